//! SIGHUP: the access log's file opened again, the config file read again
//! and what can change while serving applied (the log filter, the access
//! log's filtered rate, the admin token); every other changed key is named
//! as needing a restart. A reload never stops the process, and a file that
//! does not load changes nothing.

use std::sync::Arc;

use tokio::sync::watch;

use crate::config::Config;
use crate::gateway::Gateway;

#[cfg(unix)]
type Hangups = Option<tokio::signal::unix::Signal>;
#[cfg(not(unix))]
type Hangups = Option<()>;

#[cfg(unix)]
pub(super) fn hangup_signals() -> Hangups {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::hangup()) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!(error = %e, "cannot handle SIGHUP");
            None
        }
    }
}

#[cfg(not(unix))]
pub(super) fn hangup_signals() -> Hangups {
    None
}

#[cfg(unix)]
async fn next_hangup(h: &mut Hangups) {
    match h {
        Some(s) => {
            if s.recv().await.is_none() {
                std::future::pending::<()>().await;
            }
        }
        None => std::future::pending::<()>().await,
    }
}

#[cfg(not(unix))]
async fn next_hangup(_h: &mut Hangups) {
    std::future::pending::<()>().await
}

/// On each SIGHUP: the config file read again, the log filter and the
/// admin token applied; nothing else changes, and nothing stops.
pub(super) async fn reload_on_hangup(
    mut hangups: Hangups,
    path: Option<std::path::PathBuf>,
    admin_on: bool,
    gateway: Arc<Gateway>,
    tokens: watch::Sender<Option<String>>,
    mut shutdown: crate::shutdown::Shutdown,
) {
    loop {
        tokio::select! {
            () = shutdown.fired() => return,
            () = next_hangup(&mut hangups) => {}
        }
        // First and whatever the config file holds: logrotate moved the
        // file and waits for nothing else.
        if let Some(access) = crate::access::global()
            && gateway.config.log.access_file.is_some()
        {
            access.reopen();
        }
        let Some(path) = &path else {
            tracing::info!("SIGHUP: no config file to reload");
            continue;
        };
        let new = match Config::load(path) {
            Ok(c) => c,
            Err(e) => {
                tracing::error!(error = %e, "SIGHUP: the config does not load; nothing reloaded");
                continue;
            }
        };
        for d in &new.deprecations {
            tracing::warn!("SIGHUP: {d}");
        }
        match crate::telemetry::reload(&new.log) {
            Ok(filter) => tracing::info!(filter, "SIGHUP: log filter reloaded"),
            Err(e) => tracing::error!(error = %e, "SIGHUP: log filter not reloaded"),
        }
        if let Some(access) = crate::access::global() {
            access.set_filtered_rate(new.log.access_filtered_rate);
        }
        match new.admin.token() {
            Ok(Some(token)) if admin_on => {
                tokens.send_replace(Some(token));
                tracing::info!("SIGHUP: admin token reloaded");
            }
            Ok(Some(_)) => tracing::warn!(
                "SIGHUP: an admin token is configured now, but the admin listener was off at \
                 start: restart to open it"
            ),
            Ok(None) if admin_on => tracing::warn!(
                "SIGHUP: no admin token configured now; the one in force stays (restart to \
                 close the admin listener)"
            ),
            Ok(None) => {}
            Err(e) => tracing::error!(error = %e, "SIGHUP: admin token not reloaded"),
        }
        let restart = needs_restart(&gateway.config, &new);
        if !restart.is_empty() {
            tracing::warn!(
                keys = %restart.join(", "),
                "SIGHUP: {} changed; that takes effect at the next restart (only log.level, \
                 log.access, log.access_filtered_rate and the admin token are reloaded)",
                restart.join(", ")
            );
        }
    }
}

/// The keys `new` changes that SIGHUP does not reload, named (never their
/// values) for the log.
fn needs_restart(old: &Config, new: &Config) -> Vec<String> {
    const RELOADED: [&str; 4] = [
        "log.level",
        "log.access",
        "log.access_filtered_rate",
        "admin.token_file",
    ];
    old.changed_keys(new)
        .into_iter()
        .filter(|k| !RELOADED.contains(&k.as_str()))
        .collect()
}
