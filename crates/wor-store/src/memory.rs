//! Conversation memory: what earlier runs of a routine's thread said, with provenance labels.

use sqlx::Row;
use wor_core::step::MemoryEntry;
use wor_core::{ProjectId, RoutineId};

use crate::{Store, StoreError, now_millis, parse_column};

impl Store {
    /// Appends entries to a thread's memory; nothing when the thread holds entries of their
    /// run already.
    pub async fn append_memory(
        &self,
        project: ProjectId,
        routine: RoutineId,
        thread: &str,
        entries: &[MemoryEntry],
    ) -> Result<(), StoreError> {
        let mut tx = self.begin_write().await?;
        // A run's entries are appended once: a sweep that queues an ended run's announcements
        // again finds them there.
        for run in entries
            .iter()
            .map(|e| e.run_id)
            .collect::<std::collections::BTreeSet<_>>()
        {
            // Two appends of one run's entries at once (its process late, a sweep beside it)
            // take turns on the run's row, so the second finds the first's entries.
            if self.backend() == crate::Backend::Postgres {
                sqlx::query("SELECT id FROM runs WHERE id = $1 FOR UPDATE")
                    .bind(run.to_string())
                    .execute(&mut **tx)
                    .await?;
            }
            let kept =
                sqlx::query("SELECT 1 AS kept FROM memory_entries WHERE run_id = $1 LIMIT 1")
                    .bind(run.to_string())
                    .fetch_optional(&mut **tx)
                    .await?;
            if kept.is_some() {
                tx.rollback().await?;
                return Ok(());
            }
        }
        for entry in entries {
            sqlx::query(
                "INSERT INTO memory_entries (id, project_id, routine_id, thread, run_id, role, provenance, text, created_at) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
            )
            .bind(format!("mem_{}", uuid::Uuid::now_v7().simple()))
            .bind(project.to_string())
            .bind(routine.to_string())
            .bind(thread)
            .bind(entry.run_id.to_string())
            .bind(entry.role.as_str())
            .bind(entry.provenance.as_str())
            .bind(&entry.text)
            .bind(now_millis())
            .execute(&mut **tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// The latest `limit` entries of a thread, oldest first.
    pub async fn thread_memory(
        &self,
        project: ProjectId,
        routine: RoutineId,
        thread: &str,
        limit: u32,
    ) -> Result<Vec<MemoryEntry>, StoreError> {
        let rows = sqlx::query(
            "SELECT run_id, role, provenance, text, created_at FROM memory_entries \
             WHERE project_id = $1 AND routine_id = $2 AND thread = $3 ORDER BY id DESC LIMIT $4",
        )
        .bind(project.to_string())
        .bind(routine.to_string())
        .bind(thread)
        .bind(i64::from(limit))
        .fetch_all(self.pool())
        .await?;
        let mut entries = rows
            .iter()
            .map(|row| {
                Ok(MemoryEntry {
                    run_id: parse_column(
                        &row.try_get::<String, _>("run_id")?,
                        "memory_entries.run_id",
                    )?,
                    role: parse_column(&row.try_get::<String, _>("role")?, "memory_entries.role")?,
                    provenance: parse_column(
                        &row.try_get::<String, _>("provenance")?,
                        "memory_entries.provenance",
                    )?,
                    text: row.try_get("text")?,
                    created_at: row.try_get("created_at")?,
                })
            })
            .collect::<Result<Vec<_>, StoreError>>()?;
        entries.reverse();
        Ok(entries)
    }
}
