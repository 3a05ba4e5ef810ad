//! The shipped deployment files against the crate and the binary: every
//! metric the dashboard and alerting rules name is exported by a live
//! gateway (scraped over a real socket, from the metrics listener of its
//! own that needs no token), and, when `BLOOMGATE_PROMTOOL` names promtool
//! (scripts/test.sh sets it), the rules pass `promtool check rules` and
//! their unit tests; the Kubernetes Deployment's probes and scrape get
//! what the binary, run with its ConfigMap's config, serves on the ports
//! they name; the Dockerfile's build stage copies every file the build
//! reads (there is no Docker engine to build the image with).

use crate::binary;
use crate::common;

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

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
        // Snapshots on (`bus.fleet_key_file`): their metrics too.
        let key = std::env::temp_dir().join(format!("deploy_fleet_key_{}", std::process::id()));
        std::fs::write(&key, "0123456789abcdef0123456789abcdef").unwrap();
        cfg.bus.fleet_key_file = Some(key.clone());
        let gw = started(cfg).await;
        // The relay's reading of Redis' memory (every 10 s, the first
        // within a second or so of its term).
        eventually("the relay read Redis' memory", || async {
            gw.bus_status()
                .is_some_and(|s| s.counters().redis_used.is_some())
        })
        .await;
        let served = serve_socket(&gw, None).await;
        let text = scrape(addr).await;
        served.shutdown().await.unwrap();
        fleet.stop(&[gw], &db).await;
        let _ = std::fs::remove_file(key);
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

/// The sources of the `COPY` lines of the Dockerfile's first stage (the
/// build), as paths relative to the build context (`.` for all of it);
/// `COPY --from=` copies from another stage, not from the context.
fn build_stage_copies(dockerfile: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut stages = 0;
    for line in dockerfile.lines().map(str::trim) {
        let mut words = line.split_whitespace();
        match words.next().map(str::to_ascii_uppercase).as_deref() {
            Some("FROM") => stages += 1,
            Some("COPY" | "ADD") if stages == 1 => {
                let args: Vec<&str> = words.collect();
                assert!(
                    !line.contains('[') && !line.ends_with('\\'),
                    "Dockerfile: only the one-line shell form of COPY is read here: {line}"
                );
                if args.iter().any(|a| a.starts_with("--from=")) {
                    continue;
                }
                let sources = args.iter().filter(|a| !a.starts_with("--"));
                let sources: Vec<&&str> = sources.collect();
                for s in &sources[..sources.len().saturating_sub(1)] {
                    let s = s.trim_start_matches("./").trim_end_matches('/');
                    out.push(if s.is_empty() {
                        ".".into()
                    } else {
                        s.to_string()
                    });
                }
            }
            _ => {}
        }
    }
    out
}

/// Whether `path` is `pattern` or inside it (a `.dockerignore` line, a
/// `COPY` source).
fn covers(pattern: &str, path: &str) -> bool {
    pattern == "." || path == pattern || path.starts_with(&format!("{pattern}/"))
}

/// What building the crate reads: `cargo package --list` (Cargo.toml's
/// `include`), less cargo's own additions, and `build.rs` by name (the
/// commit in `bloomgate_build_info` comes from it: an image built without
/// it fails to compile).
fn build_inputs(root: &Path) -> BTreeSet<String> {
    let out = Command::new(env!("CARGO"))
        .args([
            "package",
            "--list",
            "--allow-dirty",
            "--locked",
            "--offline",
        ])
        .current_dir(root)
        .output()
        .expect("cargo package --list");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut files: BTreeSet<String> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .filter(|f| !matches!(*f, "Cargo.toml.orig" | ".cargo_vcs_info.json"))
        .map(str::to_string)
        .collect();
    assert!(
        files.contains("src/main.rs") && files.contains("Cargo.lock"),
        "{files:?}"
    );
    files.insert("build.rs".into());
    files
}

/// The image's build stage (`cargo build --release`, no Docker engine
/// here to run it) gets every file the build reads: each is under a
/// `COPY` source of the first stage and not left out by `.dockerignore`.
/// The Dockerfile once predated build.rs, and `docker compose up --build`
/// failed at `env!("BLOOMGATE_COMMIT")`.
#[test]
fn the_dockerfiles_build_stage_copies_every_file_the_build_reads() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let copies = build_stage_copies(&std::fs::read_to_string(root.join("Dockerfile")).unwrap());
    assert!(
        !copies.is_empty(),
        "no COPY in the Dockerfile's build stage"
    );
    let ignored: Vec<String> = std::fs::read_to_string(root.join(".dockerignore"))
        .unwrap_or_default()
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| {
            assert!(
                !l.contains(['*', '?', '!', '[']),
                ".dockerignore: {l:?}: only plain paths are read here"
            );
            l.trim_start_matches('/').trim_end_matches('/').to_string()
        })
        .collect();
    let missing: Vec<String> = build_inputs(root)
        .into_iter()
        .filter(|f| !copies.iter().any(|c| covers(c, f)) || ignored.iter().any(|i| covers(i, f)))
        .collect();
    assert!(
        missing.is_empty(),
        "the Dockerfile's build stage does not copy {missing:?} (COPY sources: {copies:?}, .dockerignore: {ignored:?})"
    );
}

/// Cargo.toml's `include` (so the list above) holds every file the binary
/// was built from, as the binary's dep-info lists them (every source file,
/// each `include_str!`, the embedded migrations, build.rs): a new input
/// outside it fails here, not in a Docker build.
#[test]
fn the_package_list_holds_every_file_the_binary_was_built_from() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dep_info = format!("{}.d", env!("CARGO_BIN_EXE_bloomgate"));
    let text = std::fs::read_to_string(&dep_info)
        .unwrap_or_else(|e| {
            panic!("{dep_info}: {e}: `cargo build` writes it beside the binary, `cargo test` does not (scripts/test.sh builds first)")
        });
    let (_, deps) = text
        .lines()
        .next()
        .and_then(|l| l.split_once(": "))
        .expect("a dep-info line");
    let root_text = format!("{}/", root.display());
    let inputs = build_inputs(root);
    let built_from: Vec<&str> = deps
        .split_whitespace()
        .filter_map(|d| d.strip_prefix(&root_text))
        // build.rs watches git's HEAD for the commit it records; the image
        // takes the commit as BLOOMGATE_COMMIT instead (a worktree keeps
        // them outside the crate's directory).
        .filter(|d| !d.starts_with("target/") && !d.starts_with(".git/"))
        .collect();
    assert!(
        built_from.contains(&"src/main.rs") && built_from.contains(&"build.rs"),
        "{built_from:?}"
    );
    let outside: Vec<&&str> = built_from
        .iter()
        .filter(|d| !inputs.contains(**d))
        .collect();
    assert!(
        outside.is_empty(),
        "the binary was built from {outside:?}, which Cargo.toml's include leaves out"
    );
}

#[test]
fn the_build_stage_is_read_from_the_dockerfiles_copy_lines() {
    let copies = build_stage_copies(
        "FROM rust AS build\nCOPY Cargo.toml Cargo.lock ./\ncopy ./src/ ./src\n\
         COPY --chown=1:1 build.rs .\nFROM debian\nCOPY --from=build /x /y\nCOPY config /etc\n",
    );
    assert_eq!(copies, ["Cargo.toml", "Cargo.lock", "src", "build.rs"]);
    assert!(covers("src", "src/main.rs") && !covers("src", "srcx/a.rs"));
    assert!(covers(".", "build.rs"));
}

/// A port nothing listens on now.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The Kubernetes Deployment against the binary: the gateway run with the
/// ConfigMap's config as written (only the database, its feed and the
/// listeners' addresses moved to this machine), as the Deployment runs it
/// (the admin token from the environment). Each probe's path answers 200
/// on the port the probe names, and the port Prometheus is told to scrape
/// answers `GET /metrics` without a token (the shipped annotation named
/// the admin listener, which answers 401 without the admin token).
#[tokio::test]
async fn the_kubernetes_probes_and_scrape_get_what_the_binary_serves_there() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = Command::new("python3")
        .arg(root.join("scripts/check-deploy.py"))
        .arg("--facts")
        .output()
        .expect("python3 (with python3-yaml)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let facts: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let text = facts["config"].as_str().unwrap();
    let config: toml::Value = toml::from_str(text).unwrap();
    let port_of = |addr: Option<&toml::Value>| {
        addr.and_then(|a| a.as_str())
            .and_then(|a| a.rsplit_once(':'))
            .map(|(_, p)| p.parse::<u16>().unwrap())
    };
    // Each listener the config opens, by its port as the manifests name
    // it, moved to a free port here through its environment variable.
    let mut moved: Vec<(u16, u16, &str)> = Vec::new();
    for (section, key, variable) in [
        ("server", "listen", "BLOOMGATE_SERVER__LISTEN"),
        ("admin", "listen", "BLOOMGATE_ADMIN__LISTEN"),
        ("admin", "metrics_listen", "BLOOMGATE_ADMIN__METRICS_LISTEN"),
    ] {
        if let Some(port) = port_of(config.get(section).and_then(|s| s.get(key))) {
            moved.push((port, free_port(), variable));
        }
    }
    let db = TestDb::new().await;
    db.seed_users(3).await;
    let dir = tempdir();
    let path = dir.join("bloomgate.toml");
    std::fs::write(&path, text).unwrap();
    let addrs: Vec<(String, String)> = moved
        .iter()
        .map(|(_, to, var)| (var.to_string(), format!("127.0.0.1:{to}")))
        .collect();
    let mut env: Vec<(&str, &str)> = vec![
        ("DATABASE_URL", &db.url),
        ("BLOOMGATE_ADMIN_TOKEN", binary::TOKEN_A),
        // The test server has no publication: the triggers' feed, which
        // the probes and the scrape do not depend on.
        ("BLOOMGATE_DATABASE__FRESHNESS", "notify"),
        ("BLOOMGATE_DATABASE__INSTALL_TRIGGERS", "true"),
    ];
    env.extend(addrs.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    let gw = binary::Running::start(&path, &env);
    let here = |port: u64| {
        moved
            .iter()
            .find(|(from, ..)| u64::from(*from) == port)
            .map(|(_, to, _)| *to)
            .unwrap_or_else(|| panic!("port {port} is none of the config's listeners {moved:?}"))
    };
    let get = async |port: u16, path: &str| {
        let began = std::time::Instant::now();
        loop {
            // Until it listens and has built its filters (the probe is
            // retried so too); only "never" fails.
            let r = binary::client()
                .get(format!("http://127.0.0.1:{port}{path}"))
                .send()
                .await;
            if let Ok(r) = r
                && (r.status() != 503 || began.elapsed().as_secs() > 30)
            {
                return (r.status().as_u16(), r.text().await.unwrap());
            }
            assert!(
                began.elapsed().as_secs() < 30,
                "{path} on {port}:\n{}",
                gw.log()
            );
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    };
    let probes = facts["probes"].as_array().unwrap();
    assert!(probes.len() >= 2, "{facts}");
    for p in probes {
        let port = here(p["port"].as_u64().expect("a probe port that resolves"));
        let path = p["path"].as_str().unwrap();
        let (status, body) = get(port, path).await;
        assert_eq!(status, 200, "{}: {path}: {body}\n{}", p["probe"], gw.log());
    }
    let scrape = &facts["scrape"];
    let port = here(
        scrape["port"]
            .as_u64()
            .expect("prometheus.io/scrape and its port"),
    );
    let (status, body) = get(port, scrape["path"].as_str().unwrap()).await;
    assert_eq!(
        status, 200,
        "the scraped port answers {status} without a token: {body}"
    );
    assert!(body.contains("bloomgate_requests_total"), "{body}");
}
