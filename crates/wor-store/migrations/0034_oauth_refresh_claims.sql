-- A connection's token refresh is done by one process at a time. With refresh-token rotation a
-- second refresh with the same token is refused, and an authorization server that detects the
-- reuse may revoke the whole grant. A process claims the refresh until `refreshing_until`
-- (milliseconds) under a random `refresh_claim`, which only it may release; recording the refresh
-- ends the claim, and a claim whose process died lapses.
ALTER TABLE tool_connection_oauth ADD COLUMN refreshing_until BIGINT;
ALTER TABLE tool_connection_oauth ADD COLUMN refresh_claim TEXT;
