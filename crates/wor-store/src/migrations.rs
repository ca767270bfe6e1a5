//! The schema, as an ordered list of migrations with one SQL text per backend.

use std::borrow::Cow;

use sqlx::SqlSafeStr;
use sqlx::migrate::{Migration, MigrationType, Migrator};

use crate::{Backend, Store, StoreError};

struct SchemaMigration {
    version: i64,
    description: &'static str,
    sqlite: &'static str,
    postgres: &'static str,
}

const FOUNDATION: &str = include_str!("../migrations/0001_foundation.sql");

const MIGRATIONS: &[SchemaMigration] = &[SchemaMigration {
    version: 1,
    description: "foundation",
    sqlite: FOUNDATION,
    postgres: FOUNDATION,
}];

pub(crate) async fn apply(store: &Store) -> Result<(), StoreError> {
    let migrations = MIGRATIONS
        .iter()
        .map(|m| {
            let sql = match store.backend {
                Backend::Sqlite => m.sqlite,
                Backend::Postgres => m.postgres,
            };
            Migration::new(
                m.version,
                Cow::Borrowed(m.description),
                MigrationType::Simple,
                sql.into_sql_str(),
                false,
            )
        })
        .collect();
    Migrator::with_migrations(migrations)
        .run(&store.pool)
        .await?;
    Ok(())
}
