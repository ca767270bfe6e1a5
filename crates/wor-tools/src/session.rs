//! An open connection to a tool source, whatever its kind: one way to list its tools and call
//! them over MCP, HTTP or a Wasm component.

use std::collections::BTreeMap;

use serde_json::{Map, Value, json};
use wor_wasm::WasmTool;

use crate::{HttpToolError, McpError, McpSession, ToolCallResult, ToolContent, ToolDefinition};

/// An open connection to a tool source: an MCP server, or the configured tools of an HTTP API.
pub enum ToolSession {
    Mcp(McpSession),
    Http {
        connection: Box<crate::HttpApiConnection>,
        tools: BTreeMap<String, crate::HttpToolDefinition>,
        egress: wor_egress::EgressClient,
    },
    /// A Wasm component and the SHA-256 of its file.
    Wasm {
        tool: Box<wor_wasm::WasmTool>,
        digest: String,
    },
}

impl std::fmt::Debug for ToolSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The kind only: a session holds credentials.
        f.write_str(match self {
            ToolSession::Mcp(_) => "ToolSession::Mcp",
            ToolSession::Http { .. } => "ToolSession::Http",
            ToolSession::Wasm { .. } => "ToolSession::Wasm",
        })
    }
}

/// Why a session could not list or call its tools. A tool's own failure is not one of these:
/// it is a result with `is_error`.
#[derive(Debug, thiserror::Error)]
pub enum ToolSessionError {
    #[error(transparent)]
    Mcp(#[from] McpError),
    #[error(transparent)]
    Http(#[from] HttpToolError),
    #[error("no http tool `{0}`")]
    NoSuchTool(String),
    #[error(transparent)]
    Wasm(#[from] wor_wasm::WasmError),
    /// A component listed a tool that is not one (no name, a schema that is not an object).
    #[error("{0}")]
    WasmListing(String),
}

impl ToolSessionError {
    /// Whether the egress guard refused the request the call made (an HTTP tool's request,
    /// or an MCP server's endpoint over streamable HTTP).
    pub fn egress_refused(&self) -> bool {
        matches!(
            self,
            ToolSessionError::Mcp(McpError::Egress(wor_egress::EgressError::Denied(_)))
                | ToolSessionError::Http(HttpToolError::Egress(wor_egress::EgressError::Denied(_)))
        )
    }
}

impl ToolSession {
    /// The live tool list: what the MCP server lists, or the configured HTTP tools.
    pub async fn list_tools(&self) -> Result<Vec<ToolDefinition>, ToolSessionError> {
        match self {
            ToolSession::Mcp(session) => Ok(session.list_tools().await?),
            ToolSession::Http { tools, .. } => {
                Ok(tools.values().map(|t| t.tool_definition()).collect())
            }
            ToolSession::Wasm { tool, digest } => list_wasm_tools(tool, digest).await,
        }
    }

    /// Calls `tool`; a tool's own failure is `Ok` with `is_error`, anything else `Err`.
    pub async fn call_tool(
        &self,
        tool: &str,
        arguments: serde_json::Map<String, Value>,
    ) -> Result<ToolCallResult, ToolSessionError> {
        match self {
            ToolSession::Mcp(session) => Ok(session.call_tool(tool, arguments).await?),
            ToolSession::Http {
                connection,
                tools,
                egress,
            } => {
                let definition = tools
                    .get(tool)
                    .ok_or_else(|| ToolSessionError::NoSuchTool(tool.to_owned()))?;
                Ok(definition.execute(egress, connection, &arguments).await?)
            }
            ToolSession::Wasm { tool: wasm, .. } => call_wasm_tool(wasm, tool, arguments).await,
        }
    }

    /// Whether the server announced a changed tool list since the last look (never, for HTTP
    /// tools: their list is configuration).
    pub fn take_tools_changed(&self) -> bool {
        match self {
            ToolSession::Mcp(session) => session.tools_changed().take(),
            ToolSession::Http { .. } | ToolSession::Wasm { .. } => false,
        }
    }

    pub async fn close(self) {
        if let ToolSession::Mcp(session) = self {
            session.close().await;
        }
    }
}

/// The tools a component lists, as definitions carrying the component's digest.
async fn list_wasm_tools(
    tool: &WasmTool,
    digest: &str,
) -> Result<Vec<ToolDefinition>, ToolSessionError> {
    let listed = tool.list_tools().await?;
    listed
        .into_iter()
        .map(|entry| {
            let name = entry
                .get("name")
                .and_then(Value::as_str)
                .filter(|n| !n.is_empty())
                .ok_or_else(|| {
                    ToolSessionError::WasmListing("a listed tool has no name".to_owned())
                })?
                .to_owned();
            let input_schema = match entry.get("input_schema") {
                None => Map::from_iter([("type".to_owned(), json!("object"))]),
                Some(Value::Object(schema)) => schema.clone(),
                Some(_) => {
                    return Err(ToolSessionError::WasmListing(format!(
                        "the input schema of tool `{name}` is not an object"
                    )));
                }
            };
            Ok(ToolDefinition {
                name,
                description: entry
                    .get("description")
                    .and_then(Value::as_str)
                    .map(str::to_owned),
                input_schema,
                annotations: Some(json!({ "component_sha256": digest })),
            })
        })
        .collect()
}

/// Calls one tool of a component: its own error is a result with `is_error`.
async fn call_wasm_tool(
    tool: &WasmTool,
    name: &str,
    arguments: Map<String, Value>,
) -> Result<ToolCallResult, ToolSessionError> {
    match tool.call_tool(name, &Value::Object(arguments)).await {
        Ok(Ok(text)) => Ok(ToolCallResult {
            content: vec![ToolContent::Text(text)],
            is_error: false,
        }),
        Ok(Err(text)) => Ok(ToolCallResult {
            content: vec![ToolContent::Text(text)],
            is_error: true,
        }),
        Err(error) => Err(error.into()),
    }
}
