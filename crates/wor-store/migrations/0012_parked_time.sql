-- Time a run spends parked (waiting for a person) is not its wall time: `parked_at` is set
-- when it parks, and the span is added to `parked_ms` when a worker claims it again.
ALTER TABLE runs ADD COLUMN parked_at BIGINT;
ALTER TABLE runs ADD COLUMN parked_ms BIGINT NOT NULL DEFAULT 0;
