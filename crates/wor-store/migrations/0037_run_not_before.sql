-- A scheduled run may be recorded a few seconds ahead of its slot, so that a slot shared by
-- many routines has all its rows written when it comes. No worker claims such a run before
-- `not_before` (milliseconds): the slot's time plus its jitter. NULL: claimable at once.
ALTER TABLE runs ADD COLUMN not_before BIGINT;
