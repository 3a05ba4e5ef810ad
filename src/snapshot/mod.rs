//! Snapshots: a resource's filter, built by one gateway's scan, published
//! on the bus for the rest of the fleet, so that a gateway that joins, or
//! meets a gap the whole fleet meets, loads it instead of scanning the
//! table again. What is stored and why a reader of Redis learns nothing
//! useful: [`seal`]. Where it is stored: a [`Store`] (the bus's Redis,
//! `feed::bus::redis::snapshots`). Who loads and who scans:
//! `resource::fleet`.
//!
//! # What a snapshot is complete at
//! A snapshot carries a [`Mark`]: a stream of the bus (one per database,
//! watched columns and epoch of the primary: its system identifier,
//! timeline and start) and an entry of it. It holds the key of every row
//! that existed when that entry was appended, and perhaps more (a filter
//! with extra keys is safe). Built so:
//!
//! 1. the publisher's rebuild scans with its window open, as every
//!    rebuild does (`resource::live_filter`), and swaps the new set in;
//! 2. then it reads the stream's newest place, lets its consumer read up
//!    to it (for a second at most), reads where the consumer has passed
//!    entries on to, `R` ([`Store::settled`]), and waits until every event
//!    of the entries up to `R` has been applied (a barrier through the
//!    applier's queue).
//!    Reading up to the head first is for the rest of the fleet: every
//!    gateway that opened its window before the swap asks for a snapshot
//!    at or past its own place, which is at or before that head;
//! 3. it checks that no gap was opened on the resource since its window
//!    opened (a continuity break, an epoch change, a table the feed
//!    cannot follow): such a gap may have lost keys the scan did not see;
//! 4. it encodes the live set, and labels it `R`.
//!
//! A row whose commit is in an entry up to `R` is in the set: visible
//! before the scan (the relay appends a commit once it is visible), so
//! scanned; or applied during the window, so journaled and replayed; or
//! applied after the swap, into the set itself; and step 2 makes "applied"
//! true of every such entry before the set is encoded.
//!
//! # When a snapshot may be used
//! - **Joining** (start-up, `resource::fleet` at the consumer's start): the
//!   set is installed before the consumer delivers anything, and the
//!   consumer reads from `R` on, so every commit after `R` reaches the
//!   set. Only when the stream still continues from `R` (the entry after
//!   `R` names it as its predecessor, or `R` is the newest entry); a
//!   trimmed or lost entry after `R` is the break every consumer checks
//!   for anyway (`feed::bus`, "Continuity"), a resync.
//! - **A gap** (mid-life, with the consumer reading on): a rebuild opens
//!   its window, reads its consumer's position `W` (at or past everything
//!   it has applied), and takes a snapshot at `R ≥ W` on the same stream:
//!   entries up to `W` are in the snapshot, later ones in the journal.
//!
//! - **A little behind**: a snapshot at `R < W` plus the keys this
//!   gateway applied from commits past `R`, when it still holds every one
//!   of them and no gap opened since a rebuild was last complete
//!   (`resource::recent`).
//!
//! Never a snapshot of another stream (a manifest names its stream, and
//! the name is authenticated with the body): another cluster, database,
//! set of watched columns, timeline or start of the primary. Never one
//! of another key definition (table, key columns and types, how each
//! compares: [`Manifest::shape`]), nor of another catalog state of the
//! table ([`Store::catalog`]: a rewrite, partitions, a replaced table, an
//! edited publication change rows no stream entry names, and may have
//! happened while no feed ran to see them).

pub mod seal;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures_util::future::BoxFuture;
use serde::{Deserialize, Serialize};

pub use seal::{FleetKey, FleetKeyError, Nonce, SealError};

use crate::filter::{FilterKey, KeySet};

/// A place in a stream of the bus: the stream's name and an entry's ID.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mark {
    pub stream: String,
    pub lsn: u64,
    pub seq: u64,
}

impl Mark {
    /// Whether this place is on `other`'s stream, at or after it.
    pub fn reaches(&self, other: &Mark) -> bool {
        self.stream == other.stream && (self.lsn, self.seq) >= (other.lsn, other.seq)
    }
}

/// The manifest: what a snapshot is, in JSON, stored beside its chunks.
/// Its exact bytes are bound to every chunk ([`seal`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// [`FORMAT`].
    pub format: u32,
    pub resource: String,
    /// The key definition, hashed ([`shape`]).
    pub shape: String,
    /// The table's catalog state as the publisher's rebuild began
    /// ([`Store::catalog`]): a snapshot is used only where it is the same.
    pub catalog: String,
    /// The fleet key's public name ([`FleetKey::id`]).
    pub key_id: String,
    /// Complete at this place (see the module doc).
    pub at: Mark,
    /// The build's nonce ([`Nonce::hex`]): names the snapshot, and with
    /// the fleet key gives its filter and body keys.
    pub nonce: String,
    /// `bloom` or `exact`.
    pub kind: String,
    /// Keys the scan found, and rows it counted (what the set is sized for).
    pub keys: u64,
    pub rows: u64,
    /// The highest integer key found (`i64::MIN`: none, or not integers).
    pub max_int: i64,
    /// The filter's serialised length, and what is stored.
    pub plain_bytes: u64,
    pub sealed_bytes: u64,
    pub chunks: u32,
    /// When it was published (Unix milliseconds) and by whom (host:pid).
    pub published_ms: u64,
    pub by: String,
}

/// The manifest's format.
pub const FORMAT: u32 = 1;

/// The most chunks a manifest may name: the largest body
/// ([`seal::MAX_PLAIN`]) in chunks. Checked before anything is fetched,
/// since a manifest is authenticated only with its chunks.
pub const MAX_CHUNKS: u32 = (seal::MAX_PLAIN / seal::CHUNK as u64) as u32 + 2;

/// A snapshot read back: the manifest's exact bytes and its chunks.
pub struct Stored {
    pub manifest: Vec<u8>,
    pub chunks: Vec<Vec<u8>>,
}

/// A snapshot opened: the set and what the scan found.
pub struct Opened {
    pub manifest: Manifest,
    pub set: KeySet,
}

/// Why a snapshot was not used; each is a scan, never a wrong filter.
#[derive(Debug, thiserror::Error)]
pub enum Unusable {
    #[error("its manifest does not parse ({0})")]
    Manifest(String),
    #[error("it is of another resource, key definition, stream or format")]
    Other,
    #[error("{0}")]
    Seal(#[from] SealError),
    #[error("its filter does not decode ({0})")]
    Filter(String),
}

/// Why a snapshot was not stored, found or published; safe to log (no URL,
/// password, token or key). Each is a scan instead, never a wrong filter.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// The store (the bus's Redis) did not answer, refused, or answered
    /// what it should not.
    #[error("{0}")]
    Store(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error("reading the catalog: {0}")]
    Catalog(#[source] sqlx::Error),
    #[error("reading the catalog timed out")]
    CatalogTimedOut,
    #[error("the table does not exist")]
    NoTable,
    #[error("not a watched table")]
    NotWatched,
    /// A snapshot handed to [`Store::put`] that does not read back.
    #[error("{0}")]
    Unusable(#[from] Unusable),
    /// What a snapshot would stand for is not known (see the module doc,
    /// step 2): not published.
    #[error("{0}")]
    NotSettled(&'static str),
    /// Encoding or opening it on a blocking thread panicked.
    #[error("{0} panicked")]
    Panicked(&'static str),
}

/// The key definition's fingerprint: the table, and each key column with
/// its type and how it compares. Two gateways whose definitions differ
/// would hash different bytes for one key.
pub fn shape(parts: &[String]) -> String {
    let mut input = Vec::new();
    for p in parts {
        input.extend_from_slice(p.as_bytes());
        input.push(0);
    }
    let d = ring::digest::digest(&ring::digest::SHA256, &input);
    d.as_ref()[..12]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A build that may be published: its nonce and the filter key the fleet
/// derives from it.
#[derive(Clone)]
pub struct BuildKey {
    pub nonce: Nonce,
    pub filter: FilterKey,
}

impl BuildKey {
    pub fn new(fleet: &FleetKey) -> Self {
        let nonce = Nonce::random();
        Self {
            filter: fleet.filter_key(&nonce),
            nonce,
        }
    }
}

/// Seals `set` (built with `key`) under `fleet`, for `manifest` whose
/// size fields this fills in.
pub fn publishable(
    fleet: &FleetKey,
    key: &BuildKey,
    mut manifest: Manifest,
    set: &KeySet,
) -> Stored {
    let packed = seal::pack(&set.to_bytes());
    manifest.format = FORMAT;
    manifest.key_id = fleet.id();
    manifest.nonce = key.nonce.hex();
    manifest.kind = set.kind().to_string();
    manifest.plain_bytes = packed.plain_len;
    manifest.sealed_bytes = packed.sealed_len;
    manifest.chunks = packed.chunks;
    let bytes = serde_json::to_vec(&manifest).expect("a manifest serialises");
    let chunks = seal::seal(fleet, &key.nonce, &bytes, packed);
    Stored {
        manifest: bytes,
        chunks,
    }
}

/// Reads a stored manifest (not yet authenticated: only to decide whether
/// its chunks are worth fetching).
pub fn manifest(bytes: &[u8]) -> Result<Manifest, Unusable> {
    serde_json::from_slice(bytes).map_err(|e| Unusable::Manifest(e.to_string()))
}

/// Opens a stored snapshot of `resource` with key definition `shape`:
/// authenticated (every chunk bound to the manifest's bytes), decoded, the
/// filter key checked.
pub fn open(
    fleet: &FleetKey,
    stored: Stored,
    resource: &str,
    shape: &str,
) -> Result<Opened, Unusable> {
    let m = manifest(&stored.manifest)?;
    if m.format != FORMAT || m.resource != resource || m.shape != shape {
        return Err(Unusable::Other);
    }
    let nonce = Nonce::parse(&m.nonce).ok_or_else(|| Unusable::Manifest("its nonce".into()))?;
    if stored.chunks.len() != m.chunks as usize {
        return Err(Unusable::Seal(SealError::Forged));
    }
    let plain = seal::open(
        fleet,
        &nonce,
        &stored.manifest,
        stored.chunks,
        m.plain_bytes,
    )?;
    let set = KeySet::from_bytes(&plain, &fleet.filter_key(&nonce))
        .map_err(|e| Unusable::Filter(e.to_string()))?;
    Ok(Opened { manifest: m, set })
}

/// Where snapshots are kept and the scans of a fleet are counted out: the
/// bus. Object safe, so resources hold it without knowing the bus.
pub trait Store: Send + Sync + 'static {
    fn fleet(&self) -> &FleetKey;
    fn settings(&self) -> &Settings;
    fn stats(&self) -> &Stats;
    /// Where this gateway's consumer has read to: past everything it has
    /// applied. `None` off the bus (starting, or following the WAL itself).
    fn mark(&self) -> Option<Mark>;
    /// Where this gateway's consumer has passed entries on to, once the
    /// applier has applied everything passed on before it (see the module
    /// doc, step 2); `None` off the bus, or if the applier does not get
    /// there within a few seconds.
    fn settled(&self) -> BoxFuture<'_, Option<Mark>>;
    /// Snapshots published before this (Unix milliseconds) are not used:
    /// the primary's position went back within its epoch since (see
    /// `feed::bus::cursor`). 0: none.
    fn not_before_ms(&self) -> u64;
    /// Keeps `stored` as the newest snapshot of `resource` on its stream;
    /// older ones past `bus.snapshot_keep` are deleted.
    fn put<'a>(
        &'a self,
        resource: &'a str,
        stored: &'a Stored,
    ) -> BoxFuture<'a, Result<(), SnapshotError>>;
    /// The manifests of `resource` on `stream`, newest first.
    fn manifests<'a>(
        &'a self,
        stream: &'a str,
        resource: &'a str,
    ) -> BoxFuture<'a, Result<Vec<Vec<u8>>, SnapshotError>>;
    /// The chunks of the snapshot `nonce` (`n` of them); `None` if it is
    /// gone (deleted since its manifest was read).
    fn chunks<'a>(
        &'a self,
        stream: &'a str,
        resource: &'a str,
        nonce: &'a str,
        n: u32,
    ) -> BoxFuture<'a, Result<Option<Vec<Vec<u8>>>, SnapshotError>>;
    /// Takes slot `slot` of `resource`'s scans on `stream` for `ttl`:
    /// `Some(token)` when it was free.
    fn lease<'a>(
        &'a self,
        stream: &'a str,
        resource: &'a str,
        slot: u32,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Option<String>, SnapshotError>>;
    /// Extends a lease held (`false`: it was lost).
    fn renew<'a>(
        &'a self,
        lease: &'a Lease,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<bool, SnapshotError>>;
    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, ()>;
    /// The catalog state of the watched table `table` now: its storage
    /// (the `relfilenode` of the table or of each leaf partition), its
    /// served columns' types and places, and the feed's dependency on it
    /// (its publication entry's row versions). A rewrite, a partition
    /// attached or detached, a table replaced, or a publication edited
    /// changes rows no stream entry names; such a change between a
    /// snapshot's scan and its use makes the snapshot wrong, and this is
    /// how it is seen, whether or not any feed was running to see it.
    fn catalog<'a>(&'a self, table: &'a str) -> BoxFuture<'a, Result<String, SnapshotError>>;
    /// The newest place of `stream`.
    fn head<'a>(&'a self, stream: &'a str) -> BoxFuture<'a, Result<Mark, SnapshotError>>;
    /// Whether the stream continues from `at`: its next entry names `at`
    /// as its predecessor, or `at` is the newest.
    fn continues<'a>(&'a self, at: &'a Mark) -> BoxFuture<'a, Result<bool, SnapshotError>>;
}

/// A slot of a resource's scans, held.
#[derive(Clone, Debug)]
pub struct Lease {
    pub stream: String,
    pub resource: String,
    pub slot: u32,
    pub token: String,
}

/// `bus.snapshot_wait`, `bus.max_parallel_scans`, `bus.snapshot_keep`.
#[derive(Clone, Debug)]
pub struct Settings {
    pub wait: Duration,
    pub max_parallel_scans: u32,
    pub keep: u32,
}

/// What the fleet's snapshots did on this gateway (`/metrics`).
#[derive(Debug, Default)]
pub struct Stats {
    /// Snapshots this gateway published.
    pub published: AtomicU64,
    /// Filters this gateway loaded from a snapshot instead of scanning.
    pub loaded: AtomicU64,
    /// Scans this gateway made as the fleet's one scan (it held slot 0).
    pub scans_for_fleet: AtomicU64,
    /// Scans it made by itself: no snapshot within `bus.snapshot_wait`.
    pub scans_after_wait: AtomicU64,
    /// Scans made without the bus: Redis or the catalog did not answer,
    /// or this gateway was off the bus (following the WAL itself).
    pub scans_without_bus: AtomicU64,
    /// Snapshots refused, each once (forged, damaged, another fleet key,
    /// an impossible manifest, gone mid-read).
    pub unusable: AtomicU64,
    /// Scans made because the snapshot loaded holds far fewer keys than
    /// the filter it would replace (`filter.max_shrink`).
    pub scans_after_refusal: AtomicU64,
    /// Publishes that failed (Redis refused, or a gap made the set unfit).
    pub publish_failed: AtomicU64,
    /// Bytes of the last snapshot published.
    pub last_bytes: AtomicU64,
}

impl Stats {
    pub fn count(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }

    pub fn totals(&self) -> Totals {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Totals {
            published: l(&self.published),
            loaded: l(&self.loaded),
            scans_for_fleet: l(&self.scans_for_fleet),
            scans_after_wait: l(&self.scans_after_wait),
            scans_without_bus: l(&self.scans_without_bus),
            scans_after_refusal: l(&self.scans_after_refusal),
            unusable: l(&self.unusable),
            publish_failed: l(&self.publish_failed),
            last_bytes: l(&self.last_bytes),
        }
    }
}

/// [`Stats`] read together (`/metrics`, the admin API).
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Totals {
    pub published: u64,
    pub loaded: u64,
    pub scans_for_fleet: u64,
    pub scans_after_wait: u64,
    pub scans_without_bus: u64,
    pub scans_after_refusal: u64,
    pub unusable: u64,
    pub publish_failed: u64,
    pub last_bytes: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::filter::{Item, KeyKind, KeySetBuilder, Mode};

    fn fleet() -> FleetKey {
        FleetKey::from_bytes(&[b'f'; 32]).unwrap()
    }

    fn base(resource: &str) -> Manifest {
        Manifest {
            format: 0,
            resource: resource.into(),
            shape: shape(&["users".into(), "id bigint".into()]),
            catalog: "16384|id:1:20:-1".into(),
            key_id: String::new(),
            at: Mark {
                stream: "bg:1:db:abc:tl1:s1".into(),
                lsn: 100,
                seq: 0,
            },
            nonce: String::new(),
            kind: String::new(),
            keys: 0,
            rows: 0,
            max_int: i64::MIN,
            plain_bytes: 0,
            sealed_bytes: 0,
            chunks: 0,
            published_ms: 0,
            by: "test".into(),
        }
    }

    fn built(mode: Mode, kind: KeyKind, key: &BuildKey, items: &[Vec<u8>]) -> KeySet {
        let mut b = KeySetBuilder::new(mode, kind, 10_000, 0.01, key.filter.clone()).unwrap();
        for (i, it) in items.iter().enumerate() {
            match kind {
                KeyKind::Int => b.insert(Item::Int(i as i64 * 3)),
                KeyKind::Bytes => b.insert(Item::Bytes(it)),
            }
        }
        b.finish()
    }

    #[test]
    fn a_published_filter_opens_holding_every_key() {
        for (mode, kind) in [(Mode::Bloom, KeyKind::Bytes), (Mode::Exact, KeyKind::Int)] {
            let key = BuildKey::new(&fleet());
            let items: Vec<Vec<u8>> = (0..5000u32).map(|i| format!("k{i}").into_bytes()).collect();
            let set = built(mode, kind, &key, &items);
            let stored = publishable(&fleet(), &key, base("users"), &set);
            let opened = open(&fleet(), stored, "users", &base("users").shape).unwrap();
            assert_eq!(opened.manifest.at, base("users").at);
            for (i, it) in items.iter().enumerate() {
                let item = match kind {
                    KeyKind::Int => Item::Int(i as i64 * 3),
                    KeyKind::Bytes => Item::Bytes(it),
                };
                assert!(opened.set.contains(item), "{mode:?} lost key {i}");
            }
        }
    }

    #[test]
    fn a_snapshot_of_another_resource_shape_or_fleet_is_not_used() {
        let key = BuildKey::new(&fleet());
        let set = built(Mode::Bloom, KeyKind::Bytes, &key, &[b"a".to_vec()]);
        let stored = || publishable(&fleet(), &key, base("users"), &set);
        let s = base("users").shape;
        assert!(matches!(
            open(&fleet(), stored(), "articles", &s),
            Err(Unusable::Other)
        ));
        assert!(matches!(
            open(&fleet(), stored(), "users", "other"),
            Err(Unusable::Other)
        ));
        let other = FleetKey::from_bytes(&[b'g'; 32]).unwrap();
        assert!(matches!(
            open(&other, stored(), "users", &s),
            Err(Unusable::Seal(_))
        ));
    }

    #[test]
    fn a_manifest_moved_to_another_position_or_stream_does_not_open() {
        let key = BuildKey::new(&fleet());
        let set = built(Mode::Bloom, KeyKind::Bytes, &key, &[b"a".to_vec()]);
        let s = base("users").shape;
        for edit in [
            |m: &mut Manifest| m.at.lsn += 1,
            |m: &mut Manifest| m.at.stream.push('x'),
            |m: &mut Manifest| m.keys += 1,
        ] {
            let mut stored = publishable(&fleet(), &key, base("users"), &set);
            let mut m = manifest(&stored.manifest).unwrap();
            edit(&mut m);
            stored.manifest = serde_json::to_vec(&m).unwrap();
            assert!(matches!(
                open(&fleet(), stored, "users", &s),
                Err(Unusable::Seal(_))
            ));
        }
    }

    #[test]
    fn a_redis_reader_cannot_compute_the_filter_key() {
        // What Redis holds names the nonce; the key needs the fleet key too.
        let key = BuildKey::new(&fleet());
        let guess = FilterKey::from_bytes(key.nonce.0.repeat(2).try_into().unwrap());
        assert_ne!(guess.fingerprint(), key.filter.fingerprint());
        let set = built(Mode::Bloom, KeyKind::Bytes, &key, &[b"a".to_vec()]);
        let stored = publishable(&fleet(), &key, base("users"), &set);
        let text = String::from_utf8_lossy(&stored.manifest);
        assert!(!text.contains(&format!("{:016x}", key.filter.fingerprint())));
    }

    #[test]
    fn marks_compare_on_one_stream_only() {
        let m = |s: &str, lsn, seq| Mark {
            stream: s.into(),
            lsn,
            seq,
        };
        assert!(m("a", 5, 0).reaches(&m("a", 5, 0)));
        assert!(m("a", 5, 1).reaches(&m("a", 5, 0)));
        assert!(m("a", 6, 0).reaches(&m("a", 5, 9)));
        assert!(!m("a", 4, 9).reaches(&m("a", 5, 0)));
        assert!(!m("b", 9, 0).reaches(&m("a", 5, 0)));
    }
}
