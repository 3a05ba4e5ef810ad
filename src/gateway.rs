//! The gateway: the database handle and every configured resource, and the
//! start-up sequence that makes them ready.
//!
//! # Tasks
//! Every background task is the gateway's: it keeps their handles and
//! [`Gateway::stop`] aborts them all. Per resource: its background task
//! ([`Resource::run_background`]: the rebuild coordinator every rebuild
//! request goes through, and the confirmation of announced keys) and its
//! rebuild schedule; plus the change feed and the applier
//! ([`crate::apply`]). Aborting a resource's task cancels a rebuild
//! mid-scan: the query is cancelled on the server and the journal closed
//! (see `resource` and `db`), and every waiting [`crate::rebuild::Ticket`] resolves.

use std::collections::BTreeMap;
use std::ops::Deref;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;

use crate::apply::{Applied, Applier, Route};
use crate::config::{Config, Freshness};
use crate::db::catalog::{self, RelKind, TableName};
use crate::db::triggers::Sink;
use crate::db::{Db, DbError};
use crate::feed::{self, Lsn, Watch, WatchedColumn, WatchedTable, notify};
use crate::metrics::Metrics;
use crate::resource::{RebuildError, Resource};

/// Events a feed may send before it waits for the applier.
const FEED_QUEUE: usize = 4096;

pub struct Gateway {
    pub config: Config,
    pub db: Arc<Db>,
    pub resources: Vec<Arc<Resource>>,
    pub stats: GatewayStats,
    pub metrics: Metrics,
    /// Every background task (see the module doc), aborted by
    /// [`Gateway::stop`].
    tasks: Mutex<Vec<JoinHandle<()>>>,
    /// Set once start-up has succeeded: starting twice is a no-op.
    started: tokio::sync::Mutex<bool>,
    /// What the feeds watch, resolved from the catalog at start-up.
    watch: OnceLock<Watch>,
    /// The commit LSN the applier has applied up to (see `apply`).
    applied: Applied,
    applied_tx: watch::Sender<Lsn>,
    /// The change feed start-up chose (see [`FeedMode`]).
    feed_mode: OnceLock<FeedMode>,
    /// The `wal` feed's counters (zero in the other modes).
    pub wal_stats: Arc<feed::wal::Stats>,
    /// What the feed in force says of its connection.
    pub feed_health: Arc<feed::Health>,
    /// The access checks of every resource (see `auth`).
    pub auth: Arc<crate::auth::Auth>,
}

/// How the `wal` feed reads the slot (`database.wal_poll_interval`), for
/// the log line that says which feed is in force.
pub fn wal_delivery(db: &crate::config::DatabaseConfig) -> String {
    match db.wal_poll_interval {
        None => "streamed".into(),
        Some(every) => format!("polled every {}", humantime::format_duration(every)),
    }
}

/// The change feed in force: `database.freshness` resolved at start-up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FeedMode {
    Wal,
    Queue,
    Notify,
    Off,
}

impl FeedMode {
    pub fn as_str(self) -> &'static str {
        match self {
            FeedMode::Wal => "wal",
            FeedMode::Queue => "queue",
            FeedMode::Notify => "notify",
            FeedMode::Off => "off",
        }
    }
}

/// Counters that belong to no single resource. The `notify` source's
/// counters are shared with it, or with the `queue` source, which counts
/// the same things (read through this struct: `stats.notifications`).
#[derive(Debug, Default)]
pub struct GatewayStats {
    pub notify: Arc<notify::Counters>,
    /// Requests refused because `max_concurrency` were in flight (shared
    /// with the HTTP front layer, which counts them).
    pub shed: Arc<AtomicU64>,
    /// Requests that ran past `request_timeout` (shared likewise).
    pub timeouts: Arc<AtomicU64>,
}

impl Deref for GatewayStats {
    type Target = notify::Counters;
    fn deref(&self) -> &notify::Counters {
        &self.notify
    }
}

/// What stands between the gateway and readiness: each resource's reason
/// (a filter loading, a resync, a table the feed cannot follow, a feed not
/// proven current), the feed's own (waiting for its slot, say) and the
/// access checks' (a key set not fetched yet). Safe to show: no SQL, no
/// secret.
#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct Readiness {
    pub resources: Vec<(String, String)>,
    pub feed: Option<String>,
    pub auth: Option<String>,
}

impl Readiness {
    pub fn is_empty(&self) -> bool {
        self.resources.is_empty() && self.feed.is_none() && self.auth.is_none()
    }
}

impl std::fmt::Display for Readiness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut parts: Vec<String> = Vec::new();
        if let Some(feed) = &self.feed {
            parts.push(format!("change feed: {feed}"));
        }
        if let Some(auth) = &self.auth {
            parts.push(format!("auth: {auth}"));
        }
        for (r, why) in &self.resources {
            parts.push(format!("{r}: {why}"));
        }
        f.write_str(&parts.join("; "))
    }
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
    Feed(String),
}

impl Gateway {
    /// Builds the gateway with a lazy pool: nothing is contacted yet.
    pub fn new(config: Config) -> Result<Arc<Self>, StartError> {
        let db = Db::connect_lazy(&config.database).map_err(StartError::Url)?;
        Ok(Self::with_db(config, Arc::new(db)))
    }

    pub fn with_db(config: Config, db: Arc<Db>) -> Arc<Self> {
        // Row loads in flight, attached to a request or detached from
        // departed clients, within the same bound as requests.
        let loads = Arc::new(tokio::sync::Semaphore::new(config.server.max_concurrency));
        let resources = config
            .resolved()
            .into_iter()
            .map(|r| Arc::new(Resource::new(r, db.clone(), loads.clone())))
            .collect();
        let (applied_tx, applied) = watch::channel(Lsn::ZERO);
        let auth = Arc::new(crate::auth::Auth::new(&config));
        Arc::new(Self {
            config,
            db,
            resources,
            stats: GatewayStats::default(),
            metrics: Metrics::default(),
            tasks: Mutex::new(Vec::new()),
            started: tokio::sync::Mutex::new(false),
            watch: OnceLock::new(),
            applied,
            applied_tx,
            feed_mode: OnceLock::new(),
            wal_stats: Arc::default(),
            feed_health: Arc::default(),
            auth,
        })
    }

    pub fn resource(&self, name: &str) -> Option<&Arc<Resource>> {
        self.resources.iter().find(|r| r.name() == name)
    }

    /// Every resource can answer from its filter and cache, and a key set
    /// at `auth.jwks_url` has been fetched.
    pub fn is_ready(&self) -> bool {
        self.resources.iter().all(|r| r.is_ready()) && self.auth.is_ready()
    }

    /// Why the gateway is not ready, per resource and for the feed; empty
    /// when it is (see [`Readiness`]).
    pub fn readiness(&self) -> Readiness {
        let resources = self
            .resources
            .iter()
            .filter_map(|r| Some((r.name().to_string(), r.why_not_ready()?)))
            .collect();
        let health = self.feed_health.get();
        let feed = match health.state {
            feed::FeedState::Streaming => None,
            _ if self.feed_mode() == Some(FeedMode::Off) => None,
            feed::FeedState::Starting => Some(
                health
                    .detail
                    .unwrap_or_else(|| "the change feed is starting".into()),
            ),
            feed::FeedState::Waiting => Some(
                health
                    .detail
                    .unwrap_or_else(|| "the change feed is not streaming".into()),
            ),
        };
        let auth = (!self.auth.is_ready())
            .then(|| "the key set at auth.jwks_url has not been fetched yet".to_string());
        Readiness {
            resources,
            feed,
            auth,
        }
    }

    /// The tables and key columns the change feeds watch (canonical names),
    /// once start-up has read the catalog.
    pub fn watch(&self) -> Option<&Watch> {
        self.watch.get()
    }

    /// The commit LSN every change up to which has been applied (WAL
    /// sources only; [`Lsn::ZERO`] until then).
    pub fn applied(&self) -> Applied {
        self.applied.clone()
    }

    /// Waits for the database, migrates if configured, reads the catalog
    /// (canonical table names, key column types: a column the key type does
    /// not accept is an error), installs the triggers if configured,
    /// subscribes to key changes, then builds every filter. Transient
    /// failures are retried for as long as it takes; a permanent one (a
    /// missing table, a standby that cannot `LISTEN`) is returned.
    pub async fn start(self: &Arc<Self>) -> Result<(), StartError> {
        let mut started = self.started.lock().await;
        if *started {
            return Ok(());
        }
        let began = Instant::now();
        // First, so that rebuild requests made from here on (the first
        // build, a feed's resync) are served.
        for r in &self.resources {
            self.keep(tokio::spawn(r.clone().run_background()));
        }
        self.db.wait_until_reachable().await;
        if self.config.database.listen {
            // First: on a standby everything after this fails (migrations,
            // triggers) or hangs (LISTEN), and this names the cause.
            let standby: bool = sqlx::query_scalar("SELECT pg_is_in_recovery()")
                .fetch_one(self.db.pool())
                .await
                .map_err(StartError::Catalog)?;
            if standby {
                let why = if self.config.database.freshness == Freshness::Queue {
                    feed::queue::QueueError::Standby.to_string()
                } else {
                    notify::NotifyError::Standby.to_string()
                };
                return Err(StartError::Feed(why));
            }
        }
        if self.config.database.migrate {
            self.db.migrate().await?;
        }
        if let Some(replicas) = self.db.replicas() {
            // Known before the first scan, which may then run on one.
            replicas.check().await;
            let every = self.config.database.replica_check_interval;
            self.keep(tokio::spawn(replicas.clone().run_checks(every)));
        }
        let (routes, watch) = self.resolve().await?;
        let mode = self.choose_feed(&watch).await?;
        let _ = self.feed_mode.set(mode);
        if mode == FeedMode::Wal && self.config.database.install_feed {
            self.remove_triggers(&watch).await;
        }
        let sink = match mode {
            FeedMode::Notify => Some(Sink::Notify),
            FeedMode::Queue => Some(Sink::Queue),
            FeedMode::Wal | FeedMode::Off => None,
        };
        if let Some(sink) = sink
            && self.config.database.install_triggers
        {
            for (table, r) in self.install_triggers_for(&watch, sink).await {
                match r {
                    Ok(columns) => {
                        tracing::info!(table = %table, columns = ?columns, "triggers installed")
                    }
                    Err(e) => {
                        tracing::warn!(table = %table, error = %e, "cannot install the triggers; changes to it are seen at the next rebuild")
                    }
                }
            }
        }
        // Resources whose changes no feed follows (a view without
        // `source_table`) change only at rebuilds: nothing to prove.
        for r in &self.resources {
            if !routes.iter().any(|x| Arc::ptr_eq(&x.resource, r)) {
                r.vouch.set_fresh(true);
            }
        }
        self.start_feed(routes, &watch, mode).await?;
        let _ = self.watch.set(watch);
        if let Some(replicas) = self.db.replicas() {
            // A replica behind the primary now may lack commits no feed
            // event will ever name: loads wait for it to pass this point.
            match replicas.primary_lsn().await {
                Ok(lsn) => replicas.note_change(lsn),
                Err(_) => replicas.note_unknown_change(),
            }
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
        tracing::info!(elapsed = ?began.elapsed(), resources = self.resources.len(), "ready");
        *started = true;
        Ok(())
    }

    /// Waits until the feed has proven itself current once (every resource
    /// fresh, see `vouch`), saying why in the log while it waits.
    async fn wait_heard(&self) {
        let began = Instant::now();
        let mut said = began;
        while !self.resources.iter().all(|r| r.vouch.is_fresh()) {
            if said.elapsed() >= std::time::Duration::from_secs(10) {
                tracing::warn!(waited = ?began.elapsed(), why = %self.readiness(), "waiting for the change feed to confirm it is current");
                said = Instant::now();
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    }

    /// Reads every resource's table from the catalog: the table whose
    /// changes it follows (canonical name) and its key column's type, which
    /// the key type must accept.
    async fn resolve(&self) -> Result<(Vec<Route>, Watch), StartError> {
        let pool = self.db.pool();
        let mut routes = Vec::new();
        let mut tables: BTreeMap<TableName, Vec<WatchedColumn>> = BTreeMap::new();
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
            let column = served
                .column(&c.key_column)
                .ok_or_else(|| bad(format!("{} has no column {:?}", served.name, c.key_column)))?;
            if !c.key_type.accepts(column.column_type()) {
                return Err(bad(format!(
                    "key column {}.{} is {}, which key_type {:?} does not accept (accepted: {}, or a domain over one)",
                    served.name,
                    c.key_column,
                    column.declared,
                    c.key_type.sql_type(),
                    c.key_type.accepted()
                )));
            }
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
            let Some(key) = source.column(&c.key_column) else {
                return Err(bad(format!(
                    "source_table {} has no column {:?} (the key column must have the same name there)",
                    source.name, c.key_column
                )));
            };
            let column: Arc<str> = Arc::from(c.key_column.as_str());
            let watched = tables.entry(source.name.clone()).or_default();
            if !watched.iter().any(|w| w.name == column) {
                watched.push(WatchedColumn {
                    name: column.clone(),
                    ty: key.column_type(),
                });
            }
            routes.push(Route {
                table: source.name.clone(),
                column,
                resource: r.clone(),
            });
        }
        let watch = Watch {
            tables: tables
                .into_iter()
                .map(|(name, columns)| WatchedTable { name, columns })
                .collect(),
        };
        Ok((routes, watch))
    }

    /// Reads the catalog and installs the triggers of every watched table
    /// (`bloomgate install-triggers`), writing to the change table when
    /// `database.freshness = "queue"`, else notifying; one result per
    /// table: the key columns written in, or why not.
    pub async fn install_triggers(
        &self,
    ) -> Result<Vec<(TableName, Result<Vec<String>, DbError>)>, StartError> {
        let (_, watch) = self.resolve().await?;
        let sink = if self.config.database.freshness == Freshness::Queue {
            Sink::Queue
        } else {
            Sink::Notify
        };
        Ok(self.install_triggers_for(&watch, sink).await)
    }

    /// One function and trigger pair per watched table, with the key
    /// columns of every resource on it (see `db::triggers`).
    async fn install_triggers_for(
        &self,
        watch: &Watch,
        sink: Sink,
    ) -> Vec<(TableName, Result<Vec<String>, DbError>)> {
        let mut out = Vec::new();
        for t in &watch.tables {
            let columns: Vec<&str> = t.columns.iter().map(|c| &*c.name).collect();
            let r = self.db.install_triggers(&t.name, &columns, sink).await;
            out.push((
                t.name.clone(),
                r.map(|()| columns.iter().map(|c| c.to_string()).collect()),
            ));
        }
        out
    }

    /// The applier task, and the change feed feeding it, subscribed before
    /// this returns (so before the first scan takes its snapshot: see
    /// `feed::notify`).
    async fn start_feed(
        &self,
        routes: Vec<Route>,
        watch: &Watch,
        mode: FeedMode,
    ) -> Result<(), StartError> {
        // A start that failed after this point may be retried: its tasks
        // were stopped (`stop`) or will be, and new ones start here.
        let applied = self.applied_tx.clone();
        let (tx, rx) = mpsc::channel(FEED_QUEUE);
        let mut applier = Applier::new(routes, applied).with_replicas(self.db.replicas().cloned());
        if mode != FeedMode::Off {
            applier = applier.with_bound(self.config.database.freshness_bound);
        }
        self.keep(tokio::spawn(applier.run(rx)));
        if mode == FeedMode::Off {
            return Ok(());
        }
        let (ready_tx, ready) = oneshot::channel();
        if mode == FeedMode::Wal {
            let opts = feed::wal::Options {
                connect: (*self.db.pool().connect_options()).clone(),
                publication: self.config.database.publication.clone(),
                slot: self.config.database.slot.clone(),
                password: feed::replication::password_from_url(&self.config.database.url),
                poll: self.config.database.wal_poll_interval,
                silence_limit: feed::wal::SILENCE_LIMIT,
                install: self.config.database.install_feed,
            };
            self.keep(tokio::spawn(feed::wal::run(
                opts,
                watch.clone(),
                tx,
                self.applied.clone(),
                self.wal_stats.clone(),
                self.feed_health.clone(),
                ready_tx,
            )));
            return match ready.await {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) => Err(StartError::Feed(e)),
                Err(_) => Err(StartError::Feed(
                    "the WAL feed stopped before its slot existed".into(),
                )),
            };
        }
        if mode == FeedMode::Queue {
            let opts = feed::queue::Options {
                connect: (*self.db.pool().connect_options()).clone(),
                counters: self.stats.notify.clone(),
                interval: self.config.database.queue_poll_interval,
                retention: self.config.database.queue_retention,
                health: self.feed_health.clone(),
                install: self.config.database.install_triggers,
            };
            self.keep(tokio::spawn(feed::queue::run(
                opts,
                watch.clone(),
                tx,
                ready_tx,
            )));
            return match ready.await {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) => Err(StartError::Feed(e)),
                Err(_) => Err(StartError::Feed(
                    "the queue feed stopped before its first snapshot".into(),
                )),
            };
        }
        let opts = notify::Options {
            connect: (*self.db.pool().connect_options()).clone(),
            counters: self.stats.notify.clone(),
            health: self.feed_health.clone(),
            install: self.config.database.install_triggers,
        };
        self.keep(tokio::spawn(feed::notify::run(
            opts,
            watch.clone(),
            tx,
            ready_tx,
        )));
        match ready.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(StartError::Feed(e)),
            Err(_) => Err(StartError::Feed(
                "the feed stopped before it was subscribed".into(),
            )),
        }
    }

    /// The change feed in force, once start-up has chosen it.
    pub fn feed_mode(&self) -> Option<FeedMode> {
        self.feed_mode.get().copied()
    }

    /// `database.freshness` resolved (see its doc); one log line says which
    /// and why.
    async fn choose_feed(&self, watch: &Watch) -> Result<FeedMode, StartError> {
        let db = &self.config.database;
        if !db.listen || db.freshness == Freshness::Off || watch.tables.is_empty() {
            tracing::info!(
                freshness = "off",
                "change feed off: rows change in the gateway only at rebuilds and TTLs"
            );
            return Ok(FeedMode::Off);
        }
        let pool = self.db.pool();
        match db.freshness {
            Freshness::Queue => {
                tracing::info!(
                    freshness = "queue",
                    every = %humantime::format_duration(db.queue_poll_interval),
                    "change feed: triggers writing to the change table, polled (database.freshness = queue)"
                );
                Ok(FeedMode::Queue)
            }
            Freshness::Notify => {
                tracing::info!(
                    freshness = "notify",
                    "change feed: triggers and LISTEN (database.freshness = notify)"
                );
                Ok(FeedMode::Notify)
            }
            Freshness::Wal => {
                if db.install_feed {
                    self.install_publication(watch).await?;
                }
                feed::wal::check(pool, watch, &db.publication)
                    .await
                    .map_err(StartError::Feed)?;
                tracing::info!(freshness = "wal", publication = %db.publication, delivery = %wal_delivery(db), "change feed: logical decoding of the WAL (database.freshness = wal)");
                Ok(FeedMode::Wal)
            }
            Freshness::Auto | Freshness::Off => {
                let why = match feed::wal::readiness(pool).await {
                    Ok(r) if r.wal_level != "logical" => {
                        format!("wal_level is {}, not logical", r.wal_level)
                    }
                    Ok(r) if !r.can_replicate => "the role lacks REPLICATION".to_string(),
                    Ok(_) => {
                        let installed = match db.install_feed {
                            true => self.install_publication(watch).await,
                            false => Ok(()),
                        };
                        match installed {
                            // Nothing was changed: the notify feed instead.
                            Err(e) => e.to_string(),
                            Ok(()) => match feed::wal::check(pool, watch, &db.publication).await {
                                Ok(()) => {
                                    tracing::info!(freshness = "wal", publication = %db.publication, delivery = %wal_delivery(db), "change feed: logical decoding of the WAL (auto: wal_level = logical, REPLICATION, publication in place)");
                                    return Ok(FeedMode::Wal);
                                }
                                Err(e) => e,
                            },
                        }
                    }
                    Err(e) => format!("cannot read wal_level: {e}"),
                };
                tracing::info!(freshness = "notify", reason = %why, "change feed: triggers and LISTEN (auto: the WAL feed is not possible)");
                Ok(FeedMode::Notify)
            }
        }
    }

    async fn install_publication(&self, watch: &Watch) -> Result<(), StartError> {
        let mut conn = self
            .db
            .pool()
            .acquire()
            .await
            .map_err(StartError::Catalog)?;
        crate::db::publication::install(&mut conn, watch, &self.config.database.publication)
            .await
            .map_err(|e| StartError::Feed(format!("cannot install the publication: {e}")))?;
        tracing::info!(publication = %self.config.database.publication, "publication covers every resource table");
        Ok(())
    }

    /// Drops bloomgate's notification triggers from every watched table:
    /// with the WAL feed in force, writers must not pay for them.
    pub async fn remove_triggers(&self, watch: &Watch) {
        for t in &watch.tables {
            let sql = format!(
                "{}{}",
                crate::db::INSTALL_LOCK,
                crate::db::triggers::uninstall_sql(&t.name)
            );
            match sqlx::raw_sql(&sql).execute(self.db.pool()).await {
                Ok(_) => {
                    tracing::info!(table = %t.name, "notification triggers removed (WAL feed in force)")
                }
                Err(e) => {
                    tracing::warn!(table = %t.name, error = %e, "cannot remove the notification triggers")
                }
            }
        }
    }

    /// `bloomgate install-feed`: the publication over every resource table,
    /// and bloomgate's triggers removed.
    pub async fn install_feed(&self) -> Result<(), StartError> {
        let (_, watch) = self.resolve().await?;
        self.install_publication(&watch).await?;
        self.remove_triggers(&watch).await;
        Ok(())
    }

    /// Starts each resource's scheduled rebuilds.
    pub fn spawn_rebuilds(&self) {
        for r in &self.resources {
            self.keep(tokio::spawn(r.clone().rebuild_periodically()));
        }
    }

    fn keep(&self, task: JoinHandle<()>) {
        self.tasks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(task);
    }

    /// Stops every background task: the change feed, rebuild schedules and
    /// coordinators (a rebuild in progress is cancelled, its scan's query
    /// too). Returns at once; the cancelled scans' queries
    /// are cancelled on the server within `db::CANCEL_WITHIN`.
    pub fn stop(&self) {
        for t in self
            .tasks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
        {
            t.abort();
        }
    }
}
