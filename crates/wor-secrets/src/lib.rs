//! Secrets of Work on Repeat: the single AEAD seam, the key ring, HMAC signing, the audit
//! signing key, private key files, redaction, and the keys and run envelopes of a scaled-out
//! deployment.
//!
//! Everything that encrypts, decrypts, signs or redacts goes through this crate. It never logs,
//! prints or formats (through `Debug` or `Display`) any key or secret value it holds.

pub mod aead;
pub mod audit_signing;
mod key_file;
pub mod redaction;
pub mod run_envelope;
pub mod slack_signature;
pub mod webhook_signature;
pub mod worker_keys;
pub mod worker_request;

pub use aead::{
    DEV_KEY_FILE_NAME, DevKeyOrigin, KeyId, KeyRing, SealedSecret, SecretBinding, SecretsError,
    load_dev_key, load_or_create_dev_key,
};
pub use audit_signing::{
    AUDIT_SIGNING_KEY_FILE_NAME, AuditSigningKey, parse_verifying_key, verifying_key_to_base64,
};
pub use key_file::{KeyFileOrigin, writable_by_any_user};
pub use redaction::{
    REDACTED_MARKER, RedactionError, Redactor, StreamRedactor, redact_shapes, redact_shapes_json,
};
pub use run_envelope::{
    EnvelopeClaims, EnvelopeError, EnvelopeLimits, EnvelopeOpener, OpenedEnvelope, RunSecrets,
    SealedEnvelope, ToolCredential,
};
pub use webhook_signature::{SignatureError, StandardWebhookSecret};
pub use worker_keys::{
    CONTROL_PLANE_SIGNING_KEY_FILE_NAME, ControlPlaneSigningKey, WorkerIdentity, WorkerPublicKeys,
};
pub use worker_request::{RequestToSign, WorkerRequestError, WorkerRequestHeaders};
