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
