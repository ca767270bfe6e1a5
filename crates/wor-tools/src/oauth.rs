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
//! The token requests are here too: dynamic client registration (RFC 7591, a public client
//! using PKCE), the code exchange and the refresh grant, each with `resource`; tokens come back
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
use wor_egress::{EgressClient, EgressError, EgressRequest, EgressUrl};

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
    /// The connection's authorization server offers no dynamic registration.
    #[error(
        "authorization server `{issuer}` offers no dynamic client registration; give the connection a client id"
    )]
    NoRegistration {
        /// The issuer.
        issuer: String,
    },
    /// The authorization server refused a registration or token request.
    #[error("the authorization server refused the {what}: `{error}`")]
    Refused {
        /// Which request.
        what: &'static str,
        /// The OAuth error code (RFC 6749 §5.2), or the status when there is none.
        error: String,
    },
    /// No randomness could be had.
    #[error("no randomness for pkce and state: {0}")]
    Random(String),
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
}

/// What discovery found; stored with a connection's authorization as JSON.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
pub struct AuthorizationDiscovery {
    /// The MCP server's resource identifier, sent as `resource` on every request.
    pub resource: String,
    pub protected_resource: ProtectedResourceMetadata,
    pub authorization_server: AuthorizationServerMetadata,
}

/// The `resource_metadata` parameter of a `WWW-Authenticate: Bearer …` challenge.
pub fn resource_metadata_url(www_authenticate: &str) -> Option<String> {
    let lower = www_authenticate.to_ascii_lowercase();
    let start = lower.find("resource_metadata=")? + "resource_metadata=".len();
    let rest = www_authenticate.get(start..)?;
    let value = match rest.strip_prefix('"') {
        Some(quoted) => quoted.split('"').next()?,
        None => rest.split([',', ' ']).next()?,
    };
    (!value.is_empty()).then(|| value.to_owned())
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

/// Discovers how to authorize with the MCP server at `mcp_url`: the protected-resource
/// metadata named by the `401`'s challenge (or its well-known URL), then the first
/// authorization server's metadata (RFC 8414, then OpenID discovery), which must offer
/// `S256`.
pub async fn discover(
    egress: &EgressClient,
    mcp_url: &str,
    www_authenticate: Option<&str>,
) -> Result<AuthorizationDiscovery, OAuthError> {
    let server = parse_url("the mcp server url", mcp_url)?;
    let metadata_url = match www_authenticate.and_then(resource_metadata_url) {
        Some(url) => parse_url("the protected-resource metadata url", &url)?.to_string(),
        None => well_known(&server, "oauth-protected-resource"),
    };
    let protected: ProtectedResourceMetadata =
        fetch(egress, "the protected-resource metadata", &metadata_url).await?;
    let named = parse_url("the protected resource", &protected.resource)?;
    if named.as_str().trim_end_matches('/') != server.as_str().trim_end_matches('/') {
        return Err(OAuthError::ResourceMismatch {
            named: protected.resource.clone(),
            expected: server.to_string(),
        });
    }
    let Some(issuer) = protected.authorization_servers.first() else {
        return Err(OAuthError::InvalidDocument {
            what: "the protected-resource metadata",
            url: metadata_url,
            reason: "it names no authorization server".to_owned(),
        });
    };
    let issuer_url = parse_url("the authorization server", issuer)?;
    let mut last = None;
    let mut found = None;
    for suffix in ["oauth-authorization-server", "openid-configuration"] {
        let url = well_known(&issuer_url, suffix);
        match fetch::<AuthorizationServerMetadata>(
            egress,
            "the authorization server metadata",
            &url,
        )
        .await
        {
            Ok(metadata) => {
                found = Some(metadata);
                break;
            }
            // Only a missing document moves on to the next form; anything else is an answer.
            Err(error @ OAuthError::Status { status: 404, .. }) => last = Some(error),
            Err(error) => return Err(error),
        }
    }
    let metadata = match (found, last) {
        (Some(metadata), _) => metadata,
        (None, Some(error)) => return Err(error),
        (None, None) => {
            return Err(OAuthError::InvalidDocument {
                what: "the authorization server metadata",
                url: issuer.clone(),
                reason: "none was found".to_owned(),
            });
        }
    };
    if metadata.issuer.trim_end_matches('/') != issuer.trim_end_matches('/') {
        return Err(OAuthError::IssuerMismatch {
            named: metadata.issuer,
            expected: issuer.clone(),
        });
    }
    if !metadata
        .code_challenge_methods_supported
        .iter()
        .any(|m| m == "S256")
    {
        return Err(OAuthError::NoPkce {
            issuer: metadata.issuer,
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
    Ok(AuthorizationDiscovery {
        resource: server.to_string(),
        protected_resource: protected,
        authorization_server: metadata,
    })
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

/// A client registered with the authorization server.
#[derive(Debug, Clone)]
pub struct ClientRegistration {
    pub client_id: String,
    /// Only for a confidential client; a registered public client has none.
    pub client_secret: Option<SecretString>,
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
) -> Result<Vec<u8>, OAuthError> {
    let mut request = EgressRequest::post(url, body);
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
        });
    };
    let body = serde_json::json!({
        "client_name": client_name,
        "redirect_uris": [redirect_uri],
        "grant_types": ["authorization_code", "refresh_token"],
        "response_types": ["code"],
        "token_endpoint_auth_method": "none",
    });
    let what = "client registration";
    let answer = post(
        egress,
        what,
        endpoint,
        "application/json",
        body.to_string().into_bytes(),
    )
    .await?;
    let registered: RegistrationResponse =
        serde_json::from_slice(&answer).map_err(|e| OAuthError::InvalidDocument {
            what,
            url: endpoint.clone(),
            reason: e.to_string(),
        })?;
    Ok(ClientRegistration {
        client_id: registered.client_id,
        client_secret: registered.client_secret.map(SecretString::from),
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
        form.append_pair("client_id", &client.client_id);
        if let Some(secret) = &client.client_secret {
            form.append_pair("client_secret", secret.expose_secret());
        }
        form.append_pair("resource", &discovery.resource);
        form.finish().into_bytes()
    };
    let endpoint = &discovery.authorization_server.token_endpoint;
    let answer = post(
        egress,
        what,
        endpoint,
        "application/x-www-form-urlencoded",
        body,
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
