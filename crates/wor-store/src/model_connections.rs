//! Model connections: a provider endpoint and the API key to reach it (in the vault).
//!
//! A connection is project-scoped and owner-controlled. Its `credential_version` rises each
//! time its key is replaced, so a run that pinned one version notices a change and fails
//! closed rather than silently using another credential.

use std::str::FromStr;

use sqlx::Row;
use wor_core::audit::AuditEvent;
use wor_core::model::ProviderKind;
use wor_core::{ApiKeyId, ConnectionId, MemberId, ProjectId};

use crate::staged::StagedEvent;
use crate::{Store, StoreError, conflict_or, now_millis, parse_column};

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ConnectionStatus {
    Active,
    Revoked,
}

impl FromStr for ConnectionStatus {
    type Err = ();
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "active" => Ok(ConnectionStatus::Active),
            "revoked" => Ok(ConnectionStatus::Revoked),
            _ => Err(()),
        }
    }
}

/// The table secrets of model connections are filed under in the vault.
pub const MODEL_CONNECTIONS_TABLE: &str = "model_connections";
/// The vault field holding a model connection's API key.
pub const API_KEY_FIELD: &str = "api_key";

#[derive(Debug, Clone)]
pub struct NewModelConnection {
    pub name: String,
    pub provider: ProviderKind,
    pub base_url: String,
    pub owner_member_id: Option<MemberId>,
    pub created_by: Option<ApiKeyId>,
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct ModelConnectionRecord {
    pub id: ConnectionId,
    pub project_id: ProjectId,
    pub name: String,
    pub provider: ProviderKind,
    pub base_url: String,
    pub owner_member_id: Option<MemberId>,
    pub status: ConnectionStatus,
    pub credential_version: i64,
    pub created_by: Option<ApiKeyId>,
    pub created_at: i64,
    pub updated_at: i64,
}

const COLUMNS: &str = "id, project_id, name, provider, base_url, owner_member_id, status, \
                       credential_version, created_by, created_at, updated_at";

impl Store {
    pub async fn create_model_connection(
        &self,
        project: ProjectId,
        new: NewModelConnection,
    ) -> Result<ModelConnectionRecord, StoreError> {
        let (record, _) = self
            .create_model_connection_staged(project, ConnectionId::new(), new, None, None)
            .await?;
        Ok(record)
    }

    /// [`Self::create_model_connection`] under `id`, writing `key` (sealed for this connection's
    /// slot, [`crate::Vault::seal_put`]) when given and staging `recorded`, when given, from the
    /// new connection, all in one transaction (`crate::staged`): a crash leaves the connection
    /// with its key and its entry, or nothing. A key sealed for another row is refused
    /// ([`StoreError::MisplacedSecret`]) and nothing is made.
    pub async fn create_model_connection_staged(
        &self,
        project: ProjectId,
        id: ConnectionId,
        new: NewModelConnection,
        key: Option<&crate::SealedPut>,
        recorded: Option<&(dyn Fn(&ModelConnectionRecord) -> AuditEvent + Sync)>,
    ) -> Result<(ModelConnectionRecord, Option<StagedEvent>), StoreError> {
        let key = key.map(std::slice::from_ref).unwrap_or_default();
        crate::vault::check_owners(key, project, MODEL_CONNECTIONS_TABLE, id)?;
        let now = now_millis();
        let record = ModelConnectionRecord {
            id,
            project_id: project,
            name: new.name,
            provider: new.provider,
            base_url: new.base_url,
            owner_member_id: new.owner_member_id,
            status: ConnectionStatus::Active,
            credential_version: 1,
            created_by: new.created_by,
            created_at: now,
            updated_at: now,
        };
        let mut tx = self.begin_write().await?;
        sqlx::query(
            "INSERT INTO model_connections (id, project_id, name, provider, base_url, owner_member_id, \
             status, credential_version, created_by, created_at, updated_at) \
             VALUES ($1, $2, $3, $4, $5, $6, 'active', 1, $7, $8, $8)",
        )
        .bind(record.id.to_string())
        .bind(project.to_string())
        .bind(&record.name)
        .bind(record.provider.as_str())
        .bind(&record.base_url)
        .bind(record.owner_member_id.map(|m| m.to_string()))
        .bind(record.created_by.map(|k| k.to_string()))
        .bind(now)
        .execute(&mut **tx)
        .await
        .map_err(|e| {
            conflict_or(e, || {
                format!("a model connection named `{}` already exists", record.name)
            })
        })?;
        crate::vault::write_sealed(&mut tx, key, now).await?;
        let staged =
            crate::staged::stage_some(&mut tx, recorded.map(|recorded| recorded(&record))).await?;
        tx.commit().await?;
        Ok((record, staged))
    }

    pub async fn get_model_connection(
        &self,
        project: ProjectId,
        id: ConnectionId,
    ) -> Result<ModelConnectionRecord, StoreError> {
        let row = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM model_connections WHERE project_id = $1 AND id = $2"
        )))
        .bind(project.to_string())
        .bind(id.to_string())
        .fetch_optional(self.pool())
        .await?
        .ok_or(StoreError::NotFound)?;
        from_row(&row)
    }

    pub async fn list_model_connections(
        &self,
        project: ProjectId,
    ) -> Result<Vec<ModelConnectionRecord>, StoreError> {
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM model_connections WHERE project_id = $1 ORDER BY id"
        )))
        .bind(project.to_string())
        .fetch_all(self.pool())
        .await?;
        rows.iter().map(from_row).collect()
    }

    /// Replaces the connection's key with `key` (sealed for its slot): its credential version
    /// rises by one. Writes the key and stages the replacement's `model_connection.set_key`
    /// entry, made by `recorded` from the new credential version, in the same transaction
    /// (`crate::staged`): the caller appends it with [`crate::AuditLog::append_staged`]. A
    /// revoked connection is a conflict, and its key is left as it was.
    pub async fn bump_model_credential_version(
        &self,
        project: ProjectId,
        id: ConnectionId,
        key: &crate::SealedPut,
        recorded: &(dyn Fn(i64) -> AuditEvent + Sync),
    ) -> Result<(ModelConnectionRecord, StagedEvent), StoreError> {
        let key = std::slice::from_ref(key);
        crate::vault::check_owners(key, project, MODEL_CONNECTIONS_TABLE, id)?;
        let now = now_millis();
        let mut tx = self.begin_write().await?;
        let bumped: Option<i64> = sqlx::query_scalar(
            "UPDATE model_connections SET credential_version = credential_version + 1, updated_at = $1 \
             WHERE project_id = $2 AND id = $3 AND status = 'active' RETURNING credential_version",
        )
        .bind(now)
        .bind(project.to_string())
        .bind(id.to_string())
        .fetch_optional(&mut **tx)
        .await?;
        let Some(version) = bumped else {
            tx.rollback().await?;
            // Either absent (404) or revoked (409): tell which without revealing anything foreign.
            self.get_model_connection(project, id).await?;
            return Err(StoreError::Conflict(format!(
                "model connection `{id}` is revoked"
            )));
        };
        crate::vault::write_sealed(&mut tx, key, now).await?;
        let staged = crate::staged::stage_one(&mut tx, recorded(version)).await?;
        tx.commit().await?;
        Ok((self.get_model_connection(project, id).await?, staged))
    }

    /// Revokes the connection, staging `recorded`, its `model_connection.revoke` entry, in the
    /// same transaction (`crate::staged`): the caller appends it with
    /// [`crate::AuditLog::append_staged`]. One revoked already is left as it is, and no entry
    /// is staged.
    pub async fn revoke_model_connection(
        &self,
        project: ProjectId,
        id: ConnectionId,
        recorded: AuditEvent,
    ) -> Result<(ModelConnectionRecord, Option<StagedEvent>), StoreError> {
        let mut tx = self.begin_write().await?;
        let done = sqlx::query(
            "UPDATE model_connections SET status = 'revoked', updated_at = $1 \
             WHERE project_id = $2 AND id = $3 AND status <> 'revoked'",
        )
        .bind(now_millis())
        .bind(project.to_string())
        .bind(id.to_string())
        .execute(&mut **tx)
        .await?;
        if done.rows_affected() == 0 {
            tx.rollback().await?;
            // Revoked before, or not there (a 404).
            return Ok((self.get_model_connection(project, id).await?, None));
        }
        let staged = crate::staged::stage_one(&mut tx, recorded).await?;
        tx.commit().await?;
        Ok((self.get_model_connection(project, id).await?, Some(staged)))
    }
}

fn from_row(row: &sqlx::any::AnyRow) -> Result<ModelConnectionRecord, StoreError> {
    let id: String = row.try_get("id")?;
    let project_id: String = row.try_get("project_id")?;
    let provider: String = row.try_get("provider")?;
    let owner: Option<String> = row.try_get("owner_member_id")?;
    let status: String = row.try_get("status")?;
    let created_by: Option<String> = row.try_get("created_by")?;
    Ok(ModelConnectionRecord {
        id: parse_column(&id, "model_connections.id")?,
        project_id: parse_column(&project_id, "model_connections.project_id")?,
        name: row.try_get("name")?,
        provider: parse_column(&provider, "model_connections.provider")?,
        base_url: row.try_get("base_url")?,
        owner_member_id: owner
            .map(|m| parse_column(&m, "model_connections.owner_member_id"))
            .transpose()?,
        status: parse_column(&status, "model_connections.status")?,
        credential_version: row.try_get("credential_version")?,
        created_by: created_by
            .map(|k| parse_column(&k, "model_connections.created_by"))
            .transpose()?,
        created_at: row.try_get("created_at")?,
        updated_at: row.try_get("updated_at")?,
    })
}
