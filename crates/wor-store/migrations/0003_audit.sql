-- The audit chain. Both tables are append-only: triggers (one text per backend, in
-- 0003_audit_triggers.*.sql) reject UPDATE and DELETE. Nothing but the audit writer in
-- wor-store inserts into them.
CREATE TABLE audit_entries (
    project_id      TEXT NOT NULL REFERENCES projects(id),
    seq             BIGINT NOT NULL CHECK (seq > 0),
    at              BIGINT NOT NULL,
    actor           TEXT NOT NULL,
    category        TEXT NOT NULL,
    subjects        TEXT NOT NULL,
    root_run_id     TEXT,
    parent_run_id   TEXT,
    payload_digest  TEXT NOT NULL,
    payload         TEXT NOT NULL,
    prev_hash       TEXT NOT NULL,
    hash            TEXT NOT NULL,
    PRIMARY KEY (project_id, seq)
);

CREATE TABLE audit_checkpoints (
    project_id  TEXT NOT NULL REFERENCES projects(id),
    seq         BIGINT NOT NULL,
    entry_hash  TEXT NOT NULL,
    at          BIGINT NOT NULL,
    key_id      TEXT NOT NULL,
    signature   TEXT NOT NULL,
    PRIMARY KEY (project_id, seq)
);
