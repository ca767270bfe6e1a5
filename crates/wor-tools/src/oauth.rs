//! MCP authorization, its discovery half: from a streamable-HTTP server's `401` to the
//! authorization server's metadata (protected-resource metadata, RFC 9728; authorization
//! server metadata, RFC 8414, or OpenID discovery), and the authorization request an operator
//! opens, with PKCE (`S256`), a random `state` and the `resource` parameter (RFC 8707).
//!
//! Metadata URLs come from the server being connected to, so they are attacker-influenced:
//! every document is fetched through the [`EgressClient`] (its address rules hold whatever the
//! document names), with [`MAX_METADATA_BYTES`] as the size cap and a short timeout; a
//! redirect is never followed (the guard does not follow them and a `3xx` here is an error).
//!
//! The client is chosen here too ([`choose_client`]), in the order of MCP's authorization
//! specification: a client the operator registered; else, where the server accepts them, a
//! client ID metadata document (draft-ietf-oauth-client-id-metadata-document: the `client_id`
//! is the HTTPS URL of a [`ClientMetadata`] document the server fetches); else dynamic
//! registration. A `403` whose challenge says `insufficient_scope` names the scopes a request
//! needs ([`Challenge::scopes`]); [`union_scopes`] adds them to those asked for before.
//!
//! The token requests are here too: dynamic client registration (RFC 7591: a public client
//! using PKCE wherever the server allows one) or a client the operator registered, each
//! authenticating at the token endpoint as the server's metadata allows (`none`,
//! `client_secret_basic` or `client_secret_post`), the code exchange and the refresh grant,
//! each with `resource`; tokens come back
//! as [`SecretString`]s and an error names only the server's error code, never its text (which
//! could quote a token). Storing the pending authorization, sealing the tokens and refreshing
//! them are the engine's (`wor-engine`'s `oauth_connections`); see `docs/tools.md`.

use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use reqwest::header::{ACCEPT, HeaderValue};
use secrecy::{ExposeSecret, SecretString};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use url::Url;
use wor_egress::{EgressClient, EgressError, EgressRequest, EgressUrl, HostAllowlist};

/// The largest metadata document accepted.
pub const MAX_METADATA_BYTES: u64 = 64 * 1024;
/// How long one metadata request may take.
pub const METADATA_TIMEOUT: Duration = Duration::from_secs(10);

/// Discovery failed; each names the document and the reason.
#[derive(Debug, thiserror::Error)]
pub enum OAuthError {
    /// A URL named by the server or a document is refused.
    #[error("{what} `{url}` is not a usable url: {reason}")]
    InvalidUrl {
        /// Which URL.
        what: &'static str,
        /// The URL.
        url: String,
        /// Why.
        reason: String,
    },
    /// The egress guard refused the request or it failed.
    #[error("{what} could not be fetched from `{url}`: {source}")]
    Fetch {
        /// Which document.
        what: &'static str,
        /// From where.
        url: String,
        /// The refusal or failure.
        #[source]
        source: EgressError,
    },
    /// The document's server answered with a redirect, which is not followed.
    #[error("{what} at `{url}` answered {status} (a redirect); redirects are not followed")]
    Redirect {
        /// Which document.
        what: &'static str,
        /// From where.
        url: String,
        /// The status.
        status: u16,
    },
    /// The document's server answered another non-success status.
    #[error("{what} at `{url}` answered {status}")]
    Status {
        /// Which document.
        what: &'static str,
        /// From where.
        url: String,
        /// The status.
        status: u16,
    },
    /// The document is not the JSON it should be.
    #[error("{what} at `{url}` is not valid: {reason}")]
    InvalidDocument {
        /// Which document.
        what: &'static str,
        /// From where.
        url: String,
        /// Why.
        reason: String,
    },
    /// The protected-resource metadata is about another resource.
    #[error(
        "the protected-resource metadata names resource `{named}`, not this server (`{expected}`)"
    )]
    ResourceMismatch {
        /// What it names.
        named: String,
        /// The MCP server's URL.
        expected: String,
    },
    /// The authorization server's metadata names another issuer.
    #[error("the authorization server metadata names issuer `{named}`, not `{expected}`")]
    IssuerMismatch {
        /// What it names.
        named: String,
        /// The issuer it was fetched for.
        expected: String,
    },
    /// The server does not offer PKCE with `S256`.
    #[error("authorization server `{issuer}` does not offer PKCE with S256; it cannot be used")]
    NoPkce {
        /// The issuer.
        issuer: String,
    },
    /// The connection's authorization server offers no dynamic registration (and no client
    /// ID metadata document wor can use).
    #[error(
        "authorization server `{issuer}` offers no dynamic client registration{}; give the connection a client id",
        declined_document(.metadata_document.as_ref())
    )]
    NoRegistration {
        /// The issuer.
        issuer: String,
        /// Why a client ID metadata document the server would accept cannot be used instead.
        metadata_document: Option<MetadataDocumentUnusable>,
    },
    /// The authorization server refused a registration or token request.
    #[error("the authorization server refused the {what}: `{error}`")]
    Refused {
        /// Which request.
        what: &'static str,
        /// The OAuth error code (RFC 6749 §5.2), or the status when there is none.
        error: String,
    },
    /// The client's id and secret do not fit the request that carries them.
    #[error("the client's credentials cannot be sent as {0}")]
    ClientCredentials(&'static str),
    /// No randomness could be had.
    #[error("no randomness for pkce and state: {0}")]
    Random(String),
}

fn declined_document(declined: Option<&MetadataDocumentUnusable>) -> String {
    declined.map_or_else(String::new, |why| {
        format!(", and it accepts a client ID metadata document but {why}")
    })
}

/// The protected-resource metadata of an MCP server (RFC 9728), the fields used.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
pub struct ProtectedResourceMetadata {
    /// The resource identifier: the MCP server's URL.
    pub resource: String,
    /// Issuers of the authorization servers it trusts.
    #[serde(default)]
    pub authorization_servers: Vec<String>,
    /// Scopes it understands.
    #[serde(default)]
    pub scopes_supported: Vec<String>,
}

/// An authorization server's metadata (RFC 8414 / OpenID discovery), the fields used.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
pub struct AuthorizationServerMetadata {
    pub issuer: String,
    pub authorization_endpoint: String,
    pub token_endpoint: String,
    #[serde(default)]
    pub registration_endpoint: Option<String>,
    #[serde(default)]
    pub code_challenge_methods_supported: Vec<String>,
    #[serde(default)]
    pub scopes_supported: Vec<String>,
    /// How clients may authenticate at the token endpoint; empty means the RFC 8414 default,
    /// `client_secret_basic`.
    #[serde(default)]
    pub token_endpoint_auth_methods_supported: Vec<String>,
    /// The server accepts an HTTPS URL as a `client_id`, fetching the client's metadata
    /// document from it (draft-ietf-oauth-client-id-metadata-document).
    #[serde(default)]
    pub client_id_metadata_document_supported: bool,
    /// The server names itself (`iss`) in every authorization response (RFC 9207), which the
    /// callback then checks: the defence against an authorization-server mix-up.
    #[serde(default)]
    pub authorization_response_iss_parameter_supported: bool,
}

/// What discovery found; stored with a connection's authorization as JSON.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
pub struct AuthorizationDiscovery {
    /// The MCP server's resource identifier, sent as `resource` on every request.
    pub resource: String,
    pub protected_resource: ProtectedResourceMetadata,
    pub authorization_server: AuthorizationServerMetadata,
}

/// What a server's `401` (or `403`) asked for: the `WWW-Authenticate: Bearer …` parameters
/// discovery and a scope step-up use.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Challenge {
    /// `resource_metadata`: where the protected-resource metadata is (RFC 9728 §5.1).
    pub resource_metadata: Option<String>,
    /// `scope`: the scopes the server wants for this resource, space-separated.
    pub scope: Option<String>,
    /// `error`: why the token was refused (RFC 6750 §3.1), e.g. `insufficient_scope`.
    pub error: Option<String>,
}

impl Challenge {
    /// The parameters of a `Bearer` challenge; another scheme, or none, gives an empty one.
    pub fn parse(www_authenticate: &str) -> Self {
        let mut challenge = Self::default();
        for (name, value) in bearer_params(www_authenticate) {
            let slot = match name.as_str() {
                "resource_metadata" => &mut challenge.resource_metadata,
                "scope" => &mut challenge.scope,
                "error" => &mut challenge.error,
                _ => continue,
            };
            if slot.is_none() && !value.is_empty() {
                *slot = Some(value);
            }
        }
        challenge
    }

    /// Whether the server refused the token for its scope (RFC 6750 §3.1 `insufficient_scope`):
    /// the scopes it needs are in [`Challenge::scopes`].
    pub fn is_insufficient_scope(&self) -> bool {
        self.error.as_deref() == Some("insufficient_scope")
    }

    /// The scopes the challenge names, each a valid scope token (see [`scope_tokens`]).
    pub fn scopes(&self) -> Vec<String> {
        scope_tokens(self.scope.as_deref().unwrap_or_default())
    }
}

/// The most scope tokens taken from one `scope` value.
pub const MAX_SCOPE_TOKENS: usize = 32;
/// The longest scope token taken.
pub const MAX_SCOPE_TOKEN_BYTES: usize = 256;

/// The scope tokens of a space-separated `scope` value (RFC 6749 §3.3), in order, without
/// repeats. A token with a character RFC 6749 does not allow (a server's text, not a scope),
/// or longer than [`MAX_SCOPE_TOKEN_BYTES`], is dropped; at most [`MAX_SCOPE_TOKENS`] are kept.
pub fn scope_tokens(scope: &str) -> Vec<String> {
    union_scopes([scope])
}

/// The union of space-separated `scope` values: each valid token once, in the order first met
/// (the scopes asked for before come first), at most [`MAX_SCOPE_TOKENS`].
pub fn union_scopes<'a>(scopes: impl IntoIterator<Item = &'a str>) -> Vec<String> {
    let valid = |token: &str| {
        token.len() <= MAX_SCOPE_TOKEN_BYTES
            && token
                .bytes()
                .all(|b| b == 0x21 || (0x23..=0x5b).contains(&b) || (0x5d..=0x7e).contains(&b))
    };
    let mut union: Vec<String> = Vec::new();
    for token in scopes.into_iter().flat_map(str::split_ascii_whitespace) {
        if token.is_empty() || !valid(token) || union.iter().any(|known| known == token) {
            continue;
        }
        if union.len() == MAX_SCOPE_TOKENS {
            break;
        }
        union.push(token.to_owned());
    }
    union
}

/// The `name=value` parameters of a `Bearer` challenge (RFC 9110 §11.2: a token or a quoted
/// string with `\` escapes), names lower-cased; parsing stops at the first malformed one.
fn bearer_params(header: &str) -> Vec<(String, String)> {
    let header = header.trim_start();
    let Some((scheme, mut rest)) = header.split_once(char::is_whitespace) else {
        return Vec::new();
    };
    if !scheme.eq_ignore_ascii_case("bearer") {
        return Vec::new();
    }
    let mut params = Vec::new();
    loop {
        rest = rest.trim_start_matches(|c: char| c == ',' || c.is_whitespace());
        let Some((name, after)) = rest.split_once('=') else {
            break;
        };
        let name = name.trim().to_ascii_lowercase();
        let after = after.trim_start();
        let (value, remaining) = match after.strip_prefix('"') {
            Some(quoted) => {
                let mut value = String::new();
                let mut escaped = false;
                let mut end = None;
                for (at, c) in quoted.char_indices() {
                    match (escaped, c) {
                        (true, _) => {
                            value.push(c);
                            escaped = false;
                        }
                        (false, '\\') => escaped = true,
                        (false, '"') => {
                            end = Some(at);
                            break;
                        }
                        (false, _) => value.push(c),
                    }
                }
                let Some(end) = end else {
                    break;
                };
                (value, quoted.get(end + 1..).unwrap_or_default())
            }
            None => {
                let end = after
                    .find(|c: char| c == ',' || c.is_whitespace())
                    .unwrap_or(after.len());
                let (value, remaining) = after.split_at_checked(end).unwrap_or((after, ""));
                (value.to_owned(), remaining)
            }
        };
        params.push((name, value));
        rest = remaining;
    }
    params
}

/// The `resource_metadata` parameter of a `WWW-Authenticate: Bearer …` challenge.
pub fn resource_metadata_url(www_authenticate: &str) -> Option<String> {
    Challenge::parse(www_authenticate).resource_metadata
}

/// Asks the MCP server at `mcp_url` to begin a session without credentials: its `401`'s
/// challenge when it wants authorization, `None` when it answers anything else.
pub async fn probe(
    egress: &EgressClient,
    mcp_url: &str,
    allowlist: Option<&HostAllowlist>,
) -> Result<Option<Challenge>, OAuthError> {
    let initialize = serde_json::json!({
        "jsonrpc": "2.0",
        "id": 0,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-06-18",
            "capabilities": {},
            "clientInfo": {"name": "wor", "version": env!("CARGO_PKG_VERSION")},
        },
    });
    let mut request = EgressRequest::post(mcp_url, initialize.to_string().into_bytes());
    request.allowlist = allowlist;
    request.timeout = Some(METADATA_TIMEOUT);
    request.max_response_bytes = Some(MAX_METADATA_BYTES);
    request.headers.insert(
        reqwest::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    request.headers.insert(
        ACCEPT,
        HeaderValue::from_static("application/json, text/event-stream"),
    );
    let response = egress
        .send(request)
        .await
        .map_err(|source| OAuthError::Fetch {
            what: "the mcp server",
            url: mcp_url.to_owned(),
            source,
        })?;
    if response.status.as_u16() != 401 {
        return Ok(None);
    }
    let header = response
        .headers
        .get(reqwest::header::WWW_AUTHENTICATE)
        .and_then(|value| value.to_str().ok())
        .unwrap_or_default();
    Ok(Some(Challenge::parse(header)))
}

/// The scopes to ask for: those the server's challenge names, else those its
/// protected-resource metadata lists, else none (the parameter is left out).
pub fn requested_scopes(
    challenge: Option<&Challenge>,
    discovery: &AuthorizationDiscovery,
) -> Vec<String> {
    match challenge.map(Challenge::scopes) {
        Some(scopes) if !scopes.is_empty() => scopes,
        _ => union_scopes(
            discovery
                .protected_resource
                .scopes_supported
                .iter()
                .map(String::as_str),
        ),
    }
}

fn parse_url(what: &'static str, url: &str) -> Result<Url, OAuthError> {
    let parsed = EgressUrl::parse(url).map_err(|refusal| OAuthError::InvalidUrl {
        what,
        url: url.to_owned(),
        reason: refusal.to_string(),
    })?;
    let url = parsed.as_url().clone();
    if url.fragment().is_some() {
        return Err(OAuthError::InvalidUrl {
            what,
            url: url.to_string(),
            reason: "it has a fragment".to_owned(),
        });
    }
    Ok(url)
}

/// `https://host/.well-known/{suffix}{path}`, the well-known URL of RFC 8414 / RFC 9728 for a
/// URL with a path.
fn well_known(base: &Url, suffix: &str) -> String {
    let path = base.path().trim_end_matches('/');
    let mut url = base.clone();
    url.set_query(None);
    url.set_path(&format!("/.well-known/{suffix}{path}"));
    url.to_string()
}

/// Whether `url` has a path beyond `/`.
fn has_path(url: &Url) -> bool {
    !url.path().trim_end_matches('/').is_empty()
}

/// Where an authorization server's metadata may be, in the order MCP asks clients to try:
/// RFC 8414 with the issuer's path inserted, OpenID discovery with it inserted, then appended.
fn authorization_server_metadata_urls(issuer: &Url) -> Vec<String> {
    let mut urls = vec![
        well_known(issuer, "oauth-authorization-server"),
        well_known(issuer, "openid-configuration"),
    ];
    if has_path(issuer) {
        let mut appended = issuer.clone();
        appended.set_query(None);
        appended.set_path(&format!(
            "{}/.well-known/openid-configuration",
            issuer.path().trim_end_matches('/')
        ));
        urls.push(appended.to_string());
    }
    urls
}

async fn fetch<T: for<'de> Deserialize<'de>>(
    egress: &EgressClient,
    what: &'static str,
    url: &str,
) -> Result<T, OAuthError> {
    let mut request = EgressRequest::get(url);
    request.timeout = Some(METADATA_TIMEOUT);
    request.max_response_bytes = Some(MAX_METADATA_BYTES);
    request
        .headers
        .insert(ACCEPT, HeaderValue::from_static("application/json"));
    let response = egress
        .send(request)
        .await
        .map_err(|source| OAuthError::Fetch {
            what,
            url: url.to_owned(),
            source,
        })?;
    let status = response.status.as_u16();
    if response.status.is_redirection() {
        return Err(OAuthError::Redirect {
            what,
            url: url.to_owned(),
            status,
        });
    }
    if !response.status.is_success() {
        return Err(OAuthError::Status {
            what,
            url: url.to_owned(),
            status,
        });
    }
    serde_json::from_slice(&response.body).map_err(|e| OAuthError::InvalidDocument {
        what,
        url: url.to_owned(),
        reason: e.to_string(),
    })
}

/// The first of `urls` that answers with a document; only a `404` moves on to the next
/// (anything else is an answer). `None` when every one is missing.
async fn first_found<'u, T: for<'de> Deserialize<'de>>(
    egress: &EgressClient,
    what: &'static str,
    urls: &'u [String],
) -> Result<Option<(&'u str, T)>, OAuthError> {
    for url in urls {
        match fetch(egress, what, url).await {
            Ok(document) => return Ok(Some((url, document))),
            Err(OAuthError::Status { status: 404, .. }) => continue,
            Err(error) => return Err(error),
        }
    }
    Ok(None)
}

/// Discovers how to authorize with the MCP server at `mcp_url`: the protected-resource
/// metadata its `401` names (else its well-known URL with the server's path, then at the
/// root), then the first authorization server's metadata (RFC 8414, then OpenID discovery),
/// which must offer `S256`.
///
/// A server with no protected-resource metadata at all is one written for the 2025-03-26
/// revision of MCP: its own origin is then the authorization server, found through RFC 8414
/// there, or at that revision's default endpoints (`/authorize`, `/token`, `/register`) when it
/// has no metadata either.
pub async fn discover(
    egress: &EgressClient,
    mcp_url: &str,
    challenge: Option<&Challenge>,
) -> Result<AuthorizationDiscovery, OAuthError> {
    let server = parse_url("the mcp server url", mcp_url)?;
    let named = challenge.and_then(|c| c.resource_metadata.as_deref());
    let mut origin = server.clone();
    origin.set_path("/");
    origin.set_query(None);
    let at_root = well_known(&origin, "oauth-protected-resource");
    let candidates = match named {
        Some(url) => vec![parse_url("the protected-resource metadata url", url)?.to_string()],
        None if has_path(&server) => {
            vec![
                well_known(&server, "oauth-protected-resource"),
                at_root.clone(),
            ]
        }
        None => vec![at_root.clone()],
    };
    let what = "the protected-resource metadata";
    let (found_at, protected): (&str, ProtectedResourceMetadata) =
        match first_found(egress, what, &candidates).await? {
            Some(found) => found,
            // The server named its metadata and it is not there: that is an error, not an old server.
            None if named.is_some() => {
                return Err(OAuthError::Status {
                    what,
                    url: candidates.join(" or "),
                    status: 404,
                });
            }
            None => return legacy_discovery(egress, &server).await,
        };
    // RFC 9728 §3.3: the resource is the one whose URL the well-known suffix was put into, so
    // metadata found at the root may name the server's origin; anything else must be the server.
    let resource = parse_url("the protected resource", &protected.resource)?;
    let same =
        |a: &Url, b: &Url| a.as_str().trim_end_matches('/') == b.as_str().trim_end_matches('/');
    let matches = same(&resource, &server) || (found_at == at_root && same(&resource, &origin));
    if !matches {
        return Err(OAuthError::ResourceMismatch {
            named: protected.resource.clone(),
            expected: server.to_string(),
        });
    }
    let Some(issuer) = protected.authorization_servers.first().cloned() else {
        return Err(OAuthError::InvalidDocument {
            what,
            url: candidates.join(" or "),
            reason: "it names no authorization server".to_owned(),
        });
    };
    let issuer_url = parse_url("the authorization server", &issuer)?;
    let what = "the authorization server metadata";
    let urls = authorization_server_metadata_urls(&issuer_url);
    let Some((_, metadata)) =
        first_found::<AuthorizationServerMetadata>(egress, what, &urls).await?
    else {
        return Err(OAuthError::InvalidDocument {
            what,
            url: issuer,
            reason: "none was found".to_owned(),
        });
    };
    checked(
        AuthorizationDiscovery {
            resource: server.to_string(),
            protected_resource: protected,
            authorization_server: metadata,
        },
        &issuer,
    )
}

/// Discovery for a server of MCP's 2025-03-26 revision: its origin is the authorization server.
async fn legacy_discovery(
    egress: &EgressClient,
    server: &Url,
) -> Result<AuthorizationDiscovery, OAuthError> {
    let mut origin = server.clone();
    origin.set_path("");
    origin.set_query(None);
    let issuer = origin.as_str().trim_end_matches('/').to_owned();
    let urls = [well_known(&origin, "oauth-authorization-server")];
    let metadata = first_found::<AuthorizationServerMetadata>(
        egress,
        "the authorization server metadata",
        &urls,
    )
    .await?;
    let metadata = match metadata {
        Some((_, metadata)) => metadata,
        // That revision's default endpoints; it required PKCE of every client.
        None => AuthorizationServerMetadata {
            issuer: issuer.clone(),
            authorization_endpoint: format!("{issuer}/authorize"),
            token_endpoint: format!("{issuer}/token"),
            registration_endpoint: Some(format!("{issuer}/register")),
            code_challenge_methods_supported: vec!["S256".to_owned()],
            scopes_supported: Vec::new(),
            token_endpoint_auth_methods_supported: Vec::new(),
            client_id_metadata_document_supported: false,
            authorization_response_iss_parameter_supported: false,
        },
    };
    checked(
        AuthorizationDiscovery {
            resource: server.to_string(),
            protected_resource: ProtectedResourceMetadata {
                resource: server.to_string(),
                authorization_servers: vec![issuer.clone()],
                scopes_supported: Vec::new(),
            },
            authorization_server: metadata,
        },
        &issuer,
    )
}

/// The checks every discovery passes: the metadata is the issuer's own, offers `S256`, and
/// names usable endpoints.
fn checked(
    discovery: AuthorizationDiscovery,
    issuer: &str,
) -> Result<AuthorizationDiscovery, OAuthError> {
    let metadata = &discovery.authorization_server;
    if metadata.issuer.trim_end_matches('/') != issuer.trim_end_matches('/') {
        return Err(OAuthError::IssuerMismatch {
            named: metadata.issuer.clone(),
            expected: issuer.to_owned(),
        });
    }
    if !metadata
        .code_challenge_methods_supported
        .iter()
        .any(|m| m == "S256")
    {
        return Err(OAuthError::NoPkce {
            issuer: metadata.issuer.clone(),
        });
    }
    parse_url(
        "the authorization endpoint",
        &metadata.authorization_endpoint,
    )?;
    parse_url("the token endpoint", &metadata.token_endpoint)?;
    if let Some(registration) = &metadata.registration_endpoint {
        parse_url("the registration endpoint", registration)?;
    }
    Ok(discovery)
}

/// A PKCE verifier (kept secret until the code exchange) and its `S256` challenge.
#[derive(Debug)]
pub struct Pkce {
    verifier: SecretString,
    /// `BASE64URL(SHA-256(verifier))`, sent in the authorization request.
    pub challenge: String,
}

fn random_token() -> Result<String, OAuthError> {
    let mut bytes = [0_u8; 32];
    getrandom::fill(&mut bytes).map_err(|e| OAuthError::Random(e.to_string()))?;
    Ok(URL_SAFE_NO_PAD.encode(bytes))
}

impl Pkce {
    /// A fresh verifier of 256 random bits (43 characters) and its challenge.
    pub fn new() -> Result<Self, OAuthError> {
        Ok(Self::from_verifier(SecretString::from(random_token()?)))
    }

    /// The challenge of a given verifier (RFC 7636 appendix B).
    pub fn from_verifier(verifier: SecretString) -> Self {
        let challenge = URL_SAFE_NO_PAD.encode(Sha256::digest(verifier.expose_secret().as_bytes()));
        Self {
            verifier,
            challenge,
        }
    }

    /// The verifier, for the code exchange.
    pub fn verifier(&self) -> &SecretString {
        &self.verifier
    }
}

/// A random `state` value of 256 bits.
pub fn new_state() -> Result<String, OAuthError> {
    random_token()
}

/// The URL a person opens to authorize: authorization code with PKCE `S256`, `state` and the
/// `resource` (RFC 8707).
pub fn authorization_url(
    discovery: &AuthorizationDiscovery,
    client_id: &str,
    redirect_uri: &str,
    scopes: &[String],
    state: &str,
    pkce: &Pkce,
) -> Result<String, OAuthError> {
    let mut url = parse_url(
        "the authorization endpoint",
        &discovery.authorization_server.authorization_endpoint,
    )?;
    {
        let mut query = url.query_pairs_mut();
        query
            .append_pair("response_type", "code")
            .append_pair("client_id", client_id)
            .append_pair("redirect_uri", redirect_uri)
            .append_pair("state", state)
            .append_pair("code_challenge", &pkce.challenge)
            .append_pair("code_challenge_method", "S256")
            .append_pair("resource", &discovery.resource);
        if !scopes.is_empty() {
            query.append_pair("scope", &scopes.join(" "));
        }
    }
    Ok(url.to_string())
}

/// How a client authenticates at the token endpoint (RFC 7591 §2 names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TokenEndpointAuth {
    /// A public client: its `client_id` in the form, no secret (PKCE protects the code).
    None,
    /// `Authorization: Basic` with the id and secret (RFC 6749 §2.3.1).
    ClientSecretBasic,
    /// The id and secret in the form.
    ClientSecretPost,
}

impl TokenEndpointAuth {
    fn from_wire(name: &str) -> Option<Self> {
        match name {
            "none" => Some(Self::None),
            "client_secret_basic" => Some(Self::ClientSecretBasic),
            "client_secret_post" => Some(Self::ClientSecretPost),
            _ => None,
        }
    }

    /// How a client with (or without) a secret authenticates at this server: no secret is a
    /// public client; with one, `client_secret_basic` unless the server lists only
    /// `client_secret_post` (an empty list means basic, RFC 8414 §2).
    pub fn for_client(metadata: &AuthorizationServerMetadata, has_secret: bool) -> Self {
        let listed = |name: &str| {
            metadata
                .token_endpoint_auth_methods_supported
                .iter()
                .any(|m| m == name)
        };
        match has_secret {
            false => Self::None,
            true if !listed("client_secret_basic") && listed("client_secret_post") => {
                Self::ClientSecretPost
            }
            true => Self::ClientSecretBasic,
        }
    }

    /// What a registering client asks for: a public client wherever the server allows one
    /// (or lists nothing), else the first secret-based method it lists.
    fn to_register(metadata: &AuthorizationServerMetadata) -> Self {
        let methods = &metadata.token_endpoint_auth_methods_supported;
        if methods.is_empty() || methods.iter().any(|m| m == "none") {
            return Self::None;
        }
        methods
            .iter()
            .find_map(|m| Self::from_wire(m))
            .unwrap_or(Self::None)
    }
}

/// A client registered with the authorization server, or given by the operator.
#[derive(Debug, Clone)]
pub struct ClientRegistration {
    pub client_id: String,
    /// Only for a confidential client; a registered public client has none.
    pub client_secret: Option<SecretString>,
    /// How it authenticates at the token endpoint.
    pub auth: TokenEndpointAuth,
}

impl ClientRegistration {
    /// A client known by its id, its secret (if it has one) and how it authenticated before;
    /// a secret-based method without a secret leaves a public client.
    pub fn known(
        client_id: String,
        client_secret: Option<SecretString>,
        auth: Option<TokenEndpointAuth>,
        metadata: &AuthorizationServerMetadata,
    ) -> Self {
        let auth = match (auth, &client_secret) {
            (Some(TokenEndpointAuth::None), _) => TokenEndpointAuth::None,
            (Some(method), Some(_)) => method,
            _ => TokenEndpointAuth::for_client(metadata, client_secret.is_some()),
        };
        Self {
            client_id,
            client_secret,
            auth,
        }
    }

    /// A client whose id (and secret) the operator registered beforehand, authenticating as
    /// [`TokenEndpointAuth::for_client`] chooses.
    pub fn pre_registered(
        client_id: String,
        client_secret: Option<SecretString>,
        metadata: &AuthorizationServerMetadata,
    ) -> Self {
        Self::known(client_id, client_secret, None, metadata)
    }
}

/// Why wor's client ID metadata document URL cannot be a `client_id`
/// (draft-ietf-oauth-client-id-metadata-document §3).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MetadataDocumentUnusable {
    /// An authorization server fetches the document only over HTTPS: wor's `public_url` is
    /// `http` (a loopback or development address).
    #[error("`{url}` is not an https url (the server's `public_url` must be https for it)")]
    NotHttps {
        /// The URL.
        url: String,
    },
    /// The authorization server does not name itself in its answers (RFC 9207 `iss`): a
    /// `client_id` that is the same at every server would let a malicious server relay a
    /// code meant for another without the person seeing a different client.
    #[error(
        "the authorization server does not send `iss` with its answers (RFC 9207), which a client id shared by every server needs against a mix-up"
    )]
    NoIssuerInResponses,
    /// Not a URL a `client_id` may be: no path, a fragment, credentials, or a `.`/`..` segment.
    #[error("`{url}` cannot be a client id: {reason}")]
    Invalid {
        /// The URL.
        url: String,
        /// Why.
        reason: &'static str,
    },
}

/// An HTTPS URL that can be a `client_id` naming the client ID metadata document served there:
/// `https`, a path, no fragment, no credentials, no `.` or `..` path segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientMetadataUrl(String);

impl ClientMetadataUrl {
    /// Checks `url` as the draft requires of a client ID metadata document's URL.
    pub fn parse(url: &str) -> Result<Self, MetadataDocumentUnusable> {
        let invalid = |reason| MetadataDocumentUnusable::Invalid {
            url: url.to_owned(),
            reason,
        };
        let parsed = Url::parse(url).map_err(|_| invalid("it is not a url"))?;
        if parsed.scheme() != "https" {
            return Err(MetadataDocumentUnusable::NotHttps {
                url: url.to_owned(),
            });
        }
        // The parser resolves dot segments away, so they are looked for in the text.
        let raw_path = url
            .split_once("://")
            .map(|(_, rest)| rest)
            .and_then(|rest| rest.find('/').and_then(|at| rest.get(at..)))
            .unwrap_or_default();
        let raw_path = raw_path.split(['?', '#']).next().unwrap_or_default();
        if raw_path.split('/').any(|segment| {
            matches!(
                segment.to_ascii_lowercase().as_str(),
                "." | ".." | "%2e" | "%2e%2e" | ".%2e" | "%2e."
            )
        }) {
            return Err(invalid("its path has a `.` or `..` segment"));
        }
        if parsed.fragment().is_some() {
            return Err(invalid("it has a fragment"));
        }
        if !parsed.username().is_empty() || parsed.password().is_some() {
            return Err(invalid("it carries credentials"));
        }
        if !has_path(&parsed) {
            return Err(invalid("it has no path"));
        }
        Ok(Self(url.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A client's metadata (RFC 7591 §2): the body of a dynamic registration and, with its
/// `client_id`, the client ID metadata document `wor serve` publishes at that URL.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
pub struct ClientMetadata {
    /// In a metadata document: the document's own URL. Absent from a registration.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_id: Option<String>,
    pub client_name: String,
    pub redirect_uris: Vec<String>,
    pub grant_types: Vec<String>,
    pub response_types: Vec<String>,
    pub token_endpoint_auth_method: TokenEndpointAuth,
}

impl ClientMetadata {
    /// A client of the authorization-code grant (with refresh) for the one `redirect_uri`.
    fn new(
        client_id: Option<String>,
        client_name: &str,
        redirect_uri: &str,
        auth: TokenEndpointAuth,
    ) -> Self {
        Self {
            client_id,
            client_name: client_name.to_owned(),
            redirect_uris: vec![redirect_uri.to_owned()],
            grant_types: vec!["authorization_code".to_owned(), "refresh_token".to_owned()],
            response_types: vec!["code".to_owned()],
            token_endpoint_auth_method: auth,
        }
    }

    /// The client ID metadata document served at `url`: a public client (`none`; PKCE
    /// protects its codes), its `client_id` the URL itself.
    pub fn document(url: &ClientMetadataUrl, client_name: &str, redirect_uri: &str) -> Self {
        Self::new(
            Some(url.as_str().to_owned()),
            client_name,
            redirect_uri,
            TokenEndpointAuth::None,
        )
    }
}

/// How the authorization server knows the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ClientSource {
    /// The operator registered it beforehand and gave its id (and secret).
    Registered,
    /// Its id is the URL of its client ID metadata document.
    MetadataDocument,
    /// It was registered dynamically (RFC 7591) just now.
    DynamicRegistration,
}

/// The client an authorization uses, and how it came to be.
#[derive(Debug, Clone)]
pub struct ChosenClient {
    pub registration: ClientRegistration,
    pub source: ClientSource,
    /// The server accepts a client ID metadata document, but this one could not be used, so
    /// the client was registered dynamically instead.
    pub metadata_document_declined: Option<MetadataDocumentUnusable>,
}

/// The client to authorize with, in the order of MCP's authorization specification: one the
/// operator registered beforehand (`given`); else, when the server's metadata says
/// `client_id_metadata_document_supported`, the URL of wor's client ID metadata document as
/// the `client_id` (a public client; the server fetches the document itself); else dynamic
/// registration for `redirect_uri`. A metadata document the server would accept but which is
/// unusable (`metadata_document` is `Err`, e.g. an `http` public URL) falls back to dynamic
/// registration and says why.
pub async fn choose_client(
    egress: &EgressClient,
    discovery: &AuthorizationDiscovery,
    given: Option<ClientRegistration>,
    metadata_document: Result<&ClientMetadataUrl, &MetadataDocumentUnusable>,
    client_name: &str,
    redirect_uri: &str,
) -> Result<ChosenClient, OAuthError> {
    if let Some(registration) = given {
        return Ok(ChosenClient {
            registration,
            source: ClientSource::Registered,
            metadata_document_declined: None,
        });
    }
    let declined = match (
        discovery
            .authorization_server
            .client_id_metadata_document_supported,
        metadata_document,
    ) {
        (true, Ok(_))
            if !discovery
                .authorization_server
                .authorization_response_iss_parameter_supported =>
        {
            Some(MetadataDocumentUnusable::NoIssuerInResponses)
        }
        (true, Ok(url)) => {
            return Ok(ChosenClient {
                registration: ClientRegistration {
                    client_id: url.as_str().to_owned(),
                    client_secret: None,
                    auth: TokenEndpointAuth::None,
                },
                source: ClientSource::MetadataDocument,
                metadata_document_declined: None,
            });
        }
        (true, Err(why)) => Some(why.clone()),
        (false, _) => None,
    };
    let registration = register_client(egress, discovery, client_name, redirect_uri)
        .await
        .map_err(|error| match error {
            OAuthError::NoRegistration { issuer, .. } => OAuthError::NoRegistration {
                issuer,
                metadata_document: declined.clone(),
            },
            other => other,
        })?;
    Ok(ChosenClient {
        registration,
        source: ClientSource::DynamicRegistration,
        metadata_document_declined: declined,
    })
}

/// Tokens from the token endpoint.
#[derive(Debug, Clone)]
pub struct TokenSet {
    pub access_token: SecretString,
    /// The refresh token, when the server issued one (a rotated one replaces the old).
    pub refresh_token: Option<SecretString>,
    /// Seconds until the access token expires, when the server said.
    pub expires_in: Option<u64>,
}

#[derive(Deserialize)]
struct TokenResponse {
    access_token: String,
    #[serde(default)]
    refresh_token: Option<String>,
    #[serde(default)]
    expires_in: Option<u64>,
}

#[derive(Deserialize)]
struct ErrorResponse {
    error: String,
}

#[derive(Deserialize)]
struct RegistrationResponse {
    client_id: String,
    #[serde(default)]
    client_secret: Option<String>,
    #[serde(default)]
    token_endpoint_auth_method: Option<String>,
}

/// The OAuth error code of a refusal, kept only when it is made of the characters RFC 6749
/// allows (anything else could carry more than a code).
fn refusal(what: &'static str, status: u16, body: &[u8]) -> OAuthError {
    let error = serde_json::from_slice::<ErrorResponse>(body)
        .ok()
        .map(|e| e.error)
        .filter(|code| {
            !code.is_empty()
                && code.len() <= 64
                && code
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.')
        })
        .unwrap_or_else(|| format!("http status {status}"));
    OAuthError::Refused { what, error }
}

async fn post(
    egress: &EgressClient,
    what: &'static str,
    url: &str,
    content_type: &'static str,
    body: Vec<u8>,
    authorization: Option<HeaderValue>,
) -> Result<Vec<u8>, OAuthError> {
    let mut request = EgressRequest::post(url, body);
    if let Some(mut value) = authorization {
        value.set_sensitive(true);
        request
            .headers
            .insert(reqwest::header::AUTHORIZATION, value);
    }
    request.timeout = Some(METADATA_TIMEOUT);
    request.max_response_bytes = Some(MAX_METADATA_BYTES);
    request.headers.insert(
        reqwest::header::CONTENT_TYPE,
        HeaderValue::from_static(content_type),
    );
    request
        .headers
        .insert(ACCEPT, HeaderValue::from_static("application/json"));
    let response = egress
        .send(request)
        .await
        .map_err(|source| OAuthError::Fetch {
            what,
            url: url.to_owned(),
            source,
        })?;
    if !response.status.is_success() {
        return Err(refusal(what, response.status.as_u16(), &response.body));
    }
    Ok(response.body)
}

/// Registers a public client (PKCE, no secret) for `redirect_uri` (RFC 7591).
pub async fn register_client(
    egress: &EgressClient,
    discovery: &AuthorizationDiscovery,
    client_name: &str,
    redirect_uri: &str,
) -> Result<ClientRegistration, OAuthError> {
    let metadata = &discovery.authorization_server;
    let Some(endpoint) = &metadata.registration_endpoint else {
        return Err(OAuthError::NoRegistration {
            issuer: metadata.issuer.clone(),
            metadata_document: None,
        });
    };
    let requested = TokenEndpointAuth::to_register(metadata);
    let body = ClientMetadata::new(None, client_name, redirect_uri, requested);
    let what = "client registration";
    let body = serde_json::to_vec(&body).map_err(|e| OAuthError::InvalidDocument {
        what,
        url: endpoint.clone(),
        reason: e.to_string(),
    })?;
    let answer = post(egress, what, endpoint, "application/json", body, None).await?;
    let registered: RegistrationResponse =
        serde_json::from_slice(&answer).map_err(|e| OAuthError::InvalidDocument {
            what,
            url: endpoint.clone(),
            reason: e.to_string(),
        })?;
    let client_secret = registered.client_secret.map(SecretString::from);
    // The server's answer says how the client it registered authenticates; a secret-based
    // method without a secret cannot be used, so the client is then a public one.
    let auth = match registered
        .token_endpoint_auth_method
        .as_deref()
        .and_then(TokenEndpointAuth::from_wire)
    {
        Some(TokenEndpointAuth::None) => TokenEndpointAuth::None,
        Some(method) if client_secret.is_some() => method,
        _ => TokenEndpointAuth::for_client(metadata, client_secret.is_some()),
    };
    Ok(ClientRegistration {
        client_id: registered.client_id,
        client_secret,
        auth,
    })
}

async fn token_request(
    egress: &EgressClient,
    discovery: &AuthorizationDiscovery,
    client: &ClientRegistration,
    what: &'static str,
    pairs: &[(&str, &str)],
) -> Result<TokenSet, OAuthError> {
    // The serializer is not `Send`: the body is finished before anything is awaited.
    let body = {
        let mut form = url::form_urlencoded::Serializer::new(String::new());
        for (key, value) in pairs {
            form.append_pair(key, value);
        }
        match (client.auth, &client.client_secret) {
            (TokenEndpointAuth::ClientSecretPost, Some(secret)) => {
                form.append_pair("client_id", &client.client_id);
                form.append_pair("client_secret", secret.expose_secret());
            }
            (TokenEndpointAuth::ClientSecretBasic, Some(_)) => {}
            _ => {
                form.append_pair("client_id", &client.client_id);
            }
        }
        form.append_pair("resource", &discovery.resource);
        form.finish().into_bytes()
    };
    let authorization = match (client.auth, &client.client_secret) {
        (TokenEndpointAuth::ClientSecretBasic, Some(secret)) => {
            let encode = |text: &str| {
                url::form_urlencoded::byte_serialize(text.as_bytes()).collect::<String>()
            };
            let pair = format!(
                "{}:{}",
                encode(&client.client_id),
                encode(secret.expose_secret())
            );
            let value = format!(
                "Basic {}",
                base64::engine::general_purpose::STANDARD.encode(pair)
            );
            Some(
                HeaderValue::from_str(&value)
                    .map_err(|_| OAuthError::ClientCredentials("a basic authorization header"))?,
            )
        }
        _ => None,
    };
    let endpoint = &discovery.authorization_server.token_endpoint;
    let answer = post(
        egress,
        what,
        endpoint,
        "application/x-www-form-urlencoded",
        body,
        authorization,
    )
    .await?;
    // The answer holds tokens: a parse error says where, never what.
    let tokens: TokenResponse =
        serde_json::from_slice(&answer).map_err(|_| OAuthError::InvalidDocument {
            what,
            url: endpoint.clone(),
            reason: "it is not a token response".to_owned(),
        })?;
    Ok(TokenSet {
        access_token: SecretString::from(tokens.access_token),
        refresh_token: tokens.refresh_token.map(SecretString::from),
        expires_in: tokens.expires_in,
    })
}

/// Exchanges an authorization `code` for tokens, proving the PKCE verifier.
pub async fn exchange_code(
    egress: &EgressClient,
    discovery: &AuthorizationDiscovery,
    client: &ClientRegistration,
    code: &SecretString,
    redirect_uri: &str,
    pkce: &Pkce,
) -> Result<TokenSet, OAuthError> {
    token_request(
        egress,
        discovery,
        client,
        "code exchange",
        &[
            ("grant_type", "authorization_code"),
            ("code", code.expose_secret()),
            ("redirect_uri", redirect_uri),
            ("code_verifier", pkce.verifier().expose_secret()),
        ],
    )
    .await
}

/// Refreshes the tokens; the answer may rotate the refresh token too.
pub async fn refresh_tokens(
    egress: &EgressClient,
    discovery: &AuthorizationDiscovery,
    client: &ClientRegistration,
    refresh_token: &SecretString,
) -> Result<TokenSet, OAuthError> {
    token_request(
        egress,
        discovery,
        client,
        "token refresh",
        &[
            ("grant_type", "refresh_token"),
            ("refresh_token", refresh_token.expose_secret()),
        ],
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_challenge_is_rfc_7636s_example() {
        let pkce = Pkce::from_verifier(SecretString::from(
            "dBjftJeZ4CVP-mB92K27uhbUJU1p1r_wW1gFWFOEjXk".to_owned(),
        ));
        assert_eq!(
            pkce.challenge,
            "E9Melhoa2OwvFrEMTJguCHaoeK1t8URWbuGJSstw-cM"
        );
        assert!(
            !format!("{pkce:?}").contains("dBjftJeZ"),
            "the verifier stays out of Debug"
        );
        let fresh = Pkce::new().unwrap();
        assert_eq!(fresh.verifier().expose_secret().len(), 43);
        assert_ne!(new_state().unwrap(), new_state().unwrap());
    }

    #[test]
    fn the_challenge_names_the_resource_metadata() {
        assert_eq!(
            resource_metadata_url(
                r#"Bearer error="invalid_token", resource_metadata="https://mcp.example.com/.well-known/oauth-protected-resource""#
            )
            .as_deref(),
            Some("https://mcp.example.com/.well-known/oauth-protected-resource")
        );
        assert_eq!(
            resource_metadata_url("Bearer resource_metadata=https://a.example/x, scope=y")
                .as_deref(),
            Some("https://a.example/x")
        );
        assert_eq!(resource_metadata_url("Bearer realm=\"x\""), None);
    }

    #[test]
    fn a_challenge_gives_its_scope_and_metadata_quoted_or_not() {
        let challenge = Challenge::parse(
            r#"Bearer error="insufficient_scope", scope="files:read files:write", resource_metadata="https://a.example/m?scope=x""#,
        );
        assert_eq!(challenge.scope.as_deref(), Some("files:read files:write"));
        assert_eq!(
            challenge.resource_metadata.as_deref(),
            Some("https://a.example/m?scope=x"),
            "a parameter's name inside another's value is not a parameter"
        );
        let escaped = Challenge::parse(r#"bearer scope="a \"b\"""#);
        assert_eq!(escaped.scope.as_deref(), Some(r#"a "b""#));
        assert_eq!(
            Challenge::parse(r#"Basic realm="x", scope="y""#),
            Challenge::default(),
            "only a Bearer challenge counts"
        );
        assert_eq!(
            Challenge::parse(r#"Bearer scope="unterminated"#),
            Challenge::default()
        );
    }

    fn metadata(methods: &[&str]) -> AuthorizationServerMetadata {
        AuthorizationServerMetadata {
            issuer: "https://auth.example".to_owned(),
            authorization_endpoint: "https://auth.example/authorize".to_owned(),
            token_endpoint: "https://auth.example/token".to_owned(),
            registration_endpoint: None,
            code_challenge_methods_supported: vec!["S256".to_owned()],
            scopes_supported: Vec::new(),
            token_endpoint_auth_methods_supported: methods
                .iter()
                .map(|m| (*m).to_owned())
                .collect(),
            client_id_metadata_document_supported: false,
            authorization_response_iss_parameter_supported: false,
        }
    }

    #[test]
    fn an_insufficient_scope_challenge_names_the_scopes_needed() {
        let challenge = Challenge::parse(
            r#"Bearer error="insufficient_scope", scope="files:read files:write files:read", resource_metadata="https://a.example/m""#,
        );
        assert!(challenge.is_insufficient_scope());
        assert_eq!(challenge.scopes(), ["files:read", "files:write"]);
        assert!(!Challenge::parse(r#"Bearer error="invalid_token""#).is_insufficient_scope());
        assert_eq!(Challenge::parse("Bearer scope=x").scopes(), ["x"]);
    }

    #[test]
    fn scopes_are_united_in_order_and_only_valid_tokens_kept() {
        assert_eq!(
            union_scopes(["mcp:basic", "mcp:basic  mcp:write", ""]),
            ["mcp:basic", "mcp:write"]
        );
        // A double quote, a backslash or a control character is no scope token.
        assert_eq!(scope_tokens("a \"b c\\d e\u{7}f g"), ["a", "g"]);
        assert_eq!(
            scope_tokens(&"x".repeat(MAX_SCOPE_TOKEN_BYTES + 1)),
            Vec::<String>::new()
        );
        let many: Vec<String> = (0..100).map(|n| format!("s{n}")).collect();
        assert_eq!(
            scope_tokens(&many.join(" ")).len(),
            MAX_SCOPE_TOKENS,
            "the count is capped"
        );
    }

    #[test]
    fn a_client_metadata_url_is_https_with_a_clean_path() {
        let url =
            ClientMetadataUrl::parse("https://wor.example.com/hooks/oauth/client-metadata.json")
                .unwrap();
        assert_eq!(
            url.as_str(),
            "https://wor.example.com/hooks/oauth/client-metadata.json"
        );
        assert!(matches!(
            ClientMetadataUrl::parse("http://127.0.0.1:8080/hooks/oauth/client-metadata.json"),
            Err(MetadataDocumentUnusable::NotHttps { .. })
        ));
        for (bad, reason) in [
            ("https://wor.example.com", "it has no path"),
            ("https://wor.example.com/", "it has no path"),
            (
                "https://wor.example.com/a/../b.json",
                "its path has a `.` or `..` segment",
            ),
            (
                "https://wor.example.com/a/%2E/b.json",
                "its path has a `.` or `..` segment",
            ),
            ("https://wor.example.com/a.json#x", "it has a fragment"),
            (
                "https://u:p@wor.example.com/a.json",
                "it carries credentials",
            ),
            ("not a url", "it is not a url"),
        ] {
            assert_eq!(
                ClientMetadataUrl::parse(bad),
                Err(MetadataDocumentUnusable::Invalid {
                    url: bad.to_owned(),
                    reason
                }),
                "{bad}"
            );
        }
    }

    #[test]
    fn the_client_metadata_document_is_a_public_client_named_by_its_url() {
        let url =
            ClientMetadataUrl::parse("https://wor.example.com/hooks/oauth/client-metadata.json")
                .unwrap();
        let document =
            ClientMetadata::document(&url, "wor", "https://wor.example.com/hooks/oauth/callback");
        assert_eq!(
            serde_json::to_value(&document).unwrap(),
            serde_json::json!({
                "client_id": "https://wor.example.com/hooks/oauth/client-metadata.json",
                "client_name": "wor",
                "redirect_uris": ["https://wor.example.com/hooks/oauth/callback"],
                "grant_types": ["authorization_code", "refresh_token"],
                "response_types": ["code"],
                "token_endpoint_auth_method": "none",
            })
        );
        let registration = ClientMetadata::new(None, "wor", "http://x/cb", TokenEndpointAuth::None);
        assert!(
            serde_json::to_value(&registration)
                .unwrap()
                .get("client_id")
                .is_none(),
            "a registration request names no client id"
        );
    }

    #[test]
    fn a_declined_metadata_document_is_said_when_no_registration_is_offered() {
        let error = OAuthError::NoRegistration {
            issuer: "http://auth.example".to_owned(),
            metadata_document: Some(MetadataDocumentUnusable::NotHttps {
                url: "http://wor.test/hooks/oauth/client-metadata.json".to_owned(),
            }),
        };
        assert_eq!(
            error.to_string(),
            "authorization server `http://auth.example` offers no dynamic client registration, \
             and it accepts a client ID metadata document but `http://wor.test/hooks/oauth/client-metadata.json` \
             is not an https url (the server's `public_url` must be https for it); give the connection a client id"
        );
    }

    #[test]
    fn the_token_endpoint_authentication_follows_the_servers_metadata() {
        use TokenEndpointAuth::*;
        assert_eq!(TokenEndpointAuth::for_client(&metadata(&[]), false), None);
        assert_eq!(
            TokenEndpointAuth::for_client(&metadata(&[]), true),
            ClientSecretBasic
        );
        assert_eq!(
            TokenEndpointAuth::for_client(&metadata(&["client_secret_post"]), true),
            ClientSecretPost
        );
        assert_eq!(
            TokenEndpointAuth::for_client(
                &metadata(&["client_secret_post", "client_secret_basic"]),
                true
            ),
            ClientSecretBasic
        );
        assert_eq!(TokenEndpointAuth::to_register(&metadata(&[])), None);
        assert_eq!(
            TokenEndpointAuth::to_register(&metadata(&["client_secret_basic", "none"])),
            None
        );
        assert_eq!(
            TokenEndpointAuth::to_register(&metadata(&["client_secret_post"])),
            ClientSecretPost
        );
        let known = ClientRegistration::known(
            "c".to_owned(),
            Option::None,
            Some(ClientSecretBasic),
            &metadata(&[]),
        );
        assert_eq!(known.auth, None, "a secret-based method needs a secret");
    }

    #[test]
    fn authorization_server_metadata_is_looked_for_where_mcp_says() {
        let issuer = Url::parse("https://auth.example/tenant1").unwrap();
        assert_eq!(
            authorization_server_metadata_urls(&issuer),
            [
                "https://auth.example/.well-known/oauth-authorization-server/tenant1",
                "https://auth.example/.well-known/openid-configuration/tenant1",
                "https://auth.example/tenant1/.well-known/openid-configuration",
            ]
        );
        let root = Url::parse("https://auth.example").unwrap();
        assert_eq!(authorization_server_metadata_urls(&root).len(), 2);
    }

    #[test]
    fn well_known_urls_keep_the_path() {
        let url = Url::parse("https://mcp.example.com/v1/mcp").unwrap();
        assert_eq!(
            well_known(&url, "oauth-protected-resource"),
            "https://mcp.example.com/.well-known/oauth-protected-resource/v1/mcp"
        );
        let root = Url::parse("https://auth.example.com/").unwrap();
        assert_eq!(
            well_known(&root, "oauth-authorization-server"),
            "https://auth.example.com/.well-known/oauth-authorization-server"
        );
    }
}
