//! The scheduler: starts the runs of every schedule whose slot is due, in batches.
//!
//! One statement finds a batch of due schedules (oldest slot first, paged by slot and routine
//! so that a slot still inside its jitter never holds up the ones after it); each routine's
//! plan says which slots fire; then one transaction records every run of the batch with its
//! input and moves every schedule on, and the runs' start entries join the audit chain
//! together. A slot starts at most one run whichever process gets there (its trigger key is
//! unique), and a schedule only moves forward by compare-and-set.
//!
//! A routine whose start cannot depend on when it is decided — overlap policy `queue`, no
//! memory — has the run of its next slot recorded up to [`DISPATCH_AHEAD_MS`] before the
//! slot, with `not_before` set to the slot plus its jitter: no worker claims it earlier, and
//! when thousands of routines share a slot their rows are all written when it comes. Every
//! other routine's slot is started at its time, as its overlap policy and memory then say.

use std::collections::HashMap;
use std::sync::Arc;

use serde_json::Value;
use tokio::task::JoinHandle;
use wor_core::ProjectId;
use wor_core::audit::Actor;
use wor_core::routine::{OverlapPolicy, RoutineDefinition};
use wor_core::run::RunStatus;
use wor_core::schedule::slot_rfc3339;
use wor_secrets::Redactor;
use wor_store::{DueSchedule, RoutineVersionRecord, ScheduleAdvance, ScheduledStart};

use crate::start::{Admission, run_started};
use crate::{Engine, EngineError, StartRun, Trigger};

/// How many due schedules one statement takes.
const SCHEDULE_BATCH: usize = 1_000;

/// How long before its slot (plus jitter) a run may be recorded, to be claimed from then on.
pub const DISPATCH_AHEAD_MS: i64 = 5_000;

/// What one scheduler pass did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SchedulerReport {
    /// Runs started (including ones recorded as skipped by the overlap policy).
    pub started: u64,
    /// Slots another scheduler process had already started.
    pub already_started: u64,
}

/// At most this many slots of one schedule are recorded ahead in one pass (a schedule that
/// fires every second has several inside [`DISPATCH_AHEAD_MS`]).
const MAX_AHEAD_SLOTS: usize = 8;

/// What a scheduler page read for one due schedule, together with the others'.
struct Prefetched {
    /// Its routine's version; `None` when the page's read did not find it.
    version: Option<Arc<RoutineVersionRecord>>,
    /// How many runs of its routine are active.
    active: u64,
}

/// A slot that fires in this pass, as admitted.
struct Firing {
    project: ProjectId,
    version: Arc<RoutineVersionRecord>,
    admission: Admission,
    /// When the slot is due: its time plus its jitter.
    due_at: i64,
    /// For a run recorded ahead of its slot: `due_at`, before which no worker claims it.
    not_before: Option<i64>,
}

impl Engine {
    /// One scheduler pass at `now` (Unix ms): every scheduled routine whose next slot is due
    /// starts its slots as its catch-up and jitter settings say, and the routines that may
    /// have their next slot's run recorded ahead of it ([`DISPATCH_AHEAD_MS`]) have it
    /// recorded, claimable from the slot on.
    pub async fn schedule_tick(&self, now: i64) -> Result<SchedulerReport, EngineError> {
        let mut report = SchedulerReport::default();
        // The start entries of each page, being appended while the next page is written.
        let mut appending = Vec::new();
        let mut after = None;
        let horizon = now.saturating_add(DISPATCH_AHEAD_MS);
        loop {
            let due = self
                .store
                .due_schedules(horizon, after, SCHEDULE_BATCH)
                .await?;
            let Some(last) = due.last() else { break };
            after = Some((last.next_slot_at, last.routine_id));
            let full = due.len() == SCHEDULE_BATCH;
            // A page that cannot be written is retried on the next pass; the pages after it
            // still start now.
            match self.start_due(&due, now, &mut report).await {
                Ok(appended) => appending.extend(appended),
                Err(error) => {
                    tracing::error!(category = "schedule", error = %error, schedules = due.len(),
                        "a page of due schedules could not be started; it is retried next pass");
                }
            }
            if !full {
                break;
            }
        }
        // A failed append is logged by the task (`Engine::append_staged_or_log`); here only a
        // task that did not finish.
        for appended in appending {
            if let Err(error) = appended.await {
                tracing::error!(category = "schedule", error = %error,
                    "the task appending a page's start entries did not finish; they stay staged for the audit writer's sweep");
            }
        }
        Ok(report)
    }

    /// Starts the due slots of one batch of schedules and moves the schedules on; returns the
    /// task appending the runs' start entries to the audit chain, which then cancels what
    /// the starts of `cancel_previous` routines replaced and wakes the worker pool (the next
    /// page is written meanwhile).
    async fn start_due(
        &self,
        due: &[DueSchedule],
        now: i64,
        report: &mut SchedulerReport,
    ) -> Result<Option<JoinHandle<()>>, EngineError> {
        let mut firings = Vec::new();
        let mut advances = Vec::new();
        let mut redactors: HashMap<ProjectId, Redactor> = HashMap::new();
        // The page's versions and active-run counts are read together, not one each.
        let keys: Vec<_> = due
            .iter()
            .map(|s| (s.project_id, s.routine_id, s.version))
            .collect();
        let versions = self.routine_versions(&keys).await;
        let routines: Vec<_> = due.iter().map(|s| (s.project_id, s.routine_id)).collect();
        let active = self.store.active_run_counts(&routines).await?;
        for (schedule, key) in due.iter().zip(&keys) {
            let page = Prefetched {
                version: versions.get(key).cloned(),
                active: active.get(&schedule.routine_id).copied().unwrap_or(0),
            };
            // One schedule's trouble never holds up the others.
            match self
                .plan_schedule(schedule, page, now, &mut redactors, &mut firings)
                .await
            {
                Ok(advance) => advances.extend(advance),
                Err(error) => {
                    tracing::error!(category = "schedule", routine_id = %schedule.routine_id, error = %error,
                        "a schedule could not be processed; it is retried next pass");
                }
            }
        }
        if firings.is_empty() && advances.is_empty() {
            return Ok(None);
        }
        let starts = firings
            .iter()
            .map(|f| ScheduledStart {
                project: f.project,
                run: f.admission.run.clone(),
                input: f.admission.input.clone(),
                not_before: f.not_before,
            })
            .collect();
        // When the runs recorded ahead become claimable, and whether any is claimable now.
        let mut release = None::<i64>;
        let mut claimable_now = false;
        // Each run's `run.start` is staged with the run: a crash before they are appended
        // leaves them for the audit writer's sweep.
        // A scheduled run's starter is its schedule, as `Engine::admit` names it.
        let entry = |start: &ScheduledStart, id: wor_core::RunId| {
            let actor = Actor::Schedule {
                routine_id: start.run.routine_id,
            };
            run_started(start.project, id, &start.run, actor)
        };
        let (started, staged) = self
            .store
            .start_scheduled(starts, &advances, &entry)
            .await?;
        let recorded = wor_store::now_millis();
        // The routines of overlap `cancel_previous` a run was recorded for, once each.
        let mut cancelling = std::collections::BTreeSet::new();
        for (firing, recorded_as) in firings.into_iter().zip(started) {
            let Some((id, status)) = recorded_as else {
                report.already_started += 1;
                continue;
            };
            report.started += 1;
            let Firing {
                project,
                version,
                admission,
                due_at,
                not_before,
            } = firing;
            crate::metrics::slot_started(due_at, recorded);
            let concurrency = &version.definition.concurrency;
            if concurrency.overlap == OverlapPolicy::CancelPrevious {
                cancelling.insert((project, admission.run.routine_id, concurrency.max_runs));
            }
            match (status, not_before) {
                (RunStatus::Queued, Some(at)) => release = Some(release.map_or(at, |r| r.min(at))),
                (RunStatus::Queued, None) => claimable_now = true,
                _ => {}
            }
            tracing::info!(category = "run", action = "run.start", project_id = %project,
                run_id = %id, routine_id = %admission.run.routine_id, version = version.version,
                status = status.as_str(), not_before = ?not_before, "run started");
        }
        // The start entries go to the audit writer together, which commits them in as few
        // transactions as its batch allows.
        let engine = self.clone();
        Ok(Some(tokio::spawn(async move {
            engine.append_staged_or_log(staged).await;
            // After the starts' entries, so a run recorded by this page and replaced by a
            // later slot of it ends after its `run.start`.
            for (project, routine, max_runs) in cancelling {
                let schedule = Actor::Schedule {
                    routine_id: routine,
                };
                if let Err(error) = engine
                    .cancel_previous(project, routine, max_runs, &schedule)
                    .await
                {
                    tracing::error!(category = "schedule", routine_id = %routine, error = %error,
                        "the runs a scheduled start of a `cancel_previous` routine replaced could not be asked to stop");
                }
            }
            if claimable_now {
                engine.wake_workers();
            }
            // Runs recorded ahead become claimable at their slot: the pool looks then rather
            // than at its next poll.
            if let Some(at) = release {
                engine.wake_workers_at(at);
            }
        })))
    }

    /// Wakes this process's worker pool at `at` (Unix ms), when runs recorded ahead of their
    /// slot become claimable.
    fn wake_workers_at(&self, at: i64) {
        let wait = u64::try_from(at.saturating_sub(wor_store::now_millis())).unwrap_or(0);
        let engine = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(std::time::Duration::from_millis(wait)).await;
            engine.wake_workers();
        });
    }

    /// Plans one due schedule: admits the runs of its slots that fire now into `firings`, and
    /// returns how its schedule moves on (`None` when it stays, its next slot still inside
    /// its jitter).
    async fn plan_schedule(
        &self,
        schedule: &DueSchedule,
        page: Prefetched,
        now: i64,
        redactors: &mut HashMap<ProjectId, Redactor>,
        firings: &mut Vec<Firing>,
    ) -> Result<Option<ScheduleAdvance>, EngineError> {
        let version = match page.version {
            Some(version) => version,
            None => {
                self.routine_version(schedule.project_id, schedule.routine_id, schedule.version)
                    .await?
            }
        };
        let stop = ScheduleAdvance {
            routine: schedule.routine_id,
            from: schedule.next_slot_at,
            to: None,
        };
        let routine = schedule.routine_id.to_string();
        let key = (schedule.project_id, schedule.routine_id, version.version);
        let (mut plan, compiled) = match self.versions.schedule(key, &version) {
            Some(Ok(compiled)) => (
                compiled.plan(&routine, schedule.next_slot_at, now),
                compiled,
            ),
            Some(Err(reason)) => {
                tracing::error!(category = "schedule", routine_id = %schedule.routine_id, reason = %reason,
                    "a stored schedule does not compile; it is stopped");
                return Ok(Some(stop));
            }
            None => return Ok(Some(stop)),
        };
        // The slots after those due now whose time comes within the lead, for a routine whose
        // start is the same whenever it is decided.
        // Each slot is due at its time plus its jitter, and not before the slot ahead of it
        // (`Schedule::plan`): the slots due now, then those recorded ahead, in order.
        let mut ready_at = i64::MIN;
        let mut due = |slot: i64| {
            ready_at = slot
                .saturating_add(compiled.jitter_of(&routine, slot))
                .max(ready_at);
            ready_at
        };
        let mut slots: Vec<(i64, i64, bool)> = plan
            .fire
            .iter()
            .map(|slot| (*slot, due(*slot), false))
            .collect();
        if may_dispatch_ahead(&version.definition) {
            let mut ahead = 0;
            while let Some(slot) = plan.next_slot {
                let at = due(slot);
                if at <= now
                    || at > now.saturating_add(DISPATCH_AHEAD_MS)
                    || ahead >= MAX_AHEAD_SLOTS
                {
                    break;
                }
                slots.push((slot, at, true));
                ahead += 1;
                plan.next_slot = compiled.next_after(slot);
            }
        }
        if !slots.is_empty() {
            let redactor = match redactors.entry(schedule.project_id) {
                std::collections::hash_map::Entry::Occupied(found) => found.into_mut(),
                std::collections::hash_map::Entry::Vacant(slot) => {
                    slot.insert(self.project_redactor(schedule.project_id).await?)
                }
            };
            let mut active = page.active;
            // Under overlap `skip` the newest slots take the free places: after an outage the
            // slot on time runs and a caught-up one is recorded skipped, not the reverse. The
            // runs are still recorded oldest first.
            let newest_first =
                version.definition.concurrency.overlap == OverlapPolicy::Skip && slots.len() > 1;
            let slots: Vec<_> = if newest_first {
                slots.into_iter().rev().collect()
            } else {
                slots
            };
            let first_firing = firings.len();
            for (slot, due_at, ahead) in slots {
                let request = StartRun {
                    project: schedule.project_id,
                    routine: schedule.routine_id,
                    input: Value::String(format!("Scheduled run for slot {}.", slot_rfc3339(slot))),
                    trigger: Trigger::Schedule { slot },
                    actor: None,
                    thread: None,
                    idempotency_key: None,
                };
                // A slot whose run cannot start (the routine is refused, say) is logged and
                // passed, not retried forever.
                match self.admit(&request, &version, Some(active), redactor).await {
                    Ok(admission) => {
                        if admission.run.status == RunStatus::Queued {
                            active = active.saturating_add(1);
                        }
                        firings.push(Firing {
                            project: schedule.project_id,
                            version: version.clone(),
                            admission,
                            due_at,
                            not_before: ahead.then_some(due_at),
                        });
                    }
                    Err(error) => {
                        tracing::error!(category = "schedule", routine_id = %schedule.routine_id,
                            slot = %slot_rfc3339(slot), error = %error,
                            "a scheduled run could not start; the slot is passed");
                    }
                }
            }
            if newest_first && let Some(these) = firings.get_mut(first_firing..) {
                these.reverse();
            }
        }
        Ok(
            (plan.next_slot != Some(schedule.next_slot_at)).then_some(ScheduleAdvance {
                to: plan.next_slot,
                ..stop
            }),
        )
    }
}

/// Whether a routine's scheduled runs may be recorded ahead of their slot: only when what the
/// start decides cannot change before the slot. Overlap `queue` queues the run whatever is
/// active (the claim holds `max_runs`); `skip` and `cancel_previous` look at the runs active
/// at the slot, and `[memory]` replays the thread as it stands at the slot.
fn may_dispatch_ahead(definition: &RoutineDefinition) -> bool {
    definition.concurrency.overlap == OverlapPolicy::Queue && !definition.memory.enabled
}
