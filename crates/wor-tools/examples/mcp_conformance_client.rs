//! The client under test of the MCP conformance suite's client scenarios
//! (`.ci/mcp-conformance.sh`): the suite starts a server for a scenario and runs this program
//! with the server's URL as its last argument, the scenario's name in
//! `MCP_CONFORMANCE_SCENARIO` and, for some, JSON in `MCP_CONFORMANCE_CONTEXT`.
//!
//! It does what `wor` does with a streamable-HTTP connection, through the same code: the
//! egress client (loopback allowed, as an operator lists a private range), the authorization
//! of `wor_tools::oauth` when the server answers `401` (this program plays the person's
//! browser, reading the code from the authorization server's redirect), then an MCP session
//! that lists the tools and calls each with arguments made from its input schema.
#![allow(
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "a command-line program reports on its streams"
)]

use std::net::{IpAddr, Ipv4Addr};
use std::process::ExitCode;
use std::sync::Arc;

use secrecy::SecretString;
use serde::Deserialize;
use serde_json::{Map, Value, json};
use wor_egress::{
    EgressClient, EgressLimits, EgressPolicy, EgressRequest, HostAllowlist, StaticResolver,
};
use wor_tools::oauth::{self, Challenge, ClientRegistration, Pkce};
use wor_tools::{ConnectionCredentials, McpLimits, McpSession, StreamableHttpEndpoint};

/// Where the authorization server is told to send the browser; never contacted.
const REDIRECT_URI: &str = "http://localhost:3000/callback";

/// The scenario's context: the operator-registered client, where a scenario has one.
#[derive(Debug, Default, Deserialize)]
struct Context {
    client_id: Option<String>,
    client_secret: Option<String>,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let Some(url) = std::env::args().next_back() else {
        eprintln!("usage: mcp_conformance_client <server url>");
        return ExitCode::FAILURE;
    };
    let context = match std::env::var("MCP_CONFORMANCE_CONTEXT") {
        Ok(text) => match serde_json::from_str::<Context>(&text) {
            Ok(context) => context,
            Err(error) => {
                eprintln!("MCP_CONFORMANCE_CONTEXT is not the expected JSON: {error}");
                return ExitCode::FAILURE;
            }
        },
        Err(_) => Context::default(),
    };
    match run(&url, context).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::FAILURE
        }
    }
}

fn loopback_egress() -> Result<EgressClient, String> {
    let policy = EgressPolicy::development()
        .with_allowed_cidrs([
            "127.0.0.1/32".parse().map_err(|e| format!("{e}"))?,
            "::1/128".parse().map_err(|e| format!("{e}"))?,
        ])
        .map_err(|e| e.to_string())?;
    let mut resolver = StaticResolver::new();
    resolver.insert("localhost", IpAddr::V4(Ipv4Addr::LOCALHOST));
    EgressClient::with_resolver(policy, Arc::new(resolver), EgressLimits::default())
        .map_err(|e| e.to_string())
}

async fn run(url: &str, context: Context) -> Result<(), String> {
    let egress = loopback_egress()?;
    let parsed = url::Url::parse(url).map_err(|e| format!("the server url: {e}"))?;
    let host = parsed.host_str().unwrap_or_default();
    let port = parsed.port_or_known_default().unwrap_or(80);
    let allowlist = HostAllowlist::parse([format!("{host}:{port}")]).map_err(|e| format!("{e}"))?;

    let credentials = match oauth::probe(&egress, url, Some(&allowlist))
        .await
        .map_err(|e| e.to_string())?
    {
        None => ConnectionCredentials::none(),
        Some(challenge) => {
            let token = authorize(&egress, url, &challenge, context).await?;
            ConnectionCredentials::bearer(token).map_err(|e| e.to_string())?
        }
    };
    let endpoint = StreamableHttpEndpoint {
        url: url.to_owned(),
        allowlist,
        credentials,
    };
    let session = McpSession::connect_http(&egress, endpoint, McpLimits::default())
        .await
        .map_err(|e| e.to_string())?;
    let tools = session.list_tools().await.map_err(|e| e.to_string())?;
    for tool in &tools {
        let arguments = example_arguments(&tool.input_schema);
        let result = session
            .call_tool(&tool.name, arguments)
            .await
            .map_err(|e| format!("calling `{}`: {e}", tool.name))?;
        println!(
            "called `{}`: {}",
            tool.name,
            if result.is_error {
                "a tool error"
            } else {
                "ok"
            }
        );
    }
    session.close().await;
    Ok(())
}

/// The authorization of `wor connection authorize`, with this program as the browser.
async fn authorize(
    egress: &EgressClient,
    url: &str,
    challenge: &Challenge,
    context: Context,
) -> Result<SecretString, String> {
    let discovery = oauth::discover(egress, url, Some(challenge))
        .await
        .map_err(|e| e.to_string())?;
    let client = match context.client_id {
        Some(client_id) => ClientRegistration::pre_registered(
            client_id,
            context.client_secret.map(SecretString::from),
            &discovery.authorization_server,
        ),
        None => oauth::register_client(egress, &discovery, "wor", REDIRECT_URI)
            .await
            .map_err(|e| e.to_string())?,
    };
    let state = oauth::new_state().map_err(|e| e.to_string())?;
    let pkce = Pkce::new().map_err(|e| e.to_string())?;
    let scopes = oauth::requested_scopes(Some(challenge), &discovery);
    let authorization_url = oauth::authorization_url(
        &discovery,
        &client.client_id,
        REDIRECT_URI,
        &scopes,
        &state,
        &pkce,
    )
    .map_err(|e| e.to_string())?;

    // The browser: the authorization server approves at once and redirects to the callback.
    let answer = egress
        .send(EgressRequest::get(&authorization_url))
        .await
        .map_err(|e| format!("the authorization request: {e}"))?;
    let location = answer
        .headers
        .get("location")
        .and_then(|value| value.to_str().ok())
        .ok_or_else(|| format!("the authorization request answered {}", answer.status))?;
    let callback = url::Url::parse(location).map_err(|e| format!("the redirect: {e}"))?;
    let param = |name: &str| {
        callback
            .query_pairs()
            .find(|(key, _)| key == name)
            .map(|(_, value)| value.into_owned())
    };
    if param("state").as_deref() != Some(state.as_str()) {
        return Err("the redirect does not carry the request's state".to_owned());
    }
    let code = param("code").ok_or("the redirect carries no code")?;
    let tokens = oauth::exchange_code(
        egress,
        &discovery,
        &client,
        &SecretString::from(code),
        REDIRECT_URI,
        &pkce,
    )
    .await
    .map_err(|e| e.to_string())?;
    Ok(tokens.access_token)
}

/// Arguments a tool's input schema accepts: each required property given a value of its type.
fn example_arguments(schema: &Map<String, Value>) -> Map<String, Value> {
    let required: Vec<&str> = schema
        .get("required")
        .and_then(Value::as_array)
        .map(|names| names.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let properties = schema.get("properties").and_then(Value::as_object);
    required
        .into_iter()
        .map(|name| {
            let kind = properties
                .and_then(|p| p.get(name))
                .and_then(|p| p.get("type"))
                .and_then(Value::as_str)
                .unwrap_or("string");
            let value = match kind {
                "number" | "integer" => json!(2),
                "boolean" => json!(true),
                "array" => json!([]),
                "object" => json!({}),
                _ => json!("conformance"),
            };
            (name.to_owned(), value)
        })
        .collect()
}
