//! The internal API between the control plane and its remote workers, as both sides write and
//! read it: the paths under `/internal/v1` and the JSON of each request and answer.
//!
//! `wor-server` serves these routes; a worker's runtime (`remote.rs`) calls them. Each body is
//! one type here, so the two sides cannot drift apart.

use wor_core::RunId;
use wor_core::budget::BudgetUsage;
use wor_store::{ApprovalRecord, ModelConnectionRecord, RunRecord, ToolConnectionRecord};

/// The path of worker enrolment.
pub const ENROLL_PATH: &str = "/internal/v1/workers/enroll";
/// The path of a worker's heartbeat, its first signed request.
pub const HEARTBEAT_PATH: &str = "/internal/v1/workers/heartbeat";
/// The path where a worker claims a run.
pub const CLAIM_PATH: &str = "/internal/v1/runs/claim";

/// The path of `what` (`lease`, `release`, `refuse`, `steps`, `end`, `park`, `nested`,
/// `quarantine`) for `run`.
pub fn run_path(run: RunId, what: &str) -> String {
    format!("/internal/v1/runs/{run}/{what}")
}

/// The path where a worker uses `approval` of `run`.
pub fn approval_use_path(run: RunId, approval: wor_core::ApprovalId) -> String {
    format!("/internal/v1/runs/{run}/approvals/{approval}/use")
}

/// The error code of a signed request refused because its worker is revoked: the worker
/// stops, as nothing it asks will be answered again.
pub const WORKER_REVOKED: &str = "worker_revoked";

/// The longest a claim waits for a run when none is queued, whatever the worker asks.
pub const MAX_CLAIM_WAIT_MS: u64 = 10_000;

/// A worker's claim: how long it will wait for a run when none is queued (at most
/// [`MAX_CLAIM_WAIT_MS`]; `0`, the default, answers at once).
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClaimRequest {
    #[serde(default)]
    pub wait_ms: u64,
}

/// Why a worker gives back a claim it cannot take up (its envelope was refused): the
/// control plane logs it and puts the run back in the queue. The claim's credential is in
/// the envelope it could not open, so the signed request alone names the holder.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RefuseRequest {
    pub lease_id: String,
    pub reason: String,
}

/// What a worker's heartbeat answers.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct HeartbeatAnswer {
    pub worker_id: String,
}

/// A run claimed by a worker: what it is driven from, and its secrets in an envelope sealed to
/// that worker alone.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct ClaimedRun {
    /// Names this claim in the envelope and in both sides' logs.
    pub lease_id: String,
    pub run: RunRecord,
    pub routine_version: ClaimedVersion,
    /// The project's policy text; `null`: the built-in default.
    pub project_policy: Option<String>,
    /// The steps recorded so far, in order.
    pub steps: Vec<ClaimedStep>,
    pub model_connection: Option<ModelConnectionRecord>,
    /// The roster's tool connections with their pins (no secrets).
    pub tool_connections: Vec<ToolConnectionRecord>,
    /// The run's approvals, oldest first.
    pub approvals: Vec<ApprovalRecord>,
    /// The routines the roster offers as tools (`routine/NAME`), as they are now.
    #[serde(default)]
    pub routine_tools: Vec<RoutineTool>,
    /// The run's deadline: its credential expires then (Unix milliseconds).
    pub credential_expires_at: i64,
    /// When the lease runs out unless renewed (Unix milliseconds, the control plane's clock).
    pub lease_expires_at: i64,
    /// How long the lease lasts from the claim and from each renewal or write (milliseconds):
    /// what a worker times its lease by, on its own clock.
    pub lease_ms: i64,
    /// Standard base64 of the run envelope (`wor_secrets::run_envelope`).
    pub envelope: String,
}

/// A routine a roster offers as a tool: what the model is shown of it and the hash of its
/// current version, which the tool's pin binds.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct RoutineTool {
    pub name: String,
    pub description: String,
    pub content_hash: String,
}

/// A worker's routine call that started (recorded as started): the control plane starts its
/// nested run, or finds the one an earlier attempt started.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NestedRequest {
    pub run_credential: String,
    pub call_id: String,
    /// The run's usage as the worker counts it; never below what is recorded.
    pub usage: BudgetUsage,
}

/// What came of a routine call.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum NestedAnswer {
    /// The nested run ended: the call is answered with it, and the run's usage (the nested
    /// run's added, and recorded) is this.
    Ended {
        nested: crate::nested::NestedEnd,
        usage: BudgetUsage,
    },
    /// The nested run is queued or waits for a person: the run is parked until it ends, and
    /// the claim has ended.
    Parked,
    /// A cancel of the run was requested: nothing was started, and the worker ends the run.
    CancelRequested,
}

/// A worker found that a connection its run uses lists tools that changed since they were
/// pinned: the control plane lists them itself, and quarantines the connection if it sees the
/// change too.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QuarantineRequest {
    pub run_credential: String,
    /// The connection's name, as the roster names it.
    pub connection: String,
}

/// Whether the connection is quarantined now (by this report or an earlier one).
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct QuarantineAnswer {
    pub quarantined: bool,
}

/// The routine version a claimed run runs.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct ClaimedVersion {
    pub version: i64,
    pub content_hash: String,
    pub source_toml: String,
}

/// One step of a claimed run, as it was recorded.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct ClaimedStep {
    pub seq: i64,
    /// `input`, `memory`, `model_turn`, `tool_call`, `approval_used`, `tool_result`, `output`
    /// or `outcome`.
    pub kind: String,
    /// Where the content came from: trusted, requester, untrusted, model or engine.
    pub provenance: String,
    pub payload: serde_json::Value,
    /// Unix milliseconds.
    pub created_at: i64,
}

impl ClaimedStep {
    /// `step` as a claim carries it.
    ///
    /// # Errors
    /// A step whose payload does not serialise.
    pub fn recorded(step: &wor_store::RunStep) -> Result<Self, wor_core::step::StepError> {
        Ok(ClaimedStep {
            seq: step.seq,
            kind: step.step.kind().as_str().to_owned(),
            provenance: step.provenance.as_str().to_owned(),
            payload: step.step.to_stored()?,
            created_at: step.created_at,
        })
    }

    /// The step as recorded, read back; a kind, provenance or payload that does not read is
    /// refused.
    ///
    /// # Errors
    /// What does not read, said in words.
    pub fn read(self) -> Result<wor_store::RunStep, String> {
        let provenance = self.provenance.parse().map_err(|_| {
            format!(
                "step {}: `{}` is not a provenance",
                self.seq, self.provenance
            )
        })?;
        let step = wor_core::step::Step::from_stored(&self.kind, self.payload)
            .map_err(|e| format!("step {}: {e}", self.seq))?;
        Ok(wor_store::RunStep {
            seq: self.seq,
            provenance,
            step,
            created_at: self.created_at,
        })
    }
}

/// The body of a request about a run a worker holds: the claim's credential.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HeldRunRequest {
    pub run_credential: String,
}

/// A renewed lease.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct LeaseAnswer {
    /// Unix milliseconds.
    pub lease_expires_at: i64,
    /// A cancel was requested: the worker stops the run before its next step.
    pub cancel_requested: bool,
}

/// One step a worker records, in the shape a run's steps are read in.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerStep {
    /// `input`, `model_turn`, `tool_call` or `tool_result`.
    pub kind: String,
    /// `model`, `engine` or `untrusted`, as a driver labels the step.
    pub provenance: String,
    pub payload: serde_json::Value,
}

/// What a worker records at one step of a run it holds.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepsRequest {
    pub run_credential: String,
    pub steps: Vec<WorkerStep>,
    /// The run's usage after these steps.
    pub usage: BudgetUsage,
}

/// What a worker's write came to.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct StepsAnswer {
    /// False only for a write that reserves a call when a cancel was requested: the worker
    /// ends the run as cancelled instead.
    pub recorded: bool,
    /// A cancel of the run was requested: the worker stops before its next step.
    pub cancel_requested: bool,
}

/// How a worker ends a run it holds.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EndRequest {
    pub run_credential: String,
    /// `succeeded`, `failed`, `cancelled` or `budget_exceeded`.
    pub status: String,
    pub outcome: String,
    pub usage: BudgetUsage,
}

/// How a worker parks a run it holds for a person's decision on a call: one it recorded as
/// held, or one that started and whose outcome is unknown.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParkRequest {
    pub run_credential: String,
    pub call_id: String,
}

/// What a worker's park came to.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct ParkAnswer {
    /// The approval the run now waits for; `null` when a cancel was requested instead.
    pub approval_id: Option<String>,
    /// A cancel of the run was requested: it is not parked, and the worker ends it.
    pub cancel_requested: bool,
}

/// How a worker starts a call with the approval a person gave it.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UseApprovalRequest {
    pub run_credential: String,
    /// The hash of the tool definition the call runs against.
    pub pin_hash: String,
    /// The hash of the arguments it runs with (an approver's edit applied).
    pub arguments_hash: String,
    /// The run's usage with the call reserved.
    pub usage: BudgetUsage,
}

/// Whether the approval started its call.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct ApprovalUseAnswer {
    /// True: the call is recorded as started and runs now. False: it does not run — the
    /// approval is not usable for this call (not approved, used already, or bound to another
    /// call), or a cancel was requested.
    pub started: bool,
    /// A cancel of the run was requested: the worker ends it.
    pub cancel_requested: bool,
}
