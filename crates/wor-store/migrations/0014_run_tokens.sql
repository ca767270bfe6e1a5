-- The credential of a run while a worker drives it: stored as a SHA-256 digest only, one per
-- run, bound to the claim it was minted under (`lease_owner`), expiring at the run's deadline.
-- Parking, ending or claiming the run again deletes it.
CREATE TABLE run_tokens (
    run_id     TEXT PRIMARY KEY REFERENCES runs(id),
    project_id TEXT NOT NULL REFERENCES projects(id),
    sha256     TEXT NOT NULL UNIQUE,
    lease_owner TEXT NOT NULL,
    expires_at BIGINT NOT NULL,
    created_at BIGINT NOT NULL
);
