//! How deeply JSON nests, measured without recursion, and the bound on JSON the API accepts and
//! runs record.
//!
//! serde_json refuses to parse JSON nested deeper than 128 levels, which keeps its own
//! recursion safe. What is stored comes back wrapped (a run's input inside its step inside the
//! run), so JSON accepted at 128 levels would come back deeper than any client could parse.
//! Request bodies and the arguments of a model's tool calls are therefore held to
//! [`MAX_JSON_NESTING`], leaving room for the wrapping.

use serde_json::Value;

/// The deepest arrays and objects may nest in a request body or a tool call's arguments.
pub const MAX_JSON_NESTING: usize = 64;

/// How deeply the arrays and objects of JSON text nest (0 for a scalar). Brackets inside
/// strings do not count; text that is not JSON is measured all the same, for the parser to
/// refuse.
pub fn text_nesting(json: &[u8]) -> usize {
    let (mut depth, mut deepest, mut in_string, mut escaped) = (0usize, 0usize, false, false);
    for &byte in json {
        if in_string {
            match (escaped, byte) {
                (true, _) => escaped = false,
                (false, b'\\') => escaped = true,
                (false, b'"') => in_string = false,
                _ => {}
            }
            continue;
        }
        match byte {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                deepest = deepest.max(depth);
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    deepest
}

/// How deeply the arrays and objects of `value` nest (0 for a scalar).
pub fn value_nesting(value: &Value) -> usize {
    let mut deepest = 0;
    let mut pending = vec![(value, 0usize)];
    while let Some((value, depth)) = pending.pop() {
        match value {
            Value::Array(items) => {
                deepest = deepest.max(depth + 1);
                pending.extend(items.iter().map(|item| (item, depth + 1)));
            }
            Value::Object(map) => {
                deepest = deepest.max(depth + 1);
                pending.extend(map.values().map(|item| (item, depth + 1)));
            }
            Value::Null | Value::Bool(_) | Value::Number(_) | Value::String(_) => {}
        }
    }
    deepest
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_and_value_agree_and_strings_do_not_count() {
        for text in [
            "1",
            "[]",
            "{\"a\": [1, {\"b\": []}]}",
            "[\"]]]\\\"[[[\", [[1]]]",
            "{\"a\": \"{{{{\"}",
        ] {
            let value: Value = serde_json::from_str(text).unwrap();
            assert_eq!(
                text_nesting(text.as_bytes()),
                value_nesting(&value),
                "{text}"
            );
        }
        assert_eq!(text_nesting(b"[[[1]]]"), 3);
        let deep = format!("{}1{}", "[".repeat(100), "]".repeat(100));
        assert_eq!(text_nesting(deep.as_bytes()), 100);
        assert_eq!(value_nesting(&serde_json::from_str(&deep).unwrap()), 100);
    }
}
