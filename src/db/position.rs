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
//! (and read into a cache) before it was flushed, and is lost by a crash.
//! A change feed never saw it (logical decoding reads flushed WAL only),
//! so nothing in its stream tells; a restore of an older copy of the data
//! directory keeps the system identifier and the timeline too, at a lower
//! position. [`Server`] therefore carries the start time, and whoever
//! holds state read from the primary treats a new [`Server`] as a gap for
//! everything it holds (see "The principle" in `feed`).
//!
//! # What a reading proves
//! A commit inserts its commit record into the WAL before it becomes
//! visible; made with `synchronous_commit = off`, it becomes visible
//! before that record is flushed, and a walsender sends flushed WAL only.
//! So a proof rests on the *insert* position ([`Reading::insert`]), read
//! at moment `m`: every commit visible at `m` ends at or before it, and a
//! stream that has sent up to it has sent each of them. How long that
//! takes is the flush's business, not an assumption of the proof: a WAL
//! writer delayed (a raised `wal_writer_delay`) or stalled (a stuck WAL
//! disk) only delays the proof, and past `database.freshness_bound`
//! nothing is vouched for. The insert position also counts WAL of
//! transactions not committed yet, which the WAL writer may leave
//! unflushed on a partial page for as long as nothing commits: a feed
//! whose stream has reached the flush position but not the insert
//! position forces the flush ([`flush_wal`]: one tiny transaction
//! committed with `synchronous_commit = local`).
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

/// A promotion: timeline `to` forked from `from` at `at` (its history
/// file says so). Every change past `at` on `from` was lost with it, and
/// every change up to it is in `to`'s history (see `feed::wal::fork`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fork {
    pub from: Timeline,
    pub at: Lsn,
    pub to: Timeline,
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
    /// The primary's identity and its WAL positions, in one round trip.
    /// Fails on a server in recovery (`pg_walfile_name` cannot run there):
    /// a feed never follows a standby.
    pub async fn read<'c>(
        conn: impl sqlx::PgExecutor<'c>,
    ) -> Result<(Server, Reading), sqlx::Error> {
        let row: ReadRow = sqlx::query_as(&read_sql("")).fetch_one(conn).await?;
        Ok(from_read_row(row))
    }

    /// [`Server::read`] through a pool.
    pub async fn read_pool(pool: &sqlx::PgPool) -> Result<(Server, Reading), sqlx::Error> {
        let mut conn = pool.acquire().await?;
        Self::read(&mut *conn).await
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
                "the primary restarted (a crash may have lost commits made with synchronous_commit = off; a restore from a copy goes back in the WAL)"
                    .into(),
            );
        }
        None
    }
}

/// The primary's WAL positions as one reading (see "What a reading
/// proves").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reading {
    /// `pg_current_wal_insert_lsn()`: every commit visible when it was
    /// read ends at or before it.
    pub insert: Position,
    /// `pg_current_wal_flush_lsn()`: what a walsender can have sent.
    pub flush: Position,
}

/// The system identifier where the role may read it, the current WAL
/// file's name (whose first 8 hex digits are the timeline WAL is inserted
/// on), the postmaster's start time, and the insert and flush positions;
/// then `more`, if any (`, <expression>`: what a feed reads in the same
/// round trip, `feed::tracker::Shapes`).
pub(crate) fn read_sql(more: &str) -> String {
    format!(
        "SELECT {}, pg_walfile_name(w.i), \
         (extract(epoch FROM pg_postmaster_start_time()) * 1000000)::int8, w.i::text, w.f::text{more} \
         FROM (SELECT pg_current_wal_insert_lsn() AS i, pg_current_wal_flush_lsn() AS f) w",
        super::system_identifier_sql!()
    )
}

/// [`read_sql`]'s first five columns.
pub(crate) type ReadRow = (Option<String>, String, i64, String, String);

/// [`read_sql`]'s first five columns, read.
pub(crate) fn from_read_row(
    (system, file, started_us, insert, flush): ReadRow,
) -> (Server, Reading) {
    let server = Server::from_row(system.as_deref(), &file, started_us);
    let at = |text: &str| Position::new(server.timeline, Lsn::parse(text).unwrap_or(Lsn::ZERO));
    (
        server,
        Reading {
            insert: at(&insert),
            flush: at(&flush),
        },
    )
}

/// Flushes the WAL past every record inserted before it was called: one
/// transaction that writes one record of its own (a transactional logical
/// decoding message, which pgoutput does not send unless asked for
/// `messages`, and any role may emit) and commits with `synchronous_commit
/// = local`, which flushes the WAL up to its commit record on this server,
/// without waiting for a synchronous standby. A transaction that only takes
/// an xid would not do: a commit that wrote no WAL of its own is not
/// flushed. Costs one WAL flush, one transaction id and a few dozen bytes
/// of WAL; a feed calls it only when its stream has sent what was flushed
/// and not what was inserted (see "What a reading proves").
pub async fn flush_wal(conn: &mut PgConnection) -> Result<(), sqlx::Error> {
    // `Executor::execute` on the connection, not `RawSql::execute`: the
    // latter's future is not `Send` for every lifetime, and the feeds'
    // tasks must be.
    sqlx::Executor::execute(
        conn,
        sqlx::raw_sql(
            "BEGIN READ WRITE; SET LOCAL synchronous_commit = local; \
             SELECT pg_logical_emit_message(true, 'bloomgate', ''); COMMIT",
        ),
    )
    .await
    .map(|_| ())
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
