//! `wor egress check`: what the egress guard would decide for a URL, without connecting.

use std::process::ExitCode;
use std::sync::Arc;

use wor_egress::{
    EgressConfig, EgressDecision, EgressPolicy, GuardedResolver, HostAllowlist, NameResolver,
    StaticResolver, SystemResolver,
};

use crate::config::{ServerConfig, ServerFlags};

#[derive(Debug, clap::Subcommand)]
pub enum EgressCommand {
    /// Print `allow` or `deny: <reason>`; exit 0 when allowed, 1 when denied, 2 on bad usage.
    Check {
        /// The URL a connection, model or webhook would use.
        url: String,
        /// Resolve HOST to IP and nothing else, as curl's option does; repeatable. With any
        /// `--resolve`, names not listed do not resolve at all (no DNS is asked).
        #[arg(long, value_name = "HOST:IP")]
        resolve: Vec<String>,
        /// Check as production mode does.
        #[arg(long)]
        production: bool,
        /// The connection's host allowlist (`api.example.com`, `*.example.com`, `host:443`);
        /// repeatable.
        #[arg(long = "allow-host", value_name = "HOST")]
        allow_host: Vec<String>,
        /// Print the decision as JSON: `decision`, and `addresses` or `reason`.
        #[arg(long)]
        json: bool,
        /// Also read the operator's `[egress] allowed_cidrs` from the server configuration.
        #[command(flatten)]
        flags: ServerFlags,
    },
}

const EXIT_DENIED: u8 = 1;
const EXIT_USAGE: u8 = 2;

pub async fn run(cmd: EgressCommand) -> anyhow::Result<ExitCode> {
    let EgressCommand::Check {
        url,
        resolve,
        production,
        allow_host,
        json,
        flags,
    } = cmd;
    let usage = |message: String| {
        eprintln!("error: {message}");
        Ok(ExitCode::from(EXIT_USAGE))
    };
    let config = match ServerConfig::resolve(&flags, None, production) {
        Ok(config) => config,
        Err(err) => return usage(format!("{err:#}")),
    };
    let policy = match EgressPolicy::from_config(&EgressConfig {
        production: config.production,
        allowed_cidrs: config.egress_allowed_cidrs.clone(),
        model_cidrs: Vec::new(),
    }) {
        Ok(policy) => policy,
        Err(err) => return usage(err.to_string()),
    };
    let allowlist = if allow_host.is_empty() {
        None
    } else {
        match HostAllowlist::parse(&allow_host) {
            Ok(list) => Some(list),
            Err(err) => return usage(err.to_string()),
        }
    };
    let names: Arc<dyn NameResolver> = if resolve.is_empty() {
        match SystemResolver::from_system_conf() {
            Ok(system) => Arc::new(system),
            Err(err) => {
                return usage(format!(
                    "cannot read the system resolver configuration: {err}"
                ));
            }
        }
    } else {
        let mut fixed = StaticResolver::new();
        for entry in &resolve {
            if let Err(err) = fixed.insert_entry(entry) {
                return usage(err.to_string());
            }
        }
        Arc::new(fixed)
    };
    let resolver = GuardedResolver::new(names, Arc::new(policy));
    let decision = wor_egress::check(&url, allowlist.as_ref(), &resolver).await;
    if json {
        super::print_json(&match &decision {
            EgressDecision::Allow(addresses) => serde_json::json!({
                "url": url,
                "decision": "allow",
                "addresses": addresses.iter().map(ToString::to_string).collect::<Vec<_>>(),
            }),
            EgressDecision::Deny(reason) => serde_json::json!({
                "url": url,
                "decision": "deny",
                "reason": reason.to_string(),
            }),
        })?;
    } else {
        println!("{decision}");
    }
    Ok(match decision {
        EgressDecision::Allow(_) => ExitCode::SUCCESS,
        EgressDecision::Deny(_) => ExitCode::from(EXIT_DENIED),
    })
}
