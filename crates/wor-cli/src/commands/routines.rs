//! `wor routine …`: clients of the API.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use serde_json::{Value, json};

use super::{field, print_json};
use crate::client::{ApiClient, ClientArgs};

#[derive(Debug, clap::Subcommand)]
pub enum RoutineCommand {
    /// Create a routine from a TOML file, or make a new version of it if it changed.
    Apply {
        /// The routine definition (see docs/routines.md); `-` reads standard input.
        #[arg(short = 'f', long = "file", value_name = "FILE")]
        file: PathBuf,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// List the project's routines.
    List(ClientArgs),
    /// Show a routine (by name or `rtn_…` id): its current definition, versions and the next
    /// firings of its schedule.
    Show {
        routine: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Make a new webhook secret for a routine and print it once (the old one stops working).
    WebhookSecret {
        routine: String,
        /// The secret that signs run webhooks, instead of the one that verifies inbound ones.
        #[arg(long)]
        notify: bool,
        #[command(flatten)]
        client: ClientArgs,
    },
}

/// Resolves a routine name to its id through the list; an id passes through, checked (a
/// malformed one is a usage error).
pub(crate) async fn routine_id(
    api: &ApiClient,
    routine: &str,
) -> anyhow::Result<wor_core::RoutineId> {
    super::id_or_name(
        api,
        routine,
        wor_core::RoutineId::PREFIX,
        "routine",
        "/v1/routines",
    )
    .await
}

pub async fn run(cmd: RoutineCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        RoutineCommand::Apply { file, client } => {
            let toml = if file.as_os_str() == "-" {
                std::io::read_to_string(std::io::stdin()).context("cannot read standard input")?
            } else {
                std::fs::read_to_string(&file)
                    .map_err(|e| crate::usage(format!("cannot read `{}`: {e}", file.display())))?
            };
            let applied = ApiClient::new(&client)?
                .post("/v1/routines", &json!({ "toml": toml }))
                .await?;
            if client.json {
                print_json(&applied)?;
            } else {
                let version = applied.get("version").and_then(Value::as_i64).unwrap_or(0);
                let changed = applied.get("changed").and_then(Value::as_bool) == Some(true);
                println!(
                    "{} {} ({}) version {version}",
                    if changed { "applied" } else { "unchanged" },
                    field(&applied, "/routine/name"),
                    field(&applied, "/routine/id"),
                );
                // The server's sentences quote what the routine names: escaped for the terminal.
                for warning in applied
                    .get("warnings")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .filter_map(Value::as_str)
                {
                    eprintln!("warning: {}", super::for_terminal(warning));
                }
                for (key, what) in [
                    (
                        "webhook_secret",
                        "inbound webhook secret (shown once; it verifies POST /hooks/…):",
                    ),
                    (
                        "notify_secret",
                        "run webhook secret (shown once; receivers verify run webhooks with it):",
                    ),
                ] {
                    if let Some(secret) = applied.get(key).and_then(Value::as_str) {
                        eprintln!("{what}");
                        println!("{secret}");
                    }
                }
            }
        }
        RoutineCommand::List(client) => {
            let list = ApiClient::new(&client)?.get("/v1/routines").await?;
            if client.json {
                print_json(&list)?;
            } else {
                for r in list.as_array().into_iter().flatten() {
                    println!(
                        "{}  v{:<3}  {}",
                        field(r, "/id"),
                        r.get("current_version")
                            .and_then(Value::as_i64)
                            .unwrap_or(0),
                        field(r, "/name")
                    );
                }
            }
        }
        RoutineCommand::Show { routine, client } => {
            let api = ApiClient::new(&client)?;
            let id = routine_id(&api, &routine).await?;
            let detail = api.get(&format!("/v1/routines/{id}")).await?;
            if client.json {
                print_json(&detail)?;
            } else {
                println!(
                    "{} ({})",
                    field(&detail, "/routine/name"),
                    field(&detail, "/routine/id")
                );
                for v in detail
                    .get("versions")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                {
                    println!(
                        "  v{:<3} {}  {}",
                        v.get("version").and_then(Value::as_i64).unwrap_or(0),
                        field(v, "/created_at"),
                        field(v, "/content_hash"),
                    );
                }
                let firings: Vec<&str> = detail
                    .get("next_firings")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .filter_map(Value::as_str)
                    .collect();
                if !firings.is_empty() {
                    println!("next firings (UTC):");
                    for firing in firings {
                        println!("  {firing}");
                    }
                }
                println!("\n{}", field(&detail, "/source_toml"));
            }
        }
        RoutineCommand::WebhookSecret {
            routine,
            notify,
            client,
        } => {
            let api = ApiClient::new(&client)?;
            let id = routine_id(&api, &routine).await?;
            let kind = if notify { "notify" } else { "inbound" };
            let made = api
                .post(
                    &format!("/v1/routines/{id}/webhook-secret?for={kind}"),
                    &Value::Null,
                )
                .await?;
            if client.json {
                print_json(&made)?;
            } else {
                println!("{}", field(&made, "/secret"));
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
