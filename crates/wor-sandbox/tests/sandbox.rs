//! The sandbox end to end: real processes, each escape attempt made from inside and its
//! failure asserted; fail-closed start-up; cleanup after every way a process can end.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic,
    reason = "tests fail loudly"
)]

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use wor_egress::{EgressPolicy, GuardedResolver, StaticResolver};
use wor_sandbox::{
    Bind, NetworkAccess, ROOT_PREFIX, Sandbox, SandboxConfig, SandboxError, SandboxExit,
    SandboxLayer, SandboxOutput, SandboxProfile, SandboxStdio,
};

const HELPER: &str = env!("CARGO_BIN_EXE_wor-sandbox-helper");
const TIMEOUT: Duration = Duration::from_secs(20);

fn sandbox_with(state: &Path, resolver: GuardedResolver) -> Sandbox {
    Sandbox::new(SandboxConfig {
        helper: HELPER.into(),
        state_dir: state.to_path_buf(),
        resolver: Arc::new(resolver),
        startup_timeout: Duration::from_secs(10),
    })
    .unwrap()
}

fn sandbox(state: &Path) -> Sandbox {
    sandbox_with(
        state,
        GuardedResolver::new(
            Arc::new(StaticResolver::new()),
            Arc::new(EgressPolicy::development()),
        ),
    )
}

fn sh(script: &str) -> SandboxProfile {
    SandboxProfile::new("/bin/sh").args(["-c", script])
}

async fn run(sandbox: &Sandbox, profile: &SandboxProfile) -> SandboxOutput {
    sandbox.output(profile, TIMEOUT).await.unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[tokio::test]
async fn a_command_runs_and_its_output_and_status_come_back() {
    let dir = tempfile::tempdir().unwrap();
    let sandbox = sandbox(dir.path());
    let out = run(
        &sandbox,
        &sh("echo hello; id -u; hostname; echo err >&2; exit 7"),
    )
    .await;
    assert_eq!(out.exit, SandboxExit::Code(7), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "hello\n1000\nwor-sandbox\n");
    assert_eq!(text(&out.stderr), "err\n");
}

#[tokio::test]
async fn secrets_and_the_data_dir_are_not_visible() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir(&data).unwrap();
    std::fs::write(data.join("wor.db"), "the server's data").unwrap();
    let sandbox = sandbox(&dir.path().join("state"));
    let script = format!(
        "cat /etc/shadow; echo shadow=$?; cat {0}/wor.db; echo db=$?; ls {0}; echo ls=$?; ls /etc",
        data.display()
    );
    let out = run(&sandbox, &sh(&script)).await;
    let stdout = text(&out.stdout);
    assert!(stdout.contains("shadow=1"), "{stdout}");
    assert!(stdout.contains("db=1"), "{stdout}");
    assert!(!stdout.contains("the server's data"), "{stdout}");
    assert!(stdout.contains("ls=2"), "{stdout}");
    // Only the dynamic linker cache is bound from /etc.
    assert!(stdout.trim_end().ends_with("ld.so.cache"), "{stdout}");
}

#[tokio::test]
async fn only_tmp_is_writable_and_nothing_written_there_executes() {
    let dir = tempfile::tempdir().unwrap();
    let sandbox = sandbox(dir.path());
    let script = "echo x > /x; echo root=$?; echo x > /usr/x; echo usr=$?; \
                  echo x > /proc/x; echo proc=$?; \
                  echo data > /tmp/f && cat /tmp/f; \
                  cp /bin/true /tmp/t && chmod +x /tmp/t && echo copied; /tmp/t; echo exec=$?";
    let out = run(&sandbox, &sh(script)).await;
    let stdout = text(&out.stdout);
    for expected in ["root=2", "usr=2", "proc=2", "data", "copied", "exec=126"] {
        assert!(stdout.contains(expected), "{expected} in {stdout}");
    }
    assert!(
        text(&out.stderr).contains("Permission denied"),
        "{}",
        text(&out.stderr)
    );
}

#[tokio::test]
async fn tmp_is_size_limited_and_limits_apply() {
    let dir = tempfile::tempdir().unwrap();
    let sandbox = sandbox(dir.path());
    let mut profile = sh(
        "head -c 4194304 /dev/zero > /tmp/big; echo write=$?; ulimit -n; \
                          grep -E '^(NoNewPrivs|Seccomp):' /proc/self/status",
    );
    profile.tmp_size_bytes = 1 << 20;
    let out = run(&sandbox, &profile).await;
    let stdout = text(&out.stdout);
    assert!(stdout.contains("write=1"), "{stdout}");
    assert!(stdout.contains("\n256\n"), "{stdout}");
    assert!(stdout.contains("NoNewPrivs:\t1"), "{stdout}");
    assert!(stdout.contains("Seccomp:\t2"), "{stdout}");
}

#[tokio::test]
async fn host_processes_are_invisible_and_unreachable() {
    let dir = tempfile::tempdir().unwrap();
    let sandbox = sandbox(dir.path());
    let host_pid = std::process::id();
    let script = format!(
        "kill -0 {host_pid}; echo kill=$?; ls /proc | grep -E '^[0-9]+$' | tr '\\n' ' '; echo; \
         cat /proc/1/cmdline | tr '\\0' ' '; echo"
    );
    let out = run(&sandbox, &sh(&script)).await;
    let stdout = text(&out.stdout);
    let mut lines = stdout.lines();
    assert_eq!(lines.next(), Some("kill=1"), "{stdout}");
    let pids: Vec<u32> = lines
        .next()
        .unwrap()
        .split_whitespace()
        .map(|p| p.parse().unwrap())
        .collect();
    assert!(!pids.is_empty() && pids.iter().all(|&p| p < 10), "{pids:?}");
    assert!(!pids.contains(&host_pid));
    assert!(lines.next().unwrap().starts_with("/bin/sh -c"), "{stdout}");
}

#[tokio::test]
async fn ptrace_mount_and_new_namespaces_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let sandbox = sandbox(dir.path());
    let script = "strace -o /dev/null /bin/true; echo strace=$?; \
                  mount -t tmpfs none /tmp; echo mount=$?; \
                  unshare -U /bin/true; echo unshare=$?; \
                  unshare -n /bin/true; echo unshare_net=$?";
    let out = run(&sandbox, &sh(script)).await;
    let stdout = text(&out.stdout);
    let stderr = text(&out.stderr);
    for refused in ["strace=0", "mount=0", "unshare=0", "unshare_net=0"] {
        assert!(!stdout.contains(refused), "{refused}: {stdout} {stderr}");
    }
    assert!(stdout.contains("strace="), "{stdout}");
    assert!(stderr.contains("Operation not permitted"), "{stderr}");
}

#[tokio::test]
async fn only_declared_variables_are_in_the_environment() {
    assert!(
        std::env::var_os("PATH").is_some(),
        "the host test process has a PATH"
    );
    let dir = tempfile::tempdir().unwrap();
    let sandbox = sandbox(dir.path());
    let profile = SandboxProfile::new("/usr/bin/env").env("DECLARED", "yes");
    let out = run(&sandbox, &profile).await;
    assert_eq!(text(&out.stdout), "DECLARED=yes\n");
}

#[tokio::test]
async fn without_network_access_nothing_is_reachable() {
    let dir = tempfile::tempdir().unwrap();
    let sandbox = sandbox(dir.path());
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let port = listener.local_addr().unwrap().port();
    let script = format!(
        "echo hi > /dev/tcp/127.0.0.1/{port}; echo tcp=$?; \
         curl -sS -m 2 http://1.1.1.1/; echo curl=$?"
    );
    let out = run(
        &sandbox,
        &SandboxProfile::new("/bin/bash").args(["-c", &script]),
    )
    .await;
    let stdout = text(&out.stdout);
    assert!(stdout.contains("tcp=1"), "{stdout} {}", text(&out.stderr));
    assert!(!stdout.contains("curl=0"), "{stdout}");
    assert_eq!(
        listener.accept().map_err(|e| e.kind()).err(),
        Some(std::io::ErrorKind::WouldBlock),
        "the host listener must see no connection"
    );
}

/// A loopback HTTP server answering `hello`, counting its connections.
fn counting_server(ip: &str) -> (u16, Arc<std::sync::atomic::AtomicUsize>) {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind((ip, 0)).unwrap();
    let port = listener.local_addr().unwrap().port();
    let count = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen = count.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let mut buf = [0u8; 1024];
            let _ = stream.read(&mut buf);
            let _ = stream.write_all(
                b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello",
            );
        }
    });
    (port, count)
}

#[tokio::test]
async fn with_an_allowlist_only_allowed_hosts_are_reachable_through_the_proxy() {
    use std::sync::atomic::Ordering;
    let (allowed_port, allowed_hits) = counting_server("127.0.0.1");
    let (refused_port, refused_hits) = counting_server("127.0.0.2");
    let mut names = StaticResolver::new();
    names.insert("allowed.test", "127.0.0.1".parse().unwrap());
    names.insert("other.test", "127.0.0.1".parse().unwrap());
    names.insert("refused.test", "127.0.0.2".parse().unwrap());
    let policy = EgressPolicy::development()
        .with_allowed_cidrs(["127.0.0.1/32".parse().unwrap()])
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let sandbox = sandbox_with(
        dir.path(),
        GuardedResolver::new(Arc::new(names), Arc::new(policy)),
    );
    let script = format!(
        "curl -sS -p http://allowed.test:{allowed_port}/; echo; echo allowed=$?; \
         curl -sS -p http://other.test:{allowed_port}/; echo other=$?; \
         curl -sS -p http://refused.test:{refused_port}/; echo refused=$?; \
         curl -sS --noproxy '*' -m 2 http://127.0.0.1:{allowed_port}/; echo direct=$?"
    );
    let profile = sh(&script).network(NetworkAccess::Proxy(vec![
        "allowed.test".into(),
        "refused.test".into(),
    ]));
    let out = run(&sandbox, &profile).await;
    let stdout = text(&out.stdout);
    let stderr = text(&out.stderr);
    assert!(stdout.starts_with("hello\nallowed=0"), "{stdout} {stderr}");
    for refused in ["other=0", "refused=0", "direct=0"] {
        assert!(!stdout.contains(refused), "{refused}: {stdout} {stderr}");
    }
    assert!(stderr.contains("403"), "{stderr}");
    assert_eq!(
        allowed_hits.load(Ordering::SeqCst),
        1,
        "only the allowed tunnel"
    );
    assert_eq!(
        refused_hits.load(Ordering::SeqCst),
        0,
        "a refused address is never dialled"
    );
}

#[tokio::test]
async fn every_layer_fails_closed_and_the_error_names_it() {
    let dir = tempfile::tempdir().unwrap();
    let sandbox = sandbox(dir.path());
    for layer in SandboxLayer::ALL {
        let mut profile = sh("echo ran");
        if layer == SandboxLayer::EgressProxy {
            profile.network = NetworkAccess::Proxy(vec!["example.com".into()]);
        }
        profile.simulate_unavailable = Some(layer);
        match sandbox.spawn(&profile, SandboxStdio::Piped).await {
            Err(SandboxError::Layer {
                layer: failed,
                reason,
            }) => {
                assert_eq!(failed, layer, "{reason}");
                assert!(reason.contains("simulated"), "{reason}");
            }
            other => panic!("{layer}: expected a refusal, got {other:?}"),
        }
    }
    assert_eq!(roots(dir.path()), 0);
}

#[tokio::test]
async fn a_real_setup_failure_refuses_to_start() {
    let dir = tempfile::tempdir().unwrap();
    let sandbox = sandbox(dir.path());
    let profile = sh("echo ran").bind(Bind::same("/nonexistent/tool/runtime"));
    let error = sandbox
        .spawn(&profile, SandboxStdio::Piped)
        .await
        .unwrap_err();
    assert!(
        matches!(
            &error,
            SandboxError::Layer {
                layer: SandboxLayer::RootFilesystem,
                ..
            }
        ),
        "{error}"
    );
    let missing = SandboxProfile::new("/usr/bin/not-there");
    let error = sandbox
        .spawn(&missing, SandboxStdio::Piped)
        .await
        .unwrap_err();
    assert!(matches!(&error, SandboxError::Exec { .. }), "{error}");
    assert_eq!(roots(dir.path()), 0);
}

fn roots(state: &Path) -> usize {
    std::fs::read_dir(state)
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .filter(|e| e.file_name().to_string_lossy().starts_with(ROOT_PREFIX))
                .count()
        })
        .unwrap_or(0)
}

/// Host processes whose command line contains `marker`.
fn processes(marker: &str) -> usize {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().parse::<u32>().is_ok())
        .filter(|e| {
            std::fs::read(e.path().join("cmdline"))
                .map(|c| String::from_utf8_lossy(&c).contains(marker))
                .unwrap_or(false)
        })
        .count()
}

async fn eventually(what: &str, check: impl Fn() -> bool) {
    for _ in 0..100 {
        if check() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{what}");
}

fn marker() -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(1);
    format!(
        "1000.{}{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    )
}

/// A tool that starts a grandchild and waits: the whole tree must go.
fn sleepers(marker: &str) -> SandboxProfile {
    sh(&format!("sleep {marker} & sleep {marker}; echo done"))
}

#[tokio::test]
async fn success_and_failure_leave_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let sandbox = sandbox(dir.path());
    assert_eq!(run(&sandbox, &sh("true")).await.exit, SandboxExit::Code(0));
    assert_eq!(
        run(&sandbox, &sh("exit 3")).await.exit,
        SandboxExit::Code(3)
    );
    assert_eq!(roots(dir.path()), 0);
}

#[tokio::test]
async fn a_timeout_kills_the_whole_tree_and_removes_the_root() {
    let dir = tempfile::tempdir().unwrap();
    let sandbox = sandbox(dir.path());
    let marker = marker();
    let out = sandbox
        .output(&sleepers(&marker), Duration::from_millis(1500))
        .await
        .unwrap();
    assert_eq!(out.exit, SandboxExit::TimedOut);
    assert!(!text(&out.stdout).contains("done"));
    eventually("no sleeper survives the timeout", || {
        processes(&marker) == 0
    })
    .await;
    assert_eq!(roots(dir.path()), 0);
}

#[tokio::test]
async fn kill_and_drop_kill_the_whole_tree_and_remove_the_root() {
    let dir = tempfile::tempdir().unwrap();
    let sandbox = sandbox(dir.path());
    for by_drop in [false, true] {
        let marker = marker();
        let mut process = sandbox
            .spawn(&sleepers(&marker), SandboxStdio::Null)
            .await
            .unwrap();
        eventually("both sleepers run", || processes(&marker) >= 2).await;
        assert_eq!(roots(dir.path()), 1);
        if by_drop {
            drop(process);
        } else {
            process.kill().await.unwrap();
        }
        eventually("no sleeper survives", || processes(&marker) == 0).await;
        eventually("the root is removed", || roots(dir.path()) == 0).await;
    }
}

#[tokio::test]
async fn stdio_is_a_pipe_pair_for_json_rpc() {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
    let dir = tempfile::tempdir().unwrap();
    let sandbox = sandbox(dir.path());
    let mut process = sandbox
        .spawn(
            &sh("while read line; do echo \"got $line\"; done"),
            SandboxStdio::Piped,
        )
        .await
        .unwrap();
    let mut stdin = process.stdin.take().unwrap();
    let mut lines = BufReader::new(process.stdout.take().unwrap()).lines();
    for request in ["{\"id\":1}", "{\"id\":2}"] {
        stdin
            .write_all(format!("{request}\n").as_bytes())
            .await
            .unwrap();
        assert_eq!(
            lines.next_line().await.unwrap().unwrap(),
            format!("got {request}")
        );
    }
    drop(stdin);
    assert_eq!(process.wait().await.unwrap(), SandboxExit::Code(0));
    assert_eq!(roots(dir.path()), 0);
}

#[tokio::test]
async fn doctor_probes_every_layer() {
    let dir = tempfile::tempdir().unwrap();
    let sandbox = sandbox(dir.path());
    let reports = wor_sandbox::doctor(&sandbox).await;
    assert_eq!(reports.len(), SandboxLayer::ALL.len());
    for report in &reports {
        assert!(report.supported, "{report:?}");
    }
    assert_eq!(roots(dir.path()), 0);
}

#[test]
fn a_state_directory_that_cannot_be_made_is_named_with_the_way_out() {
    let dir = tempfile::tempdir().unwrap();
    // Under a file: no directory can be made there.
    let file = dir.path().join("a-file");
    std::fs::write(&file, "").unwrap();
    let state = file.join("state");
    let Err(refused) = Sandbox::new(SandboxConfig {
        helper: HELPER.into(),
        state_dir: state.clone(),
        resolver: Arc::new(GuardedResolver::new(
            Arc::new(StaticResolver::new()),
            Arc::new(EgressPolicy::development()),
        )),
        startup_timeout: Duration::from_secs(10),
    }) else {
        panic!("a state directory under a file was taken");
    };
    let message = refused.to_string();
    assert!(message.contains(&state.display().to_string()), "{message}");
    assert!(message.contains("WOR_SANDBOX_DIR"), "{message}");
    assert!(
        std::error::Error::source(&refused).is_none(),
        "its cause is in its message once, not again as its source"
    );
}
