#!/usr/bin/env bash
# scripts/patroni.sh: a throwaway high-availability cluster for the failover
# tests: one etcd and two Patroni nodes (n1, n2) running PostgreSQL 15, all
# on free 127.0.0.1 ports, everything in the directory DIR the caller gives.
# The dynamic configuration declares the permanent logical slot `bloomgate`
# (pgoutput, database `bloomgate`), so Patroni keeps a copy of it on the
# replica and the WAL feed finds its slot on whichever node is promoted.
#
#   scripts/patroni.sh available        exit 0 iff patroni, patronictl, etcd
#                                       and the PostgreSQL 15 binaries exist
#   scripts/patroni.sh start DIR        start what is not running and wait
#                                       until there is a leader and the other
#                                       node streams from it and holds the
#                                       slot; prints etcd=, n1_pg=, n1_api=,
#                                       n2_pg=, n2_api=, leader=
#   scripts/patroni.sh leader DIR       prints `leader=NAME port=PORT`
#   scripts/patroni.sh switchover DIR   to the other node; prints the leader
#   scripts/patroni.sh kill-leader DIR  SIGKILL the leader's Patroni and its
#                                       PostgreSQL; prints the new leader and
#                                       promoted=yes|no
#   scripts/patroni.sh set DIR KEY=VALUE...
#                                       changes the dynamic configuration
#                                       (patronictl edit-config --set)
#   scripts/patroni.sh stop DIR [--clean]
#                                       --clean removes what start made
#                                       (and DIR, when it is left empty)
#
# Output is `key=value` lines on stdout; progress goes to stderr. Every wait
# is bounded. Environment:
#   BLOOMGATE_PATRONI_MAX_LAG        maximum_lag_on_failover in bytes, read
#                                    when the cluster is first made
#                                    (default 1048576; `set` changes it later)
#   BLOOMGATE_PATRONI_FAILOVER_WAIT  seconds kill-leader waits for a promotion
#                                    (default 60)
#   BLOOMGATE_PATRONI_PGBIN          default /usr/lib/postgresql/15/bin
#
# What Patroni 3.0.2 does with the slot (patroni/postgresql/slots.py), and
# what was seen here:
# - The primary creates it and publishes its confirmed_flush_lsn in the DCS
#   every loop. A replica that lacks it reads the slot's state file from
#   the primary (pg_read_binary_file, as the superuser), stops its
#   PostgreSQL, writes the file into pg_replslot and starts again: a
#   restart of the replica, ~2 s without it, which `start` waits out.
# - The replica then moves its copy to the published position with
#   pg_replication_slot_advance, within a second or two, but never past
#   what it has replayed. After a promotion the slot is therefore at or
#   before the fork point of the new timeline, never past it, while the
#   old primary may have confirmed past it (WAL the replica never got):
#   a consumer that resumes there with START_REPLICATION (accepted) skips
#   the new timeline's transactions that commit before that position.
# - When the copy cannot be advanced (its restart_lsn is in WAL the
#   replica lacks), Patroni copies the slot again: one more restart.
# - Patroni on PostgreSQL 14+ resumes a replay paused with
#   pg_wal_replay_pause() within a loop (unless Patroni itself is paused),
#   so pausing replay cannot make the replica lag for long.
# - A crashed primary restarts with the slot's confirmed_flush_lsn of its
#   last checkpoint: consuming alone does not save it to disk.
# - The copy serves after a failover only if hot_standby_feedback holds the
#   catalog rows back on the primary (Patroni forces it on replicas that
#   hold permanent logical slots).
set -euo pipefail

PGBIN=${BLOOMGATE_PATRONI_PGBIN:-/usr/lib/postgresql/15/bin}
NODES=(n1 n2)

log() { echo "patroni.sh: $*" >&2; }
die() { log "$*"; exit 1; }

usage() {
  sed -n '9,26p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

# PostgreSQL refuses to run as root: everything in DIR (etcd too, so one
# owner can remove it all) runs as postgres and belongs to it.
run=()
if [ "$(id -u)" -eq 0 ]; then
  run=(runuser -u postgres --)
fi

cmd_available() {
  local c
  for c in patroni patronictl etcd curl python3; do
    command -v "$c" >/dev/null 2>&1 || { log "no $c"; return 1; }
  done
  for c in postgres initdb pg_ctl pg_rewind pg_basebackup psql; do
    [ -x "$PGBIN/$c" ] || { log "no $PGBIN/$c"; return 1; }
  done
  if [ "$(id -u)" -eq 0 ] && ! id postgres >/dev/null 2>&1 && ! command -v useradd >/dev/null 2>&1; then
    log "running as root without a postgres user to run the servers as"
    return 1
  fi
}

# set_dir DIR: makes DIR absolute (the process checks below compare paths).
set_dir() {
  [ -n "${1:-}" ] || usage
  DIR=$(readlink -f "$1") || die "bad directory $1"
}

load_env() {
  [ -s "$DIR/cluster.env" ] || return 1
  # shellcheck disable=SC1091 # written by this script
  . "$DIR/cluster.env"
}

# own_pid PIDFILE NEEDLE: the pid in PIDFILE if that process still runs with
# NEEDLE (a path inside DIR) in its command line; a pid left by a process
# that is gone may name anyone by now.
own_pid() {
  local pid
  pid=$(head -n 1 "$1" 2>/dev/null) || return 1
  [ -n "$pid" ] && [ -r "/proc/$pid/cmdline" ] || return 1
  tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "$2" || return 1
  echo "$pid"
}

# exited PIDFILE NEEDLE: true once the process in PIDFILE has exited. One
# look is not proof: while the process execs its program, the kernel shows
# an empty command line (the new image's arguments are not yet in place), so
# a process that runs looks, for an instant, like one that does not. A gone
# process stays gone; three looks over a second tell the two apart.
exited() {
  local i
  for i in 1 2 3; do
    own_pid "$1" "$2" >/dev/null && return 1
    [ "$i" -lt 3 ] && sleep 0.5
  done
  return 0
}

# pg_live DATADIR: the postmaster of DATADIR, if it runs (its working
# directory is its data directory), as in scripts/pg.sh.
pg_live() {
  local pid
  pid=$(head -n 1 "$1/postmaster.pid" 2>/dev/null) || return 1
  [ -n "$pid" ] && [ "$(readlink "/proc/$pid/cwd" 2>/dev/null)" = "$1" ] || return 1
  echo "$pid"
}

# wait_gone SECONDS PID...: true once none of them runs.
wait_gone() {
  local deadline=$((SECONDS + $1)) p alive
  shift
  while :; do
    alive=0
    for p in "$@"; do
      # A zombie has exited; its parent (runuser) reaps it soon.
      if [ -e "/proc/$p" ] && ! grep -q '^State:.*Z' "/proc/$p/status" 2>/dev/null; then alive=1; fi
    done
    [ "$alive" -eq 0 ] && return 0
    [ "$SECONDS" -ge "$deadline" ] && return 1
    sleep 0.2
  done
}

node_pg() { local v="${1^^}_PG"; echo "${!v}"; }
node_api() { local v="${1^^}_API"; echo "${!v}"; }
other_node() { [ "$1" = n1 ] && echo n2 || echo n1; }

# psql_at PORT SQL: one value, or failure; never waits long (a server in
# the middle of a restart or a promotion answers quickly or not at all).
psql_at() {
  psql_db "$1" postgres "$2"
}

psql_db() {
  PGCONNECT_TIMEOUT=3 PGOPTIONS="-c statement_timeout=5000" \
    "$PGBIN/psql" -X -qAt -h 127.0.0.1 -p "$1" -U postgres -d "$2" -c "$3" 2>/dev/null
}

api_code() {
  curl -s -o /dev/null -w '%{http_code}' --max-time 2 "http://127.0.0.1:$(node_api "$1")/$2" 2>/dev/null || true
}

# writable NODE: Patroni holds the leader key for it (GET /primary answers
# 200 only then) and its PostgreSQL has left recovery: it takes writes.
writable() {
  [ "$(api_code "$1" primary)" = 200 ] && [ "$(psql_at "$(node_pg "$1")" \
    "SELECT NOT pg_is_in_recovery() AND current_setting('transaction_read_only') = 'off'")" = t ]
}

# find_leader: the name of the node that takes writes, if one does. It is
# noted in DIR/last_leader: see cmd_start.
find_leader() {
  local n
  for n in "${NODES[@]}"; do
    if writable "$n"; then
      echo "$n" >"$DIR/last_leader"
      echo "$n"
      return 0
    fi
  done
  return 1
}

# replica_ready NODE: streams from the primary and holds the slot (Patroni
# copied it, restarting this replica once).
replica_ready() {
  [ "$(psql_at "$(node_pg "$1")" "SELECT (SELECT count(*) FROM pg_stat_wal_receiver WHERE status = 'streaming') || ',' || (SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'bloomgate')")" = "1,1" ]
}

write_configs() {
  local ports n lag=${BLOOMGATE_PATRONI_MAX_LAG:-1048576}
  ports=$(python3 -c '
import socket
ss = [socket.socket() for _ in range(6)]
for s in ss: s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in ss))')
  read -r ETCD_PORT ETCD_PEER N1_PG N1_API N2_PG N2_API <<<"$ports"
  cat >"$DIR/cluster.env" <<EOF
ETCD_PORT=$ETCD_PORT
ETCD_PEER=$ETCD_PEER
N1_PG=$N1_PG
N1_API=$N1_API
N2_PG=$N2_PG
N2_API=$N2_API
EOF
  # Patroni runs it once, on the node that bootstraps, with a connection
  # string as its last argument: the slot's database must exist before the
  # primary can make the slot (it retries every loop until then).
  cat >"$DIR/post_bootstrap.sh" <<EOF
#!/bin/sh
exec "$PGBIN/psql" -X -q -v ON_ERROR_STOP=1 -c 'CREATE DATABASE bloomgate' "\$1"
EOF
  chmod 755 "$DIR/post_bootstrap.sh"
  for n in "${NODES[@]}"; do
    mkdir -p "$DIR/$n"
    # loop_wait 1 and ttl 10: a failover within seconds; ttl stays above
    # loop_wait + 2 * retry_timeout, or a slow etcd request would cost the
    # leader its key. pgpass and the socket directory are set so that
    # nothing outside DIR is written (the postgres user's home holds the
    # system cluster's files).
    cat >"$DIR/$n.yml" <<EOF
scope: bloomgate
name: $n
restapi:
  listen: 127.0.0.1:$(node_api "$n")
  connect_address: 127.0.0.1:$(node_api "$n")
etcd3:
  host: 127.0.0.1:$ETCD_PORT
watchdog:
  mode: 'off'
bootstrap:
  dcs:
    ttl: 10
    loop_wait: 1
    retry_timeout: 4
    maximum_lag_on_failover: $lag
    postgresql:
      use_pg_rewind: true
      use_slots: true
      parameters:
        wal_level: logical
        hot_standby_feedback: 'on'
        max_replication_slots: 10
        max_wal_senders: 10
        max_connections: 200
        fsync: 'off'
        wal_log_hints: 'on'
    slots:
      bloomgate:
        type: logical
        database: bloomgate
        plugin: pgoutput
  initdb:
    - encoding: UTF8
  post_bootstrap: $DIR/post_bootstrap.sh
postgresql:
  listen: 127.0.0.1:$(node_pg "$n")
  connect_address: 127.0.0.1:$(node_pg "$n")
  data_dir: $DIR/$n/data
  bin_dir: $PGBIN
  pgpass: $DIR/$n/pgpass
  # A spread checkpoint on the primary would hold the replica's
  # pg_basebackup for minutes.
  basebackup:
    - checkpoint: fast
  authentication:
    superuser:
      username: postgres
    replication:
      username: replicator
    rewind:
      username: postgres
  parameters:
    unix_socket_directories: ''
  pg_hba:
    - local all all trust
    - host all all 127.0.0.1/32 trust
    - host replication all 127.0.0.1/32 trust
EOF
  done
}

# spawn PIDFILE LOG COMMAND...: runs COMMAND in DIR as the servers' user, in
# a session of its own, detached from the caller's stdout (a test reading
# this script's output until its end would wait for the cluster's end).
spawn() {
  local pidfile=$1 logfile=$2
  shift 2
  setsid "${run[@]}" sh -c 'cd "$1" && echo $$ >"$2" && shift 2 && exec "$@"' sh "$DIR" "$pidfile" "$@" \
    </dev/null >>"$logfile" 2>&1 &
}

start_etcd() {
  if own_pid "$DIR/etcd.pid" "--data-dir $DIR/etcd " >/dev/null; then return 0; fi
  log "starting etcd on 127.0.0.1:$ETCD_PORT"
  rm -f "$DIR/etcd.pid"
  spawn "$DIR/etcd.pid" "$DIR/etcd.log" etcd --name bloomgate --data-dir "$DIR/etcd" \
    --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls "http://127.0.0.1:$ETCD_PEER" --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER" \
    --initial-cluster "bloomgate=http://127.0.0.1:$ETCD_PEER" --initial-cluster-token "bloomgate-$ETCD_PEER" \
    --log-level warn
  local deadline=$((SECONDS + 30))
  until curl -s --max-time 2 "http://127.0.0.1:$ETCD_PORT/health" 2>/dev/null | grep -q '"health":"true"'; do
    # Gone already (its port taken, say): its log says why.
    if [ -s "$DIR/etcd.pid" ] && exited "$DIR/etcd.pid" "--data-dir $DIR/etcd " || [ "$SECONDS" -ge "$deadline" ]; then
      tail -n 20 "$DIR/etcd.log" >&2
      die "etcd did not start"
    fi
    sleep 0.2
  done
}

start_node() {
  local n=$1
  if own_pid "$DIR/$n/patroni.pid" "$DIR/$n.yml" >/dev/null; then return 0; fi
  log "starting Patroni $n (PostgreSQL on 127.0.0.1:$(node_pg "$n"), REST API on $(node_api "$n"))"
  rm -f "$DIR/$n/patroni.pid"
  spawn "$DIR/$n/patroni.pid" "$DIR/$n/patroni.log" patroni "$DIR/$n.yml"
}

# wait_for SECONDS WHAT COMMAND...: polls COMMAND; on timeout prints the end
# of every log in DIR and fails.
wait_for() {
  local deadline=$((SECONDS + $1)) what=$2 n
  shift 2
  until "$@"; do
    if [ "$SECONDS" -ge "$deadline" ]; then
      for n in "${NODES[@]}"; do
        [ -s "$DIR/$n/patroni.log" ] && { log "the end of $n's Patroni log:"; tail -n 15 "$DIR/$n/patroni.log" >&2; }
      done
      die "timed out waiting for $what"
    fi
    sleep 0.3
  done
}

# copy_usable NODE: the WAL segment holding the restart_lsn of NODE's slot
# is in NODE's pg_wal (any timeline), so the slot can be decoded or
# advanced there.
copy_usable() {
  [ "$(psql_at "$(node_pg "$1")" "WITH c AS (SELECT setting::bigint AS seg FROM pg_settings WHERE name = 'wal_segment_size'),
      s AS (SELECT pg_wal_lsn_diff(restart_lsn, '0/0')::bigint / c.seg AS segno, c.seg FROM pg_replication_slots, c WHERE slot_name = 'bloomgate')
    SELECT EXISTS (SELECT 1 FROM pg_ls_waldir() w, s WHERE w.name ~ '^[0-9A-F]{24}\$'
      AND ('x' || substr(w.name, 9, 8))::bit(32)::bigint * (4294967296 / s.seg) + ('x' || substr(w.name, 17, 8))::bit(32)::bigint = s.segno)")" = t ]
}

# replica_settled LEADER: the other node streams and holds a copy of the
# slot that has caught up with the leader's, can be advanced, and has not
# been restarted for it in the last seconds.
replica_settled() {
  local r p
  r=$(other_node "$1")
  p=$(node_pg "$r")
  replica_ready "$r" && copy_usable "$r" \
    && [ "$(psql_at "$p" "SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = 'bloomgate'")" \
      = "$(psql_at "$(node_pg "$1")" "SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = 'bloomgate'")" ] \
    && [ "$(psql_at "$p" "SELECT now() - pg_postmaster_start_time() > interval '3 s'")" = t ]
}

# settle_slot LEADER: once, on a new cluster, after the replica's first
# copy of the slot. The primary made the slot right after initdb; the
# replica's pg_basebackup starts in a later WAL segment (it switches
# segments), so its copy's restart_lsn is in WAL it never holds and
# pg_replication_slot_advance fails there. Patroni then copies the slot
# again, restarting the replica, each time until the primary's restart_lsn
# has moved into WAL the replica has: left alone, that happens when the
# tests first consume the slot (seen: three restarts, ~2 s each without a
# replica, after `start` had returned). Here the database is still empty
# (nothing to decode), so the slot is moved to the end of WAL now, past a
# checkpoint's running-xacts record (where decoding may restart), and the
# replica's restarts happen before `start` returns.
settle_slot() {
  local p
  p=$(node_pg "$1")
  psql_at "$p" "CHECKPOINT" >/dev/null || die "CHECKPOINT failed on $1"
  psql_db "$p" bloomgate "SELECT pg_replication_slot_advance('bloomgate', pg_current_wal_lsn())" >/dev/null \
    || die "could not advance slot bloomgate on $1"
}

# running NODE...: dies, with the end of its log, if the Patroni of one of
# them has exited (a port taken since, say): waiting on would only time out.
# No pid yet is a Patroni still being spawned.
running() {
  local n
  for n in "$@"; do
    [ -s "$DIR/$n/patroni.pid" ] || continue
    if exited "$DIR/$n/patroni.pid" "$DIR/$n.yml"; then
      log "Patroni $n has exited; the end of its log:"
      tail -n 20 "$DIR/$n/patroni.log" >&2
      die "Patroni $n is not running"
    fi
  done
}

first_up() {
  running "$1"
  writable "$1"
}

cluster_ready() {
  local l
  running "${NODES[@]}"
  l=$(find_leader) || return 1
  replica_ready "$(other_node "$l")"
}

cmd_start() {
  cmd_available || die "missing binaries (see above)"
  [[ ${BLOOMGATE_PATRONI_MAX_LAG:-0} =~ ^[0-9]+$ ]] || die "BLOOMGATE_PATRONI_MAX_LAG is not a number of bytes"
  mkdir -p "$1"
  set_dir "$1"
  local began=$SECONDS
  if [ "$(id -u)" -eq 0 ]; then
    id postgres >/dev/null 2>&1 || useradd --system --no-create-home postgres
    chown postgres "$DIR"
    chmod 700 "$DIR"
    "${run[@]}" test -w "$DIR" || die "user postgres cannot write $DIR (a parent directory closed to it?)"
  fi
  if ! load_env; then
    write_configs
    [ "$(id -u)" -eq 0 ] && chown -R postgres "$DIR"
  fi
  # With no leader, the last one starts alone and is waited for: started
  # together, the nodes race for the leader key, and Patroni 3.0.2 gives it
  # to the highest WAL position whatever its timeline. A leader killed
  # after a failover has the higher one (the WAL the replica never got),
  # and won it once: promoted on a timeline of its own, it left the other
  # node following a history that was not its own, unable to stream.
  # On a new cluster the first node bootstraps alone: the tests want n1 as
  # the first leader.
  local first=n1 second
  [ -s "$DIR/last_leader" ] && first=$(cat "$DIR/last_leader")
  second=$(other_node "$first")
  start_etcd
  start_node "$first"
  if ! find_leader >/dev/null; then
    wait_for 120 "$first to become the leader" first_up "$first"
  fi
  start_node "$second"
  wait_for 180 "a leader and a streaming replica holding slot bloomgate" cluster_ready
  local l
  l=$(find_leader) || die "the leader went away"
  if [ ! -e "$DIR/slot_settled" ]; then
    settle_slot "$l"
    wait_for 60 "the replica's copy of slot bloomgate to settle" replica_settled "$l"
    touch "$DIR/slot_settled"
  elif ! copy_usable "$(other_node "$l")"; then
    log "the replica's copy of slot bloomgate starts in WAL it does not hold: Patroni will copy it again, restarting the replica, when the slot is first consumed"
  fi
  log "ready in $((SECONDS - began)) s"
  echo "etcd=127.0.0.1:$ETCD_PORT"
  echo "n1_pg=$N1_PG"
  echo "n1_api=$N1_API"
  echo "n2_pg=$N2_PG"
  echo "n2_api=$N2_API"
  echo "leader=$l"
}

cmd_leader() {
  set_dir "$1"
  load_env || die "no cluster in $DIR"
  local l
  if l=$(find_leader); then
    echo "leader=$l port=$(node_pg "$l")"
  else
    echo "leader=none"
    return 1
  fi
}

cmd_switchover() {
  set_dir "$1"
  load_env || die "no cluster in $DIR"
  local l c began=$SECONDS
  l=$(find_leader) || die "no leader to switch over from"
  c=$(other_node "$l")
  log "switching over from $l to $c"
  timeout 90 patronictl -c "$DIR/n1.yml" switchover --leader "$l" --candidate "$c" --force >&2 \
    || die "patronictl switchover failed"
  wait_for 60 "$c to take writes" writable "$c"
  echo "$c" >"$DIR/last_leader"
  log "switched over in $((SECONDS - began)) s"
  echo "leader=$c port=$(node_pg "$c")"
}

# kill_node NODE: a crash: Patroni, then its postmaster and every child of
# it at once, SIGKILL (no shutdown checkpoint, no leader key released).
kill_node() {
  local n=$1 pids=() p
  p=$(own_pid "$DIR/$n/patroni.pid" "$DIR/$n.yml") && pids+=("$p")
  if p=$(pg_live "$DIR/$n/data"); then
    pids+=("$p")
    # Children first looked up, then all killed: a child of a dead
    # postmaster is no longer found by its parent.
    pids+=($(ps -o pid= --ppid "$p" || true))
  fi
  [ "${#pids[@]}" -gt 0 ] || return 0
  kill -KILL "${pids[@]}" 2>/dev/null || true
  wait_gone 10 "${pids[@]}" || log "some processes of $n survive SIGKILL: ${pids[*]}"
}

cmd_kill_leader() {
  set_dir "$1"
  load_env || die "no cluster in $DIR"
  local l c began wait=${BLOOMGATE_PATRONI_FAILOVER_WAIT:-60}
  l=$(find_leader) || die "no leader to kill"
  c=$(other_node "$l")
  log "killing the leader $l (SIGKILL: Patroni and PostgreSQL)"
  kill_node "$l"
  began=$SECONDS
  # Its leader key lives out its ttl first; the replica is then promoted
  # unless it lags the last position the leader published by more than
  # maximum_lag_on_failover, in which case nobody is.
  local deadline=$((SECONDS + wait))
  until writable "$c"; do
    if [ "$SECONDS" -ge "$deadline" ]; then
      log "$c was not promoted in $wait s; the end of its Patroni log:"
      tail -n 10 "$DIR/$c/patroni.log" >&2
      echo "killed=$l"
      echo "promoted=no"
      echo "leader=none"
      return 0
    fi
    sleep 0.3
  done
  echo "$c" >"$DIR/last_leader"
  log "$c promoted $((SECONDS - began)) s after the kill"
  echo "killed=$l"
  echo "promoted=yes"
  echo "leader=$c port=$(node_pg "$c")"
}

cmd_set() {
  set_dir "$1"
  shift
  load_env || die "no cluster in $DIR"
  [ $# -gt 0 ] || usage
  local a args=()
  for a in "$@"; do args+=(--set "$a"); done
  timeout 30 patronictl -c "$DIR/n1.yml" edit-config --force "${args[@]}" >&2 || die "patronictl edit-config failed"
  # Every node reads the new value in its next loop.
  sleep 2
  echo "set=$*"
}

# stop_node NODE: Patroni stops its own PostgreSQL on SIGTERM; whatever
# still runs after a bounded wait (or was left by a killed Patroni) is
# stopped immediately.
stop_node() {
  local n=$1 pid pm kids
  if pid=$(own_pid "$DIR/$n/patroni.pid" "$DIR/$n.yml"); then
    log "stopping Patroni $n"
    local t0=$SECONDS
    kill -TERM "$pid" 2>/dev/null || true
    wait_gone 40 "$pid" || { log "Patroni $n ignores SIGTERM: killing it"; kill -KILL "$pid" 2>/dev/null || true; wait_gone 5 "$pid" || true; }
    log "Patroni $n stopped in $((SECONDS - t0)) s"
  fi
  if pm=$(pg_live "$DIR/$n/data"); then
    log "stopping the PostgreSQL of $n"
    if ! "${run[@]}" "$PGBIN/pg_ctl" -D "$DIR/$n/data" -m immediate -t 20 stop >&2; then
      kids=$(ps -o pid= --ppid "$pm" || true)
      # shellcheck disable=SC2086 # a list of pids
      kill -KILL "$pm" $kids 2>/dev/null || true
      wait_gone 10 "$pm" || log "the PostgreSQL of $n ($pm) does not stop"
    fi
  fi
}

cmd_stop() {
  local clean=0 a dirarg=""
  for a in "$@"; do
    case "$a" in
      --clean) clean=1 ;;
      *) [ -z "$dirarg" ] || usage; dirarg=$a ;;
    esac
  done
  [ -n "$dirarg" ] || usage
  [ -d "$dirarg" ] || { log "no $dirarg: nothing to stop"; echo "stopped=$dirarg"; return 0; }
  set_dir "$dirarg"
  local order=("${NODES[@]}") l pid
  # The replica first: with the leader gone first it would be promoted,
  # only to be stopped in the middle of it.
  if load_env && l=$(find_leader); then order=("$(other_node "$l")" "$l"); fi
  for a in "${order[@]}"; do stop_node "$a"; done
  if pid=$(own_pid "$DIR/etcd.pid" "--data-dir $DIR/etcd "); then
    log "stopping etcd"
    kill -TERM "$pid" 2>/dev/null || true
    wait_gone 20 "$pid" || { kill -KILL "$pid" 2>/dev/null || true; wait_gone 5 "$pid" || true; }
  fi
  if [ "$clean" -eq 1 ]; then
    rm -rf "$DIR/etcd" "$DIR/n1" "$DIR/n2" "$DIR/n1.yml" "$DIR/n2.yml" "$DIR/cluster.env" \
      "$DIR/post_bootstrap.sh" "$DIR/etcd.log" "$DIR/etcd.pid" "$DIR/last_leader" "$DIR/slot_settled"
    rmdir "$DIR" 2>/dev/null || true
  fi
  echo "stopped=$DIR"
}

case "${1:-}" in
  available) [ $# -eq 1 ] || usage; cmd_available ;;
  start) [ $# -eq 2 ] || usage; cmd_start "$2" ;;
  leader) [ $# -eq 2 ] || usage; cmd_leader "$2" ;;
  switchover) [ $# -eq 2 ] || usage; cmd_switchover "$2" ;;
  kill-leader) [ $# -eq 2 ] || usage; cmd_kill_leader "$2" ;;
  set) shift; cmd_set "$@" ;;
  stop) shift; cmd_stop "$@" ;;
  *) usage ;;
esac
