//! `Counter`: a monotonic count that request threads add to without writing
//! memory another core writes, and the thread-to-shard assignment it shares
//! with [`crate::histogram`].
//!
//! # Guarantees
//! - [`Counter::get`] is the sum of every [`Counter::add`] that happened
//!   before it (in the happens-before sense); adds racing with it may or may
//!   not be in it. The count never goes down, so a later `get` is never
//!   below an earlier one from the same thread.
//! - `add` takes no lock and never waits: one relaxed atomic addition to the
//!   calling thread's shard.
//!
//! # Why
//! A plain `AtomicU64` bumped on every cached hit and filtered 404 is one
//! cache line that both cores write per request: each write takes the line
//! from the other core, and every other field on that line (the resource's
//! filter pointer and configuration, read on the same path) goes with it.
//! Sharded by thread, each core keeps its own line; a scrape, which is rare,
//! adds the shards up.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// Shards per counter and per histogram. Threads are given shards
/// round-robin as they first record; more threads than shards share one
/// (still exact, since every update is an atomic addition, only slower).
/// Tokio's workers are one per core.
pub const SHARDS: usize = 8;

/// The calling thread's shard, assigned on its first call.
pub fn shard() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static INDEX: Cell<usize> = const { Cell::new(usize::MAX) };
    }
    INDEX.with(|i| {
        let mut v = i.get();
        if v == usize::MAX {
            v = NEXT.fetch_add(1, Ordering::Relaxed) % SHARDS;
            i.set(v);
        }
        v
    })
}

/// 128 bytes, two cache lines (for the adjacent-line prefetcher), so that no
/// two shards share one.
#[repr(align(128))]
#[derive(Default)]
struct Shard(AtomicU64);

pub struct Counter {
    shards: Box<[Shard]>,
}

impl Default for Counter {
    fn default() -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Shard::default()).collect(),
        }
    }
}

impl std::fmt::Debug for Counter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.get())
    }
}

impl Counter {
    pub fn add(&self, n: u64) {
        self.shards[shard()].0.fetch_add(n, Ordering::Relaxed);
    }

    pub fn get(&self) -> u64 {
        self.shards
            .iter()
            .map(|s| s.0.load(Ordering::Relaxed))
            .fold(0, u64::wrapping_add)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn adds_from_more_threads_than_shards_are_all_counted() {
        let c = Arc::new(Counter::default());
        let threads: Vec<_> = (0..SHARDS as u64 + 3)
            .map(|t| {
                let c = c.clone();
                std::thread::spawn(move || {
                    for _ in 0..1000 {
                        c.add(t + 1);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let n = SHARDS as u64 + 3;
        assert_eq!(c.get(), 1000 * n * (n + 1) / 2);
    }

    #[test]
    fn threads_get_different_shards_round_robin() {
        let here = shard();
        assert_eq!(shard(), here, "a thread keeps its shard");
        let others: Vec<usize> = (0..SHARDS - 1)
            .map(|_| std::thread::spawn(shard).join().unwrap())
            .collect();
        // Other tests' threads take shards too, so only this holds: a
        // thread's shard is in range, and the assignment is not all one.
        assert!(others.iter().all(|&s| s < SHARDS));
        let mut distinct = others.clone();
        distinct.push(here);
        distinct.sort_unstable();
        distinct.dedup();
        assert!(distinct.len() > 1, "{others:?}");
    }

    #[test]
    fn shards_do_not_share_a_cache_line() {
        assert!(std::mem::align_of::<Shard>() >= 128);
        let c = Counter::default();
        let a = &c.shards[0] as *const Shard as usize;
        let b = &c.shards[1] as *const Shard as usize;
        assert!(b - a >= 128);
    }
}
