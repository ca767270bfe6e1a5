//! rmcp's streamable HTTP client trait, implemented on the [`EgressClient`].
//!
//! Every request rmcp makes (initialize, calls, the server-sent event stream, session delete)
//! is vetted by the egress guard against the connection's allowlist and sent on the guarded
//! client. Credential headers are attached here, at send time; rmcp's own `auth_header` is
//! never used, so no credential sits in rmcp's configuration or its `Debug` output.
//! Bodies and server-sent events are read with size caps.

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;
use futures::stream::{BoxStream, Stream, StreamExt};
use http::{HeaderName, HeaderValue};
use reqwest::header::{ACCEPT, CONTENT_TYPE, RETRY_AFTER};
use rmcp::model::{ClientJsonRpcMessage, ServerJsonRpcMessage};
use rmcp::transport::streamable_http_client::{
    HttpStatusError, SseError, StreamableHttpClient, StreamableHttpError,
    StreamableHttpPostResponse, StreamableHttpResponseLimits,
};
use sse_stream::{Sse, SseStream};
use wor_egress::{EgressClient, EgressError, GuardedLookupError, HostAllowlist, Method};

use secrecy::{ExposeSecret, SecretString};

use super::LiveRedactor;
use crate::credentials::{BearerRenewal, BearerRenewalError, ConnectionCredentials};
use crate::oauth::Challenge;

const SESSION_ID: &str = "mcp-session-id";
const LAST_EVENT_ID: &str = "last-event-id";
const EVENT_STREAM: &str = "text/event-stream";
const JSON: &str = "application/json";

/// The deepest arrays and objects may nest in a message from an MCP server, its JSON-RPC
/// envelope included. Checked before the message is parsed: the parser that reads it does not
/// bound its depth, and a deep enough value overflows the stack of whatever walks or drops it.
pub const MAX_MESSAGE_NESTING: usize = 128;

/// The JSON body of a response, refused when it nests too deeply.
fn shallow_enough(body: &[u8]) -> Result<&[u8], McpHttpError> {
    if wor_core::json_depth::text_nesting(body) > MAX_MESSAGE_NESTING {
        return Err(McpHttpError::TooDeep(MAX_MESSAGE_NESTING));
    }
    Ok(body)
}

/// What went wrong in one HTTP exchange with an MCP server. No variant holds a URL or header.
#[derive(Debug, thiserror::Error)]
pub enum McpHttpError {
    /// The egress guard refused the request, or it could not be sent.
    #[error(transparent)]
    Egress(#[from] EgressError),
    /// The server answered with an unexpected status.
    #[error("mcp server answered http {0}")]
    Status(u16),
    /// A body or event exceeded its cap.
    #[error("mcp server sent more than {0} bytes in one message")]
    TooLarge(usize),
    /// A message nested deeper than [`MAX_MESSAGE_NESTING`].
    #[error("mcp server sent a message nested deeper than {0} levels")]
    TooDeep(usize),
    /// The server refused the connection's access token and it could not be renewed, or
    /// refused the renewed one too.
    #[error(transparent)]
    Unauthorized(BearerRenewalError),
    /// The server asks for authorization (`401`) and the session has no token to renew: its
    /// challenge says where the metadata is and which scopes it wants.
    #[error("mcp server asks for authorization (http 401)")]
    AuthorizationRequired(Challenge),
    /// The server refused the access token for its scope (`403` with
    /// `WWW-Authenticate: Bearer error="insufficient_scope"`): the challenge names the scopes.
    #[error("mcp server refused the access token's scope (http 403 insufficient_scope)")]
    InsufficientScope(Challenge),
    /// A message could not be encoded.
    #[error("could not encode the message: {0}")]
    Encode(#[source] serde_json::Error),
}

/// The guarded HTTP side of one MCP connection. Cheap to clone.
#[derive(Debug, Clone)]
pub(crate) struct EgressStreamableHttp {
    inner: Arc<Inner>,
}

struct Inner {
    egress: EgressClient,
    allowlist: HostAllowlist,
    /// Replaced only when a refused access token is renewed.
    credentials: std::sync::RwLock<ConnectionCredentials>,
    renewal: Option<Arc<dyn BearerRenewal>>,
    /// One renewal at a time per session: a request refused meanwhile retries with its result.
    renewing: tokio::sync::Mutex<()>,
    /// The access tokens the session used before renewing them, still redacted.
    retired: std::sync::Mutex<Vec<SecretString>>,
    redactor: Arc<LiveRedactor>,
    max_message_bytes: usize,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EgressStreamableHttp")
            .field("allowlist", &self.allowlist)
            .field("renews", &self.renewal.is_some())
            .field("max_message_bytes", &self.max_message_bytes)
            .finish_non_exhaustive()
    }
}

type HttpResult<T> = Result<T, StreamableHttpError<McpHttpError>>;

fn unauthorized(error: BearerRenewalError) -> StreamableHttpError<McpHttpError> {
    StreamableHttpError::Client(McpHttpError::Unauthorized(error))
}

impl EgressStreamableHttp {
    pub(crate) fn new(
        egress: EgressClient,
        allowlist: HostAllowlist,
        credentials: ConnectionCredentials,
        renewal: Option<Arc<dyn BearerRenewal>>,
        redactor: Arc<LiveRedactor>,
        max_message_bytes: usize,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                egress,
                allowlist,
                credentials: std::sync::RwLock::new(credentials),
                renewal,
                renewing: tokio::sync::Mutex::new(()),
                retired: std::sync::Mutex::new(Vec::new()),
                redactor,
                max_message_bytes,
            }),
        }
    }

    fn credentials(&self) -> ConnectionCredentials {
        self.inner
            .credentials
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// A vetted request with rmcp's protocol headers, then the credentials (last, so nothing
    /// can replace them); also the credentials it carries.
    async fn request(
        &self,
        method: Method,
        uri: &str,
        session_id: Option<&str>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
    ) -> HttpResult<(reqwest::RequestBuilder, ConnectionCredentials)> {
        let mut builder = self
            .inner
            .egress
            .streaming_request(method, uri, Some(&self.inner.allowlist))
            .await
            .map_err(|e| StreamableHttpError::Client(McpHttpError::Egress(e)))?;
        for (name, value) in custom_headers {
            builder = builder.header(name, value);
        }
        if let Some(session_id) = session_id {
            builder = builder.header(SESSION_ID, session_id);
        }
        let credentials = self.credentials();
        builder = builder.headers(credentials.header_map());
        Ok((builder, credentials))
    }

    async fn send(&self, builder: reqwest::RequestBuilder) -> HttpResult<reqwest::Response> {
        builder.send().await.map_err(client_error)
    }

    /// Sends a request built by `finish` on [`Self::request`]. When the server refuses the
    /// session's access token (`401`) and the session can renew it, the token is renewed once
    /// and the request sent again. A `401` means the server refused the request before acting
    /// on it, so sending it again cannot run a tool call twice. A renewal that fails, or a
    /// renewed token refused too, ends the request with the renewal's reason.
    async fn send_authorized(
        &self,
        method: Method,
        uri: &str,
        session_id: Option<&str>,
        custom_headers: &HashMap<HeaderName, HeaderValue>,
        finish: impl Fn(reqwest::RequestBuilder) -> reqwest::RequestBuilder,
    ) -> HttpResult<reqwest::Response> {
        let (builder, presented) = self
            .request(method.clone(), uri, session_id, custom_headers.clone())
            .await?;
        let response = self.send(finish(builder)).await?;
        let Some(renewal) = &self.inner.renewal else {
            return Ok(response);
        };
        if response.status() != reqwest::StatusCode::UNAUTHORIZED {
            return Ok(response);
        }
        drop(response);
        self.renew(renewal.as_ref(), &presented).await?;
        let (builder, _) = self
            .request(method, uri, session_id, custom_headers.clone())
            .await?;
        let response = self.send(finish(builder)).await?;
        if response.status() == reqwest::StatusCode::UNAUTHORIZED {
            return Err(unauthorized(renewal.refused_after_renewal()));
        }
        Ok(response)
    }

    /// Replaces the bearer token `presented` carried, unless another request of the session
    /// already did. The session's redactor learns the new token before any answer sent with
    /// it is read, and keeps the old one.
    async fn renew(
        &self,
        renewal: &dyn BearerRenewal,
        presented: &ConnectionCredentials,
    ) -> HttpResult<()> {
        let _one = self.inner.renewing.lock().await;
        let current = self.credentials();
        let rejected = presented
            .bearer_token()
            .unwrap_or_else(|| SecretString::from(String::new()));
        if current
            .bearer_token()
            .is_some_and(|token| token.expose_secret() != rejected.expose_secret())
        {
            return Ok(());
        }
        let token = renewal.renew(&rejected).await.map_err(unauthorized)?;
        let cannot_use = |what: String| {
            unauthorized(BearerRenewalError {
                reason: format!("the renewed access token cannot be used: {what}"),
            })
        };
        let renewed = current
            .with_bearer_replaced(token)
            .map_err(|e| cannot_use(e.to_string()))?;
        let redactor = {
            let mut retired = self
                .inner
                .retired
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            retired.push(rejected);
            renewed
                .redactor_with(&retired)
                .map_err(|e| cannot_use(e.to_string()))?
        };
        self.inner.redactor.replace(redactor);
        *self
            .inner
            .credentials
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = renewed;
        Ok(())
    }
}

/// Maps a reqwest failure, recovering a guard refusal raised inside the resolver and
/// stripping the URL.
fn client_error(error: reqwest::Error) -> StreamableHttpError<McpHttpError> {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&error);
    while let Some(current) = source {
        if let Some(lookup) = current.downcast_ref::<GuardedLookupError>() {
            let egress = match lookup.clone() {
                GuardedLookupError::Denied(denial) => EgressError::Denied(Box::new(denial)),
                GuardedLookupError::Resolve { host, source } => {
                    EgressError::Resolve { host, source }
                }
            };
            return StreamableHttpError::Client(McpHttpError::Egress(egress));
        }
        source = current.source();
    }
    StreamableHttpError::Client(McpHttpError::Egress(EgressError::Request(
        error.without_url(),
    )))
}

fn media_type(response: &reqwest::Response) -> Option<String> {
    response
        .headers()
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .map(|v| v.trim().to_ascii_lowercase())
}

/// The error for a non-success status: rate limits and server errors keep only the status and
/// `Retry-After` (rmcp may retry them); a `401` is [`McpHttpError::AuthorizationRequired`] and a
/// `403` whose Bearer challenge says `insufficient_scope` is [`McpHttpError::InsufficientScope`],
/// each with the challenge; anything else is [`McpHttpError::Status`].
fn status_failure(
    status: reqwest::StatusCode,
    headers: &reqwest::header::HeaderMap,
) -> StreamableHttpError<McpHttpError> {
    let challenge = || {
        Challenge::parse(
            headers
                .get(reqwest::header::WWW_AUTHENTICATE)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default(),
        )
    };
    if status == reqwest::StatusCode::UNAUTHORIZED {
        return StreamableHttpError::Client(McpHttpError::AuthorizationRequired(challenge()));
    }
    if status == reqwest::StatusCode::FORBIDDEN {
        let challenge = challenge();
        if challenge.is_insufficient_scope() {
            return StreamableHttpError::Client(McpHttpError::InsufficientScope(challenge));
        }
    }
    if status == reqwest::StatusCode::TOO_MANY_REQUESTS || status.is_server_error() {
        let retry_after = headers
            .get(RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        return HttpStatusError::new(status.as_u16(), retry_after).into();
    }
    StreamableHttpError::Client(McpHttpError::Status(status.as_u16()))
}

fn require_success(response: &reqwest::Response) -> HttpResult<()> {
    if response.status().is_success() {
        Ok(())
    } else {
        Err(status_failure(response.status(), response.headers()))
    }
}

/// Reads the whole body, refusing more than `limit` bytes.
async fn read_capped(response: reqwest::Response, limit: usize) -> HttpResult<Vec<u8>> {
    if response
        .content_length()
        .is_some_and(|len| usize::try_from(len).map_or(true, |len| len > limit))
    {
        return Err(StreamableHttpError::Client(McpHttpError::TooLarge(limit)));
    }
    let mut body = Vec::new();
    let mut stream = response.bytes_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(client_error)?;
        if body.len().saturating_add(chunk.len()) > limit {
            return Err(StreamableHttpError::Client(McpHttpError::TooLarge(limit)));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// Counts the bytes of the current server-sent event and fails past `limit`, and tracks how
/// deeply its JSON nests and fails past [`MAX_MESSAGE_NESTING`], before the parser buffers it.
/// An event ends at a blank line (`\n\n`, `\r\n\r\n` or `\r\r`).
#[derive(Debug)]
struct EventSizeLimit {
    limit: usize,
    in_event: usize,
    /// Open arrays and objects of the event's data; strings (which cannot span lines) aside.
    nesting: usize,
    in_string: bool,
    escaped: bool,
    /// The previous byte ended a line (`\n`, or `\r` not followed by `\n` yet).
    at_line_start: bool,
    previous_cr: bool,
}

impl EventSizeLimit {
    fn new(limit: usize) -> Self {
        Self {
            limit,
            in_event: 0,
            nesting: 0,
            in_string: false,
            escaped: false,
            at_line_start: true,
            previous_cr: false,
        }
    }

    fn feed(&mut self, chunk: &[u8]) -> Result<(), McpHttpError> {
        for &byte in chunk {
            match byte {
                b'\n' if self.previous_cr => {
                    // The `\n` of a `\r\n`: the line already ended at `\r`.
                    self.previous_cr = false;
                    continue;
                }
                b'\n' | b'\r' => {
                    if self.at_line_start {
                        self.in_event = 0;
                        self.nesting = 0;
                    }
                    self.in_string = false;
                    self.escaped = false;
                    self.at_line_start = true;
                    self.previous_cr = byte == b'\r';
                    continue;
                }
                _ => {
                    self.at_line_start = false;
                    self.previous_cr = false;
                }
            }
            self.in_event = self.in_event.saturating_add(1);
            if self.in_event > self.limit {
                return Err(McpHttpError::TooLarge(self.limit));
            }
            match (self.in_string, self.escaped, byte) {
                (true, true, _) => self.escaped = false,
                (true, false, b'\\') => self.escaped = true,
                (true, false, b'"') | (false, _, b'"') => self.in_string = !self.in_string,
                (false, _, b'[' | b'{') => {
                    self.nesting += 1;
                    if self.nesting > MAX_MESSAGE_NESTING {
                        return Err(McpHttpError::TooDeep(MAX_MESSAGE_NESTING));
                    }
                }
                (false, _, b']' | b'}') => self.nesting = self.nesting.saturating_sub(1),
                _ => {}
            }
        }
        Ok(())
    }
}

fn capped_events<S>(bytes: S, limit: usize) -> BoxStream<'static, Result<Sse, SseError>>
where
    S: Stream<Item = Result<Bytes, reqwest::Error>> + Send + 'static,
{
    let mut counter = EventSizeLimit::new(limit);
    let mut failed = false;
    let checked = bytes
        .map(move |chunk| {
            let chunk =
                chunk.map_err(|e| McpHttpError::Egress(EgressError::Request(e.without_url())))?;
            counter.feed(&chunk)?;
            Ok::<Bytes, McpHttpError>(chunk)
        })
        // Stop after the first error: the parser must not resume mid-event.
        .take_while(move |item| {
            let keep = !failed;
            failed = failed || item.is_err();
            std::future::ready(keep)
        });
    SseStream::from_bytes_stream(checked).boxed()
}

impl StreamableHttpClient for EgressStreamableHttp {
    type Error = McpHttpError;

    async fn post_message(
        &self,
        uri: Arc<str>,
        message: ClientJsonRpcMessage,
        session_id: Option<Arc<str>>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
    ) -> HttpResult<StreamableHttpPostResponse> {
        self.post_message_with_response_limits(
            uri,
            message,
            session_id,
            auth_header,
            custom_headers,
            StreamableHttpResponseLimits::default(),
        )
        .await
    }

    async fn post_message_with_max_sse_event_size(
        &self,
        uri: Arc<str>,
        message: ClientJsonRpcMessage,
        session_id: Option<Arc<str>>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
        max_sse_event_size: usize,
    ) -> HttpResult<StreamableHttpPostResponse> {
        let mut limits = StreamableHttpResponseLimits::default();
        limits.max_sse_event_size = max_sse_event_size;
        self.post_message_with_response_limits(
            uri,
            message,
            session_id,
            auth_header,
            custom_headers,
            limits,
        )
        .await
    }

    async fn post_message_with_response_limits(
        &self,
        uri: Arc<str>,
        message: ClientJsonRpcMessage,
        session_id: Option<Arc<str>>,
        // Never set: credentials come from the connection, attached in `request`.
        _auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
        limits: StreamableHttpResponseLimits,
    ) -> HttpResult<StreamableHttpPostResponse> {
        let body = serde_json::to_vec(&message)
            .map_err(|e| StreamableHttpError::Client(McpHttpError::Encode(e)))?;
        let had_session = session_id.is_some();
        let response = self
            .send_authorized(
                Method::POST,
                &uri,
                session_id.as_deref(),
                &custom_headers,
                |builder| {
                    builder
                        .header(ACCEPT, format!("{JSON}, {EVENT_STREAM}"))
                        .header(CONTENT_TYPE, JSON)
                        .body(body.clone())
                },
            )
            .await?;
        let status = response.status();
        if status == reqwest::StatusCode::ACCEPTED || status == reqwest::StatusCode::NO_CONTENT {
            return Ok(StreamableHttpPostResponse::Accepted);
        }
        if status == reqwest::StatusCode::NOT_FOUND && had_session {
            return Err(StreamableHttpError::SessionExpired);
        }
        let new_session = response
            .headers()
            .get(SESSION_ID)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let media = media_type(&response);
        let json_limit = limits
            .max_json_response_size
            .min(self.inner.max_message_bytes);
        if !status.is_success() {
            let failure = status_failure(status, response.headers());
            // A JSON-RPC error in an error response is the server's answer, not a transport
            // failure: hand it to rmcp.
            let auth = status == reqwest::StatusCode::UNAUTHORIZED
                || status == reqwest::StatusCode::FORBIDDEN;
            if media.as_deref() == Some(JSON) && !auth {
                let body = read_capped(response, json_limit).await?;
                if let Ok(message @ ServerJsonRpcMessage::Error(_)) =
                    shallow_enough(&body).map_err(|_| ()).and_then(|body| {
                        serde_json::from_slice::<ServerJsonRpcMessage>(body).map_err(|_| ())
                    })
                {
                    return Ok(StreamableHttpPostResponse::Json(message, new_session));
                }
            }
            return Err(failure);
        }
        match media.as_deref() {
            Some(EVENT_STREAM) => {
                let limit = limits.max_sse_event_size.min(self.inner.max_message_bytes);
                Ok(StreamableHttpPostResponse::Sse(
                    capped_events(response.bytes_stream(), limit),
                    new_session,
                ))
            }
            Some(JSON) => {
                let body = read_capped(response, json_limit).await?;
                if body.is_empty() {
                    return Ok(StreamableHttpPostResponse::Accepted);
                }
                let message = serde_json::from_slice(
                    shallow_enough(&body).map_err(StreamableHttpError::Client)?,
                )?;
                Ok(StreamableHttpPostResponse::Json(message, new_session))
            }
            _ if response.content_length() == Some(0) => Ok(StreamableHttpPostResponse::Accepted),
            other => Err(StreamableHttpError::UnexpectedContentType(
                other.map(str::to_owned),
            )),
        }
    }

    async fn delete_session(
        &self,
        uri: Arc<str>,
        session_id: Arc<str>,
        _auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
    ) -> HttpResult<()> {
        let (builder, _) = self
            .request(Method::DELETE, &uri, Some(&session_id), custom_headers)
            .await?;
        let response = self.send(builder).await?;
        if response.status() == reqwest::StatusCode::METHOD_NOT_ALLOWED {
            return Ok(());
        }
        require_success(&response)
    }

    async fn get_stream(
        &self,
        uri: Arc<str>,
        session_id: Option<Arc<str>>,
        last_event_id: Option<String>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
    ) -> HttpResult<BoxStream<'static, Result<Sse, SseError>>> {
        self.get_stream_with_max_sse_event_size(
            uri,
            session_id,
            last_event_id,
            auth_header,
            custom_headers,
            self.inner.max_message_bytes,
        )
        .await
    }

    async fn get_stream_with_max_sse_event_size(
        &self,
        uri: Arc<str>,
        session_id: Option<Arc<str>>,
        last_event_id: Option<String>,
        _auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
        max_sse_event_size: usize,
    ) -> HttpResult<BoxStream<'static, Result<Sse, SseError>>> {
        let response = self
            .send_authorized(
                Method::GET,
                &uri,
                session_id.as_deref(),
                &custom_headers,
                |builder| {
                    let builder = builder.header(ACCEPT, EVENT_STREAM);
                    match &last_event_id {
                        Some(last_event_id) => builder.header(LAST_EVENT_ID, last_event_id),
                        None => builder,
                    }
                },
            )
            .await?;
        if response.status() == reqwest::StatusCode::METHOD_NOT_ALLOWED {
            return Err(StreamableHttpError::ServerDoesNotSupportSse);
        }
        require_success(&response)?;
        match media_type(&response).as_deref() {
            Some(EVENT_STREAM) => Ok(capped_events(
                response.bytes_stream(),
                max_sse_event_size.min(self.inner.max_message_bytes),
            )),
            other => Err(StreamableHttpError::UnexpectedContentType(
                other.map(str::to_owned),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_limit_resets_at_blank_lines_in_every_line_ending() {
        for separator in ["\n\n", "\r\n\r\n", "\r\r"] {
            let mut limit = EventSizeLimit::new(10);
            let text = format!("data: 1234{separator}data: 5678{separator}");
            assert!(limit.feed(text.as_bytes()).is_ok(), "{separator:?}");
        }
    }

    #[test]
    fn event_limit_counts_across_lines_and_chunks() {
        let mut limit = EventSizeLimit::new(20);
        assert!(limit.feed(b"data: 12345\r").is_ok());
        assert!(limit.feed(b"\ndata: 67").is_ok());
        // 11 + 8 + 2 bytes in one event (a single line break does not end it): over.
        assert!(matches!(limit.feed(b"89"), Err(McpHttpError::TooLarge(20))));
    }

    #[test]
    fn events_nested_too_deeply_are_refused_across_chunks_and_strings_do_not_count() {
        let mut limit = EventSizeLimit::new(1 << 20);
        let at_limit = format!(
            "data: {}1{}\n\n",
            "[".repeat(MAX_MESSAGE_NESTING),
            "]".repeat(MAX_MESSAGE_NESTING)
        );
        // Twice: the count starts again with each event.
        assert!(limit.feed(at_limit.as_bytes()).is_ok());
        assert!(limit.feed(at_limit.as_bytes()).is_ok());
        let strings = format!("data: {{\"a\": \"\\\"{}\"}}\n\n", "[".repeat(1000));
        assert!(limit.feed(strings.as_bytes()).is_ok(), "{strings}");
        assert!(limit.feed(b"data: ").is_ok());
        assert!(
            limit
                .feed("[".repeat(MAX_MESSAGE_NESTING).as_bytes())
                .is_ok()
        );
        assert!(matches!(
            limit.feed(b"[1]"),
            Err(McpHttpError::TooDeep(MAX_MESSAGE_NESTING))
        ));
        assert!(shallow_enough(at_limit.as_bytes()).is_ok());
        assert!(shallow_enough(format!("[{at_limit}]").as_bytes()).is_err());
    }
}
