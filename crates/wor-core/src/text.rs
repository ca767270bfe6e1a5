//! U+0000 in text a run produces, and text shown to a person with what would hide in it made
//! visible.
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

/// Whether `c`, shown to a person as it is, would hide itself while changing what the text
/// around it looks like: a control character other than a line break, carriage return or tab
/// (escape sequences, bells, C1 controls), or a format character (direction embeddings,
/// overrides, isolates and marks, zero-width spaces, the byte order mark, tag characters;
/// [`crate::name::is_format_char`]) other than the zero-width joiner and non-joiner, which
/// some scripts and emoji need.
pub fn is_hidden(c: char) -> bool {
    (c.is_control() && !matches!(c, '\n' | '\r' | '\t'))
        || (crate::name::is_format_char(c) && !matches!(c, '\u{200C}' | '\u{200D}'))
}

/// `text` as a person is shown it: each character that [`is_hidden`] (and each `also`) written
/// as its `\u{…}` escape, so that what a model, a tool or another person wrote cannot show
/// as something else.
pub fn shown(text: &str, also: impl Fn(char) -> bool) -> Cow<'_, str> {
    let escaped = |c: char| is_hidden(c) || also(c);
    if !text.chars().any(escaped) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if escaped(c) {
            out.push_str(&format!("\\u{{{:x}}}", u32::from(c)));
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// `value` as indented JSON for a person to read and, where a form offers it, send back: each
/// character that [`is_hidden`] written as a JSON escape (`\u202e`), so the text shows it and
/// still reads as the same value.
pub fn json_shown(value: &Value) -> String {
    let text = serde_json::to_string_pretty(value).unwrap_or_default();
    if !text.chars().any(is_hidden) {
        return text;
    }
    let mut out = String::with_capacity(text.len() + 16);
    for c in text.chars() {
        if is_hidden(c) {
            let mut units = [0u16; 2];
            for unit in c.encode_utf16(&mut units) {
                out.push_str(&format!("\\u{unit:04x}"));
            }
        } else {
            out.push(c);
        }
    }
    out
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

    #[test]
    fn what_would_hide_in_shown_text_is_written_as_its_escape() {
        assert_eq!(
            shown(
                "a\u{202e}b\u{200b}c\u{200d}d\u{1b}[2J\r\n\te\u{e0041}",
                |_| false
            ),
            "a\\u{202e}b\\u{200b}c\u{200d}d\\u{1b}[2J\r\n\te\\u{e0041}"
        );
        assert_eq!(shown("a\rb", |c| c == '\r'), "a\\u{d}b");
        assert!(matches!(shown("plain שלום", |_| false), Cow::Borrowed(_)));
        let value = serde_json::json!({"q": "x\u{202e}y\u{e0041}", "n": [1]});
        let text = json_shown(&value);
        assert!(text.contains(r"x\u202ey\udb40\udc41"), "{text}");
        assert!(!text.chars().any(is_hidden), "{text}");
        assert_eq!(serde_json::from_str::<Value>(&text).unwrap(), value);
    }
}
