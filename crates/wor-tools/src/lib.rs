//! Tool library of Work on Repeat: what a tool is, how its definition is pinned, how it is
//! called, and what comes back.
//!
//! - [`definition`]: [`ToolDefinition`], its pin ([`PinnedToolDefinition`], SHA-256 over
//!   canonical JSON) and [`compare`], which turns a changed tool list into a quarantine.
//! - [`roster`]: a routine's [`RosterEntry`]s, what the model is shown ([`model_view`]) and the
//!   arguments actually sent ([`prepare_arguments`]: pinned values forced in, then validated
//!   against the pinned schema, no remote `$ref`).
//! - [`mcp`]: the MCP client ([`McpSession`]) over streamable HTTP through the egress guard,
//!   or over stdio through a [`SandboxLauncher`].
//! - [`http_tool`]: HTTP API tools, a method and a path template on an allowlisted host.
//! - [`openapi`]: chosen operations of an OpenAPI 3.0/3.1 document as HTTP tools.
//! - [`oauth`]: MCP authorization discovery (RFC 9728, RFC 8414) and the PKCE authorization
//!   request, every document fetched through the egress guard.
//! - [`result`]: [`ShapedResult`], redacted and capped (always untrusted).
//! - [`credentials`]: a connection's secret headers, attached only at send time.
//! - [`output`]: a routine's output schema and the check of a final answer against it.
//!
//! This crate never opens a socket itself (all HTTP goes through `wor_egress::EgressClient`),
//! never spawns a process (stdio servers start only through a sandbox launcher), and never
//! puts a credential in a `Debug` output, an error or a result.

pub mod credentials;
pub mod definition;
pub mod http_tool;
pub mod mcp;
pub mod oauth;
pub mod openapi;
pub mod output;
pub mod result;
pub mod roster;
pub mod session;

pub use credentials::{BearerRenewal, BearerRenewalError, ConnectionCredentials, CredentialError};
pub use definition::{
    Change, ChangedTool, Difference, PinError, PinnedToolDefinition, ToolDefinition, ToolListDiff,
    ToolListVerdict, compare, pin_all,
};
pub use http_tool::{
    HttpApiConnection, HttpToolConfig, HttpToolDefinition, HttpToolError, MAX_HTTP_TOOLS,
    PathTemplate, is_valid_tool_name,
};
pub use mcp::egress_http::McpHttpError;
pub use mcp::sandbox::{
    LaunchError, LaunchFuture, LaunchedProcess, ProcessGuard, SandboxLauncher, SandboxUnavailable,
    StdioCommand,
};
pub use mcp::sandboxed::Sandboxed;
pub use mcp::{
    McpError, McpLimits, McpServerKind, McpSession, StreamableHttpEndpoint, ToolListChanged,
};
pub use openapi::{
    CredentialSlot, ImportedOperation, OpenApiDocument, OpenApiError, OpenApiImport,
};
pub use output::{OutputSchema, OutputSchemaError, OutputViolation};
pub use result::{ResultLimits, ShapedResult, ToolCallResult, ToolContent, Truncation};
pub use roster::{
    ArgumentError, ArgumentSchema, CanonicalArguments, InputSchemaError, ModelToolSpec,
    SchemaViolation, check_input_schema, model_view, prepare_arguments,
};
pub use session::{ToolSession, ToolSessionError};
