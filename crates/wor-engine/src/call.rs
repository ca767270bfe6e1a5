//! What the driver, the tool pipeline and nested runs share, so they need not import each
//! other: the scope one tool call is answered in, the builder of a run's audit events, and the
//! one guard that stops a wait on a cancel request, the run's deadline or a lost lease.

use std::collections::BTreeSet;
use std::time::Duration;

use wor_core::audit::{Actor, AuditCategory, AuditEvent};
use wor_core::budget::BudgetUsage;
use wor_core::model::ToolResult;
use wor_core::provenance::ContentIndex;
use wor_core::routine::{BudgetLimits, RoutineDefinition};
use wor_core::run::Provenance;
use wor_core::run_loop::CallOutcome;
use wor_core::step::{PendingCall, ToolResultStep};
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

/// What a journal write came to, for a worker that still holds its run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Recorded {
    /// Committed; whether a cancel of the run had been requested by then.
    Committed { cancel_requested: bool },
    /// The presented credential is no longer live: nothing was written.
    CredentialEnded,
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
    /// it); a lost lease is an error.
    pub(crate) async fn until_stopped<T>(
        &self,
        run: &RunRecord,
        remaining: Duration,
        work: impl Future<Output = T>,
    ) -> Result<Result<T, Stopped>, EngineError> {
        tokio::pin!(work);
        let deadline = tokio::time::sleep(remaining);
        tokio::pin!(deadline);
        let mut poll = cancel_poll();
        loop {
            tokio::select! {
                done = &mut work => return Ok(Ok(done)),
                () = &mut deadline => return Ok(Err(Stopped::Deadline)),
                _ = poll.tick() => {
                    if self.store.is_cancel_requested(run.id).await? {
                        return Ok(Err(Stopped::Cancelled));
                    }
                    self.renew_lease(run).await?;
                }
            }
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
        match self.audit.record(write).await? {
            RunWritten::Committed {
                cancel_requested, ..
            } => Ok(Recorded::Committed { cancel_requested }),
            RunWritten::CredentialEnded => Ok(Recorded::CredentialEnded),
            RunWritten::LeaseLost => Err(EngineError::LeaseLost),
        }
    }

    /// Renews the lease of a run this worker drives; [`EngineError::LeaseLost`] when another
    /// worker holds it now.
    pub(crate) async fn renew_lease(&self, run: &RunRecord) -> Result<(), EngineError> {
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
