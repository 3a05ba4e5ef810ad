//! [`Gate`]: at most `rate` lines a second for one class of request (the
//! filtered 404s), so that a flood of absent keys cannot fill the disk.
//!
//! # Guarantees (tested below)
//! - Within one second (of the caller's clock) at most `rate` calls are
//!   let through, however many threads call; the first `rate` of a second
//!   are.
//! - A call is let through or not, never both: the caller counts the ones
//!   not let through, so lines written plus lines left out is every
//!   request of the class.
//! - Lock-free; once a second's lines are spent, a call reads one shared
//!   word and writes nothing, so a flood does not bounce a cache line
//!   between cores.

use std::sync::atomic::{AtomicU64, Ordering};

/// No limit: every call is let through.
pub const UNLIMITED: u64 = u64::MAX;

#[derive(Debug)]
pub(super) struct Gate {
    /// Lines a second, or [`UNLIMITED`]; below 2^32.
    rate: AtomicU64,
    /// The second being counted (high 32 bits) and the calls let through
    /// in it (low 32 bits): one word, so that moving to a new second and
    /// counting in it are one atomic step.
    window: AtomicU64,
}

impl Gate {
    pub(super) fn new(rate: u64) -> Self {
        let g = Self {
            rate: AtomicU64::new(UNLIMITED),
            window: AtomicU64::new(0),
        };
        g.set_rate(rate);
        g
    }

    /// A new rate, in force from the next call (SIGHUP).
    pub(super) fn set_rate(&self, rate: u64) {
        let rate = if rate == UNLIMITED {
            rate
        } else {
            rate.min(u64::from(u32::MAX))
        };
        self.rate.store(rate, Ordering::Relaxed);
    }

    pub(super) fn rate(&self) -> u64 {
        self.rate.load(Ordering::Relaxed)
    }

    /// Whether a call in second `now_s` (of any monotonic clock) is let
    /// through.
    pub(super) fn permit(&self, now_s: u64) -> bool {
        let rate = self.rate.load(Ordering::Relaxed);
        if rate == UNLIMITED {
            return true;
        }
        let second = now_s & u64::from(u32::MAX);
        let spent = |w: u64| w >> 32 >= second && (w & u64::from(u32::MAX)) >= rate;
        if spent(self.window.load(Ordering::Relaxed)) {
            return false;
        }
        self.window
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |w| {
                let (at, n) = (w >> 32, w & u64::from(u32::MAX));
                if second > at {
                    // A thread with a clock read a little earlier counts
                    // into the newer second rather than moving back.
                    (rate > 0).then_some(second << 32 | 1)
                } else if n < rate {
                    Some(w + 1)
                } else {
                    None
                }
            })
            .is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn at_most_rate_a_second_and_the_first_ones() {
        let g = Gate::new(3);
        let let_through = |s: u64, n: usize| (0..n).map(|_| g.permit(s)).collect::<Vec<_>>();
        assert_eq!(let_through(1, 5), [true, true, true, false, false]);
        assert_eq!(let_through(2, 4), [true, true, true, false]);
        // A late clock read counts into the second already open.
        assert_eq!(let_through(1, 1), [false]);
        assert_eq!(let_through(10, 1), [true]);
    }

    #[test]
    fn zero_lets_nothing_through_and_unlimited_everything() {
        let g = Gate::new(0);
        assert!(!(0..100).any(|s| g.permit(s)));
        g.set_rate(UNLIMITED);
        assert!((0..100).all(|_| g.permit(5)));
    }

    #[test]
    fn concurrent_callers_share_the_rate() {
        let g = Arc::new(Gate::new(1000));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let g = g.clone();
                std::thread::spawn(move || {
                    (0..3u64)
                        .map(|s| (0..10_000).filter(|_| g.permit(s)).count())
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let mut per_second = [0usize; 3];
        for h in threads {
            // Each thread walks the seconds in order; between threads
            // the seconds overlap, and still the total per second holds.
            for (s, n) in h.join().unwrap().into_iter().enumerate() {
                per_second[s] += n;
            }
        }
        let total: usize = per_second.iter().sum();
        assert!(total <= 3000, "{per_second:?}");
        assert!(total >= 1000, "{per_second:?}");
    }
}
