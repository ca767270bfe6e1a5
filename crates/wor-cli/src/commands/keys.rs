//! `wor key …`: clients of the API.

use std::process::ExitCode;

use serde_json::json;

use super::{field, print_json};
use crate::client::{ApiClient, ClientArgs};

#[derive(Debug, clap::Subcommand)]
pub enum KeyCommand {
    /// Create a key; print it once on stdout.
    Create {
        /// A name to recognise the key by.
        #[arg(long)]
        name: String,
        /// owner, admin, approver or viewer; never above your own.
        #[arg(long)]
        role: String,
        /// A service key: a role and no person, for automation; it can never approve.
        #[arg(long)]
        service: bool,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// List the project's keys (prefix and metadata only).
    List(ClientArgs),
    /// Revoke a key at once.
    Revoke {
        /// A `key_…` id.
        id: wor_core::ApiKeyId,
        #[command(flatten)]
        client: ClientArgs,
    },
}

pub async fn run(cmd: KeyCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        KeyCommand::Create {
            name,
            role,
            service,
            client,
        } => {
            let created = ApiClient::new(&client)?
                .post(
                    "/v1/keys",
                    &json!({ "name": name, "role": role, "service": service }),
                )
                .await?;
            if client.json {
                print_json(&created)?;
            } else {
                eprintln!(
                    "created {} key `{}` ({}) with role {}; it follows, shown only once:",
                    if service { "service" } else { "personal" },
                    field(&created, "/name"),
                    field(&created, "/id"),
                    field(&created, "/role"),
                );
                println!("{}", field(&created, "/api_key"));
            }
        }
        KeyCommand::List(args) => {
            let keys = ApiClient::new(&args)?.get("/v1/keys").await?;
            if args.json {
                print_json(&keys)?;
            } else {
                for k in keys.as_array().into_iter().flatten() {
                    let state = if k.get("revoked_at").is_some_and(|v| v.is_string()) {
                        "revoked"
                    } else {
                        "active"
                    };
                    let kind = if k.get("service").and_then(|v| v.as_bool()) == Some(true) {
                        "service"
                    } else {
                        "personal"
                    };
                    // The role it acts with; the one it was made with beside it when a
                    // member's demotion lowered it.
                    let made = field(k, "/role");
                    let acts = field(k, "/acts_as");
                    let note = if acts == made {
                        String::new()
                    } else {
                        format!("  (made as {made}; its member's role is now lower)")
                    };
                    println!(
                        "{}  {}…  {:<8}  {:<8}  {:<7}  {}{note}",
                        field(k, "/id"),
                        field(k, "/prefix"),
                        acts,
                        kind,
                        state,
                        field(k, "/name")
                    );
                }
            }
        }
        KeyCommand::Revoke { id, client } => {
            let key = ApiClient::new(&client)?
                .delete(&format!("/v1/keys/{id}"))
                .await?;
            if client.json {
                print_json(&key)?;
            } else {
                eprintln!("revoked {}", field(&key, "/id"));
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
