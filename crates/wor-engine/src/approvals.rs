//! Deciding approvals, and expiring the ones nobody decided.
//!
//! Separation of duties: only a role that may approve decides, and never with the API key that
//! started the run, nor as the member who owns that key (whichever of their keys they use); a
//! routine with `[approvals] separate_from_author = true` also excludes the member who applied
//! the run's routine version.

use serde_json::json;
use wor_core::audit::{Actor, AuditCategory, AuditEvent};
use wor_core::{ApiKeyId, ApprovalId, MemberId, ProjectId, Role};
use wor_store::{
    ApprovalAnswer, ApprovalDecision, ApprovalEdit, ApprovalKind, ApprovalRecord, DecideError,
    RunRecord, StoreError,
};

use crate::{Engine, EngineError};

/// What an `approval.decide` entry records: the decision, where it was made and, for Slack,
/// the Slack identity that pressed (the member is the entry's actor).
fn decision_payload(
    decided: &ApprovalRecord,
    reason: &str,
    via: &DecidedVia,
    original_binding: &str,
) -> serde_json::Value {
    let mut payload = json!({
        "decision": decided.status.as_str(),
        "reason": reason,
        "tool": decided.tool,
        "binding_hash": decided.binding_hash,
        "via": via.as_str(),
    });
    if let (DecidedVia::Slack { team, user }, Some(fields)) = (via, payload.as_object_mut()) {
        fields.insert("slack_team".to_owned(), json!(team));
        fields.insert("slack_user".to_owned(), json!(user));
    }
    // An edited call: both calls, and the binding of each.
    if let (Some(edited), Some(fields)) = (&decided.edited_arguments, payload.as_object_mut()) {
        fields.insert("original_arguments".to_owned(), decided.arguments.clone());
        fields.insert("original_binding_hash".to_owned(), json!(original_binding));
        fields.insert("edited_arguments".to_owned(), edited.clone());
    }
    payload
}

/// Longest reason accepted with a decision.
const MAX_REASON_CHARS: usize = 2000;

/// Why a decision without a person is refused.
const NO_PERSON: &str = "a service key cannot decide approvals; use a member's key";

/// Who is deciding: the authenticated caller.
#[derive(Debug, Clone, Copy)]
pub struct Approver {
    /// The API key used; `None` for a member signed in to the console.
    pub key_id: Option<ApiKeyId>,
    pub member_id: Option<MemberId>,
    pub role: Role,
}

/// Where a decision was made, for what the messages about it say and its audit entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum DecidedVia {
    /// An API key (the API or the CLI).
    Api,
    /// A console session.
    Console,
    /// Slack, by the linked member whose Slack identity this is.
    Slack { team: String, user: String },
}

impl DecidedVia {
    fn as_note(&self) -> &'static str {
        match self {
            DecidedVia::Api => "through the API",
            DecidedVia::Console => "in the console",
            DecidedVia::Slack { .. } => "in Slack",
        }
    }

    fn as_str(&self) -> &'static str {
        match self {
            DecidedVia::Api => "api",
            DecidedVia::Console => "console",
            DecidedVia::Slack { .. } => "slack",
        }
    }
}

impl Engine {
    /// Records `approver`'s decision on approval `id` and queues its run to go on.
    pub async fn decide_approval(
        &self,
        project: ProjectId,
        id: ApprovalId,
        approver: Approver,
        verdict: ApprovalAnswer,
        reason: &str,
    ) -> Result<ApprovalRecord, EngineError> {
        let via = if approver.key_id.is_some() {
            DecidedVia::Api
        } else {
            DecidedVia::Console
        };
        self.decide_approval_via(project, id, approver, verdict, reason, via, None)
            .await
    }

    /// Approves approval `id` with some of its call's arguments corrected (`edits`: the
    /// arguments to change and their new values; pinned ones cannot change). The approval is
    /// bound to the edited call, so only the edited call can use it; the run checks it against
    /// policy again when it resumes (an edit never turns a denied call into an allowed one) and
    /// tells the model the call ran with edited arguments. Both calls are in the audit entry.
    pub async fn approve_edited(
        &self,
        project: ProjectId,
        id: ApprovalId,
        approver: Approver,
        edits: &serde_json::Value,
        reason: &str,
    ) -> Result<ApprovalRecord, EngineError> {
        let approval = self.store.get_approval(project, id).await?;
        if approval.kind != ApprovalKind::Policy {
            return Err(EngineError::Refused(
                "only a call held by policy can be edited; a call whose outcome is unknown is approved or denied as it ran".to_owned(),
            ));
        }
        let edits = match edits.as_object() {
            Some(edits) if !edits.is_empty() => edits,
            _ => {
                return Err(EngineError::Invalid(
                    "`arguments` must be an object of the arguments to change and their new values"
                        .to_owned(),
                ));
            }
        };
        if let Some(pinned) = edits.keys().find(|k| approval.pinned_keys.contains(k)) {
            return Err(EngineError::Invalid(format!(
                "`{}` is pinned by the routine and cannot be edited",
                pinned.chars().take(100).collect::<String>()
            )));
        }
        let mut edited = approval.arguments.as_object().cloned().unwrap_or_default();
        for (key, value) in edits {
            edited.insert(key.clone(), value.clone());
        }
        let edited = serde_json::Value::Object(edited);
        if edited == approval.arguments {
            return Err(EngineError::Invalid(
                "the edit changes nothing; approve the call as it is".to_owned(),
            ));
        }
        let hash = wor_core::canonical::sha256_hex(
            wor_core::canonical::to_canonical_json(&edited).as_bytes(),
        );
        let binding = wor_core::approval::binding_hash(
            approval.run_id,
            &approval.call_id,
            &approval.pin_hash,
            &hash,
        );
        let via = if approver.key_id.is_some() {
            DecidedVia::Api
        } else {
            DecidedVia::Console
        };
        self.decide_approval_via(
            project,
            id,
            approver,
            ApprovalAnswer::Approve,
            reason,
            via,
            Some(ApprovalEdit {
                arguments: edited,
                binding_hash: binding,
            }),
        )
        .await
    }

    /// [`Self::decide_approval`], saying where the decision was made: every channel decides
    /// through here, under the same checks.
    #[expect(
        clippy::too_many_arguments,
        reason = "every channel's decision passes through here, each fact of it apart"
    )]
    pub(crate) async fn decide_approval_via(
        &self,
        project: ProjectId,
        id: ApprovalId,
        approver: Approver,
        verdict: ApprovalAnswer,
        reason: &str,
        via: DecidedVia,
        edit: Option<ApprovalEdit>,
    ) -> Result<ApprovalRecord, EngineError> {
        // Lookups first: another project's approval is not found, whoever asks and however.
        let approval = self.store.get_approval(project, id).await?;
        let run = self.store.get_run(project, approval.run_id).await?;
        let reason = reason.trim();
        if reason.is_empty() {
            return Err(EngineError::Invalid(
                "a decision needs a reason (`reason`)".to_owned(),
            ));
        }
        if reason.chars().count() > MAX_REASON_CHARS {
            return Err(EngineError::Invalid(format!(
                "the reason is longer than {MAX_REASON_CHARS} characters"
            )));
        }
        if let Some(refusal) = self.approver_refusal(project, &run, approver).await? {
            return Err(EngineError::Forbidden(refusal));
        }
        let reason = wor_secrets::redact_shapes(reason).into_owned();
        let decision = ApprovalDecision {
            verdict,
            key_id: approver.key_id,
            member_id: approver.member_id,
            reason: reason.clone(),
        };
        let original_binding = approval.binding_hash.clone();
        let recorded = match &edit {
            Some(edit) => {
                self.store
                    .decide_approval_edited(project, id, &decision, edit)
                    .await
            }
            None => self.store.decide_approval(project, id, &decision).await,
        };
        let decided = match recorded {
            Ok(decided) => decided,
            Err(DecideError::NotFound) => return Err(StoreError::NotFound.into()),
            Err(DecideError::Store(error)) => return Err(error.into()),
            Err(other @ (DecideError::NotPending(_) | DecideError::Expired)) => {
                return Err(EngineError::Refused(other.to_string()));
            }
        };
        let actor = match (approver.member_id, approver.key_id) {
            (Some(member_id), Some(key_id)) => Actor::Member { member_id, key_id },
            (Some(member_id), None) => Actor::ConsoleMember { member_id },
            (None, Some(key_id)) => Actor::ApiKey { key_id },
            // Refused by `approver_refusal` above: a decision always has a person.
            (None, None) => return Err(EngineError::Forbidden(NO_PERSON.to_owned())),
        };
        self.audit
            .append(
                AuditEvent::new(project, AuditCategory::ApprovalDecide, actor)
                    .subject("approval_id", id)
                    .subject("run_id", run.id)
                    .runs(run.root_run_id, run.parent_run_id)
                    .payload(decision_payload(&decided, &reason, &via, &original_binding)),
            )
            .await?;
        crate::metrics::approval_decided(decided.status);
        self.wake_workers();
        self.notify_approval_changed_or_log(project, id, "decided", Some(via.as_note().to_owned()))
            .await;
        tracing::info!(category = "approval", action = "approval.decide", project_id = %project,
            approval_id = %id, decision = decided.status.as_str(), "approval decided");
        Ok(decided)
    }

    /// Why `approver` may not decide approvals of `run`, or `None` when they may. The console
    /// shows this beside a held call; [`Engine::decide_approval`] refuses with it.
    pub async fn approval_refusal(
        &self,
        project: ProjectId,
        approval: &ApprovalRecord,
        approver: Approver,
    ) -> Result<Option<String>, EngineError> {
        let run = self.store.get_run(project, approval.run_id).await?;
        self.approver_refusal(project, &run, approver).await
    }

    async fn approver_refusal(
        &self,
        project: ProjectId,
        run: &RunRecord,
        approver: Approver,
    ) -> Result<Option<String>, EngineError> {
        let Some(member_id) = approver.member_id else {
            return Ok(Some(NO_PERSON.to_owned()));
        };
        if !approver.role.can_approve() {
            return Ok(Some(format!(
                "deciding approvals needs the approver, admin or owner role; this caller has `{}`",
                approver.role
            )));
        }
        if run.started_by_member == Some(member_id) {
            return Ok(Some(
                "the member who started this run cannot decide its approvals".to_owned(),
            ));
        }
        if let Some(starter) = run.started_by {
            if Some(starter) == approver.key_id {
                return Ok(Some(
                    "the API key that started this run cannot decide its approvals".to_owned(),
                ));
            }
            if self.key_member(project, starter).await? == Some(member_id) {
                return Ok(Some(
                    "the member who started this run cannot decide its approvals".to_owned(),
                ));
            }
        }
        let version = self
            .routine_version(project, run.routine_id, run.routine_version)
            .await?;
        if version.definition.approvals.separate_from_author
            && let Some(author_key) = version.created_by
            && (Some(author_key) == approver.key_id
                || self.key_member(project, author_key).await? == Some(member_id))
        {
            return Ok(Some(
                "this routine asks that its author not decide its approvals".to_owned(),
            ));
        }
        Ok(None)
    }

    /// The member a key belongs to; `None` for a service key or a key no longer there.
    async fn key_member(
        &self,
        project: ProjectId,
        key: ApiKeyId,
    ) -> Result<Option<MemberId>, EngineError> {
        match self.store.get_api_key(project, key).await {
            Ok(key) => Ok(key.member_id),
            Err(StoreError::NotFound) => Ok(None),
            Err(other) => Err(other.into()),
        }
    }

    /// Expires every pending approval whose time ran out; their runs go on as their routines
    /// say for a denial. Returns how many expired.
    pub async fn expire_approvals(&self) -> Result<usize, EngineError> {
        let expired = self.store.expire_approvals().await?;
        crate::metrics::approvals_expired(expired.len());
        for approval in &expired {
            let run = self
                .store
                .get_run(approval.project_id, approval.run_id)
                .await?;
            self.audit
                .append(
                    AuditEvent::new(
                        approval.project_id,
                        AuditCategory::ApprovalExpire,
                        Actor::Run { run_id: run.id },
                    )
                    .subject("approval_id", approval.id)
                    .subject("run_id", run.id)
                    .runs(run.root_run_id, run.parent_run_id)
                    .payload(json!({ "tool": approval.tool, "expires_at": approval.expires_at })),
                )
                .await?;
            self.notify_approval_changed_or_log(approval.project_id, approval.id, "expired", None)
                .await;
            tracing::info!(category = "approval", action = "approval.expire", project_id = %approval.project_id,
                approval_id = %approval.id, "approval expired");
        }
        Ok(expired.len())
    }
}
