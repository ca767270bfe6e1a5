//! Notification routes: where approval requests are sent (a Slack channel, per project and
//! optionally per routine, tool or policy), their delivery log, and the Slack interaction
//! endpoint (docs/notifications.md). A route's Slack bot token and signing secret go in once
//! and never come out (S3).

use axum::Json;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use secrecy::SecretString;
use wor_core::{ApprovalId, NotificationRouteId, RoutineId};
use wor_engine::{
    NOTIFICATION_ROUTES_TABLE, SLACK_BOT_TOKEN_FIELD, SLACK_SIGNING_SECRET_FIELD, SlackInteraction,
    SlackOutcome, SlackRejection, SlackSecrets,
};
use wor_store::{
    NewNotificationRoute, NotificationDeliveryFilter, NotificationDeliveryRecord,
    NotificationRouteRecord, RouteChannel, RouteFilter, SecretSlot,
};

use crate::AppState;
use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::extract::{ApiBytes, ApiJson, ApiPath, page_limit, query_id};
use crate::routes::members::check_name;
use crate::routes::model_connections::SecretFieldView;
use crate::views::rfc3339;

/// Slack's Web API, unless a route names another base URL.
pub const DEFAULT_SLACK_API_URL: &str = "https://slack.com/api";

/// The kinds of route; only Slack is built.
#[derive(Debug, Clone, Copy, serde::Deserialize, serde::Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum RouteKind {
    Slack,
}

#[derive(Debug, serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateNotificationRoute {
    pub name: String,
    /// `slack` (the only kind built).
    pub kind: RouteKind,
    /// The Slack channel id (`C…`) requests are posted to.
    pub channel: String,
    /// The Slack Web API base URL [default: `https://slack.com/api`]; vetted by the egress guard.
    pub slack_api_url: Option<String>,
    /// The Slack app's bot token (`xoxb-…`). Sealed; never returned.
    pub slack_bot_token: String,
    /// The Slack app's signing secret, which verifies its interactions. Sealed; never returned.
    pub slack_signing_secret: String,
    /// Only approval requests of this routine (`rtn_…`).
    pub routine_id: Option<String>,
    /// Only approval requests of this tool (`CONNECTION/TOOL`).
    pub tool: Option<String>,
    /// Only approval requests this policy id determined.
    pub policy: Option<String>,
}

#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct NotificationRouteView {
    pub id: String,
    pub name: String,
    /// `slack`.
    pub kind: String,
    pub channel: String,
    pub slack_api_url: String,
    pub routine_id: Option<String>,
    pub tool: Option<String>,
    pub policy: Option<String>,
    pub slack_bot_token: SecretFieldView,
    pub slack_signing_secret: SecretFieldView,
    /// The path of this route's Slack interaction endpoint, to set as the Slack app's
    /// interactivity request URL (after the server's public address).
    pub interaction_path: String,
    pub created_at: String,
}

#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct NotificationDeliveryView {
    pub id: String,
    pub route_id: String,
    pub approval_id: String,
    /// `slack.post` or `slack.update`.
    pub action: String,
    /// `pending`, `delivered` or `failed` (attempts exhausted).
    pub status: String,
    pub attempts: i64,
    pub next_attempt_at: Option<String>,
    pub last_status_code: Option<i64>,
    pub last_error: Option<String>,
    pub created_at: String,
    pub updated_at: String,
}

impl From<NotificationDeliveryRecord> for NotificationDeliveryView {
    fn from(d: NotificationDeliveryRecord) -> Self {
        NotificationDeliveryView {
            next_attempt_at: (d.status == "pending").then(|| rfc3339(d.next_attempt_at)),
            id: d.id,
            route_id: d.route_id.to_string(),
            approval_id: d.approval_id.to_string(),
            action: d.action.to_string(),
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
pub struct NotificationDeliveryQuery {
    /// Only this route's (`ntf_…`).
    pub route_id: Option<String>,
    /// Only those about this approval (`apr_…`).
    pub approval_id: Option<String>,
    /// Only `pending`, `delivered` or `failed` ones.
    pub status: Option<String>,
    /// Only deliveries older than this one: the previous page's last id.
    pub before: Option<String>,
    /// At most this many (1 to 200, default 50).
    pub limit: Option<u32>,
}

#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct SlackInteractionReply {
    /// `approved`, `denied`, or `refused`.
    pub outcome: String,
    /// Why a press was refused.
    pub reason: Option<String>,
}

async fn secret_view(
    state: &AppState,
    route: &NotificationRouteRecord,
    field: &str,
) -> Result<SecretFieldView, ApiError> {
    let slot = SecretSlot::new(route.project_id, NOTIFICATION_ROUTES_TABLE, route.id, field);
    let secret = state.vault.metadata(&slot).await?;
    Ok(SecretFieldView {
        configured: secret.is_some(),
        updated_at: secret.map(|s| rfc3339(s.updated_at)),
    })
}

async fn view(
    state: &AppState,
    route: NotificationRouteRecord,
) -> Result<NotificationRouteView, ApiError> {
    let slack_bot_token = secret_view(state, &route, SLACK_BOT_TOKEN_FIELD).await?;
    let slack_signing_secret = secret_view(state, &route, SLACK_SIGNING_SECRET_FIELD).await?;
    let RouteChannel::Slack { channel, api_url } = route.channel;
    Ok(NotificationRouteView {
        interaction_path: format!("/hooks/slack/{}", route.id),
        id: route.id.to_string(),
        name: route.name,
        kind: "slack".to_owned(),
        channel,
        slack_api_url: api_url,
        routine_id: route.filter.routine_id.map(|r| r.to_string()),
        tool: route.filter.tool,
        policy: route.filter.policy,
        slack_bot_token,
        slack_signing_secret,
        created_at: rfc3339(route.created_at),
    })
}

/// A filter text: 1 to 200 printable characters.
fn filter_text(value: Option<String>, field: &str) -> Result<Option<String>, ApiError> {
    match value {
        Some(text)
            if text.trim().is_empty()
                || text.chars().count() > 200
                || text.chars().any(char::is_control) =>
        {
            Err(ApiError::bad_request(
                "invalid_route",
                format!("`{field}` must be 1 to 200 printable characters"),
            ))
        }
        other => Ok(other),
    }
}

/// The project's notification routes, oldest first.
#[utoipa::path(get, path = "/v1/notification-routes", tag = "notifications", security(("bearer" = [])),
    responses((status = 200, body = [NotificationRouteView])))]
pub async fn list(
    State(state): State<AppState>,
    caller: Caller,
) -> Result<Json<Vec<NotificationRouteView>>, ApiError> {
    let mut views = Vec::new();
    for route in state
        .store
        .list_notification_routes(caller.project_id)
        .await?
    {
        views.push(view(&state, route).await?);
    }
    Ok(Json(views))
}

/// Adds a notification route; its secrets are sealed at once and never returned.
#[utoipa::path(post, path = "/v1/notification-routes", tag = "notifications", security(("bearer" = [])),
    request_body = CreateNotificationRoute,
    responses((status = 201, body = NotificationRouteView), (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn create(
    State(state): State<AppState>,
    caller: Caller,
    ApiJson(body): ApiJson<CreateNotificationRoute>,
) -> Result<(StatusCode, Json<NotificationRouteView>), ApiError> {
    caller.require_configure()?;
    check_name(&body.name, "route")?;
    let RouteKind::Slack = body.kind;
    let routine_id = query_id::<RoutineId>(body.routine_id.as_deref())
        .map_err(|_| ApiError::bad_request("invalid_route", "`routine_id` is not a `rtn_…` id"))?;
    let route = NewNotificationRoute {
        name: body.name,
        channel: RouteChannel::Slack {
            channel: body.channel,
            api_url: body
                .slack_api_url
                .unwrap_or_else(|| DEFAULT_SLACK_API_URL.to_owned()),
        },
        filter: RouteFilter {
            routine_id,
            tool: filter_text(body.tool, "tool")?,
            policy: filter_text(body.policy, "policy")?,
        },
        created_by: Some(caller.key_id),
    };
    let secrets = SlackSecrets {
        bot_token: SecretString::from(body.slack_bot_token),
        signing_secret: SecretString::from(body.slack_signing_secret),
    };
    let created = state
        .engine
        .create_slack_route(caller.project_id, route, secrets, caller.actor())
        .await?;
    tracing::info!(category = "config", action = "notification_route.create", project_id = %caller.project_id,
        route_id = %created.id, actor_key_id = %caller.key_id, "notification route made");
    Ok((StatusCode::CREATED, Json(view(&state, created).await?)))
}

/// One notification route.
#[utoipa::path(get, path = "/v1/notification-routes/{notification_route_id}", tag = "notifications",
    security(("bearer" = [])),
    params(("notification_route_id" = String, Path, description = "a `ntf_…` id", pattern = "^ntf_[0-9a-f]{32}$")),
    responses((status = 200, body = NotificationRouteView), (status = 404, body = ErrorBody)))]
pub async fn get(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<NotificationRouteId>,
) -> Result<Json<NotificationRouteView>, ApiError> {
    let route = state
        .store
        .get_notification_route(caller.project_id, id)
        .await?;
    Ok(Json(view(&state, route).await?))
}

/// Deletes a notification route and its sealed secrets; its pending deliveries fail. Answers
/// the route as it was.
#[utoipa::path(delete, path = "/v1/notification-routes/{notification_route_id}", tag = "notifications",
    security(("bearer" = [])),
    params(("notification_route_id" = String, Path, description = "a `ntf_…` id", pattern = "^ntf_[0-9a-f]{32}$")),
    responses((status = 200, body = NotificationRouteView), (status = 404, body = ErrorBody)))]
pub async fn delete(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<NotificationRouteId>,
) -> Result<Json<NotificationRouteView>, ApiError> {
    // Looked up first, inside the caller's project: a foreign route is a 404, not a 403.
    let route = state
        .store
        .get_notification_route(caller.project_id, id)
        .await?;
    caller.require_configure()?;
    let shown = view(&state, route).await?;
    state
        .engine
        .delete_notification_route(caller.project_id, id, caller.actor())
        .await?;
    tracing::info!(category = "config", action = "notification_route.delete", project_id = %caller.project_id,
        route_id = %id, actor_key_id = %caller.key_id, "notification route deleted");
    Ok(Json(shown))
}

/// The delivery log of notifications, newest first: what was posted or updated, and what
/// failed and why.
#[utoipa::path(get, path = "/v1/notification-deliveries", tag = "notifications", security(("bearer" = [])),
    params(NotificationDeliveryQuery),
    responses((status = 200, body = [NotificationDeliveryView]), (status = 400, body = ErrorBody)))]
pub async fn deliveries(
    State(state): State<AppState>,
    caller: Caller,
    query: Result<Query<NotificationDeliveryQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<Vec<NotificationDeliveryView>>, ApiError> {
    let Query(query) = query.map_err(|e| ApiError::bad_request("invalid_query", e.body_text()))?;
    let status = match query.status.as_deref() {
        None => None,
        Some(s @ ("pending" | "delivered" | "failed")) => Some(s.to_owned()),
        Some(_) => {
            return Err(ApiError::bad_request(
                "invalid_query",
                "`status` is `pending`, `delivered` or `failed`",
            ));
        }
    };
    let before = match query.before {
        Some(id)
            if id.is_empty()
                || id.len() > 64
                || !id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') =>
        {
            return Err(ApiError::bad_request(
                "invalid_query",
                "`before` is not a delivery id",
            ));
        }
        other => other,
    };
    let filter = NotificationDeliveryFilter {
        route_id: query_id::<NotificationRouteId>(query.route_id.as_deref())?,
        approval_id: query_id::<ApprovalId>(query.approval_id.as_deref())?,
        status,
        before,
        limit: page_limit(query.limit)?,
    };
    let list = state
        .store
        .list_notification_deliveries(caller.project_id, &filter)
        .await?;
    Ok(Json(list.into_iter().map(Into::into).collect()))
}

fn header(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

/// Slack's interaction callback for a route: Approve or Deny pressed on a message. No API key:
/// the request proves itself with the route's signing secret (`X-Slack-Request-Timestamp` +
/// `X-Slack-Signature` over the raw body, 5-minute window); each `trigger_id` acts once. The
/// Slack user must be linked to a member, and the decision follows the same rules as the API's.
#[utoipa::path(post, path = "/hooks/slack/{notification_route_id}", tag = "notifications",
    params(("notification_route_id" = String, Path, description = "a `ntf_…` id", pattern = "^ntf_[0-9a-f]{32}$")),
    request_body(content = String, content_type = "application/x-www-form-urlencoded",
        description = "Slack's `payload=` form of a `block_actions` interaction"),
    responses((status = 200, body = SlackInteractionReply), (status = 400, body = ErrorBody),
        (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody), (status = 413, body = ErrorBody)))]
pub async fn slack_interaction(
    State(state): State<AppState>,
    ApiPath(route): ApiPath<String>,
    headers: HeaderMap,
    ApiBytes(body): ApiBytes,
) -> Result<Json<SlackInteractionReply>, ApiError> {
    let route: NotificationRouteId = route.parse().map_err(|_| ApiError::NotFound)?;
    let interaction = SlackInteraction {
        timestamp: header(&headers, "x-slack-request-timestamp"),
        signature: header(&headers, "x-slack-signature"),
        body: body.to_vec(),
    };
    match state
        .engine
        .receive_slack_interaction(route, interaction)
        .await
    {
        Ok(SlackOutcome::Decided(status)) => Ok(Json(SlackInteractionReply {
            outcome: status.to_string(),
            reason: None,
        })),
        Ok(SlackOutcome::Refused(reason)) => Ok(Json(SlackInteractionReply {
            outcome: "refused".to_owned(),
            reason: Some(reason),
        })),
        Err(rejection) => {
            tracing::info!(category = "notification", action = "slack.reject", route_id = %route,
                reason = rejection_kind(&rejection), "slack interaction refused");
            Err(match rejection {
                SlackRejection::NotFound => ApiError::NotFound,
                SlackRejection::TooLarge => ApiError::PayloadTooLarge,
                SlackRejection::BadSignature(reason) => ApiError::InvalidSignature(reason),
                SlackRejection::Replayed => {
                    ApiError::Conflict("this interaction was received before".to_owned())
                }
                SlackRejection::Malformed(reason) => {
                    ApiError::bad_request("invalid_interaction", reason)
                }
                SlackRejection::Engine(error) => error.into(),
            })
        }
    }
}

fn rejection_kind(rejection: &SlackRejection) -> &'static str {
    match rejection {
        SlackRejection::NotFound => "not_found",
        SlackRejection::TooLarge => "too_large",
        SlackRejection::BadSignature(_) => "bad_signature",
        SlackRejection::Replayed => "replayed",
        SlackRejection::Malformed(_) => "malformed",
        SlackRejection::Engine(_) => "error",
    }
}
