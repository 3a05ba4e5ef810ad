//! The gateway end to end against a real Postgres: through the router
//! (`oneshot`) and through a real socket.

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use bloomgate::resource::RebuildError;
use common::*;

#[tokio::test]
async fn miss_then_hit_serves_the_row_once_from_the_database() {
    let db = TestDb::new().await;
    db.seed_users(100).await;
    let gw = started(config(&db.url, "")).await;
    let q0 = queries(&gw);

    let first = get(&gw, "/users/7").await;
    assert_eq!(first.status, StatusCode::OK);
    assert_eq!(first.header("content-type"), "application/json");
    assert_eq!(first.header("cache-status"), "bloomgate; fwd=miss; stored");
    let row = first.json();
    assert_eq!(row["id"], 7);
    assert_eq!(row["email"], "u7@example.com");
    assert_eq!(row["name"], "User 7");
    assert_eq!(queries(&gw), q0 + 1);

    let second = get(&gw, "/users/7").await;
    assert_eq!(second.status, StatusCode::OK);
    assert_eq!(second.header("cache-status"), "bloomgate; hit");
    assert_eq!(second.body, first.body);
    assert_eq!(second.header("etag"), first.header("etag"));
    assert_eq!(queries(&gw), q0 + 1, "a hit must not query");
}

#[tokio::test]
async fn filtered_keys_are_404_without_any_query() {
    let db = TestDb::new().await;
    db.seed_users(1000).await;
    for mode in ["exact", "bloom"] {
        let mut cfg = config(&db.url, "");
        cfg.resources[0].filter.mode = Some(serde_json::from_value(mode.into()).unwrap());
        let gw = started(cfg).await;
        assert_eq!(gw.resources[0].filter_stats().unwrap().kind, mode);
        let q0 = queries(&gw);
        let mut filtered = 0;
        let mut forwarded = 0;
        for id in 1_000_001..1_000_501 {
            let r = get(&gw, &format!("/users/{id}")).await;
            assert_eq!(r.status, StatusCode::NOT_FOUND);
            assert_eq!(r.json()["error"], "not_found");
            match r.header("cache-status") {
                "bloomgate; detail=filter-absent" => filtered += 1,
                s => {
                    assert!(s.contains("fwd=miss"), "{s}");
                    forwarded += 1;
                }
            }
        }
        // Only what the filter let through reached the database.
        assert_eq!(queries(&gw) - q0, forwarded, "{mode}");
        if mode == "exact" {
            assert_eq!(filtered, 500, "an exact set has no false positives");
        } else {
            assert!(
                filtered >= 480,
                "bloom at p=0.01 let {forwarded} of 500 through"
            );
        }
    }
}

#[tokio::test]
async fn uuid_resource_serves_rows_and_rejects_absent_keys() {
    let db = TestDb::new().await;
    db.exec(
        "INSERT INTO articles (id, title, body) SELECT md5('a' || g)::uuid, 'Title ' || g, 'x'
         FROM generate_series(1, 50) g",
    )
    .await;
    let gw = started(config(&db.url, "")).await;
    let id: uuid::Uuid = sqlx::query_scalar("SELECT md5('a7')::uuid")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let r = get(&gw, &format!("/articles/{id}")).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.json()["title"], "Title 7");
    // The simple (unhyphenated, upper-case) form names the same row.
    let simple = id.simple().to_string().to_uppercase();
    let r = get(&gw, &format!("/articles/{simple}")).await;
    assert_eq!(r.header("cache-status"), "bloomgate; hit");
    let r = get(&gw, &format!("/articles/{}", uuid::Uuid::new_v4())).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn absent_rows_are_cached_negatively() {
    let db = TestDb::new().await;
    db.seed_users(10).await;
    // Without notifications: this is about what happens before they arrive.
    let gw = started(config(&db.url, "freshness = \"off\"")).await;
    // Deleted after the filter was built: the filter still says "maybe".
    db.exec("DELETE FROM users WHERE id = 5").await;
    let q0 = queries(&gw);
    let r = get(&gw, "/users/5").await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    assert_eq!(
        r.header("cache-status"),
        "bloomgate; fwd=miss; stored; detail=negative"
    );
    let r = get(&gw, "/users/5").await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    assert_eq!(r.header("cache-status"), "bloomgate; hit; detail=negative");
    assert_eq!(queries(&gw), q0 + 1);
    let users = gw.resource("users").unwrap();
    assert_eq!(
        users
            .stats
            .observed_absent
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
}

#[tokio::test]
async fn concurrent_requests_for_a_cold_key_make_one_query() {
    let db = TestDb::new().await;
    db.seed_users(10).await;
    db.add_slow_view().await;
    let gw = started(config(&db.url, SLOW)).await;
    db.set_delay(0.3).await;
    let q0 = queries(&gw);
    let mut tasks = Vec::new();
    for _ in 0..100 {
        let gw = gw.clone();
        tasks.push(tokio::spawn(async move { get(&gw, "/slow/3").await }));
    }
    let mut collapsed = 0;
    for t in tasks {
        let r = t.await.unwrap();
        assert_eq!(r.status, StatusCode::OK);
        assert_eq!(r.json()["id"], 3);
        if r.header("cache-status").contains("collapsed") {
            collapsed += 1;
        }
    }
    assert_eq!(queries(&gw) - q0, 1);
    assert!(
        collapsed >= 90,
        "only {collapsed} requests waited on the shared load"
    );
}

#[tokio::test]
async fn malformed_keys_are_400_json_and_touch_nothing() {
    let db = TestDb::new().await;
    db.seed_users(10).await;
    let gw = started(config(&db.url, "[server]\nmax_key_length = 40")).await;
    let q0 = queries(&gw);
    let long = "1".repeat(41);
    let cases = [
        ("/users/abc", "not an integer"),
        ("/users/1.5", "not an integer"),
        ("/users/+1", "not an integer"),
        ("/users/99999999999999999999", "out of range"),
        ("/users/%zz", "percent-encoding"),
        ("/users/1%2", "percent-encoding"),
        ("/users/%00", "control characters"),
        ("/users/%ff", "UTF-8"),
        ("/users/%2531", "not an integer"),
        (&format!("/users/{long}"), "longer than 40"),
        ("/articles/not-a-uuid", "not a valid UUID"),
        (
            "/articles/67e55044-10b1-426f-9247-bb680e5fe0c",
            "not a valid UUID",
        ),
    ];
    for (path, message) in cases {
        let r = get(&gw, path).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{path}");
        let body = r.json();
        assert_eq!(body["error"], "malformed_key", "{path}");
        let text = body["message"].as_str().unwrap();
        assert!(text.contains(message), "{path}: {text}");
        assert_eq!(r.header("cache-status"), "bloomgate; detail=malformed-key");
    }
    assert_eq!(
        queries(&gw),
        q0,
        "a malformed key must not reach the database"
    );
}

#[tokio::test]
async fn readiness_follows_the_preload() {
    let db = TestDb::new().await;
    db.seed_users(10).await;
    let gw = gateway(config(&db.url, ""));
    assert_eq!(get(&gw, "/healthz").await.status, StatusCode::OK);
    let r = get(&gw, "/readyz").await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        r.json()["loading"],
        serde_json::json!(["users", "articles"])
    );
    let r = get(&gw, "/users/1").await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(r.header("retry-after"), "1");
    assert_eq!(r.json()["error"], "not_ready");
    assert_eq!(queries(&gw), 0);

    gw.start().await.unwrap();
    assert_eq!(get(&gw, "/readyz").await.status, StatusCode::OK);
    assert_eq!(get(&gw, "/users/1").await.status, StatusCode::OK);
}

#[tokio::test]
async fn forced_rebuild_serves_rows_inserted_behind_the_gateway() {
    let db = TestDb::new().await;
    db.seed_users(100).await;
    // Without notifications: this is about what happens before they arrive.
    let gw = started(config(&db.url, "freshness = \"off\"")).await;
    let users = gw.resource("users").unwrap();
    let gen0 = users.generation();
    db.exec("INSERT INTO users (id, email, name) VALUES (5000, 'new@example.com', 'New')")
        .await;
    // Dense ids: the exact set, so the new key is certainly rejected until
    // the filter is rebuilt.
    let r = get(&gw, "/users/5000").await;
    assert_eq!(r.header("cache-status"), "bloomgate; detail=filter-absent");

    let report = users.rebuild(true).await.unwrap();
    assert_eq!(report.keys, 101);
    assert_eq!(users.generation(), gen0 + 1);
    let r = get(&gw, "/users/5000").await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.json()["email"], "new@example.com");
}

#[tokio::test]
async fn live_inserts_during_a_rebuild_survive_the_swap() {
    let db = TestDb::new().await;
    db.seed_users(20).await;
    db.add_slow_view().await;
    let gw = started(config(&db.url, SLOW)).await;
    let slow = gw.resource("slow").unwrap().clone();
    // Every row the rebuild scans now takes 50 ms: a window of about 2 s.
    db.set_delay(0.05).await;
    let rebuild = tokio::spawn({
        let slow = slow.clone();
        async move { slow.rebuild(true).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    // Keys announced while the rebuild scans: they have no rows, so they
    // are not in its snapshot, and only the journal can carry them over.
    let announced: Vec<_> = (50_000..50_200).map(bloomgate::key::Key::Int).collect();
    for key in &announced {
        slow.insert_key(key).await;
    }
    assert!(
        !rebuild.is_finished(),
        "the inserts must land during the rebuild"
    );
    let report = rebuild.await.unwrap().unwrap();
    assert_eq!(report.replayed, 200);
    for key in &announced {
        assert!(
            slow.filter_contains(key),
            "{key} was inserted during the rebuild and lost by the swap"
        );
    }
}

#[tokio::test]
async fn a_shrunken_scan_is_refused_unless_forced() {
    let db = TestDb::new().await;
    db.seed_users(100).await;
    // Without notifications: this is about what happens before they arrive.
    let gw = started(config(&db.url, "freshness = \"off\"")).await;
    let users = gw.resource("users").unwrap();
    db.exec("DELETE FROM users WHERE id > 30").await;
    let err = users.rebuild(false).await.unwrap_err();
    assert!(
        matches!(
            err,
            RebuildError::Shrunk {
                old: 100,
                new: 30,
                ..
            }
        ),
        "{err}"
    );
    // The old filter still serves: a deleted key passes it and the database
    // answers.
    let r = get(&gw, "/users/50").await;
    assert_eq!(
        r.header("cache-status"),
        "bloomgate; fwd=miss; stored; detail=negative"
    );

    users.rebuild(true).await.unwrap();
    let r = get(&gw, "/users/51").await;
    assert_eq!(r.header("cache-status"), "bloomgate; detail=filter-absent");
}

#[tokio::test]
async fn database_outage_is_503_for_cold_keys_only_and_recovers() {
    let db = TestDb::new().await;
    db.seed_users(10).await;
    let proxy = Proxy::start().await;
    let gw = started(config(&proxy.url(&db), "")).await;
    assert_eq!(get(&gw, "/users/1").await.status, StatusCode::OK);

    proxy.cut();
    let r = get(&gw, "/users/1").await;
    assert_eq!(
        (r.status, r.header("cache-status")),
        (StatusCode::OK, "bloomgate; hit")
    );
    let r = get(&gw, "/users/123456").await;
    assert_eq!(r.header("cache-status"), "bloomgate; detail=filter-absent");
    let began = Instant::now();
    let r = get(&gw, "/users/2").await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(r.header("retry-after"), "1");
    let body = r.json();
    assert_eq!(body["error"], "database_unavailable");
    let text = body.to_string();
    assert!(
        !text.contains("SELECT") && !text.contains("127.0.0.1"),
        "{text}"
    );
    assert!(
        began.elapsed() < Duration::from_secs(5),
        "took {:?}",
        began.elapsed()
    );
    // Errors are not cached, and a failed rebuild keeps the old filter.
    let users = gw.resource("users").unwrap();
    assert!(users.rebuild(true).await.is_err());
    assert!(users.filter_stats().is_some());

    proxy.restore();
    // While the gateway holds the database down, one request per 250 ms
    // tries it and the others get 503 at once (`db::outage`): the first
    // try after the restore is answered.
    fresh(&gw, "/users/2", |r| {
        assert!(
            r.status == StatusCode::OK || r.header("retry-after") == "1",
            "{:?} {:?}",
            r.status,
            r.body
        );
        r.status == StatusCode::OK
    })
    .await;
}

#[tokio::test]
async fn etag_and_if_none_match_give_304() {
    let db = TestDb::new().await;
    db.seed_users(3).await;
    let gw = started(config(&db.url, "")).await;
    let etag = get(&gw, "/users/2").await.header("etag").to_string();
    assert!(etag.starts_with('"') && etag.len() == 18, "{etag}");
    let req = Request::get("/users/2")
        .header("if-none-match", format!("W/\"nope\", {etag}"))
        .body(Body::empty())
        .unwrap();
    let r = get_with(&gw, req).await;
    assert_eq!(r.status, StatusCode::NOT_MODIFIED);
    assert!(r.body.is_empty());
    assert_eq!(r.header("etag"), etag);
    let req = Request::get("/users/2")
        .header("if-none-match", "\"other\"")
        .body(Body::empty())
        .unwrap();
    assert_eq!(get_with(&gw, req).await.status, StatusCode::OK);
}

#[tokio::test]
async fn head_works_and_other_methods_are_405() {
    let db = TestDb::new().await;
    db.seed_users(3).await;
    let gw = started(config(&db.url, "")).await;
    let req = Request::head("/users/1").body(Body::empty()).unwrap();
    let r = get_with(&gw, req).await;
    assert_eq!(r.status, StatusCode::OK);
    assert!(r.body.is_empty());
    let req = Request::builder()
        .method(Method::DELETE)
        .uri("/users/1")
        .body(Body::empty())
        .unwrap();
    let r = get_with(&gw, req).await;
    assert_eq!(r.status, StatusCode::METHOD_NOT_ALLOWED);
    assert!(r.header("allow").contains("GET"), "{:?}", r.headers);
    let r = get(&gw, "/nope/1").await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    assert_eq!(r.json()["error"], "no_route");
}

#[tokio::test]
async fn filter_and_cache_can_be_disabled() {
    let db = TestDb::new().await;
    db.seed_users(3).await;
    let gw = started(config(
        &db.url,
        "[filter]\nenabled = false\n[cache]\nenabled = false",
    ))
    .await;
    let q0 = queries(&gw);
    for _ in 0..3 {
        let r = get(&gw, "/users/1").await;
        assert_eq!(
            (r.status, r.header("cache-status")),
            (StatusCode::OK, "bloomgate; fwd=bypass")
        );
    }
    let r = get(&gw, "/users/999").await;
    assert_eq!(
        (r.status, r.header("cache-status")),
        (StatusCode::NOT_FOUND, "bloomgate; fwd=bypass")
    );
    assert_eq!(queries(&gw) - q0, 4);
}

#[tokio::test]
async fn a_missing_table_is_a_start_up_error_naming_it() {
    let db = TestDb::new().await;
    let extra = r#"
        [[resource]]
        name = "ghosts"
        route = "/ghosts/{id}"
        table = "no_such_table"
        key_column = "id"
        key_type = "bigint"
        columns = ["id"]
    "#;
    let gw = gateway(config(&db.url, extra));
    let err = tokio::time::timeout(Duration::from_secs(20), gw.start())
        .await
        .expect("a permanent error must not be retried forever")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("ghosts") && err.contains("no_such_table"),
        "{err}"
    );
}

#[tokio::test]
async fn over_a_real_socket_with_graceful_shutdown() {
    let db = TestDb::new().await;
    db.seed_users(10).await;
    db.add_slow_view().await;
    let gw = gateway(config(&db.url, SLOW));
    let served = serve_socket(&gw, None).await;
    let addr = served.addr;
    let client = reqwest::Client::new();
    let base = format!("http://{addr}");

    let r = client.get(format!("{base}/users/4")).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert!(r.headers().contains_key("x-request-id"));
    assert_eq!(r.headers()["cache-status"], "bloomgate; fwd=miss; stored");
    let r = client
        .get(format!("{base}/users/4444"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::NOT_FOUND);

    db.set_delay(0.5).await;
    let in_flight = tokio::spawn({
        let client = client.clone();
        let url = format!("{base}/slow/2");
        async move { client.get(url).send().await }
    });
    tokio::time::sleep(Duration::from_millis(150)).await;
    let shutdown = tokio::spawn(served.shutdown());
    let r = in_flight
        .await
        .unwrap()
        .expect("the in-flight request must complete");
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(r.json::<serde_json::Value>().await.unwrap()["id"], 2);
    shutdown.await.unwrap().unwrap();
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "still accepting after shutdown"
    );
    let _ = Arc::strong_count(&gw);
}

#[tokio::test]
async fn scheduled_rebuilds_swap_in_fresh_filters() {
    let db = TestDb::new().await;
    db.seed_users(1000).await;
    let mut cfg = config(
        &db.url,
        "freshness = \"off\"\n[filter]\nrebuild_interval = \"1s\"",
    );
    cfg.resources[0].filter.mode = Some(serde_json::from_value("bloom".into()).unwrap());
    let gw = gateway(cfg);
    let served = serve_socket(&gw, None).await;
    let users = gw.resource("users").unwrap().clone();
    let first = users.filter_stats().unwrap().key_fingerprint;
    // Rows inserted behind the gateway's back (no notifications here) are
    // picked up by the schedule alone.
    db.exec("INSERT INTO users (id, email, name) VALUES (77777, 'late@example.com', 'Late')")
        .await;
    let began = Instant::now();
    while users.generation() < 3 {
        assert!(
            began.elapsed() < Duration::from_secs(10),
            "no scheduled rebuild"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let last = users.filter_stats().unwrap().key_fingerprint;
    assert_ne!(first, last, "every build draws a fresh hash key");
    let r = reqwest::get(format!("http://{}/users/77777", served.addr))
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    served.shutdown().await.unwrap();
}

/// `auto` on an empty uuid (or text) table does not stay an exact integer
/// set, which answers "maybe" for every byte key and so sends every absent
/// key to Postgres: an empty table rejects everything.
#[tokio::test]
async fn an_empty_uuid_or_text_table_rejects_every_key_without_a_query() {
    let db = TestDb::new().await;
    db.add_things(&[]).await;
    // `articles` (uuid) is empty too; `auto` is the default mode.
    let gw = started(config(&db.url, &format!("freshness = \"off\"\n{THINGS}"))).await;
    for name in ["articles", "things"] {
        assert_eq!(
            gw.resource(name).unwrap().filter_stats().unwrap().kind,
            "bloom",
            "{name}"
        );
    }
    let q0 = queries(&gw);
    for path in [
        "/articles/6f1c2a4e-8a59-4a4e-9d8e-0a1b2c3d4e5f",
        "/articles/00000000-0000-0000-0000-000000000000",
        "/things/anything",
        "/things/1",
    ] {
        let r = get(&gw, path).await;
        assert_eq!(
            (r.status, r.header("cache-status")),
            (StatusCode::NOT_FOUND, "bloomgate; detail=filter-absent"),
            "{path}"
        );
    }
    assert_eq!(queries(&gw) - q0, 0, "an empty table sent queries");
}
