//! Logging setup: human-readable or JSON lines, filtered by `log.level` or
//! `RUST_LOG`.

use tracing_subscriber::EnvFilter;

use crate::config::{LogConfig, LogFormat};

/// Installs the global subscriber; a second call (tests) is a no-op.
pub fn init(cfg: &LogConfig) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(&cfg.level));
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
    let _ = match cfg.format {
        LogFormat::Human => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}
