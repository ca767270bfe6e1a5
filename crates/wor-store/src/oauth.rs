//! MCP authorization of tool connections: the authorizations members have started and not
//! finished, and what a finished one settled on.
//!
//! Nothing secret is here. The `state` of a pending authorization is kept only as its SHA-256
//! digest; its PKCE verifier is sealed in the vault under [`OAUTH_AUTHORIZATIONS_TABLE`] (owner
//! id: the digest, field [`PKCE_VERIFIER_FIELD`]). A connection's access and refresh tokens and
//! a client secret are sealed under the connection ([`ACCESS_TOKEN_FIELD`] and the others).
//! The authorization server's metadata is kept as the JSON the tool library reads it from.

use serde_json::Value;
use sqlx::Row;
use wor_core::audit::AuditEvent;
use wor_core::canonical::sha256_hex;
use wor_core::{ApiKeyId, ConnectionId, MemberId, ProjectId};

use crate::staged::StagedEvent;
use crate::{Store, StoreError, changed_one, now_millis, parse_column};

/// The vault table a pending authorization's PKCE verifier is filed under.
pub const OAUTH_AUTHORIZATIONS_TABLE: &str = "oauth_authorizations";
/// The vault field of a pending authorization's PKCE verifier.
pub const PKCE_VERIFIER_FIELD: &str = "pkce_verifier";
/// The vault field (under the connection) of its access token.
pub const ACCESS_TOKEN_FIELD: &str = "oauth:access_token";
/// The vault field (under the connection) of its refresh token.
pub const REFRESH_TOKEN_FIELD: &str = "oauth:refresh_token";
/// The vault field (under the connection) of an operator-supplied client secret.
pub const CLIENT_SECRET_FIELD: &str = "oauth:client_secret";

/// The digest a `state` value is stored and looked up by.
pub fn state_digest(state: &str) -> String {
    sha256_hex(state.as_bytes())
}

/// An authorization being started.
#[derive(Debug, Clone)]
pub struct NewOAuthAuthorization {
    pub connection_id: ConnectionId,
    /// The member who started it, and the key they used: the callback finishes it for them.
    /// No key when they started it signed in to the console, where the callback sends them
    /// back.
    pub member_id: MemberId,
    pub api_key_id: Option<ApiKeyId>,
    pub client_id: String,
    pub redirect_uri: String,
    /// The discovered metadata, as the tool library wrote it.
    pub discovery: Value,
    /// The scopes asked for, space-separated; `None`: none.
    pub scope: Option<String>,
    /// How long the person has to come back, in milliseconds.
    pub lifetime_ms: i64,
}

/// A pending authorization, as stored.
#[derive(Debug, Clone, PartialEq)]
pub struct OAuthAuthorizationRecord {
    pub state_digest: String,
    pub project_id: ProjectId,
    pub connection_id: ConnectionId,
    pub member_id: MemberId,
    /// `None`: started in the console.
    pub api_key_id: Option<ApiKeyId>,
    pub client_id: String,
    pub redirect_uri: String,
    pub discovery: Value,
    /// The scopes asked for, space-separated.
    pub scope: Option<String>,
    pub created_at: i64,
    pub expires_at: i64,
}

/// What a connection's finished authorization settled on.
#[derive(Debug, Clone, PartialEq)]
pub struct ConnectionOAuthRecord {
    pub connection_id: ConnectionId,
    pub project_id: ProjectId,
    pub client_id: String,
    pub discovery: Value,
    /// When the access token expires (milliseconds), when the server said.
    pub access_expires_at: Option<i64>,
    pub authorized_by: MemberId,
    /// The key they used (`None` in the console); a refresh is recorded as theirs.
    pub authorized_key_id: Option<ApiKeyId>,
    pub authorized_at: i64,
    pub refreshed_at: Option<i64>,
    /// The scopes the authorization asked for, widened by those the server later said a
    /// request needs (space-separated): the next authorization asks for these.
    pub scope: Option<String>,
}

fn to_json(value: &Value) -> Result<String, StoreError> {
    serde_json::to_string(value).map_err(|e| StoreError::Corrupt(format!("cannot encode: {e}")))
}

fn from_json(text: &str, column: &str) -> Result<Value, StoreError> {
    serde_json::from_str(text)
        .map_err(|e| StoreError::Corrupt(format!("column `{column}` is not json: {e}")))
}

fn optional_id(row: &sqlx::any::AnyRow, column: &str) -> Result<Option<ApiKeyId>, StoreError> {
    row.try_get::<Option<String>, _>(column)?
        .map(|text| parse_column(&text, column))
        .transpose()
}

fn authorization_from_row(row: &sqlx::any::AnyRow) -> Result<OAuthAuthorizationRecord, StoreError> {
    let text = |c: &str| -> Result<String, StoreError> { Ok(row.try_get::<String, _>(c)?) };
    Ok(OAuthAuthorizationRecord {
        state_digest: text("state_digest")?,
        project_id: parse_column(&text("project_id")?, "project_id")?,
        connection_id: parse_column(&text("connection_id")?, "connection_id")?,
        member_id: parse_column(&text("member_id")?, "member_id")?,
        api_key_id: optional_id(row, "api_key_id")?,
        client_id: text("client_id")?,
        redirect_uri: text("redirect_uri")?,
        discovery: from_json(&text("discovery")?, "discovery")?,
        scope: row.try_get("scope")?,
        created_at: row.try_get("created_at")?,
        expires_at: row.try_get("expires_at")?,
    })
}

fn connection_oauth_from_row(row: &sqlx::any::AnyRow) -> Result<ConnectionOAuthRecord, StoreError> {
    let text = |c: &str| -> Result<String, StoreError> { Ok(row.try_get::<String, _>(c)?) };
    Ok(ConnectionOAuthRecord {
        connection_id: parse_column(&text("connection_id")?, "connection_id")?,
        project_id: parse_column(&text("project_id")?, "project_id")?,
        client_id: text("client_id")?,
        discovery: from_json(&text("discovery")?, "discovery")?,
        access_expires_at: row.try_get("access_expires_at")?,
        authorized_by: parse_column(&text("authorized_by")?, "authorized_by")?,
        authorized_key_id: optional_id(row, "authorized_key_id")?,
        authorized_at: row.try_get("authorized_at")?,
        refreshed_at: row.try_get("refreshed_at")?,
        scope: row.try_get("scope")?,
    })
}

const AUTHORIZATION_COLUMNS: &str = "state_digest, project_id, connection_id, member_id, \
    api_key_id, client_id, redirect_uri, discovery, scope, created_at, expires_at";
const CONNECTION_COLUMNS: &str = "connection_id, project_id, client_id, discovery, \
    access_expires_at, authorized_by, authorized_key_id, authorized_at, refreshed_at, scope";

impl Store {
    /// Records a pending authorization under the digest of `state`.
    pub async fn create_oauth_authorization(
        &self,
        project: ProjectId,
        state: &str,
        new: NewOAuthAuthorization,
    ) -> Result<OAuthAuthorizationRecord, StoreError> {
        let now = now_millis();
        let record = OAuthAuthorizationRecord {
            state_digest: state_digest(state),
            project_id: project,
            connection_id: new.connection_id,
            member_id: new.member_id,
            api_key_id: new.api_key_id,
            client_id: new.client_id,
            redirect_uri: new.redirect_uri,
            discovery: new.discovery,
            scope: new.scope,
            created_at: now,
            expires_at: now.saturating_add(new.lifetime_ms),
        };
        sqlx::query(
            "INSERT INTO oauth_authorizations (state_digest, project_id, connection_id, member_id, \
             api_key_id, client_id, redirect_uri, discovery, scope, created_at, expires_at, used_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, NULL)",
        )
        .bind(&record.state_digest)
        .bind(project.to_string())
        .bind(record.connection_id.to_string())
        .bind(record.member_id.to_string())
        .bind(record.api_key_id.map(|key| key.to_string()))
        .bind(&record.client_id)
        .bind(&record.redirect_uri)
        .bind(to_json(&record.discovery)?)
        .bind(record.scope.as_deref())
        .bind(record.created_at)
        .bind(record.expires_at)
        .execute(&*self.write_pool().await?)
        .await?;
        Ok(record)
    }

    /// Takes the pending authorization `state` names, once, for `member`, who started it:
    /// `None` when it is unknown, was taken before, has expired or is another member's.
    pub async fn take_oauth_authorization(
        &self,
        state: &str,
        member: MemberId,
    ) -> Result<Option<OAuthAuthorizationRecord>, StoreError> {
        let row = sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE oauth_authorizations SET used_at = $1 WHERE state_digest = $2 \
             AND member_id = $3 AND used_at IS NULL AND expires_at > $1 \
             RETURNING {AUTHORIZATION_COLUMNS}"
        )))
        .bind(now_millis())
        .bind(state_digest(state))
        .bind(member.to_string())
        .fetch_optional(&*self.write_pool().await?)
        .await?;
        row.as_ref().map(authorization_from_row).transpose()
    }

    /// The pending authorization `state` names while it can still be finished (not taken,
    /// not expired), left as it is.
    pub async fn pending_oauth_authorization(
        &self,
        state: &str,
    ) -> Result<Option<OAuthAuthorizationRecord>, StoreError> {
        let row = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {AUTHORIZATION_COLUMNS} FROM oauth_authorizations WHERE state_digest = $1 \
             AND used_at IS NULL AND expires_at > $2"
        )))
        .bind(state_digest(state))
        .bind(now_millis())
        .fetch_optional(self.pool())
        .await?;
        row.as_ref().map(authorization_from_row).transpose()
    }

    /// The state digests of `project`'s pending authorizations that were taken or expired at
    /// or before `before` (a time far enough back that no finish is still reading one), oldest
    /// first, at most `limit`.
    pub async fn lapsed_oauth_authorizations(
        &self,
        project: ProjectId,
        before: i64,
        limit: i64,
    ) -> Result<Vec<String>, StoreError> {
        let rows = sqlx::query(
            "SELECT state_digest FROM oauth_authorizations WHERE project_id = $1 \
             AND (used_at <= $2 OR expires_at <= $2) ORDER BY created_at LIMIT $3",
        )
        .bind(project.to_string())
        .bind(before)
        .bind(limit)
        .fetch_all(self.pool())
        .await?;
        rows.iter()
            .map(|row| {
                row.try_get::<String, _>("state_digest")
                    .map_err(StoreError::from)
            })
            .collect()
    }

    /// Deletes a pending authorization (its sealed secrets are the vault's to delete first).
    pub async fn delete_oauth_authorization(
        &self,
        project: ProjectId,
        state_digest: &str,
    ) -> Result<(), StoreError> {
        sqlx::query("DELETE FROM oauth_authorizations WHERE project_id = $1 AND state_digest = $2")
            .bind(project.to_string())
            .bind(state_digest)
            .execute(&*self.write_pool().await?)
            .await?;
        Ok(())
    }

    /// Records (or replaces) what a connection's authorization settled on.
    pub async fn put_connection_oauth(
        &self,
        record: &ConnectionOAuthRecord,
    ) -> Result<(), StoreError> {
        self.put_connection_oauth_staged(record, &[], None).await?;
        Ok(())
    }

    /// [`Self::put_connection_oauth`], writing `secrets` (the authorization's tokens and client
    /// secret, sealed for their slots) and staging `recorded`, when given, its
    /// `connection.authorize` entry, in the same transaction (`crate::staged`).
    pub async fn put_connection_oauth_staged(
        &self,
        record: &ConnectionOAuthRecord,
        secrets: &[crate::SealedPut],
        recorded: Option<AuditEvent>,
    ) -> Result<Option<StagedEvent>, StoreError> {
        crate::vault::check_owners(
            secrets,
            record.project_id,
            crate::TOOL_CONNECTIONS_TABLE,
            record.connection_id,
        )?;
        let mut tx = self.begin_write().await?;
        let now = now_millis();
        crate::vault::write_sealed(&mut tx, secrets, now).await?;
        sqlx::query(
            "DELETE FROM tool_connection_oauth WHERE project_id = $1 AND connection_id = $2",
        )
        .bind(record.project_id.to_string())
        .bind(record.connection_id.to_string())
        .execute(&mut **tx)
        .await?;
        sqlx::query(
            "INSERT INTO tool_connection_oauth (connection_id, project_id, client_id, discovery, \
             access_expires_at, authorized_by, authorized_key_id, authorized_at, refreshed_at, \
             scope) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
        )
        .bind(record.connection_id.to_string())
        .bind(record.project_id.to_string())
        .bind(&record.client_id)
        .bind(to_json(&record.discovery)?)
        .bind(record.access_expires_at)
        .bind(record.authorized_by.to_string())
        .bind(record.authorized_key_id.map(|key| key.to_string()))
        .bind(record.authorized_at)
        .bind(record.refreshed_at)
        .bind(record.scope.as_deref())
        .execute(&mut **tx)
        .await?;
        let staged = crate::staged::stage_some(&mut tx, recorded).await?;
        tx.commit().await?;
        Ok(staged)
    }

    /// Claims the connection's token refresh for this process until `until` (milliseconds),
    /// unless another process holds a claim that has not lapsed: the claim's id when this one
    /// holds it, `None` otherwise.
    pub async fn claim_connection_oauth_refresh(
        &self,
        project: ProjectId,
        connection: ConnectionId,
        until: i64,
    ) -> Result<Option<String>, StoreError> {
        let claim = wor_core::ids::request_id();
        let done = sqlx::query(
            "UPDATE tool_connection_oauth SET refreshing_until = $1, refresh_claim = $2 \
             WHERE project_id = $3 AND connection_id = $4 \
             AND (refreshing_until IS NULL OR refreshing_until < $5)",
        )
        .bind(until)
        .bind(&claim)
        .bind(project.to_string())
        .bind(connection.to_string())
        .bind(now_millis())
        .execute(&*self.write_pool().await?)
        .await?;
        Ok((done.rows_affected() == 1).then_some(claim))
    }

    /// Ends refresh claim `claim` without a refresh recorded (it failed); a claim another
    /// process took after this one lapsed is left alone.
    pub async fn release_connection_oauth_refresh(
        &self,
        project: ProjectId,
        connection: ConnectionId,
        claim: &str,
    ) -> Result<(), StoreError> {
        sqlx::query(
            "UPDATE tool_connection_oauth SET refreshing_until = NULL, refresh_claim = NULL \
             WHERE project_id = $1 AND connection_id = $2 AND refresh_claim = $3",
        )
        .bind(project.to_string())
        .bind(connection.to_string())
        .bind(claim)
        .execute(&*self.write_pool().await?)
        .await?;
        Ok(())
    }

    /// Records a refresh: the new expiry and when it happened; the refresh claim ends.
    pub async fn record_connection_oauth_refresh(
        &self,
        project: ProjectId,
        connection: ConnectionId,
        access_expires_at: Option<i64>,
    ) -> Result<(), StoreError> {
        let done = sqlx::query(
            "UPDATE tool_connection_oauth SET access_expires_at = $1, refreshed_at = $2, \
             refreshing_until = NULL, refresh_claim = NULL \
             WHERE project_id = $3 AND connection_id = $4",
        )
        .bind(access_expires_at)
        .bind(now_millis())
        .bind(project.to_string())
        .bind(connection.to_string())
        .execute(&*self.write_pool().await?)
        .await?;
        changed_one(&done)
    }

    /// Marks the connection's access token expired, so the next caller refreshes it: the
    /// server refused it before its recorded expiry.
    pub async fn expire_connection_oauth_access(
        &self,
        project: ProjectId,
        connection: ConnectionId,
    ) -> Result<(), StoreError> {
        let done = sqlx::query(
            "UPDATE tool_connection_oauth SET access_expires_at = 0 \
             WHERE project_id = $1 AND connection_id = $2",
        )
        .bind(project.to_string())
        .bind(connection.to_string())
        .execute(&*self.write_pool().await?)
        .await?;
        changed_one(&done)
    }

    /// Records the scopes the connection's next authorization asks for (the ones it has, widened
    /// by what its server said a request needs).
    pub async fn set_connection_oauth_scope(
        &self,
        project: ProjectId,
        connection: ConnectionId,
        scope: &str,
    ) -> Result<(), StoreError> {
        let done = sqlx::query(
            "UPDATE tool_connection_oauth SET scope = $1 WHERE project_id = $2 AND connection_id = $3",
        )
        .bind(scope)
        .bind(project.to_string())
        .bind(connection.to_string())
        .execute(&*self.write_pool().await?)
        .await?;
        if done.rows_affected() == 0 {
            return Err(StoreError::NotFound);
        }
        Ok(())
    }

    /// What a connection's authorization settled on, `None` when it was never authorized.
    pub async fn get_connection_oauth(
        &self,
        project: ProjectId,
        connection: ConnectionId,
    ) -> Result<Option<ConnectionOAuthRecord>, StoreError> {
        let row = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {CONNECTION_COLUMNS} FROM tool_connection_oauth \
             WHERE project_id = $1 AND connection_id = $2"
        )))
        .bind(project.to_string())
        .bind(connection.to_string())
        .fetch_optional(self.pool())
        .await?;
        row.as_ref().map(connection_oauth_from_row).transpose()
    }
}
