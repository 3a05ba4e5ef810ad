//! The `queue` source: the triggers `db::triggers` generates write each
//! change as a row of the change table (`public.bloomgate_changes`, the
//! same payload the `notify` source receives), and this source polls it.
//!
//! It exists for servers where logical decoding is not available
//! (`wal_level` below `logical`, no REPLICATION attribute): like `notify`
//! it needs only triggers, but a notifying transaction takes a
//! cluster-wide lock at commit, which serialises every writer's commit
//! (a third of the writers' throughput, measured), and a notification sent while
//! a listener is away is lost. A row in a table takes no lock at commit and
//! stays until it is read.
//!
//! # Which rows a poll delivers: snapshots, not ids
//! Transaction ids are handed out when a transaction first writes, and
//! transactions commit in any order, so "every row with an id above the
//! last one read" would miss the row of a transaction that started early
//! and committed late. Each row carries the writer's transaction id
//! (`xid`, `xid8`: it never wraps) instead, and each poll is one statement
//! that reads `pg_current_snapshot()` together with the rows whose
//! transaction that snapshot shows as committed and the previous poll's
//! snapshot did not:
//!
//! - A statement reads the table in one snapshot, and `pg_current_snapshot()`
//!   is that snapshot: the rows it returns are exactly those of the
//!   transactions it shows as committed (an aborted transaction's rows are
//!   never visible).
//! - Keeping the rows the previous snapshot does not show then yields each
//!   committed transaction in exactly one poll: the first whose snapshot
//!   shows it. A snapshot does not show exactly the transactions with
//!   `xid >= xmax` or listed in its `xip`, which is how the query asks
//!   (two index searches: a long-running transaction, which holds `xmin`
//!   back, does not make every poll read every row since it began).
//! - The first snapshot is taken before `ready` fires, and start-up waits
//!   for it before the first filter scan takes its own: every change
//!   committed after the scan's snapshot is one the first snapshot does not
//!   show, so it is delivered (one committed in between is in both: applying
//!   is idempotent).
//! - Delivered changes are applied in any order within a poll: the
//!   applier's effects commute (keys only ever enter the filter, cache
//!   entries are only dropped, rebuilds scan after the poll's commits). The
//!   rows come ordered by `xid`, which for transactions run one after the
//!   other is commit order (the tests' marker commits rely on that).
//!
//! # Nothing lost while away
//! A failed poll keeps the previous snapshot and is retried: the rows are
//! still there, so a reconnect resumes without a rebuild (unlike
//! `notify`), and a change re-delivered after a poll failed half way is
//! applied twice, harmlessly. Every statement has a deadline
//! ([`STATEMENT_DEADLINE`]); past it the connection is dropped and a new
//! one made, so a hung connection delays changes by that much, no more.
//!
//! # Heartbeats and checks
//! A poll's snapshot is taken after the poll began, so a successful poll
//! has delivered every transaction committed before that moment: each is a
//! [`Event::Heartbeat`]. A failed poll tells the gateway at once
//! ([`Event::Interrupted`]). Every [`CHECK_EVERY`] the watched tables and
//! their triggers are checked ([`super::watch::check_triggers`]).
//!
//! Snapshots compare only within one server's history. When the feed's
//! connection is new (a different backend), it checks the server's
//! identity (`system_identifier`, timeline and postmaster start time):
//! after a failover to a promoted standby or a restore, transaction ids
//! below the old snapshot's `xmax` may have been handed out again, so the
//! previous snapshot means nothing there; after a restart in place, a
//! commit made with `synchronous_commit = off` that was visible (and may
//! have been loaded into a cache) may have been lost with its change row
//! (see `db::position`). Then, as after a long outage (below), it starts
//! from a new snapshot and has every table rescanned: caches cleared,
//! filters rebuilt.
//!
//! # Pruning
//! Every gateway deletes rows older than `database.queue_retention`: once
//! per tenth of it, each gateway notes the `xmin` of its latest snapshot,
//! and deletes `xid < ` a note at least `queue_retention` old. Every such
//! transaction had finished when that snapshot was taken, so a gateway
//! whose own snapshot is younger than that has delivered them. A gateway
//! whose last successful poll is older than half the retention (a long
//! outage) cannot know that, and sends an [`Event::Resync`] of every
//! watched table instead of resuming: their caches are cleared and their
//! filters rebuilt from a snapshot taken after its new starting snapshot.
//! That rule rests on every gateway having the same `queue_retention` and
//! on the host's monotonic clock (a suspended virtual machine is "away"
//! without knowing it), so the table says it too: before deleting, a
//! gateway raises the pruning mark (`bloomgate_changes_pruned.below`, only
//! ever raised) to the `xid` it deletes below, and every poll reads the
//! mark in its snapshot. A mark above the previous snapshot's `xmin` means
//! rows that snapshot had not shown may be gone: the gateway rescans
//! likewise. Deletion runs in batches on a second connection, so polls go
//! on meanwhile; each batch is a transaction holding an advisory lock
//! ([`PRUNE_LOCK_KEY`]), and a gateway that finds it taken leaves the
//! pruning to the holder (which raised the mark before deleting). The
//! first batch raises the mark in the same transaction as its deletions.
//!
//! # Forgery
//! Only the change table's owner may write to it; the trigger functions
//! write as their definer. Payloads are parsed as `notify`'s are (junk is
//! dropped, logged at most once per interval), and their keys are
//! *announced*, not trusted (see `resource`), like `notify`'s.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use futures_util::TryStreamExt;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgPool, Row};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use super::notify::{self, Counters};
use super::watch::{Tracker, check_triggers};
use super::{CHECK_EVERY, Event, Health, Resync, Watch};
use crate::db::triggers::{QUEUE_TABLE_CHECK, Sink};
use crate::shutdown::Shutdown;
use crate::telemetry::LogThrottle;

/// The feed's connections, as `pg_stat_activity` shows them.
pub const APPLICATION_NAME: &str = "bloomgate-queue-feed";

/// Longest any of the feed's statements may take before its connection is
/// dropped and the statement retried on a new one.
pub const STATEMENT_DEADLINE: Duration = Duration::from_secs(10);

/// Rows deleted per statement when pruning.
const PRUNE_BATCH: i64 = 10_000;

/// The transaction-level advisory lock each pruning batch takes, so one
/// gateway prunes at a time and the others, finding it taken, leave it to
/// that one (rather than every gateway deleting the same rows, each
/// waiting on the other's row locks).
pub const PRUNE_LOCK_KEY: i64 = crate::db::INSTALL_LOCK_KEY + 1;

/// One poll: the statement's snapshot, the backend (see [`BACKEND`]: a new
/// one means a new connection), the pruning mark, and the payloads of the transactions the snapshot
/// shows as committed that `$1` did not (see the module doc). One row with
/// a NULL payload when there are none.
const POLL: &str = "SELECT s.cur::text, s.backend, s.pruned::text, c.payload
  FROM (SELECT pg_current_snapshot() AS cur,
               pg_backend_pid()::text || '@' || pg_postmaster_start_time()::text AS backend,
               (SELECT below FROM public.bloomgate_changes_pruned LIMIT 1) AS pruned) s
  LEFT JOIN public.bloomgate_changes c
    ON c.xid >= pg_snapshot_xmax($1::pg_snapshot)
    OR c.xid = ANY(ARRAY(SELECT pg_snapshot_xip($1::pg_snapshot)))
 ORDER BY c.xid";

/// Which backend a statement ran on: its pid and its server's start time
/// (a pid alone could repeat on another server after a failover).
const BACKEND: &str = "pg_backend_pid()::text || '@' || pg_postmaster_start_time()::text";

/// Which server history snapshots belong to: the cluster's
/// `system_identifier` and the current timeline.
const IDENTITY: &str =
    "SELECT system_identifier::text || '/' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8)
         || '/' || pg_postmaster_start_time()::text
  FROM pg_control_system()";

pub struct Options {
    /// The primary (the feed prunes the table).
    pub connect: PgConnectOptions,
    /// Shared with `notify`'s meaning: `notifications` counts change rows
    /// read, `listener_reconnects` failed polls.
    pub counters: Arc<Counters>,
    /// `database.queue_poll_interval`.
    pub interval: Duration,
    /// `database.queue_retention`.
    pub retention: Duration,
    pub health: Arc<Health>,
    /// `database.install_triggers`: a check that finds a trigger missing or
    /// outdated installs it (and rescans its table).
    pub install: bool,
}

/// Why the source cannot start.
#[derive(Debug, thiserror::Error)]
pub enum QueueError {
    #[error(
        "the database is a hot standby (pg_is_in_recovery() is true): the queue feed prunes its table and needs the primary; point database.url at it (or set database.freshness = \"off\")"
    )]
    Standby,
    #[error(
        "no change table public.bloomgate_changes (database.freshness = queue): run `bloomgate install-triggers` or set database.install_triggers = true"
    )]
    NoTable,
    #[error(
        "the queue feed's table {0}: a table anyone else may write lets them forge changes; drop it (if there) and run `bloomgate install-triggers` as the gateway's role"
    )]
    Unsafe(String),
}

/// A task aborted when this is dropped (the feed's pruning: it stops with
/// the feed).
struct AbortOnDrop(Option<JoinHandle<()>>);

impl AbortOnDrop {
    fn running(&self) -> bool {
        self.0.as_ref().is_some_and(|t| !t.is_finished())
    }
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if let Some(t) = &self.0 {
            t.abort();
        }
    }
}

/// Where the feed stands: the snapshot of its last successful poll.
struct Position {
    snapshot: String,
    /// When that snapshot was taken (no later than this).
    taken: Instant,
    /// The backend that took it.
    backend: String,
    /// The server history it belongs to ([`IDENTITY`]).
    identity: String,
}

/// Polls until `shutdown` fires or `tx` closes. `ready` gets `Ok` once
/// the first snapshot is taken (from then on every commit is delivered), or
/// the error that prevents it for good; transient failures are retried.
pub async fn run(
    opts: Options,
    watch: Watch,
    tx: mpsc::Sender<Event>,
    ready: oneshot::Sender<Result<(), String>>,
    mut shutdown: Shutdown,
) {
    // Its own pool: polls must not wait for the request path's
    // connections, nor take them. Two connections: one polls, the other
    // prunes.
    let connect = opts.connect.clone().application_name(APPLICATION_NAME);
    let new_pool = || {
        PgPoolOptions::new()
            .max_connections(2)
            .acquire_timeout(Duration::from_secs(5))
            .connect_lazy_with(connect.clone())
    };
    let mut pool = new_pool();
    let mut at = match first_position(&pool).await {
        Ok(p) => p,
        Err(e) => {
            tracing::error!(error = %e, "cannot follow key changes");
            let _ = ready.send(Err(e.to_string()));
            return;
        }
    };
    let mut tracker = Tracker::default();
    // The first check, before start-up scans: it reports what cannot be
    // followed. Retried like a poll.
    loop {
        let checked = async {
            let mut conn = timed(pool.acquire()).await?;
            let events = timed(check_triggers(
                &mut conn,
                &watch,
                Sink::Queue,
                opts.install,
                &mut tracker,
            ))
            .await?;
            Ok::<_, Failure>(events)
        };
        match checked.await {
            Ok(events) => {
                for e in events {
                    if tx.send(e).await.is_err() {
                        return;
                    }
                }
                break;
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot check the watched tables yet");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    }
    let _ = ready.send(Ok(()));
    opts.health.streaming();
    let counters = &opts.counters;
    let ignored = LogThrottle::default();
    let failures = LogThrottle::default();
    let mut checked = Instant::now();
    // Told the gateway the feed stopped, since the last good poll.
    let mut interrupted = false;
    let mut pruner = Pruner::new(opts.retention);
    let mut pruning = AbortOnDrop(None);
    let mut delay = opts.interval;
    // Set when the position means nothing any more (see the module doc):
    // the next turn starts afresh and rescans every table.
    let mut rescan = false;
    loop {
        // Between polls: what was read is delivered, and the position is
        // in the table; a pruning batch in flight is its own transaction.
        tokio::select! {
            () = shutdown.fired() => return,
            () = tokio::time::sleep(delay) => {}
        }
        if !rescan && at.taken.elapsed() >= opts.retention / 2 {
            // Another gateway may have pruned rows this one never read.
            tracing::warn!(
                "the change queue was not read for half of database.queue_retention; every table is rescanned in case pruned changes were missed"
            );
            rescan = true;
        }
        let began = Instant::now();
        let outcome = if rescan {
            restart(&pool, &tx).await.map(|p| match p {
                Some(p) => {
                    at = p;
                    rescan = false;
                    Polled::At(at.snapshot.clone(), at.backend.clone())
                }
                None => Polled::Stopped,
            })
        } else {
            poll(&pool, &at, &watch, &tx, counters, &ignored).await
        };
        match outcome {
            Ok(Polled::Stopped) => return,
            Ok(Polled::Pruned) => {
                tracing::warn!(
                    "changes this gateway had not read were deleted (by a gateway with a shorter database.queue_retention, or after a long pause): every table is rescanned"
                );
                rescan = true;
                continue;
            }
            Ok(Polled::Elsewhere) => {
                tracing::warn!(
                    was = %at.identity,
                    "the database is another server history (failover or restore): every table is rescanned"
                );
                // The pool's other connection may still be on the old
                // server (an address moved while it stayed up): start over
                // with connections that all reach the new one.
                pool = new_pool();
                // Its notes and its running batch belong to the old history.
                pruner = Pruner::new(opts.retention);
                pruning = AbortOnDrop(None);
                rescan = true;
                continue;
            }
            Ok(Polled::At(snapshot, backend)) => {
                at.snapshot = snapshot;
                at.taken = at.taken.max(began);
                at.backend = backend;
                delay = opts.interval;
                interrupted = false;
                opts.health.streaming();
                let mut events = Vec::new();
                if checked.elapsed() >= CHECK_EVERY {
                    let check = async {
                        let mut conn = timed(pool.acquire()).await?;
                        timed(check_triggers(
                            &mut conn,
                            &watch,
                            Sink::Queue,
                            opts.install,
                            &mut tracker,
                        ))
                        .await
                    };
                    match check.await {
                        Ok(found) => {
                            events = found;
                            checked = Instant::now();
                        }
                        Err(e) => tracing::debug!(error = %e, "queue feed: the check failed"),
                    }
                }
                // The poll's snapshot was taken after `began`: every
                // transaction committed before it has been delivered.
                events.push(Event::Heartbeat(began));
                for e in events {
                    if tx.send(e).await.is_err() {
                        return;
                    }
                }
            }
            Err(e) => {
                delay = failed(counters, &failures, &e, delay, opts.interval);
                opts.health.waiting(format!("change queue: {e}"));
                if !interrupted {
                    interrupted = true;
                    if tx.send(Event::Interrupted(e.to_string())).await.is_err() {
                        return;
                    }
                }
                if matches!(e, Failure::Deadline) {
                    pool = new_pool();
                }
                continue;
            }
        }
        if !pruning.running()
            && let Some(below) = pruner.due(&at.snapshot)
        {
            pruning = AbortOnDrop(Some(tokio::spawn(prune(pool.clone(), below))));
        }
    }
}

/// Why a statement failed.
#[derive(Debug, thiserror::Error)]
enum Failure {
    #[error("{0}")]
    Sql(#[from] sqlx::Error),
    #[error("no answer within {STATEMENT_DEADLINE:?}")]
    Deadline,
}

async fn timed<T>(f: impl Future<Output = Result<T, sqlx::Error>>) -> Result<T, Failure> {
    match tokio::time::timeout(STATEMENT_DEADLINE, f).await {
        Ok(r) => Ok(r?),
        Err(_) => Err(Failure::Deadline),
    }
}

/// A failed statement: counted, logged at most once per interval (as an
/// error when retrying cannot fix it), retried with capped back-off from
/// the same snapshot.
fn failed(
    counters: &Counters,
    log: &LogThrottle,
    e: &Failure,
    delay: Duration,
    interval: Duration,
) -> Duration {
    counters.listener_reconnects.fetch_add(1, Ordering::Relaxed);
    if let Some(not_logged) = log.permit() {
        let code = match e {
            Failure::Sql(sqlx::Error::Database(d)) => d.code().map(|c| c.into_owned()),
            _ => None,
        };
        // No privilege, no table, a standby: needs an operator.
        if matches!(code.as_deref(), Some("42501" | "42P01" | "25006")) {
            tracing::error!(error = %e, not_logged, "cannot read the change queue: changes are not followed until this is fixed");
        } else {
            tracing::warn!(error = %e, not_logged, "cannot read the change queue; retrying from the last snapshot (nothing is lost)");
        }
    }
    (delay * 2).min(Duration::from_secs(1)).max(interval)
}

enum Polled {
    /// The new snapshot, and the backend that took it.
    At(String, String),
    /// Nobody receives events any more.
    Stopped,
    /// Rows the previous snapshot had not shown may have been deleted.
    Pruned,
    /// A new connection reached another server history (failover,
    /// restore): the position means nothing there.
    Elsewhere,
}

/// Reads one poll's changes and sends them.
async fn poll(
    pool: &PgPool,
    at: &Position,
    watch: &Watch,
    tx: &mpsc::Sender<Event>,
    counters: &Counters,
    ignored: &LogThrottle,
) -> Result<Polled, Failure> {
    let mut conn = timed(pool.acquire()).await?;
    let mut rows = sqlx::query(POLL).bind(&at.snapshot).fetch(&mut *conn);
    let mut cur = None;
    // The deadline is for the server's answers; the applier's pace is the
    // applier's business (`send` waits for room in the channel).
    while let Some(row) = timed(rows.try_next()).await? {
        if cur.is_none() {
            cur = Some((row.try_get::<String, _>(0)?, row.try_get::<String, _>(1)?));
            // Rows of transactions below the mark may be gone; those the
            // previous snapshot did not show are all at or above its xmin.
            let pruned: Option<String> = row.try_get(2)?;
            let mark = pruned.as_deref().and_then(|p| p.parse::<u64>().ok());
            let from = xmin(&at.snapshot).and_then(|x| x.parse::<u64>().ok());
            if let (Some(mark), Some(from)) = (mark, from)
                && mark > from
            {
                return Ok(Polled::Pruned);
            }
        }
        let Some(payload) = row.try_get::<Option<String>, _>(3)? else {
            continue;
        };
        counters.notifications.fetch_add(1, Ordering::Relaxed);
        let event = match notify::parse(watch, &payload, counters) {
            Ok(Some(e)) => e,
            Ok(None) => continue,
            Err(why) => {
                if let Some(not_logged) = ignored.permit() {
                    tracing::warn!(problem = %why, not_logged, "ignoring a change row");
                }
                continue;
            }
        };
        if tx.send(event).await.is_err() {
            return Ok(Polled::Stopped);
        }
    }
    drop(rows);
    let (snapshot, backend) = cur.ok_or(sqlx::Error::RowNotFound)?;
    if backend != at.backend {
        // A new connection: is it still the same server history? Asked on
        // this connection: another in the pool (the pruner's) may still be
        // on the old server while this one reached a new one.
        let identity: String = timed(sqlx::query_scalar(IDENTITY).fetch_one(&mut *conn)).await?;
        if identity != at.identity {
            return Ok(Polled::Elsewhere);
        }
    }
    Ok(Polled::At(snapshot, backend))
}

/// A new starting position, then a rescan of every watched table (caches
/// cleared, filters rebuilt from a later snapshot); `None` when nobody
/// receives events any more.
async fn restart(pool: &PgPool, tx: &mpsc::Sender<Event>) -> Result<Option<Position>, Failure> {
    let p = timed(position(pool)).await?;
    if tx
        .send(Resync::all(
            "queue feed: changes may have been pruned unread",
        ))
        .await
        .is_err()
    {
        return Ok(None);
    }
    Ok(Some(p))
}

/// A snapshot and what it belongs to, read on one connection.
async fn position(pool: &PgPool) -> Result<Position, sqlx::Error> {
    let mut conn = pool.acquire().await?;
    let (snapshot, backend): (String, String) =
        sqlx::query_as(&format!("SELECT pg_current_snapshot()::text, {BACKEND}"))
            .fetch_one(&mut *conn)
            .await?;
    let identity = sqlx::query_scalar(IDENTITY).fetch_one(&mut *conn).await?;
    Ok(Position {
        snapshot,
        taken: Instant::now(),
        backend,
        identity,
    })
}

/// The starting position, once the server is known to be a primary with a
/// change table nobody else may write; transient failures are retried with
/// capped back-off.
async fn first_position(pool: &PgPool) -> Result<Position, QueueError> {
    let mut delay = Duration::from_millis(100);
    loop {
        let attempt = async {
            let (standby, table): (bool, bool) = sqlx::query_as(
                "SELECT pg_is_in_recovery(), to_regclass('public.bloomgate_changes') IS NOT NULL",
            )
            .fetch_one(pool)
            .await?;
            if standby {
                return Ok(Err(QueueError::Standby));
            }
            if !table {
                return Ok(Err(QueueError::NoTable));
            }
            let unsafe_: Option<String> = sqlx::query_scalar(QUEUE_TABLE_CHECK)
                .fetch_optional(pool)
                .await?
                .flatten();
            if let Some(why) = unsafe_ {
                return Ok(Err(QueueError::Unsafe(why)));
            }
            Ok::<_, sqlx::Error>(Ok(position(pool).await?))
        };
        match timed(attempt).await {
            Ok(r) => return r,
            Err(e) => {
                tracing::warn!(error = %e, retry_in = ?delay, "cannot read the change queue yet");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(5));
            }
        }
    }
}

/// Deletes the rows of transactions below `below`, in batches (each its
/// own transaction and deadline: [`prune_batch`]), on the pool's second
/// connection, once the pruning mark says so (a gateway that had not read
/// them learns it from the mark, whatever its own retention or clock).
async fn prune(pool: PgPool, below: String) {
    static FAILURES: std::sync::OnceLock<LogThrottle> = std::sync::OnceLock::new();
    let log = |e: &Failure| {
        if let Some(not_logged) = FAILURES.get_or_init(LogThrottle::default).permit() {
            tracing::warn!(error = %e, not_logged, "cannot delete old rows of the change queue");
        }
    };
    let mut deleted = 0;
    let mut first = true;
    loop {
        match timed(prune_batch(&pool, &below, first)).await {
            Ok(Some(n)) => {
                deleted += n;
                first = false;
                if n < PRUNE_BATCH as u64 {
                    break;
                }
            }
            Ok(None) => {
                tracing::debug!("another gateway is deleting old change rows");
                break;
            }
            Err(e) => {
                log(&e);
                break;
            }
        }
    }
    tracing::debug!(deleted, "old change rows deleted");
}

/// One batch of pruning in its own transaction, under [`PRUNE_LOCK_KEY`]
/// (`None`: another gateway holds it, and prunes); the first batch also
/// raises the mark, committed with its deletions, so no snapshot sees
/// rows gone and the mark not raised.
async fn prune_batch(pool: &PgPool, below: &str, mark: bool) -> Result<Option<u64>, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let locked: bool = sqlx::query_scalar("SELECT pg_try_advisory_xact_lock($1)")
        .bind(PRUNE_LOCK_KEY)
        .fetch_one(&mut *tx)
        .await?;
    if !locked {
        return Ok(None);
    }
    if mark {
        sqlx::query(
            "UPDATE public.bloomgate_changes_pruned SET below = $1::text::xid8
              WHERE below < $1::text::xid8",
        )
        .bind(below)
        .execute(&mut *tx)
        .await?;
    }
    let r = sqlx::query(
        "DELETE FROM public.bloomgate_changes WHERE ctid = ANY(ARRAY(
           SELECT ctid FROM public.bloomgate_changes WHERE xid < $1::text::xid8 LIMIT $2))",
    )
    .bind(below)
    .bind(PRUNE_BATCH)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(Some(r.rows_affected()))
}

/// `xmin` of a snapshot's text (`xmin:xmax:xip,...`).
fn xmin(snapshot: &str) -> Option<&str> {
    let x = snapshot.split(':').next()?;
    (!x.is_empty() && x.bytes().all(|b| b.is_ascii_digit())).then_some(x)
}

/// When to prune, and below which transaction id (see the module doc).
struct Pruner {
    retention: Duration,
    every: Duration,
    /// (when, the `xmin` of a snapshot taken then), oldest first.
    notes: VecDeque<(Instant, String)>,
    last: Option<Instant>,
}

impl Pruner {
    fn new(retention: Duration) -> Self {
        Self {
            retention,
            every: (retention / 10).max(Duration::from_secs(1)),
            notes: VecDeque::new(),
            last: None,
        }
    }

    /// Notes `snapshot` once per tenth of the retention; then, if a note is
    /// old enough, the `xmin` to delete below (the newest such note's).
    fn due(&mut self, snapshot: &str) -> Option<String> {
        self.due_at(Instant::now(), snapshot)
    }

    fn due_at(&mut self, now: Instant, snapshot: &str) -> Option<String> {
        if self
            .last
            .is_some_and(|t| now.duration_since(t) < self.every)
        {
            return None;
        }
        self.last = Some(now);
        let current = xmin(snapshot)?;
        // Within one server history `xmin` never goes back. A note above
        // the current one is from another history (a failover or restore to
        // lower ids): deleting below it, and raising the pruning mark to it,
        // would make every gateway rescan on every poll until the ids
        // caught up. Such notes are dropped.
        let ahead = |x: &str| x.parse::<u64>().ok() > current.parse::<u64>().ok();
        if self.notes.iter().any(|(_, x)| ahead(x)) {
            self.notes.clear();
        }
        self.notes.push_back((now, current.to_string()));
        let mut below = None;
        while let Some((at, _)) = self.notes.front()
            && now.duration_since(*at) >= self.retention
        {
            below = self.notes.pop_front().map(|(_, x)| x);
        }
        below
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xmin_is_the_first_field_of_a_snapshot() {
        assert_eq!(xmin("740:745:740,742"), Some("740"));
        assert_eq!(xmin("3:3:"), Some("3"));
        for bad in ["", ":1:", "x:1:", "1 :2:"] {
            assert_eq!(xmin(bad), None, "{bad:?}");
        }
    }

    /// Rows go only once a note is a whole retention old, and only below
    /// that note's `xmin`, never a younger one.
    #[test]
    fn pruning_waits_a_whole_retention_and_uses_the_newest_old_enough_note() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut p = Pruner::new(s(100));
        assert_eq!(p.every, s(10));
        assert_eq!(p.due_at(t0, "100:100:"), None);
        // Within the same tenth: not even noted.
        assert_eq!(p.due_at(t0 + s(5), "150:150:"), None);
        assert_eq!(p.notes.len(), 1);
        for i in 1..10u64 {
            let snapshot = format!("{}:{}:", 100 + i * 10, 100 + i * 10);
            assert_eq!(p.due_at(t0 + s(i * 10), &snapshot), None, "at {i}0 s");
        }
        // 100 s after the first note: below its xmin, nothing younger.
        assert_eq!(p.due_at(t0 + s(100), "200:200:").as_deref(), Some("100"));
        // A long gap: the newest note at least 100 s old wins.
        assert_eq!(p.due_at(t0 + s(195), "300:300:").as_deref(), Some("190"));
        assert!(p.notes.iter().all(|(at, _)| t0 + s(195) - *at < s(100)));
    }

    /// After a switch to a server history with lower transaction ids, the
    /// old history's notes are never used to prune.
    #[test]
    fn notes_from_a_history_with_higher_ids_are_dropped() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut p = Pruner::new(s(100));
        for i in 0..10u64 {
            let snapshot = format!("{}:{}:", 9000 + i, 9000 + i);
            assert_eq!(p.due_at(t0 + s(i * 10), &snapshot), None);
        }
        // The new history: ids around 500, and the old notes old enough.
        assert_eq!(p.due_at(t0 + s(150), "500:500:"), None);
        assert_eq!(p.notes.len(), 1);
        assert_eq!(p.due_at(t0 + s(250), "600:600:").as_deref(), Some("500"));
    }
}
