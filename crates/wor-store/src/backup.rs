//! Backups of the embedded SQLite database, taken while the server runs, and their restore
//! into a fresh data directory.
//!
//! A backup is one SQLite file written by `VACUUM INTO`: a read transaction, so it is one
//! consistent snapshot however many writers are busy, and it never blocks them. It holds the
//! sealed secrets as ciphertexts only; the key ring lives outside the database (environment or
//! key file) and so is never in a backup. PostgreSQL is backed up with `pg_dump`.

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
    #[error(
        "`{path}` is there already (a database or its journal files); restore into a data directory without them"
    )]
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

/// A backup restored into a data dir and opened, not yet accepted: [`Restored::discard`]
/// takes it away again, with the directories the restore made.
#[derive(Debug)]
pub struct Restored {
    pub store: Store,
    place: RestorePlace,
}

impl Restored {
    /// Closes the restored database and removes it, its journal files, and each directory the
    /// restore made for it that is still empty.
    pub async fn discard(self) {
        self.store.close().await;
        self.place.discard();
    }
}

/// Where a restore writes: the data dir, and the outermost directory of it the restore made
/// (`None`: it existed).
#[derive(Debug)]
struct RestorePlace {
    data_dir: PathBuf,
    made_from: Option<PathBuf>,
}

impl RestorePlace {
    /// Makes `data_dir` (mode 0700, parents too) where it is missing, remembering the
    /// outermost directory it made.
    fn make(data_dir: &Path) -> Result<Self, BackupError> {
        let mut made_from = None;
        let mut dir = data_dir;
        while !dir.exists() {
            made_from = Some(dir.to_path_buf());
            match dir.parent() {
                Some(parent) if !parent.as_os_str().is_empty() => dir = parent,
                _ => break,
            }
        }
        {
            use std::os::unix::fs::DirBuilderExt as _;
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(data_dir)
                .map_err(io(data_dir))?;
        }
        let place = RestorePlace {
            data_dir: data_dir.to_path_buf(),
            made_from,
        };
        // A data dir `wor serve` would refuse is refused before anything is written to it.
        if let Err(refused) = crate::refuse_an_open_data_dir(data_dir) {
            place.discard();
            return Err(refused.into());
        }
        Ok(place)
    }

    /// Removes the restored database with its journal files, then each directory made for it,
    /// from the data dir outwards, while it is empty.
    fn discard(&self) {
        discard_restored(&self.data_dir);
        let Some(outermost) = &self.made_from else {
            return;
        };
        let mut dir = self.data_dir.as_path();
        loop {
            if std::fs::remove_dir(dir).is_err() || dir == outermost.as_path() {
                break;
            }
            match dir.parent() {
                Some(parent) => dir = parent,
                None => break,
            }
        }
    }
}

/// Copies the backup `from` into `data_dir` as its database, which must not exist yet, and
/// opens it (applying the migrations of this release to an older backup), after checking that
/// the file is whole, undamaged and a Work on Repeat database. The caller checks the restored
/// copy and calls [`Restored::discard`] if it refuses it.
pub async fn restore_sqlite(from: &Path, data_dir: &Path) -> Result<Restored, BackupError> {
    let target = data_dir.join(SQLITE_FILE);
    let exists = || BackupError::DatabaseExists {
        path: target.display().to_string(),
    };
    // The database, or journal files a database left: SQLite would read a log left beside the
    // restored copy into it.
    if let Some(found) = ["", "-wal", "-shm"]
        .iter()
        .map(|suffix| data_dir.join(format!("{SQLITE_FILE}{suffix}")))
        .find(|path| path.exists())
    {
        return Err(BackupError::DatabaseExists {
            path: found.display().to_string(),
        });
    }
    let not_a_backup = |reason: String| BackupError::NotABackup {
        path: from.display().to_string(),
        reason,
    };
    // Only the header is read before the file is known to be a whole SQLite database; the
    // rest is copied, never held in memory.
    // Looked at before it is opened, as opening a FIFO would wait for a writer; and again once
    // open, for what the path names now.
    let not_a_file = || not_a_backup("it is not a regular file".to_owned());
    if !std::fs::metadata(from).map_err(io(from))?.is_file() {
        return Err(not_a_file());
    }
    let mut source = std::fs::File::open(from).map_err(io(from))?;
    let metadata = source.metadata().map_err(io(from))?;
    if !metadata.is_file() {
        return Err(not_a_file());
    }
    let mut header = Vec::with_capacity(SQLITE_HEADER_LEN);
    {
        use std::io::Read as _;
        (&mut source)
            .take(SQLITE_HEADER_LEN as u64)
            .read_to_end(&mut header)
            .map_err(io(from))?;
    }
    sqlite_file_whole(&header, metadata.len()).map_err(not_a_backup)?;
    {
        use std::io::Seek as _;
        source.seek(std::io::SeekFrom::Start(0)).map_err(io(from))?;
    }
    let place = RestorePlace::make(data_dir)?;
    let created = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&target);
    let mut file = match created {
        Ok(file) => file,
        // Another process made the database since it was looked for: it is not this
        // restore's to remove.
        Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => return Err(exists()),
        Err(source) => {
            place.discard();
            return Err(BackupError::Io {
                path: target.display().to_string(),
                source,
            });
        }
    };
    // From here the database file is this restore's own, removed with anything refused.
    let refuse = |error: BackupError| {
        place.discard();
        error
    };
    // An error is told under the file it came from: the backup's when reading it failed.
    let copied = copy_into(&mut source, &mut file)
        .and_then(|()| file.sync_all().map_err(CopyFailed::Writing));
    match copied {
        Ok(()) => {}
        Err(CopyFailed::Reading(error)) => return Err(refuse(io(from)(error))),
        Err(CopyFailed::Writing(error)) => return Err(refuse(io(&target)(error))),
    }
    drop(file);
    // Damage inside the file, or a database of something else, is found before the store
    // opens it: the pool would retry a connection to a damaged file until its timeout, and
    // the migrations would make any database look like one of ours.
    if let Err(reason) = quick_check(&target) {
        return Err(refuse(not_a_backup(reason)));
    }
    let url = format!("sqlite://{}?mode=rw", target.display());
    match Store::connect(&url).await {
        Ok(store) => Ok(Restored { store, place }),
        // A backup of a newer release is one, which this release cannot serve: said so.
        Err(error @ StoreError::NewerSchema(_)) => Err(refuse(error.into())),
        Err(error) => Err(refuse(not_a_backup(error.to_string()))),
    }
}

/// Which side of a copy failed.
#[derive(Debug)]
enum CopyFailed {
    Reading(std::io::Error),
    Writing(std::io::Error),
}

/// Copies all of `source` into `target`, saying which of them an error came from.
fn copy_into(
    source: &mut impl std::io::Read,
    target: &mut impl std::io::Write,
) -> Result<(), CopyFailed> {
    let mut buffer = vec![0u8; 64 * 1024];
    loop {
        let read = match source.read(&mut buffer) {
            Ok(0) => return target.flush().map_err(CopyFailed::Writing),
            Ok(read) => read,
            Err(error) if error.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(error) => return Err(CopyFailed::Reading(error)),
        };
        let chunk = buffer.get(..read).unwrap_or_default();
        target.write_all(chunk).map_err(CopyFailed::Writing)?;
    }
}

/// Length of an SQLite database file's header.
const SQLITE_HEADER_LEN: usize = 100;

/// Whether a file of `len` bytes that begins with `header` is a whole SQLite database file, as
/// far as its header tells: its magic string, and as many pages as the header counts (a copy
/// cut short has fewer).
fn sqlite_file_whole(header: &[u8], len: u64) -> Result<(), String> {
    let header = header
        .get(..SQLITE_HEADER_LEN)
        .ok_or_else(|| "it is not an SQLite database (shorter than a header)".to_owned())?;
    if header.get(..16) != Some(b"SQLite format 3\0".as_slice()) {
        return Err("it is not an SQLite database".to_owned());
    }
    let be_u32 = |at: usize| {
        header
            .get(at..at + 4)
            .and_then(|b| <[u8; 4]>::try_from(b).ok())
            .map_or(0, u32::from_be_bytes)
    };
    let page_size = match header.get(16..18) {
        Some([0, 1]) => 65_536,
        Some([high, low]) => u64::from(u16::from_be_bytes([*high, *low])),
        _ => 0,
    };
    // The page count in the header is valid when the change counter it was written with
    // matches the file's (SQLite's file format, "in-header database size").
    let pages = u64::from(be_u32(28));
    if page_size > 0 && pages > 0 && be_u32(92) == be_u32(24) {
        let expected = page_size.saturating_mul(pages);
        if len < expected {
            return Err(format!(
                "it is cut short (or its header is damaged): it holds {len} of the {expected} \
                 bytes its header counts"
            ));
        }
    }
    Ok(())
}

/// SQLite's own quick check of the database file at `path`, opened read-only, and whether it
/// holds Work on Repeat's tables: `Err` with what was found when the file is damaged or is
/// some other database.
fn quick_check(path: &Path) -> Result<(), String> {
    let connection = rusqlite::Connection::open_with_flags(
        path,
        rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(|e| format!("it cannot be opened: {e}"))?;
    let found: Vec<String> = connection
        .prepare("PRAGMA quick_check(5)")
        .and_then(|mut statement| {
            statement
                .query_map([], |row| row.get::<_, String>(0))?
                .collect::<Result<_, _>>()
        })
        .map_err(|e| format!("it is damaged: {e}"))?;
    if !matches!(found.as_slice(), [ok] if ok == "ok") {
        return Err(format!("it is damaged: {}", found.join("; ")));
    }
    // A backup is a database this project's migrations made: it records them, and holds the
    // projects every record belongs to.
    let ours: i64 = connection
        .query_row(
            "SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' \
             AND name IN ('_sqlx_migrations', 'projects')",
            [],
            |row| row.get(0),
        )
        .map_err(|e| format!("it is damaged: {e}"))?;
    if ours < 2 {
        return Err(
            "it is an SQLite database of something else: it has no migrations or projects of \
             Work on Repeat"
                .to_owned(),
        );
    }
    // A newer release's schema is that release's to judge: opening it says what made it.
    let newest: Option<i64> = connection
        .query_row("SELECT MAX(version) FROM _sqlx_migrations", [], |row| {
            row.get(0)
        })
        .map_err(|e| format!("it is damaged: {e}"))?;
    if newest.is_some_and(|newest| newest > crate::migrations::latest_version()) {
        return Ok(());
    }
    audit_triggers_intact(&connection)
}

/// Whether the database holds the triggers that keep its audit log append-only, each as the
/// migrations made it: one dropped or rewritten (which the migrations, recorded as run, would
/// not make again) would leave the restored log open to edits. `Err` names them.
fn audit_triggers_intact(connection: &rusqlite::Connection) -> Result<(), String> {
    let found: std::collections::HashMap<String, String> = connection
        .prepare("SELECT name, sql FROM sqlite_master WHERE type = 'trigger'")
        .and_then(|mut statement| {
            statement
                .query_map([], |row| {
                    Ok((row.get::<_, String>(0)?, row.get::<_, Option<String>>(1)?))
                })?
                .collect::<Result<Vec<_>, _>>()
        })
        .map_err(|e| format!("it is damaged: {e}"))?
        .into_iter()
        .map(|(name, sql)| (name, sql.unwrap_or_default()))
        .collect();
    let altered = crate::migrations::altered_sqlite_audit_triggers(&found);
    if altered.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "the triggers that keep its audit log append-only were altered ({}): a backup is \
             never changed so",
            altered.join(", ")
        ))
    }
}

/// Removes a restored database that its checks refused (with SQLite's journal files).
fn discard_restored(data_dir: &Path) {
    for suffix in ["", "-wal", "-shm"] {
        let path: PathBuf = data_dir.join(format!("{SQLITE_FILE}{suffix}"));
        let _ = std::fs::remove_file(path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A database at `path` with what the quick check looks for in one of ours: the migrations
    /// and projects tables, and the audit tables with their append-only triggers.
    fn ours(path: &Path) -> rusqlite::Connection {
        let connection = rusqlite::Connection::open(path).unwrap();
        connection
            .execute_batch(
                "CREATE TABLE _sqlx_migrations (version BIGINT PRIMARY KEY); \
                 CREATE TABLE projects (id TEXT PRIMARY KEY); \
                 CREATE TABLE audit_entries (seq INTEGER PRIMARY KEY); \
                 CREATE TABLE audit_checkpoints (seq INTEGER PRIMARY KEY);",
            )
            .unwrap();
        connection
            .execute_batch(crate::migrations::AUDIT_TRIGGERS_SQLITE)
            .unwrap();
        connection
    }

    /// Gives `good` bytes, then fails as a disk's read error would.
    struct FailsAfter {
        good: usize,
    }

    impl std::io::Read for FailsAfter {
        fn read(&mut self, buffer: &mut [u8]) -> std::io::Result<usize> {
            if self.good == 0 {
                return Err(std::io::Error::from_raw_os_error(5));
            }
            let read = self.good.min(buffer.len());
            self.good -= read;
            Ok(read)
        }
    }

    #[test]
    fn a_copy_says_which_side_failed() {
        use std::io::Read as _;
        let mut copied = Vec::new();
        match copy_into(&mut FailsAfter { good: 70_000 }, &mut copied) {
            Err(CopyFailed::Reading(error)) => assert_eq!(error.raw_os_error(), Some(5)),
            other => panic!("{other:?}"),
        }
        assert_eq!(copied.len(), 70_000, "what was read before is written");
        let mut full = [0u8; 10];
        match copy_into(&mut std::io::repeat(1).take(11), &mut full.as_mut_slice()) {
            Err(CopyFailed::Writing(error)) => {
                assert_eq!(error.kind(), std::io::ErrorKind::WriteZero);
            }
            other => panic!("{other:?}"),
        }
        let mut whole = Vec::new();
        assert!(copy_into(&mut std::io::repeat(7).take(200_000), &mut whole).is_ok());
        assert_eq!(whole, vec![7u8; 200_000]);
    }

    /// A header of `pages` pages of 4096 bytes, its page count valid.
    fn header(pages: u32) -> Vec<u8> {
        let mut header = vec![0u8; SQLITE_HEADER_LEN];
        header[..16].copy_from_slice(b"SQLite format 3\0");
        header[16..18].copy_from_slice(&4096u16.to_be_bytes());
        header[24..28].copy_from_slice(&7u32.to_be_bytes());
        header[28..32].copy_from_slice(&pages.to_be_bytes());
        header[92..96].copy_from_slice(&7u32.to_be_bytes());
        header
    }

    #[test]
    fn a_file_shorter_than_its_header_counts_is_cut_short() {
        let mut whole = header(3);
        whole.resize(3 * 4096, 0);
        let len = |bytes: &[u8]| u64::try_from(bytes.len()).unwrap();
        assert_eq!(sqlite_file_whole(&whole, len(&whole)), Ok(()));
        let cut = whole.get(..2 * 4096 + 10).unwrap();
        let refused = sqlite_file_whole(cut, len(cut)).unwrap_err();
        assert!(
            refused.contains("cut short") && refused.contains("8202 of the 12288"),
            "{refused}"
        );
        // A page count left by an older writer (its change counter differs) is not trusted.
        let mut stale = whole.get(..2 * 4096).unwrap().to_vec();
        stale[92..96].copy_from_slice(&6u32.to_be_bytes());
        assert_eq!(sqlite_file_whole(&stale, len(&stale)), Ok(()));
        assert!(
            sqlite_file_whole(b"SQLite format 3\0", 16)
                .unwrap_err()
                .contains("shorter")
        );
        assert!(
            sqlite_file_whole(&[b'x'; 200], 200)
                .unwrap_err()
                .contains("not an SQLite")
        );
    }

    #[test]
    fn a_file_damaged_inside_or_of_something_else_fails_the_quick_check() {
        let dir = tempfile::tempdir().unwrap();
        let other = dir.path().join("other");
        rusqlite::Connection::open(&other)
            .unwrap()
            .execute_batch("CREATE TABLE t (id INTEGER PRIMARY KEY)")
            .unwrap();
        let found = quick_check(&other).unwrap_err();
        assert!(found.contains("of something else"), "{found}");

        let path = dir.path().join("db");
        {
            let connection = ours(&path);
            connection
                .execute_batch(
                    "CREATE TABLE t (id INTEGER PRIMARY KEY, body TEXT); \
                     CREATE INDEX t_body ON t (body);",
                )
                .unwrap();
            for n in 0..2000 {
                connection
                    .execute(
                        "INSERT INTO t (body) VALUES (?1)",
                        [format!("row {n} {}", "x".repeat(200))],
                    )
                    .unwrap();
            }
        }
        assert_eq!(quick_check(&path), Ok(()));
        let mut bytes = std::fs::read(&path).unwrap();
        let middle = bytes.len() / 2;
        bytes[middle..middle + 3000].fill(0x5a);
        std::fs::write(&path, &bytes).unwrap();
        let found = quick_check(&path).unwrap_err();
        assert!(found.starts_with("it is damaged"), "{found}");
    }

    #[test]
    fn a_database_whose_audit_triggers_were_dropped_or_rewritten_fails_the_check() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db");
        let connection = ours(&path);
        assert_eq!(quick_check(&path), Ok(()));
        connection
            .execute_batch(
                "DROP TRIGGER audit_entries_no_delete; \
                 DROP TRIGGER audit_checkpoints_no_update; \
                 CREATE TRIGGER audit_checkpoints_no_update BEFORE UPDATE ON audit_checkpoints \
                 BEGIN SELECT 1; END;",
            )
            .unwrap();
        let found = quick_check(&path).unwrap_err();
        assert!(
            found.contains("`audit_entries_no_delete` missing")
                && found.contains("`audit_checkpoints_no_update` rewritten")
                && !found.contains("audit_entries_no_update"),
            "{found}"
        );
        // A newer release's database is left to opening it, which names what made it: its
        // triggers may differ from this release's.
        connection
            .execute(
                "INSERT INTO _sqlx_migrations (version) VALUES (?1)",
                [crate::migrations::latest_version() + 1],
            )
            .unwrap();
        assert_eq!(quick_check(&path), Ok(()));
    }
}
