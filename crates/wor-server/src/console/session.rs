//! Console sessions: the cookie, the signed-in member, and the CSRF check on every POST.
//!
//! The session token lives only in an `HttpOnly; SameSite=Strict; Path=/` cookie (`Secure`
//! when the operator's configuration says the console is served over HTTPS) and is stored as a
//! digest. Each session has its own synchronizer token, which every console form carries in a
//! hidden `csrf` field; the forms used before sign-in (sign-in and invitations) carry instead
//! a random value in a cookie of their own, compared with the form's, whether or not the
//! browser also has a session. [`csrf_gate`] checks every POST under `/console` before any
//! handler runs, so a form added later is covered by default.

use axum::body::Body;
use axum::extract::{FromRequestParts, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, Method, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Redirect, Response};
use subtle::ConstantTimeEq;
use wor_core::audit::Actor;
use wor_store::ConsoleSessionRecord;

use super::{ConsoleConfig, ConsoleError, millis};
use crate::AppState;
use crate::error::ApiError;

/// The session cookie.
pub const SESSION_COOKIE: &str = "wor_session";
/// The pre-session CSRF cookie of the sign-in and invitation forms.
pub const FORM_COOKIE: &str = "wor_form";
/// Largest form body the console reads: the API's body limit, so that what the API takes
/// (a 128 KiB policy, which a form's percent-encoding can make three times as long) the
/// console's forms take too, each field then held to the API's own limit.
const MAX_FORM_BYTES: usize = crate::MAX_BODY_BYTES;

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

/// A `Set-Cookie` value: `HttpOnly; SameSite=Strict`, and `Secure` when the operator says the
/// console is reached over HTTPS (never because a request says so); `max_age` 0 clears it.
pub fn set_cookie(
    config: &ConsoleConfig,
    name: &str,
    value: &str,
    path: &str,
    max_age: Option<i64>,
) -> HeaderValue {
    let mut text = format!("{name}={value}; HttpOnly; SameSite=Strict; Path={path}");
    if let Some(seconds) = max_age {
        text.push_str(&format!("; Max-Age={seconds}"));
    }
    if config.secure_cookies {
        text.push_str("; Secure");
    }
    // Names and values are ours: fixed names and hex tokens.
    HeaderValue::from_str(&text).unwrap_or_else(|_| HeaderValue::from_static(""))
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

/// Why a page needing a session was refused: no session goes to the sign-in page, which
/// returns to the page asked for (a `GET` of a console page) once signed in.
#[derive(Debug)]
pub enum SessionRejection {
    SignIn { next: Option<String> },
    Error(ConsoleError),
}

impl IntoResponse for SessionRejection {
    fn into_response(self) -> Response {
        match self {
            SessionRejection::SignIn { next: None } => {
                Redirect::to("/console/sign-in").into_response()
            }
            SessionRejection::SignIn { next: Some(next) } => {
                let next: String = url::form_urlencoded::byte_serialize(next.as_bytes()).collect();
                Redirect::to(&format!("/console/sign-in?next={next}")).into_response()
            }
            SessionRejection::Error(error) => error.into_response(),
        }
    }
}

/// `next` when it is a page of this console to return to after sign-in: a relative path under
/// `/console/`, with nothing that could make a browser leave this origin (`//`, a backslash,
/// spaces or control characters) or this console (a `.` or `..` segment, spelt with `%2e` or
/// not), and not the sign-in or sign-out page itself. Anything else is no place to go, so no
/// link can send a member elsewhere after they sign in.
pub fn safe_next(next: &str) -> Option<&str> {
    let path = next.split(['?', '#']).next().unwrap_or_default();
    let dot_segment = |segment: &str| {
        let dots = segment.to_ascii_lowercase().replace("%2e", ".");
        dots == "." || dots == ".."
    };
    let safe = next.len() <= 1024
        && next.starts_with("/console/")
        && !next.contains("//")
        && !next.contains('\\')
        && next.bytes().all(|b| b.is_ascii_graphic())
        && !path.split('/').any(dot_segment)
        && !next.starts_with("/console/sign-in")
        && !next.starts_with("/console/sign-out");
    safe.then_some(next)
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
            Ok(None) => Err(SessionRejection::SignIn {
                // The URI as the browser asked for it: nested under `/console`, the request's
                // own URI has lost that prefix.
                next: (parts.method == Method::GET)
                    .then(|| {
                        parts
                            .extensions
                            .get::<axum::extract::OriginalUri>()
                            .map_or(&parts.uri, |original| &original.0)
                            .path_and_query()
                            .map(|p| p.as_str().to_owned())
                    })
                    .flatten()
                    .filter(|next| safe_next(next).is_some() && !next.ends_with("/events")),
            }),
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

/// The pre-session form token this browser holds already, when it has the shape of one this
/// server makes (64 hex digits): every form page before sign-in renders with it and sets it
/// again, so two such pages open side by side (two tabs signed out) do not refuse each other's
/// form. As any double-submit token, it is only as safe as the cookie is from being set by
/// another site of the same domain.
#[derive(Debug, Clone, Default)]
pub struct HeldFormToken(pub Option<String>);

impl<S: Send + Sync> FromRequestParts<S> for HeldFormToken {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        Ok(HeldFormToken(
            cookie(&parts.headers, FORM_COOKIE)
                .filter(|token| token.len() == 64 && token.bytes().all(|b| b.is_ascii_hexdigit()))
                .map(str::to_owned),
        ))
    }
}

fn csrf_refused() -> Response {
    ConsoleError(ApiError::Forbidden(
        "this form is missing its security token or it has expired; reload the page and try again"
            .to_owned(),
    ))
    .into_response()
}

/// Where a form sent with a session that has ended leads: the sign-in page, saying so.
pub const SESSION_ENDED_PAGE: &str = "/console/sign-in?session_ended=1";

/// Whether `path` (under `/console`) is a form used before sign-in, whose token is the form
/// cookie's rather than a session's: a member may open an invitation or a sign-in link while
/// signed in.
fn is_pre_session_form(path: &str) -> bool {
    let path = path.strip_prefix("/console").unwrap_or(path);
    path == "/sign-in" || path.starts_with("/invitations/") || path.starts_with("/sign-in-links/")
}

/// Refuses every POST under `/console` whose `csrf` field does not match the expected token,
/// with 403, before any handler runs: the form cookie's for the sign-in and invitation forms,
/// the session's for every other form.
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
    let expected = if is_pre_session_form(parts.uri.path()) {
        cookie(&parts.headers, FORM_COOKIE).map(str::to_owned)
    } else {
        member.as_ref().map(|m| m.session.csrf_token.clone())
    };
    let matches = expected.is_some_and(|expected| {
        !expected.is_empty() && bool::from(expected.as_bytes().ct_eq(presented.as_bytes()))
    });
    if !matches {
        // A form of a session that has ended since its page was shown (idle, expired, signed
        // out elsewhere) is not a forgery: the member is sent to sign in again, told why.
        let session_ended = member.is_none()
            && !is_pre_session_form(parts.uri.path())
            && cookie(&parts.headers, SESSION_COOKIE).is_some_and(|token| !token.is_empty());
        if session_ended {
            tracing::info!(
                category = "console",
                action = "csrf.session_ended",
                "a console form came with a session that has ended; sign-in asked again"
            );
            let mut response = Redirect::to(SESSION_ENDED_PAGE).into_response();
            response.headers_mut().append(
                header::SET_COOKIE,
                set_cookie(&state.console, SESSION_COOKIE, "", "/", Some(0)),
            );
            return response;
        }
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
