//! The `bus`: a fleet of gateways on one database decodes the WAL once.
//! One gateway, the *relay*, reads the primary's WAL through one permanent
//! slot (`bus.slot`) and appends what it decodes to one stream; every
//! gateway, the relay's own included, reads that stream instead of a slot
//! of its own, and turns it back into the [`Event`](super::Event)s a direct feed sends,
//! so the applier cannot tell the difference. The primary runs one
//! walsender whatever the size of the fleet.
//!
//! Files: [`entry`] (what one entry carries, and its encoding), [`redis`]
//! (the [`Bus`] on Redis Streams), [`relay`] (the slot to the stream),
//! [`consumer`] (the stream to the applier, and the fall-back to a direct
//! feed), `follow` (the consumer's bus mode), [`cursor`] (where the
//! consumer has read to, for snapshots), [`fallback`] (who may follow
//! the WAL directly). Snapshots of the filters travel beside the stream
//! (`redis::snapshots`; the protocol: `crate::snapshot`). Another log (NATS JetStream, Kafka) needs only another [`Bus`].
//!
//! # Who relays: the slot is the lock
//! Every gateway is a candidate. Once a second it looks whether the slot
//! is held (`pg_replication_slots.active`); when it is free it starts a WAL
//! feed on it. Postgres lets one walsender hold a slot, so at most one
//! candidate streams: no lease, no clock, and no second system to agree
//! with. A relay that dies (a crash, `SIGKILL`) drops its connection, the
//! walsender exits at once, and the next candidate holds the slot within
//! about a second (failover bound: one look, plus starting a session; a
//! hung host without a FIN takes until `wal_sender_timeout`, 60 s by
//! default: lower it on the primary where that matters).
//!
//! # The stream
//! One stream per database, configuration and epoch of the primary, key
//! `{bus.prefix}:{system identifier}:{database}:{watch fingerprint}:tl{timeline}:s{start}`:
//! two clusters, or two configurations watching different columns, never
//! share one, and neither do two *epochs* of one cluster: its timelines,
//! and each start of its postmaster. LSNs order one run of one history
//! only (`db::position`): after a failover the new primary's commits,
//! whose LSNs may be below what the old timeline's stream reached, and
//! after a restore from an older copy (the same system identifier and
//! timeline, at a lower position) the restored primary's, go to a new
//! stream instead of being refused as duplicates of entries that were
//! something else. Entry IDs are positions
//! `lsn-seq` on the stream's timeline, chosen by [`Bus::append`]
//! atomically with the entry (a Lua script on Redis):
//!
//! - a commit at `L` (the end of its commit record) gets `L-0`, and is
//!   refused as a duplicate unless `L` is past the newest entry's LSN; a
//!   batch of commits (what the relay appends: see `relay`, "Batches")
//!   is placed, and refused, by its last commit's `L`, and a consumer
//!   skips the commits in it at or below the entry before it (a relay that
//!   took over decodes again from the slot's confirmed position);
//! - a heartbeat at `P` (the primary's insert position read before the
//!   relay's WAL feed proved itself: every commit that ends at or before
//!   it is in the stream before it) gets `P-1`, and is left out unless `P`
//!   is past the newest entry's LSN;
//! - a resync that stands for a position past the newest entry (a term
//!   whose slot stands past the stream: [`crate::feed::Resync::upto`])
//!   gets that position's LSN with a sequence drawn at random;
//! - any other resync, a coverage change or an interruption
//!   (relation-level events) gets the newest entry's LSN with a greater
//!   sequence, by a step drawn at random, so that two relays all but never
//!   (odds of about 2^-32) give two such entries one ID (`redis`,
//!   "Lineage").
//!
//! Every entry carries `p`, the ID of the entry before it, read in the
//! same atomic step. So the stream is the relay's sequence of commits in
//! commit order, and an entry's LSN says every commit up to it is in the
//! stream before it, or, past a resync placed at its position, covered by
//! the rebuild that resync asks for.
//!
//! # Epochs
//! The relay reads the primary's [`Server`] (system identifier, timeline,
//! postmaster start time) at the start of each term and appends to that
//! epoch's stream, marking the streams of other epochs to expire once it
//! holds an entry (`redis`, "Epochs"); a commit on another timeline or a reading of
//! another server ends its term (the next one starts on the new stream).
//! Every consumer reads the primary's [`Server`] with each reading of its
//! insert position (every 100 ms): on a new epoch (a failover, a restart,
//! a restore) it moves to that epoch's stream, after its newest entry, and
//! resyncs, unless that stream continues its own (see "A promotion the
//! slot survived" below) (every cache and negative entry emptied, every filter rebuilt:
//! the old epoch may have had commits the new one lacks, visible ones
//! made with `synchronous_commit = off` that a crash lost, and loads may
//! have cached them); it proves itself current only with entries and
//! readings of the new epoch. A reading of the same epoch whose position
//! is behind an earlier one is a gap too, never a proof. A connection of
//! the gateway that reached another server than the one the consumer
//! follows (`db::identity`) makes it read the primary on a connection of
//! its own, where the address leads now.
//!
//! # A promotion the slot survived
//! Where the bus's slot survives a promotion (Patroni's permanent slots,
//! PostgreSQL 17's failover slots), the fleet keeps its filters, as a
//! direct feed does (see `wal::fork`). A relay whose new epoch's stream
//! is empty asks the bus which stream was in use before it
//! ([`Bus::previous`]: the one other stream not yet retired). Every term
//! counts its stream among the epochs' as it starts ([`Bus::enter`]), and
//! retires the others only once its stream holds an entry: so a stream
//! of an epoch that never got an entry (a restart in place, promoted away
//! from before its relay appended) still counts, and two candidates are
//! no answer. If it is of another timeline, its term's WAL feed starts as though it had
//! applied that stream, up to its newest position `A`, from that epoch's
//! server: the feed judges the promotion with the slot it kept and the
//! new timeline's history. Proven, the stream's first entry is an
//! [`Entry::Fork`] ([`Forked`]): the old epoch, the fork `F`, and
//! `K = min(A, F)`, where it is placed. Every commit of the new history
//! up to `K` is in the old stream, and the new stream brings every one
//! after it (the slot stood at or before `K`). Not proven, the first entry
//! is a resync, as for any new server. An event the feed's first check
//! of its dependencies sends (a table it cannot follow, a publication it
//! repaired) comes before the fork, which is then not first: the fleet
//! resyncs. A consumer waits for the new stream's first entry up to
//! `bus.max_lag`, then follows the WAL itself (a gap).
//!
//! A consumer that moves to the new epoch reads that first entry: a
//! `Fork` from the epoch it read, then it reads the old stream to its end
//! (its tail past `F`, which the new timeline lost, included: an extra key
//! in a filter is safe, and the caches go with the fork). Once it reached
//! `K` with no entry missing, it passes the fork on
//! ([`Event::Fork`](super::Event::Fork): every cache emptied, each filter
//! kept where its build saw nothing past `F`) and reads the new stream
//! after that entry. Anything else (another first entry, a stream it
//! cannot read to `K`, a break) is the resync of "Epochs". Tested in
//! `tests/it/feed/bus.rs` for a switchover and for a failover that lost a tail.
//!
//! # Guarantees (tested in `tests/it/feed/bus.rs`; reading Redis replicas, in
//! `tests/it/feed/bus/replicas.rs`)
//! - **Nothing lost at a failover.** The relay's WAL feed confirms the
//!   slot only up to what the bus acknowledged ([`relay`]), so a new relay
//!   starts at or before the stream's newest entry: what it decodes again
//!   is refused as a duplicate, and it cannot skip a commit (a relay
//!   appends in commit order and starts no later than the first commit
//!   the stream lacks). A relay that finds the slot created anew, or
//!   confirmed past the stream's newest entry (someone else read it),
//!   appends a resync before anything else. Two relays appending at once
//!   (one that lost the slot and has not noticed) append the same
//!   commits in the same order: the second copy of each is refused.
//! - **Continuity.** A consumer checks every entry's `p` against the
//!   entry it read last. A stream trimmed past it, a Redis that lost
//!   entries (a restart without persistence, a failover of its
//!   asynchronous replication) shows as a break: the consumer resyncs
//!   (every cache emptied, every filter rebuilt), as a direct feed does
//!   after a gap. The same holds across Redis nodes: a consumer that
//!   moves to another node (a replica of the read tier, or after a
//!   failover) reads on after the same ID there, and the `p`s tell it
//!   whether anything is missing.
//! - **No gap at start-up.** The relay appends a commit only once it is
//!   visible on the primary. A consumer starts reading after the stream's
//!   newest entry, read before the first scan: a commit in the stream by
//!   then is visible to the scan's snapshot, one after it is read. A
//!   stream with no entry yet is waited for (up to `bus.max_lag`, then the
//!   consumer follows the WAL itself): its relay's slot may not exist, and
//!   a scan before the slot's consistent point would miss what commits in
//!   between. So a relay that finds the stream empty owes nobody a resync,
//!   and a fleet's start-up (or a new timeline's stream) rebuilds once.
//! - **Current, or not vouched for.** Every 100 ms a consumer reads the
//!   primary's insert position `P`; once it has read an entry at `P` or
//!   past it, every change visible at that moment is applied
//!   ([`Event::Heartbeat`](super::Event::Heartbeat)): a commit inserts its
//!   commit record before it becomes visible, even one made with
//!   `synchronous_commit = off` (see "What a reading proves" in
//!   `db::position`: no delay of the WAL writer is assumed). How far
//!   behind the bus is (`bus.max_lag`) is measured from the reading. The
//!   relay appends a heartbeat whenever the primary's insert position
//!   moved past the stream and its WAL feed has proven itself up to it
//!   (about every 100 ms while the WAL grows; its feed forces the flush
//!   of WAL left unflushed), so an idle stream proves itself without
//!   writes.
//! - **The bus failing never makes a gateway wrong.** Unproven for
//!   `bus.max_lag` (Redis unreachable, no relay, a relay behind), a
//!   consumer starts a direct WAL feed on a temporary slot, given the
//!   position it had applied, so the feed's new slot is a gap it answers
//!   with a resync before its first commit or heartbeat; it checks the bus
//!   every second and returns once the stream reaches the primary's flush
//!   position, resyncing again. At most `bus.max_direct_fallback`
//!   gateways do so at once ([`fallback`]): the others follow nothing
//!   until the bus is back or a ticket is free. While a gateway has
//!   neither the bus nor its own feed, it is not vouched for: the
//!   database answers.

pub mod consumer;
pub mod cursor;
pub mod entry;
pub mod fallback;
mod follow;
pub mod redis;
pub mod relay;

use std::fmt;
use std::future::Future;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use sqlx::PgPool;

pub use entry::{Entry, Forked};

use super::{Position, Server, Watch};

/// A place in the stream: `lsn-seq`, the entry ID.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct EntryId {
    pub lsn: u64,
    pub seq: u64,
}

impl EntryId {
    /// Before every entry (the `p` of the first).
    pub const START: EntryId = EntryId { lsn: 0, seq: 0 };

    pub fn parse(text: &str) -> Option<EntryId> {
        let (lsn, seq) = text.split_once('-')?;
        Some(EntryId {
            lsn: lsn.parse().ok()?,
            seq: seq.parse().ok()?,
        })
    }
}

impl fmt::Display for EntryId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.lsn, self.seq)
    }
}

/// What [`Bus::append`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Appended {
    /// Appended at this position.
    At(EntryId),
    /// The stream already reaches this entry's LSN (a commit a relay
    /// decoded again; a heartbeat with nothing new).
    Already,
}

/// One entry read back.
#[derive(Debug)]
pub struct Read {
    pub at: EntryId,
    /// The position of the entry before it when it was appended.
    pub prev: EntryId,
    /// What it says; `Err` when it does not decode (a resync).
    pub entry: Result<Entry, String>,
}

/// Why the bus did not answer; safe to show (no URL, no password).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct BusError(pub String);

/// A log the relay appends to and consumers read: the one seam between the
/// feed and the transport. An implementation keeps the ordering and
/// duplicate rules of "The stream" above.
pub trait Bus: Send + 'static {
    /// From now on, the stream of `server`'s epoch (see "Epochs").
    fn set_epoch(&mut self, server: Server);
    /// The epoch of the stream in use.
    fn epoch(&self) -> Server;
    /// The stream in use is the epoch's: the streams of other epochs of
    /// the same key expire a while later (the relay, as it starts a term).
    fn retire_others(&mut self) -> impl Future<Output = Result<(), BusError>> + Send;
    /// Counts the stream in use among the epochs' streams (a relay, as its
    /// term starts), retiring none: a stream it may continue is then the
    /// only other one not retired.
    fn enter(&mut self) -> impl Future<Output = Result<(), BusError>> + Send;
    /// The epoch whose stream was in use before this one's, and its newest
    /// entry: the one other stream not yet retired. `None` when there is
    /// none, or more than one (see "A promotion the slot survived").
    fn previous(
        &mut self,
    ) -> impl Future<Output = Result<Option<(Server, EntryId)>, BusError>> + Send;
    /// The name of the stream in use (the status page).
    fn stream(&self) -> &str;
    /// The node the handle's connection reached, its role and address
    /// (the status page; empty before the first connection).
    fn node(&self) -> &str;
    /// Appends `entry` at the position the rules give it, atomically with
    /// reading the newest entry (its `p`).
    fn append(&mut self, entry: &Entry) -> impl Future<Output = Result<Appended, BusError>> + Send;
    /// The newest entry's position ([`EntryId::START`] for an empty or
    /// absent stream).
    fn head(&mut self) -> impl Future<Output = Result<EntryId, BusError>> + Send;
    /// Up to `max` entries after `after`, waiting up to `wait` for one.
    fn read(
        &mut self,
        after: EntryId,
        wait: Duration,
        max: usize,
    ) -> impl Future<Output = Result<Vec<Read>, BusError>> + Send;
    /// Says who relays, for `ttl` (the status page).
    fn announce(
        &mut self,
        who: &str,
        ttl: Duration,
    ) -> impl Future<Output = Result<(), BusError>> + Send;
    /// Who relays, as last announced.
    fn relay(&mut self) -> impl Future<Output = Result<Option<String>, BusError>> + Send;
    /// The next call opens a new connection (a consumer leaving a server
    /// that did not keep it current: a replica behind, see
    /// `redis::replicas`; a primary the sentinels no longer name). Where
    /// a new connection would reach the same server, it may keep the one
    /// it has.
    fn reconnect(&mut self);
    /// Trims the stream to its retention without appending: the append
    /// trims as it adds, and a bus that refuses the append for want of
    /// memory would otherwise never shrink the stream.
    fn trim(&mut self) -> impl Future<Output = Result<(), BusError>> + Send {
        async { Ok(()) }
    }
    /// Whether the node this handle writes to is the primary its discovery
    /// names now (Sentinel); `false` also drops the connection, so the
    /// next call asks again. A bus without discovery: always.
    fn still_primary(&mut self) -> impl Future<Output = Result<bool, BusError>> + Send {
        async { Ok(true) }
    }
    /// The node's memory and eviction policy, where the bus has them
    /// (Redis' `INFO memory`); `None`: a bus without.
    fn read_memory(
        &mut self,
    ) -> impl Future<Output = Result<Option<redis::writes::Memory>, BusError>> + Send {
        async { Ok(None) }
    }
}

/// Whether `e` is the bus refusing a write while it answers (a read-only
/// replica, an ACL user without the command, out of memory, a failed
/// snapshot): Redis' error codes.
pub fn is_refusal(e: &BusError) -> bool {
    [
        "(READONLY)",
        "(NOPERM)",
        "(OOM)",
        "(MISCONF)",
        "(NOREPLICAS)",
    ]
    .iter()
    .any(|code| e.0.ends_with(code))
}

/// Which the consumer follows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Follows {
    #[default]
    Starting,
    /// The bus.
    Bus,
    /// Its own WAL feed, the bus being unhealthy.
    Direct,
    /// Neither: the bus is unhealthy and `bus.max_direct_fallback`
    /// gateways follow the WAL themselves already (see `fallback`).
    Lost,
}

impl Follows {
    pub fn name(self) -> &'static str {
        match self {
            Follows::Starting => "starting",
            Follows::Bus => "bus",
            Follows::Direct => "direct",
            Follows::Lost => "lost",
        }
    }
}

/// What the bus says of itself, for the admin API, metrics and the status
/// page. Correctness rests on the events, never on this.
#[derive(Debug, Default)]
pub struct Status {
    state: Mutex<StatusState>,
    /// Times the consumer fell back to a direct feed.
    pub fallbacks: AtomicU64,
    /// Times it returned to the bus.
    pub returns: AtomicU64,
    /// Continuity breaks (a trimmed stream, lost entries) and undecodable
    /// entries: each a resync.
    pub breaks: AtomicU64,
    /// Entries read.
    pub read: AtomicU64,
    /// Entries this gateway appended as relay, and those refused as
    /// already there.
    pub appended: AtomicU64,
    pub duplicates: AtomicU64,
    /// Terms as relay (times this gateway took the slot).
    pub terms: AtomicU64,
    /// Bytes of WAL between the primary's flush position last read and
    /// what the stream has proven.
    pub lag_bytes: AtomicU64,
    /// Age of the oldest unproven reading of the primary's position, in
    /// milliseconds (0: current).
    pub lag_ms: AtomicU64,
    /// The bus's Redis `used_memory` and `maxmemory` (0: no limit), as the
    /// relay last read them; 0 and `u64::MAX`: not read (not the relay).
    pub redis_used: AtomicU64,
    pub redis_max: AtomicU64,
}

/// The bus's counters, read together: the one snapshot both `/metrics`
/// and the admin API show (each picks what it exports).
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct Counters {
    pub lag_bytes: u64,
    pub lag_ms: u64,
    pub fallbacks: u64,
    pub returns: u64,
    pub breaks: u64,
    pub read: u64,
    pub appended: u64,
    pub duplicates: u64,
    pub terms: u64,
    /// `used_memory` and `maxmemory` of the bus's Redis, read by the relay
    /// (`None`: this gateway has not read them).
    pub redis_used: Option<u64>,
    pub redis_max: Option<u64>,
}

#[derive(Clone, Debug, Default)]
pub struct StatusState {
    pub mode: Follows,
    /// This gateway holds the slot.
    pub relaying: bool,
    /// Who relays, as announced on the bus.
    pub relay: Option<String>,
    /// The Redis URL, password redacted.
    pub url: String,
    pub stream: String,
    /// The Redis node the consumer reads (`primary HOST:PORT`, `replica
    /// HOST:PORT`; see `redis::replicas`): the one its last read reached;
    /// empty off the bus and before its first read.
    pub reading: String,
    /// Why it is not on the bus, or the last error; safe to show.
    pub detail: Option<String>,
}

impl Status {
    pub fn counters(&self) -> Counters {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Counters {
            lag_bytes: l(&self.lag_bytes),
            lag_ms: l(&self.lag_ms),
            fallbacks: l(&self.fallbacks),
            returns: l(&self.returns),
            breaks: l(&self.breaks),
            read: l(&self.read),
            appended: l(&self.appended),
            duplicates: l(&self.duplicates),
            terms: l(&self.terms),
            redis_used: match l(&self.redis_used) {
                0 => None,
                used => Some(used),
            },
            redis_max: match l(&self.redis_max) {
                u64::MAX => None,
                max => Some(max),
            },
        }
    }

    pub fn new(url: String, stream: String) -> Self {
        let s = Status::default();
        s.redis_max.store(u64::MAX, Ordering::Relaxed);
        {
            let mut st = s.lock();
            st.url = url;
            st.stream = stream;
        }
        s
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, StatusState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn get(&self) -> StatusState {
        self.lock().clone()
    }

    fn set_mode(&self, mode: Follows, detail: Option<String>) {
        let mut s = self.lock();
        s.mode = mode;
        s.detail = detail;
        if mode != Follows::Bus {
            s.reading.clear();
        }
    }

    fn set_stream(&self, stream: &str) {
        let mut s = self.lock();
        if s.stream != stream {
            s.stream = stream.to_string();
        }
    }

    fn set_reading(&self, node: &str) {
        let mut s = self.lock();
        if s.reading != node {
            s.reading = node.to_string();
        }
    }

    fn set_relaying(&self, relaying: bool) {
        self.lock().relaying = relaying;
    }

    fn set_relay(&self, relay: Option<String>) {
        self.lock().relay = relay;
    }

    fn count(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// The primary as it answers now ([`Server`]: its timeline and start
/// time) and its insert position, on that timeline: every commit visible
/// when it was read ends at or before it (see "What a reading proves" in
/// `db::position`).
pub(crate) async fn primary(pool: &PgPool) -> Option<(Server, Position)> {
    match tokio::time::timeout(Duration::from_secs(1), Server::read_pool(pool)).await {
        Ok(Ok((server, reading))) => Some((server, reading.insert)),
        _ => None,
    }
}

/// [`primary`], and the watched tables' shapes read in the same round trip
/// (see "Shapes" in `feed::tracker`).
pub(crate) async fn primary_and_shapes(
    pool: &PgPool,
    shapes: &super::tracker::Shapes,
) -> Option<(Server, Position, Vec<Option<String>>)> {
    match tokio::time::timeout(Duration::from_secs(1), shapes.read_with_proof(pool)).await {
        Ok(Ok((server, reading, tables))) => Some((server, reading.insert, tables)),
        _ => None,
    }
}

/// [`primary`] on a connection of its own, not the pool's: where the
/// address leads now (see `db::identity`).
pub(crate) async fn primary_where_the_address_leads(pool: &PgPool) -> Option<(Server, Position)> {
    let within = crate::db::identity::ADDRESS_WITHIN;
    crate::db::identity::where_the_address_leads(&pool.connect_options(), within)
        .await
        .map(|(server, reading)| (server, reading.insert))
}

/// [`primary`] through the pool, or where the address leads when the pool
/// cannot answer (every connection refused for reaching another server
/// than the one followed: after a restart, all of them; see
/// `db::identity`) or `moved` says a connection of it reached another. The
/// pool first, so that a fleet waiting for its bus does not open a
/// connection per gateway per look.
pub(crate) async fn primary_through_the_pool(
    pool: &PgPool,
    moved: bool,
) -> Option<(Server, Position)> {
    let read = match moved {
        true => None,
        false => primary(pool).await,
    };
    match read {
        Some(read) => Some(read),
        None => primary_where_the_address_leads(pool).await,
    }
}

/// The key of `server`'s epoch's stream (see "The stream"): its timeline
/// and the moment its postmaster started.
pub fn epoch_key(base: &str, server: &Server) -> String {
    format!("{base}:tl{}:s{}", server.timeline.id, server.started_us)
}

/// The epoch of the stream `key` of `base` ([`epoch_key`] read back), on
/// the database system `system` (which `base` names).
pub fn epoch_of(base: &str, key: &str, system: u64) -> Option<Server> {
    let rest = key.strip_prefix(base)?.strip_prefix(":tl")?;
    let (id, start) = rest.split_once(":s")?;
    Some(Server {
        timeline: super::Timeline {
            system,
            id: id.parse().ok()?,
        },
        started_us: start.parse().ok()?,
    })
}

/// The stream's key without its timeline (see "The stream"): the
/// cluster's system identifier (the server's address and port where the
/// role may not read it), the database, and a fingerprint of the watched
/// tables and columns.
pub async fn stream_key(
    pool: &PgPool,
    prefix: &str,
    watch: &Watch,
) -> Result<String, super::PrepareError> {
    let row: (Option<String>, String) = sqlx::query_as(
        "SELECT CASE WHEN has_function_privilege('pg_control_system()', 'execute')
                THEN (SELECT system_identifier::text FROM pg_control_system())
                ELSE coalesce(host(inet_server_addr()), 'local') || '-' || coalesce(inet_server_port()::text, '')
                END,
                current_database()",
    )
    .fetch_one(pool)
    .await
    .map_err(|source| super::PrepareError::Db {
        what: "reading the cluster's identity for the bus",
        source,
    })?;
    let system = row.0.unwrap_or_else(|| "0".into());
    Ok(format!(
        "{prefix}:{system}:{}:{}",
        row.1,
        fingerprint(watch)
    ))
}

/// The watched tables and columns, hashed: gateways that watch different
/// columns must not share a stream (the relay carries only its own).
pub fn fingerprint(watch: &Watch) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for t in &watch.tables {
        h.update(t.name.as_bytes());
        h.update([0]);
        let mut cols: Vec<&str> = t.columns.iter().map(|c| &*c.name).collect();
        cols.sort_unstable();
        for c in cols {
            h.update(c.as_bytes());
            h.update([1]);
        }
        h.update([2]);
    }
    h.finalize()[..6]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// This process, as the status page names the relay.
pub fn whoami() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "unknown".into());
    format!("{host}:{}", std::process::id())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::feed::Timeline;

    #[test]
    fn an_epoch_key_reads_back_as_its_epoch() {
        let base = "bg:7:db:f00";
        for (id, started_us) in [(1, 0), (7, 1_733_000_000_123_456), (u32::MAX, -42)] {
            let s = Server {
                timeline: Timeline { system: 7, id },
                started_us,
            };
            assert_eq!(epoch_of(base, &epoch_key(base, &s), 7), Some(s));
        }
        assert_eq!(epoch_of(base, "bg:7:db:f00:epochs", 7), None);
        assert_eq!(epoch_of(base, "other:tl1:s2", 7), None);
        assert_eq!(epoch_of(base, "bg:7:db:f00:tlx:s2", 7), None);
    }
}
