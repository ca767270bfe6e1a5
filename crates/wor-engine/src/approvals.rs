//! Deciding approvals, and expiring the ones nobody decided.
//!
//! Separation of duties: only a role that may approve decides, and never with the API key that
//! started the run, nor as the member who owns that key (whichever of their keys they use); a
//! routine with `[approvals] separate_from_author = true` also excludes the member who applied
//! the run's routine version.

use std::collections::HashMap;

use serde_json::json;
use wor_core::audit::{Actor, AuditCategory, AuditEvent};
use wor_core::{ApiKeyId, ApprovalId, MemberId, ProjectId, Role};
use wor_store::{
    ApprovalAnswer, ApprovalDecision, ApprovalEdit, ApprovalKind, ApprovalRecord, ApprovalStatus,
    DecideError, RunRecord, StoreError,
};

use wor_core::call::Verdict;
use wor_core::routine::ROUTINE_CONNECTION;
use wor_core::step::untrusted_sources;
use wor_tools::{ArgumentError, CanonicalArguments};

use crate::pipeline::decide_call;
use crate::run_tools::OfferedTool;
use crate::tool_connections::stored_pins;
use crate::{Engine, EngineError};

/// Why an approver's edit of a held call is refused when they decide: nothing is decided, and
/// the call stays pending. Each names what to correct.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EditRefusal {
    /// Only a call held by policy can be edited.
    #[error(
        "only a call held by policy can be edited; a call whose outcome is unknown is approved or denied as it ran"
    )]
    NotEditable,
    /// The edit is not an object of arguments, or is empty.
    #[error("`arguments` must be an object of the arguments to change and their new values")]
    NotAnObject,
    /// A pinned argument was given.
    #[error("`{argument}` is pinned by the routine and cannot be edited")]
    Pinned { argument: String },
    /// The edit leaves the call as it was.
    #[error("the edit changes nothing; approve the call as it is")]
    Unchanged,
    /// The edit names an argument the call does not have and the tool's input schema does
    /// not declare: a misspelt name, which would otherwise be sent as an extra argument.
    #[error(
        "`{argument}` is neither an argument of the call nor one the tool declares; correct the name"
    )]
    UnknownArgument { argument: String },
    /// The edited arguments do not fit the tool's pinned input schema.
    #[error("the edited arguments do not fit the tool's input schema: {}", describe(.violations))]
    Schema { violations: Vec<ArgumentViolation> },
    /// Policy denies the edited call.
    #[error(
        "policy denies the edited call ({}): {}; an edit cannot turn a denied call into an allowed one",
        policies.join(", "),
        reasons.join("; ")
    )]
    PolicyDenied {
        policies: Vec<String>,
        reasons: Vec<String>,
    },
    /// The tool cannot be checked any more (gone from the roster, its pin changed).
    #[error("the edited call to `{tool}` cannot be checked: {why}")]
    ToolUnavailable { tool: String, why: String },
}

/// One reason the edited arguments do not fit the tool's schema.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArgumentViolation {
    /// The top-level argument it is at; `None` for the arguments as a whole.
    pub argument: Option<String>,
    pub message: String,
}

fn describe(violations: &[ArgumentViolation]) -> String {
    violations
        .iter()
        .map(|v| match &v.argument {
            Some(argument) => format!("`{argument}`: {}", v.message),
            None => v.message.clone(),
        })
        .collect::<Vec<_>>()
        .join("; ")
}

impl EditRefusal {
    fn from_argument_error(error: &ArgumentError) -> Self {
        let violations = match error {
            ArgumentError::SchemaViolations { violations } => violations
                .iter()
                .map(|v| ArgumentViolation {
                    argument: v
                        .path
                        .split('/')
                        .nth(1)
                        .filter(|first| !first.is_empty())
                        .map(|first| first.replace("~1", "/").replace("~0", "~")),
                    // Redacted whole, then cut: a secret cut short would no longer be recognised.
                    message: wor_secrets::redact_shapes(&v.message)
                        .chars()
                        .take(300)
                        .collect(),
                })
                .collect(),
            other => vec![ArgumentViolation {
                argument: None,
                message: other.to_string(),
            }],
        };
        EditRefusal::Schema { violations }
    }

    /// The arguments each reason is about, for a form that shows them by field; `None` for
    /// the edit as a whole.
    pub fn by_argument(&self) -> Vec<(Option<String>, String)> {
        match self {
            EditRefusal::Pinned { argument } | EditRefusal::UnknownArgument { argument } => {
                vec![(Some(argument.clone()), self.to_string())]
            }
            EditRefusal::Schema { violations } => violations
                .iter()
                .map(|v| (v.argument.clone(), v.message.clone()))
                .collect(),
            other => vec![(None, other.to_string())],
        }
    }
}

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

/// Why a caller may not decide the approvals of a run: a role or separation-of-duties rule.
/// Nothing is decided.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ApproverRefusal {
    /// A service key (no person behind it) decides nothing.
    #[error("a service key cannot decide approvals; use a member's key")]
    NoPerson,
    /// The caller's role does not decide approvals.
    #[error("deciding approvals needs the approver, admin or owner role; this caller has `{0}`")]
    Role(Role),
    /// The member who started the run (with any of their keys, or signed in).
    #[error("the member who started this run cannot decide its approvals")]
    StarterMember,
    /// The API key that started the run.
    #[error("the API key that started this run cannot decide its approvals")]
    StarterKey,
    /// The routine's author, when the routine asks for `separate_from_author`.
    #[error("this routine asks that its author not decide its approvals")]
    Author,
}

/// Why a decision is not taken as it was sent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecisionRefusal {
    /// The decision has no reason.
    #[error("a decision needs a reason (`reason`)")]
    NoReason,
    /// The reason is longer than [`MAX_REASON_CHARS`].
    #[error("the reason is longer than {MAX_REASON_CHARS} characters")]
    ReasonTooLong,
    /// The approval was decided before.
    #[error("the approval is already {0}")]
    NotPending(ApprovalStatus),
    /// The approval expired before it was decided.
    #[error("the approval expired before it was decided")]
    Expired,
    /// The approval's run was asked to cancel before the decision.
    #[error("the approval's run was cancelled; its calls are no longer decided")]
    RunCancelled,
}

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
    /// arguments to change and their new values; pinned ones cannot change). The edited call
    /// is checked now as the run will check it when it resumes — the tool's pinned schema and
    /// pins, then policy with the run's provenance — and refused ([`EditRefusal`]) if it does
    /// not pass. The approval is bound to the edited call, so only the edited call can use it;
    /// the run checks it again when it resumes (an edit never turns a denied call into an
    /// allowed one) and tells the model the call ran with edited arguments. Both calls are in
    /// the audit entry.
    pub async fn approve_edited(
        &self,
        project: ProjectId,
        id: ApprovalId,
        approver: Approver,
        edits: &serde_json::Value,
        reason: &str,
    ) -> Result<ApprovalRecord, EngineError> {
        let approval = self.store.get_approval(project, id).await?;
        let run = self.store.get_run(project, approval.run_id).await?;
        // Who may edit is who may approve: a caller who may not decide learns nothing of
        // whether their edit would pass.
        if let Some(refusal) = self
            .approver_refusal(project, &run, approver, &mut HashMap::new())
            .await?
        {
            return Err(refusal.into());
        }
        // A call decided already is answered as deciding it again is, before its edit is
        // looked at: an edit of it would say nothing true.
        if approval.status != ApprovalStatus::Pending {
            return Err(DecisionRefusal::NotPending(approval.status).into());
        }
        if approval.kind != ApprovalKind::Policy {
            return Err(EditRefusal::NotEditable.into());
        }
        let edits = match edits.as_object() {
            Some(edits) if !edits.is_empty() => edits,
            _ => return Err(EditRefusal::NotAnObject.into()),
        };
        if let Some(pinned) = edits.keys().find(|k| approval.pinned_keys.contains(k)) {
            return Err(EditRefusal::Pinned {
                argument: wor_core::quote::excerpt(pinned, 100),
            }
            .into());
        }
        let mut edited = approval.arguments.as_object().cloned().unwrap_or_default();
        for (key, value) in edits {
            edited.insert(key.clone(), value.clone());
        }
        let edited = serde_json::Value::Object(edited);
        if edited == approval.arguments {
            return Err(EditRefusal::Unchanged.into());
        }
        let added: Vec<&str> = edits
            .keys()
            .filter(|k| {
                approval
                    .arguments
                    .as_object()
                    .is_none_or(|call| !call.contains_key(k.as_str()))
            })
            .map(String::as_str)
            .collect();
        let arguments = self.check_edit(&approval, &run, &edited, &added).await?;
        let binding = wor_core::approval::binding_hash(
            approval.run_id,
            &approval.call_id,
            &approval.pin_hash,
            &arguments.hash,
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

    /// The edited arguments of a held call as the run will send them, checked now the way the
    /// run checks them when it resumes: against the tool's pinned definition (the one the call
    /// was held for) with the roster's pins applied, then by the run's policies with the run's
    /// provenance. A refusal names the argument or the policies.
    async fn check_edit(
        &self,
        approval: &ApprovalRecord,
        run: &RunRecord,
        edited: &serde_json::Value,
        added: &[&str],
    ) -> Result<CanonicalArguments, EngineError> {
        let project = run.project_id;
        let version = self
            .routine_version(project, run.routine_id, run.routine_version)
            .await?;
        let definition = &version.definition;
        let unavailable = |why: String| EditRefusal::ToolUnavailable {
            tool: approval.tool.clone(),
            why,
        };
        let Some(entry) = definition.tools.iter().find(|e| e.tool == approval.tool) else {
            return Err(unavailable("it is not on the run's roster".to_owned()).into());
        };
        let Some((connection, tool)) = entry.tool.split_once('/') else {
            return Err(unavailable("it is not CONNECTION/TOOL".to_owned()).into());
        };
        let offered = if connection == ROUTINE_CONNECTION {
            match self.routine_tool(run, tool, entry).await {
                Ok(offered) => offered,
                Err(EngineError::Store(error)) => return Err(error.into()),
                Err(other) => return Err(unavailable(other.to_string()).into()),
            }
        } else {
            let record = match self
                .store
                .get_tool_connection_by_name(project, connection)
                .await
            {
                Ok(record) => record,
                Err(StoreError::NotFound) => {
                    return Err(
                        unavailable("its tool connection no longer exists".to_owned()).into(),
                    );
                }
                Err(other) => return Err(other.into()),
            };
            let pins = stored_pins(&record).map_err(|e| unavailable(e.to_string()))?;
            let Some(pin) = pins.into_iter().find(|p| p.name() == tool) else {
                return Err(unavailable("its tool connection no longer pins it".to_owned()).into());
            };
            OfferedTool::new(entry, connection, tool, pin, record.class_of(tool))
        };
        if offered.pin.hash() != approval.pin_hash {
            return Err(unavailable(
                "its pinned definition changed since the call was held".to_owned(),
            )
            .into());
        }
        // An argument the call did not have must be one the tool declares, when it declares
        // any: an edit adds an optional argument the model left out, never a misspelt one.
        if let Some(declared) = offered
            .pin
            .input_schema()
            .get("properties")
            .and_then(serde_json::Value::as_object)
            && let Some(unknown) = added.iter().find(|name| !declared.contains_key(**name))
        {
            return Err(EditRefusal::UnknownArgument {
                argument: wor_core::quote::excerpt(unknown, 100),
            }
            .into());
        }
        let arguments = offered
            .prepare_arguments(edited)
            .map_err(|error| EditRefusal::from_argument_error(&error))?;
        let policy = self.run_policy(run, definition).await?;
        let steps = self.store.list_run_steps(project, run.id, 0).await?;
        let untrusted = untrusted_sources(steps.iter().map(|s| (&s.step, s.provenance)));
        let content =
            crate::pipeline::run_content(definition, steps.iter().map(|s| (&s.step, s.provenance)));
        let (decision, _) = decide_call(
            &policy,
            definition.name.as_str(),
            run,
            &offered,
            &arguments,
            run.usage,
            &untrusted,
            &content,
        );
        if decision.outcome == Verdict::Deny {
            return Err(EditRefusal::PolicyDenied {
                policies: decision.determining_policies,
                reasons: decision.reasons,
            }
            .into());
        }
        Ok(arguments)
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
        // A reason of nothing but spaces and invisible characters says nothing either.
        if reason
            .chars()
            .all(|c| c.is_whitespace() || wor_core::name::is_format_char(c))
        {
            return Err(DecisionRefusal::NoReason.into());
        }
        if reason.chars().count() > MAX_REASON_CHARS {
            return Err(DecisionRefusal::ReasonTooLong.into());
        }
        if let Some(refusal) = self
            .approver_refusal(project, &run, approver, &mut HashMap::new())
            .await?
        {
            return Err(refusal.into());
        }
        let reason = wor_secrets::redact_shapes(reason).into_owned();
        let decision = ApprovalDecision {
            verdict,
            key_id: approver.key_id,
            member_id: approver.member_id,
            reason: reason.clone(),
        };
        let original_binding = approval.binding_hash.clone();
        let actor = match (approver.member_id, approver.key_id) {
            (Some(member_id), Some(key_id)) => Actor::Member { member_id, key_id },
            (Some(member_id), None) => Actor::ConsoleMember { member_id },
            (None, Some(key_id)) => Actor::ApiKey { key_id },
            // Refused by `approver_refusal` above: a decision always has a person.
            (None, None) => return Err(ApproverRefusal::NoPerson.into()),
        };
        // The decision's entry is staged with the decision: a crash before it is appended here
        // leaves it for the audit writer's sweep, never an approved call without its entry.
        let entry = |decided: &ApprovalRecord| {
            AuditEvent::new(project, AuditCategory::ApprovalDecide, actor.clone())
                .subject("approval_id", id)
                .subject("run_id", run.id)
                .runs(run.root_run_id, run.parent_run_id)
                .payload(decision_payload(decided, &reason, &via, &original_binding))
        };
        let recorded = self
            .store
            .decide_approval_staged(project, id, &decision, edit.as_ref(), Some(&entry))
            .await;
        let (decided, staged) = match recorded {
            Ok(decided) => decided,
            Err(DecideError::NotFound) => return Err(StoreError::NotFound.into()),
            Err(DecideError::Store(error)) => return Err(error.into()),
            Err(DecideError::NotPending(status)) => {
                return Err(DecisionRefusal::NotPending(status).into());
            }
            Err(DecideError::Expired) => return Err(DecisionRefusal::Expired.into()),
            Err(DecideError::RunCancelled) => return Err(DecisionRefusal::RunCancelled.into()),
        };
        // The decision is made and its entry is on disk: the run is woken and the channels told
        // whatever the append.
        self.append_staged_or_log(staged).await;
        crate::metrics::approval_decided(decided.status);
        crate::traces::approval_waited(&decided);
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
    ) -> Result<Option<ApproverRefusal>, EngineError> {
        let run = self.store.get_run(project, approval.run_id).await?;
        self.approver_refusal(project, &run, approver, &mut HashMap::new())
            .await
    }

    /// [`Engine::approval_refusal`] for the approvals of each of `runs` at once (a page of the
    /// console's inbox), in their order: each key the runs name is read once.
    pub async fn approval_refusals(
        &self,
        project: ProjectId,
        runs: &[&RunRecord],
        approver: Approver,
    ) -> Result<Vec<Option<ApproverRefusal>>, EngineError> {
        let mut key_members = HashMap::new();
        let mut refusals = Vec::with_capacity(runs.len());
        for run in runs {
            refusals.push(
                self.approver_refusal(project, run, approver, &mut key_members)
                    .await?,
            );
        }
        Ok(refusals)
    }

    /// Why `approver` may not decide approvals of `run`; `key_members` keeps the members of
    /// the keys already looked up.
    async fn approver_refusal(
        &self,
        project: ProjectId,
        run: &RunRecord,
        approver: Approver,
        key_members: &mut HashMap<ApiKeyId, Option<MemberId>>,
    ) -> Result<Option<ApproverRefusal>, EngineError> {
        let Some(member_id) = approver.member_id else {
            return Ok(Some(ApproverRefusal::NoPerson));
        };
        if !approver.role.can_approve() {
            return Ok(Some(ApproverRefusal::Role(approver.role)));
        }
        if run.started_by_member == Some(member_id) {
            return Ok(Some(ApproverRefusal::StarterMember));
        }
        if let Some(starter) = run.started_by {
            if Some(starter) == approver.key_id {
                return Ok(Some(ApproverRefusal::StarterKey));
            }
            if self.key_member(project, starter, key_members).await? == Some(member_id) {
                return Ok(Some(ApproverRefusal::StarterMember));
            }
        }
        let version = self
            .routine_version(project, run.routine_id, run.routine_version)
            .await?;
        if version.definition.approvals.separate_from_author
            && let Some(author_key) = version.created_by
            && (Some(author_key) == approver.key_id
                || self.key_member(project, author_key, key_members).await? == Some(member_id))
        {
            return Ok(Some(ApproverRefusal::Author));
        }
        Ok(None)
    }

    /// The member a key belongs to; `None` for a service key or a key no longer there. Read
    /// once per `known`.
    async fn key_member(
        &self,
        project: ProjectId,
        key: ApiKeyId,
        known: &mut HashMap<ApiKeyId, Option<MemberId>>,
    ) -> Result<Option<MemberId>, EngineError> {
        if let Some(member) = known.get(&key) {
            return Ok(*member);
        }
        let member = match self.store.get_api_key(project, key).await {
            Ok(key) => key.member_id,
            Err(StoreError::NotFound) => None,
            Err(other) => return Err(other.into()),
        };
        known.insert(key, member);
        Ok(member)
    }

    /// Expires every pending approval whose time ran out; their runs go on as their routines
    /// say for a denial. Returns how many expired.
    pub async fn expire_approvals(&self) -> Result<usize, EngineError> {
        // Each expiry's entry is staged with it: a crash before the append below leaves it for
        // the audit writer's sweep, never an expired approval without its entry.
        let entry = |approval: &ApprovalRecord, run: &wor_store::RunRecord| {
            AuditEvent::new(
                approval.project_id,
                AuditCategory::ApprovalExpire,
                Actor::Run { run_id: run.id },
            )
            .subject("approval_id", approval.id)
            .subject("run_id", run.id)
            .runs(run.root_run_id, run.parent_run_id)
            .payload(json!({ "tool": approval.tool, "expires_at": approval.expires_at }))
        };
        let (expired, staged): (Vec<ApprovalRecord>, Vec<_>) = self
            .store
            .expire_approvals(&entry)
            .await?
            .into_iter()
            .unzip();
        self.append_staged_or_log(staged).await;
        crate::metrics::approvals_expired(expired.len());
        expired.iter().for_each(crate::traces::approval_waited);
        for approval in &expired {
            self.notify_approval_changed_or_log(approval.project_id, approval.id, "expired", None)
                .await;
            tracing::info!(category = "approval", action = "approval.expire", project_id = %approval.project_id,
                approval_id = %approval.id, "approval expired");
        }
        Ok(expired.len())
    }
}
