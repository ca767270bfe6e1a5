//! Tool connections at work: reviewing a connection's live tools, pinning exactly what an
//! admin reviewed, and, at each run start, checking the live list against the pins (S9).
//!
//! Credentials come out of the vault only to build the [`ConnectionCredentials`] that
//! `wor-tools` attaches at send time; they never enter a value this module returns.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Component, Path, PathBuf};

use secrecy::SecretString;
use serde_json::{Value, json};
use wor_core::audit::{Actor, AuditCategory, AuditEvent};
use wor_core::call::ToolClass;
use wor_core::{ConnectionId, ProjectId};
use wor_store::{SecretSlot, StdioSpec, StoreError, env_field};
use wor_store::{
    StoredPin, TOOL_CONNECTIONS_TABLE, ToolConnectionKind, ToolConnectionRecord,
    ToolConnectionStatus, header_field,
};
use wor_tools::{
    ConnectionCredentials, CredentialError, CredentialSlot, HttpToolError, McpError, McpLimits,
    McpSession, PinError, PinnedToolDefinition, StreamableHttpEndpoint, ToolDefinition,
    ToolListDiff, ToolListVerdict, ToolSession, ToolSessionError, compare,
};

use crate::{Engine, EngineError};

/// The vault field of a connection's bearer token.
pub const BEARER_TOKEN_FIELD: &str = "bearer_token";

/// One secret a connection's requests carry, by where it goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RequestSecret<'a> {
    /// Its static bearer token (`Authorization: Bearer`).
    Bearer,
    /// The access token of its MCP authorization (`Authorization: Bearer`).
    OAuthAccessToken,
    /// A secret header, by name.
    Header(&'a str),
}

impl RequestSecret<'_> {
    /// The field it is known by: its vault field, or `oauth_access_token`.
    pub(crate) fn field(self) -> String {
        match self {
            RequestSecret::Bearer => BEARER_TOKEN_FIELD.to_owned(),
            RequestSecret::OAuthAccessToken => OAUTH_ACCESS_TOKEN_FIELD.to_owned(),
            RequestSecret::Header(name) => header_field(name),
        }
    }
}

/// The field a run envelope names an MCP authorization's access token by.
pub const OAUTH_ACCESS_TOKEN_FIELD: &str = "oauth_access_token";

/// One live tool as an admin reviews it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ReviewedTool {
    pub name: String,
    pub description: Option<String>,
    pub input_schema: Value,
    /// The server's hints; shown, never trusted for decisions.
    pub annotations: Option<Value>,
    /// What enabling pins.
    pub hash: String,
}

/// How the live list differs from the pins.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ReviewDiff {
    pub changed: Vec<String>,
    pub added: Vec<String>,
    pub removed: Vec<String>,
    pub duplicated: Vec<String>,
    /// The readable diff, path by path.
    pub text: String,
}

/// What `review` shows: the live tools, and the diff against the pins when there are pins.
#[derive(Debug, Clone)]
pub struct ToolReview {
    pub connection: ToolConnectionRecord,
    pub tools: Vec<ReviewedTool>,
    pub diff: Option<ReviewDiff>,
}

/// What replacing an `http_api` connection's tools did.
#[derive(Debug, Clone)]
pub struct ReplacedTools {
    pub connection: ToolConnectionRecord,
    /// The difference from the pins; `None` when nothing is pinned.
    pub diff: Option<ReviewDiff>,
    /// Whether the replacement quarantined the connection (a changed or new tool).
    pub quarantined: bool,
}

/// Why a tool connection cannot be used. Each names the connection (never a secret value) and
/// keeps its source, so the API and a run's outcome are decided from the kind of failure.
#[derive(Debug, thiserror::Error)]
pub enum ConnectionError {
    /// Its status does not let runs use it.
    #[error("{}", not_enabled(connection, *status))]
    NotEnabled {
        connection: String,
        status: ToolConnectionStatus,
    },
    /// What is stored for it does not have the shape it was checked into when created.
    #[error("tool connection `{connection}`: {reason}")]
    InvalidStored {
        connection: String,
        reason: StoredConnectionError,
    },
    /// Its command is not (or no longer) allowed by the operator's rules for local programs.
    #[error("tool connection `{connection}`: {source}")]
    Command {
        connection: String,
        #[source]
        source: CommandRefusal,
    },
    /// A stdio MCP server runs only in the sandbox, and this server has none.
    #[error(
        "tool connection `{connection}` is a stdio MCP server, which runs only in the sandbox; this server has no sandbox"
    )]
    NoSandbox { connection: String },
    /// A credential of it cannot be read from or opened by the vault.
    #[error("a credential of tool connection `{connection}` cannot be opened: {source}")]
    Vault {
        connection: String,
        #[source]
        source: wor_store::VaultError,
    },
    /// A credential does not fit where it is attached (a header name or value).
    #[error("tool connection `{connection}`: {source}")]
    Credential {
        connection: String,
        #[source]
        source: CredentialError,
    },
    /// Its OAuth access token could not be had (refused, refreshing elsewhere, not stored).
    #[error(transparent)]
    Authorization(Box<EngineError>),
    /// Its MCP server over HTTP could not be reached or answered wrongly.
    #[error("tool connection `{connection}` cannot be reached: {source}")]
    Connect {
        connection: String,
        #[source]
        source: McpError,
    },
    /// Its stdio MCP server could not be started or answered wrongly.
    #[error("tool connection `{connection}` cannot be started: {source}")]
    Start {
        connection: String,
        #[source]
        source: McpError,
    },
    /// Its HTTP API cannot be set up on its base URL.
    #[error("tool connection `{connection}`: {source}")]
    HttpApi {
        connection: String,
        #[source]
        source: HttpToolError,
    },
    /// Its Wasm component cannot be loaded or given what it declares.
    #[error("tool connection `{connection}`: {source}")]
    Wasm {
        connection: String,
        #[source]
        source: wor_wasm::WasmError,
    },
    /// Its session is open, and its tools cannot be listed.
    #[error("the tools of tool connection `{connection}` cannot be listed: {source}")]
    List {
        connection: String,
        #[source]
        source: ToolSessionError,
    },
}

fn not_enabled(connection: &str, status: ToolConnectionStatus) -> String {
    match status {
        ToolConnectionStatus::Enabled => format!("tool connection `{connection}` is enabled"),
        ToolConnectionStatus::Quarantined => format!(
            "tool connection `{connection}` is quarantined: its tools changed since they were pinned; an admin must review the diff and enable it again"
        ),
        ToolConnectionStatus::PendingReview => format!(
            "tool connection `{connection}` is waiting for review; an admin must review and enable it"
        ),
        ToolConnectionStatus::Disabled => format!("tool connection `{connection}` is disabled"),
    }
}

/// Why a change an admin asked of a tool connection (enabling it with their review, replacing
/// its tools) is refused: nothing changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ToolConnectionRefusal {
    /// A tool classified read-only or open-world is not among the reviewed tools.
    #[error("`{field}` names `{tool}`, which is not among the reviewed tools")]
    UnreviewedClass { field: &'static str, tool: String },
    /// A tool classified both read-only and open-world.
    #[error("`{tool}` is classified both read-only and open-world; a tool has one class")]
    TwoClasses { tool: String },
    /// The server lists a tool twice: there is no one definition to pin.
    #[error("the server lists tool `{tool}` twice; it cannot be pinned")]
    DuplicateTool { tool: String },
    /// The live tool list is not the one reviewed (these tools differ).
    #[error(
        "the live tool list changed since it was reviewed ({}); review it again",
        quoted(.tools)
    )]
    ChangedSinceReview { tools: Vec<String> },
    /// Only an `http_api` connection's tools are replaced through the API.
    #[error(
        "tool connection `{connection}` is `{kind}`: only an `http_api` connection's tools are replaced; other kinds list their own"
    )]
    NotHttpApi {
        connection: String,
        kind: ToolConnectionKind,
    },
}

fn quoted(names: &[String]) -> String {
    names
        .iter()
        .map(|n| format!("`{n}`"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// A stored part of a tool connection that is not what was checked when it was written.
#[derive(Debug, thiserror::Error)]
pub enum StoredConnectionError {
    #[error("its allowlist is invalid: {0}")]
    Allowlist(#[source] wor_egress::AllowlistError),
    #[error("it has no command")]
    NoCommand,
    #[error("a stored pin is not a tool definition: {0}")]
    PinShape(#[source] serde_json::Error),
    #[error(transparent)]
    Pin(#[from] PinError),
    #[error("an http tool is not valid: {0}")]
    HttpToolShape(#[source] serde_json::Error),
    #[error(transparent)]
    HttpTool(#[from] HttpToolError),
}

/// Why a local program's command (`mcp_stdio`, `wasm`) is refused by the operator's rules.
#[derive(Debug, thiserror::Error)]
pub enum CommandRefusal {
    #[error("{what} `{path}` must be an absolute path without `.` or `..`")]
    NotNormal { what: &'static str, path: String },
    #[error(
        "the program `{program}` is neither in the system runtime ({}) nor under a path the operator allows (`[sandbox] allowed_paths`)",
        SYSTEM_PROGRAM_ROOTS.join(", ")
    )]
    ProgramOutsideRoots { program: String },
    #[error(
        "the read-only path `{path}` is not under a path the operator allows (`[sandbox] allowed_paths` in the server configuration), once links are resolved"
    )]
    PathOutsideRoots { path: String },
    #[error("the read-only path `{path}` cannot be resolved: {source}")]
    PathUnresolved {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the read-only path `{path}` overlaps the server's data directory")]
    PathProtected { path: String },
    #[error(
        "environment variable `{variable}` must be upper-case letters, digits and `_`, not starting with a digit or `LD_`"
    )]
    EnvName { variable: String },
}

/// The slot of a connection's credential `field`.
pub fn credential_slot(
    project: ProjectId,
    connection: ConnectionId,
    field: impl Into<String>,
) -> SecretSlot {
    SecretSlot::new(project, TOOL_CONNECTIONS_TABLE, connection, field)
}

/// A stored pin as the tool library's checked pin.
pub(crate) fn pin_from_stored(
    stored: &StoredPin,
) -> Result<PinnedToolDefinition, StoredConnectionError> {
    let definition: ToolDefinition = serde_json::from_value(stored.definition.clone())
        .map_err(StoredConnectionError::PinShape)?;
    Ok(PinnedToolDefinition::from_stored(definition, &stored.hash)?)
}

pub(crate) fn stored_from_definition(definition: &ToolDefinition) -> StoredPin {
    StoredPin {
        definition: serde_json::to_value(definition).unwrap_or(Value::Null),
        hash: definition.hash(),
    }
}

/// A connection's pins; a pin that does not read back is stored state the run cannot use.
pub(crate) fn stored_pins(
    record: &ToolConnectionRecord,
) -> Result<Vec<PinnedToolDefinition>, ConnectionError> {
    record
        .pinned_tools
        .values()
        .map(pin_from_stored)
        .collect::<Result<_, _>>()
        .map_err(|reason| ConnectionError::InvalidStored {
            connection: record.name.clone(),
            reason,
        })
}

/// The names a diff makes a quarantine of: changed, new and duplicated tools.
pub(crate) fn quarantine_names(diff: &ToolListDiff) -> Vec<String> {
    let mut names: BTreeSet<String> = diff.changed.iter().map(|c| c.name.clone()).collect();
    names.extend(diff.added.iter().map(|t| t.name.clone()));
    names.extend(diff.duplicated.iter().cloned());
    names.into_iter().collect()
}

fn review_diff(diff: &ToolListDiff) -> ReviewDiff {
    ReviewDiff {
        changed: diff.changed.iter().map(|c| c.name.clone()).collect(),
        added: diff.added.iter().map(|t| t.name.clone()).collect(),
        removed: diff.removed.clone(),
        duplicated: diff.duplicated.clone(),
        text: diff.to_string(),
    }
}

impl Engine {
    /// Opens a session with a tool connection of any kind: an MCP session over HTTP or stdio
    /// (in the sandbox), the configured tools of an HTTP API, or a Wasm component. Credentials
    /// are attached by `wor-tools` at send time.
    /// Opens a session on `record`'s server, for `run` when a run will call it (its trace
    /// context goes to servers the operator named, `EngineConfig::trace_context_to`).
    pub(crate) async fn open_tool_session(
        &self,
        record: &ToolConnectionRecord,
        run: Option<&wor_store::RunRecord>,
    ) -> Result<ToolSession, ConnectionError> {
        let connection = || record.name.clone();
        // Parsed once here, for whichever kind of session needs it.
        let allowlist = wor_egress::HostAllowlist::parse(&record.allowlist).map_err(|e| {
            ConnectionError::InvalidStored {
                connection: connection(),
                reason: StoredConnectionError::Allowlist(e),
            }
        })?;
        match record.kind {
            ToolConnectionKind::McpStdio => {
                return self
                    .open_stdio_session(record, allowlist)
                    .await
                    .map(ToolSession::Mcp);
            }
            ToolConnectionKind::HttpApi => {
                return self.open_http_api(record, allowlist, run).await;
            }
            ToolConnectionKind::Wasm => {
                // No allowlist means no network at all for a component.
                let allowlist = (!record.allowlist.is_empty()).then_some(allowlist);
                return self.open_wasm_session(record, allowlist).await;
            }
            ToolConnectionKind::McpHttp => {}
        }
        let endpoint = StreamableHttpEndpoint {
            url: record.url.clone(),
            allowlist,
            credentials: self.traced(self.connection_credentials(record).await?, record, run)?,
        };
        // An authorized connection's access token is renewed when its server refuses it (not
        // by a remote worker, which uses the token its envelope brought).
        let renewal = if self.is_remote() {
            None
        } else {
            self.store
                .get_connection_oauth(record.project_id, record.id)
                .await
                .map_err(|e| ConnectionError::Authorization(Box::new(EngineError::Store(e))))?
                .map(|_| {
                    std::sync::Arc::new(crate::oauth_connections::OAuthRenewal {
                        engine: self.clone(),
                        project: record.project_id,
                        id: record.id,
                        connection: connection(),
                    }) as std::sync::Arc<dyn wor_tools::BearerRenewal>
                })
        };
        McpSession::connect_http_renewing(&self.egress, endpoint, renewal, McpLimits::default())
            .await
            .map(ToolSession::Mcp)
            .map_err(|source| ConnectionError::Connect {
                connection: connection(),
                source,
            })
    }

    /// `credentials` with the run's trace context (`traceparent`) when traces are on and the
    /// operator named the connection's server in `[traces] propagate_to`; otherwise as they
    /// are. Nothing a tool server answers is read as trace context.
    fn traced(
        &self,
        credentials: ConnectionCredentials,
        record: &ToolConnectionRecord,
        run: Option<&wor_store::RunRecord>,
    ) -> Result<ConnectionCredentials, ConnectionError> {
        let Some(traceparent) = run.and_then(crate::traces::traceparent) else {
            return Ok(credentials);
        };
        let named = wor_egress::EgressUrl::parse(&record.url)
            .is_ok_and(|url| self.config.trace_context_to.allows(url.host(), url.port()));
        // A `traceparent` the connection's own credentials set is left as it is.
        let own = record
            .secret_headers
            .iter()
            .any(|h| h.eq_ignore_ascii_case("traceparent"));
        if !named || own {
            return Ok(credentials);
        }
        credentials
            .with_header("traceparent", SecretString::from(traceparent))
            .map_err(|source| ConnectionError::Credential {
                connection: record.name.clone(),
                source,
            })
    }

    /// The bearer token and secret headers of a connection, opened from the vault.
    async fn connection_credentials(
        &self,
        record: &ToolConnectionRecord,
    ) -> Result<ConnectionCredentials, ConnectionError> {
        Engine::credentials_from(record, self.request_secrets(record).await?)
    }

    /// `secrets` as the credentials a session attaches, checked (header names and values, at
    /// most one `authorization`).
    pub(crate) fn credentials_from<'a>(
        record: &ToolConnectionRecord,
        secrets: impl IntoIterator<Item = (RequestSecret<'a>, SecretString)>,
    ) -> Result<ConnectionCredentials, ConnectionError> {
        let mut credentials = ConnectionCredentials::none();
        for (field, value) in secrets {
            credentials = match field {
                RequestSecret::Bearer | RequestSecret::OAuthAccessToken => {
                    credentials.with_bearer(value)
                }
                RequestSecret::Header(header) => credentials.with_header(header, value),
            }
            .map_err(|source| ConnectionError::Credential {
                connection: record.name.clone(),
                source,
            })?;
        }
        Ok(credentials)
    }

    /// What a connection's requests carry, opened from the vault: its bearer token, the
    /// access token of its authorization (refreshed first when it is about to expire), and
    /// its secret headers, in the order they are attached.
    pub(crate) async fn request_secrets<'a>(
        &self,
        record: &'a ToolConnectionRecord,
    ) -> Result<Vec<(RequestSecret<'a>, SecretString)>, ConnectionError> {
        let name = &record.name;
        let mut secrets = Vec::new();
        // A remote worker's are the ones its envelope brought.
        if self.is_remote() {
            for secret in [RequestSecret::Bearer, RequestSecret::OAuthAccessToken]
                .into_iter()
                .chain(
                    record
                        .secret_headers
                        .iter()
                        .map(|h| RequestSecret::Header(h)),
                )
            {
                if let Some(Some(value)) =
                    self.remote_tool_credential(&record.id.to_string(), &secret.field())
                {
                    secrets.push((secret, value));
                }
            }
            return Ok(secrets);
        }
        let bearer = credential_slot(record.project_id, record.id, BEARER_TOKEN_FIELD);
        if self
            .vault
            .metadata(&bearer)
            .await
            .map_err(|e| ConnectionError::Vault {
                connection: name.clone(),
                source: e.into(),
            })?
            .is_some()
        {
            secrets.push((
                RequestSecret::Bearer,
                self.open_secret(&bearer, name).await?,
            ));
        }
        if record.kind == ToolConnectionKind::McpHttp
            && let Some(token) = self
                .oauth_access_token(record.project_id, record.id, name)
                .await
                .map_err(|e| ConnectionError::Authorization(Box::new(e)))?
        {
            secrets.push((RequestSecret::OAuthAccessToken, token));
        }
        for header in &record.secret_headers {
            let value = self
                .open_secret(
                    &credential_slot(record.project_id, record.id, header_field(header)),
                    name,
                )
                .await?;
            secrets.push((RequestSecret::Header(header), value));
        }
        Ok(secrets)
    }

    /// The configured tools of an `http_api` connection on its base URL.
    async fn open_http_api(
        &self,
        record: &ToolConnectionRecord,
        allowlist: wor_egress::HostAllowlist,
        run: Option<&wor_store::RunRecord>,
    ) -> Result<ToolSession, ConnectionError> {
        let connection = wor_tools::HttpApiConnection::new(
            &record.url,
            allowlist,
            self.traced(self.connection_credentials(record).await?, record, run)?,
        )
        .map_err(|source| ConnectionError::HttpApi {
            connection: record.name.clone(),
            source,
        })?;
        let tools = http_tool_definitions(record)
            .map_err(|reason| ConnectionError::InvalidStored {
                connection: record.name.clone(),
                reason,
            })?
            .into_iter()
            .map(|tool| (tool.tool_definition().name, tool))
            .collect();
        Ok(ToolSession::Http {
            connection: Box::new(connection),
            tools,
            egress: self.egress.clone(),
        })
    }

    /// Starts a stdio connection's server in the sandbox: its declared program, arguments,
    /// read-only paths and environment (values opened from the vault now), network only to its
    /// allowlist through the egress proxy. Without a sandbox nothing starts.
    async fn open_stdio_session(
        &self,
        record: &ToolConnectionRecord,
        allowlist: wor_egress::HostAllowlist,
    ) -> Result<McpSession, ConnectionError> {
        let Some(sandbox) = &self.sandbox else {
            return Err(ConnectionError::NoSandbox {
                connection: record.name.clone(),
            });
        };
        let (spec, env) = self.local_command(record).await?;
        let command = wor_tools::StdioCommand {
            program: spec.program.clone(),
            args: spec.args.clone(),
            env,
            egress_allowlist: allowlist,
            read_only_paths: spec.read_only_paths.iter().map(PathBuf::from).collect(),
        };
        McpSession::connect_stdio(
            &wor_tools::Sandboxed::new(sandbox.clone()),
            &command,
            McpLimits::default(),
        )
        .await
        .map_err(|source| ConnectionError::Start {
            connection: record.name.clone(),
            source,
        })
    }

    /// A local connection's (`mcp_stdio`, `wasm`) command, checked against the operator's
    /// allowed roots, and its environment, opened from the vault now.
    pub(crate) async fn local_command<'a>(
        &self,
        record: &'a ToolConnectionRecord,
    ) -> Result<(&'a StdioSpec, Vec<(String, SecretString)>), ConnectionError> {
        let name = &record.name;
        let spec = record
            .command
            .as_ref()
            .ok_or_else(|| ConnectionError::InvalidStored {
                connection: name.clone(),
                reason: StoredConnectionError::NoCommand,
            })?;
        check_stdio_spec(
            spec,
            &self.config.stdio_allowed_roots,
            &self.config.protected_paths,
        )
        .map_err(|source| ConnectionError::Command {
            connection: name.clone(),
            source,
        })?;
        let mut env = Vec::with_capacity(spec.env_names.len());
        for variable in &spec.env_names {
            let value = self
                .open_secret(
                    &credential_slot(record.project_id, record.id, env_field(variable)),
                    name,
                )
                .await?;
            env.push((variable.clone(), value));
        }
        Ok((spec, env))
    }

    async fn open_secret(
        &self,
        slot: &SecretSlot,
        name: &str,
    ) -> Result<SecretString, ConnectionError> {
        // A remote worker opens nothing: the secret is in the envelope of the run it drives,
        // or missing.
        if self.is_remote() {
            return self
                .remote_tool_credential(&slot.owner_id, &slot.field)
                .flatten()
                .ok_or_else(|| ConnectionError::Vault {
                    connection: name.to_owned(),
                    source: wor_store::VaultError::Missing {
                        slot: slot.to_string(),
                    },
                });
        }
        self.vault
            .open(slot)
            .await
            .map_err(|source| ConnectionError::Vault {
                connection: name.to_owned(),
                source,
            })
    }

    async fn live_tools(
        &self,
        record: &ToolConnectionRecord,
    ) -> Result<Vec<ToolDefinition>, EngineError> {
        let session = self.open_tool_session(record, None).await?;
        let listed = session.list_tools().await;
        session.close().await;
        Ok(listed.map_err(|source| ConnectionError::List {
            connection: record.name.clone(),
            source,
        })?)
    }

    /// Connects to the connection, lists its live tools, and compares them with its pins.
    pub async fn review_tool_connection(
        &self,
        project: ProjectId,
        id: wor_core::ConnectionId,
    ) -> Result<ToolReview, EngineError> {
        let record = self.store.get_tool_connection(project, id).await?;
        let live = self.live_tools(&record).await?;
        let diff = if record.pinned_tools.is_empty() {
            None
        } else {
            let pins = stored_pins(&record)?;
            Some(review_diff(&compare(&pins, &live)))
        };
        let tools = live
            .iter()
            .map(|t| ReviewedTool {
                name: t.name.clone(),
                description: t.description.clone(),
                input_schema: Value::Object(t.input_schema.clone()),
                annotations: t.annotations.clone(),
                hash: t.hash(),
            })
            .collect();
        Ok(ToolReview {
            connection: record,
            tools,
            diff,
        })
    }

    /// Pins exactly the tools an admin reviewed: `reviewed` maps each tool name to the hash
    /// they saw. The live list is fetched again and must be exactly that set, or nothing is
    /// pinned. `read_only` names the tools the admin classifies read-only. `recorded`, the
    /// enable's `connection.enable` entry, is staged with it and appended here.
    pub async fn enable_tool_connection(
        &self,
        project: ProjectId,
        id: wor_core::ConnectionId,
        reviewed: &BTreeMap<String, String>,
        read_only: &[String],
        open_world: &[String],
        recorded: AuditEvent,
    ) -> Result<ToolConnectionRecord, EngineError> {
        let record = self.store.get_tool_connection(project, id).await?;
        for (field, tools) in [("read_only", read_only), ("open_world", open_world)] {
            for tool in tools {
                if !reviewed.contains_key(tool) {
                    return Err(ToolConnectionRefusal::UnreviewedClass {
                        field,
                        tool: tool.clone(),
                    }
                    .into());
                }
            }
        }
        if let Some(tool) = read_only.iter().find(|t| open_world.contains(t)) {
            return Err(ToolConnectionRefusal::TwoClasses { tool: tool.clone() }.into());
        }
        let live = self.live_tools(&record).await?;
        let mut pins = BTreeMap::new();
        for tool in &live {
            if pins
                .insert(tool.name.clone(), stored_from_definition(tool))
                .is_some()
            {
                return Err(ToolConnectionRefusal::DuplicateTool {
                    tool: tool.name.clone(),
                }
                .into());
            }
        }
        let live_hashes: BTreeMap<&String, &String> =
            pins.iter().map(|(name, pin)| (name, &pin.hash)).collect();
        let reviewed_hashes: BTreeMap<&String, &String> = reviewed.iter().collect();
        if live_hashes != reviewed_hashes {
            let mut differing: BTreeSet<&String> = BTreeSet::new();
            for (name, hash) in &live_hashes {
                if reviewed_hashes.get(name) != Some(hash) {
                    differing.insert(name);
                }
            }
            differing.extend(
                reviewed_hashes
                    .keys()
                    .filter(|name| !live_hashes.contains_key(*name)),
            );
            return Err(ToolConnectionRefusal::ChangedSinceReview {
                tools: differing.into_iter().cloned().collect(),
            }
            .into());
        }
        let classification: BTreeMap<String, ToolClass> = pins
            .keys()
            .map(|name| {
                let class = if read_only.contains(name) {
                    ToolClass::ReadOnly
                } else if open_world.contains(name) {
                    ToolClass::OpenWorld
                } else {
                    ToolClass::Consequential
                };
                (name.clone(), class)
            })
            .collect();
        let (record, staged) = self
            .store
            .enable_tool_connection(project, id, &pins, &classification, recorded)
            .await?;
        self.append_staged_or_log([staged]).await;
        Ok(record)
    }

    /// The credentials a connection has sealed: its bearer token and secret headers.
    pub async fn configured_credential_slots(
        &self,
        record: &ToolConnectionRecord,
    ) -> Result<BTreeSet<CredentialSlot>, EngineError> {
        let mut slots: BTreeSet<CredentialSlot> = record
            .secret_headers
            .iter()
            .map(|h| CredentialSlot::Header(h.clone()))
            .collect();
        if self
            .vault
            .metadata(&credential_slot(
                record.project_id,
                record.id,
                BEARER_TOKEN_FIELD,
            ))
            .await?
            .is_some()
        {
            slots.insert(CredentialSlot::Bearer);
        }
        Ok(slots)
    }

    /// Replaces the tools of an `http_api` connection with `tools` (checked by
    /// [`crate::HttpToolsSource::validate`]): written again, or imported again from a changed
    /// document. Nothing is pinned here. If the connection is enabled and a tool changed or is
    /// new, it is quarantined at once, recorded with `actor`, until an admin reviews the diff
    /// and enables it again; a removed tool is just unavailable.
    pub async fn replace_http_tools(
        &self,
        project: ProjectId,
        id: wor_core::ConnectionId,
        tools: &crate::CheckedHttpTools,
        actor: Actor,
    ) -> Result<ReplacedTools, EngineError> {
        let before = self.store.get_tool_connection(project, id).await?;
        if before.kind != ToolConnectionKind::HttpApi {
            return Err(ToolConnectionRefusal::NotHttpApi {
                connection: before.name,
                kind: before.kind,
            }
            .into());
        }
        let live = &tools.definitions;
        // The entry is staged with the new tools: a crash before it is appended leaves it for
        // the audit writer's sweep.
        let recorded =
            AuditEvent::new(project, AuditCategory::ToolConnectionUpdateTools, actor.clone())
                .subject("connection_id", id)
                .payload(json!({
                    "connection": before.name,
                    "tools": live.iter().map(|t| json!({"name": t.name, "hash": t.hash()})).collect::<Vec<_>>(),
                }));
        let (record, staged) = self
            .store
            .replace_http_tools(project, id, &tools.tools, recorded)
            .await?;
        self.append_staged_or_log([staged]).await;
        if record.pinned_tools.is_empty() {
            return Ok(ReplacedTools {
                connection: record,
                diff: None,
                quarantined: false,
            });
        }
        let pins = stored_pins(&record)?;
        let diff = compare(&pins, live);
        if diff.verdict() != ToolListVerdict::Quarantine
            || record.status != ToolConnectionStatus::Enabled
        {
            return Ok(ReplacedTools {
                connection: record,
                diff: Some(review_diff(&diff)),
                quarantined: false,
            });
        }
        let seen = live
            .iter()
            .map(|tool| (tool.name.clone(), stored_from_definition(tool)))
            .collect();
        let recorded = AuditEvent::new(project, AuditCategory::ToolConnectionQuarantine, actor)
            .subject("connection_id", id)
            .payload(quarantine_payload(&record.name, &diff));
        let (record, staged) = self
            .store
            .quarantine_tool_connection(project, id, &seen, recorded)
            .await?;
        self.append_staged_or_log([staged]).await;
        tracing::warn!(category = "tools", action = "connection.quarantine", project_id = %project,
            connection_id = %id, "tool connection quarantined: its tools were replaced");
        Ok(ReplacedTools {
            connection: record,
            diff: Some(review_diff(&diff)),
            quarantined: true,
        })
    }

    /// Quarantines `record` because its live list differs from its pins, and records why.
    pub(crate) async fn quarantine_tool_connection(
        &self,
        record: &ToolConnectionRecord,
        live: &[ToolDefinition],
        diff: &ToolListDiff,
        run: &wor_store::RunRecord,
    ) -> Result<(), StoreError> {
        let mut seen = BTreeMap::new();
        for tool in live {
            seen.insert(tool.name.clone(), stored_from_definition(tool));
        }
        let recorded = AuditEvent::new(
            record.project_id,
            AuditCategory::ToolConnectionQuarantine,
            Actor::Run { run_id: run.id },
        )
        .subject("connection_id", record.id)
        .runs(run.root_run_id, run.parent_run_id)
        .payload(quarantine_payload(&record.name, diff));
        let (_, staged) = self
            .store
            .quarantine_tool_connection(record.project_id, record.id, &seen, recorded)
            .await?;
        self.append_staged_or_log([staged]).await;
        tracing::warn!(category = "tools", action = "connection.quarantine", project_id = %record.project_id,
            connection_id = %record.id, run_id = %run.id, "tool connection quarantined");
        Ok(())
    }

    /// Whether `status` lets runs use the connection, and why not.
    pub(crate) fn check_enabled(record: &ToolConnectionRecord) -> Result<(), ConnectionError> {
        match record.status {
            ToolConnectionStatus::Enabled => Ok(()),
            status => Err(ConnectionError::NotEnabled {
                connection: record.name.clone(),
                status,
            }),
        }
    }
}

/// Paths every sandbox already has read-only (the system runtime): a program may live there.
const SYSTEM_PROGRAM_ROOTS: &[&str] = &["/usr/bin", "/usr/local/bin", "/bin"];

/// Checks a stdio server's command against the operator's allowed roots: absolute paths without
/// `.` or `..`; the program under the system runtime or an allowed root; every read-only path
/// under an allowed root, *after* resolving symbolic links (a link under a root pointing
/// elsewhere is refused), and neither inside nor containing a protected path (the data dir);
/// environment names that cannot redirect the loader.
pub fn check_stdio_spec(
    spec: &StdioSpec,
    allowed_roots: &[PathBuf],
    protected: &[PathBuf],
) -> Result<(), CommandRefusal> {
    let normal = |text: &str, what: &'static str| -> Result<PathBuf, CommandRefusal> {
        let path = Path::new(text);
        if !path.is_absolute()
            || path
                .components()
                .any(|c| matches!(c, Component::ParentDir | Component::CurDir))
        {
            return Err(CommandRefusal::NotNormal {
                what,
                path: text.to_owned(),
            });
        }
        Ok(path.to_path_buf())
    };
    let resolve = |path: &Path| std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let under = |path: &Path, roots: &[PathBuf]| {
        roots
            .iter()
            .any(|root| path.starts_with(root) && path != root.as_path())
    };
    let allowed: Vec<PathBuf> = allowed_roots.iter().map(|r| resolve(r)).collect();
    let mut program_roots: Vec<PathBuf> = SYSTEM_PROGRAM_ROOTS
        .iter()
        .map(|r| resolve(Path::new(r)))
        .collect();
    program_roots.extend(allowed.iter().cloned());
    let program = normal(&spec.program, "the program")?;
    if !under(&resolve(&program), &program_roots) {
        return Err(CommandRefusal::ProgramOutsideRoots {
            program: spec.program.clone(),
        });
    }
    let protected: Vec<PathBuf> = protected.iter().map(|p| resolve(p)).collect();
    for text in &spec.read_only_paths {
        let path = normal(text, "a read-only path")?;
        let outside = || CommandRefusal::PathOutsideRoots { path: text.clone() };
        if !under(&path, &allowed) {
            return Err(outside());
        }
        let real =
            std::fs::canonicalize(&path).map_err(|source| CommandRefusal::PathUnresolved {
                path: text.clone(),
                source,
            })?;
        if !under(&real, &allowed) {
            return Err(outside());
        }
        if protected
            .iter()
            .any(|p| real.starts_with(p) || p.starts_with(&real))
        {
            return Err(CommandRefusal::PathProtected { path: text.clone() });
        }
    }
    for variable in &spec.env_names {
        let valid = !variable.is_empty()
            && variable.len() <= 64
            && variable
                .chars()
                .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
            && !variable.starts_with(|c: char| c.is_ascii_digit());
        if !valid || variable.starts_with("LD_") {
            return Err(CommandRefusal::EnvName {
                variable: variable.clone(),
            });
        }
    }
    Ok(())
}

/// The HTTP tools configured on an `http_api` connection, checked.
pub fn http_tool_definitions(
    record: &ToolConnectionRecord,
) -> Result<Vec<wor_tools::HttpToolDefinition>, StoredConnectionError> {
    record
        .http_tools
        .iter()
        .map(|config| {
            let config: wor_tools::HttpToolConfig = serde_json::from_value(config.clone())
                .map_err(StoredConnectionError::HttpToolShape)?;
            Ok(wor_tools::HttpToolDefinition::new(config)?)
        })
        .collect()
}

/// What a `connection.quarantine` entry says about connection `name`'s tools that differ
/// from its pins.
fn quarantine_payload(name: &str, diff: &ToolListDiff) -> Value {
    json!({
        "connection": name,
        "tools": quarantine_names(diff),
        "changed": diff.changed.iter().map(|c| c.name.clone()).collect::<Vec<_>>(),
        "added": diff.added.iter().map(|t| t.name.clone()).collect::<Vec<_>>(),
        "duplicated": diff.duplicated,
    })
}

#[cfg(test)]
mod stdio_tests {
    use super::*;

    fn spec(program: &str, paths: &[&str], env: &[&str]) -> StdioSpec {
        StdioSpec {
            program: program.to_owned(),
            args: Vec::new(),
            read_only_paths: paths.iter().map(|p| (*p).to_owned()).collect(),
            env_names: env.iter().map(|p| (*p).to_owned()).collect(),
        }
    }

    #[test]
    fn stdio_commands_stay_inside_what_the_operator_allows() {
        let base = tempfile::tempdir().unwrap();
        let root = base.path().join("mcp");
        let package = root.join("everything");
        let data = root.join("data");
        let outside = base.path().join("secrets");
        for dir in [&package, &data, &outside] {
            std::fs::create_dir_all(dir).unwrap();
        }
        std::os::unix::fs::symlink(&outside, root.join("link")).unwrap();
        let roots = [root.clone()];
        let protected = [data.clone()];
        let p = |path: &Path| path.display().to_string();
        let ok = |s: &StdioSpec| check_stdio_spec(s, &roots, &protected);
        assert!(ok(&spec("/usr/bin/node", &[&p(&package)], &["API_TOKEN"])).is_ok());
        assert!(ok(&spec(&p(&root.join("bin/server")), &[], &[])).is_ok());
        for (bad, why) in [
            (spec("node", &[], &[]), "relative program"),
            (
                spec("/home/x/server", &[], &[]),
                "program outside the roots",
            ),
            (spec("/usr/bin/node", &["/etc"], &[]), "outside the roots"),
            (
                spec("/usr/bin/node", &[&p(&root.join("link"))], &[]),
                "a link leading out",
            ),
            (spec("/usr/bin/node", &[&p(&data)], &[]), "the data dir"),
            (
                spec("/usr/bin/node", &[&format!("{}/../secrets", p(&root))], &[]),
                "escaping with ..",
            ),
            (spec("/usr/bin/node", &[&p(&root)], &[]), "the root itself"),
            (
                spec("/usr/bin/node", &[&p(&root.join("missing"))], &[]),
                "a path that does not exist",
            ),
            (spec("/usr/bin/node", &[], &["LD_PRELOAD"]), "the loader"),
            (spec("/usr/bin/node", &[], &["lower"]), "a bad name"),
        ] {
            assert!(ok(&bad).is_err(), "{why}");
        }
        assert!(
            check_stdio_spec(&spec("/usr/bin/node", &[&p(&package)], &[]), &[], &[]).is_err(),
            "no roots configured: no read-only paths"
        );
    }
}
