//! Freshness: key changes reach every replica, and no real key is ever
//! rejected, across rebuilds and feed reconnects.
//!
//! Every test runs with both change feeds: scripts/test.sh runs this file
//! once on the notification triggers, once more with
//! `BLOOMGATE_TEST_FRESHNESS=wal` on the WAL feed (see `common::wal_mode`)
//! once with `wal-poll` on the WAL feed polled, and once with `queue` on the
//! triggers writing to the change table.
//! The few that test the notify feed's own mechanics (its triggers, the
//! LISTEN connection, payloads) return early on the WAL feed; their WAL
//! counterparts are in tests/it/feed/wal.rs. Those about LISTEN and NOTIFY
//! return early on the queue feed too: its own are in tests/it/feed/queue.rs.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use bloomgate::gateway::Gateway;
use bloomgate::key::Key;
use common::*;
use futures_util::StreamExt;

/// How long until `path` answers what `done` wants: polls, and panics
/// after 10 s (which only catches "never"; the latencies are measured, not
/// asserted). Not `common::eventually`, which waits on any condition and
/// measures nothing.
async fn time_until(gw: &Arc<Gateway>, path: &str, done: impl Fn(&Resp) -> bool) -> Duration {
    let began = Instant::now();
    loop {
        let r = get(gw, path).await;
        if done(&r) {
            return began.elapsed();
        }
        assert!(
            began.elapsed() < Duration::from_secs(10),
            "{} never became fresh: last {:?} {:?}",
            &path[..path.len().min(80)],
            r.status,
            r.body.slice(..r.body.len().min(200))
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// True (and says so) when this run is on the WAL feed and `test` is about
/// the triggers' mechanics.
fn notify_only(test: &str) -> bool {
    if wal_mode() {
        println!("{test}: the notify feed's mechanics; WAL counterpart in tests/it/feed/wal.rs");
    }
    wal_mode()
}

/// True (and says so) when this run is not on the notify feed and `test`
/// is about LISTEN and NOTIFY themselves.
fn listen_only(test: &str) -> bool {
    if queue_mode() {
        println!("{test}: LISTEN's mechanics; queue counterpart in tests/it/feed/queue.rs");
    }
    queue_mode() || notify_only(test)
}

/// Returns once the gateway has applied every change committed before the
/// call: a marker commit (a new article) is served, and feeds apply in
/// commit order. On the WAL feed that is the `Received` delivery only: the
/// `Visible` one of an earlier commit may be batched with the marker's
/// (`feed::wal`, at most every 5 ms), and it drops what was loaded between
/// the two. So there the feed's confirmed position, which passes a commit
/// once both deliveries are applied, must pass where the WAL ended before
/// the marker.
async fn caught_up(gw: &Arc<Gateway>, db: &TestDb) {
    let before: i64 = sqlx::query_scalar("SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::int8")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let id: uuid::Uuid =
        sqlx::query_scalar("INSERT INTO articles (title, body) VALUES ('marker', '') RETURNING id")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    time_until(gw, &format!("/articles/{id}"), |r| {
        r.status == StatusCode::OK
    })
    .await;
    if wal_mode() {
        let began = Instant::now();
        while gw.wal_stats.applied_lsn.load(Ordering::Relaxed) < before as u64 {
            assert!(
                began.elapsed() < Duration::from_secs(10),
                "the WAL feed never confirmed the marker"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
}

#[tokio::test]
async fn an_insert_is_servable_without_a_rebuild() {
    let db = TestDb::new().await;
    db.seed_users(100).await;
    let gw = started(config(&db.url, "")).await;
    let gen0 = gw.resource("users").unwrap().generation();
    assert_eq!(
        get(&gw, "/users/500").await.header("cache-status"),
        "bloomgate; detail=filter-absent"
    );
    insert_user(&db.pool, 500).await;
    time_until(&gw, "/users/500", |r| r.status == StatusCode::OK).await;
    assert_eq!(get(&gw, "/users/500").await.json()["name"], "New 500");
    assert_eq!(
        gw.resource("users").unwrap().generation(),
        gen0,
        "served without a rebuild"
    );
    assert!(changes_received(&gw) >= 1);
}

#[tokio::test]
async fn an_update_replaces_the_cached_row() {
    let db = TestDb::new().await;
    db.seed_users(10).await;
    let gw = started(config(&db.url, "")).await;
    assert_eq!(get(&gw, "/users/3").await.json()["name"], "User 3");
    assert_eq!(
        get(&gw, "/users/3").await.header("cache-status"),
        "bloomgate; hit"
    );
    db.exec("UPDATE users SET name = 'Changed' WHERE id = 3")
        .await;
    let took = time_until(&gw, "/users/3", |r| r.json()["name"] == "Changed").await;
    println!("update visible after {took:?}");
}

#[tokio::test]
async fn a_key_change_moves_the_row() {
    let db = TestDb::new().await;
    db.seed_users(10).await;
    let gw = started(config(&db.url, "")).await;
    assert_eq!(get(&gw, "/users/4").await.status, StatusCode::OK);
    db.exec("UPDATE users SET id = 4000 WHERE id = 4").await;
    time_until(&gw, "/users/4000", |r| r.status == StatusCode::OK).await;
    time_until(&gw, "/users/4", |r| r.status == StatusCode::NOT_FOUND).await;
}

#[tokio::test]
async fn delete_then_reinsert() {
    let db = TestDb::new().await;
    db.seed_users(10).await;
    // Negative entries outlive the test: only the re-insert can drop one.
    let gw = started(config(&db.url, "[cache]\nnegative_ttl = \"10m\"")).await;
    assert_eq!(get(&gw, "/users/6").await.status, StatusCode::OK);
    db.exec("DELETE FROM users WHERE id = 6").await;
    time_until(&gw, "/users/6", |r| r.status == StatusCode::NOT_FOUND).await;
    // Then a negative entry. Not necessarily the first 404's: the WAL feed
    // applies a commit again once it is visible (feed::Phase), dropping what
    // was loaded in between; once caught up, that has happened.
    caught_up(&gw, &db).await;
    time_until(&gw, "/users/6", |r| {
        r.header("cache-status") == "bloomgate; hit; detail=negative"
    })
    .await;
    let seen = changes_received(&gw);
    insert_user(&db.pool, 6).await;
    time_until(&gw, "/users/6", |r| r.status == StatusCode::OK).await;
    assert!(
        changes_received(&gw) > seen,
        "dropped by the insert's change"
    );
}

#[tokio::test]
async fn an_update_racing_a_slow_load_leaves_no_stale_entry() {
    let db = TestDb::new().await;
    db.seed_users(10).await;
    db.add_slow_view().await;
    // The view follows the changes of its base table.
    let gw = started(config(
        &db.url,
        &SLOW.replace(
            "table = \"slow_users\"",
            "table = \"slow_users\"\nsource_table = \"users\"",
        ),
    ))
    .await;
    db.set_delay(0.5).await;
    // The load reads the old row, then sleeps in the view's WHERE clause.
    let load = tokio::spawn({
        let gw = gw.clone();
        async move { get(&gw, "/slow/3").await }
    });
    tokio::time::sleep(Duration::from_millis(150)).await;
    let n0 = changes_received(&gw);
    db.exec("UPDATE users SET name = 'Fresh' WHERE id = 3")
        .await;
    let began = Instant::now();
    // One change (one notification per table, or one commit), applied to
    // both resources on `users` by the applier task, which runs as soon as
    // this one yields.
    while changes_received(&gw) < n0 + 1 {
        assert!(began.elapsed() < Duration::from_secs(5));
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    tokio::time::sleep(Duration::from_millis(20)).await;
    let old = load.await.unwrap();
    assert_eq!(
        old.json()["name"],
        "User 3",
        "the load read the row before the update"
    );
    db.set_delay(0.0).await;
    let r = get(&gw, "/slow/3").await;
    assert_eq!(
        r.json()["name"],
        "Fresh",
        "the stale row stayed cached: {}",
        r.header("cache-status")
    );
}

#[tokio::test]
async fn insert_storm_during_rebuilds_loses_no_key_on_either_replica() {
    let db = TestDb::new().await;
    db.seed_users(1000).await;
    // Two replicas: an exact set (auto picks it for dense ids) and a Bloom
    // filter, both rebuilding every 100 ms while 4 writers insert.
    let exact = started(config(&db.url, "")).await;
    let mut cfg = config(&db.url, "");
    cfg.resources[0].filter.mode = Some(serde_json::from_value("bloom".into()).unwrap());
    let bloom = started(cfg).await;
    assert_eq!(exact.resources[0].filter_stats().unwrap().kind, "exact");
    assert_eq!(bloom.resources[0].filter_stats().unwrap().kind, "bloom");

    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut rebuilders = Vec::new();
    for gw in [&exact, &bloom] {
        let users = gw.resource("users").unwrap().clone();
        let stop = stop.clone();
        rebuilders.push(tokio::spawn(async move {
            let mut n = 0u32;
            while !stop.load(Ordering::Relaxed) {
                if users.rebuild(false).await.is_ok() {
                    n += 1;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            n
        }));
    }
    let mut writers = Vec::new();
    for w in 0..4i64 {
        let pool = db.pool.clone();
        writers.push(tokio::spawn(async move {
            for i in 0..5000i64 {
                sqlx::query("INSERT INTO users (id, email, name) VALUES ($1, 's' || $1, 'S')")
                    .bind(100_000 + w * 5000 + i)
                    .execute(&pool)
                    .await
                    .unwrap();
            }
        }));
    }
    for w in writers {
        w.await.unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    let mut rebuilds = 0;
    for r in rebuilders {
        rebuilds += r.await.unwrap();
    }
    assert!(
        rebuilds >= 4,
        "only {rebuilds} rebuilds overlapped the writers"
    );

    let keys: Vec<i64> = (100_000..120_000).collect();
    for gw in [&exact, &bloom] {
        let users = gw.resource("users").unwrap();
        // Notifications still in flight land within moments.
        let began = Instant::now();
        let missing = loop {
            let missing: Vec<i64> = keys
                .iter()
                .copied()
                .filter(|k| !users.filter_contains(&Key::Int(*k)))
                .collect();
            if missing.is_empty() || began.elapsed() > Duration::from_secs(10) {
                break missing;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert!(
            missing.is_empty(),
            "{} keys rejected, e.g. {:?}",
            missing.len(),
            &missing[..missing.len().min(5)]
        );
        let not_ok = futures_util::stream::iter(keys.clone())
            .map(|k| {
                let gw = gw.clone();
                async move { (k, get(&gw, &format!("/users/{k}")).await.status) }
            })
            .buffer_unordered(16)
            .filter(|(_, s)| std::future::ready(*s != StatusCode::OK))
            .collect::<Vec<_>>()
            .await;
        // No key is lost: never a 404. A 503 is the honest answer of a
        // loaded machine (a connection not acquired within acquire_timeout,
        // load slots full: CI's load made 3 of 20,000), so such a key is
        // asked again until the database answers it; it must then be 200.
        let lost: Vec<_> = not_ok
            .iter()
            .filter(|(_, s)| *s != StatusCode::SERVICE_UNAVAILABLE)
            .collect();
        assert!(
            lost.is_empty(),
            "not 200 nor 503: {:?}",
            &lost[..lost.len().min(5)]
        );
        for (k, _) in not_ok {
            let began = Instant::now();
            loop {
                match get(gw, &format!("/users/{k}")).await.status {
                    StatusCode::OK => break,
                    StatusCode::SERVICE_UNAVAILABLE
                        if began.elapsed() < Duration::from_secs(60) =>
                    {
                        tokio::time::sleep(Duration::from_millis(100)).await
                    }
                    s => panic!("{k}: {s} (was 503 under load)"),
                }
            }
        }
    }
}

#[tokio::test]
async fn a_cut_listener_reconnects_and_rebuilds() {
    if listen_only("a_cut_listener_reconnects_and_rebuilds") {
        return;
    }
    let db = TestDb::new().await;
    db.seed_users(100).await;
    let gw = started(config(&db.url, "")).await;
    let writer = paced_inserts(&db.pool, 10_000..10_400, Duration::from_millis(2));
    tokio::time::sleep(Duration::from_millis(200)).await;
    let killed: Vec<bool> = sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
         WHERE datname = current_database() AND application_name = 'bloomgate-notify-feed'",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert!(
        killed.contains(&true),
        "the listener's connection was killed"
    );
    writer.await.unwrap();

    let users = gw.resource("users").unwrap();
    let began = Instant::now();
    while gw.stats.feed.listener_reconnects.load(Ordering::Relaxed) == 0 {
        assert!(
            began.elapsed() < Duration::from_secs(60),
            "the listener never noticed"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let began = Instant::now();
    loop {
        let missing = (10_000..10_400)
            .filter(|k| !users.filter_contains(&Key::Int(*k)))
            .count();
        if missing == 0 {
            break;
        }
        assert!(
            began.elapsed() < Duration::from_secs(60),
            "{missing} keys lost across the reconnect"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // And it listens again.
    insert_user(&db.pool, 77_777).await;
    time_until(&gw, "/users/77777", |r| r.status == StatusCode::OK).await;
}

/// 100 users, and a gateway on them through a [`Proxy`], in clear so that
/// the proxy sees each connection's application_name and statements.
async fn behind_a_proxy(extra: &str) -> (TestDb, Proxy, Arc<Gateway>) {
    let db = TestDb::new().await;
    db.seed_users(100).await;
    let proxy = Proxy::start().await;
    let url = proxy.url(&db);
    let sep = if url.contains('?') { '&' } else { '?' };
    let gw = started(config(&format!("{url}{sep}sslmode=disable"), extra)).await;
    (db, proxy, gw)
}

/// The resync after a lost listener comes after `LISTEN` is back, not
/// before: the listener's connection ends (a cut network) and its
/// reconnect is held (a slow connect, shorter than its pool's 5 s acquire
/// timeout), a row is inserted once any rebuild the loss started is done,
/// then the connect goes through. A resync sent before `LISTEN` is back
/// would rebuild before the row exists while `LISTEN` comes after its
/// notification: the row in neither, 404 until the next scheduled rebuild.
#[tokio::test]
async fn the_resync_after_a_lost_listener_follows_its_listen() {
    if listen_only("the_resync_after_a_lost_listener_follows_its_listen") {
        return;
    }
    let (db, proxy, gw) = behind_a_proxy("").await;
    // Connections for the rebuild to use while new ones are held: a few
    // lookups at once open them.
    let warm: Vec<_> = (1..=8)
        .map(|id| {
            let gw = gw.clone();
            tokio::spawn(async move { get(&gw, &format!("/users/{id}")).await.status })
        })
        .collect();
    for w in warm {
        assert_eq!(w.await.unwrap(), StatusCode::OK);
    }
    let users = gw.resource("users").unwrap();
    let rebuilds = || users.stats.rebuilds.load(Ordering::Relaxed);
    let before = rebuilds();

    proxy.hold();
    // Closed without a word (a killed backend says why, and sqlx reports
    // that as an error, whose path reconnected first all along).
    proxy.cut_named("bloomgate-notify-feed");
    // A resync sent at the loss rebuilds now, on the pool's open
    // connections; one that waits for `LISTEN` does not, while it is held.
    let began = Instant::now();
    while rebuilds() == before && began.elapsed() < Duration::from_millis(1500) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    insert_user(&db.pool, 4242).await;
    proxy.release();

    time_until(&gw, "/users/4242", |r| r.status == StatusCode::OK).await;
}

/// A listener whose reconnect is cut short loses nothing after it. The
/// listener's connection ends (a cut network) and its `LISTEN` on a new one
/// is slow on the wire (300 ms, three heartbeats), and so is each
/// heartbeat's round trip (40 ms, while the server, idle, sends
/// notifications at once). A reconnect made by sqlx inside the feed's
/// `select!` would be dropped by the next heartbeat along with the
/// notification buffer it had moved; from then on a notification arriving
/// during a heartbeat's query is taken by that query, which fails on it
/// (seen, instrumented, on the feed before `feed::notify` replaced lost
/// listeners: 29 heartbeats failed so in one run). The feed must hear
/// every notification and the filter hold every key.
#[tokio::test]
async fn a_listener_reconnect_cut_short_loses_no_notification() {
    if listen_only("a_listener_reconnect_cut_short_loses_no_notification") {
        return;
    }
    // No rebuild but the resync's: one for growth would rescan the table
    // and hide lost notifications.
    let (db, proxy, gw) = behind_a_proxy(
        "[filter]\nrebuild_insert_fraction = 0\nrebuild_fp_multiple = 0\nrebuild_delete_fraction = 0",
    )
    .await;
    proxy.slow_down("LISTEN", Duration::from_millis(300));
    // And each heartbeat's round trip spends 40 ms on the wire, while the
    // server, idle, sends notifications straight away: they arrive during
    // the query, as they can on a loaded network.
    proxy.slow_down("pg_backend_pid", Duration::from_millis(40));
    proxy.cut_named("bloomgate-notify-feed");
    let began = Instant::now();
    while gw.stats.feed.listener_reconnects.load(Ordering::Relaxed) == 0 {
        assert!(
            began.elapsed() < Duration::from_secs(60),
            "the listener never came back"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The resync's rebuild, whose snapshot follows the new `LISTEN`.
    let users = gw.resource("users").unwrap();
    time_until(&gw, "/users/100", |r| r.status == StatusCode::OK).await;
    let rebuilt = users.stats.rebuilds.load(Ordering::Relaxed);
    while users.stats.rebuilds.load(Ordering::Relaxed) == rebuilt
        && began.elapsed() < Duration::from_secs(5)
    {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let heard = || gw.stats.feed.notifications.load(Ordering::Relaxed);
    let before = heard();
    let writers: Vec<_> = (0..4i64)
        .map(|w| {
            let pool = db.pool.clone();
            tokio::spawn(async move {
                for i in 0..750i64 {
                    sqlx::query("INSERT INTO users (id, email, name) VALUES ($1, 'r' || $1, 'R')")
                        .bind(20_000 + w * 750 + i)
                        .execute(&pool)
                        .await
                        .unwrap();
                }
            })
        })
        .collect();
    for w in writers {
        w.await.unwrap();
    }
    // Every notification reaches the feed: none is taken by a heartbeat's
    // query (the filter may hide a loss: past `database.freshness_bound`
    // without a heartbeat the gateway answers from the database, and so
    // heartbeats that fail often are covered).
    let began = Instant::now();
    while heard() - before < 3000 {
        assert!(
            began.elapsed() < Duration::from_secs(20),
            "{} of 3000 notifications never reached the feed",
            3000 - (heard() - before)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let began = Instant::now();
    loop {
        let missing = (20_000..23_000)
            .filter(|k| !users.filter_contains(&Key::Int(*k)))
            .count();
        if missing == 0 {
            break;
        }
        assert!(
            began.elapsed() < Duration::from_secs(20),
            "{missing} of 3000 keys inserted after the reconnect never reached the filter"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn keys_above_the_high_water_mark_are_verified_within_budget() {
    let db = TestDb::new().await;
    db.seed_users(100).await;
    // No notifications: only the verification can find the new row.
    let cfg = config(
        &db.url,
        "freshness = \"off\"\n[filter]\nverify_above_high_water = true\nverify_budget = 3",
    );
    let gw = started(cfg).await;
    insert_user(&db.pool, 1000).await;
    let r = get(&gw, "/users/1000").await;
    assert_eq!(
        (r.status, r.header("cache-status")),
        (StatusCode::OK, "bloomgate; fwd=miss; stored")
    );
    // Added to the filter: served from cache now, and no longer "above".
    assert!(
        gw.resource("users")
            .unwrap()
            .filter_contains(&Key::Int(1000))
    );
    // Below the mark the filter is trusted as usual.
    let r = get(&gw, "/users/-5").await;
    assert_eq!(r.header("cache-status"), "bloomgate; detail=filter-absent");
    // Two more verifications fit the budget of 3 a second; the next does not.
    assert_eq!(
        get(&gw, "/users/2001").await.header("cache-status"),
        "bloomgate; fwd=miss; stored; detail=negative"
    );
    assert_eq!(
        get(&gw, "/users/2002").await.header("cache-status"),
        "bloomgate; fwd=miss; stored; detail=negative"
    );
    assert_eq!(
        get(&gw, "/users/2003").await.header("cache-status"),
        "bloomgate; detail=filter-absent"
    );
    // The filter rejected 2001 and 2002 and was right: checking them
    // anyway found no false positive.
    let users = gw.resource("users").unwrap();
    assert_eq!(
        users
            .stats
            .observed_absent
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
}

#[tokio::test]
async fn install_triggers_makes_a_user_table_fresh() {
    if notify_only("install_triggers_makes_a_user_table_fresh") {
        return;
    }
    if least_privilege() {
        // `bloomgate install-triggers` is the tables' owner's step (docs/src/production.md,
        // "A role of its own"); the role's own install is tested by every
        // other test here (`install_triggers = true`).
        println!(
            "install_triggers_makes_a_user_table_fresh: run by the tables' owner, not the gateway's role"
        );
        return;
    }
    let db = TestDb::new().await;
    db.add_things(&["a"]).await;
    // Installed by the CLI's path, not at start-up.
    let cfg = config(&db.url, &format!("install_triggers = false\n{THINGS}"));
    let gw = gateway(cfg);
    for _ in 0..2 {
        // Idempotent.
        let installed = gw.install_triggers().await.unwrap();
        let tables: Vec<&str> = installed.iter().map(|(t, _)| &**t).collect();
        assert_eq!(tables, ["public.articles", "public.things", "public.users"]);
        assert!(installed.iter().all(|(_, r)| r.is_ok()), "{installed:?}");
    }
    gw.start().await.unwrap();
    db.exec("INSERT INTO things VALUES ('b c%', 'B')").await;
    time_until(&gw, "/things/b%20c%25", |r| r.status == StatusCode::OK).await;
    assert_eq!(get(&gw, "/things/b%20c%25").await.json()["label"], "B");
}

/// Every insert reaches the filter, each within 10 s of its commit (far
/// past the milliseconds it takes: only "never" fails), on whichever feed
/// this run uses.
#[tokio::test]
async fn every_insert_reaches_the_filter() {
    let took = commit_to_servable_on_the_feed(20).await;
    println!("commit-to-servable: {took}");
}

/// Commit to servable, as a bench: how long after `INSERT` returns the key
/// passes the filter, over 1,000 inserts; printed, recorded in
/// BENCHMARKS.md ("Freshness: commit to servable"):
/// `scripts/test.sh --test it feed::freshness::commit_to_servable -- --ignored --nocapture`.
#[tokio::test]
#[ignore = "a bench: run with --ignored --nocapture"]
async fn commit_to_servable_latency() {
    let took = commit_to_servable_on_the_feed(1000).await;
    println!("commit-to-servable: {took}");
}

async fn commit_to_servable_on_the_feed(inserts: i64) -> String {
    let db = TestDb::new().await;
    db.seed_users(1000).await;
    let gw = started(config(&db.url, "")).await;
    let users = gw.resource("users").unwrap().clone();
    commit_to_servable(&db.pool, 50_000..50_000 + inserts, &[users]).await
}

// current_thread (the default): the listener task runs on this thread, so
// the captured subscriber sees its lines.
#[tokio::test]
async fn junk_notifications_are_ignored_without_a_log_flood() {
    if listen_only("junk_notifications_are_ignored_without_a_log_flood") {
        return;
    }
    let db = TestDb::new().await;
    db.seed_users(10).await;
    let gw = started(config(&db.url, "")).await;
    let (logs, _guard) = capture_logs();

    // Anyone who can connect can NOTIFY the channel: 100 payloads with an
    // op that does not exist, the first (logged) one trying to forge a log
    // line, then 300 that are not JSON.
    db.exec(
        "SELECT pg_notify('bloomgate',
             json_build_object('table', 'users', 'op', E'DROP\\nFORGED line ' || g, 'key', '1')::text)
           FROM generate_series(1, 100) g;
         SELECT pg_notify('bloomgate', 'junk ' || g) FROM generate_series(1, 300) g;",
    )
    .await;
    // A real change after the junk still gets through.
    insert_user(&db.pool, 500).await;
    time_until(&gw, "/users/500", |r| r.status == StatusCode::OK).await;
    assert!(gw.stats.feed.notifications.load(Ordering::Relaxed) >= 401);

    let text = logs.text();
    let ignored = text
        .lines()
        .filter(|l| l.contains("ignoring a notification"))
        .count();
    assert!(
        (1..=3).contains(&ignored),
        "{ignored} lines for 400 junk notifications:\n{text}"
    );
    assert!(
        !text.lines().any(|l| l.starts_with("FORGED")),
        "a notification forged a log line:\n{text}"
    );
}

/// Two resources on one table each get their own key, old and new, on
/// insert, update (of either key) and delete; both routes stay fresh.
#[tokio::test]
async fn two_resources_on_one_table_are_both_fresh() {
    let db = TestDb::new().await;
    db.seed_users(10).await;
    if wal_mode() {
        // The WAL must carry the old email as well as the old id.
        db.exec("ALTER TABLE users REPLICA IDENTITY FULL").await;
    }
    let gw = started(config(&db.url, BY_EMAIL)).await;
    // Cached on both routes first, so staleness would show.
    assert_eq!(get(&gw, "/users/3").await.json()["email"], "u3@example.com");
    assert_eq!(
        get(&gw, "/users-by-email/u3@example.com").await.json()["id"],
        3
    );
    assert_eq!(
        get(&gw, "/users-by-email/n500@example.com")
            .await
            .header("cache-status"),
        "bloomgate; detail=filter-absent"
    );

    // Insert: servable on both routes without a rebuild.
    let gens: Vec<u64> = gw.resources.iter().map(|r| r.generation()).collect();
    insert_user(&db.pool, 500).await;
    time_until(&gw, "/users/500", |r| r.status == StatusCode::OK).await;
    time_until(&gw, "/users-by-email/n500@example.com", |r| {
        r.status == StatusCode::OK
    })
    .await;

    // Update of the email: the new email is servable, the old one is gone,
    // and the row by id is not stale.
    db.exec("UPDATE users SET email = 'moved@example.com' WHERE id = 3")
        .await;
    time_until(&gw, "/users-by-email/moved@example.com", |r| {
        r.status == StatusCode::OK && r.json()["id"] == 3
    })
    .await;
    time_until(&gw, "/users-by-email/u3@example.com", |r| {
        r.status == StatusCode::NOT_FOUND
    })
    .await;
    time_until(&gw, "/users/3", |r| {
        r.json()["email"] == "moved@example.com"
    })
    .await;

    // Update of the id: both routes follow.
    db.exec("UPDATE users SET id = 3000 WHERE id = 3").await;
    time_until(&gw, "/users/3000", |r| r.status == StatusCode::OK).await;
    time_until(&gw, "/users/3", |r| r.status == StatusCode::NOT_FOUND).await;
    time_until(&gw, "/users-by-email/moved@example.com", |r| {
        r.json()["id"] == 3000
    })
    .await;

    // Delete: gone on both.
    db.exec("DELETE FROM users WHERE id = 3000").await;
    time_until(&gw, "/users/3000", |r| r.status == StatusCode::NOT_FOUND).await;
    time_until(&gw, "/users-by-email/moved@example.com", |r| {
        r.status == StatusCode::NOT_FOUND
    })
    .await;
    let after: Vec<u64> = gw.resources.iter().map(|r| r.generation()).collect();
    assert_eq!(gens, after, "fresh without a rebuild");
}

/// A key whose notification would be too long once JSON-escaped (4000 `"`
/// are 8000 bytes escaped, 1400 `chr(1)` are 8400) must not fail the
/// writer's transaction: the trigger announces a RESCAN of the table
/// instead, and the rebuild makes the key servable.
#[tokio::test]
async fn a_key_too_long_to_announce_never_fails_a_write_and_is_served_after_a_rescan() {
    let db = TestDb::new().await;
    db.add_things(&["a"]).await;
    let gw = started(config(
        &db.url,
        &format!("[server]\nmax_key_length = 8192\n{THINGS}"),
    ))
    .await;
    let things = gw.resource("things").unwrap().clone();
    let quotes = "\"".repeat(4000);
    let controls = "\u{1}".repeat(1400);
    for key in [&quotes, &controls] {
        sqlx::query("INSERT INTO things VALUES ($1, 'long')")
            .bind(key)
            .execute(&db.pool)
            .await
            .expect("the trigger failed the insert");
    }
    // Served after the rescan (a control character cannot be requested:
    // that key is checked in the filter).
    let path = format!("/things/{}", "%22".repeat(4000));
    time_until(&gw, &path, |r| r.status == StatusCode::OK).await;
    let key = Key::Text(Arc::from(controls.as_str()));
    let began = Instant::now();
    while !things.filter_contains(&key) {
        assert!(began.elapsed() < Duration::from_secs(10), "never rescanned");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Updates and deletes of such rows go through too.
    for key in [&quotes, &controls] {
        sqlx::query("UPDATE things SET label = 'changed' WHERE code = $1")
            .bind(key)
            .execute(&db.pool)
            .await
            .expect("the trigger failed the update");
    }
    time_until(&gw, &path, |r| r.json()["label"] == "changed").await;
    for key in [&quotes, &controls] {
        sqlx::query("DELETE FROM things WHERE code = $1")
            .bind(key)
            .execute(&db.pool)
            .await
            .expect("the trigger failed the delete");
    }
    time_until(&gw, &path, |r| r.status == StatusCode::NOT_FOUND).await;
}

/// TOAST blocks read so far for `docs` (heap and index of its TOAST table),
/// as the statistics system has them after this backend's flush.
async fn toast_blocks(conn: &mut sqlx::PgConnection) -> i64 {
    // Flushed when the backend goes idle after this statement.
    sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(&mut *conn)
        .await
        .unwrap();
    sqlx::query_scalar(
        "SELECT coalesce(toast_blks_read, 0) + coalesce(toast_blks_hit, 0)
                + coalesce(tidx_blks_read, 0) + coalesce(tidx_blks_hit, 0)
           FROM pg_statio_user_tables WHERE relname = 'docs'",
    )
    .fetch_one(&mut *conn)
    .await
    .unwrap()
}

/// The trigger reads only the key columns. Updating a non-key column of a
/// row holding 2 MB of text must not detoast that text (`to_jsonb(NEW)`
/// would: about 30× the cost of the update). Measured as TOAST blocks
/// read by the update, with a trigger that serialises the row as the
/// positive control.
#[tokio::test]
async fn an_update_never_detoasts_the_rest_of_the_row() {
    if notify_only("an_update_never_detoasts_the_rest_of_the_row") {
        return;
    }
    use sqlx::Connection;
    let db = TestDb::new().await;
    // STORAGE EXTERNAL: kept out of line, uncompressed (2 MB in ~1000
    // chunks).
    db.exec(
        "CREATE TABLE docs (id int8 PRIMARY KEY, n int NOT NULL, body text NOT NULL);
         ALTER TABLE docs ALTER body SET STORAGE EXTERNAL;
         INSERT INTO docs SELECT 1, 0, string_agg(md5(g::text), '') FROM generate_series(1, 65536) g;",
    )
    .await;
    let docs = r#"
        [[resource]]
        name = "docs"
        route = "/docs/{id}"
        table = "docs"
        key_column = "id"
        key_type = "bigint"
        columns = ["id", "n"]
    "#;
    let gw = started(config(&db.url, docs)).await;
    let mut conn = sqlx::PgConnection::connect(&db.url).await.unwrap();
    let update = async |conn: &mut sqlx::PgConnection| {
        let before = toast_blocks(conn).await;
        sqlx::query("UPDATE docs SET n = n + 1 WHERE id = 1")
            .execute(&mut *conn)
            .await
            .unwrap();
        toast_blocks(conn).await - before
    };

    // The control: a trigger that serialises the row reads every chunk.
    db.exec(
        "CREATE FUNCTION serialise() RETURNS trigger LANGUAGE plpgsql AS
             $$ BEGIN PERFORM to_jsonb(NEW); RETURN NULL; END $$;
         CREATE TRIGGER serialise AFTER UPDATE ON docs FOR EACH ROW EXECUTE FUNCTION serialise();",
    )
    .await;
    let with_to_jsonb = update(&mut conn).await;
    assert!(
        with_to_jsonb > 200,
        "the measurement cannot see detoasting: {with_to_jsonb} blocks"
    );
    db.exec("DROP TRIGGER serialise ON docs").await;

    // The gateway's trigger only.
    let ours = update(&mut conn).await;
    println!("TOAST blocks read by one update: {ours} (a to_jsonb trigger: {with_to_jsonb})");
    assert_eq!(ours, 0, "the notification trigger detoasted the row");
    let source: String = sqlx::query_scalar(
        "SELECT string_agg(p.prosrc, '') FROM pg_trigger t JOIN pg_proc p ON p.oid = t.tgfoid
          WHERE t.tgrelid = 'docs'::regclass AND NOT t.tgisinternal",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(source.contains("NEW.\"id\"::text"), "{source}");
    assert!(!source.contains("to_jsonb"), "{source}");
    // And the update was announced.
    time_until(&gw, "/docs/1", |r| r.json()["n"] == 2).await;
}

/// A resource on `public.my_view` matches the notifications, which it
/// cannot if the two sides name the table differently: both use the
/// catalog's canonical name, and a view follows its base table through
/// `source_table`, whose triggers the gateway installs.
#[tokio::test]
async fn a_view_follows_its_source_table() {
    let db = TestDb::new().await;
    db.seed_users(10).await;
    db.exec("CREATE VIEW my_view AS SELECT id, name FROM users")
        .await;
    let view = r#"
        [[resource]]
        name = "my"
        route = "/my/{id}"
        table = "public.my_view"
        source_table = "users"
        key_column = "id"
        key_type = "bigint"
        columns = ["id", "name"]
    "#;
    let gw = started(config(&db.url, view)).await;
    assert_eq!(get(&gw, "/my/3").await.json()["name"], "User 3");
    insert_user(&db.pool, 500).await;
    time_until(&gw, "/my/500", |r| r.status == StatusCode::OK).await;
    db.exec("UPDATE users SET name = 'Renamed' WHERE id = 3")
        .await;
    time_until(&gw, "/my/3", |r| r.json()["name"] == "Renamed").await;
    db.exec("DELETE FROM users WHERE id = 500").await;
    time_until(&gw, "/my/500", |r| r.status == StatusCode::NOT_FOUND).await;
    if wal_mode() {
        return;
    }
    // One trigger function on users serves both resources on it.
    let functions: i64 = sqlx::query_scalar(
        "SELECT count(DISTINCT tgfoid) FROM pg_trigger
          WHERE tgrelid = 'users'::regclass AND NOT tgisinternal",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(functions, 1);
}

/// A partitioned table: the trigger goes on the parent (Postgres clones it
/// onto every partition) and announces the parent's name, so inserts into
/// any partition, moves between partitions and deletes are all fresh.
#[tokio::test]
async fn a_partitioned_table_is_fresh_through_its_parent() {
    let db = TestDb::new().await;
    db.exec(
        "CREATE TABLE events (id int8 PRIMARY KEY, kind text NOT NULL) PARTITION BY RANGE (id);
         CREATE TABLE events_low PARTITION OF events FOR VALUES FROM (MINVALUE) TO (1000);
         CREATE TABLE events_high PARTITION OF events FOR VALUES FROM (1000) TO (MAXVALUE);
         INSERT INTO events VALUES (1, 'a');",
    )
    .await;
    let events = r#"
        [[resource]]
        name = "events"
        route = "/events/{id}"
        table = "events"
        key_column = "id"
        key_type = "bigint"
        columns = ["id", "kind"]
    "#;
    let gw = started(config(&db.url, events)).await;
    assert_eq!(get(&gw, "/events/1").await.json()["kind"], "a");
    db.exec("INSERT INTO events VALUES (5, 'b'), (1500, 'c')")
        .await;
    time_until(&gw, "/events/5", |r| r.status == StatusCode::OK).await;
    time_until(&gw, "/events/1500", |r| r.status == StatusCode::OK).await;
    // Moves the row from one partition to the other.
    db.exec("UPDATE events SET id = 2000, kind = 'moved' WHERE id = 1")
        .await;
    time_until(&gw, "/events/2000", |r| r.json()["kind"] == "moved").await;
    time_until(&gw, "/events/1", |r| r.status == StatusCode::NOT_FOUND).await;
    db.exec("DELETE FROM events WHERE id = 1500").await;
    time_until(&gw, "/events/1500", |r| r.status == StatusCode::NOT_FOUND).await;
    db.exec("TRUNCATE events").await;
    time_until(&gw, "/events/5", |r| r.status == StatusCode::NOT_FOUND).await;
}

/// The applier's contract with the feed sources (DESIGN.md): a commit with
/// an LSN is trusted (raises the high-water mark), its LSN is published once
/// applied and never goes back; a `Visible` re-delivery only invalidates
/// (no second count); an unchanged key the source could not carry clears
/// the cache; an inserted row whose key it could not carry asks for a
/// rebuild.
#[tokio::test]
async fn the_applier_keeps_the_feed_contract() {
    use bloomgate::apply::{Applier, Follower};
    use bloomgate::feed::{Columns, Commit, Event, Lsn, Op, Phase, RowChange, Value};
    let db = TestDb::new().await;
    db.seed_users(10).await;
    let gw = started(config(
        &db.url,
        "freshness = \"off\"\n[filter]\nverify_above_high_water = true",
    ))
    .await;
    let users = gw.resource("users").unwrap().clone();
    let table: Arc<str> = Arc::from("public.users");
    let id: Arc<str> = Arc::from("id");
    let (tx, applied) = tokio::sync::watch::channel(bloomgate::feed::Position::ZERO);
    let applier = Applier::new(
        vec![Follower {
            table: table.clone(),
            columns: vec![id.clone()].into(),
            resource: users.clone(),
        }],
        tx,
    );
    let row = |v: Value| Some(Columns(vec![(id.clone(), v)]));
    let commit = |lsn: u64, phase, op, new, old| {
        Event::Commit(Commit {
            xid: Some(7),
            position: Some(bloomgate::feed::Position::new(
                bloomgate::feed::Timeline { system: 1, id: 1 },
                Lsn(lsn),
            )),
            committed_at: None,
            phase,
            changes: vec![RowChange {
                table: table.clone(),
                op,
                new,
                old,
            }],
            truncated: Vec::new(),
        })
    };
    // The row exists (the WAL says so): trusted, so the mark rises at once.
    insert_user(&db.pool, 5000).await;
    let text = |s: &str| Value::Text(s.into());
    applier
        .apply(commit(
            100,
            Phase::Received,
            Op::Insert,
            row(text("5000")),
            None,
        ))
        .await;
    assert!(users.filter_contains(&Key::Int(5000)));
    assert_eq!(users.high_water(), Some(5000));
    assert_eq!(applied.borrow().lsn, Lsn(100));
    let inserts = users.stats.live_inserts.load(Ordering::Relaxed);
    applier
        .apply(commit(
            100,
            Phase::Visible,
            Op::Insert,
            row(text("5000")),
            None,
        ))
        .await;
    assert_eq!(
        users.stats.live_inserts.load(Ordering::Relaxed),
        inserts,
        "a Visible re-delivery counted the insert again"
    );
    // An older LSN never moves "applied" back.
    applier
        .apply(commit(
            50,
            Phase::Received,
            Op::Delete,
            None,
            row(text("9")),
        ))
        .await;
    assert_eq!(applied.borrow().lsn, Lsn(100));
    assert_eq!(users.stats.deletes.load(Ordering::Relaxed), 1);

    // An update whose unchanged key was not carried: the cache is cleared.
    assert_eq!(get(&gw, "/users/3").await.status, StatusCode::OK);
    assert_eq!(
        get(&gw, "/users/3").await.header("cache-status"),
        "bloomgate; hit"
    );
    applier
        .apply(commit(
            200,
            Phase::Received,
            Op::Update,
            row(Value::Unknown),
            None,
        ))
        .await;
    assert_eq!(
        get(&gw, "/users/3").await.header("cache-status"),
        "bloomgate; fwd=miss; stored"
    );
    assert_eq!(applied.borrow().lsn, Lsn(200));
    // An insert whose key was not carried: only a scan can find it.
    let gen0 = users.generation();
    applier
        .apply(commit(
            300,
            Phase::Received,
            Op::Insert,
            row(Value::Unknown),
            None,
        ))
        .await;
    let began = Instant::now();
    while users.generation() == gen0 {
        assert!(began.elapsed() < Duration::from_secs(10), "no rebuild");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A watched table whose trigger is missing (the migration that dropped
/// the first version, `install_triggers` off) or does not announce a key
/// column this config needs: its changes cannot be followed, so its
/// resources are not ready, and say why (the log too); they still answer,
/// from the database.
#[tokio::test]
async fn a_missing_or_partial_trigger_makes_its_resources_not_ready() {
    if listen_only("a_missing_or_partial_trigger_makes_its_resources_not_ready") {
        return;
    }
    let db = TestDb::new().await;
    db.seed_users(3).await;
    let (logs, _guard) = capture_logs();
    let gw = started(config(&db.url, "install_triggers = false")).await;
    let text = logs.text();
    assert!(
        text.lines()
            .any(|l| l.contains("has no bloomgate trigger") && l.contains("public.users")),
        "{text}"
    );
    assert!(!gw.is_ready());
    let why = gw.readiness().to_string();
    assert!(
        why.contains("table public.users has no bloomgate trigger")
            && why.contains("install-triggers"),
        "{why}"
    );
    insert_user(&db.pool, 50).await;
    let r = get(&gw, "/users/50").await;
    assert_eq!(
        r.status,
        StatusCode::OK,
        "not followed, but answered from the database"
    );
    gw.stop();
    // Installed by a config that serves users by id only...
    started(config(&db.url, "")).await.stop();
    // ...then started with users by email too, without installing.
    let gw = started(config(
        &db.url,
        &format!("install_triggers = false\n{BY_EMAIL}"),
    ))
    .await;
    // Never ready for a cause of its configuration: not ready, naming it
    // (issue 52, item 3: it said degraded, ready, and sent every answer
    // to the database for good).
    let why = gw.readiness().to_string();
    assert!(
        why.contains(
            "users_by_email: the bloomgate trigger of public.users does not announce email"
        ),
        "{why}"
    );
    assert!(!why.contains("no bloomgate trigger"), "{why}");
    assert_eq!(
        get(&gw, "/readyz").await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    gw.stop();
    // Ready, then its trigger dropped at run time: a cause every gateway
    // shares, so degraded, not a reason.
    let gw = started(config(&db.url, "install_triggers = false")).await;
    vouched(&gw, "users").await;
    db.exec(
        "DROP TRIGGER bloomgate_notify_users_896e6dda ON users;
         DROP TRIGGER bloomgate_notify_users_896e6dda_t ON users",
    )
    .await;
    let began = std::time::Instant::now();
    loop {
        let why = gw.readiness().to_string();
        if why.contains("users (degraded): table public.users has no bloomgate trigger") {
            break;
        }
        assert!(began.elapsed() < Duration::from_secs(15), "{why}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(get(&gw, "/readyz").await.status, StatusCode::OK);
    gw.stop();
}
