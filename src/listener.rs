//! Key-change notifications: one `LISTEN bloomgate` connection per gateway.
//!
//! The `bloomgate_notify` triggers (see `migrations/`) announce each insert,
//! update and delete at commit. Applying them keeps every replica fresh:
//!
//! - insert: the key goes into the live filter (and the rebuild journal, if a
//!   rebuild runs) and any negative entry for it is dropped;
//! - update: the cached row is dropped (a changed key counts as a delete of
//!   the old key and an insert of the new);
//! - delete: the cached row is dropped; the filter keeps the key until the
//!   next rebuild, the database answers 404 and the negative cache keeps
//!   repeats cheap;
//! - truncate, or a key too long to announce: rebuild.
//!
//! # Nothing falls through a gap
//! Start-up subscribes *before* the first scan, so every change committed
//! after that scan's snapshot is announced to a listener that is already
//! listening (the rebuild journal carries it into the new filter; see
//! `resource`). Notifications sent while the connection is down are lost,
//! and Postgres cannot tell us which, so every reconnect is followed by a
//! rebuild of every filter whose snapshot is taken after `LISTEN` again.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::Deserialize;
use sqlx::PgPool;
use sqlx::postgres::{PgListener, PgPoolOptions};
use tokio::sync::oneshot;

use crate::gateway::Gateway;
use crate::key::{self, Key};
use crate::resource::Resource;
use crate::telemetry::LogThrottle;

/// The channel the triggers notify.
pub const CHANNEL: &str = "bloomgate";

#[derive(Debug, Deserialize)]
struct Payload {
    table: String,
    op: String,
    key: Option<String>,
    old_key: Option<String>,
    ts: Option<f64>,
}

/// Listens until aborted. `listening` fires once the first `LISTEN` is in
/// place (or never, if the database never answers).
pub async fn run(gateway: Arc<Gateway>, listening: oneshot::Sender<()>) {
    // Its own one-connection pool: the listener holds its connection for
    // good, which must not cost the request path a connection.
    let opts = (*gateway.db.pool().connect_options()).clone();
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(5))
        .connect_lazy_with(opts);
    let mut listener = connect(&pool).await;
    let _ = listening.send(());
    // Anyone who can connect can `NOTIFY bloomgate`; a loop of junk must not
    // become a flood of log lines.
    let ignored = LogThrottle::default();
    loop {
        match listener.try_recv().await {
            Ok(Some(n)) => apply(&gateway, n.payload(), &ignored).await,
            Ok(None) => {
                // sqlx has reconnected and listens again already.
                reconnected(&gateway, "connection lost");
            }
            Err(e) => {
                tracing::warn!(error = %e, "notification listener failed; reconnecting");
                drop(listener);
                listener = connect(&pool).await;
                reconnected(&gateway, "listener error");
            }
        }
    }
}

async fn connect(pool: &PgPool) -> PgListener {
    let mut delay = Duration::from_millis(100);
    loop {
        let attempt = async {
            let mut l = PgListener::connect_with(pool).await?;
            l.listen(CHANNEL).await?;
            Ok::<_, sqlx::Error>(l)
        };
        match attempt.await {
            Ok(l) => return l,
            Err(e) => {
                tracing::warn!(error = %e, retry_in = ?delay, "cannot subscribe to key changes yet");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(5));
            }
        }
    }
}

/// Changes may have been missed: rebuild everything, from a snapshot taken
/// now that the listener is subscribed again.
fn reconnected(gateway: &Gateway, why: &str) {
    gateway
        .stats
        .listener_reconnects
        .fetch_add(1, Ordering::Relaxed);
    tracing::warn!(
        reason = why,
        "notification listener reconnected; rebuilding every filter in case changes were missed"
    );
    for r in &gateway.resources {
        spawn_rebuild(r);
    }
}

fn spawn_rebuild(r: &Arc<Resource>) {
    if r.config.filter.enabled {
        let r = r.clone();
        // Outcome is logged and counted inside; a refused or failed rebuild
        // keeps the current filter.
        tokio::spawn(async move { r.rebuild(false).await });
    }
}

async fn apply(gateway: &Gateway, payload: &str, ignored: &LogThrottle) {
    let stats = &gateway.stats;
    stats.notifications.fetch_add(1, Ordering::Relaxed);
    let p: Payload = match serde_json::from_str(payload) {
        Ok(p) => p,
        Err(e) => {
            if let Some(not_logged) = ignored.permit() {
                tracing::warn!(error = %e, not_logged, "ignoring a malformed notification");
            }
            return;
        }
    };
    if let Some(ts) = p.ts {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs_f64();
        let lag_us = ((now - ts).max(0.0) * 1e6) as u64;
        stats
            .last_notification_lag_us
            .store(lag_us, Ordering::Relaxed);
    }
    for r in gateway
        .resources
        .iter()
        .filter(|r| table_matches(&r.config.table, &p.table))
    {
        let ty = r.key_type();
        let new = p.key.as_deref().and_then(|k| key::from_db_text(k, ty));
        let old = p.old_key.as_deref().and_then(|k| key::from_db_text(k, ty));
        match p.op.as_str() {
            "INSERT" => insert(r, new).await,
            "UPDATE" => {
                if new != old {
                    insert(r, new).await;
                }
                invalidate(r, old).await;
            }
            "DELETE" => invalidate(r, old).await,
            "TRUNCATE" => {
                r.clear_cache();
                spawn_rebuild(r);
            }
            "RESCAN" => spawn_rebuild(r),
            other => {
                if let Some(not_logged) = ignored.permit() {
                    // Debug-quoted and cut short: the text is whatever the
                    // sender chose, newlines included.
                    let op: String = other.chars().take(32).collect();
                    tracing::warn!(
                        op = ?op,
                        not_logged,
                        "ignoring a notification with an unknown op"
                    );
                }
            }
        }
    }
}

async fn insert(r: &Resource, key: Option<Key>) {
    match key {
        Some(k) => r.insert_key(&k).await,
        // A key we cannot parse can never be requested either.
        None => tracing::debug!(resource = %r.name(), "notified key does not fit the key type"),
    }
}

async fn invalidate(r: &Resource, key: Option<Key>) {
    if let Some(k) = key {
        r.invalidate(&k).await;
    }
}

/// `users` matches `public.users` and `users`; `app.users` matches only
/// `app.users`.
fn table_matches(resource_table: &str, announced: &str) -> bool {
    resource_table == announced
        || (!resource_table.contains('.') && announced.rsplit('.').next() == Some(resource_table))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_match_with_or_without_schema() {
        assert!(table_matches("users", "public.users"));
        assert!(table_matches("users", "users"));
        assert!(table_matches("app.users", "app.users"));
        assert!(!table_matches("app.users", "public.users"));
        assert!(!table_matches("users", "public.users_archive"));
        assert!(!table_matches("users", "public.ausers"));
    }
}
