//! The HTTP API of Work on Repeat: routes, authentication, the one error shape and the
//! OpenAPI document.
//!
//! Handlers hold no business rules of their own beyond who may call them; they never take a
//! project id from the request, and they never return a secret except a key at its creation.

pub mod auth;
pub mod console;
pub mod error;
pub mod extract;
pub mod internal;
pub mod metrics;
mod request_log;
pub mod routes;
pub mod serving;
pub mod tls;
pub mod traces;
pub mod views;

use std::future::Future;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::routing::get;
use tokio::net::TcpListener;
use utoipa::openapi::path::{Operation, PathItem};
use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
use utoipa::openapi::{Content, InfoBuilder, OpenApi, Ref, RefOr, Response};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;
use wor_engine::Engine;
use wor_store::{AuditLog, Store, Vault};

use crate::error::ApiError;

/// Request bodies larger than this are refused with 413.
pub const MAX_BODY_BYTES: usize = 1024 * 1024;

/// What every handler can reach.
#[derive(Debug, Clone)]
pub struct AppState {
    pub store: Store,
    /// The only path to stored secret values.
    pub vault: Vault,
    /// Starts and drives runs.
    pub engine: Engine,
    /// Production mode: demo-only features (the replay model) are refused.
    pub production: bool,
    /// The one writer of the audit log; handlers append through it.
    pub audit: AuditLog,
    /// Sign-in settings of the web console.
    pub console: console::ConsoleConfig,
    /// The key that signs run envelopes; workers enrol only where it is set.
    pub control_plane: Option<std::sync::Arc<wor_secrets::ControlPlaneSigningKey>>,
}

impl AppState {
    /// The state of an API over `engine`; handlers append to the engine's audit log.
    pub fn new(engine: Engine) -> Self {
        AppState {
            store: engine.store().clone(),
            vault: engine.vault().clone(),
            production: engine.config().production,
            audit: engine.audit().clone(),
            console: console::ConsoleConfig::default(),
            control_plane: None,
            engine,
        }
    }

    /// The same state with the control plane's envelope signing key: workers may enrol.
    pub fn with_control_plane(
        mut self,
        key: std::sync::Arc<wor_secrets::ControlPlaneSigningKey>,
    ) -> Self {
        self.control_plane = Some(key);
        self
    }

    /// The same state with the console's settings from the server configuration.
    pub fn with_console(mut self, console: console::ConsoleConfig) -> Self {
        self.console = console;
        self
    }
}

/// The API's routes together with their OpenAPI description. Routes are registered through
/// `utoipa_axum`, so a route cannot exist without its document entry.
fn api() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(routes::health::healthz))
        .routes(routes!(routes::health::readyz))
        .routes(routes!(routes::project::get_project))
        .routes(routes!(routes::project::whoami))
        .routes(routes!(
            routes::members::list_members,
            routes::members::create_member
        ))
        .routes(routes!(
            routes::members::get_member,
            routes::members::change_role
        ))
        .routes(routes!(routes::invitations::invite))
        .routes(routes!(routes::keys::list_keys, routes::keys::create_key))
        .routes(routes!(routes::keys::get_key, routes::keys::revoke_key))
        .routes(routes!(
            routes::model_connections::list,
            routes::model_connections::create
        ))
        .routes(routes!(routes::model_connections::get))
        .routes(routes!(routes::model_connections::set_api_key))
        .routes(routes!(routes::model_connections::revoke))
        .routes(routes!(
            routes::tool_connections::list,
            routes::tool_connections::create
        ))
        .routes(routes!(routes::tool_connections::get))
        .routes(routes!(routes::tool_connections::review))
        .routes(routes!(routes::tool_connections::enable))
        .routes(routes!(routes::tool_connections::disable))
        .routes(routes!(routes::tool_connections::replace_tools))
        .routes(routes!(routes::oauth::authorize))
        .routes(routes!(routes::oauth::callback))
        .routes(routes!(routes::oauth::client_metadata))
        .routes(routes!(routes::routines::list, routes::routines::apply))
        .routes(routes!(routes::routines::get))
        .routes(routes!(routes::runs::start))
        .routes(routes!(routes::runs::list))
        .routes(routes!(routes::runs::get))
        .routes(routes!(routes::runs::cancel))
        .routes(routes!(routes::runs::events))
        .routes(routes!(routes::runs::own_run))
        .routes(routes!(routes::approvals::list))
        .routes(routes!(routes::approvals::get))
        .routes(routes!(routes::approvals::approve))
        .routes(routes!(routes::approvals::deny))
        .routes(routes!(routes::approvals::edit_and_approve))
        .routes(routes!(
            routes::policy::get,
            routes::policy::set,
            routes::policy::reset
        ))
        .routes(routes!(routes::webhooks::receive))
        .routes(routes!(routes::webhooks::rotate_secret))
        .routes(routes!(routes::webhooks::deliveries))
        .routes(routes!(
            routes::notifications::list,
            routes::notifications::create
        ))
        .routes(routes!(
            routes::notifications::get,
            routes::notifications::delete
        ))
        .routes(routes!(routes::notifications::deliveries))
        .routes(routes!(routes::notifications::slack_interaction))
        .routes(routes!(routes::audit::list_audit))
}

/// The OpenAPI 3.1 document of the API.
pub fn openapi() -> OpenApi {
    let (_, doc) = api().split_for_parts();
    finish_document(doc)
}

fn finish_document(mut doc: OpenApi) -> OpenApi {
    doc.info = InfoBuilder::new()
        .title("Work on Repeat API")
        .version(env!("CARGO_PKG_VERSION"))
        .description(Some(
            "Every route under /v1 needs `Authorization: Bearer wor_…`; the key decides the project.",
        ))
        .build();
    let components = doc.components.get_or_insert_with(Default::default);
    components.add_security_scheme(
        "bearer",
        SecurityScheme::Http(Http::new(HttpAuthScheme::Bearer)),
    );
    for item in doc.paths.paths.values_mut() {
        for operation in operations_mut(item) {
            document_extractor_answers(operation);
            describe_every_answer(operation);
            name_by_tag(operation);
        }
    }
    doc
}

/// The operations of a path, whatever their method.
fn operations_mut(item: &mut PathItem) -> impl Iterator<Item = &mut Operation> {
    [
        &mut item.get,
        &mut item.put,
        &mut item.post,
        &mut item.delete,
        &mut item.patch,
    ]
    .into_iter()
    .flatten()
}

/// Gives every answer of `operation` the description OpenAPI requires: a handler's own, else
/// the status's reason phrase.
fn describe_every_answer(operation: &mut Operation) {
    for (status, answer) in &mut operation.responses.responses {
        if let RefOr::T(answer) = answer
            && answer.description.is_empty()
        {
            answer.description = status
                .parse::<u16>()
                .ok()
                .and_then(|code| axum::http::StatusCode::from_u16(code).ok())
                .and_then(|code| code.canonical_reason())
                .unwrap_or("the answer")
                .to_owned();
        }
    }
}

/// Names `operation` by its first tag and its handler (`runs_list`, `approvals_get`): one id an
/// operation, as OpenAPI requires and client generators rely on, however many modules have a
/// handler of the same name, and an id that stays as it is when another module adds one.
fn name_by_tag(operation: &mut Operation) {
    if let (Some(id), Some(tag)) = (
        operation.operation_id.as_ref(),
        operation.tags.as_ref().and_then(|tags| tags.first()),
    ) {
        operation.operation_id = Some(format!("{}_{id}", tag.replace('-', "_")));
    }
}

/// Adds the answers an operation gives whatever its handler does, because they come from the
/// extractors and the gate in front of the router: the caller's key (401 when missing, unknown
/// or revoked; 403 for a role that may not, or a run's credential), a JSON body (400 when
/// malformed, 413 over [`MAX_BODY_BYTES`], 415 without `content-type: application/json`), any
/// other body (413) and path or query parameters (400 when malformed). A handler's own entry
/// for one of these statuses is kept.
fn document_extractor_answers(operation: &mut Operation) {
    let mut answers: Vec<(u16, &str)> = Vec::new();
    if operation.security.as_ref().is_some_and(|s| !s.is_empty()) {
        answers.push((401, "the API key is missing, unknown or revoked"));
        answers.push((
            403,
            "the key's role may not do this, or a run's credential was used",
        ));
    }
    match operation.request_body.as_ref() {
        Some(RefOr::T(body)) if body.content.contains_key("application/json") => {
            answers.push((
                400,
                "the body is not valid JSON or not what this operation takes",
            ));
            answers.push((413, "the body is larger than the limit"));
            answers.push((
                415,
                "the body is not sent as `content-type: application/json`",
            ));
        }
        Some(_) => answers.push((413, "the body is larger than the limit")),
        None => {}
    }
    if operation.parameters.as_ref().is_some_and(|p| !p.is_empty()) {
        answers.push((400, "a path or query parameter is malformed"));
    }
    for (status, description) in answers {
        operation
            .responses
            .responses
            .entry(status.to_string())
            .or_insert_with(|| {
                RefOr::T(
                    Response::builder()
                        .description(description)
                        .content(
                            "application/json",
                            Content::new(Some(Ref::from_schema_name("ErrorBody"))),
                        )
                        .build(),
                )
            });
    }
}

/// The complete router, with state, limits, logging and fallbacks.
pub fn router(state: AppState) -> Router {
    let (routes, doc) = api().split_for_parts();
    let doc = finish_document(doc);
    routes
        .merge(console::router(state.clone()))
        .merge(internal::router())
        .route(
            "/v1/openapi.json",
            get(move || {
                let doc = doc.clone();
                async move { axum::Json(doc) }
            }),
        )
        .fallback(|| async { ApiError::NoRoute })
        .method_not_allowed_fallback(|| async { ApiError::MethodNotAllowed })
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(tower_http::timeout::RequestBodyTimeoutLayer::new(
            serving::BODY_READ_TIMEOUT,
        ))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            auth::run_credential_gate,
        ))
        .layer(axum::middleware::from_fn(refuse_nul_in_uri))
        .layer(axum::middleware::from_fn(request_log::log_request))
        .with_state(state)
}

/// Refuses, with 400 and before anything else reads it, a request whose path or query holds
/// U+0000 (`%00`): PostgreSQL text cannot hold it, so no path segment or query value may carry
/// it to the database, on any backend.
async fn refuse_nul_in_uri(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse as _;
    let uri = request.uri();
    let holds_nul = |text: &str| {
        text.as_bytes()
            .windows(3)
            .any(|w| w.eq_ignore_ascii_case(b"%00"))
    };
    let (in_path, in_query) = (holds_nul(uri.path()), uri.query().is_some_and(holds_nul));
    if !in_path && !in_query {
        return next.run(request).await;
    }
    let error = if in_path {
        ApiError::bad_request("invalid_path", "the path contains a NUL character (U+0000)")
    } else {
        ApiError::bad_request(
            "invalid_query",
            "the query contains a NUL character (U+0000)",
        )
    };
    if uri.path().starts_with("/console") {
        console::ConsoleError(error).into_response()
    } else {
        error.into_response()
    }
}

/// Only the liveness and readiness probes, for a process that serves no API (`wor serve
/// --role scheduler`); every other path is 404.
pub fn health_router(state: AppState) -> Router {
    Router::new()
        .route("/healthz", get(routes::health::healthz))
        .route("/readyz", get(routes::health::readyz))
        .fallback(|| async { ApiError::NoRoute })
        .method_not_allowed_fallback(|| async { ApiError::MethodNotAllowed })
        .layer(axum::middleware::from_fn(request_log::log_request))
        .with_state(state)
}

/// The probes of a process without a database (`wor serve --role worker`): `/healthz` while
/// it is up, `/readyz` while `ready` says it can take work (`Err` says why not, as a 503).
pub fn probe_router(
    ready: impl Fn() -> Result<(), String> + Clone + Send + Sync + 'static,
) -> Router {
    Router::new()
        .route("/healthz", get(routes::health::healthz))
        .route(
            "/readyz",
            get(move || {
                let ready = ready.clone();
                async move {
                    ready()
                        .map(|()| axum::Json(routes::health::HealthStatus { status: "ready" }))
                        .map_err(ApiError::Unavailable)
                }
            }),
        )
        .fallback(|| async { ApiError::NoRoute })
        .method_not_allowed_fallback(|| async { ApiError::MethodNotAllowed })
}

/// Serves [`probe_router`] on `listener` until `shutdown` completes.
pub async fn serve_probes(
    listener: TcpListener,
    ready: impl Fn() -> Result<(), String> + Clone + Send + Sync + 'static,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, probe_router(ready))
        .with_graceful_shutdown(shutdown)
        .await
}

/// Serves [`health_router`] on `listener` until `shutdown` completes.
pub async fn serve_health(
    listener: TcpListener,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(
        listener,
        health_router(state).into_make_service_with_connect_info::<std::net::SocketAddr>(),
    )
    .with_graceful_shutdown(shutdown)
    .await
}

/// How long the requests open when shutdown begins may go on; those still open then (an
/// event stream following a run that waits for a person, a client that stopped reading) are
/// closed, so a stopping server does not wait on its clients.
pub const DRAIN_GRACE: std::time::Duration = std::time::Duration::from_secs(10);

/// Serves the API and the console on `listener` until `shutdown` completes, then drains open
/// requests for at most [`DRAIN_GRACE`]. Handlers can read the peer's address (the console's
/// per-address sign-in limit).
pub async fn serve(
    listener: TcpListener,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let (shutdown, begun) = announced(shutdown);
    let serving = serving::serve_connections(
        sending_at_once(listener),
        router(state),
        serving::ConnectionLimits::default(),
        shutdown,
    );
    within_drain_grace(serving, begun).await
}

/// `shutdown`, and a receiver that turns `true` when it has completed.
fn announced(
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> (
    impl Future<Output = ()> + Send + 'static,
    tokio::sync::watch::Receiver<bool>,
) {
    let (tell, begun) = tokio::sync::watch::channel(false);
    let shutdown = async move {
        shutdown.await;
        let _ = tell.send(true);
    };
    (shutdown, begun)
}

/// `serving` to its end, or until [`DRAIN_GRACE`] after `begun` turned `true`, whichever
/// comes first; `serving` is then dropped, and with it ([`serving::serve_connections`]) the
/// tasks of the connections still open, which closes them.
async fn within_drain_grace(
    serving: impl Future<Output = std::io::Result<()>>,
    mut begun: tokio::sync::watch::Receiver<bool>,
) -> std::io::Result<()> {
    let grace = async {
        if begun.wait_for(|begun| *begun).await.is_err() {
            // The shutdown future was dropped unfinished: shutdown never begins.
            std::future::pending::<()>().await;
        }
        tokio::time::sleep(DRAIN_GRACE).await;
    };
    tokio::select! {
        served = serving => served,
        () = grace => {
            tracing::warn!(category = "http", grace_seconds = DRAIN_GRACE.as_secs(),
                "requests still open after the drain's grace were closed");
            Ok(())
        }
    }
}

/// `listener`, its connections sending what is written at once ([`send_at_once`]).
pub fn sending_at_once(
    listener: TcpListener,
) -> axum::serve::TapIo<TcpListener, fn(&mut tokio::net::TcpStream)> {
    use axum::serve::ListenerExt as _;
    let tap: fn(&mut tokio::net::TcpStream) = |connection| send_at_once(connection);
    listener.tap_io(tap)
}

/// Has `connection` send each write at once (`TCP_NODELAY`). Otherwise a response written in
/// pieces (an event stream's events; headers, then a body) waits on a connection kept alive:
/// a small piece is held until the client acknowledges the one before, and a client delays
/// that acknowledgement (40 ms or more on Linux).
pub(crate) fn send_at_once(connection: &tokio::net::TcpStream) {
    if let Err(error) = connection.set_nodelay(true) {
        tracing::debug!(
            category = "http",
            kind = ?error.kind(),
            "a connection's writes cannot be sent at once; they may wait for acknowledgements"
        );
    }
}

/// [`serve`] over TLS (open requests drained as there): connections are accepted under `tls`'s current certificate, which
/// [`tls::ReloadableTls::reload`] replaces without touching connections already open.
pub async fn serve_tls(
    listener: TcpListener,
    tls: tls::ReloadableTls,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    use axum::serve::ListenerExt as _;
    // `tap_io` gives the listener the peer address as connect info, as a plain TCP one has.
    let listener = tls::TlsListener::new(listener, tls)?.tap_io(|_| {});
    let (shutdown, begun) = announced(shutdown);
    let serving = serving::serve_connections(
        listener,
        router(state),
        serving::ConnectionLimits::default(),
        shutdown,
    );
    within_drain_grace(serving, begun).await
}
