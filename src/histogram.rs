//! `Histogram`: request latency in fixed buckets, recorded by request threads
//! without writing to memory another core writes.
//!
//! # Guarantees
//! - A recorded duration lands in exactly one bucket: the first whose upper
//!   bound it does not exceed (Prometheus `le` semantics), or `+Inf`.
//! - [`Histogram::snapshot`] returns cumulative bucket counts, their total
//!   (`_count`, equal to the `+Inf` bucket) and the sum of the durations.
//!   Every counter only grows (the sum, in nanoseconds, until 2⁶⁴ ns: 584
//!   years of summed latency in one shard), so a snapshot taken while
//!   requests record may miss the records in flight and never counts one
//!   twice; of two snapshots ordered by happens-before (the same thread, or
//!   both under `Metrics`' lock, as scrapes are), the later is never below
//!   the earlier.
//! - Recording takes no lock, allocates nothing and never waits: two relaxed
//!   additions to counters of the calling thread's shard (the assignment of
//!   [`crate::counter`]).
//!
//! # Why not the exporter's histogram
//! `metrics-exporter-prometheus` keeps every sample until an upkeep pass
//! folds it into buckets. Its `record` pins a crossbeam epoch (a `SeqCst`
//! fence), then does two read-modify-writes on the tail block's header, a
//! cache line that every core's requests write, and allocates a new block
//! every 64 samples. On the fast paths (a cached hit, a filtered 404), where
//! the gateway does a few microseconds of work, that shared line moves
//! between the cores on every request. Here each thread adds to its own
//! shard's counters, each shard on cache lines of its own; a scrape (rare)
//! adds the shards up.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::counter::{SHARDS, shard};

/// Upper bounds of the finite buckets, in seconds (the `le` labels).
pub const BOUNDS: [f64; 15] = [
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 5.0,
];

/// The same bounds in nanoseconds, compared against without floating point
/// (a test checks the two lists agree).
const BOUNDS_NS: [u64; 15] = [
    50_000,
    100_000,
    250_000,
    500_000,
    1_000_000,
    2_500_000,
    5_000_000,
    10_000_000,
    25_000_000,
    50_000_000,
    100_000_000,
    250_000_000,
    500_000_000,
    1_000_000_000,
    5_000_000_000,
];

/// One thread's counters: a bucket per bound plus `+Inf`, and the sum.
/// Aligned to 128 bytes (two lines, for the adjacent-line prefetcher) so
/// that no two shards share a line.
#[repr(align(128))]
#[derive(Default)]
struct Shard {
    buckets: [AtomicU64; BOUNDS.len() + 1],
    sum_ns: AtomicU64,
}

pub struct Histogram {
    shards: Box<[Shard]>,
}

/// What a scrape sees.
#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot {
    /// Upper bounds of the finite buckets, in seconds.
    pub bounds: &'static [f64],
    /// Cumulative: `cumulative[i]` counts durations ≤ `bounds[i]`.
    pub cumulative: Vec<u64>,
    /// Every duration recorded (the `+Inf` bucket).
    pub count: u64,
    pub sum_seconds: f64,
}

impl Default for Histogram {
    fn default() -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Shard::default()).collect(),
        }
    }
}

impl std::fmt::Debug for Histogram {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Histogram")
            .field("count", &self.snapshot().count)
            .finish()
    }
}

impl Histogram {
    pub fn record(&self, d: Duration) {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        let bucket = BOUNDS_NS.partition_point(|&b| b < ns);
        let shard = &self.shards[shard()];
        shard.buckets[bucket].fetch_add(1, Ordering::Relaxed);
        shard.sum_ns.fetch_add(ns, Ordering::Relaxed);
    }

    /// Samples recorded so far: the sum of every shard's buckets.
    pub fn count(&self) -> u64 {
        self.shards
            .iter()
            .flat_map(|s| s.buckets.iter())
            .map(|b| b.load(Ordering::Relaxed))
            .sum()
    }

    pub fn snapshot(&self) -> Snapshot {
        let mut per_bucket = [0u64; BOUNDS.len() + 1];
        let mut sum_ns = 0u64;
        for s in self.shards.iter() {
            for (total, b) in per_bucket.iter_mut().zip(&s.buckets) {
                *total += b.load(Ordering::Relaxed);
            }
            sum_ns = sum_ns.wrapping_add(s.sum_ns.load(Ordering::Relaxed));
        }
        Snapshot::of(&BOUNDS, &per_bucket, sum_ns as f64 / 1e9)
    }
}

impl Snapshot {
    /// From counts per bucket (not cumulative, `+Inf` last).
    fn of(bounds: &'static [f64], per_bucket: &[u64], sum_seconds: f64) -> Self {
        let mut running = 0;
        let cumulative = per_bucket[..bounds.len()]
            .iter()
            .map(|n| {
                running += n;
                running
            })
            .collect();
        Snapshot {
            bounds,
            cumulative,
            count: running + per_bucket[bounds.len()],
            sum_seconds,
        }
    }
}

/// Bounds for durations of seconds to minutes (a rebuild's scan), in
/// seconds.
pub const SLOW_BOUNDS: [f64; 12] = [
    0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
];

/// A histogram of rare events (a few a minute at most, such as rebuilds):
/// one lock, any bounds. Not for the request path.
#[derive(Debug)]
pub struct RareHistogram {
    bounds: &'static [f64],
    /// Per bucket (not cumulative), `+Inf` last; and the sum in seconds.
    counts: std::sync::Mutex<(Vec<u64>, f64)>,
}

impl RareHistogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: std::sync::Mutex::new((vec![0; bounds.len() + 1], 0.0)),
        }
    }

    pub fn record(&self, d: Duration) {
        let s = d.as_secs_f64();
        let bucket = self.bounds.partition_point(|&b| b < s);
        let mut c = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        c.0[bucket] += 1;
        c.1 += s;
    }

    pub fn snapshot(&self) -> Snapshot {
        let c = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        Snapshot::of(self.bounds, &c.0, c.1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_two_bound_lists_agree() {
        for (s, ns) in BOUNDS.iter().zip(BOUNDS_NS) {
            assert_eq!((s * 1e9).round() as u64, ns);
        }
    }

    #[test]
    fn a_duration_on_a_bound_counts_in_that_bucket_and_one_above_in_the_next() {
        let h = Histogram::default();
        h.record(Duration::from_micros(50));
        h.record(Duration::from_nanos(50_001));
        h.record(Duration::from_secs(6));
        let s = h.snapshot();
        assert_eq!(s.cumulative[0], 1, "50 µs is ≤ le=0.00005");
        assert_eq!(s.cumulative[1], 2, "50.001 µs is ≤ le=0.0001 only");
        assert_eq!(s.cumulative[14], 2, "6 s is above every finite bound");
        assert_eq!(s.count, 3);
        assert!((s.sum_seconds - (6.0 + 100.001e-6)).abs() < 1e-9);
    }

    #[test]
    fn records_from_many_threads_are_all_counted() {
        let h = std::sync::Arc::new(Histogram::default());
        let threads: Vec<_> = (0..(SHARDS + 3))
            .map(|t| {
                let h = h.clone();
                std::thread::spawn(move || {
                    for i in 0..1000u64 {
                        h.record(Duration::from_micros(t as u64 * 100 + i % 7));
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let s = h.snapshot();
        assert_eq!(s.count, (SHARDS as u64 + 3) * 1000);
        assert_eq!(
            h.count(),
            s.count,
            "the count alone sums what the snapshot does"
        );
        // Thread 0 records 0..6 µs, all ≤ 50 µs; the others are above.
        assert_eq!(s.cumulative[0], 1000);
    }

    #[test]
    fn a_rare_histogram_counts_like_the_sharded_one() {
        let h = RareHistogram::new(&SLOW_BOUNDS);
        h.record(Duration::from_millis(10));
        h.record(Duration::from_secs(2));
        h.record(Duration::from_secs(4000));
        let s = h.snapshot();
        assert_eq!(s.cumulative[0], 1, "10 ms is ≤ le=0.01");
        assert_eq!(s.cumulative[5], 2, "2 s is ≤ le=5");
        assert_eq!(s.cumulative[11], 2);
        assert_eq!(s.count, 3);
        assert!((s.sum_seconds - 4002.01).abs() < 1e-6);
    }

    proptest! {
        // Against the definition: every bucket counts exactly the durations
        // at or under its bound, and the total and sum are exact.
        #[test]
        fn buckets_match_the_definition(ns in prop::collection::vec(0u64..7_000_000_000, 0..200)) {
            let h = Histogram::default();
            for &n in &ns {
                h.record(Duration::from_nanos(n));
            }
            let s = h.snapshot();
            for (i, &bound) in BOUNDS.iter().enumerate() {
                let want = ns.iter().filter(|&&n| n as f64 / 1e9 <= bound).count() as u64;
                prop_assert_eq!(s.cumulative[i], want, "le={}", bound);
            }
            prop_assert_eq!(s.count, ns.len() as u64);
            let sum: u64 = ns.iter().sum();
            prop_assert!((s.sum_seconds - sum as f64 / 1e9).abs() < 1e-6);
        }
    }
}
