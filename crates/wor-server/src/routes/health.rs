//! Liveness and readiness probes. They carry no project data and need no key.

use axum::Json;
use axum::extract::State;

use crate::AppState;

/// How long readiness waits for the database.
const READY_WITHIN: std::time::Duration = std::time::Duration::from_secs(2);
use crate::error::ApiError;

#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct HealthStatus {
    pub status: &'static str,
}

/// The process is up.
#[utoipa::path(get, path = "/healthz", tag = "health",
    responses((status = 200, body = HealthStatus)))]
pub async fn healthz() -> Json<HealthStatus> {
    Json(HealthStatus { status: "ok" })
}

/// The process can serve: the database answers.
#[utoipa::path(get, path = "/readyz", tag = "health",
    responses((status = 200, body = HealthStatus), (status = 503, body = crate::error::ErrorBody)))]
pub async fn readyz(State(state): State<AppState>) -> Result<Json<HealthStatus>, ApiError> {
    // Answered within a probe's usual timeout: a database that does not answer in time is as
    // good as down, however long the pool would wait for a connection.
    tokio::time::timeout(READY_WITHIN, state.store.ping())
        .await
        .map_err(|_| ApiError::Unavailable("database did not answer in time".to_owned()))?
        .map_err(|_| ApiError::Unavailable("database is not reachable".to_owned()))?;
    Ok(Json(HealthStatus { status: "ready" }))
}
