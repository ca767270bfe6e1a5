-- Single-use sign-in links: a link bound to one member that opens a console session without a
-- password, used once and within minutes (`wor demo` prints one for its approver). Stored as
-- the SHA-256 digest of the token only.
CREATE TABLE member_sign_in_links (
    sha256     TEXT PRIMARY KEY,
    project_id TEXT NOT NULL REFERENCES projects(id),
    member_id  TEXT NOT NULL REFERENCES members(id),
    created_at BIGINT NOT NULL,
    expires_at BIGINT NOT NULL,
    used_at    BIGINT
);
