//! Issue 10, suspicion: loads detached when a client disconnects (or an
//! HTTP/2 stream is reset) no longer count against `max_concurrency`, so
//! tasks, queries and memory grow with the rate of cold requests whose
//! clients go away.

use crate::common;

use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use common::*;
use tower::ServiceExt;

/// 40 cold requests in a row, each abandoned by its client 5 ms in (while
/// its load waits on a 2 s query): the loads they leave behind must stay
/// within `max_concurrency`, like the requests did.
#[tokio::test]
async fn loads_left_by_departed_clients_count_against_max_concurrency() {
    let db = TestDb::new().await;
    db.seed_users(50).await;
    db.add_slow_view().await;
    let extra = format!("freshness = \"off\"\n[server]\nmax_concurrency = 4\n{SLOW}");
    let gw = started(config(&db.url, &extra)).await;
    let app = bloomgate::http::app(gw.clone());
    db.set_delay(2.0).await;
    let metrics = tokio::runtime::Handle::current().metrics();
    let tasks_before = metrics.num_alive_tasks();
    let mut statuses = Vec::new();
    for id in 1..=40 {
        let req = Request::get(format!("/slow/{id}"))
            .body(Body::empty())
            .unwrap();
        // The client goes away after 5 ms, unless answered by then.
        match tokio::time::timeout(Duration::from_millis(5), app.clone().oneshot(req)).await {
            Ok(resp) => statuses.push(resp.unwrap().status()),
            Err(_) => statuses.push(StatusCode::REQUEST_TIMEOUT),
        }
    }
    let detached = metrics.num_alive_tasks() - tasks_before;
    let running: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity
          WHERE datname = current_database() AND state = 'active' AND query LIKE '%slow_users%'
            AND pid <> pg_backend_pid()",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    println!(
        "after 40 abandoned cold requests: {detached} detached load tasks, {running} queries running; statuses {statuses:?}"
    );
    assert!(
        detached <= 4,
        "{detached} loads outlive their departed clients with max_concurrency = 4"
    );
    assert!(running <= 4, "{running} row queries running");
    // Refused loads are answered at once as overloaded (503), like shed
    // requests.
    assert!(
        statuses.contains(&StatusCode::SERVICE_UNAVAILABLE),
        "{statuses:?}"
    );
    // Once the slow loads are done, the slots are free again.
    db.set_delay(0.0).await;
    let began = std::time::Instant::now();
    loop {
        let r = get(&gw, "/slow/45").await;
        if r.status == StatusCode::OK {
            break;
        }
        assert!(began.elapsed() < Duration::from_secs(10), "{:?}", r.status);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
