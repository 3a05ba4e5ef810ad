//! Rebuilds: coalesced requests owned by the gateway, cancelled at stop and
//! shutdown, the high-water mark, the shrink guard's merge, and rebuilds
//! when the filter's protection decays (issue 10, items 5, 6, 7, 10, 12).
//! Driven through `Resource`'s API, not through a change feed.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use axum::http::StatusCode;
use bloomgate::key::Key;
use bloomgate::rebuild::Reason;
use bloomgate::resource::{Provenance, RebuildError, Resource};
use common::*;

/// Queries of the `slow` resource's scans running on the server (count or
/// COPY, both read the `slow_users` view).
async fn scans_running(db: &TestDb) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
         AND query LIKE '%slow_users%' AND state = 'active' AND pid <> pg_backend_pid()",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

const QUIET: &str = "freshness = \"off\"";

#[tokio::test]
async fn two_hundred_rebuild_requests_cost_at_most_two_scans() {
    let db = TestDb::new().await;
    db.seed_users(20).await;
    db.add_slow_view().await;
    let gw = started(config(&db.url, &format!("{QUIET}\n{SLOW}"))).await;
    let slow = gw.resource("slow").unwrap().clone();
    // Each scan reads the view twice (count, keys): ~0.4 s a scan.
    db.set_delay(0.01).await;
    let q0 = queries(&gw);
    let first = slow.request_rebuild(Reason::Rescan, false);
    eventually("the first rebuild runs", || async {
        slow.rebuild_status().running.is_some()
    })
    .await;
    // 200 distinct requests, as 200 forged RESCAN/TRUNCATE payloads would
    // make, one of them forced.
    let reasons = [
        Reason::Rescan,
        Reason::Truncate,
        Reason::Resync,
        Reason::Admin,
    ];
    let tickets: Vec<_> = (0..200)
        .map(|i| slow.request_rebuild(reasons[i % 4], i == 99))
        .collect();
    let pending = slow.rebuild_status().pending.expect("one pending");
    assert_eq!((pending.requests, pending.force), (200, true));
    assert!(first.outcome().await.unwrap().is_ok());
    for t in tickets {
        assert!(t.id() == pending.ticket && t.outcome().await.unwrap().is_ok());
    }
    let scans = queries(&gw) - q0;
    println!("200 requests while one rebuild ran: {scans} scans");
    assert_eq!(scans, 2);

    // The listener's way (a task per notification, each awaiting
    // `rebuild`) coalesces the same.
    let q0 = queries(&gw);
    let waiters: Vec<_> = (0..200)
        .map(|_| {
            let slow = slow.clone();
            tokio::spawn(async move { slow.rebuild(false).await })
        })
        .collect();
    for w in waiters {
        assert!(w.await.unwrap().is_ok());
    }
    let scans = queries(&gw) - q0;
    println!("200 awaited rebuilds: {scans} scans");
    assert!(scans <= 2, "{scans} scans for 200 requests");
}

#[tokio::test]
async fn gateway_stop_cancels_a_running_rebuild_and_closes_its_journal() {
    let db = TestDb::new().await;
    db.seed_users(20).await;
    db.add_slow_view().await;
    let gw = started(config(&db.url, &format!("{QUIET}\n{SLOW}"))).await;
    let slow = gw.resource("slow").unwrap().clone();
    // A scan of 20 s per pass.
    db.set_delay(1.0).await;
    let running = slow.request_rebuild(Reason::Admin, false);
    eventually("the scan runs", || async {
        scans_running(&db).await > 0 && slow.journal_open()
    })
    .await;
    let pending = slow.request_rebuild(Reason::Schedule, false);
    gw.stop();
    assert!(running.outcome().await.is_none(), "stopped, not finished");
    assert!(pending.outcome().await.is_none());
    let began = Instant::now();
    eventually("the scan's query is cancelled on the server", || async {
        scans_running(&db).await == 0
    })
    .await;
    println!("scan cancelled {:?} after Gateway::stop", began.elapsed());
    eventually("the journal is closed", || async { !slow.journal_open() }).await;
    let s = slow.rebuild_status();
    assert!(s.stopped && s.running.is_none() && s.pending.is_none());
    assert!(matches!(
        slow.rebuild(true).await,
        Err(RebuildError::Cancelled)
    ));
    assert_eq!(slow.generation(), 1, "only the first build swapped");
}

#[tokio::test]
async fn shutdown_cancels_a_running_scan_within_the_deadline() {
    let db = TestDb::new().await;
    db.seed_users(20).await;
    db.add_slow_view().await;
    let gw = gateway(config(
        &db.url,
        &format!("{QUIET}\n[server]\nshutdown_timeout = \"200ms\"\n{SLOW}"),
    ));
    let served = serve_socket(&gw, None).await;
    let slow = gw.resource("slow").unwrap().clone();
    db.set_delay(1.0).await;
    let ticket = slow.request_rebuild(Reason::Admin, false);
    eventually("the scan runs", || async { scans_running(&db).await > 0 }).await;
    let began = Instant::now();
    // `shutdown` panics if `serve` has not returned within 10 s; the scan
    // alone would hold it for 40 s.
    served.shutdown().await.unwrap();
    let stopped = began.elapsed();
    assert!(ticket.outcome().await.is_none());
    eventually("the scan's query is cancelled on the server", || async {
        scans_running(&db).await == 0
    })
    .await;
    println!(
        "shutdown_timeout 200ms, 40 s scan running: serve returned after {stopped:?}, scan cancelled on the server after {:?}",
        began.elapsed()
    );
    assert!(!slow.journal_open());
}

fn verifying() -> String {
    format!("{QUIET}\n[filter]\nverify_above_high_water = true\nverify_budget = 100")
}

#[tokio::test]
async fn a_forged_insert_cannot_raise_the_high_water_mark() {
    let db = TestDb::new().await;
    db.seed_users(100).await;
    let gw = started(config(&db.url, &verifying())).await;
    let users = gw.resource("users").unwrap();
    assert_eq!(users.high_water(), Some(100));
    // What a forged `NOTIFY` INSERT of the largest bigint delivers.
    users
        .insert_key_from(&Key::Int(i64::MAX), Provenance::Announced)
        .await;
    assert!(
        users.filter_contains(&Key::Int(i64::MAX)),
        "in the filter anyway"
    );
    eventually("the forged key is checked", || async {
        users.stats.announced_unconfirmed.load(Ordering::Relaxed) == 1
    })
    .await;
    assert_eq!(users.high_water(), Some(100));
    // A row committed without a notification is still found.
    insert_user(&db.pool, 1000).await;
    let r = get(&gw, "/users/1000").await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.header("cache-status"));
    assert_eq!(users.high_water(), Some(1000), "a row read raises it");

    // An announced key whose row exists raises it once confirmed; a trusted
    // one (a WAL change) at once.
    insert_user(&db.pool, 2000).await;
    users
        .insert_key_from(&Key::Int(2000), Provenance::Announced)
        .await;
    eventually("the announced row is confirmed", || async {
        users.high_water() == Some(2000)
    })
    .await;
    users
        .insert_key_from(&Key::Int(3000), Provenance::Trusted)
        .await;
    assert_eq!(users.high_water(), Some(3000));
}

#[tokio::test]
async fn a_rebuild_resets_the_high_water_mark_to_what_exists() {
    let db = TestDb::new().await;
    db.seed_users(100).await;
    let gw = started(config(&db.url, &verifying())).await;
    let users = gw.resource("users").unwrap();
    let huge = 9_000_000_000_000_000_000i64;
    insert_user(&db.pool, huge).await;
    assert_eq!(
        get(&gw, &format!("/users/{huge}")).await.status,
        StatusCode::OK
    );
    assert_eq!(users.high_water(), Some(huge));
    db.exec(&format!("DELETE FROM users WHERE id = {huge}"))
        .await;
    users.rebuild(false).await.unwrap();
    assert_eq!(users.high_water(), Some(100), "reset by the scan");
    insert_user(&db.pool, 1000).await;
    let r = get(&gw, "/users/1000").await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.header("cache-status"));
}

#[tokio::test]
async fn forged_inserts_cannot_grow_an_exact_set_without_bound() {
    let db = TestDb::new().await;
    db.seed_users(100).await;
    let gw = started(config(&db.url, QUIET)).await;
    let users = gw.resource("users").unwrap();
    assert_eq!(users.filter_stats().unwrap().kind, "exact");
    let limit = users.protection().unwrap().rebuild_at_inserts.unwrap();
    assert_eq!(limit, 1024, "1.0 x max(100 keys, 1024)");
    // Random ids, as a forger would send: ~20 bytes each in the bitmap.
    let forged: Vec<Key> = (1..=limit as i64 + 1)
        .map(|i| Key::Int(i.wrapping_mul(0x9E37_79B9_7F4A_7C15u64 as i64)))
        .collect();
    for (i, k) in forged.iter().enumerate() {
        assert!(
            !users.protection().unwrap().rebuild_requested,
            "early at {i}"
        );
        users.insert_key_from(k, Provenance::Announced).await;
    }
    assert!(users.protection().unwrap().rebuild_requested);
    eventually("the growth bound rebuilds", || async {
        users.generation() > 1
    })
    .await;
    let b = users.last_build().unwrap();
    assert_eq!((b.keys, b.reasons.clone()), (100, vec!["growth"]));
    assert_eq!(users.filter_stats().unwrap().keys, 100);
    assert!(
        forged
            .iter()
            .all(|k| !users.filter_contains(k) || matches!(k, Key::Int(1..=100)))
    );
}

/// Lost notifications, then a delete of most of the table: the shrink guard
/// refuses the swap, and the keys the scan found are served anyway.
#[tokio::test]
async fn a_refused_rebuild_still_serves_every_key_it_found() {
    for mode in ["auto", "bloom"] {
        let db = TestDb::new().await;
        db.seed_users(100).await;
        // No notifications at all: these rows are "lost".
        let gw = started(config(
            &db.url,
            &format!("{QUIET}\n[filter]\nmode = \"{mode}\""),
        ))
        .await;
        let users = gw.resource("users").unwrap();
        // 65 % deleted, 10 rows added: 45 keys, below the 50 the guard wants.
        db.exec("DELETE FROM users WHERE id > 35").await;
        for id in 5000..5010 {
            insert_user(&db.pool, id).await;
        }
        let err = users.rebuild(false).await.unwrap_err();
        // A key a Bloom filter passes already (a false positive) needs no
        // adding: "recovered" counts the ones it rejected.
        let RebuildError::Shrunk {
            old: 100,
            new: 45,
            recovered,
            ..
        } = err
        else {
            panic!("{mode}: {err}");
        };
        assert!(
            recovered == 10 || (mode == "bloom" && recovered <= 10),
            "{mode}: {recovered}"
        );
        for id in 5000..5010 {
            let r = get(&gw, &format!("/users/{id}")).await;
            assert_eq!(
                r.status,
                StatusCode::OK,
                "{mode}: /users/{id}: {}",
                r.header("cache-status")
            );
        }
        assert_eq!(users.generation(), 1, "{mode}: the swap was refused");
        assert_eq!(users.stats.refused_swaps.load(Ordering::Relaxed), 1);
        let refusal = users.last_refusal().unwrap();
        assert_eq!(
            (refusal.keys_found, refusal.recovered, refusal.min_keys),
            (45, recovered, 50)
        );
        assert_eq!(users.last_outcome().unwrap().result, "refused");
    }
}

async fn bloom_resource(db: &TestDb) -> (Arc<bloomgate::gateway::Gateway>, Arc<Resource>) {
    let gw = started(config(
        &db.url,
        &format!(
            "{QUIET}\n[filter]\nmode = \"bloom\"\nheadroom = 1.0\nrebuild_insert_fraction = 0"
        ),
    ))
    .await;
    let users = gw.resource("users").unwrap().clone();
    (gw, users)
}

#[tokio::test]
async fn a_false_positive_rate_past_twice_the_target_rebuilds() {
    let db = TestDb::new().await;
    db.seed_users(1000).await;
    let (_gw, users) = bloom_resource(&db).await;
    let p = users.protection().unwrap();
    let limit = p.rebuild_at_keys.unwrap();
    assert_eq!(p.rebuild_fp_rate, Some(0.02));
    assert!(p.estimated_fp_rate <= 0.01, "{p:?}");
    assert!(limit > 1000 && limit < 2000, "{limit}");
    let mut id = 1_000_000i64;
    while !users.protection().unwrap().rebuild_requested {
        let p = users.protection().unwrap();
        assert!(p.keys <= limit, "past the limit and not requested: {p:?}");
        users
            .insert_key_from(&Key::Int(id), Provenance::Trusted)
            .await;
        id += 1;
    }
    let p = users.protection().unwrap();
    println!(
        "rebuild requested at {} keys (limit {limit}), estimated FP {:.4}, after {} live inserts",
        p.keys,
        p.estimated_fp_rate,
        id - 1_000_000
    );
    assert!(p.keys == limit + 1 && p.estimated_fp_rate > 0.02, "{p:?}");
    eventually("the rebuild ran", || async { users.generation() > 1 }).await;
    assert_eq!(users.last_build().unwrap().reasons, vec!["false_positives"]);
    let p = users.protection().unwrap();
    assert!(!p.rebuild_requested && p.estimated_fp_rate <= 0.01, "{p:?}");
}

#[tokio::test]
async fn deletes_past_a_quarter_of_the_keys_rebuild() {
    let db = TestDb::new().await;
    db.seed_users(1000).await;
    let gw = started(config(&db.url, QUIET)).await;
    let users = gw.resource("users").unwrap();
    assert_eq!(users.protection().unwrap().rebuild_at_deletes, Some(250));
    db.exec("DELETE FROM users WHERE id <= 300").await;
    for id in 1..=251i64 {
        assert!(
            !users.protection().unwrap().rebuild_requested,
            "early at {id}"
        );
        users.note_delete(&Key::Int(id)).await;
    }
    assert!(users.protection().unwrap().rebuild_requested);
    eventually("the rebuild ran", || async { users.generation() > 1 }).await;
    let b = users.last_build().unwrap();
    assert_eq!((b.keys, b.reasons.clone()), (700, vec!["deletes"]));
    assert_eq!(
        get(&gw, "/users/5").await.header("cache-status"),
        "bloomgate; detail=filter-absent"
    );
    assert_eq!(users.protection().unwrap().deletes_since_build, 0);
}

/// Cuts the database off and asks for a rebuild, which fails.
async fn fails_while_cut(proxy: &Proxy, users: &Resource, reason: Reason) {
    proxy.cut();
    let outcome = users
        .request_rebuild(reason, false)
        .outcome()
        .await
        .unwrap();
    assert!(matches!(outcome, Err(RebuildError::Db(_))), "{outcome:?}");
}

/// A rebuild asked for because the filter may lack keys (a feed's rescan,
/// here) fails: the database it scans is unreachable. It is asked for
/// again once the back-off passes, so a row whose change no feed delivered
/// is found as soon as the database is back, not at the next scheduled
/// rebuild (none here). Before the retry it answered 404 for good.
#[tokio::test]
async fn a_failed_rescan_is_retried_until_it_succeeds() {
    let db = TestDb::new().await;
    db.seed_users(10).await;
    db.exec("DELETE FROM users WHERE id = 5").await;
    let proxy = Proxy::start().await;
    let gw = started(config(&proxy.url(&db), QUIET)).await;
    let users = gw.resource("users").unwrap().clone();
    // Below the high-water mark, so only the filter answers; no feed.
    db.exec("INSERT INTO users (id, email, name) VALUES (5, 'back', 'Back')")
        .await;
    assert_eq!(get(&gw, "/users/5").await.status, StatusCode::NOT_FOUND);

    fails_while_cut(&proxy, &users, Reason::Rescan).await;
    let failed = users.rebuild_status().completed;
    proxy.restore();
    fresh(&gw, "/users/5", |r| r.status == StatusCode::OK).await;
    let status = users.rebuild_status();
    assert!(status.completed > failed, "{status:?}");
    assert!(users.stats.rebuild_retries.load(Ordering::Relaxed) >= 1);
    gw.stop();
}

/// A rebuild that only restores precision (the admin's, the schedule's)
/// is not retried when it fails: the next one comes anyway, and retrying
/// would scan a failing database for nothing.
#[tokio::test]
async fn a_failed_admin_rebuild_is_not_retried() {
    let db = TestDb::new().await;
    db.seed_users(10).await;
    let proxy = Proxy::start().await;
    let gw = started(config(&proxy.url(&db), QUIET)).await;
    let users = gw.resource("users").unwrap().clone();
    fails_while_cut(&proxy, &users, Reason::Admin).await;
    proxy.restore();
    let requests = users.rebuild_status().requests;
    // Past the first retry's back-off, with room to spare.
    tokio::time::sleep(bloomgate::resource::RETRY_FIRST * 3).await;
    assert_eq!(users.rebuild_status().requests, requests);
    assert_eq!(users.stats.rebuild_retries.load(Ordering::Relaxed), 0);
    gw.stop();
}
