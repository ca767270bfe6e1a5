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
use wor_core::ConnectionId;
use wor_core::audit::{AuditCategory, AuditEvent};
use wor_engine::{BEARER_TOKEN_FIELD, ReviewDiff, ReviewedTool, credential_slot};
use wor_store::{NewToolConnection, ToolConnectionKind, ToolConnectionRecord, header_field};

use crate::AppState;
use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::extract::{ApiJson, ApiPath};
use crate::routes::model_connections::SecretFieldView;
use crate::views::rfc3339;

/// The longest credential value accepted.
const MAX_SECRET_LEN: usize = 8 * 1024;
/// The most credential headers one connection holds.
const MAX_HEADERS: usize = 16;

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
    /// path template's `{params}` must be properties of the input schema.
    #[serde(default)]
    #[schema(value_type = Vec<Object>)]
    pub tools: Vec<serde_json::Value>,
    /// Sent as `Authorization: Bearer …`. Stored encrypted; never returned.
    #[serde(default)]
    pub bearer_token: Option<String>,
    /// Secret headers by name (`x-api-key`). Stored encrypted; never returned.
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
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
    /// Tools the admin classifies read-only; every other tool is consequential.
    #[serde(default)]
    pub read_only: Vec<String>,
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
            .metadata(&credential_slot(&record, field))
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

fn check_connection_name(name: &str) -> Result<(), ApiError> {
    let ok = (1..=40).contains(&name.len())
        && name.starts_with(|c: char| c.is_ascii_lowercase())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '_');
    if ok {
        Ok(())
    } else {
        Err(ApiError::bad_request(
            "invalid_name",
            "a tool connection name is 1 to 40 of a-z, 0-9, `-` and `_`, starting with a letter",
        ))
    }
}

fn check_secret(value: &str, what: &str) -> Result<(), ApiError> {
    if value.trim().is_empty()
        || value.len() > MAX_SECRET_LEN
        || value.chars().any(char::is_control)
    {
        return Err(ApiError::bad_request(
            "invalid_credential",
            format!("{what} must be 1 to 8192 printable characters"),
        ));
    }
    Ok(())
}

/// The credential headers of `body`, names lower-cased and checked the way they will be sent.
fn check_credentials(body: &CreateToolConnection) -> Result<Vec<(String, String)>, ApiError> {
    if body.headers.len() > MAX_HEADERS {
        return Err(ApiError::bad_request(
            "invalid_credential",
            format!("a connection holds at most {MAX_HEADERS} credential headers"),
        ));
    }
    let mut credentials = wor_tools_check::Credentials::default();
    if let Some(token) = &body.bearer_token {
        check_secret(token, "bearer_token")?;
        credentials.bearer(token)?;
    }
    let mut headers = Vec::new();
    for (name, value) in &body.headers {
        check_secret(value, &format!("header `{name}`"))?;
        let name = name.trim().to_ascii_lowercase();
        credentials.header(&name, value)?;
        headers.push((name, value.clone()));
    }
    Ok(headers)
}

/// Checks credentials the way `wor-tools` will attach them, so a bad header is refused at
/// create time rather than at the first run.
mod wor_tools_check {
    use secrecy::SecretString;
    use wor_tools::ConnectionCredentials;

    use crate::error::ApiError;

    #[derive(Default)]
    pub struct Credentials(ConnectionCredentials);

    fn invalid(error: wor_tools::CredentialError) -> ApiError {
        ApiError::bad_request("invalid_credential", error.to_string())
    }

    impl Credentials {
        pub fn bearer(&mut self, token: &str) -> Result<(), ApiError> {
            let current = std::mem::take(&mut self.0);
            self.0 = current
                .with_bearer(SecretString::from(token.to_owned()))
                .map_err(invalid)?;
            Ok(())
        }

        pub fn header(&mut self, name: &str, value: &str) -> Result<(), ApiError> {
            let current = std::mem::take(&mut self.0);
            self.0 = current
                .with_header(name, SecretString::from(value.to_owned()))
                .map_err(invalid)?;
            Ok(())
        }
    }
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
    caller: Caller,
    ApiJson(body): ApiJson<CreateToolConnection>,
) -> Result<(StatusCode, Json<ToolConnectionView>), ApiError> {
    caller.require_configure()?;
    check_connection_name(&body.name)?;
    if body.name == "routine" {
        return Err(ApiError::bad_request(
            "invalid_name",
            "`routine` is reserved: rosters name routines used as tools `routine/NAME`",
        ));
    }
    let kind: ToolConnectionKind = body
        .kind
        .parse()
        .map_err(|e: String| ApiError::bad_request("invalid_kind", e))?;
    let command = if kind.is_local() {
        let Some(mut command) = body.command.clone() else {
            return Err(ApiError::bad_request(
                "invalid_command",
                format!("a `{kind}` connection needs `command` (program, args, read_only_paths)"),
            ));
        };
        if !body.url.is_empty() {
            return Err(ApiError::bad_request(
                "invalid_url",
                format!("a `{kind}` connection has no `url`"),
            ));
        }
        if !body.tools.is_empty() {
            return Err(ApiError::bad_request(
                "invalid_tools",
                format!("a `{kind}` connection lists its own tools; it takes no `tools`"),
            ));
        }
        command.env_names = body.env.keys().cloned().collect();
        let config = state.engine.config();
        wor_engine::check_stdio_spec(
            &command,
            &config.stdio_allowed_roots,
            &config.protected_paths,
        )
        .map_err(|e| ApiError::bad_request("invalid_command", format!("command: {e}")))?;
        // After the roots check: nothing is looked at outside the operator's paths.
        if kind == ToolConnectionKind::Wasm {
            check_wasm_command(&command, &body)?;
        }
        Some(command)
    } else {
        if (kind == ToolConnectionKind::HttpApi) == body.tools.is_empty() {
            return Err(ApiError::bad_request(
                "invalid_tools",
                "an `http_api` connection lists its `tools`; other kinds do not",
            ));
        }
        if body.command.is_some() || !body.env.is_empty() {
            return Err(ApiError::bad_request(
                "invalid_command",
                "`command` and `env` are only for `mcp_stdio` and `wasm` connections",
            ));
        }
        wor_egress::EgressUrl::parse(&body.url)
            .map_err(|refusal| ApiError::bad_request("invalid_url", format!("url: {refusal}")))?;
        if body.allowlist.is_empty() {
            return Err(ApiError::bad_request(
                "invalid_allowlist",
                "allowlist must name at least the host of `url`",
            ));
        }
        None
    };
    let allowlist = wor_egress::HostAllowlist::parse(&body.allowlist)
        .map_err(|e| ApiError::bad_request("invalid_allowlist", format!("allowlist: {e}")))?;
    if kind == ToolConnectionKind::HttpApi {
        check_http_tools(&body, allowlist)?;
    }
    let headers = check_credentials(&body)?;
    let record = state
        .store
        .create_tool_connection(
            caller.project_id,
            NewToolConnection {
                name: body.name,
                kind,
                url: body.url,
                allowlist: body.allowlist,
                secret_headers: headers.iter().map(|(name, _)| name.clone()).collect(),
                command,
                http_tools: body.tools.clone(),
                created_by: Some(caller.key_id),
            },
        )
        .await?;
    let mut sealed = Vec::new();
    if let Some(token) = &body.bearer_token {
        sealed.push((credential_slot(&record, BEARER_TOKEN_FIELD), token.as_str()));
    }
    for (name, value) in &headers {
        sealed.push((credential_slot(&record, header_field(name)), value.as_str()));
    }
    for (name, value) in &body.env {
        sealed.push((
            credential_slot(&record, wor_store::env_field(name)),
            value.as_str(),
        ));
    }
    for (slot, value) in sealed {
        if let Err(err) = state.vault.put(&slot, value).await {
            // Never leave a connection that could be enabled without its credentials.
            state
                .store
                .disable_tool_connection(caller.project_id, record.id)
                .await?;
            return Err(err.into());
        }
    }
    state
        .audit
        .append(
            AuditEvent::new(
                caller.project_id,
                AuditCategory::ToolConnectionCreate,
                caller.actor(),
            )
            .subject("connection_id", record.id)
            .payload(serde_json::json!({
                "name": record.name, "kind": record.kind, "url": record.url,
                "allowlist": record.allowlist, "credential_headers": record.secret_headers,
                "bearer_token": body.bearer_token.is_some(), "command": record.command,
            })),
        )
        .await?;
    tracing::info!(category = "config", action = "connection.create", project_id = %caller.project_id,
        connection_id = %record.id, actor_key_id = %caller.key_id, "tool connection created");
    Ok((StatusCode::CREATED, Json(view(&state, record).await?)))
}

/// Checks an `http_api` connection's base URL and tools: the URL's host on the allowlist, each
/// tool a supported method with a valid template, names unique.
fn check_http_tools(
    body: &CreateToolConnection,
    allowlist: wor_egress::HostAllowlist,
) -> Result<(), ApiError> {
    let bad = |message: String| ApiError::bad_request("invalid_tools", message);
    wor_tools::HttpApiConnection::new(
        &body.url,
        allowlist,
        wor_tools::ConnectionCredentials::none(),
    )
    .map_err(|e| bad(format!("url: {e}")))?;
    let mut names = std::collections::BTreeSet::new();
    for (index, tool) in body.tools.iter().enumerate() {
        let config: wor_tools::HttpToolConfig = serde_json::from_value(tool.clone())
            .map_err(|e| bad(format!("tools[{index}]: {e}")))?;
        check_connection_name(&config.name).map_err(|_| {
            bad(format!(
                "tools[{index}]: `{}` is not a valid tool name",
                config.name
            ))
        })?;
        if !names.insert(config.name.clone()) {
            return Err(bad(format!(
                "tools[{index}]: `{}` is listed twice",
                config.name
            )));
        }
        wor_tools::HttpToolDefinition::new(config)
            .map_err(|e| bad(format!("tools[{index}]: {e}")))?;
    }
    Ok(())
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
    if !role.can_configure() {
        return Err(ApiError::Forbidden(format!(
            "role `{role}` cannot change configuration; `admin` or `owner` is required"
        )));
    }
    let record = state
        .engine
        .enable_tool_connection(project, id, &body.tools, &body.read_only)
        .await?;
    state
        .audit
        .append(
            AuditEvent::new(project, AuditCategory::ToolConnectionEnable, actor)
                .subject("connection_id", id)
                .payload(serde_json::json!({
                    "previous_status": before.status,
                    "pinned": body.tools,
                    "read_only": body.read_only,
                })),
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
    let record = state
        .store
        .disable_tool_connection(caller.project_id, id)
        .await?;
    state
        .audit
        .append(
            AuditEvent::new(
                caller.project_id,
                AuditCategory::ToolConnectionDisable,
                caller.actor(),
            )
            .subject("connection_id", id),
        )
        .await?;
    tracing::info!(category = "config", action = "connection.disable", project_id = %caller.project_id,
        connection_id = %id, actor_key_id = %caller.key_id, "tool connection disabled");
    Ok(Json(view(&state, record).await?))
}

/// What a `wasm` connection may not have: arguments (a component gets none), credentials other
/// than its environment, read-only paths that are not directories.
fn check_wasm_command(
    command: &wor_store::StdioSpec,
    body: &CreateToolConnection,
) -> Result<(), ApiError> {
    if !command.args.is_empty() {
        return Err(ApiError::bad_request(
            "invalid_command",
            "a `wasm` connection takes no `args`",
        ));
    }
    if body.bearer_token.is_some() || !body.headers.is_empty() {
        return Err(ApiError::bad_request(
            "invalid_credentials",
            "a `wasm` connection has no headers; give it secrets through `env`",
        ));
    }
    for path in &command.read_only_paths {
        if !std::path::Path::new(path).is_dir() {
            return Err(ApiError::bad_request(
                "invalid_command",
                format!(
                    "command: the read-only path `{path}` of a `wasm` connection must be a directory"
                ),
            ));
        }
    }
    Ok(())
}
