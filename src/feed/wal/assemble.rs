//! Turning decoded pgoutput messages into the commits of watched changes,
//! whole: the part of the WAL feed that knows nothing of connections.
//!
//! The server sends a transaction either whole at its commit (Begin …
//! Commit), in commit order, or, with protocol 2's streaming, a large one in
//! blocks while it runs (Stream Start … Stop, any number, interleaved with
//! whole transactions) and then Stream Commit or Stream Abort. Nothing is
//! delivered before its commit, so an aborted transaction, or an aborted
//! subtransaction of a streamed one, has no effect.
//!
//! # Guarantees (tested below)
//! - Every watched change of a committed transaction is either in its
//!   [`Assembled::commit`] or covered by a rescan ([`Assembled::rescan`],
//!   [`Assembled::resync`]) requested once the commit is visible.
//! - Memory per transaction is bounded by `max_changes` changes and about
//!   `max_bytes` (each change counted as its key text plus a fixed
//!   overhead, when it arrives).
//! - A watched column the old row does not carry (outside the replica
//!   identity, or an UPDATE that sent no old row) is [`Value::Unknown`],
//!   never a guess; an unchanged TOASTed value in the new row is the old
//!   row's when the old row carries it (see "Replica identity" in
//!   [`super`]).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::Stats;
use crate::db::catalog::canonical_text;
use crate::feed::wal::pgoutput::{self, Datum, Message};
use crate::feed::{
    Columns, Commit, Lsn, Op, Phase, Position, RowChange, TableName, Timeline, Value, Watch,
};

/// A watched table as the feed knows it: its key columns' positions are
/// resolved when its `Relation` message arrives.
struct TrackedRelation {
    table: TableName,
    /// (column name, type, index in the tuple, in the replica identity)
    columns: Vec<(Arc<str>, crate::feed::ColumnType, usize, bool)>,
    /// The key and served columns as the message describes them: name,
    /// place, type and modifier. Another description of the same relation
    /// later in the session is a rewrite's sign (see "Shapes" in
    /// `feed::tracker`): the table is rescanned after that transaction.
    shape: Vec<(String, usize, u32, i32)>,
}

/// Commits delivered at `Received` and not yet at `Visible`, and what
/// they could not carry.
#[derive(Default)]
pub(super) struct Pending {
    /// Copies for the `Visible` delivery.
    pub(super) commits: Vec<Commit>,
    /// The last one's end: confirmed once they are visible and applied.
    pub(super) last: Option<Lsn>,
    /// A change could not be decoded: every filter is rebuilt.
    pub(super) resync: bool,
    /// Tables whose changes were too many to hold.
    pub(super) rescan: Vec<TableName>,
}

impl Pending {
    /// Takes a completed transaction; returns its `Received` delivery.
    pub(super) fn add(&mut self, done: Assembled) -> Commit {
        self.resync |= done.resync;
        for t in done.rescan {
            if !self.rescan.contains(&t) {
                self.rescan.push(t);
            }
        }
        self.last = self.last.max(done.commit.position.map(|p| p.lsn));
        self.commits.push(done.commit.clone());
        done.commit
    }
}

/// Changes one transaction may hold in memory until its commit, and the
/// bytes they may take (keys can be long text); past either its changes
/// are dropped and the tables it touched rescanned after it commits (a
/// rebuild sees every row it wrote).
const MAX_CHANGES: usize = 1_000_000;
const MAX_BYTES: usize = 256 << 20;

/// Turns decoded pgoutput messages into commits of watched changes (see the
/// module doc).
pub(super) struct Assembler<'a> {
    watch: &'a Watch,
    stats: &'a Stats,
    rels: HashMap<u32, Option<TrackedRelation>>,
    /// The whole transaction being received.
    current: Option<(u32, Txn)>,
    /// Streamed transactions not yet committed or aborted.
    streams: HashMap<u32, Txn>,
    /// Inside a Stream Start … Stop block: the transaction's xid.
    block: Option<u32>,
    /// A message that could not be decoded arrived outside any
    /// transaction: every filter is rebuilt at the end of the batch.
    stray_error: bool,
    /// Tables logged for a replica identity that misses a watched column.
    identity_warned: HashSet<TableName>,
    max_changes: usize,
    max_bytes: usize,
    /// The timeline of the server the session streams from: every commit's
    /// position is on it.
    timeline: Timeline,
}

/// One transaction's watched changes until its commit.
#[derive(Default)]
struct Txn {
    /// Each with the (sub)transaction it belongs to.
    items: Vec<(u32, Entry)>,
    /// What `items` took when they arrived (see [`Entry::size`]).
    bytes: usize,
    /// Past `max_changes` or `max_bytes`: only the tables touched (the items
    /// are dropped).
    overflow: Option<Vec<TableName>>,
    /// Tables whose `Relation` message changed in it (a rewrite's sign).
    rewritten: Vec<TableName>,
    /// One of its messages could not be decoded.
    broken: bool,
}

/// One watched change of a transaction, in order.
enum Entry {
    Row(RowChange),
    Truncated(TableName),
}

impl Entry {
    /// Its memory, roughly: the key text it holds plus a fixed overhead
    /// for the row change, each column and the vectors holding them.
    fn size(&self) -> usize {
        let columns = |c: &Option<Columns>| {
            c.as_ref().map_or(0, |c| {
                c.0.iter()
                    .map(|(_, v)| match v {
                        Value::Text(t) => 48 + t.len(),
                        Value::Null | Value::Unknown => 48,
                    })
                    .sum()
            })
        };
        match self {
            Entry::Row(r) => 96 + columns(&r.new) + columns(&r.old),
            Entry::Truncated(_) => 96,
        }
    }

    fn table(&self) -> &TableName {
        match self {
            Entry::Row(r) => &r.table,
            Entry::Truncated(t) => t,
        }
    }
}

/// A committed transaction, and what must be rescanned once it is visible.
pub(super) struct Assembled {
    commit: Commit,
    /// Tables whose changes were too many to hold.
    rescan: Vec<TableName>,
    /// A change of it could not be decoded: rebuild every filter.
    resync: bool,
}

impl<'a> Assembler<'a> {
    pub(super) fn new(watch: &'a Watch, stats: &'a Stats, timeline: Timeline) -> Self {
        Self {
            timeline,
            watch,
            stats,
            rels: HashMap::new(),
            current: None,
            streams: HashMap::new(),
            block: None,
            stray_error: false,
            identity_warned: HashSet::new(),
            max_changes: MAX_CHANGES,
            max_bytes: MAX_BYTES,
        }
    }

    /// Logs a table whose replica identity no longer carries a watched
    /// column, once until it does again (see "Replica identity").
    fn note_identity(&mut self, rel: &TrackedRelation) {
        let outside: Vec<&str> = rel
            .columns
            .iter()
            .filter(|(_, _, _, identity)| !identity)
            .map(|(name, ..)| &**name)
            .collect();
        if outside.is_empty() {
            self.identity_warned.remove(&rel.table);
        } else if self.identity_warned.insert(rel.table.clone()) {
            tracing::warn!(
                table = %rel.table,
                columns = ?outside,
                "the table's replica identity does not carry these key columns: each UPDATE or DELETE of it clears the cache of their resources; ALTER TABLE {} REPLICA IDENTITY FULL (or USING INDEX a unique index on them)",
                rel.table
            );
        }
    }

    /// A message that could not be decoded arrived outside any transaction
    /// since the last call: every filter must be rebuilt.
    pub(super) fn take_stray_error(&mut self) -> bool {
        std::mem::take(&mut self.stray_error)
    }

    /// Whether a whole transaction is half received: its commit has been
    /// decoded already, so a position the server reports now may be past
    /// it, and no position to acknowledge. (An open *streamed*
    /// transaction is not: it has not committed, so its commit lies after
    /// anything the server has sent, and after a reconnect the server
    /// streams it again from the start.)
    pub(super) fn in_transaction(&self) -> bool {
        self.current.is_some()
    }

    /// Whether the next message is inside a streamed block (see
    /// [`pgoutput::decode_in`]).
    pub(super) fn in_block(&self) -> bool {
        self.block.is_some()
    }

    /// A message could not be decoded: whatever it was is lost.
    pub(super) fn poison(&mut self) {
        match (self.block, self.current.as_mut()) {
            (Some(xid), _) => self.streams.entry(xid).or_default().broken = true,
            (None, Some((_, txn))) => txn.broken = true,
            (None, None) => self.stray_error = true,
        }
    }

    /// `table` was described anew within the transaction being received:
    /// rescanned once it is visible (see [`TrackedRelation::shape`]).
    fn note_rewrite(&mut self, table: TableName) {
        let txn = match (self.block, self.current.as_mut()) {
            (Some(xid), _) => self.streams.entry(xid).or_default(),
            (None, Some((_, txn))) => txn,
            // Outside a transaction: the shapes read with the proofs see it.
            (None, None) => return,
        };
        if !txn.rewritten.contains(&table) {
            txn.rewritten.push(table);
        }
    }

    fn record(&mut self, sub: Option<u32>, item: Entry) {
        let (txn, sub) = match self.block {
            Some(xid) => (self.streams.entry(xid).or_default(), sub.unwrap_or(xid)),
            None => match self.current.as_mut() {
                Some((xid, txn)) => (txn, *xid),
                None => return,
            },
        };
        if let Some(tables) = txn.overflow.as_mut() {
            if !tables.contains(item.table()) {
                tables.push(item.table().clone());
            }
            return;
        }
        let size = item.size();
        if txn.items.len() >= self.max_changes || txn.bytes + size > self.max_bytes {
            let mut tables: Vec<TableName> = Vec::new();
            for t in txn
                .items
                .iter()
                .map(|(_, i)| i.table())
                .chain([item.table()])
            {
                if !tables.contains(t) {
                    tables.push(t.clone());
                }
            }
            tracing::warn!(
                changes = txn.items.len(),
                bytes = txn.bytes,
                "a transaction changed more watched rows (or key bytes) than the feed holds; its tables are rescanned once it commits"
            );
            txn.items = Vec::new();
            txn.bytes = 0;
            txn.overflow = Some(tables);
            return;
        }
        txn.bytes += size;
        txn.items.push((sub, item));
    }

    fn done(&self, xid: u32, end_lsn: u64, commit_time: i64, txn: Txn) -> Assembled {
        let committed_at = pg_time(commit_time);
        if let Some(at) = committed_at
            && let Ok(d) = SystemTime::now().duration_since(at)
        {
            self.stats
                .lag_us
                .store(d.as_micros() as u64, Ordering::Relaxed);
        }
        let mut changes = Vec::new();
        let mut truncated = Vec::new();
        for (_, item) in txn.items {
            match item {
                Entry::Row(r) => changes.push(r),
                Entry::Truncated(t) => truncated.push(t),
            }
        }
        Assembled {
            commit: Commit {
                xid: Some(xid),
                position: Some(Position::new(self.timeline, Lsn(end_lsn))),
                committed_at,
                phase: Phase::Received,
                changes,
                truncated,
            },
            rescan: {
                let mut rescan = txn.overflow.unwrap_or_default();
                for t in txn.rewritten {
                    if !rescan.contains(&t) {
                        rescan.push(t);
                    }
                }
                rescan
            },
            resync: txn.broken,
        }
    }

    /// Takes one message (`sub`: the xid a streamed message carries);
    /// returns the transaction it completes, if any.
    pub(super) fn push(&mut self, sub: Option<u32>, msg: Message) -> Option<Assembled> {
        let stats = self.stats;
        match msg {
            Message::Begin { xid, .. } => self.current = Some((xid, Txn::default())),
            Message::Relation(r) => {
                let table: TableName = Arc::from(format!("{}.{}", r.namespace, r.name));
                let known =
                    self.watch
                        .tables
                        .iter()
                        .find(|t| t.name == table)
                        .map(|t| TrackedRelation {
                            table: t.name.clone(),
                            columns: t
                                .columns
                                .iter()
                                .filter_map(|c| {
                                    let i = r.columns.iter().position(|n| *n == *c.name)?;
                                    let identity = r.identity.get(i).copied().unwrap_or(false);
                                    Some((c.name.clone(), c.ty, i, identity))
                                })
                                .collect(),
                            shape: r
                                .columns
                                .iter()
                                .enumerate()
                                .filter(|(_, n)| {
                                    t.columns.iter().any(|c| *c.name == **n)
                                        || t.served.iter().any(|c| **c == **n)
                                })
                                .map(|(i, n)| {
                                    let (ty, typmod) = r.types.get(i).copied().unwrap_or((0, -1));
                                    (n.clone(), i, ty, typmod)
                                })
                                .collect(),
                        });
                if let Some(rel) = &known {
                    self.note_identity(rel);
                    if let Some(Some(before)) = self.rels.get(&r.id)
                        && before.shape != rel.shape
                    {
                        tracing::warn!(table = %rel.table, "the WAL describes the table anew (a served column's type or place changed): rescanned after this transaction");
                        self.note_rewrite(rel.table.clone());
                    }
                }
                self.rels.insert(r.id, known);
            }
            Message::Insert { rel, new } => {
                if let Some(Some(r)) = self.rels.get(&rel) {
                    stats.inserts.fetch_add(1, Ordering::Relaxed);
                    let change = RowChange {
                        table: r.table.clone(),
                        op: Op::Insert,
                        new: Some(columns(r, &new, false)),
                        old: None,
                    };
                    self.record(sub, Entry::Row(change));
                }
            }
            Message::Update { rel, old, new } => {
                if let Some(Some(r)) = self.rels.get(&rel) {
                    stats.updates.fetch_add(1, Ordering::Relaxed);
                    let old = match &old {
                        Some(o) => columns(r, o, true),
                        // No old tuple: no replica identity column changed.
                        // A watched column in the identity kept its value;
                        // one outside it may have changed, to what is not
                        // said (see "Replica identity").
                        None => Columns(
                            r.columns
                                .iter()
                                .map(|(name, ty, i, identity)| {
                                    let v = match identity {
                                        true => value(*ty, new.0.get(*i)),
                                        false => Value::Unknown,
                                    };
                                    (name.clone(), v)
                                })
                                .collect(),
                        ),
                    };
                    let mut new = columns(r, &new, false);
                    // Sent as unchanged (TOASTed, not rewritten): the old
                    // row's value, when the old row carries it.
                    for ((_, n), (_, o)) in new.0.iter_mut().zip(&old.0) {
                        if *n == Value::Unknown && *o != Value::Unknown {
                            *n = o.clone();
                        }
                    }
                    let change = RowChange {
                        table: r.table.clone(),
                        op: Op::Update,
                        new: Some(new),
                        old: Some(old),
                    };
                    self.record(sub, Entry::Row(change));
                }
            }
            Message::Delete { rel, old } => {
                if let Some(Some(r)) = self.rels.get(&rel) {
                    stats.deletes.fetch_add(1, Ordering::Relaxed);
                    let change = RowChange {
                        table: r.table.clone(),
                        op: Op::Delete,
                        new: None,
                        old: Some(columns(r, &old, true)),
                    };
                    self.record(sub, Entry::Row(change));
                }
            }
            Message::Truncate { rels: ids } => {
                for id in ids {
                    if let Some(Some(r)) = self.rels.get(&id) {
                        stats.truncates.fetch_add(1, Ordering::Relaxed);
                        let table = r.table.clone();
                        self.record(sub, Entry::Truncated(table));
                    }
                }
            }
            Message::Commit {
                end_lsn,
                commit_time,
                ..
            } => {
                let (xid, txn) = self.current.take()?;
                return Some(self.done(xid, end_lsn, commit_time, txn));
            }
            Message::StreamStart { xid, .. } => {
                self.streams.entry(xid).or_default();
                self.block = Some(xid);
            }
            Message::StreamStop => self.block = None,
            Message::StreamCommit {
                xid,
                end_lsn,
                commit_time,
                ..
            } => {
                let txn = self.streams.remove(&xid)?;
                return Some(self.done(xid, end_lsn, commit_time, txn));
            }
            Message::StreamAbort { xid, subxid } => {
                if xid == subxid {
                    self.streams.remove(&xid);
                } else if let Some(txn) = self.streams.get_mut(&xid) {
                    // An overflowed transaction keeps its tables: a rescan
                    // too many is harmless.
                    txn.items.retain(|(sub, _)| *sub != subxid);
                }
            }
            // Origin, type names, logical messages and unknown types
            // change no row.
            Message::Origin { .. }
            | Message::Type { .. }
            | Message::LogicalMessage { .. }
            | Message::Other(_) => {}
        }
        None
    }
}

/// The watched columns of `tuple`. In an `old` tuple, a column outside the
/// replica identity is not carried (pgoutput sends it as null): it is
/// [`Value::Unknown`], never `Null`, or a deleted row's key would stay in
/// the filter and its cached row be served on.
fn columns(rel: &TrackedRelation, tuple: &pgoutput::Tuple, old: bool) -> Columns {
    Columns(
        rel.columns
            .iter()
            .map(|(name, ty, i, identity)| {
                if old && !identity {
                    return (name.clone(), Value::Unknown);
                }
                (name.clone(), value(*ty, tuple.0.get(*i)))
            })
            .collect(),
    )
}

/// One column's value as a tuple carries it.
fn value(ty: crate::feed::ColumnType, datum: Option<&Datum>) -> Value {
    match datum {
        Some(Datum::Text(t)) => Value::Text(canonical_text(ty, t).to_string()),
        Some(Datum::Null) => Value::Null,
        Some(Datum::Unchanged) | None => Value::Unknown,
    }
}

/// Postgres' microseconds since 2000-01-01 as a `SystemTime`.
fn pg_time(us: i64) -> Option<SystemTime> {
    const PG_EPOCH: u64 = 946_684_800;
    let since = UNIX_EPOCH + Duration::from_secs(PG_EPOCH);
    if us >= 0 {
        since.checked_add(Duration::from_micros(us as u64))
    } else {
        since.checked_sub(Duration::from_micros(us.unsigned_abs()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::feed::wal::pgoutput::{Relation, Tuple};
    use crate::feed::{ColumnType, WatchedColumn, WatchedTable};

    fn watch() -> Watch {
        Watch {
            tables: vec![WatchedTable {
                name: Arc::from("public.t"),
                columns: vec![WatchedColumn {
                    name: Arc::from("id"),
                    ty: ColumnType::Int8,
                }],
                keys: Vec::new(),
                served: Vec::new(),
            }],
        }
    }

    fn relation() -> Message {
        Message::Relation(Relation {
            id: 1,
            namespace: "public".into(),
            name: "t".into(),
            columns: vec!["id".into()],
            identity: vec![true],
            types: vec![(20, -1)],
        })
    }

    fn insert(id: i64) -> Message {
        Message::Insert {
            rel: 1,
            new: Tuple(vec![Datum::Text(id.to_string())]),
        }
    }

    fn keys(d: &Assembled) -> Vec<String> {
        d.commit
            .changes
            .iter()
            .map(|c| match c.new.as_ref().and_then(|n| n.get("id")) {
                Some(Value::Text(t)) => t.clone(),
                other => panic!("{other:?}"),
            })
            .collect()
    }

    /// Feeds `msgs` (each with the xid a streamed message carries) and
    /// returns every completed transaction.
    fn run(asm: &mut Assembler<'_>, msgs: Vec<(Option<u32>, Message)>) -> Vec<Assembled> {
        msgs.into_iter()
            .filter_map(|(sub, m)| asm.push(sub, m))
            .collect()
    }

    fn commit(xid: u32, end: u64) -> Message {
        Message::StreamCommit {
            xid,
            commit_lsn: end - 1,
            end_lsn: end,
            commit_time: 0,
        }
    }

    #[test]
    fn streamed_transactions_keep_only_what_committed() {
        let (w, stats) = (watch(), Stats::default());
        let mut asm = Assembler::new(&w, &stats, Timeline { system: 1, id: 1 });
        let done = run(
            &mut asm,
            vec![
                (
                    None,
                    Message::StreamStart {
                        xid: 10,
                        first: true,
                    },
                ),
                (Some(10), relation()),
                (Some(10), insert(1)),
                (Some(11), insert(2)), // subtransaction 11
                (None, Message::StreamStop),
                // A whole transaction between two blocks of 10.
                (
                    None,
                    Message::Begin {
                        final_lsn: 5,
                        xid: 20,
                    },
                ),
                (None, insert(3)),
                (
                    None,
                    Message::Commit {
                        commit_lsn: 5,
                        end_lsn: 6,
                        commit_time: 0,
                    },
                ),
                (
                    None,
                    Message::StreamStart {
                        xid: 10,
                        first: false,
                    },
                ),
                (Some(12), insert(4)),
                (None, Message::StreamStop),
                (
                    None,
                    Message::StreamStart {
                        xid: 30,
                        first: true,
                    },
                ),
                (Some(30), insert(5)),
                (None, Message::StreamStop),
                (
                    None,
                    Message::StreamAbort {
                        xid: 10,
                        subxid: 11,
                    },
                ),
                (
                    None,
                    Message::StreamAbort {
                        xid: 30,
                        subxid: 30,
                    },
                ),
                (None, commit(10, 9)),
            ],
        );
        assert_eq!(done.len(), 2);
        assert_eq!(keys(&done[0]), ["3"]);
        assert_eq!(done[0].commit.xid, Some(20));
        assert_eq!(keys(&done[1]), ["1", "4"], "subtransaction 11 aborted");
        assert_eq!(done[1].commit.position.map(|p| p.lsn), Some(Lsn(9)));
        assert!(asm.streams.is_empty(), "transaction 30 aborted");
        assert!(!asm.in_transaction());
    }

    #[test]
    fn a_whole_transaction_half_read_holds_back_acknowledgement() {
        let (w, stats) = (watch(), Stats::default());
        let mut asm = Assembler::new(&w, &stats, Timeline { system: 1, id: 1 });
        asm.push(
            None,
            Message::Begin {
                final_lsn: 5,
                xid: 20,
            },
        );
        assert!(asm.in_transaction());
        asm.push(
            None,
            Message::StreamStart {
                xid: 7,
                first: true,
            },
        );
        asm.push(None, Message::StreamStop);
        asm.push(
            None,
            Message::Commit {
                commit_lsn: 5,
                end_lsn: 6,
                commit_time: 0,
            },
        );
        // Only a streamed transaction is open: its commit is still ahead.
        assert!(!asm.in_transaction());
    }

    /// The byte bound: three inserts of short keys fit in 500 bytes, four
    /// do not; each transaction counts its own.
    #[test]
    fn too_many_bytes_become_a_rescan() {
        let (w, stats) = (watch(), Stats::default());
        let mut asm = Assembler::new(&w, &stats, Timeline { system: 1, id: 1 });
        asm.max_changes = usize::MAX;
        asm.max_bytes = 500;
        let txn = |xid: u32, ids: std::ops::Range<i64>| {
            let mut m = vec![(
                None,
                Message::Begin {
                    final_lsn: u64::from(xid),
                    xid,
                },
            )];
            m.extend(ids.map(|i| (None, insert(i))));
            m.push((
                None,
                Message::Commit {
                    commit_lsn: u64::from(xid),
                    end_lsn: u64::from(xid) + 1,
                    commit_time: 0,
                },
            ));
            m
        };
        let mut msgs = vec![(None, relation())];
        msgs.extend(txn(10, 0..3));
        msgs.extend(txn(20, 0..4));
        msgs.extend(txn(30, 5..8));
        let done = run(&mut asm, msgs);
        assert_eq!(keys(&done[0]), ["0", "1", "2"]);
        assert!(done[0].rescan.is_empty());
        assert!(done[1].commit.changes.is_empty());
        assert_eq!(done[1].rescan, [Arc::<str>::from("public.t")]);
        assert_eq!(
            keys(&done[2]),
            ["5", "6", "7"],
            "the bound is per transaction"
        );
    }

    #[test]
    fn too_many_changes_become_a_rescan_and_memory_stays_bounded() {
        let (w, stats) = (watch(), Stats::default());
        let mut asm = Assembler::new(&w, &stats, Timeline { system: 1, id: 1 });
        asm.max_changes = 3;
        let mut msgs = vec![
            (None, relation()),
            (
                None,
                Message::Begin {
                    final_lsn: 5,
                    xid: 20,
                },
            ),
        ];
        msgs.extend((0..10).map(|i| (None, insert(i))));
        msgs.push((
            None,
            Message::Commit {
                commit_lsn: 5,
                end_lsn: 6,
                commit_time: 0,
            },
        ));
        msgs.push((
            None,
            Message::Begin {
                final_lsn: 7,
                xid: 21,
            },
        ));
        msgs.push((None, insert(99)));
        msgs.push((
            None,
            Message::Commit {
                commit_lsn: 7,
                end_lsn: 8,
                commit_time: 0,
            },
        ));
        let done = run(&mut asm, msgs);
        assert!(done[0].commit.changes.is_empty());
        assert_eq!(done[0].rescan, [Arc::<str>::from("public.t")]);
        assert_eq!(
            done[0].commit.position.map(|p| p.lsn),
            Some(Lsn(6)),
            "still acknowledged in order"
        );
        assert_eq!(keys(&done[1]), ["99"]);
        assert!(done[1].rescan.is_empty());
    }

    /// The WAL describing a watched table anew within a session (a served
    /// column's type or place changed: a rewrite) rescans it after that
    /// transaction; the same description again does not.
    #[test]
    fn a_relation_described_anew_is_rescanned_after_its_transaction() {
        let (w, stats) = (watch(), Stats::default());
        let mut asm = Assembler::new(&w, &stats, Timeline { system: 1, id: 1 });
        let txn = |asm: &mut Assembler<'_>, rel: Message, end: u64| {
            asm.push(
                None,
                Message::Begin {
                    final_lsn: end,
                    xid: end as u32,
                },
            );
            asm.push(None, rel);
            asm.push(None, insert(1));
            asm.push(
                None,
                Message::Commit {
                    commit_lsn: end,
                    end_lsn: end + 1,
                    commit_time: 0,
                },
            )
            .expect("a whole transaction")
        };
        assert!(txn(&mut asm, relation(), 5).rescan.is_empty(), "the first");
        assert!(
            txn(&mut asm, relation(), 7).rescan.is_empty(),
            "the same again"
        );
        let retyped = Message::Relation(Relation {
            types: vec![(1700, -1)],
            ..match relation() {
                Message::Relation(r) => r,
                _ => unreachable!(),
            }
        });
        let done = txn(&mut asm, retyped, 9);
        assert_eq!(done.rescan, [Arc::<str>::from("public.t")]);
        assert_eq!(keys(&done), ["1"], "its changes are delivered too");
    }

    #[test]
    fn an_undecodable_message_rebuilds_after_its_transaction() {
        let (w, stats) = (watch(), Stats::default());
        let mut asm = Assembler::new(&w, &stats, Timeline { system: 1, id: 1 });
        asm.push(None, relation());
        asm.push(
            None,
            Message::StreamStart {
                xid: 10,
                first: true,
            },
        );
        asm.poison();
        asm.push(None, Message::StreamStop);
        asm.push(
            None,
            Message::Begin {
                final_lsn: 5,
                xid: 20,
            },
        );
        asm.push(None, insert(1));
        let whole = asm
            .push(
                None,
                Message::Commit {
                    commit_lsn: 5,
                    end_lsn: 6,
                    commit_time: 0,
                },
            )
            .unwrap();
        assert!(!whole.resync, "another transaction's error");
        let streamed = asm.push(None, commit(10, 9)).unwrap();
        assert!(streamed.resync);
        assert!(!asm.stray_error);
        asm.poison();
        assert!(
            asm.stray_error,
            "outside any transaction: at the batch's end"
        );
    }
}
