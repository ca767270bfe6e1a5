//! Test support: a database for one test. With `WOR_TEST_DATABASE_URL` set (CI sets it to a
//! PostgreSQL database) every test shares that database and keeps to its own projects;
//! otherwise each test gets a fresh SQLite file in a temporary directory.

use crate::{Store, StoreError};

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
}

fn uuid_hex() -> String {
    wor_core::ids::request_id()
        .trim_start_matches("req_")
        .to_owned()
}
