//! The Gemini provider, on Google's native API:
//! `POST {base_url}/v1beta/models/{model}:generateContent`, or
//! `:streamGenerateContent?alt=sse` when streaming.
//!
//! The key goes in `x-goog-api-key`. System messages become `systemInstruction`; the assistant
//! is the `model` role; tools are `functionDeclarations` whose parameters are given as JSON
//! Schema (`parametersJsonSchema`). A call arrives as a `functionCall` part with its arguments
//! as an object, and its result goes back as a `functionResponse` part naming the function (the
//! wire format matches results to calls by name, and by id when the call had one), with
//! `{"output": …}` or `{"error": …}`. Consecutive messages of one role are merged into one
//! turn, so the results of parallel calls travel together.
//!
//! Thinking models attach a `thoughtSignature` to the part that calls a function and expect it
//! back on that part in later requests; it is kept on the call
//! ([`ToolCallRequest::thought_signature`]). Thought parts (`"thought": true`) are not answer
//! text. Usage is `usageMetadata`: input is the prompt count, output the candidates' count plus
//! the thinking count (which is billed as output).
//!
//! A stream is a sequence of whole response objects whose text parts are deltas; it has no end
//! marker, so a stream that closes before a candidate's `finishReason` is a
//! [`ModelError::TruncatedStream`].

use secrecy::ExposeSecret;
use serde::Deserialize;
use serde_json::{Map, Value, json};
use wor_core::model::{
    AssistantMessage, ChatMessage, ModelRequest, ModelResponse, ProviderKind, StopReason,
    ToolCallRequest, Usage,
};
use wor_egress::EgressClient;
use wor_egress::header::HeaderName;

use crate::error::ModelError;
use crate::sse::SseEvent;
use crate::transport::{
    ProviderEndpoint, ProviderOptions, StreamAssembler, json_headers, post_json, read_answer,
    secret_header,
};
use crate::{ModelFuture, ModelProvider, StreamSink, parse_json, shorten};

/// The prefix of call ids made up here for calls Gemini sent without one; they are not sent
/// back as ids.
const LOCAL_ID_PREFIX: &str = "gemini_call_";

/// A client of the Gemini API (or a gateway speaking it).
#[derive(Debug)]
pub struct GeminiProvider {
    egress: EgressClient,
    endpoint: ProviderEndpoint,
    options: ProviderOptions,
}

impl GeminiProvider {
    /// A provider sending through `egress` to `endpoint`
    /// (`https://generativelanguage.googleapis.com`, with or without `/v1beta`).
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
        let streaming = self.options.streaming;
        let url = model_url(&self.endpoint.base_url, &request.model, streaming)?;
        let body = serde_json::to_vec(&request_body(request))
            .map_err(|e| ModelError::InvalidRequest(e.to_string()))?;
        let mut headers = json_headers(streaming);
        if let Some(key) = &self.endpoint.api_key {
            headers.insert(
                HeaderName::from_static("x-goog-api-key"),
                secret_header(key.expose_secret())?,
            );
        }
        let response = post_json(
            &self.egress,
            &self.endpoint,
            &self.options,
            &url,
            headers,
            body,
        )
        .await?;
        read_answer::<GeminiStream>(response, streaming, &self.endpoint, sink, |body| {
            let answer: WireResponse = parse_json("gemini response", body)?;
            let mut stream = GeminiStream::default();
            stream.take(answer, &mut crate::DiscardStream)?;
            stream.finish()
        })
        .await
    }
}

impl ModelProvider for GeminiProvider {
    fn kind(&self) -> ProviderKind {
        ProviderKind::Gemini
    }

    fn complete<'a>(
        &'a self,
        request: &'a ModelRequest,
        sink: &'a mut dyn StreamSink,
    ) -> ModelFuture<'a> {
        Box::pin(self.complete_turn(request, sink))
    }
}

/// The URL of `model`'s generate (or streamed generate) method at `base_url`.
pub fn model_url(base_url: &str, model: &str, streaming: bool) -> Result<String, ModelError> {
    let model = model.strip_prefix("models/").unwrap_or(model);
    let safe = !model.is_empty()
        && model
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if !safe {
        return Err(ModelError::InvalidRequest(
            "a gemini model id is letters, digits, `-`, `_` and `.`".to_owned(),
        ));
    }
    let base = base_url.trim_end_matches('/');
    let base = base.strip_suffix("/v1beta").unwrap_or(base);
    Ok(if streaming {
        format!("{base}/v1beta/models/{model}:streamGenerateContent?alt=sse")
    } else {
        format!("{base}/v1beta/models/{model}:generateContent")
    })
}

/// The `generateContent` request body for `request`.
pub fn request_body(request: &ModelRequest) -> Value {
    let mut body = Map::new();
    let system: Vec<&str> = request
        .messages
        .iter()
        .filter_map(|m| match m {
            ChatMessage::System { content } => Some(content.as_str()),
            _ => None,
        })
        .collect();
    if !system.is_empty() {
        body.insert(
            "systemInstruction".into(),
            json!({"parts": [{"text": system.join("\n\n")}]}),
        );
    }
    let mut contents: Vec<(&'static str, Vec<Value>)> = Vec::new();
    for message in &request.messages {
        let (role, parts) = match message {
            ChatMessage::System { .. } => continue,
            ChatMessage::User { content } => ("user", vec![json!({"text": content})]),
            ChatMessage::Assistant(assistant) => ("model", model_parts(assistant)),
            ChatMessage::Tool(result) => {
                let name = call_name(&request.messages, &result.tool_call_id);
                let response = if result.is_error {
                    json!({"error": result.content})
                } else {
                    json!({"output": result.content})
                };
                let mut function_response = json!({"name": name, "response": response});
                if !result.tool_call_id.starts_with(LOCAL_ID_PREFIX)
                    && let Some(object) = function_response.as_object_mut()
                {
                    object.insert("id".into(), json!(result.tool_call_id));
                }
                ("user", vec![json!({"functionResponse": function_response})])
            }
        };
        match contents.last_mut() {
            Some((last, merged)) if *last == role => merged.extend(parts),
            _ => contents.push((role, parts)),
        }
    }
    body.insert(
        "contents".into(),
        Value::Array(
            contents
                .into_iter()
                .map(|(role, parts)| json!({"role": role, "parts": parts}))
                .collect(),
        ),
    );
    if !request.tools.is_empty() {
        let declarations: Vec<Value> = request
            .tools
            .iter()
            .map(|tool| {
                json!({
                    "name": tool.name,
                    "description": tool.description,
                    "parametersJsonSchema": tool.input_schema,
                })
            })
            .collect();
        body.insert(
            "tools".into(),
            json!([{ "functionDeclarations": declarations }]),
        );
    }
    let mut config = Map::new();
    config.insert("maxOutputTokens".into(), json!(request.max_output_tokens));
    if let Some(temperature) = request.temperature {
        config.insert("temperature".into(), json!(temperature));
    }
    // Structured output, on turns without tools: a JSON answer constrained to the schema.
    if let (Some(schema), true) = (&request.output_schema, request.tools.is_empty()) {
        config.insert("responseMimeType".into(), json!("application/json"));
        config.insert("responseJsonSchema".into(), schema.clone());
    }
    body.insert("generationConfig".into(), Value::Object(config));
    Value::Object(body)
}

/// The parts of an assistant turn: its text, then each call with its signature.
fn model_parts(assistant: &AssistantMessage) -> Vec<Value> {
    let mut parts = Vec::new();
    if !assistant.text.is_empty() {
        parts.push(json!({"text": assistant.text}));
    }
    for call in &assistant.tool_calls {
        let mut function_call = json!({"name": call.name, "args": call.arguments});
        if !call.id.starts_with(LOCAL_ID_PREFIX)
            && let Some(object) = function_call.as_object_mut()
        {
            object.insert("id".into(), json!(call.id));
        }
        let mut part = json!({"functionCall": function_call});
        if let (Some(signature), Some(object)) = (&call.thought_signature, part.as_object_mut()) {
            object.insert("thoughtSignature".into(), json!(signature));
        }
        parts.push(part);
    }
    if parts.is_empty() {
        // A turn must have a part; an empty answer is empty text.
        parts.push(json!({"text": ""}));
    }
    parts
}

/// The function name of the call `id` answers, from the assistant turns before it.
fn call_name<'a>(messages: &'a [ChatMessage], id: &str) -> &'a str {
    messages
        .iter()
        .filter_map(|m| match m {
            ChatMessage::Assistant(assistant) => Some(&assistant.tool_calls),
            _ => None,
        })
        .flatten()
        .find(|call| call.id == id)
        .map_or("", |call| call.name.as_str())
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct WireResponse {
    #[serde(default)]
    candidates: Vec<WireCandidate>,
    usage_metadata: Option<WireUsage>,
    prompt_feedback: Option<WirePromptFeedback>,
    error: Option<Value>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct WireCandidate {
    content: Option<WireContent>,
    finish_reason: Option<String>,
    #[serde(default)]
    index: u32,
}

#[derive(Debug, Deserialize)]
struct WireContent {
    #[serde(default)]
    parts: Vec<WirePart>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct WirePart {
    text: Option<String>,
    #[serde(default)]
    thought: bool,
    function_call: Option<WireFunctionCall>,
    thought_signature: Option<String>,
}

#[derive(Debug, Deserialize)]
struct WireFunctionCall {
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    name: String,
    #[serde(default)]
    args: Option<Value>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct WireUsage {
    #[serde(default)]
    prompt_token_count: u64,
    #[serde(default)]
    candidates_token_count: u64,
    #[serde(default)]
    thoughts_token_count: u64,
    #[serde(default)]
    tool_use_prompt_token_count: u64,
}

impl From<WireUsage> for Usage {
    fn from(usage: WireUsage) -> Self {
        Usage {
            input_tokens: usage
                .prompt_token_count
                .saturating_add(usage.tool_use_prompt_token_count),
            output_tokens: usage
                .candidates_token_count
                .saturating_add(usage.thoughts_token_count),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct WirePromptFeedback {
    block_reason: Option<String>,
}

/// A response being assembled, from one whole answer or from the chunks of a stream.
#[derive(Debug, Default)]
struct GeminiStream {
    text: String,
    tool_calls: Vec<ToolCallRequest>,
    finish_reason: Option<String>,
    usage: Option<Usage>,
}

impl GeminiStream {
    fn take(&mut self, answer: WireResponse, sink: &mut dyn StreamSink) -> Result<(), ModelError> {
        if let Some(error) = answer.error {
            let message = error
                .get("message")
                .and_then(Value::as_str)
                .unwrap_or("no message");
            // Whole: `read_answer` redacts the key from it, then cuts it.
            return Err(ModelError::StreamError(message.to_owned()));
        }
        if let Some(usage) = answer.usage_metadata {
            self.usage = Some(usage.into());
        }
        if let Some(reason) = answer.prompt_feedback.and_then(|f| f.block_reason) {
            // The prompt was refused: no candidate comes, and the turn ends here.
            self.finish_reason = Some(format!("prompt_blocked_{}", reason.to_ascii_lowercase()));
        }
        // One candidate was asked for; others are not ours.
        for candidate in answer.candidates.into_iter().filter(|c| c.index == 0) {
            for part in candidate.content.map(|c| c.parts).unwrap_or_default() {
                if let Some(call) = part.function_call {
                    if call.name.is_empty() {
                        return Err(ModelError::malformed(format!(
                            "function call {} has no name",
                            self.tool_calls.len()
                        )));
                    }
                    sink.tool_call_started(&call.name);
                    let arguments = match call.args {
                        None | Some(Value::Null) => Value::Object(Map::new()),
                        Some(args @ Value::Object(_)) => args,
                        Some(_) => {
                            return Err(ModelError::malformed(format!(
                                "arguments of function call `{}` are not an object",
                                shorten(&call.name)
                            )));
                        }
                    };
                    let id = call
                        .id
                        .filter(|id| !id.is_empty())
                        .unwrap_or_else(|| format!("{LOCAL_ID_PREFIX}{}", self.tool_calls.len()));
                    self.tool_calls.push(ToolCallRequest {
                        id,
                        name: call.name,
                        arguments,
                        thought_signature: part.thought_signature,
                    });
                } else if let Some(text) = part.text.filter(|t| !t.is_empty() && !part.thought) {
                    sink.text_delta(&text);
                    self.text.push_str(&text);
                }
            }
            if let Some(reason) = candidate.finish_reason {
                self.finish_reason = Some(reason);
            }
        }
        Ok(())
    }

    fn finish(self) -> Result<ModelResponse, ModelError> {
        let usage = self.usage.unwrap_or_default();
        let Some(reason) = self.finish_reason else {
            return Err(ModelError::TruncatedStream {
                usage_so_far: usage,
            });
        };
        let stop_reason = match reason.as_str() {
            _ if !self.tool_calls.is_empty() => StopReason::ToolUse,
            "STOP" => StopReason::EndTurn,
            "MAX_TOKENS" => StopReason::MaxTokens,
            other => StopReason::Other(other.to_ascii_lowercase()),
        };
        Ok(ModelResponse {
            message: AssistantMessage {
                text: self.text,
                tool_calls: self.tool_calls,
            },
            stop_reason,
            usage,
        })
    }
}

impl StreamAssembler for GeminiStream {
    fn event(&mut self, event: &SseEvent, sink: &mut dyn StreamSink) -> Result<(), ModelError> {
        if event.data.trim().is_empty() {
            return Ok(());
        }
        let chunk: WireResponse = parse_json("gemini stream chunk", event.data.as_bytes())?;
        self.take(chunk, sink)
    }

    fn finish(self) -> Result<ModelResponse, ModelError> {
        GeminiStream::finish(self)
    }

    fn usage_so_far(&self) -> Usage {
        self.usage.unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use wor_core::model::{ToolResult, ToolSpec};

    #[test]
    fn urls_name_the_model_and_the_method() {
        assert_eq!(
            model_url("https://g.example/", "models/gemini-2.5-flash", false).unwrap(),
            "https://g.example/v1beta/models/gemini-2.5-flash:generateContent"
        );
        assert_eq!(
            model_url("https://g.example/v1beta", "gemini-2.5-pro", true).unwrap(),
            "https://g.example/v1beta/models/gemini-2.5-pro:streamGenerateContent?alt=sse"
        );
        for bad in ["", "a/b", "x:generateContent", "../k"] {
            assert!(model_url("https://g", bad, false).is_err(), "{bad}");
        }
    }

    #[test]
    fn results_name_their_function_and_signatures_go_back_on_their_part() {
        let request = ModelRequest {
            model: "m".into(),
            messages: vec![
                ChatMessage::system("Be terse."),
                ChatMessage::user("Weather?"),
                ChatMessage::Assistant(AssistantMessage {
                    text: String::new(),
                    tool_calls: vec![
                        ToolCallRequest {
                            id: "fc_1".into(),
                            name: "weather".into(),
                            arguments: json!({"city": "Oslo"}),
                            thought_signature: Some("c2lnbmF0dXJl".into()),
                        },
                        ToolCallRequest {
                            id: format!("{LOCAL_ID_PREFIX}1"),
                            name: "clock".into(),
                            arguments: json!({}),
                            thought_signature: None,
                        },
                    ],
                }),
                ChatMessage::Tool(ToolResult {
                    tool_call_id: "fc_1".into(),
                    content: "rain".into(),
                    is_error: false,
                }),
                ChatMessage::Tool(ToolResult {
                    tool_call_id: format!("{LOCAL_ID_PREFIX}1"),
                    content: "no clock".into(),
                    is_error: true,
                }),
            ],
            tools: vec![ToolSpec {
                name: "weather".into(),
                description: "Weather of a city".into(),
                input_schema: json!({"type": "object", "additionalProperties": false}),
            }],
            max_output_tokens: 100,
            temperature: None,
            output_schema: None,
        };
        assert_eq!(
            request_body(&request),
            json!({
                "systemInstruction": {"parts": [{"text": "Be terse."}]},
                "contents": [
                    {"role": "user", "parts": [{"text": "Weather?"}]},
                    {"role": "model", "parts": [
                        {"functionCall": {"name": "weather", "args": {"city": "Oslo"}, "id": "fc_1"},
                            "thoughtSignature": "c2lnbmF0dXJl"},
                        {"functionCall": {"name": "clock", "args": {}}},
                    ]},
                    {"role": "user", "parts": [
                        {"functionResponse": {"name": "weather", "response": {"output": "rain"}, "id": "fc_1"}},
                        {"functionResponse": {"name": "clock", "response": {"error": "no clock"}}},
                    ]},
                ],
                "tools": [{"functionDeclarations": [{"name": "weather", "description": "Weather of a city",
                    "parametersJsonSchema": {"type": "object", "additionalProperties": false}}]}],
                "generationConfig": {"maxOutputTokens": 100},
            })
        );
    }
}
