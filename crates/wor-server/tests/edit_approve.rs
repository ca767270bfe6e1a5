//! Edit and approve: an approver corrects a held call's arguments (never the pinned ones); the
//! approval binds to the edited call, which runs exactly once with them; the model is told it
//! ran with edited arguments; both calls are audited; and policy decides the edited call again,
//! so an edit cannot turn a denied call into an allowed one.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic,
    reason = "test helpers fail loudly"
)]

mod common;

use std::sync::{Arc, Mutex};

use axum::Router;
use axum::http::{Method, StatusCode};
use common::{Harness, serve, steps_of};
use serde_json::{Value, json};

/// An HTTP API tool whose `send_note` is held for approval, with `to` pinned; returns what it
/// received.
async fn notes_tool(h: &Harness) -> Arc<Mutex<Vec<Value>>> {
    let sent: Arc<Mutex<Vec<Value>>> = Arc::default();
    let sink = sent.clone();
    let api = Router::new().route(
        "/v1/notes",
        axum::routing::post(move |axum::Json(body): axum::Json<Value>| {
            let sink = sink.clone();
            async move {
                sink.lock().unwrap().push(body);
                axum::Json(json!({"status": "sent"}))
            }
        }),
    );
    let addr = serve(api).await;
    let tools = json!([
        {"name": "send_note", "description": "Sends a note", "method": "POST", "path": "/notes",
         "inputSchema": {"type": "object", "properties": {"to": {"type": "string"}, "text": {"type": "string"}}}}
    ]);
    let (status, created) = h
        .call(
            Method::POST,
            "/v1/tool-connections",
            Some(
                json!({"name": "notes", "kind": "http_api", "url": format!("http://{addr}/v1"),
                "allowlist": [addr.to_string()], "tools": tools}),
            ),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    h.review_and_enable(created["id"].as_str().unwrap(), &[])
        .await;
    sent
}

const ROUTINE: &str = r#"
name = "note-sender"
instructions = "Send the note."
policy = '''
@id("no-passwords-in-notes")
forbid (principal, action, resource) when {
  context.arguments.hasTag("text") && context.arguments.getTag("text") like "*password*"
};
'''
[model]
provider = "replay"
model = "script"
[[model.script.turns]]
when = { last_tool_result_contains = "sent" }
text = "sent it"
[[model.script.turns]]
when = { last_tool_result_contains = "refused" }
text = "it was refused"
[[model.script.turns]]
tool_calls = [{ name = "notes__send_note", arguments = { text = "helo wrld" } }]
[[tools]]
tool = "notes/send_note"
mode = "confirm"
pinned = { to = "team@example.com" }
[concurrency]
max_runs = 5
"#;

async fn parked(h: &Harness, routine: &str) -> (String, String) {
    let (status, run) = h
        .call(
            Method::POST,
            &format!("/v1/routines/{routine}/runs"),
            Some(json!({"input": "send it"})),
        )
        .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{run}");
    let run = run["id"].as_str().unwrap().to_owned();
    assert!(h.engine.run_next().await.unwrap(), "no run was queued");
    let pending = h.pending_approvals(&run).await;
    assert_eq!(pending.len(), 1, "{pending:?}");
    (run, pending[0]["id"].as_str().unwrap().to_owned())
}

async fn edit(h: &Harness, key: &str, approval: &str, body: Value) -> (StatusCode, Value) {
    let (status, body, _) = h
        .call_as(
            key,
            Method::POST,
            &format!("/v1/approvals/{approval}/edit-and-approve"),
            Some(body),
        )
        .await;
    (status, body)
}

#[tokio::test]
async fn an_edited_call_runs_once_with_its_edits_and_both_calls_are_audited() {
    let h = Harness::new().await;
    let sent = notes_tool(&h).await;
    let (status, applied) = h
        .call(Method::POST, "/v1/routines", Some(json!({"toml": ROUTINE})))
        .await;
    assert_eq!(status, StatusCode::CREATED, "{applied}");
    let routine = applied["routine"]["id"].as_str().unwrap().to_owned();
    let approver = h.member("approver").await;
    let (run, approval) = parked(&h, &routine).await;
    let (_, before) = h
        .call(Method::GET, &format!("/v1/approvals/{approval}"), None)
        .await;
    let original_binding = before["binding_hash"].as_str().unwrap().to_owned();

    // A pinned argument cannot be edited; an edit that changes nothing, or is no object, is
    // refused; the run's starter may not edit either, as they may not approve.
    for (body, needle) in [
        (
            json!({"arguments": {"to": "me@evil.example"}, "reason": "r"}),
            "pinned",
        ),
        (
            json!({"arguments": {"text": "helo wrld"}, "reason": "r"}),
            "changes nothing",
        ),
        (json!({"arguments": [], "reason": "r"}), "arguments"),
        (json!({"arguments": {}, "reason": "r"}), "arguments"),
        // A name neither the call nor the tool has: a misspelt `text`, not an extra argument.
        (
            json!({"arguments": {"txet": "hello world"}, "reason": "r"}),
            "`txet` is neither an argument of the call nor one the tool declares",
        ),
    ] {
        let (status, answer) = edit(&h, &approver, &approval, body.clone()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {answer}");
        assert!(answer.to_string().contains(needle), "{body}: {answer}");
    }
    let (status, _) = edit(
        &h,
        h.owner(),
        &approval,
        json!({"arguments": {"text": "hello world"}, "reason": "typo"}),
    )
    .await;
    assert_eq!(status, StatusCode::FORBIDDEN, "the starter cannot approve");

    // The approver corrects the typo and approves: the approval binds to the edited call.
    let (status, decided) = edit(
        &h,
        &approver,
        &approval,
        json!({"arguments": {"text": "hello world"}, "reason": "fixed the typo"}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{decided}");
    assert_eq!(decided["status"], "approved");
    assert_eq!(
        decided["arguments"]["text"], "helo wrld",
        "the original stays"
    );
    assert_eq!(
        decided["edited_arguments"],
        json!({"text": "hello world", "to": "team@example.com"})
    );
    assert_ne!(decided["binding_hash"], original_binding.as_str());
    // Decided once: a second edit or decision is refused as already decided, whatever the
    // edit would be (one that changes nothing, or a pinned argument, included).
    for body in [
        json!({"arguments": {"text": "again"}, "reason": "r"}),
        json!({"arguments": {"text": "helo wrld"}, "reason": "r"}),
        json!({"arguments": {"to": "me@evil.example"}, "reason": "r"}),
    ] {
        let (status, refused) = edit(&h, &approver, &approval, body).await;
        assert_eq!(status, StatusCode::CONFLICT, "{refused}");
        assert!(
            refused["error"]["message"]
                .as_str()
                .unwrap()
                .contains("already approved"),
            "{refused}"
        );
    }

    // The run resumes: the edited call runs exactly once, with the pinned value still pinned.
    while h.engine.run_next().await.unwrap() {}
    let run_view = h.get_run(&run).await;
    assert_eq!(run_view["status"], "succeeded", "{run_view:#}");
    let notes = sent.lock().unwrap().clone();
    assert_eq!(
        notes,
        [json!({"text": "hello world", "to": "team@example.com"})]
    );
    // The model was told the call ran with edited arguments (never the pinned one).
    let results = steps_of(&run_view, "tool_result");
    let told = results[0].to_string();
    assert!(told.contains("edited this call"), "{told}");
    assert!(told.contains("hello world"), "{told}");
    assert!(!told.contains("team@example.com"), "{told}");

    // The decision's audit entry holds both calls and both bindings.
    let (_, audit) = h.call(Method::GET, "/v1/audit?limit=1000", None).await;
    let entries = audit["entries"].as_array().unwrap();
    let decide = entries
        .iter()
        .find(|e| e["category"] == "approval.decide")
        .unwrap();
    assert_eq!(decide["payload"]["original_arguments"]["text"], "helo wrld");
    assert_eq!(decide["payload"]["edited_arguments"]["text"], "hello world");
    assert_eq!(
        decide["payload"]["original_binding_hash"],
        original_binding.as_str()
    );
    assert_eq!(decide["payload"]["binding_hash"], decided["binding_hash"]);
    let used: Vec<&Value> = entries
        .iter()
        .filter(|e| e["category"] == "approval.use")
        .collect();
    assert_eq!(used.len(), 1, "used once");
    assert_eq!(used[0]["payload"]["binding_hash"], decided["binding_hash"]);

    // An edit policy denies is refused when the approver decides, naming the policy, and
    // the call stays pending: an edit cannot turn a denied call into an allowed one.
    let (run, approval) = parked(&h, &routine).await;
    let (status, refused) = edit(
        &h,
        &approver,
        &approval,
        json!({"arguments": {"text": "the password is hunter2"}, "reason": "sure"}),
    )
    .await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{refused}");
    let message = refused["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("policy denies the edited call"),
        "{message}"
    );
    assert!(message.contains("no-passwords-in-notes"), "{message}");
    // Arguments that do not fit the tool's pinned schema are refused too, naming the argument.
    let (status, refused) = edit(
        &h,
        &approver,
        &approval,
        json!({"arguments": {"text": 42}, "reason": "sure"}),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{refused}");
    let message = refused["error"]["message"].as_str().unwrap();
    assert!(message.contains("`text`"), "{message}");
    assert!(message.contains("schema"), "{message}");
    let (_, still) = h
        .call(Method::GET, &format!("/v1/approvals/{approval}"), None)
        .await;
    assert_eq!(still["status"], "pending", "nothing was decided: {still}");

    // Checked again when the run resumes: an edit that passed when it was decided but that
    // policy denies by then (the project's policy changed meanwhile) is not run.
    let (status, decided) = edit(
        &h,
        &approver,
        &approval,
        json!({"arguments": {"text": "hello world"}, "reason": "fixed the typo"}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{decided}");
    let stricter = format!(
        "{}\n@id(\"no-worlds\")\nforbid (principal, action, resource) when {{\n  context.arguments.hasTag(\"text\") && context.arguments.getTag(\"text\") like \"*world*\"\n}};\n",
        wor_policy::DEFAULT_PROJECT_POLICY
    );
    let (status, saved) = h
        .call(Method::PUT, "/v1/policy", Some(json!({"text": stricter})))
        .await;
    assert_eq!(status, StatusCode::OK, "{saved}");
    while h.engine.run_next().await.unwrap() {}
    let run_view = h.get_run(&run).await;
    assert_eq!(sent.lock().unwrap().len(), 1, "the denied edit did not run");
    let told = steps_of(&run_view, "tool_result")[0].to_string();
    assert!(told.contains("refused by policy"), "{told}");
    let audit = h.audit_text().await;
    assert!(audit.contains("edit_denied"), "{audit}");
}
