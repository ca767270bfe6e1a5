-- A start asks whether its routine is full and which of its runs is oldest: both read this
-- index, however many runs of the routine have ended or are parked.
CREATE INDEX runs_routine_active ON runs (routine_id, status, id);

-- Every process's workers hear of a queued run at once, whoever queued it: the notification
-- is sent when the transaction that queued it commits (and not at all if it rolls back).
CREATE FUNCTION wor_notify_queued() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('wor_work', '');
    RETURN NULL;
END
$$;
CREATE TRIGGER runs_queued AFTER INSERT OR UPDATE OF status ON runs
    FOR EACH ROW WHEN (NEW.status = 'queued') EXECUTE FUNCTION wor_notify_queued();
