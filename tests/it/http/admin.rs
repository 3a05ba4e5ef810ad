//! Metrics, the admin API and the OpenAPI document.

use crate::common;

use std::collections::BTreeSet;
use std::sync::Arc;

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use bloomgate::gateway::Gateway;
use common::*;

const TOKEN: &str = "s3cret-admin-token-for-tests";

async fn admin(gw: &Arc<Gateway>, method: Method, path: &str, token: Option<&str>) -> Resp {
    let mut req = Request::builder().method(method).uri(path);
    if let Some(t) = token {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    send(
        bloomgate::http::admin::app(gw.clone(), TOKEN),
        req.body(Body::empty()).unwrap(),
    )
    .await
}

/// The value of one sample line `name{labels} value` in the exposition.
fn sample(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            let (n, rest) = series.split_once('{').unwrap_or((series, "}"));
            if n != name {
                return None;
            }
            let got: BTreeSet<(String, String)> = rest
                .trim_end_matches('}')
                .split(',')
                .filter(|p| !p.is_empty())
                .filter_map(|p| p.split_once('='))
                .map(|(k, v)| (k.to_string(), v.trim_matches('"').to_string()))
                .collect();
            let want: BTreeSet<(String, String)> = labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            (got == want).then(|| value.parse().unwrap())
        })
}

#[tokio::test]
async fn metrics_follow_a_known_sequence_of_requests() {
    let db = TestDb::new().await;
    db.seed_users(10).await;
    let gw = started(config(&db.url, "freshness = \"off\"")).await;
    db.exec("DELETE FROM users WHERE id = 9").await;
    let before = scrape(&gw).await;
    let rows = |text: &str| {
        sample(
            text,
            "bloomgate_db_queries_total",
            &[
                ("resource", "users"),
                ("kind", "row"),
                ("target", "primary"),
            ],
        )
        .unwrap()
    };
    for path in [
        "/users/1",
        "/users/1",
        "/users/1",
        "/users/12345",
        "/users/abc",
        "/users/9",
        "/users/9",
    ] {
        get(&gw, path).await;
    }
    let m = admin(&gw, Method::GET, "/metrics", Some(TOKEN)).await;
    assert_eq!(m.status, StatusCode::OK);
    assert!(m.header("content-type").starts_with("text/plain"));
    let text = String::from_utf8(m.body.to_vec()).unwrap();
    let req = |o: &str| {
        sample(
            &text,
            "bloomgate_requests_total",
            &[("resource", "users"), ("outcome", o)],
        )
    };
    assert_eq!(req("miss"), Some(2.0), "{text}");
    assert_eq!(req("hit"), Some(2.0));
    assert_eq!(req("filtered"), Some(1.0));
    assert_eq!(req("bad_request"), Some(1.0));
    assert_eq!(req("negative_hit"), Some(1.0));
    assert_eq!(req("unavailable"), Some(0.0));
    let users = [("resource", "users")];
    assert_eq!(
        sample(
            &text,
            "bloomgate_filter_false_positives_observed_total",
            &users
        ),
        Some(1.0)
    );
    assert_eq!(sample(&text, "bloomgate_filter_keys", &users), Some(10.0));
    assert_eq!(
        sample(&text, "bloomgate_filter_hashes", &users),
        Some(0.0),
        "dense ids: exact set"
    );
    assert_eq!(sample(&text, "bloomgate_rebuilds_total", &users), Some(1.0));
    assert_eq!(
        sample(
            &text,
            "bloomgate_cache_entries",
            &[("resource", "users"), ("kind", "row")]
        ),
        Some(1.0)
    );
    assert_eq!(
        sample(
            &text,
            "bloomgate_request_duration_seconds_count",
            &[("resource", "users"), ("outcome", "hit")]
        ),
        Some(2.0)
    );
    // Exactly two row loads, all on the primary; with the scans and the
    // start-up's probes, every query.
    assert_eq!(rows(&text) - rows(&before), 2.0, "{text}");
    assert_eq!(
        sum(&text, "bloomgate_db_queries_total") as u64,
        queries(&gw)
    );
    // A second scrape sees the next request.
    get(&gw, "/users/12346").await;
    let text = String::from_utf8(
        admin(&gw, Method::GET, "/metrics", Some(TOKEN))
            .await
            .body
            .to_vec(),
    )
    .unwrap();
    assert_eq!(
        sample(
            &text,
            "bloomgate_requests_total",
            &[("resource", "users"), ("outcome", "filtered")]
        ),
        Some(2.0)
    );
}

#[tokio::test]
async fn without_the_right_token_nothing_is_shown_or_changed() {
    let db = TestDb::new().await;
    db.seed_users(10).await;
    let gw = started(config(&db.url, "freshness = \"off\"")).await;
    get(&gw, "/users/1").await;
    let users = gw.resource("users").unwrap().clone();
    let gen0 = users.generation();
    for token in [
        None,
        Some("wrong"),
        Some(&TOKEN[..TOKEN.len() - 1]),
        Some("s3cret-admin-token-for-testsX"),
    ] {
        for (method, path) in [
            (Method::GET, "/metrics"),
            (Method::GET, "/admin/resources"),
            (Method::GET, "/admin/stats"),
            (Method::GET, "/admin/resources/users"),
            (Method::POST, "/admin/resources/users/rebuild?force=true"),
            (
                Method::POST,
                "/admin/resources/users/rebuild?force=true&wait=true",
            ),
            (Method::DELETE, "/admin/resources/users/cache/keys/1"),
            (Method::DELETE, "/admin/resources/users/cache"),
            (Method::POST, "/admin/resources/users/cache/clear"),
        ] {
            let r = admin(&gw, method.clone(), path, token).await;
            assert_eq!(
                r.status,
                StatusCode::UNAUTHORIZED,
                "{method} {path} with {token:?}"
            );
            assert_eq!(
                r.header("www-authenticate"),
                "Bearer realm=\"bloomgate-admin\""
            );
            assert_eq!(r.json()["error"], "unauthorized");
            // Why, without the token: none sent, or not the admin token.
            let reason = match token {
                None => "missing",
                Some(_) => "admin_token",
            };
            assert_eq!(r.json()["reason"], reason);
            if let Some(t) = token {
                assert!(!r.json().to_string().contains(t), "the token was quoted");
            }
        }
    }
    assert_eq!(users.generation(), gen0);
    assert_eq!(
        get(&gw, "/users/1").await.header("cache-status"),
        "bloomgate; hit"
    );
    // The page itself is static and public; its data is not.
    let page = admin(&gw, Method::GET, "/admin/", None).await;
    assert_eq!(page.status, StatusCode::OK);
    assert!(page.header("content-type").starts_with("text/html"));
    // The admin API is not on the public router.
    for path in ["/metrics", "/admin/", "/admin/resources"] {
        assert_eq!(get(&gw, path).await.json()["error"], "no_route", "{path}");
    }
}

#[tokio::test]
async fn admin_endpoints_act() {
    let db = TestDb::new().await;
    db.seed_users(100).await;
    let gw = started(config(&db.url, "freshness = \"off\"")).await;
    let users = gw.resource("users").unwrap().clone();

    let list = admin(&gw, Method::GET, "/admin/resources", Some(TOKEN))
        .await
        .json();
    let names: Vec<_> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["users", "articles"]);
    assert_eq!(list[0]["filter"]["kind"], "exact");
    assert_eq!(list[0]["filter"]["keys"], 100);

    // A rebuild is requested: 202 at once, with where to watch it.
    let post = |path: &'static str| admin(&gw, Method::POST, path, Some(TOKEN));
    let gen0 = users.generation();
    let r = post("/admin/resources/users/rebuild").await;
    assert_eq!(r.status, StatusCode::ACCEPTED, "{:?}", r.body);
    assert_eq!(r.header("location"), "/admin/resources/users");
    let accepted = r.json();
    assert_eq!(accepted["watch"], "/admin/resources/users");
    assert_eq!(accepted["generation"], gen0);
    let ticket = accepted["ticket"].as_u64().unwrap();
    let began = std::time::Instant::now();
    let watched = loop {
        let v = admin(&gw, Method::GET, "/admin/resources/users", Some(TOKEN))
            .await
            .json();
        if v["rebuild"]["completed_ticket"].as_u64().unwrap() >= ticket {
            break v;
        }
        assert!(began.elapsed() < std::time::Duration::from_secs(10));
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    };
    assert_eq!(watched["rebuild"]["last"]["ticket"], ticket);
    assert_eq!(watched["rebuild"]["last"]["result"], "built");
    assert_eq!(watched["generation"], gen0 + 1);
    assert_eq!(watched["last_build"]["reasons"][0], "admin");

    // `wait=true`: the outcome itself.
    let r = post("/admin/resources/users/rebuild?wait=true").await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    assert_eq!(r.json()["generation"], gen0 + 2);
    assert_eq!(users.generation(), gen0 + 2);

    db.exec("DELETE FROM users WHERE id > 10").await;
    let r = post("/admin/resources/users/rebuild?wait=true").await;
    assert_eq!(r.status, StatusCode::CONFLICT);
    assert!(r.json()["message"].as_str().unwrap().contains("force"));
    let view = admin(&gw, Method::GET, "/admin/resources/users", Some(TOKEN))
        .await
        .json();
    assert_eq!(view["rebuild_refused"], 1);
    assert_eq!(view["last_refusal"]["keys_found"], 10);
    assert_eq!(view["last_refusal"]["recovered"], 0);
    assert_eq!(view["rebuild"]["last"]["result"], "refused");
    let r = post("/admin/resources/users/rebuild?force=true&wait=true").await;
    assert_eq!(
        (r.status, r.json()["keys"].clone()),
        (StatusCode::OK, 10.into())
    );

    // Purge one key: its next request is a miss again.
    assert_eq!(
        get(&gw, "/users/2").await.header("cache-status"),
        "bloomgate; fwd=miss; stored"
    );
    assert_eq!(
        get(&gw, "/users/2").await.header("cache-status"),
        "bloomgate; hit"
    );
    let r = admin(
        &gw,
        Method::DELETE,
        "/admin/resources/users/cache/keys/2",
        Some(TOKEN),
    )
    .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    assert_eq!(
        get(&gw, "/users/2").await.header("cache-status"),
        "bloomgate; fwd=miss; stored"
    );
    let r = admin(
        &gw,
        Method::DELETE,
        "/admin/resources/users/cache/keys/abc",
        Some(TOKEN),
    )
    .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);

    // Clear, either spelling: everything is a miss again.
    for (method, path) in [
        (Method::DELETE, "/admin/resources/users/cache"),
        (Method::POST, "/admin/resources/users/cache/clear"),
    ] {
        get(&gw, "/users/3").await;
        let r = admin(&gw, method, path, Some(TOKEN)).await;
        assert_eq!(r.status, StatusCode::NO_CONTENT);
        for id in [2, 3] {
            assert_eq!(
                get(&gw, &format!("/users/{id}"))
                    .await
                    .header("cache-status"),
                "bloomgate; fwd=miss; stored",
                "{path}"
            );
        }
    }

    for (method, path) in [
        (Method::GET, "/admin/resources/nope"),
        (Method::POST, "/admin/resources/nope/rebuild"),
        (Method::DELETE, "/admin/resources/nope/cache/keys/1"),
        (Method::DELETE, "/admin/resources/nope/cache"),
        (Method::POST, "/admin/resources/nope/cache/clear"),
    ] {
        let r = admin(&gw, method, path, Some(TOKEN)).await;
        assert_eq!(
            (r.status, r.json()["error"].clone()),
            (StatusCode::NOT_FOUND, "no_resource".into())
        );
    }
    let stats = admin(&gw, Method::GET, "/admin/stats", Some(TOKEN))
        .await
        .json();
    assert!(stats["time_ms"].as_u64().unwrap() > 0);
    assert_eq!(stats["resources"][0]["requests"]["hit"], 2);
}

#[tokio::test]
async fn each_listener_documents_exactly_what_it_serves() {
    let db = TestDb::new().await;
    db.seed_users(3).await;
    let gw = started(config(&db.url, "freshness = \"off\"")).await;
    let public = get(&gw, "/openapi.json").await;
    assert_eq!(public.status, StatusCode::OK);
    let admin_doc = admin(&gw, Method::GET, "/admin/openapi.json", Some(TOKEN)).await;
    assert_eq!(admin_doc.status, StatusCode::OK);
    let no_token = admin(&gw, Method::GET, "/admin/openapi.json", None).await;
    assert_eq!(no_token.status, StatusCode::UNAUTHORIZED);

    let paths = |r: &Resp| -> BTreeSet<String> {
        // It parses as an OpenAPI 3.1 document.
        let doc: utoipa::openapi::OpenApi = serde_json::from_slice(&r.body).unwrap();
        assert!(r.json()["openapi"].as_str().unwrap().starts_with("3.1"));
        doc.paths.paths.keys().cloned().collect()
    };
    let set = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>();
    assert_eq!(
        paths(&public),
        set(&[
            "/healthz",
            "/readyz",
            "/openapi.json",
            "/users/{id}",
            "/articles/{id}"
        ])
    );
    assert_eq!(
        paths(&admin_doc),
        set(&[
            "/admin/openapi.json",
            "/metrics",
            "/admin/resources",
            "/admin/stats",
            "/admin/resources/{name}",
            "/admin/resources/{name}/rebuild",
            "/admin/resources/{name}/cache",
            "/admin/resources/{name}/cache/keys/{key}",
            "/admin/resources/{name}/cache/clear",
        ])
    );

    // This project's info, not utoipa's package metadata.
    for doc in [public.json(), admin_doc.json()] {
        assert_eq!(doc["info"]["license"]["identifier"], "Apache-2.0");
        assert_eq!(doc["info"]["version"], env!("CARGO_PKG_VERSION"));
        assert!(doc["info"].get("contact").is_none(), "{}", doc["info"]);
        assert!(
            doc["info"]["title"]
                .as_str()
                .unwrap()
                .starts_with("bloomgate")
        );
    }

    // Every documented operation is served on the listener that documents
    // it (no fallback, no 405), and documents its responses; every admin
    // operation requires the bearer token.
    for (doc, on_admin) in [(public.json(), false), (admin_doc.json(), true)] {
        for (path, item) in doc["paths"].as_object().unwrap() {
            let concrete = path
                .replace("{id}", "1")
                .replace("{name}", "users")
                .replace("{key}", "1");
            for (method, op) in item.as_object().unwrap() {
                assert!(
                    !op["responses"].as_object().unwrap().is_empty(),
                    "{method} {path}"
                );
                if on_admin {
                    assert_eq!(op["security"][0]["bearer"], serde_json::json!([]), "{path}");
                }
                let method: Method = method.to_uppercase().parse().unwrap();
                let r = if on_admin {
                    admin(&gw, method.clone(), &concrete, Some(TOKEN)).await
                } else {
                    let req = Request::builder()
                        .method(method.clone())
                        .uri(&concrete)
                        .body(Body::empty())
                        .unwrap();
                    get_with(&gw, req).await
                };
                assert_ne!(r.status, StatusCode::METHOD_NOT_ALLOWED, "{method} {path}");
                if r.status == StatusCode::NOT_FOUND && !r.body.is_empty() {
                    assert_ne!(
                        r.json()["error"],
                        "no_route",
                        "{method} {path} is documented but not served"
                    );
                }
            }
        }
    }
    assert!(admin_doc.json()["components"]["securitySchemes"]["bearer"].is_object());
    assert!(public.json()["components"].get("securitySchemes").is_none());
}

/// The row schema says what the gateway sends: each column with the JSON
/// type of its Postgres type, nullable where the column is; the key
/// parameter with its type, pattern and length. Checked against real rows.
#[tokio::test]
async fn the_row_schema_is_typed_from_the_database() {
    let db = TestDb::new().await;
    db.seed_users(3).await;
    let gw = started(config(&db.url, "freshness = \"off\"")).await;
    let doc = get(&gw, "/openapi.json").await.json();
    let op = &doc["paths"]["/users/{id}"]["get"];
    let row = &op["responses"]["200"]["content"]["application/json"]["schema"];
    assert_eq!(row["properties"]["id"]["type"], "integer");
    assert_eq!(row["properties"]["id"]["format"], "int64");
    assert_eq!(row["additionalProperties"], false);
    assert_eq!(row["required"], serde_json::json!(["id", "email", "name"]));
    let body = get(&gw, "/users/2").await.json();
    for (col, value) in body.as_object().unwrap() {
        let ty = &row["properties"][col]["type"];
        let json_type = match value {
            serde_json::Value::Null => "null",
            serde_json::Value::Number(n) if n.is_i64() => "integer",
            serde_json::Value::String(_) => "string",
            v => panic!("{col}: unexpected {v}"),
        };
        let allowed: Vec<&str> = match ty {
            serde_json::Value::String(s) => vec![s.as_str()],
            serde_json::Value::Array(a) => a.iter().map(|t| t.as_str().unwrap()).collect(),
            t => panic!("{col}: type {t}"),
        };
        assert!(allowed.contains(&json_type), "{col}: {value} is not {ty}");
    }
    let key = &op["parameters"][0]["schema"];
    assert_eq!(key["type"], "integer");
    assert_eq!(key["pattern"], "^-?[0-9]+$");
    let statuses: BTreeSet<&str> = op["responses"]
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(
        statuses,
        [
            "200", "304", "400", "404", "405", "412", "413", "431", "503", "504"
        ]
        .into_iter()
        .collect()
    );
    assert!(op["responses"]["503"]["headers"]["Retry-After"].is_object());
    assert!(op["responses"]["200"]["headers"]["ETag"].is_object());
}

/// An admin rebuild is not cut off by the public `request_timeout` (which
/// would answer 504 and abandon the rebuild, leaving its journal open),
/// and a dropped request leaves it running to completion.
#[tokio::test]
async fn an_admin_rebuild_outlives_request_timeouts_and_dropped_requests() {
    let db = TestDb::new().await;
    db.seed_users(20).await;
    db.add_slow_view().await;
    let gw = started(config(
        &db.url,
        &format!(
            "freshness = \"off\"\n[server]\nrequest_timeout = \"1s\"\n[admin]\nrequest_timeout = \"1s\"\n{SLOW}"
        ),
    ))
    .await;
    let slow = gw.resource("slow").unwrap().clone();
    // Every row read sleeps 0.1 s: a scan (count, then keys) takes ~4 s.
    db.set_delay(0.1).await;
    let began = std::time::Instant::now();
    let r = admin(
        &gw,
        Method::POST,
        "/admin/resources/slow/rebuild?wait=true",
        Some(TOKEN),
    )
    .await;
    println!("waited {:?} for the rebuild", began.elapsed());
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    assert_eq!(r.json()["generation"], 2);
    assert!(!slow.journal_open());

    // A waiting request dropped mid-scan: the rebuild goes on.
    let dropped = tokio::spawn({
        let gw = gw.clone();
        async move {
            admin(
                &gw,
                Method::POST,
                "/admin/resources/slow/rebuild?wait=true",
                Some(TOKEN),
            )
            .await
        }
    });
    while !slow.journal_open() {
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    dropped.abort();
    assert!(dropped.await.is_err_and(|e| e.is_cancelled()));
    // Meanwhile another request answers 202 at once: it is merged into the
    // rebuild pending behind the running one.
    let r = admin(
        &gw,
        Method::POST,
        "/admin/resources/slow/rebuild",
        Some(TOKEN),
    )
    .await;
    assert_eq!(r.status, StatusCode::ACCEPTED);
    let ticket = r.json()["ticket"].as_u64().unwrap();
    let began = std::time::Instant::now();
    while slow.rebuild_status().completed_ticket < ticket {
        assert!(began.elapsed() < std::time::Duration::from_secs(30));
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(
        slow.generation(),
        4,
        "the dropped request's rebuild and the next"
    );
    assert!(!slow.journal_open());
    // Other admin requests keep their own deadline.
    assert_eq!(
        admin(&gw, Method::GET, "/admin/resources", Some(TOKEN))
            .await
            .status,
        StatusCode::OK
    );
}

/// `DELETE .../cache/clear` means "purge the key clear", never the
/// POST-only clear route (which would answer 405): purge and clear paths
/// are disjoint for every key.
#[tokio::test]
async fn purge_and_clear_paths_are_unambiguous_for_every_key() {
    let db = TestDb::new().await;
    db.add_things(&["clear", "keys", "other", "a/b"]).await;
    let gw = started(config(&db.url, &format!("freshness = \"off\"\n{THINGS}"))).await;
    let status = |code: &'static str| {
        let gw = gw.clone();
        async move {
            get(&gw, &format!("/things/{code}"))
                .await
                .header("cache-status")
                .to_string()
        }
    };
    let (miss, hit) = ("bloomgate; fwd=miss; stored", "bloomgate; hit");
    for code in ["clear", "keys", "other", "a%2Fb"] {
        assert_eq!(status(code).await, miss);
        assert_eq!(status(code).await, hit);
    }
    for (code, path) in [
        ("clear", "/admin/resources/things/cache/keys/clear"),
        ("keys", "/admin/resources/things/cache/keys/keys"),
        ("a%2Fb", "/admin/resources/things/cache/keys/a%2Fb"),
    ] {
        let r = admin(&gw, Method::DELETE, path, Some(TOKEN)).await;
        assert_eq!(r.status, StatusCode::NO_CONTENT, "{path}: {:?}", r.body);
        assert_eq!(status(code).await, miss, "{path} purged {code}");
        assert_eq!(status("other").await, hit, "{path} purged only {code}");
    }
    let r = admin(
        &gw,
        Method::DELETE,
        "/admin/resources/things/cache",
        Some(TOKEN),
    )
    .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    for code in ["clear", "keys", "other"] {
        assert_eq!(status(code).await, miss, "cleared: {code}");
    }
}

/// Every database query is one resource's, counted by what it was for:
/// a miss's load (`row`), a rejected key checked anyway (`verify`), the
/// filter's scan (`scan`) and the start-up probe (`probe`).
#[tokio::test]
async fn database_queries_are_counted_by_resource_and_kind() {
    let db = TestDb::new().await;
    db.seed_users(10).await;
    let gw = started(config(
        &db.url,
        "freshness = \"off\"\n[filter]\nverify_above_high_water = true",
    ))
    .await;
    let before = scrape(&gw).await;
    let q = |text: &str, resource: &str, kind: &str| {
        sample(
            text,
            "bloomgate_db_queries_total",
            &[
                ("resource", resource),
                ("kind", kind),
                ("target", "primary"),
            ],
        )
        .unwrap_or_else(|| panic!("no {resource}/{kind} series:\n{text}"))
    };
    for kind in ["scan", "probe"] {
        assert!(q(&before, "users", kind) >= 1.0, "{kind}: {before}");
        assert!(q(&before, "articles", kind) >= 1.0, "{kind}: {before}");
    }
    // A miss (row), a key above the high-water mark checked against the
    // database (verify), and one below it rejected (no query at all).
    get(&gw, "/users/3").await;
    assert_eq!(get(&gw, "/users/500").await.status, StatusCode::NOT_FOUND);
    assert_eq!(get(&gw, "/users/0").await.status, StatusCode::NOT_FOUND);
    let text = scrape(&gw).await;
    let delta = |r: &str, k: &str| q(&text, r, k) - q(&before, r, k);
    assert_eq!(delta("users", "row"), 1.0, "{text}");
    assert_eq!(delta("users", "verify"), 1.0, "{text}");
    assert_eq!(delta("users", "scan"), 0.0);
    assert_eq!(delta("articles", "row"), 0.0);
    assert_eq!(delta("articles", "verify"), 0.0);
    // Every query is some resource's: the series add up to the total the
    // admin API reports.
    assert_eq!(
        sum(&text, "bloomgate_db_queries_total") as u64,
        queries(&gw)
    );
}

/// Every sample of `name`, summed.
fn sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let n = series.split_once('{').map_or(series, |(n, _)| n);
            (n == name).then(|| value.parse::<f64>().unwrap())
        })
        .sum()
}

async fn scrape(gw: &Arc<Gateway>) -> String {
    let m = admin(gw, Method::GET, "/metrics", Some(TOKEN)).await;
    assert_eq!(m.status, StatusCode::OK);
    String::from_utf8(m.body.to_vec()).unwrap()
}

#[tokio::test]
async fn requests_no_resource_answered_are_counted_so_one_sum_is_all_traffic() {
    let db = TestDb::new().await;
    db.seed_users(10).await;
    let gw = started(config(&db.url, "freshness = \"off\"")).await;
    let app = || bloomgate::http::app(gw.clone());
    let loads = |text: &str| {
        sample(
            text,
            "bloomgate_db_query_duration_seconds_count",
            &[("kind", "row"), ("target", "primary")],
        )
        .unwrap()
    };
    let before = loads(&scrape(&gw).await);
    get(&gw, "/users/1").await;
    get(&gw, "/users/12345").await;
    assert_eq!(get(&gw, "/nowhere").await.status, StatusCode::NOT_FOUND);
    let post = Request::post("/users/1").body(Body::empty()).unwrap();
    assert_eq!(
        send(app(), post).await.status,
        StatusCode::METHOD_NOT_ALLOWED
    );
    let big = Request::get("/users/1")
        .header("content-length", "999999999")
        .body(Body::empty())
        .unwrap();
    assert_eq!(send(app(), big).await.status, StatusCode::PAYLOAD_TOO_LARGE);
    let text = scrape(&gw).await;
    let outcome = |o: &str| sample(&text, "bloomgate_requests_total", &[("outcome", o)]);
    assert_eq!(outcome("no_route"), Some(1.0), "{text}");
    assert_eq!(outcome("method_not_allowed"), Some(1.0));
    assert_eq!(outcome("body_too_large"), Some(1.0));
    assert_eq!(outcome("shed"), Some(0.0));
    assert_eq!(outcome("timeout"), Some(0.0));
    assert_eq!(sum(&text, "bloomgate_requests_total"), 5.0, "{text}");
    let users = |o: &str| {
        sample(
            &text,
            "bloomgate_requests_total",
            &[("resource", "users"), ("outcome", o)],
        )
    };
    assert_eq!(users("shed"), Some(0.0));
    assert_eq!(users("timeout"), Some(0.0));
    // The bounds beside what is in flight.
    assert_eq!(
        sample(&text, "bloomgate_requests_in_flight_max", &[]),
        Some(gw.config.server.max_concurrency as f64)
    );
    assert_eq!(
        sample(&text, "bloomgate_row_loads_in_flight", &[]),
        Some(0.0)
    );
    assert_eq!(
        sample(&text, "bloomgate_connections_max", &[]),
        Some(gw.config.server.max_connections as f64)
    );
    assert_eq!(
        sample(&text, "bloomgate_db_pool_max_connections", &[]),
        Some(f64::from(gw.config.database.pool_size))
    );
    assert_eq!(sample(&text, "bloomgate_db_pool_waiting", &[]), Some(0.0));
    assert_eq!(
        loads(&text) - before,
        1.0,
        "one row load (/users/1); the rest were answered before the database"
    );
}

#[tokio::test]
async fn the_process_the_build_and_the_rebuilds_are_exposed_in_base_units() {
    let db = TestDb::new().await;
    db.seed_users(10).await;
    let gw = started(config(&db.url, "freshness = \"off\"")).await;
    let text = scrape(&gw).await;
    for family in [
        "bloomgate_build_info",
        "process_resident_memory_bytes",
        "process_open_fds",
        "process_max_fds",
        "process_cpu_seconds_total",
        "process_start_time_seconds",
        "bloomgate_filter_size_bytes",
        "bloomgate_rebuild_last_success_timestamp_seconds",
    ] {
        assert!(
            text.contains(&format!("\n{family}")),
            "{family} missing:\n{text}"
        );
    }
    let version = format!("version=\"{}\"", env!("CARGO_PKG_VERSION"));
    assert!(text.contains(&version), "{text}");
    for gone in ["bloomgate_filter_bits", "bloomgate_filter_age_seconds"] {
        assert!(!text.contains(gone), "{gone} is not exported any more");
    }
    let users = [("resource", "users")];
    assert_eq!(
        sample(&text, "bloomgate_rebuild_duration_seconds_count", &users),
        Some(1.0),
        "the first build, in the histogram"
    );
    let built = sample(
        &text,
        "bloomgate_rebuild_last_success_timestamp_seconds",
        &users,
    )
    .unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    assert!(built <= now && built > now - 600.0, "{built} vs {now}");
    // No feed is in force: the info says so, and no feed's own family is
    // there.
    assert_eq!(
        sample(&text, "bloomgate_feed_info", &[("feed", "off")]),
        Some(1.0),
        "{text}"
    );
    for family in [
        "bloomgate_wal_",
        "bloomgate_notification",
        "bloomgate_queue_",
        "bloomgate_feed_up",
    ] {
        assert!(!text.contains(family), "{family} without its feed");
    }
}

#[tokio::test]
async fn the_metrics_token_opens_metrics_only_and_the_metrics_app_needs_none() {
    const METRICS: &str = "read-only-metrics-token-for-tests";
    let db = TestDb::new().await;
    db.seed_users(10).await;
    let gw = started(config(&db.url, "freshness = \"off\"")).await;
    let app = || bloomgate::http::admin::app_with_metrics_token(gw.clone(), TOKEN, Some(METRICS));
    let req = |path: &str, token: &str| {
        Request::get(path)
            .header("authorization", format!("Bearer {token}"))
            .body(Body::empty())
            .unwrap()
    };
    let m = send(app(), req("/metrics", METRICS)).await;
    assert_eq!(m.status, StatusCode::OK);
    assert!(String::from_utf8_lossy(&m.body).contains("bloomgate_requests_total"));
    assert_eq!(
        send(app(), req("/metrics", TOKEN)).await.status,
        StatusCode::OK
    );
    for path in ["/admin/resources", "/admin/stats", "/admin/resources/users"] {
        assert_eq!(
            send(app(), req(path, METRICS)).await.status,
            StatusCode::UNAUTHORIZED,
            "{path}"
        );
    }
    let rebuild = Request::post("/admin/resources/users/rebuild")
        .header("authorization", format!("Bearer {METRICS}"))
        .body(Body::empty())
        .unwrap();
    assert_eq!(send(app(), rebuild).await.status, StatusCode::UNAUTHORIZED);
    // The listener of its own: /metrics without a token, nothing else.
    let open = || bloomgate::http::admin::metrics_app(gw.clone());
    let m = send(
        open(),
        Request::get("/metrics").body(Body::empty()).unwrap(),
    )
    .await;
    assert_eq!(m.status, StatusCode::OK);
    assert!(String::from_utf8_lossy(&m.body).contains("bloomgate_build_info"));
    for path in ["/admin/resources", "/admin/stats", "/admin/"] {
        let r = send(open(), Request::get(path).body(Body::empty()).unwrap()).await;
        assert_eq!(r.status, StatusCode::NOT_FOUND, "{path}");
    }
}

#[tokio::test]
async fn the_notify_feed_shows_up_its_heartbeats_and_only_its_own_families() {
    let db = TestDb::new().await;
    db.seed_users(10).await;
    let gw = started(config(&db.url, "freshness = \"notify\"")).await;
    db.exec("INSERT INTO users (id, email, name) VALUES (11, 'n11@example.com', 'New')")
        .await;
    eventually("the insert to be applied", || async {
        let text = scrape(&gw).await;
        sample(&text, "bloomgate_notifications_total", &[]) >= Some(1.0)
    })
    .await;
    let text = scrape(&gw).await;
    let feed = [("feed", "notify")];
    assert_eq!(
        sample(&text, "bloomgate_feed_up", &feed),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        sample(&text, "bloomgate_feed_info", &[("feed", "notify")]),
        Some(1.0)
    );
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    for ts in [
        "bloomgate_feed_last_event_timestamp_seconds",
        "bloomgate_feed_last_heartbeat_timestamp_seconds",
    ] {
        let t = sample(&text, ts, &feed).unwrap();
        assert!(t > now - 600.0 && t <= now + 1.0, "{ts} {t} vs {now}");
    }
    assert!(text.contains("\nbloomgate_notification_lag_seconds "));
    for family in [
        "bloomgate_wal_",
        "bloomgate_queue_",
        "bloomgate_feed_lag_bytes",
    ] {
        assert!(!text.contains(family), "{family} under the notify feed");
    }
}

mod status_page;
