//! The internal API workers call, under `/internal/v1`: so far only enrolment.
//!
//! It has its own authentication, apart from the public API's: an enrolment token in the body
//! (later, requests signed with the worker's key). A bearer credential of any kind is refused
//! here before anything is read, so an API key never opens the internal API; an enrolment token
//! or a worker key is no API key, so neither opens the public one. These routes are not in the
//! public OpenAPI document; `docs/deployment.md` describes them.

use std::sync::Arc;

use axum::Json;
use axum::Router;
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse as _, Response};
use axum::routing::post;
use wor_secrets::{ControlPlaneSigningKey, WorkerPublicKeys};
use wor_store::{EnrolmentRefusal, WORKER_ENROLMENT_TOKEN_PREFIX};

use crate::AppState;
use crate::error::ApiError;
use crate::extract::ApiJson;

/// The path of worker enrolment.
pub const ENROLL_PATH: &str = "/internal/v1/workers/enroll";

/// What a worker sends to enrol.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnrollRequest {
    /// The single-use token an operator made with `wor worker token create`.
    pub token: String,
    /// A name for the worker, for operators.
    pub name: String,
    /// Standard base64 of the worker's Ed25519 public key.
    pub signing_public_key: String,
    /// Standard base64 of the worker's X25519 public key.
    pub exchange_public_key: String,
}

/// What an enrolled worker keeps: its id and the key that signs its envelopes.
#[derive(Debug, serde::Serialize)]
pub struct EnrollResponse {
    pub worker_id: String,
    pub control_plane_verifying_key: String,
}

pub(crate) fn router() -> Router<AppState> {
    Router::new()
        .route(ENROLL_PATH, post(enroll))
        .layer(axum::middleware::from_fn(refuse_bearer_credentials))
}

/// No bearer credential opens an internal route, whatever it is.
async fn refuse_bearer_credentials(request: Request, next: Next) -> Response {
    if request.headers().contains_key(header::AUTHORIZATION) {
        tracing::warn!(
            category = "auth",
            action = "internal.bearer_refused",
            "a bearer credential was refused on the internal API"
        );
        return ApiError::InternalCredentialRefused.into_response();
    }
    next.run(request).await
}

fn check_name(name: &str) -> Result<(), ApiError> {
    if name.is_empty()
        || name.len() > 100
        || name.trim() != name
        || name.chars().any(char::is_control)
    {
        return Err(ApiError::bad_request(
            "invalid_name",
            "worker name must be 1 to 100 characters with no control characters or surrounding space",
        ));
    }
    Ok(())
}

async fn enroll(
    State(state): State<AppState>,
    ApiJson(request): ApiJson<EnrollRequest>,
) -> Result<(StatusCode, Json<EnrollResponse>), ApiError> {
    let control_plane: &Arc<ControlPlaneSigningKey> = state
        .control_plane
        .as_ref()
        .ok_or_else(|| ApiError::Unavailable("this server does not enrol workers".to_owned()))?;
    check_name(&request.name)?;
    let keys =
        WorkerPublicKeys::from_base64(&request.signing_public_key, &request.exchange_public_key)
            .map_err(|e| ApiError::bad_request("invalid_public_key", e.to_string()))?;
    if !request.token.starts_with(WORKER_ENROLMENT_TOKEN_PREFIX) {
        return Err(ApiError::EnrolmentRefused(EnrolmentRefusal::Unknown));
    }
    let worker = state
        .store
        .enroll_worker(
            &request.token,
            &request.name,
            &keys.signing_base64(),
            &keys.exchange_base64(),
        )
        .await?
        .map_err(|refusal| {
            tracing::warn!(category = "auth", action = "worker.enrolment_refused",
                reason = ?refusal, "a worker enrolment was refused");
            ApiError::EnrolmentRefused(refusal)
        })?;
    tracing::info!(category = "lifecycle", action = "worker.enrolled",
        worker_id = %worker.id, "a worker enrolled");
    Ok((
        StatusCode::CREATED,
        Json(EnrollResponse {
            worker_id: worker.id,
            control_plane_verifying_key: wor_secrets::verifying_key_to_base64(
                &control_plane.verifying_key(),
            ),
        }),
    ))
}
