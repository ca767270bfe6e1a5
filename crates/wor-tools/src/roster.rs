//! A routine's tool roster, what the model is shown of each tool, and the arguments that are
//! actually sent: pinned values forced in, then checked against the pinned input schema.
//!
//! Schema validation uses `jsonschema` without any retriever: a `$ref` that points outside the
//! schema is never fetched; the schema is unusable instead ([`ArgumentError::UnusableSchema`]).
//! Every [`ArgumentError`] is a message for the model (a tool error), not a server failure.

use std::collections::BTreeSet;
use std::sync::OnceLock;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use wor_core::routine::RosterEntry;

use crate::definition::PinnedToolDefinition;

/// A tool as the model sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelToolSpec {
    /// The tool's name.
    pub name: String,
    /// Its pinned description (empty when it has none).
    pub description: String,
    /// Its pinned input schema without the pinned arguments.
    pub input_schema: Value,
}

/// What the model is shown of `pinned`: name, description, and the input schema with every
/// pinned argument removed from the top-level `properties` and `required`.
pub fn model_view(pinned: &PinnedToolDefinition, entry: &RosterEntry) -> ModelToolSpec {
    let definition = pinned.definition();
    let mut schema = definition.input_schema.clone();
    if let Some(Value::Object(properties)) = schema.get_mut("properties") {
        for key in entry.pinned.keys() {
            properties.remove(key);
        }
    }
    if let Some(Value::Array(required)) = schema.get_mut("required") {
        required.retain(|name| {
            name.as_str()
                .is_none_or(|name| !entry.pinned.contains_key(name))
        });
    }
    ModelToolSpec {
        name: definition.name.clone(),
        description: definition.description.clone().unwrap_or_default(),
        input_schema: Value::Object(schema),
    }
}

/// The arguments that will be sent, in canonical form.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CanonicalArguments {
    /// The arguments, pinned values included.
    pub value: Map<String, Value>,
    /// Their canonical JSON ([`wor_core::canonical`]).
    pub canonical_json: String,
    /// Lower-case hex SHA-256 of `canonical_json`: what approvals bind to.
    pub hash: String,
    /// The keys whose value came from the roster, sorted.
    pub pinned_keys: Vec<String>,
}

/// One way the arguments break the schema.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SchemaViolation {
    /// JSON pointer into the arguments (`""` for the whole object).
    pub path: String,
    /// What is wrong there.
    pub message: String,
}

/// Why the arguments cannot be sent. Each is returned to the model as a tool error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ArgumentError {
    /// The model sent something other than a JSON object.
    #[error("arguments must be a json object, got {found}")]
    NotAnObject {
        /// The JSON type that was sent.
        found: &'static str,
    },
    /// The arguments do not match the pinned input schema.
    #[error("arguments do not match the input schema: {}", summary(.violations))]
    SchemaViolations {
        /// Every violation, in schema order.
        violations: Vec<SchemaViolation>,
    },
    /// The pinned schema cannot be used (malformed, or it refers to a remote document, which
    /// is never fetched).
    #[error("the tool's input schema cannot be used: {reason}")]
    UnusableSchema {
        /// Why.
        reason: String,
    },
}

fn summary(violations: &[SchemaViolation]) -> String {
    violations
        .iter()
        .map(|v| {
            if v.path.is_empty() {
                v.message.clone()
            } else {
                format!("at `{}`: {}", v.path, v.message)
            }
        })
        .collect::<Vec<_>>()
        .join("; ")
}

fn json_type(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// A tool's pinned input schema, compiled the first time arguments are checked against it and
/// kept for every later call (a run holds one per tool it offers). A schema that cannot be
/// compiled refuses every call, each with the same reason.
pub struct ArgumentSchema {
    schema: Value,
    compiled: OnceLock<Result<jsonschema::Validator, String>>,
}

impl std::fmt::Debug for ArgumentSchema {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ArgumentSchema")
            .field("schema", &self.schema)
            .field("compiled", &self.compiled.get().map(Result::is_ok))
            .finish()
    }
}

impl ArgumentSchema {
    /// `pinned_schema`, compiled when first used.
    pub fn new(pinned_schema: Value) -> Self {
        ArgumentSchema {
            schema: pinned_schema,
            compiled: OnceLock::new(),
        }
    }

    /// Builds the arguments to send: the model's object (`null` counts as `{}`), with every
    /// pinned value written over it, validated against the schema.
    ///
    /// A violation at a pinned key names the key but never shows its value: pinned values are
    /// hidden from the model.
    pub fn prepare(
        &self,
        model_arguments: &Value,
        entry: &RosterEntry,
    ) -> Result<CanonicalArguments, ArgumentError> {
        let mut arguments = match model_arguments {
            Value::Object(map) => map.clone(),
            Value::Null => Map::new(),
            other => {
                return Err(ArgumentError::NotAnObject {
                    found: json_type(other),
                });
            }
        };
        for (key, value) in &entry.pinned {
            arguments.insert(key.clone(), value.clone());
        }
        let instance = Value::Object(arguments);

        let validator = self
            .compiled
            .get_or_init(|| compile(&self.schema))
            .as_ref()
            .map_err(|reason| ArgumentError::UnusableSchema {
                reason: reason.clone(),
            })?;
        let pinned_keys: BTreeSet<&String> = entry.pinned.keys().collect();
        let violations: Vec<SchemaViolation> = validator
            .iter_errors(&instance)
            .map(|error| {
                let path = error.instance_path().as_str().to_owned();
                let first = path.split('/').nth(1).map(unescape_pointer);
                let at_pinned = first.is_some_and(|key| pinned_keys.contains(&key));
                let message = if at_pinned {
                    error.masked().to_string()
                } else {
                    error.to_string()
                };
                SchemaViolation { path, message }
            })
            .collect();
        if !violations.is_empty() {
            return Err(ArgumentError::SchemaViolations { violations });
        }

        let Value::Object(value) = instance else {
            return Err(ArgumentError::NotAnObject { found: "unknown" });
        };
        let canonical_json = wor_core::canonical::to_canonical_json(&Value::Object(value.clone()));
        let hash = wor_core::canonical::sha256_hex(canonical_json.as_bytes());
        Ok(CanonicalArguments {
            value,
            canonical_json,
            hash,
            pinned_keys: pinned_keys.into_iter().cloned().collect(),
        })
    }
}

/// Compiles a tool's input schema as every call's arguments are checked against it: offline,
/// so a remote reference is an error rather than a fetch.
fn compile(schema: &Value) -> Result<jsonschema::Validator, String> {
    jsonschema::options()
        .offline()
        .build(schema)
        .map_err(|error| error.to_string())
}

/// Why an input schema written for a tool could check no call's arguments.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InputSchemaError {
    /// It does not compile (an invalid `pattern`, a keyword of the wrong type, a remote
    /// reference, ...).
    #[error("the input schema cannot be used: {0}")]
    Unusable(String),
    /// Its `type` leaves out `object`, which a call's arguments always are.
    #[error(
        "the input schema's `type` is {found}, but a call's arguments are an object: give `object` or leave `type` out"
    )]
    NotForObjects {
        /// The `type` as written.
        found: String,
    },
}

/// Checks a tool's input schema before it is stored, where a schema that cannot be used
/// would otherwise only refuse each call at the time it is made.
pub fn check_input_schema(schema: &Value) -> Result<(), InputSchemaError> {
    let allows_object = match schema.get("type") {
        None => true,
        Some(Value::String(kind)) => kind == "object",
        Some(Value::Array(kinds)) => kinds.iter().any(|kind| kind == "object"),
        Some(_) => true,
    };
    if !allows_object {
        let found = schema.get("type").map(Value::to_string).unwrap_or_default();
        return Err(InputSchemaError::NotForObjects { found });
    }
    compile(schema)
        .map(drop)
        .map_err(InputSchemaError::Unusable)
}

/// [`ArgumentSchema::prepare`] against `pinned_schema`, compiled for this one call.
pub fn prepare_arguments(
    model_arguments: &Value,
    entry: &RosterEntry,
    pinned_schema: &Value,
) -> Result<CanonicalArguments, ArgumentError> {
    ArgumentSchema::new(pinned_schema.clone()).prepare(model_arguments, entry)
}

fn unescape_pointer(segment: &str) -> String {
    segment.replace("~1", "/").replace("~0", "~")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::definition::ToolDefinition;
    use serde_json::json;
    use wor_core::routine::ToolMode;

    #[test]
    fn an_input_schema_that_could_check_no_calls_arguments_is_refused_before_it_is_stored() {
        for schema in [
            json!({}),
            json!({"type": "object", "properties": {"q": {"type": "string", "pattern": "^a+$"}}}),
            json!({"type": ["object", "null"]}),
        ] {
            assert_eq!(check_input_schema(&schema), Ok(()), "{schema}");
        }
        for schema in [json!({"type": "string"}), json!({"type": ["array"]})] {
            assert!(
                matches!(
                    check_input_schema(&schema),
                    Err(InputSchemaError::NotForObjects { .. })
                ),
                "{schema}"
            );
        }
        for schema in [
            json!({"properties": {"q": {"pattern": "(["}}}),
            json!({"properties": {"q": {"$ref": "https://example.com/s.json"}}}),
            json!({"required": "q"}),
        ] {
            assert!(
                matches!(
                    check_input_schema(&schema),
                    Err(InputSchemaError::Unusable(_))
                ),
                "{schema}"
            );
        }
    }

    fn schema() -> Value {
        json!({
            "type": "object",
            "properties": {
                "owner": {"type": "string"},
                "repo": {"type": "string"},
                "title": {"type": "string", "maxLength": 20},
                "labels": {"type": "array", "items": {"type": "string"}}
            },
            "required": ["owner", "repo", "title"],
            "additionalProperties": false
        })
    }

    fn entry() -> RosterEntry {
        RosterEntry {
            tool: "create_issue".into(),
            mode: ToolMode::Confirm,
            pinned: json!({"owner": "acme", "repo": "ops"})
                .as_object()
                .cloned()
                .unwrap()
                .into_iter()
                .collect(),
        }
    }

    fn pinned() -> PinnedToolDefinition {
        PinnedToolDefinition::pin(ToolDefinition {
            name: "create_issue".into(),
            description: Some("Opens an issue".into()),
            input_schema: schema().as_object().cloned().unwrap(),
            annotations: None,
        })
    }

    #[test]
    fn model_view_hides_pinned_arguments() {
        let view = model_view(&pinned(), &entry());
        assert_eq!(view.name, "create_issue");
        assert_eq!(view.description, "Opens an issue");
        assert_eq!(
            view.input_schema,
            json!({
                "type": "object",
                "properties": {
                    "title": {"type": "string", "maxLength": 20},
                    "labels": {"type": "array", "items": {"type": "string"}}
                },
                "required": ["title"],
                "additionalProperties": false
            })
        );
    }

    #[test]
    fn pinned_values_override_the_model() {
        let prepared = prepare_arguments(
            &json!({"owner": "attacker", "title": "hi"}),
            &entry(),
            &schema(),
        )
        .unwrap();
        assert_eq!(
            prepared.canonical_json,
            r#"{"owner":"acme","repo":"ops","title":"hi"}"#
        );
        assert_eq!(
            prepared.hash,
            wor_core::canonical::sha256_hex(prepared.canonical_json.as_bytes())
        );
        assert_eq!(prepared.pinned_keys, ["owner", "repo"]);
    }

    #[test]
    fn violations_are_clear_messages() {
        let error = prepare_arguments(
            &json!({"title": "this title is far too long", "labels": [1], "extra": true}),
            &entry(),
            &schema(),
        )
        .unwrap_err();
        let ArgumentError::SchemaViolations { violations } = &error else {
            panic!("{error:?}");
        };
        let paths: BTreeSet<&str> = violations.iter().map(|v| v.path.as_str()).collect();
        assert_eq!(paths, BTreeSet::from(["", "/labels/0", "/title"]));
        let message = error.to_string();
        assert!(message.starts_with("arguments do not match the input schema: "));
        assert!(
            message.contains("at `/labels/0`: 1 is not of type \"string\""),
            "{message}"
        );
        assert!(message.contains("extra"), "{message}");

        assert_eq!(
            prepare_arguments(&json!([1]), &entry(), &schema())
                .unwrap_err()
                .to_string(),
            "arguments must be a json object, got an array"
        );
    }

    #[test]
    fn a_schema_is_compiled_at_its_first_call_and_checks_every_later_one() {
        let checker = ArgumentSchema::new(schema());
        assert!(
            checker.compiled.get().is_none(),
            "nothing is compiled up front"
        );
        let good = json!({"owner": "o", "repo": "r", "title": "t"});
        assert_eq!(
            checker.prepare(&good, &entry()).unwrap(),
            prepare_arguments(&good, &entry(), &schema()).unwrap()
        );
        assert!(matches!(checker.compiled.get(), Some(Ok(_))));
        // The compiled schema still refuses what breaks it, call after call.
        for _ in 0..2 {
            assert!(matches!(
                checker.prepare(&json!({"title": 5}), &entry()),
                Err(ArgumentError::SchemaViolations { .. })
            ));
        }
        // One that cannot compile refuses every call with the same reason.
        let unusable = ArgumentSchema::new(json!({"$ref": "https://example.invalid/s.json"}));
        let first = unusable.prepare(&json!({}), &entry()).unwrap_err();
        assert!(
            matches!(first, ArgumentError::UnusableSchema { .. }),
            "{first:?}"
        );
        assert_eq!(unusable.prepare(&json!({}), &entry()).unwrap_err(), first);
    }

    #[test]
    fn a_bad_pinned_value_is_reported_without_showing_it() {
        let mut entry = entry();
        entry
            .pinned
            .insert("title".into(), json!("pinned-secret-looking-title-value"));
        let error = prepare_arguments(&json!({}), &entry, &schema()).unwrap_err();
        let message = error.to_string();
        assert!(message.contains("`/title`"), "{message}");
        assert!(!message.contains("pinned-secret-looking"), "{message}");
    }

    #[test]
    fn null_arguments_are_an_empty_object() {
        let entry = RosterEntry {
            tool: "t".into(),
            mode: ToolMode::Auto,
            pinned: Default::default(),
        };
        let prepared = prepare_arguments(&Value::Null, &entry, &json!({"type": "object"})).unwrap();
        assert_eq!(prepared.canonical_json, "{}");
    }

    #[test]
    fn a_remote_ref_is_unusable_not_fetched() {
        // No listener: a fetch would also fail, so the loopback test in tests/ counts requests.
        let schema = json!({"$ref": "https://schemas.example.com/args.json"});
        let error = prepare_arguments(&json!({}), &entry(), &schema).unwrap_err();
        assert!(
            matches!(error, ArgumentError::UnusableSchema { .. }),
            "{error:?}"
        );
    }

    /// The deepest a schema can arrive (an MCP message nests at most 128 levels) and the deepest
    /// arguments a model may send (64 levels), on a tokio worker's 2 MiB stack.
    #[test]
    fn deep_schemas_and_deep_arguments_validate_on_a_worker_stack() {
        let check = std::thread::Builder::new()
            .stack_size(2 << 20)
            .spawn(|| {
                let entry = RosterEntry {
                    tool: "deep".into(),
                    mode: ToolMode::Auto,
                    pinned: Default::default(),
                };
                // 60 nested object schemas: 120 levels of JSON.
                let nested = (0..60).fold(json!({"type": "integer"}), |inner, _| {
                    json!({"type": "object", "properties": {"a": inner}})
                });
                let deep_value = (0..59).fold(json!(1), |inner, _| json!({ "a": inner }));
                let ok = prepare_arguments(&json!({"a": deep_value}), &entry, &nested);
                assert!(ok.is_ok(), "{ok:?}");
                // A recursive schema walks the arguments as deep as they go.
                let recursive = json!({
                    "type": "object",
                    "$defs": {"node": {"anyOf": [{"type": "integer"}, {"type": "array", "items": {"$ref": "#/$defs/node"}}]}},
                    "properties": {"v": {"$ref": "#/$defs/node"}},
                });
                let deep_array = (0..62).fold(json!(1), |inner, _| json!([inner]));
                let ok = prepare_arguments(&json!({"v": deep_array}), &entry, &recursive);
                assert!(ok.is_ok(), "{ok:?}");
                let bad = (0..62).fold(json!("x"), |inner, _| json!([inner]));
                let refused = prepare_arguments(&json!({"v": bad}), &entry, &recursive);
                assert!(
                    matches!(refused, Err(ArgumentError::SchemaViolations { .. })),
                    "{refused:?}"
                );
            })
            .unwrap();
        check.join().unwrap();
    }
}
