//! Approval requests in Slack, against a loopback fake of Slack's Web API and signed
//! interaction callbacks: one message per matching route, delivered through the outbox with
//! retries; Approve from a linked approver resumes the run through the engine; forged,
//! replayed, unlinked, starter and viewer presses are refused and the message says why; a
//! decision through the API, or an expiry, updates every message.
#![allow(
    clippy::disallowed_methods,
    reason = "the test plays a browser reaching the server under test on loopback"
)]
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic,
    reason = "test helpers fail loudly"
)]

mod common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderMap, Method, Request, StatusCode};
use common::{Harness, serve};
use http_body_util::BodyExt;
use serde_json::{Value, json};
use tower::ServiceExt;

const BOT_TOKEN: &str = "xoxb-test-1111-2222-abcdefabcdef";
const SIGNING_SECRET: &str = "slack-signing-secret-for-the-test";
const CONSOLE_URL: &str = "https://wor.example.com";

/// Every call the fake Slack Web API received: (method, authorization, body).
type Calls = Arc<Mutex<Vec<(String, String, Value)>>>;

/// A loopback fake of Slack's Web API. The first `fail_first` calls answer 500.
async fn fake_slack(fail_first: usize) -> (SocketAddr, Calls) {
    let calls: Calls = Arc::default();
    let sink = calls.clone();
    let seen = Arc::new(Mutex::new(0_usize));
    let app = Router::new().route(
        "/api/{method}",
        axum::routing::post(
            move |axum::extract::Path(method): axum::extract::Path<String>,
                  headers: HeaderMap,
                  body: axum::body::Bytes| {
                let sink = sink.clone();
                let seen = seen.clone();
                async move {
                    let n = {
                        let mut seen = seen.lock().unwrap();
                        *seen += 1;
                        *seen
                    };
                    if n <= fail_first {
                        return (
                            StatusCode::INTERNAL_SERVER_ERROR,
                            axum::Json(json!({"ok": false})),
                        );
                    }
                    let auth = headers
                        .get("authorization")
                        .map(|v| v.to_str().unwrap().to_owned())
                        .unwrap_or_default();
                    let body: Value = serde_json::from_slice(&body).unwrap();
                    let channel = body["channel"].clone();
                    let ts = body
                        .get("ts")
                        .cloned()
                        .unwrap_or_else(|| json!(format!("1700000000.{n:06}")));
                    sink.lock().unwrap().push((method, auth, body));
                    (
                        StatusCode::OK,
                        axum::Json(json!({"ok": true, "channel": channel, "ts": ts})),
                    )
                }
            },
        ),
    );
    (serve(app).await, calls)
}

/// An HTTP API tool server whose `send_note` is held for approval, with `to` pinned.
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

fn routine() -> String {
    let long = "x".repeat(300);
    format!(
        r#"
name = "note-sender"
instructions = "Send the note."
[model]
provider = "replay"
model = "script"
[[model.script.turns]]
when = {{ last_tool_result_contains = "sent" }}
text = "sent it"
[[model.script.turns]]
tool_calls = [{{ name = "notes__send_note", arguments = {{ text = "{long}" }} }}]
[[tools]]
tool = "notes/send_note"
mode = "confirm"
pinned = {{ to = "team@example.com" }}
[concurrency]
max_runs = 5
"#
    )
}

async fn apply_routine(h: &Harness) -> String {
    let (status, applied) = h
        .call(
            Method::POST,
            "/v1/routines",
            Some(json!({"toml": routine()})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{applied}");
    applied["routine"]["id"].as_str().unwrap().to_owned()
}

/// Starts a run as `key` and drives it until it parks; returns the run and approval ids.
async fn parked_run(h: &Harness, key: &str, routine: &str) -> (String, String) {
    let (status, run, _) = h
        .call_as(
            key,
            Method::POST,
            &format!("/v1/routines/{routine}/runs"),
            Some(json!({"input": "send it"})),
        )
        .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{run}");
    let id = run["id"].as_str().unwrap().to_owned();
    assert!(h.engine.run_next().await.unwrap(), "no run was queued");
    let pending = h.pending_approvals(&id).await;
    assert_eq!(pending.len(), 1);
    (id, pending[0]["id"].as_str().unwrap().to_owned())
}

async fn slack_route(h: &Harness, name: &str, slack: SocketAddr, tool: Option<&str>) -> String {
    let (status, route) = h
        .call(
            Method::POST,
            "/v1/notification-routes",
            Some(json!({"name": name, "kind": "slack", "channel": format!("C{}", name.to_uppercase()),
                "slack_api_url": format!("http://{slack}/api"), "slack_bot_token": BOT_TOKEN,
                "slack_signing_secret": SIGNING_SECRET, "tool": tool})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{route}");
    // Secrets go in and never come out (S3).
    assert!(!route.to_string().contains(BOT_TOKEN));
    assert!(!route.to_string().contains(SIGNING_SECRET));
    assert_eq!(route["slack_bot_token"]["configured"], true);
    route["id"].as_str().unwrap().to_owned()
}

/// A `block_actions` payload as Slack posts it, form-encoded.
fn press(user: &str, action: &str, approval: &str, trigger: &str) -> String {
    let payload = json!({"type": "block_actions", "trigger_id": trigger,
        "user": {"id": user, "team_id": "T0TEAM"}, "team": {"id": "T0TEAM"},
        "channel": {"id": "CALL"},
        "actions": [{"action_id": action, "block_id": "wor_decision", "value": approval}]});
    url::form_urlencoded::Serializer::new(String::new())
        .append_pair("payload", &payload.to_string())
        .finish()
}

async fn interact(
    h: &Harness,
    route: &str,
    body: &str,
    secret: &str,
    timestamp: i64,
) -> (StatusCode, Value) {
    let signature = wor_secrets::slack_signature::sign(secret, timestamp, body.as_bytes());
    let request = Request::builder()
        .method(Method::POST)
        .uri(format!("/hooks/slack/{route}"))
        .header("content-type", "application/x-www-form-urlencoded")
        .header("x-slack-request-timestamp", timestamp.to_string())
        .header("x-slack-signature", signature)
        .body(Body::from(body.to_owned()))
        .unwrap();
    let response = h.router.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

fn now_secs() -> i64 {
    wor_store::now_millis() / 1000
}

/// Sends every notification due, as if `ahead_ms` later (retries wait out their backoff).
async fn deliver(h: &Harness, ahead_ms: i64) -> usize {
    h.engine
        .deliver_notifications(wor_store::now_millis() + ahead_ms)
        .await
        .unwrap()
}

/// The text of every block of a message, joined.
fn message_text(body: &Value) -> String {
    body.to_string()
}

// ---------------------------------------------------------------------------------------------
// A browser without script, for linking a Slack identity from a console session.

struct Browser {
    base: String,
    client: reqwest::Client,
    cookies: BTreeMap<String, String>,
}

impl Browser {
    fn new(addr: SocketAddr) -> Self {
        Browser {
            base: format!("http://{addr}"),
            client: reqwest::Client::builder()
                .redirect(reqwest::redirect::Policy::none())
                .build()
                .unwrap(),
            cookies: BTreeMap::new(),
        }
    }

    async fn send(&mut self, request: reqwest::RequestBuilder) -> (StatusCode, String) {
        let cookie = self
            .cookies
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join("; ");
        let request = if cookie.is_empty() {
            request
        } else {
            request.header("cookie", cookie)
        };
        let response = request.send().await.unwrap();
        let status = StatusCode::from_u16(response.status().as_u16()).unwrap();
        for set in response.headers().get_all("set-cookie") {
            let text = set.to_str().unwrap();
            let pair = text.split(';').next().unwrap();
            let (name, value) = pair.split_once('=').unwrap();
            self.cookies.insert(name.to_owned(), value.to_owned());
        }
        (status, response.text().await.unwrap())
    }

    async fn get(&mut self, path: &str) -> (StatusCode, String) {
        let request = self.client.get(format!("{}{path}", self.base));
        self.send(request).await
    }

    async fn post(&mut self, path: &str, form: &[(&str, &str)]) -> (StatusCode, String) {
        let body = url::form_urlencoded::Serializer::new(String::new())
            .extend_pairs(form)
            .finish();
        let request = self
            .client
            .post(format!("{}{path}", self.base))
            .header("content-type", "application/x-www-form-urlencoded")
            .body(body);
        self.send(request).await
    }
}

fn csrf(body: &str) -> String {
    let start = body.find("name=\"csrf\" value=\"").expect("a csrf field") + 19;
    let rest = &body[start..];
    rest[..rest.find('"').unwrap()].to_owned()
}

async fn serve_console(h: &Harness) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let router = h.router.clone();
    tokio::spawn(async move {
        axum::serve(
            listener,
            router.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .await
        .unwrap();
    });
    addr
}

/// Invites `name` with `role` (the owner when `None` names the existing owner), sets their
/// password and signs them in.
async fn signed_in(h: &Harness, addr: SocketAddr, name: &str, role: Option<&str>) -> Browser {
    let (status, invitation, _) = h
        .call_as(
            h.owner(),
            Method::POST,
            "/v1/invitations",
            Some(json!({"name": name, "role": role})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{invitation}");
    let path = invitation["path"].as_str().unwrap();
    let mut browser = Browser::new(addr);
    let (status, page) = browser.get(path).await;
    assert_eq!(status, StatusCode::OK, "{page}");
    let token = csrf(&page);
    let password = "a long and quiet passphrase";
    let (status, page) = browser
        .post(
            path,
            &[
                ("csrf", &token),
                ("password", password),
                ("repeat", password),
            ],
        )
        .await;
    assert_eq!(status, StatusCode::SEE_OTHER, "{page}");
    let (_, page) = browser.get("/console/sign-in").await;
    let token = csrf(&page);
    let (status, page) = browser
        .post(
            "/console/sign-in",
            &[
                ("csrf", &token),
                ("project", &h.project.project.name),
                ("name", name),
                ("password", password),
            ],
        )
        .await;
    assert_eq!(status, StatusCode::SEE_OTHER, "{page}");
    browser
}

/// Presses a button as an unlinked Slack user (`press` naming the press) and returns the path
/// of the link Slack was asked to show them privately.
async fn link_sent(
    h: &Harness,
    calls: &Calls,
    route: &str,
    approval: &str,
    user: &str,
    press_id: &str,
) -> String {
    let (status, reply) = interact(
        h,
        route,
        &press(user, "approve", approval, press_id),
        SIGNING_SECRET,
        now_secs(),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{reply}");
    assert_eq!(reply["outcome"], "refused");
    assert!(reply["reason"].as_str().unwrap().contains("not linked"));
    let ephemeral = calls
        .lock()
        .unwrap()
        .iter()
        .rev()
        .find(|(method, _, body)| method == "chat.postEphemeral" && body["user"] == user)
        .map(|(_, _, body)| body["text"].as_str().unwrap().to_owned())
        .expect("the unlinked user was sent a link");
    let start = ephemeral.find(CONSOLE_URL).unwrap() + CONSOLE_URL.len();
    let path = ephemeral[start..]
        .split_whitespace()
        .next()
        .unwrap()
        .to_owned();
    assert!(path.starts_with("/console/slack/link/wsl_"), "{path}");
    path
}

/// Presses a button as an unlinked Slack user, takes the link Slack was asked to show them
/// privately, and links it from `browser`'s session.
async fn link(
    h: &Harness,
    calls: &Calls,
    route: &str,
    approval: &str,
    user: &str,
    browser: &mut Browser,
) {
    let path = link_sent(h, calls, route, approval, user, &format!("link-{user}")).await;
    let (status, page) = browser.get(&path).await;
    assert_eq!(status, StatusCode::OK, "{page}");
    assert!(page.contains(user), "{page}");
    let token = csrf(&page);
    let (status, page) = browser.post(&path, &[("csrf", &token)]).await;
    assert_eq!(status, StatusCode::OK, "{page}");
    assert!(page.contains("Slack identity linked"), "{page}");
    // A link works once.
    let (status, _) = browser.post(&path, &[("csrf", &token)]).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

fn config() -> wor_engine::EngineConfig {
    wor_engine::EngineConfig {
        console_url: Some(CONSOLE_URL.to_owned()),
        ..wor_engine::EngineConfig::default()
    }
}

#[tokio::test]
async fn slack_decides_through_the_engine_and_every_message_follows_the_approval() {
    // Each test runs in a process of its own: this recorder sees only this test's attempts.
    let metrics = wor_server::metrics::install_recorder().unwrap();
    let count = |result: &str| -> f64 {
        let series =
            format!("wor_notification_deliveries_total{{channel=\"slack\",result=\"{result}\"}}");
        metrics
            .render()
            .lines()
            .find_map(|l| l.strip_prefix(&series))
            .map_or(0.0, |v| v.trim().parse().unwrap())
    };
    let h = Harness::with_config(config()).await;
    let addr = serve_console(&h).await;
    let (slack, calls) = fake_slack(1).await;
    let sent = notes_tool(&h).await;
    let routine = apply_routine(&h).await;
    let all = slack_route(&h, "all", slack, None).await;
    let _same_tool = slack_route(&h, "notes", slack, Some("notes/send_note")).await;
    let _other_tool = slack_route(&h, "other", slack, Some("notes/other")).await;

    let (run, approval) = parked_run(&h, h.owner(), &routine).await;

    // One message per matching route; the first attempt fails and is retried with backoff.
    assert_eq!(deliver(&h, 0).await, 2);
    let (_, failing) = h
        .call(
            Method::GET,
            "/v1/notification-deliveries?status=pending",
            None,
        )
        .await;
    let failing = failing.as_array().unwrap();
    assert_eq!(failing.len(), 1, "{failing:?}");
    assert_eq!(failing[0]["attempts"], 1);
    assert_eq!(failing[0]["last_status_code"], 500);
    assert!(failing[0]["next_attempt_at"].is_string());
    assert_eq!(deliver(&h, 0).await, 0, "the retry waits for its backoff");
    // Counted: one delivered, one refused (Slack's 500).
    assert_eq!((count("delivered"), count("refused")), (1.0, 1.0));
    assert_eq!(deliver(&h, 60_000).await, 1);
    assert_eq!((count("delivered"), count("refused")), (2.0, 1.0));
    let posts: Vec<(String, String, Value)> = calls
        .lock()
        .unwrap()
        .iter()
        .filter(|(method, _, _)| method == "chat.postMessage")
        .cloned()
        .collect();
    assert_eq!(posts.len(), 2, "{posts:?}");
    let channels: Vec<&str> = posts
        .iter()
        .map(|(_, _, b)| b["channel"].as_str().unwrap())
        .collect();
    assert!(
        channels.contains(&"CALL") && channels.contains(&"CNOTES"),
        "{channels:?}"
    );
    for (_, auth, body) in &posts {
        assert_eq!(auth, &format!("Bearer {BOT_TOKEN}"));
        let text = message_text(body);
        assert!(text.contains("notes/send_note"), "{text}");
        assert!(text.contains("note-sender"), "{text}");
        assert!(text.contains("`to` (pinned): team@example.com"), "{text}");
        assert!(text.contains("100 more characters"), "{text}");
        assert!(!text.contains(&"x".repeat(201)), "long values are cut");
        assert!(text.contains("Expires at"), "{text}");
        assert!(text.contains("\"action_id\":\"approve\""), "{text}");
        assert!(text.contains("\"action_id\":\"deny\""), "{text}");
        assert!(text.contains(&approval), "{text}");
        assert!(
            text.contains(&format!("{CONSOLE_URL}/console/approvals")),
            "{text}"
        );
    }

    // A forged signature, a stale timestamp and an unknown route decide nothing.
    let body = press("U0ANN", "approve", &approval, "t-forged");
    let (status, _) = interact(&h, &all, &body, "not-the-secret", now_secs()).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, _) = interact(&h, &all, &body, SIGNING_SECRET, now_secs() - 400).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let unknown = wor_core::NotificationRouteId::new().to_string();
    let (status, _) = interact(&h, &unknown, &body, SIGNING_SECRET, now_secs()).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    // The timestamp is decimal digits: another spelling of the signed number is refused.
    let timestamp = now_secs();
    let signature = wor_secrets::slack_signature::sign(SIGNING_SECRET, timestamp, body.as_bytes());
    let respelled = Request::builder()
        .method(Method::POST)
        .uri(format!("/hooks/slack/{all}"))
        .header("content-type", "application/x-www-form-urlencoded")
        .header("x-slack-request-timestamp", format!("+{timestamp}"))
        .header("x-slack-signature", signature)
        .body(Body::from(body.clone()))
        .unwrap();
    let response = h.router.clone().oneshot(respelled).await.unwrap();
    assert_eq!(response.status(), StatusCode::UNAUTHORIZED);

    // An unlinked Slack user is refused, the message says why, and a replay does nothing.
    let first = press("U0ANN", "approve", &approval, "t-unlinked");
    let timestamp = now_secs();
    let (status, reply) = interact(&h, &all, &first, SIGNING_SECRET, timestamp).await;
    assert_eq!(status, StatusCode::OK, "{reply}");
    assert_eq!(reply["outcome"], "refused");
    let (status, _) = interact(&h, &all, &first, SIGNING_SECRET, timestamp).await;
    assert_eq!(
        status,
        StatusCode::CONFLICT,
        "a replayed interaction is refused"
    );
    deliver(&h, 0).await;
    let updates = |needle: &str| {
        calls
            .lock()
            .unwrap()
            .iter()
            .filter(|(method, _, body)| {
                method == "chat.update" && message_text(body).contains(needle)
            })
            .count()
    };
    assert_eq!(
        updates("is not linked to a member"),
        2,
        "both messages say why"
    );

    // Members link their Slack identities from signed-in console sessions.
    let mut ann = signed_in(&h, addr, "ann", Some("approver")).await;
    link(&h, &calls, &all, &approval, "U0ANN", &mut ann).await;
    let mut vic = signed_in(&h, addr, "vic", Some("viewer")).await;
    link(&h, &calls, &all, &approval, "U0VIC", &mut vic).await;
    let mut alice = signed_in(&h, addr, "alice", None).await;
    link(&h, &calls, &all, &approval, "U0ALICE", &mut alice).await;
    assert!(h.audit_text().await.contains("slack.link"));
    // A Slack user sent two links links once: using one spends the other, so a link handed
    // on cannot move the identity to whoever opens it later.
    let first = link_sent(&h, &calls, &all, &approval, "U0TWICE", "twice-1").await;
    let second = link_sent(&h, &calls, &all, &approval, "U0TWICE", "twice-2").await;
    assert_ne!(first, second);
    let (_, page) = ann.get(&first).await;
    let (status, page) = ann.post(&first, &[("csrf", &csrf(&page))]).await;
    assert_eq!(status, StatusCode::OK, "{page}");
    let (status, page) = vic.get(&second).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{page}");

    // The run's starter and a viewer are refused, and the message says why.
    let (status, reply) = interact(
        &h,
        &all,
        &press("U0ALICE", "approve", &approval, "t-starter"),
        SIGNING_SECRET,
        now_secs(),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        reply["reason"]
            .as_str()
            .unwrap()
            .contains("started this run"),
        "{reply}"
    );
    let (status, reply) = interact(
        &h,
        &all,
        &press("U0VIC", "approve", &approval, "t-viewer"),
        SIGNING_SECRET,
        now_secs(),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        reply["reason"].as_str().unwrap().contains("viewer"),
        "{reply}"
    );
    deliver(&h, 0).await;
    assert_eq!(updates("cannot decide its approvals"), 2);
    assert_eq!(updates("this caller has `viewer`"), 2);
    assert!(sent.lock().unwrap().is_empty(), "nothing ran");

    // A linked approver approves: the run goes on through the engine and the call runs once.
    let (status, reply) = interact(
        &h,
        &all,
        &press("U0ANN", "approve", &approval, "t-approve"),
        SIGNING_SECRET,
        now_secs(),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{reply}");
    assert_eq!(reply["outcome"], "approved");
    assert!(h.engine.run_next().await.unwrap());
    assert_eq!(h.get_run(&run).await["status"], "succeeded");
    let sent_notes = sent.lock().unwrap().clone();
    assert_eq!(sent_notes.len(), 1, "{sent_notes:?}");
    assert_eq!(sent_notes[0]["to"], "team@example.com");
    deliver(&h, 0).await;
    assert_eq!(updates("*Approved* by ann in Slack"), 2);
    // Pressing again changes nothing: the approval is single use.
    let (_, reply) = interact(
        &h,
        &all,
        &press("U0ANN", "deny", &approval, "t-again"),
        SIGNING_SECRET,
        now_secs(),
    )
    .await;
    assert_eq!(reply["outcome"], "refused");
    assert!(
        reply["reason"]
            .as_str()
            .unwrap()
            .contains("already approved"),
        "{reply}"
    );
    let audit = h.audit_text().await;
    assert!(audit.contains("slack.interaction"));
    assert!(audit.contains("approval.decide"));

    // A decision through the API (the CLI's path) updates every message too.
    let (second_run, second) = parked_run(&h, h.owner(), &routine).await;
    deliver(&h, 0).await;
    let ann_key = h.member("approver").await;
    let (status, decided) = h.decide(&ann_key, &second, "deny", "not this one").await;
    assert_eq!(status, StatusCode::OK, "{decided}");
    deliver(&h, 0).await;
    assert_eq!(updates("*Denied* by approver-member through the API"), 2);
    assert!(h.engine.run_next().await.unwrap());
    assert_ne!(
        h.get_run(&second_run).await["status"],
        "waiting_for_approval"
    );
    // An approval given with an edit: every message then shows the edited call, which is
    // what the tool receives, and says which argument the approver changed.
    let (_, third) = parked_run(&h, h.owner(), &routine).await;
    deliver(&h, 0).await;
    let (status, edited, _) = h
        .call_as(
            &ann_key,
            Method::POST,
            &format!("/v1/approvals/{third}/edit-and-approve"),
            Some(json!({"arguments": {"text": "a shorter note"}, "reason": "too long"})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{edited}");
    deliver(&h, 0).await;
    assert_eq!(
        updates(
            "as the approver edited them (canonical)\\n• `text` (edited by the approver): a shorter note"
        ),
        2
    );

    // Every delivery is visible; none failed.
    let (_, all_deliveries) = h
        .call(Method::GET, "/v1/notification-deliveries?limit=200", None)
        .await;
    let all_deliveries = all_deliveries.as_array().unwrap();
    assert!(
        all_deliveries.iter().all(|d| d["status"] == "delivered"),
        "{all_deliveries:?}"
    );
    // A page cursor is a delivery's id; what could name none is a 400, not a page.
    let newest = all_deliveries[0]["id"].as_str().unwrap();
    let (status, older) = h
        .call(
            Method::GET,
            &format!("/v1/notification-deliveries?before={newest}"),
            None,
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{older}");
    assert_eq!(older.as_array().unwrap().len(), all_deliveries.len() - 1);
    for bad in [
        "xyz",
        "aaa",
        "apr_0123456789abcdef0123456789abcdef",
        "ntd_%00",
    ] {
        let (status, body) = h
            .call(
                Method::GET,
                &format!("/v1/notification-deliveries?before={bad}"),
                None,
            )
            .await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{bad}: {body}");
        assert_eq!(body["error"]["code"], "invalid_query", "{bad}");
    }
}

/// A submitted Deny form (`view_submission`) as Slack posts it, form-encoded.
fn deny_form(user: &str, approval: &str, trigger: &str, reason: &str) -> String {
    let payload = json!({"type": "view_submission", "trigger_id": trigger,
        "user": {"id": user, "team_id": "T0TEAM"}, "team": {"id": "T0TEAM"},
        "view": {"id": format!("V{trigger}"), "callback_id": "wor_deny", "private_metadata": approval,
            "state": {"values": {"wor_reason": {"reason": {"type": "plain_text_input", "value": reason}}}}}});
    url::form_urlencoded::Serializer::new(String::new())
        .append_pair("payload", &payload.to_string())
        .finish()
}

#[tokio::test]
async fn deny_in_slack_asks_for_a_reason_and_the_decision_names_the_slack_user() {
    let h = Harness::with_config(config()).await;
    let addr = serve_console(&h).await;
    let (slack, calls) = fake_slack(0).await;
    let sent = notes_tool(&h).await;
    let routine = apply_routine(&h).await;
    let all = slack_route(&h, "all", slack, None).await;
    let (run, approval) = parked_run(&h, h.owner(), &routine).await;
    deliver(&h, 0).await;
    let mut ann = signed_in(&h, addr, "ann", Some("approver")).await;
    link(&h, &calls, &all, &approval, "U0ANN", &mut ann).await;
    let mut alice = signed_in(&h, addr, "alice", None).await;
    link(&h, &calls, &all, &approval, "U0ALICE", &mut alice).await;

    // The starter's Deny is refused at once: no form is opened for someone who cannot decide.
    let (status, reply) = interact(
        &h,
        &all,
        &press("U0ALICE", "deny", &approval, "t-starter-deny"),
        SIGNING_SECRET,
        now_secs(),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{reply}");
    assert!(
        reply["reason"]
            .as_str()
            .unwrap()
            .contains("started this run"),
        "{reply}"
    );
    let forms = || {
        calls
            .lock()
            .unwrap()
            .iter()
            .filter(|(method, _, _)| method == "views.open")
            .map(|(_, auth, body)| (auth.clone(), body.clone()))
            .collect::<Vec<_>>()
    };
    assert!(forms().is_empty());

    // An approver's Deny opens a form for the reason, and decides nothing yet.
    let (status, reply) = interact(
        &h,
        &all,
        &press("U0ANN", "deny", &approval, "t-deny"),
        SIGNING_SECRET,
        now_secs(),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{reply}");
    assert_eq!(reply["outcome"], "reason_asked");
    let opened = forms();
    assert_eq!(opened.len(), 1, "{opened:?}");
    assert_eq!(opened[0].0, format!("Bearer {BOT_TOKEN}"));
    assert_eq!(opened[0].1["trigger_id"], "t-deny");
    assert_eq!(opened[0].1["view"]["callback_id"], "wor_deny");
    assert_eq!(opened[0].1["view"]["private_metadata"], approval.as_str());
    assert_eq!(h.pending_approvals(&run).await.len(), 1);

    // A blank reason, one of invisible characters only, or one too long keeps the form open
    // with why; a forged submission is refused.
    let long = "r".repeat(2001);
    for (trigger, reason, says) in [
        ("f-blank", "   ", "reason"),
        ("f-invisible", "\u{200b}\u{200b}", "needs a reason"),
        ("f-long", long.as_str(), "longer than 2000"),
    ] {
        let (status, reply) = interact(
            &h,
            &all,
            &deny_form("U0ANN", &approval, trigger, reason),
            SIGNING_SECRET,
            now_secs(),
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{trigger}: {reply}");
        assert_eq!(reply["response_action"], "errors", "{trigger}: {reply}");
        assert!(
            reply["errors"]["wor_reason"]
                .as_str()
                .is_some_and(|why| why.contains(says)),
            "{trigger}: {reply}"
        );
    }
    let forged = deny_form("U0ANN", &approval, "f-forged", "forged");
    let (status, _) = interact(&h, &all, &forged, "not-the-secret", now_secs()).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_eq!(h.pending_approvals(&run).await.len(), 1);

    // The reason denies the call as the linked member, through the engine.
    let form = deny_form("U0ANN", &approval, "f-reason", "the recipient is wrong");
    let (status, reply) = interact(&h, &all, &form, SIGNING_SECRET, now_secs()).await;
    assert_eq!(status, StatusCode::OK, "{reply}");
    assert_eq!(reply["response_action"], "clear", "{reply}");
    let (status, _) = interact(&h, &all, &form, SIGNING_SECRET, now_secs()).await;
    assert_eq!(status, StatusCode::CONFLICT, "a replayed form is refused");
    let (_, decided) = h
        .call(Method::GET, &format!("/v1/approvals/{approval}"), None)
        .await;
    assert_eq!(decided["status"], "denied");
    assert_eq!(decided["decision_reason"], "the recipient is wrong");
    assert!(h.engine.run_next().await.unwrap());
    assert_ne!(h.get_run(&run).await["status"], "waiting_for_approval");
    assert!(
        sent.lock().unwrap().is_empty(),
        "a denied call does not run"
    );
    deliver(&h, 0).await;
    let updated = calls.lock().unwrap().iter().any(|(method, _, body)| {
        method == "chat.update"
            && message_text(body).contains("*Denied* by ann in Slack")
            && message_text(body).contains("the recipient is wrong")
    });
    assert!(updated, "the message says who denied, where and why");

    // The decision's own audit entry names the member and the Slack identity that decided.
    let (_, audit) = h.call(Method::GET, "/v1/audit?limit=1000", None).await;
    let decide = audit["entries"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["category"] == "approval.decide")
        .expect("an approval.decide entry")
        .clone();
    assert_eq!(decide["payload"]["via"], "slack", "{decide}");
    assert_eq!(decide["payload"]["slack_user"], "U0ANN", "{decide}");
    assert_eq!(decide["payload"]["slack_team"], "T0TEAM", "{decide}");
    assert_eq!(decide["payload"]["reason"], "the recipient is wrong");
    assert!(
        decide["actor"].to_string().contains("mem_"),
        "the member is the actor: {decide}"
    );
}

#[tokio::test]
async fn the_outbox_survives_a_restart_an_expiry_says_so_and_a_deleted_route_sends_nothing_more() {
    let h = Harness::with_config(wor_engine::EngineConfig {
        approval_ttl: Duration::from_millis(300),
        ..config()
    })
    .await;
    let (slack, calls) = fake_slack(0).await;
    notes_tool(&h).await;
    let routine = apply_routine(&h).await;
    let route = slack_route(&h, "all", slack, None).await;
    let (_, approval) = parked_run(&h, h.owner(), &routine).await;
    // The outbox is in the database: a restarted server sends what the first one queued.
    let restarted = h.restarted_engine(config());
    assert_eq!(
        restarted
            .deliver_notifications(wor_store::now_millis())
            .await
            .unwrap(),
        1
    );
    assert_eq!(calls.lock().unwrap().len(), 1);
    assert_eq!(deliver(&h, 0).await, 0, "sent once");
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(h.engine.expire_approvals().await.unwrap(), 1);
    // The run goes on as its routine says for a denial.
    assert!(h.engine.run_next().await.unwrap());
    assert_eq!(deliver(&h, 0).await, 1);
    let last = calls.lock().unwrap().last().cloned().unwrap();
    assert_eq!(last.0, "chat.update");
    let text = message_text(&last.2);
    assert!(text.contains("*Expired*"), "{text}");
    assert!(
        !text.contains("\"action_id\":\"approve\""),
        "no buttons once expired"
    );
    // A press on an expired approval is refused and decides nothing.
    let (_, reply) = interact(
        &h,
        &route,
        &press("U0ANN", "approve", &approval, "t-late"),
        SIGNING_SECRET,
        now_secs(),
    )
    .await;
    assert_eq!(reply["outcome"], "refused");
    deliver(&h, 0).await;

    // A run cancelled while it waits ends its approval, and the message says so.
    let (cancelled_run, _) = parked_run(&h, h.owner(), &routine).await;
    assert_eq!(deliver(&h, 0).await, 1);
    let (status, _) = h
        .call(
            Method::POST,
            &format!("/v1/runs/{cancelled_run}/cancel"),
            None,
        )
        .await;
    assert!(status.is_success(), "{status}");
    assert!(h.engine.run_next().await.unwrap());
    assert_eq!(h.get_run(&cancelled_run).await["status"], "cancelled");
    assert_eq!(deliver(&h, 0).await, 1);
    let last = calls.lock().unwrap().last().cloned().unwrap();
    assert_eq!(last.0, "chat.update");
    let text = message_text(&last.2);
    assert!(text.contains("*Cancelled*"), "{text}");
    assert!(!text.contains("\"action_id\":\"approve\""), "{text}");

    // Deleting the route removes its secrets; another held call sends nothing.
    let (status, _) = h
        .call(
            Method::DELETE,
            &format!("/v1/notification-routes/{route}"),
            None,
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    let (status, _) = h
        .call(
            Method::GET,
            &format!("/v1/notification-routes/{route}"),
            None,
        )
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let before = calls.lock().unwrap().len();
    parked_run(&h, h.owner(), &routine).await;
    assert_eq!(deliver(&h, 0).await, 0);
    assert_eq!(calls.lock().unwrap().len(), before);
    let (status, _) = interact(
        &h,
        &route,
        &press("U0ANN", "approve", &approval, "t-gone"),
        SIGNING_SECRET,
        now_secs(),
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn routes_are_checked_when_made_and_only_admins_make_them() {
    let h = Harness::with_config(config()).await;
    let good = json!({"name": "r", "kind": "slack", "channel": "C1",
        "slack_bot_token": BOT_TOKEN, "slack_signing_secret": SIGNING_SECRET,
        "slack_api_url": "http://127.0.0.1:9/api"});
    let with = |key: &str, value: Value| {
        let mut body = good.clone();
        body[key] = value;
        body
    };
    for (body, needle) in [
        (with("channel", json!("<!channel>")), "channel"),
        (
            with("slack_api_url", json!("http://169.254.169.254/api")),
            "slack_api_url",
        ),
        (with("slack_bot_token", json!("")), "slack_bot_token"),
        (with("kind", json!("email")), "email"),
        (with("routine_id", json!("rtn_nope")), "routine_id"),
        (with("name", json!("")), "name"),
        (with("name", json!("line\nbreak")), "name"),
        (
            with("slack_signing_secret", json!("tab\tinside")),
            "slack_signing_secret",
        ),
        // A tool filter no approval could match.
        (with("tool", json!(" spaced tool ")), "CONNECTION/TOOL"),
        (with("tool", json!("<script>")), "CONNECTION/TOOL"),
        (with("tool", json!("notes/")), "CONNECTION/TOOL"),
        (with("tool", json!("/send_note")), "CONNECTION/TOOL"),
    ] {
        let (status, reply) = h
            .call(Method::POST, "/v1/notification-routes", Some(body))
            .await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{reply}");
        assert!(reply.to_string().contains(needle), "{needle}: {reply}");
    }
    let approver = h.member("approver").await;
    let (status, _, _) = h
        .call_as(
            &approver,
            Method::POST,
            "/v1/notification-routes",
            Some(good.clone()),
        )
        .await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    let (status, created) = h
        .call(Method::POST, "/v1/notification-routes", Some(good.clone()))
        .await;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    let (status, _) = h
        .call(Method::POST, "/v1/notification-routes", Some(good))
        .await;
    assert_eq!(status, StatusCode::CONFLICT, "names are unique");
    let (status, list, text) = h
        .call_as(&approver, Method::GET, "/v1/notification-routes", None)
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(list.as_array().unwrap().len(), 1);
    assert!(!text.contains(BOT_TOKEN) && !text.contains(SIGNING_SECRET));
    let id = created["id"].as_str().unwrap();
    let (status, _, _) = h
        .call_as(
            &approver,
            Method::DELETE,
            &format!("/v1/notification-routes/{id}"),
            None,
        )
        .await;
    assert_eq!(status, StatusCode::FORBIDDEN);
}
