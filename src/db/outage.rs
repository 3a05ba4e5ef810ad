//! Whether the database can be reached at all, as the gateway's own queries
//! and checks find it: the input of the outage ride-through
//! (`cache.stale_if_error`, see `resource`).
//!
//! An *outage* is the server unreachable: connections refused or cut,
//! the pool unable to keep a single connection, or the server hung (a new
//! connection and `SELECT 1` not done within `acquire_timeout`, asked by
//! `db::reach` when the pool cannot tell). A slow database is not one (a
//! statement timeout, a pool whose connections are all busy while a new
//! one is answered): the gateway must then keep asking it, not answer
//! from what it held. Nor is
//! a server the gateway refuses for not being the one its feed follows
//! (`db::identity`): a server answers at that address, and what was
//! vouched for on the old one is not answered as stale while the feed
//! moves to it.
//!
//! # Guarantees (tested below)
//! - [`Outage::is_down`] from the first failure reported until the next
//!   answer reported, whatever the order of concurrent reports.
//! - While down, [`Outage::may_try`] lets one caller per [`TRY_EVERY`]
//!   through, so that a request learns the database is back without
//!   waiting for the next check, and never more, so that an outage that
//!   hangs connections (packets dropped, no refusal) costs one hung load
//!   per interval rather than one per request.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// While down, how often one caller may try the database.
pub const TRY_EVERY: Duration = Duration::from_millis(250);

#[derive(Debug, Default)]
pub struct Outage {
    /// When the current outage began, in Unix milliseconds; 0: up.
    down_since_ms: AtomicU64,
    /// The next moment a caller may try, in Unix milliseconds.
    next_try_ms: AtomicU64,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis() as u64
}

impl Outage {
    /// A connection or query failed for want of the server.
    pub fn failed(&self) {
        let now = now_ms().max(1);
        let _ = self
            .down_since_ms
            .compare_exchange(0, now, Ordering::AcqRel, Ordering::Acquire);
        self.next_try_ms
            .fetch_max(now + TRY_EVERY.as_millis() as u64, Ordering::AcqRel);
    }

    /// The server answered.
    pub fn answered(&self) {
        if self.down_since_ms.load(Ordering::Acquire) != 0 {
            self.down_since_ms.store(0, Ordering::Release);
        }
    }

    pub fn is_down(&self) -> bool {
        self.down_since_ms.load(Ordering::Acquire) != 0
    }

    /// How long the current outage has lasted, if there is one.
    pub fn down_for(&self) -> Option<Duration> {
        match self.down_since_ms.load(Ordering::Acquire) {
            0 => None,
            since => Some(Duration::from_millis(now_ms().saturating_sub(since))),
        }
    }

    /// Whether this caller should ask the database now: always while it
    /// is up; while it is down, the first caller after each
    /// [`TRY_EVERY`].
    pub fn may_try(&self) -> bool {
        if !self.is_down() {
            return true;
        }
        let now = now_ms();
        let next = self.next_try_ms.load(Ordering::Acquire);
        now >= next
            && self
                .next_try_ms
                .compare_exchange(
                    next,
                    now + TRY_EVERY.as_millis() as u64,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
                .is_ok()
    }
}

/// Whether `e` says the server could not be reached (see the module doc).
/// `pool_size`: connections the pool holds now; a pool that timed out
/// while holding some is busy, not cut off.
pub fn is_unreachable(e: &sqlx::Error, pool_size: u32) -> bool {
    match e {
        sqlx::Error::Io(_) | sqlx::Error::Tls(_) | sqlx::Error::PoolClosed => true,
        sqlx::Error::PoolTimedOut => pool_size == 0,
        // 08: connection exception; 57P01-03: admin shutdown, crash
        // shutdown, cannot connect now (starting up, shutting down).
        sqlx::Error::Database(db) => db
            .code()
            .is_some_and(|c| c.starts_with("08") || matches!(&*c, "57P01" | "57P02" | "57P03")),
        _ => false,
    }
}

/// Whether a statement failed for a reason of the moment, not for an
/// answer: the server out of reach (as [`is_unreachable`], a pool timed out
/// counted whatever it holds), or a statement it gave up on while it
/// answered: `statement_timeout` (57014, which a statement held behind a
/// hung network meets when it finally runs), `lock_timeout` (55P03), a
/// deadlock (40P01) or a serialization failure (40001). The same
/// statement tried again may succeed; a missing table or privilege never
/// does.
pub fn is_momentary(e: &sqlx::Error) -> bool {
    if matches!(e, sqlx::Error::PoolTimedOut) || is_unreachable(e, 0) {
        return true;
    }
    match e {
        sqlx::Error::Database(db) => db
            .code()
            .is_some_and(|c| matches!(&*c, "57014" | "55P03" | "40P01" | "40001")),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn down_from_the_first_failure_to_the_next_answer() {
        let o = Outage::default();
        assert!(!o.is_down() && o.down_for().is_none() && o.may_try());
        o.failed();
        assert!(o.is_down());
        let since = o.down_since_ms.load(Ordering::Relaxed);
        o.failed();
        assert_eq!(
            o.down_since_ms.load(Ordering::Relaxed),
            since,
            "a later failure does not restart the outage"
        );
        o.answered();
        assert!(!o.is_down() && o.may_try());
    }

    #[test]
    fn while_down_one_caller_per_interval_may_try() {
        let o = Outage::default();
        o.failed();
        assert!(!o.may_try(), "a failure just now: wait");
        o.next_try_ms.store(now_ms(), Ordering::Relaxed);
        let tries: usize = std::thread::scope(|s| {
            let handles: Vec<_> = (0..8).map(|_| s.spawn(|| o.may_try())).collect();
            handles
                .into_iter()
                .map(|h| usize::from(h.join().unwrap()))
                .sum()
        });
        assert_eq!(tries, 1, "exactly one of the concurrent callers");
        assert!(!o.may_try());
    }

    #[test]
    fn a_slow_database_is_not_an_outage() {
        assert!(!is_unreachable(&sqlx::Error::PoolTimedOut, 4), "busy pool");
        assert!(
            is_unreachable(&sqlx::Error::PoolTimedOut, 0),
            "no connection left"
        );
        assert!(is_unreachable(
            &sqlx::Error::Io(std::io::ErrorKind::ConnectionRefused.into()),
            0
        ));
        assert!(!is_unreachable(&sqlx::Error::RowNotFound, 0));
    }

    #[test]
    fn a_pool_timed_out_or_closed_is_momentary_an_answer_is_not() {
        assert!(is_momentary(&sqlx::Error::PoolTimedOut));
        assert!(is_momentary(&sqlx::Error::PoolClosed));
        assert!(!is_momentary(&sqlx::Error::RowNotFound));
        assert!(!is_momentary(&sqlx::Error::ColumnNotFound("id".into())));
    }
}
