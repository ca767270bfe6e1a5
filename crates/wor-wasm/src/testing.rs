//! Test support for this and other crates' tests: where the probe component is.

use std::path::PathBuf;

/// The probe component (`guest/`): `WOR_WASM_PROBE`, or the release build under the target
/// directory. Panics with how to build it when it is missing: a test that needs it must not
/// pass without it.
#[allow(clippy::panic, reason = "test support fails loudly")]
pub fn probe_component() -> PathBuf {
    let path = std::env::var_os("WOR_WASM_PROBE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let target = std::env::var_os("CARGO_TARGET_DIR")
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target"));
            target.join("wasm32-wasip2/release/wor_wasm_probe.wasm")
        });
    if !path.is_file() {
        panic!(
            "the probe component is not built at {}: run `bash .ci/wasm-fixtures.sh` (or set WOR_WASM_PROBE)",
            path.display()
        );
    }
    path
}
