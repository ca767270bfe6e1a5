-- Approvals: a durable request for a person's decision on one exact tool call. The binding
-- hash covers run, call, pinned tool definition hash and canonical arguments; an approval is
-- used at most once (`used_at`), and only for a call whose binding hash matches.
CREATE TABLE approvals (
    id                 TEXT PRIMARY KEY,
    project_id         TEXT NOT NULL REFERENCES projects(id),
    run_id             TEXT NOT NULL REFERENCES runs(id),
    call_id            TEXT NOT NULL,
    tool               TEXT NOT NULL,
    pin_hash           TEXT NOT NULL,
    arguments          TEXT NOT NULL,
    arguments_hash     TEXT NOT NULL,
    pinned_keys        TEXT NOT NULL,
    binding_hash       TEXT NOT NULL,
    kind               TEXT NOT NULL CHECK (kind IN ('policy', 'outcome_unknown')),
    why                TEXT NOT NULL,
    status             TEXT NOT NULL CHECK (status IN ('pending', 'approved', 'denied', 'expired', 'cancelled')),
    requested_at       BIGINT NOT NULL,
    expires_at         BIGINT NOT NULL,
    decided_by_key     TEXT,
    decided_by_member  TEXT,
    decision_reason    TEXT,
    decided_at         BIGINT,
    used_at            BIGINT,
    UNIQUE (run_id, call_id, kind)
);
CREATE INDEX approvals_project ON approvals (project_id, status, id);
CREATE INDEX approvals_expiry ON approvals (status, expires_at);

-- A project's own Cedar policy, replacing the built-in default when set.
CREATE TABLE project_policies (
    project_id  TEXT PRIMARY KEY REFERENCES projects(id),
    text        TEXT NOT NULL,
    updated_by  TEXT,
    updated_at  BIGINT NOT NULL
);
