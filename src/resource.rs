//! A resource: one table served by key, with its filter, cache and queries.
//!
//! This is where the request path is put together, in order: the parsed key
//! goes to the filter (absent: answered at once), then to the cache, whose
//! loader closure is the only thing here that reaches the database.
//!
//! # The filter is never missing a key
//! A real row must never be rejected. Keys reach the filter two ways: a full
//! scan (start-up and every rebuild) and live inserts ([`Resource::insert_key`],
//! fed by whoever learns of new rows). A rebuild scans into a *new* filter
//! while the old one keeps serving, then swaps. A key inserted live during
//! that window would be in the old filter only, so live inserts are also
//! recorded in a journal that exists exactly while a rebuild runs:
//!
//! 1. the rebuild opens the journal, *then* takes its snapshot;
//! 2. `insert_key` writes to the current filter and the journal under the
//!    journal's lock;
//! 3. the rebuild, holding that lock, replays the journal into the new filter
//!    and swaps it in, then closes the journal.
//!
//! A key inserted before step 1 is in the snapshot (its row committed before
//! it was announced); one inserted between 1 and 3 is replayed; one inserted
//! after 3 goes into the new filter directly. Since step 3 holds the lock, no
//! insert can land between "replayed" and "swapped".

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use arc_swap::ArcSwapOption;
use serde::Serialize;

use crate::budget::TokenBucket;
use crate::cache::{Outcome, RowCache};
use crate::config::Resolved;
use crate::db::{Db, DbError, Queries};
use crate::error::Error;
use crate::filter::{FilterKey, FilterStats, Item, KeySet, KeySetBuilder};
use crate::key::{self, Key, KeyType};
use crate::telemetry::LogThrottle;

/// How a lookup was answered.
#[derive(Debug)]
pub enum Lookup {
    /// The filter knows the key does not exist: nothing else was asked.
    Filtered,
    /// The cache answered, or loaded through to the database.
    Cached(Outcome),
}

/// Counters for metrics and the admin API. Monotonic.
#[derive(Debug, Default)]
pub struct Stats {
    pub filtered: AtomicU64,
    pub hits: AtomicU64,
    pub negative_hits: AtomicU64,
    pub loads: AtomicU64,
    pub collapsed: AtomicU64,
    /// The filter said "maybe" and the database said "no": observed false
    /// positives (and deleted rows the filter still holds).
    pub observed_absent: AtomicU64,
    pub unavailable: AtomicU64,
    pub not_ready: AtomicU64,
    pub bad_requests: AtomicU64,
    pub rebuilds: AtomicU64,
    pub rebuild_failures: AtomicU64,
    pub refused_swaps: AtomicU64,
    pub live_inserts: AtomicU64,
    /// Keys above the high-water mark checked against the database instead
    /// of rejected (`verify_above_high_water`).
    pub verified_above_high_water: AtomicU64,
}

impl Stats {
    /// Lookups by outcome, in `metrics::OUTCOMES` order.
    pub fn by_outcome(&self) -> [u64; 8] {
        [
            &self.filtered,
            &self.hits,
            &self.negative_hits,
            &self.loads,
            &self.collapsed,
            &self.bad_requests,
            &self.unavailable,
            &self.not_ready,
        ]
        .map(|a| a.load(Ordering::Relaxed))
    }
}

/// What the last successful build did.
#[derive(Clone, Debug, Serialize)]
pub struct BuildReport {
    pub generation: u64,
    pub keys: u64,
    pub rows_counted: u64,
    pub replayed: u64,
    pub duration_ms: u64,
    #[serde(with = "humantime_serde")]
    pub built_at: SystemTime,
    pub filter: FilterStats,
}

#[derive(Debug, thiserror::Error)]
pub enum RebuildError {
    #[error("database: {0}")]
    Db(#[from] DbError),
    #[error("filter: {0}")]
    Filter(#[from] crate::filter::FilterError),
    #[error(
        "refused: the new scan found {new} keys, fewer than {min} ({old} now, max_shrink {max_shrink}); force the rebuild if this is intended"
    )]
    Shrunk {
        old: u64,
        new: u64,
        min: u64,
        max_shrink: f64,
    },
    #[error("{0} key values did not convert to the key type")]
    BadValues(u64),
    #[error("the filter is disabled for this resource")]
    Disabled,
}

impl RebuildError {
    /// A mistake in the config or schema (missing table or column, wrong
    /// type): retrying will not help, unlike an unreachable database.
    pub fn is_permanent(&self) -> bool {
        match self {
            RebuildError::Db(DbError::Sqlx(sqlx::Error::Database(e))) => {
                // Class 42: syntax error or access rule violation
                // (undefined table/column, type mismatch, permission).
                e.code().is_some_and(|c| c.starts_with("42"))
            }
            RebuildError::BadValues(_) => true,
            _ => false,
        }
    }
}

pub struct Resource {
    pub config: Resolved,
    queries: Queries,
    db: Arc<Db>,
    filter: ArcSwapOption<KeySet>,
    cache: RowCache<Key>,
    /// Open (Some) exactly while a rebuild runs; see the module doc.
    journal: Mutex<Option<Vec<Key>>>,
    /// One rebuild at a time per resource.
    rebuilding: tokio::sync::Mutex<()>,
    last_build: Mutex<Option<BuildReport>>,
    generation: AtomicU64,
    /// The highest integer key the filter has been given.
    high_water: AtomicI64,
    verify_budget: TokenBucket,
    /// "row load failed" at most once per interval: in an outage every cold
    /// key fails (the count is in `stats.unavailable`).
    load_failure_log: LogThrottle,
    pub stats: Stats,
}

impl Resource {
    pub fn new(config: Resolved, db: Arc<Db>) -> Self {
        let queries = Queries::new(
            &config.table,
            &config.key_column,
            config.key_type.sql_type(),
            &config.columns,
        );
        let verify_budget = TokenBucket::new(config.filter.verify_budget);
        Self {
            queries,
            cache: RowCache::new(&config.cache),
            config,
            db,
            filter: ArcSwapOption::empty(),
            journal: Mutex::new(None),
            rebuilding: tokio::sync::Mutex::new(()),
            last_build: Mutex::new(None),
            generation: AtomicU64::new(0),
            high_water: AtomicI64::new(i64::MIN),
            verify_budget,
            load_failure_log: LogThrottle::default(),
            stats: Stats::default(),
        }
    }

    pub fn name(&self) -> &str {
        &self.config.name
    }

    pub fn key_type(&self) -> KeyType {
        self.config.key_type
    }

    /// Ready to answer: the filter is built, or there is none to build.
    pub fn is_ready(&self) -> bool {
        !self.config.filter.enabled || self.filter.load().is_some()
    }

    /// Parses a raw path segment for this resource's key type.
    pub fn parse_key(&self, raw: &str, max_len: usize) -> Result<Key, Error> {
        key::parse(raw, self.config.key_type, max_len).map_err(|e| {
            self.stats.bad_requests.fetch_add(1, Ordering::Relaxed);
            Error::BadKey(e)
        })
    }

    /// Filter, then cache, then database.
    pub async fn lookup(&self, key: Key) -> Result<Lookup, Error> {
        let mut verifying = false;
        if self.config.filter.enabled {
            let filter = self.filter.load();
            let Some(filter) = filter.as_ref() else {
                self.stats.not_ready.fetch_add(1, Ordering::Relaxed);
                return Err(Error::NotReady);
            };
            if !filter.contains(key.item()) {
                if !self.may_verify(&key) {
                    self.stats.filtered.fetch_add(1, Ordering::Relaxed);
                    return Ok(Lookup::Filtered);
                }
                verifying = true;
                self.stats
                    .verified_above_high_water
                    .fetch_add(1, Ordering::Relaxed);
            }
        }
        let result = self.load_through_cache(key.clone()).await;
        if verifying && let Ok(Lookup::Cached(Outcome::Loaded { .. })) = &result {
            // The row exists and its notification has not arrived yet.
            self.add_to_filter(&key);
        }
        result
    }

    /// A rejected key above the high-water mark may be a row committed a
    /// moment ago; check it against the database while the budget allows.
    fn may_verify(&self, key: &Key) -> bool {
        self.config.filter.verify_above_high_water
            && matches!(key, Key::Int(v) if *v > self.high_water.load(Ordering::Relaxed))
            && self.verify_budget.try_take()
    }

    async fn load_through_cache(&self, key: Key) -> Result<Lookup, Error> {
        let db = self.db.clone();
        let sql = self.queries.row.clone();
        let k = key.clone();
        let load = move || async move {
            match k {
                Key::Int(v) => db.fetch_json(&sql, v).await,
                Key::Uuid(u) => db.fetch_json(&sql, u).await,
                Key::Text(s) => db.fetch_json(&sql, s.to_string()).await,
            }
        };
        match self.cache.get_or_load(key, load).await {
            Ok(outcome) => {
                let s = &self.stats;
                match &outcome {
                    Outcome::Hit(_) => {
                        s.hits.fetch_add(1, Ordering::Relaxed);
                    }
                    Outcome::NegativeHit => {
                        s.negative_hits.fetch_add(1, Ordering::Relaxed);
                    }
                    Outcome::Loaded { collapsed, .. } => self.count_load(*collapsed, false),
                    Outcome::Absent { collapsed } => self.count_load(*collapsed, true),
                    Outcome::Bypassed(row) => self.count_load(false, row.is_none()),
                }
                Ok(Lookup::Cached(outcome))
            }
            Err(e) => {
                self.stats.unavailable.fetch_add(1, Ordering::Relaxed);
                let detail = match e.source() {
                    Some(db) => db.to_string(),
                    None => "load aborted".to_string(),
                };
                if let Some(not_logged) = self.load_failure_log.permit() {
                    tracing::warn!(
                        resource = %self.config.name,
                        error = %detail,
                        not_logged,
                        "row load failed (at most one such line per 10 s; not_logged counts the rest)"
                    );
                }
                Err(Error::Unavailable(detail))
            }
        }
    }

    fn count_load(&self, collapsed: bool, absent: bool) {
        let s = &self.stats;
        if collapsed {
            s.collapsed.fetch_add(1, Ordering::Relaxed);
        } else {
            s.loads.fetch_add(1, Ordering::Relaxed);
            if absent && self.config.filter.enabled {
                s.observed_absent.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Adds a key that now exists (a row was inserted or re-keyed) to the
    /// live filter, and forgets any negative entry for it.
    pub async fn insert_key(&self, key: &Key) {
        self.add_to_filter(key);
        self.stats.live_inserts.fetch_add(1, Ordering::Relaxed);
        self.cache.invalidate(key).await;
    }

    /// The filter half of [`insert_key`](Self::insert_key): into the live
    /// filter and, while a rebuild runs, its journal (see the module doc).
    fn add_to_filter(&self, key: &Key) {
        let mut journal = self.lock_journal();
        if let Some(filter) = self.filter.load().as_ref() {
            filter.insert(key.item());
        }
        if let Some(j) = journal.as_mut() {
            j.push(key.clone());
        }
        drop(journal);
        if let Key::Int(v) = key {
            self.high_water.fetch_max(*v, Ordering::Relaxed);
        }
    }

    /// Forgets a cached row (it changed or was deleted).
    pub async fn invalidate(&self, key: &Key) {
        self.cache.invalidate(key).await;
    }

    pub fn clear_cache(&self) {
        self.cache.clear();
    }

    /// Brings the cache counts up to date (see `RowCache::sync`).
    pub async fn sync_cache(&self) {
        self.cache.sync().await;
    }

    pub fn cache_entries(&self) -> (u64, u64) {
        self.cache.entry_counts()
    }

    pub fn cache_weighted_size(&self) -> u64 {
        self.cache.weighted_size()
    }

    /// Whether the live filter may hold `key` (false before it is built).
    pub fn filter_contains(&self, key: &Key) -> bool {
        self.filter
            .load()
            .as_ref()
            .is_some_and(|f| f.contains(key.item()))
    }

    /// Stats of the live filter, if built.
    pub fn filter_stats(&self) -> Option<FilterStats> {
        self.filter.load().as_ref().map(|f| f.stats())
    }

    pub fn last_build(&self) -> Option<BuildReport> {
        self.last_build
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Bumped on every swap.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Relaxed)
    }

    /// Checks that the table, key column and columns exist and fit the key
    /// type, by running the row query for a NULL key (which matches nothing).
    pub async fn probe(&self) -> Result<(), DbError> {
        let sql = &self.queries.row;
        match self.config.key_type {
            KeyType::Bigint => self.db.fetch_json(sql, None::<i64>).await,
            KeyType::Uuid => self.db.fetch_json(sql, None::<uuid::Uuid>).await,
            KeyType::Text => self.db.fetch_json(sql, None::<String>).await,
        }
        .map(|_| ())
    }

    /// Scans every key into a new filter with a fresh secret key and swaps it
    /// in. Refuses a scan that shrank by more than `max_shrink` unless
    /// `force`; on any failure the current filter stays.
    pub async fn rebuild(&self, force: bool) -> Result<BuildReport, RebuildError> {
        if !self.config.filter.enabled {
            return Err(RebuildError::Disabled);
        }
        let _one_at_a_time = self.rebuilding.lock().await;
        let began = Instant::now();
        *self.lock_journal() = Some(Vec::new());
        let built = self.scan().await;
        let mut journal = self.lock_journal();
        let pending = journal.take().unwrap_or_default();
        let result = built.and_then(|(set, keys, rows)| {
            self.check_shrink(keys, force)?;
            for k in &pending {
                set.insert(k.item());
            }
            let generation = self.generation.fetch_add(1, Ordering::Relaxed) + 1;
            let report = BuildReport {
                generation,
                keys,
                rows_counted: rows,
                replayed: pending.len() as u64,
                duration_ms: began.elapsed().as_millis() as u64,
                built_at: SystemTime::now(),
                filter: set.stats(),
            };
            self.filter.store(Some(Arc::new(set)));
            Ok(report)
        });
        drop(journal);
        match &result {
            Ok(r) => {
                self.stats.rebuilds.fetch_add(1, Ordering::Relaxed);
                *self.last_build.lock().unwrap_or_else(|p| p.into_inner()) = Some(r.clone());
                tracing::info!(
                    resource = %self.config.name,
                    generation = r.generation,
                    keys = r.keys,
                    replayed = r.replayed,
                    kind = r.filter.kind,
                    bits = r.filter.bits,
                    hashes = r.filter.hashes,
                    duration_ms = r.duration_ms,
                    "filter built"
                );
            }
            Err(e @ RebuildError::Shrunk { .. }) => {
                self.stats.refused_swaps.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(resource = %self.config.name, error = %e, "filter swap refused");
            }
            Err(e) => {
                self.stats.rebuild_failures.fetch_add(1, Ordering::Relaxed);
                tracing::error!(resource = %self.config.name, error = %e, "filter rebuild failed; keeping the current filter");
            }
        }
        result
    }

    fn lock_journal(&self) -> std::sync::MutexGuard<'_, Option<Vec<Key>>> {
        self.journal.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn check_shrink(&self, new: u64, force: bool) -> Result<(), RebuildError> {
        let Some(old) = self.last_build().map(|r| r.keys) else {
            return Ok(());
        };
        let max_shrink = self.config.filter.max_shrink;
        let min = (old as f64 * (1.0 - max_shrink)).floor() as u64;
        if !force && new < min {
            return Err(RebuildError::Shrunk {
                old,
                new,
                min,
                max_shrink,
            });
        }
        Ok(())
    }

    async fn scan(&self) -> Result<(KeySet, u64, u64), RebuildError> {
        let f = &self.config.filter;
        let key_type = self.config.key_type;
        let mut bad = 0u64;
        let mut rows = 0;
        let mut max_int = i64::MIN;
        let (builder, keys) = self
            .db
            .scan_keys(
                &self.queries,
                |count| {
                    rows = count;
                    // Sized for growth until the next rebuild; at least one
                    // key so an empty table still gets a valid filter.
                    let expected = ((count as f64) * f.headroom).ceil().max(1.0) as u64;
                    // The key type decides the layouts `auto` may pick: an
                    // empty uuid or text table must still get a filter that
                    // rejects byte keys.
                    KeySetBuilder::new(
                        f.mode,
                        key_type.kind(),
                        expected,
                        f.false_positive_rate,
                        FilterKey::random(),
                    )
                },
                |builder, raw| match (builder, key::item_from_column(key_type, raw)) {
                    (Ok(b), Some(item)) => {
                        if let Item::Int(v) = item {
                            max_int = max_int.max(v);
                        }
                        b.insert(item)
                    }
                    (Ok(_), None) => bad += 1,
                    (Err(_), _) => {}
                },
            )
            .await?;
        if bad > 0 {
            return Err(RebuildError::BadValues(bad));
        }
        self.high_water.fetch_max(max_int, Ordering::Relaxed);
        Ok((builder?.finish(), keys, rows))
    }

    /// Rebuilds every `rebuild_interval`, jittered by ±10 % so replicas do not
    /// all scan the table at once. Runs until the task is aborted.
    pub async fn rebuild_periodically(self: Arc<Self>) {
        let base = self.config.filter.rebuild_interval;
        if base.is_zero() || !self.config.filter.enabled {
            return;
        }
        loop {
            let jitter = rand::random_range(0.9..1.1);
            tokio::time::sleep(base.mul_f64(jitter)).await;
            // Errors are logged and counted inside; the old filter stays.
            let _ = self.rebuild(false).await;
        }
    }

    /// The first build, retried until it succeeds. Returns the error at once
    /// if it is permanent (a missing table or column).
    pub async fn preload(&self) -> Result<BuildReport, RebuildError> {
        if let Err(e) = self.probe().await {
            let e = RebuildError::Db(e);
            if e.is_permanent() {
                return Err(e);
            }
        }
        let mut delay = Duration::from_millis(200);
        loop {
            match self.rebuild(true).await {
                Ok(r) => return Ok(r),
                Err(e) if e.is_permanent() => return Err(e),
                Err(RebuildError::Disabled) => return Err(RebuildError::Disabled),
                Err(_) => {
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(10));
                }
            }
        }
    }
}
