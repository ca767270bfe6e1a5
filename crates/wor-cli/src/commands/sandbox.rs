//! `wor sandbox exec`: run a command under exactly the profile a tool gets; and the sandbox
//! layers this host supports, for `wor doctor`.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use wor_egress::{EgressPolicy, GuardedResolver, NameResolver, StaticResolver, SystemResolver};
use wor_sandbox::{
    NetworkAccess, Sandbox, SandboxConfig, SandboxExit, SandboxProfile, SandboxStdio,
};

use crate::env;

#[derive(Debug, clap::Args)]
pub struct SandboxFlags {
    /// Directory for per-operation sandbox roots [default: a `wor-sandbox` directory in the
    /// system temporary directory].
    #[arg(long, env = env::SANDBOX_DIR, value_name = "DIR")]
    state_dir: Option<std::path::PathBuf>,
}

#[derive(Debug, clap::Subcommand)]
pub enum SandboxCommand {
    /// Run a command in the sandbox, with the profile a tool gets; its exit code is passed
    /// through.
    Exec(ExecArgs),
}

#[derive(Debug, clap::Args)]
pub struct ExecArgs {
    #[command(flatten)]
    flags: SandboxFlags,
    /// Allow HTTP CONNECT through the egress proxy to this host (`api.example.com`,
    /// `*.example.com`, optionally `:port`); repeatable. Without it there is no network.
    #[arg(long = "allow-host", value_name = "HOST")]
    allow_hosts: Vec<String>,
    /// A special-use CIDR the egress guard allows anyway (as the server's `allowed_cidrs`).
    #[arg(long = "allow-cidr", value_name = "CIDR")]
    allow_cidrs: Vec<String>,
    /// Resolve HOST to IP instead of asking DNS (`HOST:IP`); repeatable.
    #[arg(long, value_name = "HOST:IP")]
    resolve: Vec<String>,
    /// Pass this variable of wor's environment into the sandbox; repeatable. Nothing else is.
    #[arg(long = "env", value_name = "NAME")]
    env: Vec<String>,
    /// The command and its arguments.
    #[arg(last = true, required = true, value_name = "CMD")]
    command: Vec<String>,
}

fn sandbox(flags: &SandboxFlags, resolver: GuardedResolver) -> anyhow::Result<Sandbox> {
    let helper = std::env::current_exe().context("cannot find the wor binary")?;
    let state_dir = flags
        .state_dir
        .clone()
        .unwrap_or_else(|| std::env::temp_dir().join("wor-sandbox"));
    Ok(Sandbox::new(SandboxConfig {
        helper,
        state_dir,
        resolver: Arc::new(resolver),
        startup_timeout: Duration::from_secs(30),
    })?)
}

pub async fn exec(args: ExecArgs) -> anyhow::Result<ExitCode> {
    let Some((program, rest)) = args.command.split_first() else {
        return Err(crate::usage("no command given"));
    };
    let path_var = std::env::var(env::PATH).ok();
    let program = wor_sandbox::resolve_program(program, path_var.as_deref())
        .with_context(|| format!("command `{program}` not found"))?;
    let mut profile = SandboxProfile::new(program).args(rest.iter().cloned());
    for name in &args.env {
        let value = std::env::var(name)
            .with_context(|| format!("variable `{name}` is not set in wor's environment"))?;
        profile = profile.env(name.clone(), value);
    }
    if !args.allow_hosts.is_empty() {
        profile = profile.network(NetworkAccess::Proxy(args.allow_hosts.clone()));
    }
    let policy = EgressPolicy::from_config(&wor_egress::EgressConfig {
        production: false,
        allowed_cidrs: args.allow_cidrs.clone(),
        model_cidrs: Vec::new(),
    })?;
    let names: Arc<dyn NameResolver> = if args.resolve.is_empty() {
        Arc::new(SystemResolver::from_system_conf()?)
    } else {
        let mut map = StaticResolver::new();
        for entry in &args.resolve {
            map.insert_entry(entry)?;
        }
        Arc::new(map)
    };
    let sandbox = sandbox(&args.flags, GuardedResolver::new(names, Arc::new(policy)))?;
    let mut process = sandbox.spawn(&profile, SandboxStdio::Inherit).await?;
    let code = match process.wait().await? {
        SandboxExit::Code(code) => u8::try_from(code).unwrap_or(u8::MAX),
        SandboxExit::TimedOut | SandboxExit::Killed => 137,
    };
    Ok(ExitCode::from(code))
}

/// Every sandbox layer, applied for real, and the Wasm runtime: `(name, supported, detail)`.
pub(crate) async fn layers(flags: &SandboxFlags) -> anyhow::Result<Vec<(String, bool, String)>> {
    let resolver = GuardedResolver::new(
        Arc::new(StaticResolver::new()),
        Arc::new(EgressPolicy::development()),
    );
    let sandbox = sandbox(flags, resolver)?;
    let mut layers: Vec<(String, bool, String)> = wor_sandbox::doctor(&sandbox)
        .await
        .into_iter()
        .map(|r| (r.layer.name().to_owned(), r.supported, r.detail))
        .collect();
    // Wasm tools need no namespace, but their runtime reserves address space for its pool.
    layers.push(match wor_wasm::WasmRuntime::new() {
        Ok(_) => ("wasm-runtime".to_owned(), true, String::new()),
        Err(error) => ("wasm-runtime".to_owned(), false, error.to_string()),
    });
    Ok(layers)
}
