//! What policy answered for one tool call.

use serde::{Deserialize, Serialize};
use wor_core::call::Verdict;

/// A decision on one tool call: a value, also when it is a denial.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Decision {
    pub outcome: Verdict,
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
