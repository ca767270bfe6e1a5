//! Scale-out benchmark: how fast runs are claimed and how long a queued run waits to start,
//! with one process that drives its own runs (`wor serve`, the embedded default) and with an
//! `api` process and 1 or 4 remote `worker` processes (`--role worker`), in the same run.
//!
//! For each backend and mode it starts a batch of trivial runs (one replay model turn) from
//! 32 concurrent starters and prints the runs claimed per second (runs over the time from the
//! first run created to the last run started) and enqueue → start (a run's `started_at` less
//! its `created_at`) at p50 and p99, for the batch (which waits for free slots) and for runs
//! started alone, one after another, with every slot free.
//!
//! ```sh
//! cargo bench -p wor-cli --bench scale                              # SQLite
//! WOR_BENCH_PG_URL=postgres://wor@127.0.0.1:5432/postgres \
//!     cargo bench -p wor-cli --bench scale                          # and PostgreSQL
//! WOR_BENCH_RUNS=1000 WOR_BENCH_SLOTS=8 cargo bench -p wor-cli --bench scale
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

use std::time::{Duration, Instant};

use serde_json::json;
use support::{
    Api, Server, backends, between, database_for, drop_fresh_databases, env_number, ms, percentile,
    start_runs,
};

/// Run starts in flight at once from the load generator.
const STARTERS: usize = 32;

const ROUTINE: &str = r#"
name = "scale"
instructions = "Answer."
[model]
provider = "replay"
model = "script"
[[model.script.turns]]
text = "done"
repeat = true
[concurrency]
max_runs = 1000
overlap = "queue"
"#;

/// Who drives the runs.
#[derive(Clone, Copy)]
enum Mode {
    /// One `wor serve` (role `all`) with its own pool.
    SingleProcess,
    /// An `api` process and this many `worker` processes.
    Workers(usize),
}

impl Mode {
    fn label(self) -> String {
        match self {
            Mode::SingleProcess => "single-process".to_owned(),
            Mode::Workers(n) => format!("{n} worker(s)"),
        }
    }
}

struct Figure {
    claims_per_second: f64,
    start_p50: Duration,
    start_p99: Duration,
    succeeded: usize,
    /// Enqueue → start of a run started alone, with every slot free, at p50 and p99.
    idle_p50: Duration,
    idle_p99: Duration,
}

/// Runs started one at a time, each after the one before has ended, for the idle figure.
const IDLE_RUNS: usize = 40;

async fn measure(database: Option<String>, mode: Mode, slots: usize, runs: usize) -> Figure {
    let config = format!("max_running_per_project = 1000\nworkers = {slots}\n");
    let role = match mode {
        Mode::SingleProcess => "all",
        Mode::Workers(_) => "api",
    };
    let (server, key) = Server::start_as(database.as_deref(), &config, role);
    let _workers: Vec<Server> = match mode {
        Mode::SingleProcess => Vec::new(),
        Mode::Workers(n) => (0..n)
            .map(|_| server.worker(database.as_deref(), slots))
            .collect(),
    };
    let api = Api::new(&server, key);
    let routine = api.apply(ROUTINE).await;

    start_runs(&api, &routine, runs, STARTERS).await;
    let deadline = Instant::now() + Duration::from_secs(900);
    loop {
        let queued = api.get("/v1/runs?status=queued&limit=1").await;
        let running = api.get("/v1/runs?status=running&limit=1").await;
        if queued.as_array().is_some_and(Vec::is_empty)
            && running.as_array().is_some_and(Vec::is_empty)
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{}: the runs did not finish in time",
            mode.label()
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let done = api.runs_with_status("succeeded").await;
    let mut waits: Vec<Duration> = done
        .iter()
        .filter_map(|run| between(run, "created_at", "started_at"))
        .collect();
    waits.sort();
    let first_created = done
        .iter()
        .filter_map(|run| run["created_at"].as_str())
        .min()
        .unwrap()
        .to_owned();
    let span = done
        .iter()
        .filter_map(|run| {
            between(
                &json!({"a": first_created, "b": run["started_at"]}),
                "a",
                "b",
            )
        })
        .max()
        .unwrap_or_default();
    // Alone: each run started with nothing else queued, waited for until it ends.
    let mut idle = Vec::new();
    for _ in 0..IDLE_RUNS {
        let run = api
            .post(
                &format!("/v1/routines/{routine}/runs"),
                json!({"input": "alone"}),
            )
            .await;
        let id = run["id"].as_str().unwrap().to_owned();
        let ended = loop {
            let run = api.get(&format!("/v1/runs/{id}")).await;
            if run["status"] == "succeeded" {
                break run;
            }
            assert!(
                Instant::now() < deadline,
                "{}: a run started alone did not finish",
                mode.label()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        idle.extend(between(&ended, "created_at", "started_at"));
    }
    idle.sort();
    Figure {
        claims_per_second: done.len() as f64 / span.as_secs_f64().max(0.001),
        start_p50: percentile(&waits, 0.50),
        start_p99: percentile(&waits, 0.99),
        succeeded: done.len(),
        idle_p50: percentile(&idle, 0.50),
        idle_p99: percentile(&idle, 0.99),
    }
}

#[tokio::main]
async fn main() {
    let runs = env_number("WOR_BENCH_RUNS", 500);
    let slots = env_number("WOR_BENCH_SLOTS", 8);
    println!(
        "scale: {runs} trivial runs, {STARTERS} concurrent starters, {slots} runs driven at once per process"
    );
    for (backend, base) in backends() {
        for mode in [Mode::SingleProcess, Mode::Workers(1), Mode::Workers(4)] {
            let figure = measure(database_for(&base).await, mode, slots, runs).await;
            println!(
                "{backend:<8} {:<15} claims/s={:>7.1} batch enqueue->start p50={:>7.1}ms p99={:>7.1}ms \
                 alone enqueue->start p50={:>6.1}ms p99={:>6.1}ms succeeded={}/{runs}",
                mode.label(),
                figure.claims_per_second,
                ms(figure.start_p50),
                ms(figure.start_p99),
                ms(figure.idle_p50),
                ms(figure.idle_p99),
                figure.succeeded,
            );
        }
        drop_fresh_databases(&base).await;
    }
}
