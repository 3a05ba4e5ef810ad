#!/usr/bin/env bash
# Hunts flaky tests: runs each test binary N times, each run on its own, no
# retries, and says which tests failed in how many runs.
#
#   scripts/flakes.sh N [TARGET...]
#
# A TARGET is a test binary (`memory`), a module of the one that holds
# the rest (`it/feed::wal`: tests/it/feed/wal.rs and below), `lib` (the unit tests),
# `freshness@MODE` (tests/it/feed/freshness.rs with BLOOMGATE_TEST_FRESHNESS=MODE,
# `least-MODE` for the least-privilege role: as scripts/test.sh runs it),
# or `truth@seeds` (the checker's CI seeds, its ignored tests). Without
# targets: `lib`, every binary under tests/ (tests/it/ by its top-level
# modules), every freshness variant
# scripts/test.sh runs, and `truth@seeds`.
#
#   FLAKES_LOAD=1   keeps one core busy with a CPU hog for the whole hunt
#                   (as CI's fuzz build loads it while the tests run)
#   FLAKES_LOG=DIR  where each failed run's output is kept
#                   (default target/flakes)
#
# Exit 1 if any run failed. The servers are scripts/test.sh's (it is called
# for every run, with the binary's cargo arguments).
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:?usage: scripts/flakes.sh N [TARGET...]}
shift
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  targets=(lib)
  for f in tests/*.rs tests/*/main.rs; do
    [ -e "$f" ] || continue
    case "$f" in
      tests/it/main.rs)
        # The whole binary (its modules side by side, as CI runs them),
        # then each top-level module alone.
        targets+=(it)
        for m in tests/it/*.rs; do
          [ "$m" = tests/it/main.rs ] || targets+=("it/$(basename "$m" .rs)")
        done ;;
      */main.rs) targets+=("$(basename "$(dirname "$f")")") ;;
      *) targets+=("$(basename "$f" .rs)") ;;
    esac
  done
  [ -d tests/truth ] && targets+=(truth@seeds)
  targets+=(freshness@wal freshness@wal-poll freshness@queue freshness@least-wal freshness@least-notify freshness@least-queue)
fi
logs=${FLAKES_LOG:-target/flakes}
mkdir -p "$logs"
hog=""
if [ -n "${FLAKES_LOAD:-}" ]; then
  # One core busy, at normal priority: the tests get the other one.
  (exec taskset -c 0 sh -c 'while :; do :; done') &
  hog=$!
  echo "flakes: a CPU hog on core 0 (pid $hog)" >&2
fi
cleanup() { [ -n "$hog" ] && kill "$hog" 2>/dev/null || true; }
trap cleanup EXIT
# Built once, before the clock starts.
scripts/test.sh --no-run >/dev/null 2>&1 || scripts/test.sh --no-run
summary=$(mktemp)
began=$SECONDS
any=0
for t in "${targets[@]}"; do
  env=()
  args=()
  case "$t" in
    lib) args=(--lib) ;;
    truth@seeds) args=(--test truth -- --ignored) ;;
    freshness@least-*) env=(BLOOMGATE_TEST_ROLE=least); mode=${t#freshness@least-}
      [ "$mode" = notify ] || env+=(BLOOMGATE_TEST_FRESHNESS="$mode")
      args=(--test it -- feed::freshness::) ;;
    freshness@*) env=(BLOOMGATE_TEST_FRESHNESS="${t#freshness@}"); args=(--test it -- feed::freshness::) ;;
    it/*) args=(--test it -- "${t#it/}::") ;;
    *) args=(--test "$t") ;;
  esac
  failed_runs=0
  t_began=$SECONDS
  for i in $(seq 1 "$n"); do
    out="$logs/${t//[@\/]/_}.$i.log"
    if env "${env[@]}" scripts/test.sh "${args[@]}" >"$out" 2>&1; then
      rm -f "$out"
    else
      failed_runs=$((failed_runs + 1))
      any=1
      names=$(grep -E '^test .* FAILED$|^    [a-z_:]+$' "$out" | sed -E 's/^test (.*) \.\.\. FAILED$/\1/; s/^ +//' | sort -u | tr '\n' ' ')
      echo "flakes: $t run $i failed: ${names:-see $out} ($out)" >&2
      echo "$t $i $names" >>"$summary"
    fi
  done
  echo "flakes: $t: $failed_runs of $n runs failed ($((SECONDS - t_began)) s)" >&2
done
echo "flakes: ${#targets[@]} targets x $n runs in $((SECONDS - began)) s${FLAKES_LOAD:+, one core loaded}" >&2
if [ "$any" -ne 0 ]; then
  echo "flakes: failures (target, run, tests):" >&2
  cat "$summary" >&2
  exit 1
fi
echo "flakes: no failure" >&2
