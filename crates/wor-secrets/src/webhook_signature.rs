//! HMAC-SHA256 webhook signatures: the `wor` scheme and Standard Webhooks.
//!
//! The `wor` scheme signs `${timestamp}.` followed by the raw body, keyed by the UTF-8 bytes of
//! the secret, as lower-case hex. Standard Webhooks signs `${id}.${timestamp}.${body}`, keyed by
//! the base64 bytes after `whsec_`, as `v1,<base64>`. Verification checks the timestamp against
//! a replay window first, then compares MACs in constant time.

use std::fmt;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use hmac::{Hmac, KeyInit as _, Mac as _};
use secrecy::{ExposeSecret as _, SecretSlice};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

/// Prefix of a Standard Webhooks secret.
const STANDARD_SECRET_PREFIX: &str = "whsec_";
/// Version tag of the only Standard Webhooks signature scheme (HMAC-SHA256).
const STANDARD_SIGNATURE_VERSION: &str = "v1";

/// Why a webhook signature was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SignatureError {
    /// The timestamp is older than the replay window allows.
    #[error("webhook timestamp {timestamp} is {age_secs} s old, beyond the {window_secs} s window")]
    StaleTimestamp {
        /// The timestamp received.
        timestamp: i64,
        /// How far behind `now` it is.
        age_secs: u64,
        /// The window allowed.
        window_secs: u64,
    },
    /// The timestamp is further in the future than the replay window allows.
    #[error(
        "webhook timestamp {timestamp} is {ahead_secs} s in the future, beyond the {window_secs} s window"
    )]
    FutureTimestamp {
        /// The timestamp received.
        timestamp: i64,
        /// How far ahead of `now` it is.
        ahead_secs: u64,
        /// The window allowed.
        window_secs: u64,
    },
    /// The signature is not in the expected encoding.
    #[error("webhook signature is malformed: {reason}")]
    MalformedSignature {
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The signature is well formed but does not match the body.
    #[error("webhook signature does not match")]
    Mismatch,
    /// A Standard Webhooks secret is not `whsec_` followed by base64 (it is not echoed).
    #[error("webhook secret is not `whsec_` followed by standard base64")]
    InvalidSecret,
}

fn mac_for(key: &[u8]) -> HmacSha256 {
    #[expect(
        clippy::expect_used,
        reason = "HMAC accepts keys of every length; new_from_slice cannot fail"
    )]
    HmacSha256::new_from_slice(key).expect("hmac accepts any key length")
}

/// A signed request's timestamp header as Unix seconds: decimal digits alone (around any white
/// space), no sign and no leading zero, within `i64`. What a signature covers is the value
/// this reads, so no other spelling of it is taken.
pub fn parse_timestamp(header: &str) -> Option<i64> {
    let digits = header.trim();
    let canonical = !digits.is_empty()
        && digits.bytes().all(|b| b.is_ascii_digit())
        && (digits == "0" || !digits.starts_with('0'));
    if !canonical {
        return None;
    }
    digits.parse().ok()
}

pub(crate) fn check_window(
    timestamp: i64,
    now: i64,
    window_secs: u64,
) -> Result<(), SignatureError> {
    let distance = now.abs_diff(timestamp);
    if distance <= window_secs {
        return Ok(());
    }
    if timestamp < now {
        Err(SignatureError::StaleTimestamp {
            timestamp,
            age_secs: distance,
            window_secs,
        })
    } else {
        Err(SignatureError::FutureTimestamp {
            timestamp,
            ahead_secs: distance,
            window_secs,
        })
    }
}

fn wor_mac(secret: &str, timestamp: i64, body: &[u8]) -> HmacSha256 {
    let mut mac = mac_for(secret.as_bytes());
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    mac
}

/// A new routine webhook secret: `whsec_` and the standard base64 of 32 random bytes. The same
/// text keys both schemes: the `wor` scheme uses its UTF-8 bytes, Standard Webhooks the bytes
/// after `whsec_`.
///
/// # Errors
/// [`crate::SecretsError::RandomnessUnavailable`] when the system has no randomness to give.
pub fn generate_secret() -> Result<secrecy::SecretString, crate::SecretsError> {
    let mut bytes = zeroize::Zeroizing::new([0u8; 32]);
    getrandom::fill(bytes.as_mut_slice())
        .map_err(|_| crate::SecretsError::RandomnessUnavailable)?;
    Ok(format!(
        "{STANDARD_SECRET_PREFIX}{}",
        STANDARD.encode(bytes.as_slice())
    )
    .into())
}

/// Signs a run webhook in the `wor` scheme: lower-case hex HMAC-SHA256 of `${timestamp}.${body}`.
pub fn sign(secret: &str, timestamp: i64, body: &[u8]) -> String {
    hex::encode(wor_mac(secret, timestamp, body).finalize().into_bytes())
}

/// Verifies a `wor` scheme signature over the unmodified body.
///
/// `timestamp` must be within `window_secs` of `now` (both Unix seconds), in either direction.
/// The hex signature may be upper or lower case; the MAC comparison is constant time.
///
/// # Errors
/// [`SignatureError::StaleTimestamp`], [`SignatureError::FutureTimestamp`],
/// [`SignatureError::MalformedSignature`] or [`SignatureError::Mismatch`].
pub fn verify(
    secret: &str,
    timestamp: i64,
    body: &[u8],
    signature_hex: &str,
    now: i64,
    window_secs: u64,
) -> Result<(), SignatureError> {
    check_window(timestamp, now, window_secs)?;
    let tag =
        hex::decode(signature_hex.trim()).map_err(|_| SignatureError::MalformedSignature {
            reason: "not hexadecimal",
        })?;
    if tag.len() != 32 {
        return Err(SignatureError::MalformedSignature {
            reason: "expected 64 hex digits",
        });
    }
    wor_mac(secret, timestamp, body)
        .verify_slice(&tag)
        .map_err(|_| SignatureError::Mismatch)
}

/// A Standard Webhooks signing secret (`whsec_<base64>`), held in zeroizing memory.
pub struct StandardWebhookSecret {
    key: SecretSlice<u8>,
}

impl fmt::Debug for StandardWebhookSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("StandardWebhookSecret([REDACTED])")
    }
}

impl StandardWebhookSecret {
    /// Parses `whsec_<base64>`. As in the reference libraries, a bare base64 secret without
    /// the prefix is accepted too.
    ///
    /// # Errors
    /// [`SignatureError::InvalidSecret`] if the rest is not standard base64 or is empty.
    pub fn parse(secret: &str) -> Result<Self, SignatureError> {
        let encoded = secret
            .strip_prefix(STANDARD_SECRET_PREFIX)
            .unwrap_or(secret);
        let key = STANDARD
            .decode(encoded)
            .map_err(|_| SignatureError::InvalidSecret)?;
        if key.is_empty() {
            return Err(SignatureError::InvalidSecret);
        }
        Ok(Self {
            key: SecretSlice::from(key),
        })
    }

    fn mac(&self, id: &str, timestamp: i64, body: &[u8]) -> HmacSha256 {
        let mut mac = mac_for(self.key.expose_secret());
        mac.update(id.as_bytes());
        mac.update(b".");
        mac.update(timestamp.to_string().as_bytes());
        mac.update(b".");
        mac.update(body);
        mac
    }

    /// Signs a message: the `webhook-signature` header value `v1,<base64>`.
    pub fn sign(&self, id: &str, timestamp: i64, body: &[u8]) -> String {
        let tag = self.mac(id, timestamp, body).finalize().into_bytes();
        format!("{STANDARD_SIGNATURE_VERSION},{}", STANDARD.encode(tag))
    }

    /// Verifies a `webhook-signature` header: space-separated `version,base64` entries, of which
    /// at least one `v1` entry must match. Entries of other versions are ignored.
    ///
    /// # Errors
    /// [`SignatureError::StaleTimestamp`], [`SignatureError::FutureTimestamp`],
    /// [`SignatureError::MalformedSignature`] when no `v1` entry is present or one is not
    /// base64, or [`SignatureError::Mismatch`].
    pub fn verify(
        &self,
        id: &str,
        timestamp: i64,
        body: &[u8],
        header: &str,
        now: i64,
        window_secs: u64,
    ) -> Result<(), SignatureError> {
        check_window(timestamp, now, window_secs)?;
        let expected = self.mac(id, timestamp, body);
        let mut saw_v1 = false;
        let mut matched = false;
        for entry in header.split_ascii_whitespace() {
            let Some((version, encoded)) = entry.split_once(',') else {
                continue;
            };
            if version != STANDARD_SIGNATURE_VERSION {
                continue;
            }
            saw_v1 = true;
            let tag = STANDARD
                .decode(encoded)
                .map_err(|_| SignatureError::MalformedSignature {
                    reason: "v1 signature is not standard base64",
                })?;
            // Every candidate is checked, in constant time each, without stopping early.
            matched |= expected.clone().verify_slice(&tag).is_ok();
        }
        match (saw_v1, matched) {
            (_, true) => Ok(()),
            (false, false) => Err(SignatureError::MalformedSignature {
                reason: "no `v1,` signature entry",
            }),
            (true, false) => Err(SignatureError::Mismatch),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_timestamp_is_read_only_as_plain_decimal_digits() {
        for (header, seconds) in [("1700000000", 1_700_000_000), (" 12 ", 12), ("0", 0)] {
            assert_eq!(parse_timestamp(header), Some(seconds), "{header:?}");
        }
        for header in [
            "",
            " ",
            "+12",
            "-12",
            "012",
            "00",
            "12.0",
            "1e3",
            "0x1f",
            "1 2",
            "99999999999999999999",
        ] {
            assert_eq!(parse_timestamp(header), None, "{header:?}");
        }
    }

    fn corpus(name: &str) -> serde_json::Value {
        let text = match name {
            "run-webhook-signature.json" => RUN_WEBHOOK_VECTORS,
            "standard-webhooks.json" => STANDARD_WEBHOOKS_VECTORS,
            other => panic!("no webhook corpus named `{other}`"),
        };
        serde_json::from_str(text).unwrap()
    }

    // The vectors live in the repository (`testdata/SOURCES.md` names their sources).
    const RUN_WEBHOOK_VECTORS: &str = include_str!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../testdata/webhooks/run-webhook-signature.json"
    ));
    const STANDARD_WEBHOOKS_VECTORS: &str = include_str!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../testdata/webhooks/standard-webhooks.json"
    ));

    fn vectors(doc: &serde_json::Value) -> &Vec<serde_json::Value> {
        let vectors = doc["vectors"].as_array().unwrap();
        assert!(!vectors.is_empty(), "corpus has no vectors");
        vectors
    }

    const WINDOW: u64 = 300;

    #[test]
    fn wor_scheme_matches_every_corpus_vector() {
        let doc = corpus("run-webhook-signature.json");
        for v in vectors(&doc) {
            let secret = v["secret"].as_str().unwrap();
            let timestamp = v["timestamp"].as_i64().unwrap();
            let body = v["body"].as_str().unwrap().as_bytes();
            let expected = v["signature_hex"].as_str().unwrap();
            assert_eq!(sign(secret, timestamp, body), expected);
            verify(secret, timestamp, body, expected, timestamp + 10, WINDOW).unwrap();
            let upper = expected.to_uppercase();
            verify(secret, timestamp, body, &upper, timestamp, WINDOW).unwrap();

            let mut tampered = body.to_vec();
            tampered.push(b' ');
            assert_eq!(
                verify(secret, timestamp, &tampered, expected, timestamp, WINDOW),
                Err(SignatureError::Mismatch)
            );
            assert_eq!(
                verify("wrong secret", timestamp, body, expected, timestamp, WINDOW),
                Err(SignatureError::Mismatch)
            );
            // The timestamp is signed: a replay with a fresh timestamp fails.
            assert_eq!(
                verify(secret, timestamp + 1, body, expected, timestamp, WINDOW),
                Err(SignatureError::Mismatch)
            );
            assert!(matches!(
                verify(secret, timestamp, body, expected, timestamp + 301, WINDOW),
                Err(SignatureError::StaleTimestamp { age_secs: 301, .. })
            ));
            assert!(matches!(
                verify(secret, timestamp, body, expected, timestamp - 301, WINDOW),
                Err(SignatureError::FutureTimestamp {
                    ahead_secs: 301,
                    ..
                })
            ));
        }
    }

    #[test]
    fn wor_scheme_rejects_malformed_signatures() {
        for bad in ["", "zz", "abcd", &"0".repeat(66)] {
            assert!(
                matches!(
                    verify("s", 1, b"{}", bad, 1, WINDOW),
                    Err(SignatureError::MalformedSignature { .. })
                ),
                "`{bad}`"
            );
        }
    }

    #[test]
    fn standard_webhooks_matches_every_corpus_vector() {
        let doc = corpus("standard-webhooks.json");
        for v in vectors(&doc) {
            let secret = StandardWebhookSecret::parse(v["secret"].as_str().unwrap()).unwrap();
            let id = v["id"].as_str().unwrap();
            let timestamp = v["timestamp"].as_i64().unwrap();
            let body = v["body"].as_str().unwrap().as_bytes();
            let expected = v["signature"].as_str().unwrap();
            assert_eq!(secret.sign(id, timestamp, body), expected);
            secret
                .verify(id, timestamp, body, expected, timestamp, WINDOW)
                .unwrap();
            // Several entries, the matching one last, an unknown version first.
            let several = format!("v1a,AAAA v1,Zm9vYmFy {expected}");
            secret
                .verify(id, timestamp, body, &several, timestamp, WINDOW)
                .unwrap();

            assert_eq!(
                secret.verify(id, timestamp, b"{\"test\": 1}", expected, timestamp, WINDOW),
                Err(SignatureError::Mismatch)
            );
            assert_eq!(
                secret.verify("msg_other", timestamp, body, expected, timestamp, WINDOW),
                Err(SignatureError::Mismatch)
            );
            let wrong = StandardWebhookSecret::parse("whsec_c2VjcmV0LWtleS1vdGhlcg==").unwrap();
            assert_eq!(
                wrong.verify(id, timestamp, body, expected, timestamp, WINDOW),
                Err(SignatureError::Mismatch)
            );
            assert!(matches!(
                secret.verify(id, timestamp, body, expected, timestamp + 3600, WINDOW),
                Err(SignatureError::StaleTimestamp { .. })
            ));
            assert!(matches!(
                secret.verify(id, timestamp, body, "v2,abc", timestamp, WINDOW),
                Err(SignatureError::MalformedSignature { .. })
            ));
            assert!(matches!(
                secret.verify(id, timestamp, body, "v1,@@@", timestamp, WINDOW),
                Err(SignatureError::MalformedSignature { .. })
            ));
        }
    }

    #[test]
    fn standard_secret_parsing_and_debug() {
        assert_eq!(
            StandardWebhookSecret::parse("whsec_!!").unwrap_err(),
            SignatureError::InvalidSecret
        );
        assert!(StandardWebhookSecret::parse("whsec_").is_err());
        let raw = "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
        let bare = StandardWebhookSecret::parse(raw).unwrap();
        let prefixed = StandardWebhookSecret::parse(&format!("whsec_{raw}")).unwrap();
        assert_eq!(bare.sign("m", 1, b"b"), prefixed.sign("m", 1, b"b"));
        let rendered = format!("{prefixed:?}");
        assert!(!rendered.contains(raw));
        assert!(rendered.contains("REDACTED"));
    }
}
