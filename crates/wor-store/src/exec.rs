//! The statements of the audit writer's transactions, on either of its two kinds of
//! connection: sqlx's, on any backend, or the embedded database's own writer connection
//! ([`EmbeddedWriter`]), which the writer drives synchronously on its thread so that a
//! statement costs no hand-off to another thread and back.
//!
//! The writer's statements (a run's journal write, the audit chain's head and entries,
//! checkpoints) are written once, against [`Exec`], and run on both.

use sqlx::{Any, Row as _};

use crate::{Durability, StoreError};

/// How the embedded writer's `BEGIN IMMEDIATE` waits for the database's write lock that
/// another process on the same file holds (the process's own writes all wait for its turn
/// to write first). Its connection has no `busy_timeout`, so `BEGIN` fails at once; it is
/// tried again after a pause that is awaited, growing from [`FIRST_LOCK_PAUSE`] to
/// [`LONGEST_LOCK_PAUSE`].
///
/// Awaited, the wait blocks no thread: a caller's write is committed on a thread of the
/// process's runtime ([`crate::AuditLog`]), which SQLite's own wait would hold for as long
/// as the lock is held elsewhere. And the lock is asked for often: SQLite's own wait asks
/// every 100 ms after its first few tries, so another process that commits back to back
/// could keep it from the lock. It gives up, with the busy error, after as long as a
/// transaction on the pool waits ([`LOCK_WAIT_LIMIT`]).
struct LockWait {
    began: std::time::Instant,
    pause: std::time::Duration,
    /// Whether a long wait has been logged.
    told: bool,
}

/// The first pause of a [`LockWait`]; each next one is twice as long, up to
/// [`LONGEST_LOCK_PAUSE`].
const FIRST_LOCK_PAUSE: std::time::Duration = std::time::Duration::from_millis(1);
const LONGEST_LOCK_PAUSE: std::time::Duration = std::time::Duration::from_millis(8);
/// How long a [`LockWait`] lasts in all: what a transaction on the pool waits,
/// `busy_timeout` for each of its tries of `BEGIN`.
const LOCK_WAIT_LIMIT: std::time::Duration =
    crate::BUSY_TIMEOUT.saturating_mul(crate::WRITE_BEGIN_ATTEMPTS);
/// A wait longer than this is logged, once.
const LONG_LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

impl LockWait {
    fn new() -> Self {
        LockWait {
            began: std::time::Instant::now(),
            pause: FIRST_LOCK_PAUSE,
            told: false,
        }
    }

    /// After `BEGIN` failed with `err`: waits and returns when it is to be tried again (the
    /// database busy, time left), or returns the error.
    async fn after(&mut self, err: StoreError) -> Result<(), StoreError> {
        let waited = self.began.elapsed();
        if !crate::is_busy(&err) || waited >= LOCK_WAIT_LIMIT {
            return Err(err);
        }
        if waited >= LONG_LOCK_WAIT && !std::mem::replace(&mut self.told, true) {
            tracing::warn!(
                category = "store",
                waited_ms = u64::try_from(waited.as_millis()).unwrap_or(u64::MAX),
                "the database's write lock is held by another connection; the write waits for it"
            );
        }
        tokio::time::sleep(self.pause).await;
        self.pause = self.pause.saturating_mul(2).min(LONGEST_LOCK_PAUSE);
        Ok(())
    }
}

/// A value bound to a statement's placeholder (`$1`, `$2`, … in order).
#[derive(Debug, Clone)]
pub(crate) enum Param {
    Int(i64),
    Text(String),
    Null,
}

impl From<i64> for Param {
    fn from(value: i64) -> Self {
        Param::Int(value)
    }
}

impl From<String> for Param {
    fn from(value: String) -> Self {
        Param::Text(value)
    }
}

impl From<&str> for Param {
    fn from(value: &str) -> Self {
        Param::Text(value.to_owned())
    }
}

impl From<Option<String>> for Param {
    fn from(value: Option<String>) -> Self {
        value.map_or(Param::Null, Param::Text)
    }
}

/// A row a statement returned, read by column name.
pub(crate) enum Row {
    Any(sqlx::any::AnyRow),
    Embedded(Vec<(String, Param)>),
}

impl Row {
    fn embedded(&self, column: &str) -> Result<&Param, StoreError> {
        match self {
            Row::Embedded(values) => values
                .iter()
                .find(|(name, _)| name == column)
                .map(|(_, value)| value)
                .ok_or_else(|| StoreError::Corrupt(format!("no column `{column}` in a row"))),
            Row::Any(_) => Err(StoreError::Corrupt("a row read the wrong way".to_owned())),
        }
    }

    pub(crate) fn int(&self, column: &str) -> Result<i64, StoreError> {
        self.opt_int(column)?
            .ok_or_else(|| StoreError::Corrupt(format!("column `{column}` is null")))
    }

    pub(crate) fn opt_int(&self, column: &str) -> Result<Option<i64>, StoreError> {
        match self {
            Row::Any(row) => Ok(row.try_get(column)?),
            Row::Embedded(_) => match self.embedded(column)? {
                Param::Int(value) => Ok(Some(*value)),
                Param::Null => Ok(None),
                Param::Text(_) => Err(StoreError::Corrupt(format!(
                    "column `{column}` holds text where a number belongs"
                ))),
            },
        }
    }

    pub(crate) fn text(&self, column: &str) -> Result<String, StoreError> {
        self.opt_text(column)?
            .ok_or_else(|| StoreError::Corrupt(format!("column `{column}` is null")))
    }

    pub(crate) fn opt_text(&self, column: &str) -> Result<Option<String>, StoreError> {
        match self {
            Row::Any(row) => Ok(row.try_get(column)?),
            Row::Embedded(_) => match self.embedded(column)? {
                Param::Text(value) => Ok(Some(value.clone())),
                Param::Null => Ok(None),
                Param::Int(_) => Err(StoreError::Corrupt(format!(
                    "column `{column}` holds a number where text belongs"
                ))),
            },
        }
    }
}

/// Where the writer's statements run.
pub(crate) trait Exec: Send {
    /// Runs `sql`, returning how many rows it changed.
    async fn execute(&mut self, sql: &str, params: Vec<Param>) -> Result<u64, StoreError>;

    /// Runs `sql`, returning every row.
    async fn fetch_all(&mut self, sql: &str, params: Vec<Param>) -> Result<Vec<Row>, StoreError>;

    /// Runs `sql`, returning its first row, if any.
    async fn fetch_optional(
        &mut self,
        sql: &str,
        params: Vec<Param>,
    ) -> Result<Option<Row>, StoreError> {
        Ok(self.fetch_all(sql, params).await?.into_iter().next())
    }
}

fn any_query(
    sql: &str,
    params: Vec<Param>,
) -> sqlx::query::Query<'static, Any, sqlx::any::AnyArguments> {
    let mut query = sqlx::query(sqlx::AssertSqlSafe(sql.to_owned()));
    for param in params {
        query = match param {
            Param::Int(value) => query.bind(value),
            Param::Text(value) => query.bind(value),
            Param::Null => query.bind(None::<String>),
        };
    }
    query
}

impl Exec for sqlx::AnyConnection {
    async fn execute(&mut self, sql: &str, params: Vec<Param>) -> Result<u64, StoreError> {
        Ok(any_query(sql, params)
            .execute(&mut *self)
            .await?
            .rows_affected())
    }

    async fn fetch_all(&mut self, sql: &str, params: Vec<Param>) -> Result<Vec<Row>, StoreError> {
        Ok(any_query(sql, params)
            .fetch_all(&mut *self)
            .await?
            .into_iter()
            .map(Row::Any)
            .collect())
    }

    async fn fetch_optional(
        &mut self,
        sql: &str,
        params: Vec<Param>,
    ) -> Result<Option<Row>, StoreError> {
        Ok(any_query(sql, params)
            .fetch_optional(&mut *self)
            .await?
            .map(Row::Any))
    }
}

impl Exec for sqlx::Transaction<'_, Any> {
    async fn execute(&mut self, sql: &str, params: Vec<Param>) -> Result<u64, StoreError> {
        (**self).execute(sql, params).await
    }

    async fn fetch_all(&mut self, sql: &str, params: Vec<Param>) -> Result<Vec<Row>, StoreError> {
        (**self).fetch_all(sql, params).await
    }

    async fn fetch_optional(
        &mut self,
        sql: &str,
        params: Vec<Param>,
    ) -> Result<Option<Row>, StoreError> {
        (**self).fetch_optional(sql, params).await
    }
}

/// The audit writer's own connection to the embedded database, driven synchronously on the
/// writer's thread (see [`crate::AuditLog`]): every statement of a batch runs without leaving
/// that thread. Opened on the database file the store uses, with the store's settings
/// (`busy_timeout`, foreign keys, WAL).
pub(crate) struct EmbeddedWriter {
    path: std::path::PathBuf,
    connection: rusqlite::Connection,
    /// What `synchronous` is set to on the connection.
    synchronous: Option<Durability>,
    /// Whether the checkpointer copies the log, so that no commit here does.
    checkpoints_elsewhere: bool,
}

impl EmbeddedWriter {
    pub(crate) fn open(path: &std::path::Path) -> Result<EmbeddedWriter, StoreError> {
        let connection = rusqlite::Connection::open_with_flags(
            path,
            rusqlite::OpenFlags::SQLITE_OPEN_READ_WRITE | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )?;
        connection.execute_batch(crate::SQLITE_CONNECTION_SETTINGS)?;
        // Never waits inside SQLite for a lock: `BEGIN` waits for the write lock by trying
        // again ([`LockWait`]), without blocking its thread.
        connection.busy_timeout(std::time::Duration::ZERO)?;
        // A batch's statements differ with the number of its steps and entries.
        connection.set_prepared_statement_cache_capacity(128);
        let mode: String = connection.query_row("PRAGMA journal_mode", [], |row| row.get(0))?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(StoreError::Corrupt(format!(
                "the database is in journal mode `{mode}`, not WAL"
            )));
        }
        Ok(EmbeddedWriter {
            path: path.to_owned(),
            connection,
            synchronous: None,
            checkpoints_elsewhere: false,
        })
    }

    /// Leaves copying the write-ahead log into the database file to the checkpointer
    /// ([`crate::wal::WalCheckpointer`]): no commit on this connection does it.
    pub(crate) fn leave_checkpoints_to_checkpointer(&mut self) -> Result<(), StoreError> {
        self.connection
            .execute_batch("PRAGMA wal_autocheckpoint = 0")?;
        self.checkpoints_elsewhere = true;
        Ok(())
    }

    /// Checkpoints the log as it commits again, as SQLite does by default: the checkpointer
    /// has stopped.
    pub(crate) fn checkpoint_as_it_commits(&mut self) -> Result<(), StoreError> {
        self.checkpoints_elsewhere = false;
        self.connection
            .execute_batch("PRAGMA wal_autocheckpoint = 1000")?;
        Ok(())
    }

    /// Copies all of the log into the database file and has the next write reuse it from its
    /// start ([`crate::wal::restart_log`]), between two transactions.
    pub(crate) fn restart_log(&mut self) -> Result<bool, StoreError> {
        self.roll_back();
        Ok(crate::wal::restart_log(&self.connection)?)
    }

    /// Runs `body` in one transaction that takes the database's write lock up front
    /// (`BEGIN IMMEDIATE`, waiting for it as [`LockWait`] says), and commits it with
    /// `durability`; rolls it back when `body` fails.
    pub(crate) async fn transaction<T>(
        &mut self,
        durability: Durability,
        body: impl AsyncFnOnce(&mut EmbeddedWriter) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        // A transaction a failed rollback left open is ended first (or the connection
        // replaced), so it cannot keep the database's write lock.
        self.roll_back();
        if self.synchronous != Some(durability) {
            // SQLite reads `synchronous` when a transaction begins, so it is set before.
            self.synchronous = None;
            self.connection.execute_batch(durability.sqlite_pragma())?;
            self.synchronous = Some(durability);
        }
        let mut wait = LockWait::new();
        loop {
            match self.connection.execute_batch("BEGIN IMMEDIATE") {
                Ok(()) => break,
                Err(err) => wait.after(err.into()).await?,
            }
        }
        match body(self).await {
            Ok(value) => match self.connection.execute_batch("COMMIT") {
                Ok(()) => Ok(value),
                Err(err) => {
                    self.roll_back();
                    Err(err.into())
                }
            },
            Err(err) => {
                self.roll_back();
                Err(err)
            }
        }
    }

    fn roll_back(&mut self) {
        if self.connection.is_autocommit() {
            return;
        }
        if self.connection.execute_batch("ROLLBACK").is_err() {
            // Closing a connection rolls back what it left open; the next batch runs on a
            // fresh one (or fails to begin, with its error, while none opens).
            if let Ok(mut fresh) = EmbeddedWriter::open(&self.path)
                && (!self.checkpoints_elsewhere
                    || fresh.leave_checkpoints_to_checkpointer().is_ok())
            {
                *self = fresh;
            }
        }
    }

    /// A statement of `sql` with `params` bound to its `$N` placeholders.
    ///
    /// SQLite numbers named placeholders such as `$3` in the order they first appear, and
    /// finds one by its name only by walking the statement's list of names. The text is
    /// therefore prepared with each `$N` written `?N`, which SQLite binds at index `N`, and
    /// each value is bound by its position: no name is looked up.
    fn prepare(
        &self,
        sql: &str,
        params: Vec<Param>,
    ) -> Result<rusqlite::CachedStatement<'_>, StoreError> {
        let numbered = numbered_placeholders(sql)?;
        // Every value is bound to its own placeholder, as sqlx insists: a statement and its
        // values that disagree are an error here too, not a silent NULL.
        if numbered.count != params.len() {
            return Err(StoreError::Corrupt(format!(
                "a statement with {} placeholders was given {} values",
                numbered.count,
                params.len()
            )));
        }
        let mut statement = self.connection.prepare_cached(&numbered.text)?;
        if statement.parameter_count() != params.len() {
            return Err(StoreError::Corrupt(format!(
                "a statement with {} placeholders was given {} values",
                statement.parameter_count(),
                params.len()
            )));
        }
        for (index, param) in params.into_iter().enumerate() {
            let at = index + 1;
            match param {
                Param::Int(value) => statement.raw_bind_parameter(at, value)?,
                Param::Text(value) => statement.raw_bind_parameter(at, value)?,
                Param::Null => statement.raw_bind_parameter(at, rusqlite::types::Null)?,
            }
        }
        Ok(statement)
    }
}

/// A statement's text with its `$N` placeholders written `?N`, and how many there are.
struct Numbered {
    text: String,
    count: usize,
}

/// Rewrites each `$N` of `sql` outside its string literals (`'…'`) and quoted names (`"…"`)
/// as `?N`, and checks that the placeholders are exactly `$1` to `$count`, each used at least
/// once: a number skipped, written with a leading zero or past SQLite's bound, run into a
/// name (`$1abc`, or any character beyond ASCII, which SQLite reads as part of a name), or a
/// placeholder of another kind, is refused. So is a comment or a name
/// quoted with backticks or brackets, whose contents the rewrite does not read as SQLite does.
fn numbered_placeholders(sql: &str) -> Result<Numbered, StoreError> {
    /// The most placeholders a statement may have (SQLite's default bound).
    const MOST: usize = 32_766;
    let refuse = |what: String| Err(StoreError::Corrupt(format!("a statement has {what}")));
    let mut text = String::with_capacity(sql.len());
    let mut used: Vec<bool> = Vec::new();
    let mut quote: Option<u8> = None;
    // The text up to `copied` is in `text` already. Every byte the scan acts on is ASCII, so
    // it reads bytes: a byte of a character beyond ASCII is never one of them.
    let mut copied = 0;
    let bytes = sql.as_bytes();
    let mut at = 0;
    while let Some(&c) = bytes.get(at) {
        let next = bytes.get(at + 1).copied();
        if let Some(open) = quote {
            // A quote doubled inside a literal closes it and opens it again: the same state.
            if c == open {
                quote = None;
            }
            at += 1;
            continue;
        }
        match c {
            b'\'' | b'"' => quote = Some(c),
            b'$' => {
                let digits = bytes
                    .get(at + 1..)
                    .unwrap_or_default()
                    .iter()
                    .take_while(|d| d.is_ascii_digit())
                    .count();
                let end = at + 1 + digits;
                // `$1abc` is one name to SQLite, where `?1abc` would be `?1` named `abc`; a
                // character beyond ASCII is part of a name to SQLite too.
                if bytes.get(end).is_some_and(|next| {
                    next.is_ascii_alphanumeric() || !next.is_ascii() || b"_$:(".contains(next)
                }) {
                    return refuse(format!("a placeholder run into a name at byte {at}"));
                }
                let number = sql.get(at + 1..end).unwrap_or_default();
                let Some(n) = number
                    .parse::<usize>()
                    .ok()
                    .filter(|n| (1..=MOST).contains(n) && !number.starts_with('0'))
                else {
                    return refuse(format!(
                        "a placeholder `${number}` that is not $1 to ${MOST}"
                    ));
                };
                if used.len() < n {
                    used.resize(n, false);
                }
                if let Some(slot) = used.get_mut(n - 1) {
                    *slot = true;
                }
                text.push_str(sql.get(copied..at).unwrap_or_default());
                text.push('?');
                text.push_str(number);
                copied = end;
                at = end;
                continue;
            }
            b'?' | b':' | b'@' => {
                return refuse(format!("a placeholder that is not `$N` at byte {at}"));
            }
            // What these open (comments, names quoted SQLite's other ways) is not scanned for
            // its quotes: a statement that has one is refused rather than misread.
            b'`' | b'[' => return refuse(format!("a quoted name not in `\"` at byte {at}")),
            b'-' | b'/' if (c, next) == (b'-', Some(b'-')) || (c, next) == (b'/', Some(b'*')) => {
                return refuse(format!("a comment at byte {at}"));
            }
            _ => {}
        }
        at += 1;
    }
    text.push_str(sql.get(copied..).unwrap_or_default());
    if let Some(open) = quote {
        return refuse(format!("an unclosed `{}`", char::from(open)));
    }
    if let Some(skipped) = used.iter().position(|used| !used) {
        return refuse(format!("no placeholder ${}", skipped + 1));
    }
    Ok(Numbered {
        text,
        count: used.len(),
    })
}

impl Exec for EmbeddedWriter {
    async fn execute(&mut self, sql: &str, params: Vec<Param>) -> Result<u64, StoreError> {
        let mut statement = self.prepare(sql, params)?;
        let changed = statement.raw_execute()?;
        Ok(u64::try_from(changed).unwrap_or(u64::MAX))
    }

    async fn fetch_all(&mut self, sql: &str, params: Vec<Param>) -> Result<Vec<Row>, StoreError> {
        let mut statement = self.prepare(sql, params)?;
        let names: Vec<String> = statement
            .column_names()
            .into_iter()
            .map(str::to_owned)
            .collect();
        let mut rows = statement.raw_query();
        let mut read = Vec::new();
        while let Some(row) = rows.next()? {
            let mut values = Vec::with_capacity(names.len());
            for (index, name) in names.iter().enumerate() {
                let value = match row.get_ref(index)? {
                    rusqlite::types::ValueRef::Null => Param::Null,
                    rusqlite::types::ValueRef::Integer(value) => Param::Int(value),
                    rusqlite::types::ValueRef::Text(text) => {
                        Param::Text(String::from_utf8(text.to_vec()).map_err(|_| {
                            StoreError::Corrupt(format!(
                                "column `{name}` holds text that is not UTF-8"
                            ))
                        })?)
                    }
                    rusqlite::types::ValueRef::Real(_) | rusqlite::types::ValueRef::Blob(_) => {
                        return Err(StoreError::Corrupt(format!(
                            "column `{name}` holds a value of a type the writer never stores"
                        )));
                    }
                };
                values.push((name.clone(), value));
            }
            read.push(Row::Embedded(values));
        }
        Ok(read)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A writer on a fresh database file in WAL mode, and the directory that holds it.
    fn writer() -> (tempfile::TempDir, EmbeddedWriter) {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let path = dir.path().join("wor.db");
        let setup = rusqlite::Connection::open(&path).expect("a new database");
        setup
            .query_row("PRAGMA journal_mode = WAL", [], |_| Ok(()))
            .expect("WAL mode");
        drop(setup);
        let writer = EmbeddedWriter::open(&path).expect("the writer's connection");
        (dir, writer)
    }

    #[tokio::test]
    async fn each_placeholder_takes_the_value_its_number_names() {
        let (_dir, mut writer) = writer();
        // `$2` appears first and `$1` twice: SQLite numbers them 1 and 2 in that order.
        let rows = writer
            .fetch_all(
                "SELECT $2 AS second, $1 AS first, $1 || $3 AS again",
                vec![Param::from("one"), Param::Int(2), Param::from("three")],
            )
            .await
            .expect("the statement runs");
        let [row] = rows.as_slice() else {
            panic!("one row, not {}", rows.len())
        };
        assert_eq!(row.int("second").expect("an integer"), 2);
        assert_eq!(row.text("first").expect("text"), "one");
        assert_eq!(row.text("again").expect("text"), "onethree");
    }

    #[tokio::test]
    async fn a_dollar_sign_in_a_string_literal_or_a_quoted_name_is_text() {
        let (_dir, mut writer) = writer();
        let rows = writer
            .fetch_all(
                r#"SELECT '$2 it''s ?3 é' AS "$1é", $1 AS b"#,
                vec![Param::from("one")],
            )
            .await
            .expect("the statement runs");
        let [row] = rows.as_slice() else {
            panic!("one row, not {}", rows.len())
        };
        assert_eq!(row.text("$1é").expect("text"), "$2 it's ?3 é");
        assert_eq!(row.text("b").expect("text"), "one");
    }

    #[tokio::test]
    async fn a_statement_and_its_values_that_disagree_are_refused() {
        let (_dir, mut writer) = writer();
        for (sql, values) in [
            ("SELECT $1 AS a", 2),
            ("SELECT $1 AS a, $2 AS b", 1),
            ("SELECT $1 AS a, $3 AS b", 2),
            ("SELECT $1 AS a, $01 AS b", 2),
            ("SELECT $1 AS a, :b AS b", 2),
            ("SELECT $0 AS a", 1),
            ("SELECT $1 AS a, ? AS b", 2),
            ("SELECT $1 AS a, ?2 AS b", 2),
            ("SELECT $1 AS a, @b AS b", 2),
            ("SELECT $ AS a", 1),
            ("SELECT $1 AS a, $32767 AS b", 2),
            ("SELECT 'a $1 AS a", 1),
            ("SELECT $1 AS a, ?1 AS b", 1),
            ("SELECT $1 AS a, $01 AS b", 1),
            ("SELECT $1abc", 1),
            ("SELECT $1—", 1),
            // Quotes inside these comments pair up so that `'$1'` would be read as outside a
            // literal: only the refusal of comments stops them.
            ("SELECT $1 -- don't\n, '$1' -- it's\n", 1),
            ("SELECT $1 /* don't */, '$1' /* it's */", 1),
            ("SELECT $1 AS [a$1]", 1),
            ("SELECT $1 AS `a$1`", 1),
        ] {
            let params = (0..values).map(Param::Int).collect();
            let refused = writer.fetch_all(sql, params).await;
            match refused {
                Err(StoreError::Corrupt(_)) => {}
                Err(other) => panic!("{sql} with {values} values: {other:?}"),
                Ok(rows) => panic!("{sql} with {values} values ran: {} rows", rows.len()),
            }
        }
    }
}
