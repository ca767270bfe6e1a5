//! The sessions page: a member sees and ends their own console sessions; an admin (or owner)
//! also sees and ends every member's in the project. Each end is in the audit chain.

use askama::Template;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Redirect};
use serde_json::json;
use wor_core::ConsoleSessionId;
use wor_core::audit::{AuditCategory, AuditEvent};

use super::pages::{Banner, PageResult};
use super::session::{ConsoleMember, SESSION_COOKIE, set_cookie};
use super::{ConsoleError, PagePath, millis, render};
use crate::AppState;
use crate::error::ApiError;
use crate::views::rfc3339;

struct SessionRow {
    id: String,
    member_name: String,
    address: String,
    user_agent: String,
    created_at: String,
    last_seen_at: String,
    expires_at: String,
    current: bool,
}

#[derive(Template)]
#[template(path = "console/sessions.html")]
struct SessionsPage {
    banner: Banner,
    /// The page lists every member's sessions, not only the viewer's.
    admin: bool,
    /// The viewer's own sessions first, then others' (an admin's page only).
    rows: Vec<SessionRow>,
}

pub async fn sessions(State(state): State<AppState>, member: ConsoleMember) -> PageResult {
    let me = &member.session;
    let admin = me.role.can_configure();
    let listed = state
        .store
        .list_console_sessions(
            me.project_id,
            (!admin).then_some(me.member_id),
            millis(state.console.session_idle),
        )
        .await?;
    let mut rows: Vec<(bool, SessionRow)> = listed
        .into_iter()
        .map(|s| {
            (
                s.member_id != me.member_id,
                SessionRow {
                    id: s.id.to_string(),
                    current: s.id == me.id,
                    member_name: s.member_name,
                    address: s.address,
                    user_agent: s.user_agent,
                    created_at: rfc3339(s.created_at),
                    last_seen_at: rfc3339(s.last_seen_at),
                    expires_at: rfc3339(s.expires_at),
                },
            )
        })
        .collect();
    // Stable: the viewer's own first, each group most recently used first.
    rows.sort_by_key(|(others, _)| *others);
    Ok(render(
        StatusCode::OK,
        &SessionsPage {
            banner: (&member).into(),
            admin,
            rows: rows.into_iter().map(|(_, row)| row).collect(),
        },
    ))
}

/// Ends a session: the member's own, or, for an admin, anyone's in the project. Another
/// member's session is not found for everyone else, as is another project's for anyone.
pub async fn revoke(
    State(state): State<AppState>,
    member: ConsoleMember,
    PagePath(id): PagePath<ConsoleSessionId>,
) -> PageResult {
    let me = &member.session;
    let only = (!me.role.can_configure()).then_some(me.member_id);
    // The entry is staged with the revocation: a crash before it is appended leaves it for
    // the audit writer's sweep.
    let entry = |owner: wor_core::MemberId| {
        AuditEvent::new(
            me.project_id,
            AuditCategory::ConsoleSessionRevoke,
            member.actor(),
        )
        .subject("member_id", owner)
        .subject("session_id", id)
        .payload(json!({ "own": owner == me.member_id }))
    };
    let (owner, staged) = state
        .store
        .revoke_console_session(me.project_id, id, only, &entry)
        .await?
        .ok_or(ConsoleError(ApiError::NotFound))?;
    state.engine.append_staged_or_log([staged]).await;
    tracing::info!(category = "console", action = "session.revoke", project_id = %me.project_id,
        member_id = %owner, session_id = %id, "a console session was ended");
    if id == me.id {
        let mut response = Redirect::to("/console/sign-in").into_response();
        response.headers_mut().append(
            header::SET_COOKIE,
            set_cookie(&state.console, SESSION_COOKIE, "", "/", Some(0)),
        );
        return Ok(response);
    }
    Ok(Redirect::to("/console/sessions").into_response())
}
