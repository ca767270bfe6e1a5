//! Invitations to the web console: a single-use link where a member sets their password.

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use serde_json::json;
use wor_core::audit::{AuditCategory, AuditEvent};

use crate::AppState;
use crate::auth::Caller;
use crate::console::millis;
use crate::error::{ApiError, ErrorBody};
use crate::extract::ApiJson;
use crate::routes::members::{check_name, parse_role};
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
    caller: Caller,
    ApiJson(body): ApiJson<CreateInvitation>,
) -> Result<(StatusCode, Json<CreatedInvitation>), ApiError> {
    caller.require_configure()?;
    check_name(&body.name, "member")?;
    let role = body.role.as_deref().map(parse_role).transpose()?;
    let project = caller.project_id;
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
            if !caller.role.can_grant(role) {
                return Err(ApiError::Forbidden(format!(
                    "role `{}` cannot invite a member with role `{role}`",
                    caller.role
                )));
            }
            (
                state.store.create_member(project, &body.name, role).await?,
                true,
            )
        }
    };
    // Inviting someone sets their password: never for a role the caller could not grant.
    if !caller.role.can_grant(member.role) {
        return Err(ApiError::Forbidden(format!(
            "role `{}` cannot invite a member with role `{}`",
            caller.role, member.role
        )));
    }
    if new_member {
        state
            .audit
            .append(
                AuditEvent::new(project, AuditCategory::MemberCreate, caller.actor())
                    .subject("member_id", member.id)
                    .payload(json!({ "name": member.name, "role": member.role })),
            )
            .await?;
    }
    let (token, expires_at) = state
        .store
        .create_invitation(
            project,
            member.id,
            Some(caller.key_id),
            millis(state.console.invitation_ttl),
        )
        .await?;
    state
        .audit
        .append(
            AuditEvent::new(project, AuditCategory::MemberInvite, caller.actor())
                .subject("member_id", member.id)
                .payload(json!({ "expires_at": rfc3339(expires_at) })),
        )
        .await?;
    tracing::info!(category = "config", action = "member.invite", project_id = %project,
        member_id = %member.id, actor_key_id = %caller.key_id, "member invited to the console");
    Ok((
        StatusCode::CREATED,
        Json(CreatedInvitation {
            member: member.into(),
            new_member,
            path: format!("/console/invitations/{}", token.expose()),
            expires_at: rfc3339(expires_at),
        }),
    ))
}
