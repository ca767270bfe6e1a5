//! Fuzzing what an MCP server can send back, with proptest: arbitrary and deeply nested
//! JSON-RPC messages and tool results, as JSON bodies and as server-sent events, through the
//! real client (`McpSession` over the egress client) and then `ShapedResult::new`, which
//! redacts, caps and labels them. Nothing panics (also not in the client's background tasks),
//! nothing overflows a 2 MiB stack, oversized messages are refused, and every result that
//! comes through is within its cap, free of the connection's secret and labelled untrusted.
//!
//! The server here is not an MCP implementation but a scripted HTTP endpoint: it answers the
//! handshake properly and then whatever the test tells it to, byte for byte.

use std::cell::RefCell;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use secrecy::SecretString;
use serde_json::{Value, json};
use wor_secrets::Redactor;
use wor_tools::{
    ConnectionCredentials, McpLimits, McpSession, ResultLimits, ShapedResult,
    StreamableHttpEndpoint, compare, pin_all,
};

use crate::{allow, loopback_egress};

/// The connection's secret: it must never come out of a result.
const SECRET: &str = "tok-live-fuzz-5e1f0a9b8c7d";
/// Largest message the client accepts in these tests.
const MAX_MESSAGE: usize = 64 * 1024;

/// What the scripted server answers to the next `tools/call` or `tools/list`.
#[derive(Debug, Clone)]
enum Reply {
    /// `{"jsonrpc":"2.0","id":ID,"result":TEXT}`, TEXT as given (it need not be valid JSON).
    Result(String),
    /// This whole body as `application/json`, `{ID}` replaced by the request's id.
    Json(String),
    /// A server-sent event stream: one event whose data is the result message of `Result`.
    Sse(String),
    /// These bytes with this content type.
    Bytes(&'static str, Vec<u8>),
}

#[derive(Debug)]
struct Script {
    reply: Mutex<Reply>,
}

fn json_response(body: String) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        body,
    )
        .into_response()
}

async fn scripted(State(script): State<Arc<Script>>, body: Bytes) -> Response {
    let Ok(request) = serde_json::from_slice::<Value>(&body) else {
        return StatusCode::BAD_REQUEST.into_response();
    };
    let Some(id) = request.get("id").cloned() else {
        // A notification (`notifications/initialized`, a cancellation).
        return StatusCode::ACCEPTED.into_response();
    };
    if request["method"] == "initialize" {
        let version = request["params"]["protocolVersion"].clone();
        return json_response(
            json!({"jsonrpc": "2.0", "id": id, "result": {"protocolVersion": version,
                "capabilities": {"tools": {}}, "serverInfo": {"name": "fuzz", "version": "0"}}})
            .to_string(),
        );
    }
    let reply = script.reply.lock().unwrap().clone();
    let message = |result: &str| format!(r#"{{"jsonrpc":"2.0","id":{id},"result":{result}}}"#);
    match reply {
        Reply::Result(result) => json_response(message(&result)),
        Reply::Json(body) => json_response(body.replace("{ID}", &id.to_string())),
        Reply::Sse(result) => (
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/event-stream"),
            )],
            format!("event: message\ndata: {}\n\n", message(&result)),
        )
            .into_response(),
        Reply::Bytes(content_type, bytes) => (
            [(header::CONTENT_TYPE, HeaderValue::from_static(content_type))],
            bytes,
        )
            .into_response(),
    }
}

/// The scripted server on its own runtime and threads, so a client on a small stack runs
/// only the client's code.
fn start_server(script: Arc<Script>) -> SocketAddr {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async move {
            let router = axum::Router::new()
                .route(
                    "/mcp",
                    axum::routing::post(scripted).get(|| async { StatusCode::METHOD_NOT_ALLOWED }),
                )
                .with_state(script);
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            tx.send(listener.local_addr().unwrap()).unwrap();
            axum::serve(crate::sending_at_once(listener), router)
                .await
                .unwrap();
        });
    });
    rx.recv().unwrap()
}

fn limits() -> McpLimits {
    McpLimits {
        initialize_timeout: Duration::from_secs(5),
        request_timeout: Duration::from_secs(5),
        max_message_bytes: MAX_MESSAGE,
        max_tool_pages: 3,
        max_tool_list_bytes: MAX_MESSAGE,
    }
}

async fn connect(addr: SocketAddr) -> McpSession {
    let endpoint = StreamableHttpEndpoint {
        url: format!("http://{addr}/mcp"),
        allowlist: allow(addr),
        credentials: ConnectionCredentials::bearer(SecretString::from(SECRET)).unwrap(),
    };
    McpSession::connect_http(&loopback_egress(), endpoint, limits())
        .await
        .unwrap()
}

/// Panics anywhere in the process, the client's spawned tasks included (tokio would turn
/// those into a closed transport, which looks like an ordinary error).
static PANICS: AtomicUsize = AtomicUsize::new(0);

fn count_panics() {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            PANICS.fetch_add(1, Ordering::SeqCst);
            default(info);
        }));
    });
}

/// A client on a thread with a 2 MiB stack (a tokio worker's default), with its own
/// current-thread runtime, talking to a scripted server.
struct Fuzzer {
    script: Arc<Script>,
    addr: SocketAddr,
    runtime: tokio::runtime::Runtime,
    session: Option<McpSession>,
}

impl Fuzzer {
    fn new() -> Self {
        count_panics();
        let script = Arc::new(Script {
            reply: Mutex::new(Reply::Result("{}".into())),
        });
        let addr = start_server(script.clone());
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        Fuzzer {
            script,
            addr,
            runtime,
            session: None,
        }
    }

    /// Calls a tool with `reply` scripted; a failed call drops the session (the next call
    /// connects again).
    fn call(&mut self, reply: Reply) -> Result<wor_tools::ToolCallResult, wor_tools::McpError> {
        *self.script.reply.lock().unwrap() = reply;
        let addr = self.addr;
        let session = match self.session.take() {
            Some(session) => session,
            None => self.runtime.block_on(connect(addr)),
        };
        let result = self
            .runtime
            .block_on(session.call_tool("echo", Default::default()));
        if result.is_ok() {
            self.session = Some(session);
        } else {
            self.runtime.block_on(session.close());
        }
        result
    }

    fn list(
        &mut self,
        reply: Reply,
    ) -> Result<Vec<wor_tools::ToolDefinition>, wor_tools::McpError> {
        *self.script.reply.lock().unwrap() = reply;
        let addr = self.addr;
        self.runtime.block_on(async move {
            let session = connect(addr).await;
            let listed = session.list_tools().await;
            session.close().await;
            listed
        })
    }
}

/// Runs `body` on a thread with a 2 MiB stack and returns what it returned; a stack overflow
/// aborts the whole test binary, which fails the test.
fn on_small_stack<T: Send + 'static>(body: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::Builder::new()
        .name("small-stack".into())
        .stack_size(2 * 1024 * 1024)
        .spawn(body)
        .unwrap()
        .join()
        .unwrap()
}

/// What every result that comes through must be once it is made ready for the model.
fn check_result(result: &wor_tools::ToolCallResult, max_bytes: usize) -> Result<(), TestCaseError> {
    let redactor = Redactor::new([SECRET]).unwrap();
    let ready = ShapedResult::new(result, &redactor, ResultLimits { max_bytes });
    prop_assert!(
        ready.text.len() <= max_bytes,
        "{} bytes of result text against a cap of {max_bytes}",
        ready.text.len()
    );
    prop_assert!(
        !ready.text.contains(SECRET),
        "the secret came through: {}",
        ready.text
    );
    prop_assert_eq!(ready.is_error, result.is_error);
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Generators

fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => any::<String>(),
        1 => (any::<String>(), any::<String>()).prop_map(|(a, b)| format!("{a}{SECRET}{b}")),
        1 => (0usize..12_000).prop_map(|n| format!("{}{SECRET}", "é".repeat(n))),
    ]
}

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_map(Value::from),
        text().prop_map(Value::from),
    ];
    leaf.prop_recursive(6, 64, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::from),
            prop::collection::btree_map(text(), inner, 0..6)
                .prop_map(|map| Value::Object(map.into_iter().collect())),
        ]
    })
}

fn content_block() -> impl Strategy<Value = Value> {
    prop_oneof![
        4 => text().prop_map(|text| json!({"type": "text", "text": text})),
        1 => (text(), text()).prop_map(|(data, mime)| json!({"type": "image", "data": data, "mimeType": mime})),
        1 => (text(), text()).prop_map(|(uri, text)| json!({"type": "resource", "resource": {"uri": uri, "text": text}})),
        1 => (text(), text()).prop_map(|(uri, name)| json!({"type": "resource_link", "uri": uri, "name": name})),
        1 => json_value(),
    ]
}

fn tool_result() -> impl Strategy<Value = Value> {
    (
        prop::collection::vec(content_block(), 0..5),
        prop::option::of(json_value()),
        prop::option::of(any::<bool>()),
        prop::option::of(json_value()),
    )
        .prop_map(|(content, structured, is_error, extra)| {
            let mut result = json!({"content": content});
            if let Some(structured) = structured {
                result["structuredContent"] = structured;
            }
            if let Some(is_error) = is_error {
                result["isError"] = json!(is_error);
            }
            if let Some(extra) = extra {
                result["_meta"] = extra;
            }
            result
        })
}

fn reply() -> impl Strategy<Value = Reply> {
    prop_oneof![
        6 => tool_result().prop_map(|r| Reply::Result(r.to_string())),
        2 => tool_result().prop_map(|r| Reply::Sse(r.to_string())),
        1 => json_value().prop_map(|v| Reply::Result(v.to_string())),
        1 => json_value().prop_map(|v| Reply::Json(v.to_string())),
        1 => any::<String>().prop_map(Reply::Result),
        1 => prop::collection::vec(any::<u8>(), 0..512)
            .prop_map(|b| Reply::Bytes("application/json", b)),
        1 => prop::collection::vec(any::<u8>(), 0..512)
            .prop_map(|b| Reply::Bytes("text/event-stream", b)),
        1 => "(event: [a-z]{0,8}\n)?(id: [0-9]{0,3}\n)?(data: [{}\\[\\]\"a-z0-9:,]{0,40}\n){0,3}\n?"
            .prop_map(|sse| Reply::Bytes("text/event-stream", sse.into_bytes())),
        1 => tool_result().prop_map(|r| Reply::Json(format!(
            r#"{{"jsonrpc":"2.0","id":{{ID}},"error":{{"code":-32000,"message":"failed with {SECRET}","data":{r}}}}}"#
        ))),
    ]
}

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// Arbitrary answers to `tools/call`: the client answers with a result or an error, never a
/// panic; results are capped, redacted and labelled; a message past the size limit is refused.
#[test]
fn arbitrary_tool_call_answers_are_refused_or_capped_redacted_and_labelled() {
    on_small_stack(|| {
        let fuzzer = RefCell::new(Fuzzer::new());
        let mut runner = proptest::test_runner::TestRunner::new(config(128));
        runner
            .run(&(reply(), 0usize..8192), |(reply, max_bytes)| {
                let size = match &reply {
                    Reply::Result(r) | Reply::Sse(r) => r.len(),
                    Reply::Json(b) => b.len(),
                    Reply::Bytes(_, b) => b.len(),
                };
                let before = PANICS.load(Ordering::SeqCst);
                let answer = fuzzer.borrow_mut().call(reply);
                prop_assert_eq!(PANICS.load(Ordering::SeqCst), before, "the client panicked");
                match answer {
                    Ok(result) => {
                        prop_assert!(size <= MAX_MESSAGE, "a {size}-byte message was accepted");
                        check_result(&result, max_bytes)?;
                    }
                    Err(error) => {
                        prop_assert!(
                            !error.to_string().contains(SECRET),
                            "the secret came through an error: {error}"
                        );
                    }
                }
                Ok(())
            })
            .unwrap();
    });
}

/// Arbitrary tool lists: listing, pinning and comparing them never panics.
#[test]
fn arbitrary_tool_lists_are_refused_or_pinned() {
    on_small_stack(|| {
        let fuzzer = RefCell::new(Fuzzer::new());
        let tool = (
            text(),
            prop::option::of(text()),
            json_value(),
            prop::option::of(json_value()),
        )
            .prop_map(|(name, description, schema, annotations)| {
                json!({"name": name, "description": description,
                    "inputSchema": {"type": "object", "properties": {"x": schema}},
                    "annotations": annotations})
            });
        let list = prop::collection::vec(tool, 0..4)
            .prop_map(|tools| Reply::Result(json!({"tools": tools}).to_string()));
        let mut runner = proptest::test_runner::TestRunner::new(config(32));
        runner
            .run(&list, |reply| {
                let before = PANICS.load(Ordering::SeqCst);
                if let Ok(tools) = fuzzer.borrow_mut().list(reply) {
                    let pins = pin_all(tools.clone());
                    let _ = compare(&pins, &tools).verdict();
                }
                prop_assert_eq!(PANICS.load(Ordering::SeqCst), before, "the client panicked");
                Ok(())
            })
            .unwrap();
    });
}

/// `depth` nested arrays (`[[[…]]]`) or objects (`{"a":{"a":…}}`) around `inner`.
fn nested(depth: usize, objects: bool, inner: &str) -> String {
    if objects {
        format!("{}{inner}{}", r#"{"a":"#.repeat(depth), "}".repeat(depth))
    } else {
        format!("{}{inner}{}", "[".repeat(depth), "]".repeat(depth))
    }
}

/// 100,000 levels of nesting in every place a server can put them — the whole message, the
/// result, a content block, the structured content, a tool's schema — as JSON and as an
/// event: refused or read, on a 2 MiB stack, never a stack overflow or a panic. Nesting just
/// under the parser's limit comes through and is rendered, redacted and capped.
#[test]
fn deeply_nested_messages_do_not_overflow_a_small_stack() {
    on_small_stack(|| {
        let mut fuzzer = Fuzzer::new();
        let mut limits = fuzzer_limits();
        for depth in [100_000, 1_000, 127, 100] {
            for objects in [false, true] {
                let deep = nested(depth, objects, "1");
                let replies = [
                    Reply::Json(nested(
                        depth,
                        objects,
                        r#"{"jsonrpc":"2.0","id":{ID},"result":{}}"#,
                    )),
                    Reply::Result(deep.clone()),
                    Reply::Result(json_with("content", &format!("[{deep}]"))),
                    Reply::Result(json_with("structuredContent", &deep)),
                    Reply::Sse(json_with("structuredContent", &deep)),
                    Reply::Result(format!(
                        r#"{{"content":[{{"type":"text","text":"{SECRET}"}}],"structuredContent":{deep}}}"#
                    )),
                ];
                let mut read = 0;
                for reply in replies {
                    let shown = format!("{reply:?}").chars().take(120).collect::<String>();
                    match fuzzer.call(reply) {
                        Ok(result) => {
                            read += 1;
                            check_result(&result, limits.next().unwrap())
                                .unwrap_or_else(|e| panic!("{shown}: {e}"));
                        }
                        Err(error) => assert!(!error.to_string().contains(SECRET), "{error}"),
                    }
                }
                if depth == 100 {
                    // The structured content, as JSON and as an event, and next to a secret.
                    assert_eq!(read, 3, "100 levels of structured content should be read");
                }
                let schema = format!(
                    r#"{{"tools":[{{"name":"deep","inputSchema":{{"type":"object","properties":{{"x":{deep}}}}}}}]}}"#
                );
                if let Ok(tools) = fuzzer.list(Reply::Result(schema)) {
                    let pins = pin_all(tools.clone());
                    let _ = compare(&pins, &tools).verdict();
                }
            }
        }
        assert_eq!(PANICS.load(Ordering::SeqCst), 0, "the client panicked");
    });
}

fn json_with(field: &str, value: &str) -> String {
    format!(r#"{{"content":[],"{field}":{value}}}"#)
}

/// Caps to check results against: small ones (below the truncation marker's length), the
/// default, and between.
fn fuzzer_limits() -> impl Iterator<Item = usize> {
    [0, 1, 10, 80, 200, 4096, ResultLimits::default().max_bytes]
        .into_iter()
        .cycle()
}

/// A message over the size limit is refused whole, as a body and as an event.
#[test]
fn messages_over_the_size_limit_are_refused() {
    on_small_stack(|| {
        let mut fuzzer = Fuzzer::new();
        let big = format!(
            r#"{{"content":[{{"type":"text","text":"{}"}}]}}"#,
            "x".repeat(MAX_MESSAGE)
        );
        for reply in [Reply::Result(big.clone()), Reply::Sse(big)] {
            let answer = fuzzer.call(reply);
            assert!(answer.is_err(), "{answer:?}");
        }
    });
}
