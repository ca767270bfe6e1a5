-- Console sessions get a public id, for a member to list and end their sessions (and an admin
-- anyone's) without ever seeing a token or its digest, and the client address and browser they
-- were opened from, for the member to recognise them. Sessions opened before have neither:
-- they end, and their members sign in again.
DELETE FROM console_sessions;
ALTER TABLE console_sessions ADD COLUMN id TEXT NOT NULL DEFAULT '';
ALTER TABLE console_sessions ADD COLUMN address TEXT NOT NULL DEFAULT '';
ALTER TABLE console_sessions ADD COLUMN user_agent TEXT NOT NULL DEFAULT '';
CREATE UNIQUE INDEX console_sessions_id ON console_sessions (id);
