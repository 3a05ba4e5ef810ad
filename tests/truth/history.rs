//! One history: a database, its gateways, readers, a writer and the
//! faults, judged as the crate doc says.

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use bloomgate::feed::{Lsn, Position, Timeline};
use bloomgate::gateway::Gateway;
use bloomgate::http::App;
use futures_util::StreamExt;
use serde_json::Value;
use sqlx::postgres::PgPoolOptions;
use sqlx::{Connection, Executor, PgConnection, PgPool};
use tokio::task::JoinHandle;

mod assumptions;
mod faults;
mod life;
mod reads;
mod refusals;

pub(crate) use life::private_cluster;

use faults::{Action, Resume};
use reads::{Answer, get, is_ready, reader};

use crate::common::TestDb;
use crate::common::sentinel::{MASTER, PASSWORD, SENTINEL_PASSWORD, Site};
use crate::model::{Model, secs};
use crate::ops::{End, Gen, Part, Step};
use crate::redis::Redis;
use crate::rng::Rng;
use crate::schema::{self, BusSetup, Path, Res, Setup};
use crate::{Fault, Feed};
use life::Life;

/// A feed's connection lost (walsender, listener, poller killed; slot
/// dropped): how long the gateway may serve what it had before.
pub const FEED_GAP: Duration = Duration::from_secs(3);
/// Something the feed depends on changed under it (publication, replica
/// identity, partitions): how long until the gateway must have noticed
/// (its check interval, assumed at most 2 s, plus a rescan).
pub const WATCHED: Duration = Duration::from_secs(5);
/// At a quiescence point, at least one of the history's gateways must say
/// ready within this (a second one may wait for the slot the first holds).
pub const NOT_READY_LIMIT: Duration = Duration::from_secs(20);
/// A ready gateway must have applied the marker write within this.
pub const CATCH_UP_LIMIT: Duration = Duration::from_secs(10);
/// After catching up: the WAL feed's second, visible-phase delivery
/// (every 5 ms) has run.
const SETTLE: Duration = Duration::from_millis(100);
/// Mixed into the seed for the bus's `max_direct_fallback` draw.
const FALLBACK_DRAW: u64 = 0xFA11_BAC4_D1EC_7000;
/// Mixed into the seed for the Sentinel stream: whether a bus history runs
/// on Redis Sentinel, and which rounds fail its primary over. Any salt
/// would do; this one keeps CI's `restart-redis` seeds (1008, 1011, 1015)
/// on one `redis-server`, where that fault is played, and puts 2 on
/// Sentinel (see [`crate::BUS_CI_SEEDS`]).
const SENTINEL_DRAW: u64 = 0xAA3F_C17D_9BA8_45E4;
/// Mixed into the seed for whether a Sentinel history's fleet reads the
/// replica (`bus.read_from = "replicas"`): a stream of its own, so no other
/// choice of any seed changes. This salt puts CI's Sentinel seed (2) on
/// the replica (and 5, 7 and 12 of 1..12).
const READ_FROM_DRAW: u64 = 0x4EAD_F40E_2E91_1CA7;

/// Salts the stream every choice about `orders` is drawn from (see
/// `ops`): one of its own, so that the seeds' other choices are what they
/// were before it existed.
const ORDERS_DRAW: u64 = 0x0D3E_5C0A_1B2F_7E11;

/// Salts [`snapshot_draw`]'s stream.
const SNAPSHOT_DRAW: u64 = 0x5_4A95_407F_1EE7;

/// Salts [`assumption_draw`]'s stream.
const ASSUMPTION_DRAW: u64 = 0xA55E_7710_0B5E_D050;

/// Salts [`redis_draw`]'s stream.
const REDIS_DRAW: u64 = 0x2ED1_5EF0_5E5B_0A11;
const READERS: usize = 2;

pub struct Opts {
    pub feed: Feed,
    pub seed: u64,
    pub faults: Vec<Fault>,
    pub rounds: usize,
    /// Forced slot kind (`BLOOMGATE_TRUTH_SLOT`); else the seed decides.
    pub permanent_slot: Option<bool>,
    /// The streaming replicas' server URLs (no database); the last is the
    /// one the replica fault pauses.
    pub replicas: Vec<String>,
    pub trace: bool,
    /// Run every round even after a violation (`BLOOMGATE_TRUTH_KEEP_GOING`).
    pub keep_going: bool,
    /// The faults of what was assumed, one per round in turn rather than
    /// drawn (`BLOOMGATE_TRUTH_IN_TURN`; CI's [`crate::CI_IN_TURN_SEED`]).
    pub in_turn: bool,
}

#[derive(Default)]
pub struct Report {
    pub ops: u64,
    pub faults: u64,
    pub checks: u64,
    pub unavailable: u64,
    /// The writer's transactions Postgres aborted (deadlocks), retried.
    pub writer_aborts: u64,
    /// Filters kept across a promotion, summed over the gateways and
    /// their resources (`failover-kept-slot`: how often the proof held).
    pub kept: u64,
    pub violations: Vec<String>,
    pub journal: Vec<String>,
    /// The seed's choices (slot kind, replica), for the failure message.
    pub setup: String,
}

/// One gateway of the history.
struct Gw {
    id: usize,
    gw: Arc<Gateway>,
    app: App,
    /// Taken out of service: its answers no longer count (a reader that
    /// finishes a request after this ignores it).
    retired: AtomicBool,
    ready_at: Mutex<Option<Duration>>,
    /// Why start-up failed, and whether the replica-identity fault
    /// excused it (see [`Shared::identity_excuse`]).
    failed: Mutex<Option<(String, bool)>>,
    start: Mutex<Option<JoinHandle<()>>>,
    /// The bus feed's gateways run on a runtime of their own, every task
    /// of theirs on it, so that `kill-relay` can end one as a crash does:
    /// the runtime shut down, every task dropped where it stands (see the
    /// crate doc). `None` on the other feeds, whose gateways share the
    /// test's runtime.
    rt: Mutex<Option<tokio::runtime::Runtime>>,
    handle: Option<tokio::runtime::Handle>,
}

/// What the readers share with the driver.
struct Shared {
    epoch: Instant,
    model: Mutex<Model>,
    gws: RwLock<Vec<Arc<Gw>>>,
    violations: Mutex<Vec<String>>,
    journal: Mutex<Vec<String>>,
    flagged: Mutex<HashSet<(usize, String)>>,
    checks: AtomicU64,
    unavailable: AtomicU64,
    /// Filters kept across a promotion by gateways no longer running.
    kept: AtomicU64,
    /// Until when a start-up refused for `users`' replica identity is the
    /// documented refusal, not a violation: `Duration::MAX` while the
    /// fault is open, `WATCHED` past its repair after (the gateway checks
    /// what the feed depends on within that), `None` before the first.
    identity_excuse: Mutex<Option<Duration>>,
    /// The same for a start-up refused because the publication lacks a
    /// served table (the `publication` fault; a gateway of the fleet may
    /// still be starting when it is injected).
    publication_excuse: Mutex<Option<Duration>>,
    stop: AtomicBool,
    trace: bool,
}

impl Shared {
    fn now(&self) -> Duration {
        self.epoch.elapsed()
    }

    fn note(&self, line: String) {
        let line = format!("t={} {line}", secs(self.now()));
        if self.trace {
            eprintln!("truth: {line}");
        }
        self.journal.lock().unwrap().push(line);
    }

    /// A violation during the run, recorded once per gateway and path
    /// (a stale row is read again and again until it is fixed).
    fn violation_once(&self, gw: usize, url: &str, line: String) {
        if self.flagged.lock().unwrap().insert((gw, url.to_string())) {
            self.violation(line);
        }
    }

    fn violation(&self, line: String) {
        let line = format!("t={} {line}", secs(self.now()));
        if self.trace {
            eprintln!("truth: VIOLATION {line}");
        }
        self.violations.lock().unwrap().push(line);
    }

    fn live(&self) -> Vec<Arc<Gw>> {
        self.gws.read().unwrap().clone()
    }
}

struct World {
    opts: Opts,
    shared: Arc<Shared>,
    db: TestDb,
    writer: PgConnection,
    writes: Gen,
    slot: Option<String>,
    /// The replicas' URLs for this database (empty: none configured).
    replica_dbs: Vec<String>,
    /// The last replica's `postgres` database (pool, URL), for pausing its
    /// replay.
    replica_admin: Option<(PgPool, String)>,
    paused: Option<Resume>,
    marker: i64,
    step: u64,
    due: Vec<(u64, Action)>,
    next_gw: usize,
    next_part: u32,
    columns_added: u32,
    open_publication: bool,
    open_identity: bool,
    open_second: bool,
    /// The bus feed: its `redis-server`, `[bus]`, and how many gateways
    /// the fleet keeps.
    redis: Option<Redis>,
    bus: Option<BusSetup>,
    fleet: usize,
    open_redis: bool,
    /// `restart-redis`: not started again before this.
    redis_back_at: Duration,
    /// A Sentinel history's site (`redis` is then `None`), and its stream
    /// of choices (see [`sentinel_draw`]).
    site: Option<Site>,
    sentinel_rng: Option<Rng>,
    /// The fleet shares snapshots (see [`snapshot_draw`]).
    snapshot_rng: Option<Rng>,
    /// `redis-refuses` and `redis-split-brain` (see [`redis_draw`]).
    redis_rng: Option<Rng>,
    /// A split brain is open (see `refusals`).
    split: bool,
    /// The stream the faults of what was assumed are drawn from (see
    /// [`assumption_draw`]); `None`: the history has none.
    assume_rng: Option<Rng>,
    /// `wal-writer` in force: how to undo it, and not before when.
    wal_writer: Option<(assumptions::WalWriter, Duration)>,
    /// `restore`: the copy of the primary's data directory to put back, and
    /// when it was made.
    copy: Option<(std::path::PathBuf, std::time::Duration)>,
    /// `redis-failover` under way: when its primary was killed (`None`
    /// while the replica's link is cut and the kill is still to come).
    failover: Option<Option<Duration>>,
    /// The database's lifecycle faults: the history's own cluster.
    life: Option<Life>,
    report: Report,
    readers: Vec<JoinHandle<()>>,
}

pub async fn run(opts: Opts) -> Report {
    let mut w = World::setup(opts).await;
    if w.shared.violations.lock().unwrap().is_empty() {
        w.main().await;
    }
    w.teardown().await
}

impl World {
    async fn setup(opts: Opts) -> World {
        let mut rng = Rng::new(opts.seed);
        let (db, mut life) = if private_cluster(&opts) {
            let name = format!("truth_life_{}_{}", std::process::id(), opts.seed);
            let (life, pool) = Life::start(opts.seed, &name).await;
            let url = life.gateway_url(&name);
            // Not through the gateway's proxy, which a fault may have cut.
            let admin = life.writer_url("postgres");
            let db = TestDb {
                name,
                url,
                pool,
                admin,
            };
            (db, Some(life))
        } else {
            (TestDb::new().await, None)
        };
        db.exec(schema::SETUP).await;
        let writer_url = match &life {
            Some(l) => l.writer_url(&db.name),
            None => db.url.clone(),
        };
        let mut writer = PgConnection::connect(&writer_url).await.unwrap();
        if life.as_ref().is_some_and(|l| l.async_commits) {
            writer
                .execute("SET synchronous_commit = off")
                .await
                .unwrap();
        }
        drop_stale_slots(&mut writer).await;
        let tag = db.name.trim_start_matches("bloomgate_test_").to_string();
        let mut writes = Gen::new(
            rng.fork(),
            Rng::new(opts.seed ^ ORDERS_DRAW),
            format!("truth_{tag}"),
        );
        let prepared: String = sqlx::query_scalar("SHOW max_prepared_transactions")
            .fetch_one(&mut writer)
            .await
            .unwrap();
        // Postgres refuses to PREPARE a transaction that sent a NOTIFY,
        // which every write does through the notify feed's triggers: no
        // two-phase writer can use a table that feed watches.
        writes.prepared_ok = prepared != "0" && opts.feed != Feed::Notify;
        let only_permanent = !opts.faults.is_empty()
            && opts.faults.iter().all(|f| {
                matches!(
                    f,
                    Fault::DropSlot | Fault::SecondGateway | Fault::FailoverKeptSlot
                )
            });
        let on_bus = opts.feed == Feed::Bus;
        let permanent = opts.feed.is_wal()
            && !on_bus
            && opts
                .permanent_slot
                .unwrap_or_else(|| only_permanent || rng.chance(50));
        // On the bus: `bus.slot`, the relay's (the consumers' direct feeds
        // take temporary ones); `truth_` so a panicked history's is dropped.
        let slot = (permanent || on_bus).then(|| format!("truth_{tag}"));
        if let Some(l) = &mut life
            && let Some((r, only)) = life::kept_slot_draw(&opts, slot.is_some())
        {
            l.kept = Some(r);
            l.kept_only = only;
        }
        let use_replica = (!opts.replicas.is_empty() || life.is_some())
            && (opts.faults.contains(&Fault::ReplicaPause) || rng.chance(50));
        if let Some(l) = &mut life {
            l.add_servers(use_replica);
        }
        let replica_dbs: Vec<String> =
            if let Some(r) = life.as_ref().and_then(|l| l.replica.as_ref()) {
                vec![r.url(&db.name)]
            } else if use_replica && life.is_none() {
                opts.replicas
                    .iter()
                    .map(|r| format!("{r}/{}", db.name))
                    .collect()
            } else {
                Vec::new()
            };
        let sentinel_rng = sentinel_draw(&opts);
        let assume_rng = assumption_draw(&opts);
        let mut snapshot_rng = snapshot_draw(&opts);
        let redis_rng = redis_draw(&opts);
        let mut site_slot = None;
        // A fleet of two or three; `bus.max_lag` short (a consumer falls
        // back to its own feed before a failover completes) or the default
        // (it waits for the failover, not vouched for meanwhile).
        let (redis, bus, fleet) = if on_bus {
            let fleet = 2 + rng.below(2);
            let max_lag = if rng.chance(50) { "1s" } else { "5s" };
            // Fewer direct-feed slots than gateways, so a bus lost past
            // `max_lag` leaves some of the fleet unvouched. Drawn apart
            // (a stream of its own), so the seeds' other choices stay as
            // they were.
            let max_direct_fallback = Rng::new(opts.seed ^ FALLBACK_DRAW).below(fleet);
            // On Sentinel, half the seeds read the replica: its link cut
            // before a kill strands the fleet's reads there.
            let read_from =
                if sentinel_rng.is_some() && Rng::new(opts.seed ^ READ_FROM_DRAW).chance(50) {
                    "replicas"
                } else {
                    "primary"
                };
            let (redis, url, sentinels, sentinel_master) = if sentinel_rng.is_some() {
                let site = Site::start().await;
                let sentinels = site.sentinel_urls(SENTINEL_PASSWORD);
                site_slot = Some(site);
                (
                    None,
                    Site::url(PASSWORD),
                    sentinels,
                    Some(MASTER.to_string()),
                )
            } else {
                let redis = Redis::start().await;
                let url = redis.url();
                (Some(redis), url, Vec::new(), None)
            };
            let snapshots = snapshot_rng.as_mut().map(|r| {
                let path = std::env::temp_dir().join(format!("truth_{tag}.fleet.key"));
                let key: String = (0..32).map(|_| format!("{:02x}", r.below(256))).collect();
                std::fs::write(&path, key).unwrap();
                let wait = if r.chance(50) { "1s" } else { "30s" };
                (path.to_string_lossy().into_owned(), wait)
            });
            let bus = BusSetup {
                url,
                sentinels,
                sentinel_master,
                slot: slot.clone().unwrap(),
                prefix: format!("truth_{tag}"),
                max_lag,
                max_direct_fallback,
                read_from,
                snapshots,
            };
            (redis, Some(bus), fleet)
        } else {
            (None, None, 1)
        };
        let report = Report {
            setup: format!(
                "{}slot {}, {}, database {}{}",
                life.as_ref()
                    .map(|l| format!("{}; ", l.describe()))
                    .unwrap_or_default(),
                if let Some(b) = &bus {
                    format!(
                        "bus.slot (permanent), a fleet of {fleet}, bus.max_lag {}, bus.max_direct_fallback {}, bus.read_from {}, {}, {}",
                        b.max_lag,
                        b.max_direct_fallback,
                        b.read_from,
                        match &b.snapshots {
                            Some((_, wait)) => format!("snapshots (bus.snapshot_wait {wait})"),
                            None => "no snapshots".into(),
                        },
                        match (&redis, &site_slot) {
                            (Some(r), _) => format!("redis-server on port {}", r.port),
                            (None, Some(site)) => format!(
                                "Redis Sentinel (primary on port {}, replica on {}, sentinels on {:?})",
                                site.primary.port,
                                site.replica.port,
                                site.sentinels.iter().map(|(_, p)| *p).collect::<Vec<_>>()
                            ),
                            (None, None) => unreachable!(),
                        }
                    )
                } else if !opts.feed.is_wal() {
                    "none".to_string()
                } else if permanent {
                    "permanent".to_string()
                } else {
                    "temporary".to_string()
                },
                match replica_dbs.len() {
                    0 => "no replica".to_string(),
                    n => format!("{n} read replicas"),
                },
                db.name,
                if prepared == "0" {
                    ", max_prepared_transactions = 0: no PREPARE TRANSACTION (scripts/pg.sh sets it)"
                } else if opts.feed == Feed::Notify {
                    ", no PREPARE TRANSACTION (refused after NOTIFY)"
                } else {
                    ""
                }
            ),
            ..Report::default()
        };
        let shared = Arc::new(Shared {
            epoch: Instant::now(),
            model: Mutex::new(Model::default()),
            gws: RwLock::new(Vec::new()),
            violations: Mutex::new(Vec::new()),
            journal: Mutex::new(Vec::new()),
            flagged: Mutex::new(HashSet::new()),
            checks: AtomicU64::new(0),
            unavailable: AtomicU64::new(0),
            kept: AtomicU64::new(0),
            identity_excuse: Mutex::new(None),
            publication_excuse: Mutex::new(None),
            stop: AtomicBool::new(false),
            trace: opts.trace,
        });
        shared.note(format!(
            "history seed={} feed={} faults={:?}: {}",
            opts.seed,
            opts.feed.name(),
            opts.faults.iter().map(|f| f.name()).collect::<Vec<_>>(),
            report.setup
        ));
        let mut w = World {
            opts,
            shared,
            db,
            writer,
            writes,
            slot,
            replica_dbs,
            replica_admin: None,
            paused: None,
            marker: 0,
            step: 0,
            due: Vec::new(),
            next_gw: 0,
            next_part: 1,
            columns_added: 0,
            open_publication: false,
            open_identity: false,
            open_second: false,
            redis,
            bus,
            fleet,
            open_redis: false,
            redis_back_at: Duration::ZERO,
            site: site_slot,
            sentinel_rng,
            snapshot_rng,
            redis_rng,
            split: false,
            assume_rng,
            wal_writer: None,
            copy: None,
            failover: None,
            life,
            report,
            readers: Vec::new(),
        };
        // The rows before the gateway starts, and probes that never exist.
        let mut paths = Vec::new();
        for s in w.writes.initial(30) {
            w.writer.execute(s.sql.as_str()).await.unwrap();
            paths.extend(s.paths);
        }
        let absent = w.writes.absent(6);
        paths.extend(absent.iter().cloned());
        let truth = read_back(&mut w.writer, &paths).await.unwrap();
        {
            let mut m = w.shared.model.lock().unwrap();
            for (p, body) in truth {
                m.initial(p, body);
            }
        }
        for url in w.replica_dbs.clone() {
            if !w.replica_has_database(&url).await {
                // Paused or stopped by another test on the shared server:
                // the gateway's pools would not start on it.
                let why = format!(
                    "replica {url} is paused or has not replayed the new database in 15 s: no replicas in this history"
                );
                eprintln!("truth: seed {}: {why}", w.opts.seed);
                w.shared.note(why);
                w.report
                    .setup
                    .push_str(" (replicas not in step: none used)");
                w.replica_dbs.clear();
                break;
            }
        }
        if let Some(url) = w.replica_dbs.last() {
            // The last one is paused by the replica fault: the second
            // replica is the checker's alone, the first is shared with
            // tests/it/db/replicas.rs, which pauses and stops it itself.
            let admin = url.rsplit_once('/').unwrap().0.to_string() + "/postgres";
            let pool = PgPoolOptions::new()
                .max_connections(1)
                .connect(&admin)
                .await
                .unwrap();
            w.replica_admin = Some((pool, admin));
        }
        let first = w.spawn_gateway("first");
        let began = Instant::now();
        while first.ready_at.lock().unwrap().is_none() {
            if let Some((e, _)) = first.failed.lock().unwrap().clone() {
                w.shared
                    .violation(format!("gw{} did not start: {e}", first.id));
                return w;
            }
            if began.elapsed() > Duration::from_secs(60) {
                w.shared
                    .violation(format!("gw{} not started after 60 s", first.id));
                return w;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // The rest of the fleet, compared once each says ready.
        for _ in 1..w.fleet {
            w.spawn_gateway("fleet");
        }
        for _ in 0..READERS {
            let rng = w.writes.rng.fork();
            w.readers.push(tokio::spawn(reader(w.shared.clone(), rng)));
        }
        w
    }

    /// Whether the replica at `url` (this database on it) has replayed
    /// the seeded rows within 15 s; at once `false` if someone paused its
    /// replay.
    async fn replica_has_database(&mut self, url: &str) -> bool {
        let want = self.writes.shadow.users.len() as i64;
        let server = url.rsplit_once('/').unwrap().0.to_string() + "/postgres";
        if let Ok(mut c) = PgConnection::connect(&server).await {
            let paused: Result<bool, _> = sqlx::query_scalar("SELECT pg_is_wal_replay_paused()")
                .fetch_one(&mut c)
                .await;
            if paused.unwrap_or(false) {
                return false;
            }
        }
        let began = Instant::now();
        while began.elapsed() < Duration::from_secs(15) {
            if let Ok(mut c) = PgConnection::connect(url).await {
                let n: Result<i64, _> = sqlx::query_scalar("SELECT count(*) FROM users")
                    .fetch_one(&mut c)
                    .await;
                if n.is_ok_and(|n| n == want) {
                    return true;
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        false
    }

    fn setup_config(&self) -> bloomgate::config::Config {
        schema::config(&Setup {
            url: &self.db.url,
            feed: self.opts.feed,
            slot: self.slot.as_deref().filter(|_| self.bus.is_none()),
            replicas: &self.replica_dbs,
            bus: self.bus.as_ref(),
        })
    }

    /// A new gateway, starting in the background (503 until ready).
    fn spawn_gateway(&mut self, why: &str) -> Arc<Gw> {
        // Two workers each, as a small process of its own would have:
        // every gateway on a runtime of its own, so that `kill-relay` can
        // end one as a crash does and `pause` stop one as SIGSTOP does.
        let rt = Some(
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                // The log's thread names say which gateway wrote a line.
                .thread_name(format!("truth-gw{}", self.next_gw + 1))
                .enable_all()
                .build()
                .unwrap(),
        );
        let handle = rt.as_ref().map(|rt| rt.handle().clone());
        // Its pools and their tasks belong to the runtime it is made in.
        let entered = handle.as_ref().map(|h| h.enter());
        let gw = Gateway::new(self.setup_config(), &Default::default()).unwrap();
        let app = bloomgate::http::app(gw.clone());
        drop(entered);
        self.next_gw += 1;
        let g = Arc::new(Gw {
            id: self.next_gw,
            gw,
            app,
            retired: AtomicBool::new(false),
            ready_at: Mutex::new(None),
            failed: Mutex::new(None),
            start: Mutex::new(None),
            rt: Mutex::new(rt),
            handle,
        });
        let (g2, shared) = (g.clone(), self.shared.clone());
        let started = async move {
            match g2.gw.start().await {
                Ok(()) => {
                    *g2.ready_at.lock().unwrap() = Some(shared.now());
                    shared.note(format!("gw{} started", g2.id));
                }
                Err(e) => {
                    shared.note(format!("gw{} failed to start: {e}", g2.id));
                    let e = e.to_string();
                    let now = shared.now();
                    let open = |excuse: &Mutex<Option<Duration>>| {
                        excuse.lock().unwrap().is_some_and(|until| now < until)
                    };
                    let excused = (e.contains("a replica identity without it")
                        && open(&shared.identity_excuse))
                        || (e.contains("publication") && open(&shared.publication_excuse));
                    *g2.failed.lock().unwrap() = Some((e, excused));
                }
            }
        };
        let task = match &g.handle {
            Some(h) => h.spawn(started),
            None => tokio::spawn(started),
        };
        *g.start.lock().unwrap() = Some(task);
        self.shared.gws.write().unwrap().push(g.clone());
        self.shared.note(format!("gw{} starting ({why})", g.id));
        g
    }

    /// Takes `g` out of the running gateways, its count of filters kept
    /// across a promotion into the history's.
    fn leave(&self, g: &Arc<Gw>) {
        g.retired.store(true, Ordering::SeqCst);
        self.shared
            .gws
            .write()
            .unwrap()
            .retain(|x| !Arc::ptr_eq(x, g));
        self.shared.kept.fetch_add(kept(g), Ordering::Relaxed);
    }

    fn retire(&self, g: &Arc<Gw>) {
        self.leave(g);
        if let Some(t) = g.start.lock().unwrap().take() {
            t.abort();
        }
        {
            // `stop` gives the tasks a second on the runtime it runs in.
            let _in = g.handle.as_ref().map(|h| h.enter());
            g.gw.stop();
        }
        if let Some(rt) = g.rt.lock().unwrap().take() {
            // Whatever is left after the graceful stop's second goes with
            // the runtime; on a thread of its own, as a runtime must not be
            // dropped on another's.
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_secs(2));
                rt.shutdown_background();
            });
        }
        self.shared.note(format!("gw{} stopped", g.id));
    }

    /// Ends `g` as a crash would (`SIGKILL` where it is a process): its
    /// runtime shut down at once, every task dropped at the await it
    /// stands at, no shutdown signal, so none of its graceful paths run
    /// (no last append, no slot confirmed, no goodbye); dropping its
    /// connections closes their sockets, as the kernel closes a killed
    /// process's. Only gateways with a runtime of their own (the bus).
    fn kill(&self, g: &Arc<Gw>) {
        self.leave(g);
        let rt = g.rt.lock().unwrap().take();
        rt.expect("kill: a gateway on a runtime of its own")
            .shutdown_background();
        self.shared.note(format!("gw{} killed", g.id));
    }

    fn now(&self) -> Duration {
        self.shared.now()
    }

    /// Where the writer connects: the current primary, directly.
    fn writer_url(&self) -> String {
        match &self.life {
            Some(l) => l.writer_url(&self.db.name),
            None => self.db.url.clone(),
        }
    }

    fn violations(&self) -> usize {
        self.shared.violations.lock().unwrap().len()
    }

    async fn main(&mut self) {
        // The lifecycle's faults are drawn from the cluster's own stream,
        // so that the others are drawn as before they existed.
        let mut faults: Vec<Fault> = self
            .opts
            .faults
            .iter()
            .copied()
            .filter(|f| {
                !f.is_lifecycle()
                    && !f.is_assumption()
                    && !matches!(
                        f,
                        Fault::RedisFailover
                            | Fault::DamagedSnapshots
                            | Fault::FailoverKeptSlot
                            | Fault::RedisRefuses
                            | Fault::SplitBrain
                    )
            })
            .collect();
        faults.sort_by_key(|f| f.name());
        let mut lifecycle: Vec<Fault> = self
            .opts
            .faults
            .iter()
            .copied()
            .filter(|f| f.is_lifecycle())
            .collect();
        // `failover-kept-slot` is a way a failover goes (see
        // `life::kept_slot_draw`): selected alone, it plays failovers.
        if self.life.as_ref().is_some_and(|l| l.kept.is_some())
            && !lifecycle.contains(&Fault::Failover)
        {
            lifecycle.push(Fault::Failover);
        }
        for round in 0..self.opts.rounds {
            let steps = self.writes.rng.range(15, 35);
            // Early in the round, so that writes follow the fault.
            let mut fault = if !faults.is_empty() && self.writes.rng.chance(85) {
                Some((
                    self.writes.rng.below(steps / 2 + 1),
                    *self.writes.rng.pick(&faults),
                ))
            } else {
                None
            };
            // `redis-failover` from the Sentinel stream (see
            // [`sentinel_draw`]), for the same reason.
            if let Some(r) = &mut self.sentinel_rng
                && self.opts.faults.contains(&Fault::RedisFailover)
                && (faults.is_empty() || r.chance(50))
            {
                fault = Some((r.below(steps / 2 + 1), Fault::RedisFailover));
            }
            if let Some(l) = &mut self.life
                && !lifecycle.is_empty()
                && ((faults.is_empty() && self.sentinel_rng.is_none()) || l.rng.chance(60))
            {
                fault = Some((l.rng.below(steps / 2 + 1), *l.rng.pick(&lifecycle)));
            }
            // What was assumed, from its own stream (see `assumption_draw`).
            let on_cluster = self.life.is_some();
            let assumptions: Vec<Fault> = self
                .opts
                .faults
                .iter()
                .copied()
                .filter(|f| f.is_assumption() && (on_cluster || !f.needs_cluster()))
                .collect();
            if let Some(a) = &mut self.assume_rng
                && !assumptions.is_empty()
                && self.opts.in_turn
            {
                fault = Some((
                    a.below(steps / 2 + 1),
                    assumptions[round % assumptions.len()],
                ));
            } else if let Some(a) = &mut self.assume_rng
                && !assumptions.is_empty()
                && ((fault.is_none() && faults.is_empty() && lifecycle.is_empty()) || a.chance(40))
            {
                fault = Some((a.below(steps / 2 + 1), *a.pick(&assumptions)));
            }
            // Damaged snapshots, from the snapshots' own stream.
            if let Some(r) = &mut self.snapshot_rng
                && self.opts.faults.contains(&Fault::DamagedSnapshots)
                && ((fault.is_none() && faults.is_empty()) || r.chance(33))
            {
                fault = Some((r.below(steps / 2 + 1), Fault::DamagedSnapshots));
            }
            // Redis refusing the relay, from its own stream (see
            // [`redis_draw`]).
            let refusal = match self.site {
                Some(_) => Fault::SplitBrain,
                None => Fault::RedisRefuses,
            };
            if let Some(r) = &mut self.redis_rng
                && self.opts.faults.contains(&refusal)
                && ((fault.is_none() && faults.is_empty()) || r.chance(30))
            {
                fault = Some((r.below(steps / 2 + 1), refusal));
            }
            for s in 0..steps {
                self.run_due(false).await;
                if let Some((at, f)) = fault
                    && at == s
                {
                    self.inject(f).await;
                }
                let step = self.writes.step();
                self.exec(step).await;
                self.report.ops += 1;
                self.step += 1;
                let pause = self.writes.rng.below(4) as u64;
                tokio::time::sleep(Duration::from_millis(pause)).await;
            }
            self.quiesce(&format!("round {round}")).await;
            if self.violations() > 0 && !self.opts.keep_going {
                // The round's picture is complete; later rounds would only
                // pile up consequences.
                self.shared
                    .note("stopping the history at its first violations".into());
                return;
            }
        }
        // Everything repairable repaired: the last comparison is strict.
        self.run_due(true).await;
        self.end_lifecycle().await;
        self.quiesce("final").await;
    }

    async fn run_due(&mut self, all: bool) {
        self.due.sort_by_key(|(at, _)| *at);
        while let Some(&(at, action)) = self.due.first() {
            if !all && at > self.step {
                break;
            }
            self.due.remove(0);
            self.act(action).await;
        }
    }

    fn later(&mut self, lo: usize, hi: usize, action: Action) {
        let at = self.step + self.writes.rng.range(lo, hi) as u64;
        self.due.push((at, action));
    }

    /// Runs `step`, retrying it when Postgres aborts it (see `try_exec`).
    async fn exec(&mut self, step: Step) {
        if self.opts.trace {
            eprintln!(
                "truth: t={} step {} {:?}",
                secs(self.now()),
                step.kind,
                step.parts
            );
        }
        // Drawn once: a retry must not move the seed's sequence.
        let pause = match step.end {
            End::Prepared { .. } => self.writes.rng.below(20) as u64,
            End::Commit => 0,
        };
        let paths = step.paths();
        let mut attempt = 0;
        loop {
            let Err(e) = self.try_exec(&step, &paths, pause).await else {
                return;
            };
            let _ = self.writer.execute("ROLLBACK").await;
            self.shared.model.lock().unwrap().aborted();
            // What an application would see too: a deadlock with a
            // gateway's DDL at start-up, say. Retried, and counted.
            attempt += 1;
            if !aborted(&e) || attempt > 10 {
                panic!("seed {}: {step:?}: {e}", self.opts.seed);
            }
            self.report.writer_aborts += 1;
            self.shared.note(format!(
                "the writer's transaction was aborted, retried: {e}"
            ));
        }
    }

    /// One transaction: its statements, what it makes of every path it
    /// touched (read inside it, so exactly what it commits), then the
    /// commit, recorded around it.
    async fn try_exec(
        &mut self,
        step: &Step,
        paths: &[Path],
        pause: u64,
    ) -> Result<(), sqlx::Error> {
        let c = &mut self.writer;
        c.execute("BEGIN").await?;
        for part in &step.parts {
            match part {
                Part::Stmt(s) => {
                    c.execute(s.sql.as_str()).await?;
                }
                Part::RolledBack(ss) => {
                    c.execute("SAVEPOINT s").await?;
                    for s in ss {
                        c.execute(s.sql.as_str()).await?;
                    }
                    c.execute("ROLLBACK TO SAVEPOINT s").await?;
                }
            }
        }
        let changes = read_back(c, paths).await?;
        let model = &self.shared.model;
        match &step.end {
            End::Commit => {
                model.lock().unwrap().stage(self.shared.now(), changes);
                c.execute("COMMIT").await?;
                model.lock().unwrap().committed(self.shared.now());
            }
            End::Prepared { gid, commit } => {
                c.execute(format!("PREPARE TRANSACTION '{gid}'").as_str())
                    .await?;
                // Readers read while it is prepared: nothing may show.
                tokio::time::sleep(Duration::from_millis(pause)).await;
                if *commit {
                    model.lock().unwrap().stage(self.shared.now(), changes);
                    c.execute(format!("COMMIT PREPARED '{gid}'").as_str())
                        .await?;
                    model.lock().unwrap().committed(self.shared.now());
                } else {
                    c.execute(format!("ROLLBACK PREPARED '{gid}'").as_str())
                        .await?;
                }
            }
        }
        Ok(())
    }

    /// The marker write, then every gateway that should serve is waited
    /// for (ready, applied past the marker), then the fault windows are
    /// let close, then every path is compared on every ready gateway.
    async fn quiesce(&mut self, label: &str) {
        // A look at the address a cut-over silenced speaks again, and the
        // cut-over's window closes on its bound from now.
        let now = self.now();
        if let Some(life) = self.life.as_mut()
            && life.look_held
        {
            life.proxy.unstall();
            life.look_held = false;
            self.shared
                .model
                .lock()
                .unwrap()
                .close_window("cut-over", now + life::ADDRESS_BOUND + FEED_GAP);
        }
        // An open failover or outage ends first: gateways that cannot
        // reach the database cannot catch up. So does a lost bus where no
        // gateway may fall back to a direct feed (`max_direct_fallback`
        // 0): none can be vouched for until Redis is back, by design.
        let no_fallback = self
            .bus
            .as_ref()
            .is_some_and(|b| b.max_direct_fallback == 0);
        let ends_first = |a: &Action| {
            matches!(a, Action::Promote | Action::Restore | Action::RedisAccepts)
                || (no_fallback && matches!(a, Action::RedisBack(_)))
        };
        let ends: Vec<Action> = self
            .due
            .iter()
            .filter(|(_, a)| ends_first(a))
            .map(|(_, a)| *a)
            .collect();
        self.due.retain(|(_, a)| !ends_first(a));
        // So does a Redis failover: the gateways cannot be back on the bus
        // before the sentinels have promoted the replica, and its window
        // from the promotion must be open before the comparison waits it
        // out.
        if self.failover.is_some() {
            self.due
                .retain(|(_, a)| !matches!(a, Action::FailoverKill | Action::RedisPromoted));
            if self.failover == Some(None) {
                self.failover_kill().await;
            }
            self.failover_promoted(true).await;
        }
        for a in ends {
            if let Action::RedisBack(_) = a {
                // Down as long as the fault drew.
                let now = self.now();
                if self.redis_back_at > now {
                    tokio::time::sleep(self.redis_back_at - now).await;
                }
            }
            self.act(a).await;
        }
        let (marker, lsn) = self.write_marker().await;
        self.shared
            .note(format!("{label}: quiescence, marker {marker} at {lsn}"));
        let mut ready = Vec::new();
        for g in self.ready_gateways(label).await {
            self.caught_up(&g, label).await;
            ready.push(g);
        }
        let open = self.shared.model.lock().unwrap().still_open();
        if !open.is_empty() {
            self.shared.violation(format!(
                "{label}: checker: compared while {open:?} is still open"
            ));
        }
        let quiet = self.shared.model.lock().unwrap().quiet_from();
        let now = self.now();
        if quiet > now {
            tokio::time::sleep(quiet - now).await;
        }
        tokio::time::sleep(SETTLE).await;
        self.compare(&ready, label).await;
        if self.site.is_some() {
            // Whether a failover lost entries shows here: a continuity
            // break (a resync) on each consumer that had read them.
            for g in &ready {
                if let Some(b) = g.gw.bus_status() {
                    let c = b.counters();
                    self.shared.note(format!(
                        "{label}: gw{} on the bus: {:?}, breaks {}, fallbacks {}, returns {}, terms as relay {}",
                        g.id,
                        b.get().mode,
                        c.breaks,
                        c.fallbacks,
                        c.returns,
                        c.terms
                    ));
                }
            }
        }
    }

    /// A new marker row, and the WAL insert position read just before its
    /// COMMIT: the commit record ends past it, so a gateway whose applied
    /// LSN reaches it has applied the marker and (commit order) every
    /// write before it.
    async fn write_marker(&mut self) -> (i64, Position) {
        self.marker += 1;
        for attempt in 0.. {
            match self.try_marker().await {
                Ok(lsn) => return (self.marker, lsn),
                Err(e) if aborted(&e) && attempt < 10 => {
                    let _ = self.writer.execute("ROLLBACK").await;
                    self.report.writer_aborts += 1;
                    self.shared
                        .note(format!("the marker write was aborted, retried: {e}"));
                }
                Err(e) => panic!("seed {}: the marker write: {e}", self.opts.seed),
            }
        }
        unreachable!()
    }

    async fn try_marker(&mut self) -> Result<Position, sqlx::Error> {
        let c = &mut self.writer;
        c.execute("BEGIN").await?;
        sqlx::query("INSERT INTO marker VALUES ($1)")
            .bind(self.marker)
            .execute(&mut *c)
            .await?;
        // The position with its timeline, as the gateway publishes what it
        // applied (`Gateway::applied`): comparable only on one timeline.
        let (lsn, file, system): (String, String, String) = sqlx::query_as(
            "SELECT l::text, pg_walfile_name(l), (SELECT system_identifier::text FROM pg_control_system())
               FROM (SELECT pg_current_wal_insert_lsn() AS l) i",
        )
        .fetch_one(&mut *c)
        .await?;
        c.execute("COMMIT").await?;
        let timeline = Timeline {
            system: system.parse().unwrap(),
            id: u32::from_str_radix(&file[..8], 16).unwrap(),
        };
        Ok(Position::new(timeline, Lsn::parse(&lsn).unwrap()))
    }

    /// The gateways to compare: those that say ready once one does. One
    /// must within `NOT_READY_LIMIT`; the others may wait (a second
    /// gateway for the slot the first holds, one still starting).
    async fn ready_gateways(&mut self, label: &str) -> Vec<Arc<Gw>> {
        let began = Instant::now();
        loop {
            let live = self.shared.live();
            let mut ready = Vec::new();
            let mut refused = Vec::new();
            for g in &live {
                if let Some((e, excused)) = g.failed.lock().unwrap().take() {
                    if excused {
                        // The documented refusal of a gateway started while
                        // the replica-identity fault has `users` without
                        // its old email or id, or the publication fault
                        // has the publication without a served table
                        // (`install_feed` is off): right, not a violation.
                        // Replaced, as a supervisor would restart it. The
                        // same refusal once the repair is past `WATCHED`
                        // is one.
                        refused.push(g.clone());
                    } else {
                        self.shared
                            .violation(format!("{label}: gw{} failed to start: {e}", g.id));
                    }
                }
                if is_ready(g).await {
                    ready.push(g.clone());
                }
            }
            for g in refused {
                self.shared.note(format!(
                    "{label}: gw{} refused to start while a fault had what the feed needs (replica-identity, publication)",
                    g.id
                ));
                self.retire(&g);
                self.spawn_gateway("replaces one that refused to start");
            }
            if !ready.is_empty() || live.is_empty() {
                for g in live
                    .iter()
                    .filter(|g| !ready.iter().any(|r| Arc::ptr_eq(r, g)))
                {
                    self.shared
                        .note(format!("{label}: gw{} not ready: not compared", g.id));
                }
                return ready;
            }
            if began.elapsed() > NOT_READY_LIMIT {
                self.shared.violation(format!(
                    "{label}: no gateway has said ready for {} s",
                    NOT_READY_LIMIT.as_secs()
                ));
                return ready;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Reports `g` unless it applies a marker write within
    /// `CATCH_UP_LIMIT`.
    async fn caught_up(&mut self, g: &Arc<Gw>, label: &str) {
        let began = Instant::now();
        let mut applied = g.gw.applied();
        let (mut marker, mut lsn) = self.write_marker().await;
        let mut written = Instant::now();
        loop {
            let lsn_reached = !self.opts.feed.is_wal() || applied.borrow_and_update().reaches(&lsn);
            let url = format!("/marker/{marker}");
            if lsn_reached && matches!(get(g, &url).await, Answer::Row(..)) {
                return;
            }
            if began.elapsed() > CATCH_UP_LIMIT {
                self.shared.violation(format!(
                    "{label}: gw{} says ready but has not applied a marker write (applied {}, marker at {lsn}, GET {url} {}) within {} s",
                    g.id,
                    *applied.borrow(),
                    get(g, &url).await.show(),
                    CATCH_UP_LIMIT.as_secs()
                ));
                // Compared anyway: what it serves says what it missed.
                return;
            }
            // A feed that resynced (a new temporary slot) never delivers
            // the commits before its new slot: the rebuild covers them. A
            // later marker is delivered once it streams again.
            if written.elapsed() > Duration::from_millis(500) {
                (marker, lsn) = self.write_marker().await;
                written = Instant::now();
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    async fn compare(&mut self, gws: &[Arc<Gw>], label: &str) {
        let paths = self.shared.model.lock().unwrap().paths.clone();
        // The writer's connection: it is on the current primary, also after
        // a failover.
        let truth = read_back(&mut self.writer, &paths).await.unwrap();
        {
            let m = self.shared.model.lock().unwrap();
            for (p, body) in &truth {
                assert_eq!(
                    m.latest(p),
                    body.as_ref(),
                    "the checker's model lost track of {} (seed {}): a bug in tests/truth",
                    p.url(),
                    self.opts.seed
                );
            }
        }
        let mut wrong = 0;
        for g in gws {
            let answers: Vec<(usize, Answer)> =
                futures_util::stream::iter(truth.iter().enumerate())
                    .map(|(i, (p, _))| {
                        let g = g.clone();
                        async move {
                            let url = p.url();
                            let mut a = get(&g, &url).await;
                            for _ in 0..3 {
                                if !matches!(a, Answer::Unavailable) {
                                    break;
                                }
                                tokio::time::sleep(Duration::from_millis(100)).await;
                                a = get(&g, &url).await;
                            }
                            (i, a)
                        }
                    })
                    .buffer_unordered(8)
                    .collect()
                    .await;
            let mut unavailable = 0;
            for (i, a) in answers {
                let (p, want) = &truth[i];
                if matches!(a, Answer::Unavailable) {
                    unavailable += 1;
                    continue;
                }
                self.shared.checks.fetch_add(1, Ordering::Relaxed);
                // Every outage has ended by now: nothing may be stale.
                let ok = !matches!(a, Answer::Other(..)) && a.body() == want.as_ref() && !a.stale();
                if !ok {
                    wrong += 1;
                    let history = self.shared.model.lock().unwrap().describe(p);
                    self.shared.violation(format!(
                        "{label}: gw{} GET {} -> {}; Postgres: {} (versions: {history})",
                        g.id,
                        p.url(),
                        a.show(),
                        want.as_ref()
                            .map(|v| v.to_string())
                            .unwrap_or_else(|| "404".into()),
                    ));
                }
            }
            if unavailable > 0 {
                self.shared
                    .unavailable
                    .fetch_add(unavailable, Ordering::Relaxed);
                self.shared.note(format!(
                    "{label}: gw{} answered 503 for {unavailable} paths at quiescence",
                    g.id
                ));
            }
        }
        self.shared.note(format!(
            "{label}: compared {} paths on {} gateways: {wrong} wrong",
            truth.len(),
            gws.len()
        ));
    }

    async fn teardown(mut self) -> Report {
        self.shared.stop.store(true, Ordering::SeqCst);
        for r in self.readers.drain(..) {
            let _ = r.await;
        }
        for g in self.shared.live() {
            self.retire(&g);
        }
        if let Some((key, _)) = self.bus.as_ref().and_then(|b| b.snapshots.as_ref()) {
            let _ = std::fs::remove_file(key);
        }
        if let Some(r) = self.paused.take() {
            r.resume().await;
        }
        // The database cannot be dropped while a prepared transaction or
        // a replication slot (permanent, or a temporary one whose
        // walsender has not exited yet) is on it.
        let gids: Vec<String> = sqlx::query_scalar(
            "SELECT gid FROM pg_prepared_xacts WHERE database = current_database()",
        )
        .fetch_all(&mut self.writer)
        .await
        .unwrap_or_default();
        for gid in gids {
            let _ = self
                .writer
                .execute(format!("ROLLBACK PREPARED '{gid}'").as_str())
                .await;
        }
        let began = Instant::now();
        loop {
            let _ = self
                .writer
                .execute(
                    "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots \
                     WHERE database = current_database() AND active_pid IS NOT NULL",
                )
                .await;
            let _ = self
                .writer
                .execute(
                    "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots \
                     WHERE database = current_database() AND NOT active AND NOT temporary",
                )
                .await;
            let left: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_replication_slots WHERE database = current_database()",
            )
            .fetch_one(&mut self.writer)
            .await
            .unwrap_or(0);
            if left == 0 || began.elapsed() > Duration::from_secs(10) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let mut report = std::mem::take(&mut self.report);
        report.checks = self.shared.checks.load(Ordering::Relaxed);
        report.unavailable = self.shared.unavailable.load(Ordering::Relaxed);
        report.kept = self.shared.kept.load(Ordering::Relaxed)
            + self
                .shared
                .gws
                .read()
                .unwrap()
                .iter()
                .map(kept)
                .sum::<u64>();
        report.violations = std::mem::take(&mut *self.shared.violations.lock().unwrap());
        report.journal = std::mem::take(&mut *self.shared.journal.lock().unwrap());
        report
    }
}

/// The filters `g`'s resources kept across a promotion.
fn kept(g: &Arc<Gw>) -> u64 {
    g.gw.resources
        .iter()
        .map(|r| r.stats.kept_across_failover.load(Ordering::Relaxed))
        .sum()
}

/// Whether a bus history runs on Redis Sentinel, and if so the stream it
/// draws its failovers from: one of its own (the seed mixed with
/// [`SENTINEL_DRAW`]), so that the seeds' other choices, CI's among them,
/// stay what they were before the fault existed. Never without
/// `redis-failover` or `redis-split-brain` among the faults; always when
/// they are the only ones on the bus (a replay of one alone plays it), else
/// half the seeds. Its failovers only with `redis-failover`.
fn sentinel_draw(opts: &Opts) -> Option<Rng> {
    let on_sentinel = |f: &Fault| matches!(f, Fault::RedisFailover | Fault::SplitBrain);
    if opts.feed != Feed::Bus || !opts.faults.iter().any(on_sentinel) {
        return None;
    }
    let mut rng = Rng::new(opts.seed ^ SENTINEL_DRAW);
    let drawn = rng.chance(50);
    let only = opts
        .faults
        .iter()
        .all(|f| on_sentinel(f) || f.is_lifecycle());
    (drawn || only).then_some(rng)
}

/// The stream `redis-refuses` and `redis-split-brain` are drawn from: one
/// of its own (the seed mixed with [`REDIS_DRAW`]), so that the seeds' other
/// choices, CI's among them, stay what they were before these faults
/// existed. Every bus history that has them.
fn redis_draw(opts: &Opts) -> Option<Rng> {
    let has =
        opts.faults.contains(&Fault::RedisRefuses) || opts.faults.contains(&Fault::SplitBrain);
    (opts.feed == Feed::Bus && has).then(|| Rng::new(opts.seed ^ REDIS_DRAW))
}

/// Whether a bus history's fleet shares snapshots (`bus.fleet_key_file`),
/// and the stream `damaged-snapshots` and the snapshots' settings are
/// drawn from: one of its own (the seed mixed with [`SNAPSHOT_DRAW`]), so
/// that the seeds' other choices stay what they were before snapshots
/// existed. Half the bus seeds; always when `damaged-snapshots` is the only
/// fault selected.
fn snapshot_draw(opts: &Opts) -> Option<Rng> {
    if opts.feed != Feed::Bus {
        return None;
    }
    let mut rng = Rng::new(opts.seed ^ SNAPSHOT_DRAW);
    let drawn = rng.chance(50);
    let only = opts.faults.iter().all(|f| *f == Fault::DamagedSnapshots);
    (drawn || only).then_some(rng)
}

/// The stream of choices the faults of what was assumed (`rewrite`, `pause`,
/// `wal-writer`, `restore`, `cut-over`) are drawn from: one of its own (the
/// seed mixed with [`ASSUMPTION_DRAW`]), so that the seeds' other choices, CI's
/// among them, stay what they were before these faults existed. On half the
/// seeds; always when the faults selected are all of them.
fn assumption_draw(opts: &Opts) -> Option<Rng> {
    if !opts.faults.iter().any(|f| f.is_assumption()) {
        return None;
    }
    let mut rng = Rng::new(opts.seed ^ ASSUMPTION_DRAW);
    let drawn = rng.chance(50);
    let only = opts.faults.iter().all(|f| f.is_assumption());
    (drawn || only).then_some(rng)
}

/// Whether Postgres aborted the transaction for a deadlock or a
/// serialization failure: retrying it is what an application would do.
fn aborted(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(d) => matches!(d.code().as_deref(), Some("40P01" | "40001")),
        _ => false,
    }
}

/// Drops the permanent slots of histories whose process is gone (a panic
/// skips the teardown): on the shared primary they would keep WAL for
/// ever. Named `truth_<pid>_…`; a live process's slots are left alone.
async fn drop_stale_slots(c: &mut PgConnection) {
    let slots: Vec<String> = sqlx::query_scalar(
        "SELECT slot_name FROM pg_replication_slots WHERE slot_name LIKE 'truth\\_%' AND NOT active",
    )
    .fetch_all(&mut *c)
    .await
    .unwrap_or_default();
    for slot in slots {
        let pid = slot.split('_').nth(1).unwrap_or_default();
        if !pid.is_empty() && !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = sqlx::query("SELECT pg_drop_replication_slot($1)")
                .bind(&slot)
                .execute(&mut *c)
                .await;
        }
    }
}

/// What Postgres has for each of `paths`, as seen by `c`.
async fn read_back(
    c: &mut PgConnection,
    paths: &[Path],
) -> Result<Vec<(Path, Option<Value>)>, sqlx::Error> {
    let mut by_res: BTreeMap<Res, Vec<String>> = BTreeMap::new();
    for p in paths {
        by_res.entry(p.res).or_default().push(p.key.clone());
    }
    let mut found = BTreeMap::new();
    for (res, keys) in by_res {
        let rows = schema::fetch(c, res, &keys).await?;
        found.insert(res, rows);
    }
    Ok(paths
        .iter()
        .map(|p| (p.clone(), found[&p.res].get(&p.key).cloned()))
        .collect())
}
