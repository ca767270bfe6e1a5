//! The internal API workers call, under `/internal/v1`: so far enrolment and a heartbeat.
//!
//! It has its own authentication, apart from the public API's: an enrolment token in the body,
//! then requests signed with the worker's key ([`authenticate_worker`]). A bearer credential of any kind is refused
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
/// The path of a worker's heartbeat, its first signed request.
pub const HEARTBEAT_PATH: &str = "/internal/v1/workers/heartbeat";
/// How far a worker's request timestamp may be from this server's clock, in seconds.
pub const WORKER_REQUEST_SKEW_SECS: i64 = 30;
/// The largest body of a worker's signed request.
const MAX_WORKER_BODY_BYTES: usize = 1024 * 1024;

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
        .route(HEARTBEAT_PATH, post(heartbeat))
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

/// What a worker's heartbeat answers.
#[derive(Debug, serde::Serialize)]
pub struct HeartbeatResponse {
    pub worker_id: String,
}

/// Why a worker's signed request was refused; logged, and named in the 401 it answers.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WorkerAuthError {
    #[error("{0}")]
    Request(#[from] wor_secrets::WorkerRequestError),
    #[error("worker is not enrolled")]
    UnknownWorker,
    #[error("worker is revoked")]
    Revoked,
    #[error("request nonce was already used: a replay")]
    Replayed,
}

/// The enrolled, active worker that signed `parts` and `body`: the signature under its stored
/// key, the timestamp within [`WORKER_REQUEST_SKEW_SECS`], and a nonce no API process has seen.
///
/// # Errors
/// [`ApiError::WorkerUnauthenticated`] naming the reason, or a store error.
pub async fn authenticate_worker(
    state: &AppState,
    parts: &axum::http::request::Parts,
    body: &[u8],
) -> Result<wor_store::WorkerRecord, ApiError> {
    let refused = |reason: WorkerAuthError| {
        tracing::warn!(category = "auth", action = "worker.request_refused",
            reason = %reason, "a worker request was refused");
        ApiError::WorkerUnauthenticated(reason.to_string())
    };
    let headers = wor_secrets::WorkerRequestHeaders::parse(|name| {
        parts.headers.get(name).and_then(|v| v.to_str().ok())
    })
    .map_err(|e| refused(e.into()))?;
    let worker = state
        .store
        .worker(&headers.worker_id)
        .await?
        .ok_or_else(|| refused(WorkerAuthError::UnknownWorker))?;
    if worker.status != wor_store::WorkerStatus::Active {
        return Err(refused(WorkerAuthError::Revoked));
    }
    let keys =
        WorkerPublicKeys::from_base64(&worker.signing_public_key, &worker.exchange_public_key)
            .map_err(|_| {
                tracing::error!(category = "auth", worker_id = %worker.id,
                "a stored worker key does not parse");
                ApiError::Internal
            })?;
    let path = parts
        .uri
        .path_and_query()
        .map_or_else(|| parts.uri.path(), |p| p.as_str());
    let now = wor_store::now_millis() / 1000;
    headers
        .verify(
            &keys,
            &wor_secrets::RequestToSign {
                method: parts.method.as_str(),
                path_and_query: path,
                body,
            },
            now,
            WORKER_REQUEST_SKEW_SECS,
        )
        .map_err(|e| refused(e.into()))?;
    let fresh = state
        .store
        .remember_worker_request_nonce(
            &worker.id,
            &headers.nonce_hex(),
            // Kept for twice the window: another process whose clock runs ahead by up to the
            // window forgets nonces by its own clock, and this one still accepts the request.
            headers
                .timestamp
                .saturating_add(WORKER_REQUEST_SKEW_SECS.saturating_mul(2)),
        )
        .await?;
    if !fresh {
        return Err(refused(WorkerAuthError::Replayed));
    }
    state.store.touch_worker(&worker.id).await?;
    Ok(worker)
}

/// A worker says it is alive; the first building block of the signed internal API.
async fn heartbeat(
    State(state): State<AppState>,
    request: Request,
) -> Result<Json<HeartbeatResponse>, ApiError> {
    let (parts, body) = request.into_parts();
    let body = axum::body::to_bytes(body, MAX_WORKER_BODY_BYTES)
        .await
        .map_err(|_| ApiError::PayloadTooLarge)?;
    let worker = authenticate_worker(&state, &parts, &body).await?;
    Ok(Json(HeartbeatResponse {
        worker_id: worker.id,
    }))
}
