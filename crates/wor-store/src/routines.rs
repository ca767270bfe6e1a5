//! Routines and their immutable versions.

use sqlx::Row;
use wor_core::audit::AuditEvent;
use wor_core::routine::RoutineDefinition;
use wor_core::{ApiKeyId, ProjectId, RoutineId};

use crate::staged::StagedEvent;
use crate::{Store, StoreError, now_millis, parse_column};

#[derive(Debug, Clone, serde::Serialize)]
pub struct RoutineRecord {
    pub id: RoutineId,
    pub project_id: ProjectId,
    pub name: String,
    pub current_version: i64,
    pub created_at: i64,
    pub updated_at: i64,
}

#[derive(Debug, Clone)]
pub struct RoutineVersionRecord {
    pub routine_id: RoutineId,
    pub version: i64,
    pub source_toml: String,
    pub definition: RoutineDefinition,
    pub content_hash: String,
    pub created_by: Option<ApiKeyId>,
    pub created_at: i64,
}

/// What an apply did.
#[derive(Debug, Clone)]
pub struct AppliedRoutine {
    pub routine: RoutineRecord,
    pub version: i64,
    /// False when the definition equals the current version: no new version was made.
    pub changed: bool,
}

const COLUMNS: &str = "id, project_id, name, current_version, created_at, updated_at";

impl Store {
    /// Creates the routine or, if its definition changed, a new version of it.
    pub async fn apply_routine(
        &self,
        project: ProjectId,
        source_toml: &str,
        definition: &RoutineDefinition,
        created_by: Option<ApiKeyId>,
    ) -> Result<AppliedRoutine, StoreError> {
        let (applied, _) = self
            .apply_routine_staged(project, source_toml, definition, created_by, None)
            .await?;
        Ok(applied)
    }

    /// [`Self::apply_routine`], staging `recorded`, when given, from what the apply made in the
    /// same transaction (`crate::staged`) when it made a new version; an apply that changed nothing
    /// stages nothing.
    pub async fn apply_routine_staged(
        &self,
        project: ProjectId,
        source_toml: &str,
        definition: &RoutineDefinition,
        created_by: Option<ApiKeyId>,
        recorded: Option<&(dyn Fn(&AppliedRoutine) -> AuditEvent + Sync)>,
    ) -> Result<(AppliedRoutine, Option<StagedEvent>), StoreError> {
        let hash = definition.content_hash();
        let now = now_millis();
        let mut tx = self.begin_write().await?;
        let existing = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM routines WHERE project_id = $1 AND name = $2"
        )))
        .bind(project.to_string())
        .bind(definition.name.as_str())
        .fetch_optional(&mut **tx)
        .await?;
        let (routine, version) = match existing {
            None => {
                let routine = RoutineRecord {
                    id: RoutineId::new(),
                    project_id: project,
                    name: definition.name.to_string(),
                    current_version: 1,
                    created_at: now,
                    updated_at: now,
                };
                sqlx::query(
                    "INSERT INTO routines (id, project_id, name, current_version, created_at, updated_at) \
                     VALUES ($1, $2, $3, 1, $4, $4)",
                )
                .bind(routine.id.to_string())
                .bind(project.to_string())
                .bind(&routine.name)
                .bind(now)
                .execute(&mut **tx)
                .await
                .map_err(|e| {
                    crate::conflict_or(e, || "the routine was created concurrently; apply again".to_owned())
                })?;
                (routine, 1)
            }
            Some(row) => {
                let mut routine = routine_from_row(&row)?;
                let current_hash: String = sqlx::query(
                    "SELECT content_hash FROM routine_versions WHERE routine_id = $1 AND version = $2",
                )
                .bind(routine.id.to_string())
                .bind(routine.current_version)
                .fetch_one(&mut **tx)
                .await?
                .try_get("content_hash")?;
                if current_hash == hash {
                    let version = routine.current_version;
                    tx.rollback().await?;
                    let unchanged = AppliedRoutine {
                        routine,
                        version,
                        changed: false,
                    };
                    return Ok((unchanged, None));
                }
                let next = routine.current_version + 1;
                // Guarded by the version read above: a concurrent apply makes this a no-op,
                // and the insert below then conflicts instead of forking the history.
                sqlx::query(
                    "UPDATE routines SET current_version = $1, updated_at = $2 \
                     WHERE id = $3 AND current_version = $4",
                )
                .bind(next)
                .bind(now)
                .bind(routine.id.to_string())
                .bind(routine.current_version)
                .execute(&mut **tx)
                .await?;
                routine.current_version = next;
                routine.updated_at = now;
                (routine, next)
            }
        };
        sqlx::query(
            "INSERT INTO routine_versions (routine_id, version, project_id, source_toml, \
             content_hash, created_by, created_at) VALUES ($1, $2, $3, $4, $5, $6, $7)",
        )
        .bind(routine.id.to_string())
        .bind(version)
        .bind(project.to_string())
        .bind(source_toml)
        .bind(&hash)
        .bind(created_by.map(|k| k.to_string()))
        .bind(now)
        .execute(&mut **tx)
        .await
        .map_err(|e| {
            crate::conflict_or(e, || {
                "the routine changed concurrently; apply again".to_owned()
            })
        })?;
        crate::triggers::sync_schedule(
            &mut tx,
            project,
            routine.id,
            definition.schedule.as_ref(),
            now,
        )
        .await?;
        let applied = AppliedRoutine {
            routine,
            version,
            changed: true,
        };
        let staged =
            crate::staged::stage_some(&mut tx, recorded.map(|recorded| recorded(&applied))).await?;
        tx.commit().await?;
        Ok((applied, staged))
    }

    pub async fn get_routine(
        &self,
        project: ProjectId,
        id: RoutineId,
    ) -> Result<RoutineRecord, StoreError> {
        let row = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM routines WHERE project_id = $1 AND id = $2"
        )))
        .bind(project.to_string())
        .bind(id.to_string())
        .fetch_optional(self.pool())
        .await?
        .ok_or(StoreError::NotFound)?;
        routine_from_row(&row)
    }

    /// The routine with this id in whichever project holds it. Only for the inbound webhook
    /// route, where the request carries no key: the caller must then prove itself with the
    /// routine's own secret before anything about the routine is revealed or done.
    pub async fn get_routine_for_webhook(
        &self,
        id: RoutineId,
    ) -> Result<RoutineRecord, StoreError> {
        let row = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM routines WHERE id = $1"
        )))
        .bind(id.to_string())
        .fetch_optional(self.pool())
        .await?
        .ok_or(StoreError::NotFound)?;
        routine_from_row(&row)
    }

    pub async fn find_routine_by_name(
        &self,
        project: ProjectId,
        name: &str,
    ) -> Result<RoutineRecord, StoreError> {
        let row = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM routines WHERE project_id = $1 AND name = $2"
        )))
        .bind(project.to_string())
        .bind(name)
        .fetch_optional(self.pool())
        .await?
        .ok_or(StoreError::NotFound)?;
        routine_from_row(&row)
    }

    pub async fn list_routines(
        &self,
        project: ProjectId,
    ) -> Result<Vec<RoutineRecord>, StoreError> {
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM routines WHERE project_id = $1 ORDER BY name"
        )))
        .bind(project.to_string())
        .fetch_all(self.pool())
        .await?;
        rows.iter().map(routine_from_row).collect()
    }

    pub async fn get_routine_version(
        &self,
        project: ProjectId,
        id: RoutineId,
        version: i64,
    ) -> Result<RoutineVersionRecord, StoreError> {
        let row = sqlx::query(
            "SELECT routine_id, version, source_toml, content_hash, created_by, created_at \
             FROM routine_versions WHERE project_id = $1 AND routine_id = $2 AND version = $3",
        )
        .bind(project.to_string())
        .bind(id.to_string())
        .bind(version)
        .fetch_optional(self.pool())
        .await?
        .ok_or(StoreError::NotFound)?;
        version_from_row(&row)
    }

    /// The versions named by `wanted` (project, routine, version), read by one statement per
    /// 200; a version that does not exist is absent from the answer.
    pub async fn get_routine_versions(
        &self,
        wanted: &[(ProjectId, RoutineId, i64)],
    ) -> Result<Vec<(ProjectId, RoutineVersionRecord)>, StoreError> {
        const PER_STATEMENT: usize = 200;
        let mut found = Vec::with_capacity(wanted.len());
        for chunk in wanted.chunks(PER_STATEMENT) {
            let rows: Vec<String> = (0..chunk.len())
                .map(|i| {
                    let n = i * 3;
                    format!("(${}, ${}, CAST(${} AS BIGINT))", n + 1, n + 2, n + 3)
                })
                .collect();
            let sql = format!(
                "SELECT project_id, routine_id, version, source_toml, content_hash, created_by, created_at \
                 FROM routine_versions WHERE (project_id, routine_id, version) IN (VALUES {})",
                rows.join(", ")
            );
            let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
            for (project, routine, version) in chunk {
                query = query
                    .bind(project.to_string())
                    .bind(routine.to_string())
                    .bind(*version);
            }
            for row in query.fetch_all(self.pool()).await? {
                let project: String = row.try_get("project_id")?;
                found.push((
                    parse_column(&project, "routine_versions.project_id")?,
                    version_from_row(&row)?,
                ));
            }
        }
        Ok(found)
    }

    /// Every version of a routine, newest first, without their sources.
    pub async fn list_routine_versions(
        &self,
        project: ProjectId,
        id: RoutineId,
    ) -> Result<Vec<(i64, String, i64)>, StoreError> {
        let rows = sqlx::query(
            "SELECT version, content_hash, created_at FROM routine_versions \
             WHERE project_id = $1 AND routine_id = $2 ORDER BY version DESC",
        )
        .bind(project.to_string())
        .bind(id.to_string())
        .fetch_all(self.pool())
        .await?;
        rows.iter()
            .map(|r| {
                Ok((
                    r.try_get("version")?,
                    r.try_get("content_hash")?,
                    r.try_get("created_at")?,
                ))
            })
            .collect()
    }
}

fn routine_from_row(row: &sqlx::any::AnyRow) -> Result<RoutineRecord, StoreError> {
    let id: String = row.try_get("id")?;
    let project_id: String = row.try_get("project_id")?;
    Ok(RoutineRecord {
        id: parse_column(&id, "routines.id")?,
        project_id: parse_column(&project_id, "routines.project_id")?,
        name: row.try_get("name")?,
        current_version: row.try_get("current_version")?,
        created_at: row.try_get("created_at")?,
        updated_at: row.try_get("updated_at")?,
    })
}

fn version_from_row(row: &sqlx::any::AnyRow) -> Result<RoutineVersionRecord, StoreError> {
    let routine_id: String = row.try_get("routine_id")?;
    let source_toml: String = row.try_get("source_toml")?;
    // The stored source is re-parsed: what runs is exactly what the author wrote and saw
    // validated, and a definition that no longer parses is reported, not guessed at.
    let definition = RoutineDefinition::from_toml(&source_toml)
        .map_err(|e| StoreError::Corrupt(format!("stored routine no longer parses: {e}")))?;
    let created_by: Option<String> = row.try_get("created_by")?;
    Ok(RoutineVersionRecord {
        routine_id: parse_column(&routine_id, "routine_versions.routine_id")?,
        version: row.try_get("version")?,
        source_toml,
        definition,
        content_hash: row.try_get("content_hash")?,
        created_by: created_by
            .map(|k| parse_column(&k, "routine_versions.created_by"))
            .transpose()?,
        created_at: row.try_get("created_at")?,
    })
}
