//! Tool connections: the list, and a connection's page where an admin reviews the live tools
//! (through the engine's review, which connects through the egress client), classifies each
//! read-only or consequential and enables exactly what was reviewed; for a quarantined
//! connection the page shows the diff between the pinned and the offered definitions, and
//! re-approving pins the offered ones. Enabling is the API's `enable_connection`.
//!
//! Model connections are listed on the same page; an admin or owner adds one (its key goes
//! into the vault and is never shown back) or revokes one, through the API's
//! `create_model_connection` and `revoke_model_connection`.

use std::collections::BTreeMap;

use askama::Template;
use axum::Form;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::FormRejection;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Redirect};
use wor_core::ConnectionId;
use wor_core::call::ToolClass;
use wor_engine::EngineError;
use wor_store::{ToolConnectionKind, ToolConnectionStatus};

use super::pages::{Banner, PageResult, form};
use super::session::ConsoleMember;
use super::{ConsoleError, PagePath, render};
use crate::AppState;
use crate::error::ApiError;
use crate::routes::model_connections::{
    CreateModelConnection, create_model_connection, revoke_model_connection,
};
use crate::routes::tool_connections::{EnableToolConnection, enable_connection};
use crate::views::rfc3339;

struct ConnectionRow {
    id: String,
    name: String,
    kind: String,
    status: String,
    pinned: usize,
    updated_at: String,
}

/// A model connection as listed: never its key.
struct ModelRow {
    id: String,
    name: String,
    provider: &'static str,
    base_url: String,
    active: bool,
    updated_at: String,
}

#[derive(Template)]
#[template(path = "console/connections.html")]
struct ConnectionsPage {
    banner: Banner,
    connections: Vec<ConnectionRow>,
    models: Vec<ModelRow>,
    /// Whether the member may add and revoke model connections (admin or owner).
    may_configure: bool,
    /// The providers a model connection can be made for, and whether the form chose each.
    providers: Vec<(&'static str, bool)>,
    /// What the model connection form was sent with, never its key, when it is shown again.
    model_form: ModelFormEcho,
    model_error: Option<String>,
    notice: Option<String>,
}

/// The model connection form's fields as sent, to show again after a refusal. The key is not
/// among them: it is never written into a page.
#[derive(Default)]
struct ModelFormEcho {
    name: String,
    provider: String,
    base_url: String,
}

pub async fn list(State(state): State<AppState>, member: ConsoleMember) -> PageResult {
    connections_page(
        &state,
        &member,
        StatusCode::OK,
        ModelFormEcho::default(),
        None,
        None,
    )
    .await
}

async fn connections_page(
    state: &AppState,
    member: &ConsoleMember,
    status: StatusCode,
    model_form: ModelFormEcho,
    model_error: Option<String>,
    notice: Option<String>,
) -> PageResult {
    let connections = state
        .store
        .list_tool_connections(member.session.project_id)
        .await?
        .into_iter()
        .map(|c| ConnectionRow {
            id: c.id.to_string(),
            name: c.name,
            kind: c.kind.as_str().to_owned(),
            status: c.status.as_str().to_owned(),
            pinned: c.pinned_tools.len(),
            updated_at: rfc3339(c.updated_at),
        })
        .collect();
    let models = state
        .store
        .list_model_connections(member.session.project_id)
        .await?
        .into_iter()
        .map(|m| ModelRow {
            id: m.id.to_string(),
            name: m.name,
            provider: m.provider.as_str(),
            base_url: m.base_url,
            active: m.status == wor_store::ConnectionStatus::Active,
            updated_at: rfc3339(m.updated_at),
        })
        .collect();
    Ok(render(
        status,
        &ConnectionsPage {
            banner: member.into(),
            connections,
            models,
            may_configure: member.session.role.can_configure(),
            providers: wor_core::model::ProviderKind::ALL
                .into_iter()
                .filter(|p| p.needs_connection())
                .map(|p| (p.as_str(), p.as_str() == model_form.provider))
                .collect(),
            model_form,
            model_error,
            notice,
        },
    ))
}

#[derive(Debug, serde::Deserialize)]
pub struct ModelConnectionForm {
    name: String,
    provider: String,
    base_url: String,
    /// Empty for a keyless local model server the operator allowed.
    #[serde(default)]
    api_key: String,
}

/// Adds a model connection through the API's path; the key is sealed and never shown back.
/// A refusal the API answers with 400 shows the form again, without the key.
pub async fn create_model(
    State(state): State<AppState>,
    member: ConsoleMember,
    body: Result<Form<ModelConnectionForm>, FormRejection>,
) -> PageResult {
    let body = form(body)?;
    let echo = ModelFormEcho {
        name: body.name.clone(),
        provider: body.provider.clone(),
        base_url: body.base_url.clone(),
    };
    let session = &member.session;
    let request = CreateModelConnection {
        name: body.name,
        provider: body.provider,
        base_url: body.base_url,
        api_key: Some(body.api_key).filter(|k| !k.is_empty()),
    };
    match create_model_connection(
        &state,
        session.project_id,
        session.role,
        Some(session.member_id),
        None,
        member.actor(),
        request,
    )
    .await
    {
        Ok(record) => {
            let notice = format!("Model connection {} was added.", record.name);
            connections_page(
                &state,
                &member,
                StatusCode::CREATED,
                ModelFormEcho::default(),
                None,
                Some(notice),
            )
            .await
        }
        Err(ApiError::BadRequest { message, .. }) => {
            connections_page(
                &state,
                &member,
                StatusCode::BAD_REQUEST,
                echo,
                Some(message),
                None,
            )
            .await
        }
        Err(other) => Err(ConsoleError(other)),
    }
}

/// Revokes a model connection through the API's path: its key is deleted and runs using it
/// fail closed.
pub async fn revoke_model(
    State(state): State<AppState>,
    member: ConsoleMember,
    PagePath(id): PagePath<ConnectionId>,
) -> PageResult {
    let session = &member.session;
    let record =
        revoke_model_connection(&state, session.project_id, session.role, member.actor(), id)
            .await?;
    let notice = format!(
        "Model connection {} is revoked and its key deleted.",
        record.name
    );
    connections_page(
        &state,
        &member,
        StatusCode::OK,
        ModelFormEcho::default(),
        None,
        Some(notice),
    )
    .await
}

/// A model connection's new key, as its form sends it.
#[derive(Debug, serde::Deserialize)]
pub struct ModelKeyForm {
    api_key: String,
}

/// Replaces a model connection's key through the API's path; the key is sealed and never
/// shown back.
pub async fn replace_model_key(
    State(state): State<AppState>,
    member: ConsoleMember,
    PagePath(id): PagePath<ConnectionId>,
    body: Result<Form<ModelKeyForm>, FormRejection>,
) -> PageResult {
    let body = form(body)?;
    let session = &member.session;
    let record = crate::routes::model_connections::replace_model_key(
        &state,
        session.project_id,
        session.role,
        member.actor(),
        id,
        &body.api_key,
    )
    .await?;
    let notice = format!(
        "The key of model connection {} is replaced (credential version {}).",
        record.name, record.credential_version
    );
    connections_page(
        &state,
        &member,
        StatusCode::OK,
        ModelFormEcho::default(),
        None,
        Some(notice),
    )
    .await
}

/// A tool as the review shows it, all as text.
struct ToolRow {
    name: String,
    description: String,
    input_schema: String,
    annotations: String,
    hash: String,
    /// The operator's class of it (`read_only`, `open_world`, `consequential`).
    class: &'static str,
    /// The server's `openWorldHint`, shown as a suggestion only.
    open_world_hint: bool,
    /// The field value that pins it: `HASH:NAME`.
    pin: String,
}

struct PinnedRow {
    name: String,
    class: &'static str,
}

struct DiffView {
    changed: Vec<String>,
    added: Vec<String>,
    removed: Vec<String>,
    text: String,
}

#[derive(Template)]
#[template(path = "console/connection.html")]
struct ConnectionPage {
    banner: Banner,
    id: String,
    name: String,
    kind: String,
    url: String,
    status: String,
    pinned: Vec<PinnedRow>,
    /// The live tools, for a member who may configure; `None` for everyone else.
    review: Option<Vec<ToolRow>>,
    /// Why the live tools could not be listed, for a member who may configure.
    review_error: Option<String>,
    /// The offer to authorize an `mcp_http` connection whose server asks for it.
    authorize: Option<AuthorizeOffer>,
    diff: Option<DiffView>,
    quarantined: bool,
}

/// An OAuth connection's authorization, as the page offers it.
struct AuthorizeOffer {
    /// It was authorized before: the button says "Authorize again".
    authorized: bool,
}

fn class_name(class: ToolClass) -> &'static str {
    match class {
        ToolClass::ReadOnly => "read-only",
        ToolClass::Consequential => "consequential",
        ToolClass::OpenWorld => "open-world",
    }
}

fn pretty(value: &serde_json::Value) -> String {
    serde_json::to_string_pretty(value).unwrap_or_default()
}

pub async fn show(
    State(state): State<AppState>,
    member: ConsoleMember,
    PagePath(id): PagePath<ConnectionId>,
) -> PageResult {
    let project = member.session.project_id;
    let record = state.store.get_tool_connection(project, id).await?;
    let configure = member.session.role.can_configure();
    let mcp_http = record.kind == ToolConnectionKind::McpHttp;
    let settled = if configure && mcp_http {
        state.store.get_connection_oauth(project, id).await?
    } else {
        None
    };
    let mut review_error = None;
    let (review, diff) = if configure {
        match state.engine.review_tool_connection(project, id).await {
            Ok(review) => review_rows(&record, review),
            // An MCP server that refuses the connection (not, or no longer, authorized):
            // the page says why, and offers to authorize it when the server asks for it.
            Err(EngineError::Connection(error))
                if mcp_http
                    && matches!(
                        *error,
                        wor_engine::ConnectionError::Connect { .. }
                            | wor_engine::ConnectionError::Authorization(_)
                    ) =>
            {
                review_error = Some(error.to_string());
                (None, None)
            }
            Err(error) => return Err(error.into()),
        }
    } else {
        (None, None)
    };
    let authorize = if settled.is_some() {
        Some(AuthorizeOffer { authorized: true })
    } else if review_error.is_some() && state.engine.oauth_challenged(project, id).await? {
        Some(AuthorizeOffer { authorized: false })
    } else {
        None
    };
    let page = ConnectionPage {
        banner: (&member).into(),
        id: record.id.to_string(),
        name: record.name.clone(),
        kind: record.kind.as_str().to_owned(),
        url: record.url.clone(),
        status: record.status.as_str().to_owned(),
        quarantined: record.status == ToolConnectionStatus::Quarantined,
        pinned: record
            .pinned_tools
            .keys()
            .map(|name| PinnedRow {
                class: class_name(record.class_of(name)),
                name: name.clone(),
            })
            .collect(),
        review,
        review_error,
        authorize,
        diff,
    };
    Ok(render(StatusCode::OK, &page))
}

/// The live tools and the diff against the pins, as the page shows them.
fn review_rows(
    record: &wor_store::ToolConnectionRecord,
    review: wor_engine::ToolReview,
) -> (Option<Vec<ToolRow>>, Option<DiffView>) {
    let tools = review
        .tools
        .into_iter()
        .map(|tool| ToolRow {
            class: record.class_of(&tool.name).as_str(),
            open_world_hint: tool
                .annotations
                .as_ref()
                .and_then(|a| a.get("openWorldHint"))
                .and_then(serde_json::Value::as_bool)
                .unwrap_or(false),
            pin: format!("{}:{}", tool.hash, tool.name),
            description: tool.description.unwrap_or_default(),
            input_schema: pretty(&tool.input_schema),
            annotations: tool.annotations.as_ref().map(pretty).unwrap_or_default(),
            name: tool.name,
            hash: tool.hash,
        })
        .collect();
    let diff = review
        .diff
        .filter(|d| !(d.changed.is_empty() && d.added.is_empty() && d.removed.is_empty()))
        .map(|d| DiffView {
            changed: d.changed,
            added: d.added,
            removed: d.removed,
            text: d.text,
        });
    (Some(tools), diff)
}

/// Starts the MCP authorization of an `mcp_http` connection for the member signed in, as the
/// API's does but with no API key, and sends the browser to the authorization server; its
/// callback brings the person back to the connection's page.
pub async fn authorize(
    State(state): State<AppState>,
    member: ConsoleMember,
    PagePath(id): PagePath<ConnectionId>,
) -> PageResult {
    let project = member.session.project_id;
    state.store.get_tool_connection(project, id).await?;
    if !member.session.role.can_configure() {
        return Err(ConsoleError(ApiError::Forbidden(
            "only an admin or owner authorizes a connection".to_owned(),
        )));
    }
    let started = state
        .engine
        .start_oauth_authorization(project, id, member.session.member_id, None, None)
        .await?;
    tracing::info!(category = "config", action = "connection.authorize_start", project_id = %project,
        connection_id = %id, member_id = %member.session.member_id,
        "tool connection authorization started in the console");
    Ok(Redirect::to(&started.authorization_url).into_response())
}

/// Finishes an MCP authorization the callback handed on (`routes::oauth::callback`): for the
/// member signed in, who must be the one who started it (the proof that the browser the
/// authorization server sent back is theirs, not someone else's sent a link to it), and
/// still allowed to configure. Back to the connection's page.
pub async fn finish_authorization(
    State(state): State<AppState>,
    member: ConsoleMember,
    uri: axum::http::Uri,
) -> PageResult {
    if !member.session.role.can_configure() {
        return Err(ConsoleError(ApiError::Forbidden(
            "only an admin or owner authorizes a connection".to_owned(),
        )));
    }
    let query = crate::routes::oauth::CallbackQuery::parse(uri.query().unwrap_or_default());
    let finished = crate::routes::oauth::finish(&state, &query, member.session.member_id)
        .await
        .map_err(ConsoleError)?;
    Ok(Redirect::to(&format!("/console/connections/{}", finished.connection_id)).into_response())
}

/// The enable form: `pin` fields (`HASH:NAME`, one per reviewed tool) and `read_only` fields
/// (tool names). Repeated fields are why this reads the body itself.
fn enable_body(bytes: &[u8]) -> Result<EnableToolConnection, ConsoleError> {
    let mut tools = BTreeMap::new();
    let mut read_only = Vec::new();
    let mut open_world = Vec::new();
    for (key, value) in url::form_urlencoded::parse(bytes) {
        match key.as_ref() {
            "pin" => {
                let (hash, name) = value.split_once(':').ok_or_else(|| {
                    ConsoleError(ApiError::bad_request(
                        "invalid_form",
                        "a `pin` field is `HASH:NAME`",
                    ))
                })?;
                tools.insert(name.to_owned(), hash.to_owned());
            }
            // One select per tool: `class.NAME` = `read_only`, `open_world` or
            // `consequential`; the older `read_only` checkbox field still reads.
            "read_only" => read_only.push(value.into_owned()),
            class if class.starts_with("class.") => {
                let tool = class.trim_start_matches("class.").to_owned();
                match value.as_ref() {
                    "read_only" => read_only.push(tool),
                    "open_world" => open_world.push(tool),
                    "consequential" => {}
                    _ => {
                        return Err(ConsoleError(ApiError::bad_request(
                            "invalid_form",
                            "a tool's class is `read_only`, `open_world` or `consequential`",
                        )));
                    }
                }
            }
            "csrf" => {}
            other => {
                return Err(ConsoleError(ApiError::bad_request(
                    "invalid_form",
                    format!("unknown field `{}`", wor_core::quote::excerpt(other, 40)),
                )));
            }
        }
    }
    Ok(EnableToolConnection {
        tools,
        read_only,
        open_world,
    })
}

pub async fn enable(
    State(state): State<AppState>,
    member: ConsoleMember,
    PagePath(id): PagePath<ConnectionId>,
    body: Bytes,
) -> PageResult {
    let body = enable_body(&body)?;
    let record = enable_connection(
        &state,
        member.session.project_id,
        member.session.role,
        member.actor(),
        id,
        &body,
    )
    .await?;
    tracing::info!(category = "config", action = "connection.enable", project_id = %member.session.project_id,
        connection_id = %id, member_id = %member.session.member_id, tools = record.pinned_tools.len(),
        "tool connection enabled in the console");
    Ok(Redirect::to(&format!("/console/connections/{id}")).into_response())
}
