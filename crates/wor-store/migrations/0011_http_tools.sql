-- The tools of an `http_api` connection, as configured (name, description, method, path
-- template, input schema): its "live" tool list, pinned like any other.
ALTER TABLE tool_connections ADD COLUMN http_tools TEXT;
