//! MCP authorization discovery against a loopback server playing both the MCP server and its
//! authorization server, and malicious discovery documents.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::Json;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use secrecy::{ExposeSecret, SecretString};
use serde_json::{Value, json};
use wor_egress::EgressError;
use wor_tools::oauth::{
    OAuthError, Pkce, authorization_url, discover, exchange_code, new_state, refresh_tokens,
    register_client,
};

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

fn challenge(addr: SocketAddr, path: &str) -> wor_tools::oauth::Challenge {
    wor_tools::oauth::Challenge::parse(&format!(
        r#"Bearer error="invalid_token", resource_metadata="http://{addr}{path}""#
    ))
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
        Some(&wor_tools::oauth::Challenge::parse(
            r#"Bearer resource_metadata="http://169.254.169.254/latest/meta-data""#,
        )),
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

/// A token endpoint that checks the PKCE proof and `resource`, issues tokens and rotates the
/// refresh token on every refresh (the old one is then revoked).
#[derive(Default)]
struct TokenDesk {
    challenge: Mutex<String>,
    resource: Mutex<String>,
    live_refresh: Mutex<Option<String>>,
    issued: Mutex<u32>,
}

async fn token_server(desk: Arc<TokenDesk>) -> SocketAddr {
    use base64::Engine;
    use sha2::Digest;
    let register = axum::routing::post(|Json(body): Json<Value>| async move {
        assert_eq!(body["token_endpoint_auth_method"], "none");
        assert_eq!(
            body["grant_types"],
            json!(["authorization_code", "refresh_token"])
        );
        (
            StatusCode::CREATED,
            Json(json!({"client_id": "wor-client-1"})),
        )
    });
    let token = axum::routing::post(move |body: String| {
        let desk = desk.clone();
        async move {
            let form: std::collections::BTreeMap<String, String> =
                url::form_urlencoded::parse(body.as_bytes())
                    .into_owned()
                    .collect();
            let refuse = |error: &str| {
                (
                    StatusCode::BAD_REQUEST,
                    Json(json!({"error": error,
                    "error_description": format!("bad {}", form.get("refresh_token").cloned().unwrap_or_default())})),
                )
            };
            if form["client_id"] != "wor-client-1"
                || form.get("resource") != Some(&*desk.resource.lock().unwrap())
            {
                return refuse("invalid_client");
            }
            match form["grant_type"].as_str() {
                "authorization_code" => {
                    let proof = base64::engine::general_purpose::URL_SAFE_NO_PAD
                        .encode(sha2::Sha256::digest(form["code_verifier"].as_bytes()));
                    if form["code"] != "code-1" || proof != *desk.challenge.lock().unwrap() {
                        return refuse("invalid_grant");
                    }
                }
                "refresh_token" => {
                    if desk.live_refresh.lock().unwrap().as_deref()
                        != Some(form["refresh_token"].as_str())
                    {
                        return refuse("invalid_grant");
                    }
                }
                _ => return refuse("unsupported_grant_type"),
            }
            let n = {
                let mut issued = desk.issued.lock().unwrap();
                *issued += 1;
                *issued
            };
            let refresh = format!("refresh-canary-{n}");
            *desk.live_refresh.lock().unwrap() = Some(refresh.clone());
            (
                StatusCode::OK,
                Json(json!({"access_token": format!("access-canary-{n}"),
                "token_type": "Bearer", "expires_in": 60, "refresh_token": refresh})),
            )
        }
    });
    serve(
        axum::Router::new()
            .route("/auth/register", register)
            .route("/auth/token", token),
    )
    .await
}

#[tokio::test]
async fn a_registered_client_exchanges_its_code_with_pkce_and_refresh_rotates_until_revoked() {
    let (addr, documents) = authorization_fixture().await;
    let desk = Arc::new(TokenDesk::default());
    let tokens_at = token_server(desk.clone()).await;
    // The metadata sends registration and tokens to the token desk.
    documents.server.lock().unwrap()["registration_endpoint"] =
        json!(format!("http://{tokens_at}/auth/register"));
    documents.server.lock().unwrap()["token_endpoint"] =
        json!(format!("http://{tokens_at}/auth/token"));
    let egress = loopback_egress();
    let mcp = format!("http://{addr}/mcp");
    let found = discover(&egress, &mcp, None).await.unwrap();
    let redirect = "http://127.0.0.1:8080/oauth/callback";
    let client = register_client(&egress, &found, "wor", redirect)
        .await
        .unwrap();
    assert_eq!(client.client_id, "wor-client-1");
    let pkce = Pkce::new().unwrap();
    *desk.challenge.lock().unwrap() = pkce.challenge.clone();
    *desk.resource.lock().unwrap() = mcp.clone();

    // A wrong code is refused with the server's error code only.
    let error = exchange_code(
        &egress,
        &found,
        &client,
        &SecretString::from("code-2"),
        redirect,
        &pkce,
    )
    .await
    .unwrap_err();
    assert_eq!(
        error.to_string(),
        "the authorization server refused the code exchange: `invalid_grant`"
    );
    // Another verifier does not prove the challenge.
    let other = Pkce::new().unwrap();
    assert!(
        exchange_code(
            &egress,
            &found,
            &client,
            &SecretString::from("code-1"),
            redirect,
            &other
        )
        .await
        .is_err()
    );

    let tokens = exchange_code(
        &egress,
        &found,
        &client,
        &SecretString::from("code-1"),
        redirect,
        &pkce,
    )
    .await
    .unwrap();
    assert_eq!(tokens.access_token.expose_secret(), "access-canary-1");
    assert_eq!(tokens.expires_in, Some(60));
    let first_refresh = tokens.refresh_token.clone().unwrap();
    assert!(
        !format!("{tokens:?}").contains("canary"),
        "tokens stay out of Debug"
    );

    let rotated = refresh_tokens(&egress, &found, &client, &first_refresh)
        .await
        .unwrap();
    assert_eq!(rotated.access_token.expose_secret(), "access-canary-2");
    assert_eq!(
        rotated.refresh_token.as_ref().unwrap().expose_secret(),
        "refresh-canary-2"
    );

    // The rotated-out refresh token is revoked: refused, and the error quotes no token even
    // though the server's description does.
    let error = refresh_tokens(&egress, &found, &client, &first_refresh)
        .await
        .unwrap_err();
    assert!(
        matches!(&error, OAuthError::Refused { error, .. } if error == "invalid_grant"),
        "{error}"
    );
    assert!(!error.to_string().contains("canary"), "{error}");
    assert!(!format!("{error:?}").contains("canary"), "{error:?}");
}

/// Before `shifty`'s MCP server: `initialize` and notifications pass without a token (as the
/// conformance suite's step-up server does); any other request without one is a `401` naming
/// scope `mcp:basic`; with the `basic-token` a tool call is a `403` for scope
/// `mcp:basic mcp:write`; with the `write-token` everything passes.
async fn step_up_gate(
    axum::extract::State(addr): axum::extract::State<Arc<Mutex<String>>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let (parts, body) = request.into_parts();
    let bytes = axum::body::to_bytes(body, 1 << 20).await.unwrap();
    let method = serde_json::from_slice::<Value>(&bytes)
        .ok()
        .and_then(|message| {
            message
                .get("method")
                .and_then(Value::as_str)
                .map(str::to_owned)
        })
        .unwrap_or_default();
    let token = parts
        .headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::to_owned);
    let metadata = format!(
        "http://{}/.well-known/oauth-protected-resource/mcp",
        addr.lock().unwrap()
    );
    let open = method == "initialize" || method.starts_with("notifications/");
    match token.as_deref() {
        _ if open || parts.method != axum::http::Method::POST => {}
        None => {
            return (
                StatusCode::UNAUTHORIZED,
                [(
                    header::WWW_AUTHENTICATE,
                    format!(r#"Bearer scope="mcp:basic", resource_metadata="{metadata}""#),
                )],
            )
                .into_response();
        }
        Some("basic-token") if method == "tools/call" => {
            return (
                StatusCode::FORBIDDEN,
                [(
                    header::WWW_AUTHENTICATE,
                    format!(
                        r#"Bearer error="insufficient_scope", scope="mcp:basic mcp:write", resource_metadata="{metadata}", error_description="needs write""#
                    ),
                )],
                Json(json!({"error": "insufficient_scope"})),
            )
                .into_response();
        }
        Some(_) => {}
    }
    next.run(axum::extract::Request::from_parts(
        parts,
        axum::body::Body::from(bytes),
    ))
    .await
}

#[tokio::test]
async fn a_401_after_initialize_and_a_403_for_scope_are_typed_with_their_challenges() {
    use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
    use rmcp::transport::streamable_http_server::{
        StreamableHttpServerConfig, StreamableHttpService,
    };
    use wor_tools::{
        ConnectionCredentials, McpError, McpLimits, McpSession, StreamableHttpEndpoint,
    };

    let server = crate::own_server::ShiftyServer::default();
    let state = server.state.clone();
    let service = StreamableHttpService::new(
        move || Ok(server.clone()),
        Arc::new(LocalSessionManager::default()),
        StreamableHttpServerConfig::default(),
    );
    let own_addr = Arc::new(Mutex::new(String::new()));
    let router = axum::Router::new().nest_service("/mcp", service).layer(
        axum::middleware::from_fn_with_state(own_addr.clone(), step_up_gate),
    );
    let addr = serve(router).await;
    *own_addr.lock().unwrap() = addr.to_string();
    let egress = loopback_egress();
    let session = |credentials| {
        McpSession::connect_http(
            &egress,
            StreamableHttpEndpoint {
                url: format!("http://{addr}/mcp"),
                allowlist: crate::allow(addr),
                credentials,
            },
            McpLimits::default(),
        )
    };

    // The server lets the session begin and asks for authorization on the next request.
    let anonymous = session(ConnectionCredentials::none()).await.unwrap();
    let Err(McpError::AuthorizationRequired(challenge)) = anonymous.list_tools().await else {
        panic!("a 401 after initialize is a typed authorization request");
    };
    assert_eq!(challenge.scope.as_deref(), Some("mcp:basic"));
    assert_eq!(
        challenge.resource_metadata,
        Some(format!(
            "http://{addr}/.well-known/oauth-protected-resource/mcp"
        ))
    );
    anonymous.close().await;

    // With the basic scope the tools list, and a call is refused for its scope: nothing ran.
    let basic = session(ConnectionCredentials::bearer(SecretString::from("basic-token")).unwrap())
        .await
        .unwrap();
    assert!(!basic.list_tools().await.unwrap().is_empty());
    let seen = state.seen.lock().unwrap().len();
    let error = basic
        .call_tool("echo", serde_json::Map::new())
        .await
        .unwrap_err();
    assert_eq!(
        error.to_string(),
        "the mcp server refused the access token: it needs scope `mcp:basic mcp:write`"
    );
    let McpError::InsufficientScope(challenge) = error else {
        panic!("a 403 with insufficient_scope is typed: {error}");
    };
    assert!(challenge.is_insufficient_scope());
    assert_eq!(challenge.scopes(), ["mcp:basic", "mcp:write"]);
    assert_eq!(
        state.seen.lock().unwrap().len(),
        seen,
        "the call never reached the tool"
    );
    // The next authorization asks for what was asked before and what the server now needs.
    assert_eq!(
        wor_tools::oauth::union_scopes(["mcp:basic", challenge.scope.as_deref().unwrap()]),
        ["mcp:basic", "mcp:write"]
    );
    basic.close().await;

    // With the wider scope the call runs.
    let write = session(ConnectionCredentials::bearer(SecretString::from("write-token")).unwrap())
        .await
        .unwrap();
    let result = write
        .call_tool("echo", serde_json::Map::new())
        .await
        .unwrap();
    assert!(!result.is_error);
    write.close().await;
}
