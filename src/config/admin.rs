//! `[admin]`: the admin listener (metrics, the admin API, the status page)
//! and its bearer token.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::server::ServerConfig;
use super::{ConfigError, KeyProblem};

/// The admin listener: metrics, the admin API and the status page. It runs
/// only when a token is configured, in `BLOOMGATE_ADMIN_TOKEN` or the file
/// `token_file` names (at least 16 characters; never logged).
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    /// Address of the admin listener; keep it private. Default
    /// `127.0.0.1:9090`.
    pub listen: SocketAddr,
    /// A file holding the bearer token (trailing whitespace ignored).
    /// Default: none; `BLOOMGATE_ADMIN_TOKEN` takes precedence.
    pub token_file: Option<PathBuf>,
    /// Whole-request deadline for admin requests (the admin listener does
    /// not use `server.request_timeout`); past it: 504. A rebuild is never
    /// cut off by it: it runs in the background (see `rebuild_wait`).
    /// Default `30s`.
    #[serde(with = "crate::config::forms::duration")]
    pub request_timeout: Duration,
    /// How long `POST /admin/resources/{name}/rebuild?wait=true` waits for
    /// the rebuild's outcome before answering 202 (the rebuild goes on).
    /// Not bounded by `request_timeout`. Default `10m`.
    #[serde(with = "crate::config::forms::duration")]
    pub rebuild_wait: Duration,
    /// A file holding a read-only token that `GET /metrics` on the admin
    /// listener accepts besides the admin token (it opens nothing else).
    /// Default: none; `BLOOMGATE_METRICS_TOKEN` takes precedence.
    pub metrics_token_file: Option<PathBuf>,
    /// An address of its own serving only `GET /metrics`, without a token:
    /// for an internal network a Prometheus scrapes. Default: none.
    pub metrics_listen: Option<SocketAddr>,
}

impl Default for AdminConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 9090)),
            token_file: None,
            request_timeout: Duration::from_secs(30),
            rebuild_wait: Duration::from_secs(600),
            metrics_token_file: None,
            metrics_listen: None,
        }
    }
}

/// The minimum length of an admin token.
pub const MIN_TOKEN_LEN: usize = 16;

impl AdminConfig {
    /// The configured token: `BLOOMGATE_ADMIN_TOKEN`, else `token_file`,
    /// else none (the admin listener stays off).
    pub fn token(&self) -> Result<Option<String>, ConfigError> {
        read_token(
            "BLOOMGATE_ADMIN_TOKEN",
            self.token_file.as_deref(),
            "admin.token_file",
            "admin token",
        )
    }

    /// The read-only metrics token: `BLOOMGATE_METRICS_TOKEN`, else
    /// `metrics_token_file`, else none.
    pub fn metrics_token(&self) -> Result<Option<String>, ConfigError> {
        read_token(
            "BLOOMGATE_METRICS_TOKEN",
            self.metrics_token_file.as_deref(),
            "admin.metrics_token_file",
            "metrics token",
        )
    }
}

/// A token from the environment variable `var`, else from `file` (its
/// config key `key`), at least [`MIN_TOKEN_LEN`] characters.
fn read_token(
    var: &str,
    file: Option<&std::path::Path>,
    key: &str,
    what: &str,
) -> Result<Option<String>, ConfigError> {
    let (token, from) = match std::env::var(var) {
        Ok(t) => (t, var.to_string()),
        Err(_) => match file {
            Some(path) => {
                let t = std::fs::read_to_string(path).map_err(|e| ConfigError::Invalid {
                    file: "config".into(),
                    key: key.into(),
                    problem: format!("cannot read {}: {e}", path.display()),
                })?;
                (t.trim_end().to_string(), path.display().to_string())
            }
            None => return Ok(None),
        },
    };
    if token.len() < MIN_TOKEN_LEN {
        return Err(ConfigError::Invalid {
            file: from,
            key: what.into(),
            problem: format!("must be at least {MIN_TOKEN_LEN} characters"),
        });
    }
    Ok(Some(token))
}

impl AdminConfig {
    /// The admin API is never on the public address.
    pub(super) fn validate(&self, server: &ServerConfig) -> Result<(), KeyProblem> {
        if self.request_timeout.is_zero() {
            return Err(KeyProblem::new("admin.request_timeout", "must be above 0"));
        }
        if self.rebuild_wait.is_zero() {
            return Err(KeyProblem::new("admin.rebuild_wait", "must be above 0"));
        }
        if self.listen == server.listen {
            return Err(KeyProblem::new(
                "admin.listen",
                "must differ from server.listen: the admin API is never on the public address",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::config::tests::{MINIMAL, err};

    #[test]
    fn bad_values_are_refused_naming_the_key() {
        for (prefix, key) in [
            (
                "[admin]\nrequest_timeout = \"0s\"\n",
                "admin.request_timeout",
            ),
            ("[admin]\nrebuild_wait = \"0s\"\n", "admin.rebuild_wait"),
        ] {
            let e = err(&format!("{prefix}{MINIMAL}"));
            assert!(e.contains(key), "{prefix}: {e}");
        }
    }
}
