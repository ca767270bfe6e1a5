-- The web console's sign-in: a member's password (an argon2id PHC string, never the password),
-- single-use invitations and server-side sessions (both stored as SHA-256 digests of their
-- tokens only), and the recent failed sign-ins that lock an account or an address out.
CREATE TABLE member_passwords (
    member_id  TEXT PRIMARY KEY REFERENCES members(id),
    project_id TEXT NOT NULL REFERENCES projects(id),
    phc        TEXT NOT NULL,
    set_at     BIGINT NOT NULL
);

CREATE TABLE member_invitations (
    sha256     TEXT PRIMARY KEY,
    project_id TEXT NOT NULL REFERENCES projects(id),
    member_id  TEXT NOT NULL REFERENCES members(id),
    created_by TEXT,
    created_at BIGINT NOT NULL,
    expires_at BIGINT NOT NULL,
    used_at    BIGINT
);

CREATE TABLE console_sessions (
    sha256       TEXT PRIMARY KEY,
    project_id   TEXT NOT NULL REFERENCES projects(id),
    member_id    TEXT NOT NULL REFERENCES members(id),
    csrf_token   TEXT NOT NULL,
    created_at   BIGINT NOT NULL,
    last_seen_at BIGINT NOT NULL,
    expires_at   BIGINT NOT NULL
);
CREATE INDEX console_sessions_member ON console_sessions (project_id, member_id);

CREATE TABLE sign_in_failures (
    scope TEXT NOT NULL,
    at    BIGINT NOT NULL
);
CREATE INDEX sign_in_failures_scope ON sign_in_failures (scope, at);
