//! Model connections through the API: local model servers in the operator's model ranges
//! without a key, and those ranges kept shut to tools and webhooks.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic,
    reason = "tests fail loudly"
)]

mod common;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::http::{HeaderMap, Method, StatusCode};
use common::{Harness, steps_of};
use serde_json::{Value, json};
use wor_egress::{EgressClient, EgressLimits, EgressPolicy, StaticResolver};

/// The address the local model server listens on: listed for models only. Tools and webhooks
/// may reach 127.0.0.1 (the harness's usual allowed range), never this one.
const MODEL_RANGE: &str = "127.0.0.2/32";

/// Egress for tools and webhooks, and egress for models, as `wor serve` builds them from
/// `[egress] allowed_cidrs = ["127.0.0.1/32"]` and `model_cidrs = ["127.0.0.2/32"]`.
fn egress_with_model_range() -> (EgressClient, EgressClient) {
    let policy = EgressPolicy::development()
        .with_allowed_cidrs(["127.0.0.1/32".parse().unwrap()])
        .unwrap()
        .with_model_cidrs([MODEL_RANGE.parse().unwrap()])
        .unwrap();
    let client = |policy| {
        EgressClient::with_resolver(
            policy,
            Arc::new(StaticResolver::new()),
            EgressLimits::default(),
        )
        .unwrap()
    };
    (client(policy.for_models()), client(policy))
}

/// What a local server saw: each request's path, authorization header and body.
#[derive(Debug, Default)]
struct Seen {
    requests: Mutex<Vec<(String, Option<String>, Value)>>,
}

/// A local OpenAI-compatible server (Ollama's dialect: no key, usage in the last chunk) on
/// `ip`, answering every chat completion with `text`; any other path is recorded and 404.
async fn local_model(ip: [u8; 4], text: &'static str) -> (SocketAddr, Arc<Seen>) {
    let seen = Arc::new(Seen::default());
    let record = seen.clone();
    let chat = axum::routing::post(
        move |headers: HeaderMap, axum::Json(body): axum::Json<Value>| {
            let seen = record.clone();
            async move {
                let auth = headers
                    .get("authorization")
                    .map(|v| v.to_str().unwrap().to_owned());
                seen.requests
                    .lock()
                    .unwrap()
                    .push(("/v1/chat/completions".into(), auth, body));
                let chunks = [
                    json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "llama3.2",
                    "choices": [{"index": 0, "delta": {"role": "assistant", "content": text}, "finish_reason": null}]}),
                    json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "llama3.2",
                    "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": "stop"}]}),
                    json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "llama3.2",
                    "choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}}),
                ];
                let mut sse = String::new();
                for chunk in chunks {
                    sse.push_str(&format!("data: {chunk}\n\n"));
                }
                sse.push_str("data: [DONE]\n\n");
                ([("content-type", "text/event-stream")], sse)
            }
        },
    );
    let other = seen.clone();
    let router =
        Router::new()
            .route("/v1/chat/completions", chat)
            .fallback(move |uri: axum::http::Uri| {
                let seen = other.clone();
                async move {
                    seen.requests
                        .lock()
                        .unwrap()
                        .push((uri.path().to_owned(), None, Value::Null));
                    StatusCode::NOT_FOUND
                }
            });
    let listener = tokio::net::TcpListener::bind(SocketAddr::from((ip, 0)))
        .await
        .unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    (addr, seen)
}

const LOCAL_ROUTINE: &str = r#"
name = "local"
instructions = "Answer briefly."
[model]
provider = "openai_compatible"
connection = "local"
model = "llama3.2"
"#;

#[tokio::test]
async fn a_local_model_server_in_the_model_range_needs_no_key_and_the_range_stays_shut_to_tools_and_webhooks()
 {
    let (model_egress, egress) = egress_with_model_range();
    let h = Harness::with_egress(Default::default(), egress, Some(model_egress)).await;
    let (local, seen) = local_model([127, 0, 0, 2], "hello from the local model").await;

    // No key, and the address is in the model range: created, shown as keyless.
    let (status, created) = h
        .call(
            Method::POST,
            "/v1/model-connections",
            Some(json!({"name": "local", "provider": "openai_compatible",
                "base_url": format!("http://{local}/v1")})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    assert_eq!(created["api_key"]["configured"], false);

    let run = h.run(LOCAL_ROUTINE).await;
    assert_eq!(run["status"], "succeeded", "{run:#}");
    let turn = &steps_of(&run, "model_turn")[0]["payload"];
    assert_eq!(
        turn["message"]["text"], "hello from the local model",
        "{turn}"
    );
    {
        let requests = seen.requests.lock().unwrap();
        assert_eq!(requests.len(), 1);
        assert_eq!(requests[0].1, None, "no authorization header is sent");
        assert_eq!(requests[0].2["model"], "llama3.2");
    }
    // No secret was used, so none is recorded as used.
    assert!(!h.audit_text().await.contains("secret.use"));

    // Without a key, an address outside the model range is refused, even one tools may reach.
    let (elsewhere, _) = local_model([127, 0, 0, 1], "unused").await;
    for base_url in [
        format!("http://{elsewhere}/v1"),
        "http://10.0.0.5:11434/v1".to_owned(),
    ] {
        let (status, refused) = h
            .call(
                Method::POST,
                "/v1/model-connections",
                Some(
                    json!({"name": "nokey", "provider": "openai_compatible", "base_url": base_url}),
                ),
            )
            .await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{base_url}: {refused}");
        assert_eq!(refused["error"]["code"], "api_key_required", "{refused}");
    }

    // A tool connection to the model range is refused by the egress guard at review...
    let body = json!({"name": "sneaky", "kind": "mcp_http", "url": format!("http://{local}/mcp"),
        "allowlist": [local.to_string()]});
    let (status, created) = h
        .call(Method::POST, "/v1/tool-connections", Some(body))
        .await;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    let id = created["id"].as_str().unwrap();
    let (status, review) = h
        .call(
            Method::GET,
            &format!("/v1/tool-connections/{id}/review"),
            None,
        )
        .await;
    assert!(!status.is_success(), "{status} {review}");
    let message = review["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("127.0.0.2"), "{message}");
    // ... and so is a run webhook to it, when the routine is applied.
    let toml = format!("{LOCAL_ROUTINE}\n[notify]\nurl = \"http://{local}/hook\"\n");
    let (status, refused) = h
        .call(Method::POST, "/v1/routines", Some(json!({ "toml": toml })))
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{refused}");
    assert!(
        refused["error"]["message"]
            .as_str()
            .unwrap()
            .contains("`notify.url`"),
        "{refused}"
    );
    // Nothing but the one model call reached the local server.
    let paths: Vec<String> = seen
        .requests
        .lock()
        .unwrap()
        .iter()
        .map(|r| r.0.clone())
        .collect();
    assert_eq!(paths, ["/v1/chat/completions"]);
}

#[tokio::test]
async fn a_keyless_connection_is_rechecked_at_every_start() {
    // The connection was made while the range was listed; a server restarted without it
    // fails the run closed instead of sending to the range.
    let (model_egress, egress) = egress_with_model_range();
    let h = Harness::with_egress(Default::default(), egress, Some(model_egress)).await;
    let (local, seen) = local_model([127, 0, 0, 2], "unused").await;
    let (status, created) = h
        .call(
            Method::POST,
            "/v1/model-connections",
            Some(json!({"name": "local", "provider": "openai_compatible",
                "base_url": format!("http://{local}/v1")})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    let (status, applied) = h
        .call(
            Method::POST,
            "/v1/routines",
            Some(json!({"toml": LOCAL_ROUTINE})),
        )
        .await;
    assert!(status.is_success(), "{applied}");
    let routine_id = applied["routine"]["id"].as_str().unwrap();
    let (status, run) = h
        .call(
            Method::POST,
            &format!("/v1/routines/{routine_id}/runs"),
            Some(json!({"input": "go"})),
        )
        .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{run}");
    let restarted = h.restarted_engine(Default::default());
    assert!(restarted.run_next().await.unwrap());
    let run = h.get_run(run["id"].as_str().unwrap()).await;
    assert_eq!(run["status"], "failed", "{run:#}");
    let outcome = run["outcome"].as_str().unwrap();
    assert!(
        outcome.contains("has no API key") && outcome.contains("127.0.0.2"),
        "{outcome}"
    );
    assert!(seen.requests.lock().unwrap().is_empty());
}

/// A cloud provider's fake on 127.0.0.1: answers every POST with `body` as an event stream and
/// records the path, the header named `key_header` and whether any other credential header
/// came.
async fn cloud_model(body: String, key_header: &'static str) -> (SocketAddr, Arc<Seen>) {
    let seen = Arc::new(Seen::default());
    let record = seen.clone();
    let router = Router::new().fallback(move |uri: axum::http::Uri, headers: HeaderMap| {
        let seen = record.clone();
        let body = body.clone();
        async move {
            let key = headers
                .get(key_header)
                .map(|v| v.to_str().unwrap().to_owned());
            let path = uri
                .path_and_query()
                .map(|p| p.as_str().to_owned())
                .unwrap_or_default();
            seen.requests.lock().unwrap().push((path, key, Value::Null));
            ([("content-type", "text/event-stream")], body)
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    (addr, seen)
}

#[tokio::test]
async fn azure_and_gemini_connections_run_routines_with_usage_and_cost() {
    let mut config = wor_engine::EngineConfig::default();
    for model in ["prod-gpt", "gemini-2.5-flash"] {
        config.prices.insert(
            model.to_owned(),
            wor_core::budget::ModelPrice {
                input_microdollars_per_mtok: 1_000_000,
                output_microdollars_per_mtok: 2_000_000,
            },
        );
    }
    let h = Harness::with_config(config).await;
    let azure_body = {
        let chunks = [
            json!({"choices": [], "prompt_filter_results": []}),
            json!({"choices": [{"index": 0, "delta": {"content": "from azure"}, "finish_reason": null}]}),
            json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
            json!({"choices": [], "usage": {"prompt_tokens": 1000, "completion_tokens": 500}}),
        ];
        sse_chunks(&chunks, true)
    };
    let gemini_body = format!(
        "data: {}\r\n\r\n",
        json!({"candidates": [{"content": {"role": "model", "parts": [{"text": "from gemini"}]},
            "finishReason": "STOP", "index": 0}],
            "usageMetadata": {"promptTokenCount": 2000, "candidatesTokenCount": 100, "thoughtsTokenCount": 900}})
    );
    let (azure, azure_seen) = cloud_model(azure_body, "api-key").await;
    let (gemini, gemini_seen) = cloud_model(gemini_body, "x-goog-api-key").await;
    let mut connection_ids = Vec::new();
    for (name, provider, base_url, key) in [
        (
            "az",
            "azure_openai",
            format!("http://{azure}"),
            "azure-key-0123456789abcdef",
        ),
        (
            "gem",
            "gemini",
            format!("http://{gemini}"),
            "AIzaSyA-test-key-0123456789abcdefghijk",
        ),
    ] {
        let (status, created) = h
            .call(
                Method::POST,
                "/v1/model-connections",
                Some(json!({"name": name, "provider": provider, "base_url": base_url, "api_key": key})),
            )
            .await;
        assert_eq!(status, StatusCode::CREATED, "{created}");
        connection_ids.push(created["id"].as_str().unwrap().to_owned());
    }
    let routine = |name: &str, provider: &str, connection: &str, model: &str| {
        format!(
            "name = \"{name}\"\ninstructions = \"Answer.\"\n[model]\nprovider = \"{provider}\"\nconnection = \"{connection}\"\nmodel = \"{model}\"\n"
        )
    };
    let run = h
        .run(&routine("on-azure", "azure_openai", "az", "prod-gpt"))
        .await;
    assert_eq!(run["status"], "succeeded", "{run:#}");
    assert_eq!(run["outcome"], "from azure", "{run:#}");
    assert_eq!(run["usage"]["input_tokens"], 1000);
    assert_eq!(run["usage"]["output_tokens"], 500);
    assert_eq!(run["usage"]["cost_microdollars"], 2000);
    // Every model call records the model identity and the key's version.
    assert_eq!(
        steps_of(&run, "model_turn")[0]["payload"]["identity"],
        json!({"provider": "azure_openai", "connection_id": connection_ids[0],
            "model_id": "prod-gpt", "credential_version": 1})
    );
    {
        let seen = azure_seen.requests.lock().unwrap();
        assert_eq!(
            seen[0].0,
            "/openai/deployments/prod-gpt/chat/completions?api-version=2024-10-21"
        );
        assert_eq!(seen[0].1.as_deref(), Some("azure-key-0123456789abcdef"));
    }
    let run = h
        .run(&routine("on-gemini", "gemini", "gem", "gemini-2.5-flash"))
        .await;
    assert_eq!(run["status"], "succeeded", "{run:#}");
    assert_eq!(run["usage"]["input_tokens"], 2000);
    assert_eq!(
        run["usage"]["output_tokens"], 1000,
        "thinking counts as output"
    );
    assert_eq!(run["usage"]["cost_microdollars"], 4000);
    {
        let seen = gemini_seen.requests.lock().unwrap();
        assert_eq!(
            seen[0].0,
            "/v1beta/models/gemini-2.5-flash:streamGenerateContent?alt=sse"
        );
        assert_eq!(
            seen[0].1.as_deref(),
            Some("AIzaSyA-test-key-0123456789abcdefghijk")
        );
    }
    // A routine whose provider differs from its connection's fails closed, sending nothing.
    let before = gemini_seen.requests.lock().unwrap().len();
    let run = h
        .run(&routine(
            "mismatch",
            "azure_openai",
            "gem",
            "gemini-2.5-flash",
        ))
        .await;
    assert_eq!(run["status"], "failed", "{run:#}");
    assert!(
        run["outcome"].as_str().unwrap().contains("speaks `gemini`"),
        "{run:#}"
    );
    assert_eq!(gemini_seen.requests.lock().unwrap().len(), before);
    // No key appears in what the API shows of the runs or the audit log.
    let audit = h.audit_text().await;
    let entries: Value = serde_json::from_str(&audit).unwrap();
    let calls: Vec<&Value> = entries["entries"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["category"] == "model.call")
        .map(|e| &e["payload"])
        .collect();
    assert_eq!(calls.len(), 2, "the mismatched run called no model");
    for (call, (connection, provider)) in calls
        .iter()
        .zip(connection_ids.iter().zip(["azure_openai", "gemini"]))
    {
        assert_eq!(call["connection_id"], connection.as_str(), "{call}");
        assert_eq!(call["provider"], provider, "{call}");
        assert_eq!(call["credential_version"], 1, "{call}");
    }
    assert!(!audit.contains("azure-key-0123") && !audit.contains("AIzaSyA-test"));
}

/// A model call that fails on what the provider sent fails the run with an outcome redacted
/// of the run's secrets, the model key among them, not only of secret shapes.
#[tokio::test]
async fn a_failed_model_call_that_echoes_the_key_is_redacted_of_it() {
    const KEY: &str = "plainkey-ABCDEFGHIJKLMNOPQRSTUVWX-0123";
    let h = Harness::new().await;
    let stream = sse_chunks(
        &[
            json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "c1",
                "type": "function", "function": {"name": KEY, "arguments": "{bad"}}]},
                "finish_reason": null}]}),
            json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}),
        ],
        true,
    );
    let run = run_on_openai_compatible_fake(&h, stream, KEY).await;
    assert_eq!(run["status"], "failed", "{run:#}");
    let outcome = run["outcome"].as_str().unwrap();
    assert!(
        outcome.contains("not valid json") && outcome.contains("[REDACTED"),
        "{outcome}"
    );
    assert!(!run.to_string().contains("ABCDEFGHIJ"), "{run:#}");
    assert!(!h.audit_text().await.contains("ABCDEFGHIJ"));
}

/// A stream cut short after the provider reported its usage fails the run, and the tokens it
/// reported count against the run's budgets.
#[tokio::test]
async fn the_tokens_a_cut_stream_reported_count_against_the_run() {
    let h = Harness::new().await;
    // No `[DONE]`: the stream is cut after the usage chunk.
    let stream = sse_chunks(
        &[
            json!({"choices": [{"index": 0, "delta": {"content": "partial"}, "finish_reason": null}]}),
            json!({"choices": [], "usage": {"prompt_tokens": 100, "completion_tokens": 50}}),
        ],
        false,
    );
    let run = run_on_openai_compatible_fake(&h, stream, "cut-key-0123456789abcdef").await;
    assert_eq!(run["status"], "failed", "{run:#}");
    assert_eq!(run["usage"]["input_tokens"], 100, "{run:#}");
    assert_eq!(run["usage"]["output_tokens"], 50, "{run:#}");
}

/// `chunks` as an OpenAI-compatible event stream, ended by `[DONE]` when `done`.
fn sse_chunks(chunks: &[Value], done: bool) -> String {
    let mut sse: String = chunks.iter().map(|c| format!("data: {c}\n\n")).collect();
    if done {
        sse.push_str("data: [DONE]\n\n");
    }
    sse
}

/// Runs a routine on an `openai_compatible` connection with `key` to a fake that answers every
/// call with `stream`; the run as the API shows it once it has ended.
async fn run_on_openai_compatible_fake(h: &Harness, stream: String, key: &str) -> Value {
    let (addr, _) = cloud_model(stream, "authorization").await;
    let (status, created) = h
        .call(
            Method::POST,
            "/v1/model-connections",
            Some(json!({"name": "fake", "provider": "openai_compatible",
                "base_url": format!("http://{addr}/v1"), "api_key": key})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    h.run("name = \"on-fake\"\ninstructions = \"Answer.\"\n[model]\nprovider = \"openai_compatible\"\nconnection = \"fake\"\nmodel = \"m\"\n")
        .await
}

/// A replay routine with `[output] schema` whose model answers `answers` in turn.
fn structured_routine(answers: &[&str], turns: u64) -> String {
    let mut toml = format!(
        r#"name = "triage"
instructions = "Classify the page."
[model]
provider = "replay"
model = "script"
[budget]
turns = {turns}
[output]
schema = {{ type = "object", required = ["severity", "summary"], additionalProperties = false, properties = {{ severity = {{ enum = ["low", "high"] }}, summary = {{ type = "string" }} }} }}
"#
    );
    for answer in answers {
        toml.push_str(&format!("[[model.script.turns]]\ntext = '''{answer}'''\n"));
    }
    toml
}

#[tokio::test]
async fn a_structured_answer_is_the_runs_json_result() {
    let h = Harness::new().await;
    let run = h
        .run(&structured_routine(
            &["```json\n{\"severity\": \"low\", \"summary\": \"disk at 81%\"}\n```"],
            3,
        ))
        .await;
    assert_eq!(run["status"], "succeeded", "{run:#}");
    assert_eq!(
        run["result"],
        json!({"severity": "low", "summary": "disk at 81%"})
    );
    assert_eq!(
        run["outcome"],
        r#"{"severity":"low","summary":"disk at 81%"}"#
    );
    assert_eq!(steps_of(&run, "output").len(), 1);
    assert_eq!(run["usage"]["turns"], 1);
}

#[tokio::test]
async fn an_invalid_answer_is_corrected_within_the_turn_budget() {
    let h = Harness::new().await;
    let run = h
        .run(&structured_routine(
            &[
                "The disk is nearly full.",
                r#"{"severity": "urgent", "summary": "disk full"}"#,
                r#"{"severity": "high", "summary": "disk full"}"#,
            ],
            3,
        ))
        .await;
    assert_eq!(run["status"], "succeeded", "{run:#}");
    assert_eq!(
        run["result"],
        json!({"severity": "high", "summary": "disk full"})
    );
    assert_eq!(run["usage"]["turns"], 3);
    // Each correction request is an engine input naming the violation.
    let requests: Vec<&str> = steps_of(&run, "input")
        .iter()
        .filter(|s| s["provenance"] == "engine")
        .map(|s| s["payload"]["input"].as_str().unwrap())
        .collect();
    assert_eq!(requests.len(), 2, "{run:#}");
    assert!(requests[0].contains("not JSON"), "{}", requests[0]);
    assert!(requests[1].contains("at `/severity`"), "{}", requests[1]);
}

#[tokio::test]
async fn an_answer_that_stays_invalid_fails_the_run_naming_the_violation() {
    let h = Harness::new().await;
    let run = h
        .run(&structured_routine(
            &[
                r#"{"severity": "low"}"#,
                r#"{"severity": "low", "summary": 7}"#,
            ],
            2,
        ))
        .await;
    assert_eq!(run["status"], "failed", "{run:#}");
    let outcome = run["outcome"].as_str().unwrap();
    assert!(
        outcome.contains("does not match the output schema") && outcome.contains("/summary"),
        "{outcome}"
    );
    assert!(run.get("result").is_none(), "{run:#}");

    // In the list, a succeeded run carries its result and the failed one none.
    let valid = structured_routine(&[r#"{"severity": "high", "summary": "ok"}"#], 2)
        .replace("name = \"triage\"", "name = \"triage-valid\"");
    let succeeded = h.run(&valid).await;
    assert_eq!(succeeded["status"], "succeeded", "{succeeded:#}");
    let (status, listed) = h.call(Method::GET, "/v1/runs", None).await;
    assert_eq!(status, StatusCode::OK, "{listed}");
    let listed = listed.as_array().unwrap();
    let item = |id: &Value| listed.iter().find(|r| r["id"] == *id).unwrap();
    assert_eq!(
        item(&succeeded["id"])["result"],
        json!({"severity": "high", "summary": "ok"})
    );
    assert!(item(&run["id"]).get("result").is_none(), "{listed:?}");
}

#[tokio::test]
async fn an_output_schema_with_a_remote_ref_is_refused_when_applied() {
    let h = Harness::new().await;
    let toml = "name = \"r\"\ninstructions = \"x\"\n[model]\nprovider = \"replay\"\nmodel = \"s\"\n[[model.script.turns]]\ntext = \"{}\"\n[output]\nschema = '{\"$ref\": \"https://schemas.example.com/out.json\"}'\n";
    let (status, refused) = h
        .call(Method::POST, "/v1/routines", Some(json!({ "toml": toml })))
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{refused}");
    assert!(
        refused["error"]["message"]
            .as_str()
            .unwrap()
            .contains("`output.schema` cannot be used"),
        "{refused}"
    );
}

/// The model connection's key, which the fake model writes into its answer in three deltas.
const STREAMED_KEY: &str = "sk-live-0123456789abcdefXYZ";

/// A streaming OpenAI-compatible fake: text deltas with the connection's key split across
/// three of them, then a pause before the turn ends. Sends the time it finished on `done`.
async fn slow_streaming_model(
    done: tokio::sync::oneshot::Sender<std::time::Instant>,
) -> SocketAddr {
    let done = Arc::new(Mutex::new(Some(done)));
    let route = axum::routing::post(move || {
        let done = done.clone();
        async move {
            // More than the 256 bytes the stream holds back, so text goes out before the end.
            let filler = "and more text. ".repeat(6);
            let deltas = [
                "Here is the key: ",
                "sk-live-",
                "0123456789",
                "abcdefXYZ",
                " ",
                &filler,
                &filler,
                &filler,
                &filler,
            ];
            let mut chunks: Vec<(u64, String)> = deltas
                .iter()
                .map(|d| {
                    (
                        20,
                        format!(
                            "data: {}\n\n",
                            json!({"choices": [{"index": 0, "delta": {"content": d}}]})
                        ),
                    )
                })
                .collect();
            chunks.push((
                400,
                format!(
                    "data: {}\n\ndata: {}\n\ndata: [DONE]\n\n",
                    json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
                    json!({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 12}})
                ),
            ));
            let stream = futures_util::stream::unfold(
                (chunks.into_iter(), done),
                |(mut chunks, done)| async move {
                    let (pause, chunk) = chunks.next()?;
                    tokio::time::sleep(std::time::Duration::from_millis(pause)).await;
                    if chunk.contains("[DONE]")
                        && let Some(done) = done.lock().unwrap().take()
                    {
                        let _ = done.send(std::time::Instant::now());
                    }
                    Some((Ok::<_, std::convert::Infallible>(chunk), (chunks, done)))
                },
            );
            (
                [("content-type", "text/event-stream")],
                axum::body::Body::from_stream(stream),
            )
        }
    });
    common::serve(Router::new().route("/v1/chat/completions", route)).await
}

#[tokio::test]
async fn model_text_streams_to_run_events_redacted_before_the_turn_ends() {
    use http_body_util::BodyExt;
    use tower::ServiceExt;

    let h = Harness::new().await;
    let (done_tx, done_rx) = tokio::sync::oneshot::channel();
    let model = slow_streaming_model(done_tx).await;
    let (status, created) = h
        .call(
            Method::POST,
            "/v1/model-connections",
            Some(json!({"name": "fake", "provider": "openai_compatible",
                "base_url": format!("http://{model}/v1"), "api_key": STREAMED_KEY})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    let toml = "name = \"talker\"\ninstructions = \"Talk.\"\n[model]\nprovider = \"openai_compatible\"\nconnection = \"fake\"\nmodel = \"m\"\n";
    let (_, applied) = h
        .call(Method::POST, "/v1/routines", Some(json!({ "toml": toml })))
        .await;
    let routine_id = applied["routine"]["id"].as_str().unwrap().to_owned();
    let (status, run) = h
        .call(
            Method::POST,
            &format!("/v1/routines/{routine_id}/runs"),
            Some(json!({"input": "go"})),
        )
        .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{run}");
    let run_id = run["id"].as_str().unwrap().to_owned();

    let request = axum::http::Request::builder()
        .uri(format!("/v1/runs/{run_id}/events"))
        .header("authorization", format!("Bearer {}", h.owner()))
        .body(axum::body::Body::empty())
        .unwrap();
    let response = h.router.clone().oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let reader = tokio::spawn(async move {
        let mut body = response.into_body();
        let mut frames: Vec<(std::time::Instant, String)> = Vec::new();
        while let Some(frame) = body.frame().await {
            if let Ok(data) = frame.unwrap().into_data() {
                let text = String::from_utf8_lossy(&data).into_owned();
                let end = text.contains("event: end");
                frames.push((std::time::Instant::now(), text));
                if end {
                    break;
                }
            }
        }
        frames
    });
    assert!(h.engine.run_next().await.unwrap());
    let finished_at = done_rx.await.unwrap();
    let frames = tokio::time::timeout(std::time::Duration::from_secs(10), reader)
        .await
        .unwrap()
        .unwrap();

    let everything: String = frames.iter().map(|(_, f)| f.as_str()).collect();
    for part in ["sk-live-0", "0123456789", "abcdefXYZ", STREAMED_KEY] {
        assert!(
            !everything.contains(part),
            "`{part}` reached the stream: {everything}"
        );
    }
    // The text events, in order, and when they came.
    let mut deltas = String::new();
    let mut first_text_at = None;
    for (at, frame) in &frames {
        for event in frame.split("\n\n") {
            if let Some(data) = event
                .strip_prefix("event: text\ndata: ")
                .or_else(|| event.strip_prefix("event:text\ndata:"))
            {
                let value: Value = serde_json::from_str(data.trim()).unwrap();
                deltas.push_str(value["delta"].as_str().unwrap());
                first_text_at.get_or_insert(*at);
            }
        }
    }
    let expected = format!(
        "Here is the key: [REDACTED] {}",
        "and more text. ".repeat(24)
    );
    assert_eq!(deltas, expected, "{everything}");
    let first_text_at = first_text_at.expect("text events");
    assert!(
        first_text_at < finished_at,
        "text arrived before the model's turn ended"
    );
    let text_pos = everything.find("event: text").unwrap();
    let turn_pos = everything.find("\"model_turn\"").unwrap();
    assert!(text_pos < turn_pos, "deltas come before the recorded turn");
    // The stored turn is written whole, redacted as before.
    let run = h.get_run(&run_id).await;
    assert_eq!(run["status"], "succeeded", "{run:#}");
    let turn = &steps_of(&run, "model_turn")[0]["payload"]["message"]["text"];
    assert_eq!(turn, &json!(expected));
}

#[tokio::test]
async fn a_key_replaced_while_a_run_waits_stops_it_when_it_resumes() {
    let h = Harness::new().await;
    // The model asks for a note to be sent, which a person must approve first.
    let call = [
        json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
            "function": {"name": "notes__send_note", "arguments": "{\"text\":\"hi\"}"}}]}, "finish_reason": null}]}),
        json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}),
        json!({"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 5}}),
    ];
    let mut body: String = call.iter().map(|c| format!("data: {c}\n\n")).collect();
    body.push_str("data: [DONE]\n\n");
    let (model, seen) = cloud_model(body, "authorization").await;
    let notes: Arc<Mutex<usize>> = Arc::default();
    let counted = notes.clone();
    let tool = common::serve(Router::new().route(
        "/v1/notes",
        axum::routing::post(move || {
            let counted = counted.clone();
            async move {
                *counted.lock().unwrap() += 1;
                axum::Json(json!({"status": "sent"}))
            }
        }),
    ))
    .await;
    let (status, created) = h
        .call(
            Method::POST,
            "/v1/tool-connections",
            Some(json!({"name": "notes", "kind": "http_api", "url": format!("http://{tool}/v1"),
                "allowlist": [tool.to_string()], "tools": [{"name": "send_note", "description": "Sends a note",
                "method": "POST", "path": "/notes",
                "inputSchema": {"type": "object", "properties": {"text": {"type": "string"}}}}]})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    h.review_and_enable(created["id"].as_str().unwrap(), &[])
        .await;
    let (status, connection) = h
        .call(
            Method::POST,
            "/v1/model-connections",
            Some(json!({"name": "cloud", "provider": "openai_compatible",
                "base_url": format!("http://{model}/v1"), "api_key": "sk-first-0123456789abcdef"})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{connection}");
    let connection = connection["id"].as_str().unwrap().to_owned();
    let toml = "name = \"noter\"\ninstructions = \"Send a note.\"\n[model]\nprovider = \"openai_compatible\"\n\
                connection = \"cloud\"\nmodel = \"m\"\n[[tools]]\ntool = \"notes/send_note\"\nmode = \"confirm\"\n";
    let (status, applied) = h
        .call(Method::POST, "/v1/routines", Some(json!({ "toml": toml })))
        .await;
    assert_eq!(status, StatusCode::CREATED, "{applied}");
    let routine = applied["routine"]["id"].as_str().unwrap();
    let (_, run) = h
        .call(
            Method::POST,
            &format!("/v1/routines/{routine}/runs"),
            Some(json!({"input": "go"})),
        )
        .await;
    let run_id = run["id"].as_str().unwrap().to_owned();
    assert!(h.engine.run_next().await.unwrap());
    let pending = h.pending_approvals(&run_id).await;
    assert_eq!(
        pending.len(),
        1,
        "the run waits for its call to be approved"
    );
    assert_eq!(
        steps_of(&h.get_run(&run_id).await, "model_turn")[0]["payload"]["identity"]["credential_version"],
        1
    );

    // The key is replaced while the run waits; then the call is approved.
    let (status, replaced) = h
        .call(
            Method::PUT,
            &format!("/v1/model-connections/{connection}/api-key"),
            Some(json!({"api_key": "sk-second-0123456789abcdef"})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{replaced}");
    assert_eq!(replaced["credential_version"], 2);
    let approver = h.member("approver").await;
    let (status, decided) = h
        .decide(
            &approver,
            pending[0]["id"].as_str().unwrap(),
            "approve",
            "fine",
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{decided}");
    assert!(
        h.engine.run_next().await.unwrap(),
        "the approved run resumes"
    );

    let run = h.get_run(&run_id).await;
    assert_eq!(run["status"], "failed", "{run:#}");
    let outcome = run["outcome"].as_str().unwrap();
    assert!(
        outcome.contains("key was replaced") && outcome.contains("credential version 1, now 2"),
        "{outcome}"
    );
    assert_eq!(*notes.lock().unwrap(), 0, "the approved call did not run");
    let seen = seen.requests.lock().unwrap();
    assert_eq!(seen.len(), 1, "no model call with the new key: {seen:?}");
    assert_eq!(
        seen[0].1.as_deref(),
        Some("Bearer sk-first-0123456789abcdef")
    );
}

/// A model that asks for a note first, then, once it has the result, answers with text that
/// streams slowly.
async fn calling_then_streaming_model() -> SocketAddr {
    let calls = Arc::new(Mutex::new(0usize));
    let route = axum::routing::post(move || {
        let calls = calls.clone();
        async move {
            let first = {
                let mut calls = calls.lock().unwrap();
                *calls += 1;
                *calls == 1
            };
            let mut chunks: Vec<(u64, String)> = if first {
                vec![(
                    0,
                    format!(
                        "data: {}\n\ndata: {}\n\n",
                        json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0,
                            "id": "call_1", "type": "function", "function": {"name":
                            "notes__send_note", "arguments": "{\"text\":\"hi\"}"}}]},
                            "finish_reason": null}]}),
                        json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
                    ),
                )]
            } else {
                // More than the 256 bytes the stream holds back, each piece a moment apart.
                let filler = "the note went out. ".repeat(8);
                (0..4)
                    .map(|_| {
                        (
                            100,
                            format!(
                                "data: {}\n\n",
                                json!({"choices": [{"index": 0, "delta": {"content": filler}}]})
                            ),
                        )
                    })
                    .chain(std::iter::once((
                        300,
                        format!(
                            "data: {}\n\n",
                            json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
                        ),
                    )))
                    .collect()
            };
            chunks.push((
                0,
                format!(
                    "data: {}\n\ndata: [DONE]\n\n",
                    json!({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 12}})
                ),
            ));
            let stream =
                futures_util::stream::unfold(chunks.into_iter(), |mut chunks| async move {
                    let (pause, chunk) = chunks.next()?;
                    tokio::time::sleep(std::time::Duration::from_millis(pause)).await;
                    Some((Ok::<_, std::convert::Infallible>(chunk), chunks))
                });
            axum::response::Response::builder()
                .header("content-type", "text/event-stream")
                .body(axum::body::Body::from_stream(stream))
                .unwrap()
        }
    });
    common::serve(Router::new().route("/v1/chat/completions", route)).await
}

#[tokio::test]
async fn a_turns_streamed_text_follows_the_tool_result_it_answers() {
    use http_body_util::BodyExt;
    use tower::ServiceExt;

    let h = Harness::new().await;
    let model = calling_then_streaming_model().await;
    let tool = common::serve(Router::new().route(
        "/v1/notes",
        axum::routing::post(|| async { axum::Json(json!({"status": "sent"})) }),
    ))
    .await;
    let (status, created) = h
        .call(
            Method::POST,
            "/v1/tool-connections",
            Some(json!({"name": "notes", "kind": "http_api", "url": format!("http://{tool}/v1"),
                "allowlist": [tool.to_string()], "tools": [{"name": "send_note", "description": "Sends a note",
                "method": "POST", "path": "/notes",
                "inputSchema": {"type": "object", "properties": {"text": {"type": "string"}}}}]})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    h.review_and_enable(created["id"].as_str().unwrap(), &[])
        .await;
    let (status, connection) = h
        .call(
            Method::POST,
            "/v1/model-connections",
            Some(json!({"name": "cloud", "provider": "openai_compatible",
                "base_url": format!("http://{model}/v1"), "api_key": "sk-first-0123456789abcdef"})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{connection}");
    let toml = "name = \"noter\"\ninstructions = \"Send a note.\"\n[model]\nprovider = \"openai_compatible\"\n\
                connection = \"cloud\"\nmodel = \"m\"\n[[tools]]\ntool = \"notes/send_note\"\nmode = \"auto\"\n";
    let (status, applied) = h
        .call(Method::POST, "/v1/routines", Some(json!({ "toml": toml })))
        .await;
    assert_eq!(status, StatusCode::CREATED, "{applied}");
    let routine = applied["routine"]["id"].as_str().unwrap();
    let (_, run) = h
        .call(
            Method::POST,
            &format!("/v1/routines/{routine}/runs"),
            Some(json!({"input": "go"})),
        )
        .await;
    let run_id = run["id"].as_str().unwrap().to_owned();
    let request = axum::http::Request::builder()
        .uri(format!("/v1/runs/{run_id}/events"))
        .header("authorization", format!("Bearer {}", h.owner()))
        .body(axum::body::Body::empty())
        .unwrap();
    let response = h.router.clone().oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let reader = tokio::spawn(async move {
        let mut body = response.into_body();
        let mut seen = String::new();
        while let Some(frame) = body.frame().await {
            if let Ok(data) = frame.unwrap().into_data() {
                seen.push_str(&String::from_utf8_lossy(&data));
                if seen.contains("event: end") {
                    break;
                }
            }
        }
        seen
    });
    assert!(h.engine.run_next().await.unwrap());
    let seen = tokio::time::timeout(std::time::Duration::from_secs(20), reader)
        .await
        .unwrap()
        .unwrap();
    let at = |needle: &str| {
        seen.find(needle)
            .unwrap_or_else(|| panic!("no `{needle}` in: {seen}"))
    };
    let result = at("\"tool_result\"");
    let text = at("event: text");
    let answer = seen.rfind("\"model_turn\"").unwrap();
    assert!(
        result < text && text < answer,
        "the text came before the result it answers, or after its turn: {seen}"
    );
}
