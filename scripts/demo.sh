#!/usr/bin/env bash
# Runs the gateway on demo data: starts PostgreSQL if none is running,
# creates the `bloomgate` database, migrates, seeds (idempotent) and serves
# on http://127.0.0.1:8080 with config/bloomgate.toml.
#   USERS=1000000 ARTICLES=100000 scripts/demo.sh
#   BLOOMGATE_DB=bloomgate          the database served (created if missing)
#   BLOOMGATE_BIN=target/release/bloomgate   a binary already built (default:
#                                   cargo builds the release binary first)
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/pg.sh
ensure_postgres
db=${BLOOMGATE_DB:-bloomgate}
if ! psql "$PG_BASE_URL/postgres" -Atqc "SELECT 1 FROM pg_database WHERE datname = '$db'" | grep -q 1; then
  psql "$PG_BASE_URL/postgres" -qc "CREATE DATABASE \"$db\""
fi
export DATABASE_URL="$PG_BASE_URL/$db"
echo "demo.sh: database $DATABASE_URL (psql \"\$(scripts/pg.sh start)/$db\")" >&2
bin=${BLOOMGATE_BIN:-}
if [ -z "$bin" ]; then
  cargo build --locked --release --bin bloomgate
  bin=./target/release/bloomgate
fi
"$bin" seed --users "${USERS:-1000000}" --articles "${ARTICLES:-100000}"
exec "$bin" serve "$@"
