#!/usr/bin/env bash
# Runs the client scenarios of the MCP conformance suite (npm `@modelcontextprotocol/conformance`)
# against wor's MCP client: `crates/wor-tools/examples/mcp_conformance_client.rs`, which connects,
# authorizes and calls tools through the same code `wor serve` uses.
#
#   bash .ci/mcp-conformance.sh
#
# The scenarios the client knowingly fails are listed, each with its reason, in
# `testdata/mcp-conformance/expected-failures.yml`. The suite exits non-zero when a scenario
# outside that list fails, and when one inside it passes (the list must then shrink).
#
# 0.1.13 is the newest release that runs on the Node.js of Debian bookworm (v20): later ones
# call `fs.globSync`, which arrived in Node.js 22. Installs into "$WOR_NPM_CONFORMANCE_PREFIX"
# (default "$HOME/.cache/wor-npm-conformance"); an install of the pinned version is reused.
set -euo pipefail
cd "$(dirname "$0")/.."

version="0.1.13"
package="@modelcontextprotocol/conformance"
prefix="${WOR_NPM_CONFORMANCE_PREFIX:-$HOME/.cache/wor-npm-conformance}"
manifest="$prefix/node_modules/$package/package.json"

if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  echo "mcp-conformance: node and npm are needed (.ci/mcp-servers.sh installs them)" >&2
  exit 1
fi
installed=""
if [ -f "$manifest" ]; then
  installed="$(node -p "require(process.argv[1]).version" "$manifest")"
fi
if [ "$installed" != "$version" ]; then
  echo "mcp-conformance: installing $package@$version with npm into $prefix" >&2
  npm install --prefix "$prefix" --no-audit --no-fund --loglevel=error "$package@$version" >&2
fi

# .ci/run passes the client its test build linked (WOR_CONFORMANCE_CLIENT); alone, this builds
# one.
client="${WOR_CONFORMANCE_CLIENT:-}"
if [ -z "$client" ]; then
  cargo build --locked -p wor-tools --example mcp_conformance_client
  client="${CARGO_TARGET_DIR:-target}/debug/examples/mcp_conformance_client"
fi
client="$(realpath "$client")"
baseline="$PWD/testdata/mcp-conformance/expected-failures.yml"

suite=(node "$prefix/node_modules/$package/dist/index.js")
scenarios="$("${suite[@]}" list | sed -n '/^Client scenarios/,$p' | sed -n 's/^  - //p')"
if [ -z "$scenarios" ]; then
  echo "mcp-conformance: the suite lists no client scenarios" >&2
  exit 1
fi

# One scenario at a time: a few check the client's timing (SSE reconnection after `retry`),
# which scenarios run side by side on two cores would disturb.
results="$(mktemp -d)"
trap 'rm -rf "$results"' EXIT
failed=()
for scenario in $scenarios; do
  if ! (cd "$results" && "${suite[@]}" client --command "$client" --scenario "$scenario" \
    --expected-failures "$baseline" --timeout 20000 >"$results/last.txt" 2>&1); then
    cat "$results/last.txt"
    failed+=("$scenario")
  fi
done
count="$(echo "$scenarios" | wc -l)"
if [ "${#failed[@]}" -gt 0 ]; then
  echo "mcp-conformance: ${#failed[@]} of $count client scenarios differ from $baseline: ${failed[*]}" >&2
  exit 1
fi
echo "mcp-conformance: $count client scenarios as expected ($(grep -c '^  - ' "$baseline") known failures)"
