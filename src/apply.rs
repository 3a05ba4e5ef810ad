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
//! | any, key [`Value::Unknown`] | ? | `clear_cache()`; for a new row also a rebuild ([`Reason::UnknownKey`]) |
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
//! Once every change of a commit with an LSN is applied, that LSN is
//! published on a watch channel ([`Applied`]): the `wal` source
//! acknowledges to the server only what it says, and read replicas may be
//! used for a key once they have replayed past it. A [`Phase::Visible`]
//! re-delivery only invalidates again (its filter inserts and deletes were
//! applied on receipt; see `feed`).
//!
//! # Resync and rescan
//! [`Event::Resync`]: every filter is rebuilt (coalesced per resource, never
//! forced: a forged event must not get past the shrink guard). A snapshot
//! offered with it is declined (dropped), so the feed delivers from its
//! start: correct, and a rebuild from any later snapshot covers the rest.
//! [`Event::Rescan`] (a change too large to announce: its keys are not
//! known): the caches of that table's resources are cleared and their
//! filters rebuilt.

use std::sync::Arc;

use tokio::sync::{mpsc, watch};

use crate::db::replicas::Replicas;
use crate::feed::{Columns, Commit, Event, Lsn, Op, Phase, RowChange, TableName, Value};
use crate::key::{self, Key};
use crate::rebuild::Reason;
use crate::resource::{Provenance, Resource};

/// Who publishes how far the applier got, and who reads it.
pub type Applied = watch::Receiver<Lsn>;

/// One resource following one table through one key column.
#[derive(Clone)]
pub struct Route {
    /// The canonical name of the table whose changes it follows (its own
    /// table, or a view's `source_table`).
    pub table: TableName,
    /// Its key column in that table.
    pub column: Arc<str>,
    pub resource: Arc<Resource>,
}

pub struct Applier {
    routes: Vec<Route>,
    applied: watch::Sender<Lsn>,
    /// Told the LSN of each change before it is applied (read-your-writes
    /// on replicas; see `db::replicas`).
    replicas: Option<Arc<Replicas>>,
}

impl Applier {
    pub fn new(routes: Vec<Route>, applied: watch::Sender<Lsn>) -> Self {
        Self {
            routes,
            applied,
            replicas: None,
        }
    }

    pub fn with_replicas(mut self, replicas: Option<Arc<Replicas>>) -> Self {
        self.replicas = replicas;
        self
    }

    /// Applies events until every sender is gone (or the task is aborted).
    pub async fn run(self, mut events: mpsc::Receiver<Event>) {
        while let Some(event) = events.recv().await {
            self.apply(event).await;
        }
    }

    pub async fn apply(&self, event: Event) {
        match event {
            Event::Commit(c) => self.commit(c).await,
            Event::Resync(r) => {
                // Declined: see the module doc.
                drop(r.snapshot);
                tracing::info!(reason = %r.reason, "change feed resync: rebuilding every filter");
                for route in &self.routes {
                    route.resource.request_rebuild(Reason::Resync, false);
                }
            }
            Event::Rescan(table) => {
                // A change whose keys were not carried: a new key only a
                // scan finds, a cached row we cannot name.
                for route in self.on(&table) {
                    route.resource.clear_cache();
                    route.resource.request_rebuild(Reason::Rescan, false);
                }
            }
        }
    }

    fn on<'a>(&'a self, table: &'a TableName) -> impl Iterator<Item = &'a Route> + 'a {
        self.routes.iter().filter(move |r| r.table == *table)
    }

    async fn commit(&self, c: Commit) {
        if let Some(reps) = &self.replicas {
            // Before anything is applied: a load that starts after an
            // invalidation below must not read a replica behind this commit.
            match c.lsn {
                Some(lsn) => reps.note_change(lsn.0),
                // A notification: the commit happened before it was sent,
                // so the primary's position now is past it.
                None => match reps.primary_lsn().await {
                    Ok(lsn) => reps.note_change(lsn),
                    Err(_) => reps.note_unknown_change(),
                },
            }
        }
        let from = if c.lsn.is_some() {
            Provenance::Trusted
        } else {
            Provenance::Announced
        };
        for change in &c.changes {
            for route in self.on(&change.table) {
                apply_change(route, change, from, c.phase).await;
            }
        }
        for table in &c.truncated {
            for route in self.on(table) {
                route.resource.clear_cache();
                route.resource.request_rebuild(Reason::Truncate, false);
            }
        }
        if let Some(lsn) = c.lsn {
            self.applied.send_if_modified(|at| {
                let newer = lsn > *at;
                if newer {
                    *at = lsn;
                }
                newer
            });
        }
    }
}

/// What one version of a row says about a resource's key.
enum Seen {
    Key(Key),
    /// NULL, or a value that cannot be a key of this type: no request can
    /// name it.
    None,
    /// The source did not carry it.
    Unknown,
}

fn seen(route: &Route, row: Option<&Columns>) -> Seen {
    match row.and_then(|r| r.get(&route.column)) {
        Some(Value::Text(t)) => match key::from_db_text(t, route.resource.key_type()) {
            Some(k) => Seen::Key(k),
            None => Seen::None,
        },
        Some(Value::Null) => Seen::None,
        Some(Value::Unknown) | None => Seen::Unknown,
    }
}

async fn apply_change(route: &Route, change: &RowChange, from: Provenance, phase: Phase) {
    let r = &route.resource;
    let new = match change.op {
        Op::Insert | Op::Update => seen(route, change.new.as_ref()),
        Op::Delete => Seen::None,
    };
    if change.op == Op::Update && change.old.is_none() && matches!(new, Seen::Unknown) {
        // The key did not change, but which one it is was not carried.
        r.clear_cache();
        return;
    }
    let old = match change.op {
        Op::Insert => Seen::None,
        Op::Delete => seen(route, change.old.as_ref()),
        // No old row: no watched column changed.
        Op::Update if change.old.is_none() => match &new {
            Seen::Key(k) => Seen::Key(k.clone()),
            Seen::None => Seen::None,
            Seen::Unknown => Seen::Unknown,
        },
        Op::Update => seen(route, change.old.as_ref()),
    };
    if matches!(new, Seen::Unknown) || matches!(old, Seen::Unknown) {
        // Some cached row may be stale, and we cannot say which.
        r.clear_cache();
    }
    if phase == Phase::Visible {
        // Filter and counts were done on receipt: only the cache again.
        for k in [&old, &new] {
            if let Seen::Key(k) = k {
                r.invalidate(k).await;
            }
        }
        return;
    }
    match (&old, &new) {
        (Seen::Key(o), Seen::Key(n)) if o == n => r.invalidate(n).await,
        _ => {
            if let Seen::Key(o) = &old {
                r.note_delete(o).await;
            }
            match &new {
                Seen::Key(n) => r.insert_key_from(n, from).await,
                // A row whose key we were not told may be new: only a scan
                // finds it.
                Seen::Unknown => {
                    r.request_rebuild(Reason::UnknownKey, false);
                }
                Seen::None => {}
            }
        }
    }
}
