//! The web console: server-rendered pages for people, on the same listener as the API.
//!
//! Members sign in with a password set through a single-use invitation; a server-side session
//! (its token in an `HttpOnly; SameSite=Strict` cookie) decides the project, never the request
//! (S1). Every page is rendered by askama, which escapes everything it prints with [`Shown`]:
//! text a model or a tool produced is shown, never interpreted, and what in it would hide or
//! reorder text shows as its escape. Every response carries a Content-Security-Policy
//! without inline script or any third-party origin; every POST passes [`session::csrf_gate`].
//!
//! INVARIANT: an API key or a run credential never opens a console session, and a console
//! session never calls `/v1`: each side only reads its own credential.

mod account;
mod client;
mod connections;
mod keys;
mod live;
mod members;
mod pages;
pub mod password;
pub use sign_in_link::{SIGN_IN_LINK_TTL, issue_sign_in_link};
mod project;
mod routines;
mod runs;
pub mod session;
mod sign_in_link;
mod slack_link;
mod threads;

use std::time::Duration;

/// The escaper of every console template (`askama.toml`): HTML escaping, after each character
/// that would hide itself or reorder the text around it ([`wor_core::text::is_hidden`]: a
/// direction override, an isolate, a zero-width space, an escape sequence, a tag character) is
/// written as its `\u{…}` escape. An approver reads a call as the tool receives it: text that
/// a right-to-left override reverses on screen shows the override instead.
#[derive(Debug, Clone, Copy)]
pub struct Shown;

impl askama::filters::Escaper for Shown {
    fn write_escaped_str<W: std::fmt::Write>(&self, dest: W, string: &str) -> std::fmt::Result {
        askama::filters::Html.write_escaped_str(dest, &wor_core::text::shown(string, |_| false))
    }
}

use askama::Template;
use axum::Router;
use axum::extract::{FromRequestParts, Request};
use axum::http::request::Parts;
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};

use serde::de::DeserializeOwned;

use crate::AppState;
use crate::error::ApiError;
use crate::extract::ApiPath;

/// The console's settings, from the server's configuration file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsoleConfig {
    /// argon2id memory cost in KiB.
    pub argon2_memory_kib: u32,
    /// argon2id passes over memory.
    pub argon2_iterations: u32,
    /// argon2id lanes.
    pub argon2_parallelism: u32,
    /// How long an invitation link works.
    pub invitation_ttl: Duration,
    /// A session unused this long ends.
    pub session_idle: Duration,
    /// A session ends this long after sign-in, however busy.
    pub session_absolute: Duration,
    /// Failed sign-ins for one account within [`Self::lockout`] before it is locked.
    pub max_failures_per_account: u32,
    /// Failed sign-ins from one address within [`Self::lockout`] before it is locked.
    pub max_failures_per_address: u32,
    /// How far back failures count, and so how long a lockout lasts.
    pub lockout: Duration,
    /// Whether cookies carry `Secure`: the operator says the console is reached over HTTPS
    /// (`wor serve` speaks plain HTTP; TLS ends in front of it). Never taken from a request.
    pub secure_cookies: bool,
    /// Proxies whose `X-Forwarded-For` names the client, for the per-address sign-in limit.
    /// From any other peer the header is ignored: the peer is the client.
    pub trusted_proxies: Vec<ipnet::IpNet>,
}

impl Default for ConsoleConfig {
    /// argon2id at 19 MiB, 2 passes, 1 lane (OWASP's recommended minimum); 72-hour
    /// invitations; sessions idle out after 30 minutes and end after 12 hours; 5 failed
    /// sign-ins for an account (20 from an address) in 15 minutes lock it for 15 minutes;
    /// cookies without `Secure` and no trusted proxy.
    fn default() -> Self {
        ConsoleConfig {
            argon2_memory_kib: 19 * 1024,
            argon2_iterations: 2,
            argon2_parallelism: 1,
            invitation_ttl: Duration::from_secs(72 * 3600),
            session_idle: Duration::from_secs(30 * 60),
            session_absolute: Duration::from_secs(12 * 3600),
            max_failures_per_account: 5,
            max_failures_per_address: 20,
            lockout: Duration::from_secs(15 * 60),
            secure_cookies: false,
            trusted_proxies: Vec::new(),
        }
    }
}

pub(crate) use crate::views::millis;

/// The policy on every console response: nothing but this origin's stylesheet, images and one
/// script file (no inline script, no `eval`), fetches and event streams only to this origin,
/// forms only to this origin, never framed.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; \
    connect-src 'self'; style-src 'self'; img-src 'self'; form-action 'self'; \
    frame-ancestors 'none'; base-uri 'none'";

const STYLESHEET: &str = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/static/console.css"));
const SCRIPT: &str = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/static/console.js"));

/// At most this many approvals are read for a run's page, a thread's turn or the inbox's
/// live fingerprint.
pub(crate) const INBOX_LIMIT: u32 = 200;

/// Pending approvals on one page of the inbox, newest first; older ones on the next pages.
pub(crate) const INBOX_PAGE: u32 = 50;

/// The console's routes, under `/console`.
pub fn router(state: AppState) -> Router<AppState> {
    let pages = Router::new()
        .route("/", get(pages::home))
        .route("/sign-in", get(pages::sign_in_page).post(pages::sign_in))
        .route("/sign-out", post(pages::sign_out))
        .route(
            "/invitations/{token}",
            get(pages::invitation_page).post(pages::accept_invitation),
        )
        .route(
            "/sign-in-links/{token}",
            get(sign_in_link::page).post(sign_in_link::sign_in),
        )
        .route("/approvals", get(pages::approvals))
        .route("/approvals/events", get(live::inbox))
        .route("/approvals/{approval_id}", get(pages::approval))
        .route(
            "/approvals/{approval_id}/edit",
            post(pages::edit_and_approve),
        )
        .route("/approvals/{approval_id}/{verdict}", post(pages::decide))
        .route("/runs", get(runs::list))
        .route("/runs/{run_id}", get(pages::run))
        .route("/runs/{run_id}/cancel", post(runs::cancel))
        .route("/runs/{run_id}/events", get(live::run))
        .route("/connections", get(connections::list))
        .route("/connections/{connection_id}", get(connections::show))
        .route(
            "/connections/{connection_id}/enable",
            post(connections::enable),
        )
        .route(
            "/connections/{connection_id}/authorize",
            post(connections::authorize),
        )
        .route("/oauth/finish", get(connections::finish_authorization))
        .route("/model-connections", post(connections::create_model))
        .route(
            "/model-connections/{connection_id}/revoke",
            post(connections::revoke_model),
        )
        .route(
            "/model-connections/{connection_id}/key",
            post(connections::replace_model_key),
        )
        .route("/keys", get(keys::list).post(keys::create))
        .route("/keys/{key_id}/revoke", post(keys::revoke))
        .route("/members", get(members::list))
        .route("/members/invite", post(members::invite))
        .route("/members/{member_id}/role", post(members::change_role))
        .route("/policy", get(project::policy).post(project::set))
        .route("/audit", get(project::audit))
        .route("/routines", get(routines::list))
        .route("/routines/{routine_id}", get(routines::show))
        .route("/routines/{routine_id}/runs", post(routines::start))
        .route("/routines/{routine_id}/threads", get(threads::list))
        .route(
            "/routines/{routine_id}/thread",
            get(threads::show).post(threads::write),
        )
        .route("/routines/{routine_id}/thread/events", get(threads::events))
        .route("/sessions", get(account::sessions))
        .route("/sessions/{session_id}/revoke", post(account::revoke))
        .route(
            "/slack/link/{token}",
            get(slack_link::link_page).post(slack_link::link),
        )
        .route("/static/console.css", get(stylesheet))
        .route("/static/console.js", get(script))
        .fallback(|| async { ConsoleError(ApiError::NotFound) })
        .layer(axum::middleware::from_fn_with_state(
            state,
            session::csrf_gate,
        ))
        .layer(axum::middleware::from_fn(security_headers));
    // `/console/`, as a person may type it, is the console's home, with the console's headers.
    let home_with_slash = Router::new()
        .route(
            "/console/",
            get(|| async { axum::response::Redirect::permanent("/console") }),
        )
        .layer(axum::middleware::from_fn(security_headers));
    Router::new().nest("/console", pages).merge(home_with_slash)
}

async fn stylesheet() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/css; charset=utf-8"),
            (header::CACHE_CONTROL, "public, max-age=3600"),
        ],
        STYLESHEET,
    )
        .into_response()
}

async fn script() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/javascript; charset=utf-8"),
            (header::CACHE_CONTROL, "public, max-age=3600"),
        ],
        SCRIPT,
    )
        .into_response()
}

/// Adds the console's security headers to every response under `/console`, error pages
/// included.
async fn security_headers(request: Request, next: Next) -> Response {
    let mut response = next.run(request).await;
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CONTENT_SECURITY_POLICY),
    );
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    if !headers.contains_key(header::CACHE_CONTROL) {
        headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    }
    response
}

/// A console URL's path parameter, such as a typed id. Text that is not one is a page not
/// found, as another project's resource is: a URL names nothing but what exists.
#[derive(Debug)]
pub struct PagePath<T>(pub T);

impl<T: DeserializeOwned + Send> FromRequestParts<AppState> for PagePath<T> {
    type Rejection = ConsoleError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        // The API's extractor, with the console's answer to a path that names nothing.
        let ApiPath(value) = ApiPath::<T>::from_request_parts(parts, state)
            .await
            .map_err(|_| ConsoleError(ApiError::NotFound))?;
        Ok(PagePath(value))
    }
}

/// A page's failure, shown as an HTML page with the status the API would answer.
#[derive(Debug)]
pub struct ConsoleError(pub ApiError);

impl<E: Into<ApiError>> From<E> for ConsoleError {
    fn from(err: E) -> Self {
        ConsoleError(err.into())
    }
}

#[derive(Template)]
#[template(path = "console/error.html")]
struct ErrorPage {
    title: &'static str,
    message: String,
}

impl IntoResponse for ConsoleError {
    fn into_response(self) -> Response {
        let (status, _) = self.0.status_and_code();
        let title = match status {
            StatusCode::NOT_FOUND => "Not found",
            StatusCode::FORBIDDEN => "Not allowed",
            // Decided meanwhile, expired, cancelled, in use: the message says which.
            StatusCode::CONFLICT => "No longer possible",
            StatusCode::BAD_REQUEST => "Not accepted",
            StatusCode::TOO_MANY_REQUESTS => "Too many attempts",
            _ => "Something went wrong",
        };
        // The same redaction as the API's error bodies (S4).
        let message = match self.0 {
            ApiError::NotFound | ApiError::NoRoute => {
                "There is nothing here, or it belongs to another project.".to_owned()
            }
            other => wor_secrets::redact_shapes(&other.to_string()).into_owned(),
        };
        render(status, &ErrorPage { title, message })
    }
}

/// Renders `page` with `status`; a template that fails to render is a 500 without detail.
pub(crate) fn render(status: StatusCode, page: &impl Template) -> Response {
    match page.render() {
        Ok(html) => (status, Html(html)).into_response(),
        Err(error) => {
            tracing::error!(category = "console", error = %error, "a console page failed to render");
            (StatusCode::INTERNAL_SERVER_ERROR, "internal error").into_response()
        }
    }
}
