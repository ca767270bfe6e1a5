-- A call whose approved retry was interrupted too is asked about again: a call may have
-- several approvals of one kind over time, but at most one not yet used. SQLite cannot drop
-- a table's UNIQUE constraint, so the table is rebuilt (no other table refers to it).
CREATE TABLE approvals_next (
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
    used_at            BIGINT
);
INSERT INTO approvals_next SELECT id, project_id, run_id, call_id, tool, pin_hash, arguments,
    arguments_hash, pinned_keys, binding_hash, kind, why, status, requested_at, expires_at,
    decided_by_key, decided_by_member, decision_reason, decided_at, used_at FROM approvals;
DROP TABLE approvals;
ALTER TABLE approvals_next RENAME TO approvals;
CREATE INDEX approvals_project ON approvals (project_id, status, id);
CREATE INDEX approvals_expiry ON approvals (status, expires_at);
CREATE INDEX approvals_call ON approvals (run_id, call_id, kind, id);
CREATE UNIQUE INDEX approvals_unused_per_call ON approvals (run_id, call_id, kind) WHERE used_at IS NULL;
