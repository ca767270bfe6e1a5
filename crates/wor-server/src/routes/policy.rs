//! The project's Cedar policy: read, replace (validated against the schema), reset.

use axum::Json;
use axum::extract::State;
use wor_core::audit::{Actor, AuditCategory, AuditEvent};
use wor_core::{ApiKeyId, ProjectId, Role};
use wor_policy::{DEFAULT_PROJECT_POLICY, PolicyEngine};

use crate::AppState;
use crate::auth::{Caller, Configurer};
use crate::error::{ApiError, ErrorBody};
use crate::extract::ApiJson;
use crate::views::rfc3339;

/// The largest policy text accepted.
const MAX_POLICY_BYTES: usize = 128 * 1024;

#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct PolicyView {
    /// The Cedar text in force for the project.
    pub text: String,
    /// True when the project uses the built-in default policy.
    pub is_default: bool,
    pub updated_by: Option<String>,
    pub updated_at: Option<String>,
}

#[derive(Debug, serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SetPolicyBody {
    /// Cedar policies (docs/policies.md); they replace the built-in default.
    pub text: String,
}

/// The policy in force for `project`: the API's and the console's one reading.
pub(crate) async fn current(state: &AppState, project: ProjectId) -> Result<PolicyView, ApiError> {
    Ok(match state.store.project_policy(project).await? {
        Some(policy) => PolicyView {
            text: policy.text,
            is_default: false,
            updated_by: policy.updated_by.map(|k| k.to_string()),
            updated_at: Some(rfc3339(policy.updated_at)),
        },
        None => PolicyView {
            text: DEFAULT_PROJECT_POLICY.to_owned(),
            is_default: true,
            updated_by: None,
            updated_at: None,
        },
    })
}

/// The project's policy (the built-in default until one is set).
#[utoipa::path(get, path = "/v1/policy", tag = "policy", security(("bearer" = [])),
    responses((status = 200, body = PolicyView)))]
pub async fn get(
    State(state): State<AppState>,
    caller: Caller,
) -> Result<Json<PolicyView>, ApiError> {
    Ok(Json(current(&state, caller.project_id).await?))
}

/// Replaces the project's policy; it is validated against the schema first, and an error names
/// the line.
#[utoipa::path(put, path = "/v1/policy", tag = "policy", security(("bearer" = [])),
    request_body = SetPolicyBody,
    responses((status = 200, body = PolicyView), (status = 400, body = ErrorBody), (status = 403, body = ErrorBody)))]
pub async fn set(
    State(state): State<AppState>,
    Configurer(caller): Configurer,
    ApiJson(body): ApiJson<SetPolicyBody>,
) -> Result<Json<PolicyView>, ApiError> {
    set_policy(
        &state,
        caller.project_id,
        caller.role,
        caller.actor(),
        Some(caller.key_id),
        Some(&body.text),
    )
    .await?;
    Ok(Json(current(&state, caller.project_id).await?))
}

/// Goes back to the built-in default policy.
#[utoipa::path(delete, path = "/v1/policy", tag = "policy", security(("bearer" = [])),
    responses((status = 200, body = PolicyView), (status = 403, body = ErrorBody)))]
pub async fn reset(
    State(state): State<AppState>,
    caller: Caller,
) -> Result<Json<PolicyView>, ApiError> {
    set_policy(
        &state,
        caller.project_id,
        caller.role,
        caller.actor(),
        Some(caller.key_id),
        None,
    )
    .await?;
    Ok(Json(current(&state, caller.project_id).await?))
}

/// Sets `project`'s policy to `text` (validated against the schema first; an error names the
/// line), or back to the built-in default with `None`, for a caller with `role`, audited as
/// `actor`: the API's and the console's one path.
pub(crate) async fn set_policy(
    state: &AppState,
    project: ProjectId,
    role: Role,
    actor: Actor,
    key: Option<ApiKeyId>,
    text: Option<&str>,
) -> Result<(), ApiError> {
    crate::auth::require_configure(role)?;
    if let Some(text) = text {
        if text.trim().is_empty() {
            return Err(ApiError::bad_request(
                "invalid_policy",
                "the policy is empty, which would deny every call (nothing would permit one); to go back to the built-in default, reset it (`DELETE /v1/policy`, `wor policy reset`)",
            ));
        }
        if text.len() > MAX_POLICY_BYTES {
            return Err(ApiError::bad_request(
                "invalid_policy",
                "the policy is larger than 128 KiB",
            ));
        }
        let built = PolicyEngine::builder()
            .project_policy(text.to_owned())
            .build()
            .map_err(|e| ApiError::bad_request("invalid_policy", e.to_string()))?;
        if built.policies_from(wor_policy::PolicySource::Project) == 0 {
            return Err(ApiError::bad_request(
                "invalid_policy",
                "the policy holds no statement, only comments, which would deny every call (nothing would permit one); to go back to the built-in default, reset it (`DELETE /v1/policy`, `wor policy reset`)",
            ));
        }
    }
    let recorded =
        AuditEvent::new(project, AuditCategory::PolicySet, actor).payload(serde_json::json!({
            "is_default": text.is_none(),
            "content_hash": text.map(|t| wor_core::canonical::sha256_hex(t.as_bytes())),
        }));
    let staged = state
        .store
        .set_project_policy(project, text, key, recorded)
        .await?;
    state.engine.append_staged_or_log([staged]).await;
    tracing::info!(category = "config", action = "policy.set", project_id = %project,
        is_default = text.is_none(), "project policy set");
    Ok(())
}
