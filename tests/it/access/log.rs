//! Access lines from the real binary, read back from where they went:
//! `log.access_file` in JSON through a logrotate-style move and SIGHUP,
//! and SIGTERM right after the last request (every line parses, each
//! field has its type, one line per request and none lost, filtered 404s
//! over `log.access_filtered_rate` counted exactly); standard output in the
//! human format (one line per request, whatever the request id holds).

use crate::binary;
use crate::common;

use std::collections::HashMap;
use std::net::SocketAddr;

use binary::*;
use common::*;

/// `GET /users/{key}` with `x-request-id: id`; the status and
/// `Cache-Status`.
async fn get(public: SocketAddr, key: u64, id: &str) -> (u16, String) {
    let r = client()
        .get(format!("http://{public}/users/{key}"))
        .header("x-request-id", id)
        .send()
        .await
        .unwrap();
    let cache = r
        .headers()
        .get("cache-status")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    (r.status().as_u16(), cache)
}

/// A counter's value in `/metrics`.
async fn metric(admin: SocketAddr, name: &str) -> u64 {
    let text = metrics_text(admin).await;
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("{name} not in /metrics:\n{text}"))
        .parse()
        .unwrap()
}

fn read_json(path: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l:?}")))
        .collect()
}

#[tokio::test]
async fn an_access_file_through_a_rotation_and_sigterm_has_every_line_once() {
    let db = TestDb::new().await;
    db.seed_users(10).await;
    let dir = tempdir();
    let file = dir.join("access.log");
    let config = write_config(
        &dir,
        &db.url,
        &format!(
            "format = \"json\"\naccess_file = \"{}\"\naccess_filtered_rate = 0",
            file.display()
        ),
        TOKEN_A,
    );
    let mut gw = Running::start(&config, &[("BLOOMGATE_SERVER__SHUTDOWN_DRAIN", "0s")]);
    let public = addr_json(&gw, "listening").await;
    let admin = addr_json(&gw, "admin listening").await;
    wait_ready(public, || gw.log()).await;

    // Before the move: rows (misses, then hits), an id to escape, and
    // absent keys the filter answers.
    let mut sent = HashMap::new();
    for i in 0..20u64 {
        let id = format!("before-{i}");
        let (status, _) = get(public, 1 + i % 10, &id).await;
        assert_eq!(status, 200);
        sent.insert(id, 200);
    }
    let odd = "quote\" back\\slash\ttab";
    get(public, 1, odd).await;
    sent.insert(odd.to_string(), 200);
    const FILTERED: u64 = 40;
    for i in 0..FILTERED {
        let (status, cache) = get(public, 1_000_001 + i, &format!("absent-{i}")).await;
        assert_eq!(
            (status, cache.as_str()),
            (404, "bloomgate; detail=filter-absent")
        );
    }
    let left_out = metric(admin, "bloomgate_access_lines_left_out_total").await;

    // logrotate: move, then SIGHUP (its postrotate).
    let moved = dir.join("access.log.1");
    std::fs::rename(&file, &moved).unwrap();
    gw.signal("HUP");
    gw.wait_log("access file reopened").await;
    for i in 0..20u64 {
        let id = format!("after-{i}");
        get(public, 1 + i % 10, &id).await;
        sent.insert(id, 200);
    }
    // SIGTERM at once after the last answer: within the writer's 100 ms.
    gw.signal("TERM");
    assert!(gw.exited().await.success(), "{}", gw.log());

    let old = read_json(&moved);
    let new = read_json(&file);
    let requests = |lines: &[serde_json::Value]| -> Vec<String> {
        lines
            .iter()
            .filter(|l| l["fields"]["message"] == "request")
            .map(|l| l["fields"]["request_id"].as_str().unwrap().to_string())
            .collect()
    };
    let (before, after) = (requests(&old), requests(&new));
    assert!(
        before.iter().all(|id| !id.starts_with("after-")),
        "{before:?}"
    );
    assert!(after.iter().all(|id| id.starts_with("after-")), "{after:?}");
    let mut count: HashMap<&str, usize> = HashMap::new();
    for id in before.iter().chain(&after) {
        *count.entry(id).or_default() += 1;
    }
    for id in sent.keys() {
        assert_eq!(count.get(id.as_str()), Some(&1), "{id:?}: {count:?}");
    }
    let filtered_lines = count.keys().filter(|id| id.starts_with("absent-")).count() as u64;
    // A rate of 0: every filtered 404 is left out, and counted (the
    // unit tests in `access` hold a rate above 0 to its count).
    assert_eq!((filtered_lines, left_out), (0, FILTERED));
    // What was left out is said, in the same file, and adds up.
    let said: u64 = old
        .iter()
        .chain(&new)
        .filter_map(|l| l["fields"]["left_out"].as_u64())
        .sum();
    assert_eq!(said, left_out);

    for l in old.iter().chain(&new) {
        assert_eq!(l["target"], "bloomgate::access", "{l}");
        let f = &l["fields"];
        if f["message"] != "request" {
            continue;
        }
        assert_eq!(l["level"], "INFO");
        assert!(
            humantime::parse_rfc3339(l["timestamp"].as_str().unwrap()).is_ok(),
            "{l}"
        );
        assert_eq!(f["method"], "GET");
        assert!(f["status"].is_u64(), "{f}");
        assert!(f["duration_ms"].is_f64(), "{f}");
        assert_eq!(f["client"], "127.0.0.1");
        // Besides ours: the probes of /readyz, the scrape of /metrics.
        let id = f["request_id"].as_str().unwrap();
        if !sent.contains_key(id) && !id.starts_with("absent-") {
            continue;
        }
        assert_eq!(
            f["route"], "/users/{id}",
            "the template, never the key: {l}"
        );
        assert_eq!(f["resource"], "users");
        assert!(f["cache_status"].as_str().unwrap().starts_with("bloomgate"));
        let id = f["request_id"].as_str().unwrap();
        let expected = if id.starts_with("absent-") { 404 } else { 200 };
        assert_eq!(f["status"], expected, "{f}");
    }
    // No key in the log: the route is the template.
    let text = std::fs::read_to_string(&moved).unwrap();
    assert!(!text.contains("1000001"), "a key was logged");
    // The rest of the log is not in the access file, and the access lines
    // are not on standard output.
    assert!(!gw.log().contains("\"request_id\""), "{}", gw.log());
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn human_lines_on_stdout_are_one_per_request() {
    let db = TestDb::new().await;
    db.seed_users(5).await;
    let dir = tempdir();
    let config = write_config(&dir, &db.url, "format = \"human\"", TOKEN_A);
    let mut gw = Running::start(&config, &[("BLOOMGATE_SERVER__SHUTDOWN_DRAIN", "0s")]);
    let public = gw.addr(false).await;
    wait_ready(public, || gw.log()).await;
    let ids = ["plain-1", "with \"quotes\"", "tab\there", "trailing\\"];
    for id in ids {
        assert_eq!(get(public, 2, id).await.0, 200);
    }
    gw.signal("TERM");
    assert!(gw.exited().await.success(), "{}", gw.log());
    let log = gw.log();
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains(" bloomgate::access: request ") && !l.contains("/readyz"))
        .collect();
    assert_eq!(lines.len(), ids.len(), "{log}");
    for id in ids {
        // The value as a JSON string (the escaping both formats share).
        // Lines of different threads may come in any order.
        let quoted = serde_json::to_string(id).unwrap();
        let mine: Vec<_> = lines
            .iter()
            .filter(|l| l.contains(&format!(" request_id={quoted} ")))
            .collect();
        assert_eq!(mine.len(), 1, "{id:?}: {log}");
        let line = mine[0];
        assert!(line.contains(" INFO "), "{line}");
        assert!(
            line.contains(" route=\"/users/{id}\" status=200 "),
            "{line}"
        );
        assert_eq!(field(line, "client"), Some("127.0.0.1"));
    }
}

/// What the access line says of who asked and why a request was refused,
/// from the binary: behind a trusted proxy (the test, from 127.0.0.1,
/// `BLOOMGATE_SERVER__TRUSTED_PROXIES`) `client` is the caller its
/// `X-Forwarded-For` names, read from the right, and `peer` the
/// connection's address; a refusal's line has its `reason`, the token is
/// in no line; with `log.access_probes = false` the probes have none.
#[tokio::test]
async fn lines_name_the_caller_behind_a_proxy_and_why_a_request_was_refused() {
    use bloomgate::auth::jwt::{self, Alg};
    let db = TestDb::new().await;
    db.seed_users(5).await;
    let dir = tempdir();
    let file = dir.join("access.log");
    let secret = "access-log-secret-0123456789abcdef";
    let config = write_config(
        &dir,
        &db.url,
        &format!(
            "format = \"json\"\naccess_file = \"{}\"\naccess_probes = false\n\
             [auth]\njwt_secret = \"{secret}\"\naudience = \"bloomgate\"\n\
             [[resource]]\nname = \"private\"\nroute = \"/private/{{id}}\"\ntable = \"users\"\n\
             key_column = \"id\"\nkey_type = \"bigint\"\ncolumns = [\"id\", \"name\"]\nauth = \"jwt\"\n",
            file.display()
        ),
        TOKEN_A,
    );
    let mut gw = Running::start(
        &config,
        &[
            ("BLOOMGATE_SERVER__SHUTDOWN_DRAIN", "0s"),
            ("BLOOMGATE_SERVER__TRUSTED_PROXIES", "127.0.0.1"),
        ],
    );
    let public = addr_json(&gw, "listening").await;
    wait_ready(public, || gw.log()).await;
    let ask = |path: &str, id: &str, headers: &[(&str, String)]| {
        let mut req = client()
            .get(format!("http://{public}{path}"))
            .header("x-request-id", id);
        for (k, v) in headers {
            req = req.header(*k, v);
        }
        async move { req.send().await.unwrap().status().as_u16() }
    };
    let sign = |claims: serde_json::Value| {
        let s = jwt::Secret::new(secret.as_bytes());
        jwt::encode(&serde_json::json!({"alg": "HS256"}), &claims, |m| {
            s.sign(Alg::HS256, m).unwrap()
        })
    };
    let exp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 600;
    let keycloak_default = sign(serde_json::json!({"sub": "1", "exp": exp, "aud": "account"}));
    let expired = sign(serde_json::json!({"sub": "1", "exp": exp - 7200, "aud": "bloomgate"}));
    let xff = |v: &str| vec![("x-forwarded-for", v.to_string())];
    let bearer = |t: &str| vec![("authorization", format!("Bearer {t}"))];
    assert_eq!(
        ask("/users/1", "proxied", &xff("198.51.100.9, 203.0.113.7")).await,
        200
    );
    assert_eq!(ask("/users/1", "direct", &[]).await, 200);
    assert_eq!(ask("/private/1", "no-token", &[]).await, 401);
    assert_eq!(
        ask("/private/1", "audience", &bearer(&keycloak_default)).await,
        401
    );
    assert_eq!(ask("/private/1", "expired", &bearer(&expired)).await, 401);
    assert_eq!(ask("/healthz", "probe-live", &[]).await, 200);
    assert_eq!(ask("/readyz", "probe-ready", &[]).await, 200);
    gw.signal("TERM");
    assert!(gw.exited().await.success(), "{}", gw.log());

    let lines = read_json(&file);
    let by_id: HashMap<&str, &serde_json::Value> = lines
        .iter()
        .filter(|l| l["fields"]["message"] == "request")
        .map(|l| (l["fields"]["request_id"].as_str().unwrap(), &l["fields"]))
        .collect();
    let proxied = by_id["proxied"];
    assert_eq!(proxied["client"], "203.0.113.7", "{proxied}");
    assert_eq!(proxied["peer"], "127.0.0.1", "{proxied}");
    let direct = by_id["direct"];
    assert_eq!(direct["client"], "127.0.0.1");
    assert!(
        direct.get("peer").is_none() && direct.get("reason").is_none(),
        "{direct}"
    );
    for (id, reason) in [
        ("no-token", "missing"),
        ("audience", "audience"),
        ("expired", "expired"),
    ] {
        let l = by_id[id];
        assert_eq!(
            (l["status"].as_u64(), l["reason"].as_str()),
            (Some(401), Some(reason)),
            "{l}"
        );
    }
    // No probe, neither ours nor the harness's readiness polls.
    assert!(
        lines
            .iter()
            .all(|l| !matches!(l["fields"]["route"].as_str(), Some("/healthz" | "/readyz"))),
        "{lines:?}"
    );
    assert!(!by_id.contains_key("probe-live") && !by_id.contains_key("probe-ready"));
    let text = std::fs::read_to_string(&file).unwrap();
    for token in [&keycloak_default, &expired] {
        assert!(!text.contains(token.as_str()), "a token in the access log");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
