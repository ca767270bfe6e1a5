-- Notification routes: where a project's approval requests are sent (a Slack channel or email
-- addresses), optionally only those of one routine, one tool or one determining policy. Their
-- secrets (Slack bot token and signing secret, SMTP password) live in the vault, never here.
CREATE TABLE notification_routes (
    id             TEXT PRIMARY KEY,
    project_id     TEXT NOT NULL REFERENCES projects(id),
    name           TEXT NOT NULL,
    kind           TEXT NOT NULL CHECK (kind IN ('slack', 'email')),
    routine_id     TEXT REFERENCES routines(id),
    tool           TEXT,
    policy         TEXT,
    target         TEXT NOT NULL,
    settings       TEXT NOT NULL,
    created_by     TEXT,
    created_at     BIGINT NOT NULL,
    UNIQUE (project_id, name)
);
CREATE INDEX notification_routes_project ON notification_routes (project_id, id);

-- The outbox of notifications: one row per message to post or update, with its attempts. What
-- a message says is rendered from the approval when it is sent, so a late attempt shows the
-- approval as it stands. `event_key` makes enqueueing the same event twice a no-op.
CREATE TABLE notification_deliveries (
    id               TEXT PRIMARY KEY,
    project_id       TEXT NOT NULL REFERENCES projects(id),
    route_id         TEXT NOT NULL,
    approval_id      TEXT NOT NULL REFERENCES approvals(id),
    action           TEXT NOT NULL CHECK (action IN ('slack.post', 'slack.update', 'email.send')),
    event_key        TEXT NOT NULL,
    note             TEXT,
    status           TEXT NOT NULL CHECK (status IN ('pending', 'delivered', 'failed')),
    attempts         BIGINT NOT NULL DEFAULT 0,
    next_attempt_at  BIGINT NOT NULL,
    last_status_code BIGINT,
    last_error       TEXT,
    created_at       BIGINT NOT NULL,
    updated_at       BIGINT NOT NULL,
    UNIQUE (route_id, approval_id, event_key)
);
CREATE INDEX notification_deliveries_due ON notification_deliveries (status, next_attempt_at);
CREATE INDEX notification_deliveries_project ON notification_deliveries (project_id, id);

-- The Slack messages posted about an approval, so every one of them can be updated.
CREATE TABLE slack_messages (
    approval_id  TEXT NOT NULL REFERENCES approvals(id),
    route_id     TEXT NOT NULL,
    project_id   TEXT NOT NULL REFERENCES projects(id),
    channel      TEXT NOT NULL,
    ts           TEXT NOT NULL,
    posted_at    BIGINT NOT NULL,
    PRIMARY KEY (approval_id, route_id)
);

-- Which member a Slack user is, linked by that member from a signed-in console session.
CREATE TABLE slack_identities (
    project_id     TEXT NOT NULL REFERENCES projects(id),
    team_id        TEXT NOT NULL,
    slack_user_id  TEXT NOT NULL,
    member_id      TEXT NOT NULL REFERENCES members(id),
    linked_at      BIGINT NOT NULL,
    PRIMARY KEY (project_id, team_id, slack_user_id)
);

-- Single-use links, handed to a Slack user the server has just verified, that a signed-in
-- member opens to link that Slack identity (SHA-256 of the token only).
CREATE TABLE slack_link_tokens (
    sha256         TEXT PRIMARY KEY,
    project_id     TEXT NOT NULL REFERENCES projects(id),
    team_id        TEXT NOT NULL,
    slack_user_id  TEXT NOT NULL,
    created_at     BIGINT NOT NULL,
    expires_at     BIGINT NOT NULL,
    used_at        BIGINT
);

-- Slack interactions already acted on (by `trigger_id`), so a replay inside the signature's
-- window does nothing.
CREATE TABLE slack_interactions (
    route_id     TEXT NOT NULL,
    trigger_id   TEXT NOT NULL,
    received_at  BIGINT NOT NULL,
    PRIMARY KEY (route_id, trigger_id)
);
