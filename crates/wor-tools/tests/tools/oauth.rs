//! MCP authorization discovery against a loopback server playing both the MCP server and its
//! authorization server, and malicious discovery documents.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::Json;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use serde_json::{Value, json};
use wor_egress::EgressError;
use wor_tools::oauth::{OAuthError, Pkce, authorization_url, discover, new_state};

use crate::{loopback_egress, serve};

/// What the loopback server answers for its protected-resource metadata and its
/// authorization server metadata, changed by each test.
#[derive(Clone)]
struct Documents {
    resource: Arc<Mutex<Value>>,
    server: Arc<Mutex<Value>>,
}

async fn authorization_fixture() -> (SocketAddr, Documents) {
    let documents = Documents {
        resource: Arc::new(Mutex::new(Value::Null)),
        server: Arc::new(Mutex::new(Value::Null)),
    };
    let (resource, server) = (documents.resource.clone(), documents.server.clone());
    let router = axum::Router::new()
        .route(
            "/.well-known/oauth-protected-resource/mcp",
            get(move || {
                let resource = resource.lock().unwrap().clone();
                async move { Json(resource) }
            }),
        )
        .route(
            "/.well-known/oauth-authorization-server/auth",
            get(move || {
                let server = server.lock().unwrap().clone();
                async move { Json(server) }
            }),
        )
        .route(
            "/moved",
            get(|| async {
                (
                    StatusCode::FOUND,
                    [(header::LOCATION, "http://127.0.0.1:1/.well-known/x")],
                )
            }),
        )
        .route(
            "/huge",
            get(|| async { "x".repeat(10 * 1024 * 1024).into_response() }),
        );
    let addr = serve(router).await;
    *documents.resource.lock().unwrap() = json!({
        "resource": format!("http://{addr}/mcp"),
        "authorization_servers": [format!("http://{addr}/auth")],
        "scopes_supported": ["tools"],
    });
    *documents.server.lock().unwrap() = json!({
        "issuer": format!("http://{addr}/auth"),
        "authorization_endpoint": format!("http://{addr}/auth/authorize"),
        "token_endpoint": format!("http://{addr}/auth/token"),
        "registration_endpoint": format!("http://{addr}/auth/register"),
        "code_challenge_methods_supported": ["S256"],
    });
    (addr, documents)
}

fn challenge(addr: SocketAddr, path: &str) -> String {
    format!(r#"Bearer error="invalid_token", resource_metadata="http://{addr}{path}""#)
}

#[tokio::test]
async fn a_401_leads_to_the_authorization_servers_metadata_and_an_authorization_url() {
    let (addr, _) = authorization_fixture().await;
    let egress = loopback_egress();
    let mcp = format!("http://{addr}/mcp");
    let found = discover(
        &egress,
        &mcp,
        Some(&challenge(
            addr,
            "/.well-known/oauth-protected-resource/mcp",
        )),
    )
    .await
    .unwrap();
    assert_eq!(found.resource, mcp);
    assert_eq!(
        found.authorization_server.token_endpoint,
        format!("http://{addr}/auth/token")
    );
    // Without a challenge, the well-known URL of the server's path is used.
    assert_eq!(discover(&egress, &mcp, None).await.unwrap(), found);
    let pkce = Pkce::new().unwrap();
    let state = new_state().unwrap();
    let url = url::Url::parse(
        &authorization_url(
            &found,
            "client-1",
            "http://127.0.0.1:8080/oauth/callback",
            &["tools".to_owned()],
            &state,
            &pkce,
        )
        .unwrap(),
    )
    .unwrap();
    let query: std::collections::BTreeMap<String, String> =
        url.query_pairs().into_owned().collect();
    assert_eq!(url.path(), "/auth/authorize");
    assert_eq!(query["response_type"], "code");
    assert_eq!(query["code_challenge_method"], "S256");
    assert_eq!(query["code_challenge"], pkce.challenge);
    assert_eq!(query["state"], state);
    assert_eq!(query["resource"], mcp);
    assert_eq!(query["scope"], "tools");
    assert!(
        !url.as_str()
            .contains(secrecy::ExposeSecret::expose_secret(pkce.verifier()))
    );
}

#[tokio::test]
async fn malicious_discovery_is_refused_with_a_clear_reason() {
    let (addr, documents) = authorization_fixture().await;
    let egress = loopback_egress();
    let mcp = format!("http://{addr}/mcp");
    let path = "/.well-known/oauth-protected-resource/mcp";

    // The metadata points at the cloud metadata address: the egress guard refuses it.
    documents.resource.lock().unwrap()["authorization_servers"] =
        json!(["http://169.254.169.254/latest"]);
    let error = discover(&egress, &mcp, Some(&challenge(addr, path)))
        .await
        .unwrap_err();
    assert!(
        matches!(
            &error,
            OAuthError::Fetch {
                source: EgressError::Denied(_),
                ..
            }
        ),
        "{error}"
    );
    assert!(error.to_string().contains("169.254.169.254"), "{error}");

    // The challenge itself names the metadata address.
    let error = discover(
        &egress,
        &mcp,
        Some(r#"Bearer resource_metadata="http://169.254.169.254/latest/meta-data""#),
    )
    .await
    .unwrap_err();
    assert!(
        matches!(
            &error,
            OAuthError::Fetch {
                source: EgressError::Denied(_),
                ..
            }
        ),
        "{error}"
    );

    // A redirect is not followed.
    let error = discover(&egress, &mcp, Some(&challenge(addr, "/moved")))
        .await
        .unwrap_err();
    assert!(
        error
            .to_string()
            .contains("answered 302 (a redirect); redirects are not followed"),
        "{error}"
    );

    // A 10 MB document is cut off at the cap.
    let error = discover(&egress, &mcp, Some(&challenge(addr, "/huge")))
        .await
        .unwrap_err();
    assert!(
        matches!(
            &error,
            OAuthError::Fetch {
                source: EgressError::ResponseTooLarge { .. },
                ..
            }
        ),
        "{error}"
    );

    // Metadata about another resource, and a server without S256, are refused.
    documents.resource.lock().unwrap()["authorization_servers"] =
        json!([format!("http://{addr}/auth")]);
    documents.resource.lock().unwrap()["resource"] = json!("https://elsewhere.example/mcp");
    let error = discover(&egress, &mcp, Some(&challenge(addr, path)))
        .await
        .unwrap_err();
    assert!(
        matches!(error, OAuthError::ResourceMismatch { .. }),
        "{error}"
    );
    documents.resource.lock().unwrap()["resource"] = json!(mcp);
    documents.server.lock().unwrap()["code_challenge_methods_supported"] = json!(["plain"]);
    let error = discover(&egress, &mcp, Some(&challenge(addr, path)))
        .await
        .unwrap_err();
    assert!(matches!(error, OAuthError::NoPkce { .. }), "{error}");
}
