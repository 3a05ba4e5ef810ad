//! Per-caller rate limits: GCRA (the generic cell rate algorithm, a token
//! bucket kept as one timestamp) in a fixed table.
//!
//! # Why not `governor`
//! Its keyed limiter keeps a `DashMap` entry per key until something calls
//! `retain_recent`: between two calls a caller rotating addresses or
//! subjects grows it without bound, and a cleanup task must scan it. Here
//! the table is `rate_limit_callers` slots of 16 bytes, allocated once, in
//! sets of [`WAYS`] under one small lock each, indexed by a keyed hash of
//! (resource, caller). A new caller takes a way whose bucket has refilled
//! (an idle caller, indistinguishable from a new one) or else the way
//! closest to refilled. Evicting a caller can only give it a fresh burst,
//! never refuse anyone; no caller can aim at a set.

use std::sync::Mutex;
use std::time::{Duration, Instant};

pub const WAYS: usize = 4;

/// A limit: one request every `interval_ns`, `burst` at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rate {
    pub interval_ns: u64,
    pub burst: u32,
}

impl Rate {
    pub fn new(per_second: f64, burst: u32) -> Self {
        Self {
            interval_ns: ((1e9 / per_second).round() as u64).max(1),
            burst: burst.max(1),
        }
    }

    /// Nanoseconds a full burst takes to refill (the RateLimit window).
    pub fn window_ns(&self) -> u64 {
        self.interval_ns.saturating_mul(u64::from(self.burst))
    }

    fn tolerance(&self) -> u64 {
        self.interval_ns
            .saturating_mul(u64::from(self.burst).saturating_sub(1))
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Served; this many more could be sent at once, and the whole burst
    /// is back after `reset`.
    Allowed { remaining: u32, reset: Duration },
    /// Refused: the next request may come after this long.
    Limited { retry_after: Duration },
}

#[derive(Clone, Copy, Default)]
struct Way {
    /// 0: empty.
    key: u64,
    /// Theoretical arrival time, in nanoseconds since the limiter's epoch.
    tat: u64,
}

pub struct Limiter {
    sets: Box<[Mutex<[Way; WAYS]>]>,
    epoch: Instant,
}

impl Limiter {
    /// Room for at least `callers` (rounded up to a power of two).
    pub fn new(callers: usize) -> Self {
        let sets = (callers.max(WAYS) / WAYS).next_power_of_two();
        Self {
            sets: (0..sets)
                .map(|_| Mutex::new([Way::default(); WAYS]))
                .collect(),
            epoch: Instant::now(),
        }
    }

    pub fn capacity(&self) -> usize {
        self.sets.len() * WAYS
    }

    /// Counts one request of `key` (a keyed hash, never 0) against `rate`
    /// at `now`.
    pub fn check(&self, key: u64, rate: &Rate, now: Instant) -> Decision {
        // Never 0 (0 marks an empty way); +1 so that `tat = 0` is "refilled".
        let t = now.saturating_duration_since(self.epoch).as_nanos() as u64 + 1;
        let set = &self.sets[(key as usize) & (self.sets.len() - 1)];
        let mut ways = set.lock().unwrap_or_else(|e| e.into_inner());
        let i = match ways.iter().position(|w| w.key == key) {
            Some(i) => i,
            None => {
                // The way nearest to refilled: a refilled bucket is the
                // same as a new caller's, so reusing it changes nothing.
                let i = (0..WAYS).min_by_key(|&i| ways[i].tat).expect("WAYS > 0");
                ways[i] = Way { key, tat: 0 };
                i
            }
        };
        let tat = ways[i].tat.max(t);
        let tolerance = rate.tolerance();
        if tat - t > tolerance {
            return Decision::Limited {
                retry_after: Duration::from_nanos(tat - t - tolerance),
            };
        }
        let next = tat + rate.interval_ns;
        ways[i].tat = next;
        let used = (next - t).div_ceil(rate.interval_ns);
        Decision::Allowed {
            remaining: u64::from(rate.burst).saturating_sub(used) as u32,
            reset: Duration::from_nanos(next - t),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_then_one_per_interval() {
        let l = Limiter::new(64);
        let r = Rate::new(10.0, 3);
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let allowed = |remaining, reset_ms| Decision::Allowed {
            remaining,
            reset: Duration::from_millis(reset_ms),
        };
        assert_eq!(l.check(7, &r, at(0)), allowed(2, 100));
        assert_eq!(l.check(7, &r, at(0)), allowed(1, 200));
        assert_eq!(l.check(7, &r, at(0)), allowed(0, 300));
        let Decision::Limited { retry_after } = l.check(7, &r, at(0)) else {
            panic!("a fourth at once is over the burst");
        };
        assert!(retry_after <= Duration::from_millis(100), "{retry_after:?}");
        // Another caller is served meanwhile.
        assert!(matches!(l.check(8, &r, at(0)), Decision::Allowed { .. }));
        // One interval later, one more.
        assert!(matches!(l.check(7, &r, at(101)), Decision::Allowed { .. }));
        assert!(matches!(l.check(7, &r, at(101)), Decision::Limited { .. }));
        // After a pause, the whole burst again.
        for _ in 0..3 {
            assert!(matches!(l.check(7, &r, at(2000)), Decision::Allowed { .. }));
        }
    }

    /// New callers take the ways of refilled (idle) ones, not of a caller
    /// in the middle of its window, and the table never grows.
    #[test]
    fn new_callers_replace_idle_ones_not_busy_ones() {
        let l = Limiter::new(16);
        assert_eq!(l.capacity(), 16);
        let r = Rate::new(1.0, 1);
        let t0 = Instant::now();
        let at = |s| t0 + Duration::from_secs(s);
        // Four sets: 5, 9, 13, 17 and 21 share one.
        for k in [9, 13, 17] {
            assert!(matches!(l.check(k, &r, at(0)), Decision::Allowed { .. }));
        }
        assert!(matches!(l.check(5, &r, at(10)), Decision::Allowed { .. }));
        assert!(matches!(l.check(21, &r, at(10)), Decision::Allowed { .. }));
        assert!(
            matches!(l.check(5, &r, at(10)), Decision::Limited { .. }),
            "the busy caller kept its state"
        );
        for k in 100..10_000u64 {
            l.check(k, &r, at(20));
        }
        assert_eq!(l.capacity(), 16);
    }
}
