//! `[log]`: the format and the `tracing` filter.

use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Human,
    Json,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    /// `human` or `json`. Default `human`.
    pub format: LogFormat,
    /// A `tracing` filter such as `info` or `info,bloomgate::http::front=debug`
    /// (a span and a line per request);
    /// `RUST_LOG` overrides it. Reloaded on SIGHUP. Default `info`.
    pub level: String,
    /// One line per request at `info` (target `bloomgate::access`): method,
    /// route template, status, `Cache-Status`, resource, duration, request
    /// id, client address; and the request id on every line logged while
    /// the request is handled. Default true.
    pub access: bool,
}

impl Default for LogConfig {
    fn default() -> Self {
        Self {
            format: LogFormat::Human,
            level: "info".into(),
            access: true,
        }
    }
}
