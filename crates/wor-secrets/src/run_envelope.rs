//! Run envelopes: the credentials of one run, sealed to one worker and signed by the control
//! plane.
//!
//! The control plane seals a [`RunSecrets`] to the worker's X25519 key (an ephemeral key pair,
//! HKDF-SHA256, then the crate's one AEAD, XChaCha20-Poly1305) and signs the whole envelope with
//! its Ed25519 key. The claims (run, lease, worker, issue and expiry times, a nonce) travel in
//! clear text but are covered by the signature and are the AEAD's associated data, so they can be
//! neither changed nor moved onto other ciphertext.
//!
//! A worker opens envelopes with an [`EnvelopeOpener`], which checks, in this order: size,
//! signature, shape, audience, lifetime, clock skew, expiry, the nonce against its replay cache,
//! and finally decrypts. Each refusal is an [`EnvelopeError`] variant naming its reason.
//!
//! Byte form (version 1), everything but the signature signed:
//! `"wre"`, `0x01`, run id, lease id, worker id (each a u16 big-endian length and UTF-8 bytes),
//! issued-at and expires-at (i64 big-endian Unix seconds), 16-byte nonce, 32-byte ephemeral
//! X25519 key, 24-byte AEAD nonce, ciphertext (u32 length and bytes), then a 64-byte Ed25519
//! signature over a label and all the bytes before it.

use std::collections::HashMap;
use std::fmt;

use ed25519_dalek::{Signature, VerifyingKey};
use hkdf::Hkdf;
use secrecy::{ExposeSecret as _, SecretString};
use sha2::Sha256;
use zeroize::Zeroizing;

use crate::aead::{NONCE_LEN, TAG_LEN, open_with_single_use_key, seal_with_single_use_key};
use crate::worker_keys::{ControlPlaneSigningKey, WorkerIdentity, WorkerPublicKeys};

const MAGIC: &[u8; 3] = b"wre";
const VERSION: u8 = 1;
const SIGNATURE_LABEL: &[u8] = b"wor run envelope signature v1\0";
const AAD_LABEL: &[u8] = b"wor run envelope aad v1\0";
const KDF_INFO: &[u8] = b"wor run envelope key v1";
const PLAINTEXT_VERSION: u8 = 1;
const SIGNATURE_LEN: usize = 64;
/// Length in bytes of an envelope's nonce.
pub const ENVELOPE_NONCE_LEN: usize = 16;

/// What a worker accepts. The defaults suit a control plane and workers whose clocks are kept
/// by NTP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EnvelopeLimits {
    /// How far the issuer's clock may be ahead of or behind the worker's, in seconds.
    pub max_clock_skew_secs: i64,
    /// The longest lifetime (expires-at minus issued-at) accepted, in seconds. It also bounds
    /// how long a nonce stays in the replay cache.
    pub max_lifetime_secs: i64,
    /// The largest envelope accepted, in bytes, checked before anything else is read.
    pub max_bytes: usize,
}

impl Default for EnvelopeLimits {
    fn default() -> Self {
        Self {
            max_clock_skew_secs: 30,
            max_lifetime_secs: 15 * 60,
            max_bytes: 64 * 1024,
        }
    }
}

/// Why an envelope was not sealed or not opened. No variant carries a secret.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnvelopeError {
    /// Larger than [`EnvelopeLimits::max_bytes`]; nothing else was read.
    #[error("envelope of {actual} bytes is larger than the {limit} bytes allowed")]
    Oversized {
        /// Its size.
        actual: usize,
        /// The limit.
        limit: usize,
    },
    /// The signature does not verify under the control plane's key: the bytes were altered or
    /// someone else made them.
    #[error(
        "envelope signature does not verify: it was altered or not issued by the control plane"
    )]
    Tampered,
    /// Signed, but not an envelope this build can read.
    #[error("malformed envelope: {reason}")]
    Malformed {
        /// What is wrong with it.
        reason: &'static str,
    },
    /// Addressed to another worker.
    #[error("envelope is addressed to worker `{addressed_to}`, not to this worker `{this_worker}`")]
    WrongAudience {
        /// The worker it names.
        addressed_to: String,
        /// This worker.
        this_worker: String,
    },
    /// Addressed to this worker's id but sealed to an exchange key it does not hold (the
    /// worker's keys were replaced since, or the control plane holds another worker's keys
    /// under this id).
    #[error("envelope is not sealed to this worker's key")]
    NotSealedToThisWorker,
    /// Its lifetime is not positive or longer than [`EnvelopeLimits::max_lifetime_secs`].
    #[error("envelope lifetime of {lifetime_secs} s is outside 1..={limit_secs} s")]
    LifetimeOutOfBounds {
        /// expires-at minus issued-at.
        lifetime_secs: i64,
        /// The limit.
        limit_secs: i64,
    },
    /// Issued further in the future than the allowed clock skew.
    #[error(
        "envelope issued at {issued_at} is ahead of this clock ({now}) by more than {skew_secs} s"
    )]
    NotYetValid {
        /// Its issued-at.
        issued_at: i64,
        /// This worker's clock.
        now: i64,
        /// The allowed skew.
        skew_secs: i64,
    },
    /// Expired (allowing for clock skew).
    #[error("envelope expired at {expires_at}; it is now {now}")]
    Expired {
        /// Its expires-at.
        expires_at: i64,
        /// This worker's clock.
        now: i64,
    },
    /// Its nonce was seen before by this worker.
    #[error("envelope nonce was already used: a replay")]
    Replayed,
    /// A claim or secret is too long for the byte form.
    #[error("envelope field `{field}` is too long")]
    FieldTooLong {
        /// Which field.
        field: &'static str,
    },
    /// The worker's exchange key gives a degenerate shared secret.
    #[error("the worker's exchange key is unusable")]
    UnusableWorkerKey,
    /// The operating system's random number generator failed.
    #[error("operating system randomness is unavailable")]
    RandomnessUnavailable,
    /// The cipher refused to seal (it never does for the sizes allowed here).
    #[error("envelope could not be encrypted")]
    EncryptionFailed,
}

/// Whom and what an envelope is for, and when.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvelopeClaims {
    /// The run whose secrets it carries.
    pub run_id: String,
    /// The lease under which the worker holds the run.
    pub lease_id: String,
    /// The worker it is addressed to.
    pub worker_id: String,
    /// When it was issued, Unix seconds on the control plane's clock.
    pub issued_at: i64,
    /// When it stops being valid, Unix seconds.
    pub expires_at: i64,
}

/// One credential of a tool connection: the value of one of its sealed fields, which the
/// worker attaches as the connection's kind says (a request header, a bearer token, a stdio
/// server's environment variable).
#[derive(Debug)]
pub struct ToolCredential {
    /// The tool connection it belongs to.
    pub connection_id: String,
    /// The field it is sealed under on the control plane (for example `bearer_token`,
    /// `header:X-Api-Key` or `env:API_TOKEN`), which says where it goes.
    pub field: String,
    /// Its value; zeroised on drop, `[REDACTED]` in `Debug`.
    pub value: SecretString,
}

/// The secrets of one run. Every value is a [`SecretString`]: zeroised on drop and never
/// printed by `Debug`.
#[derive(Debug)]
pub struct RunSecrets {
    /// The run's own credential (S14).
    pub run_credential: SecretString,
    /// The key of the routine's model connection, if it takes one.
    pub model_key: Option<SecretString>,
    /// The credentials of the run's tool connections.
    pub tool_credentials: Vec<ToolCredential>,
}

/// An envelope as it travels: bytes, shown by length only.
#[derive(Clone, PartialEq, Eq)]
pub struct SealedEnvelope(Vec<u8>);

impl fmt::Debug for SealedEnvelope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SealedEnvelope")
            .field("len", &self.0.len())
            .finish()
    }
}

impl SealedEnvelope {
    /// Wraps bytes received from the control plane; [`EnvelopeOpener::open`] checks them.
    pub fn from_bytes(bytes: Vec<u8>) -> Self {
        Self(bytes)
    }

    /// The byte form.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// Standard base64 of the bytes, as the internal API carries an envelope.
    pub fn to_base64(&self) -> String {
        base64::Engine::encode(&base64::engine::general_purpose::STANDARD, &self.0)
    }

    /// An envelope from its standard base64 form; [`EnvelopeError::Malformed`] when it is not
    /// base64. [`EnvelopeOpener::open`] checks the rest.
    ///
    /// # Errors
    /// [`EnvelopeError::Malformed`].
    pub fn from_base64(text: &str) -> Result<Self, EnvelopeError> {
        base64::Engine::decode(&base64::engine::general_purpose::STANDARD, text)
            .map(Self)
            .map_err(|_| EnvelopeError::Malformed {
                reason: "not standard base64",
            })
    }
}

/// An envelope that passed every check, with its secrets.
#[derive(Debug)]
pub struct OpenedEnvelope {
    /// Whom and what it is for.
    pub claims: EnvelopeClaims,
    /// Its nonce, now recorded as used.
    pub nonce: [u8; ENVELOPE_NONCE_LEN],
    /// The run's secrets.
    pub secrets: RunSecrets,
}

fn put_str<const WIDE: bool>(
    out: &mut Vec<u8>,
    value: &str,
    field: &'static str,
) -> Result<(), EnvelopeError> {
    let too_long = || EnvelopeError::FieldTooLong { field };
    if WIDE {
        let len = u32::try_from(value.len()).map_err(|_| too_long())?;
        out.extend_from_slice(&len.to_be_bytes());
    } else {
        let len = u16::try_from(value.len()).map_err(|_| too_long())?;
        out.extend_from_slice(&len.to_be_bytes());
    }
    out.extend_from_slice(value.as_bytes());
    Ok(())
}

/// A cursor over bytes that refuses to read past their end.
struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], EnvelopeError> {
        if self.rest.len() < n {
            return Err(EnvelopeError::Malformed {
                reason: "truncated",
            });
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], EnvelopeError> {
        let bytes = self.take(N)?;
        bytes.try_into().map_err(|_| EnvelopeError::Malformed {
            reason: "truncated",
        })
    }

    fn str16(&mut self) -> Result<&'a str, EnvelopeError> {
        let len = u16::from_be_bytes(self.array()?);
        self.utf8(usize::from(len))
    }

    fn str32(&mut self) -> Result<&'a str, EnvelopeError> {
        let len = u32::from_be_bytes(self.array()?);
        let len =
            usize::try_from(len).map_err(|_| EnvelopeError::Malformed { reason: "length" })?;
        self.utf8(len)
    }

    fn utf8(&mut self, len: usize) -> Result<&'a str, EnvelopeError> {
        std::str::from_utf8(self.take(len)?).map_err(|_| EnvelopeError::Malformed {
            reason: "text is not UTF-8",
        })
    }

    fn end(&self) -> Result<(), EnvelopeError> {
        if self.rest.is_empty() {
            Ok(())
        } else {
            Err(EnvelopeError::Malformed {
                reason: "trailing bytes",
            })
        }
    }
}

fn encode_secrets(secrets: &RunSecrets) -> Result<Zeroizing<Vec<u8>>, EnvelopeError> {
    // Sized up front so the buffer never reallocates and leaves a copy of a secret behind.
    let capacity = 16
        + secrets.run_credential.expose_secret().len()
        + secrets
            .model_key
            .as_ref()
            .map_or(0, |k| k.expose_secret().len() + 4)
        + secrets
            .tool_credentials
            .iter()
            .map(|c| c.connection_id.len() + c.field.len() + c.value.expose_secret().len() + 8)
            .sum::<usize>();
    let mut out = Zeroizing::new(Vec::with_capacity(capacity));
    out.push(PLAINTEXT_VERSION);
    put_str::<true>(
        &mut out,
        secrets.run_credential.expose_secret(),
        "run_credential",
    )?;
    match &secrets.model_key {
        Some(key) => {
            out.push(1);
            put_str::<true>(&mut out, key.expose_secret(), "model_key")?;
        }
        None => out.push(0),
    }
    let count =
        u16::try_from(secrets.tool_credentials.len()).map_err(|_| EnvelopeError::FieldTooLong {
            field: "tool_credentials",
        })?;
    out.extend_from_slice(&count.to_be_bytes());
    for credential in &secrets.tool_credentials {
        put_str::<false>(&mut out, &credential.connection_id, "connection_id")?;
        put_str::<false>(&mut out, &credential.field, "field")?;
        put_str::<true>(
            &mut out,
            credential.value.expose_secret(),
            "tool_credential",
        )?;
    }
    Ok(out)
}

fn decode_secrets(plaintext: &[u8]) -> Result<RunSecrets, EnvelopeError> {
    let mut reader = Reader { rest: plaintext };
    let [version] = reader.array::<1>()?;
    if version != PLAINTEXT_VERSION {
        return Err(EnvelopeError::Malformed {
            reason: "unknown secrets version",
        });
    }
    let run_credential = SecretString::from(reader.str32()?);
    let model_key = match reader.array::<1>()? {
        [0] => None,
        [1] => Some(SecretString::from(reader.str32()?)),
        _ => {
            return Err(EnvelopeError::Malformed {
                reason: "bad model key flag",
            });
        }
    };
    let count = u16::from_be_bytes(reader.array()?);
    let mut tool_credentials = Vec::new();
    for _ in 0..count {
        tool_credentials.push(ToolCredential {
            connection_id: reader.str16()?.to_owned(),
            field: reader.str16()?.to_owned(),
            value: SecretString::from(reader.str32()?),
        });
    }
    reader.end()?;
    Ok(RunSecrets {
        run_credential,
        model_key,
        tool_credentials,
    })
}

fn derive_key(
    shared: &[u8; 32],
    ephemeral_public: &[u8; 32],
    recipient_public: &[u8; 32],
) -> Result<Zeroizing<[u8; 32]>, EnvelopeError> {
    // A degenerate shared secret means a small-order key on one side.
    if shared.iter().all(|b| *b == 0) {
        return Err(EnvelopeError::UnusableWorkerKey);
    }
    let mut salt = [0u8; 64];
    for (slot, byte) in salt
        .iter_mut()
        .zip(ephemeral_public.iter().chain(recipient_public))
    {
        *slot = *byte;
    }
    let mut key = Zeroizing::new([0u8; 32]);
    Hkdf::<Sha256>::new(Some(&salt), shared)
        .expand(KDF_INFO, key.as_mut_slice())
        .map_err(|_| EnvelopeError::EncryptionFailed)?;
    Ok(key)
}

fn associated_data(header: &[u8]) -> Vec<u8> {
    let mut aad = Vec::with_capacity(AAD_LABEL.len() + header.len());
    aad.extend_from_slice(AAD_LABEL);
    aad.extend_from_slice(header);
    aad
}

fn signed_message(signed: &[u8]) -> Vec<u8> {
    let mut message = Vec::with_capacity(SIGNATURE_LABEL.len() + signed.len());
    message.extend_from_slice(SIGNATURE_LABEL);
    message.extend_from_slice(signed);
    message
}

/// Seals `secrets` to `recipient` under `claims`, signed by the control plane.
///
/// # Errors
/// [`EnvelopeError::FieldTooLong`], [`EnvelopeError::UnusableWorkerKey`],
/// [`EnvelopeError::RandomnessUnavailable`] or [`EnvelopeError::EncryptionFailed`].
pub fn seal(
    signer: &ControlPlaneSigningKey,
    recipient: &WorkerPublicKeys,
    claims: &EnvelopeClaims,
    secrets: &RunSecrets,
) -> Result<SealedEnvelope, EnvelopeError> {
    let mut nonce = [0u8; ENVELOPE_NONCE_LEN];
    getrandom::fill(&mut nonce).map_err(|_| EnvelopeError::RandomnessUnavailable)?;
    let (ephemeral, _) =
        WorkerIdentity::generate().map_err(|_| EnvelopeError::RandomnessUnavailable)?;
    let ephemeral_public = *ephemeral.public_keys().exchange();
    let shared = ephemeral.exchange_with(recipient.exchange());
    let key = derive_key(&shared, &ephemeral_public, recipient.exchange())?;

    let mut bytes = Vec::new();
    bytes.extend_from_slice(MAGIC);
    bytes.push(VERSION);
    put_str::<false>(&mut bytes, &claims.run_id, "run_id")?;
    put_str::<false>(&mut bytes, &claims.lease_id, "lease_id")?;
    put_str::<false>(&mut bytes, &claims.worker_id, "worker_id")?;
    bytes.extend_from_slice(&claims.issued_at.to_be_bytes());
    bytes.extend_from_slice(&claims.expires_at.to_be_bytes());
    bytes.extend_from_slice(&nonce);
    bytes.extend_from_slice(&ephemeral_public);
    let plaintext = encode_secrets(secrets)?;
    let (aead_nonce, ciphertext) =
        seal_with_single_use_key(&key, &associated_data(&bytes), &plaintext)
            .map_err(|_| EnvelopeError::EncryptionFailed)?;
    bytes.extend_from_slice(&aead_nonce);
    let len = u32::try_from(ciphertext.len()).map_err(|_| EnvelopeError::FieldTooLong {
        field: "ciphertext",
    })?;
    bytes.extend_from_slice(&len.to_be_bytes());
    bytes.extend_from_slice(&ciphertext);
    let signature = signer.sign(&signed_message(&bytes));
    bytes.extend_from_slice(&signature.to_bytes());
    Ok(SealedEnvelope(bytes))
}

/// Nonces of envelopes already opened, each kept until its envelope expires (plus the skew),
/// so the cache holds at most the envelopes of one maximum lifetime.
#[derive(Debug, Default)]
pub struct ReplayCache {
    seen: HashMap<[u8; ENVELOPE_NONCE_LEN], i64>,
}

impl ReplayCache {
    fn forget_expired(&mut self, now: i64) {
        self.seen.retain(|_, keep_until| *keep_until >= now);
    }

    fn contains(&self, nonce: &[u8; ENVELOPE_NONCE_LEN]) -> bool {
        self.seen.contains_key(nonce)
    }

    fn insert(&mut self, nonce: [u8; ENVELOPE_NONCE_LEN], keep_until: i64) {
        self.seen.insert(nonce, keep_until);
    }

    /// How many nonces are remembered.
    pub fn len(&self) -> usize {
        self.seen.len()
    }

    /// Whether no nonce is remembered.
    pub fn is_empty(&self) -> bool {
        self.seen.is_empty()
    }
}

/// A worker's side: its identity, its id, the control plane's key it pinned at enrolment, its
/// limits and its replay cache.
#[derive(Debug)]
pub struct EnvelopeOpener {
    identity: WorkerIdentity,
    worker_id: String,
    control_plane: VerifyingKey,
    limits: EnvelopeLimits,
    replay: ReplayCache,
}

struct Parsed<'a> {
    run_id: &'a str,
    lease_id: &'a str,
    worker_id: &'a str,
    issued_at: i64,
    expires_at: i64,
    nonce: [u8; ENVELOPE_NONCE_LEN],
    ephemeral_public: [u8; 32],
    header: &'a [u8],
    aead_nonce: [u8; NONCE_LEN],
    ciphertext: &'a [u8],
}

fn parse(signed: &[u8]) -> Result<Parsed<'_>, EnvelopeError> {
    let mut reader = Reader { rest: signed };
    if reader.take(MAGIC.len())? != MAGIC {
        return Err(EnvelopeError::Malformed {
            reason: "wrong magic bytes",
        });
    }
    if reader.array::<1>()? != [VERSION] {
        return Err(EnvelopeError::Malformed {
            reason: "unknown version",
        });
    }
    let run_id = reader.str16()?;
    let lease_id = reader.str16()?;
    let worker_id = reader.str16()?;
    let issued_at = i64::from_be_bytes(reader.array()?);
    let expires_at = i64::from_be_bytes(reader.array()?);
    let nonce = reader.array()?;
    let ephemeral_public = reader.array()?;
    let header_len = signed.len() - reader.rest.len();
    let header = signed.get(..header_len).ok_or(EnvelopeError::Malformed {
        reason: "truncated",
    })?;
    let aead_nonce = reader.array()?;
    let len = u32::from_be_bytes(reader.array()?);
    let len = usize::try_from(len).map_err(|_| EnvelopeError::Malformed { reason: "length" })?;
    let ciphertext = reader.take(len)?;
    if ciphertext.len() < TAG_LEN {
        return Err(EnvelopeError::Malformed {
            reason: "ciphertext shorter than its tag",
        });
    }
    reader.end()?;
    Ok(Parsed {
        run_id,
        lease_id,
        worker_id,
        issued_at,
        expires_at,
        nonce,
        ephemeral_public,
        header,
        aead_nonce,
        ciphertext,
    })
}

impl EnvelopeOpener {
    /// An opener for the worker `worker_id` holding `identity`, trusting envelopes signed by
    /// `control_plane`.
    pub fn new(
        identity: WorkerIdentity,
        worker_id: impl Into<String>,
        control_plane: VerifyingKey,
        limits: EnvelopeLimits,
    ) -> Self {
        Self {
            identity,
            worker_id: worker_id.into(),
            control_plane,
            limits,
            replay: ReplayCache::default(),
        }
    }

    /// The nonces remembered so far.
    pub fn replay_cache(&self) -> &ReplayCache {
        &self.replay
    }

    /// Checks `envelope` at time `now` (Unix seconds on this worker's clock) and returns its
    /// claims and secrets; its nonce is then remembered until it expires.
    ///
    /// # Errors
    /// The first check that fails, as an [`EnvelopeError`].
    pub fn open(
        &mut self,
        envelope: &SealedEnvelope,
        now: i64,
    ) -> Result<OpenedEnvelope, EnvelopeError> {
        let bytes = envelope.as_bytes();
        if bytes.len() > self.limits.max_bytes {
            return Err(EnvelopeError::Oversized {
                actual: bytes.len(),
                limit: self.limits.max_bytes,
            });
        }
        let split = bytes
            .len()
            .checked_sub(SIGNATURE_LEN)
            .ok_or(EnvelopeError::Malformed {
                reason: "shorter than a signature",
            })?;
        let (signed, signature) = bytes.split_at(split);
        let signature: [u8; SIGNATURE_LEN] =
            signature.try_into().map_err(|_| EnvelopeError::Malformed {
                reason: "shorter than a signature",
            })?;
        self.control_plane
            .verify_strict(&signed_message(signed), &Signature::from_bytes(&signature))
            .map_err(|_| EnvelopeError::Tampered)?;
        let parsed = parse(signed)?;

        if parsed.worker_id != self.worker_id {
            return Err(EnvelopeError::WrongAudience {
                addressed_to: parsed.worker_id.to_owned(),
                this_worker: self.worker_id.clone(),
            });
        }
        let lifetime = parsed.expires_at.saturating_sub(parsed.issued_at);
        if lifetime <= 0 || lifetime > self.limits.max_lifetime_secs {
            return Err(EnvelopeError::LifetimeOutOfBounds {
                lifetime_secs: lifetime,
                limit_secs: self.limits.max_lifetime_secs,
            });
        }
        let skew = self.limits.max_clock_skew_secs;
        if parsed.issued_at > now.saturating_add(skew) {
            return Err(EnvelopeError::NotYetValid {
                issued_at: parsed.issued_at,
                now,
                skew_secs: skew,
            });
        }
        let keep_until = parsed.expires_at.saturating_add(skew);
        if now > keep_until {
            return Err(EnvelopeError::Expired {
                expires_at: parsed.expires_at,
                now,
            });
        }
        self.replay.forget_expired(now);
        if self.replay.contains(&parsed.nonce) {
            return Err(EnvelopeError::Replayed);
        }

        let own_public = *self.identity.public_keys().exchange();
        let shared = self.identity.exchange_with(&parsed.ephemeral_public);
        let key = derive_key(&shared, &parsed.ephemeral_public, &own_public)
            .map_err(|_| EnvelopeError::NotSealedToThisWorker)?;
        let plaintext = open_with_single_use_key(
            &key,
            &parsed.aead_nonce,
            &associated_data(parsed.header),
            parsed.ciphertext,
        )
        .map_err(|_| EnvelopeError::NotSealedToThisWorker)?;
        let secrets = decode_secrets(&plaintext)?;
        self.replay.insert(parsed.nonce, keep_until);
        Ok(OpenedEnvelope {
            claims: EnvelopeClaims {
                run_id: parsed.run_id.to_owned(),
                lease_id: parsed.lease_id.to_owned(),
                worker_id: parsed.worker_id.to_owned(),
                issued_at: parsed.issued_at,
                expires_at: parsed.expires_at,
            },
            nonce: parsed.nonce,
            secrets,
        })
    }
}
