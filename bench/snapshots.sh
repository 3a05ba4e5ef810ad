#!/bin/bash
# Joining a fleet from the bus's snapshots against scanning (issue 56):
# time to ready and scans of the database, for a gateway that starts
# beside a running one, with `bus.fleet_key_file` (it loads the fleet's
# snapshots) and without (it scans every table itself), side by side in
# one run. Two tables of N rows (default 10,000,000): `users` keyed by a
# dense bigint (the `auto` filter: the exact bitmap) and `tokens` keyed by
# a random uuid (a Bloom filter at 1 %). On the throwaway logical primary
# (scripts/pg.sh replicas, :54332) and a redis-server of its own.
#   bench/snapshots.sh                 # N=10000000, ROUNDS=3
#   N=1000000 ROUNDS=5 bench/snapshots.sh
# The tables are made once in the database `bloomgate_snapshots` and kept
# (10M rows each take a few minutes); DROP DATABASE it to start over.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/pg.sh
ensure_replica_pair >/dev/null
export PGHOST=127.0.0.1 PGPORT=${BLOOMGATE_PRIMARY_PORT:-54332} PGUSER=postgres
N=${N:-10000000}
ROUNDS=${ROUNDS:-3}
DB=bloomgate_snapshots
URL="postgres://postgres@127.0.0.1:$PGPORT/$DB"
cargo build --locked -q --release --bin bloomgate
if [ "$(psql -Atd "$DB" -c "SELECT count(*) = $N FROM users" 2>/dev/null)" != t ]; then
  echo "making $N rows of users and tokens (once)" >&2
  psql -qd postgres -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" -c "CREATE DATABASE $DB"
  psql -qd "$DB" <<SQL
CREATE TABLE users AS SELECT g::bigint AS id, 'user' || g || '@example.com' AS email FROM generate_series(1, $N) g;
ALTER TABLE users ADD PRIMARY KEY (id);
CREATE TABLE tokens AS SELECT gen_random_uuid() AS id, g AS n FROM generate_series(1, $N) g;
ALTER TABLE tokens ADD PRIMARY KEY (id);
ALTER TABLE users REPLICA IDENTITY FULL;
ALTER TABLE tokens REPLICA IDENTITY FULL;
VACUUM ANALYZE users;
VACUUM ANALYZE tokens;
SQL
fi
work=$(mktemp -d)
rpid=""
pids=""
cleanup() {
  [ -n "$pids" ] && kill $pids 2>/dev/null || true
  [ -n "$rpid" ] && kill "$rpid" 2>/dev/null || true
  sleep 1
  psql -qd postgres -c "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = 'bloomgate_snap_bench' AND NOT active" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
rport=$(free_port)
redis-server --port "$rport" --bind 127.0.0.1 --save "" --appendonly no >"$work/redis.log" 2>&1 &
rpid=$!
sleep 0.3
openssl rand -hex 32 >"$work/fleet.key"
config() { # NAME PORT METRICS_PORT FLEET(yes|no)
  local key=""
  [ "$4" = yes ] && key="fleet_key_file = \"$work/fleet.key\""
  cat >"$work/$1.toml" <<TOML
[server]
listen = "127.0.0.1:$2"
[admin]
listen = "127.0.0.1:$(($3 + 100))"
metrics_listen = "127.0.0.1:$3"
[database]
url = "$URL"
freshness = "wal"
install_feed = true
migrate = false
[bus]
url = "redis://127.0.0.1:$rport/0"
slot = "bloomgate_snap_bench"
prefix = "bench"
$key
[[resource]]
name = "users"
route = "/users/{id}"
table = "users"
key_column = "id"
key_type = "bigint"
columns = ["id", "email"]
[[resource]]
name = "tokens"
route = "/tokens/{id}"
table = "tokens"
key_column = "id"
key_type = "uuid"
columns = ["id", "n"]
TOML
}
# Starts NAME and prints the seconds to /readyz 200, then its scans and loads.
start() { # NAME PORT METRICS_PORT
  local t0 t1
  t0=$(date +%s.%N)
  RUST_LOG=warn target/release/bloomgate serve --config "$work/$1.toml" >"$work/$1.log" 2>&1 &
  pids+=" $!"
  eval "pid_$1=$!"
  until curl -fsS "http://127.0.0.1:$2/readyz" >/dev/null 2>&1; do sleep 0.02; done
  t1=$(date +%s.%N)
  local m scans loaded
  m=$(curl -fsS "http://127.0.0.1:$3/metrics")
  scans=$(echo "$m" | awk '/^bloomgate_db_queries_total\{.*kind="scan"/ {s += $2} END {print s + 0}')
  loaded=$(echo "$m" | awk '/^bloomgate_bus_snapshots_loaded_total/ {print $2}')
  printf '%s %.2f s to ready, %s scans, %s snapshots loaded\n' "$1" "$(echo "$t1 - $t0" | bc)" "$scans" "${loaded:-0}"
}
stop() { # NAME
  local pid
  eval "pid=\$pid_$1"
  kill "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
}
config first 18101 19101 yes
config join 18102 19102 yes
config alone 18103 19103 no
echo "N=$N: the first gateway scans and publishes"
start first 18101 19101
for r in $(seq 1 "$ROUNDS"); do
  echo "round $r"
  start join 18102 19102
  stop join
  start alone 18103 19103
  stop alone
done
echo "Redis: $(redis-cli -p "$rport" info memory | grep '^used_memory_human' | tr -d '\r')"
for k in $(redis-cli -p "$rport" --scan --pattern 'bench:*:snap:*'); do
  case "$k" in
    *:snap:users:*|*:snap:tokens:*) echo "$k $(redis-cli -p "$rport" memory usage "$k" samples 0) bytes" ;;
  esac
done
