//! Runs: their status and the labels of what enters their context.

use std::fmt;
use std::str::FromStr;

/// Where a run is in its life. Terminal statuses never change again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RunStatus {
    Queued,
    Running,
    WaitingForApproval,
    Succeeded,
    Failed,
    Cancelled,
    BudgetExceeded,
    /// Not started: the routine's overlap policy is `skip` and no slot was free.
    Skipped,
}

impl RunStatus {
    pub const ALL: [RunStatus; 8] = [
        RunStatus::Queued,
        RunStatus::Running,
        RunStatus::WaitingForApproval,
        RunStatus::Succeeded,
        RunStatus::Failed,
        RunStatus::Cancelled,
        RunStatus::BudgetExceeded,
        RunStatus::Skipped,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            RunStatus::Queued => "queued",
            RunStatus::Running => "running",
            RunStatus::WaitingForApproval => "waiting_for_approval",
            RunStatus::Succeeded => "succeeded",
            RunStatus::Failed => "failed",
            RunStatus::Cancelled => "cancelled",
            RunStatus::BudgetExceeded => "budget_exceeded",
            RunStatus::Skipped => "skipped",
        }
    }

    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            RunStatus::Succeeded
                | RunStatus::Failed
                | RunStatus::Cancelled
                | RunStatus::BudgetExceeded
                | RunStatus::Skipped
        )
    }

    /// Counts against the routine's concurrency limit.
    pub fn is_active(self) -> bool {
        matches!(
            self,
            RunStatus::Queued | RunStatus::Running | RunStatus::WaitingForApproval
        )
    }
}

impl fmt::Display for RunStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The text was not a run status.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not a run status")]
pub struct RunStatusParseError(pub String);

impl FromStr for RunStatus {
    type Err = RunStatusParseError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        RunStatus::ALL
            .into_iter()
            .find(|st| st.as_str() == s)
            .ok_or_else(|| RunStatusParseError(crate::quote::excerpt(s, 40)))
    }
}

/// Where a piece of a run's context came from (S8).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Provenance {
    /// The routine's own instructions.
    Trusted,
    /// The authenticated caller's input.
    Requester,
    /// Webhook payloads, tool results, fetched content, and anything derived from them.
    Untrusted,
    /// What the model wrote.
    Model,
    /// What the engine itself wrote: refusals, budget and cancellation notices.
    Engine,
}

impl Provenance {
    pub fn as_str(self) -> &'static str {
        match self {
            Provenance::Trusted => "trusted",
            Provenance::Requester => "requester",
            Provenance::Untrusted => "untrusted",
            Provenance::Model => "model",
            Provenance::Engine => "engine",
        }
    }
}

impl FromStr for Provenance {
    type Err = RunStatusParseError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        [
            Provenance::Trusted,
            Provenance::Requester,
            Provenance::Untrusted,
            Provenance::Model,
            Provenance::Engine,
        ]
        .into_iter()
        .find(|p| p.as_str() == s)
        .ok_or_else(|| RunStatusParseError(crate::quote::excerpt(s, 40)))
    }
}

/// A requester's key for one start of a routine (`Idempotency-Key`): a request sent again
/// with the same key starts nothing new. Between 1 and [`IdempotencyKey::MAX_LEN`] visible
/// ASCII characters, so it is shown as it is anywhere.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

/// The text cannot be an idempotency key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdempotencyKeyError {
    #[error("an idempotency key cannot be empty")]
    Empty,
    #[error("an idempotency key is at most {max} characters; this one has {len}", max = IdempotencyKey::MAX_LEN)]
    TooLong { len: usize },
    #[error(
        "an idempotency key is visible ASCII only (no spaces or control characters); character {position} is not"
    )]
    NotVisibleAscii { position: usize },
}

impl IdempotencyKey {
    /// Longest key accepted.
    pub const MAX_LEN: usize = 255;

    /// The run's trigger key for a start under this key: apart from a schedule's slots and a
    /// webhook's deliveries by its prefix.
    pub fn trigger_key(&self) -> String {
        format!("request:{}", self.0)
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for IdempotencyKey {
    type Err = IdempotencyKeyError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.is_empty() {
            return Err(IdempotencyKeyError::Empty);
        }
        if let Some(position) = s.chars().position(|c| !c.is_ascii_graphic()) {
            return Err(IdempotencyKeyError::NotVisibleAscii {
                position: position + 1,
            });
        }
        if s.len() > Self::MAX_LEN {
            return Err(IdempotencyKeyError::TooLong { len: s.len() });
        }
        Ok(IdempotencyKey(s.to_owned()))
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_idempotency_key_is_visible_ascii_of_bounded_length() {
        let key: IdempotencyKey = "order-42/retry:1".parse().expect("a plain key");
        assert_eq!(key.trigger_key(), "request:order-42/retry:1");
        assert_eq!(
            "".parse::<IdempotencyKey>(),
            Err(IdempotencyKeyError::Empty)
        );
        assert_eq!(
            "a b".parse::<IdempotencyKey>(),
            Err(IdempotencyKeyError::NotVisibleAscii { position: 2 })
        );
        assert_eq!(
            "ab\u{1b}[2J".parse::<IdempotencyKey>(),
            Err(IdempotencyKeyError::NotVisibleAscii { position: 3 })
        );
        assert_eq!(
            "é".parse::<IdempotencyKey>(),
            Err(IdempotencyKeyError::NotVisibleAscii { position: 1 })
        );
        let longest = "k".repeat(IdempotencyKey::MAX_LEN);
        assert!(longest.parse::<IdempotencyKey>().is_ok());
        assert_eq!(
            format!("{longest}k").parse::<IdempotencyKey>(),
            Err(IdempotencyKeyError::TooLong {
                len: IdempotencyKey::MAX_LEN + 1
            })
        );
    }

    #[test]
    fn statuses_round_trip_and_classify() {
        for status in RunStatus::ALL {
            assert_eq!(status.as_str().parse::<RunStatus>(), Ok(status));
            assert_ne!(status.is_terminal(), status.is_active(), "{status}");
        }
        assert!("done".parse::<RunStatus>().is_err());
        assert_eq!("untrusted".parse::<Provenance>(), Ok(Provenance::Untrusted));
    }
}
