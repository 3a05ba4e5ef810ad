//! Change feeds: where the gateway learns that rows changed.
//!
//! A feed turns whatever its source delivers into [`Event`]s and sends them
//! down a channel; it knows nothing of the gateway, which applies them (data
//! flows one way: Postgres → feed → gateway). The feeds:
//!
//! - [`notify`]: `LISTEN bloomgate`, fed by the triggers `install-triggers`
//!   writes (one small function per table, the key columns written in);
//! - [`queue`]: the same triggers writing rows of a change table instead,
//!   polled by snapshot (no lock at commit, nothing lost while away);
//! - [`wal`]: logical replication (`wal::pgoutput`) from a slot, streamed
//!   over the replication protocol (`wal::replication`, which takes a
//!   password from the URL, `PGPASSWORD` or the password file, `pgpass`)
//!   or polled; it
//!   cannot be forged and puts nothing in the writers' transactions;
//! - [`bus`]: the WAL decoded once for a fleet, through a Redis stream.
//!
//! Beside them, what they share: [`tracker`] (what a feed depends on besides
//! its stream, and the tables' shapes), [`probes`] (readings of the primary
//! and what they prove), [`supervisor`] (which feed, and its start),
//! [`stats`].
//!
//! All deliver the same thing: for each committed transaction, in commit
//! order, the changed rows reduced to the values of the *watched* columns
//! (the key columns of every resource on that table), as canonical text.
//! (`queue` knows commit order only between polls: the transactions that
//! committed within one poll interval come in transaction-id order, which
//! the applier does not mind; see `queue`.)
//!
//! # Canonical key text
//! The key a feed announces, the key the filter scan reads and the key a
//! request parses must be the same text for every supported column type, or
//! a live insert adds a key no request matches. The canonical form is the
//! column's value cast to `text` (`col::text`), which is what the scan reads:
//! for `char(n)` that strips the trailing blanks its output function keeps;
//! for every other supported type it is the output function's text.
//! [`canonical_text`] (in `db::catalog`, with the types) maps a source's raw
//! text to it.
//!
//! # The principle: vouch only for what can be shown complete
//! The gateway answers from a resource's filter and cache only while it can
//! show that they reflect every change committed up to a recent point; an
//! event it cannot interpret exactly takes away, at once, what that event
//! may cover. Every feed therefore says more than "this committed":
//!
//! - [`Event::Heartbeat`] `at` t: every change committed before t has been
//!   sent before this event. A feed sends one at least every
//!   [`HEARTBEAT_EVERY`], and only after checking what it depends on (see
//!   below). Past `database.freshness_bound` without one, the gateway stops
//!   vouching for every resource: a silent feed (a hung connection, a cut
//!   network, a walsender far behind) is never trusted for longer than that.
//! - [`Event::Interrupted`]: the stream stopped (an error, a lost
//!   connection). The gateway stops vouching at once, without waiting for
//!   the bound; a heartbeat after the stream resumes restores it.
//! - [`Event::Resync`]: changes to its scope (every table, or one) may have
//!   been missed: a new temporary slot, a permanent slot someone else
//!   advanced or dropped, a notify reconnect, a table recreated or back in
//!   the publication, a partition attached or detached, a change whose keys
//!   were not carried. The gateway drops every cached row and negative
//!   entry of the scope, stops vouching for its filters (a key they reject
//!   may exist), and rebuilds them; the gap closes when a rebuild that
//!   started after the event has swapped its filter in (its scan and the
//!   stream, live since before it, meet). A feed sends it only once the new
//!   stream is in place, so that rebuild's snapshot is covered.
//! - [`Event::Fork`]: the WAL feed went on along a promoted standby's
//!   timeline from a slot that survived the promotion, and proved which
//!   of the changes it applied the new timeline kept (`wal::fork`). Every
//!   cached row and negative entry is dropped (a row read from the old
//!   primary may be one the new timeline lost); each filter is kept where
//!   its own build saw nothing the new timeline lost, else it is a
//!   [`Event::Resync`] for that resource.
//! - [`Event::Coverage`]: whether the feed can follow a table at all (the
//!   publication lacks it, publishes only some operations, filters its rows;
//!   its trigger is missing). A table it cannot follow is not vouched for
//!   until the feed says it can again, which comes with a [`Event::Resync`]
//!   of that table (what changed meanwhile was missed).
//!
//! What a feed depends on is checked while it runs, not only at start-up:
//! each watched table's identity (its OID: a table dropped and created
//! again, or swapped in by a rename, is another table), its shape (its
//! storage and its served columns' types and places, read with every
//! proof: a rewrite is a change of every row, see "Shapes" in [`tracker`]),
//! its partitions, and
//! for the WAL feed the publication (tables, `publish` flags, row filters,
//! column lists, `publish_via_partition_root`) and each `Relation`
//! message's replica identity; for the trigger feeds the triggers. See
//! [`tracker`]. A check that finds the dependency changed repairs it where the
//! configuration allows (`install_feed`, `install_triggers`) and rescans the
//! tables involved; otherwise their resources report not ready, naming the
//! fix. The check runs every [`CHECK_EVERY`]: that is the longest a change
//! to one of these can go unnoticed, within the bound above.
//!
//! Not vouched, a resource still answers correctly, from the database: a
//! key its filter rejects is looked up (within `filter.verify_budget` a
//! second, else 503 with `Retry-After`), a row is loaded without the cache.

pub mod bus;
pub mod notify;
pub mod probes;
pub mod queue;
pub mod stats;
pub mod supervisor;
pub mod tracker;
pub mod wal;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

pub use crate::db::catalog::{
    ColumnType, TableName, Watch, WatchedColumn, WatchedTable, canonical_text,
};
pub use crate::db::lsn::Lsn;
pub use crate::db::position::{Fork, Position, Server, Timeline};

/// Why the change feed could not be prepared.
#[derive(Debug, thiserror::Error)]
pub enum PrepareError {
    /// What the configuration or the database's answer rules out (a
    /// publication `"wal"` cannot use, a standby, a bus without the WAL
    /// feed): start-up stops and says why.
    #[error("{0}")]
    Refused(String),
    /// The feed started but will never stream: what its [`supervisor::Ready`]
    /// said.
    #[error(transparent)]
    NotStarted(#[from] NotStarted),
    /// A statement that failed: an answer, or a failure of the moment
    /// ([`PrepareError::is_momentary`]) that start-up tries again.
    #[error("{what}: {source}")]
    Db {
        what: &'static str,
        #[source]
        source: sqlx::Error,
    },
}

impl PrepareError {
    /// Whether trying again may succeed: the database out of reach, or a
    /// statement it gave up on while it answered (`db::outage::is_momentary`:
    /// a publication's install held behind a lock or a hung network until
    /// `statement_timeout`), never a refusal.
    pub fn is_momentary(&self) -> bool {
        match self {
            PrepareError::Refused(_) | PrepareError::NotStarted(_) => false,
            PrepareError::Db { source, .. } => crate::db::outage::is_momentary(source),
        }
    }
}

/// Why a feed that was started never streams: the error its
/// [`supervisor::Ready`] carries. Each feed retries what may pass (the
/// database out of reach) before it says so; this is what will not.
#[derive(Debug, thiserror::Error)]
pub enum NotStarted {
    #[error(transparent)]
    Notify(#[from] notify::NotifyError),
    #[error(transparent)]
    Queue(#[from] queue::QueueError),
    /// Its task ended before it said anything (a panic, or the gateway
    /// stopping meanwhile).
    #[error("the change feed stopped before it was streaming")]
    Stopped,
}

/// A watched column's value in one version of a row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Value {
    Null,
    /// Canonical text (see the module doc).
    Text(String),
    /// The source did not carry it: an unchanged TOASTed value, or a column
    /// outside the replica identity in an old row. The consumer must assume
    /// anything (for a key: clear that resource's cache).
    Unknown,
}

/// The watched columns of one version of a row, by name.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Columns(pub Vec<(Arc<str>, Value)>);

impl Columns {
    /// The value of `column`, or `None` if the source did not mention it.
    pub fn get(&self, column: &str) -> Option<&Value> {
        self.0
            .iter()
            .find(|(name, _)| &**name == column)
            .map(|(_, v)| v)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Insert,
    Update,
    Delete,
}

/// One changed row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RowChange {
    pub table: TableName,
    pub op: Op,
    /// The new row (INSERT, UPDATE).
    pub new: Option<Columns>,
    /// The old row (UPDATE, DELETE) as far as the source carries it. For an
    /// UPDATE without it, the watched columns did not change (the source
    /// guarantees that, or reports them [`Value::Unknown`]).
    pub old: Option<Columns>,
}

/// Which application of a transaction this is; see `wal` for why a
/// transaction can be delivered before it is visible to new snapshots, and
/// so is applied twice. Applying is idempotent, so the second application
/// costs little and closes that window.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// As soon as the commit arrived.
    Received,
    /// Again, once a snapshot on the primary shows the transaction as
    /// committed (only the `wal` source; `notify` delivers visible
    /// transactions only).
    Visible,
}

/// One committed transaction's changes, in their order within it.
#[derive(Clone, Debug)]
pub struct Commit {
    /// Transaction id (32-bit, as pgoutput sends it); `None` from `notify`.
    pub xid: Option<u32>,
    /// End of the commit record, on the primary's timeline: once a standby
    /// has replayed this far on that timeline, the transaction is visible
    /// there. `None` from `notify` and `queue`.
    pub position: Option<Position>,
    /// When the transaction committed, if the source says.
    pub committed_at: Option<SystemTime>,
    pub phase: Phase,
    pub changes: Vec<RowChange>,
    /// Watched tables this transaction truncated.
    pub truncated: Vec<TableName>,
}

/// Now, in Unix milliseconds (0 before the epoch).
pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis() as u64
}

/// How often a feed proves it is current ([`Event::Heartbeat`]).
pub const HEARTBEAT_EVERY: Duration = Duration::from_millis(100);

/// How often a feed checks what it depends on (see "The principle").
pub const CHECK_EVERY: Duration = Duration::from_secs(1);

/// What a feed sends.
#[derive(Debug)]
pub enum Event {
    Commit(Commit),
    /// Every change committed before `at` was sent before this.
    Heartbeat(Instant),
    /// The stream stopped; why (for logs).
    Interrupted(String),
    /// Changes to the scope may have been missed; the stream is live again.
    Resync(Resync),
    /// A promotion the feed proved the filters survive (see `wal::fork`):
    /// caches are emptied, filters kept where their own proof holds.
    Fork(Fork),
    /// Whether the feed can follow a table.
    Coverage(Coverage),
    /// Answered once every event queued before it is applied (a
    /// snapshot's publisher waits so: see "What a snapshot is complete at"
    /// in `snapshot`). Sent by no feed.
    Barrier(tokio::sync::oneshot::Sender<()>),
}

#[derive(Debug)]
pub struct Resync {
    /// For logs and metrics.
    pub reason: String,
    pub scope: Scope,
    /// Where the stream after it starts, when a new session's stream
    /// starts past what was delivered (a slot confirmed past it, created
    /// anew, a new server): the rebuild stands for every commit up to it,
    /// the stream brings every one after. On the bus the entry is placed
    /// there, not after the entry before it (see "Lineage" in
    /// `bus::redis`): a place compared by number with the resync's (a
    /// snapshot's, labelled on another history of the stream) is past it
    /// only if it is past what the resync stands for. `None`: the stream
    /// goes on from the entry before.
    pub upto: Option<Position>,
}

impl Resync {
    pub fn all(reason: impl Into<String>) -> Event {
        Event::Resync(Resync {
            reason: reason.into(),
            scope: Scope::All,
            upto: None,
        })
    }

    /// [`Resync::all`] for a stream that starts at `upto`.
    pub fn all_upto(reason: impl Into<String>, upto: Position) -> Event {
        Event::Resync(Resync {
            reason: reason.into(),
            scope: Scope::All,
            upto: Some(upto),
        })
    }

    pub fn table(table: TableName, reason: impl Into<String>) -> Event {
        Event::Resync(Resync {
            reason: reason.into(),
            scope: Scope::Table(table),
            upto: None,
        })
    }
}

/// Which tables an event concerns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Scope {
    All,
    Table(TableName),
}

impl Scope {
    pub fn covers(&self, table: &TableName) -> bool {
        match self {
            Scope::All => true,
            Scope::Table(t) => t == table,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Coverage {
    pub table: TableName,
    /// `None`: followed. `Some(why)`: not followed; `why` names the fix
    /// (safe to show: no SQL text of the application, no secret).
    pub problem: Option<String>,
}

/// What a feed says of its connection, for readiness, logs and the status
/// page. Correctness rests on the events, never on this.
#[derive(Debug, Default)]
pub struct Health(Mutex<HealthState>);

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum FeedState {
    /// Not streaming yet.
    #[default]
    Starting,
    /// The stream is in place.
    Streaming,
    /// Cannot stream, retrying: the detail says why.
    Waiting,
}

#[derive(Clone, Debug, Default)]
pub struct HealthState {
    pub state: FeedState,
    /// Why it waits, or the last error; safe to show.
    pub detail: Option<String>,
    /// Sessions that ended and were opened again.
    pub reconnects: u64,
    /// Times the feed could not stream (a failed connection attempt, a
    /// stream that broke), counted as they happen.
    pub failures: u64,
}

impl Health {
    pub fn get(&self) -> HealthState {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub fn streaming(&self) {
        let mut h = self.0.lock().unwrap_or_else(|p| p.into_inner());
        h.state = FeedState::Streaming;
        h.detail = None;
    }

    pub fn waiting(&self, why: impl Into<String>) {
        let mut h = self.0.lock().unwrap_or_else(|p| p.into_inner());
        h.state = FeedState::Waiting;
        h.detail = Some(why.into());
        h.failures += 1;
    }

    /// Streaming, but unable to deliver what it received (transactions
    /// held invisible): not up, not a failure; `why` says what it waits
    /// for. [`Health::streaming`] ends it.
    pub fn held(&self, why: impl Into<String>) {
        let mut h = self.0.lock().unwrap_or_else(|p| p.into_inner());
        h.state = FeedState::Waiting;
        h.detail = Some(why.into());
    }

    pub fn reconnected(&self) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).reconnects += 1;
    }
}

/// A trigger feed's own pool (`notify`, `queue`): two connections, named
/// `application_name` on the server. Its own, so the feed neither waits for
/// the request path's connections nor takes them: one listens or polls,
/// the other checks the watched tables or prunes.
pub(crate) fn private_pool(
    connect: &sqlx::postgres::PgConnectOptions,
    application_name: &str,
) -> sqlx::PgPool {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(5))
        .connect_lazy_with(connect.clone().application_name(application_name))
}
