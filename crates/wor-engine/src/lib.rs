//! The engine: starts runs and drives them — the agent loop — on workers.
//!
//! A run is driven from its stored steps alone: every model turn and every tool result is
//! written before the next step begins, so a worker that dies leaves a run another worker (or
//! the same process after a restart) resumes where it stopped. Budgets, cancellation and the
//! wall-time deadline are checked before every step.
//!
//! Roster tools on MCP connections (over HTTP, or stdio in the sandbox), HTTP API tools and Wasm
//! components run through the pipeline of the spec (roster,
//! schema and pinned arguments, decision by Cedar policy, budget, record, execute, result). A
//! call that needs approval parks its run, holding no worker, until a person decides or the
//! approval expires. Runs also start on a schedule and on signed inbound webhooks, and run
//! webhooks tell other systems about them (`triggers.rs`); a routine used as a tool runs as a
//! nested run on its root's budget (`nested.rs`). Every call executes under the run's own
//! credential, minted at claim and expiring at the run's deadline (`authority.rs`).

mod approvals;
mod assignment;
mod authority;
mod call;
mod driver;
mod email;
mod live_text;
pub mod metrics;
mod nested;
mod notice;
mod notifications;
mod oauth_connections;
mod output;
mod pipeline;
mod remote;
mod run_tools;
mod scheduler;
mod start;
mod tool_connection_spec;
mod tool_connections;
pub mod traces;
mod triggers;
mod versions;
mod wasm_tools;
mod worker;
pub mod worker_wire;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use wor_core::budget::ModelPrice;
use wor_egress::EgressClient;
use wor_store::{AuditLog, RunWrite, StagedEvent, Store, StoreError, Vault};

pub use approvals::{Approver, ApproverRefusal, ArgumentViolation, DecisionRefusal, EditRefusal};
pub use assignment::{
    BoundCall, LeaseRenewal, MAX_WORKER_STEPS_PER_WRITE, WorkerApprovalUse, WorkerClaim,
    WorkerParked, WorkerRecorded, WorkerStepRefusal, WorkerSteps,
};
pub use email::{SMTP_PASSWORD_FIELD, SMTP_USERNAME_FIELD, SmtpSecrets};
pub use live_text::TextWatch;
pub use notice::RouteError;
pub use notifications::{
    MAX_SLACK_INTERACTION_BYTES, NOTIFICATION_ROUTES_TABLE, SLACK_BOT_TOKEN_FIELD,
    SLACK_REPLAY_WINDOW_SECS, SLACK_SIGNING_SECRET_FIELD, SlackInteraction, SlackOutcome,
    SlackRejection, SlackSecrets,
};
pub use oauth_connections::{
    AUTHORIZATION_LIFETIME_MS, FinishedAuthorization, LostAuthorization, OAUTH_CALLBACK_PATH,
    OAUTH_CLIENT_METADATA_PATH, OAuthRefusal, REFRESH_AHEAD_MS, RegisteredClient,
    StartedAuthorization,
};
pub use remote::{
    ClaimError, ControlPlaneLink, LinkAnswer, LinkError, LinkFuture, WorkerEnd, WorkerTimings,
};
pub use scheduler::{DISPATCH_AHEAD_MS, SchedulerReport};
pub use start::{DEFAULT_THREAD, Differs, StartRun, Started, Trigger};
pub use tool_connection_spec::{
    CheckedHttpTools, CheckedToolConnection, HttpToolsSource, LocalCommandRules, OpenApiSource,
    ToolConnectionSpec, ToolConnectionSpecError,
};
pub use tool_connections::{
    BEARER_TOKEN_FIELD, CommandRefusal, ConnectionError, OAUTH_ACCESS_TOKEN_FIELD, ReplacedTools,
    ReviewDiff, ReviewedTool, StoredConnectionError, ToolConnectionRefusal, ToolReview,
    check_stdio_spec, credential_slot,
};
pub use triggers::{
    InboundWebhook, MAX_DELIVERY_ATTEMPTS, MAX_WEBHOOK_BYTES, REPLAY_WINDOW_SECS, SignedHeaders,
    WebhookRejection, WebhookSecretKind,
};

/// How long an approval waits for a decision unless configured otherwise: 24 hours.
pub const DEFAULT_APPROVAL_TTL: Duration = Duration::from_secs(24 * 60 * 60);

/// How many runs one process drives at once unless configured otherwise: as many as one
/// project may run.
pub const DEFAULT_WORKERS: usize = 16;

/// How the engine runs.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Names this process's leases; unique per process.
    pub worker_id: String,
    /// How long a claimed run stays this worker's without renewal.
    pub lease: Duration,
    /// How often an idle worker looks for work.
    pub poll_interval: Duration,
    /// Prices per model id; a model without a price costs nothing.
    pub prices: BTreeMap<String, ModelPrice>,
    /// Production refuses demo-only features (the replay model).
    pub production: bool,
    /// At most this many runs of one project run at once, whatever their routines allow.
    pub max_running_per_project: u64,
    /// How many runs this process drives at once (its worker pool's slots; at least one).
    pub workers: usize,
    /// How long an approval request waits for a decision before it counts as denied.
    pub approval_ttl: Duration,
    /// Host directories (from the operator's configuration, never the API) under which stdio
    /// tool servers' programs and read-only paths may lie, besides the system runtime.
    pub stdio_allowed_roots: Vec<std::path::PathBuf>,
    /// Host paths no tool may ever see, whatever the roots allow (the server's data dir).
    pub protected_paths: Vec<std::path::PathBuf>,
    /// Where people reach the console (`https://wor.example.com`), for links in notifications;
    /// `None` leaves links out.
    pub console_url: Option<String>,
    /// The operator allows email routes to speak SMTP without TLS to a loopback relay
    /// (`[notifications] smtp_plaintext_loopback`); otherwise every relay needs STARTTLS.
    pub smtp_plaintext_loopback: bool,
    /// Certificates (DER) trusted for SMTP relays besides the platform's roots
    /// (`[notifications] smtp_ca_file`): a relay with a private CA.
    pub smtp_root_certificates: Vec<Vec<u8>>,
    /// The tool servers a run's trace context is passed to (`[traces] propagate_to`): an
    /// MCP-over-HTTP or HTTP API connection whose URL's host matches gets a `traceparent`
    /// header naming the run's trace while traces are on. Empty: no tool server learns it.
    pub trace_context_to: wor_egress::HostAllowlist,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            worker_id: format!(
                "worker-{}",
                wor_core::ids::request_id().trim_start_matches("req_")
            ),
            lease: Duration::from_secs(30),
            poll_interval: Duration::from_millis(200),
            prices: BTreeMap::new(),
            production: false,
            max_running_per_project: 16,
            workers: DEFAULT_WORKERS,
            approval_ttl: DEFAULT_APPROVAL_TTL,
            stdio_allowed_roots: Vec::new(),
            protected_paths: Vec::new(),
            console_url: None,
            smtp_plaintext_loopback: false,
            smtp_root_certificates: Vec::new(),
            trace_context_to: wor_egress::HostAllowlist::default(),
        }
    }
}

/// Why the engine could not do what it was asked. A run that fails is not an engine error:
/// it ends with status `failed` and its reason.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The caller may not decide this run's approvals (a role or separation-of-duties rule).
    #[error(transparent)]
    ApproverRefused(#[from] ApproverRefusal),
    /// A decision is not taken as sent: no reason, or the approval is no longer pending.
    #[error(transparent)]
    Decision(#[from] DecisionRefusal),
    /// An approver's edit of a held call is refused; nothing was decided.
    #[error(transparent)]
    EditRefused(#[from] EditRefusal),
    /// The run's policies (the project's, the routine's, its roster modes) do not validate:
    /// its calls cannot be decided, so it fails closed.
    #[error("the run's policies do not validate: {0}")]
    InvalidPolicies(#[source] wor_policy::PolicyError),
    /// Production refuses what the routine asks for (the scripted replay model).
    #[error("{0}")]
    RefusedInProduction(&'static str),
    /// A run's `thread` that is empty, too long or not printable.
    #[error(
        "`thread` must be 1 to {} printable characters",
        start::MAX_THREAD_CHARS
    )]
    InvalidThread,
    /// A run's `thread` for a routine that keeps no memory: it would be dropped.
    #[error(
        "`thread` names a memory thread, and this routine keeps no memory (`[memory] enabled = true` turns it on); start the run without one"
    )]
    ThreadWithoutMemory,
    /// A start's idempotency key already started a run of the routine, with other input or
    /// another thread: a different request under a key that is not its own.
    #[error(
        "idempotency key `{key}` already started run {run} of this routine with {differs}; a different request needs a key of its own"
    )]
    IdempotencyKeyReused {
        key: wor_core::run::IdempotencyKey,
        run: wor_core::RunId,
        differs: Differs,
    },
    /// A start's idempotency key is one of the project's secrets or has a secret's shape:
    /// it would be kept and shown in the clear.
    #[error(
        "the idempotency key has the shape of a secret, or is one of this project's, and a key is kept and shown in the clear; choose one that is not a credential"
    )]
    IdempotencyKeySecret,
    /// A roster entry `routine/NAME` names a routine the project does not have.
    #[error("routine `{name}` named by the roster does not exist")]
    MissingRosterRoutine { name: String },
    /// The routine's schedule does not compile (checked when it was applied).
    #[error(transparent)]
    Schedule(wor_core::schedule::ScheduleError),
    /// A webhook secret could not be made (the system's randomness failed).
    #[error("cannot make a webhook secret: {0}")]
    WebhookSecret(#[source] wor_secrets::SecretsError),
    /// A notification route that is not valid.
    #[error(transparent)]
    Route(#[from] RouteError),
    /// A change an admin asked of a tool connection is refused.
    #[error(transparent)]
    ToolConnection(#[from] ToolConnectionRefusal),
    /// An MCP authorization cannot be started or finished, or is no longer usable.
    #[error(transparent)]
    OAuth(#[from] OAuthRefusal),
    /// A tool connection cannot be used, with the reason and its source.
    #[error(transparent)]
    Connection(Box<ConnectionError>),
    /// An authorization server could not be reached or answered wrongly while authorizing a
    /// tool connection or refreshing its token.
    #[error("authorizing tool connection `{connection}`: {source}")]
    Authorization {
        connection: String,
        #[source]
        source: Box<wor_tools::oauth::OAuthError>,
    },
    /// Another process is refreshing the connection's token and did not finish in time.
    #[error(
        "the token of tool connection `{connection}` is being refreshed by another process; try again"
    )]
    RefreshInProgress { connection: String },
    /// Another worker holds the run now (this one's lease expired): this worker stops driving
    /// it and leaves its end to the holder.
    #[error("the run's lease was lost to another worker")]
    LeaseLost,
    /// This remote worker is stopping: the run stopped at a step boundary, to be given back
    /// and resumed from its steps by another claim.
    #[error("the worker is stopping; the run is given back at a step boundary")]
    Stopping,
    /// A secret could not be sealed or opened.
    #[error("the vault: {0}")]
    Vault(#[source] wor_store::VaultError),
    /// What is stored does not have the shape the engine wrote (a step, a pin, a run's
    /// record): the run fails closed rather than guess.
    #[error("stored state is not valid: {0}")]
    InvalidState(String),
    /// A nested run's task ended without an answer (it panicked or was aborted).
    #[error("the nested run's task ended abnormally: {0}")]
    NestedTask(String),
    /// The task that creates a run claimed by this process and hands it to the pool ended
    /// without an answer (it panicked, or its runtime shut down under it).
    #[error("the task starting the run ended abnormally: {0}")]
    StartTask(String),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("{0}")]
    ControlPlane(String),
}

impl From<ConnectionError> for EngineError {
    fn from(error: ConnectionError) -> Self {
        EngineError::Connection(Box::new(error))
    }
}

impl EngineError {
    /// The reason a run being driven ends as failed because of this error; `None` for an error
    /// that must not end the run (the store is unavailable: the run resumes later).
    pub(crate) fn run_failure(&self) -> Option<String> {
        match self {
            EngineError::Vault(_) => {
                Some("the project's secrets cannot be opened; the run cannot go on".to_owned())
            }
            // A run cannot go on without its policies, a tool its roster names or the
            // authorization of its connection: it fails closed.
            EngineError::InvalidPolicies(_)
            | EngineError::RefusedInProduction(_)
            | EngineError::MissingRosterRoutine { .. }
            | EngineError::OAuth(OAuthRefusal::NotAuthorized { .. })
            | EngineError::InvalidState(_)
            | EngineError::NestedTask(_)
            | EngineError::Connection(_)
            | EngineError::Authorization { .. } => Some(self.to_string()),
            // What a request asked: nothing a run being driven meets.
            EngineError::ApproverRefused(_)
            | EngineError::Decision(_)
            | EngineError::EditRefused(_)
            | EngineError::InvalidThread
            | EngineError::ThreadWithoutMemory
            | EngineError::IdempotencyKeyReused { .. }
            | EngineError::IdempotencyKeySecret
            | EngineError::Schedule(_)
            | EngineError::WebhookSecret(_)
            | EngineError::Route(_)
            | EngineError::ToolConnection(_)
            | EngineError::OAuth(_)
            // Only a start meets it, before any driver holds the run.
            | EngineError::StartTask(_)
            // The run resumes later: another worker holds it, or the store is unavailable.
            | EngineError::RefreshInProgress { .. }
            | EngineError::LeaseLost
            | EngineError::Stopping
            | EngineError::ControlPlane(_)
            | EngineError::Store(_) => None,
        }
    }
}

/// The refresh lock of each MCP connection this process has refreshed.
type OAuthRefreshLocks =
    std::collections::HashMap<wor_core::ConnectionId, Arc<tokio::sync::Mutex<()>>>;

/// The engine: cheap to clone, shared by the API and the workers.
#[derive(Debug, Clone)]
pub struct Engine {
    store: Store,
    vault: Vault,
    egress: EgressClient,
    /// The client model calls go out through: `egress`'s policy plus the operator's
    /// `[egress] model_cidrs`, which no tool, webhook or sandbox traffic may reach.
    model_egress: EgressClient,
    /// Where the engine's security events are recorded (S12).
    audit: AuditLog,
    config: Arc<EngineConfig>,
    /// Starts stdio tool servers; without it, stdio connections are refused.
    sandbox: Option<wor_sandbox::Sandbox>,
    /// Runs Wasm tool components.
    wasm: wor_wasm::WasmHost<wor_core::ProjectId>,
    /// Wakes this process's idle worker pool: a run was queued or one ended.
    work: Arc<tokio::sync::Notify>,
    /// The same news for every remote worker's claim waiting here (`claim_for_worker_within`).
    work_seen: Arc<tokio::sync::watch::Sender<()>>,
    /// This process's worker pool: its slots, and the way in for runs started here.
    pool: Arc<worker::Pool>,
    /// The model text of runs driven here, redacted, for people watching them.
    live_text: live_text::LiveText,
    /// Routine versions read so far (they never change).
    versions: Arc<versions::VersionCache>,
    /// One lock per MCP connection whose token this process refreshes.
    oauth_refreshes: Arc<std::sync::Mutex<OAuthRefreshLocks>>,
    /// Per run driven here: a model turn recorded but not yet committed, which the run's next
    /// journal write carries ([`Engine::carry`]).
    carried: Arc<std::sync::Mutex<std::collections::HashMap<wor_core::RunId, RunWrite>>>,
    /// Runs whose announcements this process has queued, to be marked so in the database
    /// together ([`Engine::mark_announced`]).
    announced: Arc<std::sync::Mutex<driver::AnnouncedRuns>>,
    /// Set for a remote worker's engine: the runs it claimed and how it reaches the control
    /// plane (`remote.rs`).
    remote: Option<Arc<remote::RemoteRuns>>,
}

impl Engine {
    pub fn new(
        store: Store,
        vault: Vault,
        egress: EgressClient,
        audit: AuditLog,
        config: EngineConfig,
    ) -> Self {
        let pool = Arc::new(worker::Pool::new(config.workers));
        Engine {
            store,
            vault,
            model_egress: egress.clone(),
            egress,
            audit,
            config: Arc::new(config),
            sandbox: None,
            wasm: wor_wasm::WasmHost::default(),
            work: Arc::new(tokio::sync::Notify::new()),
            work_seen: Arc::new(tokio::sync::watch::Sender::new(())),
            pool,
            live_text: live_text::LiveText::default(),
            versions: Arc::default(),
            oauth_refreshes: Arc::default(),
            carried: Arc::default(),
            announced: Arc::default(),
            remote: None,
        }
    }

    /// Lets the engine start stdio tool servers, always inside `sandbox`.
    #[must_use]
    pub fn with_sandbox(mut self, sandbox: wor_sandbox::Sandbox) -> Self {
        self.sandbox = Some(sandbox);
        self
    }

    /// Sends model calls through `model_egress` (built from the policy's
    /// [`for_models`](wor_egress::EgressPolicy::for_models)) instead of the tools' client.
    #[must_use]
    pub fn with_model_egress(mut self, model_egress: EgressClient) -> Self {
        self.model_egress = model_egress;
        self
    }

    /// Checks that a model connection may go without an API key: its base URL reaches only
    /// addresses the operator listed in `[egress] model_cidrs` (S6).
    pub async fn vet_keyless_model_url(
        &self,
        url: &str,
    ) -> Result<(), wor_egress::KeylessModelRefusal> {
        self.model_egress.vet_keyless_model(url).await.map(|_| ())
    }

    /// The redacted text of `run`'s model calls while this process drives it: what the call
    /// under way has written so far, then each delta; the channel closes when the run ends
    /// here.
    pub fn watch_text(&self, run: wor_core::RunId) -> TextWatch {
        self.live_text.subscribe(run)
    }

    pub fn audit(&self) -> &AuditLog {
        &self.audit
    }

    /// Appends the entries `staged` with their changes. The changes are made and their entries
    /// are on disk, staged: a failed append is logged and left to the audit writer's sweep,
    /// and the caller goes on as after a change made (an error would invite it to make it
    /// again).
    pub async fn append_staged_or_log(&self, staged: impl IntoIterator<Item = StagedEvent>) {
        let staged: Vec<StagedEvent> = staged.into_iter().collect();
        let Some(first) = staged.first() else {
            return;
        };
        let (project, action) = (first.event().project_id(), first.event().category());
        // The rows an operator can find in `audit_staged`, should the append fail.
        let ids: Vec<String> = staged.iter().map(|s| s.id().to_owned()).collect();
        if let Err(error) = self.audit.append_staged(staged).await {
            tracing::error!(category = "audit", project_id = %project, action = %action,
                staged_ids = ?ids, kind = error.kind(),
                "an entry staged with its change could not be appended; it stays staged for the audit writer's sweep");
        }
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    pub fn vault(&self) -> &Vault {
        &self.vault
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Vets the base URL of a model connection with an API key when it is made, with the
    /// egress policy model calls are sent under (the operator's model ranges open); see
    /// [`EgressClient::vet_destination`]. A keyless one is vetted by
    /// [`Engine::vet_keyless_model_url`].
    pub fn vet_model_url(&self, url: &str) -> Result<(), Box<wor_egress::EgressDenial>> {
        self.model_egress.vet_destination(url).map(|_| ())
    }

    /// Vets a routine's run webhook destination (`notify.url`) when the routine is applied,
    /// with the egress policy its deliveries are sent under; see
    /// [`EgressClient::vet_destination`].
    pub fn vet_notify_url(&self, url: &str) -> Result<(), Box<wor_egress::EgressDenial>> {
        self.egress.vet_destination(url).map(|_| ())
    }
}
