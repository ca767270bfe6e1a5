//! Notification routes: where approval requests are sent (a Slack channel or email
//! recipients, per project and optionally per routine, tool or policy), their delivery log,
//! and the Slack interaction endpoint (docs/notifications.md). A route's Slack bot token and
//! signing secret, or its SMTP credentials, go in once and never come out (S3).

use axum::Json;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use secrecy::SecretString;
use wor_core::{ApprovalId, NotificationRouteId, RoutineId};
use wor_engine::{
    NOTIFICATION_ROUTES_TABLE, SLACK_BOT_TOKEN_FIELD, SLACK_SIGNING_SECRET_FIELD,
    SMTP_PASSWORD_FIELD, SlackInteraction, SlackOutcome, SlackRejection, SlackSecrets, SmtpSecrets,
};
use wor_store::{
    NewNotificationRoute, NotificationDeliveryFilter, NotificationDeliveryRecord,
    NotificationRouteRecord, RouteChannel, RouteFilter, SecretSlot, SmtpTls,
};

use crate::AppState;
use crate::auth::{Caller, Configurer};
use crate::error::{ApiError, ErrorBody};
use crate::extract::{ApiBytes, ApiJson, ApiPath, page_limit, query_id};
use crate::routes::members::check_name;
use crate::routes::model_connections::SecretFieldView;
use crate::views::rfc3339;

/// Slack's Web API, unless a route names another base URL.
pub const DEFAULT_SLACK_API_URL: &str = "https://slack.com/api";

/// The kinds of route.
#[derive(Debug, Clone, Copy, serde::Deserialize, serde::Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum RouteKind {
    Slack,
    Email,
}

/// How an email route's connection to its relay is protected.
#[derive(Debug, Clone, Copy, serde::Deserialize, serde::Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum SmtpTlsView {
    /// `STARTTLS` before anything is sent (the default); a relay without it is refused.
    Starttls,
    /// No TLS, to a loopback relay only, when the operator's configuration allows it.
    PlaintextLoopback,
    /// TLS from the first byte (SMTPS; port 465 by default).
    ImplicitTls,
}

impl From<SmtpTlsView> for SmtpTls {
    fn from(view: SmtpTlsView) -> Self {
        match view {
            SmtpTlsView::Starttls => SmtpTls::Starttls,
            SmtpTlsView::PlaintextLoopback => SmtpTls::PlaintextLoopback,
            SmtpTlsView::ImplicitTls => SmtpTls::ImplicitTls,
        }
    }
}

impl From<SmtpTls> for SmtpTlsView {
    fn from(tls: SmtpTls) -> Self {
        match tls {
            SmtpTls::Starttls => SmtpTlsView::Starttls,
            SmtpTls::PlaintextLoopback => SmtpTlsView::PlaintextLoopback,
            SmtpTls::ImplicitTls => SmtpTlsView::ImplicitTls,
        }
    }
}

#[derive(Debug, serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateNotificationRoute {
    pub name: String,
    /// `slack` or `email`; the fields of the other kind must be left out.
    pub kind: RouteKind,
    /// Slack: the channel id (`C…`) requests are posted to.
    pub channel: Option<String>,
    /// Slack: the Web API base URL [default: `https://slack.com/api`]; vetted by the egress guard.
    pub slack_api_url: Option<String>,
    /// Slack: the app's bot token (`xoxb-…`). Sealed; never returned.
    pub slack_bot_token: Option<String>,
    /// Slack: the app's signing secret, which verifies its interactions. Sealed; never returned.
    pub slack_signing_secret: Option<String>,
    /// Email: the SMTP relay's host name or address; vetted by the egress guard.
    pub smtp_host: Option<String>,
    /// Email: the relay's port [default: 587].
    pub smtp_port: Option<u16>,
    /// Email: `starttls` [default], `implicit_tls` (SMTPS) or `plaintext_loopback`.
    pub smtp_tls: Option<SmtpTlsView>,
    /// Email: the relay's user name, with `smtp_password` (both or neither). Sealed.
    pub smtp_username: Option<String>,
    /// Email: the relay's password. Sealed; never returned.
    pub smtp_password: Option<String>,
    /// Email: the sender address.
    pub email_from: Option<String>,
    /// Email: the recipients (1 to 20).
    pub email_to: Option<Vec<String>>,
    /// Email: send one message every this many minutes (1 to 1440) listing the requests since
    /// the last, instead of one per request.
    pub digest_minutes: Option<u32>,
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
    /// `slack` or `email`.
    pub kind: String,
    /// Slack: the channel id.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub channel: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slack_api_url: Option<String>,
    pub routine_id: Option<String>,
    pub tool: Option<String>,
    pub policy: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slack_bot_token: Option<SecretFieldView>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slack_signing_secret: Option<SecretFieldView>,
    /// Slack: the path of this route's interaction endpoint, to set as the Slack app's
    /// interactivity request URL (after the server's public address).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub interaction_path: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub smtp_host: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub smtp_port: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub smtp_tls: Option<SmtpTlsView>,
    /// Email: whether SMTP credentials are set (never the values).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub smtp_credentials: Option<SecretFieldView>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub email_from: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub email_to: Option<Vec<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub digest_minutes: Option<u32>,
    pub created_at: String,
}

#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct NotificationDeliveryView {
    pub id: String,
    pub route_id: String,
    pub approval_id: String,
    /// `slack.post`, `slack.update` or `email.send`.
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
    /// `approved`, `denied`, `refused`, or `reason_asked` (Deny opened a form for the reason).
    pub outcome: String,
    /// Why a press was refused.
    pub reason: Option<String>,
}

/// The answer to a submitted Deny form, in the shape Slack reads: `clear` closes the form;
/// `errors` keeps it open and shows why under the reason field.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct SlackFormReply {
    /// `clear` or `errors`.
    pub response_action: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub errors: Option<std::collections::BTreeMap<String, String>>,
}

/// A button press is answered with what came of it; a submitted form in Slack's form shape.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
#[serde(untagged)]
pub enum SlackReply {
    Press(SlackInteractionReply),
    Form(SlackFormReply),
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
    let mut shown = NotificationRouteView {
        id: route.id.to_string(),
        name: route.name.clone(),
        kind: route.channel.kind().to_owned(),
        channel: None,
        slack_api_url: None,
        routine_id: route.filter.routine_id.map(|r| r.to_string()),
        tool: route.filter.tool.clone(),
        policy: route.filter.policy.clone(),
        slack_bot_token: None,
        slack_signing_secret: None,
        interaction_path: None,
        smtp_host: None,
        smtp_port: None,
        smtp_tls: None,
        smtp_credentials: None,
        email_from: None,
        email_to: None,
        digest_minutes: None,
        created_at: rfc3339(route.created_at),
    };
    match &route.channel {
        RouteChannel::Slack { channel, api_url } => {
            shown.slack_bot_token = Some(secret_view(state, &route, SLACK_BOT_TOKEN_FIELD).await?);
            shown.slack_signing_secret =
                Some(secret_view(state, &route, SLACK_SIGNING_SECRET_FIELD).await?);
            shown.interaction_path = Some(format!("/hooks/slack/{}", route.id));
            shown.channel = Some(channel.clone());
            shown.slack_api_url = Some(api_url.clone());
        }
        RouteChannel::Email {
            smtp_host,
            smtp_port,
            tls,
            from,
            to,
            digest_minutes,
        } => {
            shown.smtp_credentials = Some(secret_view(state, &route, SMTP_PASSWORD_FIELD).await?);
            shown.smtp_host = Some(smtp_host.clone());
            shown.smtp_port = Some(*smtp_port);
            shown.smtp_tls = Some((*tls).into());
            shown.email_from = Some(from.clone());
            shown.email_to = Some(to.clone());
            shown.digest_minutes = *digest_minutes;
        }
    }
    Ok(shown)
}

/// A field of the other kind of route is a mistake, never ignored.
fn refuse_foreign(kind: &str, fields: &[(&str, bool)]) -> Result<(), ApiError> {
    match fields.iter().find(|(_, given)| *given) {
        Some((field, _)) => Err(ApiError::bad_request(
            "invalid_route",
            format!("`{field}` does not apply to a `{kind}` route"),
        )),
        None => Ok(()),
    }
}

fn required<T>(value: Option<T>, field: &str, kind: &str) -> Result<T, ApiError> {
    value.ok_or_else(|| {
        ApiError::bad_request("invalid_route", format!("a `{kind}` route needs `{field}`"))
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

/// A tool filter: a roster name `CONNECTION/TOOL`, as a routine's `[[tools]]` names it and
/// an approval's `tool` reads; anything else could match no approval.
fn tool_filter(value: Option<String>) -> Result<Option<String>, ApiError> {
    let tool = filter_text(value, "tool")?;
    if let Some(tool) = &tool {
        // As a routine's roster takes it: a connection and a tool, neither empty.
        let roster_name = tool
            .split_once('/')
            .is_some_and(|(connection, name)| !connection.is_empty() && !name.is_empty());
        if !roster_name {
            return Err(ApiError::bad_request(
                "invalid_route",
                format!(
                    "`tool` `{}` is not a roster name CONNECTION/TOOL, as an approval names its tool",
                    wor_core::quote::excerpt(tool, 80)
                ),
            ));
        }
    }
    Ok(tool)
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
    Configurer(caller): Configurer,
    ApiJson(body): ApiJson<CreateNotificationRoute>,
) -> Result<(StatusCode, Json<NotificationRouteView>), ApiError> {
    check_name(&body.name, "route")?;
    let routine_id = query_id::<RoutineId>(body.routine_id.as_deref())
        .map_err(|_| ApiError::bad_request("invalid_route", "`routine_id` is not a `rtn_…` id"))?;
    let filter = RouteFilter {
        routine_id,
        tool: tool_filter(body.tool)?,
        policy: filter_text(body.policy, "policy")?,
    };
    let created = match body.kind {
        RouteKind::Slack => {
            refuse_foreign(
                "slack",
                &[
                    ("smtp_host", body.smtp_host.is_some()),
                    ("smtp_port", body.smtp_port.is_some()),
                    ("smtp_tls", body.smtp_tls.is_some()),
                    ("smtp_username", body.smtp_username.is_some()),
                    ("smtp_password", body.smtp_password.is_some()),
                    ("email_from", body.email_from.is_some()),
                    ("email_to", body.email_to.is_some()),
                    ("digest_minutes", body.digest_minutes.is_some()),
                ],
            )?;
            let route = NewNotificationRoute {
                name: body.name,
                channel: RouteChannel::Slack {
                    channel: required(body.channel, "channel", "slack")?,
                    api_url: body
                        .slack_api_url
                        .unwrap_or_else(|| DEFAULT_SLACK_API_URL.to_owned()),
                },
                filter,
                created_by: Some(caller.key_id),
            };
            let secrets = SlackSecrets {
                bot_token: SecretString::from(required(
                    body.slack_bot_token,
                    "slack_bot_token",
                    "slack",
                )?),
                signing_secret: SecretString::from(required(
                    body.slack_signing_secret,
                    "slack_signing_secret",
                    "slack",
                )?),
            };
            state
                .engine
                .create_slack_route(caller.project_id, route, secrets, caller.actor())
                .await?
        }
        RouteKind::Email => {
            refuse_foreign(
                "email",
                &[
                    ("channel", body.channel.is_some()),
                    ("slack_api_url", body.slack_api_url.is_some()),
                    ("slack_bot_token", body.slack_bot_token.is_some()),
                    ("slack_signing_secret", body.slack_signing_secret.is_some()),
                ],
            )?;
            let secrets = match (body.smtp_username, body.smtp_password) {
                (Some(username), Some(password)) => Some(SmtpSecrets {
                    username: SecretString::from(username),
                    password: SecretString::from(password),
                }),
                (None, None) => None,
                _ => {
                    return Err(ApiError::bad_request(
                        "invalid_route",
                        "`smtp_username` and `smtp_password` go together: give both or neither",
                    ));
                }
            };
            let tls: SmtpTls = body.smtp_tls.unwrap_or(SmtpTlsView::Starttls).into();
            let default_port = match tls {
                SmtpTls::ImplicitTls => 465,
                SmtpTls::Starttls | SmtpTls::PlaintextLoopback => 587,
            };
            let route = NewNotificationRoute {
                name: body.name,
                channel: RouteChannel::Email {
                    smtp_host: required(body.smtp_host, "smtp_host", "email")?,
                    smtp_port: body.smtp_port.unwrap_or(default_port),
                    tls,
                    from: required(body.email_from, "email_from", "email")?,
                    to: required(body.email_to, "email_to", "email")?,
                    digest_minutes: body.digest_minutes,
                },
                filter,
                created_by: Some(caller.key_id),
            };
            state
                .engine
                .create_email_route(caller.project_id, route, secrets, caller.actor())
                .await?
        }
    };
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
    let before = crate::extract::page_cursor(query.before, "ntd", "a delivery")?;
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
        description = "Slack's `payload=` form of a `block_actions` interaction or of a submitted Deny form (`view_submission`)"),
    responses((status = 200, body = SlackReply), (status = 400, body = ErrorBody),
        (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody), (status = 413, body = ErrorBody)))]
pub async fn slack_interaction(
    State(state): State<AppState>,
    ApiPath(route): ApiPath<String>,
    headers: HeaderMap,
    ApiBytes(body): ApiBytes,
) -> Result<Json<SlackReply>, ApiError> {
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
        Ok(SlackOutcome::Decided(status)) => Ok(Json(SlackReply::Press(SlackInteractionReply {
            outcome: status.to_string(),
            reason: None,
        }))),
        Ok(SlackOutcome::Refused(reason)) => Ok(Json(SlackReply::Press(SlackInteractionReply {
            outcome: "refused".to_owned(),
            reason: Some(reason),
        }))),
        Ok(SlackOutcome::ReasonAsked) => Ok(Json(SlackReply::Press(SlackInteractionReply {
            outcome: "reason_asked".to_owned(),
            reason: None,
        }))),
        Ok(SlackOutcome::FormDecided(_)) => Ok(Json(SlackReply::Form(SlackFormReply {
            response_action: "clear".to_owned(),
            errors: None,
        }))),
        Ok(SlackOutcome::FormRefused(reason)) => Ok(Json(SlackReply::Form(SlackFormReply {
            response_action: "errors".to_owned(),
            errors: Some(std::collections::BTreeMap::from([(
                "wor_reason".to_owned(),
                // Redacted whole, then cut: a secret cut short would no longer be recognised.
                wor_secrets::redact_shapes(&reason)
                    .chars()
                    .take(150)
                    .collect(),
            )])),
        }))),
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
