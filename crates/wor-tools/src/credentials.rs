//! [`ConnectionCredentials`]: the headers and bearer token of a tool connection, held as
//! secrets and attached to a request only at the moment it is sent.
//!
//! Values never appear in `Debug`, `Display` or an error: `Debug` shows header names only.
//! Attached header values are marked sensitive, so the HTTP stack does not print them either.

use std::fmt;

use reqwest::header::{AUTHORIZATION, HeaderMap, HeaderName, HeaderValue};
use secrecy::{ExposeSecret, SecretString};
use wor_secrets::{RedactionError, Redactor};

/// Header names a connection may not set: the transport owns them.
const RESERVED_HEADERS: &[&str] = &[
    "accept",
    "connection",
    "content-length",
    "content-type",
    "host",
    "last-event-id",
    "mcp-protocol-version",
    "mcp-session-id",
    "transfer-encoding",
];

/// Replaces an access token the MCP server refused (`401`) in the middle of a session: the
/// engine refreshes an authorized connection's token through the connection's refresh claim.
pub trait BearerRenewal: Send + Sync {
    /// A token to send instead of `rejected`, which the server just refused (another caller
    /// may have renewed it already; then the current one).
    fn renew<'a>(
        &'a self,
        rejected: &'a SecretString,
    ) -> futures::future::BoxFuture<'a, Result<SecretString, BearerRenewalError>>;

    /// Why the session stops when the server refuses the renewed token too.
    fn refused_after_renewal(&self) -> BearerRenewalError;
}

/// A refused token could not be renewed. The reason is for people: it names the connection
/// and what to do, never a token.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason}")]
pub struct BearerRenewalError {
    pub reason: String,
}

/// A credential could not be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CredentialError {
    /// Not a valid HTTP header name.
    #[error("`{0}` is not a valid header name")]
    InvalidHeaderName(String),
    /// The transport sets this header itself.
    #[error("header `{0}` is set by the transport and cannot be a credential")]
    ReservedHeader(String),
    /// The same header given twice (names are case-insensitive).
    #[error("header `{0}` is given twice (header names are case-insensitive)")]
    DuplicateHeader(String),
    /// Both a bearer token and an `Authorization` header.
    #[error("a connection has either a bearer token or an `authorization` header, not both")]
    DuplicateAuthorization,
    /// The value cannot be sent in a header (control characters); the value is not shown.
    #[error("the value of header `{0}` is not a valid header value")]
    InvalidHeaderValue(String),
}

/// The secret headers of one connection.
#[derive(Clone, Default)]
pub struct ConnectionCredentials {
    headers: Vec<(HeaderName, SecretString)>,
}

impl fmt::Debug for ConnectionCredentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = self.headers.iter().map(|(name, _)| name.as_str()).collect();
        f.debug_struct("ConnectionCredentials")
            .field("headers", &names)
            .finish_non_exhaustive()
    }
}

impl ConnectionCredentials {
    /// No credentials.
    pub fn none() -> Self {
        Self::default()
    }

    /// `Authorization: Bearer <token>`.
    pub fn bearer(token: SecretString) -> Result<Self, CredentialError> {
        Self::none().with_bearer(token)
    }

    /// Adds `Authorization: Bearer <token>`.
    pub fn with_bearer(self, token: SecretString) -> Result<Self, CredentialError> {
        let value = SecretString::from(format!("Bearer {}", token.expose_secret()));
        self.with_header(AUTHORIZATION.as_str(), value)
    }

    /// Adds a secret header, such as `x-api-key`.
    pub fn with_header(mut self, name: &str, value: SecretString) -> Result<Self, CredentialError> {
        let name = HeaderName::from_bytes(name.trim().as_bytes())
            .map_err(|_| CredentialError::InvalidHeaderName(name.to_owned()))?;
        if RESERVED_HEADERS.contains(&name.as_str()) {
            return Err(CredentialError::ReservedHeader(name.as_str().to_owned()));
        }
        if self.headers.iter().any(|(existing, _)| *existing == name) {
            return Err(if name == AUTHORIZATION {
                CredentialError::DuplicateAuthorization
            } else {
                CredentialError::DuplicateHeader(name.as_str().to_owned())
            });
        }
        HeaderValue::from_str(value.expose_secret())
            .map_err(|_| CredentialError::InvalidHeaderValue(name.as_str().to_owned()))?;
        self.headers.push((name, value));
        Ok(self)
    }

    /// The header names, for display.
    pub fn header_names(&self) -> impl Iterator<Item = &str> {
        self.headers.iter().map(|(name, _)| name.as_str())
    }

    /// Whether there are no credentials.
    pub fn is_empty(&self) -> bool {
        self.headers.is_empty()
    }

    /// The headers to attach, values marked sensitive. Call at send time only.
    pub(crate) fn header_map(&self) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, secret) in &self.headers {
            // Checked in `with_header`; a value that fails here is skipped, never shown.
            if let Ok(mut value) = HeaderValue::from_str(secret.expose_secret()) {
                value.set_sensitive(true);
                map.insert(name.clone(), value);
            }
        }
        map
    }

    /// The bearer token sent in `Authorization: Bearer …`, if any.
    pub(crate) fn bearer_token(&self) -> Option<SecretString> {
        self.headers.iter().find_map(|(name, value)| {
            (*name == AUTHORIZATION)
                .then(|| value.expose_secret().strip_prefix("Bearer "))
                .flatten()
                .map(|token| SecretString::from(token.to_owned()))
        })
    }

    /// These credentials with `token` in place of the bearer token.
    pub(crate) fn with_bearer_replaced(
        &self,
        token: SecretString,
    ) -> Result<Self, CredentialError> {
        let mut replaced = self.clone();
        replaced.headers.retain(|(name, _)| *name != AUTHORIZATION);
        replaced.with_bearer(token)
    }

    /// A redactor for this connection's live secret values (the bare bearer token included)
    /// plus every secret shape.
    pub fn redactor(&self) -> Result<Redactor, RedactionError> {
        self.redactor_with(&[])
    }

    /// [`ConnectionCredentials::redactor`], also knowing `retired` values (the access tokens a
    /// session used before it renewed them).
    pub(crate) fn redactor_with(
        &self,
        retired: &[SecretString],
    ) -> Result<Redactor, RedactionError> {
        let mut values: Vec<&str> = retired.iter().map(|s| s.expose_secret()).collect();
        for (name, secret) in &self.headers {
            let value = secret.expose_secret();
            values.push(value);
            if *name == AUTHORIZATION
                && let Some(token) = value.strip_prefix("Bearer ")
            {
                values.push(token);
            }
        }
        Redactor::new(values)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_shows_names_only() {
        let credentials = ConnectionCredentials::bearer(SecretString::from("tok-1234567890"))
            .unwrap()
            .with_header("X-Api-Key", SecretString::from("key-0987654321"))
            .unwrap();
        let debug = format!("{credentials:?}");
        assert!(debug.contains("authorization") && debug.contains("x-api-key"));
        assert!(!debug.contains("tok-1234567890") && !debug.contains("key-0987654321"));
        let map = credentials.header_map();
        assert!(map.get(AUTHORIZATION).unwrap().is_sensitive());
        assert!(!format!("{map:?}").contains("tok-1234567890"));
    }

    #[test]
    fn refuses_reserved_and_invalid_headers() {
        assert_eq!(
            ConnectionCredentials::none()
                .with_header("Mcp-Session-Id", SecretString::from("x"))
                .unwrap_err(),
            CredentialError::ReservedHeader("mcp-session-id".into())
        );
        let error = ConnectionCredentials::none()
            .with_header("x-key", SecretString::from("line\nbreak-secret"))
            .unwrap_err();
        assert!(!error.to_string().contains("break-secret"));
        assert_eq!(
            ConnectionCredentials::bearer(SecretString::from("a"))
                .unwrap()
                .with_header("Authorization", SecretString::from("Basic b"))
                .unwrap_err(),
            CredentialError::DuplicateAuthorization
        );
        // The same header twice, however it is cased, is said to be that.
        let twice = ConnectionCredentials::none()
            .with_header("X-A", SecretString::from("a"))
            .unwrap()
            .with_header("x-a", SecretString::from("b"))
            .unwrap_err();
        assert_eq!(twice, CredentialError::DuplicateHeader("x-a".into()));
        assert!(twice.to_string().contains("given twice"), "{twice}");
    }

    #[test]
    fn a_replaced_bearer_keeps_the_other_headers_and_the_old_token_stays_redacted() {
        let credentials = ConnectionCredentials::bearer(SecretString::from("tok-old-1234567"))
            .unwrap()
            .with_header("X-Api-Key", SecretString::from("key-0987654321"))
            .unwrap();
        let replaced = credentials
            .with_bearer_replaced(SecretString::from("tok-new-7654321"))
            .unwrap();
        assert_eq!(
            replaced.bearer_token().unwrap().expose_secret(),
            "tok-new-7654321"
        );
        assert_eq!(replaced.header_map().len(), 2);
        let redactor = replaced
            .redactor_with(&[credentials.bearer_token().unwrap()])
            .unwrap();
        assert_eq!(
            redactor.redact("tok-old-1234567 tok-new-7654321 key-0987654321"),
            "[REDACTED] [REDACTED] [REDACTED]"
        );
    }

    #[test]
    fn redactor_knows_the_bare_token() {
        let credentials =
            ConnectionCredentials::bearer(SecretString::from("tok-1234567890")).unwrap();
        let redactor = credentials.redactor().unwrap();
        assert_eq!(redactor.redact("echo tok-1234567890"), "echo [REDACTED]");
    }
}
