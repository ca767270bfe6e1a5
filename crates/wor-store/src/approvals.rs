//! Approvals: durable requests for a person's decision on one exact tool call, and the project
//! policy that decides which calls need one.
//!
//! INVARIANTS: a run is parked (status `waiting_for_approval`, no lease) in the same
//! transaction that records its approval request, and re-queued in the same transaction that
//! records the decision or the expiry, so a parked run is never lost and never resumed twice.
//! An approved approval is used at most once, and only by a call with the same binding hash,
//! in the same transaction that records the call as started (its `approval_used` step): an
//! approval is never spent without its call on record, so a resumed run never finds a used
//! approval whose call did not start. A call whose outcome is unknown may be asked about
//! again after its approved retry was interrupted too: each request is a row of its own,
//! and at most one unused request exists per call and kind.

use std::fmt;
use std::str::FromStr;

use sqlx::Row;
use wor_core::audit::AuditEvent;
use wor_core::budget::BudgetUsage;
use wor_core::canonical::sha256_hex;
use wor_core::run::Provenance;
use wor_core::step::Step;
use wor_core::{ApiKeyId, ApprovalId, MemberId, ProjectId, RunId};

use crate::staged::StagedEvent;
use crate::{Store, StoreError, now_millis, parse_column};

/// Where an approval stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ApprovalStatus {
    /// Waiting for a person.
    Pending,
    Approved,
    Denied,
    /// Nobody decided before it expired: treated as denied.
    Expired,
    /// Its run ended (cancelled) before anyone decided.
    Cancelled,
}

impl ApprovalStatus {
    pub const ALL: [ApprovalStatus; 5] = [
        ApprovalStatus::Pending,
        ApprovalStatus::Approved,
        ApprovalStatus::Denied,
        ApprovalStatus::Expired,
        ApprovalStatus::Cancelled,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ApprovalStatus::Pending => "pending",
            ApprovalStatus::Approved => "approved",
            ApprovalStatus::Denied => "denied",
            ApprovalStatus::Expired => "expired",
            ApprovalStatus::Cancelled => "cancelled",
        }
    }
}

impl fmt::Display for ApprovalStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for ApprovalStatus {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ApprovalStatus::ALL
            .into_iter()
            .find(|status| status.as_str() == s)
            .ok_or_else(|| {
                format!(
                    "`{}` is not an approval status: expected pending, approved, denied, expired or cancelled",
                    wor_core::quote::excerpt(s, 40)
                )
            })
    }
}

/// Why the call needs a person.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ApprovalKind {
    /// Policy answered `confirm`.
    Policy,
    /// The call started before its run was interrupted and its outcome is unknown: approving
    /// runs it again, denying tells the model the outcome is unknown.
    OutcomeUnknown,
}

impl ApprovalKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ApprovalKind::Policy => "policy",
            ApprovalKind::OutcomeUnknown => "outcome_unknown",
        }
    }
}

impl FromStr for ApprovalKind {
    type Err = ();
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "policy" => Ok(ApprovalKind::Policy),
            "outcome_unknown" => Ok(ApprovalKind::OutcomeUnknown),
            _ => Err(()),
        }
    }
}

/// A request for approval, as the engine files it when it parks a run.
#[derive(Debug, Clone)]
pub struct NewApproval {
    pub run_id: RunId,
    pub call_id: String,
    /// `CONNECTION/TOOL`.
    pub tool: String,
    pub pin_hash: String,
    /// The canonical arguments (pinned ones included), redacted.
    pub arguments: serde_json::Value,
    pub arguments_hash: String,
    pub pinned_keys: Vec<String>,
    pub binding_hash: String,
    pub kind: ApprovalKind,
    /// Why: the determining policies, their reasons and the untrusted sources in context.
    pub why: serde_json::Value,
    pub expires_at: i64,
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct ApprovalRecord {
    pub id: ApprovalId,
    pub project_id: ProjectId,
    pub run_id: RunId,
    pub call_id: String,
    pub tool: String,
    pub pin_hash: String,
    pub arguments: serde_json::Value,
    pub arguments_hash: String,
    pub pinned_keys: Vec<String>,
    pub binding_hash: String,
    pub kind: ApprovalKind,
    pub why: serde_json::Value,
    pub status: ApprovalStatus,
    pub requested_at: i64,
    pub expires_at: i64,
    pub decided_by_key: Option<ApiKeyId>,
    pub decided_by_member: Option<MemberId>,
    pub decision_reason: Option<String>,
    pub decided_at: Option<i64>,
    pub used_at: Option<i64>,
    /// The arguments an approver corrected the call to before approving it (canonical,
    /// pinned ones unchanged); `binding_hash` is then the edited call's.
    pub edited_arguments: Option<serde_json::Value>,
}

impl ApprovalRecord {
    /// The arguments the tool receives: the edited call's once an approver edited it, else
    /// the model's.
    pub fn arguments_sent(&self) -> &serde_json::Value {
        self.edited_arguments.as_ref().unwrap_or(&self.arguments)
    }

    /// Whether an approver's edit set argument `name` to `value`, where the model asked for
    /// something else (or nothing).
    pub fn edited_to(&self, name: &str, value: &serde_json::Value) -> bool {
        self.edited_arguments.is_some() && self.arguments.get(name) != Some(value)
    }
}

/// An approver's correction of a held call: the arguments it runs with instead, and the
/// binding hash of the call with them.
#[derive(Debug, Clone)]
pub struct ApprovalEdit {
    pub arguments: serde_json::Value,
    pub binding_hash: String,
}

/// A call a person approved, as it starts: the approval it uses, the binding hash of the call
/// as it is about to run, what its `approval_used` step records, and the run's usage with the
/// call counted.
#[derive(Debug, Clone, Copy)]
pub struct ApprovedCall<'a> {
    pub approval: ApprovalId,
    pub binding_hash: &'a str,
    pub step: &'a Step,
    pub usage: &'a BudgetUsage,
    /// For a remote worker, its claim: the call starts only under it.
    pub claim: Option<ApprovedClaim<'a>>,
}

/// The claim of a remote worker an approved call starts under: the claim's credential, which
/// must still be live, and the run's usage the worker counted the call from, which must not
/// have changed since.
#[derive(Debug, Clone, Copy)]
pub struct ApprovedClaim<'a> {
    pub credential: &'a str,
    pub usage_before: &'a BudgetUsage,
}

/// What came of starting an approved call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApprovedStart {
    /// The approval is used, the call recorded as started and the usage saved: it may run.
    Started,
    /// The worker no longer holds the run; nothing changed.
    RunNotHeld,
    /// The approval is not approved, already used, or bound to another call; nothing changed.
    NotUsable,
    /// A cancel of the run was requested; nothing changed.
    CancelRequested,
}

/// A person's answer to an approval request (the call's own verdict, by policy, is
/// `wor_core::call::Verdict`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApprovalAnswer {
    Approve,
    Deny,
}

/// Who decided, and why.
#[derive(Debug, Clone)]
pub struct ApprovalDecision {
    pub verdict: ApprovalAnswer,
    /// The API key used; `None` for a decision made in the console.
    pub key_id: Option<ApiKeyId>,
    pub member_id: Option<MemberId>,
    pub reason: String,
}

/// Why a decision was not recorded.
#[derive(Debug, thiserror::Error)]
pub enum DecideError {
    #[error("not found")]
    NotFound,
    #[error("the approval is already {0}")]
    NotPending(ApprovalStatus),
    #[error("the approval expired before it was decided")]
    Expired,
    /// Its run was asked to cancel; the approval is cancelled with the run.
    #[error("the approval's run was cancelled")]
    RunCancelled,
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl From<sqlx::Error> for DecideError {
    fn from(error: sqlx::Error) -> Self {
        DecideError::Store(StoreError::Database(error))
    }
}

/// Filters and page of an approval listing, newest first.
#[derive(Debug, Clone, Default)]
pub struct ApprovalFilter {
    pub status: Option<ApprovalStatus>,
    pub run_id: Option<RunId>,
    /// Only approvals older than this one (the previous page's last id).
    pub before: Option<ApprovalId>,
    pub limit: u32,
}

/// A project's own policy text.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ProjectPolicyRecord {
    pub text: String,
    pub updated_by: Option<ApiKeyId>,
    pub updated_at: i64,
}

const COLUMNS: &str = "id, project_id, run_id, call_id, tool, pin_hash, arguments, arguments_hash, \
    pinned_keys, binding_hash, kind, why, status, requested_at, expires_at, decided_by_key, \
    decided_by_member, decision_reason, decided_at, used_at, edited_arguments";

impl Store {
    /// Files `approval` and parks its run, which `worker` holds: the run gives up its lease and
    /// waits with status `waiting_for_approval`. A request of the same kind for the same call
    /// filed before is kept as it is. Returns the approval's id and whether it was filed now,
    /// or `None` when the worker no longer holds the run (nothing changed).
    pub async fn park_for_approval(
        &self,
        project: ProjectId,
        worker: &str,
        approval: &NewApproval,
    ) -> Result<Option<(ApprovalId, bool)>, StoreError> {
        let parked = self
            .park_filing(project, worker, None, approval, None)
            .await?;
        Ok(parked.map(|(id, created, _)| (id, created)))
    }

    /// [`Store::park_for_approval`] (the approval's id and whether it was filed now), for remote
    /// worker `worker` only under the claim whose credential is `claim`, when given (a stale driver
    /// of an earlier claim parks nothing), staging `recorded` (from the new approval's id), its
    /// `approval.request` entry, in the same transaction (`crate::staged`) when the approval is
    /// filed now (a request filed before stages nothing), and after it `also`, when given, whenever
    /// the run parks.
    pub async fn park_for_approval_staged(
        &self,
        project: ProjectId,
        worker: &str,
        claim: Option<&str>,
        approval: &NewApproval,
        recorded: &(dyn Fn(ApprovalId) -> AuditEvent + Sync),
        also: Option<AuditEvent>,
    ) -> Result<Option<(ApprovalId, bool, Vec<StagedEvent>)>, StoreError> {
        self.park_filing(
            project,
            worker,
            claim,
            approval,
            Some(ParkEntries { recorded, also }),
        )
        .await
    }

    async fn park_filing(
        &self,
        project: ProjectId,
        worker: &str,
        claim: Option<&str>,
        approval: &NewApproval,
        entries: Option<ParkEntries<'_>>,
    ) -> Result<Option<(ApprovalId, bool, Vec<StagedEvent>)>, StoreError> {
        let now = now_millis();
        let mut tx = self.begin_write().await?;
        if !crate::runs::park(&mut tx, project, approval.run_id, worker, claim, true).await? {
            tx.rollback().await?;
            return Ok(None);
        }
        let existing = sqlx::query(
            "SELECT id, status, used_at FROM approvals WHERE run_id = $1 AND call_id = $2 AND kind = $3 \
             ORDER BY id DESC LIMIT 1",
        )
        .bind(approval.run_id.to_string())
        .bind(&approval.call_id)
        .bind(approval.kind.as_str())
        .fetch_optional(&mut **tx)
        .await?;
        // A used approval was spent on an attempt that started: the call may be asked about
        // again (its outcome is unknown once more), with a request of its own.
        let existing = match existing {
            Some(row) if row.try_get::<Option<i64>, _>("used_at")?.is_some() => None,
            other => other,
        };
        let parked = match existing {
            // Parking again on a decided approval would wait for nothing: refuse instead.
            Some(row) if row.try_get::<String, _>("status")? != "pending" => {
                tx.rollback().await?;
                return Err(StoreError::Conflict(format!(
                    "the approval for call `{}` was already decided",
                    approval.call_id
                )));
            }
            Some(row) => (
                parse_column(&row.try_get::<String, _>("id")?, "approvals.id")?,
                false,
            ),
            None => {
                let id = ApprovalId::new();
                sqlx::query(
                    "INSERT INTO approvals (id, project_id, run_id, call_id, tool, pin_hash, arguments, \
                     arguments_hash, pinned_keys, binding_hash, kind, why, status, requested_at, expires_at) \
                     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, 'pending', $13, $14)",
                )
                .bind(id.to_string())
                .bind(project.to_string())
                .bind(approval.run_id.to_string())
                .bind(&approval.call_id)
                .bind(&approval.tool)
                .bind(&approval.pin_hash)
                .bind(approval.arguments.to_string())
                .bind(&approval.arguments_hash)
                .bind(serde_json::Value::from(approval.pinned_keys.clone()).to_string())
                .bind(&approval.binding_hash)
                .bind(approval.kind.as_str())
                .bind(approval.why.to_string())
                .bind(now)
                .bind(approval.expires_at)
                .execute(&mut **tx)
                .await?;
                (id, true)
            }
        };
        let (id, created) = parked;
        let events = match entries {
            Some(ParkEntries { recorded, also }) => created
                .then(|| recorded(id))
                .into_iter()
                .chain(also)
                .collect(),
            None => Vec::new(),
        };
        let staged = crate::staged::stage(&mut tx, events).await?;
        tx.commit().await?;
        Ok(Some((id, created, staged)))
    }

    pub async fn get_approval(
        &self,
        project: ProjectId,
        id: ApprovalId,
    ) -> Result<ApprovalRecord, StoreError> {
        select_approval(self.pool(), project, id).await
    }

    /// The latest approval of `kind` filed for `call_id` of `run`, if any.
    pub async fn approval_for_call(
        &self,
        project: ProjectId,
        run: RunId,
        call_id: &str,
        kind: ApprovalKind,
    ) -> Result<Option<ApprovalRecord>, StoreError> {
        let row = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM approvals WHERE project_id = $1 AND run_id = $2 AND call_id = $3 AND kind = $4 \
             ORDER BY id DESC LIMIT 1"
        )))
        .bind(project.to_string())
        .bind(run.to_string())
        .bind(call_id)
        .bind(kind.as_str())
        .fetch_optional(self.pool())
        .await?;
        row.as_ref().map(approval_from_row).transpose()
    }

    pub async fn list_approvals(
        &self,
        project: ProjectId,
        filter: &ApprovalFilter,
    ) -> Result<Vec<ApprovalRecord>, StoreError> {
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM approvals WHERE project_id = $1 \
             AND ($2 IS NULL OR status = $2) AND ($3 IS NULL OR run_id = $3) AND ($4 IS NULL OR id < $4) \
             ORDER BY id DESC LIMIT $5"
        )))
        .bind(project.to_string())
        .bind(filter.status.map(|s| s.as_str()))
        .bind(filter.run_id.map(|r| r.to_string()))
        .bind(filter.before.map(|b| b.to_string()))
        .bind(i64::from(filter.limit))
        .fetch_all(self.pool())
        .await?;
        rows.iter().map(approval_from_row).collect()
    }

    /// Records a person's decision on a pending, unexpired approval and puts its run back in
    /// the queue, in one transaction. Who may decide is the caller's check.
    pub async fn decide_approval(
        &self,
        project: ProjectId,
        id: ApprovalId,
        decision: &ApprovalDecision,
    ) -> Result<ApprovalRecord, DecideError> {
        Ok(self
            .decide_approval_staged(project, id, decision, None, None)
            .await?
            .0)
    }

    /// [`Self::decide_approval`] for an approval of a corrected call: the edit is recorded and
    /// the approval bound to the edited call in the same statement as the decision.
    pub async fn decide_approval_edited(
        &self,
        project: ProjectId,
        id: ApprovalId,
        decision: &ApprovalDecision,
        edit: &ApprovalEdit,
    ) -> Result<ApprovalRecord, DecideError> {
        Ok(self
            .decide_approval_staged(project, id, decision, Some(edit), None)
            .await?
            .0)
    }

    /// [`Self::decide_approval`], or with `edit` [`Self::decide_approval_edited`], staging
    /// `decided`, when given, the decision's `approval.decide` entry made from the approval as
    /// decided, in the decision's transaction: a call is never approved without its entry on its
    /// way to the chain. The caller appends it with [`crate::AuditLog::append_staged`].
    pub async fn decide_approval_staged(
        &self,
        project: ProjectId,
        id: ApprovalId,
        decision: &ApprovalDecision,
        edit: Option<&ApprovalEdit>,
        decided: Option<&(dyn Fn(&ApprovalRecord) -> AuditEvent + Sync)>,
    ) -> Result<(ApprovalRecord, Option<StagedEvent>), DecideError> {
        let now = now_millis();
        let status = match decision.verdict {
            ApprovalAnswer::Approve => ApprovalStatus::Approved,
            ApprovalAnswer::Deny => ApprovalStatus::Denied,
        };
        let mut tx = self.begin_write().await?;
        let done = sqlx::query(
            "UPDATE approvals SET status = $1, decided_by_key = $2, decided_by_member = $3, \
             decision_reason = $4, decided_at = $5, edited_arguments = $8, \
             binding_hash = COALESCE($9, binding_hash) \
             WHERE project_id = $6 AND id = $7 AND status = 'pending' AND expires_at > $5 \
             AND edited_arguments IS NULL AND NOT EXISTS (SELECT 1 FROM runs \
             WHERE runs.id = approvals.run_id AND runs.cancel_requested <> 0)",
        )
        .bind(status.as_str())
        .bind(decision.key_id.map(|k| k.to_string()))
        .bind(decision.member_id.map(|m| m.to_string()))
        .bind(&decision.reason)
        .bind(now)
        .bind(project.to_string())
        .bind(id.to_string())
        .bind(edit.map(|e| e.arguments.to_string()))
        .bind(edit.map(|e| e.binding_hash.clone()))
        .execute(&mut **tx)
        .await?;
        if done.rows_affected() != 1 {
            tx.rollback().await?;
            let current = match self.get_approval(project, id).await {
                Ok(current) => current,
                Err(StoreError::NotFound) => return Err(DecideError::NotFound),
                Err(other) => return Err(other.into()),
            };
            if current.status != ApprovalStatus::Pending {
                return Err(DecideError::NotPending(current.status));
            }
            // Pending still: expired, or its run's cancel has not ended it yet.
            let cancelled = self.is_cancel_requested(current.run_id).await?;
            return Err(if cancelled {
                DecideError::RunCancelled
            } else {
                DecideError::Expired
            });
        }
        requeue_parked(&mut tx, project, id, now).await?;
        // Read as the decision leaves it, before it commits: a decision made is never answered
        // with an error of a read after it.
        let approval = select_approval(&mut **tx, project, id).await?;
        let staged = match decided {
            Some(decided) => Some(crate::staged::stage_one(&mut tx, decided(&approval)).await?),
            None => None,
        };
        tx.commit().await?;
        Ok((approval, staged))
    }

    /// How many approvals wait for a decision across every project, and when the oldest was
    /// requested (milliseconds): the operator's backlog, with no project's detail.
    pub async fn pending_approval_backlog(&self) -> Result<(i64, Option<i64>), StoreError> {
        let row: (i64, Option<i64>) = sqlx::query_as(
            "SELECT COUNT(*), MIN(requested_at) FROM approvals WHERE status = 'pending'",
        )
        .fetch_one(self.pool())
        .await?;
        Ok(row)
    }

    /// Marks every pending approval whose time ran out as expired and puts its run back in the
    /// queue (to continue with a denial or fail, as its routine says). Returns them, each with
    /// its `recorded` entry (from the approval as expired and its run), staged in the same
    /// transaction (`crate::staged`) for the caller to append.
    pub async fn expire_approvals(
        &self,
        recorded: &(dyn Fn(&ApprovalRecord, &crate::RunRecord) -> AuditEvent + Sync),
    ) -> Result<Vec<(ApprovalRecord, StagedEvent)>, StoreError> {
        let now = now_millis();
        let due = sqlx::query(
            "SELECT id, project_id FROM approvals WHERE status = 'pending' AND expires_at <= $1 \
             ORDER BY id LIMIT 100",
        )
        .bind(now)
        .fetch_all(self.pool())
        .await?;
        let mut expired = Vec::with_capacity(due.len());
        let mut failed = None;
        for row in due {
            match self.expire_one(&row, now, recorded).await {
                Ok(Some(done)) => expired.push(done),
                Ok(None) => {}
                // One approval that cannot be expired holds up no other; the next sweep meets it
                // again.
                Err(error) => {
                    tracing::warn!(
                        category = "approval",
                        kind = error.kind(),
                        "an approval could not be expired; the next sweep tries it again"
                    );
                    failed.get_or_insert(error);
                }
            }
        }
        // What expired is committed, its entries staged: it is returned, to be announced, even
        // when another failed; a sweep that expired nothing answers with its first failure.
        match failed {
            Some(error) if expired.is_empty() => Err(error),
            _ => Ok(expired),
        }
    }

    /// Expires the approval `row` names, if still pending, in a transaction of its own.
    async fn expire_one(
        &self,
        row: &sqlx::any::AnyRow,
        now: i64,
        recorded: &(dyn Fn(&ApprovalRecord, &crate::RunRecord) -> AuditEvent + Sync),
    ) -> Result<Option<(ApprovalRecord, StagedEvent)>, StoreError> {
        let id: ApprovalId = parse_column(&row.try_get::<String, _>("id")?, "approvals.id")?;
        let project: ProjectId = parse_column(
            &row.try_get::<String, _>("project_id")?,
            "approvals.project_id",
        )?;
        let mut tx = self.begin_write().await?;
        let done = sqlx::query(
            "UPDATE approvals SET status = 'expired', decided_at = $1 \
             WHERE id = $2 AND status = 'pending'",
        )
        .bind(now)
        .bind(id.to_string())
        .execute(&mut **tx)
        .await?;
        if done.rows_affected() != 1 {
            tx.rollback().await?;
            return Ok(None);
        }
        requeue_parked(&mut tx, project, id, now).await?;
        let approval = select_approval(&mut **tx, project, id).await?;
        let run = crate::runs::select_run(&mut **tx, project, approval.run_id).await?;
        let staged = crate::staged::stage_one(&mut tx, recorded(&approval, &run)).await?;
        tx.commit().await?;
        Ok(Some((approval, staged)))
    }

    /// Starts a call a person approved, in one transaction: uses the approval (approved,
    /// unused, of this run, bound to `call.binding_hash`), records the call as started (an
    /// `approval_used` step with `call.step`) and saves the run's usage, only while `worker`
    /// holds the run. An approval is used once; if anything fails, none of it happened.
    pub async fn start_approved_call(
        &self,
        project: ProjectId,
        run: RunId,
        worker: &str,
        call: &ApprovedCall<'_>,
    ) -> Result<ApprovedStart, StoreError> {
        let (started, _) = self
            .start_approved_call_staged(project, run, worker, call, None)
            .await?;
        Ok(started)
    }

    /// [`Store::start_approved_call`], staging `recorded`, when given, its `approval.use` entry, in
    /// the same transaction (`crate::staged`) when the call starts; staged only then.
    pub async fn start_approved_call_staged(
        &self,
        project: ProjectId,
        run: RunId,
        worker: &str,
        call: &ApprovedCall<'_>,
        recorded: Option<AuditEvent>,
    ) -> Result<(ApprovedStart, Option<StagedEvent>), StoreError> {
        let mut tx = self.begin_write().await?;
        // A remote worker's claim is checked first: a cancel, the deadline or a stale claim
        // is what it is told, whatever the approval. A local worker's run is checked for a
        // cancel asked since its last poll: an approved call never starts after one.
        let held = match call.claim {
            Some(claim) => claimed_usage(&mut tx, run, worker, claim, call.usage).await?,
            None => {
                let cancelled = sqlx::query(
                    "SELECT 1 AS cancelled FROM runs WHERE id = $1 AND cancel_requested <> 0",
                )
                .bind(run.to_string())
                .fetch_optional(&mut **tx)
                .await?;
                if cancelled.is_some() {
                    ApprovedStart::CancelRequested
                } else {
                    ApprovedStart::Started
                }
            }
        };
        if held != ApprovedStart::Started {
            tx.rollback().await?;
            return Ok((held, None));
        }
        let used = sqlx::query(
            "UPDATE approvals SET used_at = $1 WHERE project_id = $2 AND run_id = $3 AND id = $4 \
             AND status = 'approved' AND used_at IS NULL AND binding_hash = $5",
        )
        .bind(now_millis())
        .bind(project.to_string())
        .bind(run.to_string())
        .bind(call.approval.to_string())
        .bind(call.binding_hash)
        .execute(&mut **tx)
        .await?;
        if used.rows_affected() != 1 {
            tx.rollback().await?;
            return Ok((ApprovedStart::NotUsable, None));
        }
        if call.claim.is_none()
            && !crate::runs::write_usage(&mut tx, run, worker, call.usage).await?
        {
            tx.rollback().await?;
            return Ok((ApprovedStart::RunNotHeld, None));
        }
        crate::runs::append_step(&mut tx, project, run, Provenance::Engine, call.step).await?;
        let staged = crate::staged::stage_some(&mut tx, recorded).await?;
        tx.commit().await?;
        Ok((ApprovedStart::Started, staged))
    }

    /// Marks the pending approvals of `run` cancelled (its run ended without a decision);
    /// returns which.
    pub async fn cancel_approvals(&self, run: RunId) -> Result<Vec<ApprovalId>, StoreError> {
        let pool = self.write_pool().await?;
        let mut connection = pool.acquire().await?;
        cancel_pending(&mut *connection, run, now_millis()).await
    }

    /// The project's own policy, when one was set.
    pub async fn project_policy(
        &self,
        project: ProjectId,
    ) -> Result<Option<ProjectPolicyRecord>, StoreError> {
        let row = sqlx::query(
            "SELECT text, updated_by, updated_at FROM project_policies WHERE project_id = $1",
        )
        .bind(project.to_string())
        .fetch_optional(self.pool())
        .await?;
        row.map(|row| {
            let updated_by: Option<String> = row.try_get("updated_by")?;
            Ok(ProjectPolicyRecord {
                text: row.try_get("text")?,
                updated_by: updated_by
                    .map(|k| parse_column(&k, "project_policies.updated_by"))
                    .transpose()?,
                updated_at: row.try_get("updated_at")?,
            })
        })
        .transpose()
    }

    /// Sets the project's policy text (validated by the caller); `None` goes back to the
    /// built-in default. Stages `recorded`, its `policy.set` entry, in the same transaction
    /// (`crate::staged`): the caller appends it with [`crate::AuditLog::append_staged`].
    pub async fn set_project_policy(
        &self,
        project: ProjectId,
        text: Option<&str>,
        by: Option<ApiKeyId>,
        recorded: AuditEvent,
    ) -> Result<StagedEvent, StoreError> {
        let mut tx = self.begin_write().await?;
        sqlx::query("DELETE FROM project_policies WHERE project_id = $1")
            .bind(project.to_string())
            .execute(&mut **tx)
            .await?;
        if let Some(text) = text {
            sqlx::query(
                "INSERT INTO project_policies (project_id, text, updated_by, updated_at) VALUES ($1, $2, $3, $4)",
            )
            .bind(project.to_string())
            .bind(text)
            .bind(by.map(|k| k.to_string()))
            .bind(now_millis())
            .execute(&mut **tx)
            .await?;
        }
        let staged = crate::staged::stage_one(&mut tx, recorded).await?;
        tx.commit().await?;
        Ok(staged)
    }
}

/// The audit entries a park stages with it: the request's, from the approval's id, when the
/// approval is filed now, and `also`, whenever the run parks.
struct ParkEntries<'a> {
    recorded: &'a (dyn Fn(ApprovalId) -> AuditEvent + Sync),
    also: Option<AuditEvent>,
}

/// Puts the run of approval `id` back in the queue when it is parked.
async fn requeue_parked(
    tx: &mut sqlx::Transaction<'_, sqlx::Any>,
    project: ProjectId,
    id: ApprovalId,
    now: i64,
) -> Result<(), StoreError> {
    sqlx::query(
        "UPDATE runs SET status = 'queued', updated_at = $1 WHERE project_id = $2 \
         AND status = 'waiting_for_approval' AND id = (SELECT run_id FROM approvals WHERE id = $3)",
    )
    .bind(now)
    .bind(project.to_string())
    .bind(id.to_string())
    .execute(&mut **tx)
    .await?;
    Ok(())
}

fn approval_from_row(row: &sqlx::any::AnyRow) -> Result<ApprovalRecord, StoreError> {
    let text = |column: &str| -> Result<String, StoreError> { Ok(row.try_get(column)?) };
    let json = |column: &str| -> Result<serde_json::Value, StoreError> {
        serde_json::from_str(&text(column)?)
            .map_err(|_| StoreError::Corrupt(format!("approvals.{column} is not JSON")))
    };
    let optional =
        |column: &str| -> Result<Option<String>, StoreError> { Ok(row.try_get(column)?) };
    let pinned_keys = json("pinned_keys")?
        .as_array()
        .map(|keys| {
            keys.iter()
                .filter_map(|k| k.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    Ok(ApprovalRecord {
        id: parse_column(&text("id")?, "approvals.id")?,
        project_id: parse_column(&text("project_id")?, "approvals.project_id")?,
        run_id: parse_column(&text("run_id")?, "approvals.run_id")?,
        call_id: text("call_id")?,
        tool: text("tool")?,
        pin_hash: text("pin_hash")?,
        arguments: json("arguments")?,
        arguments_hash: text("arguments_hash")?,
        pinned_keys,
        binding_hash: text("binding_hash")?,
        kind: parse_column(&text("kind")?, "approvals.kind")?,
        why: json("why")?,
        status: parse_column(&text("status")?, "approvals.status")?,
        requested_at: row.try_get("requested_at")?,
        expires_at: row.try_get("expires_at")?,
        decided_by_key: optional("decided_by_key")?
            .map(|k| parse_column(&k, "approvals.decided_by_key"))
            .transpose()?,
        decided_by_member: optional("decided_by_member")?
            .map(|m| parse_column(&m, "approvals.decided_by_member"))
            .transpose()?,
        decision_reason: optional("decision_reason")?,
        decided_at: row.try_get("decided_at")?,
        used_at: row.try_get("used_at")?,
        edited_arguments: optional("edited_arguments")?
            .map(|text| {
                serde_json::from_str(&text).map_err(|_| {
                    StoreError::Corrupt("approvals.edited_arguments is not JSON".to_owned())
                })
            })
            .transpose()?,
    })
}

/// Cancels the pending approvals of `run` (it ended); returns their ids.
pub(crate) async fn cancel_pending(
    connection: &mut impl crate::exec::Exec,
    run: RunId,
    now: i64,
) -> Result<Vec<ApprovalId>, StoreError> {
    let rows = connection
        .fetch_all(
            "UPDATE approvals SET status = 'cancelled', decided_at = $1 WHERE run_id = $2 \
             AND status = 'pending' RETURNING id",
            vec![now.into(), run.to_string().into()],
        )
        .await?;
    rows.iter()
        .map(|row| parse_column(&row.text("id")?, "approvals.id"))
        .collect()
}

/// Saves `usage` for a run `worker` holds under `claim`, in `tx`: only while the claim's
/// credential is live, no cancel has been requested and the run's usage is still the one the
/// worker counted from, all in the one statement that writes it.
async fn claimed_usage(
    tx: &mut sqlx::AnyConnection,
    run: RunId,
    worker: &str,
    claim: ApprovedClaim<'_>,
    usage: &BudgetUsage,
) -> Result<ApprovedStart, StoreError> {
    let now = now_millis();
    let before = claim.usage_before;
    let count = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
    let done = sqlx::query(
        "UPDATE runs SET usage_turns = $1, usage_tool_calls = $2, usage_input_tokens = $3, \
         usage_output_tokens = $4, usage_cost_microdollars = $5, updated_at = $6 \
         WHERE id = $7 AND lease_owner = $8 AND status = 'running' AND cancel_requested = 0 \
         AND usage_turns = $9 AND usage_tool_calls = $10 AND usage_input_tokens = $11 \
         AND usage_output_tokens = $12 AND usage_cost_microdollars = $13 \
         AND EXISTS (SELECT 1 FROM run_tokens t WHERE t.run_id = runs.id \
         AND t.lease_owner = runs.lease_owner AND t.sha256 = $14 AND t.expires_at > $6)",
    )
    .bind(count(usage.turns))
    .bind(count(usage.tool_calls))
    .bind(count(usage.input_tokens))
    .bind(count(usage.output_tokens))
    .bind(count(usage.cost_microdollars))
    .bind(now)
    .bind(run.to_string())
    .bind(worker)
    .bind(count(before.turns))
    .bind(count(before.tool_calls))
    .bind(count(before.input_tokens))
    .bind(count(before.output_tokens))
    .bind(count(before.cost_microdollars))
    .bind(sha256_hex(claim.credential.as_bytes()))
    .execute(&mut *tx)
    .await?;
    if done.rows_affected() == 1 {
        return Ok(ApprovedStart::Started);
    }
    let cancelled = sqlx::query(
        "SELECT 1 AS cancelled FROM runs WHERE id = $1 AND lease_owner = $2 \
         AND status = 'running' AND cancel_requested <> 0",
    )
    .bind(run.to_string())
    .bind(worker)
    .fetch_optional(&mut *tx)
    .await?;
    Ok(if cancelled.is_some() {
        ApprovedStart::CancelRequested
    } else {
        ApprovedStart::RunNotHeld
    })
}

/// Approval `id` of `project`, read with `executor`: the pool, or a transaction.
async fn select_approval<'c, E>(
    executor: E,
    project: ProjectId,
    id: ApprovalId,
) -> Result<ApprovalRecord, StoreError>
where
    E: sqlx::Executor<'c, Database = sqlx::Any>,
{
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM approvals WHERE project_id = $1 AND id = $2"
    )))
    .bind(project.to_string())
    .bind(id.to_string())
    .fetch_optional(executor)
    .await?
    .ok_or(StoreError::NotFound)?;
    approval_from_row(&row)
}
