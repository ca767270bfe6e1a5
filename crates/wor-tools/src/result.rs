//! What a tool returned, and the [`ShapedResult`] the engine gives back to the model: redacted
//! and size-capped, always untrusted.
//!
//! Order matters: redaction runs on the whole text before the cap, so a secret cut in half by
//! the cap cannot slip past the exact-match redactor.

use std::fmt;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use wor_secrets::Redactor;

/// One piece of a tool's answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", content = "value", rename_all = "snake_case")]
pub enum ToolContent {
    /// Text.
    Text(String),
    /// Structured data (MCP structured content, non-text MCP content blocks, HTTP JSON bodies).
    Json(Value),
}

/// What one tool call returned, before redaction and capping.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCallResult {
    /// The content, in the order the tool gave it.
    pub content: Vec<ToolContent>,
    /// The tool itself reported failure (MCP `isError: true`, an HTTP error status). This is a
    /// result for the model, not a protocol failure.
    pub is_error: bool,
}

/// How large a result may be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResultLimits {
    /// Largest result text given to the model, in bytes (the truncation marker included).
    pub max_bytes: usize,
}

impl Default for ResultLimits {
    fn default() -> Self {
        Self {
            max_bytes: 64 * 1024,
        }
    }
}

/// A tool's answer as text ready for the model: redacted and capped. It is always untrusted;
/// the engine labels it so (`wor_core::run::Provenance::Untrusted`) and wraps it in its
/// envelope as the content of the `wor_core::model::ToolResult` the model gets.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShapedResult {
    /// The text given to the model (inside the engine's untrusted-content envelope).
    pub text: String,
    /// The tool reported failure.
    pub is_error: bool,
    /// Bytes dropped by the cap, if any.
    pub truncated: Option<Truncation>,
}

/// How much the cap dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Truncation {
    /// Bytes of redacted text before the cap.
    pub original_bytes: usize,
    /// Bytes dropped.
    pub dropped_bytes: usize,
}

impl fmt::Display for Truncation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "[wor: result truncated, {} of {} bytes dropped]",
            self.dropped_bytes, self.original_bytes
        )
    }
}

impl ShapedResult {
    /// Renders `result` as text (text as is, JSON as compact JSON, pieces separated by a
    /// newline), redacts it with `redactor` and caps it at `limits`.
    pub fn new(result: &ToolCallResult, redactor: &Redactor, limits: ResultLimits) -> Self {
        let rendered = render(&result.content);
        let redacted = redactor.redact(&rendered).into_owned();
        let (text, truncated) = cap(redacted, limits.max_bytes);
        Self {
            text,
            is_error: result.is_error,
            truncated,
        }
    }
}

fn render(content: &[ToolContent]) -> String {
    let mut out = String::new();
    for (index, piece) in content.iter().enumerate() {
        if index > 0 {
            out.push('\n');
        }
        match piece {
            ToolContent::Text(text) => out.push_str(text),
            ToolContent::Json(value) => out.push_str(&value.to_string()),
        }
    }
    out
}

/// Keeps as much of `text` as fits in `max_bytes` together with the marker.
fn cap(mut text: String, max_bytes: usize) -> (String, Option<Truncation>) {
    let original_bytes = text.len();
    if original_bytes <= max_bytes {
        return (text, None);
    }
    // The marker's length depends on the dropped count; the worst case is the original length.
    let worst = Truncation {
        original_bytes,
        dropped_bytes: original_bytes,
    };
    let marker_room = worst.to_string().len().saturating_add(1);
    let mut keep = max_bytes.saturating_sub(marker_room);
    while keep > 0 && !text.is_char_boundary(keep) {
        keep -= 1;
    }
    text.truncate(keep);
    let truncation = Truncation {
        original_bytes,
        dropped_bytes: original_bytes.saturating_sub(keep),
    };
    text.push('\n');
    text.push_str(&truncation.to_string());
    // A cap smaller than the marker itself: nothing of the result is kept, and the marker is
    // cut too (it is ASCII), so the cap holds whatever it is.
    text.truncate(max_bytes.min(text.len()));
    (text, Some(truncation))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn redactor() -> Redactor {
        Redactor::new(["sk-live-secret-value-123"]).unwrap()
    }

    #[test]
    fn small_results_pass_whole_and_labelled() {
        let result = ToolCallResult {
            content: vec![
                ToolContent::Text("hello".into()),
                ToolContent::Json(json!({"a": 1})),
            ],
            is_error: false,
        };
        let out = ShapedResult::new(&result, &redactor(), ResultLimits::default());
        assert_eq!(out.text, "hello\n{\"a\":1}");
        assert_eq!(out.truncated, None);
    }

    #[test]
    fn large_results_are_cut_with_a_marker_saying_how_much() {
        let result = ToolCallResult {
            content: vec![ToolContent::Text("é".repeat(1000))],
            is_error: true,
        };
        let out = ShapedResult::new(&result, &redactor(), ResultLimits { max_bytes: 200 });
        assert!(out.text.len() <= 200, "{}", out.text.len());
        let truncation = out.truncated.unwrap();
        assert_eq!(truncation.original_bytes, 2000);
        assert_eq!(
            truncation.dropped_bytes,
            2000 - out.text.split('\n').next().unwrap().len()
        );
        assert!(out.text.ends_with(&format!(
            "[wor: result truncated, {} of 2000 bytes dropped]",
            truncation.dropped_bytes
        )));
        assert!(out.is_error);
    }

    #[test]
    fn a_cap_smaller_than_the_marker_still_holds() {
        let result = ToolCallResult {
            content: vec![ToolContent::Text("x".repeat(100))],
            is_error: false,
        };
        for max_bytes in [0, 1, 10, 40] {
            let out = ShapedResult::new(&result, &redactor(), ResultLimits { max_bytes });
            assert!(out.text.len() <= max_bytes, "{max_bytes}: {:?}", out.text);
            assert!(!out.text.contains('x'), "{max_bytes}: {:?}", out.text);
            assert_eq!(
                out.truncated,
                Some(Truncation {
                    original_bytes: 100,
                    dropped_bytes: 100
                })
            );
        }
    }

    #[test]
    fn redaction_runs_before_the_cap() {
        // The secret straddles the cut: capping first would leave its first half.
        let text = format!("{}sk-live-secret-value-123", "x".repeat(120));
        let result = ToolCallResult {
            content: vec![ToolContent::Text(text)],
            is_error: false,
        };
        let out = ShapedResult::new(&result, &redactor(), ResultLimits { max_bytes: 180 });
        assert!(!out.text.contains("sk-live"), "{}", out.text);
    }

    #[test]
    fn secrets_in_json_and_shapes_are_redacted() {
        let result = ToolCallResult {
            content: vec![ToolContent::Json(
                json!({"token": "sk-live-secret-value-123", "jwt": "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U"}),
            )],
            is_error: false,
        };
        let out = ShapedResult::new(&result, &redactor(), ResultLimits::default());
        assert!(!out.text.contains("sk-live-secret"), "{}", out.text);
        assert!(!out.text.contains("eyJzdWIi"), "{}", out.text);
        assert!(out.text.contains("[REDACTED"));
    }
}
