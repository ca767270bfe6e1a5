//! The store's operational metrics, through the `metrics` facade (nothing is recorded unless
//! the server installs a recorder). Labels are fixed words only.

use std::time::Duration;

use metrics::{counter, histogram};

pub const AUDIT_APPEND: &str = "wor_audit_append_seconds";
pub const AUDIT_BATCH: &str = "wor_audit_batch_entries";
pub const AUDIT_APPEND_FAILURES: &str = "wor_audit_append_failures_total";
pub const AUDIT_COMMITS: &str = "wor_audit_commits_total";
pub const AUDIT_BATCHES: &str = "wor_audit_batches_total";
pub const AUDIT_LOG_SYNCS: &str = "wor_audit_log_syncs_total";
pub const WAL_CHECKPOINTS: &str = "wor_sqlite_wal_checkpoints_total";
/// Runs ended, by final status and trigger: counted here for runs recorded as skipped by the
/// overlap policy, which no worker ends, and by the engine for the others.
pub const RUNS_FINISHED: &str = "wor_runs_finished_total";

/// A run recorded as ended when it was made: skipped by its routine's overlap policy.
pub(crate) fn run_ended_unclaimed(
    status: wor_core::run::RunStatus,
    trigger: wor_core::call::TriggerKind,
) {
    counter!(RUNS_FINISHED, "status" => status.as_str(), "trigger" => trigger.as_str())
        .increment(1);
}

/// Describes the store's metrics to the installed recorder (`# HELP` lines).
pub fn describe() {
    use metrics::{Unit, describe_counter, describe_histogram};
    describe_histogram!(
        AUDIT_APPEND,
        Unit::Seconds,
        "Time to write one batch of audit entries (one transaction)"
    );
    describe_histogram!(
        AUDIT_BATCH,
        Unit::Count,
        "Audit entries written per transaction by the group-commit writer"
    );
    describe_counter!(
        AUDIT_APPEND_FAILURES,
        "Audit batches whose transaction failed"
    );
    describe_counter!(
        AUDIT_LOG_SYNCS,
        "Flushes of SQLite's write-ahead log to disk that synced audit batches waited for"
    );
    describe_counter!(
        WAL_CHECKPOINTS,
        "Checkpoints that copied SQLite's write-ahead log into the database file: off the \
         writer's thread (passive), or by the writer restarting a long log (restart)"
    );
    describe_counter!(
        AUDIT_BATCHES,
        "Batches of audit entries and journal writes committed, by path: queued for the audit \
         writer, or on SQLite committed directly by a run's write that found the writer idle"
    );
    describe_counter!(
        AUDIT_COMMITS,
        "Transactions the audit writer committed, by durability: synced to disk before they \
         were acknowledged, or deferred to the next synced one"
    );
    // Every series of a fixed label set exists from the start, at zero: the set of series a
    // scrape sees never changes with what happened to happen first.
    for mode in ["passive", "restart"] {
        counter!(WAL_CHECKPOINTS, "mode" => mode).increment(0);
    }
    for durability in ["synced", "deferred"] {
        counter!(AUDIT_COMMITS, "durability" => durability).increment(0);
    }
    for path in ["queued", "direct"] {
        counter!(AUDIT_BATCHES, "path" => path).increment(0);
    }
}

/// The log syncer flushed SQLite's write-ahead log for the synced batches waiting on it.
pub(crate) fn audit_log_synced() {
    counter!(AUDIT_LOG_SYNCS).increment(1);
}

/// SQLite's write-ahead log was copied into the database file: by the checkpointer
/// (`passive`), or by the writer restarting the log (`restart`).
pub(crate) fn wal_checkpointed(mode: &'static str) {
    counter!(WAL_CHECKPOINTS, "mode" => mode).increment(1);
}

/// The audit writer committed a batch with `durability`.
pub(crate) fn audit_commit(durability: crate::Durability) {
    let durability = match durability {
        crate::Durability::Synced => "synced",
        crate::Durability::Deferred => "deferred",
    };
    counter!(AUDIT_COMMITS, "durability" => durability).increment(1);
}

/// A batch committed, by the audit writer's loop from its queue (`queued`) or, on SQLite, by
/// the caller of a write that found the writer idle (`direct`).
pub(crate) fn audit_batch_committed(path: &'static str) {
    counter!(AUDIT_BATCHES, "path" => path).increment(1);
}

/// The audit writer wrote (or failed to write) a batch of `entries` in `took`.
pub(crate) fn audit_batch(entries: usize, took: Duration, ok: bool) {
    if ok {
        histogram!(AUDIT_APPEND).record(took.as_secs_f64());
        histogram!(AUDIT_BATCH).record(entries as f64);
    } else {
        counter!(AUDIT_APPEND_FAILURES).increment(1);
    }
}
