//! Wasm tool connections end to end, through the API and the engine: the probe component
//! (`crates/wor-wasm/guest`, built by `.ci/wasm-fixtures.sh`) is created, reviewed, enabled
//! and called by a routine; its HTTP goes through the egress guard; replacing its file
//! quarantines it.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic,
    reason = "tests fail loudly"
)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::http::{Method, StatusCode};
use serde_json::{Value, json};

mod common;

use common::{Harness, serve, steps_of};

const SECRET: &str = "probe-secret-0123456789abcdef";

fn routine(addr: std::net::SocketAddr) -> String {
    format!(
        r#"
name = "wasm-probe"
instructions = "Use the probe."
[budget]
turns = 6
[model]
provider = "replay"
model = "m"
[[model.script.turns]]
when = {{ last_tool_result_contains = "200 hello" }}
tool_calls = [{{ name = "probe__echo", arguments = {{ text = "wasm-said-hi" }} }}]
[[model.script.turns]]
when = {{ last_tool_result_contains = "wasm-said-hi" }}
tool_calls = [{{ name = "probe__env", arguments = {{ name = "PROBE_GIVEN" }} }}]
[[model.script.turns]]
when = {{ last_tool_result_contains = "[REDACTED]" }}
text = "done"
[[model.script.turns]]
tool_calls = [{{ name = "probe__fetch", arguments = {{ url = "http://{addr}/page" }} }}]
[[tools]]
tool = "probe/fetch"
mode = "auto"
[[tools]]
tool = "probe/echo"
mode = "auto"
[[tools]]
tool = "probe/env"
mode = "auto"
"#
    )
}

#[tokio::test]
async fn a_wasm_component_runs_as_a_tool_connection_pinned_to_its_file() {
    let root = tempfile::tempdir().unwrap();
    let component = root.path().join("probe.wasm");
    std::fs::copy(wor_wasm::testing::probe_component(), &component).unwrap();
    let h = Harness::with_config(wor_engine::EngineConfig {
        stdio_allowed_roots: vec![root.path().to_owned()],
        ..wor_engine::EngineConfig::default()
    })
    .await;
    let hits = Arc::new(AtomicUsize::new(0));
    let counter = hits.clone();
    let addr = serve(axum::Router::new().fallback(move || {
        let counter = counter.clone();
        async move {
            counter.fetch_add(1, Ordering::SeqCst);
            "hello"
        }
    }))
    .await;
    let create = |body: Value| h.call(Method::POST, "/v1/tool-connections", Some(body));

    // Refused shapes: a component outside the operator's roots, arguments, a file as a
    // read-only directory, credentials other than the environment.
    let program = component.to_str().unwrap();
    for (body, code) in [
        (
            json!({"name": "probe", "kind": "wasm", "command": {"program": "/srv/other/probe.wasm"}}),
            "invalid_command",
        ),
        (
            json!({"name": "probe", "kind": "wasm", "command": {"program": program, "args": ["x"]}}),
            "invalid_command",
        ),
        (
            json!({"name": "probe", "kind": "wasm",
                "command": {"program": program, "read_only_paths": [program]}}),
            "invalid_command",
        ),
        (
            json!({"name": "probe", "kind": "wasm", "command": {"program": program},
                "bearer_token": "tok-0123456789abcdef"}),
            "invalid_credentials",
        ),
        (
            json!({"name": "probe", "kind": "wasm", "url": "https://example.com",
                "command": {"program": program}}),
            "invalid_url",
        ),
        (
            json!({"name": "probe", "kind": "wasm", "command": {"program": program},
                "tools": [{"name": "x"}]}),
            "invalid_tools",
        ),
    ] {
        let (status, reply) = create(body.clone()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {reply}");
        assert_eq!(reply["error"]["code"], code, "{body}: {reply}");
    }

    let (status, created) = create(json!({"name": "probe", "kind": "wasm",
        "command": {"program": program}, "allowlist": [addr.to_string()],
        "env": {"PROBE_GIVEN": SECRET}}))
    .await;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    assert_eq!(created["status"], "pending_review");
    assert!(!created.to_string().contains(SECRET));
    let id = created["id"].as_str().unwrap().to_owned();
    let (review, _) = h.review_and_enable(&id, &["echo", "env"]).await;
    let digest = wor_core::canonical::sha256_hex(&std::fs::read(&component).unwrap());
    let tools = review["tools"].as_array().unwrap();
    assert_eq!(tools.len(), 9, "{review}");
    assert!(
        tools
            .iter()
            .all(|t| t["annotations"]["component_sha256"] == digest.as_str()),
        "{review}"
    );

    let run = h.run(&routine(addr)).await;
    assert_eq!(run["status"], "succeeded", "{run:#}");
    assert_eq!(run["outcome"], "done");
    let results = steps_of(&run, "tool_result");
    assert_eq!(results.len(), 3, "{run:#}");
    let text = |i: usize| {
        results[i]["payload"]["result"]["content"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    assert!(text(0).contains("200 hello"), "{}", text(0));
    assert!(
        text(0).contains("<untrusted-data source=\"probe/fetch\""),
        "{}",
        text(0)
    );
    assert_eq!(hits.load(Ordering::SeqCst), 1);
    assert!(text(1).contains("wasm-said-hi"));
    // The declared variable reached the component; its value reaches no record.
    assert!(text(2).contains("[REDACTED]"), "{}", text(2));
    assert!(!run.to_string().contains(SECRET));
    assert!(!h.audit_text().await.contains(SECRET));

    // Replacing the component file (here: one more custom section) changes every pin: the
    // next run fails closed and the connection is quarantined.
    let mut bytes = std::fs::read(&component).unwrap();
    bytes.extend_from_slice(&[0x00, 0x05, 0x04, b'e', b'v', b'i', b'l']);
    std::fs::write(&component, bytes).unwrap();
    let run = h.run(&routine(addr)).await;
    assert_eq!(run["status"], "failed", "{run:#}");
    let outcome = run["outcome"].as_str().unwrap();
    assert!(outcome.contains("quarantined"), "{outcome}");
    let (_, connection) = h
        .call(Method::GET, &format!("/v1/tool-connections/{id}"), None)
        .await;
    assert_eq!(connection["status"], "quarantined", "{connection}");
    assert_eq!(hits.load(Ordering::SeqCst), 1, "the replaced component ran");
}
