//! The shape of a script for the `replay` model (docs/replay.md): turns, their conditions and
//! tool calls, and the rules a script must keep.
//!
//! The shape lives here, below both its users: a routine's inline `model.script` is parsed
//! into it and checked when the routine is applied (`routine.rs`), and `wor-models` plays it.
//! A script that would fail every run is therefore refused once, with its line, instead.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::model::{StopReason, Usage};

/// A parsed replay script. [`ReplayScript::validate`] checks the rules the types cannot say.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplayScript {
    /// The turns, in file order.
    pub turns: Vec<ReplayTurn>,
}

/// One scripted assistant turn.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplayTurn {
    /// When this turn may play; `None` for any request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub when: Option<ReplayCondition>,
    /// The assistant text.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub text: String,
    /// The tool calls, in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ReplayToolCall>,
    /// Reported usage; estimated from sizes when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    /// The stop reason; derived from the tool calls when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_reason: Option<StopReason>,
    /// Whether the turn stays playable after it has played.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub repeat: bool,
}

/// What the request must contain for a turn to play. All given conditions must hold.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplayCondition {
    /// The most recent tool result contains this text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_tool_result_contains: Option<String>,
    /// Some message of the conversation contains this text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context_contains: Option<String>,
}

/// One scripted tool call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplayToolCall {
    /// The call id; `replay_{turn}_{call}` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// The tool name.
    pub name: String,
    /// Literal arguments.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arguments: Option<Value>,
    /// A marker: the arguments are the JSON value right after it in the context.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arguments_after: Option<String>,
}

/// Why a replay script was refused. Turns are counted from 1.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReplayScriptError {
    /// The text does not parse into the script's shape.
    #[error("{0}")]
    Shape(String),
    #[error("the script has no turns")]
    NoTurns,
    #[error("turn {turn} has neither text nor tool calls")]
    EmptyTurn { turn: usize },
    #[error("tool call `{name}` of turn {turn} has both `arguments` and `arguments_after`")]
    BothArguments { turn: usize, name: String },
    #[error("tool call `{name}` of turn {turn} has an empty `arguments_after` marker")]
    EmptyMarker { turn: usize, name: String },
}

impl ReplayScriptError {
    /// The turn the problem is in, counted from 1.
    pub fn turn(&self) -> Option<usize> {
        match self {
            ReplayScriptError::EmptyTurn { turn }
            | ReplayScriptError::BothArguments { turn, .. }
            | ReplayScriptError::EmptyMarker { turn, .. } => Some(*turn),
            ReplayScriptError::Shape(_) | ReplayScriptError::NoTurns => None,
        }
    }
}

impl ReplayScript {
    /// Parses and checks a script written in TOML.
    pub fn from_toml_str(text: &str) -> Result<Self, ReplayScriptError> {
        let script: Self = toml::from_str(text)
            .map_err(|e| ReplayScriptError::Shape(e.message().trim().to_owned()))?;
        script.validate()?;
        Ok(script)
    }

    /// Parses and checks a script written in JSON.
    pub fn from_json_str(text: &str) -> Result<Self, ReplayScriptError> {
        let script: Self =
            serde_json::from_str(text).map_err(|e| ReplayScriptError::Shape(e.to_string()))?;
        script.validate()?;
        Ok(script)
    }

    /// The rules beyond the shape: at least one turn, each with text or tool calls, and each
    /// tool call with at most one source of arguments.
    pub fn validate(&self) -> Result<(), ReplayScriptError> {
        if self.turns.is_empty() {
            return Err(ReplayScriptError::NoTurns);
        }
        for (turn, step) in self.turns.iter().enumerate().map(|(i, t)| (i + 1, t)) {
            if step.text.is_empty() && step.tool_calls.is_empty() {
                return Err(ReplayScriptError::EmptyTurn { turn });
            }
            for call in &step.tool_calls {
                let name = call.name.clone();
                if call.arguments.is_some() && call.arguments_after.is_some() {
                    return Err(ReplayScriptError::BothArguments { turn, name });
                }
                if call.arguments_after.as_deref() == Some("") {
                    return Err(ReplayScriptError::EmptyMarker { turn, name });
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_rule_is_checked_and_names_the_turn() {
        for (script, expected, turn) in [
            ("turns = []", "no turns", None),
            (
                "[[turns]]\ntext = \"a\"\n[[turns]]\nrepeat = true",
                "neither text nor tool calls",
                Some(2),
            ),
            (
                "[[turns]]\ntool_calls = [{ name = \"t\", arguments = {}, arguments_after = \"m\" }]",
                "both `arguments` and `arguments_after`",
                Some(1),
            ),
            (
                "[[turns]]\ntool_calls = [{ name = \"t\", arguments_after = \"\" }]",
                "empty `arguments_after`",
                Some(1),
            ),
            (
                "[[turns]]\ntext = \"x\"\ntypo = 1",
                "unknown field `typo`",
                None,
            ),
            ("turns = \"x\"", "invalid type: string", None),
        ] {
            let err = ReplayScript::from_toml_str(script).unwrap_err();
            assert!(err.to_string().contains(expected), "{script}: {err}");
            assert_eq!(err.turn(), turn, "{script}: {err}");
        }
    }

    #[test]
    fn defaults_are_left_out_when_serialised() {
        let script = ReplayScript::from_toml_str(
            "[[turns]]\ntext = \"hi\"\n[[turns]]\ntool_calls = [{ name = \"t\" }]",
        )
        .unwrap();
        assert_eq!(
            serde_json::to_value(&script).unwrap(),
            serde_json::json!({"turns": [{"text": "hi"}, {"tool_calls": [{"name": "t"}]}]})
        );
    }
}
