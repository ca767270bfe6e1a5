//! SQLite's write-ahead log, as the audit writer keeps it: the log syncer, which flushes it
//! for the batches that must be on disk before they are acknowledged, and the checkpointer,
//! which copies it into the database file. Both work off the writer's thread, so that the
//! writer never waits for the disk while it holds the database's write lock.

use std::time::Duration;

use sqlx::Row;
use tokio::sync::mpsc;

use crate::{Backend, Store, StoreError};

/// What a committed batch's callers are told once it is on disk, or why it could not be.
pub(crate) type Acknowledgement = Box<dyn FnOnce(Result<(), &'static str>) + Send>;

/// Syncs SQLite's write-ahead log for batches that must be on disk before they are
/// acknowledged, so that the writer does not hold the database's write lock while the disk
/// flushes.
///
/// Such a batch is committed with `synchronous = NORMAL`: its pages are in the log file (in
/// the operating system's cache) when its commit returns, and the lock is free for the next
/// batch at once. The batch's acknowledgement then waits here for a `fdatasync` of the log
/// file that began after the commit: that flushes every page written to the file before it,
/// so the batch — and every deferred batch before it — survives a power cut once it is
/// acknowledged, as with `synchronous = FULL`. Batches that commit while a sync runs share the
/// next one. SQLite syncs the log itself before a checkpoint copies it into the database file
/// and when it starts reusing the file, also with `NORMAL`.
pub(crate) async fn sync_wal(log: WalLog, mut waiting: mpsc::UnboundedReceiver<Acknowledgement>) {
    let mut log = Some(log);
    while let Some(first) = waiting.recv().await {
        let mut acknowledgements = vec![first];
        while let Ok(next) = waiting.try_recv() {
            acknowledgements.push(next);
        }
        // After a failed flush the kernel may have dropped the pages it could not write and
        // marked them clean, so a later flush could succeed over a hole in the log: nothing
        // is acknowledged as on disk again until the process restarts (and SQLite recovers
        // the log from what is really there).
        let synced = match log.take() {
            Some(mut open) => tokio::task::spawn_blocking(move || open.sync().map(|()| open))
                .await
                .map_err(|_| std::io::ErrorKind::Other)
                .and_then(|flushed| flushed.map_err(|e| e.kind())),
            None => Err(std::io::ErrorKind::Other),
        };
        let result = match synced {
            Ok(open) => {
                crate::metrics::audit_log_synced();
                log = Some(open);
                Ok(())
            }
            Err(kind) => {
                tracing::error!(
                    category = "audit",
                    kind = ?kind,
                    "the write-ahead log could not be synced: no synced write is acknowledged until the server restarts"
                );
                Err(WAL_SYNC)
            }
        };
        for acknowledgement in acknowledgements {
            acknowledgement(result);
        }
    }
}

/// The kind of error a synced write gets when the log could not be flushed.
pub(crate) const WAL_SYNC: &str = "wal_sync";

/// SQLite's write-ahead log file, held open by the log syncer: a flush through a handle held
/// across flushes reports a write error the kernel saw since the previous one, where a fresh
/// handle may not. The file is opened again only when the one at its path is another.
pub(crate) struct WalLog {
    /// The database file whose log this is.
    pub(crate) database: std::path::PathBuf,
    path: std::path::PathBuf,
    file: std::fs::File,
}

impl WalLog {
    fn open(database: std::path::PathBuf) -> std::io::Result<WalLog> {
        let mut path = database.clone().into_os_string();
        path.push("-wal");
        let path = std::path::PathBuf::from(path);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)?;
        Ok(WalLog {
            database,
            path,
            file,
        })
    }

    /// Flushes the log file at its path to disk.
    fn sync(&mut self) -> std::io::Result<()> {
        use std::os::unix::fs::MetadataExt as _;
        let at_path = std::fs::metadata(&self.path)?;
        let held = self.file.metadata()?;
        if (at_path.dev(), at_path.ino()) != (held.dev(), held.ino()) {
            // SQLite deletes the log only when its last connection closes, after copying it
            // into the database file and syncing that; what was committed since is in the
            // new file, which is the one to flush from now on.
            *self = WalLog::open(self.database.clone())?;
        }
        self.file.sync_data()
    }
}

/// The write-ahead log of the SQLite database `store` writes to, opened, when the database is
/// a file in WAL mode; otherwise batches are synced by SQLite itself (`synchronous = FULL`).
pub(crate) async fn wal_log(store: &Store) -> Option<WalLog> {
    if store.backend != Backend::Sqlite {
        return None;
    }
    let mode = sqlx::query("PRAGMA journal_mode")
        .fetch_one(store.pool())
        .await
        .ok()?;
    let mode: String = mode.try_get(0).ok()?;
    if !mode.eq_ignore_ascii_case("wal") {
        return None;
    }
    let row = sqlx::query("SELECT file FROM pragma_database_list WHERE name = 'main'")
        .fetch_optional(store.pool())
        .await
        .ok()??;
    let file: String = row.try_get("file").ok()?;
    if file.is_empty() {
        return None;
    }
    let database = std::path::PathBuf::from(file);
    match tokio::task::spawn_blocking(move || WalLog::open(database)).await {
        Ok(Ok(log)) => Some(log),
        _ => {
            tracing::warn!(
                category = "audit",
                "the write-ahead log cannot be opened for syncing; SQLite syncs each synced batch itself"
            );
            None
        }
    }
}

/// How long the checkpointer rests after a checkpoint: what is committed meanwhile is copied
/// by the next one, together.
const CHECKPOINT_SPACING: Duration = Duration::from_millis(100);

/// How often the checkpointer looks at the log when no commit of the writer woke it: the
/// process's other connections commit too (leases, claims, API changes).
const CHECKPOINT_IDLE: Duration = Duration::from_secs(1);

/// The log's length, in pages, past which the writer is asked to restart it (16 MiB of
/// 4 KiB pages).
const RESTART_AT_PAGES: i64 = 4096;

/// How long the writer's restart of the log waits for readers still on it before giving up
/// until the next request.
const RESTART_WAIT: Duration = Duration::from_millis(50);

/// How long the writer waits before trying a restart again after readers kept the log: a
/// reader that keeps it (a backup, an export) holds up the writer for at most
/// [`RESTART_WAIT`] per this.
pub(crate) const RESTART_BACKOFF: Duration = Duration::from_secs(1);

/// Copies SQLite's write-ahead log into the database file, on a thread and a connection of
/// its own, after the writer commits (at most every [`CHECKPOINT_SPACING`]) and every
/// [`CHECKPOINT_IDLE`] otherwise.
///
/// SQLite would otherwise do it right after the commit that takes the log past 1,000 pages,
/// on the committing connection: the writer's thread would wait for a flush of the log and
/// one of the database file, several milliseconds in which no run's write was committed.
/// The writer's own connection leaves it to this thread (`wal_autocheckpoint = 0`). A
/// checkpoint here is `PASSIVE`: it copies what no reader still needs and waits for no one;
/// SQLite flushes the log before copying it and the database file after.
///
/// The log is reused from its start only by a writer that begins once all of it is copied,
/// which under a steady stream of commits never happens after a checkpoint that let them go
/// on. So once the log is longer than [`RESTART_AT_PAGES`], the writer is asked (through
/// [`WalCheckpointer::committed`]) to restart it between two batches: a `RESTART` checkpoint
/// on its own connection, which copies only what came since the last checkpoint here (after
/// one that readers kept, not again for [`RESTART_BACKOFF`]). Dropping the handle stops the
/// thread after a last checkpoint.
pub(crate) struct WalCheckpointer {
    wake: std::sync::mpsc::SyncSender<()>,
    restart: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl WalCheckpointer {
    /// Starts the checkpointer of `database`'s log.
    pub(crate) fn start(
        database: &std::path::Path,
    ) -> Result<WalCheckpointer, CheckpointerUnavailable> {
        let connection = rusqlite::Connection::open_with_flags(
            database,
            rusqlite::OpenFlags::SQLITE_OPEN_READ_WRITE | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )?;
        connection.execute_batch(crate::SQLITE_CONNECTION_SETTINGS)?;
        let (wake, woken) = std::sync::mpsc::sync_channel(1);
        let restart = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let asks = restart.clone();
        std::thread::Builder::new()
            .name("wor-wal-checkpoint".to_owned())
            .spawn(move || checkpoint_loop(&connection, &woken, &asks))?;
        Ok(WalCheckpointer { wake, restart })
    }

    /// The writer committed: the checkpointer copies it soon. Never blocks.
    pub(crate) fn committed(&self) -> AfterCommit {
        match self.wake.try_send(()) {
            Err(std::sync::mpsc::TrySendError::Disconnected(())) => AfterCommit::Stopped,
            Ok(()) | Err(std::sync::mpsc::TrySendError::Full(())) => {
                if self
                    .restart
                    .swap(false, std::sync::atomic::Ordering::AcqRel)
                {
                    AfterCommit::RestartLog
                } else {
                    AfterCommit::Nothing
                }
            }
        }
    }
}

/// What the writer is to do after a commit, as the checkpointer says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AfterCommit {
    Nothing,
    /// Restart the log ([`restart_log`]).
    RestartLog,
    /// The checkpointer's thread has ended: the writer's connection checkpoints again as it
    /// commits.
    Stopped,
}

/// Why the checkpointer could not start.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CheckpointerUnavailable {
    #[error("its connection cannot open: {0}")]
    Connection(#[from] rusqlite::Error),
    #[error("its thread cannot start: {0}")]
    Thread(#[from] std::io::Error),
}

impl CheckpointerUnavailable {
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            CheckpointerUnavailable::Connection(_) => "connection",
            CheckpointerUnavailable::Thread(_) => "thread",
        }
    }
}

/// Copies all of the log into the database file on `connection`, the writer's, and has the
/// next write reuse it from its start: a `RESTART` checkpoint, waiting at most
/// [`RESTART_WAIT`] for readers still on the log (it is asked again if they were). Whether
/// the log was restarted.
pub(crate) fn restart_log(connection: &rusqlite::Connection) -> Result<bool, rusqlite::Error> {
    connection.busy_timeout(RESTART_WAIT)?;
    let busy = connection.query_row("PRAGMA wal_checkpoint(RESTART)", [], |row| {
        row.get::<_, i64>(0)
    });
    // The writer's connection waits inside SQLite for no lock (`EmbeddedWriter::open`).
    connection.busy_timeout(Duration::ZERO)?;
    let restarted = busy? == 0;
    if restarted {
        crate::metrics::wal_checkpointed("restart");
    }
    Ok(restarted)
}

fn checkpoint_loop(
    connection: &rusqlite::Connection,
    woken: &std::sync::mpsc::Receiver<()>,
    restart: &std::sync::atomic::AtomicBool,
) {
    let mut last = None;
    // Said once when checkpoints begin to fail, and once when they work again.
    let mut failing = false;
    loop {
        let stopping = matches!(
            woken.recv_timeout(CHECKPOINT_IDLE),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected)
        );
        match checkpoint(connection) {
            // The pragma reports the log's length and how much of it is in the database file,
            // not what this call copied: a log already copied reports the same pair again.
            Ok(now) => {
                if now.copied > 0 && last != Some(now) {
                    crate::metrics::wal_checkpointed("passive");
                }
                if now.log > RESTART_AT_PAGES {
                    restart.store(true, std::sync::atomic::Ordering::Release);
                }
                last = Some(now);
                if std::mem::take(&mut failing) {
                    tracing::info!(
                        category = "store",
                        "the write-ahead log is copied into the database file again"
                    );
                }
            }
            Err(error) => {
                if !std::mem::replace(&mut failing, true) {
                    tracing::warn!(
                        category = "store",
                        kind = StoreError::from(error).kind(),
                        "the write-ahead log could not be copied into the database file; it is tried again"
                    );
                }
            }
        }
        if stopping {
            return;
        }
        std::thread::sleep(CHECKPOINT_SPACING);
    }
}

/// What a checkpoint reports: the log's length in pages, and how many of them are in the
/// database file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Checkpointed {
    log: i64,
    copied: i64,
}

/// One `PASSIVE` checkpoint.
fn checkpoint(connection: &rusqlite::Connection) -> Result<Checkpointed, rusqlite::Error> {
    connection.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |row| {
        Ok(Checkpointed {
            log: row.get(1)?,
            copied: row.get(2)?,
        })
    })
}
