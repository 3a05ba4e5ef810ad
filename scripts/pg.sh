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
  if command -v pg_isready >/dev/null 2>&1 && pg_isready -q -h "$host" -p "$port"; then
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
  if "$bindir/pg_isready" -q -h 127.0.0.1 -p "$tport"; then
    return 0
  fi
  # initdb and postgres refuse to run as root: run them as an unprivileged
  # owner of the data directory.
  local run=()
  if [ "$(id -u)" -eq 0 ]; then
    id postgres >/dev/null 2>&1 || useradd --system --no-create-home postgres
    run=(runuser -u postgres --)
  fi
  if [ ! -s "$dir/PG_VERSION" ]; then
    bg_pg_log "starting a throwaway cluster in $dir on port $tport"
    rm -rf "$dir" && mkdir -p "$dir"
    [ "$(id -u)" -eq 0 ] && chown postgres "$dir"
    "${run[@]}" "$bindir/initdb" -D "$dir" -U postgres --auth=trust -E UTF8 >"$dir.initdb.log" 2>&1 \
      || { cat "$dir.initdb.log" >&2; return 1; }
  fi
  "${run[@]}" "$bindir/pg_ctl" -D "$dir" -w -t 60 -l "$dir/server.log" \
    -o "-p $tport -c listen_addresses=127.0.0.1 -k $dir -c max_connections=300 -c fsync=off" start >&2 \
    || { cat "$dir/server.log" >&2; return 1; }
}

stop_throwaway_postgres() {
  local dir=${BLOOMGATE_PG_DIR:-/tmp/bloomgate-pg} bindir run=()
  bindir=$(bg_pg_bindir)
  [ "$(id -u)" -eq 0 ] && run=(runuser -u postgres --)
  [ -s "$dir/PG_VERSION" ] && "${run[@]}" "$bindir/pg_ctl" -D "$dir" -m fast stop
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  set -euo pipefail
  case "${1:-start}" in
    start) ensure_postgres && echo "$PG_BASE_URL" ;;
    stop) stop_throwaway_postgres ;;
    *) echo "usage: scripts/pg.sh [start|stop]" >&2; exit 2 ;;
  esac
fi
