//! Against the reference MCP server, `@modelcontextprotocol/server-everything`, run with node
//! in streamable HTTP mode on a loopback port. `.ci/mcp-servers.sh` installs it; these tests
//! fail (never skip) when node or the package is missing.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use wor_core::routine::{RosterEntry, ToolMode};
use wor_tools::{
    ConnectionCredentials, McpError, McpLimits, McpSession, ResultLimits, ShapedResult,
    StreamableHttpEndpoint, ToolContent, ToolListVerdict, compare, model_view, pin_all,
    prepare_arguments,
};

use crate::{allow, loopback_egress};

/// Where `.ci/mcp-servers.sh` installs the server's entry point.
const ENV_EVERYTHING: &str = "WOR_MCP_EVERYTHING";

fn everything_entry_point() -> PathBuf {
    let path = std::env::var_os(ENV_EVERYTHING)
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME").map(|home| {
                PathBuf::from(home).join(".cache/wor-npm/node_modules/.bin/mcp-server-everything")
            })
        })
        .expect("neither WOR_MCP_EVERYTHING nor HOME is set");
    assert!(
        path.exists(),
        "the reference MCP server is not installed at `{}`: run `.ci/mcp-servers.sh` (needs node \
         and npm) or set {ENV_EVERYTHING} to its `mcp-server-everything` entry point",
        path.display()
    );
    let node = std::process::Command::new("node").arg("--version").output();
    assert!(
        node.is_ok_and(|out| out.status.success()),
        "`node` is needed to run the reference MCP server and was not found on PATH"
    );
    path
}

/// A running `server-everything`; killed on drop.
struct Everything {
    child: Child,
    addr: SocketAddr,
}

impl Everything {
    async fn start() -> Self {
        let entry = everything_entry_point();
        // A free port: bound, read, released, handed to the server.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut child = Command::new("node")
            .arg(&entry)
            .arg("streamableHttp")
            .env("PORT", port.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("could not start node");
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let ready = tokio::time::timeout(Duration::from_secs(30), async {
            while let Some(line) = lines.next_line().await.unwrap() {
                if line.contains("listening on port") {
                    return true;
                }
            }
            false
        })
        .await;
        assert!(
            matches!(ready, Ok(true)),
            "server-everything did not start listening on port {port}"
        );
        // Keep draining its stderr so it never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Self {
            child,
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
        }
    }

    async fn session(&self) -> McpSession {
        let endpoint = StreamableHttpEndpoint {
            url: format!("http://{}/mcp", self.addr),
            allowlist: allow(self.addr),
            credentials: ConnectionCredentials::none(),
        };
        McpSession::connect_http(&loopback_egress(), endpoint, McpLimits::default())
            .await
            .unwrap()
    }
}

fn object(value: Value) -> serde_json::Map<String, Value> {
    value.as_object().unwrap().clone()
}

#[tokio::test]
async fn lists_pins_and_calls_echo() {
    let server = Everything::start().await;
    let session = server.session().await;

    let tools = session.list_tools().await.unwrap();
    let echo = tools
        .iter()
        .find(|t| t.name == "echo")
        .expect("no echo tool");
    assert_eq!(
        echo.description.as_deref(),
        Some("Echoes back the input string")
    );
    assert_eq!(echo.input_schema["properties"]["message"]["type"], "string");
    assert_eq!(echo.annotations.as_ref().unwrap()["readOnlyHint"], true);
    assert!(tools.len() > 5, "{tools:?}");

    // Pinned, then listed again: nothing changed.
    let pins = pin_all(tools);
    let again = session.list_tools().await.unwrap();
    assert_eq!(compare(&pins, &again).verdict(), ToolListVerdict::Unchanged);

    let result = session
        .call_tool("echo", object(json!({"message": "hello"})))
        .await
        .unwrap();
    assert!(!result.is_error);
    assert_eq!(result.content, [ToolContent::Text("Echo: hello".into())]);
    session.close().await;
}

#[tokio::test]
async fn tool_errors_are_results_transport_failures_are_errors() {
    let mut server = Everything::start().await;
    let session = server.session().await;

    // Wrong argument type: the tool reports it, the protocol worked.
    let bad_arguments = session
        .call_tool("echo", object(json!({"message": 5})))
        .await
        .unwrap();
    assert!(bad_arguments.is_error, "{bad_arguments:?}");

    let unknown = session
        .call_tool("no_such_tool", Default::default())
        .await
        .unwrap();
    assert!(unknown.is_error, "{unknown:?}");

    // The server goes away: that is an error, not a tool result.
    server.child.kill().await.unwrap();
    let gone = session
        .call_tool("echo", object(json!({"message": "x"})))
        .await
        .unwrap_err();
    assert!(
        matches!(gone, McpError::Transport(_) | McpError::Timeout(_)),
        "{gone:?}"
    );
}

#[tokio::test]
async fn pinned_arguments_win_from_roster_to_result() {
    let server = Everything::start().await;
    let session = server.session().await;
    let pins = pin_all(session.list_tools().await.unwrap());
    let echo = pins.iter().find(|p| p.name() == "echo").unwrap();
    let entry = RosterEntry {
        tool: "echo".into(),
        mode: ToolMode::Auto,
        pinned: object(json!({"message": "the author's words"}))
            .into_iter()
            .collect(),
    };

    let view = model_view(echo, &entry);
    assert_eq!(view.input_schema["properties"], json!({}));
    assert!(
        view.input_schema
            .get("required")
            .and_then(Value::as_array)
            .is_none_or(|r| r.is_empty())
    );

    let prepared = prepare_arguments(
        &json!({"message": "the model's words"}),
        &entry,
        &echo.input_schema(),
    )
    .unwrap();
    assert_eq!(prepared.pinned_keys, ["message"]);
    let result = session.call_tool("echo", prepared.value).await.unwrap();
    let redactor = wor_secrets::Redactor::new(Vec::<String>::new()).unwrap();
    let out = ShapedResult::new(&result, &redactor, ResultLimits::default());
    assert_eq!(out.text, "Echo: the author's words");
}
