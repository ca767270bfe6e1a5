//! Notifications of approval requests: a project's routes (Slack channels and email
//! recipients), the outbox of messages to post, update or mail, the Slack messages posted per
//! approval, and the Slack users linked to members.
//!
//! INVARIANTS: every function that reads a project's routes, deliveries or identities takes
//! the project id and filters on it; a delivery is attempted by one process at a time (its
//! `next_attempt_at` is claimed by compare-and-set); a Slack link token is used at most once,
//! only before it expires and only in the project it was made for; a Slack interaction
//! (`trigger_id`) is acted on at most once per route.

use std::fmt;
use std::str::FromStr;

use sqlx::Row;
use wor_core::audit::AuditEvent;
use wor_core::canonical::sha256_hex;
use wor_core::{ApiKeyId, ApprovalId, MemberId, NotificationRouteId, ProjectId, RoutineId};

use crate::console::ConsoleToken;
use crate::outbox::{Outbox, OutboxClaim};
use crate::staged::StagedEvent;
use crate::{
    AttemptOutcome, Store, StoreError, changed_one, conflict_or, now_millis, parse_column,
};

/// The vault's owner table of a route's secrets.
pub const NOTIFICATION_ROUTES_TABLE: &str = "notification_routes";

/// Prefix of a Slack link token.
pub const SLACK_LINK_TOKEN_PREFIX: &str = "wsl_";

/// Where a route sends approval requests.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum RouteChannel {
    /// A Slack channel, through a Slack app's bot token.
    Slack {
        /// The channel id (`C…`) messages are posted to.
        channel: String,
        /// The Slack Web API base URL (`https://slack.com/api`; a test's fake elsewhere).
        api_url: String,
    },
    /// Email to a list of recipients, through an SMTP relay (its credentials in the vault).
    Email {
        /// The relay's host name or address.
        smtp_host: String,
        smtp_port: u16,
        /// How the connection to the relay is protected.
        tls: SmtpTls,
        /// The sender address.
        from: String,
        /// The recipients (at least one).
        to: Vec<String>,
        /// One message every this many minutes listing the requests since the last, instead
        /// of one message per request.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        digest_minutes: Option<u32>,
    },
}

/// How a connection to an SMTP relay is protected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SmtpTls {
    /// `STARTTLS` before anything else is sent; a relay that does not offer it is refused.
    Starttls,
    /// No TLS: only to a loopback relay, and only when the operator's configuration allows it.
    PlaintextLoopback,
    /// TLS from the connection's first byte (SMTPS, port 465 by convention).
    ImplicitTls,
}

impl SmtpTls {
    pub fn as_str(self) -> &'static str {
        match self {
            SmtpTls::Starttls => "starttls",
            SmtpTls::PlaintextLoopback => "plaintext_loopback",
            SmtpTls::ImplicitTls => "implicit_tls",
        }
    }
}

impl RouteChannel {
    pub fn kind(&self) -> &'static str {
        match self {
            RouteChannel::Slack { .. } => "slack",
            RouteChannel::Email { .. } => "email",
        }
    }

    /// What the route sends to, in one line: the channel, or the recipients.
    pub fn target(&self) -> String {
        match self {
            RouteChannel::Slack { channel, .. } => channel.clone(),
            RouteChannel::Email { to, .. } => to.join(", "),
        }
    }
}

/// Which approval requests a route receives: all of them, or only those matching every filter
/// given.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RouteFilter {
    pub routine_id: Option<RoutineId>,
    /// `CONNECTION/TOOL`.
    pub tool: Option<String>,
    /// A policy id that must be among the determining policies.
    pub policy: Option<String>,
}

/// A route to make.
#[derive(Debug, Clone)]
pub struct NewNotificationRoute {
    pub name: String,
    pub channel: RouteChannel,
    pub filter: RouteFilter,
    pub created_by: Option<ApiKeyId>,
}

#[derive(Debug, Clone)]
pub struct NotificationRouteRecord {
    pub id: NotificationRouteId,
    pub project_id: ProjectId,
    pub name: String,
    pub channel: RouteChannel,
    pub filter: RouteFilter,
    pub created_by: Option<ApiKeyId>,
    pub created_at: i64,
}

/// What a notification delivery does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotificationAction {
    /// Post the approval request to the route's Slack channel.
    SlackPost,
    /// Update every field of the posted Slack message to the approval as it stands.
    SlackUpdate,
    /// Mail the approval request (alone, or in the route's next digest).
    EmailSend,
}

impl NotificationAction {
    pub fn as_str(self) -> &'static str {
        match self {
            NotificationAction::SlackPost => "slack.post",
            NotificationAction::SlackUpdate => "slack.update",
            NotificationAction::EmailSend => "email.send",
        }
    }
}

impl fmt::Display for NotificationAction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for NotificationAction {
    type Err = ();
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "slack.post" => Ok(NotificationAction::SlackPost),
            "slack.update" => Ok(NotificationAction::SlackUpdate),
            "email.send" => Ok(NotificationAction::EmailSend),
            _ => Err(()),
        }
    }
}

/// A notification to enqueue.
#[derive(Debug, Clone)]
pub struct NewNotification {
    pub project_id: ProjectId,
    pub route_id: NotificationRouteId,
    pub approval_id: ApprovalId,
    pub action: NotificationAction,
    /// Distinguishes several deliveries of one action for one approval and route.
    pub event_key: String,
    /// Shown in the message besides the approval's state (why a Slack user was refused).
    pub note: Option<String>,
    /// Not sent before this time (a digest's end); `None` sends it at once.
    pub not_before: Option<i64>,
}

#[derive(Debug, Clone)]
pub struct NotificationDeliveryRecord {
    pub id: String,
    pub project_id: ProjectId,
    pub route_id: NotificationRouteId,
    pub approval_id: ApprovalId,
    pub action: NotificationAction,
    pub note: Option<String>,
    /// `pending`, `delivered` or `failed` (no attempts left).
    pub status: String,
    pub attempts: i64,
    pub next_attempt_at: i64,
    pub last_status_code: Option<i64>,
    pub last_error: Option<String>,
    pub created_at: i64,
    pub updated_at: i64,
}

/// Filters and page of a notification delivery listing, newest first.
#[derive(Debug, Clone, Default)]
pub struct NotificationDeliveryFilter {
    pub route_id: Option<NotificationRouteId>,
    pub approval_id: Option<ApprovalId>,
    /// Only `pending`, `delivered` or `failed` ones.
    pub status: Option<String>,
    pub before: Option<String>,
    pub limit: u32,
}

/// A Slack message posted about an approval.
#[derive(Debug, Clone)]
pub struct SlackMessageRecord {
    pub route_id: NotificationRouteId,
    pub channel: String,
    pub ts: String,
}

/// A Slack identity waiting to be linked, as its link token names it.
#[derive(Debug, Clone)]
pub struct SlackLinkRecord {
    pub team_id: String,
    pub slack_user_id: String,
}

const ROUTE_COLUMNS: &str =
    "id, project_id, name, routine_id, tool, policy, settings, created_by, created_at";
const DELIVERY_COLUMNS: &str = "id, project_id, route_id, approval_id, action, note, status, \
    attempts, next_attempt_at, last_status_code, last_error, created_at, updated_at";

impl Store {
    /// Makes a notification route under `id`; a second route of the same name is a conflict.
    /// Writes `secrets` (sealed for slots of this route, [`crate::Vault::seal_put`]) and stages
    /// `recorded`, its `notification_route.create` entry, in the same transaction
    /// (`crate::staged`) for the caller to append: a crash leaves the route with its secrets and
    /// its entry, or nothing. A secret sealed for another row is refused
    /// ([`StoreError::MisplacedSecret`]) and nothing is made.
    pub async fn create_notification_route(
        &self,
        project: ProjectId,
        id: NotificationRouteId,
        route: &NewNotificationRoute,
        secrets: &[crate::SealedPut],
        recorded: AuditEvent,
    ) -> Result<(NotificationRouteRecord, StagedEvent), StoreError> {
        crate::vault::check_owners(secrets, project, crate::NOTIFICATION_ROUTES_TABLE, id)?;
        let mut tx = self.begin_write().await?;
        let now = now_millis();
        let settings = serde_json::to_string(&route.channel)
            .map_err(|e| StoreError::Corrupt(format!("route settings: {e}")))?;
        sqlx::query(
            "INSERT INTO notification_routes (id, project_id, name, kind, routine_id, tool, policy, \
             target, settings, created_by, created_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
        )
        .bind(id.to_string())
        .bind(project.to_string())
        .bind(&route.name)
        .bind(route.channel.kind())
        .bind(route.filter.routine_id.map(|r| r.to_string()))
        .bind(route.filter.tool.clone())
        .bind(route.filter.policy.clone())
        .bind(route.channel.target())
        .bind(settings)
        .bind(route.created_by.map(|k| k.to_string()))
        .bind(now)
        .execute(&mut **tx)
        .await
        .map_err(|e| {
            conflict_or(e, || {
                format!("a notification route named `{}` exists", route.name)
            })
        })?;
        crate::vault::write_sealed(&mut tx, secrets, now).await?;
        let staged = crate::staged::stage_one(&mut tx, recorded).await?;
        tx.commit().await?;
        Ok((self.get_notification_route(project, id).await?, staged))
    }

    pub async fn get_notification_route(
        &self,
        project: ProjectId,
        id: NotificationRouteId,
    ) -> Result<NotificationRouteRecord, StoreError> {
        let row = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {ROUTE_COLUMNS} FROM notification_routes WHERE project_id = $1 AND id = $2"
        )))
        .bind(project.to_string())
        .bind(id.to_string())
        .fetch_optional(self.pool())
        .await?
        .ok_or(StoreError::NotFound)?;
        route_from_row(&row)
    }

    /// The project's routes, oldest first.
    pub async fn list_notification_routes(
        &self,
        project: ProjectId,
    ) -> Result<Vec<NotificationRouteRecord>, StoreError> {
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {ROUTE_COLUMNS} FROM notification_routes WHERE project_id = $1 ORDER BY id"
        )))
        .bind(project.to_string())
        .fetch_all(self.pool())
        .await?;
        rows.iter().map(route_from_row).collect()
    }

    /// Deletes a route; its deliveries still pending fail, naming why. Stages `recorded`, its
    /// `notification_route.delete` entry, in the same transaction (`crate::staged`).
    pub async fn delete_notification_route(
        &self,
        project: ProjectId,
        id: NotificationRouteId,
        recorded: AuditEvent,
    ) -> Result<StagedEvent, StoreError> {
        let mut tx = self.begin_write().await?;
        let done = sqlx::query("DELETE FROM notification_routes WHERE project_id = $1 AND id = $2")
            .bind(project.to_string())
            .bind(id.to_string())
            .execute(&mut **tx)
            .await?;
        changed_one(&done)?;
        sqlx::query(
            "UPDATE notification_deliveries SET status = 'failed', last_error = 'the route was deleted', \
             updated_at = $1 WHERE project_id = $2 AND route_id = $3 AND status = 'pending'",
        )
        .bind(now_millis())
        .bind(project.to_string())
        .bind(id.to_string())
        .execute(&mut **tx)
        .await?;
        let staged = crate::staged::stage_one(&mut tx, recorded).await?;
        tx.commit().await?;
        Ok(staged)
    }

    /// Enqueues a notification; enqueueing the same event again does nothing.
    pub async fn enqueue_notification(
        &self,
        notification: &NewNotification,
    ) -> Result<(), StoreError> {
        let now = now_millis();
        sqlx::query(
            "INSERT INTO notification_deliveries (id, project_id, route_id, approval_id, action, \
             event_key, note, status, attempts, next_attempt_at, created_at, updated_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, 'pending', 0, $8, $9, $9) \
             ON CONFLICT (route_id, approval_id, event_key) DO NOTHING",
        )
        .bind(format!("ntd_{}", uuid::Uuid::now_v7().simple()))
        .bind(notification.project_id.to_string())
        .bind(notification.route_id.to_string())
        .bind(notification.approval_id.to_string())
        .bind(notification.action.as_str())
        .bind(&notification.event_key)
        .bind(notification.note.clone())
        .bind(notification.not_before.unwrap_or(now).max(now))
        .bind(now)
        .execute(&*self.write_pool().await?)
        .await?;
        Ok(())
    }

    /// Claims up to `limit` pending notifications due at `now` for `lease_ms`: each is returned
    /// to exactly one caller until its lease runs out.
    pub async fn claim_due_notifications(
        &self,
        now: i64,
        lease_ms: i64,
        limit: u32,
    ) -> Result<OutboxClaim<NotificationDeliveryRecord>, StoreError> {
        self.claim_due(
            Outbox::Notifications,
            DELIVERY_COLUMNS,
            notification_from_row,
            now,
            lease_ms,
            limit,
        )
        .await
    }

    /// Records one attempt of a notification claimed until `leased_until`; whether the claim
    /// still held (else nothing is written: another process may have taken it).
    pub async fn record_notification_attempt(
        &self,
        id: &str,
        leased_until: i64,
        outcome: &AttemptOutcome,
    ) -> Result<bool, StoreError> {
        self.record_attempt(Outbox::Notifications, id, leased_until, outcome)
            .await
    }

    /// Gives back notifications claimed until `leased_until` that a stopping process did not
    /// attempt: due again at once.
    pub async fn release_notification_claims(
        &self,
        ids: &[&str],
        leased_until: i64,
    ) -> Result<(), StoreError> {
        self.release_claims(Outbox::Notifications, ids, leased_until)
            .await
    }

    pub async fn list_notification_deliveries(
        &self,
        project: ProjectId,
        filter: &NotificationDeliveryFilter,
    ) -> Result<Vec<NotificationDeliveryRecord>, StoreError> {
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {DELIVERY_COLUMNS} FROM notification_deliveries WHERE project_id = $1 \
             AND ($2 IS NULL OR route_id = $2) AND ($3 IS NULL OR approval_id = $3) \
             AND ($4 IS NULL OR status = $4) AND ($5 IS NULL OR id < $5) ORDER BY id DESC LIMIT $6"
        )))
        .bind(project.to_string())
        .bind(filter.route_id.map(|r| r.to_string()))
        .bind(filter.approval_id.map(|a| a.to_string()))
        .bind(filter.status.clone())
        .bind(filter.before.clone())
        .bind(i64::from(filter.limit))
        .fetch_all(self.pool())
        .await?;
        rows.iter().map(notification_from_row).collect()
    }

    /// Remembers the Slack message posted about `approval` through `route`.
    pub async fn record_slack_message(
        &self,
        project: ProjectId,
        approval: ApprovalId,
        route: NotificationRouteId,
        channel: &str,
        ts: &str,
    ) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO slack_messages (approval_id, route_id, project_id, channel, ts, posted_at) \
             VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (approval_id, route_id) DO NOTHING",
        )
        .bind(approval.to_string())
        .bind(route.to_string())
        .bind(project.to_string())
        .bind(channel)
        .bind(ts)
        .bind(now_millis())
        .execute(&*self.write_pool().await?)
        .await?;
        Ok(())
    }

    /// Every Slack message posted about `approval`.
    pub async fn slack_messages(
        &self,
        project: ProjectId,
        approval: ApprovalId,
    ) -> Result<Vec<SlackMessageRecord>, StoreError> {
        let rows = sqlx::query(
            "SELECT route_id, channel, ts FROM slack_messages WHERE project_id = $1 AND approval_id = $2 \
             ORDER BY route_id",
        )
        .bind(project.to_string())
        .bind(approval.to_string())
        .fetch_all(self.pool())
        .await?;
        rows.iter()
            .map(|row| {
                Ok(SlackMessageRecord {
                    route_id: parse_column(
                        &row.try_get::<String, _>("route_id")?,
                        "slack_messages.route_id",
                    )?,
                    channel: row.try_get("channel")?,
                    ts: row.try_get("ts")?,
                })
            })
            .collect()
    }

    /// Notes a Slack interaction; `false` when this route saw that `trigger_id` before.
    pub async fn note_slack_interaction(
        &self,
        route: NotificationRouteId,
        trigger_id: &str,
    ) -> Result<bool, StoreError> {
        let done = sqlx::query(
            "INSERT INTO slack_interactions (route_id, trigger_id, received_at) VALUES ($1, $2, $3) \
             ON CONFLICT (route_id, trigger_id) DO NOTHING",
        )
        .bind(route.to_string())
        .bind(trigger_id)
        .bind(now_millis())
        .execute(&*self.write_pool().await?)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    /// The member a Slack user of `team` is linked to in `project`, if any.
    pub async fn slack_member(
        &self,
        project: ProjectId,
        team_id: &str,
        slack_user_id: &str,
    ) -> Result<Option<MemberId>, StoreError> {
        let row = sqlx::query(
            "SELECT member_id FROM slack_identities WHERE project_id = $1 AND team_id = $2 \
             AND slack_user_id = $3",
        )
        .bind(project.to_string())
        .bind(team_id)
        .bind(slack_user_id)
        .fetch_optional(self.pool())
        .await?;
        row.map(|row| {
            parse_column(
                &row.try_get::<String, _>("member_id")?,
                "slack_identities.member_id",
            )
        })
        .transpose()
    }

    /// Makes a single-use link token for a Slack user the caller has just verified.
    pub async fn create_slack_link_token(
        &self,
        project: ProjectId,
        team_id: &str,
        slack_user_id: &str,
        ttl_ms: i64,
    ) -> Result<ConsoleToken, StoreError> {
        let token = ConsoleToken::generate(SLACK_LINK_TOKEN_PREFIX)?;
        let now = now_millis();
        sqlx::query(
            "INSERT INTO slack_link_tokens (sha256, project_id, team_id, slack_user_id, created_at, \
             expires_at) VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .bind(sha256_hex(token.expose().as_bytes()))
        .bind(project.to_string())
        .bind(team_id)
        .bind(slack_user_id)
        .bind(now)
        .bind(now.saturating_add(ttl_ms))
        .execute(&*self.write_pool().await?)
        .await?;
        Ok(token)
    }

    /// The Slack identity `presented` names in `project`, if it is unused and unexpired.
    pub async fn slack_link(
        &self,
        project: ProjectId,
        presented: &str,
    ) -> Result<Option<SlackLinkRecord>, StoreError> {
        let row = sqlx::query(
            "SELECT team_id, slack_user_id FROM slack_link_tokens WHERE sha256 = $1 \
             AND project_id = $2 AND used_at IS NULL AND expires_at > $3",
        )
        .bind(sha256_hex(presented.as_bytes()))
        .bind(project.to_string())
        .bind(now_millis())
        .fetch_optional(self.pool())
        .await?;
        row.map(|row| {
            Ok(SlackLinkRecord {
                team_id: row.try_get("team_id")?,
                slack_user_id: row.try_get("slack_user_id")?,
            })
        })
        .transpose()
    }

    /// Uses the link token `presented` to link its Slack identity to `member`, replacing any
    /// earlier link of that identity and spending its other link tokens, and stages `recorded`, its `slack.link` entry, in the
    /// same transaction (`crate::staged`). `None` when the token is unknown, used, expired or
    /// of another project: nothing is staged.
    pub async fn link_slack_identity(
        &self,
        project: ProjectId,
        presented: &str,
        member: MemberId,
        recorded: &(dyn Fn(&SlackLinkRecord) -> AuditEvent + Sync),
    ) -> Result<Option<(SlackLinkRecord, StagedEvent)>, StoreError> {
        let mut tx = self.begin_write().await?;
        let now = now_millis();
        let digest = sha256_hex(presented.as_bytes());
        let row = sqlx::query(
            "UPDATE slack_link_tokens SET used_at = $1 WHERE sha256 = $2 AND project_id = $3 \
             AND used_at IS NULL AND expires_at > $1 RETURNING team_id, slack_user_id",
        )
        .bind(now)
        .bind(&digest)
        .bind(project.to_string())
        .fetch_optional(&mut **tx)
        .await?;
        let Some(row) = row else {
            return Ok(None);
        };
        let link = SlackLinkRecord {
            team_id: row.try_get("team_id")?,
            slack_user_id: row.try_get("slack_user_id")?,
        };
        // The identity's other links are spent with this one: a link handed on cannot move
        // the identity to whoever opens it later.
        sqlx::query(
            "UPDATE slack_link_tokens SET used_at = $1 WHERE project_id = $2 AND team_id = $3 \
             AND slack_user_id = $4 AND used_at IS NULL",
        )
        .bind(now)
        .bind(project.to_string())
        .bind(&link.team_id)
        .bind(&link.slack_user_id)
        .execute(&mut **tx)
        .await?;
        sqlx::query(
            "DELETE FROM slack_identities WHERE project_id = $1 AND team_id = $2 AND slack_user_id = $3",
        )
        .bind(project.to_string())
        .bind(&link.team_id)
        .bind(&link.slack_user_id)
        .execute(&mut **tx)
        .await?;
        sqlx::query(
            "INSERT INTO slack_identities (project_id, team_id, slack_user_id, member_id, linked_at) \
             VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(project.to_string())
        .bind(&link.team_id)
        .bind(&link.slack_user_id)
        .bind(member.to_string())
        .bind(now)
        .execute(&mut **tx)
        .await?;
        let staged = crate::staged::stage_one(&mut tx, recorded(&link)).await?;
        tx.commit().await?;
        Ok(Some((link, staged)))
    }
}

fn route_from_row(row: &sqlx::any::AnyRow) -> Result<NotificationRouteRecord, StoreError> {
    let settings: String = row.try_get("settings")?;
    let channel: RouteChannel = serde_json::from_str(&settings)
        .map_err(|e| StoreError::Corrupt(format!("notification_routes.settings: {e}")))?;
    let created_by = row
        .try_get::<Option<String>, _>("created_by")?
        .map(|k| parse_column(&k, "notification_routes.created_by"))
        .transpose()?;
    let routine_id = row
        .try_get::<Option<String>, _>("routine_id")?
        .map(|r| parse_column(&r, "notification_routes.routine_id"))
        .transpose()?;
    Ok(NotificationRouteRecord {
        id: parse_column(&row.try_get::<String, _>("id")?, "notification_routes.id")?,
        project_id: parse_column(
            &row.try_get::<String, _>("project_id")?,
            "notification_routes.project_id",
        )?,
        name: row.try_get("name")?,
        channel,
        filter: RouteFilter {
            routine_id,
            tool: row.try_get("tool")?,
            policy: row.try_get("policy")?,
        },
        created_by,
        created_at: row.try_get("created_at")?,
    })
}

fn notification_from_row(
    row: &sqlx::any::AnyRow,
) -> Result<NotificationDeliveryRecord, StoreError> {
    let action: String = row.try_get("action")?;
    Ok(NotificationDeliveryRecord {
        id: row.try_get("id")?,
        project_id: parse_column(
            &row.try_get::<String, _>("project_id")?,
            "notification_deliveries.project_id",
        )?,
        route_id: parse_column(
            &row.try_get::<String, _>("route_id")?,
            "notification_deliveries.route_id",
        )?,
        approval_id: parse_column(
            &row.try_get::<String, _>("approval_id")?,
            "notification_deliveries.approval_id",
        )?,
        action: parse_column(&action, "notification_deliveries.action")?,
        note: row.try_get("note")?,
        status: row.try_get("status")?,
        attempts: row.try_get("attempts")?,
        next_attempt_at: row.try_get("next_attempt_at")?,
        last_status_code: row.try_get("last_status_code")?,
        last_error: row.try_get("last_error")?,
        created_at: row.try_get("created_at")?,
        updated_at: row.try_get("updated_at")?,
    })
}

impl Store {
    /// The route `id` names, in whichever project: for inbound Slack interactions, which prove
    /// themselves with the route's signing secret before anything else is read.
    pub async fn find_notification_route(
        &self,
        id: NotificationRouteId,
    ) -> Result<Option<NotificationRouteRecord>, StoreError> {
        let row = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {ROUTE_COLUMNS} FROM notification_routes WHERE id = $1"
        )))
        .bind(id.to_string())
        .fetch_optional(self.pool())
        .await?;
        row.as_ref().map(route_from_row).transpose()
    }
}
