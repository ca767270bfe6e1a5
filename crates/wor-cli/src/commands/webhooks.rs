//! `wor webhook …`: sign and verify webhook bodies locally (for receivers and senders, and for
//! tests), and read the delivery log of run webhooks (a client of the API).

use std::io::Read as _;
use std::process::ExitCode;

use anyhow::Context;
use serde_json::Value;
use wor_secrets::StandardWebhookSecret;
use wor_secrets::webhook_signature;

use super::{field, print_json};
use crate::client::{ApiClient, ClientArgs};

/// The replay window `verify` applies unless told otherwise.
const DEFAULT_WINDOW_SECS: u64 = 300;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Scheme {
    /// `wor-timestamp` + `wor-signature`: hex HMAC-SHA256 of `${timestamp}.${body}`.
    Wor,
    /// Standard Webhooks: `v1,<base64>` over `${id}.${timestamp}.${body}`.
    Standard,
}

#[derive(Debug, clap::Subcommand)]
pub enum WebhookCommand {
    /// Sign the body on standard input; prints the headers to send.
    Sign {
        /// The webhook secret.
        #[arg(long, env = "WOR_WEBHOOK_SECRET", hide_env_values = true)]
        secret: String,
        /// Unix seconds [default: now].
        #[arg(long)]
        timestamp: Option<i64>,
        #[arg(long, value_enum, default_value = "wor")]
        scheme: Scheme,
        /// The delivery id (required with `--scheme standard`).
        #[arg(long)]
        id: Option<String>,
        /// Print the headers as one JSON object instead of `name: value` lines.
        #[arg(long)]
        json: bool,
    },
    /// Verify the body on standard input against a signature. Exit 0 when valid, 1 when not.
    Verify {
        /// The webhook secret.
        #[arg(long, env = "WOR_WEBHOOK_SECRET", hide_env_values = true)]
        secret: String,
        /// The timestamp header, Unix seconds.
        #[arg(long)]
        timestamp: i64,
        /// The signature header (`wor`: hex; `standard`: `v1,<base64>` entries).
        #[arg(long)]
        signature: String,
        #[arg(long, value_enum, default_value = "wor")]
        scheme: Scheme,
        /// The delivery id (required with `--scheme standard`).
        #[arg(long)]
        id: Option<String>,
        /// Replay window in seconds around `--now`.
        #[arg(long, default_value_t = DEFAULT_WINDOW_SECS)]
        window: u64,
        /// Check as of this Unix time [default: now] (for stored deliveries and test vectors).
        #[arg(long)]
        now: Option<i64>,
        /// Print `{"valid": true}` or `{"valid": false, "reason": …}`.
        #[arg(long)]
        json: bool,
    },
    /// The delivery log of run webhooks, newest first.
    Deliveries {
        /// Only this routine's (name or `rtn_…` id).
        #[arg(long)]
        routine: Option<String>,
        /// Only this run's (`run_…`).
        #[arg(long)]
        run: Option<wor_core::RunId>,
        /// At most this many (1 to 200).
        #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=200))]
        limit: u32,
        #[command(flatten)]
        client: ClientArgs,
    },
}

fn read_body() -> anyhow::Result<Vec<u8>> {
    let mut body = Vec::new();
    std::io::stdin()
        .read_to_end(&mut body)
        .context("cannot read the body from standard input")?;
    Ok(body)
}

fn now_secs() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

pub async fn run(cmd: WebhookCommand) -> anyhow::Result<ExitCode> {
    // An empty secret signs what no routine would take: a mistake, said before anything else.
    if let WebhookCommand::Sign { secret, .. } | WebhookCommand::Verify { secret, .. } = &cmd
        && secret.is_empty()
    {
        return Err(crate::usage(
            "the webhook secret is empty: give --secret or WOR_WEBHOOK_SECRET",
        ));
    }
    match cmd {
        WebhookCommand::Sign {
            secret,
            timestamp,
            scheme,
            id,
            json,
        } => {
            let body = read_body()?;
            let timestamp = timestamp.unwrap_or_else(now_secs);
            let headers: Vec<(&str, String)> = match scheme {
                Scheme::Wor => vec![
                    ("wor-timestamp", timestamp.to_string()),
                    (
                        "wor-signature",
                        webhook_signature::sign(&secret, timestamp, &body),
                    ),
                ],
                Scheme::Standard => {
                    let Some(id) = id else {
                        return Err(crate::usage("--scheme standard needs --id"));
                    };
                    let secret = StandardWebhookSecret::parse(&secret)
                        .map_err(|e| crate::usage(format!("--secret: {e}")))?;
                    let signature = secret.sign(&id, timestamp, &body);
                    vec![
                        ("webhook-id", id),
                        ("webhook-timestamp", timestamp.to_string()),
                        ("webhook-signature", signature),
                    ]
                }
            };
            if json {
                print_json(&Value::Object(
                    headers
                        .into_iter()
                        .map(|(name, value)| (name.to_owned(), Value::String(value)))
                        .collect(),
                ))?;
            } else {
                for (name, value) in headers {
                    println!("{name}: {value}");
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        WebhookCommand::Verify {
            secret,
            timestamp,
            signature,
            scheme,
            id,
            window,
            now,
            json,
        } => {
            let body = read_body()?;
            let now = now.unwrap_or_else(now_secs);
            let checked = match scheme {
                Scheme::Wor => {
                    webhook_signature::verify(&secret, timestamp, &body, &signature, now, window)
                }
                Scheme::Standard => {
                    let Some(id) = id else {
                        return Err(crate::usage("--scheme standard needs --id"));
                    };
                    // A secret that is not one is a mistake in the command, not a signature
                    // that failed (exit 2, not 1).
                    let secret = StandardWebhookSecret::parse(&secret)
                        .map_err(|e| crate::usage(format!("--secret: {e}")))?;
                    secret.verify(&id, timestamp, &body, &signature, now, window)
                }
            };
            if json {
                print_json(&match &checked {
                    Ok(()) => serde_json::json!({ "valid": true }),
                    Err(error) => {
                        serde_json::json!({ "valid": false, "reason": error.to_string() })
                    }
                })?;
            } else {
                match &checked {
                    Ok(()) => println!("valid"),
                    Err(error) => println!("invalid: {error}"),
                }
            }
            Ok(if checked.is_ok() {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            })
        }
        WebhookCommand::Deliveries {
            routine,
            run,
            limit,
            client,
        } => {
            let api = ApiClient::new(&client)?;
            let mut query = format!("/v1/webhook-deliveries?limit={limit}");
            if let Some(routine) = routine {
                query.push_str(&format!(
                    "&routine_id={}",
                    super::routines::routine_id(&api, &routine).await?
                ));
            }
            if let Some(run) = run {
                query.push_str(&format!("&run_id={run}"));
            }
            let list = api.get(&query).await?;
            if client.json {
                print_json(&list)?;
            } else {
                for d in list.as_array().into_iter().flatten() {
                    println!(
                        "{}  {:<9}  {:<26}  attempts {}  {}  {}",
                        field(d, "/id"),
                        field(d, "/status"),
                        field(d, "/event"),
                        d.get("attempts").and_then(Value::as_i64).unwrap_or(0),
                        field(d, "/run_id"),
                        d.get("last_error")
                            .and_then(Value::as_str)
                            .unwrap_or_default(),
                    );
                }
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}
