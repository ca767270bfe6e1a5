//! The schema, as an ordered list of migrations run on either backend.

use std::borrow::Cow;

use sqlx::migrate::{Migration, MigrationType, Migrator};
use sqlx::{AssertSqlSafe, SqlSafeStr};

use crate::{Backend, Store, StoreError};

/// One step of the schema, with one SQL text per backend (most share theirs). A text may use
/// `@BYTES@` for the binary column type: `BLOB` on SQLite, `BYTEA` on PostgreSQL.
struct SchemaMigration {
    version: i64,
    description: &'static str,
    sqlite: &'static str,
    postgres: &'static str,
}

const FOUNDATION: &str = include_str!("../migrations/0001_foundation.sql");
const SECRETS: &str = include_str!("../migrations/0002_secrets.sql");
const ROUTINES: &str = include_str!("../migrations/0004_routines.sql");
const RUNS: &str = include_str!("../migrations/0005_runs.sql");
const TOOL_CONNECTIONS: &str = include_str!("../migrations/0006_tool_connections.sql");
const APPROVALS: &str = include_str!("../migrations/0007_approvals.sql");
const TRIGGERS: &str = include_str!("../migrations/0008_triggers.sql");
const MEMORY: &str = include_str!("../migrations/0009_memory.sql");
const STDIO_CONNECTIONS: &str = include_str!("../migrations/0010_stdio_connections.sql");
const HTTP_TOOLS: &str = include_str!("../migrations/0011_http_tools.sql");
const PARKED_TIME: &str = include_str!("../migrations/0012_parked_time.sql");
const NESTED_RUNS: &str = include_str!("../migrations/0013_nested_runs.sql");
const RUN_TOKENS: &str = include_str!("../migrations/0014_run_tokens.sql");

/// The triggers that make the audit tables append-only, per backend; a restore checks that
/// a backup holds SQLite's as they are here, and the test support plays an attacker who drops
/// them.
pub(crate) const AUDIT_TRIGGERS_SQLITE: &str =
    include_str!("../migrations/0003_audit_triggers.sqlite.sql");
pub(crate) const AUDIT_TRIGGERS_POSTGRES: &str =
    include_str!("../migrations/0003_audit_triggers.postgres.sql");

/// The names of the triggers `sql` (one of the texts above) makes, with each statement.
fn audit_trigger_statements(sql: &str) -> impl Iterator<Item = (&str, String)> {
    sql.split("CREATE TRIGGER")
        .filter(|statement| !statement.trim().is_empty())
        .map(|statement| {
            let name = statement.split_whitespace().next().unwrap_or_default();
            (name, words(&format!("CREATE TRIGGER{statement}")))
        })
}

/// `sql` as its words, one space apart, without a closing `;`: how SQLite stores a statement,
/// whatever its lines.
fn words(sql: &str) -> String {
    sql.trim()
        .trim_end_matches(';')
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

/// What is wrong with an SQLite database's audit triggers, given `found`, each trigger's name
/// and stored SQL: each missing one, or one whose SQL is not the migration's, named. Empty
/// when the audit log is append-only as the migrations made it.
pub(crate) fn altered_sqlite_audit_triggers(
    found: &std::collections::HashMap<String, String>,
) -> Vec<String> {
    audit_trigger_statements(AUDIT_TRIGGERS_SQLITE)
        .filter_map(|(name, expected)| match found.get(name) {
            Some(sql) if words(sql) == expected => None,
            Some(_) => Some(format!("`{name}` rewritten")),
            None => Some(format!("`{name}` missing")),
        })
        .collect()
}

/// What is wrong with a PostgreSQL database's audit triggers, given the names of those enabled
/// on it: each missing or disabled one, named.
pub(crate) fn missing_postgres_audit_triggers(enabled: &[String]) -> Vec<String> {
    audit_trigger_statements(AUDIT_TRIGGERS_POSTGRES)
        .filter(|(name, _)| !enabled.iter().any(|found| found == name))
        .map(|(name, _)| format!("`{name}` missing or disabled"))
        .collect()
}

const MIGRATIONS: &[SchemaMigration] = &[
    SchemaMigration {
        version: 1,
        description: "foundation",
        sqlite: FOUNDATION,
        postgres: FOUNDATION,
    },
    SchemaMigration {
        version: 2,
        description: "secrets",
        sqlite: SECRETS,
        postgres: SECRETS,
    },
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
    SchemaMigration {
        version: 4,
        description: "routines",
        sqlite: ROUTINES,
        postgres: ROUTINES,
    },
    SchemaMigration {
        version: 5,
        description: "runs",
        sqlite: RUNS,
        postgres: RUNS,
    },
    SchemaMigration {
        version: 6,
        description: "tool connections",
        sqlite: TOOL_CONNECTIONS,
        postgres: TOOL_CONNECTIONS,
    },
    SchemaMigration {
        version: 7,
        description: "approvals",
        sqlite: APPROVALS,
        postgres: APPROVALS,
    },
    SchemaMigration {
        version: 8,
        description: "triggers",
        sqlite: TRIGGERS,
        postgres: TRIGGERS,
    },
    SchemaMigration {
        version: 9,
        description: "memory",
        sqlite: MEMORY,
        postgres: MEMORY,
    },
    SchemaMigration {
        version: 10,
        description: "stdio connections",
        sqlite: STDIO_CONNECTIONS,
        postgres: STDIO_CONNECTIONS,
    },
    SchemaMigration {
        version: 11,
        description: "http tools",
        sqlite: HTTP_TOOLS,
        postgres: HTTP_TOOLS,
    },
    SchemaMigration {
        version: 12,
        description: "parked time",
        sqlite: PARKED_TIME,
        postgres: PARKED_TIME,
    },
    SchemaMigration {
        version: 13,
        description: "nested runs",
        sqlite: NESTED_RUNS,
        postgres: NESTED_RUNS,
    },
    SchemaMigration {
        version: 14,
        description: "run tokens",
        sqlite: RUN_TOKENS,
        postgres: RUN_TOKENS,
    },
    SchemaMigration {
        version: 15,
        description: "wasm tools",
        sqlite: include_str!("../migrations/0015_wasm_tools.sqlite.sql"),
        postgres: include_str!("../migrations/0015_wasm_tools.postgres.sql"),
    },
    SchemaMigration {
        version: 16,
        description: "repeat approvals",
        sqlite: include_str!("../migrations/0016_repeat_approvals.sqlite.sql"),
        postgres: include_str!("../migrations/0016_repeat_approvals.postgres.sql"),
    },
    SchemaMigration {
        version: 17,
        description: "console",
        sqlite: include_str!("../migrations/0017_console.sql"),
        postgres: include_str!("../migrations/0017_console.sql"),
    },
    SchemaMigration {
        version: 19,
        description: "console sessions",
        sqlite: include_str!("../migrations/0019_console_sessions.sql"),
        postgres: include_str!("../migrations/0019_console_sessions.sql"),
    },
    SchemaMigration {
        version: 20,
        description: "notifications",
        sqlite: include_str!("../migrations/0020_notifications.sql"),
        postgres: include_str!("../migrations/0020_notifications.sql"),
    },
    SchemaMigration {
        version: 21,
        description: "model providers",
        sqlite: include_str!("../migrations/0021_model_providers.sqlite.sql"),
        postgres: include_str!("../migrations/0021_model_providers.postgres.sql"),
    },
    SchemaMigration {
        version: 22,
        description: "run engine",
        sqlite: include_str!("../migrations/0022_run_engine.sqlite.sql"),
        postgres: include_str!("../migrations/0022_run_engine.postgres.sql"),
    },
    SchemaMigration {
        version: 24,
        description: "approval edits",
        sqlite: include_str!("../migrations/0024_approval_edits.sql"),
        postgres: include_str!("../migrations/0024_approval_edits.sql"),
    },
    SchemaMigration {
        version: 25,
        description: "oauth connections",
        sqlite: include_str!("../migrations/0025_oauth_connections.sql"),
        postgres: include_str!("../migrations/0025_oauth_connections.sql"),
    },
    SchemaMigration {
        version: 29,
        description: "sign-in links and runs started by members",
        sqlite: include_str!("../migrations/0029_console_members.sql"),
        postgres: include_str!("../migrations/0029_console_members.sql"),
    },
    SchemaMigration {
        version: 32,
        description: "workers and enrolment tokens",
        sqlite: include_str!("../migrations/0032_workers.sql"),
        postgres: include_str!("../migrations/0032_workers.sql"),
    },
    SchemaMigration {
        version: 34,
        description: "oauth refresh claims",
        sqlite: include_str!("../migrations/0034_oauth_refresh_claims.sql"),
        postgres: include_str!("../migrations/0034_oauth_refresh_claims.sql"),
    },
    SchemaMigration {
        version: 35,
        description: "oauth authorizations started in the console",
        sqlite: include_str!("../migrations/0035_console_oauth.sqlite.sql"),
        postgres: include_str!("../migrations/0035_console_oauth.postgres.sql"),
    },
    SchemaMigration {
        version: 37,
        description: "scheduled runs recorded ahead of their slot",
        sqlite: include_str!("../migrations/0037_run_not_before.sql"),
        postgres: include_str!("../migrations/0037_run_not_before.sql"),
    },
    SchemaMigration {
        version: 38,
        description: "oauth scopes",
        sqlite: include_str!("../migrations/0038_oauth_scopes.sql"),
        postgres: include_str!("../migrations/0038_oauth_scopes.sql"),
    },
    SchemaMigration {
        version: 39,
        description: "audit events staged with the change they record",
        sqlite: include_str!("../migrations/0039_audit_staged.sql"),
        postgres: include_str!("../migrations/0039_audit_staged.sql"),
    },
    SchemaMigration {
        version: 40,
        description: "announcements of a run's park or end, until queued",
        sqlite: include_str!("../migrations/0040_run_announcements.sql"),
        postgres: include_str!("../migrations/0040_run_announcements.sql"),
    },
];

/// The newest migration of this release.
pub(crate) fn latest_version() -> i64 {
    MIGRATIONS.iter().map(|m| m.version).max().unwrap_or(0)
}

pub(crate) async fn apply(store: &Store) -> Result<(), StoreError> {
    let migrations = MIGRATIONS
        .iter()
        .map(|m| {
            let (sql, bytes) = match store.backend {
                Backend::Sqlite => (m.sqlite, "BLOB"),
                Backend::Postgres => (m.postgres, "BYTEA"),
            };
            Migration::new(
                m.version,
                Cow::Borrowed(m.description),
                MigrationType::Simple,
                AssertSqlSafe(sql.replace("@BYTES@", bytes)).into_sql_str(),
                false,
            )
        })
        .collect();
    Migrator::with_migrations(migrations)
        .run(&store.pool)
        .await
        .map_err(|error| match error {
            sqlx::migrate::MigrateError::VersionMissing(version) => {
                StoreError::NewerSchema(version)
            }
            other => other.into(),
        })?;
    Ok(())
}
