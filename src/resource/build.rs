//! The rebuild side of a resource: scanning its table into a new key set
//! and handing it to the [`LiveFilter`](super::LiveFilter) to swap in,
//! the shrink guard, what a rebuild reports, and retrying the rebuilds that
//! recover missed keys.
//!
//! # Rebuilds are requested, never run directly
//! All of them go through the resource's [`Coordinator`](crate::rebuild::Coordinator) (see
//! [`crate::rebuild`]): [`Resource::request_rebuild`] returns at once, the
//! coordinator's task ([`Resource::run_background`], owned by the gateway)
//! runs them one at a time, at most one running and one pending. That is
//! also what makes the live filter's "one window at a time" true.
//!
//! A rebuild asked for because the filter may lack keys (a feed missed
//! changes, or delivered one without its keys: [`Reason::recovers_keys`])
//! that fails, typically because the database it must scan is the one that
//! just went away, is asked for again after a back-off ([`RETRY_FIRST`]
//! doubling to [`RETRY_MAX`]) until one succeeds: those keys must not wait
//! for the next scheduled rebuild, which may be hours away or never.
//!
//! # Vouching
//! A rebuild that swaps in, or whose refused scan was merged into the live
//! set, covers every gap opened before its window (see [`crate::vouch`]):
//! the filter then holds every key of its snapshot.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant, SystemTime};

use tokio::sync::mpsc;

use super::Resource;
use super::fleet::Origin;
use super::live_filter::{Merge, Scanned, Window, stats_of};
use super::report::{BuildReport, LastOutcome, RefusalReport};
use std::borrow::Cow;

use crate::db::DbError;
use crate::db::copy::Fields;
use crate::db::stats::{QueryKind, Tally};
use crate::filter::{FilterError, FilterKey, Item, KeySetBuilder};
use crate::key::compare::Comparison;
use crate::key::{self, KeyType};
use crate::rebuild::{self, Job, Reason, Ticket};
use crate::shutdown::Shutdown;

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

/// What a rebuild ends with; cloneable, so every request merged into one
/// rebuild gets it.
pub type RebuildOutcome = Result<BuildReport, RebuildError>;

/// The first wait before a failed key-recovering rebuild is asked for
/// again (see the module doc); it doubles up to [`RETRY_MAX`].
pub const RETRY_FIRST: Duration = Duration::from_secs(1);
pub const RETRY_MAX: Duration = Duration::from_secs(30);

impl Resource {
    /// Checks that the table, key column and columns exist and fit the key
    /// type, by running the row query for a NULL key (which matches nothing).
    pub async fn probe(&self) -> Result<(), DbError> {
        let sql = &self.queries.row;
        let tally = Tally {
            counts: &self.stats.db_queries,
            kind: QueryKind::Probe,
        };
        match self.config.single_type() {
            Some(KeyType::Bigint) => self.db.fetch_json(sql, None::<i64>, tally).await,
            Some(KeyType::Uuid) => self.db.fetch_json(sql, None::<uuid::Uuid>, tally).await,
            Some(KeyType::Text) => self.db.fetch_json(sql, None::<String>, tally).await,
            // A composite key's parts are one `text[]` (`Queries::row_query`).
            None => self.db.fetch_json(sql, None::<Vec<String>>, tally).await,
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

    /// Whether a rebuild's window is open (it is scanning).
    pub fn journal_open(&self) -> bool {
        self.live.journal_open()
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
        let (window, covers) = self.live.open_rebuild_window(&self.vouch);
        let gaps_before = covers.gaps();
        let result = self
            .build_and_swap(window, job.force, began, &reasons, gaps_before)
            .await;
        if let Ok(_) | Err(RebuildError::Shrunk { .. }) = &result {
            // Swapped in, or every key the scan found merged into the live
            // filter: the filter holds every key of the snapshot.
            self.vouch.rebuild_covered(covers);
        }
        self.settle_recent(result.is_ok() && self.vouch.gaps_opened() <= gaps_before);
        self.record(&result, &reasons, job.ticket);
        result
    }

    async fn build_and_swap(
        &self,
        window: Window<'_>,
        force: bool,
        began: Instant,
        reasons: &[&'static str],
        gaps_before: u64,
    ) -> RebuildOutcome {
        let (mut scanned, mut origin) = self.obtain().await?;
        // A snapshot the guard would refuse is not used: its publisher's
        // first build had no guard, and the refusal's merge needs a scan
        // of this gateway's own anyway.
        if let Origin::Loaded { .. } = origin {
            if self.check_shrink(scanned.keys, force).is_err() {
                tracing::warn!(resource = %self.name(), keys = scanned.keys, "the fleet's snapshot holds far fewer keys than this filter (filter.max_shrink): not used; scanning");
                self.count_snapshot(|s| &s.scans_after_refusal);
                (scanned, origin) = (self.scan(FilterKey::random()).await?, Origin::Scan);
            } else {
                self.count_snapshot(|s| &s.loaded);
            }
        }
        let (keys, rows) = (scanned.keys, scanned.rows);
        if let Err((old, min)) = self.check_shrink(keys, force) {
            let merge = window.refuse(scanned.max_int);
            drop(scanned);
            self.publish_after(origin, None, 0).await;
            let recovered = self.merge_into_live(merge).await?;
            return Err(RebuildError::Shrunk {
                old,
                new: keys,
                min,
                max_shrink: self.config.filter.max_shrink,
                recovered,
            });
        }
        let source = origin.name();
        if let Origin::Loaded { by } = &origin {
            tracing::debug!(resource = %self.name(), by = %by, "loading the fleet's snapshot");
        }
        let swapped = window.swap(scanned);
        if let Some(d) = swapped.decayed {
            self.decayed(d);
        }
        self.publish_after(origin, Some(&swapped), gaps_before)
            .await;
        Ok(BuildReport {
            source,
            generation: swapped.generation,
            keys,
            rows_counted: rows,
            replayed: swapped.replayed,
            duration_ms: began.elapsed().as_millis() as u64,
            built_at: SystemTime::now(),
            reasons: reasons.to_vec(),
            filter: stats_of(&swapped.set),
        })
    }

    /// After a refused swap: streams every key into the live set (a second
    /// scan, see `live_filter`). Returns how many it lacked.
    async fn merge_into_live(&self, mut merge: Merge<'_>) -> Result<u64, RebuildError> {
        let mut row_key = self.row_key();
        self.db
            .scan_keys(
                &self.queries,
                &self.stats.db_queries,
                |_| (),
                |_, fields| {
                    if let Some(Some(item)) = row_key.item(fields) {
                        merge.offer(item);
                    }
                },
            )
            .await?;
        let recovered = merge.finish();
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
                self.live.rearm_decay();
                tracing::error!(resource = %self.config.name, reasons = %reasons_text, error = %e, "filter rebuild failed; keeping the current filter");
            }
        }
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

    /// How a scanned row becomes its filter item.
    fn row_key(&self) -> RowKey<'_> {
        RowKey {
            parts: self
                .config
                .key
                .iter()
                .enumerate()
                .map(|(i, p)| (p.ty, self.part_comparison(i)))
                .collect(),
            buf: Vec::new(),
        }
    }

    /// Every key of the table into a new set hashed with `key`.
    pub(super) async fn scan(&self, key: FilterKey) -> Result<Scanned, RebuildError> {
        let f = &self.config.filter;
        let kind = match self.config.single_type() {
            Some(ty) => ty.kind(),
            None => crate::filter::KeyKind::Bytes,
        };
        let mut row_key = self.row_key();
        let mut bad = 0u64;
        let mut rows = 0;
        let mut max_int = i64::MIN;
        let (builder, keys, seen_upto) = self
            .db
            .scan_keys(
                &self.queries,
                &self.stats.db_queries,
                |count| {
                    rows = count;
                    // Sized for growth until the next rebuild; at least one
                    // key so an empty table still gets a valid filter.
                    let expected = ((count as f64) * f.headroom).ceil().max(1.0) as u64;
                    KeySetBuilder::new(f.mode, kind, expected, f.false_positive_rate, key.clone())
                },
                |builder, fields| match (builder, row_key.item(fields)) {
                    (Ok(b), Some(Some(item))) => {
                        if let Item::Int(v) = item {
                            max_int = max_int.max(v);
                        }
                        b.insert(item)
                    }
                    (Ok(_), Some(None)) => bad += 1,
                    (Ok(_), None) | (Err(_), _) => {}
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
            seen_upto,
        })
    }

    /// Requests a rebuild `rebuild_interval` after the last build (whatever
    /// made it), jittered by ±10 % so replicas do not all scan the table at
    /// once, and waits for each. With the fleet's snapshots, sooner: as
    /// soon as the fleet publishes a filter newer than this one's, so the
    /// fleet's schedules follow the first to fire, and its scan serves
    /// them all (`fleet`). Runs until `shutdown` fires.
    pub async fn rebuild_periodically(self: Arc<Self>, mut shutdown: Shutdown) {
        let base = self.config.filter.rebuild_interval;
        if base.is_zero() || !self.config.filter.enabled {
            return;
        }
        // The last snapshot followed: each is followed once.
        let mut followed: Option<String> = None;
        loop {
            let jitter = rand::random_range(0.9..1.1);
            let next = async {
                let wait = base.mul_f64(jitter);
                // Since the later of the last build and this task's last
                // attempt: a refused or failed rebuild waits its interval
                // too, as a loaded one does.
                let attempted = Instant::now();
                loop {
                    let since = self
                        .last_build()
                        .and_then(|r| r.built_at.elapsed().ok())
                        .map_or(attempted.elapsed(), |b| b.min(attempted.elapsed()));
                    let Some(left) = wait.checked_sub(since).filter(|d| !d.is_zero()) else {
                        break;
                    };
                    tokio::time::sleep(left.min(super::fleet::follow_every(base))).await;
                    if let Some(nonce) = self.fleet_rebuilt_since_ours().await
                        && followed.as_ref() != Some(&nonce)
                    {
                        followed = Some(nonce);
                        break;
                    }
                }
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
        // Installed from the fleet's snapshot as the feed started.
        if self.joined()
            && let Some(r) = self.last_build()
        {
            return Ok(r);
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

/// A scanned row's key columns made into the item the filter holds: each
/// value canonical as its column compares (`key::compare`), then, for a
/// composite key, the parts encoded as one (`key::encode_part`), as a
/// request's key is (`Key::item`).
struct RowKey<'a> {
    parts: Vec<(KeyType, &'a Comparison)>,
    buf: Vec<u8>,
}

impl RowKey<'_> {
    /// `None` for a row with a NULL key part (no request names it);
    /// `Some(None)` for a value that cannot be a key of its type.
    fn item<'r>(&'r mut self, mut fields: Fields<'r>) -> Option<Option<Item<'r>>> {
        let RowKey { parts, buf } = self;
        if let [(ty, cmp)] = parts.as_slice() {
            let raw = fields.next()??;
            return Some(match cmp.bytes(raw) {
                Cow::Borrowed(b) => key::item_from_column(*ty, b),
                Cow::Owned(o) => {
                    *buf = o;
                    key::item_from_column(*ty, buf)
                }
            });
        }
        buf.clear();
        for (ty, cmp) in parts.iter() {
            let raw = fields.next()??;
            let raw = cmp.bytes(raw);
            match key::item_from_column(*ty, &raw) {
                Some(item) => key::encode_part(buf, *ty, item),
                None => return Some(None),
            }
        }
        Some(Some(Item::Bytes(buf)))
    }
}
