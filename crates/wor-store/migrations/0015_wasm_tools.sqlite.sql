-- Wasm tool connections: `kind` may be `wasm`. SQLite cannot change a CHECK in place, so the
-- table is rebuilt (no other table refers to it).
CREATE TABLE tool_connections_next (
    id                   TEXT PRIMARY KEY,
    project_id           TEXT NOT NULL REFERENCES projects(id),
    name                 TEXT NOT NULL,
    kind                 TEXT NOT NULL CHECK (kind IN ('mcp_http', 'mcp_stdio', 'http_api', 'wasm')),
    url                  TEXT NOT NULL,
    allowlist            TEXT NOT NULL,
    status               TEXT NOT NULL CHECK (status IN ('pending_review', 'enabled', 'quarantined', 'disabled')),
    tool_classification  TEXT NOT NULL,
    pinned_tools         TEXT NOT NULL,
    live_tools           TEXT,
    secret_headers       TEXT NOT NULL,
    created_by           TEXT,
    created_at           BIGINT NOT NULL,
    updated_at           BIGINT NOT NULL,
    command              TEXT,
    http_tools           TEXT,
    UNIQUE (project_id, name)
);
INSERT INTO tool_connections_next (id, project_id, name, kind, url, allowlist, status,
    tool_classification, pinned_tools, live_tools, secret_headers, created_by, created_at,
    updated_at, command, http_tools)
SELECT id, project_id, name, kind, url, allowlist, status, tool_classification, pinned_tools,
    live_tools, secret_headers, created_by, created_at, updated_at, command, http_tools
FROM tool_connections;
DROP TABLE tool_connections;
ALTER TABLE tool_connections_next RENAME TO tool_connections;
CREATE INDEX tool_connections_project ON tool_connections (project_id, id);
