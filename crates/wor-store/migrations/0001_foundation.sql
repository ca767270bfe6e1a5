CREATE TABLE projects (
    id          TEXT PRIMARY KEY,
    name        TEXT NOT NULL UNIQUE,
    created_at  BIGINT NOT NULL
);

CREATE TABLE members (
    id          TEXT PRIMARY KEY,
    project_id  TEXT NOT NULL REFERENCES projects(id),
    name        TEXT NOT NULL,
    role        TEXT NOT NULL CHECK (role IN ('owner', 'admin', 'approver', 'viewer')),
    created_at  BIGINT NOT NULL,
    UNIQUE (project_id, name)
);

CREATE TABLE api_keys (
    id           TEXT PRIMARY KEY,
    project_id   TEXT NOT NULL REFERENCES projects(id),
    member_id    TEXT REFERENCES members(id),
    kind         TEXT NOT NULL CHECK (kind IN ('personal', 'service')),
    name         TEXT NOT NULL,
    role         TEXT NOT NULL CHECK (role IN ('owner', 'admin', 'approver', 'viewer')),
    prefix       TEXT NOT NULL,
    sha256       TEXT NOT NULL UNIQUE,
    created_at   BIGINT NOT NULL,
    created_by   TEXT,
    last_used_at BIGINT,
    revoked_at   BIGINT,
    CHECK ((kind = 'personal') = (member_id IS NOT NULL))
);
CREATE INDEX api_keys_project ON api_keys (project_id, id);
