-- Model connections may speak Azure OpenAI and Gemini too. SQLite cannot change a CHECK
-- constraint, so the table is rebuilt (no other table refers to it); stored values keep
-- their spelling.
CREATE TABLE model_connections_next (
    id                 TEXT PRIMARY KEY,
    project_id         TEXT NOT NULL REFERENCES projects(id),
    name               TEXT NOT NULL,
    provider           TEXT NOT NULL CHECK (provider IN ('openai_compatible', 'anthropic', 'azure_openai', 'gemini')),
    base_url           TEXT NOT NULL,
    owner_member_id    TEXT REFERENCES members(id),
    status             TEXT NOT NULL CHECK (status IN ('active', 'revoked')),
    credential_version BIGINT NOT NULL,
    created_by         TEXT,
    created_at         BIGINT NOT NULL,
    updated_at         BIGINT NOT NULL,
    UNIQUE (project_id, name)
);
INSERT INTO model_connections_next SELECT id, project_id, name, provider, base_url,
    owner_member_id, status, credential_version, created_by, created_at, updated_at
    FROM model_connections;
DROP TABLE model_connections;
ALTER TABLE model_connections_next RENAME TO model_connections;
