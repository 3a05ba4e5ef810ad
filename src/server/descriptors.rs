//! The file-descriptor budget, checked once at start-up: the soft
//! `RLIMIT_NOFILE` raised to the hard limit, and a warning naming the keys
//! when the connection caps and the pool cannot fit in it (past the limit
//! `accept` and new database connections fail until descriptors free up).

use super::accept::operator_cap;
use crate::config::Config;

/// Descriptors the process needs besides client connections: the
/// runtime, listeners, log output, the change feed.
const FD_RESERVE: u64 = 64;

/// Raises the soft `RLIMIT_NOFILE` to the hard limit (the soft default,
/// often 1024, is far below what a server needs; the hard limit is what the
/// operator allows), then warns, naming the keys, if `max_connections`, the
/// operator listeners' caps and the pool cannot fit in it: past the limit
/// `accept` fails (and so do new database connections) until descriptors
/// free up.
#[cfg(unix)]
pub(super) fn check_descriptors(config: &Config, operator_listeners: u64) {
    use super::accept::OPERATOR_MAX_CONNECTIONS;
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut limit = getrlimit(Resource::Nofile);
    if limit.current < limit.maximum {
        let raised = rustix::process::Rlimit {
            current: limit.maximum,
            maximum: limit.maximum,
        };
        match setrlimit(Resource::Nofile, raised) {
            Ok(()) => {
                tracing::info!(
                    from = ?limit.current,
                    to = ?limit.maximum,
                    "raised the file-descriptor limit (RLIMIT_NOFILE) to its hard limit"
                );
                limit = getrlimit(Resource::Nofile);
            }
            Err(e) => tracing::debug!(error = %e, "cannot raise RLIMIT_NOFILE"),
        }
    }
    let needed = descriptors_needed(config, operator_listeners);
    if let Some(soft) = limit.current
        && needed > soft
    {
        tracing::warn!(
            max_connections = config.server.max_connections,
            operator_listeners,
            pool_size = config.database.pool_size,
            needed,
            limit = soft,
            "server.max_connections, {OPERATOR_MAX_CONNECTIONS} for each operator listener, \
             database.pool_size and {FD_RESERVE} for the process need {needed} file descriptors, above the limit (RLIMIT_NOFILE) of \
             {soft}: the cap cannot be honoured, and once descriptors run out `accept` fails \
             until connections close. Raise the limit (ulimit -n, systemd LimitNOFILE=) or \
             lower server.max_connections"
        );
    }
}

#[cfg(not(unix))]
pub(super) fn check_descriptors(_config: &Config, _operator_listeners: u64) {}

fn descriptors_needed(config: &Config, operator_listeners: u64) -> u64 {
    (config.server.max_connections as u64)
        .saturating_add((operator_cap(&config.server) as u64).saturating_mul(operator_listeners))
        .saturating_add(u64::from(config.database.pool_size))
        .saturating_add(FD_RESERVE)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptors_needed_count_every_listener_and_the_pool() {
        let mut config = Config::default();
        config.server.max_connections = 1000;
        config.database.pool_size = 16;
        assert_eq!(descriptors_needed(&config, 0), 1000 + 16 + FD_RESERVE);
        assert_eq!(descriptors_needed(&config, 2), 1000 + 512 + 16 + FD_RESERVE);
        config.server.max_connections = 100;
        assert_eq!(descriptors_needed(&config, 2), 300 + 16 + FD_RESERVE);
    }

    /// The shipped configuration, admin and metrics listeners on, fits a
    /// descriptor limit of 20,000 (this machine's, and a common one), so
    /// it starts without the warning.
    #[test]
    fn the_shipped_defaults_fit_twenty_thousand_descriptors() {
        let text = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/config/bloomgate.toml"
        ))
        .unwrap();
        let config = Config::from_toml(&text).unwrap();
        assert!(
            descriptors_needed(&config, 2) <= 20_000,
            "{}",
            descriptors_needed(&config, 2)
        );
    }
}
