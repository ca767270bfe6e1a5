CREATE TABLE routines (
    id               TEXT PRIMARY KEY,
    project_id       TEXT NOT NULL REFERENCES projects(id),
    name             TEXT NOT NULL,
    current_version  BIGINT NOT NULL,
    created_at       BIGINT NOT NULL,
    updated_at       BIGINT NOT NULL,
    UNIQUE (project_id, name)
);

-- Versions are immutable: a change to a routine is a new row, and a run pins one version.
CREATE TABLE routine_versions (
    routine_id    TEXT NOT NULL REFERENCES routines(id),
    version       BIGINT NOT NULL,
    project_id    TEXT NOT NULL REFERENCES projects(id),
    source_toml   TEXT NOT NULL,
    content_hash  TEXT NOT NULL,
    created_by    TEXT,
    created_at    BIGINT NOT NULL,
    PRIMARY KEY (routine_id, version)
);
