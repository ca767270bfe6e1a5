//! Model providers of Work on Repeat: the OpenAI-compatible chat-completions client (also for
//! Azure OpenAI deployments), the Anthropic Messages client, the Gemini `generateContent` client
//! and the scripted `replay` model, behind one [`ModelProvider`] trait.
//!
//! Each provider turns a provider-neutral [`ModelRequest`] into its wire format and the answer
//! back into a [`ModelResponse`], streaming text deltas to a [`StreamSink`] for live display
//! while always returning the assembled turn. The HTTP providers are thin code over the one
//! [`wor_egress::EgressClient`]: no other HTTP client, no provider SDK. They retry 429 and 5xx
//! answers with exponential backoff that honours `Retry-After` ([`RetryPolicy`]).
//!
//! What this crate must never do: put an API key anywhere but the auth header of the request
//! being sent (not in errors, `Debug` output or logs), decide anything about tool calls (a
//! [`ToolCallRequest`](wor_core::model::ToolCallRequest) here is only a proposal), or panic on
//! a malformed response (that is a [`ModelError`]).
//!
//! Code map: [`openai`], [`azure`], [`anthropic`] and [`gemini`] are the HTTP providers; [`replay`] the scripted model
//! (format in its docs and in `docs/replay.md`); [`transport`] the shared retries, deadlines and
//! error summaries; `sse` the event-stream decoder; [`error`] the [`ModelError`] enum.

pub mod anthropic;
pub mod azure;
pub mod error;
pub mod gemini;
pub mod openai;
pub mod replay;
mod sse;
pub mod transport;

use std::future::Future;
use std::pin::Pin;

use wor_core::model::{ModelRequest, ModelResponse, ProviderKind};

pub use anthropic::{ANTHROPIC_VERSION, AnthropicProvider};
pub use azure::AzureOpenAiProvider;
pub use error::ModelError;
pub use gemini::GeminiProvider;
pub use openai::OpenAiCompatibleProvider;
pub use replay::{ReplayProvider, ReplayScript};
pub use transport::{ProviderEndpoint, ProviderOptions, RetryPolicy};

/// The future a [`ModelProvider`] returns (boxed, so providers can sit behind `dyn`).
pub type ModelFuture<'a> =
    Pin<Box<dyn Future<Output = Result<ModelResponse, ModelError>> + Send + 'a>>;

/// A model: given a conversation, produces the next assistant turn.
pub trait ModelProvider: Send + Sync + std::fmt::Debug {
    /// Which kind of provider this is.
    fn kind(&self) -> ProviderKind;

    /// Asks for one turn. Text is passed to `sink` as it arrives (all at once when the provider
    /// does not stream); the assembled turn is returned either way.
    fn complete<'a>(
        &'a self,
        request: &'a ModelRequest,
        sink: &'a mut dyn StreamSink,
    ) -> ModelFuture<'a>;
}

/// Receives a turn while it is being written, for live display. Never used for decisions: the
/// returned [`ModelResponse`] is the turn.
pub trait StreamSink: Send {
    /// A piece of assistant text, in order.
    fn text_delta(&mut self, delta: &str);

    /// The model began a tool call named `name` (its arguments are still arriving).
    fn tool_call_started(&mut self, name: &str) {
        let _ = name;
    }
}

/// A [`StreamSink`] that drops everything.
#[derive(Debug, Clone, Copy, Default)]
pub struct DiscardStream;

impl StreamSink for DiscardStream {
    fn text_delta(&mut self, _delta: &str) {}
}

/// A [`StreamSink`] that keeps every delta, in order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CollectedStream {
    /// Text deltas as they arrived.
    pub text_deltas: Vec<String>,
    /// Names of tool calls as they started.
    pub tool_calls_started: Vec<String>,
}

impl CollectedStream {
    /// The text deltas joined.
    pub fn text(&self) -> String {
        self.text_deltas.concat()
    }
}

impl StreamSink for CollectedStream {
    fn text_delta(&mut self, delta: &str) {
        self.text_deltas.push(delta.to_owned());
    }

    fn tool_call_started(&mut self, name: &str) {
        self.tool_calls_started.push(name.to_owned());
    }
}

/// Parses tool-call arguments the model wrote as JSON text; empty text means no arguments.
/// The error names the tool but never echoes the arguments.
pub(crate) fn parse_tool_arguments(
    name: &str,
    arguments: &str,
) -> Result<serde_json::Value, ModelError> {
    if arguments.trim().is_empty() {
        return Ok(serde_json::Value::Object(serde_json::Map::new()));
    }
    serde_json::from_str(arguments).map_err(|e| {
        ModelError::malformed(format!(
            "arguments of tool call `{}` are not valid json ({})",
            shorten(name),
            describe_json_error(&e)
        ))
    })
}

/// A serde_json error described without echoing any value from the input (values may be model
/// output or prompt text): its category and position, or the missing field's name.
pub(crate) fn describe_json_error(error: &serde_json::Error) -> String {
    use serde_json::error::Category;
    let position = format!("line {} column {}", error.line(), error.column());
    match error.classify() {
        Category::Eof => format!("unexpected end at {position}"),
        Category::Syntax | Category::Io => format!("invalid json at {position}"),
        Category::Data => {
            let message = error.to_string();
            match message.split(" at line ").next() {
                Some(missing) if missing.starts_with("missing field") => {
                    format!("{missing} at {position}")
                }
                _ => format!("unexpected value at {position}"),
            }
        }
    }
}

/// Parses a provider's JSON document into `T`, with a described error.
pub(crate) fn parse_json<T: serde::de::DeserializeOwned>(
    what: &str,
    text: &[u8],
) -> Result<T, ModelError> {
    serde_json::from_slice(text)
        .map_err(|e| ModelError::malformed(format!("{what}: {}", describe_json_error(&e))))
}

/// A provider-supplied name as an error message quotes it: whole up to 64 characters, else
/// only its first few ([`wor_core::quote::excerpt`]), never cut in between, where the part of
/// a key it might be would be recognised by no redactor.
pub(crate) fn shorten(name: &str) -> String {
    wor_core::quote::excerpt(name, 64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_errors_do_not_echo_values() {
        let err = parse_json::<Vec<u64>>("body", br#"["sk-secret-value"]"#).unwrap_err();
        let text = err.to_string();
        assert!(!text.contains("sk-secret-value"), "{text}");
        assert!(text.contains("unexpected value at line 1"), "{text}");

        #[derive(Debug, serde::Deserialize)]
        #[expect(dead_code, reason = "only the missing field matters")]
        struct Needs {
            choices: Vec<u8>,
        }
        let err = parse_json::<Needs>("body", b"{}").unwrap_err();
        assert!(err.to_string().contains("missing field `choices`"), "{err}");
        let err = parse_json::<Needs>("body", b"{\"choi").unwrap_err();
        assert!(err.to_string().contains("unexpected end"), "{err}");
    }

    #[test]
    fn tool_arguments_parse_or_fail_without_echo() {
        assert_eq!(
            parse_tool_arguments("t", " ").unwrap(),
            serde_json::json!({})
        );
        assert_eq!(
            parse_tool_arguments("t", r#"{"a":1}"#).unwrap(),
            serde_json::json!({"a": 1})
        );
        let err = parse_tool_arguments("lookup", r#"{"q": "private text"#).unwrap_err();
        assert!(err.to_string().contains("tool call `lookup`"), "{err}");
        assert!(!err.to_string().contains("private text"), "{err}");
    }
}
