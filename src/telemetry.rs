//! Logging: the subscriber (human-readable or JSON lines, filtered by
//! `log.level` or `RUST_LOG`), and [`LogThrottle`] for events that can repeat
//! once per request.
//!
//! Why a throttle: during a database outage every cold key fails, and under a
//! flood that is thousands of identical lines a second, enough to fill a disk
//! or a log bill while telling the operator nothing the first line did not.
//! The metrics count every occurrence; the log says it is happening, once per
//! interval, with how many it left out.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tracing_subscriber::EnvFilter;

use crate::config::{LogConfig, LogFormat};

/// Installs the global subscriber; a second call (tests) is a no-op.
pub fn init(cfg: &LogConfig) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(&cfg.level));
    // Colours only on a terminal: escape codes in a file, a pipe or a log
    // collector are noise that breaks grep.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stdout().is_terminal());
    let _ = match cfg.format {
        LogFormat::Human => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}

/// Lets one occurrence of a recurring event through per interval.
///
/// Guarantees: the first occurrence is always let through; after one is let
/// through, none is for `interval`; the next one let through reports exactly
/// how many were held back in between (across threads: the count is taken
/// with the same atomic swap that opens the window, so none is counted twice
/// or lost). Lock-free: two atomics, no allocation.
#[derive(Debug)]
pub struct LogThrottle {
    epoch: Instant,
    interval_ms: u64,
    /// Milliseconds since `epoch` before which occurrences are held back.
    next_ms: AtomicU64,
    suppressed: AtomicU64,
}

impl LogThrottle {
    /// Default interval for per-request events.
    pub const INTERVAL: Duration = Duration::from_secs(10);

    pub fn new(interval: Duration) -> Self {
        Self {
            epoch: Instant::now(),
            interval_ms: interval.as_millis().try_into().unwrap_or(u64::MAX),
            next_ms: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
        }
    }

    /// `Some(held back since the last line)` if this occurrence should be
    /// logged, `None` if it is one to leave out.
    pub fn permit(&self) -> Option<u64> {
        let now = u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.permit_at(now)
    }

    fn permit_at(&self, now_ms: u64) -> Option<u64> {
        let next = self.next_ms.load(Ordering::Acquire);
        if now_ms >= next
            && self
                .next_ms
                .compare_exchange(
                    next,
                    now_ms.saturating_add(self.interval_ms),
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
                .is_ok()
        {
            Some(self.suppressed.swap(0, Ordering::AcqRel))
        } else {
            self.suppressed.fetch_add(1, Ordering::AcqRel);
            None
        }
    }
}

impl Default for LogThrottle {
    fn default() -> Self {
        Self::new(Self::INTERVAL)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn one_line_per_interval_with_the_count_left_out() {
        let t = LogThrottle::new(Duration::from_millis(100));
        assert_eq!(t.permit_at(5), Some(0));
        assert_eq!(t.permit_at(5), None);
        assert_eq!(t.permit_at(104), None);
        assert_eq!(t.permit_at(105), Some(2));
        assert_eq!(t.permit_at(150), None);
        // A long quiet spell: the next occurrence is let through at once.
        assert_eq!(t.permit_at(10_000), Some(1));
        assert_eq!(t.permit_at(10_000), None);
    }

    #[test]
    fn concurrent_occurrences_are_each_counted_once() {
        // One window for the whole test: exactly one permit, and every other
        // occurrence is in the count the next permit reports.
        let t = Arc::new(LogThrottle::new(Duration::from_secs(3600)));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let t = t.clone();
                std::thread::spawn(move || (0..10_000).filter(|_| t.permit_at(1).is_some()).count())
            })
            .collect();
        let permitted: usize = threads.into_iter().map(|h| h.join().unwrap()).sum();
        assert_eq!(permitted, 1);
        assert_eq!(t.permit_at(u64::MAX), Some(39_999));
    }
}
