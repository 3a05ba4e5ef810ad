//! What the people who run the gateway rely on, over real sockets with the
//! real binary: signals (SIGHUP reloads and never kills, SIGTERM drains),
//! access, audit and start-up lines, `bloomgate_db_up` and the cause of a
//! refused connection, the preflight, a notify gateway without its
//! triggers, the book's metrics list against `/metrics`, the book's SQL
//! for a role of its own, and the
//! deployment files.

use crate::binary;
use crate::common;

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
    assert!(!gw.log().contains("at the next restart"), "{}", gw.log());

    // A setting SIGHUP does not reload: named, not applied, still alive.
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(
        &config,
        text.replace("shutdown_drain = \"30s\"", "shutdown_drain = \"20s\""),
    )
    .unwrap();
    gw.signal("HUP");
    gw.wait_log("server.shutdown_drain changed; that takes effect at the next restart")
        .await;
    assert!(gw.alive());

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
    // A last line says the process stopped as asked.
    gw.wait_log("bloomgate stopped").await;
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
    // Each way to a line names the route: told by the dispatch (a GET),
    // matched from the path the router kept (a HEAD, the gateway's own
    // paths), none for a path nothing serves.
    for (method, path, id) in [
        (reqwest::Method::HEAD, "/users/4", "req-head"),
        (reqwest::Method::GET, "/users/999999", "req-absent"),
        (reqwest::Method::GET, "/healthz", "req-health"),
        (reqwest::Method::GET, "/nowhere/1", "req-none"),
    ] {
        client()
            .request(method, format!("http://{public}{path}"))
            .header("x-request-id", id)
            .send()
            .await
            .unwrap();
    }
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
    gw.wait_log("\"request_id\":\"req-none\"").await;
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
    for (id, method, route, resource, status) in [
        ("req-head", "HEAD", "/users/{id}", "users", 200),
        ("req-absent", "GET", "/users/{id}", "users", 404),
        ("req-health", "GET", "/healthz", "", 200),
        ("req-none", "GET", "", "", 404),
    ] {
        let f = &lines
            .iter()
            .find(|l| l["fields"]["request_id"] == id)
            .unwrap_or_else(|| panic!("no access line for {id}"))["fields"];
        assert_eq!(
            (&f["method"], &f["route"], &f["resource"], &f["status"]),
            (
                &serde_json::json!(method),
                &serde_json::json!(route),
                &serde_json::json!(resource),
                &serde_json::json!(status)
            ),
            "{id}: {f}"
        );
    }

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

/// The `articles` resource, beside the shipped `users` one.
const ARTICLES: &str = "[[resource]]\nname = \"articles\"\nroute = \"/articles/{id}\"\n\
    table = \"articles\"\nkey_column = \"id\"\nkey_type = \"uuid\"\ncolumns = [\"id\", \"title\"]\n";

/// A config file connecting to `db` as `role`, with `database` lines in
/// `[database]`, the `users` resource and `resources`.
fn config_as(db: &TestDb, role: &str, database: &str, resources: &str) -> std::path::PathBuf {
    let url = db.url.replacen("://postgres@", &format!("://{role}@"), 1);
    let path = tempdir().join("bloomgate.toml");
    std::fs::write(
        &path,
        format!("[database]\nurl = \"{url}\"\n{database}\n{USERS}\n{resources}"),
    )
    .unwrap();
    path
}

/// `bloomgate preflight --config path`: its exit code and what it printed.
fn preflight(path: &std::path::Path) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_bloomgate"))
        .args(["preflight", "--config"])
        .arg(path)
        .env_remove("DATABASE_URL")
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
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
    let path = config_as(
        &db,
        &role,
        "freshness = \"notify\"\ninstall_triggers = true",
        ARTICLES,
    );
    let preflight = || preflight(&path);
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

/// A resource in a schema the role may not use, and a view whose
/// `source_table` is in one: preflight prints the `GRANT USAGE` it needs
/// and goes on checking the other resources (it
/// used to stop at "permission denied for schema" with no statement);
/// once the statements it prints are run, it passes.
#[tokio::test]
async fn preflight_on_a_schema_it_may_not_use_prints_the_grant_and_goes_on() {
    let db = TestDb::new().await;
    let role = format!("{}_sc", db.name);
    db.exec(&format!(
        "CREATE SCHEMA shop; CREATE TABLE shop.items (id bigint PRIMARY KEY, name text NOT NULL);
         CREATE VIEW items_view AS SELECT id, name FROM shop.items;
         CREATE ROLE \"{role}\" LOGIN"
    ))
    .await;
    let path = config_as(
        &db,
        &role,
        "freshness = \"off\"",
        "[[resource]]\nname = \"items\"\nroute = \"/items/{id}\"\ntable = \"shop.items\"\n\
             key_column = \"id\"\nkey_type = \"bigint\"\ncolumns = [\"id\", \"name\"]\n\
             [[resource]]\nname = \"items_view\"\nroute = \"/item-views/{id}\"\ntable = \"items_view\"\n\
             source_table = \"shop.items\"\nkey_column = \"id\"\nkey_type = \"bigint\"\n\
             columns = [\"id\", \"name\"]\n",
    );
    let preflight = || preflight(&path);
    let q = format!("\"{role}\"");
    let mut rounds = 0;
    loop {
        let (code, out) = preflight();
        assert!(!out.contains("reading the catalog"), "{out}");
        if rounds == 0 {
            assert_eq!(code, Some(1), "{out}");
            // The schema's grant, and the other resource checked all the same.
            assert!(
                out.contains(&format!("GRANT USAGE ON SCHEMA \"shop\" TO {q};")),
                "{out}"
            );
            assert!(
                out.contains(&format!("GRANT SELECT ON \"public\".\"users\" TO {q};")),
                "{out}"
            );
            // check-config tells a refusal from an outage.
            let checked = Command::new(env!("CARGO_BIN_EXE_bloomgate"))
                .args(["check-config", "--config"])
                .arg(&path)
                .env_remove("DATABASE_URL")
                .output()
                .unwrap();
            let checked = String::from_utf8_lossy(&checked.stdout);
            assert!(
                checked.contains("# database: reachable, but the catalog could not be read"),
                "{checked}"
            );
        }
        if code == Some(0) {
            assert!(out.contains("preflight passed"), "{out}");
            break;
        }
        let statements: Vec<&str> = out
            .lines()
            .filter(|l| !l.starts_with("--") && l.ends_with(';'))
            .collect();
        assert!(
            !statements.is_empty(),
            "missing, with nothing to run:\n{out}"
        );
        for sql in &statements {
            db.exec(sql).await;
        }
        rounds += 1;
        assert!(rounds <= 3, "still missing after {rounds} rounds:\n{out}");
    }
    drop(db);
    let admin = sqlx::PgPool::connect(&admin_url()).await.unwrap();
    let _ = admin
        .execute(format!("DROP ROLE IF EXISTS \"{role}\"").as_str())
        .await;
}

/// Runs `sql` with `psql` as the user of `url`, stopping where the block
/// says (`\set ON_ERROR_STOP on`): the exit status and what psql said.
fn psql(url: &str, sql: &str) -> (bool, String) {
    use std::io::Write;
    let mut child = Command::new("psql")
        .args(["-X", "-q", url])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("psql (scripts/pg.sh installs PostgreSQL's client)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(sql.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let said = String::from_utf8_lossy(&out.stderr).into_owned();
    (out.status.success(), said)
}

/// The book's SQL for a role of its own, run as an operator would with
/// `psql`: each block by the person it names, the database, its schema
/// and the tables owned by a role that is not a superuser (an
/// application's usual owner; `CREATE PUBLICATION` needs `CREATE` on the
/// database, which its owner has). Every block succeeds, and `bloomgate
/// preflight` as the new role then finds nothing missing (notify, queue;
/// the wal blocks run too, but preflight's `wal_level` check needs a
/// logical server). A superuser's block run by the owner stops at its
/// first error instead of carrying on (the onboarding failure: the role
/// missing, the publication created).
#[tokio::test]
async fn the_books_role_blocks_run_by_whom_they_name_and_preflight_then_passes() {
    let db = TestDb::new().await;
    let owner = format!("{}_owner", db.name);
    db.exec(&format!(
        "CREATE ROLE \"{owner}\" LOGIN; ALTER DATABASE \"{db}\" OWNER TO \"{owner}\";
         ALTER SCHEMA public OWNER TO \"{owner}\";
         ALTER TABLE users OWNER TO \"{owner}\"; ALTER TABLE articles OWNER TO \"{owner}\"",
        db = db.name
    ))
    .await;
    let as_owner = db.url.replacen("://postgres@", &format!("://{owner}@"), 1);
    let mut roles = Vec::new();
    for feed in ["notify", "queue", "wal"] {
        let role = format!("{}_{feed}", db.name);
        roles.push(role.clone());
        let blocks = documented_blocks(feed, &format!("\"{role}\""));
        assert!(blocks.iter().any(|(who, _)| *who == Grantor::Owner));
        for (who, block) in &blocks {
            assert!(block.contains("\\set ON_ERROR_STOP on"), "{block}");
            let url = match who {
                Grantor::Superuser => &db.url,
                Grantor::Owner => &as_owner,
            };
            let (ok, said) = psql(url, block);
            assert!(ok, "{feed}: as {who:?}:\n{block}\n{said}");
        }
        if feed == "wal" {
            continue;
        }
        let database = format!("freshness = \"{feed}\"\ninstall_triggers = true");
        let path = config_as(&db, &role, &database, ARTICLES);
        let (code, printed) = preflight(&path);
        assert_eq!(code, Some(0), "{feed}:\n{printed}");
    }
    // The superuser's part, run by the owner: stops at the first error.
    let blocks = documented_blocks("wal", "\"someone_else\"");
    let superuser = &blocks
        .iter()
        .find(|(who, _)| *who == Grantor::Superuser)
        .unwrap()
        .1;
    let (ok, said) = psql(&as_owner, &format!("{superuser}\nSELECT 'carried on';"));
    assert!(!ok, "{said}");
    assert!(said.contains("permission denied"), "{said}");
    drop(db);
    let admin = sqlx::PgPool::connect(&admin_url()).await.unwrap();
    for role in roles.iter().chain([&owner]) {
        let _ = admin
            .execute(format!("DROP ROLE IF EXISTS \"{role}\"").as_str())
            .await;
    }
}

/// The book's column-level form of the role's `SELECT` (docs/src/
/// production.md, "every feed, column by column"), run by the tables'
/// owner after the superuser's block: preflight as the role passes, and a
/// gateway connecting as it serves both resources.
#[tokio::test]
async fn the_books_column_level_grants_pass_preflight_and_serve() {
    let db = TestDb::new().await;
    db.seed_users(3).await;
    db.exec("INSERT INTO articles (title, body) VALUES ('T', 'B')")
        .await;
    let role = format!("{}_cols", db.name);
    let quoted = format!("\"{role}\"");
    let page = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/docs/src/production.md"
    ))
    .unwrap();
    let marker = "-- bloomgate role, as the tables' owner: every feed, column by column\n";
    let block = &page[page.find(marker).expect("the column-level block")..];
    let block = block[..block.find("```").unwrap()].replace("bloomgate_gateway", &quoted);
    assert!(
        block.contains("GRANT SELECT (id, name, created_at) ON public.users"),
        "{block}"
    );
    let superuser = documented_blocks("notify", &quoted)
        .into_iter()
        .find(|(who, _)| *who == Grantor::Superuser)
        .unwrap()
        .1;
    for sql in [&superuser, &block] {
        let (ok, said) = psql(&db.url, sql);
        assert!(ok, "{sql}\n{said}");
    }
    // The shipped resources' columns, each granted alone.
    let shipped = "[[resource]]\nname = \"articles\"\nroute = \"/articles/{id}\"\n\
        table = \"articles\"\nkey_column = \"id\"\nkey_type = \"uuid\"\n\
        columns = [\"id\", \"author_id\", \"title\", \"body\", \"published_at\"]\n";
    let path = config_as(&db, &role, "freshness = \"off\"", shipped);
    let (code, out) = preflight(&path);
    assert_eq!(code, Some(0), "{out}");
    let gw = Running::start(&path, &[("BLOOMGATE_SERVER__LISTEN", "127.0.0.1:0")]);
    let addr = gw.addr(false).await;
    let article: String = sqlx::query_scalar("SELECT id::text FROM articles LIMIT 1")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    for path in ["/users/2".to_string(), format!("/articles/{article}")] {
        let began = Instant::now();
        while status(&format!("http://{addr}/readyz"), None).await != 200 {
            assert!(began.elapsed() < Duration::from_secs(30), "{}", gw.log());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(
            status(&format!("http://{addr}{path}"), None).await,
            200,
            "{path}\n{}",
            gw.log()
        );
    }
    drop(gw);
    drop(db);
    let admin = sqlx::PgPool::connect(&admin_url()).await.unwrap();
    let _ = admin
        .execute(format!("DROP ROLE IF EXISTS {quoted}").as_str())
        .await;
}

/// The metric families the book's list names, braces expanded (`a_{b,c}`),
/// from the `GET /metrics` row of docs/src/admin.md (`_*` ends a prefix).
fn documented_metrics() -> (Vec<String>, Vec<String>) {
    let page =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/src/admin.md")).unwrap();
    let row = page
        .lines()
        .find(|l| l.starts_with("| `GET /metrics`"))
        .expect("the book's /metrics row (docs/src/admin.md)");
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

/// Every family a live gateway exports is in the book's list; every name in
/// the list is exported, except those of a feed or an option this gateway
/// does not use (the WAL feed's, the replicas', the access checks').
#[tokio::test]
async fn the_documented_metrics_list_matches_a_live_gateway() {
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
    let (names, prefixes) = documented_metrics();
    let undocumented: Vec<&&str> = exported
        .iter()
        .filter(|e| !names.iter().any(|n| n == *e) && !prefixes.iter().any(|p| e.starts_with(p)))
        .collect();
    assert!(
        undocumented.is_empty(),
        "exported but not in the book's /metrics list: {undocumented:?}"
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
        "in the book's list but not exported: {missing:?}\n{text}"
    );
    served.shutdown().await.unwrap();
}

/// deploy/: every Kubernetes manifest parses, has what the book promises
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

/// A gateway paused past `database.freshness_bound` (SIGSTOP: a frozen VM,
/// a starved host) resumed with its vouch still set: only the applier's
/// timer clears it, every eighth of the bound, and requests queued during
/// the pause ran first. An outside audit saw them answered with the old
/// row as a `hit`, 3 s after the commit (bound 2 s), in 3 rounds of 22.
/// The request path compares the latest proof's deadline with the instant
/// it began, so no round may answer the old row.
#[tokio::test]
async fn a_paused_gateway_never_answers_from_a_proof_older_than_the_bound() {
    let db = TestDb::new().await;
    db.seed_users(10).await;
    let dir = tempdir();
    let config = write_config(&dir, &db.url, "access = false", TOKEN_A);
    let gw = Running::start(&config, &[]);
    let public = gw.addr(false).await;
    wait_ready(public, || gw.log()).await;
    let name = |v: &serde_json::Value| v["name"].as_str().unwrap_or_default().to_string();
    for round in 0..4 {
        let url = format!("http://{public}/users/{}", round + 1);
        // Cached and vouched for (a hit) before the pause.
        let began = Instant::now();
        let cached = loop {
            let r = client().get(&url).send().await.unwrap();
            let hit = r.headers()["cache-status"] == "bloomgate; hit";
            let row: serde_json::Value = r.json().await.unwrap();
            if hit {
                break name(&row);
            }
            assert!(began.elapsed() < Duration::from_secs(30), "never a hit");
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        gw.signal("STOP");
        let changed = format!("changed in round {round}");
        sqlx::query("UPDATE users SET name = $1 WHERE id = $2")
            .bind(&changed)
            .bind(round + 1)
            .execute(&db.pool)
            .await
            .unwrap();
        // Past the bound (2 s), with requests queued in the socket.
        tokio::time::sleep(Duration::from_millis(2500)).await;
        let queued: Vec<_> = (0..8)
            .map(|_| {
                let url = url.clone();
                tokio::spawn(async move {
                    let r = client().get(&url).send().await.unwrap();
                    let cs = r.headers()["cache-status"].to_str().unwrap().to_string();
                    (cs, r.json::<serde_json::Value>().await.unwrap())
                })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(500)).await;
        gw.signal("CONT");
        for q in queued {
            let (cs, row) = q.await.unwrap();
            assert_ne!(
                name(&row),
                cached,
                "round {round}: the row before the pause answered after it ({cs})"
            );
        }
    }
}
