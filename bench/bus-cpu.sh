#!/bin/bash
# What following the WAL costs the primary (and Redis) at a fixed write
# rate, GW gateways each with its own walsender (direct) or on the bus
# (BUS=1: a redis-server of its own on a free port, one relay): pgbench
# single-row inserts at RATE transactions a second (default 1000) for SECS
# (default 8) on the throwaway logical primary (scripts/pg.sh replicas,
# :54332); CPU seconds from /proc of the walsenders, every process of the
# primary, redis-server and the gateways; per transaction in µs. BIN picks
# the gateway binary (default target/release/bloomgate).
#   for n in 1 2 4 8; do GW=$n bench/bus-cpu.sh; GW=$n BUS=1 bench/bus-cpu.sh; done
set -euo pipefail
cd "$(dirname "$0")/.."
export PGHOST=127.0.0.1 PGPORT=54332 PGUSER=postgres
DB=bloomgate_bus_bench
URL="postgres://postgres@127.0.0.1:54332/$DB"
BIN=${BIN:-target/release/bloomgate}
RATE=${RATE:-1000}
SECS=${SECS:-8}
GW=${GW:-1}
SLOT=bloomgate_bench_bus
[ -x "$BIN" ] || cargo build --locked -q --release --bin bloomgate
work=$(mktemp -d)
pids=()
rpid=""
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  [ -n "$rpid" ] && kill "$rpid" 2>/dev/null || true
  sleep 1
  psql -qd postgres -c "SELECT pg_drop_replication_slot('$SLOT') FROM pg_replication_slots WHERE slot_name = '$SLOT' AND NOT active" >/dev/null 2>&1 || true
  psql -qd postgres -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT
. bench/lib.sh
pgbench_db
settings=""
if [ -n "${BUS:-}" ]; then
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no >/dev/null 2>&1 &
  rpid=$!
  settings=$(printf '[bus]\nurl = "redis://127.0.0.1:%s/0"\nslot = "%s"\n' "$port" "$SLOT")
fi
cfg=$(bench_config wal wal "$settings")
env -u BLOOMGATE_ADMIN_TOKEN "$BIN" install-feed --config "$cfg" >/dev/null
for i in $(seq "$GW"); do
  env -u BLOOMGATE_ADMIN_TOKEN RUST_LOG=warn "$BIN" serve --config "$cfg" >"$work/gw$i.log" 2>&1 &
  pids+=($!)
done
# Every gateway streaming: GW walsenders direct, one on the bus.
want=$GW
[ -n "${BUS:-}" ] && want=1
for _ in $(seq 100); do
  n=$(psql -Atd postgres -c "SELECT count(*) FROM pg_stat_activity WHERE datname='$DB' AND backend_type='walsender'")
  [ "$n" -ge "$want" ] && break
  sleep 0.2
done
sleep 3
ticks() { awk '{print $14+$15}' /proc/$1/stat 2>/dev/null || echo 0; }
ws=$(psql -Atd postgres -c "SELECT pid FROM pg_stat_activity WHERE datname='$DB' AND backend_type='walsender'")
pm=$(head -1 "${BLOOMGATE_PRIMARY_DIR:-/tmp/bloomgate-pg-primary}/postmaster.pid")
allpg() { local t=0; for p in $(pgrep -P "$pm"); do t=$((t+$(ticks "$p"))); done; echo $t; }
snap() {
  local g=0 w=0 r=0
  for p in "${pids[@]}"; do g=$((g+$(ticks "$p"))); done
  for p in $ws; do w=$((w+$(ticks "$p"))); done
  [ -n "$rpid" ] && r=$(ticks "$rpid")
  echo "$g $w $r $(allpg)"
}
read -r g0 w0 r0 a0 < <(snap)
out=$(pgbench -n -f bench/pgbench/insert.sql -c 4 -j 2 -R "$RATE" -T "$SECS" "$DB" 2>/dev/null)
read -r g1 w1 r1 a1 < <(snap)
txns=$(awk '/number of transactions actually processed/{print $NF}' <<<"$out" | cut -d/ -f1)
lat=$(awk '/^latency average/{print $4}' <<<"$out")
per() { awk -v t="$1" -v n="$txns" 'BEGIN{printf "%.0f", t*10000/n}'; }
echo "gateways=$GW feed=$([ -n "${BUS:-}" ] && echo bus || echo direct) walsenders=$(wc -w <<<"$ws") txns=$txns writer_latency_ms=$lat us_per_txn: walsenders=$(per $((w1-w0))) primary_all=$(per $((a1-a0))) redis=$(per $((r1-r0))) gateways=$(per $((g1-g0)))"
