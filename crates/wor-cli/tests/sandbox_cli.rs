//! `wor sandbox exec` and `wor doctor` through the real binary: exit codes pass through, the
//! environment holds only declared variables, and killing `wor` itself (shutdown) kills the
//! sandboxed tree and removes its root.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic,
    reason = "tests fail loudly"
)]

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

const WOR: &str = env!("CARGO_BIN_EXE_wor");

fn wor(state: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::new(WOR);
    cmd.args(args)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("WOR_SANDBOX_DIR", state)
        .stdin(Stdio::null());
    cmd
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn roots(state: &Path) -> usize {
    std::fs::read_dir(state)
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .filter(|e| e.file_name().to_string_lossy().starts_with("wor-sbx-"))
                .count()
        })
        .unwrap_or(0)
}

fn processes(marker: &str) -> usize {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(Result::ok)
        .filter(|e| {
            std::fs::read(e.path().join("cmdline"))
                .map(|c| String::from_utf8_lossy(&c).contains(marker))
                .unwrap_or(false)
        })
        .count()
}

fn eventually(what: &str, check: impl Fn() -> bool) {
    for _ in 0..100 {
        if check() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("{what}");
}

#[test]
fn exec_passes_the_exit_code_and_output_through() {
    let dir = tempfile::tempdir().unwrap();
    let out = wor(
        dir.path(),
        &[
            "sandbox",
            "exec",
            "--",
            "sh",
            "-c",
            "echo hi; id -u; exit 5",
        ],
    )
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(5), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "hi\n1000\n");
    assert_eq!(roots(dir.path()), 0);
}

#[test]
fn exec_passes_only_declared_variables() {
    let dir = tempfile::tempdir().unwrap();
    let out = wor(
        dir.path(),
        &["sandbox", "exec", "--env", "DECLARED", "--", "env"],
    )
    .env("DECLARED", "yes")
    .env("UNDECLARED_SECRET", "no")
    .output()
    .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "DECLARED=yes\n");
}

#[test]
fn exec_without_network_reaches_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let port = listener.local_addr().unwrap().port();
    let script = format!("echo hi > /dev/tcp/127.0.0.1/{port}");
    let out = wor(
        dir.path(),
        &["sandbox", "exec", "--", "bash", "-c", &script],
    )
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert!(listener.accept().is_err());
}

#[test]
fn killing_wor_kills_the_sandboxed_tree_and_removes_its_root() {
    let dir = tempfile::tempdir().unwrap();
    let marker = format!("1000.{}77", std::process::id());
    let script = format!("sleep {marker} & sleep {marker}");
    let mut child = wor(dir.path(), &["sandbox", "exec", "--", "sh", "-c", &script])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    eventually("the sleepers start", || processes(&marker) >= 2);
    assert_eq!(roots(dir.path()), 1);
    child.kill().unwrap(); // SIGKILL: wor gets no chance to clean up
    child.wait().unwrap();
    eventually("no sleeper survives wor", || processes(&marker) == 0);
    eventually("the helper removes the root", || roots(dir.path()) == 0);
}

#[test]
fn doctor_reports_every_layer() {
    let dir = tempfile::tempdir().unwrap();
    let out = wor(dir.path(), &["doctor", "--sandbox-only"])
        .output()
        .unwrap();
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    for layer in [
        "user-namespace",
        "pid-namespace",
        "network-namespace",
        "mount-namespace",
        "root-filesystem",
        "private-tmp",
        "egress-proxy",
        "landlock",
        "seccomp",
        "wasm-runtime",
    ] {
        assert!(
            stdout
                .lines()
                .any(|l| l.starts_with(layer) && l.ends_with("supported")),
            "{layer}: {stdout}"
        );
    }
}
