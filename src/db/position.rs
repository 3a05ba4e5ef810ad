//! Where a WAL position belongs: a position is (system identifier,
//! timeline, LSN), never a bare LSN.
//!
//! An LSN orders the records of one server's history. A standby promoted
//! to primary starts a new *timeline* that forks off the old one at the
//! point it had replayed: its LSNs continue from there, so a commit the old
//! primary made after the fork (one the standby never received) has an LSN
//! the new primary reuses for something else. A restore, or another
//! cluster behind the same address, is another history altogether (its
//! *system identifier* differs). Two LSNs are comparable only within one
//! [`Timeline`]; across timelines "at or past" means nothing, and every
//! comparison here says so ([`Position::reaches`] is false).
//!
//! A primary restarted in place (a crash, a restart: its postmaster start
//! time changes) keeps its timeline, but a commit made with
//! `synchronous_commit = off` may have been visible to other sessions
//! (and read into a cache) before it was flushed, and is lost by a crash:
//! up to about three `wal_writer_delay`s of such commits (600 ms by
//! default). A change feed never saw them (logical decoding reads flushed
//! WAL only), so nothing in its stream tells; [`Server`] therefore carries
//! the start time too, and whoever holds state read from the primary
//! treats a new [`Server`] as a gap for everything it holds (see "The
//! principle" in `feed`).
//!
//! # Guarantees (tested below)
//! - [`Position::reaches`] holds only within one timeline, and there
//!   exactly when the LSN is at or past.
//! - [`Timeline::supersedes`]: a higher timeline of the same system
//!   supersedes a lower one (Postgres gives a promoted standby a timeline
//!   past every one in its history); any other system supersedes.
//! - [`Server::read`] reads the timeline the primary inserts WAL on now
//!   (from the name of its current WAL file), not the last checkpoint's,
//!   which lags a promotion by up to a checkpoint interval.

use std::fmt;

use sqlx::PgConnection;

pub use super::lsn::Lsn;

/// One server history: the cluster's system identifier and a timeline of
/// it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Timeline {
    /// `pg_control_system().system_identifier`; 0 where it could not be
    /// read (then the timeline alone tells histories apart).
    pub system: u64,
    /// The timeline ID (1 for a cluster never promoted).
    pub id: u32,
}

impl Timeline {
    /// Nothing read yet: reached by no position.
    pub const UNKNOWN: Timeline = Timeline { system: 0, id: 0 };

    /// Whether a position on `self` replaces one on `other` (a promotion
    /// happened in between, or another cluster took the address).
    pub fn supersedes(&self, other: &Timeline) -> bool {
        if self.system != other.system {
            return true;
        }
        self.id > other.id
    }
}

impl fmt::Display for Timeline {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "timeline {} of system {}", self.id, self.system)
    }
}

/// A WAL position with the history it belongs to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Position {
    pub timeline: Timeline,
    pub lsn: Lsn,
}

impl Position {
    /// Before everything, on no timeline: reaches nothing, and anything
    /// [`Position::advance`]s it.
    pub const ZERO: Position = Position {
        timeline: Timeline::UNKNOWN,
        lsn: Lsn::ZERO,
    };

    pub fn new(timeline: Timeline, lsn: Lsn) -> Self {
        Self { timeline, lsn }
    }

    /// Whether everything up to `target` is covered by `self`: the same
    /// timeline, and at or past it. False across timelines.
    pub fn reaches(&self, target: &Position) -> bool {
        self.timeline == target.timeline
            && self.timeline != Timeline::UNKNOWN
            && self.lsn >= target.lsn
    }

    /// Moves `self` to `to` when `to` is later: further on the same
    /// timeline, or on a timeline that supersedes this one (an unknown
    /// one always is superseded). Returns whether it moved.
    pub fn advance(&mut self, to: Position) -> bool {
        let later = if to.timeline == self.timeline {
            to.lsn > self.lsn
        } else {
            self.timeline == Timeline::UNKNOWN || to.timeline.supersedes(&self.timeline)
        };
        if later {
            *self = to;
        }
        later
    }
}

impl fmt::Display for Position {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} on timeline {}", self.lsn, self.timeline.id)
    }
}

/// The primary as one running server: its history and when its postmaster
/// started. Any change between two readings (a failover, a restore, a
/// restart) is a gap for whatever was read from it (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Server {
    pub timeline: Timeline,
    /// `pg_postmaster_start_time()`, in microseconds since the Unix epoch.
    pub started_us: i64,
}

impl Server {
    /// The primary's identity and its WAL flush position, in one round
    /// trip. Fails on a server in recovery (`pg_walfile_name` cannot run
    /// there): a feed never follows a standby.
    pub async fn read(conn: &mut PgConnection) -> Result<(Server, Position), sqlx::Error> {
        let (system, file, started_us, flush): (Option<String>, String, i64, String) =
            sqlx::query_as(READ).fetch_one(conn).await?;
        let server = Server::from_row(system.as_deref(), &file, started_us);
        let flush = Lsn::parse(&flush).unwrap_or(Lsn::ZERO);
        Ok((server, Position::new(server.timeline, flush)))
    }

    /// [`Server::read`] through a pool.
    pub async fn read_pool(pool: &sqlx::PgPool) -> Result<(Server, Position), sqlx::Error> {
        let mut conn = pool.acquire().await?;
        Self::read(&mut conn).await
    }

    fn from_row(system: Option<&str>, wal_file: &str, started_us: i64) -> Server {
        Server {
            timeline: Timeline {
                system: system.and_then(|s| s.parse().ok()).unwrap_or(0),
                id: timeline_of_wal_file(wal_file).unwrap_or(0),
            },
            started_us,
        }
    }

    /// What changed from `before` to `self`, in words for logs and
    /// readiness; `None` when it is the same server.
    pub fn change_from(&self, before: &Server) -> Option<String> {
        if self.timeline.system != before.timeline.system {
            return Some(format!(
                "another database system answers (system identifier {} where it was {})",
                self.timeline.system, before.timeline.system
            ));
        }
        if self.timeline.id != before.timeline.id {
            return Some(format!(
                "the primary is on timeline {} where it was on {} (a failover)",
                self.timeline.id, before.timeline.id
            ));
        }
        if self.started_us != before.started_us {
            return Some(
                "the primary restarted (commits made with synchronous_commit = off may have been lost)"
                    .into(),
            );
        }
        None
    }
}

/// The system identifier where the role may read it, the current WAL
/// file's name (whose first 8 hex digits are the timeline WAL is inserted
/// on), the postmaster's start time and the flush position.
const READ: &str = concat!(
    "SELECT ",
    super::system_identifier_sql!(),
    ", pg_walfile_name(f.l), \
     (extract(epoch FROM pg_postmaster_start_time()) * 1000000)::int8, f.l::text \
     FROM (SELECT pg_current_wal_flush_lsn() AS l) f"
);

/// How long a commit made with `synchronous_commit = off` may be visible
/// to other sessions before its WAL is flushed: three `wal_writer_delay`s,
/// PostgreSQL's documented maximum ("Asynchronous Commit"). Logical
/// decoding reads flushed WAL only, so a reading of the flush position at
/// moment `m` covers every commit visible at `m` minus this, not at `m`:
/// an asynchronous commit visible then may lie past it. The WAL feeds
/// (and the bus's consumers) therefore date each proof this much earlier
/// ([`proof_moment`]): 600 ms with the default 200 ms, and no staleness
/// from asynchronous commits beyond `database.freshness_bound`.
pub async fn async_commit_lag(conn: &mut PgConnection) -> Result<std::time::Duration, sqlx::Error> {
    let ms: i64 =
        sqlx::query_scalar("SELECT setting::int8 FROM pg_settings WHERE name = 'wal_writer_delay'")
            .fetch_one(conn)
            .await?;
    Ok(std::time::Duration::from_millis(3 * ms.max(0) as u64))
}

/// The moment a reading of the flush position taken at `read` proves
/// every commit visible by (see [`async_commit_lag`]); `None` where the
/// clock cannot go back that far (just after boot).
pub fn proof_moment(
    read: std::time::Instant,
    lag: std::time::Duration,
) -> Option<std::time::Instant> {
    read.checked_sub(lag)
}

/// The timeline in a WAL file name (`TTTTTTTTXXXXXXXXYYYYYYYY`).
pub fn timeline_of_wal_file(name: &str) -> Option<u32> {
    u32::from_str_radix(name.get(..8)?, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tl(system: u64, id: u32) -> Timeline {
        Timeline { system, id }
    }

    fn at(system: u64, id: u32, lsn: u64) -> Position {
        Position::new(tl(system, id), Lsn(lsn))
    }

    #[test]
    fn a_position_reaches_only_on_its_own_timeline() {
        assert!(at(7, 1, 100).reaches(&at(7, 1, 100)));
        assert!(at(7, 1, 101).reaches(&at(7, 1, 100)));
        assert!(!at(7, 1, 99).reaches(&at(7, 1, 100)));
        // The old timeline far past the fork: not past anything of the new.
        assert!(!at(7, 1, 1_000_000).reaches(&at(7, 2, 100)));
        assert!(!at(7, 2, 1_000_000).reaches(&at(7, 1, 100)));
        assert!(!at(8, 1, 1_000_000).reaches(&at(7, 1, 100)));
        assert!(!Position::ZERO.reaches(&Position::ZERO));
    }

    #[test]
    fn advancing_follows_the_newer_timeline_and_ignores_the_older() {
        let mut p = Position::ZERO;
        assert!(p.advance(at(7, 1, 500)));
        assert!(!p.advance(at(7, 1, 400)), "backwards on one timeline");
        assert!(
            p.advance(at(7, 2, 100)),
            "a promotion: lower LSN, newer history"
        );
        assert_eq!(p, at(7, 2, 100));
        assert!(
            !p.advance(at(7, 1, 900)),
            "a late position of the old timeline"
        );
        assert!(p.advance(at(9, 1, 5)), "another system");
        assert!(
            p.advance(at(7, 1, 5)),
            "and back: any other system supersedes"
        );
    }

    #[test]
    fn the_timeline_is_read_from_a_wal_file_name() {
        assert_eq!(timeline_of_wal_file("000000010000000000000001"), Some(1));
        assert_eq!(timeline_of_wal_file("0000000A00000003000000FF"), Some(10));
        assert_eq!(timeline_of_wal_file("0000"), None);
        assert_eq!(timeline_of_wal_file("zzzzzzzz00000000"), None);
    }

    #[test]
    fn a_change_of_server_names_its_kind() {
        let s = |sys, id, started| Server {
            timeline: tl(sys, id),
            started_us: started,
        };
        assert_eq!(s(7, 1, 5).change_from(&s(7, 1, 5)), None);
        assert!(
            s(7, 2, 5)
                .change_from(&s(7, 1, 5))
                .unwrap()
                .contains("failover")
        );
        assert!(
            s(7, 1, 6)
                .change_from(&s(7, 1, 5))
                .unwrap()
                .contains("restarted")
        );
        assert!(
            s(8, 1, 5)
                .change_from(&s(7, 1, 5))
                .unwrap()
                .contains("system")
        );
    }

    proptest::proptest! {
        /// Whatever order positions of several timelines arrive in,
        /// advancing never goes back on a timeline nor returns to one it
        /// left for a newer one of the same system.
        #[test]
        fn advancing_is_monotonic(steps in proptest::collection::vec((1u32..4, 0u64..50), 0..60)) {
            let mut p = Position::ZERO;
            for (id, lsn) in steps {
                let before = p;
                p.advance(at(7, id, lsn));
                if before.timeline == p.timeline {
                    proptest::prop_assert!(p.lsn >= before.lsn);
                } else if before.timeline != Timeline::UNKNOWN {
                    proptest::prop_assert!(p.timeline.id > before.timeline.id);
                }
            }
        }
    }
}
