//! What policy answered for one tool call.

use std::fmt;

use serde::{Deserialize, Serialize};

/// The three answers, ordered by strength: when several policies match, the greatest wins.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The call runs.
    Allow,
    /// The call waits for an approver's decision on that exact call.
    Confirm,
    /// The call does not run; the model gets a clear refusal.
    Deny,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Allow => "allow",
            Outcome::Confirm => "confirm",
            Outcome::Deny => "deny",
        }
    }

    /// The outcome a `@decision("…")` annotation names.
    pub fn parse(text: &str) -> Option<Outcome> {
        [Outcome::Allow, Outcome::Confirm, Outcome::Deny]
            .into_iter()
            .find(|o| o.as_str() == text)
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A decision on one tool call: a value, also when it is a denial.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Decision {
    pub outcome: Outcome,
    /// Ids of the policies that produced `outcome` (`project.read-only-runs`,
    /// `roster.mail/send`, …), sorted; never empty. The fixed ids `wor.no-policy-matched` and
    /// `wor.request-invalid` name the engine's own fail-closed denials.
    pub determining_policies: Vec<String>,
    /// Human text: which policy decided and why, and which untrusted sources are in context.
    pub reasons: Vec<String>,
}

/// The id named when no policy matched a call.
pub const NO_POLICY_MATCHED: &str = "wor.no-policy-matched";
/// The id named when a request could not be turned into a Cedar request.
pub const REQUEST_INVALID: &str = "wor.request-invalid";
