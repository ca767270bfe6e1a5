//! `wor connection …`: tool connections, clients of the API. Credentials are read from
//! environment variables or standard input, never from a flag (flags show in process
//! listings). `enable` pins the hashes of a review the admin saved, so what is pinned is what
//! they saw.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, bail};
use serde_json::{Value, json};

use super::{field, for_terminal, one_line, print_json};
use crate::client::{ApiClient, ClientArgs};

#[derive(Debug, clap::Subcommand)]
#[expect(
    clippy::large_enum_variant,
    reason = "one command is parsed once per process"
)]
pub enum ToolConnectionCommand {
    /// Add a tool connection; it waits for review before any tool runs.
    #[command(group(clap::ArgGroup::new("local").args(["stdio", "wasm"])))]
    Create {
        /// A name for the connection: rosters call its tools `NAME/TOOL`.
        name: String,
        /// mcp_http, mcp_stdio, http_api or wasm [default: mcp_stdio with --stdio, wasm with
        /// --wasm, http_api with --openapi or --tools-file, else mcp_http].
        #[arg(long)]
        kind: Option<String>,
        /// The MCP endpoint or API base URL (with --openapi, the document's first server when
        /// it is absolute).
        #[arg(long, required_unless_present_any = ["stdio", "wasm", "openapi"])]
        url: Option<String>,
        /// A host pattern the connection may reach (repeat for several); for a stdio server,
        /// the only hosts its sandbox may reach; for a Wasm component, the only hosts its
        /// outgoing HTTP may reach.
        #[arg(long = "allow", value_name = "HOST")]
        allowlist: Vec<String>,
        /// A stdio MCP server: the program, started in the sandbox (absolute path).
        #[arg(long, value_name = "PROGRAM", conflicts_with = "url")]
        stdio: Option<String>,
        /// A Wasm tool: the component file (WASI preview 2, the `wor:tool` world; absolute path).
        #[arg(long, value_name = "COMPONENT", conflicts_with_all = ["url", "stdio"])]
        wasm: Option<String>,
        /// An argument of the stdio program (repeat, in order).
        #[arg(
            long = "arg",
            value_name = "ARG",
            requires = "stdio",
            allow_hyphen_values = true
        )]
        args: Vec<String>,
        /// A host path the stdio server may read, bound read-only; for a Wasm component, a
        /// directory it may read at the same path (repeat).
        #[arg(long = "read-only", value_name = "PATH", requires = "local")]
        read_only: Vec<String>,
        /// An environment variable of the stdio server or Wasm component, its value read from
        /// this CLI's own environment variable VAR (repeat; stored encrypted).
        #[arg(long = "env-from", value_name = "NAME=VAR", requires = "local")]
        env: Vec<String>,
        /// Read a bearer token from this environment variable.
        #[arg(long, value_name = "VAR", conflicts_with = "bearer_stdin")]
        bearer_env: Option<String>,
        /// Read a bearer token from standard input.
        #[arg(long)]
        bearer_stdin: bool,
        /// A secret header, its value read from an environment variable (repeatable).
        #[arg(long = "header-env", value_name = "NAME=VAR")]
        headers: Vec<String>,
        /// An HTTP API from an OpenAPI 3.0/3.1 document (JSON or YAML): its operations become
        /// the connection's tools.
        #[arg(long, value_name = "FILE", conflicts_with_all = ["stdio", "wasm", "tools_file"])]
        openapi: Option<PathBuf>,
        /// An operationId of the --openapi document to import (repeat); all when absent.
        #[arg(long = "operation", value_name = "ID", requires = "openapi")]
        operations: Vec<String>,
        /// The secret of a security scheme of the --openapi document, read from an environment
        /// variable (repeat): an api key header or the bearer token, as the scheme says.
        #[arg(long = "scheme-env", value_name = "SCHEME=VAR", requires = "openapi")]
        schemes: Vec<String>,
        /// An HTTP API whose tools are written in this file (JSON or YAML): a list of
        /// `{name, description, method, path, inputSchema}`.
        #[arg(long, value_name = "FILE", conflicts_with_all = ["stdio", "wasm"])]
        tools_file: Option<PathBuf>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Replace the tools of an HTTP API connection (written or imported again). A changed or
    /// new tool quarantines an enabled connection until it is reviewed and enabled again.
    #[command(group(clap::ArgGroup::new("source").args(["openapi", "tools_file"]).required(true)))]
    ReplaceTools {
        /// A `con_…` id.
        id: wor_core::ConnectionId,
        /// The OpenAPI document (JSON or YAML) to import again.
        #[arg(long, value_name = "FILE")]
        openapi: Option<PathBuf>,
        /// An operationId to import (repeat); all when absent.
        #[arg(long = "operation", value_name = "ID", requires = "openapi")]
        operations: Vec<String>,
        /// The tools, written by hand (JSON or YAML).
        #[arg(long, value_name = "FILE")]
        tools_file: Option<PathBuf>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// List the project's tool connections.
    List(ClientArgs),
    /// Show one tool connection.
    Show {
        /// A `con_…` id.
        id: wor_core::ConnectionId,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// List the server's live tools with their hashes, and the diff against the pins.
    Review {
        /// A `con_…` id.
        id: wor_core::ConnectionId,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Pin the reviewed tools and enable the connection.
    Enable {
        /// A `con_…` id.
        id: wor_core::ConnectionId,
        /// The output of `wor connection review --json` the tools were reviewed from.
        #[arg(long, value_name = "FILE", required_unless_present = "tools")]
        from_review: Option<PathBuf>,
        /// A reviewed tool and its hash (repeatable), instead of --from-review.
        #[arg(
            long = "tool",
            value_name = "NAME=HASH",
            conflicts_with = "from_review"
        )]
        tools: Vec<String>,
        /// A tool to classify read-only (repeatable); every other tool is consequential
        /// unless classified open-world.
        #[arg(long = "read-only", value_name = "TOOL")]
        read_only: Vec<String>,
        /// A tool to classify open-world (repeatable): a read that contacts destinations its
        /// arguments name (URLs, hosts, addresses, channels).
        #[arg(long = "open-world", value_name = "TOOL")]
        open_world: Vec<String>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Disable the connection; runs that need it fail closed.
    Disable {
        /// A `con_…` id.
        id: wor_core::ConnectionId,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Authorize an `mcp_http` connection whose server requires MCP authorization (OAuth
    /// with PKCE): prints the URL to open in a browser; the browser comes back to `wor serve`
    /// (its `public_url`), whose console finishes it for the member who started it, signed in
    /// there, and seals the tokens. Needs a member's key.
    Authorize {
        /// A `con_…` id.
        id: wor_core::ConnectionId,
        /// A client you registered with the authorization server beforehand (a server without
        /// dynamic registration needs one); without it, a client is registered dynamically.
        #[arg(long, value_name = "ID")]
        client_id: Option<String>,
        /// Read that client's secret (a confidential client) from this environment variable.
        #[arg(long, value_name = "VAR", requires = "client_id")]
        client_secret_env: Option<String>,
        #[command(flatten)]
        client: ClientArgs,
    },
}

fn summary(c: &Value) -> String {
    let pinned = c
        .get("pinned_tools")
        .and_then(Value::as_object)
        .map_or(0, |p| p.len());
    format!(
        "{}  {:<8}  {:<14}  {} pinned  {}  {}",
        field(c, "/id"),
        field(c, "/kind"),
        field(c, "/status"),
        pinned,
        field(c, "/name"),
        field(c, "/url"),
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

/// What `read` makes of what the command was given; its errors are usage errors (exit 2):
/// a file, a variable or a flag the command cannot use.
fn given<T>(read: impl FnOnce() -> anyhow::Result<T>) -> anyhow::Result<T> {
    read().map_err(|error| crate::UsageError(error).into())
}

fn read_bearer(env: Option<&str>, stdin: bool) -> anyhow::Result<Option<String>> {
    given(|| {
        if let Some(var) = env {
            let value = std::env::var(var)
                .with_context(|| format!("environment variable {var} is not set"))?;
            return Ok(Some(value.trim().to_owned()));
        }
        if stdin {
            let mut text = String::new();
            std::io::stdin()
                .read_to_string(&mut text)
                .context("cannot read the bearer token from standard input")?;
            return Ok(Some(text.trim().to_owned()));
        }
        Ok(None)
    })
}

fn read_headers(specs: &[String]) -> anyhow::Result<BTreeMap<String, String>> {
    given(|| {
        let mut headers = BTreeMap::new();
        for spec in specs {
            let Some((name, var)) = spec.split_once('=') else {
                bail!("--header-env, --env-from and --scheme-env take NAME=VAR, got `{spec}`");
            };
            let value = std::env::var(var)
                .with_context(|| format!("environment variable {var} is not set"))?;
            headers.insert(name.to_owned(), value.trim().to_owned());
        }
        Ok(headers)
    })
}

/// The largest document or tools file read (the API takes bodies of 1 MiB).
const MAX_DOCUMENT_BYTES: u64 = 1024 * 1024;

/// A JSON or YAML file as JSON: `.yaml`/`.yml` as YAML, anything else as JSON.
fn read_document(path: &Path) -> anyhow::Result<Value> {
    given(|| {
        let size = std::fs::metadata(path)
            .with_context(|| format!("cannot read {}", path.display()))?
            .len();
        if size > MAX_DOCUMENT_BYTES {
            bail!(
                "{} is {size} bytes; the API takes documents of at most {MAX_DOCUMENT_BYTES}",
                path.display()
            );
        }
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        let yaml = path
            .extension()
            .and_then(|e| e.to_str())
            .is_some_and(|e| e.eq_ignore_ascii_case("yaml") || e.eq_ignore_ascii_case("yml"));
        if yaml {
            serde_norway::from_str(&text)
                .with_context(|| format!("{} is not a YAML document", path.display()))
        } else {
            serde_json::from_str(&text)
                .with_context(|| format!("{} is not a JSON document", path.display()))
        }
    })
}

/// The tools of a `--tools-file`: a list, or an object with a `tools` list.
fn read_tools_file(path: &Path) -> anyhow::Result<Value> {
    given(|| match read_document(path)? {
        Value::Array(tools) => Ok(Value::Array(tools)),
        Value::Object(mut object) => match object.remove("tools") {
            Some(Value::Array(tools)) => Ok(Value::Array(tools)),
            _ => bail!("{} has no `tools` list", path.display()),
        },
        _ => bail!(
            "{} holds neither a list of tools nor an object with `tools`",
            path.display()
        ),
    })
}

/// The `openapi` part of a request body.
fn openapi_body(path: &Path, operations: &[String], schemes: &[String]) -> anyhow::Result<Value> {
    Ok(
        json!({"document": read_document(path)?, "operations": operations,
        "credentials": read_headers(schemes)?}),
    )
}

/// The reviewed `name -> hash` set, from a saved review or from `NAME=HASH` flags.
fn reviewed_tools(
    from_review: Option<&PathBuf>,
    tools: &[String],
) -> anyhow::Result<BTreeMap<String, String>> {
    given(|| {
        let mut reviewed = BTreeMap::new();
        if let Some(path) = from_review {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("cannot read {}", path.display()))?;
            let review: Value = serde_json::from_str(&text)
                .with_context(|| format!("{} is not the json of a review", path.display()))?;
            for tool in review
                .get("tools")
                .and_then(Value::as_array)
                .context("the review has no `tools`")?
            {
                let name = tool.get("name").and_then(Value::as_str);
                let hash = tool.get("hash").and_then(Value::as_str);
                let (Some(name), Some(hash)) = (name, hash) else {
                    bail!("a tool in the review has no name or hash");
                };
                reviewed.insert(name.to_owned(), hash.to_owned());
            }
        }
        for spec in tools {
            let Some((name, hash)) = spec.split_once('=') else {
                bail!("--tool takes NAME=HASH, got `{spec}`");
            };
            reviewed.insert(name.to_owned(), hash.to_owned());
        }
        Ok(reviewed)
    })
}

/// A review as text. Everything a tool server wrote (names, descriptions, schemas, hints, and
/// the diff quoting them) is escaped: a reviewer sees the control characters a server sent,
/// which could otherwise rewrite what the terminal shows of the tools being pinned.
fn print_review(review: &Value) {
    println!(
        "{}",
        summary(review.get("connection").unwrap_or(&Value::Null))
    );
    let quoted = |text: &str| for_terminal(&one_line(text)).into_owned();
    for tool in review
        .get("tools")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let name = quoted(field(tool, "/name"));
        println!();
        println!("tool {name}  {}", field(tool, "/hash"));
        println!("  description: {}", quoted(field(tool, "/description")));
        println!(
            "  input schema: {}",
            quoted(&tool.get("input_schema").unwrap_or(&Value::Null).to_string())
        );
        println!(
            "  annotations (hints, not trusted): {}",
            quoted(&tool.get("annotations").unwrap_or(&Value::Null).to_string())
        );
        if tool.pointer("/annotations/openWorldHint") == Some(&Value::Bool(true)) {
            println!(
                "  suggestion: the server hints it is open-world; classify it with --open-world {name} if it contacts destinations its arguments name"
            );
        }
    }
    print_diff(review);
}

/// The difference from the pins an answer holds, escaped as a review is; nothing when there is
/// none.
fn print_diff(answer: &Value) {
    if let Some(text) = answer
        .pointer("/diff/text")
        .and_then(Value::as_str)
        .filter(|text| !text.trim().is_empty())
    {
        println!();
        println!("difference from the pins:");
        print!("{}", for_terminal(text));
    }
}

pub async fn run(cmd: ToolConnectionCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        ToolConnectionCommand::Create {
            name,
            kind,
            url,
            allowlist,
            stdio,
            wasm,
            args,
            read_only,
            env,
            bearer_env,
            bearer_stdin,
            headers,
            openapi,
            operations,
            schemes,
            tools_file,
            client,
        } => {
            let body = match (stdio, wasm) {
                (None, None) if openapi.is_some() || tools_file.is_some() => {
                    let mut body = json!({"name": name,
                        "kind": kind.as_deref().unwrap_or("http_api"),
                        "url": url.unwrap_or_default(), "allowlist": allowlist,
                        "headers": read_headers(&headers)?,
                        "bearer_token": read_bearer(bearer_env.as_deref(), bearer_stdin)?});
                    if let (Some(path), Some(object)) = (&openapi, body.as_object_mut()) {
                        object.insert(
                            "openapi".to_owned(),
                            openapi_body(path, &operations, &schemes)?,
                        );
                    }
                    if let (Some(path), Some(object)) = (&tools_file, body.as_object_mut()) {
                        object.insert("tools".to_owned(), read_tools_file(path)?);
                    }
                    body
                }
                (Some(program), _) => {
                    json!({"name": name, "kind": kind.as_deref().unwrap_or("mcp_stdio"),
                    "allowlist": allowlist,
                    "command": {"program": program, "args": args, "read_only_paths": read_only},
                    "env": read_headers(&env)?})
                }
                (None, Some(component)) => {
                    json!({"name": name, "kind": kind.as_deref().unwrap_or("wasm"),
                    "allowlist": allowlist,
                    // Any `--arg` goes along, for the server to refuse: a component takes none.
                    "command": {"program": component, "args": args, "read_only_paths": read_only},
                    "env": read_headers(&env)?})
                }
                (None, None) => json!({"name": name, "kind": kind.as_deref().unwrap_or("mcp_http"),
                    "url": url.unwrap_or_default(), "allowlist": allowlist,
                    "headers": read_headers(&headers)?,
                    "bearer_token": read_bearer(bearer_env.as_deref(), bearer_stdin)?}),
            };
            let created = ApiClient::new(&client)?
                .post("/v1/tool-connections", &body)
                .await?;
            show(&client, &created)?;
        }
        ToolConnectionCommand::ReplaceTools {
            id,
            openapi,
            operations,
            tools_file,
            client,
        } => {
            let mut body = serde_json::Map::new();
            if let Some(path) = &openapi {
                body.insert("openapi".to_owned(), openapi_body(path, &operations, &[])?);
            }
            if let Some(path) = &tools_file {
                body.insert("tools".to_owned(), read_tools_file(path)?);
            }
            let body = Value::Object(body);
            let replaced = ApiClient::new(&client)?
                .put(&format!("/v1/tool-connections/{id}/tools"), &body)
                .await?;
            if client.json {
                print_json(&replaced)?;
            } else {
                println!(
                    "{}",
                    summary(replaced.get("connection").unwrap_or(&Value::Null))
                );
                print_diff(&replaced);
                if replaced.get("quarantined") == Some(&Value::Bool(true)) {
                    println!();
                    println!(
                        "the connection is quarantined: review it (`wor connection review {id}`) and enable it again"
                    );
                }
            }
        }
        ToolConnectionCommand::List(client) => {
            let list = ApiClient::new(&client)?.get("/v1/tool-connections").await?;
            if client.json {
                print_json(&list)?;
            } else {
                for c in list.as_array().into_iter().flatten() {
                    println!("{}", summary(c));
                }
            }
        }
        ToolConnectionCommand::Show { id, client } => {
            let one = ApiClient::new(&client)?
                .get(&format!("/v1/tool-connections/{id}"))
                .await?;
            show(&client, &one)?;
        }
        ToolConnectionCommand::Review { id, client } => {
            let review = ApiClient::new(&client)?
                .get(&format!("/v1/tool-connections/{id}/review"))
                .await?;
            if client.json {
                print_json(&review)?;
            } else {
                print_review(&review);
            }
        }
        ToolConnectionCommand::Enable {
            id,
            from_review,
            tools,
            read_only,
            open_world,
            client,
        } => {
            let reviewed = reviewed_tools(from_review.as_ref(), &tools)?;
            let enabled = ApiClient::new(&client)?
                .post(
                    &format!("/v1/tool-connections/{id}/enable"),
                    &json!({"tools": reviewed, "read_only": read_only, "open_world": open_world}),
                )
                .await?;
            show(&client, &enabled)?;
        }
        ToolConnectionCommand::Disable { id, client } => {
            let disabled = ApiClient::new(&client)?
                .post(&format!("/v1/tool-connections/{id}/disable"), &Value::Null)
                .await?;
            show(&client, &disabled)?;
        }
        ToolConnectionCommand::Authorize {
            id,
            client_id,
            client_secret_env,
            client,
        } => {
            let secret = match &client_secret_env {
                Some(var) => Some(
                    std::env::var(var)
                        .map_err(|_| anyhow::anyhow!("environment variable {var} is not set"))?,
                ),
                None => None,
            };
            let body = match client_id {
                Some(client_id) => serde_json::json!({
                    "client_id": client_id,
                    "client_secret": secret,
                }),
                None => Value::Null,
            };
            let started = ApiClient::new(&client)?
                .post(&format!("/v1/tool-connections/{id}/authorize"), &body)
                .await?;
            if client.json {
                print_json(&started)?;
            } else {
                let url = started
                    .get("authorization_url")
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                let until = started
                    .get("expires_at")
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                if let Some(notice) = started.get("notice").and_then(Value::as_str) {
                    eprintln!("note: {notice}");
                }
                // What the person is about to grant, including scopes a server asked for
                // later (a step-up), before they open the page.
                let scopes: Vec<&str> = started
                    .get("scopes")
                    .and_then(Value::as_array)
                    .map(|s| s.iter().filter_map(Value::as_str).collect())
                    .unwrap_or_default();
                if !scopes.is_empty() {
                    eprintln!("asks for scopes: {}", scopes.join(" "));
                }
                println!(
                    "open this URL in a browser signed in to the console as you (it is finished \
                     there, for you alone) to authorize the connection (before {until}):"
                );
                println!("{url}");
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
