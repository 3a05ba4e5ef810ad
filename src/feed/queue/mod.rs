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
//! their triggers are checked ([`super::tracker::check_triggers`]).
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

mod poll;
mod position;
mod prune;
mod statement;

use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx::PgPool;
use sqlx::postgres::PgConnectOptions;
use tokio::sync::{mpsc, oneshot};

use super::notify::Stats;
use super::tracker::{Shapes, Tracker, check_triggers};
use super::{CHECK_EVERY, Event, Health, NotStarted, Watch};
use crate::db::identity::Identity;
use crate::db::triggers::Sink;
use crate::shutdown::Shutdown;
use crate::telemetry::LogThrottle;
use poll::{Polled, poll};
use position::{Position, first_position, restart};
use prune::{AbortOnDrop, Pruner, prune};
use statement::{Failure, failed, timed};

pub use prune::PRUNE_LOCK_KEY;
pub use statement::STATEMENT_DEADLINE;

/// The feed's connections, as `pg_stat_activity` shows them.
pub const APPLICATION_NAME: &str = "bloomgate-queue-feed";

pub struct QueueOptions {
    /// The primary (the feed prunes the table).
    pub connect: PgConnectOptions,
    /// Shared with `notify`'s meaning: `notifications` counts change rows
    /// read, `listener_reconnects` failed polls.
    pub counters: Arc<Stats>,
    /// `database.queue_poll_interval`.
    pub interval: Duration,
    /// `database.queue_retention`.
    pub retention: Duration,
    pub health: Arc<Health>,
    /// `database.install_triggers`: a check that finds a trigger missing or
    /// outdated installs it (and rescans its table).
    pub install: bool,
    /// The gateway's connections follow the server this feed reads (see
    /// `db::identity`); one of them that reached another is a move.
    pub identity: Arc<Identity>,
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

/// Polls until `shutdown` fires or `tx` closes. `ready` gets `Ok` once
/// the first snapshot is taken (from then on every commit is delivered), or
/// the error that prevents it for good; transient failures are retried.
pub async fn run(
    opts: QueueOptions,
    watch: Watch,
    tx: mpsc::Sender<Event>,
    ready: oneshot::Sender<Result<(), NotStarted>>,
    mut shutdown: Shutdown,
) {
    // Its own pool: polls must not wait for the request path's
    // connections, nor take them. Two connections: one polls, the other
    // prunes.
    let connect = opts.connect.clone().application_name(APPLICATION_NAME);
    let pool = super::private_pool(&connect, APPLICATION_NAME);
    let at = match first_position(&pool).await {
        Ok(p) => p,
        Err(e) => {
            tracing::error!(error = %e, "cannot follow key changes");
            let _ = ready.send(Err(e.into()));
            return;
        }
    };
    opts.identity.follow(at.server);
    let mut tracker = Tracker::default();
    let shapes = Shapes::new(&watch);
    if first_check(&pool, &watch, &tx, opts.install, &mut tracker)
        .await
        .is_break()
    {
        return;
    }
    let _ = ready.send(Ok(()));
    opts.health.streaming();
    let mut feed = Feed {
        ignored: LogThrottle::default(),
        failures: LogThrottle::default(),
        checked: Instant::now(),
        interrupted: false,
        pruner: Pruner::new(opts.retention),
        pruning: AbortOnDrop(None),
        delay: opts.interval,
        rescan: false,
        opts,
        watch,
        tx,
        connect,
        pool,
        at,
        tracker,
        shapes,
    };
    loop {
        // Between polls: what was read is delivered, and the position is
        // in the table; a pruning batch in flight is its own transaction.
        tokio::select! {
            () = shutdown.fired() => return,
            () = tokio::time::sleep(feed.delay) => {}
        }
        if feed.turn().await.is_break() {
            return;
        }
    }
}

/// The first check, before start-up scans: it reports what cannot be
/// followed. Retried like a poll. `Break` when nobody receives events any
/// more.
async fn first_check(
    pool: &PgPool,
    watch: &Watch,
    tx: &mpsc::Sender<Event>,
    install: bool,
    tracker: &mut Tracker,
) -> ControlFlow<()> {
    loop {
        let checked = async {
            let mut conn = timed(pool.acquire()).await?;
            let events = timed(check_triggers(
                &mut conn,
                watch,
                Sink::Queue,
                install,
                tracker,
            ))
            .await?;
            Ok::<_, Failure>(events)
        };
        match checked.await {
            Ok(events) => {
                for e in events {
                    if tx.send(e).await.is_err() {
                        return ControlFlow::Break(());
                    }
                }
                return ControlFlow::Continue(());
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot check the watched tables yet");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    }
}

/// The feed once started: where it stands, and what each turn of the
/// polling loop leaves for the next.
struct Feed {
    // Fields drop in this order: the pruning task is stopped first and the
    // event sender goes last, as when these were `run`'s locals.
    pruning: AbortOnDrop,
    pruner: Pruner,
    opts: QueueOptions,
    watch: Watch,
    /// The connections' options (a new pool is made on them).
    connect: PgConnectOptions,
    pool: PgPool,
    at: Position,
    tracker: Tracker,
    /// The watched tables' shapes as last read (see "Shapes" in
    /// `feed::tracker`).
    shapes: Shapes,
    ignored: LogThrottle,
    failures: LogThrottle,
    /// When the watched tables were last checked.
    checked: Instant,
    /// Told the gateway the feed stopped, since the last good poll.
    interrupted: bool,
    delay: Duration,
    /// Set when the position means nothing any more (see the module doc):
    /// the next turn starts afresh and rescans every table.
    rescan: bool,
    tx: mpsc::Sender<Event>,
}

impl Feed {
    /// One turn after the pause: a poll (or a fresh start), its outcome
    /// acted on, then pruning started when due. `Break` when nobody
    /// receives events any more.
    async fn turn(&mut self) -> ControlFlow<()> {
        if !self.rescan && self.at.taken.elapsed() >= self.opts.retention / 2 {
            // Another gateway may have pruned rows this one never read.
            tracing::warn!(
                "the change queue was not read for half of database.queue_retention; every table is rescanned in case pruned changes were missed"
            );
            self.rescan = true;
        }
        // A connection of the gateway reached another server than the one
        // this feed reads (an address moved): follow the address again.
        if let Some(found) = self.opts.identity.take_mismatch()
            && found.change_from(&self.at.server).is_some()
        {
            self.elsewhere();
        }
        let began = Instant::now();
        match self.read().await {
            Ok(Polled::Stopped) => return ControlFlow::Break(()),
            Ok(Polled::Pruned) => {
                tracing::warn!(
                    "changes this gateway had not read were deleted (by a gateway with a shorter database.queue_retention, or after a long pause): every table is rescanned"
                );
                self.rescan = true;
                return ControlFlow::Continue(());
            }
            Ok(Polled::Elsewhere) => {
                self.elsewhere();
                return ControlFlow::Continue(());
            }
            Ok(Polled::At(snapshot, backend, tables)) => {
                self.advance(snapshot, backend, tables, began).await?
            }
            Err(e) => return self.interrupt(e).await,
        }
        if !self.pruning.running()
            && let Some(below) = self.pruner.due(&self.at.snapshot)
        {
            self.pruning = AbortOnDrop(Some(tokio::spawn(prune(self.pool.clone(), below))));
        }
        ControlFlow::Continue(())
    }

    /// The poll from the current position, or, when the position means
    /// nothing any more, a new one and a rescan of every table.
    async fn read(&mut self) -> Result<Polled, Failure> {
        if self.rescan {
            restart(&self.pool, &self.tx).await.map(|p| match p {
                Some(p) => {
                    self.opts.identity.follow(p.server);
                    self.at = p;
                    self.rescan = false;
                    Polled::At(self.at.snapshot.clone(), self.at.backend.clone(), None)
                }
                None => Polled::Stopped,
            })
        } else {
            poll(
                &self.pool,
                &self.at,
                &self.watch,
                &self.tx,
                &self.opts.counters,
                &self.ignored,
                &self.shapes,
            )
            .await
        }
    }

    /// The database is another server history (failover, restore): every
    /// table is rescanned, on a new pool, with the pruner started afresh.
    fn elsewhere(&mut self) {
        tracing::warn!(
            was = ?self.at.server,
            "the database is another server history (failover or restore): every table is rescanned"
        );
        // The pool's other connection may still be on the old
        // server (an address moved while it stayed up): start over
        // with connections that all reach the new one.
        self.pool = super::private_pool(&self.connect, APPLICATION_NAME);
        // Its notes and its running batch belong to the old history.
        self.pruner = Pruner::new(self.opts.retention);
        self.pruning = AbortOnDrop(None);
        self.rescan = true;
        // Its tables and triggers are checked before a heartbeat vouches.
        self.checked = Instant::now()
            .checked_sub(CHECK_EVERY)
            .unwrap_or_else(Instant::now);
    }

    /// A successful poll: the position moves to its snapshot, the watched
    /// tables are checked when due, and a heartbeat says every transaction
    /// committed before the poll began is delivered. `Break` when nobody
    /// receives events any more.
    async fn advance(
        &mut self,
        snapshot: String,
        backend: String,
        tables: Option<Vec<Option<String>>>,
        began: Instant,
    ) -> ControlFlow<()> {
        self.at.snapshot = snapshot;
        self.at.taken = self.at.taken.max(began);
        self.at.backend = backend;
        self.delay = self.opts.interval;
        self.interrupted = false;
        self.opts.health.streaming();
        let mut events = Vec::new();
        if self.checked.elapsed() >= CHECK_EVERY {
            let check = async {
                let mut conn = timed(self.pool.acquire()).await?;
                timed(check_triggers(
                    &mut conn,
                    &self.watch,
                    Sink::Queue,
                    self.opts.install,
                    &mut self.tracker,
                ))
                .await
            };
            match check.await {
                Ok(found) => {
                    events = found;
                    self.checked = Instant::now();
                }
                Err(e) => tracing::debug!(error = %e, "queue feed: the check failed"),
            }
        }
        // Read in the poll's statement: a rewrite before it is a resync
        // before the heartbeat it would otherwise let through.
        if let Some(tables) = tables {
            let rewritten = self.shapes.update(&self.watch, tables);
            if self.opts.install
                && !rewritten.is_empty()
                && let Ok(mut conn) = timed(self.pool.acquire()).await
            {
                super::tracker::replace_triggers(&mut conn, &self.watch, &rewritten, Sink::Queue)
                    .await;
            }
            events.extend(rewritten);
        }
        // The poll's snapshot was taken after `began`: every
        // transaction committed before it has been delivered.
        events.push(Event::Heartbeat(began));
        for e in events {
            if self.tx.send(e).await.is_err() {
                return ControlFlow::Break(());
            }
        }
        ControlFlow::Continue(())
    }

    /// A failed poll: counted and logged, retried after a back-off from
    /// the same snapshot, the gateway told once until a poll succeeds; a
    /// statement past its deadline leaves its pool behind. `Break` when
    /// nobody receives events any more.
    async fn interrupt(&mut self, e: Failure) -> ControlFlow<()> {
        self.delay = failed(
            &self.opts.counters,
            &self.failures,
            &e,
            self.delay,
            self.opts.interval,
        );
        self.opts.health.waiting(format!("change queue: {e}"));
        if !self.interrupted {
            self.interrupted = true;
            if self
                .tx
                .send(Event::Interrupted(e.to_string()))
                .await
                .is_err()
            {
                return ControlFlow::Break(());
            }
        }
        if matches!(e, Failure::Deadline) {
            self.pool = super::private_pool(&self.connect, APPLICATION_NAME);
        }
        ControlFlow::Continue(())
    }
}
