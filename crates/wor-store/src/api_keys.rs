//! API keys: shown once at creation, stored only as a SHA-256 digest.
//!
//! A key is `wor_` followed by 64 hex digits (256 bits from the operating system's random
//! source); the prefix lets secret scanners recognise a leaked key. A *personal* key acts as
//! its member; a *service* key carries a role and no person, and can never approve.

use std::fmt;

use rand::TryRngCore;
use sqlx::{Any, Row, Transaction};
use wor_core::audit::AuditEvent;
use wor_core::canonical::sha256_hex;
use wor_core::{ApiKeyId, MemberId, ProjectId, Role};

use crate::staged::StagedEvent;
use crate::{Store, StoreError, now_millis, parse_column};

/// The text every API key starts with.
pub const API_KEY_PREFIX: &str = "wor_";
/// How many leading characters of a key are stored and shown to identify it.
const DISPLAY_PREFIX_LEN: usize = 12;
/// `last_used_at` is refreshed at most this often, so authentication is not a write.
const LAST_USED_RESOLUTION_MS: i64 = 60_000;

/// A freshly created key. Its `Debug` hides the value; read it once with [`Self::expose`].
pub struct PlaintextApiKey(String);

impl PlaintextApiKey {
    fn generate() -> Result<Self, StoreError> {
        let mut bytes = [0u8; 32];
        rand::rngs::OsRng
            .try_fill_bytes(&mut bytes)
            .map_err(|e| StoreError::Corrupt(format!("random source failed: {e}")))?;
        Ok(Self(format!("{API_KEY_PREFIX}{}", hex::encode(bytes))))
    }

    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for PlaintextApiKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("PlaintextApiKey(***)")
    }
}

/// The digest stored for a presented key.
pub fn api_key_digest(presented: &str) -> String {
    sha256_hex(presented.as_bytes())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApiKeyKind {
    Personal(MemberId),
    Service,
}

#[derive(Debug, Clone)]
pub struct NewApiKey {
    pub name: String,
    pub role: Role,
    pub kind: ApiKeyKind,
    /// The key that created this one, for the record.
    pub created_by: Option<ApiKeyId>,
}

/// A key's metadata. Never holds the key.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ApiKeyRecord {
    pub id: ApiKeyId,
    pub project_id: ProjectId,
    pub member_id: Option<MemberId>,
    pub name: String,
    /// The role the key was made with.
    pub role: Role,
    /// The role it acts with now: its own, lowered to its member's current role for a
    /// personal key (what authenticating it gives).
    pub acts_as: Role,
    pub service: bool,
    pub prefix: String,
    pub created_at: i64,
    pub created_by: Option<ApiKeyId>,
    pub last_used_at: Option<i64>,
    pub revoked_at: Option<i64>,
}

/// Who a presented key belongs to; the project comes from here and nowhere else.
#[derive(Debug, Clone)]
pub struct AuthenticatedKey {
    pub key_id: ApiKeyId,
    pub project_id: ProjectId,
    pub member_id: Option<MemberId>,
    pub role: Role,
}

impl AuthenticatedKey {
    pub fn is_service(&self) -> bool {
        self.member_id.is_none()
    }
}

const COLUMNS: &str = "id, project_id, member_id, kind, name, role, prefix, created_at, \
                       created_by, last_used_at, revoked_at, (SELECT m.role FROM members m \
                       WHERE m.id = api_keys.member_id AND m.project_id = api_keys.project_id) \
                       AS member_role";

pub(crate) async fn insert(
    tx: &mut Transaction<'_, Any>,
    project: ProjectId,
    new: NewApiKey,
) -> Result<(ApiKeyRecord, PlaintextApiKey), StoreError> {
    let key = PlaintextApiKey::generate()?;
    let prefix: String = key.expose().chars().take(DISPLAY_PREFIX_LEN).collect();
    let (kind, member_id) = match new.kind {
        ApiKeyKind::Personal(member) => ("personal", Some(member)),
        ApiKeyKind::Service => ("service", None),
    };
    let record = ApiKeyRecord {
        id: ApiKeyId::new(),
        project_id: project,
        member_id,
        name: new.name,
        role: new.role,
        // A personal key is never made above its member's role (every caller checks it with
        // the creator's role as it is now).
        acts_as: new.role,
        service: member_id.is_none(),
        prefix,
        created_at: now_millis(),
        created_by: new.created_by,
        last_used_at: None,
        revoked_at: None,
    };
    sqlx::query(
        "INSERT INTO api_keys (id, project_id, member_id, kind, name, role, prefix, sha256, \
         created_at, created_by) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
    )
    .bind(record.id.to_string())
    .bind(project.to_string())
    .bind(member_id.map(|m| m.to_string()))
    .bind(kind)
    .bind(&record.name)
    .bind(record.role.as_str())
    .bind(&record.prefix)
    .bind(api_key_digest(key.expose()))
    .bind(record.created_at)
    .bind(record.created_by.map(|k| k.to_string()))
    .execute(&mut **tx)
    .await?;
    Ok((record, key))
}

impl Store {
    /// Creates a key. For a personal key the member must belong to `project`.
    pub async fn create_api_key(
        &self,
        project: ProjectId,
        new: NewApiKey,
    ) -> Result<(ApiKeyRecord, PlaintextApiKey), StoreError> {
        let (record, key, _) = self.create_api_key_staged(project, new, None).await?;
        Ok((record, key))
    }

    /// [`Self::create_api_key`], staging `recorded`, when given, from the new key in the same
    /// transaction (`crate::staged`).
    pub async fn create_api_key_staged(
        &self,
        project: ProjectId,
        new: NewApiKey,
        recorded: Option<&(dyn Fn(&ApiKeyRecord) -> AuditEvent + Sync)>,
    ) -> Result<(ApiKeyRecord, PlaintextApiKey, Option<StagedEvent>), StoreError> {
        let mut tx = self.begin_write().await?;
        if let ApiKeyKind::Personal(member) = new.kind {
            let found =
                sqlx::query("SELECT 1 AS one FROM members WHERE project_id = $1 AND id = $2")
                    .bind(project.to_string())
                    .bind(member.to_string())
                    .fetch_optional(&mut **tx)
                    .await?;
            if found.is_none() {
                return Err(StoreError::NotFound);
            }
        }
        let (record, key) = insert(&mut tx, project, new).await?;
        let staged =
            crate::staged::stage_some(&mut tx, recorded.map(|recorded| recorded(&record))).await?;
        tx.commit().await?;
        Ok((record, key, staged))
    }

    /// Whether key `id` still opens anything: not revoked, and, for a personal key, its member
    /// still in the project. What a request authenticated by it earlier (an event stream held
    /// open) checks again as it goes on.
    pub async fn api_key_opens(&self, id: ApiKeyId) -> Result<bool, StoreError> {
        let row = sqlx::query(
            "SELECT 1 AS opens FROM api_keys k \
             LEFT JOIN members m ON m.id = k.member_id AND m.project_id = k.project_id \
             WHERE k.id = $1 AND k.revoked_at IS NULL AND (k.member_id IS NULL OR m.id IS NOT NULL)",
        )
        .bind(id.to_string())
        .fetch_optional(&self.pool)
        .await?;
        Ok(row.is_some())
    }

    /// Resolves a presented key. Unknown and revoked keys are both `None`: the caller
    /// learns nothing about which.
    ///
    /// INVARIANT: a personal key acts with the lower of its own role and its member's role as
    /// it is now, read with the key on every request: a member's new role holds for all of
    /// their keys from the next request, and no key acts above the person it belongs to.
    pub async fn authenticate_api_key(
        &self,
        presented: &str,
    ) -> Result<Option<AuthenticatedKey>, StoreError> {
        if !presented.starts_with(API_KEY_PREFIX) {
            return Ok(None);
        }
        let row = sqlx::query(
            "SELECT k.id, k.project_id, k.member_id, k.role, k.last_used_at, \
             m.role AS member_role FROM api_keys k \
             LEFT JOIN members m ON m.id = k.member_id AND m.project_id = k.project_id \
             WHERE k.sha256 = $1 AND k.revoked_at IS NULL",
        )
        .bind(api_key_digest(presented))
        .fetch_optional(&self.pool)
        .await?;
        let Some(row) = row else { return Ok(None) };
        let id: String = row.try_get("id")?;
        let project_id: String = row.try_get("project_id")?;
        let member_id: Option<String> = row.try_get("member_id")?;
        let role: String = row.try_get("role")?;
        let member_role: Option<String> = row.try_get("member_role")?;
        let last_used_at: Option<i64> = row.try_get("last_used_at")?;
        let key_role: Role = parse_column(&role, "api_keys.role")?;
        let role = match (&member_id, member_role) {
            (None, _) => key_role,
            (Some(_), Some(member_role)) => {
                key_role.at_most(parse_column(&member_role, "members.role")?)
            }
            // A personal key whose member is gone opens nothing.
            (Some(_), None) => return Ok(None),
        };
        let key = AuthenticatedKey {
            key_id: parse_column(&id, "api_keys.id")?,
            project_id: parse_column(&project_id, "api_keys.project_id")?,
            member_id: member_id
                .map(|m| parse_column(&m, "api_keys.member_id"))
                .transpose()?,
            role,
        };
        let now = now_millis();
        if last_used_at.is_none_or(|t| now - t >= LAST_USED_RESOLUTION_MS) {
            // The key is live whether or not its use is written down now: a later use does it.
            self.write_if_not_busy("api_key.last_used_at", async {
                sqlx::query("UPDATE api_keys SET last_used_at = $1 WHERE id = $2")
                    .bind(now)
                    .bind(&id)
                    .execute(&*self.write_pool().await?)
                    .await?;
                Ok(())
            })
            .await?;
        }
        Ok(Some(key))
    }

    pub async fn list_api_keys(&self, project: ProjectId) -> Result<Vec<ApiKeyRecord>, StoreError> {
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM api_keys WHERE project_id = $1 ORDER BY id"
        )))
        .bind(project.to_string())
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(key_from_row).collect()
    }

    pub async fn get_api_key(
        &self,
        project: ProjectId,
        id: ApiKeyId,
    ) -> Result<ApiKeyRecord, StoreError> {
        let row = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM api_keys WHERE project_id = $1 AND id = $2"
        )))
        .bind(project.to_string())
        .bind(id.to_string())
        .fetch_optional(&self.pool)
        .await?
        .ok_or(StoreError::NotFound)?;
        key_from_row(&row)
    }

    /// Revokes a key; revoking a revoked key is a no-op that returns it unchanged.
    ///
    /// INVARIANT: a project keeps at least one owner who can manage it — an `owner` member with
    /// a live personal `owner` key. Revoking the last such key is refused with
    /// [`StoreError::LastOwnerKey`], checked in the transaction that revokes, after taking the
    /// project's lock, so two revocations at once cannot both pass.
    pub async fn revoke_api_key(
        &self,
        project: ProjectId,
        id: ApiKeyId,
    ) -> Result<ApiKeyRecord, StoreError> {
        Ok(self.revoke_api_key_staged(project, id, None).await?.0)
    }

    /// [`Store::revoke_api_key`] staging the revocation's `key.revoke` entry, made by `recorded`,
    /// when given, from the key as revoked, in the same transaction (`crate::staged`) when it
    /// revoked the key; a key revoked already stages nothing. The caller appends the entry with
    /// [`crate::AuditLog::append_staged`].
    pub async fn revoke_api_key_staged(
        &self,
        project: ProjectId,
        id: ApiKeyId,
        recorded: Option<&(dyn Fn(&ApiKeyRecord) -> AuditEvent + Sync)>,
    ) -> Result<(ApiKeyRecord, Option<StagedEvent>), StoreError> {
        let mut tx = self.begin_write().await?;
        lock_project(&mut tx, project).await?;
        let key = fetch_key(&mut tx, project, id).await?;
        let revoked = sqlx::query(
            "UPDATE api_keys SET revoked_at = $1 \
             WHERE project_id = $2 AND id = $3 AND revoked_at IS NULL",
        )
        .bind(now_millis())
        .bind(project.to_string())
        .bind(id.to_string())
        .execute(&mut **tx)
        .await?
        .rows_affected();
        if revoked > 0 && is_owner_key(&key) && live_owner_keys(&mut tx, project).await? == 0 {
            tx.rollback().await?;
            return Err(StoreError::LastOwnerKey { key_id: id });
        }
        let key = fetch_key(&mut tx, project, id).await?;
        let staged = match recorded {
            Some(recorded) if revoked > 0 => {
                Some(crate::staged::stage_one(&mut tx, recorded(&key)).await?)
            }
            _ => None,
        };
        tx.commit().await?;
        Ok((key, staged))
    }
}

/// Takes the project's write lock for the rest of `tx`: a row lock on PostgreSQL, the
/// database's write lock on SQLite. Changes that must see each other's effect on the project's
/// owners (revocations) take it first, so they run one after the other.
pub(crate) async fn lock_project(
    tx: &mut Transaction<'_, Any>,
    project: ProjectId,
) -> Result<(), StoreError> {
    let locked = sqlx::query("UPDATE projects SET name = name WHERE id = $1")
        .bind(project.to_string())
        .execute(&mut **tx)
        .await?
        .rows_affected();
    if locked == 0 {
        return Err(StoreError::NotFound);
    }
    Ok(())
}

async fn fetch_key(
    tx: &mut Transaction<'_, Any>,
    project: ProjectId,
    id: ApiKeyId,
) -> Result<ApiKeyRecord, StoreError> {
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM api_keys WHERE project_id = $1 AND id = $2"
    )))
    .bind(project.to_string())
    .bind(id.to_string())
    .fetch_optional(&mut **tx)
    .await?
    .ok_or(StoreError::NotFound)?;
    key_from_row(&row)
}

/// A key that lets a person manage the project: a personal key with role `owner`.
fn is_owner_key(key: &ApiKeyRecord) -> bool {
    key.member_id.is_some() && key.role == Role::Owner
}

/// How many live personal `owner` keys of `owner` members the project has.
pub(crate) async fn live_owner_keys(
    tx: &mut Transaction<'_, Any>,
    project: ProjectId,
) -> Result<i64, StoreError> {
    let row = sqlx::query(
        "SELECT COUNT(*) AS n FROM api_keys k \
         JOIN members m ON m.id = k.member_id AND m.project_id = k.project_id \
         WHERE k.project_id = $1 AND k.kind = 'personal' AND k.revoked_at IS NULL \
         AND k.role = 'owner' AND m.role = 'owner'",
    )
    .bind(project.to_string())
    .fetch_one(&mut **tx)
    .await?;
    Ok(row.try_get("n")?)
}

fn key_from_row(row: &sqlx::any::AnyRow) -> Result<ApiKeyRecord, StoreError> {
    let id: String = row.try_get("id")?;
    let project_id: String = row.try_get("project_id")?;
    let member_id: Option<String> = row.try_get("member_id")?;
    let kind: String = row.try_get("kind")?;
    let role: Role = parse_column(&row.try_get::<String, _>("role")?, "api_keys.role")?;
    let member_role: Option<String> = row.try_get("member_role")?;
    let acts_as = match member_role {
        Some(member_role) => role.at_most(parse_column(&member_role, "members.role")?),
        None => role,
    };
    let created_by: Option<String> = row.try_get("created_by")?;
    Ok(ApiKeyRecord {
        id: parse_column(&id, "api_keys.id")?,
        project_id: parse_column(&project_id, "api_keys.project_id")?,
        member_id: member_id
            .map(|m| parse_column(&m, "api_keys.member_id"))
            .transpose()?,
        name: row.try_get("name")?,
        role,
        acts_as,
        service: kind == "service",
        prefix: row.try_get("prefix")?,
        created_at: row.try_get("created_at")?,
        created_by: created_by
            .map(|k| parse_column(&k, "api_keys.created_by"))
            .transpose()?,
        last_used_at: row.try_get("last_used_at")?,
        revoked_at: row.try_get("revoked_at")?,
    })
}
