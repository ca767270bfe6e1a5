//! A remote worker's side of a scaled-out deployment: runs claimed from the control plane and
//! driven here by the same driver and pipeline as a local run, with everything a run reads
//! taken from its claim and everything it writes sent to the control plane.
//!
//! A worker has no database and no encryption key. It claims a run over the internal API
//! ([`crate::worker_wire`]), opens the run's envelope (signature, audience, lifetime, skew,
//! expiry, replay: `wor_secrets::run_envelope`), and holds the claim — the run, its routine
//! version, the project's policy, its steps, approvals and connections, and the secrets of that
//! run alone — in memory for as long as it drives the run; the secrets are zeroised when the
//! claim is dropped. The driver's reads of run state come from the claim; its journal writes
//! become `steps` and `end` requests, parking and the use of an approval become `park` and
//! `use` requests, and the lease is renewed by `lease` requests, each presenting the claim's
//! credential. The control plane checks each against the run's state and the worker's lease,
//! redacts again and derives the audit entries itself; nothing here writes the audit chain.
//!
//! A routine used as a tool starts its nested run on the control plane (`nested` requests),
//! where any worker claims it; the calling run parks until it ends. A connection whose tools
//! changed fails the run closed and is reported (`quarantine` requests): the control plane
//! lists the tools itself and quarantines what it sees changed.
//!
//! What a remote worker does not do yet, and refuses rather than does elsewhere: renew an MCP
//! authorization's access token (the one in the envelope is used as it is).

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use secrecy::{ExposeSecret as _, SecretString};
use wor_core::budget::BudgetUsage;
use wor_core::run::{Provenance, RunStatus};
use wor_core::step::Step;
use wor_core::{ApprovalId, RunId};
use wor_secrets::{EnvelopeOpener, SealedEnvelope, ToolCredential};
use wor_store::{
    ApprovalKind, ApprovalRecord, ModelConnectionRecord, RoutineVersionRecord, RunRecord, RunStep,
    RunWritten, ToolConnectionRecord,
};

use crate::worker_wire::{
    self, ApprovalUseAnswer, ClaimedRun, EndRequest, HeldRunRequest, LeaseAnswer, ParkAnswer,
    ParkRequest, StepsAnswer, StepsRequest, UseApprovalRequest, WorkerStep,
};
use crate::{Engine, EngineError};

/// A boxed future, as a [`ControlPlaneLink`] returns one.
pub type LinkFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// How a worker reaches its control plane: one signed `POST` of a JSON body to a path of the
/// internal API. The composition root provides it (signing with the worker's key, over TLS
/// when the control plane is not on loopback).
pub trait ControlPlaneLink: Send + Sync {
    /// Sends `body` to `path` and returns the answer's status and body.
    fn post<'a>(
        &'a self,
        path: &'a str,
        body: Vec<u8>,
    ) -> LinkFuture<'a, Result<LinkAnswer, LinkError>>;
}

/// The control plane's answer to one request.
#[derive(Debug, Clone)]
pub struct LinkAnswer {
    pub status: u16,
    pub body: Vec<u8>,
}

/// The request did not reach the control plane, or its answer did not come back.
#[derive(Debug, Clone, thiserror::Error)]
#[error("the control plane cannot be reached: {0}")]
pub struct LinkError(pub String);

/// Why a claim could not be taken up; the run is given back, or left to its lease.
#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    #[error(transparent)]
    Link(#[from] LinkError),
    #[error("the control plane answered the claim with status {status}: {message}")]
    Refused { status: u16, message: String },
    #[error(
        "the control plane revoked this worker: it answers none of its requests; enrol a new worker to drive runs here"
    )]
    Revoked,
    #[error("the claim does not read: {0}")]
    Malformed(String),
    #[error("the run's envelope is refused: {0}")]
    Envelope(#[from] wor_secrets::EnvelopeError),
    #[error("the envelope is for run {envelope}, the claim for run {claim}")]
    OtherRun { envelope: String, claim: RunId },
    #[error(
        "run {0} was claimed again while an earlier drive of it is still going here; the new claim was given back"
    )]
    StillDriving(RunId),
}

/// The runs this worker holds and how it reaches the control plane.
pub(crate) struct RemoteRuns {
    link: Arc<dyn ControlPlaneLink>,
    opener: Mutex<EnvelopeOpener>,
    held: Mutex<HashMap<RunId, Arc<HeldClaim>>>,
    /// The worker is stopping: each drive gives its run back at its next step boundary.
    draining: AtomicBool,
    /// Why this worker cannot take work now, from the last claim or heartbeat: the control
    /// plane could not be reached or refused it. `None` while it answers.
    unready: Mutex<Option<String>>,
    /// Set once the control plane answers any request of this worker's with
    /// [`worker_wire::WORKER_REVOKED`]: its loop stops and its drives are ended at once.
    revoked: tokio::sync::watch::Sender<bool>,
}

impl std::fmt::Debug for RemoteRuns {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteRuns").finish_non_exhaustive()
    }
}

tokio::task_local! {
    /// The claim the current task drives its run under: every read and write of that drive
    /// goes through this claim, and no other (a claim of the same run taken later, or another
    /// run's, is never used by mistake).
    static DRIVEN: Arc<HeldClaim>;
}

/// Renewals of a lease during a long model or tool call are at most this often; a step's
/// write renews it too.
const RENEW_EVERY: Duration = Duration::from_secs(1);

/// How long a stalled idle worker waits at most between claims, after failures.
const MAX_CLAIM_BACKOFF: Duration = Duration::from_secs(5);

/// How a remote worker's loop ended ([`Engine::spawn_remote_worker`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkerEnd {
    /// It was asked to stop.
    Stopped,
    /// The control plane revoked the worker: it stopped, as nothing it asks is answered.
    Revoked,
}

/// How a remote worker paces itself ([`Engine::spawn_remote_worker`]).
#[derive(Debug, Clone, Copy)]
pub struct WorkerTimings {
    /// How often an idle worker tells the control plane it is alive.
    pub heartbeat: Duration,
    /// How long a stopping worker lets its drives reach a step boundary before it aborts
    /// them and gives their runs back.
    pub drain: Duration,
    /// How long a claim waits at the control plane for a run when none is queued (at most
    /// [`worker_wire::MAX_CLAIM_WAIT_MS`]); a stop waits for the claim in flight.
    pub claim_wait: Duration,
}

/// One claim this worker holds: what its run is driven from, kept until the drive is over.
pub(crate) struct HeldClaim {
    run: RunId,
    lease_id: String,
    version: Arc<RoutineVersionRecord>,
    project_policy: Option<String>,
    steps: Vec<RunStep>,
    model_connection: Option<ModelConnectionRecord>,
    tool_connections: Vec<ToolConnectionRecord>,
    approvals: Vec<ApprovalRecord>,
    routine_tools: Vec<worker_wire::RoutineTool>,
    credential: SecretString,
    credential_expires_at: i64,
    model_key: Option<SecretString>,
    tool_credentials: Vec<ToolCredential>,
    /// A cancel the control plane reported at the last request that could say so.
    cancel_requested: AtomicBool,
    /// The usage last recorded on the control plane, for a write that does not change it.
    usage: Mutex<BudgetUsage>,
    /// How long the lease lasts from a claim, renewal or write (ms).
    lease_ms: i64,
    /// When this worker last renewed the lease, and until when it surely holds it, on this
    /// machine's monotonic clock (the control plane's wall clock may differ from ours).
    lease: Mutex<LeaseClock>,
}

/// The lease of a held claim as this worker times it.
#[derive(Clone, Copy)]
struct LeaseClock {
    renewed: Instant,
    held_until: Instant,
}

impl LeaseClock {
    /// A lease of `lease_ms` renewed by a request sent at `sent`: held until then, less a
    /// margin of a fifth for the request's own time.
    fn renewed_at(sent: Instant, lease_ms: i64) -> Self {
        let lease = Duration::from_millis(u64::try_from(lease_ms).unwrap_or(0));
        LeaseClock {
            renewed: sent,
            held_until: sent + lease.saturating_sub(lease / 5),
        }
    }
}

impl HeldClaim {
    fn credential(&self) -> String {
        self.credential.expose_secret().to_owned()
    }

    fn usage(&self) -> BudgetUsage {
        *locked(&self.usage)
    }

    fn set_usage(&self, usage: BudgetUsage) {
        *locked(&self.usage) = usage;
    }

    fn lease(&self) -> LeaseClock {
        *locked(&self.lease)
    }

    /// The control plane renewed the lease with a request sent at `sent`.
    fn renewed(&self, sent: Instant) {
        *locked(&self.lease) = LeaseClock::renewed_at(sent, self.lease_ms);
    }

    fn saw_cancel(&self, cancel_requested: bool) {
        if cancel_requested {
            self.cancel_requested.store(true, Ordering::Relaxed);
        }
    }
}

/// How the control plane answered a request about a held run.
enum Answer<T> {
    Ok(T),
    /// `409 lease_not_held`: the run is not this worker's under this claim (any more).
    NotHeld,
}

impl RemoteRuns {
    pub(crate) fn new(link: Arc<dyn ControlPlaneLink>, opener: EnvelopeOpener) -> Self {
        RemoteRuns {
            link,
            opener: Mutex::new(opener),
            held: Mutex::new(HashMap::new()),
            draining: AtomicBool::new(false),
            unready: Mutex::new(Some("the control plane has not answered yet".to_owned())),
            revoked: tokio::sync::watch::Sender::new(false),
        }
    }

    /// Notes an answer that says this worker is revoked, whichever request it answers.
    fn note_revocation(&self, answer: &LinkAnswer) {
        if is_revocation(answer) {
            self.revoked.send_replace(true);
        }
    }

    /// Notes whether the control plane took a claim or heartbeat (for readiness), and passes
    /// the answer on.
    fn answered(&self, answer: Result<LinkAnswer, LinkError>) -> Result<LinkAnswer, LinkError> {
        if let Ok(answer) = &answer {
            self.note_revocation(answer);
        }
        *locked(&self.unready) = match &answer {
            Ok(LinkAnswer { status, .. }) if *status < 300 => None,
            // The status alone: the probe is served over plain HTTP, and the body is the
            // control plane's to say.
            Ok(LinkAnswer { status, .. }) => {
                Some(format!("the control plane answered with status {status}"))
            }
            Err(_) => Some("the control plane cannot be reached".to_owned()),
        };
        answer
    }

    fn held_map(&self) -> std::sync::MutexGuard<'_, HashMap<RunId, Arc<HeldClaim>>> {
        locked(&self.held)
    }

    /// The claim the current task drives `run` under; any other run, or no drive, is a lost
    /// lease.
    pub(crate) fn held(run: RunId) -> Result<Arc<HeldClaim>, EngineError> {
        DRIVEN
            .try_with(Arc::clone)
            .ok()
            .filter(|claim| claim.run == run)
            .ok_or(EngineError::LeaseLost)
    }

    /// The claims held now.
    fn held_claims(&self) -> Vec<Arc<HeldClaim>> {
        self.held_map().values().cloned().collect()
    }

    /// Version `version` of `routine`, from the claim the current task drives under.
    pub(crate) fn version(
        routine: wor_core::RoutineId,
        version: i64,
    ) -> Option<Arc<RoutineVersionRecord>> {
        DRIVEN
            .try_with(|c| {
                (c.version.routine_id == routine && c.version.version == version)
                    .then(|| c.version.clone())
            })
            .ok()
            .flatten()
    }

    /// The credential `field` of tool connection `connection`, from the envelope of the claim
    /// the current task drives under: that run's secrets alone.
    pub(crate) fn tool_credential(connection: &str, field: &str) -> Option<SecretString> {
        DRIVEN
            .try_with(|claim| {
                claim
                    .tool_credentials
                    .iter()
                    .find(|c| c.connection_id == connection && c.field == field)
                    .map(|c| c.value.clone())
            })
            .ok()
            .flatten()
    }

    /// Sends `body` to `path`: the answer's status and body.
    async fn post(
        &self,
        path: &str,
        body: &impl serde::Serialize,
    ) -> Result<LinkAnswer, EngineError> {
        let body = serde_json::to_vec(body)
            .map_err(|e| EngineError::InvalidState(format!("a request does not encode: {e}")))?;
        let answer = self
            .link
            .post(path, body)
            .await
            .map_err(|e| EngineError::ControlPlane(e.to_string()))?;
        self.note_revocation(&answer);
        Ok(answer)
    }

    /// Sends `body` to `path` and reads the answer as `T`.
    async fn call<T: serde::de::DeserializeOwned>(
        &self,
        path: &str,
        body: &impl serde::Serialize,
    ) -> Result<Answer<T>, EngineError> {
        match answered(path, "write", self.post(path, body).await?)? {
            Answer::Ok(body) => serde_json::from_slice(&body).map(Answer::Ok).map_err(|e| {
                EngineError::ControlPlane(format!("the answer to {path} does not read: {e}"))
            }),
            Answer::NotHeld => Ok(Answer::NotHeld),
        }
    }
}

/// What the control plane's answer to `path` (the run's `what`) says: its body when it took
/// the request (200 or 204), a lost lease, or an error — a refusal (400) being the run's to
/// fail with, in the control plane's words.
fn answered(path: &str, what: &str, answer: LinkAnswer) -> Result<Answer<Vec<u8>>, EngineError> {
    match answer.status {
        200 | 204 => Ok(Answer::Ok(answer.body)),
        409 if error_code(&answer.body).as_deref() == Some("lease_not_held") => Ok(Answer::NotHeld),
        400 => Err(EngineError::InvalidState(format!(
            "the control plane refused the run's {what}: {}",
            error_message(&answer.body)
        ))),
        status => Err(EngineError::ControlPlane(format!(
            "{path} answered {status}: {}",
            error_message(&answer.body)
        ))),
    }
}

/// Waits until the control plane has said the worker is revoked; never, for an engine that is
/// not a remote worker's.
async fn until_revoked(revoked: &mut Option<tokio::sync::watch::Receiver<bool>>) {
    match revoked {
        Some(revoked) => {
            if revoked.wait_for(|revoked| *revoked).await.is_err() {
                std::future::pending::<()>().await;
            }
        }
        None => std::future::pending().await,
    }
}

/// `mutex` locked; one a panicking holder left poisoned holds plain data and is used as it is.
fn locked<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The code of an error answer.
fn error_code(body: &[u8]) -> Option<String> {
    serde_json::from_slice::<serde_json::Value>(body)
        .ok()?
        .pointer("/error/code")?
        .as_str()
        .map(str::to_owned)
}

/// The message of an error answer, or its first bytes.
/// Whether the control plane answered that this worker is revoked.
fn is_revocation(answer: &LinkAnswer) -> bool {
    answer.status == 401 && error_code(&answer.body).as_deref() == Some(worker_wire::WORKER_REVOKED)
}

/// A claim's or a heartbeat's refusal: [`ClaimError::Revoked`] when the control plane answers
/// that this worker is revoked.
fn refusal(answer: &LinkAnswer) -> ClaimError {
    if is_revocation(answer) {
        return ClaimError::Revoked;
    }
    ClaimError::Refused {
        status: answer.status,
        message: error_message(&answer.body),
    }
}

fn error_message(body: &[u8]) -> String {
    serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| {
            v.pointer("/error/message")
                .and_then(|m| m.as_str())
                .map(str::to_owned)
        })
        .unwrap_or_else(|| String::from_utf8_lossy(body.get(..200).unwrap_or(body)).into_owned())
}

/// Opens a claim's envelope and reads the claim: its run, and what that run is driven from.
fn take_up(remote: &RemoteRuns, claimed: ClaimedRun) -> Result<(RunRecord, HeldClaim), ClaimError> {
    let sealed = SealedEnvelope::from_base64(&claimed.envelope)?;
    let opened = locked(&remote.opener).open(&sealed, wor_store::now_millis() / 1000)?;
    if opened.claims.run_id != claimed.run.id.to_string()
        || opened.claims.lease_id != claimed.lease_id
    {
        return Err(ClaimError::OtherRun {
            envelope: opened.claims.run_id,
            claim: claimed.run.id,
        });
    }
    read_claim(claimed, opened.secrets)
}

/// Reads a claim's answer into what the engine drives a run from.
fn read_claim(
    claimed: ClaimedRun,
    secrets: wor_secrets::RunSecrets,
) -> Result<(RunRecord, HeldClaim), ClaimError> {
    let run = claimed.run;
    let definition =
        wor_core::routine::RoutineDefinition::from_toml(&claimed.routine_version.source_toml)
            .map_err(|e| {
                ClaimError::Malformed(format!("the routine version does not parse: {e}"))
            })?;
    let version = Arc::new(RoutineVersionRecord {
        routine_id: run.routine_id,
        version: claimed.routine_version.version,
        source_toml: claimed.routine_version.source_toml,
        definition,
        content_hash: claimed.routine_version.content_hash,
        created_by: None,
        created_at: run.created_at,
    });
    if version.version != run.routine_version {
        return Err(ClaimError::Malformed(format!(
            "the claim carries version {} of the routine, the run runs version {}",
            version.version, run.routine_version
        )));
    }
    let steps = claimed
        .steps
        .into_iter()
        .map(worker_wire::ClaimedStep::read)
        .collect::<Result<Vec<_>, _>>()
        .map_err(ClaimError::Malformed)?;
    let held = HeldClaim {
        run: run.id,
        lease_id: claimed.lease_id,
        version: version.clone(),
        project_policy: claimed.project_policy,
        steps,
        model_connection: claimed.model_connection,
        tool_connections: claimed.tool_connections,
        approvals: claimed.approvals,
        routine_tools: claimed.routine_tools,
        credential: secrets.run_credential,
        credential_expires_at: claimed.credential_expires_at,
        model_key: secrets.model_key,
        tool_credentials: secrets.tool_credentials,
        cancel_requested: AtomicBool::new(run.cancel_requested),
        usage: Mutex::new(run.usage),
        lease_ms: claimed.lease_ms,
        lease: Mutex::new(LeaseClock::renewed_at(Instant::now(), claimed.lease_ms)),
    };
    Ok((run, held))
}

impl Engine {
    /// This engine as a remote worker's: it drives only runs it claims through `link`, opening
    /// their envelopes with `opener`.
    pub fn with_control_plane(
        mut self,
        link: Arc<dyn ControlPlaneLink>,
        opener: EnvelopeOpener,
    ) -> Self {
        self.remote = Some(Arc::new(RemoteRuns::new(link, opener)));
        self
    }

    /// Claims a run from the control plane and holds its claim, waiting there up to `wait`
    /// for one; `None` when none was queued. A claim this worker cannot take up (its envelope
    /// is refused) is given back with the reason.
    pub async fn claim_remote(&self, wait: Duration) -> Result<Option<RunRecord>, ClaimError> {
        let Some(remote) = &self.remote else {
            return Err(ClaimError::Malformed(
                "this engine is not a remote worker's".to_owned(),
            ));
        };
        let asked = worker_wire::ClaimRequest {
            wait_ms: u64::try_from(wait.as_millis()).unwrap_or(u64::MAX),
        };
        let body = serde_json::to_vec(&asked).map_err(|e| ClaimError::Malformed(e.to_string()))?;
        let answer = remote.link.post(worker_wire::CLAIM_PATH, body).await;
        let answer = remote.answered(answer)?;
        match answer.status {
            200 => {}
            204 => return Ok(None),
            _ => return Err(refusal(&answer)),
        }
        let claimed: ClaimedRun = serde_json::from_slice(&answer.body)
            .map_err(|e| ClaimError::Malformed(e.to_string()))?;
        let (run_id, lease_id) = (claimed.run.id, claimed.lease_id.clone());
        let (run, held) = match take_up(remote, claimed) {
            Ok(taken) => taken,
            // An envelope this worker refuses (expired, replayed, not its own) is given back
            // at once: another claim gets another envelope.
            Err(error @ ClaimError::Envelope(_)) => {
                tracing::warn!(category = "run", action = "worker.envelope_refused",
                    run_id = %run_id, lease_id = %lease_id, reason = %error,
                    "a run's envelope was refused; the run is given back");
                self.refuse_claim(remote, run_id, &lease_id, &error).await;
                return Err(error);
            }
            // A claim this worker cannot read would be as unreadable to the next claim of
            // any worker like it: given back at once it would be claimed first again and
            // hold up the queue, so it waits out its lease.
            Err(error) => {
                tracing::warn!(category = "run", action = "worker.claim_unreadable",
                    run_id = %run_id, lease_id = %lease_id, reason = %error,
                    "a claimed run cannot be taken up; it waits out its lease");
                return Err(error);
            }
        };
        let held = Arc::new(held);
        // A drive of this run from an earlier claim is still going here (it outlived its
        // lease): the new claim is given back; the old drive's writes are refused under its
        // ended credential, it stops, and the run is claimed again.
        let earlier = {
            let mut map = remote.held_map();
            let earlier = map.contains_key(&run.id);
            if !earlier {
                map.insert(run.id, held.clone());
            }
            earlier
        };
        if earlier {
            self.give_back_claim(remote, &held).await;
            return Err(ClaimError::StillDriving(run.id));
        }
        tracing::info!(category = "run", action = "worker.claimed", run_id = %run.id,
            lease_id = %held.lease_id, "claimed a run from the control plane");
        Ok(Some(run))
    }

    /// Drives a run this worker claimed until it ends, parks or is lost, then lets its claim
    /// and secrets go; a drive that stopped for any other reason gives the run back first.
    pub async fn drive_claimed(&self, run: RunRecord) -> Result<(), EngineError> {
        let Some(remote) = &self.remote else {
            return self.drive(run).await;
        };
        let Some(claim) = remote.held_map().get(&run.id).cloned() else {
            return Err(EngineError::LeaseLost);
        };
        // Forgets the claim however the drive ends (an abort or a panic included), and only
        // this drive's claim.
        let _forget = ForgetClaim {
            remote,
            claim: claim.clone(),
        };
        let driven = DRIVEN.scope(claim.clone(), self.drive(run)).await;
        if let Err(error) = &driven
            && !matches!(error, EngineError::LeaseLost)
        {
            self.give_back_claim(remote, &claim).await;
        }
        driven
    }

    /// Gives back a run whose claim this worker cannot take up, saying why.
    async fn refuse_claim(
        &self,
        remote: &RemoteRuns,
        run: RunId,
        lease_id: &str,
        error: &ClaimError,
    ) {
        let body = worker_wire::RefuseRequest {
            lease_id: lease_id.to_owned(),
            reason: error.to_string(),
        };
        match remote
            .post(&worker_wire::run_path(run, "refuse"), &body)
            .await
        {
            Ok(LinkAnswer { status: 204, .. }) => {}
            Ok(LinkAnswer { status, body }) => {
                tracing::warn!(category = "run", run_id = %run, status,
                    reason = %error_message(&body), "a refused claim could not be given back; its lease will expire");
            }
            Err(error) => tracing::warn!(category = "run", run_id = %run, error = %error,
                "a refused claim could not be given back; its lease will expire"),
        }
    }

    /// Whether this remote worker can take work: `Err` says why not (it is stopping, or its
    /// last claim or heartbeat did not reach the control plane or was refused).
    ///
    /// # Errors
    /// The reason it is not ready.
    pub fn remote_ready(&self) -> Result<(), String> {
        let Some(remote) = &self.remote else {
            return Err("this engine is not a remote worker's".to_owned());
        };
        if remote.draining.load(Ordering::Relaxed) {
            return Err("the worker is stopping".to_owned());
        }
        match locked(&remote.unready).clone() {
            Some(reason) => Err(reason),
            None => Ok(()),
        }
    }

    /// Whether the drive of `run` stops here, at a step boundary, to be given back: this
    /// worker, or this process's pool, is stopping, and nothing of the run waits to be written (a model turn carried
    /// to its first call's write is written before the run stops).
    pub(crate) fn stops_here(&self, run: RunId) -> bool {
        (self.pool.is_draining()
            || self
                .remote
                .as_ref()
                .is_some_and(|remote| remote.draining.load(Ordering::Relaxed)))
            && !self.carries(run)
    }

    /// Gives the run of `claim` back to the queue, logging what happens.
    async fn give_back_claim(&self, remote: &RemoteRuns, claim: &HeldClaim) {
        let body = HeldRunRequest {
            run_credential: claim.credential(),
        };
        let run = claim.run;
        match remote
            .post(&worker_wire::run_path(run, "release"), &body)
            .await
        {
            Ok(LinkAnswer { status: 204, .. }) => {
                tracing::info!(category = "run", action = "worker.released", run_id = %run,
                    "gave a run back to the control plane");
            }
            Ok(LinkAnswer { status, body }) => {
                tracing::warn!(category = "run", run_id = %run, status,
                    reason = %error_message(&body), "a run could not be given back; its lease will expire");
            }
            Err(error) => tracing::warn!(category = "run", run_id = %run, error = %error,
                "a run could not be given back; its lease will expire"),
        }
    }

    /// Gives back every run this worker holds, to be resumed by another claim.
    pub async fn release_claimed(&self) {
        let Some(remote) = &self.remote else {
            return;
        };
        for claim in remote.held_claims() {
            self.give_back_claim(remote, &claim).await;
            remote.held_map().remove(&claim.run);
        }
    }

    /// Tells the control plane this worker is alive; the worker id it answered with.
    pub async fn heartbeat(&self) -> Result<String, ClaimError> {
        let Some(remote) = &self.remote else {
            return Err(ClaimError::Malformed(
                "this engine is not a remote worker's".to_owned(),
            ));
        };
        let answer = remote
            .link
            .post(worker_wire::HEARTBEAT_PATH, b"{}".to_vec())
            .await;
        let answer = remote.answered(answer)?;
        if answer.status != 200 {
            return Err(refusal(&answer));
        }
        serde_json::from_slice::<worker_wire::HeartbeatAnswer>(&answer.body)
            .map(|a| a.worker_id)
            .map_err(|e| ClaimError::Malformed(e.to_string()))
    }

    /// The claim this task drives `run` under, when this engine is a remote worker's.
    pub(crate) fn remote_claim(&self, run: RunId) -> Option<Result<Arc<HeldClaim>, EngineError>> {
        self.remote.as_ref().map(|_| RemoteRuns::held(run))
    }

    /// The steps a remote run was claimed with.
    pub(crate) fn claimed_steps(claim: &HeldClaim) -> Vec<RunStep> {
        claim.steps.clone()
    }

    /// The project policy text a remote run was claimed with.
    pub(crate) fn claimed_policy(claim: &HeldClaim) -> Option<String> {
        claim.project_policy.clone()
    }

    /// The active model connection a remote run was claimed with, if any.
    pub(crate) fn claimed_model_connection(claim: &HeldClaim) -> Vec<ModelConnectionRecord> {
        claim.model_connection.iter().cloned().collect()
    }

    /// The model key from a remote run's envelope.
    pub(crate) fn claimed_model_key(claim: &HeldClaim) -> Option<SecretString> {
        claim.model_key.clone()
    }

    /// The tool connection `name` a remote run was claimed with.
    pub(crate) fn claimed_tool_connection(
        claim: &HeldClaim,
        name: &str,
    ) -> Option<ToolConnectionRecord> {
        claim
            .tool_connections
            .iter()
            .find(|c| c.name == name)
            .cloned()
    }

    /// The approval of `kind` for `call` that a remote run was claimed with, the latest first.
    pub(crate) fn claimed_approval(
        claim: &HeldClaim,
        call: &str,
        kind: ApprovalKind,
    ) -> Option<ApprovalRecord> {
        claim
            .approvals
            .iter()
            .rev()
            .find(|a| a.call_id == call && a.kind == kind)
            .cloned()
    }

    /// A secret of a tool connection from the envelope of the run this task drives, when
    /// this engine is a remote worker's.
    pub(crate) fn remote_tool_credential(
        &self,
        connection: &str,
        field: &str,
    ) -> Option<Option<SecretString>> {
        self.remote
            .as_ref()
            .map(|_| RemoteRuns::tool_credential(connection, field))
    }

    /// Every secret value a remote run's envelope brought.
    pub(crate) fn claimed_secret_values(claim: &HeldClaim) -> Vec<SecretString> {
        let mut values = vec![claim.credential.clone()];
        values.extend(claim.model_key.clone());
        values.extend(claim.tool_credentials.iter().map(|c| c.value.clone()));
        values
    }

    /// Ends a remote run on the control plane, with the turn it carried, if any: whether it
    /// ended under this claim. What follows an end there (approvals cancelled, memory, run
    /// webhooks) is the control plane's.
    pub(crate) async fn end_claimed(
        &self,
        run: &RunRecord,
        ending: wor_core::run_loop::Ending,
        usage: Option<BudgetUsage>,
    ) -> Result<bool, EngineError> {
        let mut status = ending.status;
        let carried = self.take_carried(run.id);
        let usage = usage.or_else(|| carried.as_ref().and_then(|c| c.usage));
        let steps = carried.map(|c| c.steps).unwrap_or_default();
        let ended = match self
            .end_remote(run.id, &steps, ending.status, &ending.outcome, usage)
            .await
        {
            // The control plane refused this end (an answer its output schema does not take,
            // say): the run fails with its reason instead.
            // With the usage last recorded there, which it took (the refusal may have been of
            // the usage sent, or of steps carried to the end, which are left out).
            Err(EngineError::InvalidState(reason)) if ending.status != RunStatus::Failed => {
                tracing::warn!(category = "run", run_id = %run.id, status = ending.status.as_str(),
                    "the control plane refused the run's end; it fails with the reason");
                status = RunStatus::Failed;
                self.end_remote(run.id, &[], RunStatus::Failed, &reason, None)
                    .await?
            }
            other => other?,
        };
        self.live_text.close(run.id);
        tracing::info!(category = "run", action = "run.end", project_id = %run.project_id,
            run_id = %run.id, status = status.as_str(), lease_held = ended, "run ended");
        Ok(ended)
    }

    /// The credential and deadline of a remote run's claim.
    pub(crate) fn claimed_credential(claim: &HeldClaim) -> (String, i64) {
        (claim.credential(), claim.credential_expires_at)
    }

    /// Whether a cancel of a remote run was reported.
    pub(crate) fn claimed_cancel(claim: &HeldClaim) -> bool {
        claim.cancel_requested.load(Ordering::Relaxed)
    }

    /// Renews the lease of a remote run: whether it is still held.
    /// At most once a second; a request that fails before the lease it renews runs out is
    /// tried again at the next renewal.
    pub(crate) async fn renew_remote(&self, run: RunId) -> Result<bool, EngineError> {
        let (remote, claim) = self.remote_parts(run)?;
        let sent = Instant::now();
        if sent.duration_since(claim.lease().renewed) < RENEW_EVERY {
            return Ok(true);
        }
        let body = HeldRunRequest {
            run_credential: claim.credential(),
        };
        match remote
            .call::<LeaseAnswer>(&worker_wire::run_path(run, "lease"), &body)
            .await
        {
            Ok(Answer::Ok(lease)) => {
                claim.saw_cancel(lease.cancel_requested);
                claim.renewed(sent);
                Ok(true)
            }
            Ok(Answer::NotHeld) => Ok(false),
            Err(EngineError::ControlPlane(reason)) if Instant::now() < claim.lease().held_until => {
                tracing::warn!(category = "run", run_id = %run, reason = %reason,
                    "a lease renewal failed; tried again while the lease lasts");
                Ok(true)
            }
            Err(error) => Err(error),
        }
    }

    fn remote_parts(&self, run: RunId) -> Result<(&RemoteRuns, Arc<HeldClaim>), EngineError> {
        let remote = self
            .remote
            .as_deref()
            .ok_or_else(|| EngineError::InvalidState("not a remote worker".to_owned()))?;
        Ok((remote, RemoteRuns::held(run)?))
    }

    /// A journal write of a remote run, sent as a `steps` request: its steps and usage (the
    /// control plane derives the audit entries). A write with no step records nothing there.
    pub(crate) async fn record_remote(
        &self,
        run: RunId,
        steps: &[(Provenance, Step)],
        usage: Option<BudgetUsage>,
    ) -> Result<RunWritten, EngineError> {
        let (remote, claim) = self.remote_parts(run)?;
        if steps.is_empty() {
            return Ok(RunWritten::Committed {
                cancel_requested: Engine::claimed_cancel(&claim),
                cancelled_approvals: Vec::new(),
            });
        }
        let usage = usage.unwrap_or_else(|| claim.usage());
        let steps = steps
            .iter()
            .map(|(provenance, step)| {
                Ok(WorkerStep {
                    kind: step.kind().as_str().to_owned(),
                    provenance: provenance.as_str().to_owned(),
                    payload: step.to_stored().map_err(|e| {
                        EngineError::InvalidState(format!("a step does not encode: {e}"))
                    })?,
                })
            })
            .collect::<Result<Vec<_>, EngineError>>()?;
        // One write is one request, as it is one transaction on the control plane.
        if steps.len() > crate::MAX_WORKER_STEPS_PER_WRITE {
            return Err(EngineError::InvalidState(format!(
                "a write of {} steps is more than a worker may send at once",
                steps.len()
            )));
        }
        let body = StepsRequest {
            run_credential: claim.credential(),
            steps,
            usage,
        };
        let sent = Instant::now();
        match remote
            .call::<StepsAnswer>(&worker_wire::run_path(run, "steps"), &body)
            .await?
        {
            Answer::Ok(answer) if answer.recorded => claim.saw_cancel(answer.cancel_requested),
            Answer::Ok(_) => {
                claim.saw_cancel(true);
                return Ok(RunWritten::CancelRequested);
            }
            Answer::NotHeld => return Ok(RunWritten::LeaseLost),
        }
        // The write renewed the lease on the control plane.
        claim.renewed(sent);
        claim.set_usage(usage);
        Ok(RunWritten::Committed {
            cancel_requested: Engine::claimed_cancel(&claim),
            cancelled_approvals: Vec::new(),
        })
    }

    /// Ends a remote run: whether the control plane ended it under this claim.
    pub(crate) async fn end_remote(
        &self,
        run: RunId,
        steps: &[(Provenance, Step)],
        status: RunStatus,
        outcome: &str,
        usage: Option<BudgetUsage>,
    ) -> Result<bool, EngineError> {
        // What the end carries (a turn carried to it) is recorded first.
        if !steps.is_empty() {
            match self.record_remote(run, steps, usage).await? {
                RunWritten::Committed { .. } | RunWritten::CancelRequested => {}
                RunWritten::LeaseLost | RunWritten::CredentialEnded => return Ok(false),
            }
        }
        let (remote, claim) = self.remote_parts(run)?;
        let body = EndRequest {
            run_credential: claim.credential(),
            status: status.as_str().to_owned(),
            outcome: outcome.to_owned(),
            usage: usage.unwrap_or_else(|| claim.usage()),
        };
        let path = worker_wire::run_path(run, "end");
        Ok(matches!(
            answered(&path, "end", remote.post(&path, &body).await?)?,
            Answer::Ok(_)
        ))
    }

    /// Parks a remote run on the approval of `call`, which its steps record as held or as
    /// started with an unknown outcome: the approval's id, `None` when the run is not held
    /// (any more) or a cancel was requested instead (then reported on the claim).
    pub(crate) async fn park_remote(
        &self,
        run: RunId,
        call: &str,
    ) -> Result<Option<ApprovalId>, EngineError> {
        let (remote, claim) = self.remote_parts(run)?;
        let body = ParkRequest {
            run_credential: claim.credential(),
            call_id: call.to_owned(),
        };
        match remote
            .call::<ParkAnswer>(&worker_wire::run_path(run, "park"), &body)
            .await?
        {
            Answer::Ok(ParkAnswer {
                approval_id: Some(id),
                ..
            }) => id
                .parse()
                .map(Some)
                .map_err(|_| EngineError::ControlPlane(format!("`{id}` is not an approval id"))),
            Answer::Ok(_) => {
                claim.saw_cancel(true);
                Ok(None)
            }
            Answer::NotHeld => Ok(None),
        }
    }

    /// Answers a remote run's routine call, which started: the control plane starts its nested
    /// run (or finds the one an earlier attempt started), which any worker drives. The call is
    /// answered when that run has ended; until then this run parks, and is queued again when
    /// it ends.
    pub(crate) async fn call_routine_remote(
        &self,
        scope: &crate::call::CallScope<'_>,
        offered: &crate::run_tools::OfferedTool,
        pending: &wor_core::step::PendingCall,
        usage: BudgetUsage,
    ) -> Result<wor_core::run_loop::CallOutcome, EngineError> {
        let run = scope.run.id;
        let (remote, claim) = self.remote_parts(run)?;
        let body = worker_wire::NestedRequest {
            run_credential: claim.credential(),
            call_id: pending.call.id.clone(),
            usage,
        };
        match remote
            .call::<worker_wire::NestedAnswer>(&worker_wire::run_path(run, "nested"), &body)
            .await?
        {
            Answer::Ok(worker_wire::NestedAnswer::Ended { nested, usage }) => {
                claim.set_usage(usage);
                Ok(crate::nested::nested_answer(
                    scope, offered, pending, usage, &nested,
                ))
            }
            Answer::Ok(worker_wire::NestedAnswer::Parked) => {
                Ok(wor_core::run_loop::CallOutcome::Parked)
            }
            Answer::Ok(worker_wire::NestedAnswer::CancelRequested) => {
                claim.saw_cancel(true);
                Ok(wor_core::run_loop::CallOutcome::Cancelled)
            }
            Answer::NotHeld => Err(EngineError::LeaseLost),
        }
    }

    /// Why a remote run stops at tool connection `connection`, which lists tools that changed
    /// since they were pinned (`names`): the control plane is told, lists the tools itself
    /// and quarantines the connection when it sees the change too. The run fails closed
    /// either way.
    pub(crate) async fn changed_on_remote(
        &self,
        run: RunId,
        connection: &str,
        names: &[String],
    ) -> Result<String, EngineError> {
        let (remote, claim) = self.remote_parts(run)?;
        let body = worker_wire::QuarantineRequest {
            run_credential: claim.credential(),
            connection: connection.to_owned(),
        };
        let quarantined = match remote
            .call::<worker_wire::QuarantineAnswer>(&worker_wire::run_path(run, "quarantine"), &body)
            .await
        {
            Ok(Answer::Ok(answer)) => answer.quarantined,
            Ok(Answer::NotHeld) => return Err(EngineError::LeaseLost),
            // The run fails closed all the same.
            Err(error) => {
                tracing::warn!(category = "tools", run_id = %run, error = %error,
                    "the control plane was not told of a connection's changed tools");
                false
            }
        };
        Ok(if quarantined {
            format!(
                "tool connection `{connection}` is quarantined: tools changed since they were pinned: {}; an admin must review the diff and enable it again",
                names.join(", ")
            )
        } else {
            format!(
                "tool connection `{connection}` lists tools that changed since they were pinned: {}; the run fails closed (the control plane did not find the change itself, so the connection is not quarantined: an admin should review it)",
                names.join(", ")
            )
        })
    }

    /// The routine `name` a remote run's roster offers as a tool, from its claim.
    pub(crate) fn claimed_routine_tool(
        claim: &HeldClaim,
        name: &str,
    ) -> Option<worker_wire::RoutineTool> {
        claim.routine_tools.iter().find(|r| r.name == name).cloned()
    }

    /// Starts the call `approval` approved for a remote run: whether it started, `None` when
    /// the run is not held (any more).
    pub(crate) async fn use_approval_remote(
        &self,
        run: RunId,
        approval: ApprovalId,
        pin_hash: &str,
        arguments_hash: &str,
        usage: BudgetUsage,
    ) -> Result<Option<ApprovalUseAnswer>, EngineError> {
        let (remote, claim) = self.remote_parts(run)?;
        let body = UseApprovalRequest {
            run_credential: claim.credential(),
            pin_hash: pin_hash.to_owned(),
            arguments_hash: arguments_hash.to_owned(),
            usage,
        };
        match remote
            .call::<ApprovalUseAnswer>(&worker_wire::approval_use_path(run, approval), &body)
            .await?
        {
            Answer::Ok(answer) => {
                claim.saw_cancel(answer.cancel_requested);
                if answer.started {
                    claim.set_usage(usage);
                }
                Ok(Some(answer))
            }
            Answer::NotHeld => Ok(None),
        }
    }

    /// [`Engine::use_approval_remote`] as the pipeline reads a start.
    pub(crate) async fn start_approved_remote(
        &self,
        run: RunId,
        approval: ApprovalId,
        pin_hash: &str,
        arguments_hash: &str,
        usage: BudgetUsage,
    ) -> Result<wor_store::ApprovedStart, EngineError> {
        Ok(
            match self
                .use_approval_remote(run, approval, pin_hash, arguments_hash, usage)
                .await?
            {
                None => wor_store::ApprovedStart::RunNotHeld,
                Some(answer) if answer.started => wor_store::ApprovedStart::Started,
                Some(answer) if answer.cancel_requested => {
                    wor_store::ApprovedStart::CancelRequested
                }
                Some(_) => wor_store::ApprovedStart::NotUsable,
            },
        )
    }

    /// Whether this engine is a remote worker's.
    pub(crate) fn is_remote(&self) -> bool {
        self.remote.is_some()
    }

    /// Runs this worker: claims runs while a slot of `workers` is free, each waiting up to
    /// `timings.claim_wait` at the control plane, and drives each on a task of its own; says
    /// it is alive every `timings.heartbeat` while idle. When `stop` turns true it claims no
    /// more: each drive gives its run back at its next step boundary, and drives still going
    /// after `timings.drain` are aborted and their runs given back.
    pub fn spawn_remote_worker(
        &self,
        mut stop: tokio::sync::watch::Receiver<bool>,
        timings: WorkerTimings,
    ) -> tokio::task::JoinHandle<WorkerEnd> {
        let engine = self.clone();
        tokio::spawn(async move {
            let mut ended = WorkerEnd::Stopped;
            // Any request's answer can say the worker is revoked, a drive's among them while
            // every slot is taken.
            let mut revoked = engine.remote.as_ref().map(|r| r.revoked.subscribe());
            let slots = Arc::new(tokio::sync::Semaphore::new(engine.config.workers.max(1)));
            let mut drives = tokio::task::JoinSet::new();
            let mut beat = tokio::time::interval(timings.heartbeat);
            beat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let poll = engine.config.poll_interval;
            let mut backoff = poll;
            // Drives stop at their next step boundary from the moment the stop comes, even
            // while a claim is still waiting at the control plane.
            if let Some(remote) = engine.remote.clone() {
                let mut stopping = stop.clone();
                tokio::spawn(async move {
                    let _ = stopping.wait_for(|stop| *stop).await;
                    remote.draining.store(true, Ordering::Relaxed);
                });
            }
            loop {
                if *stop.borrow() {
                    break;
                }
                while drives.try_join_next().is_some() {}
                let permit = tokio::select! {
                    permit = slots.clone().acquire_owned() => permit,
                    _ = stop.changed() => break,
                    () = until_revoked(&mut revoked) => {
                        ended = WorkerEnd::Revoked;
                        break;
                    }
                };
                let Ok(permit) = permit else { break };
                // Not raced with the stop: a claim the control plane made is driven or given
                // back, never dropped.
                let asked = Instant::now();
                let claimed = engine.claim_remote(timings.claim_wait).await;
                match claimed {
                    Ok(Some(run)) => {
                        let engine = engine.clone();
                        drives.spawn(async move {
                            let id = run.id;
                            match engine.drive_claimed(run).await {
                                Ok(()) => {}
                                Err(EngineError::Stopping) => {
                                    tracing::info!(category = "run", action = "worker.handed_back",
                                        run_id = %id, "a run was given back at a step boundary");
                                }
                                Err(error) => {
                                    tracing::warn!(category = "run", run_id = %id, error = %error,
                                        "a claimed run stopped without an end");
                                }
                            }
                            drop(permit);
                        });
                        backoff = poll;
                        continue;
                    }
                    Ok(None) => backoff = poll,
                    Err(ClaimError::Revoked) => {
                        ended = WorkerEnd::Revoked;
                        break;
                    }
                    Err(error) => {
                        tracing::warn!(category = "run", action = "worker.claim_failed",
                            error = %error, "claiming a run failed");
                        backoff = backoff.saturating_mul(2).min(MAX_CLAIM_BACKOFF);
                    }
                }
                drop(permit);
                // A claim that waited at the control plane needs no pause of its own; one
                // answered at once (a control plane that does not wait, or a failure) waits
                // out the rest of the poll interval or the backoff.
                let pause = backoff.saturating_sub(asked.elapsed());
                tokio::select! {
                    biased;
                    _ = stop.changed() => break,
                    () = until_revoked(&mut revoked) => {
                        ended = WorkerEnd::Revoked;
                        break;
                    }
                    _ = beat.tick() => match engine.heartbeat().await {
                        Ok(_) => {}
                        Err(ClaimError::Revoked) => {
                            ended = WorkerEnd::Revoked;
                            break;
                        }
                        Err(error) => {
                            tracing::warn!(category = "lifecycle", action = "worker.heartbeat_failed",
                                error = %error, "the control plane did not take the heartbeat");
                        }
                    },
                    () = tokio::time::sleep(pause) => {}
                }
            }
            if ended == WorkerEnd::Revoked {
                // The revocation already put this worker's runs back in the queue, for another
                // worker to claim: its drives end now rather than at a step boundary, nothing
                // is given back (the control plane would refuse it), and the claims' secrets
                // are dropped.
                tracing::error!(
                    category = "lifecycle",
                    action = "worker.revoked",
                    "the control plane revoked this worker; it stops"
                );
                drives.abort_all();
                while drives.join_next().await.is_some() {}
                if let Some(remote) = engine.remote.as_deref() {
                    remote.held_map().clear();
                }
                return ended;
            }
            // Draining: each drive gives its run back at its next step boundary; those still
            // going after `drain` are aborted and their runs given back, to be resumed
            // elsewhere from their recorded steps.
            if let Some(remote) = engine.remote.as_deref() {
                remote.draining.store(true, Ordering::Relaxed);
            }
            let drained = tokio::time::timeout(timings.drain, async {
                while drives.join_next().await.is_some() {}
            })
            .await;
            if drained.is_err() {
                // An aborted drive forgets its claim as it is dropped: the claims are taken
                // first, and each given back (a run that ended meanwhile answers that it is
                // not held, which is only logged).
                let in_flight = engine
                    .remote
                    .as_deref()
                    .map(RemoteRuns::held_claims)
                    .unwrap_or_default();
                drives.abort_all();
                while drives.join_next().await.is_some() {}
                if let Some(remote) = engine.remote.as_deref() {
                    for claim in in_flight {
                        engine.give_back_claim(remote, &claim).await;
                    }
                }
            }
            engine.release_claimed().await;
            ended
        })
    }
}

/// Forgets a drive's claim when the drive ends, however it ends: the claim and its secrets are
/// dropped (zeroised) unless a later claim of the run replaced it.
struct ForgetClaim<'a> {
    remote: &'a RemoteRuns,
    claim: Arc<HeldClaim>,
}

impl Drop for ForgetClaim<'_> {
    fn drop(&mut self) {
        let mut map = self.remote.held_map();
        if map
            .get(&self.claim.run)
            .is_some_and(|held| Arc::ptr_eq(held, &self.claim))
        {
            map.remove(&self.claim.run);
        }
    }
}
