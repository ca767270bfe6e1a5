//! Typed, prefixed, time-ordered identifiers.
//!
//! An id is a short type prefix, an underscore, and the 32 lower-case hex digits of a UUIDv7,
//! so ids sort by creation time and a `run_…` can never be mistaken for a `key_…`.

use std::fmt;
use std::str::FromStr;

/// Why a string is not a valid id of the expected kind.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    #[error("`{value}` is not {kind} id: expected `{prefix}_` followed by 32 hex digits")]
    Malformed {
        /// The kind with its article: `a run`, `an approval`.
        kind: &'static str,
        prefix: &'static str,
        value: String,
    },
}

const HEX_LEN: usize = 32;

/// The 32 hex digits of `value` when it has the shape of an id of `prefix`: `prefix_` and 32
/// lowercase hex digits, as every id has, typed here or not (a delivery's `dlv_…`).
pub fn id_digits<'a>(value: &'a str, prefix: &str) -> Option<&'a str> {
    value
        .strip_prefix(prefix)
        .and_then(|r| r.strip_prefix('_'))
        .filter(|rest| {
            rest.len() == HEX_LEN
                && rest
                    .bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        })
}

fn parse_prefixed(
    value: &str,
    prefix: &'static str,
    kind: &'static str,
) -> Result<uuid::Uuid, IdError> {
    let malformed = || IdError::Malformed {
        kind,
        prefix,
        value: crate::quote::excerpt(value, 80),
    };
    let rest = id_digits(value, prefix).ok_or_else(malformed)?;
    uuid::Uuid::try_parse(rest).map_err(|_| malformed())
}

macro_rules! typed_id {
    ($(#[$doc:meta])* $name:ident, $prefix:literal, $kind:literal) => {
        $(#[$doc])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(uuid::Uuid);

        impl $name {
            /// The prefix every id of this kind starts with.
            pub const PREFIX: &'static str = $prefix;

            /// A fresh, time-ordered id.
            pub fn new() -> Self {
                Self(uuid::Uuid::now_v7())
            }

            /// The underlying UUID.
            pub fn uuid(&self) -> uuid::Uuid {
                self.0
            }
        }

        impl Default for $name {
            fn default() -> Self {
                Self::new()
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}_{}", $prefix, self.0.simple())
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(self, f)
            }
        }

        impl FromStr for $name {
            type Err = IdError;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                parse_prefixed(s, $prefix, $kind).map(Self)
            }
        }

        impl serde::Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.collect_str(self)
            }
        }

        impl<'de> serde::Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
                s.parse().map_err(serde::de::Error::custom)
            }
        }
    };
}

typed_id!(/// A project: the tenant.
    ProjectId, "prj", "a project");
typed_id!(/// A member of a project.
    MemberId, "mem", "a member");
typed_id!(/// An API key (personal or service).
    ApiKeyId, "key", "an API key");
typed_id!(/// A routine.
    RoutineId, "rtn", "a routine");
typed_id!(/// A run of a routine version.
    RunId, "run", "a run");
typed_id!(/// A model or tool connection.
    ConnectionId, "con", "a connection");
typed_id!(/// A member's signed-in web console session (not its token).
    ConsoleSessionId, "ses", "a console session");
typed_id!(/// An approval request.
    ApprovalId, "apr", "an approval");
typed_id!(/// A notification route: where approval requests are sent.
    NotificationRouteId, "ntf", "a notification route");

/// A fresh id for one HTTP request, for correlating its log line with its response.
pub fn request_id() -> String {
    format!("req_{}", uuid::Uuid::now_v7().simple())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_sorts_by_time() {
        let a = RunId::new();
        let b = RunId::new();
        let text = a.to_string();
        assert!(text.starts_with("run_"));
        assert_eq!(text.len(), 4 + HEX_LEN);
        assert_eq!(text.parse::<RunId>(), Ok(a));
        assert!(a < b, "UUIDv7 ids are time-ordered");
    }

    #[test]
    fn rejects_wrong_prefix_and_bad_digits() {
        let key = ApiKeyId::new().to_string();
        assert!(key.parse::<ProjectId>().is_err());
        assert!("prj_".parse::<ProjectId>().is_err());
        assert!(
            "prj_zzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzz"
                .parse::<ProjectId>()
                .is_err()
        );
        let upper = ProjectId::new()
            .to_string()
            .to_uppercase()
            .replacen("PRJ", "prj", 1);
        assert!(
            upper.parse::<ProjectId>().is_err(),
            "ids are lower-case only"
        );
        let err = "nope".parse::<MemberId>().unwrap_err().to_string();
        assert!(err.contains("`nope`") && err.contains("mem_"), "{err}");
        // The article agrees with the kind.
        let err = "nope".parse::<ApprovalId>().unwrap_err().to_string();
        assert!(err.starts_with("`nope` is not an approval id:"), "{err}");
        let err = "nope".parse::<ApiKeyId>().unwrap_err().to_string();
        assert!(err.starts_with("`nope` is not an API key id:"), "{err}");
        let err = "nope".parse::<RunId>().unwrap_err().to_string();
        assert!(err.starts_with("`nope` is not a run id:"), "{err}");
    }

    #[test]
    fn serde_uses_the_text_form() {
        let id = ConnectionId::new();
        let json = serde_json::to_string(&id).unwrap();
        assert_eq!(json, format!("\"{id}\""));
        assert_eq!(serde_json::from_str::<ConnectionId>(&json).unwrap(), id);
        assert!(serde_json::from_str::<ConnectionId>("\"run_00\"").is_err());
    }
}
