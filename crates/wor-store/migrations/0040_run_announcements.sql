-- What a run's last transition announces (a parked run's approval request: its run webhook
-- and notifications; an ended run's memory, run webhook and the notices of the approvals it
-- left cancelled) is due by `announce_due_at` (milliseconds): set in the transaction that
-- parks or ends the run, cleared once the announcements are queued. A process that stops
-- between the two leaves it set, and a sweep queues them then; each is queued once, by its key.
ALTER TABLE runs ADD COLUMN announce_due_at BIGINT;
CREATE INDEX runs_announce_due ON runs (announce_due_at) WHERE announce_due_at IS NOT NULL;
-- An ended run's memory is appended once: the sweep looks for the run's entries first.
CREATE INDEX memory_entries_run ON memory_entries (run_id);
