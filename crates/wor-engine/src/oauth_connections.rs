//! MCP authorization of `mcp_http` connections, from the server's side: starting an
//! authorization for a member (discovery and client registration through the egress guard, a
//! pending authorization with its `state` stored as a digest and its PKCE verifier sealed),
//! finishing it when the person's browser lands on the callback (the code exchanged, the
//! access and refresh tokens sealed under the connection), and the connection's current
//! access token, refreshed ahead of its expiry with the refresh token the server rotates.
//! Also wor's client ID metadata document (published by `wor serve` when its `public_url` is
//! `https`), and the scope step-up a run's call meets: it fails closed, and the connection
//! remembers the wider scope for its next authorization.
//!
//! Tokens go only into the vault and onto the wire: no return value, error or audit entry
//! here holds one.

use std::sync::Arc;

use secrecy::{ExposeSecret, SecretString};
use serde::{Deserialize, Serialize};
use serde_json::json;
use wor_core::audit::{Actor, AuditCategory, AuditEvent};
use wor_core::{ApiKeyId, ConnectionId, MemberId, ProjectId};
use wor_store::{
    ACCESS_TOKEN_FIELD, CLIENT_SECRET_FIELD, ConnectionOAuthRecord, NewOAuthAuthorization,
    OAUTH_AUTHORIZATIONS_TABLE, PKCE_VERIFIER_FIELD, REFRESH_TOKEN_FIELD, SecretSlot,
    TOOL_CONNECTIONS_TABLE, ToolConnectionKind, ToolConnectionRecord, now_millis,
};
use wor_tools::oauth::{
    self, AuthorizationDiscovery, ClientMetadata, ClientMetadataUrl, ClientRegistration,
    ClientSource, MetadataDocumentUnusable, Pkce, TokenEndpointAuth, TokenSet,
};

use crate::{Engine, EngineError};

/// How long a person has to finish an authorization they started.
pub const AUTHORIZATION_LIFETIME_MS: i64 = 10 * 60 * 1000;
/// An access token is refreshed when it has less than this left.
pub const REFRESH_AHEAD_MS: i64 = 60 * 1000;
/// How long a process's claim on a connection's refresh lasts if it never records one.
const REFRESH_CLAIM_MS: i64 = 30 * 1000;
/// How long a caller waits for another process's refresh before giving up.
const REFRESH_WAIT: std::time::Duration = std::time::Duration::from_secs(15);
/// How often it looks whether that refresh is done.
const REFRESH_POLL: std::time::Duration = std::time::Duration::from_millis(100);
/// The path of the callback on `wor serve`.
pub const OAUTH_CALLBACK_PATH: &str = "/hooks/oauth/callback";
/// The path on `wor serve` of its client ID metadata document: with an `https` `public_url`,
/// that URL is wor's `client_id` at an authorization server that accepts such documents.
pub const OAUTH_CLIENT_METADATA_PATH: &str = "/hooks/oauth/client-metadata.json";
/// The `client_name` wor registers, and names in its client ID metadata document.
const CLIENT_NAME: &str = "wor";

/// A client the operator registered with the connection's authorization server beforehand,
/// used instead of dynamic registration (a server that offers none needs one).
#[derive(Debug, Clone)]
pub struct RegisteredClient {
    pub client_id: String,
    /// A confidential client's secret; sealed with the pending authorization, never returned.
    pub client_secret: Option<SecretString>,
}

/// An authorization started: the URL the person opens.
#[derive(Debug, Clone)]
pub struct StartedAuthorization {
    pub authorization_url: String,
    /// When the pending authorization expires (milliseconds).
    pub expires_at: i64,
    /// How the authorization server knows wor's client.
    pub client: ClientSource,
    /// The scopes asked for.
    pub scopes: Vec<String>,
    /// Why the server's offer of client ID metadata documents was not taken, when it was not.
    pub notice: Option<String>,
}

/// An authorization finished.
#[derive(Debug, Clone)]
pub struct FinishedAuthorization {
    pub project_id: ProjectId,
    pub connection_id: ConnectionId,
    pub connection: String,
}

/// Who acts for an authorization: the member with their key, or signed in to the console.
fn authorizing_actor(member_id: MemberId, key: Option<ApiKeyId>) -> Actor {
    match key {
        Some(key_id) => Actor::Member { member_id, key_id },
        None => Actor::ConsoleMember { member_id },
    }
}

/// Why an MCP authorization cannot be started or finished, or a connection's authorization
/// cannot be used: each says what to do.
#[derive(Debug, thiserror::Error)]
pub enum OAuthRefusal {
    /// The authorization server sends the person back to the server's `public_url`.
    #[error(
        "MCP authorization needs the server's `public_url` (in the configuration) for its callback"
    )]
    NoCallback,
    /// Only an MCP server over HTTP is authorized.
    #[error(
        "tool connection `{connection}` is `{kind}`: only an `mcp_http` connection is authorized"
    )]
    NotMcpHttp {
        connection: String,
        kind: wor_store::ToolConnectionKind,
    },
    /// The authorization server registers no client: the operator registers one.
    #[error(
        "authorizing tool connection `{connection}`: {source}: register a client with it and \
         run `wor connection authorize {id} --client-id ID` (with `--client-secret-env VAR` \
         for a confidential client)"
    )]
    NeedsClient {
        connection: String,
        id: ConnectionId,
        #[source]
        source: Box<oauth::OAuthError>,
    },
    /// The callback's `state` names no pending authorization.
    #[error(
        "this authorization is unknown, was already used or has expired; run `wor connection authorize` again"
    )]
    UnknownState,
    /// The authorization was started by another member than the one finishing it.
    #[error(
        "this authorization was started by another member: only they can finish it, signed in to the console; to authorize the connection yourself, run `wor connection authorize` again"
    )]
    AnotherMember,
    /// The callback's `iss` (RFC 9207) is not the authorization server this authorization was
    /// sent to, or is missing where that server promised it: a mix-up, and the code is not
    /// exchanged anywhere.
    #[error(
        "the answer came from another authorization server than this authorization was sent to ({found}); nothing was exchanged; run `wor connection authorize` again"
    )]
    IssuerMismatch { found: String },
    /// The connection's authorization cannot be used any more: it is authorized again.
    #[error(
        "tool connection `{connection}` is no longer authorized ({reason}); run `wor connection authorize {id}` again"
    )]
    NotAuthorized {
        connection: String,
        id: ConnectionId,
        reason: LostAuthorization,
    },
}

/// Why a connection's authorization cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum LostAuthorization {
    #[error("it was never authorized")]
    Never,
    #[error("its access token expired and there is no refresh token")]
    NoRefreshToken,
    #[error("{0}")]
    RefreshRefused(Box<oauth::OAuthError>),
    #[error("its server refused a freshly refreshed access token")]
    RefusedAfterRefresh,
}

fn unreachable(connection: &str, error: oauth::OAuthError) -> EngineError {
    EngineError::Authorization {
        connection: connection.to_owned(),
        source: Box::new(error),
    }
}

/// What is stored beside a pending or settled authorization: the discovery, and how the
/// registered client authenticates at the token endpoint (absent in rows written before it
/// was kept, when it is derived from the server's metadata again).
#[derive(Serialize, Deserialize)]
struct StoredDiscovery {
    #[serde(flatten)]
    discovery: AuthorizationDiscovery,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    token_endpoint_auth: Option<TokenEndpointAuth>,
}

fn discovery_json(
    discovery: &AuthorizationDiscovery,
    client: &ClientRegistration,
) -> Result<serde_json::Value, EngineError> {
    serde_json::to_value(StoredDiscovery {
        discovery: discovery.clone(),
        token_endpoint_auth: Some(client.auth),
    })
    .map_err(|e| EngineError::InvalidState(format!("the discovery cannot be stored: {e}")))
}

fn discovery_from(value: &serde_json::Value) -> Result<StoredDiscovery, EngineError> {
    serde_json::from_value(value.clone())
        .map_err(|e| EngineError::InvalidState(format!("stored discovery: {e}")))
}

impl Engine {
    /// Where the authorization server sends the person back: the server's `public_url` and
    /// [`OAUTH_CALLBACK_PATH`].
    pub fn oauth_redirect_uri(&self) -> Result<String, EngineError> {
        let Some(base) = &self.config.console_url else {
            return Err(OAuthRefusal::NoCallback.into());
        };
        Ok(format!(
            "{}{OAUTH_CALLBACK_PATH}",
            base.trim_end_matches('/')
        ))
    }

    /// The URL of wor's client ID metadata document: the server's `public_url` and
    /// [`OAUTH_CLIENT_METADATA_PATH`], usable only when that is `https`.
    fn oauth_client_metadata_url(&self) -> Result<ClientMetadataUrl, MetadataDocumentUnusable> {
        let base = self.config.console_url.as_deref().unwrap_or_default();
        ClientMetadataUrl::parse(&format!(
            "{}{OAUTH_CLIENT_METADATA_PATH}",
            base.trim_end_matches('/')
        ))
    }

    /// The client ID metadata document `wor serve` publishes at
    /// [`OAUTH_CLIENT_METADATA_PATH`]: its `client_id` is that URL, its one redirect URI the
    /// callback. `None` when the server's `public_url` is not an `https` URL (no authorization
    /// server would fetch it; authorizations then register a client dynamically).
    pub fn oauth_client_metadata_document(&self) -> Option<ClientMetadata> {
        let url = self.oauth_client_metadata_url().ok()?;
        let redirect_uri = self.oauth_redirect_uri().ok()?;
        Some(ClientMetadata::document(&url, CLIENT_NAME, &redirect_uri))
    }

    /// Starts authorizing `mcp_http` connection `id` for `member` (using `key`): the server's
    /// own `401` challenge (where its metadata is, which scopes it wants), discovery and the
    /// client (the one the operator `registered`, else wor's client ID metadata document when
    /// the server accepts one and `public_url` is `https`, else dynamic registration), all
    /// through the egress guard; a pending authorization bound to the member, key and
    /// connection (no key: started in the console, signed in). It asks for the scopes the
    /// server wants united with those the connection's last authorization asked for and its
    /// server later said it needs. Lapsed pending authorizations of the project are purged
    /// first.
    pub async fn start_oauth_authorization(
        &self,
        project: ProjectId,
        id: ConnectionId,
        member: MemberId,
        key: Option<ApiKeyId>,
        registered: Option<RegisteredClient>,
    ) -> Result<StartedAuthorization, EngineError> {
        let record = self.store.get_tool_connection(project, id).await?;
        if record.kind != ToolConnectionKind::McpHttp {
            return Err(OAuthRefusal::NotMcpHttp {
                connection: record.name,
                kind: record.kind,
            }
            .into());
        }
        let redirect_uri = self.oauth_redirect_uri()?;
        self.purge_lapsed_oauth_authorizations(project).await?;
        // The server's own challenge names its metadata and the scopes it wants.
        let challenge = self.oauth_probe(&record).await?;
        let discovery = oauth::discover(&self.egress, &record.url, challenge.as_ref())
            .await
            .map_err(|e| unreachable(&record.name, e))?;
        let given = registered.map(|registered| {
            ClientRegistration::pre_registered(
                registered.client_id,
                registered.client_secret,
                &discovery.authorization_server,
            )
        });
        let document_url = self.oauth_client_metadata_url();
        let chosen = oauth::choose_client(
            &self.egress,
            &discovery,
            given,
            document_url.as_ref(),
            CLIENT_NAME,
            &redirect_uri,
        )
        .await
        .map_err(|e| match e {
            // Not the server's failure: this authorization needs a registered client.
            e @ oauth::OAuthError::NoRegistration { .. } => OAuthRefusal::NeedsClient {
                connection: record.name.clone(),
                id,
                source: Box::new(e),
            }
            .into(),
            other => unreachable(&record.name, other),
        })?;
        let notice = chosen.metadata_document_declined.as_ref().map(|why| {
            format!(
                "the authorization server accepts a client ID metadata document, but {why}; \
                 a client was registered dynamically instead"
            )
        });
        let client = chosen.registration;
        let remembered = self
            .store
            .get_connection_oauth(project, id)
            .await?
            .and_then(|settled| settled.scope);
        let asked = oauth::requested_scopes(challenge.as_ref(), &discovery);
        // What the server asks for now comes first: within the bound on scopes, a remembered
        // step-up never crowds it out.
        let scopes = oauth::union_scopes(
            asked
                .iter()
                .map(String::as_str)
                .chain(remembered.as_deref()),
        );
        let state = oauth::new_state().map_err(|e| unreachable(&record.name, e))?;
        let pkce = Pkce::new().map_err(|e| unreachable(&record.name, e))?;
        let url = oauth::authorization_url(
            &discovery,
            &client.client_id,
            &redirect_uri,
            &scopes,
            &state,
            &pkce,
        )
        .map_err(|e| unreachable(&record.name, e))?;
        let pending = self
            .store
            .create_oauth_authorization(
                project,
                &state,
                NewOAuthAuthorization {
                    connection_id: id,
                    member_id: member,
                    api_key_id: key,
                    client_id: client.client_id.clone(),
                    redirect_uri,
                    discovery: discovery_json(&discovery, &client)?,
                    scope: (!scopes.is_empty()).then(|| scopes.join(" ")),
                    lifetime_ms: AUTHORIZATION_LIFETIME_MS,
                },
            )
            .await?;
        let slot = |field: &str| {
            SecretSlot::new(
                project,
                OAUTH_AUTHORIZATIONS_TABLE,
                &pending.state_digest,
                field,
            )
        };
        self.vault
            .put(&slot(PKCE_VERIFIER_FIELD), pkce.verifier().expose_secret())
            .await
            .map_err(EngineError::Vault)?;
        if let Some(secret) = &client.client_secret {
            self.vault
                .put(&slot(CLIENT_SECRET_FIELD), secret.expose_secret())
                .await
                .map_err(EngineError::Vault)?;
        }
        Ok(StartedAuthorization {
            authorization_url: url,
            expires_at: pending.expires_at,
            client: chosen.source,
            scopes,
            notice,
        })
    }

    /// The `401` challenge `record`'s server answers a session begun without credentials
    /// with, if any, asked within the connection's allowlist.
    async fn oauth_probe(
        &self,
        record: &ToolConnectionRecord,
    ) -> Result<Option<oauth::Challenge>, EngineError> {
        let allowlist = wor_egress::HostAllowlist::parse(&record.allowlist).map_err(|e| {
            EngineError::InvalidState(format!(
                "tool connection `{}` has an invalid allowlist: {e}",
                record.name
            ))
        })?;
        oauth::probe(&self.egress, &record.url, Some(&allowlist))
            .await
            .map_err(|e| unreachable(&record.name, e))
    }

    /// Whether `mcp_http` connection `id`'s server asks for authorization: it answers a
    /// session begun without credentials with a `401` challenge (through the egress guard).
    pub async fn oauth_challenged(
        &self,
        project: ProjectId,
        id: ConnectionId,
    ) -> Result<bool, EngineError> {
        let record = self.store.get_tool_connection(project, id).await?;
        if record.kind != ToolConnectionKind::McpHttp {
            return Ok(false);
        }
        Ok(self.oauth_probe(&record).await?.is_some())
    }

    /// Deletes the project's pending authorizations that can no longer finish, with the PKCE
    /// verifier and client secret sealed for each (the vault's copies first, so a crash part
    /// way leaves the row for the next purge).
    async fn purge_lapsed_oauth_authorizations(
        &self,
        project: ProjectId,
    ) -> Result<(), EngineError> {
        const PURGED_PER_START: i64 = 100;
        // Taken or expired a whole lifetime ago: no finish is still reading its verifier.
        let before = now_millis().saturating_sub(AUTHORIZATION_LIFETIME_MS);
        let lapsed = self
            .store
            .lapsed_oauth_authorizations(project, before, PURGED_PER_START)
            .await?;
        for digest in lapsed {
            for field in [PKCE_VERIFIER_FIELD, CLIENT_SECRET_FIELD] {
                self.vault
                    .delete(&SecretSlot::new(
                        project,
                        OAUTH_AUTHORIZATIONS_TABLE,
                        &digest,
                        field,
                    ))
                    .await?;
            }
            self.store
                .delete_oauth_authorization(project, &digest)
                .await?;
        }
        Ok(())
    }

    /// Finishes the authorization `state` names with `code`, for `member`, signed in to the
    /// console in the browser the authorization server sent back: only the member who started
    /// it (a link to another's authorization, opened by someone else, does not give that
    /// person's grant to their connection), once, before it expires. The tokens are sealed
    /// under the connection and the audit chain records who authorized it.
    pub async fn finish_oauth_authorization(
        &self,
        state: &str,
        code: &SecretString,
        issuer: Option<&str>,
        member: MemberId,
    ) -> Result<FinishedAuthorization, EngineError> {
        let Some(pending) = self.store.take_oauth_authorization(state, member).await? else {
            return Err(match self.store.pending_oauth_authorization(state).await? {
                Some(_) => OAuthRefusal::AnotherMember,
                None => OAuthRefusal::UnknownState,
            }
            .into());
        };
        let project = pending.project_id;
        let record = self
            .store
            .get_tool_connection(project, pending.connection_id)
            .await?;
        let actor = authorizing_actor(pending.member_id, pending.api_key_id);
        let slot = |field: &str| {
            SecretSlot::new(
                project,
                OAUTH_AUTHORIZATIONS_TABLE,
                &pending.state_digest,
                field,
            )
        };
        let verifier = self
            .vault
            .open(&slot(PKCE_VERIFIER_FIELD))
            .await
            .map_err(EngineError::Vault)?;
        let client_secret = match self.vault.metadata(&slot(CLIENT_SECRET_FIELD)).await? {
            Some(_) => Some(
                self.vault
                    .open(&slot(CLIENT_SECRET_FIELD))
                    .await
                    .map_err(EngineError::Vault)?,
            ),
            None => None,
        };
        self.vault.delete(&slot(PKCE_VERIFIER_FIELD)).await?;
        self.vault.delete(&slot(CLIENT_SECRET_FIELD)).await?;
        let stored = discovery_from(&pending.discovery)?;
        let discovery = stored.discovery;
        // RFC 9207: the answer must come from the server the person was sent to. The pending
        // authorization is spent already, so a mixed-up code is exchanged nowhere.
        let sent_to = &discovery.authorization_server;
        match issuer {
            Some(found) if found != sent_to.issuer => {
                return Err(OAuthRefusal::IssuerMismatch {
                    found: format!("`iss` is `{}`", found.chars().take(200).collect::<String>()),
                }
                .into());
            }
            None if sent_to.authorization_response_iss_parameter_supported => {
                return Err(OAuthRefusal::IssuerMismatch {
                    found: "no `iss`, which that server promised".to_owned(),
                }
                .into());
            }
            _ => {}
        }
        let client = ClientRegistration::known(
            pending.client_id.clone(),
            client_secret,
            stored.token_endpoint_auth,
            &discovery.authorization_server,
        );
        let tokens = match oauth::exchange_code(
            &self.egress,
            &discovery,
            &client,
            code,
            &pending.redirect_uri,
            &Pkce::from_verifier(verifier),
        )
        .await
        {
            Ok(tokens) => tokens,
            Err(error) => {
                self.audit_oauth_failure(project, &record.name, record.id, actor, &error)
                    .await?;
                return Err(unreachable(&record.name, error));
            }
        };
        let now = now_millis();
        let connection_slot =
            |field: &str| SecretSlot::new(project, TOOL_CONNECTIONS_TABLE, record.id, field);
        let mut secrets = token_secrets(&connection_slot, &tokens);
        if let Some(secret) = &client.client_secret {
            secrets.push((connection_slot(CLIENT_SECRET_FIELD), secret.expose_secret()));
        }
        let sealed = secrets
            .iter()
            .map(|(slot, value)| self.vault.seal_put(slot, value))
            .collect::<Result<Vec<_>, _>>()
            .map_err(EngineError::Vault)?;
        // The tokens and client secret are written, and the entry staged, with the
        // authorization: a crash leaves all or none of them, never tokens in use without
        // their entry.
        let recorded = AuditEvent::new(project, AuditCategory::ToolConnectionAuthorize, actor)
            .subject("connection_id", record.id)
            .payload(json!({
                "connection": record.name,
                "issuer": discovery.authorization_server.issuer,
                "resource": discovery.resource,
                "client_id": pending.client_id,
                "scope": pending.scope,
                "refresh_token": tokens.refresh_token.is_some(),
            }));
        let staged = self
            .store
            .put_connection_oauth_staged(
                &ConnectionOAuthRecord {
                    connection_id: record.id,
                    project_id: project,
                    client_id: pending.client_id.clone(),
                    discovery: pending.discovery.clone(),
                    access_expires_at: expires_at(now, &tokens),
                    authorized_by: pending.member_id,
                    authorized_key_id: pending.api_key_id,
                    authorized_at: now,
                    refreshed_at: None,
                    scope: pending.scope.clone(),
                },
                &sealed,
                Some(recorded),
            )
            .await?;
        self.append_staged_or_log(staged).await;
        tracing::info!(category = "config", action = "connection.authorize", project_id = %project,
            connection_id = %record.id, "tool connection authorized");
        Ok(FinishedAuthorization {
            project_id: project,
            connection_id: record.id,
            connection: record.name,
        })
    }

    /// Seals refreshed `tokens` into the slots `slot` names, in one transaction, staging
    /// `recorded`, the refresh's entry, in it too.
    async fn seal_tokens(
        &self,
        slot: &impl Fn(&str) -> SecretSlot,
        tokens: &TokenSet,
        recorded: AuditEvent,
    ) -> Result<Option<wor_store::StagedEvent>, EngineError> {
        let (_, staged) = self
            .vault
            .put_staged(&token_secrets(slot, tokens), Some(recorded))
            .await
            .map_err(EngineError::Vault)?;
        Ok(staged)
    }

    async fn audit_oauth_failure(
        &self,
        project: ProjectId,
        connection: &str,
        id: ConnectionId,
        actor: Actor,
        error: &oauth::OAuthError,
    ) -> Result<(), EngineError> {
        self.audit
            .append(
                AuditEvent::new(
                    project,
                    AuditCategory::ToolConnectionAuthorizeFailure,
                    actor,
                )
                .subject("connection_id", id)
                .payload(json!({"connection": connection, "reason": error.to_string()})),
            )
            .await?;
        Ok(())
    }

    /// The access token of an authorized connection, refreshed first when it expires within
    /// [`REFRESH_AHEAD_MS`] (the rotated refresh token is sealed in place of the old). `None`
    /// when the connection was never authorized. A refresh is recorded as the member (and key)
    /// who authorized the connection. A failed refresh fails closed with a reason
    /// that names the connection and says to authorize it again.
    pub async fn oauth_access_token(
        &self,
        project: ProjectId,
        id: ConnectionId,
        connection: &str,
    ) -> Result<Option<SecretString>, EngineError> {
        let slot = |field: &str| SecretSlot::new(project, TOOL_CONNECTIONS_TABLE, id, field);
        let fresh = |settled: &ConnectionOAuthRecord| {
            settled
                .access_expires_at
                .is_none_or(|at| at.saturating_sub(now_millis()) > REFRESH_AHEAD_MS)
        };
        let deadline = tokio::time::Instant::now() + REFRESH_WAIT;
        loop {
            let Some(settled) = self.store.get_connection_oauth(project, id).await? else {
                return Ok(None);
            };
            if !fresh(&settled) {
                // One refresh of a connection at a time: a lock per connection in this process,
                // a claim in the database across processes. Whoever waited finds it fresh.
                let held = self.oauth_refresh_lock(id).lock_owned().await;
                let Some(settled) = self.store.get_connection_oauth(project, id).await? else {
                    return Ok(None);
                };
                if !fresh(&settled) {
                    let until = now_millis().saturating_add(REFRESH_CLAIM_MS);
                    if let Some(claim) = self
                        .store
                        .claim_connection_oauth_refresh(project, id, until)
                        .await?
                    {
                        // The refresh runs to its end on a task of its own, holding the lock:
                        // once the server has rotated the refresh token, the new one must be
                        // sealed even if this caller is cancelled meanwhile.
                        let engine = self.clone();
                        let connection = connection.to_owned();
                        let refresh = tokio::spawn(async move {
                            let _held = held;
                            let refreshed = engine
                                .refresh_oauth(project, id, &connection, &settled)
                                .await;
                            if refreshed.is_err() {
                                engine
                                    .store
                                    .release_connection_oauth_refresh(project, id, &claim)
                                    .await?;
                            }
                            refreshed
                        });
                        return refresh
                            .await
                            .map_err(|e| {
                                EngineError::InvalidState(format!(
                                    "the token refresh of tool connection `{id}` stopped: {e}"
                                ))
                            })?
                            .map(Some);
                    }
                    drop(held);
                    if tokio::time::Instant::now() >= deadline {
                        return Err(EngineError::RefreshInProgress {
                            connection: connection.to_owned(),
                        });
                    }
                    tokio::time::sleep(REFRESH_POLL).await;
                    continue;
                }
            }
            return self
                .vault
                .open(&slot(ACCESS_TOKEN_FIELD))
                .await
                .map(Some)
                .map_err(EngineError::Vault);
        }
    }

    /// The access token to send instead of `rejected`, which connection `id`'s server refused
    /// (`401`) before its recorded expiry: when the sealed token is still `rejected`, it is
    /// marked expired and refreshed through [`Engine::oauth_access_token`] (the same lock and
    /// claim, so concurrent sessions refresh once); when another caller refreshed it already,
    /// the current one. A failed refresh fails closed with the reason that names the
    /// connection and the command that authorizes it again.
    pub async fn oauth_access_token_after_rejection(
        &self,
        project: ProjectId,
        id: ConnectionId,
        connection: &str,
        rejected: &SecretString,
    ) -> Result<SecretString, EngineError> {
        let slot = SecretSlot::new(project, TOOL_CONNECTIONS_TABLE, id, ACCESS_TOKEN_FIELD);
        {
            let _held = self.oauth_refresh_lock(id).lock_owned().await;
            let current = self.vault.open(&slot).await.map_err(EngineError::Vault)?;
            if current.expose_secret() != rejected.expose_secret() {
                return Ok(current);
            }
            self.store
                .expire_connection_oauth_access(project, id)
                .await?;
        }
        self.oauth_access_token(project, id, connection)
            .await?
            .ok_or_else(|| not_authorized(connection, id, LostAuthorization::Never))
    }

    /// The lock this process takes to refresh connection `id`'s token.
    fn oauth_refresh_lock(&self, id: ConnectionId) -> Arc<tokio::sync::Mutex<()>> {
        let mut locks = self
            .oauth_refreshes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        locks.entry(id).or_default().clone()
    }

    /// Refreshes connection `id`'s tokens with its refresh token, under this process's claim.
    async fn refresh_oauth(
        &self,
        project: ProjectId,
        id: ConnectionId,
        connection: &str,
        settled: &ConnectionOAuthRecord,
    ) -> Result<SecretString, EngineError> {
        // The refresh acts on the grant of the member who authorized the connection.
        let actor = authorizing_actor(settled.authorized_by, settled.authorized_key_id);
        let slot = |field: &str| SecretSlot::new(project, TOOL_CONNECTIONS_TABLE, id, field);
        let failed = |reason| not_authorized(connection, id, reason);
        if self
            .vault
            .metadata(&slot(REFRESH_TOKEN_FIELD))
            .await?
            .is_none()
        {
            return Err(failed(LostAuthorization::NoRefreshToken));
        }
        let refresh = self
            .vault
            .open(&slot(REFRESH_TOKEN_FIELD))
            .await
            .map_err(EngineError::Vault)?;
        let client_secret = match self.vault.metadata(&slot(CLIENT_SECRET_FIELD)).await? {
            Some(_) => Some(
                self.vault
                    .open(&slot(CLIENT_SECRET_FIELD))
                    .await
                    .map_err(EngineError::Vault)?,
            ),
            None => None,
        };
        let stored = discovery_from(&settled.discovery)?;
        let discovery = stored.discovery;
        let client = ClientRegistration::known(
            settled.client_id.clone(),
            client_secret,
            stored.token_endpoint_auth,
            &discovery.authorization_server,
        );
        let tokens = match oauth::refresh_tokens(&self.egress, &discovery, &client, &refresh).await
        {
            Ok(tokens) => tokens,
            Err(error) => {
                self.audit_oauth_failure(project, connection, id, actor, &error)
                    .await?;
                tracing::warn!(category = "tools", action = "connection.authorize_failure",
                    project_id = %project, connection_id = %id, "tool connection's token refresh failed");
                return Err(failed(LostAuthorization::RefreshRefused(Box::new(error))));
            }
        };
        // The entry is staged with the new tokens: a crash before it is appended leaves it for
        // the audit writer's sweep, never tokens in use without their entry.
        let recorded = AuditEvent::new(project, AuditCategory::ToolConnectionTokenRefresh, actor)
            .subject("connection_id", id)
            .payload(json!({
                "connection": connection,
                "refresh_token_rotated": tokens.refresh_token.is_some(),
            }));
        let staged = self.seal_tokens(&slot, &tokens, recorded).await?;
        self.append_staged_or_log(staged).await;
        self.store
            .record_connection_oauth_refresh(project, id, expires_at(now_millis(), &tokens))
            .await?;
        Ok(tokens.access_token)
    }
}

impl Engine {
    /// What a run's call fails with when connection `record`'s server refused it for the
    /// access token's scope (`403` with `insufficient_scope`; the server ran nothing). Nobody
    /// is there to authorize during a run, so the call fails closed, naming the connection,
    /// the scope and the command. An authorized connection remembers the wider scope (what it
    /// was authorized for united with what the server asked), which its next authorization,
    /// from the CLI or the console, asks for; the audit chain records the step-up the run met,
    /// as `event` (the run's `connection.scope_step_up`).
    pub(crate) async fn oauth_scope_step_up(
        &self,
        event: AuditEvent,
        record: &ToolConnectionRecord,
        challenge: &oauth::Challenge,
    ) -> Result<String, EngineError> {
        let (project, id) = (record.project_id, record.id);
        let needed = challenge.scopes().join(" ");
        // A remote worker cannot widen what the connection's next authorization asks for (the
        // control plane keeps it): the call fails closed saying what to authorize.
        let next = if self.is_remote() {
            None
        } else {
            // The lock of the connection's refresh: two calls widening at once keep both.
            let _held = self.oauth_refresh_lock(id).lock_owned().await;
            match self.store.get_connection_oauth(project, id).await? {
                Some(settled) => {
                    // Only scopes the server's metadata says it understands are remembered,
                    // when it lists any: a server's 403 cannot make the next authorization ask
                    // for arbitrary grants. The scopes it asks for now come first.
                    let discovery = discovery_from(&settled.discovery)?.discovery;
                    let known: Vec<&str> = discovery
                        .protected_resource
                        .scopes_supported
                        .iter()
                        .chain(&discovery.authorization_server.scopes_supported)
                        .map(String::as_str)
                        .collect();
                    let asked = challenge.scopes();
                    let wanted = asked
                        .iter()
                        .map(String::as_str)
                        .filter(|scope| known.is_empty() || known.contains(scope));
                    let next =
                        oauth::union_scopes(wanted.chain(settled.scope.as_deref())).join(" ");
                    if settled.scope.as_deref() != Some(next.as_str()) && !next.is_empty() {
                        self.store
                            .set_connection_oauth_scope(project, id, &next)
                            .await?;
                    }
                    Some(next)
                }
                None => None,
            }
        };
        if !self.is_remote() {
            self.audit
                .append(event.subject("connection_id", id).payload(json!({
                    "connection": record.name,
                    "scope_needed": needed,
                    "scope_next_authorization": next,
                })))
                .await?;
        }
        tracing::info!(category = "tools", action = "connection.scope_step_up", project_id = %project,
            connection_id = %id, "tool connection needs a wider scope");
        let wants = match needed.as_str() {
            "" => "a scope it did not name".to_owned(),
            scope => format!("scope `{scope}`"),
        };
        Ok(match next {
            Some(next) => {
                let asks = match next.as_str() {
                    "" => String::new(),
                    next => format!(" (it will ask for `{next}`)"),
                };
                format!(
                    "tool connection `{}`'s server refused its access token: it needs {wants}, \
                     more than the connection's authorization grants; run \
                     `wor connection authorize {id}` again{asks}",
                    record.name
                )
            }
            None => format!(
                "tool connection `{}`'s server refused its credentials: it needs {wants}; give \
                 the connection credentials with that scope, or authorize it with `wor connection authorize {id}`",
                record.name
            ),
        })
    }
}

/// The documented failure of a connection that lost its authorization: it names the connection
/// and the command that authorizes it again.
fn not_authorized(connection: &str, id: ConnectionId, reason: LostAuthorization) -> EngineError {
    OAuthRefusal::NotAuthorized {
        connection: connection.to_owned(),
        id,
        reason,
    }
    .into()
}

/// How an MCP session of an authorized connection replaces an access token its server refused.
pub(crate) struct OAuthRenewal {
    pub(crate) engine: Engine,
    pub(crate) project: ProjectId,
    pub(crate) id: ConnectionId,
    pub(crate) connection: String,
}

impl wor_tools::BearerRenewal for OAuthRenewal {
    fn renew<'a>(
        &'a self,
        rejected: &'a SecretString,
    ) -> std::pin::Pin<
        Box<
            dyn std::future::Future<Output = Result<SecretString, wor_tools::BearerRenewalError>>
                + Send
                + 'a,
        >,
    > {
        Box::pin(async move {
            self.engine
                .oauth_access_token_after_rejection(
                    self.project,
                    self.id,
                    &self.connection,
                    rejected,
                )
                .await
                .map_err(|e| wor_tools::BearerRenewalError {
                    reason: e.to_string(),
                })
        })
    }

    fn refused_after_renewal(&self) -> wor_tools::BearerRenewalError {
        wor_tools::BearerRenewalError {
            reason: not_authorized(
                &self.connection,
                self.id,
                LostAuthorization::RefusedAfterRefresh,
            )
            .to_string(),
        }
    }
}

fn expires_at(now: i64, tokens: &TokenSet) -> Option<i64> {
    tokens.expires_in.map(|seconds| {
        now.saturating_add(i64::try_from(seconds.saturating_mul(1000)).unwrap_or(i64::MAX))
    })
}

/// The slots `slot` names for `tokens`' access token and, when there is one, refresh token,
/// each with its value.
fn token_secrets<'a>(
    slot: &impl Fn(&str) -> SecretSlot,
    tokens: &'a TokenSet,
) -> Vec<(SecretSlot, &'a str)> {
    let mut secrets = vec![(
        slot(ACCESS_TOKEN_FIELD),
        tokens.access_token.expose_secret(),
    )];
    if let Some(refresh) = &tokens.refresh_token {
        secrets.push((slot(REFRESH_TOKEN_FIELD), refresh.expose_secret()));
    }
    secrets
}
