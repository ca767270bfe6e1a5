//! Storage of Work on Repeat: the SQLite and PostgreSQL repositories and their migrations.
//!
//! One schema runs on both databases through `sqlx`'s `Any` driver; the few type names that
//! differ are substituted when migrations run. Every repository function that reads or
//! writes a project's resources takes the project id as an argument, and every query filters
//! on it: a caller can never reach another project's rows by passing a foreign resource id.
//!
//! The audit chain is stored here too, written only by [`AuditLog`]'s writer task.

mod api_keys;
mod approvals;
mod audit;
mod backup;
mod console;
mod exec;
mod journal;
mod members;
mod memory;
pub mod metrics;
mod migrations;
mod model_connections;
mod notifications;
mod oauth;
mod outbox;
mod probe;
mod projects;
mod routines;
mod run_tokens;
mod runs;
mod staged;
#[cfg(feature = "testing")]
pub mod testing;
mod tool_connections;
mod triggers;
mod vault;
mod wal;
mod workers;

use std::path::Path;
use std::str::FromStr;
use std::time::Duration;

use sqlx::any::{AnyPoolOptions, install_default_drivers};
use sqlx::{Any, AnyPool, Executor, Row as _, Transaction};

pub use api_keys::{API_KEY_PREFIX, api_key_digest};
pub use api_keys::{ApiKeyKind, ApiKeyRecord, AuthenticatedKey, NewApiKey, PlaintextApiKey};
pub use approvals::{
    ApprovalAnswer, ApprovalDecision, ApprovalEdit, ApprovalFilter, ApprovalKind, ApprovalRecord,
    ApprovalStatus, ApprovedCall, ApprovedClaim, ApprovedStart, DecideError, NewApproval,
    ProjectPolicyRecord,
};
pub use audit::{AuditConfig, AuditLog, AuditReceipt};
pub use backup::{BackupError, Restored, restore_sqlite};
pub use console::{
    ConsoleSessionRecord, ConsoleSessionSummary, ConsoleToken, INVITATION_TOKEN_PREFIX,
    InvitationRecord, MAX_USER_AGENT_CHARS, PurgedConsoleState, SESSION_TOKEN_PREFIX,
    SIGN_IN_LINK_TOKEN_PREFIX, SessionOrigin, SignInAccount,
};
pub use journal::{RunWrite, RunWritten};
pub use members::{MemberRecord, RoleChange, RoleChanger};
pub use model_connections::{
    API_KEY_FIELD, ConnectionStatus, MODEL_CONNECTIONS_TABLE, ModelConnectionRecord,
    NewModelConnection,
};
pub use notifications::{
    NOTIFICATION_ROUTES_TABLE, NewNotification, NewNotificationRoute, NotificationAction,
    NotificationDeliveryFilter, NotificationDeliveryRecord, NotificationRouteRecord, RouteChannel,
    RouteFilter, SLACK_LINK_TOKEN_PREFIX, SlackLinkRecord, SlackMessageRecord, SmtpTls,
};
pub use oauth::{
    ACCESS_TOKEN_FIELD, CLIENT_SECRET_FIELD, ConnectionOAuthRecord, NewOAuthAuthorization,
    OAUTH_AUTHORIZATIONS_TABLE, OAuthAuthorizationRecord, PKCE_VERIFIER_FIELD, REFRESH_TOKEN_FIELD,
    state_digest,
};
pub use outbox::OutboxClaim;
pub use probe::{DatabaseProbe, KeysInUse, probe};
pub use projects::{CreatedProject, ProjectRecord, RecoveredOwner};
pub use routines::{AppliedRoutine, RoutineRecord, RoutineVersionRecord};
pub use run_tokens::{RUN_TOKEN_PREFIX, RunGrant, RunToken};
pub use runs::{
    AnnouncedRun, CANCELLED_WHILE_QUEUED, CancelAsked, ClaimTerms, Claimed, NestedPark, NewRun,
    ParentLink, RunFilter, RunRecord, RunStep, SURPLUS_PAGE, ScheduleAdvance, ScheduledStart,
    ThreadSummary, UnreadableRun, skipped_outcome,
};
pub use sqlx::Error as SqlxError;
pub use staged::StagedEvent;
pub use tool_connections::{
    NewToolConnection, StdioSpec, StoredPin, TOOL_CONNECTIONS_TABLE, ToolConnectionKind,
    ToolConnectionRecord, ToolConnectionStatus, env_field, header_field,
};
pub use triggers::{AttemptOutcome, DeliveryFilter, DeliveryRecord, DueSchedule, NewDelivery};
pub use vault::{RotationReport, SealedPut, SecretMetadata, SecretSlot, Vault, VaultError};
pub use workers::{
    EnrolmentRefusal, NewEnrolmentToken, WORKER_ENROLMENT_TOKEN_PREFIX, WorkerRecord,
    WorkerRequestRefusal, WorkerRevocation, WorkerStatus,
};

/// Which database a [`Store`] runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
}

impl Backend {
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Sqlite => "sqlite",
            Backend::Postgres => "postgres",
        }
    }
}

/// What went wrong talking to the database. Not-found and conflicts are their own variants
/// so callers can answer 404 / 409 without looking at database error codes.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("not found")]
    NotFound,
    #[error("{0}")]
    Conflict(String),
    /// The change would leave the project without an owner who can manage it.
    #[error(
        "key `{key_id}` is the last live owner key of the project's owners; create another \
         owner key first (an operator can run `wor project recover-owner`)"
    )]
    LastOwnerKey { key_id: wor_core::ApiKeyId },
    /// The change would leave the project without an owner who can manage it.
    #[error(
        "member `{member_id}` is the project's last owner with a live owner key; make another \
         member owner first (an operator can run `wor project recover-owner`)"
    )]
    LastOwner { member_id: wor_core::MemberId },
    /// The caller may not make this role change.
    #[error("{0}")]
    RoleChange(wor_core::RoleChangeRefusal),
    #[error("unsupported database url `{0}`: expected `sqlite://…` or `postgres://…`")]
    UnsupportedUrl(String),
    #[error("cannot make or use data directory `{path}`: {source}")]
    DataDir {
        path: String,
        source: std::io::Error,
    },
    /// The data directory may be written by any user of the host, who could replace its
    /// database or key files.
    #[error(
        "data directory `{path}` may be written by any user (mode {mode:04o}): whoever can write there can replace its database and key files; take that away with `chmod o-w {path}` (`chmod 700` is what a new one gets)"
    )]
    DataDirTooOpen { path: String, mode: u32 },
    /// A run to be skipped at `max` active runs of its routine found `active` when it was
    /// recorded; nothing was written.
    #[error("{active} run(s) of this routine active, at most {max}")]
    RoutineFull { active: u64, max: u64 },
    #[error("no database at `{path}` yet (`wor init` or `wor serve` creates it)")]
    NoDatabase { path: String },
    #[error("stored row is corrupt: {0}")]
    Corrupt(String),
    /// A step to record could not be written as JSON; nothing was recorded.
    #[error("a step to record could not be encoded: {0}")]
    StepEncoding(#[source] wor_core::step::StepError),
    /// An audit event to stage with its change could not be written as JSON; nothing changed.
    #[error("an audit event to stage could not be encoded: {0}")]
    EventEncoding(String),
    /// A secret sealed for one slot was given to a change that writes another's; nothing
    /// changed.
    #[error("a secret sealed for `{slot}` does not belong to this change")]
    MisplacedSecret { slot: String },
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    /// From the audit writer's own connection to the embedded database.
    #[error("database error: {0}")]
    Embedded(#[from] rusqlite::Error),
    #[error("migration failed: {0}")]
    Migration(#[from] sqlx::migrate::MigrateError),
    /// The database holds a migration this release does not have: a newer release made it.
    #[error(
        "the database was made by a newer release of Work on Repeat (its schema has migration \
         {0}, which this release does not know): use that release or a newer one"
    )]
    NewerSchema(i64),
    /// Other writes of this process kept the database for longer than a write waits
    /// (`busy_timeout`, 10 s).
    #[error("the database stayed busy with other writes; try again")]
    WriteTurnTimedOut,
    #[error("the audit writer has stopped")]
    AuditStopped,
    #[error("audit append failed ({0})")]
    AuditWrite(&'static str),
}

impl StoreError {
    /// A fixed label for the kind of error, for logs: messages can quote data, labels cannot.
    /// Whether no connection to the database could be had (none in time, or the pool
    /// closed): nothing was sent to it, so nothing was done, and the same request may succeed
    /// once it is back. An error in the middle of a statement is not this: its write may have
    /// committed.
    pub fn is_unreachable(&self) -> bool {
        matches!(
            self,
            StoreError::Database(sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed)
        )
    }

    /// A fixed word for the variant, for logs (which never carry the message).
    pub fn kind(&self) -> &'static str {
        match self {
            StoreError::NotFound => "not_found",
            StoreError::Conflict(_) => "conflict",
            StoreError::LastOwnerKey { .. } => "last_owner_key",
            StoreError::LastOwner { .. } => "last_owner",
            StoreError::RoleChange(_) => "role_change",
            StoreError::UnsupportedUrl(_) => "unsupported_url",
            StoreError::DataDir { .. } => "data_dir",
            StoreError::DataDirTooOpen { .. } => "data_dir_too_open",
            StoreError::NoDatabase { .. } => "no_database",
            StoreError::RoutineFull { .. } => "routine_full",
            StoreError::Corrupt(_) => "corrupt",
            StoreError::StepEncoding(_) => "step_encoding",
            StoreError::EventEncoding(_) => "event_encoding",
            StoreError::MisplacedSecret { .. } => "misplaced_secret",
            StoreError::Database(sqlx_err) => match sqlx_err {
                sqlx::Error::PoolTimedOut => "pool_timed_out",
                sqlx::Error::Database(_) => "database",
                sqlx::Error::Io(_) => "io",
                _ => "other",
            },
            StoreError::Embedded(_) => "database",
            StoreError::Migration(_) | StoreError::NewerSchema(_) => "migration",
            StoreError::WriteTurnTimedOut => "write_turn_timed_out",
            StoreError::AuditStopped => "audit_stopped",
            StoreError::AuditWrite(_) => "audit_write",
        }
    }
}

/// A connection pool to the one database, with the repositories as methods.
#[derive(Debug, Clone)]
pub struct Store {
    pool: AnyPool,
    backend: Backend,
    /// The PostgreSQL URL, for the connection that listens for queued runs.
    listen_url: Option<std::sync::Arc<str>>,
    /// On SQLite, this process's turn to write: every write transaction holds it from `BEGIN`
    /// to its end ([`WriteTx`]), and every write outside a transaction for its statement
    /// ([`WritePool`]). SQLite has one writer at a time, and one waiting for its lock sleeps
    /// in growing steps (up to 100 ms) however soon the lock is free, while a writer that just
    /// committed takes it again at once; waiting here instead, in order, a writer is woken as
    /// soon as the one before it is done. `None` on PostgreSQL, whose row locks order its writers.
    write_turn: Option<std::sync::Arc<tokio::sync::Mutex<()>>>,
}

/// A write transaction ([`Store::begin_write`]) with this process's turn to write, which it
/// gives up when it ends (committed, rolled back or dropped).
pub(crate) struct WriteTx {
    // Declared first, so dropped first. A commit or rollback ends the transaction before the
    // turn passes on; a transaction only dropped has its rollback queued on its connection,
    // which the next writer's `busy_timeout` waits for in the rare case it has not run yet.
    tx: Transaction<'static, Any>,
    _turn: Option<tokio::sync::OwnedMutexGuard<()>>,
}

impl WriteTx {
    pub(crate) async fn commit(self) -> Result<(), sqlx::Error> {
        self.tx.commit().await
    }

    pub(crate) async fn rollback(self) -> Result<(), sqlx::Error> {
        self.tx.rollback().await
    }
}

impl std::ops::Deref for WriteTx {
    type Target = Transaction<'static, Any>;

    fn deref(&self) -> &Self::Target {
        &self.tx
    }
}

impl std::ops::DerefMut for WriteTx {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.tx
    }
}

/// The pool for a write outside a transaction ([`Store::write_pool`]), with this process's
/// turn to write held until it is dropped: for one statement, pass it to the statement
/// (`.execute(&*store.write_pool().await?)`), which keeps it to the statement's end.
///
/// The turn passes to the next task in line even if that task is not being polled, so a
/// store write must be polled to its end once begun: one left waiting in a `select!` branch
/// while another branch's body runs holds up every write of the process.
#[must_use = "the turn to write is given up when this is dropped"]
pub(crate) struct WritePool<'a> {
    pool: &'a AnyPool,
    _turn: Option<tokio::sync::OwnedMutexGuard<()>>,
}

impl std::ops::Deref for WritePool<'_> {
    type Target = AnyPool;

    fn deref(&self) -> &Self::Target {
        self.pool
    }
}

/// The channel PostgreSQL notifies when a run is queued (migration 0022).
const WORK_CHANNEL: &str = "wor_work";

/// A PostgreSQL connection that hears when any process queues a run.
#[derive(Debug)]
pub struct WorkListener(sqlx::postgres::PgListener);

impl WorkListener {
    /// Waits until a run is queued somewhere. A lost connection is reconnected on the next
    /// call, and what was queued while it was down goes unheard: the workers' poll finds it.
    pub async fn queued(&mut self) -> Result<(), StoreError> {
        self.0.recv().await?;
        Ok(())
    }
}

/// The SQLite database file inside a data directory.
pub const SQLITE_FILE: &str = "wor.db";

/// How long after a run parks or ends a sweep may queue its announcements (run webhook,
/// notifications, memory) in place of the process that moved it: well past the moment that
/// process queues them itself.
pub const ANNOUNCE_GRACE_MS: i64 = 60_000;

/// Makes `data_dir` (mode 0700, with any parent missing) and its database file (mode 0600)
/// when they are missing, so that run inputs, outputs and the audit log are the server's
/// user's alone: SQLite would make the file as the process's umask says, commonly readable by
/// everyone, and its log files after it take the database file's mode. Existing ones are left
/// as they are, but a data dir any user may write to is refused before anything is put in it.
pub(crate) fn private_database_file(data_dir: &Path) -> Result<(), StoreError> {
    use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _};
    let failed = |source| StoreError::DataDir {
        path: data_dir.display().to_string(),
        source,
    };
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(data_dir)
        .map_err(failed)?;
    // Checked before anything is put in it.
    refuse_an_open_data_dir(data_dir)?;
    match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(data_dir.join(SQLITE_FILE))
    {
        Ok(_) => Ok(()),
        Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(error) => Err(failed(error)),
    }
}

/// [`Store::sealed_secret_key_ids`] of the database `pool` opens (a probe's, too).
pub(crate) async fn sealed_secret_key_ids(
    pool: &AnyPool,
) -> Result<Vec<(String, i64)>, StoreError> {
    let rows = sqlx::query(
        "SELECT key_id, COUNT(*) AS n FROM sealed_secrets GROUP BY key_id ORDER BY key_id",
    )
    .fetch_all(pool)
    .await?;
    rows.iter()
        .map(|row| Ok((row.try_get("key_id")?, row.try_get("n")?)))
        .collect()
}

/// [`Store::newest_checkpoint_key_id`] of the database `pool` opens.
pub(crate) async fn newest_checkpoint_key_id(pool: &AnyPool) -> Result<Option<String>, StoreError> {
    let row = sqlx::query(
        "SELECT key_id FROM audit_checkpoints ORDER BY at DESC, project_id DESC, seq DESC LIMIT 1",
    )
    .fetch_optional(pool)
    .await?;
    row.map(|row| row.try_get("key_id"))
        .transpose()
        .map_err(StoreError::from)
}

/// [`Store::count_audit_checkpoints`] of the database `pool` opens.
pub(crate) async fn count_audit_checkpoints(pool: &AnyPool) -> Result<i64, StoreError> {
    let row = sqlx::query("SELECT COUNT(*) AS n FROM audit_checkpoints")
        .fetch_one(pool)
        .await?;
    Ok(row.try_get("n")?)
}

/// Refuses a data dir that any user may write to ([`StoreError::DataDirTooOpen`]). One its
/// group may write to is left to the operator (a volume shared through its group).
fn refuse_an_open_data_dir(data_dir: &Path) -> Result<(), StoreError> {
    let metadata = std::fs::metadata(data_dir).map_err(|source| StoreError::DataDir {
        path: data_dir.display().to_string(),
        source,
    })?;
    match wor_secrets::writable_by_any_user(&metadata) {
        Some(mode) => Err(StoreError::DataDirTooOpen {
            path: data_dir.display().to_string(),
            mode,
        }),
        None => Ok(()),
    }
}

impl Store {
    /// Opens `database_url` if given, or the embedded SQLite database in `data_dir`, creating
    /// it if needed, and applies every pending migration.
    pub async fn open(database_url: Option<&str>, data_dir: &Path) -> Result<Self, StoreError> {
        let url = match database_url {
            Some(url) => url.to_owned(),
            None => {
                private_database_file(data_dir)?;
                format!("sqlite://{}?mode=rwc", data_dir.join(SQLITE_FILE).display())
            }
        };
        Self::connect(&url).await
    }

    /// Opens the database an operator command works on: as [`Store::open`], except that with
    /// no URL a data dir without a database is [`StoreError::NoDatabase`], not a new one (a
    /// mistyped `--data-dir` must not answer from an empty database, or put keys in it).
    pub async fn open_existing(
        database_url: Option<&str>,
        data_dir: &Path,
    ) -> Result<Self, StoreError> {
        if database_url.is_none() && !data_dir.join(SQLITE_FILE).is_file() {
            return Err(StoreError::NoDatabase {
                path: data_dir.join(SQLITE_FILE).display().to_string(),
            });
        }
        Self::open(database_url, data_dir).await
    }

    /// How many secrets are sealed in the vault, under any key.
    pub async fn count_sealed_secrets(&self) -> Result<i64, StoreError> {
        let row = sqlx::query("SELECT COUNT(*) AS n FROM sealed_secrets")
            .fetch_one(self.pool())
            .await?;
        Ok(row.try_get("n")?)
    }

    /// The keys the vault's secrets are sealed under (their ids, as the key ring names them),
    /// with how many secrets each seals.
    pub async fn sealed_secret_key_ids(&self) -> Result<Vec<(String, i64)>, StoreError> {
        sealed_secret_key_ids(self.pool()).await
    }

    /// The id of the key that signed the newest audit checkpoint, of any project; `None` when
    /// none is signed.
    pub async fn newest_checkpoint_key_id(&self) -> Result<Option<String>, StoreError> {
        newest_checkpoint_key_id(self.pool()).await
    }

    /// How many audit checkpoints are signed, in every project.
    pub async fn count_audit_checkpoints(&self) -> Result<i64, StoreError> {
        count_audit_checkpoints(self.pool()).await
    }

    /// Connects to a `sqlite://` or `postgres://` URL and applies pending migrations.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        install_default_drivers();
        let backend = if url.starts_with("sqlite:") {
            Backend::Sqlite
        } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Backend::Postgres
        } else {
            return Err(StoreError::UnsupportedUrl(scrub_url(url)));
        };
        let options = AnyPoolOptions::new().acquire_timeout(Duration::from_secs(10));
        let pool = match backend {
            // One writer at a time is SQLite's model; WAL lets readers go on meanwhile, and
            // FULL sync keeps a committed transaction across a power cut.
            Backend::Sqlite => {
                options
                    .max_connections(8)
                    // A connection to a file in this process cannot have gone away; the check
                    // sqlx makes by default on every acquire is a round trip to the
                    // connection's thread for nothing.
                    .test_before_acquire(false)
                    .after_connect(|conn, _meta| {
                        Box::pin(async move {
                            // The audit writer's checkpointer copies the log beside the writer
                            // and has it restarted past 4,096 pages (`wal.rs`); the pool's
                            // connections checkpoint as they commit only past twice that, as a
                            // backstop, and in a process without the writer.
                            conn.execute(
                                "PRAGMA journal_mode = WAL; PRAGMA synchronous = FULL; \
                                 PRAGMA wal_autocheckpoint = 8192;",
                            )
                            .await?;
                            conn.execute(SQLITE_CONNECTION_SETTINGS).await?;
                            Ok(())
                        })
                    })
                    .connect(url)
                    .await?
            }
            Backend::Postgres => options.max_connections(16).connect(url).await?,
        };
        let listen_url = (backend == Backend::Postgres).then(|| std::sync::Arc::from(url));
        let store = Store {
            pool,
            backend,
            listen_url,
            write_turn: (backend == Backend::Sqlite)
                .then(|| std::sync::Arc::new(tokio::sync::Mutex::new(()))),
        };
        migrations::apply(&store).await?;
        Ok(store)
    }

    pub fn backend(&self) -> Backend {
        self.backend
    }

    pub fn pool(&self) -> &AnyPool {
        &self.pool
    }

    /// Begins a transaction that writes: the one way the store opens one.
    ///
    /// On SQLite it takes the database's write lock up front (`BEGIN IMMEDIATE`), waiting up
    /// to `busy_timeout` for it. A deferred transaction would take it only at its first write,
    /// and in WAL mode one that has read by then cannot wait: it fails at once as busy (code
    /// 5, or 517 when another writer committed since it read). On PostgreSQL it is a plain
    /// transaction; row locks and the per-project advisory lock order its writers.
    ///
    /// Only the `BEGIN` is retried, with a doubling pause, when SQLite still finds the
    /// database busy or locked after `busy_timeout`: nothing of the transaction has run yet,
    /// so trying again cannot repeat or lose a write. Once the lock is held no statement of
    /// the transaction can meet a busy database, so nothing after `BEGIN` needs a retry.
    #[expect(
        clippy::disallowed_methods,
        reason = "the one place a transaction begins (clippy.toml)"
    )]
    pub(crate) async fn begin_write(&self) -> Result<WriteTx, StoreError> {
        let turn = self.write_turn().await?;
        let mut retry = BeginRetry::new(self.backend);
        loop {
            let begun = match self.backend {
                Backend::Sqlite => self.pool.begin_with("BEGIN IMMEDIATE").await,
                Backend::Postgres => self.pool.begin().await,
            };
            match begun {
                Ok(tx) => return Ok(WriteTx { tx, _turn: turn }),
                Err(err) => retry.after(err.into()).await?,
            }
        }
    }

    /// The pool, once this process's turn to write is taken, for a write that is not part of
    /// a transaction. On SQLite such a write otherwise waits for the database's lock in its
    /// busy handler, whose sleeps grow to 100 ms, while the process's transactions (the audit
    /// writer's among them) pass the lock from one to the next: under a steady stream of them
    /// it could wait out `busy_timeout` and fail as "database is locked". Every write the
    /// process makes thus waits in one line, in order.
    pub(crate) async fn write_pool(&self) -> Result<WritePool<'_>, StoreError> {
        Ok(WritePool {
            pool: &self.pool,
            _turn: self.write_turn().await?,
        })
    }

    /// Runs `write`, a write no answer depends on (a key's or a session's last use, kept to
    /// the minute), and gives it up with a warning naming `what` when the database is too busy
    /// to take it: this process's turn to write, or SQLite's lock, not had in time. Any other
    /// failure is returned.
    pub(crate) async fn write_if_not_busy(
        &self,
        what: &'static str,
        write: impl Future<Output = Result<(), StoreError>>,
    ) -> Result<(), StoreError> {
        match write.await {
            Err(err) if matches!(err, StoreError::WriteTurnTimedOut) || is_busy(&err) => {
                tracing::warn!(
                    category = "store",
                    what,
                    "a write no answer depends on was given up: the database was busy"
                );
                Ok(())
            }
            other => other,
        }
    }

    /// Waits for this process's turn to write, on SQLite (see `Store::write_turn`). A wait
    /// longer than SQLite's own `busy_timeout` fails as busy, as waiting for its lock would:
    /// a task that asked for a second write while holding the first never hangs.
    pub(crate) async fn write_turn(
        &self,
    ) -> Result<Option<tokio::sync::OwnedMutexGuard<()>>, StoreError> {
        let Some(turn) = &self.write_turn else {
            return Ok(None);
        };
        match tokio::time::timeout(WRITE_TURN_TIMEOUT, turn.clone().lock_owned()).await {
            Ok(guard) => Ok(Some(guard)),
            Err(_) => Err(StoreError::WriteTurnTimedOut),
        }
    }

    /// This process's turn to write if no one has it now (holding nothing on PostgreSQL, which
    /// has no turn), or `None` when it is taken.
    pub(crate) fn try_write_turn(&self) -> Option<Option<tokio::sync::OwnedMutexGuard<()>>> {
        match &self.write_turn {
            None => Some(None),
            Some(turn) => turn.clone().try_lock_owned().ok().map(Some),
        }
    }

    /// On PostgreSQL, a listener that hears whenever any process queues a run; `None` on
    /// SQLite, where only this process writes and wakes its own workers.
    pub async fn work_listener(&self) -> Result<Option<WorkListener>, StoreError> {
        let Some(url) = &self.listen_url else {
            return Ok(None);
        };
        let mut listener = sqlx::postgres::PgListener::connect(url).await?;
        listener.listen(WORK_CHANNEL).await?;
        Ok(Some(WorkListener(listener)))
    }

    /// Whether the database answers a trivial query.
    pub async fn ping(&self) -> Result<(), StoreError> {
        sqlx::query("SELECT 1").execute(&self.pool).await?;
        Ok(())
    }

    pub async fn close(&self) {
        self.pool.close().await;
    }
}

/// How a write transaction reaches the disk before its commit returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Durability {
    /// On disk (SQLite `synchronous = FULL`, PostgreSQL `synchronous_commit = on`): it
    /// survives a power cut.
    Synced,
    /// Handed to the database's log but not yet flushed to disk (SQLite `synchronous = NORMAL`
    /// in WAL mode, PostgreSQL `synchronous_commit = off`): it survives the crash of this
    /// process, and reaches the disk with the next synced commit of the same database, which
    /// flushes the log up to itself.
    Deferred,
}

impl Durability {
    /// The SQLite setting a transaction of this durability begins under.
    pub(crate) fn sqlite_pragma(self) -> &'static str {
        match self {
            Durability::Synced => "PRAGMA synchronous = FULL",
            Durability::Deferred => "PRAGMA synchronous = NORMAL",
        }
    }
}

/// What every connection to the embedded database is set to, the pool's and the audit
/// writer's own alike: how long a writer waits for SQLite's lock, and foreign keys.
pub(crate) const SQLITE_CONNECTION_SETTINGS: &str =
    "PRAGMA busy_timeout = 10000; PRAGMA foreign_keys = ON;";

/// `LIMIT n`, written into a statement's text. SQLite plans a statement whose `LIMIT` is a
/// bound parameter for the value bound, and marks it to be prepared again whenever that
/// parameter is bound anew, which is every time it runs: a statement run on every call or
/// every tick carries its limit in its text instead, one prepared statement per value.
pub(crate) fn limit_clause(n: u64) -> String {
    // Both databases take a limit as a signed 64-bit integer.
    format!("LIMIT {}", i64::try_from(n).unwrap_or(i64::MAX))
}

/// `count` placeholders numbered from `$first`, comma-separated: `$2, $3, $4` for three from
/// `$2`; for an `IN` list.
pub(crate) fn placeholders(first: usize, count: usize) -> String {
    let mut text = String::with_capacity(count * 5);
    push_placeholders(&mut text, first, count);
    text
}

/// The placeholders of a multi-row `VALUES` list: `rows` rows of `per_row` values each,
/// numbered from `$first`: `($1, $2), ($3, $4)` for two rows of two from `$1`.
pub(crate) fn value_rows(first: usize, rows: usize, per_row: usize) -> String {
    let mut text = String::with_capacity(rows * (per_row * 6 + 4));
    for row in 0..rows {
        text.push_str(if row == 0 { "(" } else { ", (" });
        push_placeholders(&mut text, first + row * per_row, per_row);
        text.push(')');
    }
    text
}

fn push_placeholders(text: &mut String, first: usize, count: usize) {
    use std::fmt::Write as _;
    for n in first..first + count {
        if n > first {
            text.push_str(", ");
        }
        // Writing to a `String` cannot fail.
        let _ = write!(text, "${n}");
    }
}

/// The `busy_timeout` of [`SQLITE_CONNECTION_SETTINGS`].
pub(crate) const BUSY_TIMEOUT: Duration = Duration::from_secs(10);

/// A connection a task keeps for its own writes (the audit writer's), with what SQLite's
/// `synchronous` is set to on it. Nothing else uses it, so setting that per transaction
/// cannot leak into another task's writes.
pub(crate) struct HeldConnection {
    /// Detached from the pool: closing the pool does not wait for it, and it is closed when
    /// its holder drops it.
    connection: sqlx::AnyConnection,
    synchronous: Option<Durability>,
}

impl Store {
    /// Runs `body` in a write transaction on the connection `held` (taken from the pool and
    /// detached from it when there is none) and commits it with `durability`. On PostgreSQL
    /// the transaction takes the advisory locks `locks`, in their order, with its `BEGIN`
    /// (SQLite has none; they are not taken there). A connection whose transaction failed is
    /// closed rather than kept, so no half-known state outlives the failure.
    pub(crate) async fn write_held<T>(
        &self,
        held: &mut Option<HeldConnection>,
        durability: Durability,
        locks: &[i64],
        body: impl AsyncFnOnce(&mut Transaction<'_, Any>) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let mut connection = match held.take() {
            Some(connection) => connection,
            None => HeldConnection {
                connection: self.pool.acquire().await?.detach(),
                synchronous: None,
            },
        };
        match self
            .write_on(&mut connection, durability, locks, body)
            .await
        {
            Ok(value) => {
                *held = Some(connection);
                Ok(value)
            }
            // Dropped here, the connection closes.
            Err(err) => Err(err),
        }
    }

    /// [`Store::write_held`] on a connection in hand; `BEGIN` is retried as in
    /// [`Store::begin_write`].
    #[expect(
        clippy::disallowed_methods,
        reason = "the held connection's transactions begin here (clippy.toml)"
    )]
    async fn write_on<T>(
        &self,
        held: &mut HeldConnection,
        durability: Durability,
        locks: &[i64],
        body: impl AsyncFnOnce(&mut Transaction<'_, Any>) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        use sqlx::Connection as _;
        if self.backend == Backend::Sqlite && held.synchronous != Some(durability) {
            // SQLite reads `synchronous` when a transaction begins, so it is set before.
            held.synchronous = None;
            held.connection.execute(durability.sqlite_pragma()).await?;
            held.synchronous = Some(durability);
        }
        // PostgreSQL takes a deferred commit's setting and the locks with its `BEGIN`, in one
        // round trip: its statements run in order, each lock taken before the next statement.
        let begin = match self.backend {
            Backend::Sqlite => "BEGIN IMMEDIATE".to_owned(),
            Backend::Postgres => {
                use std::fmt::Write as _;
                let mut begin = String::from("BEGIN");
                if durability == Durability::Deferred {
                    begin.push_str("; SET LOCAL synchronous_commit = off");
                }
                for key in locks {
                    // A number written into the text: nothing else is.
                    let _ = write!(begin, "; SELECT pg_advisory_xact_lock({key})");
                }
                begin
            }
        };
        // Held until the transaction below has ended.
        let _turn = self.write_turn().await?;
        let mut retry = BeginRetry::new(self.backend);
        let mut tx = loop {
            match held
                .connection
                .begin_with(sqlx::AssertSqlSafe(begin.clone()))
                .await
            {
                Ok(tx) => break tx,
                Err(err) => retry.after(err.into()).await?,
            }
        };
        let value = body(&mut tx).await?;
        tx.commit().await?;
        Ok(value)
    }
}

/// The retries of one write transaction's `BEGIN` (see [`Store::begin_write`]), on a
/// connection of the pool or the audit writer's own.
pub(crate) struct BeginRetry {
    backend: Backend,
    attempt: u32,
    pause: Duration,
}

impl BeginRetry {
    pub(crate) fn new(backend: Backend) -> Self {
        BeginRetry {
            backend,
            attempt: 1,
            pause: WRITE_RETRY_PAUSE,
        }
    }

    /// After `BEGIN` failed with `err`: waits and returns when it is to be tried again (SQLite
    /// still busy, attempts left), or returns the error.
    pub(crate) async fn after(&mut self, err: StoreError) -> Result<(), StoreError> {
        if self.backend != Backend::Sqlite || self.attempt >= WRITE_BEGIN_ATTEMPTS || !is_busy(&err)
        {
            return Err(err);
        }
        tracing::warn!(
            category = "store",
            attempt = self.attempt,
            "the database is busy; beginning the write again"
        );
        tokio::time::sleep(self.pause).await;
        self.pause = self.pause.saturating_mul(2);
        self.attempt += 1;
        Ok(())
    }
}

/// How many times a write transaction's `BEGIN` is tried while SQLite reports the database
/// busy, and the pause before the second try (doubled before each further one).
pub(crate) const WRITE_BEGIN_ATTEMPTS: u32 = 4;
/// How long a write waits for this process's turn: SQLite's `busy_timeout` (set on connect).
const WRITE_TURN_TIMEOUT: Duration = Duration::from_secs(10);
const WRITE_RETRY_PAUSE: Duration = Duration::from_millis(50);

/// Whether `err` is SQLite's `SQLITE_BUSY` or `SQLITE_LOCKED`, in any extended form (the
/// primary code is the low byte of the extended one).
pub(crate) fn is_busy(err: &StoreError) -> bool {
    let code = match err {
        StoreError::Database(sqlx::Error::Database(db)) => {
            db.code().and_then(|code| code.parse::<i64>().ok())
        }
        StoreError::Embedded(rusqlite::Error::SqliteFailure(failure, _)) => {
            Some(i64::from(failure.extended_code))
        }
        _ => None,
    };
    code.is_some_and(|code| matches!(code & 0xff, 5 | 6))
}

/// The URL with any password replaced, for error messages.
pub fn scrub_url(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut parsed) if parsed.password().is_some() => {
            let _ = parsed.set_password(Some("***"));
            parsed.to_string()
        }
        Ok(parsed) => parsed.to_string(),
        Err(_) => "<unparseable url>".to_owned(),
    }
}

/// Milliseconds since the Unix epoch, the one time format stored.
pub fn now_millis() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

fn parse_column<T: FromStr>(value: &str, column: &str) -> Result<T, StoreError> {
    value
        .parse()
        .map_err(|_| StoreError::Corrupt(format!("column `{column}` holds `{value}`")))
}

/// `Ok` when a statement that names one row by its key changed it; one that changed none
/// named a row that is not there (or is another project's): [`StoreError::NotFound`].
fn changed_one(done: &sqlx::any::AnyQueryResult) -> Result<(), StoreError> {
    if done.rows_affected() == 0 {
        Err(StoreError::NotFound)
    } else {
        Ok(())
    }
}

/// Maps a unique-constraint violation to [`StoreError::Conflict`] with `message`.
fn conflict_or(err: sqlx::Error, message: impl FnOnce() -> String) -> StoreError {
    match &err {
        sqlx::Error::Database(db) if db.is_unique_violation() => StoreError::Conflict(message()),
        _ => StoreError::Database(err),
    }
}

#[cfg(test)]
mod tests {
    use super::{Backend, Durability};

    /// Every prefixed token the store mints is a secret shape, so text that leaves the process
    /// never carries one whole. A new kind of token belongs in this list.
    #[test]
    fn every_token_the_store_mints_is_redacted_by_its_shape() {
        for prefix in [
            crate::api_keys::API_KEY_PREFIX,
            crate::run_tokens::RUN_TOKEN_PREFIX,
            crate::console::INVITATION_TOKEN_PREFIX,
            crate::console::SIGN_IN_LINK_TOKEN_PREFIX,
            crate::console::SESSION_TOKEN_PREFIX,
            crate::workers::WORKER_ENROLMENT_TOKEN_PREFIX,
            crate::notifications::SLACK_LINK_TOKEN_PREFIX,
        ] {
            let secret = "0a1b2c3d4e5f6789".repeat(4);
            let text = format!("sent {prefix}{secret} by mistake");
            let redacted = wor_secrets::redact_shapes(&text);
            assert!(!redacted.contains(&secret), "{prefix}: {redacted}");
        }
    }

    /// A write transaction runs under its durability's setting, on a connection a deferred
    /// write held before as on a new one: PostgreSQL's `synchronous_commit` (set with the
    /// `BEGIN`, for that transaction only), SQLite's `synchronous` (2 is `FULL`, 1 `NORMAL`).
    /// On PostgreSQL it holds the advisory locks it was given, and only those, from its first
    /// statement to its end.
    #[tokio::test]
    async fn a_write_runs_under_its_durabilitys_setting_and_locks_and_leaves_none_behind() {
        let db = crate::testing::TestDatabase::new().await.unwrap();
        let store = &db.store;
        let mut held = None;
        for (durability, locks) in [
            (Durability::Deferred, &[7_i64, -3][..]),
            (Durability::Synced, &[][..]),
            (Durability::Deferred, &[][..]),
            (Durability::Deferred, &[11][..]),
            (Durability::Synced, &[i64::MIN, i64::MAX][..]),
        ] {
            let (setting, held_locks) = store
                .write_held(&mut held, durability, locks, async |tx| {
                    Ok(match store.backend() {
                        Backend::Postgres => {
                            let setting =
                                sqlx::query_scalar::<_, String>("SHOW synchronous_commit")
                                    .fetch_one(&mut **tx)
                                    .await?;
                            // An advisory lock on a 64-bit key names its high half `classid`
                            // and its low half `objid`.
                            let held_locks: Vec<i64> = sqlx::query_scalar(
                                "SELECT (classid::bigint << 32) | objid::bigint FROM pg_locks \
                                 WHERE locktype = 'advisory' AND pid = pg_backend_pid() \
                                 AND granted ORDER BY 1",
                            )
                            .fetch_all(&mut **tx)
                            .await?;
                            (setting, held_locks)
                        }
                        Backend::Sqlite => {
                            let setting = sqlx::query_scalar::<_, i64>("PRAGMA synchronous")
                                .fetch_one(&mut **tx)
                                .await?;
                            (setting.to_string(), Vec::new())
                        }
                    })
                })
                .await
                .unwrap();
            let expected = match (store.backend(), durability) {
                (Backend::Postgres, Durability::Synced) => "on",
                (Backend::Postgres, Durability::Deferred) => "off",
                (Backend::Sqlite, Durability::Synced) => "2",
                (Backend::Sqlite, Durability::Deferred) => "1",
            };
            assert_eq!(setting, expected, "{durability:?}");
            if store.backend() == Backend::Postgres {
                let mut locks = locks.to_vec();
                locks.sort_unstable();
                assert_eq!(held_locks, locks, "{durability:?}");
            }
        }
    }

    #[test]
    fn placeholders_number_every_value_once_row_by_row() {
        assert_eq!(super::value_rows(1, 1, 1), "($1)");
        assert_eq!(super::value_rows(1, 2, 3), "($1, $2, $3), ($4, $5, $6)");
        assert_eq!(super::value_rows(2, 2, 3), "($2, $3, $4), ($5, $6, $7)");
        assert_eq!(super::value_rows(1, 0, 3), "");
        assert_eq!(super::placeholders(1, 1), "$1");
        assert_eq!(super::placeholders(2, 3), "$2, $3, $4");
    }
}
