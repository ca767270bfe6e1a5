//! HTTP API tools against a loopback server that records every request it receives.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::IntoResponse;
use secrecy::SecretString;
use serde_json::{Value, json};
use wor_tools::{
    ConnectionCredentials, HttpApiConnection, HttpToolConfig, HttpToolDefinition, HttpToolError,
    ToolContent,
};

use crate::{allow, loopback_egress, serve};

const TOKEN: &str = "ghp_live0123456789abcdefghijklmnopqrstu";

#[derive(Debug, Clone)]
struct Seen {
    method: Method,
    uri: String,
    authorization: Option<String>,
    body: String,
}

type Log = Arc<Mutex<Vec<Seen>>>;

/// Answers `/missing/...` with 404, everything else with a JSON echo of the request.
async fn recording_server() -> (SocketAddr, Log) {
    let log: Log = Arc::default();
    let record = Arc::clone(&log);
    let router = axum::Router::new().fallback(
        move |method: Method, uri: Uri, headers: HeaderMap, body: Bytes| {
            let record = Arc::clone(&record);
            async move {
                let seen = Seen {
                    method,
                    uri: uri.to_string(),
                    authorization: headers
                        .get("authorization")
                        .map(|v| v.to_str().unwrap().to_owned()),
                    body: String::from_utf8_lossy(&body).into_owned(),
                };
                record.lock().unwrap().push(seen.clone());
                if seen.uri.starts_with("/api/missing") {
                    return (StatusCode::NOT_FOUND, "no such repository").into_response();
                }
                axum::Json(json!({"path": seen.uri, "body": seen.body})).into_response()
            }
        },
    );
    (serve(router).await, log)
}

fn connection(addr: SocketAddr) -> HttpApiConnection {
    HttpApiConnection::new(
        &format!("http://{addr}/api"),
        allow(addr),
        ConnectionCredentials::bearer(SecretString::from(TOKEN)).unwrap(),
    )
    .unwrap()
}

fn tool(method: &str, path: &str) -> HttpToolDefinition {
    HttpToolDefinition::new(HttpToolConfig {
        name: "create_issue".into(),
        description: Some("Opens an issue".into()),
        method: method.into(),
        path: path.into(),
        input_schema: json!({"type": "object", "properties": {
            "owner": {"type": "string"}, "title": {"type": "string"}
        }})
        .as_object()
        .unwrap()
        .clone(),
    })
    .unwrap()
}

fn args(value: Value) -> serde_json::Map<String, Value> {
    value.as_object().unwrap().clone()
}

#[tokio::test]
async fn sends_filled_path_body_and_credentials_through_egress() {
    let (addr, log) = recording_server().await;
    let result = tool("POST", "/repos/{owner}/issues")
        .execute(
            &loopback_egress(),
            &connection(addr),
            &args(json!({"owner": "a c", "title": "Disk full"})),
        )
        .await
        .unwrap();
    assert!(!result.is_error);
    assert_eq!(
        result.content,
        [ToolContent::Json(
            json!({"path": "/api/repos/a%20c/issues", "body": "{\"title\":\"Disk full\"}"})
        )]
    );
    let seen = log.lock().unwrap()[0].clone();
    assert_eq!(seen.method, Method::POST);
    assert_eq!(
        seen.authorization.as_deref(),
        Some(&*format!("Bearer {TOKEN}"))
    );
}

#[tokio::test]
async fn injected_paths_never_leave_the_client() {
    let (addr, log) = recording_server().await;
    let egress = loopback_egress();
    let connection = connection(addr);
    for evil in ["..", "../../admin", "a/b", "."] {
        let error = tool("GET", "/repos/{owner}/issues")
            .execute(&egress, &connection, &args(json!({"owner": evil})))
            .await
            .unwrap_err();
        assert!(
            matches!(error, HttpToolError::PathInjection(_)),
            "{evil}: {error:?}"
        );
    }
    assert!(log.lock().unwrap().is_empty());
}

#[tokio::test]
async fn an_error_status_is_a_tool_error_for_the_model() {
    let (addr, _log) = recording_server().await;
    let result = tool("GET", "/missing/{owner}")
        .execute(
            &loopback_egress(),
            &connection(addr),
            &args(json!({"owner": "x", "title": "t"})),
        )
        .await
        .unwrap();
    assert!(result.is_error);
    assert_eq!(
        result.content,
        [
            ToolContent::Text("http status 404".into()),
            ToolContent::Text("no such repository".into())
        ]
    );
}

#[tokio::test]
async fn the_egress_policy_still_applies() {
    let (addr, log) = recording_server().await;
    let strict = wor_egress::EgressClient::with_resolver(
        wor_egress::EgressPolicy::development(),
        Arc::new(wor_egress::StaticResolver::new()),
        wor_egress::EgressLimits::default(),
    )
    .unwrap();
    let error = tool("GET", "/repos/{owner}/issues")
        .execute(&strict, &connection(addr), &args(json!({"owner": "x"})))
        .await
        .unwrap_err();
    assert!(
        matches!(
            error,
            HttpToolError::Egress(wor_egress::EgressError::Denied(_))
        ),
        "{error:?}"
    );
    assert!(!format!("{error} {error:?}").contains(TOKEN));
    assert!(log.lock().unwrap().is_empty());
}
