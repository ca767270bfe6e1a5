//! Audit appends per second on the embedded SQLite database: group commit (many callers,
//! one transaction per batch) against one commit per append, and against a bare `fdatasync`
//! loop on the same disk, which bounds what any durable one-commit-per-append scheme can do.
//! And how long a write outside a transaction takes while the log is appended to without
//! pause, against the same writes alone.
//!
//! `cargo bench -p wor-store --bench audit` (no harness, plain `Instant`).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stdout,
    reason = "a benchmark's output is its result"
)]

#[path = "../tests/support/mod.rs"]
mod support;

use std::io::Write as _;
use std::time::{Duration, Instant};

use wor_core::audit::{Actor, AuditCategory, AuditEvent};
use wor_secrets::AuditSigningKey;
use wor_store::{AuditConfig, AuditLog, Store};

const APPENDS: usize = 2_000;
const CALLERS: usize = 64;

fn event(project: wor_core::ProjectId, i: usize) -> AuditEvent {
    AuditEvent::new(project, AuditCategory::KeyCreate, Actor::Operator)
        .subject("key_id", wor_core::ApiKeyId::new())
        .payload(serde_json::json!({"name": format!("bench key {i}"), "role": "viewer"}))
}

async fn open(dir: &std::path::Path, max_batch: usize) -> (Store, AuditLog, wor_core::ProjectId) {
    let store = Store::open(None, dir).await.unwrap();
    let project = store
        .create_project(&format!("bench-{max_batch}"), "owner")
        .await
        .unwrap()
        .project
        .id;
    let (key, _) = AuditSigningKey::generate().unwrap();
    let config = AuditConfig {
        max_batch,
        checkpoint_interval: Duration::from_secs(3600),
        ..AuditConfig::default()
    };
    let log = AuditLog::start(store.clone(), key, config);
    (store, log, project)
}

/// `APPENDS` appends from `CALLERS` concurrent tasks; returns appends per second.
async fn concurrent_appends(log: &AuditLog, project: wor_core::ProjectId) -> f64 {
    let started = Instant::now();
    let mut tasks = Vec::new();
    for caller in 0..CALLERS {
        let log = log.clone();
        tasks.push(tokio::spawn(async move {
            for i in (caller..APPENDS).step_by(CALLERS) {
                log.append(event(project, i)).await.unwrap();
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    APPENDS as f64 / started.elapsed().as_secs_f64()
}

/// How long `WRITES` writes outside a transaction take (creating a tool connection, one
/// statement on the pool), one after the other, while `appenders` tasks append to the audit
/// log without pause: the median, the longest, and how many failed.
async fn writes_beside_appends(
    store: &Store,
    log: &AuditLog,
    project: wor_core::ProjectId,
    appenders: usize,
    round: &str,
) -> (Duration, Duration, usize) {
    const WRITES: usize = 30;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut tasks = Vec::new();
    for caller in 0..appenders {
        let (log, stop) = (log.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let mut i = caller;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                log.append(event(project, i)).await.unwrap();
                i += appenders;
            }
        }));
    }
    // Let the appends reach their pace first.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut took = Vec::with_capacity(WRITES);
    let mut failed = 0;
    for i in 0..WRITES {
        let connection = support::mcp_connection(&format!("{round}-{i}"));
        let started = Instant::now();
        if store
            .create_tool_connection(project, connection)
            .await
            .is_err()
        {
            failed += 1;
        }
        took.push(started.elapsed());
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for task in tasks {
        task.await.unwrap();
    }
    took.sort();
    let at = |i: usize| took.get(i).copied().unwrap();
    (at(WRITES / 2), at(WRITES - 1), failed)
}

fn fdatasync_loop(dir: &std::path::Path) -> f64 {
    let mut file = std::fs::File::create(dir.join("fdatasync.bin")).unwrap();
    let record = [0x5au8; 512];
    let started = Instant::now();
    for _ in 0..APPENDS {
        file.write_all(&record).unwrap();
        file.sync_data().unwrap();
    }
    APPENDS as f64 / started.elapsed().as_secs_f64()
}

#[tokio::main]
async fn main() {
    // Under the target directory, not /tmp: the same disk the build and tests use.
    let base = std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| "target".to_owned());
    std::fs::create_dir_all(&base).unwrap();
    println!("{APPENDS} appends from {CALLERS} concurrent callers, SQLite (WAL, synchronous=FULL)");

    let dir = tempfile::tempdir_in(&base).unwrap();
    let (store, log, project) = open(dir.path(), 512).await;
    let grouped = concurrent_appends(&log, project).await;
    let key = log.verifying_key();
    assert!(matches!(
        store.verify_audit_chain(project, &key, &[]).await.unwrap(),
        wor_core::audit::Verification::Intact(ref s) if s.entries == APPENDS as i64
    ));
    println!("group commit (batch <= 512):      {grouped:>9.0} appends/s");

    let dir = tempfile::tempdir_in(&base).unwrap();
    let (_, log, project) = open(dir.path(), 1).await;
    let single = concurrent_appends(&log, project).await;
    println!("one commit per append (batch = 1): {single:>9.0} appends/s");

    let dir = tempfile::tempdir_in(&base).unwrap();
    let (store, log, project) = open(dir.path(), 512).await;
    let (alone_p50, alone_max, alone_failed) =
        writes_beside_appends(&store, &log, project, 0, "alone").await;
    let (busy_p50, busy_max, busy_failed) =
        writes_beside_appends(&store, &log, project, CALLERS, "busy").await;
    println!(
        "a write outside a transaction: alone p50={:.2}ms max={:.2}ms failed={alone_failed} | \
         beside {CALLERS} appenders p50={:.2}ms max={:.2}ms failed={busy_failed}",
        alone_p50.as_secs_f64() * 1e3,
        alone_max.as_secs_f64() * 1e3,
        busy_p50.as_secs_f64() * 1e3,
        busy_max.as_secs_f64() * 1e3,
    );

    let dir = tempfile::tempdir_in(&base).unwrap();
    let bare = fdatasync_loop(dir.path());
    println!("bare write + fdatasync loop:       {bare:>9.0} syncs/s");
    println!(
        "group / single: {:.1}x, group / fdatasync: {:.1}x",
        grouped / single,
        grouped / bare
    );
}
