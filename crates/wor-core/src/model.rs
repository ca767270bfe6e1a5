//! The provider-neutral model conversation: what a routine sends to a model and what comes back.
//!
//! Providers (`wor-models`) translate these types to and from their wire formats; the engine
//! builds requests from them and records responses. Nothing here knows about HTTP or any one
//! provider, and nothing here does I/O.
//!
//! Provenance (trusted, requester, untrusted) is not a field of [`ChatMessage`]: by the time text
//! becomes a message, untrusted content has already been wrapped in its delimited envelope.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::ids::ConnectionId;

/// Who wrote a [`ChatMessage`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ChatRole {
    /// Instructions from the routine.
    System,
    /// Input from the caller or the engine.
    User,
    /// The model's own turn.
    Assistant,
    /// The result of a tool call, answering an assistant's [`ToolCallRequest`].
    Tool,
}

/// One message of a conversation, tagged by `role` when serialised.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "role", rename_all = "snake_case")]
pub enum ChatMessage {
    /// Instructions from the routine.
    System {
        /// The instruction text.
        content: String,
    },
    /// Input from the caller or the engine.
    User {
        /// The input text.
        content: String,
    },
    /// A turn of the model: text, tool calls, or both.
    Assistant(AssistantMessage),
    /// The result of one tool call.
    Tool(ToolResult),
}

impl ChatMessage {
    /// A system message.
    pub fn system(content: impl Into<String>) -> Self {
        Self::System {
            content: content.into(),
        }
    }

    /// A user message.
    pub fn user(content: impl Into<String>) -> Self {
        Self::User {
            content: content.into(),
        }
    }

    /// The role of this message.
    pub fn role(&self) -> ChatRole {
        match self {
            Self::System { .. } => ChatRole::System,
            Self::User { .. } => ChatRole::User,
            Self::Assistant(_) => ChatRole::Assistant,
            Self::Tool(_) => ChatRole::Tool,
        }
    }

    /// The message's text: the content, the assistant's text, or the tool result.
    pub fn text(&self) -> &str {
        match self {
            Self::System { content } | Self::User { content } => content,
            Self::Assistant(message) => &message.text,
            Self::Tool(result) => &result.content,
        }
    }
}

/// What the model said in one turn: text (possibly empty) and the tool calls it asked for.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct AssistantMessage {
    /// The text of the turn; empty when the model only called tools.
    #[serde(default)]
    pub text: String,
    /// Tool calls in the order the model made them (several when it called tools in parallel).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCallRequest>,
}

/// A tool call the model proposed. Nothing runs until the engine's pipeline decides.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCallRequest {
    /// The provider's id for this call; the matching [`ToolResult::tool_call_id`].
    pub id: String,
    /// The tool's name, as the model wrote it (not yet checked against the roster).
    pub name: String,
    /// The arguments, parsed as JSON (not yet validated against any schema).
    pub arguments: serde_json::Value,
    /// Opaque state the provider asks to have sent back with this call in later requests
    /// (Gemini's thought signature); `None` for every other provider.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thought_signature: Option<String>,
}

/// The result of one tool call, given back to the model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolResult {
    /// The [`ToolCallRequest::id`] this answers.
    pub tool_call_id: String,
    /// The result text (already capped, redacted and enveloped by the engine).
    pub content: String,
    /// Whether the call failed or was refused; the content then says why.
    #[serde(default)]
    pub is_error: bool,
}

/// A tool as the model is shown it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolSpec {
    /// The name the model calls it by.
    pub name: String,
    /// What it does, for the model.
    pub description: String,
    /// The JSON Schema of its arguments (with pinned arguments already removed).
    pub input_schema: serde_json::Value,
}

/// One request for a model turn.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelRequest {
    /// The provider's model id (for example `gpt-4.1-mini` or `claude-sonnet-4-5`).
    pub model: String,
    /// The conversation so far, oldest first.
    pub messages: Vec<ChatMessage>,
    /// The tools the model may call; empty for none.
    #[serde(default)]
    pub tools: Vec<ToolSpec>,
    /// The most tokens the model may write in this turn.
    pub max_output_tokens: u32,
    /// Sampling temperature; `None` leaves the provider's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    /// The JSON Schema the final answer must match (the routine's `[output] schema`), for
    /// providers that can constrain their output to it; the engine checks the answer anyway.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_schema: Option<serde_json::Value>,
}

/// Why the model stopped writing.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// It finished its turn.
    EndTurn,
    /// It wants tool results before going on.
    ToolUse,
    /// It reached [`ModelRequest::max_output_tokens`].
    MaxTokens,
    /// Anything else, as the provider named it (`content_filter`, `refusal`, `stop_sequence`…).
    #[serde(untagged)]
    Other(String),
}

/// Tokens a model call consumed, for budgets and cost.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Usage {
    /// Tokens read (prompt, including any cached prompt tokens).
    pub input_tokens: u64,
    /// Tokens written.
    pub output_tokens: u64,
}

impl Usage {
    /// The sum of two usages, saturating.
    #[must_use]
    pub fn saturating_add(self, other: Usage) -> Usage {
        Usage {
            input_tokens: self.input_tokens.saturating_add(other.input_tokens),
            output_tokens: self.output_tokens.saturating_add(other.output_tokens),
        }
    }
}

/// One complete model turn.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelResponse {
    /// What the model said.
    pub message: AssistantMessage,
    /// Why it stopped.
    pub stop_reason: StopReason,
    /// What it cost in tokens.
    pub usage: Usage,
}

/// Which wire protocol a model is reached by: the `provider` of a routine's model identity and
/// of a model connection (stored as the snake-case name, `openai_compatible` …).
///
/// Every kind but [`ProviderKind::Replay`] is reached through a model connection holding its
/// base URL and key; a connection never has kind `replay`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProviderKind {
    /// Any OpenAI-compatible chat-completions endpoint (OpenAI, vLLM, Ollama, llama.cpp
    /// server, LiteLLM, gateways), with a bearer key or, for local servers, none.
    OpenaiCompatible,
    /// The Anthropic Messages API.
    Anthropic,
    /// Azure OpenAI: chat completions at a deployment URL, an `api-key` header and an
    /// `api-version` query parameter.
    AzureOpenai,
    /// Google's Gemini API (`generateContent`).
    Gemini,
    /// The built-in scripted model, for demos and tests; production refuses it.
    Replay,
}

/// Whether `text` is the shape of an Azure OpenAI `api-version`: a date, `YYYY-MM-DD`,
/// optionally followed by `-preview`, or one of the words `preview` and `latest`. Nothing
/// else is taken, so a base URL's query cannot carry a key in the version's place.
pub fn is_azure_api_version(text: &str) -> bool {
    if matches!(text, "preview" | "latest") {
        return true;
    }
    let date = text.strip_suffix("-preview").unwrap_or(text);
    let bytes = date.as_bytes();
    bytes.len() == 10
        && bytes.iter().enumerate().all(|(index, byte)| match index {
            4 | 7 => *byte == b'-',
            _ => byte.is_ascii_digit(),
        })
}

impl ProviderKind {
    /// Every kind, in declaration order.
    pub const ALL: [ProviderKind; 5] = [
        Self::OpenaiCompatible,
        Self::Anthropic,
        Self::AzureOpenai,
        Self::Gemini,
        Self::Replay,
    ];

    /// The name used in configuration and records.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::OpenaiCompatible => "openai_compatible",
            Self::Anthropic => "anthropic",
            Self::AzureOpenai => "azure_openai",
            Self::Gemini => "gemini",
            Self::Replay => "replay",
        }
    }

    /// Whether a model of this kind is reached through a model connection (URL and API key).
    pub fn needs_connection(self) -> bool {
        !matches!(self, Self::Replay)
    }
}

impl fmt::Display for ProviderKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A string that names no provider kind.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "`{0}` is not a model provider: expected `openai_compatible`, `anthropic`, `azure_openai`, `gemini` or `replay`"
)]
pub struct ProviderKindParseError(String);

impl FromStr for ProviderKind {
    type Err = ProviderKindParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|kind| kind.as_str() == s)
            .ok_or_else(|| ProviderKindParseError(crate::quote::excerpt(s, 80)))
    }
}

/// Which model a routine talks to: `(provider, connection_id | null, model_id)`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ModelIdentity {
    /// The kind of provider.
    pub provider: ProviderKind,
    /// The model connection holding URL and key; `None` for [`ProviderKind::Replay`].
    pub connection_id: Option<ConnectionId>,
    /// The provider's model id (for replay, the script's name).
    pub model_id: String,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn an_azure_api_version_is_a_date_or_a_named_channel_and_nothing_else() {
        for good in ["2024-10-21", "2025-01-01-preview", "preview", "latest"] {
            assert!(is_azure_api_version(good), "{good}");
        }
        for bad in [
            "",
            "2024-10-2",
            "2024/10/21",
            "2024-10-21-beta",
            "2024-10-21-preview-preview",
            "20241021",
            "0123456789abcdef0123456789abcdef",
            "Preview",
            "2024-10-21 ",
            "２０２４-10-21",
        ] {
            assert!(!is_azure_api_version(bad), "{bad}");
        }
    }

    #[test]
    fn messages_serialise_tagged_by_role() {
        let messages = vec![
            ChatMessage::system("be brief"),
            ChatMessage::user("hi"),
            ChatMessage::Assistant(AssistantMessage {
                text: String::new(),
                tool_calls: vec![ToolCallRequest {
                    id: "c1".into(),
                    name: "lookup".into(),
                    arguments: json!({"q": "x"}),
                    thought_signature: None,
                }],
            }),
            ChatMessage::Tool(ToolResult {
                tool_call_id: "c1".into(),
                content: "found".into(),
                is_error: false,
            }),
        ];
        let value = serde_json::to_value(&messages).unwrap();
        assert_eq!(
            value,
            json!([
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "hi"},
                {"role": "assistant", "text": "", "tool_calls": [
                    {"id": "c1", "name": "lookup", "arguments": {"q": "x"}}
                ]},
                {"role": "tool", "tool_call_id": "c1", "content": "found", "is_error": false},
            ])
        );
        let back: Vec<ChatMessage> = serde_json::from_value(value).unwrap();
        assert_eq!(back, messages);
        let roles: Vec<ChatRole> = back.iter().map(ChatMessage::role).collect();
        assert_eq!(
            roles,
            [
                ChatRole::System,
                ChatRole::User,
                ChatRole::Assistant,
                ChatRole::Tool
            ]
        );
        assert_eq!(back[3].text(), "found");
    }

    #[test]
    fn stop_reasons_keep_unknown_provider_names() {
        let known: StopReason = serde_json::from_value(json!("tool_use")).unwrap();
        assert_eq!(known, StopReason::ToolUse);
        let other: StopReason = serde_json::from_value(json!("content_filter")).unwrap();
        assert_eq!(other, StopReason::Other("content_filter".into()));
        assert_eq!(
            serde_json::to_value(&other).unwrap(),
            json!("content_filter")
        );
        assert_eq!(
            serde_json::to_value(StopReason::MaxTokens).unwrap(),
            json!("max_tokens")
        );
    }

    #[test]
    fn provider_kinds_parse_and_print_alike() {
        // The names are stored (model connections, routine versions): they never change.
        let names: Vec<&str> = ProviderKind::ALL.iter().map(|k| k.as_str()).collect();
        assert_eq!(
            names,
            [
                "openai_compatible",
                "anthropic",
                "azure_openai",
                "gemini",
                "replay"
            ]
        );
        for kind in ProviderKind::ALL {
            assert_eq!(kind.to_string().parse::<ProviderKind>(), Ok(kind));
            assert_eq!(
                serde_json::to_value(kind).unwrap(),
                json!(kind.as_str()),
                "serde and Display agree"
            );
        }
        let err = "openai".parse::<ProviderKind>().unwrap_err();
        assert!(
            err.to_string()
                .starts_with("`openai` is not a model provider")
        );
        assert!(!ProviderKind::Replay.needs_connection());
        assert!(ProviderKind::Anthropic.needs_connection());
    }

    #[test]
    fn identity_round_trips_with_and_without_connection() {
        let with = ModelIdentity {
            provider: ProviderKind::Anthropic,
            connection_id: Some(ConnectionId::new()),
            model_id: "claude".into(),
        };
        let without = ModelIdentity {
            provider: ProviderKind::Replay,
            connection_id: None,
            model_id: "demo".into(),
        };
        for identity in [with, without] {
            let text = serde_json::to_string(&identity).unwrap();
            assert_eq!(
                serde_json::from_str::<ModelIdentity>(&text).unwrap(),
                identity
            );
        }
    }

    #[test]
    fn usage_adds_saturating() {
        let a = Usage {
            input_tokens: u64::MAX,
            output_tokens: 2,
        };
        let b = Usage {
            input_tokens: 1,
            output_tokens: 3,
        };
        assert_eq!(
            a.saturating_add(b),
            Usage {
                input_tokens: u64::MAX,
                output_tokens: 5
            }
        );
    }
}
