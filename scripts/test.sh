#!/usr/bin/env bash
# Runs the test suite against a real PostgreSQL (started if none is running).
# Each test creates its own database and drops it afterwards.
# Extra arguments go to `cargo test`, e.g. scripts/test.sh --test it -- http::cors::.
# Without arguments (the whole suite, as CI runs it) tests/it/feed/freshness.rs runs
# a second time on the WAL feed streamed, a third on it polled, a fourth
# on the queue feed and three more times as a least-privilege role (wal,
# notify, queue), two lanes side by side; then the randomized checker
# (tests/truth) runs its CI seeds, beside the outside checks: Schemathesis
# and REDbot against the live gateway (scripts/contract.sh), then the book's
# Getting started page, run as written (scripts/walk.py). Beside the
# freshness reruns, tests/it/db/patroni.rs runs in a lane of its own.
# BLOOMGATE_SKIP_CONTRACT=1 leaves all of these out (cargo test alone).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/pg.sh
ensure_postgres
# What earlier runs' tests left in the temporary directory (config and key
# files, a killed test's directories: small, but one run leaves dozens),
# once it is two hours old, so that a run beside this one keeps its own.
find "${TMPDIR:-/tmp}" -maxdepth 1 \( -name 'bloomgate-test-*' -o -name 'bloomgate-keys-*.toml' \
  -o -name 'bloomgate-jwks-*.json' -o -name 'bloomgate-bus_*' \) -mmin +120 \
  -exec rm -rf {} + 2>/dev/null || true
# tests/it/db/replicas.rs: a throwaway primary with a streaming replica.
ensure_replica_pair
# tests/truth: a second replica of it, the checker's own, whose replay it
# pauses while the first stays in step.
ensure_second_replica
# tests/it/db/tls.rs: a throwaway TLS-only server (hostssl) with its own CA.
ensure_tls_server
# tests/it/db/standby.rs: a cluster in permanent recovery on its fixed port
# (54334), started here, before any test asks the kernel for a free port:
# a server a test starts on a port the kernel chose may hold 54334 when the
# standby's binary runs, and the standby then cannot bind it (seen when two
# runs shared the machine).
scripts/standby.sh >/dev/null
# The status-page test drives a headless Chromium.
if [ -z "${BLOOMGATE_CHROMIUM:-}" ] && ! command -v chromium >/dev/null 2>&1; then
  echo "test.sh: installing chromium for the status-page test" >&2
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq chromium >&2
fi
# The rolling-restart test of tests/it/db/replicas.rs runs Debian's nginx in front
# of two gateways.
if ! command -v nginx >/dev/null 2>&1; then
  echo "test.sh: installing nginx-light for the rolling-restart test" >&2
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq nginx-light >&2
  # Only the binary is wanted: no service of its own.
  $sudo systemctl disable --now nginx >/dev/null 2>&1 || $sudo service nginx stop >/dev/null 2>&1 || true
fi
# tests/it/db/patroni.rs: Debian's patroni and etcd-server (a real HA stack on
# throwaway ports, scripts/patroni.sh); only the binaries are wanted, no
# service of their own.
if ! scripts/patroni.sh available 2>/dev/null; then
  echo "test.sh: installing patroni and etcd-server for tests/it/db/patroni.rs" >&2
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq patroni etcd-server postgresql-15 >&2
  $sudo systemctl disable --now etcd patroni >/dev/null 2>&1 || $sudo service etcd stop >/dev/null 2>&1 || true
fi
# The alerting rules are checked and unit-tested with promtool, from
# Debian's prometheus package: only the binary is taken out of it (into
# target/promtool), so no Prometheus server is installed or started.
PROMTOOL="$(command -v promtool || true)"
if [ -z "$PROMTOOL" ]; then
  PROMTOOL="$PWD/target/promtool/usr/bin/promtool"
  if [ ! -x "$PROMTOOL" ]; then
    echo "test.sh: fetching promtool (Debian's prometheus package) for the rule tests" >&2
    deb_dir="$(mktemp -d)"
    (cd "$deb_dir" && { apt-get download prometheus >&2 2>/dev/null || {
      sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
      $sudo apt-get update -qq >&2 && apt-get download prometheus >&2; }; })
    mkdir -p target/promtool
    dpkg-deb -x "$deb_dir"/prometheus_*.deb target/promtool
    rm -rf "$deb_dir"
  fi
fi
export BLOOMGATE_PROMTOOL="$PROMTOOL"
# The Kubernetes manifests are validated against the API's schemas with
# kubernetes-validate (PyPI; the schemas ship inside it, no cluster).
KUBERNETES_VALIDATE=1.37.0
KUBE_VENV=target/deploy-venv
if ! "$KUBE_VENV/bin/kubernetes-validate" --version 2>/dev/null | grep -qx "$KUBERNETES_VALIDATE"; then
  echo "test.sh: installing kubernetes-validate $KUBERNETES_VALIDATE for the manifest check" >&2
  python3 -m venv "$KUBE_VENV"
  "$KUBE_VENV/bin/pip" install -q "kubernetes-validate==$KUBERNETES_VALIDATE" >&2
fi
export BLOOMGATE_KUBERNETES_VALIDATE="$PWD/$KUBE_VENV/bin/kubernetes-validate"
# tests/it/feed/bus.rs starts a redis-server of its own per test, and the checker's
# bus feed one per history (Debian's package); without it they fail.
if ! command -v redis-server >/dev/null 2>&1; then
  echo "test.sh: installing redis-server for the bus tests" >&2
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq redis-server >&2
  # Only the binary is wanted: no service of its own.
  $sudo systemctl disable --now redis-server >/dev/null 2>&1 || $sudo service redis-server stop >/dev/null 2>&1 || true
fi
# phase NAME COMMAND...: runs COMMAND and, when BLOOMGATE_PHASES names a
# file, appends "NAME SECONDS" to it (.ci/run prints the table at its end,
# so the next decision on CI's budget has numbers).
phase() {
  local name=$1 began=$SECONDS status=0
  shift
  "$@" || status=$?
  if [ -n "${BLOOMGATE_PHASES:-}" ]; then
    echo "$name $((SECONDS - began))" >>"$BLOOMGATE_PHASES"
  fi
  return "$status"
}
export BLOOMGATE_TEST_DATABASE_URL="$PG_BASE_URL/postgres"
echo "test.sh: using $BLOOMGATE_TEST_DATABASE_URL" >&2
if [ $# -gt 0 ] || [ -n "${BLOOMGATE_SKIP_CONTRACT:-}" ]; then
  exec cargo test --locked "$@"
fi
"$PROMTOOL" check rules deploy/prometheus/bloomgate.rules.yml
(cd deploy/prometheus && "$PROMTOOL" test rules tests.yml)
# tests/it/deploy.rs reads the binary's dep-info (target/debug/bloomgate.d),
# which only `cargo build` writes: `cargo test` builds the binary without it.
phase "build (the binary)" cargo build --locked --bin bloomgate
phase "cargo test" cargo test --locked
# What follows runs two at a time, side by side: each mostly waits on
# servers (the machine is two thirds idle under one), and each creates its
# own databases (and counts only its own slots and walsenders). The WAL
# feed's reruns share one lane, so the walsenders and slots held at once
# stay what one rerun holds (the throwaway primary's max_wal_senders is
# 20); the checker, the heaviest, starts after them, beside the outside
# checks.
# Every freshness test once more, on the WAL feed (tests/common: wal_mode),
# on the WAL feed polled (`database.wal_poll_interval`), and with every
# gateway connecting as a role of its own that holds only the book's
# documented grants (docs/src/production.md; tests/common: least_privilege),
# not as the superuser.
wal_reruns() {
  local s=0
  phase "freshness wal" env BLOOMGATE_TEST_FRESHNESS=wal cargo test --locked --test it -- feed::freshness:: || s=1
  phase "freshness wal-poll" env BLOOMGATE_TEST_FRESHNESS=wal-poll cargo test --locked --test it -- feed::freshness:: || s=1
  phase "freshness least wal" env BLOOMGATE_TEST_ROLE=least BLOOMGATE_TEST_FRESHNESS=wal cargo test --locked --test it -- feed::freshness:: || s=1
  return $s
}
# On the triggers writing to the change table (`freshness = "queue"`), and
# the notify and queue feeds as the least-privilege role.
other_reruns() {
  local s=0
  phase "freshness queue" env BLOOMGATE_TEST_FRESHNESS=queue cargo test --locked --test it -- feed::freshness:: || s=1
  phase "freshness least notify" env BLOOMGATE_TEST_ROLE=least cargo test --locked --test it -- feed::freshness:: || s=1
  phase "freshness least queue" env BLOOMGATE_TEST_ROLE=least BLOOMGATE_TEST_FRESHNESS=queue cargo test --locked --test it -- feed::freshness:: || s=1
  return $s
}
# A failover on a real Patroni cluster (tests/it/db/patroni.rs, ignored in the
# run above): one cluster at a time, about three minutes, mostly waiting on
# Patroni's loop and leader key.
patroni_lane() {
  local s=0
  phase "patroni" cargo test --locked --test it -- --ignored --test-threads=1 db::patroni:: || s=1
  # A test killed mid-run leaves its cluster running (setsid'd daemons):
  # every one this run's tests made goes.
  local d
  for d in "${TMPDIR:-/tmp}"/bloomgate-test-*/patroni; do
    [ -d "$d" ] || continue
    scripts/patroni.sh stop "$d" --clean >/dev/null 2>&1 || true
    rmdir "$(dirname "$d")" 2>/dev/null || true
  done
  return $s
}
# The randomized checker (tests/truth, ignored in the run above): its CI
# seeds on every feed (the bus's among them) and a history of the assumed
# faults in turn on each, about six minutes, with its one-line summaries.
checker_seeds() {
  phase "checker seeds" cargo test --locked --test truth -- --ignored --nocapture
}
# Schemathesis and REDbot, then the book's Getting started page, every
# block of it, as a newcomer runs it (a served row, a row behind a token,
# two gateways on the bus).
outside_checks() {
  local s=0
  phase "contract" scripts/contract.sh || s=1
  phase "book walk" python3 scripts/walk.py || s=1
  return $s
}
# side_by_side FUNCTION...: runs them at once, the first one's output
# live, each other's into a file of its own, printed whole once all are
# done (a lane at a time, readable); fails if any failed. Each runs in a
# process group of its own (job control), so an interrupted run (Ctrl-C,
# a CI job cancelled) takes every lane down with its tests, and prints
# what the others had written.
side_by_side() {
  local dir fn status=0
  local -a pids=()
  dir=$(mktemp -d) || return 1
  set -m
  "$1" &
  pids+=("$!")
  for fn in "${@:2}"; do
    "$fn" >"$dir/$fn" 2>&1 &
    pids+=("$!")
  done
  set +m
  # shellcheck disable=SC2064 # the lanes and the directory of this call
  trap "kill -- ${pids[*]/#/-} 2>/dev/null; cat $dir/* 2>/dev/null; exit 130" INT TERM
  for fn in "${pids[@]}"; do
    wait "$fn" || status=1
  done
  trap - INT TERM
  for fn in "${@:2}"; do
    cat "$dir/$fn"
  done
  rm -rf "$dir"
  return "$status"
}
# contract.sh and walk.py run the gateway's binary, which `cargo build`
# builds with other features than the tests' (dev-dependencies unify only
# there; `cargo test` put its own in target/debug): put back now, not while
# the checker runs beside them.
phase "build (the binary, again)" cargo build --locked --bin bloomgate
phase "freshness reruns and patroni (side by side)" side_by_side wal_reruns other_reruns patroni_lane
phase "checker and outside checks (side by side)" side_by_side checker_seeds outside_checks
