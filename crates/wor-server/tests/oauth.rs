//! MCP authorization of a tool connection through the API, loopback only: an in-test
//! authorization server (discovery, dynamic registration, PKCE code exchange, refresh with
//! rotation, revocation); the test plays the person's browser. Canary tokens never appear in
//! an API response or the audit chain.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic,
    reason = "tests fail loudly"
)]

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
    refresh: Option<String>,
    revoked: bool,
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
    axum::Json(json!({"client_id": "client-7"})).into_response()
}

async fn authorize(State(s): State<Shared>, uri: Uri) -> Response {
    let pairs = query(&uri);
    let base = s.lock().unwrap().base.clone();
    assert_eq!(param(&pairs, "client_id"), "client-7");
    assert_eq!(param(&pairs, "code_challenge_method"), "S256");
    assert_eq!(param(&pairs, "resource"), format!("{base}/mcp"));
    s.lock().unwrap().challenge = Some(param(&pairs, "code_challenge"));
    let location = format!(
        "{}?code=the-code&state={}",
        param(&pairs, "redirect_uri"),
        param(&pairs, "state")
    );
    (StatusCode::FOUND, [("location", location)]).into_response()
}

async fn token(State(s): State<Shared>, body: String) -> Response {
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
    match param(&pairs, "grant_type").as_str() {
        "authorization_code" => {
            let verifier = param(&pairs, "code_verifier");
            let challenge =
                wor_tools::oauth::Pkce::from_verifier(secrecy::SecretString::from(verifier))
                    .challenge;
            if param(&pairs, "code") != "the-code" || s.challenge.as_deref() != Some(&challenge) {
                return refused();
            }
        }
        "refresh_token" => {
            if s.revoked || s.refresh.as_deref() != Some(&param(&pairs, "refresh_token")) {
                return refused();
            }
        }
        _ => return refused(),
    }
    s.issued += 1;
    let refresh = format!("{REFRESH_CANARY}-{}", s.issued);
    s.refresh = Some(refresh.clone());
    axum::Json(json!({
        "access_token": format!("{ACCESS_CANARY}-{}", s.issued),
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
    let answer = common::loopback_egress()
        .send(wor_egress::EgressRequest::get(url))
        .await
        .unwrap();
    assert_eq!(answer.status, StatusCode::FOUND);
    let location = answer.headers["location"].to_str().unwrap().to_owned();
    let callback = location.strip_prefix("http://wor.test").unwrap().to_owned();

    // A wrong state finishes nothing; the right one finishes it once.
    let (status, _) = h
        .call(
            Method::GET,
            "/hooks/oauth/callback?code=the-code&state=forged",
            None,
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let (status, finished, finished_text) = h.call_as("none", Method::GET, &callback, None).await;
    assert_eq!(status, StatusCode::OK, "{finished}");
    assert_eq!(finished["connection"], "tracker");
    let (status, again) = h.call(Method::GET, &callback, None).await;
    assert_eq!(
        status,
        StatusCode::BAD_REQUEST,
        "a state is used once: {again}"
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
    let _: Value = finished;
}
