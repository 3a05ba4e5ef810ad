//! Whether the gateway belongs in the load balancer, and why not: the
//! reasons `/readyz` gives (a resource still loading or not vouched for,
//! the feed, the access checks, a shutdown), and what is degraded but
//! shared by the whole fleet, so never a reason (`server.readiness`).

use crate::config::{Freshness, ReadinessPolicy};
use crate::feed;

use super::Gateway;
use crate::resource::Stale;

/// What stands between the gateway and readiness: each resource's reason
/// (a filter loading, a resync, a table the feed cannot follow, a feed not
/// proven current), the feed's own (waiting for its slot, say) and the
/// access checks' (a key set not fetched yet). Safe to show: no SQL, no
/// secret.
#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct Readiness {
    pub resources: Vec<(String, String)>,
    pub feed: Option<String>,
    pub auth: Option<String>,
    /// Start-up cannot reach the database, and why (a database that does
    /// not exist, a refused login, a refused connection): the log says it
    /// too, but a probe's caller reads only this.
    pub database: Option<String>,
    /// The process is shutting down (`server.shutdown_drain`).
    pub shutdown: Option<String>,
    /// What is wrong but shared by every gateway of the fleet, so not a
    /// reason to leave the load balancer (a load balancer that drops every
    /// gateway at once answers nothing at all; `server.readiness`): the
    /// database unreachable, a resource not vouched for (answered from the
    /// database, or during an outage from what was last vouched for: see
    /// "Outages" in `resource`), the feed or the bus not streaming.
    /// Reported in `/readyz`'s body, `bloomgate_degraded` and alerts,
    /// never as 503.
    pub degraded: Vec<(String, String)>,
}

impl Readiness {
    /// Nothing keeps the gateway out of the load balancer ([`Self::degraded`]
    /// does not).
    pub fn is_empty(&self) -> bool {
        self.resources.is_empty()
            && self.database.is_none()
            && self.feed.is_none()
            && self.auth.is_none()
            && self.shutdown.is_none()
    }
}

impl std::fmt::Display for Readiness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut parts: Vec<String> = Vec::new();
        if let Some(shutdown) = &self.shutdown {
            parts.push(format!("shutdown: {shutdown}"));
        }
        if let Some(database) = &self.database {
            parts.push(format!("database: {database}"));
        }
        if let Some(feed) = &self.feed {
            parts.push(format!("change feed: {feed}"));
        }
        if let Some(auth) = &self.auth {
            parts.push(format!("auth: {auth}"));
        }
        for (r, why) in &self.resources {
            parts.push(format!("{r}: {why}"));
        }
        for (r, why) in &self.degraded {
            parts.push(format!("{r} (degraded): {why}"));
        }
        f.write_str(&parts.join("; "))
    }
}

impl Gateway {
    /// Every resource can answer from its filter and cache, and a key set
    /// at `auth.jwks_url` has been fetched.
    pub fn is_ready(&self) -> bool {
        self.resources.iter().all(|r| r.is_ready()) && self.auth.is_ready()
    }

    /// Why the gateway is not ready, per resource and for the feed, and
    /// what is degraded (see [`Readiness`]). Under `server.readiness =
    /// "local"`, once start-up has finished, a resource not vouched for and
    /// a feed not streaming are degraded, not reasons: every gateway of a
    /// fleet shares their causes (the database, the bus, a failover's
    /// resync), and each still answers correctly, from the database.
    pub fn readiness(&self) -> Readiness {
        let settled = self.config.server.readiness == ReadinessPolicy::Local
            && self.running.load(std::sync::atomic::Ordering::Relaxed);
        let outage = self.db.outage.down_for();
        let mut degraded = Vec::new();
        let mut resources = Vec::new();
        for r in &self.resources {
            if r.note_ready() {
                continue;
            }
            let Some(why) = r.why_not_ready() else {
                continue;
            };
            // A configuration that can never vouch (notify without its
            // triggers and `install_triggers` off, the WAL feed without a
            // publication and `install_feed` off) sends every answer to
            // the database forever: not ready, naming the fix, unless the
            // resource was ready once and lost it at run time, which every
            // gateway shares (degraded, and alerted).
            let never = r.vouch.has_problem() && !r.was_ready();
            if !settled || !r.answers() || never {
                resources.push((r.name().to_string(), why));
                continue;
            }
            let answers = match (outage, r.stale_standing()) {
                (Some(_), Some(Stale::Off)) => {
                    "the database is unreachable and cache.stale_if_error is off: 503 for every key"
                        .to_string()
                }
                (Some(_), Some(Stale::Within { age, window })) => format!(
                    "the database is unreachable: answering what was vouched for {}s ago (cache.stale_if_error {}s), labelled detail=stale",
                    age.as_secs(),
                    window.as_secs()
                ),
                (Some(_), Some(Stale::Past { age, window })) => format!(
                    "the database is unreachable, and what was vouched for {}s ago is past cache.stale_if_error ({}s): 503 for every key",
                    age.as_secs(),
                    window.as_secs()
                ),
                (Some(_), None) => "the database is unreachable: 503 for every key".to_string(),
                (None, _) => {
                    "answered from the database (filter.verify_budget for keys the filter rejects)"
                        .to_string()
                }
            };
            degraded.push((r.name().to_string(), format!("{why}; {answers}")));
        }
        if let Some(down) = outage {
            degraded.insert(
                0,
                (
                    "database".to_string(),
                    format!(
                        "unreachable for {}s (connections refused or cut)",
                        down.as_secs()
                    ),
                ),
            );
        }
        let health = self.feed.get().map(|f| f.health.get()).unwrap_or_default();
        let feed = match health.state {
            feed::FeedState::Streaming => None,
            _ if self.freshness() == Some(Freshness::Off) => None,
            feed::FeedState::Starting => Some(
                health
                    .detail
                    .unwrap_or_else(|| "the change feed is starting".into()),
            ),
            feed::FeedState::Waiting => Some(
                health
                    .detail
                    .unwrap_or_else(|| "the change feed is not streaming".into()),
            ),
        };
        let feed = match feed {
            Some(why) if settled => {
                degraded.push(("change_feed".to_string(), why));
                None
            }
            feed => feed,
        };
        let auth = self.auth.why_not_ready();
        let database = match self.running.load(std::sync::atomic::Ordering::Relaxed) {
            true => None,
            false => self
                .db
                .waiting_on()
                .map(|cause| format!("start-up waits on the database: {cause}")),
        };
        let shutdown = self
            .draining
            .borrow()
            .then(|| "the process is shutting down (server.shutdown_drain)".to_string());
        Readiness {
            resources,
            database,
            feed,
            auth,
            shutdown,
            degraded,
        }
    }
}
