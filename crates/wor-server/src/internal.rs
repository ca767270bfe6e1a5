//! The internal API workers call, under `/internal/v1`: enrolment, a heartbeat, and the
//! lease of a run — claiming one (with its envelope), renewing it and giving it back.
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
use crate::error::{ApiError, WorkerAuthError};
use crate::extract::ApiJson;
use crate::routes::members::check_name;

use wor_engine::worker_wire::{
    ApprovalUseAnswer, ClaimRequest, ClaimedRun, ClaimedStep, ClaimedVersion, EndRequest,
    HeartbeatAnswer, HeldRunRequest, LeaseAnswer, MAX_CLAIM_WAIT_MS, NestedAnswer, NestedRequest,
    ParkAnswer, ParkRequest, QuarantineAnswer, QuarantineRequest, RefuseRequest, StepsAnswer,
    StepsRequest, UseApprovalRequest,
};
pub use wor_engine::worker_wire::{CLAIM_PATH, ENROLL_PATH, HEARTBEAT_PATH};
/// How long an envelope may be opened after it is issued, at least: a worker opens it as it
/// arrives, so this only covers clock skew and a slow network.
const MIN_ENVELOPE_LIFETIME_SECS: i64 = 60;
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
        .route(CLAIM_PATH, post(claim))
        .route("/internal/v1/runs/{run_id}/lease", post(renew))
        .route("/internal/v1/runs/{run_id}/release", post(release))
        .route("/internal/v1/runs/{run_id}/refuse", post(refuse))
        .route("/internal/v1/runs/{run_id}/steps", post(record_steps))
        .route("/internal/v1/runs/{run_id}/end", post(end))
        .route("/internal/v1/runs/{run_id}/park", post(park))
        .route("/internal/v1/runs/{run_id}/nested", post(nested))
        .route("/internal/v1/runs/{run_id}/quarantine", post(quarantine))
        .route(
            "/internal/v1/runs/{run_id}/approvals/{approval_id}/use",
            post(use_approval),
        )
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

async fn enroll(
    State(state): State<AppState>,
    ApiJson(request): ApiJson<EnrollRequest>,
) -> Result<(StatusCode, Json<EnrollResponse>), ApiError> {
    let control_plane: &Arc<ControlPlaneSigningKey> = state
        .control_plane
        .as_ref()
        .ok_or_else(|| ApiError::Unavailable("this server does not enrol workers".to_owned()))?;
    check_name(&request.name, "worker")?;
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

/// The public keys the control plane stored for `worker`; one that no longer parses is the
/// server's fault, logged.
fn stored_keys(worker: &wor_store::WorkerRecord) -> Result<WorkerPublicKeys, ApiError> {
    WorkerPublicKeys::from_base64(&worker.signing_public_key, &worker.exchange_public_key).map_err(
        |_| {
            tracing::error!(category = "auth", worker_id = %worker.id,
                "a stored worker key does not parse");
            ApiError::Internal
        },
    )
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
        ApiError::WorkerUnauthenticated(reason)
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
    let keys = stored_keys(&worker)?;
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
    let taken = state
        .store
        .accept_worker_request(
            &worker.id,
            &headers.nonce_hex(),
            // Kept for twice the window: another process whose clock runs ahead by up to the
            // window forgets nonces by its own clock, and this one still accepts the request.
            headers
                .timestamp
                .saturating_add(WORKER_REQUEST_SKEW_SECS.saturating_mul(2)),
        )
        .await?;
    match taken {
        Ok(()) => Ok(worker),
        Err(wor_store::WorkerRequestRefusal::Replayed) => Err(refused(WorkerAuthError::Replayed)),
        Err(wor_store::WorkerRequestRefusal::NotActive) => Err(refused(WorkerAuthError::Revoked)),
    }
}

/// The worker that signed `request`, read whole (at most [`MAX_WORKER_BODY_BYTES`]).
async fn signed_by(
    state: &AppState,
    request: Request,
) -> Result<wor_store::WorkerRecord, ApiError> {
    signed_with_body(state, request)
        .await
        .map(|(worker, _)| worker)
}

/// The worker that signed `request`, and the body it signed.
async fn signed_with_body(
    state: &AppState,
    request: Request,
) -> Result<(wor_store::WorkerRecord, axum::body::Bytes), ApiError> {
    let (parts, body) = request.into_parts();
    let body = axum::body::to_bytes(body, MAX_WORKER_BODY_BYTES)
        .await
        .map_err(|_| ApiError::PayloadTooLarge)?;
    let worker = authenticate_worker(state, &parts, &body).await?;
    Ok((worker, body))
}

/// The worker that signed a request about run `run` (a path segment), the run's id, and the
/// body it signed as `T` (a body of another shape is a 400 naming `shape`).
async fn signed_about_run<T: serde::de::DeserializeOwned>(
    state: &AppState,
    run: &str,
    request: Request,
    shape: &str,
) -> Result<(wor_store::WorkerRecord, wor_core::RunId, T), ApiError> {
    let (worker, body) = signed_with_body(state, request).await?;
    let run = run_id(run)?;
    let asked = signed_body(&body, shape)?;
    Ok((worker, run, asked))
}

/// The signing worker and the claim credential it presents.
async fn held_run(state: &AppState, request: Request) -> Result<(String, String), ApiError> {
    let (worker, body) = signed_with_body(state, request).await?;
    let held: HeldRunRequest = signed_body(&body, "{\"run_credential\": \"wrt_…\"}")?;
    Ok((worker.id, held.run_credential))
}

/// A worker says it is alive.
async fn heartbeat(
    State(state): State<AppState>,
    request: Request,
) -> Result<Json<HeartbeatAnswer>, ApiError> {
    let worker = signed_by(&state, request).await?;
    Ok(Json(HeartbeatAnswer {
        worker_id: worker.id,
    }))
}

/// Claims the oldest queued run the limits allow for the signing worker, waiting for one up
/// to the `wait_ms` it asks for (at most [`MAX_CLAIM_WAIT_MS`]). `204` when there is none.
async fn claim(State(state): State<AppState>, request: Request) -> Result<Response, ApiError> {
    let (worker, body) = signed_with_body(&state, request).await?;
    let asked: ClaimRequest = signed_body(&body, "{\"wait_ms\": 0..}")?;
    let control_plane = state
        .control_plane
        .clone()
        .ok_or_else(|| ApiError::Unavailable("this server does not serve workers".to_owned()))?;
    let keys = stored_keys(&worker)?;
    let wait = std::time::Duration::from_millis(asked.wait_ms.min(MAX_CLAIM_WAIT_MS));
    let Some(claimed) = state
        .engine
        .claim_for_worker_within(&worker.id, wait)
        .await?
    else {
        return Ok(StatusCode::NO_CONTENT.into_response());
    };
    let run = claimed.run.clone();
    let give_back = |error: ApiError| {
        let engine = state.engine.clone();
        let (run, worker) = (run.clone(), worker.id.clone());
        async move {
            engine.give_back(&run, &worker).await;
            error
        }
    };
    let steps = match claimed
        .steps
        .iter()
        .map(ClaimedStep::recorded)
        .collect::<Result<Vec<_>, _>>()
    {
        Ok(steps) => steps,
        Err(error) => {
            tracing::error!(category = "run", %error, "a run step does not serialise");
            return Err(give_back(ApiError::Internal).await);
        }
    };
    let lease_id = format!(
        "lse_{}",
        wor_core::ids::request_id().trim_start_matches("req_")
    );
    let issued_at = wor_store::now_millis() / 1000;
    let limits = wor_secrets::EnvelopeLimits::default();
    let lifetime = i64::try_from(state.engine.config().lease.as_secs())
        .unwrap_or(i64::MAX)
        .clamp(MIN_ENVELOPE_LIFETIME_SECS, limits.max_lifetime_secs);
    let envelope_claims = wor_secrets::EnvelopeClaims {
        run_id: run.id.to_string(),
        lease_id: lease_id.clone(),
        worker_id: worker.id.clone(),
        issued_at,
        expires_at: issued_at.saturating_add(lifetime),
    };
    let sealed = match wor_secrets::run_envelope::seal(
        &control_plane,
        &keys,
        &envelope_claims,
        &claimed.secrets,
    ) {
        Ok(sealed) => sealed,
        Err(error) => {
            tracing::error!(category = "run", run_id = %run.id, error = %error,
                "a run's envelope could not be sealed; the run went back to the queue");
            return Err(give_back(ApiError::Internal).await);
        }
    };
    // An envelope no worker would open (its secrets are too large) fails the run closed, as a
    // secret that cannot be opened does: claiming it again would fail the same way.
    if sealed.as_bytes().len() > limits.max_bytes {
        state
            .engine
            .fail_claimed_run(
                &run,
                &worker.id,
                format!(
                    "the run's secrets do not fit a worker's envelope ({} bytes sealed, at most {})",
                    sealed.as_bytes().len(),
                    limits.max_bytes
                ),
            )
            .await?;
        return Ok(StatusCode::NO_CONTENT.into_response());
    }
    // Last, before anything of the claim leaves: the worker still holds the run and is still
    // active (a revocation that committed meanwhile wins).
    if !state.store.worker_holds_run(&worker.id, run.id).await? {
        let refused = match state.store.worker(&worker.id).await? {
            Some(w) if w.status == wor_store::WorkerStatus::Active => {
                lease_not_held(&worker.id, run.id)
            }
            _ => ApiError::WorkerUnauthenticated(WorkerAuthError::Revoked),
        };
        return Err(give_back(refused).await);
    }
    tracing::info!(category = "run", action = "worker.claimed", worker_id = %worker.id,
        run_id = %run.id, lease_id = %lease_id, "a worker claimed a run");
    let version = &claimed.version;
    Ok(Json(ClaimedRun {
        lease_id,
        run: claimed.run,
        routine_version: ClaimedVersion {
            version: version.version,
            content_hash: version.content_hash.clone(),
            source_toml: version.source_toml.clone(),
        },
        project_policy: claimed.project_policy,
        steps,
        model_connection: claimed.model_connection,
        tool_connections: claimed.tool_connections,
        approvals: claimed.approvals,
        routine_tools: claimed.routine_tools,
        credential_expires_at: claimed.credential_expires_at,
        lease_expires_at: claimed.lease_expires_at,
        lease_ms: i64::try_from(state.engine.config().lease.as_millis()).unwrap_or(i64::MAX),
        envelope: sealed.to_base64(),
    })
    .into_response())
}

fn run_id(text: &str) -> Result<wor_core::RunId, ApiError> {
    text.parse()
        .map_err(|_| ApiError::bad_request("invalid_id", format!("`{text}` is not a run id")))
}

/// Renews the signing worker's lease of a run it holds.
async fn renew(
    State(state): State<AppState>,
    axum::extract::Path(run): axum::extract::Path<String>,
    request: Request,
) -> Result<Json<LeaseAnswer>, ApiError> {
    let (worker, credential) = held_run(&state, request).await?;
    let run = run_id(&run)?;
    match state
        .engine
        .renew_for_worker(run, &worker, &credential)
        .await?
    {
        wor_engine::LeaseRenewal::Renewed {
            expires_at,
            cancel_requested,
        } => Ok(Json(LeaseAnswer {
            lease_expires_at: expires_at,
            cancel_requested,
        })),
        wor_engine::LeaseRenewal::NotHeld => Err(lease_not_held(&worker, run)),
    }
}

/// Gives back a run the signing worker holds, to be resumed by the next claim.
async fn release(
    State(state): State<AppState>,
    axum::extract::Path(run): axum::extract::Path<String>,
    request: Request,
) -> Result<StatusCode, ApiError> {
    let (worker, credential) = held_run(&state, request).await?;
    let run = run_id(&run)?;
    if state
        .engine
        .release_for_worker(run, &worker, &credential)
        .await?
    {
        tracing::info!(category = "run", action = "worker.released", worker_id = %worker,
            run_id = %run, "a worker gave a run back");
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(lease_not_held(&worker, run))
    }
}

/// Answers a routine call of a run the signing worker holds: its nested run's end, or the run
/// parked until that run ends.
async fn nested(
    State(state): State<AppState>,
    axum::extract::Path(run): axum::extract::Path<String>,
    request: Request,
) -> Result<Json<NestedAnswer>, ApiError> {
    let (worker, run, request): (_, _, NestedRequest) = signed_about_run(
        &state,
        &run,
        request,
        "{\"run_credential\", \"call_id\", \"usage\"}",
    )
    .await?;
    match state
        .engine
        .nested_for_worker(
            run,
            &worker.id,
            &request.run_credential,
            &request.call_id,
            request.usage,
        )
        .await?
        .map_err(refused_write)?
    {
        Some(answer) => Ok(Json(answer)),
        None => Err(lease_not_held(&worker.id, run)),
    }
}

/// A worker's report that a connection its run uses lists changed tools: checked here, and
/// the connection quarantined only when this process sees the change too.
async fn quarantine(
    State(state): State<AppState>,
    axum::extract::Path(run): axum::extract::Path<String>,
    request: Request,
) -> Result<Json<QuarantineAnswer>, ApiError> {
    let (worker, run, request): (_, _, QuarantineRequest) = signed_about_run(
        &state,
        &run,
        request,
        "{\"run_credential\", \"connection\"}",
    )
    .await?;
    match state
        .engine
        .quarantine_for_worker(
            run,
            &worker.id,
            &request.run_credential,
            &request.connection,
        )
        .await?
    {
        Some(quarantined) => Ok(Json(QuarantineAnswer { quarantined })),
        None => Err(lease_not_held(&worker.id, run)),
    }
}

/// Gives back a run the signing worker holds and could not take up (it refused the claim's
/// envelope), logging the worker's reason. The claim's credential is inside that envelope, so
/// holding the run's lease is what is checked.
async fn refuse(
    State(state): State<AppState>,
    axum::extract::Path(run): axum::extract::Path<String>,
    request: Request,
) -> Result<StatusCode, ApiError> {
    let (worker, run, refused): (_, _, RefuseRequest) =
        signed_about_run(&state, &run, request, "{\"lease_id\", \"reason\"}").await?;
    if !refused.lease_id.starts_with("lse_")
        || refused.lease_id.len() > 64
        || !refused
            .lease_id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_')
    {
        return Err(ApiError::bad_request(
            "invalid_body",
            "lease_id must be the `lse_…` id the claim named",
        ));
    }
    // What the worker says is logged, not trusted: one line, bounded.
    let reason: String = refused
        .reason
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .take(500)
        .collect();
    if !state.engine.refuse_for_worker(run, &worker.id).await? {
        return Err(lease_not_held(&worker.id, run));
    }
    tracing::warn!(category = "run", action = "worker.envelope_refused", worker_id = %worker.id,
        run_id = %run, lease_id = %refused.lease_id, reason = %reason,
        "a worker refused a run's envelope; the run went back to the queue");
    Ok(StatusCode::NO_CONTENT)
}

/// The body of a signed request, as `T`; a body of another shape is a 400 that says so. It
/// must be an object: serde would read an array into `T` field by field.
fn signed_body<T: serde::de::DeserializeOwned>(body: &[u8], shape: &str) -> Result<T, ApiError> {
    let refused = |why: &dyn std::fmt::Display| {
        ApiError::bad_request("invalid_body", format!("expected {shape}: {why}"))
    };
    if !crate::extract::opens_an_object(body) {
        return Err(refused(&"the body must be a JSON object"));
    }
    serde_json::from_slice(body).map_err(|e| refused(&e))
}

fn refused_write(refusal: wor_engine::WorkerStepRefusal) -> ApiError {
    let code = match refusal {
        wor_engine::WorkerStepRefusal::NoHeldCall(_) => "no_held_call",
        wor_engine::WorkerStepRefusal::NoSuchApproval(_) => "no_such_approval",
        wor_engine::WorkerStepRefusal::OutcomeUnknownDecided(_) => "approval_decided",
        wor_engine::WorkerStepRefusal::OutputRejected(_) => "output_rejected",
        wor_engine::WorkerStepRefusal::NoRoutineCall(_) => "no_routine_call",
        _ => "invalid_step",
    };
    ApiError::bad_request(code, refusal.to_string())
}

/// Records steps of a run the signing worker holds: the control plane redacts them again and
/// writes their audit entries itself.
async fn record_steps(
    State(state): State<AppState>,
    axum::extract::Path(run): axum::extract::Path<String>,
    request: Request,
) -> Result<Json<StepsAnswer>, ApiError> {
    let (worker, run, request): (_, _, StepsRequest) = signed_about_run(
        &state,
        &run,
        request,
        "{\"run_credential\", \"steps\": [{\"kind\", \"provenance\", \"payload\"}], \"usage\"}",
    )
    .await?;
    if request.steps.len() > wor_engine::MAX_WORKER_STEPS_PER_WRITE {
        return Err(refused_write(wor_engine::WorkerStepRefusal::TooManySteps(
            request.steps.len(),
        )));
    }
    let steps = request
        .steps
        .into_iter()
        .enumerate()
        .map(|(index, step)| {
            let provenance = step.provenance.parse().map_err(|_| {
                ApiError::bad_request(
                    "invalid_step",
                    format!("step {index}: `{}` is not a provenance", step.provenance),
                )
            })?;
            let parsed = wor_core::step::Step::from_stored(&step.kind, step.payload)
                .map_err(|e| ApiError::bad_request("invalid_step", format!("step {index}: {e}")))?;
            Ok((provenance, parsed))
        })
        .collect::<Result<Vec<_>, ApiError>>()?;
    let write = wor_engine::WorkerSteps {
        steps,
        usage: request.usage,
    };
    let recorded = state
        .engine
        .record_for_worker(run, &worker.id, &request.run_credential, write)
        .await?
        .map_err(refused_write)?;
    match recorded {
        wor_engine::WorkerRecorded::Committed { cancel_requested } => Ok(Json(StepsAnswer {
            recorded: true,
            cancel_requested,
        })),
        wor_engine::WorkerRecorded::CancelRequested => Ok(Json(StepsAnswer {
            recorded: false,
            cancel_requested: true,
        })),
        wor_engine::WorkerRecorded::NotHeld => Err(lease_not_held(&worker.id, run)),
    }
}

/// Ends a run the signing worker holds, as a local driver ends one.
async fn end(
    State(state): State<AppState>,
    axum::extract::Path(run): axum::extract::Path<String>,
    request: Request,
) -> Result<StatusCode, ApiError> {
    let (worker, run, request): (_, _, EndRequest) = signed_about_run(
        &state,
        &run,
        request,
        "{\"run_credential\", \"status\", \"outcome\", \"usage\"}",
    )
    .await?;
    let status: wor_core::run::RunStatus = request.status.parse().map_err(|_| {
        ApiError::bad_request(
            "invalid_status",
            format!("`{}` is not a run status", request.status),
        )
    })?;
    let ended = state
        .engine
        .end_for_worker(
            run,
            &worker.id,
            &request.run_credential,
            status,
            &request.outcome,
            request.usage,
        )
        .await?
        .map_err(refused_write)?;
    if ended {
        tracing::info!(category = "run", action = "worker.ended", worker_id = %worker.id,
            run_id = %run, status = status.as_str(), "a worker ended a run");
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(lease_not_held(&worker.id, run))
    }
}

/// Parks a run the signing worker holds: the control plane files the approval from the call
/// as the run recorded it, and announces it.
async fn park(
    State(state): State<AppState>,
    axum::extract::Path(run): axum::extract::Path<String>,
    request: Request,
) -> Result<Json<ParkAnswer>, ApiError> {
    let (worker, run, request): (_, _, ParkRequest) =
        signed_about_run(&state, &run, request, "{\"run_credential\", \"call_id\"}").await?;
    let parked = state
        .engine
        .park_for_worker(run, &worker.id, &request.run_credential, &request.call_id)
        .await?
        .map_err(refused_write)?;
    match parked {
        wor_engine::WorkerParked::Parked(approval) => {
            tracing::info!(category = "run", action = "worker.parked", worker_id = %worker.id,
                run_id = %run, approval_id = %approval, "a worker parked a run for approval");
            Ok(Json(ParkAnswer {
                approval_id: Some(approval.to_string()),
                cancel_requested: false,
            }))
        }
        wor_engine::WorkerParked::CancelRequested => Ok(Json(ParkAnswer {
            approval_id: None,
            cancel_requested: true,
        })),
        wor_engine::WorkerParked::NotHeld => Err(lease_not_held(&worker.id, run)),
    }
}

/// Uses an approval of a run the signing worker holds to start the call it approved.
async fn use_approval(
    State(state): State<AppState>,
    axum::extract::Path((run, approval)): axum::extract::Path<(String, String)>,
    request: Request,
) -> Result<Json<ApprovalUseAnswer>, ApiError> {
    let (worker, body) = signed_with_body(&state, request).await?;
    let run = run_id(&run)?;
    let approval: wor_core::ApprovalId = approval.parse().map_err(|_| {
        ApiError::bad_request("invalid_id", format!("`{approval}` is not an approval id"))
    })?;
    let request: UseApprovalRequest = signed_body(
        &body,
        "{\"run_credential\", \"pin_hash\", \"arguments_hash\", \"usage\"}",
    )?;
    let call = wor_engine::BoundCall {
        pin_hash: request.pin_hash,
        arguments_hash: request.arguments_hash,
        usage: request.usage,
    };
    let used = state
        .engine
        .use_approval_for_worker(run, &worker.id, &request.run_credential, approval, &call)
        .await?
        .map_err(refused_write)?;
    let (started, cancel_requested) = match used {
        wor_engine::WorkerApprovalUse::Started => (true, false),
        wor_engine::WorkerApprovalUse::NotUsable => (false, false),
        wor_engine::WorkerApprovalUse::CancelRequested => (false, true),
        wor_engine::WorkerApprovalUse::NotHeld => return Err(lease_not_held(&worker.id, run)),
    };
    Ok(Json(ApprovalUseAnswer {
        started,
        cancel_requested,
    }))
}

/// A worker asked about a run it does not hold under the claim whose credential it presents:
/// the same answer whether the run exists, is another worker's, was claimed again or has ended
/// (or passed its deadline), so nothing about other runs is learnt from it.
fn lease_not_held(worker: &str, run: wor_core::RunId) -> ApiError {
    tracing::warn!(category = "auth", action = "worker.lease_not_held", worker_id = %worker,
        run_id = %run, "a worker asked about a run it does not hold");
    ApiError::LeaseNotHeld
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signed_body_is_read_only_from_an_object() {
        let shape = "{\"wait_ms\": 0..}";
        let claim: wor_engine::worker_wire::ClaimRequest =
            signed_body(b" {\"wait_ms\": 5}", shape).unwrap();
        assert_eq!(claim.wait_ms, 5);
        // serde alone reads an array into the struct, field by field.
        for body in [&b"[5]"[..], b" [5]", b"5", b"\"x\"", b""] {
            let refused = signed_body::<wor_engine::worker_wire::ClaimRequest>(body, shape)
                .map(|claim| claim.wait_ms)
                .unwrap_err();
            assert!(
                matches!(&refused, ApiError::BadRequest { code, .. } if *code == "invalid_body"),
                "{refused:?}"
            );
        }
    }
}
