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
//! - **Loads.** A load goes to a replica only if the replica's replay
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
//! The required LSN only rises, so a replica's cached replay position (which
//! only rises too) that satisfies it once satisfies it for good; a stale
//! health reading can only send a load to the primary, never to a replica
//! that is behind.
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
//! and `pg_last_xact_replay_timestamp()`. A replica is used while it
//! answers, is in recovery, and its lag (time since the primary first wrote
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

use crate::config::DatabaseConfig;
use crate::shutdown::Shutdown;

/// One replica: its pool, its state as last checked, its counters.
pub struct Replica {
    /// `host:port`, for logs and metrics (never the URL: it may hold a
    /// password).
    pub name: String,
    pool: PgPool,
    /// Replay position (LSN as a number) at the last check or refresh.
    replay: AtomicU64,
    /// Up, in recovery and within `max_replica_lag` at the last check.
    usable: AtomicBool,
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

    pub fn replay_lsn(&self) -> u64 {
        self.replay.load(Ordering::Relaxed)
    }

    /// Its state and counters as of now.
    pub fn snapshot(&self) -> ReplicaSnapshot {
        ReplicaSnapshot {
            name: self.name.clone(),
            usable: self.is_usable(),
            lag_ms: self.lag().as_millis() as u64,
            replay_lsn: crate::db::lsn::Lsn(self.replay_lsn()).to_string(),
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
    async fn refresh(&self) -> Result<u64, sqlx::Error> {
        let lsn: i64 = sqlx::query_scalar(REPLAY_LSN).fetch_one(&self.pool).await?;
        let lsn = u64::try_from(lsn).unwrap_or(0);
        self.replay.fetch_max(lsn, Ordering::Relaxed);
        Ok(lsn)
    }
}

/// A replica at one moment, for the admin API and `/metrics`.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ReplicaSnapshot {
    pub name: String,
    pub usable: bool,
    pub lag_ms: u64,
    pub replay_lsn: String,
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

const REPLAY_LSN: &str = "SELECT (coalesce(pg_last_wal_replay_lsn(), '0/0') - '0/0'::pg_lsn)::int8";
/// The insert position (not the write position: see the module doc), with
/// its offset in its segment and the WAL page size, for [`end_position`].
const PRIMARY_LSN: &str = "SELECT (i.l - '0/0'::pg_lsn)::int8, o.file_offset, \
     current_setting('wal_block_size')::int4 \
     FROM (SELECT pg_current_wal_insert_lsn() AS l) i, pg_walfile_name_offset(i.l) o";
/// The write position: the WAL a replica could have; for lag only.
const PRIMARY_WRITE_LSN: &str = "SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::int8";

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
    required: AtomicU64,
    /// Changes applied whose LSN could not be read (the primary did not
    /// answer): until a check reads the primary's position after them,
    /// every read goes to the primary.
    unknown: AtomicU64,
    primary: PgPool,
    /// The primary's WAL position at recent checks, oldest first, for lag.
    history: Mutex<VecDeque<(Instant, u64)>>,
}

impl Replicas {
    /// `None` when no replica is configured.
    pub fn new(cfg: &DatabaseConfig, primary: PgPool) -> Result<Option<Self>, sqlx::Error> {
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
            let pool = PgPoolOptions::new()
                .max_connections(cfg.pool_size)
                // A replica that does not answer quickly is skipped for the
                // primary, not waited on for the request's whole budget.
                .acquire_timeout(cfg.acquire_timeout.min(Duration::from_millis(500)))
                .connect_lazy_with(opts);
            members.push(Arc::new(Replica {
                name,
                pool,
                replay: AtomicU64::new(0),
                usable: AtomicBool::new(false),
                lag_ms: AtomicU64::new(0),
                queries: AtomicU64::new(0),
                errors: AtomicU64::new(0),
            }));
        }
        Ok(Some(Self {
            members,
            next: AtomicUsize::new(0),
            max_lag: cfg.max_replica_lag,
            required: AtomicU64::new(0),
            unknown: AtomicU64::new(0),
            primary,
            history: Mutex::new(VecDeque::new()),
        }))
    }

    pub fn members(&self) -> &[Arc<Replica>] {
        &self.members
    }

    /// Raises the required LSN (see the module doc); call before applying a
    /// change committed at or below `lsn`.
    pub fn note_change(&self, lsn: u64) {
        self.required.fetch_max(lsn, Ordering::SeqCst);
    }

    /// A change is about to be applied whose LSN is not known.
    pub fn note_unknown_change(&self) {
        self.unknown.fetch_add(1, Ordering::SeqCst);
    }

    pub fn required(&self) -> u64 {
        self.required.load(Ordering::SeqCst)
    }

    /// A position in the primary's WAL past every commit visible now (the
    /// end of the last record inserted: see the module doc).
    pub async fn primary_lsn(&self) -> Result<u64, sqlx::Error> {
        let (lsn, offset, block): (i64, i32, i32) =
            sqlx::query_as(PRIMARY_LSN).fetch_one(&self.primary).await?;
        let n = |v: i64| u64::try_from(v).unwrap_or(0);
        Ok(end_position(n(lsn), n(offset.into()), n(block.into())))
    }

    /// A usable replica that has replayed at least `required`, round robin.
    fn pick_cached(&self, required: u64) -> Option<&Arc<Replica>> {
        let n = self.members.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        (0..n)
            .map(|i| &self.members[(start + i) % n])
            .find(|r| r.is_usable() && r.replay_lsn() >= required)
    }

    /// Where a row load for a key goes: a replica that is far enough along
    /// (asking a lagging one once for its position), or `None` (the
    /// primary).
    pub async fn for_load(&self) -> Option<Arc<Replica>> {
        if self.unknown.load(Ordering::SeqCst) != 0 {
            return None;
        }
        let required = self.required();
        if let Some(r) = self.pick_cached(required) {
            return Some(r.clone());
        }
        let behind = self
            .members
            .iter()
            .find(|r| r.is_usable() && r.replay_lsn() < required)?;
        match behind.refresh().await {
            Ok(lsn) if lsn >= required => Some(behind.clone()),
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
        let required = primary.max(self.required());
        let deadline = Instant::now() + self.max_lag;
        loop {
            if let Some(r) = self.pick_cached(required) {
                return Some(r.clone());
            }
            for r in self.members.iter().filter(|r| r.is_usable()) {
                match r.refresh().await {
                    Ok(lsn) if lsn >= required => return Some(r.clone()),
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

    /// Reads the primary's position and every replica's state once.
    pub async fn check(&self) {
        let now = Instant::now();
        let unknown = self.unknown.load(Ordering::SeqCst);
        if unknown != 0
            && let Ok(lsn) = self.primary_lsn().await
        {
            // Those changes committed before this read: past them now.
            self.note_change(lsn);
            let _ = self
                .unknown
                .compare_exchange(unknown, 0, Ordering::SeqCst, Ordering::SeqCst);
        }
        let written: Result<i64, _> = sqlx::query_scalar(PRIMARY_WRITE_LSN)
            .fetch_one(&self.primary)
            .await;
        if let Ok(lsn) = written {
            let lsn = u64::try_from(lsn).unwrap_or(0);
            let mut h = self.history.lock().unwrap_or_else(|p| p.into_inner());
            if h.back().is_none_or(|&(_, last)| lsn > last) {
                h.push_back((now, lsn));
            }
            // Enough history to tell a lag beyond the limit.
            while h.len() > 2
                && h.get(1)
                    .is_some_and(|&(t, _)| now.duration_since(t) > self.max_lag * 4)
            {
                h.pop_front();
            }
        }
        for r in &self.members {
            let state: Result<(bool, i64, Option<f64>), sqlx::Error> = sqlx::query_as(
                "SELECT pg_is_in_recovery(), \
                 (coalesce(pg_last_wal_replay_lsn(), '0/0') - '0/0'::pg_lsn)::int8, \
                 extract(epoch FROM clock_timestamp() - pg_last_xact_replay_timestamp())::float8",
            )
            .fetch_one(&r.pool)
            .await;
            let usable = match state {
                Ok((in_recovery, replay, since_replayed)) => {
                    let replay = u64::try_from(replay).unwrap_or(0);
                    r.replay.fetch_max(replay, Ordering::Relaxed);
                    let since = since_replayed
                        .filter(|s| s.is_finite() && *s >= 0.0)
                        .map(Duration::from_secs_f64);
                    let lag = self.lag_of(r.replay_lsn(), since, now);
                    r.lag_ms.store(
                        lag.as_millis().try_into().unwrap_or(u64::MAX),
                        Ordering::Relaxed,
                    );
                    // A replica promoted to primary is a different server:
                    // its positions are not the primary's.
                    in_recovery && lag <= self.max_lag
                }
                Err(_) => false,
            };
            if usable != r.is_usable() {
                if usable {
                    tracing::info!(replica = %r.name, "read replica in use");
                } else {
                    tracing::warn!(replica = %r.name, "read replica down, in no recovery, or lagging: using the primary");
                }
            }
            r.usable.store(usable, Ordering::Relaxed);
        }
    }

    /// How long ago the primary first had WAL past `replay`: zero if the
    /// replica has everything the primary had at the last check. When the
    /// primary was past it already at the oldest check remembered (a replica
    /// behind since before the gateway started, or for longer than the
    /// history keeps), at least that long, and at least the time since the
    /// replica last replayed a commit (`since_replayed`, the replica's own
    /// clock): a replica paused for hours is never "lag 0".
    fn lag_of(&self, replay: u64, since_replayed: Option<Duration>, now: Instant) -> Duration {
        let h = self.history.lock().unwrap_or_else(|p| p.into_inner());
        lag_in(&h, replay, since_replayed, now)
    }

    /// Checks until `shutdown` fires (between two checks).
    pub async fn run_checks(self: Arc<Self>, every: Duration, mut shutdown: Shutdown) {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = shutdown.fired() => return,
                _ = tick.tick() => self.check().await,
            }
        }
    }
}

/// [`Replicas::lag_of`] over a history of (check, primary position),
/// oldest first.
fn lag_in(
    history: &VecDeque<(Instant, u64)>,
    replay: u64,
    since_replayed: Option<Duration>,
    now: Instant,
) -> Duration {
    let Some(&(oldest, first_lsn)) = history.front() else {
        return Duration::ZERO;
    };
    if history.back().is_none_or(|&(_, latest)| replay >= latest) {
        return Duration::ZERO;
    }
    if first_lsn <= replay {
        // The first check that saw the primary past it.
        return history
            .iter()
            .find(|&&(_, lsn)| lsn > replay)
            .map_or(Duration::ZERO, |&(t, _)| now.duration_since(t));
    }
    now.duration_since(oldest)
        .max(since_replayed.unwrap_or(Duration::ZERO))
}

#[cfg(test)]
mod tests {
    use super::{end_position, lag_in};
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
