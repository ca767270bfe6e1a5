//! The HTTP side shared by the HTTP providers: endpoint settings, retries with backoff, the
//! per-attempt deadline, the response size cap and error summaries.
//!
//! Every request goes through [`EgressClient::streaming_request`], so the guard vets the URL
//! and pins the addresses; this module only adds what a model call needs on top. Retries happen
//! only before any byte of a successful body has been read, so a retry never repeats text that
//! a [`crate::StreamSink`] has already shown.

use std::time::Duration;

use secrecy::{ExposeSecret, SecretString};
use tokio::time::Instant;
use wor_egress::header::{self, HeaderMap, HeaderValue};
use wor_egress::{EgressClient, EgressError, GuardedLookupError, HostAllowlist, Method};
use wor_secrets::Redactor;

use crate::error::ModelError;

/// Where an HTTP provider lives and how it authenticates.
///
/// `Debug` shows the key as `[REDACTED]`; the key is only exposed to build the auth header of
/// each request at the moment it is sent.
#[derive(Debug)]
pub struct ProviderEndpoint {
    /// The API base URL, for example `https://api.openai.com/v1` or `https://api.anthropic.com`.
    pub base_url: String,
    /// The API key; `None` for local servers that take none (Ollama, llama.cpp).
    pub api_key: Option<SecretString>,
    /// The model connection's host allowlist; `None` allows any host the egress policy allows.
    pub allowlist: Option<HostAllowlist>,
}

impl ProviderEndpoint {
    /// An endpoint at `base_url` with `api_key` and no allowlist.
    pub fn new(base_url: impl Into<String>, api_key: Option<SecretString>) -> Self {
        Self {
            base_url: base_url.into(),
            api_key,
            allowlist: None,
        }
    }

    /// `path` appended to the base URL, with exactly one `/` between them.
    pub(crate) fn url(&self, path: &str) -> String {
        format!("{}/{}", self.base_url.trim_end_matches('/'), path)
    }
}

/// When and how often a failed request is tried again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Requests sent at most, the first included (at least 1).
    pub max_attempts: u32,
    /// Wait before the first retry when the provider gives no `Retry-After`; doubles each retry.
    pub initial_backoff: Duration,
    /// Upper bound of the doubling backoff.
    pub max_backoff: Duration,
    /// A `Retry-After` longer than this is not waited for: the call fails with the status and
    /// the requested delay, for the engine to reschedule.
    pub max_retry_after: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 4,
            initial_backoff: Duration::from_millis(500),
            max_backoff: Duration::from_secs(20),
            max_retry_after: Duration::from_secs(60),
        }
    }
}

impl RetryPolicy {
    /// One attempt, no retries.
    pub fn no_retries() -> Self {
        Self {
            max_attempts: 1,
            ..Self::default()
        }
    }

    /// The wait before retry number `retry` (1 for the first retry) without a `Retry-After`:
    /// the doubling backoff, capped, with jitter in its upper half so that workers that failed
    /// together do not retry together.
    pub fn backoff(&self, retry: u32) -> Duration {
        let exponent = retry.saturating_sub(1).min(30);
        let full = self
            .initial_backoff
            .saturating_mul(1u32 << exponent)
            .min(self.max_backoff);
        let half = full / 2;
        let jitter_ms = u64::try_from(half.as_millis()).unwrap_or(u64::MAX);
        half + Duration::from_millis(rand::random_range(0..=jitter_ms))
    }
}

/// How an HTTP provider talks to its endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProviderOptions {
    /// Ask for a streamed response (server-sent events) so text can be shown as it arrives.
    pub streaming: bool,
    /// Retries on 429, 5xx and failed connections.
    pub retry: RetryPolicy,
    /// Total time for one attempt, from sending to the end of the body; `None` uses the egress
    /// client's total timeout.
    pub attempt_timeout: Option<Duration>,
}

impl Default for ProviderOptions {
    fn default() -> Self {
        Self {
            streaming: true,
            retry: RetryPolicy::default(),
            attempt_timeout: None,
        }
    }
}

/// Largest part of an error body read to summarise it.
const ERROR_BODY_LIMIT: usize = 16 * 1024;
/// Longest provider error summary kept, in characters.
const SUMMARY_CHARS: usize = 200;

/// A successful (2xx) response whose body has not been read yet.
#[derive(Debug)]
pub(crate) struct OpenResponse {
    response: reqwest::Response,
    deadline: Instant,
    timeout: Duration,
    limit: u64,
    read: u64,
}

impl OpenResponse {
    /// Hands each body chunk to `on_chunk` until the body ends, within the deadline and cap.
    pub async fn read_chunks(
        mut self,
        mut on_chunk: impl FnMut(&[u8]) -> Result<(), ModelError>,
    ) -> Result<(), ModelError> {
        loop {
            let chunk = tokio::time::timeout_at(self.deadline, self.response.chunk())
                .await
                .map_err(|_| ModelError::Timeout(self.timeout))?
                .map_err(|e| from_reqwest(e, self.timeout))?;
            let Some(chunk) = chunk else {
                return Ok(());
            };
            self.read = self
                .read
                .saturating_add(u64::try_from(chunk.len()).unwrap_or(u64::MAX));
            if self.read > self.limit {
                return Err(ModelError::ResponseTooLarge { limit: self.limit });
            }
            on_chunk(&chunk)?;
        }
    }

    /// The whole body.
    pub async fn read_all(self) -> Result<Vec<u8>, ModelError> {
        let mut body = Vec::new();
        self.read_chunks(|chunk| {
            body.extend_from_slice(chunk);
            Ok(())
        })
        .await?;
        Ok(body)
    }
}

/// Sends `body` as a JSON `POST` to `url`, retrying per `options.retry`, and returns the first
/// successful response unread. `auth` is the provider's credential header, built from
/// `endpoint.api_key` by the caller just before this call.
pub(crate) async fn post_json(
    egress: &EgressClient,
    endpoint: &ProviderEndpoint,
    options: &ProviderOptions,
    url: &str,
    headers: HeaderMap,
    body: Vec<u8>,
) -> Result<OpenResponse, ModelError> {
    let timeout = options
        .attempt_timeout
        .unwrap_or(egress.limits().total_timeout);
    let limit = egress.limits().max_response_bytes;
    let max_attempts = options.retry.max_attempts.max(1);
    let mut attempt = 0u32;
    loop {
        attempt += 1;
        let deadline = Instant::now() + timeout;
        let sent = tokio::time::timeout_at(deadline, async {
            let builder = egress
                .streaming_request(Method::POST, url, endpoint.allowlist.as_ref())
                .await
                .map_err(ModelError::from)?;
            builder
                .headers(headers.clone())
                .body(body.clone())
                .send()
                .await
                .map_err(|e| from_reqwest(e, timeout))
        })
        .await
        .map_err(|_| ModelError::Timeout(timeout))?;
        let retries_left = attempt < max_attempts;
        let response = match sent {
            Ok(response) => response,
            // A failed connection or exchange; refusals and timeouts are not retried.
            Err(ModelError::Transport(_)) if retries_left => {
                tokio::time::sleep(options.retry.backoff(attempt)).await;
                continue;
            }
            Err(error) => return Err(error),
        };
        let status = response.status();
        if status.is_success() {
            return Ok(OpenResponse {
                response,
                deadline,
                timeout,
                limit,
                read: 0,
            });
        }
        let header_wait = retry_after(response.headers());
        let body = error_body(response, deadline).await;
        // Google's APIs give the wait in the body (`google.rpc.RetryInfo`) instead.
        let retry_after = header_wait.or_else(|| retry_delay_in_body(&body));
        let retryable = status.as_u16() == 429 || status.is_server_error();
        let within_patience = retry_after.is_none_or(|wait| wait <= options.retry.max_retry_after);
        if retryable && retries_left && within_patience {
            let wait = retry_after.unwrap_or_else(|| options.retry.backoff(attempt));
            tokio::time::sleep(wait).await;
            continue;
        }
        return Err(ModelError::HttpStatus {
            status: status.as_u16(),
            retry_after,
            attempts: attempt,
            summary: error_summary(&body, endpoint),
        });
    }
}

/// The first part of an error body (at most [`ERROR_BODY_LIMIT`] bytes, within the deadline).
async fn error_body(mut response: reqwest::Response, deadline: Instant) -> Vec<u8> {
    let mut body = Vec::new();
    while body.len() < ERROR_BODY_LIMIT {
        match tokio::time::timeout_at(deadline, response.chunk()).await {
            Ok(Ok(Some(chunk))) => body.extend_from_slice(&chunk),
            _ => break,
        }
    }
    body
}

/// The `retryDelay` of a `google.rpc.RetryInfo` in an error body (`"37s"`, `"1.5s"`).
fn retry_delay_in_body(body: &[u8]) -> Option<Duration> {
    let json: serde_json::Value = serde_json::from_slice(body).ok()?;
    let details = json.pointer("/error/details")?.as_array()?;
    details.iter().find_map(|detail| {
        let delay = detail.get("retryDelay")?.as_str()?;
        let seconds: f64 = delay.strip_suffix('s')?.parse().ok()?;
        if !seconds.is_finite() || seconds < 0.0 {
            return None;
        }
        Duration::try_from_secs_f64(seconds).ok()
    })
}

/// The `Retry-After` header in seconds (integer or decimal). The HTTP-date form is ignored
/// and the backoff used instead.
fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let value = headers.get(header::RETRY_AFTER)?.to_str().ok()?.trim();
    let seconds: f64 = value.parse().ok()?;
    if !seconds.is_finite() || seconds < 0.0 {
        return None;
    }
    Duration::try_from_secs_f64(seconds).ok()
}

/// A short, redacted summary of an error body: the provider's `error.message` when the body is
/// the usual JSON error object, otherwise the first line of the text.
fn error_summary(body: &[u8], endpoint: &ProviderEndpoint) -> String {
    let text = String::from_utf8_lossy(body);
    let message = match serde_json::from_str::<serde_json::Value>(&text) {
        Ok(json) => json
            .pointer("/error/message")
            .or_else(|| json.get("error"))
            .or_else(|| json.get("message"))
            .or_else(|| json.get("detail"))
            .and_then(serde_json::Value::as_str)
            .unwrap_or_default()
            .to_owned(),
        Err(_) => text.lines().next().unwrap_or_default().to_owned(),
    };
    // Redacted whole, then cut: a key cut short would no longer be recognised.
    redact_key(message.trim(), endpoint)
        .chars()
        .take(SUMMARY_CHARS)
        .collect()
}

/// `text` with the endpoint's key (in any encoding the redactor knows) and secret shapes removed.
pub(crate) fn redact_key(text: &str, endpoint: &ProviderEndpoint) -> String {
    let keys = endpoint.api_key.iter().map(|key| key.expose_secret());
    match Redactor::new(keys) {
        Ok(redactor) => redactor.redact(text).into_owned(),
        Err(_) => String::from("(provider message withheld)"),
    }
}

/// `value` as a header value marked sensitive, so HTTP-layer `Debug` output hides it too.
pub(crate) fn secret_header(value: &str) -> Result<HeaderValue, ModelError> {
    let mut header = HeaderValue::from_str(value).map_err(|_| ModelError::InvalidApiKey)?;
    header.set_sensitive(true);
    Ok(header)
}

/// The JSON content headers every provider request carries.
pub(crate) fn json_headers(streaming: bool) -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    headers.insert(
        header::ACCEPT,
        HeaderValue::from_static(if streaming {
            "text/event-stream"
        } else {
            "application/json"
        }),
    );
    headers
}

/// Maps a reqwest error, recovering a guard refusal raised inside the guarded resolver.
fn from_reqwest(error: reqwest::Error, timeout: Duration) -> ModelError {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&error);
    while let Some(current) = source {
        if let Some(GuardedLookupError::Denied(denial)) = current.downcast_ref() {
            return ModelError::EgressDenied(Box::new(denial.clone()));
        }
        source = current.source();
    }
    if error.is_timeout() {
        return ModelError::Timeout(timeout);
    }
    ModelError::Transport(EgressError::Request(error.without_url()))
}

/// How a provider turns its streamed events into one response.
pub(crate) trait StreamAssembler: Default {
    /// Takes one server-sent event, passing text deltas on to `sink`.
    fn event(
        &mut self,
        event: &crate::sse::SseEvent,
        sink: &mut dyn crate::StreamSink,
    ) -> Result<(), ModelError>;
    /// The response, once the stream has ended as the provider ends it.
    fn finish(self) -> Result<wor_core::model::ModelResponse, ModelError>;
    /// What the stream reported as used before it broke off.
    fn usage_so_far(&self) -> wor_core::model::Usage;
}

/// Reads a provider's answer: the whole body parsed by `whole` when not streaming, or the
/// stream assembled by `S`. A connection lost mid-stream is a truncated stream carrying the
/// usage reported so far; the provider's own error words are redacted of the key.
pub(crate) async fn read_answer<S: StreamAssembler>(
    response: OpenResponse,
    streaming: bool,
    endpoint: &ProviderEndpoint,
    sink: &mut dyn crate::StreamSink,
    whole: impl FnOnce(&[u8]) -> Result<wor_core::model::ModelResponse, ModelError>,
) -> Result<wor_core::model::ModelResponse, ModelError> {
    if !streaming {
        let body = response.read_all().await?;
        let answer = whole(&body)?;
        if !answer.message.text.is_empty() {
            sink.text_delta(&answer.message.text);
        }
        return Ok(answer);
    }
    let mut decoder = crate::sse::SseDecoder::default();
    let mut stream = S::default();
    let mut events = Vec::new();
    let read = response
        .read_chunks(|chunk| {
            decoder.feed(chunk, &mut events)?;
            for event in events.drain(..) {
                stream.event(&event, sink)?;
            }
            Ok(())
        })
        .await;
    match read {
        Ok(()) => stream.finish(),
        Err(ModelError::Transport(_)) => Err(ModelError::TruncatedStream {
            usage_so_far: stream.usage_so_far(),
        }),
        // Redacted whole, then cut: a key cut short would no longer be recognised.
        Err(ModelError::StreamError(message)) => Err(ModelError::StreamError(
            redact_key(message.trim(), endpoint)
                .chars()
                .take(SUMMARY_CHARS)
                .collect(),
        )),
        Err(other) => Err(other),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_within_bounds() {
        let policy = RetryPolicy {
            max_attempts: 10,
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_millis(1000),
            max_retry_after: Duration::from_secs(1),
        };
        for _ in 0..50 {
            let first = policy.backoff(1);
            assert!((Duration::from_millis(50)..=Duration::from_millis(100)).contains(&first));
            let third = policy.backoff(3);
            assert!((Duration::from_millis(200)..=Duration::from_millis(400)).contains(&third));
            let capped = policy.backoff(40);
            assert!((Duration::from_millis(500)..=Duration::from_millis(1000)).contains(&capped));
        }
    }

    #[test]
    fn retry_after_takes_seconds_only() {
        let mut headers = HeaderMap::new();
        assert_eq!(retry_after(&headers), None);
        headers.insert(header::RETRY_AFTER, HeaderValue::from_static("2"));
        assert_eq!(retry_after(&headers), Some(Duration::from_secs(2)));
        headers.insert(header::RETRY_AFTER, HeaderValue::from_static("0.25"));
        assert_eq!(retry_after(&headers), Some(Duration::from_millis(250)));
        for ignored in ["Wed, 21 Oct 2015 07:28:00 GMT", "-1", "NaN", "inf"] {
            headers.insert(header::RETRY_AFTER, HeaderValue::from_static(ignored));
            assert_eq!(retry_after(&headers), None, "{ignored}");
        }
    }

    #[test]
    fn a_retry_delay_in_a_google_error_body_counts() {
        let body = br#"{"error":{"code":429,"message":"quota","status":"RESOURCE_EXHAUSTED",
            "details":[{"@type":"type.googleapis.com/google.rpc.QuotaFailure"},
                {"@type":"type.googleapis.com/google.rpc.RetryInfo","retryDelay":"1.5s"}]}}"#;
        assert_eq!(retry_delay_in_body(body), Some(Duration::from_millis(1500)));
        for none in [
            &b"{}"[..],
            b"not json",
            br#"{"error":{"details":[{"retryDelay":"soon"}]}}"#,
        ] {
            assert_eq!(retry_delay_in_body(none), None);
        }
    }

    #[test]
    fn urls_join_with_one_slash() {
        for base in ["http://h/v1", "http://h/v1/"] {
            assert_eq!(
                ProviderEndpoint::new(base, None).url("chat/completions"),
                "http://h/v1/chat/completions"
            );
        }
    }

    #[test]
    fn a_key_the_provider_echoes_where_the_summary_is_cut_is_redacted_whole() {
        let key = "sk-live-0123456789abcdefghij";
        let endpoint =
            ProviderEndpoint::new("http://h/v1", Some(SecretString::from(key.to_owned())));
        // The key straddles the summary's cut: cut first, its start would go out unrecognised.
        let message = format!(
            "{} {key} is not a valid key",
            "x".repeat(SUMMARY_CHARS - 15)
        );
        let body = serde_json::json!({"error": {"message": message}}).to_string();
        let summary = error_summary(body.as_bytes(), &endpoint);
        assert!(!summary.contains("sk-live-01"), "{summary}");
        assert!(summary.starts_with("xxxx"), "{summary}");
        assert_eq!(summary.chars().count(), SUMMARY_CHARS);
    }

    #[test]
    fn a_key_that_cannot_be_a_header_is_refused_without_showing_it() {
        let err = secret_header("sk-line\nbreak").unwrap_err();
        assert!(matches!(err, ModelError::InvalidApiKey));
        assert!(!err.to_string().contains("sk-line"));
        assert!(secret_header("Bearer ok").unwrap().is_sensitive());
    }
}
