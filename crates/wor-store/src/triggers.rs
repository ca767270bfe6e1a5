//! Triggers: the schedule state of scheduled routines, and the outbox of run webhooks.
//!
//! INVARIANTS: a schedule slot or an inbound delivery starts at most one run (a unique index on
//! `runs (routine_id, trigger_key)`); a schedule's `next_slot_at` only moves forward, by a
//! compare-and-set, so two scheduler processes never both advance it; a delivery is attempted
//! by one process at a time (its `next_attempt_at` is claimed by compare-and-set).

use sqlx::Row;
use wor_core::schedule::ScheduleSection;
use wor_core::{ProjectId, RoutineId, RunId};

use crate::outbox::{Outbox, OutboxClaim};
use crate::{ScheduleAdvance, Store, StoreError, now_millis, parse_column};

/// A scheduled routine whose next slot is due.
#[derive(Debug, Clone)]
pub struct DueSchedule {
    pub project_id: ProjectId,
    pub routine_id: RoutineId,
    /// The routine's current version, whose schedule this is.
    pub version: i64,
    pub next_slot_at: i64,
}

/// A run webhook to enqueue.
#[derive(Debug, Clone)]
pub struct NewDelivery {
    pub project_id: ProjectId,
    pub routine_id: RoutineId,
    pub run_id: RunId,
    /// `run.finished`, `run.waiting_for_approval`, …
    pub event: String,
    /// Distinguishes several events of one kind in one run (e.g. the approval id).
    pub event_key: String,
    pub url: String,
    /// The JSON body, redacted, exactly as it will be sent.
    pub body: String,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct DeliveryRecord {
    pub id: String,
    pub project_id: ProjectId,
    pub routine_id: RoutineId,
    pub run_id: RunId,
    pub event: String,
    pub url: String,
    pub body: String,
    /// `pending`, `delivered` or `failed` (no attempts left).
    pub status: String,
    pub attempts: i64,
    pub next_attempt_at: i64,
    pub last_status_code: Option<i64>,
    pub last_error: Option<String>,
    pub created_at: i64,
    pub updated_at: i64,
}

/// What one delivery attempt came to.
#[derive(Debug, Clone)]
pub enum AttemptOutcome {
    Delivered {
        status_code: u16,
    },
    /// Try again at `retry_at`, or give up when `None`.
    Failed {
        status_code: Option<u16>,
        error: String,
        retry_at: Option<i64>,
    },
}

/// Filters and page of a delivery listing, newest first.
#[derive(Debug, Clone, Default)]
pub struct DeliveryFilter {
    pub routine_id: Option<RoutineId>,
    pub run_id: Option<RunId>,
    pub before: Option<String>,
    pub limit: u32,
}

const DELIVERY_COLUMNS: &str = "id, project_id, routine_id, run_id, event, url, body, status, attempts, \
    next_attempt_at, last_status_code, last_error, created_at, updated_at";

/// Keeps `routine_schedules` in step with a routine's newly applied version, in its transaction:
/// no schedule removes the row; an unchanged schedule keeps its next slot; a new or changed one
/// starts at its first slot after now.
pub(crate) async fn sync_schedule(
    tx: &mut sqlx::Transaction<'_, sqlx::Any>,
    project: ProjectId,
    routine: RoutineId,
    schedule: Option<&ScheduleSection>,
    now: i64,
) -> Result<(), StoreError> {
    let Some(schedule) = schedule else {
        sqlx::query("DELETE FROM routine_schedules WHERE routine_id = $1")
            .bind(routine.to_string())
            .execute(&mut **tx)
            .await?;
        return Ok(());
    };
    let text = serde_json::to_string(schedule)
        .map_err(|_| StoreError::Corrupt("a schedule does not serialise".to_owned()))?;
    let current: Option<String> =
        sqlx::query("SELECT schedule FROM routine_schedules WHERE routine_id = $1")
            .bind(routine.to_string())
            .fetch_optional(&mut **tx)
            .await?
            .map(|row| row.try_get("schedule"))
            .transpose()?;
    if current.as_deref() == Some(text.as_str()) {
        return Ok(());
    }
    let next = schedule
        .compile()
        .map_err(|e| StoreError::Corrupt(e.to_string()))?
        .next_after(now);
    sqlx::query("DELETE FROM routine_schedules WHERE routine_id = $1")
        .bind(routine.to_string())
        .execute(&mut **tx)
        .await?;
    sqlx::query(
        "INSERT INTO routine_schedules (routine_id, project_id, schedule, next_slot_at, updated_at) \
         VALUES ($1, $2, $3, $4, $5)",
    )
    .bind(routine.to_string())
    .bind(project.to_string())
    .bind(text)
    .bind(next)
    .bind(now)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

impl Store {
    /// Scheduled routines whose next slot is at or before `now`, oldest first (by slot, then
    /// routine), at most `limit`, after the schedule `after` (slot, routine) when given: a
    /// pass pages through them.
    pub async fn due_schedules(
        &self,
        now: i64,
        after: Option<(i64, RoutineId)>,
        limit: usize,
    ) -> Result<Vec<DueSchedule>, StoreError> {
        let (after_slot, after_routine) = match after {
            Some((slot, routine)) => (slot, routine.to_string()),
            None => (i64::MIN, String::new()),
        };
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT s.routine_id, s.project_id, s.next_slot_at, r.current_version \
             FROM routine_schedules s JOIN routines r ON r.id = s.routine_id \
             WHERE s.next_slot_at IS NOT NULL AND s.next_slot_at <= $1 \
             AND (s.next_slot_at > $2 OR (s.next_slot_at = $2 AND s.routine_id > $3)) \
             ORDER BY s.next_slot_at, s.routine_id {}",
            crate::limit_clause(u64::try_from(limit).unwrap_or(u64::MAX))
        )))
        .bind(now)
        .bind(after_slot)
        .bind(after_routine)
        .fetch_all(self.pool())
        .await?;
        rows.iter()
            .map(|row| {
                Ok(DueSchedule {
                    routine_id: parse_column(
                        &row.try_get::<String, _>("routine_id")?,
                        "routine_schedules.routine_id",
                    )?,
                    project_id: parse_column(
                        &row.try_get::<String, _>("project_id")?,
                        "routine_schedules.project_id",
                    )?,
                    version: row.try_get("current_version")?,
                    next_slot_at: row.try_get("next_slot_at")?,
                })
            })
            .collect()
    }

    /// The next slot of a scheduled routine, if it has a schedule.
    pub async fn schedule_next_slot(
        &self,
        project: ProjectId,
        routine: RoutineId,
    ) -> Result<Option<i64>, StoreError> {
        let row = sqlx::query(
            "SELECT next_slot_at FROM routine_schedules WHERE project_id = $1 AND routine_id = $2",
        )
        .bind(project.to_string())
        .bind(routine.to_string())
        .fetch_optional(self.pool())
        .await?;
        Ok(match row {
            Some(row) => row.try_get("next_slot_at")?,
            None => None,
        })
    }

    /// The earliest next slot of any schedule after `now` (Unix ms), if there is one.
    pub async fn next_due_slot(&self, now: i64) -> Result<Option<i64>, StoreError> {
        let row = sqlx::query(
            "SELECT MIN(next_slot_at) AS next FROM routine_schedules WHERE next_slot_at > $1",
        )
        .bind(now)
        .fetch_one(self.pool())
        .await?;
        Ok(row.try_get("next")?)
    }

    /// Moves a schedule's next slot from `from` to `to`; false when another process moved it
    /// first (this one then does nothing more for that schedule).
    pub async fn advance_schedule(
        &self,
        routine: RoutineId,
        from: i64,
        to: Option<i64>,
    ) -> Result<bool, StoreError> {
        let pool = self.write_pool().await?;
        let mut connection = pool.acquire().await?;
        advance_schedule(
            &mut connection,
            &ScheduleAdvance { routine, from, to },
            now_millis(),
        )
        .await
    }

    /// Enqueues a run webhook; enqueueing the same event of a run again does nothing.
    pub async fn enqueue_delivery(&self, delivery: &NewDelivery) -> Result<(), StoreError> {
        let now = now_millis();
        sqlx::query(
            "INSERT INTO webhook_deliveries (id, project_id, routine_id, run_id, event, event_key, url, \
             body, status, attempts, next_attempt_at, created_at, updated_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, 'pending', 0, $9, $9, $9) \
             ON CONFLICT (run_id, event_key) DO NOTHING",
        )
        .bind(format!("dlv_{}", uuid::Uuid::now_v7().simple()))
        .bind(delivery.project_id.to_string())
        .bind(delivery.routine_id.to_string())
        .bind(delivery.run_id.to_string())
        .bind(&delivery.event)
        .bind(&delivery.event_key)
        .bind(&delivery.url)
        .bind(&delivery.body)
        .bind(now)
        .execute(&*self.write_pool().await?)
        .await?;
        Ok(())
    }

    /// Claims up to `limit` pending deliveries due at `now` for `lease_ms`: each is returned to
    /// exactly one caller until its lease runs out.
    pub async fn claim_due_deliveries(
        &self,
        now: i64,
        lease_ms: i64,
        limit: u32,
    ) -> Result<OutboxClaim<DeliveryRecord>, StoreError> {
        self.claim_due(
            Outbox::Webhooks,
            DELIVERY_COLUMNS,
            delivery_from_row,
            now,
            lease_ms,
            limit,
        )
        .await
    }

    /// Records one attempt of a delivery claimed until `leased_until`; whether the claim still
    /// held (else nothing is written: another process may have taken it).
    pub async fn record_delivery_attempt(
        &self,
        id: &str,
        leased_until: i64,
        outcome: &AttemptOutcome,
    ) -> Result<bool, StoreError> {
        self.record_attempt(Outbox::Webhooks, id, leased_until, outcome)
            .await
    }

    /// Gives back deliveries claimed until `leased_until` that a stopping process did not
    /// attempt: due again at once.
    pub async fn release_delivery_claims(
        &self,
        ids: &[&str],
        leased_until: i64,
    ) -> Result<(), StoreError> {
        self.release_claims(Outbox::Webhooks, ids, leased_until)
            .await
    }

    pub async fn list_deliveries(
        &self,
        project: ProjectId,
        filter: &DeliveryFilter,
    ) -> Result<Vec<DeliveryRecord>, StoreError> {
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {DELIVERY_COLUMNS} FROM webhook_deliveries WHERE project_id = $1 \
             AND ($2 IS NULL OR routine_id = $2) AND ($3 IS NULL OR run_id = $3) AND ($4 IS NULL OR id < $4) \
             ORDER BY id DESC LIMIT $5"
        )))
        .bind(project.to_string())
        .bind(filter.routine_id.map(|r| r.to_string()))
        .bind(filter.run_id.map(|r| r.to_string()))
        .bind(filter.before.clone())
        .bind(i64::from(filter.limit))
        .fetch_all(self.pool())
        .await?;
        rows.iter().map(delivery_from_row).collect()
    }
}

fn delivery_from_row(row: &sqlx::any::AnyRow) -> Result<DeliveryRecord, StoreError> {
    Ok(DeliveryRecord {
        id: row.try_get("id")?,
        project_id: parse_column(
            &row.try_get::<String, _>("project_id")?,
            "webhook_deliveries.project_id",
        )?,
        routine_id: parse_column(
            &row.try_get::<String, _>("routine_id")?,
            "webhook_deliveries.routine_id",
        )?,
        run_id: parse_column(
            &row.try_get::<String, _>("run_id")?,
            "webhook_deliveries.run_id",
        )?,
        event: row.try_get("event")?,
        url: row.try_get("url")?,
        body: row.try_get("body")?,
        status: row.try_get("status")?,
        attempts: row.try_get("attempts")?,
        next_attempt_at: row.try_get("next_attempt_at")?,
        last_status_code: row.try_get("last_status_code")?,
        last_error: row.try_get("last_error")?,
        created_at: row.try_get("created_at")?,
        updated_at: row.try_get("updated_at")?,
    })
}

/// Moves a schedule on by compare-and-set; false when another process moved it first.
pub(crate) async fn advance_schedule(
    connection: &mut sqlx::AnyConnection,
    advance: &ScheduleAdvance,
    now: i64,
) -> Result<bool, StoreError> {
    let done = sqlx::query(
        "UPDATE routine_schedules SET next_slot_at = $1, updated_at = $2 \
         WHERE routine_id = $3 AND next_slot_at = $4",
    )
    .bind(advance.to)
    .bind(now)
    .bind(advance.routine.to_string())
    .bind(advance.from)
    .execute(connection)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Moves schedules on by compare-and-set, in one statement: each moves only if its next slot
/// is still the one it was planned from (another process may have moved it first).
pub(crate) async fn advance_schedules(
    connection: &mut sqlx::AnyConnection,
    advances: &[ScheduleAdvance],
    now: i64,
) -> Result<(), StoreError> {
    if advances.is_empty() {
        return Ok(());
    }
    let sql = format!(
        "UPDATE routine_schedules SET next_slot_at = CAST(v.column3 AS BIGINT), updated_at = $1 \
         FROM (VALUES {}) AS v \
         WHERE routine_schedules.routine_id = v.column1 \
         AND routine_schedules.next_slot_at = CAST(v.column2 AS BIGINT)",
        crate::value_rows(2, advances.len(), 3)
    );
    let mut query = sqlx::query(sqlx::AssertSqlSafe(sql)).bind(now);
    for advance in advances {
        query = query
            .bind(advance.routine.to_string())
            .bind(advance.from)
            .bind(advance.to);
    }
    query.execute(connection).await?;
    Ok(())
}
