//! Runs that start on their own, and the webhooks that tell other systems about runs:
//! the scheduler, signed inbound webhooks, and the outbox of signed run webhooks
//! (docs/webhooks.md, invariant S13).

use std::time::Duration;

use secrecy::{ExposeSecret as _, SecretString};
use serde_json::{Value, json};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use wor_core::audit::{Actor, AuditCategory, AuditEvent};
use wor_core::routine::{RoutineDefinition, RunEvent, WebhookScheme};
use wor_core::run::RunStatus;
use wor_core::schedule::slot_rfc3339;
use wor_core::{ProjectId, RoutineId};
use wor_egress::{EgressRequest, HeaderMap, header};
use wor_secrets::webhook_signature;
use wor_store::{AttemptOutcome, NewDelivery, RunRecord, SecretSlot, StoreError};

use crate::{Engine, EngineError, StartRun, Trigger};

/// The vault table webhook secrets are filed under (one per routine).
pub const ROUTINES_TABLE: &str = "routines";
/// The vault field of a routine's inbound webhook secret.
pub const WEBHOOK_SECRET_FIELD: &str = "webhook_secret";
/// The vault field of a routine's run webhook (notify) secret.
pub const NOTIFY_SECRET_FIELD: &str = "notify_secret";

/// Which of a routine's two webhook secrets. They are separate so that a run webhook a
/// receiver got can never be replayed as an inbound webhook of the same routine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WebhookSecretKind {
    /// Verifies inbound webhooks (`[webhook]`).
    Inbound,
    /// Signs run webhooks (`[notify]`).
    Notify,
}

impl WebhookSecretKind {
    fn field(self) -> &'static str {
        match self {
            WebhookSecretKind::Inbound => WEBHOOK_SECRET_FIELD,
            WebhookSecretKind::Notify => NOTIFY_SECRET_FIELD,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            WebhookSecretKind::Inbound => "inbound",
            WebhookSecretKind::Notify => "notify",
        }
    }
}
/// How far a webhook timestamp may be from now, either way.
pub const REPLAY_WINDOW_SECS: u64 = 300;
/// Largest inbound webhook body accepted.
pub const MAX_WEBHOOK_BYTES: usize = 256 * 1024;
/// Longest delivery id (`wor-delivery`, `webhook-id`) accepted.
pub const MAX_DELIVERY_ID_BYTES: usize = 256;
/// How often the scheduler and each outbox look for work when they found none.
const TICK: Duration = Duration::from_secs(1);
/// Attempts per run webhook before it is given up.
pub const MAX_DELIVERY_ATTEMPTS: i64 = 6;
/// Which outbox a delivery task serves.
#[derive(Debug, Clone, Copy)]
enum Outbox {
    Webhooks,
    Notifications,
}

/// How many items of an outbox one pass claims, and so at most how many it sends at once.
pub(crate) const OUTBOX_BATCH: u32 = 32;
/// A claimed delivery is taken by another pass after this long: room for a run's batch of
/// attempts in turn, each started only while the claim has room for it.
const DELIVERY_LEASE_MS: i64 = 60_000;

/// An inbound webhook as received: the headers of each signing scheme, and the body. Only the
/// headers of the routine's own scheme are read.
#[derive(Debug, Clone, Default)]
pub struct InboundWebhook {
    /// `wor-timestamp`, `wor-signature`, `wor-delivery`.
    pub wor: SignedHeaders,
    /// Standard Webhooks: `webhook-timestamp`, `webhook-signature`, `webhook-id`.
    pub standard: SignedHeaders,
    pub body: Vec<u8>,
}

/// The headers of one signing scheme, as received.
#[derive(Debug, Clone, Default)]
pub struct SignedHeaders {
    pub timestamp: Option<String>,
    pub signature: Option<String>,
    pub delivery: Option<String>,
}

/// Why an inbound webhook started nothing. Each maps to one HTTP answer.
#[derive(Debug, thiserror::Error)]
pub enum WebhookRejection {
    /// Unknown routine, or its webhook is not enabled: answered as not found.
    #[error("not found")]
    NotFound,
    #[error("the body is larger than {MAX_WEBHOOK_BYTES} bytes")]
    TooLarge,
    #[error("{0}")]
    BadSignature(String),
    #[error("this delivery was received before")]
    Replayed,
    #[error("{0}")]
    Refused(String),
    #[error(transparent)]
    Engine(#[from] EngineError),
}

impl Engine {
    /// The next `count` slots of a routine's schedule after now, if it has one.
    pub async fn next_firings(
        &self,
        project: ProjectId,
        routine: RoutineId,
        definition: &RoutineDefinition,
        count: usize,
    ) -> Result<Vec<i64>, EngineError> {
        let Some(section) = &definition.schedule else {
            return Ok(Vec::new());
        };
        let schedule = section.compile().map_err(EngineError::Schedule)?;
        let from = match self.store.schedule_next_slot(project, routine).await? {
            // The stored next slot is the first one to fire (it may be due right now).
            Some(next) => next.saturating_sub(1),
            None => wor_store::now_millis(),
        };
        Ok(schedule.upcoming(from, count))
    }

    /// A task that runs the scheduler, the webhook outbox and the notification outbox, each
    /// in a task of its own, until `shutdown`: a receiver that is slow to answer holds up
    /// neither the schedules nor the other outbox. The scheduler wakes when the earliest
    /// schedule is due (and at least every second, for routines applied meanwhile); an outbox
    /// passes again at once after a full batch, else a second later.
    pub fn spawn_triggers(&self, shutdown: watch::Receiver<bool>) -> JoinHandle<()> {
        let scheduler = tokio::spawn(self.clone().schedule_until(shutdown.clone()));
        let webhooks = tokio::spawn(
            self.clone()
                .deliver_until(Outbox::Webhooks, shutdown.clone()),
        );
        let notifications =
            tokio::spawn(self.clone().deliver_until(Outbox::Notifications, shutdown));
        tokio::spawn(async move {
            for (name, task) in [
                ("scheduler", scheduler),
                ("webhook outbox", webhooks),
                ("notification outbox", notifications),
            ] {
                if let Err(error) = task.await {
                    tracing::error!(category = "lifecycle", task = name, error = %error, "a trigger task ended abnormally");
                }
            }
        })
    }

    async fn schedule_until(self, mut shutdown: watch::Receiver<bool>) {
        loop {
            if *shutdown.borrow() {
                return;
            }
            let now = wor_store::now_millis();
            if let Err(error) = self.schedule_tick(now).await {
                tracing::error!(category = "schedule", error = %error, "scheduler pass failed");
            }
            let wake = self.next_scheduler_wake(now).await;
            tokio::select! {
                () = tokio::time::sleep_until(wake) => {},
                _ = shutdown.changed() => return,
            }
        }
    }

    async fn deliver_until(self, outbox: Outbox, mut shutdown: watch::Receiver<bool>) {
        loop {
            if *shutdown.borrow() {
                return;
            }
            let now = wor_store::now_millis();
            // A pass started here starts no attempt once the process is stopping: it waits
            // only for those in flight, and gives back what it claimed and did not start.
            let stopping = Some(shutdown.clone());
            let claimed = match outbox {
                Outbox::Webhooks => self.webhook_pass(now, stopping).await.unwrap_or_else(|error| {
                    tracing::error!(category = "webhook", error = %error, "webhook delivery pass failed");
                    0
                }),
                Outbox::Notifications => {
                    self.notification_pass(now, stopping).await.unwrap_or_else(|error| {
                        tracing::error!(category = "notification", error = %error, "notification pass failed");
                        0
                    })
                }
            };
            if claimed >= OUTBOX_BATCH as usize {
                continue;
            }
            tokio::select! {
                () = tokio::time::sleep(TICK) => {},
                _ = shutdown.changed() => return,
            }
        }
    }

    /// When the scheduler looks again after a pass that looked at `looked_at` (Unix ms); see
    /// [`scheduler_wait`].
    async fn next_scheduler_wake(&self, looked_at: i64) -> tokio::time::Instant {
        let next = match self.store.next_due_slot(looked_at).await {
            Ok(next) => next,
            Err(error) => {
                tracing::error!(category = "schedule", error = %error, "reading the next due slot failed");
                None
            }
        };
        tokio::time::Instant::now() + scheduler_wait(next, looked_at, wor_store::now_millis())
    }

    /// The slot of one of a routine's webhook secrets.
    fn webhook_slot(project: ProjectId, routine: RoutineId, kind: WebhookSecretKind) -> SecretSlot {
        SecretSlot::new(project, ROUTINES_TABLE, routine, kind.field())
    }

    /// Whether the routine has that webhook secret.
    pub async fn has_webhook_secret(
        &self,
        project: ProjectId,
        routine: RoutineId,
        kind: WebhookSecretKind,
    ) -> Result<bool, EngineError> {
        Ok(self
            .vault
            .metadata(&Self::webhook_slot(project, routine, kind))
            .await?
            .is_some())
    }

    /// Makes a new webhook secret for the routine (replacing any), seals it, and returns it:
    /// the only time it is shown.
    pub async fn rotate_webhook_secret(
        &self,
        project: ProjectId,
        routine: RoutineId,
        kind: WebhookSecretKind,
        actor: Actor,
    ) -> Result<SecretString, EngineError> {
        let secret = webhook_signature::generate_secret().map_err(EngineError::WebhookSecret)?;
        let slot = Self::webhook_slot(project, routine, kind);
        // The entry is staged with the secret: a crash before it is appended leaves it for the
        // audit writer's sweep, never a new secret without its entry.
        let recorded = webhook_secret_entry(&slot, routine, kind, actor);
        let (_, staged) = self
            .vault
            .put_staged(&[(slot, secret.expose_secret())], Some(recorded))
            .await
            .map_err(EngineError::Vault)?;
        self.append_staged_or_log(staged).await;
        Ok(secret)
    }

    /// Makes the routine's webhook secret of `kind` if it has none, and returns it: the only
    /// time it is shown. `None` when it had one, made by a caller beside this one included, so
    /// that of applies at the same moment one shows the secret that verifies.
    pub async fn create_webhook_secret(
        &self,
        project: ProjectId,
        routine: RoutineId,
        kind: WebhookSecretKind,
        actor: Actor,
    ) -> Result<Option<SecretString>, EngineError> {
        let slot = Self::webhook_slot(project, routine, kind);
        if self.vault.metadata(&slot).await?.is_some() {
            return Ok(None);
        }
        let secret = webhook_signature::generate_secret().map_err(EngineError::WebhookSecret)?;
        let recorded = webhook_secret_entry(&slot, routine, kind, actor);
        let staged = self
            .vault
            .put_new_staged(&slot, secret.expose_secret(), recorded)
            .await
            .map_err(EngineError::Vault)?;
        Ok(match staged {
            Some(staged) => {
                self.append_staged_or_log(Some(staged)).await;
                Some(secret)
            }
            None => None,
        })
    }

    async fn open_webhook_secret(
        &self,
        project: ProjectId,
        routine: RoutineId,
        kind: WebhookSecretKind,
    ) -> Result<Option<SecretString>, EngineError> {
        let slot = Self::webhook_slot(project, routine, kind);
        if self.vault.metadata(&slot).await?.is_none() {
            return Ok(None);
        }
        self.vault
            .open(&slot)
            .await
            .map(Some)
            .map_err(EngineError::Vault)
    }

    /// Checks an inbound webhook for `routine` and starts a run with its payload as untrusted
    /// input. Nothing about the routine is revealed before the signature checks out.
    pub async fn receive_webhook(
        &self,
        routine: RoutineId,
        hook: InboundWebhook,
    ) -> Result<RunRecord, WebhookRejection> {
        if hook.body.len() > MAX_WEBHOOK_BYTES {
            return Err(WebhookRejection::TooLarge);
        }
        let record = match self.store.get_routine_for_webhook(routine).await {
            Ok(record) => record,
            Err(StoreError::NotFound) => return Err(WebhookRejection::NotFound),
            Err(other) => return Err(EngineError::from(other).into()),
        };
        let version = self
            .routine_version(record.project_id, record.id, record.current_version)
            .await?;
        let settings = &version.definition.webhook;
        if !settings.enabled {
            return Err(WebhookRejection::NotFound);
        }
        let Some(secret) = self
            .open_webhook_secret(record.project_id, record.id, WebhookSecretKind::Inbound)
            .await?
        else {
            return Err(WebhookRejection::NotFound);
        };
        let bad = |reason: &str| WebhookRejection::BadSignature(reason.to_owned());
        // The routine's scheme names the headers read; the other scheme's are not looked at.
        let headers = match settings.scheme {
            WebhookScheme::Wor => &hook.wor,
            WebhookScheme::Standard => &hook.standard,
        };
        if headers
            .delivery
            .as_deref()
            .is_some_and(|id| id.len() > MAX_DELIVERY_ID_BYTES || id.chars().any(char::is_control))
        {
            return Err(bad(&format!(
                "the delivery id must be at most {MAX_DELIVERY_ID_BYTES} printable bytes"
            )));
        }
        let timestamp = webhook_signature::parse_timestamp(
            headers
                .timestamp
                .as_deref()
                .ok_or_else(|| bad("missing timestamp header"))?,
        )
        .ok_or_else(|| bad("the timestamp is not Unix seconds (decimal digits only)"))?;
        let signature = headers
            .signature
            .as_deref()
            .ok_or_else(|| bad("missing signature header"))?;
        let now = wor_store::now_millis() / 1000;
        let checked = match settings.scheme {
            WebhookScheme::Wor => webhook_signature::verify(
                secret.expose_secret(),
                timestamp,
                &hook.body,
                signature,
                now,
                REPLAY_WINDOW_SECS,
            ),
            WebhookScheme::Standard => {
                let id = headers.delivery.as_deref().ok_or_else(|| {
                    bad("missing webhook-id header, or one that is not visible ASCII")
                })?;
                wor_secrets::StandardWebhookSecret::parse(secret.expose_secret()).and_then(
                    |standard| {
                        standard.verify(
                            id,
                            timestamp,
                            &hook.body,
                            signature,
                            now,
                            REPLAY_WINDOW_SECS,
                        )
                    },
                )
            }
        };
        checked.map_err(|e| WebhookRejection::BadSignature(e.to_string()))?;
        // Deduplicated by what the signature covers: in the `wor` scheme that is the timestamp
        // and body (a `wor-delivery` header is not signed, so a replay could change it); in
        // Standard Webhooks the signed `webhook-id`.
        let delivery = match settings.scheme {
            WebhookScheme::Wor => format!(
                "sig:{}",
                wor_core::canonical::sha256_hex(signature.trim().to_ascii_lowercase().as_bytes())
            ),
            WebhookScheme::Standard => {
                format!("id:{}", headers.delivery.as_deref().unwrap_or_default())
            }
        };
        // A payload nested deeper than any API body may be is kept as the text it came as.
        let parsed = if wor_core::json_depth::text_nesting(&hook.body)
            > wor_core::json_depth::MAX_JSON_NESTING
        {
            None
        } else {
            serde_json::from_slice::<Value>(&hook.body).ok()
        };
        let mut input = match parsed {
            Some(json) => json,
            None => Value::String(String::from_utf8_lossy(&hook.body).into_owned()),
        };
        // A sender's payload is the run's input as it came; U+0000 cannot be stored.
        wor_core::text::replace_nul_in_json(&mut input);
        match self
            .start_run(StartRun {
                project: record.project_id,
                routine: record.id,
                input,
                trigger: Trigger::Webhook { delivery },
                actor: None,
                thread: None,
                idempotency_key: None,
            })
            .await
        {
            Ok(started) => Ok(started.into_run()),
            Err(EngineError::Store(StoreError::Conflict(_))) => Err(WebhookRejection::Replayed),
            Err(refused @ EngineError::RefusedInProduction(_)) => {
                Err(WebhookRejection::Refused(refused.to_string()))
            }
            Err(other) => Err(other.into()),
        }
    }

    /// Queues the run webhook for `event` if the run's routine asks for it. `approval` adds
    /// the approval a parked run waits on.
    pub(crate) async fn enqueue_run_webhook(
        &self,
        run: &RunRecord,
        status: RunStatus,
        outcome: Option<&str>,
        approval: Option<Value>,
    ) -> Result<(), EngineError> {
        let event = match status {
            RunStatus::Succeeded => RunEvent::Finished,
            RunStatus::WaitingForApproval => RunEvent::WaitingForApproval,
            RunStatus::Failed | RunStatus::Cancelled => RunEvent::Failed,
            RunStatus::BudgetExceeded => RunEvent::BudgetExceeded,
            RunStatus::Queued | RunStatus::Running | RunStatus::Skipped => return Ok(()),
        };
        let version = self
            .routine_version(run.project_id, run.routine_id, run.routine_version)
            .await?;
        let Some(notify) = &version.definition.notify else {
            return Ok(());
        };
        if !notify.events.contains(&event) {
            return Ok(());
        }
        let event_key = match approval
            .as_ref()
            .and_then(|a| a.get("id"))
            .and_then(Value::as_str)
        {
            Some(id) => format!("{}:{id}", event.as_str()),
            None => event.as_str().to_owned(),
        };
        let mut body = json!({
            "event": event.as_str(),
            "occurred_at": slot_rfc3339(wor_store::now_millis()),
            "project_id": run.project_id.to_string(),
            "routine": { "id": run.routine_id.to_string(), "name": version.definition.name.as_str(), "version": run.routine_version },
            "run": {
                "id": run.id.to_string(),
                "status": status.as_str(),
                "trigger": run.trigger_kind,
                "outcome": outcome,
                "usage": run.usage,
            },
        });
        if let Some(approval) = approval
            && let Some(map) = body.as_object_mut()
        {
            map.insert("approval".to_owned(), approval);
        }
        // A routine with `[output] schema` ends `succeeded` only with a validated answer, whose
        // compact JSON is the outcome: the receiver gets it as JSON too.
        if event == RunEvent::Finished
            && version.definition.output.is_some()
            && let Some(result) = outcome.and_then(|o| serde_json::from_str::<Value>(o).ok())
            && let Some(run) = body.get_mut("run").and_then(Value::as_object_mut)
        {
            run.insert("result".to_owned(), result);
        }
        self.project_redactor(run.project_id)
            .await?
            .redact_json(&mut body);
        self.store
            .enqueue_delivery(&NewDelivery {
                project_id: run.project_id,
                routine_id: run.routine_id,
                run_id: run.id,
                event: event.as_str().to_owned(),
                event_key,
                url: notify.url.clone(),
                body: body.to_string(),
            })
            .await?;
        Ok(())
    }

    /// Sends the run webhooks due at `now`, signed with their routine's secret, through the
    /// egress guard; failures are retried with exponential backoff and jitter, at most
    /// [`MAX_DELIVERY_ATTEMPTS`] times. A run's webhooks go one after another, in the order
    /// they were queued; different runs' go side by side. Returns how many were claimed.
    pub async fn deliver_webhooks(&self, now: i64) -> Result<usize, EngineError> {
        self.webhook_pass(now, None).await
    }

    /// [`Engine::deliver_webhooks`], starting no attempt once `stopping` says so.
    async fn webhook_pass(
        &self,
        now: i64,
        stopping: Option<watch::Receiver<bool>>,
    ) -> Result<usize, EngineError> {
        let claimed = self
            .store
            .claim_due_deliveries(now, DELIVERY_LEASE_MS, OUTBOX_BATCH)
            .await?;
        let count = claimed.items.len();
        let room = PassRoom {
            leased_until: claimed.leased_until,
            stopping,
        };
        let runs = grouped(claimed.items, |delivery| delivery.run_id);
        let sent = futures::future::join_all(
            runs.iter()
                .map(|deliveries| self.deliver_run_webhooks(deliveries, &room)),
        )
        .await;
        sent.into_iter().collect::<Result<(), _>>()?;
        Ok(count)
    }

    /// Sends one run's claimed webhooks in turn, while the pass has room for one more.
    async fn deliver_run_webhooks(
        &self,
        deliveries: &[wor_store::DeliveryRecord],
        room: &PassRoom,
    ) -> Result<(), EngineError> {
        let leased_until = room.leased_until;
        for (started, delivery) in deliveries.iter().enumerate() {
            if !room.for_one_more(wor_egress::WEBHOOK_TIMEOUT) {
                // Given back when stopping; else left claimed, for another pass once the
                // claim runs out.
                if room.stopping() {
                    let ids: Vec<&str> = deliveries
                        .get(started..)
                        .unwrap_or_default()
                        .iter()
                        .map(|d| d.id.as_str())
                        .collect();
                    self.store
                        .release_delivery_claims(&ids, leased_until)
                        .await?;
                }
                return Ok(());
            }
            let began = std::time::SystemTime::now();
            let outcome = self.attempt_webhook(delivery).await?;
            tracing::info!(category = "webhook", action = "webhook.deliver", project_id = %delivery.project_id,
                run_id = %delivery.run_id, delivered = matches!(outcome, AttemptOutcome::Delivered { .. }),
                attempt = delivery.attempts + 1, "run webhook attempted");
            crate::metrics::webhook_attempted(&outcome);
            crate::traces::webhook_attempted(
                delivery.project_id,
                delivery.run_id,
                began,
                delivery.attempts + 1,
                &outcome,
            );
            if !self
                .store
                .record_delivery_attempt(&delivery.id, leased_until, &outcome)
                .await?
            {
                tracing::warn!(category = "webhook", project_id = %delivery.project_id,
                    run_id = %delivery.run_id, delivery = %delivery.id,
                    "a run webhook's claim ran out before its attempt was recorded; another pass may send it again");
            }
        }
        Ok(())
    }

    /// One attempt at sending `delivery`.
    async fn attempt_webhook(
        &self,
        delivery: &wor_store::DeliveryRecord,
    ) -> Result<AttemptOutcome, EngineError> {
        let Some(secret) = self
            .open_webhook_secret(
                delivery.project_id,
                delivery.routine_id,
                WebhookSecretKind::Notify,
            )
            .await?
        else {
            return Ok(AttemptOutcome::Failed {
                status_code: None,
                error: "the routine has no notify secret; create one with `wor routine webhook-secret --notify`".to_owned(),
                retry_at: None,
            });
        };
        let timestamp = wor_store::now_millis() / 1000;
        let signature =
            webhook_signature::sign(secret.expose_secret(), timestamp, delivery.body.as_bytes());
        let mut request = EgressRequest::webhook(&delivery.url, delivery.body.clone().into_bytes());
        request.headers = delivery_headers(&delivery.id, &delivery.event, timestamp, &signature);
        request.max_response_bytes = Some(wor_egress::EgressLimits::webhook().max_response_bytes);
        Ok(match self.egress.send(request).await {
            Ok(response) if response.status.is_success() => AttemptOutcome::Delivered {
                status_code: response.status.as_u16(),
            },
            Ok(response) => AttemptOutcome::Failed {
                status_code: Some(response.status.as_u16()),
                error: format!("the receiver answered {}", response.status),
                retry_at: retry_at(&delivery.id, delivery.attempts + 1),
            },
            Err(error) => AttemptOutcome::Failed {
                status_code: None,
                error: wor_secrets::redact_shapes(&error.to_string()).into_owned(),
                retry_at: retry_at(&delivery.id, delivery.attempts + 1),
            },
        })
    }
}

/// The entry of a webhook secret of `routine` made into `slot`, new or in place of another.
fn webhook_secret_entry(
    slot: &SecretSlot,
    routine: RoutineId,
    kind: WebhookSecretKind,
    actor: Actor,
) -> AuditEvent {
    AuditEvent::new(slot.project, AuditCategory::WebhookSecretRotate, actor)
        .subject("routine_id", routine)
        .payload(json!({ "slot": slot.to_string(), "kind": kind.as_str() }))
}

/// `items` in groups of one `key` each, every group in the order the items came.
pub(crate) fn grouped<T, K: Ord>(items: Vec<T>, key: impl Fn(&T) -> K) -> Vec<Vec<T>> {
    let mut groups: std::collections::BTreeMap<K, Vec<T>> = std::collections::BTreeMap::new();
    for item in items {
        groups.entry(key(&item)).or_default().push(item);
    }
    groups.into_values().collect()
}

/// What one outbox pass may still start: an attempt only while its claim has room for it, and
/// none once the process is stopping.
#[derive(Debug)]
pub(crate) struct PassRoom {
    /// Unix ms: the pass's claim holds until then.
    pub(crate) leased_until: i64,
    /// Says when the process is stopping; none for a pass run on its own.
    pub(crate) stopping: Option<watch::Receiver<bool>>,
}

impl PassRoom {
    /// Whether the process is stopping: what the pass has not started it gives back.
    pub(crate) fn stopping(&self) -> bool {
        self.stopping
            .as_ref()
            .is_some_and(|stopping| *stopping.borrow())
    }

    /// Whether the pass may start an attempt that may take `attempt`.
    pub(crate) fn for_one_more(&self, attempt: Duration) -> bool {
        !self.stopping() && time_for_one_more(self.leased_until, attempt)
    }
}

/// Whether a claim held until `leased_until` (Unix ms) still has room for an attempt that
/// may take `attempt`, with a margin for recording it.
fn time_for_one_more(leased_until: i64, attempt: Duration) -> bool {
    const MARGIN_MS: i64 = 5_000;
    let attempt_ms = i64::try_from(attempt.as_millis()).unwrap_or(i64::MAX);
    wor_store::now_millis()
        .saturating_add(attempt_ms)
        .saturating_add(MARGIN_MS)
        <= leased_until
}

fn delivery_headers(id: &str, event: &str, timestamp: i64, signature: &str) -> HeaderMap {
    let mut headers = HeaderMap::new();
    let pairs = [
        ("content-type", "application/json".to_owned()),
        ("wor-delivery", id.to_owned()),
        ("wor-event", event.to_owned()),
        ("wor-timestamp", timestamp.to_string()),
        ("wor-signature", signature.to_owned()),
    ];
    for (name, value) in pairs {
        if let (Ok(name), Ok(value)) = (
            header::HeaderName::from_bytes(name.as_bytes()),
            header::HeaderValue::from_str(&value),
        ) {
            headers.insert(name, value);
        }
    }
    headers
}

/// When attempt `attempt` (1-based, just failed) is retried: 2 s doubling per attempt, at most
/// 10 minutes, with up to 20 % jitter fixed by the delivery id; `None` once attempts run out.
pub(crate) fn retry_at(id: &str, attempt: i64) -> Option<i64> {
    if attempt >= MAX_DELIVERY_ATTEMPTS {
        return None;
    }
    let exponent = u32::try_from(attempt.saturating_sub(1))
        .unwrap_or(0)
        .min(16);
    let base = 2_000_i64.saturating_mul(1_i64 << exponent).min(600_000);
    let digest = wor_core::canonical::sha256_hex(format!("{id}:{attempt}").as_bytes());
    let spread = digest
        .get(..8)
        .and_then(|h| i64::from_str_radix(h, 16).ok())
        .unwrap_or(0)
        % (base / 5 + 1);
    Some(wor_store::now_millis() + base + spread)
}

/// How long the scheduler waits at `now` after a pass that looked at `looked_at`, when `next`
/// is the earliest slot after `looked_at` (Unix ms): until that slot's lead begins (its run
/// may be recorded then), or, when the pass looked inside the lead, until a millisecond past
/// the slot, so that the next pass finds due what could not be recorded ahead — not at all
/// when that moment came while the pass ran, and at most a tick (a slot the pass saw due and
/// left, inside its jitter or unable to start, is looked at again then).
fn scheduler_wait(next: Option<i64>, looked_at: i64, now: i64) -> Duration {
    let Some(next) = next else { return TICK };
    let ahead = next.saturating_sub(crate::scheduler::DISPATCH_AHEAD_MS);
    let at = if ahead > looked_at {
        ahead
    } else {
        next.saturating_add(1)
    };
    let wait = u64::try_from(at.saturating_sub(now)).unwrap_or(0);
    Duration::from_millis(wait).min(TICK)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retries_back_off_and_stop() {
        let now = wor_store::now_millis();
        let first = retry_at("dlv_1", 1).unwrap() - now;
        let third = retry_at("dlv_1", 3).unwrap() - now;
        assert!((2_000..=2_500).contains(&first), "{first}");
        assert!((8_000..=9_700).contains(&third), "{third}");
        assert_eq!(retry_at("dlv_1", MAX_DELIVERY_ATTEMPTS), None);
    }

    #[test]
    fn the_scheduler_wakes_for_a_lead_or_a_slot_and_at_once_for_one_that_came_during_its_pass() {
        use crate::scheduler::DISPATCH_AHEAD_MS as LEAD;
        let ms = Duration::from_millis;
        let slot = 1_800_000_000_000_i64;
        // Nothing scheduled: a tick.
        assert_eq!(scheduler_wait(None, slot, slot), TICK);
        // Before the lead: when it begins, at most a tick away.
        assert_eq!(
            scheduler_wait(Some(slot), slot - LEAD - 300, slot - LEAD - 300),
            ms(300)
        );
        assert_eq!(
            scheduler_wait(Some(slot), slot - LEAD - 9_000, slot - LEAD - 9_000),
            TICK
        );
        // The lead began while the pass ran: at once, to record the runs ahead.
        assert_eq!(
            scheduler_wait(Some(slot), slot - LEAD - 50, slot - LEAD + 20),
            ms(0)
        );
        // The pass looked inside the lead: a millisecond past the slot.
        assert_eq!(scheduler_wait(Some(slot), slot - 400, slot - 300), ms(301));
        // The slot came while the pass ran (it looked before it, and it is past now): at once,
        // not a tick late.
        assert_eq!(scheduler_wait(Some(slot), slot - 80, slot + 150), ms(0));
    }
}
