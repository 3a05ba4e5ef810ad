#!/usr/bin/env bash
# bench/ab.sh: A/B of two gateway binaries on one load-test cell, alternating
# them round by round so that drift in a noisy machine hits both alike.
#
#   bench/ab.sh BEFORE_BIN AFTER_BIN
#
# e.g. build the base commit, copy target/release/bloomgate to
# /tmp/bloomgate-before, build the change, copy it to /tmp/bloomgate-after.
# A binary named `bare_axum` (target/release/examples/bare_axum) is started
# as the bare axum ceiling instead, so the gateway can be set against it
# round by round (hit and attack only: it serves one fixed row).
# Needs what bench/run.sh sets up: Postgres with the 1M-user database
# `bloomgate_bench` (run bench/run.sh once) and wrk.
#
# Environment (defaults in brackets): ROUNDS [4], DURATION [10s] measured
# per binary and round after 3 s of warm-up, WORKLOAD [attack] (see
# bench/keys.lua; `hit` warms by walking every key first), PG_URL
# [postgres://postgres@127.0.0.1:5432], LOG [warn] the gateways' RUST_LOG
# (`info` is the shipped level: one access line per request, to /dev/null).
# A binary may be a wrapper script that execs the gateway with settings of
# its own (e.g. BLOOMGATE_LOG__ACCESS=false): its pid is the gateway's.
#
# Per round and binary: requests/s and the gateway's CPU (utime + stime)
# per request, then the after/before ratios. CPU per request is the steadier
# of the two: wrk shares the 2 cores, so requests/s moves with whatever else
# runs.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -ne 2 ]; then
  sed -n '2,27p' "$0" >&2
  exit 2
fi
BEFORE=$1 AFTER=$2
ROUNDS=${ROUNDS:-4} DURATION=${DURATION:-10s} WORKLOAD=${WORKLOAD:-attack}
PG_URL=${PG_URL:-postgres://postgres@127.0.0.1:5432}
LOG=${LOG:-warn}
PORT=18085
TCK=$(getconf CLK_TCK)

cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }

run() { # BIN -> "req/s cpu_us_per_req"
  case "$1" in
    *bare_axum) "$1" --listen "127.0.0.1:$PORT" >/dev/null 2>&1 & ;;
    *) DATABASE_URL="$PG_URL/bloomgate_bench" BLOOMGATE_SERVER__LISTEN="127.0.0.1:$PORT" \
      RUST_LOG="$LOG" "$1" serve --config config/bloomgate.toml >/dev/null 2>&1 & ;;
  esac
  local pid=$! i out c0 c1
  for i in $(seq 100); do
    curl -sf "http://127.0.0.1:$PORT/readyz" >/dev/null && break
    sleep 0.2
  done
  # hit: the warm-up walks every key in order (keys.lua hitwarm), so the
  # measured window is hits only.
  local warm=$WORKLOAD
  [ "$WORKLOAD" = hit ] && warm=hitwarm
  wrk -t2 -c64 -d3s -s bench/keys.lua "http://127.0.0.1:$PORT" -- "$warm" 7 >/dev/null 2>&1
  c0=$(cpu_ticks "$pid")
  out=$(wrk -t2 -c64 -d"$DURATION" -s bench/keys.lua "http://127.0.0.1:$PORT" -- "$WORKLOAD" 42 2>&1 | grep RESULT)
  c1=$(cpu_ticks "$pid")
  kill "$pid"
  wait "$pid" 2>/dev/null || true
  echo "$out" | awk -v c="$((c1 - c0))" -v t="$TCK" '{
    for (i = 1; i <= NF; i++) { split($i, kv, "="); v[kv[1]] = kv[2] }
    errors = v["connect"] + v["read"] + v["write"] + v["timeout"] + v["bad"]
    if (errors > 0) printf "warning: %d socket errors or statuses other than 200/404\n", errors > "/dev/stderr"
    printf "%.0f %.2f\n", v["rps"], c / t * 1e6 / v["requests"] }'
}

echo "| round | before req/s | before CPU µs/req | after req/s | after CPU µs/req | after/before req/s | after/before CPU |"
echo "|---|---:|---:|---:|---:|---:|---:|"
for r in $(seq "$ROUNDS"); do
  read -r a b <<<"$(run "$BEFORE")"
  read -r c d <<<"$(run "$AFTER")"
  awk -v r="$r" -v a="$a" -v b="$b" -v c="$c" -v d="$d" \
    'BEGIN { printf "| %d | %d | %.2f | %d | %.2f | %.3f | %.3f |\n", r, a, b, c, d, c / a, d / b }'
done
