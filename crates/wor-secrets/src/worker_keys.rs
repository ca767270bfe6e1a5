//! The keys of a scaled-out deployment: the control plane's signing key, which signs run
//! envelopes, and a worker's identity, its own key pair for receiving envelopes (X25519) and
//! signing its requests (Ed25519).
//!
//! A worker makes its identity itself; the control plane stores only [`WorkerPublicKeys`].
//! Private halves live in zeroizing types, in a 0600 file, and never in `Debug` output.

use std::fmt;
use std::path::Path;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use curve25519_dalek::montgomery::MontgomeryPoint;
use ed25519_dalek::{Signature, Signer as _, SigningKey, VerifyingKey};
use secrecy::SecretString;
use zeroize::Zeroizing;

use crate::SecretsError;
use crate::key_file::{self, KeyFileOrigin};

/// File name of the control plane's envelope signing key inside the data directory.
pub const CONTROL_PLANE_SIGNING_KEY_FILE_NAME: &str = "control-plane-signing.key";
/// File name of a worker's identity inside its data directory.
pub const WORKER_IDENTITY_FILE_NAME: &str = "worker-identity.key";

fn random_32() -> Result<Zeroizing<[u8; 32]>, SecretsError> {
    let mut bytes = Zeroizing::new([0u8; 32]);
    getrandom::fill(bytes.as_mut_slice()).map_err(|_| SecretsError::RandomnessUnavailable)?;
    Ok(bytes)
}

fn decode_exact<const N: usize>(
    text: &str,
    which: &'static str,
) -> Result<Zeroizing<[u8; N]>, SecretsError> {
    let invalid = |reason| SecretsError::InvalidKey { which, reason };
    let bytes = Zeroizing::new(
        STANDARD
            .decode(text.trim())
            .map_err(|_| invalid("is not valid standard base64"))?,
    );
    let array: [u8; N] = bytes
        .as_slice()
        .try_into()
        .map_err(|_| invalid("does not decode to the right number of bytes"))?;
    Ok(Zeroizing::new(array))
}

/// The key with which the control plane signs every run envelope it issues.
pub struct ControlPlaneSigningKey(SigningKey);

impl fmt::Debug for ControlPlaneSigningKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ControlPlaneSigningKey")
            .field(
                "verifying_key",
                &STANDARD.encode(self.verifying_key().as_bytes()),
            )
            .finish_non_exhaustive()
    }
}

impl ControlPlaneSigningKey {
    /// A fresh random key, with the base64 text to persist.
    ///
    /// # Errors
    /// [`SecretsError::RandomnessUnavailable`].
    pub fn generate() -> Result<(Self, SecretString), SecretsError> {
        let seed = random_32()?;
        let text = SecretString::from(STANDARD.encode(seed.as_slice()));
        Ok((Self(SigningKey::from_bytes(&seed)), text))
    }

    /// Reads a key written as base64 of its 32 secret bytes (never echoed).
    ///
    /// # Errors
    /// [`SecretsError::InvalidKey`].
    pub fn from_base64(text: &str) -> Result<Self, SecretsError> {
        let seed = decode_exact::<32>(text, "control plane signing")?;
        Ok(Self(SigningKey::from_bytes(&seed)))
    }

    /// Loads `dir/control-plane-signing.key`, creating it (mode 0600) if absent.
    ///
    /// # Errors
    /// I/O, loose permissions, or an invalid key.
    pub fn load_or_create(dir: &Path) -> Result<(Self, KeyFileOrigin), SecretsError> {
        key_file::load_or_create(
            dir,
            CONTROL_PLANE_SIGNING_KEY_FILE_NAME,
            Self::from_base64,
            Self::generate,
        )
    }

    /// Loads `dir/control-plane-signing.key` if it exists; never creates it.
    ///
    /// # Errors
    /// I/O, loose permissions, or an invalid key.
    pub fn load_existing(dir: &Path) -> Result<Option<Self>, SecretsError> {
        key_file::load_existing(dir, CONTROL_PLANE_SIGNING_KEY_FILE_NAME, Self::from_base64)
    }

    /// The public half, which workers pin at enrolment.
    pub fn verifying_key(&self) -> VerifyingKey {
        self.0.verifying_key()
    }

    pub(crate) fn sign(&self, message: &[u8]) -> Signature {
        self.0.sign(message)
    }
}

/// A worker's private keys: X25519 to open envelopes sealed to it, Ed25519 to sign requests.
pub struct WorkerIdentity {
    signing: SigningKey,
    exchange: Zeroizing<[u8; 32]>,
}

impl fmt::Debug for WorkerIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WorkerIdentity")
            .field("public", &self.public_keys())
            .finish_non_exhaustive()
    }
}

impl WorkerIdentity {
    /// A fresh identity, with the text to persist (base64 of the two 32-byte secrets).
    ///
    /// # Errors
    /// [`SecretsError::RandomnessUnavailable`].
    pub fn generate() -> Result<(Self, SecretString), SecretsError> {
        let signing_seed = random_32()?;
        let exchange = random_32()?;
        let mut both = Zeroizing::new([0u8; 64]);
        for (slot, byte) in both
            .iter_mut()
            .zip(signing_seed.iter().chain(exchange.iter()))
        {
            *slot = *byte;
        }
        let text = SecretString::from(STANDARD.encode(both.as_slice()));
        Ok((
            Self {
                signing: SigningKey::from_bytes(&signing_seed),
                exchange,
            },
            text,
        ))
    }

    /// Reads the text written by [`Self::generate`] (never echoed).
    ///
    /// # Errors
    /// [`SecretsError::InvalidKey`].
    pub fn from_base64(text: &str) -> Result<Self, SecretsError> {
        let both = decode_exact::<64>(text, "worker identity")?;
        let (signing_seed, exchange) = both.split_at(32);
        let mut seed = Zeroizing::new([0u8; 32]);
        seed.copy_from_slice(signing_seed);
        let mut secret = Zeroizing::new([0u8; 32]);
        secret.copy_from_slice(exchange);
        Ok(Self {
            signing: SigningKey::from_bytes(&seed),
            exchange: secret,
        })
    }

    /// Loads `dir/worker-identity.key`, creating it (mode 0600) if absent.
    ///
    /// # Errors
    /// I/O, loose permissions, or an invalid key.
    pub fn load_or_create(dir: &Path) -> Result<(Self, KeyFileOrigin), SecretsError> {
        key_file::load_or_create(
            dir,
            WORKER_IDENTITY_FILE_NAME,
            Self::from_base64,
            Self::generate,
        )
    }

    /// Loads `dir/worker-identity.key` if it exists; never creates it.
    ///
    /// # Errors
    /// I/O, loose permissions, or an invalid key.
    pub fn load(dir: &Path) -> Result<Option<Self>, SecretsError> {
        key_file::load_existing(dir, WORKER_IDENTITY_FILE_NAME, Self::from_base64)
    }

    /// The public halves, which the control plane stores.
    pub fn public_keys(&self) -> WorkerPublicKeys {
        WorkerPublicKeys {
            signing: self.signing.verifying_key(),
            exchange: MontgomeryPoint::mul_base_clamped(*self.exchange).to_bytes(),
        }
    }

    pub(crate) fn signing_key(&self) -> &SigningKey {
        &self.signing
    }

    /// The X25519 shared secret with `their_public`.
    pub(crate) fn exchange_with(&self, their_public: &[u8; 32]) -> Zeroizing<[u8; 32]> {
        Zeroizing::new(
            MontgomeryPoint(*their_public)
                .mul_clamped(*self.exchange)
                .to_bytes(),
        )
    }
}

/// The public keys of a worker, as the control plane stores them.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct WorkerPublicKeys {
    signing: VerifyingKey,
    exchange: [u8; 32],
}

impl fmt::Debug for WorkerPublicKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WorkerPublicKeys")
            .field("signing", &self.signing_base64())
            .field("exchange", &self.exchange_base64())
            .finish()
    }
}

impl WorkerPublicKeys {
    /// Parses the two base64 texts written by [`Self::signing_base64`] and
    /// [`Self::exchange_base64`], refusing an exchange key of small order (one that would make
    /// every shared secret guessable).
    ///
    /// # Errors
    /// [`SecretsError::InvalidKey`] naming which key and why.
    pub fn from_base64(signing: &str, exchange: &str) -> Result<Self, SecretsError> {
        let signing_bytes = decode_exact::<32>(signing, "worker signing")?;
        let signing =
            VerifyingKey::from_bytes(&signing_bytes).map_err(|_| SecretsError::InvalidKey {
                which: "worker signing",
                reason: "is not an ed25519 public key",
            })?;
        if signing.is_weak() {
            return Err(SecretsError::InvalidKey {
                which: "worker signing",
                reason: "is a weak ed25519 public key",
            });
        }
        let exchange = *decode_exact::<32>(exchange, "worker exchange")?;
        if MontgomeryPoint(exchange)
            .to_edwards(0)
            .is_none_or(|point| point.is_small_order())
        {
            return Err(SecretsError::InvalidKey {
                which: "worker exchange",
                reason: "is not a usable x25519 public key",
            });
        }
        Ok(Self { signing, exchange })
    }

    /// The Ed25519 key that verifies the worker's requests.
    pub fn signing(&self) -> &VerifyingKey {
        &self.signing
    }

    /// The X25519 key envelopes are sealed to.
    pub fn exchange(&self) -> &[u8; 32] {
        &self.exchange
    }

    /// Standard base64 of the signing key.
    pub fn signing_base64(&self) -> String {
        STANDARD.encode(self.signing.as_bytes())
    }

    /// Standard base64 of the exchange key.
    pub fn exchange_base64(&self) -> String {
        STANDARD.encode(self.exchange)
    }
}

#[cfg(test)]
mod tests {
    use std::fs;
    use std::os::unix::fs::PermissionsExt as _;

    use secrecy::ExposeSecret as _;

    use super::*;

    #[test]
    fn identity_is_created_private_then_loaded_with_the_same_public_keys() {
        let dir = tempfile::tempdir().unwrap();
        assert!(WorkerIdentity::load(dir.path()).unwrap().is_none());
        let (created, origin) = WorkerIdentity::load_or_create(dir.path()).unwrap();
        assert_eq!(origin, KeyFileOrigin::Created);
        let path = dir.path().join(WORKER_IDENTITY_FILE_NAME);
        assert_eq!(
            fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o600
        );
        let loaded = WorkerIdentity::load(dir.path()).unwrap().unwrap();
        assert_eq!(created.public_keys(), loaded.public_keys());
        fs::set_permissions(&path, fs::Permissions::from_mode(0o640)).unwrap();
        assert!(matches!(
            WorkerIdentity::load(dir.path()),
            Err(SecretsError::KeyFileTooOpen { .. })
        ));
    }

    #[test]
    fn public_keys_round_trip_and_bad_ones_are_refused() {
        let (identity, text) = WorkerIdentity::generate().unwrap();
        let public = identity.public_keys();
        let parsed =
            WorkerPublicKeys::from_base64(&public.signing_base64(), &public.exchange_base64())
                .unwrap();
        assert_eq!(parsed, public);
        let rendered = format!("{identity:?} {public:?}");
        assert!(!rendered.contains(text.expose_secret()));
        // The all-zero point and the identity are of small order.
        for weak in [[0u8; 32], {
            let mut one = [0u8; 32];
            one[0] = 1;
            one
        }] {
            let err =
                WorkerPublicKeys::from_base64(&public.signing_base64(), &STANDARD.encode(weak))
                    .unwrap_err();
            assert!(matches!(
                err,
                SecretsError::InvalidKey {
                    which: "worker exchange",
                    ..
                }
            ));
        }
        assert!(WorkerPublicKeys::from_base64("AAAA", &public.exchange_base64()).is_err());
        assert!(WorkerPublicKeys::from_base64(&public.signing_base64(), "not base64!").is_err());
    }

    #[test]
    fn both_sides_of_an_exchange_agree() {
        let (a, _) = WorkerIdentity::generate().unwrap();
        let (b, _) = WorkerIdentity::generate().unwrap();
        assert_eq!(
            *a.exchange_with(b.public_keys().exchange()),
            *b.exchange_with(a.public_keys().exchange())
        );
    }

    #[test]
    fn control_plane_key_reloads_and_hides_its_secret() {
        let dir = tempfile::tempdir().unwrap();
        let (created, _) = ControlPlaneSigningKey::load_or_create(dir.path()).unwrap();
        let (loaded, origin) = ControlPlaneSigningKey::load_or_create(dir.path()).unwrap();
        assert_eq!(origin, KeyFileOrigin::Loaded);
        assert_eq!(created.verifying_key(), loaded.verifying_key());
        let text =
            fs::read_to_string(dir.path().join(CONTROL_PLANE_SIGNING_KEY_FILE_NAME)).unwrap();
        assert!(!format!("{loaded:?}").contains(text.trim()));
    }
}
