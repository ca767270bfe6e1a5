//! Signed requests of a worker to the control plane's internal API.
//!
//! A worker signs, with its Ed25519 key, a label, the method, the path with its query, its id,
//! a timestamp, a random nonce and the SHA-256 of the body. The control plane checks the
//! signature against the public key it stored at enrolment and the timestamp against its clock
//! here; the caller then refuses a nonce already seen (kept in the database, so that every API
//! replica refuses it).

use std::fmt;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use ed25519_dalek::{Signature, Signer as _};
use sha2::{Digest as _, Sha256};

use crate::worker_keys::{WorkerIdentity, WorkerPublicKeys};

const LABEL: &[u8] = b"wor worker request v1\0";
/// Length in bytes of a request nonce.
pub const REQUEST_NONCE_LEN: usize = 16;

/// Header naming the worker.
pub const WORKER_ID_HEADER: &str = "x-wor-worker";
/// Header with the request's Unix time in seconds.
pub const TIMESTAMP_HEADER: &str = "x-wor-timestamp";
/// Header with the request's nonce, 32 hex digits.
pub const NONCE_HEADER: &str = "x-wor-nonce";
/// Header with the Ed25519 signature, standard base64.
pub const SIGNATURE_HEADER: &str = "x-wor-signature";

/// The parts of a request that are signed.
#[derive(Debug, Clone, Copy)]
pub struct RequestToSign<'a> {
    pub method: &'a str,
    /// The path and query, as sent.
    pub path_and_query: &'a str,
    pub body: &'a [u8],
}

/// The four header values a signed request carries.
#[derive(Clone, PartialEq, Eq)]
pub struct WorkerRequestHeaders {
    pub worker_id: String,
    pub timestamp: i64,
    pub nonce: [u8; REQUEST_NONCE_LEN],
    pub signature: [u8; 64],
}

impl fmt::Debug for WorkerRequestHeaders {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WorkerRequestHeaders")
            .field("worker_id", &self.worker_id)
            .field("timestamp", &self.timestamp)
            .field("nonce", &hex::encode(self.nonce))
            .finish_non_exhaustive()
    }
}

/// Why a worker's request was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WorkerRequestError {
    /// A header is missing or malformed.
    #[error("worker request header `{header}` is missing or malformed")]
    MalformedHeader {
        /// Which header.
        header: &'static str,
    },
    /// The signature does not verify under the worker's stored key.
    #[error("worker request signature does not verify")]
    BadSignature,
    /// The timestamp is further from the control plane's clock than allowed.
    #[error("worker request timestamp {timestamp} is more than {skew_secs} s from now ({now})")]
    ClockSkew {
        timestamp: i64,
        now: i64,
        skew_secs: i64,
    },
    /// The operating system's random number generator failed.
    #[error("operating system randomness is unavailable")]
    RandomnessUnavailable,
}

fn message(
    request: &RequestToSign<'_>,
    worker_id: &str,
    timestamp: i64,
    nonce: &[u8; REQUEST_NONCE_LEN],
) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(LABEL);
    for part in [
        request.method.as_bytes(),
        request.path_and_query.as_bytes(),
        worker_id.as_bytes(),
    ] {
        // Lengths keep the parts apart: ("GE", "T/x") never signs as ("GET", "/x").
        let len = u32::try_from(part.len()).unwrap_or(u32::MAX);
        out.extend_from_slice(&len.to_be_bytes());
        out.extend_from_slice(part);
    }
    out.extend_from_slice(&timestamp.to_be_bytes());
    out.extend_from_slice(nonce);
    out.extend_from_slice(&Sha256::digest(request.body));
    out
}

impl WorkerIdentity {
    /// Signs `request` as the worker `worker_id` at `timestamp` (Unix seconds), with a fresh
    /// nonce.
    ///
    /// # Errors
    /// [`WorkerRequestError::RandomnessUnavailable`].
    pub fn sign_request(
        &self,
        worker_id: &str,
        request: &RequestToSign<'_>,
        timestamp: i64,
    ) -> Result<WorkerRequestHeaders, WorkerRequestError> {
        let mut nonce = [0u8; REQUEST_NONCE_LEN];
        getrandom::fill(&mut nonce).map_err(|_| WorkerRequestError::RandomnessUnavailable)?;
        let signature = self
            .signing_key()
            .sign(&message(request, worker_id, timestamp, &nonce));
        Ok(WorkerRequestHeaders {
            worker_id: worker_id.to_owned(),
            timestamp,
            nonce,
            signature: signature.to_bytes(),
        })
    }
}

impl WorkerRequestHeaders {
    /// The nonce as 32 hex digits, as its header carries it.
    pub fn nonce_hex(&self) -> String {
        hex::encode(self.nonce)
    }

    /// The header values, in the order of the constants above.
    pub fn to_header_values(&self) -> [(&'static str, String); 4] {
        [
            (WORKER_ID_HEADER, self.worker_id.clone()),
            (TIMESTAMP_HEADER, self.timestamp.to_string()),
            (NONCE_HEADER, hex::encode(self.nonce)),
            (SIGNATURE_HEADER, STANDARD.encode(self.signature)),
        ]
    }

    /// Parses the header values; `get` returns a header's value by name.
    ///
    /// # Errors
    /// [`WorkerRequestError::MalformedHeader`] naming the first bad header.
    pub fn parse<'a>(
        get: impl Fn(&'static str) -> Option<&'a str>,
    ) -> Result<Self, WorkerRequestError> {
        let bad = |header| WorkerRequestError::MalformedHeader { header };
        let worker_id = get(WORKER_ID_HEADER)
            .filter(|v| !v.is_empty() && v.len() <= 64)
            .ok_or(bad(WORKER_ID_HEADER))?
            .to_owned();
        let timestamp = get(TIMESTAMP_HEADER)
            .and_then(crate::webhook_signature::parse_timestamp)
            .ok_or(bad(TIMESTAMP_HEADER))?;
        let nonce = get(NONCE_HEADER)
            .and_then(|v| hex::decode(v).ok())
            .and_then(|v| <[u8; REQUEST_NONCE_LEN]>::try_from(v.as_slice()).ok())
            .ok_or(bad(NONCE_HEADER))?;
        let signature = get(SIGNATURE_HEADER)
            .and_then(|v| STANDARD.decode(v).ok())
            .and_then(|v| <[u8; 64]>::try_from(v.as_slice()).ok())
            .ok_or(bad(SIGNATURE_HEADER))?;
        Ok(Self {
            worker_id,
            timestamp,
            nonce,
            signature,
        })
    }

    /// Checks the signature under `keys` (the worker's stored public keys) and the timestamp
    /// against `now` within `max_skew_secs`. The nonce is left to the caller's replay store.
    ///
    /// # Errors
    /// [`WorkerRequestError::ClockSkew`] or [`WorkerRequestError::BadSignature`].
    pub fn verify(
        &self,
        keys: &WorkerPublicKeys,
        request: &RequestToSign<'_>,
        now: i64,
        max_skew_secs: i64,
    ) -> Result<(), WorkerRequestError> {
        if self.timestamp.abs_diff(now) > max_skew_secs.unsigned_abs() {
            return Err(WorkerRequestError::ClockSkew {
                timestamp: self.timestamp,
                now,
                skew_secs: max_skew_secs,
            });
        }
        keys.signing()
            .verify_strict(
                &message(request, &self.worker_id, self.timestamp, &self.nonce),
                &Signature::from_bytes(&self.signature),
            )
            .map_err(|_| WorkerRequestError::BadSignature)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const REQUEST: RequestToSign<'static> = RequestToSign {
        method: "POST",
        path_and_query: "/internal/v1/workers/heartbeat",
        body: b"{}",
    };

    fn parse(headers: &WorkerRequestHeaders) -> WorkerRequestHeaders {
        let values = headers.to_header_values();
        WorkerRequestHeaders::parse(|name| {
            values
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v.as_str())
        })
        .unwrap()
    }

    #[test]
    fn a_signed_request_verifies_only_as_signed() {
        let (identity, _) = WorkerIdentity::generate().unwrap();
        let keys = identity.public_keys();
        let signed = parse(&identity.sign_request("wkr_1", &REQUEST, 1000).unwrap());
        signed.verify(&keys, &REQUEST, 1010, 30).unwrap();
        let changed = [
            RequestToSign {
                method: "GET",
                ..REQUEST
            },
            RequestToSign {
                path_and_query: "/internal/v1/workers/heartbeat?x=1",
                ..REQUEST
            },
            RequestToSign {
                body: b"{ }",
                ..REQUEST
            },
        ];
        for request in changed {
            assert_eq!(
                signed.verify(&keys, &request, 1000, 30),
                Err(WorkerRequestError::BadSignature),
                "{request:?}"
            );
        }
        let mut other_worker = signed.clone();
        other_worker.worker_id = "wkr_2".into();
        assert_eq!(
            other_worker.verify(&keys, &REQUEST, 1000, 30),
            Err(WorkerRequestError::BadSignature)
        );
        let mut other_nonce = signed.clone();
        other_nonce.nonce[0] ^= 1;
        assert!(other_nonce.verify(&keys, &REQUEST, 1000, 30).is_err());
        let (stranger, _) = WorkerIdentity::generate().unwrap();
        assert!(
            signed
                .verify(&stranger.public_keys(), &REQUEST, 1000, 30)
                .is_err()
        );
    }

    #[test]
    fn a_timestamp_outside_the_skew_is_refused_either_way() {
        let (identity, _) = WorkerIdentity::generate().unwrap();
        let signed = identity.sign_request("wkr_1", &REQUEST, 1000).unwrap();
        for now in [969, 1031] {
            assert!(matches!(
                signed.verify(&identity.public_keys(), &REQUEST, now, 30),
                Err(WorkerRequestError::ClockSkew { .. })
            ));
        }
    }

    #[test]
    fn malformed_headers_are_named() {
        // Another spelling of a number is not one: the signature covers the value read.
        for timestamp in ["soon", "+1000", "01000"] {
            let err = WorkerRequestHeaders::parse(|name| match name {
                WORKER_ID_HEADER => Some("wkr_1"),
                TIMESTAMP_HEADER => Some(timestamp),
                _ => None,
            })
            .unwrap_err();
            assert_eq!(
                err,
                WorkerRequestError::MalformedHeader {
                    header: TIMESTAMP_HEADER
                },
                "{timestamp}"
            );
        }
    }
}
