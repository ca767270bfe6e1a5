//! The test harness the server's integration tests share: an isolated database, an engine
//! whose egress reaches loopback (as an operator-listed CIDR), the router, one project, and
//! helpers for calling the API as its owner or as other members.
#![allow(
    dead_code,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic,
    reason = "tests fail loudly; not every test binary uses every helper"
)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::{Value, json};
use tower::ServiceExt;
use wor_server::{AppState, router};
use wor_store::testing::TestDatabase;
use wor_store::{AuditConfig, AuditLog, CreatedProject};

// ---------------------------------------------------------------------------------------------
// Harness

pub struct Harness {
    pub router: Router,
    pub engine: wor_engine::Engine,
    pub project: CreatedProject,
    pub db: TestDatabase,
    pub audit: AuditLog,
}

pub use wor_egress::testing::loopback_egress;

impl Harness {
    pub async fn new() -> Self {
        Self::with_config(wor_engine::EngineConfig::default()).await
    }

    /// A harness whose engine runs with `config`.
    pub async fn with_config(config: wor_engine::EngineConfig) -> Self {
        Self::with_everything(
            config,
            wor_server::console::ConsoleConfig::default(),
            loopback_egress(),
            None,
        )
        .await
    }

    /// A harness whose web console has the settings `console`.
    pub async fn with_console(console: wor_server::console::ConsoleConfig) -> Self {
        Self::with_everything(
            wor_engine::EngineConfig::default(),
            console,
            loopback_egress(),
            None,
        )
        .await
    }

    /// A harness whose tools and webhooks go out through `egress`, and model calls through
    /// `model_egress` when given (else `egress`).
    pub async fn with_egress(
        config: wor_engine::EngineConfig,
        egress: wor_egress::EgressClient,
        model_egress: Option<wor_egress::EgressClient>,
    ) -> Self {
        Self::with_everything(
            config,
            wor_server::console::ConsoleConfig::default(),
            egress,
            model_egress,
        )
        .await
    }

    async fn with_everything(
        config: wor_engine::EngineConfig,
        console: wor_server::console::ConsoleConfig,
        egress: wor_egress::EgressClient,
        model_egress: Option<wor_egress::EgressClient>,
    ) -> Self {
        // A database of its own: the worker claims any queued run, so a shared PostgreSQL
        // database would let it drive (or be beaten to) other tests' runs.
        let db = TestDatabase::isolated().await.unwrap();
        let (keys, _) = wor_secrets::KeyRing::generate().unwrap();
        let vault = wor_store::Vault::new(db.store.clone(), Arc::new(keys));
        let (key, _) = wor_secrets::AuditSigningKey::generate().unwrap();
        let audit = AuditLog::start(db.store.clone(), key, AuditConfig::default());
        let mut engine =
            wor_engine::Engine::new(db.store.clone(), vault, egress, audit.clone(), config);
        if let Some(model_egress) = model_egress {
            engine = engine.with_model_egress(model_egress);
        }
        let state = AppState::new(engine).with_console(console);
        let engine = state.engine.clone();
        let project = db
            .store
            .create_project(&TestDatabase::unique_name("p"), "alice")
            .await
            .unwrap();
        Harness {
            router: router(state),
            engine,
            project,
            db,
            audit,
        }
    }

    pub fn owner(&self) -> &str {
        self.project.owner_key.expose()
    }

    pub async fn call_as(
        &self,
        key: &str,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> (StatusCode, Value, String) {
        let request = Request::builder()
            .method(method)
            .uri(path)
            .header("authorization", format!("Bearer {key}"));
        let request = match body {
            Some(body) => request
                .header("content-type", "application/json")
                .body(Body::from(body.to_string())),
            None => request.body(Body::empty()),
        };
        let response = self.router.clone().oneshot(request.unwrap()).await.unwrap();
        let status = response.status();
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        let text = String::from_utf8_lossy(&bytes).into_owned();
        (
            status,
            serde_json::from_slice(&bytes).unwrap_or(Value::Null),
            text,
        )
    }

    /// Sends `body` as it is, as JSON, with the owner's key.
    pub async fn call_raw(
        &self,
        method: Method,
        path: &str,
        body: &str,
    ) -> (StatusCode, Value, String) {
        let request = Request::builder()
            .method(method)
            .uri(path)
            .header("authorization", format!("Bearer {}", self.owner()))
            .header("content-type", "application/json")
            .body(Body::from(body.to_owned()))
            .unwrap();
        let response = self.router.clone().oneshot(request).await.unwrap();
        let status = response.status();
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        let text = String::from_utf8_lossy(&bytes).into_owned();
        (
            status,
            serde_json::from_slice(&bytes).unwrap_or(Value::Null),
            text,
        )
    }

    pub async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> (StatusCode, Value) {
        let (status, body, _) = self.call_as(self.owner(), method, path, body).await;
        (status, body)
    }

    /// Creates an `mcp_http` connection at `addr`, reviews it and enables every tool it lists,
    /// `read_only` classified read-only. Returns the connection id and the reviewed hashes.
    pub async fn connect_and_enable(
        &self,
        name: &str,
        addr: SocketAddr,
        credentials: Value,
        read_only: &[&str],
    ) -> (String, BTreeMap<String, String>) {
        let mut body = json!({"name": name, "kind": "mcp_http", "url": format!("http://{addr}/mcp"),
            "allowlist": [addr.to_string()]});
        for (k, v) in credentials.as_object().unwrap() {
            body[k] = v.clone();
        }
        let (status, created) = self
            .call(Method::POST, "/v1/tool-connections", Some(body))
            .await;
        assert_eq!(status, StatusCode::CREATED, "{created}");
        assert_eq!(created["status"], "pending_review");
        let id = created["id"].as_str().unwrap().to_owned();
        let (_, hashes) = self.review_and_enable(&id, read_only).await;
        (id, hashes)
    }

    /// Creates an MCP connection to `addr` and enables every tool it lists, `read_only`
    /// classified read-only and `open_world` open-world.
    pub async fn connect_and_classify(
        &self,
        name: &str,
        addr: SocketAddr,
        read_only: &[&str],
        open_world: &[&str],
    ) -> String {
        let body = json!({"name": name, "kind": "mcp_http", "url": format!("http://{addr}/mcp"),
            "allowlist": [addr.to_string()]});
        let (status, created) = self
            .call(Method::POST, "/v1/tool-connections", Some(body))
            .await;
        assert_eq!(status, StatusCode::CREATED, "{created}");
        let id = created["id"].as_str().unwrap().to_owned();
        self.review_and_enable_classified(&id, read_only, open_world)
            .await;
        id
    }

    /// Reviews connection `id` and enables every tool the review lists, `read_only`
    /// classified read-only. Returns the review and the hashes it pinned.
    pub async fn review_and_enable(
        &self,
        id: &str,
        read_only: &[&str],
    ) -> (Value, BTreeMap<String, String>) {
        self.review_and_enable_classified(id, read_only, &[]).await
    }

    /// [`Self::review_and_enable`], with `open_world` classified open-world too.
    pub async fn review_and_enable_classified(
        &self,
        id: &str,
        read_only: &[&str],
        open_world: &[&str],
    ) -> (Value, BTreeMap<String, String>) {
        let (status, review) = self
            .call(
                Method::GET,
                &format!("/v1/tool-connections/{id}/review"),
                None,
            )
            .await;
        assert_eq!(status, StatusCode::OK, "{review}");
        let hashes = reviewed_hashes(&review);
        let (status, enabled) = self
            .call(
                Method::POST,
                &format!("/v1/tool-connections/{id}/enable"),
                Some(json!({"tools": hashes, "read_only": read_only, "open_world": open_world})),
            )
            .await;
        assert_eq!(status, StatusCode::OK, "{enabled}");
        assert_eq!(enabled["status"], "enabled");
        (review, hashes)
    }

    /// Applies `routine`, starts a run, drives it to its end, and returns it with its steps.
    pub async fn run(&self, routine: &str) -> Value {
        let run_id = self.apply_and_start(routine).await;
        assert!(self.engine.run_next().await.unwrap(), "no run was queued");
        let (status, run) = self
            .call(Method::GET, &format!("/v1/runs/{run_id}"), None)
            .await;
        assert_eq!(status, StatusCode::OK);
        run
    }

    /// Applies `routine` and starts a run of it, not yet driven; returns the run's id.
    pub async fn apply_and_start(&self, routine: &str) -> String {
        let (status, applied) = self
            .call(Method::POST, "/v1/routines", Some(json!({"toml": routine})))
            .await;
        assert!(status.is_success(), "{applied}");
        let routine_id = applied["routine"]["id"].as_str().unwrap().to_owned();
        let (status, run) = self
            .call(
                Method::POST,
                &format!("/v1/routines/{routine_id}/runs"),
                Some(json!({"input": "go"})),
            )
            .await;
        assert_eq!(status, StatusCode::ACCEPTED, "{run}");
        run["id"].as_str().unwrap().to_owned()
    }

    /// Adds a member with `role` and returns their personal API key.
    pub async fn member(&self, role: &str) -> String {
        let (status, member) = self
            .call(
                Method::POST,
                "/v1/members",
                Some(json!({"name": format!("{role}-member"), "role": role})),
            )
            .await;
        assert_eq!(status, StatusCode::CREATED, "{member}");
        member["key"]["api_key"].as_str().unwrap().to_owned()
    }

    pub async fn audit_text(&self) -> String {
        let (_, _, text) = self
            .call_as(self.owner(), Method::GET, "/v1/audit?limit=1000", None)
            .await;
        text
    }
}

/// Tool name to hash, from a `GET /v1/tool-connections/{id}/review` answer.
pub fn reviewed_hashes(review: &Value) -> BTreeMap<String, String> {
    review["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            (
                t["name"].as_str().unwrap().to_owned(),
                t["hash"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

pub fn steps_of<'a>(run: &'a Value, kind: &str) -> Vec<&'a Value> {
    run["steps"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["kind"] == kind)
        .collect()
}

/// Serves `router` on a fresh loopback port. Its connections send each write at once
/// (`TCP_NODELAY`), as `wor`'s own servers do: with Nagle's algorithm on, an MCP answer sent
/// as server-sent events waits about 40 ms for the client's delayed acknowledgement.
pub async fn serve(router: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let listener = wor_server::sending_at_once(listener);
    tokio::spawn(async move {
        axum::serve(listener, router).await.unwrap();
    });
    addr
}

impl Harness {
    pub async fn pending_approvals(&self, run_id: &str) -> Vec<Value> {
        let (status, list) = self
            .call(
                Method::GET,
                &format!("/v1/approvals?status=pending&run_id={run_id}"),
                None,
            )
            .await;
        assert_eq!(status, StatusCode::OK, "{list}");
        list.as_array().unwrap().clone()
    }

    pub async fn decide(
        &self,
        key: &str,
        id: &str,
        verb: &str,
        reason: &str,
    ) -> (StatusCode, Value) {
        let (status, body, _) = self
            .call_as(
                key,
                Method::POST,
                &format!("/v1/approvals/{id}/{verb}"),
                Some(json!({ "reason": reason })),
            )
            .await;
        (status, body)
    }

    pub async fn get_run(&self, run_id: &str) -> Value {
        let (status, run) = self
            .call(Method::GET, &format!("/v1/runs/{run_id}"), None)
            .await;
        assert_eq!(status, StatusCode::OK);
        run
    }

    /// The same database and keys with a new engine: what a restarted server would have.
    pub fn restarted_engine(&self, config: wor_engine::EngineConfig) -> wor_engine::Engine {
        wor_engine::Engine::new(
            self.engine.store().clone(),
            self.engine.vault().clone(),
            loopback_egress(),
            self.engine.audit().clone(),
            config,
        )
    }
}
