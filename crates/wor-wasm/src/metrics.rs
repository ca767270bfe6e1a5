//! Wasm tools that did not start, as a metric through the `metrics` facade (nothing is recorded
//! unless the server installs a recorder). The label is a fixed word, the kind of failure;
//! never a component's path, digest or message.

use metrics::counter;

use crate::WasmError;

pub const WASM_START_FAILURES: &str = "wor_wasm_start_failures_total";

/// Describes the metric to the installed recorder (`# HELP` line).
pub fn describe() {
    metrics::describe_counter!(
        WASM_START_FAILURES,
        "Wasm tool components that could not be loaded or instantiated, by reason (component, \
         read, setup, instantiate, memory_limit, out_of_fuel, deadline, trap)"
    );
}

/// The kind of a failure: a fixed word.
pub fn reason(error: &WasmError) -> &'static str {
    match error {
        WasmError::Setup(_) | WasmError::Unusable => "setup",
        WasmError::Component(_) => "component",
        WasmError::Instantiate(_) => "instantiate",
        WasmError::OutOfFuel(_) => "out_of_fuel",
        WasmError::Deadline(_) => "deadline",
        WasmError::MemoryLimit(_) => "memory_limit",
        WasmError::Trap(_) => "trap",
        WasmError::ToolList(_) => "tool_list",
        WasmError::Read { .. }
        | WasmError::NotAFile { .. }
        | WasmError::TooLarge { .. }
        | WasmError::Directory { .. } => "read",
    }
}

pub(crate) fn start_failed(error: &WasmError) {
    counter!(WASM_START_FAILURES, "reason" => reason(error)).increment(1);
}
