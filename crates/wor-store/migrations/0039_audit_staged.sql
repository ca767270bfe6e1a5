-- Audit events written in the transaction of the change they record, waiting for the audit
-- writer to append them to their project's chain. The writer deletes a row in the
-- transaction that appends its event, and appends only the events whose rows it deleted, so
-- each is appended once: by the caller's own append, or, after a crash between the change and
-- the append, by the writer's sweep of what was left. `event` is the event's JSON (wor-core's
-- `AuditEvent`); `id` is time-ordered, so the sweep appends in the order the changes staged.
CREATE TABLE audit_staged (
    id          TEXT PRIMARY KEY,
    project_id  TEXT NOT NULL,
    event       TEXT NOT NULL,
    created_at  BIGINT NOT NULL
);
