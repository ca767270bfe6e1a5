//! Members: the list, and for an admin or owner an invitation form whose link is shown once
//! and a role form on each member they may change. Inviting is the API's `invite_member` and
//! changing a role the API's `change_member_role`: the same rules on who may do what to whom.

use askama::Template;
use axum::Form;
use axum::extract::State;
use axum::extract::rejection::FormRejection;
use axum::http::StatusCode;
use wor_core::{MemberId, Role};
use wor_store::RoleChanger;

use super::pages::{Banner, PageResult, form};
use super::session::ConsoleMember;
use super::{ConsoleError, PagePath, render};
use crate::AppState;
use crate::error::ApiError;
use crate::routes::invitations::{CreateInvitation, invite_member};
use crate::routes::members::change_member_role;
use crate::views::rfc3339;

struct MemberRow {
    id: String,
    name: String,
    role: String,
    created_at: String,
    /// The roles this member may be given by the one signed in; empty when they may not
    /// change this member's role (not an admin, or the member outranks them).
    roles: Vec<&'static str>,
}

/// What the page says about the last form sent.
enum Outcome {
    None,
    /// An invitation just made: its link is shown this once.
    Invited(Invited),
    /// An invitation refused for what was typed: the name, and why.
    InviteRefused {
        name: String,
        error: String,
    },
    /// A role changed, or was already what was asked.
    RoleChanged {
        name: String,
        role: Role,
        changed: bool,
    },
    /// A role change refused, and why.
    RoleRefused(String),
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
    /// What came of a role change just asked for.
    role_notice: Option<String>,
    role_error: Option<String>,
}

async fn members_page(
    state: &AppState,
    member: &ConsoleMember,
    status: StatusCode,
    outcome: Outcome,
) -> PageResult {
    let role = member.session.role;
    let grantable: Vec<&'static str> = Role::ALL
        .into_iter()
        .filter(|r| role.can_grant(*r))
        .map(Role::as_str)
        .collect();
    let members = state
        .store
        .list_members(member.session.project_id)
        .await?
        .into_iter()
        .map(|m| MemberRow {
            id: m.id.to_string(),
            roles: if role.may_change_role(m.role, m.role).is_ok() {
                grantable.clone()
            } else {
                Vec::new()
            },
            name: m.name,
            role: m.role.to_string(),
            created_at: rfc3339(m.created_at),
        })
        .collect();
    let (mut invited, mut name, mut error, mut role_notice, mut role_error) =
        (None, String::new(), None, None, None);
    match outcome {
        Outcome::None => {}
        Outcome::Invited(i) => invited = Some(i),
        Outcome::InviteRefused { name: n, error: e } => (name, error) = (n, Some(e)),
        Outcome::RoleChanged {
            name,
            role,
            changed,
        } => {
            role_notice = Some(if changed {
                format!(
                    "{name} is now {role}, from their next request: in their console sessions, and for each of their keys up to the role the key was made with."
                )
            } else {
                format!("{name} already has role {role}; nothing changed.")
            });
        }
        Outcome::RoleRefused(e) => role_error = Some(e),
    }
    Ok(render(
        status,
        &MembersPage {
            banner: member.into(),
            members,
            grantable,
            invited,
            error,
            name,
            role_notice,
            role_error,
        },
    ))
}

pub async fn list(State(state): State<AppState>, member: ConsoleMember) -> PageResult {
    members_page(&state, &member, StatusCode::OK, Outcome::None).await
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
            members_page(
                &state,
                &member,
                StatusCode::CREATED,
                Outcome::Invited(invited),
            )
            .await
        }
        Err(ApiError::BadRequest { message, .. }) => {
            members_page(
                &state,
                &member,
                StatusCode::BAD_REQUEST,
                Outcome::InviteRefused {
                    name: body.name,
                    error: message,
                },
            )
            .await
        }
        Err(other) => Err(ConsoleError(other)),
    }
}

#[derive(Debug, serde::Deserialize)]
pub struct RoleForm {
    role: String,
}

/// Changes a member's role under the API's rules; a refusal (a role above one's own, a member
/// who outranks one, the last owner) is shown on the page with its status.
pub async fn change_role(
    State(state): State<AppState>,
    member: ConsoleMember,
    PagePath(id): PagePath<MemberId>,
    body: Result<Form<RoleForm>, FormRejection>,
) -> PageResult {
    let body = form(body)?;
    let session = member.session.clone();
    let changer = RoleChanger {
        role: session.role,
        member: Some(session.member_id),
    };
    match change_member_role(
        &state,
        session.project_id,
        changer,
        member.actor(),
        id,
        &body.role,
    )
    .await
    {
        Ok(change) => {
            // A member who changed their own role sees the page their new role gives them.
            let mut member = member;
            if change.member.id == member.session.member_id {
                member.session.role = change.member.role;
            }
            let outcome = Outcome::RoleChanged {
                changed: change.changed(),
                name: change.member.name,
                role: change.member.role,
            };
            members_page(&state, &member, StatusCode::OK, outcome).await
        }
        Err(
            error @ (ApiError::Forbidden(_) | ApiError::LastOwner(_) | ApiError::BadRequest { .. }),
        ) => {
            let status = error.status_and_code().0;
            members_page(
                &state,
                &member,
                status,
                Outcome::RoleRefused(error.to_string()),
            )
            .await
        }
        Err(other) => Err(ConsoleError(other)),
    }
}
