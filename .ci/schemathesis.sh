#!/usr/bin/env bash
# Schemathesis over the whole OpenAPI document of a real `wor serve`, run by .ci/run on SQLite
# and on PostgreSQL. Exits non-zero on any failure.
#
#   .ci/schemathesis.sh                       # embedded SQLite in a fresh data dir
#   .ci/schemathesis.sh postgres://…/db       # an empty PostgreSQL database
#
# What it installs: schemathesis (PyPI, pinned below) in a virtualenv under
# $HOME/.cache/wor-venv, made once and reused. Schemathesis generates valid and invalid requests
# for every operation from /v1/openapi.json and checks each answer: the status code is one the
# document lists for the operation (status_code_conformance), the body matches the schema the
# document gives for that status (response_schema_conformance), and it is never a 5xx
# (not_a_server_error). It is pinned so a new release cannot change what CI checks unannounced.
#
# Bounds: at most WOR_ST_MAX_EXAMPLES generated requests per operation and phase (default 100,
# about 4,000 requests), one at a time (WOR_ST_WORKERS, default 1), so a run takes about a
# minute or two per backend on two cores. The seed is fixed so a run can be reproduced;
# WOR_ST_SEED picks another. `GET /v1/run` answers 401 throughout: it takes a run's own
# credential, which no API key is.
set -euo pipefail
cd "$(dirname "$0")/.."

SCHEMATHESIS_VERSION=4.32.5
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/wor-target}"
export CARGO_INCREMENTAL=0
database="${1:-}"
max_examples="${WOR_ST_MAX_EXAMPLES:-100}"
seed="${WOR_ST_SEED:-20261201}"

venv="$HOME/.cache/wor-venv"
if ! "$venv/bin/schemathesis" --version 2>/dev/null | grep -qF "version $SCHEMATHESIS_VERSION"; then
  echo "schemathesis: installing schemathesis $SCHEMATHESIS_VERSION into $venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check "schemathesis==$SCHEMATHESIS_VERSION"
fi

# .ci/run passes the binary its test build linked (WOR_BIN); alone, this builds one.
wor="${WOR_BIN:-}"
if [ -z "$wor" ]; then
  cargo build --locked --quiet -p wor-cli --bin wor
  wor="$CARGO_TARGET_DIR/debug/wor"
fi

work=$(mktemp -d /tmp/wor-schemathesis.XXXXXX)
server_pid=
cleanup() {
  if [ -n "$server_pid" ]; then
    kill "$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

db_args=(--data-dir "$work/data")
[ -n "$database" ] && db_args+=(--database "$database")
# A clean environment: nothing from the caller's shell configures the server.
run_wor() { env -i PATH="$PATH" HOME="$work" "$wor" "$@"; }

key=$(run_wor init --project schemathesis "${db_args[@]}" 2>"$work/init.log") \
  || { cat "$work/init.log"; exit 1; }

# The log exists before the server starts: the background job opens it for the server only
# after the fork, and a read of a missing file would end this script (`set -e`, `pipefail`).
: > "$work/serve.log"
# Not through the function: `env` execs the server, so $! is the server's own pid.
env -i PATH="$PATH" HOME="$work" "$wor" serve --listen 127.0.0.1:0 "${db_args[@]}" \
  2>>"$work/serve.log" &
server_pid=$!
url=
for _ in $(seq 1 300); do
  url=$(sed -n 's/^wor: listening on //p' "$work/serve.log" | head -n 1)
  [ -n "$url" ] && break
  kill -0 "$server_pid" 2>/dev/null || { cat "$work/serve.log"; exit 1; }
  sleep 0.1
done
[ -n "$url" ] || { echo "schemathesis: the server did not start"; cat "$work/serve.log"; exit 1; }
backend=SQLite
[ -n "$database" ] && backend=PostgreSQL
echo "schemathesis: wor serve on $url ($backend), $max_examples examples per operation"

# A routine and a finished run of it, so operations on a routine or a run reach past "not found":
# their ids are given to every operation that takes them (schemathesis.toml).
client() { env -i PATH="$PATH" HOME="$work" WOR_SERVER="$url" WOR_API_KEY="$key" "$wor" "$@"; }
json_field() { "$venv/bin/python" -c 'import json, sys; print(json.load(sys.stdin)[sys.argv[1]][sys.argv[2]] if len(sys.argv) > 2 else json.load(sys.stdin)[sys.argv[1]])' "$@"; }
cat >"$work/probe.toml" <<'TOML'
name = "probe"
instructions = "Answer the request."
[model]
provider = "replay"
model = "script"
[[model.script.turns]]
text = "done"
[webhook]
enabled = true
TOML
routine_id=$(client routine apply -f "$work/probe.toml" --json | json_field routine id)
run_id=$(client run start probe --input "probe" --json | json_field id)
cat >"$work/schemathesis.toml" <<TOML
[parameters]
"path.routine_id" = "$routine_id"
"path.run_id" = "$run_id"
TOML

status=0
# From the scratch directory: schemathesis keeps a cache in the directory it runs in.
(cd "$work" && "$venv/bin/schemathesis" --config-file "$work/schemathesis.toml" run "$url/v1/openapi.json" \
  --checks not_a_server_error,status_code_conformance,response_schema_conformance \
  --header "Authorization: Bearer $key" \
  --max-examples "$max_examples" \
  --seed "$seed" \
  --workers "${WOR_ST_WORKERS:-1}" \
  --request-timeout 20 \
  --no-color) \
  || status=$?

if [ "$status" -ne 0 ]; then
  echo "schemathesis: failures above; the server's log follows"
  grep -E '"level":"(ERROR|WARN)"|ERROR|panicked' "$work/serve.log" | tail -n 50 || true
fi
kill -0 "$server_pid" 2>/dev/null || { echo "schemathesis: the server died"; tail -n 50 "$work/serve.log"; exit 1; }
exit "$status"
