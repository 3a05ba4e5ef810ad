//! Streaming read replicas (`database.replica_urls`): row loads and key
//! scans go to a replica that is up, within `max_replica_lag` of the
//! primary and far enough along, and to the primary otherwise. The change
//! feed stays on the primary.
//!
//! # Read-your-writes by LSN
//! A replica replays the primary's WAL behind it. A replica that has not
//! replayed a change can return the old row, or no row, for its key; served
//! after the gateway applied that change, either breaks the promise (a stale
//! row; a 404 for a row that exists). So the gateway keeps one number, the
//! *required LSN*: a position in the primary's WAL at or past the commit of
//! every change it has applied. The applier raises it **before** it applies
//! a change (the WAL feed knows the commit's end LSN; for a change from the
//! notify or queue feed the applier reads the primary's WAL *insert*
//! position, which is past the commit, as the commit was visible when the
//! change was announced).
//!
//! Why the insert position and not `pg_current_wal_lsn()`: that is the
//! *write* position, and a transaction committed with
//! `synchronous_commit = off` is visible (and announced) as soon as its
//! commit record is inserted, up to `wal_writer_delay` before it is
//! written. Gated on the write position, a load could go to a replica that
//! replayed everything written but not that commit, and cache the old row
//! for the whole TTL. A commit record is inserted before its transaction
//! becomes visible, whatever the commit mode, so the insert position read
//! after a change was seen is past it. The replica cannot replay past what
//! the primary has flushed, so an async commit sends loads to the primary
//! for up to `wal_writer_delay`: a cost, never a stale row.
//!
//! - **Loads.** Only loads through the cache, while the feed vouches for
//!   the resource: the required LSN covers the changes *applied*, and a
//!   lookup not vouched for may follow commits no feed has delivered
//!   (`LoadFrom::Primary`). A load goes to a replica only if the replica's replay
//!   position is at or past the required LSN read when the load starts.
//!   Every change applied before that moment has its commit at or below it,
//!   so the replica sees the row as the primary does after the change (new
//!   row, no row, updated row). A change applied *during* the load
//!   invalidates the key, and the cache discards what that load stores
//!   (`cache`'s per-load marks): a negative entry is never created from a
//!   replica that is behind the change that created the row. A replica that
//!   is behind is asked once for its current position before the primary is
//!   used (the bounded wait: one round trip).
//! - **Scans.** A rebuild opens its journal, then scans. Everything applied
//!   before the journal opened committed before it, so at or below the
//!   primary's insert position read after the journal opened; the
//!   scan waits (up to `max_replica_lag`) for a replica to replay that far,
//!   and reads its snapshot there. Changes after the journal opened are
//!   journaled and replayed into the new filter; changes in both are applied
//!   twice, which is idempotent. A scan that cannot find such a replica in
//!   time runs on the primary.
//!
//! The required LSN only rises on its timeline, so a replica's cached
//! replay position (which only rises too) that satisfies it once satisfies
//! it for good; a stale health reading can only send a load to the
//! primary, never to a replica that is behind.
//!
//! # Timelines
//! Every position here carries its timeline (`db::position`): the required
//! position, each replica's replay position, the primary's positions in the
//! lag history. A replica serves a load only if its replay position
//! [`Position::reaches`] the required one: the same system and timeline,
//! and at or past it. After a failover the required position moves to the
//! new primary's timeline (the feed's resync raises it to the new
//! primary's position, and its commits carry the new timeline), and a
//! replica is judged afresh: one that follows the new timeline is used
//! again once it replays past the required position; one stranded on the
//! old timeline (it replayed past the fork point, so it cannot follow:
//! "new timeline N forked off current database system timeline M before
//! current recovery point") is never used, whatever its LSN, and shows as
//! unusable with its timeline and the primary's. A replica's timeline is
//! the one its WAL receiver last received (`pg_stat_wal_receiver`, which
//! a role needs `pg_read_all_stats` or `pg_monitor` to read), else that of
//! its last restartpoint (`pg_control_checkpoint()`), which lags a
//! replica that followed a promotion until its next restartpoint: without
//! that privilege, replicas are used again only from then on.
//!
//! The required LSN starts at the primary's position read when the feed is
//! in place, before the first scan: a row changed before start-up is named
//! by no feed event, and a replica behind it would serve it old. A feed's
//! resync (changes missed, their positions unknown) raises it to the
//! primary's position again.
//!
//! # Health
//! A background task reads, every `replica_check_interval`, the primary's
//! WAL position and each replica's `pg_is_in_recovery()`, replay position
//! and `pg_last_xact_replay_timestamp()`. A replica that has replayed past
//! the primary's write position (read again after the replica's, as the
//! replica may have replayed WAL written meanwhile) holds WAL of another
//! history: a primary restored from an older copy of itself keeps its
//! system identifier and timeline, so positions alone would call the
//! replica caught up, and its rows may be ones the primary never had. It
//! is never used. A primary that started again (a restart, a restore) is
//! a new history of positions for the lag below. A replica is used while it
//! answers, is in recovery, is on the primary's timeline, and its lag (time since the primary first wrote
//! WAL the replica has not replayed; for a replica behind since before the
//! oldest check remembered, at least that long and at least the time since
//! it last replayed a commit) is within `max_replica_lag`. A query that fails on a replica
//! marks it down until the next check and is retried on the primary.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

use super::identity::Identity;
use super::lsn::Lsn;
use super::position::{Position, Timeline, timeline_of_wal_file};
use crate::config::DatabaseConfig;

mod check;

/// One replica: its pool, its state as last checked, its counters.
pub struct Replica {
    /// `host:port`, for logs and metrics (never the URL: it may hold a
    /// password).
    pub name: String,
    pool: PgPool,
    /// Replay position at the last check or refresh, on the timeline it
    /// receives.
    replay: Mutex<Position>,
    /// Up, in recovery, on the primary's timeline and within
    /// `max_replica_lag` at the last check.
    usable: AtomicBool,
    /// Why not usable at the last check, for the admin API.
    detail: Mutex<Option<String>>,
    /// Why its last new connection was refused, if it was (it reached
    /// another server than the one the feed follows: see `db::identity`).
    /// The pool reports such a refusal only as a time-out.
    refused: Arc<Mutex<Option<String>>>,
    /// Lag at the last check, in milliseconds.
    lag_ms: AtomicU64,
    pub queries: AtomicU64,
    pub errors: AtomicU64,
}

impl Replica {
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    pub fn is_usable(&self) -> bool {
        self.usable.load(Ordering::Relaxed)
    }

    pub fn lag(&self) -> Duration {
        Duration::from_millis(self.lag_ms.load(Ordering::Relaxed))
    }

    /// The replay position as last read.
    pub fn replay_position(&self) -> Position {
        *self.replay.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records a replay position read: further on its timeline, or a
    /// timeline of its own (a replica that followed a promotion, or one
    /// rebuilt from another history: whatever it says now is what it is).
    fn replayed(&self, at: Position) {
        let mut r = self.replay.lock().unwrap_or_else(|p| p.into_inner());
        if r.timeline != at.timeline || at.lsn > r.lsn {
            *r = at;
        }
    }

    /// Its state and counters as of now.
    pub fn snapshot(&self) -> ReplicaSnapshot {
        let replay = self.replay_position();
        ReplicaSnapshot {
            name: self.name.clone(),
            usable: self.is_usable(),
            lag_ms: self.lag().as_millis() as u64,
            replay_lsn: replay.lsn.to_string(),
            timeline: replay.timeline.id,
            detail: self
                .detail
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone(),
            queries: self.queries.load(Ordering::Relaxed),
            errors: self.errors.load(Ordering::Relaxed),
        }
    }

    /// A query failed here: not used again until a check says it is back.
    pub fn failed(&self) {
        self.errors.fetch_add(1, Ordering::Relaxed);
        self.usable.store(false, Ordering::Relaxed);
    }

    /// Reads the replay position now; returns it.
    async fn refresh(&self) -> Result<Position, sqlx::Error> {
        let (system, timeline, lsn): (Option<String>, Option<i64>, i64) =
            sqlx::query_as(REPLAY).fetch_one(&self.pool).await?;
        let at = replica_position(system.as_deref(), timeline, lsn);
        self.replayed(at);
        Ok(at)
    }
}

/// A replica at one moment, for the admin API and `/metrics`.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ReplicaSnapshot {
    pub name: String,
    pub usable: bool,
    pub lag_ms: u64,
    pub replay_lsn: String,
    /// The timeline it replays (0: unknown).
    pub timeline: u32,
    /// Why it is not used, if it is not.
    pub detail: Option<String>,
    pub queries: u64,
    pub errors: u64,
}

impl crate::exposition::Expose for ReplicaSnapshot {
    fn expose(&self, _: crate::exposition::Labels<'_>, out: &mut crate::exposition::Exposition) {
        let l = [("replica", self.name.as_str())];
        out.counter(
            "bloomgate_replica_queries_total",
            "Queries sent to each read replica.",
            &l,
            self.queries as f64,
        );
        out.counter(
            "bloomgate_replica_errors_total",
            "Queries that failed on each read replica.",
            &l,
            self.errors as f64,
        );
        out.gauge(
            "bloomgate_replica_lag_seconds",
            "Each read replica's lag at the last check.",
            &l,
            self.lag_ms as f64 / 1e3,
        );
        out.gauge(
            "bloomgate_replica_usable",
            "1 while a read replica is used.",
            &l,
            f64::from(u8::from(self.usable)),
        );
    }
}

/// A replica's system identifier, timeline (see "Timelines" in the module
/// doc) and replay position.
const REPLAY: &str = concat!(
    "SELECT ",
    system_identifier_sql!(),
    ", coalesce((SELECT received_tli FROM pg_stat_wal_receiver), \
              (SELECT timeline_id FROM pg_control_checkpoint()))::int8, \
     (coalesce(pg_last_wal_replay_lsn(), '0/0') - '0/0'::pg_lsn)::int8"
);
/// The insert position (not the write position: see the module doc), with
/// its offset in its segment and the WAL page size, for [`end_position`],
/// the WAL file's name (its timeline) and the system identifier.
const PRIMARY_LSN: &str = concat!(
    "SELECT (i.l - '0/0'::pg_lsn)::int8, o.file_offset, \
     current_setting('wal_block_size')::int4, o.file_name, ",
    system_identifier_sql!(),
    " FROM (SELECT pg_current_wal_insert_lsn() AS l) i, pg_walfile_name_offset(i.l) o"
);
/// The write position: the WAL a replica could have; for lag, and to
/// tell a replica ahead of the primary. With the postmaster's start: a
/// restarted or restored primary is a new history of positions.
const PRIMARY_WRITE_LSN: &str = concat!(
    "SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::int8, pg_walfile_name(pg_current_wal_lsn()), ",
    system_identifier_sql!(),
    ", (extract(epoch FROM pg_postmaster_start_time()) * 1000000)::int8"
);

/// The system and timeline a replica connection reached (see
/// `db::identity`).
pub(crate) async fn read_timeline(conn: &mut sqlx::PgConnection) -> Result<Timeline, sqlx::Error> {
    Ok(read_replay(conn).await?.timeline)
}

/// A replica's replay position, with its system and timeline, read on
/// `conn`.
pub(crate) async fn read_replay(conn: &mut sqlx::PgConnection) -> Result<Position, sqlx::Error> {
    let (system, timeline, lsn): (Option<String>, Option<i64>, i64) =
        sqlx::query_as(REPLAY).fetch_one(conn).await?;
    Ok(replica_position(system.as_deref(), timeline, lsn))
}

/// A replica's position from [`REPLAY`]'s columns.
fn replica_position(system: Option<&str>, timeline: Option<i64>, lsn: i64) -> Position {
    Position::new(
        Timeline {
            system: system.and_then(|s| s.parse().ok()).unwrap_or(0),
            id: timeline.and_then(|t| u32::try_from(t).ok()).unwrap_or(0),
        },
        Lsn(u64::try_from(lsn).unwrap_or(0)),
    )
}

/// The insert position as the end of the last record inserted, the form a
/// commit's end LSN and a replica's replay position take. They differ at
/// the start of a page: there the insert position points past the page
/// header (24 bytes; 40 on a segment's first page) where the next record
/// will start, while the last record ended at the page boundary. Left as
/// it is, an idle primary whose last record filled its page would keep
/// every replica "behind" until the next write.
fn end_position(insert: u64, segment_offset: u64, block: u64) -> u64 {
    const SHORT_HEADER: u64 = 24;
    const LONG_HEADER: u64 = 40;
    if segment_offset == LONG_HEADER {
        insert - LONG_HEADER
    } else if block != 0 && segment_offset % block == SHORT_HEADER {
        insert - SHORT_HEADER
    } else {
        insert
    }
}

pub struct Replicas {
    members: Vec<Arc<Replica>>,
    next: AtomicUsize,
    max_lag: Duration,
    /// See the module doc.
    required: Mutex<Position>,
    /// Changes applied whose LSN could not be read (the primary did not
    /// answer): until a check reads the primary's position after them,
    /// every read goes to the primary.
    unknown: AtomicU64,
    primary: PgPool,
    /// The primary's WAL position at recent checks, oldest first, for lag;
    /// all on the timeline it was last seen on.
    history: Mutex<History>,
}

#[derive(Default)]
struct History {
    /// The primary's timeline, and since when this gateway has seen it on
    /// it.
    timeline: Option<(Timeline, Instant)>,
    /// Its postmaster's start (microseconds since the epoch).
    started: Option<i64>,
    positions: VecDeque<(Instant, u64)>,
}

impl Replicas {
    /// `None` when no replica is configured.
    /// `identity`: what every replica connection is held to as it opens
    /// (see `db::identity`).
    pub fn new(
        cfg: &DatabaseConfig,
        primary: PgPool,
        identity: &Arc<Identity>,
    ) -> Result<Option<Self>, sqlx::Error> {
        if cfg.replica_urls.is_empty() {
            return Ok(None);
        }
        let timeout_ms = cfg.statement_timeout.as_millis().to_string();
        let mut members = Vec::new();
        for url in &cfg.replica_urls {
            let opts = super::tls::connect_options(url)?
                .application_name("bloomgate")
                .options([("statement_timeout", timeout_ms.as_str())]);
            let name = format!("{}:{}", opts.get_host(), opts.get_port());
            let refused: Arc<Mutex<Option<String>>> = Arc::default();
            let pool = PgPoolOptions::new()
                .max_connections(cfg.pool_size)
                // A replica that does not answer quickly is skipped for the
                // primary, not waited on for the request's whole budget.
                .acquire_timeout(cfg.acquire_timeout.min(Duration::from_millis(500)))
                .after_connect({
                    let identity = identity.clone();
                    let refused = refused.clone();
                    move |conn, _| {
                        let identity = identity.clone();
                        let refused = refused.clone();
                        Box::pin(async move {
                            let judged = match identity.followed() {
                                None => Ok(()),
                                Some(_) => identity.judge_replica(read_timeline(conn).await?),
                            };
                            *refused.lock().unwrap_or_else(|p| p.into_inner()) =
                                judged.as_ref().err().map(|e| e.to_string());
                            judged
                        })
                    }
                })
                .before_acquire({
                    let identity = identity.clone();
                    move |_, meta| {
                        let old = identity.opened_before_change(meta.age);
                        Box::pin(async move { Ok(!old) })
                    }
                })
                .connect_lazy_with(opts);
            members.push(Arc::new(Replica {
                name,
                pool,
                replay: Mutex::new(Position::ZERO),
                usable: AtomicBool::new(false),
                detail: Mutex::new(Some("not checked yet".into())),
                refused,
                lag_ms: AtomicU64::new(0),
                queries: AtomicU64::new(0),
                errors: AtomicU64::new(0),
            }));
        }
        Ok(Some(Self {
            members,
            next: AtomicUsize::new(0),
            max_lag: cfg.max_replica_lag,
            required: Mutex::new(Position::ZERO),
            unknown: AtomicU64::new(0),
            primary,
            history: Mutex::default(),
        }))
    }

    pub fn members(&self) -> &[Arc<Replica>] {
        &self.members
    }

    /// Raises the required position (see the module doc); call before
    /// applying a change committed at or below `at`. A position on a
    /// timeline that supersedes the required one replaces it (a failover);
    /// one on an older timeline changes nothing.
    pub fn note_change(&self, at: Position) {
        self.required
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .advance(at);
    }

    /// A change is about to be applied whose LSN is not known.
    pub fn note_unknown_change(&self) {
        self.unknown.fetch_add(1, Ordering::SeqCst);
    }

    /// Changes whose positions are not known (missed, lost, or not
    /// carried): loads wait for a replica to pass the primary's position
    /// now, which is past all of them; unknown when the primary does not
    /// answer.
    pub async fn note_past_the_primary(&self) {
        match self.primary_lsn().await {
            Ok(lsn) => self.note_change(lsn),
            Err(_) => self.note_unknown_change(),
        }
    }

    pub fn required(&self) -> Position {
        *self.required.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A position in the primary's WAL past every commit visible now (the
    /// end of the last record inserted: see the module doc), on its
    /// timeline.
    pub async fn primary_lsn(&self) -> Result<Position, sqlx::Error> {
        let (lsn, offset, block, file, system): (i64, i32, i32, String, Option<String>) =
            sqlx::query_as(PRIMARY_LSN).fetch_one(&self.primary).await?;
        let n = |v: i64| u64::try_from(v).unwrap_or(0);
        Ok(Position::new(
            primary_timeline(system.as_deref(), &file),
            Lsn(end_position(n(lsn), n(offset.into()), n(block.into()))),
        ))
    }

    /// A usable replica that has replayed at least `required`, round robin.
    fn pick_cached(&self, required: &Position) -> Option<&Arc<Replica>> {
        let n = self.members.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        (0..n)
            .map(|i| &self.members[(start + i) % n])
            .find(|r| r.is_usable() && r.replay_position().reaches(required))
    }

    /// Where a row load for a key goes: a replica that is far enough along
    /// (asking a lagging one once for its position), or `None` (the
    /// primary).
    pub async fn for_load(&self) -> Option<Arc<Replica>> {
        if self.unknown.load(Ordering::SeqCst) != 0 {
            return None;
        }
        let required = self.required();
        if let Some(r) = self.pick_cached(&required) {
            return Some(r.clone());
        }
        let behind = self
            .members
            .iter()
            .find(|r| r.is_usable() && !r.replay_position().reaches(&required))?;
        match behind.refresh().await {
            Ok(at) if at.reaches(&required) => Some(behind.clone()),
            Ok(_) => None,
            Err(_) => {
                behind.failed();
                None
            }
        }
    }

    /// Where a key scan goes: a replica that has replayed past everything
    /// applied so far (see the module doc), waiting up to `max_replica_lag`
    /// for one, or `None` (the primary).
    pub async fn for_scan(&self) -> Option<Arc<Replica>> {
        // Read after the journal opened: past every change applied before.
        let Ok(primary) = self.primary_lsn().await else {
            return None;
        };
        if self.unknown.load(Ordering::SeqCst) != 0 {
            return None;
        }
        let mut required = self.required();
        required.advance(primary);
        if required.timeline != primary.timeline {
            // The primary is on an older timeline than a change applied:
            // nothing to compare a replica with.
            return None;
        }
        let deadline = Instant::now() + self.max_lag;
        loop {
            if let Some(r) = self.pick_cached(&required) {
                return Some(r.clone());
            }
            for r in self.members.iter().filter(|r| r.is_usable()) {
                match r.refresh().await {
                    Ok(at) if at.reaches(&required) => return Some(r.clone()),
                    Ok(_) => {}
                    Err(_) => r.failed(),
                }
            }
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// The primary's timeline from its WAL file's name and the system
/// identifier read with it.
fn primary_timeline(system: Option<&str>, wal_file: &str) -> Timeline {
    Timeline {
        system: system.and_then(|s| s.parse().ok()).unwrap_or(0),
        id: timeline_of_wal_file(wal_file).unwrap_or(0),
    }
}

#[cfg(test)]
mod tests {
    use super::check::lag_in;
    use super::end_position;
    use std::collections::VecDeque;
    use std::time::{Duration, Instant};

    #[test]
    fn lag_is_never_zero_for_a_replica_behind_before_the_first_check() {
        let t0 = Instant::now();
        let now = t0 + Duration::from_secs(3);
        let s = Duration::from_secs;
        let h: VecDeque<_> = [(t0, 100), (t0 + s(1), 200), (t0 + s(2), 300)].into();
        assert_eq!(lag_in(&h, 300, None, now), Duration::ZERO, "caught up");
        assert_eq!(lag_in(&h, 400, None, now), Duration::ZERO);
        assert_eq!(
            lag_in(&h, 150, None, now),
            s(2),
            "since the primary passed it"
        );
        assert_eq!(lag_in(&h, 100, None, now), s(2));
        // Behind since before the oldest check: at least the history's span,
        // and at least since it last replayed a commit.
        assert_eq!(lag_in(&h, 50, None, now), s(3));
        assert_eq!(lag_in(&h, 50, Some(s(3600)), now), s(3600));
        // One check only (just started), behind it: not zero.
        let one: VecDeque<_> = [(t0, 100)].into();
        assert_eq!(lag_in(&one, 50, Some(s(7200)), now), s(7200));
        assert_eq!(lag_in(&VecDeque::new(), 50, None, now), Duration::ZERO);
    }

    const SEGMENT: u64 = 16 << 20;
    const BLOCK: u64 = 8192;

    #[test]
    fn an_insert_position_past_a_page_header_is_the_page_boundary() {
        // Mid-page: unchanged.
        let lsn = 5 * SEGMENT + 3 * BLOCK + 1000;
        assert_eq!(end_position(lsn, lsn % SEGMENT, BLOCK), lsn);
        // Just past a short page header: the boundary.
        let lsn = 5 * SEGMENT + 3 * BLOCK + 24;
        assert_eq!(end_position(lsn, lsn % SEGMENT, BLOCK), lsn - 24);
        // Just past a segment's long header: the boundary.
        let lsn = 5 * SEGMENT + 40;
        assert_eq!(end_position(lsn, lsn % SEGMENT, BLOCK), 5 * SEGMENT);
        // 40 bytes into a page other than a segment's first is a record.
        let lsn = 5 * SEGMENT + BLOCK + 40;
        assert_eq!(end_position(lsn, lsn % SEGMENT, BLOCK), lsn);
        // Another page size is read from the server, not assumed.
        let lsn = 2 * SEGMENT + 3 * 32768 + 24;
        assert_eq!(end_position(lsn, lsn % SEGMENT, 32768), lsn - 24);
        let lsn = 2 * SEGMENT + BLOCK + 24;
        assert_eq!(end_position(lsn, lsn % SEGMENT, 32768), lsn);
        assert_eq!(end_position(lsn, lsn % SEGMENT, BLOCK), lsn - 24);
    }
}
