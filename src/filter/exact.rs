//! Exact set of 64-bit integer keys: an immutable roaring treemap plus a small
//! concurrent delta.
//!
//! # Scheme
//! * `base`: an immutable [`RoaringTreemap`] behind an [`ArcSwap`]. Readers
//!   load it without locks; it is replaced, never mutated.
//! * `delta`: keys inserted since the last compaction, in a
//!   `RwLock<HashSet<u64>>`. Inserts take the write lock for one hash-set
//!   insert; readers take the read lock only when `pending > 0`, so a set
//!   with no live inserts costs readers nothing beyond the bitmap probe.
//! * `frozen`: during compaction, the delta being merged.
//! * Compaction (when the delta outgrows `max(4096, base bytes / 64)` entries,
//!   so the amortised merge cost is ≤ 64 bytes copied per insert): under the
//!   delta write lock, move the delta into `frozen` (O(1)); outside any lock,
//!   build `base ∪ frozen` and publish it; then clear `frozen`, then subtract
//!   the merged count from `pending`.
//!
//! # Why readers never miss a key
//! A reader checks `delta`, then `frozen`, then `base`, in that order, and the
//! compactor publishes in the opposite order: a key leaves `delta` only after
//! it is in `frozen` (same critical section), and leaves `frozen` only after
//! the new `base` containing it is published. Each step is a release store
//! that the reader's next acquire load synchronises with, so whichever
//! structure a reader finds the key missing from, it finds it in the next.
//! The `pending == 0` shortcut is safe for the same reason: `pending` drops
//! only after the base holding those keys is published. Readers never wait
//! for a compaction; they wait at most for one `HashSet::insert` or one
//! `mem::take` under the write lock.
//!
//! # Guarantees
//! * No false positives, no false negatives: `contains(x)` is true iff an
//!   `insert(x)` happened-before it or ran concurrently with it (the latter
//!   may go either way).
//! * Memory: roaring's compressed size (≈ 2 bits/key or far less for dense
//!   ids after run compression, up to ≈ 20+ bytes/key for sparse random u64s)
//!   plus the delta, which compaction keeps below ~1/64 of the base's bytes
//!   (or 4096 entries).

use std::collections::HashSet;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use arc_swap::ArcSwap;
use roaring::RoaringTreemap;

use super::codec::{self, Layout, Reader};
use super::{FilterError, FilterStats, Item};

/// Minimum delta size that triggers compaction.
const MIN_COMPACT_ENTRIES: usize = 4096;

/// Maps an i64 key to the u64 domain of the set, preserving order (flip the
/// sign bit), so negative keys and ranges stay contiguous in the bitmap.
#[inline]
pub fn encode_i64(v: i64) -> u64 {
    (v as u64) ^ (1 << 63)
}

/// Inverse of [`encode_i64`].
#[inline]
pub fn decode_i64(v: u64) -> i64 {
    (v ^ (1 << 63)) as i64
}

/// Heap bytes of one high-32 bucket of a treemap beyond its containers: its
/// share of the `BTreeMap` node that holds it (a 4-byte key and a 24-byte
/// `RoaringBitmap`, nodes of 11 about two-thirds full) and the allocation
/// rounding of its container vector. Calibrated against a counting
/// allocator (`tests/memory.rs`).
const BUCKET_BYTES: u64 = 64;
/// Heap bytes of one container's entry in its bucket's vector (its 2-byte
/// key and its store's enum), at least four of them per vector: the
/// smallest capacity a `Vec` of them grows to.
const CONTAINER_BYTES: u64 = 32;

/// What `map` holds on the heap, estimated from roaring's count of its
/// containers plus the structure around them. Not its serialised size: for
/// sparse 64-bit ids, one key per bucket, that is a tenth of the heap
/// (`tests/memory.rs` checks this estimate within a quarter). Buffers are
/// counted from the values, not roaring 0.12's `n_bytes_*`, which counts an
/// array's `u16`s as `u32`s and a bitset's capacity in bits.
pub fn heap_bytes(map: &RoaringTreemap) -> u64 {
    map.bitmaps()
        .map(|(_, b)| {
            let s = b.statistics();
            BUCKET_BYTES
                + CONTAINER_BYTES * u64::from(s.n_containers.max(4))
                + 2 * u64::from(s.n_values_array_containers)
                + 8192 * u64::from(s.n_bitset_containers)
                + s.n_bytes_run_containers
        })
        .sum()
}

/// Exact concurrent set of u64 keys; see the module docs.
pub struct ExactSet {
    base: ArcSwap<RoaringTreemap>,
    /// Heap bytes of the current base ([`heap_bytes`]), cached for the
    /// compaction threshold and the size metric.
    base_bytes: AtomicU64,
    delta: RwLock<HashSet<u64>>,
    frozen: ArcSwap<HashSet<u64>>,
    /// Keys in `delta` plus `frozen`; 0 lets readers skip both.
    pending: AtomicU64,
    compacting: Mutex<()>,
}

impl Default for ExactSet {
    fn default() -> Self {
        Self::from_treemap(RoaringTreemap::new())
    }
}

impl ExactSet {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// A set whose base is `map` (run-compressed first).
    pub fn from_treemap(mut map: RoaringTreemap) -> Self {
        map.optimize();
        let bytes = heap_bytes(&map);
        ExactSet {
            base: ArcSwap::from_pointee(map),
            base_bytes: AtomicU64::new(bytes),
            delta: RwLock::new(HashSet::new()),
            frozen: ArcSwap::from_pointee(HashSet::new()),
            pending: AtomicU64::new(0),
            compacting: Mutex::new(()),
        }
    }

    /// Whether `v` is in the set. Never blocks on compaction.
    #[inline]
    pub fn contains(&self, v: u64) -> bool {
        // Order matters: delta, frozen, base (see module docs).
        if self.pending.load(Ordering::Acquire) != 0 {
            if read(&self.delta).contains(&v) {
                return true;
            }
            if self.frozen.load().contains(&v) {
                return true;
            }
        }
        self.base.load().contains(v)
    }

    /// Adds `v`; returns whether it was newly added. Safe to call
    /// concurrently with readers and other writers.
    pub fn insert(&self, v: u64) -> bool {
        if self.base.load().contains(v) {
            return false;
        }
        let delta_len = {
            let mut delta = write(&self.delta);
            if !delta.insert(v) {
                return false;
            }
            // Inside the lock so `pending` never under-counts the delta.
            self.pending.fetch_add(1, Ordering::AcqRel);
            delta.len()
        };
        let threshold = (self.base_bytes.load(Ordering::Relaxed) / 64) as usize;
        if delta_len >= threshold.max(MIN_COMPACT_ENTRIES) {
            // One compactor at a time; others just keep filling the delta.
            if let Ok(_guard) = self.compacting.try_lock() {
                self.compact_locked();
            }
        }
        true
    }

    /// Store `item`: Int keys are encoded with [`encode_i64`]; Bytes keys
    /// cannot be represented and are not stored (returns false). That is safe
    /// because [`contains_item`](Self::contains_item) answers true for every
    /// Bytes key (fail open).
    pub fn insert_item(&self, item: Item<'_>) -> bool {
        match item {
            Item::Int(v) => self.insert(encode_i64(v)),
            Item::Bytes(_) => false,
        }
    }

    /// Lookup for `item`; Bytes keys always answer true (fail open, never a
    /// false negative: an exact integer set cannot know about them).
    #[inline]
    pub fn contains_item(&self, item: Item<'_>) -> bool {
        match item {
            Item::Int(v) => self.contains(encode_i64(v)),
            Item::Bytes(_) => true,
        }
    }

    /// Merges the delta into a new base now (also done automatically).
    pub fn compact(&self) {
        let _guard = self.compacting.lock().unwrap_or_else(|e| e.into_inner());
        self.compact_locked();
    }

    fn compact_locked(&self) {
        let taken = {
            let mut delta = write(&self.delta);
            if delta.is_empty() {
                return;
            }
            let taken = Arc::new(std::mem::take(&mut *delta));
            // Published before the lock is released: a reader that sees the
            // key gone from `delta` then finds it in `frozen`.
            self.frozen.store(taken.clone());
            taken
        };
        let mut next = RoaringTreemap::clone(&self.base.load());
        for &v in taken.iter() {
            next.insert(v);
        }
        next.optimize();
        self.base_bytes.store(heap_bytes(&next), Ordering::Relaxed);
        self.base.store(Arc::new(next));
        self.frozen.store(Arc::new(HashSet::new()));
        self.pending.fetch_sub(taken.len() as u64, Ordering::AcqRel);
    }

    /// A consistent copy of the whole set.
    pub fn snapshot(&self) -> RoaringTreemap {
        // Same order as readers, so a key moving between structures
        // mid-snapshot is still seen in one of them.
        let delta: Vec<u64> = read(&self.delta).iter().copied().collect();
        let frozen = self.frozen.load_full();
        let mut map = RoaringTreemap::clone(&self.base.load());
        map.extend(delta);
        map.extend(frozen.iter().copied());
        map
    }

    /// Number of keys. Exact, but O(delta) (it deduplicates the delta against
    /// the base).
    pub fn len(&self) -> u64 {
        if self.pending.load(Ordering::Acquire) == 0 {
            return self.base.load().len();
        }
        self.snapshot().len()
    }

    /// Whether the set is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Approximate heap bytes: the base's ([`heap_bytes`]) plus 16 bytes per
    /// delta entry.
    pub fn size_in_bytes(&self) -> u64 {
        self.base_bytes.load(Ordering::Relaxed) + 16 * self.pending.load(Ordering::Relaxed)
    }

    /// Metrics snapshot. `fill_ratio` is the key density over the occupied
    /// range, `len / (max - min + 1)` (1.0 = perfectly dense ids), which is
    /// what decides whether the bitmap stays small.
    pub fn stats(&self) -> FilterStats {
        let map = self.snapshot();
        let len = map.len();
        let bytes = heap_bytes(&map) + 16 * self.pending.load(Ordering::Relaxed);
        let fill_ratio = match (map.min(), map.max()) {
            (Some(lo), Some(hi)) => len as f64 / ((hi - lo) as f64 + 1.0),
            _ => 0.0,
        };
        FilterStats {
            kind: "exact",
            bits: bytes * 8,
            bytes,
            hashes: 0,
            keys: len,
            fill_ratio,
            estimated_fp_rate: 0.0,
            estimated_cardinality: len as f64,
            key_fingerprint: None,
        }
    }

    /// Serialises the set (see [`super::codec`]).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut map = self.snapshot();
        map.optimize();
        let size = map.serialized_size() as u64;
        let mut out = codec::header(Layout::ExactRoaringTreemap, size + 16);
        out.extend_from_slice(&map.len().to_le_bytes());
        out.extend_from_slice(&size.to_le_bytes());
        map.serialize_into(&mut out)
            .expect("writing to a Vec cannot fail");
        codec::seal(out)
    }

    /// Inverse of [`to_bytes`](Self::to_bytes).
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, FilterError> {
        let (layout, mut r) = codec::open(bytes)?;
        if layout != Layout::ExactRoaringTreemap {
            return Err(FilterError::Corrupt("not an exact set"));
        }
        Self::decode_body(&mut r)
    }

    pub(crate) fn decode_body(r: &mut Reader<'_>) -> Result<Self, FilterError> {
        let len = r.u64()?;
        let size = r.u64()?;
        let payload = r.take_exact(size)?;
        // roaring's checked decoder bounds every allocation by what it reads
        // from the slice, and validates container invariants.
        let mut payload_reader = payload;
        let map = RoaringTreemap::deserialize_from(&mut payload_reader)
            .map_err(|_| FilterError::Corrupt("invalid roaring payload"))?;
        if !payload_reader.is_empty() {
            return Err(FilterError::Corrupt("trailing bytes after roaring payload"));
        }
        if map.len() != len {
            return Err(FilterError::Corrupt("key count does not match payload"));
        }
        Ok(Self::from_treemap(map))
    }
}

impl fmt::Debug for ExactSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExactSet")
            .field("base_keys", &self.base.load().len())
            .field("pending", &self.pending.load(Ordering::Relaxed))
            .finish()
    }
}

// A poisoned lock only means another thread panicked mid-insert; a HashSet
// insert either happened or not, so the data is still valid — keep serving.
fn read(l: &RwLock<HashSet<u64>>) -> std::sync::RwLockReadGuard<'_, HashSet<u64>> {
    l.read().unwrap_or_else(|e| e.into_inner())
}
fn write(l: &RwLock<HashSet<u64>>) -> std::sync::RwLockWriteGuard<'_, HashSet<u64>> {
    l.write().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn i64_encoding_preserves_order_and_round_trips() {
        let vals = [i64::MIN, -2, -1, 0, 1, 2, i64::MAX];
        for w in vals.windows(2) {
            assert!(encode_i64(w[0]) < encode_i64(w[1]));
        }
        for v in vals {
            assert_eq!(decode_i64(encode_i64(v)), v);
        }
    }

    #[test]
    fn exact_membership_with_and_without_delta() {
        let s = ExactSet::new();
        for v in (0..10_000u64).step_by(3) {
            assert!(s.insert(v));
            assert!(!s.insert(v), "duplicate reported new");
        }
        for v in 0..10_000u64 {
            assert_eq!(s.contains(v), v % 3 == 0, "v = {v}");
        }
        assert_eq!(s.len(), 3334);
        s.compact();
        assert_eq!(s.pending.load(Ordering::Relaxed), 0);
        for v in 0..10_000u64 {
            assert_eq!(s.contains(v), v % 3 == 0, "after compaction v = {v}");
        }
        assert_eq!(s.len(), 3334);
    }

    #[test]
    fn automatic_compaction_bounds_the_delta() {
        let s = ExactSet::new();
        for v in 0..50_000u64 {
            s.insert(v * 7);
        }
        assert!(
            (s.pending.load(Ordering::Relaxed) as usize) < MIN_COMPACT_ENTRIES,
            "delta never compacted"
        );
        assert_eq!(s.len(), 50_000);
        assert!((0..50_000u64).all(|v| s.contains(v * 7)));
    }

    #[test]
    fn bytes_items_fail_open() {
        let s = ExactSet::new();
        assert!(!s.insert_item(Item::Bytes(b"abc")));
        assert!(s.contains_item(Item::Bytes(b"never inserted")));
        assert!(s.insert_item(Item::Int(-5)));
        assert!(s.contains_item(Item::Int(-5)));
        assert!(!s.contains_item(Item::Int(5)));
    }

    #[test]
    fn dense_ids_are_tiny() {
        let mut map = RoaringTreemap::new();
        map.insert_range(1..=1_000_000);
        let s = ExactSet::from_treemap(map);
        let st = s.stats();
        assert_eq!(st.keys, 1_000_000);
        assert!(st.bytes < 1_000, "{} bytes", st.bytes);
        assert!((st.fill_ratio - 1.0).abs() < 1e-12);
        assert_eq!(st.estimated_fp_rate, 0.0);
    }

    #[test]
    fn round_trip_keeps_delta_and_rejects_bad_counts() {
        let s = ExactSet::new();
        s.insert(5);
        s.insert(u64::MAX);
        s.insert(1 << 40);
        let bytes = s.to_bytes();
        let t = ExactSet::from_bytes(&bytes).unwrap();
        assert_eq!(t.len(), 3);
        assert!(t.contains(5) && t.contains(u64::MAX) && t.contains(1 << 40));
        assert!(!t.contains(6));
        assert_eq!(t.to_bytes(), bytes);
    }
}
