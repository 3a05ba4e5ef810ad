#!/usr/bin/env bash
# bench/resume.sh: how long a gateway on the WAL feed takes to be caught up
# again after its replication connection is killed (issue 11, "Resume"),
# at USERS keys, with a temporary slot (the default: a new slot, then every
# filter rebuilt, since what was committed meanwhile is gone with the old
# slot) and with a permanent slot (`database.slot`: resumed from its
# confirmed position, no rebuild).
#
# Runs on the throwaway primary of scripts/pg.sh (`ensure_replica_pair`,
# wal_level = logical, port 54332), never on a server it did not start. In
# a scratch database seeded with USERS users (the demo schema and config),
# for each slot kind and each of REPS repetitions: a gateway starts with
# `freshness = "wal"`, pgbench inserts users at RATE transactions a second
# throughout, the gateway's feed connection (the backend holding its
# slot) is killed with `pg_terminate_backend`, and the admin `/metrics` are read every 10 ms
# until the gateway has reconnected, applied a commit at or past the WAL
# position of the kill and, for the temporary slot, finished rebuilding
# `users`. Prints the time from the kill to that point and how many
# rebuilds of `users` it took.
#
# Environment (defaults in brackets): USERS [1000000], REPS [3], RATE [200].
set -euo pipefail
cd "$(dirname "$0")/.."
USERS=${USERS:-1000000}
REPS=${REPS:-3}
RATE=${RATE:-200}
. scripts/pg.sh
ensure_replica_pair
SERVER=$BLOOMGATE_TEST_PRIMARY_URL
DB=bloomgate_resume
URL="$SERVER/$DB"
SLOT=bloomgate_resume_bench
TOKEN=resume-bench-token-0123456789
PORT=18090 ADMIN_PORT=18091
host=${SERVER#*@}
export PGHOST=${host%:*} PGPORT=${host##*:} PGUSER=postgres
psql() { command psql -X -q -v ON_ERROR_STOP=1 "$@"; }

cargo build --locked -q --release --bin bloomgate
BIN=$PWD/target/release/bloomgate
work=$(mktemp -d)
gw="" writer=""
drop_slot() {
  psql -d postgres -Atc "SELECT pg_drop_replication_slot('$SLOT') FROM pg_replication_slots WHERE slot_name = '$SLOT'" >/dev/null || true
}
cleanup() {
  [ -n "$writer" ] && kill "$writer" 2>/dev/null && wait "$writer" 2>/dev/null
  [ -n "$gw" ] && kill "$gw" 2>/dev/null && wait "$gw" 2>/dev/null
  drop_slot
  psql -d postgres -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" || true
  rm -rf "$work"
}
trap cleanup EXIT

drop_slot
psql -d postgres -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" -c "CREATE DATABASE $DB"
echo "seeding $USERS users" >&2
DATABASE_URL="$URL?options=-c%20session_replication_role%3Dreplica" \
  "$BIN" seed --config config/bloomgate.toml --users "$USERS" --articles 1000 >&2
psql -d "$DB" -c "VACUUM ANALYZE users"
DATABASE_URL="$URL" "$BIN" install-feed --config config/bloomgate.toml >&2
cat >"$work/insert.sql" <<'EOF'
INSERT INTO users (email, name)
VALUES ('resume-' || md5(random()::text) || '@example.com', 'resume bench');
EOF

metrics() { curl -sf -H "authorization: Bearer $TOKEN" "http://127.0.0.1:$ADMIN_PORT/metrics"; }
metric() { # NAME [LABELS] -> value (0 when absent)
  metrics | awk -v m="$1${2:-}" '$1 == m {v = $2} END {printf "%.0f\n", v + 0}'
}

measure() { # temporary|permanent -> "seconds rebuilds"
  local kind=$1 slot_env=() i
  [ "$kind" = permanent ] && slot_env=(BLOOMGATE_DATABASE__SLOT="$SLOT")
  env "${slot_env[@]}" DATABASE_URL="$URL" BLOOMGATE_DATABASE__FRESHNESS=wal \
    BLOOMGATE_DATABASE__INSTALL_TRIGGERS=false \
    BLOOMGATE_SERVER__LISTEN="127.0.0.1:$PORT" BLOOMGATE_ADMIN__LISTEN="127.0.0.1:$ADMIN_PORT" \
    BLOOMGATE_ADMIN_TOKEN="$TOKEN" RUST_LOG=info \
    "$BIN" serve --config config/bloomgate.toml >"$work/gw-$kind.log" 2>&1 &
  gw=$!
  for i in $(seq 600); do
    curl -sf -o /dev/null "http://127.0.0.1:$PORT/readyz" && break
    kill -0 "$gw" 2>/dev/null || { tail -20 "$work/gw-$kind.log" >&2; exit 1; }
    sleep 0.1
  done
  pgbench -n -f "$work/insert.sql" -R "$RATE" -c 2 -j 1 -T 3600 "$DB" >/dev/null 2>&1 &
  writer=$!
  sleep 2
  local r0 b0 pid target t0 t1 r a b
  r0=$(metric bloomgate_wal_reconnects_total)
  b0=$(metric bloomgate_rebuilds_total '{resource="users"}')
  # The feed's replication connection: the walsender that holds its slot
  # (the feed's other connection only does bookkeeping).
  pid=$(psql -d postgres -Atc "SELECT pid FROM pg_stat_activity WHERE datname = '$DB' AND application_name = 'bloomgate-wal-feed' AND backend_type = 'walsender'")
  [ "$(echo "$pid" | grep -c .)" = 1 ] || { echo "not one feed connection for $DB: '$pid'" >&2; exit 1; }
  t0=$(date +%s%N)
  psql -d postgres -Atc "SELECT pg_terminate_backend($pid)" >/dev/null
  target=$(psql -d postgres -Atc "SELECT pg_current_wal_lsn() - '0/0'")
  t1=""
  for i in $(seq 12000); do
    r=$(metric bloomgate_wal_reconnects_total)
    a=$(metric bloomgate_wal_applied_lsn)
    b=$(metric bloomgate_rebuilds_total '{resource="users"}')
    if [ "$r" -gt "$r0" ] && [ "$a" -ge "$target" ] && { [ "$kind" = permanent ] || [ "$b" -gt "$b0" ]; }; then
      t1=$(date +%s%N)
      break
    fi
    sleep 0.01
  done
  [ -n "$t1" ] || { echo "$kind: not caught up within 120 s" >&2; tail -20 "$work/gw-$kind.log" >&2; exit 1; }
  kill "$writer"; wait "$writer" 2>/dev/null || true; writer=""
  kill "$gw"; wait "$gw" 2>/dev/null || true; gw=""
  [ "$kind" = permanent ] && drop_slot
  awk -v t0="$t0" -v t1="$t1" -v b="$((b - b0))" 'BEGIN {printf "%.3f %d\n", (t1 - t0) / 1e9, b}'
}

echo "kind rep seconds rebuilds" >"$work/raw.txt"
for rep in $(seq "$REPS"); do
  for kind in temporary permanent; do
    # Not in $(...): a failure inside must end the script (and its trap).
    measure "$kind" >"$work/one.txt"
    echo "$kind $rep $(cat "$work/one.txt")" | tee -a "$work/raw.txt" >&2
  done
done
echo
echo "$USERS users, writer at $RATE inserts/s, $REPS repetitions, $(nproc) cores, $(psql -d "$DB" -Atc 'SHOW server_version')"
printf '%-10s %22s %20s\n' slot "kill → caught up (s)" "rebuilds of users"
for kind in temporary permanent; do
  awk -v k="$kind" '$1 == k {s = s sep $3; sep = " / "; n += $4} END {printf "%-10s %22s %20d\n", k, s, n}' "$work/raw.txt"
done
