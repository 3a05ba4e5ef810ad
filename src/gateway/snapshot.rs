//! The gateway at one moment: every component's snapshot, which the admin
//! API serializes and `/metrics` renders ([`GatewaySnapshot`]), and the
//! task that reads the primary's WAL position for the feed's lag.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::Gateway;
use crate::auth::AuthView;
use crate::db::Db;
use crate::db::replicas::ReplicaSnapshot;
use crate::db::stats::DbSnapshot;
use crate::exposition::{Expose, Exposition, Labels};
use crate::feed::stats::{FeedSnapshot, Progress};
use crate::resource::{RequestOutcome, ResourceSnapshot};
use crate::shutdown::Shutdown;
use crate::traffic::TrafficSnapshot;

/// How often the WAL feed's lag behind the primary is read.
pub const PRIMARY_LSN_EVERY: Duration = Duration::from_secs(1);

pub struct GatewaySnapshot {
    /// Milliseconds since the Unix epoch.
    pub time_ms: u64,
    pub ready: bool,
    /// Something shared by the fleet is wrong (see `Readiness::degraded`).
    pub degraded: bool,
    /// How long the database has been unreachable (`db::outage`); 0: it
    /// answers.
    pub outage_seconds: f64,
    pub db: DbSnapshot,
    pub replicas: Vec<ReplicaSnapshot>,
    pub feed: FeedSnapshot,
    pub traffic: TrafficSnapshot,
    pub auth: AuthView,
    pub resources: Vec<ResourceSnapshot>,
    /// The shared change stream (`bus.url`), if configured.
    pub bus: Option<BusSnapshot>,
}

/// The bus as this gateway sees it.
#[derive(Clone, Debug, Default)]
pub struct BusSnapshot {
    pub relaying: bool,
    /// Following a direct WAL feed of its own while the bus is not current.
    pub direct: bool,
    /// Following nothing: the bus is not current and no direct-feed
    /// ticket is free (`bus.max_direct_fallback`).
    pub lost: bool,
    pub counters: crate::feed::bus::Counters,
    /// With `bus.fleet_key_file`: what the fleet's snapshots did here.
    pub snapshots: Option<crate::snapshot::Totals>,
}

impl Expose for BusSnapshot {
    fn expose(&self, _: Labels<'_>, out: &mut Exposition) {
        let b = |v: bool| f64::from(u8::from(v));
        out.gauge(
            "bloomgate_bus_relaying",
            "1 while this gateway is the bus's relay (it holds bus.slot).",
            &[],
            b(self.relaying),
        );
        out.gauge(
            "bloomgate_bus_direct",
            "1 while this gateway follows a direct WAL feed because the bus is not current.",
            &[],
            b(self.direct),
        );
        out.gauge(
            "bloomgate_bus_lost",
            "1 while this gateway follows nothing: the bus is not current and bus.max_direct_fallback gateways follow the WAL themselves (its resources answer from the database).",
            &[],
            b(self.lost),
        );
        if let (Some(used), Some(max)) = (self.counters.redis_used, self.counters.redis_max) {
            out.gauge(
                "bloomgate_bus_redis_memory_used_bytes",
                "The bus's Redis used_memory, read every 10 s by the relay (only the relay has it).",
                &[],
                used as f64,
            );
            out.gauge(
                "bloomgate_bus_redis_memory_max_bytes",
                "The bus's Redis maxmemory (0: no limit), read with used_memory: at it, Redis refuses the relay's appends (noeviction, volatile-*) or evicts (allkeys-*).",
                &[],
                max as f64,
            );
        }
        out.gauge(
            "bloomgate_bus_lag_bytes",
            "How far the stream read is behind the primary's flush position.",
            &[],
            self.counters.lag_bytes as f64,
        );
        out.gauge(
            "bloomgate_bus_lag_seconds",
            "How long since the stream last proved it reached the primary's position.",
            &[],
            self.counters.lag_ms as f64 / 1e3,
        );
        for (name, help, v) in [
            (
                "bloomgate_bus_fallbacks_total",
                "Switches from the bus to a direct feed.",
                self.counters.fallbacks,
            ),
            (
                "bloomgate_bus_returns_total",
                "Switches from a direct feed back to the bus.",
                self.counters.returns,
            ),
            (
                "bloomgate_bus_breaks_total",
                "Continuity breaks in the stream (each a resync).",
                self.counters.breaks,
            ),
            (
                "bloomgate_bus_entries_read_total",
                "Stream entries read.",
                self.counters.read,
            ),
            (
                "bloomgate_bus_entries_appended_total",
                "Stream entries appended as the relay.",
                self.counters.appended,
            ),
            (
                "bloomgate_bus_relay_terms_total",
                "Times this gateway became the relay.",
                self.counters.terms,
            ),
        ] {
            out.counter(name, help, &[], v as f64);
        }
        let Some(s) = &self.snapshots else { return };
        for (name, help, v) in [
            (
                "bloomgate_bus_snapshots_published_total",
                "Filters this gateway published on the bus for the fleet (bus.fleet_key_file).",
                s.published,
            ),
            (
                "bloomgate_bus_snapshots_loaded_total",
                "Filters this gateway loaded from the fleet's snapshots instead of scanning.",
                s.loaded,
            ),
            (
                "bloomgate_bus_snapshots_unusable_total",
                "Snapshots refused: damaged, changed, sealed under another fleet key, or gone mid-read (each passed over; a scan, never a wrong filter).",
                s.unusable,
            ),
            (
                "bloomgate_bus_snapshot_publish_failures_total",
                "Scans for the fleet whose snapshot was not published (Redis refused it, or changes may have been missed during the rebuild).",
                s.publish_failed,
            ),
        ] {
            out.counter(name, help, &[], v as f64);
        }
        for (why, v) in [
            ("for_fleet", s.scans_for_fleet),
            ("after_wait", s.scans_after_wait),
            ("without_bus", s.scans_without_bus),
            ("after_refusal", s.scans_after_refusal),
        ] {
            out.counter(
                "bloomgate_bus_snapshot_scans_total",
                "Scans of a table this gateway made with snapshots on: the fleet's one scan (for_fleet), by itself past bus.snapshot_wait (after_wait), with Redis or the catalog not answering or this gateway off the bus (without_bus), or after the shrink guard refused the snapshot it loaded (after_refusal).",
                &[("why", why)],
                v as f64,
            );
        }
        out.gauge(
            "bloomgate_bus_snapshot_last_bytes",
            "Bytes of the last snapshot this gateway published (sealed chunks in Redis).",
            &[],
            s.last_bytes as f64,
        );
    }
}

impl Gateway {
    /// Every component's counters and gauges as of now (each resource's
    /// filter stats scan a Bloom filter's bits).
    pub fn snapshot(&self) -> GatewaySnapshot {
        let resources: Vec<ResourceSnapshot> =
            self.resources.iter().map(|r| r.snapshot()).collect();
        let mut traffic = self.stats.traffic.snapshot();
        for r in &self.resources {
            traffic.shed_by_resources += r.stats.shed_in_front.load(Ordering::Relaxed);
            traffic.timeouts_by_resources += r.stats.count(RequestOutcome::Timeout);
        }
        let server = &self.config.server;
        traffic.max_connections = server.max_connections as u64;
        traffic.max_concurrency = server.max_concurrency as u64;
        traffic.loads_in_flight = server
            .max_concurrency
            .saturating_sub(self.loads.available_permits())
            as u64;
        let wal = self.wal_stats.snapshot();
        let feed = match self.freshness() {
            None => FeedSnapshot::default(),
            Some(f) => FeedSnapshot::new(
                crate::feed::supervisor::name(f),
                match f {
                    crate::config::Freshness::Wal => super::wal_delivery(&self.config.database),
                    _ => String::new(),
                },
                self.feed_health(),
                &self.stats.progress,
                wal.applied_lsn_value,
                self.stats.feed.snapshot(),
                wal,
            ),
        };
        let readiness = self.readiness();
        GatewaySnapshot {
            time_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default()
                .as_millis() as u64,
            ready: readiness.is_empty(),
            degraded: !readiness.degraded.is_empty(),
            outage_seconds: self
                .db
                .outage
                .down_for()
                .map_or(0.0, |d| d.as_secs_f64().max(0.001)),
            db: self.db.snapshot(),
            replicas: self
                .db
                .replicas()
                .map(|reps| reps.members().iter().map(|r| r.snapshot()).collect())
                .unwrap_or_default(),
            feed,
            traffic,
            auth: self.auth.view(),
            resources,
            bus: self.bus_status().map(|b| {
                let st = b.get();
                BusSnapshot {
                    relaying: st.relaying,
                    direct: st.mode == crate::feed::bus::Follows::Direct,
                    lost: st.mode == crate::feed::bus::Follows::Lost,
                    counters: b.counters(),
                    snapshots: self.snapshot_store().map(|s| s.stats().totals()),
                }
            }),
        }
    }
}

impl Expose for GatewaySnapshot {
    fn expose(&self, _: Labels<'_>, out: &mut Exposition) {
        out.gauge(
            "bloomgate_ready",
            "1 while /readyz answers 200.",
            &[],
            f64::from(u8::from(self.ready)),
        );
        out.gauge(
            "bloomgate_degraded",
            "1 while something every gateway of a fleet shares is wrong (the database unreachable, a resource not vouched for and answered from the database, the feed or the bus down): /readyz says so in its body and, under server.readiness = \"local\", still answers 200.",
            &[],
            f64::from(u8::from(self.degraded)),
        );
        out.gauge(
            "bloomgate_db_outage_seconds",
            "How long the primary has been unreachable (connections refused or cut), as the row loads and checks find it; 0 while it answers. Meanwhile resources answer what was last vouched for, within cache.stale_if_error (outcome=\"stale\").",
            &[],
            self.outage_seconds,
        );
        for r in &self.resources {
            r.expose(&[], out);
        }
        self.traffic.expose_all(out);
        self.db.expose_all(out);
        for r in &self.replicas {
            r.expose(&[], out);
        }
        self.feed.expose_all(out);
        self.auth.expose(&[], out);
        if let Some(b) = &self.bus {
            b.expose(&[], out);
        }
    }
}

/// Reads the primary's WAL position every [`PRIMARY_LSN_EVERY`] into
/// `progress`, so that the WAL feed's lag in bytes moves while nothing is
/// applied. A failed read leaves the last value (the feed's own health
/// says the database is away).
pub async fn read_primary_lsn(db: Arc<Db>, progress: Arc<Progress>, mut shutdown: Shutdown) {
    let mut tick = tokio::time::interval(PRIMARY_LSN_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = shutdown.fired() => return,
            _ = tick.tick() => {}
        }
        let read: Result<i64, _> =
            sqlx::query_scalar("SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::int8")
                .fetch_one(db.pool())
                .await;
        if let Ok(lsn) = read {
            progress
                .primary_lsn
                .store(u64::try_from(lsn).unwrap_or(0), Ordering::Relaxed);
        }
    }
}
