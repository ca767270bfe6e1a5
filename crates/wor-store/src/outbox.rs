//! The two outboxes, run webhooks (`webhook_deliveries`) and approval notifications
//! (`notification_deliveries`): the same columns for when an item is due and how its attempts
//! went, so one claim and one record of an attempt serve both.

use sqlx::Row;
use sqlx::any::AnyRow;

use crate::{AttemptOutcome, Store, StoreError, now_millis};

/// Which outbox.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Outbox {
    Webhooks,
    Notifications,
}

impl Outbox {
    fn table(self) -> &'static str {
        match self {
            Outbox::Webhooks => "webhook_deliveries",
            Outbox::Notifications => "notification_deliveries",
        }
    }
}

/// Items of an outbox claimed together, and until when they are the claimant's: another
/// process may take an item not recorded by then, and an attempt is recorded only while the
/// claim still holds.
#[derive(Debug)]
pub struct OutboxClaim<T> {
    pub items: Vec<T>,
    /// Unix ms.
    pub leased_until: i64,
}

impl Store {
    /// Claims up to `limit` pending items of `outbox` due at `now` for `lease_ms`, each read
    /// as `columns` by `from_row`: each is returned to exactly one caller until its lease runs
    /// out (an item is taken only if it is still due at the time it was read as).
    pub(crate) async fn claim_due<T>(
        &self,
        outbox: Outbox,
        columns: &str,
        from_row: fn(&AnyRow) -> Result<T, StoreError>,
        now: i64,
        lease_ms: i64,
        limit: u32,
    ) -> Result<OutboxClaim<T>, StoreError> {
        let table = outbox.table();
        let leased_until = now.saturating_add(lease_ms);
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {columns} FROM {table} WHERE status = 'pending' AND next_attempt_at <= $1 \
             ORDER BY next_attempt_at, id {}",
            crate::limit_clause(u64::from(limit))
        )))
        .bind(now)
        .fetch_all(self.pool())
        .await?;
        let mut claimed = Vec::new();
        for row in &rows {
            let id: String = row.try_get("id")?;
            let due: i64 = row.try_get("next_attempt_at")?;
            let item = from_row(row)?;
            let done = sqlx::query(sqlx::AssertSqlSafe(format!(
                "UPDATE {table} SET next_attempt_at = $1, updated_at = $2 \
                 WHERE id = $3 AND status = 'pending' AND next_attempt_at = $4"
            )))
            .bind(leased_until)
            .bind(now)
            .bind(id)
            .bind(due)
            .execute(&*self.write_pool().await?)
            .await?;
            if done.rows_affected() == 1 {
                claimed.push(item);
            }
        }
        Ok(OutboxClaim {
            items: claimed,
            leased_until,
        })
    }

    /// Records one attempt of an item of `outbox` claimed until `leased_until`: delivered, to
    /// be retried at a time, or failed for good. Whether the claim still held: once it has run
    /// out another process may have taken the item, and its record is left to that process.
    pub(crate) async fn record_attempt(
        &self,
        outbox: Outbox,
        id: &str,
        leased_until: i64,
        outcome: &AttemptOutcome,
    ) -> Result<bool, StoreError> {
        let now = now_millis();
        let (status, code, error, next) = match outcome {
            AttemptOutcome::Delivered { status_code } => {
                ("delivered", Some(i64::from(*status_code)), None, now)
            }
            AttemptOutcome::Failed {
                status_code,
                error,
                retry_at,
            } => (
                if retry_at.is_some() {
                    "pending"
                } else {
                    "failed"
                },
                status_code.map(i64::from),
                Some(error.as_str()),
                retry_at.unwrap_or(now),
            ),
        };
        let done = sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE {} SET status = $1, attempts = attempts + 1, last_status_code = $2, \
             last_error = $3, next_attempt_at = $4, updated_at = $5 \
             WHERE id = $6 AND status = 'pending' AND next_attempt_at = $7",
            outbox.table()
        )))
        .bind(status)
        .bind(code)
        .bind(error)
        .bind(next)
        .bind(now)
        .bind(id)
        .bind(leased_until)
        .execute(&*self.write_pool().await?)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    /// Gives back items of `outbox` claimed until `leased_until` and not attempted, due again
    /// at once rather than when the claim runs out; an item whose claim ran out is left alone.
    pub(crate) async fn release_claims(
        &self,
        outbox: Outbox,
        ids: &[&str],
        leased_until: i64,
    ) -> Result<(), StoreError> {
        let now = now_millis();
        for id in ids {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "UPDATE {} SET next_attempt_at = $1, updated_at = $1 \
                 WHERE id = $2 AND status = 'pending' AND next_attempt_at = $3",
                outbox.table()
            )))
            .bind(now)
            .bind(*id)
            .bind(leased_until)
            .execute(&*self.write_pool().await?)
            .await?;
        }
        Ok(())
    }
}
