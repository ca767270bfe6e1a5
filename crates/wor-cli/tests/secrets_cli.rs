//! Secrets end to end through the binary (S2, S3, S4): the canary test, rotation across an
//! interruption and a restart, and ciphertexts swapped between rows.
//!
//! The canary test grows with the project: every feature that handles a secret plants a
//! canary here and the scans below must find none of it.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic,
    reason = "tests fail loudly"
)]

mod common;

use std::io::Write;
use std::process::Stdio;

use base64::Engine;
use common::{Server, create_project, database_url, own_database_args, run, text, wor};

/// Everything a canary may look like once encoded.
fn forms(canary: &str) -> Vec<String> {
    let b64 = base64::engine::general_purpose::STANDARD;
    let url = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    vec![
        canary.to_owned(),
        b64.encode(canary),
        url.encode(canary),
        canary.bytes().map(|b| format!("{b:02x}")).collect(),
    ]
}

fn assert_absent(haystack: &str, canaries: &[&str], place: &str) {
    for canary in canaries {
        for form in forms(canary) {
            assert!(
                !haystack.contains(&form),
                "{place} holds canary `{canary}` (as `{form}`)"
            );
        }
    }
}

/// The whole database as text: the SQLite files, or every row of every table on PostgreSQL.
async fn database_text(db: &[String], dir: &std::path::Path) -> String {
    let url = database_url(db, dir);
    if !url.starts_with("postgres") {
        return ["wor.db", "wor.db-wal", "wor.db-shm"]
            .iter()
            .map(|f| {
                String::from_utf8_lossy(&std::fs::read(dir.join(f)).unwrap_or_default())
                    .into_owned()
            })
            .collect();
    }
    let store = wor_store::Store::connect(&url).await.unwrap();
    let tables: Vec<(String,)> = sqlx::query_as(
        "SELECT table_name::text FROM information_schema.tables WHERE table_schema = 'public'",
    )
    .fetch_all(store.pool())
    .await
    .unwrap();
    let mut all = String::new();
    for (table,) in tables {
        let rows: Vec<(String,)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT CAST(t AS TEXT) FROM {table} t"
        )))
        .fetch_all(store.pool())
        .await
        .unwrap();
        for (row,) in rows {
            all.push_str(&row);
            all.push('\n');
        }
    }
    all
}

fn with_stdin(server: &Server, key: &str, args: &[&str], input: &str) -> std::process::Output {
    let mut cmd = wor(args);
    cmd.env("WOR_SERVER", &server.url)
        .env("WOR_API_KEY", key)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn canaries_in_secret_fields_appear_nowhere() {
    let dir = tempfile::tempdir().unwrap();
    let db = own_database_args(dir.path()).await;
    let owner = create_project(&db);
    let server = Server::start(&db, &[("WOR_LOG", "trace")]);
    let first = "sk-canary-first-0d9e8f7a6b5c4d3e";
    let second = "sk-ant-canary-second-1a2b3c4d5e6f";
    let mut responses = String::new();
    let mut record = |out: &std::process::Output| {
        responses.push_str(&text(&out.stdout));
        responses.push_str(&text(&out.stderr));
    };

    let created = with_stdin(
        &server,
        &owner,
        &[
            "model-connection",
            "create",
            "main",
            "--provider",
            "openai_compatible",
            "--base-url",
            "https://models.example.com/v1",
            "--api-key-stdin",
            "--json",
        ],
        first,
    );
    assert!(created.status.success(), "{}", text(&created.stderr));
    record(&created);
    let id = serde_json::from_slice::<serde_json::Value>(&created.stdout).unwrap()["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let replaced = run(wor(&[
        "model-connection",
        "set-key",
        &id,
        "--api-key-env",
        "CANARY",
        "--json",
    ])
    .env("WOR_SERVER", &server.url)
    .env("WOR_API_KEY", &owner)
    .env("CANARY", second));
    assert!(replaced.status.success(), "{}", text(&replaced.stderr));
    assert!(text(&replaced.stdout).contains("\"credential_version\": 2"));
    record(&replaced);
    for args in [
        vec!["model-connection", "list", "--json"],
        vec!["model-connection", "show", id.as_str(), "--json"],
        vec!["model-connection", "list"],
        vec!["key", "list", "--json"],
        vec!["whoami", "--json"],
    ] {
        let out = server.client(&owner, &args);
        assert!(out.status.success(), "{args:?}: {}", text(&out.stderr));
        record(&out);
    }
    // A tool connection's bearer token and secret header: sealed, never shown.
    let tool_token = "tok-canary-tool-7c6b5a4f3e2d1c0b";
    let tool_header = "key-canary-tool-0f1e2d3c4b5a6978";
    let tool = run(wor(&[
        "connection",
        "create",
        "desk",
        "--url",
        "https://mcp.example.com/mcp",
        "--allow",
        "mcp.example.com",
        "--bearer-env",
        "TOOL_TOKEN",
        "--header-env",
        "X-Api-Key=TOOL_HEADER",
        "--json",
    ])
    .env("WOR_SERVER", &server.url)
    .env("WOR_API_KEY", &owner)
    .env("TOOL_TOKEN", tool_token)
    .env("TOOL_HEADER", tool_header));
    assert!(tool.status.success(), "{}", text(&tool.stderr));
    let tool_view: serde_json::Value = serde_json::from_slice(&tool.stdout).unwrap();
    assert_eq!(tool_view["status"], "pending_review");
    assert_eq!(tool_view["credentials"]["x-api-key"]["configured"], true);
    assert_eq!(
        tool_view["credentials"]["authorization"]["configured"],
        true
    );
    record(&tool);
    let tool_id = tool_view["id"].as_str().unwrap().to_owned();
    for args in [
        vec!["connection", "list", "--json"],
        vec!["connection", "show", tool_id.as_str(), "--json"],
        vec!["connection", "list"],
        vec!["audit", "export"],
    ] {
        let out = server.client(&owner, &args);
        assert!(out.status.success(), "{args:?}: {}", text(&out.stderr));
        record(&out);
    }
    // MCP authorization needs the server's public URL for its callback, and says so.
    let authorize = server.client(&owner, &["connection", "authorize", tool_id.as_str()]);
    assert!(!authorize.status.success());
    assert!(
        text(&authorize.stderr).contains("public_url"),
        "{}",
        text(&authorize.stderr)
    );
    record(&authorize);
    // An HTTP API imported from an OpenAPI document (YAML), its schemes' secrets sealed; its
    // tools replaced from a hand-written tools file.
    let scheme_key = "key-canary-openapi-5a4b3c2d1e0f9988";
    let scheme_token = "tok-canary-openapi-1122aabbccddeeff";
    let petstore = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../testdata/openapi/petstore.yaml"
    );
    let imported = run(wor(&[
        "connection",
        "create",
        "pets",
        "--openapi",
        petstore,
        "--url",
        "https://petstore.example.com/v3",
        "--allow",
        "petstore.example.com",
        "--operation",
        "getPetById",
        "--operation",
        "addPet",
        "--scheme-env",
        "api_key=PET_KEY",
        "--scheme-env",
        "petstore_auth=PET_TOKEN",
        "--json",
    ])
    .env("WOR_SERVER", &server.url)
    .env("WOR_API_KEY", &owner)
    .env("PET_KEY", scheme_key)
    .env("PET_TOKEN", scheme_token));
    assert!(imported.status.success(), "{}", text(&imported.stderr));
    let pets: serde_json::Value = serde_json::from_slice(&imported.stdout).unwrap();
    assert_eq!(pets["kind"], "http_api");
    assert_eq!(pets["credentials"]["api_key"]["configured"], true);
    assert_eq!(pets["credentials"]["authorization"]["configured"], true);
    record(&imported);
    let tools_file = dir.path().join("tools.yaml");
    std::fs::write(
        &tools_file,
        "- name: get_pet\n  method: GET\n  path: /pet/{id}\n  inputSchema:\n    type: object\n    properties: {id: {type: integer}}\n",
    )
    .unwrap();
    let pets_id = pets["id"].as_str().unwrap().to_owned();
    let replaced_tools = server.client(
        &owner,
        &[
            "connection",
            "replace-tools",
            &pets_id,
            "--tools-file",
            tools_file.to_str().unwrap(),
            "--json",
        ],
    );
    assert!(
        replaced_tools.status.success(),
        "{}",
        text(&replaced_tools.stderr)
    );
    let replaced_view: serde_json::Value = serde_json::from_slice(&replaced_tools.stdout).unwrap();
    assert_eq!(
        replaced_view["quarantined"], false,
        "nothing was pinned yet"
    );
    record(&replaced_tools);
    let tools_json = dir.path().join("tools.json");
    std::fs::write(
        &tools_json,
        r#"{"tools": [{"name": "list_notes", "method": "GET", "path": "/notes",
            "inputSchema": {"type": "object"}}]}"#,
    )
    .unwrap();
    let notes = server.client(
        &owner,
        &[
            "connection",
            "create",
            "notes",
            "--tools-file",
            tools_json.to_str().unwrap(),
            "--url",
            "https://notes.example.com/v1",
            "--allow",
            "notes.example.com",
            "--json",
        ],
    );
    assert!(notes.status.success(), "{}", text(&notes.stderr));
    let notes: serde_json::Value = serde_json::from_slice(&notes.stdout).unwrap();
    assert_eq!(notes["kind"], "http_api");
    assert_eq!(notes["status"], "pending_review");
    let missing = server.client(
        &owner,
        &[
            "connection",
            "create",
            "pets-2",
            "--openapi",
            petstore,
            "--allow",
            "petstore.example.com",
            "--operation",
            "getPetById",
        ],
    );
    assert!(!missing.status.success());
    assert!(
        text(&missing.stderr)
            .contains("`getPetById` needs one of: header `api_key` (scheme `api_key`)"),
        "{}",
        text(&missing.stderr)
    );
    // A request that fails carrying a canary: the error must not echo it.
    let bad = with_stdin(
        &server,
        &owner,
        &[
            "model-connection",
            "create",
            "bad",
            "--provider",
            "openai_compatible",
            "--base-url",
            "https://x:sk-canary-in-url-99887766@models.example.com",
            "--api-key-stdin",
        ],
        first,
    );
    assert!(!bad.status.success());
    record(&bad);
    let log = server.stop();

    let canaries = [
        first,
        second,
        "sk-canary-in-url-99887766",
        tool_token,
        tool_header,
        scheme_key,
        scheme_token,
    ];
    assert_absent(&responses, &canaries, "an API response or CLI output");
    assert_absent(&log, &canaries, "the server log");
    assert_absent(
        &database_text(&db, dir.path()).await,
        &canaries,
        "the database",
    );
    // The API key the owner uses is a credential too: not in the log, not in the database.
    assert_absent(&log, &[&owner], "the server log");
    assert_absent(
        &database_text(&db, dir.path()).await,
        &[&owner],
        "the database",
    );
}

fn secrets_cmd(args: &[&str], db: &[String], envs: &[(&str, &str)]) -> std::process::Output {
    let mut all = vec!["secrets"];
    all.extend_from_slice(args);
    all.extend(db.iter().map(String::as_str));
    run(wor(&all).envs(envs.iter().copied()))
}

fn generate_key() -> String {
    let out = run(&mut wor(&["secrets", "generate-key"]));
    assert!(out.status.success());
    let key = text(&out.stdout).trim().to_owned();
    assert_eq!(
        base64::engine::general_purpose::STANDARD
            .decode(&key)
            .unwrap()
            .len(),
        32
    );
    key
}

#[tokio::test(flavor = "multi_thread")]
async fn rotation_survives_interruption_and_old_keys_can_then_be_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let db = own_database_args(dir.path()).await;
    let owner = create_project(&db);
    let old = generate_key();
    let new = generate_key();
    let server = Server::start(&db, &[("WOR_ENCRYPTION_KEY", old.as_str())]);
    let mut ids = Vec::new();
    for i in 0..3 {
        let out = with_stdin(
            &server,
            &owner,
            &[
                "model-connection",
                "create",
                &format!("m{i}"),
                "--provider",
                "anthropic",
                "--base-url",
                "https://models.example.com",
                "--api-key-stdin",
                "--json",
            ],
            &format!("sk-rotate-{i}-abcdef123456"),
        );
        assert!(out.status.success(), "{}", text(&out.stderr));
        ids.push(
            serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()["id"]
                .as_str()
                .unwrap()
                .to_owned(),
        );
    }
    server.stop();

    let both = [
        ("WOR_ENCRYPTION_KEY", new.as_str()),
        ("WOR_ENCRYPTION_KEY_RETIRED", old.as_str()),
    ];
    // Interrupted after one secret: the rest are still under the old key, and nothing is lost.
    let partial = secrets_cmd(&["rotate", "--limit", "1"], &db, &both);
    assert!(partial.status.success(), "{}", text(&partial.stderr));
    assert!(
        text(&partial.stderr).contains("re-sealed 1"),
        "{}",
        text(&partial.stderr)
    );
    let mid = secrets_cmd(&["verify"], &db, &both);
    assert!(mid.status.success(), "{}", text(&mid.stderr));

    // A server restarted midway serves with both keys.
    let server = Server::start(&db, &both);
    let listed = server.client(&owner, &["model-connection", "list"]);
    assert!(listed.status.success());
    server.stop();

    let rest = secrets_cmd(&["rotate"], &db, &both);
    assert!(rest.status.success(), "{}", text(&rest.stderr));
    assert!(
        text(&rest.stderr).contains("no stored secret needs the retired keys"),
        "{}",
        text(&rest.stderr)
    );

    // The old key is dropped: everything still opens under the new one alone.
    let only_new = [("WOR_ENCRYPTION_KEY", new.as_str())];
    let verified = secrets_cmd(&["verify"], &db, &only_new);
    assert!(verified.status.success(), "{}", text(&verified.stderr));
    // ... and the old key alone opens nothing of ours any more.
    let only_old = [("WOR_ENCRYPTION_KEY", old.as_str())];
    let stale = secrets_cmd(&["verify"], &db, &only_old);
    assert_eq!(stale.status.code(), Some(1));
    assert!(
        text(&stale.stderr).contains("unknown key id") || text(&stale.stderr).contains("key id"),
        "{}",
        text(&stale.stderr)
    );
    assert!(!text(&stale.stderr).contains(&new) && !text(&stale.stderr).contains(&old));
}

#[tokio::test(flavor = "multi_thread")]
async fn ciphertexts_swapped_between_rows_do_not_decrypt() {
    let dir = tempfile::tempdir().unwrap();
    let db = own_database_args(dir.path()).await;
    let owner = create_project(&db);
    let key = generate_key();
    let envs = [("WOR_ENCRYPTION_KEY", key.as_str())];
    let server = Server::start(&db, &envs);
    let mut ids = Vec::new();
    for name in ["a", "b"] {
        let out = with_stdin(
            &server,
            &owner,
            &[
                "model-connection",
                "create",
                name,
                "--provider",
                "anthropic",
                "--base-url",
                "https://models.example.com",
                "--api-key-stdin",
                "--json",
            ],
            &format!("sk-swap-{name}-0123456789"),
        );
        assert!(out.status.success(), "{}", text(&out.stderr));
        ids.push(
            serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()["id"]
                .as_str()
                .unwrap()
                .to_owned(),
        );
    }
    server.stop();
    assert!(secrets_cmd(&["verify"], &db, &envs).status.success());

    // An attacker with database access swaps the two ciphertexts.
    let store = wor_store::Store::connect(&db[3]).await.unwrap();
    let fetch = |id: String| {
        let pool = store.pool().clone();
        async move {
            let (blob,): (Vec<u8>,) =
                sqlx::query_as("SELECT sealed FROM sealed_secrets WHERE owner_id = $1")
                    .bind(id)
                    .fetch_one(&pool)
                    .await
                    .unwrap();
            blob
        }
    };
    let (a, b) = (fetch(ids[0].clone()).await, fetch(ids[1].clone()).await);
    for (id, blob) in [(&ids[0], &b), (&ids[1], &a)] {
        sqlx::query("UPDATE sealed_secrets SET sealed = $1 WHERE owner_id = $2")
            .bind(blob.clone())
            .bind(id.clone())
            .execute(store.pool())
            .await
            .unwrap();
    }
    store.close().await;

    let verified = secrets_cmd(&["verify"], &db, &envs);
    let stderr = text(&verified.stderr);
    assert_eq!(verified.status.code(), Some(1), "{stderr}");
    for id in &ids {
        assert!(
            stderr.contains(&format!("model_connections/{id}/api_key")),
            "names the slot: {stderr}"
        );
    }
    assert!(!stderr.contains("sk-swap-"), "{stderr}");
}

/// An authorization server, the MCP server it guards and an OpenAI-compatible model, on
/// loopback, for the MCP authorization canary test below.
mod authorized {
    use std::sync::{Arc, Mutex};

    use axum::Router;
    use axum::extract::State;
    use axum::http::StatusCode;
    use axum::response::{IntoResponse, Response};
    use axum::routing::{get, post};
    use rmcp::model::{
        CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, ErrorData,
        InitializeResult, ListToolsResult, PaginatedRequestParams, ServerCapabilities, Tool,
        ToolAnnotations,
    };
    use rmcp::service::{RequestContext, RoleServer};
    use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
    use rmcp::transport::streamable_http_server::{
        StreamableHttpServerConfig, StreamableHttpService,
    };
    use serde_json::{Value, json};

    #[derive(Default)]
    pub struct Realm {
        pub base: String,
        /// The PKCE challenge of the authorization request the person consented to.
        pub challenge: Option<String>,
        /// Every secret the authorization server issued or received: tokens and the verifier.
        pub secrets: Vec<String>,
        pub refresh: Option<String>,
        pub access: Option<String>,
        /// The current access token has expired: each lasts for one tool call.
        pub expired: bool,
        pub refreshes: u32,
    }

    pub type Shared = Arc<Mutex<Realm>>;

    fn form(body: &str) -> Vec<(String, String)> {
        url::form_urlencoded::parse(body.as_bytes())
            .into_owned()
            .collect()
    }

    fn param(pairs: &[(String, String)], key: &str) -> String {
        pairs
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
            .unwrap_or_default()
    }

    async fn protected(State(s): State<Shared>) -> Response {
        let base = s.lock().unwrap().base.clone();
        axum::Json(json!({"resource": format!("{base}/mcp"), "authorization_servers": [base]}))
            .into_response()
    }

    async fn metadata(State(s): State<Shared>) -> Response {
        let base = s.lock().unwrap().base.clone();
        axum::Json(json!({
            "issuer": base,
            "authorization_endpoint": format!("{base}/authorize"),
            "token_endpoint": format!("{base}/token"),
            "registration_endpoint": format!("{base}/register"),
            "code_challenge_methods_supported": ["S256"],
        }))
        .into_response()
    }

    async fn register() -> Response {
        axum::Json(json!({"client_id": "client-canary"})).into_response()
    }

    async fn token(State(s): State<Shared>, body: String) -> Response {
        use secrecy::SecretString;
        let pairs = form(&body);
        let mut s = s.lock().unwrap();
        let refused = (
            StatusCode::BAD_REQUEST,
            axum::Json(json!({"error": "invalid_grant"})),
        )
            .into_response();
        match param(&pairs, "grant_type").as_str() {
            "authorization_code" => {
                let verifier = param(&pairs, "code_verifier");
                let challenge =
                    wor_tools::oauth::Pkce::from_verifier(SecretString::from(verifier.clone()))
                        .challenge;
                s.secrets.push(verifier);
                if param(&pairs, "code") != "code-canary-3e1f"
                    || s.challenge.as_deref() != Some(&challenge)
                {
                    return refused;
                }
            }
            "refresh_token" => {
                if s.refresh.as_deref() != Some(&param(&pairs, "refresh_token")) {
                    return refused;
                }
                s.refreshes += 1;
            }
            _ => return refused,
        }
        let n = s.secrets.len();
        let access = format!("oat-canary-access-{n}-7f3e91c2a4b6d8e0");
        let refresh = format!("ort-canary-refresh-{n}-1b2c3d4e5f607182");
        s.secrets.push(access.clone());
        s.secrets.push(refresh.clone());
        s.access = Some(access.clone());
        s.refresh = Some(refresh.clone());
        s.expired = false;
        axum::Json(json!({"access_token": access, "refresh_token": refresh,
            "token_type": "Bearer", "expires_in": 3600}))
        .into_response()
    }

    /// The tracker: `lookup` answers, and echoes the `Authorization` header it received as a
    /// careless or hostile server might; each access token expires once a call has used it.
    #[derive(Clone)]
    struct Tracker(Shared);

    impl rmcp::ServerHandler for Tracker {
        fn get_info(&self) -> InitializeResult {
            InitializeResult::new(ServerCapabilities::builder().enable_tools().build())
        }

        async fn list_tools(
            &self,
            _request: Option<PaginatedRequestParams>,
            _context: RequestContext<RoleServer>,
        ) -> Result<ListToolsResult, ErrorData> {
            let schema = json!({"type": "object", "properties": {"issue": {"type": "string"}}});
            let mut tool = Tool::new(
                "lookup",
                "Looks an issue up",
                Arc::new(schema.as_object().unwrap().clone()),
            );
            tool.annotations = Some(ToolAnnotations::new().read_only(true));
            Ok(ListToolsResult::with_all_items(vec![tool]))
        }

        async fn call_tool(
            &self,
            request: CallToolRequestParams,
            context: RequestContext<RoleServer>,
        ) -> Result<CallToolResponse, ErrorData> {
            let issue = request
                .arguments
                .as_ref()
                .and_then(|a| a.get("issue"))
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned();
            let presented = context
                .extensions
                .get::<axum::http::request::Parts>()
                .and_then(|parts| parts.headers.get("authorization"))
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_owned();
            self.0.lock().unwrap().expired = true;
            Ok(CallToolResult::success(vec![ContentBlock::text(format!(
                "issue {issue} is open (you sent: {presented})"
            ))])
            .into())
        }
    }

    async fn bearer_only(
        State(s): State<Shared>,
        request: axum::extract::Request,
        next: axum::middleware::Next,
    ) -> Response {
        let (base, access) = {
            let s = s.lock().unwrap();
            (s.base.clone(), s.access.clone().filter(|_| !s.expired))
        };
        let presented = request
            .headers()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::to_owned);
        if presented.is_some() && presented == access {
            return next.run(request).await;
        }
        let challenge =
            format!("Bearer resource_metadata=\"{base}/.well-known/oauth-protected-resource/mcp\"");
        (StatusCode::UNAUTHORIZED, [("www-authenticate", challenge)]).into_response()
    }

    /// The model: calls `lookup` for issue 7, then for issue 8, then answers; every request
    /// body it receives (the model's whole input) is kept.
    async fn model(State(seen): State<Arc<Mutex<Vec<String>>>>, body: String) -> Response {
        let answered = body.matches("\"role\":\"tool\"").count();
        seen.lock().unwrap().push(body);
        let delta = match answered {
            0 | 1 => {
                let issue = if answered == 0 { "7" } else { "8" };
                json!({"role": "assistant", "tool_calls": [{"index": 0, "id": format!("call_{issue}"),
                    "type": "function", "function": {"name": "tracker__lookup",
                    "arguments": json!({"issue": issue}).to_string()}}]})
            }
            _ => json!({"role": "assistant", "content": "issues 7 and 8 are open"}),
        };
        let finish = if answered < 2 { "tool_calls" } else { "stop" };
        let body = format!(
            "data: {}\n\ndata: {}\n\ndata: [DONE]\n\n",
            json!({"choices": [{"index": 0, "delta": delta}]}),
            json!({"choices": [{"index": 0, "delta": {}, "finish_reason": finish}],
                "usage": {"prompt_tokens": 9, "completion_tokens": 4}})
        );
        ([("content-type", "text/event-stream")], body).into_response()
    }

    /// Starts the servers on a runtime of their own; returns their address and what they saw.
    pub fn start() -> (std::net::SocketAddr, Shared, Arc<Mutex<Vec<String>>>) {
        let shared: Shared = Arc::default();
        let seen: Arc<Mutex<Vec<String>>> = Arc::default();
        let (tx, rx) = std::sync::mpsc::channel();
        let (state, inputs) = (shared.clone(), seen.clone());
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Runtime::new().unwrap();
            runtime.block_on(async move {
                let tracker = Tracker(state.clone());
                let mcp = StreamableHttpService::new(
                    move || Ok(tracker.clone()),
                    Arc::new(LocalSessionManager::default()),
                    StreamableHttpServerConfig::default(),
                );
                let protected_mcp = Router::new().nest_service("/mcp", mcp).layer(
                    axum::middleware::from_fn_with_state(state.clone(), bearer_only),
                );
                let app = Router::new()
                    .route("/.well-known/oauth-protected-resource/mcp", get(protected))
                    .route("/.well-known/oauth-authorization-server", get(metadata))
                    .route("/register", post(register))
                    .route("/token", post(token))
                    .with_state(state.clone())
                    .merge(protected_mcp)
                    .merge(
                        Router::new()
                            .route("/v1/chat/completions", post(model))
                            .with_state(inputs),
                    );
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                let addr = listener.local_addr().unwrap();
                state.lock().unwrap().base = format!("http://{addr}");
                tx.send(addr).unwrap();
                axum::serve(listener, app).await.unwrap();
            });
        });
        (rx.recv().unwrap(), shared, seen)
    }
}

/// MCP authorization through the binary, at the most verbose log level: a connection is
/// authorized (the test plays the person's browser), reviewed and used by a run whose access
/// token expires between its two calls and is refreshed on the server's `401`. The server
/// echoes the token it receives in its results. No access token, refresh token or PKCE
/// verifier, in any common encoding, reaches an API response or CLI output, the server's log,
/// the database (run records included) or anything the model was sent.
#[tokio::test(flavor = "multi_thread")]
async fn mcp_authorization_tokens_appear_nowhere() {
    let (addr, realm, model_inputs) = authorized::start();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("wor.toml");
    std::fs::write(
        &config,
        "public_url = \"http://wor.test\"\n[egress]\nallowed_cidrs = [\"127.0.0.1/32\"]\n\
         model_cidrs = [\"127.0.0.1/32\"]\n",
    )
    .unwrap();
    let mut db = own_database_args(dir.path()).await;
    db.extend(["--config".to_owned(), config.display().to_string()]);
    let owner = create_project(&db);
    let server = Server::start(&db, &[("WOR_LOG", "trace")]);
    let responses = std::cell::RefCell::new(String::new());
    let client = |args: &[&str]| {
        let out = server.client(&owner, args);
        assert!(out.status.success(), "{args:?}: {}", text(&out.stderr));
        let mut responses = responses.borrow_mut();
        responses.push_str(&text(&out.stdout));
        responses.push_str(&text(&out.stderr));
        text(&out.stdout)
    };

    client(&[
        "model-connection",
        "create",
        "local",
        "--provider",
        "openai_compatible",
        "--base-url",
        &format!("http://{addr}/v1"),
    ]);
    let created = client(&[
        "connection",
        "create",
        "tracker",
        "--url",
        &format!("http://{addr}/mcp"),
        "--allow",
        &addr.to_string(),
        "--json",
    ]);
    let id = serde_json::from_str::<serde_json::Value>(&created).unwrap()["id"]
        .as_str()
        .unwrap()
        .to_owned();

    // The person opens the printed URL and consents; the authorization server sends the
    // browser back to `wor serve` with a code and the state.
    let printed = client(&["connection", "authorize", &id]);
    let url = printed
        .lines()
        .find(|l| l.starts_with("http://"))
        .unwrap()
        .to_owned();
    let query: Vec<(String, String)> = url::Url::parse(&url)
        .unwrap()
        .query_pairs()
        .into_owned()
        .collect();
    let get = |key: &str| {
        query
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
            .unwrap()
    };
    assert_eq!(get("code_challenge_method"), "S256");
    realm.lock().unwrap().challenge = Some(get("code_challenge"));
    let callback = server.raw(&format!(
        "GET /hooks/oauth/callback?code=code-canary-3e1f&state={} HTTP/1.1\r\nHost: wor.test\r\n\
         Connection: close\r\n\r\n",
        get("state")
    ));
    assert!(callback.starts_with("HTTP/1.1 200"), "{callback}");
    responses.borrow_mut().push_str(&callback);
    // The page hands the browser on to the console, where the owner, signed in, finishes it.
    let start = callback.find("url=").unwrap() + 4;
    let finish = callback[start..][..callback[start..].find('"').unwrap()].replace("&amp;", "&");
    let projects = run(&mut wor(&[
        &["project", "list", "--json"][..],
        &db.iter().map(String::as_str).collect::<Vec<_>>(),
    ]
    .concat()));
    let project = serde_json::from_slice::<serde_json::Value>(&projects.stdout).unwrap()[0]["name"]
        .as_str()
        .unwrap()
        .to_owned();
    let mut console = RawConsole::default();
    let invited = client(&["member", "invite", "owner"]);
    let invitation = invited.trim().trim_start_matches(&server.url).to_owned();
    console.sign_in(&server, &invitation, &project, "owner");
    let finished = console.request(&server, "GET", &finish, &[]);
    assert!(finished.starts_with("HTTP/1.1 303"), "{finished}");
    responses.borrow_mut().push_str(&finished);

    let review = client(&["connection", "review", &id, "--json"]);
    let review_file = dir.path().join("review.json");
    std::fs::write(&review_file, review).unwrap();
    client(&[
        "connection",
        "enable",
        &id,
        "--from-review",
        review_file.to_str().unwrap(),
        "--read-only",
        "lookup",
    ]);
    let routine = dir.path().join("triage.toml");
    std::fs::write(
        &routine,
        "name = \"triage\"\ninstructions = \"Look issues 7 and 8 up.\"\n[model]\n\
         provider = \"openai_compatible\"\nconnection = \"local\"\nmodel = \"m\"\n\
         [[tools]]\ntool = \"tracker/lookup\"\nmode = \"auto\"\n",
    )
    .unwrap();
    client(&["routine", "apply", "-f", routine.to_str().unwrap()]);
    let run_id = client(&["run", "start", "triage"]).trim().to_owned();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let shown = loop {
        let shown = client(&["run", "get", &run_id, "--json"]);
        let status = serde_json::from_str::<serde_json::Value>(&shown).unwrap()["status"]
            .as_str()
            .unwrap()
            .to_owned();
        if !matches!(status.as_str(), "queued" | "running") {
            assert_eq!(status, "succeeded", "{shown}");
            break shown;
        }
        assert!(std::time::Instant::now() < deadline, "{shown}");
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    assert!(
        shown.contains("issues 7 and 8 are open")
            && shown.contains("issue 8 is open (you sent: [REDACTED])"),
        "{shown}"
    );
    // The first call used the token up: the second was refused once, refreshed and resent.
    assert_eq!(realm.lock().unwrap().refreshes, 1);
    for args in [
        vec!["connection", "show", id.as_str(), "--json"],
        vec!["connection", "list", "--json"],
        vec!["run", "list", "--json"],
        vec!["audit", "export"],
    ] {
        client(&args);
    }
    let log = server.stop();

    let secrets = realm.lock().unwrap().secrets.clone();
    assert_eq!(secrets.len(), 5, "a verifier and two pairs of tokens");
    let canaries: Vec<&str> = secrets.iter().map(String::as_str).collect();
    let inputs = model_inputs.lock().unwrap().join("\n");
    assert_eq!(model_inputs.lock().unwrap().len(), 3);
    assert!(inputs.contains("issue 8 is open"), "{inputs}");
    assert_absent(&inputs, &canaries, "what the model was sent");
    assert_absent(
        &responses.borrow(),
        &canaries,
        "an API response or CLI output",
    );
    assert_absent(&log, &canaries, "the server log");
    assert_absent(
        &database_text(&db, dir.path()).await,
        &canaries,
        "the database",
    );
}

/// A browser of the console over raw HTTP/1.1: a cookie jar, no redirects followed.
#[derive(Default)]
struct RawConsole {
    cookies: std::collections::BTreeMap<String, String>,
}

impl RawConsole {
    /// One request; the whole response, its cookies kept.
    fn request(
        &mut self,
        server: &Server,
        method: &str,
        path: &str,
        form: &[(&str, &str)],
    ) -> String {
        let body = url::form_urlencoded::Serializer::new(String::new())
            .extend_pairs(form)
            .finish();
        let cookie = self
            .cookies
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join("; ");
        let response = server.raw(&format!(
            "{method} {path} HTTP/1.1\r\nHost: wor.test\r\nCookie: {cookie}\r\n\
             Content-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\n\
             Connection: close\r\n\r\n{body}",
            body.len()
        ));
        let head = &response[..response.find("\r\n\r\n").unwrap_or(response.len())];
        for line in head.lines() {
            if let Some(set) = line.strip_prefix("set-cookie: ") {
                let pair = set.split(';').next().unwrap();
                let (name, value) = pair.split_once('=').unwrap();
                self.cookies.insert(name.to_owned(), value.to_owned());
            }
        }
        response
    }

    /// The hidden `csrf` field of the page at `path`.
    fn csrf(&mut self, server: &Server, path: &str) -> String {
        let page = self.request(server, "GET", path, &[]);
        let start = page.find("name=\"csrf\" value=\"").expect("a csrf field") + 19;
        page[start..][..page[start..].find('"').unwrap()].to_owned()
    }

    /// Sets a password through `invitation` and signs in as `name` of `project`.
    fn sign_in(&mut self, server: &Server, invitation: &str, project: &str, name: &str) {
        const PASSWORD: &str = "a long and quiet passphrase";
        let csrf = self.csrf(server, invitation);
        let set = self.request(
            server,
            "POST",
            invitation,
            &[
                ("csrf", &csrf),
                ("password", PASSWORD),
                ("repeat", PASSWORD),
            ],
        );
        assert!(set.starts_with("HTTP/1.1 303"), "{set}");
        let csrf = self.csrf(server, "/console/sign-in");
        let signed = self.request(
            server,
            "POST",
            "/console/sign-in",
            &[
                ("csrf", &csrf),
                ("project", project),
                ("name", name),
                ("password", PASSWORD),
            ],
        );
        assert!(signed.starts_with("HTTP/1.1 303"), "{signed}");
    }
}
