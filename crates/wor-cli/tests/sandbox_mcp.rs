//! Local tools through the real binary: a stdio MCP server — the reference server-everything
//! under node — running inside the mandatory sandbox, spoken to over its pipes (the sandbox is
//! the `wor` binary's own helper); and a Wasm tool component.
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

mod common;

/// A real `wor serve` whose operator allows local tools under `allowed`, and the CLI against
/// it as the project's owner, with `env` (one variable) set for `--env-from`.
struct LocalTools {
    dir: tempfile::TempDir,
    server: common::Server,
    key: String,
    env: (&'static str, &'static str),
}

impl LocalTools {
    fn start(
        dir: tempfile::TempDir,
        allowed: &std::path::Path,
        env: (&'static str, &'static str),
    ) -> Self {
        let config = dir.path().join("wor.toml");
        std::fs::write(
            &config,
            format!("[sandbox]\nallowed_paths = [\"{}\"]\n", allowed.display()),
        )
        .unwrap();
        let mut db = common::database_args(dir.path());
        db.extend(["--config".to_owned(), config.display().to_string()]);
        let key = common::create_project(&db);
        let server = common::Server::start(&db, &[]);
        LocalTools {
            dir,
            server,
            key,
            env,
        }
    }

    fn client(&self, args: &[&str]) -> std::process::Output {
        let mut cmd = common::wor(args);
        cmd.env("WOR_SERVER", &self.server.url)
            .env("WOR_API_KEY", &self.key)
            .env(self.env.0, self.env.1);
        common::run(&mut cmd)
    }

    /// Reviews connection `id` (saving the review) and enables what it lists, `read_only`
    /// classified read-only.
    fn review_and_enable(&self, id: &str, read_only: &str) {
        let review = self.client(&["connection", "review", id, "--json"]);
        assert!(review.status.success(), "{}", common::text(&review.stderr));
        let review_file = self.dir.path().join("review.json");
        std::fs::write(&review_file, &review.stdout).unwrap();
        let enabled = self.client(&[
            "connection",
            "enable",
            id,
            "--from-review",
            review_file.to_str().unwrap(),
            "--read-only",
            read_only,
        ]);
        assert!(
            enabled.status.success(),
            "{}",
            common::text(&enabled.stderr)
        );
    }

    /// Applies routine `toml` named `name` and runs it with `--follow`; returns what it showed.
    fn run_routine(&self, name: &str, toml: &str) -> String {
        let routine = self.dir.path().join(format!("{name}.toml"));
        std::fs::write(&routine, toml).unwrap();
        let applied = self.client(&["routine", "apply", "-f", routine.to_str().unwrap()]);
        assert!(
            applied.status.success(),
            "{}",
            common::text(&applied.stderr)
        );
        let run = self.client(&["run", "start", name, "--follow"]);
        let shown = common::text(&run.stdout);
        assert!(
            run.status.success(),
            "{shown}\n{}",
            common::text(&run.stderr)
        );
        shown
    }
}

/// Through the real server: an admin creates a `mcp_stdio` connection whose program and paths
/// lie where the operator's configuration allows; review starts it in the sandbox; a routine
/// calls its tool through the whole pipeline. Paths outside the allowed roots are refused.
#[test]
fn a_stdio_connection_runs_a_routine_inside_the_sandbox_through_the_api() {
    use common::text;

    let entry = everything_entry();
    let package = entry.ancestors().nth(2).unwrap().to_path_buf();
    let node_modules = package.ancestors().nth(2).unwrap().to_path_buf();
    let root = node_modules.parent().unwrap().to_path_buf();
    let tools = LocalTools::start(tempfile::tempdir().unwrap(), &root, ("TOOL_HOME", "/tmp"));
    let client = |args: &[&str]| tools.client(args);
    let entry_arg = entry.display().to_string();
    let node_modules_arg = node_modules.display().to_string();

    // Outside the allowed roots: refused, naming the configuration.
    let refused = client(&[
        "connection",
        "create",
        "bad",
        "--stdio",
        "/usr/bin/node",
        "--arg",
        &entry_arg,
        "--read-only",
        "/etc",
    ]);
    assert!(!refused.status.success());
    assert!(
        text(&refused.stderr).contains("allowed_paths"),
        "{}",
        text(&refused.stderr)
    );

    let created = client(&[
        "connection",
        "create",
        "ev",
        "--stdio",
        "/usr/bin/node",
        "--arg",
        &entry_arg,
        "--arg",
        "stdio",
        "--read-only",
        &node_modules_arg,
        "--env-from",
        "HOME=TOOL_HOME",
        "--json",
    ]);
    assert!(created.status.success(), "{}", text(&created.stderr));
    let created: serde_json::Value = serde_json::from_slice(&created.stdout).unwrap();
    assert_eq!(created["kind"], "mcp_stdio");
    assert_eq!(created["credentials"]["env:HOME"]["configured"], true);
    let id = created["id"].as_str().unwrap().to_owned();
    tools.review_and_enable(&id, "echo");

    let shown = tools.run_routine(
        "echoer",
        "name = \"echoer\"\ninstructions = \"Echo.\"\n[model]\nprovider = \"replay\"\nmodel = \"m\"\n\
         [[model.script.turns]]\nwhen = { last_tool_result_contains = \"Echo:\" }\ntext = \"echoed\"\n\
         [[model.script.turns]]\ntool_calls = [{ name = \"ev__echo\", arguments = { message = \"hi from the sandbox\" } }]\n\
         [[tools]]\ntool = \"ev/echo\"\nmode = \"auto\"\n",
    );
    assert!(shown.contains("Echo: hi from the sandbox"), "{shown}");
    tools.server.stop();
}

/// A Wasm tool through the real binary: `wor connection create --wasm`, review, enable and a
/// routine that calls it; an argument for the component is refused, not dropped.
#[test]
fn a_wasm_connection_runs_a_routine_through_the_cli() {
    use common::text;

    let dir = tempfile::tempdir().unwrap();
    let allowed = dir.path().join("tools");
    std::fs::create_dir(&allowed).unwrap();
    let component = allowed.join("probe.wasm");
    std::fs::copy(wor_wasm::testing::probe_component(), &component).unwrap();
    let tools = LocalTools::start(dir, &allowed, ("PROBE_VALUE", "from-the-cli"));
    let client = |args: &[&str]| tools.client(args);
    let program = component.display().to_string();

    let refused = client(&[
        "connection",
        "create",
        "probe",
        "--wasm",
        &program,
        "--arg",
        "x",
    ]);
    assert!(!refused.status.success());
    assert!(
        text(&refused.stderr).contains("takes no `args`"),
        "{}",
        text(&refused.stderr)
    );
    let created = client(&[
        "connection",
        "create",
        "probe",
        "--wasm",
        &program,
        "--env-from",
        "PROBE_GIVEN=PROBE_VALUE",
        "--json",
    ]);
    assert!(created.status.success(), "{}", text(&created.stderr));
    let created: serde_json::Value = serde_json::from_slice(&created.stdout).unwrap();
    assert_eq!(created["kind"], "wasm");
    assert_eq!(
        created["credentials"]["env:PROBE_GIVEN"]["configured"],
        true
    );
    let id = created["id"].as_str().unwrap().to_owned();
    tools.review_and_enable(&id, "echo");

    let shown = tools.run_routine(
        "prober",
        "name = \"prober\"\ninstructions = \"Echo.\"\n[model]\nprovider = \"replay\"\nmodel = \"m\"\n\
         [[model.script.turns]]\nwhen = { last_tool_result_contains = \"hi from wasm\" }\ntext = \"echoed\"\n\
         [[model.script.turns]]\ntool_calls = [{ name = \"probe__echo\", arguments = { text = \"hi from wasm\" } }]\n\
         [[tools]]\ntool = \"probe/echo\"\nmode = \"auto\"\n",
    );
    assert!(shown.contains("hi from wasm"), "{shown}");
    assert!(shown.contains("echoed"), "{shown}");
    tools.server.stop();
}
