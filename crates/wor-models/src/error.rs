//! [`ModelError`]: everything that can go wrong asking a model for a turn.
//!
//! Messages never contain an API key, a request body or a prompt: they name the failure, the
//! HTTP status, and at most a short, redacted summary of the provider's own error message.

use std::time::Duration;

use wor_core::model::Usage;
use wor_egress::{EgressDenial, EgressError};

/// A model call failed.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The egress guard refused the provider's URL or address.
    #[error("egress refused the model endpoint: {0}")]
    EgressDenied(Box<EgressDenial>),
    /// The request could not be sent or the connection failed (after any retries).
    #[error("model request failed: {0}")]
    Transport(#[source] EgressError),
    /// No complete response within the total timeout.
    #[error("no complete model response within {0:?}")]
    Timeout(Duration),
    /// The provider answered with an error status (after any retries).
    #[error("model provider answered http {status} after {attempts} attempt(s){}{}",
        retry_after.map(|d| format!(" (retry after {d:?})")).unwrap_or_default(),
        if summary.is_empty() { String::new() } else { format!(": {summary}") })]
    HttpStatus {
        /// The HTTP status code.
        status: u16,
        /// What the provider's `Retry-After` header asked for, if anything.
        retry_after: Option<Duration>,
        /// How many requests were sent.
        attempts: u32,
        /// The provider's error message, shortened and redacted; may be empty.
        summary: String,
    },
    /// The response was not what the provider's API promises.
    #[error("malformed model response: {0}")]
    MalformedResponse(String),
    /// The response stream ended before the provider marked it complete.
    #[error("model response stream ended before it was complete")]
    TruncatedStream {
        /// Tokens the provider reported before the stream broke (they were consumed).
        usage_so_far: Usage,
    },
    /// The provider reported an error inside an otherwise successful stream.
    #[error("model provider reported an error mid-stream: {0}")]
    StreamError(String),
    /// The response body exceeded the size cap.
    #[error("model response exceeds the limit of {limit} bytes")]
    ResponseTooLarge {
        /// The cap.
        limit: u64,
    },
    /// The API key cannot be sent as an HTTP header (the key itself is never shown).
    #[error("the api key is not a valid http header value")]
    InvalidApiKey,
    /// The request cannot be expressed in the provider's format.
    #[error("invalid model request: {0}")]
    InvalidRequest(String),
    /// A replay script could not be read or parsed.
    #[error("invalid replay script: {0}")]
    InvalidScript(String),
    /// A replay script has no turn left that matches the request.
    #[error(
        "replay script exhausted: no turn left for this request ({played} of {total} turns played)"
    )]
    ScriptExhausted {
        /// Turns played so far.
        played: usize,
        /// Turns in the script.
        total: usize,
    },
}

impl ModelError {
    /// Tokens the failed call is known to have consumed, for the run's budget.
    pub fn usage_consumed(&self) -> Usage {
        match self {
            Self::TruncatedStream { usage_so_far } => *usage_so_far,
            _ => Usage::default(),
        }
    }

    /// How long the provider asked to wait before trying again, if it did.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Self::HttpStatus { retry_after, .. } => *retry_after,
            _ => None,
        }
    }

    pub(crate) fn malformed(what: impl Into<String>) -> Self {
        Self::MalformedResponse(what.into())
    }
}

impl From<EgressError> for ModelError {
    fn from(error: EgressError) -> Self {
        match error {
            EgressError::Denied(denial) => Self::EgressDenied(denial),
            EgressError::Timeout(limit) => Self::Timeout(limit),
            EgressError::ResponseTooLarge { limit } => Self::ResponseTooLarge { limit },
            other => Self::Transport(other),
        }
    }
}
