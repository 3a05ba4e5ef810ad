//! A resource's counters, and the one snapshot of them that the admin API
//! and `/metrics` both render ([`ResourceSnapshot`]).
//!
//! Every request to a resource ends in exactly one [`RequestOutcome`],
//! recorded once, by [`Stats::record`], where the request is answered
//! (`http::lookup`; a shed request in the front layer's hook, a timed-out
//! one where its lookup is dropped): one latency sample, in that outcome's
//! histogram. `bloomgate_requests_total` is those histograms' counts, so
//! it and the latency cannot disagree, and the sum over outcomes is all
//! traffic to the resource, refused (shed, timed out) included, except a
//! request whose client left before its answer, counted nowhere. The other
//! counters here are details within an outcome (`unverified` within
//! `unavailable`, `shed_loads` within `shed`) or are not about requests.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::Serialize;

use super::{BuildReport, Resource};
use crate::db::stats::{QueriesSnapshot, QueryCounts};
use crate::exposition::{Expose, Exposition, Labels};
use crate::filter::FilterStats;
use crate::histogram::{self, Histogram, RareHistogram, SLOW_BOUNDS};
use crate::traffic::{REQUESTS_TOTAL, REQUESTS_TOTAL_HELP};

/// How a request to a resource was answered: the `outcome` label.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RequestOutcome {
    /// 404: the filter knows the key does not exist.
    Filtered,
    /// 200/304 from the cache.
    Hit,
    /// 404 from the negative cache.
    NegativeHit,
    /// Loaded from the database (stored, bypassed or not vouched for).
    Miss,
    /// Answered by another request's load.
    Collapsed,
    /// 400: a malformed key.
    BadRequest,
    /// 503: the database did not answer, or an unverified key past its
    /// budget.
    Unavailable,
    /// 503 before the filter is built.
    NotReady,
    Unauthorized,
    /// 403, or the 404 of another owner's key or row.
    Forbidden,
    RateLimited,
    /// 503: past `max_concurrency` requests or row loads in flight.
    Shed,
    /// 504: past `request_timeout`.
    Timeout,
    /// 200 or 404 from what was last vouched for while the database cannot
    /// be reached (`cache.stale_if_error`).
    Stale,
    /// 500: the key matched two rows (see `db::Queries::row`).
    KeyNotUnique,
}

impl RequestOutcome {
    pub const ALL: [RequestOutcome; 15] = [
        Self::Filtered,
        Self::Hit,
        Self::NegativeHit,
        Self::Miss,
        Self::Collapsed,
        Self::BadRequest,
        Self::Unavailable,
        Self::NotReady,
        Self::Unauthorized,
        Self::Forbidden,
        Self::RateLimited,
        Self::Shed,
        Self::Timeout,
        Self::Stale,
        Self::KeyNotUnique,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Filtered => "filtered",
            Self::Hit => "hit",
            Self::NegativeHit => "negative_hit",
            Self::Miss => "miss",
            Self::Collapsed => "collapsed",
            Self::BadRequest => "bad_request",
            Self::Unavailable => "unavailable",
            Self::NotReady => "not_ready",
            Self::Unauthorized => "unauthorized",
            Self::Forbidden => "forbidden",
            Self::RateLimited => "rate_limited",
            Self::Shed => "shed",
            Self::Timeout => "timeout",
            Self::Stale => "stale",
            Self::KeyNotUnique => "key_not_unique",
        }
    }
}

/// Counters for metrics and the admin API. Monotonic. Requests are
/// counted by their latency samples ([`Stats::record`]), whose histograms
/// are sharded by thread: a plain atomic on a fast path (a filtered 404,
/// a cached hit) is a cache line both cores write on every request.
#[derive(Debug)]
pub struct Stats {
    /// The filter said "maybe" and the database said "no": observed false
    /// positives (and deleted rows the filter still holds).
    pub observed_absent: AtomicU64,
    pub rebuilds: AtomicU64,
    pub rebuild_failures: AtomicU64,
    /// Retries of rebuilds that recover missed keys: one per back-off,
    /// however many such rebuilds failed during it.
    pub rebuild_retries: AtomicU64,
    pub refused_swaps: AtomicU64,
    pub live_inserts: AtomicU64,
    /// Keys above the high-water mark checked against the database instead
    /// of rejected (`verify_above_high_water`).
    pub verified_above_high_water: AtomicU64,
    /// Deletes applied ([`Resource::note_delete`]).
    pub deletes: AtomicU64,
    /// Announced keys above the high-water mark that the database did not
    /// confirm (forged, or deleted again): they did not raise the mark.
    pub announced_unconfirmed: AtomicU64,
    /// Keys a refused rebuild's scan found missing from the live filter and
    /// added to it.
    pub recovered_keys: AtomicU64,
    /// Rebuilds requested because the protection decayed (false-positive
    /// rate, deletes, growth).
    pub decay_rebuilds: AtomicU64,
    /// Promotions the filter was kept across (see "Across a promotion" in
    /// `live_filter`).
    pub kept_across_failover: AtomicU64,
    /// Loads refused because `max_concurrency` loads were in flight (503),
    /// within the `shed` outcome.
    pub shed_loads: AtomicU64,
    /// Requests refused by the front layer at `max_concurrency` requests in
    /// flight, within the `shed` outcome: counted in the same hook as
    /// their outcome, so the gateway's unrouted share never runs
    /// backwards between two scrapes.
    pub shed_in_front: AtomicU64,
    /// Lookups answered from the database past filter and cache because
    /// they were not vouched for (see [`crate::vouch`]).
    pub unvouched_loads: AtomicU64,
    /// Keys the filter rejected while not vouched for, past the
    /// `verify_budget`: 503, as nothing could say they do not exist;
    /// within the `unavailable` outcome.
    pub unverified: AtomicU64,
    /// Unix time in milliseconds of the latest failed rebuild; 0: none.
    pub last_failure_ms: AtomicU64,
    /// Request latency, one histogram per [`RequestOutcome`].
    latency: [Histogram; RequestOutcome::ALL.len()],
    /// How long successful builds took.
    build_durations: RareHistogram,
    /// This resource's database queries by kind and target (shared with
    /// the loads a cache miss spawns, which outlive a borrow).
    pub db_queries: Arc<QueryCounts>,
}

impl Default for Stats {
    fn default() -> Self {
        Self {
            observed_absent: AtomicU64::default(),
            rebuilds: AtomicU64::default(),
            rebuild_failures: AtomicU64::default(),
            rebuild_retries: AtomicU64::default(),
            refused_swaps: AtomicU64::default(),
            live_inserts: AtomicU64::default(),
            verified_above_high_water: AtomicU64::default(),
            deletes: AtomicU64::default(),
            announced_unconfirmed: AtomicU64::default(),
            recovered_keys: AtomicU64::default(),
            decay_rebuilds: AtomicU64::default(),
            kept_across_failover: AtomicU64::default(),
            shed_loads: AtomicU64::default(),
            shed_in_front: AtomicU64::default(),
            unvouched_loads: AtomicU64::default(),
            unverified: AtomicU64::default(),
            last_failure_ms: AtomicU64::default(),
            latency: Default::default(),
            build_durations: RareHistogram::new(&SLOW_BOUNDS),
            db_queries: Arc::default(),
        }
    }
}

fn l(a: &AtomicU64) -> u64 {
    a.load(Ordering::Relaxed)
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).unwrap_or_default().as_millis() as u64
}

impl Stats {
    /// A request to this resource, answered with `outcome` after
    /// `elapsed`: the one place a request is counted.
    pub fn record(&self, outcome: RequestOutcome, elapsed: Duration) {
        self.latency[outcome as usize].record(elapsed);
    }

    /// A successful build, and how long it took.
    pub fn built(&self, took: Duration) {
        self.rebuilds.fetch_add(1, Ordering::Relaxed);
        self.build_durations.record(took);
    }

    /// A failed build (the old filter stays).
    pub fn build_failed(&self) {
        self.rebuild_failures.fetch_add(1, Ordering::Relaxed);
        self.last_failure_ms
            .store(unix_ms(SystemTime::now()), Ordering::Relaxed);
    }

    /// Requests answered with `outcome` so far.
    pub fn count(&self, outcome: RequestOutcome) -> u64 {
        self.latency[outcome as usize].count()
    }

    /// The counters as of now.
    pub fn snapshot(&self) -> StatsSnapshot {
        let latency: Vec<_> = self.latency.iter().map(Histogram::snapshot).collect();
        let requests = |o: RequestOutcome| latency[o as usize].count;
        let observed = l(&self.observed_absent);
        let absent_asked = requests(RequestOutcome::Filtered) + observed;
        StatsSnapshot {
            requests: RequestOutcome::ALL
                .iter()
                .map(|&o| (o.as_str(), requests(o)))
                .collect(),
            unverified_loads: l(&self.unvouched_loads),
            unverified_refused: l(&self.unverified),
            observed_false_positives: observed,
            observed_fp_rate: if absent_asked == 0 {
                0.0
            } else {
                observed as f64 / absent_asked as f64
            },
            rebuilds: l(&self.rebuilds),
            rebuild_failures: l(&self.rebuild_failures),
            rebuild_retries: l(&self.rebuild_retries),
            rebuild_refused: l(&self.refused_swaps),
            live_inserts: l(&self.live_inserts),
            deletes: l(&self.deletes),
            recovered_keys: l(&self.recovered_keys),
            decay_rebuilds: l(&self.decay_rebuilds),
            kept_across_failover: l(&self.kept_across_failover),
            announced_unconfirmed: l(&self.announced_unconfirmed),
            verified_above_high_water: l(&self.verified_above_high_water),
            unauthorized: requests(RequestOutcome::Unauthorized),
            forbidden: requests(RequestOutcome::Forbidden),
            rate_limited: requests(RequestOutcome::RateLimited),
            last_failure_seconds: l(&self.last_failure_ms) as f64 / 1e3,
            latency,
            build_durations: self.build_durations.snapshot(),
            db_queries: self.db_queries.snapshot(),
        }
    }
}

/// A resource's counters at one moment. Serialized, it is the counters'
/// part of the admin API's resource view (those field names are the API's).
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct StatsSnapshot {
    /// Lookups by outcome.
    #[schema(value_type = BTreeMap<String, u64>)]
    pub requests: BTreeMap<&'static str, u64>,
    /// Lookups answered from the database past filter and cache while not
    /// vouched for, and keys rejected then past `verify_budget` (503).
    pub unverified_loads: u64,
    pub unverified_refused: u64,
    /// Keys the filter passed that the database did not have.
    pub observed_false_positives: u64,
    /// observed false positives / absent keys looked up (filtered + observed).
    pub observed_fp_rate: f64,
    pub rebuilds: u64,
    pub rebuild_failures: u64,
    /// Failed rebuilds that recover missed keys, asked for again.
    pub rebuild_retries: u64,
    pub rebuild_refused: u64,
    pub live_inserts: u64,
    /// Deletes applied (counted towards `rebuild_delete_fraction`).
    pub deletes: u64,
    /// Keys a refused rebuild found missing from the filter and added, in
    /// all.
    pub recovered_keys: u64,
    /// Rebuilds the decay limits asked for.
    pub decay_rebuilds: u64,
    /// Promotions the filter was kept across instead of rebuilt.
    pub kept_across_failover: u64,
    /// Announced keys above the mark the database did not confirm.
    pub announced_unconfirmed: u64,
    /// Keys above the high-water mark checked against the database.
    pub verified_above_high_water: u64,
    /// In the admin API under `access`.
    #[serde(skip)]
    pub unauthorized: u64,
    #[serde(skip)]
    pub forbidden: u64,
    #[serde(skip)]
    pub rate_limited: u64,
    /// Unix time of the latest failed rebuild; 0: none.
    #[serde(skip)]
    pub last_failure_seconds: f64,
    #[serde(skip)]
    pub latency: Vec<histogram::Snapshot>,
    #[serde(skip)]
    pub build_durations: histogram::Snapshot,
    #[serde(skip)]
    pub db_queries: QueriesSnapshot,
}

crate::expose_fields!(StatsSnapshot {
    observed_false_positives => counter(
        "bloomgate_filter_false_positives_observed_total",
        "Keys the filter passed that Postgres did not have."
    ),
    rebuilds => counter("bloomgate_rebuilds_total", "Successful filter builds."),
    rebuild_failures => counter(
        "bloomgate_rebuild_failures_total",
        "Failed rebuilds (the old filter stayed)."
    ),
    rebuild_retries => counter(
        "bloomgate_rebuild_retries_total",
        "Retries of rebuilds that recover missed keys (after a feed reconnect, a rescan): one per back-off, however many such rebuilds failed during it."
    ),
    rebuild_refused => counter(
        "bloomgate_rebuild_refused_total",
        "Rebuilds refused by the shrink guard."
    ),
    decay_rebuilds => counter(
        "bloomgate_decay_rebuilds_total",
        "Rebuilds requested because the filter's protection decayed (false-positive rate, deletes, growth)."
    ),
    kept_across_failover => counter(
        "bloomgate_filter_kept_across_failover_total",
        "Promotions the filter was kept across (its build saw nothing the new timeline lost) instead of rebuilt."
    ),
    live_inserts => counter(
        "bloomgate_live_inserts_total",
        "Keys added to the live filter from the change feed."
    ),
    deletes => counter("bloomgate_live_deletes_total", "Deletes applied from the change feed."),
    last_failure_seconds => gauge(
        "bloomgate_rebuild_last_failure_timestamp_seconds",
        "Unix time of the latest failed rebuild; 0: none since start."
    ),
});

/// A resource at one moment: its counters, cache, filter and latest build.
#[derive(Clone, Debug)]
pub struct ResourceSnapshot {
    pub name: String,
    pub stats: StatsSnapshot,
    pub cache_rows: u64,
    pub cache_negative: u64,
    /// Bytes when `cache.max_bytes` bounds the cache, else rows.
    pub cache_weighted_size: u64,
    pub generation: u64,
    pub filter: Option<FilterStats>,
    pub last_build: Option<BuildReport>,
    /// `filter.false_positive_rate`, and `filter.rebuild_interval` in
    /// seconds (0: no schedule): what the filter is held against.
    pub target_fp_rate: f64,
    pub rebuild_interval_seconds: f64,
}

impl Resource {
    /// Counters, cache sizes, filter stats (a scan of a Bloom filter's
    /// bits) and the latest build, as of now.
    pub fn snapshot(&self) -> ResourceSnapshot {
        let (cache_rows, cache_negative) = self.cache_entries();
        ResourceSnapshot {
            name: self.name().to_string(),
            stats: self.stats.snapshot(),
            cache_rows,
            cache_negative,
            cache_weighted_size: self.cache_weighted_size(),
            generation: self.generation(),
            filter: self.filter_stats(),
            last_build: self.last_build(),
            target_fp_rate: self.config.filter.false_positive_rate,
            rebuild_interval_seconds: self.config.filter.rebuild_interval.as_secs_f64(),
        }
    }
}

impl Expose for ResourceSnapshot {
    /// `labels` are ignored: every sample is labelled by `resource`.
    fn expose(&self, _: Labels<'_>, out: &mut Exposition) {
        let resource = [("resource", self.name.as_str())];
        let labels: Labels<'_> = &resource;
        for (o, latency) in RequestOutcome::ALL.iter().zip(&self.stats.latency) {
            let l = [("resource", self.name.as_str()), ("outcome", o.as_str())];
            out.counter(
                REQUESTS_TOTAL,
                REQUESTS_TOTAL_HELP,
                &l,
                self.stats.requests[o.as_str()] as f64,
            );
            out.histogram(
                "bloomgate_request_duration_seconds",
                "Lookup latency by resource and outcome.",
                &l,
                latency,
            );
        }
        self.stats.expose(labels, out);
        self.stats.db_queries.expose(&self.name, out);
        out.histogram(
            "bloomgate_rebuild_duration_seconds",
            "Duration of successful filter builds (scan, journal replay, swap).",
            labels,
            &self.stats.build_durations,
        );
        for (kind, n) in [("row", self.cache_rows), ("negative", self.cache_negative)] {
            out.gauge(
                "bloomgate_cache_entries",
                "Cached rows (kind=row) and negative entries (kind=negative).",
                &[("resource", self.name.as_str()), ("kind", kind)],
                n as f64,
            );
        }
        out.gauge(
            "bloomgate_cache_weighted_size",
            "Size of the row cache against its bound: bytes when cache.max_bytes is set, otherwise rows.",
            labels,
            self.cache_weighted_size as f64,
        );
        out.gauge(
            "bloomgate_filter_generation",
            "Filters swapped in so far.",
            labels,
            self.generation as f64,
        );
        out.gauge(
            "bloomgate_filter_target_fp_rate",
            "filter.false_positive_rate: the false-positive rate the filter is sized for.",
            labels,
            self.target_fp_rate,
        );
        out.gauge(
            "bloomgate_rebuild_interval_seconds",
            "filter.rebuild_interval: the schedule of rebuilds (0: none).",
            labels,
            self.rebuild_interval_seconds,
        );
        if let Some(f) = &self.filter {
            let g = |out: &mut Exposition, name, help, v: f64| out.gauge(name, help, labels, v);
            g(
                out,
                "bloomgate_filter_size_bytes",
                "Memory of the live filter's key set.",
                f.bytes as f64,
            );
            g(
                out,
                "bloomgate_filter_hashes",
                "Bits set per key (0 for an exact set).",
                f64::from(f.hashes),
            );
            g(
                out,
                "bloomgate_filter_keys",
                "Keys inserted into the live filter.",
                f.keys as f64,
            );
            g(
                out,
                "bloomgate_filter_fill_ratio",
                "Set bits / bits (exact: keys / id range).",
                f.fill_ratio,
            );
            g(
                out,
                "bloomgate_filter_estimated_fp_rate",
                "False-positive rate estimated from the fill ratio.",
                f.estimated_fp_rate,
            );
        }
        if let Some(b) = &self.last_build {
            out.gauge(
                "bloomgate_rebuild_last_success_timestamp_seconds",
                "Unix time the live filter was built.",
                labels,
                unix_ms(b.built_at) as f64 / 1e3,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_outcome_has_its_own_index_and_name() {
        for (i, o) in RequestOutcome::ALL.iter().enumerate() {
            assert_eq!(*o as usize, i);
        }
        let mut names: Vec<_> = RequestOutcome::ALL.iter().map(|o| o.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), RequestOutcome::ALL.len());
    }

    #[test]
    fn a_snapshot_renders_requests_latency_and_counters_per_resource() {
        let s = Stats::default();
        s.record(RequestOutcome::Hit, Duration::from_micros(30));
        s.record(RequestOutcome::Hit, Duration::from_micros(50));
        for _ in 0..3 {
            s.record(RequestOutcome::Shed, Duration::ZERO);
        }
        assert_eq!(s.count(RequestOutcome::Hit), 2);
        assert_eq!(s.count(RequestOutcome::Miss), 0);
        s.built(Duration::from_secs(2));
        let snap = ResourceSnapshot {
            name: "users".into(),
            stats: s.snapshot(),
            cache_rows: 1,
            cache_negative: 0,
            cache_weighted_size: 1,
            generation: 1,
            filter: None,
            last_build: None,
            target_fp_rate: 0.01,
            rebuild_interval_seconds: 600.0,
        };
        let mut e = Exposition::default();
        snap.expose(&[], &mut e);
        let text = e.render();
        for line in [
            "bloomgate_requests_total{resource=\"users\",outcome=\"hit\"} 2\n",
            "bloomgate_requests_total{resource=\"users\",outcome=\"shed\"} 3\n",
            "bloomgate_request_duration_seconds_count{resource=\"users\",outcome=\"hit\"} 2\n",
            "bloomgate_rebuilds_total{resource=\"users\"} 1\n",
            "bloomgate_rebuild_duration_seconds_bucket{resource=\"users\",le=\"5\"} 1\n",
        ] {
            assert!(text.contains(line), "{line}{text}");
        }
    }
}
