//! The gateway's applier: the one place where feed [`Event`]s (from any
//! source: `notify`, `queue`, `wal`, the bus) change resources.
//!
//! Events are applied one at a time, in the order received. For each
//! [`RowChange`] every resource following that table gets the change, each
//! reading *its own* key columns from the new and old values (two resources
//! on one table, `users` by `id` and `users_by_email` by `email`, both
//! stay fresh; a composite key is all its parts, and a change of one part
//! is the old key's delete and the new key's insert):
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
//! The row changes of the table are [`plan`], a pure function; its tests go through every
//! case and check what the promise rests on: a key in a new row always
//! ends up in the filter, and every key a change names leaves the cache.
//!
//! A NULL key (any part NULL) is no key: nothing to insert or invalidate
//! (no request can name it). A key that does not parse for the resource's
//! key types cannot be requested either. An update whose source carries no old row has not
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
//!   within the bound plus one tick, whatever else happens. The clock and
//!   its rules are `vouch::ProofClock`'s; the applier feeds it and tells
//!   every resource what it says.
//! - [`Event::Interrupted`]: not fresh at once, until the next heartbeat.
//! - [`Event::Resync`] (every table, or one): the required LSN of the read
//!   replicas is raised to the primary's position (the missed commits'
//!   positions are not known), then every resource on the scope opens a
//!   gap, empties its caches and asks for a rebuild (coalesced, never
//!   forced: a forged event must not get past the shrink guard); see
//!   `Resource::resync`.
//! - [`Event::Fork`]: a promotion the feed proved (`feed::wal::fork`):
//!   the read replicas' required LSN raised as for a resync, every cache
//!   emptied, and each filter kept where its build saw nothing the new
//!   timeline lost (`Resource::keep_across`), else that resource resyncs.
//! - [`Event::Coverage`]: the problem, if any, of every resource on that
//!   table.
//!
//! A rescan of one table (a notify `RESCAN`: a change too large to carry
//! its keys) and an insert whose key was not carried are gaps of that
//! resource too: its filter may lack a key that exists.
//!
use std::sync::Arc;
use std::time::Duration;

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
use crate::vouch::{Change, ProofClock};

/// Events applied together at most (see [`Applier::run`]).
const BATCH: usize = 1024;

/// Who publishes how far the applier got, and who reads it.
pub type Applied = watch::Receiver<Position>;

/// One resource following one table through its key columns.
#[derive(Clone)]
pub struct Follower {
    /// The canonical name of the table whose changes it follows (its own
    /// table, or a view's `source_table`).
    pub table: TableName,
    /// Its key columns in that table, in key order.
    pub columns: Box<[Arc<str>]>,
    pub resource: Arc<Resource>,
}

pub struct Applier {
    followers: Vec<Follower>,
    applied: watch::Sender<Position>,
    /// Told the LSN of each change before it is applied (read-your-writes
    /// on replicas; see `db::replicas`).
    replicas: Option<Arc<Replicas>>,
    /// `database.freshness_bound` and the latest proof (see `vouch`).
    fresh: ProofClock,
    /// Where the latest event and heartbeat applied are published.
    progress: Arc<Progress>,
}

impl Applier {
    pub fn new(followers: Vec<Follower>, applied: watch::Sender<Position>) -> Self {
        Self {
            followers,
            applied,
            replicas: None,
            fresh: ProofClock::new(None),
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
        self.fresh = ProofClock::new(Some(bound));
        self
    }

    /// Applies events until every sender is gone or `shutdown` fires (the
    /// batch in hand is applied first), checking freshness meanwhile.
    pub async fn run(self, mut events: mpsc::Receiver<Event>, mut shutdown: Shutdown) {
        self.check_fresh();
        let every = self.fresh.bound().map_or(Duration::from_secs(1), |b| {
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
        self.fresh.check(|Change { fresh, first }| {
            if !first {
                match fresh {
                    true => tracing::info!("change feed current again: filters and caches answer"),
                    false => tracing::warn!(
                        bound = ?self.fresh.bound(),
                        "the change feed has not confirmed it is current within database.freshness_bound: answering from the database until it does"
                    ),
                }
            }
            for r in &self.followers {
                r.resource.vouch.set_fresh(fresh);
            }
        });
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
            reps.note_past_the_primary().await;
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
                self.fresh.heard(at);
                if let Some(bound) = self.fresh.bound() {
                    // The request path's own check (see `vouch`): a gateway
                    // that was paused does not answer from a proof its
                    // timer has not yet found too old.
                    for r in &self.followers {
                        r.resource.vouch.proven_until(at + bound);
                    }
                }
                self.check_fresh();
            }
            Event::Interrupted(_) => {
                self.fresh.interrupted();
                self.check_fresh();
            }
            Event::Resync(r) => self.resync(r).await,
            Event::Fork(f) => self.fork(f).await,
            Event::Coverage(Coverage { table, problem }) => {
                for follower in self.on(&table) {
                    follower.resource.vouch.set_problem(problem.clone());
                }
            }
            Event::Barrier(done) => {
                let _ = done.send(());
            }
        }
    }

    /// Read replicas must reach the primary's position before they answer
    /// again: past every change missed or lost, whose positions are not
    /// known.
    async fn past_the_primary(&self) {
        if let Some(reps) = &self.replicas {
            reps.note_past_the_primary().await;
        }
    }

    /// A promotion the feed proved (see `feed::wal::fork`): every cache
    /// emptied; each filter kept if its build saw nothing the new timeline
    /// lost, else that resource resyncs.
    async fn fork(&self, f: crate::feed::Fork) {
        self.past_the_primary().await;
        let why = format!(
            "the primary was promoted (timeline {} forked from {} at {}) and the filter's build may have seen what the new timeline lost",
            f.to.id, f.from.id, f.at
        );
        for follower in &self.followers {
            if !follower.resource.keep_across(&f) {
                follower.resource.resync(&why, Reason::Resync);
            }
        }
    }

    async fn resync(&self, r: Resync) {
        tracing::info!(reason = %r.reason, scope = ?r.scope, "change feed resync: caches emptied, filters rebuilt");
        self.past_the_primary().await;
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
                let lsn = c.position.map(|p| p.lsn.0);
                apply_change(follower, change, from, c.phase, lsn).await;
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
#[derive(Clone, Debug, PartialEq)]
enum KeyInRow {
    Key(Key),
    /// NULL, or a value that cannot be a key of this type: no request can
    /// name it.
    None,
    /// The source did not carry it.
    Unknown,
}

/// The follower's key in `row`. A composite key is no key when any part
/// is NULL or cannot be one (no request can name it, whatever the other
/// parts hold), else unknown when any part is not carried.
fn key_in(follower: &Follower, row: Option<&Columns>) -> KeyInRow {
    let Some(row) = row else {
        return KeyInRow::Unknown;
    };
    let mut texts: Vec<&str> = Vec::with_capacity(follower.columns.len());
    let mut unknown = false;
    for column in &follower.columns {
        match row.get(column) {
            Some(Value::Text(t)) => texts.push(t),
            Some(Value::Null) => return KeyInRow::None,
            Some(Value::Unknown) | None => unknown = true,
        }
    }
    if unknown {
        // A part that is not a key of its type makes no key either.
        let parseable = follower
            .columns
            .iter()
            .zip(follower.resource.key_parts())
            .all(|(c, (_, ty))| match row.get(c) {
                Some(Value::Text(t)) => crate::key::from_db_text(t, *ty).is_some(),
                _ => true,
            });
        return if parseable {
            KeyInRow::Unknown
        } else {
            KeyInRow::None
        };
    }
    // A count of parts that is not the key's cannot be judged: unknown
    // (a resync), never "no key", which would skip the filter.
    if texts.len() != follower.resource.key_parts().len() {
        return KeyInRow::Unknown;
    }
    match follower.resource.key_from_db(&texts) {
        Some(k) => KeyInRow::Key(k),
        None => KeyInRow::None,
    }
}

/// One step of what a row change does to one resource, in order.
#[derive(Clone, Debug, PartialEq)]
enum Action {
    /// Every cached row and negative entry of the resource dropped.
    ClearCache,
    /// Into the filter, the key's cache entries (negative too) dropped.
    InsertKey(Key),
    /// Into the filter again on visibility, for a rebuild that may have
    /// missed it (see `resource`, "The filter is never missing a key").
    InsertAgain(Key),
    /// The key's cache entry dropped, counted towards decay.
    NoteDelete(Key),
    /// The key's cache entry dropped.
    Invalidate(Key),
    /// A gap: a row whose key was not carried may be new.
    Resync,
}

/// The module doc's table as a function: what a change does to one
/// resource, given its key in the new row and, when the source carried an
/// old row, in the old one (`None`: not carried, which for an update means
/// no watched column changed). Pure, so every case is tested below.
fn plan(op: Op, old: Option<KeyInRow>, new: KeyInRow, phase: Phase) -> Vec<Action> {
    use Action::*;
    let new = match op {
        Op::Insert | Op::Update => new,
        Op::Delete => KeyInRow::None,
    };
    let old = match (op, old) {
        (Op::Insert, _) => KeyInRow::None,
        // The key did not change, but which one it is was not carried.
        (Op::Update, None) if new == KeyInRow::Unknown => return vec![ClearCache],
        // No old row: no watched column changed.
        (Op::Update, None) => new.clone(),
        (_, Some(old)) => old,
        (Op::Delete, None) => KeyInRow::Unknown,
    };
    let mut out = Vec::new();
    if old == KeyInRow::Unknown || new == KeyInRow::Unknown {
        // Some cached row may be stale, and we cannot say which.
        out.push(ClearCache);
    }
    let unchanged = matches!((&old, &new), (KeyInRow::Key(o), KeyInRow::Key(n)) if o == n);
    if phase == Phase::Visible {
        // Counts were done on receipt. The cache again; and a new key into
        // the filter again: a rebuild whose journal opened after the
        // receipt may have taken its snapshot before the commit was
        // visible, and missed it.
        if let (KeyInRow::Key(n), false) = (&new, unchanged) {
            out.push(InsertAgain(n.clone()));
        }
        for k in [&old, &new] {
            if let KeyInRow::Key(k) = k {
                out.push(Invalidate(k.clone()));
            }
        }
        return out;
    }
    if unchanged {
        if let KeyInRow::Key(n) = new {
            out.push(Invalidate(n));
        }
        return out;
    }
    if let KeyInRow::Key(o) = old {
        out.push(NoteDelete(o));
    }
    match new {
        KeyInRow::Key(n) => out.push(InsertKey(n)),
        // A row whose key we were not told may be new: only a scan finds
        // it, and until then the filter may lack it.
        KeyInRow::Unknown => out.push(Resync),
        KeyInRow::None => {}
    }
    out
}

/// `lsn`: the commit's, if it has one (kept with a key the resource
/// inserts: see "Recent keys" in `resource::fleet`).
async fn apply_change(
    follower: &Follower,
    change: &RowChange,
    from: Provenance,
    phase: Phase,
    lsn: Option<u64>,
) {
    let r = &follower.resource;
    let new = match change.op {
        Op::Insert | Op::Update => key_in(follower, change.new.as_ref()),
        Op::Delete => KeyInRow::None,
    };
    let old = change.old.as_ref().map(|row| key_in(follower, Some(row)));
    for action in plan(change.op, old, new, phase) {
        match action {
            Action::ClearCache => r.clear_cache(),
            Action::InsertKey(k) => r.insert_key_at(&k, from, lsn).await,
            Action::InsertAgain(k) => r.insert_key_again(&k),
            Action::NoteDelete(k) => r.note_delete(&k).await,
            Action::Invalidate(k) => r.invalidate(&k).await,
            Action::Resync => {
                r.resync("an insert whose key was not carried", Reason::UnknownKey);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Action::*;

    fn k(v: i64) -> Key {
        Key::Int(v)
    }

    /// The module doc's table, row by row.
    #[test]
    fn the_change_table() {
        let rx = Phase::Received;
        let key = |v| KeyInRow::Key(k(v));
        assert_eq!(plan(Op::Insert, None, key(1), rx), [InsertKey(k(1))]);
        assert_eq!(
            plan(Op::Delete, Some(key(1)), KeyInRow::None, rx),
            [NoteDelete(k(1))]
        );
        assert_eq!(
            plan(Op::Update, Some(key(1)), key(1), rx),
            [Invalidate(k(1))]
        );
        // An update that left the key columns alone carries no old row.
        assert_eq!(plan(Op::Update, None, key(1), rx), [Invalidate(k(1))]);
        assert_eq!(
            plan(Op::Update, Some(key(1)), key(2), rx),
            [NoteDelete(k(1)), InsertKey(k(2))]
        );
        assert_eq!(
            plan(Op::Insert, None, KeyInRow::Unknown, rx),
            [ClearCache, Resync]
        );
        assert_eq!(plan(Op::Update, None, KeyInRow::Unknown, rx), [ClearCache]);
        assert_eq!(
            plan(Op::Delete, Some(KeyInRow::Unknown), KeyInRow::None, rx),
            [ClearCache]
        );
        // A NULL key is no key.
        assert_eq!(plan(Op::Insert, None, KeyInRow::None, rx), []);
        assert_eq!(
            plan(Op::Update, Some(key(1)), KeyInRow::None, rx),
            [NoteDelete(k(1))]
        );
        // Visible again: the cache again, a new key into the filter again,
        // no counting.
        let vis = Phase::Visible;
        assert_eq!(
            plan(Op::Update, Some(key(1)), key(2), vis),
            [InsertAgain(k(2)), Invalidate(k(1)), Invalidate(k(2))]
        );
        assert_eq!(
            plan(Op::Update, Some(key(1)), key(1), vis),
            [Invalidate(k(1)), Invalidate(k(1))]
        );
        assert_eq!(
            plan(Op::Delete, Some(key(1)), KeyInRow::None, vis),
            [Invalidate(k(1))]
        );
    }

    /// Over every change (each op, phase, and key in the old and new row:
    /// two keys, NULL, not carried), the guarantees the gateway's promise
    /// rests on:
    /// - never a missing key: a key in the new row ends up in the filter
    ///   (inserted, inserted again, or unchanged from a row already there);
    /// - never a stale row: every key named in the change has its cache
    ///   entry dropped, or the whole cache is;
    /// - a key not carried empties the cache; a new row whose key was not
    ///   carried is a gap (a resync) unless it is an update that changed no
    ///   key column.
    #[test]
    fn every_change_keeps_the_filter_whole_and_the_cache_fresh() {
        let versions = [
            KeyInRow::Key(k(1)),
            KeyInRow::Key(k(2)),
            KeyInRow::None,
            KeyInRow::Unknown,
        ];
        let olds = versions.iter().cloned().map(Some).chain([None]);
        for op in [Op::Insert, Op::Update, Op::Delete] {
            for phase in [Phase::Received, Phase::Visible] {
                for old in olds.clone() {
                    for new in versions.iter().cloned() {
                        let plan = plan(op, old.clone(), new.clone(), phase);
                        let case = format!("{op:?} {phase:?} old {old:?} new {new:?}: {plan:?}");
                        let cleared = plan.contains(&ClearCache);
                        let new = if op == Op::Delete {
                            KeyInRow::None
                        } else {
                            new
                        };
                        let old = match (op, old.clone()) {
                            (Op::Insert, _) => KeyInRow::None,
                            (Op::Update, None) => new.clone(),
                            (_, Some(o)) => o,
                            (Op::Delete, None) => KeyInRow::Unknown,
                        };
                        if let KeyInRow::Key(n) = &new {
                            let in_filter = plan
                                .iter()
                                .any(|a| matches!(a, InsertKey(x) | InsertAgain(x) if x == n))
                                || old == new;
                            assert!(in_filter, "a missing key: {case}");
                        }
                        for v in [&old, &new] {
                            if let KeyInRow::Key(x) = v {
                                let dropped = cleared
                                    || plan.iter().any(|a| {
                                        matches!(a, InsertKey(y) | NoteDelete(y) | Invalidate(y) if y == x)
                                    });
                                assert!(dropped, "a stale row: {case}");
                            }
                        }
                        if old == KeyInRow::Unknown || new == KeyInRow::Unknown {
                            assert!(cleared, "{case}");
                        }
                        if new == KeyInRow::Unknown
                            && old != KeyInRow::Unknown
                            && phase == Phase::Received
                        {
                            assert!(plan.contains(&Resync), "a gap not opened: {case}");
                        }
                    }
                }
            }
        }
    }
}
