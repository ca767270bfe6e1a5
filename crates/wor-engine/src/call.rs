//! What the driver, the tool pipeline and nested runs share, so they need not import each
//! other: the scope one tool call is answered in, the builder of a run's audit events, and the
//! one guard that stops a wait on a cancel request, the run's deadline or a lost lease.

use std::collections::BTreeSet;
use std::time::Duration;

use serde_json::json;
use wor_core::RunId;
use wor_core::audit::{Actor, AuditCategory, AuditEvent};
use wor_core::budget::BudgetUsage;
use wor_core::model::ToolResult;
use wor_core::provenance::ContentIndex;
use wor_core::routine::{BudgetLimits, RoutineDefinition};
use wor_core::run::Provenance;
use wor_core::run_loop::CallOutcome;
use wor_core::step::{ModelTurnStep, PendingCall, Step, ToolCallStep, ToolResultStep};
use wor_policy::PolicyEngine;
use wor_secrets::Redactor;
use wor_store::{RunRecord, RunWrite, RunWritten};

use crate::authority::RunAuthority;
use crate::run_tools::RunTools;
use crate::{Engine, EngineError};

/// How often a waiting worker looks for a cancel request and renews its lease.
const CANCEL_POLL: Duration = Duration::from_millis(250);

/// The ticks of a wait's cancel and lease poll: the first one [`CANCEL_POLL`] from now, not at
/// once (the lease was just taken or renewed).
pub(crate) fn cancel_poll() -> tokio::time::Interval {
    tokio::time::interval_at(tokio::time::Instant::now() + CANCEL_POLL, CANCEL_POLL)
}

/// Everything about a run a tool call is answered in.
pub(crate) struct CallScope<'a> {
    pub run: &'a RunRecord,
    pub definition: &'a RoutineDefinition,
    pub tools: &'a RunTools,
    pub redactor: &'a Redactor,
    pub policy: &'a PolicyEngine,
    /// Untrusted sources in the context so far (`tool:CONNECTION/TOOL`, `webhook`, …).
    pub untrusted: &'a BTreeSet<String>,
    /// The run's context indexed for labelling each call's arguments.
    pub content: &'a ContentIndex,
    /// The run's limits: its routine's, capped for a nested run by what its parent had left.
    pub limits: BudgetLimits,
    /// Wall time the run has used so far, in seconds.
    pub wall_spent: u64,
    /// The run's credential, presented before anything executes.
    pub authority: &'a RunAuthority,
}

impl CallScope<'_> {
    /// The roster name a call is answered under: the one its decision recorded, else the
    /// roster tool its model-facing name maps to, else the name the model used.
    pub(crate) fn tool_name(&self, pending: &PendingCall) -> String {
        if let Some(recorded) = &pending.recorded {
            return recorded.tool.clone();
        }
        self.tools
            .find(&pending.call.name)
            .map_or_else(|| pending.call.name.clone(), |t| t.roster_name.clone())
    }

    /// The call is answered with a refusal (redacted): the model is told `text`.
    pub(crate) fn refuse(
        &self,
        pending: &PendingCall,
        usage: BudgetUsage,
        text: &str,
    ) -> CallOutcome {
        self.answer(
            pending,
            usage,
            self.redactor.redact(text).into_owned(),
            true,
        )
        .with_provenance(Provenance::Engine)
    }

    /// The call is answered with `content` as the model gets it.
    pub(crate) fn answer(
        &self,
        pending: &PendingCall,
        usage: BudgetUsage,
        content: String,
        is_error: bool,
    ) -> Answered {
        Answered {
            step: ToolResultStep {
                tool: self.tool_name(pending),
                result: ToolResult {
                    tool_call_id: pending.call.id.clone(),
                    content,
                    is_error,
                },
                nul_replaced: false,
            },
            usage,
        }
    }
}

/// A call's answer before it is labelled.
pub(crate) struct Answered {
    step: ToolResultStep,
    usage: BudgetUsage,
}

impl Answered {
    pub(crate) fn with_provenance(self, provenance: Provenance) -> CallOutcome {
        CallOutcome::Answered {
            answer: self.step,
            provenance,
            usage: self.usage,
        }
    }
}

/// An audit event of `run`, by the run, naming it and its place in its tree.
pub(crate) fn run_event(run: &RunRecord, category: AuditCategory) -> AuditEvent {
    AuditEvent::new(run.project_id, category, Actor::Run { run_id: run.id })
        .subject("run_id", run.id)
        .runs(run.root_run_id, run.parent_run_id)
}

/// The audit entry of run `run`'s end as `status`, saying `outcome`: whoever ended it, a
/// worker or a cancel of it while it was queued.
pub(crate) fn run_ended(
    run: &RunRecord,
    status: wor_core::run::RunStatus,
    outcome: &str,
) -> AuditEvent {
    run_event(run, AuditCategory::RunEnd)
        .subject("routine_id", run.routine_id)
        .payload(json!({ "status": status.as_str(), "outcome": outcome }))
}

/// The audit entry a step is recorded with, derived from the step as recorded (redacted): a
/// model turn's `model.call`, a call's decision and a call's answer. Other steps have no
/// entry of their own. The control plane derives a remote worker's entries with it too, so
/// the chain says the same of a step whichever process drove the run, and a step and its
/// entry never disagree.
pub(crate) fn step_event(
    run: &RunRecord,
    provenance: Provenance,
    step: &Step,
) -> Option<AuditEvent> {
    match step {
        Step::ModelTurn(turn) => Some(model_call_event(run, turn)),
        Step::ToolCall(call) => Some(decided_event(run, call)),
        Step::ToolResult(answer) => Some(answered_event(run, answer, provenance)),
        Step::Input(_)
        | Step::Memory(_)
        | Step::ApprovalUsed(_)
        | Step::Output(_)
        | Step::Outcome(_) => None,
    }
}

/// `write` with `step` (as recorded) and its audit entry ([`step_event`]) after what it has.
pub(crate) fn with_step(
    write: RunWrite,
    run: &RunRecord,
    provenance: Provenance,
    step: Step,
) -> RunWrite {
    let event = step_event(run, provenance, &step);
    let write = write.step(provenance, step);
    match event {
        Some(event) => write.audit(event),
        None => write,
    }
}

/// A model turn's `model.call` entry: who answered (provider, connection and the key's
/// version, model), its tokens and how many calls it asked for.
fn model_call_event(run: &RunRecord, turn: &ModelTurnStep) -> AuditEvent {
    let identity = turn.identity.as_ref();
    run_event(run, AuditCategory::ModelCall).payload(json!({
        "provider": identity.map(|i| i.provider.as_str()),
        "model": identity.map(|i| i.model_id.as_str()),
        "connection_id": identity.and_then(|i| i.connection_id).map(|c| c.to_string()),
        "credential_version": identity.and_then(|i| i.credential_version),
        "input_tokens": turn.usage.input_tokens,
        "output_tokens": turn.usage.output_tokens,
        "tool_calls": turn.message.tool_calls.len(),
    }))
}

/// A call's `decided` entry: the verdict, the policies that reached it, and the hashes its
/// approval (if any) binds to.
pub(crate) fn decided_event(run: &RunRecord, call: &ToolCallStep) -> AuditEvent {
    run_event(run, AuditCategory::ToolCall).payload(json!({
        "transition": "decided",
        "tool": call.tool,
        "call_id": call.call_id,
        "decision": call.decision.as_str(),
        "determining_policies": call.determining_policies,
        "arguments_hash": call.arguments_hash,
        "pin_hash": call.pin_hash,
        "untrusted_sources": call.untrusted_sources,
    }))
}

/// A call's `answered` entry: where its answer came from and whether it was an error.
fn answered_event(run: &RunRecord, answer: &ToolResultStep, provenance: Provenance) -> AuditEvent {
    run_event(run, AuditCategory::ToolCall).payload(json!({
        "transition": "answered",
        "tool": answer.tool,
        "call_id": answer.result.tool_call_id,
        "provenance": provenance.as_str(),
        "is_error": answer.result.is_error,
    }))
}

/// A step as it is recorded: the project's secrets and common secret shapes redacted, and
/// U+0000 replaced (`wor_core::text`), which the step then says (`nul_replaced`). The run goes
/// on with the step as recorded.
pub(crate) fn as_recorded(step: Step, redactor: &Redactor) -> Result<Step, EngineError> {
    let mut replaced = false;
    let mut step = step
        .rewritten(|payload| {
            let redacted = redactor.redact_json(payload);
            replaced = wor_core::text::replace_nul_in_json(payload);
            redacted || replaced
        })
        .map_err(|e| EngineError::InvalidState(e.to_string()))?;
    if replaced {
        match &mut step {
            Step::ModelTurn(turn) => turn.nul_replaced = true,
            Step::ToolResult(result) => result.nul_replaced = true,
            _ => {}
        }
    }
    Ok(step)
}

/// What a journal write came to, for a worker that still holds its run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Recorded {
    /// Committed; whether a cancel of the run had been requested by then.
    Committed { cancel_requested: bool },
    /// The presented credential is no longer live: nothing was written.
    CredentialEnded,
    /// A cancel of the run was requested, and the write was to be made only unless one was:
    /// nothing was written.
    CancelRequested,
}

impl Recorded {
    /// Whether the write found a cancel of the run requested; a write that presented no
    /// credential cannot find it ended.
    pub(crate) fn cancel_seen(self) -> bool {
        match self {
            Recorded::Committed { cancel_requested } => cancel_requested,
            Recorded::CredentialEnded => false,
            Recorded::CancelRequested => true,
        }
    }
}

/// Why a guarded wait stopped before its work finished.
pub(crate) enum Stopped {
    /// A cancel was requested.
    Cancelled,
    /// The run's wall time ran out.
    Deadline,
}

impl Engine {
    /// Waits for `work`, at most `remaining`, polling for a cancel request and renewing the
    /// run's lease meanwhile. On a cancel or at the deadline, `work` is dropped (which aborts
    /// it); a lost lease is an error, and so is a database that keeps failing the poll for
    /// half a lease.
    ///
    /// `work` is polled while the lease is renewed, not only between renewals: it may itself
    /// write (a tool call whose server rejected its token records the rejection and claims a
    /// refresh), and a write left unpolled once the process's turn to write passed to it would
    /// hold up the renewal behind it, and every other write of the process, until the turn's
    /// wait timed out.
    pub(crate) async fn until_stopped<T>(
        &self,
        run: &RunRecord,
        remaining: Duration,
        work: impl Future<Output = T>,
    ) -> Result<Result<T, Stopped>, EngineError> {
        tokio::pin!(work);
        let deadline = tokio::time::sleep(remaining);
        tokio::pin!(deadline);
        let watch = async {
            let mut poll = cancel_poll();
            // A database that fails a poll or a renewal once (busy behind a backup, a dropped
            // connection) does not stop the work: it is asked again at the next tick, for as
            // long as half the lease, which the last renewal keeps well ahead of another
            // worker's claim. A lost lease stops it at once.
            let mut held_since = tokio::time::Instant::now();
            loop {
                poll.tick().await;
                let polled = async {
                    if self.cancel_requested(run.id).await? {
                        return Ok(true);
                    }
                    self.renew_lease(run).await?;
                    Ok::<_, EngineError>(false)
                };
                match polled.await {
                    Ok(true) => return Ok::<_, EngineError>(Stopped::Cancelled),
                    Ok(false) => held_since = tokio::time::Instant::now(),
                    Err(EngineError::Store(error))
                        if held_since.elapsed() < self.config.lease / 2 =>
                    {
                        tracing::warn!(category = "run", run_id = %run.id, error = %error,
                            "polling for a cancel or renewing the lease failed; trying again at the next tick");
                    }
                    Err(error) => return Err(error),
                }
            }
        };
        tokio::pin!(watch);
        tokio::select! {
            done = &mut work => Ok(Ok(done)),
            () = &mut deadline => Ok(Err(Stopped::Deadline)),
            stopped = &mut watch => stopped.map(Err),
        }
    }

    /// The start of a journal write for `run`, fenced by this worker's lease (which it renews).
    pub(crate) fn journal(&self, run: &RunRecord) -> RunWrite {
        self.journal_for(run, &self.config.worker_id)
    }

    /// The start of a journal write for `run`, fenced by `holder`'s lease (which it renews).
    pub(crate) fn journal_for(&self, run: &RunRecord, holder: &str) -> RunWrite {
        RunWrite::new(run.project_id, run.id, holder, self.lease_ms())
    }

    /// The lease a claim or a renewal gives, in milliseconds.
    pub(crate) fn lease_ms(&self) -> i64 {
        i64::try_from(self.config.lease.as_millis()).unwrap_or(i64::MAX)
    }

    /// Commits `write` (with whatever else is queued from other runs) and returns whether a
    /// cancel of the run has been requested; [`EngineError::LeaseLost`] when this worker no
    /// longer holds the run, and nothing was written.
    pub(crate) async fn record(&self, write: RunWrite) -> Result<Recorded, EngineError> {
        match self.record_carried(write).await? {
            RunWritten::Committed {
                cancel_requested, ..
            } => Ok(Recorded::Committed { cancel_requested }),
            RunWritten::CredentialEnded => Ok(Recorded::CredentialEnded),
            RunWritten::CancelRequested => Ok(Recorded::CancelRequested),
            RunWritten::LeaseLost => Err(EngineError::LeaseLost),
        }
    }

    /// Commits `write` after what its run carried ([`Engine::carry`]). When nothing was
    /// written (a credential that ended, a cancel requested), what was carried is carried on,
    /// to the write that ends the run.
    pub(crate) async fn record_carried(&self, write: RunWrite) -> Result<RunWritten, EngineError> {
        let run = write.run;
        // Only a write by the worker that carried the turn takes it along.
        let earlier = {
            let mut carried = self.carried();
            match carried.get(&run) {
                Some(earlier) if earlier.worker == write.worker => carried.remove(&run),
                _ => None,
            }
        };
        let Some(earlier) = earlier else {
            return self.commit(write).await;
        };
        let written = self.commit(write.preceded_by(earlier.clone())).await?;
        if matches!(
            written,
            RunWritten::CredentialEnded | RunWritten::CancelRequested
        ) {
            self.carried().insert(run, earlier);
        }
        Ok(written)
    }

    /// Commits `write`: with the audit writer, or, for a remote worker, as a `steps` request
    /// to the control plane (which derives the audit entries from the steps).
    async fn commit(&self, write: RunWrite) -> Result<RunWritten, EngineError> {
        if self.is_remote() {
            return self
                .record_remote(write.run, &write.steps, write.usage)
                .await;
        }
        Ok(self.audit.record(write).await?)
    }

    /// Whether a cancel of `run` has been requested: as the store has it, or, for a remote
    /// worker, as the control plane last reported it.
    pub(crate) async fn cancel_requested(&self, run: RunId) -> Result<bool, EngineError> {
        match self.remote_claim(run) {
            Some(claim) => Ok(Engine::claimed_cancel(&*claim?)),
            None => Ok(self.store.is_cancel_requested(run).await?),
        }
    }

    /// Takes what `run` carried, to be written by the caller.
    pub(crate) fn take_carried(&self, run: RunId) -> Option<RunWrite> {
        self.carried().remove(&run)
    }

    /// Keeps `write` — a model turn that asked for tool calls — for the run's next journal
    /// write, which commits it first, in its transaction. Nothing that reaches outside the
    /// process happens between the two but the listing of a connection's changed tools, so
    /// the turn is on record before anything it asked for runs, and a crash before it loses
    /// the turn as a crash just after the model answered would.
    pub(crate) fn carry(&self, write: RunWrite) {
        let mut carried = self.carried();
        let write = match carried.remove(&write.run) {
            Some(earlier) => write.preceded_by(earlier),
            None => write,
        };
        carried.insert(write.run, write);
    }

    /// Whether `run` carries a model turn not yet written.
    pub(crate) fn carries(&self, run: RunId) -> bool {
        self.carried().contains_key(&run)
    }

    /// Forgets what `run` carried: its drive here is over (or begins), and a turn it carried
    /// to a write that never came is lost, as in a crash before that write.
    pub(crate) fn drop_carried(&self, run: RunId) {
        self.carried().remove(&run);
    }

    fn carried(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<RunId, RunWrite>> {
        self.carried
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Renews the lease of a run this worker drives; [`EngineError::LeaseLost`] when another
    /// worker holds it now.
    pub(crate) async fn renew_lease(&self, run: &RunRecord) -> Result<(), EngineError> {
        if self.is_remote() {
            return match self.renew_remote(run.id).await? {
                true => Ok(()),
                false => Err(EngineError::LeaseLost),
            };
        }
        if self
            .store
            .renew_lease(run.id, &self.config.worker_id, self.lease_ms())
            .await?
        {
            Ok(())
        } else {
            Err(EngineError::LeaseLost)
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests fail loudly")]

    use std::sync::Arc;
    use std::time::Duration;

    use wor_store::testing::{TestDatabase, hold_write_turn};

    use super::CANCEL_POLL;
    use crate::{Engine, EngineConfig, StartRun, Trigger};

    /// An engine on a fresh database and a run of a one-turn routine it has claimed.
    async fn claimed() -> (TestDatabase, Engine, wor_store::RunRecord) {
        let db = TestDatabase::isolated().await.unwrap();
        let created = db
            .store
            .create_project(&TestDatabase::unique_name("guard"), "owner")
            .await
            .unwrap();
        let project = created.project.id;
        let key = db.store.list_api_keys(project).await.unwrap()[0].id;
        let (keys, _) = wor_secrets::KeyRing::generate().unwrap();
        let vault = wor_store::Vault::new(db.store.clone(), Arc::new(keys));
        let (signing, _) = wor_secrets::AuditSigningKey::generate().unwrap();
        let audit = wor_store::AuditLog::start(
            db.store.clone(),
            signing,
            wor_store::AuditConfig::default(),
        );
        let egress =
            wor_egress::EgressClient::new(wor_egress::EgressPolicy::development()).unwrap();
        let engine = Engine::new(
            db.store.clone(),
            vault,
            egress,
            audit,
            EngineConfig::default(),
        );
        let toml = "name = \"r\"\ninstructions = \"Be brief.\"\n[model]\nprovider = \"replay\"\n\
                    model = \"m\"\n[model.script]\n[[model.script.turns]]\ntext = \"done\"\n";
        let definition = wor_core::routine::RoutineDefinition::from_toml(toml).unwrap();
        let routine = db
            .store
            .apply_routine(project, toml, &definition, None)
            .await
            .unwrap()
            .routine
            .id;
        engine
            .start_run(StartRun {
                project,
                routine,
                input: serde_json::json!("go"),
                trigger: Trigger::Api(key),
                actor: None,
                thread: None,
                idempotency_key: None,
            })
            .await
            .unwrap();
        let run = db
            .store
            .claim_run(&engine.config().worker_id, engine.lease_ms(), 10)
            .await
            .unwrap()
            .unwrap();

        (db, engine, run)
    }

    /// On SQLite: a guarded call whose work waits for the process's turn to write while the
    /// lease's renewal comes due. The turn passes to the work first (it asked first); the
    /// renewal, queued behind it, must not keep the work from being polled, or neither could
    /// go on until the turn's wait timed out and the run failed.
    #[tokio::test]
    async fn work_waiting_for_the_turn_to_write_goes_on_while_the_lease_is_renewed() {
        let (db, engine, run) = claimed().await;

        // PostgreSQL has no such turn.
        let Some(held) = hold_write_turn(&db.store).await.unwrap() else {
            return;
        };
        let store = db.store.clone();
        let work = async move {
            drop(hold_write_turn(&store).await.unwrap());
            "answered"
        };
        // Given up after the first renewal has queued for the turn behind the work.
        let release = async move {
            tokio::time::sleep(CANCEL_POLL + Duration::from_millis(150)).await;
            drop(held);
        };
        let (guarded, ()) = tokio::join!(
            engine.until_stopped(&run, Duration::from_secs(60), work),
            release
        );
        assert!(
            matches!(guarded, Ok(Ok("answered"))),
            "the guarded work did not finish: {:?}",
            guarded.map(|r| r.is_ok())
        );
        // The lease was renewed or is still held: the run goes on here.
        assert!(
            db.store
                .renew_lease(run.id, &engine.config().worker_id, engine.lease_ms())
                .await
                .unwrap()
        );
    }

    /// On SQLite: a renewal that fails once (the turn to write held past its wait) does not
    /// stop the work; it is tried again at the next tick, within half the lease.
    #[tokio::test]
    async fn a_renewal_that_fails_once_leaves_the_work_going() {
        let (db, engine, run) = claimed().await;
        // PostgreSQL has no such turn.
        let Some(held) = hold_write_turn(&db.store).await.unwrap() else {
            return;
        };
        // Held past the renewal's wait for the turn (10 s), so that renewal fails.
        let release = async move {
            tokio::time::sleep(Duration::from_secs(11)).await;
            drop(held);
        };
        let work = async {
            tokio::time::sleep(Duration::from_secs(12)).await;
            "answered"
        };
        let (guarded, ()) = tokio::join!(
            engine.until_stopped(&run, Duration::from_secs(60), work),
            release
        );
        assert!(
            matches!(guarded, Ok(Ok("answered"))),
            "a failed renewal stopped the work: {:?}",
            guarded.map(|r| r.is_ok())
        );
    }
}
