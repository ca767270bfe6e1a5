//! One proposed tool call through the pipeline of the spec: roster, schema and pinned
//! arguments, decision, budget, a recorded `tool_call` step, execution, and the result
//! redacted, capped and enveloped as untrusted. Nothing runs without an `allow` or an
//! approval bound to exactly this call.
//!
//! A call policy answers `confirm` for is recorded, its approval filed and the run parked in
//! one transaction; the run holds no worker until a person decides (or the approval expires)
//! and it is queued again. A resumed run picks each unanswered call of its last model turn up
//! where its steps left it ([`PendingCall`]).

use std::collections::BTreeSet;

use serde_json::{Value, json};
use wor_core::ApprovalId;
use wor_core::audit::{AuditCategory, AuditEvent};
use wor_core::budget::{BudgetExceeded, BudgetLimit, BudgetUsage};
use wor_core::call::ToolClass;
use wor_core::provenance::{ArgumentLabels, ContentIndex};
use wor_core::routine::{OnDenial, ROUTINE_CONNECTION, ToolMode};
use wor_core::run::Provenance;
use wor_core::run_loop::{AfterDecision, CallOutcome, CallResume};
use wor_core::step::{
    ApprovalUsedStep, PendingCall, Step, ToolCallStep, new_boundary, untrusted_envelope,
};
use wor_policy::{BudgetUsed, Decision, DecisionRequest};
use wor_store::{
    ApprovalKind, ApprovalRecord, ApprovalStatus, ApprovedCall, ApprovedClaim, ApprovedStart,
    NewApproval, RunRecord,
};
use wor_tools::{CanonicalArguments, ResultLimits};

use crate::authority::Standing;
use crate::call::{CallScope, Recorded, Stopped, decided_event, run_event, with_step};
use crate::run_tools::{OfferedTool, model_name};
use crate::{Engine, EngineError};

/// A call that waits for a person, described for its approval request: the call as its
/// decision recorded it, the kind of approval, and why it is asked.
pub(crate) struct ApprovalRequest<'a> {
    pub kind: ApprovalKind,
    pub call: &'a ToolCallStep,
    pub why: Value,
}

impl Engine {
    /// Answers one pending call: a fresh one through the whole pipeline, a resumed one from
    /// where its steps left it.
    pub(crate) async fn answer_call(
        &self,
        scope: &CallScope<'_>,
        pending: &PendingCall,
        usage: BudgetUsage,
    ) -> Result<CallOutcome, EngineError> {
        // Past the run's deadline nothing more is asked of any tool.
        if scope.authority.expired() {
            return Ok(wall_time_over(scope));
        }
        match &pending.recorded {
            // A fresh call presents the run's credential with the write that records and
            // reserves it.
            None => {
                let began = std::time::SystemTime::now();
                let answered = self.answer_fresh(scope, pending, usage).await;
                crate::traces::tool_call_answered(scope.run, &pending.call.id, began, &answered);
                answered
            }
            // A resumed call presents it first: nothing is recorded or used for a run whose
            // credential has ended.
            Some(recorded) => match self.present_credential(scope).await? {
                Some(outcome) => Ok(outcome),
                None => self.resume_call(scope, pending, recorded, usage).await,
            },
        }
    }

    /// Presents the run's credential: `None` when it is live, else how the run ends — past
    /// its deadline as over its wall time, otherwise failed.
    async fn present_credential(
        &self,
        scope: &CallScope<'_>,
    ) -> Result<Option<CallOutcome>, EngineError> {
        Ok(match self.credential_standing(scope.authority).await? {
            Standing::Live => None,
            Standing::Expired => Some(wall_time_over(scope)),
            Standing::Ended => Some(credential_ended()),
        })
    }

    async fn answer_fresh(
        &self,
        scope: &CallScope<'_>,
        pending: &PendingCall,
        usage: BudgetUsage,
    ) -> Result<CallOutcome, EngineError> {
        let call = &pending.call;
        // 1. Roster: the model is shown only offered tools; anything else is refused.
        let Some(offered) = scope.tools.find(&call.name) else {
            let entry = scope.definition.tools.iter().find(|t| {
                t.tool == call.name
                    || t.tool
                        .split_once('/')
                        .is_some_and(|(c, n)| model_name(c, n) == call.name)
            });
            let text = match entry {
                Some(entry) if entry.mode == ToolMode::Deny => {
                    format!("tool `{}` is denied by this routine", entry.tool)
                }
                Some(entry) => format!(
                    "tool `{}` is not available: its connection does not list it as pinned",
                    entry.tool
                ),
                None => format!("tool `{}` is not on this routine's roster", call.name),
            };
            return Ok(scope.refuse(pending, usage, &text));
        };
        // A server that announced a changed tool list is checked against its pins first.
        if let Some(connection) = scope.tools.connections.get(&offered.connection)
            && let Some(refusal) = self.recheck_if_changed(scope.run, connection).await?
        {
            return Ok(CallOutcome::Fail(refusal));
        }
        // 2-3. Schema and pinned arguments: failures go back to the model.
        let arguments = match offered.prepare_arguments(&call.arguments) {
            Ok(arguments) => arguments,
            Err(error) => {
                let text = format!("tool `{}`: {error}", offered.roster_name);
                return Ok(scope.refuse(pending, usage, &text));
            }
        };
        // 4. Decision.
        let deciding = std::time::SystemTime::now();
        let (decision, labels) = self.decide(scope, offered, &arguments, usage);
        crate::metrics::tool_call_decided(decision.outcome);
        crate::traces::tool_call_decided(scope.run, &call.id, deciding, decision.outcome);
        let recorded = ToolCallStep {
            tool: offered.roster_name.clone(),
            model_name: call.name.clone(),
            call_id: call.id.clone(),
            arguments: arguments.value.clone(),
            arguments_hash: arguments.hash.clone(),
            pinned_keys: arguments.pinned_keys.clone(),
            pin_hash: offered.pin.hash().to_owned(),
            decision: decision.outcome,
            determining_policies: decision.determining_policies.clone(),
            reasons: decision.reasons.clone(),
            untrusted_sources: scope.untrusted.clone(),
            argument_labels: Some(labels),
        };
        let Step::ToolCall(recorded) = redacted(Step::ToolCall(recorded), scope)? else {
            return Err(EngineError::InvalidState(
                "a redacted tool call changed kind".to_owned(),
            ));
        };
        // The decision's audit entry is committed with the step that records the call.
        let record = with_step(
            self.journal(scope.run),
            scope.run,
            Provenance::Engine,
            Step::ToolCall(recorded.clone()),
        );
        match decision.outcome.then(usage, &scope.limits) {
            AfterDecision::RecordRefusal => {
                self.record(record).await?;
                let text = format!(
                    "tool `{}` was refused by policy: {}",
                    offered.roster_name,
                    decision.reasons.join("; ")
                );
                Ok(scope.refuse(pending, usage, &text))
            }
            AfterDecision::RecordAndPark => {
                let why = why_json(
                    &decision,
                    scope.untrusted,
                    recorded.argument_labels.as_ref(),
                );
                // A run whose cancel was requested ends rather than waits for a person.
                if self.record(record).await?.cancel_seen() {
                    return Ok(CallOutcome::Cancelled);
                }
                self.park(
                    scope,
                    ApprovalRequest {
                        kind: ApprovalKind::Policy,
                        call: &recorded,
                        why,
                    },
                )
                .await
            }
            // 5. Budget, before the call is on record as started.
            AfterDecision::Budget(exceeded) => {
                self.record(
                    self.journal(scope.run)
                        .audit(decided_event(scope.run, &recorded)),
                )
                .await?;
                Ok(CallOutcome::Budget(exceeded))
            }
            // The record, the reservation and the check of the run's credential are one
            // write: nothing is recorded or reserved for a call whose credential has ended.
            // It is on disk before the call runs, unless the call only reads: see
            // `RunWrite::under_live_claim`.
            AfterDecision::RecordAndExecute(usage) => {
                let credential = scope.authority.token().expose();
                let reserved = record.usage(usage).unless_cancelled();
                let reserved = if offered.class == ToolClass::ReadOnly {
                    reserved.under_live_claim(credential)
                } else {
                    reserved.presenting(credential)
                };
                match self.record(reserved).await? {
                    Recorded::Committed { .. } => {}
                    Recorded::CredentialEnded => return Ok(credential_ended()),
                    Recorded::CancelRequested => return Ok(CallOutcome::Cancelled),
                }
                self.execute(scope, offered, pending, arguments, usage)
                    .await
            }
        }
    }

    /// Pipeline step 4: what policy says of this call.
    fn decide(
        &self,
        scope: &CallScope<'_>,
        offered: &OfferedTool,
        arguments: &CanonicalArguments,
        usage: BudgetUsage,
    ) -> (Decision, ArgumentLabels) {
        decide_call(
            scope.policy,
            scope.definition.name.as_str(),
            scope.run,
            offered,
            arguments,
            usage,
            scope.untrusted,
            scope.content,
        )
    }

    /// Files an approval request and parks the run.
    async fn park(
        &self,
        scope: &CallScope<'_>,
        request: ApprovalRequest<'_>,
    ) -> Result<CallOutcome, EngineError> {
        let parked = match self.remote_claim(scope.run.id) {
            Some(claim) => {
                let claim = claim?;
                match self
                    .park_remote(scope.run.id, &request.call.call_id)
                    .await?
                {
                    Some(_) => Some(()),
                    // A cancel requested instead: the run ends rather than waits.
                    None if Engine::claimed_cancel(&claim) => return Ok(CallOutcome::Cancelled),
                    None => None,
                }
            }
            None => self
                .park_run(scope.run, &self.config.worker_id, None, request)
                .await?
                .map(|_| ()),
        };
        match parked {
            Some(()) => Ok(CallOutcome::Parked),
            None => Err(EngineError::LeaseLost),
        }
    }

    /// The latest approval of `kind` for `call` of `run`: from the store, or from a remote
    /// worker's claim.
    async fn call_approval(
        &self,
        run: &RunRecord,
        call: &str,
        kind: ApprovalKind,
    ) -> Result<Option<ApprovalRecord>, EngineError> {
        match self.remote_claim(run.id) {
            Some(claim) => Ok(Engine::claimed_approval(&*claim?, call, kind)),
            None => Ok(self
                .store
                .approval_for_call(run.project_id, run.id, call, kind)
                .await?),
        }
    }

    /// Files an approval request and parks `run`, which `holder` holds (under the claim whose
    /// credential is `claim`, for a remote worker), its audit entry staged with it, then
    /// announces the request: the entry appended, the run webhook and notifications. The
    /// approval's id; `None` when `holder` does not hold the run (nothing changed).
    pub(crate) async fn park_run(
        &self,
        run: &RunRecord,
        holder: &str,
        claim: Option<&str>,
        request: ApprovalRequest<'_>,
    ) -> Result<Option<ApprovalId>, EngineError> {
        self.park_run_recording(run, holder, claim, request, None)
            .await
    }

    /// [`Engine::park_run`], staging `also`, when given, with the park whenever the run parks,
    /// after the request's own entry.
    async fn park_run_recording(
        &self,
        run: &RunRecord,
        holder: &str,
        claim: Option<&str>,
        request: ApprovalRequest<'_>,
        also: Option<AuditEvent>,
    ) -> Result<Option<ApprovalId>, EngineError> {
        let call = request.call;
        // Read before anything is written: the routes that want this approval are chosen by
        // them.
        let policies = why_policies(&request.why)?;
        let binding = wor_core::approval::binding_hash(
            run.id,
            &call.call_id,
            &call.pin_hash,
            &call.arguments_hash,
        );
        let ttl = i64::try_from(self.config.approval_ttl.as_millis()).unwrap_or(i64::MAX);
        let approval = NewApproval {
            run_id: run.id,
            call_id: call.call_id.clone(),
            tool: call.tool.clone(),
            pin_hash: call.pin_hash.clone(),
            arguments: Value::Object(call.arguments.clone()),
            arguments_hash: call.arguments_hash.clone(),
            pinned_keys: call.pinned_keys.clone(),
            binding_hash: binding.clone(),
            kind: request.kind,
            why: request.why,
            expires_at: wor_store::now_millis().saturating_add(ttl),
        };
        // The request's entry is staged with the approval: a crash before it is appended here
        // leaves it for the audit writer's sweep, never a held call without its entry.
        let entry = |id: ApprovalId| {
            run_event(run, AuditCategory::ApprovalRequest)
                .subject("approval_id", id)
                .payload(json!({
                    "kind": approval.kind.as_str(),
                    "tool": approval.tool,
                    "call_id": approval.call_id,
                    "binding_hash": binding,
                    "arguments_hash": approval.arguments_hash,
                    "pin_hash": approval.pin_hash,
                    "expires_at": approval.expires_at,
                }))
        };
        let parked = self
            .store
            .park_for_approval_staged(run.project_id, holder, claim, &approval, &entry, also)
            .await?;
        let Some((id, created, staged)) = parked else {
            return Ok(None);
        };
        self.append_staged_or_log(staged).await;
        // Announced whether the approval was filed now or by a drive of the run that stopped
        // before it announced it: each announcement is queued once, by its key.
        self.announce_park(
            run,
            id,
            &approval.tool,
            approval.kind,
            approval.expires_at,
            &policies,
        )
        .await?;
        if !created {
            tracing::debug!(category = "approval", run_id = %run.id, approval_id = %id,
                "the run parked again for an approval filed before");
        }
        tracing::info!(category = "approval", action = "approval.request", project_id = %run.project_id,
            run_id = %run.id, approval_id = %id, "run parked for approval");
        Ok(Some(id))
    }

    /// Queues what `run`'s park for approval `id` announces — its run webhook, the
    /// notifications of the routes that want it — then marks them queued (each once, by its
    /// key; a sweep queues what a park that stopped first did not).
    pub(crate) async fn announce_park(
        &self,
        run: &RunRecord,
        id: ApprovalId,
        tool: &str,
        kind: wor_store::ApprovalKind,
        expires_at: i64,
        policies: &[String],
    ) -> Result<(), EngineError> {
        // The run as the park left it, with the usage its steps so far recorded.
        let parked = self.as_stored(run).await;
        self.enqueue_run_webhook(
            &parked,
            wor_core::run::RunStatus::WaitingForApproval,
            None,
            Some(json!({
                "id": id.to_string(),
                "tool": tool,
                "kind": kind.as_str(),
                "expires_at": wor_core::schedule::slot_rfc3339(expires_at),
            })),
        )
        .await?;
        self.notify_approval_requested(run.project_id, run.routine_id, id, tool, policies)
            .await?;
        self.mark_announced(run.id, wor_core::run::RunStatus::WaitingForApproval)
            .await;
        Ok(())
    }

    /// Queues, in place of the process that parked or ended them, the announcements of runs
    /// whose announcements stayed due past their grace (that process stopped first, or failed
    /// to queue them). Returns how many runs it looked at.
    pub async fn announce_overdue(&self) -> Result<usize, EngineError> {
        // What this process queued and has not marked yet is not overdue.
        self.flush_announced().await;
        let due = self
            .store
            .claim_due_announcements(wor_store::now_millis(), wor_store::ANNOUNCE_GRACE_MS, 100)
            .await?;
        for run in &due {
            if let Err(error) = self.announce_overdue_run(run).await {
                tracing::error!(category = "run", run_id = %run.id, error = %error,
                    "queueing an overdue run's announcements failed; the sweep tries again");
            }
        }
        Ok(due.len())
    }

    async fn announce_overdue_run(&self, run: &RunRecord) -> Result<(), EngineError> {
        let approvals = |status| wor_store::ApprovalFilter {
            status: Some(status),
            run_id: Some(run.id),
            before: None,
            limit: 1000,
        };
        if run.status.is_terminal() {
            let cancelled = self
                .store
                .list_approvals(
                    run.project_id,
                    &approvals(wor_store::ApprovalStatus::Cancelled),
                )
                .await?
                .iter()
                .map(|a| a.id)
                .collect::<Vec<_>>();
            let outcome = run.outcome.clone().unwrap_or_default();
            self.announce_end(run, run.status, &outcome, &cancelled)
                .await?;
        } else if run.status == wor_core::run::RunStatus::WaitingForApproval {
            for approval in self
                .store
                .list_approvals(
                    run.project_id,
                    &approvals(wor_store::ApprovalStatus::Pending),
                )
                .await?
            {
                let policies = why_policies(&approval.why)?;
                self.announce_park(
                    run,
                    approval.id,
                    &approval.tool,
                    approval.kind,
                    approval.expires_at,
                    &policies,
                )
                .await?;
            }
        }
        if !run.status.is_terminal() {
            // Queued for its approvals above; and a run parked for its nested run has none to
            // announce, as a run that moved on since (decided and queued again) has none left.
            self.store
                .announced(&[wor_store::AnnouncedRun {
                    id: run.id,
                    status: run.status,
                    noted_at: wor_store::now_millis(),
                }])
                .await?;
        }
        tracing::info!(category = "run", run_id = %run.id, status = run.status.as_str(),
            "queued the announcements of a run whose process did not");
        Ok(())
    }

    /// Uses `approval` to start its call in `run`, which `holder` holds (under `claim`, for a
    /// remote worker), when `binding` — the call as it is about to
    /// run — is what the approval binds to: the approval used, the call recorded as started
    /// and the run's `usage` saved in one transaction (a crash leaves both or neither, never a
    /// spent approval whose call did not start), its `approval.use` entry staged in that
    /// transaction too; an approval that is not usable for it is an `approval_mismatch` entry
    /// instead.
    pub(crate) async fn start_approved(
        &self,
        run: &RunRecord,
        holder: &str,
        claim: Option<ApprovedClaim<'_>>,
        approval: &ApprovalRecord,
        binding: &str,
        usage: &BudgetUsage,
    ) -> Result<ApprovedStart, EngineError> {
        // The store checks the binding in the statement that uses the approval, after a
        // remote worker's claim: a cancel or the deadline is what such a worker is told first.
        let started = if claim.is_some() || binding == approval.binding_hash {
            let step = Step::ApprovalUsed(ApprovalUsedStep {
                call_id: approval.call_id.clone(),
                approval_id: approval.id,
                tool: approval.tool.clone(),
            });
            // The use's entry is staged with the call's start: a crash before it is appended
            // here leaves it for the audit writer's sweep, never a spent approval without it.
            let used = run_event(run, AuditCategory::ApprovalUse)
                .subject("approval_id", approval.id)
                .payload(json!({
                    "tool": approval.tool,
                    "call_id": approval.call_id,
                    "binding_hash": binding,
                }));
            let (started, staged) = self
                .store
                .start_approved_call_staged(
                    run.project_id,
                    run.id,
                    holder,
                    &ApprovedCall {
                        approval: approval.id,
                        binding_hash: binding,
                        step: &step,
                        usage,
                        claim,
                    },
                    Some(used),
                )
                .await?;
            self.append_staged_or_log(staged).await;
            started
        } else {
            ApprovedStart::NotUsable
        };
        if started == ApprovedStart::NotUsable {
            self.audit
                .append(run_event(run, AuditCategory::ToolCall).payload(json!({
                    "transition": "approval_mismatch",
                    "tool": approval.tool,
                    "call_id": approval.call_id,
                    "approval_id": approval.id.to_string(),
                })))
                .await?;
        }
        Ok(started)
    }

    /// Picks a call up where the run's steps left it.
    async fn resume_call(
        &self,
        scope: &CallScope<'_>,
        pending: &PendingCall,
        recorded: &ToolCallStep,
        usage: BudgetUsage,
    ) -> Result<CallOutcome, EngineError> {
        let call = &pending.call;
        let tool = &recorded.tool;
        let resume = CallResume::of(pending);
        // A routine call that started is picked up again: its nested run is found by the
        // call, never started twice, so nothing is repeated.
        if resume == (CallResume::Started { routine: true }) {
            let Some(offered) = scope.tools.find(&call.name) else {
                let text = format!("tool `{tool}` is no longer available");
                return Ok(scope.refuse(pending, usage, &text));
            };
            // The same arguments as the first attempt: pinned values applied, schema checked.
            let input = offered
                .prepare_arguments(&call.arguments)
                .ok()
                .map(|a| routine_input(&a))
                .unwrap_or_default();
            return self
                .call_routine(scope, offered, pending, &input, usage)
                .await;
        }
        match resume {
            CallResume::Started { .. } => {
                return self
                    .resume_started_call(scope, pending, recorded, usage)
                    .await;
            }
            CallResume::Refused | CallResume::Fresh => {
                let text = format!("tool `{tool}` was refused");
                return Ok(scope.refuse(pending, usage, &text));
            }
            CallResume::Held => {}
        }
        let approval = self
            .call_approval(scope.run, &call.id, ApprovalKind::Policy)
            .await?;
        let ask_again = || ApprovalRequest {
            kind: ApprovalKind::Policy,
            call: recorded,
            why: why_recorded(recorded),
        };
        match approval {
            None => self.park(scope, ask_again()).await,
            Some(approval) => match approval.status {
                ApprovalStatus::Pending => self.park(scope, ask_again()).await,
                ApprovalStatus::Approved if approval.used_at.is_none() => {
                    self.execute_approved(scope, pending, &approval, usage)
                        .await
                }
                // Used, yet no `approval_used` step: the two are written in one transaction,
                // so only a record changed outside the engine gets here. Nothing is run.
                ApprovalStatus::Approved => {
                    let text = format!(
                        "the approval for `{tool}` was already used and the call is not on record as started; it was not run"
                    );
                    Ok(scope.refuse(pending, usage, &text))
                }
                ApprovalStatus::Denied | ApprovalStatus::Expired | ApprovalStatus::Cancelled => {
                    Ok(self.denied(scope, pending, &approval, usage))
                }
            },
        }
    }

    /// A call that started (by policy or with an approval) but whose result was never
    /// recorded: it may have had its effect, so it is not repeated without a person saying so.
    /// Approving runs it again; denying tells the model its outcome is unknown.
    async fn resume_started_call(
        &self,
        scope: &CallScope<'_>,
        pending: &PendingCall,
        recorded: &ToolCallStep,
        usage: BudgetUsage,
    ) -> Result<CallOutcome, EngineError> {
        let call = &pending.call;
        // The call as it ran: a retry is filed for the arguments a person edited, if they did.
        let ran = self.call_as_ran(scope.run, recorded).await?;
        let approval = self
            .call_approval(scope.run, &call.id, ApprovalKind::OutcomeUnknown)
            .await?;
        match unknown_outcome(approval, scope.untrusted)? {
            // A remote worker's control plane files the question from the recorded steps,
            // as it does for a held call.
            UnknownOutcome::Ask { .. } if self.is_remote() => {
                self.park(
                    scope,
                    ApprovalRequest {
                        kind: ApprovalKind::OutcomeUnknown,
                        call: &ran,
                        why: Value::Null,
                    },
                )
                .await
            }
            UnknownOutcome::Ask { why, attempt } => {
                match self
                    .ask_outcome_unknown(
                        scope.run,
                        &self.config.worker_id,
                        None,
                        &ran,
                        why,
                        attempt,
                    )
                    .await?
                {
                    Some(_) => Ok(CallOutcome::Parked),
                    None => Err(EngineError::LeaseLost),
                }
            }
            UnknownOutcome::Retry(approval) => {
                self.execute_approved(scope, pending, &approval, usage)
                    .await
            }
            // Denied or expired: the model is told its outcome is unknown.
            UnknownOutcome::Unknown => Ok(scope.refuse(
                pending,
                usage,
                "outcome_unknown: this call started before the run was interrupted and its outcome \
                 was not recorded; it was not repeated. Check its effect before calling it again.",
            )),
        }
    }

    /// A started call as it ran: as recorded, or, when a person edited it before approving it,
    /// with the edited arguments (the pinned ones unchanged) and their hash.
    pub(crate) async fn call_as_ran(
        &self,
        run: &RunRecord,
        recorded: &ToolCallStep,
    ) -> Result<ToolCallStep, EngineError> {
        let held = self
            .call_approval(run, &recorded.call_id, ApprovalKind::Policy)
            .await?;
        let edited = held
            .filter(|a| a.status == ApprovalStatus::Approved && a.used_at.is_some())
            .and_then(|a| a.edited_arguments);
        let Some(Value::Object(arguments)) = edited else {
            return Ok(recorded.clone());
        };
        let mut ran = recorded.clone();
        ran.arguments_hash = wor_core::canonical::sha256_hex(
            wor_core::canonical::to_canonical_json(&Value::Object(arguments.clone())).as_bytes(),
        );
        ran.arguments = arguments;
        Ok(ran)
    }

    /// Parks `run`, which `holder` holds (under the claim whose credential is `claim`, for a
    /// remote worker), on the `outcome_unknown` approval for started call `ran`, recording with
    /// the park that its outcome is unknown for the `attempt`-th time when a person is asked
    /// anew. The approval's id; `None` when `holder` does not hold the run.
    pub(crate) async fn ask_outcome_unknown(
        &self,
        run: &RunRecord,
        holder: &str,
        claim: Option<&str>,
        ran: &ToolCallStep,
        why: Value,
        attempt: Option<u64>,
    ) -> Result<Option<ApprovalId>, EngineError> {
        let request = ApprovalRequest {
            kind: ApprovalKind::OutcomeUnknown,
            call: ran,
            why,
        };
        // Staged with the park: a park that lost its lease records nothing, and one that parked
        // cannot lose it.
        let unknown = attempt.map(|attempt| {
            run_event(run, AuditCategory::ToolCall).payload(json!({
                "transition": "outcome_unknown",
                "tool": ran.tool,
                "call_id": ran.call_id,
                "attempt": attempt,
            }))
        });
        self.park_run_recording(run, holder, claim, request, unknown)
            .await
    }

    /// The answer to a call a person denied, or nobody decided in time.
    fn denied(
        &self,
        scope: &CallScope<'_>,
        pending: &PendingCall,
        approval: &ApprovalRecord,
        usage: BudgetUsage,
    ) -> CallOutcome {
        let what = match approval.status {
            ApprovalStatus::Expired => "nobody approved it before its approval expired".to_owned(),
            ApprovalStatus::Cancelled => "its approval was cancelled".to_owned(),
            _ => format!(
                "a person denied it: {}",
                approval
                    .decision_reason
                    .as_deref()
                    .unwrap_or("no reason given")
            ),
        };
        let text = format!("the call to `{}` did not run: {what}", approval.tool);
        match scope.definition.approvals.on_denial {
            OnDenial::Continue => scope.refuse(pending, usage, &text),
            OnDenial::Fail => CallOutcome::Fail(scope.redactor.redact(&text).into_owned()),
        }
    }

    /// Runs a call a person approved, once, if it is still exactly the call approved.
    async fn execute_approved(
        &self,
        scope: &CallScope<'_>,
        pending: &PendingCall,
        approval: &ApprovalRecord,
        usage: BudgetUsage,
    ) -> Result<CallOutcome, EngineError> {
        let call = &pending.call;
        let mismatch = |scope: &CallScope<'_>, usage| {
            let text = format!(
                "the approval for `{}` does not match this call (its tool definition or arguments changed, or it was used): the call did not run",
                approval.tool
            );
            scope.refuse(pending, usage, &text)
        };
        let Some(offered) = scope.tools.find(&call.name) else {
            let text = format!(
                "tool `{}` is no longer available; the approved call did not run",
                approval.tool
            );
            return Ok(scope.refuse(pending, usage, &text));
        };
        // A call an approver edited runs with the edited arguments (pins applied again), and
        // only if policy does not deny them; so does the retry of an interrupted edited call,
        // whose `outcome_unknown` approval is filed for the arguments that ran.
        let replaced = match (&approval.edited_arguments, approval.kind) {
            (Some(edited), _) => Some(edited.clone()),
            (None, ApprovalKind::OutcomeUnknown)
                if pending
                    .recorded
                    .as_ref()
                    .is_some_and(|r| r.arguments_hash != approval.arguments_hash) =>
            {
                Some(approval.arguments.clone())
            }
            (None, _) => None,
        };
        let model_arguments = replaced.clone().unwrap_or_else(|| call.arguments.clone());
        let arguments = match offered.prepare_arguments(&model_arguments) {
            Ok(arguments) => arguments,
            Err(error) if replaced.is_some() => {
                let text = format!(
                    "the arguments a person edited for `{}` do not fit the tool: {error}; the call did not run",
                    approval.tool
                );
                return Ok(scope.refuse(pending, usage, &text));
            }
            Err(_) => return Ok(mismatch(scope, usage)),
        };
        if replaced.is_some() {
            let (decision, _) = self.decide(scope, offered, &arguments, usage);
            if decision.outcome == wor_core::call::Verdict::Deny {
                // Not yet on the chain for a remote worker's run: its steps say the call
                // was refused, without this entry.
                if !self.is_remote() {
                    self.audit
                        .append(
                            run_event(scope.run, AuditCategory::ToolCall).payload(json!({
                                "transition": "edit_denied",
                                "tool": approval.tool,
                                "call_id": call.id,
                                "approval_id": approval.id.to_string(),
                                "determining_policies": decision.determining_policies,
                            })),
                        )
                        .await?;
                }
                let text = format!(
                    "tool `{}` was refused by policy with the arguments a person edited: {}",
                    approval.tool,
                    decision.reasons.join("; ")
                );
                return Ok(scope.refuse(pending, usage, &text));
            }
        }
        let binding = wor_core::approval::binding_hash(
            scope.run.id,
            &call.id,
            offered.pin.hash(),
            &arguments.hash,
        );
        // 5. Budget: reserved before the approval is used, so an approval is never spent on
        // a call the budget would not let run.
        let reserved = match usage.reserve_tool_call(&scope.limits) {
            Ok(reserved) => reserved,
            Err(exceeded) => return Ok(CallOutcome::Budget(exceeded)),
        };
        let started = if self.is_remote() {
            self.start_approved_remote(
                scope.run.id,
                approval.id,
                offered.pin.hash(),
                &arguments.hash,
                reserved,
            )
            .await?
        } else {
            self.start_approved(
                scope.run,
                &self.config.worker_id,
                None,
                approval,
                &binding,
                &reserved,
            )
            .await?
        };
        match started {
            ApprovedStart::Started => {}
            ApprovedStart::RunNotHeld => return Err(EngineError::LeaseLost),
            ApprovedStart::CancelRequested => return Ok(CallOutcome::Cancelled),
            ApprovedStart::NotUsable => return Ok(mismatch(scope, usage)),
        }
        let usage = reserved;
        let edited = replaced.as_ref().map(|_| {
            // What the model may see of the call it ran: never the pinned values.
            let shown: serde_json::Map<String, Value> = arguments
                .value
                .iter()
                .filter(|(key, _)| !arguments.pinned_keys.contains(key))
                .map(|(key, value)| (key.clone(), value.clone()))
                .collect();
            wor_core::canonical::to_canonical_json(&Value::Object(shown))
        });
        // Presented again right before the call: the approval's use came between.
        if let Some(outcome) = self.present_credential(scope).await? {
            return Ok(outcome);
        }
        let outcome = self
            .execute(scope, offered, pending, arguments, usage)
            .await?;
        Ok(match (outcome, edited) {
            (
                CallOutcome::Answered {
                    mut answer,
                    provenance,
                    usage,
                },
                Some(shown),
            ) => {
                answer.result.content = format!(
                    "A person edited this call's arguments before approving it; it ran with {shown}.\n{}",
                    answer.result.content
                );
                CallOutcome::Answered {
                    answer,
                    provenance,
                    usage,
                }
            }
            (outcome, _) => outcome,
        })
    }

    /// Pipeline steps 6 and 7: the call, credentials attached by the session at send time, and
    /// its result redacted, capped, labelled untrusted and enveloped.
    async fn execute(
        &self,
        scope: &CallScope<'_>,
        offered: &OfferedTool,
        pending: &PendingCall,
        arguments: CanonicalArguments,
        usage: BudgetUsage,
    ) -> Result<CallOutcome, EngineError> {
        if !scope.authority.allows(&offered.roster_name) {
            return Ok(CallOutcome::Fail(format!(
                "`{}` is not on the run's roster; the call did not run",
                offered.roster_name
            )));
        }
        if offered.connection == ROUTINE_CONNECTION {
            let input = routine_input(&arguments);
            return self
                .call_routine(scope, offered, pending, &input, usage)
                .await;
        }
        if let Some(connection) = scope.tools.connections.get(&offered.connection)
            && let Some(refusal) = self.recheck_if_changed(scope.run, connection).await?
        {
            return Ok(CallOutcome::Fail(refusal));
        }
        let began = std::time::SystemTime::now();
        let outcome = match scope.tools.connections.get(&offered.connection) {
            Some(connection) => match self
                .until_stopped(
                    scope.run,
                    scope.authority.remaining(),
                    connection.session.call_tool(&offered.tool, arguments.value),
                )
                .await?
            {
                // What the model is told of a failed call: the error's text (redacted below).
                Ok(Ok(result)) => Ok(result),
                // The server wants more scope than the connection's authorization grants: the
                // call fails closed, saying what to authorize; the connection remembers it.
                Ok(Err(wor_tools::ToolSessionError::Mcp(
                    wor_tools::McpError::InsufficientScope(challenge),
                ))) => Err(self
                    .oauth_scope_step_up(
                        run_event(scope.run, AuditCategory::ToolConnectionScopeStepUp),
                        &connection.record,
                        &challenge,
                    )
                    .await?),
                Ok(Err(e)) => {
                    if e.egress_refused() {
                        crate::metrics::tool_call_refused_by_egress();
                    }
                    Err(e.to_string())
                }
                // The call is dropped (aborted); the next step ends the run on its wall time.
                Err(Stopped::Deadline) => Err(
                    "it was stopped when the run's wall time ran out; its outcome is unknown"
                        .to_owned(),
                ),
                Err(Stopped::Cancelled) => Err(
                    "it was stopped when the run was cancelled; its outcome is unknown".to_owned(),
                ),
            },
            None => Err(format!(
                "tool connection `{}` is not open",
                offered.connection
            )),
        };
        let (text, is_error) = match outcome {
            Ok(result) => {
                let result =
                    wor_tools::ShapedResult::new(&result, scope.redactor, ResultLimits::default());
                (result.text, result.is_error)
            }
            Err(error) => (
                scope
                    .redactor
                    .redact(&format!("the tool call failed: {error}"))
                    .into_owned(),
                true,
            ),
        };
        crate::traces::tool_executed(scope.run, &pending.call.id, began, is_error);
        tracing::info!(category = "tools", action = "tool.call", project_id = %scope.run.project_id,
            run_id = %scope.run.id, is_error, "tool call answered");
        let content = untrusted_envelope(&offered.roster_name, &new_boundary(), &text);
        Ok(scope
            .answer(pending, usage, content, is_error)
            .with_provenance(Provenance::Untrusted))
    }

    /// When the server said its tool list changed (`notifications/tools/list_changed`) since
    /// the run started or last checked, compares the live list with the pins again before the
    /// next call: a changed or new tool quarantines the connection and the run fails closed,
    /// naming the tools. Returns the refusal, if any.
    async fn recheck_if_changed(
        &self,
        run: &RunRecord,
        connection: &crate::run_tools::LiveConnection,
    ) -> Result<Option<String>, EngineError> {
        if !connection.session.take_tools_changed() {
            return Ok(None);
        }
        let record = &connection.record;
        let live = match connection.session.list_tools().await {
            Ok(live) => live,
            Err(error) => {
                return Ok(Some(format!(
                    "tool connection `{}` announced new tools and they cannot be listed: {error}",
                    record.name
                )));
            }
        };
        let pins = crate::tool_connections::stored_pins(record)?;
        let diff = wor_tools::compare(&pins, &live);
        if diff.verdict() != wor_tools::ToolListVerdict::Quarantine {
            return Ok(None);
        }
        let names: Vec<String> = crate::tool_connections::quarantine_names(&diff)
            .iter()
            .map(|n| format!("`{n}`"))
            .collect();
        if self.is_remote() {
            return self
                .changed_on_remote(run.id, &record.name, &names)
                .await
                .map(Some);
        }
        self.quarantine_tool_connection(record, &live, &diff, run)
            .await?;
        Ok(Some(format!(
            "tool connection `{}` is quarantined: its tools changed during the run: {}; an admin must review the diff and enable it again",
            record.name,
            names.join(", ")
        )))
    }
}

/// How a call ends when the run's deadline has passed: over its wall time.
fn wall_time_over(scope: &CallScope<'_>) -> CallOutcome {
    CallOutcome::Budget(BudgetExceeded {
        limit: BudgetLimit::WallTime,
        used: scope.limits.wall_seconds,
        allowed: scope.limits.wall_seconds,
    })
}

/// How a call ends when the run's credential is no longer live: nothing ran.
fn credential_ended() -> CallOutcome {
    CallOutcome::Fail(
        "the run's credential is no longer valid (the run was parked, ended or taken over); the call did not run"
            .to_owned(),
    )
}

/// A step as it is recorded: the project's secrets and common secret shapes redacted.
fn redacted(step: Step, scope: &CallScope<'_>) -> Result<Step, EngineError> {
    step.rewritten(|payload| scope.redactor.redact_json(payload))
        .map_err(|e| EngineError::InvalidState(e.to_string()))
}

/// The input a routine call passes to the routine it starts.
fn routine_input(arguments: &CanonicalArguments) -> String {
    arguments
        .value
        .get("input")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned()
}

/// What a started call whose outcome is unknown comes to, by its `outcome_unknown` approval.
pub(crate) enum UnknownOutcome {
    /// A person is asked: anew for the `attempt`-th time (not asked yet, or the approved retry
    /// was interrupted too), or, with no attempt, again on the pending request.
    Ask { why: Value, attempt: Option<u64> },
    /// A person approved a retry: the call runs again with this approval.
    Retry(Box<ApprovalRecord>),
    /// Denied, expired or cancelled: the model is told its outcome is unknown.
    Unknown,
}

/// What a started call whose outcome is unknown comes to, given its latest `outcome_unknown`
/// approval and the untrusted sources in the run's context.
pub(crate) fn unknown_outcome(
    approval: Option<ApprovalRecord>,
    untrusted: &BTreeSet<String>,
) -> Result<UnknownOutcome, EngineError> {
    let ask = |attempt: u64| {
        let reason = if attempt == 1 {
            "this call started before the run was interrupted and its outcome was not recorded; approving runs it again, denying tells the model its outcome is unknown".to_owned()
        } else {
            format!(
                "this call started before the run was interrupted and its outcome was not recorded, {attempt} times (the earlier approved retries were interrupted too); approving runs it again, denying tells the model its outcome is unknown"
            )
        };
        UnknownOutcome::Ask {
            why: json!({
                "determining_policies": ["wor.outcome-unknown"],
                "reasons": [reason],
                "untrusted_sources": untrusted,
                "attempt": attempt,
            }),
            attempt: Some(attempt),
        }
    };
    Ok(match approval {
        None => ask(1),
        Some(approval)
            if approval.status == ApprovalStatus::Approved && approval.used_at.is_some() =>
        {
            ask(approval_attempt(&approval.why)?.saturating_add(1))
        }
        Some(approval) if approval.status == ApprovalStatus::Pending => UnknownOutcome::Ask {
            why: approval.why,
            attempt: None,
        },
        Some(approval) if approval.status == ApprovalStatus::Approved => {
            UnknownOutcome::Retry(Box::new(approval))
        }
        Some(_) => UnknownOutcome::Unknown,
    })
}

/// Which time of asking an `outcome_unknown` approval is (1 for the first), from its `why`.
/// A count that is there but is not one is stored state gone bad, never taken as 1.
fn approval_attempt(why: &Value) -> Result<u64, EngineError> {
    match why.get("attempt") {
        // Releases before the count was kept asked once per call and wrote no `attempt`:
        // such an approval was the first time of asking.
        None => Ok(1),
        Some(attempt) => attempt.as_u64().filter(|n| *n >= 1).ok_or_else(|| {
            EngineError::InvalidState(
                "an approval's `why.attempt` is not a count of times asked".to_owned(),
            )
        }),
    }
}

/// The policies that held a call, from the `why` of its approval request. Every `why` the
/// engine writes names them (policy, or `wor.outcome-unknown`): one that does not is not a
/// request the engine made, and is refused rather than filed with none.
fn why_policies(why: &Value) -> Result<Vec<String>, EngineError> {
    why.get("determining_policies")
        .and_then(Value::as_array)
        .and_then(|list| {
            list.iter()
                .map(|p| p.as_str().map(str::to_owned))
                .collect::<Option<Vec<_>>>()
        })
        .ok_or_else(|| {
            EngineError::InvalidState(
                "an approval's `why` does not list its determining policies".to_owned(),
            )
        })
}

/// Policy's decision on one call of `run`, and the labels of its arguments it decided on: the
/// same request whether the run is asking or an approver's edit is checked when it is decided
/// (`Engine::approve_edited`).
#[expect(
    clippy::too_many_arguments,
    reason = "each is one input of the decision; a struct would only rename them"
)]
pub(crate) fn decide_call(
    policy: &wor_policy::PolicyEngine,
    routine: &str,
    run: &RunRecord,
    offered: &OfferedTool,
    arguments: &CanonicalArguments,
    usage: BudgetUsage,
    untrusted: &BTreeSet<String>,
    content: &ContentIndex,
) -> (Decision, ArgumentLabels) {
    let labels = content.label(&arguments.value, &arguments.pinned_keys);
    let mut request = DecisionRequest::builder(
        routine,
        run.id.to_string(),
        &offered.connection,
        &offered.tool,
        offered.class,
    )
    .trigger(run.trigger_kind)
    .mode(offered.mode)
    .arguments(arguments.value.clone())
    .argument_labels(labels.clone())
    .budget_used(BudgetUsed {
        turns: usage.turns,
        tool_calls: usage.tool_calls,
        cost_microdollars: usage.cost_microdollars,
    });
    for source in untrusted {
        request = request.untrusted_source(source.clone());
    }
    (policy.decide(&request.build()), labels)
}

/// A run's context indexed for labelling arguments: its routine's instructions and pinned
/// values, then what its steps added.
pub(crate) fn run_content<'a>(
    definition: &'a wor_core::routine::RoutineDefinition,
    steps: impl IntoIterator<Item = (&'a Step, Provenance)>,
) -> ContentIndex {
    wor_core::step::content_index(
        &definition.instructions,
        definition.tools.iter().flat_map(|t| t.pinned.values()),
        steps,
    )
}

/// Why a call needs a person, as its approval request shows it.
fn why_json(
    decision: &Decision,
    untrusted: &BTreeSet<String>,
    labels: Option<&ArgumentLabels>,
) -> Value {
    json!({
        "determining_policies": decision.determining_policies,
        "reasons": decision.reasons,
        "untrusted_sources": untrusted,
        "argument_sources": labels,
    })
}

/// Why a call recorded as held needs a person, from what its decision recorded.
pub(crate) fn why_recorded(recorded: &ToolCallStep) -> Value {
    json!({
        "determining_policies": recorded.determining_policies,
        "reasons": recorded.reasons,
        "untrusted_sources": recorded.untrusted_sources,
        "argument_sources": recorded.argument_labels,
    })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::{approval_attempt, why_policies};
    use crate::EngineError;

    #[test]
    fn an_approval_without_a_count_was_the_first_time_of_asking() {
        assert_eq!(approval_attempt(&json!({ "reasons": [] })).unwrap(), 1);
        assert_eq!(approval_attempt(&json!({ "attempt": 3 })).unwrap(), 3);
    }

    #[test]
    fn a_count_that_is_not_one_is_invalid_stored_state() {
        for attempt in [json!("2"), json!(0), json!(-1), json!(1.5), json!(null)] {
            assert!(matches!(
                approval_attempt(&json!({ "attempt": attempt })),
                Err(EngineError::InvalidState(_))
            ));
        }
    }

    #[test]
    fn the_policies_of_a_request_are_read_as_written_or_refused() {
        let why = json!({ "determining_policies": ["wor.roster-confirm", "p1"] });
        assert_eq!(why_policies(&why).unwrap(), ["wor.roster-confirm", "p1"]);
        assert!(
            why_policies(&json!({ "determining_policies": [] }))
                .unwrap()
                .is_empty()
        );
        for why in [
            json!({}),
            json!({ "determining_policies": "p1" }),
            json!({ "determining_policies": ["p1", 2] }),
        ] {
            assert!(matches!(
                why_policies(&why),
                Err(EngineError::InvalidState(_))
            ));
        }
    }
}
