//! Stdio MCP servers start only through a sandbox launcher: without one, nothing runs; with one
//! (here an in-process stand-in joined by pipes), the session works like any other.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use rmcp::ServiceExt;
use secrecy::SecretString;
use wor_egress::HostAllowlist;
use wor_tools::{
    LaunchError, LaunchFuture, LaunchedProcess, McpError, McpLimits, McpServerKind, McpSession,
    ProcessGuard, SandboxLauncher, SandboxUnavailable, StdioCommand,
};

use crate::loopback_egress;
use crate::own_server::{HONEST, ShiftyServer};

fn command(marker: &std::path::Path) -> StdioCommand {
    StdioCommand {
        program: "/bin/sh".into(),
        args: vec!["-c".into(), format!("touch {}", marker.display())],
        env: vec![(
            "API_TOKEN".into(),
            SecretString::from("stdio-secret-123456"),
        )],
        egress_allowlist: HostAllowlist::default(),
        read_only_paths: Vec::new(),
    }
}

#[tokio::test]
async fn without_a_sandbox_nothing_is_started() {
    let marker = std::env::temp_dir().join(format!("wor-tools-stdio-{}", std::process::id()));
    let _ = std::fs::remove_file(&marker);
    let command = command(&marker);
    assert!(!format!("{command:?}").contains("stdio-secret"));

    let error = McpSession::connect(
        &McpServerKind::Stdio(command),
        &loopback_egress(),
        &SandboxUnavailable,
        McpLimits::default(),
    )
    .await
    .unwrap_err();
    assert!(
        matches!(error, McpError::Launch(LaunchError::SandboxUnavailable)),
        "{error:?}"
    );
    assert_eq!(
        error.to_string(),
        "stdio MCP servers run only in the sandbox, which is not available in this build"
    );
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    assert!(!marker.exists(), "a process ran outside the sandbox");
}

#[derive(Debug)]
struct DropFlag(Arc<AtomicBool>);

impl Drop for DropFlag {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

impl ProcessGuard for DropFlag {}

/// Stands in for the sandbox: "starts" the server in-process and joins it by pipes.
#[derive(Debug, Default)]
struct InProcessLauncher {
    stopped: Arc<AtomicBool>,
}

impl SandboxLauncher for InProcessLauncher {
    fn launch<'a>(&'a self, _command: &'a StdioCommand) -> LaunchFuture<'a> {
        let stopped = Arc::clone(&self.stopped);
        Box::pin(async move {
            let (client_end, server_end) = tokio::io::duplex(64 * 1024);
            tokio::spawn(async move {
                if let Ok(running) = ShiftyServer::default().serve(server_end).await {
                    let _ = running.waiting().await;
                }
            });
            let (stdout, stdin) = tokio::io::split(client_end);
            Ok(LaunchedProcess {
                stdin: Box::new(stdin),
                stdout: Box::new(stdout),
                guard: Box::new(DropFlag(stopped)),
            })
        })
    }
}

#[tokio::test]
async fn a_sandbox_launcher_plugs_in() {
    let launcher = InProcessLauncher::default();
    let marker = std::env::temp_dir().join("wor-tools-never-used");
    let session = McpSession::connect(
        &McpServerKind::Stdio(command(&marker)),
        &loopback_egress(),
        &launcher,
        McpLimits::default(),
    )
    .await
    .unwrap();
    let tools = session.list_tools().await.unwrap();
    assert_eq!(tools[0].name, "add");
    assert_eq!(tools[0].description.as_deref(), Some(HONEST));
    assert!(!launcher.stopped.load(Ordering::SeqCst));
    session.close().await;
    assert!(
        launcher.stopped.load(Ordering::SeqCst),
        "the process guard outlived the session"
    );
}

/// Stands in for a stdio server that answers `initialize` and then answers `tools/list` with
/// one line longer than the session's message limit.
#[derive(Debug, Default)]
struct OversizedLauncher;

impl SandboxLauncher for OversizedLauncher {
    fn launch<'a>(&'a self, _command: &'a StdioCommand) -> LaunchFuture<'a> {
        Box::pin(async move {
            use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _};
            let (client_end, server_end) = tokio::io::duplex(64 * 1024);
            tokio::spawn(async move {
                let (read, mut write) = tokio::io::split(server_end);
                let mut lines = tokio::io::BufReader::new(read).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    let message: serde_json::Value = serde_json::from_str(&line).unwrap();
                    let id = message["id"].clone();
                    let answer = match message["method"].as_str() {
                        Some("initialize") => serde_json::json!({
                            "jsonrpc": "2.0", "id": id, "result": {
                                "protocolVersion": message["params"]["protocolVersion"],
                                "capabilities": {"tools": {}},
                                "serverInfo": {"name": "big", "version": "1"},
                            }
                        }),
                        Some("tools/list") => serde_json::json!({
                            "jsonrpc": "2.0", "id": id, "result": {"tools": [{
                                "name": "big",
                                "description": "x".repeat(5 * 1024 * 1024),
                                "inputSchema": {"type": "object"},
                            }]}
                        }),
                        _ => continue,
                    };
                    let mut text = answer.to_string();
                    text.push('\n');
                    if write.write_all(text.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
            let (stdout, stdin) = tokio::io::split(client_end);
            Ok(LaunchedProcess {
                stdin: Box::new(stdin),
                stdout: Box::new(stdout),
                guard: Box::new(DropFlag(Arc::default())),
            })
        })
    }
}

#[tokio::test]
async fn a_message_past_the_limit_fails_its_request_at_once() {
    let marker = std::env::temp_dir().join("wor-tools-never-used");
    let limits = McpLimits {
        request_timeout: std::time::Duration::from_secs(30),
        ..McpLimits::default()
    };
    let session = McpSession::connect(
        &McpServerKind::Stdio(command(&marker)),
        &loopback_egress(),
        &OversizedLauncher,
        limits,
    )
    .await
    .unwrap();
    let began = std::time::Instant::now();
    let error = session.list_tools().await.unwrap_err();
    assert!(
        began.elapsed() < std::time::Duration::from_secs(5),
        "the request waited {:?} for an answer it could not read: {error:?}",
        began.elapsed()
    );
    assert!(
        matches!(error, McpError::MessageTooLarge(limit) if limit == McpLimits::default().max_message_bytes),
        "{error:?}"
    );
    assert_eq!(
        error.to_string(),
        "the mcp server sent a message larger than 4194304 bytes; the session is closed"
    );
}
