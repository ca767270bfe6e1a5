//! Run credentials: what the runtime driving a run holds instead of any member's key.
//!
//! A token is `wrt_` followed by 64 hex digits (256 bits from the operating system's random
//! source), minted when a worker claims the run and stored as a SHA-256 digest only. It is
//! live while the run is `running` under the lease it was minted under and until the run's
//! deadline; parking, ending or claiming the run again deletes it, so a parked run keeps nothing
//! but its row.

use std::fmt;

use rand::TryRngCore;
use sqlx::Row;
use wor_core::canonical::sha256_hex;
use wor_core::{ProjectId, RoutineId, RunId};

use crate::exec::Exec;
use crate::{Store, StoreError, now_millis, parse_column};

/// The text every run token starts with; the API refuses it everywhere but its own routes.
pub const RUN_TOKEN_PREFIX: &str = "wrt_";

/// A freshly minted run token. Its `Debug` hides the value.
pub struct RunToken(String);

impl RunToken {
    /// A new token from the operating system's random source, not yet stored: a journal
    /// write that mints it ([`RunWrite::minting`](crate::RunWrite::minting)) stores its digest.
    pub fn generate() -> Result<RunToken, StoreError> {
        let mut bytes = [0u8; 32];
        rand::rngs::OsRng
            .try_fill_bytes(&mut bytes)
            .map_err(|e| StoreError::Corrupt(format!("random source failed: {e}")))?;
        Ok(RunToken(format!(
            "{RUN_TOKEN_PREFIX}{}",
            hex::encode(bytes)
        )))
    }

    /// A token received from the control plane, for a remote worker to present.
    pub fn presented(token: String) -> RunToken {
        RunToken(token)
    }

    pub fn expose(&self) -> &str {
        &self.0
    }

    /// The digest that is stored of it.
    pub(crate) fn digest(&self) -> String {
        sha256_hex(self.0.as_bytes())
    }
}

/// Stores `token` (its digest) as the credential of `run`, replacing any earlier one, under
/// the lease of `worker`, which the caller has just checked in `tx`.
pub(crate) async fn store(
    tx: &mut impl Exec,
    project: ProjectId,
    run: RunId,
    worker: &str,
    digest: &str,
    expires_at: i64,
    now: i64,
) -> Result<(), StoreError> {
    revoke(tx, run).await?;
    tx.execute(
        "INSERT INTO run_tokens (run_id, project_id, sha256, lease_owner, expires_at, created_at) \
         VALUES ($1, $2, $3, $4, $5, $6)",
        vec![
            run.to_string().into(),
            project.to_string().into(),
            digest.into(),
            worker.into(),
            expires_at.into(),
            now.into(),
        ],
    )
    .await?;
    Ok(())
}

impl fmt::Debug for RunToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("RunToken(***)")
    }
}

/// What a live run token grants: acting for one running run of one project, until
/// `expires_at`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunGrant {
    pub run_id: RunId,
    pub project_id: ProjectId,
    pub routine_id: RoutineId,
    pub routine_version: i64,
    /// Unix milliseconds: the run's deadline when the token was minted.
    pub expires_at: i64,
}

impl Store {
    /// Mints the credential of a run `worker` holds, replacing any earlier one, expiring at
    /// `expires_at` (unix milliseconds). `None` when the worker does not hold the run.
    pub async fn mint_run_token(
        &self,
        project: ProjectId,
        run: RunId,
        worker: &str,
        expires_at: i64,
    ) -> Result<Option<RunToken>, StoreError> {
        let token = RunToken::generate()?;
        let mut tx = self.begin_write().await?;
        sqlx::query("DELETE FROM run_tokens WHERE run_id = $1")
            .bind(run.to_string())
            .execute(&mut **tx)
            .await?;
        let inserted = sqlx::query(
            "INSERT INTO run_tokens (run_id, project_id, sha256, lease_owner, expires_at, created_at) \
             SELECT id, project_id, $1, lease_owner, $2, $3 FROM runs \
             WHERE id = $4 AND project_id = $5 AND lease_owner = $6 AND status = 'running'",
        )
        .bind(token.digest())
        .bind(expires_at)
        .bind(now_millis())
        .bind(run.to_string())
        .bind(project.to_string())
        .bind(worker)
        .execute(&mut **tx)
        .await?;
        if inserted.rows_affected() != 1 {
            tx.rollback().await?;
            return Ok(None);
        }
        tx.commit().await?;
        Ok(Some(token))
    }

    /// What `presented` grants, if it is a live run token: stored, before its deadline, and
    /// its run still running under the lease it was minted under.
    pub async fn authenticate_run_token(
        &self,
        presented: &str,
    ) -> Result<Option<RunGrant>, StoreError> {
        if !presented.starts_with(RUN_TOKEN_PREFIX) {
            return Ok(None);
        }
        let row = sqlx::query(
            "SELECT t.run_id, t.project_id, t.expires_at, r.routine_id, r.routine_version \
             FROM run_tokens t JOIN runs r ON r.id = t.run_id \
             WHERE t.sha256 = $1 AND t.expires_at > $2 AND r.status = 'running' \
             AND r.lease_owner = t.lease_owner",
        )
        .bind(sha256_hex(presented.as_bytes()))
        .bind(now_millis())
        .fetch_optional(self.pool())
        .await?;
        let Some(row) = row else {
            return Ok(None);
        };
        Ok(Some(RunGrant {
            run_id: parse_column(&row.try_get::<String, _>("run_id")?, "run_tokens.run_id")?,
            project_id: parse_column(
                &row.try_get::<String, _>("project_id")?,
                "run_tokens.project_id",
            )?,
            routine_id: parse_column(&row.try_get::<String, _>("routine_id")?, "runs.routine_id")?,
            routine_version: row.try_get("routine_version")?,
            expires_at: row.try_get("expires_at")?,
        }))
    }

    /// Ends `run`'s credential at once: the engine refuses the run's next call and fails it.
    pub async fn revoke_run_token(&self, run: RunId) -> Result<(), StoreError> {
        let pool = self.write_pool().await?;
        let mut connection = pool.acquire().await?;
        revoke(&mut *connection, run).await
    }

    /// Whether `run` holds a stored credential (live or not): what tests and operators check
    /// after a run parks or ends.
    pub async fn run_token_exists(&self, run: RunId) -> Result<bool, StoreError> {
        let row = sqlx::query("SELECT COUNT(*) AS n FROM run_tokens WHERE run_id = $1")
            .bind(run.to_string())
            .fetch_one(self.pool())
            .await?;
        Ok(row.try_get::<i64, _>("n")? > 0)
    }
}

/// Deletes the credentials of runs no worker is driving (requeued after a lost lease, cancelled
/// while queued, or left by a crash); returns how many.
///
/// On PostgreSQL a credential another transaction holds is skipped, not waited for: that
/// transaction mints or revokes it, and a sweep that waited for it while holding the rows it
/// had already taken could deadlock with it. The next sweep finds what this one left.
pub(crate) async fn sweep(
    connection: &mut sqlx::AnyConnection,
    backend: crate::Backend,
) -> Result<u64, StoreError> {
    let sql = match backend {
        crate::Backend::Postgres => {
            "DELETE FROM run_tokens WHERE run_id IN (SELECT run_id FROM run_tokens \
             WHERE run_id NOT IN (SELECT id FROM runs WHERE status = 'running') \
             FOR UPDATE SKIP LOCKED)"
        }
        crate::Backend::Sqlite => {
            "DELETE FROM run_tokens WHERE run_id NOT IN (SELECT id FROM runs WHERE status = 'running')"
        }
    };
    let done = sqlx::query(sql).execute(connection).await?;
    Ok(done.rows_affected())
}

/// Deletes a run's credential, inside the transaction that parks, ends or claims it.
pub(crate) async fn revoke(connection: &mut impl Exec, run: RunId) -> Result<(), StoreError> {
    connection
        .execute(
            "DELETE FROM run_tokens WHERE run_id = $1",
            vec![run.to_string().into()],
        )
        .await?;
    Ok(())
}
