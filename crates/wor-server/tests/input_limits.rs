//! Input the server must bound or refuse, through the real API: recursive input nested past
//! its limit (Cedar policy text, routine TOML, JSON bodies, tool arguments and MCP results)
//! answers a 400 naming the limit instead of overflowing a worker's stack; U+0000, which
//! PostgreSQL text cannot hold, is refused in API input and replaced in what a run produces, the
//! same on both backends; a malformed replay script is refused when its routine is applied.
//!
//! The tests run on the test's own thread, whose stack is the size of a tokio worker's: an
//! overflow aborts the test binary.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic,
    reason = "tests fail loudly"
)]

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::http::{Method, StatusCode};
use rmcp::ServerHandler;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, ErrorData,
    InitializeResult, ListToolsResult, PaginatedRequestParams, ServerCapabilities, Tool,
};
use rmcp::service::{RequestContext, RoleServer};
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use serde_json::{Value, json};
use wor_core::json_depth::MAX_JSON_NESTING;

mod common;

use common::{Harness, serve, steps_of};

fn assert_bad_request(status: StatusCode, body: &Value, code: &str, needle: &str) {
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert_eq!(body["error"]["code"], code, "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains(needle), "`{needle}` not in: {message}");
}

fn replay_routine(name: &str, script: &str) -> String {
    format!(
        "name = \"{name}\"\ninstructions = \"Do the task.\"\n[model]\nprovider = \"replay\"\nmodel = \"script\"\n{script}"
    )
}

fn nested_parens(levels: usize) -> String {
    format!(
        "permit (principal, action, resource)\nwhen {{ {}true{} }};",
        "(".repeat(levels),
        ")".repeat(levels)
    )
}

// ---------------------------------------------------------------------------------------------
// Depth

#[tokio::test]
async fn a_deeply_nested_project_policy_is_refused_naming_the_limit() {
    let h = Harness::new().await;
    // 144 levels aborted the server before.
    for text in [
        nested_parens(144),
        format!(
            "permit (principal, action, resource)\nwhen {{ {}true{}.isEmpty() }};",
            "[".repeat(200),
            "]".repeat(200)
        ),
        format!(
            "permit (principal, action, resource)\nwhen {{ context.budget_used.turns{} > 0 }};",
            " + 1".repeat(20_000)
        ),
    ] {
        let (status, body) = h
            .call(Method::PUT, "/v1/policy", Some(json!({ "text": text })))
            .await;
        assert_bad_request(status, &body, "invalid_policy", "project policy, line 2");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("deeper than 32 levels") || message.contains("deeper than 256"),
            "{message}"
        );
    }
    // At the limit it is saved.
    let (status, body) = h
        .call(
            Method::PUT,
            "/v1/policy",
            Some(json!({ "text": nested_parens(31) })),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
}

#[tokio::test]
async fn a_deeply_nested_routine_policy_is_refused_when_applied() {
    let h = Harness::new().await;
    let routine = format!(
        "policy = '''\n{}\n'''\n{}",
        nested_parens(150),
        replay_routine("deep-policy", "script = { turns = [{ text = \"hi\" }] }\n")
    );
    let (status, body) = h
        .call(
            Method::POST,
            "/v1/routines",
            Some(json!({ "toml": routine })),
        )
        .await;
    assert_bad_request(
        status,
        &body,
        "invalid_routine",
        "`policy`: routine policy, line 2",
    );
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("deeper than 32 levels"),
        "{body}"
    );
}

#[tokio::test]
async fn deeply_nested_routine_toml_is_refused_naming_the_limit() {
    let h = Harness::new().await;
    for value in [
        format!("{}1{}", "[".repeat(200), "]".repeat(200)),
        format!("{}1{}", "{ a = ".repeat(200), " }".repeat(200)),
    ] {
        let routine = replay_routine(
            "deep-toml",
            &format!(
                "script = {{ turns = [{{ tool_calls = [{{ name = \"t\", arguments = {{ v = {value} }} }}] }}] }}\n"
            ),
        );
        let (status, body) = h
            .call(
                Method::POST,
                "/v1/routines",
                Some(json!({ "toml": routine })),
            )
            .await;
        assert_bad_request(status, &body, "invalid_routine", "line 6: ");
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("deeper than 80 levels"),
            "{body}"
        );
    }
}

#[tokio::test]
async fn a_deeply_nested_json_body_is_refused_naming_the_limit() {
    let h = Harness::new().await;
    let (status, applied) = h
        .call(
            Method::POST,
            "/v1/routines",
            Some(json!({ "toml": replay_routine("deep-json", "script = { turns = [{ text = \"hi\" }] }\n") })),
        )
        .await;
    assert!(status.is_success(), "{applied}");
    let id = applied["routine"]["id"].as_str().unwrap();
    for levels in [MAX_JSON_NESTING, 5000] {
        let body = format!("{{\"input\": {}}}", nested_array(levels));
        let (status, reply, _) = h
            .call_raw(Method::POST, &format!("/v1/routines/{id}/runs"), &body)
            .await;
        assert_bad_request(status, &reply, "invalid_json", "deeper than 64 levels");
    }
    let body = format!("{{\"input\": {}}}", nested_array(MAX_JSON_NESTING - 1));
    let (status, reply, text) = h
        .call_raw(Method::POST, &format!("/v1/routines/{id}/runs"), &body)
        .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{reply}");
    assert!(!text.is_empty());
}

// ---------------------------------------------------------------------------------------------
// Deep tool arguments and MCP results, through a small MCP server of our own.

#[derive(Debug, Clone, Default)]
struct Depths {
    calls: Arc<Mutex<Vec<String>>>,
}

fn nested_array(levels: usize) -> String {
    format!("{}1{}", "[".repeat(levels), "]".repeat(levels))
}

impl ServerHandler for Depths {
    fn get_info(&self) -> InitializeResult {
        InitializeResult::new(ServerCapabilities::builder().enable_tools().build())
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        // `take` validates its argument recursively, as deep as the value goes.
        let recursive = json!({
            "type": "object",
            "$defs": {"node": {"anyOf": [{"type": "integer"}, {"type": "array", "items": {"$ref": "#/$defs/node"}}]}},
            "properties": {"v": {"$ref": "#/$defs/node"}},
        });
        let plain = json!({"type": "object", "properties": {}});
        Ok(ListToolsResult::with_all_items(vec![
            Tool::new(
                "offer",
                "Offers deep arguments",
                Arc::new(plain.as_object().unwrap().clone()),
            ),
            Tool::new(
                "take",
                "Takes deep arguments",
                Arc::new(recursive.as_object().unwrap().clone()),
            ),
            Tool::new(
                "flood",
                "Answers with deep JSON",
                Arc::new(plain.as_object().unwrap().clone()),
            ),
        ]))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        self.calls.lock().unwrap().push(request.name.to_string());
        Ok(match request.name.as_ref() {
            // Just under serde_json's limit once inside `{"v": …}`.
            "offer" => CallToolResult::success(vec![ContentBlock::text(format!(
                "ARGS: {{\"v\": {}}}",
                nested_array(120)
            ))]),
            // Built by hand: past any JSON parser's default limit.
            "flood" => CallToolResult::structured(
                (0..500).fold(json!(1), |inner, _| json!({ "a": inner })),
            ),
            other => CallToolResult::success(vec![ContentBlock::text(format!("{other} done"))]),
        }
        .into())
    }
}

async fn serve_depths(depths: Depths) -> SocketAddr {
    // Answers as plain JSON: a message refused within a server-sent event stream is only
    // noticed when the request times out (rmcp waits for the answer), which is slow to test.
    let config = StreamableHttpServerConfig::default()
        .with_legacy_session_mode(false)
        .with_json_response(true);
    let service = StreamableHttpService::new(
        move || Ok(depths.clone()),
        Arc::new(LocalSessionManager::default()),
        config,
    );
    serve(Router::new().nest_service("/mcp", service)).await
}

#[tokio::test]
async fn deep_tool_arguments_and_deep_mcp_results_end_a_run_without_overflowing() {
    let depths = Depths::default();
    let addr = serve_depths(depths.clone()).await;
    let h = Harness::new().await;
    h.connect_and_enable("depths", addr, json!({}), &["offer", "take", "flood"])
        .await;
    // Arguments at the limit, validated against a recursive schema; a result nested 500 deep;
    // then 120-deep arguments the model copies from a tool result.
    let script = format!(
        "[[model.script.turns]]\ntool_calls = [{{ name = \"depths__take\", arguments = {{ v = {} }} }}]\n\
         [[model.script.turns]]\ntool_calls = [{{ name = \"depths__flood\" }}]\n\
         [[model.script.turns]]\ntool_calls = [{{ name = \"depths__offer\" }}]\n\
         [[model.script.turns]]\nwhen = {{ last_tool_result_contains = \"ARGS:\" }}\n\
         tool_calls = [{{ name = \"depths__take\", arguments_after = \"ARGS:\" }}]\n\
         [[model.script.turns]]\ntext = \"done\"\n",
        nested_array(MAX_JSON_NESTING - 1)
    );
    let routine = format!(
        "{}\n[[tools]]\ntool = \"depths/offer\"\nmode = \"auto\"\n\
         [[tools]]\ntool = \"depths/take\"\nmode = \"auto\"\n\
         [[tools]]\ntool = \"depths/flood\"\nmode = \"auto\"\n",
        replay_routine("deep-calls", &script)
    );
    let run = h.run(&routine).await;
    assert_eq!(run["status"], "failed", "{run:#}");
    assert_eq!(
        run["outcome"],
        format!(
            "the model's call of `depths__take` has arguments nested deeper than {MAX_JSON_NESTING} levels"
        ),
        "{run:#}"
    );
    // The call at the limit ran with its arguments as written.
    let calls = steps_of(&run, "tool_call");
    assert_eq!(calls.len(), 3, "{run:#}");
    assert_eq!(
        calls[0]["payload"]["arguments"]["v"].to_string(),
        nested_array(MAX_JSON_NESTING - 1)
    );
    let results = steps_of(&run, "tool_result");
    assert_eq!(
        results[0]["payload"]["result"]["is_error"], false,
        "{run:#}"
    );
    // The deep result is refused before it is parsed and reported as the call's failure.
    let flood = &results[1]["payload"]["result"];
    assert_eq!(flood["is_error"], true, "{run:#}");
    assert!(
        flood["content"]
            .as_str()
            .unwrap()
            .contains("nested deeper than 128 levels"),
        "{flood}"
    );
    assert_eq!(
        depths.calls.lock().unwrap().clone(),
        ["take", "flood", "offer"]
    );
}

// ---------------------------------------------------------------------------------------------
// U+0000

#[tokio::test]
async fn a_nul_in_api_input_is_refused_naming_the_field() {
    let h = Harness::new().await;
    let (status, body) = h
        .call(
            Method::PUT,
            "/v1/policy",
            Some(json!({ "text": "// a comment with \u{0} in it\npermit (principal, action, resource);\n" })),
        )
        .await;
    assert_bad_request(
        status,
        &body,
        "invalid_body",
        "`text` contains a NUL character (U+0000)",
    );
    let (status, applied) = h
        .call(
            Method::POST,
            "/v1/routines",
            Some(json!({ "toml": replay_routine("nul-input", "script = { turns = [{ text = \"hi\" }] }\n") })),
        )
        .await;
    assert!(status.is_success(), "{applied}");
    let id = applied["routine"]["id"].as_str().unwrap();
    for input in [json!("before\u{0}after"), json!({"nested": ["x", "\u{0}"]})] {
        let (status, body) = h
            .call(
                Method::POST,
                &format!("/v1/routines/{id}/runs"),
                Some(json!({ "input": input })),
            )
            .await;
        assert_bad_request(
            status,
            &body,
            "invalid_body",
            "`input` contains a NUL character (U+0000)",
        );
    }
    // An escaped backslash followed by `u0000` is not a NUL.
    let (status, body, _) = h
        .call_raw(
            Method::POST,
            &format!("/v1/routines/{id}/runs"),
            r#"{"input": "a \\u0000 b"}"#,
        )
        .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    // A TOML escape that reads as U+0000 is refused naming its field, wherever it is, and so
    // is JSON written as a TOML string that reads as one; in a literal string the same
    // characters are text, and kept.
    let routine = |extra: &str| {
        format!(
            "name = \"nul-toml\"\ninstructions = \"Do the task.\"\n[model]\nprovider = \"replay\"\nmodel = \"script\"\nscript = {{ turns = [{{ text = \"hi\" }}] }}\n{extra}"
        )
    };
    for (field, toml) in [
        (
            "`instructions`",
            routine("").replace("Do the task.", r"Do \u0000 the task."),
        ),
        (
            "`description`",
            routine("").replace("[model]", "description = \"a \\x00 b\"\n[model]"),
        ),
        (
            "`instructions`",
            routine("").replace(
                "\"Do the task.\"",
                "\"\"\"\nDo the\\\n  \\x00 task.\n\"\"\"",
            ),
        ),
        // Beside a replay script holding one (exempt: a run replaces U+0000 in a model's
        // replies, a_nul_in_a_model_reply_is_replaced_and_the_run_ends_at_once).
        (
            "`notify.url`",
            routine("[notify]\nurl = \"https://hooks.example.com/\\U00000000\"\n")
                .replace("text = \"hi\"", r#"text = "a \u0000 reply""#),
        ),
        (
            "`tools[0].tool`",
            routine("[[tools]]\ntool = \"desk/\\u0000\"\nmode = \"auto\"\n"),
        ),
        (
            "a key of `tools[0].pinned`",
            routine(
                "[[tools]]\ntool = \"desk/send\"\nmode = \"auto\"\npinned = { \"a\\u0000\" = 1 }\n",
            ),
        ),
        (
            "`output.schema`",
            routine("[output]\nschema = '{\"type\": \"object\", \"title\": \"\\u0000\"}'\n"),
        ),
    ] {
        let (status, body) = h
            .call(Method::POST, "/v1/routines", Some(json!({ "toml": toml })))
            .await;
        assert_bad_request(
            status,
            &body,
            "invalid_routine",
            &format!("{field} holds a NUL character (U+0000)"),
        );
    }
    let literal = r#"name = "nul-literal"
instructions = 'Do \u0000 the task.'
[model]
provider = "replay"
model = "script"
script = { turns = [{ text = "hi" }] }
"#;
    let (status, body) = h
        .call(
            Method::POST,
            "/v1/routines",
            Some(json!({ "toml": literal })),
        )
        .await;
    assert!(status.is_success(), "{body}");
    // A path or query holding `%00` is refused before any handler reads it.
    for (path, code) in [
        ("/v1/routines/rtn_%00", "invalid_path"),
        ("/v1/whoami?x=%00", "invalid_query"),
        ("/v1/runs?status=a%00b", "invalid_query"),
    ] {
        let (status, body) = h.call(Method::GET, path, None).await;
        assert_bad_request(status, &body, code, "NUL character (U+0000)");
    }
    // Nothing was saved.
    let (_, policy) = h.call(Method::GET, "/v1/policy", None).await;
    assert_eq!(policy["is_default"], true);
}

#[tokio::test]
async fn a_nul_in_a_model_reply_is_replaced_and_the_run_ends_at_once() {
    let h = Harness::new().await;
    let routine = replay_routine(
        "nul-reply",
        "[[model.script.turns]]\ntext = \"before\\u0000after\"\n",
    );
    let started = std::time::Instant::now();
    let run = h.run(&routine).await;
    assert!(started.elapsed() < std::time::Duration::from_secs(10));
    assert_eq!(run["status"], "succeeded", "{run:#}");
    assert_eq!(run["outcome"], "before\u{FFFD}after", "{run:#}");
    let turn = &steps_of(&run, "model_turn")[0]["payload"];
    assert_eq!(turn["message"]["text"], "before\u{FFFD}after", "{turn}");
    assert_eq!(turn["nul_replaced"], true, "{turn}");
}

// ---------------------------------------------------------------------------------------------
// Replay scripts

#[tokio::test]
async fn a_malformed_replay_script_is_refused_when_applied_with_its_line() {
    let h = Harness::new().await;
    for (script, needle) in [
        (
            "[[model.script.turns]]\ntext = \"hi\"\ntypo = 1\n",
            "line 8: unknown field `typo`",
        ),
        (
            "[[model.script.turns]]\ntool_calls = [{ name = \"t\", arguments = {}, arguments_after = \"m\" }]\n",
            "line 6: `model.script`: tool call `t` of turn 1 has both `arguments` and `arguments_after`",
        ),
        (
            "[[model.script.turns]]\ntext = \"hi\"\n[[model.script.turns]]\nrepeat = true\n",
            "line 8: `model.script`: turn 2 has neither text nor tool calls",
        ),
        (
            "script = { turns = [] }\n",
            "line 3: `model.script`: the script has no turns",
        ),
        (
            "script = \"turns.toml\"\n",
            "line 6: `model.script`: invalid type: string \"turns.toml\"",
        ),
    ] {
        let (status, body) = h
            .call(
                Method::POST,
                "/v1/routines",
                Some(json!({ "toml": replay_routine("bad-script", script) })),
            )
            .await;
        assert_bad_request(status, &body, "invalid_routine", needle);
    }
    let (_, routines) = h.call(Method::GET, "/v1/routines", None).await;
    assert_eq!(routines.as_array().unwrap().len(), 0, "{routines}");
}
