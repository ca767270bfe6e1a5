//! The helper: the process the parent spawns (a re-exec of a binary that calls
//! [`main_if_helper`] first thing in `main`), which builds the sandbox and execs the tool.
//!
//! Why a re-exec rather than `pre_exec`: after `fork` in a multi-threaded (tokio) parent only
//! async-signal-safe calls are allowed, and building a sandbox needs allocation (paths,
//! Landlock rulesets, seccomp programs). The parent's `pre_exec` therefore only moves one fd
//! into place; everything else runs here, in a fresh single-threaded process, where `fork` and
//! allocation are safe.
//!
//! Process tree: the helper unshares the user (outer uid/gid mapped to 1000), pid, network,
//! IPC and UTS namespaces, then forks the sandbox's init (pid 1 of the new pid namespace),
//! which builds the mount namespace and root, applies limits, no-new-privs, Landlock and
//! seccomp, and execs the tool. The helper stays outside the pid namespace as supervisor:
//! it reports start-up to the parent, kills the tree when the parent's control socket closes,
//! removes the per-operation root and exits with the tool's status (128 + signal if killed).
//! Pid 1 has `PR_SET_PDEATHSIG(SIGKILL)`, so killing the helper kills the whole tree.

use std::ffi::OsString;
use std::fs::File;
use std::io::{IoSlice, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Component, Path, PathBuf};
use std::process::Command;

use rustix::event::{PollFd, PollFlags, poll};
use rustix::fs::{Mode, OFlags, StatVfsMountFlags};
use rustix::mount::{MountFlags, MountPropagationFlags, UnmountFlags};
use rustix::net::{
    AddressFamily, RecvFlags, SendAncillaryBuffer, SendAncillaryMessage, SendFlags, SocketFlags,
    SocketType,
};
use rustix::process::{Pid, PidfdFlags, Resource, Rlimit, Signal, WaitOptions};
use rustix::thread::UnshareFlags;

use crate::layer::SandboxLayer;
use crate::profile::{NetworkAccess, PROXY_PORT, SandboxProfile};
use crate::protocol::{CONTROL_FD, HELPER_ARG, MAX_MESSAGE, Report, Request};
use crate::seccomp;

/// Uid and gid of the tool inside its user namespace.
pub const INSIDE_ID: u32 = 1000;
/// Hostname inside.
const HOSTNAME: &[u8] = b"wor-sandbox";
/// Exit status of the helper when start-up failed (the parent has the reason).
const EXIT_SETUP_FAILED: i32 = 125;
/// Exit status when the parent went away and the tree was killed.
const EXIT_KILLED: i32 = 137;

/// If this process was started as the sandbox helper (first argument [`HELPER_ARG`]), runs it
/// and exits; otherwise returns. Call it first in `main`, before any thread is started: the
/// helper forks.
pub fn main_if_helper() {
    if std::env::args_os().nth(1) == Some(OsString::from(HELPER_ARG)) {
        std::process::exit(run());
    }
}

/// A start-up failure: the layer (none for `execve`) and why.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Failure {
    layer: Option<SandboxLayer>,
    reason: String,
}

impl Failure {
    fn at(layer: SandboxLayer, reason: impl std::fmt::Display) -> Self {
        Self {
            layer: Some(layer),
            reason: reason.to_string(),
        }
    }
}

#[allow(unsafe_code)]
fn control_fd() -> Option<OwnedFd> {
    // SAFETY: the parent's `pre_exec` placed the protocol socket at fd 3 and nothing else in
    // this freshly exec'd process refers to that number; it is owned here from now on. The
    // fstat below refuses to go on if it is not a socket.
    let fd = unsafe { OwnedFd::from_raw_fd(CONTROL_FD) };
    let stat = rustix::fs::fstat(&fd).ok()?;
    (rustix::fs::FileType::from_raw_mode(stat.st_mode) == rustix::fs::FileType::Socket)
        .then_some(fd)
}

fn run() -> i32 {
    let Some(control) = control_fd() else {
        return EXIT_SETUP_FAILED;
    };
    if rustix::io::fcntl_setfd(&control, rustix::io::FdFlags::CLOEXEC).is_err() {
        return EXIT_SETUP_FAILED;
    }
    let mut buf = vec![0u8; MAX_MESSAGE];
    let request: Request = match rustix::net::recv(&control, &mut buf, RecvFlags::empty()) {
        Ok((len, _)) => match buf.get(..len).map(serde_json::from_slice) {
            Some(Ok(request)) => request,
            _ => return EXIT_SETUP_FAILED,
        },
        Err(_) => return EXIT_SETUP_FAILED,
    };
    drop(buf);
    let root = request.root.clone();
    let code = match supervise(&control, &request) {
        Ok(code) => code,
        Err(failure) => {
            send(
                &control,
                &Report::Failed {
                    layer: failure.layer,
                    reason: failure.reason,
                },
                None,
            );
            EXIT_SETUP_FAILED
        }
    };
    // The tmpfs root was mounted in the sandbox's mount namespace only; here it is an empty
    // directory. The parent removes it too (whichever comes first).
    let _ = std::fs::remove_dir(&root);
    code
}

fn send(control: &OwnedFd, report: &Report, fd: Option<BorrowedFd<'_>>) {
    let Ok(bytes) = serde_json::to_vec(report) else {
        return;
    };
    let fds;
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut ancillary = SendAncillaryBuffer::new(&mut space);
    if let Some(fd) = fd {
        fds = [fd];
        ancillary.push(SendAncillaryMessage::ScmRights(&fds));
    }
    let _ = rustix::net::sendmsg(
        control,
        &[IoSlice::new(&bytes)],
        &mut ancillary,
        SendFlags::NOSIGNAL,
    );
}

/// Whether a doctor probe stops after `layer`.
fn probe_reached(profile: &SandboxProfile, layer: SandboxLayer) -> bool {
    profile.probe_until == Some(layer)
}

/// Runs one layer's setup, honouring the test switch; the error names the layer.
fn apply(
    profile: &SandboxProfile,
    layer: SandboxLayer,
    setup: impl FnOnce() -> Result<(), String>,
) -> Result<(), Failure> {
    if profile.simulate_unavailable == Some(layer) {
        return Err(Failure::at(
            layer,
            "unavailable on this host (simulated by the test switch)",
        ));
    }
    setup().map_err(|reason| Failure::at(layer, reason))
}

fn err(what: &str) -> impl FnOnce(rustix::io::Errno) -> String + '_ {
    move |errno| format!("{what}: {errno}")
}

#[allow(unsafe_code)]
fn unshare(flags: UnshareFlags) -> Result<(), String> {
    // SAFETY: `unshare_unsafe` is unsafe only for `CLONE_FILES`, which is never passed here,
    // and this process is single-threaded.
    unsafe { rustix::thread::unshare_unsafe(flags) }.map_err(err("unshare"))
}

#[allow(unsafe_code)]
fn fork() -> Result<Option<Pid>, String> {
    // SAFETY: the helper is single-threaded (it is a fresh exec and `main_if_helper` runs
    // before any thread is started), so the child may allocate and use any library call.
    let pid = unsafe { libc::fork() };
    match pid {
        -1 => Err(format!("fork: {}", std::io::Error::last_os_error())),
        0 => Ok(None),
        pid => Ok(Pid::from_raw(pid)),
    }
}

fn write_file(path: &str, content: &str) -> Result<(), String> {
    std::fs::write(path, content).map_err(|e| format!("writing {path}: {e}"))
}

/// The helper's part: namespaces, fork, report, supervise. Returns the exit status.
fn supervise(control: &OwnedFd, request: &Request) -> Result<i32, Failure> {
    let profile = &request.profile;
    let uid = rustix::process::getuid().as_raw();
    let gid = rustix::process::getgid().as_raw();
    apply(profile, SandboxLayer::UserNamespace, || {
        unshare(UnshareFlags::NEWUSER)?;
        write_file("/proc/self/setgroups", "deny")?;
        write_file("/proc/self/uid_map", &format!("{INSIDE_ID} {uid} 1\n"))?;
        write_file("/proc/self/gid_map", &format!("{INSIDE_ID} {gid} 1\n"))
    })?;
    for (layer, flag) in [
        (SandboxLayer::PidNamespace, UnshareFlags::NEWPID),
        (SandboxLayer::NetworkNamespace, UnshareFlags::NEWNET),
        (SandboxLayer::IpcNamespace, UnshareFlags::NEWIPC),
        (SandboxLayer::UtsNamespace, UnshareFlags::NEWUTS),
    ] {
        apply(profile, layer, || unshare(flag))?;
    }
    let (status_r, status_w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)
        .map_err(|e| Failure::at(SandboxLayer::PidNamespace, e))?;
    let (alive_r, alive_w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)
        .map_err(|e| Failure::at(SandboxLayer::PidNamespace, e))?;
    let child = match fork().map_err(|e| Failure::at(SandboxLayer::PidNamespace, e))? {
        None => {
            drop(status_r);
            drop(alive_w);
            let outcome = sandbox_init(control, request, &alive_r);
            // Only a probe or a failure returns here: success ends in `execve`.
            let code = match outcome {
                Ok(()) => 0,
                Err(failure) => {
                    let mut status = File::from(status_w);
                    let _ = serde_json::to_vec(&failure).map(|bytes| status.write_all(&bytes));
                    EXIT_SETUP_FAILED
                }
            };
            std::process::exit(code);
        }
        Some(pid) => pid,
    };
    drop(status_w);
    drop(alive_r);
    let mut report = Vec::new();
    let _ = File::from(status_r).read_to_end(&mut report);
    if !report.is_empty() {
        let _ = rustix::process::waitpid(Some(child), WaitOptions::empty());
        let failure = serde_json::from_slice(&report).unwrap_or_else(|_| Failure {
            layer: None,
            reason: "the sandbox init sent an unreadable report".into(),
        });
        return Err(failure);
    }
    send(control, &Report::Running, None);
    // The tool owns stdio now: the helper lets go of it so EOF reaches the parent when the
    // tool closes its ends.
    if let Ok(null) = rustix::fs::open("/dev/null", OFlags::RDWR | OFlags::CLOEXEC, Mode::empty()) {
        let _ = rustix::stdio::dup2_stdin(&null);
        let _ = rustix::stdio::dup2_stdout(&null);
        let _ = rustix::stdio::dup2_stderr(&null);
    }
    let code = wait_or_kill(control, child);
    drop(alive_w);
    Ok(code)
}

/// Waits for the sandbox init; kills it (and with it the whole pid namespace) when the
/// parent closes the control socket.
fn wait_or_kill(control: &OwnedFd, child: Pid) -> i32 {
    let pidfd = rustix::process::pidfd_open(child, PidfdFlags::empty()).ok();
    loop {
        let mut fds = vec![PollFd::new(control, PollFlags::IN)];
        if let Some(pidfd) = &pidfd {
            fds.push(PollFd::new(pidfd, PollFlags::IN));
        }
        if poll(&mut fds, None).is_err() {
            continue;
        }
        let parent_gone = fds.first().is_some_and(|fd| {
            let events = fd.revents();
            events.intersects(PollFlags::HUP | PollFlags::ERR)
                || (events.contains(PollFlags::IN) && {
                    let mut byte = [0u8; 1];
                    matches!(
                        rustix::net::recv(control, &mut byte, RecvFlags::DONTWAIT),
                        Ok((0, _))
                    )
                })
        });
        if parent_gone {
            let _ = rustix::process::kill_process(child, Signal::KILL);
            let _ = rustix::process::waitpid(Some(child), WaitOptions::empty());
            return EXIT_KILLED;
        }
        let exited = pidfd.is_none() || fds.get(1).is_some_and(|fd| !fd.revents().is_empty());
        if exited {
            return match rustix::process::waitpid(Some(child), WaitOptions::empty()) {
                Ok(Some((_, status))) => status
                    .exit_status()
                    .or_else(|| {
                        status
                            .terminating_signal()
                            .map(|s| 128_i32.saturating_add(s))
                    })
                    .unwrap_or(EXIT_SETUP_FAILED),
                _ => EXIT_SETUP_FAILED,
            };
        }
    }
}

/// The sandbox init's part (pid 1 of the new pid namespace): everything after the fork.
/// Returns only for a doctor probe (`Ok`) or a failure.
fn sandbox_init(control: &OwnedFd, request: &Request, alive: &OwnedFd) -> Result<(), Failure> {
    let profile = &request.profile;
    for layer in [
        SandboxLayer::UserNamespace,
        SandboxLayer::PidNamespace,
        SandboxLayer::NetworkNamespace,
        SandboxLayer::IpcNamespace,
        SandboxLayer::UtsNamespace,
    ] {
        if probe_reached(profile, layer) {
            return Ok(());
        }
    }
    // Die with the helper; and if it is already gone, stop here.
    rustix::process::set_parent_process_death_signal(Some(Signal::KILL))
        .map_err(|e| Failure::at(SandboxLayer::PidNamespace, e))?;
    let mut fds = [PollFd::new(alive, PollFlags::IN)];
    let zero = rustix::time::Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    if poll(&mut fds, Some(&zero)).is_ok_and(|n| n > 0) {
        return Err(Failure::at(SandboxLayer::PidNamespace, "the helper exited"));
    }
    rustix::system::sethostname(HOSTNAME)
        .map_err(|e| Failure::at(SandboxLayer::UtsNamespace, e))?;

    apply(profile, SandboxLayer::MountNamespace, || {
        unshare(UnshareFlags::NEWNS)?;
        rustix::mount::mount_change(
            "/",
            MountPropagationFlags::PRIVATE | MountPropagationFlags::REC,
        )
        .map_err(err("making / private"))
    })?;
    if probe_reached(profile, SandboxLayer::MountNamespace) {
        return Ok(());
    }
    let root = &request.root;
    apply(profile, SandboxLayer::RootFilesystem, || {
        build_root(root, profile)
    })?;
    apply(profile, SandboxLayer::PrivateTmp, || {
        mount_tmp(root, profile.tmp_size_bytes)
    })?;
    apply(profile, SandboxLayer::RootFilesystem, || pivot(root))?;
    if probe_reached(profile, SandboxLayer::RootFilesystem)
        || probe_reached(profile, SandboxLayer::PrivateTmp)
    {
        return Ok(());
    }
    let proxy = matches!(profile.network, NetworkAccess::Proxy(_));
    apply(profile, SandboxLayer::EgressProxy, || {
        if proxy {
            proxy_listener(control)
        } else {
            Ok(())
        }
    })?;
    if probe_reached(profile, SandboxLayer::EgressProxy) {
        return Ok(());
    }
    apply(profile, SandboxLayer::ResourceLimits, || {
        set_limits(profile)
    })?;
    if probe_reached(profile, SandboxLayer::ResourceLimits) {
        return Ok(());
    }
    apply(profile, SandboxLayer::NoNewPrivileges, || {
        rustix::thread::set_no_new_privs(true).map_err(err("prctl"))?;
        match rustix::thread::no_new_privs() {
            Ok(true) => Ok(()),
            _ => Err("no_new_privs did not stick".into()),
        }
    })?;
    if probe_reached(profile, SandboxLayer::NoNewPrivileges) {
        return Ok(());
    }
    apply(profile, SandboxLayer::Landlock, || landlock(profile, proxy))?;
    if probe_reached(profile, SandboxLayer::Landlock) {
        return Ok(());
    }
    apply(profile, SandboxLayer::Seccomp, seccomp::install)?;
    if probe_reached(profile, SandboxLayer::Seccomp) {
        return Ok(());
    }
    let mut command = Command::new(&profile.program);
    command
        .args(&profile.args)
        .env_clear()
        .envs(profile.env.iter().map(|(k, v)| (k, v)))
        .current_dir("/tmp");
    if proxy {
        let url = format!("http://127.0.0.1:{PROXY_PORT}");
        for name in ["HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy"] {
            command.env(name, &url);
        }
    }
    let error = command.exec();
    Err(Failure {
        layer: None,
        reason: error.to_string(),
    })
}

/// `target` inside `root`, refusing relative targets and `..`.
fn inside(root: &Path, target: &Path) -> Result<PathBuf, String> {
    if !target.is_absolute()
        || target
            .components()
            .any(|c| matches!(c, Component::ParentDir | Component::CurDir))
    {
        return Err(format!(
            "bind target `{}` must be an absolute path without `.` or `..`",
            target.display()
        ));
    }
    let relative = target.strip_prefix("/").map_err(|e| e.to_string())?;
    Ok(root.join(relative))
}

fn io(what: &Path) -> impl FnOnce(std::io::Error) -> String + '_ {
    move |e| format!("{}: {e}", what.display())
}

/// Flags a read-only bind remount must keep: the kernel refuses to clear locked flags of a
/// mount inherited from a more privileged namespace.
fn kept_flags(path: &Path) -> MountFlags {
    let mut flags = MountFlags::empty();
    if let Ok(stat) = rustix::fs::statvfs(path) {
        let have = stat.f_flag;
        for (st, ms) in [
            (StatVfsMountFlags::NOEXEC, MountFlags::NOEXEC),
            (StatVfsMountFlags::NOATIME, MountFlags::NOATIME),
            (StatVfsMountFlags::NODIRATIME, MountFlags::NODIRATIME),
        ] {
            if have.contains(st) {
                flags |= ms;
            }
        }
    }
    flags
}

fn bind_read_only(source: &Path, target: &Path, extra: MountFlags) -> Result<(), String> {
    rustix::mount::mount_bind(source, target)
        .map_err(|e| format!("bind {}: {e}", source.display()))?;
    let flags = MountFlags::BIND | MountFlags::RDONLY | MountFlags::NOSUID | extra;
    rustix::mount::mount_remount(target, flags | kept_flags(target), "")
        .map_err(|e| format!("read-only remount of {}: {e}", target.display()))
}

/// The tmpfs root with the profile's binds, `/proc` and a minimal `/dev`.
fn build_root(root: &Path, profile: &SandboxProfile) -> Result<(), String> {
    rustix::mount::mount(
        "tmpfs",
        root,
        "tmpfs",
        MountFlags::NOSUID | MountFlags::NODEV,
        c"size=1m,mode=0755",
    )
    .map_err(err("mounting the root tmpfs"))?;
    for bind in &profile.binds {
        let target = inside(root, &bind.target)?;
        let meta = bind.source.symlink_metadata().map_err(io(&bind.source))?;
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent).map_err(io(parent))?;
        }
        if meta.is_symlink() {
            // Merged-/usr links (`/bin -> usr/bin`) are recreated, not followed.
            let link = std::fs::read_link(&bind.source).map_err(io(&bind.source))?;
            std::os::unix::fs::symlink(&link, &target).map_err(io(&target))?;
            continue;
        }
        if meta.is_dir() {
            std::fs::create_dir_all(&target).map_err(io(&target))?;
        } else {
            File::create(&target).map_err(io(&target))?;
        }
        bind_read_only(&bind.source, &target, MountFlags::NODEV)?;
    }
    let dev = root.join("dev");
    std::fs::create_dir_all(&dev).map_err(io(&dev))?;
    for node in ["null", "zero", "full", "random", "urandom"] {
        let source = Path::new("/dev").join(node);
        let target = dev.join(node);
        File::create(&target).map_err(io(&target))?;
        // Device nodes need `dev`; a read-only bind still lets /dev/null be written.
        bind_read_only(&source, &target, MountFlags::NOEXEC)?;
    }
    for (name, link) in [
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ] {
        let path = dev.join(name);
        std::os::unix::fs::symlink(link, &path).map_err(io(&path))?;
    }
    let proc = root.join("proc");
    std::fs::create_dir_all(&proc).map_err(io(&proc))?;
    rustix::mount::mount(
        "proc",
        &proc,
        "proc",
        MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC,
        None,
    )
    .map_err(err("mounting /proc"))
}

fn mount_tmp(root: &Path, size: u64) -> Result<(), String> {
    let tmp = root.join("tmp");
    std::fs::create_dir_all(&tmp).map_err(io(&tmp))?;
    let data =
        std::ffi::CString::new(format!("size={size},mode=1777")).map_err(|e| e.to_string())?;
    rustix::mount::mount(
        "tmpfs",
        &tmp,
        "tmpfs",
        MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC,
        data.as_c_str(),
    )
    .map_err(err("mounting /tmp"))
}

/// `pivot_root` into `root`, detach the old root, make `/` read-only.
fn pivot(root: &Path) -> Result<(), String> {
    rustix::process::chdir(root).map_err(err("chdir to the new root"))?;
    rustix::process::pivot_root(".", ".").map_err(err("pivot_root"))?;
    rustix::mount::unmount(".", UnmountFlags::DETACH).map_err(err("detaching the old root"))?;
    rustix::process::chdir("/").map_err(err("chdir /"))?;
    rustix::mount::mount_remount(
        "/",
        MountFlags::RDONLY | MountFlags::NOSUID | MountFlags::NODEV,
        "",
    )
    .map_err(err("read-only remount of /"))
}

/// Brings loopback up and hands a listener on 127.0.0.1:[`PROXY_PORT`] (inside this network
/// namespace) to the parent, whose egress proxy accepts on it.
fn proxy_listener(control: &OwnedFd) -> Result<(), String> {
    loopback_up()?;
    let listener = rustix::net::socket_with(
        AddressFamily::INET,
        SocketType::STREAM,
        SocketFlags::CLOEXEC,
        None,
    )
    .map_err(err("socket"))?;
    let addr = std::net::SocketAddrV4::new(std::net::Ipv4Addr::LOCALHOST, PROXY_PORT);
    rustix::net::bind(&listener, &addr).map_err(err("bind 127.0.0.1"))?;
    rustix::net::listen(&listener, 64).map_err(err("listen"))?;
    send(control, &Report::Listener, Some(listener.as_fd()));
    Ok(())
}

/// `ip link set lo up` over rtnetlink: loopback is always ifindex 1 in a new namespace.
fn loopback_up() -> Result<(), String> {
    const RTM_NEWLINK: u16 = 16;
    const NLM_F_REQUEST: u16 = 1;
    const NLM_F_ACK: u16 = 4;
    const NLMSG_ERROR: u16 = 2;
    const IFF_UP: u32 = 1;
    let socket = rustix::net::socket_with(
        AddressFamily::NETLINK,
        SocketType::RAW,
        SocketFlags::CLOEXEC,
        None,
    )
    .map_err(err("netlink socket"))?;
    let mut msg = Vec::with_capacity(32);
    msg.extend_from_slice(&32u32.to_ne_bytes()); // nlmsg_len
    msg.extend_from_slice(&RTM_NEWLINK.to_ne_bytes());
    msg.extend_from_slice(&(NLM_F_REQUEST | NLM_F_ACK).to_ne_bytes());
    msg.extend_from_slice(&1u32.to_ne_bytes()); // seq
    msg.extend_from_slice(&0u32.to_ne_bytes()); // pid: the kernel
    msg.extend_from_slice(&[0, 0]); // ifi_family, pad
    msg.extend_from_slice(&0u16.to_ne_bytes()); // ifi_type
    msg.extend_from_slice(&1i32.to_ne_bytes()); // ifi_index: lo
    msg.extend_from_slice(&IFF_UP.to_ne_bytes()); // ifi_flags
    msg.extend_from_slice(&IFF_UP.to_ne_bytes()); // ifi_change
    rustix::net::send(&socket, &msg, SendFlags::empty()).map_err(err("netlink send"))?;
    let mut answer = [0u8; 256];
    let (len, _) =
        rustix::net::recv(&socket, &mut answer, RecvFlags::empty()).map_err(err("netlink recv"))?;
    let field = |range: std::ops::Range<usize>| answer.get(..len).and_then(|a| a.get(range));
    let kind = field(4..6)
        .and_then(|b| b.try_into().ok())
        .map(u16::from_ne_bytes);
    let code = field(16..20)
        .and_then(|b| b.try_into().ok())
        .map(i32::from_ne_bytes);
    match (kind, code) {
        (Some(NLMSG_ERROR), Some(0)) => Ok(()),
        (Some(NLMSG_ERROR), Some(code)) => Err(format!(
            "bringing loopback up: {}",
            std::io::Error::from_raw_os_error(code.saturating_neg())
        )),
        _ => Err("bringing loopback up: unexpected netlink answer".into()),
    }
}

fn set_limits(profile: &SandboxProfile) -> Result<(), String> {
    let limits = profile.limits;
    for (resource, value) in [
        (Resource::As, limits.address_space_bytes),
        (Resource::Cpu, limits.cpu_seconds),
        (Resource::Nofile, limits.open_files),
        (Resource::Nproc, limits.processes),
        (Resource::Fsize, limits.file_size_bytes),
        (Resource::Core, 0),
    ] {
        rustix::process::setrlimit(
            resource,
            Rlimit {
                current: Some(value),
                maximum: Some(value),
            },
        )
        .map_err(|e| format!("setrlimit {resource:?}: {e}"))?;
    }
    Ok(())
}

fn landlock(profile: &SandboxProfile, proxy: bool) -> Result<(), String> {
    use landlock::{
        ABI, Access, AccessFs, AccessNet, BitFlags, CompatLevel, Compatible, NetPort, PathBeneath,
        PathFd, Ruleset, RulesetAttr, RulesetCreatedAttr, RulesetStatus, Scope,
    };
    // V6: filesystem rights incl. truncate and device ioctls, TCP bind/connect, and scoping
    // of signals and abstract unix sockets. Required in full: no best-effort downgrade.
    let abi = ABI::V6;
    let e = |e: landlock::RulesetError| e.to_string();
    let rule = |path: &Path, access: BitFlags<AccessFs>| -> Result<_, String> {
        let fd = PathFd::new(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let access = if path.is_dir() {
            access
        } else {
            access & AccessFs::from_file(abi)
        };
        Ok(PathBeneath::new(fd, access))
    };
    let read = AccessFs::ReadFile | AccessFs::ReadDir;
    let mut ruleset = Ruleset::default()
        .set_compatibility(CompatLevel::HardRequirement)
        .handle_access(AccessFs::from_all(abi))
        .map_err(e)?
        .handle_access(AccessNet::from_all(abi))
        .map_err(e)?
        .scope(Scope::from_all(abi))
        .map_err(e)?
        .create()
        .map_err(e)?
        .add_rule(rule(Path::new("/"), read)?)
        .map_err(e)?;
    for bind in &profile.binds {
        if bind.source.is_symlink() {
            continue;
        }
        ruleset = ruleset
            .add_rule(rule(&bind.target, AccessFs::from_read(abi))?)
            .map_err(e)?;
    }
    for node in [
        "/dev/null",
        "/dev/zero",
        "/dev/full",
        "/dev/random",
        "/dev/urandom",
    ] {
        ruleset = ruleset
            .add_rule(rule(
                Path::new(node),
                AccessFs::ReadFile | AccessFs::WriteFile,
            )?)
            .map_err(e)?;
    }
    let tmp = AccessFs::from_all(abi)
        & !(AccessFs::Execute | AccessFs::MakeChar | AccessFs::MakeBlock | AccessFs::IoctlDev);
    ruleset = ruleset.add_rule(rule(Path::new("/tmp"), tmp)?).map_err(e)?;
    if proxy {
        ruleset = ruleset
            .add_rule(NetPort::new(PROXY_PORT, AccessNet::ConnectTcp))
            .map_err(e)?;
    }
    let status = ruleset.restrict_self().map_err(e)?;
    if status.ruleset != RulesetStatus::FullyEnforced {
        return Err(format!("not fully enforced: {:?}", status.ruleset));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bind_targets_must_be_absolute_and_plain() {
        let root = Path::new("/r");
        assert_eq!(
            inside(root, Path::new("/usr/bin")).unwrap(),
            Path::new("/r/usr/bin")
        );
        assert!(inside(root, Path::new("usr")).is_err());
        assert!(inside(root, Path::new("/usr/../etc")).is_err());
    }
}
