//! What the MCP client adds to one tool call: `McpSession::call_tool` against a loopback rmcp
//! server that answers at once, beside the same `tools/call` sent as one plain POST through
//! the same egress client (vetting included), measured in the same run. The server answers
//! in plain JSON (stateless) and, in two more rounds, over a session with server-sent events:
//! from a server that sends each write at once, and from one that leaves Nagle's algorithm on.
//!
//! Run: `cargo bench -p wor-tools --bench mcp_call`
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stdout,
    clippy::indexing_slicing,
    reason = "a benchmark reports on stdout and fails loudly"
)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rmcp::ServerHandler;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, ErrorData,
    InitializeResult, ListToolsResult, PaginatedRequestParams, ServerCapabilities, Tool,
};
use rmcp::service::{RequestContext, RoleServer};
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use serde_json::{Map, json};
use wor_egress::{EgressClient, EgressRequest, HostAllowlist};
use wor_tools::{ConnectionCredentials, McpLimits, McpSession, StreamableHttpEndpoint};

const ROUNDS: usize = 2_000;
/// Calls to a server with Nagle's algorithm on, each about 40 ms.
const SLOW_ROUNDS: usize = 100;

#[derive(Clone, Default)]
struct Echo;

impl ServerHandler for Echo {
    fn get_info(&self) -> InitializeResult {
        InitializeResult::new(ServerCapabilities::builder().enable_tools().build())
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        let schema = json!({"type": "object", "properties": {"text": {"type": "string"}}});
        Ok(ListToolsResult::with_all_items(vec![Tool::new(
            "echo",
            "Echoes.",
            Arc::new(schema.as_object().unwrap().clone()),
        )]))
    }

    async fn call_tool(
        &self,
        _request: CallToolRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        Ok(CallToolResult::success(vec![ContentBlock::text("#1#")]).into())
    }
}

/// The echo server on a fresh loopback port; `at_once` has its connections send each write
/// at once (`TCP_NODELAY`), as `wor`'s own servers do.
async fn serve(config: StreamableHttpServerConfig, at_once: bool) -> SocketAddr {
    use axum::serve::ListenerExt as _;
    let service = StreamableHttpService::new(
        || Ok(Echo),
        Arc::new(LocalSessionManager::default()),
        config,
    );
    let app = axum::Router::new().nest_service("/mcp", service);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let listener = listener.tap_io(move |connection: &mut tokio::net::TcpStream| {
        connection.set_nodelay(at_once).unwrap();
    });
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

fn percentile(samples: &mut [Duration], p: f64) -> Duration {
    samples.sort_unstable();
    let index = ((samples.len() as f64 - 1.0) * p).round() as usize;
    samples[index]
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

async fn round(
    label: &str,
    config: StreamableHttpServerConfig,
    stateless: bool,
    at_once: bool,
    rounds: usize,
) {
    let addr = serve(config, at_once).await;
    let url = format!("http://{addr}/mcp");
    let allowlist = HostAllowlist::parse([addr.to_string()]).unwrap();
    let egress: EgressClient = wor_egress::testing::loopback_egress();
    let endpoint = StreamableHttpEndpoint {
        url: url.clone(),
        allowlist: allowlist.clone(),
        credentials: ConnectionCredentials::none(),
    };
    let session = McpSession::connect_http(&egress, endpoint, McpLimits::default())
        .await
        .unwrap();
    session.list_tools().await.unwrap();
    let arguments: Map<String, serde_json::Value> =
        json!({"text": "hi"}).as_object().unwrap().clone();
    let body = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
        "params": {"name": "echo", "arguments": {"text": "hi"}}})
    .to_string()
    .into_bytes();

    let warm_up = rounds / 10;
    let mut direct = Vec::with_capacity(rounds);
    let mut through = Vec::with_capacity(rounds);
    for i in 0..rounds + warm_up {
        // Alternating, so both meet the machine in the same state.
        let started = Instant::now();
        if stateless {
            let mut request = EgressRequest::post(&url, body.clone()).with_allowlist(&allowlist);
            request.headers.insert(
                "accept",
                "application/json, text/event-stream".parse().unwrap(),
            );
            request
                .headers
                .insert("content-type", "application/json".parse().unwrap());
            let response = egress.send(request).await.unwrap();
            assert!(response.body.windows(3).any(|w| w == b"#1#"));
        }
        let direct_took = started.elapsed();
        let started = Instant::now();
        let result = session.call_tool("echo", arguments.clone()).await.unwrap();
        assert!(!result.is_error);
        let through_took = started.elapsed();
        if i >= warm_up {
            direct.push(direct_took);
            through.push(through_took);
        }
    }
    let (d50, d99) = (percentile(&mut direct, 0.5), percentile(&mut direct, 0.99));
    let (t50, t99) = (
        percentile(&mut through, 0.5),
        percentile(&mut through, 0.99),
    );
    if stateless {
        println!(
            "{label:<9} plain POST p50 {:.1}µs p99 {:.1}µs | McpSession::call_tool p50 {:.1}µs \
             p99 {:.1}µs | added p50 +{:.1}µs ({rounds} calls each)",
            us(d50),
            us(d99),
            us(t50),
            us(t99),
            us(t50) - us(d50)
        );
    } else {
        println!(
            "{label:<9} McpSession::call_tool p50 {:.1}µs p99 {:.1}µs ({rounds} calls)",
            us(t50),
            us(t99)
        );
    }
}

#[tokio::main]
async fn main() {
    let stateless = || {
        StreamableHttpServerConfig::default()
            .with_legacy_session_mode(false)
            .with_json_response(true)
    };
    round("stateless", stateless(), true, true, ROUNDS).await;
    round(
        "session",
        StreamableHttpServerConfig::default(),
        false,
        true,
        ROUNDS,
    )
    .await;
    // A server that leaves Nagle's algorithm on: its answer's event waits for the client's
    // delayed acknowledgement of the headers written before it.
    round(
        "session, server with Nagle on",
        StreamableHttpServerConfig::default(),
        false,
        false,
        SLOW_ROUNDS,
    )
    .await;
}
