//! The audit chain's storage: the one writer, with group commit and signed checkpoints, and
//! the reads that export and verify it.
//!
//! [`AuditLog`] is a handle to the writer. An append goes through its channel; the writer takes
//! whatever is queued (up to a batch size), writes it in one transaction in arrival order and
//! answers each caller once that transaction has committed. On SQLite, a run's journal write
//! that is the only one under way and finds the writer idle is committed by its caller instead,
//! on its own thread, with the writer's connection and under the same lock: a lone write then
//! costs no hand-off to the writer's thread and back (see [`AuditLog::record`]). The chain's
//! head is read inside the transaction, after taking the project's lock — the database's write
//! lock on SQLite (`BEGIN IMMEDIATE`), a transaction-scoped advisory lock on PostgreSQL — so
//! the chain stays correct across restarts and across several server processes sharing one
//! database.
//!
//! INVARIANT: nothing else in the workspace inserts into `audit_entries` or
//! `audit_checkpoints`, and nothing updates or deletes them (triggers refuse it).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use ed25519_dalek::VerifyingKey;
use sha2::{Digest as _, Sha256};
use sqlx::Row;
use tokio::sync::{Mutex, Notify, mpsc, oneshot};
use wor_core::ProjectId;
use wor_core::audit::{
    Anchor, AuditCheckpoint, AuditEntry, AuditEvent, ChainVerifier, GENESIS_HASH, Verification,
    checkpoint_message, key_id,
};
use wor_secrets::{AuditSigningKey, redact_shapes_json};

use crate::exec::{EmbeddedWriter, Exec};
use crate::journal::{RunWrite, RunWritten};
use crate::staged::StagedEvent;
use crate::wal::{Acknowledgement, AfterCommit, WAL_SYNC, WalCheckpointer, sync_wal, wal_log};
use crate::{Backend, Durability, HeldConnection, Store, StoreError, now_millis, parse_column};

/// When the writer signs checkpoints and how much it commits at once.
#[derive(Debug, Clone)]
pub struct AuditConfig {
    /// Sign a project's head once this many entries follow its last checkpoint.
    pub checkpoint_every: i64,
    /// Sign the head of every project appended to since the last checkpoint this often.
    pub checkpoint_interval: Duration,
    /// At most this many appends share one transaction.
    pub max_batch: usize,
    /// How long an event staged with its change is left to its caller's own append before the
    /// writer's sweep appends it (`crate::staged`).
    pub staged_grace: Duration,
}

impl Default for AuditConfig {
    fn default() -> Self {
        AuditConfig {
            checkpoint_every: 256,
            checkpoint_interval: Duration::from_secs(60),
            max_batch: 512,
            staged_grace: Duration::from_secs(5),
        }
    }
}

/// Where an appended entry landed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditReceipt {
    pub seq: i64,
    pub hash: String,
}

enum Command {
    Append {
        event: AuditEvent,
        reply: oneshot::Sender<Result<AuditReceipt, StoreError>>,
    },
    Checkpoint {
        reply: oneshot::Sender<Result<(), StoreError>>,
    },
    Record {
        write: Box<RunWrite>,
        reply: oneshot::Sender<Result<RunWritten, StoreError>>,
    },
    /// Events staged with the changes they record: each appended unless its row is gone.
    Release {
        staged: Vec<StagedEvent>,
        reply: oneshot::Sender<Result<(), StoreError>>,
    },
}

/// The handle through which everything is appended to the audit log. Cheap to clone.
#[derive(Clone)]
pub struct AuditLog {
    sender: mpsc::Sender<Command>,
    /// The writer, locked by whoever commits a batch: its own loop, or a caller whose write
    /// was alone and found it idle.
    writer: Arc<tokio::sync::Mutex<Writer>>,
    /// Journal writes submitted and not yet answered (a synced one until its flush), from
    /// every handle: a write commits itself only when it is the one alone
    /// ([`AuditLog::submit`]).
    in_flight: Arc<AtomicUsize>,
    verifying_key: VerifyingKey,
    /// The writer's [`AuditConfig::max_batch`].
    max_batch: usize,
}

impl std::fmt::Debug for AuditLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AuditLog")
            .field("verifying_key", &self.verifying_key)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Command::Append { event, .. } => write!(f, "Append({})", event.category()),
            Command::Checkpoint { .. } => f.write_str("Checkpoint"),
            Command::Record { write, .. } => write!(f, "Record({})", write.run),
            Command::Release { staged, .. } => write!(f, "Release({})", staged.len()),
        }
    }
}

impl AuditLog {
    /// Starts the writer: on SQLite on a thread of its own, otherwise as a task of the current
    /// tokio runtime. It runs until every handle is dropped.
    pub fn start(store: Store, key: AuditSigningKey, config: AuditConfig) -> AuditLog {
        let max_batch = config.max_batch.max(1);
        let (sender, receiver) = mpsc::channel(max_batch * 4);
        let verifying_key = key.verifying_key();
        let writer = Writer {
            chain: Chain {
                backend: store.backend,
                key_id: key_id(&verifying_key),
                key,
                checkpoint_every: config.checkpoint_every,
                unsigned: BTreeSet::new(),
                signed: Vec::new(),
            },
            store,
            config,
            connection: std::sync::Mutex::new(Connection::Pool(None)),
            wal: None,
            checkpoints: None,
            restart_not_before: None,
            restart_wanted: Arc::new(Notify::new()),
        };
        let backend = writer.store.backend;
        let writer = Arc::new(Mutex::new(writer));
        Writer::spawn(writer.clone(), backend, receiver);
        AuditLog {
            sender,
            writer,
            in_flight: Arc::new(AtomicUsize::new(0)),
            verifying_key,
            max_batch,
        }
    }

    /// Hands `command` to the writer or, when it can be committed here without waiting for
    /// anything, commits it: when it is the only journal write under way (`alone`), the writer is
    /// idle, commits on its own connection to SQLite, and this process's turn to write is free. A
    /// write beside others goes to the writer even when it is idle: the writer commits the writes
    /// that queue meanwhile in one transaction, where each committing alone on its caller's thread
    /// would cost a commit apiece and hold a thread of the runtime for each (under 32 runs at once,
    /// about a sixth of the server's CPU per call; BENCHMARKS.md). A lone write is written on the
    /// caller's thread, which it blocks for that transaction: its statements run synchronously and
    /// never yield, so a caller's future dropped meanwhile cannot leave a transaction or the writer
    /// half done. The one wait left is for a write lock another process on the same file holds,
    /// before `BEGIN`: awaited between tries, so it blocks no thread, and a caller dropped
    /// meanwhile has begun nothing. Otherwise — another write under way, a busy writer, a taken
    /// turn, or a writer on the pool (PostgreSQL, where a statement awaits the server) — the
    /// command goes through the writer's channel, in order with the rest.
    async fn submit(&self, command: Command, alone: bool) -> Result<(), StoreError> {
        if alone
            && let Ok(mut writer) = self.writer.try_lock()
            && writer.commits_on_own_connection()
            && let Some(turn) = writer.store.try_write_turn()
        {
            writer
                .handle(vec![command], Committer::Caller, Some(HeldTurn(turn)))
                .await;
            return Ok(());
        }
        self.queue(command).await
    }

    /// Hands `command` to the writer's channel: once queued, it is committed even if the
    /// caller is dropped.
    async fn queue(&self, command: Command) -> Result<(), StoreError> {
        self.sender
            .send(command)
            .await
            .map_err(|_| StoreError::AuditStopped)
    }

    /// Appends `event` to its project's chain and returns once it is committed. It always
    /// goes through the writer's channel: once queued, it is committed even when the caller
    /// (an API request whose client hung up) is dropped.
    pub async fn append(&self, event: AuditEvent) -> Result<AuditReceipt, StoreError> {
        let (reply, answer) = oneshot::channel();
        self.queue(Command::Append { event, reply }).await?;
        answer.await.map_err(|_| StoreError::AuditStopped)?
    }

    /// Appends the events `staged` with the changes they record, in order, and deletes their
    /// staged rows in the same transaction; returns once that is committed. An event whose row
    /// is gone was appended already, by the writer's sweep (here or in another process), and is
    /// not appended again. Like [`AuditLog::append`], it always goes through the writer's
    /// channel, in commands of at most a batch's events each. A failure leaves the rows for the
    /// sweep of a running writer (this one, or the next to start), after its grace
    /// ([`AuditConfig::staged_grace`]) and at its next checkpoint interval.
    pub async fn append_staged(&self, staged: Vec<StagedEvent>) -> Result<(), StoreError> {
        let mut answers = Vec::new();
        let mut staged = staged.into_iter().peekable();
        while staged.peek().is_some() {
            let chunk = staged.by_ref().take(self.max_batch).collect();
            let (reply, answer) = oneshot::channel();
            self.queue(Command::Release {
                staged: chunk,
                reply,
            })
            .await?;
            answers.push(answer);
        }
        for answer in answers {
            answer.await.map_err(|_| StoreError::AuditStopped)??;
        }
        Ok(())
    }

    /// Records a run's step (steps, usage, audit entries) in one transaction, shared with
    /// whatever else is queued, and returns once it is committed; see [`RunWrite`]. On
    /// SQLite, a write that is alone and finds the writer idle is committed by its caller
    /// ([`AuditLog::submit`]). A write is under way, for that rule, until it is answered: a
    /// synced one until the log's flush. A write committed by its caller is made whole or not
    /// at all; a queued one is committed even if its caller is dropped meanwhile. Either way
    /// a run resumed goes on from the steps on record, as after a crash.
    pub async fn record(&self, write: RunWrite) -> Result<RunWritten, StoreError> {
        let (_under_way, others) = UnderWay::enter(&self.in_flight);
        let (reply, answer) = oneshot::channel();
        self.submit(
            Command::Record {
                write: Box::new(write),
                reply,
            },
            others == 0,
        )
        .await?;
        answer.await.map_err(|_| StoreError::AuditStopped)?
    }

    /// Signs the head of every project this writer appended to since its last checkpoint, now.
    /// Called before a process exits, so what it wrote does not stay unsigned.
    pub async fn checkpoint(&self) -> Result<(), StoreError> {
        let (reply, answer) = oneshot::channel();
        self.queue(Command::Checkpoint { reply }).await?;
        answer.await.map_err(|_| StoreError::AuditStopped)?
    }

    /// The public key that verifies this writer's checkpoints.
    pub fn verifying_key(&self) -> VerifyingKey {
        self.verifying_key
    }
}

/// A journal write counted as under way until it is answered or its caller is dropped.
struct UnderWay<'a>(&'a AtomicUsize);

impl<'a> UnderWay<'a> {
    /// Counts one more write under way, and says how many others were.
    fn enter(count: &'a AtomicUsize) -> (Self, usize) {
        let others = count.fetch_add(1, Ordering::AcqRel);
        (UnderWay(count), others)
    }
}

impl Drop for UnderWay<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

struct Writer {
    store: Store,
    config: AuditConfig,
    chain: Chain,
    /// The connection the writer commits its batches on (behind a mutex, which keeps `Writer`
    /// `Sync` though a rusqlite connection is not; only whoever holds the writer reaches it).
    connection: std::sync::Mutex<Connection>,
    /// On SQLite with a database file: where synced batches wait for the write-ahead log to
    /// reach the disk, outside the database's write lock (see [`sync_wal`]).
    wal: Option<mpsc::UnboundedSender<Acknowledgement>>,
    /// On SQLite with a database file: what copies the log into the database file, told of
    /// each commit.
    checkpoints: Option<WalCheckpointer>,
    /// No restart of the log is tried before this: readers kept the last one.
    restart_not_before: Option<std::time::Instant>,
    /// A caller's commit found the log due for a restart, which the writer's loop does: it
    /// may wait for readers, and a caller's thread is not blocked for that.
    restart_wanted: Arc<Notify>,
}

/// This process's turn to write ([`Store::try_write_turn`]), taken by a caller that commits
/// its own write, for the transaction it commits in.
struct HeldTurn(Option<tokio::sync::OwnedMutexGuard<()>>);

/// Who commits a batch: the writer's loop, on a thread (or task) of its own, or a caller
/// whose write was alone and found the writer idle ([`AuditLog::submit`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Committer {
    Writer,
    Caller,
}

impl Committer {
    fn as_str(self) -> &'static str {
        match self {
            Committer::Writer => "queued",
            Committer::Caller => "direct",
        }
    }
}

/// The connection the writer commits on.
enum Connection {
    /// A connection of the store's pool, kept from one batch to the next (`None` before the
    /// first batch and after a failed one).
    Pool(Option<HeldConnection>),
    /// On SQLite with a database file in WAL mode, when the writer runs on a thread of its
    /// own: the writer's own connection, on which a batch runs without a hand-off to another
    /// thread per statement.
    Embedded(EmbeddedWriter),
}

/// The audit chain as this writer keeps it: how it signs, and which projects' heads are
/// still unsigned.
struct Chain {
    backend: Backend,
    key: AuditSigningKey,
    key_id: String,
    /// Sign a project's head once this many entries follow its last checkpoint.
    checkpoint_every: i64,
    /// Projects with entries this writer appended after their last checkpoint.
    unsigned: BTreeSet<ProjectId>,
    /// Projects whose head the batch being written signed.
    signed: Vec<ProjectId>,
}

/// What the writer does in one transaction, on whichever connection it has.
trait Work {
    type Output;

    /// The projects whose chain the work may append to or sign, in id order: on PostgreSQL
    /// their chain locks are taken with the transaction's `BEGIN`.
    fn chains(&self, chain: &Chain) -> BTreeSet<ProjectId>;

    /// Does the work in `exec`'s transaction, which took the chain locks of `locked` with its
    /// `BEGIN` (on PostgreSQL; none on SQLite, whose write lock is every chain's).
    async fn run(
        self,
        chain: &mut Chain,
        exec: &mut impl Exec,
        locked: &BTreeSet<ProjectId>,
    ) -> Result<Self::Output, StoreError>;
}

/// A batch: the run writes (each fenced) and then every audit entry: `events`, those of
/// `staged` whose rows it deletes, and those of the run writes that passed their fence.
struct BatchWork {
    events: Vec<AuditEvent>,
    staged: Vec<StagedEvent>,
    writes: Vec<RunWrite>,
}

impl Work for BatchWork {
    type Output = (Vec<AuditReceipt>, Vec<RunWritten>);

    fn chains(&self, _: &Chain) -> BTreeSet<ProjectId> {
        self.events
            .iter()
            .chain(self.staged.iter().map(StagedEvent::event))
            .chain(self.writes.iter().flat_map(|write| &write.audit))
            .map(AuditEvent::project_id)
            .collect()
    }

    async fn run(
        self,
        chain: &mut Chain,
        exec: &mut impl Exec,
        locked: &BTreeSet<ProjectId>,
    ) -> Result<Self::Output, StoreError> {
        let BatchWork {
            mut events,
            staged,
            writes,
        } = self;
        events.extend(crate::staged::release(exec, staged).await?);
        let at = now_millis();
        let mut written = Vec::with_capacity(writes.len());
        for write in writes {
            let outcome = crate::journal::write_run(exec, chain.backend, &write, at).await?;
            if matches!(outcome, RunWritten::Committed { .. }) {
                events.extend(write.audit);
            }
            written.push(outcome);
        }
        let receipts = chain.append_batch(exec, events, at, locked).await?;
        Ok((receipts, written))
    }
}

/// Signs the head of every project with entries after its last checkpoint.
struct CheckpointWork;

impl Work for CheckpointWork {
    type Output = ();

    fn chains(&self, chain: &Chain) -> BTreeSet<ProjectId> {
        chain.unsigned.clone()
    }

    async fn run(
        self,
        chain: &mut Chain,
        exec: &mut impl Exec,
        locked: &BTreeSet<ProjectId>,
    ) -> Result<(), StoreError> {
        let at = now_millis();
        for project in chain.unsigned.clone() {
            let head = lock_head(exec, chain.backend, project, locked).await?;
            if head.seq > head.checkpoint_seq {
                chain
                    .insert_checkpoint(exec, project, head.seq, &head.hash, at)
                    .await?;
            }
        }
        Ok(())
    }
}

type Replies = Vec<oneshot::Sender<Result<AuditReceipt, StoreError>>>;

/// A batch the writer committed: the receipts of its appends, what became of its run writes,
/// and whether it is acknowledged only once the log syncer has it on disk.
struct Committed {
    receipts: Vec<AuditReceipt>,
    written: Vec<RunWritten>,
    awaits_sync: bool,
}

impl Writer {
    /// Starts the writer: on SQLite on a thread of its own, where it may drive its own
    /// connection synchronously ([`Connection::Embedded`]); on PostgreSQL, or when that thread
    /// cannot start, as a task of the current runtime on a connection of the pool.
    fn spawn(this: Arc<Mutex<Writer>>, backend: Backend, receiver: mpsc::Receiver<Command>) {
        let runtime = tokio::runtime::Handle::current();
        if backend != Backend::Sqlite {
            runtime.spawn(Writer::run(this, receiver, runtime.clone(), false));
            return;
        }
        let (sender, start) =
            std::sync::mpsc::channel::<(Arc<Mutex<Writer>>, mpsc::Receiver<Command>)>();
        let shared = runtime.clone();
        let thread = std::thread::Builder::new()
            .name("wor-audit-log".to_owned())
            .spawn(move || {
                let Ok((writer, receiver)) = start.recv() else {
                    return;
                };
                match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(own) => own.block_on(Writer::run(writer, receiver, shared, true)),
                    Err(_) => {
                        tracing::warn!(
                            category = "audit",
                            "the audit writer's runtime cannot start; it runs as a task"
                        );
                        let on = shared.clone();
                        on.spawn(Writer::run(writer, receiver, shared, false));
                    }
                }
            });
        match thread {
            Ok(_) => {
                if let Err(unsent) = sender.send((this, receiver)) {
                    let (writer, receiver) = unsent.0;
                    runtime.spawn(Writer::run(writer, receiver, runtime.clone(), false));
                }
            }
            Err(_) => {
                tracing::warn!(
                    category = "audit",
                    "the audit writer's thread cannot start; it runs as a task"
                );
                runtime.spawn(Writer::run(this, receiver, runtime.clone(), false));
            }
        }
    }

    /// The writer's loop. `shared` is the process's runtime, where the log syncer runs;
    /// `own_thread` says whether this loop has a thread to itself, which it may then block
    /// on its own connection's statements. The loop holds the writer while it opens its
    /// connection: until then a caller's write goes through the channel.
    async fn run(
        writer: Arc<Mutex<Writer>>,
        mut receiver: mpsc::Receiver<Command>,
        shared: tokio::runtime::Handle,
        own_thread: bool,
    ) {
        let mut this = writer.clone().lock_owned().await;
        // Read on the process's runtime, whose tasks the pool's connections go back to.
        let store = this.store.clone();
        let log = shared
            .spawn(async move { wal_log(&store).await })
            .await
            .ok()
            .flatten();
        if let Some(log) = log {
            if own_thread {
                // The writer's own connection leaves checkpoints to the checkpointer; a pool
                // connection checkpoints as it commits, as SQLite does by default.
                let opened = EmbeddedWriter::open(&log.database).map(|mut embedded| {
                    let checkpoints = WalCheckpointer::start(&log.database)
                        .map_err(|err| err.kind())
                        .and_then(|checkpoints| {
                            embedded
                                .leave_checkpoints_to_checkpointer()
                                .map(|()| checkpoints)
                                .map_err(|err| err.kind())
                        });
                    match checkpoints {
                        Ok(checkpoints) => this.checkpoints = Some(checkpoints),
                        Err(kind) => tracing::warn!(
                            category = "audit",
                            kind,
                            "the write-ahead log's checkpointer cannot start; SQLite checkpoints it as the writer commits"
                        ),
                    }
                    embedded
                });
                match opened {
                    Ok(embedded) => {
                        *this
                            .connection
                            .get_mut()
                            .unwrap_or_else(std::sync::PoisonError::into_inner) =
                            Connection::Embedded(embedded);
                    }
                    Err(err) => tracing::warn!(
                        category = "audit",
                        kind = err.kind(),
                        "the audit writer cannot open its own connection; it writes through the pool"
                    ),
                }
            }
            let (sender, waiting) = mpsc::unbounded_channel();
            shared.spawn(sync_wal(log, waiting));
            this.wal = Some(sender);
        }
        let mut ticker = tokio::time::interval(this.config.checkpoint_interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticker.tick().await;
        let restart_wanted = this.restart_wanted.clone();
        // What a crash left staged is appended before anything else this writer commits, and
        // what it left too recently for that once the grace has passed, before the first
        // checkpoint interval.
        this.sweep_staged(&shared).await;
        let after_grace = tokio::time::sleep(this.config.staged_grace);
        tokio::pin!(after_grace);
        let mut swept_after_grace = false;
        drop(this);
        loop {
            tokio::select! {
                () = &mut after_grace, if !swept_after_grace => {
                    swept_after_grace = true;
                    writer.lock().await.sweep_staged(&shared).await;
                }
                command = receiver.recv() => {
                    let Some(command) = command else { break };
                    // Waiting here, the loop is next to get the writer: a caller's attempt to
                    // commit its own write fails meanwhile, and its write queues behind.
                    let mut this = writer.lock().await;
                    let mut batch = vec![command];
                    while batch.len() < this.config.max_batch {
                        match receiver.try_recv() {
                            Ok(command) => batch.push(command),
                            Err(_) => break,
                        }
                    }
                    this.handle(batch, Committer::Writer, None).await;
                }
                _ = ticker.tick() => {
                    let mut this = writer.lock().await;
                    this.sweep_staged(&shared).await;
                    let _ = this.checkpoint_unsigned().await;
                }
                () = restart_wanted.notified() => {
                    writer.lock().await.restart_log();
                }
            }
        }
        let _ = writer.lock().await.checkpoint_unsigned().await;
    }

    /// Appends every event left staged (`audit_staged`) longer than the grace whose change's
    /// caller did not append it: after a crash between the two, or a failed append. Rows read
    /// on `shared`, the process's runtime, where the pool's connections answer; each page
    /// appended in one batch, and a page that fails row by row, so that one event that cannot be
    /// appended holds up no other. An event a caller or another process appends meanwhile is
    /// appended once all the same ([`crate::staged::release`]).
    async fn sweep_staged(&mut self, shared: &tokio::runtime::Handle) {
        let grace = i64::try_from(self.config.staged_grace.as_millis()).unwrap_or(i64::MAX);
        let older_than = now_millis().saturating_sub(grace);
        let mut after: Option<String> = None;
        loop {
            let Some((staged, next)) = self.staged_page(shared, after.clone(), older_than).await
            else {
                return;
            };
            if !staged.is_empty() {
                tracing::warn!(
                    category = "audit",
                    staged = staged.len(),
                    "appending audit events left staged by changes whose own append did not happen"
                );
                if self.release_swept(staged).await.is_err() {
                    // Row by row: the page read again, each event in a batch of its own.
                    let Some((staged, _)) =
                        self.staged_page(shared, after.clone(), older_than).await
                    else {
                        return;
                    };
                    for one in staged {
                        let id = one.id.clone();
                        if let Err(error) = self.release_swept(vec![one]).await {
                            tracing::error!(category = "audit", staged_id = %id, kind = error.kind(),
                                "a staged audit event cannot be appended; it stays in audit_staged");
                        }
                    }
                }
            }
            match next {
                Some(last) => after = Some(last),
                None => return,
            }
        }
    }

    /// A page of staged rows for the sweep (see [`Store::staged_page`]), read on `shared`;
    /// `None` when it cannot be read, which is logged.
    async fn staged_page(
        &self,
        shared: &tokio::runtime::Handle,
        after: Option<String>,
        older_than: i64,
    ) -> Option<(Vec<StagedEvent>, Option<String>)> {
        let store = self.store.clone();
        let page = shared
            .spawn(async move { store.staged_page(after.as_deref(), older_than).await })
            .await;
        match page {
            Ok(Ok(page)) => Some(page),
            Ok(Err(error)) => {
                tracing::error!(
                    category = "audit",
                    kind = error.kind(),
                    "staged audit events cannot be read; the sweep is tried again at the next checkpoint interval"
                );
                None
            }
            Err(_) => None,
        }
    }

    /// Appends `staged` for the sweep, as one batch, and waits until it is acknowledged.
    async fn release_swept(&mut self, staged: Vec<StagedEvent>) -> Result<(), StoreError> {
        let (reply, answer) = oneshot::channel();
        self.handle(
            vec![Command::Release { staged, reply }],
            Committer::Writer,
            None,
        )
        .await;
        answer.await.map_err(|_| StoreError::AuditStopped)?
    }

    /// Whether batches commit on the writer's own connection to SQLite, whose statements run
    /// synchronously: only then may a caller commit its own ([`AuditLog::submit`]).
    fn commits_on_own_connection(&mut self) -> bool {
        matches!(
            *self
                .connection
                .get_mut()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
            Connection::Embedded(_)
        )
    }

    /// Commits `batch`, by `committer`, which may hold this process's turn to write already.
    async fn handle(&mut self, batch: Vec<Command>, committer: Committer, turn: Option<HeldTurn>) {
        let mut events = Vec::new();
        let mut replies: Replies = Vec::new();
        let mut records = Vec::new();
        let mut checkpoint_replies = Vec::new();
        let mut staged = Vec::new();
        let mut staged_replies = Vec::new();
        for command in batch {
            match command {
                Command::Append { event, reply } => {
                    events.push(event);
                    replies.push(reply);
                }
                Command::Record { write, reply } => records.push((write, reply)),
                Command::Checkpoint { reply } => checkpoint_replies.push(reply),
                Command::Release {
                    staged: mut more,
                    reply,
                } => {
                    staged.append(&mut more);
                    staged_replies.push(reply);
                }
            }
        }
        let mut after_commit = AfterCommit::Nothing;
        if !events.is_empty() || !records.is_empty() || !staged.is_empty() {
            let count = events.len() + records.len() + staged.len();
            let (writes, record_replies): (Vec<_>, Vec<_>) = records
                .into_iter()
                .map(|(write, reply)| (*write, reply))
                .unzip();
            let began = std::time::Instant::now();
            let committed = self.commit_batch(events, staged, writes, turn).await;
            crate::metrics::audit_batch(count, began.elapsed(), committed.is_ok());
            if committed.is_ok() {
                crate::metrics::audit_batch_committed(committer.as_str());
            }
            after_commit = match (&committed, &self.checkpoints) {
                (Ok(_), Some(checkpoints)) => checkpoints.committed(),
                _ => AfterCommit::Nothing,
            };
            match committed {
                Ok(Committed {
                    receipts,
                    written,
                    awaits_sync,
                }) => {
                    let acknowledge: Acknowledgement = Box::new(move |synced| match synced {
                        Ok(()) => {
                            for (reply, receipt) in replies.into_iter().zip(receipts) {
                                let _ = reply.send(Ok(receipt));
                            }
                            for (reply, written) in record_replies.into_iter().zip(written) {
                                let _ = reply.send(Ok(written));
                            }
                            for reply in staged_replies {
                                let _ = reply.send(Ok(()));
                            }
                        }
                        Err(kind) => {
                            for reply in replies {
                                let _ = reply.send(Err(StoreError::AuditWrite(kind)));
                            }
                            for reply in record_replies {
                                let _ = reply.send(Err(StoreError::AuditWrite(kind)));
                            }
                            for reply in staged_replies {
                                let _ = reply.send(Err(StoreError::AuditWrite(kind)));
                            }
                        }
                    });
                    match (&self.wal, awaits_sync) {
                        (Some(wal), true) => {
                            if let Err(unsent) = wal.send(acknowledge) {
                                (unsent.0)(Err(WAL_SYNC));
                            }
                        }
                        _ => acknowledge(Ok(())),
                    }
                }
                Err(err) => {
                    tracing::error!(
                        category = "audit",
                        batch = count,
                        kind = err.kind(),
                        "audit append failed"
                    );
                    for reply in replies {
                        let _ = reply.send(Err(StoreError::AuditWrite(err.kind())));
                    }
                    for reply in record_replies {
                        let _ = reply.send(Err(StoreError::AuditWrite(err.kind())));
                    }
                    for reply in staged_replies {
                        let _ = reply.send(Err(StoreError::AuditWrite(err.kind())));
                    }
                }
            }
        }
        match after_commit {
            AfterCommit::Nothing => {}
            AfterCommit::RestartLog if committer == Committer::Writer => self.restart_log(),
            AfterCommit::RestartLog => self.restart_wanted.notify_one(),
            AfterCommit::Stopped => self.checkpoint_as_it_commits(),
        }
        if !checkpoint_replies.is_empty() {
            let result = self.checkpoint_unsigned().await;
            for reply in checkpoint_replies {
                let _ = reply.send(
                    result
                        .as_ref()
                        .map(|_| ())
                        .map_err(|e| StoreError::AuditWrite(e.kind())),
                );
            }
        }
    }

    /// Restarts SQLite's log on the writer's own connection, as the checkpointer asked
    /// ([`crate::wal::WalCheckpointer`]); one that readers kept, or that failed, is left to
    /// the next request.
    fn restart_log(&mut self) {
        let now = std::time::Instant::now();
        if self.restart_not_before.is_some_and(|at| now < at) {
            return;
        }
        let mut connection = self
            .connection
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Connection::Embedded(embedded) = &mut *connection {
            match embedded.restart_log() {
                Ok(true) => self.restart_not_before = None,
                Ok(false) => {
                    self.restart_not_before = Some(now + crate::wal::RESTART_BACKOFF);
                    tracing::debug!(
                        category = "audit",
                        "readers kept the write-ahead log; its restart is tried again"
                    );
                }
                Err(err) => tracing::warn!(
                    category = "audit",
                    kind = err.kind(),
                    "the write-ahead log could not be restarted; it is tried again"
                ),
            }
        }
    }

    /// The checkpointer's thread has ended: the writer's own connection checkpoints the log
    /// as it commits again, so that the log cannot grow without end.
    fn checkpoint_as_it_commits(&mut self) {
        self.checkpoints = None;
        tracing::error!(
            category = "audit",
            "the write-ahead log's checkpointer stopped; SQLite checkpoints it as the writer commits"
        );
        let mut connection = self
            .connection
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Connection::Embedded(embedded) = &mut *connection
            && let Err(err) = embedded.checkpoint_as_it_commits()
        {
            tracing::error!(
                category = "audit",
                kind = err.kind(),
                "the writer's connection cannot checkpoint the log either"
            );
        }
    }

    /// Writes the runs' steps and then every audit entry — `events`, those of `staged` not
    /// appended yet, and those of the run writes that passed their fence — in one transaction,
    /// and returns the receipts of `events` and what became of each write, in order.
    async fn commit_batch(
        &mut self,
        events: Vec<AuditEvent>,
        staged: Vec<StagedEvent>,
        writes: Vec<RunWrite>,
        turn: Option<HeldTurn>,
    ) -> Result<Committed, StoreError> {
        let appended = events.len();
        // A batch is synced to disk before it is acknowledged when anything in it comes from
        // outside a run's journal (an API action's entry) or permits an effect outside the
        // database: a tool call about to run, a run's end that webhooks announce. Otherwise
        // (a model turn, a tool's result, a refusal) it is deferred: it survives a crash of
        // this process, and a power cut loses at most what followed the last synced commit,
        // which a run resumes from as it would from a crash before those steps. The next
        // synced commit flushes the deferred ones before it.
        let durability =
            if appended > 0 || !staged.is_empty() || writes.iter().any(RunWrite::is_durable) {
                Durability::Synced
            } else {
                Durability::Deferred
            };
        // With a log syncer, a synced batch commits as a deferred one and reaches the disk
        // through the syncer before it is acknowledged.
        let awaits_sync = durability == Durability::Synced && self.wal.is_some();
        let committing = if awaits_sync {
            Durability::Deferred
        } else {
            durability
        };
        let (mut receipts, written) = self
            .transact(
                committing,
                BatchWork {
                    events,
                    staged,
                    writes,
                },
                turn,
            )
            .await?;
        crate::metrics::audit_commit(durability);
        self.chain.signed_committed();
        receipts.truncate(appended);
        Ok(Committed {
            receipts,
            written,
            awaits_sync,
        })
    }

    /// Does `work` in one transaction on the writer's connection, committed with
    /// `durability`, under this process's turn to write: `turn` when the committer holds it
    /// already, else waited for.
    async fn transact<W: Work>(
        &mut self,
        durability: Durability,
        work: W,
        turn: Option<HeldTurn>,
    ) -> Result<W::Output, StoreError> {
        let store = self.store.clone();
        let chain = &mut self.chain;
        let connection = self
            .connection
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match connection {
            Connection::Pool(held) => {
                // The pool's write takes the turn itself.
                drop(turn);
                let locked = match chain.backend {
                    Backend::Postgres => work.chains(chain),
                    Backend::Sqlite => BTreeSet::new(),
                };
                let keys: Vec<i64> = locked.iter().copied().map(advisory_lock_key).collect();
                store
                    .write_held(held, durability, &keys, async |tx| {
                        work.run(chain, &mut **tx, &locked).await
                    })
                    .await
            }
            Connection::Embedded(embedded) => {
                // Held until the transaction has ended, as by every writer of the store.
                let _turn = match turn {
                    Some(HeldTurn(held)) => held,
                    None => store.write_turn().await?,
                };
                // SQLite's write lock is every chain's lock.
                embedded
                    .transaction(durability, async |exec| {
                        work.run(chain, exec, &BTreeSet::new()).await
                    })
                    .await
            }
        }
    }
}

impl Chain {
    /// Appends `events` in `tx`, in order, and returns their receipts in order. The projects
    /// whose head it signed are forgotten as unsigned once `tx` commits
    /// ([`Chain::signed_committed`]).
    async fn append_batch(
        &mut self,
        tx: &mut impl Exec,
        events: Vec<AuditEvent>,
        at: i64,
        locked: &BTreeSet<ProjectId>,
    ) -> Result<Vec<AuditReceipt>, StoreError> {
        let mut by_project: BTreeMap<ProjectId, Vec<(usize, AuditEvent)>> = BTreeMap::new();
        let count = events.len();
        for (index, event) in events.into_iter().enumerate() {
            by_project
                .entry(event.project_id())
                .or_default()
                .push((index, event));
        }
        let mut receipts: Vec<Option<AuditReceipt>> = vec![None; count];
        self.signed.clear();
        // Projects' chains are locked in id order, so two processes never wait on each other in
        // a cycle: on PostgreSQL all of them with the transaction's `BEGIN` (`Work::chains`).
        for (project, events) in by_project {
            let head = lock_head(tx, self.backend, project, locked).await?;
            let (mut seq, mut prev) = (head.seq, head.hash);
            let mut entries = Vec::with_capacity(events.len());
            for (index, event) in events {
                seq += 1;
                // The stored payload has secret shapes redacted from every string and key.
                // Live secrets are not known here yet; when connections hold secrets, their
                // redactor joins this one.
                let (entry, payload) = event.into_entry(seq, at, prev, redact_shapes_json);
                prev = entry.hash.clone();
                if let Some(slot) = receipts.get_mut(index) {
                    *slot = Some(AuditReceipt {
                        seq,
                        hash: entry.hash.clone(),
                    });
                }
                entries.push((entry, payload));
            }
            let mut entries = entries.into_iter().peekable();
            while entries.peek().is_some() {
                let statement = entries.by_ref().take(ENTRIES_PER_STATEMENT).collect();
                insert_entries(tx, statement).await?;
            }
            if seq - head.checkpoint_seq >= self.checkpoint_every {
                self.insert_checkpoint(tx, project, seq, &prev, at).await?;
                self.signed.push(project);
            } else {
                self.unsigned.insert(project);
            }
        }
        receipts
            .into_iter()
            .map(|r| r.ok_or_else(|| StoreError::Corrupt("audit batch lost an entry".to_owned())))
            .collect()
    }

    /// After a batch committed: the projects whose heads it signed are not unsigned any more.
    fn signed_committed(&mut self) {
        for project in std::mem::take(&mut self.signed) {
            self.unsigned.remove(&project);
        }
    }
}

impl Writer {
    async fn checkpoint_unsigned(&mut self) -> Result<(), StoreError> {
        if self.chain.unsigned.is_empty() {
            return Ok(());
        }
        let result = self
            .transact(Durability::Synced, CheckpointWork, None)
            .await;
        if result.is_ok() {
            self.chain.unsigned.clear();
        }
        if let Err(err) = &result {
            tracing::error!(
                category = "audit",
                kind = err.kind(),
                "audit checkpoint failed"
            );
        }
        result
    }
}

impl Chain {
    async fn insert_checkpoint(
        &self,
        tx: &mut impl Exec,
        project: ProjectId,
        seq: i64,
        entry_hash: &str,
        at: i64,
    ) -> Result<(), StoreError> {
        let message = checkpoint_message(project, seq, entry_hash, at, &self.key_id);
        let signature = hex::encode(self.key.sign(&message));
        tx.execute(
            "INSERT INTO audit_checkpoints (project_id, seq, entry_hash, at, key_id, signature) \
             VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (project_id, seq) DO NOTHING",
            vec![
                project.to_string().into(),
                seq.into(),
                entry_hash.into(),
                at.into(),
                self.key_id.as_str().into(),
                signature.into(),
            ],
        )
        .await?;
        Ok(())
    }
}

struct ChainHead {
    seq: i64,
    hash: String,
    checkpoint_seq: i64,
}

/// Takes `project`'s chain lock for the rest of the transaction, unless the transaction took it
/// with its `BEGIN` (`locked`), and reads its head.
async fn lock_head(
    tx: &mut impl Exec,
    backend: Backend,
    project: ProjectId,
    locked: &BTreeSet<ProjectId>,
) -> Result<ChainHead, StoreError> {
    // INVARIANT: on PostgreSQL every project a transaction appends to or signs is in
    // `locked` (`Work::chains`), so its lock was taken with the `BEGIN`, before any run row.
    // A lock taken here would come after them, and out of the projects' order.
    debug_assert!(
        backend != Backend::Postgres || locked.contains(&project),
        "a chain lock the transaction's BEGIN did not take"
    );
    if backend == Backend::Postgres && !locked.contains(&project) {
        tx.fetch_optional(
            "SELECT 1 AS locked FROM (SELECT pg_advisory_xact_lock($1)) AS l",
            vec![advisory_lock_key(project).into()],
        )
        .await?;
    }
    // The head and the last checkpoint in one statement: one round trip on the writer's path.
    let row = tx.fetch_optional(
        "SELECT \
           (SELECT seq FROM audit_entries WHERE project_id = $1 ORDER BY seq DESC LIMIT 1) AS seq, \
           (SELECT hash FROM audit_entries WHERE project_id = $1 ORDER BY seq DESC LIMIT 1) AS hash, \
           (SELECT seq FROM audit_checkpoints WHERE project_id = $1 ORDER BY seq DESC LIMIT 1) \
             AS checkpoint_seq",
        vec![project.to_string().into()],
    )
    .await?
    .ok_or_else(|| StoreError::Corrupt("the audit chain's head read no row".to_owned()))?;
    let seq = row.opt_int("seq")?;
    let hash = row.opt_text("hash")?;
    let (seq, hash) = match (seq, hash) {
        (Some(seq), Some(hash)) => (seq, hash),
        (None, None) => (0, GENESIS_HASH.to_owned()),
        _ => {
            return Err(StoreError::Corrupt(
                "audit chain head without its hash".to_owned(),
            ));
        }
    };
    let checkpoint_seq = row.opt_int("checkpoint_seq")?;
    Ok(ChainHead {
        seq,
        hash,
        checkpoint_seq: checkpoint_seq.unwrap_or(0),
    })
}

/// A 64-bit advisory-lock key for a project's chain, from a labelled hash of its id.
pub(crate) fn advisory_lock_key(project: ProjectId) -> i64 {
    let digest = Sha256::digest(format!("wor-audit-chain\0{project}").as_bytes());
    i64::from_be_bytes(digest.first_chunk::<8>().copied().unwrap_or_default())
}

/// Entries inserted by one statement (12 values each).
const ENTRIES_PER_STATEMENT: usize = 100;

/// Inserts `entries`, each with its payload's canonical text, with one statement.
async fn insert_entries(
    tx: &mut impl Exec,
    entries: Vec<(AuditEntry, String)>,
) -> Result<(), StoreError> {
    const VALUES: usize = 12;
    let sql = format!(
        "INSERT INTO audit_entries ({ENTRY_COLUMNS}) VALUES {}",
        crate::value_rows(1, entries.len(), VALUES)
    );
    let mut params = Vec::with_capacity(entries.len() * VALUES);
    for (entry, payload) in entries {
        let subjects = entry.subjects_canonical_json();
        params.extend([
            entry.project_id.to_string().into(),
            entry.seq.into(),
            entry.at.into(),
            entry.actor.canonical_json().into(),
            entry.category.into(),
            subjects.into(),
            entry.root_run_id.map(|r| r.to_string()).into(),
            entry.parent_run_id.map(|r| r.to_string()).into(),
            entry.payload_digest.into(),
            payload.into(),
            entry.prev_hash.into(),
            entry.hash.into(),
        ]);
    }
    tx.execute(&sql, params).await?;
    Ok(())
}

const ENTRY_COLUMNS: &str = "project_id, seq, at, actor, category, subjects, root_run_id, \
                             parent_run_id, payload_digest, payload, prev_hash, hash";

/// How many entries verification reads per query.
const VERIFY_PAGE: i64 = 1000;

impl Store {
    /// Up to `limit` entries of `project`'s chain after sequence number `after`, in order.
    pub async fn audit_entries(
        &self,
        project: ProjectId,
        after: i64,
        limit: i64,
    ) -> Result<Vec<AuditEntry>, StoreError> {
        let rows = self.audit_entry_rows(project, after, limit).await?;
        rows.iter()
            .map(|row| {
                entry_from_row(row).map_err(|column| {
                    StoreError::Corrupt(format!("column `audit_entries.{column}`"))
                })
            })
            .collect()
    }

    async fn audit_entry_rows(
        &self,
        project: ProjectId,
        after: i64,
        limit: i64,
    ) -> Result<Vec<sqlx::any::AnyRow>, StoreError> {
        Ok(sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {ENTRY_COLUMNS} FROM audit_entries \
             WHERE project_id = $1 AND seq > $2 ORDER BY seq LIMIT $3"
        )))
        .bind(project.to_string())
        .bind(after)
        .bind(limit)
        .fetch_all(&self.pool)
        .await?)
    }

    /// `project`'s checkpoints with `after < seq <= through` (no upper bound when `None`).
    pub async fn audit_checkpoints(
        &self,
        project: ProjectId,
        after: i64,
        through: Option<i64>,
    ) -> Result<Vec<AuditCheckpoint>, StoreError> {
        let rows = sqlx::query(
            "SELECT project_id, seq, entry_hash, at, key_id, signature FROM audit_checkpoints \
             WHERE project_id = $1 AND seq > $2 AND seq <= $3 ORDER BY seq",
        )
        .bind(project.to_string())
        .bind(after)
        .bind(through.unwrap_or(i64::MAX))
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|row| {
                let project_id: String = row.try_get("project_id")?;
                Ok(AuditCheckpoint {
                    project_id: parse_column(&project_id, "audit_checkpoints.project_id")?,
                    seq: row.try_get("seq")?,
                    entry_hash: row.try_get("entry_hash")?,
                    at: row.try_get("at")?,
                    key_id: row.try_get("key_id")?,
                    signature: row.try_get("signature")?,
                })
            })
            .collect()
    }

    /// Verifies `project`'s whole chain and checkpoints against `key`, page by page.
    pub async fn verify_audit_chain(
        &self,
        project: ProjectId,
        key: &VerifyingKey,
        anchors: &[Anchor],
    ) -> Result<Verification, StoreError> {
        let checkpoints = self.audit_checkpoints(project, 0, None).await?;
        let mut verifier = ChainVerifier::new(project, key, checkpoints, anchors);
        let mut after = 0;
        while !verifier.entries_broken() {
            let rows = self.audit_entry_rows(project, after, VERIFY_PAGE).await?;
            for row in &rows {
                let seq: i64 = row.try_get("seq")?;
                match entry_from_row(row) {
                    Ok(entry) => verifier.push(&entry),
                    Err(column) => verifier.push_unreadable(seq, column),
                }
                after = seq;
            }
            if i64::try_from(rows.len()).unwrap_or(0) < VERIFY_PAGE {
                break;
            }
        }
        Ok(verifier.finish())
    }
}

/// An entry from its row, or the name of the column that does not parse.
fn entry_from_row(row: &sqlx::any::AnyRow) -> Result<AuditEntry, &'static str> {
    fn text(row: &sqlx::any::AnyRow, column: &'static str) -> Result<String, &'static str> {
        row.try_get(column).map_err(|_| column)
    }
    fn json<T: serde::de::DeserializeOwned>(
        row: &sqlx::any::AnyRow,
        column: &'static str,
    ) -> Result<T, &'static str> {
        serde_json::from_str(&text(row, column)?).map_err(|_| column)
    }
    fn id<T: std::str::FromStr>(
        row: &sqlx::any::AnyRow,
        column: &'static str,
    ) -> Result<Option<T>, &'static str> {
        let value: Option<String> = row.try_get(column).map_err(|_| column)?;
        value.map(|v| v.parse().map_err(|_| column)).transpose()
    }
    Ok(AuditEntry {
        project_id: text(row, "project_id")?.parse().map_err(|_| "project_id")?,
        seq: row.try_get("seq").map_err(|_| "seq")?,
        at: row.try_get("at").map_err(|_| "at")?,
        actor: json(row, "actor")?,
        category: text(row, "category")?,
        subjects: json(row, "subjects")?,
        root_run_id: id(row, "root_run_id")?,
        parent_run_id: id(row, "parent_run_id")?,
        payload_digest: text(row, "payload_digest")?,
        payload: json(row, "payload")?,
        prev_hash: text(row, "prev_hash")?,
        hash: text(row, "hash")?,
    })
}
