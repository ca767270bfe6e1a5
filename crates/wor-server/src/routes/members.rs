//! Members of the caller's project.

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use serde_json::json;
use wor_core::audit::{Actor, AuditCategory, AuditEvent};
use wor_core::{MemberId, ProjectId, Role};
use wor_store::{ApiKeyKind, NewApiKey, RoleChange, RoleChanger};

use crate::AppState;
use crate::auth::{Caller, Configurer};
use crate::error::{ApiError, ErrorBody};
use crate::extract::{ApiJson, ApiPath};
use crate::views::{CreatedApiKey, MemberView};

#[derive(Debug, serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateMember {
    pub name: String,
    /// One of `owner`, `admin`, `approver`, `viewer`; never above the caller's own role.
    pub role: String,
}

#[derive(Debug, serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ChangeMemberRole {
    /// The member's new role: one of `owner`, `admin`, `approver`, `viewer`; never above the
    /// caller's own role.
    pub role: String,
}

#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct CreatedMember {
    pub member: MemberView,
    /// The new member's first personal key, shown once.
    pub key: CreatedApiKey,
}

pub(crate) fn parse_role(text: &str) -> Result<Role, ApiError> {
    text.parse()
        .map_err(|e: wor_core::RoleParseError| ApiError::bad_request("invalid_role", e.to_string()))
}

/// `Ok` for a usable name ([`wor_core::name::check_name`]), else a 400 naming `what`.
pub(crate) fn check_name(name: &str, what: &str) -> Result<(), ApiError> {
    wor_core::name::check_name(name)
        .map_err(|err| ApiError::bad_request("invalid_name", format!("{what} name {err}")))
}

/// Lists the project's members.
#[utoipa::path(get, path = "/v1/members", tag = "members", security(("bearer" = [])),
    responses((status = 200, body = [MemberView]), (status = 401, body = ErrorBody)))]
pub async fn list_members(
    State(state): State<AppState>,
    caller: Caller,
) -> Result<Json<Vec<MemberView>>, ApiError> {
    let members = state.store.list_members(caller.project_id).await?;
    Ok(Json(members.into_iter().map(Into::into).collect()))
}

/// Adds a member and returns their first personal key, once.
#[utoipa::path(post, path = "/v1/members", tag = "members", security(("bearer" = [])),
    request_body = CreateMember,
    responses((status = 201, body = CreatedMember), (status = 400, body = ErrorBody),
        (status = 403, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn create_member(
    State(state): State<AppState>,
    Configurer(caller): Configurer,
    ApiJson(body): ApiJson<CreateMember>,
) -> Result<(StatusCode, Json<CreatedMember>), ApiError> {
    check_name(&body.name, "member")?;
    let role = parse_role(&body.role)?;
    // The answer holds the new member's key: a service key that could add members could act
    // as a person, and approve the calls of the runs it starts.
    caller.require_member("add a member, whose key it would be given")?;
    if !caller.role.can_grant(role) {
        return Err(ApiError::Forbidden(format!(
            "role `{}` cannot grant role `{role}`",
            caller.role
        )));
    }
    let project = caller.project_id;
    // Each entry is staged with its change: a crash before they are appended leaves them for
    // the audit writer's sweep, never a member or a key without its entry.
    let member_entry = |member: &wor_store::MemberRecord| {
        AuditEvent::new(project, AuditCategory::MemberCreate, caller.actor())
            .subject("member_id", member.id)
            .payload(json!({ "name": member.name, "role": role }))
    };
    let (member, staged) = state
        .store
        .create_member_staged(project, &body.name, role, Some(&member_entry))
        .await?;
    state.engine.append_staged_or_log(staged).await;
    let key_entry =
        |record: &wor_store::ApiKeyRecord| crate::routes::keys::key_created(record, caller.actor());
    let (record, key, staged) = state
        .store
        .create_api_key_staged(
            project,
            NewApiKey {
                name: format!("{} (initial key)", member.name),
                role,
                kind: ApiKeyKind::Personal(member.id),
                created_by: Some(caller.key_id),
            },
            Some(&key_entry),
        )
        .await?;
    state.engine.append_staged_or_log(staged).await;
    tracing::info!(category = "config", action = "member.create", project_id = %caller.project_id,
        member_id = %member.id, actor_key_id = %caller.key_id, "member created");
    Ok((
        StatusCode::CREATED,
        Json(CreatedMember {
            member: member.into(),
            key: CreatedApiKey {
                key: record.into(),
                api_key: key.expose().to_owned(),
            },
        }),
    ))
}

/// One member of the project.
#[utoipa::path(get, path = "/v1/members/{member_id}", tag = "members", security(("bearer" = [])),
    params(("member_id" = String, Path, description = "a `mem_…` id", pattern = "^mem_[0-9a-f]{32}$")),
    responses((status = 200, body = MemberView), (status = 404, body = ErrorBody)))]
pub async fn get_member(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(member_id): ApiPath<MemberId>,
) -> Result<Json<MemberView>, ApiError> {
    Ok(Json(
        state
            .store
            .get_member(caller.project_id, member_id)
            .await?
            .into(),
    ))
}

/// Changes a member's role. The caller must be an admin or owner whose role includes both the
/// member's role and the new one (403); the project's last owner with a live owner key cannot
/// be demoted (409 `last_owner`). The new role holds from the member's next request, for all
/// of their keys (never above the role each key was made with) and console sessions.
#[utoipa::path(patch, path = "/v1/members/{member_id}", tag = "members", security(("bearer" = [])),
    params(("member_id" = String, Path, description = "a `mem_…` id", pattern = "^mem_[0-9a-f]{32}$")),
    request_body = ChangeMemberRole,
    responses((status = 200, body = MemberView), (status = 400, body = ErrorBody),
        (status = 403, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody)))]
pub async fn change_role(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(member_id): ApiPath<MemberId>,
    ApiJson(body): ApiJson<ChangeMemberRole>,
) -> Result<Json<MemberView>, ApiError> {
    let changer = RoleChanger {
        role: caller.role,
        member: caller.member_id,
    };
    let change = change_member_role(
        &state,
        caller.project_id,
        changer,
        caller.actor(),
        member_id,
        &body.role,
    )
    .await?;
    Ok(Json(change.member.into()))
}

/// Gives member `member_id` of `project` the role named `role`, for `changer`, audited as
/// `actor`: the API's and the console's one path. The rules are the store's, checked under
/// the project's lock ([`wor_store::Store::change_member_role`]); a change is audited, asking
/// for the role a member already has records nothing.
pub(crate) async fn change_member_role(
    state: &AppState,
    project: ProjectId,
    changer: RoleChanger,
    actor: Actor,
    member_id: MemberId,
    role: &str,
) -> Result<RoleChange, ApiError> {
    let role = parse_role(role)?;
    // The entry is staged with the change, and only when the role changed.
    let recorded = |change: &RoleChange| {
        AuditEvent::new(project, AuditCategory::MemberRoleChange, actor.clone())
            .subject("member_id", member_id)
            .payload(json!({
                "name": change.member.name,
                "from": change.previous,
                "to": change.member.role,
            }))
    };
    let (change, staged) = state
        .store
        .change_member_role_staged(project, member_id, role, changer, Some(&recorded))
        .await?;
    if staged.is_some() {
        state.engine.append_staged_or_log(staged).await;
        tracing::info!(category = "config", action = "member.role_change", project_id = %project,
            member_id = %member_id, "member role changed");
    }
    Ok(change)
}
