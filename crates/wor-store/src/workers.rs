//! Workers of a scaled-out deployment and their single-use enrolment tokens.
//!
//! An operator makes a token (`wet_` and 64 hex digits, stored as a SHA-256 digest only, valid
//! until its expiry and for one enrolment). A worker presents it once with the public keys it
//! generated; the token is spent and the worker recorded in the same transaction, so two
//! workers racing with one token cannot both enrol.

use std::fmt;

use rand::TryRngCore;
use sqlx::Row;
use wor_core::canonical::sha256_hex;

use crate::{Store, StoreError, now_millis};

/// The text every worker enrolment token starts with.
pub const WORKER_ENROLMENT_TOKEN_PREFIX: &str = "wet_";

/// A freshly made enrolment token: shown once, stored as a digest. Its `Debug` hides it.
pub struct NewEnrolmentToken {
    /// The token's public id.
    pub id: String,
    token: String,
    /// Unix milliseconds.
    pub expires_at: i64,
}

impl NewEnrolmentToken {
    /// The token itself, to hand to the worker's operator.
    pub fn expose(&self) -> &str {
        &self.token
    }
}

impl fmt::Debug for NewEnrolmentToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NewEnrolmentToken")
            .field("id", &self.id)
            .field("expires_at", &self.expires_at)
            .finish_non_exhaustive()
    }
}

/// Whether a worker may act.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkerStatus {
    Active,
    Revoked,
}

impl WorkerStatus {
    /// How it is stored and shown: `active` or `revoked`.
    pub fn as_str(self) -> &'static str {
        match self {
            WorkerStatus::Active => "active",
            WorkerStatus::Revoked => "revoked",
        }
    }

    fn parse(text: &str) -> Result<Self, StoreError> {
        match text {
            "active" => Ok(WorkerStatus::Active),
            "revoked" => Ok(WorkerStatus::Revoked),
            other => Err(StoreError::Corrupt(format!(
                "unknown worker status `{other}`"
            ))),
        }
    }
}

/// A worker as the control plane knows it: its public keys only.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerRecord {
    pub id: String,
    pub name: String,
    /// Standard base64 of its Ed25519 public key.
    pub signing_public_key: String,
    /// Standard base64 of its X25519 public key.
    pub exchange_public_key: String,
    pub status: WorkerStatus,
    pub enrolled_at: i64,
    pub last_seen_at: Option<i64>,
}

/// What revoking a worker came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkerRevocation {
    /// Revoked now; the runs it held went back to the queue, to be resumed from their steps.
    Revoked { runs_released: u64 },
    /// It had been revoked already.
    AlreadyRevoked,
    /// No worker has this id.
    Unknown,
}

/// Why a worker's signed request, its signature checked, was not taken. A value, not an
/// error: the caller answers 401.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkerRequestRefusal {
    /// Its nonce was taken before: a replay.
    Replayed,
    /// The worker is no longer active (revoked since its record was read).
    NotActive,
}

/// Why an enrolment token was not accepted. A value, not an error: the caller answers 401.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EnrolmentRefusal {
    /// No such token.
    Unknown,
    /// The token was used before.
    AlreadyUsed,
    /// The token's time ran out.
    Expired,
    /// Another worker already enrolled with these public keys.
    KeysInUse,
}

impl Store {
    /// Makes a single-use worker enrolment token valid for `ttl_millis`.
    pub async fn create_worker_enrolment_token(
        &self,
        ttl_millis: i64,
    ) -> Result<NewEnrolmentToken, StoreError> {
        let mut bytes = [0u8; 32];
        rand::rngs::OsRng
            .try_fill_bytes(&mut bytes)
            .map_err(|e| StoreError::Corrupt(format!("random source failed: {e}")))?;
        let token = format!("{WORKER_ENROLMENT_TOKEN_PREFIX}{}", hex::encode(bytes));
        let id = format!("wen_{}", uuid::Uuid::now_v7().simple());
        let now = now_millis();
        let expires_at = now.saturating_add(ttl_millis);
        sqlx::query(
            "INSERT INTO worker_enrolment_tokens (id, sha256, created_at, expires_at) \
             VALUES ($1, $2, $3, $4)",
        )
        .bind(&id)
        .bind(sha256_hex(token.as_bytes()))
        .bind(now)
        .bind(expires_at)
        .execute(&*self.write_pool().await?)
        .await?;
        Ok(NewEnrolmentToken {
            id,
            token,
            expires_at,
        })
    }

    /// Spends `token` and records a worker named `name` with its public keys, both or
    /// neither. The keys are checked by the caller (`wor_secrets::WorkerPublicKeys`).
    pub async fn enroll_worker(
        &self,
        token: &str,
        name: &str,
        signing_public_key: &str,
        exchange_public_key: &str,
    ) -> Result<Result<WorkerRecord, EnrolmentRefusal>, StoreError> {
        // Anyone may knock: a token of the wrong shape, or one no usable row has, is refused
        // on a read, without ever waiting for the write lock.
        if !is_enrolment_token_shape(token) {
            return Ok(Err(EnrolmentRefusal::Unknown));
        }
        let digest = sha256_hex(token.as_bytes());
        let now = now_millis();
        let row = sqlx::query(
            "SELECT used_at, expires_at FROM worker_enrolment_tokens WHERE sha256 = $1",
        )
        .bind(&digest)
        .fetch_optional(self.pool())
        .await?;
        match row {
            None => return Ok(Err(EnrolmentRefusal::Unknown)),
            Some(row) if row.try_get::<Option<i64>, _>("used_at")?.is_some() => {
                return Ok(Err(EnrolmentRefusal::AlreadyUsed));
            }
            Some(row) if row.try_get::<i64, _>("expires_at")? <= now => {
                return Ok(Err(EnrolmentRefusal::Expired));
            }
            Some(_) => {}
        }
        let worker_id = format!("wkr_{}", uuid::Uuid::now_v7().simple());
        // Spent in the write transaction, which checks again: two workers racing with one
        // token cannot both enrol.
        let mut tx = self.begin_write().await?;
        let spent = sqlx::query(
            "UPDATE worker_enrolment_tokens SET used_at = $1, worker_id = $2 \
             WHERE sha256 = $3 AND used_at IS NULL AND expires_at > $1",
        )
        .bind(now)
        .bind(&worker_id)
        .bind(&digest)
        .execute(&mut **tx)
        .await?;
        if spent.rows_affected() != 1 {
            let row = sqlx::query("SELECT used_at FROM worker_enrolment_tokens WHERE sha256 = $1")
                .bind(&digest)
                .fetch_optional(&mut **tx)
                .await?;
            tx.rollback().await?;
            let refusal = match row {
                None => EnrolmentRefusal::Unknown,
                Some(row) if row.try_get::<Option<i64>, _>("used_at")?.is_some() => {
                    EnrolmentRefusal::AlreadyUsed
                }
                Some(_) => EnrolmentRefusal::Expired,
            };
            return Ok(Err(refusal));
        }
        let taken = sqlx::query("SELECT COUNT(*) AS n FROM workers WHERE signing_public_key = $1")
            .bind(signing_public_key)
            .fetch_one(&mut **tx)
            .await?;
        if taken.try_get::<i64, _>("n")? > 0 {
            tx.rollback().await?;
            return Ok(Err(EnrolmentRefusal::KeysInUse));
        }
        sqlx::query(
            "INSERT INTO workers (id, name, signing_public_key, exchange_public_key, status, \
             enrolled_at) VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .bind(&worker_id)
        .bind(name)
        .bind(signing_public_key)
        .bind(exchange_public_key)
        .bind(WorkerStatus::Active.as_str())
        .bind(now)
        .execute(&mut **tx)
        .await?;
        tx.commit().await?;
        Ok(Ok(WorkerRecord {
            id: worker_id,
            name: name.to_owned(),
            signing_public_key: signing_public_key.to_owned(),
            exchange_public_key: exchange_public_key.to_owned(),
            status: WorkerStatus::Active,
            enrolled_at: now,
            last_seen_at: None,
        }))
    }

    /// The worker `id`, if enrolled.
    pub async fn worker(&self, id: &str) -> Result<Option<WorkerRecord>, StoreError> {
        let row = sqlx::query(
            "SELECT id, name, signing_public_key, exchange_public_key, status, enrolled_at, \
             last_seen_at FROM workers WHERE id = $1",
        )
        .bind(id)
        .fetch_optional(self.pool())
        .await?;
        row.map(|row| worker_from_row(&row)).transpose()
    }

    /// Every enrolled worker, oldest first.
    pub async fn list_workers(&self) -> Result<Vec<WorkerRecord>, StoreError> {
        let rows = sqlx::query(
            "SELECT id, name, signing_public_key, exchange_public_key, status, enrolled_at, \
             last_seen_at FROM workers ORDER BY enrolled_at, id",
        )
        .fetch_all(self.pool())
        .await?;
        rows.iter().map(worker_from_row).collect()
    }

    /// Takes a worker's signed request whose signature was checked: records that the worker,
    /// still active, was heard from now, and remembers the request's nonce until `keep_until`
    /// (Unix seconds), in one transaction. A replay or a worker no longer active is refused
    /// with nothing recorded. Forgets nonces whose time is past.
    pub async fn accept_worker_request(
        &self,
        worker_id: &str,
        nonce: &str,
        keep_until: i64,
    ) -> Result<Result<(), WorkerRequestRefusal>, StoreError> {
        let now = now_millis();
        let mut tx = self.begin_write().await?;
        // First, so that a revocation committed since the worker's record was read refuses it.
        let seen =
            sqlx::query("UPDATE workers SET last_seen_at = $1 WHERE id = $2 AND status = 'active'")
                .bind(now)
                .bind(worker_id)
                .execute(&mut **tx)
                .await?;
        if seen.rows_affected() == 0 {
            tx.rollback().await?;
            return Ok(Err(WorkerRequestRefusal::NotActive));
        }
        sqlx::query("DELETE FROM worker_request_nonces WHERE keep_until < $1")
            .bind(now / 1000)
            .execute(&mut **tx)
            .await?;
        let inserted = sqlx::query(
            "INSERT INTO worker_request_nonces (worker_id, nonce, keep_until) VALUES ($1, $2, $3) \
             ON CONFLICT (worker_id, nonce) DO NOTHING",
        )
        .bind(worker_id)
        .bind(nonce)
        .bind(keep_until)
        .execute(&mut **tx)
        .await?;
        if inserted.rows_affected() == 0 {
            tx.rollback().await?;
            return Ok(Err(WorkerRequestRefusal::Replayed));
        }
        tx.commit().await?;
        Ok(Ok(()))
    }

    /// Revokes worker `id`: from this moment every request it signs is refused, and in the
    /// same transaction the runs it holds go back to the queue and their credentials end, so
    /// nothing it still has in memory can act for them.
    pub async fn revoke_worker(&self, id: &str) -> Result<WorkerRevocation, StoreError> {
        let now = now_millis();
        let mut tx = self.begin_write().await?;
        let revoked = sqlx::query(
            "UPDATE workers SET status = 'revoked' WHERE id = $1 AND status = 'active'",
        )
        .bind(id)
        .execute(&mut **tx)
        .await?;
        if revoked.rows_affected() == 0 {
            let known = sqlx::query("SELECT 1 AS known FROM workers WHERE id = $1")
                .bind(id)
                .fetch_optional(&mut **tx)
                .await?
                .is_some();
            tx.rollback().await?;
            return Ok(if known {
                WorkerRevocation::AlreadyRevoked
            } else {
                WorkerRevocation::Unknown
            });
        }
        let released = crate::runs::release_held(&mut tx, self.backend, id, None, now).await?;
        tx.commit().await?;
        Ok(WorkerRevocation::Revoked {
            runs_released: released,
        })
    }

    /// Whether `worker` holds `run` (running, under its lease) and is still active: checked
    /// last before anything of a claim leaves, so a worker revoked meanwhile gets nothing.
    pub async fn worker_holds_run(
        &self,
        worker: &str,
        run: wor_core::RunId,
    ) -> Result<bool, StoreError> {
        let row = sqlx::query(
            "SELECT 1 AS held FROM runs r JOIN workers w ON w.id = r.lease_owner \
             WHERE r.id = $1 AND r.lease_owner = $2 AND r.status = 'running' \
             AND w.status = 'active'",
        )
        .bind(run.to_string())
        .bind(worker)
        .fetch_optional(self.pool())
        .await?;
        Ok(row.is_some())
    }
}

fn worker_from_row(row: &sqlx::any::AnyRow) -> Result<WorkerRecord, StoreError> {
    Ok(WorkerRecord {
        id: row.try_get("id")?,
        name: row.try_get("name")?,
        signing_public_key: row.try_get("signing_public_key")?,
        exchange_public_key: row.try_get("exchange_public_key")?,
        status: WorkerStatus::parse(&row.try_get::<String, _>("status")?)?,
        enrolled_at: row.try_get("enrolled_at")?,
        last_seen_at: row.try_get("last_seen_at")?,
    })
}

/// Whether `token` has the shape of an enrolment token: the prefix and 64 lower-case hex
/// digits.
fn is_enrolment_token_shape(token: &str) -> bool {
    token
        .strip_prefix(WORKER_ENROLMENT_TOKEN_PREFIX)
        .is_some_and(|hex| {
            hex.len() == 64 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_prefix_and_64_lower_case_hex_digits_are_a_token_shape() {
        let hex = "0123456789abcdef".repeat(4);
        let short = "123456789abcdef".to_owned() + &"0123456789abcdef".repeat(3);
        assert!(is_enrolment_token_shape(&format!("wet_{hex}")));
        for bad in [
            String::new(),
            "wet_".to_owned(),
            format!("wet_{}", hex.to_uppercase()),
            format!("wet_{hex}0"),
            format!("wet_{short}"),
            format!("wek_{hex}"),
            format!("wet_{short}g"),
        ] {
            assert!(!is_enrolment_token_shape(&bad), "{bad}");
        }
    }
}
