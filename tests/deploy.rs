//! The shipped dashboard and alerting rules against the binary: every
//! metric they name is exported by a live gateway (scraped over a real
//! socket, from the metrics listener of its own that needs no token), and,
//! when `BLOOMGATE_PROMTOOL` names promtool (scripts/test.sh sets it), the
//! rules pass `promtool check rules` and their unit tests.

mod common;

use std::collections::BTreeSet;
use std::path::Path;

use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Metric names in `text`: `bloomgate_…` and `process_…` identifiers
/// (recording rules, `bloomgate:…`, and runbook anchors are not).
fn named(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let bytes = text.as_bytes();
    let is_ident = |b: u8| b.is_ascii_alphanumeric() || b == b'_';
    let mut i = 0;
    while i < bytes.len() {
        let starts = (i == 0 || !is_ident(bytes[i - 1]))
            && (text[i..].starts_with("bloomgate_") || text[i..].starts_with("process_"));
        if starts {
            let end = (i..bytes.len())
                .find(|&j| !is_ident(bytes[j]))
                .unwrap_or(bytes.len());
            out.insert(text[i..end].to_string());
            i = end;
        } else {
            i += 1;
        }
    }
    out
}

/// Every sample name in an exposition (histogram series with their
/// `_bucket`, `_sum`, `_count`).
fn exported(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_string)
        .collect()
}

async fn scrape(addr: std::net::SocketAddr) -> String {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await.unwrap();
    let text = String::from_utf8(buf).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    body.to_string()
}

#[tokio::test]
async fn the_dashboard_and_the_rules_name_only_metrics_the_gateway_exports() {
    let db = TestDb::new().await;
    db.seed_users(10).await;
    let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let metrics_addr = free.local_addr().unwrap();
    drop(free);
    let mut cfg = config(&db.url, "freshness = \"notify\"");
    cfg.admin.metrics_listen = Some(metrics_addr);
    let gw = gateway(cfg);
    let served = serve_socket(&gw, None).await;
    let text = scrape(metrics_addr).await;
    let mut have = exported(&text);
    // The bus's metrics come from a gateway on a bus (a throwaway Redis):
    // the rules alert on them, and a gateway without one exports none.
    let (bus_text, bus_have) = {
        use common::redis_server::{Fleet, Redis, bus_db};
        let redis = Redis::start().await;
        let db = bus_db().await;
        let fleet = Fleet::new();
        let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = free.local_addr().unwrap();
        drop(free);
        let mut cfg = fleet.config(&db, &redis);
        cfg.admin.metrics_listen = Some(addr);
        let gw = started(cfg).await;
        let served = serve_socket(&gw, None).await;
        let text = scrape(addr).await;
        served.shutdown().await.unwrap();
        fleet.stop(&[gw], &db).await;
        let have = exported(&text);
        (text, have)
    };
    assert!(
        bus_have.contains("bloomgate_bus_lost"),
        "a gateway on a bus exports no bus metric:\n{bus_text}"
    );
    have.extend(bus_have);
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy");
    let mut checked = 0;
    for file in [
        "grafana/bloomgate.json",
        "prometheus/bloomgate.rules.yml",
        "prometheus/tests.yml",
    ] {
        let wanted = named(&std::fs::read_to_string(root.join(file)).unwrap());
        assert!(!wanted.is_empty(), "{file} names no metric");
        let missing: Vec<_> = wanted.difference(&have).collect();
        assert!(
            missing.is_empty(),
            "{file} names metrics the gateway does not export: {missing:?}\n{text}"
        );
        checked += wanted.len();
    }
    assert!(checked > 20, "{checked}");
    served.shutdown().await.unwrap();
}

#[test]
fn the_names_of_a_text_are_its_metric_identifiers_only() {
    let got = named(
        "rate(bloomgate_requests_total{x=\"y\"}[5m]) / bloomgate:ratio5m + process_open_fds\n\
         runbook_url: docs/src/alerts/BloomgateNotReady.md, xbloomgate_no",
    );
    let want: BTreeSet<String> = ["bloomgate_requests_total", "process_open_fds"]
        .map(String::from)
        .into();
    assert_eq!(got, want);
}

/// Every alert's `runbook_url` names a page of the book that exists and is
/// that alert's (its title is the alert's name), and every runbook page is
/// some alert's: a renamed alert or a moved page fails here, not in an
/// on-call's browser.
#[test]
fn every_alert_links_its_own_runbook_page() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let rules =
        std::fs::read_to_string(root.join("deploy/prometheus/bloomgate.rules.yml")).unwrap();
    let mut alert = None;
    let mut linked = BTreeSet::new();
    for line in rules.lines().map(str::trim) {
        if let Some(name) = line.strip_prefix("- alert: ") {
            assert!(alert.is_none(), "{alert:?} has no runbook_url");
            alert = Some(name.to_string());
        }
        if let Some(url) = line.strip_prefix("runbook_url: ") {
            let name = alert.take().expect("a runbook_url outside an alert");
            let url = url.trim_matches('"');
            let page = std::fs::read_to_string(root.join(url))
                .unwrap_or_else(|e| panic!("{name}: {url}: {e}"));
            assert_eq!(
                page.lines().next(),
                Some(format!("# {name}").as_str()),
                "{url}"
            );
            linked.insert(url.to_string());
        }
    }
    assert!(alert.is_none(), "{alert:?} has no runbook_url");
    let pages: BTreeSet<String> = std::fs::read_dir(root.join("docs/src/alerts"))
        .unwrap()
        .map(|e| {
            format!(
                "docs/src/alerts/{}",
                e.unwrap().file_name().to_string_lossy()
            )
        })
        .collect();
    assert_eq!(linked, pages, "runbook pages and alerts differ");
    assert!(linked.len() >= 10, "{linked:?}");
}

#[test]
fn the_rules_pass_promtool() {
    let Ok(promtool) = std::env::var("BLOOMGATE_PROMTOOL") else {
        eprintln!("BLOOMGATE_PROMTOOL unset: scripts/test.sh runs promtool itself");
        return;
    };
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/prometheus");
    for args in [
        &["check", "rules", "bloomgate.rules.yml"][..],
        &["test", "rules", "tests.yml"][..],
    ] {
        let out = std::process::Command::new(&promtool)
            .args(args)
            .current_dir(&dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "promtool {args:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
