-- Workers of a scaled-out deployment and the tokens they enrol with. Deployment-wide, not per
-- project. A token is single-use and expires; only its SHA-256 digest is stored. A worker row
-- holds the public keys the worker generated itself; its private keys never leave it.
CREATE TABLE worker_enrolment_tokens (
    id         TEXT PRIMARY KEY,
    sha256     TEXT NOT NULL UNIQUE,
    created_at BIGINT NOT NULL,
    expires_at BIGINT NOT NULL,
    used_at    BIGINT,
    worker_id  TEXT
);

CREATE TABLE workers (
    id                  TEXT PRIMARY KEY,
    name                TEXT NOT NULL,
    signing_public_key  TEXT NOT NULL UNIQUE,
    exchange_public_key TEXT NOT NULL,
    status              TEXT NOT NULL CHECK (status IN ('active', 'revoked')),
    enrolled_at         BIGINT NOT NULL,
    last_seen_at        BIGINT
);

-- Nonces of workers' signed requests, kept until their timestamp leaves the accepted window,
-- so a request replayed to any API process is refused.
CREATE TABLE worker_request_nonces (
    worker_id  TEXT NOT NULL,
    nonce      TEXT NOT NULL,
    keep_until BIGINT NOT NULL,
    PRIMARY KEY (worker_id, nonce)
);
