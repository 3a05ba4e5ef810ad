//! The one interface between the gateway and its change feed: which feed
//! (`database.freshness` resolved, with the reason logged once), what the
//! chosen feed needs in the database (its triggers or its publication, the
//! other's triggers removed), the feed's task, and what the feed says of
//! itself ([`Health`]). The gateway names no feed's internals, and no feed
//! names the gateway.
//!
//! `database.freshness = "auto"` takes the WAL feed when the server and the
//! role allow it and the publication delivers every change of every
//! watched table (or `install_feed` may make it so), else the notify feed;
//! `"wal"` without what it needs is a start-up error naming the fix.
//!
//! With `bus.url` set, the WAL is followed through the bus (`feed::bus`):
//! every gateway is a candidate relay and a consumer of the stream, and
//! falls back to a WAL feed of its own while the bus is not current. The
//! bus needs what the WAL feed needs; any other feed with a bus is a
//! start-up error.

use std::sync::Arc;

use sqlx::PgPool;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;

use super::{Event, Health, NotStarted, Position, PrepareError, Watch, bus, notify, queue, wal};
use crate::config::{BusConfig, BusReadFrom, DatabaseConfig, Freshness};
use crate::db::triggers::Sink;
use crate::db::{Db, DbError, publication};
use crate::shutdown::Shutdown;

/// Fires once the feed streams, or says why it never will.
pub type Ready = oneshot::Receiver<Result<(), NotStarted>>;

/// The feed in force and what it reports.
pub struct Supervisor {
    /// `database.freshness` resolved: never `Auto`.
    freshness: Freshness,
    pub health: Arc<Health>,
    pub wal_stats: Arc<wal::Stats>,
    /// The notify and queue feeds' counters (they count the same things).
    pub notify_counters: Arc<notify::Stats>,
    /// With `bus.url`: the bus and what it says of itself.
    pub bus: Option<BusSetup>,
}

/// The bus in force (`bus.url`).
pub struct BusSetup {
    redis: bus::redis::RedisBus,
    config: BusConfig,
    pub status: Arc<bus::Status>,
    /// The relay's WAL feed's counters (the gateway's own are its
    /// direct feed's).
    pub relay_stats: Arc<wal::Stats>,
    /// Where the consumer has read to (for snapshots).
    cursor: Arc<bus::cursor::Cursor>,
    /// With `bus.fleet_key_file`: the fleet's snapshots.
    pub snapshots: Option<Arc<bus::redis::snapshots::RedisSnapshots>>,
    /// What the consumer does as it first starts on the bus: installs
    /// snapshots (set by the gateway, which knows the resources).
    pub join: std::sync::OnceLock<bus::cursor::Join>,
}

/// The name `database.freshness` gives a feed.
pub fn name(f: Freshness) -> &'static str {
    match f {
        Freshness::Auto => "auto",
        Freshness::Wal => "wal",
        Freshness::Queue => "queue",
        Freshness::Notify => "notify",
        Freshness::Off => "off",
    }
}

/// How the WAL feed reads the slot (`database.wal_poll_interval`), for the
/// log line that says which feed is in force.
pub fn wal_delivery(db: &DatabaseConfig) -> String {
    match db.wal_poll_interval {
        None => "streamed".into(),
        Some(every) => format!("polled every {}", humantime::format_duration(every)),
    }
}

impl Supervisor {
    /// Resolves `database.freshness` against the server and installs what
    /// the chosen feed needs. An error says what to fix (a publication
    /// `"wal"` cannot use).
    pub async fn prepare(
        db: &Db,
        cfg: &DatabaseConfig,
        bus_cfg: &BusConfig,
        watch: &Watch,
        wal_stats: Arc<wal::Stats>,
        notify_counters: Arc<notify::Stats>,
    ) -> Result<Self, PrepareError> {
        let pool = db.pool();
        let freshness = choose(pool, cfg, watch).await?;
        let bus = match &bus_cfg.url {
            None => None,
            Some(_) if freshness == Freshness::Off => None,
            Some(_) if freshness != Freshness::Wal => {
                return Err(PrepareError::Refused(format!(
                    "bus.url needs the WAL feed (database.freshness is {}): the relay decodes the WAL (wal_level = logical, REPLICATION, the publication: see `bloomgate install-feed`)",
                    name(freshness)
                )));
            }
            Some(url) => {
                let base = bus::stream_key(pool, &bus_cfg.prefix, watch).await?;
                // The stream of the primary's timeline; relay and consumer
                // each read it again before they use the bus.
                let (server, _) =
                    crate::db::position::Server::read_pool(pool)
                        .await
                        .map_err(|source| PrepareError::Db {
                            what: "reading the primary's timeline for the bus",
                            source,
                        })?;
                let stream = bus::epoch_key(&base, &server);
                let tls = bus::redis::TlsFiles {
                    ca_file: bus_cfg.ca_file.clone(),
                    cert_file: bus_cfg.cert_file.clone(),
                    key_file: bus_cfg.key_file.clone(),
                };
                let sentinels = bus_cfg
                    .sentinel_master
                    .as_ref()
                    .map(|m| bus::redis::Sentinels {
                        urls: bus_cfg.sentinels.clone(),
                        master: m.clone(),
                    });
                let redis = bus::redis::RedisBus::with_sentinels(
                    url,
                    sentinels.as_ref(),
                    &tls,
                    base,
                    server,
                    bus_cfg.retention,
                )
                .map_err(|e| PrepareError::Refused(e.to_string()))?;
                let cursor = Arc::new(bus::cursor::Cursor::default());
                let snapshots = match &bus_cfg.fleet_key_file {
                    None => None,
                    Some(path) => {
                        let key = crate::snapshot::FleetKey::from_file(path).map_err(|e| {
                            PrepareError::Refused(format!("bus.fleet_key_file: {e}"))
                        })?;
                        let settings = crate::snapshot::Settings {
                            wait: bus_cfg.snapshot_wait,
                            max_parallel_scans: bus_cfg.max_parallel_scans,
                            keep: bus_cfg.snapshot_keep,
                        };
                        Some(Arc::new(bus::redis::snapshots::RedisSnapshots::new(
                            &redis,
                            key,
                            settings,
                            cursor.clone(),
                            pool.clone(),
                            watch.clone(),
                        )))
                    }
                };
                let shown = bus_cfg.shown().unwrap_or_default();
                tracing::info!(url = %shown, stream = %stream, slot = %bus_cfg.slot, "change feed: the WAL through the bus (one relay decodes it for every gateway)");
                Some(BusSetup {
                    redis,
                    config: bus_cfg.clone(),
                    status: Arc::new(bus::Status::new(shown, stream)),
                    relay_stats: Arc::default(),
                    cursor,
                    snapshots,
                    join: Default::default(),
                })
            }
        };
        match freshness {
            Freshness::Wal if cfg.install_feed => remove_triggers(db, watch).await,
            Freshness::Notify | Freshness::Queue if cfg.install_triggers => {
                let sink = sink_of(freshness);
                for (table, r) in install_triggers(db, watch, sink).await {
                    match r {
                        Ok(columns) => {
                            tracing::info!(table = %table, columns = ?columns, "triggers installed")
                        }
                        // The feed's checks report it (the table is not
                        // followed) and retry.
                        Err(e) => {
                            tracing::warn!(table = %table, error = %e, "cannot install the triggers")
                        }
                    }
                }
            }
            _ => {}
        }
        Ok(Self {
            freshness,
            health: Arc::default(),
            wal_stats,
            notify_counters,
            bus,
        })
    }

    /// `database.freshness` resolved: never `Auto`.
    pub fn freshness(&self) -> Freshness {
        self.freshness
    }

    /// Starts the feed (none when off): its task and what fires once it
    /// streams, or says why it never will (a standby).
    pub fn spawn(
        &self,
        db: &Db,
        cfg: &DatabaseConfig,
        watch: &Watch,
        tx: mpsc::Sender<Event>,
        applied: watch::Receiver<Position>,
        shutdown: Shutdown,
    ) -> Option<(JoinHandle<()>, Ready)> {
        let (ready_tx, ready) = oneshot::channel();
        let connect = (*db.pool().connect_options()).clone();
        let watch = watch.clone();
        let task = match self.freshness {
            Freshness::Off | Freshness::Auto => return None,
            Freshness::Wal => {
                let opts = wal::WalOptions {
                    connect,
                    publication: cfg.publication.clone(),
                    slot: cfg.slot.clone(),
                    password: super::wal::replication::password_from_url(&cfg.url),
                    poll: cfg.wal_poll_interval,
                    silence_limit: wal::SILENCE_LIMIT,
                    install: cfg.install_feed,
                    start_position: None,
                    start_server: None,
                    idle_confirm_applied: false,
                    broken_slot: Default::default(),
                    identity: Some(db.identity.clone()),
                };
                if let Some(b) = &self.bus {
                    return Some((
                        self.spawn_bus(b, db, opts, watch, tx, applied, ready_tx, shutdown),
                        ready,
                    ));
                }
                tokio::spawn(wal::run(
                    opts,
                    watch,
                    tx,
                    applied,
                    self.wal_stats.clone(),
                    self.health.clone(),
                    ready_tx,
                    shutdown,
                ))
            }
            Freshness::Queue => {
                let opts = queue::QueueOptions {
                    connect,
                    counters: self.notify_counters.clone(),
                    interval: cfg.queue_poll_interval,
                    retention: cfg.queue_retention,
                    health: self.health.clone(),
                    install: cfg.install_triggers,
                    identity: db.identity.clone(),
                };
                tokio::spawn(queue::run(opts, watch, tx, ready_tx, shutdown))
            }
            Freshness::Notify => {
                let opts = notify::NotifyOptions {
                    connect,
                    counters: self.notify_counters.clone(),
                    health: self.health.clone(),
                    install: cfg.install_triggers,
                    identity: db.identity.clone(),
                };
                tokio::spawn(notify::run(opts, watch, tx, ready_tx, shutdown))
            }
        };
        Some((task, ready))
    }
}

impl Supervisor {
    /// The relay candidate and the consumer, in one task.
    #[allow(clippy::too_many_arguments)]
    fn spawn_bus(
        &self,
        b: &BusSetup,
        db: &Db,
        direct: wal::WalOptions,
        watch: Watch,
        tx: mpsc::Sender<Event>,
        applied: watch::Receiver<Position>,
        ready: oneshot::Sender<Result<(), NotStarted>>,
        shutdown: Shutdown,
    ) -> JoinHandle<()> {
        let relay = bus::relay::RelayOptions {
            wal: wal::WalOptions {
                slot: Some(b.config.slot.clone()),
                // The relay's own, shared by its terms.
                broken_slot: Default::default(),
                // The consumer names the server the gateway follows; the
                // relay's feed ends its term on its own if its server
                // changes.
                identity: None,
                ..direct.clone()
            },
            batch_window: b.config.batch_window,
            batch_max: b.config.batch_max_commits,
            pool: crate::feed::private_pool(&db.pool().connect_options(), "bloomgate-relay"),
            identity: db.identity.clone(),
            name: bus::whoami(),
            status: b.status.clone(),
            stats: b.relay_stats.clone(),
        };
        let consumer = bus::consumer::ConsumerOptions {
            pool: db.pool().clone(),
            max_lag: b.config.max_lag,
            // A temporary slot: a permanent one would hold WAL back while
            // the gateway is on the bus.
            direct: wal::WalOptions {
                slot: None,
                ..direct
            },
            status: b.status.clone(),
            health: self.health.clone(),
            wal_stats: self.wal_stats.clone(),
            max_direct: b.config.max_direct_fallback,
            identity: db.identity.clone(),
            cursor: b.cursor.clone(),
            join: b.join.get().cloned(),
        };
        let relay = bus::relay::run(b.redis.another(), relay, watch.clone(), shutdown.clone());
        let consumer = bus::consumer::run(
            b.redis.reader(b.config.read_from == BusReadFrom::Replicas),
            consumer,
            watch,
            tx,
            applied,
            ready,
            shutdown,
        );
        tokio::spawn(async move {
            tokio::join!(relay, consumer);
        })
    }
}

/// A hot standby cannot follow changes (`LISTEN` and the queue's pruning
/// need the primary, and installing triggers fails there): refused before
/// anything else is tried, with the cause named.
pub async fn refuse_standby(pool: &PgPool, cfg: &DatabaseConfig) -> Result<(), PrepareError> {
    if cfg.freshness == Freshness::Off {
        return Ok(());
    }
    let standby: bool = sqlx::query_scalar("SELECT pg_is_in_recovery()")
        .fetch_one(pool)
        .await
        .map_err(|source| PrepareError::Db {
            what: "reading the catalog",
            source,
        })?;
    if !standby {
        return Ok(());
    }
    Err(PrepareError::Refused(match cfg.freshness {
        Freshness::Queue => queue::QueueError::Standby.to_string(),
        _ => notify::NotifyError::Standby.to_string(),
    }))
}

fn sink_of(freshness: Freshness) -> Sink {
    match freshness {
        Freshness::Queue => Sink::Queue,
        _ => Sink::Notify,
    }
}

/// `database.freshness` resolved; one log line says which and why.
async fn choose(
    pool: &PgPool,
    cfg: &DatabaseConfig,
    watch: &Watch,
) -> Result<Freshness, PrepareError> {
    if cfg.freshness == Freshness::Off || watch.tables.is_empty() {
        tracing::info!(
            freshness = "off",
            "change feed off: rows change in the gateway only at rebuilds and TTLs"
        );
        return Ok(Freshness::Off);
    }
    match cfg.freshness {
        Freshness::Queue => {
            tracing::info!(
                freshness = "queue",
                every = %humantime::format_duration(cfg.queue_poll_interval),
                "change feed: triggers writing to the change table, polled (database.freshness = queue)"
            );
            Ok(Freshness::Queue)
        }
        Freshness::Notify => {
            tracing::info!(
                freshness = "notify",
                "change feed: triggers and LISTEN (database.freshness = notify)"
            );
            Ok(Freshness::Notify)
        }
        Freshness::Wal => {
            if cfg.install_feed {
                install_publication(pool, cfg, watch, false).await?;
            }
            wal::check(pool, watch, &cfg.publication).await?;
            tracing::info!(freshness = "wal", publication = %cfg.publication, delivery = %wal_delivery(cfg), "change feed: logical decoding of the WAL (database.freshness = wal)");
            Ok(Freshness::Wal)
        }
        Freshness::Auto | Freshness::Off => {
            let why = match wal::prerequisites(pool).await {
                Ok(r) if r.wal_level != "logical" => {
                    format!("wal_level is {}, not logical", r.wal_level)
                }
                Ok(r) if !r.can_replicate => "the role lacks REPLICATION".to_string(),
                Ok(_) => {
                    let installed = match cfg.install_feed {
                        true => install_publication(pool, cfg, watch, false).await,
                        false => Ok(()),
                    };
                    match installed {
                        // Not now, rather than no: asked again, so that a
                        // hiccup never settles the feed for the process's
                        // life (`preflight` would say "wal" here).
                        Err(e) if e.is_momentary() => return Err(e),
                        // Nothing was changed: the notify feed instead.
                        Err(e) => e.to_string(),
                        Ok(()) => match wal::check(pool, watch, &cfg.publication).await {
                            Ok(()) => {
                                tracing::info!(freshness = "wal", publication = %cfg.publication, delivery = %wal_delivery(cfg), "change feed: logical decoding of the WAL (auto: wal_level = logical, REPLICATION, publication in place)");
                                return Ok(Freshness::Wal);
                            }
                            Err(e) if e.is_momentary() => return Err(e),
                            Err(e) => e.to_string(),
                        },
                    }
                }
                Err(e) if crate::db::outage::is_momentary(&e) => {
                    return Err(PrepareError::Db {
                        what: "reading wal_level",
                        source: e,
                    });
                }
                Err(e) => format!("cannot read wal_level: {e}"),
            };
            tracing::info!(freshness = "notify", reason = %why, "change feed: triggers and LISTEN (auto: the WAL feed is not possible)");
            Ok(Freshness::Notify)
        }
    }
}

/// The publication over every watched table (`bloomgate install-feed`,
/// `database.install_feed`): every replica identity checked first, one
/// transaction. `narrow` (the command) also narrows a publication that
/// sends columns the feed does not need (`publication::install_narrowed`).
pub async fn install_publication(
    pool: &PgPool,
    cfg: &DatabaseConfig,
    watch: &Watch,
    narrow: bool,
) -> Result<(), PrepareError> {
    let mut conn = pool.acquire().await.map_err(|source| PrepareError::Db {
        what: "a connection to install the publication",
        source,
    })?;
    let installed = match narrow {
        true => publication::install_narrowed(&mut conn, watch, &cfg.publication).await,
        false => publication::install(&mut conn, watch, &cfg.publication).await,
    };
    installed.map_err(|e| match e {
        publication::InstallError::Sql(source) => PrepareError::Db {
            what: "cannot install the publication",
            source,
        },
        e => PrepareError::Refused(format!("cannot install the publication: {e}")),
    })?;
    tracing::info!(publication = %cfg.publication, "publication covers every resource table");
    Ok(())
}

/// Drops bloomgate's triggers from every watched table: with the WAL feed
/// in force, writers must not pay for them.
pub async fn remove_triggers(db: &Db, watch: &Watch) {
    for t in &watch.tables {
        match db.remove_triggers(&t.name).await {
            Ok(()) => {
                tracing::info!(table = %t.name, "notification triggers removed (WAL feed in force)")
            }
            Err(e) => {
                tracing::warn!(table = %t.name, error = %e, "cannot remove the notification triggers")
            }
        }
    }
}

/// One function and trigger pair per watched table, with the key columns of
/// every resource on it, delivering to `sink` (see `db::triggers`); one
/// result per table: the key columns written in, or why not.
pub async fn install_triggers(
    db: &Db,
    watch: &Watch,
    sink: Sink,
) -> Vec<(super::TableName, Result<Vec<String>, DbError>)> {
    let mut out = Vec::new();
    for t in &watch.tables {
        let columns: Vec<&str> = t.columns.iter().map(|c| &*c.name).collect();
        let r = db.install_triggers(&t.name, &columns, sink).await;
        out.push((
            t.name.clone(),
            r.map(|()| columns.iter().map(|c| c.to_string()).collect()),
        ));
    }
    out
}

/// The sink `bloomgate install-triggers` installs for: the change table for
/// the queue feed, `NOTIFY` otherwise.
pub fn sink_for(cfg: &DatabaseConfig) -> Sink {
    sink_of(cfg.freshness)
}
