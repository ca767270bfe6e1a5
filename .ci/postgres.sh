# Sourced by .ci/run: installs PostgreSQL from Debian's packages when missing, starts a
# throw-away cluster on loopback in a temporary directory, and exports WOR_PG_URL.
# `pg_stop` stops it and removes the directory.

pg_bin_dir() {
  local d
  for d in /usr/lib/postgresql/*/bin; do
    [ -x "$d/initdb" ] && { echo "$d"; return 0; }
  done
  return 1
}

if ! PG_BIN=$(pg_bin_dir); then
  echo "ci: installing PostgreSQL from Debian packages (every test runs once on it as well as on SQLite)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq postgresql >/dev/null
  PG_BIN=$(pg_bin_dir)
fi

PG_DIR=$(mktemp -d /tmp/wor-pg.XXXXXX)
PG_PORT=${WOR_CI_PG_PORT:-55432}
PG_RUN=()
if [ "$(id -u)" = 0 ]; then
  id postgres >/dev/null 2>&1 || useradd --system --no-create-home postgres
  chown postgres "$PG_DIR"
  PG_RUN=(runuser -u postgres --)
fi
"${PG_RUN[@]}" "$PG_BIN/initdb" -D "$PG_DIR/data" -U wor --auth=trust -E UTF8 >"$PG_DIR/initdb.log" 2>&1 \
  || { cat "$PG_DIR/initdb.log"; exit 1; }
"${PG_RUN[@]}" "$PG_BIN/pg_ctl" -D "$PG_DIR/data" -l "$PG_DIR/server.log" -w \
  -o "-c listen_addresses=127.0.0.1 -p $PG_PORT -k $PG_DIR -c fsync=off -c max_connections=300" start >/dev/null \
  || { cat "$PG_DIR/server.log"; exit 1; }
"${PG_RUN[@]}" "$PG_BIN/createdb" -h 127.0.0.1 -p "$PG_PORT" -U wor wor_test
export WOR_PG_URL="postgres://wor@127.0.0.1:$PG_PORT/wor_test"
echo "ci: PostgreSQL $("$PG_BIN/postgres" --version | awk '{print $3}') on 127.0.0.1:$PG_PORT"

pg_stop() {
  "${PG_RUN[@]}" "$PG_BIN/pg_ctl" -D "$PG_DIR/data" -m fast stop >/dev/null 2>&1 || true
  rm -rf "$PG_DIR"
}
