#!/usr/bin/env bash
# bench/trigger-cost.sh: what the notification triggers cost writers
# (issue 10, item 4), as pgbench TPS without and with the trigger, side by
# side in one run.
#
# In a throwaway database it creates the tables of bench/pgbench/setup.sql,
# installs the triggers with the real `bloomgate install-triggers` (so the
# SQL measured is the SQL shipped: resources users by id, users by email,
# docs by id), and runs a `bloomgate serve` that LISTENs and applies every
# notification, as in production. Then, for each workload
#
#   insert   bench/pgbench/insert.sql: single-row inserts (two key columns
#            announced)
#   update   bench/pgbench/update.sql: updates of an integer column of rows
#            holding 100 kB of text
#
# it alternates ROUNDS pairs of runs with the triggers disabled (`ALTER
# TABLE … DISABLE TRIGGER USER`) and enabled, DURATION seconds each, and
# prints the median TPS of each and the cost: the median over the rounds of
# 1 − with/without, each pair run back to back (on a shared machine the TPS
# drifts by more than the cost; a pair sees the same drift), with the
# lowest and highest round. SYNC_COMMIT=off takes the WAL
# flush out of every commit, so the trigger's CPU is a larger share of a
# transaction; with more than one client, notifying transactions commit one
# at a time (Postgres serialises them on the notification queue's lock, held
# through the commit's WAL flush), which is NOTIFY's cost, not the
# function's.
#
# Environment (defaults in brackets): DURATION [5], ROUNDS [9],
# CLIENTS [4], THREADS [2], PGHOST/PGPORT [127.0.0.1/5432], SYNC_COMMIT [on].
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION=${DURATION:-5}
ROUNDS=${ROUNDS:-9}
CLIENTS=${CLIENTS:-4}
THREADS=${THREADS:-2}
SYNC_COMMIT=${SYNC_COMMIT:-on}
. scripts/pg.sh
ensure_postgres
DB=bloomgate_trigger_cost
URL="$PG_BASE_URL/$DB"
host=${PG_BASE_URL#*@}
export PGHOST=${host%:*} PGPORT=${host##*:} PGUSER=postgres
psql() { command psql -X -q -v ON_ERROR_STOP=1 "$@"; }

cargo build -q --bin bloomgate
BIN=target/debug/bloomgate
work=$(mktemp -d)
gw_pid=""
cleanup() {
  [ -n "$gw_pid" ] && kill "$gw_pid" 2>/dev/null && wait "$gw_pid" 2>/dev/null
  psql -d postgres -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" || true
  rm -rf "$work"
}
trap cleanup EXIT

psql -d postgres -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" -c "CREATE DATABASE $DB"
psql -d "$DB" -f bench/pgbench/setup.sql

. bench/lib.sh
cfg=$(bench_config notify bench)
env -u BLOOMGATE_ADMIN_TOKEN "$BIN" install-triggers --config "$cfg"
env -u BLOOMGATE_ADMIN_TOKEN nice -n 19 "$BIN" serve --config "$cfg" >"$work/gateway.log" 2>&1 &
gw_pid=$!
for _ in $(seq 100); do
  grep -q '"ready"\|ready' "$work/gateway.log" && break
  sleep 0.2
done
kill -0 "$gw_pid" || { cat "$work/gateway.log"; exit 1; }

triggers() { # enable|disable
  psql -d "$DB" -c "ALTER TABLE tc_users ${1^^} TRIGGER USER" -c "ALTER TABLE tc_docs ${1^^} TRIGGER USER"
}
run() { # script -> TPS
  PGOPTIONS="-c synchronous_commit=$SYNC_COMMIT" nice pgbench -n -f "bench/pgbench/$1.sql" \
    -c "$CLIENTS" -j "$THREADS" -T "$DURATION" "$DB" 2>/dev/null \
    | awk '/^tps = /{print $3}'
}
median() { sort -g | awk '{a[NR]=$1} END{print a[int((NR+1)/2)]}'; }

echo "workload round without with" >"$work/raw.txt"
for w in insert update; do
  for r in $(seq "$ROUNDS"); do
    # Which of the pair runs first alternates, so neither gets the better
    # half of a drift every time.
    if [ $((r % 2)) -eq 1 ]; then
      triggers disable; off=$(run "$w"); triggers enable; on=$(run "$w")
    else
      triggers enable; on=$(run "$w"); triggers disable; off=$(run "$w")
    fi
    echo "$w $r $off $on" | tee -a "$work/raw.txt"
  done
done
echo
echo "pgbench -c $CLIENTS -j $THREADS -T $DURATION, $ROUNDS rounds, synchronous_commit=$SYNC_COMMIT, $(nproc) cores"
printf '%-8s %12s %12s %8s %16s\n' workload "TPS without" "TPS with" cost "rounds' range"
for w in insert update; do
  off=$(awk -v w="$w" '$1==w{print $3}' "$work/raw.txt" | median)
  on=$(awk -v w="$w" '$1==w{print $4}' "$work/raw.txt" | median)
  cost=$(awk -v w="$w" '$1==w{print (1 - $4 / $3) * 100}' "$work/raw.txt" | median)
  range=$(awk -v w="$w" '$1==w{print (1 - $4 / $3) * 100}' "$work/raw.txt" | sort -g | awk 'NR==1{lo=$1} {hi=$1} END{printf "%.1f%% .. %.1f%%", lo, hi}')
  awk -v w="$w" -v off="$off" -v on="$on" -v c="$cost" -v r="$range" 'BEGIN{printf "%-8s %12.0f %12.0f %7.1f%% %16s\n", w, off, on, c, r}'
done
echo
echo "raw (workload round without with):"
tail -n +2 "$work/raw.txt"
