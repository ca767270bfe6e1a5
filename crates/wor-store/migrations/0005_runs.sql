CREATE TABLE runs (
    id                        TEXT PRIMARY KEY,
    project_id                TEXT NOT NULL REFERENCES projects(id),
    routine_id                TEXT NOT NULL REFERENCES routines(id),
    routine_version           BIGINT NOT NULL,
    root_run_id               TEXT NOT NULL,
    parent_run_id             TEXT,
    depth                     BIGINT NOT NULL,
    status                    TEXT NOT NULL CHECK (status IN ('queued', 'running', 'waiting_for_approval',
                                  'succeeded', 'failed', 'cancelled', 'budget_exceeded', 'skipped')),
    trigger_kind              TEXT NOT NULL,
    started_by                TEXT,
    max_concurrent            BIGINT NOT NULL,
    outcome                   TEXT,
    usage_turns               BIGINT NOT NULL DEFAULT 0,
    usage_tool_calls          BIGINT NOT NULL DEFAULT 0,
    usage_input_tokens        BIGINT NOT NULL DEFAULT 0,
    usage_output_tokens       BIGINT NOT NULL DEFAULT 0,
    usage_cost_microdollars   BIGINT NOT NULL DEFAULT 0,
    cancel_requested          BIGINT NOT NULL DEFAULT 0,
    lease_owner               TEXT,
    lease_expires_at          BIGINT,
    created_at                BIGINT NOT NULL,
    started_at                BIGINT,
    finished_at               BIGINT,
    updated_at                BIGINT NOT NULL
);
CREATE INDEX runs_project ON runs (project_id, id);
CREATE INDEX runs_status ON runs (status, id);
CREATE INDEX runs_routine_status ON runs (routine_id, status);

-- Everything a run did, in order: each step is written before the next begins, so a run can
-- be resumed, and shown, from its steps alone.
CREATE TABLE run_steps (
    run_id      TEXT NOT NULL REFERENCES runs(id),
    seq         BIGINT NOT NULL,
    project_id  TEXT NOT NULL REFERENCES projects(id),
    kind        TEXT NOT NULL,
    provenance  TEXT NOT NULL,
    payload     TEXT NOT NULL,
    created_at  BIGINT NOT NULL,
    PRIMARY KEY (run_id, seq)
);
