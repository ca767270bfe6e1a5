-- What started a run, when it must start only once: `slot:<unix ms>` for a schedule slot,
-- `delivery:<id>` for an inbound webhook delivery. The unique index makes a second start of
-- the same slot or delivery fail, whichever process tries it.
ALTER TABLE runs ADD COLUMN trigger_key TEXT;
CREATE UNIQUE INDEX runs_trigger_key ON runs (routine_id, trigger_key);

-- The schedule of each scheduled routine's current version and its first unhandled slot.
CREATE TABLE routine_schedules (
    routine_id    TEXT PRIMARY KEY REFERENCES routines(id),
    project_id    TEXT NOT NULL REFERENCES projects(id),
    schedule      TEXT NOT NULL,
    next_slot_at  BIGINT,
    updated_at    BIGINT NOT NULL
);
CREATE INDEX routine_schedules_due ON routine_schedules (next_slot_at);

-- Run webhooks: one row per event to deliver, with its attempts. The body is stored as sent
-- (redacted); the signature is computed at each attempt. `event_key` makes enqueueing the same
-- event twice (a worker that retries) a no-op.
CREATE TABLE webhook_deliveries (
    id                TEXT PRIMARY KEY,
    project_id        TEXT NOT NULL REFERENCES projects(id),
    routine_id        TEXT NOT NULL REFERENCES routines(id),
    run_id            TEXT NOT NULL REFERENCES runs(id),
    event             TEXT NOT NULL,
    event_key         TEXT NOT NULL,
    url               TEXT NOT NULL,
    body              TEXT NOT NULL,
    status            TEXT NOT NULL CHECK (status IN ('pending', 'delivered', 'failed')),
    attempts          BIGINT NOT NULL DEFAULT 0,
    next_attempt_at   BIGINT NOT NULL,
    last_status_code  BIGINT,
    last_error        TEXT,
    created_at        BIGINT NOT NULL,
    updated_at        BIGINT NOT NULL,
    UNIQUE (run_id, event_key)
);
CREATE INDEX webhook_deliveries_due ON webhook_deliveries (status, next_attempt_at);
CREATE INDEX webhook_deliveries_project ON webhook_deliveries (project_id, id);
