-- The credential of a run while a worker drives it: stored as a SHA-256 digest only, one per
-- run, expiring at the run's deadline. Parking or ending the run deletes it; claiming the run
-- again mints a new one.
CREATE TABLE run_tokens (
    run_id     TEXT PRIMARY KEY REFERENCES runs(id),
    project_id TEXT NOT NULL REFERENCES projects(id),
    sha256     TEXT NOT NULL UNIQUE,
    expires_at BIGINT NOT NULL,
    created_at BIGINT NOT NULL
);
