#!/usr/bin/env bash
# A throwaway PostgreSQL server on localhost for the distributed tuning test; prints its URL on stdout.
#
#   export CSA2_TEST_POSTGRES_URL=$(bash .ci/postgres.sh)
#
# Idempotent and fast on a second call: installs the server only when missing, runs initdb only
# when the data directory is new, starts it only when nothing answers on the port, creates the
# database only when absent. Trust authentication on 127.0.0.1 only: it is a test fixture.
set -euo pipefail

PORT="${CSA2_PG_PORT:-55432}"
DATA="${CSA2_PG_DATA:-/tmp/csa2-postgres}"
DB="${CSA2_PG_DB:-csa2_test}"
PGUSER_NAME=postgres

find_bin() { ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1; }

BIN="$(find_bin)"
if [ -z "$BIN" ]; then
  echo "postgres.sh: installing postgresql" >&2
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql) >&2
  BIN="$(find_bin)"
fi
[ -n "$BIN" ] || { echo "postgres.sh: postgresql binaries not found after install" >&2; exit 1; }

# initdb and postgres refuse to run as root: run them as the postgres system user the package creates.
if [ "$(id -u)" = 0 ]; then
  id -u "$PGUSER_NAME" >/dev/null 2>&1 || useradd --system --no-create-home "$PGUSER_NAME"
  as_pg() { runuser -u "$PGUSER_NAME" -- "$@"; }
else
  as_pg() { "$@"; }
fi

if [ ! -f "$DATA/PG_VERSION" ]; then
  mkdir -p "$DATA"
  [ "$(id -u)" = 0 ] && chown "$PGUSER_NAME" "$DATA"
  as_pg "$BIN/initdb" -D "$DATA" -U postgres --auth=trust -E UTF8 >/dev/null
fi

if ! "$BIN/pg_isready" -q -h 127.0.0.1 -p "$PORT"; then
  as_pg "$BIN/pg_ctl" -D "$DATA" -l "$DATA/server.log" -w -t 30 \
    -o "-p $PORT -c listen_addresses=127.0.0.1 -k $DATA -c max_connections=200 -c fsync=off" start >/dev/null
fi

if [ "$("$BIN/psql" -h 127.0.0.1 -p "$PORT" -U postgres -tAc "SELECT 1 FROM pg_database WHERE datname = '$DB'")" != 1 ]; then
  "$BIN/createdb" -h 127.0.0.1 -p "$PORT" -U postgres "$DB"
fi

echo "postgresql://postgres@127.0.0.1:$PORT/$DB"
