//! A token bucket: at most `rate` events a second, with bursts up to `rate`.

use std::sync::Mutex;
use std::time::Instant;

pub struct TokenBucket {
    rate: f64,
    state: Mutex<(f64, Instant)>,
}

impl TokenBucket {
    pub fn new(per_second: u32) -> Self {
        let rate = f64::from(per_second);
        Self {
            rate,
            state: Mutex::new((rate, Instant::now())),
        }
    }

    /// Takes one token if there is one.
    pub fn try_take(&self) -> bool {
        self.try_take_at(Instant::now())
    }

    fn try_take_at(&self, now: Instant) -> bool {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let (tokens, last) = *s;
        let refilled =
            (tokens + now.saturating_duration_since(last).as_secs_f64() * self.rate).min(self.rate);
        if refilled >= 1.0 {
            *s = (refilled - 1.0, now);
            true
        } else {
            *s = (refilled, now);
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn allows_the_rate_and_refills() {
        let b = TokenBucket::new(10);
        let t0 = Instant::now();
        let taken = (0..25).filter(|_| b.try_take_at(t0)).count();
        assert_eq!(taken, 10, "a full bucket holds one second's worth");
        assert!(!b.try_take_at(t0));
        assert!(
            b.try_take_at(t0 + Duration::from_millis(100)),
            "0.1 s refills one token"
        );
        assert!(!b.try_take_at(t0 + Duration::from_millis(100)));
        let later = t0 + Duration::from_secs(60);
        assert_eq!(
            (0..25).filter(|_| b.try_take_at(later)).count(),
            10,
            "never more than the burst"
        );
    }

    #[test]
    fn zero_rate_never_allows() {
        let b = TokenBucket::new(0);
        assert!(!b.try_take());
    }
}
