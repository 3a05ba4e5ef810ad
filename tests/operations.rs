//! What the people who run the gateway rely on, over real sockets with the
//! real binary: signals (SIGHUP reloads and never kills, SIGTERM drains),
//! access, audit and start-up lines, `bloomgate_db_up` and the cause of a
//! refused connection, the preflight, a notify gateway without its
//! triggers, the README's metrics list against `/metrics`, and the
//! deployment files.

#[path = "common/binary.rs"]
mod binary;
mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use binary::*;
use common::*;
use sqlx::Executor;

/// SIGHUP: the process lives on, and the new log level and admin token
/// from the file are in force; a file that does not load changes nothing
/// and kills nothing either.
#[tokio::test]
async fn sighup_reloads_the_log_level_and_admin_token_and_never_kills() {
    let db = TestDb::new().await;
    db.seed_users(10).await;
    let dir = tempdir();
    let config = write_config(&dir, &db.url, "level = \"info\"\naccess = false", TOKEN_A);
    let mut gw = Running::start(&config, &[]);
    let (public, admin) = (gw.addr(false).await, gw.addr(true).await);
    wait_ready(public, || gw.log()).await;
    let metrics = format!("http://{admin}/metrics");
    assert_eq!(status(&metrics, Some(TOKEN_A)).await, 200);
    assert_eq!(status(&metrics, Some(TOKEN_B)).await, 401);
    assert_eq!(status(&format!("http://{public}/users/1"), None).await, 200);
    assert!(!gw.log().contains("finished processing request"));

    write_config(
        &dir,
        &db.url,
        "level = \"info,bloomgate::http::front=debug\"\naccess = false",
        TOKEN_B,
    );
    gw.signal("HUP");
    gw.wait_log("admin token reloaded").await;
    gw.wait_log("log filter reloaded").await;
    assert!(gw.alive(), "SIGHUP killed the process:\n{}", gw.log());
    assert_eq!(status(&metrics, Some(TOKEN_B)).await, 200);
    assert_eq!(status(&metrics, Some(TOKEN_A)).await, 401, "the old token");
    assert_eq!(status(&format!("http://{public}/users/2"), None).await, 200);
    gw.wait_log("finished processing request").await;

    // A broken file: said, nothing changes, still alive.
    std::fs::write(&config, "[server\n").unwrap();
    gw.signal("HUP");
    gw.wait_log("the config does not load").await;
    assert!(gw.alive());
    assert_eq!(status(&metrics, Some(TOKEN_B)).await, 200);
    gw.signal("INT");
    gw.exited().await;
}

/// SIGTERM: `/readyz` says 503 (naming the shutdown) while a request is
/// still answered, for `server.shutdown_drain`; then the process exits 0.
#[tokio::test]
async fn sigterm_makes_readyz_503_while_requests_are_still_served() {
    let db = TestDb::new().await;
    db.seed_users(10).await;
    let dir = tempdir();
    let config = write_config(&dir, &db.url, "level = \"info\"", TOKEN_A);
    let mut gw = Running::start(&config, &[]);
    let public = gw.addr(false).await;
    wait_ready(public, || gw.log()).await;
    gw.signal("TERM");
    let began = Instant::now();
    loop {
        let r = client()
            .get(format!("http://{public}/readyz"))
            .send()
            .await
            .unwrap();
        if r.status() == 503 {
            let body: serde_json::Value = r.json().await.unwrap();
            assert!(
                body["reasons"]["shutdown"]
                    .as_str()
                    .is_some_and(|s| s.contains("shutting down")),
                "{body}"
            );
            break;
        }
        assert!(began.elapsed() < Duration::from_secs(20), "{}", gw.log());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Draining, not stopped: lookups are answered, and so is liveness.
    let r = client()
        .get(format!("http://{public}/users/3"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(status(&format!("http://{public}/healthz"), None).await, 200);
    assert!(gw.alive());
    // The drain is 30 s here; SIGINT cuts it short.
    gw.signal("INT");
    assert!(gw.exited().await.success(), "{}", gw.log());
}

/// JSON lines: the start-up line (version, the config as an object,
/// password redacted), an access line per request with typed fields, the
/// request id on lines inside it, an audit line per refused admin token
/// and admin action; no SQL.
#[tokio::test]
async fn access_audit_and_startup_lines_are_typed_json() {
    let db = TestDb::new().await;
    db.seed_users(10).await;
    let dir = tempdir();
    // Trust auth ignores it; it must not be logged all the same.
    let url = db
        .url
        .replacen("://postgres@", "://postgres:hunter2-secret@", 1);
    assert_ne!(url, db.url);
    let config = write_config(&dir, &url, "format = \"json\"", TOKEN_A);
    let gw = Running::start(&config, &[]);
    let public = addr_json(&gw, "listening").await;
    let admin = addr_json(&gw, "admin listening").await;
    wait_ready(public, || gw.log()).await;
    let r = client()
        .get(format!("http://{public}/users/4"))
        .header("x-request-id", "req-42")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(
        status(
            &format!("http://{admin}/admin/resources"),
            Some("wrong-token-xxxxxxxx")
        )
        .await,
        401
    );
    let purged = client()
        .delete(format!("http://{admin}/admin/resources/users/cache/keys/4"))
        .bearer_auth(TOKEN_A)
        .send()
        .await
        .unwrap();
    assert!(purged.status().is_success(), "{}", purged.status());
    gw.wait_log("admin action").await;
    gw.wait_log("\"request_id\":\"req-42\"").await;
    let lines: Vec<serde_json::Value> = gw
        .log()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    let find = |message: &str| -> Vec<&serde_json::Value> {
        lines
            .iter()
            .filter(|l| l["fields"]["message"] == message)
            .collect()
    };
    let start = find("starting");
    let start = start.first().expect("a start-up line");
    assert_eq!(start["fields"]["version"], env!("CARGO_PKG_VERSION"));
    let cfg = &start["fields"]["config"];
    assert!(cfg.is_object(), "the config as an object: {start}");
    assert_eq!(cfg["database"]["freshness"], "notify");
    assert!(!gw.log().contains("hunter2-secret"));
    assert!(cfg["database"]["pool_size"].is_number());

    let access: Vec<_> = find("request")
        .into_iter()
        .filter(|l| l["fields"]["request_id"] == "req-42")
        .collect();
    assert_eq!(access.len(), 1, "{access:?}");
    let f = &access[0]["fields"];
    assert_eq!(access[0]["target"], "bloomgate::access");
    assert_eq!(access[0]["level"], "INFO");
    assert_eq!(f["method"], "GET");
    assert_eq!(f["route"], "/users/{id}");
    assert_eq!(f["resource"], "users");
    assert_eq!(f["status"], 200);
    assert!(f["duration_ms"].is_f64(), "{f}");
    assert!(
        f["cache_status"]
            .as_str()
            .unwrap()
            .starts_with("bloomgate;"),
        "{f}"
    );
    assert_eq!(f["client"], "127.0.0.1");
    // The id is a field of the line; a hit gets no span (it waits for
    // nothing, and nothing is logged inside it).
    assert!(access[0].get("span").is_none(), "{:?}", access[0]);

    let refused = find("admin token refused");
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert_eq!(refused[0]["target"], "bloomgate::audit");
    assert_eq!(refused[0]["fields"]["token"], "wrong");
    let client = refused[0]["fields"]["client"].as_str().unwrap();
    assert!(client.parse::<std::net::IpAddr>().is_ok(), "{client:?}");
    assert!(!gw.log().contains("wrong-token-xxxxxxxx"));
    let action = find("admin action");
    assert_eq!(action.len(), 1, "{action:?}");
    assert_eq!(action[0]["fields"]["method"], "DELETE");
    assert!(action[0]["fields"]["status"].is_number());

    // Typed durations and lists elsewhere too.
    let ready = find("ready");
    assert!(ready[0]["fields"]["elapsed_s"].is_f64(), "{:?}", ready[0]);
    let installed = find("triggers installed");
    assert!(
        installed[0]["fields"]["columns"].is_array(),
        "{:?}",
        installed[0]
    );
    // No statement text, no migration or notice chatter.
    let text = gw.log();
    for needle in ["SELECT", "sqlx::query", "skipping", "COPY ("] {
        assert!(!text.contains(needle), "{needle:?} logged:\n{text}");
    }
}

/// A database that refuses the gateway's password: retried, `/readyz` 503,
/// `bloomgate_db_up 0`, and the log names the refusal (not "pool timed
/// out").
#[tokio::test]
async fn a_refused_password_is_named_and_db_up_is_zero() {
    let Ok(primary) = std::env::var("BLOOMGATE_TEST_PRIMARY_URL") else {
        panic!(
            "run with scripts/test.sh: the server on BLOOMGATE_TEST_PRIMARY_URL asks bloomgate_scram for a password"
        );
    };
    let host = primary.split('@').nth(1).unwrap();
    let url = format!("postgres://bloomgate_scram:not-the-password@{host}/postgres");
    let dir = tempdir();
    let config = write_config(&dir, &url, "level = \"info\"", TOKEN_A);
    let mut gw = Running::start(&config, &[]);
    let (public, admin) = (gw.addr(false).await, gw.addr(true).await);
    gw.wait_log("password authentication failed").await;
    assert!(!gw.log().contains("pool timed out"), "{}", gw.log());
    assert!(!gw.log().contains("not-the-password"));
    assert_eq!(status(&format!("http://{public}/readyz"), None).await, 503);
    let metrics = metrics_text(admin).await;
    assert!(
        metrics.lines().any(|l| l == "bloomgate_db_up 0"),
        "{metrics}"
    );
    assert!(gw.alive(), "retried, not given up");
    gw.signal("INT");
    gw.exited().await;
}

/// A notify gateway whose triggers cannot be installed (its role may not
/// create them) is not ready, and says why: otherwise new rows would be
/// answered 404 until the next rebuild.
#[tokio::test]
async fn a_notify_gateway_without_its_triggers_is_not_ready() {
    let db = TestDb::new().await;
    db.seed_users(5).await;
    let role = format!("{}_ro", db.name);
    db.exec(&format!(
        "CREATE ROLE \"{role}\" LOGIN; GRANT SELECT ON users, articles TO \"{role}\""
    ))
    .await;
    let url = db.url.replacen("://postgres@", &format!("://{role}@"), 1);
    let cfg = config(
        &url,
        "freshness = \"notify\"\ninstall_triggers = true\n[filter]\nrebuild_interval = \"0s\"",
    );
    let gw = bloomgate::gateway::Gateway::new(cfg, &Default::default()).unwrap();
    gw.start().await.unwrap();
    let why = gw.readiness().to_string();
    assert!(!gw.is_ready(), "ready without triggers");
    assert!(why.contains("no bloomgate trigger"), "{why}");
    // Still correct: a new row is looked up, not refused by the filter.
    db.exec("INSERT INTO users (id, email, name) VALUES (77, 'x@example.com', 'X')")
        .await;
    assert_eq!(get(&gw, "/users/77").await.status, 200);
    gw.stop();
    // Its grants go with the database; then the role can.
    drop(db);
    let admin = sqlx::PgPool::connect(&admin_url()).await.unwrap();
    let _ = admin
        .execute(format!("DROP ROLE IF EXISTS \"{role}\"").as_str())
        .await;
}

/// `bloomgate preflight` as a role with only some grants: exit 1, the
/// exact missing statements; once an administrator has run them, exit 0.
#[tokio::test]
async fn preflight_prints_the_missing_grants_and_passes_once_they_are_run() {
    let db = TestDb::new().await;
    let role = format!("{}_pf", db.name);
    db.exec(&format!(
        "CREATE ROLE \"{role}\" LOGIN; GRANT SELECT ON users TO \"{role}\""
    ))
    .await;
    let url = db.url.replacen("://postgres@", &format!("://{role}@"), 1);
    let dir = tempdir();
    let path = dir.join("bloomgate.toml");
    std::fs::write(
        &path,
        format!(
            "[database]\nurl = \"{url}\"\nfreshness = \"notify\"\ninstall_triggers = true\n{USERS}\n\
             [[resource]]\nname = \"articles\"\nroute = \"/articles/{{id}}\"\ntable = \"articles\"\n\
             key_column = \"id\"\nkey_type = \"uuid\"\ncolumns = [\"id\", \"title\"]\n"
        ),
    )
    .unwrap();
    let preflight = || {
        let out = Command::new(env!("CARGO_BIN_EXE_bloomgate"))
            .args(["preflight", "--config"])
            .arg(&path)
            .env_remove("DATABASE_URL")
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    let (code, out) = preflight();
    assert_eq!(code, Some(1), "{out}");
    let q = format!("\"{role}\"");
    for needle in [
        format!("GRANT SELECT ON \"public\".\"articles\" TO {q};"),
        format!("GRANT TRIGGER ON \"public\".\"users\" TO {q};"),
        format!("GRANT TRIGGER ON \"public\".\"articles\" TO {q};"),
        format!("GRANT CREATE ON SCHEMA \"public\" TO {q};"),
    ] {
        assert!(out.contains(&needle), "{needle} missing from:\n{out}");
    }
    assert!(
        !out.contains("GRANT SELECT ON \"public\".\"users\""),
        "granted already:\n{out}"
    );
    let statements: Vec<&str> = out
        .lines()
        .filter(|l| !l.starts_with("--") && l.ends_with(';'))
        .collect();
    for sql in &statements {
        db.exec(sql).await;
    }
    let (code, out) = preflight();
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("preflight passed"), "{out}");
    drop(db);
    let admin = sqlx::PgPool::connect(&admin_url()).await.unwrap();
    let _ = admin
        .execute(format!("DROP ROLE IF EXISTS \"{role}\"").as_str())
        .await;
}

/// The metric families README's list names, braces expanded (`a_{b,c}`),
/// from the `GET /metrics` row of "Operating it" (`_*` ends a prefix).
fn readme_metrics() -> (Vec<String>, Vec<String>) {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let row = readme
        .lines()
        .find(|l| l.starts_with("| `GET /metrics`"))
        .expect("README's /metrics row");
    let mut names = Vec::new();
    let mut prefixes = Vec::new();
    for token in row.split('`').skip(1).step_by(2) {
        if !token.starts_with("bloomgate_") && !token.starts_with("process_") {
            continue;
        }
        // `a_{b,c}_d` expands; a trailing `{label}` does not.
        let expanded = match (token.find("_{"), token.find('}')) {
            (Some(under), Some(close)) => token[under + 2..close]
                .split(',')
                .map(|m| format!("{}{m}{}", &token[..under + 1], &token[close + 1..]))
                .map(|n| n.split('{').next().unwrap().to_string())
                .collect(),
            _ => vec![token.split('{').next().unwrap().to_string()],
        };
        for n in expanded {
            match n.strip_suffix('*') {
                Some(p) => prefixes.push(p.to_string()),
                None => names.push(n),
            }
        }
    }
    (names, prefixes)
}

/// Every family a live gateway exports is in README's list; every name in
/// the list is exported, except those of a feed or an option this gateway
/// does not use (the WAL feed's, the replicas', the access checks').
#[tokio::test]
async fn the_readme_metrics_list_matches_a_live_gateway() {
    let db = TestDb::new().await;
    db.seed_users(5).await;
    let gw = gateway(config(&db.url, ""));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let admin = listener.local_addr().unwrap();
    let served = serve_socket(
        &gw,
        Some(bloomgate::server::Admin {
            listener,
            token: TOKEN_A.into(),
        }),
    )
    .await;
    let _ = client()
        .get(format!("http://{}/users/1", served.addr))
        .send()
        .await
        .unwrap();
    let text = metrics_text(admin).await;
    let exported: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert!(exported.len() > 10, "{text}");
    let (names, prefixes) = readme_metrics();
    let undocumented: Vec<&&str> = exported
        .iter()
        .filter(|e| !names.iter().any(|n| n == *e) && !prefixes.iter().any(|p| e.starts_with(p)))
        .collect();
    assert!(
        undocumented.is_empty(),
        "exported but not in README's /metrics list: {undocumented:?}"
    );
    // Families only a feed, replicas, access rules or the bus not in use
    // here would export.
    let optional = [
        "bloomgate_wal_",
        "bloomgate_replica_",
        "bloomgate_auth_",
        "bloomgate_queue_",
        "bloomgate_notification",
        "bloomgate_feed_lag_bytes",
        "bloomgate_bus_",
    ];
    let missing: Vec<&String> = names
        .iter()
        .filter(|n| !exported.contains(&n.as_str()))
        .filter(|n| !optional.iter().any(|p| n.starts_with(p)))
        .collect();
    assert!(
        missing.is_empty(),
        "in README's list but not exported: {missing:?}\n{text}"
    );
    served.shutdown().await.unwrap();
}

/// deploy/: every Kubernetes manifest parses, has what README promises
/// (probes on /readyz and /healthz, preStop, resources, a PDB, a Service)
/// and, where `BLOOMGATE_KUBERNETES_VALIDATE` names the tool (scripts/test.sh
/// sets it), passes the API schemas strictly; the systemd unit passes
/// `systemd-analyze verify` where it exists.
#[test]
fn the_deployment_files_parse_and_carry_probes_and_limits() {
    let root = env!("CARGO_MANIFEST_DIR");
    let out = Command::new("python3")
        .arg(format!("{root}/scripts/check-deploy.py"))
        .output()
        .expect("python3 (with python3-yaml) runs the manifest check");
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
