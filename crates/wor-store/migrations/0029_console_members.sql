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

-- A run a member started from the console records that member: separation of duties keeps
-- the person who started a run from deciding its approvals, whether they used a key or a
-- session.
ALTER TABLE runs ADD COLUMN started_by_member TEXT;
