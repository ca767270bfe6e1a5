-- Tool connections: MCP servers and HTTP APIs a routine's roster names. Credentials live in
-- `sealed_secrets` (owner table `tool_connections`); only their header names are kept here.
-- `pinned_tools` maps tool name to {definition, hash}; `live_tools` is the list last seen.
CREATE TABLE tool_connections (
    id                   TEXT PRIMARY KEY,
    project_id           TEXT NOT NULL REFERENCES projects(id),
    name                 TEXT NOT NULL,
    kind                 TEXT NOT NULL CHECK (kind IN ('mcp_http', 'mcp_stdio', 'http_api')),
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
    UNIQUE (project_id, name)
);
CREATE INDEX tool_connections_project ON tool_connections (project_id, id);
