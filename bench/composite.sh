#!/usr/bin/env bash
# bench/composite.sh: a composite (bigint, bigint) key against a single
# bigint key, both in the Bloom filter, on the same table and rows: CPU per
# request of a cache hit and of a filtered 404, alternating round by round
# (bench/ab.sh, which this runs once per workload).
#
#   bench/composite.sh            # hit and attack, ROUNDS [6], DURATION [10s]
#
# The table `tenant_users` (tenant_id = 1 for every row, id 1..1,000,000,
# unique on id and on (tenant_id, id)) lives in its own database,
# `bloomgate_composite`, made once. The single key is served at
# `/c/1/{id}`, the composite one at `/c/{tenant_id}/{id}`, so the one
# request path `/c/1/<id>` (keys.lua's PATH_PREFIX) asks both for the same
# row. `freshness = "off"`: the request path alone is measured.
set -euo pipefail
cd "$(dirname "$0")/.."
PG_URL=${PG_URL:-postgres://postgres@127.0.0.1:5432}
ROUNDS=${ROUNDS:-6} DURATION=${DURATION:-10s}
DB=bloomgate_composite
command -v wrk >/dev/null || { apt-get update -qq && apt-get install -y -qq wrk >/dev/null; }
cargo build --release --locked --bin bloomgate
if ! psql "$PG_URL/$DB" -Atc "SELECT 1 FROM tenant_users LIMIT 1" >/dev/null 2>&1; then
  psql "$PG_URL/postgres" -qc "CREATE DATABASE $DB" 2>/dev/null || true
  psql "$PG_URL/$DB" -q <<'SQL'
DROP TABLE IF EXISTS tenant_users;
CREATE TABLE tenant_users AS
  SELECT 1::bigint AS tenant_id, g::bigint AS id, 'User ' || g AS name,
         'user' || g || '@example.com' AS email
    FROM generate_series(1, 1000000) g;
ALTER TABLE tenant_users ADD PRIMARY KEY (tenant_id, id);
CREATE UNIQUE INDEX ON tenant_users (id);
VACUUM ANALYZE tenant_users;
SQL
fi
WORK=$(mktemp -d /tmp/bloomgate-composite.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
write() { # NAME ROUTE KEY_COLUMN KEY_TYPE
  cat >"$WORK/$1.toml" <<TOML
[server]
listen = "127.0.0.1:18085"
[admin]
listen = "127.0.0.1:19095"
[database]
url = "$PG_URL/$DB"
freshness = "off"
[filter]
mode = "bloom"
[[resource]]
name = "tenant_users"
route = "$2"
table = "tenant_users"
key_column = $3
key_type = $4
columns = ["id", "name", "email"]
TOML
  # A "binary" for ab.sh: the gateway on this config (its pid is the
  # gateway's, by exec; ab.sh's own arguments are ignored).
  printf '#!/bin/sh\nunset DATABASE_URL BLOOMGATE_SERVER__LISTEN\nexec %s serve --config %s\n' \
    "$PWD/target/release/bloomgate" "$WORK/$1.toml" >"$WORK/$1"
  chmod +x "$WORK/$1"
}
write single '/c/1/{id}' '"id"' '"bigint"'
write composite '/c/{tenant_id}/{id}' '["tenant_id", "id"]' '"bigint"'
for wl in hit attack; do
  echo "== $wl"
  PATH_PREFIX=/c/1/ WORKLOAD=$wl ROUNDS=$ROUNDS DURATION=$DURATION \
    bench/ab.sh "$WORK/single" "$WORK/composite"
done
