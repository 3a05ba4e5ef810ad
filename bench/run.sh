#!/usr/bin/env bash
# bench/run.sh: the gateway load test of issue 7, in one command.
#
# Brings up PostgreSQL (scripts/pg.sh), seeds 1,000,000 users into the
# database `bloomgate_bench` (and 10,000,000 into `bloomgate_bench10m` for the
# preload measurement), builds the release binaries, installs wrk and nginx
# if missing, then runs every workload against every system on 127.0.0.1:
#
#   bloomgate    the gateway with the shipped config/bloomgate.toml
#   bare         examples/bare_axum.rs: fixed body, the HTTP stack's ceiling
#   nginx        nginx proxy_cache in front of bloomgate with filter and
#                cache disabled
#   varnish      Varnish (bench/varnish.vcl) in front of the same
#   unprotected  that filter/cache-disabled bloomgate hit directly
#
# Workloads (bench/keys.lua): hit (pure cache hits over 10,000 keys, warmed
# and checked), attack, hot, cold, mixed.
#
# and writes docs/perf-log/results/ (raw numbers), the run as an entry of the perf
# log, docs/perf-log/YYYY-MM-DD-gateway-load-test.md (its `## Gateway load
# test` section, replaced if that day's entry has one), and
# docs/perf-log/results/loadtest.svg. List a new entry in docs/perf-log/README.md
# and bring BENCHMARKS.md up to date by hand.
#
# Environment (defaults in brackets):
#   DURATION [10s]      measured time per cell; DURATION=30s for a longer run
#   WARMUP [3s]         unmeasured load before each cell
#   CONNECTIONS [64]    wrk connections
#   THREADS [2]         wrk threads
#   SEED [42]           RNG seed of the key generators
#   SYSTEMS, WORKLOADS  subsets, e.g. SYSTEMS="bloomgate bare" WORKLOADS=hot
#                       [bare bloomgate unprotected nginx varnish]
#                       [hit attack hot cold mixed]
#   HIT_KEYS [10000]    keys of the hit workload (all cached by every system)
#   HIT_WARM_TRIES [6]  hit warm-up passes at most: each walks every key and
#                       is repeated until one causes no cache miss
#   CHECK_FATAL [1]     1: exit 3 at the end (after writing the results) if a
#                       hit cell was not pure hits; 0: only flag it
#   VARNISH_MEM [256m]  Varnish's storage (-s malloc,...)
#   FLUSH_WAIT [11]     seconds to wait for Postgres to publish the
#                       backends' table statistics (PG flushes an idle
#                       backend's pending counters within 10 s)
#   BENCH_10M [1]       0 skips the 10M-key preload (seeding it the first
#                       time takes a few minutes)
#   PRELOAD_REPS [3]    gateway start-ups / COPY runs per preload size
#   NO_REPORT [0]       1: measure only, leave the perf log and the chart alone
#   MERGE [0]           1: keep docs/perf-log/results rows of systems not in SYSTEMS
#   SKIP_PRELOAD [0]    1: keep docs/perf-log/results/preload.tsv, skip the preload runs
#   KEEP_WORK [0]       1: keep the scratch directory (logs, key logs)
#   QUIET_MAX [20]      seconds to wait, before each cell, for the rest of the
#   QUIET_CORES [0.3]   machine to use under QUIET_CORES cores (2-core box)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

DURATION=${DURATION:-10s}
WARMUP=${WARMUP:-3s}
CONNECTIONS=${CONNECTIONS:-64}
THREADS=${THREADS:-2}
SEED=${SEED:-42}
SYSTEMS=${SYSTEMS:-"bare bloomgate unprotected nginx varnish"}
# hit first: a cache that the other workloads have filled admits new keys
# only as they prove popular (moka's TinyLFU), which the warm-up then waits
# for; HIT_WARM_TRIES bounds that wait.
WORKLOADS=${WORKLOADS:-"hit attack hot cold mixed"}
HIT_KEYS=${HIT_KEYS:-10000}
HIT_WARM_TRIES=${HIT_WARM_TRIES:-6}
CHECK_FATAL=${CHECK_FATAL:-1}
VARNISH_MEM=${VARNISH_MEM:-256m}
export HIT_KEYS
FLUSH_WAIT=${FLUSH_WAIT:-11}
BENCH_10M=${BENCH_10M:-1}
SKIP_PRELOAD=${SKIP_PRELOAD:-0}
PRELOAD_REPS=${PRELOAD_REPS:-3}
NO_REPORT=${NO_REPORT:-0}
KEEP_WORK=${KEEP_WORK:-0}
QUIET_MAX=${QUIET_MAX:-20}
QUIET_CORES=${QUIET_CORES:-0.3}
USERS=1000000
CONFIG=config/bloomgate.toml

PORT_GW=18080 PORT_BARE=18081 PORT_RAW=18082 PORT_NGINX=18083 PORT_PRELOAD=18084
# 18085 is bench/ab.sh's.
PORT_VARNISH=18086 PORT_ADMIN_GW=18087 PORT_ADMIN_RAW=18088
# The gateways' admin API (for their own query and miss counters) takes a
# bearer token: a fresh one per run, never printed.
ADMIN_TOKEN=$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')
RESULTS=docs/perf-log/results
WORK=$(mktemp -d /tmp/bloomgate-bench.XXXXXX)
BIN=target/release/bloomgate
BARE=target/release/examples/bare_axum
TCK=$(getconf CLK_TCK)

log() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# --- processes we start, stopped on exit -----------------------------------
PIDS=()
stop_pid() {
  local pid=$1 i
  kill -0 "$pid" 2>/dev/null || return 0
  kill -TERM "$pid" 2>/dev/null || true
  for i in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -KILL "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
}
cleanup() {
  local pid
  for pid in "${PIDS[@]}"; do stop_pid "$pid"; done
  rm -rf /dev/shm/bloomgate-bench-nginx-cache.$$ "$WORK/varnish"
  if [ "$KEEP_WORK" = 1 ]; then log "scratch kept in $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# --- prerequisites -----------------------------------------------------------
apt_install() {
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo=sudo
  log "installing $*"
  $sudo apt-get update -qq >&2 || true
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$@" >&2
}
command -v wrk >/dev/null || apt_install wrk
command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || apt_install nginx
NGINX=$(command -v nginx || echo /usr/sbin/nginx)
case " $SYSTEMS " in
  *" varnish "*)
    command -v varnishd >/dev/null || [ -x /usr/sbin/varnishd ] || apt_install varnish ;;
esac
VARNISHD=$(command -v varnishd || echo /usr/sbin/varnishd)
command -v python3 >/dev/null || apt_install python3

# The ports this run will listen on (the systems asked for, the preload).
ports=""
for sys in $SYSTEMS; do
  case $sys in
    bare) ports="$ports $PORT_BARE" ;;
    bloomgate) ports="$ports $PORT_GW $PORT_ADMIN_GW" ;;
    unprotected) ports="$ports $PORT_RAW $PORT_ADMIN_RAW" ;;
    nginx) ports="$ports $PORT_NGINX $PORT_RAW $PORT_ADMIN_RAW" ;;
    varnish) ports="$ports $PORT_VARNISH $PORT_RAW $PORT_ADMIN_RAW" ;;
  esac
done
[ "$SKIP_PRELOAD" = 1 ] || ports="$ports $PORT_PRELOAD"
for port in $ports; do
  if ss -Hltn "sport = :$port" 2>/dev/null | grep -q .; then
    log "port $port is in use; bench/run.sh needs it (127.0.0.1:18080-18084 and 18086-18088 in all)"; exit 1
  fi
done

# shellcheck source=../scripts/pg.sh
. scripts/pg.sh
ensure_postgres
psql_db() { local db=$1; shift; psql "$PG_BASE_URL/$db" -X -v ON_ERROR_STOP=1 -Atq "$@"; }
ensure_db() {
  if ! psql_db postgres -c "SELECT 1 FROM pg_database WHERE datname = '$1'" | grep -q 1; then
    psql_db postgres -c "CREATE DATABASE \"$1\""
  fi
}

log "building release binaries"
cargo build --locked --release --bin bloomgate --example bare_axum >&2

# Seeding is idempotent; triggers are off for the seeding session only (they
# would queue a NOTIFY per inserted row for nobody).
seed() {
  local db=$1 users=$2 articles=$3
  ensure_db "$db"
  local have
  have=$(psql_db "$db" -c "SELECT count(*) FROM users" 2>/dev/null || echo 0)
  if [ "$have" -ge "$users" ] 2>/dev/null; then
    log "$db: $have users already seeded"
    return 0
  fi
  log "seeding $db with $users users (once)"
  DATABASE_URL="$PG_BASE_URL/$db?options=-c%20session_replication_role%3Dreplica" \
    "$BIN" seed --config "$CONFIG" --users "$users" --articles "$articles" >&2
  psql_db "$db" -c "VACUUM ANALYZE users" >&2
}
BENCH_DB=bloomgate_bench
seed "$BENCH_DB" "$USERS" 10000
BENCH_URL="$PG_BASE_URL/$BENCH_DB"
if [ "$BENCH_10M" = 1 ]; then seed bloomgate_bench10m 10000000 0; fi

# --- measuring helpers -------------------------------------------------------
wait_ready() { # URL PID NAME
  local i
  for i in $(seq 1 1200); do
    if ! kill -0 "$2" 2>/dev/null; then
      log "$3 exited during start-up:"; tail -n 20 "$WORK/$3.log" >&2; return 1
    fi
    curl -sf -o /dev/null "$1" && return 0
    sleep 0.05
  done
  log "$3 not ready after 60 s"; return 1
}
start_gateway() { # NAME PORT DB [VAR=VALUE...]
  local name=$1 port=$2 db=$3; shift 3
  env "$@" DATABASE_URL="$PG_BASE_URL/$db" BLOOMGATE_SERVER__LISTEN="127.0.0.1:$port" \
    BLOOMGATE_LOG__FORMAT=json RUST_LOG=info \
    "$BIN" serve --config "$CONFIG" >"$WORK/$name.log" 2>&1 &
  local pid=$!
  PIDS+=("$pid")
  wait_ready "http://127.0.0.1:$port/readyz" "$pid" "$name" || exit 1
  STARTED_PID=$pid
}
# The gateway's admin API on PORT, for its own counters.
admin_env() { echo "BLOOMGATE_ADMIN_TOKEN=$ADMIN_TOKEN" "BLOOMGATE_ADMIN__LISTEN=127.0.0.1:$1"; }
start_bare() {
  "$BARE" --listen "127.0.0.1:$PORT_BARE" >"$WORK/bare.log" 2>&1 &
  local pid=$!
  PIDS+=("$pid")
  wait_ready "http://127.0.0.1:$PORT_BARE/readyz" "$pid" bare || exit 1
  STARTED_PID=$pid
}
start_nginx() { # UPSTREAM_PORT
  local dir=$WORK/nginx cache=/dev/shm/bloomgate-bench-nginx-cache.$$
  [ -d /dev/shm ] || cache=$WORK/nginx-cache
  rm -rf "$dir" "$cache"; mkdir -p "$dir" "$cache"
  sed -e "s|@DIR@|$dir|g" -e "s|@CACHE@|$cache|g" -e "s|@LISTEN@|127.0.0.1:$PORT_NGINX|g" \
    -e "s|@UPSTREAM@|127.0.0.1:$1|g" bench/nginx.conf.template >"$dir/nginx.conf"
  "$NGINX" -t -q -p "$dir" -e "$dir/error.log" -c "$dir/nginx.conf" >&2
  "$NGINX" -p "$dir" -e "$dir/error.log" -c "$dir/nginx.conf" -g 'daemon off;' >"$WORK/nginx.log" 2>&1 &
  local pid=$!
  PIDS+=("$pid")
  local i
  for i in $(seq 1 100); do
    [ -n "$(pgrep -P "$pid" || true)" ] && curl -s -o /dev/null "http://127.0.0.1:$PORT_NGINX/readyz" && break
    sleep 0.05
  done
  STARTED_PID=$pid
}
# Varnish in the foreground (-F, so that its pid is the manager's; the cache
# process is its child), as root without a privilege-separation jail (-j
# none, like nginx's `user root`: the scratch directory is root's), with no
# CLI port (-T none; varnishstat reads the shared memory in the -n directory).
# The parameters a fair comparison relies on are in bench/README.md.
start_varnish() { # UPSTREAM_PORT
  local dir=$WORK/varnish
  rm -rf "$dir"; mkdir -p "$dir"
  sed -e "s|@UPSTREAM_HOST@|127.0.0.1|g" -e "s|@UPSTREAM_PORT@|$1|g" bench/varnish.vcl >"$dir/bench.vcl"
  "$VARNISHD" -F -j none -n "$dir/n" -T none -a "127.0.0.1:$PORT_VARNISH" -f "$dir/bench.vcl" \
    -s "malloc,$VARNISH_MEM" -p default_grace=0 -p shortlived=0 -p thread_pools=2 -p thread_pool_min=100 \
    >"$WORK/varnish.log" 2>&1 &
  local pid=$!
  PIDS+=("$pid")
  VARNISH_DIR=$dir/n
  wait_ready "http://127.0.0.1:$PORT_VARNISH/readyz" "$pid" varnish || exit 1
  STARTED_PID=$pid
}
# A process and its children (nginx workers, Varnish's cache process).
with_children() { local p; for p in "$@"; do echo "$p"; pgrep -P "$p" || true; done; }
cpu_ticks() { # PID... -> utime + stime, in ticks
  local p t=0 s
  for p in $(with_children "$@"); do
    s=$(cut -d')' -f2 "/proc/$p/stat" 2>/dev/null) || continue
    t=$((t + $(echo "$s" | awk '{print $12 + $13}')))
  done
  echo "$t"
}
reset_peak_rss() { local p; for p in $(with_children "$@"); do echo 5 >"/proc/$p/clear_refs" 2>/dev/null || true; done; }
peak_rss_kb() { # sum of VmHWM over the processes
  local p t=0 v
  for p in $(with_children "$@"); do
    v=$(awk '/^VmHWM/ {print $2}' "/proc/$p/status" 2>/dev/null || echo 0)
    t=$((t + ${v:-0}))
  done
  echo "$t"
}
# CPU of the Postgres backends serving the gateways' pools (application_name
# bloomgate), per backend so that one opening or closing mid-window does not
# skew the sum: PG_CPU0 is a snapshot "pid ticks" per line.
pg_gateway_pids() {
  psql_db "$BENCH_DB" -c "SELECT pid FROM pg_stat_activity WHERE datname = '$BENCH_DB' AND application_name = 'bloomgate'" 2>/dev/null || true
}
pg_cpu_snapshot() { local p; for p in $(pg_gateway_pids); do echo "$p $(cpu_ticks "$p")"; done; }
pg_cpu_delta() { # SNAPSHOT -> ticks used since, by the backends alive now
  local snap=$1 p t=0 now was
  for p in $(pg_gateway_pids); do
    now=$(cpu_ticks "$p")
    was=$(echo "$snap" | awk -v p="$p" '$1 == p {print $2}')
    t=$((t + now - ${was:-0}))
  done
  echo "$t"
}
# Row lookups on users: the gateway's only query against that table.
db_queries() {
  psql_db "$BENCH_DB" -c "SELECT pg_stat_force_next_flush()" >/dev/null 2>&1 || true
  psql_db "$BENCH_DB" -c "SELECT coalesce(idx_scan, 0) + coalesce(seq_scan, 0) FROM pg_stat_user_tables WHERE relname = 'users'"
}
# Wait (up to QUIET_MAX seconds) until the rest of the machine is idle: the
# box has 2 cores, and anything else running (a compiler, a test suite) would
# be measured as the systems' slowness. Idle means under QUIET_CORES busy.
wait_quiet() {
  local waited=0 h0 h1 busy
  while :; do
    h0=$(host_busy_ticks); sleep 1; h1=$(host_busy_ticks)
    busy=$(echo "$h0 $h1 $TCK" | awk '{printf "%.2f", ($2 - $1) / $3}')
    if awk -v b="$busy" -v q="$QUIET_CORES" 'BEGIN {exit !(b <= q)}'; then return 0; fi
    waited=$((waited + 1))
    if [ "$waited" -ge "$QUIET_MAX" ]; then
      log "  warning: machine still busy ($busy cores) after ${QUIET_MAX}s; measuring anyway"
      return 0
    fi
    [ $((waited % 10)) -eq 1 ] && log "  waiting for the machine to go idle ($busy cores busy)"
  done
}
# The gateway's own counters from its admin API: "db_queries misses", misses
# being lookups of the users resource the cache did not answer (miss +
# collapsed outcomes).
gateway_counters() { # ADMIN_PORT
  curl -sf -H "Authorization: Bearer $ADMIN_TOKEN" "http://127.0.0.1:$1/admin/stats" | python3 -c '
import json, sys
d = json.load(sys.stdin)
r = next(r for r in d["resources"] if r["name"] == "users")["requests"]
print(d["db_queries"], r.get("miss", 0) + r.get("collapsed", 0))' || echo "- -"
}
# Requests the system itself reports as not answered from its cache:
# bloomgate: its miss and collapsed lookups (admin API); nginx: lines of its
# non-HIT log (nginx.conf.template); Varnish: MAIN.cache_miss + MAIN.s_pass
# (varnishstat). "-" for the systems without a cache.
cache_misses() { # SYSTEM
  case $1 in
    bloomgate) gateway_counters "$PORT_ADMIN_GW" | awk '{print $2}' ;;
    nginx) if [ -f "$WORK/nginx/misses.log" ]; then wc -l <"$WORK/nginx/misses.log"; else echo 0; fi ;;
    varnish)
      varnishstat -n "$VARNISH_DIR" -1 -f MAIN.cache_miss -f MAIN.s_pass 2>/dev/null |
        awk '{s += $2; n++} END {if (n) print s; else print "-"}' ;;
    *) echo - ;;
  esac
}
# Queries counted by the gateway that serves the system (its db_queries), or
# "-" for bare.
gateway_queries() { # SYSTEM
  case $1 in
    bloomgate) gateway_counters "$PORT_ADMIN_GW" | awk '{print $1}' ;;
    unprotected | nginx | varnish) gateway_counters "$PORT_ADMIN_RAW" | awk '{print $1}' ;;
    *) echo - ;;
  esac
}
delta() { if [ "$1" = - ] || [ "$2" = - ]; then echo -; else echo $(($2 - $1)); fi; }
# The hit workload's warm-up: passes over every key in order (keys.lua
# hitwarm) until one pass covered every key and the system reported no miss
# during it, at most HIT_WARM_TRIES passes of WARMUP each.
warm_hit() { # SYSTEM URL TAG
  local sys=$1 url=$2 try m0 m1 out sent need=$((HIT_KEYS + CONNECTIONS))
  for try in $(seq 1 "$HIT_WARM_TRIES"); do
    m0=$(cache_misses "$sys")
    out=$(wrk -t"$THREADS" -c"$CONNECTIONS" -d"$WARMUP" -s bench/keys.lua "$url" -- hitwarm 0 2>&1 |
      tee "$WORK/$3.warm$try" | grep '^RESULT' || true)
    m1=$(cache_misses "$sys")
    sent=$(kv "$out" min_sent)
    if [ "$m0" = - ]; then return 0; fi # no cache to warm (bare, unprotected): one pass warms the connections
    if [ "${sent:-0}" -lt "$need" ]; then
      log "  hit warm-up pass $try: a wrk thread sent ${sent:-0} of the $need requests that cover every key; again"
      continue
    fi
    if [ "$(delta "$m0" "$m1")" = 0 ]; then
      log "  hit warm-up: pass $try covered all $HIT_KEYS keys with no miss"
      return 0
    fi
    log "  hit warm-up pass $try: $(delta "$m0" "$m1") misses; again"
  done
  log "  warning: the hit warm-up did not reach a pass without misses in $HIT_WARM_TRIES passes"
}
host_busy_ticks() { awk '/^cpu / {print $2 + $3 + $4 + $7 + $8 + $9}' /proc/stat; }
kv() { echo "$1" | tr ' ' '\n' | awk -F= -v k="$2" '$1 == k {print $2}'; }
secs() { echo "$1" | awk '{ if ($0 ~ /ms$/) print $0 / 1000; else if ($0 ~ /m$/) print $0 * 60; else print $0 + 0 }'; }

CELLS=$RESULTS/cells.tsv
mkdir -p "$RESULTS"
OLD_CELLS=""
if [ "${MERGE:-0}" = 1 ] && [ -s "$CELLS" ]; then OLD_CELLS=$(tail -n +2 "$CELLS"); fi
# Columns after host_busy_s came later: MERGE pads older rows with "-".
COLUMNS='system workload requests duration_s rps p50_us p99_us p999_us max_us socket_errors bad_status db_queries distinct_keys server_cpu_s peak_rss_kb pg_cpu_s wrk_cpu_s host_busy_s cache_misses gw_db_queries check'
echo "$COLUMNS" | tr ' ' '\t' >"$CELLS"
# MERGE=1: keep the previous run's rows for the systems not measured now.
if [ -n "$OLD_CELLS" ]; then
  echo "$OLD_CELLS" | awk -F'\t' -v OFS='\t' -v keep=" $SYSTEMS " -v n="$(echo "$COLUMNS" | wc -w)" \
    'index(keep, " " $1 " ") == 0 { for (i = NF + 1; i <= n; i++) $i = "-"; print }' >>"$CELLS"
fi
CHECK_FAILED=0

run_cell() { # SYSTEM WORKLOAD URL USES_DB PID...
  local sys=$1 wl=$2 url=$3 uses_db=$4; shift 4
  local pids=("$@")
  wait_quiet
  if [ "$wl" = hit ]; then
    log "cell $sys/$wl: warm-up, passes of $WARMUP over the $HIT_KEYS keys"
    warm_hit "$sys" "$url" "$sys.$wl"
  else
    log "cell $sys/$wl: warm-up $WARMUP"
    wrk -t"$THREADS" -c"$CONNECTIONS" -d"$WARMUP" -s bench/keys.lua "$url" -- "$wl" $((SEED + 1000)) >"$WORK/$sys.$wl.warm" 2>&1
  fi
  if [ "$uses_db" = 1 ]; then sleep "$FLUSH_WAIT"; fi
  local q0 q1 c0 c1 pg0 pg1 h0 h1 out m0 m1 g0 g1
  q0=$(db_queries); m0=$(cache_misses "$sys"); g0=$(gateway_queries "$sys")
  pg0=$(pg_cpu_snapshot); c0=$(cpu_ticks "${pids[@]}")
  reset_peak_rss "${pids[@]}"
  rm -f "$WORK/keys."*
  h0=$(host_busy_ticks)
  log "cell $sys/$wl: measuring $DURATION"
  local TIMEFORMAT='%U %S'
  { time wrk -t"$THREADS" -c"$CONNECTIONS" -d"$DURATION" --latency -s bench/keys.lua "$url" -- "$wl" "$SEED" "$WORK/keys" \
      >"$WORK/$sys.$wl.wrk" 2>&1; } 2>"$WORK/$sys.$wl.time"
  h1=$(host_busy_ticks); c1=$(cpu_ticks "${pids[@]}"); pg1=$(pg_cpu_delta "$pg0")
  m1=$(cache_misses "$sys"); g1=$(gateway_queries "$sys")
  local rss; rss=$(peak_rss_kb "${pids[@]}")
  if [ "$uses_db" = 1 ]; then sleep "$FLUSH_WAIT"; fi
  q1=$(db_queries)
  # The hit cell must be pure hits: no query in Postgres, none counted by the
  # gateway, no miss reported by the cache. (unprotected and bare have no
  # cache: a query per request, a constant body; their cells are baselines.)
  local check=- misses gwq problems=""
  misses=$(delta "$m0" "$m1"); gwq=$(delta "$g0" "$g1")
  if [ "$wl" = hit ]; then
    if [ "$sys" = unprotected ] || [ "$sys" = bare ]; then
      check="n/a: no cache"
    else
      [ $((q1 - q0)) -eq 0 ] || problems="$problems $((q1 - q0)) Postgres scans;"
      [ "$gwq" = - ] || [ "$gwq" -eq 0 ] || problems="$problems $gwq gateway queries;"
      [ "$misses" = - ] || [ "$misses" -eq 0 ] || problems="$problems $misses cache misses;"
      if [ -z "$problems" ]; then check="pure hits"; else
        check="NOT pure hits:${problems%;}"
        CHECK_FAILED=1
        log "  CHECK FAILED: $sys/$wl was not pure hits:${problems%;}"
      fi
    fi
  fi
  out=$(grep '^RESULT' "$WORK/$sys.$wl.wrk" || { cat "$WORK/$sys.$wl.wrk" >&2; exit 1; })
  local distinct; distinct=$(cat "$WORK/keys."* | sort -u | wc -l)
  local sockerr=$(( $(kv "$out" connect) + $(kv "$out" read) + $(kv "$out" write) + $(kv "$out" timeout) ))
  local wrkcpu; wrkcpu=$(awk '{print $1 + $2}' "$WORK/$sys.$wl.time")
  printf '%s\t%s\t%s\t%.2f\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%.2f\t%s\t%.2f\t%.2f\t%.2f\t%s\t%s\t%s\n' \
    "$sys" "$wl" "$(kv "$out" requests)" "$(echo "$(kv "$out" duration_us)" | awk '{print $1/1e6}')" \
    "$(kv "$out" rps)" "$(kv "$out" p50_us)" "$(kv "$out" p99_us)" "$(kv "$out" p999_us)" "$(kv "$out" max_us)" \
    "$sockerr" "$(kv "$out" bad)" "$((q1 - q0))" "$distinct" \
    "$(echo "$c0 $c1 $TCK" | awk '{print ($2 - $1) / $3}')" "$rss" \
    "$(echo "$pg1 $TCK" | awk '{print $1 / $2}')" "$wrkcpu" \
    "$(echo "$h0 $h1 $TCK" | awk '{print ($2 - $1) / $3}')" "$misses" "$gwq" "$check" >>"$CELLS"
  log "  $(tail -n 1 "$CELLS" | cut -f3,5-8,10-13 | tr '\t' ' ') (requests rps p50 p99 p99.9 sockerr bad dbq distinct)"
  log "  CPU µs/req $(tail -n 1 "$CELLS" | awk -F'\t' '{printf "%.1f", 1e6 * $14 / ($3 > 0 ? $3 : 1)}'), cache misses $misses, gateway queries $gwq, check: $check"
}

# --- the load test -----------------------------------------------------------
BEGAN=$(date +%s)
LOAD_BEFORE=$(cut -d' ' -f1-3 /proc/loadavg)
for sys in $SYSTEMS; do
  case $sys in
    bare)
      start_bare; pids=("$STARTED_PID"); url=http://127.0.0.1:$PORT_BARE; uses_db=0 ;;
    bloomgate)
      # shellcheck disable=SC2046 # admin_env's words are VAR=VALUE pairs
      start_gateway bloomgate "$PORT_GW" "$BENCH_DB" $(admin_env "$PORT_ADMIN_GW"); pids=("$STARTED_PID")
      url=http://127.0.0.1:$PORT_GW; uses_db=1 ;;
    unprotected)
      # shellcheck disable=SC2046
      start_gateway unprotected "$PORT_RAW" "$BENCH_DB" BLOOMGATE_FILTER__ENABLED=false BLOOMGATE_CACHE__ENABLED=false \
        $(admin_env "$PORT_ADMIN_RAW")
      pids=("$STARTED_PID"); url=http://127.0.0.1:$PORT_RAW; uses_db=1 ;;
    nginx | varnish)
      # shellcheck disable=SC2046
      start_gateway "$sys-backend" "$PORT_RAW" "$BENCH_DB" BLOOMGATE_FILTER__ENABLED=false BLOOMGATE_CACHE__ENABLED=false \
        $(admin_env "$PORT_ADMIN_RAW")
      backend=$STARTED_PID
      if [ "$sys" = nginx ]; then
        start_nginx "$PORT_RAW"; url=http://127.0.0.1:$PORT_NGINX
      else
        start_varnish "$PORT_RAW"; url=http://127.0.0.1:$PORT_VARNISH
      fi
      pids=("$STARTED_PID" "$backend"); uses_db=1 ;;
    *) log "unknown system $sys"; exit 2 ;;
  esac
  # Check the key paths answer as expected before measuring.
  for probe in 500000 1500000000; do
    code=$(curl -s -o /dev/null -w '%{http_code}' "$url/users/$probe")
    log "$sys: GET /users/$probe -> $code $(curl -s -D - -o /dev/null "$url/users/$probe" | grep -iE '^(x-)?cache-status' | tr -d '\r' | tr '\n' ' ' || true)"
  done
  for wl in $WORKLOADS; do run_cell "$sys" "$wl" "$url" "$uses_db" "${pids[@]}"; done
  for p in "${pids[@]}"; do stop_pid "$p"; done
done
LOAD_SECS=$(( $(date +%s) - BEGAN ))

# --- preload: filter build vs the raw COPY of the keys -----------------------
PRELOAD=$RESULTS/preload.tsv
if [ "${SKIP_PRELOAD:-0}" = 1 ] && [ -s "$RESULTS/preload.tsv" ]; then
  log "SKIP_PRELOAD=1: keeping $RESULTS/preload.tsv"
  PRELOAD=$WORK/preload.tsv.unused
fi
printf 'keys_db\tmode\trep\tkeys\tfilter_kind\tbuild_ms\tready_ms\tpeak_rss_kb\tcopy_ms\n' >"$PRELOAD"
now_ms() { date +%s%3N; }
copy_ms() { # DB
  local t0 t1
  t0=$(now_ms)
  psql_db "$1" -c "COPY (SELECT id FROM users) TO STDOUT" >/dev/null
  t1=$(now_ms); echo $((t1 - t0))
}
preload() { # DB MODE REP
  local db=$1 mode=$2 rep=$3 t0 t1 pid line extra=()
  case $mode in
    off) extra=(BLOOMGATE_FILTER__ENABLED=false) ;;
    auto) ;;
    *) extra=(BLOOMGATE_FILTER__MODE="$mode") ;;
  esac
  t0=$(now_ms)
  start_gateway "preload-$db-$mode" "$PORT_PRELOAD" "$db" "${extra[@]}" BLOOMGATE_CACHE__ENABLED=false
  t1=$(now_ms); pid=$STARTED_PID
  local rss; rss=$(peak_rss_kb "$pid")
  line=$(grep '"filter built"' "$WORK/preload-$db-$mode.log" | grep '"resource":"users"' | tail -n 1 || true)
  local keys ms kind
  keys=$(echo "$line" | grep -o '"keys":[0-9]*' | cut -d: -f2 || true)
  ms=$(echo "$line" | grep -o '"duration_ms":[0-9]*' | cut -d: -f2 || true)
  kind=$(echo "$line" | grep -o '"kind":"[a-z]*"' | cut -d'"' -f4 || true)
  stop_pid "$pid"
  local cms; cms=$(copy_ms "$db")
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$db" "$mode" "$rep" "${keys:-0}" "${kind:--}" "${ms:-0}" \
    "$((t1 - t0))" "$rss" "$cms" >>"$PRELOAD"
  log "preload $db/$mode #$rep: $(tail -n 1 "$PRELOAD" | cut -f4- | tr '\t' ' ') (keys kind build_ms ready_ms rss_kb copy_ms)"
}
preload_dbs=("$BENCH_DB")
if [ "$BENCH_10M" = 1 ]; then preload_dbs+=(bloomgate_bench10m); fi
[ "$PRELOAD" = "$RESULTS/preload.tsv" ] || preload_dbs=()
if [ ${#preload_dbs[@]} -gt 0 ]; then
  # Where and when these were measured: SKIP_PRELOAD runs keep them, and the
  # report says they come from an earlier run.
  cat >"$RESULTS/preload-env.txt" <<EOF
run=$BEGAN
date=$(date -u +%Y-%m-%dT%H:%MZ)
cpu=$(lscpu | awk -F: '/Model name/ {gsub(/^ +/, "", $2); print $2; exit}')
git=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD -- src Cargo.toml config 2>/dev/null || echo +dirty)
EOF
fi
for db in ${preload_dbs[@]+"${preload_dbs[@]}"}; do
  copy_ms "$db" >/dev/null # warm the cache: both sides read the same pages
  preload "$db" off 1       # the gateway's memory without any filter
  for rep in $(seq 1 "$PRELOAD_REPS"); do
    for mode in auto bloom; do preload "$db" "$mode" "$rep"; done
  done
done

# --- report ------------------------------------------------------------------
cat >"$RESULTS/env.txt" <<EOF
run=$BEGAN
date=$(date -u +%Y-%m-%dT%H:%MZ)
command=$(for v in DURATION WARMUP SYSTEMS WORKLOADS HIT_KEYS QUIET_MAX BENCH_10M SKIP_PRELOAD; do
  d=$(sed -n "s/^$v=\${$v:-\"*\([^\"}]*\)\"*}$/\1/p" "$ROOT/bench/run.sh" | head -n 1)
  case ${!v-} in "$d") ;; *" "*) printf '%s="%s" ' "$v" "${!v-}" ;; *) printf '%s=%s ' "$v" "${!v-}" ;; esac
done)bench/run.sh
duration=$DURATION
warmup=$WARMUP
connections=$CONNECTIONS
threads=$THREADS
seed=$SEED
nproc=$(nproc)
cpu=$(lscpu | awk -F: '/Model name/ {gsub(/^ +/, "", $2); print $2; exit}')
memory_gb=$(awk '/MemTotal/ {printf "%.0f", $2 / 1048576}' /proc/meminfo)
kernel=$(uname -r)
postgres=$(psql_db postgres -c "SHOW server_version" | awk '{print $1}')
wrk=$(wrk -v 2>&1 | head -n 1 | awk '{print $2}')
nginx=$("$NGINX" -v 2>&1 | awk -F/ '{print $2}')
varnish=$("$VARNISHD" -V 2>&1 | head -n 1 | sed -n 's/.*varnish-\([0-9.]*\).*/\1/p')
hit_keys=$HIT_KEYS
varnish_mem=$VARNISH_MEM
git=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD -- src Cargo.toml config 2>/dev/null || echo +dirty)
load_test_seconds=$LOAD_SECS
loadavg_before=$LOAD_BEFORE
loadavg_after=$(cut -d' ' -f1-3 /proc/loadavg)
EOF
REPORT=docs/perf-log/$(date -u +%Y-%m-%d)-gateway-load-test.md
if [ "$NO_REPORT" != 1 ]; then
  python3 bench/report.py --results "$RESULTS" --benchmarks "$REPORT" --svg "$RESULTS/loadtest.svg"
fi
log "done: $RESULTS/cells.tsv, $RESULTS/preload.tsv$( [ "$NO_REPORT" = 1 ] || echo ", $REPORT, docs/perf-log/results/loadtest.svg")"
if [ "$CHECK_FAILED" = 1 ]; then
  log "a hit cell was not pure hits (see the check column of $RESULTS/cells.tsv)"
  if [ "$CHECK_FATAL" = 1 ]; then exit 3; fi
fi
