-- A call whose approved retry was interrupted too is asked about again: a call may have
-- several approvals of one kind over time, but at most one not yet used.
ALTER TABLE approvals DROP CONSTRAINT approvals_run_id_call_id_kind_key;
CREATE INDEX approvals_call ON approvals (run_id, call_id, kind, id);
CREATE UNIQUE INDEX approvals_unused_per_call ON approvals (run_id, call_id, kind) WHERE used_at IS NULL;
