//! MCP authorization of a tool connection through the API, loopback only: an in-test
//! authorization server (discovery, dynamic registration, PKCE code exchange, refresh with
//! rotation, revocation) and an MCP server that answers only its current access token; the
//! test plays the person's browser. Runs call the server across a refresh and fail closed once
//! the grant is revoked; concurrent refreshes of one connection refresh once. Canary tokens
//! never appear in an API response, a run's record or the audit chain.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic,
    reason = "tests fail loudly"
)]

#[path = "common/browser.rs"]
mod browser;
mod common;

use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::State;
use axum::http::{Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use common::{Harness, serve};
use secrecy::ExposeSecret;
use serde_json::{Value, json};

const ACCESS_CANARY: &str = "access-canary-5d1e";
const REFRESH_CANARY: &str = "refresh-canary-9b27";

#[derive(Default)]
struct AuthServer {
    base: String,
    challenge: Option<String>,
    issued: u32,
    /// Refresh grants answered.
    refreshes: u32,
    refresh: Option<String>,
    /// The one access token the MCP server accepts: the last one issued.
    access: Option<String>,
    revoked: bool,
    /// A client registered beforehand (id, secret): the server then offers no dynamic
    /// registration and takes only `client_secret_basic`.
    preregistered: Option<(String, String)>,
    /// Each access token expires once a tool call has used it (a lifetime shorter than a
    /// run, though the token endpoint said an hour).
    expire_after_call: bool,
    /// The current access token has expired: the MCP server refuses it.
    expired: bool,
    /// The server accepts client ID metadata documents: a client's id is this URL.
    metadata_document_client: Option<String>,
    /// Dynamic registrations answered.
    registrations: u32,
    /// The MCP server asks for scope `issues:read` in its challenge, and a tool call needs
    /// `issues:write` too (a `403` with `insufficient_scope` otherwise).
    step_up: bool,
    /// The `scope` of the last authorization request.
    last_scope: String,
    /// The scope the current access token was granted.
    access_scope: String,
    /// Tool calls the MCP server ran.
    calls: u32,
    /// The server promises `iss` in its answers (RFC 9207) …
    promises_iss: bool,
    /// … and sends this one (`None`: none at all).
    sends_iss: Option<String>,
}

type Shared = Arc<Mutex<AuthServer>>;

fn query(uri: &Uri) -> Vec<(String, String)> {
    url::form_urlencoded::parse(uri.query().unwrap_or_default().as_bytes())
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
    let (base, step_up) = {
        let s = s.lock().unwrap();
        (s.base.clone(), s.step_up)
    };
    let mut metadata = json!({"resource": format!("{base}/mcp"), "authorization_servers": [base]});
    if step_up {
        // The scopes it understands: a step-up asking for more is not remembered.
        metadata["scopes_supported"] = json!(["issues:read", "issues:write"]);
    }
    axum::Json(metadata).into_response()
}

async fn metadata(State(s): State<Shared>) -> Response {
    let (base, preregistered, metadata_document) = {
        let s = s.lock().unwrap();
        (
            s.base.clone(),
            s.preregistered.is_some(),
            s.metadata_document_client.is_some(),
        )
    };
    let mut metadata = json!({
        "issuer": base,
        "authorization_endpoint": format!("{base}/authorize"),
        "token_endpoint": format!("{base}/token"),
        "registration_endpoint": format!("{base}/register"),
        "code_challenge_methods_supported": ["S256"],
    });
    if preregistered {
        let object = metadata.as_object_mut().unwrap();
        object.remove("registration_endpoint");
        object.insert(
            "token_endpoint_auth_methods_supported".to_owned(),
            json!(["client_secret_basic"]),
        );
    }
    if metadata_document {
        metadata["client_id_metadata_document_supported"] = json!(true);
    }
    if s.lock().unwrap().promises_iss {
        metadata["authorization_response_iss_parameter_supported"] = json!(true);
    }
    axum::Json(metadata).into_response()
}

async fn register(State(s): State<Shared>) -> Response {
    s.lock().unwrap().registrations += 1;
    axum::Json(json!({"client_id": "client-7"})).into_response()
}

/// The client id the authorization server knows wor by: the one registered beforehand, else
/// the metadata document's URL where it accepts one and no client registered dynamically.
fn expected_client_id(s: &AuthServer) -> String {
    match (&s.preregistered, &s.metadata_document_client) {
        (Some((id, _)), _) => id.clone(),
        (None, Some(url)) if s.registrations == 0 => url.clone(),
        _ => "client-7".to_owned(),
    }
}

async fn authorize(State(s): State<Shared>, uri: Uri) -> Response {
    let pairs = query(&uri);
    let (base, client_id) = {
        let s = s.lock().unwrap();
        (s.base.clone(), expected_client_id(&s))
    };
    assert_eq!(param(&pairs, "client_id"), client_id);
    assert_eq!(param(&pairs, "code_challenge_method"), "S256");
    assert_eq!(param(&pairs, "resource"), format!("{base}/mcp"));
    {
        let mut s = s.lock().unwrap();
        s.challenge = Some(param(&pairs, "code_challenge"));
        s.last_scope = param(&pairs, "scope");
    }
    let iss = s
        .lock()
        .unwrap()
        .sends_iss
        .as_ref()
        .map(|iss| {
            format!(
                "&iss={}",
                url::form_urlencoded::byte_serialize(iss.as_bytes()).collect::<String>()
            )
        })
        .unwrap_or_default();
    let location = format!(
        "{}?code=the-code&state={}{iss}",
        param(&pairs, "redirect_uri"),
        param(&pairs, "state")
    );
    (StatusCode::FOUND, [("location", location)]).into_response()
}

async fn token(State(s): State<Shared>, headers: axum::http::HeaderMap, body: String) -> Response {
    let pairs: Vec<(String, String)> = url::form_urlencoded::parse(body.as_bytes())
        .into_owned()
        .collect();
    let mut s = s.lock().unwrap();
    assert_eq!(param(&pairs, "resource"), format!("{}/mcp", s.base));
    let refused = || {
        (
            StatusCode::BAD_REQUEST,
            axum::Json(json!({"error": "invalid_grant"})),
        )
            .into_response()
    };
    if let Some((id, secret)) = &s.preregistered {
        use base64::Engine as _;
        let expected = format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(format!("{id}:{secret}"))
        );
        let presented = headers.get("authorization").and_then(|v| v.to_str().ok());
        if presented != Some(expected.as_str()) || body.contains("client_secret") {
            return (
                StatusCode::UNAUTHORIZED,
                axum::Json(json!({"error": "invalid_client"})),
            )
                .into_response();
        }
    }
    if s.preregistered.is_none() && param(&pairs, "client_id") != expected_client_id(&s) {
        return refused();
    }
    match param(&pairs, "grant_type").as_str() {
        "authorization_code" => {
            let verifier = param(&pairs, "code_verifier");
            let challenge =
                wor_tools::oauth::Pkce::from_verifier(secrecy::SecretString::from(verifier))
                    .challenge;
            if param(&pairs, "code") != "the-code" || s.challenge.as_deref() != Some(&challenge) {
                return refused();
            }
            s.access_scope = s.last_scope.clone();
        }
        "refresh_token" => {
            if s.revoked || s.refresh.as_deref() != Some(&param(&pairs, "refresh_token")) {
                return refused();
            }
            s.refreshes += 1;
        }
        _ => return refused(),
    }
    s.issued += 1;
    s.expired = false;
    let refresh = format!("{REFRESH_CANARY}-{}", s.issued);
    s.refresh = Some(refresh.clone());
    let access = format!("{ACCESS_CANARY}-{}", s.issued);
    s.access = Some(access.clone());
    axum::Json(json!({
        "access_token": access,
        "refresh_token": refresh,
        "token_type": "Bearer",
        "expires_in": 3600,
    }))
    .into_response()
}

#[tokio::test]
async fn a_connection_is_authorized_refreshed_and_fails_closed_when_revoked() {
    let shared: Shared = Arc::default();
    let app = Router::new()
        .route("/.well-known/oauth-protected-resource/mcp", get(protected))
        .route("/.well-known/oauth-authorization-server", get(metadata))
        .route("/register", post(register))
        .route("/authorize", get(authorize))
        .route("/token", post(token))
        .with_state(shared.clone());
    let addr = serve(app).await;
    let base = format!("http://{addr}");
    shared.lock().unwrap().base = base.clone();

    let h = Harness::with_config(wor_engine::EngineConfig {
        console_url: Some("http://wor.test".to_owned()),
        ..wor_engine::EngineConfig::default()
    })
    .await;
    let (status, created) = h
        .call(
            Method::POST,
            "/v1/tool-connections",
            Some(
                json!({"name": "tracker", "kind": "mcp_http", "url": format!("{base}/mcp"),
                "allowlist": [addr.to_string()]}),
            ),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    let id = created["id"].as_str().unwrap().to_owned();

    let (status, started, started_text) = h
        .call_as(
            h.owner(),
            Method::POST,
            &format!("/v1/tool-connections/{id}/authorize"),
            None,
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{started}");
    let url = started["authorization_url"].as_str().unwrap();
    assert!(url.starts_with(&format!("{base}/authorize?")), "{url}");
    assert!(url.contains("redirect_uri=http%3A%2F%2Fwor.test%2Fhooks%2Foauth%2Fcallback"));

    // The browser: the authorization server answers with a redirect to the callback.
    let callback = browse_to_callback(url).await;

    // A wrong state finishes nothing; the right one finishes it once.
    let (status, _) = h
        .call(
            Method::GET,
            "/hooks/oauth/callback?code=the-code&state=forged",
            None,
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    // The callback hands the browser on to the console, which finishes it only for the member
    // who started it. Another member sent the link finishes nothing, and it stays pending.
    let console = browser::serve_console(&h).await;
    let mut other = browser::signed_in(&h, console, "mallory", Some("admin")).await;
    let (_, refused) = come_back(&mut other, &callback).await;
    assert_eq!(refused.status, StatusCode::FORBIDDEN, "{}", refused.body);
    assert!(
        refused.body.contains("started by another member"),
        "{}",
        refused.body
    );
    // A browser signed in to nothing is asked to sign in first, and comes back to the finish.
    let (_, asked) = come_back(&mut browser::Browser::new(console), &callback).await;
    assert_eq!(asked.status, StatusCode::SEE_OTHER, "{}", asked.body);
    assert!(
        asked
            .location()
            .starts_with("/console/sign-in?next=%2Fconsole%2Foauth%2Ffinish"),
        "{}",
        asked.location()
    );
    let mut owner = browser::signed_in(&h, console, "alice", None).await;
    let (handed, finished) = come_back(&mut owner, &callback).await;
    assert_eq!(finished.status, StatusCode::SEE_OTHER, "{}", finished.body);
    assert_eq!(finished.location(), format!("/console/connections/{id}"));
    let finished_text = format!("{}{}", handed.body, finished.body);
    let again = owner.get(&callback).await;
    assert_eq!(
        again.status,
        StatusCode::BAD_REQUEST,
        "a state is used once: {}",
        again.body
    );

    let project = h.project.project.id;
    let connection: wor_core::ConnectionId = id.parse().unwrap();
    let token = h
        .engine
        .oauth_access_token(project, connection, "tracker")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(token.expose_secret(), format!("{ACCESS_CANARY}-1"));

    // Near its expiry the token is refreshed, and the rotated refresh token is kept.
    h.db.store
        .record_connection_oauth_refresh(project, connection, Some(0))
        .await
        .unwrap();
    let token = h
        .engine
        .oauth_access_token(project, connection, "tracker")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(token.expose_secret(), format!("{ACCESS_CANARY}-2"));
    assert_eq!(
        shared.lock().unwrap().refresh.as_deref(),
        Some(format!("{REFRESH_CANARY}-2").as_str())
    );
    h.db.store
        .record_connection_oauth_refresh(project, connection, Some(0))
        .await
        .unwrap();
    let token = h
        .engine
        .oauth_access_token(project, connection, "tracker")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(token.expose_secret(), format!("{ACCESS_CANARY}-3"));

    // Revoked: the next refresh fails closed, naming the connection and what to do.
    shared.lock().unwrap().revoked = true;
    h.db.store
        .record_connection_oauth_refresh(project, connection, Some(0))
        .await
        .unwrap();
    let error = h
        .engine
        .oauth_access_token(project, connection, "tracker")
        .await
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("tool connection `tracker` is no longer authorized")
            && error.contains(&format!("run `wor connection authorize {id}` again")),
        "{error}"
    );

    let (_, _, view_text) = h
        .call_as(
            h.owner(),
            Method::GET,
            &format!("/v1/tool-connections/{id}"),
            None,
        )
        .await;
    let audit = h.audit_text().await;
    assert!(audit.contains("connection.authorize"));
    assert!(audit.contains("connection.token_refresh"));
    assert!(audit.contains("connection.authorize_failure"));
    for text in [&started_text, &finished_text, &view_text, &audit] {
        assert!(
            !text.contains(ACCESS_CANARY) && !text.contains(REFRESH_CANARY),
            "a token leaked: {text}"
        );
    }
}

/// The tracker's MCP tools: `lookup` answers what it was asked and, as a careless or hostile
/// server might, echoes the `Authorization` header it received.
#[derive(Clone)]
struct Tracker(Shared);

impl rmcp::ServerHandler for Tracker {
    fn get_info(&self) -> rmcp::model::InitializeResult {
        rmcp::model::InitializeResult::new(
            rmcp::model::ServerCapabilities::builder()
                .enable_tools()
                .build(),
        )
    }

    async fn list_tools(
        &self,
        _request: Option<rmcp::model::PaginatedRequestParams>,
        _context: rmcp::service::RequestContext<rmcp::service::RoleServer>,
    ) -> Result<rmcp::model::ListToolsResult, rmcp::model::ErrorData> {
        let schema = json!({"type": "object", "properties": {"issue": {"type": "string"}}});
        Ok(rmcp::model::ListToolsResult::with_all_items(vec![
            rmcp::model::Tool::new(
                "lookup",
                "Looks an issue up",
                Arc::new(schema.as_object().unwrap().clone()),
            ),
        ]))
    }

    async fn call_tool(
        &self,
        request: rmcp::model::CallToolRequestParams,
        context: rmcp::service::RequestContext<rmcp::service::RoleServer>,
    ) -> Result<rmcp::model::CallToolResponse, rmcp::model::ErrorData> {
        let issue = request
            .arguments
            .as_ref()
            .and_then(|a| a.get("issue"))
            .and_then(Value::as_str)
            .unwrap_or("7")
            .to_owned();
        let presented = context
            .extensions
            .get::<axum::http::request::Parts>()
            .and_then(|parts| parts.headers.get("authorization"))
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        {
            let mut s = self.0.lock().unwrap();
            s.calls += 1;
            if s.expire_after_call {
                s.expired = true;
            }
        }
        Ok(
            rmcp::model::CallToolResult::success(vec![rmcp::model::ContentBlock::text(format!(
                "issue {issue} is open (you sent: {presented})"
            ))])
            .into(),
        )
    }
}

/// Lets a request reach the MCP server only with the access token issued last; anything else
/// is the `401` whose challenge names the protected-resource metadata (and, with `step_up`,
/// scope `issues:read`). With `step_up`, a tool call whose token was not granted
/// `issues:write` is a `403` with `insufficient_scope` naming `issues:read issues:write` and
/// `admin:org`, which its metadata does not list.
async fn bearer_only(
    State(s): State<Shared>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let (base, access, step_up, access_scope) = {
        let s = s.lock().unwrap();
        (
            s.base.clone(),
            s.access.clone().filter(|_| !s.expired),
            s.step_up,
            s.access_scope.clone(),
        )
    };
    let presented = request
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::to_owned);
    let metadata = format!("resource_metadata=\"{base}/.well-known/oauth-protected-resource/mcp\"");
    if presented.is_some() && presented == access {
        if !step_up {
            return next.run(request).await;
        }
        let (parts, body) = request.into_parts();
        let bytes = axum::body::to_bytes(body, 1 << 20).await.unwrap();
        let is_call = serde_json::from_slice::<Value>(&bytes)
            .is_ok_and(|message| message["method"] == "tools/call");
        if is_call && !access_scope.split(' ').any(|scope| scope == "issues:write") {
            let challenge = format!(
                "Bearer error=\"insufficient_scope\", scope=\"issues:read issues:write admin:org\", {metadata}"
            );
            return (StatusCode::FORBIDDEN, [("www-authenticate", challenge)]).into_response();
        }
        return next
            .run(axum::extract::Request::from_parts(
                parts,
                axum::body::Body::from(bytes),
            ))
            .await;
    }
    let challenge = match step_up {
        true => format!("Bearer scope=\"issues:read\", {metadata}"),
        false => format!("Bearer {metadata}"),
    };
    (StatusCode::UNAUTHORIZED, [("www-authenticate", challenge)]).into_response()
}

/// The authorization server and, behind `bearer_only`, the tracker's MCP server, on one
/// loopback address.
async fn start_servers() -> (Shared, std::net::SocketAddr) {
    use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
    use rmcp::transport::streamable_http_server::{
        StreamableHttpServerConfig, StreamableHttpService,
    };
    let shared: Shared = Arc::default();
    let tracker = Tracker(shared.clone());
    let mcp = StreamableHttpService::new(
        move || Ok(tracker.clone()),
        Arc::new(LocalSessionManager::default()),
        StreamableHttpServerConfig::default(),
    );
    let protected_mcp =
        Router::new()
            .nest_service("/mcp", mcp)
            .layer(axum::middleware::from_fn_with_state(
                shared.clone(),
                bearer_only,
            ));
    let app = Router::new()
        .route("/.well-known/oauth-protected-resource/mcp", get(protected))
        .route("/.well-known/oauth-authorization-server", get(metadata))
        .route("/register", post(register))
        .route("/authorize", get(authorize))
        .route("/token", post(token))
        .with_state(shared.clone())
        .merge(protected_mcp);
    let addr = serve(app).await;
    shared.lock().unwrap().base = format!("http://{addr}");
    (shared, addr)
}

/// The person's browser: opens `url` at the authorization server, which redirects (302) to
/// the callback on `wor serve`; returns the callback's path and query.
async fn browse_to_callback(url: &str) -> String {
    let answer = common::loopback_egress()
        .send(wor_egress::EgressRequest::get(url))
        .await
        .unwrap();
    assert_eq!(answer.status, StatusCode::FOUND);
    let location = answer.headers["location"].to_str().unwrap();
    location
        .strip_prefix("http://wor.test")
        .or_else(|| location.strip_prefix("https://wor.test"))
        .unwrap()
        .to_owned()
}

/// Creates the `tracker` connection, an `mcp_http` connection to the server at `addr`.
async fn create_tracker(h: &Harness, addr: std::net::SocketAddr) -> String {
    let (status, created) = h
        .call(
            Method::POST,
            "/v1/tool-connections",
            Some(
                json!({"name": "tracker", "kind": "mcp_http", "url": format!("http://{addr}/mcp"),
                "allowlist": [addr.to_string()]}),
            ),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    created["id"].as_str().unwrap().to_owned()
}

/// Creates the `tracker` connection and authorizes it, the test playing the browser.
async fn authorized_tracker(h: &Harness, addr: std::net::SocketAddr) -> String {
    let id = create_tracker(h, addr).await;
    authorize_again(h, &id).await;
    id
}

/// Authorizes connection `id`, the test playing the browser; the start's answer.
async fn authorize_again(h: &Harness, id: &str) -> Value {
    let (status, started) = h
        .call(
            Method::POST,
            &format!("/v1/tool-connections/{id}/authorize"),
            None,
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{started}");
    let callback = browse_to_callback(started["authorization_url"].as_str().unwrap()).await;
    let (_, finished) = come_back(&mut owner_browser(h).await, &callback).await;
    assert_eq!(finished.status, StatusCode::SEE_OTHER, "{}", finished.body);
    assert_eq!(finished.location(), format!("/console/connections/{id}"));
    started
}

/// The owner (`alice`), who starts the API's authorizations, signed in to the console.
async fn owner_browser(h: &Harness) -> browser::Browser {
    let console = browser::serve_console(h).await;
    browser::signed_in(h, console, "alice", None).await
}

/// The person's browser, back from the authorization server at `callback`: the page there
/// hands it on to the console's finish, which `browser` then opens. Both pages.
async fn come_back(
    browser: &mut browser::Browser,
    callback: &str,
) -> (browser::Page, browser::Page) {
    let handed = browser.get(callback).await;
    assert_eq!(handed.status, StatusCode::OK, "{}", handed.body);
    assert_eq!(handed.headers["referrer-policy"], "no-referrer");
    let start = handed.body.find("url=").expect("a refresh to the finish") + 4;
    let rest = &handed.body[start..];
    let finish = rest[..rest.find('"').unwrap()].replace("&amp;", "&");
    assert!(finish.starts_with("/console/oauth/finish?"), "{finish}");
    let finished = browser.get(&finish).await;
    (handed, finished)
}

fn oauth_harness_config() -> wor_engine::EngineConfig {
    wor_engine::EngineConfig {
        console_url: Some("http://wor.test".to_owned()),
        ..wor_engine::EngineConfig::default()
    }
}

const LOOKUP_ROUTINE: &str = r#"
name = "triage"
instructions = "Look issue 7 up."
[model]
provider = "replay"
model = "script"
[[model.script.turns]]
when = { last_tool_result_contains = "issue 7 is open" }
text = "issue 7 is still open"
[[model.script.turns]]
tool_calls = [{ name = "tracker__lookup", arguments = { issue = "7" } }]
[[tools]]
tool = "tracker/lookup"
mode = "auto"
"#;

#[tokio::test]
async fn runs_call_an_authorized_server_across_a_refresh_and_fail_closed_once_revoked() {
    let (shared, addr) = start_servers().await;
    let h = Harness::with_config(oauth_harness_config()).await;
    let id = authorized_tracker(&h, addr).await;
    // Reviewing lists the tools: the session already carries the access token.
    h.review_and_enable(&id, &["lookup"]).await;

    let first = h.run(LOOKUP_ROUTINE).await;
    assert_eq!(first["status"], "succeeded", "{first:#}");
    assert_eq!(shared.lock().unwrap().refreshes, 0);

    // The access token is about to expire: the next run's session refreshes it first, and the
    // server, which now accepts only the new token, answers the run as before.
    let project = h.project.project.id;
    let connection: wor_core::ConnectionId = id.parse().unwrap();
    h.db.store
        .record_connection_oauth_refresh(project, connection, Some(0))
        .await
        .unwrap();
    let second = h.run(LOOKUP_ROUTINE).await;
    assert_eq!(second["status"], "succeeded", "{second:#}");
    assert_eq!(shared.lock().unwrap().refreshes, 1);
    assert_eq!(
        shared.lock().unwrap().access.as_deref(),
        Some(format!("{ACCESS_CANARY}-2").as_str())
    );

    // Revoked: the next run cannot refresh, and it fails closed naming the connection and the
    // command that authorizes it again; no call reaches the server without a token.
    shared.lock().unwrap().revoked = true;
    h.db.store
        .record_connection_oauth_refresh(project, connection, Some(0))
        .await
        .unwrap();
    let third = h.run(LOOKUP_ROUTINE).await;
    assert_eq!(third["status"], "failed", "{third:#}");
    let outcome = third["outcome"].as_str().unwrap_or_default();
    assert!(
        outcome.contains("tool connection `tracker` is no longer authorized")
            && outcome.contains(&format!("wor connection authorize {id}")),
        "{third:#}"
    );
    assert!(
        common::steps_of(&third, "tool_call").is_empty(),
        "{third:#}"
    );

    let audit = h.audit_text().await;
    for text in [
        first.to_string(),
        second.to_string(),
        third.to_string(),
        audit,
    ] {
        assert!(
            !text.contains(ACCESS_CANARY) && !text.contains(REFRESH_CANARY),
            "a token leaked: {text}"
        );
    }
}

#[tokio::test]
async fn concurrent_refreshes_of_one_connection_refresh_once() {
    let (shared, addr) = start_servers().await;
    let h = Harness::with_config(oauth_harness_config()).await;
    let id = authorized_tracker(&h, addr).await;
    let project = h.project.project.id;
    let connection: wor_core::ConnectionId = id.parse().unwrap();
    h.db.store
        .record_connection_oauth_refresh(project, connection, Some(0))
        .await
        .unwrap();

    // Eight sessions open at once on an expired token. With rotation, a second refresh with
    // the same refresh token is refused, so every one of them must wait for a single refresh.
    let tokens = futures_util::future::join_all(
        (0..8).map(|_| h.engine.oauth_access_token(project, connection, "tracker")),
    )
    .await;
    for token in &tokens {
        let token = token.as_ref().expect("every caller gets a token");
        assert_eq!(
            token.as_ref().unwrap().expose_secret(),
            format!("{ACCESS_CANARY}-2")
        );
    }
    assert_eq!(shared.lock().unwrap().refreshes, 1);

    // Another process's claim on the refresh holds this one off until it lapses or the
    // refresh is recorded.
    h.db.store
        .record_connection_oauth_refresh(project, connection, Some(0))
        .await
        .unwrap();
    let until = wor_store::now_millis() + 60_000;
    let claim =
        h.db.store
            .claim_connection_oauth_refresh(project, connection, until)
            .await
            .unwrap()
            .expect("an unclaimed refresh is claimed");
    assert_eq!(
        h.db.store
            .claim_connection_oauth_refresh(project, connection, until)
            .await
            .unwrap(),
        None,
        "a claim that has not lapsed is not taken twice"
    );
    // Only the claim's holder releases it.
    h.db.store
        .release_connection_oauth_refresh(project, connection, "another-claim")
        .await
        .unwrap();
    assert_eq!(
        h.db.store
            .claim_connection_oauth_refresh(project, connection, until)
            .await
            .unwrap(),
        None
    );
    h.db.store
        .release_connection_oauth_refresh(project, connection, &claim)
        .await
        .unwrap();
    let token = h
        .engine
        .oauth_access_token(project, connection, "tracker")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(token.expose_secret(), format!("{ACCESS_CANARY}-3"));
    assert_eq!(shared.lock().unwrap().refreshes, 2);
}

#[tokio::test]
async fn a_client_registered_beforehand_authorizes_a_server_without_dynamic_registration() {
    const SECRET_CANARY: &str = "client-secret-canary-61f0";
    let (shared, addr) = start_servers().await;
    shared.lock().unwrap().preregistered = Some(("client-9".to_owned(), SECRET_CANARY.to_owned()));
    let h = Harness::with_config(oauth_harness_config()).await;
    let id = create_tracker(&h, addr).await;
    let path = format!("/v1/tool-connections/{id}/authorize");

    // Without a client, a server that offers no registration is refused, saying what to do.
    let (status, refused) = h.call(Method::POST, &path, None).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{refused}");
    let said = refused.to_string();
    assert!(
        said.contains("offers no dynamic client registration")
            && said.contains(&format!("wor connection authorize {id} --client-id ID")),
        "{refused}"
    );
    // A secret alone, or an empty id, is a bad request.
    let (status, _) = h
        .call(Method::POST, &path, Some(json!({"client_secret": "x"})))
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let (status, _) = h
        .call(Method::POST, &path, Some(json!({"client_id": " "})))
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);

    let (status, started, started_text) = h
        .call_as(
            h.owner(),
            Method::POST,
            &path,
            Some(json!({"client_id": "client-9", "client_secret": SECRET_CANARY})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{started}");
    let callback = browse_to_callback(started["authorization_url"].as_str().unwrap()).await;
    // The code is exchanged with the client's id and secret in `Authorization: Basic`.
    let (handed, finished) = come_back(&mut owner_browser(&h).await, &callback).await;
    assert_eq!(finished.status, StatusCode::SEE_OTHER, "{}", finished.body);
    let finished_text = format!("{}{}", handed.body, finished.body);

    // The refresh authenticates the same way, with the secret sealed under the connection.
    h.review_and_enable(&id, &["lookup"]).await;
    let project = h.project.project.id;
    let connection: wor_core::ConnectionId = id.parse().unwrap();
    h.db.store
        .record_connection_oauth_refresh(project, connection, Some(0))
        .await
        .unwrap();
    let run = h.run(LOOKUP_ROUTINE).await;
    assert_eq!(run["status"], "succeeded", "{run:#}");
    assert_eq!(shared.lock().unwrap().refreshes, 1);

    let audit = h.audit_text().await;
    for text in [started_text, finished_text, run.to_string(), audit] {
        assert!(
            !text.contains(SECRET_CANARY),
            "the client secret leaked: {text}"
        );
    }
}

const TWO_LOOKUPS_ROUTINE: &str = r#"
name = "triage-two"
instructions = "Look issues 7 and 8 up."
[model]
provider = "replay"
model = "script"
[[model.script.turns]]
when = { last_tool_result_contains = "no longer authorized" }
text = "the tracker needs authorizing again"
[[model.script.turns]]
when = { last_tool_result_contains = "issue 8 is open" }
text = "issues 7 and 8 are open"
[[model.script.turns]]
when = { last_tool_result_contains = "issue 7 is open" }
tool_calls = [{ name = "tracker__lookup", arguments = { issue = "8" } }]
[[model.script.turns]]
tool_calls = [{ name = "tracker__lookup", arguments = { issue = "7" } }]
[[tools]]
tool = "tracker/lookup"
mode = "auto"
"#;

#[tokio::test]
async fn a_token_that_expires_mid_run_is_refreshed_unnoticed_and_a_revoked_grant_fails_the_call_closed()
 {
    let (shared, addr) = start_servers().await;
    let h = Harness::with_config(oauth_harness_config()).await;
    let id = authorized_tracker(&h, addr).await;
    h.review_and_enable(&id, &["lookup"]).await;
    // The token endpoint says an hour, so no session refreshes ahead of time; the server ends
    // each token once a call has used it, in the middle of the run.
    shared.lock().unwrap().expire_after_call = true;

    let run = h.run(TWO_LOOKUPS_ROUTINE).await;
    assert_eq!(run["status"], "succeeded", "{run:#}");
    let results = common::steps_of(&run, "tool_result");
    assert_eq!(results.len(), 2, "{run:#}");
    assert!(
        results.iter().all(|r| !r.to_string().contains("failed")),
        "{run:#}"
    );
    assert!(
        run.to_string().contains("issues 7 and 8 are open"),
        "{run:#}"
    );
    // The second call was refused once, the token refreshed and the call sent again.
    assert_eq!(shared.lock().unwrap().refreshes, 1);
    // What the server echoed back of its tokens, the refreshed one included, is redacted.
    assert!(
        run.to_string()
            .contains("issue 8 is open (you sent: [REDACTED])"),
        "{run:#}"
    );

    // The grant is revoked: the first call still has a live token, the second cannot refresh
    // and fails closed, naming the connection and the command; the server never ran it.
    {
        let mut s = shared.lock().unwrap();
        s.expired = false;
        s.revoked = true;
    }
    let revoked = h.run(TWO_LOOKUPS_ROUTINE).await;
    let results = common::steps_of(&revoked, "tool_result");
    assert_eq!(results.len(), 2, "{revoked:#}");
    let second = results[1].to_string();
    assert!(
        second.contains("tool connection `tracker` is no longer authorized")
            && second.contains(&format!("run `wor connection authorize {id}` again")),
        "{revoked:#}"
    );
    assert!(
        revoked
            .to_string()
            .contains("the tracker needs authorizing again"),
        "{revoked:#}"
    );
    assert!(
        !revoked.to_string().contains("issue 8 is open"),
        "{revoked:#}"
    );
    assert_eq!(shared.lock().unwrap().refreshes, 1);

    let audit = h.audit_text().await;
    assert!(audit.contains("connection.token_refresh"));
    assert!(audit.contains("connection.authorize_failure"));
    for text in [run.to_string(), revoked.to_string(), audit] {
        assert!(
            !text.contains(ACCESS_CANARY) && !text.contains(REFRESH_CANARY),
            "a token leaked: {text}"
        );
    }
}

#[tokio::test]
async fn an_admin_authorizes_a_connection_from_the_console_and_comes_back_to_it() {
    let (shared, addr) = start_servers().await;
    let h = Harness::with_config(oauth_harness_config()).await;
    let id = create_tracker(&h, addr).await;
    let console = browser::serve_console(&h).await;
    let page_path = format!("/console/connections/{id}");
    let authorize_path = format!("{page_path}/authorize");

    // Its server refuses the connection: the page says why and offers to authorize it.
    let mut admin = browser::signed_in(&h, console, "ada", Some("admin")).await;
    let page = admin.get(&page_path).await;
    assert_eq!(page.status, StatusCode::OK, "{}", page.body);
    assert!(
        page.body.contains("The live tools cannot be listed")
            && page.body.contains(&format!("action=\"{authorize_path}\""))
            && page.body.contains(">Authorize<"),
        "{}",
        page.body
    );
    // Someone who may not configure is offered nothing and refused.
    let mut approver = browser::signed_in(&h, console, "pat", Some("approver")).await;
    let theirs = approver.get(&page_path).await;
    assert!(!theirs.body.contains(&authorize_path), "{}", theirs.body);
    let csrf = theirs.csrf();
    let refused = approver.post(&authorize_path, &[("csrf", &csrf)]).await;
    assert_eq!(refused.status, StatusCode::FORBIDDEN, "{}", refused.body);
    // Without its CSRF token the form does nothing.
    let forged = admin.post(&authorize_path, &[]).await;
    assert!(forged.status.is_client_error(), "{}", forged.status);

    // The button sends the browser to the authorization server; its redirect brings it back
    // to `wor serve`, which seals the tokens and returns the person to the connection's page.
    let csrf = page.csrf();
    let started = admin.post(&authorize_path, &[("csrf", &csrf)]).await;
    assert_eq!(started.status, StatusCode::SEE_OTHER, "{}", started.body);
    assert!(
        started
            .location()
            .starts_with(&format!("http://{addr}/authorize?")),
        "{}",
        started.location()
    );
    let callback = browse_to_callback(started.location()).await;
    let (_, back) = come_back(&mut admin, &callback).await;
    assert_eq!(back.status, StatusCode::SEE_OTHER, "{}", back.body);
    assert_eq!(back.location(), page_path);
    let page = admin.get(&page_path).await;
    assert_eq!(page.status, StatusCode::OK, "{}", page.body);
    assert!(
        page.body.contains("Authorize again")
            && page.body.contains("<code>lookup</code>")
            && !page.body.contains("cannot be listed"),
        "{}",
        page.body
    );
    assert_eq!(shared.lock().unwrap().issued, 1);

    // The connection now works for runs; the audit chain records who authorized it, with no
    // key, and no token anywhere.
    h.review_and_enable(&id, &["lookup"]).await;
    let run = h.run(LOOKUP_ROUTINE).await;
    assert_eq!(run["status"], "succeeded", "{run:#}");
    let audit = h.audit_text().await;
    assert!(audit.contains("connection.authorize"), "{audit}");
    for text in [
        &page.body,
        &back.body,
        &started.body,
        &run.to_string(),
        &audit,
    ] {
        assert!(
            !text.contains(ACCESS_CANARY) && !text.contains(REFRESH_CANARY),
            "a token leaked: {text}"
        );
    }
}

const METADATA_DOCUMENT_URL: &str = "https://wor.test/hooks/oauth/client-metadata.json";

#[tokio::test]
async fn a_server_that_accepts_client_metadata_documents_knows_wor_by_its_document_url() {
    let (shared, addr) = start_servers().await;
    {
        let mut s = shared.lock().unwrap();
        s.metadata_document_client = Some(METADATA_DOCUMENT_URL.to_owned());
        // Only a server that names itself in its answers is given the shared client id.
        s.promises_iss = true;
        s.sends_iss = Some(s.base.clone());
    }
    let h = Harness::with_config(wor_engine::EngineConfig {
        console_url: Some("https://wor.test/".to_owned()),
        ..wor_engine::EngineConfig::default()
    })
    .await;

    // What the authorization server fetches from the client id it is given: wor's document,
    // public (no API key), naming itself and the callback the authorization sends back to.
    let (status, document, _) = h
        .call_as(
            "none",
            Method::GET,
            "/hooks/oauth/client-metadata.json",
            None,
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{document}");
    assert_eq!(
        document,
        json!({
            "client_id": METADATA_DOCUMENT_URL,
            "client_name": "wor",
            "redirect_uris": ["https://wor.test/hooks/oauth/callback"],
            "grant_types": ["authorization_code", "refresh_token"],
            "response_types": ["code"],
            "token_endpoint_auth_method": "none",
        })
    );

    let id = create_tracker(&h, addr).await;
    let started = authorize_again(&h, &id).await;
    assert_eq!(started["client"], "metadata_document", "{started}");
    assert!(started.get("notice").is_none(), "{started}");
    let url = url::Url::parse(started["authorization_url"].as_str().unwrap()).unwrap();
    let pairs: Vec<(String, String)> = url.query_pairs().into_owned().collect();
    assert_eq!(param(&pairs, "client_id"), METADATA_DOCUMENT_URL);
    assert!(
        document["redirect_uris"]
            .as_array()
            .unwrap()
            .contains(&json!(param(&pairs, "redirect_uri"))),
        "the document names the redirect the authorization uses"
    );
    assert_eq!(
        shared.lock().unwrap().registrations,
        0,
        "no client was registered"
    );

    // The code was exchanged, and the token refreshes, as that public client.
    let project = h.project.project.id;
    let connection: wor_core::ConnectionId = id.parse().unwrap();
    h.db.store
        .record_connection_oauth_refresh(project, connection, Some(0))
        .await
        .unwrap();
    let token = h
        .engine
        .oauth_access_token(project, connection, "tracker")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(token.expose_secret(), format!("{ACCESS_CANARY}-2"));
    let audit = h.audit_text().await;
    assert!(audit.contains(METADATA_DOCUMENT_URL), "{audit}");
}

#[tokio::test]
async fn with_an_http_public_url_a_server_offering_client_metadata_documents_gets_a_registered_client()
 {
    let (shared, addr) = start_servers().await;
    shared.lock().unwrap().metadata_document_client = Some(METADATA_DOCUMENT_URL.to_owned());
    let h = Harness::with_config(oauth_harness_config()).await;
    // No document is served from an `http` public URL: no authorization server would take it.
    let (status, _, _) = h
        .call_as(
            "none",
            Method::GET,
            "/hooks/oauth/client-metadata.json",
            None,
        )
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);

    // The server would accept the document; wor registers a client instead and says why.
    let id = create_tracker(&h, addr).await;
    let started = authorize_again(&h, &id).await;
    assert_eq!(started["client"], "dynamic_registration", "{started}");
    let notice = started["notice"].as_str().unwrap_or_default();
    assert!(
        notice.contains("accepts a client ID metadata document")
            && notice
                .contains("`http://wor.test/hooks/oauth/client-metadata.json` is not an https url"),
        "{started}"
    );
    assert_eq!(shared.lock().unwrap().registrations, 1);
    let url = started["authorization_url"].as_str().unwrap();
    assert!(url.contains("client_id=client-7"), "{url}");
}

const STEP_UP_ROUTINE: &str = r#"
name = "triage-step-up"
instructions = "Look issue 7 up."
[model]
provider = "replay"
model = "script"
[[model.script.turns]]
when = { last_tool_result_contains = "more than the connection's authorization grants" }
text = "the tracker needs a wider authorization"
[[model.script.turns]]
when = { last_tool_result_contains = "issue 7 is open" }
text = "issue 7 is still open"
[[model.script.turns]]
tool_calls = [{ name = "tracker__lookup", arguments = { issue = "7" } }]
[[tools]]
tool = "tracker/lookup"
mode = "auto"
"#;

#[tokio::test]
async fn a_call_refused_for_its_scope_fails_closed_and_the_next_authorization_asks_for_more() {
    let (shared, addr) = start_servers().await;
    shared.lock().unwrap().step_up = true;
    let h = Harness::with_config(oauth_harness_config()).await;
    let id = create_tracker(&h, addr).await;
    // The first authorization asks for the scope the server's challenge names.
    let started = authorize_again(&h, &id).await;
    assert_eq!(started["scopes"], json!(["issues:read"]), "{started}");
    assert_eq!(shared.lock().unwrap().access_scope, "issues:read");
    // Listing the tools needs no more than that.
    h.review_and_enable(&id, &["lookup"]).await;

    // A call needs `issues:write` too: it fails closed, naming the connection, the scope and
    // the command; the server ran nothing, and the run goes on to its answer.
    let run = h.run(STEP_UP_ROUTINE).await;
    assert_eq!(run["status"], "succeeded", "{run:#}");
    let results = common::steps_of(&run, "tool_result");
    assert_eq!(results.len(), 1, "{run:#}");
    let said = results[0].to_string();
    assert!(
        said.contains(&format!(
            "tool connection `tracker`'s server refused its access token: it needs scope \
             `issues:read issues:write admin:org`, more than the connection's authorization grants; run \
             `wor connection authorize {id}` again (it will ask for `issues:read issues:write`)"
        )),
        "{run:#}"
    );
    assert_eq!(shared.lock().unwrap().calls, 0, "the server ran nothing");
    let audit = h.audit_text().await;
    assert!(audit.contains("connection.scope_step_up"), "{audit}");
    assert!(audit.contains("issues:read issues:write"), "{audit}");

    // The connection remembers: authorizing again asks for the union of the scopes the server
    // understands (not `admin:org`), and with them the call runs.
    let started = authorize_again(&h, &id).await;
    assert_eq!(
        started["scopes"],
        json!(["issues:read", "issues:write"]),
        "{started}"
    );
    let url = started["authorization_url"].as_str().unwrap();
    assert!(url.contains("scope=issues%3Aread+issues%3Awrite"), "{url}");
    let run = h.run(STEP_UP_ROUTINE).await;
    assert_eq!(run["status"], "succeeded", "{run:#}");
    assert!(run.to_string().contains("issue 7 is still open"), "{run:#}");
    assert_eq!(shared.lock().unwrap().calls, 1);

    let audit = h.audit_text().await;
    for text in [run.to_string(), audit] {
        assert!(
            !text.contains(ACCESS_CANARY) && !text.contains(REFRESH_CANARY),
            "a token leaked: {text}"
        );
    }
}

#[tokio::test]
async fn an_answer_from_another_authorization_server_is_exchanged_nowhere() {
    let (shared, addr) = start_servers().await;
    {
        let mut s = shared.lock().unwrap();
        s.metadata_document_client = Some(METADATA_DOCUMENT_URL.to_owned());
        s.promises_iss = true;
        // A mix-up: the answer names a server other than the one the person was sent to.
        s.sends_iss = Some("https://honest.example".to_owned());
    }
    let h = Harness::with_config(wor_engine::EngineConfig {
        console_url: Some("https://wor.test/".to_owned()),
        ..wor_engine::EngineConfig::default()
    })
    .await;
    let id = create_tracker(&h, addr).await;
    let mut refused = Vec::new();
    let mut owner = owner_browser(&h).await;
    for sends in [Some("https://honest.example".to_owned()), None] {
        shared.lock().unwrap().sends_iss = sends;
        let (status, started) = h
            .call(
                Method::POST,
                &format!("/v1/tool-connections/{id}/authorize"),
                None,
            )
            .await;
        assert_eq!(status, StatusCode::OK, "{started}");
        let callback = browse_to_callback(started["authorization_url"].as_str().unwrap()).await;
        let (_, answer) = come_back(&mut owner, &callback).await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{}", answer.body);
        refused.push(answer.body);
    }
    assert!(
        refused[0].contains("another authorization server")
            && refused[0].contains("honest.example"),
        "{refused:?}"
    );
    assert!(refused[1].contains("no `iss`"), "{refused:?}");
    // Nothing was exchanged: no token was asked for, none is stored.
    assert_eq!(shared.lock().unwrap().issued, 0);
    let connection: wor_core::ConnectionId = id.parse().unwrap();
    assert!(
        h.db.store
            .get_connection_oauth(h.project.project.id, connection)
            .await
            .unwrap()
            .is_none()
    );
}

#[tokio::test]
async fn a_server_offering_client_metadata_documents_without_naming_itself_gets_a_registered_client()
 {
    let (shared, addr) = start_servers().await;
    shared.lock().unwrap().metadata_document_client = Some(METADATA_DOCUMENT_URL.to_owned());
    let h = Harness::with_config(wor_engine::EngineConfig {
        console_url: Some("https://wor.test/".to_owned()),
        ..wor_engine::EngineConfig::default()
    })
    .await;
    let id = create_tracker(&h, addr).await;
    let started = authorize_again(&h, &id).await;
    assert_eq!(started["client"], "dynamic_registration", "{started}");
    assert!(
        started["notice"].as_str().unwrap().contains("RFC 9207"),
        "{started}"
    );
    assert_eq!(shared.lock().unwrap().registrations, 1);
}
