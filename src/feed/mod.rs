//! Change feeds: where the gateway learns that rows changed.
//!
//! A feed turns whatever its source delivers into [`Event`]s and sends them
//! down a channel; it knows nothing of the gateway, which applies them (data
//! flows one way: Postgres → feed → gateway). Three sources, one file each:
//!
//! - `notify`: `LISTEN bloomgate`, fed by the triggers `install-triggers`
//!   writes (one small function per table, the key columns written in);
//! - `queue`: the same triggers writing rows of a change table instead,
//!   polled by snapshot (no lock at commit, nothing lost while away);
//! - `wal`: logical replication (`pgoutput`) from a slot, streamed over the
//!   replication protocol (`replication`, which takes a password from the
//!   URL, `PGPASSWORD` or the password file, `pgpass`) or polled; it cannot
//!   be forged and puts nothing in the writers' transactions.
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

pub mod notify;
pub mod pgoutput;
pub mod pgpass;
pub mod queue;
pub mod replication;
pub mod wal;

use std::fmt;
use std::sync::Arc;
use std::time::SystemTime;

use tokio::sync::oneshot;

/// A position in the write-ahead log.
#[derive(Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Lsn(pub u64);

impl Lsn {
    pub const ZERO: Lsn = Lsn(0);

    /// Parses Postgres' `X/Y` form (both halves hexadecimal).
    pub fn parse(text: &str) -> Option<Lsn> {
        let (hi, lo) = text.split_once('/')?;
        let hi = u32::from_str_radix(hi, 16).ok()?;
        let lo = u32::from_str_radix(lo, 16).ok()?;
        Some(Lsn((u64::from(hi) << 32) | u64::from(lo)))
    }
}

impl fmt::Display for Lsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:X}/{:X}", self.0 >> 32, self.0 & 0xffff_ffff)
    }
}

impl fmt::Debug for Lsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

pub use crate::db::catalog::{ColumnType, TableName, canonical_text};

/// What a feed should watch: every resource table and its key columns.
#[derive(Clone, Debug, Default)]
pub struct Watch {
    pub tables: Vec<WatchedTable>,
}

#[derive(Clone, Debug)]
pub struct WatchedTable {
    pub name: TableName,
    /// The key column of every resource on this table (distinct).
    pub columns: Vec<WatchedColumn>,
}

#[derive(Clone, Debug)]
pub struct WatchedColumn {
    pub name: Arc<str>,
    pub ty: ColumnType,
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
    /// End of the commit record: once a standby has replayed this far, the
    /// transaction is visible there. `None` from `notify`.
    pub lsn: Option<Lsn>,
    /// When the transaction committed, if the source says.
    pub committed_at: Option<SystemTime>,
    pub phase: Phase,
    pub changes: Vec<RowChange>,
    /// Watched tables this transaction truncated.
    pub truncated: Vec<TableName>,
}

/// What a feed sends.
#[derive(Debug)]
pub enum Event {
    Commit(Commit),
    /// Changes may have been missed (a reconnect with no way to resume, a
    /// slot that had to be recreated, a notification too long to carry):
    /// every filter must be rebuilt, from a snapshot in which nothing the
    /// feed will not deliver is missing.
    Resync(Resync),
    /// Only `table` needs a rebuild (a `notify` RESCAN).
    Rescan(TableName),
}

#[derive(Debug)]
pub struct Resync {
    /// For logs and metrics.
    pub reason: String,
    /// A snapshot exported by a new replication slot: scanning in it, the
    /// scan and the stream meet exactly (every commit is in exactly one of
    /// the two). The feed holds the stream until `imported` fires (or is
    /// dropped, meaning: rebuild without it; the feed then delivers from the
    /// slot's start anyway). `None`: scan in any snapshot taken from now on.
    pub snapshot: Option<SnapshotHandoff>,
}

#[derive(Debug)]
pub struct SnapshotHandoff {
    /// The name for `SET TRANSACTION SNAPSHOT`.
    pub id: String,
    /// Send once every scan transaction has imported the snapshot.
    pub imported: oneshot::Sender<()>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lsn_round_trips_postgres_text() {
        for text in ["0/0", "0/16B3748", "1/0", "FFFFFFFF/FFFFFFFF", "A/B"] {
            let lsn = Lsn::parse(text).unwrap();
            assert_eq!(lsn.to_string(), text);
        }
        assert_eq!(Lsn::parse("1/2").unwrap(), Lsn((1 << 32) | 2));
        assert!(Lsn::parse("1/2") > Lsn::parse("0/FFFFFFFF"));
        for bad in ["", "1", "1/", "/1", "x/1", "1/2/3", "100000000/0"] {
            assert_eq!(Lsn::parse(bad), None, "{bad:?}");
        }
    }
}
