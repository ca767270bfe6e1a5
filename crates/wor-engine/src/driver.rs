//! Driving one run: the agent loop, from the run's stored steps to its end.
//!
//! The loop's decisions — cancellation and every budget checked before each step, which call
//! to answer next, when to ask the model, how the run ends — are the pure state machine
//! `wor_core::run_loop`; this module does the I/O of each step it hands out (a model turn, one
//! call through the pipeline) and persists it before asking for the next. Everything recorded
//! is redacted first (the project's live secrets and common secret shapes).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use secrecy::ExposeSecret;
use serde_json::json;
use wor_core::audit::{Actor, AuditCategory, AuditEvent};
use wor_core::budget::{BudgetExceeded, BudgetLimit, BudgetUsage};
use wor_core::json_depth::{MAX_JSON_NESTING, value_nesting};
use wor_core::model::{AssistantMessage, ChatMessage, ModelRequest, ModelResponse, ProviderKind};
use wor_core::provenance::ContentIndex;
use wor_core::routine::{OverlapPolicy, RoutineDefinition};
use wor_core::run::{Provenance, RunStatus};
use wor_core::run_loop::{AfterCall, CallOutcome, Ending, Next, RunLoop};
use wor_core::step::{
    MemoryEntry, MemoryRole, ModelIdentity, ModelTurnStep, PendingCall, Step, ToolResultStep,
    conversation, last_model_identity, pending_calls, recorded_call_ids, untrusted_sources,
};
use wor_core::{ApprovalId, ProjectId, RunId};
use wor_models::{
    AnthropicProvider, AzureOpenAiProvider, GeminiProvider, ModelProvider,
    OpenAiCompatibleProvider, ProviderEndpoint, ProviderOptions, ReplayProvider, StreamSink,
};
use wor_policy::PolicyEngine;
use wor_secrets::Redactor;
use wor_store::{
    API_KEY_FIELD, CANCELLED_WHILE_QUEUED, CancelAsked, ConnectionStatus, MODEL_CONNECTIONS_TABLE,
    RunRecord, RunWrite, RunWritten, SecretSlot,
};

use crate::call::{CallScope, Stopped, as_recorded, run_ended, run_event, with_step};
use crate::output::AfterTurn;
use crate::run_tools::{RunTools, ToolsUnavailable};
use crate::{Engine, EngineError};

/// How many runs' notes that their announcements are queued are written together.
const ANNOUNCED_BATCH: usize = 64;
/// The longest a note waits to be written with others.
const ANNOUNCED_WAIT: Duration = Duration::from_millis(500);

/// Runs whose announcements are queued, not yet marked so in the database.
#[derive(Debug, Default)]
pub(crate) struct AnnouncedRuns {
    runs: Vec<wor_store::AnnouncedRun>,
    /// When the first of `runs` was noted.
    since: Option<Instant>,
}

/// Output tokens asked for per turn when the routine does not say.
const DEFAULT_MAX_OUTPUT_TOKENS: u32 = 1024;

/// Where driving a run stopped.
enum Flow {
    /// The run ends; with its usage when that changed since its last journal write, so the
    /// end's write records it.
    End(Ending, Option<BudgetUsage>),
    /// A call waits for a person; the run holds no worker until it is queued again.
    Parked,
}

/// What one run is driven with, prepared once per (re)start.
#[derive(Clone, Copy)]
struct RunContext<'a> {
    run: &'a RunRecord,
    definition: &'a RoutineDefinition,
    provider: &'a dyn ModelProvider,
    connection: &'a ModelCredential,
    redactor: &'a Redactor,
    tools: &'a RunTools,
    policy: &'a PolicyEngine,
}

/// The model connection a run's calls go through and the version of its key, recorded on
/// every model call (`None` for the replay model, which has no connection).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct ModelCredential {
    connection_id: Option<wor_core::ConnectionId>,
    credential_version: Option<i64>,
}

/// The tokens of a model call that was answered, for its trace span.
fn turn_tokens(outcome: &Result<TurnOutcome, EngineError>) -> Option<(u64, u64)> {
    match outcome {
        Ok(TurnOutcome::Response(response)) => {
            Some((response.usage.input_tokens, response.usage.output_tokens))
        }
        _ => None,
    }
}

/// Why a run has no model to call: it fails closed with this reason.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ModelUnavailable {
    #[error("provider `replay` is refused in production")]
    ReplayInProduction,
    #[error("the replay routine has no script")]
    NoScript,
    #[error("the replay script cannot resume this run: {0}")]
    ReplayResume(#[source] wor_models::ModelError),
    #[error("provider `replay` takes no model connection")]
    ReplayConnection,
    #[error("the routine names no model connection")]
    NoConnection,
    #[error("model connections cannot be read: {0}")]
    Connections(#[source] wor_store::StoreError),
    #[error("model connection `{name}` is missing or revoked")]
    Missing { name: String },
    #[error("model connection `{name}` speaks `{speaks}`, the routine's model `{routine}`")]
    OtherProvider {
        name: String,
        speaks: ProviderKind,
        routine: ProviderKind,
    },
    #[error("the key of model connection `{name}` cannot be opened: {source}")]
    KeyUnopened {
        name: String,
        #[source]
        source: wor_store::VaultError,
    },
    #[error("the key of model connection `{name}` cannot be read: {source}")]
    KeyUnread {
        name: String,
        #[source]
        source: wor_store::StoreError,
    },
    #[error("model connection `{name}` has no API key: {source}")]
    Keyless {
        name: String,
        #[source]
        source: wor_egress::KeylessModelRefusal,
    },
    #[error("the use of a secret cannot be recorded: {0}")]
    SecretUseUnrecorded(#[source] wor_store::StoreError),
}

/// What a model call came to.
enum TurnOutcome {
    Response(Box<ModelResponse>),
    End(Ending),
    /// The call failed; the run ends failed, saying why once redacted.
    Failed(wor_models::ModelError),
}

impl Engine {
    /// The redactor for everything a run of `project` records or sends, and for what the
    /// project's configuration shows (a routine's TOML): the project's live secret values and
    /// the common secret shapes.
    pub async fn project_redactor(
        &self,
        project: wor_core::ProjectId,
    ) -> Result<Redactor, EngineError> {
        let live: Vec<_> = self
            .vault
            .project_values(project)
            .await
            .map_err(EngineError::Vault)?;
        Redactor::new(live.iter().map(|s| s.expose_secret()))
            .map_err(|e| EngineError::InvalidState(format!("cannot build the redactor: {e}")))
    }

    /// The redactor for everything `run` records or sends: for a remote worker, the secrets
    /// its envelope brought (the control plane redacts with all of the project's again);
    /// otherwise the project's ([`Engine::project_redactor`]).
    async fn run_redactor(&self, run: &RunRecord) -> Result<Redactor, EngineError> {
        match self.remote_claim(run.id) {
            Some(claim) => {
                let claim = claim?;
                let values = Engine::claimed_secret_values(&claim);
                Redactor::new(values.iter().map(|s| s.expose_secret())).map_err(|e| {
                    EngineError::InvalidState(format!("cannot build the redactor: {e}"))
                })
            }
            None => self.project_redactor(run.project_id).await,
        }
    }

    /// Drives a run this worker holds the lease of, until it ends, parks for an approval or
    /// the lease is lost.
    pub(crate) async fn drive(&self, run: RunRecord) -> Result<(), EngineError> {
        // A turn an earlier drive of this run carried and never wrote (its task panicked or
        // was aborted) is not this drive's: the run resumes from its stored steps.
        self.drop_carried(run.id);
        let _forget = ForgetCarried {
            engine: self,
            run: run.id,
        };
        self.drive_to_end(&run).await
    }

    async fn drive_to_end(&self, run: &RunRecord) -> Result<(), EngineError> {
        let ending = match self.drive_loop(run).await {
            Ok(Flow::End(ending, usage)) => (ending, usage),
            Ok(Flow::Parked) => return Ok(()),
            // Another worker drives the run now: it is theirs to end.
            Err(EngineError::LeaseLost) => {
                tracing::warn!(category = "run", action = "run.lease_lost", project_id = %run.project_id,
                    run_id = %run.id, "the run's lease was lost to another worker; it is left to them");
                return Ok(());
            }
            Err(error) => match error.run_failure() {
                Some(reason) => (Ending::new(RunStatus::Failed, reason), None),
                None => return Err(error),
            },
        };
        let (ending, usage) = ending;
        self.end_run(run, &self.config.worker_id, ending, usage)
            .await
    }

    /// Ends a run `holder` holds the lease of: its end, outcome step and audit entry in one
    /// write, then what follows an end (approvals it left cancelled, memory, run webhooks).
    /// Nothing is written when `holder` no longer holds the run.
    pub(crate) async fn end_run(
        &self,
        run: &RunRecord,
        holder: &str,
        ending: Ending,
        usage: Option<BudgetUsage>,
    ) -> Result<(), EngineError> {
        self.end_run_with(run, self.journal_for(run, holder), ending, usage)
            .await
            .map(|_| ())
    }

    /// Ends a run with `end`, a journal write of its holder that may carry fences of its own
    /// (a remote worker's claim): see [`Engine::end_run`]. Whether the run ended by it.
    pub(crate) async fn end_run_with(
        &self,
        run: &RunRecord,
        mut end: RunWrite,
        ending: Ending,
        usage: Option<BudgetUsage>,
    ) -> Result<bool, EngineError> {
        if self.is_remote() {
            return self.end_claimed(run, ending, usage).await;
        }
        // The end, its outcome step and its audit entry are one write: nothing after it can
        // keep the run's end off the chain.
        if let Some(usage) = usage {
            end = end.usage(usage);
        }
        let end = end.end(ending.status, &ending.outcome).audit(run_ended(
            run,
            ending.status,
            &ending.outcome,
        ));
        let cancelled = match self.record_carried(end).await? {
            RunWritten::Committed {
                cancelled_approvals,
                ..
            } => Some(cancelled_approvals),
            RunWritten::LeaseLost | RunWritten::CredentialEnded | RunWritten::CancelRequested => {
                None
            }
        };
        let finished = cancelled.is_some();
        if let Some(cancelled) = cancelled {
            crate::metrics::run_finished(run, &ending);
            crate::traces::run_finished(run, ending.status);
            // What the end announces carries the usage the run ended with: the driver's, or,
            // for an end that brought none, the run's as stored.
            let ended = match usage {
                Some(usage) => RunRecord {
                    usage,
                    ..run.clone()
                },
                None => self.as_stored(run).await,
            };
            let announced = self
                .announce_end(&ended, ending.status, &ending.outcome, &cancelled)
                .await;
            if let Err(error) = announced {
                self.live_text.close(run.id);
                return Err(error);
            }
        }
        self.live_text.close(run.id);
        tracing::info!(category = "run", action = "run.end", project_id = %run.project_id,
            run_id = %run.id, status = ending.status.as_str(), lease_held = finished, "run ended");
        Ok(finished)
    }

    /// `run` as the store now holds it (its usage as its writes left it), or as given when it
    /// cannot be read: what an announcement of its park or end describes.
    pub(crate) async fn as_stored(&self, run: &RunRecord) -> RunRecord {
        match self.store.get_run(run.project_id, run.id).await {
            Ok(stored) => stored,
            Err(_) => run.clone(),
        }
    }

    /// Queues what `run`'s end announces — the notices of the approvals it left `cancelled`,
    /// its memory (when it succeeded), its run webhook — then marks them queued. Each is
    /// queued once, by its key, so a sweep that finds them still due after a crash (the end
    /// made them due in its own write) queues only what is missing.
    pub(crate) async fn announce_end(
        &self,
        run: &RunRecord,
        status: RunStatus,
        outcome: &str,
        cancelled: &[ApprovalId],
    ) -> Result<(), EngineError> {
        // Each is attempted whatever the others did; the first failure is answered, and the
        // run stays due for the sweep, which queues what is missing.
        let mut first_failure = None;
        for cancelled in cancelled {
            if let Err(error) = self
                .notify_approval_changed(run.project_id, *cancelled, "cancelled", None)
                .await
            {
                first_failure.get_or_insert(error);
            }
        }
        if status == RunStatus::Succeeded
            && let Err(error) = self.remember(run, outcome).await
        {
            first_failure.get_or_insert(error);
        }
        if let Err(error) = self
            .enqueue_run_webhook(run, status, Some(outcome), None)
            .await
        {
            first_failure.get_or_insert(error);
        }
        match first_failure {
            Some(error) => Err(error),
            None => {
                self.mark_announced(run.id, status).await;
                Ok(())
            }
        }
    }

    /// Notes that `run`'s announcements for its move to `status` are queued. The notes are
    /// written together, once [`ANNOUNCED_BATCH`] have gathered or the first has waited
    /// [`ANNOUNCED_WAIT`], and by each sweep: one write for many runs, off their path. A note
    /// lost with its process only makes the sweep queue those announcements again, each once
    /// by its key.
    pub(crate) async fn mark_announced(&self, run: RunId, status: RunStatus) {
        let (due, first) = {
            let mut announced = self.announced_runs();
            announced.runs.push(wor_store::AnnouncedRun {
                id: run,
                status,
                noted_at: wor_store::now_millis(),
            });
            let first = announced.since.is_none();
            let since = *announced.since.get_or_insert_with(Instant::now);
            (
                announced.runs.len() >= ANNOUNCED_BATCH || since.elapsed() >= ANNOUNCED_WAIT,
                first,
            )
        };
        if due {
            self.flush_announced().await;
        } else if first {
            // The first note of a batch is written after its wait, whatever follows it.
            let engine = self.clone();
            tokio::spawn(async move {
                tokio::time::sleep(ANNOUNCED_WAIT).await;
                engine.flush_announced().await;
            });
        }
    }

    /// Writes the notes [`Engine::mark_announced`] gathered; a failure is logged and the
    /// notes are dropped (the sweep then queues those announcements again).
    pub(crate) async fn flush_announced(&self) {
        let runs = {
            let mut announced = self.announced_runs();
            announced.since = None;
            std::mem::take(&mut announced.runs)
        };
        if runs.is_empty() {
            return;
        }
        if let Err(error) = self.store.announced(&runs).await {
            tracing::warn!(category = "run", runs = runs.len(), error = %error,
                "marking runs announced failed; the sweep queues their announcements again");
        }
    }

    fn announced_runs(&self) -> std::sync::MutexGuard<'_, AnnouncedRuns> {
        self.announced
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Asks run `id` of `project` to stop, with its nested runs ([`Store::request_cancel`]),
    /// for `requester` when a person or a key asked (its `run.cancel` entry is appended when
    /// the cancel asked any run to stop; a cancel the engine makes itself, by an overlap
    /// policy or for a parent, has none). Each run the cancel took from the queue is ended
    /// here, `cancelled`, as a worker ends a run: its end and `run.end` entry in one write,
    /// then its run webhook. An end that fails is logged: the run stays leased to this
    /// engine and flagged, so once the lease runs out a worker ends it, and its entry is
    /// written then. The run named is answered as the cancel left it.
    ///
    /// [`Store::request_cancel`]: wor_store::Store::request_cancel
    pub async fn request_cancel(
        &self,
        project: ProjectId,
        id: RunId,
        requester: Option<Actor>,
    ) -> Result<CancelAsked, EngineError> {
        self.cancel_as(project, id, requester.map(|actor| (actor, None)))
            .await
    }

    /// [`Engine::request_cancel`], its `run.cancel` naming, beside the requester, the overlap
    /// policy that asked when it was one.
    pub(crate) async fn cancel_as(
        &self,
        project: ProjectId,
        id: RunId,
        requester: Option<(Actor, Option<OverlapPolicy>)>,
    ) -> Result<CancelAsked, EngineError> {
        let holder = self.config.worker_id.as_str();
        let lease_ms = self.lease_ms();
        // The requester's `run.cancel` is staged with the cancel, when it asked anything: a
        // crash before it is appended here leaves it for the audit writer's sweep.
        let (mut asked, staged) = match requester {
            Some((actor, overlap)) => {
                let entry = |asked: &CancelAsked| {
                    // The status the cancel leads to: a run taken from the queue ends cancelled.
                    let taken = asked.to_end.first().is_some_and(|run| run.id == id);
                    let status = if taken {
                        RunStatus::Cancelled
                    } else {
                        asked.run.status
                    };
                    AuditEvent::new(project, AuditCategory::RunCancel, actor.clone())
                        .subject("run_id", id)
                        .runs(asked.run.root_run_id, asked.run.parent_run_id)
                        .payload(match overlap {
                            Some(policy) => json!({ "status": status.as_str(), "overlap": policy }),
                            None => json!({ "status": status.as_str() }),
                        })
                };
                self.store
                    .request_cancel_staged(project, id, holder, lease_ms, Some(&entry))
                    .await?
            }
            None => (
                self.store
                    .request_cancel(project, id, holder, lease_ms)
                    .await?,
                None,
            ),
        };
        let taken = asked.to_end.first().is_some_and(|run| run.id == id);
        // The request is appended before the ends it causes. The cancel is made and its entry
        // is on disk: a failed append is the sweep's to finish (after the ends, then), and the
        // ends are made all the same.
        self.append_staged_or_log(staged).await;
        for run in &asked.to_end {
            let ending = Ending::new(RunStatus::Cancelled, CANCELLED_WHILE_QUEUED);
            if let Err(error) = self.end_run(run, holder, ending, None).await {
                // Before its end was written, the run stays leased and flagged until a worker
                // ends it; after (its webhook, say), only what follows the end is missing.
                tracing::error!(category = "run", action = "run.cancel", project_id = %project,
                    run_id = %run.id, error = %error,
                    "ending a run taken from the queue failed; if its end was not written, a worker writes it once the lease runs out");
            }
        }
        // Parked runs queued, flagged, for a worker to end, and whatever the ends freed: a
        // parent waiting for its nested run, a slot of the routine's or the project's.
        if asked.asked > 0 {
            self.wake_workers();
        }
        if taken {
            asked.run = self.store.get_run(project, id).await?;
        }
        Ok(asked)
    }

    async fn drive_loop(&self, run: &RunRecord) -> Result<Flow, EngineError> {
        // A run asked to stop before a worker took it up (parked, or given back) ends before
        // its model, tools and credential are made ready: a connection revoked or disabled
        // meanwhile must not turn its cancel into a failure. A cancel asked later is seen at
        // the loop's first step.
        if run.cancel_requested {
            return Ok(Flow::End(Ending::cancelled(), None));
        }
        let version = self
            .routine_version(run.project_id, run.routine_id, run.routine_version)
            .await?;
        let definition = &version.definition;
        let steps = match self.remote_claim(run.id) {
            Some(claim) => Engine::claimed_steps(&*claim?),
            None => self.store.list_run_steps(run.project_id, run.id, 0).await?,
        };
        let labelled = || steps.iter().map(|s| (&s.step, s.provenance));
        let messages = conversation(&definition.instructions, labelled());
        let pending = pending_calls(steps.iter().map(|s| &s.step));
        let call_ids = recorded_call_ids(steps.iter().map(|s| &s.step));
        let untrusted = untrusted_sources(labelled());
        let content = crate::pipeline::run_content(definition, labelled());
        let (provider, connection) = match self.provider(run, definition, &messages).await {
            Ok(provider) => provider,
            Err(unavailable) => {
                return Ok(Flow::End(
                    Ending::new(RunStatus::Failed, unavailable.to_string()),
                    None,
                ));
            }
        };
        // A key replaced since the run's last model call is another credential: fail closed.
        if let Some(reason) = credential_changed(
            last_model_identity(steps.iter().map(|s| &s.step)),
            &connection,
        ) {
            return Ok(Flow::End(Ending::new(RunStatus::Failed, reason), None));
        }
        // Policies that do not validate fail the run (`EngineError::run_failure`).
        let policy = self.run_policy(run, definition).await?;
        let redactor = self.run_redactor(run).await?;
        let tools = match self.prepare_tools(run, definition).await {
            Ok(tools) => tools,
            Err(ToolsUnavailable::Refused(reason)) => {
                return Ok(Flow::End(
                    Ending::new(RunStatus::Failed, redactor.redact(&reason).into_owned()),
                    None,
                ));
            }
            Err(ToolsUnavailable::Store(error)) => return Err(error.into()),
        };
        let context = RunContext {
            run,
            definition,
            provider: provider.as_ref(),
            connection: &connection,
            redactor: &redactor,
            tools: &tools,
            policy: &policy,
        };
        let flow = self
            .turns(&context, messages, pending, untrusted, content, call_ids)
            .await;
        tools.close().await;
        flow
    }

    /// Adds what a finished run was asked and what it answered to its thread's memory, when
    /// its routine keeps memory. The answer is labelled untrusted when untrusted content was in
    /// the run's context: it may have been influenced by it, and it stays marked forever.
    async fn remember(&self, run: &RunRecord, answer: &str) -> Result<(), EngineError> {
        let Some(thread) = &run.thread else {
            return Ok(());
        };
        let version = self
            .routine_version(run.project_id, run.routine_id, run.routine_version)
            .await?;
        if !version.definition.memory.enabled {
            return Ok(());
        }
        let steps = self.store.list_run_steps(run.project_id, run.id, 0).await?;
        let tainted = !untrusted_sources(steps.iter().map(|s| (&s.step, s.provenance))).is_empty();
        let now = wor_store::now_millis();
        let mut entries = Vec::new();
        if let Some((input, provenance)) = steps.iter().find_map(|s| match &s.step {
            Step::Input(input) => Some((input, s.provenance)),
            _ => None,
        }) {
            entries.push(MemoryEntry {
                run_id: run.id,
                role: MemoryRole::Requester,
                provenance,
                text: input.text(),
                created_at: now,
            });
        }
        entries.push(MemoryEntry {
            run_id: run.id,
            role: MemoryRole::Assistant,
            provenance: if tainted {
                Provenance::Untrusted
            } else {
                Provenance::Model
            },
            text: answer.to_owned(),
            created_at: now,
        });
        self.store
            .append_memory(run.project_id, run.routine_id, thread, &entries)
            .await?;
        Ok(())
    }

    /// The policy a run's calls are decided by: the project's policy (or the built-in
    /// default), the routine's own, and its roster modes. [`EngineError::InvalidPolicies`]
    /// when they do not validate: a run being driven fails closed with it. Built once per
    /// routine version and project policy text, then shared (see [`crate::versions`]).
    pub(crate) async fn run_policy(
        &self,
        run: &RunRecord,
        definition: &RoutineDefinition,
    ) -> Result<Arc<PolicyEngine>, EngineError> {
        let project = match self.remote_claim(run.id) {
            Some(claim) => Engine::claimed_policy(&*claim?),
            None => self
                .store
                .project_policy(run.project_id)
                .await?
                .map(|p| p.text),
        };
        let key = crate::versions::PolicyKey::new(run, project.as_deref());
        if let Some(built) = self.versions.policy(&key) {
            return Ok(built);
        }
        let mut builder = PolicyEngine::builder().roster(&definition.tools);
        if let Some(text) = project {
            builder = builder.project_policy(text);
        }
        if let Some(policy) = &definition.policy {
            builder = builder.routine_policy(policy.clone());
        }
        let built = Arc::new(builder.build().map_err(EngineError::InvalidPolicies)?);
        self.versions.keep_policy(key, built.clone());
        Ok(built)
    }

    /// Drives the run's loop (`wor_core::run_loop`): does each step it hands out — a model
    /// turn, or one call through the pipeline — and persists it before asking for the next.
    async fn turns(
        &self,
        context: &RunContext<'_>,
        messages: Vec<ChatMessage>,
        pending: Vec<PendingCall>,
        untrusted: BTreeSet<String>,
        mut content: ContentIndex,
        call_ids: BTreeSet<String>,
    ) -> Result<Flow, EngineError> {
        let RunContext {
            run,
            definition,
            provider,
            connection,
            redactor,
            tools,
            policy,
        } = *context;
        // A nested run never gets more than what was left of its root's budget.
        let limits = crate::nested::capped(definition.budget, run.budget_cap.as_ref());
        let started = Instant::now();
        // Wall time already spent before a restart counts too; time parked for a person does
        // not.
        let spent_before = crate::authority::wall_spent_before(run);
        let elapsed = || spent_before.saturating_add(started.elapsed().as_secs());
        let authority = self
            .mint_authority(
                run,
                definition,
                Duration::from_secs(limits.wall_seconds.saturating_sub(spent_before)),
            )
            .await?;
        let price = self
            .config
            .prices
            .get(&definition.model.model)
            .copied()
            .unwrap_or_default();
        let mut machine = RunLoop::resume(limits, run.usage, pending, call_ids, untrusted);
        // One request for the whole loop: each turn appends to its conversation rather than
        // copying it, so a turn costs the same however long the run has been going.
        let mut request = ModelRequest {
            model: definition.model.model.clone(),
            messages,
            tools: tools.specs(),
            max_output_tokens: definition
                .model
                .max_output_tokens
                .unwrap_or(DEFAULT_MAX_OUTPUT_TOKENS),
            temperature: None,
            output_schema: definition.output.as_ref().map(|o| o.schema.clone()),
        };
        // A run that stopped after recording its final answer (a crash before its end was
        // written) ends with that answer: asking the model again would pay for a turn it has
        // and could answer differently.
        if let Some(ChatMessage::Assistant(last)) = request.messages.last()
            && last.tool_calls.is_empty()
        {
            // A cancel requested since still wins, as it would have before the next step.
            if self.cancel_requested(run.id).await? {
                return Ok(Flow::End(Ending::cancelled(), None));
            }
            let answer = last.text.clone();
            let ended = machine.turn_recorded(Vec::new(), elapsed(), || answer);
            if let AfterTurn::End(ending) = self
                .after_turn(run, definition, &machine, ended, &mut request.messages)
                .await?
            {
                return Ok(Flow::End(ending, None));
            }
        }
        // Whether a cancel was requested, as the last journal write found it: a step that
        // follows a write need not ask again.
        let mut cancel_known: Option<bool> = None;
        loop {
            // A stopping worker gives the run back between steps, never inside one.
            if self.stops_here(run.id) {
                return Err(EngineError::Stopping);
            }
            let cancel_requested = match cancel_known.take() {
                Some(known) => known,
                None => self.cancel_requested(run.id).await?,
            };
            match machine.next(cancel_requested, elapsed()) {
                Next::End(ending) => {
                    return Ok(Flow::End(ending, Some(machine.usage())));
                }
                Next::CallModel => {
                    let remaining =
                        Duration::from_secs(limits.wall_seconds.saturating_sub(elapsed()));
                    // The text goes out to watchers as it comes, redacted; the turn is
                    // recorded whole below.
                    let mut live = self.live_text.sink(run.id, redactor.stream());
                    let began = std::time::SystemTime::now();
                    let outcome = self
                        .call_model(run, provider, &request, remaining, &limits, &mut live)
                        .await;
                    live.finish();
                    crate::traces::model_turn(
                        run,
                        definition.model.provider,
                        began,
                        turn_tokens(&outcome),
                    );
                    let mut response = match outcome? {
                        TurnOutcome::Response(response) => response,
                        TurnOutcome::End(ending) => {
                            return Ok(Flow::End(ending, Some(machine.usage())));
                        }
                        // Redacted as everything the run records: the provider's words may
                        // echo the model key or any of the run's secrets, not only their shapes.
                        TurnOutcome::Failed(error) => {
                            // What the provider said it used before failing counts too.
                            let used = error.usage_consumed();
                            machine.model_answered(
                                used.input_tokens,
                                used.output_tokens,
                                &price,
                                &mut [],
                            );
                            let reason = format!("the model call failed: {error}");
                            let ending = Ending::new(
                                RunStatus::Failed,
                                redactor.redact(&reason).into_owned(),
                            );
                            return Ok(Flow::End(ending, Some(machine.usage())));
                        }
                    };
                    // Call ids key steps and approvals: the loop makes each unique in the run,
                    // whatever the model sent.
                    machine.model_answered(
                        response.usage.input_tokens,
                        response.usage.output_tokens,
                        &price,
                        &mut response.message.tool_calls,
                    );
                    let turn = ModelTurn {
                        definition,
                        connection,
                        response: &response,
                    };
                    let (message, cancel) = self
                        .record_model_turn(run, turn, machine.usage(), redactor)
                        .await?;
                    cancel_known = Some(cancel);
                    // The recorded (redacted) calls are answered, as they will be after a
                    // resume.
                    let calls = message
                        .tool_calls
                        .iter()
                        .cloned()
                        .map(PendingCall::fresh)
                        .collect();
                    request.messages.push(ChatMessage::Assistant(message));
                    let ended = machine.turn_recorded(calls, elapsed(), || {
                        redactor.redact(&response.message.text).into_owned()
                    });
                    if let AfterTurn::End(ending) = self
                        .after_turn(run, definition, &machine, ended, &mut request.messages)
                        .await?
                    {
                        return Ok(Flow::End(ending, None));
                    }
                }
                Next::Answer(call) => {
                    let scope = CallScope {
                        run,
                        definition,
                        tools,
                        redactor,
                        policy,
                        untrusted: machine.untrusted(),
                        content: &content,
                        limits,
                        wall_spent: elapsed(),
                        authority: &authority,
                    };
                    let outcome = self.answer_call(&scope, &call, machine.usage()).await?;
                    match machine.call_answered(&outcome) {
                        AfterCall::Continue => {}
                        AfterCall::Park => return Ok(Flow::Parked),
                        AfterCall::End(ending) => {
                            return Ok(Flow::End(ending, Some(machine.usage())));
                        }
                    }
                    // The loop goes on only after an answer: its step carries the run's usage
                    // and renews the lease in the same write.
                    let CallOutcome::Answered {
                        answer, provenance, ..
                    } = outcome
                    else {
                        return Err(EngineError::InvalidState(
                            "a call the run went on after had no answer".to_owned(),
                        ));
                    };
                    let tool = answer.tool.clone();
                    let (recorded, cancel) = self
                        .record_tool_result(run, answer, provenance, machine.usage(), redactor)
                        .await?;
                    // Later calls are labelled against this result too.
                    wor_core::step::index_result(&mut content, &tool, &recorded, provenance);
                    cancel_known = Some(cancel);
                    request.messages.push(ChatMessage::Tool(recorded));
                }
            }
        }
    }

    /// Records a call's answer (redacted) as a `tool_result` step with its audit entry and the
    /// run's usage after it; returns the result as recorded, which is what the model gets, as
    /// it will after a resume, and whether a cancel of the run has been requested.
    async fn record_tool_result(
        &self,
        run: &RunRecord,
        answer: ToolResultStep,
        provenance: Provenance,
        usage: BudgetUsage,
        redactor: &Redactor,
    ) -> Result<(wor_core::model::ToolResult, bool), EngineError> {
        let Step::ToolResult(recorded) = as_recorded(Step::ToolResult(answer), redactor)? else {
            return Err(EngineError::InvalidState(
                "a recorded tool result changed kind".to_owned(),
            ));
        };
        let written = self
            .record(
                with_step(
                    self.journal(run),
                    run,
                    provenance,
                    Step::ToolResult(recorded.clone()),
                )
                .usage(usage),
            )
            .await?;
        Ok((recorded.result, written.cancel_seen()))
    }

    /// Records a model turn (redacted) with its audit entry and the run's usage after it;
    /// returns the turn as recorded, which is what the conversation goes on with, as it will
    /// after a resume, and whether a cancel of the run has been requested (for a turn that
    /// asks for calls, whether the write that records the first of them must find out).
    async fn record_model_turn(
        &self,
        run: &RunRecord,
        turn: ModelTurn<'_>,
        usage: BudgetUsage,
        redactor: &Redactor,
    ) -> Result<(AssistantMessage, bool), EngineError> {
        let ModelTurn {
            definition,
            connection,
            response,
        } = turn;
        let turn = Step::ModelTurn(ModelTurnStep {
            message: response.message.clone(),
            usage: response.usage,
            stop_reason: response.stop_reason.clone(),
            // The model identity (provider, connection, model) and the key's version, on every
            // call.
            identity: Some(ModelIdentity {
                provider: definition.model.provider,
                connection_id: connection.connection_id,
                model_id: definition.model.model.clone(),
                credential_version: connection.credential_version,
            }),
            nul_replaced: false,
        });
        let Step::ModelTurn(recorded) = as_recorded(turn, redactor)? else {
            return Err(EngineError::InvalidState(
                "a recorded model turn changed kind".to_owned(),
            ));
        };
        let write = with_step(
            self.journal(run),
            run,
            Provenance::Model,
            Step::ModelTurn(recorded.clone()),
        )
        .usage(usage);
        crate::metrics::model_called(
            definition.model.provider,
            response.usage.input_tokens,
            response.usage.output_tokens,
        );
        if recorded.message.tool_calls.is_empty() {
            let written = self.record(write).await?;
            return Ok((recorded.message, written.cancel_seen()));
        }
        // A turn that asks for calls is committed with the write that records the first of
        // them. That write reserves the call or parks the run only unless a cancel has been
        // requested, and every other write after it reports one: the loop goes on as if none
        // had been, without asking.
        self.carry(write);
        Ok((recorded.message, false))
    }

    /// One model call, stopped early by a cancel request or the wall-time deadline.
    async fn call_model(
        &self,
        run: &RunRecord,
        provider: &dyn ModelProvider,
        request: &ModelRequest,
        remaining: Duration,
        limits: &wor_core::routine::BudgetLimits,
        sink: &mut dyn StreamSink,
    ) -> Result<TurnOutcome, EngineError> {
        let call = provider.complete(request, sink);
        Ok(match self.until_stopped(run, remaining, call).await? {
            Ok(Ok(response)) => match too_deep_call(&response) {
                Some(ending) => TurnOutcome::End(ending),
                None => TurnOutcome::Response(Box::new(response)),
            },
            Ok(Err(error)) => TurnOutcome::Failed(error),
            Err(Stopped::Deadline) => TurnOutcome::End(Ending::budget(BudgetExceeded {
                limit: BudgetLimit::WallTime,
                used: limits.wall_seconds,
                allowed: limits.wall_seconds,
            })),
            Err(Stopped::Cancelled) => TurnOutcome::End(Ending::cancelled()),
        })
    }

    /// The model provider of the routine, rechecking its connection now (S14): a connection
    /// that is missing or revoked fails the run closed, with the reason.
    async fn provider(
        &self,
        run: &RunRecord,
        definition: &RoutineDefinition,
        history: &[ChatMessage],
    ) -> Result<(Box<dyn ModelProvider>, ModelCredential), ModelUnavailable> {
        let model = &definition.model;
        if model.provider == ProviderKind::Replay {
            if self.config.production {
                return Err(ModelUnavailable::ReplayInProduction);
            }
            // Checked when the routine was applied (and again whenever it is read back).
            let script = model.script.clone().ok_or(ModelUnavailable::NoScript)?;
            return ReplayProvider::resuming(script, history)
                .map(|p| {
                    (
                        Box::new(p) as Box<dyn ModelProvider>,
                        ModelCredential::default(),
                    )
                })
                .map_err(ModelUnavailable::ReplayResume);
        }
        let name = model
            .connection
            .as_deref()
            .ok_or(ModelUnavailable::NoConnection)?;
        let claim = self
            .remote_claim(run.id)
            .transpose()
            .map_err(|_| ModelUnavailable::Connections(wor_store::StoreError::NotFound))?;
        let connections = match &claim {
            Some(claim) => Engine::claimed_model_connection(claim),
            None => self
                .store
                .list_model_connections(run.project_id)
                .await
                .map_err(ModelUnavailable::Connections)?,
        };
        let connection = connections
            .into_iter()
            .find(|c| c.name == name && c.status == ConnectionStatus::Active)
            .ok_or_else(|| ModelUnavailable::Missing {
                name: name.to_owned(),
            })?;
        if connection.provider != model.provider {
            return Err(ModelUnavailable::OtherProvider {
                name: name.to_owned(),
                speaks: connection.provider,
                routine: model.provider,
            });
        }
        let slot = SecretSlot::new(
            run.project_id,
            MODEL_CONNECTIONS_TABLE,
            connection.id,
            API_KEY_FIELD,
        );
        // A connection without a key is a local model server: allowed only while its address
        // is in the operator's model ranges, rechecked at every (re)start.
        // A remote worker's key is the one its envelope brought, if any; the control plane
        // recorded its use when it sealed it.
        let key = match &claim {
            Some(claim) => Engine::claimed_model_key(claim),
            None => match self.vault.metadata(&slot).await {
                Ok(Some(_)) => Some(self.vault.open(&slot).await.map_err(|source| {
                    ModelUnavailable::KeyUnopened {
                        name: name.to_owned(),
                        source,
                    }
                })?),
                Ok(None) => None,
                Err(source) => {
                    return Err(ModelUnavailable::KeyUnread {
                        name: name.to_owned(),
                        source,
                    });
                }
            },
        };
        if key.is_none() {
            self.model_egress
                .vet_keyless_model(&connection.base_url)
                .await
                .map_err(|source| ModelUnavailable::Keyless {
                    name: name.to_owned(),
                    source,
                })?;
        }
        if key.is_some() && claim.is_none() {
            self.audit
                .append(
                    run_event(run, AuditCategory::SecretUse)
                        .subject("connection_id", connection.id)
                        .payload(json!({ "slot": slot.to_string(), "credential_version": connection.credential_version })),
                )
                .await
                .map_err(ModelUnavailable::SecretUseUnrecorded)?;
        }
        let credential = ModelCredential {
            connection_id: Some(connection.id),
            credential_version: Some(connection.credential_version),
        };
        let endpoint = ProviderEndpoint::new(connection.base_url, key);
        let options = ProviderOptions::default();
        let provider: Box<dyn ModelProvider> = match model.provider {
            ProviderKind::Anthropic => Box::new(AnthropicProvider::new(
                self.model_egress.clone(),
                endpoint,
                options,
            )),
            ProviderKind::OpenaiCompatible => Box::new(OpenAiCompatibleProvider::new(
                self.model_egress.clone(),
                endpoint,
                options,
            )),
            ProviderKind::AzureOpenai => Box::new(AzureOpenAiProvider::new(
                self.model_egress.clone(),
                endpoint,
                options,
            )),
            ProviderKind::Gemini => Box::new(GeminiProvider::new(
                self.model_egress.clone(),
                endpoint,
                options,
            )),
            ProviderKind::Replay => return Err(ModelUnavailable::ReplayConnection),
        };
        Ok((provider, credential))
    }
}

/// Why the run may not go on with `now`: its last recorded model call (`then`) went through
/// another connection or another version of the key.
fn credential_changed(then: Option<&ModelIdentity>, now: &ModelCredential) -> Option<String> {
    let then = then?;
    if then.connection_id != now.connection_id {
        return Some(
            "the routine's model connection is not the one this run started with; the run fails closed"
                .to_owned(),
        );
    }
    match (then.credential_version, now.credential_version) {
        (Some(then), Some(now)) if then != now => Some(format!(
            "the model connection's key was replaced since this run's last model call (credential version {then}, now {now}); the run fails closed"
        )),
        _ => None,
    }
}

/// A tool call whose arguments nest deeper than [`MAX_JSON_NESTING`] ends the run, before
/// anything records or validates them (`wor_core::json_depth`).
fn too_deep_call(response: &ModelResponse) -> Option<Ending> {
    let call = response
        .message
        .tool_calls
        .iter()
        .find(|call| value_nesting(&call.arguments) > MAX_JSON_NESTING)?;
    Some(Ending::new(
        RunStatus::Failed,
        format!(
            "the model's call of `{}` has arguments nested deeper than {MAX_JSON_NESTING} levels",
            call.name
        ),
    ))
}

/// Forgets what a run carried when its drive is over, however it ends: returned, failed,
/// panicked or aborted.
struct ForgetCarried<'a> {
    engine: &'a Engine,
    run: wor_core::RunId,
}

impl Drop for ForgetCarried<'_> {
    fn drop(&mut self) {
        self.engine.drop_carried(self.run);
    }
}

/// A model's answer and what it was asked under, as a turn records them.
struct ModelTurn<'a> {
    definition: &'a RoutineDefinition,
    connection: &'a ModelCredential,
    response: &'a ModelResponse,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replaced_key_or_connection_stops_a_resumed_run() {
        let connection = wor_core::ConnectionId::new();
        let now = ModelCredential {
            connection_id: Some(connection),
            credential_version: Some(2),
        };
        let recorded = |version: i64| ModelIdentity {
            provider: ProviderKind::OpenaiCompatible,
            connection_id: Some(connection),
            model_id: "m".to_owned(),
            credential_version: Some(version),
        };
        // Nothing recorded yet (or turns recorded before identities were), or the same key.
        assert_eq!(credential_changed(None, &now), None);
        assert_eq!(credential_changed(Some(&recorded(2)), &now), None);
        let replaced = credential_changed(Some(&recorded(1)), &now).unwrap();
        assert!(
            replaced.contains("credential version 1, now 2"),
            "{replaced}"
        );
        let other = ModelCredential {
            connection_id: Some(wor_core::ConnectionId::new()),
            credential_version: Some(1),
        };
        let moved = credential_changed(Some(&recorded(1)), &other).unwrap();
        assert!(
            moved.contains("not the one this run started with"),
            "{moved}"
        );
    }
}
