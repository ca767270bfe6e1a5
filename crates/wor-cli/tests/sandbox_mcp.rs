//! A stdio MCP server — the reference server-everything under node — running inside the
//! mandatory sandbox, spoken to over its pipes; the sandbox is the `wor` binary's own helper.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic,
    reason = "tests fail loudly"
)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use secrecy::SecretString;
use wor_egress::{EgressPolicy, GuardedResolver, HostAllowlist, StaticResolver};
use wor_sandbox::{Sandbox, SandboxConfig};
use wor_tools::{McpLimits, McpSession, Sandboxed, StdioCommand};

/// The installed reference server (`.ci/mcp-servers.sh` installs it and exports its path).
fn everything_entry() -> PathBuf {
    let path = std::env::var("WOR_MCP_EVERYTHING")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            PathBuf::from(std::env::var("HOME").unwrap())
                .join(".cache/wor-npm/node_modules/.bin/mcp-server-everything")
        });
    let resolved = std::fs::canonicalize(&path).unwrap_or_else(|e| {
        panic!(
            "server-everything is not installed at {} ({e}): run `source .ci/mcp-servers.sh`",
            path.display()
        )
    });
    assert!(
        std::path::Path::new("/usr/bin/node").exists(),
        "node is needed at /usr/bin/node"
    );
    resolved
}

#[tokio::test(flavor = "multi_thread")]
async fn server_everything_runs_over_stdio_inside_the_sandbox() {
    let entry = everything_entry();
    // The package directory, read-only: node resolves its imports from there.
    let package = entry.ancestors().nth(2).unwrap().to_path_buf();
    let node_modules = package.ancestors().nth(2).unwrap().to_path_buf();
    let state = tempfile::tempdir().unwrap();
    let resolver = Arc::new(GuardedResolver::new(
        Arc::new(StaticResolver::new()),
        Arc::new(EgressPolicy::development()),
    ));
    let sandbox = Sandbox::new(SandboxConfig {
        helper: PathBuf::from(env!("CARGO_BIN_EXE_wor")),
        state_dir: state.path().to_path_buf(),
        resolver,
        startup_timeout: Duration::from_secs(30),
    })
    .unwrap();
    let command = StdioCommand {
        program: "/usr/bin/node".into(),
        args: vec![entry.display().to_string(), "stdio".into()],
        env: vec![("HOME".into(), SecretString::from("/tmp"))],
        egress_allowlist: HostAllowlist::default(),
        read_only_paths: vec![node_modules],
    };
    let session =
        McpSession::connect_stdio(&Sandboxed::new(sandbox), &command, McpLimits::default())
            .await
            .unwrap();
    let tools = session.list_tools().await.unwrap();
    assert!(
        tools.iter().any(|t| t.name == "echo"),
        "{:?}",
        tools.iter().map(|t| &t.name).collect::<Vec<_>>()
    );
    let mut arguments = serde_json::Map::new();
    arguments.insert(
        "message".into(),
        serde_json::json!("from inside the sandbox"),
    );
    let result = session.call_tool("echo", arguments).await.unwrap();
    assert!(!result.is_error);
    assert!(
        format!("{:?}", result.content).contains("from inside the sandbox"),
        "{result:?}"
    );
    session.close().await;
    // The operation's root is gone once the session is closed.
    for _ in 0..50 {
        if std::fs::read_dir(state.path()).unwrap().next().is_none() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!(
        "the sandbox root was left behind in {}",
        state.path().display()
    );
}
