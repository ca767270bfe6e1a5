//! The OpenAI-compatible chat-completions provider: `POST {base_url}/chat/completions`.
//!
//! Works with OpenAI and the servers that speak its format (vLLM, Ollama, llama.cpp server,
//! LiteLLM, gateways). Tools are sent as `function` tools; the model may call several in
//! parallel. Streamed responses are `data:` events ending in `data: [DONE]`; tool-call argument
//! fragments arrive keyed by `index` and are assembled here; usage comes in a last chunk because
//! the request sets `stream_options.include_usage`. A stream that ends before `[DONE]` is a
//! [`ModelError::TruncatedStream`].
//!
//! The wire format has no error flag on tool results, so a failed tool result is sent with its
//! content prefixed by `error: `.

use std::collections::BTreeMap;

use secrecy::ExposeSecret;
use serde::Deserialize;
use serde_json::{Map, Value, json};
use wor_core::model::{
    AssistantMessage, ChatMessage, ModelRequest, ModelResponse, ProviderKind, StopReason,
    ToolCallRequest, Usage,
};
use wor_egress::EgressClient;
use wor_egress::header::{AUTHORIZATION, HeaderName, HeaderValue};

use crate::error::ModelError;
use crate::sse::SseEvent;
use crate::transport::{
    ProviderEndpoint, ProviderOptions, StreamAssembler, json_headers, post_json, read_answer,
    secret_header,
};
use crate::{ModelFuture, ModelProvider, StreamSink, parse_json, parse_tool_arguments};

/// A client of one OpenAI-compatible endpoint.
#[derive(Debug)]
pub struct OpenAiCompatibleProvider {
    egress: EgressClient,
    endpoint: ProviderEndpoint,
    options: ProviderOptions,
}

impl OpenAiCompatibleProvider {
    /// A provider sending through `egress` to `endpoint`.
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
        let url = self.endpoint.url("chat/completions");
        let body = request_body(request, self.options.streaming);
        // The key becomes a header only now, as the request is sent.
        let auth = match &self.endpoint.api_key {
            Some(key) => Some((
                AUTHORIZATION,
                secret_header(&format!("Bearer {}", key.expose_secret()))?,
            )),
            None => None,
        };
        exchange(
            &self.egress,
            &self.endpoint,
            &self.options,
            &url,
            body,
            auth,
            sink,
        )
        .await
    }
}

/// Sends one chat-completions `body` to `url` with the `auth` header and reads the answer,
/// streamed or whole: the exchange the OpenAI-compatible and Azure OpenAI providers share.
pub(crate) async fn exchange(
    egress: &EgressClient,
    endpoint: &ProviderEndpoint,
    options: &ProviderOptions,
    url: &str,
    body: Value,
    auth: Option<(HeaderName, HeaderValue)>,
    sink: &mut dyn StreamSink,
) -> Result<ModelResponse, ModelError> {
    let streaming = options.streaming;
    let body = serde_json::to_vec(&body).map_err(|e| ModelError::InvalidRequest(e.to_string()))?;
    let mut headers = json_headers(streaming);
    if let Some((name, value)) = auth {
        headers.insert(name, value);
    }
    let response = post_json(egress, endpoint, options, url, headers, body).await?;
    read_answer::<ChatStream>(response, streaming, endpoint, sink, |body| {
        parse_json::<Completion>("chat completion", body)?.into_response()
    })
    .await
}

impl ModelProvider for OpenAiCompatibleProvider {
    fn kind(&self) -> ProviderKind {
        ProviderKind::OpenaiCompatible
    }

    fn complete<'a>(
        &'a self,
        request: &'a ModelRequest,
        sink: &'a mut dyn StreamSink,
    ) -> ModelFuture<'a> {
        Box::pin(self.complete_turn(request, sink))
    }
}

/// The chat-completions request body for `request`.
pub fn request_body(request: &ModelRequest, streaming: bool) -> Value {
    let mut body = Map::new();
    body.insert("model".into(), json!(request.model));
    body.insert(
        "messages".into(),
        Value::Array(request.messages.iter().map(message_json).collect()),
    );
    body.insert("max_tokens".into(), json!(request.max_output_tokens));
    if let Some(temperature) = request.temperature {
        body.insert("temperature".into(), json!(temperature));
    }
    if !request.tools.is_empty() {
        let tools = request
            .tools
            .iter()
            .map(|tool| {
                json!({
                    "type": "function",
                    "function": {
                        "name": tool.name,
                        "description": tool.description,
                        "parameters": tool.input_schema,
                    }
                })
            })
            .collect();
        body.insert("tools".into(), Value::Array(tools));
    }
    if let Some(schema) = &request.output_schema {
        // Structured output: the answer is constrained to the schema where the server supports
        // it; not strict, since strict mode refuses schemas outside OpenAI's subset.
        body.insert(
            "response_format".into(),
            json!({
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": schema, "strict": false},
            }),
        );
    }
    if streaming {
        body.insert("stream".into(), Value::Bool(true));
        body.insert("stream_options".into(), json!({"include_usage": true}));
    }
    Value::Object(body)
}

fn message_json(message: &ChatMessage) -> Value {
    match message {
        ChatMessage::System { content } => json!({"role": "system", "content": content}),
        ChatMessage::User { content } => json!({"role": "user", "content": content}),
        ChatMessage::Assistant(assistant) => {
            let mut object = Map::new();
            object.insert("role".into(), json!("assistant"));
            object.insert(
                "content".into(),
                if assistant.text.is_empty() {
                    Value::Null
                } else {
                    json!(assistant.text)
                },
            );
            if !assistant.tool_calls.is_empty() {
                let calls = assistant
                    .tool_calls
                    .iter()
                    .map(|call| {
                        json!({
                            "id": call.id,
                            "type": "function",
                            "function": {
                                "name": call.name,
                                "arguments": call.arguments.to_string(),
                            }
                        })
                    })
                    .collect();
                object.insert("tool_calls".into(), Value::Array(calls));
            }
            Value::Object(object)
        }
        ChatMessage::Tool(result) => {
            let content = if result.is_error {
                format!("error: {}", result.content)
            } else {
                result.content.clone()
            };
            json!({"role": "tool", "tool_call_id": result.tool_call_id, "content": content})
        }
    }
}

/// Why the turn ended. Some servers (Ollama among them) say `stop` on a turn that called tools:
/// a turn with tool calls is a tool-use turn whatever the reason says.
fn stop_reason(finish_reason: Option<&str>, has_tool_calls: bool) -> StopReason {
    match finish_reason {
        Some("stop") if has_tool_calls => StopReason::ToolUse,
        Some("stop") => StopReason::EndTurn,
        Some("tool_calls" | "function_call") => StopReason::ToolUse,
        Some("length") => StopReason::MaxTokens,
        Some(other) => StopReason::Other(other.to_owned()),
        None if has_tool_calls => StopReason::ToolUse,
        None => StopReason::EndTurn,
    }
}

#[derive(Debug, Deserialize)]
struct WireUsage {
    #[serde(default)]
    prompt_tokens: u64,
    #[serde(default)]
    completion_tokens: u64,
}

impl From<WireUsage> for Usage {
    fn from(usage: WireUsage) -> Self {
        Usage {
            input_tokens: usage.prompt_tokens,
            output_tokens: usage.completion_tokens,
        }
    }
}

/// llama.cpp server's own counters, which some of its builds send instead of `usage`.
#[derive(Debug, Deserialize)]
struct WireTimings {
    #[serde(default)]
    prompt_n: u64,
    #[serde(default)]
    predicted_n: u64,
}

impl From<WireTimings> for Usage {
    fn from(timings: WireTimings) -> Self {
        Usage {
            input_tokens: timings.prompt_n,
            output_tokens: timings.predicted_n,
        }
    }
}

#[derive(Debug, Deserialize)]
struct Completion {
    choices: Vec<Choice>,
    usage: Option<WireUsage>,
    timings: Option<WireTimings>,
}

#[derive(Debug, Deserialize)]
struct Choice {
    message: WireMessage,
    finish_reason: Option<String>,
}

#[derive(Debug, Deserialize)]
struct WireMessage {
    content: Option<String>,
    #[serde(default)]
    tool_calls: Vec<WireToolCall>,
}

#[derive(Debug, Deserialize)]
struct WireToolCall {
    #[serde(default)]
    id: String,
    function: WireFunction,
}

#[derive(Debug, Deserialize)]
struct WireFunction {
    name: String,
    #[serde(default)]
    arguments: WireArguments,
}

/// Tool-call arguments: JSON text as the format says, or (from some local servers) the JSON
/// object itself.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum WireArguments {
    Text(String),
    Object(Map<String, Value>),
}

impl Default for WireArguments {
    fn default() -> Self {
        Self::Text(String::new())
    }
}

impl WireArguments {
    fn into_text(self) -> String {
        match self {
            Self::Text(text) => text,
            Self::Object(object) => Value::Object(object).to_string(),
        }
    }
}

impl Completion {
    fn into_response(self) -> Result<ModelResponse, ModelError> {
        let choice = self
            .choices
            .into_iter()
            .next()
            .ok_or_else(|| ModelError::malformed("chat completion has no choices"))?;
        let tool_calls = choice
            .message
            .tool_calls
            .into_iter()
            .enumerate()
            .map(|(position, call)| {
                tool_call(
                    call.id,
                    call.function.name,
                    &call.function.arguments.into_text(),
                    position,
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        let stop_reason = stop_reason(choice.finish_reason.as_deref(), !tool_calls.is_empty());
        Ok(ModelResponse {
            message: AssistantMessage {
                text: choice.message.content.unwrap_or_default(),
                tool_calls,
            },
            stop_reason,
            usage: self
                .usage
                .map(Usage::from)
                .or(self.timings.map(Usage::from))
                .unwrap_or_default(),
        })
    }
}

/// A tool call from its wire parts; a server that sends no id gets a positional one.
fn tool_call(
    id: String,
    name: String,
    arguments: &str,
    position: usize,
) -> Result<ToolCallRequest, ModelError> {
    if name.is_empty() {
        return Err(ModelError::malformed(format!(
            "tool call {position} has no function name"
        )));
    }
    let arguments = parse_tool_arguments(&name, arguments)?;
    let id = if id.is_empty() {
        format!("call_{position}")
    } else {
        id
    };
    Ok(ToolCallRequest {
        id,
        name,
        arguments,
        thought_signature: None,
    })
}

#[derive(Debug, Deserialize)]
struct Chunk {
    #[serde(default)]
    choices: Vec<ChunkChoice>,
    usage: Option<WireUsage>,
    timings: Option<WireTimings>,
    error: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct ChunkChoice {
    #[serde(default)]
    index: u32,
    delta: Option<Delta>,
    finish_reason: Option<String>,
}

#[derive(Debug, Deserialize)]
struct Delta {
    content: Option<String>,
    #[serde(default)]
    tool_calls: Vec<DeltaToolCall>,
}

#[derive(Debug, Deserialize)]
struct DeltaToolCall {
    index: Option<u64>,
    id: Option<String>,
    function: Option<DeltaFunction>,
}

#[derive(Debug, Deserialize)]
struct DeltaFunction {
    name: Option<String>,
    arguments: Option<WireArguments>,
}

/// A tool call being assembled from deltas.
#[derive(Debug, Default)]
struct PartialToolCall {
    id: String,
    name: String,
    arguments: String,
}

/// The state of one streamed completion.
#[derive(Debug, Default)]
struct ChatStream {
    text: String,
    tool_calls: BTreeMap<u64, PartialToolCall>,
    finish_reason: Option<String>,
    usage: Option<Usage>,
    /// From llama.cpp's `timings`, used only when no `usage` came.
    timings: Option<Usage>,
    done: bool,
}

impl ChatStream {
    /// Where a tool-call fragment without an `index` belongs (servers that send each call
    /// whole, such as Ollama, may leave it out): a new id starts a new call, no id or a known
    /// one continues the last.
    fn index_without_one(&self, id: Option<&str>) -> u64 {
        let last = self.tool_calls.last_key_value().map(|(index, _)| *index);
        match (id.filter(|id| !id.is_empty()), last) {
            (_, None) => 0,
            (Some(id), Some(last)) => {
                match self.tool_calls.iter().find(|(_, call)| call.id == id) {
                    Some((index, _)) => *index,
                    None => last.saturating_add(1),
                }
            }
            (None, Some(last)) => last,
        }
    }
}

impl StreamAssembler for ChatStream {
    fn usage_so_far(&self) -> Usage {
        self.usage.or(self.timings).unwrap_or_default()
    }

    fn event(&mut self, event: &SseEvent, sink: &mut dyn StreamSink) -> Result<(), ModelError> {
        if self.done {
            return Ok(());
        }
        if event.data.trim() == "[DONE]" {
            self.done = true;
            return Ok(());
        }
        let chunk: Chunk = parse_json("chat completion chunk", event.data.as_bytes())?;
        if let Some(error) = chunk.error {
            let message = error
                .get("message")
                .and_then(Value::as_str)
                .unwrap_or("no message");
            // Whole: `read_answer` redacts the key from it, then cuts it.
            return Err(ModelError::StreamError(message.to_owned()));
        }
        if let Some(usage) = chunk.usage {
            self.usage = Some(usage.into());
        }
        if let Some(timings) = chunk.timings {
            self.timings = Some(timings.into());
        }
        // One completion was asked for; other choice indexes are not ours.
        for choice in chunk.choices.into_iter().filter(|c| c.index == 0) {
            if let Some(delta) = choice.delta {
                if let Some(text) = delta.content.filter(|t| !t.is_empty()) {
                    sink.text_delta(&text);
                    self.text.push_str(&text);
                }
                for fragment in delta.tool_calls {
                    let index = match fragment.index {
                        Some(index) => index,
                        None => self.index_without_one(fragment.id.as_deref()),
                    };
                    let call = self.tool_calls.entry(index).or_default();
                    if let Some(id) = fragment.id.filter(|id| !id.is_empty()) {
                        call.id = id;
                    }
                    if let Some(function) = fragment.function {
                        if let Some(name) = function.name.filter(|n| !n.is_empty()) {
                            let first = call.name.is_empty();
                            call.name.push_str(&name);
                            if first {
                                sink.tool_call_started(&call.name);
                            }
                        }
                        if let Some(arguments) = function.arguments {
                            call.arguments.push_str(&arguments.into_text());
                        }
                    }
                }
            }
            if let Some(reason) = choice.finish_reason {
                self.finish_reason = Some(reason);
            }
        }
        Ok(())
    }

    fn finish(self) -> Result<ModelResponse, ModelError> {
        let usage = self.usage_so_far();
        if !self.done {
            return Err(ModelError::TruncatedStream {
                usage_so_far: usage,
            });
        }
        let tool_calls = self
            .tool_calls
            .into_values()
            .enumerate()
            .map(|(position, call)| tool_call(call.id, call.name, &call.arguments, position))
            .collect::<Result<Vec<_>, _>>()?;
        let stop_reason = stop_reason(self.finish_reason.as_deref(), !tool_calls.is_empty());
        Ok(ModelResponse {
            message: AssistantMessage {
                text: self.text,
                tool_calls,
            },
            stop_reason,
            usage,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CollectedStream;

    fn feed(stream: &mut ChatStream, sink: &mut CollectedStream, data: &str) {
        stream
            .event(
                &SseEvent {
                    event: None,
                    data: data.into(),
                },
                sink,
            )
            .unwrap();
    }

    #[test]
    fn argument_fragments_assemble_by_index_even_interleaved() {
        let mut stream = ChatStream::default();
        let mut sink = CollectedStream::default();
        feed(
            &mut stream,
            &mut sink,
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":1,"id":"b","function":{"name":"second","arguments":"{\"y\""}}]}}]}"#,
        );
        feed(
            &mut stream,
            &mut sink,
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"a","function":{"name":"first","arguments":""}}]}}]}"#,
        );
        feed(
            &mut stream,
            &mut sink,
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":1,"function":{"arguments":":2}"}},{"index":0,"function":{"arguments":"{\"x\":1}"}}]}}]}"#,
        );
        feed(
            &mut stream,
            &mut sink,
            r#"{"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}"#,
        );
        feed(&mut stream, &mut sink, "[DONE]");
        let response = stream.finish().unwrap();
        let calls: Vec<(&str, &str, Value)> = response
            .message
            .tool_calls
            .iter()
            .map(|c| (c.id.as_str(), c.name.as_str(), c.arguments.clone()))
            .collect();
        assert_eq!(
            calls,
            [
                ("a", "first", json!({"x": 1})),
                ("b", "second", json!({"y": 2}))
            ]
        );
        assert_eq!(response.stop_reason, StopReason::ToolUse);
        assert_eq!(sink.tool_calls_started, ["second", "first"]);
    }

    #[test]
    fn a_tool_result_error_is_marked_in_content() {
        let message = ChatMessage::Tool(wor_core::model::ToolResult {
            tool_call_id: "c".into(),
            content: "denied by policy".into(),
            is_error: true,
        });
        assert_eq!(
            message_json(&message),
            json!({"role": "tool", "tool_call_id": "c", "content": "error: denied by policy"})
        );
    }
}
