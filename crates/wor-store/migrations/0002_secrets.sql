-- Every secret value lives here, sealed by wor-secrets; the rows that own a secret hold none.
-- The sealing binds each ciphertext to (project_id, owner_table, owner_id, field), so a
-- ciphertext copied to another row does not decrypt.
CREATE TABLE sealed_secrets (
    project_id   TEXT NOT NULL REFERENCES projects(id),
    owner_table  TEXT NOT NULL,
    owner_id     TEXT NOT NULL,
    field        TEXT NOT NULL,
    key_id       TEXT NOT NULL,
    sealed       @BYTES@ NOT NULL,
    updated_at   BIGINT NOT NULL,
    PRIMARY KEY (project_id, owner_table, owner_id, field)
);
CREATE INDEX sealed_secrets_key ON sealed_secrets (key_id);

CREATE TABLE model_connections (
    id                 TEXT PRIMARY KEY,
    project_id         TEXT NOT NULL REFERENCES projects(id),
    name               TEXT NOT NULL,
    provider           TEXT NOT NULL CHECK (provider IN ('openai_compatible', 'anthropic')),
    base_url           TEXT NOT NULL,
    owner_member_id    TEXT REFERENCES members(id),
    status             TEXT NOT NULL CHECK (status IN ('active', 'revoked')),
    credential_version BIGINT NOT NULL,
    created_by         TEXT,
    created_at         BIGINT NOT NULL,
    updated_at         BIGINT NOT NULL,
    UNIQUE (project_id, name)
);
