//! Slack's request signatures: `v0=` and the lower-case hex HMAC-SHA256 of
//! `v0:{timestamp}:{raw body}`, keyed by the UTF-8 bytes of the app's signing secret, with the
//! timestamp in `X-Slack-Request-Timestamp` and the signature in `X-Slack-Signature`.
//!
//! Verification checks the timestamp against a replay window first, then compares MACs in
//! constant time (`verify_slice`). The secret is never printed.

use hmac::{Hmac, KeyInit as _, Mac as _};
use sha2::Sha256;

use crate::SignatureError;

type HmacSha256 = Hmac<Sha256>;

/// The only version of Slack's signature scheme.
const VERSION: &str = "v0";

fn slack_mac(signing_secret: &str, timestamp: i64, body: &[u8]) -> HmacSha256 {
    #[expect(
        clippy::expect_used,
        reason = "HMAC accepts keys of every length; new_from_slice cannot fail"
    )]
    let mut mac =
        HmacSha256::new_from_slice(signing_secret.as_bytes()).expect("hmac accepts any key");
    mac.update(VERSION.as_bytes());
    mac.update(b":");
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b":");
    mac.update(body);
    mac
}

/// Signs a request as Slack does: the `X-Slack-Signature` value `v0=<hex>`.
pub fn sign(signing_secret: &str, timestamp: i64, body: &[u8]) -> String {
    let tag = slack_mac(signing_secret, timestamp, body)
        .finalize()
        .into_bytes();
    format!("{VERSION}={}", hex::encode(tag))
}

/// Verifies an `X-Slack-Signature` over the unmodified body. `timestamp` must be within
/// `window_secs` of `now` (Unix seconds), in either direction.
///
/// # Errors
/// [`SignatureError::StaleTimestamp`], [`SignatureError::FutureTimestamp`],
/// [`SignatureError::MalformedSignature`] or [`SignatureError::Mismatch`].
pub fn verify(
    signing_secret: &str,
    timestamp: i64,
    body: &[u8],
    signature: &str,
    now: i64,
    window_secs: u64,
) -> Result<(), SignatureError> {
    crate::webhook_signature::check_window(timestamp, now, window_secs)?;
    let Some(hex_tag) = signature.trim().strip_prefix("v0=") else {
        return Err(SignatureError::MalformedSignature {
            reason: "expected `v0=` followed by hex",
        });
    };
    let tag = hex::decode(hex_tag).map_err(|_| SignatureError::MalformedSignature {
        reason: "not hexadecimal",
    })?;
    if tag.len() != 32 {
        return Err(SignatureError::MalformedSignature {
            reason: "expected 64 hex digits",
        });
    }
    slack_mac(signing_secret, timestamp, body)
        .verify_slice(&tag)
        .map_err(|_| SignatureError::Mismatch)
}

#[cfg(test)]
mod tests {
    use super::*;

    // Slack's published worked example (`testdata/SOURCES.md` names its source).
    const VECTORS: &str = include_str!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../testdata/webhooks/slack-signature.json"
    ));

    #[test]
    fn slacks_published_example_signs_and_verifies() {
        let doc: serde_json::Value = serde_json::from_str(VECTORS).unwrap();
        let vectors = doc["vectors"].as_array().unwrap();
        assert!(!vectors.is_empty());
        for v in vectors {
            let secret = v["signing_secret"].as_str().unwrap();
            let timestamp = v["timestamp"].as_i64().unwrap();
            let body = v["body"].as_str().unwrap().as_bytes();
            let signature = v["signature"].as_str().unwrap();
            assert_eq!(sign(secret, timestamp, body), signature);
            verify(secret, timestamp, body, signature, timestamp + 60, 300).unwrap();
            // Upper-case hex is the same MAC.
            let upper = format!("v0={}", signature[3..].to_uppercase());
            verify(secret, timestamp, body, &upper, timestamp, 300).unwrap();
            // One byte changed anywhere fails.
            let mut tampered = body.to_vec();
            tampered[0] ^= 1;
            assert_eq!(
                verify(secret, timestamp, &tampered, signature, timestamp, 300),
                Err(SignatureError::Mismatch)
            );
            assert_eq!(
                verify("another-secret", timestamp, body, signature, timestamp, 300),
                Err(SignatureError::Mismatch)
            );
            assert_eq!(
                verify(secret, timestamp + 1, body, signature, timestamp, 300),
                Err(SignatureError::Mismatch)
            );
            // Outside the window, either way, before any MAC is computed.
            assert!(matches!(
                verify(secret, timestamp, body, signature, timestamp + 301, 300),
                Err(SignatureError::StaleTimestamp { .. })
            ));
            assert!(matches!(
                verify(secret, timestamp, body, signature, timestamp - 301, 300),
                Err(SignatureError::FutureTimestamp { .. })
            ));
            for malformed in ["", "v1=00", "a2114d57", "v0=zz", "v0=abcd"] {
                assert!(matches!(
                    verify(secret, timestamp, body, malformed, timestamp, 300),
                    Err(SignatureError::MalformedSignature { .. })
                ));
            }
        }
    }
}
