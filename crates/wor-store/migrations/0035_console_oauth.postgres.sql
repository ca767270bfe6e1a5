-- A member signed in to the console authorizes a connection with no API key: the key of a
-- pending authorization, and of the one a connection settled on, is NULL when it was started
-- in the console (whose callback sends the person back there).
ALTER TABLE oauth_authorizations ALTER COLUMN api_key_id DROP NOT NULL;
ALTER TABLE tool_connection_oauth ALTER COLUMN authorized_key_id DROP NOT NULL;
