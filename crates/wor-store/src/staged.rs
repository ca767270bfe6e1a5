//! Audit events staged with the change they record (table `audit_staged`).
//!
//! An API action's change (a run started, an approval decided, a cancel) and its audit entry
//! cannot share one transaction: the entry takes its place in the chain on the audit writer,
//! which the change's transaction does not run on. So the change's transaction also writes the
//! event, as a staged row; the writer then appends it ([`crate::AuditLog::append_staged`]) and
//! deletes the row in the transaction of that append. A crash between the two leaves the row,
//! and the writer's sweep of staged rows, when it starts and then at every checkpoint interval,
//! appends it. Whoever deletes a row appends its event, and only they: an event is appended
//! once, however many writers (processes) sweep.

use sqlx::{Any, Row as _};
use wor_core::audit::AuditEvent;

use crate::exec::Exec;
use crate::{Store, StoreError, now_millis};

/// An audit event written in the transaction of the change it records, not yet appended to
/// its chain. Made by the store's operations that stage their entry; handed to
/// [`crate::AuditLog::append_staged`].
#[derive(Debug)]
#[must_use = "a staged event is appended by AuditLog::append_staged, or by the writer's sweep only after a delay"]
pub struct StagedEvent {
    pub(crate) id: String,
    pub(crate) event: AuditEvent,
}

impl StagedEvent {
    pub fn event(&self) -> &AuditEvent {
        &self.event
    }

    /// Its row's id in `audit_staged` (`stg_…`).
    pub fn id(&self) -> &str {
        &self.id
    }
}

/// Staged rows written in one statement, at most.
const ROWS_PER_STATEMENT: usize = 100;
/// Staged rows released (deleted) in one statement, at most.
const RELEASED_PER_STATEMENT: usize = 100;
/// Staged rows a sweep reads, and appends in one batch, at a time.
pub(crate) const SWEEP_PAGE: u32 = 512;

/// Writes `event` as a staged row in `tx`, the transaction of the change it records.
pub(crate) async fn stage_one(
    tx: &mut sqlx::Transaction<'static, Any>,
    event: AuditEvent,
) -> Result<StagedEvent, StoreError> {
    let row = staged_row(event)?;
    insert_rows(tx, std::slice::from_ref(&row)).await?;
    Ok(row.0)
}

/// Writes `event`, when there is one, as a staged row in `tx`, the transaction of the change it
/// records.
pub(crate) async fn stage_some(
    tx: &mut sqlx::Transaction<'static, Any>,
    event: Option<AuditEvent>,
) -> Result<Option<StagedEvent>, StoreError> {
    match event {
        Some(event) => stage_one(tx, event).await.map(Some),
        None => Ok(None),
    }
}

/// Writes `events` as staged rows in `tx`, the transaction of the change they record.
pub(crate) async fn stage(
    tx: &mut sqlx::Transaction<'static, Any>,
    events: Vec<AuditEvent>,
) -> Result<Vec<StagedEvent>, StoreError> {
    let rows = events
        .into_iter()
        .map(staged_row)
        .collect::<Result<Vec<_>, _>>()?;
    for chunk in rows.chunks(ROWS_PER_STATEMENT) {
        insert_rows(tx, chunk).await?;
    }
    Ok(rows.into_iter().map(|(row, _)| row).collect())
}

/// `event` with a fresh, time-ordered id, and its stored JSON.
fn staged_row(event: AuditEvent) -> Result<(StagedEvent, String), StoreError> {
    let text =
        serde_json::to_string(&event).map_err(|e| StoreError::EventEncoding(e.to_string()))?;
    let id = format!("stg_{}", uuid::Uuid::now_v7().simple());
    Ok((StagedEvent { id, event }, text))
}

/// Inserts `rows` in one statement.
async fn insert_rows(
    tx: &mut sqlx::Transaction<'static, Any>,
    rows: &[(StagedEvent, String)],
) -> Result<(), StoreError> {
    let sql = format!(
        "INSERT INTO audit_staged (id, project_id, event, created_at) VALUES {}",
        crate::value_rows(1, rows.len(), 4)
    );
    let now = now_millis();
    let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
    for (row, text) in rows {
        query = query
            .bind(row.id.clone())
            .bind(row.event.project_id().to_string())
            .bind(text.clone())
            .bind(now);
    }
    query.execute(&mut **tx).await?;
    Ok(())
}

/// Deletes the rows of `staged` in the writer's transaction and returns the events whose rows
/// it deleted, in order: those nobody appended yet.
pub(crate) async fn release(
    exec: &mut impl Exec,
    staged: Vec<StagedEvent>,
) -> Result<Vec<AuditEvent>, StoreError> {
    let mut kept = Vec::with_capacity(staged.len());
    let mut staged = staged.into_iter().peekable();
    while staged.peek().is_some() {
        let chunk: Vec<StagedEvent> = staged.by_ref().take(RELEASED_PER_STATEMENT).collect();
        let sql = format!(
            "DELETE FROM audit_staged WHERE id IN ({}) RETURNING id",
            crate::placeholders(1, chunk.len())
        );
        let params = chunk.iter().map(|s| s.id.as_str().into()).collect();
        let deleted = exec.fetch_all(&sql, params).await?;
        let deleted = deleted
            .iter()
            .map(|row| row.text("id"))
            .collect::<Result<std::collections::HashSet<String>, _>>()?;
        if deleted.len() < chunk.len() {
            // Another writer's sweep appended them first, or someone deleted the rows.
            tracing::warn!(
                category = "audit",
                missing = chunk.len() - deleted.len(),
                "staged audit events whose rows were gone are not appended again"
            );
        }
        kept.extend(
            chunk
                .into_iter()
                .filter(|s| deleted.contains(&s.id))
                .map(|s| s.event),
        );
    }
    Ok(kept)
}

impl Store {
    /// Up to [`SWEEP_PAGE`] staged rows after `after` (a row id) and staged at `older_than`
    /// (Unix ms) or before, oldest first, for the writer's sweep, and the id to read after for
    /// the next page when this one was full. A row whose event cannot be read is logged and
    /// left where it is.
    pub(crate) async fn staged_page(
        &self,
        after: Option<&str>,
        older_than: i64,
    ) -> Result<(Vec<StagedEvent>, Option<String>), StoreError> {
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT id, event FROM audit_staged WHERE ($1 IS NULL OR id > $1) AND created_at <= $2 \
             ORDER BY id {}",
            crate::limit_clause(u64::from(SWEEP_PAGE))
        )))
        .bind(after.map(str::to_owned))
        .bind(older_than)
        .fetch_all(self.pool())
        .await?;
        let full = rows.len() >= SWEEP_PAGE as usize;
        let mut last = None;
        let mut staged = Vec::with_capacity(rows.len());
        for row in &rows {
            let id: String = row.try_get("id")?;
            let text: String = row.try_get("event")?;
            match serde_json::from_str::<AuditEvent>(&text) {
                Ok(event) => staged.push(StagedEvent {
                    id: id.clone(),
                    event,
                }),
                Err(error) => tracing::error!(
                    category = "audit",
                    staged_id = %id,
                    error = %error,
                    "a staged audit event cannot be read; it is left in audit_staged"
                ),
            }
            last = Some(id);
        }
        Ok((staged, last.filter(|_| full)))
    }
}
