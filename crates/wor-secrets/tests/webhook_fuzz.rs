//! Fuzzing webhook signature verification, both schemes (`wor` and Standard Webhooks), with
//! proptest: arbitrary secrets, headers, bodies and timestamps never panic; a signature made
//! by `sign` verifies anywhere inside the replay window; and any single-byte change to the
//! body, the timestamp, the message id or the signature makes verification fail.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic,
    reason = "tests fail loudly"
)]

use proptest::prelude::*;
use wor_secrets::webhook_signature::{SignatureError, StandardWebhookSecret, sign, verify};

const WINDOW: u64 = 300;

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// Timestamps a sender could plausibly use, and the extremes.
fn timestamp() -> impl Strategy<Value = i64> {
    prop_oneof![
        0i64..4_000_000_000,
        any::<i64>(),
        Just(i64::MIN),
        Just(i64::MAX),
        Just(0),
    ]
}

/// `text` with the byte at `at` (modulo its length) replaced by `byte`.
fn replace_byte(text: &[u8], at: usize, byte: u8) -> Vec<u8> {
    let mut changed = text.to_vec();
    let index = at % changed.len();
    changed[index] = byte;
    changed
}

/// A valid Standard Webhooks secret from `bytes`.
fn standard_secret(bytes: &[u8]) -> StandardWebhookSecret {
    use base64::Engine as _;
    let encoded = base64::engine::general_purpose::STANDARD.encode(bytes);
    StandardWebhookSecret::parse(&format!("whsec_{encoded}")).unwrap()
}

proptest! {
    #![proptest_config(config(1000))]

    /// Nothing a sender controls panics the `wor` scheme's verification.
    #[test]
    fn wor_verification_never_panics(
        secret in any::<String>(),
        timestamp in timestamp(),
        body in prop::collection::vec(any::<u8>(), 0..256),
        signature in prop_oneof![any::<String>(), "[0-9a-fA-F \t]{0,70}"],
        now in timestamp(),
        window in prop_oneof![Just(WINDOW), any::<u64>()],
    ) {
        let _ = verify(&secret, timestamp, &body, &signature, now, window);
    }

    /// Nothing a sender controls panics Standard Webhooks: the secret, the id, the header with
    /// any number of entries of any version.
    #[test]
    fn standard_verification_never_panics(
        secret in prop_oneof![any::<String>(), "(whsec_)?[A-Za-z0-9+/=]{0,48}"],
        id in any::<String>(),
        timestamp in timestamp(),
        body in prop::collection::vec(any::<u8>(), 0..256),
        header in prop_oneof![
            any::<String>(),
            "((v[0-9],|,)?[A-Za-z0-9+/=]{0,50}[ \t]{0,2}){0,5}",
        ],
        now in timestamp(),
    ) {
        if let Ok(secret) = StandardWebhookSecret::parse(&secret) {
            let _ = secret.verify(&id, timestamp, &body, &header, now, WINDOW);
            let _ = secret.sign(&id, timestamp, &body);
        }
    }

    /// A `wor` signature verifies inside the window, in either case; one changed byte of the
    /// body, a different timestamp, or one changed byte of the signature fails.
    #[test]
    fn wor_signatures_verify_and_any_change_fails(
        secret in "[ -~]{1,64}",
        timestamp in 0i64..4_000_000_000,
        skew in -(WINDOW as i64)..=(WINDOW as i64),
        body in prop::collection::vec(any::<u8>(), 1..256),
        at in any::<usize>(),
        byte in any::<u8>(),
        other_timestamp in 0i64..4_000_000_000,
        sig_byte in 0x21u8..0x7f,
    ) {
        let now = timestamp + skew;
        let signature = sign(&secret, timestamp, &body);
        prop_assert_eq!(verify(&secret, timestamp, &body, &signature, now, WINDOW), Ok(()));
        prop_assert_eq!(
            verify(&secret, timestamp, &body, &signature.to_uppercase(), now, WINDOW),
            Ok(())
        );

        let changed_body = replace_byte(&body, at, byte);
        if changed_body != body {
            prop_assert_eq!(
                verify(&secret, timestamp, &changed_body, &signature, now, WINDOW),
                Err(SignatureError::Mismatch)
            );
        }
        if other_timestamp != timestamp {
            // Judged inside the window, so only the signature can refuse it.
            prop_assert_eq!(
                verify(&secret, other_timestamp, &body, &signature, other_timestamp, WINDOW),
                Err(SignatureError::Mismatch)
            );
        }
        let changed_signature = replace_byte(signature.as_bytes(), at, sig_byte);
        let changed_signature = String::from_utf8(changed_signature).unwrap();
        // A hex digit in the other case is the same signature.
        if !changed_signature.eq_ignore_ascii_case(&signature) {
            prop_assert!(
                verify(&secret, timestamp, &body, &changed_signature, now, WINDOW).is_err(),
                "`{}` verified in place of `{}`", changed_signature, signature
            );
        }
    }

    /// A Standard Webhooks signature verifies inside the window, also among other entries; one
    /// changed byte of the id, the body, the timestamp or the header fails.
    #[test]
    fn standard_signatures_verify_and_any_change_fails(
        key in prop::collection::vec(any::<u8>(), 1..64),
        id in "[ -~]{1,40}",
        timestamp in 0i64..4_000_000_000,
        skew in -(WINDOW as i64)..=(WINDOW as i64),
        body in prop::collection::vec(any::<u8>(), 1..256),
        at in any::<usize>(),
        byte in any::<u8>(),
        other_timestamp in 0i64..4_000_000_000,
        header_byte in 0x20u8..0x7f,
        noise in prop::collection::vec((0u8..10, prop::collection::vec(any::<u8>(), 1..40)), 0..4),
    ) {
        let secret = standard_secret(&key);
        let now = timestamp + skew;
        let header = secret.sign(&id, timestamp, &body);
        prop_assert_eq!(secret.verify(&id, timestamp, &body, &header, now, WINDOW), Ok(()));
        // Entries of other versions and other keys next to the valid one do not hide it.
        let mut crowded: Vec<String> = noise
            .iter()
            .map(|(version, tag)| {
                use base64::Engine as _;
                format!("v{version},{}", base64::engine::general_purpose::STANDARD.encode(tag))
            })
            .collect();
        crowded.insert(at % (crowded.len() + 1), header.clone());
        let crowded = crowded.join(" ");
        prop_assert_eq!(secret.verify(&id, timestamp, &body, &crowded, now, WINDOW), Ok(()));

        let changed_body = replace_byte(&body, at, byte);
        if changed_body != body {
            prop_assert_eq!(
                secret.verify(&id, timestamp, &changed_body, &header, now, WINDOW),
                Err(SignatureError::Mismatch)
            );
        }
        let changed_id = String::from_utf8(replace_byte(id.as_bytes(), at, header_byte)).unwrap();
        if changed_id != id {
            prop_assert_eq!(
                secret.verify(&changed_id, timestamp, &body, &header, now, WINDOW),
                Err(SignatureError::Mismatch)
            );
        }
        if other_timestamp != timestamp {
            prop_assert_eq!(
                secret.verify(&id, other_timestamp, &body, &header, other_timestamp, WINDOW),
                Err(SignatureError::Mismatch)
            );
        }
        let changed_header =
            String::from_utf8(replace_byte(header.as_bytes(), at, header_byte)).unwrap();
        if changed_header != header {
            prop_assert!(
                secret.verify(&id, timestamp, &body, &changed_header, now, WINDOW).is_err(),
                "`{}` verified in place of `{}`", changed_header, header
            );
        }
    }

    /// Outside the window nothing verifies, however valid the signature.
    #[test]
    fn signatures_outside_the_window_are_refused(
        secret in "[ -~]{1,64}",
        timestamp in 0i64..4_000_000_000,
        beyond in (WINDOW as i64 + 1)..1_000_000,
        later in any::<bool>(),
        body in prop::collection::vec(any::<u8>(), 0..64),
    ) {
        let now = if later { timestamp + beyond } else { timestamp - beyond };
        let signature = sign(&secret, timestamp, &body);
        let wor = verify(&secret, timestamp, &body, &signature, now, WINDOW);
        prop_assert!(
            matches!(
                wor,
                Err(SignatureError::StaleTimestamp { .. } | SignatureError::FutureTimestamp { .. })
            ),
            "{:?}", wor
        );
        let standard = standard_secret(secret.as_bytes());
        let header = standard.sign("msg_1", timestamp, &body);
        let verdict = standard.verify("msg_1", timestamp, &body, &header, now, WINDOW);
        prop_assert!(
            matches!(
                verdict,
                Err(SignatureError::StaleTimestamp { .. } | SignatureError::FutureTimestamp { .. })
            ),
            "{:?}", verdict
        );
    }
}

/// The MACs are compared only by `hmac`'s `verify_slice`, which compares in constant time
/// (`subtle`): neither verifying function ever materialises the expected MAC (`finalize`), so
/// there is nothing it could compare with `==`.
#[test]
fn verification_compares_macs_only_in_constant_time() {
    let source = include_str!("../src/webhook_signature.rs");
    let code = source.split("#[cfg(test)]").next().unwrap();
    let bodies: Vec<&str> = code
        .match_indices("pub fn verify(")
        .map(|(start, _)| {
            let rest = &code[start..];
            // The function ends at the first line that closes a block at its indentation.
            let indent = code[..start].rsplit('\n').next().unwrap();
            let end = rest
                .find(&format!("\n{indent}}}\n"))
                .expect("the function's closing brace");
            &rest[..end]
        })
        .collect();
    assert_eq!(
        bodies.len(),
        2,
        "both schemes' `verify` functions are found"
    );
    for body in bodies {
        assert!(body.contains(".verify_slice("), "{body}");
        assert!(!body.contains("finalize"), "{body}");
    }
}
