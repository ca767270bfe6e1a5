//! The MCP client: one [`McpSession`] per connection, over streamable HTTP through the egress
//! guard, or over stdio inside the sandbox.
//!
//! A tool that fails reports it in its result ([`ToolCallResult::is_error`]); a protocol or
//! transport failure is an [`McpError`]. Every error message that carries text from rmcp or
//! the server passes through the connection's redactor first.
//!
//! Tool lists are fetched with plain `tools/list` requests, page by page, never from rmcp's
//! response cache: pinning compares what the server says now.

pub mod egress_http;
mod line_limit;
pub mod sandbox;
pub mod sandboxed;

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use rmcp::model::{
    CallToolRequestParams, ClientRequest, ContentBlock, ListToolsRequest, PaginatedRequestParams,
    ServerResult,
};
use rmcp::service::{
    NotificationContext, PeerRequestOptions, RoleClient, RunningService, ServiceError,
};
use rmcp::transport::streamable_http_client::{
    StreamableHttpClientTransport, StreamableHttpClientTransportConfig, StreamableHttpError,
};
use rmcp::{ClientHandler, ServiceExt};
use serde_json::{Map, Value};
use tokio::sync::Notify;
use wor_egress::{EgressClient, EgressError, HostAllowlist};
use wor_secrets::{RedactionError, Redactor};

use crate::credentials::{BearerRenewal, BearerRenewalError, ConnectionCredentials};
use crate::definition::ToolDefinition;
use crate::oauth::Challenge;
use crate::result::{ToolCallResult, ToolContent};
use egress_http::{EgressStreamableHttp, McpHttpError};
use sandbox::{LaunchError, ProcessGuard, SandboxLauncher, StdioCommand};

/// Timeouts and caps of one MCP session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct McpLimits {
    /// Time allowed for the `initialize` handshake.
    pub initialize_timeout: Duration,
    /// Time allowed for one request (a page of tools, a tool call).
    pub request_timeout: Duration,
    /// Largest JSON body or server-sent event accepted.
    pub max_message_bytes: usize,
    /// Most `tools/list` pages followed before giving up.
    pub max_tool_pages: usize,
    /// Most bytes (as JSON) of tool definitions one list may hold, all its pages together:
    /// the list is pinned, stored and read again for every run.
    pub max_tool_list_bytes: usize,
}

impl Default for McpLimits {
    fn default() -> Self {
        Self {
            initialize_timeout: Duration::from_secs(30),
            request_timeout: Duration::from_secs(60),
            max_message_bytes: 4 * 1024 * 1024,
            max_tool_pages: 100,
            max_tool_list_bytes: 8 * 1024 * 1024,
        }
    }
}

/// An MCP server reached over streamable HTTP.
#[derive(Debug, Clone)]
pub struct StreamableHttpEndpoint {
    /// The MCP endpoint URL (`https://mcp.example.com/mcp`).
    pub url: String,
    /// The hosts this connection may reach.
    pub allowlist: HostAllowlist,
    /// Attached to every request at send time.
    pub credentials: ConnectionCredentials,
}

/// Where an MCP connection's server runs.
#[derive(Debug, Clone)]
pub enum McpServerKind {
    /// Over streamable HTTP, through the egress guard.
    StreamableHttp(StreamableHttpEndpoint),
    /// A local process over stdio, only ever inside the sandbox.
    Stdio(StdioCommand),
}

/// Something went wrong talking to an MCP server.
#[derive(Debug, thiserror::Error)]
pub enum McpError {
    /// The egress guard refused the endpoint, or it could not be reached.
    #[error(transparent)]
    Egress(#[from] EgressError),
    /// A stdio server could not be started (in this build: never, there is no sandbox).
    #[error(transparent)]
    Launch(#[from] LaunchError),
    /// The connection's secrets could not be compiled into a redactor.
    #[error(transparent)]
    Redaction(#[from] RedactionError),
    /// The `initialize` handshake failed.
    #[error("could not initialize the mcp session: {0}")]
    Initialize(String),
    /// The server answered with a JSON-RPC error.
    #[error("mcp server returned error {code}: {message}")]
    Protocol {
        /// The JSON-RPC error code.
        code: i32,
        /// The server's message, redacted.
        message: String,
    },
    /// The exchange failed below the protocol (connection, HTTP status, framing).
    #[error("mcp transport failed: {0}")]
    Transport(String),
    /// A stdio server wrote a message (a line) longer than [`McpLimits::max_message_bytes`]:
    /// the session ends, and what was in flight fails at once.
    #[error("the mcp server sent a message larger than {0} bytes; the session is closed")]
    MessageTooLarge(usize),
    /// No answer in time.
    #[error("no answer from the mcp server within {0:?}")]
    Timeout(Duration),
    /// The server answered something this client does not accept.
    #[error("unexpected answer from the mcp server: {0}")]
    UnexpectedResponse(&'static str),
    /// The tool list did not end within [`McpLimits::max_tool_pages`].
    #[error("the tool list has more than {0} pages")]
    TooManyPages(usize),
    /// The tool list's definitions hold more than [`McpLimits::max_tool_list_bytes`].
    #[error("the tool list's definitions hold more than {0} bytes")]
    ToolListTooLarge(usize),
    /// The server refused the connection's access token and it could not be renewed, or it
    /// refused the renewed one too: the reason names the connection and what to do.
    #[error(transparent)]
    Unauthorized(BearerRenewalError),
    /// The server asks for authorization (`401`) on a session that has no token it can renew;
    /// the challenge says where its metadata is and which scopes it wants.
    #[error("the mcp server asks for authorization (http 401)")]
    AuthorizationRequired(Challenge),
    /// The server refused the access token for its scope (`403`, `insufficient_scope`): the
    /// challenge names the scopes the request needs. Nothing ran.
    #[error("the mcp server refused the access token: it needs {}", needed_scope(.0))]
    InsufficientScope(Challenge),
}

fn needed_scope(challenge: &Challenge) -> String {
    let scopes = challenge.scopes();
    if scopes.is_empty() {
        "a scope it did not name".to_owned()
    } else {
        format!("scope `{}`", scopes.join(" "))
    }
}

/// The redactor of a session's live secrets, replaced when the session renews its token.
#[derive(Debug)]
pub(crate) struct LiveRedactor(std::sync::RwLock<Arc<Redactor>>);

impl LiveRedactor {
    fn new(redactor: Redactor) -> Self {
        Self(std::sync::RwLock::new(Arc::new(redactor)))
    }

    fn current(&self) -> Arc<Redactor> {
        self.0
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    pub(crate) fn replace(&self, redactor: Redactor) {
        *self
            .0
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::new(redactor);
    }
}

/// The authorization failure behind an exchange over streamable HTTP, if that is what it was:
/// a renewal that failed, a `401` with nothing to renew, or a `403` for the token's scope.
fn authorization_failure(error: &ServiceError) -> Option<McpError> {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(current) = source {
        if let Some(StreamableHttpError::Client(failure)) =
            current.downcast_ref::<StreamableHttpError<McpHttpError>>()
        {
            match failure {
                McpHttpError::Unauthorized(failure) => {
                    return Some(McpError::Unauthorized(failure.clone()));
                }
                McpHttpError::AuthorizationRequired(challenge) => {
                    return Some(McpError::AuthorizationRequired(challenge.clone()));
                }
                McpHttpError::InsufficientScope(challenge) => {
                    return Some(McpError::InsufficientScope(challenge.clone()));
                }
                _ => {}
            }
        }
        source = current.source();
    }
    None
}

/// The egress guard's refusal behind a failed exchange over streamable HTTP, if that is what
/// it was: the transport error keeps it typed, the service error only as its source.
fn guard_refusal(error: &ServiceError) -> Option<wor_egress::EgressDenial> {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(current) = source {
        if let Some(StreamableHttpError::Client(McpHttpError::Egress(EgressError::Denied(
            denial,
        )))) = current.downcast_ref::<StreamableHttpError<McpHttpError>>()
        {
            return Some((**denial).clone());
        }
        source = current.source();
    }
    None
}

/// Set when the server sends `notifications/tools/list_changed`. Cheap to clone; clones share
/// the flag.
#[derive(Debug, Clone, Default)]
pub struct ToolListChanged {
    flag: Arc<AtomicBool>,
    notify: Arc<Notify>,
}

impl ToolListChanged {
    /// Whether a notification arrived since the last [`ToolListChanged::take`].
    pub fn is_set(&self) -> bool {
        self.flag.load(Ordering::SeqCst)
    }

    /// Returns whether a notification arrived, and clears the flag.
    pub fn take(&self) -> bool {
        self.flag.swap(false, Ordering::SeqCst)
    }

    /// Waits until the flag is set (returns at once if it already is).
    pub async fn wait(&self) {
        loop {
            let notified = self.notify.notified();
            if self.is_set() {
                return;
            }
            notified.await;
        }
    }

    fn set(&self) {
        self.flag.store(true, Ordering::SeqCst);
        self.notify.notify_waiters();
    }
}

/// rmcp's view of this client: its identity, and the notification it listens for.
#[derive(Debug, Clone)]
struct WorClientHandler {
    tools_changed: ToolListChanged,
}

impl ClientHandler for WorClientHandler {
    async fn on_tool_list_changed(&self, _context: NotificationContext<RoleClient>) {
        self.tools_changed.set();
    }

    fn get_info(&self) -> rmcp::model::ClientConfig {
        let mut info = rmcp::model::ClientConfig::default();
        info.client_info.name = "work-on-repeat".to_owned();
        info.client_info.version = env!("CARGO_PKG_VERSION").to_owned();
        info
    }
}

/// An initialized session with one MCP server.
pub struct McpSession {
    service: RunningService<RoleClient, WorClientHandler>,
    tools_changed: ToolListChanged,
    limits: McpLimits,
    /// Redacts error text and tool results: the connection's secrets, and every access token
    /// the session has used (a renewed one is not yet known to the run's own redactor).
    redactor: Arc<LiveRedactor>,
    /// Keeps a sandboxed stdio server alive for as long as the session.
    _process: Option<Box<dyn ProcessGuard>>,
    /// Set when a stdio server's message went past the limit and ended the session.
    oversized: Arc<std::sync::atomic::AtomicBool>,
}

impl fmt::Debug for McpSession {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("McpSession")
            .field("tools_changed", &self.tools_changed.is_set())
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

impl McpSession {
    /// Connects to `server`: over HTTP through `egress`, or over stdio through `launcher`.
    pub async fn connect(
        server: &McpServerKind,
        egress: &EgressClient,
        launcher: &dyn SandboxLauncher,
        limits: McpLimits,
    ) -> Result<Self, McpError> {
        match server {
            McpServerKind::StreamableHttp(endpoint) => {
                Self::connect_http(egress, endpoint.clone(), limits).await
            }
            McpServerKind::Stdio(command) => Self::connect_stdio(launcher, command, limits).await,
        }
    }

    /// Initializes a session over streamable HTTP. The endpoint is vetted by the egress guard
    /// first; every later request is vetted again.
    pub async fn connect_http(
        egress: &EgressClient,
        endpoint: StreamableHttpEndpoint,
        limits: McpLimits,
    ) -> Result<Self, McpError> {
        Self::connect_http_renewing(egress, endpoint, None, limits).await
    }

    /// [`McpSession::connect_http`] for a connection whose bearer token is an OAuth access
    /// token: when the server refuses it (`401`) mid-session, `renewal` replaces it once and
    /// the request is sent again (see `egress_http`).
    pub async fn connect_http_renewing(
        egress: &EgressClient,
        endpoint: StreamableHttpEndpoint,
        renewal: Option<Arc<dyn BearerRenewal>>,
        limits: McpLimits,
    ) -> Result<Self, McpError> {
        egress.vet(&endpoint.url, Some(&endpoint.allowlist)).await?;
        let redactor = Arc::new(LiveRedactor::new(endpoint.credentials.redactor()?));
        let http = EgressStreamableHttp::new(
            egress.clone(),
            endpoint.allowlist,
            endpoint.credentials,
            renewal,
            redactor.clone(),
            limits.max_message_bytes,
        );
        let config = StreamableHttpClientTransportConfig::with_uri(endpoint.url)
            .max_json_response_size(limits.max_message_bytes)
            .max_sse_event_size(limits.max_message_bytes);
        let transport = StreamableHttpClientTransport::with_client(http, config);
        Self::initialize(transport, redactor, limits, None, Arc::default()).await
    }

    /// Initializes a session with a stdio server started by `launcher`. Without a sandbox
    /// ([`sandbox::SandboxUnavailable`]) this fails with [`LaunchError::SandboxUnavailable`];
    /// no process is ever started outside it.
    pub async fn connect_stdio(
        launcher: &dyn SandboxLauncher,
        command: &StdioCommand,
        limits: McpLimits,
    ) -> Result<Self, McpError> {
        let secrets = command.env.iter().map(|(_, value)| {
            use secrecy::ExposeSecret as _;
            value.expose_secret().to_owned()
        });
        let redactor = Arc::new(LiveRedactor::new(Redactor::new(
            secrets.collect::<Vec<_>>(),
        )?));
        let process = tokio::time::timeout(limits.initialize_timeout, launcher.launch(command))
            .await
            .map_err(|_| McpError::Timeout(limits.initialize_timeout))??;
        // A line is one message: held to the limit that holds over HTTP. A longer one ends
        // the session (`line_limit`) before the transport, whose own limit is just above, would
        // drop it and leave its request waiting.
        let oversized = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stdout = line_limit::LineLimited::new(
            process.stdout,
            limits.max_message_bytes,
            oversized.clone(),
        );
        let transport =
            rmcp::transport::async_rw::AsyncRwTransport::new_client(stdout, process.stdin)
                .with_max_line_length(limits.max_message_bytes.saturating_add(2));
        Self::initialize(transport, redactor, limits, Some(process.guard), oversized).await
    }

    async fn initialize<T, E, A>(
        transport: T,
        redactor: Arc<LiveRedactor>,
        limits: McpLimits,
        process: Option<Box<dyn ProcessGuard>>,
        oversized: Arc<std::sync::atomic::AtomicBool>,
    ) -> Result<Self, McpError>
    where
        T: rmcp::transport::IntoTransport<RoleClient, E, A> + Send + 'static,
        E: std::error::Error + Send + Sync + 'static,
    {
        let tools_changed = ToolListChanged::default();
        let handler = WorClientHandler {
            tools_changed: tools_changed.clone(),
        };
        let service = tokio::time::timeout(limits.initialize_timeout, handler.serve(transport))
            .await
            .map_err(|_| McpError::Timeout(limits.initialize_timeout))?
            .map_err(|error| {
                if oversized.load(std::sync::atomic::Ordering::Acquire) {
                    return McpError::MessageTooLarge(limits.max_message_bytes);
                }
                McpError::Initialize(redactor.current().redact(&error.to_string()).into_owned())
            })?;
        Ok(Self {
            service,
            tools_changed,
            limits,
            redactor,
            _process: process,
            oversized,
        })
    }

    /// Set when the server says its tool list changed; the engine then lists and compares.
    pub fn tools_changed(&self) -> &ToolListChanged {
        &self.tools_changed
    }

    /// The session's limits.
    pub fn limits(&self) -> McpLimits {
        self.limits
    }

    fn service_error(&self, error: ServiceError) -> McpError {
        if self.oversized.load(std::sync::atomic::Ordering::Acquire) {
            return McpError::MessageTooLarge(self.limits.max_message_bytes);
        }
        let redactor = self.redactor.current();
        if let Some(failure) = authorization_failure(&error) {
            return failure;
        }
        match error {
            ServiceError::McpError(data) => McpError::Protocol {
                code: data.code.0,
                message: redactor.redact(&data.message).into_owned(),
            },
            ServiceError::Timeout { timeout } => McpError::Timeout(timeout),
            ServiceError::UnexpectedResponse => {
                McpError::UnexpectedResponse("a result of the wrong type")
            }
            other => match guard_refusal(&other) {
                Some(denial) => McpError::Egress(EgressError::Denied(Box::new(denial))),
                None => McpError::Transport(redactor.redact(&other.to_string()).into_owned()),
            },
        }
    }

    /// Every tool the server lists, following `nextCursor` up to
    /// [`McpLimits::max_tool_pages`] pages.
    pub async fn list_tools(&self) -> Result<Vec<ToolDefinition>, McpError> {
        let mut tools = Vec::new();
        let mut bytes = 0usize;
        let mut cursor: Option<String> = None;
        for _ in 0..self.limits.max_tool_pages {
            let params = PaginatedRequestParams::default().with_cursor(cursor.take());
            let request = ClientRequest::ListToolsRequest(ListToolsRequest {
                method: Default::default(),
                params: Some(params),
                extensions: Default::default(),
            });
            let mut options = PeerRequestOptions::no_options();
            options.timeout = Some(self.limits.request_timeout);
            let handle = self
                .service
                .peer()
                .send_request_with_option(request, options)
                .await
                .map_err(|e| self.service_error(e))?;
            let page = match handle
                .await_response()
                .await
                .map_err(|e| self.service_error(e))?
            {
                ServerResult::ListToolsResult(page) => page,
                _ => return Err(McpError::UnexpectedResponse("not a tool list")),
            };
            for tool in page.tools {
                bytes = bytes.saturating_add(
                    serde_json::to_vec(&tool)
                        .map_err(|_| McpError::UnexpectedResponse("unencodable tool definition"))?
                        .len(),
                );
                if bytes > self.limits.max_tool_list_bytes {
                    return Err(McpError::ToolListTooLarge(self.limits.max_tool_list_bytes));
                }
                let annotations = tool
                    .annotations
                    .as_ref()
                    .map(serde_json::to_value)
                    .transpose()
                    .map_err(|_| McpError::UnexpectedResponse("unencodable tool annotations"))?;
                tools.push(ToolDefinition {
                    name: tool.name.into_owned(),
                    description: tool.description.map(|d| d.into_owned()),
                    input_schema: (*tool.input_schema).clone(),
                    annotations,
                });
            }
            match page.next_cursor {
                Some(next) if !next.is_empty() => cursor = Some(next),
                _ => return Ok(tools),
            }
        }
        Err(McpError::TooManyPages(self.limits.max_tool_pages))
    }

    /// Calls `name` with `arguments` (already prepared and validated). A tool failure is
    /// `Ok` with `is_error`; a JSON-RPC error, a transport failure or a timeout is `Err`.
    /// Dropping the future cancels the call on the server.
    pub async fn call_tool(
        &self,
        name: &str,
        arguments: Map<String, Value>,
    ) -> Result<ToolCallResult, McpError> {
        let params = CallToolRequestParams::new(name.to_owned()).with_arguments(arguments);
        let timeout = self.limits.request_timeout;
        let response = tokio::time::timeout(timeout, self.service.peer().call_tool_once(params))
            .await
            .map_err(|_| McpError::Timeout(timeout))?
            .map_err(|e| self.service_error(e))?;
        let result = match response {
            rmcp::model::CallToolResponse::Complete(result) => result,
            _ => {
                return Err(McpError::UnexpectedResponse(
                    "the server asked for input or started a task, which wor does not support",
                ));
            }
        };
        // The session's own secrets out first: a token renewed mid-run is not yet known to
        // the redactor the run applies next.
        let redactor = self.redactor.current();
        let mut content = Vec::new();
        for block in result.content {
            content.push(match block {
                ContentBlock::Text(text) => {
                    ToolContent::Text(redactor.redact(&text.text).into_owned())
                }
                other => {
                    let mut value = serde_json::to_value(&other)
                        .map_err(|_| McpError::UnexpectedResponse("unencodable content"))?;
                    redactor.redact_json(&mut value);
                    ToolContent::Json(value)
                }
            });
        }
        if let Some(mut structured) = result.structured_content {
            redactor.redact_json(&mut structured);
            content.push(ToolContent::Json(structured));
        }
        Ok(ToolCallResult {
            content,
            is_error: result.is_error.unwrap_or(false),
        })
    }

    /// Ends the session (for HTTP, deletes it on the server).
    pub async fn close(mut self) {
        let _ = self
            .service
            .close_with_timeout(Duration::from_secs(5))
            .await;
    }
}
