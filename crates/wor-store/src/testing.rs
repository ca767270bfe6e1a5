//! Test support: a database for one test. With `WOR_TEST_DATABASE_URL` set (CI sets it to a
//! PostgreSQL database) every test shares that database and keeps to its own projects;
//! otherwise each test gets a fresh SQLite file in a temporary directory.

use sqlx::Executor as _;

use crate::migrations::{AUDIT_TRIGGERS_POSTGRES, AUDIT_TRIGGERS_SQLITE};
use crate::{Backend, Store, StoreError};

/// The environment variable naming the database tests run against.
pub const TEST_DATABASE_URL: &str = "WOR_TEST_DATABASE_URL";

/// A store for one test; the temporary directory (for SQLite) lives as long as this value.
#[derive(Debug)]
pub struct TestDatabase {
    pub store: Store,
    pub url: String,
    pub dir: tempfile::TempDir,
}

impl TestDatabase {
    pub async fn new() -> Result<Self, StoreError> {
        let dir = tempfile::tempdir().map_err(|source| StoreError::DataDir {
            path: "<temporary directory>".to_owned(),
            source,
        })?;
        let url = match std::env::var(TEST_DATABASE_URL) {
            Ok(url) if !url.is_empty() => url,
            _ => format!(
                "sqlite://{}?mode=rwc",
                dir.path().join(crate::SQLITE_FILE).display()
            ),
        };
        let store = Store::connect(&url).await?;
        Ok(TestDatabase { store, url, dir })
    }

    /// A store on a database of this test's own (see [`Self::fresh_url`]): for tests whose
    /// workers claim whatever work the database holds.
    pub async fn isolated() -> Result<Self, StoreError> {
        let dir = tempfile::tempdir().map_err(|source| StoreError::DataDir {
            path: "<temporary directory>".to_owned(),
            source,
        })?;
        let url = Self::fresh_url(dir.path()).await?;
        let store = Store::connect(&url).await?;
        Ok(TestDatabase { store, url, dir })
    }

    /// A database of its own for a test that works on a whole database (rotation, audit
    /// verification): a new PostgreSQL database when `WOR_TEST_DATABASE_URL` is set, else the
    /// SQLite file in `dir`. Returns its URL; nothing is created in it yet.
    pub async fn fresh_url(dir: &std::path::Path) -> Result<String, StoreError> {
        let base = match std::env::var(TEST_DATABASE_URL) {
            Ok(url) if !url.is_empty() => url,
            _ => {
                return Ok(format!(
                    "sqlite://{}?mode=rwc",
                    dir.join(crate::SQLITE_FILE).display()
                ));
            }
        };
        sqlx::any::install_default_drivers();
        let name = format!("wor_t_{}", uuid_hex());
        let admin = sqlx::AnyPool::connect(&base).await?;
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&admin)
            .await?;
        admin.close().await;
        let mut url = url::Url::parse(&base)
            .map_err(|_| StoreError::UnsupportedUrl(crate::scrub_url(&base)))?;
        url.set_path(&format!("/{name}"));
        Ok(url.to_string())
    }

    /// A project name no other test uses, for tests sharing one PostgreSQL database.
    pub fn unique_name(prefix: &str) -> String {
        format!("{prefix}-{}", wor_core::ids::request_id())
    }

    /// Runs `statements` as an attacker with database access would: drops the triggers that
    /// keep the audit tables append-only, changes the rows, and puts the triggers back, all
    /// in one transaction (on a shared PostgreSQL database other tests never see the
    /// triggers missing).
    pub async fn tamper(&self, statements: &[String]) -> Result<(), StoreError> {
        tamper(&self.store, statements).await
    }
}

/// Holds `store`'s turn to write until the guard is dropped, as a write of this process in
/// progress does: the process's other writes wait for it meanwhile. `None` on PostgreSQL,
/// which has no such turn.
pub async fn hold_write_turn(
    store: &Store,
) -> Result<Option<tokio::sync::OwnedMutexGuard<()>>, StoreError> {
    store.write_turn().await
}

/// The statements that drop the audit log's append-only triggers on `backend`.
fn drop_audit_triggers(backend: Backend) -> &'static str {
    match backend {
        Backend::Sqlite => {
            "DROP TRIGGER audit_entries_no_update; DROP TRIGGER audit_entries_no_delete; \
             DROP TRIGGER audit_checkpoints_no_update; DROP TRIGGER audit_checkpoints_no_delete;"
        }
        Backend::Postgres => {
            "DROP TRIGGER audit_entries_append_only ON audit_entries; \
             DROP TRIGGER audit_entries_no_truncate ON audit_entries; \
             DROP TRIGGER audit_checkpoints_append_only ON audit_checkpoints; \
             DROP TRIGGER audit_checkpoints_no_truncate ON audit_checkpoints;"
        }
    }
}

/// Drops the audit log's append-only triggers and leaves them dropped, as an attacker with the
/// database's credentials could.
pub async fn unguard_audit(store: &Store) -> Result<(), StoreError> {
    let mut tx = store.begin_write().await?;
    tx.execute(sqlx::raw_sql(drop_audit_triggers(store.backend())))
        .await?;
    tx.commit().await?;
    Ok(())
}

/// [`TestDatabase::tamper`] on any store, for tests that open the database a binary used.
pub async fn tamper(store: &Store, statements: &[String]) -> Result<(), StoreError> {
    {
        let drop = drop_audit_triggers(store.backend());
        let create = match store.backend() {
            Backend::Sqlite => AUDIT_TRIGGERS_SQLITE,
            Backend::Postgres => AUDIT_TRIGGERS_POSTGRES,
        };
        let mut tx = store.begin_write().await?;
        tx.execute(sqlx::raw_sql(drop)).await?;
        for statement in statements {
            tx.execute(sqlx::raw_sql(sqlx::AssertSqlSafe(statement.clone())))
                .await?;
        }
        tx.execute(sqlx::raw_sql(create)).await?;
        tx.commit().await?;
        Ok(())
    }
}

fn uuid_hex() -> String {
    wor_core::ids::request_id()
        .trim_start_matches("req_")
        .to_owned()
}

/// The key of `project`'s audit chain lock on PostgreSQL (a transaction-scoped advisory lock),
/// for a test that holds it as another process's writer would.
pub fn audit_chain_lock_key(project: wor_core::ProjectId) -> i64 {
    crate::audit::advisory_lock_key(project)
}

/// The most steps of a run's journal write that its fence inserts in its own statement on
/// PostgreSQL; a write with more inserts them in statements of their own.
pub const STEPS_PER_WRITE_STATEMENT: usize = crate::runs::STEPS_PER_WRITE_STATEMENT;

/// How many audit events of `project` wait staged (`audit_staged`), not yet appended.
pub async fn staged_count(store: &Store, project: wor_core::ProjectId) -> Result<i64, StoreError> {
    let count: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM audit_staged WHERE project_id = $1")
        .bind(project.to_string())
        .fetch_one(store.pool())
        .await?;
    Ok(count)
}
