#!/usr/bin/env bash
# bench/auth.sh: what the access checks cost a cached hit, in gateway CPU
# per request, side by side in one run: a hit without auth, with an HS256
# token, an ES256 token and an API key whose verification is cached (warm),
# and with a token not seen before on every request (cold) for HS256,
# RS256, ES256 and EdDSA; and an API key the file does not hold, with 10
# and with 10,000 keys in the file (`apikey-unknown-10`,
# `apikey-unknown-10k`: every request refused 401, which wrk's script
# counts as `bad` and warns about; the cost is what is measured).
#
#   bench/auth.sh                       # 3 rounds of 10 s cells (~8 min on 2 cores)
#   ROUNDS=5 DURATION=20s bench/auth.sh
#   CELLS="none hs256 es256" bench/auth.sh
#   BASE_BIN=/tmp/bloomgate-base CELLS="apikey apikey-unknown-10k apikey@base apikey-unknown-10k@base" bench/auth.sh
#
# A cell named CELL@base runs CELL on the gateway binary BASE_BIN (another
# build, for a before/after in one run); BIN overrides the binary of the
# others (default: this tree's release build, built first).
#
# Every cell starts a fresh gateway (release build) on the database
# `bloomgate_authbench` (1M users, seeded once and kept), warms it by
# walking the hit keys (bench/keys.lua `hitwarm`, with the cell's warm
# credential: the rows and the verification are cached), then measures
# `hit` (10,000 keys, every request a cache hit) for DURATION: requests/s
# and the gateway's CPU (utime + stime from /proc) per request. Cells
# alternate within a round, so machine drift hits them alike; the ratio to
# the no-auth cell of the same round is printed per round.
#
# Cold cells send COUNT distinct tokens (default 20,000) in turn, each
# request the next one, through a verified-token cache of 16 entries
# (BLOOMGATE_AUTH__TOKEN_CACHE_ENTRIES=16): every request verifies a
# signature. The `verified` column checks it from the gateway's own counters
# (token cache misses per request: 1.00 cold, 0.00 warm). The last column
# is the CPU the rest of the machine used meanwhile (host busy time less
# the gateway's and wrk's), in cores: a cell above ~0.25 was disturbed.
#
# Resources (all on `users`, the same columns, so the same rows):
# /users/{id} (none), /jwt/users/{id} (auth = "jwt", scope users:read),
# /key/users/{id} (auth = "api_key", scope users:read). Ports 18090 (public)
# and 18091 (admin). Needs wrk (installed with apt-get if missing) and the
# openssl CLI (the RSA key).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3} DURATION=${DURATION:-10s} WARMUP=${WARMUP:-3s}
COUNT=${COUNT:-20000}
CELLS=${CELLS:-"none hs256 es256 apikey apikey-unknown-10 apikey-unknown-10k hs256-cold rs256-cold es256-cold eddsa-cold"}
PORT=18090 ADMIN=18091
TCK=$(getconf CLK_TCK)

. scripts/pg.sh
ensure_postgres
if ! command -v wrk >/dev/null 2>&1; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq wrk >&2
fi
# With BIN set nothing is built (a copy of a build, to compare; the
# auth_tokens example from an earlier build is used).
[ -n "${BIN:-}" ] || cargo build --locked -q --release --bin bloomgate --example auth_tokens
bin=${BIN:-target/release/bloomgate}
db="$PG_BASE_URL/bloomgate_authbench"
if ! psql "$PG_BASE_URL/postgres" -Atqc "SELECT 1 FROM pg_database WHERE datname = 'bloomgate_authbench'" | grep -q 1; then
  psql "$PG_BASE_URL/postgres" -qc "CREATE DATABASE bloomgate_authbench"
fi
DATABASE_URL=$db $bin seed --users 1000000 --articles 0 >&2

work=$(mktemp -d)
pid=""
cleanup() {
  [ -n "$pid" ] && kill "$pid" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
openssl genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:2048 -outform DER -out "$work/rsa.der" 2>/dev/null
target/release/examples/auth_tokens "$work" "$work/rsa.der" "$COUNT" 2>/dev/null
# The keys file padded to 10 and to 10,000 keys (the most a file may hold),
# by digest (the padding keys are never sent).
for n in 10 10000; do
  python3 - "$work/api-keys.toml" "$n" >"$work/api-keys-$n.toml" <<'PY'
import hashlib, os, sys
base = open(sys.argv[1]).read()
have = base.count("[[key]]")
print(base)
for i in range(int(sys.argv[2]) - have):
    print(f'[[key]]\nname = "pad{i}"\nsha256 = "{hashlib.sha256(os.urandom(16)).hexdigest()}"\n')
PY
done
cat >"$work/bench.toml" <<EOF
[database]
url = "$db"
install_triggers = false
freshness = "off"
[filter]
rebuild_interval = "0s"
[auth]
jwks_file = "$work/jwks.json"
api_keys_file = "$work/api-keys.toml"
EOF
for r in "users /users/{id} none" "users_jwt /jwt/users/{id} jwt" "users_key /key/users/{id} api_key"; do
  read -r name route auth <<<"$r"
  cat >>"$work/bench.toml" <<EOF
[[resource]]
name = "$name"
route = "$route"
table = "users"
key_column = "id"
key_type = "bigint"
columns = ["id", "name", "created_at"]
auth = "$auth"
EOF
  [ "$auth" = none ] || echo 'scopes = ["users:read"]' >>"$work/bench.toml"
done
admin_token="bench-$(od -An -N12 -tx1 /dev/urandom | tr -d ' \n')"

cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
# Busy ticks of the whole host (user, nice, system, irq, softirq, steal).
host_ticks() { awk '/^cpu / {print $2 + $3 + $4 + $7 + $8 + $9}' /proc/stat; }
misses() {
  curl -sf -H "Authorization: Bearer $admin_token" "http://127.0.0.1:$ADMIN/admin/stats" |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["auth"]["token_cache"]["misses"])'
}

cell() { # CELL -> "rps cpu_us_per_req misses_per_req other_cores"
  local c=$1 prefix=/users/ header="" tokens="" entries=65536 keys=$work/api-keys-10000.toml run=$bin
  case "$c" in
    *@base) run=${BASE_BIN:?BASE_BIN names the binary of @base cells} c=${c%@base} ;;
  esac
  case "$c" in
    none) ;;
    apikey) prefix=/key/users/ header="X-API-Key: $(cat "$work/api-key")" ;;
    apikey-unknown-*) prefix=/key/users/ header="X-API-Key: unknown-key-0123456789abcdef"
      keys=$work/api-keys-${c#apikey-unknown-}.toml
      [ "$c" = apikey-unknown-10k ] && keys=$work/api-keys-10000.toml ;;
    *-cold) prefix=/jwt/users/ entries=16 tokens="$work/${c%-cold}.cold"
      header="Authorization: Bearer $(cat "$work/${c%-cold}.warm")" ;;
    *) prefix=/jwt/users/ header="Authorization: Bearer $(cat "$work/$c.warm")" ;;
  esac
  BLOOMGATE_AUTH__JWT_SECRET=$(cat "$work/secret") BLOOMGATE_AUTH__TOKEN_CACHE_ENTRIES=$entries \
    BLOOMGATE_AUTH__API_KEYS_FILE=$keys \
    BLOOMGATE_SERVER__LISTEN=127.0.0.1:$PORT BLOOMGATE_ADMIN__LISTEN=127.0.0.1:$ADMIN \
    BLOOMGATE_ADMIN_TOKEN=$admin_token RUST_LOG=warn \
    $run serve --config "$work/bench.toml" >"$work/gateway.log" 2>&1 &
  pid=$!
  local i
  for i in $(seq 200); do
    curl -sf "http://127.0.0.1:$PORT/readyz" >/dev/null && break
    sleep 0.1
  done
  PATH_PREFIX=$prefix AUTH_HEADER=$header \
    wrk -t2 -c64 -d"$WARMUP" -s bench/keys.lua "http://127.0.0.1:$PORT" -- hitwarm 7 >/dev/null 2>&1
  local m0 m1 c0 c1 h0 h1 w out wrk_pid
  m0=$(misses)
  c0=$(cpu_ticks "$pid")
  h0=$(host_ticks)
  if [ -n "$tokens" ]; then
    PATH_PREFIX=$prefix TOKENS_FILE=$tokens \
      wrk -t2 -c64 -d"$DURATION" -s bench/keys.lua "http://127.0.0.1:$PORT" -- hit 42 >"$work/wrk.out" 2>&1 &
  else
    PATH_PREFIX=$prefix AUTH_HEADER=$header \
      wrk -t2 -c64 -d"$DURATION" -s bench/keys.lua "http://127.0.0.1:$PORT" -- hit 42 >"$work/wrk.out" 2>&1 &
  fi
  wrk_pid=$!
  sleep 1
  # wrk's own CPU, read just before it exits (its ticks grow with the run).
  while kill -0 "$wrk_pid" 2>/dev/null; do
    w=$(cpu_ticks "$wrk_pid" 2>/dev/null || echo "${w:-0}")
    sleep 0.2
  done
  wait "$wrk_pid" || true
  c1=$(cpu_ticks "$pid")
  h1=$(host_ticks)
  m1=$(misses)
  out=$(grep RESULT "$work/wrk.out")
  kill "$pid"
  wait "$pid" 2>/dev/null || true
  pid=""
  local other=$((h1 - h0 - (c1 - c0) - ${w:-0}))
  echo "$out" | awk -v c="$((c1 - c0))" -v t="$TCK" -v m="$((m1 - m0))" -v cell="$c" -v o="$other" '{
    for (i = 1; i <= NF; i++) { split($i, kv, "="); v[kv[1]] = kv[2] }
    errors = v["connect"] + v["read"] + v["write"] + v["timeout"] + v["bad"]
    if (errors > 0) printf "warning: %s: %d socket errors or statuses other than 200/404\n", cell, errors > "/dev/stderr"
    printf "%.0f %.2f %.2f %.2f\n", v["rps"], c / t * 1e6 / v["requests"], m / v["requests"], o / t / (v["duration_us"] / 1e6) }'
}

echo "| round | cell | req/s | CPU µs/req | × no auth | verified per req | other processes (cores) |"
echo "|---:|---|---:|---:|---:|---:|---:|"
for r in $(seq "$ROUNDS"); do
  base=""
  for c in $CELLS; do
    read -r rps cpu miss other <<<"$(cell "$c")"
    [ "$c" = none ] && base=$cpu
    ratio=$(awk -v a="$cpu" -v b="${base:-0}" 'BEGIN { if (b > 0) printf "%.3f", a / b; else print "-" }')
    echo "| $r | $c | $rps | $cpu | $ratio | $miss | $other |"
  done
done
