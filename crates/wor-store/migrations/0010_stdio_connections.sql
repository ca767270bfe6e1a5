-- How a `mcp_stdio` connection's server is started in the sandbox: program, arguments,
-- read-only paths and the names of its environment variables (their values are sealed in the
-- vault as `env:NAME`).
ALTER TABLE tool_connections ADD COLUMN command TEXT;
