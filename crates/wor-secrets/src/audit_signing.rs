//! The audit log's ed25519 signing key, which signs chain checkpoints.
//!
//! The key is 32 random bytes, written as standard base64: from `WOR_AUDIT_SIGNING_KEY`, or
//! from `audit-signing.key` in the data directory, created with mode 0600 on first use. Its
//! `Debug` output shows only the public half.

use std::fmt;
use std::path::Path;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use ed25519_dalek::{Signer as _, SigningKey, VerifyingKey};
use secrecy::SecretString;
use zeroize::Zeroizing;

use crate::SecretsError;
use crate::key_file::{self, KeyFileOrigin};

/// File name of the audit signing key inside the data directory.
pub const AUDIT_SIGNING_KEY_FILE_NAME: &str = "audit-signing.key";

/// The key that signs audit checkpoints.
pub struct AuditSigningKey(SigningKey);

impl fmt::Debug for AuditSigningKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AuditSigningKey")
            .field(
                "verifying_key",
                &verifying_key_to_base64(&self.verifying_key()),
            )
            .finish_non_exhaustive()
    }
}

impl AuditSigningKey {
    /// A fresh random key, with the base64 text to persist.
    ///
    /// # Errors
    /// [`SecretsError::RandomnessUnavailable`] if the OS cannot supply random bytes.
    pub fn generate() -> Result<(Self, SecretString), SecretsError> {
        let mut seed = Zeroizing::new([0u8; 32]);
        getrandom::fill(seed.as_mut_slice()).map_err(|_| SecretsError::RandomnessUnavailable)?;
        let text = SecretString::from(STANDARD.encode(seed.as_slice()));
        Ok((Self(SigningKey::from_bytes(&seed)), text))
    }

    /// Reads a key written as base64 of its 32 secret bytes (the key itself is never echoed).
    ///
    /// # Errors
    /// [`SecretsError::InvalidAuditKey`] when the text is not base64 of 32 bytes.
    pub fn from_base64(text: &str) -> Result<Self, SecretsError> {
        let bytes = Zeroizing::new(STANDARD.decode(text.trim()).map_err(|_| {
            SecretsError::InvalidAuditKey {
                which: "signing",
                reason: "not valid standard base64",
            }
        })?);
        let seed: &[u8; 32] =
            bytes
                .as_slice()
                .try_into()
                .map_err(|_| SecretsError::InvalidAuditKey {
                    which: "signing",
                    reason: "does not decode to exactly 32 bytes",
                })?;
        Ok(Self(SigningKey::from_bytes(seed)))
    }

    /// Loads `dir/audit-signing.key`, creating it (mode 0600) if absent.
    ///
    /// # Errors
    /// As the development encryption key: I/O, loose permissions, or an invalid key.
    pub fn load_or_create(dir: &Path) -> Result<(Self, KeyFileOrigin), SecretsError> {
        key_file::load_or_create(
            dir,
            AUDIT_SIGNING_KEY_FILE_NAME,
            Self::from_base64,
            Self::generate,
        )
    }

    /// Loads `dir/audit-signing.key` if it exists; never creates it.
    ///
    /// # Errors
    /// As [`Self::load_or_create`], but for a missing file, which is `None`.
    pub fn load_existing(dir: &Path) -> Result<Option<Self>, SecretsError> {
        key_file::load_existing(dir, AUDIT_SIGNING_KEY_FILE_NAME, Self::from_base64)
    }

    /// The key from the environment value if one is set, else from (or created in) `dir`.
    ///
    /// # Errors
    /// As [`Self::from_base64`] or [`Self::load_or_create`].
    pub fn from_env_or_dir(env_value: Option<&str>, dir: &Path) -> Result<Self, SecretsError> {
        match env_value.map(str::trim).filter(|v| !v.is_empty()) {
            Some(text) => Self::from_base64(text),
            None => Self::load_or_create(dir).map(|(key, _)| key),
        }
    }

    /// The public half, which verifies checkpoints.
    pub fn verifying_key(&self) -> VerifyingKey {
        self.0.verifying_key()
    }

    /// The ed25519 signature of `message`.
    pub fn sign(&self, message: &[u8]) -> [u8; 64] {
        self.0.sign(message).to_bytes()
    }
}

/// The text form of a verifying key: standard base64 of its 32 bytes.
pub fn verifying_key_to_base64(key: &VerifyingKey) -> String {
    STANDARD.encode(key.as_bytes())
}

/// Parses the text form written by [`verifying_key_to_base64`].
///
/// # Errors
/// [`SecretsError::InvalidAuditKey`] when the text is not base64 of a valid ed25519 point.
pub fn parse_verifying_key(text: &str) -> Result<VerifyingKey, SecretsError> {
    let invalid = |reason| SecretsError::InvalidAuditKey {
        which: "verifying",
        reason,
    };
    let bytes = STANDARD
        .decode(text.trim())
        .map_err(|_| invalid("not valid standard base64"))?;
    let bytes: [u8; 32] = bytes
        .as_slice()
        .try_into()
        .map_err(|_| invalid("does not decode to exactly 32 bytes"))?;
    VerifyingKey::from_bytes(&bytes).map_err(|_| invalid("is not an ed25519 public key"))
}

#[cfg(test)]
mod tests {
    use std::fs;
    use std::os::unix::fs::PermissionsExt as _;

    use ed25519_dalek::{Signature, Verifier as _};

    use super::*;

    #[test]
    fn key_file_is_created_private_then_loaded() {
        let dir = tempfile::tempdir().unwrap();
        let (created, origin) = AuditSigningKey::load_or_create(dir.path()).unwrap();
        assert_eq!(origin, KeyFileOrigin::Created);
        let path = dir.path().join(AUDIT_SIGNING_KEY_FILE_NAME);
        assert_eq!(
            fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o600
        );
        let (loaded, origin) = AuditSigningKey::load_or_create(dir.path()).unwrap();
        assert_eq!(origin, KeyFileOrigin::Loaded);
        assert_eq!(created.verifying_key(), loaded.verifying_key());

        fs::set_permissions(&path, fs::Permissions::from_mode(0o640)).unwrap();
        assert!(matches!(
            AuditSigningKey::load_or_create(dir.path()).unwrap_err(),
            SecretsError::KeyFileTooOpen { mode: 0o640, .. }
        ));
    }

    #[test]
    fn the_environment_value_wins_over_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let text = STANDARD.encode([5u8; 32]);
        let key = AuditSigningKey::from_env_or_dir(Some(&text), dir.path()).unwrap();
        assert_eq!(
            key.verifying_key(),
            SigningKey::from_bytes(&[5u8; 32]).verifying_key()
        );
        assert!(!dir.path().join(AUDIT_SIGNING_KEY_FILE_NAME).exists());
        let from_file = AuditSigningKey::from_env_or_dir(Some("  "), dir.path()).unwrap();
        assert_ne!(from_file.verifying_key(), key.verifying_key());
        assert!(dir.path().join(AUDIT_SIGNING_KEY_FILE_NAME).exists());
    }

    #[test]
    fn signatures_verify_under_the_printed_public_key_only() {
        let (key, _) = AuditSigningKey::generate().unwrap();
        let public = parse_verifying_key(&verifying_key_to_base64(&key.verifying_key())).unwrap();
        let signature = Signature::from_bytes(&key.sign(b"checkpoint"));
        assert!(public.verify(b"checkpoint", &signature).is_ok());
        assert!(public.verify(b"checkpoinT", &signature).is_err());
    }

    #[test]
    fn bad_keys_are_refused_without_echoing_them() {
        for bad in ["%%%", "AAAA", &STANDARD.encode([1u8; 31])] {
            let err = AuditSigningKey::from_base64(bad).unwrap_err().to_string();
            assert!(err.starts_with("audit signing key"), "{err}");
            assert!(bad.len() < 8 || !err.contains(bad), "{err}");
            assert!(parse_verifying_key(bad).is_err());
        }
        let (key, text) = AuditSigningKey::generate().unwrap();
        let debug = format!("{key:?}");
        assert!(
            !debug.contains(secrecy::ExposeSecret::expose_secret(&text)),
            "{debug}"
        );
    }
}
