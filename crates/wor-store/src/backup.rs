//! Backups of the embedded SQLite database, taken while the server runs, and their restore
//! into a fresh data directory.
//!
//! A backup is one SQLite file written by `VACUUM INTO`: a read transaction, so it is one
//! consistent snapshot however many writers are busy, and it never blocks them. It holds the
//! sealed secrets as ciphertexts only; the key ring lives outside the database (environment or
//! key file) and so is never in a backup. PostgreSQL is backed up with `pg_dump`.

use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};

use crate::{Backend, SQLITE_FILE, Store, StoreError};

/// Why a backup or a restore could not be made.
#[derive(Debug, thiserror::Error)]
pub enum BackupError {
    /// The database is PostgreSQL, whose own tools make consistent backups.
    #[error(
        "the database is PostgreSQL: back it up with `pg_dump --format=custom` and restore it \
         with `pg_restore` (see docs/operations.md); the key ring is not in the dump either"
    )]
    Postgres,
    #[error("`{path}` already exists; a backup never overwrites a file")]
    TargetExists { path: String },
    #[error("`{path}` already holds a database; restore into an empty data directory")]
    DatabaseExists { path: String },
    #[error("cannot read or write `{path}`")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("`{path}` is not a Work on Repeat backup: {reason}")]
    NotABackup { path: String, reason: String },
    #[error(transparent)]
    Store(#[from] StoreError),
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> BackupError {
    let path = path.display().to_string();
    move |source| BackupError::Io { path, source }
}

impl Store {
    /// Writes a consistent copy of the whole SQLite database to `target`, a file that must not
    /// exist yet; created with mode 0600, as it holds the project's records. Safe while other
    /// connections (a running server) write.
    pub async fn backup_into(&self, target: &Path) -> Result<(), BackupError> {
        if self.backend() == Backend::Postgres {
            return Err(BackupError::Postgres);
        }
        // `VACUUM INTO` needs a missing or empty file: creating it empty first sets its mode
        // and refuses an existing file in one step.
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(target)
            .map_err(|source| match source.kind() {
                std::io::ErrorKind::AlreadyExists => BackupError::TargetExists {
                    path: target.display().to_string(),
                },
                _ => BackupError::Io {
                    path: target.display().to_string(),
                    source,
                },
            })?;
        let text = target.to_str().ok_or_else(|| BackupError::Io {
            path: target.display().to_string(),
            source: std::io::Error::new(std::io::ErrorKind::InvalidInput, "path is not UTF-8"),
        })?;
        let written = sqlx::query("VACUUM INTO $1")
            .bind(text.to_owned())
            .execute(self.pool())
            .await;
        if let Err(err) = written {
            let _ = std::fs::remove_file(target);
            return Err(StoreError::from(err).into());
        }
        Ok(())
    }
}

/// Copies the backup `from` into `data_dir` as its database, which must not exist yet, and
/// opens it (applying the migrations of this release to an older backup). The caller checks
/// the restored copy and calls [`discard_restored`] if it refuses it.
pub async fn restore_sqlite(from: &Path, data_dir: &Path) -> Result<Store, BackupError> {
    let target = data_dir.join(SQLITE_FILE);
    if target.exists() {
        return Err(BackupError::DatabaseExists {
            path: target.display().to_string(),
        });
    }
    let not_a_backup = |reason: String| BackupError::NotABackup {
        path: from.display().to_string(),
        reason,
    };
    let mut header = [0u8; 16];
    {
        use std::io::Read as _;
        let mut file = std::fs::File::open(from).map_err(io(from))?;
        file.read_exact(&mut header)
            .map_err(|e| not_a_backup(e.to_string()))?;
    }
    if &header != b"SQLite format 3\0" {
        return Err(not_a_backup("it is not an SQLite database".to_owned()));
    }
    {
        use std::os::unix::fs::DirBuilderExt as _;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(data_dir)
            .map_err(io(data_dir))?;
    }
    let bytes = std::fs::read(from).map_err(io(from))?;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&target)
        .map_err(io(&target))?;
    file.write_all(&bytes).map_err(io(&target))?;
    file.sync_all().map_err(io(&target))?;
    drop(file);
    let url = format!("sqlite://{}?mode=rw", target.display());
    let has_schema = async {
        let store = Store::connect(&url).await?;
        let projects: Result<(i64,), sqlx::Error> = sqlx::query_as("SELECT COUNT(*) FROM projects")
            .fetch_one(store.pool())
            .await;
        Ok::<_, StoreError>((store, projects))
    }
    .await;
    match has_schema {
        Ok((store, Ok(_))) => Ok(store),
        Ok((store, Err(err))) => {
            store.close().await;
            discard_restored(data_dir);
            Err(not_a_backup(err.to_string()))
        }
        Err(err) => {
            discard_restored(data_dir);
            Err(not_a_backup(err.to_string()))
        }
    }
}

/// Removes a restored database that its checks refused (with SQLite's journal files).
pub fn discard_restored(data_dir: &Path) {
    for suffix in ["", "-wal", "-shm"] {
        let path: PathBuf = data_dir.join(format!("{SQLITE_FILE}{suffix}"));
        let _ = std::fs::remove_file(path);
    }
}
