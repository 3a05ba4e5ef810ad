//! The gateway: the database handle and every configured resource, and the
//! start-up sequence that makes them ready.
//!
//! # Tasks
//! Every background task is the gateway's: it keeps their handles and
//! [`Gateway::stop`] aborts them all. Per resource: its background task
//! ([`Resource::run_background`]: the rebuild coordinator every rebuild
//! request goes through, and the confirmation of announced keys) and its
//! rebuild schedule; plus the change feed and metrics upkeep. Aborting a
//! resource's task cancels a rebuild mid-scan: the query is cancelled on the
//! server and the journal closed (see `resource` and `db`), and every
//! waiting [`crate::rebuild::Ticket`] resolves.

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio::task::JoinHandle;

use crate::config::Config;
use crate::db::Db;
use crate::listener;
use crate::metrics::Metrics;
use crate::resource::{RebuildError, Resource};

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
}

/// Counters that belong to no single resource.
#[derive(Debug, Default)]
pub struct GatewayStats {
    pub notifications: AtomicU64,
    pub listener_reconnects: AtomicU64,
    /// Trigger time to receipt of the latest notification, in microseconds.
    pub last_notification_lag_us: AtomicU64,
    /// Requests refused because `max_concurrency` were in flight.
    pub shed: AtomicU64,
    /// Requests that ran past `request_timeout`.
    pub timeouts: AtomicU64,
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
}

impl Gateway {
    /// Builds the gateway with a lazy pool: nothing is contacted yet.
    pub fn new(config: Config) -> Result<Arc<Self>, StartError> {
        let db = Db::connect_lazy(&config.database).map_err(StartError::Url)?;
        Ok(Self::with_db(config, Arc::new(db)))
    }

    pub fn with_db(config: Config, db: Arc<Db>) -> Arc<Self> {
        let resources = config
            .resolved()
            .into_iter()
            .map(|r| Arc::new(Resource::new(r, db.clone())))
            .collect();
        Arc::new(Self {
            config,
            db,
            resources,
            stats: GatewayStats::default(),
            metrics: Metrics::default(),
            tasks: Mutex::new(Vec::new()),
            started: tokio::sync::Mutex::new(false),
        })
    }

    pub fn resource(&self, name: &str) -> Option<&Arc<Resource>> {
        self.resources.iter().find(|r| r.name() == name)
    }

    /// Every resource can answer.
    pub fn is_ready(&self) -> bool {
        self.resources.iter().all(|r| r.is_ready())
    }

    /// Waits for the database, migrates and installs triggers if configured,
    /// subscribes to key changes, then builds every filter. Transient
    /// failures are retried for as long as it takes; a permanent one (a
    /// missing table) is returned.
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
        if self.config.database.migrate {
            self.db.migrate().await?;
        }
        if self.config.database.install_triggers {
            for r in &self.resources {
                match self
                    .db
                    .install_triggers(&r.config.table, &r.config.key_column)
                    .await
                {
                    Ok(()) => {
                        tracing::info!(resource = %r.name(), "notification triggers installed")
                    }
                    Err(e) => {
                        tracing::warn!(resource = %r.name(), error = %e, "cannot install notification triggers (a view? put them on its base table)")
                    }
                }
            }
        }
        {
            let weak = Arc::downgrade(self);
            self.keep(tokio::spawn(async move {
                let mut tick = tokio::time::interval(std::time::Duration::from_secs(5));
                loop {
                    tick.tick().await;
                    let Some(gw) = weak.upgrade() else { break };
                    gw.metrics.upkeep();
                }
            }));
        }
        if self.config.database.listen {
            // Subscribed before the first scan takes its snapshot: see the
            // `listener` module doc.
            let (tx, rx) = tokio::sync::oneshot::channel();
            self.keep(tokio::spawn(listener::run(self.clone(), tx)));
            let _ = rx.await;
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
        tracing::info!(elapsed = ?began.elapsed(), resources = self.resources.len(), "ready");
        *started = true;
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
    /// too), metrics upkeep. Returns at once; the cancelled scans' queries
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
