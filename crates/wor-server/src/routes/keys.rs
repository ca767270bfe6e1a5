//! API keys of the caller's project: created and shown once, listed by prefix, revoked.

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use serde_json::json;
use wor_core::audit::{Actor, AuditCategory, AuditEvent};
use wor_core::{ApiKeyId, MemberId, ProjectId, Role};
use wor_store::{ApiKeyKind, NewApiKey};

use crate::AppState;
use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::extract::{ApiJson, ApiPath};
use crate::routes::members::{check_name, parse_role};
use crate::views::{ApiKeyView, CreatedApiKey};

#[derive(Debug, serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateApiKey {
    pub name: String,
    /// One of `owner`, `admin`, `approver`, `viewer`; never above the caller's own role.
    pub role: String,
    /// A service key has a role and no person (for automation) and can never approve. A
    /// personal key (the default) belongs to the calling member.
    #[serde(default)]
    pub service: bool,
}

/// Lists the project's keys: metadata and prefix only.
#[utoipa::path(get, path = "/v1/keys", tag = "keys", security(("bearer" = [])),
    responses((status = 200, body = [ApiKeyView]), (status = 401, body = ErrorBody)))]
pub async fn list_keys(
    State(state): State<AppState>,
    caller: Caller,
) -> Result<Json<Vec<ApiKeyView>>, ApiError> {
    let keys = state.store.list_api_keys(caller.project_id).await?;
    Ok(Json(keys.into_iter().map(Into::into).collect()))
}

/// Creates a key and returns it once.
#[utoipa::path(post, path = "/v1/keys", tag = "keys", security(("bearer" = [])),
    request_body = CreateApiKey,
    responses((status = 201, body = CreatedApiKey), (status = 400, body = ErrorBody),
        (status = 403, body = ErrorBody)))]
pub async fn create_key(
    State(state): State<AppState>,
    caller: Caller,
    ApiJson(body): ApiJson<CreateApiKey>,
) -> Result<(StatusCode, Json<CreatedApiKey>), ApiError> {
    let created = create_api_key(
        &state,
        caller.project_id,
        caller.role,
        caller.member_id,
        caller.actor(),
        Some(caller.key_id),
        &body,
    )
    .await?;
    Ok((StatusCode::CREATED, Json(created)))
}

/// Creates a key for a caller with `caller_role` (and `member`, for a personal key) in
/// `project`, audited as `actor`, and returns it once: the API's and the console's one path.
/// A service key needs an admin and a role they could grant; a personal key never exceeds
/// the caller's role.
pub(crate) async fn create_api_key(
    state: &AppState,
    project: ProjectId,
    caller_role: Role,
    member: Option<MemberId>,
    actor: Actor,
    created_by: Option<ApiKeyId>,
    body: &CreateApiKey,
) -> Result<CreatedApiKey, ApiError> {
    check_name(&body.name, "key")?;
    let role = parse_role(&body.role)?;
    let kind = if body.service {
        crate::auth::require_configure(caller_role)?;
        if !caller_role.can_grant(role) {
            return Err(ApiError::Forbidden(format!(
                "role `{}` cannot grant role `{role}`",
                caller_role
            )));
        }
        ApiKeyKind::Service
    } else {
        let member = member.ok_or_else(|| {
            ApiError::Forbidden(
                "a service key cannot create a personal key; use a member's key".to_owned(),
            )
        })?;
        if !caller_role.includes(role) {
            return Err(ApiError::Forbidden(format!(
                "a key with role `{}` cannot create a key with role `{role}`",
                caller_role
            )));
        }
        ApiKeyKind::Personal(member)
    };
    // The entry is staged with the key: a crash before it is appended leaves it for the audit
    // writer's sweep, never a key without its entry.
    let entry = |record: &wor_store::ApiKeyRecord| key_created(record, actor.clone());
    let (record, key, staged) = state
        .store
        .create_api_key_staged(
            project,
            NewApiKey {
                name: body.name.clone(),
                role,
                kind,
                created_by,
            },
            Some(&entry),
        )
        .await?;
    state.engine.append_staged_or_log(staged).await;
    tracing::info!(category = "config", action = "key.create", project_id = %project,
        key_id = %record.id, "api key created");
    Ok(CreatedApiKey {
        key: record.into(),
        api_key: key.expose().to_owned(),
    })
}

/// One key's metadata.
#[utoipa::path(get, path = "/v1/keys/{key_id}", tag = "keys", security(("bearer" = [])),
    params(("key_id" = String, Path, description = "a `key_…` id", pattern = "^key_[0-9a-f]{32}$")),
    responses((status = 200, body = ApiKeyView), (status = 404, body = ErrorBody)))]
pub async fn get_key(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(key_id): ApiPath<ApiKeyId>,
) -> Result<Json<ApiKeyView>, ApiError> {
    Ok(Json(
        state
            .store
            .get_api_key(caller.project_id, key_id)
            .await?
            .into(),
    ))
}

/// Revokes a key at once. Admins and owners may revoke any key; a member their own. The last
/// live owner key of the project's owners cannot be revoked (409 `last_owner_key`).
#[utoipa::path(delete, path = "/v1/keys/{key_id}", tag = "keys", security(("bearer" = [])),
    params(("key_id" = String, Path, description = "a `key_…` id", pattern = "^key_[0-9a-f]{32}$")),
    responses((status = 200, body = ApiKeyView), (status = 403, body = ErrorBody),
        (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn revoke_key(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(key_id): ApiPath<ApiKeyId>,
) -> Result<Json<ApiKeyView>, ApiError> {
    let revoked = revoke_api_key(
        &state,
        caller.project_id,
        caller.role,
        caller.member_id,
        caller.actor(),
        key_id,
    )
    .await?;
    Ok(Json(revoked.into()))
}

/// Revokes `key_id` for a caller of `role` (the member `member`, if a person) in `project`: the
/// API's and the console's one path. A key of another project is a 404; a key not the
/// caller's own needs `admin` or `owner`; revoking a revoked key records nothing.
pub(crate) async fn revoke_api_key(
    state: &AppState,
    project: ProjectId,
    role: Role,
    member: Option<MemberId>,
    actor: Actor,
    key_id: ApiKeyId,
) -> Result<wor_store::ApiKeyRecord, ApiError> {
    // Looked up first, inside the caller's project: a foreign key is a 404, not a 403.
    let key = state.store.get_api_key(project, key_id).await?;
    let own_key = key.member_id.is_some() && key.member_id == member;
    if !own_key {
        crate::auth::require_configure(role)?;
    }
    // The entry is staged with the revocation. Revoking a revoked key changes nothing and
    // records nothing: the store decides, in the transaction that would revoke it.
    let recorded = |revoked: &wor_store::ApiKeyRecord| {
        AuditEvent::new(project, AuditCategory::KeyRevoke, actor.clone())
            .subject("key_id", key_id)
            .payload(json!({ "name": revoked.name, "own_key": own_key }))
    };
    let (revoked, staged) = state
        .store
        .revoke_api_key_staged(project, key_id, Some(&recorded))
        .await?;
    state.engine.append_staged_or_log(staged).await;
    tracing::info!(category = "config", action = "key.revoke", project_id = %project,
        key_id = %key_id, "api key revoked");
    Ok(revoked)
}

/// The `key.create` entry of `record`, made by `actor`.
pub(crate) fn key_created(record: &wor_store::ApiKeyRecord, actor: Actor) -> AuditEvent {
    let event = AuditEvent::new(record.project_id, AuditCategory::KeyCreate, actor)
        .subject("key_id", record.id)
        .payload(json!({ "name": record.name, "role": record.role, "service": record.service }));
    match record.member_id {
        Some(member) => event.subject("member_id", member),
        None => event,
    }
}
