#!/bin/bash
# The fleet simulator (examples/fleet_sim.rs): one relay, CONSUMERS real
# gateways (default 1) and N stream readers standing for N gateways' reads,
# against a redis-server of its own and the throwaway logical primary
# (scripts/pg.sh replicas, :54332), under pgbench single-row inserts at
# RATE a second (default 5000) for SECS (default 10). One line per N of
# GATEWAYS (default "1 8 64 256"): Redis, relay and per-gateway CPU per
# commit, delivery and commit-to-servable latency.
#   bench/fleet.sh                       # (no run recorded in docs/perf-log/ yet)
#   GATEWAYS="1 256" RATE=2000 bench/fleet.sh
# BATCH_WINDOW sets bus.batch_window for the relay (default the shipped 2ms).
# REPLICAS=k (default 0) adds k Redis replicas of the primary, the read
# tier (bus.read_from = "replicas"): the readers are spread over them and
# each one's CPU is reported apart from the primary's.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/pg.sh
ensure_replica_pair >/dev/null
export PGHOST=127.0.0.1 PGPORT=${BLOOMGATE_PRIMARY_PORT:-54332} PGUSER=postgres
DB=bloomgate_fleet_sim
URL="postgres://postgres@127.0.0.1:$PGPORT/$DB"
RATE=${RATE:-5000}
SECS=${SECS:-10}
CONSUMERS=${CONSUMERS:-1}
cargo build --locked -q --release --example fleet_sim
work=$(mktemp -d)
rpid=""
rpids=""
cleanup() {
  [ -n "$rpid" ] && kill "$rpid" 2>/dev/null || true
  [ -n "$rpids" ] && kill $rpids 2>/dev/null || true
  sleep 1
  psql -qd postgres -c "SELECT pg_drop_replication_slot('bloomgate_fleet_sim') FROM pg_replication_slots WHERE slot_name = 'bloomgate_fleet_sim' AND NOT active" >/dev/null 2>&1 || true
  psql -qd postgres -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT
for n in ${GATEWAYS:-1 8 64 256}; do
  psql -qd postgres -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" -c "CREATE DATABASE $DB" >/dev/null
  psql -qd "$DB" -f bench/pgbench/setup.sql -c "ALTER TABLE tc_users REPLICA IDENTITY FULL" >/dev/null
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no --maxclients 10000 \
    --repl-diskless-sync-delay 0 >"$work/redis.log" 2>&1 &
  rpid=$!
  sleep 0.3
  replicas=""
  for k in $(seq 1 "${REPLICAS:-0}"); do
    rport=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
    mkdir -p "$work/replica-$k"
    redis-server --port "$rport" --bind 127.0.0.1 --save "" --appendonly no --maxclients 10000 \
      --replicaof 127.0.0.1 "$port" --dir "$work/replica-$k" >"$work/replica-$k.log" 2>&1 &
    rpids+=" $!"
    replicas+="${replicas:+,}redis://127.0.0.1:$rport/0|$!"
    for _ in $(seq 1 100); do
      redis-cli -p "$rport" info replication 2>/dev/null | grep -q master_link_status:up && break
      sleep 0.1
    done
  done
  readers=$((n - CONSUMERS))
  [ "$readers" -lt 0 ] && readers=0
  consumers=$((n < CONSUMERS ? n : CONSUMERS))
  ulimit -n 65536 2>/dev/null || true
  RUST_LOG=warn BATCH_WINDOW=${BATCH_WINDOW:-2ms} REPLICAS="$replicas" \
    target/release/examples/fleet_sim "$URL" "redis://127.0.0.1:$port/0" "$rpid" \
    "$readers" "$consumers" "$RATE" "$SECS"
  kill "$rpid" $rpids 2>/dev/null || true
  wait "$rpid" $rpids 2>/dev/null || true
  rpid=""
  rpids=""
  psql -qd postgres -c "SELECT pg_drop_replication_slot('bloomgate_fleet_sim') FROM pg_replication_slots WHERE slot_name = 'bloomgate_fleet_sim' AND NOT active" >/dev/null 2>&1 || true
done
