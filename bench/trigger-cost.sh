#!/usr/bin/env bash
# bench/trigger-cost.sh: what the triggers cost writers (issue 10, item 4),
# as pgbench TPS without a trigger, with the notification triggers and with
# the queue triggers (`freshness = "queue"`), side by side in one run.
#
# In a throwaway database it creates the tables of bench/pgbench/setup.sql,
# installs the triggers with the real `bloomgate install-triggers` (so the
# SQL measured is the SQL shipped: resources users by id, users by email,
# docs by id), and runs a `bloomgate serve` on the arm's feed, as in
# production: LISTENing and applying every notification, or polling the
# change table every 5 ms (pruning it too). Then, for each workload
#
#   insert   bench/pgbench/insert.sql: single-row inserts (two key columns
#            announced)
#   update   bench/pgbench/update.sql: updates of an integer column of rows
#            holding 100 kB of text
#
# it runs ROUNDS rounds of the three arms, DURATION seconds each, the arms'
# order rotating from round to round:
#
#   none     triggers disabled (`ALTER TABLE … DISABLE TRIGGER USER`), no
#            gateway
#   notify   the notifying triggers, one gateway listening
#   queue    the queue triggers, one gateway polling
#
# and prints the median TPS of each and the cost of each trigger arm: the
# median over the rounds of 1 − arm/none, each round's arms run back to
# back (on a shared machine the TPS drifts by more than the cost; a round
# sees the same drift), with the lowest and highest round. SYNC_COMMIT=off
# takes the WAL flush out of every commit, so the trigger's CPU is a larger
# share of a transaction; with more than one client, notifying transactions
# commit one at a time (Postgres serialises them on the notification
# queue's lock, held through the commit's WAL flush), which is NOTIFY's
# cost, not the function's. The queue's row takes no such lock.
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

cargo build --locked -q --release --bin bloomgate
BIN=target/release/bloomgate
work=$(mktemp -d)
pids=()
. bench/lib.sh
cleanup() {
  stop_gateways
  psql -d postgres -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" || true
  rm -rf "$work"
}
trap cleanup EXIT

psql -d postgres -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" -c "CREATE DATABASE $DB"
psql -d "$DB" -f bench/pgbench/setup.sql

notify_cfg=$(bench_config notify)
queue_cfg=$(bench_config queue)
install() { # config
  env -u BLOOMGATE_ADMIN_TOKEN "$BIN" install-triggers --config "$1" >/dev/null
}
triggers() { # enable|disable
  psql -d "$DB" -c "ALTER TABLE tc_users ${1^^} TRIGGER USER" -c "ALTER TABLE tc_docs ${1^^} TRIGGER USER"
}
start_gateway() { # config
  local log="$work/gw-$(date +%s%N).log"
  env -u BLOOMGATE_ADMIN_TOKEN nice -n 19 "$BIN" serve --config "$1" >"$log" 2>&1 &
  pids+=($!)
  for _ in $(seq 150); do
    grep -q 'ready' "$log" && return
    kill -0 "${pids[-1]}" 2>/dev/null || { cat "$log" >&2; exit 1; }
    sleep 0.1
  done
  cat "$log" >&2
  exit 1
}
arm() { # none|notify|queue
  stop_gateways
  case $1 in
    none) triggers disable ;;
    notify) install "$notify_cfg"; triggers enable; start_gateway "$notify_cfg" ;;
    queue) install "$queue_cfg"; triggers enable; start_gateway "$queue_cfg" ;;
  esac
}
run() { # script -> TPS
  PGOPTIONS="-c synchronous_commit=$SYNC_COMMIT" nice pgbench -n -f "bench/pgbench/$1.sql" \
    -c "$CLIENTS" -j "$THREADS" -T "$DURATION" "$DB" 2>/dev/null \
    | awk '/^tps = /{print $3}'
}
median() { sort -g | awk '{a[NR]=$1} END{print a[int((NR+1)/2)]}'; }

arms=(none notify queue)
echo "workload round arm tps" >"$work/raw.txt"
for w in insert update; do
  for r in $(seq "$ROUNDS"); do
    for k in 0 1 2; do
      a=${arms[$(((r + k) % 3))]}
      arm "$a"
      echo "$w $r $a $(run "$w")" | tee -a "$work/raw.txt"
    done
  done
done
stop_gateways

echo
echo "pgbench -c $CLIENTS -j $THREADS -T $DURATION, $ROUNDS rounds, synchronous_commit=$SYNC_COMMIT, fsync=$(psql -d "$DB" -Atc 'SHOW fsync'), $(nproc) cores, $(psql -d "$DB" -Atc 'SHOW server_version')"
printf '%-8s %10s %11s %9s %16s %10s %9s %16s\n' workload "TPS none" "TPS notify" cost "rounds' range" "TPS queue" cost "rounds' range"
for w in insert update; do
  tps() { awk -v w="$w" -v a="$1" '$1==w && $3==a {print $4}' "$work/raw.txt" | median; }
  costs() { # arm -> one cost per round, in %
    awk -v w="$w" -v a="$1" '$1==w && $3=="none" {n[$2]=$4} $1==w && $3==a {x[$2]=$4}
      END {for (r in x) print (1 - x[r] / n[r]) * 100}' "$work/raw.txt"
  }
  range() { costs "$1" | sort -g | awk 'NR==1{lo=$1} {hi=$1} END{printf "%.1f%% .. %.1f%%", lo, hi}'; }
  printf '%-8s %10.0f %11.0f %8.1f%% %16s %10.0f %8.1f%% %16s\n' "$w" "$(tps none)" "$(tps notify)" \
    "$(costs notify | median)" "$(range notify)" "$(tps queue)" "$(costs queue | median)" "$(range queue)"
done
echo
echo "raw (workload round arm tps):"
tail -n +2 "$work/raw.txt"
