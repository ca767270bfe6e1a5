//! What a tool connection must be before it is stored, checked in one place:
//! [`ToolConnectionSpec::validate`] turns what a caller asked for into a
//! [`CheckedToolConnection`] or one [`ToolConnectionSpecError`] (each a 400 over the API, with
//! its [`code`](ToolConnectionSpecError::code)).
//!
//! An `http_api` connection's tools are written by hand ([`HttpToolsSource::Written`]) or
//! imported from an OpenAPI document ([`HttpToolsSource::OpenApi`]); either way they are
//! stored as the same HTTP tool configurations, reviewed and pinned like any other tools.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use secrecy::SecretString;
use serde_json::Value;
use wor_store::{NewToolConnection, StdioSpec, ToolConnectionKind, env_field, header_field};
use wor_tools::{
    ConnectionCredentials, CredentialSlot, HttpToolConfig, HttpToolDefinition, OpenApiDocument,
    OpenApiError, is_valid_tool_name,
};

use crate::tool_connections::{BEARER_TOKEN_FIELD, check_stdio_spec};

/// The longest credential value accepted.
pub const MAX_SECRET_LEN: usize = 8 * 1024;
/// The most credential headers one connection holds.
pub const MAX_HEADERS: usize = 16;
pub use wor_tools::MAX_HTTP_TOOLS;

/// Where an `http_api` connection's tools come from.
#[derive(Debug, Clone, Default)]
pub enum HttpToolsSource {
    /// None (every other kind).
    #[default]
    None,
    /// Written by hand: `{name, description, method, path, inputSchema}` each.
    Written(Vec<Value>),
    /// Chosen operations of an OpenAPI document.
    OpenApi(OpenApiSource),
}

/// An OpenAPI document to import, already read as JSON.
#[derive(Debug, Clone)]
pub struct OpenApiSource {
    /// The document.
    pub document: Value,
    /// The `operationId`s to import; all when empty.
    pub operations: Vec<String>,
    /// A secret for each security scheme, by the scheme's name in the document.
    pub credentials: BTreeMap<String, SecretString>,
}

/// A new tool connection as a caller asks for it.
#[derive(Debug, Clone)]
pub struct ToolConnectionSpec {
    pub name: String,
    pub kind: String,
    pub url: String,
    pub allowlist: Vec<String>,
    pub command: Option<StdioSpec>,
    pub env: BTreeMap<String, SecretString>,
    pub tools: HttpToolsSource,
    pub bearer_token: Option<SecretString>,
    pub headers: BTreeMap<String, SecretString>,
}

/// The operator's rules for local (`mcp_stdio`, `wasm`) connections.
#[derive(Debug, Clone, Copy)]
pub struct LocalCommandRules<'a> {
    /// Where programs and read-only paths may lie (`[sandbox] allowed_paths`).
    pub allowed_roots: &'a [PathBuf],
    /// Paths no connection may see (the data directory).
    pub protected: &'a [PathBuf],
}

/// A connection ready to store, and the secrets to seal once it has an id.
#[derive(Debug)]
pub struct CheckedToolConnection {
    /// What to store (`created_by` left for the caller).
    pub connection: NewToolConnection,
    /// Each credential's vault field and value.
    pub secrets: Vec<(String, SecretString)>,
    /// Whether a bearer token is among the secrets.
    pub has_bearer_token: bool,
    /// The `operationId`s imported, when the tools came from an OpenAPI document.
    pub imported_operations: Vec<String>,
}

/// Why a tool connection was refused.
#[derive(Debug, thiserror::Error)]
pub enum ToolConnectionSpecError {
    #[error("a tool connection name is 1 to 40 of a-z, 0-9, `-` and `_`, starting with a letter")]
    InvalidName,
    #[error("`routine` is reserved: rosters name routines used as tools `routine/NAME`")]
    ReservedName,
    #[error("{0}")]
    InvalidKind(String),
    #[error("{0}")]
    InvalidCommand(String),
    #[error("{0}")]
    InvalidUrl(String),
    #[error("{0}")]
    InvalidAllowlist(String),
    #[error("{0}")]
    InvalidTools(String),
    #[error("{0}")]
    InvalidCredential(String),
    #[error("a `wasm` connection has no headers; give it secrets through `env`")]
    WasmCredentials,
    #[error("openapi: {0}")]
    OpenApi(#[from] OpenApiError),
    #[error(
        "openapi: operation `{operation}` needs {needs}, which the connection does not have: a connection's credentials are given when it is created (`openapi.credentials` by scheme name, with the CLI `wor connection create --scheme-env SCHEME=VAR`; or `bearer_token` or `headers`)"
    )]
    MissingCredential {
        /// The `operationId`.
        operation: String,
        /// What it needs, in words.
        needs: String,
    },
}

impl ToolConnectionSpecError {
    /// The API's error code.
    pub fn code(&self) -> &'static str {
        match self {
            Self::InvalidName | Self::ReservedName => "invalid_name",
            Self::InvalidKind(_) => "invalid_kind",
            Self::InvalidCommand(_) => "invalid_command",
            Self::InvalidUrl(_) => "invalid_url",
            Self::InvalidAllowlist(_) => "invalid_allowlist",
            Self::InvalidTools(_) => "invalid_tools",
            Self::InvalidCredential(_) => "invalid_credential",
            Self::WasmCredentials => "invalid_credentials",
            Self::OpenApi(_) | Self::MissingCredential { .. } => "invalid_openapi",
        }
    }
}

fn check_secret(value: &SecretString, what: &str) -> Result<(), ToolConnectionSpecError> {
    use secrecy::ExposeSecret;
    let value = value.expose_secret();
    if value.trim().is_empty()
        || value.len() > MAX_SECRET_LEN
        || value.chars().any(char::is_control)
    {
        return Err(ToolConnectionSpecError::InvalidCredential(format!(
            "{what} must be 1 to 8192 printable characters"
        )));
    }
    Ok(())
}

/// Tools checked for an `http_api` connection, as stored.
#[derive(Debug)]
pub struct CheckedHttpTools {
    /// Each tool's configuration, as stored.
    pub(crate) tools: Vec<Value>,
    /// Each tool's definition, as its connection lists it, in the same order.
    pub(crate) definitions: Vec<wor_tools::ToolDefinition>,
    /// The `operationId`s imported, for an OpenAPI source.
    pub(crate) imported_operations: Vec<String>,
}

impl CheckedHttpTools {
    /// How many tools were checked.
    pub fn len(&self) -> usize {
        self.tools.len()
    }

    /// Whether no tool was checked.
    pub fn is_empty(&self) -> bool {
        self.tools.is_empty()
    }
}

impl HttpToolsSource {
    /// Checks the tools of an `http_api` connection at `url` (filled from an OpenAPI
    /// document's server when empty) on `allowlist`. An OpenAPI source's scheme credentials
    /// are moved into `bearer` and `headers` first; then every imported operation must be able
    /// to authenticate with those or the credentials already `configured`.
    pub fn validate(
        self,
        url: &mut String,
        allowlist: &wor_egress::HostAllowlist,
        bearer: &mut Option<SecretString>,
        headers: &mut BTreeMap<String, SecretString>,
        configured: &BTreeSet<CredentialSlot>,
    ) -> Result<CheckedHttpTools, ToolConnectionSpecError> {
        let bad = ToolConnectionSpecError::InvalidTools;
        let (configs, imported_operations) = match self {
            HttpToolsSource::None => {
                return Err(bad(
                    "an `http_api` connection lists its `tools` or imports them from `openapi`"
                        .to_owned(),
                ));
            }
            HttpToolsSource::Written(tools) => {
                if tools.is_empty() {
                    return Err(bad(
                        "an `http_api` connection lists its `tools`; other kinds do not".to_owned(),
                    ));
                }
                let mut configs = Vec::with_capacity(tools.len());
                for (index, tool) in tools.into_iter().enumerate() {
                    let config: HttpToolConfig = serde_json::from_value(tool)
                        .map_err(|e| bad(format!("tools[{index}]: {e}")))?;
                    configs.push(config);
                }
                (configs, Vec::new())
            }
            HttpToolsSource::OpenApi(source) => {
                let document = OpenApiDocument::from_json(source.document)?;
                let import = document.import(&source.operations)?;
                if url.is_empty() {
                    match document.server_url() {
                        // A variable the document gives no value for stays as `{name}`.
                        Some(server) if server.contains(['{', '}']) => {
                            return Err(ToolConnectionSpecError::InvalidUrl(format!(
                                "the document's first server url `{}` has a variable its \
                                 `variables` give no value for: give the API's base `url`",
                                wor_core::quote::excerpt(&server, 200)
                            )));
                        }
                        Some(server)
                            if server.starts_with("https://") || server.starts_with("http://") =>
                        {
                            *url = server;
                        }
                        Some(server) => {
                            return Err(ToolConnectionSpecError::InvalidUrl(format!(
                                "the document's first server url `{server}` is not absolute: give the API's base `url`"
                            )));
                        }
                        None => {
                            return Err(ToolConnectionSpecError::InvalidUrl(
                                "the document names no server: give the API's base `url`"
                                    .to_owned(),
                            ));
                        }
                    }
                }
                for (scheme, secret) in source.credentials {
                    let Some(slot) = import.schemes.get(&scheme) else {
                        return Err(ToolConnectionSpecError::InvalidCredential(format!(
                            "`{scheme}` is not a security scheme of the document that an http tool can send (an api key in a header, a bearer token, oauth2 or openIdConnect)"
                        )));
                    };
                    let taken = match slot {
                        CredentialSlot::Bearer => bearer.replace(secret).is_some(),
                        CredentialSlot::Header(name) => {
                            headers.insert(name.clone(), secret).is_some()
                        }
                    };
                    if taken {
                        return Err(ToolConnectionSpecError::InvalidCredential(format!(
                            "{slot} is given twice (security scheme `{scheme}` fills it too)"
                        )));
                    }
                }
                let mut present = configured.clone();
                present.extend(
                    headers
                        .keys()
                        .map(|h| CredentialSlot::Header(h.trim().to_ascii_lowercase())),
                );
                if bearer.is_some() {
                    present.insert(CredentialSlot::Bearer);
                }
                for operation in &import.operations {
                    check_security(operation, &present)?;
                }
                let ids = import
                    .operations
                    .iter()
                    .map(|o| o.operation_id.clone())
                    .collect();
                (import.tools(), ids)
            }
        };
        if configs.len() > MAX_HTTP_TOOLS {
            return Err(bad(format!(
                "an `http_api` connection holds at most {MAX_HTTP_TOOLS} tools"
            )));
        }
        wor_tools::HttpApiConnection::new(url, allowlist.clone(), ConnectionCredentials::none())
            .map_err(|e| bad(format!("url: {e}")))?;
        let mut names = BTreeSet::new();
        let mut tools = Vec::with_capacity(configs.len());
        let mut definitions = Vec::with_capacity(configs.len());
        for (index, config) in configs.into_iter().enumerate() {
            if !is_valid_tool_name(&config.name) {
                return Err(bad(format!(
                    "tools[{index}]: `{}` is not a valid tool name",
                    config.name
                )));
            }
            if !names.insert(config.name.clone()) {
                return Err(bad(format!(
                    "tools[{index}]: `{}` is listed twice",
                    config.name
                )));
            }
            wor_tools::check_input_schema(&Value::Object(config.input_schema.clone()))
                .map_err(|e| bad(format!("tools[{index}] `{}`: {e}", config.name)))?;
            let value =
                serde_json::to_value(&config).map_err(|e| bad(format!("tools[{index}]: {e}")))?;
            let definition =
                HttpToolDefinition::new(config).map_err(|e| bad(format!("tools[{index}]: {e}")))?;
            tools.push(value);
            definitions.push(definition.tool_definition());
        }
        Ok(CheckedHttpTools {
            tools,
            definitions,
            imported_operations,
        })
    }
}

/// An imported operation must be able to authenticate with the credentials given.
fn check_security(
    operation: &wor_tools::ImportedOperation,
    present: &BTreeSet<CredentialSlot>,
) -> Result<(), ToolConnectionSpecError> {
    if operation.security.is_empty()
        || operation
            .security
            .iter()
            .any(|alternative| alternative.iter().all(|(_, slot)| present.contains(slot)))
    {
        return Ok(());
    }
    let words: Vec<String> = operation
        .security
        .iter()
        .map(|alternative| {
            alternative
                .iter()
                .map(|(scheme, slot)| format!("{slot} (scheme `{scheme}`)"))
                .collect::<Vec<_>>()
                .join(" and ")
        })
        .collect();
    let needs = if words.len() == 1 {
        words.concat()
    } else {
        format!("one of: {}", words.join("; "))
    };
    Err(ToolConnectionSpecError::MissingCredential {
        operation: operation.operation_id.clone(),
        needs,
    })
}

impl ToolConnectionSpec {
    /// Checks everything about a new connection that can be checked before it is stored:
    /// its name, kind, URL or command, allowlist, tools and credentials (the way `wor-tools`
    /// will attach them, so a bad header is refused now rather than at the first run).
    pub fn validate(
        self,
        rules: LocalCommandRules<'_>,
    ) -> Result<CheckedToolConnection, ToolConnectionSpecError> {
        let Self {
            name,
            kind,
            mut url,
            allowlist,
            command,
            env,
            tools,
            mut bearer_token,
            mut headers,
        } = self;
        if !is_valid_tool_name(&name) {
            return Err(ToolConnectionSpecError::InvalidName);
        }
        if name == "routine" {
            return Err(ToolConnectionSpecError::ReservedName);
        }
        let kind: ToolConnectionKind =
            kind.parse().map_err(ToolConnectionSpecError::InvalidKind)?;
        let has_tools = !matches!(tools, HttpToolsSource::None);
        let mut stated_url = None;
        let command = if kind.is_local() {
            let Some(mut command) = command else {
                return Err(ToolConnectionSpecError::InvalidCommand(format!(
                    "a `{kind}` connection needs `command` (program, args, read_only_paths)"
                )));
            };
            if !url.is_empty() {
                return Err(ToolConnectionSpecError::InvalidUrl(format!(
                    "a `{kind}` connection has no `url`"
                )));
            }
            if has_tools {
                return Err(ToolConnectionSpecError::InvalidTools(format!(
                    "a `{kind}` connection lists its own tools; it takes no `tools`"
                )));
            }
            command.env_names = env.keys().cloned().collect();
            check_stdio_spec(&command, rules.allowed_roots, rules.protected)
                .map_err(|e| ToolConnectionSpecError::InvalidCommand(format!("command: {e}")))?;
            // After the roots check: nothing is looked at outside the operator's paths.
            if kind == ToolConnectionKind::Wasm {
                check_wasm_command(&command, bearer_token.is_some() || !headers.is_empty())?;
            }
            Some(command)
        } else {
            if (kind == ToolConnectionKind::HttpApi) != has_tools {
                return Err(ToolConnectionSpecError::InvalidTools(
                    "an `http_api` connection lists its `tools`; other kinds do not".to_owned(),
                ));
            }
            if command.is_some() || !env.is_empty() {
                return Err(ToolConnectionSpecError::InvalidCommand(
                    "`command` and `env` are only for `mcp_stdio` and `wasm` connections"
                        .to_owned(),
                ));
            }
            // An imported document may name the URL itself.
            if !(url.is_empty() && matches!(tools, HttpToolsSource::OpenApi(_))) {
                let parsed = wor_egress::EgressUrl::parse(&url).map_err(|refusal| {
                    ToolConnectionSpecError::InvalidUrl(format!("url: {refusal}"))
                })?;
                // A query or a fragment could carry a credential, which would be stored,
                // shown to every member and written into the audit log in the clear.
                let parts = parsed.as_url();
                if kind == ToolConnectionKind::McpHttp
                    && (parts.query().is_some() || parts.fragment().is_some())
                {
                    return Err(ToolConnectionSpecError::InvalidUrl(
                        "url: a query or a fragment is not accepted; a token goes in \
                         `bearer_token` or `headers`, where it is sealed"
                            .to_owned(),
                    ));
                }
                stated_url = Some(parsed);
            }
            if allowlist.is_empty() {
                return Err(ToolConnectionSpecError::InvalidAllowlist(
                    "allowlist must name at least the host of `url`".to_owned(),
                ));
            }
            None
        };
        let parsed_allowlist = wor_egress::HostAllowlist::parse(&allowlist)
            .map_err(|e| ToolConnectionSpecError::InvalidAllowlist(format!("allowlist: {e}")))?;
        // A connection whose own URL its allowlist leaves out could never be reached.
        if let Some(stated) = &stated_url
            && !parsed_allowlist.allows(stated.host(), stated.port())
        {
            return Err(ToolConnectionSpecError::InvalidAllowlist(format!(
                "allowlist must name at least the host of `url` (`{}`, port {})",
                stated.host(),
                stated.port()
            )));
        }
        let mut http_tools = Vec::new();
        let mut imported_operations = Vec::new();
        if kind == ToolConnectionKind::HttpApi {
            let checked = tools.validate(
                &mut url,
                &parsed_allowlist,
                &mut bearer_token,
                &mut headers,
                &BTreeSet::new(),
            )?;
            http_tools = checked.tools;
            imported_operations = checked.imported_operations;
            wor_egress::EgressUrl::parse(&url).map_err(|refusal| {
                ToolConnectionSpecError::InvalidUrl(format!("url: {refusal}"))
            })?;
        }
        let headers = check_credentials(bearer_token.as_ref(), headers)?;
        let mut secrets = Vec::new();
        let has_bearer_token = bearer_token.is_some();
        if let Some(token) = bearer_token {
            secrets.push((BEARER_TOKEN_FIELD.to_owned(), token));
        }
        let secret_headers = headers.iter().map(|(name, _)| name.clone()).collect();
        for (name, value) in headers {
            secrets.push((header_field(&name), value));
        }
        for (name, value) in env {
            secrets.push((env_field(&name), value));
        }
        Ok(CheckedToolConnection {
            connection: NewToolConnection {
                name,
                kind,
                url,
                allowlist,
                secret_headers,
                command,
                http_tools,
                created_by: None,
            },
            secrets,
            has_bearer_token,
            imported_operations,
        })
    }
}

/// The credential headers, names lower-cased, each checked the way it will be sent.
fn check_credentials(
    bearer: Option<&SecretString>,
    headers: BTreeMap<String, SecretString>,
) -> Result<Vec<(String, SecretString)>, ToolConnectionSpecError> {
    let invalid =
        |e: wor_tools::CredentialError| ToolConnectionSpecError::InvalidCredential(e.to_string());
    if headers.len() > MAX_HEADERS {
        return Err(ToolConnectionSpecError::InvalidCredential(format!(
            "a connection holds at most {MAX_HEADERS} credential headers"
        )));
    }
    let mut credentials = ConnectionCredentials::none();
    if let Some(token) = bearer {
        check_secret(token, "bearer_token")?;
        credentials = credentials.with_bearer(token.clone()).map_err(invalid)?;
    }
    let mut checked = Vec::new();
    for (name, value) in headers {
        check_secret(&value, &format!("header `{name}`"))?;
        let name = name.trim().to_ascii_lowercase();
        credentials = credentials
            .with_header(&name, value.clone())
            .map_err(invalid)?;
        checked.push((name, value));
    }
    Ok(checked)
}

/// What a `wasm` connection may not have: arguments (a component gets none), credentials other
/// than its environment, read-only paths that are not directories.
fn check_wasm_command(
    command: &StdioSpec,
    has_credentials: bool,
) -> Result<(), ToolConnectionSpecError> {
    if !command.args.is_empty() {
        return Err(ToolConnectionSpecError::InvalidCommand(
            "a `wasm` connection takes no `args`".to_owned(),
        ));
    }
    if has_credentials {
        return Err(ToolConnectionSpecError::WasmCredentials);
    }
    for path in &command.read_only_paths {
        if !std::path::Path::new(path).is_dir() {
            return Err(ToolConnectionSpecError::InvalidCommand(format!(
                "command: the read-only path `{path}` of a `wasm` connection must be a directory"
            )));
        }
    }
    Ok(())
}
