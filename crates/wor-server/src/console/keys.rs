//! API keys: the project's keys by prefix, and creating one, shown once on the answer. Creating
//! is the API's `create_api_key`: a personal key never above the member's role, a service key
//! only by an admin and never above what they could grant. Revoking is the API's
//! `revoke_api_key`: a member revokes their own keys, an admin or owner any key.

use askama::Template;
use axum::Form;
use axum::extract::State;
use axum::extract::rejection::FormRejection;
use axum::http::StatusCode;
use wor_core::{ApiKeyId, Role};

use super::pages::{Banner, PageResult, form};
use super::session::ConsoleMember;
use super::{ConsoleError, PagePath, render};
use crate::AppState;
use crate::error::ApiError;
use crate::routes::keys::{CreateApiKey, create_api_key, revoke_api_key};
use crate::views::rfc3339;

struct KeyRow {
    id: String,
    name: String,
    prefix: String,
    role: String,
    /// The role a personal key acts with now, when its member's demotion lowered it.
    lowered_to: Option<String>,
    kind: &'static str,
    created_at: String,
    revoked: bool,
    /// Whether this member may revoke it (their own key, or any for an admin).
    may_revoke: bool,
}

/// A key just made: shown this once.
struct CreatedKey {
    name: String,
    secret: String,
}

#[derive(Template)]
#[template(path = "console/keys.html")]
struct KeysPage {
    banner: Banner,
    keys: Vec<KeyRow>,
    roles: Vec<&'static str>,
    may_make_service_keys: bool,
    created: Option<CreatedKey>,
    error: Option<String>,
    /// The key just revoked, by name.
    revoked: Option<String>,
}

async fn keys_page(
    state: &AppState,
    member: &ConsoleMember,
    status: StatusCode,
    created: Option<CreatedKey>,
    error: Option<String>,
    revoked: Option<String>,
) -> PageResult {
    let keys = state
        .store
        .list_api_keys(member.session.project_id)
        .await?
        .into_iter()
        .map(|k| KeyRow {
            may_revoke: k.revoked_at.is_none()
                && (member.session.role.can_configure()
                    || k.member_id == Some(member.session.member_id)),
            id: k.id.to_string(),
            name: k.name,
            prefix: k.prefix,
            role: k.role.to_string(),
            lowered_to: (k.acts_as != k.role).then(|| k.acts_as.to_string()),
            kind: if k.service { "service" } else { "personal" },
            created_at: rfc3339(k.created_at),
            revoked: k.revoked_at.is_some(),
        })
        .collect();
    let role = member.session.role;
    Ok(render(
        status,
        &KeysPage {
            banner: member.into(),
            keys,
            roles: Role::ALL
                .into_iter()
                .filter(|r| role.includes(*r))
                .map(Role::as_str)
                .collect(),
            may_make_service_keys: role.can_configure(),
            created,
            error,
            revoked,
        },
    ))
}

pub async fn list(State(state): State<AppState>, member: ConsoleMember) -> PageResult {
    keys_page(&state, &member, StatusCode::OK, None, None, None).await
}

#[derive(Debug, serde::Deserialize)]
pub struct KeyForm {
    name: String,
    role: String,
    /// `on` for a service key.
    #[serde(default)]
    service: Option<String>,
}

pub async fn create(
    State(state): State<AppState>,
    member: ConsoleMember,
    body: Result<Form<KeyForm>, FormRejection>,
) -> PageResult {
    let body = form(body)?;
    let request = CreateApiKey {
        name: body.name,
        role: body.role,
        service: body.service.is_some(),
    };
    let session = &member.session;
    match create_api_key(
        &state,
        session.project_id,
        session.role,
        Some(session.member_id),
        member.actor(),
        None,
        &request,
    )
    .await
    {
        Ok(created) => {
            let shown = CreatedKey {
                name: request.name,
                secret: created.api_key,
            };
            keys_page(
                &state,
                &member,
                StatusCode::CREATED,
                Some(shown),
                None,
                None,
            )
            .await
        }
        Err(ApiError::BadRequest { message, .. }) => {
            keys_page(
                &state,
                &member,
                StatusCode::BAD_REQUEST,
                None,
                Some(message),
                None,
            )
            .await
        }
        Err(other) => Err(ConsoleError(other)),
    }
}

/// Revokes a key through the API's path (the CSRF gate has checked the form token).
pub async fn revoke(
    State(state): State<AppState>,
    member: ConsoleMember,
    PagePath(key_id): PagePath<ApiKeyId>,
) -> PageResult {
    let session = &member.session;
    let revoked = revoke_api_key(
        &state,
        session.project_id,
        session.role,
        Some(session.member_id),
        member.actor(),
        key_id,
    )
    .await?;
    keys_page(
        &state,
        &member,
        StatusCode::OK,
        None,
        None,
        Some(revoked.name),
    )
    .await
}
