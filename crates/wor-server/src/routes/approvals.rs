//! Approvals: the requests a parked run waits on, and a person's decision on each.

use axum::Json;
use axum::extract::{Query, State};
use wor_core::step::Step;
use wor_core::{ApprovalId, RunId};
use wor_engine::Approver;
use wor_store::{ApprovalAnswer, ApprovalFilter, ApprovalRecord, ApprovalStatus};

use crate::AppState;
use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::extract::{ApiJson, ApiPath, page_limit, query_id};
use crate::routes::runs::RunView;
use crate::views::rfc3339;

#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct ApprovalView {
    pub id: String,
    pub run_id: String,
    /// The model's id for the call.
    pub call_id: String,
    /// `CONNECTION/TOOL`.
    pub tool: String,
    /// Hash of the pinned tool definition the call is for.
    pub pin_hash: String,
    /// The canonical arguments that will be sent, pinned ones included (redacted).
    #[schema(value_type = Object)]
    pub arguments: serde_json::Value,
    /// Which arguments the routine pinned (the model did not choose them).
    pub pinned_keys: Vec<String>,
    pub arguments_hash: String,
    /// Hash of (run, call, tool definition hash, arguments hash): what approving binds to.
    pub binding_hash: String,
    /// `policy`, or `outcome_unknown` for a call interrupted mid-flight (approving runs it again).
    pub kind: String,
    /// Why: the determining policies, their reasons, and the untrusted sources in context.
    #[schema(value_type = Object)]
    pub why: serde_json::Value,
    /// pending, approved, denied, expired or cancelled.
    pub status: String,
    pub requested_at: String,
    pub expires_at: String,
    pub decided_by_key: Option<String>,
    pub decided_by_member: Option<String>,
    pub decision_reason: Option<String>,
    pub decided_at: Option<String>,
    pub used_at: Option<String>,
    /// The arguments an approver corrected the call to (`edit-and-approve`); the call runs
    /// with these, and `binding_hash` is theirs. `arguments` stay as the model proposed them.
    pub edited_arguments: Option<serde_json::Value>,
}

impl From<ApprovalRecord> for ApprovalView {
    fn from(a: ApprovalRecord) -> Self {
        ApprovalView {
            id: a.id.to_string(),
            run_id: a.run_id.to_string(),
            call_id: a.call_id,
            tool: a.tool,
            pin_hash: a.pin_hash,
            arguments: a.arguments,
            pinned_keys: a.pinned_keys,
            arguments_hash: a.arguments_hash,
            binding_hash: a.binding_hash,
            kind: a.kind.as_str().to_owned(),
            why: a.why,
            status: a.status.as_str().to_owned(),
            requested_at: rfc3339(a.requested_at),
            expires_at: rfc3339(a.expires_at),
            decided_by_key: a.decided_by_key.map(|k| k.to_string()),
            decided_by_member: a.decided_by_member.map(|m| m.to_string()),
            decision_reason: a.decision_reason,
            decided_at: a.decided_at.map(rfc3339),
            used_at: a.used_at.map(rfc3339),
            edited_arguments: a.edited_arguments,
        }
    }
}

#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct ApprovalDetail {
    #[serde(flatten)]
    pub approval: ApprovalView,
    /// The run the call belongs to.
    pub run: RunView,
    /// The routine's name.
    pub routine: String,
    /// What the run was asked to do (its requester input).
    #[schema(value_type = Object)]
    pub run_input: serde_json::Value,
}

#[derive(Debug, serde::Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct ApprovalListQuery {
    /// Only approvals with this status (pending, approved, denied, expired, cancelled).
    pub status: Option<String>,
    /// Only approvals of this run (`run_…`).
    pub run_id: Option<String>,
    /// Only approvals older than this one: the previous page's last id.
    pub before: Option<String>,
    /// At most this many (1 to 200, default 50).
    pub limit: Option<u32>,
}

#[derive(Debug, serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DecideBody {
    /// Why: recorded with the decision and in the audit log.
    pub reason: String,
}

/// Lists approvals, newest first.
#[utoipa::path(get, path = "/v1/approvals", tag = "approvals", security(("bearer" = [])),
    params(ApprovalListQuery),
    responses((status = 200, body = [ApprovalView]), (status = 400, body = ErrorBody)))]
pub async fn list(
    State(state): State<AppState>,
    caller: Caller,
    query: Result<Query<ApprovalListQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<Vec<ApprovalView>>, ApiError> {
    let Query(query) = query.map_err(|e| ApiError::bad_request("invalid_query", e.body_text()))?;
    let filter = ApprovalFilter {
        status: query
            .status
            .as_deref()
            .map(str::parse::<ApprovalStatus>)
            .transpose()
            .map_err(|e| ApiError::bad_request("invalid_status", e))?,
        run_id: query_id::<RunId>(query.run_id.as_deref())?,
        before: query_id::<ApprovalId>(query.before.as_deref())?,
        limit: page_limit(query.limit)?,
    };
    let approvals = state
        .store
        .list_approvals(caller.project_id, &filter)
        .await?;
    Ok(Json(approvals.into_iter().map(Into::into).collect()))
}

/// One approval with the context of its run.
#[utoipa::path(get, path = "/v1/approvals/{approval_id}", tag = "approvals", security(("bearer" = [])),
    params(("approval_id" = String, Path, description = "an `apr_…` id", pattern = "^apr_[0-9a-f]{32}$")),
    responses((status = 200, body = ApprovalDetail), (status = 404, body = ErrorBody)))]
pub async fn get(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<ApprovalId>,
) -> Result<Json<ApprovalDetail>, ApiError> {
    let approval = state.store.get_approval(caller.project_id, id).await?;
    let run = state
        .store
        .get_run(caller.project_id, approval.run_id)
        .await?;
    let routine = state
        .store
        .get_routine(caller.project_id, run.routine_id)
        .await?;
    let run_input = state
        .store
        .list_run_steps(caller.project_id, run.id, 0)
        .await?
        .into_iter()
        .find_map(|s| match s.step {
            Step::Input(input) => Some(input.input),
            _ => None,
        })
        .unwrap_or(serde_json::Value::Null);
    Ok(Json(ApprovalDetail {
        approval: approval.into(),
        run: run.into(),
        routine: routine.name,
        run_input,
    }))
}

/// Approves exactly this call: its run goes on and runs it once.
#[utoipa::path(post, path = "/v1/approvals/{approval_id}/approve", tag = "approvals", security(("bearer" = [])),
    request_body = DecideBody,
    params(("approval_id" = String, Path, description = "an `apr_…` id", pattern = "^apr_[0-9a-f]{32}$")),
    responses((status = 200, body = ApprovalView), (status = 400, body = ErrorBody),
        (status = 403, body = ErrorBody), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn approve(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<ApprovalId>,
    ApiJson(body): ApiJson<DecideBody>,
) -> Result<Json<ApprovalView>, ApiError> {
    decide(state, caller, id, ApprovalAnswer::Approve, &body.reason).await
}

#[derive(Debug, serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct EditAndApproveBody {
    /// The arguments to change and their new values; pinned arguments cannot change.
    pub arguments: serde_json::Value,
    pub reason: String,
}

/// Approves this call with some of its arguments corrected: the approval binds to the edited
/// call, which runs once with them if policy does not deny them, and the model is told it ran
/// with edited arguments. Both calls are in the audit entry.
#[utoipa::path(post, path = "/v1/approvals/{approval_id}/edit-and-approve", tag = "approvals",
    security(("bearer" = [])),
    request_body = EditAndApproveBody,
    params(("approval_id" = String, Path, description = "an `apr_…` id", pattern = "^apr_[0-9a-f]{32}$")),
    responses((status = 200, body = ApprovalView), (status = 400, body = ErrorBody),
        (status = 403, body = ErrorBody), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn edit_and_approve(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<ApprovalId>,
    ApiJson(body): ApiJson<EditAndApproveBody>,
) -> Result<Json<ApprovalView>, ApiError> {
    let decided = state
        .engine
        .approve_edited(
            caller.project_id,
            id,
            Approver {
                key_id: Some(caller.key_id),
                member_id: caller.member_id,
                role: caller.role,
            },
            &body.arguments,
            &body.reason,
        )
        .await?;
    Ok(Json(decided.into()))
}

/// Denies this call: its run goes on without it (or fails, as its routine says).
#[utoipa::path(post, path = "/v1/approvals/{approval_id}/deny", tag = "approvals", security(("bearer" = [])),
    request_body = DecideBody,
    params(("approval_id" = String, Path, description = "an `apr_…` id", pattern = "^apr_[0-9a-f]{32}$")),
    responses((status = 200, body = ApprovalView), (status = 400, body = ErrorBody),
        (status = 403, body = ErrorBody), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn deny(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<ApprovalId>,
    ApiJson(body): ApiJson<DecideBody>,
) -> Result<Json<ApprovalView>, ApiError> {
    decide(state, caller, id, ApprovalAnswer::Deny, &body.reason).await
}

async fn decide(
    state: AppState,
    caller: Caller,
    id: ApprovalId,
    verdict: ApprovalAnswer,
    reason: &str,
) -> Result<Json<ApprovalView>, ApiError> {
    // The engine looks the approval up before any check: another project's is a 404.
    let decided = state
        .engine
        .decide_approval(
            caller.project_id,
            id,
            Approver {
                key_id: Some(caller.key_id),
                member_id: caller.member_id,
                role: caller.role,
            },
            verdict,
            reason,
        )
        .await?;
    Ok(Json(decided.into()))
}
