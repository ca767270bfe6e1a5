//! A run's journal writes: what the worker driving a run records at one step — its steps, its
//! usage, its audit entries — committed together, fenced by the worker's lease (and, when the
//! step reserves a call, by the run's credential).
//!
//! The writes go through the audit writer's task ([`AuditLog::record`](crate::AuditLog)),
//! which commits whatever is queued, from every run this process drives, in one transaction:
//! a step and its audit entries are durable together, and concurrent runs share one commit.
//! Nothing is acknowledged before its transaction has committed, so "every step is persisted
//! before the next begins" holds for each run.

use sqlx::{Any, Row, Transaction};
use wor_core::audit::AuditEvent;
use wor_core::budget::BudgetUsage;
use wor_core::canonical::sha256_hex;
use wor_core::run::Provenance;
use wor_core::step::Step;
use wor_core::{ProjectId, RunId};

use crate::runs::{insert_step, to_i64};
use crate::{RunToken, StoreError};

/// What the worker driving a run records at one step, in one transaction.
#[derive(Debug)]
pub struct RunWrite {
    pub project: ProjectId,
    pub run: RunId,
    /// The worker that must hold the run's lease; the write renews the lease for `lease_ms`.
    pub worker: String,
    pub lease_ms: i64,
    /// The SHA-256 digest of the run's credential, when the write reserves a call: the
    /// credential must still be live, or nothing is written.
    credential: Option<String>,
    pub steps: Vec<(Provenance, Step)>,
    /// The run's usage after this step, when it changed.
    pub usage: Option<BudgetUsage>,
    /// Audit entries committed with the steps, in order.
    pub audit: Vec<AuditEvent>,
}

impl RunWrite {
    pub fn new(project: ProjectId, run: RunId, worker: &str, lease_ms: i64) -> Self {
        RunWrite {
            project,
            run,
            worker: worker.to_owned(),
            lease_ms,
            credential: None,
            steps: Vec::new(),
            usage: None,
            audit: Vec::new(),
        }
    }

    #[must_use]
    pub fn step(mut self, provenance: Provenance, step: Step) -> Self {
        self.steps.push((provenance, step));
        self
    }

    #[must_use]
    pub fn usage(mut self, usage: BudgetUsage) -> Self {
        self.usage = Some(usage);
        self
    }

    #[must_use]
    pub fn audit(mut self, event: AuditEvent) -> Self {
        self.audit.push(event);
        self
    }

    /// Writes only while `credential` is the run's live credential: the check and the
    /// reservation of a call are one statement.
    #[must_use]
    pub fn presenting(mut self, credential: &RunToken) -> Self {
        self.credential = Some(sha256_hex(credential.expose().as_bytes()));
        self
    }
}

/// What became of a [`RunWrite`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunWritten {
    /// Committed. Whether a cancel of the run had been requested when it was written.
    Committed { cancel_requested: bool },
    /// The worker does not hold the run (any more): nothing was written.
    LeaseLost,
    /// The worker holds the run but the presented credential is no longer live: nothing was
    /// written.
    CredentialEnded,
}

/// Writes `write`'s run part in `tx`: the fence (lease, credential), the lease renewal, the
/// usage and the steps. Its audit entries are the caller's to append in the same transaction
/// when this answers [`RunWritten::Committed`].
pub(crate) async fn write_run(
    tx: &mut Transaction<'_, Any>,
    write: &RunWrite,
    now: i64,
) -> Result<RunWritten, StoreError> {
    let mut sql = String::from("UPDATE runs SET lease_expires_at = $1, updated_at = $2");
    if write.usage.is_some() {
        sql.push_str(
            ", usage_turns = $6, usage_tool_calls = $7, usage_input_tokens = $8, \
             usage_output_tokens = $9, usage_cost_microdollars = $10",
        );
    }
    sql.push_str(" WHERE id = $3 AND project_id = $4 AND lease_owner = $5 AND status = 'running'");
    if write.credential.is_some() {
        let at = if write.usage.is_some() { 11 } else { 6 };
        sql.push_str(&format!(
            " AND EXISTS (SELECT 1 FROM run_tokens t WHERE t.run_id = runs.id \
             AND t.sha256 = ${at} AND t.expires_at > $2 AND t.lease_owner = runs.lease_owner)"
        ));
    }
    sql.push_str(" RETURNING cancel_requested");
    let mut query = sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(now.saturating_add(write.lease_ms))
        .bind(now)
        .bind(write.run.to_string())
        .bind(write.project.to_string())
        .bind(write.worker.clone());
    if let Some(usage) = &write.usage {
        query = query
            .bind(to_i64(usage.turns))
            .bind(to_i64(usage.tool_calls))
            .bind(to_i64(usage.input_tokens))
            .bind(to_i64(usage.output_tokens))
            .bind(to_i64(usage.cost_microdollars));
    }
    if let Some(credential) = &write.credential {
        query = query.bind(credential.clone());
    }
    let Some(row) = query.fetch_optional(&mut **tx).await? else {
        return fenced_out(tx, write).await;
    };
    let cancel_requested: i64 = row.try_get("cancel_requested")?;
    if !write.steps.is_empty() {
        let last: i64 =
            sqlx::query("SELECT COALESCE(MAX(seq), 0) AS last FROM run_steps WHERE run_id = $1")
                .bind(write.run.to_string())
                .fetch_one(&mut **tx)
                .await?
                .try_get("last")?;
        for (seq, (provenance, step)) in (last + 1..).zip(&write.steps) {
            insert_step(tx, write.project, write.run, seq, *provenance, step, now).await?;
        }
    }
    Ok(RunWritten::Committed {
        cancel_requested: cancel_requested != 0,
    })
}

/// Why a fenced write matched no row: the lease, or only the credential.
async fn fenced_out(
    tx: &mut Transaction<'_, Any>,
    write: &RunWrite,
) -> Result<RunWritten, StoreError> {
    if write.credential.is_none() {
        return Ok(RunWritten::LeaseLost);
    }
    let held = sqlx::query(
        "SELECT 1 AS held FROM runs WHERE id = $1 AND lease_owner = $2 AND status = 'running'",
    )
    .bind(write.run.to_string())
    .bind(write.worker.clone())
    .fetch_optional(&mut **tx)
    .await?;
    Ok(if held.is_some() {
        RunWritten::CredentialEnded
    } else {
        RunWritten::LeaseLost
    })
}
