//! The one canonical JSON encoding and the SHA-256 digests built on it.
//!
//! Canonical form: object keys sorted by their UTF-8 bytes (which is Unicode code point order),
//! no insignificant white space, strings escaped as `serde_json` escapes them, numbers as
//! `serde_json` prints them. Two values that are equal as JSON data encode to the same bytes,
//! whatever order their keys arrived in. Pinned tool definitions, approval bindings and audit
//! entries are all hashed over this form.

use serde_json::Value;
use sha2::{Digest, Sha256};

/// The canonical JSON text of `value`.
pub fn to_canonical_json(value: &Value) -> String {
    let mut out = String::new();
    write_value(&mut out, value);
    out
}

fn write_value(out: &mut String, value: &Value) {
    match value {
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            entries.sort_unstable_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
            out.push('{');
            for (i, (key, val)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_string(out, key);
                out.push(':');
                write_value(out, val);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_value(out, item);
            }
            out.push(']');
        }
        scalar => out.push_str(&scalar.to_string()),
    }
}

fn write_string(out: &mut String, s: &str) {
    out.push_str(&Value::String(s.to_owned()).to_string());
}

/// Lower-case hex SHA-256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// Lower-case hex SHA-256 of the canonical JSON of `value`.
pub fn canonical_hash(value: &Value) -> String {
    sha256_hex(to_canonical_json(value).as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn key_order_does_not_matter() {
        let a: Value = serde_json::from_str(r#"{"b":1,"a":{"y":[1,2],"x":"é"}}"#).unwrap();
        let b: Value = serde_json::from_str(r#"{ "a" : { "x":"é", "y":[1, 2] }, "b":1 }"#).unwrap();
        assert_eq!(to_canonical_json(&a), r#"{"a":{"x":"é","y":[1,2]},"b":1}"#);
        assert_eq!(canonical_hash(&a), canonical_hash(&b));
    }

    #[test]
    fn different_values_differ() {
        assert_ne!(
            canonical_hash(&json!({"a": 1})),
            canonical_hash(&json!({"a": "1"}))
        );
        assert_ne!(
            canonical_hash(&json!([1, 2])),
            canonical_hash(&json!([2, 1]))
        );
    }

    #[test]
    fn escapes_strings() {
        assert_eq!(
            to_canonical_json(&json!({"q\"": "line\nbreak"})),
            r#"{"q\"":"line\nbreak"}"#
        );
        assert_eq!(
            sha256_hex(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}
