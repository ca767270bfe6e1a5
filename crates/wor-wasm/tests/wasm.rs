//! Wasm tools against the probe component (`guest/`, built by `.ci/wasm-fixtures.sh`): each
//! tool of the probe tries one thing, and each test checks the host's limit holds. Network
//! tests use loopback listeners that count what reaches them.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic,
    reason = "tests fail loudly"
)]

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde_json::{Value, json};
use wor_egress::testing::loopback_egress;
use wor_egress::{EgressClient, EgressLimits, EgressPolicy, HostAllowlist, StaticResolver};
use wor_wasm::{
    MAX_COMPONENT_BYTES, WasmError, WasmGrants, WasmHost, WasmLimits, WasmRuntime, WasmTool,
};

fn probe_path() -> PathBuf {
    wor_wasm::testing::probe_component()
}

fn probe(runtime: &WasmRuntime, grants: WasmGrants, limits: WasmLimits) -> WasmTool {
    let component = runtime.load_file(&probe_path()).unwrap();
    WasmTool::new(component, grants, limits, loopback_egress()).unwrap()
}

async fn call(tool: &WasmTool, name: &str, arguments: Value) -> Result<String, String> {
    tool.call_tool(name, &arguments).await.unwrap()
}

/// A loopback HTTP server that counts requests and answers `hello`.
async fn counting_server() -> (std::net::SocketAddr, Arc<AtomicUsize>) {
    let hits = Arc::new(AtomicUsize::new(0));
    let counter = hits.clone();
    let app = axum::Router::new().fallback(move || {
        let counter = counter.clone();
        async move {
            counter.fetch_add(1, Ordering::SeqCst);
            "hello"
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (addr, hits)
}

#[tokio::test]
async fn a_component_lists_its_tools_and_answers_calls_on_fresh_instances() {
    let runtime = WasmRuntime::new().unwrap();
    let tool = probe(&runtime, WasmGrants::default(), WasmLimits::default());
    let tools = tool.list_tools().await.unwrap();
    let names: Vec<&str> = tools.iter().map(|t| t["name"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        [
            "echo",
            "env",
            "read_file",
            "write_file",
            "spin",
            "hog",
            "connect",
            "fetch",
            "upload"
        ]
    );
    assert_eq!(tools[0]["input_schema"]["type"], "object");
    assert_eq!(
        call(&tool, "echo", json!({"text": "hi"})).await,
        Ok("hi".to_owned())
    );
    // The tool's own errors come back as errors, not failures of the host.
    let unknown = call(&tool, "nope", json!({})).await.unwrap_err();
    assert!(unknown.contains("no tool `nope`"), "{unknown}");
}

#[tokio::test]
async fn fuel_and_the_deadline_stop_a_tool_that_never_ends() {
    let runtime = WasmRuntime::new().unwrap();
    let starved = probe(
        &runtime,
        WasmGrants::default(),
        WasmLimits {
            fuel: 50_000_000,
            ..WasmLimits::default()
        },
    );
    let error = starved.call_tool("spin", &json!({})).await.unwrap_err();
    assert!(matches!(error, WasmError::OutOfFuel(50_000_000)), "{error}");
    let hurried = probe(
        &runtime,
        WasmGrants::default(),
        WasmLimits {
            fuel: u64::MAX,
            timeout: Duration::from_millis(300),
            ..WasmLimits::default()
        },
    );
    let started = std::time::Instant::now();
    let error = hurried.call_tool("spin", &json!({})).await.unwrap_err();
    assert!(matches!(error, WasmError::Deadline(_)), "{error}");
    assert!(started.elapsed() < Duration::from_secs(10));
    // The runtime goes on serving calls.
    assert_eq!(
        call(&hurried, "echo", json!({"text": "after"})).await,
        Ok("after".to_owned())
    );
}

#[tokio::test]
async fn memory_beyond_the_limit_is_refused() {
    let runtime = WasmRuntime::new().unwrap();
    let tool = probe(
        &runtime,
        WasmGrants::default(),
        WasmLimits {
            memory_bytes: 16 << 20,
            ..WasmLimits::default()
        },
    );
    assert_eq!(
        call(&tool, "hog", json!({"mib": 2})).await,
        Ok(format!("{} bytes", 2 << 20))
    );
    let error = tool
        .call_tool("hog", &json!({"mib": 64}))
        .await
        .unwrap_err();
    assert!(
        matches!(error, WasmError::MemoryLimit(limit) if limit == 16 << 20),
        "{error}"
    );
    let too_big = WasmTool::new(
        runtime.load_file(&probe_path()).unwrap(),
        WasmGrants::default(),
        WasmLimits {
            memory_bytes: wor_wasm::MAX_MEMORY_BYTES + 1,
            ..WasmLimits::default()
        },
        loopback_egress(),
    );
    assert!(too_big.is_err());
}

#[tokio::test]
async fn a_tool_sees_no_file_variable_or_socket_it_was_not_given() {
    let runtime = WasmRuntime::new().unwrap();
    let shared = tempfile::tempdir().unwrap();
    std::fs::write(shared.path().join("note.txt"), "shared text").unwrap();
    let tool = probe(
        &runtime,
        WasmGrants {
            env: vec![("PROBE_GIVEN".to_owned(), "given".to_owned())],
            read_only_dirs: vec![(shared.path().to_owned(), "/data".to_owned())],
            allowlist: None,
        },
        WasmLimits::default(),
    );
    // Host files: none but the declared directory, and that one read-only.
    for path in ["/etc/passwd", "/etc/shadow", "/proc/self/environ"] {
        let read = call(&tool, "read_file", json!({"path": path})).await;
        assert!(read.is_err(), "{path} was readable: {read:?}");
    }
    assert_eq!(
        call(&tool, "read_file", json!({"path": "/data/note.txt"})).await,
        Ok("shared text".to_owned())
    );
    for path in ["/data/new.txt", "/tmp/new.txt", "new.txt"] {
        let write = call(&tool, "write_file", json!({"path": path})).await;
        assert!(write.is_err(), "{path} was writable");
    }
    assert!(!shared.path().join("new.txt").exists());
    // Environment: only what was declared.
    std::env::var("HOME").expect("the test needs HOME set on the host");
    assert!(call(&tool, "env", json!({"name": "HOME"})).await.is_err());
    assert!(call(&tool, "env", json!({"name": "PATH"})).await.is_err());
    assert_eq!(
        call(&tool, "env", json!({"name": "PROBE_GIVEN"})).await,
        Ok("given".to_owned())
    );
    // Sockets: none, not even to loopback.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let connect = call(&tool, "connect", json!({"addr": addr})).await;
    assert!(connect.is_err(), "{connect:?}");
    assert!(
        listener.accept().is_err(),
        "a connection reached the listener"
    );
}

#[tokio::test]
async fn outgoing_http_goes_only_through_the_egress_guard_and_the_allowlist() {
    let runtime = WasmRuntime::new().unwrap();
    let (addr, hits) = counting_server().await;
    let url = format!("http://{addr}/page");
    let grants = |entries: &[&str]| WasmGrants {
        allowlist: Some(HostAllowlist::parse(entries).unwrap()),
        ..WasmGrants::default()
    };

    // No allowlist: no network at all.
    let offline = probe(&runtime, WasmGrants::default(), WasmLimits::default());
    let refused = call(&offline, "fetch", json!({"url": url}))
        .await
        .unwrap_err();
    assert!(refused.contains("HttpRequestDenied"), "{refused}");
    // Another host on the allowlist: refused.
    let elsewhere = probe(
        &runtime,
        grants(&["api.example.com"]),
        WasmLimits::default(),
    );
    let refused = call(&elsewhere, "fetch", json!({"url": url}))
        .await
        .unwrap_err();
    assert!(refused.contains("HttpRequestDenied"), "{refused}");
    assert_eq!(hits.load(Ordering::SeqCst), 0, "a refused request arrived");

    // The allowlisted host: through the guard.
    let allowed = probe(
        &runtime,
        grants(&[&addr.to_string()]),
        WasmLimits::default(),
    );
    assert_eq!(
        call(&allowed, "fetch", json!({"url": url})).await,
        Ok("200 hello".to_owned())
    );
    assert_eq!(hits.load(Ordering::SeqCst), 1);
    // A request body beyond 1 MiB is refused while it streams, before anything is sent.
    let refused = call(&allowed, "upload", json!({"url": url, "mib": 8}))
        .await
        .unwrap_err();
    assert!(refused.contains("HttpRequestBodySize"), "{refused}");
    assert_eq!(
        hits.load(Ordering::SeqCst),
        1,
        "the oversized request arrived"
    );

    // The guard's own rules hold whatever the allowlist says: a metadata address, and loopback
    // under a policy that does not list it.
    let metadata = probe(
        &runtime,
        grants(&["169.254.169.254"]),
        WasmLimits::default(),
    );
    let refused = call(
        &metadata,
        "fetch",
        json!({"url": "http://169.254.169.254/latest/meta-data/"}),
    )
    .await
    .unwrap_err();
    assert!(refused.contains("HttpRequestDenied"), "{refused}");
    let strict = WasmTool::new(
        runtime.load_file(&probe_path()).unwrap(),
        grants(&[&addr.to_string()]),
        WasmLimits::default(),
        EgressClient::with_resolver(
            EgressPolicy::development(),
            Arc::new(StaticResolver::new()),
            EgressLimits::default(),
        )
        .unwrap(),
    )
    .unwrap();
    let refused = call(&strict, "fetch", json!({"url": url}))
        .await
        .unwrap_err();
    assert!(refused.contains("HttpRequestDenied"), "{refused}");
    assert_eq!(hits.load(Ordering::SeqCst), 1, "a refused request arrived");
}

#[tokio::test]
async fn what_is_not_a_tool_component_is_refused_when_loaded() {
    let runtime = WasmRuntime::new().unwrap();
    let error = runtime.load(b"not wasm at all").unwrap_err();
    assert!(matches!(error, WasmError::Component(_)), "{error}");
    let missing = runtime
        .load_file(std::path::Path::new("/nonexistent/tool.wasm"))
        .unwrap_err();
    assert!(matches!(missing, WasmError::Read { .. }), "{missing}");
}

#[tokio::test]
async fn the_host_names_a_component_by_the_digest_of_its_file_and_refuses_what_is_not_one() {
    let host = WasmHost::<u32>::default();
    let first = host
        .open(1, &probe_path(), WasmGrants::default(), loopback_egress())
        .await
        .unwrap();
    assert_eq!(first.digest.len(), 64, "{}", first.digest);
    // The same bytes elsewhere are the same component, for any owner.
    let dir = tempfile::tempdir().unwrap();
    let copy = dir.path().join("copy.wasm");
    std::fs::copy(probe_path(), &copy).unwrap();
    let same = host
        .open(2, &copy, WasmGrants::default(), loopback_egress())
        .await
        .unwrap();
    assert_eq!(same.digest, first.digest);
    // One byte of difference (a custom section appended) is another digest, and it runs.
    let mut bytes = std::fs::read(probe_path()).unwrap();
    bytes.extend_from_slice(&[0x00, 0x05, 0x04, b'n', b'o', b't', b'e']);
    let changed = dir.path().join("changed.wasm");
    std::fs::write(&changed, &bytes).unwrap();
    let other = host
        .open(1, &changed, WasmGrants::default(), loopback_egress())
        .await
        .unwrap();
    assert_ne!(other.digest, first.digest);
    assert!(!other.tool.list_tools().await.unwrap().is_empty());

    let error = host
        .open(1, dir.path(), WasmGrants::default(), loopback_egress())
        .await
        .unwrap_err();
    assert!(matches!(error, WasmError::NotAFile { .. }), "{error}");
    let missing = host
        .open(
            1,
            &dir.path().join("missing.wasm"),
            WasmGrants::default(),
            loopback_egress(),
        )
        .await
        .unwrap_err();
    assert!(matches!(missing, WasmError::Read { .. }), "{missing}");
    let large = dir.path().join("large.wasm");
    std::fs::File::create(&large)
        .unwrap()
        .set_len(MAX_COMPONENT_BYTES + 1)
        .unwrap();
    let error = host
        .open(1, &large, WasmGrants::default(), loopback_egress())
        .await
        .unwrap_err();
    assert!(matches!(error, WasmError::TooLarge { .. }), "{error}");
    let error = host
        .open(1, &copy, WasmGrants::default(), loopback_egress())
        .await
        .map(drop);
    assert!(error.is_ok(), "a refusal leaves the host usable");
}

#[test]
fn declared_directories_are_seen_at_their_real_path_and_a_missing_one_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let declared = dir.path().to_str().unwrap().to_owned();
    let resolved = WasmGrants::resolve_read_only_dirs(std::slice::from_ref(&declared)).unwrap();
    assert_eq!(
        resolved,
        [(std::fs::canonicalize(dir.path()).unwrap(), declared.clone())]
    );
    let missing = format!("{declared}/missing");
    let error = WasmGrants::resolve_read_only_dirs(&[missing]).unwrap_err();
    assert!(matches!(error, WasmError::Directory { .. }), "{error}");
}

#[tokio::test]
async fn a_share_caps_the_instances_one_owner_holds_and_waiting_counts_against_the_deadline() {
    let runtime = WasmRuntime::new().unwrap();
    let share = Arc::new(wor_wasm::Semaphore::new(1));
    let busy = probe(
        &runtime,
        WasmGrants::default(),
        WasmLimits {
            fuel: u64::MAX,
            timeout: Duration::from_millis(1500),
            ..WasmLimits::default()
        },
    )
    .with_share(share.clone());
    let quick = probe(
        &runtime,
        WasmGrants::default(),
        WasmLimits {
            timeout: Duration::from_millis(300),
            ..WasmLimits::default()
        },
    );
    let spinning = tokio::spawn(async move { busy.call_tool("spin", &json!({})).await });
    // Wait until the spinning call holds the owner's one instance.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while share.available_permits() > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the spin never started"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Another owner's tool is not held up by it.
    assert_eq!(
        call(&quick, "echo", json!({"text": "free"})).await,
        Ok("free".to_owned())
    );
    // The same owner's next call waits for the instance, and its wait counts.
    let capped = quick.clone().with_share(share.clone());
    let error = capped
        .call_tool("echo", &json!({"text": "x"}))
        .await
        .unwrap_err();
    assert!(matches!(error, WasmError::Deadline(_)), "{error}");
    let spun = spinning.await.unwrap().unwrap_err();
    assert!(matches!(spun, WasmError::Deadline(_)), "{spun}");
    // Freed, the share serves the next call.
    assert_eq!(
        call(&capped, "echo", json!({"text": "after"})).await,
        Ok("after".to_owned())
    );
}
