//! The vault: where secret values are stored, always sealed by `wor-secrets`.
//!
//! A secret lives in a [`SecretSlot`] — the project, the owning table and row, and the field —
//! and the slot is the associated data of its ciphertext, so callers cannot seal a value for
//! one place and open it in another. Secrets are never returned through the API; the only
//! metadata that leaves is whether a slot is set and when it changed.
//!
//! INVARIANT: the vault is the only code that reads or writes `sealed_secrets`.

use std::fmt;
use std::sync::Arc;

use secrecy::SecretString;
use sqlx::{AssertSqlSafe, Row};
use wor_core::ProjectId;
use wor_core::audit::AuditEvent;
use wor_secrets::{KeyRing, SealedSecret, SecretBinding, SecretsError};

use crate::staged::StagedEvent;
use crate::{Store, StoreError, now_millis};

/// Where one secret lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SecretSlot {
    pub project: ProjectId,
    pub owner_table: &'static str,
    pub owner_id: String,
    pub field: String,
}

impl SecretSlot {
    pub fn new(
        project: ProjectId,
        owner_table: &'static str,
        owner_id: impl fmt::Display,
        field: impl Into<String>,
    ) -> Self {
        SecretSlot {
            project,
            owner_table,
            owner_id: owner_id.to_string(),
            field: field.into(),
        }
    }
}

impl fmt::Display for SecretSlot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}/{}", self.owner_table, self.owner_id, self.field)
    }
}

/// A stored secret's metadata: the value never travels with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SecretMetadata {
    pub updated_at: i64,
}

/// Why a secret could not be opened or sealed.
#[derive(Debug, thiserror::Error)]
pub enum VaultError {
    #[error("the secret `{slot}` cannot be opened: {source}")]
    Open { slot: String, source: SecretsError },
    #[error("the secret `{slot}` cannot be sealed: {source}")]
    Seal { slot: String, source: SecretsError },
    #[error("the secret `{slot}` is not set")]
    Missing { slot: String },
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// How a rotation pass went.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct RotationReport {
    pub rotated: u64,
    /// Rows that failed to open: each named, never with its value.
    pub failed: Vec<String>,
}

/// Sealing and opening of stored secrets under the server's key ring.
#[derive(Clone)]
pub struct Vault {
    store: Store,
    keys: Arc<KeyRing>,
}

impl fmt::Debug for Vault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Vault")
            .field("primary_key_id", &self.keys.primary_key_id().to_string())
            .finish_non_exhaustive()
    }
}

fn binding(slot: &SecretSlot) -> (String, &str, &str, &str) {
    (
        slot.project.to_string(),
        slot.owner_table,
        slot.owner_id.as_str(),
        slot.field.as_str(),
    )
}

impl Vault {
    pub fn new(store: Store, keys: Arc<KeyRing>) -> Self {
        Vault { store, keys }
    }

    pub fn key_ring(&self) -> &KeyRing {
        &self.keys
    }

    fn seal(&self, slot: &SecretSlot, value: &[u8]) -> Result<SealedSecret, VaultError> {
        let (project, table, row, field) = binding(slot);
        self.keys
            .encrypt(
                &SecretBinding {
                    project: &project,
                    table,
                    row,
                    field,
                },
                value,
            )
            .map_err(|source| VaultError::Seal {
                slot: slot.to_string(),
                source,
            })
    }

    fn open_sealed(&self, slot: &SecretSlot, bytes: &[u8]) -> Result<SecretString, VaultError> {
        let (project, table, row, field) = binding(slot);
        let open = |source| VaultError::Open {
            slot: slot.to_string(),
            source,
        };
        let sealed = SealedSecret::from_bytes(bytes).map_err(open)?;
        self.keys
            .decrypt_string(
                &SecretBinding {
                    project: &project,
                    table,
                    row,
                    field,
                },
                &sealed,
            )
            .map_err(open)
    }

    /// Seals `value` into `slot`, replacing what was there.
    pub async fn put(&self, slot: &SecretSlot, value: &str) -> Result<SecretMetadata, VaultError> {
        let (metadata, _) = self.put_staged(&[(slot.clone(), value)], None).await?;
        Ok(metadata)
    }

    /// Seals each value of `secrets` into its slot, replacing what was there, all in one
    /// transaction, and stages `recorded`, when given, the entry of the change they are, in it
    /// too (`crate::staged`).
    pub async fn put_staged(
        &self,
        secrets: &[(SecretSlot, &str)],
        recorded: Option<AuditEvent>,
    ) -> Result<(SecretMetadata, Option<StagedEvent>), VaultError> {
        let sealed = secrets
            .iter()
            .map(|(slot, value)| self.seal_put(slot, value))
            .collect::<Result<Vec<_>, VaultError>>()?;
        let now = now_millis();
        let mut tx = self.store.begin_write().await?;
        write_sealed(&mut tx, &sealed, now).await?;
        let staged = crate::staged::stage_some(&mut tx, recorded).await?;
        tx.commit().await.map_err(StoreError::from)?;
        Ok((SecretMetadata { updated_at: now }, staged))
    }

    /// Seals `value` into `slot` only if the slot holds nothing, staging `recorded` with it
    /// when it does: the staged entry when this call filled the slot, `None` (and nothing
    /// written) when a secret was there already, one put there a moment before by a caller
    /// beside this one included.
    pub async fn put_new_staged(
        &self,
        slot: &SecretSlot,
        value: &str,
        recorded: AuditEvent,
    ) -> Result<Option<StagedEvent>, VaultError> {
        let sealed = self.seal_put(slot, value)?;
        let mut tx = self.store.begin_write().await?;
        if !insert_sealed(&mut tx, &sealed, now_millis(), Existing::Keep).await? {
            tx.rollback().await.map_err(StoreError::from)?;
            return Ok(None);
        }
        let staged = crate::staged::stage_one(&mut tx, recorded).await?;
        tx.commit().await.map_err(StoreError::from)?;
        Ok(Some(staged))
    }

    /// Seals `value` for `slot`, to be written by the store operation whose change it belongs
    /// to, in that change's own transaction.
    pub fn seal_put(&self, slot: &SecretSlot, value: &str) -> Result<SealedPut, VaultError> {
        Ok(SealedPut {
            slot: slot.clone(),
            sealed: self.seal(slot, value.as_bytes())?,
        })
    }

    /// Opens the secret in `slot`: only for attaching it to an outgoing request.
    pub async fn open(&self, slot: &SecretSlot) -> Result<SecretString, VaultError> {
        let query = sqlx::query(AssertSqlSafe(format!(
            "SELECT sealed FROM sealed_secrets WHERE {SLOT_WHERE}"
        )));
        let row = bind_slot(query, slot)
            .fetch_optional(self.store.pool())
            .await
            .map_err(StoreError::from)?
            .ok_or_else(|| VaultError::Missing {
                slot: slot.to_string(),
            })?;
        let bytes: Vec<u8> = row.try_get("sealed").map_err(StoreError::from)?;
        self.open_sealed(slot, &bytes)
    }

    /// Whether `slot` is set, and when it changed.
    pub async fn metadata(&self, slot: &SecretSlot) -> Result<Option<SecretMetadata>, StoreError> {
        let query = sqlx::query(AssertSqlSafe(format!(
            "SELECT updated_at FROM sealed_secrets WHERE {SLOT_WHERE}"
        )));
        let row = bind_slot(query, slot)
            .fetch_optional(self.store.pool())
            .await?;
        row.map(|r| {
            Ok(SecretMetadata {
                updated_at: r.try_get("updated_at")?,
            })
        })
        .transpose()
    }

    /// Removes the secret in `slot`, if any.
    pub async fn delete(&self, slot: &SecretSlot) -> Result<(), StoreError> {
        let query = sqlx::query(AssertSqlSafe(format!(
            "DELETE FROM sealed_secrets WHERE {SLOT_WHERE}"
        )));
        bind_slot(query, slot)
            .execute(&*self.store.write_pool().await?)
            .await?;
        Ok(())
    }

    /// Every live secret value of `project`, for building its redactor.
    pub async fn project_values(
        &self,
        project: ProjectId,
    ) -> Result<Vec<SecretString>, VaultError> {
        let rows = sqlx::query(
            "SELECT owner_table, owner_id, field, sealed FROM sealed_secrets WHERE project_id = $1",
        )
        .bind(project.to_string())
        .fetch_all(self.store.pool())
        .await
        .map_err(StoreError::from)?;
        let mut values = Vec::with_capacity(rows.len());
        for row in rows {
            let (slot, bytes) = slot_from_row(project, &row)?;
            values.push(self.open_sealed(&slot, &bytes)?);
        }
        Ok(values)
    }

    /// How many stored secrets are sealed under a key other than the primary.
    pub async fn count_needing_rotation(&self) -> Result<i64, StoreError> {
        let row = sqlx::query("SELECT COUNT(*) AS n FROM sealed_secrets WHERE key_id <> $1")
            .bind(self.keys.primary_key_id().to_string())
            .fetch_one(self.store.pool())
            .await?;
        Ok(row.try_get("n")?)
    }

    /// Re-seals up to `limit` secrets that are not under the primary key, calling `progress`
    /// after each. Every row is its own update, guarded by its old key id, so an interrupted
    /// rotation loses nothing and the next run continues where this one stopped.
    pub async fn rotate(
        &self,
        limit: Option<u64>,
        mut progress: impl FnMut(&RotationReport),
    ) -> Result<RotationReport, StoreError> {
        let primary = self.keys.primary_key_id().to_string();
        let mut report = RotationReport::default();
        let mut skipped = 0_i64;
        loop {
            let batch = sqlx::query(
                "SELECT project_id, owner_table, owner_id, field, key_id, sealed FROM sealed_secrets \
                 WHERE key_id <> $1 ORDER BY project_id, owner_table, owner_id, field LIMIT 100 OFFSET $2",
            )
            .bind(&primary)
            .bind(skipped)
            .fetch_all(self.store.pool())
            .await?;
            if batch.is_empty() {
                return Ok(report);
            }
            for row in batch {
                if limit.is_some_and(|l| report.rotated >= l) {
                    return Ok(report);
                }
                let project: String = row.try_get("project_id")?;
                let project: ProjectId =
                    crate::parse_column(&project, "sealed_secrets.project_id")?;
                let old_key: String = row.try_get("key_id")?;
                let (slot, bytes) = match slot_from_row(project, &row) {
                    Ok(found) => found,
                    Err(err) => {
                        report.failed.push(err.to_string());
                        skipped += 1;
                        continue;
                    }
                };
                let resealed = self.open_sealed(&slot, &bytes).and_then(|value| {
                    self.seal(
                        &slot,
                        secrecy::ExposeSecret::expose_secret(&value).as_bytes(),
                    )
                });
                let sealed = match resealed {
                    Ok(sealed) => sealed,
                    Err(err) => {
                        report.failed.push(err.to_string());
                        skipped += 1;
                        progress(&report);
                        continue;
                    }
                };
                sqlx::query(
                    "UPDATE sealed_secrets SET key_id = $1, sealed = $2 \
                     WHERE project_id = $3 AND owner_table = $4 AND owner_id = $5 AND field = $6 \
                     AND key_id = $7",
                )
                .bind(&primary)
                .bind(sealed.to_bytes())
                .bind(slot.project.to_string())
                .bind(slot.owner_table)
                .bind(&slot.owner_id)
                .bind(&slot.field)
                .bind(&old_key)
                .execute(&*self.store.write_pool().await?)
                .await?;
                report.rotated += 1;
                progress(&report);
            }
        }
    }

    /// Opens every stored secret and names those that fail; values are dropped at once.
    pub async fn verify_all(&self) -> Result<(u64, Vec<String>), StoreError> {
        let rows = sqlx::query(
            "SELECT project_id, owner_table, owner_id, field, sealed FROM sealed_secrets \
             ORDER BY project_id, owner_table, owner_id, field",
        )
        .fetch_all(self.store.pool())
        .await?;
        let mut failed = Vec::new();
        let total = rows.len() as u64;
        for row in rows {
            let project: String = row.try_get("project_id")?;
            let project: ProjectId = crate::parse_column(&project, "sealed_secrets.project_id")?;
            let result = slot_from_row(project, &row)
                .and_then(|(slot, bytes)| self.open_sealed(&slot, &bytes));
            if let Err(err) = result {
                failed.push(err.to_string());
            }
        }
        Ok((total, failed))
    }
}

type AnyQuery<'q> = sqlx::query::Query<'q, sqlx::Any, sqlx::any::AnyArguments>;

/// The WHERE clause that names one slot, for [`bind_slot`].
const SLOT_WHERE: &str = "project_id = $1 AND owner_table = $2 AND owner_id = $3 AND field = $4";

/// A secret sealed for its slot ([`Vault::seal_put`]), not yet written.
pub struct SealedPut {
    slot: SecretSlot,
    sealed: SealedSecret,
}

impl fmt::Debug for SealedPut {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SealedPut({})", self.slot)
    }
}

/// Refused unless every one of `puts` is sealed for a slot of row `owner_id` of `owner_table`
/// in `project`: the row the change that writes them writes.
pub(crate) fn check_owners(
    puts: &[SealedPut],
    project: ProjectId,
    owner_table: &str,
    owner_id: impl fmt::Display,
) -> Result<(), StoreError> {
    let owner_id = owner_id.to_string();
    match puts.iter().find(|put| {
        put.slot.project != project
            || put.slot.owner_table != owner_table
            || put.slot.owner_id != owner_id
    }) {
        Some(misplaced) => Err(StoreError::MisplacedSecret {
            slot: misplaced.slot.to_string(),
        }),
        None => Ok(()),
    }
}

/// Writes each of `puts` into its slot in `tx`, replacing what was there, as of `now`.
pub(crate) async fn write_sealed(
    tx: &mut sqlx::Transaction<'static, sqlx::Any>,
    puts: &[SealedPut],
    now: i64,
) -> Result<(), StoreError> {
    for put in puts {
        insert_sealed(tx, put, now, Existing::Replace).await?;
    }
    Ok(())
}

/// What writing a secret into a slot that holds one does.
#[derive(Debug, Clone, Copy)]
enum Existing {
    Replace,
    Keep,
}

/// Writes `put` into its slot at `now`; whether it was written (with [`Existing::Keep`], not
/// when the slot held a secret).
async fn insert_sealed(
    tx: &mut sqlx::Transaction<'static, sqlx::Any>,
    put: &SealedPut,
    now: i64,
    existing: Existing,
) -> Result<bool, StoreError> {
    let on_conflict = match existing {
        Existing::Replace => {
            "DO UPDATE SET key_id = excluded.key_id, sealed = excluded.sealed, \
             updated_at = excluded.updated_at"
        }
        Existing::Keep => "DO NOTHING",
    };
    let query = sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO sealed_secrets (project_id, owner_table, owner_id, field, key_id, sealed, updated_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7) \
         ON CONFLICT (project_id, owner_table, owner_id, field) {on_conflict}"
    )));
    let written = bind_slot(query, &put.slot)
        .bind(put.sealed.key_id().to_string())
        .bind(put.sealed.to_bytes())
        .bind(now)
        .execute(&mut **tx)
        .await?;
    Ok(written.rows_affected() == 1)
}

/// Binds `slot` as parameters `$1` to `$4`, in the order of [`SLOT_WHERE`].
fn bind_slot<'q>(query: AnyQuery<'q>, slot: &SecretSlot) -> AnyQuery<'q> {
    query
        .bind(slot.project.to_string())
        .bind(slot.owner_table)
        .bind(slot.owner_id.clone())
        .bind(slot.field.clone())
}

/// The owning tables a secret may belong to; a row naming any other is corrupt.
const OWNER_TABLES: &[&str] = &[
    "model_connections",
    "tool_connections",
    "routines",
    crate::NOTIFICATION_ROUTES_TABLE,
];

fn slot_from_row(
    project: ProjectId,
    row: &sqlx::any::AnyRow,
) -> Result<(SecretSlot, Vec<u8>), VaultError> {
    let table: String = row.try_get("owner_table").map_err(StoreError::from)?;
    let owner_table = OWNER_TABLES.iter().find(|t| **t == table).ok_or_else(|| {
        StoreError::Corrupt(format!("sealed_secrets.owner_table holds `{table}`"))
    })?;
    let slot = SecretSlot {
        project,
        owner_table,
        owner_id: row.try_get("owner_id").map_err(StoreError::from)?,
        field: row.try_get("field").map_err(StoreError::from)?,
    };
    let bytes: Vec<u8> = row.try_get("sealed").map_err(StoreError::from)?;
    Ok((slot, bytes))
}
