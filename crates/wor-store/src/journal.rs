//! A run's journal writes: what the worker driving a run records at one step — its steps, its
//! usage, its audit entries — committed together, fenced by the worker's lease (and, when the
//! step reserves a call, by the run's credential).
//!
//! The writes go through the audit writer's task ([`AuditLog::record`](crate::AuditLog)),
//! which commits whatever is queued, from every run this process drives, in one transaction:
//! a step and its audit entries are durable together, and concurrent runs share one commit.
//! Nothing is acknowledged before its transaction has committed, so "every step is persisted
//! before the next begins" holds for each run. A write that permits an effect outside the
//! database (a call about to run that can change something, a run's end) is also on disk
//! before it is acknowledged; the others reach the disk with the next such commit
//! ([`RunWrite::is_durable`]).

use std::fmt::Write as _;

use wor_core::audit::AuditEvent;
use wor_core::budget::BudgetUsage;
use wor_core::canonical::sha256_hex;
use wor_core::run::{Provenance, RunStatus};
use wor_core::step::{OutcomeStep, Step};
use wor_core::{ApprovalId, ProjectId, RunId};

use crate::exec::{Exec, Param};
use crate::runs::{STEPS_PER_WRITE_STATEMENT, StepRow, insert_steps, requeue_parent, to_i64};
use crate::{Backend, RunToken, Store, StoreError, now_millis};

/// What the worker driving a run records at one step, in one transaction.
#[derive(Debug, Clone)]
pub struct RunWrite {
    pub project: ProjectId,
    pub run: RunId,
    /// The worker that must hold the run's lease; the write renews the lease for `lease_ms`.
    pub worker: String,
    pub lease_ms: i64,
    /// The run's credential the write presents, when it reserves a call or comes from a
    /// remote worker: nothing is written unless it is the credential of the worker's claim
    /// (and, for a reservation, still live).
    credential: Option<Presented>,
    /// A new credential for the run (its digest and expiry), replacing any earlier one.
    mint: Option<(String, i64)>,
    /// Whether nothing is written once a cancel of the run has been requested.
    unless_cancelled: bool,
    /// The run's usage the writer last saw: nothing is written if it changed since.
    usage_before: Option<BudgetUsage>,
    /// Whether nothing is written when the write's usage is below the run's in any measure.
    usage_not_lower: bool,
    pub steps: Vec<(Provenance, Step)>,
    /// The run's usage after this step, when it changed.
    pub usage: Option<BudgetUsage>,
    /// Audit entries committed with the steps, in order.
    pub audit: Vec<AuditEvent>,
    /// The run's end, when this write ends it.
    end: Option<(RunStatus, String)>,
    /// Whether the write is on disk before it is acknowledged: set by what permits an effect
    /// outside the database (a call reserved to run that can change something, a run's end).
    durable: bool,
}

impl RunWrite {
    pub fn new(project: ProjectId, run: RunId, worker: &str, lease_ms: i64) -> Self {
        RunWrite {
            project,
            run,
            worker: worker.to_owned(),
            lease_ms,
            credential: None,
            mint: None,
            unless_cancelled: false,
            usage_before: None,
            usage_not_lower: false,
            steps: Vec::new(),
            usage: None,
            audit: Vec::new(),
            end: None,
            durable: false,
        }
    }

    /// This write with `earlier`'s steps and audit entries before its own, in the same
    /// transaction: what the worker recorded and had no reason to commit alone. `earlier`
    /// carries steps, usage and audit entries only; the later usage is the run's.
    #[must_use]
    pub fn preceded_by(mut self, earlier: RunWrite) -> Self {
        let mut steps = earlier.steps;
        steps.append(&mut self.steps);
        self.steps = steps;
        let mut audit = earlier.audit;
        audit.append(&mut self.audit);
        self.audit = audit;
        self.usage = self.usage.or(earlier.usage);
        self
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

    /// Ends the run with `status` and `outcome`, after the steps: its `outcome` step is the
    /// last, its lease and credential end, its pending approvals are cancelled and a parent
    /// waiting for it is queued again — all in the same transaction.
    #[must_use]
    pub fn end(mut self, status: RunStatus, outcome: &str) -> Self {
        self.end = Some((status, outcome.to_owned()));
        self.durable = true;
        self
    }

    /// Writes only while `credential` is the run's live credential: the check and the
    /// reservation of a call are one statement.
    #[must_use]
    pub fn presenting(mut self, credential: &str) -> Self {
        self.credential = Some(Presented::new(credential, true));
        self.durable = true;
        self
    }

    /// Writes only under the claim `credential` was minted for, before the run's deadline
    /// (while it is the run's live credential), without being synced for it: a remote
    /// worker's step that reserves nothing, or the reservation of a call that changes nothing
    /// outside — to a tool an admin classified read-only, let run by an auto decision, using
    /// no approval. If a power cut loses that reservation, the run resumes from the steps
    /// before it and may make the read again, as after a crash before it; a crash of the
    /// process loses nothing, the write being committed before it is acknowledged.
    #[must_use]
    pub fn under_live_claim(mut self, credential: &str) -> Self {
        self.credential = Some(Presented::new(credential, true));
        self
    }

    /// Writes only when its usage is no lower than the run's in any measure: a remote
    /// worker's end never undoes what a write that committed before it counted.
    #[must_use]
    pub fn never_lowering_usage(mut self) -> Self {
        self.usage_not_lower = true;
        self
    }

    /// Writes only while the run's usage is still `before`, what the writer counted from: two
    /// writes counted from the same usage cannot both commit, so neither can lower the usage
    /// or count two reservations as one. A write that finds it changed writes nothing and is
    /// reported as not held ([`RunWritten::LeaseLost`], or [`RunWritten::CredentialEnded`]
    /// when it presents a credential): its writer's view of the run is stale.
    #[must_use]
    pub fn counted_from(mut self, before: BudgetUsage) -> Self {
        self.usage_before = Some(before);
        self
    }

    /// Writes only under the claim `credential` was minted for, whether or not the run's
    /// deadline has ended it: a remote worker's write is bound to its claim, so a stale driver
    /// of an earlier claim by the same worker writes nothing. A write that also reserves a
    /// call presents it live ([`RunWrite::presenting`], or [`RunWrite::under_live_claim`]
    /// for a read) instead.
    #[must_use]
    pub fn under_claim(mut self, credential: &str) -> Self {
        self.credential = Some(Presented::new(credential, false));
        self
    }

    /// Writes only while no cancel of the run has been requested: a call is reserved, or a
    /// run parked for a person, only for a run that is to go on.
    #[must_use]
    pub fn unless_cancelled(mut self) -> Self {
        self.unless_cancelled = true;
        self
    }

    /// Stores `token` as the run's credential until `expires_at` (unix milliseconds),
    /// replacing any earlier one. Not synced by itself: a credential lost to a power cut is
    /// minted again when the run resumes, and the write that reserves a call with it fails
    /// its check then.
    #[must_use]
    pub fn minting(mut self, token: &RunToken, expires_at: i64) -> Self {
        self.mint = Some((token.digest(), expires_at));
        self
    }

    /// Whether this write is synced to disk before it is acknowledged. A write that reserves
    /// a call that can change something ([`RunWrite::presenting`]) or ends the run is: the
    /// call runs, and the end is announced, only once their record survives a power cut.
    /// Other writes (a model turn, a tool's result, the reservation of a read) may be lost to
    /// a power cut, never to a crash of the process; the run then resumes from the steps
    /// before them, as from a crash.
    pub fn is_durable(&self) -> bool {
        self.durable
    }
}

impl Store {
    /// Ends a run `worker` holds, outside the audit writer (the engine ends runs through
    /// [`AuditLog::record`](crate::AuditLog::record), with their audit entry): see
    /// [`RunWrite::end`](crate::RunWrite::end). False when the worker does not hold it.
    pub async fn finish_run(
        &self,
        project: ProjectId,
        run: RunId,
        worker: &str,
        status: RunStatus,
        outcome: &str,
    ) -> Result<bool, StoreError> {
        let write = RunWrite::new(project, run, worker, 0).end(status, outcome);
        let mut tx = self.begin_write().await?;
        let written = write_run(&mut *tx, self.backend, &write, now_millis()).await?;
        tx.commit().await?;
        Ok(matches!(written, RunWritten::Committed { .. }))
    }
}

/// A credential a write presents: its SHA-256 digest, and whether it must still be live.
#[derive(Debug, Clone)]
struct Presented {
    digest: String,
    live: bool,
}

impl Presented {
    fn new(credential: &str, live: bool) -> Self {
        Presented {
            digest: sha256_hex(credential.as_bytes()),
            live,
        }
    }
}

/// What became of a [`RunWrite`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RunWritten {
    /// Committed. Whether a cancel of the run had been requested when it was written, and,
    /// for a write that ended the run, the approvals it cancelled.
    Committed {
        cancel_requested: bool,
        cancelled_approvals: Vec<ApprovalId>,
    },
    /// The worker does not hold the run (any more): nothing was written.
    LeaseLost,
    /// The worker holds the run but the presented credential is no longer live: nothing was
    /// written.
    CredentialEnded,
    /// The worker holds the run but a cancel of it was requested, and the write was to be
    /// made only unless one was ([`RunWrite::unless_cancelled`]): nothing was written.
    CancelRequested,
}

/// Writes `write`'s run part in `tx`: the fence (lease, credential), the lease renewal, the
/// usage and the steps. Its audit entries are the caller's to append in the same transaction
/// when this answers [`RunWritten::Committed`].
pub(crate) async fn write_run(
    tx: &mut impl Exec,
    backend: Backend,
    write: &RunWrite,
    now: i64,
) -> Result<RunWritten, StoreError> {
    let mut fence = Fence::default();
    let at = fence.int(now);
    // Written into one text as it is built: `write!` to a `String` cannot fail.
    let mut sql = String::with_capacity(1024);
    let _ = write!(sql, "UPDATE runs SET updated_at = {at}");
    match &write.end {
        Some((status, outcome)) => {
            let status = fence.text(status.as_str());
            let outcome = fence.text(outcome);
            let announce = fence.int(now.saturating_add(crate::ANNOUNCE_GRACE_MS));
            let _ = write!(
                sql,
                ", lease_owner = NULL, lease_expires_at = NULL, finished_at = {at}, \
                 status = {status}, outcome = {outcome}, announce_due_at = {announce}"
            );
        }
        None => {
            let lease = fence.int(now.saturating_add(write.lease_ms));
            let _ = write!(sql, ", lease_expires_at = {lease}");
        }
    }
    if let Some(usage) = &write.usage {
        sql.push_str(", ");
        fence.usage(&mut sql, usage, "=", ", ");
    }
    let id = fence.text(write.run.to_string());
    let project = fence.text(write.project.to_string());
    let worker = fence.text(write.worker.as_str());
    let _ = write!(
        sql,
        " WHERE id = {id} AND project_id = {project} AND lease_owner = {worker} \
         AND status = 'running'"
    );
    if write.unless_cancelled {
        sql.push_str(" AND cancel_requested = 0");
    }
    if let (true, Some(usage)) = (write.usage_not_lower, &write.usage) {
        sql.push_str(" AND ");
        fence.usage(&mut sql, usage, "<=", " AND ");
    }
    if let Some(before) = &write.usage_before {
        sql.push_str(" AND ");
        fence.usage(&mut sql, before, "=", " AND ");
    }
    if let Some(credential) = &write.credential {
        let digest = fence.text(credential.digest.as_str());
        let _ = write!(
            sql,
            " AND EXISTS (SELECT 1 FROM run_tokens t WHERE t.run_id = runs.id \
             AND t.sha256 = {digest}"
        );
        if credential.live {
            let _ = write!(sql, " AND t.expires_at > {at}");
        }
        sql.push_str(" AND t.lease_owner = runs.lease_owner)");
    }
    // The run's last step number comes back with the fence, saving the writer a round trip.
    sql.push_str(
        " RETURNING runs.id, cancel_requested, \
         (SELECT COALESCE(MAX(s.seq), 0) FROM run_steps s WHERE s.run_id = runs.id) AS last_seq",
    );
    let outcome = write.end.as_ref().map(|(status, outcome)| {
        Step::Outcome(OutcomeStep {
            status: *status,
            message: outcome.clone(),
        })
    });
    let steps: Vec<(Provenance, &Step)> = write
        .steps
        .iter()
        .map(|(provenance, step)| (*provenance, step))
        .chain(outcome.as_ref().map(|step| (Provenance::Engine, step)))
        .collect();
    // On PostgreSQL, each statement is a round trip on the one connection every journal write
    // of this process takes its turn on: the steps are inserted by the fence's own statement,
    // numbered from the last step it returns, and only if it matched the run.
    let inserted_with_fence = backend == Backend::Postgres
        && !steps.is_empty()
        && steps.len() <= STEPS_PER_WRITE_STATEMENT;
    if inserted_with_fence {
        sql = fence.with_steps(&sql, &steps, at, project)?;
    }
    let Some(row) = tx.fetch_optional(&sql, fence.values).await? else {
        return fenced_out(tx, write).await;
    };
    let cancel_requested = row.int("cancel_requested")?;
    if !inserted_with_fence {
        let mut seq = row.int("last_seq")?;
        let rows: Vec<StepRow<'_>> = steps
            .into_iter()
            .map(|(provenance, step)| {
                seq += 1;
                StepRow {
                    run: write.run,
                    project: write.project,
                    seq,
                    provenance,
                    step,
                }
            })
            .collect();
        insert_steps(tx, &rows, now, STEPS_PER_WRITE_STATEMENT).await?;
    }
    if let Some((digest, expires_at)) = &write.mint {
        crate::run_tokens::store(
            tx,
            write.project,
            write.run,
            &write.worker,
            digest,
            *expires_at,
            now,
        )
        .await?;
    }
    let mut cancelled_approvals = Vec::new();
    if write.end.is_some() {
        // A nested run's parent, parked while it ran, goes on: an ended child never leaves
        // its parent waiting.
        requeue_parent(tx, write.run, now).await?;
        crate::run_tokens::revoke(tx, write.run).await?;
        cancelled_approvals = crate::approvals::cancel_pending(tx, write.run, now).await?;
    }
    Ok(RunWritten::Committed {
        cancel_requested: cancel_requested != 0,
        cancelled_approvals,
    })
}

/// The values of a fence statement in the order of their placeholders.
#[derive(Default)]
struct Fence {
    values: Vec<Param>,
}

/// The placeholder of one of a [`Fence`]'s values: `$N`, written where it is used.
#[derive(Clone, Copy)]
struct Placeholder(usize);

impl std::fmt::Display for Placeholder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "${}", self.0)
    }
}

impl Fence {
    /// The placeholder of the next value, `value`.
    fn int(&mut self, value: i64) -> Placeholder {
        self.push(Param::Int(value))
    }

    fn text(&mut self, value: impl Into<String>) -> Placeholder {
        self.push(Param::Text(value.into()))
    }

    /// The fence statement `update` (an `UPDATE runs … RETURNING runs.id, cancel_requested,
    /// … AS last_seq`) as one PostgreSQL statement that also inserts `steps` into the run
    /// fenced, numbered after its `last_seq`, created at `at`, in `project`; it returns the
    /// fence's `cancel_requested` and `last_seq`. When the fence matches no row, no step is
    /// inserted and no row is returned.
    fn with_steps(
        &mut self,
        update: &str,
        steps: &[(Provenance, &Step)],
        at: Placeholder,
        project: Placeholder,
    ) -> Result<String, StoreError> {
        // The text around the fence, and each step's row of placeholders: a guess at the
        // length, so the text is seldom grown. `write!` to a `String` cannot fail.
        let mut sql = String::with_capacity(update.len() + 320 + steps.len() * 24);
        let _ = write!(
            sql,
            "WITH fenced AS ({update}), steps AS (INSERT INTO run_steps \
             (run_id, seq, project_id, kind, provenance, payload, created_at) \
             SELECT fenced.id, fenced.last_seq + step.n, {project}, step.kind, step.provenance, \
             step.payload, {at} FROM fenced CROSS JOIN (VALUES "
        );
        for (n, (provenance, step)) in steps.iter().enumerate() {
            let [kind, provenance, payload] = crate::runs::step_values(*provenance, step)?;
            let (kind, provenance, payload) =
                (self.push(kind), self.push(provenance), self.push(payload));
            let separator = if n == 0 { "" } else { ", " };
            let _ = write!(
                sql,
                "{separator}({}, {kind}, {provenance}, {payload})",
                n + 1
            );
        }
        sql.push_str(
            ") AS step (n, kind, provenance, payload)) \
             SELECT cancel_requested, last_seq FROM fenced",
        );
        Ok(sql)
    }

    /// The placeholder of the next value, `value`, of any type.
    fn push(&mut self, value: Param) -> Placeholder {
        self.values.push(value);
        Placeholder(self.values.len())
    }

    /// Writes each usage column of a run compared with (`op`) its measure in `usage` to
    /// `sql`, joined by `joiner`: `usage_turns = $n, …` to set them, `usage_turns <= $n AND
    /// …` to fence on them.
    fn usage(&mut self, sql: &mut String, usage: &BudgetUsage, op: &str, joiner: &str) {
        let columns = [
            ("usage_turns", usage.turns),
            ("usage_tool_calls", usage.tool_calls),
            ("usage_input_tokens", usage.input_tokens),
            ("usage_output_tokens", usage.output_tokens),
            ("usage_cost_microdollars", usage.cost_microdollars),
        ];
        for (i, (column, value)) in columns.into_iter().enumerate() {
            if i > 0 {
                sql.push_str(joiner);
            }
            let value = self.int(to_i64(value));
            let _ = write!(sql, "{column} {op} {value}");
        }
    }
}

/// Why a fenced write matched no row: the lease, a requested cancel, or the credential.
async fn fenced_out(tx: &mut impl Exec, write: &RunWrite) -> Result<RunWritten, StoreError> {
    if write.credential.is_none() && !write.unless_cancelled {
        return Ok(RunWritten::LeaseLost);
    }
    let held = tx
        .fetch_optional(
            "SELECT cancel_requested FROM runs WHERE id = $1 AND lease_owner = $2 \
             AND status = 'running'",
            vec![write.run.to_string().into(), write.worker.as_str().into()],
        )
        .await?;
    let Some(held) = held else {
        return Ok(RunWritten::LeaseLost);
    };
    Ok(
        if write.unless_cancelled && held.int("cancel_requested")? != 0 {
            RunWritten::CancelRequested
        } else if write.credential.is_some() {
            RunWritten::CredentialEnded
        } else {
            RunWritten::LeaseLost
        },
    )
}
