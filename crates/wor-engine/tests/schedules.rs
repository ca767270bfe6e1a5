//! The scheduler on the configured database: slots start runs on time, exactly once across
//! restarts and concurrent schedulers, missed slots are caught up as the routine says, a run
//! recorded ahead of its slot is claimed only from it, and an unscheduled routine stops firing.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic,
    reason = "tests fail loudly"
)]

use std::collections::BTreeSet;
use std::sync::Arc;

use wor_core::run::Provenance;
use wor_core::{ProjectId, RoutineId};
use wor_engine::{DISPATCH_AHEAD_MS, Engine, EngineConfig};
use wor_store::testing::TestDatabase;
use wor_store::{AuditConfig, AuditLog, RunFilter, Vault};

struct Harness {
    db: TestDatabase,
    vault: Vault,
    audit: AuditLog,
    project: ProjectId,
}

impl Harness {
    async fn new() -> Self {
        let db = TestDatabase::isolated().await.unwrap();
        let created = db
            .store
            .create_project(&TestDatabase::unique_name("sched"), "owner")
            .await
            .unwrap();
        let (keys, _) = wor_secrets::KeyRing::generate().unwrap();
        let vault = Vault::new(db.store.clone(), Arc::new(keys));
        let (signing, _) = wor_secrets::AuditSigningKey::generate().unwrap();
        let audit = AuditLog::start(db.store.clone(), signing, AuditConfig::default());
        Harness {
            db,
            vault,
            audit,
            project: created.project.id,
        }
    }

    /// A new engine on the same database: another scheduler process, or this one restarted.
    fn engine(&self) -> Engine {
        Engine::new(
            self.db.store.clone(),
            self.vault.clone(),
            wor_egress::EgressClient::new(wor_egress::EgressPolicy::development()).unwrap(),
            self.audit.clone(),
            EngineConfig::default(),
        )
    }

    async fn apply(&self, schedule: &str) -> RoutineId {
        self.apply_named("nightly", schedule).await
    }

    async fn apply_named(&self, name: &str, schedule: &str) -> RoutineId {
        let toml = format!(
            "name = \"{name}\"\ninstructions = \"Report.\"\n[model]\nprovider = \"replay\"\n\
             model = \"m\"\nscript = {{ turns = [{{ text = \"hi\" }}] }}\n[concurrency]\nmax_runs = 100\n{schedule}\n"
        );
        self.apply_toml(&toml).await
    }

    /// Applies the routine `toml`; its id.
    async fn apply_toml(&self, toml: &str) -> RoutineId {
        let definition = wor_core::routine::RoutineDefinition::from_toml(toml).unwrap();
        self.db
            .store
            .apply_routine(self.project, toml, &definition, None)
            .await
            .unwrap()
            .routine
            .id
    }

    /// The routine's runs, newest first, as their trigger key and status.
    async fn slot_statuses(&self, routine: RoutineId) -> Vec<(String, wor_core::run::RunStatus)> {
        self.db
            .store
            .list_runs(
                self.project,
                &RunFilter {
                    routine_id: Some(routine),
                    limit: 10,
                    ..Default::default()
                },
            )
            .await
            .unwrap()
            .iter()
            .map(|r| (r.trigger_key.clone().unwrap(), r.status))
            .collect()
    }

    async fn next_slot(&self, routine: RoutineId) -> Option<i64> {
        self.db
            .store
            .schedule_next_slot(self.project, routine)
            .await
            .unwrap()
    }

    /// The slots the routine's runs were started for.
    async fn slots(&self, routine: RoutineId) -> Vec<i64> {
        let runs = self
            .db
            .store
            .list_runs(
                self.project,
                &RunFilter {
                    routine_id: Some(routine),
                    limit: 200,
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        let mut slots: Vec<i64> = runs
            .iter()
            .map(|r| {
                assert_eq!(r.trigger_kind, wor_core::call::TriggerKind::Schedule);
                assert_eq!(r.started_by, None);
                r.trigger_key
                    .as_deref()
                    .unwrap()
                    .strip_prefix("slot:")
                    .unwrap()
                    .parse()
                    .unwrap()
            })
            .collect();
        slots.sort_unstable();
        slots
    }
}

const MINUTE: i64 = 60_000;

/// More routines than one scheduler statement takes, due in the same slot, start in one pass,
/// one run each; a slot still inside its jitter, first in line, holds none of them up.
#[tokio::test]
async fn many_routines_due_at_once_start_in_one_pass() {
    let h = Harness::new().await;
    // A yearly slot: however long applying them takes, every routine shares the next one.
    const YEARLY: &str = "[schedule]\ncron = \"0 0 1 1 *\"";
    let count = 1_100;
    let mut routines = Vec::new();
    for i in 0..count {
        routines.push(h.apply_named(&format!("r{i}"), YEARLY).await);
    }
    let jittered = h
        .apply_named("jittered", &format!("{YEARLY}\njitter_seconds = 50"))
        .await;
    let first = h.next_slot(routines[0]).await.unwrap();
    for routine in &routines {
        assert_eq!(h.next_slot(*routine).await, Some(first));
    }
    let engine = h.engine();
    let report = engine.schedule_tick(first + 200).await.unwrap();
    // The jittered routine may or may not be due 200 ms after its slot; all the others are.
    assert!(
        report.started == count || report.started == count + 1,
        "{report:?}"
    );
    for routine in &routines {
        assert_eq!(h.slots(*routine).await, [first], "one run per routine");
        assert!(h.next_slot(*routine).await > Some(first));
    }
    let again = engine.schedule_tick(first + 300).await.unwrap();
    // Only the jittered routine can still start; nothing starts twice.
    assert!(
        again.started <= 1 && again.already_started == 0,
        "{again:?}"
    );
    for routine in &routines {
        assert_eq!(h.slots(*routine).await, [first]);
    }
    assert!(h.slots(jittered).await.len() <= 1);
    let starts =
        h.db.store
            .audit_entries(h.project, 0, 5_000)
            .await
            .unwrap()
            .iter()
            .filter(|e| e.category == "run.start")
            .count();
    assert_eq!(
        u64::try_from(starts).unwrap(),
        report.started + again.started,
        "every start is on the audit chain"
    );
}

#[tokio::test]
async fn each_slot_starts_one_run_across_restarts_and_concurrent_schedulers() {
    let h = Harness::new().await;
    let routine = h.apply("[schedule]\ncron = \"* * * * *\"").await;
    let first = h.next_slot(routine).await.unwrap();
    assert_eq!(first % MINUTE, 0, "a minute cron fires on the minute");

    let a = h.engine();
    assert_eq!(
        a.schedule_tick(first - DISPATCH_AHEAD_MS - 1)
            .await
            .unwrap()
            .started,
        0,
        "not yet"
    );
    assert_eq!(a.schedule_tick(first + 500).await.unwrap().started, 1);
    assert_eq!(a.schedule_tick(first + 900).await.unwrap().started, 0);
    assert_eq!(h.next_slot(routine).await, Some(first + MINUTE));

    // A restarted scheduler (a new engine on the same database) neither repeats nor skips.
    let b = h.engine();
    assert_eq!(b.schedule_tick(first + 1_000).await.unwrap().started, 0);
    assert_eq!(
        b.schedule_tick(first + MINUTE + 200).await.unwrap().started,
        1
    );

    // Two schedulers ticking at once start the slot once between them.
    let now = first + 2 * MINUTE + 300;
    let (x, y) = tokio::join!(a.schedule_tick(now), b.schedule_tick(now));
    let (x, y) = (x.unwrap(), y.unwrap());
    assert_eq!(x.started + y.started, 1, "{x:?} {y:?}");
    assert_eq!(
        h.slots(routine).await,
        [first, first + MINUTE, first + 2 * MINUTE]
    );

    // The scheduled run's input says which slot it is for, labelled as the engine's.
    let runs =
        h.db.store
            .list_runs(
                h.project,
                &RunFilter {
                    limit: 1,
                    ..Default::default()
                },
            )
            .await
            .unwrap();
    let steps =
        h.db.store
            .list_run_steps(h.project, runs[0].id, 0)
            .await
            .unwrap();
    assert_eq!(steps[0].provenance, Provenance::Engine);
    let wor_core::step::Step::Input(input) = &steps[0].step else {
        panic!("the first step is the input: {:?}", steps[0]);
    };
    assert!(input.text().contains("Scheduled run for slot"), "{input:?}");
    let audit = h.db.store.audit_entries(h.project, 0, 100).await.unwrap();
    assert!(
        audit.iter().any(|e| e.category == "run.start"
            && matches!(e.actor, wor_core::audit::Actor::Schedule { .. })),
        "the audit log names the schedule as the actor"
    );
}

/// A routine whose start cannot change before its slot (overlap `queue`, no memory) has the
/// slot's run recorded ahead of it, which no worker claims before the slot; a routine whose
/// overlap policy or memory depends on the moment starts at its slot. Either way a slot
/// starts one run, across schedulers.
#[tokio::test]
async fn runs_recorded_ahead_of_their_slot_are_claimed_only_from_it() {
    let h = Harness::new().await;
    // A yearly slot: far ahead of the real clock whenever the test runs.
    const YEARLY: &str = "[schedule]\ncron = \"0 0 1 1 *\"";
    let queued = h.apply_named("queued", YEARLY).await;
    let skipping = h
        .apply_named("skipping", &format!("overlap = \"skip\"\n{YEARLY}"))
        .await;
    let remembering = h
        .apply_named(
            "remembering",
            &format!("{YEARLY}\n[memory]\nenabled = true"),
        )
        .await;
    let first = h.next_slot(queued).await.unwrap();
    assert_eq!(h.next_slot(skipping).await, Some(first));
    assert_eq!(h.next_slot(remembering).await, Some(first));

    let a = h.engine();
    let before_lead = a
        .schedule_tick(first - DISPATCH_AHEAD_MS - 1)
        .await
        .unwrap();
    assert_eq!(
        before_lead.started, 0,
        "before the lead nothing is recorded"
    );
    let ahead = a.schedule_tick(first - 1_000).await.unwrap();
    assert_eq!(
        ahead.started, 1,
        "only the queueing routine is recorded ahead"
    );
    assert_eq!(h.slots(queued).await, [first]);
    assert!(h.slots(skipping).await.is_empty());
    assert!(h.slots(remembering).await.is_empty());
    assert!(
        h.next_slot(queued).await > Some(first),
        "its schedule moved on"
    );
    assert_eq!(h.next_slot(skipping).await, Some(first));

    let run =
        h.db.store
            .run_by_trigger_key(h.project, queued, &format!("slot:{first}"))
            .await
            .unwrap()
            .unwrap();
    assert_eq!(run.status, wor_core::run::RunStatus::Queued);
    assert_eq!(run.not_before, Some(first));
    // The slot is months away on the real clock: no worker takes the run now.
    assert!(!a.run_next().await.unwrap(), "claimed before its slot");
    assert!(
        h.db.store
            .claim_run("another-worker", 30_000, 100)
            .await
            .unwrap()
            .is_none()
    );
    let again = h.db.store.get_run(h.project, run.id).await.unwrap();
    assert_eq!(again.status, wor_core::run::RunStatus::Queued);
    assert_eq!(again.started_at, None);

    // Another scheduler inside the lead and both at the slot: each slot still has one run.
    let b = h.engine();
    assert_eq!(b.schedule_tick(first - 500).await.unwrap().started, 0);
    let now = first + 300;
    let (x, y) = tokio::join!(a.schedule_tick(now), b.schedule_tick(now));
    let (x, y) = (x.unwrap(), y.unwrap());
    assert_eq!(x.started + y.started, 2, "{x:?} {y:?}");
    for routine in [queued, skipping, remembering] {
        assert_eq!(h.slots(routine).await, [first]);
    }
    let at_slot =
        h.db.store
            .run_by_trigger_key(h.project, skipping, &format!("slot:{first}"))
            .await
            .unwrap()
            .unwrap();
    assert_eq!(
        at_slot.not_before, None,
        "started at its slot, claimable at once"
    );
}

/// On the real clock: a schedule that fires every second has the runs of its next slots
/// recorded at once, and each is claimed no earlier than its slot.
#[tokio::test]
async fn a_run_recorded_ahead_is_claimed_once_its_slot_comes() {
    let h = Harness::new().await;
    let routine = h
        .apply_named("every-second", "[schedule]\ncron = \"* * * * * *\"")
        .await;
    let first = h.next_slot(routine).await.unwrap();
    let report = h.engine().schedule_tick(first - 1).await.unwrap();
    let recorded = usize::try_from(report.started).unwrap();
    assert!(recorded >= 2, "{report:?}");
    assert_eq!(h.slots(routine).await.len(), recorded);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let mut claimed = 0;
    while claimed < recorded {
        assert!(
            std::time::Instant::now() < deadline,
            "{claimed} of {recorded} claimed"
        );
        let Some(run) = h.db.store.claim_run("worker", 30_000, 100).await.unwrap() else {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            continue;
        };
        let slot: i64 = run
            .trigger_key
            .as_deref()
            .and_then(|k| k.strip_prefix("slot:"))
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(run.not_before, Some(slot));
        let started = run.started_at.unwrap();
        assert!(
            started >= slot,
            "claimed {} ms before its slot",
            slot - started
        );
        claimed += 1;
    }
}

/// Each slot's lag is recorded: from its time to its run's being recorded, 0 for a run
/// recorded ahead of its slot.
#[test]
fn the_lag_of_each_slot_is_a_metric() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};

    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    metrics::with_local_recorder(&recorder, || {
        runtime.block_on(async {
            let h = Harness::new().await;
            // `skip` is started at its slot, never ahead: its two slots are 1.5 s and 0.5 s
            // late when the pass comes.
            let late = h
                .apply_named(
                    "late",
                    "overlap = \"skip\"\n[schedule]\ncron = \"* * * * * *\"",
                )
                .await;
            let first = h.next_slot(late).await.unwrap();
            let wait = first + 1_500 - wor_store::now_millis();
            tokio::time::sleep(std::time::Duration::from_millis(
                u64::try_from(wait).unwrap_or(0),
            ))
            .await;
            let report = h
                .engine()
                .schedule_tick(wor_store::now_millis())
                .await
                .unwrap();
            assert_eq!(report.started, 2, "{report:?}");
            // A yearly `queue` routine (of another database) is recorded ahead: no lag.
            let other = Harness::new().await;
            let ahead = other
                .apply_named("ahead", "[schedule]\ncron = \"0 0 1 1 *\"")
                .await;
            let slot = other.next_slot(ahead).await.unwrap();
            let report = other.engine().schedule_tick(slot - 1_000).await.unwrap();
            assert_eq!(report.started, 1, "{report:?}");
        });
    });
    let mut lags: Vec<f64> = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter(|(key, _, _, _)| key.key().name() == "wor_schedule_lag_seconds")
        .flat_map(|(_, _, _, value)| match value {
            DebugValue::Histogram(values) => values.into_iter().map(|v| v.into_inner()),
            other => panic!("a histogram: {other:?}"),
        })
        .collect();
    lags.sort_by(f64::total_cmp);
    assert_eq!(lags.len(), 3, "{lags:?}");
    assert!(lags[0] == 0.0, "{lags:?}");
    assert!((0.5..5.0).contains(&lags[1]), "{lags:?}");
    assert!((1.5..6.0).contains(&lags[2]), "{lags:?}");
}

#[tokio::test]
async fn missed_slots_are_caught_up_as_the_routine_says() {
    for (policy, expected_missed) in [("skip", 0), ("one", 1), ("all", 5)] {
        let h = Harness::new().await;
        let routine = h
            .apply(&format!(
                "[schedule]\ncron = \"* * * * *\"\ncatch_up = \"{policy}\""
            ))
            .await;
        let first = h.next_slot(routine).await.unwrap();
        // Down for five minutes: slots first … first+4m were missed; first+5m is on time.
        let now = first + 5 * MINUTE + 2_000;
        let report = h.engine().schedule_tick(now).await.unwrap();
        assert_eq!(report.started, expected_missed + 1, "catch_up = {policy}");
        let slots: BTreeSet<i64> = h.slots(routine).await.into_iter().collect();
        assert!(
            slots.contains(&(first + 5 * MINUTE)),
            "{policy}: the on-time slot runs"
        );
        if policy == "one" {
            assert!(
                slots.contains(&(first + 4 * MINUTE)),
                "the latest missed slot"
            );
        }
        assert_eq!(h.next_slot(routine).await, Some(first + 6 * MINUTE));
    }
}

#[tokio::test]
async fn a_new_version_without_a_schedule_stops_firing() {
    let h = Harness::new().await;
    let routine = h
        .apply("[schedule]\ncron = \"*/2 * * * * *\"\ntimezone = \"Europe/Berlin\"")
        .await;
    let first = h.next_slot(routine).await.unwrap();
    let engine = h.engine();
    let version =
        h.db.store
            .get_routine_version(h.project, routine, 1)
            .await
            .unwrap();
    let upcoming = engine
        .next_firings(h.project, routine, &version.definition, 3)
        .await
        .unwrap();
    assert_eq!(upcoming, [first, first + 2_000, first + 4_000]);
    // Re-applying the same schedule keeps its place; removing it stops it.
    h.apply("[schedule]\ncron = \"*/2 * * * * *\"\ntimezone = \"Europe/Berlin\"\n# same")
        .await;
    assert_eq!(h.next_slot(routine).await, Some(first));
    h.apply("").await;
    assert_eq!(h.next_slot(routine).await, None);
    assert_eq!(
        engine.schedule_tick(first + 10_000).await.unwrap().started,
        0
    );
    assert!(h.slots(routine).await.is_empty());
}

/// After an outage, a `skip` routine with one place runs its slot on time and records the
/// caught-up one skipped, rather than running the old slot and skipping the current one.
#[tokio::test]
async fn after_an_outage_a_skip_routine_runs_the_slot_on_time_and_skips_the_caught_up_one() {
    let h = Harness::new().await;
    let toml = "name = \"latest\"\ninstructions = \"Report.\"\n[model]\nprovider = \"replay\"\n\
                model = \"m\"\nscript = { turns = [{ text = \"hi\" }] }\n[concurrency]\nmax_runs = 1\n\
                overlap = \"skip\"\n[schedule]\ncron = \"* * * * *\"\ncatch_up = \"one\"\n";
    let routine = h.apply_toml(toml).await;
    let first = h.next_slot(routine).await.unwrap();
    let engine = h.engine();
    // The scheduler was down for five slots: the latest missed one and the one on time fire.
    let report = engine
        .schedule_tick(first + 5 * MINUTE + 200)
        .await
        .unwrap();
    assert_eq!(report.started, 2, "{report:?}");
    let runs = h.slot_statuses(routine).await;
    assert_eq!(
        runs,
        [
            (
                format!("slot:{}", first + 5 * MINUTE),
                wor_core::run::RunStatus::Queued
            ),
            (
                format!("slot:{}", first + 4 * MINUTE),
                wor_core::run::RunStatus::Skipped
            ),
        ]
    );
}

/// A scheduled start of a `cancel_previous` routine cancels the run of the slot before it.
#[tokio::test]
async fn a_scheduled_start_under_cancel_previous_replaces_the_run_before_it() {
    let h = Harness::new().await;
    let toml = "name = \"replacing\"\ninstructions = \"Report.\"\n[model]\nprovider = \"replay\"\n\
                model = \"m\"\nscript = { turns = [{ text = \"hi\" }] }\n[concurrency]\nmax_runs = 1\n\
                overlap = \"cancel_previous\"\n[schedule]\ncron = \"* * * * *\"\n";
    let routine = h.apply_toml(toml).await;
    let first = h.next_slot(routine).await.unwrap();
    let engine = h.engine();
    assert_eq!(engine.schedule_tick(first + 200).await.unwrap().started, 1);
    assert_eq!(
        engine
            .schedule_tick(first + MINUTE + 200)
            .await
            .unwrap()
            .started,
        1
    );
    let runs = h.slot_statuses(routine).await;
    assert_eq!(
        runs,
        [
            (
                format!("slot:{}", first + MINUTE),
                wor_core::run::RunStatus::Queued
            ),
            (format!("slot:{first}"), wor_core::run::RunStatus::Cancelled),
        ]
    );
    // The schedule asked for the cancel, naming the policy.
    let replaced =
        h.db.store
            .run_by_trigger_key(h.project, routine, &format!("slot:{first}"))
            .await
            .unwrap()
            .unwrap()
            .id
            .to_string();
    let audit = h.db.store.audit_entries(h.project, 0, 100).await.unwrap();
    let cancel = audit
        .iter()
        .find(|e| e.category == "run.cancel" && e.subjects.get("run_id") == Some(&replaced))
        .expect("the replaced run's cancel is on the audit chain");
    assert_eq!(
        cancel.actor,
        wor_core::audit::Actor::Schedule {
            routine_id: routine
        }
    );
    assert_eq!(cancel.payload["overlap"], "cancel_previous");
}
