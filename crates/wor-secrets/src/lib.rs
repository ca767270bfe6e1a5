//! Secrets of Work on Repeat: the single AEAD seam, the key ring, HMAC signing and redaction.
//!
//! Everything that encrypts, decrypts, signs or redacts goes through this crate. It never logs,
//! prints or formats (through `Debug` or `Display`) any key or secret value it holds.

pub mod aead;
pub mod redaction;
pub mod webhook_signature;

pub use aead::{
    DevKeyOrigin, KeyId, KeyRing, SealedSecret, SecretBinding, SecretsError, load_dev_key,
    load_or_create_dev_key,
};
pub use redaction::{REDACTED_MARKER, RedactionError, Redactor, redact_shapes};
pub use webhook_signature::{SignatureError, StandardWebhookSecret};
