//! The bus (`[bus]`, `feed::bus`): a fleet of gateways on one Redis stream
//! with one walsender on the primary. Real servers: each test starts its
//! own `redis-server` on a free port, and uses the throwaway
//! `wal_level = logical` primary of `scripts/test.sh`. Gateways run in
//! process, and as the release binary where a test kills or stops one
//! (`SIGKILL`, `SIGSTOP`).

mod common;

use std::net::TcpListener as StdListener;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use bloomgate::config::Config;
use bloomgate::feed::bus::Mode;
use bloomgate::gateway::Gateway;
use common::*;

/// Tests that count walsenders or kill servers run one at a time.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Ten users; the by-email route needs the old email on UPDATE and DELETE.
async fn bus_db() -> TestDb {
    let db = logical_db(10).await;
    db.exec("ALTER TABLE users REPLICA IDENTITY FULL").await;
    db
}

fn free_port() -> u16 {
    StdListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A `redis-server` of this test's own, without persistence.
struct Redis {
    child: Option<Child>,
    port: u16,
}

impl Redis {
    async fn start() -> Self {
        Self::start_on(free_port()).await
    }

    async fn start_on(port: u16) -> Self {
        let bin = std::env::var("BLOOMGATE_REDIS_SERVER").unwrap_or_else(|_| "redis-server".into());
        let child = Command::new(bin)
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server: run with scripts/test.sh, which installs it");
        let r = Redis {
            child: Some(child),
            port,
        };
        eventually("redis-server answers", || async {
            r.conn().await.is_some()
        })
        .await;
        r
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    async fn conn(&self) -> Option<redis::aio::MultiplexedConnection> {
        let client = redis::Client::open(self.url()).ok()?;
        let mut c = client.get_multiplexed_async_connection().await.ok()?;
        let pong: String = redis::cmd("PING").query_async(&mut c).await.ok()?;
        (pong == "PONG").then_some(c)
    }

    /// `SIGKILL`: everything it held is gone.
    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// The keys matching `pattern`.
    async fn keys(&self, pattern: &str) -> Vec<String> {
        let mut c = self.conn().await.unwrap();
        redis::cmd("KEYS")
            .arg(pattern)
            .query_async(&mut c)
            .await
            .unwrap()
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A fresh name for this test's slot and key prefix.
fn unique(what: &str) -> String {
    format!("{what}_{:x}", rand::random::<u32>())
}

struct Fleet {
    slot: String,
    prefix: String,
}

impl Fleet {
    fn new() -> Self {
        Fleet {
            slot: unique("bg_bus"),
            prefix: unique("bgtest"),
        }
    }

    fn bus_toml(&self, redis: &Redis) -> String {
        format!(
            "[bus]\nurl = \"{}\"\nslot = \"{}\"\nprefix = \"{}\"\nmax_lag = \"1s\"\n",
            redis.url(),
            self.slot,
            self.prefix
        )
    }

    fn config(&self, db: &TestDb, redis: &Redis) -> Config {
        wal_config(db, &format!("{BY_EMAIL}\n{}", self.bus_toml(redis)))
    }

    async fn stream(&self, redis: &Redis) -> String {
        let began = Instant::now();
        loop {
            let keys: Vec<String> = redis
                .keys(&format!("{}:*", self.prefix))
                .await
                .into_iter()
                .filter(|k| !k.ends_with(":relay"))
                .collect();
            if let Some(k) = keys.into_iter().next() {
                return k;
            }
            assert!(
                began.elapsed() < Duration::from_secs(15),
                "never: the stream"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until the slot is free (its holder gone), then drops it.
    async fn drop_slot(&self, db: &TestDb) {
        eventually("the bus slot released", || async {
            let active: Option<bool> =
                sqlx::query_scalar("SELECT active FROM pg_replication_slots WHERE slot_name = $1")
                    .bind(&self.slot)
                    .fetch_optional(&db.pool)
                    .await
                    .unwrap();
            active != Some(true)
        })
        .await;
        let _ = sqlx::query("SELECT pg_drop_replication_slot($1)")
            .bind(&self.slot)
            .execute(&db.pool)
            .await;
    }
}

/// Walsenders serving this database (the bus's and any direct feed's).
async fn walsenders(db: &TestDb) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_replication r JOIN pg_stat_activity a USING (pid)
         WHERE a.datname = $1",
    )
    .bind(&db.name)
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

fn mode(gw: &Gateway) -> Mode {
    gw.bus_status().unwrap().get().mode
}

fn relaying(gw: &Gateway) -> bool {
    gw.bus_status().unwrap().get().relaying
}

async fn status(gw: &Arc<Gateway>, path: &str) -> StatusCode {
    get(gw, path).await.status
}

async fn wait_all_on_bus(gws: &[Arc<Gateway>]) {
    eventually("every gateway on the bus, one of them relaying", || async {
        gws.iter().all(|g| mode(g) == Mode::Bus) && gws.iter().filter(|g| relaying(g)).count() == 1
    })
    .await;
}

#[tokio::test]
async fn a_fleet_on_the_bus_has_one_walsender_and_every_gateway_stays_fresh() {
    let _one = ONE_AT_A_TIME.lock().await;
    let redis = Redis::start().await;
    let db = bus_db().await;
    let fleet = Fleet::new();
    let mut gws = Vec::new();
    for _ in 0..4 {
        gws.push(started(fleet.config(&db, &redis)).await);
    }
    wait_all_on_bus(&gws).await;
    // Cached before the changes, so a stale row would show.
    for g in &gws {
        assert_eq!(status(g, "/users/3").await, StatusCode::OK);
        assert_eq!(
            status(g, "/users-by-email/u4@example.com").await,
            StatusCode::OK
        );
    }
    db.exec("INSERT INTO users (id, email, name) VALUES (500, 'five@x.org', 'Five')")
        .await;
    db.exec("UPDATE users SET name = 'Renamed' WHERE id = 3")
        .await;
    db.exec("UPDATE users SET email = 'moved4@x.org' WHERE id = 4")
        .await;
    db.exec("DELETE FROM users WHERE id = 2").await;
    for g in &gws {
        eventually("every change fresh on every gateway", || async {
            status(g, "/users/500").await == StatusCode::OK
                && status(g, "/users-by-email/five@x.org").await == StatusCode::OK
                && get(g, "/users/3").await.json()["name"] == "Renamed"
                && status(g, "/users-by-email/moved4@x.org").await == StatusCode::OK
                && status(g, "/users-by-email/u4@example.com").await == StatusCode::NOT_FOUND
                && status(g, "/users/2").await == StatusCode::NOT_FOUND
        })
        .await;
    }
    assert_eq!(
        walsenders(&db).await,
        1,
        "one walsender for the whole fleet"
    );
    for g in &gws {
        let s = g.bus_status().unwrap();
        assert_eq!(s.fallbacks.load(Ordering::Relaxed), 0);
        assert_eq!(s.breaks.load(Ordering::Relaxed), 0);
        eventually("every gateway ready", || async { g.is_ready() }).await;
    }
    // The stream holds what the relay appended: commits keyed by LSN.
    let stream = fleet.stream(&redis).await;
    let mut c = redis.conn().await.unwrap();
    let len: u64 = redis::cmd("XLEN")
        .arg(&stream)
        .query_async(&mut c)
        .await
        .unwrap();
    assert!(len >= 4, "{len} entries");
    for g in &gws {
        g.stop();
    }
    fleet.drop_slot(&db).await;
}

/// Commits appended again are refused, and the position rules hold, on the
/// real Redis (the Lua script).
#[tokio::test]
async fn the_stream_refuses_a_commit_appended_twice_and_chains_every_entry() {
    use bloomgate::feed::bus::redis::RedisBus;
    use bloomgate::feed::bus::{Appended, Bus, Entry, Position};
    use bloomgate::feed::{Commit, Lsn, Phase, Resync};
    let redis = Redis::start().await;
    let mut bus = RedisBus::new(&redis.url(), "t:stream".into(), 1000).unwrap();
    assert_eq!(bus.head().await.unwrap(), Position::START);
    let commit = |lsn: u64| {
        Entry::Commit(Commit {
            xid: Some(1),
            lsn: Some(Lsn(lsn)),
            committed_at: None,
            phase: Phase::Visible,
            changes: Vec::new(),
            truncated: Vec::new(),
        })
    };
    let at = |lsn, seq| Appended::At(Position { lsn, seq });
    assert_eq!(bus.append(&commit(100)).await.unwrap(), at(100, 0));
    assert_eq!(bus.append(&commit(100)).await.unwrap(), Appended::Already);
    assert_eq!(bus.append(&commit(90)).await.unwrap(), Appended::Already);
    assert_eq!(
        bus.append(&Entry::Heartbeat(Lsn(100))).await.unwrap(),
        Appended::Already
    );
    assert_eq!(
        bus.append(&Entry::Heartbeat(Lsn(150))).await.unwrap(),
        at(150, 1)
    );
    assert_eq!(bus.append(&commit(150)).await.unwrap(), Appended::Already);
    assert_eq!(
        bus.append(&Resync::all("x").into_entry()).await.unwrap(),
        at(150, 2)
    );
    assert_eq!(bus.append(&commit(200)).await.unwrap(), at(200, 0));
    // An LSN past 2^53 (Lua's doubles) still compares exactly.
    let big = (1u64 << 60) + 1;
    assert_eq!(bus.append(&commit(big)).await.unwrap(), at(big, 0));
    assert_eq!(
        bus.append(&commit(big - 1)).await.unwrap(),
        Appended::Already
    );
    let read = bus
        .read(Position::START, Duration::from_millis(10), 100)
        .await
        .unwrap();
    let ids: Vec<Position> = read.iter().map(|r| r.at).collect();
    assert_eq!(ids.len(), 5);
    let mut prev = Position::START;
    for r in &read {
        assert_eq!(r.prev, prev, "each entry names the one before it");
        assert!(r.entry.is_ok());
        prev = r.at;
    }
    assert_eq!(bus.head().await.unwrap(), prev);
}

trait IntoEntry {
    fn into_entry(self) -> bloomgate::feed::bus::Entry;
}

impl IntoEntry for bloomgate::feed::Event {
    fn into_entry(self) -> bloomgate::feed::bus::Entry {
        match self {
            bloomgate::feed::Event::Resync(r) => bloomgate::feed::bus::Entry::Resync(r),
            _ => unreachable!(),
        }
    }
}

/// The release (or debug) binary, serving on a port of its own, with an
/// admin listener.
struct Binary {
    child: Child,
    public: u16,
    admin: u16,
    _dir: std::path::PathBuf,
}

const TOKEN: &str = "bus-test-admin-token-0123456789";

impl Binary {
    fn spawn(db: &TestDb, fleet: &Fleet, redis: &Redis) -> Self {
        let (public, admin) = (free_port(), free_port());
        let dir = std::env::temp_dir().join(unique("bloomgate-bus"));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("bloomgate.toml");
        let text = format!(
            r#"
            [server]
            listen = "127.0.0.1:{public}"
            [admin]
            listen = "127.0.0.1:{admin}"
            [database]
            url = "{url}"
            pool_size = 4
            freshness = "wal"
            install_feed = true
            {BY_EMAIL}
            {bus}
            {RESOURCES}
            "#,
            url = db.url,
            bus = fleet.bus_toml(redis),
        );
        std::fs::write(&path, text).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_bloomgate"))
            .args(["serve", "--config", path.to_str().unwrap()])
            .env_remove("DATABASE_URL")
            .env("BLOOMGATE_ADMIN_TOKEN", TOKEN)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        Binary {
            child,
            public,
            admin,
            _dir: dir,
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    async fn get(&self, path: &str) -> Option<(u16, String)> {
        let r = reqwest::get(format!("http://127.0.0.1:{}{path}", self.public))
            .await
            .ok()?;
        let code = r.status().as_u16();
        Some((code, r.text().await.ok()?))
    }

    async fn stats(&self) -> Option<serde_json::Value> {
        let r = reqwest::Client::new()
            .get(format!("http://127.0.0.1:{}/admin/stats", self.admin))
            .bearer_auth(TOKEN)
            .send()
            .await
            .ok()?;
        r.json().await.ok()
    }

    fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([sig, &self.pid().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill {sig}");
    }
}

impl Drop for Binary {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn ready(b: &Binary) {
    eventually("the binary is ready", || async {
        matches!(b.get("/readyz").await, Some((200, _)))
    })
    .await;
}

/// Whether the relay announced on the bus is process `pid`.
async fn relay_is(redis: &Redis, fleet: &Fleet, pid: u32) -> bool {
    let Some(mut c) = redis.conn().await else {
        return false;
    };
    for key in redis.keys(&format!("{}:*:relay", fleet.prefix)).await {
        let who: Option<String> = redis::cmd("GET")
            .arg(&key)
            .query_async(&mut c)
            .await
            .ok()
            .flatten();
        if who.is_some_and(|w| w.ends_with(&format!(":{pid}"))) {
            return true;
        }
    }
    false
}

/// The relay, a separate process, is `SIGKILL`ed while a writer inserts
/// rows: another gateway takes the slot, and every row is servable on
/// every gateway left.
#[tokio::test]
async fn the_relay_killed_under_writes_loses_nothing() {
    let _one = ONE_AT_A_TIME.lock().await;
    let redis = Redis::start().await;
    let db = bus_db().await;
    let fleet = Fleet::new();
    let relay = Binary::spawn(&db, &fleet, &redis);
    ready(&relay).await;
    eventually("the binary relays", || {
        relay_is(&redis, &fleet, relay.pid())
    })
    .await;
    let mut gws = Vec::new();
    for _ in 0..2 {
        gws.push(started(fleet.config(&db, &redis)).await);
    }
    eventually("both consumers on the bus", || async {
        gws.iter().all(|g| mode(g) == Mode::Bus)
    })
    .await;
    let writer = paced_inserts(&db.pool, 10_000..10_600, Duration::from_millis(5));
    tokio::time::sleep(Duration::from_millis(800)).await;
    relay.signal("-KILL");
    let killed = Instant::now();
    eventually("another gateway relays", || async {
        gws.iter().any(|g| relaying(g))
    })
    .await;
    let failover = killed.elapsed();
    writer.await.unwrap();
    for g in &gws {
        for id in 10_000..10_600i64 {
            fresh(g, &format!("/users/{id}"), |r| r.status == StatusCode::OK).await;
        }
    }
    let fell_back: u64 = gws
        .iter()
        .map(|g| g.bus_status().unwrap().fallbacks.load(Ordering::Relaxed))
        .sum();
    eprintln!(
        "relay failover: {failover:?} from SIGKILL to the new relay; fallbacks to a direct feed: {fell_back}"
    );
    assert_eq!(walsenders(&db).await, 1);
    drop(relay);
    for g in &gws {
        g.stop();
    }
    fleet.drop_slot(&db).await;
}

/// Redis killed: past `bus.max_lag` each gateway follows the WAL itself
/// (its own walsender) and stays fresh; Redis back (empty): the fleet
/// returns to the bus, one walsender again.
#[tokio::test]
async fn redis_killed_and_restarted() {
    let _one = ONE_AT_A_TIME.lock().await;
    let mut redis = Redis::start().await;
    let port = redis.port;
    let db = bus_db().await;
    let fleet = Fleet::new();
    let mut gws = Vec::new();
    for _ in 0..2 {
        gws.push(started(fleet.config(&db, &redis)).await);
    }
    wait_all_on_bus(&gws).await;
    for g in &gws {
        assert_eq!(get(g, "/users/5").await.json()["name"], "User 5");
    }
    redis.kill();
    eventually("every gateway on a direct feed", || async {
        gws.iter().all(|g| mode(g) == Mode::Direct)
    })
    .await;
    db.exec("UPDATE users SET name = 'during the outage' WHERE id = 5")
        .await;
    db.exec("INSERT INTO users (id, email, name) VALUES (700, 'o@x.org', 'O')")
        .await;
    for g in &gws {
        fresh(g, "/users/5", |r| {
            r.status == StatusCode::OK && r.json()["name"] == "during the outage"
        })
        .await;
        fresh(g, "/users/700", |r| r.status == StatusCode::OK).await;
    }
    for g in &gws {
        eventually("ready on a direct feed", || async { g.is_ready() }).await;
    }
    let n = walsenders(&db).await;
    assert!(
        n >= 2,
        "a direct feed each: {n} walsenders; {:?} {:?}",
        gws.iter().map(|g| g.feed_health()).collect::<Vec<_>>(),
        gws.iter()
            .map(|g| g.bus_status().unwrap().get())
            .collect::<Vec<_>>()
    );
    let redis = Redis::start_on(port).await;
    wait_all_on_bus(&gws).await;
    eventually("the direct feeds' walsenders gone", || async {
        walsenders(&db).await == 1
    })
    .await;
    db.exec("UPDATE users SET name = 'after' WHERE id = 5")
        .await;
    db.exec("INSERT INTO users (id, email, name) VALUES (701, 'p@x.org', 'P')")
        .await;
    for g in &gws {
        fresh(g, "/users/5", |r| r.json()["name"] == "after").await;
        fresh(g, "/users/701", |r| r.status == StatusCode::OK).await;
        let s = g.bus_status().unwrap();
        assert!(s.fallbacks.load(Ordering::Relaxed) >= 1);
        assert!(s.returns.load(Ordering::Relaxed) >= 1);
    }
    for g in &gws {
        g.stop();
    }
    drop(redis);
    fleet.drop_slot(&db).await;
}

/// A consumer stopped (`SIGSTOP`) while the stream is trimmed past it and
/// a row it cached changes: resumed, it finds the break and resyncs; the
/// row is fresh.
#[tokio::test]
async fn a_stream_trimmed_under_a_stopped_consumer_is_a_resync() {
    let _one = ONE_AT_A_TIME.lock().await;
    let redis = Redis::start().await;
    let db = bus_db().await;
    let fleet = Fleet::new();
    let relay = started(fleet.config(&db, &redis)).await;
    eventually("the in-process gateway relays", || async {
        relaying(&relay)
    })
    .await;
    let consumer = Binary::spawn(&db, &fleet, &redis);
    ready(&consumer).await;
    let (_, body) = consumer.get("/users/6").await.unwrap();
    assert!(body.contains("User 6"), "{body}");
    consumer.signal("-STOP");
    db.exec("UPDATE users SET name = 'while stopped' WHERE id = 6")
        .await;
    db.exec("INSERT INTO users (id, email, name) VALUES (800, 's@x.org', 'S')")
        .await;
    let stream = fleet.stream(&redis).await;
    eventually("the relay appended the insert", || async {
        let mut c = redis.conn().await.unwrap();
        let len: u64 = redis::cmd("XLEN")
            .arg(&stream)
            .query_async(&mut c)
            .await
            .unwrap();
        len > 0 && fresh_now(&relay, "/users/800").await
    })
    .await;
    let mut c = redis.conn().await.unwrap();
    let _: u64 = redis::cmd("XTRIM")
        .arg(&stream)
        .arg("MAXLEN")
        .arg(0)
        .query_async(&mut c)
        .await
        .unwrap();
    db.exec("INSERT INTO users (id, email, name) VALUES (801, 't@x.org', 'T')")
        .await;
    consumer.signal("-CONT");
    eventually(
        "the resumed consumer serves the changes it missed",
        || async {
            let a = consumer.get("/users/6").await;
            let b = consumer.get("/users/800").await;
            let c = consumer.get("/users/801").await;
            matches!(&a, Some((200, body)) if body.contains("while stopped"))
                && matches!(b, Some((200, _)))
                && matches!(c, Some((200, _)))
        },
    )
    .await;
    let stats = consumer.stats().await.unwrap();
    let bus = &stats["bus"];
    assert!(
        bus["breaks"].as_u64().unwrap() >= 1,
        "the break seen: {bus}"
    );
    drop(consumer);
    relay.stop();
    fleet.drop_slot(&db).await;
}

async fn fresh_now(gw: &Arc<Gateway>, path: &str) -> bool {
    status(gw, path).await == StatusCode::OK
}

/// A gateway started while a writer inserts rows misses none of them.
#[tokio::test]
async fn a_consumer_started_while_writes_run_misses_nothing() {
    let _one = ONE_AT_A_TIME.lock().await;
    let redis = Redis::start().await;
    let db = bus_db().await;
    let fleet = Fleet::new();
    let first = started(fleet.config(&db, &redis)).await;
    eventually("a relay", || async { relaying(&first) }).await;
    let writer = paced_inserts(&db.pool, 20_000..20_400, Duration::from_millis(3));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let late = started(fleet.config(&db, &redis)).await;
    writer.await.unwrap();
    for id in 20_000..20_400i64 {
        fresh(&late, &format!("/users/{id}"), |r| {
            r.status == StatusCode::OK
        })
        .await;
    }
    assert_eq!(mode(&late), Mode::Bus);
    assert_eq!(walsenders(&db).await, 1);
    first.stop();
    late.stop();
    fleet.drop_slot(&db).await;
}

/// Commit to servable over the bus: how long after `INSERT` returns the
/// key passes the filter of every gateway of a fleet of three (the relay's
/// own included). Measured and printed (BENCHMARKS.md), not asserted.
#[tokio::test]
async fn commit_to_servable_over_the_bus() {
    let _one = ONE_AT_A_TIME.lock().await;
    let redis = Redis::start().await;
    let db = bus_db().await;
    let fleet = Fleet::new();
    let mut gws = Vec::new();
    for _ in 0..3 {
        gws.push(started(fleet.config(&db, &redis)).await);
    }
    wait_all_on_bus(&gws).await;
    let users: Vec<_> = gws
        .iter()
        .map(|g| g.resource("users").unwrap().clone())
        .collect();
    let mut lat = Vec::new();
    for id in 50_000..51_000i64 {
        sqlx::query("INSERT INTO users (id, email, name) VALUES ($1, $1 || '@l.org', 'L')")
            .bind(id)
            .execute(&db.pool)
            .await
            .unwrap();
        let committed = Instant::now();
        let key = bloomgate::key::Key::Int(id);
        while !users.iter().all(|u| u.filter_contains(&key)) {
            assert!(
                committed.elapsed() < Duration::from_secs(10),
                "{id} never arrived"
            );
            tokio::task::yield_now().await;
        }
        lat.push(committed.elapsed());
    }
    lat.sort();
    let pct = |p: f64| lat[((lat.len() as f64 * p) as usize).min(lat.len() - 1)];
    println!(
        "bus commit-to-servable on all of 3 gateways over {} inserts: p50 {:?}, p99 {:?}, max {:?}",
        lat.len(),
        pct(0.5),
        pct(0.99),
        lat[lat.len() - 1]
    );
    for g in &gws {
        g.stop();
    }
    fleet.drop_slot(&db).await;
}

/// A row cached, then changed while Redis is down: once the gateway no
/// longer vouches for its cache, nothing vouches for it again until the
/// change is covered; in particular the direct feed it falls back to (a
/// new slot, past the change) resyncs before its first heartbeat. Found
/// by tests/truth's bus feed: the resync came a check interval after the
/// direct feed's heartbeats, and the old row was served as a hit.
#[tokio::test]
async fn a_consumer_falling_back_serves_nothing_the_bus_left_stale() {
    let _one = ONE_AT_A_TIME.lock().await;
    let mut redis = Redis::start().await;
    let db = bus_db().await;
    let fleet = Fleet::new();
    let gw = started(fleet.config(&db, &redis)).await;
    wait_all_on_bus(std::slice::from_ref(&gw)).await;
    eventually("/users/5 cached", || async {
        get(&gw, "/users/5")
            .await
            .header("cache-status")
            .contains("hit")
    })
    .await;
    redis.kill();
    db.exec("UPDATE users SET name = 'changed, bus down' WHERE id = 5")
        .await;
    let stale = |r: &Resp| r.header("cache-status").contains("hit") && r.json()["name"] == "User 5";
    // The gateway stops vouching (Redis gone: no proof): from then on a
    // hit of the old row is a wrong answer.
    eventually("the old proof no longer vouches", || async {
        !get(&gw, "/users/5")
            .await
            .header("cache-status")
            .contains("hit")
    })
    .await;
    let began = Instant::now();
    let mut direct_since = None;
    while direct_since.is_none_or(|d: Instant| d.elapsed() < Duration::from_secs(3)) {
        assert!(
            began.elapsed() < Duration::from_secs(30),
            "no direct feed in 30 s"
        );
        if direct_since.is_none() && mode(&gw) == Mode::Direct {
            direct_since = Some(Instant::now());
        }
        let r = get(&gw, "/users/5").await;
        assert!(
            !stale(&r),
            "the row changed while the bus was down served from the old cache: {} {}",
            r.header("cache-status"),
            r.json()
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    fresh(&gw, "/users/5", |r| r.json()["name"] == "changed, bus down").await;
    gw.stop();
    drop(redis);
    fleet.drop_slot(&db).await;
}
