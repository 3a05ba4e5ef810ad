#!/usr/bin/env bash
# bench/ab.sh: A/B (or A/B/C...) of gateway binaries on one load-test cell,
# alternating them round by round so that drift in a noisy machine hits all
# alike.
#
#   bench/ab.sh BEFORE_BIN AFTER_BIN [MORE_BINS...]
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
# (`info` is the shipped level: one access line per request, to stdout),
# THREADS [2] wrk's threads (64 connections), LOG_BYTES [0] 1: the
# gateways' stdout goes to a file and the bytes it grew by in the measured
# window are reported per second (else stdout is /dev/null).
# A binary may be a wrapper script that execs the gateway with settings of
# its own (e.g. BLOOMGATE_LOG__ACCESS=false, or RUST_LOG=warn to compare
# levels in one run): its pid is the gateway's.
#
# Per round and binary: requests/s and the gateway's CPU (utime + stime)
# per request (and log bytes/s), then each binary's ratios to the first;
# at the end the median and range of each ratio over the rounds. CPU per
# request is the steadier of the two: wrk shares the 2 cores, so
# requests/s moves with whatever else runs.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 2 ]; then
  sed -n '2,35p' "$0" >&2
  exit 2
fi
BINS=("$@")
ROUNDS=${ROUNDS:-4} DURATION=${DURATION:-10s} WORKLOAD=${WORKLOAD:-attack}
PG_URL=${PG_URL:-postgres://postgres@127.0.0.1:5432}
LOG=${LOG:-warn} THREADS=${THREADS:-2} LOG_BYTES=${LOG_BYTES:-0}
PORT=18085
TCK=$(getconf CLK_TCK)
OUT=$(mktemp /tmp/bloomgate-ab.XXXXXX)
trap 'rm -f "$OUT"' EXIT

cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
size() { stat -c %s "$OUT"; }

run() { # BIN -> "req/s cpu_us_per_req log_bytes_per_s"
  local sink=/dev/null
  if [ "$LOG_BYTES" = 1 ]; then : >"$OUT"; sink=$OUT; fi
  case "$1" in
    *bare_axum) "$1" --listen "127.0.0.1:$PORT" >"$sink" 2>&1 & ;;
    *) DATABASE_URL="$PG_URL/bloomgate_bench" BLOOMGATE_SERVER__LISTEN="127.0.0.1:$PORT" \
      RUST_LOG="$LOG" "$1" serve --config config/bloomgate.toml >"$sink" 2>&1 & ;;
  esac
  local pid=$! i out c0 c1 s0 s1
  for i in $(seq 100); do
    curl -sf "http://127.0.0.1:$PORT/readyz" >/dev/null && break
    sleep 0.2
  done
  # hit: the warm-up walks every key in order (keys.lua hitwarm), so the
  # measured window is hits only.
  local warm=$WORKLOAD
  [ "$WORKLOAD" = hit ] && warm=hitwarm
  wrk -t"$THREADS" -c64 -d3s -s bench/keys.lua "http://127.0.0.1:$PORT" -- "$warm" 7 >/dev/null 2>&1
  c0=$(cpu_ticks "$pid") s0=$(size)
  out=$(wrk -t"$THREADS" -c64 -d"$DURATION" -s bench/keys.lua "http://127.0.0.1:$PORT" -- "$WORKLOAD" 42 2>&1 | grep RESULT)
  c1=$(cpu_ticks "$pid") s1=$(size)
  kill "$pid"
  wait "$pid" 2>/dev/null || true
  echo "$out" | awk -v c="$((c1 - c0))" -v t="$TCK" -v b="$((s1 - s0))" -v d="${DURATION%s}" '{
    for (i = 1; i <= NF; i++) { split($i, kv, "="); v[kv[1]] = kv[2] }
    errors = v["connect"] + v["read"] + v["write"] + v["timeout"] + v["bad"]
    if (errors > 0) printf "warning: %d socket errors or statuses other than 200/404\n", errors > "/dev/stderr"
    printf "%.0f %.2f %.0f\n", v["rps"], c / t * 1e6 / v["requests"], b / d }'
}

n=${#BINS[@]}
head="| round |" rule="|---|"
for b in "${BINS[@]}"; do
  name=$(basename "$b")
  head+=" $name req/s | $name CPU µs/req |"
  rule+="---:|---:|"
  if [ "$LOG_BYTES" = 1 ]; then head+=" $name log B/s |"; rule+="---:|"; fi
done
for ((j = 1; j < n; j++)); do
  name=$(basename "${BINS[j]}")
  head+=" $name/first req/s | $name/first CPU |"
  rule+="---:|---:|"
done
echo "$head"
echo "$rule"
ratios=()
for r in $(seq "$ROUNDS"); do
  rps=() cpu=() row="| $r |"
  for b in "${BINS[@]}"; do
    read -r a c l <<<"$(run "$b")"
    rps+=("$a") cpu+=("$c")
    row+=" $a | $c |"
    if [ "$LOG_BYTES" = 1 ]; then row+=" $l |"; fi
  done
  for ((j = 1; j < n; j++)); do
    read -r x y <<<"$(awk -v a="${rps[0]}" -v b="${cpu[0]}" -v c="${rps[j]}" -v d="${cpu[j]}" \
      'BEGIN { printf "%.3f %.3f", c / a, d / b }')"
    row+=" $x | $y |"
    ratios+=("$j $x $y")
  done
  echo "$row"
done
# Median and range of each ratio over the rounds.
for ((j = 1; j < n; j++)); do
  printf '%s\n' "${ratios[@]}" | awk -v j="$j" -v name="$(basename "${BINS[j]}")" '
    $1 == j { r[++k] = $2; c[k] = $3 }
    function sort(a, n,   i, m, t) { for (i = 2; i <= n; i++) for (m = i; m > 1 && a[m-1] > a[m]; m--) { t = a[m]; a[m] = a[m-1]; a[m-1] = t } }
    function median(a, n) { return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2 }
    END { sort(r, k); sort(c, k)
      printf "%s/first: req/s median %.3f (%.3f-%.3f), CPU median %.3f (%.3f-%.3f) over %d rounds\n",
        name, median(r, k), r[1], r[k], median(c, k), c[1], c[k], k }'
done
