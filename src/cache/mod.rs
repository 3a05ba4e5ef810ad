//! The row cache: moka in front of a loader closure.
//!
//! Guarantees:
//! - **One load per key at a time.** Concurrent misses for one key wait on a
//!   single loader call (moka's `or_try_insert_with`); the others are reported
//!   as `collapsed`.
//! - **Loads outlive their callers.** The load runs in the caller's task, but
//!   if the caller goes away mid-load (a client disconnects) the unfinished
//!   load is handed to the runtime to complete: the query is not cancelled,
//!   the waiters behind it are answered, the row still lands in the cache.
//!   ([`DetachOnDrop`]; running every load in a spawned task would do the
//!   same at the price of two cross-thread wake-ups per miss.)
//! - **Errors are shared, never cached.** A failed load reaches every waiter
//!   and the next request tries again.
//! - **An invalidation or a clear is never undone by a load.** A load that
//!   was running when its key was invalidated, or the whole cache cleared
//!   (TRUNCATE, admin clear), may have read the old row (or "absent"); it
//!   still answers its waiters, but whatever it stored is removed again.
//!   Every load in flight is registered in an [`Inflight`], which says at
//!   its end whether its key was invalidated meanwhile (see its guarantee).
//! - **Absent rows are remembered separately.** "No such row" goes into a
//!   second, smaller cache with a short TTL, so a flood of absent keys (filter
//!   false positives, deleted rows) cannot evict real rows.
//!
//! The cache knows nothing of the database: the caller passes the loader.
//!
//! # Layout
//! - here: [`RowCache`], the two moka caches and the load protocol;
//! - [`row`]: [`Row`], a row as HTTP sends it (body, ETag, compressed forms);
//! - [`inflight`]: [`Inflight`], the loads running per key and their
//!   invalidations;
//! - [`detach`]: [`DetachOnDrop`], a future that finishes when dropped.

pub mod detach;
pub mod inflight;
pub mod row;

use std::future::Future;
use std::hash::Hash;
use std::sync::Arc;
use std::sync::OnceLock;

use bytes::Bytes;
use futures_util::FutureExt;
use moka::future::Cache;

use crate::config::{CacheBound, CacheConfig};
use crate::encoding::Variant;
pub use detach::DetachOnDrop;
pub use inflight::Inflight;
pub use row::Row;

/// Bytes a cached row costs beyond its representations' buffers (body,
/// ETag and length digits) and its key, for `cache.max_bytes`: the
/// `Arc<Row>` block, the compressed forms' box, moka's entry, its
/// access-order and timer nodes, and its hash-table slot. Measured at ~315
/// with a counting allocator; the margin covers the table's doubling.
/// `tests/memory.rs` asserts that no row, of any width, is charged less
/// than the heap it holds, so a byte budget bounds the heap.
pub const ENTRY_OVERHEAD: usize = 384;

/// Heap bytes a key holds beyond its inline size (a text key's buffer), so
/// that `cache.max_bytes` counts them: moka keeps one copy of each key.
pub trait KeyHeap {
    fn heap_bytes(&self) -> usize;
}

macro_rules! inline_keys {
    ($($t:ty),*) => {$(
        impl KeyHeap for $t {
            fn heap_bytes(&self) -> usize {
                0
            }
        }
    )*};
}
inline_keys!(i32, i64, u32, u64);

/// What one cached row counts against `cache.max_bytes`: every stored
/// representation (identity and each compressed variant, with their tags)
/// and the key, inline and on the heap.
fn row_weight<K: KeyHeap>(key: &K, row: &Row) -> u32 {
    let variants: usize = row
        .variants()
        .iter()
        .map(|v| v.rep.stored_len() + std::mem::size_of::<Variant>())
        .sum();
    let bytes = row.identity.stored_len()
        + variants
        + std::mem::size_of::<K>()
        + key.heap_bytes()
        + ENTRY_OVERHEAD;
    u32::try_from(bytes).unwrap_or(u32::MAX)
}

/// How a lookup was answered, for the `Cache-Status` header and metrics.
#[derive(Debug)]
pub enum Outcome {
    /// Served from the row cache.
    Hit(Arc<Row>),
    /// A recent load found no row; answered from the negative cache.
    NegativeHit,
    /// Loaded now. `collapsed`: another request's load answered this one.
    Loaded { row: Arc<Row>, collapsed: bool },
    /// Loaded now and not found; remembered as a negative entry.
    Absent { collapsed: bool },
    /// The cache is disabled: loaded straight through, nothing stored.
    Bypassed(Option<Arc<Row>>),
}

/// What [`RowCache::cached`] found.
#[derive(Debug)]
pub enum Peek {
    /// A hit or a negative hit.
    Answered(Outcome),
    /// In neither cache: load with [`RowCache::load_missed_with`].
    Missed,
    /// Not asked (the cache is off) or the read would have waited: use
    /// [`RowCache::get_or_load_with`].
    Unknown,
}

/// Why a lookup failed. Holds the loader's error, shared by every waiter.
#[derive(Debug)]
pub enum CacheError<E> {
    Load(Arc<Miss<E>>),
}

impl<E> CacheError<E> {
    /// The loader's error, if that is what failed.
    pub fn source(&self) -> Option<&E> {
        match self {
            CacheError::Load(m) => match &**m {
                Miss::Failed(e) => Some(e),
                Miss::Absent => None,
            },
        }
    }
}

/// What a load that produced no row produced instead. `Absent` travels as an
/// error inside moka only so that it is not stored in the row cache.
#[derive(Debug)]
pub enum Miss<E> {
    Absent,
    Failed(E),
}

/// Row cache and negative cache for one resource.
pub struct RowCache<K> {
    rows: Option<Cache<K, Arc<Row>>>,
    negative: Option<Cache<K, ()>>,
    /// Loads in flight, per key (see the module doc).
    inflight: Arc<Inflight<K>>,
    /// Bodies at least this long are stored compressed too (`None`: never).
    compress_min: Option<usize>,
}

impl<K> RowCache<K>
where
    K: Hash + Eq + Clone + Send + Sync + KeyHeap + 'static,
{
    pub fn new(cfg: &CacheConfig) -> Self {
        if !cfg.enabled {
            return Self {
                rows: None,
                negative: None,
                inflight: Arc::default(),
                compress_min: None,
            };
        }
        let rows = match cfg.bound() {
            CacheBound::Bytes(budget) => Cache::builder()
                .weigher(|key: &K, row: &Arc<Row>| row_weight(key, row))
                .max_capacity(budget),
            CacheBound::Entries(n) => Cache::builder().max_capacity(n),
        }
        .time_to_live(cfg.ttl)
        .build();
        let negative = (!cfg.negative_ttl.is_zero() && cfg.negative_max_entries > 0).then(|| {
            Cache::builder()
                .max_capacity(cfg.negative_max_entries)
                .time_to_live(cfg.negative_ttl)
                .build()
        });
        Self {
            rows: Some(rows),
            negative,
            inflight: Arc::default(),
            compress_min: cfg
                .compression
                .then(|| usize::try_from(cfg.compress_min_bytes.as_u64()).unwrap_or(usize::MAX)),
        }
    }

    /// Answers `key` from the caches, or runs `load` (once, however many
    /// callers are waiting) and caches what it returns: `Some(body)` as a
    /// row, `None` as a negative entry, an error not at all.
    pub async fn get_or_load<F, Fut, E>(&self, key: K, load: F) -> Result<Outcome, CacheError<E>>
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = Result<Option<Bytes>, E>> + Send + 'static,
        E: Send + Sync + 'static,
    {
        self.get_or_load_with(key, move |_: &K| load).await
    }

    /// What the caches hold for `key` right now, without waiting: the read
    /// [`Self::get_or_load_with`] starts with, recorded by moka the same way
    /// (one read per request whichever path answers it: a [`Peek::Missed`]
    /// goes on to [`Self::load_missed_with`], which does not read again).
    ///
    /// Why: a hit needs nothing that waits, and answering it here spares the
    /// request a boxed future and the reference counts that future must own
    /// (`http::dispatch`). moka's read completes at once unless it first has
    /// to resend a write an abandoned caller left while the write channel is
    /// full; then this says [`Peek::Unknown`]. Dropping that read unfinished
    /// is safe: moka's operations are cancel-safe (an interrupted write is
    /// kept and retried by the next caller).
    pub fn cached(&self, key: &K) -> Peek {
        let Some(rows) = self.rows.as_ref() else {
            return Peek::Unknown;
        };
        match rows.get(key).now_or_never() {
            None => Peek::Unknown,
            Some(Some(row)) => Peek::Answered(Outcome::Hit(row)),
            Some(None) => match &self.negative {
                Some(neg) if neg.contains_key(key) => Peek::Answered(Outcome::NegativeHit),
                _ => Peek::Missed,
            },
        }
    }

    /// [`Self::get_or_load_with`] for a key [`Self::cached`] has just found
    /// in neither cache: the load without the reads. A row another request
    /// stored since is still found (moka's entry API answers with it, as a
    /// collapsed load), so this is never staler than reading first.
    pub async fn load_missed_with<M, F, Fut, E>(
        &self,
        key: K,
        make_load: M,
    ) -> Result<Outcome, CacheError<E>>
    where
        M: FnOnce(&K) -> F,
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = Result<Option<Bytes>, E>> + Send + 'static,
        E: Send + Sync + 'static,
    {
        let Some(rows) = &self.rows else {
            return match make_load(&key)().await {
                Ok(row) => Ok(Outcome::Bypassed(row.map(|b| Arc::new(Row::new(b))))),
                Err(e) => Err(CacheError::Load(Arc::new(Miss::Failed(e)))),
            };
        };
        let load = make_load(&key);
        let rows = rows.clone();
        let negative = self.negative.clone();
        let inflight = self.inflight.clone();
        let compress_min = self.compress_min;
        let load_and_store = async move {
            // Only the caller whose closure moka runs sets this, to its
            // load's id: the rest were collapsed onto that load.
            let started = Arc::new(OnceLock::new());
            let started_in_load = started.clone();
            let inflight_in_load = inflight.clone();
            let key_in_load = key.clone();
            let result = rows
                .entry(key.clone())
                .or_try_insert_with(async move {
                    // Registered before the query starts: an invalidation
                    // from here on may concern a row the query already read.
                    let _ = started_in_load.set(inflight_in_load.start(key_in_load));
                    match load().await {
                        // Compressed here, once, by the one caller that
                        // loaded it: hits never compress.
                        Ok(Some(body)) => Ok(Arc::new(Row::compressed(body, compress_min))),
                        Ok(None) => Err(Miss::Absent),
                        Err(e) => Err(Miss::Failed(e)),
                    }
                })
                .await;
            let started = started.get().copied();
            let collapsed = started.is_none();
            let outcome = match result {
                Ok(entry) => Ok(Outcome::Loaded {
                    row: entry.into_value(),
                    collapsed,
                }),
                Err(miss) => match &*miss {
                    Miss::Absent => {
                        if !collapsed && let Some(neg) = &negative {
                            neg.insert(key.clone(), ()).await;
                        }
                        Ok(Outcome::Absent { collapsed })
                    }
                    Miss::Failed(_) => Err(CacheError::Load(miss)),
                },
            };
            if let Some(id) = started {
                // What was stored is in the cache now, so any invalidation
                // after this point removes it by itself; one that came during
                // the load is applied here.
                if inflight.finish(&key, id) {
                    rows.invalidate(&key).await;
                    if let Some(neg) = &negative {
                        neg.invalidate(&key).await;
                    }
                }
            }
            outcome
        };
        DetachOnDrop::new(load_and_store).await
    }

    /// [`Self::get_or_load`] with the loader made by `make_load` from the
    /// key, which runs only when the caches cannot answer. The loader must
    /// own what it uses (it may outlive the caller), and gathering that
    /// costs atomic reference counts on memory every core shares: a hit
    /// should not pay for a load it does not run.
    pub async fn get_or_load_with<M, F, Fut, E>(
        &self,
        key: K,
        make_load: M,
    ) -> Result<Outcome, CacheError<E>>
    where
        M: FnOnce(&K) -> F,
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = Result<Option<Bytes>, E>> + Send + 'static,
        E: Send + Sync + 'static,
    {
        if let Some(rows) = &self.rows {
            if let Some(row) = rows.get(&key).await {
                return Ok(Outcome::Hit(row));
            }
            if let Some(neg) = &self.negative
                && neg.contains_key(&key)
            {
                return Ok(Outcome::NegativeHit);
            }
        }
        self.load_missed_with(key, make_load).await
    }

    /// Forgets `key` in both caches, including what a load running right now
    /// for it would store.
    pub async fn invalidate(&self, key: &K) {
        self.inflight.invalidate(key);
        if let Some(rows) = &self.rows {
            rows.invalidate(key).await;
        }
        if let Some(neg) = &self.negative {
            neg.invalidate(key).await;
        }
    }

    /// Forgets everything, including what the loads running right now would
    /// store.
    pub fn clear(&self) {
        // Marked before the entries go: a load that stores after this point
        // finds its mark dirty and removes what it stored.
        self.inflight.invalidate_all();
        if let Some(rows) = &self.rows {
            rows.invalidate_all();
        }
        if let Some(neg) = &self.negative {
            neg.invalidate_all();
        }
    }

    /// Applies moka's pending bookkeeping, so the counts below are current
    /// (for scrapes; the request path never needs it).
    pub async fn sync(&self) {
        if let Some(rows) = &self.rows {
            rows.run_pending_tasks().await;
        }
        if let Some(neg) = &self.negative {
            neg.run_pending_tasks().await;
        }
    }

    /// Weighted size of the row cache: bytes as [`ENTRY_OVERHEAD`]'s doc
    /// counts them when bounded by bytes (the default), otherwise one per
    /// row.
    pub fn weighted_size(&self) -> u64 {
        self.rows.as_ref().map_or(0, |c| c.weighted_size())
    }

    /// (rows, negative entries) currently held; approximate, as moka's are.
    pub fn entry_counts(&self) -> (u64, u64) {
        (
            self.rows.as_ref().map_or(0, |c| c.entry_count()),
            self.negative.as_ref().map_or(0, |c| c.entry_count()),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::time::Duration;

    fn cfg() -> CacheConfig {
        CacheConfig {
            enabled: true,
            max_entries: Some(100),
            max_bytes: None,
            ttl: Duration::from_secs(60),
            negative_ttl: Duration::from_secs(60),
            negative_max_entries: 100,
            ..CacheConfig::default()
        }
    }

    type Loads = Arc<AtomicUsize>;
    type LoadFuture =
        std::pin::Pin<Box<dyn Future<Output = Result<Option<Bytes>, &'static str>> + Send>>;

    /// Key `key` answered from the cache with `cached`, the loader (which
    /// would give `other`) not run: one load so far, the first.
    async fn assert_hit(
        c: &RowCache<i64>,
        key: i64,
        loads: &Loads,
        other: &'static str,
        cached: &str,
    ) {
        match c
            .get_or_load(key, loader(loads, Ok(Some(other)), 0))
            .await
            .unwrap()
        {
            Outcome::Hit(r) => assert_eq!(r.body(), cached.as_bytes()),
            o => panic!("key {key}: {o:?}"),
        }
        assert_eq!(loads.load(Ordering::SeqCst), 1);
    }

    fn loader(
        loads: &Loads,
        result: Result<Option<&'static str>, &'static str>,
        delay_ms: u64,
    ) -> impl FnOnce() -> LoadFuture + Send + 'static {
        let loads = loads.clone();
        move || {
            Box::pin(async move {
                loads.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(delay_ms)).await;
                result.map(|o| o.map(|s: &'static str| Bytes::from_static(s.as_bytes())))
            })
        }
    }

    #[tokio::test]
    async fn miss_then_hit() {
        let c = RowCache::new(&cfg());
        let loads = Loads::default();
        let o = c
            .get_or_load(1, loader(&loads, Ok(Some("a")), 0))
            .await
            .unwrap();
        assert!(matches!(
            o,
            Outcome::Loaded {
                collapsed: false,
                ..
            }
        ));
        assert_hit(&c, 1, &loads, "b", "a").await;
    }

    #[tokio::test]
    async fn absent_is_cached_negatively_and_separately() {
        let c = RowCache::new(&cfg());
        let loads = Loads::default();
        let o = c.get_or_load(7, loader(&loads, Ok(None), 0)).await.unwrap();
        assert!(matches!(o, Outcome::Absent { collapsed: false }));
        let o = c
            .get_or_load(7, loader(&loads, Ok(Some("x")), 0))
            .await
            .unwrap();
        assert!(matches!(o, Outcome::NegativeHit));
        assert_eq!(loads.load(Ordering::SeqCst), 1);
        c.invalidate(&7).await;
        let o = c
            .get_or_load(7, loader(&loads, Ok(Some("x")), 0))
            .await
            .unwrap();
        assert!(matches!(o, Outcome::Loaded { .. }));
    }

    /// `cached` answers what `get_or_load` would answer without a load, and
    /// nothing else: no row before a load, none after an invalidation or a
    /// clear, and never with the cache off.
    #[tokio::test]
    async fn cached_answers_hits_and_negative_hits_only() {
        let c = RowCache::new(&cfg());
        let loads = Loads::default();
        assert!(matches!(c.cached(&1), Peek::Missed));
        c.get_or_load(1, loader(&loads, Ok(Some("a")), 0))
            .await
            .unwrap();
        c.get_or_load(2, loader(&loads, Ok(None), 0)).await.unwrap();
        match c.cached(&1) {
            Peek::Answered(Outcome::Hit(row)) => assert_eq!(row.body(), b"a"),
            other => panic!("{other:?}"),
        }
        assert!(matches!(c.cached(&2), Peek::Answered(Outcome::NegativeHit)));
        assert!(matches!(c.cached(&3), Peek::Missed));
        c.invalidate(&1).await;
        assert!(matches!(c.cached(&1), Peek::Missed));
        c.clear();
        assert!(matches!(c.cached(&2), Peek::Missed));
        let off = RowCache::new(&CacheConfig {
            enabled: false,
            ..cfg()
        });
        off.get_or_load(1, loader(&loads, Ok(Some("a")), 0))
            .await
            .unwrap();
        assert!(matches!(off.cached(&1), Peek::Unknown));
    }

    /// After a missed peek the load path does not read again, yet a row
    /// stored in between is still what it answers (not a second load).
    #[tokio::test]
    async fn a_load_after_a_missed_peek_still_finds_a_row_stored_since() {
        let c = RowCache::new(&cfg());
        let loads = Loads::default();
        assert!(matches!(c.cached(&1), Peek::Missed));
        c.get_or_load(1, loader(&loads, Ok(Some("a")), 0))
            .await
            .unwrap();
        let o = c
            .load_missed_with(1, |_: &u64| loader(&loads, Ok(Some("b")), 0))
            .await
            .unwrap();
        match o {
            Outcome::Loaded {
                row,
                collapsed: true,
            } => assert_eq!(row.body(), b"a"),
            other => panic!("{other:?}"),
        }
        assert_eq!(loads.load(Ordering::SeqCst), 1, "no second load");
        let o = c
            .load_missed_with(2, |_: &u64| loader(&loads, Ok(None), 0))
            .await
            .unwrap();
        assert!(matches!(o, Outcome::Absent { collapsed: false }));
        assert!(matches!(c.cached(&2), Peek::Answered(Outcome::NegativeHit)));
    }

    #[tokio::test]
    async fn the_loader_is_made_only_when_the_caches_cannot_answer() {
        let c = RowCache::new(&cfg());
        let loads = Loads::default();
        let made = AtomicUsize::new(0);
        let (made, loads) = (&made, &loads);
        let get = |key: u64, body: Option<&'static str>| {
            c.get_or_load_with(key, move |k: &u64| {
                assert_eq!(*k, key, "made for the key asked");
                made.fetch_add(1, Ordering::SeqCst);
                loader(loads, Ok(body), 0)
            })
        };
        assert!(matches!(
            get(1, Some("a")).await.unwrap(),
            Outcome::Loaded { .. }
        ));
        assert!(matches!(
            get(2, None).await.unwrap(),
            Outcome::Absent { .. }
        ));
        assert_eq!(made.load(Ordering::SeqCst), 2, "one per miss");
        assert!(matches!(get(1, Some("a")).await.unwrap(), Outcome::Hit(_)));
        assert!(matches!(get(2, None).await.unwrap(), Outcome::NegativeHit));
        assert_eq!(
            made.load(Ordering::SeqCst),
            2,
            "none for a hit or a negative hit"
        );
    }

    #[tokio::test]
    async fn concurrent_misses_make_one_load() {
        let c = Arc::new(RowCache::new(&cfg()));
        let loads = Loads::default();
        let mut tasks = Vec::new();
        for _ in 0..50 {
            let c = c.clone();
            let l = loader(&loads, Ok(Some("row")), 50);
            tasks.push(tokio::spawn(async move { c.get_or_load(3, l).await }));
        }
        let mut collapsed = 0;
        for t in tasks {
            match t.await.unwrap().unwrap() {
                Outcome::Loaded {
                    collapsed: true, ..
                } => collapsed += 1,
                Outcome::Loaded { .. } | Outcome::Hit(_) => {}
                o => panic!("{o:?}"),
            }
        }
        assert_eq!(loads.load(Ordering::SeqCst), 1);
        assert!(collapsed >= 1);
    }

    #[tokio::test]
    async fn errors_reach_every_waiter_and_are_not_cached() {
        let c = Arc::new(RowCache::new(&cfg()));
        let loads = Loads::default();
        let mut tasks = Vec::new();
        for _ in 0..10 {
            let c = c.clone();
            let l = loader(&loads, Err("db down"), 30);
            tasks.push(tokio::spawn(async move { c.get_or_load(5, l).await }));
        }
        for t in tasks {
            let e = t.await.unwrap().unwrap_err();
            assert_eq!(e.source(), Some(&"db down"));
        }
        assert_eq!(loads.load(Ordering::SeqCst), 1);
        let o = c
            .get_or_load(5, loader(&loads, Ok(Some("ok")), 0))
            .await
            .unwrap();
        assert!(matches!(o, Outcome::Loaded { .. }));
        assert_eq!(loads.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_cancelled_caller_does_not_cancel_the_load() {
        let c = Arc::new(RowCache::new(&cfg()));
        let loads = Loads::default();
        let first = {
            let c = c.clone();
            let l = loader(&loads, Ok(Some("row")), 100);
            tokio::spawn(async move { c.get_or_load(9, l).await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        first.abort();
        tokio::time::sleep(Duration::from_millis(150)).await;
        // The abandoned load was cached.
        assert_hit(&c, 9, &loads, "other", "row").await;
    }

    #[tokio::test]
    async fn an_invalidation_during_a_load_is_not_undone() {
        for found in [true, false] {
            let c = Arc::new(RowCache::new(&cfg()));
            let loads = Loads::default();
            let old = if found { Ok(Some("old")) } else { Ok(None) };
            let slow = {
                let c = c.clone();
                let l = loader(&loads, old, 100);
                tokio::spawn(async move { c.get_or_load(4, l).await })
            };
            tokio::time::sleep(Duration::from_millis(30)).await;
            // The row changes while the load that read the old one runs.
            c.invalidate(&4).await;
            let _ = slow.await.unwrap().unwrap();
            let o = c
                .get_or_load(4, loader(&loads, Ok(Some("new")), 0))
                .await
                .unwrap();
            match o {
                Outcome::Loaded { row, .. } => assert_eq!(row.body(), b"new"),
                o => panic!("stale entry survived the invalidation ({found}): {o:?}"),
            }
        }
    }

    /// A loader that reports when it has started and returns `result` only
    /// when `release` fires: the test decides what happens during the query.
    fn gated(
        result: Option<&'static str>,
    ) -> (
        impl FnOnce() -> LoadFuture + Send + 'static,
        tokio::sync::oneshot::Receiver<()>,
        tokio::sync::oneshot::Sender<()>,
    ) {
        let (started_tx, started) = tokio::sync::oneshot::channel();
        let (release, release_rx) = tokio::sync::oneshot::channel::<()>();
        let load = move || -> LoadFuture {
            Box::pin(async move {
                let _ = started_tx.send(());
                let _ = release_rx.await;
                Ok(result.map(|s| Bytes::from_static(s.as_bytes())))
            })
        };
        (load, started, release)
    }

    #[tokio::test]
    async fn a_clear_during_a_load_is_not_undone() {
        for old in [Some("old"), None] {
            let c = Arc::new(RowCache::new(&cfg()));
            let (load, started, release) = gated(old);
            let slow = {
                let c = c.clone();
                tokio::spawn(async move { c.get_or_load(4, load).await })
            };
            started.await.unwrap();
            // TRUNCATE (or an admin clear) while the query that read the
            // old state runs.
            c.clear();
            release.send(()).unwrap();
            let _ = slow.await.unwrap().unwrap();
            let loads = Loads::default();
            let o = c
                .get_or_load(4, loader(&loads, Ok(Some("new")), 0))
                .await
                .unwrap();
            match o {
                Outcome::Loaded { row, .. } => assert_eq!(row.body(), b"new"),
                o => panic!("what a load read before the clear survived it ({old:?}): {o:?}"),
            }
        }
    }

    /// Two loads of one key overlap when the first ends without a row: moka
    /// lets the next caller start its own load before the first has
    /// finished its bookkeeping. Neither may erase or consume the other's
    /// record of an invalidation. The overlap is a narrow window, so this
    /// runs many rounds on two threads with a second caller hammering the
    /// key as the first load ends; each round checks that no negative entry
    /// from before the invalidation survives it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn overlapping_loads_of_one_key_keep_each_invalidation() {
        for round in 0..2000 {
            let c = Arc::new(RowCache::new(&cfg()));
            let (load, started, release) = gated(None);
            let first = {
                let c = c.clone();
                tokio::spawn(async move { c.get_or_load(1, load).await })
            };
            started.await.unwrap();
            // The row is inserted (and announced) while the first load,
            // which read "absent", is still running.
            c.invalidate(&1).await;
            let stop = Arc::new(AtomicBool::new(false));
            let hammer = {
                let (c, stop) = (c.clone(), stop.clone());
                tokio::spawn(async move {
                    let loads = Loads::default();
                    while !stop.load(Ordering::Relaxed) {
                        let _ = c.get_or_load(1, loader(&loads, Ok(Some("new")), 0)).await;
                        tokio::task::yield_now().await;
                    }
                })
            };
            release.send(()).unwrap();
            let _ = first.await.unwrap();
            stop.store(true, Ordering::Relaxed);
            hammer.await.unwrap();
            // The hammer's loads read after the invalidation and found the
            // row, so a negative entry can only be the first load's: stale.
            let neg = c.negative.as_ref().unwrap();
            neg.run_pending_tasks().await;
            assert!(
                !neg.contains_key(&1),
                "round {round}: the first load's \"absent\" outlived the invalidation during it"
            );
            assert!(
                c.inflight.is_empty(),
                "round {round}: a mark outlived its load"
            );
        }
    }

    #[tokio::test]
    async fn disabled_cache_loads_every_time() {
        let c = RowCache::new(&CacheConfig {
            enabled: false,
            ..cfg()
        });
        let loads = Loads::default();
        for _ in 0..3 {
            let o = c
                .get_or_load(1, loader(&loads, Ok(Some("a")), 0))
                .await
                .unwrap();
            assert!(matches!(o, Outcome::Bypassed(Some(_))));
        }
        assert_eq!(loads.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn a_byte_budget_bounds_the_rows_whatever_their_count() {
        let budget = 64 * 1024;
        let c = RowCache::new(&CacheConfig {
            max_entries: None,
            max_bytes: Some(bytesize::ByteSize::b(budget)),
            ..cfg()
        });
        let body: &'static str = Box::leak("x".repeat(1024).into_boxed_str());
        let loads = Loads::default();
        for k in 0..500 {
            let o = c.get_or_load(k, loader(&loads, Ok(Some(body)), 0)).await;
            assert!(matches!(o, Ok(Outcome::Loaded { .. })), "{o:?}");
            // Bookkeeping after each insert, as a busy cache would run it.
            c.sync().await;
            assert!(
                c.weighted_size() <= budget,
                "{} bytes held against a budget of {budget}",
                c.weighted_size()
            );
        }
        let per_row = row_weight(&0i32, &Row::new(Bytes::from_static(body.as_bytes()))) as u64;
        let (rows, _) = c.entry_counts();
        assert!(rows <= budget / per_row, "{rows} rows of {per_row} bytes");
        // Evicted for size, not refused: most of the budget is in use.
        assert!(
            rows * per_row > budget / 2,
            "{rows} rows of {per_row} bytes"
        );
    }

    #[tokio::test]
    async fn a_row_over_the_whole_budget_is_served_but_not_kept() {
        let c = RowCache::new(&CacheConfig {
            max_bytes: Some(bytesize::ByteSize::kib(64)),
            ..cfg()
        });
        let huge: &'static str = Box::leak("y".repeat(100 * 1024).into_boxed_str());
        let loads = Loads::default();
        for _ in 0..2 {
            let o = c.get_or_load(7, loader(&loads, Ok(Some(huge)), 0)).await;
            match o {
                Ok(Outcome::Loaded { row, .. }) => assert_eq!(row.body().len(), huge.len()),
                o => panic!("{o:?}"),
            }
            c.sync().await;
        }
        assert_eq!(loads.load(Ordering::SeqCst), 2, "the huge row was cached");
        assert_eq!(c.weighted_size(), 0);
    }

    #[tokio::test]
    async fn every_stored_variant_counts_against_the_byte_budget() {
        let body = Bytes::from("the quick brown fox ".repeat(200));
        let row = Row::compressed(body.clone(), Some(1024));
        assert_eq!(row.variants().len(), 3);
        let variants: usize = row.variants().iter().map(|v| v.rep.body().len()).sum();
        let plain = row_weight(&0i32, &Row::new(body)) as usize;
        assert!(row_weight(&0i32, &row) as usize >= plain + variants);
        // Through the cache: the weighed size is what the variants add up to.
        let c = RowCache::new(&CacheConfig {
            max_bytes: Some(bytesize::ByteSize::mib(1)),
            ..cfg()
        });
        let loads = Loads::default();
        let text: &'static str = Box::leak("the quick brown fox ".repeat(200).into_boxed_str());
        let o = c.get_or_load(1, loader(&loads, Ok(Some(text)), 0)).await;
        match o {
            Ok(Outcome::Loaded { row, .. }) => assert_eq!(row.variants().len(), 3),
            o => panic!("{o:?}"),
        }
        c.sync().await;
        assert_eq!(c.weighted_size(), u64::from(row_weight(&0i32, &row)));
    }
}
