#!/usr/bin/env bash
# Builds the Wasm component the tests and the benchmark run (crates/wor-wasm/guest, the probe
# tool) for wasm32-wasip2, and exports where it is. Source it before the tests:
#
#   source .ci/wasm-fixtures.sh
#
# Adds the wasm32-wasip2 standard library with rustup when it is missing; fails loudly when it
# cannot be had.

wor_build_wasm_fixtures() {
  local target_dir="${CARGO_TARGET_DIR:-$PWD/target}"
  if ! rustup target list --installed 2>/dev/null | grep -qx wasm32-wasip2; then
    echo "wasm-fixtures: adding the wasm32-wasip2 target with rustup (to build the probe component the Wasm tool tests run)"
    rustup target add wasm32-wasip2 || {
      echo "wasm-fixtures: the wasm32-wasip2 target cannot be installed with rustup" >&2
      return 1
    }
  fi
  cargo build --quiet --release --locked --target wasm32-wasip2 \
    --manifest-path crates/wor-wasm/guest/Cargo.toml --target-dir "$target_dir" || return 1
  export WOR_WASM_PROBE="$target_dir/wasm32-wasip2/release/wor_wasm_probe.wasm"
  echo "wasm-fixtures: probe component at $WOR_WASM_PROBE"
}

wor_build_wasm_fixtures
