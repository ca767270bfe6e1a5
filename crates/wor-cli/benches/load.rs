//! Load benchmark: many runs, each with one tool call that takes 100 ms, through the real
//! `wor serve` (release build) on SQLite and on PostgreSQL, at several worker counts.
//!
//! For each backend and worker count it prints the runs per second, the ideal for that worker
//! count in the same run (`runs × 100 ms / workers`), the most tool calls in flight at once
//! (runs executing together), and the latency of an API read sampled during the load.
//!
//! ```sh
//! cargo bench -p wor-cli --bench load                              # SQLite
//! WOR_BENCH_PG_URL=postgres://wor@127.0.0.1:5432/postgres \
//!     cargo bench -p wor-cli --bench load                          # and PostgreSQL
//! WOR_BENCH_RUNS=200 WOR_BENCH_WORKERS=1,16 cargo bench -p wor-cli --bench load
//! ```
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic,
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "a benchmark fails loudly and reports on stdout"
)]

#[allow(dead_code, reason = "each benchmark uses a part of the shared support")]
mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde_json::json;
use support::{
    Api, Server, backends, database_for, drop_fresh_databases, env_number, ms, percentile,
    start_runs,
};

/// How long the tool takes to answer each call.
const TOOL_LATENCY: Duration = Duration::from_millis(100);
/// How often the API is read while the load runs.
const SAMPLE_EVERY: Duration = Duration::from_millis(20);
/// Run starts in flight at once from the load generator.
const STARTERS: usize = 32;

const ROUTINE: &str = r#"
name = "load"
instructions = "Do the work once."
[model]
provider = "replay"
model = "script"
[[model.script.turns]]
when = { last_tool_result_contains = "done" }
text = "finished"
repeat = true
[[model.script.turns]]
tool_calls = [{ name = "work__do", arguments = { n = 1 } }]
repeat = true
[concurrency]
max_runs = 1000
overlap = "queue"
[[tools]]
tool = "work/do"
mode = "auto"
"#;

/// The loopback tool: answers after [`TOOL_LATENCY`], counting calls in flight.
#[derive(Default)]
struct ToolLoad {
    in_flight: AtomicUsize,
    most_in_flight: AtomicUsize,
    calls: AtomicUsize,
}

async fn serve_tool(load: Arc<ToolLoad>) -> std::net::SocketAddr {
    let app = axum::Router::new().fallback(move || {
        let load = load.clone();
        async move {
            let now = load.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
            load.most_in_flight.fetch_max(now, Ordering::SeqCst);
            tokio::time::sleep(TOOL_LATENCY).await;
            load.in_flight.fetch_sub(1, Ordering::SeqCst);
            load.calls.fetch_add(1, Ordering::SeqCst);
            axum::Json(json!({"status": "done"}))
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

struct Figure {
    elapsed: Duration,
    most_in_flight: usize,
    api_p50: Duration,
    api_p99: Duration,
    succeeded: usize,
}

async fn measure(database: Option<String>, workers: usize, runs: usize) -> Figure {
    let load = Arc::new(ToolLoad::default());
    let tool = serve_tool(load.clone()).await;
    let config = format!(
        "max_running_per_project = {workers}\nworkers = {workers}\n\n\
         [egress]\nallowed_cidrs = [\"127.0.0.1/32\"]\n"
    );
    let (server, key) = Server::start(database.as_deref(), &config);
    let api = Api::new(&server, key);
    api.http_tools(
        "work",
        tool,
        json!([{"name": "do", "description": "Does some work", "method": "POST",
                "path": "/work", "inputSchema": {"type": "object",
                "properties": {"n": {"type": "integer"}}}}]),
        &["do"],
    )
    .await;
    let routine = api.apply(ROUTINE).await;

    let sampling = Arc::new(AtomicBool::new(true));
    let sampler = {
        let api = api.clone();
        let sampling = sampling.clone();
        tokio::spawn(async move {
            let mut samples = Vec::new();
            while sampling.load(Ordering::SeqCst) {
                let started = Instant::now();
                api.get("/v1/runs?limit=20").await;
                samples.push(started.elapsed());
                tokio::time::sleep(SAMPLE_EVERY).await;
            }
            samples
        })
    };

    let started = Instant::now();
    start_runs(&api, &routine, runs, STARTERS).await;
    let deadline = Instant::now() + Duration::from_secs(900);
    loop {
        let active = api.get("/v1/runs?status=queued&limit=1").await;
        let running = api.get("/v1/runs?status=running&limit=1").await;
        let idle = active.as_array().is_some_and(Vec::is_empty)
            && running.as_array().is_some_and(Vec::is_empty);
        if idle && load.calls.load(Ordering::SeqCst) >= runs {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{workers} workers: the runs did not finish in time"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let elapsed = started.elapsed();
    sampling.store(false, Ordering::SeqCst);
    let mut samples = sampler.await.unwrap();
    samples.sort();
    let succeeded = api.runs_with_status("succeeded").await.len();
    Figure {
        elapsed,
        most_in_flight: load.most_in_flight.load(Ordering::SeqCst),
        api_p50: percentile(&samples, 0.50),
        api_p99: percentile(&samples, 0.99),
        succeeded,
    }
}

#[tokio::main]
async fn main() {
    let runs = env_number("WOR_BENCH_RUNS", 1000);
    let workers: Vec<usize> = std::env::var("WOR_BENCH_WORKERS")
        .unwrap_or_else(|_| "1,16,64".to_owned())
        .split(',')
        .map(|w| w.trim().parse().expect("WOR_BENCH_WORKERS: numbers"))
        .collect();
    println!(
        "load: {runs} runs, one {} ms tool call each, {STARTERS} concurrent starters",
        TOOL_LATENCY.as_millis()
    );
    for (backend, base) in backends() {
        for &count in &workers {
            let figure = measure(database_for(&base).await, count, runs).await;
            let ideal = TOOL_LATENCY.as_secs_f64() * runs as f64 / count as f64;
            println!(
                "{backend:<8} workers={count:<3} runs/s={:>7.1} elapsed={:>6.2}s ideal={:>6.2}s \
                 ratio={:>5.2}x at-once={:<3} api p50={:.1}ms p99={:.1}ms succeeded={}/{runs}",
                runs as f64 / figure.elapsed.as_secs_f64(),
                figure.elapsed.as_secs_f64(),
                ideal,
                figure.elapsed.as_secs_f64() / ideal,
                figure.most_in_flight,
                ms(figure.api_p50),
                ms(figure.api_p99),
                figure.succeeded,
            );
        }
        drop_fresh_databases(&base).await;
    }
}
