//! Webhooks: the signed inbound trigger of a routine, its secret, and the delivery log of run
//! webhooks (docs/webhooks.md).

use axum::Json;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use secrecy::ExposeSecret as _;
use wor_core::{RoutineId, RunId};
use wor_engine::{InboundWebhook, SignedHeaders, WebhookRejection, WebhookSecretKind};
use wor_store::{DeliveryFilter, DeliveryRecord};

use crate::AppState;
use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::extract::{ApiBytes, ApiPath, page_limit, query_id};
use crate::views::rfc3339;

#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct HookAccepted {
    pub run_id: String,
    /// The new run's status as it was recorded: `running` when a worker took it as it was
    /// created, `queued` while it waits for one, or `skipped` when the routine's overlap policy
    /// refused it.
    pub status: String,
}

#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct WebhookSecretView {
    /// The routine's new secret of that kind, shown this once; the previous one stops working
    /// now.
    pub secret: String,
}

#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct DeliveryView {
    pub id: String,
    pub routine_id: String,
    pub run_id: String,
    /// `run.finished`, `run.waiting_for_approval`, `run.failed` or `run.budget_exceeded`.
    pub event: String,
    pub url: String,
    /// `pending`, `delivered` or `failed` (attempts exhausted).
    pub status: String,
    pub attempts: i64,
    pub next_attempt_at: Option<String>,
    pub last_status_code: Option<i64>,
    pub last_error: Option<String>,
    /// The body as sent (redacted).
    #[schema(value_type = Object)]
    pub body: serde_json::Value,
    pub created_at: String,
    pub updated_at: String,
}

impl From<DeliveryRecord> for DeliveryView {
    fn from(d: DeliveryRecord) -> Self {
        DeliveryView {
            next_attempt_at: (d.status == "pending").then(|| rfc3339(d.next_attempt_at)),
            body: serde_json::from_str(&d.body).unwrap_or(serde_json::Value::Null),
            id: d.id,
            routine_id: d.routine_id.to_string(),
            run_id: d.run_id.to_string(),
            event: d.event,
            url: d.url,
            status: d.status,
            attempts: d.attempts,
            last_status_code: d.last_status_code,
            last_error: d.last_error,
            created_at: rfc3339(d.created_at),
            updated_at: rfc3339(d.updated_at),
        }
    }
}

#[derive(Debug, serde::Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct DeliveryListQuery {
    /// Only deliveries of this routine (`rtn_…`).
    pub routine_id: Option<String>,
    /// Only deliveries of this run (`run_…`).
    pub run_id: Option<String>,
    /// Only deliveries older than this one: the previous page's last id.
    pub before: Option<String>,
    /// At most this many (1 to 200, default 50).
    pub limit: Option<u32>,
}

fn header(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

/// Starts a run of the routine from a signed webhook. No API key: the request proves itself
/// with the routine's secret (`wor-timestamp` + `wor-signature`, or Standard Webhooks
/// `webhook-id` + `webhook-timestamp` + `webhook-signature`). The body becomes the run's
/// untrusted input. An unknown routine, or one whose webhook is not enabled, is not found.
#[utoipa::path(post, path = "/hooks/{routine_id}", tag = "webhooks",
    params(("routine_id" = String, Path, description = "a `rtn_…` id", pattern = "^rtn_[0-9a-f]{32}$")),
    request_body(content = String, description = "any body, at most 256 KiB; JSON is kept as JSON"),
    responses((status = 202, body = HookAccepted), (status = 401, body = ErrorBody),
        (status = 404, body = ErrorBody), (status = 409, body = ErrorBody), (status = 413, body = ErrorBody)))]
pub async fn receive(
    State(state): State<AppState>,
    ApiPath(routine): ApiPath<String>,
    headers: HeaderMap,
    ApiBytes(body): ApiBytes,
) -> Result<(StatusCode, Json<HookAccepted>), ApiError> {
    // A malformed id is as unknown as any other: nothing tells the caller which it was.
    let routine: RoutineId = routine.parse().map_err(|_| ApiError::NotFound)?;
    let signed = |prefix: &str, delivery: &str| SignedHeaders {
        timestamp: header(&headers, &format!("{prefix}-timestamp")),
        signature: header(&headers, &format!("{prefix}-signature")),
        delivery: header(&headers, delivery),
    };
    let hook = InboundWebhook {
        wor: signed("wor", "wor-delivery"),
        standard: signed("webhook", "webhook-id"),
        body: body.to_vec(),
    };
    match state.engine.receive_webhook(routine, hook).await {
        Ok(run) => {
            tracing::info!(category = "webhook", action = "webhook.receive", project_id = %run.project_id,
                run_id = %run.id, routine_id = %routine, "webhook started a run");
            Ok((
                StatusCode::ACCEPTED,
                Json(HookAccepted {
                    run_id: run.id.to_string(),
                    status: run.status.to_string(),
                }),
            ))
        }
        Err(rejection) => {
            tracing::info!(category = "webhook", action = "webhook.reject", routine_id = %routine,
                reason = rejection_kind(&rejection), "webhook refused");
            Err(match rejection {
                WebhookRejection::NotFound => ApiError::NotFound,
                WebhookRejection::TooLarge => ApiError::PayloadTooLarge,
                WebhookRejection::BadSignature(reason) => ApiError::InvalidSignature(reason),
                WebhookRejection::Replayed => {
                    ApiError::Conflict("this delivery was received before".to_owned())
                }
                WebhookRejection::Refused(reason) => ApiError::Conflict(reason),
                WebhookRejection::Engine(error) => error.into(),
            })
        }
    }
}

fn rejection_kind(rejection: &WebhookRejection) -> &'static str {
    match rejection {
        WebhookRejection::NotFound => "not_found",
        WebhookRejection::TooLarge => "too_large",
        WebhookRejection::BadSignature(_) => "bad_signature",
        WebhookRejection::Replayed => "replayed",
        WebhookRejection::Refused(_) => "refused",
        WebhookRejection::Engine(_) => "error",
    }
}

#[derive(Debug, serde::Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct SecretQuery {
    /// `inbound` (default: verifies `POST /hooks/{routine_id}`) or `notify` (signs run webhooks).
    #[serde(rename = "for")]
    #[param(rename = "for")]
    pub kind: Option<String>,
}

/// Makes a new webhook secret for the routine and shows it once; the old one stops working.
#[utoipa::path(post, path = "/v1/routines/{routine_id}/webhook-secret", tag = "webhooks", security(("bearer" = [])),
    params(("routine_id" = String, Path, description = "a `rtn_…` id", pattern = "^rtn_[0-9a-f]{32}$"), SecretQuery),
    responses((status = 200, body = WebhookSecretView), (status = 400, body = ErrorBody),
        (status = 403, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn rotate_secret(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(routine): ApiPath<RoutineId>,
    query: Result<Query<SecretQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<WebhookSecretView>, ApiError> {
    let Query(query) = query.map_err(|e| ApiError::bad_request("invalid_query", e.body_text()))?;
    let kind = match query.kind.as_deref() {
        None | Some("inbound") => WebhookSecretKind::Inbound,
        Some("notify") => WebhookSecretKind::Notify,
        Some(other) => {
            return Err(ApiError::bad_request(
                "invalid_query",
                format!("`for` is `inbound` or `notify`, not `{other}`"),
            ));
        }
    };
    state.store.get_routine(caller.project_id, routine).await?;
    caller.require_configure()?;
    let secret = state
        .engine
        .rotate_webhook_secret(caller.project_id, routine, kind, caller.actor())
        .await?;
    tracing::info!(category = "config", action = "routine.webhook_secret", project_id = %caller.project_id,
        routine_id = %routine, actor_key_id = %caller.key_id, "webhook secret made");
    Ok(Json(WebhookSecretView {
        secret: secret.expose_secret().to_owned(),
    }))
}

/// The delivery log of run webhooks, newest first.
#[utoipa::path(get, path = "/v1/webhook-deliveries", tag = "webhooks", security(("bearer" = [])),
    params(DeliveryListQuery),
    responses((status = 200, body = [DeliveryView]), (status = 400, body = ErrorBody)))]
pub async fn deliveries(
    State(state): State<AppState>,
    caller: Caller,
    query: Result<Query<DeliveryListQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<Vec<DeliveryView>>, ApiError> {
    let Query(query) = query.map_err(|e| ApiError::bad_request("invalid_query", e.body_text()))?;
    let filter = DeliveryFilter {
        routine_id: query_id::<RoutineId>(query.routine_id.as_deref())?,
        run_id: query_id::<RunId>(query.run_id.as_deref())?,
        before: crate::extract::page_cursor(query.before, "dlv", "a delivery")?,
        limit: page_limit(query.limit)?,
    };
    let list = state
        .store
        .list_deliveries(caller.project_id, &filter)
        .await?;
    Ok(Json(list.into_iter().map(Into::into).collect()))
}
