//! Linking a Slack identity to a member: a Slack user the server has verified is handed a
//! single-use link; the member opens it in a signed-in session and confirms with the session's
//! form token. The project is the session's: a link of another project is not found.

use askama::Template;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::Response;

use super::session::ConsoleMember;
use super::{ConsoleError, render};
use crate::AppState;
use crate::error::ApiError;

#[derive(Template)]
#[template(path = "console/slack_link.html")]
struct SlackLinkPage {
    linked: bool,
    csrf: String,
    slack_user: String,
    slack_team: String,
    member_name: String,
    role: String,
}

/// Shows which Slack user the link names and asks the member to confirm.
pub async fn link_page(
    State(state): State<AppState>,
    member: ConsoleMember,
    Path(token): Path<String>,
) -> Result<Response, ConsoleError> {
    let link = state
        .store
        .slack_link(member.session.project_id, &token)
        .await?
        .ok_or(ConsoleError(ApiError::NotFound))?;
    Ok(render(
        StatusCode::OK,
        &SlackLinkPage {
            linked: false,
            csrf: member.session.csrf_token.clone(),
            slack_user: link.slack_user_id,
            slack_team: link.team_id,
            member_name: member.session.member_name.clone(),
            role: member.session.role.to_string(),
        },
    ))
}

/// Links the Slack user to the signed-in member (the CSRF gate has checked the form token).
pub async fn link(
    State(state): State<AppState>,
    member: ConsoleMember,
    Path(token): Path<String>,
) -> Result<Response, ConsoleError> {
    let link = state
        .engine
        .link_slack_identity(member.session.project_id, &token, member.session.member_id)
        .await?;
    tracing::info!(category = "console", action = "slack.link", project_id = %member.session.project_id,
        member_id = %member.session.member_id, "slack identity linked");
    Ok(render(
        StatusCode::OK,
        &SlackLinkPage {
            linked: true,
            csrf: String::new(),
            slack_user: link.slack_user_id,
            slack_team: link.team_id,
            member_name: member.session.member_name.clone(),
            role: member.session.role.to_string(),
        },
    ))
}
