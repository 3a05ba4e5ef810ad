//! Access lines from the real binary, read back from where they went:
//! `log.access_file` in JSON through a logrotate-style move and SIGHUP,
//! and SIGTERM right after the last request (every line parses, each
//! field has its type, one line per request and none lost, filtered 404s
//! over `log.access_filtered_rate` counted exactly); standard output in the
//! human format (one line per request, whatever the request id holds).

#[path = "common/binary.rs"]
mod binary;
mod common;

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
