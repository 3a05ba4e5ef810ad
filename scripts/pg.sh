# Sourced by the other scripts: makes sure a PostgreSQL server is reachable
# and exports PG_BASE_URL (postgres://user@host:port, no database).
#
# 1. A server already on $PGHOST_BG:$PGPORT_BG (default 127.0.0.1:5432)
#    answering pg_isready is used as it is (user postgres, trust auth).
# 2. Otherwise a throwaway cluster is started from the local PostgreSQL
#    binaries on 127.0.0.1:${BLOOMGATE_PG_PORT:-54329}, in
#    ${BLOOMGATE_PG_DIR:-/tmp/bloomgate-pg}; the `postgresql` package is
#    installed first if no binaries are found. It keeps running for the next
#    command; stop it with `scripts/pg.sh stop`.

bg_pg_log() { echo "pg.sh: $*" >&2; }

# Every server below is a throwaway this script made, in a directory of its
# own; a run may end without stopping them (a CI job cancelled, a machine
# stopped under a session), and the next run on the machine starts them
# again. Two rules make that start dependable:
# - fsync=off on every one of them: PostgreSQL fsyncs the whole data
#   directory before it replays a crash, unless fsync is off (minutes, for
#   a replica that has replayed a long run's databases), and a throwaway
#   server has no data to keep.
# - a throwaway server that will not start is made anew (bg_pg_up): it
#   holds nothing a test needs, and a run that reports its log instead
#   fails every test for a server's sake. Not when the cause is elsewhere:
#   a postmaster of that directory still running (another run's start, a
#   crash replay) is waited for, a port someone else holds fails the run,
#   and a pid file left by a killed server is never used to signal anyone
#   (after a machine's restart its pid may name any process).

# bg_pg_start BINDIR DIR OPTIONS [RUNNER...]: starts the server whose data
# is in DIR and waits until it accepts connections (its crash replay
# included); prints the end of its log when it does not.
bg_pg_start() {
  local bindir=$1 dir=$2 opts=$3
  shift 3
  "$@" "$bindir/pg_ctl" -D "$dir" -w -t 300 -l "$dir/server.log" -o "$opts" start >&2 && return 0
  bg_pg_log "the server in $dir did not start; the end of its log:"
  tail -n 20 "$dir/server.log" >&2 2>/dev/null || true
  return 1
}

# bg_pg_live DIR: the pid in DIR's postmaster.pid, if that process is a
# postmaster of DIR (a postmaster's working directory is its data
# directory); nothing otherwise.
bg_pg_live() {
  local dir=$1 pid
  pid=$(head -n 1 "$dir/postmaster.pid" 2>/dev/null) || return 1
  [ -n "$pid" ] && [ "$(readlink "/proc/$pid/cwd" 2>/dev/null)" = "$(readlink -f "$dir")" ] || return 1
  echo "$pid"
}

# bg_pg_discard BINDIR DIR [RUNNER...]: stops the server in DIR if one of
# DIR's own runs (immediately: its data is about to go), and removes DIR.
# Fails, keeping DIR, if that server does not stop.
bg_pg_discard() {
  local bindir=$1 dir=$2
  shift 2
  if bg_pg_live "$dir" >/dev/null; then
    "$@" "$bindir/pg_ctl" -D "$dir" -m immediate -t 60 stop >/dev/null 2>&1 \
      || { bg_pg_log "the server in $dir does not stop; it is kept"; return 1; }
  fi
  rm -rf "$dir"
}

# bg_pg_up BINDIR DIR OPTIONS MAKE [RUNNER...]: starts the throwaway server
# in DIR (OPTIONS begin with `-p PORT`); MAKE (a function, which sees the
# caller's locals) makes its data directory first when there is none.
# When a server that was already there does not start: a postmaster of
# DIR still running is waited for; a port held by another process fails;
# a pid file naming no postmaster of DIR is removed and the start tried
# again; only then is the server discarded, made again and started once
# more.
bg_pg_up() {
  local bindir=$1 dir=$2 opts=$3 make=$4 made=0 port
  shift 4
  port=${opts#-p }
  port=${port%% *}
  if [ ! -s "$dir/PG_VERSION" ]; then
    "$make" || return 1
    made=1
  fi
  bg_pg_start "$bindir" "$dir" "$opts" "$@" && return 0
  [ "$made" -eq 1 ] && return 1
  if bg_pg_live "$dir" >/dev/null; then
    bg_pg_log "a postmaster of $dir runs: waiting for it to accept connections"
    "$bindir/pg_isready" -U postgres -q -t 300 -h 127.0.0.1 -p "$port"
    return
  fi
  if tail -n 20 "$dir/server.log" 2>/dev/null | grep -q "could not bind\|Address already in use"; then
    bg_pg_log "port $port is held by another process: $dir is kept"
    return 1
  fi
  if [ -e "$dir/postmaster.pid" ]; then
    bg_pg_log "removing the pid file a killed server left in $dir"
    rm -f "$dir/postmaster.pid"
    bg_pg_start "$bindir" "$dir" "$opts" "$@" && return 0
  fi
  bg_pg_log "making the throwaway server in $dir anew"
  bg_pg_discard "$bindir" "$dir" "$@" || return 1
  "$make" || return 1
  bg_pg_start "$bindir" "$dir" "$opts" "$@"
}

# bg_pg_init BINDIR DIR [RUNNER...]: a new, empty cluster in DIR.
bg_pg_init() {
  local bindir=$1 dir=$2
  shift 2
  rm -rf "$dir" && mkdir -p "$dir"
  [ "$(id -u)" -eq 0 ] && chown postgres "$dir"
  "$@" "$bindir/initdb" -D "$dir" -U postgres --auth=trust -E UTF8 >"$dir.initdb.log" 2>&1 \
    || { cat "$dir.initdb.log" >&2; return 1; }
}

bg_pg_bindir() {
  local d
  d=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)
  if [ -z "$d" ] && command -v initdb >/dev/null 2>&1; then
    d=$(dirname "$(readlink -f "$(command -v initdb)")")
  fi
  echo "$d"
}

bg_pg_install() {
  bg_pg_log "no PostgreSQL binaries found; installing the postgresql package"
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq postgresql >&2
}

ensure_postgres() {
  local host=${PGHOST_BG:-127.0.0.1} port=${PGPORT_BG:-5432}
  if command -v pg_isready >/dev/null 2>&1 && pg_isready -U postgres -q -h "$host" -p "$port"; then
    export PG_BASE_URL="postgres://postgres@$host:$port"
    return 0
  fi
  local bindir
  bindir=$(bg_pg_bindir)
  if [ -z "$bindir" ] || [ ! -x "$bindir/initdb" ]; then
    bg_pg_install || return 1
    bindir=$(bg_pg_bindir)
  fi
  local dir=${BLOOMGATE_PG_DIR:-/tmp/bloomgate-pg} tport=${BLOOMGATE_PG_PORT:-54329}
  export PG_BASE_URL="postgres://postgres@127.0.0.1:$tport"
  if "$bindir/pg_isready" -U postgres -q -h 127.0.0.1 -p "$tport"; then
    return 0
  fi
  # initdb and postgres refuse to run as root: run them as an unprivileged
  # owner of the data directory.
  local run=()
  if [ "$(id -u)" -eq 0 ]; then
    id postgres >/dev/null 2>&1 || useradd --system --no-create-home postgres
    run=(runuser -u postgres --)
  fi
  bg_pg_make_cluster() {
    bg_pg_log "starting a throwaway cluster in $dir on port $tport"
    bg_pg_init "$bindir" "$dir" "${run[@]}"
  }
  bg_pg_up "$bindir" "$dir" "-p $tport -c listen_addresses=127.0.0.1 -k $dir -c max_connections=300 -c fsync=off" \
    bg_pg_make_cluster "${run[@]}"
}

stop_throwaway_postgres() {
  local dir=${BLOOMGATE_PG_DIR:-/tmp/bloomgate-pg} bindir run=()
  bindir=$(bg_pg_bindir)
  [ "$(id -u)" -eq 0 ] && run=(runuser -u postgres --)
  [ -s "$dir/PG_VERSION" ] && "${run[@]}" "$bindir/pg_ctl" -D "$dir" -m fast stop
}

# A throwaway primary with one streaming replica, from the local binaries,
# for tests/it/db/replicas.rs and the fleet benchmarks: the primary on
# 127.0.0.1:${BLOOMGATE_PRIMARY_PORT:-54332} (wal_level = logical, so either
# change feed works), the replica on ${BLOOMGATE_REPLICA_PORT:-54333}, made
# with `pg_basebackup -R` (it streams from the primary and answers read-only
# queries). Idempotent; exports BLOOMGATE_TEST_PRIMARY_URL and
# BLOOMGATE_TEST_REPLICA_URL (no database). Never touches :5432.
ensure_replica_pair() {
  local bindir run=() pport=${BLOOMGATE_PRIMARY_PORT:-54332} rport=${BLOOMGATE_REPLICA_PORT:-54333}
  local pdir=${BLOOMGATE_PRIMARY_DIR:-/tmp/bloomgate-pg-primary} rdir=${BLOOMGATE_REPLICA_DIR:-/tmp/bloomgate-pg-replica}
  # max_prepared_transactions: tests/truth commits with PREPARE
  # TRANSACTION / COMMIT PREPARED; the replica must allow as many.
  local popts="-p $pport -c listen_addresses=127.0.0.1 -k $pdir -c max_connections=300 -c fsync=off -c wal_level=logical -c max_wal_senders=20 -c max_replication_slots=20 -c hot_standby_feedback=on -c wal_keep_size=256MB -c max_prepared_transactions=20"
  local ropts="-p $rport -c listen_addresses=127.0.0.1 -k $rdir -c max_connections=300 -c fsync=off -c max_wal_senders=20 -c max_replication_slots=20 -c hot_standby=on -c hot_standby_feedback=on -c max_prepared_transactions=20"
  bindir=$(bg_pg_bindir)
  if [ -z "$bindir" ] || [ ! -x "$bindir/initdb" ]; then
    bg_pg_install || return 1
    bindir=$(bg_pg_bindir)
  fi
  if [ "$(id -u)" -eq 0 ]; then
    id postgres >/dev/null 2>&1 || useradd --system --no-create-home postgres
    run=(runuser -u postgres --)
  fi
  export BLOOMGATE_TEST_PRIMARY_URL="postgres://postgres@127.0.0.1:$pport"
  export BLOOMGATE_TEST_REPLICA_URL="postgres://postgres@127.0.0.1:$rport"
  # A primary made anew has a new system identifier: replicas of the old one
  # could never stream from it, so they go with it (and are made again).
  bg_pg_make_primary() {
    bg_pg_log "starting a throwaway primary in $pdir on port $pport"
    bg_pg_discard "$bindir" "$rdir" "${run[@]}" || return 1
    bg_pg_discard "$bindir" "${BLOOMGATE_REPLICA2_DIR:-/tmp/bloomgate-pg-replica2}" "${run[@]}" || return 1
    # initdb's trust lines cover replication connections from 127.0.0.1.
    bg_pg_init "$bindir" "$pdir" "${run[@]}"
  }
  if ! "$bindir/pg_isready" -U postgres -q -h 127.0.0.1 -p "$pport"; then
    bg_pg_up "$bindir" "$pdir" "$popts" bg_pg_make_primary "${run[@]}" || return 1
  fi
  # Three roles that must give a password, one per method the WAL feed's
  # replication client speaks (tests/it/feed/wal/events.rs, tests/it/operations.rs); every other role
  # keeps trust. Added once, in front of initdb's lines (first match wins).
  if [ -f "$pdir/pg_hba.conf" ] && ! grep -q bloomgate_scram "$pdir/pg_hba.conf"; then
    local hba
    hba=$(mktemp)
    {
      echo "host all bloomgate_scram 127.0.0.1/32 scram-sha-256"
      echo "host all bloomgate_md5 127.0.0.1/32 md5"
      echo "host all bloomgate_clear 127.0.0.1/32 password"
      cat "$pdir/pg_hba.conf"
    } >"$hba"
    # Written in place: the file keeps its owner and mode.
    cat "$hba" >"$pdir/pg_hba.conf" && rm -f "$hba"
    "${run[@]}" "$bindir/pg_ctl" -D "$pdir" reload >&2
  fi
  bg_pg_make_replica() {
    bg_pg_log "making a streaming replica of it in $rdir on port $rport (pg_basebackup)"
    rm -rf "$rdir" && mkdir -p "$rdir"
    [ "$(id -u)" -eq 0 ] && chown postgres "$rdir"
    chmod 700 "$rdir"
    # A physical slot keeps the WAL the replica has not received (tests
    # stop and pause it), so it can always catch up.
    "$bindir/psql" -h 127.0.0.1 -p "$pport" -U postgres -d postgres -qAtc \
      "SELECT pg_drop_replication_slot('bloomgate_replica') FROM pg_replication_slots WHERE slot_name = 'bloomgate_replica'" >/dev/null
    "${run[@]}" "$bindir/pg_basebackup" -h 127.0.0.1 -p "$pport" -U postgres -D "$rdir" -R -X stream \
      -C -S bloomgate_replica >&2
  }
  if ! "$bindir/pg_isready" -U postgres -q -h 127.0.0.1 -p "$rport"; then
    bg_pg_up "$bindir" "$rdir" "$ropts" bg_pg_make_replica "${run[@]}" || return 1
  fi
  # A pair an older version of this script started may run without
  # max_prepared_transactions (tests/truth commits with PREPARE
  # TRANSACTION) or with fsync on: restarted with today's options, the
  # replica first, since a standby must allow at least as many prepared
  # transactions as its primary or it stops replaying. Only servers whose
  # data directory is ours are restarted.
  bg_pg_restart_if_stale "$bindir" "$rport" "$rdir" "$ropts" "${run[@]}" || return 1
  bg_pg_restart_if_stale "$bindir" "$pport" "$pdir" "$popts" "${run[@]}" || return 1
}

# bg_pg_restart_if_stale BINDIR PORT DATADIR OPTIONS [RUNNER...]: restarts
# the server on PORT with OPTIONS if its data directory is DATADIR (one this
# script started) and it runs with max_prepared_transactions 0 or fsync on.
bg_pg_restart_if_stale() {
  local bindir=$1 port=$2 dir=$3 opts=$4 got
  shift 4
  got=$("$bindir/psql" -h 127.0.0.1 -p "$port" -U postgres -d postgres -qAtc \
    "SELECT current_setting('data_directory') || '|' || current_setting('max_prepared_transactions') || '|' || current_setting('fsync')" 2>/dev/null) \
    || return 0
  [ "${got%%|*}" = "$(readlink -f "$dir")" ] || return 0
  case "$got" in
    *"|0|"* | *"|on") ;;
    *) return 0 ;;
  esac
  bg_pg_log "restarting the server in $dir with today's options (prepared transactions, fsync off)"
  "$@" "$bindir/pg_ctl" -D "$dir" -w -t 300 -m fast -l "$dir/server.log" -o "$opts" restart >&2 \
    || { tail -n 20 "$dir/server.log" >&2; return 1; }
}

# A second streaming replica of that primary, for tests/truth: its
# replica fault pauses this one's replay while the gateway also has the
# first, on which its scans need not wait, as in a deployment with several
# replicas (the first is tests/it/db/replicas.rs', which pauses and stops it). On ${BLOOMGATE_REPLICA2_PORT:-54336}, data in
# ${BLOOMGATE_REPLICA2_DIR:-/tmp/bloomgate-pg-replica2}; starts the pair
# first. Idempotent; exports BLOOMGATE_TEST_REPLICA2_URL (no database).
ensure_second_replica() {
  ensure_replica_pair || return 1
  local bindir run=() pport=${BLOOMGATE_PRIMARY_PORT:-54332} port=${BLOOMGATE_REPLICA2_PORT:-54336}
  local dir=${BLOOMGATE_REPLICA2_DIR:-/tmp/bloomgate-pg-replica2}
  local opts="-p $port -c listen_addresses=127.0.0.1 -k $dir -c max_connections=300 -c fsync=off -c max_wal_senders=20 -c max_replication_slots=20 -c hot_standby=on -c hot_standby_feedback=on -c max_prepared_transactions=20"
  bindir=$(bg_pg_bindir)
  if [ "$(id -u)" -eq 0 ]; then
    run=(runuser -u postgres --)
  fi
  export BLOOMGATE_TEST_REPLICA2_URL="postgres://postgres@127.0.0.1:$port"
  if "$bindir/pg_isready" -U postgres -q -h 127.0.0.1 -p "$port"; then
    bg_pg_restart_if_stale "$bindir" "$port" "$dir" "$opts" "${run[@]}"
    return
  fi
  bg_pg_make_replica2() {
    bg_pg_log "making a second streaming replica in $dir on port $port (pg_basebackup)"
    rm -rf "$dir" && mkdir -p "$dir"
    [ "$(id -u)" -eq 0 ] && chown postgres "$dir"
    chmod 700 "$dir"
    "$bindir/psql" -h 127.0.0.1 -p "$pport" -U postgres -d postgres -qAtc \
      "SELECT pg_drop_replication_slot('bloomgate_replica2') FROM pg_replication_slots WHERE slot_name = 'bloomgate_replica2'" >/dev/null
    "${run[@]}" "$bindir/pg_basebackup" -h 127.0.0.1 -p "$pport" -U postgres -D "$dir" -R -X stream \
      -C -S bloomgate_replica2 >&2
  }
  bg_pg_up "$bindir" "$dir" "$opts" bg_pg_make_replica2 "${run[@]}"
}

stop_replica_pair() {
  local bindir run=()
  bindir=$(bg_pg_bindir)
  [ "$(id -u)" -eq 0 ] && run=(runuser -u postgres --)
  for d in "${BLOOMGATE_REPLICA2_DIR:-/tmp/bloomgate-pg-replica2}" "${BLOOMGATE_REPLICA_DIR:-/tmp/bloomgate-pg-replica}" "${BLOOMGATE_PRIMARY_DIR:-/tmp/bloomgate-pg-primary}"; do
    [ -s "$d/postmaster.pid" ] && "${run[@]}" "$bindir/pg_ctl" -D "$d" -m fast stop >&2 || true
  done
}

# A throwaway server with wal_level = logical, for the book's Getting
# started (its fleet follows the WAL through the bus): from the local
# binaries, data in ${BLOOMGATE_LOGICAL_DIR:-/tmp/bloomgate-pg-logical}, on a
# port the kernel finds free when it starts (a fixed one may be taken on a
# shared machine), written down beside the data directory (DIR.port) so
# that the running server is found again. Idempotent; exports BLOOMGATE_LOGICAL_URL (no
# database). Never touches another server.
ensure_logical_server() {
  local bindir run=() dir=${BLOOMGATE_LOGICAL_DIR:-/tmp/bloomgate-pg-logical} port="" found
  bindir=$(bg_pg_bindir)
  if [ -z "$bindir" ] || [ ! -x "$bindir/initdb" ]; then
    bg_pg_install || return 1
    bindir=$(bg_pg_bindir)
  fi
  if [ "$(id -u)" -eq 0 ]; then
    id postgres >/dev/null 2>&1 || useradd --system --no-create-home postgres
    run=(runuser -u postgres --)
  fi
  [ -s "$dir.port" ] && port=$(cat "$dir.port")
  # The server on that port is this directory's, or another's port now.
  if [ -n "$port" ]; then
    found=$("$bindir/psql" -h 127.0.0.1 -p "$port" -U postgres -d postgres -qAtc       "SELECT current_setting('data_directory')" 2>/dev/null) || found=""
    if [ "$found" = "$(readlink -f "$dir")" ]; then
      export BLOOMGATE_LOGICAL_URL="postgres://postgres@127.0.0.1:$port"
      return 0
    fi
    # Stopped: it starts on a port free now. Still running on its port,
    # which answers as another's: bg_pg_up waits for its postmaster.
    bg_pg_live "$dir" >/dev/null || port=""
  fi
  [ -n "$port" ] || port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  bg_pg_make_logical() {
    bg_pg_log "starting a throwaway server with wal_level = logical in $dir on port $port"
    bg_pg_init "$bindir" "$dir" "${run[@]}"
  }
  bg_pg_up "$bindir" "$dir" \
    "-p $port -c listen_addresses=127.0.0.1 -k $dir -c fsync=off -c wal_level=logical -c max_wal_senders=10 -c max_replication_slots=10" \
    bg_pg_make_logical "${run[@]}" || return 1
  echo "$port" >"$dir.port"
  export BLOOMGATE_LOGICAL_URL="postgres://postgres@127.0.0.1:$port"
}

stop_logical_server() {
  local bindir run=() dir=${BLOOMGATE_LOGICAL_DIR:-/tmp/bloomgate-pg-logical}
  bindir=$(bg_pg_bindir)
  [ "$(id -u)" -eq 0 ] && run=(runuser -u postgres --)
  [ -s "$dir/postmaster.pid" ] && "${run[@]}" "$bindir/pg_ctl" -D "$dir" -m fast stop >&2 || true
}

# A throwaway TLS-only server for tests/it/db/tls.rs, from the local binaries:
# 127.0.0.1:${BLOOMGATE_TLS_PORT:-54335}, data in
# ${BLOOMGATE_TLS_DIR:-/tmp/bloomgate-pg-tls}, `ssl = on` with a
# self-signed CA and a server certificate it signed (CN localhost, SAN
# DNS:localhost and IP:127.0.0.1) made with the openssl CLI, and
# wal_level = logical (the WAL feed's replication connection runs over TLS
# too). Its pg_hba.conf takes TCP only through `hostssl` (trust): a
# plaintext connection is refused. A second CA that signed nothing here is
# made for the wrong-CA tests. Idempotent; exports BLOOMGATE_TEST_TLS_URL
# (no database, no sslmode), BLOOMGATE_TEST_TLS_CA (the CA file) and
# BLOOMGATE_TEST_TLS_OTHER_CA. Never touches another server.
ensure_tls_server() {
  local bindir run=() port=${BLOOMGATE_TLS_PORT:-54335} dir=${BLOOMGATE_TLS_DIR:-/tmp/bloomgate-pg-tls}
  local certs=${BLOOMGATE_TLS_DIR:-/tmp/bloomgate-pg-tls}.certs
  bindir=$(bg_pg_bindir)
  if [ -z "$bindir" ] || [ ! -x "$bindir/initdb" ]; then
    bg_pg_install || return 1
    bindir=$(bg_pg_bindir)
  fi
  if ! command -v openssl >/dev/null 2>&1; then
    bg_pg_log "no openssl CLI (for the TLS server's certificates); installing the openssl package"
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq openssl >&2 || return 1
  fi
  if [ "$(id -u)" -eq 0 ]; then
    id postgres >/dev/null 2>&1 || useradd --system --no-create-home postgres
    run=(runuser -u postgres --)
  fi
  export BLOOMGATE_TEST_TLS_URL="postgres://postgres@localhost:$port"
  export BLOOMGATE_TEST_TLS_CA="$certs/ca.crt"
  export BLOOMGATE_TEST_TLS_OTHER_CA="$certs/other-ca.crt"
  if "$bindir/pg_isready" -U postgres -q -h 127.0.0.1 -p "$port" && [ -s "$certs/ca.crt" ] && [ -s "$dir/server.crt" ]; then
    return 0
  fi
  bg_pg_make_tls() {
    bg_pg_log "starting a throwaway TLS-only server in $dir on port $port"
    rm -rf "$dir" "$certs" && mkdir -p "$dir" "$certs"
    local ext
    ext=$(mktemp)
    printf 'basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\nsubjectAltName=DNS:localhost,IP:127.0.0.1\n' >"$ext"
    {
      for ca in ca other-ca; do
        openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 3650 \
          -subj "/CN=bloomgate test $ca" -addext basicConstraints=critical,CA:TRUE \
          -addext keyUsage=critical,keyCertSign,cRLSign \
          -keyout "$certs/$ca.key" -out "$certs/$ca.crt" || return 1
      done
      openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=localhost" \
        -keyout "$dir/server.key" -out "$certs/server.csr" || return 1
      openssl x509 -req -in "$certs/server.csr" -CA "$certs/ca.crt" -CAkey "$certs/ca.key" \
        -CAcreateserial -days 3650 -extfile "$ext" -out "$dir/server.crt" || return 1
    } >"$certs/openssl.log" 2>&1 || { cat "$certs/openssl.log" >&2; rm -f "$ext"; return 1; }
    rm -f "$ext"
    chmod 600 "$dir/server.key"
    [ "$(id -u)" -eq 0 ] && chown postgres "$dir" "$dir/server.key" "$dir/server.crt"
    # initdb wants an empty directory: the certificates wait next to it.
    mv "$dir/server.key" "$dir/server.crt" "$certs/"
    "${run[@]}" "$bindir/initdb" -D "$dir" -U postgres --auth=trust -E UTF8 >"$dir.initdb.log" 2>&1 \
      || { cat "$dir.initdb.log" >&2; return 1; }
    mv "$certs/server.key" "$certs/server.crt" "$dir/"
    # TCP only with TLS; the Unix socket (for pg_ctl and psql here) stays.
    printf 'local all all trust\nlocal replication all trust\nhostssl all all 127.0.0.1/32 trust\nhostssl replication all 127.0.0.1/32 trust\n' \
      >"$dir/pg_hba.conf"
  }
  # A data directory of ours that runs, or would start, without its
  # certificates is made again.
  if [ ! -s "$certs/ca.crt" ] || [ ! -s "$dir/server.crt" ]; then
    bg_pg_discard "$bindir" "$dir" "${run[@]}" || return 1
  fi
  bg_pg_up "$bindir" "$dir" \
    "-p $port -c listen_addresses=127.0.0.1 -k $dir -c max_connections=100 -c fsync=off -c ssl=on -c ssl_cert_file=server.crt -c ssl_key_file=server.key -c wal_level=logical -c max_wal_senders=10 -c max_replication_slots=10" \
    bg_pg_make_tls "${run[@]}"
}

stop_tls_server() {
  local bindir run=() dir=${BLOOMGATE_TLS_DIR:-/tmp/bloomgate-pg-tls}
  bindir=$(bg_pg_bindir)
  [ "$(id -u)" -eq 0 ] && run=(runuser -u postgres --)
  [ -s "$dir/postmaster.pid" ] && "${run[@]}" "$bindir/pg_ctl" -D "$dir" -m fast stop >&2 || true
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  set -euo pipefail
  case "${1:-start}" in
    start) ensure_postgres && echo "$PG_BASE_URL" ;;
    replicas) ensure_replica_pair && echo "$BLOOMGATE_TEST_PRIMARY_URL $BLOOMGATE_TEST_REPLICA_URL" ;;
    logical) ensure_logical_server && echo "$BLOOMGATE_LOGICAL_URL" ;;
    replica2) ensure_second_replica && echo "$BLOOMGATE_TEST_REPLICA2_URL" ;;
    tls) ensure_tls_server && echo "$BLOOMGATE_TEST_TLS_URL $BLOOMGATE_TEST_TLS_CA" ;;
    stop) stop_tls_server; stop_logical_server; stop_replica_pair; stop_throwaway_postgres ;;
    *) echo "usage: scripts/pg.sh [start|replicas|logical|replica2|tls|stop]" >&2; exit 2 ;;
  esac
fi
