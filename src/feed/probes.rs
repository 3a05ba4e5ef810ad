//! The sending side of freshness: readings of the primary, and what a
//! stream that has reached them proves. (The receiving side, how long a
//! proof holds, is `vouch::ProofClock`.)
//!
//! A reading is the primary's [`Server`] and its WAL insert position,
//! taken at a moment (see "What a reading proves" in `db::position`):
//! every commit visible at that moment ends at or before the position, so
//! once the stream has delivered everything up to it, that moment is
//! proven. Three places take readings, each with its own stream: a WAL
//! session (its keepalives), the bus's relay (the heartbeats it appends,
//! against its WAL feed's proofs), a bus consumer (the entries it reads).
//! The rules are here, once:
//!
//! # Guarantees (tested below)
//! - A reading proves only once the stream has reached its position, and
//!   then the latest such reading's moment: never a moment later than the
//!   reading's.
//! - Readings are of one server: a reading of another one (a failover, a
//!   restart, a restore, another cluster) is refused and named
//!   ([`Probes::read`] returns the change), and every reading held is
//!   dropped: nothing of the old server proves anything of the new one.
//! - A reading of the same server whose position is behind an earlier
//!   reading is a gap too (positions of one server only grow), never a
//!   proof.

use std::collections::VecDeque;
use std::time::Instant;

use crate::db::position::{Lsn, Server};

/// Why a reading was refused: the readings held were dropped, and the
/// caller owes a gap (a resync) for what it holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Gap(pub String);

/// Readings not yet proven, oldest first (see the module doc).
#[derive(Debug, Default)]
pub struct Probes {
    server: Option<Server>,
    queue: VecDeque<(Instant, Lsn)>,
    /// The furthest position read of `server`.
    furthest: Lsn,
    /// At most this many held (the oldest go first): a stream that proves
    /// nothing for a while keeps the newest readings.
    cap: usize,
}

impl Probes {
    /// Readings of `server`, at most `cap` held.
    pub fn new(server: Server, cap: usize) -> Self {
        Self {
            server: Some(server),
            queue: VecDeque::new(),
            furthest: Lsn::ZERO,
            cap: cap.max(1),
        }
    }

    /// The server the readings are of.
    pub fn server(&self) -> Option<Server> {
        self.server
    }

    /// A reading of `server` at position `at`, asked at `asked`. Another
    /// server, or a position behind an earlier reading of this one: every
    /// reading held is dropped, the probes are of `server` from now on,
    /// and the gap is named.
    pub fn read(&mut self, asked: Instant, server: Server, at: Lsn) -> Result<(), Gap> {
        let gap = match self.server {
            Some(s) => s
                .change_from(&server)
                .map(|change| change.to_string())
                .or_else(|| {
                    (at < self.furthest).then(|| {
                        format!(
                            "the primary's position went back from {} to {at} (a restore?)",
                            self.furthest
                        )
                    })
                }),
            None => None,
        };
        if let Some(why) = gap {
            self.server = Some(server);
            self.queue.clear();
            self.furthest = at;
            return Err(Gap(why));
        }
        self.server = Some(server);
        self.furthest = self.furthest.max(at);
        if self.queue.len() == self.cap {
            self.queue.pop_front();
        }
        self.queue.push_back((asked, at));
        Ok(())
    }

    /// The stream has delivered everything up to `at` (on the readings'
    /// server): the moment of the latest reading that covers, if any; it
    /// and the readings before it are done.
    pub fn reached(&mut self, at: Lsn) -> Option<Instant> {
        let mut moment = None;
        while let Some(&(asked, p)) = self.queue.front() {
            if p > at {
                break;
            }
            moment = Some(asked);
            self.queue.pop_front();
        }
        moment
    }

    /// The latest reading asked at or before `by`, taken with the ones
    /// before it: its position (the relay: what a heartbeat of the feed's
    /// moment `by` covers).
    pub fn taken_by(&mut self, by: Instant) -> Option<Lsn> {
        let mut p = None;
        while self.queue.front().is_some_and(|(m, _)| *m <= by) {
            p = self.queue.pop_front().map(|(_, p)| p);
        }
        p
    }

    /// The oldest reading not proven yet: when it was asked.
    pub fn oldest(&self) -> Option<Instant> {
        self.queue.front().map(|(m, _)| *m)
    }

    /// The newest reading's position.
    pub fn newest(&self) -> Option<Lsn> {
        self.queue.back().map(|(_, p)| *p)
    }

    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// Drops every reading (the stream moved: nothing held proves anything
    /// of the new one).
    pub fn clear(&mut self) {
        self.queue.clear();
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::db::position::Timeline;

    fn server(id: u32, started_us: i64) -> Server {
        Server {
            timeline: Timeline { system: 7, id },
            started_us,
        }
    }

    #[test]
    fn a_reading_proves_its_own_moment_once_reached() {
        let t0 = Instant::now();
        let t = |ms| t0 + Duration::from_millis(ms);
        let mut p = Probes::new(server(1, 5), 100);
        p.read(t(0), server(1, 5), Lsn(100)).unwrap();
        p.read(t(100), server(1, 5), Lsn(200)).unwrap();
        p.read(t(200), server(1, 5), Lsn(300)).unwrap();
        assert_eq!(p.reached(Lsn(99)), None);
        assert_eq!(p.reached(Lsn(250)), Some(t(100)), "the latest covered");
        assert_eq!(p.oldest(), Some(t(200)));
        assert_eq!(p.reached(Lsn(250)), None, "done once");
        assert_eq!(p.reached(Lsn(300)), Some(t(200)));
        assert!(p.is_empty());
    }

    #[test]
    fn another_server_or_a_position_going_back_is_a_gap() {
        let t0 = Instant::now();
        let mut p = Probes::new(server(1, 5), 100);
        p.read(t0, server(1, 5), Lsn(500)).unwrap();
        for other in [server(2, 5), server(1, 6)] {
            let gap = p.read(t0, other, Lsn(10)).unwrap_err();
            assert!(!gap.0.is_empty());
            assert!(p.is_empty(), "nothing of the old server proves anything");
            assert_eq!(p.server(), Some(other));
            p.read(t0, other, Lsn(20)).unwrap();
            p.read(t0, server(1, 5), Lsn(500)).unwrap_err();
            p.read(t0, server(1, 5), Lsn(500)).unwrap();
        }
        let gap = p.read(t0, server(1, 5), Lsn(499)).unwrap_err();
        assert!(gap.0.contains("went back"), "{gap:?}");
        assert_eq!(p.reached(Lsn(1000)), None, "dropped");
    }

    #[test]
    fn the_relay_takes_the_latest_reading_asked_by_a_moment() {
        let t0 = Instant::now();
        let t = |ms| t0 + Duration::from_millis(ms);
        let mut p = Probes::new(server(1, 5), 2);
        p.read(t(0), server(1, 5), Lsn(100)).unwrap();
        p.read(t(10), server(1, 5), Lsn(200)).unwrap();
        p.read(t(20), server(1, 5), Lsn(300)).unwrap();
        assert_eq!(p.newest(), Some(Lsn(300)));
        assert_eq!(
            p.taken_by(t(15)),
            Some(Lsn(200)),
            "the oldest went past the cap"
        );
        assert_eq!(p.taken_by(t(15)), None);
        assert_eq!(p.taken_by(t(20)), Some(Lsn(300)));
    }

    proptest::proptest! {
        /// Whatever readings and stream positions come, a moment is proven
        /// only by a reading at or below the position reached, and never a
        /// moment later than any reading asked after it.
        #[test]
        fn a_proof_is_always_a_reached_readings_moment(
            steps in proptest::collection::vec((0u64..50, proptest::bool::ANY), 0..60)
        ) {
            let t0 = Instant::now();
            let mut p = Probes::new(server(1, 5), 1000);
            let mut read: Vec<(Instant, Lsn)> = Vec::new();
            let mut lsn = 0u64;
            for (i, (delta, reach)) in steps.into_iter().enumerate() {
                let at = t0 + Duration::from_millis(i as u64);
                if reach {
                    let upto = Lsn(lsn.saturating_sub(delta));
                    if let Some(m) = p.reached(upto) {
                        proptest::prop_assert!(read.iter().any(|&(r, l)| r == m && l <= upto));
                    }
                } else {
                    lsn += delta;
                    p.read(at, server(1, 5), Lsn(lsn)).unwrap();
                    read.push((at, Lsn(lsn)));
                }
            }
        }
    }
}
