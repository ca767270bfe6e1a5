-- Conversation memory, opt-in per routine, scoped to project, routine and thread. Each entry
-- keeps the provenance label it had: text that came from (or was influenced by) untrusted
-- content stays `untrusted` forever.
ALTER TABLE runs ADD COLUMN thread TEXT;

CREATE TABLE memory_entries (
    id          TEXT PRIMARY KEY,
    project_id  TEXT NOT NULL REFERENCES projects(id),
    routine_id  TEXT NOT NULL REFERENCES routines(id),
    thread      TEXT NOT NULL,
    run_id      TEXT NOT NULL REFERENCES runs(id),
    role        TEXT NOT NULL CHECK (role IN ('requester', 'assistant')),
    provenance  TEXT NOT NULL,
    text        TEXT NOT NULL,
    created_at  BIGINT NOT NULL
);
CREATE INDEX memory_entries_thread ON memory_entries (project_id, routine_id, thread, id);
