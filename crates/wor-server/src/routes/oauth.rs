//! MCP authorization of tool connections (`docs/tools.md`, "OAuth connections"): a member
//! starts it and gets the URL to open; the person's browser comes back to the callback, which
//! finishes it. The tokens are sealed in the vault and never returned (S3).

use axum::Json;
use axum::extract::State;
use axum::http::Uri;
use axum::response::{IntoResponse, Response};
use secrecy::SecretString;
use wor_core::ConnectionId;

use crate::AppState;
use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::extract::{ApiPath, OptionalApiJson};
use crate::views::rfc3339;

/// An authorization started: the URL to open in a browser, and until when it may be finished.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct AuthorizationStartedView {
    pub connection_id: String,
    pub authorization_url: String,
    pub expires_at: String,
    /// How the authorization server knows wor's client: `registered` (the body's client),
    /// `metadata_document` (its id is the URL of the client ID metadata document `wor serve`
    /// publishes) or `dynamic_registration`.
    #[schema(value_type = String)]
    pub client: wor_tools::oauth::ClientSource,
    /// The scopes asked for: what the server wants, with those the connection's last
    /// authorization asked for and its server later said it needs.
    pub scopes: Vec<String>,
    /// Why the server's offer of client ID metadata documents was not taken, when it was not
    /// (an `http` `public_url`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub notice: Option<String>,
}

/// What the authorization server sends the browser back with.
#[derive(Debug, Default, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct CallbackQuery {
    pub code: Option<String>,
    pub state: Option<String>,
    /// Set instead of `code` when the person or the server refused.
    pub error: Option<String>,
    /// The authorization server that answered (RFC 9207), checked against the one the
    /// authorization was sent to.
    pub iss: Option<String>,
}

impl CallbackQuery {
    /// The code and the state, when the authorization server sent both: `error` instead (the
    /// person or the server refused), or either missing, is a 400 that says so.
    pub(crate) fn checked(&self) -> Result<(&str, &str), ApiError> {
        if let Some(error) = &self.error {
            let code: String = error
                .chars()
                .filter(|c| c.is_ascii_alphanumeric() || *c == '_')
                .take(64)
                .collect();
            return Err(ApiError::bad_request(
                "authorization_refused",
                format!(
                    "the authorization server refused: `{code}`; run `wor connection authorize` again"
                ),
            ));
        }
        match (&self.code, &self.state) {
            (Some(code), Some(state)) => Ok((code, state)),
            _ => Err(ApiError::bad_request(
                "invalid_callback",
                "the callback needs `code` and `state`",
            )),
        }
    }

    /// The console's path that finishes this authorization, with its `code`, `state` and
    /// `iss` encoded again.
    pub(crate) fn finish_path(&self) -> String {
        let mut query = url::form_urlencoded::Serializer::new(String::new());
        for (name, value) in [
            ("code", &self.code),
            ("state", &self.state),
            ("iss", &self.iss),
        ] {
            if let Some(value) = value {
                query.append_pair(name, value);
            }
        }
        format!("/console/oauth/finish?{}", query.finish())
    }

    /// The first of each parameter; others are ignored.
    pub(crate) fn parse(query: &str) -> Self {
        let mut parsed = Self::default();
        for (key, value) in url::form_urlencoded::parse(query.as_bytes()) {
            let slot = match key.as_ref() {
                "code" => &mut parsed.code,
                "state" => &mut parsed.state,
                "error" => &mut parsed.error,
                "iss" => &mut parsed.iss,
                _ => continue,
            };
            if slot.is_none() {
                *slot = Some(value.into_owned());
            }
        }
        parsed
    }
}

/// The client to authorize with, when the operator registered one with the authorization server
/// beforehand; without a body, wor registers a client dynamically.
#[derive(Debug, serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AuthorizeRequest {
    /// The registered client's id.
    #[schema(min_length = 1, max_length = 512)]
    pub client_id: String,
    /// A confidential client's secret: sealed with the pending authorization and then under the
    /// connection, sent only to the token endpoint, never returned.
    #[schema(min_length = 1, max_length = 4096)]
    pub client_secret: Option<String>,
}

impl AuthorizeRequest {
    fn checked(self) -> Result<wor_engine::RegisteredClient, ApiError> {
        let id = self.client_id.trim();
        if id.is_empty() || id.len() > 512 || id.chars().any(char::is_control) {
            return Err(ApiError::bad_request(
                "invalid_client_id",
                "`client_id` must be 1 to 512 characters, none of them control characters",
            ));
        }
        let secret = match self.client_secret {
            Some(secret) if secret.is_empty() || secret.len() > 4096 => {
                return Err(ApiError::bad_request(
                    "invalid_client_secret",
                    "`client_secret` must be 1 to 4096 bytes; leave it out for a public client",
                ));
            }
            secret => secret.map(SecretString::from),
        };
        Ok(wor_engine::RegisteredClient {
            client_id: id.to_owned(),
            client_secret: secret,
        })
    }
}

/// Starts the MCP authorization of an `mcp_http` connection for the calling member: discovery
/// and client registration (or the registered client the body names) through the egress
/// guard, then a pending authorization bound to this member, key and connection (single use,
/// 10 minutes). Needs the server's `public_url`.
#[utoipa::path(post, path = "/v1/tool-connections/{tool_connection_id}/authorize", tag = "tool-connections",
    security(("bearer" = [])),
    params(("tool_connection_id" = String, Path, description = "a `con_…` id", pattern = "^con_[0-9a-f]{32}$")),
    request_body(content = Option<AuthorizeRequest>, description = "a client registered beforehand; leave the body out to register one dynamically"),
    responses((status = 200, body = AuthorizationStartedView), (status = 400, body = ErrorBody),
        (status = 403, body = ErrorBody), (status = 404, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn authorize(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<ConnectionId>,
    OptionalApiJson(body): OptionalApiJson<AuthorizeRequest>,
) -> Result<Json<AuthorizationStartedView>, ApiError> {
    state
        .store
        .get_tool_connection(caller.project_id, id)
        .await?;
    caller.require_configure()?;
    let Some(member) = caller.member_id else {
        return Err(ApiError::Forbidden(
            "a connection is authorized by a member, with a personal key; a service key cannot"
                .to_owned(),
        ));
    };
    let registered = body.map(AuthorizeRequest::checked).transpose()?;
    let started = state
        .engine
        .start_oauth_authorization(
            caller.project_id,
            id,
            member,
            Some(caller.key_id),
            registered,
        )
        .await?;
    tracing::info!(category = "config", action = "connection.authorize_start", project_id = %caller.project_id,
        connection_id = %id, actor_key_id = %caller.key_id, "tool connection authorization started");
    Ok(Json(AuthorizationStartedView {
        connection_id: id.to_string(),
        authorization_url: started.authorization_url,
        expires_at: rfc3339(started.expires_at),
        client: started.client,
        scopes: started.scopes,
        notice: started.notice,
    }))
}

/// wor's client ID metadata document (draft-ietf-oauth-client-id-metadata-document), which an
/// authorization server that accepts such documents fetches from the URL wor gives as its
/// `client_id`: that URL (`{public_url}/hooks/oauth/client-metadata.json`), the name `wor`, the
/// callback as its one redirect URI, the authorization-code and refresh grants, and no secret
/// (`token_endpoint_auth_method` `none`; PKCE protects the codes). No API key: it is public. A
/// 404 when the server's `public_url` is not `https` (authorizations then register a client
/// dynamically).
#[utoipa::path(get, path = "/hooks/oauth/client-metadata.json", tag = "tool-connections",
    responses((status = 200, body = Object, description = "the client ID metadata document: `client_id`, `client_name`, `redirect_uris`, `grant_types`, `response_types`, `token_endpoint_auth_method`"),
        (status = 404, body = ErrorBody)))]
pub async fn client_metadata(
    State(state): State<AppState>,
) -> Result<Json<wor_tools::oauth::ClientMetadata>, ApiError> {
    state
        .engine
        .oauth_client_metadata_document()
        .map(Json)
        .ok_or(ApiError::NotFound)
}

/// Where the authorization server sends the person's browser back. No API key, and no
/// console session either: a browser sends the console's cookie (`SameSite=Strict`) on no
/// navigation another site started. So this page only checks that `state` names an
/// authorization that can still finish and hands the browser on to
/// `/console/oauth/finish` (same query), a navigation of this site's own, where the console
/// session shows whether the person who came back is the member who started it.
#[utoipa::path(get, path = "/hooks/oauth/callback", tag = "tool-connections",
    params(CallbackQuery),
    responses((status = 200, content_type = "text/html", description = "a page that takes the browser on to `/console/oauth/finish` with the same query"),
        (status = 400, body = ErrorBody)))]
pub async fn callback(State(state): State<AppState>, uri: Uri) -> Result<Response, ApiError> {
    let query = CallbackQuery::parse(uri.query().unwrap_or_default());
    let (_, pending) = query.checked()?;
    if state
        .store
        .pending_oauth_authorization(pending)
        .await?
        .is_none()
    {
        return Err(wor_engine::EngineError::from(wor_engine::OAuthRefusal::UnknownState).into());
    }
    Ok(hand_on_page(&query.finish_path()))
}

/// Finishes the authorization `query` names for `member`, signed in to the console: its code
/// exchanged (with the PKCE verifier) and the tokens sealed; nothing secret is returned.
pub(crate) async fn finish(
    state: &AppState,
    query: &CallbackQuery,
    member: wor_core::MemberId,
) -> Result<wor_engine::FinishedAuthorization, ApiError> {
    let (code, pending) = query.checked()?;
    Ok(state
        .engine
        .finish_oauth_authorization(
            pending,
            &SecretString::from(code.to_owned()),
            query.iss.as_deref(),
            member,
        )
        .await?)
}

/// A page that takes the browser on to `path` on this site at once (and a link, should it not).
/// Nothing on it loads from elsewhere, and it sends no referrer.
fn hand_on_page(path: &str) -> Response {
    // `path` holds only what a query's encoding leaves: letters, digits, `%`, `&`, `=`, `+`,
    // `-`, `.`, `_`, `*` and `/`, `?`; only `&` needs an entity in an attribute.
    let href = path.replace('&', "&amp;");
    let page = format!(
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"referrer\" content=\"no-referrer\">\
         <meta http-equiv=\"refresh\" content=\"0;url={href}\">\
         <title>Finishing the authorization</title></head><body>\
         <p>Finishing the authorization in the console, where you need to be signed in as the \
         member who started it. <a href=\"{href}\">Continue</a></p></body></html>"
    );
    (
        [
            (axum::http::header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (axum::http::header::CACHE_CONTROL, "no-store"),
            (axum::http::header::REFERRER_POLICY, "no-referrer"),
        ],
        page,
    )
        .into_response()
}
