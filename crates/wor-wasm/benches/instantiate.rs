//! A Wasm tool call from a warm runtime — a fresh instance from the pre-instantiated probe
//! component on the pooling allocator, then its `echo` tool — against a plain spawn of
//! `/usr/bin/echo` to its first output, measured in the same run. Also reports the one-time
//! compile of the component. Run with `cargo bench -p wor-wasm --bench instantiate` after
//! `source .ci/wasm-fixtures.sh`.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stdout,
    reason = "a benchmark reports on stdout and fails loudly"
)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use tokio::io::AsyncReadExt;
use wor_egress::{EgressClient, EgressLimits, EgressPolicy, StaticResolver};
use wor_wasm::{WasmGrants, WasmLimits, WasmRuntime, WasmTool};

const RUNS: usize = 200;

fn stats(mut samples: Vec<Duration>) -> (Duration, Duration) {
    samples.sort();
    let median = samples.get(samples.len() / 2).copied().unwrap_or_default();
    let best = samples.first().copied().unwrap_or_default();
    (median, best)
}

async fn plain_spawn() -> Duration {
    let start = Instant::now();
    let mut child = tokio::process::Command::new("/usr/bin/echo")
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

async fn wasm_call(tool: &WasmTool) -> Duration {
    let start = Instant::now();
    let reply = tool
        .call_tool("echo", &json!({"text": "ready"}))
        .await
        .unwrap();
    let elapsed = start.elapsed();
    assert_eq!(reply, Ok("ready".to_owned()));
    elapsed
}

#[tokio::main]
async fn main() {
    let path = std::env::var_os("WOR_WASM_PROBE")
        .map(PathBuf::from)
        .expect("set WOR_WASM_PROBE (source .ci/wasm-fixtures.sh)");
    let bytes = std::fs::read(&path).unwrap();
    let runtime = WasmRuntime::new().unwrap();
    let compile_started = Instant::now();
    let component = runtime.load(&bytes).unwrap();
    let compile = compile_started.elapsed();
    let egress = EgressClient::with_resolver(
        EgressPolicy::development(),
        Arc::new(StaticResolver::new()),
        EgressLimits::default(),
    )
    .unwrap();
    let tool = WasmTool::new(
        component,
        WasmGrants::default(),
        WasmLimits::default(),
        egress,
    )
    .unwrap();
    // Warm both paths once.
    wasm_call(&tool).await;
    plain_spawn().await;
    let mut wasm = Vec::with_capacity(RUNS);
    let mut spawn = Vec::with_capacity(RUNS);
    for _ in 0..RUNS {
        wasm.push(wasm_call(&tool).await);
        spawn.push(plain_spawn().await);
    }
    let (wasm_median, wasm_best) = stats(wasm);
    let (spawn_median, spawn_best) = stats(spawn);
    println!(
        "component: {} bytes, compiled once in {:.1} ms",
        bytes.len(),
        compile.as_secs_f64() * 1e3
    );
    println!("{RUNS} runs each (interleaved)     median      best");
    println!(
        "wasm: instantiate + echo call   {:>7.1} µs {:>7.1} µs",
        wasm_median.as_secs_f64() * 1e6,
        wasm_best.as_secs_f64() * 1e6
    );
    println!(
        "plain spawn of /usr/bin/echo    {:>7.1} µs {:>7.1} µs",
        spawn_median.as_secs_f64() * 1e6,
        spawn_best.as_secs_f64() * 1e6
    );
    println!(
        "ratio wasm / plain spawn (median): {:.2}x",
        wasm_median.as_secs_f64() / spawn_median.as_secs_f64()
    );
}
