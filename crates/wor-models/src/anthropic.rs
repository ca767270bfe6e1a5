//! The Anthropic Messages provider: `POST {base_url}/v1/messages`.
//!
//! The key goes in `x-api-key`, with `anthropic-version: 2023-06-01`. System messages are sent
//! as the top-level `system` text (joined by blank lines, wherever they stood); consecutive
//! messages of one role are merged into one turn, so the tool results answering parallel calls
//! travel together in one user turn, as the API requires. A streamed response is the event
//! sequence `message_start`, `content_block_start` / `content_block_delta` (`text_delta`,
//! `input_json_delta`) / `content_block_stop`, `message_delta` (stop reason, usage) and
//! `message_stop`; a stream that ends before `message_stop` is a
//! [`ModelError::TruncatedStream`]. Input tokens include cache creation and cache reads.
//! A routine's output schema is sent as `output_config.format` (JSON outputs) when it lies
//! within what Anthropic documents it can constrain to; a model that refuses it with a 400 is
//! asked once more without it.

use std::collections::BTreeMap;

use secrecy::ExposeSecret;
use serde::Deserialize;
use serde_json::{Map, Value, json};
use wor_core::model::{
    AssistantMessage, ChatMessage, ModelRequest, ModelResponse, ProviderKind, StopReason,
    ToolCallRequest, Usage,
};
use wor_egress::EgressClient;
use wor_egress::header::{HeaderName, HeaderValue};

use crate::error::ModelError;
use crate::sse::SseEvent;
use crate::transport::{
    ProviderEndpoint, ProviderOptions, StreamAssembler, json_headers, post_json, read_answer,
    secret_header,
};
use crate::{ModelFuture, ModelProvider, StreamSink, parse_json, parse_tool_arguments};

/// The API version this client speaks, sent as `anthropic-version`.
pub const ANTHROPIC_VERSION: &str = "2023-06-01";

/// A client of the Anthropic Messages API (or a gateway speaking it).
#[derive(Debug)]
pub struct AnthropicProvider {
    egress: EgressClient,
    endpoint: ProviderEndpoint,
    options: ProviderOptions,
}

impl AnthropicProvider {
    /// A provider sending through `egress` to `endpoint` (base URL without `/v1`).
    pub fn new(egress: EgressClient, endpoint: ProviderEndpoint, options: ProviderOptions) -> Self {
        Self {
            egress,
            endpoint,
            options,
        }
    }

    async fn complete_turn(
        &self,
        request: &ModelRequest,
        sink: &mut dyn StreamSink,
    ) -> Result<ModelResponse, ModelError> {
        let native = request
            .output_schema
            .as_ref()
            .and_then(native_output_schema);
        match self.send(request, native, sink).await {
            // A model without JSON outputs refuses the request with a 400 (before any text
            // was streamed): asked again without it, its answer is still checked by the engine.
            Err(ModelError::HttpStatus { status: 400, .. }) if native.is_some() => {
                self.send(request, None, sink).await
            }
            answer => answer,
        }
    }

    async fn send(
        &self,
        request: &ModelRequest,
        output_schema: Option<&Value>,
        sink: &mut dyn StreamSink,
    ) -> Result<ModelResponse, ModelError> {
        let streaming = self.options.streaming;
        let mut body = request_body(request, streaming);
        if let (Some(schema), Some(map)) = (output_schema, body.as_object_mut()) {
            map.insert(
                "output_config".into(),
                json!({"format": {"type": "json_schema", "schema": schema}}),
            );
        }
        let body =
            serde_json::to_vec(&body).map_err(|e| ModelError::InvalidRequest(e.to_string()))?;
        let mut headers = json_headers(streaming);
        headers.insert(
            HeaderName::from_static("anthropic-version"),
            HeaderValue::from_static(ANTHROPIC_VERSION),
        );
        if let Some(key) = &self.endpoint.api_key {
            headers.insert(
                HeaderName::from_static("x-api-key"),
                secret_header(key.expose_secret())?,
            );
        }
        let url = self.endpoint.url("v1/messages");
        let response = post_json(
            &self.egress,
            &self.endpoint,
            &self.options,
            &url,
            headers,
            body,
        )
        .await?;
        read_answer::<MessageStream>(response, streaming, &self.endpoint, sink, |body| {
            parse_json::<WireMessage>("message", body)?.into_response()
        })
        .await
    }
}

impl ModelProvider for AnthropicProvider {
    fn kind(&self) -> ProviderKind {
        ProviderKind::Anthropic
    }

    fn complete<'a>(
        &'a self,
        request: &'a ModelRequest,
        sink: &'a mut dyn StreamSink,
    ) -> ModelFuture<'a> {
        Box::pin(self.complete_turn(request, sink))
    }
}

/// The Messages request body for `request`, without the output schema (which
/// [`native_output_schema`] decides on, as `output_config`).
pub fn request_body(request: &ModelRequest, streaming: bool) -> Value {
    let mut system = Vec::new();
    // (role, content blocks), consecutive same-role messages merged.
    let mut turns: Vec<(&str, Vec<Value>)> = Vec::new();
    for message in &request.messages {
        let (role, blocks) = match message {
            ChatMessage::System { content } => {
                system.push(content.as_str());
                continue;
            }
            ChatMessage::User { content } => {
                ("user", vec![json!({"type": "text", "text": content})])
            }
            ChatMessage::Assistant(assistant) => {
                let mut blocks = Vec::new();
                if !assistant.text.is_empty() {
                    blocks.push(json!({"type": "text", "text": assistant.text}));
                }
                for call in &assistant.tool_calls {
                    blocks.push(json!({
                        "type": "tool_use",
                        "id": call.id,
                        "name": call.name,
                        "input": call.arguments,
                    }));
                }
                ("assistant", blocks)
            }
            ChatMessage::Tool(result) => (
                "user",
                vec![json!({
                    "type": "tool_result",
                    "tool_use_id": result.tool_call_id,
                    "content": result.content,
                    "is_error": result.is_error,
                })],
            ),
        };
        match turns.last_mut() {
            Some((last_role, last_blocks)) if *last_role == role => last_blocks.extend(blocks),
            _ => turns.push((role, blocks)),
        }
    }
    let mut body = Map::new();
    body.insert("model".into(), json!(request.model));
    body.insert("max_tokens".into(), json!(request.max_output_tokens));
    if !system.is_empty() {
        body.insert("system".into(), json!(system.join("\n\n")));
    }
    let messages = turns
        .into_iter()
        .map(|(role, content)| json!({"role": role, "content": content}))
        .collect();
    body.insert("messages".into(), Value::Array(messages));
    if let Some(temperature) = request.temperature {
        body.insert("temperature".into(), json!(temperature));
    }
    if !request.tools.is_empty() {
        let tools = request
            .tools
            .iter()
            .map(|tool| {
                json!({
                    "name": tool.name,
                    "description": tool.description,
                    "input_schema": tool.input_schema,
                })
            })
            .collect();
        body.insert("tools".into(), Value::Array(tools));
    }
    if streaming {
        body.insert("stream".into(), Value::Bool(true));
    }
    Value::Object(body)
}

/// Keywords Anthropic's JSON outputs accept, from its documented JSON Schema limits
/// (`additionalProperties` only as `false`, `minItems` only 0 or 1, `enum` of plain values).
const NATIVE_KEYWORDS: &[&str] = &[
    "type",
    "title",
    "description",
    "enum",
    "const",
    "default",
    "properties",
    "required",
    "additionalProperties",
    "items",
    "minItems",
    "anyOf",
    "allOf",
    "format",
    "pattern",
];

/// Bounds the walk over a schema; a larger schema is not sent natively.
const NATIVE_SCHEMA_NODES: usize = 10_000;

/// `schema` when Anthropic can constrain its answer to it: only [`NATIVE_KEYWORDS`], every
/// object closed (`additionalProperties: false`), no `$ref` (its recursion is refused). A
/// schema outside that is not sent: the engine's check of the answer holds either way.
pub fn native_output_schema(schema: &Value) -> Option<&Value> {
    let mut stack = vec![schema];
    let mut seen = 0usize;
    while let Some(node) = stack.pop() {
        seen += 1;
        if seen > NATIVE_SCHEMA_NODES {
            return None;
        }
        let map = match node {
            Value::Object(map) => map,
            Value::Bool(true) => continue,
            _ => return None,
        };
        let is_object = map.contains_key("properties")
            || match map.get("type") {
                Some(Value::String(t)) => t == "object",
                Some(Value::Array(types)) => types.iter().any(|t| t == "object"),
                _ => false,
            };
        if is_object && map.get("additionalProperties") != Some(&Value::Bool(false)) {
            return None;
        }
        for (keyword, value) in map {
            if !NATIVE_KEYWORDS.contains(&keyword.as_str()) {
                return None;
            }
            match (keyword.as_str(), value) {
                ("properties", Value::Object(properties)) => stack.extend(properties.values()),
                ("items", items) => stack.push(items),
                ("anyOf" | "allOf", Value::Array(branches)) => stack.extend(branches),
                ("additionalProperties", Value::Bool(false)) => {}
                ("minItems", n) if n.as_u64().is_some_and(|n| n <= 1) => {}
                ("enum", Value::Array(values))
                    if values.iter().all(|v| !v.is_object() && !v.is_array()) => {}
                (
                    "type" | "title" | "description" | "const" | "default" | "required" | "format"
                    | "pattern",
                    _,
                ) => {}
                _ => return None,
            }
        }
    }
    Some(schema)
}

fn stop_reason(reason: Option<&str>, has_tool_calls: bool) -> StopReason {
    match reason {
        Some("end_turn") => StopReason::EndTurn,
        Some("tool_use") => StopReason::ToolUse,
        Some("max_tokens") => StopReason::MaxTokens,
        Some(other) => StopReason::Other(other.to_owned()),
        None if has_tool_calls => StopReason::ToolUse,
        None => StopReason::EndTurn,
    }
}

#[derive(Debug, Default, Deserialize)]
struct WireUsage {
    input_tokens: Option<u64>,
    output_tokens: Option<u64>,
    cache_creation_input_tokens: Option<u64>,
    cache_read_input_tokens: Option<u64>,
}

impl WireUsage {
    /// Input tokens of every kind, if the provider reported any.
    fn input(&self) -> Option<u64> {
        let parts = [
            self.input_tokens,
            self.cache_creation_input_tokens,
            self.cache_read_input_tokens,
        ];
        parts.iter().any(Option::is_some).then(|| {
            parts
                .iter()
                .flatten()
                .fold(0u64, |sum, n| sum.saturating_add(*n))
        })
    }
}

#[derive(Debug, Deserialize)]
struct WireMessage {
    content: Vec<WireBlock>,
    stop_reason: Option<String>,
    #[serde(default)]
    usage: WireUsage,
}

#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum WireBlock {
    Text {
        text: String,
    },
    ToolUse {
        id: String,
        name: String,
        input: Value,
    },
    #[serde(other)]
    Other,
}

impl WireMessage {
    fn into_response(self) -> Result<ModelResponse, ModelError> {
        let mut text = String::new();
        let mut tool_calls = Vec::new();
        for block in self.content {
            match block {
                WireBlock::Text { text: part } => text.push_str(&part),
                WireBlock::ToolUse { id, name, input } => tool_calls.push(ToolCallRequest {
                    id,
                    name,
                    arguments: input,
                    thought_signature: None,
                }),
                WireBlock::Other => {}
            }
        }
        let stop_reason = stop_reason(self.stop_reason.as_deref(), !tool_calls.is_empty());
        Ok(ModelResponse {
            message: AssistantMessage { text, tool_calls },
            stop_reason,
            usage: Usage {
                input_tokens: self.usage.input().unwrap_or_default(),
                output_tokens: self.usage.output_tokens.unwrap_or_default(),
            },
        })
    }
}

#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum StreamEvent {
    MessageStart {
        message: StartMessage,
    },
    ContentBlockStart {
        index: u64,
        content_block: StartBlock,
    },
    ContentBlockDelta {
        index: u64,
        delta: BlockDelta,
    },
    MessageDelta {
        delta: MessageDeltaBody,
        #[serde(default)]
        usage: WireUsage,
    },
    MessageStop,
    Error {
        error: StreamErrorBody,
    },
    /// `ping`, `content_block_stop` and event types added later.
    #[serde(other)]
    Ignored,
}

#[derive(Debug, Deserialize)]
struct StartMessage {
    #[serde(default)]
    usage: WireUsage,
}

#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum StartBlock {
    Text {
        #[serde(default)]
        text: String,
    },
    ToolUse {
        id: String,
        name: String,
    },
    #[serde(other)]
    Other,
}

#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum BlockDelta {
    TextDelta {
        text: String,
    },
    InputJsonDelta {
        partial_json: String,
    },
    #[serde(other)]
    Other,
}

#[derive(Debug, Deserialize)]
struct MessageDeltaBody {
    stop_reason: Option<String>,
}

#[derive(Debug, Deserialize)]
struct StreamErrorBody {
    #[serde(rename = "type", default)]
    kind: String,
    #[serde(default)]
    message: String,
}

/// A content block being assembled.
#[derive(Debug)]
enum PartialBlock {
    Text(String),
    ToolUse {
        id: String,
        name: String,
        input_json: String,
    },
    Other,
}

/// The state of one streamed message.
#[derive(Debug, Default)]
struct MessageStream {
    started: bool,
    blocks: BTreeMap<u64, PartialBlock>,
    stop_reason: Option<String>,
    usage: Usage,
    stopped: bool,
}

impl StreamAssembler for MessageStream {
    fn finish(self) -> Result<ModelResponse, ModelError> {
        self.assemble()
    }

    fn usage_so_far(&self) -> Usage {
        self.usage
    }

    fn event(&mut self, event: &SseEvent, sink: &mut dyn StreamSink) -> Result<(), ModelError> {
        if self.stopped {
            return Ok(());
        }
        let parsed: StreamEvent = parse_json("message stream event", event.data.as_bytes())?;
        match parsed {
            StreamEvent::MessageStart { message } => {
                self.started = true;
                self.record_usage(&message.usage);
            }
            StreamEvent::ContentBlockStart {
                index,
                content_block,
            } => {
                self.require_start()?;
                let block = match content_block {
                    StartBlock::Text { text } => {
                        if !text.is_empty() {
                            sink.text_delta(&text);
                        }
                        PartialBlock::Text(text)
                    }
                    StartBlock::ToolUse { id, name } => {
                        sink.tool_call_started(&name);
                        PartialBlock::ToolUse {
                            id,
                            name,
                            input_json: String::new(),
                        }
                    }
                    StartBlock::Other => PartialBlock::Other,
                };
                self.blocks.insert(index, block);
            }
            StreamEvent::ContentBlockDelta { index, delta } => {
                self.require_start()?;
                let block = self.blocks.get_mut(&index).ok_or_else(|| {
                    ModelError::malformed(format!(
                        "delta for content block {index} before its start"
                    ))
                })?;
                match (block, delta) {
                    (PartialBlock::Text(text), BlockDelta::TextDelta { text: part }) => {
                        sink.text_delta(&part);
                        text.push_str(&part);
                    }
                    (
                        PartialBlock::ToolUse { input_json, .. },
                        BlockDelta::InputJsonDelta { partial_json },
                    ) => input_json.push_str(&partial_json),
                    (PartialBlock::Other, _) | (_, BlockDelta::Other) => {}
                    _ => {
                        return Err(ModelError::malformed(format!(
                            "delta of the wrong kind for content block {index}"
                        )));
                    }
                }
            }
            StreamEvent::MessageDelta { delta, usage } => {
                self.require_start()?;
                if delta.stop_reason.is_some() {
                    self.stop_reason = delta.stop_reason;
                }
                self.record_usage(&usage);
            }
            StreamEvent::MessageStop => {
                self.require_start()?;
                self.stopped = true;
            }
            StreamEvent::Error { error } => {
                // Whole: `read_answer` redacts the key from it, then cuts it.
                return Err(ModelError::StreamError(format!(
                    "{}: {}",
                    error.kind, error.message
                )));
            }
            StreamEvent::Ignored => {}
        }
        Ok(())
    }
}

impl MessageStream {
    fn require_start(&self) -> Result<(), ModelError> {
        if self.started {
            Ok(())
        } else {
            Err(ModelError::malformed(
                "message stream event before message_start",
            ))
        }
    }

    /// Usage counts in the stream are cumulative: a later report replaces an earlier one.
    fn record_usage(&mut self, usage: &WireUsage) {
        if let Some(input) = usage.input() {
            self.usage.input_tokens = input;
        }
        if let Some(output) = usage.output_tokens {
            self.usage.output_tokens = output;
        }
    }

    fn assemble(self) -> Result<ModelResponse, ModelError> {
        if !self.stopped {
            return Err(ModelError::TruncatedStream {
                usage_so_far: self.usage,
            });
        }
        let mut text = String::new();
        let mut tool_calls = Vec::new();
        for block in self.blocks.into_values() {
            match block {
                PartialBlock::Text(part) => text.push_str(&part),
                PartialBlock::ToolUse {
                    id,
                    name,
                    input_json,
                } => {
                    let arguments = parse_tool_arguments(&name, &input_json)?;
                    tool_calls.push(ToolCallRequest {
                        id,
                        name,
                        arguments,
                        thought_signature: None,
                    });
                }
                PartialBlock::Other => {}
            }
        }
        let stop_reason = stop_reason(self.stop_reason.as_deref(), !tool_calls.is_empty());
        Ok(ModelResponse {
            message: AssistantMessage { text, tool_calls },
            stop_reason,
            usage: self.usage,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use wor_core::model::ToolResult;

    #[test]
    fn system_is_separate_and_parallel_results_share_one_user_turn() {
        let request = ModelRequest {
            model: "m".into(),
            messages: vec![
                ChatMessage::system("rule one"),
                ChatMessage::user("go"),
                ChatMessage::Assistant(AssistantMessage {
                    text: String::new(),
                    tool_calls: vec![
                        ToolCallRequest {
                            id: "a".into(),
                            name: "t".into(),
                            arguments: json!({}),
                            thought_signature: None,
                        },
                        ToolCallRequest {
                            id: "b".into(),
                            name: "t".into(),
                            arguments: json!({"k": 1}),
                            thought_signature: None,
                        },
                    ],
                }),
                ChatMessage::Tool(ToolResult {
                    tool_call_id: "a".into(),
                    content: "ra".into(),
                    is_error: false,
                }),
                ChatMessage::Tool(ToolResult {
                    tool_call_id: "b".into(),
                    content: "rb".into(),
                    is_error: true,
                }),
                ChatMessage::system("rule two"),
            ],
            tools: Vec::new(),
            max_output_tokens: 10,
            temperature: None,
            output_schema: None,
        };
        let body = request_body(&request, false);
        assert_eq!(body.get("system"), Some(&json!("rule one\n\nrule two")));
        assert_eq!(body.get("stream"), None);
        assert_eq!(
            body.get("messages"),
            Some(&json!([
                {"role": "user", "content": [{"type": "text", "text": "go"}]},
                {"role": "assistant", "content": [
                    {"type": "tool_use", "id": "a", "name": "t", "input": {}},
                    {"type": "tool_use", "id": "b", "name": "t", "input": {"k": 1}},
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "a", "content": "ra", "is_error": false},
                    {"type": "tool_result", "tool_use_id": "b", "content": "rb", "is_error": true},
                ]},
            ]))
        );
    }

    #[test]
    fn only_a_schema_within_anthropics_limits_is_sent_natively() {
        let closed = json!({
            "type": "object",
            "required": ["severity", "tags"],
            "additionalProperties": false,
            "properties": {
                "severity": {"enum": ["low", "high"]},
                "tags": {"type": "array", "minItems": 1, "items": {"type": "string", "format": "uuid"}},
                "owner": {"anyOf": [{"type": "null"}, {
                    "type": "object", "additionalProperties": false,
                    "properties": {"name": {"type": "string", "description": "who"}},
                }]},
            },
        });
        assert_eq!(native_output_schema(&closed), Some(&closed));
        assert_eq!(
            native_output_schema(&json!({"type": "string"})),
            Some(&json!({"type": "string"}))
        );
        for outside in [
            // An object that may have other properties.
            json!({"type": "object", "properties": {"a": {"type": "string"}}}),
            json!({"type": "object", "additionalProperties": {"type": "string"}}),
            // Nested, too.
            json!({"type": "object", "additionalProperties": false, "properties": {
                "inner": {"properties": {"b": {"type": "string"}}},
            }}),
            // Constraints it does not enforce.
            json!({"type": "integer", "minimum": 1}),
            json!({"type": "string", "maxLength": 10}),
            json!({"type": "array", "minItems": 2}),
            json!({"type": "array", "maxItems": 2}),
            json!({"oneOf": [{"type": "string"}, {"type": "null"}]}),
            // References (a recursive one is refused) and enums of objects.
            json!({"$defs": {"n": {"type": "string"}}, "$ref": "#/$defs/n"}),
            json!({"enum": [{"a": 1}]}),
            json!({"not": {"type": "string"}}),
        ] {
            assert_eq!(native_output_schema(&outside), None, "{outside}");
        }
    }

    #[test]
    fn events_before_message_start_are_malformed() {
        let mut stream = MessageStream::default();
        let err = stream
            .event(
                &SseEvent {
                    event: Some("content_block_delta".into()),
                    data: r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"x"}}"#.into(),
                },
                &mut crate::DiscardStream,
            )
            .unwrap_err();
        assert!(err.to_string().contains("before message_start"), "{err}");
    }
}
