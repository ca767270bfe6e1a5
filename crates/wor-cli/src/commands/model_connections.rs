//! `wor model-connection …`: clients of the API. API keys are read from an environment
//! variable or standard input, never from a flag (flags show in process listings).

use std::io::Read;
use std::process::ExitCode;

use anyhow::Context;
use serde_json::{Value, json};

use super::{field, print_json};
use crate::client::{ApiClient, ClientArgs};

/// Where to read a provider API key from.
#[derive(Debug, Clone, clap::Args)]
pub struct ApiKeySource {
    /// Read the provider API key from this environment variable.
    #[arg(long, value_name = "VAR", conflicts_with = "api_key_stdin")]
    api_key_env: Option<String>,
    /// Read the provider API key from standard input.
    #[arg(long)]
    api_key_stdin: bool,
}

impl ApiKeySource {
    fn read(&self) -> anyhow::Result<String> {
        match self.read_if_given()? {
            Some(key) => Ok(key),
            None => Err(crate::usage(
                "give the provider API key with --api-key-env VAR or --api-key-stdin",
            )),
        }
    }

    /// The key, or `None` when neither source was given (a local model server in the
    /// operator's `[egress] model_cidrs` may take none; the server decides).
    fn read_if_given(&self) -> anyhow::Result<Option<String>> {
        let key = if let Some(var) = &self.api_key_env {
            std::env::var(var)
                .map_err(|_| crate::usage(format!("environment variable {var} is not set")))?
        } else if self.api_key_stdin {
            let mut text = String::new();
            std::io::stdin()
                .read_to_string(&mut text)
                .context("cannot read the API key from standard input")?;
            text
        } else {
            return Ok(None);
        };
        Ok(Some(key.trim().to_owned()))
    }
}

#[derive(Debug, clap::Subcommand)]
pub enum ModelConnectionCommand {
    /// Add a model connection.
    Create {
        /// A name for the connection (unique in the project).
        name: String,
        /// openai_compatible, anthropic, azure_openai or gemini.
        #[arg(long)]
        provider: String,
        /// The provider's base URL, e.g. https://api.openai.com/v1.
        #[arg(long)]
        base_url: String,
        #[command(flatten)]
        key: ApiKeySource,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// List the project's model connections.
    List(ClientArgs),
    /// Show one model connection.
    Show {
        /// A `con_…` id.
        id: wor_core::ConnectionId,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Replace a connection's API key.
    SetKey {
        /// A `con_…` id.
        id: wor_core::ConnectionId,
        #[command(flatten)]
        key: ApiKeySource,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Revoke a connection and delete its key.
    Revoke {
        /// A `con_…` id.
        id: wor_core::ConnectionId,
        #[command(flatten)]
        client: ClientArgs,
    },
}

fn summary(c: &Value) -> String {
    let configured = c.pointer("/api_key/configured").and_then(Value::as_bool) == Some(true);
    format!(
        "{}  {:<17}  {:<7}  v{}  key {}  {}  {}",
        field(c, "/id"),
        field(c, "/provider"),
        field(c, "/status"),
        c.get("credential_version")
            .and_then(Value::as_i64)
            .unwrap_or(0),
        if configured { "configured" } else { "absent" },
        field(c, "/name"),
        field(c, "/base_url"),
    )
}

fn show(client: &ClientArgs, value: &Value) -> anyhow::Result<()> {
    if client.json {
        print_json(value)
    } else {
        println!("{}", summary(value));
        Ok(())
    }
}

pub async fn run(cmd: ModelConnectionCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        ModelConnectionCommand::Create {
            name,
            provider,
            base_url,
            key,
            client,
        } => {
            let body = match key.read_if_given()? {
                Some(api_key) => {
                    json!({"name": name, "provider": provider, "base_url": base_url, "api_key": api_key})
                }
                None => json!({"name": name, "provider": provider, "base_url": base_url}),
            };
            let created = ApiClient::new(&client)?
                .post("/v1/model-connections", &body)
                .await?;
            show(&client, &created)?;
        }
        ModelConnectionCommand::List(client) => {
            let list = ApiClient::new(&client)?
                .get("/v1/model-connections")
                .await?;
            if client.json {
                print_json(&list)?;
            } else {
                for c in list.as_array().into_iter().flatten() {
                    println!("{}", summary(c));
                }
            }
        }
        ModelConnectionCommand::Show { id, client } => {
            let one = ApiClient::new(&client)?
                .get(&format!("/v1/model-connections/{id}"))
                .await?;
            show(&client, &one)?;
        }
        ModelConnectionCommand::SetKey { id, key, client } => {
            let api_key = key.read()?;
            let updated = ApiClient::new(&client)?
                .put(
                    &format!("/v1/model-connections/{id}/api-key"),
                    &json!({"api_key": api_key}),
                )
                .await?;
            show(&client, &updated)?;
        }
        ModelConnectionCommand::Revoke { id, client } => {
            let revoked = ApiClient::new(&client)?
                .post(&format!("/v1/model-connections/{id}/revoke"), &Value::Null)
                .await?;
            show(&client, &revoked)?;
        }
    }
    Ok(ExitCode::SUCCESS)
}
