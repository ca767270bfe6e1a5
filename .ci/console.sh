# Sourced by .ci/run once per database: the web console's browser tests, against the real
# `wor serve` (the debug binary the test build linked), on the database in
# CONSOLE_DATABASE_URL (empty: SQLite in a temporary data dir).
# Installs what is missing: Debian's chromium (the browser the tests drive) and, into
# $HOME/.cache/wor-npm-console, the npm packages playwright-core (drives chromium; no browser
# download) and @axe-core/playwright (the accessibility checks), at pinned versions.

CONSOLE_NPM_DIR="$HOME/.cache/wor-npm-console"
CONSOLE_PLAYWRIGHT_CORE=1.57.0
CONSOLE_AXE_PLAYWRIGHT=4.11.0

if [ ! -x /usr/bin/chromium ]; then
  echo "ci: installing chromium from Debian packages (the browser the console tests drive)"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null
fi
if ! grep -qs "\"version\": \"$CONSOLE_PLAYWRIGHT_CORE\"" "$CONSOLE_NPM_DIR/node_modules/playwright-core/package.json" \
  || ! grep -qs "\"version\": \"$CONSOLE_AXE_PLAYWRIGHT\"" "$CONSOLE_NPM_DIR/node_modules/@axe-core/playwright/package.json"; then
  echo "ci: installing npm playwright-core@$CONSOLE_PLAYWRIGHT_CORE (drives chromium) and" \
    "@axe-core/playwright@$CONSOLE_AXE_PLAYWRIGHT (accessibility checks) into $CONSOLE_NPM_DIR"
  mkdir -p "$CONSOLE_NPM_DIR"
  (cd "$CONSOLE_NPM_DIR" && npm install --no-audit --no-fund --no-save --silent \
    "playwright-core@$CONSOLE_PLAYWRIGHT_CORE" "@axe-core/playwright@$CONSOLE_AXE_PLAYWRIGHT")
fi

# The timeout bounds the whole test file (node runs each file as one test), not one test.
# The SQLite run takes docs/console.md's screenshots into the target dir, so CI leaves the
# checkout as it was; `WOR_CONSOLE_SCREENSHOTS=docs/console bash .ci/run` refreshes them.
WOR_BIN="$CARGO_TARGET_DIR/debug/wor" \
  WOR_CONSOLE_SCREENSHOTS="${WOR_CONSOLE_SCREENSHOTS:-$CARGO_TARGET_DIR/console-screenshots}" \
  WOR_NPM_CONSOLE="$CONSOLE_NPM_DIR" \
  WOR_TEST_DATABASE_URL="${CONSOLE_DATABASE_URL:-}" \
  node --test --test-timeout=300000 crates/wor-server/tests/console/
