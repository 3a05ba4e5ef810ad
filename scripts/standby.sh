#!/usr/bin/env bash
# scripts/standby.sh: a throwaway hot standby for tests/it/db/standby.rs, on
# 127.0.0.1:${BLOOMGATE_STANDBY_PORT:-54334}, in
# ${BLOOMGATE_STANDBY_DIR:-/tmp/bloomgate-standby}. Prints its base URL
# (postgres://postgres@127.0.0.1:PORT).
#
# No primary is needed: a fresh cluster started with `standby.signal` and no
# `primary_conninfo` stays in recovery for good, waiting for WAL, and (with
# hot_standby on, the default) accepts read-only connections. That is all a
# start-up check against a standby needs: pg_is_in_recovery() is true and
# LISTEN is refused ("cannot execute LISTEN during recovery").
#
#   scripts/standby.sh [start]   start it if it is not running (idempotent)
#   scripts/standby.sh stop
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/pg.sh
port=${BLOOMGATE_STANDBY_PORT:-54334}
dir=${BLOOMGATE_STANDBY_DIR:-/tmp/bloomgate-standby}
bindir=$(bg_pg_bindir)
[ -n "$bindir" ] && [ -x "$bindir/initdb" ] || { bg_pg_install && bindir=$(bg_pg_bindir); }
run=()
if [ "$(id -u)" -eq 0 ]; then
  id postgres >/dev/null 2>&1 || useradd --system --no-create-home postgres
  run=(runuser -u postgres --)
fi
case "${1:-start}" in
  start)
    # One start at a time (parallel test binaries); the server must not
    # inherit the lock's descriptor (9>&- below), or it holds it for good.
    exec 9>"$dir.lock"
    flock 9
    if ! "$bindir/pg_isready" -U postgres -q -h 127.0.0.1 -p "$port"; then
      # (9>&-: the server must not inherit the lock's descriptor.)
      bg_pg_make_standby() {
        bg_pg_init "$bindir" "$dir" "${run[@]}" 9>&- || return 1
        "${run[@]}" touch "$dir/standby.signal"
      }
      if [ -s "$dir/PG_VERSION" ]; then "${run[@]}" touch "$dir/standby.signal"; fi
      bg_pg_up "$bindir" "$dir" "-p $port -c listen_addresses=127.0.0.1 -k $dir -c fsync=off -c hot_standby=on" \
        bg_pg_make_standby "${run[@]}" 9>&- || exit 1
    fi
    echo "postgres://postgres@127.0.0.1:$port"
    ;;
  stop) [ -s "$dir/PG_VERSION" ] && "${run[@]}" "$bindir/pg_ctl" -D "$dir" -m fast stop ;;
  *) echo "usage: scripts/standby.sh [start|stop]" >&2; exit 2 ;;
esac
