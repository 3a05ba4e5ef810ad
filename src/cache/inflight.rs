//! [`Inflight`]: the row loads running right now, per key, and whether
//! each one's key was invalidated while it ran.
//!
//! # Guarantee
//! [`Inflight::finish`] for a load answers `true` exactly when
//! [`Inflight::invalidate`] of its key, or [`Inflight::invalidate_all`],
//! was called between that load's [`Inflight::start`] and its `finish`.
//! Loads of one key may overlap (moka stops tracking a load that ended
//! without a row before its caller has finished with it): each has its own
//! mark, so one load's `finish` never resets or consumes another's
//! invalidation. Nothing is kept for a key once its last load has finished.
//!
//! The cache uses it so that an invalidation during a load is never undone
//! by what that load stores: a load whose `finish` says `true` removes
//! what it stored (`RowCache::load_missed_with`).
//!
//! Touched only on misses, invalidations and clears, never on hits.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

/// The loads in flight of one cache; see the module doc.
#[derive(Debug)]
pub struct Inflight<K> {
    marks: Mutex<HashMap<K, Vec<Mark>>>,
}

/// One load in flight: which one, and whether its key was invalidated (or
/// the cache cleared) since it started.
#[derive(Debug)]
struct Mark {
    id: LoadId,
    dirty: bool,
}

/// A load, as [`Inflight::start`] registered it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoadId(u64);

/// Ids for [`LoadId`]s: unique per process, so one cache's are too.
static LOAD_IDS: AtomicU64 = AtomicU64::new(0);

impl<K> Default for Inflight<K> {
    fn default() -> Self {
        Self {
            marks: Mutex::default(),
        }
    }
}

impl<K: Hash + Eq> Inflight<K> {
    /// Registers a load of `key`, before its query starts: an invalidation
    /// from here on may concern a row the query already read.
    pub fn start(&self, key: K) -> LoadId {
        let id = LoadId(LOAD_IDS.fetch_add(1, Ordering::Relaxed));
        self.lock()
            .entry(key)
            .or_default()
            .push(Mark { id, dirty: false });
        id
    }

    /// Marks every load of `key` running now.
    pub fn invalidate(&self, key: &K) {
        if let Some(marks) = self.lock().get_mut(key) {
            for m in marks {
                m.dirty = true;
            }
        }
    }

    /// Marks every load running now.
    pub fn invalidate_all(&self) {
        for m in self.lock().values_mut().flatten() {
            m.dirty = true;
        }
    }

    /// Forgets load `id` of `key`; returns whether it was marked.
    pub fn finish(&self, key: &K, id: LoadId) -> bool {
        let mut map = self.lock();
        let Some(marks) = map.get_mut(key) else {
            return false;
        };
        let dirty = marks
            .iter()
            .position(|m| m.id == id)
            .is_some_and(|i| marks.swap_remove(i).dirty);
        if marks.is_empty() {
            map.remove(key);
        }
        dirty
    }

    /// No load is registered.
    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<K, Vec<Mark>>> {
        // A panic while holding this lock cannot leave the map inconsistent.
        self.marks.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[derive(Clone, Debug)]
    enum Op {
        Start(u8),
        /// Finishes the n-th load still running (modulo their number).
        Finish(usize),
        Invalidate(u8),
        InvalidateAll,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u8..3).prop_map(Op::Start),
            (0usize..8).prop_map(Op::Finish),
            (0u8..3).prop_map(Op::Invalidate),
            Just(Op::InvalidateAll),
        ]
    }

    proptest! {
        /// Against the guarantee written plainly: a load is dirty when an
        /// invalidation of its key (or of all) came after its start.
        #[test]
        fn finish_says_whether_the_key_was_invalidated_during_the_load(
            ops in prop::collection::vec(op(), 0..64),
        ) {
            let inflight = Inflight::default();
            // The model: each running load's key and its invalidated flag.
            let mut running: Vec<(u8, LoadId, bool)> = Vec::new();
            for op in ops {
                match op {
                    Op::Start(k) => running.push((k, inflight.start(k), false)),
                    Op::Finish(n) if !running.is_empty() => {
                        let (k, id, dirty) = running.remove(n % running.len());
                        prop_assert_eq!(inflight.finish(&k, id), dirty);
                    }
                    Op::Finish(_) => {}
                    Op::Invalidate(k) => {
                        inflight.invalidate(&k);
                        for r in running.iter_mut().filter(|r| r.0 == k) {
                            r.2 = true;
                        }
                    }
                    Op::InvalidateAll => {
                        inflight.invalidate_all();
                        for r in &mut running {
                            r.2 = true;
                        }
                    }
                }
            }
            for (k, id, dirty) in running.drain(..) {
                prop_assert_eq!(inflight.finish(&k, id), dirty);
            }
            prop_assert!(inflight.is_empty(), "a mark outlived its load");
        }
    }

    #[test]
    fn a_finished_load_is_forgotten_and_finishing_twice_is_clean() {
        let inflight = Inflight::default();
        let a = inflight.start("k");
        let b = inflight.start("k");
        inflight.invalidate(&"k");
        let c = inflight.start("k");
        assert!(inflight.finish(&"k", a));
        assert!(!inflight.finish(&"k", a), "already forgotten");
        assert!(!inflight.finish(&"k", c), "started after the invalidation");
        assert!(inflight.finish(&"k", b));
        assert!(inflight.is_empty());
    }
}
