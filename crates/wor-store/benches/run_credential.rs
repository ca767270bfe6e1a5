//! The run credential check each tool call pays (`authenticate_run_token`: a digest lookup
//! joined with its run) against a primary-key read of the same run (`get_run`), on the embedded
//! SQLite database, measured in the same run.
//!
//! `cargo bench -p wor-store --bench run_credential` (no harness, plain `Instant`).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stdout,
    reason = "a benchmark's output is its result"
)]

use std::time::{Duration, Instant};

use wor_core::routine::RoutineDefinition;
use wor_core::run::{Provenance, RunStatus};
use wor_store::{NewRun, Store};

const ROUNDS: usize = 5_000;

const ROUTINE: &str = "name = \"bench\"\ninstructions = \"Bench.\"\n[model]\nprovider = \"replay\"\nmodel = \"m\"\nscript = { turns = [{ text = \"hi\" }] }\n";

fn stats(mut samples: Vec<Duration>) -> (Duration, Duration) {
    samples.sort();
    let median = samples.get(samples.len() / 2).copied().unwrap_or_default();
    let p99 = samples
        .get(samples.len() * 99 / 100)
        .copied()
        .unwrap_or_default();
    (median, p99)
}

#[tokio::main]
async fn main() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(None, dir.path()).await.unwrap();
    let project = store
        .create_project("bench", "owner")
        .await
        .unwrap()
        .project
        .id;
    let definition = RoutineDefinition::from_toml(ROUTINE).unwrap();
    let routine = store
        .apply_routine(project, ROUTINE, &definition, None)
        .await
        .unwrap()
        .routine;
    // Many runs, so the lookups search a table of realistic size; the last one is measured.
    let mut last = None;
    for _ in 0..200 {
        let run = store
            .create_run(
                project,
                NewRun {
                    routine_id: routine.id,
                    routine_version: routine.current_version,
                    trigger_kind: wor_core::call::TriggerKind::Api,
                    started_by: None,
                    started_by_member: None,
                    max_concurrent: 1_000,
                    status: RunStatus::Queued,
                    outcome: None,
                    trigger_key: None,
                    input_provenance: Provenance::Requester,
                    thread: None,
                    memory: None,
                    parent: None,
                    skip_at: None,
                },
                wor_core::step::InputStep::requested(serde_json::json!("go")),
            )
            .await
            .unwrap();
        store
            .claim_run_by_id(project, run.id, "bench", 3_600_000)
            .await
            .unwrap()
            .unwrap();
        let token = store
            .mint_run_token(
                project,
                run.id,
                "bench",
                wor_store::now_millis() + 3_600_000,
            )
            .await
            .unwrap()
            .unwrap();
        last = Some((run.id, token));
    }
    let (run, token) = last.unwrap();
    let mut check = Vec::with_capacity(ROUNDS);
    let mut read = Vec::with_capacity(ROUNDS);
    for _ in 0..ROUNDS {
        let started = Instant::now();
        let grant = store.authenticate_run_token(token.expose()).await.unwrap();
        check.push(started.elapsed());
        assert_eq!(grant.map(|g| g.run_id), Some(run));
        let started = Instant::now();
        let record = store.get_run(project, run).await.unwrap();
        read.push(started.elapsed());
        assert_eq!(record.id, run);
    }
    let (check_median, check_p99) = stats(check);
    let (read_median, read_p99) = stats(read);
    println!("{ROUNDS} rounds, interleaved, 200 running runs     median       p99");
    println!(
        "run credential check (authenticate_run_token)  {:>7.1} µs {:>7.1} µs",
        check_median.as_secs_f64() * 1e6,
        check_p99.as_secs_f64() * 1e6
    );
    println!(
        "primary-key read of the run (get_run)          {:>7.1} µs {:>7.1} µs",
        read_median.as_secs_f64() * 1e6,
        read_p99.as_secs_f64() * 1e6
    );
    println!(
        "ratio check / read (median): {:.2}x",
        check_median.as_secs_f64() / read_median.as_secs_f64()
    );
}
