//! Runs claimed for remote workers (docs/deployment.md): what the control plane hands a worker
//! that claims a run, and the run's lease as that worker keeps it.
//!
//! A claim is the same atomic claim a local pool makes, leased to the worker's id. The worker
//! gets the run, its routine version, the project's policy text, the steps recorded so far and
//! the connections the run uses (no secrets in any of them), and, apart from those, the
//! secrets of that run alone — its freshly minted credential (S14), its model connection's key
//! and its tool connections' credentials — which `wor-server` seals into an envelope only that
//! worker opens. No other run's secret and no key of the vault leaves the control plane.

use std::sync::Arc;
use std::time::Duration;

use secrecy::SecretString;
use serde_json::json;
use wor_core::audit::AuditCategory;
use wor_core::budget::BudgetUsage;
use wor_core::call::Verdict;
use wor_core::json_depth::{MAX_JSON_NESTING, value_nesting};
use wor_core::model::ProviderKind;
use wor_core::routine::{BudgetLimits, RoutineDefinition};
use wor_core::routine::{ROUTINE_CONNECTION, ToolMode};
use wor_core::run::{Provenance, RunStatus};
use wor_core::run_loop::CallResume;
use wor_core::run_loop::Ending;
use wor_core::step::{
    InputSource, ModelIdentity, OutputStep, Step, pending_calls, untrusted_sources,
};
use wor_core::{ApprovalId, RunId};
use wor_secrets::{RunSecrets, ToolCredential};
use wor_store::{
    API_KEY_FIELD, ApprovalFilter, ApprovalKind, ApprovalRecord, ApprovedClaim, ApprovedStart,
    ConnectionStatus, MODEL_CONNECTIONS_TABLE, ModelConnectionRecord, NestedPark,
    RoutineVersionRecord, RunRecord, RunStep, RunWritten, SecretSlot, StoreError,
    ToolConnectionKind, ToolConnectionRecord,
};

use crate::call::{as_recorded, run_event, with_step};
use crate::pipeline::{ApprovalRequest, UnknownOutcome, unknown_outcome, why_recorded};
use crate::tool_connections::ConnectionError;
use crate::worker_wire::NestedAnswer;
use crate::{Engine, EngineError};

/// How many runs one claim request may fail closed before it answers that it found none.
const MAX_FAILED_CLAIMS_PER_REQUEST: usize = 16;

/// A run claimed for a remote worker, with everything it is driven from.
#[derive(Debug)]
pub struct WorkerClaim {
    pub run: RunRecord,
    /// Its routine version, as written when the routine was applied.
    pub version: Arc<RoutineVersionRecord>,
    /// The project's policy text; `None`: the built-in default.
    pub project_policy: Option<String>,
    /// The steps recorded so far, in order: the run resumes from them.
    pub steps: Vec<RunStep>,
    /// The routine's model connection, when it names one that is active.
    pub model_connection: Option<ModelConnectionRecord>,
    /// The tool connections the roster names (not `deny` entries), as stored.
    pub tool_connections: Vec<ToolConnectionRecord>,
    /// The run's approvals, oldest first: what a resumed run's held calls were decided.
    pub approvals: Vec<ApprovalRecord>,
    /// The routines the roster offers as tools that exist, as they are now.
    pub routine_tools: Vec<crate::worker_wire::RoutineTool>,
    /// The run's secrets, for the worker's envelope alone.
    pub secrets: RunSecrets,
    /// When the run's credential expires: its deadline (Unix milliseconds).
    pub credential_expires_at: i64,
    /// When the lease runs out unless the worker renews it (Unix milliseconds).
    pub lease_expires_at: i64,
}

/// At most this many steps in one write of a remote worker: a model turn, and the call it
/// asked for first, or a call's answer, and some room.
pub const MAX_WORKER_STEPS_PER_WRITE: usize = 16;

/// What a remote worker records at one step of a run it holds: the steps (its first may be a
/// model turn carried to the write of the call it asked for first) and the run's usage after
/// them.
#[derive(Debug, Clone)]
pub struct WorkerSteps {
    pub steps: Vec<(Provenance, Step)>,
    pub usage: BudgetUsage,
}

/// Why a remote worker's write was refused before anything was written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WorkerStepRefusal {
    #[error("a write records at least one step")]
    NoSteps,
    #[error("a write records at most {MAX_WORKER_STEPS_PER_WRITE} steps, not {0}")]
    TooManySteps(usize),
    #[error(
        "step {index}: a worker records input, model turns, tool calls and tool results; \
         `{kind}` is the control plane's to record"
    )]
    NotAWorkersStep { index: usize, kind: &'static str },
    #[error("step {index}: a worker's input step asks for an output correction and nothing else")]
    NotAnOutputCorrection { index: usize },
    #[error("step {index}: a `{kind}` step is recorded as `{expected}`, not `{given}`")]
    Provenance {
        index: usize,
        kind: &'static str,
        expected: String,
        given: &'static str,
    },
    #[error(
        "step {index}: the model turn does not name the routine's model, its connection and \
         the connection's key version"
    )]
    NotTheRoutinesModel { index: usize },
    #[error("step {index}: nested deeper than {MAX_JSON_NESTING} levels")]
    TooDeep { index: usize },
    #[error("a run ends `succeeded`, `failed` or `cancelled`, not `{0}`")]
    NotAnEnd(&'static str),
    #[error("a run's usage never goes down: `{0}` is below what is recorded")]
    UsageDecreased(&'static str),
    #[error("no call `{0}` is recorded as held for a person and still unanswered")]
    NoHeldCall(String),
    #[error("the run has no approval `{0}`")]
    NoSuchApproval(String),
    #[error(
        "a person already decided whether call `{0}` runs again: use its approval, or answer \
         the call with its outcome unknown"
    )]
    OutcomeUnknownDecided(String),
    #[error("a write reserves one call at most, not {0}")]
    SeveralReservations(usize),
    #[error("a reserved call counts one tool call in the run's usage")]
    ReservationUncounted,
    #[error("the run's budget allows {0} tool calls; the reservation would exceed it")]
    OverBudget(u64),
    #[error("each model turn counts one turn in the run's usage, within its limit of {0}")]
    TurnsUncounted(u64),
    #[error("the outcome does not match the routine's output schema: {0}")]
    OutputRejected(String),
    #[error("no call `{0}` to a routine on the run's roster is recorded as started and unanswered")]
    NoRoutineCall(String),
    #[error("routines may nest at most {0} deep")]
    NestedTooDeep(i64),
}

/// Whether a write's model turns are counted: one turn each in the usage, within the run's
/// limit.
fn turns_counted(
    write: &WorkerSteps,
    before: &BudgetUsage,
    limits: &BudgetLimits,
) -> Result<(), WorkerStepRefusal> {
    let turns = write
        .steps
        .iter()
        .filter(|(_, step)| matches!(step, Step::ModelTurn(_)))
        .count();
    let turns = u64::try_from(turns).unwrap_or(u64::MAX);
    if turns == 0 {
        return Ok(());
    }
    let expected = before.turns.saturating_add(turns);
    if write.usage.turns != expected || expected > limits.turns {
        return Err(WorkerStepRefusal::TurnsUncounted(limits.turns));
    }
    Ok(())
}

/// Whether a write's reservation is counted as a local driver counts one: at most one call
/// allowed per write, its usage one tool call more than recorded, within the run's limit.
fn reservation_counted(
    write: &WorkerSteps,
    before: &BudgetUsage,
    limits: &BudgetLimits,
) -> Result<(), WorkerStepRefusal> {
    let allowed = write
        .steps
        .iter()
        .filter(|(_, step)| matches!(step, Step::ToolCall(call) if call.decision == Verdict::Allow))
        .count();
    match allowed {
        0 => Ok(()),
        1 => one_call_reserved(before, &write.usage, limits),
        more => Err(WorkerStepRefusal::SeveralReservations(more)),
    }
}

/// Whether `after` is `before` with one tool call reserved, within the run's limit.
fn one_call_reserved(
    before: &BudgetUsage,
    after: &BudgetUsage,
    limits: &BudgetLimits,
) -> Result<(), WorkerStepRefusal> {
    if after.tool_calls != before.tool_calls.saturating_add(1) {
        Err(WorkerStepRefusal::ReservationUncounted)
    } else if after.tool_calls > limits.tool_calls {
        Err(WorkerStepRefusal::OverBudget(limits.tool_calls))
    } else {
        Ok(())
    }
}

/// Whether `after` is no less than `before` in every measure; the first that is less if not.
fn usage_not_lowered(before: &BudgetUsage, after: &BudgetUsage) -> Result<(), WorkerStepRefusal> {
    let measures = [
        ("turns", before.turns, after.turns),
        ("tool_calls", before.tool_calls, after.tool_calls),
        ("input_tokens", before.input_tokens, after.input_tokens),
        ("output_tokens", before.output_tokens, after.output_tokens),
        (
            "cost_microdollars",
            before.cost_microdollars,
            after.cost_microdollars,
        ),
    ];
    match measures
        .into_iter()
        .find(|(_, before, after)| after < before)
    {
        Some((name, _, _)) => Err(WorkerStepRefusal::UsageDecreased(name)),
        None => Ok(()),
    }
}

/// What became of a remote worker's write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkerRecorded {
    /// Committed, with its audit entries; whether a cancel of the run had been requested.
    Committed { cancel_requested: bool },
    /// The write reserves a call and a cancel of the run was requested: nothing was written,
    /// and the worker ends the run as cancelled.
    CancelRequested,
    /// The worker does not hold the run under the claim it presented (or, for a write that
    /// reserves a call, the run's deadline has passed): nothing was written.
    NotHeld,
}

/// What became of a remote worker's request to park its run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkerParked {
    /// Parked on this approval; the claim has ended.
    Parked(ApprovalId),
    /// A cancel of the run was requested: it is not parked, and the worker ends it.
    CancelRequested,
    /// The worker does not hold the run under the claim it presented.
    NotHeld,
}

impl From<Option<ApprovalId>> for WorkerParked {
    fn from(parked: Option<ApprovalId>) -> Self {
        parked.map_or(WorkerParked::NotHeld, WorkerParked::Parked)
    }
}

/// What became of a remote worker's use of an approval.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkerApprovalUse {
    /// The call is recorded as started and runs now.
    Started,
    /// The approval is not usable for this call (not approved, used, or bound to another
    /// call): it does not run.
    NotUsable,
    /// A cancel of the run was requested: the call does not run, and the worker ends the run.
    CancelRequested,
    /// The worker does not hold the run under the claim it presented, the run's deadline has
    /// passed, or its usage changed since the worker counted from it.
    NotHeld,
}

/// A call as a remote worker is about to run it with an approval: what the approval must
/// bind to, and the run's usage with the call reserved.
#[derive(Debug, Clone)]
pub struct BoundCall {
    pub pin_hash: String,
    pub arguments_hash: String,
    pub usage: BudgetUsage,
}

/// Where a remote worker's lease of a run stands after a renewal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseRenewal {
    /// Renewed until `expires_at` (Unix milliseconds); whether a cancel of the run was
    /// requested, which the worker must act on before its next step.
    Renewed {
        expires_at: i64,
        cancel_requested: bool,
    },
    /// The worker does not hold the run (its lease expired and another took it, or the run
    /// parked or ended): it must stop driving it at once.
    NotHeld,
}

impl Engine {
    /// Claims the oldest queued run the limits allow for remote worker `worker` and gathers
    /// what it is driven from. `None` when nothing is claimable.
    ///
    /// A run that cannot be driven as it stands — its secrets cannot be opened, a connection's
    /// authorization or credentials fail — is failed closed with the reason, as a local driver
    /// fails it, and the next run is claimed. On any other error the run goes back to the queue
    /// before the error is returned.
    ///
    /// # Errors
    /// A store error; [`EngineError::LeaseLost`] if the lease was lost while the credential
    /// was minted.
    pub async fn claim_for_worker(&self, worker: &str) -> Result<Option<WorkerClaim>, EngineError> {
        // Bounded: a request never spends itself failing an unending line of runs; the worker
        // asks again.
        for _ in 0..MAX_FAILED_CLAIMS_PER_REQUEST {
            let Some(run) = self.claim_for(worker).await? else {
                return Ok(None);
            };
            match self.gather_claim(run.clone(), worker).await {
                Ok(claim) => {
                    tracing::info!(category = "run", action = "run.claimed_remote",
                        project_id = %run.project_id, run_id = %run.id, worker_id = %worker,
                        "a remote worker claimed a run");
                    return Ok(Some(claim));
                }
                Err(error) => match error.run_failure() {
                    Some(reason) => {
                        self.fail_claimed_run(&run, worker, reason).await?;
                    }
                    None => {
                        self.give_back(&run, worker).await;
                        return Err(error);
                    }
                },
            }
        }
        Ok(None)
    }

    /// Claims a run for `worker` as [`Engine::claim_for_worker`] does, waiting up to `wait`
    /// for one when none is queued: woken when a run is queued or ends here, or (PostgreSQL)
    /// is queued anywhere, and trying again each poll interval besides.
    ///
    /// # Errors
    /// As [`Engine::claim_for_worker`].
    pub async fn claim_for_worker_within(
        &self,
        worker: &str,
        wait: std::time::Duration,
    ) -> Result<Option<WorkerClaim>, EngineError> {
        let deadline = tokio::time::Instant::now() + wait;
        let mut news = self.work_seen.subscribe();
        loop {
            // Seen before the claim: news that comes while it looks is not missed.
            news.borrow_and_update();
            if let Some(claim) = self.claim_for_worker(worker).await? {
                return Ok(Some(claim));
            }
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            if left.is_zero() {
                return Ok(None);
            }
            tokio::select! {
                _ = news.changed() => {}
                () = tokio::time::sleep(left.min(self.config.poll_interval)) => {}
            }
        }
    }

    /// Fails a run claimed for `worker` closed with `reason`, before the worker saw it.
    ///
    /// # Errors
    /// A store error.
    pub async fn fail_claimed_run(
        &self,
        run: &RunRecord,
        worker: &str,
        reason: String,
    ) -> Result<(), EngineError> {
        tracing::warn!(category = "run", action = "run.claim_failed", project_id = %run.project_id,
            run_id = %run.id, worker_id = %worker, "a run claimed for a worker cannot be driven; it fails closed");
        let ending = wor_core::run_loop::Ending::new(wor_core::run::RunStatus::Failed, reason);
        self.end_run(run, worker, ending, None).await
    }

    /// Gives a run claimed for `worker` back to the queue, logging (not returning) a failure:
    /// its lease expires then instead.
    pub async fn give_back(&self, run: &RunRecord, worker: &str) {
        match self.store.release_run(run.id, worker).await {
            Ok(_) => self.wake_workers(),
            Err(error) => tracing::error!(category = "run", run_id = %run.id, error = %error,
                "a claimed run could not be given back; its lease will expire"),
        }
    }

    async fn gather_claim(&self, run: RunRecord, worker: &str) -> Result<WorkerClaim, EngineError> {
        let version = self
            .routine_version(run.project_id, run.routine_id, run.routine_version)
            .await?;
        let definition = &version.definition;
        let project_policy = self
            .store
            .project_policy(run.project_id)
            .await?
            .map(|p| p.text);
        let steps = self.store.list_run_steps(run.project_id, run.id, 0).await?;
        let mut approvals = self
            .store
            .list_approvals(
                run.project_id,
                &ApprovalFilter {
                    status: None,
                    run_id: Some(run.id),
                    before: None,
                    limit: u32::MAX,
                },
            )
            .await?;
        approvals.reverse();
        let model_connection = match &definition.model.connection {
            Some(name) if definition.model.provider != ProviderKind::Replay => self
                .store
                .list_model_connections(run.project_id)
                .await?
                .into_iter()
                .find(|c| &c.name == name && c.status == ConnectionStatus::Active),
            _ => None,
        };
        // A connection of another provider is refused by the driver (as a local one refuses
        // it): its key is not opened for it.
        let model_key = match &model_connection {
            Some(connection) if connection.provider == definition.model.provider => {
                self.model_key_for_worker(&run, connection, worker).await?
            }
            _ => None,
        };
        let mut tool_connections = Vec::new();
        let mut tool_credentials = Vec::new();
        let mut names: Vec<&str> = definition
            .tools
            .iter()
            .filter(|entry| entry.mode != ToolMode::Deny)
            .filter_map(|entry| entry.tool.split_once('/').map(|(connection, _)| connection))
            .filter(|connection| *connection != ROUTINE_CONNECTION)
            .collect();
        names.sort_unstable();
        names.dedup();
        for name in names {
            let record = match self
                .store
                .get_tool_connection_by_name(run.project_id, name)
                .await
            {
                Ok(record) => record,
                // The worker's driver finds it missing and fails the run closed, as a local
                // driver does.
                Err(StoreError::NotFound) => continue,
                Err(other) => return Err(other.into()),
            };
            tool_credentials.extend(self.tool_credentials_for_worker(&record).await?);
            tool_connections.push(record);
        }
        let mut routine_tools = Vec::new();
        for entry in &definition.tools {
            let Some((ROUTINE_CONNECTION, name)) = entry.tool.split_once('/') else {
                continue;
            };
            if entry.mode == ToolMode::Deny {
                continue;
            }
            let routine = match self.store.find_routine_by_name(run.project_id, name).await {
                Ok(routine) => routine,
                // The worker's driver finds it missing and fails the run closed.
                Err(StoreError::NotFound) => continue,
                Err(other) => return Err(other.into()),
            };
            let current = self
                .routine_version(run.project_id, routine.id, routine.current_version)
                .await?;
            routine_tools.push(crate::worker_wire::RoutineTool {
                name: name.to_owned(),
                description: current.definition.description.clone(),
                content_hash: current.content_hash.clone(),
            });
        }
        let limits = crate::nested::capped(definition.budget, run.budget_cap.as_ref());
        let remaining = Duration::from_secs(
            limits
                .wall_seconds
                .saturating_sub(crate::authority::wall_spent_before(&run)),
        );
        let (token, credential_expires_at) = self.mint_credential(&run, worker, remaining).await?;
        let lease_expires_at = wor_store::now_millis().saturating_add(self.lease_ms());
        Ok(WorkerClaim {
            secrets: RunSecrets {
                run_credential: SecretString::from(token.expose().to_owned()),
                model_key,
                tool_credentials,
            },
            run,
            project_policy,
            steps,
            model_connection,
            tool_connections,
            approvals,
            routine_tools,
            credential_expires_at,
            lease_expires_at,
            version,
        })
    }

    /// The key of the run's model connection, if it has one; its use is recorded on the
    /// audit chain with the worker it is sealed for, as a local driver records its own use.
    async fn model_key_for_worker(
        &self,
        run: &RunRecord,
        connection: &ModelConnectionRecord,
        worker: &str,
    ) -> Result<Option<SecretString>, EngineError> {
        let slot = SecretSlot::new(
            run.project_id,
            MODEL_CONNECTIONS_TABLE,
            connection.id,
            API_KEY_FIELD,
        );
        if self.vault.metadata(&slot).await?.is_none() {
            return Ok(None);
        }
        let key = self.vault.open(&slot).await.map_err(EngineError::Vault)?;
        self.audit
            .append(
                run_event(run, AuditCategory::SecretUse)
                    .subject("connection_id", connection.id)
                    .payload(json!({
                        "slot": slot.to_string(),
                        "credential_version": connection.credential_version,
                        "worker_id": worker,
                    })),
            )
            .await?;
        Ok(Some(key))
    }

    /// The credentials of one tool connection, each under the field that says where it goes;
    /// none for a connection a driver may not use as it stands (not enabled, or a command the
    /// operator's rules refuse): the worker's driver finds it so and fails the run closed, and
    /// its secrets never leave. The credentials are checked as a local session checks them.
    async fn tool_credentials_for_worker(
        &self,
        record: &ToolConnectionRecord,
    ) -> Result<Vec<ToolCredential>, EngineError> {
        if Engine::check_enabled(record).is_err() {
            return Ok(Vec::new());
        }
        let fields: Vec<(String, SecretString)> = match record.kind {
            ToolConnectionKind::McpStdio | ToolConnectionKind::Wasm => {
                match self.local_command(record).await {
                    Ok((_, env)) => env
                        .into_iter()
                        .map(|(variable, value)| (wor_store::env_field(&variable), value))
                        .collect(),
                    Err(ConnectionError::Command { .. }) => return Ok(Vec::new()),
                    Err(error) => return Err(error.into()),
                }
            }
            ToolConnectionKind::McpHttp | ToolConnectionKind::HttpApi => {
                let secrets = self.request_secrets(record).await?;
                // The same checks a local session's credentials pass (header names, values,
                // one `authorization`).
                Engine::credentials_from(record, secrets.iter().map(|(s, v)| (*s, v.clone())))?;
                secrets
                    .into_iter()
                    .map(|(secret, value)| (secret.field(), value))
                    .collect()
            }
        };
        Ok(fields
            .into_iter()
            .map(|(field, value)| ToolCredential {
                connection_id: record.id.to_string(),
                field,
                value,
            })
            .collect())
    }

    /// Whether `credential` is the live credential of `worker`'s claim of `run`: minted for
    /// this claim (a stale driver of an earlier claim holds an ended one) and before the run's
    /// deadline.
    async fn holds_claim(
        &self,
        run: RunId,
        worker: &str,
        credential: &str,
    ) -> Result<bool, EngineError> {
        Ok(self
            .store
            .authenticate_run_token(credential)
            .await?
            .is_some_and(|grant| grant.run_id == run)
            && self.store.worker_holds_run(worker, run).await?)
    }

    /// Renews remote worker `worker`'s lease of `run`, presenting the claim's `credential`,
    /// and says whether a cancel was requested. Past the run's deadline the credential has
    /// ended and so has the renewal: the lease runs out and the run is resumed elsewhere,
    /// where it ends over its wall time.
    ///
    /// # Errors
    /// A store error.
    pub async fn renew_for_worker(
        &self,
        run: RunId,
        worker: &str,
        credential: &str,
    ) -> Result<LeaseRenewal, EngineError> {
        if !self.holds_claim(run, worker, credential).await?
            || !self.store.renew_lease(run, worker, self.lease_ms()).await?
        {
            return Ok(LeaseRenewal::NotHeld);
        }
        let expires_at = wor_store::now_millis().saturating_add(self.lease_ms());
        Ok(LeaseRenewal::Renewed {
            expires_at,
            cancel_requested: self.store.is_cancel_requested(run).await?,
        })
    }

    /// Records what remote worker `worker` sends of a run it holds under the claim whose
    /// `credential` it presents: the steps, redacted again here with the project's live
    /// secrets, with the audit entries this process derives from them (a worker never writes
    /// the chain), in one journal write fenced by the worker's lease and claim, before the
    /// run's deadline, and only while the run's usage is the one the worker counted from. A
    /// write with a call the worker's decision allowed reserves it, and is made only unless a
    /// cancel was requested, as a local driver's reservation is.
    ///
    /// # Errors
    /// A store error; stored state that does not read back.
    pub async fn record_for_worker(
        &self,
        run: RunId,
        worker: &str,
        credential: &str,
        write: WorkerSteps,
    ) -> Result<Result<WorkerRecorded, WorkerStepRefusal>, EngineError> {
        let Some(run) = self.store.claimed_run(worker, run, credential).await? else {
            return Ok(Ok(WorkerRecorded::NotHeld));
        };
        let version = self
            .routine_version(run.project_id, run.routine_id, run.routine_version)
            .await?;
        let limits = crate::nested::capped(version.definition.budget, run.budget_cap.as_ref());
        let model = if write
            .steps
            .iter()
            .any(|(_, step)| matches!(step, Step::ModelTurn(_)))
        {
            self.routine_model(&run, &version.definition).await?
        } else {
            None
        };
        let checked = worker_steps(&write.steps, model)
            .and_then(|()| usage_not_lowered(&run.usage, &write.usage))
            .and_then(|()| turns_counted(&write, &run.usage, &limits))
            .and_then(|()| reservation_counted(&write, &run.usage, &limits));
        if let Err(refusal) = checked {
            tracing::warn!(category = "run", action = "worker.write_refused", worker_id = %worker,
                run_id = %run.id, reason = %refusal, "a worker's write was refused");
            return Ok(Err(refusal));
        }
        let redactor = self.project_redactor(run.project_id).await?;
        let mut journal = self
            .journal_for(&run, worker)
            .usage(write.usage)
            .counted_from(run.usage);
        let mut reserves = false;
        for (provenance, step) in write.steps {
            let step = as_recorded(step, &redactor)?;
            reserves |= matches!(&step, Step::ToolCall(call) if call.decision == Verdict::Allow);
            journal = with_step(journal, &run, provenance, step);
        }
        // Before the run's deadline only: past it, the worker ends the run (`end_for_worker`),
        // and a write that renewed the lease would keep it from running out.
        let journal = if reserves {
            journal.presenting(credential).unless_cancelled()
        } else {
            journal.under_live_claim(credential)
        };
        Ok(Ok(match self.audit.record(journal).await? {
            RunWritten::Committed {
                cancel_requested, ..
            } => WorkerRecorded::Committed { cancel_requested },
            RunWritten::CancelRequested => WorkerRecorded::CancelRequested,
            RunWritten::LeaseLost | RunWritten::CredentialEnded => WorkerRecorded::NotHeld,
        }))
    }

    /// Ends a run remote worker `worker` holds under the claim whose `credential` it presents,
    /// with `status` and `outcome` (redacted here) and the run's usage, as a local driver ends
    /// one: its outcome step and `run.end` entry in one write, then what follows an end
    /// (approvals cancelled, memory, run webhooks). Past the run's deadline too: the claim,
    /// not its deadline, is what the end is bound to. False when the worker does not hold it.
    ///
    /// # Errors
    /// A store error.
    pub async fn end_for_worker(
        &self,
        run: RunId,
        worker: &str,
        credential: &str,
        status: RunStatus,
        outcome: &str,
        usage: BudgetUsage,
    ) -> Result<Result<bool, WorkerStepRefusal>, EngineError> {
        if !status.is_terminal() {
            return Ok(Err(WorkerStepRefusal::NotAnEnd(status.as_str())));
        }
        let Some(run) = self.store.claimed_run(worker, run, credential).await? else {
            return Ok(Ok(false));
        };
        if let Err(refusal) = usage_not_lowered(&run.usage, &usage) {
            return Ok(Err(refusal));
        }
        let redactor = self.project_redactor(run.project_id).await?;
        let mut outcome = wor_core::text::replace_nul(&redactor.redact(outcome)).into_owned();
        let mut end = self
            .journal_for(&run, worker)
            .under_claim(credential)
            .never_lowering_usage();
        // A routine with an output schema succeeds only with an answer that matches it, which
        // this process checks and records as its `output` step, as a local driver does.
        if status == RunStatus::Succeeded {
            let version = self
                .routine_version(run.project_id, run.routine_id, run.routine_version)
                .await?;
            if let Some(output) = &version.definition.output {
                let schema = wor_tools::OutputSchema::compile(&output.schema)
                    .map_err(|e| EngineError::InvalidState(e.to_string()))?;
                let result = match schema.check(&outcome) {
                    Ok(result) => result,
                    Err(violation) => {
                        return Ok(Err(WorkerStepRefusal::OutputRejected(
                            violation.to_string(),
                        )));
                    }
                };
                outcome = serde_json::to_string(&result)
                    .map_err(|e| EngineError::InvalidState(e.to_string()))?;
                end = end.step(Provenance::Model, Step::Output(OutputStep { result }));
            }
        }
        let ending = Ending::new(status, outcome);
        let ended = self.end_run_with(&run, end, ending, Some(usage)).await?;
        if ended {
            // A place under the routine's and the project's limits is free.
            self.wake_workers();
        }
        Ok(Ok(ended))
    }

    /// Parks a run remote worker `worker` holds under the claim whose `credential` it presents,
    /// for a person's decision on call `call_id`, a call of its last model turn that has no
    /// answer: one it recorded as held (`confirm`), or one that started and whose outcome is
    /// unknown (the worker that ran it stopped before its result was recorded; a person is
    /// asked before it runs again, anew for each interrupted retry). The approval is filed
    /// from the recorded step — the call as it ran, its arguments and why, as a local driver
    /// files it — and announced by this process (its audit entries, run webhook and
    /// notifications). A run whose cancel was requested is not parked: the worker ends it.
    ///
    /// # Errors
    /// A store error; a decided approval for that call.
    pub async fn park_for_worker(
        &self,
        run: RunId,
        worker: &str,
        credential: &str,
        call_id: &str,
    ) -> Result<Result<WorkerParked, WorkerStepRefusal>, EngineError> {
        let Some(run) = self.store.claimed_run(worker, run, credential).await? else {
            return Ok(Ok(WorkerParked::NotHeld));
        };
        // A run whose cancel was requested ends rather than waits for a person.
        if run.cancel_requested {
            return Ok(Ok(WorkerParked::CancelRequested));
        }
        let steps = self.store.list_run_steps(run.project_id, run.id, 0).await?;
        let pending = pending_calls(steps.iter().map(|s| &s.step))
            .into_iter()
            .find(|pending| pending.call.id == call_id);
        let no_held_call = || WorkerStepRefusal::NoHeldCall(wor_core::quote::excerpt(call_id, 80));
        let Some(pending) = pending else {
            return Ok(Err(no_held_call()));
        };
        let resume = CallResume::of(&pending);
        let Some(recorded) = pending.recorded else {
            return Ok(Err(no_held_call()));
        };
        match resume {
            CallResume::Held => {
                let request = ApprovalRequest {
                    kind: ApprovalKind::Policy,
                    call: &recorded,
                    why: why_recorded(&recorded),
                };
                let parked = self
                    .park_run(&run, worker, Some(credential), request)
                    .await?;
                Ok(Ok(WorkerParked::from(parked)))
            }
            // A call that started and has no result: its outcome is unknown, and a person is
            // asked before it runs again, as a local driver asks.
            CallResume::Started { routine: false } => {
                let ran = self.call_as_ran(&run, &recorded).await?;
                let approval = self
                    .store
                    .approval_for_call(
                        run.project_id,
                        run.id,
                        call_id,
                        ApprovalKind::OutcomeUnknown,
                    )
                    .await?;
                let untrusted = untrusted_sources(steps.iter().map(|s| (&s.step, s.provenance)));
                match unknown_outcome(approval, &untrusted)? {
                    UnknownOutcome::Ask { why, attempt } => {
                        let parked = self
                            .ask_outcome_unknown(&run, worker, Some(credential), &ran, why, attempt)
                            .await?;
                        Ok(Ok(WorkerParked::from(parked)))
                    }
                    UnknownOutcome::Retry(_) | UnknownOutcome::Unknown => {
                        Ok(Err(WorkerStepRefusal::OutcomeUnknownDecided(
                            wor_core::quote::excerpt(call_id, 80),
                        )))
                    }
                }
            }
            CallResume::Started { routine: true } | CallResume::Fresh | CallResume::Refused => {
                Ok(Err(no_held_call()))
            }
        }
    }

    /// Uses approval `approval` of a run remote worker `worker` holds under the claim whose
    /// `credential` it presents, to start the call it approved as the worker is about to run
    /// it — the tool definition `pin_hash` and the arguments `arguments_hash` (the approver's
    /// edit, if any, applied) — with the run's usage after its reservation. As for a local
    /// run: only an approved, unused approval whose binding is that call's is used, in one
    /// transaction with the call recorded as started, and the chain says which it was
    /// (`approval.use` or `approval_mismatch`). Like a reservation, only before the run's
    /// deadline, unless a cancel was requested, and only while the run's usage is the one the
    /// worker counted the call from.
    ///
    /// # Errors
    /// A store error.
    pub async fn use_approval_for_worker(
        &self,
        run: RunId,
        worker: &str,
        credential: &str,
        approval: ApprovalId,
        call: &BoundCall,
    ) -> Result<Result<WorkerApprovalUse, WorkerStepRefusal>, EngineError> {
        let Some(run) = self.store.claimed_run(worker, run, credential).await? else {
            return Ok(Ok(WorkerApprovalUse::NotHeld));
        };
        // A cancelled run ends rather than tries its approval.
        if run.cancel_requested {
            return Ok(Ok(WorkerApprovalUse::CancelRequested));
        }
        let version = self
            .routine_version(run.project_id, run.routine_id, run.routine_version)
            .await?;
        let limits = crate::nested::capped(version.definition.budget, run.budget_cap.as_ref());
        let counted = usage_not_lowered(&run.usage, &call.usage)
            .and_then(|()| one_call_reserved(&run.usage, &call.usage, &limits));
        if let Err(refusal) = counted {
            return Ok(Err(refusal));
        }
        let approval = match self.store.get_approval(run.project_id, approval).await {
            Ok(record) if record.run_id == run.id => record,
            Ok(_) | Err(StoreError::NotFound) => {
                return Ok(Err(WorkerStepRefusal::NoSuchApproval(approval.to_string())));
            }
            Err(other) => return Err(other.into()),
        };
        let binding = wor_core::approval::binding_hash(
            run.id,
            &approval.call_id,
            &call.pin_hash,
            &call.arguments_hash,
        );
        let started = self
            .start_approved(
                &run,
                worker,
                Some(ApprovedClaim {
                    credential,
                    usage_before: &run.usage,
                }),
                &approval,
                &binding,
                &call.usage,
            )
            .await?;
        Ok(Ok(match started {
            ApprovedStart::Started => WorkerApprovalUse::Started,
            ApprovedStart::NotUsable => WorkerApprovalUse::NotUsable,
            ApprovedStart::CancelRequested => WorkerApprovalUse::CancelRequested,
            ApprovedStart::RunNotHeld => WorkerApprovalUse::NotHeld,
        }))
    }

    /// Who answers the model calls of a run of `definition`, as its model turns must name it:
    /// the routine's provider and model, and its active model connection with its key's
    /// version (none for the replay model). `None` when the routine names no active
    /// connection of its provider, or the replay model in production: no model turn of it is
    /// taken.
    async fn routine_model(
        &self,
        run: &RunRecord,
        definition: &RoutineDefinition,
    ) -> Result<Option<ModelIdentity>, EngineError> {
        let model = &definition.model;
        let identity = |connection_id, credential_version| ModelIdentity {
            provider: model.provider,
            connection_id,
            model_id: model.model.clone(),
            credential_version,
        };
        if model.provider == ProviderKind::Replay {
            // Refused in production, as a local driver refuses it.
            return Ok((!self.config.production).then(|| identity(None, None)));
        }
        let Some(name) = &model.connection else {
            return Ok(None);
        };
        Ok(self
            .store
            .list_model_connections(run.project_id)
            .await?
            .into_iter()
            .find(|c| {
                &c.name == name
                    && c.status == ConnectionStatus::Active
                    && c.provider == model.provider
            })
            .map(|c| identity(Some(c.id), Some(c.credential_version))))
    }

    /// Answers a routine call of a run remote worker `worker` holds under the claim whose
    /// `credential` it presents: call `call_id` of its last model turn, recorded as started,
    /// to a routine its roster offers. Its nested run is the one an earlier attempt started,
    /// or a new one — its input from the recorded call, its budget what is left of the run's
    /// after `usage` — queued for any worker (a local driver drives it at once instead). When
    /// the nested run has ended, its usage is added to the run's and recorded, and the call
    /// is answered with it; until then the run parks under the claim (its credential ends)
    /// and is queued again when the nested run ends. `None` when the worker does not hold the
    /// run under this claim.
    ///
    /// # Errors
    /// A store error.
    pub async fn nested_for_worker(
        &self,
        run: RunId,
        worker: &str,
        credential: &str,
        call_id: &str,
        usage: BudgetUsage,
    ) -> Result<Result<Option<NestedAnswer>, WorkerStepRefusal>, EngineError> {
        let Some(parent) = self.store.claimed_run(worker, run, credential).await? else {
            return Ok(Ok(None));
        };
        if parent.cancel_requested {
            return Ok(Ok(Some(NestedAnswer::CancelRequested)));
        }
        if let Err(refusal) = usage_not_lowered(&parent.usage, &usage) {
            return Ok(Err(refusal));
        }
        let no_routine_call =
            || WorkerStepRefusal::NoRoutineCall(wor_core::quote::excerpt(call_id, 80));
        let steps = self
            .store
            .list_run_steps(parent.project_id, parent.id, 0)
            .await?;
        let Some(pending) = pending_calls(steps.iter().map(|s| &s.step))
            .into_iter()
            .find(|pending| pending.call.id == call_id)
        else {
            return Ok(Err(no_routine_call()));
        };
        let (CallResume::Started { routine: true }, Some(recorded)) =
            (CallResume::of(&pending), &pending.recorded)
        else {
            return Ok(Err(no_routine_call()));
        };
        let version = self
            .routine_version(parent.project_id, parent.routine_id, parent.routine_version)
            .await?;
        // On the roster, and — where the roster has every call of it wait for a person —
        // started with a person's approval: a worker's word that it was allowed starts
        // nothing the roster holds.
        let on_roster = version.definition.tools.iter().any(|entry| {
            entry.tool == recorded.tool
                && match entry.mode {
                    ToolMode::Auto => true,
                    ToolMode::Confirm => pending.started_with_approval,
                    ToolMode::Deny => false,
                }
        });
        let Some((ROUTINE_CONNECTION, name)) = recorded.tool.split_once('/') else {
            return Ok(Err(no_routine_call()));
        };
        if !on_roster {
            return Ok(Err(no_routine_call()));
        }
        if parent.depth + 1 > crate::nested::MAX_NESTING_DEPTH {
            return Ok(Err(WorkerStepRefusal::NestedTooDeep(
                crate::nested::MAX_NESTING_DEPTH,
            )));
        }
        let limits = crate::nested::capped(version.definition.budget, parent.budget_cap.as_ref());
        let mut left = crate::nested::remaining(&limits, &usage);
        left.wall_seconds = limits
            .wall_seconds
            .saturating_sub(crate::authority::wall_spent_before(&parent));
        // The input as the call recorded it (redacted when it was stored).
        let input = recorded
            .arguments
            .get("input")
            .and_then(serde_json::Value::as_str)
            .unwrap_or_default();
        let untrusted =
            !untrusted_sources(steps.iter().map(|s| (&s.step, s.provenance))).is_empty();
        let (mut child, started_now) = self
            .nested_child(&parent, name, call_id, input, untrusted, left)
            .await?;
        if !child.status.is_terminal() {
            match self
                .store
                .park_for_nested(
                    parent.project_id,
                    parent.id,
                    child.id,
                    worker,
                    Some(credential),
                )
                .await?
            {
                NestedPark::NotHeld => {
                    if started_now {
                        self.wake_workers();
                    }
                    return Ok(Ok(None));
                }
                NestedPark::Parked => {
                    // Queued for any worker, this one's waiting claims included, and the
                    // parked run's place under the limits is free.
                    self.wake_workers();
                    tracing::info!(category = "run", action = "worker.nested_parked",
                        worker_id = %worker, run_id = %parent.id, nested_run_id = %child.id,
                        "a worker's run waits for its nested run");
                    return Ok(Ok(Some(NestedAnswer::Parked)));
                }
                NestedPark::ChildEnded => {
                    child = self.store.get_run(parent.project_id, child.id).await?;
                }
            }
        }
        let usage = crate::nested::with_child_usage(usage, &child.usage);
        // A run that was parked while its nested run ran (one an earlier call started) did
        // not count that time as wall time: the nested run's own wall time is counted as the
        // run's, as it is when a local driver drives the nested run while its parent waits,
        // and the claim's deadline comes that much sooner. A nested run started and ended
        // within this call ran on the run's own clock.
        let nested_wall_ms = match (started_now, child.started_at, child.finished_at) {
            (false, Some(started), Some(finished)) => finished
                .saturating_sub(started)
                .saturating_sub(child.parked_ms)
                .max(0),
            _ => 0,
        };
        // Recorded now: once the call has its answer, nothing would add it again.
        self.store
            .record_nested_end(parent.id, worker, &usage, nested_wall_ms)
            .await?;
        Ok(Ok(Some(NestedAnswer::Ended {
            nested: crate::nested::NestedEnd::of(&child),
            usage,
        })))
    }

    /// Checks a remote worker's report that tool connection `connection`, which the run it
    /// holds under the claim whose `credential` it presents uses, lists tools that changed
    /// since they were pinned. The worker's word is not taken: this process lists the tools
    /// itself and quarantines the connection only when it sees the change too (with the same
    /// audit entry a local driver writes). Whether the connection is quarantined now; `None`
    /// when the worker does not hold the run under this claim.
    ///
    /// # Errors
    /// A store error.
    pub async fn quarantine_for_worker(
        &self,
        run: RunId,
        worker: &str,
        credential: &str,
        connection: &str,
    ) -> Result<Option<bool>, EngineError> {
        let Some(run) = self.store.claimed_run(worker, run, credential).await? else {
            return Ok(None);
        };
        let version = self
            .routine_version(run.project_id, run.routine_id, run.routine_version)
            .await?;
        let on_roster = connection != ROUTINE_CONNECTION
            && version.definition.tools.iter().any(|entry| {
                entry.mode != ToolMode::Deny
                    && entry
                        .tool
                        .split_once('/')
                        .is_some_and(|(name, _)| name == connection)
            });
        let not_seen = |why: &str| {
            tracing::warn!(category = "tools", action = "worker.change_not_seen", worker_id = %worker,
                run_id = %run.id, connection = %wor_core::quote::excerpt(connection, 100),
                why, "a worker reported changed tools this process does not find");
            Ok(Some(false))
        };
        if !on_roster {
            return not_seen("the connection is not on the run's roster");
        }
        let record = match self
            .store
            .get_tool_connection_by_name(run.project_id, connection)
            .await
        {
            Ok(record) => record,
            Err(StoreError::NotFound) => return not_seen("no such connection"),
            Err(other) => return Err(other.into()),
        };
        if record.status == wor_store::ToolConnectionStatus::Quarantined {
            return Ok(Some(true));
        }
        if Engine::check_enabled(&record).is_err() {
            return not_seen("the connection is not enabled");
        }
        let session = match self.open_tool_session(&record, Some(&run)).await {
            Ok(session) => session,
            Err(_) => return not_seen("the connection cannot be reached from here"),
        };
        let listed = session.list_tools().await;
        session.close().await;
        let Ok(live) = listed else {
            return not_seen("its tools cannot be listed from here");
        };
        let pins = crate::tool_connections::stored_pins(&record)?;
        let diff = wor_tools::compare(&pins, &live);
        if diff.verdict() != wor_tools::ToolListVerdict::Quarantine {
            return not_seen("its tools are as pinned");
        }
        self.quarantine_tool_connection(&record, &live, &diff, &run)
            .await?;
        Ok(Some(true))
    }

    /// Gives back a run remote worker `worker` holds and could not take up (it refused the
    /// claim's envelope, which holds the claim's credential); false when it does not hold it.
    ///
    /// # Errors
    /// A store error.
    pub async fn refuse_for_worker(&self, run: RunId, worker: &str) -> Result<bool, EngineError> {
        let released = self.store.release_run(run, worker).await?;
        if released {
            self.wake_workers();
        }
        Ok(released)
    }

    /// Gives back a run remote worker `worker` holds under the claim whose `credential` it
    /// presents, to be resumed from its steps by the next claim; false when it does not.
    ///
    /// # Errors
    /// A store error.
    pub async fn release_for_worker(
        &self,
        run: RunId,
        worker: &str,
        credential: &str,
    ) -> Result<bool, EngineError> {
        if !self.holds_claim(run, worker, credential).await? {
            return Ok(false);
        }
        let released = self.store.release_run(run, worker).await?;
        if released {
            self.wake_workers();
        }
        Ok(released)
    }
}

/// Whether `steps` are steps a worker records, each with the provenance a driver gives it,
/// its model turns answered by `model` (the routine's; `None`: no model turn is taken).
fn worker_steps(
    steps: &[(Provenance, Step)],
    model: Option<ModelIdentity>,
) -> Result<(), WorkerStepRefusal> {
    if steps.is_empty() {
        return Err(WorkerStepRefusal::NoSteps);
    }
    if steps.len() > MAX_WORKER_STEPS_PER_WRITE {
        return Err(WorkerStepRefusal::TooManySteps(steps.len()));
    }
    for (index, (provenance, step)) in steps.iter().enumerate() {
        let kind = step.kind().as_str();
        let expected: &[Provenance] = match step {
            Step::Input(input) => {
                if input.source != Some(InputSource::OutputSchema) {
                    return Err(WorkerStepRefusal::NotAnOutputCorrection { index });
                }
                &[Provenance::Engine]
            }
            Step::ModelTurn(turn) => {
                let named = model.is_some() && turn.identity == model;
                if !named {
                    return Err(WorkerStepRefusal::NotTheRoutinesModel { index });
                }
                &[Provenance::Model]
            }
            Step::ToolCall(_) => &[Provenance::Engine],
            Step::ToolResult(_) => &[Provenance::Untrusted, Provenance::Engine],
            Step::Output(_) | Step::Memory(_) | Step::ApprovalUsed(_) | Step::Outcome(_) => {
                return Err(WorkerStepRefusal::NotAWorkersStep { index, kind });
            }
        };
        if !expected.contains(provenance) {
            return Err(WorkerStepRefusal::Provenance {
                index,
                kind,
                expected: expected
                    .iter()
                    .map(|p| p.as_str())
                    .collect::<Vec<_>>()
                    .join("` or `"),
                given: provenance.as_str(),
            });
        }
        let nesting = step
            .to_stored()
            .map_or(usize::MAX, |payload| value_nesting(&payload));
        if nesting > MAX_JSON_NESTING {
            return Err(WorkerStepRefusal::TooDeep { index });
        }
    }
    Ok(())
}
