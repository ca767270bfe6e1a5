//! Console sessions: the cookie, the signed-in member, and the CSRF check on every POST.
//!
//! The session token lives only in an `HttpOnly; SameSite=Strict; Path=/` cookie (`Secure`
//! when the request came over TLS) and is stored as a digest. Each session has its own
//! synchronizer token, which every console form carries in a hidden `csrf` field; before
//! sign-in (the sign-in and invitation forms) the token is a random value in a cookie of its
//! own, compared with the form's. [`csrf_gate`] checks every POST under `/console` before any
//! handler runs, so a form added later is covered by default.

use std::net::SocketAddr;

use axum::body::Body;
use axum::extract::{ConnectInfo, FromRequestParts, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, Method, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Redirect, Response};
use subtle::ConstantTimeEq;
use wor_core::audit::Actor;
use wor_store::ConsoleSessionRecord;

use super::{ConsoleError, millis};
use crate::AppState;
use crate::error::ApiError;

/// The session cookie.
pub const SESSION_COOKIE: &str = "wor_session";
/// The pre-session CSRF cookie of the sign-in and invitation forms.
pub const FORM_COOKIE: &str = "wor_form";
/// Largest form body the console reads.
const MAX_FORM_BYTES: usize = 64 * 1024;

/// The value of cookie `name`, if the request has it.
pub fn cookie<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(key, _)| *key == name)
        .map(|(_, value)| value)
}

/// Whether the request reached us over TLS: directly, or through a proxy that says so. The
/// header can only add `Secure` to a cookie, never remove it.
fn over_tls(parts: &Parts) -> bool {
    parts.uri.scheme_str() == Some("https")
        || parts
            .headers
            .get("x-forwarded-proto")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.eq_ignore_ascii_case("https"))
}

/// A `Set-Cookie` value: `HttpOnly; SameSite=Strict`, `Secure` over TLS; `max_age` 0 clears it.
pub fn set_cookie(
    parts: &Parts,
    name: &str,
    value: &str,
    path: &str,
    max_age: Option<i64>,
) -> HeaderValue {
    let mut text = format!("{name}={value}; HttpOnly; SameSite=Strict; Path={path}");
    if let Some(seconds) = max_age {
        text.push_str(&format!("; Max-Age={seconds}"));
    }
    if over_tls(parts) {
        text.push_str("; Secure");
    }
    // Names and values are ours: fixed names and hex tokens.
    HeaderValue::from_str(&text).unwrap_or_else(|_| HeaderValue::from_static(""))
}

/// The client's address, for the per-address sign-in limit.
pub fn client_address(parts: &Parts) -> String {
    parts
        .extensions
        .get::<ConnectInfo<SocketAddr>>()
        .map(|ConnectInfo(addr)| addr.ip().to_string())
        .unwrap_or_else(|| "unknown".to_owned())
}

/// A member signed in to the console. The project is the session's, and only the session's.
#[derive(Debug, Clone)]
pub struct ConsoleMember {
    pub session: ConsoleSessionRecord,
    /// The presented session token, for signing out.
    pub token: String,
}

impl ConsoleMember {
    pub fn actor(&self) -> Actor {
        Actor::ConsoleMember {
            member_id: self.session.member_id,
        }
    }
}

/// Resolves the session cookie, if any, to a live session.
async fn resolve(parts: &Parts, state: &AppState) -> Result<Option<ConsoleMember>, ApiError> {
    let Some(token) = cookie(&parts.headers, SESSION_COOKIE) else {
        return Ok(None);
    };
    let session = state
        .store
        .console_session(token, millis(state.console.session_idle))
        .await?;
    Ok(session.map(|session| ConsoleMember {
        session,
        token: token.to_owned(),
    }))
}

/// Why a page needing a session was refused: no session goes to the sign-in page.
#[derive(Debug)]
pub enum SessionRejection {
    SignIn,
    Error(ConsoleError),
}

impl IntoResponse for SessionRejection {
    fn into_response(self) -> Response {
        match self {
            SessionRejection::SignIn => Redirect::to("/console/sign-in").into_response(),
            SessionRejection::Error(error) => error.into_response(),
        }
    }
}

impl FromRequestParts<AppState> for ConsoleMember {
    type Rejection = SessionRejection;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        if let Some(member) = parts.extensions.get::<ConsoleMember>() {
            return Ok(member.clone());
        }
        match resolve(parts, state).await {
            Ok(Some(member)) => Ok(member),
            Ok(None) => Err(SessionRejection::SignIn),
            Err(error) => Err(SessionRejection::Error(error.into())),
        }
    }
}

/// The session of the request, if it has a live one (for pages that work both ways).
#[derive(Debug, Clone)]
pub struct MaybeConsoleMember(pub Option<ConsoleMember>);

impl FromRequestParts<AppState> for MaybeConsoleMember {
    type Rejection = ConsoleError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        if let Some(member) = parts.extensions.get::<ConsoleMember>() {
            return Ok(MaybeConsoleMember(Some(member.clone())));
        }
        Ok(MaybeConsoleMember(resolve(parts, state).await?))
    }
}

fn csrf_refused() -> Response {
    ConsoleError(ApiError::Forbidden(
        "this form is missing its security token or it has expired; reload the page and try again"
            .to_owned(),
    ))
    .into_response()
}

/// Refuses every POST under `/console` whose `csrf` field does not match the session's token
/// (or, with no session, the form cookie's), with 403, before any handler runs.
pub async fn csrf_gate(State(state): State<AppState>, request: Request, next: Next) -> Response {
    if request.method() != Method::POST {
        return next.run(request).await;
    }
    let (mut parts, body) = request.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, MAX_FORM_BYTES).await else {
        return ConsoleError(ApiError::PayloadTooLarge).into_response();
    };
    // PostgreSQL text cannot hold U+0000: no console form may carry it, in any field.
    if url::form_urlencoded::parse(&bytes)
        .any(|(key, value)| key.contains('\0') || value.contains('\0'))
    {
        return ConsoleError(ApiError::bad_request(
            "invalid_form",
            "a field contains a NUL character (U+0000)",
        ))
        .into_response();
    }
    let presented = url::form_urlencoded::parse(&bytes)
        .find(|(key, _)| key == "csrf")
        .map(|(_, value)| value.into_owned())
        .unwrap_or_default();
    let member = match resolve(&parts, &state).await {
        Ok(member) => member,
        Err(error) => return ConsoleError(error).into_response(),
    };
    let expected = match &member {
        Some(member) => Some(member.session.csrf_token.clone()),
        None => cookie(&parts.headers, FORM_COOKIE).map(str::to_owned),
    };
    let matches = expected.is_some_and(|expected| {
        !expected.is_empty() && bool::from(expected.as_bytes().ct_eq(presented.as_bytes()))
    });
    if !matches {
        tracing::warn!(
            category = "console",
            action = "csrf.refused",
            "a console form was refused"
        );
        return csrf_refused();
    }
    if let Some(member) = member {
        parts.extensions.insert(member);
    }
    next.run(Request::from_parts(parts, Body::from(bytes)))
        .await
}
