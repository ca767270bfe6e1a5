//! What an approval is bound to.

use serde_json::json;

use crate::RunId;
use crate::canonical::canonical_hash;

/// The hash an approval binds to: the canonical JSON of the run, the call's id, the pinned
/// tool definition's hash and the canonical arguments' hash. A call with any of these
/// different cannot use the approval.
pub fn binding_hash(run: RunId, call_id: &str, pin_hash: &str, arguments_hash: &str) -> String {
    canonical_hash(&json!({
        "run": run.to_string(),
        "call": call_id,
        "tool_definition": pin_hash,
        "arguments": arguments_hash,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_part_changes_the_binding() {
        let run = RunId::new();
        let base = binding_hash(run, "call-1", "pin", "args");
        assert_eq!(base, binding_hash(run, "call-1", "pin", "args"));
        assert_ne!(base, binding_hash(RunId::new(), "call-1", "pin", "args"));
        assert_ne!(base, binding_hash(run, "call-2", "pin", "args"));
        assert_ne!(base, binding_hash(run, "call-1", "pin2", "args"));
        assert_ne!(base, binding_hash(run, "call-1", "pin", "args2"));
    }
}
