//! Every environment variable `wor` reads, in one place.

/// Path of the TOML configuration file.
pub const CONFIG: &str = "WOR_CONFIG";
/// `production` turns on production mode.
pub const ENV: &str = "WOR_ENV";
/// Address the server listens on.
pub const LISTEN: &str = "WOR_LISTEN";
/// How many runs `wor serve` drives at once.
pub const WORKERS: &str = "WOR_WORKERS";
/// Directory of the embedded database and generated keys.
pub const DATA_DIR: &str = "WOR_DATA_DIR";
/// `postgres://…` (or `sqlite://…`) instead of the embedded database.
pub const DATABASE_URL: &str = "WOR_DATABASE_URL";
/// `1`/`true` turns on demo mode, which production refuses.
pub const DEMO: &str = "WOR_DEMO";
/// The primary encryption key: 32 bytes, base64.
pub const ENCRYPTION_KEY: &str = "WOR_ENCRYPTION_KEY";
/// Retired encryption keys, comma-separated: still open old values, never seal new ones.
pub const ENCRYPTION_KEY_RETIRED: &str = "WOR_ENCRYPTION_KEY_RETIRED";
/// The audit log's ed25519 signing key: 32 bytes, base64. Without it the key lives in
/// `audit-signing.key` in the data dir. Every process writing one database needs the same key.
pub const AUDIT_SIGNING_KEY: &str = "WOR_AUDIT_SIGNING_KEY";
/// Log level of Work on Repeat's own components (`error` … `trace`); dependencies stay at `warn`.
pub const LOG: &str = "WOR_LOG";
/// `json` (default) or `text`.
pub const LOG_FORMAT: &str = "WOR_LOG_FORMAT";
/// Base URL of the server that client subcommands talk to.
pub const SERVER: &str = "WOR_SERVER";
/// API key that client subcommands present.
pub const API_KEY: &str = "WOR_API_KEY";
/// A PEM file of certificates the client subcommands and a worker trust for the server they
/// talk to, beside the system's: a private CA, or a server's own self-signed certificate.
pub const CA_CERT: &str = "WOR_CA_CERT";
/// Directory for per-operation sandbox roots.
pub const SANDBOX_DIR: &str = "WOR_SANDBOX_DIR";
/// Where `wor sandbox exec` looks commands up (the shell's search path).
pub const PATH: &str = "PATH";
/// The control plane's run-envelope signing key: 32 bytes, base64. Without it the key lives in
/// `control-plane-signing.key` in the data dir. Every API process of one deployment needs the
/// same key, as workers pin it at enrolment.
pub const CONTROL_PLANE_SIGNING_KEY: &str = "WOR_CONTROL_PLANE_SIGNING_KEY";
/// What a `wor serve` process does: `all` (default), `api` or `scheduler`.
pub const ROLE: &str = "WOR_ROLE";
