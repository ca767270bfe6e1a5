//! Starting runs: the routine's current version, its concurrency policy, and the input as the
//! requester's first step.

use wor_core::audit::{Actor, AuditCategory, AuditEvent};
use wor_core::call::TriggerKind;
use wor_core::routine::OverlapPolicy;
use wor_core::run::{IdempotencyKey, Provenance, RunStatus};
use wor_core::step::{InputSource, InputStep, MemoryStep, new_boundary};
use wor_core::{ApiKeyId, MemberId, ProjectId, RoutineId, RunId};
use wor_secrets::Redactor;
use wor_store::{NewRun, RoutineVersionRecord, RunRecord, skipped_outcome};

use crate::{Engine, EngineError};

/// What started a run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Trigger {
    /// An API call, by this key.
    Api(ApiKeyId),
    /// A member signed in to the console (no key involved). Recorded with trigger kind
    /// `api`: a person asked for the run, as through the API.
    Console(MemberId),
    /// The routine's schedule, for this slot (Unix ms); a slot starts at most one run.
    Schedule { slot: i64 },
    /// A signed inbound webhook; a delivery id starts at most one run. Its payload is
    /// untrusted input.
    Webhook { delivery: String },
}

impl Trigger {
    pub fn kind(&self) -> TriggerKind {
        match self {
            Trigger::Api(_) | Trigger::Console(_) => TriggerKind::Api,
            Trigger::Schedule { .. } => TriggerKind::Schedule,
            Trigger::Webhook { .. } => TriggerKind::Webhook,
        }
    }
}

/// A request to start a run.
#[derive(Debug, Clone)]
pub struct StartRun {
    pub project: ProjectId,
    pub routine: RoutineId,
    /// The requester's input: text or any JSON value.
    pub input: serde_json::Value,
    pub trigger: Trigger,
    /// Who the audit log names as starting the run; `None` names the trigger's key.
    pub actor: Option<Actor>,
    /// The memory thread (routines with `[memory]`); `None` is the thread `default`.
    pub thread: Option<String>,
    /// The requester's key for this start (an API or console start only): a start under a
    /// key that already started a run of the routine starts nothing and answers with that run.
    pub idempotency_key: Option<IdempotencyKey>,
}

/// What a start did.
#[derive(Debug, Clone)]
pub enum Started {
    /// The request started this run (or recorded it skipped).
    New(RunRecord),
    /// The request's idempotency key had already started this run, with the same input and
    /// thread: nothing new was started.
    Earlier(RunRecord),
}

/// What differs between a start and the earlier one under its idempotency key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Differs {
    Input,
    Thread,
    InputAndThread,
}

impl std::fmt::Display for Differs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Differs::Input => "other input",
            Differs::Thread => "another thread",
            Differs::InputAndThread => "other input and another thread",
        })
    }
}

impl Started {
    /// The run, new or earlier.
    pub fn into_run(self) -> RunRecord {
        match self {
            Started::New(run) | Started::Earlier(run) => run,
        }
    }
}

/// The thread a run without one belongs to.
pub const DEFAULT_THREAD: &str = "default";
/// Longest thread name accepted.
pub(crate) const MAX_THREAD_CHARS: usize = 128;

/// What a start decided before anything is written: the run to record, its input, and who the
/// audit log names as starting it.
pub(crate) struct Admission {
    pub run: NewRun,
    pub input: InputStep,
    pub actor: Actor,
}

impl Engine {
    /// Starts a run of the routine's current version, applying its overlap policy: queued,
    /// or claimed at once when this process's pool has a free slot (`running`), or skipped.
    /// Under an idempotency key that already started a run of the routine, starts nothing and
    /// answers with that run, if it was asked for with the same input and thread
    /// ([`EngineError::IdempotencyKeyReused`] if not); two such starts at the same moment
    /// record one run, which both answer with.
    pub async fn start_run(&self, request: StartRun) -> Result<Started, EngineError> {
        let Some(key) = &request.idempotency_key else {
            return self.start_new(&request).await.map(Started::New);
        };
        // The key is kept and shown in the clear, as the run's trigger key: never a secret's.
        let redactor = self.project_redactor(request.project).await?;
        if redactor.redact(key.as_str()) != key.as_str() {
            return Err(EngineError::IdempotencyKeySecret);
        }
        if let Some(earlier) = self.started_under(&request, key, &redactor).await? {
            return Ok(Started::Earlier(earlier));
        }
        match self.start_new(&request).await {
            // Another start under the key recorded its run since this one looked.
            Err(EngineError::Store(wor_store::StoreError::Conflict(message))) => {
                match self.started_under(&request, key, &redactor).await? {
                    Some(earlier) => Ok(Started::Earlier(earlier)),
                    None => Err(wor_store::StoreError::Conflict(message).into()),
                }
            }
            started => started.map(Started::New),
        }
    }

    /// The run `key` already started of `request`'s routine, if any, when `request` asks for
    /// it again: the same input (as recorded, redacted with `redactor`) and the same thread.
    async fn started_under(
        &self,
        request: &StartRun,
        key: &IdempotencyKey,
        redactor: &Redactor,
    ) -> Result<Option<RunRecord>, EngineError> {
        let Some(earlier) = self
            .store
            .run_by_trigger_key(request.project, request.routine, &key.trigger_key())
            .await?
        else {
            return Ok(None);
        };
        let recorded = self
            .store
            .list_run_steps_page(request.project, earlier.id, 0, 1)
            .await?;
        let recorded_input = recorded.first().and_then(|step| match &step.step {
            wor_core::step::Step::Input(input) => Some(&input.input),
            _ => None,
        });
        let mut input = request.input.clone();
        redactor.redact_json(&mut input);
        let thread = |thread: Option<&str>| thread.map_or(DEFAULT_THREAD, str::trim).to_owned();
        let other_input = recorded_input != Some(&input);
        let other_thread = thread(request.thread.as_deref()) != thread(earlier.thread.as_deref());
        let differs = match (other_input, other_thread) {
            (false, false) => return Ok(Some(earlier)),
            (true, false) => Differs::Input,
            (false, true) => Differs::Thread,
            (true, true) => Differs::InputAndThread,
        };
        Err(EngineError::IdempotencyKeyReused {
            key: key.clone(),
            run: earlier.id,
            differs,
        })
    }

    /// Starts a new run of `request`: [`Engine::start_run`] once no earlier run answers it.
    async fn start_new(&self, request: &StartRun) -> Result<RunRecord, EngineError> {
        let routine = self
            .store
            .get_routine(request.project, request.routine)
            .await?;
        let version = self
            .routine_version(request.project, routine.id, routine.current_version)
            .await?;
        let definition = &version.definition;
        // Only `skip` counts the routine's active runs before the start: `queue` queues the
        // run whatever is active (its claim holds `max_runs`) and `cancel_previous` cancels
        // once the run is recorded, so a start of such a routine costs the same however many
        // of its runs are parked.
        let active = match definition.concurrency.overlap {
            OverlapPolicy::Skip => Some(
                self.store
                    .active_run_count(request.project, routine.id, definition.concurrency.max_runs)
                    .await?,
            ),
            OverlapPolicy::Queue | OverlapPolicy::CancelPrevious => None,
        };
        let redactor = self.project_redactor(request.project).await?;
        let Admission {
            run: new,
            input,
            actor,
        } = self.admit(request, &version, active, &redactor).await?;
        let starter = actor.clone();
        // With a slot of this process's pool free, the run is claimed as it is created and
        // driven here at once; otherwise it waits in the queue for any worker.
        let slot = if new.status == RunStatus::Queued {
            self.pool.free_slot()
        } else {
            None
        };
        // Only a run the overlap policy may yet skip keeps what recording it skipped takes.
        let skippable = new
            .skip_at
            .is_some()
            .then(|| (new.clone(), input.clone(), actor.clone()));
        let run = match (
            self.create_admitted(request.project, new, input, actor, slot)
                .await,
            skippable,
        ) {
            // Runs started at the same moment filled the routine since it was counted: this
            // one is skipped, as it would have been a moment later.
            (
                Err(EngineError::Store(wor_store::StoreError::RoutineFull { active, max })),
                Some((new, input, actor)),
            ) => {
                let skipped = NewRun {
                    status: RunStatus::Skipped,
                    outcome: Some(skipped_outcome(active, max)),
                    skip_at: None,
                    ..new
                };
                self.create_started(request.project, skipped, input, actor, None)
                    .await?
            }
            (created, _) => created?,
        };
        // The run is recorded (and may be driven): a cancel that fails is logged, not the
        // start's answer, so a caller does not start it again.
        let run = if definition.concurrency.overlap == OverlapPolicy::CancelPrevious {
            match self
                .cancel_previous(
                    request.project,
                    routine.id,
                    definition.concurrency.max_runs,
                    &starter,
                )
                .await
            {
                // A start whose own run another one at the same moment replaced says so.
                Ok(cancelled) if cancelled.contains(&run.id) => {
                    self.store.get_run(request.project, run.id).await?
                }
                Ok(_) => run,
                Err(error) => {
                    tracing::error!(category = "run", project_id = %request.project, run_id = %run.id,
                        routine_id = %routine.id, error = %error,
                        "the runs a start of a `cancel_previous` routine replaced could not all be asked to stop");
                    run
                }
            }
        } else {
            run
        };
        tracing::info!(category = "run", action = "run.start", project_id = %request.project,
            run_id = %run.id, routine_id = %routine.id, version = version.version,
            status = run.status.as_str(), "run started");
        Ok(run)
    }

    /// Overlap `cancel_previous`, once a start is recorded: cancels the routine's active runs
    /// beyond its newest `max_runs`, and returns them, each cancel's `run.cancel` naming
    /// `starter` (who started the run that replaces them) and the policy. Starts at the same moment each look
    /// after their own run is recorded, so the last to look sees every one of them and leaves
    /// only the newest. Newest is by run id, which orders runs by when the process that
    /// recorded them made them: of runs recorded within the processes' clock skew of each
    /// other, which is kept is arbitrary, but always the same for every start that looks.
    pub(crate) async fn cancel_previous(
        &self,
        project: ProjectId,
        routine: RoutineId,
        max_runs: u64,
        starter: &Actor,
    ) -> Result<Vec<RunId>, EngineError> {
        // A page at a time: each page asked to stop leaves the next among the active ones.
        const MAX_PAGES: usize = 100;
        let mut cancelled = Vec::new();
        for _ in 0..MAX_PAGES {
            let surplus = self
                .store
                .surplus_active_runs(project, routine, max_runs)
                .await?;
            let full_page = surplus.len() >= wor_store::SURPLUS_PAGE;
            for run in surplus {
                let requester = (starter.clone(), Some(OverlapPolicy::CancelPrevious));
                self.cancel_as(project, run, Some(requester)).await?;
                cancelled.push(run);
            }
            if !full_page {
                break;
            }
        }
        Ok(cancelled)
    }

    /// Creates run `new` as admitted: claimed in `slot` of this process's pool when it has
    /// one, else queued (or skipped) for any worker.
    async fn create_admitted(
        &self,
        project: ProjectId,
        new: NewRun,
        input: InputStep,
        actor: Actor,
        slot: Option<tokio::sync::OwnedSemaphorePermit>,
    ) -> Result<RunRecord, EngineError> {
        Ok(match slot {
            // On a task of its own from the claim to the hand-over, so a caller that goes away
            // meanwhile (a client hanging up) cannot leave the run claimed with no driver.
            Some(slot) => {
                let engine = self.clone();
                tokio::spawn(async move {
                    engine
                        .create_started(project, new, input, actor, Some(slot))
                        .await
                })
                .await
                .map_err(|error| EngineError::StartTask(error.to_string()))??
            }
            None => {
                self.create_started(project, new, input, actor, None)
                    .await?
            }
        })
    }

    /// Creates run `new` of `project` and records its start. With a `slot` of this process's
    /// pool, the run is claimed as it is created when the limits and the queue allow it and
    /// handed to the pool in that slot. Otherwise the run is queued (or skipped) for any worker.
    async fn create_started(
        &self,
        project: ProjectId,
        new: NewRun,
        input: InputStep,
        actor: Actor,
        slot: Option<tokio::sync::OwnedSemaphorePermit>,
    ) -> Result<RunRecord, EngineError> {
        // The run's `run.start` is staged with the run: a crash before it is appended here
        // leaves it for the audit writer's sweep, never a run without its entry.
        let started = |id: RunId| run_started(project, id, &new, actor.clone());
        let terms = slot
            .as_ref()
            .map(|_| self.claim_terms(&self.config.worker_id));
        let (run, staged) = self
            .store
            .create_run_staged(project, new.clone(), input, terms, Some(&started))
            .await?;
        // The start has happened and its entry is on disk: the run goes on whatever the append.
        self.append_staged_or_log(staged).await;
        match (run.status, slot) {
            (RunStatus::Running, Some(slot)) => {
                crate::metrics::run_claimed(&run, run.created_at);
                self.drive_started(run.clone(), slot).await;
            }
            (status, slot) => {
                drop(slot);
                if status == RunStatus::Queued {
                    self.wake_workers();
                }
            }
        }
        Ok(run)
    }

    /// Decides how `request` starts a run of `version` with `active` runs of the routine
    /// active (`None`: not counted, as only overlap policy `skip` needs the count): queued, or
    /// skipped by the overlap policy; its input redacted with `redactor` and its memory
    /// replayed.
    pub(crate) async fn admit(
        &self,
        request: &StartRun,
        version: &RoutineVersionRecord,
        active: Option<u64>,
        redactor: &Redactor,
    ) -> Result<Admission, EngineError> {
        let definition = &version.definition;
        if let Some(refusal) = definition
            .production_refusal()
            .filter(|_| self.config.production)
        {
            return Err(EngineError::RefusedInProduction(refusal));
        }
        let max = definition.concurrency.max_runs;
        let full = active.filter(|active| *active >= max);
        let (status, outcome) = match (full, definition.concurrency.overlap) {
            (Some(active), OverlapPolicy::Skip) => {
                (RunStatus::Skipped, Some(skipped_outcome(active, max)))
            }
            _ => (RunStatus::Queued, None),
        };
        let routine_id = version.routine_id;
        let started_by_member = match request.trigger {
            Trigger::Console(member) => Some(member),
            _ => None,
        };
        let requested_key = request
            .idempotency_key
            .as_ref()
            .map(IdempotencyKey::trigger_key);
        let (started_by, trigger_key, provenance, default_actor) = match &request.trigger {
            Trigger::Api(key) => (
                Some(*key),
                requested_key,
                Provenance::Requester,
                Actor::ApiKey { key_id: *key },
            ),
            Trigger::Console(member) => (
                None,
                requested_key,
                Provenance::Requester,
                Actor::ConsoleMember { member_id: *member },
            ),
            Trigger::Schedule { slot } => (
                None,
                Some(format!("slot:{slot}")),
                Provenance::Engine,
                Actor::Schedule { routine_id },
            ),
            Trigger::Webhook { delivery } => (
                None,
                Some(format!("delivery:{delivery}")),
                Provenance::Untrusted,
                Actor::Webhook { routine_id },
            ),
        };
        // The input is recorded, and later sent to the model, without secrets. A webhook's
        // payload is untrusted: it reaches the model inside a boundary fixed now.
        let mut input = request.input.clone();
        redactor.redact_json(&mut input);
        let input = match request.trigger {
            Trigger::Webhook { .. } => InputStep::untrusted(input, InputSource::Webhook),
            _ => InputStep::requested(input),
        };
        // Memory is replayed with the labels it was stored with; one untrusted entry makes the
        // whole memory step untrusted, so decisions see it from the first call.
        if request.thread.is_some() && !definition.memory.enabled {
            return Err(EngineError::ThreadWithoutMemory);
        }
        let thread = match &request.thread {
            Some(thread) => {
                let thread = thread.trim();
                if thread.is_empty()
                    || thread.chars().count() > MAX_THREAD_CHARS
                    || thread.chars().any(char::is_control)
                {
                    return Err(EngineError::InvalidThread);
                }
                thread.to_owned()
            }
            None => DEFAULT_THREAD.to_owned(),
        };
        let memory = if definition.memory.enabled {
            let entries = self
                .store
                .thread_memory(
                    request.project,
                    routine_id,
                    &thread,
                    definition.memory.max_entries,
                )
                .await?;
            (!entries.is_empty()).then(|| {
                let provenance = if entries
                    .iter()
                    .any(|e| e.provenance == Provenance::Untrusted)
                {
                    Provenance::Untrusted
                } else {
                    Provenance::Requester
                };
                (
                    provenance,
                    MemoryStep {
                        thread: thread.clone(),
                        entries,
                        boundary: new_boundary(),
                    },
                )
            })
        } else {
            None
        };
        Ok(Admission {
            run: NewRun {
                routine_id,
                routine_version: version.version,
                trigger_kind: request.trigger.kind(),
                started_by,
                started_by_member,
                max_concurrent: max,
                status,
                outcome,
                trigger_key,
                input_provenance: provenance,
                thread: definition.memory.enabled.then_some(thread),
                memory,
                parent: None,
                skip_at: (status == RunStatus::Queued
                    && definition.concurrency.overlap == OverlapPolicy::Skip)
                    .then_some(max),
            },
            input,
            actor: request.actor.clone().unwrap_or(default_actor),
        })
    }
}

/// The audit entry of the start of run `id`, recorded as `run`.
pub(crate) fn run_started(project: ProjectId, id: RunId, run: &NewRun, actor: Actor) -> AuditEvent {
    let root = run.parent.as_ref().map_or(id, |p| p.root);
    let parent = run.parent.as_ref().map(|p| p.parent);
    AuditEvent::new(project, AuditCategory::RunStart, actor)
        .subject("run_id", id)
        .subject("routine_id", run.routine_id)
        .runs(root, parent)
        .payload(serde_json::json!({
            "routine_version": run.routine_version,
            "trigger": run.trigger_kind.as_str(),
            "status": run.status.as_str(),
        }))
}
