//! How durable each journal write is: the audit writer's commits, counted by the metrics it
//! records (SQLite by default, PostgreSQL in CI).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic,
    reason = "tests fail loudly"
)]

use wor_core::step::StepKind;
use wor_store::testing::TestDatabase;

mod support;
use support::{
    audit_config, claimed_run, key_event, model_turn, project_with_routine, signing_key,
};

/// A journal write that permits an effect outside the database — a call reserved to run, a
/// run's end — and any API entry are synced to disk before they are acknowledged; a model
/// turn's or a result's write is deferred to the next synced commit.
#[test]
fn journal_writes_that_permit_an_effect_are_synced_and_the_others_deferred() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    use wor_core::run::{Provenance, RunStatus};
    use wor_store::{AuditLog, RunWrite, RunWritten};

    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    // Flushes of SQLite's log for synced batches (PostgreSQL syncs its own), over the whole
    // test: a snapshot counts only what came since the one before.
    let log_syncs = std::cell::Cell::new(0u64);
    // Checkpoints that copied SQLite's log into the database file, off the writer's thread.
    let wal_checkpoints = std::cell::Cell::new(0u64);
    // Batches committed by a caller that found the writer idle, and by the writer's loop.
    let by_caller = std::cell::Cell::new(0u64);
    let by_writer = std::cell::Cell::new(0u64);
    let commits = || {
        let mut counts = (0, 0);
        for (key, _, _, value) in snapshotter.snapshot().into_vec() {
            let key = key.key();
            if key.name() == "wor_audit_log_syncs_total"
                && let DebugValue::Counter(n) = value
            {
                log_syncs.set(log_syncs.get() + n);
                continue;
            }
            if key.name() == "wor_sqlite_wal_checkpoints_total"
                && let DebugValue::Counter(n) = value
            {
                wal_checkpoints.set(wal_checkpoints.get() + n);
                continue;
            }
            if key.name() == "wor_audit_batches_total"
                && let DebugValue::Counter(n) = value
            {
                match key.labels().next().map(|l| l.value().to_owned()).as_deref() {
                    Some("direct") => by_caller.set(by_caller.get() + n),
                    Some("queued") => by_writer.set(by_writer.get() + n),
                    other => panic!("unexpected label {other:?}"),
                }
                continue;
            }
            if key.name() != "wor_audit_commits_total" {
                continue;
            }
            let DebugValue::Counter(n) = value else {
                panic!("a counter")
            };
            match key.labels().next().map(|l| l.value().to_owned()).as_deref() {
                Some("synced") => counts.0 += n,
                Some("deferred") => counts.1 += n,
                other => panic!("unexpected label {other:?}"),
            }
        }
        counts
    };
    // The audit writer records from a thread of its own: the recorder is the process's (this
    // binary holds no other test).
    metrics::set_global_recorder(recorder).unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    {
        runtime.block_on(async {
            let db = TestDatabase::isolated().await.unwrap();
            let store = &db.store;
            let sqlite = store.backend() == wor_store::Backend::Sqlite;
            let (project, routine) = project_with_routine(store, "durable", 1).await;
            let run = claimed_run(store, project, routine, "w", 60_000).await;
            let token = store
                .mint_run_token(project, run, "w", wor_store::now_millis() + 60_000)
                .await
                .unwrap()
                .unwrap();
            let log = AuditLog::start(store.clone(), signing_key(7), audit_config(1_000));
            let turn = || model_turn("hi");
            let write = || RunWrite::new(project, run, "w", 60_000);
            let committed = |written: RunWritten| {
                assert!(
                    matches!(written, RunWritten::Committed { .. }),
                    "{written:?}"
                );
            };

            // Each snapshot counts what was recorded since the one before.
            commits();
            committed(
                log.record(write().step(Provenance::Engine, turn()))
                    .await
                    .unwrap(),
            );
            assert_eq!(commits(), (0, 1), "a model turn is deferred");
            // On SQLite the writer drives its own connection on a thread of its own.
            assert_eq!(writer_threads(usize::from(sqlite)), usize::from(sqlite));

            // A credential minted by a journal write replaces the one before, is deferred, and
            // is fenced by the lease like any step.
            let minted = wor_store::RunToken::generate().unwrap();
            let expires = wor_store::now_millis() + 60_000;
            committed(log.record(write().minting(&minted, expires)).await.unwrap());
            assert_eq!(commits(), (0, 1), "a new credential is deferred");
            assert!(
                store
                    .authenticate_run_token(token.expose())
                    .await
                    .unwrap()
                    .is_none(),
                "the credential minted before is replaced"
            );
            let grant = store.authenticate_run_token(minted.expose()).await.unwrap();
            assert_eq!(grant.map(|g| g.run_id), Some(run));
            let stolen = wor_store::RunToken::generate().unwrap();
            assert_eq!(
                log.record(RunWrite::new(project, run, "other", 60_000).minting(&stolen, expires))
                    .await
                    .unwrap(),
                RunWritten::LeaseLost
            );
            assert!(
                store
                    .authenticate_run_token(stolen.expose())
                    .await
                    .unwrap()
                    .is_none()
            );
            commits();
            let token = minted;

            committed(
                log.record(
                    write()
                        .step(Provenance::Engine, turn())
                        .presenting(token.expose()),
                )
                .await
                .unwrap(),
            );
            assert_eq!(commits(), (1, 0), "a write that reserves a call is synced");
            // On SQLite it was acknowledged only after a flush of the log that began after it
            // committed; the deferred writes before it waited for none.
            let synced_so_far = log_syncs.get();
            assert_eq!(synced_so_far > 0, sqlite, "{synced_so_far} flushes");
            committed(
                log.record(write().step(Provenance::Engine, turn()))
                    .await
                    .unwrap(),
            );
            assert_eq!(commits(), (0, 1));
            assert_eq!(
                log_syncs.get(),
                synced_so_far,
                "a deferred write waits for no flush"
            );
            // On SQLite a write that finds the writer idle is committed by its caller, with no
            // hand-off to the writer's thread; on PostgreSQL the writer commits every batch.
            let (callers, writers) = (by_caller.get(), by_writer.get());
            committed(
                log.record(write().step(Provenance::Engine, turn()))
                    .await
                    .unwrap(),
            );
            commits();
            assert_eq!(
                (by_caller.get() - callers, by_writer.get() - writers),
                if sqlite { (1, 0) } else { (0, 1) },
                "who committed a lone write"
            );
            // A write that finds the process's turn to write taken (held here, as another
            // write of the process holds it) is not committed by its caller: it queues, and the
            // writer commits it once the turn is free.
            if sqlite {
                let (callers, writers) = (by_caller.get(), by_writer.get());
                let queued = log.record(write().step(Provenance::Engine, turn()));
                committed(support::held_up(store, queued).await.unwrap());
                commits();
                assert_eq!(
                    (by_caller.get() - callers, by_writer.get() - writers),
                    (0, 1),
                    "who committed a write that found the turn taken"
                );
            }

            // The reservation of a read (a write under the live credential) is committed but
            // deferred: it waits for no flush either.
            committed(
                log.record(
                    write()
                        .step(Provenance::Engine, turn())
                        .under_live_claim(token.expose()),
                )
                .await
                .unwrap(),
            );
            assert_eq!(commits(), (0, 1), "a reservation of a read is deferred");
            assert_eq!(log_syncs.get(), synced_so_far);
            // A write beside another under way is left to the writer, even an idle one, which
            // commits what queues meanwhile together. The first write here awaits the flush of
            // the log (by a task of this runtime, so not before both writes are polled) when
            // the second comes. (The first is committed by its caller only if the writer's
            // loop is not busy then, as with a checkpoint of the log it was asked for; if it
            // is, the loop commits both.)
            let (callers, writers) = (by_caller.get(), by_writer.get());
            let (first, second) = tokio::join!(
                log.record(
                    write()
                        .step(Provenance::Engine, turn())
                        .presenting(token.expose())
                ),
                log.record(write().step(Provenance::Engine, turn())),
            );
            committed(first.unwrap());
            committed(second.unwrap());
            let synced = commits().0;
            assert_eq!(synced, 1, "the reservation is synced");
            let (by_callers, by_loop) = (by_caller.get() - callers, by_writer.get() - writers);
            assert!(
                by_callers <= u64::from(sqlite) && by_loop >= 1,
                "the second write was committed by its caller: {by_callers} batches by callers, \
                 {by_loop} by the writer's loop"
            );

            log.append(key_event(project, 1)).await.unwrap();
            assert_eq!(commits(), (1, 0), "an API entry is synced");

            // Once a cancel is requested, a write to be made only unless one was (a call's
            // reservation) writes nothing; any other write goes in and reports the cancel.
            store
                .request_cancel(project, run, "canceller", 60_000)
                .await
                .unwrap();
            assert_eq!(
                log.record(
                    write()
                        .step(Provenance::Engine, turn())
                        .presenting(token.expose())
                        .unless_cancelled(),
                )
                .await
                .unwrap(),
                RunWritten::CancelRequested
            );
            assert_eq!(
                log.record(write().step(Provenance::Engine, turn()))
                    .await
                    .unwrap(),
                RunWritten::Committed {
                    cancel_requested: true,
                    cancelled_approvals: Vec::new()
                }
            );
            commits();

            // A write counted from the run's usage commits once: another counted from the same
            // usage finds it changed, and writes nothing.
            let before = store.get_run(project, run).await.unwrap().usage;
            let counted = wor_core::budget::BudgetUsage {
                tool_calls: before.tool_calls + 1,
                ..before
            };
            committed(
                log.record(write().usage(counted).counted_from(before))
                    .await
                    .unwrap(),
            );
            assert_eq!(
                log.record(write().usage(counted).counted_from(before))
                    .await
                    .unwrap(),
                RunWritten::LeaseLost
            );
            // Past the run's deadline its claim's credential has ended: a write under the live
            // claim writes nothing, one bound to the claim alone still goes in, and another
            // credential opens neither.
            wor_store::testing::tamper(
                store,
                &[format!(
                    "UPDATE run_tokens SET expires_at = 1 WHERE run_id = '{}'",
                    run
                )],
            )
            .await
            .unwrap();
            assert_eq!(
                log.record(write().under_live_claim(token.expose()))
                    .await
                    .unwrap(),
                RunWritten::CredentialEnded
            );
            committed(
                log.record(write().under_claim(token.expose()))
                    .await
                    .unwrap(),
            );
            let other = wor_store::RunToken::generate().unwrap();
            assert_eq!(
                log.record(write().under_claim(other.expose()))
                    .await
                    .unwrap(),
                RunWritten::CredentialEnded
            );
            commits();

            committed(
                log.record(write().end(RunStatus::Succeeded, "done"))
                    .await
                    .unwrap(),
            );
            assert_eq!(commits(), (1, 0), "a run's end is synced");
            // On SQLite, what the writer committed is copied into the database file by the
            // checkpointer, soon after.
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while sqlite && wal_checkpoints.get() == 0 {
                assert!(
                    std::time::Instant::now() < deadline,
                    "no checkpoint copied the log"
                );
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                commits();
            }
            assert_eq!(wal_checkpoints.get() > 0, sqlite);
            // Every step is there, in order, whatever its durability.
            let steps = store.list_run_steps(project, run, 0).await.unwrap();
            let kinds: Vec<_> = steps.iter().map(|s| s.step.kind()).collect();
            // One turn more on SQLite: the write that found the turn to write taken.
            let turns = if sqlite { 9 } else { 8 };
            let mut expected = vec![StepKind::Input];
            expected.extend(std::iter::repeat_n(StepKind::ModelTurn, turns));
            expected.push(StepKind::Outcome);
            assert_eq!(kinds, expected);
        });
    }
}

/// How many threads of this process are the audit writer's, once the count is `expected` or
/// after a second. A thread the writer starts (its log's checkpointer, a blocking task's
/// thread) carries the writer's name until it sets its own, so one moment's count can be one
/// too many.
fn writer_threads(expected: usize) -> usize {
    let count = || {
        std::fs::read_dir("/proc/self/task")
            .unwrap()
            .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
            .filter(|name| name.trim() == "wor-audit-log")
            .count()
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(1);
    loop {
        let now = count();
        if now == expected || std::time::Instant::now() >= deadline {
            return now;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}
