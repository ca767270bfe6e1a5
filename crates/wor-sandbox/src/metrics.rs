//! The sandbox's start failures as a metric, through the `metrics` facade (nothing is recorded
//! unless the server installs a recorder). The label is a fixed word: the layer that could not
//! be applied, or the stage that failed; never a program, path or message.

use metrics::counter;

use crate::layer::SandboxError;

pub const SANDBOX_START_FAILURES: &str = "wor_sandbox_start_failures_total";

/// Describes the sandbox's metric to the installed recorder (`# HELP` line).
pub fn describe() {
    metrics::describe_counter!(
        SANDBOX_START_FAILURES,
        "Sandboxed processes that did not start, by stage: the layer that could not be applied \
         (user-namespace, landlock, seccomp, ...), or exec, profile, helper, io"
    );
}

/// The stage a start failed at: a fixed word.
pub fn stage(error: &SandboxError) -> &'static str {
    match error {
        SandboxError::Layer { layer, .. } => layer.name(),
        SandboxError::Exec { .. } => "exec",
        SandboxError::Profile(_) => "profile",
        SandboxError::Helper(_) => "helper",
        SandboxError::Io(_) | SandboxError::StateDir { .. } => "io",
    }
}

pub(crate) fn start_failed(error: &SandboxError) {
    counter!(SANDBOX_START_FAILURES, "stage" => stage(error)).increment(1);
}
