//! A resource's rebuilds in a fleet that shares snapshots on the bus
//! (`bus.fleet_key_file`; the protocol and its argument: `snapshot`).
//!
//! Where a rebuild's new set comes from, once its window is open:
//!
//! 1. **Joining** ([`Resource::join`]): the consumer, before it passes on
//!    anything at start-up, installs the newest snapshot the stream
//!    continues from, then reads on from its place.
//! 2. **A snapshot complete for the window**: at or past the place `W` the
//!    consumer had read to when the window opened, on its stream, or a
//!    little behind it with the keys applied since still held
//!    (`recent`), and published after this resource's last build (an older
//!    one cannot be better than the filter it would replace). Loaded, no
//!    scan.
//! 3. **The fleet's one scan**: slot 0 of the resource's scan leases on the
//!    stream, free: this gateway scans (with the build key the fleet can
//!    derive), swaps, and publishes; the lease is held, renewed, until the
//!    snapshot is stored, so whoever waits finds the snapshot before it
//!    finds the slot free.
//! 4. **Waiting**: slot 0 is held; the snapshot is looked for every
//!    [`POLL`]. Past `bus.snapshot_wait`, any of the `bus.max_parallel_scans`
//!    slots will do: this gateway scans by itself (and publishes). Past
//!    [`UNLEASED_AFTER`] waits, it scans without a lease: a lease held for
//!    ever (a Redis writer's, or a bug's) never holds a rebuild for ever.
//! 5. **Without the bus**: Redis does not answer, or the consumer is off
//!    the bus (following the WAL itself): a scan, as without snapshots.
//!    The bus failing never makes a gateway wrong, nor waits on it.
//!
//! Every snapshot is checked against the table's catalog state now (its
//! storage, served columns, partitions, publication entry:
//! [`Store::catalog`]): one scanned before a rewrite, a partition attached,
//! a table replaced or a publication edited is not used, whether or not a
//! feed was running to see the change. One that does not open (forged,
//! damaged, another fleet key) or is gone is counted and passed over: the
//! next one, or a scan. A loaded snapshot passes the shrink guard as a
//! scan does (its publisher's first build had none).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::RebuildError;
use super::Resource;
use super::live_filter::{Scanned, Swapped};
use crate::filter::FilterKey;
use crate::key::Key;
use crate::snapshot::{
    self, BuildKey, Lease, MAX_CHUNKS, Manifest, Mark, Opened, SnapshotError, Stats, Store, Stored,
};

/// How often a waiting rebuild looks for the snapshot or a free slot.
const POLL: Duration = Duration::from_millis(200);

/// A scan lease's time to live, renewed every third of it while the scan
/// and the publish run: a gateway that dies mid-scan frees its slot within
/// this.
const LEASE_TTL: Duration = Duration::from_secs(15);

/// How long a publisher lets its consumer catch up with the stream's head
/// before it labels the snapshot (a label behind the head only makes the
/// snapshot useless to gateways that read further).
const CATCH_UP: Duration = Duration::from_secs(1);

/// Past this many `bus.snapshot_wait`s with every slot held, a rebuild
/// scans without a lease.
pub const UNLEASED_AFTER: u32 = 4;

/// How often a resource's schedule looks for a filter the fleet published
/// (see `Resource::rebuild_periodically`): a tenth of the interval, at
/// most this.
const FOLLOW_EVERY: Duration = Duration::from_secs(5);

pub(super) fn follow_every(interval: Duration) -> Duration {
    (interval / 10).clamp(Duration::from_millis(100), FOLLOW_EVERY)
}

/// A resource's part in the fleet: the store, and the watched table whose
/// catalog state a snapshot must match.
pub(super) struct Fleet {
    store: Arc<dyn Store>,
    table: Arc<str>,
    /// Snapshots that did not open, by nonce (the last [`REFUSED`]): not
    /// fetched again, nor counted again.
    refused: std::sync::Mutex<std::collections::VecDeque<String>>,
}

/// Refused snapshots remembered per resource.
const REFUSED: usize = 64;

impl Fleet {
    fn refused(&self, nonce: &str) -> bool {
        self.refused
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .any(|n| n == nonce)
    }

    fn refuse(&self, nonce: &str) {
        let mut r = self.refused.lock().unwrap_or_else(|p| p.into_inner());
        if r.len() >= REFUSED {
            r.pop_front();
        }
        r.push_back(nonce.to_string());
    }
}

/// Where a rebuild's set came from, and what is owed after the swap.
pub(super) enum Origin {
    /// Scanned with a key of its own: nothing to publish.
    Scan,
    /// Loaded from a snapshot (published by `by`).
    Loaded { by: String },
    /// Scanned with a build key the fleet derives: published after the
    /// swap, then the lease (if any) released.
    ForFleet(Box<ForFleet>),
}

pub(super) struct ForFleet {
    key: BuildKey,
    /// The window's mark: the snapshot must be labelled on its stream.
    mark: Mark,
    /// The table's catalog state read before the scan.
    catalog: String,
    lease: Option<Lease>,
    /// What the scan found.
    keys: u64,
    rows: u64,
    max_int: i64,
}

impl Origin {
    pub(super) fn name(&self) -> &'static str {
        match self {
            Origin::Loaded { .. } => "snapshot",
            _ => "scan",
        }
    }
}

impl Resource {
    /// Shares this resource's filters with the fleet through `store`
    /// (once, at start-up); `table`: the watched table it follows.
    pub fn use_snapshots(&self, store: Arc<dyn Store>, table: Arc<str>) {
        let _ = self.snapshots.set(Fleet {
            store,
            table,
            refused: Default::default(),
        });
    }

    fn fleet(&self) -> Option<&Fleet> {
        self.snapshots.get()
    }

    /// Counts on the fleet's snapshot stats, if snapshots are on.
    pub(super) fn count_snapshot(&self, which: impl Fn(&Stats) -> &std::sync::atomic::AtomicU64) {
        if let Some(f) = self.fleet() {
            Stats::count(which(f.store.stats()));
        }
    }

    /// Keeps a key a commit at `lsn` inserted (see `recent`); nothing
    /// without snapshots.
    pub(super) fn remember(&self, lsn: u64, key: &Key) {
        if self.snapshots.get().is_some() {
            self.recent().push(lsn, key);
        }
    }

    fn recent(&self) -> std::sync::MutexGuard<'_, super::recent::Recent> {
        self.recent.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// After a rebuild: `covered` if it left no gap open (see `recent`).
    pub(super) fn settle_recent(&self, covered: bool) {
        self.recent().settle(covered);
    }

    /// A gap opened (see `recent`).
    pub(super) fn poison_recent(&self) {
        self.recent().poison();
    }

    /// Whether a snapshot at `at` can be made complete at the window's
    /// `mark`: it reaches it, or the keys applied past it are all held.
    fn fits(&self, at: &Mark, mark: &Mark) -> bool {
        at.stream == mark.stream && (at.reaches(mark) || self.recent().covers(at.lsn))
    }

    /// The key definition's fingerprint ([`snapshot::shape`]).
    pub fn shape(&self) -> String {
        let mut parts = vec![self.config.table.clone()];
        for (i, p) in self.config.key.iter().enumerate() {
            parts.push(format!(
                "{} {} {}",
                p.column,
                p.ty.sql_type(),
                self.part_comparison(i).describe()
            ));
        }
        snapshot::shape(&parts)
    }

    /// The set a rebuild swaps in, its window open (see the module doc).
    pub(super) async fn obtain(&self) -> Result<(Scanned, Origin), RebuildError> {
        let joining = self
            .joining
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(opened) = joining {
            self.recent().pending = Some(opened.manifest.at.lsn);
            return Ok(loaded(opened));
        }
        let Some(fleet) = self.fleet() else {
            return Ok((self.scan(FilterKey::random()).await?, Origin::Scan));
        };
        let store = fleet.store.clone();
        // Read with the window open: every entry applied by now is at or
        // before it.
        let Some(mark) = store.mark() else {
            return self
                .scan_without_bus(&*store, &"this gateway is off the bus")
                .await;
        };
        // Whatever this rebuild swaps in is complete at the mark.
        self.recent().pending = Some(mark.lsn);
        let catalog = match store.catalog(&fleet.table).await {
            Ok(c) => c,
            Err(e) => return self.scan_without_bus(&*store, &e).await,
        };
        let stats = store.stats();
        let settings = store.settings().clone();
        let began = Instant::now();
        let mut waited = false;
        loop {
            match self.load_fitting(&*store, &mark, &catalog).await {
                Ok(Some(found)) => return Ok(found),
                Ok(None) => {}
                Err(e) => return self.scan_without_bus(&*store, &e).await,
            }
            let past_wait = began.elapsed() >= settings.wait;
            if past_wait && !waited {
                waited = true;
                tracing::warn!(resource = %self.name(), wait = ?settings.wait, "no snapshot from the fleet within bus.snapshot_wait; scanning within bus.max_parallel_scans");
            }
            if began.elapsed() >= settings.wait * UNLEASED_AFTER {
                tracing::warn!(resource = %self.name(), "every scan slot of the fleet has been held past 4 × bus.snapshot_wait; scanning without one");
                Stats::count(&stats.scans_after_wait);
                return self.scan_for_fleet(&*store, mark, catalog, None).await;
            }
            let slots = if past_wait {
                settings.max_parallel_scans.max(1)
            } else {
                1
            };
            for slot in 0..slots {
                let token = match store
                    .lease(&mark.stream, self.name(), slot, LEASE_TTL)
                    .await
                {
                    Ok(Some(token)) => token,
                    Ok(None) => continue,
                    Err(e) => return self.scan_without_bus(&*store, &e).await,
                };
                let lease = Lease {
                    stream: mark.stream.clone(),
                    resource: self.name().to_string(),
                    slot,
                    token,
                };
                // The slot may be free because its holder has just
                // published: looked for once more, now that no one else
                // can start the fleet's scan.
                if let Ok(Some(found)) = self.load_fitting(&*store, &mark, &catalog).await {
                    store.release(&lease).await;
                    return Ok(found);
                }
                Stats::count(match slot {
                    0 => &stats.scans_for_fleet,
                    _ => &stats.scans_after_wait,
                });
                return self
                    .scan_for_fleet(&*store, mark, catalog, Some(lease))
                    .await;
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// The newest snapshot that, with the recent keys it lacks, is complete
    /// at the window's `mark` and of the table's `catalog` state, as the
    /// rebuild's set; `Err`: the bus does not answer.
    async fn load_fitting(
        &self,
        store: &dyn Store,
        mark: &Mark,
        catalog: &str,
    ) -> Result<Option<(Scanned, Origin)>, SnapshotError> {
        // Never one published before this filter was built: it cannot be
        // better than the filter it would replace (a rebuild that restores
        // precision would load the same deleted keys again), and a
        // rebuild that covers a gap needs one labelled after the gap.
        let ours = self.last_build().map(|r| {
            r.built_at
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64)
        });
        for (bytes, m) in self.manifests(store, &mark.stream).await? {
            if m.catalog != catalog
                || ours.is_some_and(|ours| m.published_ms <= ours)
                || !self.fits(&m.at, mark)
            {
                continue;
            }
            let Some(opened) = self.open(store, &mark.stream, bytes, &m).await? else {
                continue;
            };
            // Read now: the keys held include every one applied before the
            // window opened.
            let Some(missing) = (match opened.manifest.at.reaches(mark) {
                true => Some(Vec::new()),
                false => self.recent().after(opened.manifest.at.lsn),
            }) else {
                continue;
            };
            for k in &missing {
                opened.set.insert(k.item());
            }
            return Ok(Some(loaded(opened)));
        }
        Ok(None)
    }

    async fn scan_without_bus(
        &self,
        store: &dyn Store,
        why: &(dyn std::fmt::Display + Sync),
    ) -> Result<(Scanned, Origin), RebuildError> {
        Stats::count(&store.stats().scans_without_bus);
        tracing::warn!(resource = %self.name(), why = %why, "snapshots: not on the bus; scanning");
        Ok((self.scan(FilterKey::random()).await?, Origin::Scan))
    }

    /// Scans with a build key the fleet derives, holding `lease` (renewed
    /// while the scan runs; a lease lost only lets another scan too).
    async fn scan_for_fleet(
        &self,
        store: &dyn Store,
        mark: Mark,
        catalog: String,
        lease: Option<Lease>,
    ) -> Result<(Scanned, Origin), RebuildError> {
        let key = BuildKey::new(store.fleet());
        let scanned = renewing(store, lease.as_ref(), self.scan(key.filter.clone())).await;
        match scanned {
            Ok(s) => {
                let origin = Origin::ForFleet(Box::new(ForFleet {
                    key,
                    mark,
                    catalog,
                    lease,
                    keys: s.keys,
                    rows: s.rows,
                    max_int: s.max_int,
                }));
                Ok((s, origin))
            }
            Err(e) => {
                if let Some(l) = &lease {
                    store.release(l).await;
                }
                Err(e)
            }
        }
    }

    /// After the swap: publishes what a scan for the fleet built (see
    /// "What a snapshot is complete at" in `snapshot`), then releases its
    /// lease. `gaps_before`: the gaps opened before the window (this
    /// rebuild covers them; one opened since may have lost keys). No
    /// `swapped` (the shrink guard refused the scan): only the release.
    pub(super) async fn publish_after(
        &self,
        origin: Origin,
        swapped: Option<&Swapped>,
        gaps_before: u64,
    ) {
        let Origin::ForFleet(f) = origin else {
            return;
        };
        let Some(fleet) = self.fleet() else {
            return;
        };
        let store = &*fleet.store;
        if let Some(swapped) = swapped {
            let publish = self.publish(store, &f, swapped, gaps_before);
            match renewing(store, f.lease.as_ref(), publish).await {
                Ok(bytes) => {
                    Stats::count(&store.stats().published);
                    store.stats().last_bytes.store(bytes, Ordering::Relaxed);
                }
                Err(why) => {
                    Stats::count(&store.stats().publish_failed);
                    tracing::warn!(resource = %self.name(), why = %why, "snapshot not published; the fleet scans for itself");
                }
            }
        }
        if let Some(l) = &f.lease {
            store.release(l).await;
        }
    }

    async fn publish(
        &self,
        store: &dyn Store,
        f: &ForFleet,
        swapped: &Swapped,
        gaps_before: u64,
    ) -> Result<u64, SnapshotError> {
        // Up to the head first (see the `snapshot` module doc, step 2).
        if let Ok(head) = store.head(&f.mark.stream).await {
            let until = Instant::now() + CATCH_UP;
            while !store.mark().is_some_and(|m| m.reaches(&head)) && Instant::now() < until {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        let at = store.settled().await.ok_or(SnapshotError::NotSettled(
            "the consumer left the bus, or its queue did not drain",
        ))?;
        if at.stream != f.mark.stream {
            return Err(SnapshotError::NotSettled(
                "the primary's epoch changed during the rebuild",
            ));
        }
        if self.vouch.gaps_opened() > gaps_before || self.vouch.has_problem() {
            return Err(SnapshotError::NotSettled(
                "changes may have been missed during the rebuild",
            ));
        }
        let manifest = Manifest {
            format: snapshot::FORMAT,
            resource: self.name().to_string(),
            shape: self.shape(),
            catalog: f.catalog.clone(),
            key_id: String::new(),
            at,
            nonce: String::new(),
            kind: String::new(),
            keys: f.keys,
            rows: f.rows,
            max_int: f.max_int,
            plain_bytes: 0,
            sealed_bytes: 0,
            chunks: 0,
            published_ms: crate::feed::now_ms(),
            by: crate::feed::bus::whoami(),
        };
        let set = swapped.set.clone();
        let fleet = store.fleet().clone();
        let key = f.key.clone();
        let stored: Stored = tokio::task::spawn_blocking(move || {
            snapshot::publishable(&fleet, &key, manifest, &set)
        })
        .await
        .map_err(|_| SnapshotError::Panicked("encoding the snapshot"))?;
        let bytes = stored.chunks.iter().map(|c| c.len() as u64).sum::<u64>();
        store.put(self.name(), &stored).await?;
        tracing::info!(resource = %self.name(), bytes, "snapshot published for the fleet");
        Ok(bytes)
    }

    /// The manifests of this resource on `stream`, newest first, parsed
    /// (not yet authenticated: only to choose what to fetch), without
    /// those this gateway cannot use whatever its place: another fleet key
    /// or format, published before the primary's position last went back,
    /// refused before. One that does not parse or names an impossible size
    /// is refused (and counted) here.
    async fn manifests(
        &self,
        store: &dyn Store,
        stream: &str,
    ) -> Result<Vec<(Vec<u8>, Manifest)>, SnapshotError> {
        let Some(fleet) = self.fleet() else {
            return Ok(Vec::new());
        };
        let (key_id, not_before) = (store.fleet().id(), store.not_before_ms());
        let mut out = Vec::new();
        for bytes in store.manifests(stream, self.name()).await? {
            match snapshot::manifest(&bytes) {
                Ok(m) if fleet.refused(&m.nonce) => {}
                Ok(m)
                    if (1..=MAX_CHUNKS).contains(&m.chunks)
                        && m.format == snapshot::FORMAT
                        && m.key_id == key_id
                        && m.published_ms >= not_before =>
                {
                    out.push((bytes, m))
                }
                Ok(m) if m.published_ms < not_before => {}
                Ok(m) => {
                    fleet.refuse(&m.nonce);
                    Stats::count(&store.stats().unusable);
                    tracing::warn!(resource = %self.name(), by = %m.by, "a snapshot on the bus was not used: another fleet key (bus.fleet_key_file), format, or size");
                }
                Err(_) => Stats::count(&store.stats().unusable),
            }
        }
        Ok(out)
    }

    /// Fetches and opens one snapshot; `None` (counted) if it is gone or
    /// does not open; `Err` when the bus does not answer.
    async fn open(
        &self,
        store: &dyn Store,
        stream: &str,
        bytes: Vec<u8>,
        m: &Manifest,
    ) -> Result<Option<Opened>, SnapshotError> {
        let refuse = || {
            if let Some(f) = self.fleet() {
                f.refuse(&m.nonce);
            }
            Stats::count(&store.stats().unusable);
        };
        let Some(chunks) = store
            .chunks(stream, self.name(), &m.nonce, m.chunks)
            .await?
        else {
            refuse();
            return Ok(None);
        };
        let fleet = store.fleet().clone();
        let name = self.name().to_string();
        let shape = self.shape();
        let stored = Stored {
            manifest: bytes,
            chunks,
        };
        let opened =
            tokio::task::spawn_blocking(move || snapshot::open(&fleet, stored, &name, &shape))
                .await
                .map_err(|_| SnapshotError::Panicked("opening a snapshot"))?;
        match opened {
            Ok(o) => Ok(Some(o)),
            Err(e) => {
                refuse();
                tracing::warn!(resource = %self.name(), error = %e, "a snapshot on the bus was not used");
                Ok(None)
            }
        }
    }

    /// Joining (see the module doc): installs the newest snapshot of
    /// `head`'s stream that the stream continues from and that is of the
    /// table's catalog state now, before the consumer passes anything on.
    /// Returns its place, from which the consumer must read on; `None`:
    /// nothing installed (the start-up scan builds it).
    pub async fn join(&self, head: &Mark) -> Option<Mark> {
        let fleet = self.fleet()?;
        if !self.config.filter.enabled {
            return None;
        }
        let store = &*fleet.store;
        let opened = match self.joinable(store, &fleet.table, head).await {
            Ok(o) => o?,
            Err(e) => {
                tracing::warn!(resource = %self.name(), error = %e, "snapshots: the bus does not answer; the start-up scan builds the filter");
                return None;
            }
        };
        let at = opened.manifest.at.clone();
        *self.joining.lock().unwrap_or_else(|p| p.into_inner()) = Some(opened);
        let outcome = self
            .request_rebuild(crate::rebuild::Reason::Join, true)
            .outcome()
            .await;
        // A join merged into a rebuild that scanned instead leaves the
        // slot full: emptied, so no later rebuild takes an old snapshot.
        let unused = self
            .joining
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .is_some();
        match outcome {
            Some(Ok(r)) if !unused && r.source == "snapshot" => {
                self.joined.store(true, Ordering::Relaxed);
                tracing::info!(resource = %self.name(), keys = r.keys, "filter loaded from the fleet's snapshot; no scan");
                Some(at)
            }
            _ => None,
        }
    }

    /// The snapshot a join installs: the newest at or before the
    /// consumer's place (one past it is from a stream that went back: Redis
    /// lost its newest entries), of the catalog state now, whose place the
    /// stream still continues from (checked before anything is fetched).
    async fn joinable(
        &self,
        store: &dyn Store,
        table: &str,
        head: &Mark,
    ) -> Result<Option<Opened>, SnapshotError> {
        let catalog = store.catalog(table).await?;
        for (bytes, m) in self.manifests(store, &head.stream).await? {
            if !head.reaches(&m.at) {
                continue;
            }
            if m.catalog != catalog {
                tracing::info!(resource = %self.name(), "the table's catalog changed since the fleet's snapshot (a rewrite, partitions, the publication): the start-up scan builds the filter");
                return Ok(None);
            }
            // Trimmed from its oldest end: a stream that does not continue
            // from the newest continues from none older.
            if !store.continues(&m.at).await? {
                tracing::info!(resource = %self.name(), "the fleet's snapshot is older than the stream reaches back; the start-up scan builds the filter");
                return Ok(None);
            }
            if let Some(o) = self.open(store, &head.stream, bytes, &m).await? {
                return Ok(Some(o));
            }
        }
        Ok(None)
    }

    /// A filter of this resource the fleet published after this gateway's
    /// last build, that it could load (this fleet key and format, this key
    /// definition and catalog state), by its nonce: the schedule then
    /// rebuilds now, once per snapshot (see
    /// `Resource::rebuild_periodically`). A snapshot another gateway
    /// cannot use is not followed, so gateways that differ (a fleet key
    /// being rotated, a rolling upgrade) never take turns scanning. `None`
    /// without snapshots, off the bus, or when Redis does not answer (the
    /// schedule's own timer goes on).
    pub(super) async fn fleet_rebuilt_since_ours(&self) -> Option<String> {
        let (fleet, ours) = (self.fleet()?, self.last_build()?);
        let mark = fleet.store.mark()?;
        let ours = ours
            .built_at
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let found = self.manifests(&*fleet.store, &mark.stream).await.ok()?;
        let (_, newest) = found.first()?;
        if newest.published_ms <= ours || newest.shape != self.shape() {
            return None;
        }
        let catalog = fleet.store.catalog(&fleet.table).await.ok()?;
        (newest.catalog == catalog).then(|| newest.nonce.clone())
    }

    /// Whether the filter was installed by [`Resource::join`] (the
    /// start-up scan is then not needed).
    pub fn joined(&self) -> bool {
        self.joined.load(Ordering::Relaxed)
    }
}

/// Runs `work` holding `lease` (renewed every third of [`LEASE_TTL`]).
async fn renewing<T>(
    store: &dyn Store,
    lease: Option<&Lease>,
    work: impl std::future::Future<Output = T>,
) -> T {
    tokio::pin!(work);
    let mut renew = tokio::time::interval(LEASE_TTL / 3);
    renew.tick().await;
    loop {
        tokio::select! {
            r = &mut work => return r,
            _ = renew.tick() => {
                if let Some(l) = lease {
                    let _ = store.renew(l, LEASE_TTL).await;
                }
            }
        }
    }
}

/// A snapshot opened, as a rebuild's set.
fn loaded(opened: Opened) -> (Scanned, Origin) {
    let m = opened.manifest;
    (
        Scanned {
            set: opened.set,
            keys: m.keys,
            rows: m.rows,
            max_int: m.max_int,
            // A place on the bus, not a position: no promotion is proven
            // harmless to it (see `feed::wal::fork`).
            seen_upto: None,
        },
        Origin::Loaded { by: m.by },
    )
}
