//! A look at a database without changing it, for `wor doctor`: is it reachable, how far are
//! its migrations, and what time does it think it is.

use std::path::Path;
use std::time::Duration;

use sqlx::any::{AnyPoolOptions, install_default_drivers};

use crate::{Backend, SQLITE_FILE, StoreError};

/// What [`probe`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DatabaseProbe {
    pub backend: Backend,
    /// The newest migration applied to the database (0 for none).
    pub applied_migration: i64,
    /// The newest migration this release knows.
    pub latest_migration: i64,
    /// The database server's clock, in milliseconds since the epoch (PostgreSQL only: an
    /// embedded SQLite database has the host's clock).
    pub server_now_ms: Option<i64>,
    /// The keys the database's records need, once its migrations made their tables.
    pub keys: Option<KeysInUse>,
    /// What keeps the audit log append-only and is not as the migrations made it (each trigger
    /// missing, rewritten or disabled, named), once its migrations made the audit tables:
    /// empty when it is whole.
    pub audit_unguarded: Option<Vec<String>>,
}

/// The keys a database's records need: what a server on it must hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeysInUse {
    /// The key ids its secrets are sealed under, with how many secrets each seals.
    pub sealed: Vec<(String, i64)>,
    /// How many audit checkpoints are signed.
    pub checkpoints: i64,
    /// The key id that signed the newest checkpoint.
    pub checkpoint_signer: Option<String>,
}

/// Connects to `database_url`, or the embedded SQLite database of `data_dir` (read-only,
/// never creating it), and reads what [`DatabaseProbe`] holds. Applies no migration.
pub async fn probe(
    database_url: Option<&str>,
    data_dir: &Path,
) -> Result<DatabaseProbe, StoreError> {
    install_default_drivers();
    let (url, backend) = match database_url {
        Some(url) if url.starts_with("postgres://") || url.starts_with("postgresql://") => {
            (url.to_owned(), Backend::Postgres)
        }
        Some(url) if url.starts_with("sqlite:") => (url.to_owned(), Backend::Sqlite),
        Some(url) => return Err(StoreError::UnsupportedUrl(crate::scrub_url(url))),
        None => {
            let file = data_dir.join(SQLITE_FILE);
            if !file.exists() {
                return Err(StoreError::NoDatabase {
                    path: file.display().to_string(),
                });
            }
            crate::refuse_an_open_data_dir(data_dir)?;
            (
                format!("sqlite://{}?mode=ro", file.display()),
                Backend::Sqlite,
            )
        }
    };
    let pool = AnyPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(5))
        .connect(&url)
        .await?;
    let applied: Result<(Option<i64>,), sqlx::Error> =
        sqlx::query_as("SELECT MAX(version) FROM _sqlx_migrations WHERE success")
            .fetch_one(&pool)
            .await;
    let applied = match applied {
        Ok((version,)) => version.unwrap_or(0),
        // No migration table: a database nothing was ever applied to.
        Err(sqlx::Error::Database(_)) => 0,
        Err(other) => return Err(other.into()),
    };
    let server_now_ms = match backend {
        Backend::Postgres => Some(
            sqlx::query_as::<_, (i64,)>(
                "SELECT CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS BIGINT)",
            )
            .fetch_one(&pool)
            .await?
            .0,
        ),
        Backend::Sqlite => None,
    };
    // The migration that made the vault and the audit tables: before it nothing is sealed or
    // signed.
    const KEYS_MIGRATION: i64 = 3;
    let keys = if applied >= KEYS_MIGRATION {
        Some(KeysInUse {
            sealed: crate::sealed_secret_key_ids(&pool).await?,
            checkpoints: crate::count_audit_checkpoints(&pool).await?,
            checkpoint_signer: crate::newest_checkpoint_key_id(&pool).await?,
        })
    } else {
        None
    };
    let audit_unguarded = if applied >= KEYS_MIGRATION {
        Some(audit_unguarded(&pool, backend).await?)
    } else {
        None
    };
    pool.close().await;
    Ok(DatabaseProbe {
        backend,
        applied_migration: applied,
        latest_migration: crate::migrations::latest_version(),
        server_now_ms,
        keys,
        audit_unguarded,
    })
}

/// What keeps the audit tables append-only and is missing or altered, named
/// ([`DatabaseProbe::audit_unguarded`]).
async fn audit_unguarded(
    pool: &sqlx::AnyPool,
    backend: Backend,
) -> Result<Vec<String>, StoreError> {
    Ok(match backend {
        Backend::Sqlite => {
            let found: Vec<(String, Option<String>)> =
                sqlx::query_as("SELECT name, sql FROM sqlite_master WHERE type = 'trigger'")
                    .fetch_all(pool)
                    .await?;
            let found = found
                .into_iter()
                .map(|(name, sql)| (name, sql.unwrap_or_default()))
                .collect();
            crate::migrations::altered_sqlite_audit_triggers(&found)
        }
        Backend::Postgres => {
            let enabled: Vec<(String,)> = sqlx::query_as(
                "SELECT t.tgname::text FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid \
                 WHERE c.relname IN ('audit_entries', 'audit_checkpoints') \
                 AND c.relnamespace = (SELECT oid FROM pg_namespace WHERE nspname = current_schema()) \
                 AND NOT t.tgisinternal AND t.tgenabled <> 'D'",
            )
            .fetch_all(pool)
            .await?;
            let enabled: Vec<String> = enabled.into_iter().map(|(name,)| name).collect();
            crate::migrations::missing_postgres_audit_triggers(&enabled)
        }
    })
}
