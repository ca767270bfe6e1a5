//! Model connections: provider endpoints whose API keys live sealed in the vault.
//!
//! A key goes in through `POST` or `PUT …/api-key` and never comes out: responses say only
//! whether it is configured and when it changed (S3).

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use serde_json::json;
use wor_core::audit::{Actor, AuditCategory, AuditEvent};
use wor_core::model::{ProviderKind, ProviderKindParseError};
use wor_core::{ApiKeyId, ConnectionId, MemberId, ProjectId, Role};
use wor_store::{
    API_KEY_FIELD, MODEL_CONNECTIONS_TABLE, ModelConnectionRecord, NewModelConnection, SecretSlot,
};

use crate::AppState;
use crate::auth::{Caller, Configurer, require_configure};
use crate::error::{ApiError, ErrorBody};
use crate::extract::{ApiJson, ApiPath};
use crate::routes::members::check_name;
use crate::views::rfc3339;

/// The longest API key accepted; longer input is a mistake, not a key.
const MAX_API_KEY_LEN: usize = 8 * 1024;

#[derive(Debug, serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateModelConnection {
    pub name: String,
    /// `openai_compatible`, `anthropic`, `azure_openai` or `gemini`.
    pub provider: String,
    /// The provider's base URL, `https://…`; checked again by the egress guard on every call.
    pub base_url: String,
    /// The provider API key. Stored encrypted; never returned. Left out only for a local
    /// model server whose address the operator listed in the server configuration's
    /// `[egress] model_cidrs`.
    #[serde(default)]
    pub api_key: Option<String>,
}

#[derive(Debug, serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SetApiKey {
    /// The new provider API key. Stored encrypted; never returned.
    pub api_key: String,
}

/// What the API says about a secret-bearing field: never its value, masked or not.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct SecretFieldView {
    pub configured: bool,
    pub updated_at: Option<String>,
}

#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct ModelConnectionView {
    pub id: String,
    pub name: String,
    pub provider: String,
    pub base_url: String,
    pub owner_member_id: Option<String>,
    /// `active` or `revoked`.
    pub status: String,
    /// Rises each time the key is replaced; runs recheck it when they start.
    pub credential_version: i64,
    pub api_key: SecretFieldView,
    pub created_at: String,
    pub updated_at: String,
}

fn slot(project: ProjectId, id: ConnectionId) -> SecretSlot {
    SecretSlot::new(project, MODEL_CONNECTIONS_TABLE, id, API_KEY_FIELD)
}

async fn view(
    state: &AppState,
    record: ModelConnectionRecord,
) -> Result<ModelConnectionView, ApiError> {
    let secret = state
        .vault
        .metadata(&slot(record.project_id, record.id))
        .await?;
    Ok(ModelConnectionView {
        id: record.id.to_string(),
        name: record.name,
        provider: record.provider.to_string(),
        base_url: record.base_url,
        owner_member_id: record.owner_member_id.map(|m| m.to_string()),
        status: match record.status {
            wor_store::ConnectionStatus::Active => "active".to_owned(),
            wor_store::ConnectionStatus::Revoked => "revoked".to_owned(),
        },
        credential_version: record.credential_version,
        api_key: SecretFieldView {
            configured: secret.is_some(),
            updated_at: secret.map(|s| rfc3339(s.updated_at)),
        },
        created_at: rfc3339(record.created_at),
        updated_at: rfc3339(record.updated_at),
    })
}

fn check_api_key(key: &str) -> Result<(), ApiError> {
    if key.trim().is_empty() || key.len() > MAX_API_KEY_LEN || key.chars().any(char::is_control) {
        return Err(ApiError::bad_request(
            "invalid_api_key",
            "api_key must be 1 to 8192 printable characters",
        ));
    }
    Ok(())
}

/// A base URL carries nothing but where the provider is: the key goes in `api_key`, sealed.
/// Its query may only choose Azure OpenAI's API version (`?api-version=…`, the provider's one
/// use of it, in the shape of a version: `wor_core::model::is_azure_api_version`); any other
/// query, or a fragment, could carry a credential, which would then be stored, shown and
/// audited as plain text.
fn check_base_url(url: &str, provider: ProviderKind) -> Result<(), ApiError> {
    let refused = |message: String| ApiError::bad_request("invalid_base_url", message);
    let parsed = wor_egress::EgressUrl::parse(url)
        .map_err(|refusal| refused(format!("base_url: {refusal}")))?;
    // Where a key goes instead of a query or a fragment.
    const SEALED: &str = "an API key goes in `api_key`, where it is sealed";
    if parsed.as_url().fragment().is_some() {
        return Err(refused(format!(
            "base_url: a fragment is not accepted; {SEALED}"
        )));
    }
    if let Some(query) = parsed.as_url().query() {
        let azure = provider == ProviderKind::AzureOpenai;
        let versions_only = azure
            && query.split('&').all(|pair| {
                pair.split_once('=').is_some_and(|(name, value)| {
                    name == "api-version" && wor_core::model::is_azure_api_version(value)
                })
            });
        if !versions_only {
            let but = if azure {
                " other than `api-version=` and a version (`YYYY-MM-DD`, optionally `-preview`, `preview` or `latest`)"
            } else {
                ""
            };
            return Err(refused(format!(
                "base_url: a query{but} is not accepted; {SEALED}"
            )));
        }
    }
    Ok(())
}

/// Lists the project's model connections.
#[utoipa::path(get, path = "/v1/model-connections", tag = "model-connections", security(("bearer" = [])),
    responses((status = 200, body = [ModelConnectionView]), (status = 401, body = ErrorBody)))]
pub async fn list(
    State(state): State<AppState>,
    caller: Caller,
) -> Result<Json<Vec<ModelConnectionView>>, ApiError> {
    let mut views = Vec::new();
    for record in state
        .store
        .list_model_connections(caller.project_id)
        .await?
    {
        views.push(view(&state, record).await?);
    }
    Ok(Json(views))
}

/// Adds a model connection; its API key is sealed at once and never returned.
#[utoipa::path(post, path = "/v1/model-connections", tag = "model-connections", security(("bearer" = [])),
    request_body = CreateModelConnection,
    responses((status = 201, body = ModelConnectionView), (status = 400, body = ErrorBody),
        (status = 403, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn create(
    State(state): State<AppState>,
    Configurer(caller): Configurer,
    ApiJson(body): ApiJson<CreateModelConnection>,
) -> Result<(StatusCode, Json<ModelConnectionView>), ApiError> {
    let record = create_model_connection(
        &state,
        caller.project_id,
        caller.role,
        caller.member_id,
        Some(caller.key_id),
        caller.actor(),
        body,
    )
    .await?;
    Ok((StatusCode::CREATED, Json(view(&state, record).await?)))
}

/// Adds a model connection for a caller of `role` (the member `member`, through the key
/// `created_by` when a key was used): the API's and the console's one path. The key is sealed
/// at once and never returned.
pub(crate) async fn create_model_connection(
    state: &AppState,
    project: ProjectId,
    role: Role,
    member: Option<MemberId>,
    created_by: Option<ApiKeyId>,
    actor: Actor,
    body: CreateModelConnection,
) -> Result<ModelConnectionRecord, ApiError> {
    require_configure(role)?;
    check_name(&body.name, "connection")?;
    let provider: ProviderKind = body.provider.parse().map_err(|e: ProviderKindParseError| {
        ApiError::bad_request("invalid_provider", e.to_string())
    })?;
    if !provider.needs_connection() {
        return Err(ApiError::bad_request(
            "invalid_provider",
            format!("provider `{provider}` takes no model connection"),
        ));
    }
    check_base_url(&body.base_url, provider)?;
    match &body.api_key {
        Some(key) => {
            check_api_key(key)?;
            state
                .engine
                .vet_model_url(&body.base_url)
                .map_err(|denial| {
                    ApiError::bad_request("invalid_base_url", format!("base_url: {denial}"))
                })?;
        }
        None => state
            .engine
            .vet_keyless_model_url(&body.base_url)
            .await
            .map_err(|refusal| ApiError::bad_request("api_key_required", refusal.to_string()))?,
    }
    // The key is sealed before anything is written, and written with the connection and its
    // staged entry: a crash leaves the connection with its key and its entry, or nothing.
    let id = ConnectionId::new();
    let key = body
        .api_key
        .as_deref()
        .map(|key| state.vault.seal_put(&slot(project, id), key))
        .transpose()?;
    let entry = |record: &ModelConnectionRecord| {
        AuditEvent::new(project, AuditCategory::ModelConnectionCreate, actor.clone())
            .subject("connection_id", record.id)
            .payload(json!({ "name": record.name, "provider": record.provider, "base_url": record.base_url }))
    };
    let (record, staged) = state
        .store
        .create_model_connection_staged(
            project,
            id,
            NewModelConnection {
                name: body.name,
                provider,
                base_url: body.base_url,
                owner_member_id: member,
                created_by,
            },
            key.as_ref(),
            Some(&entry),
        )
        .await?;
    state.engine.append_staged_or_log(staged).await;
    tracing::info!(category = "config", action = "model_connection.create", project_id = %project,
        connection_id = %record.id, "model connection created");
    Ok(record)
}

/// One model connection.
#[utoipa::path(get, path = "/v1/model-connections/{connection_id}", tag = "model-connections",
    security(("bearer" = [])),
    params(("connection_id" = String, Path, description = "a `con_…` id", pattern = "^con_[0-9a-f]{32}$")),
    responses((status = 200, body = ModelConnectionView), (status = 404, body = ErrorBody)))]
pub async fn get(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<ConnectionId>,
) -> Result<Json<ModelConnectionView>, ApiError> {
    let record = state
        .store
        .get_model_connection(caller.project_id, id)
        .await?;
    Ok(Json(view(&state, record).await?))
}

/// Replaces the API key; the credential version rises by one.
#[utoipa::path(put, path = "/v1/model-connections/{connection_id}/api-key", tag = "model-connections",
    security(("bearer" = [])), request_body = SetApiKey,
    params(("connection_id" = String, Path, description = "a `con_…` id", pattern = "^con_[0-9a-f]{32}$")),
    responses((status = 200, body = ModelConnectionView), (status = 400, body = ErrorBody),
        (status = 403, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody)))]
pub async fn set_api_key(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<ConnectionId>,
    ApiJson(body): ApiJson<SetApiKey>,
) -> Result<Json<ModelConnectionView>, ApiError> {
    let record = replace_model_key(
        &state,
        caller.project_id,
        caller.role,
        caller.actor(),
        id,
        &body.api_key,
    )
    .await?;
    Ok(Json(view(&state, record).await?))
}

/// Replaces connection `id`'s key for a caller of `role`, sealing the new one and raising the
/// credential version: the API's and the console's one path. Another project's connection is
/// a 404, before the role check; a revoked one is a 409.
pub(crate) async fn replace_model_key(
    state: &AppState,
    project: ProjectId,
    role: Role,
    actor: Actor,
    id: ConnectionId,
    api_key: &str,
) -> Result<ModelConnectionRecord, ApiError> {
    let record = state.store.get_model_connection(project, id).await?;
    require_configure(role)?;
    check_api_key(api_key)?;
    if record.status == wor_store::ConnectionStatus::Revoked {
        return Err(ApiError::Conflict(format!(
            "model connection `{id}` is revoked"
        )));
    }
    let key = state
        .vault
        .seal_put(&slot(record.project_id, record.id), api_key)?;
    // The key is written, and its entry staged, with the new credential version: a crash
    // leaves all three or none of them.
    let recorded = |version: i64| {
        AuditEvent::new(project, AuditCategory::ModelConnectionSetKey, actor.clone())
            .subject("connection_id", id)
            .payload(json!({ "credential_version": version }))
    };
    let (record, staged) = state
        .store
        .bump_model_credential_version(project, id, &key, &recorded)
        .await?;
    state.engine.append_staged_or_log([staged]).await;
    tracing::info!(category = "config", action = "model_connection.set_key", project_id = %project,
        connection_id = %id, credential_version = record.credential_version,
        "model connection key replaced");
    Ok(record)
}

/// Revokes the connection and deletes its key; runs using it fail closed.
#[utoipa::path(post, path = "/v1/model-connections/{connection_id}/revoke", tag = "model-connections",
    security(("bearer" = [])),
    params(("connection_id" = String, Path, description = "a `con_…` id", pattern = "^con_[0-9a-f]{32}$")),
    responses((status = 200, body = ModelConnectionView), (status = 404, body = ErrorBody)))]
pub async fn revoke(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<ConnectionId>,
) -> Result<Json<ModelConnectionView>, ApiError> {
    let record =
        revoke_model_connection(&state, caller.project_id, caller.role, caller.actor(), id).await?;
    Ok(Json(view(&state, record).await?))
}

/// Revokes connection `id` for a caller of `role` and deletes its key: the API's and the
/// console's one path. Another project's connection is a 404, before the role check.
pub(crate) async fn revoke_model_connection(
    state: &AppState,
    project: ProjectId,
    role: Role,
    actor: Actor,
    id: ConnectionId,
) -> Result<ModelConnectionRecord, ApiError> {
    let record = state.store.get_model_connection(project, id).await?;
    require_configure(role)?;
    let recorded = AuditEvent::new(project, AuditCategory::ModelConnectionRevoke, actor)
        .subject("connection_id", id);
    let (record, staged) = state
        .store
        .revoke_model_connection(project, record.id, recorded)
        .await?;
    state.engine.append_staged_or_log(staged).await;
    state
        .vault
        .delete(&slot(record.project_id, record.id))
        .await?;
    tracing::info!(category = "config", action = "model_connection.revoke", project_id = %project,
        connection_id = %id, "model connection revoked");
    Ok(record)
}
