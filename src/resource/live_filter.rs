//! A resource's live filter: the key set requests are checked against, and
//! everything that keeps it from ever rejecting a key that exists. This is
//! the one place that invariant is kept; it does no I/O (the scan that feeds
//! a rebuild and the checks that confirm keys are the resource's, in
//! `resource::build`).
//!
//! # Never missing a key
//! Keys reach the filter two ways: a full scan (start-up and every rebuild)
//! and live inserts ([`LiveFilter::insert`], fed by whoever learns of new
//! rows). A rebuild scans into a *new* key set while the old one keeps
//! serving, then swaps. A key inserted live during that window would be in
//! the old set only, so live inserts are also recorded in a journal that
//! exists exactly while a rebuild runs ([`Window`]):
//!
//! 1. the rebuild opens the journal ([`LiveFilter::open_window`]), *then*
//!    takes its snapshot;
//! 2. [`LiveFilter::insert`] writes to the live set and the journal under
//!    the journal's lock;
//! 3. the rebuild, holding that lock, replays the journal into the new set
//!    and swaps it in, then closes the journal ([`Window::swap`]).
//!
//! A key inserted before step 1 is in the snapshot (its row committed
//! before it was announced); one inserted between 1 and 3 is replayed; one
//! inserted after 3 goes into the new set directly. Since step 3 holds the
//! lock, no insert can land between "replayed" and "swapped". The WAL feed
//! announces a commit on receipt, a moment before new snapshots see it, so
//! a key it inserted before step 1 may be in neither: the applier inserts
//! it once more at the commit's `Visible` delivery, which comes once
//! snapshots see it, so that second insert is journaled or precedes the
//! snapshot. The journal is closed when its [`Window`] drops, on every way
//! out of a rebuild (success, refusal, error, panic, the rebuild's future
//! dropped at shutdown), so it never collects keys for nobody. One window
//! at a time: the resource's rebuild coordinator runs one rebuild at a time.
//!
//! A swap the shrink guard refuses keeps the live set, but every key the
//! scan found is then streamed into it ([`Window::refuse`], [`Merge`]): a
//! second scan, since two sets with different secret keys and shapes cannot
//! be merged bit-wise, and adding keys is always safe. So a refused rebuild
//! still recovers the keys whose notifications were lost.
//!
//! # The high-water mark
//! For `bigint` keys, `verify_above_high_water` checks a rejected key above
//! the highest key known to exist against the database (a row committed a
//! moment ago). A mark that is too high silently turns that off for every
//! key below it, so the mark only follows keys known to exist:
//! - each swap (and each refusal) *resets* it to the highest key the scan
//!   found, raised by the trusted inserts journaled since the window opened;
//! - a [`Provenance::Trusted`] insert (a WAL change, a row the gateway read)
//!   raises it;
//! - a [`Provenance::Announced`] insert (a `NOTIFY` payload anyone can send)
//!   goes into the set at once but raises the mark only through
//!   [`LiveFilter::confirm`], once the database has confirmed the row.
//!
//! Raises and resets both happen under the journal lock, so a reset cannot
//! lose a raise.
//!
//! # Across a promotion
//! A filter may hold keys that do not exist; it must hold every key that
//! does. A promotion the feed proved (`feed::wal::fork`: the new timeline
//! forked from the old at `F`; the stream goes on from at or before both
//! `F` and what was applied) loses the old timeline's changes past `F`.
//! What they did to the live set:
//! - their deletes did nothing: a deleted key stays in the set (Bloom or
//!   exact) until the next build, so there is nothing to put back;
//! - their inserts left keys the new history lacks: extra keys, which a
//!   filter may hold. Nothing relies on an exact set having none: it holds
//!   deleted keys already, and every key it passes is looked up. What did
//!   rely on them is the high-water mark ("known to exist"): it is lowered
//!   to what the build's scan found, forgetting every raise since (a
//!   lower mark only sends more rejected keys to the database). A row
//!   read by a load that began before the promotion may be a lost one: it
//!   goes into the set, but raises the mark only when no promotion was
//!   kept across meanwhile ([`LiveFilter::forks`]).
//!
//! What the *scan* of the live set's build saw is another matter: a
//! snapshot of the old primary past `F` may lack a row that a lost delete
//! removed and the new timeline still has. So the set is kept only when
//! its scan saw nothing past `F` (the insert position read in the scan's
//! transaction, `db::Db::scan_keys`, at or before `F` on the old timeline,
//! or on the new one already), and no rebuild's window is open (its scan
//! may be reading the old primary). A set loaded from a snapshot or
//! scanned on a replica has no such position: rebuilt.
//!
//! # Decay
//! Inserts fill a Bloom filter past the count it was sized for, and deleted
//! keys stay in any filter; both let more absent keys through. Each swap
//! precomputes limits (from the sizing model, [`KeySet::max_keys_at_rate`])
//! and every live insert or delete compares counters with them, O(1): past
//! `rebuild_fp_multiple` × the target rate, past `rebuild_delete_fraction`
//! of the keys deleted, or past `rebuild_insert_fraction` of the keys
//! inserted live (which bounds an exact set forged inserts would grow).
//! Crossing one yields a [`Decayed`] once per build, for the resource to
//! request a rebuild with.

use std::cell::Cell;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use arc_swap::ArcSwapOption;

use super::report::Protection;
use crate::config::FilterConfig;
use crate::db::position::{Fork, Position};
use crate::filter::{FilterStats, Item, KeySet};
use crate::key::{Key, KeyType};
use crate::rebuild::Reason;
use crate::vouch::{Covers, Vouch};

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

/// A key set built by a scan, ready to be swapped in.
pub struct Scanned {
    pub set: KeySet,
    /// Keys the scan inserted.
    pub keys: u64,
    /// Rows the scan counted before it began (what the set was sized for).
    pub rows: u64,
    /// The highest integer key found, `i64::MIN` if none.
    pub max_int: i64,
    /// A position the scan's snapshot saw nothing past, if known (see
    /// "Across a promotion").
    pub seen_upto: Option<Position>,
}

/// What a swap did.
pub struct Swapped {
    pub generation: u64,
    pub set: Arc<KeySet>,
    /// Journaled keys replayed into the new set.
    pub replayed: u64,
    /// Deletes carried over from the scan's window may pass the new build's
    /// limit at once.
    pub decayed: Option<Decayed>,
}

/// A decay limit was crossed: one rebuild should be requested.
#[derive(Clone, Copy, Debug)]
pub struct Decayed {
    pub reason: Reason,
    pub keys: u64,
    pub inserts_since_build: u64,
    pub deletes_since_build: u64,
}

/// Fewest live inserts that can ask for a rebuild by
/// `rebuild_insert_fraction`, so a small table is not rebuilt every few
/// inserts.
const MIN_GROWTH_LIMIT_BASE: u64 = 1024;

pub struct LiveFilter {
    config: FilterConfig,
    key_type: KeyType,
    set: ArcSwapOption<KeySet>,
    /// Open (Some) exactly while a [`Window`] lives.
    journal: Mutex<Option<Journal>>,
    generation: AtomicU64,
    /// The highest integer key known to exist (see the module doc).
    high_water: AtomicI64,
    decay: Decay,
    /// What the live set's build saw (see "Across a promotion"), under the
    /// journal lock.
    built: Mutex<Built>,
    /// Promotions the set was kept across: a load that began before one
    /// may have read the old primary, and must not raise the mark.
    forks: AtomicU64,
}

/// The live set's build, as a promotion asks about it.
#[derive(Clone, Copy, Debug)]
struct Built {
    /// A position its scan saw nothing past (`None`: unknown, a snapshot
    /// loaded, or the scan's position not read).
    seen_upto: Option<Position>,
    /// The highest key its scan found.
    max_int: i64,
}

impl LiveFilter {
    pub fn new(config: FilterConfig, key_type: KeyType) -> Self {
        Self {
            config,
            key_type,
            set: ArcSwapOption::empty(),
            journal: Mutex::new(None),
            generation: AtomicU64::new(0),
            high_water: AtomicI64::new(i64::MIN),
            decay: Decay::default(),
            built: Mutex::new(Built {
                seen_upto: None,
                max_int: i64::MIN,
            }),
            forks: AtomicU64::new(0),
        }
    }

    /// A set has been swapped in.
    pub fn is_built(&self) -> bool {
        self.set.load().is_some()
    }

    /// Whether the live set may hold `key`; `None` before the first swap.
    #[inline]
    pub fn contains(&self, key: &Key) -> Option<bool> {
        self.set.load().as_ref().map(|s| s.contains(key.item()))
    }

    /// `key` is an integer above the high-water mark.
    #[inline]
    pub fn above_high_water(&self, key: &Key) -> bool {
        matches!(key, Key::Int(v) if *v > self.high_water.load(Ordering::Relaxed))
    }

    /// Adds a key that now exists to the live set and, while a window is
    /// open, to its journal; raises the mark if `from` is trusted. O(1)
    /// apart from the insert itself; returns the decay limit it crossed, if
    /// this insert is the one to ask for a rebuild.
    pub fn insert(&self, key: &Key, from: Provenance) -> Option<Decayed> {
        let mut journal = self.lock_journal();
        let changed = match self.set.load().as_ref() {
            Some(set) => set.insert(key.item()),
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
        if changed { self.check_decay() } else { None }
    }

    /// Counts a deleted row towards the delete limit (its key stays in the
    /// set until the next build).
    pub fn note_delete(&self) -> Option<Decayed> {
        {
            let mut journal = self.lock_journal();
            self.decay.deletes.fetch_add(1, Ordering::Relaxed);
            if let Some(j) = journal.as_mut() {
                j.deletes += 1;
            }
        }
        self.check_decay()
    }

    /// An announced key the database has confirmed: it may raise the mark.
    pub fn confirm(&self, v: i64) {
        self.raise_mark(&mut self.lock_journal(), v);
    }

    /// The mark, as compared with keys (`i64::MIN` before any).
    pub fn mark(&self) -> i64 {
        self.high_water.load(Ordering::Relaxed)
    }

    /// The high-water mark (bigint keys, once one is known).
    pub fn high_water(&self) -> Option<i64> {
        let v = self.mark();
        (self.key_type == KeyType::Bigint && v != i64::MIN).then_some(v)
    }

    /// Bumped on every swap.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Relaxed)
    }

    /// Whether the live set survives the promotion `fork` (see "Across a
    /// promotion"): if so, forgets the mark's raises since its build, and
    /// its build counts as one of the new timeline; else why not.
    pub fn keep_across(&self, fork: &Fork) -> Result<(), String> {
        let journal = self.lock_journal();
        if journal.is_some() {
            return Err("a rebuild was scanning the old primary when it changed".into());
        }
        if !self.is_built() {
            return Err("no filter yet".into());
        }
        let mut built = self.lock_built();
        match built.seen_upto {
            Some(p) if p.timeline == fork.to => {}
            Some(p) if p.timeline == fork.from && p.lsn <= fork.at => {
                built.seen_upto = Some(Position::new(fork.to, p.lsn));
            }
            Some(p) => {
                return Err(format!(
                    "its build saw {p}, which the new timeline (forked at {} on timeline {}) may not hold",
                    fork.at, fork.from.id
                ));
            }
            None => {
                return Err("its build has no position to compare with the fork (a snapshot loaded, or the scan's position not read)".into());
            }
        }
        // Lowered only: under the journal lock, as every raise. A load
        // that began before this may have read the old primary: it checks
        // `forks` before it raises the mark.
        self.forks.fetch_add(1, Ordering::Relaxed);
        self.high_water.fetch_min(built.max_int, Ordering::Relaxed);
        drop(journal);
        Ok(())
    }

    /// Promotions the set was kept across so far: a load reads it when it
    /// begins, and raises the mark only if it has not changed when the row
    /// is in (see "Across a promotion").
    pub fn forks(&self) -> u64 {
        self.forks.load(Ordering::Relaxed)
    }

    fn lock_built(&self) -> MutexGuard<'_, Built> {
        self.built.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A rebuild's window is open.
    pub fn journal_open(&self) -> bool {
        self.lock_journal().is_some()
    }

    /// Stats of the live set, if built: O(bits) for a Bloom filter, so
    /// never under the journal lock (asserted in debug builds).
    pub fn stats(&self) -> Option<FilterStats> {
        self.set.load().as_ref().map(|s| stats_of(s))
    }

    /// A failed rebuild: a decay limit may ask again at the next insert or
    /// delete past it (a refusal does not re-arm: it would only be refused
    /// again).
    pub fn rearm_decay(&self) {
        self.decay.requested.store(false, Ordering::Relaxed);
    }

    /// Opens a rebuild's window (step 1 of the module doc), and only then
    /// takes the rebuild's ticket from `vouch`: the gaps it covers are
    /// those opened before the window, whose events the scan's snapshot,
    /// taken after this returns, includes (see `vouch`). One call, so the
    /// order cannot be written the other way round.
    pub fn open_rebuild_window(&self, vouch: &Vouch) -> (Window<'_>, Covers) {
        let window = self.open_window();
        (window, vouch.rebuild_began())
    }

    /// Opens a rebuild's window: take the scan's snapshot after this
    /// returns.
    fn open_window(&self) -> Window<'_> {
        let mut journal = self.lock_journal();
        debug_assert!(journal.is_none(), "one rebuild window at a time");
        *journal = Some(Journal::new());
        Window { live: self }
    }

    /// The live set's decay and its rebuild limits, if built. O(1).
    pub fn protection(&self) -> Option<Protection> {
        let set = self.set.load_full()?;
        let f = &self.config;
        let d = &self.decay;
        let keys_at_build = d.keys_at_build.load(Ordering::Relaxed);
        let grown = d.grown.load(Ordering::Relaxed);
        let keys = keys_at_build.saturating_add(grown);
        let rebuild_at_keys = limit_or_never(d.fp_limit_keys.load(Ordering::Relaxed));
        Some(Protection {
            keys,
            keys_at_build,
            target_fp_rate: f.false_positive_rate,
            estimated_fp_rate: set.fp_rate_at(keys),
            rebuild_fp_rate: rebuild_at_keys.map(|_| f.rebuild_fp_multiple * f.false_positive_rate),
            rebuild_at_keys,
            inserts_since_build: grown,
            rebuild_at_inserts: limit_or_never(d.growth_limit.load(Ordering::Relaxed)),
            deletes_since_build: d.deletes.load(Ordering::Relaxed),
            rebuild_at_deletes: limit_or_never(d.delete_limit.load(Ordering::Relaxed)),
            rebuild_requested: d.requested.load(Ordering::Relaxed),
        })
    }

    fn raise_mark(&self, journal: &mut JournalLock<'_>, v: i64) {
        self.high_water.fetch_max(v, Ordering::Relaxed);
        if let Some(j) = journal.as_mut() {
            j.high = j.high.max(v);
        }
    }

    /// Takes the journal (closing it) and resets the high-water mark to
    /// what the scan found plus what raised it since the window opened.
    fn close_journal(&self, journal: &mut JournalLock<'_>, scan_max: i64) -> Journal {
        let pending = journal.take().unwrap_or_else(Journal::new);
        self.high_water
            .store(scan_max.max(pending.high), Ordering::Relaxed);
        pending
    }

    /// A few atomic loads; `Some` once per build, for the first crossing.
    fn check_decay(&self) -> Option<Decayed> {
        let d = &self.decay;
        if d.requested.load(Ordering::Relaxed) {
            return None;
        }
        let grown = d.grown.load(Ordering::Relaxed);
        let deletes = d.deletes.load(Ordering::Relaxed);
        let keys = d
            .keys_at_build
            .load(Ordering::Relaxed)
            .saturating_add(grown);
        let reason = if keys > d.fp_limit_keys.load(Ordering::Relaxed) {
            Reason::FalsePositives
        } else if grown > d.growth_limit.load(Ordering::Relaxed) {
            Reason::Growth
        } else if deletes > d.delete_limit.load(Ordering::Relaxed) {
            Reason::Deletes
        } else {
            return None;
        };
        if d.requested.swap(true, Ordering::Relaxed) {
            return None;
        }
        Some(Decayed {
            reason,
            keys,
            inserts_since_build: grown,
            deletes_since_build: deletes,
        })
    }

    /// The decay limits for a new build of `set` holding `keys` keys.
    fn limits(&self, set: &KeySet, keys: u64) -> Limits {
        let f = &self.config;
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

    fn lock_journal(&self) -> JournalLock<'_> {
        let guard = self.journal.lock().unwrap_or_else(|p| p.into_inner());
        JOURNAL_HELD.with(|h| h.set(h.get() + 1));
        JournalLock(guard)
    }
}

/// A rebuild in progress: the journal is open while this lives and closed
/// when it drops, however the rebuild ends.
pub struct Window<'a> {
    live: &'a LiveFilter,
}

impl<'a> Window<'a> {
    /// Step 3: under the journal lock, replays the journal into `scanned`,
    /// resets the mark and the decay counters, and swaps it in.
    pub fn swap(self, scanned: Scanned) -> Swapped {
        let live = self.live;
        let Scanned {
            set,
            keys,
            max_int,
            seen_upto,
            ..
        } = scanned;
        // Computed before the lock: the sizing model is cheap, but nothing
        // that can be done outside belongs under it.
        let limits = live.limits(&set, keys);
        let mut journal = live.lock_journal();
        let pending = live.close_journal(&mut journal, max_int);
        let mut replayed_new = 0;
        for k in &pending.keys {
            replayed_new += u64::from(set.insert(k.item()));
        }
        let generation = live.generation.fetch_add(1, Ordering::Relaxed) + 1;
        let d = &live.decay;
        d.keys_at_build
            .store(keys + replayed_new, Ordering::Relaxed);
        d.grown.store(0, Ordering::Relaxed);
        d.deletes.store(pending.deletes, Ordering::Relaxed);
        d.fp_limit_keys.store(limits.fp_keys, Ordering::Relaxed);
        d.growth_limit.store(limits.growth, Ordering::Relaxed);
        d.delete_limit.store(limits.deletes, Ordering::Relaxed);
        d.requested.store(false, Ordering::Relaxed);
        let set = Arc::new(set);
        live.set.store(Some(set.clone()));
        *live.lock_built() = Built { seen_upto, max_int };
        drop(journal);
        Swapped {
            generation,
            set,
            replayed: pending.keys.len() as u64,
            decayed: live.check_decay(),
        }
    }

    /// The shrink guard refused the scan: closes the journal, resets the
    /// mark to what the scan found (a fact either way), and returns the
    /// merge that the second scan feeds (see the module doc).
    pub fn refuse(self, scan_max: i64) -> Merge<'a> {
        let live = self.live;
        live.close_journal(&mut live.lock_journal(), scan_max);
        Merge {
            live,
            set: live.set.load_full(),
            recovered: 0,
            grown: 0,
        }
    }

    /// The live filter's shape, for sizing decisions (the last swap's key
    /// count is the shrink guard's business, not this).
    pub fn live(&self) -> &LiveFilter {
        self.live
    }
}

impl Drop for Window<'_> {
    fn drop(&mut self) {
        *self.live.lock_journal() = None;
    }
}

/// Every key of a refused scan, into the live set.
pub struct Merge<'a> {
    live: &'a LiveFilter,
    set: Option<Arc<KeySet>>,
    recovered: u64,
    grown: u64,
}

impl Merge<'_> {
    /// One key the scan found.
    pub fn offer(&mut self, item: Item<'_>) {
        if let Some(set) = &self.set
            && !set.contains(item)
        {
            self.recovered += 1;
            self.grown += u64::from(set.insert(item));
        }
    }

    /// How many keys the live set lacked.
    pub fn finish(self) -> u64 {
        self.live
            .decay
            .grown
            .fetch_add(self.grown, Ordering::Relaxed);
        self.recovered
    }
}

/// Live inserts recorded while a window is open.
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
/// itself in [`JOURNAL_HELD`] so that [`stats_of`], which scans the whole
/// bit array, can assert it is not held (debug builds; tested below).
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
/// (about 1 ms per 10 MB), so never under the journal lock.
pub(super) fn stats_of(set: &KeySet) -> FilterStats {
    debug_assert_eq!(
        JOURNAL_HELD.with(Cell::get),
        0,
        "filter stats scan the bit array: never under the journal lock"
    );
    set.stats()
}

/// The decay of the live set since its build, and the limits past which a
/// rebuild is requested. Reset at every swap, under the journal lock, which
/// every insert also takes, so counts and limits always belong to one build.
struct Decay {
    keys_at_build: AtomicU64,
    /// Live inserts since the build that changed the set.
    grown: AtomicU64,
    deletes: AtomicU64,
    /// `u64::MAX`: never.
    fp_limit_keys: AtomicU64,
    growth_limit: AtomicU64,
    delete_limit: AtomicU64,
    /// A rebuild has been asked for this build.
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

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use proptest::prelude::*;

    use super::*;
    use crate::filter::{FilterKey, KeyKind, KeySetBuilder, Mode};

    fn config(mode: Mode) -> FilterConfig {
        FilterConfig {
            mode,
            ..FilterConfig::default()
        }
    }

    /// A scan of `rows`: what a rebuild's snapshot would find.
    fn scan(mode: Mode, rows: &BTreeSet<i64>) -> Scanned {
        let mut b = KeySetBuilder::new(
            mode,
            KeyKind::Int,
            (rows.len() as u64 * 2).max(16),
            0.01,
            FilterKey::random(),
        )
        .unwrap();
        for v in rows {
            b.insert(Item::Int(*v));
        }
        Scanned {
            set: b.finish(),
            keys: rows.len() as u64,
            rows: rows.len() as u64,
            max_int: rows.iter().copied().max().unwrap_or(i64::MIN),
            seen_upto: None,
        }
    }

    fn mode() -> impl Strategy<Value = Mode> {
        prop_oneof![Just(Mode::Bloom), Just(Mode::Exact)]
    }

    /// When, relative to one rebuild, a row is committed and announced.
    #[derive(Clone, Copy, Debug)]
    enum When {
        /// Before the window opened: the snapshot sees it.
        BeforeWindow,
        /// After the window opened, before the snapshot: the snapshot sees
        /// it and the journal has it.
        BeforeSnapshot,
        /// After the snapshot, before the swap: only the journal has it.
        AfterSnapshot,
        /// After the swap: into the new set directly.
        AfterSwap,
    }

    fn when() -> impl Strategy<Value = When> {
        prop_oneof![
            Just(When::BeforeWindow),
            Just(When::BeforeSnapshot),
            Just(When::AfterSnapshot),
            Just(When::AfterSwap),
        ]
    }

    proptest! {
        /// The never-miss invariant: whatever the interleaving of commits
        /// (each announced as a live insert) with a rebuild, every key that
        /// exists is in the set swapped in; and the mark is the highest
        /// trusted key, never above every key that exists.
        #[test]
        fn a_rebuild_never_loses_a_committed_key(
            mode in mode(),
            initial in proptest::collection::btree_set(0i64..5_000, 0..200),
            commits in proptest::collection::vec((0i64..5_000, when(), any::<bool>()), 0..200),
        ) {
            let live = LiveFilter::new(config(mode), KeyType::Bigint);
            live.open_window().swap(scan(mode, &initial));
            let mut table = initial.clone();
            let mut trusted_high = initial.iter().copied().max().unwrap_or(i64::MIN);
            let from = |t: bool| if t { Provenance::Trusted } else { Provenance::Announced };
            let phase = |w: When, table: &mut BTreeSet<i64>, high: &mut i64| {
                for &(k, _, t) in commits.iter().filter(|(_, c, _)| std::mem::discriminant(c) == std::mem::discriminant(&w)) {
                    table.insert(k);
                    if t { *high = (*high).max(k); }
                    live.insert(&Key::Int(k), from(t));
                }
            };
            phase(When::BeforeWindow, &mut table, &mut trusted_high);
            // The scan's high comes from what it finds, which includes
            // announced keys: they exist, the scan is the proof.
            let window = live.open_window();
            phase(When::BeforeSnapshot, &mut table, &mut trusted_high);
            let snapshot = table.clone();
            phase(When::AfterSnapshot, &mut table, &mut trusted_high);
            let journal_high = commits.iter().filter(|(_, w, t)| *t && matches!(w, When::BeforeSnapshot | When::AfterSnapshot)).map(|c| c.0).max().unwrap_or(i64::MIN);
            window.swap(scan(mode, &snapshot));
            prop_assert_eq!(live.mark(), snapshot.iter().copied().max().unwrap_or(i64::MIN).max(journal_high));
            phase(When::AfterSwap, &mut table, &mut trusted_high);
            for k in &table {
                prop_assert_eq!(live.contains(&Key::Int(*k)), Some(true), "key {} lost", k);
            }
            prop_assert!(table.is_empty() || live.mark() <= *table.iter().max().unwrap());
            prop_assert!(!live.journal_open());
        }

        /// A refused swap keeps the live set and merges in what the scan
        /// found: keys the live set missed (lost notifications) are served
        /// afterwards, and keys inserted during the window stay.
        #[test]
        fn a_refused_rebuild_still_recovers_every_scanned_key(
            mode in mode(),
            initial in proptest::collection::btree_set(0i64..5_000, 1..100),
            lost in proptest::collection::btree_set(5_000i64..10_000, 0..100),
            during in proptest::collection::btree_set(10_000i64..15_000, 0..50),
        ) {
            let live = LiveFilter::new(config(mode), KeyType::Bigint);
            live.open_window().swap(scan(mode, &initial));
            let window = live.open_window();
            for k in &during {
                live.insert(&Key::Int(*k), Provenance::Trusted);
            }
            let table: BTreeSet<i64> = initial.iter().chain(&lost).copied().collect();
            let found = scan(mode, &table);
            let mut merge = window.refuse(found.max_int);
            for v in &table {
                merge.offer(Item::Int(*v));
            }
            let recovered = merge.finish();
            for k in table.iter().chain(&during) {
                prop_assert_eq!(live.contains(&Key::Int(*k)), Some(true), "key {} lost", k);
            }
            if mode == Mode::Exact {
                prop_assert_eq!(recovered, lost.len() as u64);
            }
            prop_assert!(!live.journal_open());
            prop_assert_eq!(live.generation(), 1);
        }
    }

    /// The protocol under real concurrency: a writer commits keys to a
    /// "table" (a counter: keys `0..committed`) and then inserts them live,
    /// while rebuilds snapshot the table and swap. No committed key is ever
    /// missing once its insert returned.
    #[test]
    fn concurrent_inserts_survive_concurrent_rebuilds() {
        const KEYS: i64 = 20_000;
        let live = Arc::new(LiveFilter::new(config(Mode::Bloom), KeyType::Bigint));
        live.open_window().swap(scan(Mode::Bloom, &BTreeSet::new()));
        let committed = Arc::new(AtomicI64::new(0));
        let writer = {
            let (live, committed) = (live.clone(), committed.clone());
            std::thread::spawn(move || {
                for k in 0..KEYS {
                    committed.store(k + 1, Ordering::SeqCst);
                    live.insert(&Key::Int(k), Provenance::Trusted);
                    // Every key inserted so far is in whichever set is live.
                    if k % 97 == 0 {
                        for j in (0..=k).step_by(13) {
                            assert_eq!(live.contains(&Key::Int(j)), Some(true), "key {j} lost");
                        }
                    }
                }
            })
        };
        let mut swaps = 0;
        while !writer.is_finished() {
            let window = live.open_window();
            let snapshot: BTreeSet<i64> = (0..committed.load(Ordering::SeqCst)).collect();
            window.swap(scan(Mode::Bloom, &snapshot));
            swaps += 1;
        }
        writer.join().unwrap();
        for k in 0..KEYS {
            assert_eq!(live.contains(&Key::Int(k)), Some(true), "key {k} lost");
        }
        assert_eq!(live.generation(), swaps + 1);
        assert_eq!(live.high_water(), Some(KEYS - 1));
    }

    /// Dropping a window (a rebuild that failed or was cancelled) closes
    /// the journal; the live set and its mark stay.
    #[test]
    fn a_dropped_window_closes_the_journal_and_keeps_the_set() {
        let live = LiveFilter::new(config(Mode::Bloom), KeyType::Bigint);
        live.open_window()
            .swap(scan(Mode::Bloom, &BTreeSet::from([1, 2, 3])));
        let window = live.open_window();
        live.insert(&Key::Int(10), Provenance::Trusted);
        assert!(live.journal_open());
        drop(window);
        assert!(!live.journal_open());
        assert_eq!(live.contains(&Key::Int(10)), Some(true));
        assert_eq!(live.high_water(), Some(10));
        assert_eq!(live.generation(), 1);
    }

    /// An announced key goes into the set but does not raise the mark
    /// until confirmed; a trusted one raises it at once.
    #[test]
    fn only_trusted_or_confirmed_keys_raise_the_mark() {
        let live = LiveFilter::new(config(Mode::Bloom), KeyType::Bigint);
        live.open_window()
            .swap(scan(Mode::Bloom, &BTreeSet::from([5])));
        live.insert(&Key::Int(1_000), Provenance::Announced);
        assert_eq!(live.contains(&Key::Int(1_000)), Some(true));
        assert_eq!(live.high_water(), Some(5));
        assert!(live.above_high_water(&Key::Int(6)));
        live.confirm(1_000);
        assert_eq!(live.high_water(), Some(1_000));
        live.insert(&Key::Int(2_000), Provenance::Trusted);
        assert_eq!(live.high_water(), Some(2_000));
        assert!(!live.above_high_water(&Key::Int(2_000)));
    }

    const T1: crate::db::position::Timeline = crate::db::position::Timeline { system: 7, id: 1 };
    const T2: crate::db::position::Timeline = crate::db::position::Timeline { system: 7, id: 2 };

    fn fork_at(at: u64) -> Fork {
        Fork {
            from: T1,
            at: crate::db::position::Lsn(at),
            to: T2,
        }
    }

    fn seen(timeline: crate::db::position::Timeline, lsn: u64) -> Option<Position> {
        Some(Position::new(timeline, crate::db::position::Lsn(lsn)))
    }

    /// A set is kept across a promotion only when its scan saw nothing
    /// past the fork, and no rebuild is scanning; kept, it holds every key
    /// it held, and the mark forgets the raises since the build.
    #[test]
    fn a_set_survives_a_promotion_only_if_its_scan_saw_nothing_past_the_fork() {
        for mode in [Mode::Bloom, Mode::Exact] {
            let rows = BTreeSet::from([1, 2, 3, 40]);
            let built = |seen_upto| {
                let live = LiveFilter::new(config(mode), KeyType::Bigint);
                live.open_window().swap(Scanned {
                    seen_upto,
                    ..scan(mode, &rows)
                });
                // The lost tail's insert (or a row read since) raised the mark.
                live.insert(&Key::Int(90), Provenance::Trusted);
                live
            };
            // At or before the fork, on the old timeline.
            for lsn in [100, 150] {
                let live = built(seen(T1, lsn));
                assert_eq!(live.forks(), 0);
                assert_eq!(live.keep_across(&fork_at(150)), Ok(()), "{mode:?} {lsn}");
                assert_eq!(
                    live.forks(),
                    1,
                    "a load begun before it will not raise the mark"
                );
                for k in [1, 2, 3, 40, 90] {
                    assert_eq!(
                        live.contains(&Key::Int(k)),
                        Some(true),
                        "{mode:?}: {k} kept"
                    );
                }
                assert_eq!(live.high_water(), Some(40), "{mode:?}: the raise forgotten");
                assert!(live.above_high_water(&Key::Int(41)));
                // Its build now counts as the new timeline's: a second
                // telling, or the next promotion from it, keeps it.
                assert_eq!(live.keep_across(&fork_at(150)), Ok(()));
                let next = Fork {
                    from: T2,
                    at: crate::db::position::Lsn(lsn),
                    to: crate::db::position::Timeline { system: 7, id: 3 },
                };
                assert_eq!(live.keep_across(&next), Ok(()));
            }
            // A scan of the new timeline already is of the new history.
            assert_eq!(built(seen(T2, 999)).keep_across(&fork_at(150)), Ok(()));
            // Past the fork, another timeline, another system, unknown.
            for seen_upto in [
                seen(T1, 151),
                seen(crate::db::position::Timeline { system: 7, id: 5 }, 1),
                seen(crate::db::position::Timeline { system: 8, id: 1 }, 1),
                None,
            ] {
                let live = built(seen_upto);
                assert!(
                    live.keep_across(&fork_at(150)).is_err(),
                    "{mode:?} {seen_upto:?}"
                );
                assert_eq!(
                    live.high_water(),
                    Some(90),
                    "refused: the mark is left alone"
                );
                assert_eq!(live.forks(), 0);
            }
            // A rebuild scanning: its scan may be reading the old primary.
            let live = built(seen(T1, 100));
            let window = live.open_window();
            assert!(live.keep_across(&fork_at(150)).is_err());
            drop(window);
            // Never built.
            let live = LiveFilter::new(config(mode), KeyType::Bigint);
            assert!(live.keep_across(&fork_at(150)).is_err());
        }
    }

    /// Each decay limit asks for one rebuild per build, and a swap re-arms.
    #[test]
    fn decay_asks_once_per_build() {
        let cfg = FilterConfig {
            mode: Mode::Exact,
            rebuild_delete_fraction: 0.1,
            rebuild_insert_fraction: 0.0,
            rebuild_fp_multiple: 0.0,
            ..FilterConfig::default()
        };
        let live = LiveFilter::new(cfg, KeyType::Bigint);
        let rows: BTreeSet<i64> = (0..100).collect();
        live.open_window().swap(scan(Mode::Exact, &rows));
        let asked: Vec<Decayed> = (0..30).filter_map(|_| live.note_delete()).collect();
        assert_eq!(asked.len(), 1);
        assert_eq!(asked[0].reason, Reason::Deletes);
        assert_eq!(asked[0].deletes_since_build, 11);
        assert!(live.protection().unwrap().rebuild_requested);
        live.rearm_decay();
        assert!(live.note_delete().is_some());
        live.open_window().swap(scan(Mode::Exact, &rows));
        assert!(!live.protection().unwrap().rebuild_requested);
        assert_eq!(live.protection().unwrap().deletes_since_build, 0);
    }

    /// Filter stats scan the bit array: computed under the journal lock
    /// they would stall every request thread inserting or verifying.
    #[test]
    fn filter_stats_are_never_computed_under_the_journal_lock() {
        let live = LiveFilter::new(config(Mode::Bloom), KeyType::Bigint);
        live.open_window()
            .swap(scan(Mode::Bloom, &BTreeSet::from([1])));
        assert_eq!(live.stats().unwrap().kind, "bloom");
        let held = live.lock_journal();
        let under_lock = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| live.stats()));
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
