-- MCP authorization (OAuth 2.1 with PKCE) of tool connections.
--
-- `oauth_authorizations`: an authorization a member started and has not finished. The `state`
-- sent to the authorization server is kept only as its SHA-256 digest; the PKCE verifier is
-- sealed in the vault (owner table `oauth_authorizations`, owner id = the digest). A row is
-- taken once (`used_at`), and only before `expires_at`.
CREATE TABLE oauth_authorizations (
    state_digest   TEXT PRIMARY KEY,
    project_id     TEXT NOT NULL REFERENCES projects(id),
    connection_id  TEXT NOT NULL REFERENCES tool_connections(id),
    member_id      TEXT NOT NULL,
    api_key_id     TEXT NOT NULL,
    client_id      TEXT NOT NULL,
    redirect_uri   TEXT NOT NULL,
    discovery      TEXT NOT NULL,
    created_at     BIGINT NOT NULL,
    expires_at     BIGINT NOT NULL,
    used_at        BIGINT
);
CREATE INDEX oauth_authorizations_connection ON oauth_authorizations (project_id, connection_id);

-- `tool_connection_oauth`: what a connection's authorization settled on, without secrets. The
-- access and refresh tokens and a client secret live in the vault under the connection.
CREATE TABLE tool_connection_oauth (
    connection_id     TEXT PRIMARY KEY REFERENCES tool_connections(id),
    project_id        TEXT NOT NULL REFERENCES projects(id),
    client_id         TEXT NOT NULL,
    discovery         TEXT NOT NULL,
    access_expires_at BIGINT,
    authorized_by     TEXT NOT NULL,
    authorized_key_id TEXT NOT NULL,
    authorized_at     BIGINT NOT NULL,
    refreshed_at      BIGINT
);
