#!/bin/bash
# What the WAL feed costs the primary while it follows a write load:
# pgbench single-row inserts (-c 4 -j 2 -T 8, bench/pgbench/insert.sql) on
# the throwaway logical primary (scripts/pg.sh replicas, :54332) with GW
# gateways on the `wal` feed (default 2; GW=0: none), and the CPU seconds
# spent meanwhile by the gateways, by their walsenders, by their feeds'
# other (SQL) connections and by all of the primary's processes, read from
# /proc. BIN picks the gateway binary (default target/release/bloomgate),
# so two builds can be compared in one run, and POLL (e.g. 5ms) sets
# `wal_poll_interval`, the feed polled instead of streamed:
#   for r in 1 2; do GW=2 bench/feed-cpu.sh; POLL=5ms GW=2 bench/feed-cpu.sh; GW=0 bench/feed-cpu.sh; done
set -euo pipefail
cd "$(dirname "$0")/.."
export PGHOST=127.0.0.1 PGPORT=54332 PGUSER=postgres
DB=bloomgate_diag
URL="postgres://postgres@127.0.0.1:54332/$DB"
BIN=${BIN:-target/release/bloomgate}
[ -x "$BIN" ] || cargo build --locked -q --release --bin bloomgate
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
. bench/lib.sh
pgbench_db
cfg=$(bench_config wal wal "${POLL:+wal_poll_interval = \"$POLL\"}")
env -u BLOOMGATE_ADMIN_TOKEN "$BIN" install-feed --config "$cfg" >/dev/null
pids=()
for i in $(seq ${GW:-2}); do
  env -u BLOOMGATE_ADMIN_TOKEN RUST_LOG=warn "$BIN" serve --config "$cfg" >$work/gw$i.log 2>&1 &
  pids+=($!)
done
sleep 3
ticks() { awk '{print $14+$15}' /proc/$1/stat 2>/dev/null || echo 0; }
ws=$(psql -Atd postgres -c "SELECT pid FROM pg_stat_activity WHERE datname='$DB' AND backend_type='walsender'")
side=$(psql -Atd postgres -c "SELECT pid FROM pg_stat_activity WHERE datname='$DB' AND application_name='bloomgate-wal-feed' AND backend_type='client backend'")
pm=$(head -1 "${BLOOMGATE_PRIMARY_DIR:-/tmp/bloomgate-pg-primary}/postmaster.pid")
allpg() { local t=0; for p in $(pgrep -P $pm); do t=$((t+$(ticks $p))); done; echo $t; }
snap() { local g=0 w=0 s=0; for p in "${pids[@]}"; do g=$((g+$(ticks $p))); done; for p in $ws; do w=$((w+$(ticks $p))); done; for p in $side; do s=$((s+$(ticks $p))); done; echo "$g $w $s $(allpg)"; }
read g0 w0 s0 a0 < <(snap)
tps=$(pgbench -n -f bench/pgbench/insert.sql -c 4 -j 2 -T 8 "$DB" 2>/dev/null | awk '/^tps = /{print $3}')
read g1 w1 s1 a1 < <(snap)
cs() { awk -v t="$1" 'BEGIN{printf "%.2f", t/100}'; }
echo "gateways=${GW:-2}${POLL:+ poll=$POLL} tps=$tps cpu_s: gateways=$(cs $((g1-g0))) walsenders=$(cs $((w1-w0))) feed_sql_conns=$(cs $((s1-s0))) primary_all=$(cs $((a1-a0)))"
for p in "${pids[@]}"; do kill $p; done; wait 2>/dev/null || true
psql -qd postgres -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" >/dev/null
