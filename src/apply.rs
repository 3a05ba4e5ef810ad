//! The gateway's applier: the one place where feed [`Event`]s (from any
//! source: `notify`, `wal`) change resources.
//!
//! Events are applied one at a time, in the order received. For each
//! [`RowChange`] every resource following that table gets the change, each
//! reading *its own* key column from the new and old values (two resources
//! on one table, `users` by `id` and `users_by_email` by `email`, both
//! stay fresh):
//!
//! | change | that resource's key | done |
//! |---|---|---|
//! | insert | new key `k` | `insert_key_from(k)`: into the filter, cache entries (negative too) dropped |
//! | delete | old key `k` | `note_delete(k)`: cache entry dropped, counted towards decay |
//! | update, key unchanged | `k` | `invalidate(k)` |
//! | update, key changed | old `o`, new `n` | `note_delete(o)`, `insert_key_from(n)` |
//! | any, key [`Value::Unknown`] | ? | `clear_cache()`; for a new row a gap ([`Reason::UnknownKey`], see below) |
//! | truncate | | `clear_cache()`, rebuild ([`Reason::Truncate`]) |
//!
//! A NULL key is no key: nothing to insert or invalidate (no request can
//! name it). A key that does not parse for the resource's key type cannot be
//! requested either. An update whose source carries no old row has not
//! changed any watched column (the feed's contract).
//!
//! # Provenance
//! A commit with an LSN comes from the WAL, which nobody can forge: its
//! inserts are [`Provenance::Trusted`] and may raise the high-water mark at
//! once. A commit without one is a `NOTIFY` payload anyone may send:
//! [`Provenance::Announced`].
//!
//! # Applied up to
//! Once every change of a commit with a position is applied, that position
//! (its LSN on its timeline) is published on a watch channel
//! ([`Applied`]): the `wal` source acknowledges to the server only what it
//! says, and read replicas may be used for a key once they have replayed
//! past it. A position on a newer timeline replaces the published one even
//! though its LSN is lower (see `db::position`): after a failover the feed
//! waits for the new timeline's commits to be applied, never for a number
//! the old timeline reached. A [`Phase::Visible`]
//! re-delivery only invalidates again (its filter inserts and deletes were
//! applied on receipt; see `feed`).
//!
//! # Vouching (see "The principle" in `feed`)
//! - [`Event::Heartbeat`]: the feed is current up to that moment. Every
//!   resource is *fresh* while the latest heartbeat is within
//!   `database.freshness_bound`; the applier checks that on a timer as well
//!   as on each heartbeat, so a feed that falls silent stops being trusted
//!   within the bound plus one tick, whatever else happens.
//! - [`Event::Interrupted`]: not fresh at once, until the next heartbeat.
//! - [`Event::Resync`] (every table, or one): the required LSN of the read
//!   replicas is raised to the primary's position (the missed commits'
//!   positions are not known), then every resource on the scope opens a
//!   gap, empties its caches and asks for a rebuild (coalesced, never
//!   forced: a forged event must not get past the shrink guard); see
//!   `Resource::resync`.
//! - [`Event::Coverage`]: the problem, if any, of every resource on that
//!   table.
//!
//! A rescan of one table (a notify `RESCAN`: a change too large to carry
//! its keys) and an insert whose key was not carried are gaps of that
//! resource too: its filter may lack a key that exists.
//!
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, watch};

use crate::db::replicas::Replicas;
use crate::feed::stats::Progress;
use crate::feed::{
    Columns, Commit, Coverage, Event, Op, Phase, Position, Resync, RowChange, Scope, TableName,
    Value,
};
use crate::key::Key;
use crate::rebuild::Reason;
use crate::resource::{Provenance, Resource};
use crate::shutdown::Shutdown;

/// Events applied together at most (see [`Applier::run`]).
const BATCH: usize = 1024;

/// Who publishes how far the applier got, and who reads it.
pub type Applied = watch::Receiver<Position>;

/// One resource following one table through one key column.
#[derive(Clone)]
pub struct Follower {
    /// The canonical name of the table whose changes it follows (its own
    /// table, or a view's `source_table`).
    pub table: TableName,
    /// Its key column in that table.
    pub column: Arc<str>,
    pub resource: Arc<Resource>,
}

pub struct Applier {
    followers: Vec<Follower>,
    applied: watch::Sender<Position>,
    /// Told the LSN of each change before it is applied (read-your-writes
    /// on replicas; see `db::replicas`).
    replicas: Option<Arc<Replicas>>,
    /// `database.freshness_bound`; `None`: no feed sends heartbeats (the
    /// feed is off), so freshness is not the feed's to prove.
    bound: Option<Duration>,
    fresh: Mutex<Freshness>,
    /// Where the latest event and heartbeat applied are published.
    progress: Arc<Progress>,
}

#[derive(Default)]
struct Freshness {
    /// The latest heartbeat's moment, `None` since an interruption.
    heard: Option<Instant>,
    /// What the resources were last told.
    told: Option<bool>,
}

impl Applier {
    pub fn new(followers: Vec<Follower>, applied: watch::Sender<Position>) -> Self {
        Self {
            followers,
            applied,
            replicas: None,
            bound: None,
            fresh: Mutex::default(),
            progress: Arc::default(),
        }
    }

    /// Publishes what it applies to `progress` (for metrics).
    pub fn with_progress(mut self, progress: Arc<Progress>) -> Self {
        self.progress = progress;
        self
    }

    pub fn with_replicas(mut self, replicas: Option<Arc<Replicas>>) -> Self {
        self.replicas = replicas;
        self
    }

    /// Expects heartbeats: a resource is fresh only while the latest is
    /// within `bound`.
    pub fn with_bound(mut self, bound: Duration) -> Self {
        self.bound = Some(bound);
        self
    }

    /// Applies events until every sender is gone or `shutdown` fires (the
    /// batch in hand is applied first), checking freshness meanwhile.
    pub async fn run(self, mut events: mpsc::Receiver<Event>, mut shutdown: Shutdown) {
        self.check_fresh();
        let every = self.bound.map_or(Duration::from_secs(1), |b| {
            (b / 8).max(Duration::from_millis(10))
        });
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut batch = Vec::new();
        loop {
            let event = tokio::select! {
                () = shutdown.fired() => return,
                e = events.recv() => match e {
                    Some(e) => e,
                    None => return,
                },
                _ = tick.tick() => {
                    self.check_fresh();
                    continue;
                }
            };
            // What is queued already is applied with it: with read replicas,
            // one read of the primary's position covers the whole batch.
            batch.push(event);
            while batch.len() < BATCH {
                match events.try_recv() {
                    Ok(e) => batch.push(e),
                    Err(_) => break,
                }
            }
            self.note_lsns(&batch).await;
            for event in batch.drain(..) {
                self.apply_noted(event).await;
            }
        }
    }

    /// Tells every resource whether the feed is fresh, when that changed.
    fn check_fresh(&self) {
        let mut f = self.fresh.lock().unwrap_or_else(|p| p.into_inner());
        let fresh = match self.bound {
            None => true,
            Some(bound) => f.heard.is_some_and(|at| at.elapsed() <= bound),
        };
        if f.told == Some(fresh) {
            return;
        }
        if f.told.is_some() {
            match fresh {
                true => tracing::info!("change feed current again: filters and caches answer"),
                false => tracing::warn!(
                    bound = ?self.bound,
                    "the change feed has not confirmed it is current within database.freshness_bound: answering from the database until it does"
                ),
            }
        }
        f.told = Some(fresh);
        for r in &self.followers {
            r.resource.vouch.set_fresh(fresh);
        }
    }

    /// Applies one event (its LSN noted for the replicas first).
    pub async fn apply(&self, event: Event) {
        let one = [event];
        self.note_lsns(&one).await;
        let [event] = one;
        self.apply_noted(event).await;
    }

    /// Before anything of `events` is applied, raises the replicas'
    /// required LSN past every commit in them (see `db::replicas`): a load
    /// that starts after an invalidation below must not read a replica
    /// behind that commit. A commit from the WAL carries its LSN; a
    /// notification does not, but its commit happened before it was sent,
    /// so the primary's position read now (after every event of the batch
    /// was received) is past all of them.
    async fn note_lsns(&self, events: &[Event]) {
        let Some(reps) = &self.replicas else {
            return;
        };
        let commits = events.iter().filter_map(|e| match e {
            Event::Commit(c) => Some(c),
            _ => None,
        });
        let mut unknown = false;
        for c in commits {
            match c.position {
                Some(p) => reps.note_change(p),
                None => unknown = true,
            }
        }
        if unknown {
            match reps.primary_lsn().await {
                Ok(lsn) => reps.note_change(lsn),
                Err(_) => reps.note_unknown_change(),
            }
        }
    }

    async fn apply_noted(&self, event: Event) {
        match event {
            Event::Commit(c) => {
                self.progress.event();
                self.commit(c).await
            }
            Event::Heartbeat(at) => {
                self.progress.heartbeat(at);
                {
                    let mut f = self.fresh.lock().unwrap_or_else(|p| p.into_inner());
                    f.heard = Some(f.heard.map_or(at, |h| h.max(at)));
                }
                self.check_fresh();
            }
            Event::Interrupted(_) => {
                self.fresh.lock().unwrap_or_else(|p| p.into_inner()).heard = None;
                self.check_fresh();
            }
            Event::Resync(r) => self.resync(r).await,
            Event::Coverage(Coverage { table, problem }) => {
                for follower in self.on(&table) {
                    follower.resource.vouch.set_problem(problem.clone());
                }
            }
        }
    }

    async fn resync(&self, r: Resync) {
        tracing::info!(reason = %r.reason, scope = ?r.scope, "change feed resync: caches emptied, filters rebuilt");
        // The missed commits' positions are not known: past all of them.
        if let Some(reps) = &self.replicas {
            match reps.primary_lsn().await {
                Ok(lsn) => reps.note_change(lsn),
                Err(_) => reps.note_unknown_change(),
            }
        }
        let reason = match &r.scope {
            Scope::All => Reason::Resync,
            Scope::Table(_) => Reason::Rescan,
        };
        for follower in self.followers.iter().filter(|x| r.scope.covers(&x.table)) {
            follower.resource.resync(&r.reason, reason);
        }
    }

    fn on<'a>(&'a self, table: &'a TableName) -> impl Iterator<Item = &'a Follower> + 'a {
        self.followers.iter().filter(move |r| r.table == *table)
    }

    async fn commit(&self, c: Commit) {
        let from = if c.position.is_some() {
            Provenance::Trusted
        } else {
            Provenance::Announced
        };
        for change in &c.changes {
            for follower in self.on(&change.table) {
                apply_change(follower, change, from, c.phase).await;
            }
        }
        for table in &c.truncated {
            for follower in self.on(table) {
                follower.resource.clear_cache();
                follower.resource.request_rebuild(Reason::Truncate, false);
            }
        }
        if let Some(p) = c.position {
            self.applied.send_if_modified(|at| at.advance(p));
        }
    }
}

/// What one version of a row says about a resource's key.
enum KeyInRow {
    Key(Key),
    /// NULL, or a value that cannot be a key of this type: no request can
    /// name it.
    None,
    /// The source did not carry it.
    Unknown,
}

fn key_in(follower: &Follower, row: Option<&Columns>) -> KeyInRow {
    match row.and_then(|r| r.get(&follower.column)) {
        Some(Value::Text(t)) => match follower.resource.key_from_db(t) {
            Some(k) => KeyInRow::Key(k),
            None => KeyInRow::None,
        },
        Some(Value::Null) => KeyInRow::None,
        Some(Value::Unknown) | None => KeyInRow::Unknown,
    }
}

async fn apply_change(follower: &Follower, change: &RowChange, from: Provenance, phase: Phase) {
    let r = &follower.resource;
    let new = match change.op {
        Op::Insert | Op::Update => key_in(follower, change.new.as_ref()),
        Op::Delete => KeyInRow::None,
    };
    if change.op == Op::Update && change.old.is_none() && matches!(new, KeyInRow::Unknown) {
        // The key did not change, but which one it is was not carried.
        r.clear_cache();
        return;
    }
    let old = match change.op {
        Op::Insert => KeyInRow::None,
        Op::Delete => key_in(follower, change.old.as_ref()),
        // No old row: no watched column changed.
        Op::Update if change.old.is_none() => match &new {
            KeyInRow::Key(k) => KeyInRow::Key(k.clone()),
            KeyInRow::None => KeyInRow::None,
            KeyInRow::Unknown => KeyInRow::Unknown,
        },
        Op::Update => key_in(follower, change.old.as_ref()),
    };
    if matches!(new, KeyInRow::Unknown) || matches!(old, KeyInRow::Unknown) {
        // Some cached row may be stale, and we cannot say which.
        r.clear_cache();
    }
    if phase == Phase::Visible {
        // Counts were done on receipt. The cache again; and a new key into
        // the filter again: a rebuild whose journal opened after the
        // receipt may have taken its snapshot before the commit was
        // visible, and missed it (see `resource`, "The filter is never
        // missing a key").
        if let (KeyInRow::Key(n), false) = (
            &new,
            matches!((&old, &new), (KeyInRow::Key(o), KeyInRow::Key(n)) if o == n),
        ) {
            r.insert_key_again(n);
        }
        for k in [&old, &new] {
            if let KeyInRow::Key(k) = k {
                r.invalidate(k).await;
            }
        }
        return;
    }
    match (&old, &new) {
        (KeyInRow::Key(o), KeyInRow::Key(n)) if o == n => r.invalidate(n).await,
        _ => {
            if let KeyInRow::Key(o) = &old {
                r.note_delete(o).await;
            }
            match &new {
                KeyInRow::Key(n) => r.insert_key_from(n, from).await,
                // A row whose key we were not told may be new: only a scan
                // finds it, and until then the filter may lack it.
                KeyInRow::Unknown => {
                    r.resync("an insert whose key was not carried", Reason::UnknownKey);
                }
                KeyInRow::None => {}
            }
        }
    }
}
