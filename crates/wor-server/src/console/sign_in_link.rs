//! Single-use sign-in links: a link bound to one member that opens a console session without a
//! password, once, within minutes. `wor demo` prints one for its approver, so the first thing
//! a new user does is decide a held call in the browser.
//!
//! Opening the link only shows a button: the session starts on the form's POST, so a link
//! previewer that fetches the URL does not use it up. The form carries the pre-session form
//! token, as the sign-in form does.

use std::time::Duration;

use askama::Template;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::http::request::Parts;
use serde_json::json;
use wor_core::audit::{AuditCategory, AuditEvent};
use wor_core::{MemberId, ProjectId};
use wor_store::ConsoleToken;

use super::client::ClientAddress;
use super::pages::{PageResult, form_page, open_session};
use super::{ConsoleError, millis};
use crate::AppState;
use crate::error::ApiError;

/// How long a sign-in link works by default.
pub const SIGN_IN_LINK_TTL: Duration = Duration::from_secs(10 * 60);

/// Makes a single-use sign-in link for `member` of `project`, working for `ttl`, and audits
/// it (`member.sign_in_link`, the operator as actor). Returns the console path to open and
/// when it expires. A member of another project, or none, is not found.
pub async fn issue_sign_in_link(
    state: &AppState,
    project: ProjectId,
    member: MemberId,
    ttl: Duration,
) -> Result<(String, i64), ApiError> {
    // The entry is staged with the link: a crash before it is appended leaves it for the
    // audit writer's sweep, never a link that signs someone in without its entry.
    let entry = |expires_at: i64| {
        AuditEvent::new(
            project,
            AuditCategory::MemberSignInLink,
            wor_core::audit::Actor::Operator,
        )
        .subject("member_id", member)
        .payload(json!({ "expires_at": expires_at }))
    };
    let (token, expires_at, staged): (ConsoleToken, i64, _) = state
        .store
        .create_sign_in_link(project, member, millis(ttl), &entry)
        .await?;
    state.engine.append_staged_or_log([staged]).await;
    Ok((
        format!("/console/sign-in-links/{}", token.expose()),
        expires_at,
    ))
}

#[derive(Template)]
#[template(path = "console/sign_in_link.html")]
struct SignInLinkPage {
    csrf: String,
    member_name: String,
    expires_at: String,
}

fn link_gone() -> ConsoleError {
    ConsoleError(ApiError::LinkGone(
        "This sign-in link cannot be used: it was used already or it expired. Sign in with your password, or ask for a new link.",
    ))
}

/// Names the member the link signs in, with a button; uses nothing.
pub async fn page(
    State(state): State<AppState>,
    Path(token): Path<String>,
    held: super::session::HeldFormToken,
) -> PageResult {
    let link = state
        .store
        .sign_in_link(&token)
        .await?
        .ok_or_else(link_gone)?;
    form_page(
        &state.console,
        StatusCode::OK,
        SignInLinkPage {
            csrf: String::new(),
            member_name: link.member_name,
            expires_at: crate::views::rfc3339(link.expires_at),
        },
        |p| &mut p.csrf,
        held,
    )
}

/// Uses the link (the CSRF gate has checked the form token) and opens a session for its
/// member; a used, expired or unknown link is the 404 page.
pub async fn sign_in(
    State(state): State<AppState>,
    parts: Parts,
    Path(token): Path<String>,
) -> PageResult {
    let link = state
        .store
        .use_sign_in_link(&token)
        .await?
        .ok_or_else(link_gone)?;
    let address = ClientAddress::of(&parts, &state.console.trusted_proxies).text();
    open_session(
        &state,
        &parts,
        link.project_id,
        link.member_id,
        address,
        Some("sign_in_link"),
        "/console/approvals",
    )
    .await
}
