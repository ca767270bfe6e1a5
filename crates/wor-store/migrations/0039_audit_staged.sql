-- Audit events written in the transaction of the change they record, waiting for the audit
-- writer to append them to their project's chain. The writer deletes a row in the
-- transaction that appends its event, and appends only the events whose rows it deleted, so
-- each is appended once: by the caller's own append, or, after a crash between the change and
-- the append, by the writer's sweep of what was left. `event` is the event's JSON (wor-core's
-- `AuditEvent`); `id` is time-ordered (by the clock of the host that staged it), so a sweep
-- appends in about the order the changes staged. A sweep takes only rows older than its grace
-- (`created_at`, milliseconds), leaving a live request's row to that request.
CREATE TABLE audit_staged (
    id          TEXT PRIMARY KEY,
    project_id  TEXT NOT NULL,
    event       TEXT NOT NULL,
    created_at  BIGINT NOT NULL
);
