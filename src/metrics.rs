//! Prometheus metrics.
//!
//! Each gateway owns its recorder (not the process-global one), so two
//! gateways in one process, as in the tests, keep separate numbers. Counters
//! are the gateway's own atomics, copied into the recorder when scraped.
//! Request latency, the one thing recorded on the request path, goes into
//! the gateway's own sharded [`Histogram`]s (one per resource and outcome,
//! made once), which a scrape renders after the recorder's families: the
//! exporter's histogram costs every request a shared write (see
//! [`crate::histogram`]).

use std::fmt::Write as _;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use metrics::Label;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusRecorder};

use crate::gateway::Gateway;
use crate::histogram::{BOUNDS, Histogram};

/// Indexes into [`OUTCOMES`].
pub mod outcome {
    pub const FILTERED: usize = 0;
    pub const HIT: usize = 1;
    pub const NEGATIVE_HIT: usize = 2;
    pub const MISS: usize = 3;
    pub const COLLAPSED: usize = 4;
    pub const BAD_REQUEST: usize = 5;
    pub const UNAVAILABLE: usize = 6;
    pub const NOT_READY: usize = 7;
    pub const UNAUTHORIZED: usize = 8;
    pub const FORBIDDEN: usize = 9;
    pub const RATE_LIMITED: usize = 10;
}

/// Request outcomes, the `outcome` label of request metrics.
pub const OUTCOMES: [&str; 11] = [
    "filtered",
    "hit",
    "negative_hit",
    "miss",
    "collapsed",
    "bad_request",
    "unavailable",
    "not_ready",
    "unauthorized",
    "forbidden",
    "rate_limited",
];

const LATENCY: &str = "bloomgate_request_duration_seconds";
const LATENCY_HELP: &str = "Lookup latency by resource and outcome.";

pub struct Metrics {
    recorder: PrometheusRecorder,
    /// Latency histograms by resource, each in [`OUTCOMES`] order.
    latency: Mutex<Vec<(String, Vec<Arc<Histogram>>)>>,
}

impl Default for Metrics {
    fn default() -> Self {
        let m = Self {
            recorder: PrometheusBuilder::new().build_recorder(),
            latency: Mutex::default(),
        };
        m.with(describe);
        m
    }
}

impl Metrics {
    fn with<T>(&self, f: impl FnOnce() -> T) -> T {
        metrics::with_local_recorder(&self.recorder, f)
    }

    /// The latency histograms of `resource`, one per outcome in
    /// [`OUTCOMES`] order; the same ones on every call, so that routers
    /// built again (the tests build several per gateway) add to one series.
    pub fn latency_histograms(&self, resource: &str) -> Vec<Arc<Histogram>> {
        let mut all = self.latency.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, h)) = all.iter().find(|(r, _)| r == resource) {
            return h.clone();
        }
        let h: Vec<_> = OUTCOMES.iter().map(|_| Arc::default()).collect();
        all.push((resource.to_string(), h.clone()));
        h
    }

    /// The exposition text: the gateway's counters as of now, plus the
    /// latency histograms.
    pub fn render(&self, gw: &Gateway) -> String {
        self.with(|| snapshot(gw));
        let mut text = self.recorder.handle().render();
        self.render_latency(&mut text);
        text
    }

    /// The histogram family as the exporter wrote it: cumulative `_bucket`
    /// lines with `le`, then `_sum` and `_count`, per resource and outcome.
    fn render_latency(&self, out: &mut String) {
        let all = self.latency.lock().unwrap_or_else(|p| p.into_inner());
        if all.is_empty() {
            return;
        }
        if !out.is_empty() && !out.ends_with("\n\n") {
            out.push('\n');
        }
        let _ = writeln!(out, "# HELP {LATENCY} {LATENCY_HELP}");
        let _ = writeln!(out, "# TYPE {LATENCY} histogram");
        for (resource, hs) in all.iter() {
            let resource = escape_label(resource);
            for (outcome, h) in OUTCOMES.iter().zip(hs) {
                let s = h.snapshot();
                let labels = format!("resource=\"{resource}\",outcome=\"{outcome}\"");
                for (le, n) in BOUNDS.iter().zip(s.cumulative) {
                    let _ = writeln!(out, "{LATENCY}_bucket{{{labels},le=\"{le}\"}} {n}");
                }
                let _ = writeln!(out, "{LATENCY}_bucket{{{labels},le=\"+Inf\"}} {}", s.count);
                let _ = writeln!(out, "{LATENCY}_sum{{{labels}}} {}", s.sum_seconds);
                let _ = writeln!(out, "{LATENCY}_count{{{labels}}} {}", s.count);
            }
        }
        out.push('\n');
    }
}

/// A label value in the text format: backslash, double quote and newline
/// escaped.
fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn describe() {
    use metrics::{describe_counter, describe_gauge};
    describe_counter!(
        "bloomgate_requests_total",
        "Lookups by resource and outcome."
    );
    describe_counter!(
        "bloomgate_db_queries_total",
        "Queries sent to Postgres (row loads and key scans)."
    );
    describe_counter!("bloomgate_db_errors_total", "Queries that failed.");
    describe_counter!(
        "bloomgate_filter_false_positives_observed_total",
        "Keys the filter passed that Postgres did not have."
    );
    describe_gauge!(
        "bloomgate_cache_entries",
        "Cached rows (kind=row) and negative entries (kind=negative)."
    );
    describe_gauge!(
        "bloomgate_cache_weighted_size",
        "Size of the row cache against its bound: bytes when cache.max_bytes is set, otherwise rows."
    );
    describe_gauge!("bloomgate_filter_bits", "Size of the filter in bits.");
    describe_gauge!(
        "bloomgate_filter_hashes",
        "Bits set per key (0 for an exact set)."
    );
    describe_gauge!(
        "bloomgate_filter_keys",
        "Keys inserted into the live filter."
    );
    describe_gauge!("bloomgate_filter_fill_ratio", "Set bits / bits.");
    describe_gauge!(
        "bloomgate_filter_estimated_fp_rate",
        "False-positive rate estimated from the fill ratio."
    );
    describe_gauge!("bloomgate_filter_age_seconds", "Age of the live filter.");
    describe_gauge!("bloomgate_filter_generation", "Swaps so far.");
    describe_counter!("bloomgate_rebuilds_total", "Successful filter builds.");
    describe_counter!(
        "bloomgate_rebuild_failures_total",
        "Failed rebuilds (the old filter stayed)."
    );
    describe_counter!(
        "bloomgate_rebuild_retries_total",
        "Retries of rebuilds that recover missed keys (after a feed reconnect, a rescan): one per back-off, however many such rebuilds failed during it."
    );
    describe_counter!(
        "bloomgate_rebuild_refused_total",
        "Rebuilds refused by the shrink guard."
    );
    describe_gauge!(
        "bloomgate_rebuild_duration_seconds",
        "Duration of the latest build."
    );
    describe_counter!(
        "bloomgate_live_inserts_total",
        "Keys added to the live filter from notifications."
    );
    describe_counter!(
        "bloomgate_wal_changes_total",
        "Row changes the WAL feed delivered, by operation."
    );
    describe_counter!(
        "bloomgate_wal_commits_total",
        "Transactions the WAL feed delivered."
    );
    describe_counter!("bloomgate_wal_reconnects_total", "WAL feed reconnects.");
    describe_counter!(
        "bloomgate_wal_slot_invalidations_total",
        "Permanent slots found invalidated (and recreated, with a rebuild)."
    );
    describe_gauge!(
        "bloomgate_wal_applied_lsn",
        "The LSN the slot was advanced to (applied)."
    );
    describe_gauge!(
        "bloomgate_wal_lag_bytes",
        "WAL between the primary's position and the slot's."
    );
    describe_gauge!(
        "bloomgate_wal_lag_seconds",
        "Commit to receipt of the latest transaction."
    );
    describe_counter!(
        "bloomgate_replica_queries_total",
        "Queries sent to each read replica."
    );
    describe_counter!(
        "bloomgate_replica_errors_total",
        "Queries that failed on each read replica."
    );
    describe_gauge!(
        "bloomgate_replica_lag_seconds",
        "Each read replica's lag at the last check."
    );
    describe_gauge!(
        "bloomgate_replica_usable",
        "1 while a read replica is used."
    );
    describe_counter!(
        "bloomgate_notifications_total",
        "Key-change notifications received (queue feed: change rows read)."
    );
    describe_gauge!(
        "bloomgate_notification_lag_seconds",
        "Trigger to receipt, latest notification or change row."
    );
    describe_counter!(
        "bloomgate_listener_reconnects_total",
        "Listener reconnects (each followed by rebuilds); queue feed: failed polls (resumed without one)."
    );
    describe_counter!(
        "bloomgate_auth_failures_total",
        "Requests refused by the access checks, by reason (missing, expired, signature, insufficient_scope, not_owner, rate_limited, ...)."
    );
    describe_counter!(
        "bloomgate_auth_token_cache_total",
        "Credentials found in the verified-credential cache (result=hit) or verified (result=miss)."
    );
    describe_gauge!(
        "bloomgate_auth_token_cache_entries",
        "Verified credentials held (bounded by auth.token_cache_entries)."
    );
    describe_gauge!(
        "bloomgate_auth_jwks_keys",
        "Public keys held for verifying tokens (auth.jwks_file and auth.jwks_url)."
    );
    describe_counter!(
        "bloomgate_auth_jwks_fetches_total",
        "Fetches of auth.jwks_url, by result (ok, failed), and the changes of the key set they brought (changed)."
    );
    describe_counter!(
        "bloomgate_requests_shed_total",
        "Requests refused at the concurrency limit."
    );
    describe_counter!(
        "bloomgate_requests_timed_out_total",
        "Requests past request_timeout."
    );
}

fn snapshot(gw: &Gateway) {
    use metrics::{counter, gauge};
    let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    counter!("bloomgate_db_queries_total").absolute(gw.db.queries());
    counter!("bloomgate_db_errors_total").absolute(gw.db.errors());
    let g = &gw.stats;
    counter!("bloomgate_notifications_total").absolute(load(&g.notifications));
    counter!("bloomgate_listener_reconnects_total").absolute(load(&g.listener_reconnects));
    counter!("bloomgate_requests_shed_total").absolute(load(&g.shed));
    let w = &gw.wal_stats;
    for (op, v) in [
        ("insert", &w.inserts),
        ("update", &w.updates),
        ("delete", &w.deletes),
        ("truncate", &w.truncates),
    ] {
        counter!("bloomgate_wal_changes_total", "op" => op).absolute(load(v));
    }
    counter!("bloomgate_wal_commits_total").absolute(load(&w.commits));
    counter!("bloomgate_wal_reconnects_total").absolute(load(&w.reconnects));
    counter!("bloomgate_wal_slot_invalidations_total").absolute(load(&w.slot_invalidations));
    gauge!("bloomgate_wal_applied_lsn").set(load(&w.applied_lsn) as f64);
    gauge!("bloomgate_wal_lag_bytes").set(load(&w.lag_bytes) as f64);
    gauge!("bloomgate_wal_lag_seconds").set(load(&w.lag_us) as f64 / 1e6);
    if let Some(b) = gw.bus_status() {
        let st = b.get();
        gauge!("bloomgate_bus_relaying").set(if st.relaying { 1.0 } else { 0.0 });
        gauge!("bloomgate_bus_direct").set(if st.mode == crate::feed::bus::Mode::Direct {
            1.0
        } else {
            0.0
        });
        gauge!("bloomgate_bus_lag_bytes").set(load(&b.lag_bytes) as f64);
        gauge!("bloomgate_bus_lag_seconds").set(load(&b.lag_ms) as f64 / 1e3);
        counter!("bloomgate_bus_fallbacks_total").absolute(load(&b.fallbacks));
        counter!("bloomgate_bus_returns_total").absolute(load(&b.returns));
        counter!("bloomgate_bus_breaks_total").absolute(load(&b.breaks));
        counter!("bloomgate_bus_entries_read_total").absolute(load(&b.read));
        counter!("bloomgate_bus_entries_appended_total").absolute(load(&b.appended));
        counter!("bloomgate_bus_relay_terms_total").absolute(load(&b.terms));
    }
    if let Some(reps) = gw.db.replicas() {
        for r in reps.members() {
            let name = r.name.clone();
            counter!("bloomgate_replica_queries_total", "replica" => name.clone())
                .absolute(load(&r.queries));
            counter!("bloomgate_replica_errors_total", "replica" => name.clone())
                .absolute(load(&r.errors));
            gauge!("bloomgate_replica_lag_seconds", "replica" => name.clone())
                .set(r.lag().as_secs_f64());
            gauge!("bloomgate_replica_usable", "replica" => name).set(if r.is_usable() {
                1.0
            } else {
                0.0
            });
        }
    }
    counter!("bloomgate_requests_timed_out_total").absolute(load(&g.timeouts));
    let a = gw.auth.view();
    for (reason, n) in &a.failures {
        counter!("bloomgate_auth_failures_total", "reason" => *reason).absolute(*n);
    }
    counter!("bloomgate_auth_token_cache_total", "result" => "hit").absolute(a.token_cache.hits);
    counter!("bloomgate_auth_token_cache_total", "result" => "miss").absolute(a.token_cache.misses);
    gauge!("bloomgate_auth_token_cache_entries").set(a.token_cache.entries as f64);
    gauge!("bloomgate_auth_jwks_keys").set(a.jwks_keys as f64);
    if let Some(j) = &a.jwks_url {
        let fetches = "bloomgate_auth_jwks_fetches_total";
        counter!(fetches, "result" => "ok").absolute(j.fetches - j.failures);
        counter!(fetches, "result" => "failed").absolute(j.failures);
        counter!(fetches, "result" => "changed").absolute(j.changes);
    }
    gauge!("bloomgate_notification_lag_seconds")
        .set(load(&g.last_notification_lag_us) as f64 / 1e6);

    for r in &gw.resources {
        let name = r.name().to_string();
        let s = &r.stats;
        let by_outcome = s.by_outcome();
        for (outcome, value) in OUTCOMES.iter().zip(by_outcome) {
            counter!("bloomgate_requests_total", "resource" => name.clone(), "outcome" => *outcome)
                .absolute(value);
        }
        let labels = [Label::new("resource", name.clone())];
        let c = |n: &'static str, v: u64| counter!(n, labels.iter()).absolute(v);
        c(
            "bloomgate_filter_false_positives_observed_total",
            load(&s.observed_absent),
        );
        c("bloomgate_rebuilds_total", load(&s.rebuilds));
        c(
            "bloomgate_rebuild_failures_total",
            load(&s.rebuild_failures),
        );
        c("bloomgate_rebuild_retries_total", load(&s.rebuild_retries));
        c("bloomgate_rebuild_refused_total", load(&s.refused_swaps));
        c("bloomgate_live_inserts_total", load(&s.live_inserts));
        let (rows, negative) = r.cache_entries();
        gauge!("bloomgate_cache_entries", "resource" => name.clone(), "kind" => "row")
            .set(rows as f64);
        gauge!("bloomgate_cache_entries", "resource" => name.clone(), "kind" => "negative")
            .set(negative as f64);
        let gset = |n: &'static str, v: f64| gauge!(n, labels.iter()).set(v);
        gset(
            "bloomgate_cache_weighted_size",
            r.cache_weighted_size() as f64,
        );
        gset("bloomgate_filter_generation", r.generation() as f64);
        if let Some(f) = r.filter_stats() {
            gset("bloomgate_filter_bits", f.bits as f64);
            gset("bloomgate_filter_hashes", f64::from(f.hashes));
            gset("bloomgate_filter_keys", f.keys as f64);
            gset("bloomgate_filter_fill_ratio", f.fill_ratio);
            gset("bloomgate_filter_estimated_fp_rate", f.estimated_fp_rate);
        }
        if let Some(b) = r.last_build() {
            gset(
                "bloomgate_rebuild_duration_seconds",
                b.duration_ms as f64 / 1e3,
            );
            let age = SystemTime::now()
                .duration_since(b.built_at)
                .unwrap_or_default();
            gset("bloomgate_filter_age_seconds", age.as_secs_f64());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn value(text: &str, series: &str) -> Option<String> {
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
            .map(str::to_string)
    }

    #[test]
    fn latency_renders_as_one_cumulative_histogram_family() {
        let m = Metrics::default();
        let users = m.latency_histograms("users");
        assert!(
            Arc::ptr_eq(&users[0], &m.latency_histograms("users")[0]),
            "a router built again adds to the same series"
        );
        m.latency_histograms("articles");
        users[outcome::HIT].record(Duration::from_micros(30));
        users[outcome::HIT].record(Duration::from_millis(2));
        users[outcome::FILTERED].record(Duration::from_secs(9));
        let mut text = String::from("# TYPE other counter\nother 1\n");
        m.render_latency(&mut text);

        assert_eq!(
            text.matches(&format!("# TYPE {LATENCY} histogram")).count(),
            1
        );
        assert_eq!(text.matches(&format!("# HELP {LATENCY} ")).count(), 1);
        assert!(text.contains("other 1\n\n# HELP"), "families apart: {text}");
        let hit = r#"resource="users",outcome="hit""#;
        let b = |le: &str| value(&text, &format!("{LATENCY}_bucket{{{hit},le=\"{le}\"}}"));
        assert_eq!(b("0.00005").as_deref(), Some("1"));
        assert_eq!(b("0.001").as_deref(), Some("1"));
        assert_eq!(b("0.0025").as_deref(), Some("2"));
        assert_eq!(b("5").as_deref(), Some("2"));
        assert_eq!(b("+Inf").as_deref(), Some("2"));
        assert_eq!(
            value(&text, &format!("{LATENCY}_count{{{hit}}}")).as_deref(),
            Some("2")
        );
        let sum: f64 = value(&text, &format!("{LATENCY}_sum{{{hit}}}"))
            .unwrap()
            .parse()
            .unwrap();
        assert!((sum - 0.00203).abs() < 1e-9, "{sum}");
        let filtered = r#"resource="users",outcome="filtered""#;
        let f = |le: &str| {
            value(
                &text,
                &format!("{LATENCY}_bucket{{{filtered},le=\"{le}\"}}"),
            )
        };
        assert_eq!(
            f("5").as_deref(),
            Some("0"),
            "9 s is above every finite bound"
        );
        assert_eq!(f("+Inf").as_deref(), Some("1"));
        // Every resource and outcome has its series, recorded into or not.
        let series = text.lines().filter(|l| l.contains("_count{")).count();
        assert_eq!(series, 2 * OUTCOMES.len());
    }
}
