//! A resource: one table served by key, as a thin composition of its
//! [`LiveFilter`] (the key set and the never-miss invariant), its
//! [`RowCache`] and its queries.
//!
//! The request path is put together here, in order: the parsed key goes to
//! the filter (absent: answered at once), then to the cache, whose loader
//! closure is the only thing here that reaches the database. Changes come
//! in through [`Resource::insert_key_from`], [`Resource::note_delete`],
//! [`Resource::invalidate`] and [`Resource::resync`]: the filter's part of
//! each is the live filter's, the rest is cache invalidation.
//!
//! - [`live_filter`]: the published key set, the rebuild journal, the
//!   high-water mark and decay (no I/O);
//! - [`build`]: scanning the table into a new key set, the shrink guard,
//!   rebuild reports and retries;
//! - [`fleet`]: where a rebuild's set comes from in a fleet that shares
//!   snapshots on the bus (a snapshot, the fleet's one scan, a scan of its
//!   own), and the recent keys that let an older snapshot do;
//! - [`report`]: what the admin API shows of a resource's filter;
//! - `load`: the lookup's second half, the database through the cache or
//!   past it.
//!
//! # Outages
//! Not vouched for, a lookup goes to the database. When the database
//! cannot be reached at all (`db::outage`: connections refused or cut,
//! not a slow query), and the resource lost its vouching for want of
//! freshness alone within `cache.stale_if_error` (see
//! [`Vouch::stale_since`]: the filter and cache still hold what was vouched
//! for then), the lookup is answered from them instead, labelled: a cached
//! row, a negative entry, or a key the filter rejects, as
//! [`Lookup::Stale`]; a key held by neither gets 503 at once. One lookup
//! per `db::outage::TRY_EVERY` tries the database while it is down (the
//! others are answered at once), so the first answer it gives ends the
//! ride-through;
//! from then on lookups go to it until the feed vouches again. This is the
//! one place the gateway answers from state it cannot show current, and
//! it says so on every such answer (`Cache-Status: ...; detail=stale`,
//! `Age`).

mod build;
mod column;
mod fleet;
mod live_filter;
mod load;
mod recent;
mod report;
mod stats;

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

pub use build::{RETRY_FIRST, RETRY_MAX, RebuildError, RebuildOutcome};
pub use live_filter::{Decayed, LiveFilter, Provenance};
pub use report::{BuildReport, LastOutcome, Protection, RefusalReport};

use crate::budget::TokenBucket;
use crate::cache::{Outcome, Peek, Row, RowCache};
use crate::config::Resolved;
use crate::db::stats::{QueryKind, Tally};
use crate::db::{Db, DbError, Queries};
use crate::error::Error;
use crate::filter::FilterStats;
use crate::key::{self, Key, KeyType};
use crate::rebuild::{Coordinator, Reason};
use crate::telemetry::LogThrottle;
use crate::vouch::Vouch;

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
    /// The database cannot be reached: what the filter and cache held when
    /// they were last vouched for, `age` ago (see "Outages"): a row, or
    /// "absent" from the cache (a negative entry: `cached`) or the filter.
    Stale {
        row: Option<Arc<Row>>,
        cached: bool,
        age: Duration,
    },
}

/// Where a resource's answer during an outage stands
/// ([`Resource::stale_standing`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stale {
    /// `cache.stale_if_error` is off: 503 for every key.
    Off,
    /// Within the window: what was vouched for, labelled `detail=stale`.
    Within { age: Duration, window: Duration },
    /// Past it: 503 for every key.
    Past { age: Duration, window: Duration },
}

/// A lookup after its part that needs no future ([`Resource::lookup_now`]).
#[derive(Debug)]
pub enum Now {
    /// Answered by the filter or the cache.
    Answered(Lookup),
    /// The database must be asked: [`Resource::load`].
    Load(Load),
}

/// The rest of a lookup: one load from the database, through the cache or
/// past it. Opaque: made by [`Resource::lookup_now`] only.
#[derive(Debug)]
pub struct Load {
    key: Key,
    how: How,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum How {
    /// Through the cache. `read_first`: false when `lookup_now` has just
    /// found the key in neither cache, so the load does not read them a
    /// second time (moka would count the key twice for its admission).
    Cached { read_first: bool },
    /// Not in the filter, but above the high-water mark and within the
    /// verify budget (`verify_above_high_water`): through the cache, and
    /// into the filter if the row is there.
    Verify,
    /// Neither filter nor cache is vouched for ([`crate::vouch`]): from the
    /// database past them. `rejected`: the filter rejected the key (within
    /// `verify_budget`), so a row found goes into it.
    Direct { rejected: bool },
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

/// Announced keys waiting for confirmation; more are not confirmed (the mark
/// stays, which is safe).
const CONFIRM_QUEUE: usize = 256;

pub struct Resource {
    pub config: Resolved,
    queries: Queries,
    /// How its key and owner columns compare, and the row query for them
    /// (see `column`): read from the catalog at start-up.
    column: std::sync::OnceLock<column::KeyColumn>,
    db: Arc<Db>,
    live: LiveFilter,
    cache: RowCache<Key>,
    rebuilds: Coordinator<RebuildOutcome>,
    last_build: Mutex<Option<BuildReport>>,
    last_refusal: Mutex<Option<RefusalReport>>,
    last_outcome: Mutex<Option<LastOutcome>>,
    /// Spent on keys above the high-water mark: checked against the
    /// database instead of rejected, and announced keys confirmed.
    verify_budget: TokenBucket,
    /// Announced keys above the mark, for the confirming task.
    to_confirm: mpsc::Sender<i64>,
    to_confirm_rx: Mutex<Option<mpsc::Receiver<i64>>>,
    /// "row load failed" at most once per interval: in an outage every cold
    /// key fails (each is counted as the `unavailable` outcome).
    load_failure_log: LogThrottle,
    /// "a key matched more than one row", at most once per interval.
    not_unique_log: LogThrottle,
    /// Slots for row loads, shared by every resource of the gateway
    /// (`server.max_concurrency`); see [`LoadError::Overloaded`].
    loads: Arc<tokio::sync::Semaphore>,
    /// Whether the filter and cache may answer (see [`crate::vouch`]).
    pub vouch: Vouch,
    /// The key's columns and types (`config.key`), as parsing wants them.
    key_parts: Box<[(Arc<str>, KeyType)]>,
    /// Started with no feed to follow (the bus down, no fall-back ticket
    /// free): until its first build swaps in, every key is asked of the
    /// database within `verify_budget` ([`Resource::answer_unbuilt`]).
    unbuilt_answers: std::sync::atomic::AtomicBool,
    /// Ready at least once since start-up (see [`Resource::note_ready`]).
    was_ready: std::sync::atomic::AtomicBool,
    pub stats: Stats,
    /// The fleet's snapshots on the bus (see `fleet`), when configured.
    snapshots: std::sync::OnceLock<fleet::Fleet>,
    /// A snapshot the joining consumer hands the next rebuild.
    joining: Mutex<Option<crate::snapshot::Opened>>,
    /// The first filter came from the fleet's snapshot.
    joined: std::sync::atomic::AtomicBool,
    /// Keys recent commits inserted (see "Recent keys" in `fleet`).
    recent: Mutex<recent::Recent>,
}

impl Resource {
    /// `loads`: the gateway's semaphore of row-load slots.
    pub fn new(config: Resolved, db: Arc<Db>, loads: Arc<tokio::sync::Semaphore>) -> Self {
        let key: Vec<(&str, &str)> = config
            .key
            .iter()
            .map(|p| (p.column.as_str(), p.ty.sql_type()))
            .collect();
        let queries = Queries::new(&config.table, &key, &config.columns);
        let verify_budget = TokenBucket::new(config.filter.verify_budget);
        let (to_confirm, rx) = mpsc::channel(CONFIRM_QUEUE);
        Self {
            queries,
            column: std::sync::OnceLock::new(),
            cache: RowCache::new(&config.cache),
            // A composite key is hashed as bytes (`key`'s encoding).
            live: LiveFilter::new(
                config.filter.clone(),
                config.single_type().unwrap_or(KeyType::Text),
            ),
            key_parts: config
                .key
                .iter()
                .map(|p| (Arc::from(p.column.as_str()), p.ty))
                .collect(),
            config,
            db,
            rebuilds: Coordinator::default(),
            last_build: Mutex::new(None),
            last_refusal: Mutex::new(None),
            last_outcome: Mutex::new(None),
            verify_budget,
            to_confirm,
            to_confirm_rx: Mutex::new(Some(rx)),
            load_failure_log: LogThrottle::default(),
            not_unique_log: LogThrottle::default(),
            loads,
            vouch: Vouch::default(),
            unbuilt_answers: std::sync::atomic::AtomicBool::new(false),
            was_ready: std::sync::atomic::AtomicBool::new(false),
            stats: Stats::default(),
            snapshots: std::sync::OnceLock::new(),
            joining: Mutex::new(None),
            joined: std::sync::atomic::AtomicBool::new(false),
            recent: Mutex::default(),
        }
    }

    pub fn name(&self) -> &str {
        &self.config.name
    }

    /// The key's columns and types, in order.
    pub fn key_parts(&self) -> &[(Arc<str>, KeyType)] {
        &self.key_parts
    }

    /// Ready to answer from its filter and cache: the filter is built (or
    /// there is none), and they are vouched for.
    pub fn is_ready(&self) -> bool {
        self.is_built() && self.vouch.ok()
    }

    /// The filter is built, or there is none to build.
    pub fn is_built(&self) -> bool {
        !self.config.filter.enabled || self.live.is_built()
    }

    /// Answers without a filter until one is built: every key asked of
    /// the database within `filter.verify_budget`, as a running gateway
    /// answers keys its filter rejects while nothing vouches for it. For a
    /// gateway started with no feed to follow (the bus down and every
    /// fall-back ticket taken), which would otherwise never be ready until
    /// the bus returns, and must not scan the primary meanwhile: the feed's
    /// resync when it returns builds the filter, and nothing is vouched
    /// for before that build swaps in (`vouch`).
    pub fn answer_unbuilt(&self) {
        self.unbuilt_answers.store(true, Ordering::Relaxed);
    }

    /// Whether it is ready now, remembered: a resource never ready since
    /// start-up for a cause of its configuration (a table the feed cannot
    /// follow) is not ready, where one that was and lost it is degraded
    /// (`gateway::readiness`).
    pub fn note_ready(&self) -> bool {
        let ready = self.is_ready();
        if ready && !self.was_ready.load(Ordering::Relaxed) {
            self.was_ready.store(true, Ordering::Relaxed);
        }
        ready
    }

    /// Ready at least once since start-up, as [`Resource::note_ready`]
    /// saw it.
    pub fn was_ready(&self) -> bool {
        self.was_ready.load(Ordering::Relaxed)
    }

    /// The filter is built, or the database answers for it meanwhile
    /// ([`Resource::answer_unbuilt`]).
    pub fn answers(&self) -> bool {
        self.is_built() || self.unbuilt_answers.load(Ordering::Relaxed)
    }

    /// Why not ready, for `/readyz`, the admin API and the status page.
    pub fn why_not_ready(&self) -> Option<String> {
        if !self.is_built() {
            if self.unbuilt_answers.load(Ordering::Relaxed) {
                return Some("no filter yet (started with no change feed to follow): every key is asked of the database within filter.verify_budget until the feed returns and the filter is built".into());
            }
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
            self.poison_recent();
            self.vouch.open_gap(why);
        }
        self.cache.clear();
        if self.config.filter.enabled {
            self.request_rebuild(reason, false);
        }
    }

    /// The primary was promoted and the feed proved which of its changes
    /// the new timeline kept (`feed::wal::fork`): every cached row and
    /// negative entry goes (a row read from the old primary may be one the
    /// new timeline lost, and nothing would invalidate it), and the filter
    /// is kept if its own proof holds (see "Across a promotion" in
    /// `live_filter`). False: it does not, and the caller resyncs.
    pub fn keep_across(&self, fork: &crate::db::position::Fork) -> bool {
        self.cache.clear();
        if !self.config.filter.enabled {
            return true;
        }
        match self.live.keep_across(fork) {
            Ok(()) => {
                self.stats
                    .kept_across_failover
                    .fetch_add(1, Ordering::Relaxed);
                tracing::info!(resource = %self.config.name, "filter kept across the promotion; caches emptied");
                true
            }
            Err(why) => {
                tracing::info!(resource = %self.config.name, why = %why, "filter not kept across the promotion: rebuilt");
                false
            }
        }
    }

    /// Parses the raw path segments of a key, one per key column, for
    /// this resource's key types.
    pub fn parse_key(&self, raw: &[&str], max_len: usize) -> Result<Key, Error> {
        let key = match (raw, &*self.key_parts) {
            ([one], [(_, ty)]) => key::parse(one, *ty, max_len),
            _ => key::parse_parts(raw, &self.key_parts, max_len),
        }
        .map_err(Error::BadKey)?;
        self.canonical(key)
    }

    /// The request path up to the first await: the filter, then the cache
    /// if it can answer at once. A rejected key and a cache hit are
    /// answered here, without a future (`http::dispatch`); anything else
    /// is a [`Load`] for [`Resource::load`].
    #[inline]
    pub fn lookup_now(&self, key: Key, began: Instant) -> Result<Now, Error> {
        // Before the filter is read (see `vouch`), and for the instant the
        // request began, not for whatever the applier's timer last found.
        let vouched = self.vouch.ok_at(began);
        if !vouched && self.db.outage.is_down() && !self.db.outage.may_try() {
            // One request per `outage::TRY_EVERY` asks the database; the
            // others answer from what was vouched for, or at once: a key
            // neither the cache nor the filter holds waits on no database
            // that does not answer.
            if let Some(age) = self.stale_age()
                && let Some(stale) = self.stale(&key, age)
            {
                return Ok(Now::Answered(stale));
            }
            return Err(Error::Unavailable(
                "the database is unreachable; one request per 250 ms tries it".into(),
            ));
        }
        if self.config.filter.enabled {
            match self.live.contains(&key) {
                Some(true) => {}
                Some(false) if !vouched => {
                    // The filter may lack a key that exists: the database
                    // says, within the budget that bounds what absent keys
                    // cost it.
                    if !self.verify_budget.try_take() {
                        self.stats.unverified.fetch_add(1, Ordering::Relaxed);
                        return Err(Error::Unverified);
                    }
                    return Ok(self.later(key, How::Direct { rejected: true }));
                }
                Some(false) => {
                    if !self.may_verify(&key) {
                        return Ok(Now::Answered(Lookup::Filtered));
                    }
                    self.stats
                        .verified_above_high_water
                        .fetch_add(1, Ordering::Relaxed);
                    return Ok(self.later(key, How::Verify));
                }
                None if self.unbuilt_answers.load(Ordering::Relaxed) => {
                    if !self.verify_budget.try_take() {
                        self.stats.unverified.fetch_add(1, Ordering::Relaxed);
                        return Err(Error::Unverified);
                    }
                    return Ok(self.later(key, How::Direct { rejected: true }));
                }
                None => return Err(Error::NotReady),
            }
        }
        if !vouched {
            return Ok(self.later(key, How::Direct { rejected: false }));
        }
        match self.cache.cached(&key) {
            Peek::Answered(outcome) => Ok(Now::Answered(Lookup::Cached(outcome))),
            Peek::Missed => Ok(self.later(key, How::Cached { read_first: false })),
            Peek::Unknown => Ok(self.later(key, How::Cached { read_first: true })),
        }
    }

    fn later(&self, key: Key, how: How) -> Now {
        Now::Load(Load { key, how })
    }

    /// How long ago the filter and cache were last vouched for, if they may
    /// answer during an outage (see "Outages").
    fn stale_age(&self) -> Option<Duration> {
        match self.stale_standing()? {
            Stale::Within { age, .. } => Some(age),
            Stale::Off | Stale::Past { .. } => None,
        }
    }

    /// Where the answer of "Outages" stands: the age of the last vouch
    /// against `cache.stale_if_error`; `None` if never vouched for. The one
    /// place the window is judged (readiness says what it decides).
    pub fn stale_standing(&self) -> Option<Stale> {
        let since = self.vouch.stale_since()?;
        let window = self.config.cache.stale_if_error;
        let age = since.elapsed();
        Some(if window.is_zero() {
            Stale::Off
        } else if age <= window {
            Stale::Within { age, window }
        } else {
            Stale::Past { age, window }
        })
    }

    /// The answer of "Outages": what the filter and cache say of `key`;
    /// `None` when they hold nothing of it (a cold key asks the database,
    /// which may be back).
    fn stale(&self, key: &Key, age: Duration) -> Option<Lookup> {
        let rejected = self.config.filter.enabled && self.live.contains(key) == Some(false);
        let row = match rejected {
            true => None,
            false => match self.cache.cached(key) {
                Peek::Answered(Outcome::Hit(row)) => Some(row),
                Peek::Answered(Outcome::NegativeHit) => None,
                _ => return None,
            },
        };
        Some(Lookup::Stale {
            row,
            cached: !rejected,
            age,
        })
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
        self.insert_key_at(key, from, None).await;
    }

    /// [`insert_key_from`](Self::insert_key_from) for a commit at `lsn`
    /// (on the feed's timeline), which the fleet's snapshots may need
    /// again (see "Recent keys" in `fleet`).
    pub async fn insert_key_at(&self, key: &Key, from: Provenance, lsn: Option<u64>) {
        if let Some(lsn) = lsn {
            self.remember(lsn, key);
        }
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
        if let Some(d) = self.live.note_delete() {
            self.decayed(d);
        }
        self.stats.deletes.fetch_add(1, Ordering::Relaxed);
        self.cache.invalidate(key).await;
    }

    /// The filter half of [`insert_key_from`](Self::insert_key_from).
    fn add_to_filter(&self, key: &Key, from: Provenance) {
        if let Some(d) = self.live.insert(key, from) {
            self.decayed(d);
        }
    }

    /// Queues an announced key above the mark for confirmation, if the
    /// mark is used at all and the budget allows.
    fn confirm_later(&self, key: &Key) {
        let Key::Int(v) = key else { return };
        if self.config.filter.verify_above_high_water
            && *v > self.live.mark()
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
            if v <= self.live.mark() {
                continue;
            }
            let tally = Tally {
                counts: &self.stats.db_queries,
                kind: QueryKind::Verify,
            };
            match self.db.fetch_json(&self.queries.row, v, tally).await {
                Ok(Some(_)) => self.live.confirm(v),
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

    /// A decay limit was crossed: one rebuild for this build.
    fn decayed(&self, d: Decayed) {
        self.stats.decay_rebuilds.fetch_add(1, Ordering::Relaxed);
        tracing::info!(
            resource = %self.config.name,
            reason = d.reason.as_str(),
            keys = d.keys,
            inserts_since_build = d.inserts_since_build,
            deletes_since_build = d.deletes_since_build,
            "the filter's protection decayed; rebuild requested"
        );
        self.request_rebuild(d.reason, false);
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
        self.live.contains(key) == Some(true)
    }

    /// Stats of the live filter, if built (a scan of a Bloom filter's bits).
    pub fn filter_stats(&self) -> Option<FilterStats> {
        self.live.stats()
    }

    /// The live filter's decay and its rebuild limits, if built.
    pub fn protection(&self) -> Option<Protection> {
        self.live.protection()
    }

    /// The high-water mark (bigint keys, once built).
    pub fn high_water(&self) -> Option<i64> {
        self.live.high_water()
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
        self.live.generation()
    }
}
