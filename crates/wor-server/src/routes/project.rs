//! The caller's own project, and who the caller is.

use axum::Json;
use axum::extract::State;

use crate::AppState;
use crate::auth::Caller;
use crate::error::ApiError;
use crate::views::{ProjectView, WhoAmI};

/// The project the calling key belongs to.
#[utoipa::path(get, path = "/v1/project", tag = "project", security(("bearer" = [])),
    responses((status = 200, body = ProjectView), (status = 401, body = crate::error::ErrorBody)))]
pub async fn get_project(
    State(state): State<AppState>,
    caller: Caller,
) -> Result<Json<ProjectView>, ApiError> {
    Ok(Json(
        state.store.get_project(caller.project_id).await?.into(),
    ))
}

/// The calling key: its project, member (for a personal key) and role.
#[utoipa::path(get, path = "/v1/whoami", tag = "project", security(("bearer" = [])),
    responses((status = 200, body = WhoAmI), (status = 401, body = crate::error::ErrorBody)))]
pub async fn whoami(
    State(state): State<AppState>,
    caller: Caller,
) -> Result<Json<WhoAmI>, ApiError> {
    let project = state.store.get_project(caller.project_id).await?;
    Ok(Json(WhoAmI {
        project: project.into(),
        key_id: caller.key_id.to_string(),
        member_id: caller.member_id.map(|m| m.to_string()),
        role: caller.role.to_string(),
        service: caller.member_id.is_none(),
    }))
}
