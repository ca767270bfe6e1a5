//! `wor notify …`: notification routes that send approval requests to Slack or by email, and
//! their delivery log (a client of the API).

use std::process::ExitCode;

use serde_json::{Value, json};

use super::{field, print_json};
use crate::client::{ApiClient, ClientArgs};

#[derive(Debug, clap::Subcommand)]
pub enum NotifyCommand {
    /// Send approval requests to a Slack channel (`--slack-channel`) or by email
    /// (`--email-to`): all of the project's, or only those matching every filter given. Prints
    /// the route; a Slack route's with the path to set as the Slack app's interactivity
    /// request URL.
    Create(Box<CreateRoute>),
    /// The project's notification routes.
    List {
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Delete a route (`ntf_…`) and its sealed secrets.
    Delete {
        id: wor_core::NotificationRouteId,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// The delivery log, newest first: what was posted or updated, and what failed and why.
    Deliveries {
        /// Only this route's (`ntf_…`).
        #[arg(long)]
        route: Option<wor_core::NotificationRouteId>,
        /// Only those about this approval (`apr_…`).
        #[arg(long)]
        approval: Option<wor_core::ApprovalId>,
        /// Only these.
        #[arg(long, value_parser = ["pending", "delivered", "failed"])]
        status: Option<String>,
        /// At most this many (1 to 200).
        #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=200))]
        limit: u32,
        #[command(flatten)]
        client: ClientArgs,
    },
}

/// The flags of `wor notify create`.
#[derive(Debug, clap::Args)]
pub struct CreateRoute {
    /// The route's name, unique in the project.
    name: String,
    /// Slack: the channel id (`C…`).
    #[arg(
        long,
        conflicts_with = "email_to",
        required_unless_present = "email_to"
    )]
    slack_channel: Option<String>,
    /// Slack: the app's bot token (`xoxb-…`); sealed, never shown again. Best given in the
    /// environment, which keeps it out of the process list and shell history.
    #[arg(long, env = "WOR_SLACK_BOT_TOKEN", hide_env_values = true)]
    slack_bot_token: Option<String>,
    /// Slack: the app's signing secret; sealed, never shown again. Best given in the
    /// environment.
    #[arg(long, env = "WOR_SLACK_SIGNING_SECRET", hide_env_values = true)]
    slack_signing_secret: Option<String>,
    /// Slack: the Web API base URL [default: https://slack.com/api].
    #[arg(long)]
    slack_api_url: Option<String>,
    /// Email: a recipient (repeat for more).
    #[arg(long)]
    email_to: Vec<String>,
    /// Email: the sender address.
    #[arg(long, requires = "email_to")]
    email_from: Option<String>,
    /// Email: the SMTP relay's host name or address.
    #[arg(long, requires = "email_to")]
    smtp_host: Option<String>,
    /// Email: the relay's port [default: 587, or 465 with `--smtp-implicit-tls`].
    #[arg(long, requires = "email_to")]
    smtp_port: Option<u16>,
    /// Email: speak SMTP without TLS to a loopback relay (the server's configuration must
    /// allow it); otherwise STARTTLS is required.
    #[arg(long, requires = "email_to", conflicts_with = "smtp_implicit_tls")]
    smtp_plaintext_loopback: bool,
    /// Email: TLS from the first byte (SMTPS, port 465 by default) instead of STARTTLS.
    #[arg(long, requires = "email_to")]
    smtp_implicit_tls: bool,
    /// Email: the relay's user name (with `WOR_SMTP_PASSWORD`); sealed.
    #[arg(long, env = "WOR_SMTP_USERNAME", hide_env_values = true)]
    smtp_username: Option<String>,
    /// Email: the relay's password; sealed, never shown again. Best given in the environment.
    #[arg(long, env = "WOR_SMTP_PASSWORD", hide_env_values = true)]
    smtp_password: Option<String>,
    /// Email: one message every this many minutes listing the requests since the last.
    #[arg(long, requires = "email_to")]
    digest_minutes: Option<u32>,
    /// Only this routine's approval requests (name or `rtn_…` id).
    #[arg(long)]
    routine: Option<String>,
    /// Only approval requests of this tool (`CONNECTION/TOOL`).
    #[arg(long)]
    tool: Option<String>,
    /// Only approval requests this policy id determined.
    #[arg(long)]
    policy: Option<String>,
    #[command(flatten)]
    client: ClientArgs,
}

fn print_route(route: &Value) {
    let filters: Vec<String> = ["routine_id", "tool", "policy"]
        .iter()
        .filter_map(|key| {
            route
                .get(*key)
                .and_then(Value::as_str)
                .map(|v| format!("{key}={v}"))
        })
        .collect();
    let target = match route.get("kind").and_then(Value::as_str) {
        Some("email") => {
            let to: Vec<&str> = route
                .get("email_to")
                .and_then(Value::as_array)
                .map(|to| to.iter().filter_map(Value::as_str).collect())
                .unwrap_or_default();
            let digest = route
                .get("digest_minutes")
                .and_then(Value::as_u64)
                .map(|m| format!(" (digest every {m} min)"))
                .unwrap_or_default();
            format!(
                "email {} via {}:{}{digest}",
                to.join(","),
                field(route, "/smtp_host"),
                route.get("smtp_port").and_then(Value::as_u64).unwrap_or(0)
            )
        }
        _ => format!(
            "slack {}  {}",
            field(route, "/channel"),
            field(route, "/interaction_path")
        ),
    };
    println!(
        "{}  {:<20}  {}  {}",
        field(route, "/id"),
        field(route, "/name"),
        target,
        if filters.is_empty() {
            "every approval request".to_owned()
        } else {
            filters.join(" ")
        },
    );
}

pub async fn run(cmd: NotifyCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        NotifyCommand::Create(create) => {
            let CreateRoute {
                name,
                slack_channel,
                slack_bot_token,
                slack_signing_secret,
                slack_api_url,
                email_to,
                email_from,
                smtp_host,
                smtp_port,
                smtp_plaintext_loopback,
                smtp_implicit_tls,
                smtp_username,
                smtp_password,
                digest_minutes,
                routine,
                tool,
                policy,
                client,
            } = *create;
            let api = ApiClient::new(&client)?;
            let routine_id = match routine {
                Some(routine) => Some(super::routines::routine_id(&api, &routine).await?),
                None => None,
            };
            let body = if email_to.is_empty() {
                json!({
                    "name": name,
                    "kind": "slack",
                    "channel": slack_channel,
                    "slack_api_url": slack_api_url,
                    "slack_bot_token": slack_bot_token,
                    "slack_signing_secret": slack_signing_secret,
                    "routine_id": routine_id,
                    "tool": tool,
                    "policy": policy,
                })
            } else {
                json!({
                    "name": name,
                    "kind": "email",
                    "email_to": email_to,
                    "email_from": email_from,
                    "smtp_host": smtp_host,
                    "smtp_port": smtp_port,
                    "smtp_tls": if smtp_plaintext_loopback {
                        "plaintext_loopback"
                    } else if smtp_implicit_tls {
                        "implicit_tls"
                    } else {
                        "starttls"
                    },
                    "smtp_username": smtp_username,
                    "smtp_password": smtp_password,
                    "digest_minutes": digest_minutes,
                    "routine_id": routine_id,
                    "tool": tool,
                    "policy": policy,
                })
            };
            let route = api.post("/v1/notification-routes", &body).await?;
            if client.json {
                print_json(&route)?;
            } else {
                print_route(&route);
            }
        }
        NotifyCommand::List { client } => {
            let api = ApiClient::new(&client)?;
            let list = api.get("/v1/notification-routes").await?;
            if client.json {
                print_json(&list)?;
            } else {
                for route in list.as_array().into_iter().flatten() {
                    print_route(route);
                }
            }
        }
        NotifyCommand::Delete { id, client } => {
            let api = ApiClient::new(&client)?;
            let route = api.delete(&format!("/v1/notification-routes/{id}")).await?;
            if client.json {
                print_json(&route)?;
            } else {
                println!(
                    "deleted {}  {}",
                    field(&route, "/id"),
                    field(&route, "/name")
                );
            }
        }
        NotifyCommand::Deliveries {
            route,
            approval,
            status,
            limit,
            client,
        } => {
            let api = ApiClient::new(&client)?;
            let mut query = format!("/v1/notification-deliveries?limit={limit}");
            for (key, value) in [
                ("route_id", route.map(|id| id.to_string())),
                ("approval_id", approval.map(|id| id.to_string())),
                ("status", status),
            ] {
                if let Some(value) = value {
                    query.push_str(&format!("&{key}={}", urlencoding(&value)));
                }
            }
            let list = api.get(&query).await?;
            if client.json {
                print_json(&list)?;
            } else {
                for d in list.as_array().into_iter().flatten() {
                    println!(
                        "{}  {:<9}  {:<12}  attempts {}  {}  {}",
                        field(d, "/id"),
                        field(d, "/status"),
                        field(d, "/action"),
                        d.get("attempts").and_then(Value::as_i64).unwrap_or(0),
                        field(d, "/approval_id"),
                        d.get("last_error")
                            .and_then(Value::as_str)
                            .unwrap_or_default(),
                    );
                }
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Percent-encodes a query value.
fn urlencoding(value: &str) -> String {
    url::form_urlencoded::byte_serialize(value.as_bytes()).collect()
}
