//! A routine's output schema (`[output] schema`): compiled once, offline (a `$ref` to another
//! document is an error, never a fetch), and used to check a model's final answer.
//!
//! The answer is the model's text; it must be JSON matching the schema, alone or inside one
//! fenced code block (models often fence JSON). A violation names the place and the rule but
//! quotes none of the answer beyond what the validator says of the failing value.

use serde_json::Value;

/// A compiled output schema.
#[derive(Debug)]
pub struct OutputSchema {
    validator: jsonschema::Validator,
}

/// Why an output schema cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`output.schema` cannot be used: {reason}")]
pub struct OutputSchemaError {
    /// What the compiler said.
    pub reason: String,
}

/// Why an answer is not the routine's output.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OutputViolation {
    /// The answer is not JSON.
    #[error("the answer is not JSON ({0})")]
    NotJson(String),
    /// The JSON does not match the schema.
    #[error("the answer does not match the output schema: {0}")]
    Schema(String),
}

impl OutputSchema {
    /// Compiles `schema` without any retriever and with at most
    /// [`MAX_JSON_NESTING`](wor_core::json_depth::MAX_JSON_NESTING) levels.
    pub fn compile(schema: &Value) -> Result<Self, OutputSchemaError> {
        if wor_core::json_depth::value_nesting(schema) > wor_core::json_depth::MAX_JSON_NESTING {
            return Err(OutputSchemaError {
                reason: format!(
                    "it nests deeper than {} levels",
                    wor_core::json_depth::MAX_JSON_NESTING
                ),
            });
        }
        let validator =
            jsonschema::options()
                .offline()
                .build(schema)
                .map_err(|e| OutputSchemaError {
                    reason: e.to_string(),
                })?;
        Ok(Self { validator })
    }

    /// The JSON the answer holds, when it matches the schema.
    pub fn check(&self, answer: &str) -> Result<Value, OutputViolation> {
        let text = unfenced(answer.trim());
        let value: Value = serde_json::from_str(text).map_err(|e| {
            OutputViolation::NotJson(format!("line {} column {}", e.line(), e.column()))
        })?;
        if wor_core::json_depth::value_nesting(&value) > wor_core::json_depth::MAX_JSON_NESTING {
            return Err(OutputViolation::Schema(format!(
                "it nests deeper than {} levels",
                wor_core::json_depth::MAX_JSON_NESTING
            )));
        }
        let violations: Vec<String> = self
            .validator
            .iter_errors(&value)
            .take(5)
            .map(|error| {
                let path = error.instance_path().as_str().to_owned();
                if path.is_empty() {
                    error.to_string()
                } else {
                    format!("at `{path}`: {error}")
                }
            })
            .collect();
        if violations.is_empty() {
            Ok(value)
        } else {
            Err(OutputViolation::Schema(violations.join("; ")))
        }
    }
}

/// The inside of one fenced code block (```` ```json … ``` ````), or the text as it is.
fn unfenced(text: &str) -> &str {
    let Some(rest) = text.strip_prefix("```") else {
        return text;
    };
    let Some(body) = rest.strip_suffix("```") else {
        return text;
    };
    // Drop the info string (`json`) on the opening line.
    match body.split_once('\n') {
        Some((_, inner)) => inner.trim(),
        None => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn schema() -> OutputSchema {
        OutputSchema::compile(&json!({
            "type": "object",
            "required": ["severity", "summary"],
            "properties": {
                "severity": {"enum": ["low", "high"]},
                "summary": {"type": "string", "maxLength": 80}
            },
            "additionalProperties": false
        }))
        .unwrap()
    }

    #[test]
    fn a_matching_answer_is_its_json_fenced_or_not() {
        let expected = json!({"severity": "low", "summary": "disk almost full"});
        for answer in [
            r#"{"severity": "low", "summary": "disk almost full"}"#,
            "```json\n{\"severity\": \"low\", \"summary\": \"disk almost full\"}\n```",
            "  ```\n{\"severity\":\"low\",\"summary\":\"disk almost full\"}```  ",
        ] {
            assert_eq!(schema().check(answer), Ok(expected.clone()), "{answer}");
        }
    }

    #[test]
    fn violations_name_the_place_and_the_rule() {
        let err = schema()
            .check(r#"{"severity": "urgent", "summary": "x", "extra": 1}"#)
            .unwrap_err();
        let text = err.to_string();
        assert!(text.contains("at `/severity`"), "{text}");
        assert!(text.contains("Additional properties"), "{text}");
        assert!(matches!(
            schema().check("The disk is almost full."),
            Err(OutputViolation::NotJson(_))
        ));
    }

    #[test]
    fn remote_refs_and_deep_schemas_are_refused_when_compiled() {
        let remote =
            OutputSchema::compile(&json!({"$ref": "https://schemas.example.com/out.json"}));
        assert!(remote.is_err());
        let mut deep = json!({"type": "string"});
        for _ in 0..70 {
            deep = json!({"type": "array", "items": deep});
        }
        let err = OutputSchema::compile(&deep).unwrap_err();
        assert!(err.reason.contains("deeper than 64"), "{err}");
        let local = OutputSchema::compile(&json!({
            "$defs": {"s": {"type": "string"}},
            "properties": {"a": {"$ref": "#/$defs/s"}}
        }));
        assert!(local.is_ok());
    }
}
