//! Cache-line-blocked Bloom filter on secret-keyed HighwayHash.
//!
//! # Layout
//! The bit array is a sequence of 512-bit blocks, each one 64-byte-aligned
//! cache line of eight `AtomicU64`. A key's 128-bit hash `[h0, h1]` picks
//!
//! * the block by multiply-high range reduction, `(h0 · num_blocks) >> 64`
//!   (uniform for any block count, no `%`, no power-of-two rounding, exact in
//!   u128 so it is correct far past 2^32 bits);
//! * k positions inside the block as the top 9 bits of `h1 · C_i` for fixed
//!   odd constants `C_0 = 1, C_i = M^i`. Multiplication by an odd constant is a
//!   bijection on u64 whose high bits depend on every bit of `h1`, so the k
//!   positions behave like independent uniform draws, which is what the sizing
//!   model assumes. (Plain double hashing `(a + i·b) mod 512` was rejected:
//!   with only 512·256 distinct (a, b) patterns, a query whose `b` equals a
//!   stored key's `b` and whose `a` is a few strides away shares most of its
//!   bits with that key, which adds ≈ 5e-4 to the FP rate at 15 bits/key —
//!   half of p = 0.001.)
//!
//! So a lookup is one hash and one cache-line access.
//!
//! # Guarantees
//! * **No false negatives**: `contains(x)` is true for every `x` whose
//!   `insert(x)` happens-before the `contains` call (program order, thread
//!   join, any release/acquire pair). Bits are only ever set, never cleared.
//! * **Concurrency**: `insert` takes `&self` and is lock-free (`fetch_or` on
//!   the touched words only); lookups may run concurrently with it.
//!   `Relaxed` ordering suffices: the only property needed is that a set bit
//!   stays visible to anyone who synchronised with the inserter, and per-word
//!   coherence gives that.
//! * **False positives**: at the sized-for key count the FP rate is at most
//!   `p` under the model in [`super::sizing`] (verified by measurement in the
//!   tests: within [0.5p, 1.1p] at 1M keys for p = 1 % and 0.1 %). Inserting
//!   more keys than sized for raises it smoothly; see
//!   [`BloomFilter::estimated_fp_rate`].
//! * **Flooding resistance**: positions depend on a secret key; keys that
//!   collide under one key pass a filter with another key at the normal rate.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

use super::codec::{self, Layout, Reader};
use super::hash::FilterKey;
use super::sizing::{self, BLOCK_BITS, MAX_BLOCKS, MAX_HASHES, MIN_HASHES};
use super::{FilterError, FilterStats};

/// Words per block.
const WORDS: usize = (BLOCK_BITS / 64) as usize;

/// Multipliers `M^i` deriving position i from `h1`. `M` is an odd constant
/// with well-mixed bits (the 64-bit golden-ratio constant).
const POSITION_MULTIPLIERS: [u64; MAX_HASHES as usize] = {
    const M: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut out = [1u64; MAX_HASHES as usize];
    let mut i = 1;
    while i < out.len() {
        out[i] = out[i - 1].wrapping_mul(M);
        i += 1;
    }
    out
};

/// One cache line of filter bits.
#[repr(C, align(64))]
#[derive(Default)]
pub(crate) struct Block([AtomicU64; WORDS]);

/// A cache-line-blocked Bloom filter; see the module docs for its guarantees.
pub struct BloomFilter {
    blocks: Box<[Block]>,
    num_hashes: u32,
    /// Number of insert calls (not distinct keys): an input to the metrics,
    /// not to correctness.
    inserted: AtomicU64,
    key: FilterKey,
}

impl BloomFilter {
    /// A filter for `expected` keys at false-positive rate `p`, sized by
    /// [`sizing::size_blocked`]. Allocates once; the size never changes.
    pub fn new(expected: u64, p: f64, key: FilterKey) -> Result<Self, FilterError> {
        let s = sizing::size_blocked(expected, p)?;
        Self::with_shape(s.num_blocks, s.num_hashes, key)
    }

    /// A filter with an explicit shape (`num_blocks` ≥ 1, `num_hashes` in
    /// `[1, 16]`), for tests and tools that need a particular size.
    pub fn with_shape(
        num_blocks: u64,
        num_hashes: u32,
        key: FilterKey,
    ) -> Result<Self, FilterError> {
        if num_blocks == 0 || num_blocks > MAX_BLOCKS {
            return Err(FilterError::TooLarge {
                keys: 0,
                max_bits: sizing::MAX_BITS,
            });
        }
        if !(MIN_HASHES..=MAX_HASHES).contains(&num_hashes) {
            return Err(FilterError::Corrupt("number of hashes out of range"));
        }
        Ok(BloomFilter {
            blocks: alloc_blocks(num_blocks)?,
            num_hashes,
            inserted: AtomicU64::new(0),
            key,
        })
    }

    /// The keyed 128-bit hash this filter uses for `data`.
    #[inline]
    pub fn hash(&self, data: &[u8]) -> [u64; 2] {
        self.key.hash128(data)
    }

    /// Adds `data`; returns whether any bit was newly set (false for a key
    /// already present, or one whose bits other keys had all set: neither
    /// raises the false-positive rate). Lock-free; safe while other threads
    /// insert and query.
    #[inline]
    pub fn insert(&self, data: &[u8]) -> bool {
        self.insert_hash(self.hash(data))
    }

    /// Whether `data` may be in the set (false means definitely absent).
    #[inline]
    pub fn contains(&self, data: &[u8]) -> bool {
        self.contains_hash(self.hash(data))
    }

    /// [`insert`](Self::insert) with a hash from [`hash`](Self::hash).
    #[inline]
    pub fn insert_hash(&self, h: [u64; 2]) -> bool {
        let (block, mask) = self.locate(h);
        let mut changed = false;
        for (word, m) in block.0.iter().zip(mask) {
            // Skipping words whose bits are already set avoids a locked RMW
            // (and a cache-line ownership transfer between cores) for the
            // common case of re-inserting a present key.
            if m != 0 && word.load(Ordering::Relaxed) & m != m {
                // The previous value says whether this call set a bit (two
                // racing inserts of one key may both report a change).
                changed |= word.fetch_or(m, Ordering::Relaxed) & m != m;
            }
        }
        self.inserted.fetch_add(1, Ordering::Relaxed);
        changed
    }

    /// [`contains`](Self::contains) with a hash from [`hash`](Self::hash).
    #[inline]
    pub fn contains_hash(&self, h: [u64; 2]) -> bool {
        let (block, mask) = self.locate(h);
        // Branch-free over the whole line: for absent keys an early exit would
        // mispredict about half the time, which costs more than 8 ANDs.
        let mut missing = 0u64;
        for (word, m) in block.0.iter().zip(mask) {
            missing |= m & !word.load(Ordering::Relaxed);
        }
        missing == 0
    }

    /// Builder insert with software pipelining: prefetches this key's block
    /// and applies the insert queued [`PIPELINE_DEPTH`] calls ago. Hashing a
    /// key takes long enough that the out-of-order window otherwise holds
    /// only one or two cache misses, leaving a streaming build bound by
    /// serial DRAM latency (measured: ~3x slower at 10M keys). Queued inserts
    /// are not visible until [`flush`](Self::flush); only the builder, which
    /// owns the filter exclusively and flushes before handing it out, uses
    /// this.
    #[inline]
    pub(crate) fn insert_hash_pipelined(&mut self, h: [u64; 2], pipe: &mut InsertPipeline) {
        let idx = block_index(h[0], self.blocks.len() as u64);
        prefetch(&self.blocks[idx]);
        let slot = &mut pipe.slots[pipe.next];
        if pipe.filled == PIPELINE_DEPTH {
            let (old_idx, old_h1) = *slot;
            self.apply_mut(old_idx, old_h1);
        } else {
            pipe.filled += 1;
        }
        *slot = (idx, h[1]);
        pipe.next = (pipe.next + 1) % PIPELINE_DEPTH;
        *self.inserted.get_mut() += 1;
    }

    /// Applies every insert queued by
    /// [`insert_hash_pipelined`](Self::insert_hash_pipelined).
    pub(crate) fn flush(&mut self, pipe: &mut InsertPipeline) {
        for &(idx, h1) in &pipe.slots[..pipe.filled] {
            self.apply_mut(idx, h1);
        }
        *pipe = InsertPipeline::default();
    }

    #[inline]
    fn apply_mut(&mut self, idx: usize, h1: u64) {
        let mask = block_mask(h1, self.num_hashes);
        for (word, m) in self.blocks[idx].0.iter_mut().zip(mask) {
            *word.get_mut() |= m;
        }
    }

    /// Overrides the insert counter (the builder counts calls itself).
    pub(crate) fn set_inserted(&mut self, n: u64) {
        *self.inserted.get_mut() = n;
    }

    #[inline]
    fn locate(&self, h: [u64; 2]) -> (&Block, [u64; WORDS]) {
        let idx = block_index(h[0], self.blocks.len() as u64);
        (&self.blocks[idx], block_mask(h[1], self.num_hashes))
    }

    /// Number of 512-bit blocks.
    pub fn num_blocks(&self) -> u64 {
        self.blocks.len() as u64
    }
    /// Total bits.
    pub fn num_bits(&self) -> u64 {
        self.num_blocks() * BLOCK_BITS
    }
    /// Bit positions per key.
    pub fn num_hashes(&self) -> u32 {
        self.num_hashes
    }
    /// Number of insert calls so far (duplicates counted).
    pub fn inserted(&self) -> u64 {
        self.inserted.load(Ordering::Relaxed)
    }
    /// Fingerprint of the hash key (safe to log).
    pub fn key_fingerprint(&self) -> u64 {
        self.key.fingerprint()
    }

    /// Number of set bits. O(bits/64): a scan of the whole array.
    pub fn count_ones(&self) -> u64 {
        self.blocks
            .iter()
            .flat_map(|b| b.0.iter())
            .map(|w| u64::from(w.load(Ordering::Relaxed).count_ones()))
            .sum()
    }

    /// Fraction of set bits.
    pub fn fill_ratio(&self) -> f64 {
        self.count_ones() as f64 / self.num_bits() as f64
    }

    /// FP rate estimated from the fill ratio: `fill^k`. First-order only: it
    /// treats bits as uniformly filled, while blocks fill unevenly, so it
    /// reads ~10–20 % low for the blocked layout; it is for trend monitoring
    /// (e.g. alert when it doubles), not for guarantees.
    pub fn estimated_fp_rate(&self) -> f64 {
        self.fill_ratio().powi(self.num_hashes as i32)
    }

    /// Estimated number of distinct keys from the fill ratio: Swamidass–Baldi
    /// `-(m/k)·ln(1 - X/m)`, with the per-key occupancy of a 512-bit block,
    /// `512·(1 - (1-1/512)^k)`, in place of k (the two agree as blocks grow;
    /// this removes a ≈(k-1)/1024 underestimate). A saturated filter would
    /// give infinity; it is capped at X = m - ½ so the value stays finite.
    pub fn estimated_cardinality(&self) -> f64 {
        let m = self.num_bits() as f64;
        let x = (self.count_ones() as f64).min(m - 0.5);
        let per_key = BLOCK_BITS as f64
            * (1.0 - (1.0 - 1.0 / BLOCK_BITS as f64).powi(self.num_hashes as i32));
        -(m / per_key) * (1.0 - x / m).ln()
    }

    /// Metrics snapshot (one scan of the bit array).
    pub fn stats(&self) -> FilterStats {
        let ones = self.count_ones();
        let bits = self.num_bits();
        let fill = ones as f64 / bits as f64;
        FilterStats {
            kind: "bloom",
            bits,
            bytes: bits / 8,
            hashes: self.num_hashes,
            keys: self.inserted(),
            fill_ratio: fill,
            estimated_fp_rate: fill.powi(self.num_hashes as i32),
            estimated_cardinality: self.estimated_cardinality(),
            key_fingerprint: Some(self.key_fingerprint()),
        }
    }

    /// Serialises the filter (see [`super::codec`] for the format). Contains
    /// the key's fingerprint, never the key.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = codec::header(Layout::BloomBlocked512, self.num_bits() / 8 + 32);
        out.extend_from_slice(&self.num_blocks().to_le_bytes());
        out.extend_from_slice(&self.num_hashes.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(&self.inserted().to_le_bytes());
        out.extend_from_slice(&self.key_fingerprint().to_le_bytes());
        for word in self.blocks.iter().flat_map(|b| b.0.iter()) {
            out.extend_from_slice(&word.load(Ordering::Relaxed).to_le_bytes());
        }
        codec::seal(out)
    }

    /// Inverse of [`to_bytes`](Self::to_bytes). `key` must be the key the
    /// filter was built with (checked by fingerprint: [`FilterError::WrongKey`]).
    pub fn from_bytes(bytes: &[u8], key: &FilterKey) -> Result<Self, FilterError> {
        let (layout, mut r) = codec::open(bytes)?;
        if layout != Layout::BloomBlocked512 {
            return Err(FilterError::Corrupt("not a bloom filter"));
        }
        Self::decode_body(&mut r, key)
    }

    pub(crate) fn decode_body(r: &mut Reader<'_>, key: &FilterKey) -> Result<Self, FilterError> {
        let num_blocks = r.u64()?;
        let num_hashes = r.u32()?;
        let _reserved = r.u32()?;
        let inserted = r.u64()?;
        let fingerprint = r.u64()?;
        if num_blocks == 0 || num_blocks > MAX_BLOCKS {
            return Err(FilterError::Corrupt("block count out of range"));
        }
        if !(MIN_HASHES..=MAX_HASHES).contains(&num_hashes) {
            return Err(FilterError::Corrupt("number of hashes out of range"));
        }
        // Check the declared size against the actual input before
        // allocating, so hostile input cannot request a huge allocation.
        let payload = r.take_exact(num_blocks * BLOCK_BITS / 8)?;
        if fingerprint != key.fingerprint() {
            return Err(FilterError::WrongKey {
                expected: fingerprint,
                actual: key.fingerprint(),
            });
        }
        let mut blocks = alloc_blocks(num_blocks)?;
        for (block, chunk) in blocks.iter_mut().zip(payload.chunks_exact(64)) {
            for (word, b) in block.0.iter_mut().zip(chunk.chunks_exact(8)) {
                let mut w = [0u8; 8];
                w.copy_from_slice(b);
                *word.get_mut() = u64::from_le_bytes(w);
            }
        }
        Ok(BloomFilter {
            blocks,
            num_hashes,
            inserted: AtomicU64::new(inserted),
            key: key.clone(),
        })
    }
}

impl fmt::Debug for BloomFilter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BloomFilter")
            .field("num_blocks", &self.num_blocks())
            .field("num_hashes", &self.num_hashes)
            .field("inserted", &self.inserted())
            .field("key", &self.key)
            .finish()
    }
}

/// Inserts queued by [`BloomFilter::insert_hash_pipelined`].
pub(crate) const PIPELINE_DEPTH: usize = 16;

/// Queue of (block index, position hash) awaiting application.
#[derive(Default)]
pub(crate) struct InsertPipeline {
    slots: [(usize, u64); PIPELINE_DEPTH],
    next: usize,
    filled: usize,
}

/// Hints the CPU to start loading `block` into cache.
#[inline(always)]
fn prefetch(block: &Block) {
    #[cfg(target_arch = "x86_64")]
    #[allow(unsafe_code)]
    // SAFETY: a prefetch is only a hint: it never faults and never reads the
    // data into Rust-visible state; SSE is part of the x86_64 baseline.
    unsafe {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        _mm_prefetch::<_MM_HINT_T0>((block as *const Block).cast::<i8>());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = block;
}

/// Zeroed blocks, or an error instead of an abort if memory is short.
fn alloc_blocks(num_blocks: u64) -> Result<Box<[Block]>, FilterError> {
    let n = usize::try_from(num_blocks).map_err(|_| FilterError::OutOfMemory {
        bytes: num_blocks.saturating_mul(64),
    })?;
    let mut v: Vec<Block> = Vec::new();
    v.try_reserve_exact(n)
        .map_err(|_| FilterError::OutOfMemory {
            bytes: num_blocks * 64,
        })?;
    v.resize_with(n, Block::default);
    Ok(v.into_boxed_slice())
}

/// Block for hash word `h0` among `num_blocks`: multiply-high range reduction.
#[inline]
pub(crate) fn block_index(h0: u64, num_blocks: u64) -> usize {
    ((u128::from(h0) * u128::from(num_blocks)) >> 64) as usize
}

/// The k bit positions of hash word `h1`, as a mask per word of the block.
#[inline]
pub(crate) fn block_mask(h1: u64, num_hashes: u32) -> [u64; WORDS] {
    let mut mask = [0u64; WORDS];
    for &c in &POSITION_MULTIPLIERS[..num_hashes as usize] {
        let pos = h1.wrapping_mul(c) >> 55; // 9 bits: 0..512
        mask[(pos >> 6) as usize] |= 1 << (pos & 63);
    }
    mask
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn key(seed: u8) -> FilterKey {
        FilterKey::from_bytes([seed; 32])
    }

    #[test]
    fn block_is_one_aligned_cache_line() {
        assert_eq!(std::mem::size_of::<Block>(), 64);
        assert_eq!(std::mem::align_of::<Block>(), 64);
        let f = BloomFilter::with_shape(3, 7, key(1)).unwrap();
        for b in f.blocks.iter() {
            assert_eq!(b as *const Block as usize % 64, 0);
        }
    }

    #[test]
    fn block_index_is_uniform_and_exact_past_2_pow_32_bits() {
        // 2^24 blocks = 2^33 bits: indices must reach the top of the range.
        let nb = 1u64 << 24;
        assert_eq!(block_index(u64::MAX, nb), (nb - 1) as usize);
        assert_eq!(block_index(0, nb), 0);
        assert_eq!(block_index(1 << 63, nb), (nb / 2) as usize);
        // An odd, non-power-of-two count past 2^32 bits.
        let nb = 10_000_019u64;
        assert_eq!(block_index(u64::MAX, nb), (nb - 1) as usize);
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let mut hist = [0u32; 10];
        for _ in 0..100_000 {
            let i = block_index(rng.random(), nb) as u64;
            assert!(i < nb);
            hist[(i * 10 / nb) as usize] += 1;
        }
        for h in hist {
            assert!((9_500..10_500).contains(&h), "{hist:?}");
        }
    }

    #[test]
    fn positions_are_uniform_and_k_many() {
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        let mut hist = vec![0u32; 512];
        let mut total_bits = 0u32;
        for _ in 0..20_000 {
            let mask = block_mask(rng.random(), 8);
            let bits: u32 = mask.iter().map(|w| w.count_ones()).sum();
            assert!((1..=8).contains(&bits));
            total_bits += bits;
            for (w, m) in mask.iter().enumerate() {
                for b in 0..64 {
                    if m & (1 << b) != 0 {
                        hist[w * 64 + b] += 1;
                    }
                }
            }
        }
        // Expected 312.5 per position; allow ±6σ (σ ≈ 17.7).
        for (i, h) in hist.iter().enumerate() {
            assert!((206..420).contains(h), "position {i}: {h}");
        }
        // With replacement, mean distinct = 512(1-(1-1/512)^8) ≈ 7.945.
        let mean = total_bits as f64 / 20_000.0;
        assert!((mean - 7.945).abs() < 0.02, "{mean}");
    }

    #[test]
    fn no_false_negatives_and_sane_stats() {
        let f = BloomFilter::new(10_000, 0.01, key(3)).unwrap();
        for i in 0u64..10_000 {
            f.insert(&i.to_le_bytes());
        }
        for i in 0u64..10_000 {
            assert!(f.contains(&i.to_le_bytes()), "false negative {i}");
        }
        let s = f.stats();
        assert_eq!(s.kind, "bloom");
        assert_eq!(s.keys, 10_000);
        assert_eq!(s.bits, f.num_blocks() * 512);
        assert_eq!(s.bytes * 8, s.bits);
        assert!(s.fill_ratio > 0.3 && s.fill_ratio < 0.7, "{}", s.fill_ratio);
        // The fill-based FP estimate is first-order (reads low) but close.
        assert!(s.estimated_fp_rate > 0.005 && s.estimated_fp_rate < 0.012);
        assert!(
            (s.estimated_cardinality - 10_000.0).abs() < 200.0,
            "{}",
            s.estimated_cardinality
        );
        assert_eq!(s.key_fingerprint, Some(key(3).fingerprint()));
    }

    #[test]
    fn insert_reports_whether_it_set_a_bit() {
        let f = BloomFilter::new(1000, 0.01, key(9)).unwrap();
        assert!(f.insert(b"a"));
        assert!(!f.insert(b"a"), "a repeat sets nothing");
        let mut new = 0;
        for i in 0u32..1000 {
            new += u32::from(f.insert(&i.to_le_bytes()));
        }
        // Only keys whose bits were all set already (≈ the FP rate, rising
        // to 1 % at 1000 keys) report no change.
        assert!((975..=1000).contains(&new), "{new}");
    }

    #[test]
    fn cardinality_estimate_tracks_distinct_keys_not_calls() {
        let f = BloomFilter::new(50_000, 0.01, key(4)).unwrap();
        for i in 0u64..20_000 {
            f.insert(&i.to_le_bytes());
            f.insert(&i.to_le_bytes());
        }
        assert_eq!(f.inserted(), 40_000);
        let c = f.estimated_cardinality();
        assert!((c - 20_000.0).abs() < 400.0, "{c}");
    }

    #[test]
    fn pipelined_inserts_land_after_flush() {
        let mut a = BloomFilter::new(1000, 0.01, key(5)).unwrap();
        let b = BloomFilter::new(1000, 0.01, key(5)).unwrap();
        let mut pipe = InsertPipeline::default();
        // Counts around the pipeline depth exercise partial and wrapped rings.
        for n in [0u32, 1, 15, 16, 17, 1000] {
            for i in 0..n {
                let h = a.hash(&i.to_le_bytes());
                a.insert_hash_pipelined(h, &mut pipe);
                b.insert(&i.to_le_bytes());
            }
            a.flush(&mut pipe);
            assert_eq!(a.to_bytes(), b.to_bytes(), "n = {n}");
        }
    }

    #[test]
    fn saturated_filter_stays_finite_and_answers_true() {
        let f = BloomFilter::with_shape(1, 16, key(6)).unwrap();
        for i in 0u32..5000 {
            f.insert(&i.to_le_bytes());
        }
        assert!(f.estimated_cardinality().is_finite());
        assert!(f.contains(b"anything"));
    }

    #[test]
    fn round_trip_and_key_check() {
        let f = BloomFilter::new(5000, 0.01, key(7)).unwrap();
        for i in 0u32..5000 {
            f.insert(&i.to_le_bytes());
        }
        let bytes = f.to_bytes();
        let g = BloomFilter::from_bytes(&bytes, &key(7)).unwrap();
        assert_eq!(g.to_bytes(), bytes);
        assert_eq!(g.inserted(), 5000);
        assert_eq!(g.num_hashes(), f.num_hashes());
        for i in 0u32..5000 {
            assert!(g.contains(&i.to_le_bytes()));
        }
        assert!(matches!(
            BloomFilter::from_bytes(&bytes, &key(8)),
            Err(FilterError::WrongKey { .. })
        ));
    }
}
