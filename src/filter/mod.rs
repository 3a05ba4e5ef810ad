//! The membership filter: the gate in front of the cache and Postgres.
//!
//! Every request's key is checked here first; a key the filter rejects never
//! reaches the cache or the database. Two implementations sit behind
//! [`KeySet`]:
//!
//! * [`BloomFilter`]: cache-line-blocked Bloom filter on secret-keyed
//!   HighwayHash. One hash and one cache-line access per lookup; lock-free
//!   inserts into the live filter. False-positive rate ≤ `p` at the sized-for
//!   key count (modelled exactly for the blocked layout, see [`sizing`]).
//! * [`ExactSet`]: roaring treemap for integer keys: no false positives; for
//!   dense ids far smaller than any Bloom filter.
//!
//! # Guarantees (tested in this module, its submodules and
//! `tests/it/filter/props.rs`)
//! * **No false negatives**, ever: an inserted key is reported present by
//!   every later lookup, including with concurrent inserters and after a
//!   serialisation round trip. Where a structure cannot represent a key
//!   (a `Bytes` key in an exact set), it fails open and answers "present".
//! * **Bounded false positives**: Bloom ≤ `p` at `expected` keys (measured
//!   within [0.5p, 1.1p] at 1M keys); exact: none.
//! * **Flooding resistance**: keys that collide under one hash key pass a
//!   filter with a different key at the normal rate; every builder draws a
//!   fresh key unless given one, and the key never appears in `Debug`,
//!   errors, or serialised bytes (only its [`FilterKey::fingerprint`]).
//! * **No panics on input**: `from_bytes` on arbitrary bytes returns an error
//!   and allocates at most O(input length).
//!
//! No I/O happens here; the gateway feeds keys in and asks questions.

mod bloom;
mod codec;
mod exact;
mod hash;
pub mod sizing;

use std::fmt;

use roaring::RoaringTreemap;

pub use bloom::BloomFilter;
pub use exact::{ExactSet, decode_i64, encode_i64};
pub use hash::FilterKey;
pub use sizing::{optimal_num_bits, optimal_num_hashes};

/// Which structure to build.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Always the Bloom filter.
    Bloom,
    /// Always the exact set (integer keys only: [`KeySetBuilder::new`]
    /// refuses it for [`KeyKind::Bytes`]).
    Exact,
    /// Whichever is smaller for the actual keys (see [`KeySetBuilder`]);
    /// always the Bloom filter for [`KeyKind::Bytes`].
    Auto,
}

/// What kind of [`Item`] a set will hold: the builder must know before the
/// first key arrives, because an empty table sends none. An exact set can
/// only represent `Int` items and answers "maybe" for any `Bytes` item, so
/// a set for byte keys (uuid, text) must be a Bloom filter, even when no key
/// was ever inserted: an empty Bloom filter rejects everything.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyKind {
    /// [`Item::Int`] keys (SQL bigint).
    Int,
    /// [`Item::Bytes`] keys (uuid, text).
    Bytes,
}

/// What is stored or looked up.
///
/// `Int` is a SQL bigint key; `Bytes` is a uuid's 16 bytes or a text key's
/// UTF-8. The Bloom filter hashes `Int(v)` as `v.to_le_bytes()`, so
/// `Int(v)` and `Bytes(&v.to_le_bytes())` are the same key to it. The exact
/// set stores `Int(v)` as [`encode_i64`]`(v)` and cannot store `Bytes` at all:
/// inserting one is a no-op and looking one up answers `true` (fail open).
#[derive(Clone, Copy, Debug)]
pub enum Item<'a> {
    Int(i64),
    Bytes(&'a [u8]),
}

impl Item<'_> {
    /// Runs `f` on the bytes the Bloom filter hashes for this item.
    #[inline]
    fn with_bytes<R>(self, f: impl FnOnce(&[u8]) -> R) -> R {
        match self {
            Item::Int(v) => f(&v.to_le_bytes()),
            Item::Bytes(b) => f(b),
        }
    }
}

/// A point-in-time description of a filter, for metrics and `/stats`.
#[derive(Clone, Debug, serde::Serialize)]
pub struct FilterStats {
    /// `"bloom"` or `"exact"`.
    pub kind: &'static str,
    /// Size in bits (exact: its estimated heap bytes × 8).
    pub bits: u64,
    /// Size in bytes.
    pub bytes: u64,
    /// Bit positions per key; 0 for exact.
    pub hashes: u32,
    /// Bloom: number of insert calls (duplicates counted; approximate while
    /// inserts race). Exact: number of keys.
    pub keys: u64,
    /// Bloom: set bits / bits. Exact: keys / (max − min + 1), the density of
    /// the id range.
    pub fill_ratio: f64,
    /// Bloom: `fill^k` (first-order, reads somewhat low for the blocked
    /// layout). Exact: 0.0.
    pub estimated_fp_rate: f64,
    /// Bloom: distinct keys estimated from the fill (Swamidass–Baldi).
    /// Exact: the key count.
    pub estimated_cardinality: f64,
    /// Bloom: fingerprint of the hash key (never the key). Exact: `None`.
    pub key_fingerprint: Option<u64>,
}

/// Errors from building or decoding filters. Messages never contain key
/// material (at most the key's fingerprint).
#[derive(Clone, Debug, thiserror::Error)]
pub enum FilterError {
    #[error("false-positive rate must be in (0, 1), got {0}")]
    InvalidRate(f64),
    #[error("a filter for {keys} keys at this rate would exceed the cap of {max_bits} bits")]
    TooLarge { keys: u64, max_bits: u64 },
    #[error("could not allocate {bytes} bytes for the filter")]
    OutOfMemory { bytes: u64 },
    #[error("serialised filter is truncated")]
    Truncated,
    #[error("not a serialised filter (bad magic bytes)")]
    BadMagic,
    #[error("unsupported filter format version {0}")]
    UnsupportedVersion(u16),
    #[error("corrupt serialised filter: {0}")]
    Corrupt(&'static str),
    #[error(
        "filter was built with key fingerprint {expected:016x}, but the supplied key has fingerprint {actual:016x}"
    )]
    WrongKey { expected: u64, actual: u64 },
    #[error("an exact set holds only integer keys; use the Bloom filter (or auto) for byte keys")]
    ExactNeedsIntegers,
}

/// A built filter of either kind. `Send + Sync`: share it behind an `Arc`;
/// inserts take `&self`.
#[derive(Debug)]
pub enum KeySet {
    Bloom(BloomFilter),
    Exact(ExactSet),
}

impl KeySet {
    /// Adds `item`; returns whether the set changed (Bloom: at least one
    /// bit was newly set; exact: the key is new), so callers can count growth
    /// without counting repeated deliveries of one key. Bloom: lock-free.
    /// Exact: a short write lock on the delta that never makes readers wait
    /// for a compaction. A `Bytes` item in an exact set is ignored (lookups
    /// of it answer `true` anyway; [`KeySetBuilder`] never builds an exact
    /// set for [`KeyKind::Bytes`]).
    #[inline]
    pub fn insert(&self, item: Item<'_>) -> bool {
        match self {
            KeySet::Bloom(b) => item.with_bytes(|bytes| b.insert(bytes)),
            KeySet::Exact(e) => e.insert_item(item),
        }
    }

    /// Whether `item` may be present (`false` = definitely absent).
    #[inline]
    pub fn contains(&self, item: Item<'_>) -> bool {
        match self {
            KeySet::Bloom(b) => item.with_bytes(|bytes| b.contains(bytes)),
            KeySet::Exact(e) => e.contains_item(item),
        }
    }

    /// Metrics snapshot. Bloom: scans the bit array (≈1 ms per 10 MB).
    pub fn stats(&self) -> FilterStats {
        match self {
            KeySet::Bloom(b) => b.stats(),
            KeySet::Exact(e) => e.stats(),
        }
    }

    /// The false-positive rate the sizing model ([`sizing::blocked_fp_rate`])
    /// gives this filter's shape at `keys` distinct keys: O(k²), no scan of
    /// the bits. Exact: 0.
    pub fn fp_rate_at(&self, keys: u64) -> f64 {
        match self {
            KeySet::Bloom(b) => sizing::blocked_fp_rate(keys, b.num_blocks(), b.num_hashes()),
            KeySet::Exact(_) => 0.0,
        }
    }

    /// The most distinct keys this filter can hold while the model's
    /// false-positive rate stays at most `rate` ([`sizing::max_keys_at_rate`]),
    /// so a caller can compare a key count against it in O(1) on every
    /// insert instead of estimating the rate. Exact: `None` (no false
    /// positives, whatever the count).
    pub fn max_keys_at_rate(&self, rate: f64) -> Option<u64> {
        match self {
            KeySet::Bloom(b) => Some(sizing::max_keys_at_rate(
                b.num_blocks(),
                b.num_hashes(),
                rate,
            )),
            KeySet::Exact(_) => None,
        }
    }

    /// Cheap key count: Bloom, insert calls; exact, keys.
    pub fn keys(&self) -> u64 {
        match self {
            KeySet::Bloom(b) => b.inserted(),
            KeySet::Exact(e) => e.len(),
        }
    }

    /// `"bloom"` or `"exact"`.
    pub fn kind(&self) -> &'static str {
        match self {
            KeySet::Bloom(_) => "bloom",
            KeySet::Exact(_) => "exact",
        }
    }

    /// Serialised form (versioned, checksummed; see `codec.rs`).
    pub fn to_bytes(&self) -> Vec<u8> {
        match self {
            KeySet::Bloom(b) => b.to_bytes(),
            KeySet::Exact(e) => e.to_bytes(),
        }
    }

    /// Decodes either kind. `key` is ignored for exact sets; for a Bloom
    /// filter a key whose fingerprint differs from the stored one is
    /// [`FilterError::WrongKey`] (with the wrong key every lookup would be
    /// meaningless, including false negatives).
    pub fn from_bytes(bytes: &[u8], key: &FilterKey) -> Result<KeySet, FilterError> {
        let (layout, mut r) = codec::open(bytes)?;
        let set = match layout {
            codec::Layout::BloomBlocked512 => KeySet::Bloom(BloomFilter::decode_body(&mut r, key)?),
            codec::Layout::ExactRoaringTreemap => KeySet::Exact(ExactSet::decode_body(&mut r)?),
        };
        r.finish()?;
        Ok(set)
    }
}

/// Streaming builder: the gateway streams keys from Postgres into it.
///
/// The [`KeyKind`] is given up front, so the layout is valid for the key
/// type whatever keys arrive, none included:
///
/// * `Bloom`: allocates the filter once in `new`; constant memory.
/// * `Exact`: a roaring treemap; refused for [`KeyKind::Bytes`]. (A `Bytes`
///   item inserted anyway into an `Int` exact set is skipped and fails open.)
/// * `Auto` with [`KeyKind::Bytes`]: the Bloom filter from the start.
/// * `Auto` with [`KeyKind::Int`]: starts as a bitmap. Every so often (amortised O(1) per key) it
///   compares the bitmap's size with the Bloom filter sized for `expected`;
///   once the bitmap is larger even after run compression it builds the Bloom
///   filter, moves the bitmap's keys into it, drops the bitmap and continues
///   as Bloom: no second scan, and peak memory stays below about 2× the Bloom
///   size. A `Bytes` item switches to Bloom at once. `finish` picks the
///   smaller of the two for the keys actually seen.
///
/// The size compared is the bitmap's heap ([`exact::heap_bytes`]), not its
/// serialised size: the two agree for containers holding thousands of keys,
/// but a sparse 64-bit id alone in its bucket costs ~200 heap bytes against
/// ~22 serialised (`tests/memory.rs`).
pub struct KeySetBuilder {
    mode: Mode,
    expected: u64,
    p: f64,
    key: FilterKey,
    /// Bytes of the Bloom filter sized for `expected`: the switch threshold.
    bloom_bytes: u64,
    state: Building,
    len: u64,
    next_check: u64,
}

enum Building {
    // Boxed: the filter carries the prepared hasher state (~290 B) and the
    // pipeline 16 queued inserts; the exact variant is 24 B.
    Bloom(Box<BloomFilter>, Box<bloom::InsertPipeline>),
    Exact(RoaringTreemap),
}

/// Auto mode keeps a bitmap this small whatever the Bloom filter would
/// take: a few KiB cost nothing, and the bitmap has no false positives (a
/// small table's bitmap is mostly fixed overhead, bigger than a Bloom
/// filter sized for its few keys, which fills up as rows arrive).
const EXACT_ANYWAY_BELOW: u64 = 16 * 1024;

/// Minimum keys between two size checks in auto mode.
const MIN_CHECK_INTERVAL: u64 = 1024;

impl KeySetBuilder {
    /// `kind`: the items the set will hold; `expected`: keys to size for
    /// (headroom already applied by the caller); `p`: target FP rate in
    /// (0, 1), validated for every mode. `Mode::Exact` with
    /// [`KeyKind::Bytes`] is [`FilterError::ExactNeedsIntegers`].
    pub fn new(
        mode: Mode,
        kind: KeyKind,
        expected: u64,
        p: f64,
        key: FilterKey,
    ) -> Result<Self, FilterError> {
        let sizing = sizing::size_blocked(expected, p)?;
        let bloom = match (mode, kind) {
            (Mode::Bloom, _) | (Mode::Auto, KeyKind::Bytes) => true,
            (Mode::Exact, KeyKind::Bytes) => return Err(FilterError::ExactNeedsIntegers),
            (Mode::Exact | Mode::Auto, KeyKind::Int) => false,
        };
        let state = match bloom {
            true => Building::Bloom(
                Box::new(BloomFilter::with_shape(
                    sizing.num_blocks,
                    sizing.num_hashes,
                    key.clone(),
                )?),
                Default::default(),
            ),
            false => Building::Exact(RoaringTreemap::new()),
        };
        Ok(KeySetBuilder {
            mode,
            expected,
            p,
            key,
            bloom_bytes: sizing.bytes(),
            state,
            len: 0,
            next_check: MIN_CHECK_INTERVAL,
        })
    }

    /// Adds one key.
    #[inline]
    pub fn insert(&mut self, item: Item<'_>) {
        self.len += 1;
        match (&mut self.state, item) {
            (Building::Bloom(b, pipe), item) => {
                let h = item.with_bytes(|bytes| b.hash(bytes));
                b.insert_hash_pipelined(h, pipe);
            }
            (Building::Exact(map), Item::Int(v)) => {
                map.insert(encode_i64(v));
                if self.mode == Mode::Auto && self.len >= self.next_check {
                    self.check_size();
                }
            }
            (Building::Exact(_), Item::Bytes(bytes)) => {
                if self.mode == Mode::Auto {
                    self.switch_to_bloom();
                    if let Building::Bloom(b, pipe) = &mut self.state {
                        let h = b.hash(bytes);
                        b.insert_hash_pipelined(h, pipe);
                    }
                }
                // Mode::Exact: not representable; lookups fail open.
            }
        }
    }

    /// Keys inserted so far (insert calls).
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether nothing was inserted yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The kind currently being built (`"bloom"` or `"exact"`).
    pub fn current_kind(&self) -> &'static str {
        match self.state {
            Building::Bloom(..) => "bloom",
            Building::Exact(_) => "exact",
        }
    }

    /// The finished set.
    pub fn finish(mut self) -> KeySet {
        if self.mode == Mode::Auto
            && let Building::Exact(map) = &mut self.state
        {
            map.optimize();
            let exact = exact::heap_bytes(map);
            // Compare against the Bloom filter that would actually be built
            // for these keys.
            let bloom = sizing::size_blocked(self.expected.max(self.len), self.p)
                .map(|s| s.bytes())
                .unwrap_or(u64::MAX);
            if exact > bloom.max(EXACT_ANYWAY_BELOW) {
                self.switch_to_bloom();
            }
        }
        match self.state {
            Building::Bloom(mut b, mut pipe) => {
                b.flush(&mut pipe);
                b.set_inserted(self.len);
                KeySet::Bloom(*b)
            }
            Building::Exact(map) => KeySet::Exact(ExactSet::from_treemap(map)),
        }
    }

    /// Auto mode: switch to Bloom once the bitmap outgrows it.
    fn check_size(&mut self) {
        let Building::Exact(map) = &mut self.state else {
            return;
        };
        let limit = self.bloom_bytes.max(EXACT_ANYWAY_BELOW);
        let mut size = exact::heap_bytes(map);
        if size > limit {
            // Array/bitmap containers of dense ids shrink a lot as runs.
            map.optimize();
            size = exact::heap_bytes(map);
        }
        if size > limit {
            self.switch_to_bloom();
            return;
        }
        // The next check after a number of keys proportional to the size
        // (≈ number of containers), so checking costs O(1) amortised per key
        // while the bitmap can overshoot the threshold by at most ~4/5
        // (≤ ~200 heap bytes per new key, a key alone in its bucket,
        // × size/256 keys).
        self.next_check = self.len + (size / 256).max(MIN_CHECK_INTERVAL);
    }

    fn switch_to_bloom(&mut self) {
        let Building::Exact(map) = &self.state else {
            return;
        };
        // Sized for at least the keys already seen, so an underestimated
        // `expected` does not leave the filter overfull from the start. If
        // even that is refused (absurd sizes), fall back to the cap-sized
        // expected filter, which `new` already validated.
        let sizing = sizing::size_blocked(self.expected.max(self.len), self.p)
            .or_else(|_| sizing::size_blocked(self.expected, self.p))
            .expect("validated in new()");
        let mut bloom =
            match BloomFilter::with_shape(sizing.num_blocks, sizing.num_hashes, self.key.clone()) {
                Ok(b) => b,
                // Out of memory for the bigger filter: keep the bitmap, which is
                // still correct, just larger.
                Err(_) => return,
            };
        let mut pipe = Box::<bloom::InsertPipeline>::default();
        for v in map.iter() {
            let h = bloom.hash(&decode_i64(v).to_le_bytes());
            bloom.insert_hash_pipelined(h, &mut pipe);
        }
        self.state = Building::Bloom(Box::new(bloom), pipe);
    }
}

impl fmt::Debug for KeySetBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeySetBuilder")
            .field("mode", &self.mode)
            .field("expected", &self.expected)
            .field("p", &self.p)
            .field("len", &self.len)
            .field("current", &self.current_kind())
            .field("key", &self.key)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> FilterKey {
        FilterKey::from_bytes([0x5a; 32])
    }

    #[test]
    fn public_types_are_send_and_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<KeySet>();
        assert_send_sync::<BloomFilter>();
        assert_send_sync::<ExactSet>();
        assert_send_sync::<FilterKey>();
        assert_send_sync::<KeySetBuilder>();
    }

    #[test]
    fn mode_serde_names_are_lowercase() {
        for (mode, name) in [
            (Mode::Bloom, "bloom"),
            (Mode::Exact, "exact"),
            (Mode::Auto, "auto"),
        ] {
            assert_eq!(serde_json::to_string(&mode).unwrap(), format!("\"{name}\""));
            let back: Mode = serde_json::from_str(&format!("\"{name}\"")).unwrap();
            assert_eq!(back, mode);
        }
    }

    #[test]
    fn int_and_bytes_items_agree_in_bloom() {
        let b = KeySetBuilder::new(Mode::Bloom, KeyKind::Int, 100, 0.01, key()).unwrap();
        let set = b.finish();
        set.insert(Item::Int(-42));
        assert!(set.contains(Item::Bytes(&(-42i64).to_le_bytes())));
    }

    /// An empty uuid or text table sends no key at all: the layout must
    /// still be one that can reject byte keys (an exact set answers "maybe"
    /// for every byte key).
    #[test]
    fn byte_keys_never_get_an_exact_set_even_with_no_keys() {
        let set = KeySetBuilder::new(Mode::Auto, KeyKind::Bytes, 1, 0.01, key())
            .unwrap()
            .finish();
        assert_eq!(set.kind(), "bloom");
        for probe in [&b"6f1c2a4e8a594a4e"[..], b"anything", b""] {
            assert!(!set.contains(Item::Bytes(probe)), "{probe:?} passed");
        }
        // With keys, auto stays Bloom for byte keys, whatever their count.
        let mut b = KeySetBuilder::new(Mode::Auto, KeyKind::Bytes, 10, 0.01, key()).unwrap();
        assert_eq!(b.current_kind(), "bloom");
        b.insert(Item::Bytes(b"alice"));
        let set = b.finish();
        assert_eq!(set.kind(), "bloom");
        assert!(set.contains(Item::Bytes(b"alice")));
        // An exact set for byte keys is refused outright.
        assert!(matches!(
            KeySetBuilder::new(Mode::Exact, KeyKind::Bytes, 10, 0.01, key()),
            Err(FilterError::ExactNeedsIntegers)
        ));
        // Integer keys in auto mode still start as the bitmap.
        let set = KeySetBuilder::new(Mode::Auto, KeyKind::Int, 1, 0.01, key())
            .unwrap()
            .finish();
        assert_eq!(set.kind(), "exact");
        assert!(!set.contains(Item::Int(1)));
    }

    /// A small table keeps its bitmap in auto mode, though a Bloom filter
    /// sized for its few keys takes fewer bytes than the bitmap's fixed
    /// structure: that filter would fill up with the first rows inserted.
    #[test]
    fn auto_keeps_a_small_tables_bitmap() {
        for sparse in [1, 1000] {
            let mut b = KeySetBuilder::new(Mode::Auto, KeyKind::Int, 150, 0.01, key()).unwrap();
            for id in 1..=100 {
                b.insert(Item::Int(id * sparse));
            }
            assert_eq!(b.finish().kind(), "exact", "ids spaced by {sparse}");
        }
    }

    #[test]
    fn exact_mode_fails_open_for_bytes() {
        let mut b = KeySetBuilder::new(Mode::Exact, KeyKind::Int, 100, 0.01, key()).unwrap();
        b.insert(Item::Bytes(b"text-key"));
        b.insert(Item::Int(7));
        assert_eq!(b.len(), 2);
        let set = b.finish();
        assert_eq!(set.kind(), "exact");
        assert!(set.contains(Item::Bytes(b"anything at all")));
        assert!(set.contains(Item::Int(7)));
        assert!(!set.contains(Item::Int(8)));
        assert_eq!(set.stats().keys, 1);
    }

    #[test]
    fn auto_switches_to_bloom_on_bytes_and_keeps_earlier_ints() {
        let mut b = KeySetBuilder::new(Mode::Auto, KeyKind::Int, 1000, 0.01, key()).unwrap();
        for i in 0..100 {
            b.insert(Item::Int(i));
        }
        assert_eq!(b.current_kind(), "exact");
        b.insert(Item::Bytes(b"uuid-bytes-here!"));
        assert_eq!(b.current_kind(), "bloom");
        let set = b.finish();
        assert_eq!(set.kind(), "bloom");
        assert_eq!(set.stats().keys, 101);
        assert!((0..100).all(|i| set.contains(Item::Int(i))));
        assert!(set.contains(Item::Bytes(b"uuid-bytes-here!")));
    }

    #[test]
    fn auto_switches_mid_stream_for_sparse_keys() {
        let mut b = KeySetBuilder::new(Mode::Auto, KeyKind::Int, 100_000, 0.01, key()).unwrap();
        let mut x = 0x1234_5678_9abc_def0u64;
        let mut keys = Vec::new();
        let mut switched_at = None;
        for i in 0..100_000u64 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            keys.push(x as i64);
            b.insert(Item::Int(x as i64));
            if switched_at.is_none() && b.current_kind() == "bloom" {
                switched_at = Some(i);
            }
        }
        // The bitmap costs ~20+ bytes per sparse key vs ~1.2 for Bloom: the
        // switch must happen within the first few percent of the stream.
        let at = switched_at.expect("never switched");
        assert!(at < 15_000, "switched late, at {at}");
        let set = b.finish();
        assert!(keys.iter().all(|&k| set.contains(Item::Int(k))));
    }

    #[test]
    fn builder_validates_rate_for_every_mode() {
        for mode in [Mode::Bloom, Mode::Exact, Mode::Auto] {
            for kind in [KeyKind::Int, KeyKind::Bytes] {
                assert!(matches!(
                    KeySetBuilder::new(mode, kind, 10, 1.0, key()),
                    Err(FilterError::InvalidRate(_))
                ));
            }
        }
        // n = 0 is a valid, minimal filter.
        let set = KeySetBuilder::new(Mode::Bloom, KeyKind::Int, 0, 0.01, key())
            .unwrap()
            .finish();
        assert_eq!(set.stats().bits, 512);
        assert!(!set.contains(Item::Int(1)));
    }

    #[test]
    fn keyset_from_bytes_dispatches_and_checks_key() {
        let mut b = KeySetBuilder::new(Mode::Bloom, KeyKind::Int, 1000, 0.01, key()).unwrap();
        b.insert(Item::Int(1));
        let bloom = b.finish();
        let mut b = KeySetBuilder::new(Mode::Exact, KeyKind::Int, 1000, 0.01, key()).unwrap();
        b.insert(Item::Int(1));
        let exact = b.finish();
        let other = FilterKey::from_bytes([1; 32]);
        let e = KeySet::from_bytes(&bloom.to_bytes(), &other).unwrap_err();
        assert!(matches!(e, FilterError::WrongKey { .. }));
        // The wrong-key message shows fingerprints only.
        assert!(
            e.to_string()
                .contains(&format!("{:016x}", key().fingerprint()))
        );
        let back = KeySet::from_bytes(&exact.to_bytes(), &other).unwrap();
        assert_eq!(back.kind(), "exact");
        assert!(back.contains(Item::Int(1)));
        let back = KeySet::from_bytes(&bloom.to_bytes(), &key()).unwrap();
        assert_eq!(back.kind(), "bloom");
        assert!(back.contains(Item::Int(1)));
    }
}
