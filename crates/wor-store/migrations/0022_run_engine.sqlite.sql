-- A start asks whether its routine is full and which of its runs is oldest: both read this
-- index, however many runs of the routine have ended or are parked.
CREATE INDEX runs_routine_active ON runs (routine_id, status, id);
