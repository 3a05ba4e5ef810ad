#!/usr/bin/env bash
# bench/compression.sh: compressed rows (issue 12), measured, in one run.
#
#   bench/compression.sh              # both parts, ~4 min on 2 shared cores
#   PARTS=wire bench/compression.sh   # or PARTS=cost
#
# Part "wire": an 8 kB article row (English prose: the first 8,028 bytes of
# LICENSE, whitespace squeezed) served from the cache in identity, gzip, br
# and zstd, side by side: bytes on the wire per response (status line,
# headers and body, as wrk reads them), requests/s and the gateway's CPU
# per request. The four cells alternate round by round so that drift on a
# shared machine hits all alike; the table gives the median of ROUNDS.
#
# Part "cost": what the compression layer adds to a cache hit on a 100-byte
# row (under the 1 KiB threshold, so never compressed), in instructions
# (callgrind Ir, the count is stable where times on a shared machine are
# not), through the whole router (examples/compression_cost.rs): the build
# of BASE (the commit before the layer) against this build, with
# `cache.compression` on and off; and the 8 kB row's hit in identity
# against br. BASE is built from `git archive` in target/compression-base/
# (sharing target/'s dependencies).
#
# Environment (defaults in brackets): ROUNDS [3], DURATION [5s] per cell and
# round after a 2 s warm-up, CONNECTIONS [32], THREADS [2], N [10000] hits
# counted per cost run, REPS [3] cost runs per configuration, BASE [90a6311, the merge before adc31c1 "Compressed
# rows"], PG_URL [postgres://postgres@127.0.0.1:5432]; the database
# `bloomgate_comp` is created, migrated and seeded (1,000 users, 1,000
# articles) if missing. Needs wrk and valgrind; everything runs under
# `nice -n 10` on 127.0.0.1 with a free port.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
ROUNDS=${ROUNDS:-3} DURATION=${DURATION:-5s} CONNECTIONS=${CONNECTIONS:-32} THREADS=${THREADS:-2}
N=${N:-10000} BASE=${BASE:-90a6311} PARTS=${PARTS:-"wire cost"}
PG_URL=${PG_URL:-postgres://postgres@127.0.0.1:5432}
DB=bloomgate_comp
export DATABASE_URL="$PG_URL/$DB"
TCK=$(getconf CLK_TCK)
WORK=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT
log() { echo "compression.sh: $*" >&2; }

nice -n 10 cargo build --locked -q --release --bin bloomgate --example compression_cost
BIN=$ROOT/target/release/bloomgate

# The database: demo rows, and article 1 made 8 kB.
if ! psql "$PG_URL/postgres" -Atqc "SELECT 1 FROM pg_database WHERE datname = '$DB'" | grep -q 1; then
  psql "$PG_URL/postgres" -qc "CREATE DATABASE $DB"
  "$BIN" migrate >&2
  "$BIN" seed --users 1000 --articles 1000 >&2
fi
ARTICLE=$(psql "$DATABASE_URL" -Atqc "SELECT md5('article-1')::uuid")
text=$(tr -s ' \n' ' ' <LICENSE) # (not `| head`: SIGPIPE under pipefail)
text=${text:0:8028}
psql "$DATABASE_URL" -q -v body="$text" -v id="$ARTICLE" <<'SQL'
UPDATE articles SET body = :'body' WHERE id = :'id' AND body IS DISTINCT FROM :'body';
SQL

cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

cat >"$WORK/report.lua" <<'LUA'
done = function(summary, latency, requests)
  io.write(string.format("RESULT requests=%d bytes=%d rps=%.1f errors=%d\n",
    summary.requests, summary.bytes, summary.requests / (summary.duration / 1e6),
    summary.errors.status + summary.errors.connect + summary.errors.read
      + summary.errors.write + summary.errors.timeout))
end
LUA

wire() {
  local port url pid
  port=$(free_port)
  url="http://127.0.0.1:$port/articles/$ARTICLE"
  # A TTL longer than the run: every measured request is a hit.
  BLOOMGATE_SERVER__LISTEN="127.0.0.1:$port" BLOOMGATE_CACHE__TTL=1h RUST_LOG=warn \
    nice -n 10 "$BIN" serve --config config/bloomgate.toml >"$WORK/gw.log" 2>&1 &
  pid=$!
  pids+=("$pid")
  for _ in $(seq 100); do curl -sf "http://127.0.0.1:$port/readyz" >/dev/null && break; sleep 0.2; done
  local codings="identity gzip br zstd" c
  declare -A body
  for c in $codings; do
    curl -s -o /dev/null -H "Accept-Encoding: $c" "$url" # load it
    local h
    h=$(curl -s -D - -o "$WORK/body.$c" -H "Accept-Encoding: $c" "$url")
    grep -qi '^cache-status: .*hit' <<<"$h" || { log "not a hit: $h"; exit 1; }
    if [ "$c" != identity ]; then
      grep -qi "^content-encoding: $c" <<<"$h" || { log "no $c: $h"; exit 1; }
    fi
    body[$c]=$(stat -c %s "$WORK/body.$c")
  done
  for r in $(seq "$ROUNDS"); do
    for c in $codings; do
      nice -n 10 wrk -t"$THREADS" -c"$CONNECTIONS" -d2s -H "Accept-Encoding: $c" "$url" >/dev/null 2>&1
      local c0 c1 out
      c0=$(cpu_ticks "$pid")
      out=$(nice -n 10 wrk -t"$THREADS" -c"$CONNECTIONS" -d"$DURATION" -H "Accept-Encoding: $c" \
        -s "$WORK/report.lua" "$url" 2>&1 | grep RESULT)
      c1=$(cpu_ticks "$pid")
      echo "$out" | awk -v c="$c" -v r="$r" -v t=$((c1 - c0)) -v tck="$TCK" -v b="${body[$c]}" '{
        for (i = 1; i <= NF; i++) { split($i, kv, "="); v[kv[1]] = kv[2] }
        printf "%s %d %d %.1f %.0f %.2f %d\n", c, r, b, v["bytes"] / v["requests"], v["rps"],
          t / tck * 1e6 / v["requests"], v["errors"] }' >>"$WORK/wire.tsv"
      log "round $r $c: $(tail -n1 "$WORK/wire.tsv")"
    done
  done
  kill "$pid"
  echo
  echo "8 kB article row from the cache, $ROUNDS rounds x $DURATION per coding, wrk -t$THREADS -c$CONNECTIONS (median of the rounds):"
  echo
  echo "| Accept-Encoding | body bytes | bytes on the wire / response | of identity | requests/s | gateway CPU µs / request | errors |"
  echo "|---|---:|---:|---:|---:|---:|---:|"
  python3 - "$WORK/wire.tsv" <<'PY'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
by = {}
for c, r, b, wire, rps, cpu, err in rows:
    by.setdefault(c, []).append((int(b), float(wire), float(rps), float(cpu), int(err)))
ident = statistics.median(x[1] for x in by["identity"])
for c in ["identity", "gzip", "br", "zstd"]:
    xs = by[c]
    wire = statistics.median(x[1] for x in xs)
    print(f"| {c} | {xs[0][0]:,} | {wire:,.0f} | {100 * wire / ident:.1f} % | "
          f"{statistics.median(x[2] for x in xs):,.0f} | {statistics.median(x[3] for x in xs):.1f} | "
          f"{sum(x[4] for x in xs)} |")
PY
}

ir() { # DIR BINARY ENV... -> instructions per hit
  local dir=$1 bin=$2
  shift 2
  (cd "$dir" && env "$@" N="$N" nice -n 10 valgrind --tool=callgrind --toggle-collect='*measured_hits*' \
    --callgrind-out-file="$WORK/cg.out" "$bin" >"$WORK/cg.stdout" 2>"$WORK/cg.stderr") \
    || { cat "$WORK/cg.stderr" >&2; exit 1; }
  local total
  total=$(awk '/^(summary|totals):/ { print $2; exit }' "$WORK/cg.out")
  log "$* -> $(cat "$WORK/cg.stdout") Ir=$total"
  echo $((total / N))
}

cost() {
  local base=$ROOT/target/compression-base ours=$WORK/compression_cost
  # Both packages build an example of this name into target/release/examples:
  # each copy is taken right after its own build.
  nice -n 10 cargo build --locked -q --release --example compression_cost
  cp "$ROOT/target/release/examples/compression_cost" "$ours"
  if [ ! -x "$base/target-bin" ] || [ "$(cat "$base/commit" 2>/dev/null)" != "$(git rev-parse "$BASE")" ]; then
    rm -rf "$base/src"
    mkdir -p "$base/src"
    git archive "$BASE" | tar -x -C "$base/src"
    cp examples/compression_cost.rs "$base/src/examples/"
    log "building $BASE's compression_cost"
    CARGO_TARGET_DIR=$ROOT/target nice -n 10 cargo build --locked -q --release --example compression_cost \
      --manifest-path "$base/src/Cargo.toml"
    cp "$ROOT/target/release/examples/compression_cost" "$base/target-bin"
    git rev-parse "$BASE" >"$base/commit"
  fi
  local browser="gzip, deflate, br, zstd" art="/articles/$ARTICLE"
  # Ir varies by a few hundred per hit from run to run (moka's maintenance,
  # random request ids): every configuration runs REPS times, alternating.
  local labels=(
    "$BASE (before compression)|100 B user|\`$browser\`"
    "this, \`compression = false\`|100 B user|\`$browser\`"
    "this, \`compression = true\`|100 B user|\`$browser\`"
    "this, \`compression = true\`|8 kB article|\`identity\`"
    "this, \`compression = true\`|8 kB article|\`$browser\` (br)"
  )
  for r in $(seq "${REPS:-3}"); do
    echo "0 $(ir "$base/src" "$base/target-bin" HIT_PATH=/users/500 ACCEPT_ENCODING="$browser")" >>"$WORK/cost.tsv"
    echo "1 $(ir "$ROOT" "$ours" HIT_PATH=/users/500 ACCEPT_ENCODING="$browser" BLOOMGATE_CACHE__COMPRESSION=false)" >>"$WORK/cost.tsv"
    echo "2 $(ir "$ROOT" "$ours" HIT_PATH=/users/500 ACCEPT_ENCODING="$browser")" >>"$WORK/cost.tsv"
    echo "3 $(ir "$ROOT" "$ours" HIT_PATH="$art" ACCEPT_ENCODING=identity)" >>"$WORK/cost.tsv"
    echo "4 $(ir "$ROOT" "$ours" HIT_PATH="$art" ACCEPT_ENCODING="$browser")" >>"$WORK/cost.tsv"
  done
  echo
  echo "One cache hit through the whole router (\`oneshot\`, no hyper): callgrind instructions per hit over $N hits, median (min-max) of ${REPS:-3} runs:"
  echo
  echo "| build | row | Accept-Encoding | Ir / hit | vs $BASE |"
  echo "|---|---|---|---:|---:|"
  printf '%s\n' "${labels[@]}" >"$WORK/labels"
  python3 - "$WORK/cost.tsv" "$WORK/labels" <<'PY'
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    i, ir = line.split()
    runs.setdefault(int(i), []).append(int(ir))
labels = open(sys.argv[2]).read().splitlines()
med = {i: statistics.median(v) for i, v in runs.items()}
for i, label in enumerate(labels):
    build, row, accept = label.split("|")
    vs = f"{100 * (med[i] - med[0]) / med[0]:+.2f} %" if row == "100 B user" and i else ""
    print(f"| {build} | {row} | {accept} | {med[i]:,.0f} ({min(runs[i]):,}-{max(runs[i]):,}) | {vs} |")
print(f"\nThe layer on a 100-byte row (never compressed): {100 * (med[2] - med[0]) / med[0]:+.2f} % "
      f"instructions per hit against the build without it (target: at most 2 %). "
      f"A br hit of the 8 kB row against its identity hit: {100 * (med[4] - med[3]) / med[3]:+.2f} %.")
PY
}

for p in $PARTS; do "$p"; done
