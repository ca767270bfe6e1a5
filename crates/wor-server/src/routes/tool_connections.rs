//! Tool connections: MCP servers and HTTP APIs, reviewed by an admin before any tool runs (S5)
//! and pinned by hash (S9).
//!
//! Credentials go in with `POST` and never come out: responses say only, per header, whether
//! it is configured and when it changed (S3). `review` lists the live tools through the egress
//! client; `enable` pins exactly the set of hashes the admin reviewed, or nothing.

use std::collections::BTreeMap;

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use secrecy::{ExposeSecret, SecretString};
use wor_core::ConnectionId;
use wor_core::audit::{AuditCategory, AuditEvent};
use wor_engine::{
    BEARER_TOKEN_FIELD, HttpToolsSource, LocalCommandRules, OpenApiSource, ReviewDiff,
    ReviewedTool, ToolConnectionSpec, credential_slot,
};
use wor_store::{ToolConnectionKind, ToolConnectionRecord, header_field};

use crate::AppState;
use crate::auth::{Caller, Configurer};
use crate::error::{ApiError, ErrorBody};
use crate::extract::{ApiJson, ApiPath};
use crate::routes::model_connections::SecretFieldView;
use crate::views::rfc3339;

#[derive(Debug, serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateToolConnection {
    /// 1 to 40 of `a-z`, `0-9`, `-` and `_`, starting with a letter: rosters name tools as
    /// `CONNECTION/TOOL`.
    pub name: String,
    /// `mcp_http`, `mcp_stdio` (a server started in the sandbox), `http_api` or `wasm` (a
    /// WebAssembly component, `docs/tools.md`).
    pub kind: String,
    /// The MCP endpoint or API base URL; checked again by the egress guard on every request.
    /// Not used by `mcp_stdio` and `wasm`.
    #[serde(default)]
    pub url: String,
    /// Host patterns the connection may reach (`api.example.com`, `*.example.com`, `host:port`);
    /// for `mcp_stdio`, the only hosts its sandbox may reach (through the egress proxy); for
    /// `wasm`, the only hosts its outgoing HTTP may reach (none when empty).
    #[serde(default)]
    pub allowlist: Vec<String>,
    /// `mcp_stdio` and `wasm` only: how its server starts in the sandbox, or which component
    /// file (`program`) runs with which read-only directories. The program and read-only paths
    /// must lie where the operator allows (`[sandbox] allowed_paths`).
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub command: Option<wor_store::StdioSpec>,
    /// `mcp_stdio` and `wasm` only: the server's or component's whole environment, by name. Stored encrypted; never
    /// returned. (`command.env_names` is filled from these keys.)
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// `http_api` only: its tools, each `{name, description, method, path, inputSchema}`; the
    /// path template's `{params}` must be properties of the input schema. Not with `openapi`.
    #[serde(default)]
    #[schema(value_type = Vec<Object>)]
    pub tools: Vec<serde_json::Value>,
    /// `http_api` only: tools imported from an OpenAPI 3.0/3.1 document instead of `tools`
    /// (`docs/tools.md`). Without `url`, the document's first server must be absolute.
    #[serde(default)]
    pub openapi: Option<OpenApiImportBody>,
    /// Sent as `Authorization: Bearer …`. Stored encrypted; never returned.
    #[serde(default)]
    pub bearer_token: Option<String>,
    /// Secret headers by name (`x-api-key`). Stored encrypted; never returned.
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
}

/// Operations of an OpenAPI document to import as HTTP tools.
#[derive(Debug, serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct OpenApiImportBody {
    /// The OpenAPI 3.0 or 3.1 document, as JSON. Local `$ref`s are inlined; remote ones are
    /// refused, never fetched.
    #[schema(value_type = Object)]
    pub document: serde_json::Value,
    /// The `operationId`s to import (each becomes a tool named in snake case); all when empty.
    #[serde(default)]
    pub operations: Vec<String>,
    /// A secret per security scheme of the document, by scheme name: an `apiKey` in a header
    /// becomes that secret header; `http` bearer, `oauth2` and `openIdConnect` the bearer
    /// token. Stored encrypted; never returned.
    #[serde(default)]
    pub credentials: BTreeMap<String, String>,
}

/// New tools for an `http_api` connection: `tools` or `openapi`, as when it was created.
#[derive(Debug, serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReplaceTools {
    #[serde(default)]
    #[schema(value_type = Vec<Object>)]
    pub tools: Vec<serde_json::Value>,
    /// Without `credentials`: the connection keeps the ones it has.
    #[serde(default)]
    pub openapi: Option<OpenApiImportBody>,
}

#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct ReplacedToolsView {
    pub connection: ToolConnectionView,
    /// The difference from the pins; `null` when nothing is pinned.
    pub diff: Option<ReviewDiffView>,
    /// Whether a changed or new tool quarantined the connection.
    pub quarantined: bool,
}

fn secret(value: String) -> SecretString {
    SecretString::from(value)
}

fn tools_source(
    tools: Vec<serde_json::Value>,
    openapi: Option<OpenApiImportBody>,
) -> Result<HttpToolsSource, ApiError> {
    match (tools.is_empty(), openapi) {
        (true, None) => Ok(HttpToolsSource::None),
        (false, None) => Ok(HttpToolsSource::Written(tools)),
        (true, Some(openapi)) => Ok(HttpToolsSource::OpenApi(OpenApiSource {
            document: openapi.document,
            operations: openapi.operations,
            credentials: openapi
                .credentials
                .into_iter()
                .map(|(k, v)| (k, secret(v)))
                .collect(),
        })),
        (false, Some(_)) => Err(ApiError::bad_request(
            "invalid_tools",
            "give `tools` or `openapi`, not both",
        )),
    }
}

#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct ToolConnectionView {
    pub id: String,
    pub name: String,
    pub kind: String,
    pub url: String,
    pub allowlist: Vec<String>,
    /// `mcp_stdio` and `wasm` only: how it starts (environment names only).
    #[schema(value_type = Option<Object>)]
    pub command: Option<wor_store::StdioSpec>,
    /// `pending_review`, `enabled`, `quarantined` or `disabled`.
    pub status: String,
    /// Tool name to `read_only` or `consequential`, set when the connection is enabled.
    #[schema(value_type = Object)]
    pub tool_classification: serde_json::Value,
    /// Tool name to its pinned hash.
    pub pinned_tools: BTreeMap<String, String>,
    /// Credential headers (`authorization` for the bearer token): configured or not, never
    /// the value.
    pub credentials: BTreeMap<String, SecretFieldView>,
    pub created_at: String,
    pub updated_at: String,
}

#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct ReviewedToolView {
    pub name: String,
    pub description: Option<String>,
    #[schema(value_type = Object)]
    pub input_schema: serde_json::Value,
    /// The server's hints: for display, never trusted for decisions.
    #[schema(value_type = Object)]
    pub annotations: Option<serde_json::Value>,
    /// What `enable` pins.
    pub hash: String,
}

#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct ReviewDiffView {
    pub changed: Vec<String>,
    pub added: Vec<String>,
    pub removed: Vec<String>,
    pub duplicated: Vec<String>,
    /// The readable diff, path by path.
    pub text: String,
}

#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct ToolReviewView {
    pub connection: ToolConnectionView,
    /// The live tools, as the server lists them now.
    pub tools: Vec<ReviewedToolView>,
    /// The difference from the pins; `null` before the first enable.
    pub diff: Option<ReviewDiffView>,
}

#[derive(Debug, serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct EnableToolConnection {
    /// Tool name to the hash shown by `review`: exactly the tools to pin. If the live list
    /// differs in any way, nothing is pinned.
    pub tools: BTreeMap<String, String>,
    /// Tools the admin classifies read-only; every other tool is consequential unless
    /// classified open-world.
    #[serde(default)]
    pub read_only: Vec<String>,
    /// Tools the admin classifies open-world: reads that contact destinations their arguments
    /// name (URLs, hosts, addresses, channels). A tool's `openWorldHint` only suggests it.
    #[serde(default)]
    pub open_world: Vec<String>,
}

async fn view(
    state: &AppState,
    record: ToolConnectionRecord,
) -> Result<ToolConnectionView, ApiError> {
    let mut credentials = BTreeMap::new();
    let mut fields = vec![("authorization".to_owned(), BEARER_TOKEN_FIELD.to_owned())];
    fields.extend(
        record
            .secret_headers
            .iter()
            .map(|h| (h.clone(), header_field(h))),
    );
    if let Some(command) = &record.command {
        fields.extend(
            command
                .env_names
                .iter()
                .map(|n| (format!("env:{n}"), wor_store::env_field(n))),
        );
    }
    for (name, field) in fields {
        if let Some(secret) = state
            .vault
            .metadata(&credential_slot(record.project_id, record.id, field))
            .await?
        {
            credentials.insert(
                name,
                SecretFieldView {
                    configured: true,
                    updated_at: Some(rfc3339(secret.updated_at)),
                },
            );
        }
    }
    Ok(ToolConnectionView {
        id: record.id.to_string(),
        name: record.name,
        kind: record.kind.to_string(),
        command: record.command.clone(),
        url: record.url,
        allowlist: record.allowlist,
        status: record.status.to_string(),
        tool_classification: serde_json::to_value(&record.tool_classification)
            .map_err(|_| ApiError::Internal)?,
        pinned_tools: record
            .pinned_tools
            .into_iter()
            .map(|(name, pin)| (name, pin.hash))
            .collect(),
        credentials,
        created_at: rfc3339(record.created_at),
        updated_at: rfc3339(record.updated_at),
    })
}

/// Lists the project's tool connections.
#[utoipa::path(get, path = "/v1/tool-connections", tag = "tool-connections", security(("bearer" = [])),
    responses((status = 200, body = [ToolConnectionView]), (status = 401, body = ErrorBody)))]
pub async fn list(
    State(state): State<AppState>,
    caller: Caller,
) -> Result<Json<Vec<ToolConnectionView>>, ApiError> {
    let mut views = Vec::new();
    for record in state.store.list_tool_connections(caller.project_id).await? {
        views.push(view(&state, record).await?);
    }
    Ok(Json(views))
}

/// Adds a tool connection, `pending_review`; its credentials are sealed at once.
#[utoipa::path(post, path = "/v1/tool-connections", tag = "tool-connections", security(("bearer" = [])),
    request_body = CreateToolConnection,
    responses((status = 201, body = ToolConnectionView), (status = 400, body = ErrorBody),
        (status = 403, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn create(
    State(state): State<AppState>,
    Configurer(caller): Configurer,
    ApiJson(body): ApiJson<CreateToolConnection>,
) -> Result<(StatusCode, Json<ToolConnectionView>), ApiError> {
    let config = state.engine.config();
    let spec = ToolConnectionSpec {
        name: body.name,
        kind: body.kind,
        url: body.url,
        allowlist: body.allowlist,
        command: body.command,
        env: body.env.into_iter().map(|(k, v)| (k, secret(v))).collect(),
        tools: tools_source(body.tools, body.openapi)?,
        bearer_token: body.bearer_token.map(secret),
        headers: body
            .headers
            .into_iter()
            .map(|(k, v)| (k, secret(v)))
            .collect(),
    };
    let checked = spec.validate(LocalCommandRules {
        allowed_roots: &config.stdio_allowed_roots,
        protected: &config.protected_paths,
    })?;
    let mut new = checked.connection;
    new.created_by = Some(caller.key_id);
    let project = caller.project_id;
    // The credentials are sealed before anything is written, and written with the connection
    // and its staged entry: a crash leaves the connection with its credentials and its entry, or
    // nothing.
    let id = ConnectionId::new();
    let credentials = checked
        .secrets
        .iter()
        .map(|(field, value)| {
            state.vault.seal_put(
                &credential_slot(project, id, field.clone()),
                value.expose_secret(),
            )
        })
        .collect::<Result<Vec<_>, _>>()?;
    let entry = |record: &wor_store::ToolConnectionRecord| {
        AuditEvent::new(project, AuditCategory::ToolConnectionCreate, caller.actor())
            .subject("connection_id", record.id)
            .payload(serde_json::json!({
                "name": record.name, "kind": record.kind, "url": record.url,
                "allowlist": record.allowlist, "credential_headers": record.secret_headers,
                "bearer_token": checked.has_bearer_token, "command": record.command,
                "openapi_operations": checked.imported_operations,
            }))
    };
    let (record, staged) = state
        .store
        .create_tool_connection_staged(project, id, new, &credentials, Some(&entry))
        .await?;
    state.engine.append_staged_or_log(staged).await;
    tracing::info!(category = "config", action = "connection.create", project_id = %caller.project_id,
        connection_id = %record.id, actor_key_id = %caller.key_id, "tool connection created");
    Ok((StatusCode::CREATED, Json(view(&state, record).await?)))
}

/// One tool connection.
#[utoipa::path(get, path = "/v1/tool-connections/{tool_connection_id}", tag = "tool-connections",
    security(("bearer" = [])),
    params(("tool_connection_id" = String, Path, description = "a `con_…` id", pattern = "^con_[0-9a-f]{32}$")),
    responses((status = 200, body = ToolConnectionView), (status = 404, body = ErrorBody)))]
pub async fn get(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<ConnectionId>,
) -> Result<Json<ToolConnectionView>, ApiError> {
    let record = state
        .store
        .get_tool_connection(caller.project_id, id)
        .await?;
    Ok(Json(view(&state, record).await?))
}

fn tool_view(tool: ReviewedTool) -> ReviewedToolView {
    ReviewedToolView {
        name: tool.name,
        description: tool.description,
        input_schema: tool.input_schema,
        annotations: tool.annotations,
        hash: tool.hash,
    }
}

fn diff_view(diff: ReviewDiff) -> ReviewDiffView {
    ReviewDiffView {
        changed: diff.changed,
        added: diff.added,
        removed: diff.removed,
        duplicated: diff.duplicated,
        text: diff.text,
    }
}

/// Connects through the egress client and shows the live tools, with the diff against the
/// pins if there are any. Changes nothing.
#[utoipa::path(get, path = "/v1/tool-connections/{tool_connection_id}/review", tag = "tool-connections",
    security(("bearer" = [])),
    params(("tool_connection_id" = String, Path, description = "a `con_…` id", pattern = "^con_[0-9a-f]{32}$")),
    responses((status = 200, body = ToolReviewView), (status = 403, body = ErrorBody),
        (status = 404, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn review(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<ConnectionId>,
) -> Result<Json<ToolReviewView>, ApiError> {
    state
        .store
        .get_tool_connection(caller.project_id, id)
        .await?;
    caller.require_configure()?;
    let review = state
        .engine
        .review_tool_connection(caller.project_id, id)
        .await?;
    Ok(Json(ToolReviewView {
        connection: view(&state, review.connection).await?,
        tools: review.tools.into_iter().map(tool_view).collect(),
        diff: review.diff.map(diff_view),
    }))
}

/// Pins exactly the reviewed tools (by hash), classifies them, and enables the connection.
/// Refused with 409 if the live list changed since the review.
#[utoipa::path(post, path = "/v1/tool-connections/{tool_connection_id}/enable", tag = "tool-connections",
    security(("bearer" = [])), request_body = EnableToolConnection,
    params(("tool_connection_id" = String, Path, description = "a `con_…` id", pattern = "^con_[0-9a-f]{32}$")),
    responses((status = 200, body = ToolConnectionView), (status = 400, body = ErrorBody),
        (status = 403, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn enable(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<ConnectionId>,
    ApiJson(body): ApiJson<EnableToolConnection>,
) -> Result<Json<ToolConnectionView>, ApiError> {
    let record = enable_connection(
        &state,
        caller.project_id,
        caller.role,
        caller.actor(),
        id,
        &body,
    )
    .await?;
    tracing::info!(category = "config", action = "connection.enable", project_id = %caller.project_id,
        connection_id = %id, actor_key_id = %caller.key_id, tools = record.pinned_tools.len(),
        "tool connection enabled");
    Ok(Json(view(&state, record).await?))
}

/// Pins exactly `body.tools`, classifies them and enables connection `id` of `project`, for a
/// caller with `role`, audited as `actor`: the API's and the console's one path. Another
/// project's connection is not found, before the role check.
pub(crate) async fn enable_connection(
    state: &AppState,
    project: wor_core::ProjectId,
    role: wor_core::Role,
    actor: wor_core::audit::Actor,
    id: ConnectionId,
    body: &EnableToolConnection,
) -> Result<ToolConnectionRecord, ApiError> {
    let before = state.store.get_tool_connection(project, id).await?;
    crate::auth::require_configure(role)?;
    let recorded = AuditEvent::new(project, AuditCategory::ToolConnectionEnable, actor)
        .subject("connection_id", id)
        .payload(serde_json::json!({
            "previous_status": before.status,
            "pinned": body.tools,
            "read_only": body.read_only,
            "open_world": body.open_world,
        }));
    let record = state
        .engine
        .enable_tool_connection(
            project,
            id,
            &body.tools,
            &body.read_only,
            &body.open_world,
            recorded,
        )
        .await?;
    Ok(record)
}

/// Disables the connection: runs that need it fail closed. Its pins are kept.
#[utoipa::path(post, path = "/v1/tool-connections/{tool_connection_id}/disable", tag = "tool-connections",
    security(("bearer" = [])),
    params(("tool_connection_id" = String, Path, description = "a `con_…` id", pattern = "^con_[0-9a-f]{32}$")),
    responses((status = 200, body = ToolConnectionView), (status = 403, body = ErrorBody),
        (status = 404, body = ErrorBody)))]
pub async fn disable(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<ConnectionId>,
) -> Result<Json<ToolConnectionView>, ApiError> {
    state
        .store
        .get_tool_connection(caller.project_id, id)
        .await?;
    caller.require_configure()?;
    let recorded = AuditEvent::new(
        caller.project_id,
        AuditCategory::ToolConnectionDisable,
        caller.actor(),
    )
    .subject("connection_id", id);
    let (record, staged) = state
        .store
        .disable_tool_connection_staged(caller.project_id, id, recorded)
        .await?;
    state.engine.append_staged_or_log(staged).await;
    tracing::info!(category = "config", action = "connection.disable", project_id = %caller.project_id,
        connection_id = %id, actor_key_id = %caller.key_id, "tool connection disabled");
    Ok(Json(view(&state, record).await?))
}

/// Replaces an `http_api` connection's tools: written again, or imported again from a changed
/// document. Nothing is pinned; an enabled connection whose tools changed or grew is
/// quarantined at once until an admin reviews the diff and enables it again.
#[utoipa::path(put, path = "/v1/tool-connections/{tool_connection_id}/tools", tag = "tool-connections",
    security(("bearer" = [])), request_body = ReplaceTools,
    params(("tool_connection_id" = String, Path, description = "a `con_…` id", pattern = "^con_[0-9a-f]{32}$")),
    responses((status = 200, body = ReplacedToolsView), (status = 400, body = ErrorBody),
        (status = 403, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn replace_tools(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<ConnectionId>,
    ApiJson(body): ApiJson<ReplaceTools>,
) -> Result<Json<ReplacedToolsView>, ApiError> {
    let record = state
        .store
        .get_tool_connection(caller.project_id, id)
        .await?;
    caller.require_configure()?;
    if record.kind != ToolConnectionKind::HttpApi {
        return Err(ApiError::bad_request(
            "invalid_tools",
            format!(
                "`{}` is a `{}` connection, which lists its own tools; only `http_api` tools are replaced",
                record.name, record.kind
            ),
        ));
    }
    if body
        .openapi
        .as_ref()
        .is_some_and(|o| !o.credentials.is_empty())
    {
        return Err(ApiError::bad_request(
            "invalid_credential",
            "replacing tools keeps the connection's credentials; `openapi.credentials` is not taken here",
        ));
    }
    let source = tools_source(body.tools, body.openapi)?;
    let allowlist = wor_egress::HostAllowlist::parse(&record.allowlist)
        .map_err(|e| ApiError::bad_request("invalid_allowlist", format!("allowlist: {e}")))?;
    let configured = state.engine.configured_credential_slots(&record).await?;
    let mut url = record.url.clone();
    let checked = source.validate(
        &mut url,
        &allowlist,
        &mut None,
        &mut BTreeMap::new(),
        &configured,
    )?;
    let replaced = state
        .engine
        .replace_http_tools(caller.project_id, id, &checked, caller.actor())
        .await?;
    tracing::info!(category = "config", action = "connection.update_tools", project_id = %caller.project_id,
        connection_id = %id, actor_key_id = %caller.key_id, tools = checked.len(),
        quarantined = replaced.quarantined, "tool connection's tools replaced");
    Ok(Json(ReplacedToolsView {
        connection: view(&state, replaced.connection).await?,
        diff: replaced.diff.map(diff_view),
        quarantined: replaced.quarantined,
    }))
}
