//! Driving one run: the agent loop, from the run's stored steps to its end.
//!
//! The loop's decisions — cancellation and every budget checked before each step, which call
//! to answer next, when to ask the model, how the run ends — are the pure state machine
//! `wor_core::run_loop`; this module does the I/O of each step it hands out (a model turn, one
//! call through the pipeline) and persists it before asking for the next. Everything recorded
//! is redacted first (the project's live secrets and common secret shapes).

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use secrecy::ExposeSecret;
use serde_json::{Value, json};
use wor_core::audit::{Actor, AuditCategory, AuditEvent};
use wor_core::budget::BudgetExceeded;
use wor_core::json_depth::{MAX_JSON_NESTING, value_nesting};
use wor_core::model::{
    AssistantMessage, ChatMessage, ModelRequest, ModelResponse, ProviderKind, ToolResult,
};
use wor_core::routine::RoutineDefinition;
use wor_core::run::{Provenance, RunStatus};
use wor_core::run_loop::{AfterCall, CallOutcome, Ending, Next, RunLoop};
use wor_models::{
    AnthropicProvider, AzureOpenAiProvider, GeminiProvider, ModelProvider,
    OpenAiCompatibleProvider, ProviderEndpoint, ProviderOptions, ReplayProvider, StreamSink,
};
use wor_policy::PolicyEngine;
use wor_secrets::Redactor;
use wor_store::{
    API_KEY_FIELD, ConnectionStatus, MODEL_CONNECTIONS_TABLE, RunRecord, RunStep, SecretSlot,
};

use crate::output::FinalAnswer;
use crate::pipeline::{Answer, CallScope, PendingCall, pending_calls, untrusted_sources};
use crate::run_tools::{RunTools, ToolsUnavailable};
use crate::{Engine, EngineError};

/// Output tokens asked for per turn when the routine does not say.
const DEFAULT_MAX_OUTPUT_TOKENS: u32 = 1024;
/// How often a waiting worker looks for a cancel request and renews its lease.
pub(crate) const CANCEL_POLL: Duration = Duration::from_millis(250);

/// Where driving a run stopped.
enum Flow {
    End(Ending),
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

/// What a model call came to.
enum TurnOutcome {
    Response(Box<ModelResponse>),
    End(Ending),
}

impl Engine {
    /// The redactor for everything a run of `project` records or sends: the project's live
    /// secret values and the common secret shapes.
    pub(crate) async fn project_redactor(
        &self,
        project: wor_core::ProjectId,
    ) -> Result<Redactor, EngineError> {
        let live: Vec<_> = self.vault.project_values(project).await.map_err(|e| {
            EngineError::Refused(format!("the project's secrets cannot be opened: {e}"))
        })?;
        Redactor::new(live.iter().map(|s| s.expose_secret()))
            .map_err(|e| EngineError::Refused(format!("cannot build the redactor: {e}")))
    }

    /// Drives a run this worker holds the lease of, until it ends, parks for an approval or
    /// the lease is lost.
    pub(crate) async fn drive(&self, run: RunRecord) -> Result<(), EngineError> {
        let worker = self.config.worker_id.clone();
        let ending = match self.drive_loop(&run).await {
            Ok(Flow::End(ending)) => ending,
            Ok(Flow::Parked) => return Ok(()),
            Err(EngineError::Refused(reason)) => Ending::new(RunStatus::Failed, reason),
            Err(other) => return Err(other),
        };
        let finished = self
            .store
            .finish_run(
                run.project_id,
                run.id,
                &worker,
                ending.status,
                &ending.outcome,
            )
            .await?;
        if finished {
            // The audit entry first: nothing after it can keep the run's end off the chain.
            self.audit
                .append(
                    AuditEvent::new(
                        run.project_id,
                        AuditCategory::RunEnd,
                        Actor::Run { run_id: run.id },
                    )
                    .subject("run_id", run.id)
                    .subject("routine_id", run.routine_id)
                    .runs(run.root_run_id, run.parent_run_id)
                    .payload(
                        json!({ "status": ending.status.as_str(), "outcome": ending.outcome }),
                    ),
                )
                .await?;
            self.store.cancel_approvals(run.id).await?;
            if ending.status == RunStatus::Succeeded {
                self.remember(&run, &ending.outcome).await?;
            }
            self.enqueue_run_webhook(&run, ending.status, Some(&ending.outcome), None)
                .await?;
        }
        self.live_text.close(run.id);
        tracing::info!(category = "run", action = "run.end", project_id = %run.project_id,
            run_id = %run.id, status = ending.status.as_str(), lease_held = finished, "run ended");
        Ok(())
    }

    async fn drive_loop(&self, run: &RunRecord) -> Result<Flow, EngineError> {
        let version = self
            .store
            .get_routine_version(run.project_id, run.routine_id, run.routine_version)
            .await?;
        let definition = version.definition;
        let steps = self.store.list_run_steps(run.project_id, run.id, 0).await?;
        let messages = conversation(&definition, &steps);
        let pending = pending_calls(&steps);
        let call_ids = recorded_call_ids(&steps);
        let untrusted = untrusted_sources(&steps);
        let (provider, connection) = match self.provider(run, &definition, &messages).await {
            Ok(provider) => provider,
            Err(reason) => return Ok(Flow::End(Ending::new(RunStatus::Failed, reason))),
        };
        // A key replaced since the run's last model call is another credential: fail closed.
        if let Some(reason) = credential_changed(&steps, &connection) {
            return Ok(Flow::End(Ending::new(RunStatus::Failed, reason)));
        }
        let policy = match self.run_policy(run, &definition).await? {
            Ok(policy) => policy,
            Err(reason) => return Ok(Flow::End(Ending::new(RunStatus::Failed, reason))),
        };
        let redactor = self.project_redactor(run.project_id).await?;
        let tools = match self.prepare_tools(run, &definition).await {
            Ok(tools) => tools,
            Err(ToolsUnavailable::Refused(reason)) => {
                return Ok(Flow::End(Ending::new(
                    RunStatus::Failed,
                    redactor.redact(&reason).into_owned(),
                )));
            }
            Err(ToolsUnavailable::Store(error)) => return Err(error.into()),
        };
        let context = RunContext {
            run,
            definition: &definition,
            provider: provider.as_ref(),
            connection: &connection,
            redactor: &redactor,
            tools: &tools,
            policy: &policy,
        };
        let flow = self
            .turns(&context, messages, pending, untrusted, call_ids)
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
            .store
            .get_routine_version(run.project_id, run.routine_id, run.routine_version)
            .await?;
        if !version.definition.memory.enabled {
            return Ok(());
        }
        let steps = self.store.list_run_steps(run.project_id, run.id, 0).await?;
        let tainted = !untrusted_sources(&steps).is_empty();
        let now = wor_store::now_millis();
        let mut entries = Vec::new();
        if let Some(input) = steps.iter().find(|s| s.kind == "input") {
            let text = match input.payload.get("input") {
                Some(Value::String(text)) => text.clone(),
                Some(other) => other.to_string(),
                None => String::new(),
            };
            entries.push(wor_store::MemoryEntry {
                run_id: run.id,
                role: "requester".to_owned(),
                provenance: input.provenance,
                text,
                created_at: now,
            });
        }
        entries.push(wor_store::MemoryEntry {
            run_id: run.id,
            role: "assistant".to_owned(),
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
    /// default), the routine's own, and its roster modes. `Err` when they do not validate:
    /// the run fails closed with the reason.
    async fn run_policy(
        &self,
        run: &RunRecord,
        definition: &RoutineDefinition,
    ) -> Result<Result<PolicyEngine, String>, EngineError> {
        let mut builder = PolicyEngine::builder().roster(&definition.tools);
        if let Some(project) = self.store.project_policy(run.project_id).await? {
            builder = builder.project_policy(project.text);
        }
        if let Some(policy) = &definition.policy {
            builder = builder.routine_policy(policy.clone());
        }
        Ok(builder
            .build()
            .map_err(|e| format!("the run's policies do not validate: {e}")))
    }

    /// Drives the run's loop (`wor_core::run_loop`): does each step it hands out — a model
    /// turn, or one call through the pipeline — and persists it before asking for the next.
    async fn turns(
        &self,
        context: &RunContext<'_>,
        mut messages: Vec<ChatMessage>,
        pending: Vec<PendingCall>,
        untrusted: BTreeSet<String>,
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
        let spent_before = run
            .started_at
            .map(|s| {
                let spent = wor_store::now_millis()
                    .saturating_sub(s)
                    .saturating_sub(run.parked_ms);
                u64::try_from(spent / 1000).unwrap_or(0)
            })
            .unwrap_or(0);
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
        loop {
            let cancel_requested = self.store.is_cancel_requested(run.id).await?;
            match machine.next(cancel_requested, elapsed()) {
                Next::End(ending) => {
                    self.store
                        .save_usage(run.id, &self.config.worker_id, &machine.usage())
                        .await?;
                    return Ok(Flow::End(ending));
                }
                Next::CallModel => {
                    let request = ModelRequest {
                        model: definition.model.model.clone(),
                        messages: messages.clone(),
                        tools: tools.specs(),
                        max_output_tokens: definition
                            .model
                            .max_output_tokens
                            .unwrap_or(DEFAULT_MAX_OUTPUT_TOKENS),
                        temperature: None,
                        output_schema: definition.output.as_ref().map(|o| o.schema.clone()),
                    };
                    let remaining =
                        Duration::from_secs(limits.wall_seconds.saturating_sub(elapsed()));
                    // The text goes out to watchers as it comes, redacted; the turn is
                    // recorded whole below.
                    let mut live = self.live_text.sink(run.id, redactor.stream());
                    let outcome = self
                        .call_model(run, provider, &request, remaining, &limits, &mut live)
                        .await;
                    live.finish();
                    let mut response = match outcome? {
                        TurnOutcome::Response(response) => response,
                        TurnOutcome::End(ending) => {
                            self.store
                                .save_usage(run.id, &self.config.worker_id, &machine.usage())
                                .await?;
                            return Ok(Flow::End(ending));
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
                    let message = self
                        .record_model_turn(run, definition, connection, &response, redactor)
                        .await?;
                    self.store
                        .save_usage(run.id, &self.config.worker_id, &machine.usage())
                        .await?;
                    // The recorded (redacted) calls are answered, as they will be after a
                    // resume.
                    let calls = message
                        .tool_calls
                        .iter()
                        .cloned()
                        .map(PendingCall::fresh)
                        .collect();
                    messages.push(ChatMessage::Assistant(message));
                    if let Some(ending) = machine.turn_recorded(calls, elapsed(), || {
                        redactor.redact(&response.message.text).into_owned()
                    }) {
                        let usage = machine.usage();
                        match self
                            .final_answer(run, definition, usage, &limits, ending, &mut messages)
                            .await?
                        {
                            FinalAnswer::End(ending) => return Ok(Flow::End(ending)),
                            FinalAnswer::Correct => {}
                        }
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
                        limits,
                        wall_spent: elapsed(),
                        authority: &authority,
                    };
                    let answer = self.answer_call(&scope, &call, machine.usage()).await?;
                    let (outcome, answered) = match answer {
                        Answer::Result {
                            result,
                            usage,
                            provenance,
                        } => {
                            let tool = call
                                .recorded
                                .as_ref()
                                .and_then(|r| r.get("tool").cloned())
                                .or_else(|| {
                                    tools
                                        .find(&call.call.name)
                                        .map(|t| Value::from(t.roster_name.clone()))
                                })
                                .unwrap_or_else(|| Value::from(call.call.name.clone()));
                            let source = (provenance == Provenance::Untrusted)
                                .then(|| format!("tool:{}", tool.as_str().unwrap_or_default()));
                            (
                                CallOutcome::Answered {
                                    usage,
                                    untrusted_source: source,
                                },
                                Some((result, provenance, tool)),
                            )
                        }
                        Answer::Budget(exceeded) => (CallOutcome::Budget(exceeded), None),
                        Answer::Parked => (CallOutcome::Parked, None),
                        Answer::Fail(reason) => (CallOutcome::Fail(reason), None),
                    };
                    match machine.call_answered(outcome) {
                        AfterCall::Continue => {}
                        AfterCall::Park => return Ok(Flow::Parked),
                        AfterCall::End(ending) => {
                            self.store
                                .save_usage(run.id, &self.config.worker_id, &machine.usage())
                                .await?;
                            return Ok(Flow::End(ending));
                        }
                    }
                    if let Some((result, provenance, tool)) = answered {
                        let message = self
                            .record_tool_result(run, &call, result, provenance, tool, redactor)
                            .await?;
                        messages.push(ChatMessage::Tool(message));
                    }
                    self.store
                        .save_usage(run.id, &self.config.worker_id, &machine.usage())
                        .await?;
                    if !self
                        .store
                        .renew_lease(run.id, &self.config.worker_id, lease_ms(&self.config))
                        .await?
                    {
                        return Err(EngineError::Refused(
                            "the run's lease was lost to another worker".to_owned(),
                        ));
                    }
                }
            }
        }
    }

    /// Records a call's result (redacted) as a `tool_result` step and its audit entry; returns
    /// the result as recorded, which is what the model gets, as it will after a resume.
    async fn record_tool_result(
        &self,
        run: &RunRecord,
        call: &PendingCall,
        result: ToolResult,
        provenance: Provenance,
        tool: Value,
        redactor: &Redactor,
    ) -> Result<ToolResult, EngineError> {
        let mut recorded = json!({ "tool": tool, "result": result });
        redactor.redact_json(&mut recorded);
        note_nul_replaced(&mut recorded);
        let result: ToolResult = recorded
            .get("result")
            .cloned()
            .and_then(|r| serde_json::from_value(r).ok())
            .ok_or_else(|| EngineError::Refused("a tool result does not serialise".to_owned()))?;
        self.store
            .append_run_step(run.project_id, run.id, "tool_result", provenance, &recorded)
            .await?;
        self.audit_tool_call(
            run,
            json!({
                "transition": "answered",
                "tool": tool,
                "call_id": call.call.id,
                "provenance": provenance.as_str(),
                "is_error": result.is_error,
            }),
        )
        .await?;
        Ok(result)
    }

    /// Records a model turn (redacted) and its audit entry; returns the turn as recorded, which
    /// is what the conversation goes on with, as it will after a resume.
    async fn record_model_turn(
        &self,
        run: &RunRecord,
        definition: &RoutineDefinition,
        connection: &ModelCredential,
        response: &ModelResponse,
        redactor: &Redactor,
    ) -> Result<AssistantMessage, EngineError> {
        // The model identity (provider, connection, model) and the key's version, on every
        // call.
        let identity = json!({
            "provider": definition.model.provider.as_str(),
            "connection_id": connection.connection_id.map(|c| c.to_string()),
            "model_id": definition.model.model,
            "credential_version": connection.credential_version,
        });
        let mut recorded = json!({
            "message": response.message,
            "usage": response.usage,
            "stop_reason": response.stop_reason,
            "identity": identity,
        });
        redactor.redact_json(&mut recorded);
        note_nul_replaced(&mut recorded);
        self.store
            .append_run_step(
                run.project_id,
                run.id,
                "model_turn",
                Provenance::Model,
                &recorded,
            )
            .await?;
        self.audit
            .append(
                AuditEvent::new(
                    run.project_id,
                    AuditCategory::ModelCall,
                    Actor::Run { run_id: run.id },
                )
                .subject("run_id", run.id)
                .runs(run.root_run_id, run.parent_run_id)
                .payload(json!({
                    "provider": definition.model.provider.as_str(),
                    "model": definition.model.model,
                    "connection_id": connection.connection_id.map(|c| c.to_string()),
                    "credential_version": connection.credential_version,
                    "input_tokens": response.usage.input_tokens,
                    "output_tokens": response.usage.output_tokens,
                    "tool_calls": response.message.tool_calls.len(),
                })),
            )
            .await?;
        recorded
            .get("message")
            .cloned()
            .and_then(|m| serde_json::from_value(m).ok())
            .ok_or_else(|| EngineError::Refused("a model turn does not serialise".to_owned()))
    }

    /// Waits for a tool call, polling for a cancel request, at most `remaining` (the run's
    /// wall time left); on a cancel or at the deadline the call is dropped, which cancels it on
    /// the server.
    pub(crate) async fn call_until_cancelled(
        &self,
        run: &RunRecord,
        remaining: Duration,
        call: impl Future<Output = Result<wor_tools::ToolCallResult, String>>,
    ) -> Result<Result<wor_tools::ToolCallResult, String>, EngineError> {
        tokio::pin!(call);
        let deadline = tokio::time::sleep(remaining);
        tokio::pin!(deadline);
        let mut poll = tokio::time::interval(CANCEL_POLL);
        loop {
            tokio::select! {
                result = &mut call => return Ok(result),
                // The call is dropped (aborted); the next step ends the run on its wall time.
                () = &mut deadline => {
                    return Ok(Err(
                        "it was stopped when the run's wall time ran out; its outcome is unknown"
                            .to_owned(),
                    ));
                }
                _ = poll.tick() => {
                    if self.store.is_cancel_requested(run.id).await? {
                        return Ok(Err(
                            "it was stopped when the run was cancelled; its outcome is unknown"
                                .to_owned(),
                        ));
                    }
                    if !self.store.renew_lease(run.id, &self.config.worker_id, lease_ms(&self.config)).await? {
                        return Err(EngineError::Refused("the run's lease was lost to another worker".to_owned()));
                    }
                }
            }
        }
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
        tokio::pin!(call);
        let deadline = tokio::time::sleep(remaining);
        tokio::pin!(deadline);
        let mut poll = tokio::time::interval(CANCEL_POLL);
        loop {
            tokio::select! {
                result = &mut call => {
                    return Ok(match result {
                        Ok(response) => match too_deep_call(&response) {
                            Some(ending) => TurnOutcome::End(ending),
                            None => TurnOutcome::Response(Box::new(response)),
                        },
                        Err(error) => TurnOutcome::End(Ending::new(
                            RunStatus::Failed,
                            wor_secrets::redact_shapes(&format!("the model call failed: {error}")).into_owned(),
                        )),
                    });
                }
                () = &mut deadline => {
                    return Ok(TurnOutcome::End(Ending::budget(BudgetExceeded {
                        limit: wor_core::budget::BudgetLimit::WallTime,
                        used: limits.wall_seconds,
                        allowed: limits.wall_seconds,
                    })));
                }
                _ = poll.tick() => {
                    if self.store.is_cancel_requested(run.id).await? {
                        return Ok(TurnOutcome::End(Ending::new(RunStatus::Cancelled, "cancelled on request")));
                    }
                    if !self.store.renew_lease(run.id, &self.config.worker_id, lease_ms(&self.config)).await? {
                        return Err(EngineError::Refused("the run's lease was lost to another worker".to_owned()));
                    }
                }
            }
        }
    }

    /// The model provider of the routine, rechecking its connection now (S14): a connection
    /// that is missing or revoked fails the run closed, with the reason.
    async fn provider(
        &self,
        run: &RunRecord,
        definition: &RoutineDefinition,
        history: &[ChatMessage],
    ) -> Result<(Box<dyn ModelProvider>, ModelCredential), String> {
        let model = &definition.model;
        if model.provider == ProviderKind::Replay {
            if self.config.production {
                return Err("provider `replay` is refused in production".to_owned());
            }
            // Checked when the routine was applied (and again whenever it is read back).
            let script = model
                .script
                .clone()
                .ok_or("the replay routine has no script")?;
            return ReplayProvider::resuming(script, history)
                .map(|p| {
                    (
                        Box::new(p) as Box<dyn ModelProvider>,
                        ModelCredential::default(),
                    )
                })
                .map_err(|e| format!("the replay script cannot resume this run: {e}"));
        }
        let name = model
            .connection
            .as_deref()
            .ok_or("the routine names no model connection")?;
        let connections = self
            .store
            .list_model_connections(run.project_id)
            .await
            .map_err(|e| format!("model connections cannot be read: {e}"))?;
        let connection = connections
            .into_iter()
            .find(|c| c.name == name && c.status == ConnectionStatus::Active)
            .ok_or_else(|| format!("model connection `{name}` is missing or revoked"))?;
        if connection.provider != model.provider {
            return Err(format!(
                "model connection `{name}` speaks `{}`, the routine's model `{}`",
                connection.provider, model.provider
            ));
        }
        let slot = SecretSlot::new(
            run.project_id,
            MODEL_CONNECTIONS_TABLE,
            connection.id,
            API_KEY_FIELD,
        );
        // A connection without a key is a local model server: allowed only while its address
        // is in the operator's model ranges, rechecked at every (re)start.
        let key = match self.vault.metadata(&slot).await {
            Ok(Some(_)) => Some(self.vault.open(&slot).await.map_err(|e| {
                format!("the key of model connection `{name}` cannot be opened: {e}")
            })?),
            Ok(None) => {
                self.model_egress
                    .vet_keyless_model(&connection.base_url)
                    .await
                    .map_err(|e| format!("model connection `{name}` has no API key: {e}"))?;
                None
            }
            Err(e) => {
                return Err(format!(
                    "the key of model connection `{name}` cannot be read: {e}"
                ));
            }
        };
        if key.is_some() {
            self.audit
                .append(
                    AuditEvent::new(run.project_id, AuditCategory::SecretUse, Actor::Run { run_id: run.id })
                        .subject("run_id", run.id)
                        .subject("connection_id", connection.id)
                        .runs(run.root_run_id, run.parent_run_id)
                        .payload(json!({ "slot": slot.to_string(), "credential_version": connection.credential_version })),
                )
                .await
                .map_err(|e| format!("the use of a secret cannot be recorded: {e}"))?;
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
            ProviderKind::Replay => {
                return Err("provider `replay` takes no model connection".to_owned());
            }
        };
        Ok((provider, credential))
    }
}

/// Why the run may not go on with `now`: its last recorded model call went through another
/// connection or another version of the key.
fn credential_changed(steps: &[RunStep], now: &ModelCredential) -> Option<String> {
    let identity = steps
        .iter()
        .rev()
        .filter(|s| s.kind == "model_turn")
        .find_map(|s| s.payload.get("identity"))?;
    let connection = identity.get("connection_id").and_then(Value::as_str);
    let version = identity.get("credential_version").and_then(Value::as_i64);
    let now_connection = now.connection_id.map(|c| c.to_string());
    if connection != now_connection.as_deref() {
        return Some(
            "the routine's model connection is not the one this run started with; the run fails closed"
                .to_owned(),
        );
    }
    match (version, now.credential_version) {
        (Some(then), Some(now)) if then != now => Some(format!(
            "the model connection's key was replaced since this run's last model call (credential version {then}, now {now}); the run fails closed"
        )),
        _ => None,
    }
}

fn lease_ms(config: &crate::EngineConfig) -> i64 {
    i64::try_from(config.lease.as_millis()).unwrap_or(i64::MAX)
}

/// The conversation so far, rebuilt from the run's steps: the instructions (trusted), the
/// requester's input, then each recorded model turn and tool result in order.
fn conversation(definition: &RoutineDefinition, steps: &[RunStep]) -> Vec<ChatMessage> {
    let mut messages = vec![ChatMessage::system(definition.instructions.clone())];
    // Memory of earlier runs comes right after the instructions, before this run's input.
    if let Some(memory) = steps.iter().find(|s| s.kind == "memory") {
        messages.extend(memory_messages(&memory.payload));
    }
    for step in steps {
        match step.kind.as_str() {
            "input" => {
                let input = step.payload.get("input").cloned().unwrap_or(Value::Null);
                let text = match input {
                    Value::String(text) => text,
                    other => other.to_string(),
                };
                // An untrusted input (a webhook payload) goes in its envelope, with the
                // boundary fixed when the run was created.
                let boundary = step.payload.get("boundary").and_then(Value::as_str);
                let text = match (step.provenance, boundary) {
                    (Provenance::Untrusted, Some(boundary)) => {
                        let source = step
                            .payload
                            .get("source")
                            .and_then(Value::as_str)
                            .unwrap_or("input");
                        crate::pipeline::untrusted_envelope(source, boundary, &text)
                    }
                    (Provenance::Untrusted, None) => crate::pipeline::untrusted_envelope(
                        "input",
                        &crate::pipeline::new_boundary(),
                        &text,
                    ),
                    _ => text,
                };
                messages.push(ChatMessage::user(text));
            }
            "model_turn" => {
                if let Some(message) = step
                    .payload
                    .get("message")
                    .and_then(|m| serde_json::from_value::<AssistantMessage>(m.clone()).ok())
                {
                    messages.push(ChatMessage::Assistant(message));
                }
            }
            "tool_result" => {
                if let Some(result) = step
                    .payload
                    .get("result")
                    .and_then(|r| serde_json::from_value::<ToolResult>(r.clone()).ok())
                {
                    messages.push(ChatMessage::Tool(result));
                }
            }
            _ => {}
        }
    }
    messages
}

/// The messages a `memory` step replays, each with its label: what earlier requesters asked
/// and what runs free of untrusted content answered are plain messages; anything labelled
/// untrusted goes in an envelope marked as data, whatever its role was.
fn memory_messages(payload: &Value) -> Vec<ChatMessage> {
    let boundary = payload
        .get("boundary")
        .and_then(Value::as_str)
        .map(str::to_owned)
        .unwrap_or_else(crate::pipeline::new_boundary);
    payload
        .get("entries")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|entry| {
            let text = entry.get("text").and_then(Value::as_str)?;
            let role = entry.get("role").and_then(Value::as_str)?;
            let provenance = entry.get("provenance").and_then(Value::as_str)?;
            Some(match (provenance, role) {
                ("requester" | "engine", _) => ChatMessage::user(format!(
                    "(From an earlier run of this thread, the requester asked:) {text}"
                )),
                ("model", "assistant") => ChatMessage::user(format!(
                    "(From an earlier run of this thread, you answered:) {text}"
                )),
                _ => ChatMessage::user(crate::pipeline::untrusted_envelope(
                    "memory", &boundary, text,
                )),
            })
        })
        .collect()
}

/// The call ids the run's recorded model turns already used.
fn recorded_call_ids(steps: &[RunStep]) -> BTreeSet<String> {
    steps
        .iter()
        .filter(|s| s.kind == "model_turn")
        .filter_map(|s| {
            s.payload
                .pointer("/message/tool_calls")
                .and_then(Value::as_array)
        })
        .flatten()
        .filter_map(|c| c.get("id").and_then(Value::as_str).map(str::to_owned))
        .collect()
}

/// Replaces U+0000 in a step about to be recorded (`wor_core::text`), and says so in the step
/// as `"nul_replaced": true`; the run goes on with the step as recorded.
fn note_nul_replaced(recorded: &mut Value) {
    if wor_core::text::replace_nul_in_json(recorded)
        && let Value::Object(step) = recorded
    {
        step.insert("nul_replaced".to_owned(), Value::Bool(true));
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

#[cfg(test)]
mod tests {
    use super::*;

    fn turn(identity: Value) -> RunStep {
        RunStep {
            seq: 2,
            kind: "model_turn".to_owned(),
            provenance: Provenance::Model,
            payload: json!({"message": {"text": "x"}, "identity": identity}),
            created_at: 0,
        }
    }

    #[test]
    fn a_replaced_key_or_connection_stops_a_resumed_run() {
        let connection = wor_core::ConnectionId::new();
        let now = ModelCredential {
            connection_id: Some(connection),
            credential_version: Some(2),
        };
        let recorded = |version: i64| {
            turn(
                json!({"provider": "openai_compatible", "connection_id": connection.to_string(),
                "model_id": "m", "credential_version": version}),
            )
        };
        // Nothing recorded yet, or the same key: go on.
        assert_eq!(credential_changed(&[], &now), None);
        assert_eq!(credential_changed(&[recorded(2)], &now), None);
        // The last call counts.
        assert_eq!(credential_changed(&[recorded(1), recorded(2)], &now), None);
        let replaced = credential_changed(&[recorded(1)], &now).unwrap();
        assert!(
            replaced.contains("credential version 1, now 2"),
            "{replaced}"
        );
        let other = ModelCredential {
            connection_id: Some(wor_core::ConnectionId::new()),
            credential_version: Some(1),
        };
        let moved = credential_changed(&[recorded(1)], &other).unwrap();
        assert!(
            moved.contains("not the one this run started with"),
            "{moved}"
        );
        // Turns recorded before identities were recorded say nothing.
        let old = RunStep {
            payload: json!({"message": {"text": "x"}}),
            ..turn(Value::Null)
        };
        assert_eq!(credential_changed(&[old], &now), None);
    }
}
