//! Run envelopes: what opens, and each reason one is refused.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic,
    reason = "tests fail loudly"
)]

use proptest::prelude::*;
use secrecy::{ExposeSecret as _, SecretString};
use wor_secrets::{
    ControlPlaneSigningKey, EnvelopeClaims, EnvelopeError, EnvelopeLimits, EnvelopeOpener,
    RunSecrets, SealedEnvelope, ToolCredential, WorkerIdentity, run_envelope,
};

const NOW: i64 = 1_800_000_000;
const RUN_CREDENTIAL: &str = "wor_run_canary_3f9a1c";
const MODEL_KEY: &str = "sk-model-canary-77d2";
const TOOL_TOKEN: &str = "tool-canary-1b5e";

fn secrets() -> RunSecrets {
    RunSecrets {
        run_credential: SecretString::from(RUN_CREDENTIAL),
        model_key: Some(SecretString::from(MODEL_KEY)),
        tool_credentials: vec![ToolCredential {
            connection_id: "con_1".into(),
            field: "bearer_token".into(),
            value: SecretString::from(TOOL_TOKEN),
        }],
    }
}

fn claims(worker_id: &str) -> EnvelopeClaims {
    EnvelopeClaims {
        run_id: "run_1".into(),
        lease_id: "lease_1".into(),
        worker_id: worker_id.into(),
        issued_at: NOW,
        expires_at: NOW + 300,
    }
}

struct Setup {
    control_plane: ControlPlaneSigningKey,
    opener: EnvelopeOpener,
    worker: wor_secrets::WorkerPublicKeys,
}

fn setup() -> Setup {
    let (control_plane, _) = ControlPlaneSigningKey::generate().unwrap();
    let (identity, _) = WorkerIdentity::generate().unwrap();
    let worker = identity.public_keys();
    let opener = EnvelopeOpener::new(
        identity,
        "wkr_a",
        control_plane.verifying_key(),
        EnvelopeLimits::default(),
    );
    Setup {
        control_plane,
        opener,
        worker,
    }
}

fn seal(setup: &Setup, claims: &EnvelopeClaims) -> SealedEnvelope {
    run_envelope::seal(&setup.control_plane, &setup.worker, claims, &secrets()).unwrap()
}

#[test]
fn the_addressed_worker_opens_its_envelope_and_reads_every_secret() {
    let mut setup = setup();
    let envelope = seal(&setup, &claims("wkr_a"));
    // The secrets are encrypted: none is in the bytes on the wire.
    for canary in [RUN_CREDENTIAL, MODEL_KEY, TOOL_TOKEN] {
        assert!(
            !envelope
                .as_bytes()
                .windows(canary.len())
                .any(|w| w == canary.as_bytes())
        );
    }
    let opened = setup.opener.open(&envelope, NOW + 5).unwrap();
    assert_eq!(opened.claims, claims("wkr_a"));
    assert_eq!(
        opened.secrets.run_credential.expose_secret(),
        RUN_CREDENTIAL
    );
    assert_eq!(
        opened.secrets.model_key.as_ref().unwrap().expose_secret(),
        MODEL_KEY
    );
    let tool = &opened.secrets.tool_credentials[0];
    assert_eq!(
        (tool.connection_id.as_str(), tool.field.as_str()),
        ("con_1", "bearer_token")
    );
    assert_eq!(tool.value.expose_secret(), TOOL_TOKEN);
    // Debug output never shows a secret.
    let rendered = format!("{opened:?} {envelope:?}");
    for canary in [RUN_CREDENTIAL, MODEL_KEY, TOOL_TOKEN] {
        assert!(!rendered.contains(canary), "{rendered}");
    }
}

#[test]
fn an_envelope_without_a_model_key_or_tools_opens() {
    let mut setup = setup();
    let bare = RunSecrets {
        run_credential: SecretString::from(RUN_CREDENTIAL),
        model_key: None,
        tool_credentials: Vec::new(),
    };
    let envelope =
        run_envelope::seal(&setup.control_plane, &setup.worker, &claims("wkr_a"), &bare).unwrap();
    let opened = setup.opener.open(&envelope, NOW).unwrap();
    assert!(opened.secrets.model_key.is_none());
    assert!(opened.secrets.tool_credentials.is_empty());
}

#[test]
fn a_replayed_envelope_is_refused_until_and_after_it_expires() {
    let mut setup = setup();
    let envelope = seal(&setup, &claims("wkr_a"));
    setup.opener.open(&envelope, NOW).unwrap();
    assert_eq!(
        setup.opener.open(&envelope, NOW + 1).unwrap_err(),
        EnvelopeError::Replayed
    );
    assert_eq!(setup.opener.replay_cache().len(), 1);
    // Once expired it is refused as expired, and its nonce is forgotten by the next open.
    let later = NOW + 300 + 31;
    assert!(matches!(
        setup.opener.open(&envelope, later).unwrap_err(),
        EnvelopeError::Expired { .. }
    ));
    let fresh = seal(
        &setup,
        &EnvelopeClaims {
            issued_at: later,
            expires_at: later + 60,
            ..claims("wkr_a")
        },
    );
    setup.opener.open(&fresh, later).unwrap();
    assert_eq!(setup.opener.replay_cache().len(), 1);
}

#[test]
fn an_envelope_for_another_worker_is_refused_in_this_workers_hands() {
    let mut setup = setup();
    let envelope = seal(&setup, &claims("wkr_b"));
    let err = setup.opener.open(&envelope, NOW).unwrap_err();
    assert_eq!(
        err,
        EnvelopeError::WrongAudience {
            addressed_to: "wkr_b".into(),
            this_worker: "wkr_a".into(),
        }
    );
    assert_eq!(
        err.to_string(),
        "envelope is addressed to worker `wkr_b`, not to this worker `wkr_a`"
    );
}

#[test]
fn an_envelope_naming_this_worker_but_sealed_to_another_key_is_refused() {
    let mut setup = setup();
    let (other, _) = WorkerIdentity::generate().unwrap();
    let envelope = run_envelope::seal(
        &setup.control_plane,
        &other.public_keys(),
        &claims("wkr_a"),
        &secrets(),
    )
    .unwrap();
    assert_eq!(
        setup.opener.open(&envelope, NOW).unwrap_err(),
        EnvelopeError::NotSealedToThisWorker
    );
    // A refused envelope leaves no nonce behind.
    assert!(setup.opener.replay_cache().is_empty());
}

#[test]
fn expiry_and_clock_skew_are_bounded() {
    let mut setup = setup();
    let skew = EnvelopeLimits::default().max_clock_skew_secs;
    let envelope = seal(&setup, &claims("wkr_a"));
    // Issued 31 s in this worker's future: more than the skew allows.
    assert_eq!(
        setup.opener.open(&envelope, NOW - skew - 1).unwrap_err(),
        EnvelopeError::NotYetValid {
            issued_at: NOW,
            now: NOW - skew - 1,
            skew_secs: skew,
        }
    );
    // Past its expiry by more than the skew.
    assert_eq!(
        setup
            .opener
            .open(&envelope, NOW + 300 + skew + 1)
            .unwrap_err(),
        EnvelopeError::Expired {
            expires_at: NOW + 300,
            now: NOW + 300 + skew + 1,
        }
    );
    // Within the skew on either side it opens.
    setup.opener.open(&envelope, NOW - skew).unwrap();
    let second = seal(&setup, &claims("wkr_a"));
    setup.opener.open(&second, NOW + 300 + skew).unwrap();
}

#[test]
fn the_skew_is_configurable() {
    let (control_plane, _) = ControlPlaneSigningKey::generate().unwrap();
    let (identity, _) = WorkerIdentity::generate().unwrap();
    let worker = identity.public_keys();
    let mut strict = EnvelopeOpener::new(
        identity,
        "wkr_a",
        control_plane.verifying_key(),
        EnvelopeLimits {
            max_clock_skew_secs: 0,
            ..EnvelopeLimits::default()
        },
    );
    let envelope =
        run_envelope::seal(&control_plane, &worker, &claims("wkr_a"), &secrets()).unwrap();
    assert!(matches!(
        strict.open(&envelope, NOW - 1).unwrap_err(),
        EnvelopeError::NotYetValid { skew_secs: 0, .. }
    ));
    strict.open(&envelope, NOW).unwrap();
}

#[test]
fn a_lifetime_beyond_the_limit_or_backwards_is_refused() {
    let mut setup = setup();
    for expires_at in [NOW + 15 * 60 + 1, NOW, NOW - 10] {
        let envelope = seal(
            &setup,
            &EnvelopeClaims {
                expires_at,
                ..claims("wkr_a")
            },
        );
        assert!(
            matches!(
                setup.opener.open(&envelope, NOW).unwrap_err(),
                EnvelopeError::LifetimeOutOfBounds { .. }
            ),
            "expires at {expires_at}"
        );
    }
}

#[test]
fn an_oversized_envelope_is_refused_before_anything_is_read() {
    let mut setup = setup();
    let huge = SealedEnvelope::from_bytes(vec![0u8; 64 * 1024 + 1]);
    assert_eq!(
        setup.opener.open(&huge, NOW).unwrap_err(),
        EnvelopeError::Oversized {
            actual: 64 * 1024 + 1,
            limit: 64 * 1024,
        }
    );
    // A genuine envelope over the limit too.
    let big = RunSecrets {
        run_credential: SecretString::from("x".repeat(70 * 1024)),
        model_key: None,
        tool_credentials: Vec::new(),
    };
    let envelope =
        run_envelope::seal(&setup.control_plane, &setup.worker, &claims("wkr_a"), &big).unwrap();
    assert!(matches!(
        setup.opener.open(&envelope, NOW).unwrap_err(),
        EnvelopeError::Oversized { .. }
    ));
}

#[test]
fn an_envelope_signed_by_another_key_is_tampered() {
    let mut setup = setup();
    let (impostor, _) = ControlPlaneSigningKey::generate().unwrap();
    let envelope =
        run_envelope::seal(&impostor, &setup.worker, &claims("wkr_a"), &secrets()).unwrap();
    assert_eq!(
        setup.opener.open(&envelope, NOW).unwrap_err(),
        EnvelopeError::Tampered
    );
}

#[test]
fn short_or_truncated_bytes_are_refused_without_panic() {
    let mut setup = setup();
    let envelope = seal(&setup, &claims("wkr_a"));
    for len in 0..envelope.as_bytes().len() {
        let cut = SealedEnvelope::from_bytes(envelope.as_bytes()[..len].to_vec());
        let err = setup.opener.open(&cut, NOW).unwrap_err();
        assert!(
            matches!(
                err,
                EnvelopeError::Malformed { .. } | EnvelopeError::Tampered
            ),
            "length {len}: {err}"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Any single bit flipped anywhere, signature included, is refused as tampered, and the
    /// envelope opens untouched afterwards (a refusal burns no nonce).
    #[test]
    fn any_bit_flip_is_refused(position in any::<prop::sample::Index>(), bit in 0u8..8) {
        let mut setup = setup();
        let envelope = seal(&setup, &claims("wkr_a"));
        let mut bytes = envelope.as_bytes().to_vec();
        let index = position.index(bytes.len());
        bytes[index] ^= 1 << bit;
        let flipped = SealedEnvelope::from_bytes(bytes);
        prop_assert_eq!(setup.opener.open(&flipped, NOW).unwrap_err(), EnvelopeError::Tampered);
        prop_assert!(setup.opener.open(&envelope, NOW).is_ok());
    }

    /// Arbitrary bytes never open and never panic.
    #[test]
    fn arbitrary_bytes_are_refused(bytes in prop::collection::vec(any::<u8>(), 0..600)) {
        let mut setup = setup();
        prop_assert!(setup.opener.open(&SealedEnvelope::from_bytes(bytes), NOW).is_err());
    }
}
