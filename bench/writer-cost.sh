#!/usr/bin/env bash
# bench/writer-cost.sh: what capturing changes costs the application's
# writers (issue 11, "Writer cost"), side by side in one run: pgbench TPS
# with no capture, with the notification triggers, with the queue
# triggers, with the WAL feed streamed and with it polled, GATEWAYS
# gateways attached in the capturing arms.
#
# Runs on the throwaway primary of scripts/pg.sh (`ensure_replica_pair`:
# wal_level = logical, port 54332, fsync off, its streaming replica
# attached in every arm), never on a server it did not start. In a scratch
# database it creates the tables of bench/pgbench/setup.sql (`tc_users`
# gets REPLICA IDENTITY FULL in every arm, since it is served under two
# keys), then alternates, round by round, five arms:
#
#   none      no trigger, no gateway: the writers alone
#   triggers  `bloomgate install-triggers` enabled, GATEWAYS gateways with
#             `freshness = "notify"` (LISTEN, applying every notification)
#   queue     the queue triggers (installed for `freshness = "queue"`),
#             GATEWAYS gateways polling the change table every 5 ms
#   wal       no trigger, GATEWAYS gateways with `freshness = "wal"` (one
#             temporary logical slot each, streamed to its walsender)
#   poll      the same, `wal_poll_interval = POLL` (each slot polled)
#
# for each workload of bench/trigger-cost.sh (insert: single-row inserts;
# update: an integer column of rows holding 100 kB of text). The arms' order
# rotates from round to round. Prints the median TPS per arm and the cost
# of each capturing arm: the median over the rounds of 1 - arm/none, each
# round's arms run back to back.
#
# Environment (defaults in brackets): DURATION [5] seconds per pgbench run,
# ROUNDS [5], CLIENTS [4], THREADS [2], GATEWAYS [2], POLL [5ms].
# PIN=1 gives the change capture a core of its own, as a primary with a
# spare core would: pgbench and the server's backends (the postmaster, so
# every backend it forks from then on) on CPU 0; the gateways, and the
# feeds' walsenders and SQL connections once started, on CPU 1. The
# postmaster's affinity is restored at exit.
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION=${DURATION:-5}
ROUNDS=${ROUNDS:-5}
CLIENTS=${CLIENTS:-4}
THREADS=${THREADS:-2}
GATEWAYS=${GATEWAYS:-2}
POLL=${POLL:-5ms}
. scripts/pg.sh
ensure_replica_pair
SERVER=$BLOOMGATE_TEST_PRIMARY_URL
DB=bloomgate_writer_cost
URL="$SERVER/$DB"
host=${SERVER#*@}
export PGHOST=${host%:*} PGPORT=${host##*:} PGUSER=postgres
psql() { command psql -X -q -v ON_ERROR_STOP=1 "$@"; }

cargo build --locked -q --release --bin bloomgate
PIN=${PIN:-}
pm=$(head -1 "${BLOOMGATE_PRIMARY_DIR:-/tmp/bloomgate-pg-primary}/postmaster.pid")
# Command prefixes: empty, or taskset onto CPU 0 or 1.
cpu0=() cpu1=()
[ -z "$PIN" ] || { cpu0=(taskset -c 0); cpu1=(taskset -c 1); }
BIN=target/release/bloomgate
work=$(mktemp -d)
pids=()
. bench/lib.sh
cleanup() {
  stop_gateways
  [ -z "$PIN" ] || taskset -pc "0-$(($(nproc) - 1))" "$pm" >/dev/null
  psql -d postgres -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" || true
  rm -rf "$work"
}
trap cleanup EXIT
[ -z "$PIN" ] || taskset -pc 0 "$pm" >/dev/null

pgbench_db
notify_cfg=$(bench_config notify)
wal_cfg=$(bench_config wal)
poll_cfg=$(bench_config wal poll "wal_poll_interval = \"$POLL\"")
queue_cfg=$(bench_config queue)
env -u BLOOMGATE_ADMIN_TOKEN "$BIN" install-triggers --config "$notify_cfg" >/dev/null
env -u BLOOMGATE_ADMIN_TOKEN "$BIN" install-feed --config "$wal_cfg" >/dev/null
# install-feed removed the triggers again; put them back, disabled: the
# triggers arm enables them.
env -u BLOOMGATE_ADMIN_TOKEN "$BIN" install-triggers --config "$notify_cfg" >/dev/null

install() { # config: the triggers for its feed (notify and queue share the functions)
  env -u BLOOMGATE_ADMIN_TOKEN "$BIN" install-triggers --config "$1" >/dev/null
}
triggers() { # enable|disable
  psql -d "$DB" -c "ALTER TABLE tc_users ${1^^} TRIGGER USER" -c "ALTER TABLE tc_docs ${1^^} TRIGGER USER"
}
start_gateways() { # config
  local i log
  for i in $(seq "$GATEWAYS"); do
    log="$work/gw-$i-$(date +%s%N).log"
    "${cpu1[@]}" env -u BLOOMGATE_ADMIN_TOKEN RUST_LOG=info "$BIN" serve --config "$1" >"$log" 2>&1 &
    pids+=($!)
    for _ in $(seq 150); do
      grep -q 'ready' "$log" && break
      kill -0 "${pids[-1]}" 2>/dev/null || { cat "$log" >&2; exit 1; }
      sleep 0.1
    done
  done
  if [ -n "$PIN" ]; then
    local p
    for p in $(psql -Atd postgres -c "SELECT pid FROM pg_stat_activity WHERE datname = '$DB'
                 AND (backend_type = 'walsender' OR application_name IN ('bloomgate-wal-feed', 'bloomgate-queue-feed')
                      OR query ILIKE 'LISTEN%')"); do
      taskset -pc 1 "$p" >/dev/null
    done
  fi
}
arm() { # none|triggers|queue|wal|poll
  stop_gateways
  case $1 in
    none) triggers disable ;;
    triggers) install "$notify_cfg"; triggers enable; start_gateways "$notify_cfg" ;;
    queue) install "$queue_cfg"; triggers enable; start_gateways "$queue_cfg" ;;
    wal) triggers disable; start_gateways "$wal_cfg" ;;
    poll) triggers disable; start_gateways "$poll_cfg" ;;
  esac
}
run() { # script -> TPS
  "${cpu0[@]}" pgbench -n -f "bench/pgbench/$1.sql" -c "$CLIENTS" -j "$THREADS" -T "$DURATION" "$DB" 2>/dev/null \
    | awk '/^tps = /{print $3}'
}
median() { sort -g | awk '{a[NR]=$1} END{print a[int((NR+1)/2)]}'; }

arms=(none triggers queue wal poll)
echo "workload round arm tps" >"$work/raw.txt"
for w in insert update; do
  for r in $(seq "$ROUNDS"); do
    for k in 0 1 2 3 4; do
      a=${arms[$(((r + k) % 5))]}
      arm "$a"
      echo "$w $r $a $(run "$w")" | tee -a "$work/raw.txt"
    done
  done
done
stop_gateways

echo
echo "pgbench -c $CLIENTS -j $THREADS -T $DURATION, $ROUNDS rounds, $GATEWAYS gateways per capturing arm, $(nproc) cores${PIN:+ (pinned: writers on CPU 0, capture on CPU 1)}, $(psql -d "$DB" -Atc 'SHOW server_version')"
printf '%-8s %10s %14s %10s %15s %10s %10s %15s %10s %15s %10s %15s\n' workload "TPS none" "TPS triggers" "cost" "range" \
  "TPS queue" "cost" "range" "TPS wal" "cost / range" "TPS poll" "cost / range"
for w in insert update; do
  tps() { awk -v w="$w" -v a="$1" '$1==w && $3==a {print $4}' "$work/raw.txt" | median; }
  costs() { # arm -> one cost per round, in %
    awk -v w="$w" -v a="$1" '$1==w && $3=="none" {n[$2]=$4} $1==w && $3==a {x[$2]=$4}
      END {for (r in x) print (1 - x[r] / n[r]) * 100}' "$work/raw.txt"
  }
  range() { costs "$1" | sort -g | awk 'NR==1{lo=$1} {hi=$1} END{printf "%.1f..%.1f%%", lo, hi}'; }
  printf '%-8s %10.0f %14.0f %9.1f%% %15s %10.0f %9.1f%% %15s %10.0f %9.1f%% %15s %10.0f %9.1f%% %s\n' "$w" "$(tps none)" "$(tps triggers)" \
    "$(costs triggers | median)" "$(range triggers)" "$(tps queue)" "$(costs queue | median)" "$(range queue)" \
    "$(tps wal)" "$(costs wal | median)" "$(range wal)" \
    "$(tps poll)" "$(costs poll | median)" "$(range poll)"
done
echo
echo "raw (workload round arm tps):"
tail -n +2 "$work/raw.txt"
