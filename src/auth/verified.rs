//! The verified-credential cache: what a token or key was found to say,
//! kept so that a hit costs a keyed hash and a table read instead of a
//! signature check.
//!
//! A fixed table of `token_cache_entries` slots in sets of [`WAYS`],
//! indexed by the keyed digest of the credential (so no caller can aim at
//! a set). Its memory is bounded whatever callers send: only credentials
//! that verified are stored, each replacing an empty, expired or stale way
//! or, when the set is full, one chosen by the digest. An entry is served
//! until its token's `exp` (plus the leeway), and only while the key sets
//! are the ones it was verified against: every change of them starts a new
//! generation, and an entry of an older one is a miss (a rotated-out key's
//! tokens are refused at once, not at their `exp`).
//!
//! Each slot is an `ArcSwapOption`: a read takes no lock and writes no
//! memory another core reads (arc-swap's per-thread debt slots), which is
//! what the hit path needs; the few writes (inserts) are lock-free too.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use arc_swap::{ArcSwapOption, Guard};

pub const WAYS: usize = 4;

/// What a verified credential says, as the request path uses it.
#[derive(Debug)]
pub struct Verified {
    pub digest: [u8; 32],
    pub generation: u64,
    /// Seconds since the epoch: valid in `[valid_from, valid_until)`.
    pub valid_from: u64,
    pub valid_until: u64,
    /// Bit i: the caller holds scope i of the configured scopes.
    pub scopes: u64,
    /// The rate limiter's caller: a keyed hash of the `sub` or the key's
    /// name; 0 when there is neither (the address is used).
    pub caller: u64,
    /// The owner claims the resources name, in `Rules::owner_claims` order.
    pub owners: Box<[super::jwt::OwnerClaim]>,
}

pub type Held = Guard<Option<Arc<Verified>>>;

pub struct Cache {
    slots: Box<[ArcSwapOption<Verified>]>,
    sets: usize,
    generation: AtomicU64,
}

impl Cache {
    /// Room for at least `entries` (rounded up to a power of two).
    pub fn new(entries: usize) -> Self {
        let sets = (entries.max(WAYS) / WAYS).next_power_of_two();
        Self {
            slots: (0..sets * WAYS).map(|_| ArcSwapOption::empty()).collect(),
            sets,
            generation: AtomicU64::new(1),
        }
    }

    pub fn capacity(&self) -> usize {
        self.slots.len()
    }

    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Every entry stops being served (the key sets changed).
    pub fn new_generation(&self) {
        self.generation.fetch_add(1, Ordering::AcqRel);
    }

    fn set(&self, digest: &[u8; 32]) -> &[ArcSwapOption<Verified>] {
        let word = u64::from_le_bytes(digest[..8].try_into().expect("8 bytes"));
        let at = (word as usize & (self.sets - 1)) * WAYS;
        &self.slots[at..at + WAYS]
    }

    /// The entry for `digest`, if it is valid at `now`.
    pub fn get(&self, digest: &[u8; 32], now: u64) -> Option<Held> {
        let generation = self.generation();
        for slot in self.set(digest) {
            let held = slot.load();
            if let Some(v) = held.as_ref()
                && v.digest == *digest
            {
                let valid =
                    v.generation == generation && now >= v.valid_from && now < v.valid_until;
                return valid.then_some(held);
            }
        }
        None
    }

    /// Stores `v`: over its own older entry, else an empty, expired or
    /// stale way, else the way its digest picks.
    pub fn insert(&self, v: Arc<Verified>, now: u64) {
        let generation = self.generation();
        let set = self.set(&v.digest);
        let mut free = None;
        for (i, slot) in set.iter().enumerate() {
            let held = slot.load();
            match held.as_ref() {
                Some(old) if old.digest == v.digest => {
                    free = Some(i);
                    break;
                }
                Some(old) if old.generation == generation && now < old.valid_until => {}
                _ => {
                    free.get_or_insert(i);
                }
            }
        }
        let way = free.unwrap_or(v.digest[8] as usize % WAYS);
        set[way].store(Some(v));
    }

    /// Entries held now (any generation): a scan, for the admin API.
    pub fn len(&self) -> usize {
        self.slots.iter().filter(|s| s.load().is_some()).count()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(digest: [u8; 32], generation: u64, until: u64) -> Arc<Verified> {
        Arc::new(Verified {
            digest,
            generation,
            valid_from: 10,
            valid_until: until,
            scopes: 0,
            caller: 1,
            owners: Box::new([]),
        })
    }

    #[test]
    fn entries_are_served_within_their_time_and_generation_only() {
        let c = Cache::new(16);
        let d = [3u8; 32];
        c.insert(entry(d, c.generation(), 100), 50);
        assert!(c.get(&d, 50).is_some());
        assert!(c.get(&d, 9).is_none(), "before nbf");
        assert!(c.get(&d, 100).is_none(), "at exp + leeway");
        assert!(c.get(&[4u8; 32], 50).is_none());
        c.new_generation();
        assert!(c.get(&d, 50).is_none(), "key sets changed");
    }

    /// A flood of distinct verified credentials never grows the table.
    #[test]
    fn the_table_is_bounded_and_live_entries_survive_in_other_sets() {
        let c = Cache::new(64);
        assert_eq!(c.capacity(), 64);
        for i in 0..10_000u32 {
            let mut d = [0u8; 32];
            d[..4].copy_from_slice(&i.to_le_bytes());
            d[8] = i as u8;
            c.insert(entry(d, c.generation(), 1000), 50);
        }
        assert!(c.len() <= 64);
        let mut d = [0u8; 32];
        d[..4].copy_from_slice(&9_999u32.to_le_bytes());
        d[8] = 9_999u32 as u8;
        assert!(c.get(&d, 50).is_some(), "the latest insert is held");
    }

    #[test]
    fn expired_ways_are_reused_before_live_ones() {
        let c = Cache::new(4);
        let g = c.generation();
        let mk = |i: u8| {
            let mut d = [0u8; 32];
            d[31] = i;
            d
        };
        for i in 0..3 {
            c.insert(entry(mk(i), g, 1000), 50);
        }
        c.insert(entry(mk(3), g, 60), 50);
        // Way 3 has expired by 70: the new entry takes it.
        c.insert(entry(mk(4), g, 1000), 70);
        for i in [0, 1, 2, 4] {
            assert!(c.get(&mk(i), 70).is_some(), "{i}");
        }
    }
}
