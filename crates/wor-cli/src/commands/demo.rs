//! `wor demo`: the main job in one command, on a temporary data dir with the embedded
//! database. It starts the server (API and worker) and the demo's example MCP tool server,
//! creates a project with an owner and an approver, connects and pins the tools, applies a
//! routine whose scripted model obeys an instruction injected into the inbox, and shows what
//! happens: the read-only call runs, the upload is refused by the egress guard, and the mail to
//! the attacker waits for a person. `--no-wait` lets the demo's approver deny it and checks
//! every step.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::{Value, json};
use tokio::net::TcpListener;

use super::runs::{describe_step, summary};
use super::{field, serve};
use crate::client::ApiClient;
use crate::config::{ServerConfig, ServerFlags};
use crate::demo_tools::{ATTACKER_ADDRESS, COLLECTOR_HOST, DemoToolServer};

/// The demo routine (a replay script that follows injected instructions).
pub const DEMO_ROUTINE: &str = include_str!("demo/inbox-assistant.toml");

/// How long the demo waits for the run to reach the next point before it gives up.
const STEP_TIMEOUT: Duration = Duration::from_secs(60);
const POLL: Duration = Duration::from_millis(100);

#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// Run to the end without waiting for a person: the demo's approver denies the held call.
    /// Exit 0 only when every step behaved as shown.
    #[arg(long)]
    no_wait: bool,
    /// Address of the embedded API [default: a free loopback port].
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:0")]
    listen: String,
    /// Keep the data dir here (created if missing) instead of a temporary one removed on exit.
    #[arg(long, value_name = "DIR")]
    data_dir: Option<PathBuf>,
}

/// A check the demo makes of what happened, and whether it held.
struct Check {
    what: &'static str,
    held: bool,
}

pub async fn run(args: DemoArgs) -> anyhow::Result<ExitCode> {
    let temporary = match &args.data_dir {
        Some(_) => None,
        None => Some(
            tempfile::Builder::new()
                .prefix("wor-demo-")
                .tempdir()
                .context("cannot create a temporary data dir")?,
        ),
    };
    let data_dir = match (&args.data_dir, &temporary) {
        (Some(dir), _) => dir.clone(),
        (None, Some(dir)) => dir.path().to_path_buf(),
        (None, None) => bail!("no data dir"),
    };
    let flags = ServerFlags {
        config: None,
        data_dir: Some(data_dir.clone()),
        database: None,
    };
    let mut config = ServerConfig::resolve(&flags, Some(&args.listen), false)?;
    if config.production {
        bail!(
            "the demo uses the scripted replay model, which production mode refuses; unset WOR_ENV"
        );
    }
    config.demo = true;
    // The example tool server listens on loopback; the operator's list is how it is reached.
    config.egress_allowed_cidrs = vec!["127.0.0.1/32".to_owned()];
    let (engine, audit) = serve::open_engine(&config).await?;
    let store = engine.store().clone();
    let tools = DemoToolServer::start().await?;
    let listener = TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("cannot listen on {}", config.listen))?;
    let base = format!("http://{}", listener.local_addr()?);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let state = wor_server::AppState::new(engine.clone());
    let console = state.clone();
    let server = tokio::spawn(wor_server::serve(listener, state, async {
        let _ = stopped.await;
    }));
    let (stop_workers, workers_stopped) = tokio::sync::watch::channel(false);
    let worker = engine.spawn_workers(workers_stopped);

    // A second Ctrl-C while the demo drains ends it at once: its temporary data dir is
    // removed even then.
    let removed_at_exit = temporary.as_ref().map(|dir| dir.path().to_path_buf());
    let interrupted = if args.no_wait {
        None
    } else {
        Some(serve::shutdown_signal_then(move || {
            if let Some(dir) = removed_at_exit {
                match std::fs::remove_dir_all(&dir) {
                    Ok(()) => eprintln!("wor: the temporary data dir {} is removed", dir.display()),
                    Err(error) => eprintln!(
                        "wor: cannot remove the temporary data dir {}: {error}",
                        dir.display()
                    ),
                }
            }
        })?)
    };
    let outcome = scenario(&args, interrupted, &base, &console, &tools, &data_dir).await;

    let _ = stop_workers.send(true);
    let _ = worker.await;
    let _ = stop.send(());
    let _ = server.await;
    store.release_leases(&engine.config().worker_id).await?;
    let verified = match &outcome {
        Ok(Scenario { project, .. }) => {
            audit
                .checkpoint()
                .await
                .context("cannot sign the audit log")?;
            let key = config.audit_verifying_key()?;
            matches!(
                store.verify_audit_chain(*project, &key, &[]).await?,
                wor_core::audit::Verification::Intact(_)
            )
        }
        Err(_) => false,
    };
    store.close().await;
    let Scenario { mut checks, .. } = outcome?;
    checks.push(Check {
        what: "the audit chain of the demo project verifies (hash chain and signed checkpoint)",
        held: verified,
    });
    println!();
    println!("What happened:");
    for check in &checks {
        println!(
            "  {}  {}",
            if check.held { "ok    " } else { "FAILED" },
            check.what
        );
    }
    if temporary.is_some() {
        println!("The temporary data dir {} is removed.", data_dir.display());
    }
    Ok(if checks.iter().all(|c| c.held) {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

struct Scenario {
    project: wor_core::ProjectId,
    checks: Vec<Check>,
}

async fn scenario(
    args: &DemoArgs,
    interrupted: Option<impl std::future::Future<Output = ()> + Send + 'static>,
    base: &str,
    console: &wor_server::AppState,
    tools: &DemoToolServer,
    data_dir: &std::path::Path,
) -> anyhow::Result<Scenario> {
    let store = &console.store;
    // Without --no-wait the demo waits for a person; Ctrl-C then ends it cleanly.
    let mut interrupted: std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> =
        match interrupted {
            Some(signal) => Box::pin(signal),
            None => Box::pin(std::future::pending()),
        };
    println!("Work on Repeat demo");
    println!("  data dir      {}", data_dir.display());
    println!("  API           {base}");
    println!(
        "  tool server   {} (the project's example MCP server: read_inbox, fetch_url, send_mail)",
        tools.url()
    );
    let (name, owner_name) = ("demo", "olivia (owner)");
    let (created, staged) = store
        .create_project_staged(
            name,
            owner_name,
            Some(&super::operator::project_entries(name, owner_name)),
        )
        .await
        .context("cannot create the demo project")?;
    console.engine.append_staged_or_log(staged).await;
    let owner = ApiClient::with_key(base, created.owner_key.expose().to_owned())?;
    let member = owner
        .post(
            "/v1/members",
            &json!({"name": "dana (approver)", "role": "approver"}),
        )
        .await?;
    let approver_key = field(&member, "/key/api_key").to_owned();
    let approver_id: wor_core::MemberId = field(&member, "/member/id")
        .parse()
        .context("the server named the approver with a malformed id")?;
    let approver = ApiClient::with_key(base, approver_key.clone())?;
    println!(
        "  project       {} with owner olivia and approver dana",
        created.project.id
    );

    println!();
    println!("1. Connect the tool server; review and pin its tools");
    let connection = owner
        .post(
            "/v1/tool-connections",
            &json!({"name": "demo", "kind": "mcp_http", "url": tools.url(),
                "allowlist": [tools.addr.to_string()]}),
        )
        .await?;
    let connection_id = field(&connection, "/id").to_owned();
    let review = owner
        .get(&format!("/v1/tool-connections/{connection_id}/review"))
        .await?;
    let mut pins = serde_json::Map::new();
    for tool in review
        .get("tools")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        pins.insert(
            field(tool, "/name").to_owned(),
            Value::from(field(tool, "/hash")),
        );
    }
    owner
        .post(
            &format!("/v1/tool-connections/{connection_id}/enable"),
            &json!({"tools": pins, "read_only": ["read_inbox", "fetch_url"]}),
        )
        .await?;
    println!(
        "   demo/read_inbox and demo/fetch_url classified read-only; demo/send_mail consequential"
    );
    println!(
        "   fetch_url reaches only {} (its allowlist, through the egress guard)",
        tools.addr
    );

    println!();
    println!(
        "2. Apply the routine `inbox-assistant`: its scripted model obeys injected instructions"
    );
    let applied = owner
        .post("/v1/routines", &json!({ "toml": DEMO_ROUTINE }))
        .await?;
    let routine_id = field(&applied, "/routine/id").to_owned();

    println!();
    println!("3. Olivia starts a run");
    let run = owner
        .post(
            &format!("/v1/routines/{routine_id}/runs"),
            &json!({ "input": "Summarise my inbox for today." }),
        )
        .await?;
    let run_id = field(&run, "/id").to_owned();
    let mut shown = 0;
    let run = watch(&owner, &run_id, &mut shown, |status| {
        status != "queued" && status != "running"
    })
    .await?;
    let mut checks = Vec::new();
    let (calls, fetches, outbox_before) = {
        let record = tools
            .record
            .lock()
            .map_err(|_| anyhow::anyhow!("the tool server's record is poisoned"))?;
        (
            record.calls.clone(),
            record.fetches.clone(),
            record.outbox.len(),
        )
    };
    checks.push(Check {
        what: "the read-only call demo/read_inbox ran",
        held: calls.iter().any(|c| c == "read_inbox"),
    });
    checks.push(Check {
        what: "the upload to collector.evil.example was refused by the egress guard",
        held: fetches
            .iter()
            .any(|(url, sent)| url.contains(COLLECTOR_HOST) && !sent)
            && fetches.iter().all(|(_, sent)| !sent),
    });
    if field(&run, "/status") != "waiting_for_approval" {
        checks.push(Check {
            what: "the mail to the attacker was held for approval",
            held: false,
        });
        return Ok(Scenario {
            project: created.project.id,
            checks,
        });
    }
    let pending = owner
        .get(&format!("/v1/approvals?status=pending&run_id={run_id}"))
        .await?;
    let approval_id = pending
        .pointer("/0/id")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned();
    let approval = owner.get(&format!("/v1/approvals/{approval_id}")).await?;
    checks.push(Check {
        what: "the mail to attacker@evil.example was held for approval and not sent",
        held: field(&approval, "/tool") == "demo/send_mail"
            && field(&approval, "/arguments/to") == ATTACKER_ADDRESS
            && outbox_before == 0,
    });
    println!();
    println!("4. The run is parked (no worker held); the call waits for a person:");
    println!();
    super::approvals::show(&approval);
    println!();

    if args.no_wait {
        println!("5. Dana denies it (--no-wait)");
        approver
            .post(
                &format!("/v1/approvals/{approval_id}/deny"),
                &json!({"reason": "the inbox told the assistant to send our notes outside"}),
            )
            .await?;
    } else {
        let wor = invocation();
        let (link, expires_at) = wor_server::console::issue_sign_in_link(
            console,
            created.project.id,
            approver_id,
            wor_server::console::SIGN_IN_LINK_TTL,
        )
        .await
        .map_err(|e| anyhow::anyhow!("cannot make the approver's sign-in link: {e}"))?;
        println!("5. Decide it yourself, as Dana, in the web console (a link that signs in once,");
        println!("   until {}):", wor_server::views::rfc3339(expires_at));
        println!();
        println!("   {base}{link}");
        println!();
        println!("   or in another terminal:");
        println!();
        println!("   export WOR_SERVER={base} WOR_API_KEY={approver_key}");
        println!("   {wor} approvals show {approval_id}");
        println!("   {wor} approvals deny {approval_id} --reason \"exfiltration attempt\"");
        println!(
            "   (or `{wor} approvals approve …`: the mail then goes to the demo's local outbox)"
        );
        println!();
        println!(
            "   Olivia cannot decide it: the key that started a run never approves its calls."
        );
        println!(
            "   Waiting for the decision (up to the approval's expiry; Ctrl-C stops the demo)…"
        );
    }
    let timeout = if args.no_wait {
        STEP_TIMEOUT
    } else {
        wor_engine::DEFAULT_APPROVAL_TTL + STEP_TIMEOUT
    };
    let run = tokio::select! {
        run = watch_for(&owner, &run_id, &mut shown, timeout, |status| {
            !matches!(status, "queued" | "running" | "waiting_for_approval")
        }) => run?,
        () = &mut interrupted => {
            println!();
            println!("Stopped before the decision.");
            return Ok(Scenario { project: created.project.id, checks });
        }
    };
    let decided = owner.get(&format!("/v1/approvals/{approval_id}")).await?;
    let outbox = tools
        .record
        .lock()
        .map_err(|_| anyhow::anyhow!("the tool server's record is poisoned"))?
        .outbox
        .clone();
    match field(&decided, "/status") {
        "approved" => checks.push(Check {
            what: "a person approved the mail, and it went out exactly once (to the local outbox)",
            held: outbox.len() == 1,
        }),
        _ => checks.push(Check {
            what: "the held mail never reached the outbox",
            held: outbox.is_empty(),
        }),
    }
    checks.push(Check {
        what: "the run finished with its summary",
        held: field(&run, "/status") == "succeeded",
    });
    println!();
    println!("   {}", summary(&run));
    if !args.no_wait {
        println!();
        let wor = invocation();
        println!("Where to look (the server stays up until Ctrl-C):");
        println!(
            "   export WOR_SERVER={base} WOR_API_KEY={}",
            created.owner_key.expose()
        );
        println!("   {wor} run get {run_id}     every step, its provenance and decision");
        println!("   {wor} approvals list --status all");
        println!("   {wor} audit verify --data-dir {}", data_dir.display());
        interrupted.await;
    }
    Ok(Scenario {
        project: created.project.id,
        checks,
    })
}

async fn watch(
    api: &ApiClient,
    run_id: &str,
    shown: &mut usize,
    done: impl Fn(&str) -> bool,
) -> anyhow::Result<Value> {
    watch_for(api, run_id, shown, STEP_TIMEOUT, done).await
}

/// Prints the run's new steps until its status satisfies `done`; returns the run.
async fn watch_for(
    api: &ApiClient,
    run_id: &str,
    shown: &mut usize,
    timeout: Duration,
    done: impl Fn(&str) -> bool,
) -> anyhow::Result<Value> {
    let started = Instant::now();
    loop {
        let run = api.get(&format!("/v1/runs/{run_id}")).await?;
        let steps = run
            .get("steps")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        for step in steps.iter().skip(*shown) {
            println!("   {}", describe_step(step).replace('\n', "\n   | "));
        }
        *shown = steps.len().max(*shown);
        if done(field(&run, "/status")) {
            return Ok(run);
        }
        if started.elapsed() > timeout {
            bail!(
                "the run did not get past `{}` in {} s",
                field(&run, "/status"),
                timeout.as_secs()
            );
        }
        tokio::time::sleep(POLL).await;
    }
}

/// How the user can run this same binary from where they stand: `wor` when that name on
/// `PATH` is this binary, else its path relative to the working directory when it lies below
/// it (`target/release/wor`), else its absolute path.
fn invocation() -> String {
    let Ok(me) = std::env::current_exe().and_then(|p| p.canonicalize()) else {
        return "wor".to_owned();
    };
    let on_path = std::env::var_os("PATH").is_some_and(|path| {
        std::env::split_paths(&path)
            .filter_map(|dir| dir.join("wor").canonicalize().ok())
            .next()
            .is_some_and(|found| found == me)
    });
    if on_path {
        return "wor".to_owned();
    }
    let relative = std::env::current_dir()
        .ok()
        .and_then(|cwd| cwd.canonicalize().ok())
        .and_then(|cwd| me.strip_prefix(cwd).ok().map(std::path::Path::to_path_buf));
    match relative {
        Some(path) => path.display().to_string(),
        None => me.display().to_string(),
    }
}
