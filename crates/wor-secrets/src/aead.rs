//! The single AEAD seam: XChaCha20-Poly1305 under a key ring with rotation.
//!
//! Every secret stored at rest is sealed here. A [`SealedSecret`] records the id of the key that
//! sealed it, and its associated data binds it to one project, table, row and field
//! ([`SecretBinding`]), so a ciphertext copied anywhere else fails to open. Key ids are derived
//! from the keys themselves, so rotation needs no configuration beyond the keys.
//!
//! Key material lives only in zeroizing types and never appears in `Debug` output or errors.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use chacha20poly1305::aead::{Aead as _, KeyInit as _, Payload};
use chacha20poly1305::{XChaCha20Poly1305, XNonce};
use secrecy::{ExposeSecret as _, SecretBox, SecretSlice, SecretString};
use sha2::{Digest as _, Sha256};
use zeroize::Zeroizing;

use crate::key_file::{self, KeyFileOrigin};

/// Length in bytes of an encryption key.
pub const KEY_LEN: usize = 32;
/// Length in bytes of a key id.
pub const KEY_ID_LEN: usize = 8;
/// Length in bytes of an XChaCha20-Poly1305 nonce.
pub(crate) const NONCE_LEN: usize = 24;
/// Length in bytes of the Poly1305 tag appended to every ciphertext.
pub(crate) const TAG_LEN: usize = 16;

/// First bytes of every [`SealedSecret`] in its byte form.
const SEALED_MAGIC: &[u8; 3] = b"wse";
/// The only byte-format version written so far.
const SEALED_VERSION: u8 = 1;
/// Algorithm code for XChaCha20-Poly1305.
const ALGORITHM_XCHACHA20_POLY1305: u8 = 1;
/// Length of the header: magic, version, algorithm, key id.
const HEADER_LEN: usize = SEALED_MAGIC.len() + 2 + KEY_ID_LEN;

/// Domain-separation label for key ids, so an id is never a hash used for anything else.
const KEY_ID_LABEL: &[u8] = b"wor-secrets key id v1\0";
/// Domain-separation label at the start of the associated data.
const AAD_LABEL: &[u8] = b"wor-secrets binding v1\0";

/// File name of the development key inside the data directory.
pub const DEV_KEY_FILE_NAME: &str = "encryption.key";

/// What went wrong while loading keys or sealing and opening secrets.
///
/// No variant carries key material or plaintext.
#[derive(Debug, thiserror::Error)]
pub enum SecretsError {
    /// No primary encryption key was configured.
    #[error("no primary encryption key is configured")]
    MissingPrimaryKey,
    /// A key was not valid standard base64 (the key itself is not echoed).
    #[error("{which} encryption key is not valid standard base64")]
    KeyNotBase64 {
        /// Which key: `primary` or `retired #n`.
        which: String,
    },
    /// A key decoded to the wrong number of bytes.
    #[error("{which} encryption key decodes to {actual} bytes, expected exactly 32")]
    KeyWrongLength {
        /// Which key: `primary` or `retired #n`.
        which: String,
        /// Number of bytes it decoded to.
        actual: usize,
    },
    /// The sealed secret names a key that is not in the ring.
    #[error("secret was sealed under key id `{key_id}`, which is not in the key ring")]
    UnknownKeyId {
        /// The id of the missing key.
        key_id: KeyId,
    },
    /// Authentication failed: wrong key, wrong binding, or the bytes were altered.
    #[error("secret failed to decrypt: it was altered or does not belong to this binding")]
    DecryptionFailed,
    /// Encryption failed (the plaintext or binding is too large for the cipher).
    #[error("secret could not be encrypted")]
    EncryptionFailed,
    /// The decrypted secret was expected to be UTF-8 text and is not.
    #[error("decrypted secret is not valid UTF-8")]
    NotUtf8,
    /// The bytes are not a sealed secret.
    #[error("malformed sealed secret: {reason}")]
    MalformedSealedSecret {
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The sealed secret uses a byte-format version this build does not know.
    #[error("sealed secret has unsupported format version {version}")]
    UnsupportedVersion {
        /// The version byte found.
        version: u8,
    },
    /// The sealed secret uses an algorithm this build does not know.
    #[error("sealed secret has unsupported algorithm code {code}")]
    UnsupportedAlgorithm {
        /// The algorithm byte found.
        code: u8,
    },
    /// The operating system's random number generator failed.
    #[error("operating system randomness is unavailable")]
    RandomnessUnavailable,
    /// Reading or creating a key file failed. The I/O error is part of the message, not a
    /// source of its own, so it is told once.
    #[error("key file `{path}`: {error}")]
    KeyFile {
        /// The file involved.
        path: PathBuf,
        /// The I/O error.
        error: io::Error,
    },
    /// An audit signing or verifying key is malformed (the key itself is not echoed).
    #[error("audit {which} key {reason}")]
    InvalidAuditKey {
        /// `signing` or `verifying`.
        which: &'static str,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A control plane or worker key is malformed (the key itself is not echoed).
    #[error("{which} key {reason}")]
    InvalidKey {
        /// Which key.
        which: &'static str,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The directory of a key file may be written by any user, who could replace the key.
    #[error(
        "key directory `{path}` has mode {mode:04o}: any user may write to it, and so replace its keys (chmod o-w)"
    )]
    KeyDirTooOpen {
        /// The directory.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// A key file may be read by other users.
    #[error(
        "key file `{path}` has mode {mode:o}; it must not be readable by group or others (chmod 600)"
    )]
    KeyFileTooOpen {
        /// The file involved.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
}

/// Identifies a key without revealing it: the first 8 bytes of SHA-256 over a label and the key.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct KeyId([u8; KEY_ID_LEN]);

impl KeyId {
    fn derive(key: &[u8; KEY_LEN]) -> Self {
        let digest = Sha256::new()
            .chain_update(KEY_ID_LABEL)
            .chain_update(key)
            .finalize();
        let mut id = [0u8; KEY_ID_LEN];
        for (slot, byte) in id.iter_mut().zip(digest.iter()) {
            *slot = *byte;
        }
        Self(id)
    }

    /// The raw id bytes.
    pub fn as_bytes(&self) -> &[u8; KEY_ID_LEN] {
        &self.0
    }
}

impl fmt::Display for KeyId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex::encode(self.0))
    }
}

impl fmt::Debug for KeyId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "KeyId({self})")
    }
}

/// Where a secret lives; it becomes the associated data of its ciphertext.
///
/// Each field is length-prefixed in the associated data, so no two different bindings encode
/// to the same bytes (`("ab", "c")` and `("a", "bc")` differ).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SecretBinding<'a> {
    /// The owning project's id.
    pub project: &'a str,
    /// The table (or kind of record) holding the secret.
    pub table: &'a str,
    /// The row's id.
    pub row: &'a str,
    /// The field (column, header name, …) within the row.
    pub field: &'a str,
}

impl SecretBinding<'_> {
    /// Associated data: label, sealed-secret header, then each binding part with a u32
    /// big-endian length prefix. The header is included so the key id and version are
    /// authenticated too.
    fn associated_data(&self, header: &[u8]) -> Vec<u8> {
        let parts = [self.project, self.table, self.row, self.field];
        let mut aad = Vec::with_capacity(
            AAD_LABEL.len() + header.len() + parts.iter().map(|p| p.len() + 4).sum::<usize>(),
        );
        aad.extend_from_slice(AAD_LABEL);
        aad.extend_from_slice(header);
        for part in parts {
            // Parts longer than u32::MAX are saturated; such a binding cannot exist in practice
            // and the full bytes still follow, so the encoding stays unambiguous up to 4 GiB.
            let len = u32::try_from(part.len()).unwrap_or(u32::MAX);
            aad.extend_from_slice(&len.to_be_bytes());
            aad.extend_from_slice(part.as_bytes());
        }
        aad
    }
}

/// A secret sealed under one key of a [`KeyRing`]: key id, nonce and ciphertext with its tag.
///
/// Byte form (version 1): `"wse"`, version `0x01`, algorithm `0x01` (XChaCha20-Poly1305),
/// 8-byte key id, 24-byte nonce, ciphertext followed by the 16-byte tag.
#[derive(Clone, PartialEq, Eq)]
pub struct SealedSecret {
    key_id: KeyId,
    nonce: [u8; NONCE_LEN],
    ciphertext: Vec<u8>,
}

impl SealedSecret {
    /// Id of the key this secret was sealed under.
    pub fn key_id(&self) -> KeyId {
        self.key_id
    }

    /// Serialises to the versioned byte form, for storage.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut bytes = Vec::with_capacity(HEADER_LEN + NONCE_LEN + self.ciphertext.len());
        bytes.extend_from_slice(&header(self.key_id));
        bytes.extend_from_slice(&self.nonce);
        bytes.extend_from_slice(&self.ciphertext);
        bytes
    }

    /// Parses the byte form written by [`SealedSecret::to_bytes`].
    ///
    /// # Errors
    /// [`SecretsError::MalformedSealedSecret`], [`SecretsError::UnsupportedVersion`] or
    /// [`SecretsError::UnsupportedAlgorithm`] when the bytes are not a sealed secret this build
    /// can read.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, SecretsError> {
        let malformed = |reason| SecretsError::MalformedSealedSecret { reason };
        let (magic, rest) = bytes
            .split_first_chunk::<3>()
            .ok_or(malformed("too short"))?;
        if magic != SEALED_MAGIC {
            return Err(malformed("wrong magic bytes"));
        }
        let (&[version, algorithm], rest) = rest
            .split_first_chunk::<2>()
            .ok_or(malformed("too short"))?;
        if version != SEALED_VERSION {
            return Err(SecretsError::UnsupportedVersion { version });
        }
        if algorithm != ALGORITHM_XCHACHA20_POLY1305 {
            return Err(SecretsError::UnsupportedAlgorithm { code: algorithm });
        }
        let (key_id, rest) = rest
            .split_first_chunk::<KEY_ID_LEN>()
            .ok_or(malformed("truncated key id"))?;
        let (nonce, ciphertext) = rest
            .split_first_chunk::<NONCE_LEN>()
            .ok_or(malformed("truncated nonce"))?;
        if ciphertext.len() < TAG_LEN {
            return Err(malformed("ciphertext shorter than its tag"));
        }
        Ok(Self {
            key_id: KeyId(*key_id),
            nonce: *nonce,
            ciphertext: ciphertext.to_vec(),
        })
    }
}

impl fmt::Debug for SealedSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SealedSecret")
            .field("key_id", &self.key_id)
            .field("ciphertext_len", &self.ciphertext.len())
            .finish_non_exhaustive()
    }
}

fn header(key_id: KeyId) -> [u8; HEADER_LEN] {
    let mut out = [0u8; HEADER_LEN];
    let fixed = SEALED_MAGIC
        .iter()
        .chain(&[SEALED_VERSION, ALGORITHM_XCHACHA20_POLY1305])
        .chain(key_id.as_bytes());
    for (slot, byte) in out.iter_mut().zip(fixed) {
        *slot = *byte;
    }
    out
}

/// One key of the ring, with its derived id.
struct RingKey {
    id: KeyId,
    material: SecretBox<[u8; KEY_LEN]>,
}

impl RingKey {
    fn from_bytes(bytes: &[u8], which: &str) -> Result<Self, SecretsError> {
        let array: &[u8; KEY_LEN] = bytes.try_into().map_err(|_| SecretsError::KeyWrongLength {
            which: which.to_owned(),
            actual: bytes.len(),
        })?;
        let material = SecretBox::new(Box::new(*array));
        Ok(Self {
            id: KeyId::derive(material.expose_secret()),
            material,
        })
    }

    fn from_base64(text: &str, which: &str) -> Result<Self, SecretsError> {
        let decoded = Zeroizing::new(STANDARD.decode(text.trim()).map_err(|_| {
            SecretsError::KeyNotBase64 {
                which: which.to_owned(),
            }
        })?);
        Self::from_bytes(&decoded, which)
    }

    fn cipher(&self) -> XChaCha20Poly1305 {
        XChaCha20Poly1305::new(self.material.expose_secret().into())
    }
}

/// The encryption keys: one primary key that seals, plus retired keys that still open.
pub struct KeyRing {
    primary: RingKey,
    retired: Vec<RingKey>,
}

impl fmt::Debug for KeyRing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let retired: Vec<KeyId> = self.retired.iter().map(|k| k.id).collect();
        f.debug_struct("KeyRing")
            .field("primary", &self.primary.id)
            .field("retired", &retired)
            .finish()
    }
}

impl KeyRing {
    /// Builds a ring from base64 keys (standard alphabet, padded, 32 bytes each).
    ///
    /// Retired keys equal to the primary, or to each other, are kept once.
    ///
    /// # Errors
    /// [`SecretsError::KeyNotBase64`] or [`SecretsError::KeyWrongLength`] naming which key is bad.
    pub fn from_base64<'a>(
        primary: &str,
        retired: impl IntoIterator<Item = &'a str>,
    ) -> Result<Self, SecretsError> {
        let primary = RingKey::from_base64(primary, "primary")?;
        let mut ring = Self {
            primary,
            retired: Vec::new(),
        };
        for (index, text) in retired.into_iter().enumerate() {
            let key = RingKey::from_base64(text, &format!("retired #{}", index + 1))?;
            ring.push_retired(key);
        }
        Ok(ring)
    }

    /// Builds a ring from environment-style values: the primary key and a comma-separated
    /// list of retired keys (empty entries are ignored).
    ///
    /// # Errors
    /// [`SecretsError::MissingPrimaryKey`] when `primary` is `None` or blank, otherwise as
    /// [`KeyRing::from_base64`].
    pub fn from_env_values(primary: Option<&str>, retired: &str) -> Result<Self, SecretsError> {
        let primary = primary
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .ok_or(SecretsError::MissingPrimaryKey)?;
        Self::from_base64(
            primary,
            retired.split(',').map(str::trim).filter(|k| !k.is_empty()),
        )
    }

    /// Generates a fresh ring with one random key, returning it with the base64 text to persist.
    ///
    /// # Errors
    /// [`SecretsError::RandomnessUnavailable`] if the OS cannot supply random bytes.
    pub fn generate() -> Result<(Self, SecretString), SecretsError> {
        let mut bytes = Zeroizing::new([0u8; KEY_LEN]);
        getrandom::fill(bytes.as_mut_slice()).map_err(|_| SecretsError::RandomnessUnavailable)?;
        let text = SecretString::from(STANDARD.encode(bytes.as_slice()));
        let primary = RingKey::from_bytes(bytes.as_slice(), "generated")?;
        Ok((
            Self {
                primary,
                retired: Vec::new(),
            },
            text,
        ))
    }

    /// Adds every key of `other` to this ring as a retired key: values sealed under them still
    /// open, and new values are sealed under this ring's primary.
    pub fn with_retired_ring(mut self, other: KeyRing) -> Self {
        self.push_retired(other.primary);
        for key in other.retired {
            self.push_retired(key);
        }
        self
    }

    fn push_retired(&mut self, key: RingKey) {
        let known = key.id == self.primary.id || self.retired.iter().any(|k| k.id == key.id);
        if !known {
            self.retired.push(key);
        }
    }

    /// Id of the primary key, under which [`KeyRing::encrypt`] seals.
    pub fn primary_key_id(&self) -> KeyId {
        self.primary.id
    }

    /// Ids of the retired keys, which open old secrets but never seal new ones.
    pub fn retired_key_ids(&self) -> Vec<KeyId> {
        self.retired.iter().map(|k| k.id).collect()
    }

    fn key(&self, id: KeyId) -> Option<&RingKey> {
        std::iter::once(&self.primary)
            .chain(&self.retired)
            .find(|k| k.id == id)
    }

    /// Seals `plaintext` under the primary key with a random nonce, bound to `binding`.
    ///
    /// # Errors
    /// [`SecretsError::RandomnessUnavailable`] or [`SecretsError::EncryptionFailed`].
    pub fn encrypt(
        &self,
        binding: &SecretBinding<'_>,
        plaintext: &[u8],
    ) -> Result<SealedSecret, SecretsError> {
        let mut nonce = [0u8; NONCE_LEN];
        getrandom::fill(&mut nonce).map_err(|_| SecretsError::RandomnessUnavailable)?;
        let aad = binding.associated_data(&header(self.primary.id));
        let ciphertext = self
            .primary
            .cipher()
            .encrypt(
                &XNonce::from(nonce),
                Payload {
                    msg: plaintext,
                    aad: &aad,
                },
            )
            .map_err(|_| SecretsError::EncryptionFailed)?;
        Ok(SealedSecret {
            key_id: self.primary.id,
            nonce,
            ciphertext,
        })
    }

    /// Opens a sealed secret with whichever key of the ring sealed it.
    ///
    /// # Errors
    /// [`SecretsError::UnknownKeyId`] if that key is not in the ring;
    /// [`SecretsError::DecryptionFailed`] if the binding differs or the bytes were altered.
    pub fn decrypt(
        &self,
        binding: &SecretBinding<'_>,
        sealed: &SealedSecret,
    ) -> Result<SecretSlice<u8>, SecretsError> {
        let key = self.key(sealed.key_id).ok_or(SecretsError::UnknownKeyId {
            key_id: sealed.key_id,
        })?;
        let aad = binding.associated_data(&header(sealed.key_id));
        let plaintext = key
            .cipher()
            .decrypt(
                &XNonce::from(sealed.nonce),
                Payload {
                    msg: &sealed.ciphertext,
                    aad: &aad,
                },
            )
            .map_err(|_| SecretsError::DecryptionFailed)?;
        Ok(SecretSlice::from(plaintext))
    }

    /// Opens a sealed secret that holds UTF-8 text (a header value, a token).
    ///
    /// # Errors
    /// As [`KeyRing::decrypt`], plus [`SecretsError::NotUtf8`].
    pub fn decrypt_string(
        &self,
        binding: &SecretBinding<'_>,
        sealed: &SealedSecret,
    ) -> Result<SecretString, SecretsError> {
        let bytes = self.decrypt(binding, sealed)?;
        let text = std::str::from_utf8(bytes.expose_secret()).map_err(|_| SecretsError::NotUtf8)?;
        Ok(SecretString::from(text))
    }

    /// Whether `sealed` should be re-encrypted: it was not sealed under the primary key.
    pub fn needs_rotation(&self, sealed: &SealedSecret) -> bool {
        sealed.key_id != self.primary.id
    }
}

/// Seals `plaintext` under a single-use key (one derived for one run envelope), with a random
/// nonce; the nonce is returned beside the ciphertext. The same cipher as the key ring, so the
/// crate keeps one AEAD.
pub(crate) fn seal_with_single_use_key(
    key: &Zeroizing<[u8; KEY_LEN]>,
    aad: &[u8],
    plaintext: &[u8],
) -> Result<([u8; NONCE_LEN], Vec<u8>), SecretsError> {
    let mut nonce = [0u8; NONCE_LEN];
    getrandom::fill(&mut nonce).map_err(|_| SecretsError::RandomnessUnavailable)?;
    let ciphertext = XChaCha20Poly1305::new((&**key).into())
        .encrypt(
            &XNonce::from(nonce),
            Payload {
                msg: plaintext,
                aad,
            },
        )
        .map_err(|_| SecretsError::EncryptionFailed)?;
    Ok((nonce, ciphertext))
}

/// Opens what [`seal_with_single_use_key`] sealed.
pub(crate) fn open_with_single_use_key(
    key: &Zeroizing<[u8; KEY_LEN]>,
    nonce: &[u8; NONCE_LEN],
    aad: &[u8],
    ciphertext: &[u8],
) -> Result<Zeroizing<Vec<u8>>, SecretsError> {
    XChaCha20Poly1305::new((&**key).into())
        .decrypt(
            &XNonce::from(*nonce),
            Payload {
                msg: ciphertext,
                aad,
            },
        )
        .map(Zeroizing::new)
        .map_err(|_| SecretsError::DecryptionFailed)
}

/// Whether [`load_or_create_dev_key`] found an existing key or made a new one.
pub type DevKeyOrigin = KeyFileOrigin;

/// Loads the development key from `dir/encryption.key`, creating it (mode 0600) if absent.
///
/// For development only: production takes its key from the environment. The file is created
/// as [`crate::key_file`] creates every key file: private from the start, never overwritten,
/// refused when readable by group or others.
///
/// # Errors
/// [`SecretsError::KeyFile`] on I/O failure, [`SecretsError::KeyFileTooOpen`] on loose
/// permissions, or a key parsing error if the file holds no valid key.
pub fn load_or_create_dev_key(dir: &Path) -> Result<(KeyRing, DevKeyOrigin), SecretsError> {
    key_file::load_or_create(
        dir,
        DEV_KEY_FILE_NAME,
        |text| KeyRing::from_base64(text, []),
        KeyRing::generate,
    )
}

/// Loads the development key from `dir/encryption.key` if the file exists; never creates it.
///
/// # Errors
/// As [`load_or_create_dev_key`], except that a missing file is `Ok(None)`.
pub fn load_dev_key(dir: &Path) -> Result<Option<KeyRing>, SecretsError> {
    key_file::load_existing(dir, DEV_KEY_FILE_NAME, |text| {
        KeyRing::from_base64(text, [])
    })
}

#[cfg(test)]
mod tests {
    use std::fs;
    use std::os::unix::fs::PermissionsExt as _;

    use super::*;
    use crate::key_file::write_new_private_file;

    const BINDING: SecretBinding<'static> = SecretBinding {
        project: "prj_1",
        table: "connections",
        row: "con_1",
        field: "headers",
    };

    fn key_text(byte: u8) -> String {
        STANDARD.encode([byte; KEY_LEN])
    }

    fn ring(byte: u8) -> KeyRing {
        KeyRing::from_base64(&key_text(byte), []).unwrap()
    }

    #[test]
    fn round_trips_through_bytes() {
        let ring = ring(7);
        let sealed = ring.encrypt(&BINDING, b"hunter2-token").unwrap();
        let parsed = SealedSecret::from_bytes(&sealed.to_bytes()).unwrap();
        assert_eq!(parsed, sealed);
        let opened = ring.decrypt(&BINDING, &parsed).unwrap();
        assert_eq!(opened.expose_secret(), b"hunter2-token");
        let text = ring.decrypt_string(&BINDING, &parsed).unwrap();
        assert_eq!(text.expose_secret(), "hunter2-token");
    }

    #[test]
    fn ciphertext_hides_plaintext_and_nonces_differ() {
        let ring = ring(7);
        let a = ring.encrypt(&BINDING, b"same plaintext here").unwrap();
        let b = ring.encrypt(&BINDING, b"same plaintext here").unwrap();
        assert_ne!(a.to_bytes(), b.to_bytes());
        let bytes = a.to_bytes();
        assert!(!bytes.windows(5).any(|w| w == b"plain"));
    }

    #[test]
    fn moved_ciphertext_fails_for_each_binding_part() {
        let ring = ring(7);
        let sealed = ring.encrypt(&BINDING, b"secret").unwrap();
        let others = [
            SecretBinding {
                project: "prj_2",
                ..BINDING
            },
            SecretBinding {
                table: "models",
                ..BINDING
            },
            SecretBinding {
                row: "con_2",
                ..BINDING
            },
            SecretBinding {
                field: "token",
                ..BINDING
            },
        ];
        for other in others {
            assert!(
                matches!(
                    ring.decrypt(&other, &sealed),
                    Err(SecretsError::DecryptionFailed)
                ),
                "{other:?} must not open"
            );
        }
    }

    #[test]
    fn binding_encoding_is_unambiguous() {
        let a = SecretBinding {
            project: "ab",
            table: "c",
            row: "r",
            field: "f",
        };
        let b = SecretBinding {
            project: "a",
            table: "bc",
            row: "r",
            field: "f",
        };
        assert_ne!(a.associated_data(&[]), b.associated_data(&[]));
        let ring = ring(7);
        let sealed = ring.encrypt(&a, b"secret").unwrap();
        assert!(ring.decrypt(&b, &sealed).is_err());
    }

    #[test]
    fn tampered_bytes_fail() {
        let ring = ring(7);
        let bytes = ring.encrypt(&BINDING, b"secret").unwrap().to_bytes();
        for index in HEADER_LEN..bytes.len() {
            let mut copy = bytes.clone();
            copy[index] ^= 1;
            let sealed = SealedSecret::from_bytes(&copy).unwrap();
            assert!(ring.decrypt(&BINDING, &sealed).is_err(), "byte {index}");
        }
    }

    #[test]
    fn rotation_keeps_old_secrets_readable() {
        let old = ring(1);
        let sealed = old.encrypt(&BINDING, b"old secret").unwrap();
        let rotated =
            KeyRing::from_env_values(Some(&key_text(2)), &format!(" {} ,,", key_text(1))).unwrap();
        assert!(rotated.needs_rotation(&sealed));
        assert!(!old.needs_rotation(&sealed));
        let opened = rotated.decrypt(&BINDING, &sealed).unwrap();
        assert_eq!(opened.expose_secret(), b"old secret");
        let resealed = rotated.encrypt(&BINDING, b"old secret").unwrap();
        assert_eq!(resealed.key_id(), rotated.primary_key_id());
        assert!(!rotated.needs_rotation(&resealed));
        assert_eq!(rotated.retired_key_ids(), vec![old.primary_key_id()]);
    }

    #[test]
    fn unknown_key_id_is_named() {
        let sealed = ring(1).encrypt(&BINDING, b"x").unwrap();
        let err = ring(2).decrypt(&BINDING, &sealed).unwrap_err();
        let id = ring(1).primary_key_id().to_string();
        assert!(matches!(err, SecretsError::UnknownKeyId { .. }));
        assert!(err.to_string().contains(&format!("`{id}`")), "{err}");
        assert!(!err.to_string().contains(&key_text(1)));
    }

    #[test]
    fn key_ids_are_derived_and_stable() {
        assert_eq!(ring(1).primary_key_id(), ring(1).primary_key_id());
        assert_ne!(ring(1).primary_key_id(), ring(2).primary_key_id());
        assert_eq!(ring(1).primary_key_id().to_string().len(), 16);
        let raw_prefix = hex::encode(Sha256::digest([1u8; KEY_LEN]));
        assert!(!raw_prefix.starts_with(&ring(1).primary_key_id().to_string()));
    }

    #[test]
    fn bad_keys_are_rejected_clearly() {
        let err = KeyRing::from_base64("not base64!!", []).unwrap_err();
        assert!(matches!(err, SecretsError::KeyNotBase64 { .. }));
        assert!(!err.to_string().contains("not base64!!"));
        let short = STANDARD.encode([1u8; 31]);
        let err = KeyRing::from_base64(&short, []).unwrap_err();
        assert!(matches!(
            err,
            SecretsError::KeyWrongLength { actual: 31, .. }
        ));
        let err = KeyRing::from_base64(&key_text(1), ["AAAA"]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "retired #1 encryption key decodes to 3 bytes, expected exactly 32"
        );
        let url_safe = base64::engine::general_purpose::URL_SAFE.encode([0xfb; KEY_LEN]);
        assert!(KeyRing::from_base64(&url_safe, []).is_err());
        assert!(matches!(
            KeyRing::from_env_values(None, ""),
            Err(SecretsError::MissingPrimaryKey)
        ));
        assert!(matches!(
            KeyRing::from_env_values(Some("  "), ""),
            Err(SecretsError::MissingPrimaryKey)
        ));
    }

    #[test]
    fn garbage_bytes_are_errors() {
        let valid = ring(1).encrypt(&BINDING, b"x").unwrap().to_bytes();
        for len in 0..HEADER_LEN + NONCE_LEN + TAG_LEN {
            let result = SealedSecret::from_bytes(&valid[..len]);
            assert!(result.is_err(), "prefix of length {len}");
        }
        let mut wrong_version = valid.clone();
        wrong_version[3] = 9;
        assert!(matches!(
            SealedSecret::from_bytes(&wrong_version),
            Err(SecretsError::UnsupportedVersion { version: 9 })
        ));
        let mut wrong_algorithm = valid.clone();
        wrong_algorithm[4] = 9;
        assert!(matches!(
            SealedSecret::from_bytes(&wrong_algorithm),
            Err(SecretsError::UnsupportedAlgorithm { code: 9 })
        ));
        assert!(SealedSecret::from_bytes(&[0xff; 200]).is_err());
    }

    #[test]
    fn header_is_authenticated() {
        let ring = KeyRing::from_env_values(Some(&key_text(1)), &key_text(2)).unwrap();
        let mut bytes = ring.encrypt(&BINDING, b"x").unwrap().to_bytes();
        // Relabel the ciphertext as sealed under the retired key.
        let retired = ring.retired_key_ids()[0];
        bytes[5..HEADER_LEN].copy_from_slice(retired.as_bytes());
        let sealed = SealedSecret::from_bytes(&bytes).unwrap();
        assert!(ring.decrypt(&BINDING, &sealed).is_err());
    }

    #[test]
    fn debug_output_holds_no_key_material() {
        let (ring, text) = KeyRing::generate().unwrap();
        let sealed = ring.encrypt(&BINDING, b"plaintext-value").unwrap();
        let key_bytes = STANDARD.decode(text.expose_secret()).unwrap();
        let rendered = format!("{ring:?} {sealed:?} {text:?}");
        assert!(!rendered.contains(text.expose_secret()));
        assert!(!rendered.contains(&hex::encode(&key_bytes)));
        assert!(!rendered.contains(&format!("{key_bytes:?}")));
        assert!(!rendered.contains("plaintext-value"));
        assert!(rendered.contains(&ring.primary_key_id().to_string()));
    }

    #[test]
    fn generated_key_reloads_from_its_text() {
        let (ring, text) = KeyRing::generate().unwrap();
        let reloaded = KeyRing::from_base64(text.expose_secret(), []).unwrap();
        assert_eq!(ring.primary_key_id(), reloaded.primary_key_id());
        let sealed = ring.encrypt(&BINDING, b"x").unwrap();
        assert!(reloaded.decrypt(&BINDING, &sealed).is_ok());
    }

    #[test]
    fn dev_key_is_created_private_then_loaded() {
        let dir = tempfile::tempdir().unwrap();
        let nested = dir.path().join("data");
        let (created, origin) = load_or_create_dev_key(&nested).unwrap();
        assert_eq!(origin, DevKeyOrigin::Created);
        let path = nested.join(DEV_KEY_FILE_NAME);
        let mode = fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        // Only the key file remains: the staging file is gone.
        assert_eq!(fs::read_dir(&nested).unwrap().count(), 1);

        let (loaded, origin) = load_or_create_dev_key(&nested).unwrap();
        assert_eq!(origin, DevKeyOrigin::Loaded);
        assert_eq!(created.primary_key_id(), loaded.primary_key_id());
    }

    #[test]
    fn dev_key_readable_by_others_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        load_or_create_dev_key(dir.path()).unwrap();
        let path = dir.path().join(DEV_KEY_FILE_NAME);
        fs::set_permissions(&path, fs::Permissions::from_mode(0o644)).unwrap();
        let err = load_or_create_dev_key(dir.path()).unwrap_err();
        assert!(matches!(
            err,
            SecretsError::KeyFileTooOpen { mode: 0o644, .. }
        ));
    }

    #[test]
    fn corrupt_dev_key_is_an_error_not_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(DEV_KEY_FILE_NAME);
        write_new_private_file(&path, "garbage").unwrap();
        assert!(load_or_create_dev_key(dir.path()).is_err());
        assert_eq!(fs::read_to_string(&path).unwrap(), "garbage\n");
    }
}
