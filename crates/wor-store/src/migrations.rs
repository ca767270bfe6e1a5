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

/// The triggers that make the audit tables append-only, per backend; also used by the test
/// support that plays an attacker who drops them.
#[cfg(feature = "testing")]
pub(crate) const AUDIT_TRIGGERS_SQLITE: &str =
    include_str!("../migrations/0003_audit_triggers.sqlite.sql");
#[cfg(feature = "testing")]
pub(crate) const AUDIT_TRIGGERS_POSTGRES: &str =
    include_str!("../migrations/0003_audit_triggers.postgres.sql");

const MIGRATIONS: &[SchemaMigration] = &[
    SchemaMigration {
        version: 1,
        description: "foundation",
        sqlite: FOUNDATION,
        postgres: FOUNDATION,
    },
    // Version 2 is taken by the secrets branch's migration, developed in parallel.
    SchemaMigration {
        version: 3,
        description: "audit",
        sqlite: concat!(
            include_str!("../migrations/0003_audit.sql"),
            include_str!("../migrations/0003_audit_triggers.sqlite.sql")
        ),
        postgres: concat!(
            include_str!("../migrations/0003_audit.sql"),
            include_str!("../migrations/0003_audit_function.postgres.sql"),
            include_str!("../migrations/0003_audit_triggers.postgres.sql")
        ),
    },
];

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
