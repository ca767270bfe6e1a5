#!/usr/bin/env bash
# Sourced by .ci/run: clones the committed repository into an empty folder of its own, so that
# nothing beside the checkout (no `shared/`, no sibling folders) is reachable, and runs there
# the tests that load public test data (the SSRF corpus and the webhook signature vectors).
# Uses a target dir of its own under CARGO_TARGET_DIR, so the main build is not disturbed, and
# always the same folder (emptied first), so a warm target dir rebuilds only the three crates.

wor_clone_check() {
  local parent clone target
  parent="${WOR_CLONE_CHECK_DIR:-$HOME/.cache/wor-clone-check}"
  rm -rf "$parent"
  mkdir -p "$parent"
  clone="$parent/wor"
  target="${CARGO_TARGET_DIR:-$PWD/target}/clone-check"
  git clone --quiet --no-local . "$clone" || return 1
  echo "clone-check: $(git -C "$clone" rev-parse --short HEAD) cloned into $clone"
  local status=0
  (
    cd "$clone" &&
      CARGO_TARGET_DIR="$target" cargo nextest run --locked --no-fail-fast \
        -p wor-egress -p wor-secrets -E 'test(/corpus/)'
  ) || status=$?
  rm -rf "$parent"
  return $status
}

wor_clone_check
