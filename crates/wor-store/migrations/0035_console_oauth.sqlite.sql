-- A member signed in to the console authorizes a connection with no API key: the key of a
-- pending authorization, and of the one a connection settled on, is NULL when it was started
-- in the console (whose callback sends the person back there). SQLite cannot drop a NOT NULL,
-- so both tables are copied into new ones.
CREATE TABLE oauth_authorizations_next (
    state_digest   TEXT PRIMARY KEY,
    project_id     TEXT NOT NULL REFERENCES projects(id),
    connection_id  TEXT NOT NULL REFERENCES tool_connections(id),
    member_id      TEXT NOT NULL,
    api_key_id     TEXT,
    client_id      TEXT NOT NULL,
    redirect_uri   TEXT NOT NULL,
    discovery      TEXT NOT NULL,
    created_at     BIGINT NOT NULL,
    expires_at     BIGINT NOT NULL,
    used_at        BIGINT
);
INSERT INTO oauth_authorizations_next (state_digest, project_id, connection_id, member_id,
    api_key_id, client_id, redirect_uri, discovery, created_at, expires_at, used_at)
SELECT state_digest, project_id, connection_id, member_id, api_key_id, client_id, redirect_uri,
    discovery, created_at, expires_at, used_at FROM oauth_authorizations;
DROP TABLE oauth_authorizations;
ALTER TABLE oauth_authorizations_next RENAME TO oauth_authorizations;
CREATE INDEX oauth_authorizations_connection ON oauth_authorizations (project_id, connection_id);

CREATE TABLE tool_connection_oauth_next (
    connection_id     TEXT PRIMARY KEY REFERENCES tool_connections(id),
    project_id        TEXT NOT NULL REFERENCES projects(id),
    client_id         TEXT NOT NULL,
    discovery         TEXT NOT NULL,
    access_expires_at BIGINT,
    authorized_by     TEXT NOT NULL,
    authorized_key_id TEXT,
    authorized_at     BIGINT NOT NULL,
    refreshed_at      BIGINT,
    refreshing_until  BIGINT,
    refresh_claim     TEXT
);
INSERT INTO tool_connection_oauth_next (connection_id, project_id, client_id, discovery,
    access_expires_at, authorized_by, authorized_key_id, authorized_at, refreshed_at,
    refreshing_until, refresh_claim)
SELECT connection_id, project_id, client_id, discovery, access_expires_at, authorized_by,
    authorized_key_id, authorized_at, refreshed_at, refreshing_until, refresh_claim
FROM tool_connection_oauth;
DROP TABLE tool_connection_oauth;
ALTER TABLE tool_connection_oauth_next RENAME TO tool_connection_oauth;
