//! The API end to end, in process: tenant isolation over every documented route, the one
//! error shape, roles, and keys shown once.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic,
    reason = "tests fail loudly"
)]

use axum::Router;
use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::{Value, json};
use tower::ServiceExt;
use wor_core::audit::{Actor, AuditCategory, AuditEvent, Verification};
use wor_server::{AppState, router};
use wor_store::testing::TestDatabase;
use wor_store::{AuditConfig, AuditLog, CreatedProject};

/// The application state over a test database, with fresh keys and no workers.
fn app_state(db: &TestDatabase, production: bool) -> (AppState, AuditLog) {
    let (keys, _) = wor_secrets::KeyRing::generate().unwrap();
    let vault = wor_store::Vault::new(db.store.clone(), std::sync::Arc::new(keys));
    let egress = wor_egress::EgressClient::new(wor_egress::EgressPolicy::development()).unwrap();
    let config = wor_engine::EngineConfig {
        production,
        ..wor_engine::EngineConfig::default()
    };
    let (key, _) = wor_secrets::AuditSigningKey::generate().unwrap();
    let audit = AuditLog::start(db.store.clone(), key, AuditConfig::default());
    let engine = wor_engine::Engine::new(db.store.clone(), vault, egress, audit.clone(), config);
    (AppState::new(engine), audit)
}

struct TestApi {
    router: Router,
    db: TestDatabase,
    audit: AuditLog,
}

struct Reply {
    status: StatusCode,
    body: Value,
    text: String,
}

impl TestApi {
    async fn new() -> Self {
        let db = TestDatabase::new().await.unwrap();
        let (state, audit) = app_state(&db, false);
        TestApi {
            router: router(state),
            db,
            audit,
        }
    }

    /// With a database of its own, for tests that claim runs (a worker claims any queued run).
    async fn isolated() -> Self {
        let db = TestDatabase::isolated().await.unwrap();
        let (state, audit) = app_state(&db, false);
        TestApi {
            router: router(state),
            db,
            audit,
        }
    }

    async fn project(&self, owner: &str) -> CreatedProject {
        self.db
            .store
            .create_project(&TestDatabase::unique_name("p"), owner)
            .await
            .unwrap()
    }

    async fn raw(&self, request: Request<Body>) -> Reply {
        let response = self.router.clone().oneshot(request).await.unwrap();
        let status = response.status();
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        let text = String::from_utf8_lossy(&bytes).into_owned();
        let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        Reply { status, body, text }
    }

    async fn call(
        &self,
        method: Method,
        path: &str,
        key: Option<&str>,
        body: Option<Value>,
    ) -> Reply {
        let mut request = Request::builder().method(method).uri(path);
        if let Some(key) = key {
            request = request.header("authorization", format!("Bearer {key}"));
        }
        let request = match body {
            Some(body) => request
                .header("content-type", "application/json")
                .body(Body::from(body.to_string())),
            None => request.body(Body::empty()),
        };
        self.raw(request.unwrap()).await
    }
}

fn assert_error(reply: &Reply, status: StatusCode, code: &str) {
    assert_eq!(reply.status, status, "{}", reply.text);
    assert_eq!(reply.body["error"]["code"], code, "{}", reply.text);
    assert!(
        reply.body["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty())
    );
    assert_eq!(
        reply.body.as_object().map(|o| o.len()),
        Some(1),
        "the error shape has one top-level field: {}",
        reply.text
    );
}

const REPLAY_ROUTINE: &str = r#"
name = "probe"
instructions = "Say hello."
[model]
provider = "replay"
model = "script"
script = { turns = [{ text = "hi" }] }
"#;

/// Every documented operation, as (method, path template).
fn documented_operations() -> Vec<(Method, String)> {
    let doc = serde_json::to_value(wor_server::openapi()).unwrap();
    let mut ops = Vec::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (method, _) in item.as_object().unwrap() {
            let method: Method = method.to_uppercase().parse().unwrap();
            ops.push((method, path.clone()));
        }
    }
    assert!(ops.len() >= 8, "the document lists the API: {ops:?}");
    ops
}

/// Sample request bodies for documented operations that take one.
fn sample_body(method: &Method, path: &str) -> Option<Value> {
    match (method.as_str(), path) {
        ("POST", "/v1/members") => Some(json!({"name": "probe", "role": "viewer"})),
        ("PATCH", "/v1/members/{member_id}") => Some(json!({"role": "viewer"})),
        ("POST", "/v1/invitations") => Some(json!({"name": "probe-invited", "role": "viewer"})),
        ("POST", "/v1/keys") => Some(json!({"name": "probe", "role": "viewer", "service": true})),
        ("POST", "/v1/model-connections") => Some(json!({
            "name": "probe", "provider": "anthropic", "base_url": "https://api.example.com",
            "api_key": "sk-probe-0000000000"
        })),
        ("PUT", "/v1/model-connections/{connection_id}/api-key") => {
            Some(json!({"api_key": "sk-probe-1111111111"}))
        }
        ("POST", "/v1/model-connections/{connection_id}/revoke") => None,
        ("POST", "/v1/tool-connections") => Some(json!({
            "name": "probe", "kind": "mcp_http", "url": "https://mcp.example.com/mcp",
            "allowlist": ["mcp.example.com"], "bearer_token": "tok-probe-0000000000"
        })),
        ("POST", "/v1/tool-connections/{tool_connection_id}/enable") => Some(json!({"tools": {}})),
        ("POST", "/v1/tool-connections/{tool_connection_id}/disable") => None,
        ("POST", "/v1/tool-connections/{tool_connection_id}/authorize") => None,
        ("PUT", "/v1/tool-connections/{tool_connection_id}/tools") => Some(json!({"tools": [
            {"name": "probe", "method": "GET", "path": "/probe", "inputSchema": {"type": "object"}}
        ]})),
        ("POST", "/v1/routines") => Some(json!({"toml": REPLAY_ROUTINE})),
        ("POST", "/v1/routines/{routine_id}/runs") => Some(json!({"input": "probe"})),
        ("POST", "/v1/runs/{run_id}/cancel") => None,
        ("POST", "/v1/approvals/{approval_id}/approve" | "/v1/approvals/{approval_id}/deny") => {
            Some(json!({"reason": "probe"}))
        }
        ("POST", "/v1/approvals/{approval_id}/edit-and-approve") => {
            Some(json!({"arguments": {"text": "probe"}, "reason": "probe"}))
        }
        ("PUT", "/v1/policy") => Some(json!({"text": wor_policy::DEFAULT_PROJECT_POLICY})),
        ("POST", "/v1/routines/{routine_id}/webhook-secret") => None,
        ("POST", "/hooks/{routine_id}") => Some(json!({"probe": true})),
        ("POST", "/v1/notification-routes") => Some(json!({
            "name": "probe", "kind": "slack", "channel": "C0PROBE",
            "slack_api_url": "https://slack.example.com/api",
            "slack_bot_token": "xoxb-probe-0000000000", "slack_signing_secret": "probe-signing-secret"
        })),
        ("POST", "/hooks/slack/{notification_route_id}") => Some(json!({"probe": true})),
        ("POST" | "PUT" | "PATCH", _) => {
            panic!("no sample body for {method} {path}: add one so the isolation walk covers it")
        }
        _ => None,
    }
}

#[tokio::test]
async fn another_projects_resources_answer_404_on_every_route() {
    let api = TestApi::isolated().await;
    let a = api.project("alice").await;
    let b = api.project("bob").await;
    let a_key_id = api.db.store.list_api_keys(a.project.id).await.unwrap()[0].id;
    let a_model = api
        .call(
            Method::POST,
            "/v1/model-connections",
            Some(a.owner_key.expose()),
            Some(json!({"name": "m", "provider": "openai_compatible",
                "base_url": "https://models.example.com/v1", "api_key": "sk-a-secret-123456789"})),
        )
        .await;
    assert_eq!(a_model.status, StatusCode::CREATED, "{}", a_model.text);
    let a_model_id = a_model.body["id"].as_str().unwrap().to_owned();
    let a_tools = api
        .call(
            Method::POST,
            "/v1/tool-connections",
            Some(a.owner_key.expose()),
            Some(json!({"name": "t", "kind": "mcp_http", "url": "https://mcp.example.com/mcp",
                "allowlist": ["mcp.example.com"], "headers": {"x-api-key": "key-a-secret-123456789"}})),
        )
        .await;
    assert_eq!(a_tools.status, StatusCode::CREATED, "{}", a_tools.text);
    let a_tools_id = a_tools.body["id"].as_str().unwrap().to_owned();
    let a_routine = api
        .call(
            Method::POST,
            "/v1/routines",
            Some(a.owner_key.expose()),
            Some(json!({"toml": REPLAY_ROUTINE})),
        )
        .await;
    assert_eq!(a_routine.status, StatusCode::CREATED, "{}", a_routine.text);
    let a_routine_id = a_routine.body["routine"]["id"].as_str().unwrap().to_owned();
    // A parked run of A's with an approval request, as a worker leaves it.
    let parked_run = api
        .call(
            Method::POST,
            &format!("/v1/routines/{a_routine_id}/runs"),
            Some(a.owner_key.expose()),
            Some(json!({"input": "park"})),
        )
        .await;
    assert_eq!(
        parked_run.status,
        StatusCode::ACCEPTED,
        "{}",
        parked_run.text
    );
    let claimed = api
        .db
        .store
        .claim_run("walk", 60_000, 16)
        .await
        .unwrap()
        .unwrap();
    let (a_approval_id, _) = api
        .db
        .store
        .park_for_approval(
            a.project.id,
            "walk",
            &wor_store::NewApproval {
                run_id: claimed.id,
                call_id: "call-1".to_owned(),
                tool: "t/send".to_owned(),
                pin_hash: "pin".to_owned(),
                arguments: json!({"to": "x"}),
                arguments_hash: "args".to_owned(),
                pinned_keys: Vec::new(),
                binding_hash: "binding".to_owned(),
                kind: wor_store::ApprovalKind::Policy,
                why: json!({}),
                expires_at: i64::MAX,
            },
        )
        .await
        .unwrap()
        .unwrap();
    let a_approval_id = a_approval_id.to_string();
    let a_run = api
        .call(
            Method::POST,
            &format!("/v1/routines/{a_routine_id}/runs"),
            Some(a.owner_key.expose()),
            Some(json!({"input": "hello"})),
        )
        .await;
    assert_eq!(a_run.status, StatusCode::ACCEPTED, "{}", a_run.text);
    let a_run_id = a_run.body["id"].as_str().unwrap().to_owned();
    let a_route = api
        .call(
            Method::POST,
            "/v1/notification-routes",
            Some(a.owner_key.expose()),
            sample_body(&Method::POST, "/v1/notification-routes"),
        )
        .await;
    assert_eq!(a_route.status, StatusCode::CREATED, "{}", a_route.text);
    let a_route_id = a_route.body["id"].as_str().unwrap().to_owned();
    let foreign_ids = [
        ("notification_route_id", a_route_id.clone()),
        ("member_id", a.owner.id.to_string()),
        ("key_id", a_key_id.to_string()),
        ("connection_id", a_model_id.clone()),
        ("tool_connection_id", a_tools_id.clone()),
        ("routine_id", a_routine_id.clone()),
        ("run_id", a_run_id.clone()),
        ("approval_id", a_approval_id.clone()),
    ];
    let a_ids = [
        a_route_id.clone(),
        a.project.id.to_string(),
        a.owner.id.to_string(),
        a_key_id.to_string(),
        a_model_id.clone(),
        a_tools_id.clone(),
        a_routine_id.clone(),
        a_run_id.clone(),
        claimed.id.to_string(),
        a_approval_id.clone(),
    ];
    let b_key = b.owner_key.expose();
    // A's audit log names A's ids; B must never see them.
    api.audit
        .append(
            AuditEvent::new(a.project.id, AuditCategory::ProjectCreate, Actor::Operator)
                .subject("member_id", a.owner.id)
                .subject("key_id", a_key_id),
        )
        .await
        .unwrap();

    for (method, template) in documented_operations() {
        let mut path = template.clone();
        let mut has_param = false;
        while let Some(start) = path.find('{') {
            let end = path[start..].find('}').unwrap() + start;
            let name = &path[start + 1..end];
            let id = foreign_ids
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, id)| id.clone())
                .unwrap_or_else(|| {
                    panic!("no foreign id for path parameter `{name}` of {template}: add one")
                });
            path.replace_range(start..=end, &id);
            has_param = true;
        }
        let reply = api
            .call(
                method.clone(),
                &path,
                Some(b_key),
                sample_body(&method, &template),
            )
            .await;
        if template.starts_with("/hooks/slack/") {
            // A Slack interaction proves itself by signature, not by key: unsigned, it is
            // refused before anything about the route is read.
            assert_error(&reply, StatusCode::UNAUTHORIZED, "invalid_signature");
        } else if has_param {
            assert_error(&reply, StatusCode::NOT_FOUND, "not_found");
        }
        for id in &a_ids {
            assert!(
                !reply.text.contains(id.as_str()),
                "{method} {template} with project B's key revealed project A's `{id}`"
            );
        }
    }
    // Nothing of A's was changed by B's walk.
    let model = api
        .call(
            Method::GET,
            &format!("/v1/model-connections/{a_model_id}"),
            Some(a.owner_key.expose()),
            None,
        )
        .await;
    assert_eq!(model.body["status"], "active");
    assert_eq!(model.body["credential_version"], 1);
    let tools = api
        .call(
            Method::GET,
            &format!("/v1/tool-connections/{a_tools_id}"),
            Some(a.owner_key.expose()),
            None,
        )
        .await;
    assert_eq!(
        tools.body["status"], "pending_review",
        "B's walk changed A's tool connection"
    );
    let run = api
        .db
        .store
        .get_run(a.project.id, a_run_id.parse().unwrap())
        .await
        .unwrap();
    assert!(
        !run.cancel_requested && run.status.as_str() == "queued",
        "B's walk cancelled A's run"
    );
    let approval = api
        .db
        .store
        .get_approval(a.project.id, a_approval_id.parse().unwrap())
        .await
        .unwrap();
    assert_eq!(
        approval.status,
        wor_store::ApprovalStatus::Pending,
        "B's walk decided A's approval"
    );
    let a_key = api
        .db
        .store
        .get_api_key(a.project.id, a_key_id)
        .await
        .unwrap();
    assert!(a_key.revoked_at.is_none());
    assert!(
        api.db
            .store
            .authenticate_api_key(a.owner_key.expose())
            .await
            .unwrap()
            .is_some()
    );
}

#[tokio::test]
async fn every_documented_route_exists_and_requires_a_key() {
    let api = TestApi::new().await;
    for (method, template) in documented_operations() {
        let path = template.replace('{', "x").replace('}', "");
        let reply = api.call(method.clone(), &path, None, None).await;
        if template.starts_with("/v1/") {
            assert_error(&reply, StatusCode::UNAUTHORIZED, "unauthenticated");
        } else if template == "/hooks/oauth/callback" {
            // The browser's return from an authorization server: its single-use `state` is
            // its proof; without `code` and `state` it finishes nothing.
            assert_error(&reply, StatusCode::BAD_REQUEST, "invalid_callback");
        } else if template.starts_with("/hooks/") {
            // Inbound webhooks prove themselves by signature; an unknown routine is not found.
            assert_error(&reply, StatusCode::NOT_FOUND, "not_found");
        } else {
            assert_eq!(
                reply.status,
                StatusCode::OK,
                "{method} {template}: {}",
                reply.text
            );
        }
    }
    let doc = api.call(Method::GET, "/v1/openapi.json", None, None).await;
    assert_eq!(doc.status, StatusCode::OK);
    assert_eq!(doc.body["openapi"], "3.1.0");
    assert_eq!(
        doc.body,
        serde_json::to_value(wor_server::openapi()).unwrap()
    );
}

#[tokio::test]
async fn bad_requests_get_clear_4xx_errors_in_one_shape() {
    let api = TestApi::new().await;
    let p = api.project("alice").await;
    let key = p.owner_key.expose();

    let malformed = Request::post("/v1/keys")
        .header("authorization", format!("Bearer {key}"))
        .header("content-type", "application/json")
        .body(Body::from("{\"name\": "))
        .unwrap();
    assert_error(
        &api.raw(malformed).await,
        StatusCode::BAD_REQUEST,
        "invalid_json",
    );

    let unknown = api
        .call(
            Method::POST,
            "/v1/keys",
            Some(key),
            Some(json!({"name": "k", "role": "viewer", "rol": "x"})),
        )
        .await;
    assert_error(&unknown, StatusCode::BAD_REQUEST, "invalid_body");
    assert!(
        unknown.text.contains("unknown field `rol`"),
        "{}",
        unknown.text
    );

    let bad_role = api
        .call(
            Method::POST,
            "/v1/keys",
            Some(key),
            Some(json!({"name": "k", "role": "root"})),
        )
        .await;
    assert_error(&bad_role, StatusCode::BAD_REQUEST, "invalid_role");

    let huge = "x".repeat(wor_server::MAX_BODY_BYTES + 10);
    let oversized = api
        .call(
            Method::POST,
            "/v1/keys",
            Some(key),
            Some(json!({"name": huge, "role": "viewer"})),
        )
        .await;
    assert_error(
        &oversized,
        StatusCode::PAYLOAD_TOO_LARGE,
        "payload_too_large",
    );

    let no_type = Request::post("/v1/keys")
        .header("authorization", format!("Bearer {key}"))
        .body(Body::from("{}"))
        .unwrap();
    assert_error(
        &api.raw(no_type).await,
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "unsupported_media_type",
    );

    let bad_id = api
        .call(Method::GET, "/v1/keys/mem_123", Some(key), None)
        .await;
    assert_error(&bad_id, StatusCode::BAD_REQUEST, "invalid_id");
    assert!(bad_id.text.contains("key_"), "{}", bad_id.text);
    assert_eq!(
        bad_id.body["error"]["message"],
        "`mem_123` is not an API key id: expected `key_` followed by 32 hex digits",
        "an id is named without a prefix about URLs"
    );

    // A body that is JSON but not an object is refused before it is read into a request, which
    // would otherwise take an array's items as its fields in order.
    let before = api.call(Method::GET, "/v1/keys", Some(key), None).await;
    for body in [r#"["arr", "viewer", false]"#, "[]", "\"k\"", "7", "null"] {
        let not_object = Request::post("/v1/keys")
            .header("authorization", format!("Bearer {key}"))
            .header("content-type", "application/json")
            .body(Body::from(body))
            .unwrap();
        let refused = api.raw(not_object).await;
        assert_error(&refused, StatusCode::BAD_REQUEST, "invalid_body");
        assert!(
            refused.text.contains("must be a JSON object"),
            "{body}: {}",
            refused.text
        );
        assert!(!refused.text.contains("CreateApiKey"), "{}", refused.text);
    }
    let after = api.call(Method::GET, "/v1/keys", Some(key), None).await;
    assert_eq!(
        before.body, after.body,
        "a body not an object created a key"
    );
    // A body that may be left out is left out by `null`, and is otherwise an object too.
    let authorize = format!(
        "/v1/tool-connections/{}/authorize",
        wor_core::ConnectionId::new()
    );
    for (body, status, code) in [
        ("null", StatusCode::NOT_FOUND, "not_found"),
        ("[]", StatusCode::BAD_REQUEST, "invalid_body"),
    ] {
        let optional = Request::post(authorize.as_str())
            .header("authorization", format!("Bearer {key}"))
            .header("content-type", "application/json")
            .body(Body::from(body))
            .unwrap();
        assert_error(&api.raw(optional).await, status, code);
    }

    // A key sent where an id belongs is not sent back (S4): whole, it is redacted by its shape;
    // longer than an id, it is cut to a few characters instead of cut where its shape breaks.
    let pasted = api
        .call(Method::GET, &format!("/v1/keys/{key}"), Some(key), None)
        .await;
    assert_error(&pasted, StatusCode::BAD_REQUEST, "invalid_id");
    assert!(!pasted.text.contains(&key[12..]), "{}", pasted.text);
    assert!(
        pasted.text.contains("[REDACTED:wor-api-key]"),
        "{}",
        pasted.text
    );
    let anthropic = format!("sk-ant-api03-{}AA", "A".repeat(93));
    for path in [
        format!("/v1/keys/{anthropic}"),
        format!("/v1/runs?routine_id={anthropic}"),
        format!("/v1/runs?status={anthropic}"),
    ] {
        let refused = api.call(Method::GET, &path, Some(key), None).await;
        assert_eq!(
            refused.status,
            StatusCode::BAD_REQUEST,
            "{path}: {}",
            refused.text
        );
        assert!(
            !refused.text.contains("AAAAAAAAAA"),
            "{path}: {}",
            refused.text
        );
        assert!(
            refused.text.contains("sk-ant-a…"),
            "{path}: {}",
            refused.text
        );
    }
    let long_role = api
        .call(
            Method::POST,
            "/v1/keys",
            Some(key),
            Some(json!({"name": "k", "role": anthropic})),
        )
        .await;
    assert_error(&long_role, StatusCode::BAD_REQUEST, "invalid_role");
    assert!(!long_role.text.contains("AAAAAAAAAA"), "{}", long_role.text);

    // Names are counted in characters: 100 of them fit whatever their bytes.
    let euros = "€".repeat(100);
    let named = api
        .call(
            Method::POST,
            "/v1/keys",
            Some(key),
            Some(json!({"name": euros, "role": "viewer"})),
        )
        .await;
    assert_eq!(named.status, StatusCode::CREATED, "{}", named.text);
    let too_long = api
        .call(
            Method::POST,
            "/v1/keys",
            Some(key),
            Some(json!({"name": "€".repeat(101), "role": "viewer"})),
        )
        .await;
    assert_error(&too_long, StatusCode::BAD_REQUEST, "invalid_name");

    let missing = api
        .call(
            Method::GET,
            &format!("/v1/keys/{}", wor_core::ApiKeyId::new()),
            Some(key),
            None,
        )
        .await;
    assert_error(&missing, StatusCode::NOT_FOUND, "not_found");

    assert_error(
        &api.call(Method::GET, "/v1/nope", Some(key), None).await,
        StatusCode::NOT_FOUND,
        "no_route",
    );
    assert_error(
        &api.call(Method::PUT, "/v1/keys", Some(key), None).await,
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
    );
    assert_error(
        &api.call(Method::GET, "/v1/keys", Some("wor_not_a_key"), None)
            .await,
        StatusCode::UNAUTHORIZED,
        "unauthenticated",
    );
    let basic = Request::get("/v1/keys")
        .header("authorization", "Basic Zm9vOmJhcg==")
        .body(Body::empty())
        .unwrap();
    assert_error(
        &api.raw(basic).await,
        StatusCode::UNAUTHORIZED,
        "unauthenticated",
    );
}

#[tokio::test]
async fn roles_are_checked_on_every_configuration_route() {
    let api = TestApi::new().await;
    let p = api.project("alice").await;
    let owner = p.owner_key.expose();

    let created = api
        .call(
            Method::POST,
            "/v1/members",
            Some(owner),
            Some(json!({"name": "vera", "role": "viewer"})),
        )
        .await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.text);
    let viewer_key = created.body["key"]["api_key"].as_str().unwrap().to_owned();
    assert_eq!(created.body["key"]["role"], "viewer");

    // A viewer reads but does not configure.
    assert_eq!(
        api.call(Method::GET, "/v1/members", Some(&viewer_key), None)
            .await
            .status,
        StatusCode::OK
    );
    let denied = api
        .call(
            Method::POST,
            "/v1/members",
            Some(&viewer_key),
            Some(json!({"name": "x", "role": "viewer"})),
        )
        .await;
    assert_error(&denied, StatusCode::FORBIDDEN, "forbidden");
    let denied = api
        .call(
            Method::POST,
            "/v1/keys",
            Some(&viewer_key),
            Some(json!({"name": "s", "role": "viewer", "service": true})),
        )
        .await;
    assert_error(&denied, StatusCode::FORBIDDEN, "forbidden");
    // A route that creates configuration refuses the role before it reads the body: whatever
    // the body holds, the answer is the 403, and nothing of the body's shape is told.
    for (method, path) in [
        (Method::POST, "/v1/invitations"),
        (Method::POST, "/v1/members"),
        (Method::POST, "/v1/model-connections"),
        (Method::POST, "/v1/notification-routes"),
        (Method::PUT, "/v1/policy"),
        (Method::POST, "/v1/routines"),
        (Method::POST, "/v1/tool-connections"),
    ] {
        for body in [json!({}), json!({"no_such_field": 1})] {
            let denied = api
                .call(method.clone(), path, Some(&viewer_key), Some(body))
                .await;
            assert_error(&denied, StatusCode::FORBIDDEN, "forbidden");
            assert!(
                !denied.text.contains("field"),
                "{method} {path}: {}",
                denied.text
            );
        }
    }
    // A viewer may make itself another viewer key, never a stronger one.
    let own = api
        .call(
            Method::POST,
            "/v1/keys",
            Some(&viewer_key),
            Some(json!({"name": "laptop", "role": "viewer"})),
        )
        .await;
    assert_eq!(own.status, StatusCode::CREATED, "{}", own.text);
    let stronger = api
        .call(
            Method::POST,
            "/v1/keys",
            Some(&viewer_key),
            Some(json!({"name": "up", "role": "admin"})),
        )
        .await;
    assert_error(&stronger, StatusCode::FORBIDDEN, "forbidden");

    // An admin cannot mint owners.
    let admin = api
        .call(
            Method::POST,
            "/v1/members",
            Some(owner),
            Some(json!({"name": "adam", "role": "admin"})),
        )
        .await;
    let admin_key = admin.body["key"]["api_key"].as_str().unwrap().to_owned();
    let escalate = api
        .call(
            Method::POST,
            "/v1/members",
            Some(&admin_key),
            Some(json!({"name": "o2", "role": "owner"})),
        )
        .await;
    assert_error(&escalate, StatusCode::FORBIDDEN, "forbidden");

    // A service key has no person: it cannot make personal keys.
    let service = api
        .call(
            Method::POST,
            "/v1/keys",
            Some(owner),
            Some(json!({"name": "ci", "role": "admin", "service": true})),
        )
        .await;
    assert_eq!(service.status, StatusCode::CREATED, "{}", service.text);
    assert_eq!(service.body["service"], true);
    assert_eq!(service.body["member_id"], Value::Null);
    let service_key = service.body["api_key"].as_str().unwrap().to_owned();
    let personal = api
        .call(
            Method::POST,
            "/v1/keys",
            Some(&service_key),
            Some(json!({"name": "p", "role": "viewer"})),
        )
        .await;
    assert_error(&personal, StatusCode::FORBIDDEN, "forbidden");
    // Nor can it become one: adding a member would hand it their key, and an invitation sets
    // a member's password; either would let a key approve the calls of the runs it starts.
    for (path, body) in [
        (
            "/v1/members",
            json!({"name": "stand-in", "role": "approver"}),
        ),
        (
            "/v1/invitations",
            json!({"name": "stand-in", "role": "approver"}),
        ),
        ("/v1/invitations", json!({"name": "vera"})),
    ] {
        let refused = api
            .call(Method::POST, path, Some(&service_key), Some(body))
            .await;
        assert_error(&refused, StatusCode::FORBIDDEN, "forbidden");
        assert!(
            refused.body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("a service key cannot"),
            "{}",
            refused.text
        );
    }
    let members = api
        .call(Method::GET, "/v1/members", Some(owner), None)
        .await;
    assert!(!members.text.contains("stand-in"), "{}", members.text);

    // A viewer may revoke its own key but not another's.
    let own_id = own.body["id"].as_str().unwrap();
    let other_id = service.body["id"].as_str().unwrap();
    assert_error(
        &api.call(
            Method::DELETE,
            &format!("/v1/keys/{other_id}"),
            Some(&viewer_key),
            None,
        )
        .await,
        StatusCode::FORBIDDEN,
        "forbidden",
    );
    let revoked = api
        .call(
            Method::DELETE,
            &format!("/v1/keys/{own_id}"),
            Some(&viewer_key),
            None,
        )
        .await;
    assert_eq!(revoked.status, StatusCode::OK, "{}", revoked.text);
    assert!(revoked.body["revoked_at"].is_string());
    let own_secret = own.body["api_key"].as_str().unwrap();
    assert_error(
        &api.call(Method::GET, "/v1/whoami", Some(own_secret), None)
            .await,
        StatusCode::UNAUTHORIZED,
        "unauthenticated",
    );
}

#[tokio::test]
async fn keys_are_shown_once_and_listed_by_prefix() {
    let api = TestApi::new().await;
    let p = api.project("alice").await;
    let owner = p.owner_key.expose();
    let created = api
        .call(
            Method::POST,
            "/v1/keys",
            Some(owner),
            Some(json!({"name": "bot", "role": "viewer", "service": true})),
        )
        .await;
    let secret = created.body["api_key"].as_str().unwrap().to_owned();
    assert!(secret.starts_with("wor_"));
    for path in [
        "/v1/keys".to_owned(),
        format!("/v1/keys/{}", created.body["id"].as_str().unwrap()),
    ] {
        let reply = api.call(Method::GET, &path, Some(owner), None).await;
        assert_eq!(reply.status, StatusCode::OK);
        assert!(
            !reply.text.contains(&secret[12..]),
            "{path} returned the key"
        );
        assert!(
            !reply.text.contains(&owner[12..]),
            "{path} returned the owner key"
        );
        assert!(!reply.text.contains("api_key"), "{path}: {}", reply.text);
        assert!(
            reply.text.contains(&secret[..12]),
            "the prefix identifies the key"
        );
    }
    let me = api
        .call(Method::GET, "/v1/whoami", Some(&secret), None)
        .await;
    assert_eq!(me.body["service"], true);
    assert_eq!(me.body["role"], "viewer");
    assert_eq!(me.body["project"]["id"], p.project.id.to_string());
}

#[tokio::test]
async fn health_and_readiness_answer_without_a_key() {
    let api = TestApi::new().await;
    let health = api.call(Method::GET, "/healthz", None, None).await;
    assert_eq!(
        (health.status, health.body["status"].clone()),
        (StatusCode::OK, json!("ok"))
    );
    let ready = api.call(Method::GET, "/readyz", None, None).await;
    assert_eq!(
        (ready.status, ready.body["status"].clone()),
        (StatusCode::OK, json!("ready"))
    );
    api.db.store.close().await;
    let closed = api.call(Method::GET, "/readyz", None, None).await;
    assert_error(&closed, StatusCode::SERVICE_UNAVAILABLE, "unavailable");
}

#[tokio::test]
async fn model_connection_keys_go_in_and_never_come_out() {
    let api = TestApi::new().await;
    let p = api.project("alice").await;
    let owner = p.owner_key.expose();
    let secret = "sk-live-canary-5c8e2f1a9b7d4e3f";
    let created = api
        .call(
            Method::POST,
            "/v1/model-connections",
            Some(owner),
            Some(json!({"name": "main", "provider": "anthropic",
                "base_url": "https://api.anthropic.example", "api_key": secret})),
        )
        .await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.text);
    assert_eq!(created.body["api_key"]["configured"], true);
    assert!(created.body["api_key"]["updated_at"].is_string());
    assert_eq!(created.body["credential_version"], 1);
    let id = created.body["id"].as_str().unwrap().to_owned();

    let second = "sk-live-canary-second-77aa11bb";
    let replaced = api
        .call(
            Method::PUT,
            &format!("/v1/model-connections/{id}/api-key"),
            Some(owner),
            Some(json!({"api_key": second})),
        )
        .await;
    assert_eq!(replaced.status, StatusCode::OK, "{}", replaced.text);
    assert_eq!(replaced.body["credential_version"], 2);

    let listed = api
        .call(Method::GET, "/v1/model-connections", Some(owner), None)
        .await;
    let one = api
        .call(
            Method::GET,
            &format!("/v1/model-connections/{id}"),
            Some(owner),
            None,
        )
        .await;
    for reply in [&created, &replaced, &listed, &one] {
        for value in [secret, second] {
            assert!(
                !reply.text.contains(value),
                "a response holds the key: {}",
                reply.text
            );
            assert!(
                !reply.text.contains(&value[8..]),
                "a response holds part of the key"
            );
        }
    }
    // Sealed under the project, the row and the field: the value opens from its own slot only.
    let slot = wor_store::SecretSlot::new(p.project.id, "model_connections", &id, "api_key");
    let (keys, _) = wor_secrets::KeyRing::generate().unwrap();
    let stranger = wor_store::Vault::new(api.db.store.clone(), std::sync::Arc::new(keys));
    assert!(
        stranger.open(&slot).await.is_err(),
        "another key ring cannot open it"
    );

    let revoked = api
        .call(
            Method::POST,
            &format!("/v1/model-connections/{id}/revoke"),
            Some(owner),
            None,
        )
        .await;
    assert_eq!(revoked.body["status"], "revoked");
    assert_eq!(revoked.body["api_key"]["configured"], false);
    let again = api
        .call(
            Method::PUT,
            &format!("/v1/model-connections/{id}/api-key"),
            Some(owner),
            Some(json!({"api_key": "sk-x-123456789"})),
        )
        .await;
    assert_error(&again, StatusCode::CONFLICT, "conflict");

    if api.db.url.starts_with("sqlite:") {
        for file in ["wor.db", "wor.db-wal"] {
            let bytes = std::fs::read(api.db.dir.path().join(file)).unwrap_or_default();
            for value in [secret, second] {
                assert!(
                    !bytes.windows(value.len()).any(|w| w == value.as_bytes()),
                    "{file} holds a key"
                );
            }
        }
    }
}

/// A project secret's value in a routine's TOML is refused when the routine is applied; a
/// secret's shape, or a value that became a secret later, is shown redacted, as in the records
/// of its runs.
#[tokio::test]
async fn a_secret_in_a_routine_is_refused_when_applied_and_shown_redacted() {
    let api = TestApi::new().await;
    let p = api.project("alice").await;
    let owner = p.owner_key.expose();
    let model_connection = |key: &'static str, name: &'static str| {
        api.call(
            Method::POST,
            "/v1/model-connections",
            Some(owner),
            Some(json!({"name": name, "provider": "anthropic",
                "base_url": "https://api.anthropic.example", "api_key": key})),
        )
    };
    let apply = |toml: String| {
        api.call(
            Method::POST,
            "/v1/routines",
            Some(owner),
            Some(json!({"toml": toml})),
        )
    };
    let key = "sk-live-routine-canary-3d9f1a";
    assert_eq!(
        model_connection(key, "main").await.status,
        StatusCode::CREATED
    );
    let refused = apply(REPLAY_ROUTINE.replace("Say hello.", &format!("Use {key}."))).await;
    assert_error(&refused, StatusCode::BAD_REQUEST, "secret_in_routine");
    assert!(!refused.text.contains(key), "{}", refused.text);

    let github = format!("ghp_{}", "a1B2c3D4e5".repeat(4).get(..36).unwrap());
    let later = "sk-live-became-a-secret-8e7c";
    let applied =
        apply(REPLAY_ROUTINE.replace("Say hello.", &format!("Use {github} and {later}."))).await;
    assert_eq!(applied.status, StatusCode::CREATED, "{}", applied.text);
    assert_eq!(
        model_connection(later, "second").await.status,
        StatusCode::CREATED
    );
    let shown = api
        .call(
            Method::GET,
            &format!(
                "/v1/routines/{}",
                applied.body["routine"]["id"].as_str().unwrap()
            ),
            Some(owner),
            None,
        )
        .await;
    assert_eq!(shown.status, StatusCode::OK, "{}", shown.text);
    for value in [github.as_str(), later] {
        assert!(!shown.text.contains(value), "{value}: {}", shown.text);
    }
    for field in [
        &shown.body["source_toml"],
        &shown.body["definition"]["instructions"],
    ] {
        assert_eq!(
            field.as_str().unwrap().matches("[REDACTED").count(),
            2,
            "{field}"
        );
    }
}

#[tokio::test]
async fn model_connection_input_is_checked() {
    let api = TestApi::new().await;
    let p = api.project("alice").await;
    let owner = p.owner_key.expose();
    let body = |base_url: &str, provider: &str| json!({"name": "m", "provider": provider, "base_url": base_url, "api_key": "sk-test-123456789"});
    for (url, provider, code) in [
        ("ftp://models.example.com", "anthropic", "invalid_base_url"),
        (
            "https://user:pw@models.example.com",
            "anthropic",
            "invalid_base_url",
        ),
        ("not a url", "anthropic", "invalid_base_url"),
        ("https://models.example.com", "gpt", "invalid_provider"),
        // A credential has one place, `api_key`, where it is sealed: not a query or fragment.
        (
            "https://models.example.com/v1?key=user:pw",
            "openai_compatible",
            "invalid_base_url",
        ),
        (
            "https://models.example.com/v1#user:pw",
            "anthropic",
            "invalid_base_url",
        ),
        (
            "https://r.openai.azure.com?api-version=2024-10-21&sig=user:pw",
            "azure_openai",
            "invalid_base_url",
        ),
        (
            "https://r.openai.azure.com?api-version=2024-10-21",
            "openai_compatible",
            "invalid_base_url",
        ),
        (
            "https://r.openai.azure.com?api-version",
            "azure_openai",
            "invalid_base_url",
        ),
        (
            "https://r.openai.azure.com?api-version=",
            "azure_openai",
            "invalid_base_url",
        ),
        // The version's place holds a version, not a key.
        (
            "https://r.openai.azure.com?api-version=user:pw",
            "azure_openai",
            "invalid_base_url",
        ),
        // Refused at once, as every call to it would be.
        (
            "http://169.254.169.254/v1",
            "openai_compatible",
            "invalid_base_url",
        ),
    ] {
        let reply = api
            .call(
                Method::POST,
                "/v1/model-connections",
                Some(owner),
                Some(body(url, provider)),
            )
            .await;
        assert_error(&reply, StatusCode::BAD_REQUEST, code);
        assert!(
            !reply.text.contains("user:pw"),
            "the refusal does not repeat credentials: {}",
            reply.text
        );
    }
    let empty_key = api
        .call(
            Method::POST,
            "/v1/model-connections",
            Some(owner),
            Some(json!({"name": "m", "provider": "anthropic", "base_url": "https://a.example", "api_key": " "})),
        )
        .await;
    assert_error(&empty_key, StatusCode::BAD_REQUEST, "invalid_api_key");
    let metadata = api
        .call(
            Method::POST,
            "/v1/model-connections",
            Some(owner),
            Some(body("http://169.254.169.254/v1", "openai_compatible")),
        )
        .await;
    assert!(metadata.text.contains("link-local"), "{}", metadata.text);
    // Azure's API version is the one query a base URL may carry.
    let azure = api
        .call(
            Method::POST,
            "/v1/model-connections",
            Some(owner),
            Some(body(
                "https://r.openai.azure.com?api-version=2024-10-21",
                "azure_openai",
            )),
        )
        .await;
    assert_eq!(azure.status, StatusCode::CREATED, "{}", azure.text);

    let viewer = api
        .call(
            Method::POST,
            "/v1/members",
            Some(owner),
            Some(json!({"name": "v", "role": "viewer"})),
        )
        .await;
    let viewer_key = viewer.body["key"]["api_key"].as_str().unwrap();
    let denied = api
        .call(
            Method::POST,
            "/v1/model-connections",
            Some(viewer_key),
            Some(body("https://a.example", "anthropic")),
        )
        .await;
    assert_error(&denied, StatusCode::FORBIDDEN, "forbidden");
}

#[tokio::test]
async fn routines_apply_as_immutable_versions() {
    let api = TestApi::new().await;
    let p = api.project("alice").await;
    let owner = p.owner_key.expose();
    let apply = |toml: String| {
        api.call(
            Method::POST,
            "/v1/routines",
            Some(owner),
            Some(json!({"toml": toml})),
        )
    };

    let first = apply(REPLAY_ROUTINE.to_owned()).await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.text);
    assert_eq!(
        (first.body["version"].clone(), first.body["changed"].clone()),
        (json!(1), json!(true))
    );
    let id = first.body["routine"]["id"].as_str().unwrap().to_owned();

    let reformatted = REPLAY_ROUTINE.replace("instructions = ", "instructions   =   ");
    let same = apply(reformatted).await;
    assert_eq!(same.status, StatusCode::OK);
    assert_eq!(
        (same.body["version"].clone(), same.body["changed"].clone()),
        (json!(1), json!(false))
    );

    let edited = apply(REPLAY_ROUTINE.replace("Say hello.", "Say goodbye.")).await;
    assert_eq!(
        (
            edited.body["version"].clone(),
            edited.body["changed"].clone()
        ),
        (json!(2), json!(true))
    );
    assert_eq!(edited.body["routine"]["id"], id.as_str());

    let detail = api
        .call(
            Method::GET,
            &format!("/v1/routines/{id}"),
            Some(owner),
            None,
        )
        .await;
    assert_eq!(detail.status, StatusCode::OK, "{}", detail.text);
    assert_eq!(detail.body["routine"]["current_version"], 2);
    assert!(
        detail.body["source_toml"]
            .as_str()
            .unwrap()
            .contains("goodbye")
    );
    assert_eq!(
        detail.body["definition"]["budget"]["turns"], 20,
        "defaults are filled in"
    );
    assert_eq!(detail.body["versions"].as_array().unwrap().len(), 2);
    // The first version is still there, unchanged.
    let v1 = api
        .db
        .store
        .get_routine_version(p.project.id, id.parse().unwrap(), 1)
        .await
        .unwrap();
    assert_eq!(v1.definition.instructions, "Say hello.");

    let bad =
        apply(REPLAY_ROUTINE.replace("model = \"script\"", "model = \"script\"\nmodle = 1")).await;
    assert_error(&bad, StatusCode::BAD_REQUEST, "invalid_routine");
    assert!(
        bad.text.contains("line 7") && bad.text.contains("modle"),
        "{}",
        bad.text
    );

    // A roster naming what the project does not have is applied, and said: its runs would
    // fail until it is there.
    let pending = api
        .call(
            Method::POST,
            "/v1/tool-connections",
            Some(owner),
            Some(json!({"name": "pending", "kind": "mcp_http",
                "url": "https://mcp.example.com/mcp", "allowlist": ["mcp.example.com"]})),
        )
        .await;
    assert_eq!(pending.status, StatusCode::CREATED, "{}", pending.text);
    let gaps = apply(
        REPLAY_ROUTINE.replace("name = \"probe\"", "name = \"gappy\"")
            + "[[tools]]\ntool = \"nocon/foo\"\nmode = \"auto\"\n\
               [[tools]]\ntool = \"pending/foo\"\nmode = \"confirm\"\n\
               [[tools]]\ntool = \"routine/nope\"\nmode = \"auto\"\n\
               [[tools]]\ntool = \"routine/gappy\"\nmode = \"auto\"\n\
               [[tools]]\ntool = \"gone/bar\"\nmode = \"deny\"\n",
    )
    .await;
    assert_eq!(gaps.status, StatusCode::CREATED, "{}", gaps.text);
    let warnings = gaps.body["warnings"].as_array().unwrap();
    let said: Vec<&str> = warnings.iter().map(|w| w.as_str().unwrap()).collect();
    assert_eq!(said.len(), 3, "{said:?}");
    assert!(
        said[0].contains("names tool connection `nocon`"),
        "{said:?}"
    );
    assert!(
        said[1].contains("tool connection `pending`, which is pending_review"),
        "{said:?}"
    );
    assert!(said[2].contains("calls routine `nope`"), "{said:?}");
    assert_eq!(
        first.body["warnings"],
        json!([]),
        "nothing named: nothing said"
    );

    // A schedule whose years have all passed would never start a run: refused when applied.
    let past = apply(format!(
        "{REPLAY_ROUTINE}[schedule]\ncron = \"0 0 0 1 1 * 2020\"\n"
    ))
    .await;
    assert_error(&past, StatusCode::BAD_REQUEST, "invalid_routine");
    assert!(past.text.contains("fires no more"), "{}", past.text);
    // Memory off says nothing of its entries.
    let off = apply(format!(
        "{}[memory]\nenabled = false\nmax_entries = 0\n",
        REPLAY_ROUTINE.replace("name = \"probe\"", "name = \"forgetful\"")
    ))
    .await;
    assert_eq!(off.status, StatusCode::CREATED, "{}", off.text);
    // Memory that recalls nothing, or more than a run could be given: refused.
    for entries in [0, 1001] {
        let memory = apply(format!(
            "{REPLAY_ROUTINE}[memory]\nenabled = true\nmax_entries = {entries}\n"
        ))
        .await;
        assert_error(&memory, StatusCode::BAD_REQUEST, "invalid_routine");
        assert!(
            memory
                .text
                .contains("`memory.max_entries` must be from 1 to 1000"),
            "{}",
            memory.text
        );
    }

    let missing_connection = apply(
        REPLAY_ROUTINE
            .replace(
                "provider = \"replay\"",
                "provider = \"anthropic\"\nconnection = \"nope\"",
            )
            .replace("script = { turns = [{ text = \"hi\" }] }\n", ""),
    )
    .await;
    assert_error(
        &missing_connection,
        StatusCode::BAD_REQUEST,
        "invalid_routine",
    );
    assert!(
        missing_connection
            .text
            .contains("no active model connection named `nope`"),
        "{}",
        missing_connection.text
    );

    let viewer = api
        .call(
            Method::POST,
            "/v1/members",
            Some(owner),
            Some(json!({"name": "v", "role": "viewer"})),
        )
        .await;
    let viewer_key = viewer.body["key"]["api_key"].as_str().unwrap();
    let denied = api
        .call(
            Method::POST,
            "/v1/routines",
            Some(viewer_key),
            Some(json!({"toml": REPLAY_ROUTINE})),
        )
        .await;
    assert_error(&denied, StatusCode::FORBIDDEN, "forbidden");
    let listed = api
        .call(Method::GET, "/v1/routines", Some(viewer_key), None)
        .await;
    assert_eq!(
        listed.body.as_array().unwrap().len(),
        3,
        "probe, gappy and forgetful"
    );
}

#[tokio::test]
async fn production_refuses_the_replay_model() {
    let db = TestDatabase::new().await.unwrap();
    let (state, audit) = app_state(&db, true);
    let api = TestApi {
        router: router(state),
        db,
        audit,
    };
    let p = api.project("alice").await;
    let reply = api
        .call(
            Method::POST,
            "/v1/routines",
            Some(p.owner_key.expose()),
            Some(json!({"toml": REPLAY_ROUTINE})),
        )
        .await;
    assert_error(&reply, StatusCode::BAD_REQUEST, "invalid_routine");
    assert!(
        reply.text.contains("production refuses it"),
        "{}",
        reply.text
    );
}

#[tokio::test]
async fn configuration_changes_are_audited_and_exported_page_by_page() {
    let api = TestApi::new().await;
    let p = api.project("alice").await;
    let other = api.project("bob").await;
    let owner = p.owner_key.expose();

    let member = api
        .call(
            Method::POST,
            "/v1/members",
            Some(owner),
            Some(json!({"name": "val", "role": "viewer"})),
        )
        .await;
    assert_eq!(member.status, StatusCode::CREATED, "{}", member.text);
    let service = api
        .call(
            Method::POST,
            "/v1/keys",
            Some(owner),
            Some(json!({"name": "ci", "role": "viewer", "service": true})),
        )
        .await;
    assert_eq!(service.status, StatusCode::CREATED, "{}", service.text);
    let service_id = service.body["id"].as_str().unwrap();
    let service_key = service.body["api_key"].as_str().unwrap();
    let revoke = api
        .call(
            Method::DELETE,
            &format!("/v1/keys/{service_id}"),
            Some(owner),
            None,
        )
        .await;
    assert_eq!(revoke.status, StatusCode::OK, "{}", revoke.text);
    // Revoking again changes nothing and records nothing.
    api.call(
        Method::DELETE,
        &format!("/v1/keys/{service_id}"),
        Some(owner),
        None,
    )
    .await;
    // Bob's project does something too; Alice must not see it.
    api.call(
        Method::POST,
        "/v1/members",
        Some(other.owner_key.expose()),
        Some(json!({"name": "eve", "role": "viewer"})),
    )
    .await;

    // The new viewer reads the log, two entries a page.
    let viewer = member.body["key"]["api_key"].as_str().unwrap();
    let mut entries = Vec::new();
    let mut checkpoints = Vec::new();
    let mut after = 0;
    loop {
        let page = api
            .call(
                Method::GET,
                &format!("/v1/audit?after={after}&limit=2"),
                Some(viewer),
                None,
            )
            .await;
        assert_eq!(page.status, StatusCode::OK, "{}", page.text);
        assert!(!page.text.contains(service_key) && !page.text.contains(viewer));
        for e in page.body["entries"].as_array().unwrap() {
            entries.push(serde_json::from_value::<wor_core::audit::AuditEntry>(e.clone()).unwrap());
        }
        for c in page.body["checkpoints"].as_array().unwrap() {
            checkpoints.push(serde_json::from_value(c.clone()).unwrap());
        }
        match page.body["next_after"].as_i64() {
            Some(next) => after = next,
            None => break,
        }
    }
    let categories: Vec<&str> = entries.iter().map(|e| e.category.as_str()).collect();
    assert_eq!(
        categories,
        ["member.create", "key.create", "key.create", "key.revoke"]
    );
    let owner_actor = Actor::Member {
        member_id: p.owner.id,
        key_id: api.db.store.list_api_keys(p.project.id).await.unwrap()[0].id,
    };
    assert!(
        entries
            .iter()
            .all(|e| e.actor == owner_actor && e.project_id == p.project.id)
    );
    assert_eq!(entries[3].subjects["key_id"], service_id);
    assert_eq!(entries[2].payload["service"], true);

    api.audit.checkpoint().await.unwrap();
    let signed: Vec<wor_core::audit::AuditCheckpoint> = serde_json::from_value(
        api.call(Method::GET, "/v1/audit", Some(viewer), None)
            .await
            .body["checkpoints"]
            .clone(),
    )
    .unwrap();
    assert_eq!(signed.last().map(|c| c.seq), Some(4));
    checkpoints.extend(signed);
    let verdict = wor_core::audit::verify_chain(
        p.project.id,
        &api.audit.verifying_key(),
        &entries,
        checkpoints,
        &[],
    );
    assert!(
        matches!(verdict, Verification::Intact(ref s) if s.entries == 4 && s.unsigned_tail == 0),
        "{verdict:?}"
    );

    for bad in [
        "?limit=0",
        "?limit=1001",
        "?after=-1",
        "?after=x",
        "?sort=desc",
    ] {
        assert_error(
            &api.call(Method::GET, &format!("/v1/audit{bad}"), Some(viewer), None)
                .await,
            StatusCode::BAD_REQUEST,
            "invalid_query",
        );
    }
}

#[tokio::test]
async fn policies_are_validated_when_saved_with_the_line_named() {
    let api = TestApi::new().await;
    let a = api.project("alice").await;
    let owner = Some(a.owner_key.expose());
    let shown = api.call(Method::GET, "/v1/policy", owner, None).await;
    assert_eq!(shown.status, StatusCode::OK, "{}", shown.text);
    assert_eq!(shown.body["is_default"], true);
    assert_eq!(shown.body["text"], wor_policy::DEFAULT_PROJECT_POLICY);

    // A policy that does not fit the schema is refused, naming its line; nothing changes.
    let bad = "@id(\"ok\")\npermit (principal, action, resource);\n\n@id(\"bad\")\npermit (principal, action, resource)\nwhen { context.no_such_field == 1 };\n";
    let refused = api
        .call(Method::PUT, "/v1/policy", owner, Some(json!({"text": bad})))
        .await;
    assert_error(&refused, StatusCode::BAD_REQUEST, "invalid_policy");
    assert!(
        refused.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("line 6"),
        "{}",
        refused.text
    );
    // An empty policy, or one of comments alone, would deny every call: refused, pointing at
    // the reset.
    for empty in [
        "",
        "  \n\t",
        "// permit (principal, action, resource);\n// later\n",
    ] {
        let refused = api
            .call(
                Method::PUT,
                "/v1/policy",
                owner,
                Some(json!({"text": empty})),
            )
            .await;
        assert_error(&refused, StatusCode::BAD_REQUEST, "invalid_policy");
        assert!(
            refused.text.contains("DELETE /v1/policy"),
            "{}",
            refused.text
        );
    }
    let unchanged = api.call(Method::GET, "/v1/policy", owner, None).await;
    assert_eq!(unchanged.body["is_default"], true);

    // A viewer may read but not set it.
    let viewer = api
        .call(
            Method::POST,
            "/v1/members",
            owner,
            Some(json!({"name": "vera", "role": "viewer"})),
        )
        .await;
    let viewer_key = viewer.body["key"]["api_key"].as_str().unwrap().to_owned();
    let good = "@id(\"everything-needs-approval\")\n@decision(\"confirm\")\npermit (principal, action, resource);\n";
    let forbidden = api
        .call(
            Method::PUT,
            "/v1/policy",
            Some(&viewer_key),
            Some(json!({"text": good})),
        )
        .await;
    assert_error(&forbidden, StatusCode::FORBIDDEN, "forbidden");

    let set = api
        .call(
            Method::PUT,
            "/v1/policy",
            owner,
            Some(json!({"text": good})),
        )
        .await;
    assert_eq!(set.status, StatusCode::OK, "{}", set.text);
    assert_eq!(set.body["is_default"], false);
    assert_eq!(set.body["text"], good);
    let reset = api.call(Method::DELETE, "/v1/policy", owner, None).await;
    assert_eq!(reset.body["is_default"], true);

    // A routine's own policy is validated when the routine is applied.
    let routine = format!(
        "{REPLAY_ROUTINE}policy = \"\"\"\n@id(\"x\")\npermit (principal, action, resource)\nwhen {{ context.nope }};\n\"\"\"\n"
    );
    let refused = api
        .call(
            Method::POST,
            "/v1/routines",
            owner,
            Some(json!({"toml": routine})),
        )
        .await;
    assert_error(&refused, StatusCode::BAD_REQUEST, "invalid_routine");
    assert!(
        refused.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("`policy`"),
        "{}",
        refused.text
    );
    let audit = api
        .call(Method::GET, "/v1/audit?limit=100", owner, None)
        .await;
    assert_eq!(
        audit.text.matches("policy.set").count(),
        2,
        "{}",
        audit.text
    );
}

/// S14: a run's own credential reads its own run and nothing else. Every other documented
/// route refuses it with 403 — with the project's own ids and valid bodies, so a route that
/// accepted it would act.
#[tokio::test]
async fn a_run_credential_reads_its_own_run_and_every_other_route_refuses_it() {
    let api = TestApi::isolated().await;
    let a = api.project("alice").await;
    let owner = a.owner_key.expose();
    let key_id = api.db.store.list_api_keys(a.project.id).await.unwrap()[0].id;
    let created = |reply: Reply, pointer: &str| {
        assert!(reply.status.is_success(), "{}", reply.text);
        reply
            .body
            .pointer(pointer)
            .unwrap()
            .as_str()
            .unwrap()
            .to_owned()
    };
    let model = created(
        api.call(
            Method::POST,
            "/v1/model-connections",
            Some(owner),
            Some(json!({"name": "m", "provider": "openai_compatible",
                "base_url": "https://models.example.com/v1", "api_key": "sk-a-secret-123456789"})),
        )
        .await,
        "/id",
    );
    let tools = created(
        api.call(
            Method::POST,
            "/v1/tool-connections",
            Some(owner),
            Some(
                json!({"name": "t", "kind": "mcp_http", "url": "https://mcp.example.com/mcp",
                "allowlist": ["mcp.example.com"]}),
            ),
        )
        .await,
        "/id",
    );
    let routine = created(
        api.call(
            Method::POST,
            "/v1/routines",
            Some(owner),
            Some(json!({"toml": REPLAY_ROUTINE})),
        )
        .await,
        "/routine/id",
    );
    let run = created(
        api.call(
            Method::POST,
            &format!("/v1/routines/{routine}/runs"),
            Some(owner),
            Some(json!({"input": "hello"})),
        )
        .await,
        "/id",
    );
    let run_id: wor_core::RunId = run.parse().unwrap();
    // The runtime's side: claim the run and mint its credential, as a worker does.
    api.db
        .store
        .claim_run_by_id(a.project.id, run_id, "runtime", 60_000)
        .await
        .unwrap()
        .unwrap();
    let expires_at = wor_store::now_millis() + 60_000;
    let token = api
        .db
        .store
        .mint_run_token(a.project.id, run_id, "runtime", expires_at)
        .await
        .unwrap()
        .unwrap();
    let token = token.expose();
    assert!(token.starts_with("wrt_"));

    let own = api.call(Method::GET, "/v1/run", Some(token), None).await;
    assert_eq!(own.status, StatusCode::OK, "{}", own.text);
    assert_eq!(own.body["id"], run.as_str());
    assert_eq!(own.body["status"], "running");
    assert_eq!(own.body["roster"], json!([]));
    assert!(own.body["credential_expires_at"].is_string());

    let own_ids = [
        ("member_id", a.owner.id.to_string()),
        ("key_id", key_id.to_string()),
        ("connection_id", model.clone()),
        ("tool_connection_id", tools.clone()),
        ("routine_id", routine.clone()),
        ("run_id", run.clone()),
        ("approval_id", wor_core::ApprovalId::new().to_string()),
        (
            "notification_route_id",
            wor_core::NotificationRouteId::new().to_string(),
        ),
    ];
    let mut refused = 0;
    for (method, template) in documented_operations() {
        if method == Method::GET && template == "/v1/run" {
            continue;
        }
        let mut path = template.clone();
        while let Some(start) = path.find('{') {
            let end = path[start..].find('}').unwrap() + start;
            let name = &path[start + 1..end];
            let id = own_ids
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, id)| id.clone())
                .unwrap_or_else(|| panic!("no id for path parameter `{name}` of {template}"));
            path.replace_range(start..=end, &id);
        }
        let reply = api
            .call(
                method.clone(),
                &path,
                Some(token),
                sample_body(&method, &template),
            )
            .await;
        assert_error(&reply, StatusCode::FORBIDDEN, "forbidden");
        assert!(
            reply.text.contains("run's credential"),
            "{method} {template}: {}",
            reply.text
        );
        refused += 1;
    }
    assert!(refused >= 30, "the walk covered the API: {refused} routes");
    let unknown = api
        .call(Method::GET, "/v1/not-a-route", Some(token), None)
        .await;
    assert_error(&unknown, StatusCode::FORBIDDEN, "forbidden");
    // Nothing was changed by the walk.
    let stored = api.db.store.get_run(a.project.id, run_id).await.unwrap();
    assert!(!stored.cancel_requested, "the walk cancelled the run");
    let keys = api.db.store.list_api_keys(a.project.id).await.unwrap();
    assert_eq!(keys.len(), 1, "the walk created a key");
    assert!(keys[0].revoked_at.is_none(), "the walk revoked a key");
    let routines = api
        .call(Method::GET, "/v1/routines", Some(owner), None)
        .await;
    assert_eq!(routines.body.as_array().map(Vec::len), Some(1));
    let version = api
        .call(
            Method::GET,
            &format!("/v1/routines/{routine}"),
            Some(owner),
            None,
        )
        .await;
    assert_eq!(
        version.body["routine"]["current_version"], 1,
        "the walk changed the routine"
    );

    // A member's key is not a run credential, nor is a made-up one.
    let as_owner = api.call(Method::GET, "/v1/run", Some(owner), None).await;
    assert_error(&as_owner, StatusCode::UNAUTHORIZED, "unauthenticated");
    let made_up = format!("wrt_{}", "0".repeat(64));
    let forged = api.call(Method::GET, "/v1/run", Some(&made_up), None).await;
    assert_error(&forged, StatusCode::UNAUTHORIZED, "unauthenticated");
    // Nor is it one on any other route: it is not a credential, not a run's that is refused.
    let forged = api
        .call(Method::GET, "/v1/whoami", Some(&made_up), None)
        .await;
    assert_error(&forged, StatusCode::UNAUTHORIZED, "unauthenticated");
    // Past its deadline the credential is dead; so it is once the run ends.
    let expired = api
        .db
        .store
        .mint_run_token(a.project.id, run_id, "runtime", wor_store::now_millis() - 1)
        .await
        .unwrap()
        .unwrap();
    let reply = api
        .call(Method::GET, "/v1/run", Some(expired.expose()), None)
        .await;
    assert_error(&reply, StatusCode::UNAUTHORIZED, "unauthenticated");
    let live = api
        .db
        .store
        .mint_run_token(a.project.id, run_id, "runtime", expires_at)
        .await
        .unwrap()
        .unwrap();
    let reply = api
        .call(Method::GET, "/v1/run", Some(live.expose()), None)
        .await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
    // A live credential under the scheme's other spelling is still refused off its route; the
    // internal API refuses it as it refuses every bearer.
    let lower = Request::get("/v1/whoami")
        .header("authorization", format!("bearer {}", live.expose()))
        .body(Body::empty())
        .unwrap();
    assert_error(&api.raw(lower).await, StatusCode::FORBIDDEN, "forbidden");
    let internal = Request::post("/internal/v1/runs/claim")
        .header("authorization", format!("Bearer {}", live.expose()))
        .header("content-type", "application/json")
        .body(Body::from("{}"))
        .unwrap();
    assert_error(
        &api.raw(internal).await,
        StatusCode::UNAUTHORIZED,
        "bearer_refused",
    );
    let old = api.call(Method::GET, "/v1/run", Some(token), None).await;
    assert_error(&old, StatusCode::UNAUTHORIZED, "unauthenticated");
    assert!(
        api.db
            .store
            .finish_run(
                a.project.id,
                run_id,
                "runtime",
                wor_core::run::RunStatus::Succeeded,
                "done"
            )
            .await
            .unwrap()
    );
    let reply = api
        .call(Method::GET, "/v1/run", Some(live.expose()), None)
        .await;
    assert_error(&reply, StatusCode::UNAUTHORIZED, "unauthenticated");
    assert!(!api.db.store.run_token_exists(run_id).await.unwrap());
}

#[tokio::test]
async fn the_last_owner_key_cannot_be_revoked_through_the_api() {
    let api = TestApi::new().await;
    let p = api.project("alice").await;
    let owner = p.owner_key.expose();
    let first = api.db.store.list_api_keys(p.project.id).await.unwrap()[0].id;

    let refused = api
        .call(
            Method::DELETE,
            &format!("/v1/keys/{first}"),
            Some(owner),
            None,
        )
        .await;
    assert_error(&refused, StatusCode::CONFLICT, "last_owner_key");
    let message = refused.body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains(&format!("`{first}`")) && message.contains("recover-owner"),
        "{message}"
    );
    assert_eq!(
        api.call(Method::GET, "/v1/whoami", Some(owner), None)
            .await
            .status,
        StatusCode::OK
    );

    // A second owner member: now the first owner's key can go, and the second's cannot.
    let bob = api
        .call(
            Method::POST,
            "/v1/members",
            Some(owner),
            Some(json!({"name": "bob", "role": "owner"})),
        )
        .await;
    assert_eq!(bob.status, StatusCode::CREATED, "{}", bob.text);
    let bob_key = bob.body["key"]["api_key"].as_str().unwrap().to_owned();
    let bob_key_id = bob.body["key"]["id"].as_str().unwrap().to_owned();
    let revoked = api
        .call(
            Method::DELETE,
            &format!("/v1/keys/{first}"),
            Some(&bob_key),
            None,
        )
        .await;
    assert_eq!(revoked.status, StatusCode::OK, "{}", revoked.text);
    assert_error(
        &api.call(
            Method::DELETE,
            &format!("/v1/keys/{bob_key_id}"),
            Some(&bob_key),
            None,
        )
        .await,
        StatusCode::CONFLICT,
        "last_owner_key",
    );
}

/// Adds member `name` with `role` through the API; returns their id and first key.
async fn add_member(api: &TestApi, owner: &str, name: &str, role: &str) -> (String, String) {
    let created = api
        .call(
            Method::POST,
            "/v1/members",
            Some(owner),
            Some(json!({"name": name, "role": role})),
        )
        .await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.text);
    (
        created.body["member"]["id"].as_str().unwrap().to_owned(),
        created.body["key"]["api_key"].as_str().unwrap().to_owned(),
    )
}

#[tokio::test]
async fn a_members_role_changes_within_the_callers_own_and_the_last_owner_stays() {
    let api = TestApi::new().await;
    let p = api.project("alice").await;
    let owner = p.owner_key.expose();
    let alice = p.owner.id.to_string();
    let (adam, adam_key) = add_member(&api, owner, "adam", "admin").await;
    let (pia, pia_key) = add_member(&api, owner, "pia", "approver").await;
    let (vera, vera_key) = add_member(&api, owner, "vera", "viewer").await;
    let patch = |id: &str, key: &str, role: &str| {
        let (path, key, body) = (
            format!("/v1/members/{id}"),
            key.to_owned(),
            json!({ "role": role }),
        );
        let api = &api;
        async move { api.call(Method::PATCH, &path, Some(&key), Some(body)).await }
    };
    let role_of = |key: &str| {
        let (key, api) = (key.to_owned(), &api);
        async move {
            let reply = api.call(Method::GET, "/v1/whoami", Some(&key), None).await;
            reply.body["role"].as_str().unwrap().to_owned()
        }
    };

    // Only admins and owners change roles, never above their own nor of someone above them.
    assert_error(
        &patch(&pia, &vera_key, "viewer").await,
        StatusCode::FORBIDDEN,
        "forbidden",
    );
    assert_error(
        &patch(&vera, &pia_key, "viewer").await,
        StatusCode::FORBIDDEN,
        "forbidden",
    );
    let refused = patch(&pia, &adam_key, "owner").await;
    assert_error(&refused, StatusCode::FORBIDDEN, "forbidden");
    assert!(
        refused.text.contains("cannot grant role `owner`"),
        "{}",
        refused.text
    );
    let refused = patch(&alice, &adam_key, "viewer").await;
    assert_error(&refused, StatusCode::FORBIDDEN, "forbidden");
    assert!(refused.text.contains("who is `owner`"), "{}", refused.text);
    // Unknown members are 404; bad roles and bodies 400.
    let nobody = wor_core::MemberId::new().to_string();
    assert_error(
        &patch(&nobody, owner, "viewer").await,
        StatusCode::NOT_FOUND,
        "not_found",
    );
    assert_error(
        &patch(&pia, owner, "root").await,
        StatusCode::BAD_REQUEST,
        "invalid_role",
    );
    assert_error(
        &api.call(
            Method::PATCH,
            &format!("/v1/members/{pia}"),
            Some(owner),
            Some(json!({"role": "viewer", "name": "x"})),
        )
        .await,
        StatusCode::BAD_REQUEST,
        "invalid_body",
    );
    // The last owner cannot step down; nothing changed.
    let refused = patch(&alice, owner, "admin").await;
    assert_error(&refused, StatusCode::CONFLICT, "last_owner");
    assert!(
        refused.text.contains(&alice) && refused.text.contains("recover-owner"),
        "{}",
        refused.text
    );
    assert_eq!(role_of(owner).await, "owner");

    // An admin promotes an approver to admin: the member is admin; their key, made as an
    // approver, still acts as one (a promotion raises no key).
    let promoted = patch(&pia, &adam_key, "admin").await;
    assert_eq!(promoted.status, StatusCode::OK, "{}", promoted.text);
    assert_eq!(promoted.body["role"], "admin");
    assert_eq!(promoted.body["id"], pia.as_str());
    assert_eq!(role_of(&pia_key).await, "approver");
    // The role a member has already: nothing changes, nothing is recorded.
    let same = patch(&vera, &adam_key, "viewer").await;
    assert_eq!(same.status, StatusCode::OK, "{}", same.text);

    // A demotion holds for the member's keys from their next request.
    let demoted = patch(&adam, owner, "viewer").await;
    assert_eq!(demoted.status, StatusCode::OK, "{}", demoted.text);
    assert_eq!(role_of(&adam_key).await, "viewer");
    // The key list says so: made as admin, acting as viewer; a promotion raises no key.
    let keys = api.call(Method::GET, "/v1/keys", Some(owner), None).await;
    let listed = keys.body.as_array();
    let roles = |member: &str| {
        listed
            .unwrap()
            .iter()
            .find(|k| k["member_id"] == member)
            .map(|k| (k["role"].clone(), k["acts_as"].clone()))
            .unwrap()
    };
    assert_eq!(
        roles(&adam),
        (json!("admin"), json!("viewer")),
        "{}",
        keys.text
    );
    assert_eq!(
        roles(&pia),
        (json!("approver"), json!("approver")),
        "{}",
        keys.text
    );
    assert_error(
        &api.call(
            Method::POST,
            "/v1/members",
            Some(&adam_key),
            Some(json!({"name": "x", "role": "viewer"})),
        )
        .await,
        StatusCode::FORBIDDEN,
        "forbidden",
    );
    assert_error(
        &patch(&vera, &adam_key, "viewer").await,
        StatusCode::FORBIDDEN,
        "forbidden",
    );

    // A second owner with an owner key: now the first may step down, and then is an admin
    // who cannot touch the owner who remains, who is the last one.
    let (bob, bob_key) = add_member(&api, owner, "bob", "owner").await;
    let stepped = patch(&alice, owner, "admin").await;
    assert_eq!(stepped.status, StatusCode::OK, "{}", stepped.text);
    assert_eq!(role_of(owner).await, "admin");
    assert_error(
        &patch(&bob, owner, "admin").await,
        StatusCode::FORBIDDEN,
        "forbidden",
    );
    assert_error(
        &patch(&bob, &bob_key, "admin").await,
        StatusCode::CONFLICT,
        "last_owner",
    );

    // Each change is one audit entry naming the member, the old role and the new.
    let log = api
        .call(Method::GET, "/v1/audit?limit=1000", Some(&bob_key), None)
        .await;
    let changes: Vec<(String, String, String)> = log.body["entries"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["category"] == "member.role_change")
        .map(|e| {
            (
                e["subjects"]["member_id"].as_str().unwrap().to_owned(),
                e["payload"]["from"].as_str().unwrap().to_owned(),
                e["payload"]["to"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    let change = |id: &str, from: &str, to: &str| (id.to_owned(), from.to_owned(), to.to_owned());
    assert_eq!(
        changes,
        [
            change(&pia, "approver", "admin"),
            change(&adam, "admin", "viewer"),
            change(&alice, "owner", "admin"),
        ]
    );
}

#[tokio::test]
async fn the_bearer_scheme_is_case_insensitive() {
    let api = TestApi::new().await;
    let p = api.project("alice").await;
    let key = p.owner_key.expose();
    let with = |authorization: String| {
        Request::get("/v1/whoami")
            .header("authorization", authorization)
            .body(Body::empty())
            .unwrap()
    };
    for scheme in ["Bearer", "bearer", "BEARER", "bEaReR"] {
        let reply = api.raw(with(format!("{scheme} {key}"))).await;
        assert_eq!(reply.status, StatusCode::OK, "{scheme}: {}", reply.text);
    }
    for wrong in [
        format!("Basic {key}"),
        format!("Bearer{key}"),
        key.to_owned(),
    ] {
        assert_error(
            &api.raw(with(wrong)).await,
            StatusCode::UNAUTHORIZED,
            "unauthenticated",
        );
    }
    // The gate that keeps run credentials off the API reads the scheme the same way: it finds
    // no such credential, a 401 (the extractor behind it would have answered 403).
    let gated = api.raw(with("bearer wrt_0123".to_owned())).await;
    assert_error(&gated, StatusCode::UNAUTHORIZED, "unauthenticated");
}

/// The operations of the served document, as (method, path template, operation).
fn document_operations(doc: &Value) -> Vec<(String, String, Value)> {
    let mut ops = Vec::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (method, operation) in item.as_object().unwrap() {
            ops.push((method.clone(), path.clone(), operation.clone()));
        }
    }
    ops
}

#[tokio::test]
async fn the_openapi_document_describes_what_the_server_answers() {
    let api = TestApi::new().await;
    let served = api.call(Method::GET, "/v1/openapi.json", None, None).await;
    assert_eq!(served.status, StatusCode::OK);
    let doc = served.body;
    assert_eq!(doc, serde_json::to_value(wor_server::openapi()).unwrap());
    let ops = document_operations(&doc);
    assert!(ops.len() >= 30, "{}", ops.len());
    // What OpenAPI requires and client generators rely on: one id an operation, and a
    // description for every answer.
    let mut ids = std::collections::BTreeMap::new();
    for (method, path, op) in &ops {
        let id = op["operationId"]
            .as_str()
            .unwrap_or_else(|| panic!("{method} {path}: no operationId"));
        // Named by its tag, so no later handler of the same name elsewhere can take its id.
        let tag = op["tags"][0]
            .as_str()
            .unwrap_or_else(|| panic!("{method} {path}: no tag"));
        assert!(
            id.starts_with(&format!("{}_", tag.replace('-', "_"))),
            "{method} {path}: `{id}` is not named by its tag `{tag}`"
        );
        if let Some(other) = ids.insert(id.to_owned(), format!("{method} {path}")) {
            panic!("operationId `{id}` of {method} {path} is also {other}'s");
        }
        for (status, answer) in op["responses"].as_object().unwrap() {
            assert!(
                answer["description"]
                    .as_str()
                    .is_some_and(|d| !d.is_empty()),
                "{method} {path} {status}: no description"
            );
        }
    }
    let mut queries = 0;
    for (method, path, op) in &ops {
        let params = op["parameters"].as_array().cloned().unwrap_or_default();
        for param in &params {
            let name = param["name"].as_str().unwrap();
            match param["in"].as_str().unwrap() {
                "path" => assert!(
                    path.contains(&format!("{{{name}}}")),
                    "{method} {path}: path parameter `{name}` is not in the path"
                ),
                "query" => {
                    queries += 1;
                    assert_ne!(param["required"], true, "{method} {path}: `{name}`");
                }
                // The one header a route reads: a start's idempotency key, never required.
                "header" => {
                    assert_eq!(
                        (method.as_str(), path.as_str(), name),
                        ("post", "/v1/routines/{routine_id}/runs", "Idempotency-Key")
                    );
                    assert_ne!(param["required"], true, "{method} {path}: `{name}`");
                }
                other => panic!("{method} {path}: `{name}` in {other}"),
            }
        }
        // Every `{name}` of the template is a path parameter.
        for segment in path.split('/').filter(|s| s.starts_with('{')) {
            let name = segment.trim_start_matches('{').trim_end_matches('}');
            assert!(
                params
                    .iter()
                    .any(|p| p["name"] == name && p["in"] == "path"),
                "{method} {path}: `{name}` is not declared"
            );
        }
        let responses = op["responses"].as_object().unwrap();
        let documents = |status: &str| responses.contains_key(status);
        if let Some(content) = op["requestBody"]["content"].as_object() {
            assert!(documents("400"), "{method} {path} takes a body: 400");
            assert!(documents("413"), "{method} {path} takes a body: 413");
            if content.contains_key("application/json") {
                assert!(documents("415"), "{method} {path} takes JSON: 415");
            }
        }
        if op["security"].as_array().is_some_and(|s| !s.is_empty()) {
            assert!(documents("401"), "{method} {path} is authenticated: 401");
            assert!(documents("403"), "{method} {path} is authenticated: 403");
        }
        if !params.is_empty() {
            assert!(documents("400"), "{method} {path} has parameters: 400");
        }
    }
    assert!(
        queries >= 15,
        "the listings' filters are query parameters: {queries}"
    );

    // A run's input is text or any JSON value.
    let input = &doc["components"]["schemas"]["StartRunBody"]["properties"]["input"];
    let accepts = |value: Value| match input.get("type") {
        None => true,
        Some(Value::String(t)) => t == json_type(&value),
        Some(Value::Array(types)) => types.iter().any(|t| t == json_type(&value)),
        Some(other) => panic!("{other}"),
    };
    assert!(accepts(json!("summarise the queue")), "{input}");
    assert!(accepts(json!({"ticket": 7})), "{input}");
}

fn json_type(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// The API's connections send each write at once (`TCP_NODELAY`): on a connection kept alive,
/// an event stream's next event would otherwise wait for the client's delayed acknowledgement
/// of the one before (about 40 ms on Linux).
#[tokio::test]
async fn the_apis_connections_send_each_write_at_once() {
    use axum::serve::Listener as _;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let mut listener = wor_server::sending_at_once(listener);
    #[expect(
        clippy::disallowed_methods,
        reason = "the test's own client of the loopback listener it bound"
    )]
    let client = tokio::spawn(tokio::net::TcpStream::connect(address));
    let (connection, _) = listener.accept().await;
    assert!(connection.nodelay().unwrap());
    client.await.unwrap().unwrap();
}

/// A connection accepted over TLS sends each write at once too; it is set before the
/// handshake, whose messages go out at once as well.
#[tokio::test]
async fn the_apis_tls_connections_send_each_write_at_once() {
    use axum::serve::Listener as _;
    let made = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let files = wor_server::tls::TlsFiles {
        cert: dir.path().join("cert.pem"),
        key: dir.path().join("key.pem"),
    };
    std::fs::write(&files.cert, made.cert.pem()).unwrap();
    std::fs::write(&files.key, made.signing_key.serialize_pem()).unwrap();
    let tls = wor_server::tls::ReloadableTls::load(files).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let mut listener = wor_server::tls::TlsListener::new(listener, tls).unwrap();

    let mut roots = rustls::RootCertStore::empty();
    roots.add(made.cert.der().clone()).unwrap();
    let provider = std::sync::Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config));
    let client = tokio::spawn(async move {
        #[expect(
            clippy::disallowed_methods,
            reason = "the test's own client of the loopback listener it bound"
        )]
        let tcp = tokio::net::TcpStream::connect(address).await?;
        let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
        connector.connect(name, tcp).await
    });
    let (connection, _) = listener.accept().await;
    assert!(connection.get_ref().0.nodelay().unwrap());
    client.await.unwrap().unwrap();
}
