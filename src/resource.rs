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
//! after 3 goes into the new filter directly. The WAL feed announces a
//! commit on receipt, a moment before new snapshots see it, so a key it
//! inserted before step 1 may be in neither: it is inserted once more at
//! the commit's `Visible` delivery (`apply`), which comes once snapshots
//! see it, so that second insert is journaled or precedes the snapshot. Since step 3 holds the lock, no
//! insert can land between "replayed" and "swapped". The journal is closed
//! by a guard on every way out of a rebuild: success, refusal, error, panic,
//! or the rebuild future being dropped (its task aborted at shutdown), so a
//! journal never outlives its rebuild and collects keys for nobody.
//!
//! A swap refused by the shrink guard keeps the live filter, but every key
//! the scan found is then streamed into it (a second scan: adding keys to a
//! filter is always safe, and the two filters, with different secret keys
//! and shapes, cannot be merged bit-wise). So a refused rebuild still
//! recovers the keys whose notifications were lost. The second scan costs
//! only on refusal; merging during every scan would add a keyed hash and a
//! probe of the live filter per key to every rebuild.
//!
//! # Rebuilds are requested, never run directly
//! All of them go through the resource's [`Coordinator`] (see
//! [`crate::rebuild`]): [`Resource::request_rebuild`] returns at once, the
//! coordinator's task (owned by the gateway, [`Resource::run_background`])
//! runs them one at a time, at most one running and one pending. That is
//! also what makes the journal's "one rebuild at a time" true.
//!
//! A rebuild asked for because the filter may lack keys (a feed missed
//! changes, or delivered one without its keys: [`Reason::recovers_keys`])
//! that fails, typically because the database it must scan is the one that
//! just went away, is asked for again after a back-off
//! ([`RETRY_FIRST`] doubling to [`RETRY_MAX`]) until one succeeds: those
//! keys must not wait for the next scheduled rebuild, which may be hours
//! away or never.
//!
//! # The high-water mark
//! For `bigint` keys, `verify_above_high_water` checks a rejected key above
//! the highest key known to exist against the database (a row committed a
//! moment ago). A mark that is too high silently turns that off for every
//! key below it, so the mark only follows keys known to exist:
//! - each build *resets* it to the highest key its scan found, raised by the
//!   live inserts recorded in its journal (those after the snapshot) that
//!   may raise it;
//! - a [`Provenance::Trusted`] insert (a WAL change, a row the gateway read)
//!   raises it;
//! - a [`Provenance::Announced`] insert (a `NOTIFY` payload anyone can send)
//!   goes into the filter at once but raises the mark only once the
//!   database confirms the row, checked in the background under the same
//!   `verify_budget` (no budget, no check: the mark stays, which costs at
//!   most some budgeted checks, never a false negative).
//!
//! # Rebuilds when the protection decays
//! Inserts fill a Bloom filter past the count it was sized for, and deleted
//! keys stay in any filter; both let more absent keys through. Each build
//! precomputes limits (from the sizing model, [`KeySet::max_keys_at_rate`])
//! and every live insert or noted delete compares counters with them, O(1):
//! past `rebuild_fp_multiple` × the target rate, past
//! `rebuild_delete_fraction` of the keys deleted, or past
//! `rebuild_insert_fraction` of the keys inserted live (which bounds an
//! exact set forged inserts would grow), one rebuild is requested per build.

use std::cell::Cell;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use arc_swap::ArcSwapOption;
use serde::Serialize;
use tokio::sync::mpsc;

use crate::budget::TokenBucket;
use crate::cache::{Outcome, Peek, Row, RowCache};
use crate::config::Resolved;
use crate::db::{Db, DbError, Queries};
use crate::error::Error;
use crate::filter::{FilterError, FilterKey, FilterStats, Item, KeySet, KeySetBuilder};
use crate::key::{self, Key, KeyType};
use crate::rebuild::{self, Coordinator, Job, Reason, Ticket};
use crate::shutdown::Shutdown;
use crate::telemetry::LogThrottle;
use crate::vouch::Vouch;

mod stats;
pub use stats::{RequestOutcome, ResourceSnapshot, Stats, StatsSnapshot};

/// How a lookup was answered.
#[derive(Debug)]
pub enum Lookup {
    /// The filter knows the key does not exist: nothing else was asked.
    Filtered,
    /// The cache answered, or loaded through to the database.
    Cached(Outcome),
    /// Not vouched for ([`crate::vouch`]): loaded from the database past
    /// the caches, which were neither read nor written.
    Unvouched(Option<Arc<Row>>),
}

/// What the filter says of a key ([`Resource::filter`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Passed {
    /// Absent for certain: answer 404, touch nothing.
    Filtered,
    /// May exist (or the filter is off): ask the cache.
    Maybe,
    /// Not in the filter, but above the high-water mark and within the
    /// verify budget: ask the cache and the database, and add the key if
    /// the row is there (`verify_above_high_water`).
    Verify,
    /// Let through as `Maybe`, and found in neither cache a moment ago
    /// ([`Resource::cached`]): load, without reading the caches again.
    Missed,
    /// Neither filter nor cache is vouched for ([`crate::vouch`]): load
    /// from the database without them. `rejected`: the filter rejected the
    /// key (within `verify_budget`), so a row found goes into it.
    Unvouched { rejected: bool },
}

/// Where a live insert comes from: decides whether it may raise the
/// high-water mark (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Provenance {
    /// A source nobody can forge: a WAL change (logical replication), or a
    /// row the gateway itself read.
    Trusted,
    /// A source anyone who can connect may write to: a `NOTIFY` payload.
    Announced,
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
    /// What asked for it (several requests merge into one build).
    pub reasons: Vec<&'static str>,
    pub filter: FilterStats,
}

/// The latest swap the shrink guard refused, for the admin API.
#[derive(Clone, Debug, Serialize)]
pub struct RefusalReport {
    #[serde(with = "humantime_serde")]
    pub at: SystemTime,
    /// Keys of the last accepted build.
    pub keys_before: u64,
    /// Keys the refused scan found.
    pub keys_found: u64,
    /// Fewest keys an unforced swap accepts.
    pub min_keys: u64,
    /// Found keys the live filter did not hold, added to it (the keys of
    /// lost notifications, now servable).
    pub recovered: u64,
    pub reasons: Vec<&'static str>,
}

/// How the latest rebuild ended, by ticket, for `GET /admin/resources/{name}`
/// (where `POST .../rebuild` tells a client to watch).
#[derive(Clone, Debug, Serialize)]
pub struct LastOutcome {
    /// The coordinator's ticket of that rebuild (see [`crate::rebuild`]).
    pub ticket: u64,
    #[serde(with = "humantime_serde")]
    pub at: SystemTime,
    /// `built`, `refused`, `failed`, `disabled` or `cancelled`.
    pub result: &'static str,
    /// The generation swapped in (`built`).
    pub generation: Option<u64>,
    /// What happened, safe to show (no SQL, no database text).
    pub message: String,
}

/// How far the live filter has decayed since its build, and where the
/// rebuild triggers are. Every figure is O(1) to get (no scan of the bits).
#[derive(Clone, Debug, Serialize)]
pub struct Protection {
    /// Keys at the build plus live inserts that changed the filter since.
    pub keys: u64,
    pub keys_at_build: u64,
    /// `false_positive_rate`.
    pub target_fp_rate: f64,
    /// The sizing model's false-positive rate at `keys` (0 for an exact
    /// set).
    pub estimated_fp_rate: f64,
    /// A rebuild is requested past this estimate (`rebuild_fp_multiple` ×
    /// the target); `null` when off or for an exact set.
    pub rebuild_fp_rate: Option<f64>,
    /// The key count at which the estimate crosses `rebuild_fp_rate`.
    pub rebuild_at_keys: Option<u64>,
    pub inserts_since_build: u64,
    pub rebuild_at_inserts: Option<u64>,
    pub deletes_since_build: u64,
    pub rebuild_at_deletes: Option<u64>,
    /// One of these limits has asked for a rebuild of this build already.
    pub rebuild_requested: bool,
}

#[derive(Clone, Debug, thiserror::Error)]
pub enum RebuildError {
    #[error("database: {0}")]
    Db(Arc<DbError>),
    #[error("filter: {0}")]
    Filter(#[from] FilterError),
    #[error(
        "refused: the new scan found {new} keys, fewer than {min} ({old} now, max_shrink {max_shrink}); force the rebuild if this is intended. Meanwhile every key it found is served: {recovered} were missing from the filter and were added"
    )]
    Shrunk {
        old: u64,
        new: u64,
        min: u64,
        max_shrink: f64,
        recovered: u64,
    },
    #[error("{0} key values did not convert to the key type")]
    BadValues(u64),
    #[error("the filter is disabled for this resource")]
    Disabled,
    #[error("the gateway stopped before the rebuild finished")]
    Cancelled,
    #[error("the rebuild panicked (a bug; see the log); the current filter stays")]
    Panicked,
}

/// What a finished rebuild means for the retries (see the module doc).
#[derive(Debug, PartialEq)]
enum Retry {
    /// Every key that existed when it scanned is in the live filter (built,
    /// or refused with what it found merged in): nothing missed before is
    /// still missing.
    Covered,
    /// It failed and must be asked for again with these reasons.
    Again(Vec<Reason>),
    /// Neither (a failure nothing needs retried, a cancellation).
    Nothing,
}

impl Retry {
    fn after(reasons: rebuild::Reasons, outcome: &RebuildOutcome) -> Self {
        match outcome {
            Ok(_) | Err(RebuildError::Shrunk { .. }) => Retry::Covered,
            // Values that do not convert will not on a retry either.
            Err(RebuildError::Db(_) | RebuildError::Panicked) => {
                let again: Vec<Reason> = reasons.iter().filter(|r| r.recovers_keys()).collect();
                if again.is_empty() {
                    Retry::Nothing
                } else {
                    Retry::Again(again)
                }
            }
            Err(_) => Retry::Nothing,
        }
    }
}

impl From<DbError> for RebuildError {
    fn from(e: DbError) -> Self {
        RebuildError::Db(Arc::new(e))
    }
}

impl RebuildError {
    /// A mistake in the config or schema (missing table or column, wrong
    /// type): retrying will not help, unlike an unreachable database.
    pub fn is_permanent(&self) -> bool {
        match self {
            RebuildError::Db(e) => match &**e {
                // Class 42: syntax error or access rule violation
                // (undefined table/column, type mismatch, permission).
                DbError::Sqlx(sqlx::Error::Database(e)) => {
                    e.code().is_some_and(|c| c.starts_with("42"))
                }
                _ => false,
            },
            RebuildError::BadValues(_) => true,
            _ => false,
        }
    }
}

/// Why a row load produced no answer.
#[derive(Debug)]
enum LoadError {
    Db(DbError),
    /// `server.max_concurrency` loads are in flight already. A load detached
    /// from departed clients (see `cache`) no longer holds its request's
    /// concurrency slot, so loads hold slots of their own, from one
    /// gateway-wide semaphore of the same size: loads in flight, attached
    /// or not, never exceed `max_concurrency`, and neither do the tasks
    /// and queries of departed clients. Answered 503 like a shed request.
    Overloaded,
}

/// What a rebuild ends with; cloneable, so every request merged into one
/// rebuild gets it.
pub type RebuildOutcome = Result<BuildReport, RebuildError>;

/// Live inserts recorded while a rebuild runs (see the module doc).
struct Journal {
    keys: Vec<Key>,
    /// The highest key that raised the high-water mark while open.
    high: i64,
    /// Deletes noted while open: their keys may still be in the scan.
    deletes: u64,
}

impl Journal {
    fn new() -> Self {
        Self {
            keys: Vec::new(),
            high: i64::MIN,
            deletes: 0,
        }
    }
}

thread_local! {
    /// Journal locks this thread holds (see [`JournalLock`]).
    static JOURNAL_HELD: Cell<u32> = const { Cell::new(0) };
}

/// The journal's lock. Request threads take it on the verify path (and
/// every live insert does), so nothing slow may run under it; it counts
/// itself in [`JOURNAL_HELD`] so that [`stats_of`], which scans the whole bit
/// array, can assert it is not held (debug builds; tested below).
struct JournalLock<'a>(MutexGuard<'a, Option<Journal>>);

impl Drop for JournalLock<'_> {
    fn drop(&mut self) {
        JOURNAL_HELD.with(|h| h.set(h.get() - 1));
    }
}

impl Deref for JournalLock<'_> {
    type Target = Option<Journal>;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl DerefMut for JournalLock<'_> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

/// The only way filter stats are computed here: O(bits) for a Bloom filter
/// (≈1 ms per 10 MB), so never under the journal lock.
fn stats_of(set: &KeySet) -> FilterStats {
    debug_assert_eq!(
        JOURNAL_HELD.with(Cell::get),
        0,
        "filter stats scan the bit array: never under the journal lock"
    );
    set.stats()
}

/// Opens the journal; closes it when dropped, on every way out of a rebuild.
struct OpenJournal<'a>(&'a Resource);

impl<'a> OpenJournal<'a> {
    fn open(r: &'a Resource) -> Self {
        *r.lock_journal() = Some(Journal::new());
        Self(r)
    }
}

impl Drop for OpenJournal<'_> {
    fn drop(&mut self) {
        *self.0.lock_journal() = None;
    }
}

/// Fewest live inserts that can ask for a rebuild by `rebuild_insert_fraction`,
/// so a small table is not rebuilt every few inserts.
const MIN_GROWTH_LIMIT_BASE: u64 = 1024;
/// The first wait before a failed key-recovering rebuild is asked for
/// again (see the module doc); it doubles up to [`RETRY_MAX`].
pub const RETRY_FIRST: Duration = Duration::from_secs(1);
pub const RETRY_MAX: Duration = Duration::from_secs(30);

/// Announced keys waiting for confirmation; more are not confirmed (the mark
/// stays, which is safe).
const CONFIRM_QUEUE: usize = 256;

/// The decay of the live filter since its build, and the limits past which
/// a rebuild is requested. Reset at every swap, under the journal lock, which
/// every insert also takes, so counts and limits always belong to one build.
struct Decay {
    keys_at_build: AtomicU64,
    /// Live inserts since the build that changed the filter.
    grown: AtomicU64,
    deletes: AtomicU64,
    /// `u64::MAX`: never.
    fp_limit_keys: AtomicU64,
    growth_limit: AtomicU64,
    delete_limit: AtomicU64,
    /// A rebuild has been requested for this build.
    requested: AtomicBool,
}

impl Default for Decay {
    fn default() -> Self {
        Self {
            keys_at_build: AtomicU64::new(0),
            grown: AtomicU64::new(0),
            deletes: AtomicU64::new(0),
            fp_limit_keys: AtomicU64::new(u64::MAX),
            growth_limit: AtomicU64::new(u64::MAX),
            delete_limit: AtomicU64::new(u64::MAX),
            requested: AtomicBool::new(false),
        }
    }
}

#[derive(Clone, Copy)]
struct Limits {
    fp_keys: u64,
    growth: u64,
    deletes: u64,
}

fn limit_or_never(limit: u64) -> Option<u64> {
    (limit != u64::MAX).then_some(limit)
}

/// One scan's result.
struct Scanned {
    set: KeySet,
    keys: u64,
    rows: u64,
    max_int: i64,
}

pub struct Resource {
    pub config: Resolved,
    queries: Queries,
    db: Arc<Db>,
    filter: ArcSwapOption<KeySet>,
    cache: RowCache<Key>,
    /// Open (Some) exactly while a rebuild runs; see the module doc.
    journal: Mutex<Option<Journal>>,
    rebuilds: Coordinator<RebuildOutcome>,
    last_build: Mutex<Option<BuildReport>>,
    last_refusal: Mutex<Option<RefusalReport>>,
    last_outcome: Mutex<Option<LastOutcome>>,
    generation: AtomicU64,
    /// The highest integer key known to exist; see the module doc.
    high_water: AtomicI64,
    verify_budget: TokenBucket,
    /// Announced keys above the mark, for the confirming task.
    to_confirm: mpsc::Sender<i64>,
    to_confirm_rx: Mutex<Option<mpsc::Receiver<i64>>>,
    decay: Decay,
    /// "row load failed" at most once per interval: in an outage every cold
    /// key fails (the count is in `stats.unavailable`).
    load_failure_log: LogThrottle,
    /// Slots for row loads, shared by every resource of the gateway
    /// (`server.max_concurrency`); see [`LoadError::Overloaded`].
    loads: Arc<tokio::sync::Semaphore>,
    /// Whether the filter and cache may answer (see [`crate::vouch`]).
    pub vouch: Vouch,
    pub stats: Stats,
}

impl Resource {
    /// `loads`: the gateway's semaphore of row-load slots.
    pub fn new(config: Resolved, db: Arc<Db>, loads: Arc<tokio::sync::Semaphore>) -> Self {
        let queries = Queries::new(
            &config.table,
            &config.key_column,
            config.key_type.sql_type(),
            &config.columns,
        );
        let verify_budget = TokenBucket::new(config.filter.verify_budget);
        let (to_confirm, rx) = mpsc::channel(CONFIRM_QUEUE);
        Self {
            queries,
            cache: RowCache::new(&config.cache),
            config,
            db,
            filter: ArcSwapOption::empty(),
            journal: Mutex::new(None),
            rebuilds: Coordinator::default(),
            last_build: Mutex::new(None),
            last_refusal: Mutex::new(None),
            last_outcome: Mutex::new(None),
            generation: AtomicU64::new(0),
            high_water: AtomicI64::new(i64::MIN),
            verify_budget,
            to_confirm,
            to_confirm_rx: Mutex::new(Some(rx)),
            decay: Decay::default(),
            load_failure_log: LogThrottle::default(),
            loads,
            vouch: Vouch::default(),
            stats: Stats::default(),
        }
    }

    pub fn name(&self) -> &str {
        &self.config.name
    }

    pub fn key_type(&self) -> KeyType {
        self.config.key_type
    }

    /// Ready to answer from its filter and cache: the filter is built (or
    /// there is none), and they are vouched for.
    pub fn is_ready(&self) -> bool {
        self.is_built() && self.vouch.ok()
    }

    /// The filter is built, or there is none to build.
    pub fn is_built(&self) -> bool {
        !self.config.filter.enabled || self.filter.load().is_some()
    }

    /// Why not ready, for `/readyz`, the admin API and the status page.
    pub fn why_not_ready(&self) -> Option<String> {
        if !self.is_built() {
            return Some("the filter is still loading".into());
        }
        self.vouch.why_not()
    }

    /// Changes to this resource's table may have been missed (a feed's
    /// resync or rescan): from now on its filter may lack keys and its
    /// cache hold old rows, so neither answers (see [`crate::vouch`]) until
    /// a rebuild that begins after this has swapped in; the caches are
    /// emptied and that rebuild requested.
    pub fn resync(&self, why: &str, reason: Reason) {
        if self.config.filter.enabled {
            self.vouch.open_gap(why);
        }
        self.cache.clear();
        if self.config.filter.enabled {
            self.request_rebuild(reason, false);
        }
    }

    /// Parses a raw path segment for this resource's key type.
    pub fn parse_key(&self, raw: &str, max_len: usize) -> Result<Key, Error> {
        key::parse(raw, self.config.key_type, max_len).map_err(|e| {
            self.stats.bad_requests.fetch_add(1, Ordering::Relaxed);
            Error::BadKey(e)
        })
    }

    /// The filter's verdict on `key`, with no await: a rejected key is
    /// answered without a future (`http::dispatch`). The request path is
    /// this, then [`Resource::lookup_passed`]: filter, then cache, then
    /// database.
    pub fn filter(&self, key: &Key) -> Result<Passed, Error> {
        // Before the filter is read (see `vouch`).
        let vouched = self.vouch.ok();
        let maybe = match vouched {
            true => Passed::Maybe,
            false => Passed::Unvouched { rejected: false },
        };
        if !self.config.filter.enabled {
            return Ok(maybe);
        }
        let filter = self.filter.load();
        let Some(filter) = filter.as_ref() else {
            self.stats.not_ready.fetch_add(1, Ordering::Relaxed);
            return Err(Error::NotReady);
        };
        if filter.contains(key.item()) {
            return Ok(maybe);
        }
        if !vouched {
            // The filter may lack a key that exists: the database says,
            // within the budget that bounds what absent keys cost it.
            if self.verify_budget.try_take() {
                return Ok(Passed::Unvouched { rejected: true });
            }
            self.stats.unverified.fetch_add(1, Ordering::Relaxed);
            return Err(Error::Unverified);
        }
        if !self.may_verify(key) {
            self.stats.filtered.add(1);
            return Ok(Passed::Filtered);
        }
        self.stats
            .verified_above_high_water
            .fetch_add(1, Ordering::Relaxed);
        Ok(Passed::Verify)
    }

    /// Cache, then database, for a key [`Resource::filter`] let through
    /// (`passed` is what it said; [`Passed::Filtered`] answers at once).
    pub async fn lookup_passed(&self, key: Key, passed: Passed) -> Result<Lookup, Error> {
        match passed {
            Passed::Filtered => return Ok(Lookup::Filtered),
            Passed::Maybe => return self.load_through_cache(key, true).await,
            Passed::Missed => return self.load_through_cache(key, false).await,
            Passed::Unvouched { rejected } => {
                let result = self.load_direct(&key).await;
                if rejected && let Ok(Lookup::Unvouched(Some(_))) = &result {
                    // Read by the gateway itself: it exists.
                    self.add_to_filter(&key, Provenance::Trusted);
                }
                return result;
            }
            Passed::Verify => {}
        }
        let result = self.load_through_cache(key.clone(), true).await;
        if let Ok(Lookup::Cached(Outcome::Loaded { .. })) = &result {
            // The row exists and its notification has not arrived yet; the
            // gateway read it itself, so it may raise the mark.
            self.add_to_filter(&key, Provenance::Trusted);
        }
        result
    }

    /// The cache's answer for a key the filter passed as [`Passed::Maybe`],
    /// if it has one without waiting (a hit or a negative hit, counted as
    /// [`Resource::lookup_passed`] counts them). Otherwise what to pass to
    /// `lookup_passed`: [`Passed::Missed`] after a miss, so the load path
    /// does not read the caches a second time (moka would count the key
    /// twice for its admission policy), else `passed` unchanged. A key to
    /// verify always goes on: its load may have to add it to the filter.
    pub fn cached(&self, key: &Key, passed: Passed) -> Result<Lookup, Passed> {
        if passed != Passed::Maybe {
            return Err(passed);
        }
        match self.cache.cached(key) {
            Peek::Answered(outcome) => {
                self.count(&outcome);
                Ok(Lookup::Cached(outcome))
            }
            Peek::Missed => Err(Passed::Missed),
            Peek::Unknown => Err(passed),
        }
    }

    /// A rejected key above the high-water mark may be a row committed a
    /// moment ago; check it against the database while the budget allows.
    fn may_verify(&self, key: &Key) -> bool {
        self.config.filter.verify_above_high_water
            && matches!(key, Key::Int(v) if *v > self.high_water.load(Ordering::Relaxed))
            && self.verify_budget.try_take()
    }

    /// One load from the database for a lookup not vouched for: no cache
    /// read, nothing stored, no coalescing (each such request is one query,
    /// within the load slots and, for keys the filter rejected,
    /// `verify_budget`).
    async fn load_direct(&self, key: &Key) -> Result<Lookup, Error> {
        self.stats.unvouched_loads.fetch_add(1, Ordering::Relaxed);
        let Ok(_slot) = self.loads.clone().try_acquire_owned() else {
            self.stats.shed_loads.fetch_add(1, Ordering::Relaxed);
            return Err(Error::Overloaded);
        };
        let sql = &self.queries.row;
        let loaded = match key {
            Key::Int(v) => self.db.fetch_json(sql, *v).await,
            Key::Uuid(u) => self.db.fetch_json(sql, *u).await,
            Key::Text(s) => self.db.fetch_json(sql, s.to_string()).await,
        };
        match loaded {
            Ok(row) => {
                self.count_load(false, row.is_none());
                Ok(Lookup::Unvouched(row.map(|b| Arc::new(Row::new(b)))))
            }
            Err(e) => {
                self.stats.unavailable.fetch_add(1, Ordering::Relaxed);
                let detail = e.to_string();
                if let Some(not_logged) = self.load_failure_log.permit() {
                    tracing::warn!(resource = %self.config.name, error = %detail, not_logged, "row load failed (at most one such line per 10 s; not_logged counts the rest)");
                }
                Err(Error::Unavailable(detail))
            }
        }
    }

    /// `read_first`: false when [`Resource::cached`] has just missed.
    async fn load_through_cache(&self, key: Key, read_first: bool) -> Result<Lookup, Error> {
        let make_load = |key: &Key| {
            let db = self.db.clone();
            let sql = self.queries.row.clone();
            let k = key.clone();
            let loads = self.loads.clone();
            move || async move {
                // Taken by the load itself, so held until its query returns even
                // when every client waiting on it has gone and the cache has
                // detached it: the request's own slot is released when the
                // client goes, this one is not (see [`LoadError::Overloaded`]).
                let Ok(_slot) = loads.try_acquire_owned() else {
                    return Err(LoadError::Overloaded);
                };
                match k {
                    Key::Int(v) => db.fetch_json(&sql, v).await,
                    Key::Uuid(u) => db.fetch_json(&sql, u).await,
                    Key::Text(s) => db.fetch_json(&sql, s.to_string()).await,
                }
                .map_err(LoadError::Db)
            }
        };
        let loaded = match read_first {
            true => self.cache.get_or_load_with(key, make_load).await,
            false => self.cache.load_missed_with(key, make_load).await,
        };
        match loaded {
            Ok(outcome) => {
                self.count(&outcome);
                Ok(Lookup::Cached(outcome))
            }
            Err(e) => {
                if let Some(LoadError::Overloaded) = e.source() {
                    self.stats.shed_loads.fetch_add(1, Ordering::Relaxed);
                    return Err(Error::Overloaded);
                }
                self.stats.unavailable.fetch_add(1, Ordering::Relaxed);
                let detail = match e.source() {
                    Some(LoadError::Db(db)) => db.to_string(),
                    _ => "load aborted".to_string(),
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

    fn count(&self, outcome: &Outcome) {
        let s = &self.stats;
        match outcome {
            Outcome::Hit(_) => s.hits.add(1),
            Outcome::NegativeHit => s.negative_hits.add(1),
            Outcome::Loaded { collapsed, .. } => self.count_load(*collapsed, false),
            Outcome::Absent { collapsed } => self.count_load(*collapsed, true),
            Outcome::Bypassed(row) => self.count_load(false, row.is_none()),
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

    /// Adds a key that now exists (a row was inserted, or its key changed)
    /// to the live filter and forgets any negative entry for it. `from`
    /// decides whether it may raise the high-water mark at once
    /// ([`Provenance::Trusted`]) or only once the database confirms it
    /// ([`Provenance::Announced`], checked in the background under
    /// `verify_budget`, and only with `verify_above_high_water`). The key
    /// goes into the filter either way. May request a rebuild (see the
    /// module doc on decay); never waits for one.
    pub async fn insert_key_from(&self, key: &Key, from: Provenance) {
        self.add_to_filter(key, from);
        self.stats.live_inserts.fetch_add(1, Ordering::Relaxed);
        if from == Provenance::Announced {
            self.confirm_later(key);
        }
        self.cache.invalidate(key).await;
    }

    /// A trusted key already inserted on receipt of its commit, into the
    /// filter once more now that the commit is visible (see the module
    /// doc): not counted again as a live insert.
    pub fn insert_key_again(&self, key: &Key) {
        self.add_to_filter(key, Provenance::Trusted);
    }

    /// [`insert_key_from`](Self::insert_key_from) with
    /// [`Provenance::Announced`]: what a `NOTIFY` payload is. The applier
    /// (`apply`) passes the provenance itself; this is for tests and tools.
    pub async fn insert_key(&self, key: &Key) {
        self.insert_key_from(key, Provenance::Announced).await;
    }

    /// Applies a delete: forgets the cached row and counts the delete towards
    /// the `rebuild_delete_fraction` trigger (the key stays in the filter
    /// until the next build). Whoever applies a feed's deletes calls this
    /// (an update that changes the key: for the old key).
    pub async fn note_delete(&self, key: &Key) {
        {
            let mut journal = self.lock_journal();
            self.decay.deletes.fetch_add(1, Ordering::Relaxed);
            if let Some(j) = journal.as_mut() {
                j.deletes += 1;
            }
        }
        self.stats.deletes.fetch_add(1, Ordering::Relaxed);
        self.check_decay();
        self.cache.invalidate(key).await;
    }

    /// The filter half of [`insert_key_from`](Self::insert_key_from): into
    /// the live filter and, while a rebuild runs, its journal (see the module
    /// doc); raises the mark if trusted; counts growth and checks the decay
    /// limits, O(1).
    fn add_to_filter(&self, key: &Key, from: Provenance) {
        let mut journal = self.lock_journal();
        let changed = match self.filter.load().as_ref() {
            Some(filter) => filter.insert(key.item()),
            None => false,
        };
        if let Some(j) = journal.as_mut() {
            j.keys.push(key.clone());
        }
        if changed {
            self.decay.grown.fetch_add(1, Ordering::Relaxed);
        }
        if from == Provenance::Trusted
            && let Key::Int(v) = key
        {
            self.raise_mark(&mut journal, *v);
        }
        drop(journal);
        if changed {
            self.check_decay();
        }
    }

    /// Raises the high-water mark to `v`, and records it in an open journal
    /// so that the rebuild's reset keeps it. Under the journal lock, so that
    /// the reset at a swap cannot lose a raise.
    fn raise_mark(&self, journal: &mut JournalLock<'_>, v: i64) {
        self.high_water.fetch_max(v, Ordering::Relaxed);
        if let Some(j) = journal.as_mut() {
            j.high = j.high.max(v);
        }
    }

    /// Queues an announced key above the mark for confirmation, if the
    /// mark is used at all and the budget allows.
    fn confirm_later(&self, key: &Key) {
        let Key::Int(v) = key else { return };
        if self.config.filter.verify_above_high_water
            && *v > self.high_water.load(Ordering::Relaxed)
            && self.verify_budget.try_take()
        {
            // Full: not confirmed, the mark stays (safe, see the module doc).
            let _ = self.to_confirm.try_send(*v);
        }
    }

    /// Confirms queued announced keys against the database; a key that
    /// exists raises the mark. Runs until the channel closes or the task is
    /// aborted.
    async fn confirm_announced(&self, mut queue: mpsc::Receiver<i64>) {
        while let Some(v) = queue.recv().await {
            if v <= self.high_water.load(Ordering::Relaxed) {
                continue;
            }
            match self.db.fetch_json(&self.queries.row, v).await {
                Ok(Some(_)) => self.raise_mark(&mut self.lock_journal(), v),
                Ok(None) => {
                    self.stats
                        .announced_unconfirmed
                        .fetch_add(1, Ordering::Relaxed);
                }
                // Unknown: the mark stays, which is the safe side.
                Err(_) => {}
            }
        }
    }

    /// Requests a rebuild if a decay limit is passed: a few atomic loads.
    fn check_decay(&self) {
        let d = &self.decay;
        if d.requested.load(Ordering::Relaxed) {
            return;
        }
        let grown = d.grown.load(Ordering::Relaxed);
        let keys = d
            .keys_at_build
            .load(Ordering::Relaxed)
            .saturating_add(grown);
        let reason = if keys > d.fp_limit_keys.load(Ordering::Relaxed) {
            Reason::FalsePositives
        } else if grown > d.growth_limit.load(Ordering::Relaxed) {
            Reason::Growth
        } else if d.deletes.load(Ordering::Relaxed) > d.delete_limit.load(Ordering::Relaxed) {
            Reason::Deletes
        } else {
            return;
        };
        if d.requested.swap(true, Ordering::Relaxed) {
            return;
        }
        self.stats.decay_rebuilds.fetch_add(1, Ordering::Relaxed);
        tracing::info!(
            resource = %self.config.name,
            reason = reason.as_str(),
            keys,
            inserts_since_build = grown,
            deletes_since_build = d.deletes.load(Ordering::Relaxed),
            "the filter's protection decayed; rebuild requested"
        );
        self.request_rebuild(reason, false);
    }

    /// The decay limits for a new build of `set` holding `keys` keys.
    fn limits(&self, set: &KeySet, keys: u64) -> Limits {
        let f = &self.config.filter;
        let fp_keys = match f.rebuild_fp_multiple {
            m if m > 0.0 => set
                .max_keys_at_rate(m * f.false_positive_rate)
                .unwrap_or(u64::MAX),
            _ => u64::MAX,
        };
        let growth = match f.rebuild_insert_fraction {
            g if g > 0.0 => (g * keys.max(MIN_GROWTH_LIMIT_BASE) as f64).ceil() as u64,
            _ => u64::MAX,
        };
        let deletes = match f.rebuild_delete_fraction {
            d if d > 0.0 => (d * keys as f64).floor() as u64,
            _ => u64::MAX,
        };
        Limits {
            fp_keys,
            growth,
            deletes,
        }
    }

    /// Forgets a cached row (it changed). For a deleted row use
    /// [`note_delete`](Self::note_delete), which also counts it.
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

    /// Stats of the live filter, if built (a scan of a Bloom filter's bits).
    pub fn filter_stats(&self) -> Option<FilterStats> {
        self.filter.load().as_ref().map(|f| stats_of(f))
    }

    /// The live filter's decay and its rebuild limits, if built.
    pub fn protection(&self) -> Option<Protection> {
        let filter = self.filter.load_full()?;
        let f = &self.config.filter;
        let d = &self.decay;
        let keys_at_build = d.keys_at_build.load(Ordering::Relaxed);
        let grown = d.grown.load(Ordering::Relaxed);
        let keys = keys_at_build.saturating_add(grown);
        let rebuild_at_keys = limit_or_never(d.fp_limit_keys.load(Ordering::Relaxed));
        Some(Protection {
            keys,
            keys_at_build,
            target_fp_rate: f.false_positive_rate,
            estimated_fp_rate: filter.fp_rate_at(keys),
            rebuild_fp_rate: rebuild_at_keys.map(|_| f.rebuild_fp_multiple * f.false_positive_rate),
            rebuild_at_keys,
            inserts_since_build: grown,
            rebuild_at_inserts: limit_or_never(d.growth_limit.load(Ordering::Relaxed)),
            deletes_since_build: d.deletes.load(Ordering::Relaxed),
            rebuild_at_deletes: limit_or_never(d.delete_limit.load(Ordering::Relaxed)),
            rebuild_requested: d.requested.load(Ordering::Relaxed),
        })
    }

    /// The high-water mark (bigint keys, once built).
    pub fn high_water(&self) -> Option<i64> {
        let v = self.high_water.load(Ordering::Relaxed);
        (self.config.key_type == KeyType::Bigint && v != i64::MIN).then_some(v)
    }

    pub fn last_build(&self) -> Option<BuildReport> {
        self.last_build
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The latest swap the shrink guard refused, if any.
    pub fn last_refusal(&self) -> Option<RefusalReport> {
        self.last_refusal
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// How the latest rebuild ended, if one has.
    pub fn last_outcome(&self) -> Option<LastOutcome> {
        self.last_outcome
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

    /// Asks for a rebuild of this resource's filter and returns at once
    /// (see [`crate::rebuild`]: merged into the pending rebuild if there is
    /// one; `force` overrides the shrink guard and makes the pending one
    /// forced). The ticket resolves with the outcome of the rebuild that
    /// covers this request (one whose scan starts after it), or `None` if
    /// the gateway stops first; dropping it changes nothing. Served by the
    /// task [`run_background`](Self::run_background) runs (the gateway
    /// starts it in `Gateway::start`).
    pub fn request_rebuild(&self, reason: Reason, force: bool) -> Ticket<RebuildOutcome> {
        self.rebuilds.request(reason, force)
    }

    /// Requests a rebuild ([`Reason::Direct`]) and waits for its outcome;
    /// [`RebuildError::Cancelled`] if the gateway stops first.
    pub async fn rebuild(&self, force: bool) -> RebuildOutcome {
        self.request_rebuild(Reason::Direct, force)
            .outcome()
            .await
            .unwrap_or(Err(RebuildError::Cancelled))
    }

    /// The rebuild coordinator's state: running, pending, tickets.
    pub fn rebuild_status(&self) -> rebuild::Status {
        self.rebuilds.status()
    }

    /// Whether the rebuild journal is open (a rebuild is scanning).
    pub fn journal_open(&self) -> bool {
        self.lock_journal().is_some()
    }

    /// The resource's background work, until `shutdown` fires
    /// (`Gateway::shutdown`): the rebuild coordinator, and the confirmation
    /// of announced keys above the high-water mark. The signal, or an
    /// abort, cancels a rebuild mid-scan (the scan's query is cancelled,
    /// its journal closed).
    pub async fn run_background(self: Arc<Self>, mut shutdown: Shutdown) {
        let queue = self
            .to_confirm_rx
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        let confirm = async {
            match queue {
                Some(q) => self.confirm_announced(q).await,
                // Started twice: the first task confirms.
                None => std::future::pending().await,
            }
        };
        // A panic (a bug) fails that rebuild only: the coordinator's task
        // lives on, or no rebuild would ever run again. The journal is
        // closed by its guard while unwinding.
        let (retry_tx, retry_rx) = mpsc::unbounded_channel();
        let rebuilds = self.rebuilds.run(|job| {
            use futures_util::FutureExt;
            let reasons = job.reasons;
            let retry_tx = retry_tx.clone();
            std::panic::AssertUnwindSafe(self.run_rebuild(job))
                .catch_unwind()
                .map(move |r| {
                    let outcome = r.unwrap_or(Err(RebuildError::Panicked));
                    let _ = retry_tx.send(Retry::after(reasons, &outcome));
                    outcome
                })
        });
        let work = async {
            tokio::join!(rebuilds, confirm, self.retry_failed(retry_rx));
        };
        // At the signal a rebuild in progress is dropped: its query is
        // cancelled on the server and its journal closed (the guards), and
        // every waiting ticket resolves (the coordinator's own guard).
        tokio::select! {
            () = shutdown.fired() => {}
            () = work => {}
        }
    }

    /// Asks again, after a back-off, for every key-recovering rebuild that
    /// failed (see the module doc). Gets one message per finished rebuild.
    async fn retry_failed(&self, mut outcomes: mpsc::UnboundedReceiver<Retry>) {
        let mut wait = RETRY_FIRST;
        while let Some(outcome) = outcomes.recv().await {
            let mut reasons = match outcome {
                Retry::Again(r) => r,
                Retry::Covered => {
                    wait = RETRY_FIRST;
                    continue;
                }
                Retry::Nothing => continue,
            };
            tracing::warn!(
                resource = %self.name(),
                retry_in = ?wait,
                "a rebuild that recovers missed keys failed; it is asked for again"
            );
            self.stats.rebuild_retries.fetch_add(1, Ordering::Relaxed);
            let due = tokio::time::sleep(wait);
            tokio::pin!(due);
            wait = (wait * 2).min(RETRY_MAX);
            loop {
                tokio::select! {
                    () = &mut due => break,
                    more = outcomes.recv() => match more {
                        None => return,
                        // A rebuild since scanned the whole table after
                        // the failure: nothing is missing any more.
                        Some(Retry::Covered) => {
                            reasons.clear();
                            wait = RETRY_FIRST;
                            break;
                        }
                        Some(Retry::Again(also)) => reasons.extend(also),
                        Some(Retry::Nothing) => {}
                    },
                }
            }
            for r in reasons {
                self.rebuilds.request(r, false);
            }
        }
    }

    /// One rebuild, run by the coordinator only (so one at a time, which the
    /// journal protocol relies on): scans every key into a new filter with a
    /// fresh secret key and swaps it in. Refuses a scan that shrank by more
    /// than `max_shrink` unless forced, and then merges what it found into
    /// the live filter; on any failure the current filter stays.
    async fn run_rebuild(&self, job: Job) -> RebuildOutcome {
        if !self.config.filter.enabled {
            return Err(RebuildError::Disabled);
        }
        let began = Instant::now();
        let reasons = job.reasons.names();
        let journal = OpenJournal::open(self);
        // After the journal opened, so before the scan's snapshot: the gaps
        // this rebuild covers (see `vouch`).
        let covers = self.vouch.rebuild_began();
        let result = self.build_and_swap(job.force, began, &reasons).await;
        drop(journal);
        if let Ok(_) | Err(RebuildError::Shrunk { .. }) = &result {
            // Swapped in, or every key the scan found merged into the live
            // filter: the filter holds every key of the snapshot.
            self.vouch.rebuild_covered(covers);
        }
        self.record(&result, &reasons, job.ticket);
        result
    }

    async fn build_and_swap(
        &self,
        force: bool,
        began: Instant,
        reasons: &[&'static str],
    ) -> RebuildOutcome {
        let Scanned {
            set,
            keys,
            rows,
            max_int,
        } = self.scan().await?;
        let limits = self.limits(&set, keys);
        if let Err((old, min)) = self.check_shrink(keys, force) {
            self.close_journal(&mut self.lock_journal(), max_int);
            let recovered = self.merge_into_live().await?;
            return Err(RebuildError::Shrunk {
                old,
                new: keys,
                min,
                max_shrink: self.config.filter.max_shrink,
                recovered,
            });
        }
        let mut journal = self.lock_journal();
        let pending = self.close_journal(&mut journal, max_int);
        let mut replayed_new = 0;
        for k in &pending.keys {
            replayed_new += u64::from(set.insert(k.item()));
        }
        let generation = self.generation.fetch_add(1, Ordering::Relaxed) + 1;
        let d = &self.decay;
        d.keys_at_build
            .store(keys + replayed_new, Ordering::Relaxed);
        d.grown.store(0, Ordering::Relaxed);
        d.deletes.store(pending.deletes, Ordering::Relaxed);
        d.fp_limit_keys.store(limits.fp_keys, Ordering::Relaxed);
        d.growth_limit.store(limits.growth, Ordering::Relaxed);
        d.delete_limit.store(limits.deletes, Ordering::Relaxed);
        d.requested.store(false, Ordering::Relaxed);
        let set = Arc::new(set);
        self.filter.store(Some(set.clone()));
        drop(journal);
        let report = BuildReport {
            generation,
            keys,
            rows_counted: rows,
            replayed: pending.keys.len() as u64,
            duration_ms: began.elapsed().as_millis() as u64,
            built_at: SystemTime::now(),
            reasons: reasons.to_vec(),
            filter: stats_of(&set),
        };
        // Deletes carried over from the scan's window may be past the new
        // limit already.
        self.check_decay();
        Ok(report)
    }

    /// Takes the journal (closing it) and resets the high-water mark: it
    /// follows what exists, i.e. what the scan found plus what raised it
    /// since the journal opened. Also on a refusal: the scan is a fact
    /// either way.
    fn close_journal(&self, journal: &mut JournalLock<'_>, scan_max: i64) -> Journal {
        let pending = journal.take().unwrap_or_else(Journal::new);
        self.high_water
            .store(scan_max.max(pending.high), Ordering::Relaxed);
        pending
    }

    /// After a refused swap: streams every key into the live filter (a
    /// second scan, see the module doc). Returns how many it lacked.
    async fn merge_into_live(&self) -> Result<u64, RebuildError> {
        let Some(live) = self.filter.load_full() else {
            return Ok(0);
        };
        let key_type = self.config.key_type;
        let (mut recovered, mut grown) = (0u64, 0u64);
        self.db
            .scan_keys(
                &self.queries,
                |_| (),
                |_, raw| {
                    if let Some(item) = key::item_from_column(key_type, raw)
                        && !live.contains(item)
                    {
                        recovered += 1;
                        grown += u64::from(live.insert(item));
                    }
                },
            )
            .await?;
        self.decay.grown.fetch_add(grown, Ordering::Relaxed);
        self.stats
            .recovered_keys
            .fetch_add(recovered, Ordering::Relaxed);
        Ok(recovered)
    }

    /// Counts, logs and keeps the report of a finished rebuild.
    fn record(&self, result: &RebuildOutcome, reasons: &[&'static str], ticket: u64) {
        let reasons_text = reasons.join(",");
        let (outcome, generation, message) = match result {
            Ok(r) => ("built", Some(r.generation), format!("{} keys", r.keys)),
            Err(e @ (RebuildError::Shrunk { .. } | RebuildError::Disabled)) => (
                if matches!(e, RebuildError::Disabled) {
                    "disabled"
                } else {
                    "refused"
                },
                None,
                e.to_string(),
            ),
            Err(RebuildError::Cancelled) => ("cancelled", None, String::new()),
            Err(_) => (
                "failed",
                None,
                "the rebuild failed; the current filter stays (see the logs)".into(),
            ),
        };
        *self.last_outcome.lock().unwrap_or_else(|p| p.into_inner()) = Some(LastOutcome {
            ticket,
            at: SystemTime::now(),
            result: outcome,
            generation,
            message,
        });
        match result {
            Ok(r) => {
                self.stats.built(Duration::from_millis(r.duration_ms));
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
                    reasons = %reasons_text,
                    "filter built"
                );
            }
            Err(
                e @ RebuildError::Shrunk {
                    old,
                    new,
                    min,
                    recovered,
                    ..
                },
            ) => {
                self.stats.refused_swaps.fetch_add(1, Ordering::Relaxed);
                *self.last_refusal.lock().unwrap_or_else(|p| p.into_inner()) =
                    Some(RefusalReport {
                        at: SystemTime::now(),
                        keys_before: *old,
                        keys_found: *new,
                        min_keys: *min,
                        recovered: *recovered,
                        reasons: reasons.to_vec(),
                    });
                tracing::warn!(resource = %self.config.name, reasons = %reasons_text, error = %e, "filter swap refused");
            }
            Err(RebuildError::Disabled | RebuildError::Cancelled) => {}
            Err(e) => {
                self.stats.build_failed();
                // A decay limit may ask again: the next insert or delete
                // past it retries (a refusal does not re-arm: it would only
                // be refused again).
                self.decay.requested.store(false, Ordering::Relaxed);
                tracing::error!(resource = %self.config.name, reasons = %reasons_text, error = %e, "filter rebuild failed; keeping the current filter");
            }
        }
    }

    fn lock_journal(&self) -> JournalLock<'_> {
        let guard = self.journal.lock().unwrap_or_else(|p| p.into_inner());
        JOURNAL_HELD.with(|h| h.set(h.get() + 1));
        JournalLock(guard)
    }

    /// `Err((old, min))` if `new` keys is a shrink the guard refuses.
    fn check_shrink(&self, new: u64, force: bool) -> Result<(), (u64, u64)> {
        let Some(old) = self.last_build().map(|r| r.keys) else {
            return Ok(());
        };
        let min = (old as f64 * (1.0 - self.config.filter.max_shrink)).floor() as u64;
        if !force && new < min {
            return Err((old, min));
        }
        Ok(())
    }

    async fn scan(&self) -> Result<Scanned, RebuildError> {
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
        Ok(Scanned {
            set: builder?.finish(),
            keys,
            rows,
            max_int,
        })
    }

    /// Requests a rebuild every `rebuild_interval`, jittered by ±10 % so
    /// replicas do not all scan the table at once, and waits for each. Runs
    /// until `shutdown` fires.
    pub async fn rebuild_periodically(self: Arc<Self>, mut shutdown: Shutdown) {
        let base = self.config.filter.rebuild_interval;
        if base.is_zero() || !self.config.filter.enabled {
            return;
        }
        loop {
            let jitter = rand::random_range(0.9..1.1);
            let next = async {
                tokio::time::sleep(base.mul_f64(jitter)).await;
                // Errors are logged and counted by the rebuild; the old
                // filter stays.
                let _ = self
                    .request_rebuild(Reason::Schedule, false)
                    .outcome()
                    .await;
            };
            tokio::select! {
                () = shutdown.fired() => return,
                () = next => {}
            }
        }
    }

    /// The first build, retried until it succeeds. Returns the error at once
    /// if it is permanent (a missing table or column). Needs the task of
    /// [`run_background`](Self::run_background) running.
    pub async fn preload(&self) -> Result<BuildReport, RebuildError> {
        if let Err(e) = self.probe().await {
            let e = RebuildError::from(e);
            if e.is_permanent() {
                return Err(e);
            }
        }
        let mut delay = Duration::from_millis(200);
        loop {
            let outcome = self
                .request_rebuild(Reason::Startup, true)
                .outcome()
                .await
                .unwrap_or(Err(RebuildError::Cancelled));
            match outcome {
                Ok(r) => return Ok(r),
                Err(e) if e.is_permanent() => return Err(e),
                Err(e @ (RebuildError::Disabled | RebuildError::Cancelled)) => return Err(e),
                Err(_) => {
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(10));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 10's suspicion: `set.stats()` scanned the whole bit array while
    /// holding the journal mutex, which request threads take too. Now every
    /// stats call here goes through `stats_of`, which asserts (debug builds)
    /// that this thread holds no journal lock; and the source has no other
    /// `.stats()` call to bypass it.
    #[test]
    fn filter_stats_are_never_computed_under_the_journal_lock() {
        let source = include_str!("resource.rs");
        let code = source.split("#[cfg(test)]").next().unwrap();
        assert_eq!(
            code.matches(".stats()").count(),
            1,
            "a `.stats()` call outside `stats_of`"
        );
        let set = KeySetBuilder::new(
            crate::filter::Mode::Bloom,
            crate::filter::KeyKind::Int,
            10,
            0.01,
            FilterKey::random(),
        )
        .unwrap()
        .finish();
        assert_eq!(stats_of(&set).kind, "bloom");
        let journal = Mutex::new(None);
        let held = {
            let guard = journal.lock().unwrap();
            JOURNAL_HELD.with(|h| h.set(h.get() + 1));
            JournalLock(guard)
        };
        let under_lock = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| stats_of(&set)));
        drop(held);
        if cfg!(debug_assertions) {
            assert!(
                under_lock.is_err(),
                "stats under the journal lock went unnoticed"
            );
        }
        assert_eq!(JOURNAL_HELD.with(Cell::get), 0);
    }
}
