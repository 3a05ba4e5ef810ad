//! A flood of absent keys, measured in Postgres itself: the table's
//! `idx_scan` counts every row lookup that reached it. Alone in its test
//! binary so that the process's memory is the gateway's.

mod common;

use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use common::*;
use futures_util::StreamExt;
use rand::{Rng, SeedableRng};
use tower::ServiceExt;

const REQUESTS: usize = 200_000;
const P: f64 = 0.01;

fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches(" kB").parse().ok())
        .unwrap()
}

/// `idx_scan` of `users`, after making the gateway's backends exit: a
/// backend reports its statistics when it exits (otherwise only when idle
/// for a while), and the pool opens new connections as needed.
async fn idx_scan(db: &TestDb) -> i64 {
    sqlx::query(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
         WHERE datname = current_database() AND application_name = 'bloomgate'",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    for _ in 0..100 {
        let left: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND application_name = 'bloomgate'",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap();
        if left == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    sqlx::query_scalar(
        "SELECT coalesce(idx_scan, 0) FROM pg_stat_user_tables WHERE relname = 'users'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_absent_keys_costs_at_most_1_5_p_queries() {
    let db = TestDb::new().await;
    db.seed_users(100_000).await;
    let mut cfg = config(
        &db.url,
        "freshness = \"off\"\n[cache]\nnegative_ttl = \"10m\"",
    );
    // A Bloom filter (an exact set would make this trivially zero).
    cfg.resources[0].filter.mode = Some(serde_json::from_value("bloom".into()).unwrap());
    cfg.resources[0].filter.false_positive_rate = Some(P);
    let gw = started(cfg).await;
    let app = bloomgate::http::app(gw.clone());
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let keys: Vec<i64> = (0..REQUESTS)
        .map(|_| rng.random_range(1_000_000_000..1_000_000_000_000))
        .collect();

    let send = |keys: Vec<i64>| {
        let app = app.clone();
        async move {
            futures_util::stream::iter(keys)
                .map(|k| {
                    let app = app.clone();
                    async move {
                        let req = Request::get(format!("/users/{k}"))
                            .body(Body::empty())
                            .unwrap();
                        app.oneshot(req).await.unwrap().status()
                    }
                })
                .buffer_unordered(64)
                .fold(0usize, |n, s| async move {
                    assert_eq!(s, StatusCode::NOT_FOUND);
                    n + 1
                })
                .await
        }
    };

    let scans0 = idx_scan(&db).await;
    let ours0 = queries(&gw);
    let rss0 = rss_kib();
    assert_eq!(send(keys.clone()).await, REQUESTS);
    let rss1 = rss_kib();
    let scans1 = idx_scan(&db).await;
    let ours1 = queries(&gw);
    let reached = scans1 - scans0;
    let bound = (1.5 * P * REQUESTS as f64) as i64;
    println!(
        "flood: {REQUESTS} absent keys, {reached} reached Postgres (idx_scan; bound {bound}), our counter {}; RSS {} -> {} KiB",
        ours1 - ours0,
        rss0,
        rss1
    );
    assert!(
        reached <= bound,
        "{reached} queries for {REQUESTS} absent keys"
    );
    assert_eq!(
        reached as u64,
        ours1 - ours0,
        "Postgres and our counter disagree"
    );

    // The same keys again: the false positives are negative entries now.
    assert_eq!(send(keys).await, REQUESTS);
    let scans2 = idx_scan(&db).await;
    assert_eq!(
        scans2 - scans1,
        0,
        "repeated absent keys reached the database"
    );

    // Memory is bounded by the filter and the caches, not the flood.
    let grown_mib = rss1.saturating_sub(rss0) / 1024;
    assert!(
        grown_mib < 128,
        "RSS grew by {grown_mib} MiB during the flood"
    );
}
