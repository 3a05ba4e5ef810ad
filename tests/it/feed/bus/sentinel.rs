//! The bus on Redis Sentinel (`bus.sentinels`, `bus.sentinel_master`):
//! each test starts its own Redis primary, a replica and three sentinels
//! (`redis-server --sentinel`) on free ports (`common::sentinel::Site`,
//! which the checker's `redis-failover` fault shares). The data nodes
//! have no default user, only an ACL user with a password; the sentinels
//! have a password of their own. The Postgres side is the throwaway
//! `wal_level = logical` primary of `scripts/test.sh`.

use crate::common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bloomgate::feed::bus::Follows;
use common::redis_server::*;
use common::sentinel::*;
use common::*;

// Tests that kill servers and count walsenders run one at a time.
use crate::common::ON_THE_PRIMARY as ONE_AT_A_TIME;

/// The newest entry ID of the stream on `redis`.
async fn last_id(redis: &Redis, stream: &str) -> String {
    let mut c = redis.conn().await.unwrap();
    let info: HashMap<String, redis::Value> = redis::cmd("XINFO")
        .arg("STREAM")
        .arg(stream)
        .query_async(&mut c)
        .await
        .unwrap();
    match &info["last-generated-id"] {
        redis::Value::BulkString(b) => String::from_utf8(b.clone()).unwrap(),
        other => panic!("{other:?}"),
    }
}

/// An entry ID as (LSN, sequence), for comparing.
fn id(s: &str) -> (u64, u64) {
    let (l, q) = s.split_once('-').unwrap();
    (l.parse().unwrap(), q.parse().unwrap())
}

/// When each version of each row committed, as the writer saw it.
#[derive(Default)]
struct Written {
    /// id → (version, committed by then); "User {id}" is version 0.
    versions: HashMap<i64, Vec<(i64, Instant)>>,
    /// Rows inserted, and when.
    inserted: Vec<(i64, Instant)>,
}

/// Writes under the failover: an update a row at a time (`name = 'v{n}'`)
/// and every fifth an insert, each recorded once committed.
fn writer(
    db: &TestDb,
    written: Arc<Mutex<Written>>,
    stop: Arc<tokio::sync::Notify>,
) -> tokio::task::JoinHandle<()> {
    let pool = db.pool.clone();
    tokio::spawn(async move {
        let mut n: i64 = 1;
        loop {
            let id = n % 10 + 1;
            let ok = sqlx::query("UPDATE users SET name = $1 WHERE id = $2")
                .bind(format!("v{n}"))
                .bind(id)
                .execute(&pool)
                .await
                .is_ok();
            if ok {
                written
                    .lock()
                    .unwrap()
                    .versions
                    .entry(id)
                    .or_default()
                    .push((n, Instant::now()));
            }
            if n % 5 == 0 {
                let new = 5000 + n;
                let ok = sqlx::query("INSERT INTO users (id, email, name) VALUES ($1, $2, 'new')")
                    .bind(new)
                    .bind(format!("u{new}@example.com"))
                    .execute(&pool)
                    .await
                    .is_ok();
                if ok {
                    written.lock().unwrap().inserted.push((new, Instant::now()));
                }
            }
            n += 1;
            tokio::select! {
                () = stop.notified() => return,
                () = tokio::time::sleep(Duration::from_millis(15)) => {}
            }
        }
    })
}

/// The promise, checked on one answer to a request sent at `sent`: no
/// version older than one committed `bound` before it, no 404 for a row
/// inserted `bound` before it. A 503 is allowed (nothing vouched for,
/// the database's word not yet had).
fn check(written: &Written, path_id: i64, sent: Instant, r: &Resp, bound: Duration) {
    let Some(before) = sent.checked_sub(bound) else {
        return;
    };
    if r.status == 503 {
        return;
    }
    if let Some(&(_, at)) = written.inserted.iter().find(|(i, _)| *i == path_id) {
        assert!(
            !(r.status == 404 && at < before),
            "/users/{path_id}, inserted {:?} before the request, answered 404 {}",
            sent - at,
            r.header("cache-status")
        );
        return;
    }
    assert_eq!(
        r.status,
        200,
        "/users/{path_id}: {}",
        r.header("cache-status")
    );
    let name = r.json()["name"].as_str().unwrap_or_default().to_string();
    let served: i64 = name
        .strip_prefix('v')
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let owed = written
        .versions
        .get(&path_id)
        .and_then(|vs| vs.iter().rev().find(|(_, at)| *at < before))
        .map_or(0, |(v, _)| *v);
    assert!(
        served >= owed,
        "/users/{path_id} served {name} ({}), but v{owed} committed over {bound:?} before the request",
        r.header("cache-status")
    );
}

/// Redis' primary is killed under writes while its replica has lost its
/// link, so the entries it had not replicated are lost: the sentinels
/// promote the replica, the fleet follows it through the sentinels (with
/// the ACL user's password; the data nodes have no default user), the
/// relay appends there, and no answer is stale or a false 404 at any
/// moment, before, during or after.
#[tokio::test]
async fn a_fleet_on_sentinel_follows_a_redis_failover_and_never_answers_wrong() {
    let _one = ONE_AT_A_TIME.lock().await;
    let mut site = Site::start().await;
    let (db, fleet, gws, stream) = fleet_on(&site).await;
    assert!(
        site.primary.xlen(&stream).await > 0,
        "the relay appends to the primary"
    );
    let traffic = Traffic::start(&db, &gws);
    tokio::time::sleep(Duration::from_secs(2)).await;

    // The replica loses its link (its replication user turned away); the
    // primary goes on for a while, then dies with entries only it had.
    site.cut_replication().await;
    tokio::time::sleep(Duration::from_millis(700)).await;
    let lost_from = last_id(&site.primary, &stream).await;
    site.primary.kill();
    let kept = last_id(&site.replica, &stream).await;
    assert!(
        id(&kept) < id(&lost_from),
        "the replica lacks entries the primary had: {kept} < {lost_from}"
    );

    eventually("the sentinels promoted the replica", || async {
        site.primary_port().await == Some(site.replica.port)
    })
    .await;
    wait_all_on_bus(&gws).await;
    let now = last_id(&site.replica, &stream).await;
    eventually("the relay appends to the new primary", || async {
        id(&last_id(&site.replica, &stream).await) > id(&now)
    })
    .await;
    // Writes and reads go on past the failover for a few bounds.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let checked = traffic.finish().await;
    eprintln!("lost {kept}..{lost_from}");
    every_row_fresh(&db, &gws, checked).await;
    fleet.stop(&gws, &db).await;
}

/// A switchover an operator asks the sentinels for (`SENTINEL FAILOVER`,
/// the primary alive throughout): the fleet follows it with no wrong
/// answer, and the test site follows it too ([`Site::follow`], which the
/// checker relies on when the sentinels fail over on their own).
#[tokio::test]
async fn a_switchover_the_sentinels_make_is_followed_by_the_fleet_and_the_site() {
    switchover("").await;
}

/// The same with the fleet reading the replicas (`bus.read_from`, "A read
/// tier" in `feed::bus::redis`): the sentinels name the primary, whose
/// `INFO replication` names the replica the fleet reads, before the
/// switchover and after it.
#[tokio::test]
async fn a_fleet_reading_replicas_follows_a_switchover() {
    switchover("read_from = \"replicas\"\n").await;
}

async fn switchover(bus_extra: &str) {
    let _one = ONE_AT_A_TIME.lock().await;
    let mut site = Site::start().await;
    let (db, fleet, gws, stream) = fleet_with(&site, bus_extra).await;
    if !bus_extra.is_empty() {
        eventually("the fleet reads the replica, none the primary", || async {
            site.replica.clients_reading().await == 2 && site.primary.clients_reading().await == 0
        })
        .await;
    }
    let traffic = Traffic::start(&db, &gws);
    tokio::time::sleep(Duration::from_secs(2)).await;

    let (old, new) = (site.primary.port, site.replica.port);
    assert_eq!(site.follow().await, None, "nothing to follow before it");
    let client = redis::Client::open(site.sentinel_urls(SENTINEL_PASSWORD)[0].as_str()).unwrap();
    let mut c = client.get_multiplexed_async_connection().await.unwrap();
    let _: () = redis::cmd("SENTINEL")
        .arg("FAILOVER")
        .arg(MASTER)
        .query_async(&mut c)
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let said = loop {
        if let Some(said) = site.follow().await {
            break said;
        }
        assert!(
            Instant::now() < deadline,
            "the site never saw the switchover"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    eprintln!("the sentinel said: {said}");
    assert_eq!((site.primary.port, site.replica.port), (new, old));
    assert!(said.contains("+switch-master"), "{said}");
    wait_all_on_bus(&gws).await;
    let now = last_id(&site.primary, &stream).await;
    eventually("the relay appends to the new primary", || async {
        id(&last_id(&site.primary, &stream).await) > id(&now)
    })
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    if !bus_extra.is_empty() {
        // The old primary, now the replica, in sync: the fleet reads it
        // once a connection is opened again (each consumer's was dropped
        // by the switchover).
        // A gateway that reconnected while the old primary was not yet a
        // replica in sync reads the new primary, and looks again every
        // 10 s: a deadline of its own, past that.
        let deadline = Instant::now() + Duration::from_secs(60);
        while site.replica.clients_reading().await != 2 {
            assert!(
                Instant::now() < deadline,
                "the fleet never read the new replica"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let checked = traffic.finish().await;
    every_row_fresh(&db, &gws, checked).await;
    fleet.stop(&gws, &db).await;
}

/// Two gateways on the bus through `site`'s sentinels, and their stream.
async fn fleet_on(site: &Site) -> (TestDb, Fleet, Vec<Arc<bloomgate::gateway::Gateway>>, String) {
    fleet_with(site, "").await
}

/// [`fleet_on`] with `bus_extra` added to `[bus]`.
async fn fleet_with(
    site: &Site,
    bus_extra: &str,
) -> (TestDb, Fleet, Vec<Arc<bloomgate::gateway::Gateway>>, String) {
    let db = bus_db().await;
    let fleet = Fleet::new();
    let bus = format!(
        "{}{bus_extra}",
        site.bus_toml(&fleet, PASSWORD, SENTINEL_PASSWORD)
    );
    let config = || wal_config(&db, &format!("{BY_EMAIL}\n{bus}"));
    let gws = vec![started(config()).await, started(config()).await];
    wait_all_on_bus(&gws).await;
    let stream = gws[0].bus_status().unwrap().get().stream;
    (db, fleet, gws, stream)
}

/// The writer and, on each gateway, a reader checking every answer
/// ([`check`], bound 2 s) while a test fails Redis over.
struct Traffic {
    stop: Arc<tokio::sync::Notify>,
    writes: tokio::task::JoinHandle<()>,
    reading: Arc<std::sync::atomic::AtomicBool>,
    readers: Vec<tokio::task::JoinHandle<u64>>,
}

impl Traffic {
    fn start(db: &TestDb, gws: &[Arc<bloomgate::gateway::Gateway>]) -> Self {
        let written = Arc::new(Mutex::new(Written::default()));
        let stop = Arc::new(tokio::sync::Notify::new());
        let writes = writer(db, written.clone(), stop.clone());
        let bound = Duration::from_secs(2);
        let reading = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let mut readers = Vec::new();
        for gw in gws {
            let (gw, written, reading) = (gw.clone(), written.clone(), reading.clone());
            readers.push(tokio::spawn(async move {
                let mut checked = 0u64;
                let mut i = 0i64;
                while reading.load(std::sync::atomic::Ordering::Relaxed) {
                    i += 1;
                    let key = match i % 3 {
                        0 => written
                            .lock()
                            .unwrap()
                            .inserted
                            .iter()
                            .rev()
                            .nth((i % 7) as usize)
                            .map_or(1, |(k, _)| *k),
                        _ => i % 10 + 1,
                    };
                    let sent = Instant::now();
                    let r = get(&gw, &format!("/users/{key}")).await;
                    check(&written.lock().unwrap(), key, sent, &r, bound);
                    checked += 1;
                    tokio::time::sleep(Duration::from_millis(3)).await;
                }
                checked
            }));
        }
        Self {
            stop,
            writes,
            reading,
            readers,
        }
    }

    /// Stops the writer, then the readers; the answers they checked.
    async fn finish(self) -> u64 {
        self.stop.notify_one();
        self.writes.await.unwrap();
        self.reading
            .store(false, std::sync::atomic::Ordering::Relaxed);
        let mut checked = 0;
        for r in self.readers {
            checked += r.await.unwrap();
        }
        checked
    }
}

/// After a failover: enough answers were checked, one relay again, and
/// every row's newest version on every gateway, back on the bus.
async fn every_row_fresh(db: &TestDb, gws: &[Arc<bloomgate::gateway::Gateway>], checked: u64) {
    assert!(checked > 100, "{checked} answers checked");
    for gw in gws {
        let b = gw.bus_status().unwrap();
        eprintln!(
            "{checked} answers checked; breaks {}, fallbacks {}, terms {}",
            b.breaks.load(std::sync::atomic::Ordering::Relaxed),
            b.fallbacks.load(std::sync::atomic::Ordering::Relaxed),
            b.terms.load(std::sync::atomic::Ordering::Relaxed),
        );
    }
    // The direct feeds' walsenders end a moment after their gateways
    // return to the bus.
    eventually("one relay again", || async { walsenders(db).await == 1 }).await;
    let rows: Vec<(i64, String)> = sqlx::query_as("SELECT id, name FROM users ORDER BY id")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    for gw in gws {
        assert_eq!(mode(gw), Follows::Bus);
        for (key, name) in rows.iter() {
            fresh(gw, &format!("/users/{key}"), |r| {
                r.status == 200 && r.json()["name"] == name.as_str()
            })
            .await;
        }
    }
}

/// Wrong passwords, the data nodes' or the sentinels': the gateway does
/// not follow the bus (it follows the WAL itself) and says why, and
/// neither password is ever in its log or its status.
#[tokio::test]
async fn a_wrong_password_is_named_as_the_cause_and_never_shown() {
    let _one = ONE_AT_A_TIME.lock().await;
    let site = Site::start().await;
    let db = bus_db().await;
    for (password, sentinel_password, cause) in [
        (
            "wrong-data-password",
            SENTINEL_PASSWORD,
            "the primary `bgm` the sentinels name: Redis: authentication failed",
        ),
        (
            PASSWORD,
            "wrong-sentinel-password",
            "the sentinels (asked for the primary `bgm`): Redis: authentication failed",
        ),
    ] {
        let fleet = Fleet::new();
        let bus = site.bus_toml(&fleet, password, sentinel_password);
        let log = site.dir.join(format!("{}.log", fleet.prefix));
        let gw = Binary::spawn_with(&db, &bus, Some(&log));
        ready(&gw).await;
        let (code, body) = gw.get("/users/4").await.unwrap();
        assert_eq!(code, 200, "{body}");
        eventually("the gateway follows the WAL itself", || async {
            gw.stats()
                .await
                .is_some_and(|s| s["bus"]["mode"] == "direct")
        })
        .await;
        let stats = gw.stats().await.unwrap().to_string();
        assert!(stats.contains(cause), "{cause} in {stats}");
        assert!(stats.contains(MASTER), "{stats}");
        drop(gw);
        let text = std::fs::read_to_string(&log).unwrap();
        assert!(text.contains(cause), "{cause} in {text}");
        for secret in [PASSWORD, SENTINEL_PASSWORD, password, sentinel_password] {
            assert!(!text.contains(secret), "{secret} in the log:\n{text}");
            assert!(!stats.contains(secret), "{secret} in the status: {stats}");
        }
        fleet.drop_slot(&db).await;
    }
}

/// A split brain. The sentinels come to name another node (here: the
/// replica made a primary, and every sentinel told to monitor it, as a
/// majority cut off from the old primary would promote it) while the old
/// primary, which no sentinel reaches, stays a primary, takes writes and
/// answers reads. A relay that checked the node's role only when it
/// connected would go on appending to the old primary on its open
/// connection, which the fleet's new connections never read; the relay
/// asks the sentinels every second and moves. A consumer reading the old
/// primary finds it answers, with a stream nobody appends to: unproven, it
/// must open its next connection where the sentinels say, not keep the
/// one it has. With no direct feed allowed (`max_direct_fallback = 0`),
/// only the bus can vouch for a gateway again.
#[tokio::test]
async fn a_split_brain_moves_the_relay_and_every_consumer_to_the_primary_the_sentinels_name() {
    let _one = ONE_AT_A_TIME.lock().await;
    let site = Site::start().await;
    let (db, fleet, gws, stream) = fleet_with(&site, "max_direct_fallback = 0\n").await;
    site.split().await;
    let before = last_id(&site.replica, &stream).await;
    db.exec("UPDATE users SET name = 'while split' WHERE id = 6")
        .await;
    eventually(
        "the relay appends to the node the sentinels name",
        || async { id(&last_id(&site.replica, &stream).await) > id(&before) },
    )
    .await;
    // Cached now, when what the relay appends no longer reaches a
    // consumer still on the old primary: that one answers it old, then
    // from the database, never vouched for and fresh.
    for g in &gws {
        assert_eq!(get(g, "/users/5").await.status, 200);
    }
    db.exec("UPDATE users SET name = 'after the split' WHERE id = 5")
        .await;
    // Vouched for, not answered from the database for want of a feed.
    for g in &gws {
        fresh_within(g, "/users/5", Duration::from_secs(30), |r| {
            r.json()["name"] == "after the split" && !r.header("cache-status").contains("bypass")
        })
        .await;
    }
    wait_all_on_bus(&gws).await;
    fleet.stop(&gws, &db).await;
}

/// A split brain under snapshots (`bus.fleet_key_file`). A gateway that
/// reads the replica, the node the sentinels then promote, never sees
/// what the old primary takes once the replica's link is cut; the other,
/// reading the old primary, publishes a snapshot of `users_by_email`
/// labelled at its place there (past everything the replica holds). The
/// snapshot is then put on the replica, as a publisher's store connection
/// reaches it once the sentinels name it while its consumer still reads
/// the old node (how the checker's split brain met it; copied by hand here
/// so that no timing decides it). An insert after the snapshot reaches the
/// old primary only, and the relay's slot is confirmed past it. The split:
/// the relay's next term, on the promoted node, starts at its slot, past
/// that node's stream, and appends the resync it owes. The gateway on the
/// promoted node must not take the snapshot for complete at that resync:
/// the insert is in neither the snapshot nor the stream after the resync.
#[tokio::test]
async fn a_snapshot_of_the_old_node_never_stands_for_the_promoted_node_s_resync() {
    use bloomgate::rebuild::Reason;
    let _one = ONE_AT_A_TIME.lock().await;
    let site = Site::start().await;
    let db = bus_db().await;
    let fleet = Fleet::new();
    let key = std::env::temp_dir().join(unique("split_fleet_key"));
    let hex: String = (0..32)
        .map(|_| format!("{:02x}", rand::random::<u8>()))
        .collect();
    std::fs::write(&key, hex).unwrap();
    let bus = site.bus_toml(&fleet, PASSWORD, SENTINEL_PASSWORD);
    let config = |read_from| {
        let mut c = wal_config(&db, &format!("{BY_EMAIL}\n{bus}"));
        c.bus.fleet_key_file = Some(key.clone());
        c.bus.max_direct_fallback = 0;
        c.bus.read_from = read_from;
        // The reader of the replica stays on it, unproven, until halfway
        // to this: through the whole test.
        c.bus.max_lag = Duration::from_secs(120);
        c
    };
    let old = started(config(bloomgate::config::BusReadFrom::Primary)).await;
    let new = started(config(bloomgate::config::BusReadFrom::Replicas)).await;
    let gws = vec![old.clone(), new.clone()];
    wait_all_on_bus(&gws).await;
    eventually("the second gateway reads the replica", || async {
        new.bus_status().unwrap().get().reading
            == format!("replica 127.0.0.1:{}", site.replica.port)
    })
    .await;
    let stream = old.bus_status().unwrap().get().stream;
    site.cut_replication().await;
    let held = last_id(&site.replica, &stream).await;
    db.exec("INSERT INTO users (id, email, name) VALUES (901, 'before@x.org', 'Before')")
        .await;
    eventually("the old node's reader applied the first insert", || async {
        get(&old, "/users-by-email/before@x.org").await.status == 200
    })
    .await;
    let published =
        |g: &bloomgate::gateway::Gateway| g.snapshot_store().unwrap().stats().totals().published;
    let was = published(&old);
    let report = old
        .resource("users_by_email")
        .unwrap()
        .request_rebuild(Reason::Schedule, false)
        .outcome()
        .await
        .unwrap()
        .unwrap();
    assert_eq!(report.source, "scan");
    eventually("the snapshot is published", || async {
        published(&old) > was
    })
    .await;
    assert_eq!(
        last_id(&site.replica, &stream).await,
        held,
        "the replica's link is cut"
    );
    copy_snapshots(&site, &format!("{stream}:snap:users_by_email")).await;
    db.exec("INSERT INTO users (id, email, name) VALUES (902, 'split@x.org', 'Split')")
        .await;
    let after: String = sqlx::query_scalar("SELECT pg_current_wal_insert_lsn()::text")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    eventually("the relay's slot is confirmed past the second insert", || async {
        sqlx::query_scalar::<_, bool>(
            "SELECT confirmed_flush_lsn >= $1::pg_lsn FROM pg_replication_slots WHERE slot_name = $2",
        )
        .bind(&after)
        .bind(&fleet.slot)
        .fetch_optional(&db.pool)
        .await
        .unwrap()
        .unwrap_or(false)
    })
    .await;
    // The premise: the second gateway still reads the replica, which
    // holds nothing past the cut (nothing rebuilds it meanwhile).
    assert_eq!(
        new.bus_status().unwrap().get().reading,
        format!("replica 127.0.0.1:{}", site.replica.port)
    );
    assert_eq!(last_id(&site.replica, &stream).await, held);
    let rebuilt = new
        .resource("users_by_email")
        .unwrap()
        .stats
        .rebuilds
        .load(std::sync::atomic::Ordering::Relaxed);
    site.split().await;
    eventually("the relay appends to the promoted node", || async {
        id(&last_id(&site.replica, &stream).await) > id(&held)
    })
    .await;
    eventually(
        "the promoted node's reader rebuilt and is vouched again",
        || async {
            new.resource("users_by_email")
                .unwrap()
                .stats
                .rebuilds
                .load(std::sync::atomic::Ordering::Relaxed)
                > rebuilt
                && new.resource("users_by_email").unwrap().is_ready()
                && get(&new, "/users-by-email/before@x.org")
                    .await
                    .header("cache-status")
                    .contains("hit")
        },
    )
    .await;
    let r = get(&new, "/users-by-email/split@x.org").await;
    assert_eq!(r.status, 200, "{}", r.header("cache-status"));
    assert_eq!(r.json()["name"], "Split");
    fleet.stop(&gws, &db).await;
    let _ = std::fs::remove_file(key);
}

/// Every key of `list`'s snapshots (the list of nonces and each
/// snapshot's hash) copied from the site's primary to its replica, which
/// is made writable for it.
async fn copy_snapshots(site: &Site, list: &str) {
    let mut from = site.primary.conn().await.unwrap();
    let mut to = site.replica.conn().await.unwrap();
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("replica-read-only")
        .arg("no")
        .query_async(&mut to)
        .await
        .unwrap();
    let nonces: Vec<String> = redis::cmd("LRANGE")
        .arg(list)
        .arg(0)
        .arg(-1)
        .query_async(&mut from)
        .await
        .unwrap();
    let keys =
        std::iter::once(list.to_string()).chain(nonces.iter().map(|n| format!("{list}:{n}")));
    for k in keys {
        let dump: Vec<u8> = redis::cmd("DUMP")
            .arg(&k)
            .query_async(&mut from)
            .await
            .unwrap();
        let _: () = redis::cmd("RESTORE")
            .arg(&k)
            .arg(0)
            .arg(dump)
            .arg("REPLACE")
            .query_async(&mut to)
            .await
            .unwrap();
    }
}
