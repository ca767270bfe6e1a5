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
    NetworkAccess, Sandbox, SandboxConfig, SandboxError, SandboxExit, SandboxLayer,
    SandboxOutput, SandboxProfile,
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
    let out = run(&sandbox, &sh("echo hello; id -u; hostname; echo err >&2; exit 7")).await;
    assert_eq!(out.exit, SandboxExit::Code(7), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "hello\n1000\nwor-sandbox\n");
    assert_eq!(text(&out.stderr), "err\n");
}
