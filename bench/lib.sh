# Shared by the bench scripts that run gateways against the pgbench tables
# of bench/pgbench/ (writer-cost.sh, trigger-cost.sh, feed-cpu.sh,
# replica-load.sh). Source it after setting `work` (a scratch directory) and, where used, `URL`, `DB`
# and the `pids` array.

# Creates $DB afresh with the tables of bench/pgbench/setup.sql
# (`tc_users` is served under two keys, so REPLICA IDENTITY FULL).
pgbench_db() {
  psql -qd postgres -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" -c "CREATE DATABASE $DB" >/dev/null
  psql -qd "$DB" -f bench/pgbench/setup.sql -c "ALTER TABLE tc_users REPLICA IDENTITY FULL" >/dev/null
}

# Writes a gateway config for $URL with the given change feed and the
# resources of bench/pgbench/resources.toml; prints its path. A second
# argument names the file, a third is more [database] settings.
bench_config() { # freshness [name] [database settings]
  local f="$work/${2:-$1}.toml"
  cat >"$f" <<EOT
[server]
listen = "127.0.0.1:0"
[database]
url = "$URL"
migrate = false
install_triggers = false
freshness = "$1"
${3:-}
EOT
  cat bench/pgbench/resources.toml >>"$f"
  echo "$f"
}

# Stops every gateway in `pids` and waits for each.
stop_gateways() {
  local p
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  pids=()
}
