-- The scopes of a connection's MCP authorization. `oauth_authorizations.scope`: what a pending
-- authorization asked for. `tool_connection_oauth.scope`: what the connection's authorization
-- asked for, widened by each scope its server later said a request needs (a `403` with
-- `insufficient_scope`), so the next authorization asks for all of them. Space-separated
-- scope tokens; NULL: none asked for.
ALTER TABLE oauth_authorizations ADD COLUMN scope TEXT;
ALTER TABLE tool_connection_oauth ADD COLUMN scope TEXT;
