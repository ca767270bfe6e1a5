//! The `replay` provider: a scripted model for demos and tests (production refuses it).
//!
//! A script is a TOML or JSON document holding an ordered list of `turns`. Each request plays
//! the **first unplayed turn, in file order, whose `when` condition matches** the request; a
//! turn without `when` matches any request. A played turn is not played again unless it says
//! `repeat = true`. When no turn matches, the call fails with
//! [`ModelError::ScriptExhausted`].
//!
//! ```toml
//! # Played first: fires only once a tool result carries the injected marker, calling
//! # `send_email` with the JSON object written right after the marker.
//! [[turns]]
//! when = { last_tool_result_contains = "INJECT:" }
//! tool_calls = [{ name = "send_email", arguments_after = "INJECT:" }]
//!
//! [[turns]]
//! text = "Let me fetch the page."
//! tool_calls = [{ id = "call_1", name = "fetch", arguments = { url = "https://example.com" } }]
//! usage = { input_tokens = 120, output_tokens = 18 }
//!
//! [[turns]]
//! text = "Done."
//! ```
//!
//! Turn fields: `text` (assistant text), `tool_calls` (each `name`, optional `id`, and either
//! `arguments` — a literal JSON/TOML value — or `arguments_after` — a marker: the arguments are
//! the JSON value written right after the marker in the most recent message containing it),
//! `usage` (`input_tokens`, `output_tokens`; when absent, estimated as one token per four bytes
//! of context and output), `stop_reason` (default `tool_use` with tool calls, else
//! `end_turn`), `repeat`, and `when` with any of `last_tool_result_contains` (the most recent
//! tool result contains the text) and `context_contains` (any message contains it); all given
//! conditions must hold. The same format is documented for script authors in `docs/replay.md`.

use std::path::Path;
use std::sync::Mutex;

use serde_json::Value;
use wor_core::model::{
    AssistantMessage, ChatMessage, ModelRequest, ModelResponse, ProviderKind, StopReason,
    ToolCallRequest, Usage,
};

use crate::error::ModelError;
use crate::{ModelFuture, ModelProvider, StreamSink};

pub use wor_core::replay::{
    ReplayCondition, ReplayScript, ReplayScriptError, ReplayToolCall, ReplayTurn,
};

impl From<ReplayScriptError> for ModelError {
    fn from(err: ReplayScriptError) -> Self {
        ModelError::InvalidScript(err.to_string())
    }
}

/// Reads a script file: JSON if the name ends in `.json`, TOML otherwise.
fn load_script(path: &Path) -> Result<ReplayScript, ModelError> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        ModelError::InvalidScript(format!("could not read `{}`: {e}", path.display()))
    })?;
    Ok(if path.extension().is_some_and(|ext| ext == "json") {
        ReplayScript::from_json_str(&text)?
    } else {
        ReplayScript::from_toml_str(&text)?
    })
}

/// Whether `condition` holds for the conversation `messages`.
fn condition_matches(condition: &ReplayCondition, messages: &[ChatMessage]) -> bool {
    let tool_result_ok = condition
        .last_tool_result_contains
        .as_ref()
        .is_none_or(|needle| {
            messages
                .iter()
                .rev()
                .find_map(|m| match m {
                    ChatMessage::Tool(result) => Some(result.content.contains(needle.as_str())),
                    _ => None,
                })
                .unwrap_or(false)
        });
    let context_ok = condition
        .context_contains
        .as_ref()
        .is_none_or(|needle| messages.iter().any(|m| m.text().contains(needle.as_str())));
    tool_result_ok && context_ok
}

/// Which turns have played.
#[derive(Debug)]
struct ReplayState {
    played: Vec<bool>,
}

/// The scripted model.
#[derive(Debug)]
pub struct ReplayProvider {
    script: ReplayScript,
    state: Mutex<ReplayState>,
}

impl ReplayProvider {
    /// A provider playing `script` from its start.
    pub fn new(script: ReplayScript) -> Self {
        let played = vec![false; script.turns.len()];
        Self {
            script,
            state: Mutex::new(ReplayState { played }),
        }
    }

    /// A provider continuing a conversation: the turns that produced the assistant messages
    /// of `history` count as played, as they were chosen then. A run that resumes after a
    /// restart therefore gets the turn it would have got, never a replay of the first.
    pub fn resuming(script: ReplayScript, history: &[ChatMessage]) -> Result<Self, ModelError> {
        let provider = Self::new(script);
        for (at, message) in history.iter().enumerate() {
            if matches!(message, ChatMessage::Assistant(_)) {
                let earlier = history.get(..at).unwrap_or_default().to_vec();
                provider.next_turn(&ModelRequest {
                    model: String::new(),
                    messages: earlier,
                    tools: Vec::new(),
                    max_output_tokens: 0,
                    temperature: None,
                    output_schema: None,
                })?;
            }
        }
        Ok(provider)
    }

    /// A provider playing the script file at `path`.
    pub fn load(path: &Path) -> Result<Self, ModelError> {
        load_script(path).map(Self::new)
    }

    /// Picks the turn for `request`, marks it played and builds the response.
    fn next_turn(&self, request: &ModelRequest) -> Result<ModelResponse, ModelError> {
        // A poisoned lock only means another call panicked mid-update of `played`; the flags
        // are still meaningful, so carry on with them.
        let mut state = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let total = self.script.turns.len();
        let chosen =
            self.script
                .turns
                .iter()
                .zip(state.played.iter())
                .position(|(turn, played)| {
                    (!played || turn.repeat)
                        && turn
                            .when
                            .as_ref()
                            .is_none_or(|c| condition_matches(c, &request.messages))
                });
        let (Some(index), Some(turn)) = (chosen, chosen.and_then(|i| self.script.turns.get(i)))
        else {
            return Err(ModelError::ScriptExhausted {
                played: state.played.iter().filter(|p| **p).count(),
                total,
            });
        };
        let response = build_response(index + 1, turn, &request.messages)?;
        if let Some(flag) = state.played.get_mut(index) {
            *flag = true;
        }
        Ok(response)
    }
}

fn build_response(
    number: usize,
    turn: &ReplayTurn,
    messages: &[ChatMessage],
) -> Result<ModelResponse, ModelError> {
    let tool_calls = turn
        .tool_calls
        .iter()
        .enumerate()
        .map(|(position, call)| {
            let arguments = match (&call.arguments, &call.arguments_after) {
                (Some(literal), _) => literal.clone(),
                (None, Some(marker)) => arguments_after(marker, messages).ok_or_else(|| {
                    ModelError::InvalidScript(format!(
                        "turn {number}: no json value follows `{marker}` in the conversation"
                    ))
                })?,
                (None, None) => Value::Object(serde_json::Map::new()),
            };
            Ok(ToolCallRequest {
                id: call
                    .id
                    .clone()
                    .unwrap_or_else(|| format!("replay_{number}_{}", position + 1)),
                name: call.name.clone(),
                arguments,
                thought_signature: None,
            })
        })
        .collect::<Result<Vec<_>, ModelError>>()?;
    let stop_reason = turn
        .stop_reason
        .clone()
        .unwrap_or(if tool_calls.is_empty() {
            StopReason::EndTurn
        } else {
            StopReason::ToolUse
        });
    let usage = turn.usage.unwrap_or_else(|| {
        let context: usize = messages.iter().map(|m| m.text().len()).sum();
        let output = turn.text.len()
            + tool_calls
                .iter()
                .map(|c| c.name.len() + c.arguments.to_string().len())
                .sum::<usize>();
        Usage {
            input_tokens: estimated_tokens(context),
            output_tokens: estimated_tokens(output),
        }
    });
    Ok(ModelResponse {
        message: AssistantMessage {
            text: turn.text.clone(),
            tool_calls,
        },
        stop_reason,
        usage,
    })
}

/// One token per four bytes, rounded up.
fn estimated_tokens(bytes: usize) -> u64 {
    u64::try_from(bytes.div_ceil(4)).unwrap_or(u64::MAX)
}

/// The JSON value written right after `marker` in the most recent message that has one.
fn arguments_after(marker: &str, messages: &[ChatMessage]) -> Option<Value> {
    messages.iter().rev().find_map(|message| {
        let text = message.text();
        text.match_indices(marker).find_map(|(at, _)| {
            let rest = text.get(at + marker.len()..)?;
            serde_json::Deserializer::from_str(rest)
                .into_iter::<Value>()
                .next()?
                .ok()
        })
    })
}

impl ModelProvider for ReplayProvider {
    fn kind(&self) -> ProviderKind {
        ProviderKind::Replay
    }

    fn complete<'a>(
        &'a self,
        request: &'a ModelRequest,
        sink: &'a mut dyn StreamSink,
    ) -> ModelFuture<'a> {
        Box::pin(async move {
            let response = self.next_turn(request)?;
            if !response.message.text.is_empty() {
                sink.text_delta(&response.message.text);
            }
            for call in &response.message.tool_calls {
                sink.tool_call_started(&call.name);
            }
            Ok(response)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_crate_doc_example_parses() {
        let script = ReplayScript::from_toml_str(
            r#"
            [[turns]]
            when = { last_tool_result_contains = "INJECT:" }
            tool_calls = [{ name = "send_email", arguments_after = "INJECT:" }]

            [[turns]]
            text = "Let me fetch the page."
            tool_calls = [{ id = "call_1", name = "fetch", arguments = { url = "https://example.com" } }]
            usage = { input_tokens = 120, output_tokens = 18 }

            [[turns]]
            text = "Done."
            "#,
        )
        .unwrap();
        assert_eq!(script.turns.len(), 3);
        assert_eq!(
            script.turns[1].tool_calls[0].arguments,
            Some(serde_json::json!({"url": "https://example.com"}))
        );
    }

    #[test]
    fn invalid_scripts_are_refused_with_reasons() {
        for (script, expected) in [
            ("turns = []", "no turns"),
            ("[[turns]]\nrepeat = true", "neither text nor tool calls"),
            (
                "[[turns]]\ntool_calls = [{ name = \"t\", arguments = {}, arguments_after = \"m\" }]",
                "both `arguments` and `arguments_after`",
            ),
            ("[[turns]]\ntext = \"x\"\ntypo = 1", "unknown field `typo`"),
        ] {
            let err = ReplayScript::from_toml_str(script).unwrap_err();
            assert!(err.to_string().contains(expected), "{script}: {err}");
        }
    }

    #[test]
    fn arguments_follow_the_latest_marker_and_tolerate_trailing_text() {
        let messages = vec![
            ChatMessage::user(r#"old: INJECT: {"to": "old@example.com"}"#),
            ChatMessage::user(r#"page text INJECT: {"to": "evil@example.com"} more text"#),
        ];
        assert_eq!(
            arguments_after("INJECT:", &messages),
            Some(serde_json::json!({"to": "evil@example.com"}))
        );
        assert_eq!(arguments_after("MISSING", &messages), None);
    }
}
