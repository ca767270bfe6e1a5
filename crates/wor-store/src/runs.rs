//! Runs and their steps. A run's row holds its status, usage and lease; its steps hold
//! everything it did, in order, each written before the next begins.
//!
//! INVARIANT: a worker changes a running run only while it holds the run's lease
//! (`lease_owner`), so two workers never drive one run.

use sqlx::Row;
use wor_core::audit::AuditEvent;
use wor_core::budget::BudgetUsage;
use wor_core::call::TriggerKind;
use wor_core::canonical::sha256_hex;
use wor_core::run::{Provenance, RunStatus};
use wor_core::step::{InputStep, MemoryStep, Step};
use wor_core::{ApiKeyId, MemberId, ProjectId, RoutineId, RunId};

use crate::exec::{Exec, Param};
use crate::staged::StagedEvent;
use crate::{Store, StoreError, now_millis, parse_column};

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct RunRecord {
    pub id: RunId,
    pub project_id: ProjectId,
    pub routine_id: RoutineId,
    pub routine_version: i64,
    pub root_run_id: RunId,
    pub parent_run_id: Option<RunId>,
    pub depth: i64,
    pub status: RunStatus,
    pub trigger_kind: TriggerKind,
    pub started_by: Option<ApiKeyId>,
    /// The member who started the run from the console (no key involved).
    pub started_by_member: Option<MemberId>,
    pub trigger_key: Option<String>,
    pub thread: Option<String>,
    pub outcome: Option<String>,
    pub usage: BudgetUsage,
    /// Milliseconds spent parked for approvals, not counted as the run's wall time.
    pub parked_ms: i64,
    /// When the park the run is in began, while it is parked; not yet in `parked_ms`.
    #[serde(default)]
    pub parked_at: Option<i64>,
    /// A nested run's cap: what was left of its root's budget when it started.
    pub budget_cap: Option<serde_json::Value>,
    pub cancel_requested: bool,
    pub created_at: i64,
    /// A scheduled run recorded ahead of its slot is not claimed before this time (its slot
    /// plus jitter, milliseconds); `None` for every other run.
    pub not_before: Option<i64>,
    pub started_at: Option<i64>,
    pub finished_at: Option<i64>,
}

/// What [`Store::park_for_nested`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NestedPark {
    /// Parked until the nested run ends.
    Parked,
    /// The nested run had ended: nothing was parked.
    ChildEnded,
    /// The worker does not hold the run (under this claim): nothing was parked.
    NotHeld,
}

#[derive(Debug, Clone)]
pub struct NewRun {
    pub routine_id: RoutineId,
    pub routine_version: i64,
    pub trigger_kind: TriggerKind,
    pub started_by: Option<ApiKeyId>,
    /// The member who started the run from the console.
    pub started_by_member: Option<MemberId>,
    pub max_concurrent: u64,
    /// `Skipped` for a run refused by the overlap policy, otherwise `Queued`.
    pub status: RunStatus,
    pub outcome: Option<String>,
    /// For triggers that must start at most one run: `slot:<ms>`, `delivery:<id>`.
    pub trigger_key: Option<String>,
    /// How the input step is labelled: `requester` for a caller's input, `untrusted` for a
    /// webhook payload, `engine` for what a schedule says.
    pub input_provenance: Provenance,
    /// The memory thread the run belongs to, when its routine keeps memory.
    pub thread: Option<String>,
    /// The thread's memory as replayed into this run (a `memory` step after the input), with
    /// the step's label: `untrusted` when any entry is.
    pub memory: Option<(Provenance, MemoryStep)>,
    /// For a run started by another run's call: its place in the tree and its budget cap.
    pub parent: Option<ParentLink>,
    /// For a run of a routine whose overlap policy skips: how many active runs of the routine
    /// make this one skipped. Counted again in the transaction that records it (with the
    /// routine's row locked on PostgreSQL), so starts at the same moment never pass it
    /// together: one that would is refused with [`StoreError::RoutineFull`].
    pub skip_at: Option<u64>,
}

/// A note that a run's announcements for its move to `status` were queued at `noted_at`
/// (milliseconds): see [`Store::announced`].
#[derive(Debug, Clone, Copy)]
pub struct AnnouncedRun {
    pub id: RunId,
    pub status: RunStatus,
    pub noted_at: i64,
}

/// A run a scheduler pass starts.
#[derive(Debug, Clone)]
pub struct ScheduledStart {
    pub project: ProjectId,
    pub run: NewRun,
    pub input: InputStep,
    /// For a run recorded ahead of its slot: no worker claims it before this time
    /// (milliseconds). `None`: claimable at once.
    pub not_before: Option<i64>,
}

/// A schedule's next slot moved from `from` to `to` (`None`: it fires no more), by
/// compare-and-set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScheduleAdvance {
    pub routine: RoutineId,
    pub from: i64,
    pub to: Option<i64>,
}

/// Who claims a run and on what terms: the worker the lease is for, the lease's length and the
/// most runs of one project running at once.
#[derive(Debug, Clone, Copy)]
pub struct ClaimTerms<'a> {
    pub worker: &'a str,
    pub lease_ms: i64,
    pub max_per_project: u64,
}

/// What one claim of the queue took, leased to its claimer.
#[derive(Debug, Default)]
pub struct Claimed {
    /// The runs claimed, oldest first.
    pub runs: Vec<RunRecord>,
    /// Runs claimed whose stored row does not read as a run, with why: their claimer ends
    /// them, so one damaged row never holds up the queue behind it.
    pub unreadable: Vec<UnreadableRun>,
}

/// A claimed run whose stored row does not read as a run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnreadableRun {
    pub project: ProjectId,
    pub id: RunId,
    /// What could not be read.
    pub reason: String,
}

/// The limits a claim of the queue checks as it is written.
#[derive(Debug, Clone, Copy)]
struct ClaimLimits<'a> {
    /// The candidate's routine (`rtn_…`), whose `max_concurrent` holds.
    routine: &'a str,
    /// At most this many running runs per project.
    max_per_project: u64,
}

/// Where a nested run sits: its root and parent runs, its depth, and what is left of the
/// root's budget (JSON budget limits) when it started.
#[derive(Debug, Clone)]
pub struct ParentLink {
    pub root: RunId,
    pub parent: RunId,
    pub depth: i64,
    pub budget_cap: serde_json::Value,
}

/// One step of a run's log as stored: its place, its label and when it was written.
#[derive(Debug, Clone, PartialEq)]
pub struct RunStep {
    pub seq: i64,
    pub provenance: Provenance,
    pub step: Step,
    pub created_at: i64,
}

/// One memory thread of a routine: its name, how many runs it has had and when the last
/// started (milliseconds since the epoch).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThreadSummary {
    pub thread: String,
    pub runs: u64,
    pub last_at: i64,
}

/// Filters and page of a run listing, newest first.
#[derive(Debug, Clone, Default)]
pub struct RunFilter {
    pub routine_id: Option<RoutineId>,
    pub status: Option<RunStatus>,
    /// Only runs older than this one (the previous page's last id).
    pub before: Option<RunId>,
    pub limit: u32,
    /// Only runs started this way: `api`, `schedule`, `webhook` or `routine`.
    pub trigger_kind: Option<TriggerKind>,
    /// Only runs created at or after this time (milliseconds since the epoch).
    pub created_after: Option<i64>,
    /// Only runs created before this time (milliseconds since the epoch).
    pub created_before: Option<i64>,
}

const COLUMNS: &str = "id, project_id, routine_id, routine_version, root_run_id, parent_run_id, depth, \
    status, trigger_kind, started_by, started_by_member, trigger_key, thread, outcome, usage_turns, usage_tool_calls, usage_input_tokens, \
    usage_output_tokens, usage_cost_microdollars, cancel_requested, created_at, started_at, finished_at, parked_ms, parked_at, budget_cap, not_before";

pub(crate) fn to_i64(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

fn to_u64(value: i64) -> u64 {
    u64::try_from(value).unwrap_or(0)
}

impl Store {
    /// Records a new top-level run (queued, or skipped by the overlap policy), with its input
    /// as the first step.
    pub async fn create_run(
        &self,
        project: ProjectId,
        new: NewRun,
        input: InputStep,
    ) -> Result<RunRecord, StoreError> {
        Ok(self
            .create_run_staged(project, new, input, None, None)
            .await?
            .0)
    }

    /// Creates a run as [`Store::create_run`] does and, when it is queued, no run of its
    /// project queued before it is due, and the limits allow it, claims it for `claim`'s
    /// worker in the same transaction, checking the limits as [`Store::claim_runs`] does: the
    /// run is `running` from the moment it exists. Otherwise it stays queued for any worker.
    /// The check for older runs is stricter than a claim of the queue: an older run its own
    /// routine's limit holds back still keeps a new run of the project from being claimed
    /// here (the pool's next look claims it, passing over the held one).
    pub async fn create_and_claim_run(
        &self,
        project: ProjectId,
        new: NewRun,
        input: InputStep,
        claim: ClaimTerms<'_>,
    ) -> Result<RunRecord, StoreError> {
        Ok(self
            .create_run_staged(project, new, input, Some(claim), None)
            .await?
            .0)
    }

    /// Creates a run as [`Store::create_run`] does, or with `claim` as
    /// [`Store::create_and_claim_run`] does, and stages `started`, when given, its start entry,
    /// made from the new run's id, in the same transaction: a run never exists without its
    /// entry on its way to the chain. The caller appends it with
    /// [`crate::AuditLog::append_staged`]; if that does not happen, the audit writer's sweep
    /// does.
    pub async fn create_run_staged(
        &self,
        project: ProjectId,
        new: NewRun,
        input: InputStep,
        claim: Option<ClaimTerms<'_>>,
        started: Option<&(dyn Fn(RunId) -> AuditEvent + Sync)>,
    ) -> Result<(RunRecord, Option<StagedEvent>), StoreError> {
        let id = RunId::new();
        let now = now_millis();
        let mut tx = self.begin_write().await?;
        if let Some(max) = new.skip_at.filter(|_| new.status == RunStatus::Queued) {
            let active =
                count_active_locked(&mut tx, self.backend(), project, new.routine_id, max).await?;
            if active >= max {
                tx.rollback().await?;
                return Err(StoreError::RoutineFull { active, max });
            }
        }
        let start = ScheduledStart {
            project,
            run: new,
            input,
            not_before: None,
        };
        if insert_runs(
            &mut tx,
            &[id],
            std::slice::from_ref(&start),
            now,
            values_per_statement(self.backend()),
        )
        .await?
        .is_empty()
        {
            return Err(StoreError::Conflict(
                "this trigger (a schedule slot, a webhook delivery or an idempotency key) already started a run of the routine".to_owned(),
            ));
        }
        if let Some(claim) = claim
            && start.run.status == RunStatus::Queued
        {
            self.take_claim_locks(&mut tx, &[project]).await?;
            // Runs of the project queued before this one, due now, go first: the new run does
            // not take a place they wait for.
            let older: Option<String> = sqlx::query_scalar(
                "SELECT id FROM runs WHERE status = 'queued' AND id < $1 AND project_id = $2 \
                 AND (not_before IS NULL OR not_before <= $3) LIMIT 1",
            )
            .bind(id.to_string())
            .bind(project.to_string())
            .bind(now)
            .fetch_optional(&mut **tx)
            .await?;
            if older.is_none() {
                let routine = start.run.routine_id.to_string();
                let limits = ClaimLimits {
                    routine: &routine,
                    max_per_project: claim.max_per_project,
                };
                claim_in(
                    &mut tx,
                    project,
                    id,
                    claim.worker,
                    claim.lease_ms,
                    now,
                    Some(limits),
                )
                .await?;
            }
        }
        // Read in the transaction: a run this write claimed is never committed unread.
        let run = select_run(&mut **tx, project, id).await?;
        let staged = match started {
            Some(started) => Some(crate::staged::stage_one(&mut tx, started(id)).await?),
            None => None,
        };
        tx.commit().await?;
        if start.run.status == RunStatus::Skipped {
            crate::metrics::run_ended_unclaimed(start.run.status, start.run.trigger_kind);
        }
        Ok((run, staged))
    }

    /// Records the runs a scheduler pass starts, stages the start entry `started` makes of each
    /// (from its start and its id), and moves the schedules on, in one transaction:
    /// a crash leaves all of it or none. A slot that already started a run (in another process)
    /// starts no other and stages nothing: its entry in the answer is `None`. A schedule another
    /// process moved first is left as that process moved it. The caller appends the staged
    /// entries with [`crate::AuditLog::append_staged`]. A run the overlap policy may yet skip
    /// (`skip_at`) is counted again in the transaction, as a start by the API is, and recorded
    /// skipped when its routine is full; the answer has each run's id and status.
    pub async fn start_scheduled(
        &self,
        mut starts: Vec<ScheduledStart>,
        advances: &[ScheduleAdvance],
        started: &(dyn Fn(&ScheduledStart, RunId) -> AuditEvent + Sync),
    ) -> Result<(Vec<Option<(RunId, RunStatus)>>, Vec<StagedEvent>), StoreError> {
        let now = now_millis();
        let ids: Vec<RunId> = starts.iter().map(|_| RunId::new()).collect();
        let mut tx = self.begin_write().await?;
        skip_the_full(&mut tx, self.backend(), &mut starts).await?;
        let mut inserted = std::collections::HashSet::new();
        let values = values_per_statement(self.backend());
        for (ids, starts) in ids
            .chunks(values / RUN_VALUES)
            .zip(starts.chunks(values / RUN_VALUES))
        {
            inserted.extend(insert_runs(&mut tx, ids, starts, now, values).await?);
        }
        for advances in advances.chunks(values / ADVANCE_VALUES) {
            crate::triggers::advance_schedules(&mut tx, advances, now).await?;
        }
        let entries = ids
            .iter()
            .zip(&starts)
            .filter(|(id, _)| inserted.contains(*id))
            .map(|(id, start)| started(start, *id))
            .collect();
        let staged = crate::staged::stage(&mut tx, entries).await?;
        tx.commit().await?;
        for (id, start) in ids.iter().zip(&starts) {
            if start.run.status == RunStatus::Skipped && inserted.contains(id) {
                crate::metrics::run_ended_unclaimed(start.run.status, start.run.trigger_kind);
            }
        }
        let ids = ids
            .into_iter()
            .zip(&starts)
            .map(|(id, start)| inserted.contains(&id).then_some((id, start.run.status)))
            .collect();
        Ok((ids, staged))
    }

    pub async fn get_run(&self, project: ProjectId, id: RunId) -> Result<RunRecord, StoreError> {
        select_run(self.pool(), project, id).await
    }

    /// The run `worker` holds under the claim `credential` was minted for, deadline passed or
    /// not, while that worker is active; `None` otherwise, alike whether the run exists, is
    /// another worker's, was claimed again, parked or ended.
    pub async fn claimed_run(
        &self,
        worker: &str,
        id: RunId,
        credential: &str,
    ) -> Result<Option<RunRecord>, StoreError> {
        let row = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM runs WHERE id = $1 AND lease_owner = $2 AND status = 'running' \
             AND EXISTS (SELECT 1 FROM run_tokens t WHERE t.run_id = runs.id \
             AND t.lease_owner = runs.lease_owner AND t.sha256 = $3) \
             AND EXISTS (SELECT 1 FROM workers w WHERE w.id = runs.lease_owner \
             AND w.status = 'active')"
        )))
        .bind(id.to_string())
        .bind(worker)
        .bind(sha256_hex(credential.as_bytes()))
        .fetch_optional(self.pool())
        .await?;
        row.as_ref().map(run_from_row).transpose()
    }

    pub async fn list_runs(
        &self,
        project: ProjectId,
        filter: &RunFilter,
    ) -> Result<Vec<RunRecord>, StoreError> {
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM runs WHERE project_id = $1 \
             AND ($2 IS NULL OR routine_id = $2) AND ($3 IS NULL OR status = $3) AND ($4 IS NULL OR id < $4) \
             AND ($6 IS NULL OR trigger_kind = $6) AND ($7 IS NULL OR created_at >= $7) \
             AND ($8 IS NULL OR created_at < $8) \
             ORDER BY id DESC LIMIT $5"
        )))
        .bind(project.to_string())
        .bind(filter.routine_id.map(|r| r.to_string()))
        .bind(filter.status.map(|s| s.as_str()))
        .bind(filter.before.map(|r| r.to_string()))
        .bind(i64::from(filter.limit.clamp(1, 200)))
        .bind(filter.trigger_kind.map(TriggerKind::as_str))
        .bind(filter.created_after)
        .bind(filter.created_before)
        .fetch_all(self.pool())
        .await?;
        rows.iter().map(run_from_row).collect()
    }

    /// The latest `limit` runs of `routine`'s memory thread `thread`, oldest first: the turns
    /// of a conversation.
    pub async fn thread_runs(
        &self,
        project: ProjectId,
        routine: RoutineId,
        thread: &str,
        limit: u32,
    ) -> Result<Vec<RunRecord>, StoreError> {
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM runs WHERE project_id = $1 AND routine_id = $2 AND thread = $3 \
             ORDER BY id DESC LIMIT $4"
        )))
        .bind(project.to_string())
        .bind(routine.to_string())
        .bind(thread)
        .bind(i64::from(limit.clamp(1, 200)))
        .fetch_all(self.pool())
        .await?;
        let mut runs = rows
            .iter()
            .map(run_from_row)
            .collect::<Result<Vec<_>, _>>()?;
        runs.reverse();
        Ok(runs)
    }

    /// The memory threads of `routine` that have runs, the most recently used first, at most
    /// `limit`.
    pub async fn list_threads(
        &self,
        project: ProjectId,
        routine: RoutineId,
        limit: u32,
    ) -> Result<Vec<ThreadSummary>, StoreError> {
        let rows = sqlx::query(
            "SELECT thread, COUNT(*) AS runs, MAX(created_at) AS last_at FROM runs \
             WHERE project_id = $1 AND routine_id = $2 AND thread IS NOT NULL \
             GROUP BY thread ORDER BY MAX(created_at) DESC, thread LIMIT $3",
        )
        .bind(project.to_string())
        .bind(routine.to_string())
        .bind(i64::from(limit.clamp(1, 200)))
        .fetch_all(self.pool())
        .await?;
        rows.iter()
            .map(|row| {
                Ok(ThreadSummary {
                    thread: row.try_get("thread")?,
                    runs: to_u64(row.try_get("runs")?),
                    last_at: row.try_get("last_at")?,
                })
            })
            .collect()
    }

    /// How many runs of a routine are active (queued, running or waiting), counted up to
    /// `up_to`: a start asks only whether the routine is full, so its cost does not grow with
    /// the runs parked there.
    pub async fn active_run_count(
        &self,
        project: ProjectId,
        routine: RoutineId,
        up_to: u64,
    ) -> Result<u64, StoreError> {
        count_active(self.pool(), project, routine, up_to).await
    }

    /// How many runs of each of `routines` (project, routine) are active, by one statement
    /// per 200 routines; a routine with none is absent from the answer.
    pub async fn active_run_counts(
        &self,
        routines: &[(ProjectId, RoutineId)],
    ) -> Result<std::collections::HashMap<RoutineId, u64>, StoreError> {
        const PER_STATEMENT: usize = 200;
        let mut counts = std::collections::HashMap::new();
        for chunk in routines.chunks(PER_STATEMENT) {
            let sql = format!(
                "SELECT routine_id, project_id, COUNT(*) AS n FROM runs WHERE routine_id IN ({}) \
                 AND status IN ('queued', 'running', 'waiting_for_approval') \
                 GROUP BY routine_id, project_id",
                crate::placeholders(1, chunk.len())
            );
            let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
            for (_, routine) in chunk {
                query = query.bind(routine.to_string());
            }
            for row in query.fetch_all(self.pool()).await? {
                let routine: RoutineId =
                    parse_column(&row.try_get::<String, _>("routine_id")?, "runs.routine_id")?;
                let project: ProjectId =
                    parse_column(&row.try_get::<String, _>("project_id")?, "runs.project_id")?;
                // Counted only under the project the routine was asked for (S1).
                if chunk.contains(&(project, routine)) {
                    counts.insert(routine, to_u64(row.try_get("n")?));
                }
            }
        }
        Ok(counts)
    }

    /// The active runs of a routine not asked to stop yet, beyond its newest `keep`: the
    /// [`SURPLUS_PAGE`] newest of them, oldest first. What overlap `cancel_previous` cancels
    /// once a start is recorded, a page at a time.
    pub async fn surplus_active_runs(
        &self,
        project: ProjectId,
        routine: RoutineId,
        keep: u64,
    ) -> Result<Vec<RunId>, StoreError> {
        let rows = sqlx::query(
            "SELECT id FROM runs WHERE routine_id = $1 AND project_id = $2 \
             AND status IN ('queued', 'running', 'waiting_for_approval') AND cancel_requested = 0 \
             ORDER BY id DESC LIMIT $4 OFFSET $3",
        )
        .bind(routine.to_string())
        .bind(project.to_string())
        .bind(i64::try_from(keep).unwrap_or(i64::MAX))
        .bind(i64::try_from(SURPLUS_PAGE).unwrap_or(i64::MAX))
        .fetch_all(self.pool())
        .await?;
        let mut surplus = rows
            .iter()
            .map(|row| parse_column(&row.try_get::<String, _>("id")?, "runs.id"))
            .collect::<Result<Vec<RunId>, StoreError>>()?;
        surplus.reverse();
        Ok(surplus)
    }

    /// Asks a run to stop. A queued run is taken from the queue to be ended at once: leased
    /// to `holder` for `lease_ms` and flagged, for the caller to end it with its audit entry
    /// ([`CancelAsked::to_end`]); left alone, its lease runs out and a worker ends it, so no
    /// end is lost. A queued run asked before is a worker's to end already. A running run is
    /// flagged and its worker stops it; a parked one is flagged and queued, for a worker to
    /// end it. Its nested runs still going, however deep, are asked alike, even when the run
    /// itself has ended; of a finished run with none, nothing changes. The run and its tree
    /// are asked in one transaction, which reads them as it leaves them.
    pub async fn request_cancel(
        &self,
        project: ProjectId,
        id: RunId,
        holder: &str,
        lease_ms: i64,
    ) -> Result<CancelAsked, StoreError> {
        Ok(self
            .request_cancel_staged(project, id, holder, lease_ms, None)
            .await?
            .0)
    }

    /// [`Store::request_cancel`], staging `requested`, when given, the `run.cancel` entry made
    /// from what the cancel did, in the cancel's transaction when it asked anything: a cancel is
    /// never made without its entry on its way to the chain. The caller appends it with
    /// [`crate::AuditLog::append_staged`] before it ends the runs taken from the queue.
    pub async fn request_cancel_staged(
        &self,
        project: ProjectId,
        id: RunId,
        holder: &str,
        lease_ms: i64,
        requested: Option<&(dyn Fn(&CancelAsked) -> AuditEvent + Sync)>,
    ) -> Result<(CancelAsked, Option<StagedEvent>), StoreError> {
        let now = now_millis();
        // The run and its whole tree are asked in one transaction: a cancel that fails part
        // way has asked none of them, so asking again asks them all.
        let mut tx = self.begin_write().await?;
        let mut asked = vec![(
            id,
            cancel_one(&mut tx, project, id, holder, lease_ms, now).await?,
        )];
        // Its nested runs are cancelled with it, however deep, wherever they are driven: a
        // nested run does not go on for a parent nobody waits for.
        // Every child is looked under (an ended one may have a live child of its own); only
        // those still going are asked. Parent links form a tree, so each run is met once.
        let mut parents = vec![id];
        while let Some(parent) = parents.pop() {
            let children = sqlx::query(
                "SELECT id, status FROM runs WHERE project_id = $1 AND parent_run_id = $2",
            )
            .bind(project.to_string())
            .bind(parent.to_string())
            .fetch_all(&mut **tx)
            .await?;
            for child in children {
                let child_id: RunId = parse_column(&child.try_get::<String, _>("id")?, "runs.id")?;
                let status: RunStatus =
                    parse_column(&child.try_get::<String, _>("status")?, "runs.status")?;
                if !status.is_terminal() {
                    let what =
                        cancel_one(&mut tx, project, child_id, holder, lease_ms, now).await?;
                    asked.push((child_id, what));
                }
                parents.push(child_id);
            }
        }
        // Read as the cancel leaves them, before it commits: a cancel that happened is never
        // answered with an error of a read after it.
        let mut answer = CancelAsked {
            run: select_run(&mut **tx, project, id).await?,
            asked: 0,
            to_end: Vec::new(),
        };
        for (run, what) in asked {
            match what {
                Asked::Taken => {
                    answer.asked += 1;
                    let taken = if run == id {
                        answer.run.clone()
                    } else {
                        select_run(&mut **tx, project, run).await?
                    };
                    answer.to_end.push(taken);
                }
                Asked::Flagged => answer.asked += 1,
                Asked::Nothing => {}
            }
        }
        let staged = match requested {
            Some(requested) if answer.asked > 0 => {
                Some(crate::staged::stage_one(&mut tx, requested(&answer)).await?)
            }
            _ => None,
        };
        tx.commit().await?;
        Ok((answer, staged))
    }

    /// Puts runs whose worker stopped renewing its lease back in the queue, to be resumed.
    pub async fn requeue_expired_runs(&self) -> Result<u64, StoreError> {
        // The turn to write is held for the sweep too.
        let pool = self.write_pool().await?;
        let done = sqlx::query(
            "UPDATE runs SET status = 'queued', lease_owner = NULL, lease_expires_at = NULL, updated_at = $1 \
             WHERE status = 'running' AND lease_expires_at < $1",
        )
        .bind(now_millis())
        .execute(&*pool)
        .await?;
        // Their credentials, and any other left by a run no worker drives, end here.
        let mut connection = pool.acquire().await?;
        crate::run_tokens::sweep(&mut connection, self.backend).await?;
        Ok(done.rows_affected())
    }

    /// Gives back every run `worker` holds, for another worker (or this process after its
    /// restart) to resume at once rather than after the lease runs out.
    pub async fn release_leases(&self, worker: &str) -> Result<u64, StoreError> {
        let mut tx = self.begin_write().await?;
        let released = release_held(&mut tx, self.backend, worker, None, now_millis()).await?;
        tx.commit().await?;
        Ok(released)
    }

    /// Gives back run `run` if `worker` holds it, to be resumed from its steps by whoever
    /// claims it next; false when `worker` does not hold it (nothing changes).
    pub async fn release_run(&self, run: RunId, worker: &str) -> Result<bool, StoreError> {
        let mut tx = self.begin_write().await?;
        let released = release_held(&mut tx, self.backend, worker, Some(run), now_millis()).await?;
        tx.commit().await?;
        Ok(released == 1)
    }

    /// Claims the oldest queued run whose routine and project both have a free slot, leasing
    /// it to `worker`: [`Store::claim_runs`] for one run. A claimed run that does not read
    /// back is [`StoreError::Corrupt`], and stays leased to `worker` until its lease expires.
    pub async fn claim_run(
        &self,
        worker: &str,
        lease_ms: i64,
        max_per_project: u64,
    ) -> Result<Option<RunRecord>, StoreError> {
        let terms = ClaimTerms {
            worker,
            lease_ms,
            max_per_project,
        };
        let Claimed {
            mut runs,
            unreadable,
        } = self.claim_runs(terms, 1).await?;
        if let Some(unreadable) = unreadable.into_iter().next() {
            return Err(StoreError::Corrupt(format!(
                "claimed run {}: {}",
                unreadable.id, unreadable.reason
            )));
        }
        Ok(runs.pop())
    }

    /// Claims up to `max` of the oldest queued runs whose routine and project both have a
    /// free slot (at most `terms.max_per_project` running runs per project; a run waiting for
    /// approval holds no worker and does not count there, but does count against its
    /// routine's limit), leasing them to `terms.worker`, oldest first. A run recorded ahead of
    /// its slot is not claimed before it (`not_before`).
    ///
    /// One write transaction claims them all, each claim checking the limits as it is
    /// written, so they hold however many workers claim at once: every claim in the
    /// transaction sees the ones before it; on PostgreSQL the claims of a project take turns
    /// (an advisory lock per candidate project for the transaction, taken in the order of
    /// the projects' ids; two projects whose lock keys collide can still meet in a cycle,
    /// which PostgreSQL breaks by failing one claim, retried at the next look) and each sees
    /// the others' committed claims; SQLite has one writer at a time already.
    ///
    /// A claimed run whose row does not read as a run is claimed all the same and returned
    /// apart ([`Claimed::unreadable`]), for the claimer to end.
    pub async fn claim_runs(
        &self,
        terms: ClaimTerms<'_>,
        max: usize,
    ) -> Result<Claimed, StoreError> {
        let ClaimTerms {
            worker,
            lease_ms,
            max_per_project,
        } = terms;
        if max == 0 {
            return Ok(Claimed::default());
        }
        // Runs the limits turn away stay queued ahead of ones they allow: looking past them,
        // up to a bound, keeps one busy routine from holding up the rest of the queue.
        // Rounded up to a multiple of 16, so the statement, whose limit is written in its
        // text, takes few forms.
        let look_at = max
            .div_ceil(16)
            .saturating_add(1)
            .saturating_mul(16)
            .min(CLAIM_CANDIDATES_MAX);
        // The active runs of each routine and the running runs of each project are counted
        // once for the whole statement, not once for every queued run it looks at: with
        // correlated counts a claim cost the queue's length times the active runs. Only
        // routines with a queued run have their active runs counted, so a look at an empty
        // queue does not count every parked run.
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "WITH active AS (SELECT routine_id, COUNT(*) AS n FROM runs \
              WHERE status IN ('running', 'waiting_for_approval') \
              AND routine_id IN (SELECT routine_id FROM runs WHERE status = 'queued') \
              GROUP BY routine_id), \
             busy AS (SELECT project_id, COUNT(*) AS n FROM runs WHERE status = 'running' \
              GROUP BY project_id) \
             SELECT r.id, r.project_id, r.routine_id FROM runs r \
             LEFT JOIN active a ON a.routine_id = r.routine_id \
             LEFT JOIN busy b ON b.project_id = r.project_id \
             WHERE r.status = 'queued' AND (r.not_before IS NULL OR r.not_before <= $2) \
             AND COALESCE(a.n, 0) < r.max_concurrent \
             AND COALESCE(b.n, 0) < $1 ORDER BY r.id {}",
            crate::limit_clause(look_at as u64)
        )))
        .bind(to_i64(max_per_project))
        .bind(now_millis())
        .fetch_all(self.pool())
        .await?;
        if rows.is_empty() {
            return Ok(Claimed::default());
        }
        let mut candidates = Vec::with_capacity(rows.len());
        for row in rows {
            let project: ProjectId =
                parse_column(&row.try_get::<String, _>("project_id")?, "runs.project_id")?;
            let routine: String = row.try_get("routine_id")?;
            let id: RunId = parse_column(&row.try_get::<String, _>("id")?, "runs.id")?;
            candidates.push((project, routine, id));
        }
        let now = now_millis();
        let mut tx = self.begin_write().await?;
        let projects: Vec<ProjectId> = candidates.iter().map(|(project, _, _)| *project).collect();
        self.take_claim_locks(&mut tx, &projects).await?;
        let mut claimed: Vec<(ProjectId, RunId)> = Vec::with_capacity(max.min(candidates.len()));
        for (project, routine, id) in &candidates {
            let limits = ClaimLimits {
                routine,
                max_per_project,
            };
            if claim_in(&mut tx, *project, *id, worker, lease_ms, now, Some(limits)).await? {
                claimed.push((*project, *id));
                if claimed.len() == max {
                    break;
                }
            }
        }
        if claimed.is_empty() {
            tx.rollback().await?;
            return Ok(Claimed::default());
        }
        // Read back in the transaction, in one statement (at most `CLAIM_CANDIDATES_MAX`
        // runs), so no claim is committed that is not returned.
        let mut query = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM runs WHERE id IN ({})",
            crate::placeholders(1, claimed.len())
        )));
        for (_, id) in &claimed {
            query = query.bind(id.to_string());
        }
        // Each row read by its id as text, so a row that does not read as a run is still
        // told apart.
        let mut read = std::collections::HashMap::with_capacity(claimed.len());
        for row in query.fetch_all(&mut **tx).await? {
            let id: String = row.try_get("id")?;
            read.insert(id, run_from_row(&row));
        }
        let mut taken = Claimed::default();
        for (project, id) in claimed {
            match read.remove(&id.to_string()) {
                Some(Ok(run)) => taken.runs.push(run),
                Some(Err(error)) => taken.unreadable.push(UnreadableRun {
                    project,
                    id,
                    reason: error.to_string(),
                }),
                None => {
                    return Err(StoreError::Corrupt(format!(
                        "claimed run {id} does not read back"
                    )));
                }
            }
        }
        tx.commit().await?;
        Ok(taken)
    }

    /// On PostgreSQL, makes the claims of `projects` in `tx` take turns with every other
    /// claim of them: one advisory lock per project for the transaction, taken in the order
    /// of the projects' ids. SQLite has one writer at a time already.
    async fn take_claim_locks(
        &self,
        tx: &mut crate::WriteTx,
        projects: &[ProjectId],
    ) -> Result<(), StoreError> {
        if self.backend() != crate::Backend::Postgres {
            return Ok(());
        }
        let mut ids: Vec<String> = projects.iter().map(ToString::to_string).collect();
        ids.sort_unstable();
        ids.dedup();
        for id in ids {
            sqlx::query("SELECT pg_advisory_xact_lock(hashtext($1))")
                .bind(id)
                .execute(&mut ***tx)
                .await?;
        }
        Ok(())
    }

    /// Claims one queued run by id for `worker`, whatever the limits: a parent driving its
    /// nested run at once. Time spent parked is added to `parked_ms`.
    pub async fn claim_run_by_id(
        &self,
        project: ProjectId,
        id: RunId,
        worker: &str,
        lease_ms: i64,
    ) -> Result<Option<RunRecord>, StoreError> {
        let mut tx = self.begin_write().await?;
        if !claim_in(&mut tx, project, id, worker, lease_ms, now_millis(), None).await? {
            tx.rollback().await?;
            return Ok(None);
        }
        tx.commit().await?;
        self.get_run(project, id).await.map(Some)
    }

    /// The run a trigger key started, if any.
    pub async fn run_by_trigger_key(
        &self,
        project: ProjectId,
        routine: RoutineId,
        key: &str,
    ) -> Result<Option<RunRecord>, StoreError> {
        let row = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM runs WHERE project_id = $1 AND routine_id = $2 AND trigger_key = $3"
        )))
        .bind(project.to_string())
        .bind(routine.to_string())
        .bind(key)
        .fetch_optional(self.pool())
        .await?;
        row.as_ref().map(run_from_row).transpose()
    }

    /// Parks run `id`, which `worker` holds (under the claim whose credential is `claim`, for
    /// a remote worker), until its nested run `child` ends: it gives up its lease and waits as
    /// `waiting_for_approval`, and the end of `child` queues it again (`requeue_parent`).
    /// Unless `child` has ended already: its row is read in the same transaction, after an end
    /// being written to it has committed (on PostgreSQL the row is locked first, so that end
    /// is waited for; SQLite has one writer at a time), so no end can come between the read
    /// and the park and leave the run parked for good.
    pub async fn park_for_nested(
        &self,
        project: ProjectId,
        id: RunId,
        child: RunId,
        worker: &str,
        claim: Option<&str>,
    ) -> Result<NestedPark, StoreError> {
        let lock = match self.backend() {
            // Conflicts with the update an end makes, not with rows that refer to the run.
            crate::Backend::Postgres => " FOR NO KEY UPDATE",
            crate::Backend::Sqlite => "",
        };
        let mut tx = self.begin_write().await?;
        let status: Option<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT status FROM runs WHERE project_id = $1 AND id = $2{lock}"
        )))
        .bind(project.to_string())
        .bind(child.to_string())
        .fetch_optional(&mut **tx)
        .await?;
        let status: RunStatus = match status {
            Some(status) => parse_column(&status, "runs.status")?,
            None => return Err(StoreError::NotFound),
        };
        if status.is_terminal() {
            tx.rollback().await?;
            return Ok(NestedPark::ChildEnded);
        }
        let parked = park(&mut tx, project, id, worker, claim, false).await?;
        tx.commit().await?;
        Ok(if parked {
            NestedPark::Parked
        } else {
            NestedPark::NotHeld
        })
    }

    /// Extends `worker`'s lease; false when the lease was lost (the run must not go on here).
    pub async fn renew_lease(
        &self,
        run: RunId,
        worker: &str,
        lease_ms: i64,
    ) -> Result<bool, StoreError> {
        let now = now_millis();
        let done = sqlx::query(
            "UPDATE runs SET lease_expires_at = $1 WHERE id = $2 AND lease_owner = $3 AND status = 'running'",
        )
        .bind(now + lease_ms)
        .bind(run.to_string())
        .bind(worker)
        .execute(&*self.write_pool().await?)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    /// Up to `limit` runs whose announcements were due by `now` and are not yet queued, each
    /// taken for `grace_ms` (another process takes it after that, if it is still due): the
    /// process that parked or ended them stopped before it queued them, or failed to.
    pub async fn claim_due_announcements(
        &self,
        now: i64,
        grace_ms: i64,
        limit: u32,
    ) -> Result<Vec<RunRecord>, StoreError> {
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {COLUMNS}, announce_due_at FROM runs WHERE announce_due_at <= $1 \
             ORDER BY announce_due_at {}",
            crate::limit_clause(u64::from(limit))
        )))
        .bind(now)
        .fetch_all(self.pool())
        .await?;
        let mut claimed = Vec::with_capacity(rows.len());
        for row in &rows {
            let due: i64 = row.try_get("announce_due_at")?;
            let Ok(run) = run_from_row(row) else {
                // A row that does not read as a run was ended saying so; it announces nothing.
                let id: String = row.try_get("id")?;
                sqlx::query("UPDATE runs SET announce_due_at = NULL WHERE id = $1")
                    .bind(id)
                    .execute(&*self.write_pool().await?)
                    .await?;
                continue;
            };
            let taken = sqlx::query(
                "UPDATE runs SET announce_due_at = $1 WHERE id = $2 AND announce_due_at = $3",
            )
            .bind(now.saturating_add(grace_ms))
            .bind(run.id.to_string())
            .bind(due)
            .execute(&*self.write_pool().await?)
            .await?;
            if taken.rows_affected() == 1 {
                claimed.push(run);
            }
        }
        Ok(claimed)
    }

    /// Records that the announcements of each run's park or end are queued: for a run whose
    /// status is still the one noted, and whose announcements were made due no later than the
    /// note (a run that has moved on, or parked again, since keeps what its later move made
    /// due). One statement per status and 200 runs.
    pub async fn announced(&self, runs: &[AnnouncedRun]) -> Result<(), StoreError> {
        const PER_STATEMENT: usize = 200;
        let mut by_status: std::collections::BTreeMap<&str, Vec<&AnnouncedRun>> =
            Default::default();
        for run in runs {
            by_status.entry(run.status.as_str()).or_default().push(run);
        }
        for (status, runs) in by_status {
            for runs in runs.chunks(PER_STATEMENT) {
                let each = (0..runs.len())
                    .map(|n| {
                        format!(
                            "(id = ${} AND announce_due_at <= ${})",
                            2 + 2 * n,
                            3 + 2 * n
                        )
                    })
                    .collect::<Vec<_>>()
                    .join(" OR ");
                let mut query = sqlx::query(sqlx::AssertSqlSafe(format!(
                    "UPDATE runs SET announce_due_at = NULL WHERE status = $1 AND ({each})"
                )))
                .bind(status);
                for run in runs {
                    query = query
                        .bind(run.id.to_string())
                        .bind(run.noted_at.saturating_add(crate::ANNOUNCE_GRACE_MS));
                }
                query.execute(&*self.write_pool().await?).await?;
            }
        }
        Ok(())
    }

    pub async fn is_cancel_requested(&self, run: RunId) -> Result<bool, StoreError> {
        let row = sqlx::query("SELECT cancel_requested FROM runs WHERE id = $1")
            .bind(run.to_string())
            .fetch_one(self.pool())
            .await?;
        let flag: i64 = row.try_get("cancel_requested")?;
        Ok(flag != 0)
    }

    /// Records the usage of a run `worker` holds whose nested run ended while it was parked,
    /// and counts the nested run's `wall_ms` as the run's wall time: taken off its parked
    /// time, and off its live credential's expiry (its deadline).
    pub async fn record_nested_end(
        &self,
        run: RunId,
        worker: &str,
        usage: &BudgetUsage,
        wall_ms: i64,
    ) -> Result<(), StoreError> {
        let mut tx = self.begin_write().await?;
        if write_usage(&mut tx, run, worker, usage).await? && wall_ms > 0 {
            sqlx::query(
                "UPDATE runs SET parked_ms = CASE WHEN parked_ms > $1 THEN parked_ms - $1 \
                 ELSE 0 END WHERE id = $2 AND lease_owner = $3 AND status = 'running'",
            )
            .bind(wall_ms)
            .bind(run.to_string())
            .bind(worker)
            .execute(&mut **tx)
            .await?;
            sqlx::query("UPDATE run_tokens SET expires_at = expires_at - $1 WHERE run_id = $2")
                .bind(wall_ms)
                .bind(run.to_string())
                .execute(&mut **tx)
                .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// Records the run's usage so far.
    pub async fn save_usage(
        &self,
        run: RunId,
        worker: &str,
        usage: &BudgetUsage,
    ) -> Result<(), StoreError> {
        let pool = self.write_pool().await?;
        let mut connection = pool.acquire().await?;
        write_usage(&mut connection, run, worker, usage).await?;
        Ok(())
    }

    /// Appends a step and returns its sequence number.
    pub async fn append_run_step(
        &self,
        project: ProjectId,
        run: RunId,
        provenance: Provenance,
        step: &Step,
    ) -> Result<i64, StoreError> {
        let mut tx = self.begin_write().await?;
        let seq = append_step(&mut tx, project, run, provenance, step).await?;
        tx.commit().await?;
        Ok(seq)
    }

    /// The run's steps after `after_seq`, in order.
    pub async fn list_run_steps(
        &self,
        project: ProjectId,
        run: RunId,
        after_seq: i64,
    ) -> Result<Vec<RunStep>, StoreError> {
        self.select_run_steps(project, run, after_seq, None).await
    }

    /// The first `limit` steps of `run` after `after_seq`, in order: one page of a run read as
    /// it goes, so that a long run is read in bounded pieces.
    pub async fn list_run_steps_page(
        &self,
        project: ProjectId,
        run: RunId,
        after_seq: i64,
        limit: u16,
    ) -> Result<Vec<RunStep>, StoreError> {
        self.select_run_steps(project, run, after_seq, Some(limit))
            .await
    }

    /// The sequence number of `run`'s last step, 0 before its first.
    pub async fn last_run_step_seq(
        &self,
        project: ProjectId,
        run: RunId,
    ) -> Result<i64, StoreError> {
        last_step_seq(self.pool(), project, run).await
    }

    async fn select_run_steps(
        &self,
        project: ProjectId,
        run: RunId,
        after_seq: i64,
        limit: Option<u16>,
    ) -> Result<Vec<RunStep>, StoreError> {
        let limit = limit
            .map(|limit| crate::limit_clause(u64::from(limit)))
            .unwrap_or_default();
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT seq, kind, provenance, payload, created_at FROM run_steps \
             WHERE project_id = $1 AND run_id = $2 AND seq > $3 ORDER BY seq {limit}"
        )))
        .bind(project.to_string())
        .bind(run.to_string())
        .bind(after_seq)
        .fetch_all(self.pool())
        .await?;
        rows.iter().map(step_from_row).collect()
    }
}

/// Run `id` of `project`, read on `executor` (the pool, or a transaction that just wrote it).
pub(crate) async fn select_run<'c, E>(
    executor: E,
    project: ProjectId,
    id: RunId,
) -> Result<RunRecord, StoreError>
where
    E: sqlx::Executor<'c, Database = sqlx::Any>,
{
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM runs WHERE project_id = $1 AND id = $2"
    )))
    .bind(project.to_string())
    .bind(id.to_string())
    .fetch_optional(executor)
    .await?
    .ok_or(StoreError::NotFound)?;
    run_from_row(&row)
}

/// At most this many queued runs are looked at by one claim of several.
const CLAIM_CANDIDATES_MAX: usize = 256;

/// Claims queued run `id` for `worker` on `connection` (a write transaction), as of `now`.
/// With `limits`, only if its routine and project still have a free slot as the claim is
/// written. Time spent parked is
/// added to `parked_ms`. A credential minted under an earlier claim (whose lease expired) ends
/// with it; the new holder mints its own. False when the run was not claimable.
async fn claim_in(
    connection: &mut sqlx::AnyConnection,
    project: ProjectId,
    id: RunId,
    worker: &str,
    lease_ms: i64,
    now: i64,
    limits: Option<ClaimLimits<'_>>,
) -> Result<bool, StoreError> {
    let within_limits = if limits.is_some() {
        " AND (SELECT COUNT(*) FROM runs x WHERE x.routine_id = $6 \
         AND x.status IN ('running', 'waiting_for_approval')) < max_concurrent \
         AND (SELECT COUNT(*) FROM runs y WHERE y.project_id = $4 AND y.status = 'running') < $7"
    } else {
        ""
    };
    let sql = format!(
        "UPDATE runs SET status = 'running', lease_owner = $1, lease_expires_at = $2, \
         started_at = COALESCE(started_at, $3), updated_at = $3, \
         parked_ms = parked_ms + COALESCE($3 - parked_at, 0), parked_at = NULL \
         WHERE project_id = $4 AND id = $5 AND status = 'queued' \
         AND (not_before IS NULL OR not_before <= $3){within_limits}"
    );
    let mut query = sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(worker)
        .bind(now + lease_ms)
        .bind(now)
        .bind(project.to_string())
        .bind(id.to_string());
    if let Some(limits) = limits {
        query = query
            .bind(limits.routine.to_owned())
            .bind(to_i64(limits.max_per_project));
    }
    if query.execute(&mut *connection).await?.rows_affected() != 1 {
        return Ok(false);
    }
    crate::run_tokens::revoke(connection, id).await?;
    Ok(true)
}

fn step_from_row(row: &sqlx::any::AnyRow) -> Result<RunStep, StoreError> {
    let provenance: String = row.try_get("provenance")?;
    let kind: String = row.try_get("kind")?;
    let payload: String = row.try_get("payload")?;
    Ok(RunStep {
        seq: row.try_get("seq")?,
        provenance: parse_column(&provenance, "run_steps.provenance")?,
        step: Step::from_stored_text(&kind, &payload)
            .map_err(|e| StoreError::Corrupt(format!("run_steps: {e}")))?,
        created_at: row.try_get("created_at")?,
    })
}

impl Store {
    /// The runs of `ids` in `project`, by id, in one statement per 200: a page's runs read
    /// together. Runs of another project and unknown ids are absent.
    pub async fn get_runs(
        &self,
        project: ProjectId,
        ids: &[RunId],
    ) -> Result<std::collections::HashMap<RunId, RunRecord>, StoreError> {
        let rows = self
            .select_by_runs(project, ids, |places| {
                format!("SELECT {COLUMNS} FROM runs WHERE project_id = $1 AND id IN ({places})")
            })
            .await?;
        let mut runs = std::collections::HashMap::with_capacity(rows.len());
        for row in rows {
            let run = run_from_row(&row)?;
            runs.insert(run.id, run);
        }
        Ok(runs)
    }

    /// The rows `sql` selects for `runs` of `project`, by one statement per 200 runs: `sql` is
    /// given the placeholders the run ids are bound to (`$2, $3, …`; `$1` is the project).
    async fn select_by_runs(
        &self,
        project: ProjectId,
        runs: &[RunId],
        sql: impl Fn(&str) -> String,
    ) -> Result<Vec<sqlx::any::AnyRow>, StoreError> {
        const PER_STATEMENT: usize = 200;
        let mut rows = Vec::new();
        for chunk in runs.chunks(PER_STATEMENT) {
            let mut query = sqlx::query(sqlx::AssertSqlSafe(sql(&crate::placeholders(
                2,
                chunk.len(),
            ))))
            .bind(project.to_string());
            for run in chunk {
                query = query.bind(run.to_string());
            }
            rows.extend(query.fetch_all(self.pool()).await?);
        }
        Ok(rows)
    }

    /// The steps of `runs` that say what a held call came from: each run's input steps and its
    /// untrusted steps, in order, by run, in one statement per 200 runs. Model turns and tool
    /// calls, the bulk of a run's log, are not read.
    pub async fn input_and_untrusted_steps(
        &self,
        project: ProjectId,
        runs: &[RunId],
    ) -> Result<std::collections::HashMap<RunId, Vec<RunStep>>, StoreError> {
        let rows = self
            .select_by_runs(project, runs, |places| {
                format!(
                    "SELECT run_id, seq, kind, provenance, payload, created_at FROM run_steps \
                     WHERE project_id = $1 AND run_id IN ({places}) \
                     AND (kind = 'input' OR provenance = 'untrusted') ORDER BY run_id, seq"
                )
            })
            .await?;
        let mut steps: std::collections::HashMap<RunId, Vec<RunStep>> =
            std::collections::HashMap::with_capacity(runs.len());
        for row in rows {
            let run: RunId =
                parse_column(&row.try_get::<String, _>("run_id")?, "run_steps.run_id")?;
            steps.entry(run).or_default().push(step_from_row(&row)?);
        }
        Ok(steps)
    }

    /// The validated results of `runs` (routines with `[output] schema`): each run's last
    /// `output` step, by run. Runs of another project and runs without one are absent.
    pub async fn run_results(
        &self,
        project: ProjectId,
        runs: &[RunId],
    ) -> Result<std::collections::HashMap<RunId, serde_json::Value>, StoreError> {
        let rows = self
            .select_by_runs(project, runs, |places| {
                format!(
                    "SELECT run_id, seq, kind, provenance, payload, created_at FROM run_steps \
                     WHERE project_id = $1 AND kind = 'output' AND run_id IN ({places}) \
                     ORDER BY run_id, seq"
                )
            })
            .await?;
        let mut results = std::collections::HashMap::new();
        for row in rows {
            let run: RunId =
                parse_column(&row.try_get::<String, _>("run_id")?, "run_steps.run_id")?;
            if let Step::Output(output) = step_from_row(&row)?.step {
                results.insert(run, output.result);
            }
        }
        Ok(results)
    }
}

/// At most this many values are bound to one statement of a scheduler pass. SQLite finds the
/// name of a `$N` placeholder by a linear search, and sqlx asks it for every value it binds,
/// so binding a statement costs the square of its values: 200 runs' rows (4,000 values) took
/// 19 ms a statement, 20 rows (400 values) under half a millisecond. PostgreSQL binds in
/// linear time, and each statement is a round trip: it takes larger ones.
fn values_per_statement(backend: crate::Backend) -> usize {
    match backend {
        crate::Backend::Sqlite => 400,
        crate::Backend::Postgres => 4_000,
    }
}
/// The values of one run's row.
const RUN_VALUES: usize = 20;
/// The values of one step's row.
const STEP_VALUES: usize = 7;
/// The values of one schedule's advance (`triggers::advance_schedules`).
const ADVANCE_VALUES: usize = 3;

/// Inserts the runs of `starts` under `ids` (two statements: the runs, then their first
/// steps: the input, and the memory a run replays), skipping any whose trigger key already
/// started a run; returns the ids inserted. One run or a scheduler page alike.
async fn insert_runs(
    tx: &mut sqlx::Transaction<'_, sqlx::Any>,
    ids: &[RunId],
    starts: &[ScheduledStart],
    now: i64,
    values_per_statement: usize,
) -> Result<Vec<RunId>, StoreError> {
    if starts.is_empty() {
        return Ok(Vec::new());
    }
    let rows = crate::value_rows(1, starts.len(), RUN_VALUES);
    let sql = format!(
        "INSERT INTO runs (id, project_id, routine_id, routine_version, root_run_id, parent_run_id, depth, \
         status, trigger_kind, started_by, max_concurrent, outcome, created_at, updated_at, finished_at, \
         trigger_key, thread, budget_cap, started_by_member, not_before) VALUES {rows} ON CONFLICT DO NOTHING RETURNING id"
    );
    let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
    for (id, start) in ids.iter().zip(starts) {
        let new = &start.run;
        query = query
            .bind(id.to_string())
            .bind(start.project.to_string())
            .bind(new.routine_id.to_string())
            .bind(new.routine_version)
            .bind(new.parent.as_ref().map_or(*id, |p| p.root).to_string())
            .bind(new.parent.as_ref().map(|p| p.parent.to_string()))
            .bind(new.parent.as_ref().map_or(0, |p| p.depth))
            .bind(new.status.as_str())
            .bind(new.trigger_kind.as_str())
            .bind(new.started_by.map(|k| k.to_string()))
            .bind(to_i64(new.max_concurrent))
            .bind(new.outcome.clone())
            .bind(now)
            .bind(now)
            .bind(new.status.is_terminal().then_some(now))
            .bind(new.trigger_key.clone())
            .bind(new.thread.clone())
            .bind(new.parent.as_ref().map(|p| p.budget_cap.to_string()))
            .bind(new.started_by_member.map(|m| m.to_string()))
            .bind(start.not_before);
    }
    let inserted: std::collections::HashSet<RunId> = query
        .fetch_all(&mut **tx)
        .await?
        .iter()
        .map(|row| parse_column(&row.try_get::<String, _>("id")?, "runs.id"))
        .collect::<Result<_, StoreError>>()?;
    let mut steps = Vec::new();
    for (id, start) in ids.iter().zip(starts) {
        if !inserted.contains(id) {
            continue;
        }
        steps.push((
            *id,
            start.project,
            1_i64,
            start.run.input_provenance,
            Step::Input(start.input.clone()),
        ));
        if let Some((provenance, memory)) = &start.run.memory {
            steps.push((
                *id,
                start.project,
                2_i64,
                *provenance,
                Step::Memory(memory.clone()),
            ));
        }
    }
    let step_rows: Vec<StepRow<'_>> = steps
        .iter()
        .map(|(run, project, seq, provenance, step)| StepRow {
            run: *run,
            project: *project,
            seq: *seq,
            provenance: *provenance,
            step,
        })
        .collect();
    insert_steps(
        &mut **tx,
        &step_rows,
        now,
        values_per_statement / STEP_VALUES,
    )
    .await?;
    Ok(ids
        .iter()
        .copied()
        .filter(|id| inserted.contains(id))
        .collect())
}

/// Parks a run `worker` holds: status `waiting_for_approval`, lease released, `parked_at` set,
/// and, with `announce` (a park for a person), its announcements due (`announce_due_at`).
/// False when the worker no longer holds it.
pub(crate) async fn park(
    connection: &mut sqlx::AnyConnection,
    project: ProjectId,
    id: RunId,
    worker: &str,
    claim: Option<&str>,
    announce: bool,
) -> Result<bool, StoreError> {
    let now = now_millis();
    // A remote worker parks only under the claim whose credential it presents, before the
    // run's deadline and while no cancel was requested.
    let under_claim = if claim.is_some() {
        " AND cancel_requested = 0 AND EXISTS (SELECT 1 FROM run_tokens t \
         WHERE t.run_id = runs.id AND t.lease_owner = runs.lease_owner AND t.sha256 = $6 \
         AND t.expires_at > $1)"
    } else {
        ""
    };
    let mut query = sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE runs SET status = 'waiting_for_approval', lease_owner = NULL, lease_expires_at = NULL, \
         updated_at = $1, parked_at = $1, announce_due_at = COALESCE($5, announce_due_at) \
         WHERE project_id = $2 AND id = $3 AND lease_owner = $4 AND status = 'running'{under_claim}"
    )))
    .bind(now)
    .bind(project.to_string())
    .bind(id.to_string())
    .bind(worker)
    .bind(announce.then(|| now.saturating_add(crate::ANNOUNCE_GRACE_MS)));
    if let Some(credential) = claim {
        query = query.bind(sha256_hex(credential.as_bytes()));
    }
    let done = query.execute(&mut *connection).await?;
    if done.rows_affected() != 1 {
        return Ok(false);
    }
    crate::run_tokens::revoke(connection, id).await?;
    Ok(true)
}

/// Records the usage of a run `worker` holds; false when it does not hold it.
pub(crate) async fn write_usage(
    connection: &mut sqlx::AnyConnection,
    run: RunId,
    worker: &str,
    usage: &BudgetUsage,
) -> Result<bool, StoreError> {
    let done = sqlx::query(
        "UPDATE runs SET usage_turns = $1, usage_tool_calls = $2, usage_input_tokens = $3, \
         usage_output_tokens = $4, usage_cost_microdollars = $5, updated_at = $6 \
         WHERE id = $7 AND lease_owner = $8 AND status = 'running'",
    )
    .bind(to_i64(usage.turns))
    .bind(to_i64(usage.tool_calls))
    .bind(to_i64(usage.input_tokens))
    .bind(to_i64(usage.output_tokens))
    .bind(to_i64(usage.cost_microdollars))
    .bind(now_millis())
    .bind(run.to_string())
    .bind(worker)
    .execute(&mut *connection)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// The sequence number of `run`'s last step, 0 before its first, read on `executor`.
async fn last_step_seq<'c, E>(
    executor: E,
    project: ProjectId,
    run: RunId,
) -> Result<i64, StoreError>
where
    E: sqlx::Executor<'c, Database = sqlx::Any>,
{
    Ok(sqlx::query(
        "SELECT COALESCE(MAX(seq), 0) AS last FROM run_steps WHERE project_id = $1 AND run_id = $2",
    )
    .bind(project.to_string())
    .bind(run.to_string())
    .fetch_one(executor)
    .await?
    .try_get("last")?)
}

/// Appends a step after the run's last one, in `tx`; returns its sequence number.
pub(crate) async fn append_step(
    tx: &mut sqlx::Transaction<'_, sqlx::Any>,
    project: ProjectId,
    run: RunId,
    provenance: Provenance,
    step: &Step,
) -> Result<i64, StoreError> {
    let last = last_step_seq(&mut **tx, project, run).await?;
    let row = StepRow {
        run,
        project,
        seq: last + 1,
        provenance,
        step,
    };
    insert_steps(tx, &[row], now_millis(), 1).await?;
    Ok(last + 1)
}

/// Queues the parent of `child` again if it is parked waiting for it.
pub(crate) async fn requeue_parent(
    tx: &mut impl Exec,
    child: RunId,
    now: i64,
) -> Result<(), StoreError> {
    tx.execute(
        "UPDATE runs SET status = 'queued', updated_at = $1 WHERE status = 'waiting_for_approval' \
         AND id = (SELECT parent_run_id FROM runs WHERE id = $2)",
        vec![now.into(), child.to_string().into()],
    )
    .await?;
    Ok(())
}

/// One step of a run to insert: the run, its project, the step's number and provenance.
pub(crate) struct StepRow<'a> {
    pub run: RunId,
    pub project: ProjectId,
    pub seq: i64,
    pub provenance: Provenance,
    pub step: &'a Step,
}

/// The most steps one statement of a run's journal write inserts: far more than a write
/// holds, and within SQLite's default bound on a statement's values.
pub(crate) const STEPS_PER_WRITE_STATEMENT: usize = 50;

/// Inserts `rows`, all created at `now`, in `tx`: one statement for every `per_statement`
/// rows, so a write's steps, or a scheduler page's first steps, cost one round trip.
/// Sequence numbers are bound as BIGINT in every statement: PostgreSQL keeps the types a
/// statement was first prepared with on each connection.
pub(crate) async fn insert_steps(
    tx: &mut impl Exec,
    rows: &[StepRow<'_>],
    now: i64,
    per_statement: usize,
) -> Result<(), StoreError> {
    for chunk in rows.chunks(per_statement.max(1)) {
        let sql = format!(
            "INSERT INTO run_steps (run_id, seq, project_id, kind, provenance, payload, created_at) \
             VALUES {}",
            crate::value_rows(1, chunk.len(), STEP_VALUES)
        );
        let mut params = Vec::with_capacity(chunk.len() * STEP_VALUES);
        for row in chunk {
            let [kind, provenance, payload] = step_values(row.provenance, row.step)?;
            params.extend([
                row.run.to_string().into(),
                row.seq.into(),
                row.project.to_string().into(),
                kind,
                provenance,
                payload,
                now.into(),
            ]);
        }
        tx.execute(&sql, params).await?;
    }
    Ok(())
}

/// A step's `kind`, `provenance` and `payload` columns, as stored.
pub(crate) fn step_values(provenance: Provenance, step: &Step) -> Result<[Param; 3], StoreError> {
    let payload = step.to_stored_text().map_err(StoreError::StepEncoding)?;
    Ok([
        step.kind().as_str().into(),
        provenance.as_str().into(),
        payload.into(),
    ])
}

fn run_from_row(row: &sqlx::any::AnyRow) -> Result<RunRecord, StoreError> {
    let id: String = row.try_get("id")?;
    let project_id: String = row.try_get("project_id")?;
    let routine_id: String = row.try_get("routine_id")?;
    let root: String = row.try_get("root_run_id")?;
    let parent: Option<String> = row.try_get("parent_run_id")?;
    let status: String = row.try_get("status")?;
    let started_by: Option<String> = row.try_get("started_by")?;
    let started_by_member: Option<String> = row.try_get("started_by_member")?;
    let cancel: i64 = row.try_get("cancel_requested")?;
    Ok(RunRecord {
        id: parse_column(&id, "runs.id")?,
        project_id: parse_column(&project_id, "runs.project_id")?,
        routine_id: parse_column(&routine_id, "runs.routine_id")?,
        routine_version: row.try_get("routine_version")?,
        root_run_id: parse_column(&root, "runs.root_run_id")?,
        parent_run_id: parent
            .map(|p| parse_column(&p, "runs.parent_run_id"))
            .transpose()?,
        depth: row.try_get("depth")?,
        status: parse_column(&status, "runs.status")?,
        trigger_kind: parse_column(
            &row.try_get::<String, _>("trigger_kind")?,
            "runs.trigger_kind",
        )?,
        started_by: started_by
            .map(|k| parse_column(&k, "runs.started_by"))
            .transpose()?,
        started_by_member: started_by_member
            .map(|m| parse_column(&m, "runs.started_by_member"))
            .transpose()?,
        trigger_key: row.try_get("trigger_key")?,
        thread: row.try_get("thread")?,
        outcome: row.try_get("outcome")?,
        usage: BudgetUsage {
            turns: to_u64(row.try_get("usage_turns")?),
            tool_calls: to_u64(row.try_get("usage_tool_calls")?),
            input_tokens: to_u64(row.try_get("usage_input_tokens")?),
            output_tokens: to_u64(row.try_get("usage_output_tokens")?),
            cost_microdollars: to_u64(row.try_get("usage_cost_microdollars")?),
        },
        cancel_requested: cancel != 0,
        created_at: row.try_get("created_at")?,
        not_before: row.try_get("not_before")?,
        started_at: row.try_get("started_at")?,
        finished_at: row.try_get("finished_at")?,
        parked_ms: row.try_get("parked_ms")?,
        parked_at: row.try_get("parked_at")?,
        budget_cap: row
            .try_get::<Option<String>, _>("budget_cap")?
            .map(|text| {
                serde_json::from_str(&text)
                    .map_err(|_| StoreError::Corrupt("runs.budget_cap is not JSON".to_owned()))
            })
            .transpose()?,
    })
}

/// Puts the running runs `worker` holds (only `run`, when given) back in the queue and ends
/// their credentials, in `tx` (on `backend`). Returns how many.
pub(crate) async fn release_held(
    connection: &mut sqlx::AnyConnection,
    backend: crate::Backend,
    worker: &str,
    run: Option<RunId>,
    now: i64,
) -> Result<u64, StoreError> {
    let one = if run.is_some() { " AND id = $3" } else { "" };
    let sql = format!(
        "UPDATE runs SET status = 'queued', lease_owner = NULL, lease_expires_at = NULL, \
         updated_at = $1 WHERE lease_owner = $2 AND status = 'running'{one}"
    );
    let mut query = sqlx::query(sqlx::AssertSqlSafe(sql)).bind(now).bind(worker);
    if let Some(run) = run {
        query = query.bind(run.to_string());
    }
    let done = query.execute(&mut *connection).await?;
    crate::run_tokens::sweep(connection, backend).await?;
    Ok(done.rows_affected())
}

/// The outcome of a run that a cancel took from the queue and ended, before any worker had it.
pub const CANCELLED_WHILE_QUEUED: &str = "cancelled while queued";

/// What a cancel did ([`Store::request_cancel`]).
#[derive(Debug, Clone)]
pub struct CancelAsked {
    /// The run named, as the cancel left it.
    pub run: RunRecord,
    /// How many runs it asked to stop: the run and its nested runs that were still going and
    /// not asked before. None for a run that had ended with nothing under it still going.
    pub asked: u64,
    /// The runs it took from the queue, as it left them: leased to its holder and flagged,
    /// for the holder to end ([`CANCELLED_WHILE_QUEUED`]) with their audit entries. The run
    /// named comes first when it is one.
    pub to_end: Vec<RunRecord>,
}

/// What a cancel did to one run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Asked {
    /// Took it from the queue, to be ended by the cancel's holder.
    Taken,
    /// Flagged it for its worker (or queued it, flagged, from its park).
    Flagged,
    /// Nothing: it had ended, or was asked before.
    Nothing,
}

/// Asks run `id` alone to stop, in `tx` ([`Store::request_cancel`]).
async fn cancel_one(
    tx: &mut crate::WriteTx,
    project: ProjectId,
    id: RunId,
    holder: &str,
    lease_ms: i64,
    now: i64,
) -> Result<Asked, StoreError> {
    // A queued run flagged already (parked, or left by a worker, when it was asked) is a
    // worker's to end, as its pending approvals and steps are: asked again, it stays so.
    let taken = sqlx::query(
        "UPDATE runs SET status = 'running', lease_owner = $4, lease_expires_at = $5, \
         cancel_requested = 1, updated_at = $1 \
         WHERE project_id = $2 AND id = $3 AND status = 'queued' AND cancel_requested = 0",
    )
    .bind(now)
    .bind(project.to_string())
    .bind(id.to_string())
    .bind(holder)
    .bind(now.saturating_add(lease_ms))
    .execute(&mut ***tx)
    .await?;
    if taken.rows_affected() == 1 {
        return Ok(Asked::Taken);
    }
    // A parked run has no worker: it goes back in the queue, flagged, for one to end it,
    // flagged already or not (a cancel may land as it parks). A running run flagged already
    // is left as it is.
    let flagged = sqlx::query(
        "UPDATE runs SET cancel_requested = 1, updated_at = $1, \
         status = CASE WHEN status = 'waiting_for_approval' THEN 'queued' ELSE status END \
         WHERE project_id = $2 AND id = $3 \
         AND (status = 'waiting_for_approval' OR (status = 'running' AND cancel_requested = 0))",
    )
    .bind(now)
    .bind(project.to_string())
    .bind(id.to_string())
    .execute(&mut ***tx)
    .await?;
    Ok(if flagged.rows_affected() == 1 {
        Asked::Flagged
    } else {
        Asked::Nothing
    })
}

/// How many runs of `routine` are active, counted up to `up_to`.
/// How many surplus runs [`Store::surplus_active_runs`] answers at most.
pub const SURPLUS_PAGE: usize = 100;

/// What a run skipped by its routine's overlap policy ends with.
pub fn skipped_outcome(active: u64, max: u64) -> String {
    format!("skipped: {active} run(s) of this routine active, at most {max}")
}

/// Counts the routine's active runs, up to `up_to`, in `tx`, after taking the routine's row
/// on PostgreSQL (SQLite's write transaction holds the whole database), so that no other start
/// counts them until `tx` ends.
async fn count_active_locked(
    tx: &mut crate::WriteTx,
    backend: crate::Backend,
    project: ProjectId,
    routine: RoutineId,
    up_to: u64,
) -> Result<u64, StoreError> {
    if backend == crate::Backend::Postgres {
        sqlx::query("SELECT id FROM routines WHERE id = $1 AND project_id = $2 FOR UPDATE")
            .bind(routine.to_string())
            .bind(project.to_string())
            .execute(&mut ***tx)
            .await?;
    }
    count_active(&mut ***tx, project, routine, up_to).await
}

/// Marks skipped, in `tx`, the queued `starts` a `skip` overlap policy may yet pass over
/// (`skip_at`) that find their routine full: its active runs counted again, with those of
/// `starts` queued before them. Routines are taken in the order of their ids, so two passes
/// never wait for each other's rows.
async fn skip_the_full(
    tx: &mut crate::WriteTx,
    backend: crate::Backend,
    starts: &mut [ScheduledStart],
) -> Result<(), StoreError> {
    let skippable = |start: &ScheduledStart| {
        start
            .run
            .skip_at
            .filter(|_| start.run.status == RunStatus::Queued)
    };
    let mut routines = std::collections::BTreeMap::new();
    for start in starts.iter() {
        if let Some(max) = skippable(start) {
            routines.insert(start.run.routine_id, (start.project, max));
        }
    }
    for (routine, (project, max)) in routines {
        let mut active = count_active_locked(tx, backend, project, routine, max).await?;
        for start in starts.iter_mut() {
            if start.run.routine_id != routine || skippable(start).is_none() {
                continue;
            }
            if active >= max {
                start.run.status = RunStatus::Skipped;
                start.run.outcome = Some(skipped_outcome(active, max));
                start.run.skip_at = None;
            } else {
                active = active.saturating_add(1);
            }
        }
    }
    Ok(())
}

async fn count_active<'e>(
    executor: impl sqlx::Executor<'e, Database = sqlx::Any>,
    project: ProjectId,
    routine: RoutineId,
    up_to: u64,
) -> Result<u64, StoreError> {
    // The limit stays bound: it is a routine's own `max_runs`, whose every value would be a
    // statement of its own in each connection's cache.
    let row = sqlx::query(
        "SELECT COUNT(*) AS n FROM (SELECT 1 AS one FROM runs WHERE routine_id = $1 \
         AND project_id = $2 AND status IN ('queued', 'running', 'waiting_for_approval') \
         LIMIT $3) AS active",
    )
    .bind(routine.to_string())
    .bind(project.to_string())
    .bind(to_i64(up_to))
    .fetch_one(executor)
    .await?;
    Ok(to_u64(row.try_get("n")?))
}
