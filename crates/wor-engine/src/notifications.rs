//! Approval requests where people work: notification routes, their outbox, Slack messages and
//! the Slack interactions that decide (docs/notifications.md).
//!
//! A held call enqueues one `slack.post` per matching route; a decision (from any channel), a
//! refusal or an expiry enqueues a `slack.update` of every message posted about it. What a
//! message says is rendered from the approval when it is sent, so a late attempt shows the
//! approval as it stands. Every request leaves through the egress guard.
//!
//! A Slack interaction is accepted only with a valid signature of the route's signing secret
//! inside the replay window, once per `trigger_id`; the Slack user must be linked to a member
//! (from a signed-in console session), and the decision goes through the same engine function
//! as the API's, so separation of duties, the binding to the exact call and single use hold
//! unchanged.

use secrecy::{ExposeSecret as _, SecretString};
use serde_json::{Value, json};
use wor_core::audit::{Actor, AuditCategory, AuditEvent};
use wor_core::{ApprovalId, MemberId, NotificationRouteId, ProjectId};
use wor_egress::{EgressRequest, HeaderMap, header};
use wor_store::{
    ApprovalAnswer, ApprovalRecord, ApprovalStatus, AttemptOutcome, NewNotification,
    NewNotificationRoute, NotificationAction, NotificationDeliveryFilter,
    NotificationDeliveryRecord, NotificationRouteRecord, RouteChannel, StoreError,
};

use crate::approvals::{DecidedVia, DecisionRefusal};
use crate::metrics::{DeliveryResult, NotificationChannel};
use crate::notice::{MAX_ROUTE_NAME_CHARS, RouteError, route_slot, shown_value};
use crate::triggers::retry_at;
use crate::triggers::{PassRoom, grouped};
use crate::{Approver, Engine, EngineError};

pub use wor_store::NOTIFICATION_ROUTES_TABLE;
/// The vault field of a route's Slack bot token (`xoxb-…`).
pub const SLACK_BOT_TOKEN_FIELD: &str = "slack_bot_token";
/// The vault field of a route's Slack signing secret.
pub const SLACK_SIGNING_SECRET_FIELD: &str = "slack_signing_secret";

/// How far a Slack request's timestamp may be from now, in seconds (Slack's own advice).
pub const SLACK_REPLAY_WINDOW_SECS: u64 = 300;
/// Longest Slack interaction body accepted.
pub const MAX_SLACK_INTERACTION_BYTES: usize = 64 * 1024;
/// Why an unlinked Slack user is refused.
const UNLINKED: &str = "this Slack user is not linked to a member of the project";
/// The `callback_id` of the form that asks for a Deny's reason.
const DENY_FORM: &str = "wor_deny";
/// How long a Slack link stays usable.
const SLACK_LINK_TTL_MS: i64 = 15 * 60 * 1000;
/// A claimed notification is taken by another pass after this long: room for an email's
/// longest exchange, or an approval's Slack messages in turn, each started only while the
/// claim has room for it.
const NOTIFICATION_LEASE_MS: i64 = 180_000;

/// A Slack route's secrets, as an admin gives them; sealed at once, never shown again.
pub struct SlackSecrets {
    pub bot_token: SecretString,
    pub signing_secret: SecretString,
}

impl std::fmt::Debug for SlackSecrets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SlackSecrets(***)")
    }
}

/// An inbound Slack interaction (a button press), as received.
#[derive(Debug, Clone)]
pub struct SlackInteraction {
    /// `X-Slack-Request-Timestamp`.
    pub timestamp: Option<String>,
    /// `X-Slack-Signature`.
    pub signature: Option<String>,
    /// The raw, unmodified body.
    pub body: Vec<u8>,
}

/// What came of a verified interaction: the text Slack shows the person who pressed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SlackOutcome {
    Decided(ApprovalStatus),
    Refused(String),
    /// Deny was pressed: Slack was asked to show a form for the reason (`views.open`).
    ReasonAsked,
    /// The reason form was submitted and the call denied.
    FormDecided(ApprovalStatus),
    /// The reason form was submitted and refused, for this reason (shown in the form).
    FormRefused(String),
}

/// Why an interaction was refused before anything was decided.
#[derive(Debug, thiserror::Error)]
pub enum SlackRejection {
    /// No such route, or not a Slack route: nothing tells the caller which.
    #[error("not found")]
    NotFound,
    #[error("the interaction is larger than the limit")]
    TooLarge,
    #[error("{0}")]
    BadSignature(String),
    #[error("this interaction was received before")]
    Replayed,
    #[error("{0}")]
    Malformed(String),
    #[error(transparent)]
    Engine(#[from] EngineError),
}

impl From<StoreError> for SlackRejection {
    fn from(error: StoreError) -> Self {
        SlackRejection::Engine(error.into())
    }
}

/// A Slack id (`C…`, `U…`, `T…`): letters and digits only, so it can be printed in messages
/// and stored without escaping.
fn is_slack_id(text: &str) -> bool {
    !text.is_empty() && text.len() <= 32 && text.bytes().all(|b| b.is_ascii_alphanumeric())
}

impl Engine {
    /// Makes a Slack notification route and seals its secrets (S3).
    pub async fn create_slack_route(
        &self,
        project: ProjectId,
        route: NewNotificationRoute,
        secrets: SlackSecrets,
        actor: Actor,
    ) -> Result<NotificationRouteRecord, EngineError> {
        let RouteChannel::Slack { channel, api_url } = &route.channel else {
            return Err(RouteError::NotSlack.into());
        };
        if !is_slack_id(channel) {
            return Err(RouteError::SlackChannel.into());
        }
        self.egress
            .vet_destination(&format!(
                "{}/chat.postMessage",
                api_url.trim_end_matches('/')
            ))
            .map_err(|denial| RouteError::Destination {
                field: "slack_api_url",
                denial,
            })?;
        self.create_route(
            project,
            route,
            vec![
                (SLACK_BOT_TOKEN_FIELD, secrets.bot_token),
                (SLACK_SIGNING_SECRET_FIELD, secrets.signing_secret),
            ],
            actor,
        )
        .await
    }

    /// Makes a checked route of any kind, seals its secrets and audits it.
    pub(crate) async fn create_route(
        &self,
        project: ProjectId,
        route: NewNotificationRoute,
        secrets: Vec<(&'static str, SecretString)>,
        actor: Actor,
    ) -> Result<NotificationRouteRecord, EngineError> {
        let name = route.name.trim();
        if name.is_empty() || name.chars().count() > MAX_ROUTE_NAME_CHARS {
            return Err(RouteError::Name.into());
        }
        for (field, value) in &secrets {
            let value = value.expose_secret();
            if value.trim().is_empty() || value.len() > 512 || value.chars().any(char::is_control) {
                return Err(RouteError::Secret { field }.into());
            }
        }
        if let Some(routine) = route.filter.routine_id {
            self.store.get_routine(project, routine).await?;
        }
        let mut payload = json!({
            "name": route.name,
            "kind": route.channel.kind(),
            "target": route.channel.target(),
            "routine_id": route.filter.routine_id,
            "tool": route.filter.tool,
            "policy": route.filter.policy,
        });
        if let (RouteChannel::Slack { channel, .. }, Some(object)) =
            (&route.channel, payload.as_object_mut())
        {
            object.insert("channel".to_owned(), json!(channel));
        }
        // The secrets are sealed before anything is written, and written with the route and its
        // staged entry: a crash leaves the route with its secrets and its entry, or nothing.
        let id = NotificationRouteId::new();
        let sealed = secrets
            .iter()
            .map(|(field, value)| {
                self.vault
                    .seal_put(&route_slot(project, id, field), value.expose_secret())
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(EngineError::Vault)?;
        let entry = AuditEvent::new(project, AuditCategory::NotificationRouteCreate, actor)
            .subject("route_id", id)
            .payload(payload);
        let (created, staged) = self
            .store
            .create_notification_route(project, id, &route, &sealed, entry)
            .await?;
        self.append_staged_or_log([staged]).await;
        Ok(created)
    }

    /// Deletes a route and its sealed secrets; its pending deliveries fail.
    pub async fn delete_notification_route(
        &self,
        project: ProjectId,
        id: NotificationRouteId,
        actor: Actor,
    ) -> Result<(), EngineError> {
        let recorded = AuditEvent::new(project, AuditCategory::NotificationRouteDelete, actor)
            .subject("route_id", id);
        let staged = self
            .store
            .delete_notification_route(project, id, recorded)
            .await?;
        self.append_staged_or_log([staged]).await;
        for field in [
            SLACK_BOT_TOKEN_FIELD,
            SLACK_SIGNING_SECRET_FIELD,
            crate::email::SMTP_USERNAME_FIELD,
            crate::email::SMTP_PASSWORD_FIELD,
        ] {
            self.vault.delete(&route_slot(project, id, field)).await?;
        }
        Ok(())
    }

    /// Enqueues a message for every route of the project that wants approval `id` of `run`.
    pub(crate) async fn notify_approval_requested(
        &self,
        project: ProjectId,
        run_routine: wor_core::RoutineId,
        id: ApprovalId,
        tool: &str,
        policies: &[String],
    ) -> Result<(), EngineError> {
        for route in self.store.list_notification_routes(project).await? {
            let filter = &route.filter;
            let wanted = filter.routine_id.is_none_or(|r| r == run_routine)
                && filter.tool.as_deref().is_none_or(|t| t == tool)
                && filter
                    .policy
                    .as_deref()
                    .is_none_or(|p| policies.iter().any(|held| held == p));
            if !wanted {
                continue;
            }
            let (action, not_before) = match &route.channel {
                RouteChannel::Slack { .. } => (NotificationAction::SlackPost, None),
                RouteChannel::Email { digest_minutes, .. } => (
                    NotificationAction::EmailSend,
                    digest_minutes
                        .map(|minutes| crate::email::digest_due(wor_store::now_millis(), minutes)),
                ),
            };
            self.store
                .enqueue_notification(&NewNotification {
                    project_id: project,
                    route_id: route.id,
                    approval_id: id,
                    action,
                    event_key: "post".to_owned(),
                    note: None,
                    not_before,
                })
                .await?;
        }
        Ok(())
    }

    /// Enqueues an update of every message about approval `id` (decided, refused or expired),
    /// with `note` shown beside its state.
    pub(crate) async fn notify_approval_changed(
        &self,
        project: ProjectId,
        id: ApprovalId,
        event_key: &str,
        note: Option<String>,
    ) -> Result<(), EngineError> {
        let posts = self
            .store
            .list_notification_deliveries(
                project,
                &NotificationDeliveryFilter {
                    approval_id: Some(id),
                    limit: 1000,
                    ..NotificationDeliveryFilter::default()
                },
            )
            .await?;
        for post in posts
            .iter()
            .filter(|d| d.action == NotificationAction::SlackPost)
        {
            self.store
                .enqueue_notification(&NewNotification {
                    project_id: project,
                    route_id: post.route_id,
                    approval_id: id,
                    action: NotificationAction::SlackUpdate,
                    event_key: event_key.to_owned(),
                    note: note.clone(),
                    not_before: None,
                })
                .await?;
        }
        Ok(())
    }

    /// The same as [`Self::notify_approval_changed`], for a path that must not fail after
    /// its change is committed: a failure is logged, and the messages keep their old text.
    pub(crate) async fn notify_approval_changed_or_log(
        &self,
        project: ProjectId,
        id: ApprovalId,
        event_key: &str,
        note: Option<String>,
    ) {
        if let Err(error) = self
            .notify_approval_changed(project, id, event_key, note)
            .await
        {
            tracing::error!(category = "notification", project_id = %project, approval_id = %id,
                error = %error, "cannot enqueue the update of an approval's messages");
        }
    }

    /// Sends the notifications due at `now` through the egress guard; failures are retried
    /// with backoff, at most [`crate::MAX_DELIVERY_ATTEMPTS`] times. Returns how many were
    /// claimed.
    pub async fn deliver_notifications(&self, now: i64) -> Result<usize, EngineError> {
        self.notification_pass(now, None).await
    }

    /// [`Engine::deliver_notifications`], starting no attempt once `stopping` says so.
    pub(crate) async fn notification_pass(
        &self,
        now: i64,
        stopping: Option<tokio::sync::watch::Receiver<bool>>,
    ) -> Result<usize, EngineError> {
        let claimed = self
            .store
            .claim_due_notifications(now, NOTIFICATION_LEASE_MS, crate::triggers::OUTBOX_BATCH)
            .await?;
        let count = claimed.items.len();
        let room = PassRoom {
            leased_until: claimed.leased_until,
            stopping,
        };
        let (emails, slack): (Vec<_>, Vec<_>) = claimed
            .items
            .into_iter()
            .partition(|d| d.action == NotificationAction::EmailSend);
        // Email deliveries go per route (a digest route sends its due ones as one message),
        // Slack's per approval, its post before its updates; routes and approvals side by side.
        let routes = grouped(emails, |d| d.route_id);
        let approvals = grouped(slack, |d| d.approval_id);
        let (emailed, posted) = tokio::join!(
            futures::future::join_all(
                routes
                    .iter()
                    .map(|deliveries| self.deliver_route_emails(deliveries, &room))
            ),
            futures::future::join_all(
                approvals
                    .iter()
                    .map(|deliveries| self.deliver_slack_messages(deliveries, &room))
            ),
        );
        emailed
            .into_iter()
            .chain(posted)
            .collect::<Result<(), _>>()?;
        Ok(count)
    }

    /// Sends one route's claimed emails, each while the pass has room for it.
    async fn deliver_route_emails(
        &self,
        deliveries: &[NotificationDeliveryRecord],
        room: &PassRoom,
    ) -> Result<(), EngineError> {
        let leased_until = room.leased_until;
        for (id, outcome, result) in self.attempt_emails(deliveries, room).await? {
            crate::metrics::notification_attempted(NotificationChannel::Email, result);
            tracing::info!(category = "notification", action = "email.send",
                route_id = %deliveries.first().map(|d| d.route_id.to_string()).unwrap_or_default(),
                delivered = matches!(outcome, AttemptOutcome::Delivered { .. }),
                "notification attempted");
            self.record_notification(&id, leased_until, &outcome)
                .await?;
        }
        Ok(())
    }

    /// Sends one approval's claimed Slack messages in turn, while the pass has room for one
    /// more.
    async fn deliver_slack_messages(
        &self,
        deliveries: &[NotificationDeliveryRecord],
        room: &PassRoom,
    ) -> Result<(), EngineError> {
        let leased_until = room.leased_until;
        for (started, delivery) in deliveries.iter().enumerate() {
            if !room.for_one_more(wor_egress::WEBHOOK_TIMEOUT) {
                let unstarted = deliveries.get(started..).unwrap_or_default();
                return self.give_back_unstarted(unstarted, room).await;
            }
            let (outcome, result) = self.attempt_notification(delivery).await?;
            crate::metrics::notification_attempted(NotificationChannel::Slack, result);
            tracing::info!(category = "notification", action = delivery.action.as_str(),
                project_id = %delivery.project_id, approval_id = %delivery.approval_id,
                delivered = matches!(outcome, AttemptOutcome::Delivered { .. }),
                attempt = delivery.attempts + 1, "notification attempted");
            self.record_notification(&delivery.id, leased_until, &outcome)
                .await?;
        }
        Ok(())
    }

    /// What a pass did not start: given back when the process is stopping, else left claimed
    /// for another pass once the claim runs out.
    pub(crate) async fn give_back_unstarted(
        &self,
        unstarted: &[NotificationDeliveryRecord],
        room: &PassRoom,
    ) -> Result<(), EngineError> {
        if room.stopping() {
            let ids: Vec<&str> = unstarted.iter().map(|d| d.id.as_str()).collect();
            self.store
                .release_notification_claims(&ids, room.leased_until)
                .await?;
        }
        Ok(())
    }

    /// Records an attempt of notification `id`, saying so when its claim ran out first.
    async fn record_notification(
        &self,
        id: &str,
        leased_until: i64,
        outcome: &AttemptOutcome,
    ) -> Result<(), EngineError> {
        if !self
            .store
            .record_notification_attempt(id, leased_until, outcome)
            .await?
        {
            tracing::warn!(category = "notification", delivery = %id,
                "a notification's claim ran out before its attempt was recorded; another pass may send it again");
        }
        Ok(())
    }

    async fn attempt_notification(
        &self,
        delivery: &NotificationDeliveryRecord,
    ) -> Result<(AttemptOutcome, DeliveryResult), EngineError> {
        let give_up = |error: &str| {
            (
                AttemptOutcome::Failed {
                    status_code: None,
                    error: error.to_owned(),
                    retry_at: None,
                },
                DeliveryResult::Undeliverable,
            )
        };
        let project = delivery.project_id;
        let route = match self
            .store
            .get_notification_route(project, delivery.route_id)
            .await
        {
            Ok(route) => route,
            Err(StoreError::NotFound) => return Ok(give_up("the route was deleted")),
            Err(other) => return Err(other.into()),
        };
        let RouteChannel::Slack { channel, api_url } = &route.channel else {
            return Ok(give_up("the route is not a Slack route"));
        };
        let approval = self
            .store
            .get_approval(project, delivery.approval_id)
            .await?;
        let message = self
            .slack_message(&approval, delivery.note.as_deref())
            .await?;
        let (method, body) = match delivery.action {
            NotificationAction::SlackPost => (
                "chat.postMessage",
                json!({ "channel": channel, "text": message.text, "blocks": message.blocks }),
            ),
            NotificationAction::SlackUpdate => {
                let posted = self.store.slack_messages(project, approval.id).await?;
                let Some(posted) = posted.into_iter().find(|m| m.route_id == route.id) else {
                    // The post has not gone out yet: it will show the approval as it stands,
                    // and this update waits for it in case it goes out later.
                    return Ok((
                        AttemptOutcome::Failed {
                            status_code: None,
                            error: "the message to update has not been posted yet".to_owned(),
                            retry_at: retry_at(&delivery.id, delivery.attempts + 1),
                        },
                        DeliveryResult::Waiting,
                    ));
                };
                (
                    "chat.update",
                    json!({ "channel": posted.channel, "ts": posted.ts, "text": message.text,
                        "blocks": message.blocks }),
                )
            }
            // Sent by `attempt_emails`; never claimed here.
            NotificationAction::EmailSend => {
                return Ok(give_up("an email delivery is not a Slack message"));
            }
        };
        let token = match self
            .vault
            .open(&route_slot(project, route.id, SLACK_BOT_TOKEN_FIELD))
            .await
        {
            Ok(token) => token,
            Err(error) => {
                return Ok(give_up(&format!(
                    "cannot open the route's bot token: {error}"
                )));
            }
        };
        let answer = self.slack_call(api_url, method, &token, &body).await;
        let retry = || retry_at(&delivery.id, delivery.attempts + 1);
        Ok(match answer {
            Ok(SlackAnswer::Ok(reply)) => {
                if delivery.action == NotificationAction::SlackPost {
                    let channel = reply.get("channel").and_then(Value::as_str);
                    let ts = reply.get("ts").and_then(Value::as_str);
                    match (channel, ts) {
                        (Some(channel), Some(ts)) => {
                            self.store
                                .record_slack_message(project, approval.id, route.id, channel, ts)
                                .await?;
                        }
                        _ => {
                            return Ok(give_up(
                                "Slack answered ok without the message's channel and ts",
                            ));
                        }
                    }
                }
                (
                    AttemptOutcome::Delivered { status_code: 200 },
                    DeliveryResult::Delivered,
                )
            }
            Ok(SlackAnswer::Refused { status, error }) => (
                AttemptOutcome::Failed {
                    status_code: Some(status),
                    error: format!("Slack answered `{error}`"),
                    retry_at: retry(),
                },
                DeliveryResult::Refused,
            ),
            Err(error) => (
                AttemptOutcome::Failed {
                    status_code: None,
                    error: wor_secrets::redact_shapes(&error.to_string()).into_owned(),
                    retry_at: retry(),
                },
                error.result(),
            ),
        })
    }

    /// Calls one Slack Web API method with the bot token, through the egress guard.
    async fn slack_call(
        &self,
        api_url: &str,
        method: &str,
        token: &SecretString,
        body: &Value,
    ) -> Result<SlackAnswer, SlackCallError> {
        let url = format!("{}/{method}", api_url.trim_end_matches('/'));
        let mut request = EgressRequest::webhook(&url, body.to_string().into_bytes());
        let mut headers = HeaderMap::new();
        headers.insert(
            header::CONTENT_TYPE,
            header::HeaderValue::from_static("application/json; charset=utf-8"),
        );
        let mut bearer =
            header::HeaderValue::from_str(&format!("Bearer {}", token.expose_secret()))
                .map_err(|_| SlackCallError::Token)?;
        bearer.set_sensitive(true);
        headers.insert(header::AUTHORIZATION, bearer);
        request.headers = headers;
        request.max_response_bytes = Some(wor_egress::EgressLimits::webhook().max_response_bytes);
        let response = self.egress.send(request).await?;
        let status = response.status.as_u16();
        let reply: Value = serde_json::from_slice(&response.body).unwrap_or(Value::Null);
        if response.status.is_success() && reply.get("ok") == Some(&Value::Bool(true)) {
            return Ok(SlackAnswer::Ok(reply));
        }
        let error = reply.get("error").and_then(Value::as_str).map_or_else(
            || format!("HTTP {status}"),
            |e| e.chars().take(100).collect(),
        );
        Ok(SlackAnswer::Refused { status, error })
    }

    /// The Slack message about `approval` as it stands.
    async fn slack_message(
        &self,
        approval: &ApprovalRecord,
        note: Option<&str>,
    ) -> Result<SlackMessage, EngineError> {
        let project = approval.project_id;
        let run = self.store.get_run(project, approval.run_id).await?;
        let routine = self.store.get_routine(project, run.routine_id).await?;
        let mut blocks = vec![json!({
            "type": "section",
            "text": { "type": "mrkdwn", "text": format!(
                "*Approval needed* for `{}` in routine *{}* (version {}), run `{}`",
                slack_escape(&approval.tool), slack_escape(&routine.name), run.routine_version, run.id) },
        })];
        // Once an approver edited the call, the edited arguments are what the tool receives.
        let mut arguments = Vec::new();
        if let Some(map) = approval.arguments_sent().as_object() {
            for (key, value) in map {
                let pinned = approval.pinned_keys.iter().any(|k| k == key);
                let edited = approval.edited_to(key, value);
                arguments.push(format!(
                    "• `{}`{}: {}",
                    slack_escape(key),
                    match (pinned, edited) {
                        (true, _) => " (pinned)",
                        (false, true) => " (edited by the approver)",
                        (false, false) => "",
                    },
                    slack_escape(&shown_value(value))
                ));
            }
        }
        if arguments.is_empty() {
            arguments.push("(no arguments)".to_owned());
        }
        let heading = if approval.edited_arguments.is_some() {
            "*Arguments*, as the approver edited them (canonical)"
        } else {
            "*Arguments* (canonical)"
        };
        blocks.push(json!({ "type": "section", "text": { "type": "mrkdwn",
            "text": format!("{heading}\n{}", arguments.join("\n")) } }));
        let texts = |key: &str| -> Vec<String> {
            approval
                .why
                .get(key)
                .and_then(Value::as_array)
                .map(|l| {
                    l.iter()
                        .filter_map(Value::as_str)
                        .map(slack_escape)
                        .collect()
                })
                .unwrap_or_default()
        };
        let mut why = Vec::new();
        let reasons = texts("reasons");
        if !reasons.is_empty() {
            why.push(format!("Reasons: {}", reasons.join("; ")));
        }
        let policies = texts("determining_policies");
        if !policies.is_empty() {
            why.push(format!("Policies: {}", policies.join(", ")));
        }
        let untrusted = texts("untrusted_sources");
        if !untrusted.is_empty() {
            why.push(format!(
                "Untrusted content in context: {}",
                untrusted.join(", ")
            ));
        }
        if approval.kind == wor_store::ApprovalKind::OutcomeUnknown {
            why.push("The call started before an interruption and its outcome is unknown: approving runs it again.".to_owned());
        }
        if why.is_empty() {
            why.push("Held by policy.".to_owned());
        }
        blocks.push(json!({ "type": "section", "text": { "type": "mrkdwn",
            "text": format!("*Why it is held*\n{}", why.join("\n")) } }));
        let expires = wor_core::schedule::slot_rfc3339(approval.expires_at);
        let link = self
            .config
            .console_url
            .as_deref()
            .map(|base| {
                format!(
                    " · <{}/console/approvals/{}|Open it in the console>",
                    base.trim_end_matches('/'),
                    approval.id
                )
            })
            .unwrap_or_default();
        let (state, text) = match approval.status {
            ApprovalStatus::Pending => (
                format!("Expires at {expires}{link}"),
                format!("Approval needed for {}", approval.tool),
            ),
            ApprovalStatus::Approved | ApprovalStatus::Denied => {
                let who = match approval.decided_by_member {
                    Some(member) => self.member_name(project, member).await?,
                    None => "a service key".to_owned(),
                };
                let verb = if approval.status == ApprovalStatus::Approved {
                    "Approved"
                } else {
                    "Denied"
                };
                let when = approval
                    .decided_at
                    .map(wor_core::schedule::slot_rfc3339)
                    .unwrap_or_default();
                (
                    format!(
                        "*{verb}* by {} {} at {when}: {}",
                        slack_escape(&who),
                        note.unwrap_or("through the API"),
                        slack_escape(approval.decision_reason.as_deref().unwrap_or(""))
                    ),
                    format!("{verb}: {}", approval.tool),
                )
            }
            ApprovalStatus::Expired => (
                format!("*Expired* at {expires} without a decision: the call did not run"),
                format!("Expired: {}", approval.tool),
            ),
            ApprovalStatus::Cancelled => (
                "*Cancelled*: the run ended before anyone decided".to_owned(),
                format!("Cancelled: {}", approval.tool),
            ),
        };
        blocks
            .push(json!({ "type": "context", "elements": [{ "type": "mrkdwn", "text": state }] }));
        if approval.status == ApprovalStatus::Pending {
            if let Some(note) = note {
                blocks.push(json!({ "type": "context",
                    "elements": [{ "type": "mrkdwn", "text": note }] }));
            }
            blocks.push(json!({ "type": "actions", "block_id": "wor_decision", "elements": [
                { "type": "button", "action_id": "approve", "style": "primary",
                  "text": { "type": "plain_text", "text": "Approve" }, "value": approval.id.to_string() },
                { "type": "button", "action_id": "deny", "style": "danger",
                  "text": { "type": "plain_text", "text": "Deny" }, "value": approval.id.to_string() },
            ] }));
        }
        Ok(SlackMessage { text, blocks })
    }

    async fn member_name(
        &self,
        project: ProjectId,
        member: MemberId,
    ) -> Result<String, EngineError> {
        match self.store.get_member(project, member).await {
            Ok(member) => Ok(member.name),
            Err(StoreError::NotFound) => Ok(member.to_string()),
            Err(other) => Err(other.into()),
        }
    }

    /// Checks and acts on a Slack interaction for route `route`: the signature first, then the
    /// replay, then who pressed, then the decision through [`Engine::decide_approval`]'s own
    /// path. Nothing about the route is revealed before the signature checks out.
    pub async fn receive_slack_interaction(
        &self,
        route: NotificationRouteId,
        interaction: SlackInteraction,
    ) -> Result<SlackOutcome, SlackRejection> {
        if interaction.body.len() > MAX_SLACK_INTERACTION_BYTES {
            return Err(SlackRejection::TooLarge);
        }
        let route = self
            .store
            .find_notification_route(route)
            .await?
            .ok_or(SlackRejection::NotFound)?;
        let project = route.project_id;
        let secret = match self
            .vault
            .open(&route_slot(project, route.id, SLACK_SIGNING_SECRET_FIELD))
            .await
        {
            Ok(secret) => secret,
            Err(_) => return Err(SlackRejection::NotFound),
        };
        let (Some(timestamp), Some(signature)) = (&interaction.timestamp, &interaction.signature)
        else {
            return Err(SlackRejection::BadSignature(
                "`X-Slack-Request-Timestamp` and `X-Slack-Signature` are required".to_owned(),
            ));
        };
        let timestamp =
            wor_secrets::webhook_signature::parse_timestamp(timestamp).ok_or_else(|| {
                SlackRejection::BadSignature(
                    "the timestamp is not Unix seconds (decimal digits only)".to_owned(),
                )
            })?;
        let now = wor_store::now_millis() / 1000;
        wor_secrets::slack_signature::verify(
            secret.expose_secret(),
            timestamp,
            &interaction.body,
            signature,
            now,
            SLACK_REPLAY_WINDOW_SECS,
        )
        .map_err(|e| SlackRejection::BadSignature(e.to_string()))?;

        let press = match SlackPayload::parse(&interaction.body)? {
            SlackPayload::Press(press) => press,
            SlackPayload::DenyForm(form) => {
                return self.receive_deny_form(&route, form).await;
            }
        };
        if !self
            .store
            .note_slack_interaction(route.id, &press.trigger_id)
            .await?
        {
            return Err(SlackRejection::Replayed);
        }
        let event_key = format!("interaction:{}", press.trigger_id);
        let (approval, member) = match self
            .slack_presser(&route, &press.identity, press.approval_id, &event_key)
            .await?
        {
            Ok(found) => found,
            Err(refusal) => return Ok(SlackOutcome::Refused(refusal)),
        };
        let outcome = match press.action {
            ApprovalAnswer::Approve => {
                self.decide_from_slack(
                    &approval,
                    &member,
                    &press.identity,
                    ApprovalAnswer::Approve,
                    "approved in Slack",
                    &event_key,
                )
                .await?
            }
            // Deny asks for the reason first, in a form Slack shows the person who pressed.
            ApprovalAnswer::Deny => {
                self.ask_deny_reason(&route, &approval, &member, &press, &event_key)
                    .await?
            }
        };
        self.audit_slack(
            &route,
            &approval,
            &member,
            &press.identity,
            press.action_name(),
            &outcome,
        )
        .await?;
        Ok(outcome)
    }

    /// The submitted reason form of a Deny: decides as the member the Slack user is linked to.
    async fn receive_deny_form(
        &self,
        route: &NotificationRouteRecord,
        form: DenyForm,
    ) -> Result<SlackOutcome, SlackRejection> {
        if !self
            .store
            .note_slack_interaction(route.id, &form.key)
            .await?
        {
            return Err(SlackRejection::Replayed);
        }
        let event_key = format!("interaction:{}", form.key);
        let (approval, member) = match self
            .slack_presser(route, &form.identity, form.approval_id, &event_key)
            .await?
        {
            Ok(found) => found,
            Err(refusal) => return Ok(SlackOutcome::FormRefused(refusal)),
        };
        let reason = form.reason.trim();
        let outcome = if reason.is_empty() {
            SlackOutcome::FormRefused("a reason is needed to deny".to_owned())
        } else {
            match self
                .decide_from_slack(
                    &approval,
                    &member,
                    &form.identity,
                    ApprovalAnswer::Deny,
                    reason,
                    &event_key,
                )
                .await?
            {
                SlackOutcome::Decided(status) => SlackOutcome::FormDecided(status),
                SlackOutcome::Refused(why) => SlackOutcome::FormRefused(why),
                other => other,
            }
        };
        self.audit_slack(
            route,
            &approval,
            &member,
            &form.identity,
            "deny_reason",
            &outcome,
        )
        .await?;
        Ok(outcome)
    }

    /// The approval a Slack user acts on and the member they are linked to; `None` (after
    /// telling them privately where to link, and saying why in the message) when they are not
    /// linked. Another project's approval is as unknown as a malformed id.
    async fn slack_presser(
        &self,
        route: &NotificationRouteRecord,
        identity: &SlackIdentity,
        approval: ApprovalId,
        event_key: &str,
    ) -> Result<Result<(ApprovalRecord, wor_store::MemberRecord), String>, SlackRejection> {
        let project = route.project_id;
        let approval = match self.store.get_approval(project, approval).await {
            Ok(approval) => approval,
            Err(StoreError::NotFound) => return Ok(Err("this approval is not known".to_owned())),
            Err(other) => return Err(other.into()),
        };
        let Some(member_id) = self
            .store
            .slack_member(project, &identity.team, &identity.user)
            .await?
        else {
            self.notify_approval_changed(
                project,
                approval.id,
                event_key,
                Some(format!("Refused for <@{}>: {UNLINKED}", identity.user)),
            )
            .await?;
            let link = self
                .store
                .create_slack_link_token(project, &identity.team, &identity.user, SLACK_LINK_TTL_MS)
                .await?;
            self.send_link(route, identity, link.expose()).await;
            tracing::info!(category = "notification", action = "slack.refuse", project_id = %project,
                approval_id = %approval.id, reason = "unlinked", "slack interaction refused");
            return Ok(Err(UNLINKED.to_owned()));
        };
        let member = self.store.get_member(project, member_id).await?;
        Ok(Ok((approval, member)))
    }

    /// Decides as `member` through the engine's one path; a refusal updates the messages.
    async fn decide_from_slack(
        &self,
        approval: &ApprovalRecord,
        member: &wor_store::MemberRecord,
        identity: &SlackIdentity,
        verdict: ApprovalAnswer,
        reason: &str,
        event_key: &str,
    ) -> Result<SlackOutcome, SlackRejection> {
        let approver = Approver {
            key_id: None,
            member_id: Some(member.id),
            role: member.role,
        };
        let via = DecidedVia::Slack {
            team: identity.team.clone(),
            user: identity.user.clone(),
        };
        match self
            .decide_approval_via(
                approval.project_id,
                approval.id,
                approver,
                verdict,
                reason,
                via,
                None,
            )
            .await
        {
            Ok(decided) => Ok(SlackOutcome::Decided(decided.status)),
            // A reason the engine does not take (invisible characters only, or too long) is
            // the person's to correct: told to them alone, on the form.
            Err(EngineError::Decision(
                refusal @ (DecisionRefusal::NoReason | DecisionRefusal::ReasonTooLong),
            )) => Ok(SlackOutcome::Refused(refusal.to_string())),
            // Refusals the person in Slack is told of; anything else is the request's failure.
            Err(
                refused @ (EngineError::ApproverRefused(_)
                | EngineError::Decision(
                    DecisionRefusal::NotPending(_)
                    | DecisionRefusal::Expired
                    | DecisionRefusal::RunCancelled,
                )),
            ) => {
                let refusal = refused.to_string();
                self.refuse_in_messages(approval, member, identity, &refusal, event_key)
                    .await?;
                Ok(SlackOutcome::Refused(refusal))
            }
            Err(other) => Err(other.into()),
        }
    }

    async fn refuse_in_messages(
        &self,
        approval: &ApprovalRecord,
        member: &wor_store::MemberRecord,
        identity: &SlackIdentity,
        refusal: &str,
        event_key: &str,
    ) -> Result<(), SlackRejection> {
        self.notify_approval_changed(
            approval.project_id,
            approval.id,
            event_key,
            Some(format!(
                "Refused for <@{}> ({}): {}",
                identity.user,
                slack_escape(&member.name),
                slack_escape(refusal)
            )),
        )
        .await?;
        Ok(())
    }

    /// Deny pressed by a member who may decide: Slack is asked to show them a form for the
    /// reason; the decision waits for the form. Who may not decide is told so at once.
    async fn ask_deny_reason(
        &self,
        route: &NotificationRouteRecord,
        approval: &ApprovalRecord,
        member: &wor_store::MemberRecord,
        press: &ButtonPress,
        event_key: &str,
    ) -> Result<SlackOutcome, SlackRejection> {
        let project = approval.project_id;
        let refusal = if approval.status == ApprovalStatus::Pending {
            let approver = Approver {
                key_id: None,
                member_id: Some(member.id),
                role: member.role,
            };
            self.approval_refusal(project, approval, approver)
                .await?
                .map(|refusal| refusal.to_string())
        } else {
            Some(DecisionRefusal::NotPending(approval.status).to_string())
        };
        if let Some(refusal) = refusal {
            self.refuse_in_messages(approval, member, &press.identity, &refusal, event_key)
                .await?;
            return Ok(SlackOutcome::Refused(refusal));
        }
        let RouteChannel::Slack { api_url, .. } = &route.channel else {
            return Err(SlackRejection::NotFound);
        };
        let opened = match self
            .vault
            .open(&route_slot(project, route.id, SLACK_BOT_TOKEN_FIELD))
            .await
        {
            Ok(bot) => self
                .slack_call(
                    api_url,
                    "views.open",
                    &bot,
                    &json!({ "trigger_id": press.trigger_id, "view": deny_form(approval) }),
                )
                .await
                .ok()
                .filter(|answer| matches!(answer, SlackAnswer::Ok(_)))
                .is_some(),
            Err(_) => false,
        };
        if opened {
            Ok(SlackOutcome::ReasonAsked)
        } else {
            let refusal = "Slack could not show the form for a reason; deny in the console";
            self.refuse_in_messages(approval, member, &press.identity, refusal, event_key)
                .await?;
            Ok(SlackOutcome::Refused(refusal.to_owned()))
        }
    }

    /// Audits one Slack interaction (`slack.interaction`), with the Slack ids and its outcome.
    async fn audit_slack(
        &self,
        route: &NotificationRouteRecord,
        approval: &ApprovalRecord,
        member: &wor_store::MemberRecord,
        identity: &SlackIdentity,
        action: &str,
        outcome: &SlackOutcome,
    ) -> Result<(), SlackRejection> {
        self.audit
            .append(
                AuditEvent::new(
                    route.project_id,
                    AuditCategory::SlackInteraction,
                    Actor::ConsoleMember {
                        member_id: member.id,
                    },
                )
                .subject("approval_id", approval.id)
                .subject("route_id", route.id)
                .payload(json!({
                    "slack_team": identity.team,
                    "slack_user": identity.user,
                    "action": action,
                    "outcome": match outcome {
                        SlackOutcome::Decided(status) | SlackOutcome::FormDecided(status) => status.as_str().to_owned(),
                        SlackOutcome::Refused(reason) | SlackOutcome::FormRefused(reason) => format!("refused: {reason}"),
                        SlackOutcome::ReasonAsked => "reason_asked".to_owned(),
                    },
                })),
            )
            .await
            .map_err(EngineError::from)?;
        Ok(())
    }

    /// Tells an unlinked Slack user, privately, where to link their identity; a failure is
    /// logged (the message already says why they were refused).
    async fn send_link(
        &self,
        route: &NotificationRouteRecord,
        identity: &SlackIdentity,
        token: &str,
    ) {
        let RouteChannel::Slack { channel, api_url } = &route.channel else {
            return;
        };
        let Some(base) = self.config.console_url.as_deref() else {
            tracing::warn!(category = "notification", project_id = %route.project_id,
                "no console URL is configured: an unlinked Slack user cannot be sent a link");
            return;
        };
        let text = format!(
            "Your Slack identity is not linked to a member of this project. Sign in to the console and link it here (valid 15 minutes, once): {}/console/slack/link/{token}",
            base.trim_end_matches('/')
        );
        let token_result = self
            .vault
            .open(&route_slot(
                route.project_id,
                route.id,
                SLACK_BOT_TOKEN_FIELD,
            ))
            .await;
        let Ok(bot) = token_result else {
            return;
        };
        let body = json!({ "channel": identity.channel.as_deref().unwrap_or(channel), "user": identity.user, "text": text });
        match self
            .slack_call(api_url, "chat.postEphemeral", &bot, &body)
            .await
        {
            Ok(SlackAnswer::Ok(_)) => {}
            Ok(SlackAnswer::Refused { error, .. }) => {
                tracing::warn!(category = "notification", project_id = %route.project_id,
                    error = %error, "the link could not be sent to the Slack user");
            }
            Err(error) => {
                tracing::warn!(category = "notification", project_id = %route.project_id,
                    error = %wor_secrets::redact_shapes(&error.to_string()), "the link could not be sent to the Slack user");
            }
        }
    }

    /// Links the Slack identity a link token names to the signed-in `member`.
    pub async fn link_slack_identity(
        &self,
        project: ProjectId,
        token: &str,
        member: MemberId,
    ) -> Result<wor_store::SlackLinkRecord, EngineError> {
        // The entry is staged with the link: a crash before it is appended leaves it for the
        // audit writer's sweep, never a Slack user who acts as a member without its entry.
        let entry = |link: &wor_store::SlackLinkRecord| {
            AuditEvent::new(
                project,
                AuditCategory::SlackIdentityLink,
                Actor::ConsoleMember { member_id: member },
            )
            .subject("member_id", member)
            .payload(json!({ "slack_team": link.team_id, "slack_user": link.slack_user_id }))
        };
        let Some((link, staged)) = self
            .store
            .link_slack_identity(project, token, member, &entry)
            .await?
        else {
            return Err(StoreError::NotFound.into());
        };
        self.append_staged_or_log([staged]).await;
        Ok(link)
    }
}

/// What Slack answered a Web API call.
/// Why a Slack Web API call got no answer.
#[derive(Debug, thiserror::Error)]
enum SlackCallError {
    #[error("the bot token cannot be sent as a header")]
    Token,
    #[error("{0}")]
    Egress(#[from] wor_egress::EgressError),
}

impl SlackCallError {
    fn result(&self) -> DeliveryResult {
        match self {
            SlackCallError::Token => DeliveryResult::Undeliverable,
            SlackCallError::Egress(error) => DeliveryResult::of_egress(error),
        }
    }
}

enum SlackAnswer {
    Ok(Value),
    Refused { status: u16, error: String },
}

struct SlackMessage {
    text: String,
    blocks: Vec<Value>,
}

/// Who acted in Slack: the workspace, the user, and the channel they acted in, if any.
#[derive(Debug, Clone)]
struct SlackIdentity {
    team: String,
    user: String,
    channel: Option<String>,
}

/// A press of Approve or Deny, from a `block_actions` payload.
#[derive(Debug)]
struct ButtonPress {
    trigger_id: String,
    identity: SlackIdentity,
    approval_id: ApprovalId,
    action: ApprovalAnswer,
}

impl ButtonPress {
    fn action_name(&self) -> &'static str {
        match self.action {
            ApprovalAnswer::Approve => "approve",
            ApprovalAnswer::Deny => "deny",
        }
    }
}

/// The submitted form of a Deny's reason, from a `view_submission` payload.
#[derive(Debug)]
struct DenyForm {
    /// What makes this submission unique (its `trigger_id`, else its view's id).
    key: String,
    identity: SlackIdentity,
    approval_id: ApprovalId,
    reason: String,
}

/// A verified interaction's payload.
#[derive(Debug)]
enum SlackPayload {
    Press(ButtonPress),
    DenyForm(DenyForm),
}

impl SlackPayload {
    fn parse(body: &[u8]) -> Result<Self, SlackRejection> {
        let malformed = |what: &str| SlackRejection::Malformed(format!("the interaction {what}"));
        let payload = url::form_urlencoded::parse(body)
            .find(|(key, _)| key == "payload")
            .map(|(_, value)| value.into_owned())
            .ok_or_else(|| malformed("has no `payload` field"))?;
        let payload: Value =
            serde_json::from_str(&payload).map_err(|_| malformed("payload is not JSON"))?;
        let text = |pointer: &str| payload.pointer(pointer).and_then(Value::as_str);
        let id = |pointer: &str| text(pointer).filter(|v| is_slack_id(v)).map(str::to_owned);
        let token = |pointer: &str| {
            text(pointer)
                .filter(|t| {
                    !t.is_empty() && t.len() <= 128 && t.bytes().all(|b| b.is_ascii_graphic())
                })
                .map(str::to_owned)
        };
        let identity = SlackIdentity {
            user: id("/user/id").ok_or_else(|| malformed("names no Slack user"))?,
            team: id("/team/id")
                .or_else(|| id("/user/team_id"))
                .ok_or_else(|| malformed("names no Slack team"))?,
            channel: id("/channel/id"),
        };
        match text("/type") {
            Some("block_actions") => {
                let trigger_id =
                    token("/trigger_id").ok_or_else(|| malformed("has no `trigger_id`"))?;
                let action = match text("/actions/0/action_id") {
                    Some("approve") => ApprovalAnswer::Approve,
                    Some("deny") => ApprovalAnswer::Deny,
                    _ => return Err(malformed("is neither Approve nor Deny")),
                };
                let approval_id = text("/actions/0/value")
                    .and_then(|v| v.parse().ok())
                    .ok_or_else(|| malformed("names no approval"))?;
                Ok(SlackPayload::Press(ButtonPress {
                    trigger_id,
                    identity,
                    approval_id,
                    action,
                }))
            }
            Some("view_submission") if text("/view/callback_id") == Some(DENY_FORM) => {
                let key = token("/trigger_id")
                    .or_else(|| token("/view/id").map(|v| format!("view:{v}")))
                    .ok_or_else(|| malformed("has no `trigger_id`"))?;
                let approval_id = text("/view/private_metadata")
                    .and_then(|v| v.parse().ok())
                    .ok_or_else(|| malformed("names no approval"))?;
                let reason = text("/view/state/values/wor_reason/reason/value")
                    .unwrap_or_default()
                    .to_owned();
                Ok(SlackPayload::DenyForm(DenyForm {
                    key,
                    identity,
                    approval_id,
                    reason,
                }))
            }
            _ => Err(malformed(
                "is neither a button press (`block_actions`) nor a submitted Deny form",
            )),
        }
    }
}

/// The form Slack shows whoever presses Deny, asking for the reason the model will be told.
fn deny_form(approval: &ApprovalRecord) -> Value {
    json!({
        "type": "modal",
        "callback_id": DENY_FORM,
        "private_metadata": approval.id.to_string(),
        "title": { "type": "plain_text", "text": "Deny this call" },
        "submit": { "type": "plain_text", "text": "Deny" },
        "close": { "type": "plain_text", "text": "Cancel" },
        "blocks": [
            { "type": "section", "text": { "type": "mrkdwn", "text": format!(
                "Deny `{}`? The call does not run, and the model is told why.",
                slack_escape(&approval.tool)) } },
            { "type": "input", "block_id": "wor_reason",
              "label": { "type": "plain_text", "text": "Reason" },
              "element": { "type": "plain_text_input", "action_id": "reason",
                "multiline": true, "max_length": 2000 } },
        ],
    })
}

/// Escapes the three characters Slack's `mrkdwn` treats as control characters, so text from a
/// model or a tool cannot mention people, link or format.
fn slack_escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_values_are_cut_and_control_characters_escaped() {
        let long = Value::String("x".repeat(250));
        let shown = shown_value(&long);
        assert!(shown.starts_with(&"x".repeat(200)));
        assert!(shown.contains("50 more characters"));
        assert_eq!(shown_value(&json!({"b": 1, "a": 2})), r#"{"a":2,"b":1}"#);
        // What would reverse or hide text shows as its escape.
        assert_eq!(shown_value(&json!("pay \u{202e}evil")), r"pay \u{202e}evil");
        assert_eq!(
            shown_value(&json!({"to": "a\u{2066}b"})),
            r#"{"to":"a\u{2066}b"}"#
        );
        assert_eq!(
            slack_escape("<!channel> & <@U1>"),
            "&lt;!channel&gt; &amp; &lt;@U1&gt;"
        );
    }

    #[test]
    fn only_button_presses_with_every_field_parse() {
        let approval = ApprovalId::new();
        let payload = json!({"type": "block_actions", "trigger_id": "1.2.abc",
            "user": {"id": "U1", "team_id": "T1"}, "team": {"id": "T1"},
            "channel": {"id": "C1"},
            "actions": [{"action_id": "deny", "value": approval.to_string()}]});
        let body = url::form_urlencoded::Serializer::new(String::new())
            .append_pair("payload", &payload.to_string())
            .finish();
        let Ok(SlackPayload::Press(press)) = SlackPayload::parse(body.as_bytes()) else {
            panic!("a press");
        };
        assert_eq!(press.approval_id, approval);
        assert_eq!(press.action, ApprovalAnswer::Deny);
        assert_eq!(press.identity.user, "U1");
        let form = json!({"type": "view_submission", "trigger_id": "9.8.xyz",
            "user": {"id": "U1", "team_id": "T1"}, "team": {"id": "T1"},
            "view": {"id": "V1", "callback_id": "wor_deny", "private_metadata": approval.to_string(),
                "state": {"values": {"wor_reason": {"reason": {"type": "plain_text_input", "value": "wrong recipient"}}}}}});
        let body = url::form_urlencoded::Serializer::new(String::new())
            .append_pair("payload", &form.to_string())
            .finish();
        let Ok(SlackPayload::DenyForm(form)) = SlackPayload::parse(body.as_bytes()) else {
            panic!("a Deny form");
        };
        assert_eq!(form.approval_id, approval);
        assert_eq!(form.reason, "wrong recipient");
        assert_eq!(form.key, "9.8.xyz");
        for broken in [
            json!({"type": "view_submission"}),
            json!({"type": "block_actions", "trigger_id": "t", "user": {"id": "U<1>"}, "team": {"id": "T1"},
                "actions": [{"action_id": "approve", "value": approval.to_string()}]}),
            json!({"type": "block_actions", "trigger_id": "t", "user": {"id": "U1"}, "team": {"id": "T1"},
                "actions": [{"action_id": "other", "value": approval.to_string()}]}),
            json!({"type": "block_actions", "trigger_id": "t", "user": {"id": "U1"}, "team": {"id": "T1"},
                "actions": [{"action_id": "approve", "value": "apr_x"}]}),
        ] {
            let body = url::form_urlencoded::Serializer::new(String::new())
                .append_pair("payload", &broken.to_string())
                .finish();
            assert!(matches!(
                SlackPayload::parse(body.as_bytes()),
                Err(SlackRejection::Malformed(_))
            ));
        }
        assert!(SlackPayload::parse(b"nothing=here").is_err());
    }
}
