//! The parent side: [`Sandbox`] spawns the helper, sends it the profile, waits until the
//! tool runs or a layer fails, and hands back a [`SandboxedProcess`] whose stdio are pipes.
//!
//! Cleanup is owned: the per-operation root directory is removed when the process is waited
//! for, killed, times out or is dropped; dropping also closes the control socket (the helper
//! then kills the tree) and kills the helper (`kill_on_drop`). If the parent dies, the closed
//! control socket has the same effect and the helper removes the root itself.

use std::io::IoSliceMut;
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendFlags, SocketFlags,
    SocketType,
};
use tokio::process::{Child, ChildStderr, ChildStdin, ChildStdout, Command};
use tokio::task::JoinHandle;
use wor_egress::{GuardedResolver, HostAllowlist};

use crate::layer::{SandboxError, SandboxLayer};
use crate::profile::{NetworkAccess, SandboxProfile};
use crate::protocol::{CONTROL_FD, HELPER_ARG, MAX_MESSAGE, Report, Request};

/// Prefix of every per-operation root directory.
pub const ROOT_PREFIX: &str = "wor-sbx-";

/// How the sandbox is reached on this host.
#[derive(Debug, Clone)]
pub struct SandboxConfig {
    /// A binary whose `main` calls [`crate::main_if_helper`] first (`wor` itself).
    pub helper: PathBuf,
    /// Where per-operation root directories are created (created `0700` if missing).
    pub state_dir: PathBuf,
    /// The egress guard's resolver, for the proxy of profiles with network access.
    pub resolver: Arc<GuardedResolver>,
    /// Longest time from spawn to a running tool.
    pub startup_timeout: Duration,
}

/// Spawns processes in the sandbox.
#[derive(Debug, Clone)]
pub struct Sandbox {
    config: Arc<SandboxConfig>,
}

/// What the tool's stdin, stdout and stderr are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SandboxStdio {
    /// Pipes the caller reads and writes (stdio MCP servers).
    Piped,
    /// The caller's own (`wor sandbox exec`).
    Inherit,
    /// `/dev/null`.
    Null,
}

/// How a sandboxed process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SandboxExit {
    /// It exited with this status (128 + n when killed by signal n inside).
    Code(i32),
    /// The timeout elapsed; the whole tree was killed.
    TimedOut,
    /// It was killed on request; the whole tree was killed.
    Killed,
}

/// Everything a finished sandboxed process produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxOutput {
    /// How it ended.
    pub exit: SandboxExit,
    /// Its stdout.
    pub stdout: Vec<u8>,
    /// Its stderr.
    pub stderr: Vec<u8>,
}

impl Sandbox {
    /// A sandbox launcher; creates the state directory.
    pub fn new(config: SandboxConfig) -> Result<Self, SandboxError> {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&config.state_dir)
            .map_err(|error| SandboxError::StateDir {
                path: config.state_dir.clone(),
                error,
            })?;
        Ok(Self {
            config: Arc::new(config),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &SandboxConfig {
        &self.config
    }

    /// Starts `profile` in the sandbox. Returns only once every layer is applied and the tool
    /// was executed; any layer that cannot be applied is an error naming it, and nothing ran.
    /// A failure is counted in [`crate::metrics::SANDBOX_START_FAILURES`].
    pub async fn spawn(
        &self,
        profile: &SandboxProfile,
        stdio: SandboxStdio,
    ) -> Result<SandboxedProcess, SandboxError> {
        let started = self.start(profile, stdio).await;
        if let Err(error) = &started {
            crate::metrics::start_failed(error);
        }
        started
    }

    async fn start(
        &self,
        profile: &SandboxProfile,
        stdio: SandboxStdio,
    ) -> Result<SandboxedProcess, SandboxError> {
        if !profile.program.is_absolute() {
            return Err(SandboxError::Profile(format!(
                "program `{}` must be an absolute path",
                profile.program.display()
            )));
        }
        let allowlist = match &profile.network {
            NetworkAccess::None => None,
            NetworkAccess::Proxy(entries) => Some(
                HostAllowlist::parse(entries).map_err(|e| SandboxError::Profile(e.to_string()))?,
            ),
        };
        let root = TempRoot::create(&self.config.state_dir)?;
        let request = serde_json::to_vec(&Request {
            profile: profile.clone(),
            root: root.path.clone(),
        })
        .map_err(|e| SandboxError::Profile(e.to_string()))?;
        if request.len() > MAX_MESSAGE {
            return Err(SandboxError::Profile("the profile is too large".into()));
        }
        let (control, helper_end) = rustix::net::socketpair(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )
        .map_err(std::io::Error::from)?;
        let mut command = Command::new(&self.config.helper);
        command
            .arg(HELPER_ARG)
            .env_clear()
            .kill_on_drop(true)
            .stdin(stdio_for(stdio))
            .stdout(stdio_for(stdio))
            .stderr(stdio_for(stdio));
        place_control_fd(&mut command, &helper_end);
        let mut child = command
            .spawn()
            .map_err(|e| SandboxError::Helper(format!("cannot spawn the helper: {e}")))?;
        drop(helper_end);
        rustix::net::send(&control, &request, SendFlags::NOSIGNAL)
            .map_err(|e| SandboxError::Helper(format!("cannot send the profile: {e}")))?;
        let timeout = self.config.startup_timeout;
        let received = tokio::task::spawn_blocking(move || {
            let reports = receive_startup(&control, timeout);
            (control, reports)
        })
        .await;
        let (control, reports) = match received {
            Ok(received) => received,
            Err(join) => {
                let _ = child.kill().await;
                return Err(SandboxError::Helper(format!(
                    "start-up task failed: {join}"
                )));
            }
        };
        let proxy = match reports.and_then(|reports| {
            start_proxy(reports, allowlist, &self.config.resolver, &profile.program)
        }) {
            Ok(proxy) => proxy,
            Err(error) => {
                let _ = child.kill().await;
                return Err(error);
            }
        };
        Ok(SandboxedProcess {
            stdin: child.stdin.take(),
            stdout: child.stdout.take(),
            stderr: child.stderr.take(),
            child,
            control: Some(control),
            proxy,
            root: Some(root),
        })
    }

    /// Runs `profile` to completion with no stdin, collecting its output; kills the tree when
    /// `timeout` elapses.
    pub async fn output(
        &self,
        profile: &SandboxProfile,
        timeout: Duration,
    ) -> Result<SandboxOutput, SandboxError> {
        use tokio::io::AsyncReadExt;
        let mut process = self.spawn(profile, SandboxStdio::Piped).await?;
        drop(process.stdin.take());
        let mut stdout = process.stdout.take();
        let mut stderr = process.stderr.take();
        let read_out = async {
            let mut buf = Vec::new();
            if let Some(out) = stdout.as_mut() {
                let _ = out.read_to_end(&mut buf).await;
            }
            buf
        };
        let read_err = async {
            let mut buf = Vec::new();
            if let Some(err) = stderr.as_mut() {
                let _ = err.read_to_end(&mut buf).await;
            }
            buf
        };
        let (exit, stdout, stderr) =
            tokio::join!(process.wait_timeout(timeout), read_out, read_err);
        Ok(SandboxOutput {
            exit: exit?,
            stdout,
            stderr,
        })
    }
}

fn stdio_for(stdio: SandboxStdio) -> Stdio {
    match stdio {
        SandboxStdio::Piped => Stdio::piped(),
        SandboxStdio::Inherit => Stdio::inherit(),
        SandboxStdio::Null => Stdio::null(),
    }
}

#[allow(unsafe_code)]
fn place_control_fd(command: &mut Command, fd: &OwnedFd) {
    let raw = fd.as_raw_fd();
    // SAFETY: the closure runs between fork and exec in a copy of a multi-threaded process,
    // so it may only make async-signal-safe calls: it makes `dup2` or `fcntl` and nothing
    // else (no allocation, no locks). `raw` stays open in the parent until after spawn.
    unsafe {
        command.pre_exec(move || {
            let result = if raw == CONTROL_FD {
                libc::fcntl(raw, libc::F_SETFD, 0)
            } else {
                libc::dup2(raw, CONTROL_FD)
            };
            if result == -1 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Reads the helper's reports (blocking, bounded by `timeout`) until the tool runs or
/// start-up fails.
fn receive_startup(
    control: &OwnedFd,
    timeout: Duration,
) -> Result<Vec<(Report, Option<OwnedFd>)>, SandboxError> {
    use rustix::net::sockopt::{Timeout, set_socket_timeout};
    set_socket_timeout(control, Timeout::Recv, Some(timeout)).map_err(std::io::Error::from)?;
    let mut reports = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut ancillary = RecvAncillaryBuffer::new(&mut space);
        let mut iov = [IoSliceMut::new(&mut buf)];
        let msg = rustix::net::recvmsg(control, &mut iov, &mut ancillary, RecvFlags::CMSG_CLOEXEC)
            .map_err(|e| match e {
                rustix::io::Errno::AGAIN => {
                    SandboxError::Helper(format!("the sandbox did not start within {timeout:?}"))
                }
                other => SandboxError::Io(other.into()),
            })?;
        let mut fd = None;
        for message in ancillary.drain() {
            if let RecvAncillaryMessage::ScmRights(fds) = message {
                for received in fds {
                    fd.get_or_insert(received);
                }
            }
        }
        if msg.bytes == 0 {
            return Err(SandboxError::Helper(
                "the helper exited during start-up".into(),
            ));
        }
        let report: Report = buf
            .get(..msg.bytes)
            .and_then(|bytes| serde_json::from_slice(bytes).ok())
            .ok_or_else(|| SandboxError::Helper("unreadable start-up report".into()))?;
        let done = !matches!(report, Report::Listener);
        reports.push((report, fd));
        if done {
            return Ok(reports);
        }
    }
}

/// Turns the start-up reports into a result; starts the proxy on a handed-over listener.
fn start_proxy(
    reports: Vec<(Report, Option<OwnedFd>)>,
    allowlist: Option<HostAllowlist>,
    resolver: &Arc<GuardedResolver>,
    program: &Path,
) -> Result<Option<JoinHandle<()>>, SandboxError> {
    let mut listener = None;
    for (report, fd) in reports {
        match report {
            Report::Listener => listener = fd,
            Report::Running => {
                let Some(allowlist) = allowlist else {
                    return Ok(None);
                };
                let Some(fd) = listener else {
                    return Err(SandboxError::Layer {
                        layer: SandboxLayer::EgressProxy,
                        reason: "the sandbox started without the proxy listener".into(),
                    });
                };
                let listener = std::net::TcpListener::from(fd);
                listener.set_nonblocking(true)?;
                let listener = tokio::net::TcpListener::from_std(listener)?;
                let egress =
                    wor_egress::connect_proxy::ConnectProxy::new(resolver.clone(), allowlist);
                return Ok(Some(tokio::spawn(egress.serve(listener))));
            }
            Report::Failed { layer, reason } => {
                return Err(match layer {
                    Some(layer) => SandboxError::Layer { layer, reason },
                    None => SandboxError::Exec {
                        program: program.display().to_string(),
                        reason,
                    },
                });
            }
        }
    }
    Err(SandboxError::Helper(
        "start-up ended without a report".into(),
    ))
}

/// A process running in the sandbox.
#[derive(Debug)]
pub struct SandboxedProcess {
    /// The tool's stdin (with [`SandboxStdio::Piped`]).
    pub stdin: Option<ChildStdin>,
    /// The tool's stdout.
    pub stdout: Option<ChildStdout>,
    /// The tool's stderr.
    pub stderr: Option<ChildStderr>,
    child: Child,
    control: Option<OwnedFd>,
    proxy: Option<JoinHandle<()>>,
    root: Option<TempRoot>,
}

impl SandboxedProcess {
    /// The host pid of the supervising helper (not of the tool).
    pub fn helper_pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// Waits for the tool to exit, then cleans up.
    pub async fn wait(&mut self) -> Result<SandboxExit, SandboxError> {
        let status = self.child.wait().await?;
        self.cleanup();
        Ok(status
            .code()
            .map(SandboxExit::Code)
            .unwrap_or(SandboxExit::Killed))
    }

    /// Waits at most `timeout`; then kills the whole tree.
    pub async fn wait_timeout(&mut self, timeout: Duration) -> Result<SandboxExit, SandboxError> {
        match tokio::time::timeout(timeout, self.wait()).await {
            Ok(exit) => exit,
            Err(_) => {
                self.kill().await?;
                Ok(SandboxExit::TimedOut)
            }
        }
    }

    /// Kills the whole tree (the helper, hence pid 1 of the sandbox, hence every process in
    /// its pid namespace) and cleans up.
    pub async fn kill(&mut self) -> Result<(), SandboxError> {
        // Closing the lifeline makes the helper kill pid 1 and reap it; SIGKILL to the helper
        // is the backstop (pid 1 dies with it through PDEATHSIG).
        self.control.take();
        let _ = self.child.start_kill();
        let _ = self.child.wait().await?;
        self.cleanup();
        Ok(())
    }

    fn cleanup(&mut self) {
        if let Some(task) = self.proxy.take() {
            task.abort();
        }
        self.control.take();
        self.root.take();
    }
}

impl Drop for SandboxedProcess {
    fn drop(&mut self) {
        // `kill_on_drop` sends SIGKILL to the helper; the rest is `cleanup`.
        self.cleanup();
    }
}

/// A per-operation root directory, removed on drop.
#[derive(Debug)]
struct TempRoot {
    path: PathBuf,
}

impl TempRoot {
    fn create(state_dir: &Path) -> Result<Self, SandboxError> {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or_default();
        let path = state_dir.join(format!(
            "{ROOT_PREFIX}{}-{}-{nanos:08x}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&path)
            .map_err(|error| SandboxError::StateDir {
                path: state_dir.to_owned(),
                error,
            })?;
        Ok(Self { path })
    }
}

impl Drop for TempRoot {
    fn drop(&mut self) {
        // `remove_dir`, never `remove_dir_all`: the directory is only ever an empty mount
        // point here, and a recursive removal must never be able to walk into a bind mount.
        let _ = std::fs::remove_dir(&self.path);
    }
}
