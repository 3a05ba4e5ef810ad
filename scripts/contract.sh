#!/usr/bin/env bash
# The outside checks, against the live gateway on demo data:
#   - Schemathesis (every check, its default) on the public document, without
#     a credential and with a valid bearer token (the shipped config's private
#     profile switched on: auth, scopes, owner, rate limit; CORS on for one
#     origin, whose preflight is checked too), and, with the admin token, on
#     the admin one: zero failures;
#   - REDbot on a 200 (with its own If-None-Match revalidation: the 304), a
#     200 large enough to be compressed (with REDbot's gzip negotiation), a
#     filtered 404, a negative 404 and a 503: no note of level BAD or WARN.
# Both tools are pinned and installed with pip into a virtualenv under
# target/; their reports go to target/test-artifacts/. Everything runs on
# 127.0.0.1, seeded and bounded. Part of scripts/test.sh (the README's test
# command); alone: scripts/contract.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
SCHEMATHESIS=4.32.5
REDBOT=2.7.1
venv=target/contract-venv
art=target/test-artifacts
mkdir -p "$art"

log() { echo "contract.sh: $*" >&2; }

have_st=$("$venv/bin/schemathesis" --version 2>/dev/null || true)
have_rb=$("$venv/bin/pip" show redbot 2>/dev/null || true)
if [[ "$have_st" != *" $SCHEMATHESIS" || "$have_rb" != *"Version: $REDBOT"* ]]; then
  log "installing schemathesis $SCHEMATHESIS and redbot $REDBOT into $venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q "schemathesis==$SCHEMATHESIS" "redbot==$REDBOT" >&2
fi

. scripts/pg.sh
ensure_postgres
cargo build --locked -q --bin bloomgate
bin=target/debug/bloomgate

db="bloomgate_contract_$$"
psql "$PG_BASE_URL/postgres" -qc "CREATE DATABASE \"$db\""
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  psql "$PG_BASE_URL/postgres" -qc "DROP DATABASE IF EXISTS \"$db\" WITH (FORCE)" || true
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
public=$(free_port); admin=$(free_port); down=$(free_port)
token="contract-$(od -An -N12 -tx1 /dev/urandom | tr -d ' \n')"
# The shipped config with its private profile (/me/{id}: a bearer JWT,
# scope users:read, the owner's row only, a rate limit) switched on.
cfg="$art/contract-config.toml"
{
  cat config/bloomgate.toml
  sed -n '/^# >>> private profile/,/^# <<< private profile/p' config/bloomgate.toml |
    grep -v '^# [<>]\{3\}' | sed 's/^# \{0,1\}//'
} >"$cfg"
export BLOOMGATE_AUTH__JWT_SECRET="contract-$(od -An -N24 -tx1 /dev/urandom | tr -d ' \n')"

export DATABASE_URL="$PG_BASE_URL/$db"
$bin migrate >&2
$bin seed --users 500 --articles 100 >&2
# One row large enough to be stored compressed (cache.compress_min_bytes):
# REDbot checks its gzip negotiation, Vary and per-coding ETag too.
article=$(psql "$DATABASE_URL" -Atqc "UPDATE articles SET body = repeat('All work and no play. ', 100)
  WHERE id = md5('article-1')::uuid RETURNING id")
# With CORS on for one origin: every answer Schemathesis checks says
# Vary: Origin, and the document describes it.
origin=https://app.example.com
BLOOMGATE_ADMIN_TOKEN=$token BLOOMGATE_SERVER__LISTEN=127.0.0.1:$public \
  BLOOMGATE_SERVER__CORS__ALLOW_ORIGINS=$origin \
  BLOOMGATE_ADMIN__LISTEN=127.0.0.1:$admin $bin serve --config "$cfg" >"$art/contract-gateway.log" 2>&1 &
pids+=($!)
# A second gateway whose database never answers: its lookups are 503.
DATABASE_URL="postgres://postgres@127.0.0.1:$(free_port)/nowhere" \
  BLOOMGATE_SERVER__LISTEN=127.0.0.1:$down BLOOMGATE_DATABASE__MIGRATE=false \
  $bin serve >"$art/contract-gateway-down.log" 2>&1 &
pids+=($!)

for _ in $(seq 1 300); do
  curl -sf "http://127.0.0.1:$public/readyz" >/dev/null && break
  sleep 0.1
done
curl -sf "http://127.0.0.1:$public/readyz" >/dev/null || { log "gateway not ready"; cat "$art/contract-gateway.log" >&2; exit 1; }
curl -s -o /dev/null "http://127.0.0.1:$down/healthz" || sleep 1

fail=0
st() {
  "$venv/bin/schemathesis" --config-file scripts/schemathesis.toml run "$@" \
    --max-examples "${CONTRACT_MAX_EXAMPLES:-30}" --seed 42 --request-timeout 10 \
    --no-color
}
log "schemathesis: public document"
st "http://127.0.0.1:$public/openapi.json" >"$art/schemathesis-public.txt" 2>&1 || fail=1
tail -n 4 "$art/schemathesis-public.txt" >&2
# The same with a valid token (the owner of user 42, scope users:read): the
# private profile's 200s, its owner 404s and its 429s are checked too.
jwt=$($bin mint-token --config "$cfg" --sub 42 --scope users:read --ttl 1h)
log "schemathesis: public document, with a bearer token"
st "http://127.0.0.1:$public/openapi.json" -H "Authorization: Bearer $jwt" \
  >"$art/schemathesis-public-token.txt" 2>&1 || fail=1
tail -n 4 "$art/schemathesis-public-token.txt" >&2
code=$(curl -s -o /dev/null -w '%{http_code}' -H "Authorization: Bearer $jwt" "http://127.0.0.1:$public/me/42")
[ "$code" = 200 ] || { log "the token's own row /me/42 answered $code, not 200"; fail=1; }
# A browser's preflight, without the token, of the private profile: 204
# with the origin; any other OPTIONS is the 405 the document declares.
pre=$(curl -s -o /dev/null -w '%{http_code} %header{access-control-allow-origin}' -X OPTIONS \
  -H "Origin: $origin" -H 'Access-Control-Request-Method: GET' -H 'Access-Control-Request-Headers: authorization' \
  "http://127.0.0.1:$public/me/42")
[ "$pre" = "204 $origin" ] || { log "the preflight of /me/42 answered '$pre', not '204 $origin'"; fail=1; }
code=$(curl -s -o /dev/null -w '%{http_code}' -X OPTIONS "http://127.0.0.1:$public/me/42")
[ "$code" = 405 ] || { log "OPTIONS /me/42 without Origin answered $code, not 405"; fail=1; }
log "schemathesis: admin document"
st "http://127.0.0.1:$admin/admin/openapi.json" -H "Authorization: Bearer $token" \
  >"$art/schemathesis-admin.txt" 2>&1 || fail=1
tail -n 4 "$art/schemathesis-admin.txt" >&2

# A row deleted with the triggers off stays in the filter until the next
# rebuild: a lookup passes the filter and finds nothing (a negative 404).
psql "$DATABASE_URL" -qc "ALTER TABLE users DISABLE TRIGGER USER; DELETE FROM users WHERE id = 321; ALTER TABLE users ENABLE TRIGGER USER"
redbot_check() {
  local name=$1 url=$2 want=$3
  "$venv/bin/redbot" -o har "$url" >"$art/redbot-$name.har"
  python3 - "$art/redbot-$name.har" "$want" "$name" <<'PY' || fail=1
import json, sys
har, want, name = json.load(open(sys.argv[1])), int(sys.argv[2]), sys.argv[3]
entry = har["log"]["entries"][0]
status = entry["response"]["status"]
notes = entry.get("_red_messages", [])
with open(sys.argv[1].replace(".har", ".txt"), "w") as out:
    for n in notes:
        out.write(f"{n['level']:5} {n['summary']}\n")
bad = [n for n in notes if n["level"].upper() in ("BAD", "WARN", "WARNING")]
print(f"redbot {name}: {status}, {len(notes)} notes, {len(bad)} bad or warning", file=sys.stderr)
for n in bad:
    print(f"  {n['level']}: {n['summary']}", file=sys.stderr)
if status != want:
    print(f"  expected status {want}", file=sys.stderr)
sys.exit(1 if bad or status != want else 0)
PY
}
log "redbot"
redbot_check row "http://127.0.0.1:$public/users/42" 200
redbot_check compressed "http://127.0.0.1:$public/articles/$article" 200
grep -q "Content negotiation for gzip compression is supported" "$art/redbot-compressed.txt" \
  || { log "redbot: the large row was not served gzip-compressed on request"; fail=1; }
redbot_check filtered "http://127.0.0.1:$public/users/987654321" 404
redbot_check negative "http://127.0.0.1:$public/users/321" 404
redbot_check unavailable "http://127.0.0.1:$down/users/1" 503
redbot_check unauthorized "http://127.0.0.1:$public/me/42" 401
# The 304: REDbot revalidates the 200 with its ETag and notes the result.
grep -q "If-None-Match conditional requests are supported" "$art/redbot-row.txt" \
  || { log "redbot: the 200's If-None-Match revalidation did not give a 304"; fail=1; }

if [ "$fail" -ne 0 ]; then
  log "FAILED (reports in $art/)"
  exit 1
fi
log "ok: schemathesis and redbot found nothing (reports in $art/)"
