//! Tool connections: MCP servers and HTTP APIs, their review status, the operator's
//! classification of each tool, and the pinned tool definitions.
//!
//! Credentials are not here: they live sealed in the vault under [`TOOL_CONNECTIONS_TABLE`],
//! one slot per header ([`header_field`]); this table keeps only the header names. Pins are
//! stored as JSON (`name -> {definition, hash}`); checking a pin against its definition is the
//! tool library's job when the pins are loaded.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use serde_json::Value;
use sqlx::Row;
use wor_core::audit::AuditEvent;
use wor_core::call::ToolClass;
use wor_core::{ApiKeyId, ConnectionId, ProjectId};

use crate::staged::StagedEvent;
use crate::{Store, StoreError, conflict_or, now_millis, parse_column};

/// The table secrets of tool connections are filed under in the vault.
pub const TOOL_CONNECTIONS_TABLE: &str = "tool_connections";

/// The vault field holding the value of credential header `name` (lower case).
pub fn header_field(name: &str) -> String {
    format!("header:{name}")
}

/// The vault field holding the value of a stdio server's environment variable `name`.
pub fn env_field(name: &str) -> String {
    format!("env:{name}")
}

/// How a `mcp_stdio` connection's server starts in the sandbox.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StdioSpec {
    /// An absolute path to the program.
    pub program: String,
    #[serde(default)]
    pub args: Vec<String>,
    /// Absolute host paths bound read-only at the same place inside the sandbox.
    #[serde(default)]
    pub read_only_paths: Vec<String>,
    /// Names of the environment variables it gets; their values are sealed in the vault.
    #[serde(default)]
    pub env_names: Vec<String>,
}

/// How a tool connection reaches its tools.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolConnectionKind {
    /// An MCP server over streamable HTTP.
    McpHttp,
    /// An MCP server started over stdio inside the sandbox.
    McpStdio,
    /// A plain HTTP API.
    HttpApi,
    /// A WebAssembly component (WASI preview 2) run in-process under fuel, deadline and
    /// memory limits; its `command.program` is the component file.
    Wasm,
}

impl ToolConnectionKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ToolConnectionKind::McpHttp => "mcp_http",
            ToolConnectionKind::McpStdio => "mcp_stdio",
            ToolConnectionKind::HttpApi => "http_api",
            ToolConnectionKind::Wasm => "wasm",
        }
    }

    /// Whether it runs on this machine from a `command` (a sandboxed process or a component)
    /// rather than at a URL.
    pub fn is_local(self) -> bool {
        matches!(
            self,
            ToolConnectionKind::McpStdio | ToolConnectionKind::Wasm
        )
    }
}

impl fmt::Display for ToolConnectionKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for ToolConnectionKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "mcp_http" => Ok(ToolConnectionKind::McpHttp),
            "mcp_stdio" => Ok(ToolConnectionKind::McpStdio),
            "http_api" => Ok(ToolConnectionKind::HttpApi),
            "wasm" => Ok(ToolConnectionKind::Wasm),
            other => Err(format!(
                "`{}` is not a tool connection kind: expected mcp_http, mcp_stdio, http_api or wasm",
                wor_core::quote::excerpt(other, 40)
            )),
        }
    }
}

/// Where a tool connection stands. Only `enabled` connections run tools.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolConnectionStatus {
    /// Created, its tools not reviewed yet.
    PendingReview,
    /// Reviewed and pinned.
    Enabled,
    /// Its live tool list changed from the pins; waits for a new review.
    Quarantined,
    /// Turned off by an admin.
    Disabled,
}

impl ToolConnectionStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            ToolConnectionStatus::PendingReview => "pending_review",
            ToolConnectionStatus::Enabled => "enabled",
            ToolConnectionStatus::Quarantined => "quarantined",
            ToolConnectionStatus::Disabled => "disabled",
        }
    }
}

impl fmt::Display for ToolConnectionStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for ToolConnectionStatus {
    type Err = ();
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "pending_review" => Ok(ToolConnectionStatus::PendingReview),
            "enabled" => Ok(ToolConnectionStatus::Enabled),
            "quarantined" => Ok(ToolConnectionStatus::Quarantined),
            "disabled" => Ok(ToolConnectionStatus::Disabled),
            _ => Err(()),
        }
    }
}

/// One pinned tool as stored: the pinned fields and their hash.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StoredPin {
    /// `{"name", "description", "inputSchema", "annotations"}`.
    pub definition: Value,
    /// Lower-case hex SHA-256 of the definition's canonical JSON.
    pub hash: String,
}

#[derive(Debug, Clone)]
pub struct NewToolConnection {
    pub name: String,
    pub kind: ToolConnectionKind,
    pub url: String,
    /// Host patterns this connection may reach.
    pub allowlist: Vec<String>,
    /// Lower-case names of the credential headers sealed in the vault.
    pub secret_headers: Vec<String>,
    /// How a `mcp_stdio` server starts; `None` for the other kinds.
    pub command: Option<StdioSpec>,
    /// The tools of an `http_api` connection, as configured (JSON objects); empty otherwise.
    pub http_tools: Vec<Value>,
    pub created_by: Option<ApiKeyId>,
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct ToolConnectionRecord {
    pub id: ConnectionId,
    pub project_id: ProjectId,
    pub name: String,
    pub kind: ToolConnectionKind,
    pub url: String,
    pub allowlist: Vec<String>,
    pub status: ToolConnectionStatus,
    pub tool_classification: BTreeMap<String, ToolClass>,
    pub pinned_tools: BTreeMap<String, StoredPin>,
    /// The tool list last seen, as stored pins (definition and hash); `None` before the first.
    pub live_tools: Option<BTreeMap<String, StoredPin>>,
    pub secret_headers: Vec<String>,
    pub command: Option<StdioSpec>,
    pub http_tools: Vec<Value>,
    pub created_by: Option<ApiKeyId>,
    pub created_at: i64,
    pub updated_at: i64,
}

impl ToolConnectionRecord {
    /// The operator's class of `tool`; consequential unless classified read-only.
    pub fn class_of(&self, tool: &str) -> ToolClass {
        self.tool_classification
            .get(tool)
            .copied()
            .unwrap_or_default()
    }
}

const COLUMNS: &str = "id, project_id, name, kind, url, allowlist, status, tool_classification, \
                       pinned_tools, live_tools, secret_headers, command, http_tools, created_by, created_at, updated_at";

fn to_json<T: serde::Serialize>(value: &T) -> Result<String, StoreError> {
    serde_json::to_string(value).map_err(|e| StoreError::Corrupt(format!("cannot encode: {e}")))
}

impl Store {
    /// Adds a connection, `pending_review`, with nothing pinned.
    pub async fn create_tool_connection(
        &self,
        project: ProjectId,
        new: NewToolConnection,
    ) -> Result<ToolConnectionRecord, StoreError> {
        let (record, _) = self
            .create_tool_connection_staged(project, ConnectionId::new(), new, &[], None)
            .await?;
        Ok(record)
    }

    /// [`Self::create_tool_connection`] under `id`, writing `credentials` (sealed for slots of
    /// this connection, [`crate::Vault::seal_put`]) and staging `recorded`, when given, from the
    /// new connection, all in one transaction (`crate::staged`): a crash leaves the connection
    /// with its credentials and its entry, or nothing. A credential sealed for another row is
    /// refused ([`StoreError::MisplacedSecret`]) and nothing is made.
    pub async fn create_tool_connection_staged(
        &self,
        project: ProjectId,
        id: ConnectionId,
        new: NewToolConnection,
        credentials: &[crate::SealedPut],
        recorded: Option<&(dyn Fn(&ToolConnectionRecord) -> AuditEvent + Sync)>,
    ) -> Result<(ToolConnectionRecord, Option<StagedEvent>), StoreError> {
        crate::vault::check_owners(credentials, project, crate::TOOL_CONNECTIONS_TABLE, id)?;
        let now = now_millis();
        let record = ToolConnectionRecord {
            id,
            project_id: project,
            name: new.name,
            kind: new.kind,
            url: new.url,
            allowlist: new.allowlist,
            status: ToolConnectionStatus::PendingReview,
            tool_classification: BTreeMap::new(),
            pinned_tools: BTreeMap::new(),
            live_tools: None,
            secret_headers: new.secret_headers,
            command: new.command,
            http_tools: new.http_tools,
            created_by: new.created_by,
            created_at: now,
            updated_at: now,
        };
        let mut tx = self.begin_write().await?;
        sqlx::query(
            "INSERT INTO tool_connections (id, project_id, name, kind, url, allowlist, status, \
             tool_classification, pinned_tools, live_tools, secret_headers, created_by, created_at, updated_at, command, http_tools) \
             VALUES ($1, $2, $3, $4, $5, $6, 'pending_review', '{}', '{}', NULL, $7, $8, $9, $9, $10, $11)",
        )
        .bind(record.id.to_string())
        .bind(project.to_string())
        .bind(&record.name)
        .bind(record.kind.as_str())
        .bind(&record.url)
        .bind(to_json(&record.allowlist)?)
        .bind(to_json(&record.secret_headers)?)
        .bind(record.created_by.map(|k| k.to_string()))
        .bind(now)
        .bind(record.command.as_ref().map(to_json).transpose()?)
        .bind((!record.http_tools.is_empty()).then(|| to_json(&record.http_tools)).transpose()?)
        .execute(&mut **tx)
        .await
        .map_err(|e| {
            conflict_or(e, || {
                format!("a tool connection named `{}` already exists", record.name)
            })
        })?;
        crate::vault::write_sealed(&mut tx, credentials, now).await?;
        let staged =
            crate::staged::stage_some(&mut tx, recorded.map(|recorded| recorded(&record))).await?;
        tx.commit().await?;
        Ok((record, staged))
    }

    pub async fn get_tool_connection(
        &self,
        project: ProjectId,
        id: ConnectionId,
    ) -> Result<ToolConnectionRecord, StoreError> {
        let row = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM tool_connections WHERE project_id = $1 AND id = $2"
        )))
        .bind(project.to_string())
        .bind(id.to_string())
        .fetch_optional(self.pool())
        .await?
        .ok_or(StoreError::NotFound)?;
        from_row(&row)
    }

    pub async fn get_tool_connection_by_name(
        &self,
        project: ProjectId,
        name: &str,
    ) -> Result<ToolConnectionRecord, StoreError> {
        let row = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM tool_connections WHERE project_id = $1 AND name = $2"
        )))
        .bind(project.to_string())
        .bind(name)
        .fetch_optional(self.pool())
        .await?
        .ok_or(StoreError::NotFound)?;
        from_row(&row)
    }

    pub async fn list_tool_connections(
        &self,
        project: ProjectId,
    ) -> Result<Vec<ToolConnectionRecord>, StoreError> {
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM tool_connections WHERE project_id = $1 ORDER BY id"
        )))
        .bind(project.to_string())
        .fetch_all(self.pool())
        .await?;
        rows.iter().map(from_row).collect()
    }

    /// Pins `pins` with `classification`, records them as the live list too, and enables the
    /// connection, staging `recorded`, its `connection.enable` entry, in the same transaction
    /// (`crate::staged`): the caller appends it with [`crate::AuditLog::append_staged`].
    pub async fn enable_tool_connection(
        &self,
        project: ProjectId,
        id: ConnectionId,
        pins: &BTreeMap<String, StoredPin>,
        classification: &BTreeMap<String, ToolClass>,
        recorded: AuditEvent,
    ) -> Result<(ToolConnectionRecord, StagedEvent), StoreError> {
        let pins = to_json(pins)?;
        let mut tx = self.begin_write().await?;
        let done = sqlx::query(
            "UPDATE tool_connections SET status = 'enabled', pinned_tools = $1, live_tools = $1, \
             tool_classification = $2, updated_at = $3 WHERE project_id = $4 AND id = $5",
        )
        .bind(pins)
        .bind(to_json(classification)?)
        .bind(now_millis())
        .bind(project.to_string())
        .bind(id.to_string())
        .execute(&mut **tx)
        .await?;
        self.changed_and_staged(tx, project, id, done.rows_affected(), recorded)
            .await
    }

    /// After a change of connection `id` in `tx` that touched `rows` rows: none, not found, and
    /// nothing staged; otherwise `recorded` staged, committed, and the connection as it is now.
    async fn changed_and_staged(
        &self,
        mut tx: crate::WriteTx,
        project: ProjectId,
        id: ConnectionId,
        rows: u64,
        recorded: AuditEvent,
    ) -> Result<(ToolConnectionRecord, StagedEvent), StoreError> {
        if rows == 0 {
            tx.rollback().await?;
            return Err(StoreError::NotFound);
        }
        let staged = crate::staged::stage_one(&mut tx, recorded).await?;
        tx.commit().await?;
        Ok((self.get_tool_connection(project, id).await?, staged))
    }

    /// Quarantines the connection, keeping its pins, with `live` as the list last seen, staging
    /// `recorded`, its `connection.quarantine` entry, in the same transaction
    /// (`crate::staged`) for the caller to append.
    pub async fn quarantine_tool_connection(
        &self,
        project: ProjectId,
        id: ConnectionId,
        live: &BTreeMap<String, StoredPin>,
        recorded: AuditEvent,
    ) -> Result<(ToolConnectionRecord, StagedEvent), StoreError> {
        let mut tx = self.begin_write().await?;
        let done = sqlx::query(
            "UPDATE tool_connections SET status = 'quarantined', live_tools = $1, updated_at = $2 \
             WHERE project_id = $3 AND id = $4",
        )
        .bind(to_json(live)?)
        .bind(now_millis())
        .bind(project.to_string())
        .bind(id.to_string())
        .execute(&mut **tx)
        .await?;
        self.changed_and_staged(tx, project, id, done.rows_affected(), recorded)
            .await
    }

    /// Records the tool list last seen, without changing the status.
    pub async fn record_live_tools(
        &self,
        project: ProjectId,
        id: ConnectionId,
        live: &BTreeMap<String, StoredPin>,
    ) -> Result<ToolConnectionRecord, StoreError> {
        let done = sqlx::query(
            "UPDATE tool_connections SET live_tools = $1 WHERE project_id = $2 AND id = $3",
        )
        .bind(to_json(live)?)
        .bind(project.to_string())
        .bind(id.to_string())
        .execute(&*self.write_pool().await?)
        .await?;
        self.updated_tool_connection(project, id, done.rows_affected())
            .await
    }

    /// Replaces an `http_api` connection's configured tools (its live list), staging
    /// `recorded`, its `connection.update_tools` entry, in the same transaction
    /// (`crate::staged`) for the caller to append; pins and status are left as they are.
    pub async fn replace_http_tools(
        &self,
        project: ProjectId,
        id: ConnectionId,
        tools: &[Value],
        recorded: AuditEvent,
    ) -> Result<(ToolConnectionRecord, StagedEvent), StoreError> {
        let mut tx = self.begin_write().await?;
        let done = sqlx::query(
            "UPDATE tool_connections SET http_tools = $1, updated_at = $2 \
             WHERE project_id = $3 AND id = $4 AND kind = 'http_api'",
        )
        .bind(to_json(&tools)?)
        .bind(now_millis())
        .bind(project.to_string())
        .bind(id.to_string())
        .execute(&mut **tx)
        .await?;
        self.changed_and_staged(tx, project, id, done.rows_affected(), recorded)
            .await
    }

    /// Disables the connection, as an admin does, staging `recorded`, its `connection.disable`
    /// entry, in the same transaction (`crate::staged`); its pins are kept for a later review.
    /// The caller appends the entry with [`crate::AuditLog::append_staged`]. One disabled
    /// already is left as it is, and no entry is staged.
    pub async fn disable_tool_connection_staged(
        &self,
        project: ProjectId,
        id: ConnectionId,
        recorded: AuditEvent,
    ) -> Result<(ToolConnectionRecord, Option<StagedEvent>), StoreError> {
        let mut tx = self.begin_write().await?;
        let done = sqlx::query(
            "UPDATE tool_connections SET status = 'disabled', updated_at = $1 \
             WHERE project_id = $2 AND id = $3 AND status <> 'disabled'",
        )
        .bind(now_millis())
        .bind(project.to_string())
        .bind(id.to_string())
        .execute(&mut **tx)
        .await?;
        if done.rows_affected() == 0 {
            tx.rollback().await?;
            // Disabled before, or not there (a 404).
            return Ok((self.get_tool_connection(project, id).await?, None));
        }
        let (record, staged) = self
            .changed_and_staged(tx, project, id, done.rows_affected(), recorded)
            .await?;
        Ok((record, Some(staged)))
    }

    async fn updated_tool_connection(
        &self,
        project: ProjectId,
        id: ConnectionId,
        rows: u64,
    ) -> Result<ToolConnectionRecord, StoreError> {
        if rows == 0 {
            return Err(StoreError::NotFound);
        }
        self.get_tool_connection(project, id).await
    }
}

fn json_column<T: serde::de::DeserializeOwned>(text: &str, column: &str) -> Result<T, StoreError> {
    serde_json::from_str(text)
        .map_err(|_| StoreError::Corrupt(format!("column `{column}` is not valid json")))
}

fn from_row(row: &sqlx::any::AnyRow) -> Result<ToolConnectionRecord, StoreError> {
    let id: String = row.try_get("id")?;
    let project_id: String = row.try_get("project_id")?;
    let kind: String = row.try_get("kind")?;
    let status: String = row.try_get("status")?;
    let allowlist: String = row.try_get("allowlist")?;
    let classification: String = row.try_get("tool_classification")?;
    let pinned: String = row.try_get("pinned_tools")?;
    let live: Option<String> = row.try_get("live_tools")?;
    let headers: String = row.try_get("secret_headers")?;
    let command: Option<String> = row.try_get("command")?;
    let http_tools: Option<String> = row.try_get("http_tools")?;
    let created_by: Option<String> = row.try_get("created_by")?;
    Ok(ToolConnectionRecord {
        id: parse_column(&id, "tool_connections.id")?,
        project_id: parse_column(&project_id, "tool_connections.project_id")?,
        name: row.try_get("name")?,
        kind: kind.parse().map_err(|_| {
            StoreError::Corrupt(format!("column `tool_connections.kind` holds `{kind}`"))
        })?,
        url: row.try_get("url")?,
        allowlist: json_column(&allowlist, "tool_connections.allowlist")?,
        status: parse_column(&status, "tool_connections.status")?,
        tool_classification: json_column(&classification, "tool_connections.tool_classification")?,
        pinned_tools: json_column(&pinned, "tool_connections.pinned_tools")?,
        live_tools: live
            .map(|l| json_column(&l, "tool_connections.live_tools"))
            .transpose()?,
        secret_headers: json_column(&headers, "tool_connections.secret_headers")?,
        command: command
            .map(|c| json_column(&c, "tool_connections.command"))
            .transpose()?,
        http_tools: http_tools
            .map(|t| json_column(&t, "tool_connections.http_tools"))
            .transpose()?
            .unwrap_or_default(),
        created_by: created_by
            .map(|k| parse_column(&k, "tool_connections.created_by"))
            .transpose()?,
        created_at: row.try_get("created_at")?,
        updated_at: row.try_get("updated_at")?,
    })
}
