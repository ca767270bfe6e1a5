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
//!
//! It also plays the person `wor` asks to authorize a connection again: when a request of the
//! session meets a `401` (a server that asks only after `initialize`) or a `403` with
//! `insufficient_scope`, it authorizes again, asking for the scopes it asked for before united
//! with those the challenge names, and carries on in a new session, at most
//! [`MAX_AUTHORIZATIONS`] times. Its client ID metadata document URL is the suite's, which the
//! suite's authorization server accepts without fetching it.
#![allow(
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "a command-line program reports on its streams"
)]

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr};
use std::process::ExitCode;
use std::sync::Arc;

use secrecy::SecretString;
use serde::Deserialize;
use serde_json::{Map, Value, json};
use wor_egress::{
    EgressClient, EgressLimits, EgressPolicy, EgressRequest, HostAllowlist, StaticResolver,
};
use wor_tools::oauth::{
    self, AuthorizationDiscovery, Challenge, ClientMetadataUrl, ClientRegistration, Pkce,
};
use wor_tools::{ConnectionCredentials, McpError, McpLimits, McpSession, StreamableHttpEndpoint};

/// Where the authorization server is told to send the browser; never contacted.
const REDIRECT_URI: &str = "http://localhost:3000/callback";
/// The URL of this client's ID metadata document, the one the suite's authorization server
/// expects (it does not fetch it).
const CLIENT_METADATA_URL: &str = "https://conformance-test.local/client-metadata.json";
/// The most authorizations one run makes: a server that keeps asking for more scope is not
/// asked again and again.
const MAX_AUTHORIZATIONS: usize = 3;

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

/// Why a session stopped.
enum Stop {
    /// The server asked for (more) authorization.
    Challenged(Challenge),
    Failed(String),
}

impl From<McpError> for Stop {
    fn from(error: McpError) -> Self {
        match error {
            McpError::AuthorizationRequired(challenge) | McpError::InsufficientScope(challenge) => {
                Stop::Challenged(challenge)
            }
            other => Stop::Failed(other.to_string()),
        }
    }
}

async fn run(url: &str, context: Context) -> Result<(), String> {
    let egress = loopback_egress()?;
    let parsed = url::Url::parse(url).map_err(|e| format!("the server url: {e}"))?;
    let host = parsed.host_str().unwrap_or_default();
    let port = parsed.port_or_known_default().unwrap_or(80);
    let allowlist = HostAllowlist::parse([format!("{host}:{port}")]).map_err(|e| format!("{e}"))?;
    let mut person = Person {
        egress: egress.clone(),
        url: url.to_owned(),
        context,
        client: None,
        scopes: Vec::new(),
        authorizations: 0,
    };

    let mut credentials = match oauth::probe(&egress, url, Some(&allowlist))
        .await
        .map_err(|e| e.to_string())?
    {
        None => ConnectionCredentials::none(),
        Some(challenge) => person.authorize(&challenge).await?,
    };
    let mut called = BTreeSet::new();
    loop {
        let endpoint = StreamableHttpEndpoint {
            url: url.to_owned(),
            allowlist: allowlist.clone(),
            credentials: credentials.clone(),
        };
        match call_every_tool(&egress, endpoint, &mut called).await {
            Ok(()) => return Ok(()),
            Err(Stop::Failed(error)) => return Err(error),
            Err(Stop::Challenged(challenge)) => {
                if person.authorizations >= MAX_AUTHORIZATIONS {
                    return Err(format!(
                        "the server still refuses after {MAX_AUTHORIZATIONS} authorizations"
                    ));
                }
                credentials = person.authorize(&challenge).await?;
            }
        }
    }
}

/// One session: lists the tools and calls each not called yet.
async fn call_every_tool(
    egress: &EgressClient,
    endpoint: StreamableHttpEndpoint,
    called: &mut BTreeSet<String>,
) -> Result<(), Stop> {
    let session = McpSession::connect_http(egress, endpoint, McpLimits::default()).await?;
    let outcome = async {
        let tools = session.list_tools().await?;
        for tool in &tools {
            if called.contains(&tool.name) {
                continue;
            }
            let arguments = example_arguments(&tool.input_schema);
            let result = session
                .call_tool(&tool.name, arguments)
                .await
                .map_err(|e| match Stop::from(e) {
                    Stop::Failed(error) => {
                        Stop::Failed(format!("calling `{}`: {error}", tool.name))
                    }
                    challenged => challenged,
                })?;
            called.insert(tool.name.clone());
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
        Ok::<(), Stop>(())
    }
    .await;
    session.close().await;
    outcome
}

/// The person who authorizes, with this program as their browser.
struct Person {
    egress: EgressClient,
    url: String,
    context: Context,
    /// The client, once chosen (registered once, reused for every authorization).
    client: Option<ClientRegistration>,
    /// The scopes asked for so far.
    scopes: Vec<String>,
    authorizations: usize,
}

impl Person {
    /// The authorization of `wor connection authorize`, asking for the scopes asked for before
    /// and those `challenge` names.
    async fn authorize(&mut self, challenge: &Challenge) -> Result<ConnectionCredentials, String> {
        self.authorizations += 1;
        let discovery = oauth::discover(&self.egress, &self.url, Some(challenge))
            .await
            .map_err(|e| e.to_string())?;
        let client = self.client(&discovery).await?;
        let asked = oauth::requested_scopes(Some(challenge), &discovery);
        self.scopes =
            oauth::union_scopes(self.scopes.iter().chain(asked.iter()).map(String::as_str));
        let token = browse(&self.egress, &discovery, &client, &self.scopes).await?;
        ConnectionCredentials::bearer(token).map_err(|e| e.to_string())
    }

    /// The scenario's registered client, else the metadata document's URL where the server
    /// accepts one, else a dynamically registered one: `wor`'s order.
    async fn client(
        &mut self,
        discovery: &AuthorizationDiscovery,
    ) -> Result<ClientRegistration, String> {
        if let Some(client) = &self.client {
            return Ok(client.clone());
        }
        let given = self.context.client_id.clone().map(|client_id| {
            ClientRegistration::pre_registered(
                client_id,
                self.context.client_secret.clone().map(SecretString::from),
                &discovery.authorization_server,
            )
        });
        let document = ClientMetadataUrl::parse(CLIENT_METADATA_URL);
        let chosen = oauth::choose_client(
            &self.egress,
            discovery,
            given,
            document.as_ref(),
            "wor",
            REDIRECT_URI,
        )
        .await
        .map_err(|e| e.to_string())?;
        self.client = Some(chosen.registration.clone());
        Ok(chosen.registration)
    }
}

/// The browser: opens the authorization URL, which the suite's server answers at once with a
/// redirect to the callback; the code it carries is exchanged for tokens.
async fn browse(
    egress: &EgressClient,
    discovery: &AuthorizationDiscovery,
    client: &ClientRegistration,
    scopes: &[String],
) -> Result<SecretString, String> {
    let state = oauth::new_state().map_err(|e| e.to_string())?;
    let pkce = Pkce::new().map_err(|e| e.to_string())?;
    let authorization_url = oauth::authorization_url(
        discovery,
        &client.client_id,
        REDIRECT_URI,
        scopes,
        &state,
        &pkce,
    )
    .map_err(|e| e.to_string())?;
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
        discovery,
        client,
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
