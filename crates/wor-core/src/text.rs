//! U+0000 in text a run produces.
//!
//! PostgreSQL text cannot hold U+0000, so no stored text may carry it, on either backend. Input
//! from the API is refused with a 400 (`wor-server`); what a run produces — model turns, tool
//! results, webhook payloads, outcomes — cannot be sent back, so each U+0000 in it becomes
//! U+FFFD (the replacement character) before anything records or acts on it, and the step says
//! so.

use std::borrow::Cow;

use serde_json::Value;

/// What U+0000 becomes.
pub const NUL_REPLACEMENT: char = '\u{FFFD}';

/// `text` with every U+0000 replaced by [`NUL_REPLACEMENT`].
pub fn replace_nul(text: &str) -> Cow<'_, str> {
    if text.contains('\0') {
        Cow::Owned(text.replace('\0', "\u{FFFD}"))
    } else {
        Cow::Borrowed(text)
    }
}

/// Whether any string or key of `value` holds U+0000. Iterative, so any depth is safe.
pub fn json_holds_nul(value: &Value) -> bool {
    let mut pending = vec![value];
    while let Some(value) = pending.pop() {
        match value {
            Value::String(s) if s.contains('\0') => return true,
            Value::Array(items) => pending.extend(items),
            Value::Object(map) => {
                if map.keys().any(|k| k.contains('\0')) {
                    return true;
                }
                pending.extend(map.values());
            }
            _ => {}
        }
    }
    false
}

/// Replaces U+0000 in every string and key of `value`; true when there was any. Iterative, so
/// any depth is safe.
pub fn replace_nul_in_json(value: &mut Value) -> bool {
    let mut replaced = false;
    let mut pending = vec![value];
    while let Some(value) = pending.pop() {
        match value {
            Value::String(s) => {
                if let Cow::Owned(clean) = replace_nul(s) {
                    *s = clean;
                    replaced = true;
                }
            }
            Value::Array(items) => pending.extend(items.iter_mut()),
            Value::Object(map) => {
                if map.keys().any(|k| k.contains('\0')) {
                    let entries = std::mem::take(map);
                    *map = entries
                        .into_iter()
                        .map(|(k, v)| (replace_nul(&k).into_owned(), v))
                        .collect();
                    replaced = true;
                }
                pending.extend(map.values_mut());
            }
            Value::Null | Value::Bool(_) | Value::Number(_) => {}
        }
    }
    replaced
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn nul_becomes_the_replacement_character_in_strings_and_keys() {
        assert_eq!(replace_nul("a\0b\0"), "a\u{FFFD}b\u{FFFD}");
        assert!(matches!(replace_nul("clean"), Cow::Borrowed("clean")));
        let mut value = json!({"k\0": ["x\0", {"deep": "\0"}], "n": 1});
        assert!(replace_nul_in_json(&mut value));
        assert_eq!(
            value,
            json!({"k\u{FFFD}": ["x\u{FFFD}", {"deep": "\u{FFFD}"}], "n": 1})
        );
        assert!(!replace_nul_in_json(&mut value));
    }
}
