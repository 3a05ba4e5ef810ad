//! The gateway: the database handle and every configured resource, and the
//! start-up sequence that makes them ready.
//!
//! The change feed is the [`Supervisor`]'s business: the gateway asks it
//! to choose, prepare and start the feed, and reads what the feed says of
//! itself; it names no feed's internals.
//!
//! # Tasks and shutdown
//! Every background task is the gateway's and is given its shutdown signal
//! ([`crate::shutdown`]): per resource its background task
//! ([`Resource::run_background`]: the rebuild coordinator every rebuild
//! request goes through, and the confirmation of announced keys) and its
//! rebuild schedule; the read replicas' checks; the look at where the
//! database's address leads (`db::identity::watch_address`); the change
//! feed and the applier ([`crate::apply`]). [`Gateway::shutdown`] fires the signal and
//! waits, up to a deadline, for each task to finish the unit of work it is
//! in and close what it holds; only what is still running then is aborted.
//! A rebuild mid-scan is dropped at the signal: its query is cancelled on
//! the server and the journal closed (guards in `resource` and `db`), and
//! every waiting [`crate::rebuild::Ticket`] resolves.

use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use crate::apply::{Applied, Applier, Follower};
use crate::auth::key_files::KeyFiles;
use crate::config::{Config, Freshness};
use crate::db::catalog::{self, RelKind, TableName};
use crate::db::{Db, DbError};
use crate::feed::supervisor::{self, Supervisor};
use crate::feed::{self, Position, Watch, WatchedColumn, notify};
use crate::key::compare::Comparison;
use crate::metrics::Metrics;
use crate::resource::{RebuildError, Resource};
use crate::shutdown::{self, Shutdown};
use crate::traffic::Traffic;

mod readiness;
mod snapshot;
pub use readiness::Readiness;
pub use snapshot::GatewaySnapshot;

/// Events a feed may send before it waits for the applier.
const FEED_QUEUE: usize = 4096;

pub struct Gateway {
    pub config: Config,
    pub db: Arc<Db>,
    pub resources: Vec<Arc<Resource>>,
    pub stats: GatewayStats,
    pub metrics: Metrics,
    /// Every background task (see the module doc).
    tasks: Mutex<Vec<JoinHandle<()>>>,
    /// Fired by [`Gateway::shutdown`] and [`Gateway::stop`].
    shutdown: shutdown::Trigger,
    /// Set once start-up has succeeded: starting twice is a no-op.
    started: tokio::sync::Mutex<bool>,
    /// The same, readable without waiting (readiness).
    running: std::sync::atomic::AtomicBool,
    /// What the feeds watch, resolved from the catalog at start-up.
    watch: OnceLock<Watch>,
    /// The commit LSN the applier has applied up to (see `apply`).
    applied: Applied,
    applied_tx: watch::Sender<Position>,
    /// The change feed start-up chose and started.
    feed: OnceLock<Supervisor>,
    /// The `wal` feed's counters (zero in the other modes).
    pub wal_stats: Arc<feed::wal::Stats>,
    /// The access checks of every resource (see `auth`).
    pub auth: Arc<crate::auth::Auth>,
    /// Set on SIGTERM ([`Gateway::begin_drain`]): `/readyz` says 503 while
    /// requests are still served.
    draining: tokio::sync::watch::Sender<bool>,
    /// Slots for row loads, shared by every resource (`max_concurrency`).
    loads: Arc<tokio::sync::Semaphore>,
}

pub use crate::feed::supervisor::wal_delivery;

/// Counters that belong to no single resource: the listeners' (shared
/// with the HTTP front layer and the server, which count them), the
/// change feed's progress (written by the applier) and the counters of
/// the notify or queue feed (whichever is in force counts there; the
/// snapshot names them for that feed).
#[derive(Debug, Default)]
pub struct GatewayStats {
    pub traffic: Arc<Traffic>,
    pub feed: Arc<notify::Stats>,
    pub progress: Arc<feed::stats::Progress>,
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("database.url: {0}")]
    Url(sqlx::Error),
    #[error("migrations failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error("resource {resource:?} (table {table:?}): {source}")]
    Resource {
        resource: String,
        table: String,
        source: RebuildError,
    },
    /// The schema does not fit the config (missing table or column, a key
    /// column type the key type does not accept).
    #[error("resource {resource:?}: {problem}")]
    Schema { resource: String, problem: String },
    #[error("reading the catalog: {0}")]
    Catalog(sqlx::Error),
    #[error("change feed: {0}")]
    Feed(#[from] feed::PrepareError),
}

impl Gateway {
    /// Builds the gateway with a lazy pool: nothing is contacted yet.
    /// `key_files`: what `[auth]`'s files held (`KeyFiles::read`).
    pub fn new(config: Config, key_files: &KeyFiles) -> Result<Arc<Self>, StartError> {
        let db = Db::connect_lazy(&config.database).map_err(StartError::Url)?;
        Ok(Self::with_db(config, key_files, Arc::new(db)))
    }

    pub fn with_db(config: Config, key_files: &KeyFiles, db: Arc<Db>) -> Arc<Self> {
        // Row loads in flight, attached to a request or detached from
        // departed clients, within the same bound as requests.
        let loads = Arc::new(tokio::sync::Semaphore::new(config.server.max_concurrency));
        let resources = config
            .resolved()
            .into_iter()
            .map(|r| Arc::new(Resource::new(r, db.clone(), loads.clone())))
            .collect();
        let (applied_tx, applied) = watch::channel(Position::ZERO);
        let auth = Arc::new(crate::auth::Auth::new(&config, key_files));
        Arc::new(Self {
            config,
            db,
            resources,
            stats: GatewayStats::default(),
            metrics: Metrics::default(),
            tasks: Mutex::new(Vec::new()),
            started: tokio::sync::Mutex::new(false),
            running: std::sync::atomic::AtomicBool::new(false),
            watch: OnceLock::new(),
            applied,
            applied_tx,
            feed: OnceLock::new(),
            wal_stats: Arc::default(),
            auth,
            loads,
            shutdown: shutdown::channel().0,
            draining: tokio::sync::watch::Sender::new(false),
        })
    }

    pub fn resource(&self, name: &str) -> Option<&Arc<Resource>> {
        self.resources.iter().find(|r| r.name() == name)
    }

    /// From now on `/readyz` answers 503 (SIGTERM, `server.shutdown_drain`);
    /// requests are still served.
    pub fn begin_drain(&self) {
        self.draining.send_replace(true);
    }

    /// Turns true when the drain begins: the connections then ask their
    /// clients to leave (`server::conn`).
    pub fn draining(&self) -> tokio::sync::watch::Receiver<bool> {
        self.draining.subscribe()
    }

    /// The tables and key columns the change feeds watch (canonical names),
    /// once start-up has read the catalog.
    pub fn watch(&self) -> Option<&Watch> {
        self.watch.get()
    }

    /// The commit LSN every change up to which has been applied (WAL
    /// sources only; [`Position::ZERO`] until then).
    pub fn applied(&self) -> Applied {
        self.applied.clone()
    }

    /// Waits for the database, migrates if configured, reads the catalog
    /// (canonical table names, key column types: a column the key type does
    /// not accept is an error), has the supervisor choose and prepare the
    /// change feed and start it, then builds every filter and waits for the
    /// feed to prove itself current. Transient failures are retried for as
    /// long as it takes; a permanent one (a missing table, a standby that
    /// cannot `LISTEN`) is returned.
    pub async fn start(self: &Arc<Self>) -> Result<(), StartError> {
        let mut started = self.started.lock().await;
        if *started {
            return Ok(());
        }
        let began = Instant::now();
        // First, so that rebuild requests made from here on (the first
        // build, a feed's resync) are served.
        for r in &self.resources {
            self.keep(tokio::spawn(r.clone().run_background(self.signal())));
        }
        self.keep(tokio::spawn(self.db.identity.clone().watch_address(
            (*self.db.pool().connect_options()).clone(),
            crate::db::identity::ADDRESS_EVERY,
            self.signal(),
        )));
        if let Some(replicas) = self.db.replicas() {
            let every = self.config.database.replica_check_interval;
            self.keep(tokio::spawn(
                replicas.clone().run_checks(every, self.signal()),
            ));
        }
        // Tries again after a step the database gave up on: backing off,
        // and said at most once per 10 s (a `statement_timeout` too low for
        // a step fails every try, and the whole fleet tries).
        let mut again = std::time::Duration::from_millis(200);
        let said = crate::telemetry::LogThrottle::default();
        let (followers, watch, feed) = loop {
            self.db.wait_until_reachable().await;
            let before = crate::db::position::Server::read_pool(self.db.pool())
                .await
                .ok();
            let e = match self.prepare().await {
                Ok(done) => break done,
                Err(e) => e,
            };
            // A step that failed because the database went away, or came
            // back as another server (a failover or a restart during
            // start-up), is tried again; one the database gave while it
            // answered (a missing table, a refused privilege) is the
            // answer.
            let after = crate::db::position::Server::read_pool(self.db.pool())
                .await
                .ok();
            // A standby answers, but cannot say where its WAL is flushed
            // (`before` is none): that answer is the database's own.
            let in_recovery = sqlx::query_scalar::<_, bool>("SELECT pg_is_in_recovery()")
                .fetch_one(self.db.pool())
                .await
                .unwrap_or(false);
            // So is one the database gave up on while it answered (a
            // statement held behind a lock, or behind a hung network until
            // `statement_timeout`): not now is not no.
            let momentary = match &e {
                StartError::Feed(f) => f.is_momentary(),
                StartError::Catalog(e) => crate::db::outage::is_momentary(e),
                _ => false,
            };
            let transient = momentary
                || match (before.map(|(s, _)| s), after.map(|(s, _)| s)) {
                    (Some(b), Some(a)) => b != a,
                    _ => !in_recovery && (self.db.check_up().await.is_err() || before.is_none()),
                };
            if !transient {
                return Err(e);
            }
            if let Some(not_logged) = said.permit() {
                tracing::warn!(error = %e, retry_in_s = again.as_secs_f64(), not_logged, "start-up interrupted (the database went away, changed, or gave up on a statement for now); trying again (at most one such line per 10 s)");
            }
            if momentary {
                self.db.note_waiting_on(format!("{e} (trying again)"));
            }
            tokio::time::sleep(again).await;
            again = (again * 2).min(std::time::Duration::from_secs(5));
        };
        // Resources whose changes no feed follows (a view without
        // `source_table`) change only at rebuilds: nothing to prove.
        let followed: Vec<bool> = self
            .resources
            .iter()
            .map(|r| followers.iter().any(|x| Arc::ptr_eq(&x.resource, r)))
            .collect();
        for (r, followed) in self.resources.iter().zip(&followed) {
            if !followed {
                r.vouch.set_fresh(true);
            }
        }
        let feed = self.feed.get_or_init(|| feed);
        self.share_filters(feed, &followers);
        self.start_feed(feed, followers, &watch).await?;
        let _ = self.watch.set(watch);
        if let Some(replicas) = self.db.replicas() {
            // A replica behind the primary now may lack commits no feed
            // event will ever name: loads wait for it to pass this point.
            replicas.note_past_the_primary().await;
        }
        // Started with no feed (the bus down, every fall-back ticket
        // taken): no scan now, which every gateway started during the
        // outage would make of the primary; the database answers until the
        // feed returns, and its resync builds the filters.
        if self
            .bus_status()
            .is_some_and(|s| s.get().mode == feed::bus::Follows::Lost)
        {
            for (r, followed) in self.resources.iter().zip(&followed) {
                match followed {
                    true => r.answer_unbuilt(),
                    // No feed builds it later: built now, as always.
                    false if r.config.filter.enabled => {
                        r.preload().await.map_err(|source| StartError::Resource {
                            resource: r.name().to_string(),
                            table: r.config.table.clone(),
                            source,
                        })?;
                    }
                    false => {}
                }
            }
            tracing::warn!(
                "started with no change feed to follow (the bus is down and bus.max_direct_fallback gateways follow the WAL already): every key is asked of the database within filter.verify_budget until the bus returns"
            );
            tracing::info!(
                elapsed_s = began.elapsed().as_secs_f64(),
                "ready (degraded)"
            );
            *started = true;
            self.running
                .store(true, std::sync::atomic::Ordering::Relaxed);
            return Ok(());
        }
        for r in &self.resources {
            if !r.config.filter.enabled {
                continue;
            }
            r.preload().await.map_err(|source| StartError::Resource {
                resource: r.name().to_string(),
                table: r.config.table.clone(),
                source,
            })?;
        }
        // Until the feed's first heartbeat after the scans, nothing is
        // vouched for: "ready" means the filters answer.
        self.wait_heard().await;
        tracing::info!(
            elapsed_s = began.elapsed().as_secs_f64(),
            resources = self.resources.len(),
            "ready"
        );
        for r in &self.resources {
            r.note_ready();
        }
        *started = true;
        self.running
            .store(true, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    /// Start-up's steps before the feed starts: refuses a standby, migrates
    /// if configured, reads the catalog, has the supervisor choose and
    /// prepare the change feed. Each may be run again (see `start`).
    async fn prepare(&self) -> Result<(Vec<Follower>, Watch, Supervisor), StartError> {
        // Before the migrations: on a standby they fail less clearly.
        supervisor::refuse_standby(self.db.pool(), &self.config.database)
            .await
            .map_err(StartError::Feed)?;
        if self.config.database.migrate {
            self.db.migrate().await?;
        }
        if let Some(replicas) = self.db.replicas() {
            // Known before the first scan, which may then run on one.
            replicas.check().await;
        }
        let (followers, watch) = self.resolve().await?;
        let feed = Supervisor::prepare(
            &self.db,
            &self.config.database,
            &self.config.bus,
            &watch,
            self.wal_stats.clone(),
            self.stats.feed.clone(),
        )
        .await
        .map_err(StartError::Feed)?;
        Ok((followers, watch, feed))
    }

    /// A shutdown signal for a task of this gateway.
    fn signal(&self) -> Shutdown {
        self.shutdown.signal()
    }

    /// Waits until the feed has proven itself current once (every resource
    /// fresh, see `vouch`), saying why in the log while it waits.
    async fn wait_heard(&self) {
        let began = Instant::now();
        let mut said = began;
        while !self.resources.iter().all(|r| r.vouch.is_fresh()) {
            if said.elapsed() >= std::time::Duration::from_secs(10) {
                tracing::warn!(waited_s = began.elapsed().as_secs_f64(), why = %self.readiness(), "waiting for the change feed to confirm it is current");
                said = Instant::now();
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    }

    /// Reads every resource's table from the catalog: the table whose
    /// changes it follows (canonical name) and its key column's type, which
    /// the key type must accept.
    async fn resolve(&self) -> Result<(Vec<Follower>, Watch), StartError> {
        let pool = self.db.pool();
        let mut followers = Vec::new();
        let mut watch = Watch::default();
        for r in &self.resources {
            let c = &r.config;
            let bad = |problem: String| StartError::Schema {
                resource: c.name.clone(),
                problem,
            };
            let served = catalog::table_info(pool, &c.table)
                .await
                .map_err(StartError::Catalog)?
                .ok_or_else(|| bad(format!("no table or view {:?} (names are case-sensitive; schema.table, or in the search path)", c.table)))?;
            let key = c.key_columns();
            let mut columns = Vec::with_capacity(key.len());
            for part in &c.key {
                let column = served.column(&part.column).ok_or_else(|| {
                    bad(format!("{} has no column {:?}", served.name, part.column))
                })?;
                if !part.ty.accepts(column.column_type()) {
                    return Err(bad(format!(
                        "key column {}.{} is {}, which key_type {:?} does not accept (accepted: {}, or a domain over one)",
                        served.name,
                        part.column,
                        column.declared,
                        part.ty.sql_type(),
                        part.ty.accepted()
                    )));
                }
                columns.push(column);
            }
            // One key, one row: a key that names several (part of a
            // tenant's primary key, say) would serve any of them.
            if catalog::Uniqueness::NotUnique == served.uniqueness(&key) {
                return Err(bad(served.not_unique(&key)));
            }
            // How the key and owner columns compare (`key::compare`):
            // a column the gateway cannot reproduce is refused here.
            let compared = |col: &catalog::ColumnInfo| {
                let table = served.name.clone();
                let col = col.clone();
                async move {
                    catalog::comparison(pool, &table, &col)
                        .await
                        .map_err(|e| match e {
                            catalog::ComparisonError::Db(e) => StartError::Catalog(e),
                            catalog::ComparisonError::Refused(problem) => StartError::Schema {
                                resource: c.name.clone(),
                                problem,
                            },
                        })
                }
            };
            let mut key_cmp = Vec::with_capacity(columns.len());
            for column in &columns {
                key_cmp.push((compared(column).await?, column.base_sql.clone()));
            }
            let owner_cmp = match c
                .access
                .owner_column
                .as_deref()
                .and_then(|o| served.column(o))
            {
                Some(owner) => compared(owner).await?,
                None => Comparison::Bytes,
            };
            r.set_columns(key_cmp, owner_cmp);
            let source = if c.source_table == c.table {
                served
            } else {
                catalog::table_info(pool, &c.source_table)
                    .await
                    .map_err(StartError::Catalog)?
                    .ok_or_else(|| bad(format!("no source_table {:?}", c.source_table)))?
            };
            if !matches!(source.kind, RelKind::Table | RelKind::PartitionedTable) {
                // Triggers and logical replication see tables only.
                tracing::warn!(
                    resource = %c.name,
                    relation = %source.name,
                    "not a table: its changes cannot be followed (new rows are servable after the next rebuild); set source_table to the table it reads"
                );
                continue;
            }
            let mut watched = Vec::with_capacity(c.key.len());
            for part in &c.key {
                let Some(column) = source.column(&part.column) else {
                    return Err(bad(format!(
                        "source_table {} has no column {:?}: the key's columns must have the same names there (a key computed in the view cannot be followed: key the view by the table's own key columns, several as key_column = [..])",
                        source.name, part.column
                    )));
                };
                watched.push(WatchedColumn {
                    name: Arc::from(part.column.as_str()),
                    ty: column.column_type(),
                });
            }
            let columns: Box<[Arc<str>]> = watched.iter().map(|w| w.name.clone()).collect();
            watch.follow(&source.name, watched, c.source_table == c.table, &c.columns);
            followers.push(Follower {
                table: source.name.clone(),
                columns,
                resource: r.clone(),
            });
        }
        Ok((followers, watch))
    }

    /// Reads the catalog and installs the triggers of every watched table
    /// (`bloomgate install-triggers`), writing to the change table when
    /// `database.freshness = "queue"`, else notifying; one result per
    /// table: the key columns written in, or why not.
    pub async fn install_triggers(
        &self,
    ) -> Result<Vec<(TableName, Result<Vec<String>, DbError>)>, StartError> {
        let (_, watch) = self.resolve().await?;
        let sink = supervisor::sink_for(&self.config.database);
        Ok(supervisor::install_triggers(&self.db, &watch, sink).await)
    }

    /// `bloomgate install-feed`: the publication over every resource table,
    /// each with its column list (every replica identity checked first:
    /// nothing changes unless all pass), and bloomgate's triggers removed.
    pub async fn install_feed(&self) -> Result<(), StartError> {
        let (_, watch) = self.resolve().await?;
        supervisor::install_publication(self.db.pool(), &self.config.database, &watch, true)
            .await
            .map_err(StartError::Feed)?;
        supervisor::remove_triggers(&self.db, &watch).await;
        Ok(())
    }

    /// With `bus.fleet_key_file`: the followed resources' filters shared
    /// with the fleet (`resource::fleet`), and the consumer's first start
    /// on the bus installing the fleet's snapshots.
    fn share_filters(&self, feed: &Supervisor, followers: &[Follower]) {
        let Some(b) = &feed.bus else { return };
        let Some(store) = &b.snapshots else { return };
        let sharing: Vec<Arc<Resource>> = followers
            .iter()
            .filter(|f| f.resource.config.filter.enabled)
            .map(|f| {
                f.resource.use_snapshots(store.clone(), f.table.clone());
                f.resource.clone()
            })
            .collect();
        let _ = b.join.set(Arc::new(move |head| {
            let sharing = sharing.clone();
            Box::pin(async move {
                // Read on from the oldest place installed: a resource whose
                // snapshot is newer gets what it holds once more.
                let mut from: Option<crate::snapshot::Mark> = None;
                for r in &sharing {
                    if let Some(at) = r.join(&head).await
                        && from.as_ref().is_none_or(|f| f.reaches(&at))
                    {
                        from = Some(at);
                    }
                }
                from
            })
        }));
    }

    /// The applier task, and the change feed feeding it, streaming before
    /// this returns (so before the first scan takes its snapshot: see
    /// `feed`).
    async fn start_feed(
        &self,
        feed: &Supervisor,
        followers: Vec<Follower>,
        watch: &Watch,
    ) -> Result<(), StartError> {
        // A start that failed after this point may be retried: its tasks
        // were stopped (`stop`) or will be, and new ones start here.
        let (tx, rx) = mpsc::channel(FEED_QUEUE);
        let mut applier = Applier::new(followers, self.applied_tx.clone())
            .with_replicas(self.db.replicas().cloned())
            .with_progress(self.stats.progress.clone());
        if feed.freshness() == Freshness::Wal {
            self.keep(tokio::spawn(snapshot::read_primary_lsn(
                self.db.clone(),
                self.stats.progress.clone(),
                self.signal(),
            )));
        }
        if feed.freshness() != Freshness::Off {
            applier = applier.with_bound(self.config.database.freshness_bound);
        }
        self.keep(tokio::spawn(applier.run(rx, self.signal())));
        let Some((task, ready)) = feed.spawn(
            &self.db,
            &self.config.database,
            watch,
            tx,
            self.applied.clone(),
            self.signal(),
        ) else {
            return Ok(());
        };
        self.keep(task);
        match ready.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(StartError::Feed(e.into())),
            Err(_) => Err(StartError::Feed(feed::NotStarted::Stopped.into())),
        }
    }

    /// `database.freshness` as start-up resolved it (never `auto`), once
    /// it has.
    pub fn freshness(&self) -> Option<Freshness> {
        self.feed.get().map(Supervisor::freshness)
    }

    /// The fleet's snapshots (`bus.fleet_key_file`), once the feed is chosen.
    pub fn snapshot_store(&self) -> Option<Arc<dyn crate::snapshot::Store>> {
        let s = self.feed.get()?.bus.as_ref()?.snapshots.clone()?;
        Some(s)
    }

    /// What the bus says of itself (`bus.url`), once the feed is chosen.
    pub fn bus_status(&self) -> Option<Arc<feed::bus::Status>> {
        self.feed.get()?.bus.as_ref().map(|b| b.status.clone())
    }

    /// What the change feed in force says of its connection.
    pub fn feed_health(&self) -> feed::HealthState {
        self.feed.get().map(|f| f.health.get()).unwrap_or_default()
    }

    /// Starts each resource's scheduled rebuilds.
    pub fn spawn_rebuilds(&self) {
        for r in &self.resources {
            self.keep(tokio::spawn(r.clone().rebuild_periodically(self.signal())));
        }
    }

    fn keep(&self, task: JoinHandle<()>) {
        self.tasks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(task);
    }

    /// Fires the shutdown signal and waits, up to `deadline`, for every
    /// background task to finish its unit of work and close what it holds
    /// (see the module doc); aborts what is still running then.
    pub async fn shutdown(&self, deadline: Duration) {
        self.shutdown.fire();
        let tasks = std::mem::take(&mut *self.tasks.lock().unwrap_or_else(|p| p.into_inner()));
        let until = tokio::time::Instant::now() + deadline;
        for mut t in tasks {
            if tokio::time::timeout_at(until, &mut t).await.is_err() {
                t.abort();
            }
        }
    }

    /// [`Gateway::shutdown`] without waiting: fires the signal, and gives
    /// the tasks a second in the background before aborting the rest.
    /// Returns at once; a cancelled scan's query is cancelled on the server
    /// within `db::CANCEL_WITHIN`.
    pub fn stop(&self) {
        self.shutdown.fire();
        let tasks = std::mem::take(&mut *self.tasks.lock().unwrap_or_else(|p| p.into_inner()));
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn(async move {
                    let until = tokio::time::Instant::now() + Duration::from_secs(1);
                    for mut t in tasks {
                        if tokio::time::timeout_at(until, &mut t).await.is_err() {
                            t.abort();
                        }
                    }
                });
            }
            Err(_) => tasks.iter().for_each(JoinHandle::abort),
        }
    }
}
