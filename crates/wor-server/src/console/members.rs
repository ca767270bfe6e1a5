//! Members: the list, and for an admin or owner an invitation form whose link is shown once.
//! Inviting is the API's `invite_member`: the same rules on who may invite whom.

use askama::Template;
use axum::Form;
use axum::extract::State;
use axum::extract::rejection::FormRejection;
use axum::http::StatusCode;
use wor_core::Role;

use super::pages::{Banner, PageResult, form};
use super::session::ConsoleMember;
use super::{ConsoleError, render};
use crate::AppState;
use crate::error::ApiError;
use crate::routes::invitations::{CreateInvitation, invite_member};
use crate::views::rfc3339;

struct MemberRow {
    name: String,
    role: String,
    created_at: String,
}

/// An invitation just made: its link is shown this once.
struct Invited {
    name: String,
    path: String,
    expires_at: String,
    new_member: bool,
}

#[derive(Template)]
#[template(path = "console/members.html")]
struct MembersPage {
    banner: Banner,
    members: Vec<MemberRow>,
    /// Roles this member may grant; empty when they may not invite.
    grantable: Vec<&'static str>,
    invited: Option<Invited>,
    error: Option<String>,
    name: String,
}

async fn members_page(
    state: &AppState,
    member: &ConsoleMember,
    status: StatusCode,
    invited: Option<Invited>,
    refused: Option<(String, String)>,
) -> PageResult {
    let members = state
        .store
        .list_members(member.session.project_id)
        .await?
        .into_iter()
        .map(|m| MemberRow {
            name: m.name,
            role: m.role.to_string(),
            created_at: rfc3339(m.created_at),
        })
        .collect();
    let role = member.session.role;
    let (name, error) = refused.map_or((String::new(), None), |(n, e)| (n, Some(e)));
    Ok(render(
        status,
        &MembersPage {
            banner: member.into(),
            members,
            grantable: Role::ALL
                .into_iter()
                .filter(|r| role.can_grant(*r))
                .map(Role::as_str)
                .collect(),
            invited,
            error,
            name,
        },
    ))
}

pub async fn list(State(state): State<AppState>, member: ConsoleMember) -> PageResult {
    members_page(&state, &member, StatusCode::OK, None, None).await
}

#[derive(Debug, serde::Deserialize)]
pub struct InviteForm {
    name: String,
    /// Empty for an existing member (who keeps their role).
    #[serde(default)]
    role: String,
}

pub async fn invite(
    State(state): State<AppState>,
    member: ConsoleMember,
    body: Result<Form<InviteForm>, FormRejection>,
) -> PageResult {
    let body = form(body)?;
    let request = CreateInvitation {
        name: body.name.clone(),
        role: (!body.role.is_empty()).then(|| body.role.clone()),
    };
    let session = &member.session;
    match invite_member(
        &state,
        session.project_id,
        session.role,
        member.actor(),
        None,
        &request,
    )
    .await
    {
        Ok(created) => {
            let invited = Invited {
                name: body.name,
                path: created.path,
                expires_at: created.expires_at,
                new_member: created.new_member,
            };
            members_page(&state, &member, StatusCode::CREATED, Some(invited), None).await
        }
        Err(ApiError::BadRequest { message, .. }) => {
            members_page(
                &state,
                &member,
                StatusCode::BAD_REQUEST,
                None,
                Some((body.name, message)),
            )
            .await
        }
        Err(other) => Err(ConsoleError(other)),
    }
}
