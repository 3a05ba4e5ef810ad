#!/usr/bin/env bash
# bench/profile.sh: where the gateway's CPU goes on one workload, and how
# many instructions and allocations a request costs, against bare axum.
#
#   bench/profile.sh perf SYSTEM WORKLOAD        # sampled call graphs
#   bench/profile.sh callgrind SYSTEM WORKLOAD   # instructions per request
#   bench/profile.sh cachesim SYSTEM WORKLOAD    # cache misses per request
#
# SYSTEM: bloomgate (the release binary, shipped config) or bare
# (examples/bare_axum); WORKLOAD: one of bench/keys.lua's (hit, attack, ...).
# BIN and BARE_BIN override the binaries (to profile an experiment's build).
#
# perf: `perf record` on the running server while wrk loads it (software
# clock event `cpu-clock`: this VM has no hardware counters, `perf stat -e
# instructions` says "not supported"; DWARF call graphs, since the release
# build keeps line tables but no frame pointers). Writes
# docs/perf-log/results/profiles/SYSTEM-WORKLOAD.{self,children}.txt (perf report
# --no-children / --children, entries over 1 %) and, when inferno is
# installed (`cargo install inferno`), SYSTEM-WORKLOAD.svg.
#
# callgrind: the server under `valgrind --tool=callgrind`, instrumentation
# switched on only for the measured window (start-up, the filter build and
# the warm-up are not counted), wrk at a few connections for DURATION.
# RUST_LOG [warn] is the server's log filter (`info` puts the access lines
# in the measurement).
# Valgrind runs the threads one at a time and counts user-space
# instructions exactly, so the figures repeat to within a percent on a busy
# machine where timings do not; the kernel's share (syscalls, TCP) is not
# in them. Prints and appends to docs/perf-log/results/profiles/callgrind.tsv:
# instructions per request, and calls to malloc/calloc/realloc per request
# (every Rust heap allocation ends in one of them). Keeps the callgrind
# output as docs/perf-log/results/profiles/SYSTEM-WORKLOAD.callgrind.txt
# (callgrind_annotate, top functions, inclusive).
#
# cachesim: callgrind as above with its cache simulation on
# (`--cache-sim=yes`): first-level data misses (D1) and last-level data
# misses (DL) per request, with the last level sized as one core's L2
# (LL [2097152,16,64], valgrind's `--LL=size,assoc,line`): a line a request
# misses there is one it fetches from L3 or memory on the real machine.
# This VM has no hardware counters, and a hit's cost beyond its
# instructions is mostly such misses on a 10,000-row working set (bare axum
# touches the same few lines on every request). Simulated on one cache for
# all threads, so it counts capacity misses, not lines moving between
# cores. Appends to docs/perf-log/results/profiles/cachesim.tsv; keeps
# SYSTEM-WORKLOAD.cachesim.txt (callgrind_annotate by data misses).
#
# Environment: CONFIG [config/bloomgate.toml] (bench/auth.sh's resources
# with credentials: PATH_PREFIX and AUTH_HEADER reach keys.lua through
# the environment), DURATION [15s perf, 20s callgrind], LABEL [SYSTEM] (the row
# name in callgrind.tsv and the file names), PORT [18089], PG_URL
# [postgres://postgres@127.0.0.1:5432]; the server inherits the rest of the
# environment (BLOOMGATE_* settings). Needs bench/run.sh's database (run it
# once), wrk, and linux-perf or valgrind (installed if missing).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -ne 3 ]; then
  sed -n '2,51p' "$0" >&2
  exit 2
fi
MODE=$1 SYSTEM=$2 WORKLOAD=$3
LABEL=${LABEL:-$SYSTEM}
PG_URL=${PG_URL:-postgres://postgres@127.0.0.1:5432}
OUT=docs/perf-log/results/profiles
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/bloomgate-profile.XXXXXX)
PID=""
cleanup() {
  if [ -n "$PID" ] && kill -0 "$PID" 2>/dev/null; then
    kill -TERM "$PID" 2>/dev/null || true
    for _ in $(seq 1 100); do kill -0 "$PID" 2>/dev/null || break; sleep 0.2; done
    kill -KILL "$PID" 2>/dev/null || true
  fi
  if [ "${KEEP_WORK:-0}" = 1 ]; then log "scratch kept in $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM
log() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
need() { command -v "$1" >/dev/null || { apt-get update -qq >&2 || true; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$2" >&2; }; }
need wrk wrk

PORT=${PORT:-18089}
case $SYSTEM in
  bloomgate) BIN=${BIN:-target/release/bloomgate} ;;
  bare) BIN=${BARE_BIN:-target/release/examples/bare_axum} ;;
  *) echo "SYSTEM must be bloomgate or bare" >&2; exit 2 ;;
esac
[ -x "$BIN" ] || cargo build --locked --release --bin bloomgate --example bare_axum >&2
URL=http://127.0.0.1:$PORT

start() { # WRAPPER...
  if [ "$SYSTEM" = bare ]; then
    "$@" "$BIN" --listen "127.0.0.1:$PORT" >"$WORK/server.log" 2>&1 &
  else
    DATABASE_URL="$PG_URL/bloomgate_bench" BLOOMGATE_SERVER__LISTEN="127.0.0.1:$PORT" RUST_LOG="${RUST_LOG:-warn}" \
      "$@" "$BIN" serve --config "${CONFIG:-config/bloomgate.toml}" >"$WORK/server.log" 2>&1 &
  fi
  PID=$!
  local i
  for i in $(seq 1 1800); do
    curl -sf -o /dev/null "$URL/readyz" && return 0
    kill -0 "$PID" 2>/dev/null || { tail -n 20 "$WORK/server.log" >&2; exit 1; }
    sleep 0.2
  done
  log "not ready after 6 minutes"; exit 1
}
# The hit workload: passes over every key in order until one pass reached
# them all (keys.lua's min_sent), so that the measured window has only hits
# (the cache starts empty and holds 10x the keys: nothing is refused).
warm() { # CONNECTIONS DURATION
  if [ "$WORKLOAD" = hit ]; then
    local pass sent
    for pass in $(seq 1 20); do
      sent=$(wrk -t1 -c"$1" -d"$2" -s bench/keys.lua "$URL" -- hitwarm 0 2>&1 |
        tr ' ' '\n' | awk -F= '$1 == "min_sent" {print $2}')
      [ "${sent:-0}" -ge $((${HIT_KEYS:-10000} + $1)) ] && return 0
    done
    log "warning: the hit warm-up never reached every key"
  else
    wrk -t1 -c"$1" -d"$2" -s bench/keys.lua "$URL" -- "$WORKLOAD" 7 >/dev/null 2>&1
  fi
}

case $MODE in
  perf)
    need perf linux-perf
    DURATION=${DURATION:-15s}
    start
    warm 64 3s
    secs=${DURATION%s}
    wrk -t2 -c64 -d"$((secs + 2))s" -s bench/keys.lua "$URL" -- "$WORKLOAD" 42 >"$WORK/wrk.txt" 2>&1 &
    wrk_pid=$!
    sleep 1
    perf record -e cpu-clock -F 999 --call-graph dwarf,16384 -p "$PID" -o "$WORK/perf.data" -- sleep "$secs" \
      >"$WORK/perf-record.log" 2>&1
    wait "$wrk_pid" || true
    base=$OUT/$(echo "$LABEL" | tr -c "A-Za-z0-9_.+\n-" "-")-$WORKLOAD
    # (Trailing padding and the empty IPC columns, which a clock event
    # cannot fill, are cut.)
    perf report -i "$WORK/perf.data" --no-children --percent-limit 1 --stdio --sort symbol -g none 2>/dev/null |
      sed -E 's/[[:space:]]+-[[:space:]]+-[[:space:]]*$//; s/[[:space:]]+$//' >"$base.self.txt"
    perf report -i "$WORK/perf.data" --children --percent-limit 2 --stdio --sort symbol -g none 2>/dev/null |
      sed -E 's/[[:space:]]+-[[:space:]]+-[[:space:]]*$//; s/[[:space:]]+$//' >"$base.children.txt"
    if command -v inferno-collapse-perf >/dev/null && command -v inferno-flamegraph >/dev/null; then
      perf script -i "$WORK/perf.data" 2>/dev/null | inferno-collapse-perf >"$WORK/folded.txt"
      inferno-flamegraph --title "$LABEL, $WORKLOAD ($(grep -o 'RESULT.*rps=[0-9.]*' "$WORK/wrk.txt" | grep -o 'rps=.*'))" \
        <"$WORK/folded.txt" >"$base.svg"
    fi
    log "wrote $base.self.txt, $base.children.txt$( [ -f "$base.svg" ] && echo ", $base.svg")"
    ;;
  callgrind | cachesim)
    need valgrind valgrind
    DURATION=${DURATION:-20s}
    sim=()
    [ "$MODE" = cachesim ] && sim=(--cache-sim=yes "--LL=${LL:-2097152,16,64}")
    start valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$WORK/cg.out" --dump-instr=no "${sim[@]}"
    warm 8 5s
    callgrind_control -i on "$PID" >/dev/null
    # Instrumented code warms too (valgrind translates it on first use).
    wrk -t1 -c8 -d2s -s bench/keys.lua "$URL" -- "$WORKLOAD" 7 >/dev/null 2>&1
    callgrind_control -z "$PID" >/dev/null
    out=$(wrk -t1 -c8 -d"$DURATION" -s bench/keys.lua "$URL" -- "$WORKLOAD" 42 2>&1 | grep '^RESULT')
    callgrind_control -d "$PID" >/dev/null
    callgrind_control -i off "$PID" >/dev/null
    requests=$(echo "$out" | tr ' ' '\n' | awk -F= '$1 == "requests" {print $2}')
    dump=$(ls -t "$WORK"/cg.out* | head -n 1)
    # Total instructions, and calls into the allocator's entry points.
    read -r ir mallocs < <(python3 - "$dump" <<'EOF'
import re, sys
names, calls, total, cfn = {}, {}, 0, None
for line in open(sys.argv[1], errors="replace"):
    if line.startswith("summary:") or line.startswith("totals:"):
        total = max(total, int(line.split()[1]))
    m = re.match(r"c?fn=\((\d+)\)(?: (.*))?", line)
    if m:
        if m.group(2):
            names[m.group(1)] = m.group(2).strip()
        if line.startswith("cfn="):
            cfn = names.get(m.group(1))
        continue
    if line.startswith("calls=") and cfn is not None:
        calls[cfn] = calls.get(cfn, 0) + int(line[6:].split()[0])
alloc = sum(n for f, n in calls.items() if f in ("malloc", "calloc", "realloc", "posix_memalign", "aligned_alloc"))
print(total, alloc)
EOF
)
    base=$OUT/$(echo "$LABEL" | tr -c "A-Za-z0-9_.+\n-" "-")-$WORKLOAD
    if [ "$MODE" = cachesim ]; then
      # The dump's "events:" line names the columns (Ir Dr Dw I1mr D1mr
      # D1mw ILmr DLmr DLmw).
      read -r ir d1 dl < <(python3 - "$dump" <<'EOF'
import sys
events, totals = [], None
for line in open(sys.argv[1], errors="replace"):
    if line.startswith("events:"):
        events = line.split()[1:]
    elif line.startswith("summary:") or line.startswith("totals:"):
        totals = [int(x) for x in line.split()[1:]]
v = dict(zip(events, totals))
print(v["Ir"], v["D1mr"] + v["D1mw"], v["DLmr"] + v["DLmw"])
EOF
)
      callgrind_annotate --inclusive=no --auto=no --sort=D1mr,D1mw,DLmr,DLmw --threshold=90 "$dump" 2>/dev/null |
        sed -n '/^Ir /,$p' | head -n 60 >"$base.cachesim.txt" || true
      tsv=$OUT/cachesim.tsv
      [ -s "$tsv" ] || printf 'label\tworkload\trequests\tinstructions_per_request\tD1_misses_per_request\tLL_misses_per_request\tLL\tdate\tgit\n' >"$tsv"
      row=$(awk -v l="$LABEL" -v w="$WORKLOAD" -v r="$requests" -v i="$ir" -v a="$d1" -v b="$dl" -v ll="${LL:-2097152,16,64}" \
        -v d="$(date -u +%Y-%m-%dT%H:%MZ)" -v g="$(git rev-parse --short HEAD 2>/dev/null || echo ?)" \
        'BEGIN { printf "%s\t%s\t%d\t%.0f\t%.1f\t%.1f\t%s\t%s\t%s\n", l, w, r, i / r, a / r, b / r, ll, d, g }')
      echo "$row" >>"$tsv"
      echo "$row"
      exit 0
    fi
    callgrind_annotate --inclusive=yes --threshold=99 "$dump" >"$WORK/annotate.txt" 2>/dev/null || true
    head -n 80 "$WORK/annotate.txt" >"$base.callgrind.txt"
    tsv=$OUT/callgrind.tsv
    [ -s "$tsv" ] || printf 'label\tworkload\trequests\tinstructions\tinstructions_per_request\tallocations_per_request\tdate\tgit\n' >"$tsv"
    row=$(awk -v l="$LABEL" -v w="$WORKLOAD" -v r="$requests" -v i="$ir" -v m="$mallocs" \
      -v d="$(date -u +%Y-%m-%dT%H:%MZ)" -v g="$(git rev-parse --short HEAD 2>/dev/null || echo ?)" \
      'BEGIN { printf "%s\t%s\t%d\t%d\t%.0f\t%.2f\t%s\t%s\n", l, w, r, i, i / r, m / r, d, g }')
    echo "$row" >>"$tsv"
    echo "$row"
    ;;
  *) echo "MODE must be perf, callgrind or cachesim" >&2; exit 2 ;;
esac
