//! Spawn-to-first-output: `/usr/bin/echo` in the sandbox against a plain spawn of the same
//! binary. Run with `cargo bench -p wor-sandbox --bench spawn`.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stdout,
    reason = "a benchmark reports on stdout and fails loudly"
)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::AsyncReadExt;
use wor_egress::{EgressPolicy, GuardedResolver, StaticResolver};
use wor_sandbox::{Sandbox, SandboxConfig, SandboxProfile, SandboxStdio};

const RUNS: usize = 50;
const PROGRAM: &str = "/usr/bin/echo";

fn stats(mut samples: Vec<Duration>) -> (Duration, Duration) {
    samples.sort();
    let median = samples.get(samples.len() / 2).copied().unwrap_or_default();
    let best = samples.first().copied().unwrap_or_default();
    (median, best)
}

async fn plain() -> Duration {
    let start = Instant::now();
    let mut child = tokio::process::Command::new(PROGRAM)
        .arg("ready")
        .env_clear()
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut byte = [0u8; 1];
    child
        .stdout
        .as_mut()
        .unwrap()
        .read_exact(&mut byte)
        .await
        .unwrap();
    let elapsed = start.elapsed();
    child.wait().await.unwrap();
    elapsed
}

async fn sandboxed(sandbox: &Sandbox, profile: &SandboxProfile) -> Duration {
    let start = Instant::now();
    let mut process = sandbox.spawn(profile, SandboxStdio::Piped).await.unwrap();
    let mut byte = [0u8; 1];
    process
        .stdout
        .as_mut()
        .unwrap()
        .read_exact(&mut byte)
        .await
        .unwrap();
    let elapsed = start.elapsed();
    process.wait().await.unwrap();
    elapsed
}

fn main() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let state = std::env::temp_dir().join(format!("wor-sandbox-bench-{}", std::process::id()));
    let sandbox = Sandbox::new(SandboxConfig {
        helper: env!("CARGO_BIN_EXE_wor-sandbox-helper").into(),
        state_dir: state.clone(),
        resolver: Arc::new(GuardedResolver::new(
            Arc::new(StaticResolver::new()),
            Arc::new(EgressPolicy::development()),
        )),
        startup_timeout: Duration::from_secs(10),
    })
    .unwrap();
    let profile = SandboxProfile::new(PROGRAM).args(["ready"]);
    runtime.block_on(async {
        // Warm the page cache for both paths.
        plain().await;
        sandboxed(&sandbox, &profile).await;
        let mut plain_runs = Vec::new();
        let mut sandbox_runs = Vec::new();
        for _ in 0..RUNS {
            plain_runs.push(plain().await);
            sandbox_runs.push(sandboxed(&sandbox, &profile).await);
        }
        let (plain_median, plain_best) = stats(plain_runs);
        let (sandbox_median, sandbox_best) = stats(sandbox_runs);
        println!("spawn to first output of {PROGRAM}, {RUNS} runs each (interleaved)");
        println!("plain:     median {plain_median:?}, best {plain_best:?}");
        println!("sandboxed: median {sandbox_median:?}, best {sandbox_best:?}");
        println!(
            "ratio sandboxed / plain (median): {:.1}",
            sandbox_median.as_secs_f64() / plain_median.as_secs_f64().max(1e-9)
        );
    });
    let _ = std::fs::remove_dir(&state);
}
