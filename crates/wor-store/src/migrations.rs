//! The schema, as an ordered list of migrations run on either backend.

use std::borrow::Cow;

use sqlx::migrate::{Migration, MigrationType, Migrator};
use sqlx::{AssertSqlSafe, SqlSafeStr};

use crate::{Backend, Store, StoreError};

/// One step of the schema. Its SQL may use `@BYTES@` for the binary column type, which
/// is `BLOB` on SQLite and `BYTEA` on PostgreSQL; anything else that differs gets a
/// backend-specific text.
struct SchemaMigration {
    version: i64,
    description: &'static str,
    sql: &'static str,
}

const MIGRATIONS: &[SchemaMigration] = &[
    SchemaMigration {
        version: 1,
        description: "foundation",
        sql: include_str!("../migrations/0001_foundation.sql"),
    },
    SchemaMigration {
        version: 2,
        description: "secrets",
        sql: include_str!("../migrations/0002_secrets.sql"),
    },
    SchemaMigration {
        version: 3,
        description: "routines",
        sql: include_str!("../migrations/0003_routines.sql"),
    },
    SchemaMigration {
        version: 4,
        description: "runs",
        sql: include_str!("../migrations/0004_runs.sql"),
    },
];

pub(crate) async fn apply(store: &Store) -> Result<(), StoreError> {
    let migrations = MIGRATIONS
        .iter()
        .map(|m| {
            let bytes = match store.backend {
                Backend::Sqlite => "BLOB",
                Backend::Postgres => "BYTEA",
            };
            Migration::new(
                m.version,
                Cow::Borrowed(m.description),
                MigrationType::Simple,
                AssertSqlSafe(m.sql.replace("@BYTES@", bytes)).into_sql_str(),
                false,
            )
        })
        .collect();
    Migrator::with_migrations(migrations)
        .run(&store.pool)
        .await?;
    Ok(())
}
