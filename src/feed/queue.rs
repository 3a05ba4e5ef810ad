//! The `queue` source: the triggers `db::triggers` generates write each
//! change as a row of the change table (`public.bloomgate_changes`, the
//! same payload the `notify` source receives), and this source polls it.
//!
//! It exists for servers where logical decoding is not available
//! (`wal_level` below `logical`, no REPLICATION attribute): like `notify`
//! it needs only triggers, but a notifying transaction takes a
//! database-wide lock at commit, which serialises every writer's commit
//! (31–41 % of writer TPS in BENCHMARKS.md), and a notification sent while
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
//! - Filtering by `NOT pg_visible_in_snapshot(xid, previous)` then yields
//!   each committed transaction in exactly one poll: the first whose
//!   snapshot shows it. Every transaction the previous snapshot does not
//!   show has `xid >= pg_snapshot_xmin(previous)`, which is what the index
//!   is searched for.
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
//! applied twice, harmlessly.
//!
//! # Pruning
//! Every gateway deletes rows older than `database.queue_retention`: once
//! per tenth of it, each gateway notes the `xmin` of its latest snapshot,
//! and deletes `xid < ` a note at least `queue_retention` old. Every such
//! transaction had finished when that snapshot was taken, so a gateway
//! whose own snapshot is younger than that has delivered them. A gateway
//! whose last successful poll is older than half the retention (a long
//! outage) cannot know that, and sends [`Event::Resync`] instead of
//! resuming: every filter is rebuilt from a snapshot taken after its new
//! starting snapshot.
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

use super::notify::{self, Counters};
use super::{Event, Resync, Watch};
use crate::telemetry::LogThrottle;

/// The feed's connection, as `pg_stat_activity` shows it.
pub const APPLICATION_NAME: &str = "bloomgate-queue-feed";

/// One poll: the statement's snapshot, and the payloads of the transactions
/// it shows as committed that `$1` did not (see the module doc). One row
/// with a NULL payload when there are none.
const POLL: &str = "SELECT s.cur::text, c.payload
  FROM (SELECT pg_current_snapshot() AS cur) s
  LEFT JOIN public.bloomgate_changes c
    ON c.xid >= pg_snapshot_xmin($1::pg_snapshot)
   AND NOT pg_visible_in_snapshot(c.xid, $1::pg_snapshot)
 ORDER BY c.xid";

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
}

/// Why the source cannot start.
#[derive(Debug, thiserror::Error)]
pub enum QueueError {
    #[error(
        "the database is a hot standby (pg_is_in_recovery() is true): the queue feed prunes its table and needs the primary; point database.url at it (or set database.listen = false)"
    )]
    Standby,
    #[error(
        "no change table public.bloomgate_changes (database.freshness = queue): run `bloomgate install-triggers` or set database.install_triggers = true"
    )]
    NoTable,
}

/// Polls until the task is aborted or `tx` closes. `ready` gets `Ok` once
/// the first snapshot is taken (from then on every commit is delivered), or
/// the error that prevents it for good; transient failures are retried.
pub async fn run(
    opts: Options,
    watch: Watch,
    tx: mpsc::Sender<Event>,
    ready: oneshot::Sender<Result<(), String>>,
) {
    // Its own one-connection pool: polls must not wait for the request
    // path's connections, nor take them.
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(5))
        .connect_lazy_with(opts.connect.application_name(APPLICATION_NAME));
    let mut prev = match first_snapshot(&pool).await {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "cannot follow key changes");
            let _ = ready.send(Err(e.to_string()));
            return;
        }
    };
    let _ = ready.send(Ok(()));
    let mut taken = Instant::now();
    let counters = &opts.counters;
    let ignored = LogThrottle::default();
    let failures = LogThrottle::default();
    let mut pruner = Pruner::new(opts.retention);
    let mut delay = opts.interval;
    loop {
        tokio::time::sleep(delay).await;
        if taken.elapsed() >= opts.retention / 2 {
            // Another gateway may have pruned rows this one never read.
            match snapshot(&pool).await {
                Ok(s) => {
                    prev = s;
                    taken = Instant::now();
                    tracing::warn!(
                        "the change queue was not read for half of database.queue_retention; every filter is rebuilt in case pruned changes were missed"
                    );
                    let resync = Event::Resync(Resync {
                        reason: "queue: not read for half the retention".into(),
                        snapshot: None,
                    });
                    if tx.send(resync).await.is_err() {
                        return;
                    }
                }
                Err(e) => {
                    delay = failed(counters, &failures, &e, delay, opts.interval);
                    continue;
                }
            }
        }
        let began = Instant::now();
        match poll(&pool, &prev, &watch, &tx, counters, &ignored).await {
            Ok(Some(cur)) => {
                prev = cur;
                taken = began;
                delay = opts.interval;
            }
            Ok(None) => return,
            Err(e) => {
                delay = failed(counters, &failures, &e, delay, opts.interval);
                continue;
            }
        }
        if let Some(below) = pruner.due(&prev)
            && let Err(e) = prune(&pool, &below).await
            && let Some(not_logged) = failures.permit()
        {
            tracing::warn!(error = %e, not_logged, "cannot delete old rows of the change queue");
        }
    }
}

/// A failed poll: counted, logged at most once per interval, retried with
/// capped back-off from the same snapshot.
fn failed(
    counters: &Counters,
    log: &LogThrottle,
    e: &sqlx::Error,
    delay: Duration,
    interval: Duration,
) -> Duration {
    counters.listener_reconnects.fetch_add(1, Ordering::Relaxed);
    if let Some(not_logged) = log.permit() {
        tracing::warn!(error = %e, not_logged, "cannot read the change queue; retrying from the last snapshot (nothing is lost)");
    }
    (delay * 2).clamp(interval, Duration::from_secs(1))
}

/// Reads one poll's changes and sends them; the new snapshot, or `None`
/// when nobody receives events any more.
async fn poll(
    pool: &PgPool,
    prev: &str,
    watch: &Watch,
    tx: &mpsc::Sender<Event>,
    counters: &Counters,
    ignored: &LogThrottle,
) -> Result<Option<String>, sqlx::Error> {
    let mut conn = pool.acquire().await?;
    let mut rows = sqlx::query(POLL).bind(prev).fetch(&mut *conn);
    let mut cur = None;
    while let Some(row) = rows.try_next().await? {
        if cur.is_none() {
            cur = Some(row.try_get::<String, _>(0)?);
        }
        let Some(payload) = row.try_get::<Option<String>, _>(1)? else {
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
            return Ok(None);
        }
    }
    Ok(Some(cur.ok_or(sqlx::Error::RowNotFound)?))
}

async fn snapshot(pool: &PgPool) -> Result<String, sqlx::Error> {
    sqlx::query_scalar("SELECT pg_current_snapshot()::text")
        .fetch_one(pool)
        .await
}

/// The starting snapshot, once the server is known to be a primary with
/// the change table; transient failures are retried with capped back-off.
async fn first_snapshot(pool: &PgPool) -> Result<String, QueueError> {
    let mut delay = Duration::from_millis(100);
    loop {
        let attempt = async {
            let mut conn = pool.acquire().await?;
            let (standby, table): (bool, bool) = sqlx::query_as(
                "SELECT pg_is_in_recovery(), to_regclass('public.bloomgate_changes') IS NOT NULL",
            )
            .fetch_one(&mut *conn)
            .await?;
            if standby {
                return Ok(Err(QueueError::Standby));
            }
            if !table {
                return Ok(Err(QueueError::NoTable));
            }
            let s: String = sqlx::query_scalar("SELECT pg_current_snapshot()::text")
                .fetch_one(&mut *conn)
                .await?;
            Ok::<_, sqlx::Error>(Ok(s))
        };
        match attempt.await {
            Ok(r) => return r,
            Err(e) => {
                tracing::warn!(error = %e, retry_in = ?delay, "cannot read the change queue yet");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(5));
            }
        }
    }
}

async fn prune(pool: &PgPool, below: &str) -> Result<(), sqlx::Error> {
    let deleted = sqlx::query("DELETE FROM public.bloomgate_changes WHERE xid < $1::text::xid8")
        .bind(below)
        .execute(pool)
        .await?
        .rows_affected();
    tracing::debug!(deleted, "old change rows deleted");
    Ok(())
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
        self.notes.push_back((now, xmin(snapshot)?.to_string()));
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
}
