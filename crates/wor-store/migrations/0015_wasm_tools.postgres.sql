-- Wasm tool connections: `kind` may be `wasm`.
ALTER TABLE tool_connections DROP CONSTRAINT tool_connections_kind_check;
ALTER TABLE tool_connections ADD CONSTRAINT tool_connections_kind_check
    CHECK (kind IN ('mcp_http', 'mcp_stdio', 'http_api', 'wasm'));
