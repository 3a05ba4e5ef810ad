//! Snapshots on the bus (`bus.fleet_key_file`, `snapshot`,
//! `resource::fleet`): a gateway that joins loads the fleet's filters
//! instead of scanning; a gap the whole fleet meets costs one scan; a
//! snapshot that is damaged, sealed under another key, or of another
//! stream is a scan, never a wrong filter; the wait for the fleet's scan
//! is bounded.

use std::path::{Path, PathBuf};

use bloomgate::config::Config;
use bloomgate::db::stats::{QueryKind, Target};
use bloomgate::snapshot::Totals;

use super::*;

/// A fleet key file of 32 random bytes, in hex.
fn fleet_key(name: &str) -> PathBuf {
    let p = std::env::temp_dir().join(unique(name));
    let hex: String = (0..32)
        .map(|_| format!("{:02x}", rand::random::<u8>()))
        .collect();
    std::fs::write(&p, hex).unwrap();
    p
}

fn with_key(mut cfg: Config, key: &Path) -> Config {
    cfg.bus.fleet_key_file = Some(key.to_path_buf());
    cfg
}

/// Scans of `resource`'s table this gateway made.
fn scans(g: &Gateway, resource: &str) -> u64 {
    let q = g.resource(resource).unwrap().stats.db_queries.snapshot();
    q.get(QueryKind::Scan, Target::Primary) + q.get(QueryKind::Scan, Target::Replica)
}

fn totals(g: &Gateway) -> Totals {
    g.snapshot_store().unwrap().stats().totals()
}

/// The fleet's first gateway on `cfg`, once on the bus and with its
/// three filters (users, users_by_email, articles) published.
async fn publisher(cfg: Config) -> Arc<Gateway> {
    let a = started(cfg).await;
    wait_all_on_bus(std::slice::from_ref(&a)).await;
    eventually("a published its three filters", || async {
        totals(&a).published == 3
    })
    .await;
    a
}

fn rebuilds(g: &Gateway, resource: &str) -> u64 {
    g.resource(resource)
        .unwrap()
        .stats
        .rebuilds
        .load(Ordering::Relaxed)
}

/// The bus handle a relay of `stream` would use (to append by hand).
fn stream_handle(redis: &Redis, stream: &str) -> bloomgate::feed::bus::redis::RedisBus {
    // `{base}:tl{timeline}:s{start}`
    let (rest, start) = stream.rsplit_once(":s").unwrap();
    let (base, tl) = rest.rsplit_once(":tl").unwrap();
    let server = Server {
        timeline: Timeline {
            system: 1,
            id: tl.parse().unwrap(),
        },
        started_us: start.parse().unwrap(),
    };
    bloomgate::feed::bus::redis::RedisBus::new(
        &redis.url(),
        &Default::default(),
        base.to_string(),
        server,
        100_000,
    )
    .unwrap()
}

/// A resync appended to the fleet's stream: a gap every gateway meets.
async fn fleet_wide_gap(redis: &Redis, fleet: &Fleet) {
    use bloomgate::feed::Resync;
    use bloomgate::feed::bus::Bus;
    let mut bus = stream_handle(redis, &fleet.stream(redis).await);
    bus.head().await.unwrap();
    bus.append(&Resync::all("test: a gap the whole fleet meets").into_entry())
        .await
        .unwrap();
}

async fn redis_cmd<T: redis::FromRedisValue>(redis: &Redis, cmd: &redis::Cmd) -> T {
    let mut c = redis.conn().await.unwrap();
    cmd.query_async(&mut c).await.unwrap()
}

/// The newest snapshot's hash key of `resource` on `stream`.
async fn newest_snapshot(redis: &Redis, stream: &str, resource: &str) -> String {
    let nonce: Vec<String> = redis_cmd(
        redis,
        redis::cmd("LRANGE")
            .arg(format!("{stream}:snap:{resource}"))
            .arg(0)
            .arg(0),
    )
    .await;
    format!("{stream}:snap:{resource}:{}", nonce[0])
}

/// The premise of each test: no gateway falls back to a direct feed (a
/// resync, so a rebuild of its own).
fn no_fallbacks(gws: &[Arc<Gateway>]) {
    for g in gws {
        let st = g.bus_status().unwrap();
        assert_eq!(st.fallbacks.load(Ordering::Relaxed), 0, "{:?}", st.get());
    }
}

/// A gateway that joins a running fleet loads both filters from the
/// snapshots the first one published, scans nothing, and reads the stream
/// from the snapshots' place: rows committed after them (a key below the
/// high-water mark, a text key, a delete) are right on it.
#[tokio::test]
async fn a_gateway_joining_the_fleet_loads_the_snapshots_and_scans_nothing() {
    let _one = ONE_AT_A_TIME.lock().await;
    let redis = Redis::start().await;
    let db = bus_db().await;
    db.exec("DELETE FROM users WHERE id = 4").await;
    let fleet = Fleet::new();
    let key = fleet_key("fleet_join");
    let a = publisher(with_key(fleet.patient_config(&db, &redis), &key)).await;
    assert_eq!(totals(&a).scans_for_fleet, 3);
    assert_eq!(
        a.resource("users").unwrap().last_build().unwrap().source,
        "scan"
    );
    // Only the stream has these.
    db.exec("INSERT INTO users (id, email, name) VALUES (4, 'back@x.org', 'Back')")
        .await;
    db.exec("DELETE FROM users WHERE id = 2").await;
    eventually("a sees them", || async {
        get_status(&a, "/users/4").await == StatusCode::OK
    })
    .await;
    let b = started(with_key(fleet.patient_config(&db, &redis), &key)).await;
    let both = [a.clone(), b.clone()];
    wait_all_on_bus(&both).await;
    for r in ["users", "users_by_email"] {
        assert_eq!(scans(&b, r), 0, "{r}: scanned on joining");
        assert_eq!(
            b.resource(r).unwrap().last_build().unwrap().source,
            "snapshot"
        );
        vouched(&b, r).await;
    }
    assert_eq!(totals(&b).loaded, 3);
    assert_eq!(get_status(&b, "/users/4").await, StatusCode::OK);
    assert_eq!(
        get_status(&b, "/users-by-email/back@x.org").await,
        StatusCode::OK
    );
    assert_eq!(get_status(&b, "/users/2").await, StatusCode::NOT_FOUND);
    assert_eq!(get_status(&b, "/users/5").await, StatusCode::OK);
    assert_eq!(
        get_status(&b, "/users-by-email/u6@example.com").await,
        StatusCode::OK
    );
    // And on from there.
    db.exec("INSERT INTO users (id, email, name) VALUES (800, 'eight@x.org', 'Eight')")
        .await;
    eventually("b follows the stream", || async {
        get_status(&b, "/users-by-email/eight@x.org").await == StatusCode::OK
    })
    .await;
    no_fallbacks(&both);
    fleet.stop(&both, &db).await;
    let _ = std::fs::remove_file(key);
}

/// A snapshot with one flipped byte, and snapshots sealed under another
/// fleet key: each refused and counted, and the gateway scans; its
/// filters hold every row.
#[tokio::test]
async fn a_damaged_or_foreign_snapshot_is_a_scan_never_a_wrong_filter() {
    let _one = ONE_AT_A_TIME.lock().await;
    let redis = Redis::start().await;
    let db = bus_db().await;
    let fleet = Fleet::new();
    let key = fleet_key("fleet_damaged");
    let a = publisher(with_key(fleet.patient_config(&db, &redis), &key)).await;
    let stream = fleet.stream(&redis).await;
    let hash = newest_snapshot(&redis, &stream, "users_by_email").await;
    let mut chunk: Vec<u8> = redis_cmd(&redis, redis::cmd("HGET").arg(&hash).arg("0")).await;
    let mid = chunk.len() / 2;
    chunk[mid] ^= 0x20;
    redis_cmd::<()>(&redis, redis::cmd("HSET").arg(&hash).arg("0").arg(chunk)).await;

    let b = started(with_key(fleet.patient_config(&db, &redis), &key)).await;
    let other_key = fleet_key("fleet_other");
    let c = started(with_key(fleet.patient_config(&db, &redis), &other_key)).await;
    let all = [a.clone(), b.clone(), c.clone()];
    wait_all_on_bus(&all).await;
    // b: users loaded, users_by_email refused and scanned.
    assert_eq!(scans(&b, "users"), 0);
    assert_eq!(scans(&b, "users_by_email"), 1);
    assert!(totals(&b).unusable >= 1, "{:?}", totals(&b));
    // c: neither opens under its key.
    assert_eq!(scans(&c, "users"), 1);
    assert_eq!(scans(&c, "users_by_email"), 1);
    assert!(totals(&c).unusable >= 3, "{:?}", totals(&c));
    assert_eq!(totals(&c).loaded, 0);
    for g in [&b, &c] {
        vouched(g, "users_by_email").await;
        for i in 1..=8 {
            let path = format!("/users-by-email/u{i}@example.com");
            assert_eq!(get_status(g, &path).await, StatusCode::OK, "{path}");
        }
    }
    no_fallbacks(&all);
    fleet.stop(&all, &db).await;
    let _ = std::fs::remove_file(key);
    let _ = std::fs::remove_file(other_key);
}

/// A snapshot of another stream (another epoch of the primary: a
/// failover, a restart, a restore), genuine and under the fleet's key but
/// found under this stream's keys, is not used; nor one past the
/// stream's newest entry (a Redis that lost entries). Both hold no key
/// at all: used, every row would be 404.
#[tokio::test]
async fn a_snapshot_of_another_epoch_or_past_the_stream_is_not_used() {
    use bloomgate::filter::{KeyKind, KeySetBuilder, Mode};
    use bloomgate::snapshot::{self, BuildKey, FleetKey, Manifest, Mark};
    let _one = ONE_AT_A_TIME.lock().await;
    let redis = Redis::start().await;
    let db = bus_db().await;
    let fleet = Fleet::new();
    let key = fleet_key("fleet_epoch");
    let a = publisher(with_key(fleet.patient_config(&db, &redis), &key)).await;
    let stream = fleet.stream(&redis).await;
    let fleet_key = FleetKey::from_file(&key).unwrap();
    let head = {
        use bloomgate::feed::bus::Bus;
        stream_handle(&redis, &stream).head().await.unwrap()
    };
    let other = format!("{}9", stream);
    for (resource, at) in [
        (
            "users",
            Mark {
                stream: other.clone(),
                lsn: head.lsn,
                seq: head.seq,
            },
        ),
        (
            "users_by_email",
            Mark {
                stream: stream.clone(),
                lsn: head.lsn + 1_000_000,
                seq: 0,
            },
        ),
    ] {
        let build = BuildKey::new(&fleet_key);
        let kind = match resource {
            "users" => KeyKind::Int,
            _ => KeyKind::Bytes,
        };
        let empty = KeySetBuilder::new(Mode::Bloom, kind, 100, 0.01, build.filter.clone())
            .unwrap()
            .finish();
        // The genuine one's catalog state: only the place is wrong.
        let genuine: Vec<u8> = redis_cmd(
            &redis,
            redis::cmd("HGET")
                .arg(newest_snapshot(&redis, &stream, resource).await)
                .arg("m"),
        )
        .await;
        let catalog = snapshot::manifest(&genuine).unwrap().catalog;
        let manifest = Manifest {
            format: snapshot::FORMAT,
            resource: resource.into(),
            shape: a.resource(resource).unwrap().shape(),
            catalog,
            key_id: String::new(),
            at,
            nonce: String::new(),
            kind: String::new(),
            keys: 0,
            rows: 0,
            max_int: i64::MIN,
            plain_bytes: 0,
            sealed_bytes: 0,
            chunks: 0,
            published_ms: 0,
            by: "a test".into(),
        };
        let stored = snapshot::publishable(&fleet_key, &build, manifest, &empty);
        let nonce = build.nonce.hex();
        let hash = format!("{stream}:snap:{resource}:{nonce}");
        let mut hset = redis::cmd("HSET");
        hset.arg(&hash).arg("m").arg(stored.manifest.as_slice());
        for (i, c) in stored.chunks.iter().enumerate() {
            hset.arg(i).arg(c.as_slice());
        }
        redis_cmd::<()>(&redis, &hset).await;
        redis_cmd::<()>(
            &redis,
            redis::cmd("LPUSH")
                .arg(format!("{stream}:snap:{resource}"))
                .arg(nonce),
        )
        .await;
    }
    let b = started(with_key(fleet.patient_config(&db, &redis), &key)).await;
    let both = [a.clone(), b.clone()];
    wait_all_on_bus(&both).await;
    // The newest of each is passed over; a's genuine one behind it is
    // loaded, or the table scanned.
    for r in ["users", "users_by_email"] {
        vouched(&b, r).await;
        let built = b.resource(r).unwrap().last_build().unwrap();
        assert!(built.keys > 0, "{r}: the empty snapshot was used");
    }
    assert_eq!(get_status(&b, "/users/5").await, StatusCode::OK);
    for i in 1..=8 {
        let path = format!("/users-by-email/u{i}@example.com");
        assert_eq!(get_status(&b, &path).await, StatusCode::OK, "{path}");
    }
    let scanned: u64 = ["users", "users_by_email", "articles"]
        .iter()
        .map(|r| scans(&b, r))
        .sum();
    assert_eq!(
        totals(&b).loaded + scanned,
        3,
        "each filter loaded from a's genuine snapshot or scanned, once"
    );
    no_fallbacks(&both);
    fleet.stop(&both, &db).await;
    let _ = std::fs::remove_file(key);
}

/// A gap every gateway of a fleet of four meets (a resync on the
/// stream): one scan per table for the whole fleet; the others load its
/// snapshot. The table is large enough that the scan outlasts the
/// moment each gateway opens its rebuild's window.
#[tokio::test]
async fn a_fleet_wide_gap_costs_the_fleet_one_scan() {
    let _one = ONE_AT_A_TIME.lock().await;
    let redis = Redis::start().await;
    let db = bus_db().await;
    db.exec(
        "INSERT INTO users (id, email, name)
         SELECT g, 'bulk' || g || '@x.org', 'Bulk' FROM generate_series(1000, 200000) g",
    )
    .await;
    let fleet = Fleet::new();
    let key = fleet_key("fleet_gap");
    let mut gws = Vec::new();
    for _ in 0..4 {
        gws.push(started(with_key(fleet.patient_config(&db, &redis), &key)).await);
    }
    wait_all_on_bus(&gws).await;
    let tables = ["users", "users_by_email", "articles"];
    let scans_of = |gws: &[Arc<Gateway>]| -> u64 {
        gws.iter()
            .map(|g| tables.iter().map(|t| scans(g, t)).sum::<u64>())
            .sum()
    };
    let loaded_of = |gws: &[Arc<Gateway>]| -> u64 { gws.iter().map(|g| totals(g).loaded).sum() };
    let before = scans_of(&gws);
    let loaded_before = loaded_of(&gws);
    assert!(before >= 3, "the first gateway scanned each table");
    let rebuilt: Vec<u64> = gws.iter().map(|g| rebuilds(g, "users")).collect();
    fleet_wide_gap(&redis, &fleet).await;
    for (g, was) in gws.iter().zip(&rebuilt) {
        eventually("every gateway rebuilt after the gap", || async {
            rebuilds(g, "users") > *was && g.resource("users_by_email").unwrap().is_ready()
        })
        .await;
        vouched(g, "users").await;
        vouched(g, "users_by_email").await;
    }
    for (g, was) in gws.iter().zip(&rebuilt) {
        eventually("every gateway rebuilt articles too", || async {
            g.resource("articles").unwrap().is_ready() && rebuilds(g, "users") > *was
        })
        .await;
    }
    let after = scans_of(&gws);
    assert_eq!(
        after - before,
        3,
        "one scan of each table for the fleet: {:?}",
        gws.iter().map(|g| totals(g)).collect::<Vec<_>>()
    );
    let loaded = loaded_of(&gws) - loaded_before;
    assert_eq!(loaded, 9, "the three others loaded each table");
    for g in &gws {
        assert_eq!(get_status(g, "/users/150000").await, StatusCode::OK);
        assert_eq!(
            get_status(g, "/users-by-email/bulk4321@x.org").await,
            StatusCode::OK
        );
    }
    no_fallbacks(&gws);
    fleet.stop(&gws, &db).await;
    let _ = std::fs::remove_file(key);
}

/// The fleet's scan slot held by a gateway that never publishes (it died
/// mid-scan): past `bus.snapshot_wait`, a gateway scans by itself in
/// another of the `bus.max_parallel_scans` slots; with every slot held for
/// ever, it scans without one past four waits.
#[tokio::test]
async fn the_wait_for_the_fleet_s_scan_is_bounded() {
    let _one = ONE_AT_A_TIME.lock().await;
    let redis = Redis::start().await;
    let db = bus_db().await;
    let fleet = Fleet::new();
    let key = fleet_key("fleet_wait");
    let mut cfg = with_key(fleet.patient_config(&db, &redis), &key);
    cfg.bus.snapshot_wait = Duration::from_secs(1);
    cfg.bus.max_parallel_scans = 2;
    let a = publisher(cfg).await;
    let stream = fleet.stream(&redis).await;
    for r in ["users", "users_by_email", "articles"] {
        redis_cmd::<()>(
            &redis,
            redis::cmd("SET")
                .arg(format!("{stream}:scan:{r}:0"))
                .arg("a gateway that died")
                .arg("PX")
                .arg(600_000),
        )
        .await;
    }
    let was = rebuilds(&a, "users");
    let t0 = Instant::now();
    fleet_wide_gap(&redis, &fleet).await;
    eventually("a rebuilt after the gap", || async {
        rebuilds(&a, "users") > was && a.resource("users_by_email").unwrap().is_ready()
    })
    .await;
    assert!(t0.elapsed() >= Duration::from_secs(1), "it waited");
    let t = totals(&a);
    assert_eq!(t.scans_after_wait, 3, "{t:?}");
    assert_eq!(t.scans_for_fleet, 3, "only the first start's: {t:?}");
    vouched(&a, "users").await;
    assert_eq!(get_status(&a, "/users/5").await, StatusCode::OK);
    // Every slot held for ever (a Redis writer's doing): past 4 waits, a
    // scan without a lease; never a rebuild that waits for ever.
    for r in ["users", "users_by_email", "articles"] {
        for slot in 0..2 {
            redis_cmd::<()>(
                &redis,
                redis::cmd("SET")
                    .arg(format!("{stream}:scan:{r}:{slot}"))
                    .arg("held for ever"),
            )
            .await;
        }
    }
    let was = rebuilds(&a, "users");
    let t0 = Instant::now();
    fleet_wide_gap(&redis, &fleet).await;
    eventually_within(
        "a rebuilt with every slot held",
        Duration::from_secs(60),
        || async {
            rebuilds(&a, "users") > was && a.resource("users_by_email").unwrap().is_ready()
        },
    )
    .await;
    assert!(
        t0.elapsed() >= Duration::from_secs(4),
        "it waited 4 × snapshot_wait"
    );
    assert_eq!(totals(&a).scans_after_wait, 6, "{:?}", totals(&a));
    vouched(&a, "users_by_email").await;
    assert_eq!(
        get_status(&a, "/users-by-email/u2@example.com").await,
        StatusCode::OK
    );
    no_fallbacks(std::slice::from_ref(&a));
    fleet.stop(std::slice::from_ref(&a), &db).await;
    let _ = std::fs::remove_file(key);
}

/// Rebuilds that only restore precision (the schedule), with no gap: one
/// never reloads a snapshot older than its own filter (it scans, and
/// publishes); another gateway's then loads that fresh snapshot, with the
/// keys it applied since (a text key, which no high-water mark would
/// rescue), and scans nothing.
#[tokio::test]
async fn a_scheduled_rebuild_loads_the_fleet_s_newer_snapshot_and_the_keys_applied_since() {
    use bloomgate::rebuild::Reason;
    let _one = ONE_AT_A_TIME.lock().await;
    let redis = Redis::start().await;
    let db = bus_db().await;
    let fleet = Fleet::new();
    let key = fleet_key("fleet_recent");
    let a = publisher(with_key(fleet.patient_config(&db, &redis), &key)).await;
    let b = started(with_key(fleet.patient_config(&db, &redis), &key)).await;
    let both = [a.clone(), b.clone()];
    wait_all_on_bus(&both).await;
    assert_eq!(scans(&b, "users_by_email"), 0, "b joined");
    let schedule = |g: &Gateway| {
        g.resource("users_by_email")
            .unwrap()
            .request_rebuild(Reason::Schedule, false)
    };
    // a: its own snapshot is as old as its filter: a scan.
    let scanned = scans(&a, "users_by_email");
    let report = schedule(&a).outcome().await.unwrap().unwrap();
    assert_eq!(report.source, "scan");
    assert_eq!(scans(&a, "users_by_email"), scanned + 1);
    eventually("a published it", || async { totals(&a).published == 4 }).await;
    // Applied by b after a's snapshot was labelled.
    db.exec("INSERT INTO users (id, email, name) VALUES (900, 'recent@x.org', 'Recent')")
        .await;
    eventually("b applied it", || async {
        get_status(&b, "/users-by-email/recent@x.org").await == StatusCode::OK
    })
    .await;
    let report = schedule(&b).outcome().await.unwrap().unwrap();
    assert_eq!(report.source, "snapshot");
    assert_eq!(scans(&b, "users_by_email"), 0, "no scan");
    vouched(&b, "users_by_email").await;
    assert_eq!(
        get_status(&b, "/users-by-email/recent@x.org").await,
        StatusCode::OK
    );
    assert_eq!(
        get_status(&b, "/users-by-email/u3@example.com").await,
        StatusCode::OK
    );
    no_fallbacks(&both);
    fleet.stop(&both, &db).await;
    let _ = std::fs::remove_file(key);
}

/// The table rewritten while no gateway ran (the fleet stopped, a
/// migration, the fleet started again): no feed saw it, and every email
/// changed with no row change. A gateway that joins does not load the
/// snapshot scanned before it (its catalog state differs): it scans, and
/// serves the rewritten keys.
#[tokio::test]
async fn a_table_rewritten_while_the_fleet_was_down_is_scanned_not_loaded() {
    let _one = ONE_AT_A_TIME.lock().await;
    let redis = Redis::start().await;
    let db = bus_db().await;
    let fleet = Fleet::new();
    let key = fleet_key("fleet_rewrite");
    let a = publisher(with_key(fleet.patient_config(&db, &redis), &key)).await;
    // Stopped, its slot kept: the next relay resumes it, so nothing on the
    // stream says a thing happened meanwhile.
    a.stop();
    drop(a);
    eventually("the bus slot free, and kept", || async {
        sqlx::query_scalar::<_, bool>(
            "SELECT NOT active FROM pg_replication_slots WHERE slot_name = $1",
        )
        .bind(&fleet.slot)
        .fetch_optional(&db.pool)
        .await
        .unwrap()
            == Some(true)
    })
    .await;
    db.exec("ALTER TABLE users ALTER COLUMN email TYPE text USING upper(email)")
        .await;
    let b = started(with_key(fleet.patient_config(&db, &redis), &key)).await;
    wait_all_on_bus(std::slice::from_ref(&b)).await;
    vouched(&b, "users_by_email").await;
    assert_eq!(
        get_status(&b, "/users-by-email/U3@EXAMPLE.COM").await,
        StatusCode::OK,
        "the rewritten key, which the old snapshot lacks"
    );
    assert!(scans(&b, "users_by_email") >= 1);
    assert!(!b.resource("users_by_email").unwrap().joined());
    // The other table's snapshot is still its own.
    assert_eq!(scans(&b, "articles"), 0);
    no_fallbacks(std::slice::from_ref(&b));
    fleet.stop(std::slice::from_ref(&b), &db).await;
    let _ = std::fs::remove_file(key);
}

/// A gateway whose own schedule is far off follows the fleet's: as soon as
/// another gateway's scheduled scan publishes a filter newer than its own,
/// it rebuilds, and loads it: one scan per schedule for the fleet.
#[tokio::test]
async fn a_schedule_follows_the_fleet_s_scan_and_loads_it() {
    let _one = ONE_AT_A_TIME.lock().await;
    let redis = Redis::start().await;
    let db = bus_db().await;
    let fleet = Fleet::new();
    let key = fleet_key("fleet_follow");
    let every = |interval: u64| {
        let mut cfg = with_key(fleet.patient_config(&db, &redis), &key);
        for r in cfg.resources.iter_mut() {
            r.filter.rebuild_interval = Some(Duration::from_secs(interval));
        }
        cfg
    };
    let a = started(every(3)).await;
    wait_all_on_bus(std::slice::from_ref(&a)).await;
    let b = started(every(3600)).await;
    let both = [a.clone(), b.clone()];
    wait_all_on_bus(&both).await;
    assert_eq!(scans(&b, "users"), 0, "b joined");
    let was = rebuilds(&b, "users");
    a.spawn_rebuilds();
    b.spawn_rebuilds();
    let a_scans = scans(&a, "users");
    eventually_within(
        "b followed a's scheduled scan",
        Duration::from_secs(30),
        || async { rebuilds(&b, "users") >= was + 2 },
    )
    .await;
    assert!(scans(&a, "users") > a_scans, "a's schedule scanned");
    // Once per snapshot: never more rebuilds than a published.
    assert!(
        rebuilds(&b, "users") - was <= scans(&a, "users") - a_scans + 1,
        "b rebuilt {} times for {} scans of a",
        rebuilds(&b, "users") - was,
        scans(&a, "users") - a_scans
    );
    assert_eq!(scans(&b, "users"), 0, "b loaded what a scanned");
    assert_eq!(
        b.resource("users").unwrap().last_build().unwrap().source,
        "snapshot"
    );
    no_fallbacks(&both);
    fleet.stop(&both, &db).await;
    let _ = std::fs::remove_file(key);
}

/// A scheduled rebuild the shrink guard refuses (most rows deleted) waits
/// its interval before the next, as one that swapped in does: never a
/// rebuild after another, each a scan and a merge scan.
#[tokio::test]
async fn a_refused_scheduled_rebuild_waits_its_interval() {
    let _one = ONE_AT_A_TIME.lock().await;
    let redis = Redis::start().await;
    let db = bus_db().await;
    let fleet = Fleet::new();
    let key = fleet_key("fleet_refused");
    let mut cfg = with_key(fleet.patient_config(&db, &redis), &key);
    for r in cfg.resources.iter_mut() {
        r.filter.rebuild_interval = Some(Duration::from_secs(2));
        // Not the deletes' own trigger: the schedule alone is measured.
        r.filter.rebuild_delete_fraction = Some(0.0);
    }
    let a = started(cfg).await;
    wait_all_on_bus(std::slice::from_ref(&a)).await;
    db.exec("DELETE FROM users WHERE id > 1").await;
    a.spawn_rebuilds();
    let refused = || {
        a.resource("users")
            .unwrap()
            .stats
            .refused_swaps
            .load(Ordering::Relaxed)
    };
    eventually_within(
        "a scheduled rebuild refused",
        Duration::from_secs(20),
        || async { refused() >= 1 },
    )
    .await;
    let first = refused();
    tokio::time::sleep(Duration::from_secs(5)).await;
    let more = refused() - first;
    assert!(more <= 3, "{more} refusals in 5 s with rebuild_interval 2s");
    fleet.stop(std::slice::from_ref(&a), &db).await;
    let _ = std::fs::remove_file(key);
}
