//! Invitations to the web console: a single-use link where a member sets their password.

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use serde_json::json;
use wor_core::audit::{Actor, AuditCategory, AuditEvent};
use wor_core::{ApiKeyId, ProjectId, Role};

use crate::AppState;
use crate::auth::Configurer;
use crate::error::{ApiError, ErrorBody};
use crate::extract::ApiJson;
use crate::routes::members::{check_name, parse_role};
use crate::views::millis;
use crate::views::{MemberView, rfc3339};

#[derive(Debug, serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateInvitation {
    /// The member's name. A new name adds a member with `role`; an existing member's name
    /// invites them (to set or replace their console password).
    pub name: String,
    /// The new member's role; for an existing member it may be left out, and must match.
    pub role: Option<String>,
}

#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct CreatedInvitation {
    pub member: MemberView,
    /// Whether the member was added by this invitation.
    pub new_member: bool,
    /// The link's path on this server, holding the single-use token; shown once.
    pub path: String,
    pub expires_at: String,
}

/// Invites a member to the console: returns a single-use link, once, that expires.
#[utoipa::path(post, path = "/v1/invitations", tag = "members", security(("bearer" = [])),
    request_body = CreateInvitation,
    responses((status = 201, body = CreatedInvitation), (status = 400, body = ErrorBody),
        (status = 403, body = ErrorBody)))]
pub async fn invite(
    State(state): State<AppState>,
    Configurer(caller): Configurer,
    ApiJson(body): ApiJson<CreateInvitation>,
) -> Result<(StatusCode, Json<CreatedInvitation>), ApiError> {
    // The link sets the member's password: a service key that could invite could sign in as a
    // person, and approve the calls of the runs it starts.
    caller.require_member(
        "invite a member to the console, as the link it would be given sets their password",
    )?;
    let created = invite_member(
        &state,
        caller.project_id,
        caller.role,
        caller.actor(),
        Some(caller.key_id),
        &body,
    )
    .await?;
    Ok((StatusCode::CREATED, Json(created)))
}

/// Invites `body.name` (adding them with `body.role` if new) for a caller with `caller_role`
/// in `project`, audited as `actor`: the API's and the console's one path. Nobody invites a
/// member whose role they could not grant, and a refused invitation adds nobody.
pub(crate) async fn invite_member(
    state: &AppState,
    project: ProjectId,
    caller_role: Role,
    actor: Actor,
    key: Option<ApiKeyId>,
    body: &CreateInvitation,
) -> Result<CreatedInvitation, ApiError> {
    crate::auth::require_configure(caller_role)?;
    check_name(&body.name, "member")?;
    let role = body.role.as_deref().map(parse_role).transpose()?;
    let existing = state
        .store
        .list_members(project)
        .await?
        .into_iter()
        .find(|m| m.name == body.name);
    let (member, new_member) = match existing {
        Some(member) => {
            if role.is_some_and(|role| role != member.role) {
                return Err(ApiError::bad_request(
                    "invalid_role",
                    format!(
                        "member `{}` has role `{}`; an invitation does not change a role",
                        member.name, member.role
                    ),
                ));
            }
            (member, false)
        }
        None => {
            let role = role.ok_or_else(|| {
                ApiError::bad_request(
                    "invalid_role",
                    format!(
                        "there is no member `{}`; give a role to add them",
                        body.name
                    ),
                )
            })?;
            // Checked before the member exists: a refused invitation leaves nothing behind.
            if !caller_role.can_grant(role) {
                return Err(ApiError::Forbidden(format!(
                    "role `{}` cannot invite a member with role `{role}`",
                    caller_role
                )));
            }
            // The entry is staged with the member: a crash before it is appended leaves it
            // for the audit writer's sweep.
            let entry = |member: &wor_store::MemberRecord| {
                AuditEvent::new(project, AuditCategory::MemberCreate, actor.clone())
                    .subject("member_id", member.id)
                    .payload(json!({ "name": member.name, "role": member.role }))
            };
            let (member, staged) = state
                .store
                .create_member_staged(project, &body.name, role, Some(&entry))
                .await?;
            state.engine.append_staged_or_log(staged).await;
            (member, true)
        }
    };
    // Inviting someone sets their password: never for a role the caller could not grant.
    if !caller_role.can_grant(member.role) {
        return Err(ApiError::Forbidden(format!(
            "role `{}` cannot invite a member with role `{}`",
            caller_role, member.role
        )));
    }
    let entry = |expires_at: i64| {
        AuditEvent::new(project, AuditCategory::MemberInvite, actor.clone())
            .subject("member_id", member.id)
            .payload(json!({ "expires_at": rfc3339(expires_at) }))
    };
    let (token, expires_at, staged) = state
        .store
        .create_invitation_staged(
            project,
            member.id,
            key,
            millis(state.console.invitation_ttl),
            Some(&entry),
        )
        .await?;
    state.engine.append_staged_or_log(staged).await;
    tracing::info!(category = "config", action = "member.invite", project_id = %project,
        member_id = %member.id, "member invited to the console");
    Ok(CreatedInvitation {
        member: member.into(),
        new_member,
        path: format!("/console/invitations/{}", token.expose()),
        expires_at: rfc3339(expires_at),
    })
}
