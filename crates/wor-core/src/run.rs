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

#[cfg(test)]
mod tests {
    use super::*;

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
