#!/usr/bin/env bash
# bench/replica-load.sh: what two gateways cost the primary with and
# without a streaming read replica (issue 13, "Measured"), side by side in
# one run.
#
# Runs on the throwaway primary/replica pair of scripts/pg.sh
# (`ensure_replica_pair`: primary :54332 with wal_level = logical, replica
# :54333 made by pg_basebackup), never on a server it did not start. Seeds
# 1,000,000 users into a scratch database on the primary (replicated), then
# for each setup
#
#   primary   2 gateways, WAL feed, every scan and row load on the primary
#   replica   the same 2 gateways with `replica_urls` = the replica: scans
#             and loads on the replica once it has replayed past the
#             change that concerns them (by LSN), the feed on the primary
#
# and each workload of bench/keys.lua (cold: uniform over the 1M users, 10×
# the cache; mixed: 90 % Zipf-hot, 10 % absent), runs wrk against both
# gateways at once for DURATION after a warm-up and reports: requests/s over
# both gateways, CPU seconds used by each server's processes (the
# postmaster's children: backends, walsenders, the startup process), and
# transactions per request on each server (pg_stat_database, the gateways'
# scratch database; the WAL feed's slot reads on the primary included).
# Also the start-up of a gateway (process start to /readyz) with its key
# scan on the primary against on the replica; with STARTUP_USERS set (e.g.
# 10000000), once more on a database of that many users, one gateway at a
# time, STARTUP_REPS times per setup, with the CPU each server spent
# meanwhile.
#
# Environment (defaults in brackets): DURATION [10s], WARMUP [3s],
# CONNECTIONS [32] per gateway, ROUNDS [2] (setups alternate per round),
# STARTUP_USERS [unset: skipped], STARTUP_REPS [3], LOAD [1] (0: only the
# start-up measurement).
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION=${DURATION:-10s}
WARMUP=${WARMUP:-3s}
CONNECTIONS=${CONNECTIONS:-32}
ROUNDS=${ROUNDS:-2}
STARTUP_USERS=${STARTUP_USERS:-}
STARTUP_REPS=${STARTUP_REPS:-3}
LOAD=${LOAD:-1}
DB_STARTUP=bloomgate_fleet_startup
USERS=1000000 # bench/keys.lua's N
. scripts/pg.sh
ensure_replica_pair
PRIMARY=$BLOOMGATE_TEST_PRIMARY_URL REPLICA=$BLOOMGATE_TEST_REPLICA_URL
PDIR=${BLOOMGATE_PRIMARY_DIR:-/tmp/bloomgate-pg-primary} RDIR=${BLOOMGATE_REPLICA_DIR:-/tmp/bloomgate-pg-replica}
DB=bloomgate_fleet
PORTS=(18092 18093)
TCK=$(getconf CLK_TCK)
psql_on() { local url=$1; shift; command psql "$url/${DB_OVERRIDE:-postgres}" -X -q -v ON_ERROR_STOP=1 -Atc "$@"; }

for port in "${PORTS[@]}"; do
  if ss -Hltn "sport = :$port" 2>/dev/null | grep -q .; then
    echo "port $port is in use; bench/replica-load.sh needs ${PORTS[*]}" >&2; exit 1
  fi
done
command -v wrk >/dev/null || { echo "needs wrk (apt-get install wrk)" >&2; exit 1; }
cargo build --locked -q --release --bin bloomgate
BIN=$PWD/target/release/bloomgate
work=$(mktemp -d)
pids=()
. bench/lib.sh
cleanup() {
  stop_gateways
  psql_on "$PRIMARY" "DROP DATABASE IF EXISTS $DB WITH (FORCE)" || true
  psql_on "$PRIMARY" "DROP DATABASE IF EXISTS $DB_STARTUP WITH (FORCE)" || true
  rm -rf "$work"
}
trap cleanup EXIT

psql_on "$PRIMARY" "DROP DATABASE IF EXISTS $DB WITH (FORCE)"
psql_on "$PRIMARY" "CREATE DATABASE $DB"
echo "seeding $USERS users" >&2
DATABASE_URL="$PRIMARY/$DB?options=-c%20session_replication_role%3Dreplica" \
  "$BIN" seed --config config/bloomgate.toml --users "$USERS" --articles 10000 >&2
DB_OVERRIDE=$DB psql_on "$PRIMARY" "VACUUM ANALYZE users"
DATABASE_URL="$PRIMARY/$DB" "$BIN" install-feed --config config/bloomgate.toml >&2
caught_up() { # wait until the replica has replayed what the primary wrote
  local target i
  target=$(psql_on "$PRIMARY" "SELECT pg_current_wal_lsn()")
  for i in $(seq 600); do
    [ "$(psql_on "$REPLICA" "SELECT pg_last_wal_replay_lsn() >= '$target'")" = t ] && return 0
    sleep 0.1
  done
  echo "replica not caught up" >&2; exit 1
}
caught_up

cluster_ticks() { # data dir -> utime+stime of the postmaster's children
  local pm
  pm=$(head -1 "$1/postmaster.pid")
  # shellcheck disable=SC2046
  cat $(for c in $(pgrep -P "$pm"); do echo "/proc/$c/stat"; done) 2>/dev/null \
    | awk '{ s += $14 + $15 } END { print s + 0 }'
}
xacts() { # server URL -> transactions in the scratch database so far
  psql_on "$1" "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = '$DB'"
}

start_gateways() { # setup; writes the start-up ms of the first gateway to $work/startup
  # (not called in $(...): the pids must land in this shell's array)
  local setup=$1 i log t0 ready_ms=""
  local extra=()
  [ "$setup" = replica ] && extra=(BLOOMGATE_DATABASE__REPLICA_URLS="[\"$REPLICA/$DB\"]")
  for i in 0 1; do
    log="$work/gw-$setup-$i.log"
    t0=$(date +%s%N)
    env "${extra[@]}" DATABASE_URL="$PRIMARY/$DB" BLOOMGATE_DATABASE__FRESHNESS=wal \
      BLOOMGATE_DATABASE__INSTALL_TRIGGERS=false BLOOMGATE_SERVER__LISTEN="127.0.0.1:${PORTS[$i]}" \
      RUST_LOG=warn "$BIN" serve --config config/bloomgate.toml >"$log" 2>&1 &
    pids+=($!)
    for _ in $(seq 1200); do
      # Ours, not a leftover on the port: still running and ready.
      kill -0 "${pids[-1]}" 2>/dev/null && curl -sf -o /dev/null "http://127.0.0.1:${PORTS[$i]}/readyz" && break
      kill -0 "${pids[-1]}" 2>/dev/null || { tail -20 "$log" >&2; exit 1; }
      sleep 0.02
    done
    [ -z "$ready_ms" ] && ready_ms=$((($(date +%s%N) - t0) / 1000000))
  done
  echo "$ready_ms" >"$work/startup"
}

load() { # workload seed duration -> total requests over both gateways
  local w=$1 seed=$2 d=$3 i out=()
  for i in 0 1; do
    wrk -t1 -c"$CONNECTIONS" -d"$d" -s bench/keys.lua "http://127.0.0.1:${PORTS[$i]}" -- "$w" "$((seed + i))" \
      >"$work/wrk-$i.txt" 2>&1 &
    out+=($!)
  done
  wait "${out[@]}"
  cat "$work"/wrk-[01].txt | grep RESULT | tr ' ' '\n' | awk -F= '$1 == "requests" { s += $2 } END { print s + 0 }'
}

if [ "$LOAD" = 1 ]; then
echo "round setup workload startup_ms requests rps primary_cpu_s replica_cpu_s primary_xact_per_req replica_xact_per_req" >"$work/raw.txt"
for r in $(seq "$ROUNDS"); do
  setups=(primary replica)
  [ $((r % 2)) -eq 0 ] && setups=(replica primary)
  for setup in "${setups[@]}"; do
    for w in cold mixed; do
      stop_gateways
      start_gateways "$setup"
      ms=$(cat "$work/startup")
      load "$w" 7 "$WARMUP" >/dev/null
      pc0=$(cluster_ticks "$PDIR") rc0=$(cluster_ticks "$RDIR")
      px0=$(xacts "$PRIMARY") rx0=$(xacts "$REPLICA")
      t0=$(date +%s%N)
      n=$(load "$w" 42 "$DURATION")
      t1=$(date +%s%N)
      pc1=$(cluster_ticks "$PDIR") rc1=$(cluster_ticks "$RDIR")
      # pg_stat_database is flushed by each backend within a second or so
      # of its transactions (PG 15: at most every 10 s while busy; idle
      # backends flush within 1 s): wait for the gateways' to settle.
      sleep 11
      px1=$(xacts "$PRIMARY") rx1=$(xacts "$REPLICA")
      echo "$r $setup $w $ms $n" \
        "$(awk -v n="$n" -v t="$((t1 - t0))" 'BEGIN { printf "%.0f", n / (t / 1e9) }')" \
        "$(awk -v a="$pc0" -v b="$pc1" -v k="$TCK" 'BEGIN { printf "%.2f", (b - a) / k }')" \
        "$(awk -v a="$rc0" -v b="$rc1" -v k="$TCK" 'BEGIN { printf "%.2f", (b - a) / k }')" \
        "$(awk -v a="$px0" -v b="$px1" -v n="$n" 'BEGIN { printf "%.3f", (b - a) / n }')" \
        "$(awk -v a="$rx0" -v b="$rx1" -v n="$n" 'BEGIN { printf "%.3f", (b - a) / n }')" \
        | tee -a "$work/raw.txt"
    done
  done
done
stop_gateways
echo
echo "2 gateways, wrk -t1 -c$CONNECTIONS -d$DURATION each, $ROUNDS rounds, $(nproc) cores, $(psql_on "$PRIMARY" 'SHOW server_version')"
column -t "$work/raw.txt"
fi

[ -n "$STARTUP_USERS" ] || exit 0
psql_on "$PRIMARY" "DROP DATABASE IF EXISTS $DB_STARTUP WITH (FORCE)"
psql_on "$PRIMARY" "CREATE DATABASE $DB_STARTUP"
echo "seeding $STARTUP_USERS users for the start-up measurement" >&2
DATABASE_URL="$PRIMARY/$DB_STARTUP?options=-c%20session_replication_role%3Dreplica" \
  "$BIN" seed --config config/bloomgate.toml --users "$STARTUP_USERS" --articles 0 >&2
DB_OVERRIDE=$DB_STARTUP psql_on "$PRIMARY" "VACUUM ANALYZE users"
DATABASE_URL="$PRIMARY/$DB_STARTUP" "$BIN" install-feed --config config/bloomgate.toml >&2
caught_up
echo "setup rep startup_ms primary_cpu_s replica_cpu_s" >"$work/startup.txt"
for rep in $(seq "$STARTUP_REPS"); do
  for setup in primary replica; do
    extra=()
    [ "$setup" = replica ] && extra=(BLOOMGATE_DATABASE__REPLICA_URLS="[\"$REPLICA/$DB_STARTUP\"]")
    pc0=$(cluster_ticks "$PDIR") rc0=$(cluster_ticks "$RDIR")
    t0=$(date +%s%N)
    env "${extra[@]}" DATABASE_URL="$PRIMARY/$DB_STARTUP" BLOOMGATE_DATABASE__FRESHNESS=wal \
      BLOOMGATE_DATABASE__INSTALL_TRIGGERS=false BLOOMGATE_SERVER__LISTEN="127.0.0.1:${PORTS[0]}" \
      RUST_LOG=warn "$BIN" serve --config config/bloomgate.toml >"$work/startup-$setup.log" 2>&1 &
    pids+=($!)
    for _ in $(seq 3000); do
      kill -0 "${pids[-1]}" 2>/dev/null && curl -sf -o /dev/null "http://127.0.0.1:${PORTS[0]}/readyz" && break
      kill -0 "${pids[-1]}" 2>/dev/null || { tail -20 "$work/startup-$setup.log" >&2; exit 1; }
      sleep 0.02
    done
    t1=$(date +%s%N)
    pc1=$(cluster_ticks "$PDIR") rc1=$(cluster_ticks "$RDIR")
    stop_gateways
    echo "$setup $rep $(((t1 - t0) / 1000000))" \
      "$(awk -v a="$pc0" -v b="$pc1" -v k="$TCK" 'BEGIN { printf "%.2f", (b - a) / k }')" \
      "$(awk -v a="$rc0" -v b="$rc1" -v k="$TCK" 'BEGIN { printf "%.2f", (b - a) / k }')" \
      | tee -a "$work/startup.txt"
  done
done
echo
echo "start-up of one gateway at $STARTUP_USERS users (process start to /readyz)"
column -t "$work/startup.txt"
