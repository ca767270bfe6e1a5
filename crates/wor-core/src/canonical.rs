//! The one canonical JSON encoding and the SHA-256 digests built on it.
//!
//! Canonical form: object keys sorted by their UTF-8 bytes (which is Unicode code point order),
//! no insignificant white space, strings escaped as `serde_json` escapes them, numbers as
//! `serde_json` prints them. Two values that are equal as JSON data encode to the same bytes,
//! whatever order their keys arrived in. Pinned tool definitions, approval bindings and audit
//! entries are all hashed over this form.

use std::io::{self, Write};

use serde_json::Value;
use sha2::{Digest, Sha256};

/// The canonical JSON text of `value`.
pub fn to_canonical_json(value: &Value) -> String {
    let mut out = Vec::new();
    write_value(&mut out, value);
    into_text(out)
}

/// The value of one member given to [`canonical_object`].
#[derive(Debug, Clone)]
pub(crate) enum Member<'a> {
    /// A value, written in canonical form.
    Json(&'a Value),
    /// The canonical text of a value (as [`to_canonical_json`] wrote it), written as it is.
    Canonical(&'a str),
    /// A string, written as a JSON string.
    Text(&'a str),
    /// A whole number.
    Int(i64),
    /// `null`.
    Null,
    /// An object given as its members, written as [`canonical_object`] writes one.
    Object(Vec<(&'a str, Member<'a>)>),
}

/// The canonical JSON text of an object given as its members, borrowed: the same text as
/// [`to_canonical_json`] of the object they make, without copying them into one. A name given
/// twice is written twice (no JSON object has that); callers name each member once.
pub(crate) fn canonical_object(members: &mut [(&str, Member<'_>)]) -> String {
    let mut out = Vec::new();
    write_members(&mut out, members);
    into_text(out)
}

/// Lower-case hex SHA-256 of [`canonical_object`]'s text, hashed as it is written.
pub(crate) fn canonical_object_hash(members: &mut [(&str, Member<'_>)]) -> String {
    let mut hasher = Hashing(Sha256::new());
    write_members(&mut hasher, members);
    hex::encode(hasher.0.finalize())
}

/// Lower-case hex SHA-256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// Lower-case hex SHA-256 of the canonical JSON of `value`, hashed as it is written rather than
/// built as a text first.
pub fn canonical_hash(value: &Value) -> String {
    let mut hasher = Hashing(Sha256::new());
    write_value(&mut hasher, value);
    hex::encode(hasher.0.finalize())
}

/// Where canonical JSON is written: a buffer, or a hash taking it in as it comes.
trait Sink: Write {}

impl Sink for Vec<u8> {}

/// A SHA-256 hash written to as a byte stream.
struct Hashing(Sha256);

impl Write for Hashing {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        self.0.update(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Sink for Hashing {}

/// The buffer as text. `serde_json` writes only UTF-8 and the punctuation between its pieces is
/// ASCII, so the check cannot fail; were it to, an invalid byte would become U+FFFD.
fn into_text(bytes: Vec<u8>) -> String {
    String::from_utf8(bytes)
        .unwrap_or_else(|invalid| String::from_utf8_lossy(invalid.as_bytes()).into_owned())
}

fn write_value(out: &mut impl Sink, value: &Value) {
    match value {
        Value::Object(map) => {
            let mut members: Vec<(&str, Member<'_>)> = map
                .iter()
                .map(|(name, val)| (name.as_str(), Member::Json(val)))
                .collect();
            write_members(out, &mut members);
        }
        Value::Array(items) => {
            put(out, b"[");
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    put(out, b",");
                }
                write_value(out, item);
            }
            put(out, b"]");
        }
        scalar => write_json(out, scalar),
    }
}

fn write_members(out: &mut impl Sink, members: &mut [(&str, Member<'_>)]) {
    members.sort_unstable_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
    put(out, b"{");
    for (i, (name, value)) in members.iter_mut().enumerate() {
        if i > 0 {
            put(out, b",");
        }
        write_json(out, *name);
        put(out, b":");
        match value {
            Member::Json(value) => write_value(out, value),
            Member::Canonical(text) => put(out, text.as_bytes()),
            Member::Text(text) => write_json(out, *text),
            Member::Int(number) => write_json(out, number),
            Member::Null => put(out, b"null"),
            Member::Object(inner) => write_members(out, inner),
        }
    }
    put(out, b"}");
}

/// A string or a scalar, escaped and formatted as `serde_json` does.
fn write_json(out: &mut impl Sink, value: &(impl serde::Serialize + ?Sized)) {
    // Writing a string or a scalar to a buffer or a hash cannot fail: neither sink returns an
    // error and neither value has anything `serde_json` refuses.
    let _infallible = serde_json::to_writer(&mut *out, value);
}

fn put(out: &mut impl Sink, bytes: &[u8]) {
    // As above: neither sink returns an error.
    let _infallible = out.write_all(bytes);
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
    fn hashing_as_written_and_borrowed_members_give_the_text_of_the_whole() {
        let payload = json!({
            "z": [1.5, -0.0, 1e300, null, true, "\u{1}\u{7f}\u{2028}\\\"é😀"],
            "a": {"\t": {}, "": []},
        });
        let text = to_canonical_json(&payload);
        assert_eq!(canonical_hash(&payload), sha256_hex(text.as_bytes()));
        let whole = json!({"payload": payload, "format": "f", "seq": 3});
        let (format, seq) = (json!("f"), json!(3));
        let mut members = [
            ("seq", Member::Json(&seq)),
            ("payload", Member::Json(&payload)),
            ("format", Member::Json(&format)),
        ];
        assert_eq!(canonical_object(&mut members), to_canonical_json(&whole));
        // A member given as its canonical text is written as it is, in its place.
        let mut members = [
            ("seq", Member::Json(&seq)),
            ("payload", Member::Canonical(&text)),
            ("format", Member::Json(&format)),
        ];
        assert_eq!(canonical_object(&mut members), to_canonical_json(&whole));
        // Strings, whole numbers and `null` given as they are write as their values do, and
        // hash as the text does.
        let quoted = "\u{1}\"é\u{2028}\\";
        let whole = json!({"t": quoted, "n": i64::MIN, "m": -1, "z": null, "p": payload});
        let mut members = [
            ("z", Member::Null),
            ("t", Member::Text(quoted)),
            ("n", Member::Int(i64::MIN)),
            ("p", Member::Canonical(&text)),
            ("m", Member::Int(-1)),
        ];
        assert_eq!(canonical_object(&mut members), to_canonical_json(&whole));
        assert_eq!(canonical_object_hash(&mut members), canonical_hash(&whole));
        // An object given as its members, in any order and nested, writes as its value does.
        let whole = json!({"o": {"b": quoted, "a": {"y": 2, "x": null}, "": {}}, "k": 1});
        let mut members = [
            (
                "o",
                Member::Object(vec![
                    ("b", Member::Text(quoted)),
                    (
                        "a",
                        Member::Object(vec![("y", Member::Int(2)), ("x", Member::Null)]),
                    ),
                    ("", Member::Object(Vec::new())),
                ]),
            ),
            ("k", Member::Int(1)),
        ];
        assert_eq!(canonical_object(&mut members), to_canonical_json(&whole));
        assert_eq!(canonical_object_hash(&mut members), canonical_hash(&whole));
        assert_eq!(
            text,
            "{\"a\":{\"\":[],\"\\t\":{}},\"z\":[1.5,-0.0,1e+300,null,true,\
             \"\\u0001\u{7f}\u{2028}\\\\\\\"é😀\"]}"
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
