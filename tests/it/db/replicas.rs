//! Read replicas against a real primary and a real streaming replica
//! (`scripts/pg.sh replicas`: made with `pg_basebackup`, started from the
//! local binaries by `scripts/test.sh`): scans and loads go to the replica,
//! never a 404 or a stale row while it lags, the primary when it is down.
//!
//! The tests share one replica (one stops it): they run one at a time.

use crate::common;

use std::time::{Duration, Instant};

use axum::http::StatusCode;
use bloomgate::gateway::Gateway;
use common::*;
use sqlx::postgres::PgPoolOptions;
use sqlx::{Executor, PgPool};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use crate::common::ON_THE_PRIMARY as ONE_AT_A_TIME;

fn pair() -> (String, String) {
    let p = std::env::var("BLOOMGATE_TEST_PRIMARY_URL")
        .expect("run with scripts/test.sh, which starts a primary and a streaming replica");
    let r = std::env::var("BLOOMGATE_TEST_REPLICA_URL").unwrap();
    (p, r)
}

/// A database on the primary (migrated, `n` users), once the replica has
/// it too; the gateway's config pointing at both.
async fn setup(n: i64) -> (TestDb, PgPool, String) {
    setup_lag(n, "2s").await
}

async fn setup_lag(n: i64, max_lag: &str) -> (TestDb, PgPool, String) {
    let (primary, replica) = pair();
    let db = TestDb::on(&format!("{primary}/postgres")).await;
    db.seed_users(n).await;
    let replica_db = format!("{replica}/{}", db.name);
    let deadline = Instant::now() + Duration::from_secs(30);
    let pool = loop {
        if let Ok(pool) = PgPoolOptions::new()
            .max_connections(2)
            .connect(&replica_db)
            .await
        {
            let count: Result<i64, _> = sqlx::query_scalar("SELECT count(*) FROM users")
                .fetch_one(&pool)
                .await;
            if count.is_ok_and(|c| c == n) {
                break pool;
            }
        }
        assert!(Instant::now() < deadline, "the replica never caught up");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let extra = format!(
        "install_triggers = true\nreplica_urls = [\"{replica_db}\"]\n\
         max_replica_lag = \"{max_lag}\"\nreplica_check_interval = \"50ms\"\n"
    );
    (db, pool, extra)
}

async fn seq_scans(pool: &PgPool) -> i64 {
    // Statistics reach the views up to a second after the scan.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    sqlx::query_scalar(
        "SELECT coalesce(seq_scan, 0) FROM pg_stat_user_tables WHERE relname = 'users'",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

fn replica_queries(gw: &Gateway) -> u64 {
    gw.db.replicas().unwrap().members()[0]
        .queries
        .load(Ordering::Relaxed)
}

async fn started_with(db: &TestDb, extra: &str) -> Arc<Gateway> {
    started(config(&db.url, extra)).await
}

#[tokio::test]
async fn scans_and_loads_run_on_the_replica() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (db, replica, extra) = setup(500).await;
    let (p0, r0) = (seq_scans(&db.pool).await, seq_scans(&replica).await);
    let gw = started_with(&db, &extra).await;
    let users = gw.resource("users").unwrap();
    users.rebuild(true).await.unwrap();
    let before = replica_queries(&gw);
    for id in 1..=20 {
        assert_eq!(
            get(&gw, &format!("/users/{id}")).await.status,
            StatusCode::OK
        );
    }
    assert_eq!(
        replica_queries(&gw) - before,
        20,
        "every load on the replica"
    );
    let (p1, r1) = (seq_scans(&db.pool).await, seq_scans(&replica).await);
    assert_eq!(p1 - p0, 0, "a key scan ran on the primary");
    // Start-up's scan of users and the forced rebuild.
    assert!(r1 - r0 >= 2, "replica seq scans {r0} -> {r1}");
    gw.stop();
}

/// Replay paused on the replica while 4 writers insert 20,000 rows and one
/// row is updated: every inserted key answers 200 through both gateways
/// once they have the change (the load goes to the primary, as the replica
/// is behind it), and the update is never answered with the old row after
/// a gateway applied it. Without the LSN check the replica's "no such row"
/// would be cached and answered 404.
#[tokio::test]
async fn a_lagging_replica_never_gives_a_404_or_a_stale_row() {
    let _one = ONE_AT_A_TIME.lock().await;
    // A lag limit the pause stays far within: only the LSN check keeps
    // loads off the replica.
    let (db, replica, extra) = setup_lag(100, "600s").await;
    let gw = started_with(&db, &extra).await;
    let gw2 = started_with(&db, &extra).await;
    let _ = get(&gw, "/users/7").await;
    let _ = get(&gw2, "/users/7").await;
    replica
        .execute("SELECT pg_wal_replay_pause()")
        .await
        .unwrap();
    let resume = Resume;

    let mut writers = Vec::new();
    for w in 0..4i64 {
        let pool = db.pool.clone();
        writers.push(tokio::spawn(async move {
            for batch in 0..50i64 {
                let from = 1000 + w * 5000 + batch * 100;
                sqlx::query(
                    "INSERT INTO users (id, email, name) SELECT g, 'n' || g || '@example.com', 'New ' || g \
                     FROM generate_series($1::bigint, $1::bigint + 99) g",
                )
                .bind(from)
                .execute(&pool)
                .await
                .unwrap();
            }
        }));
    }
    for w in writers {
        w.await.unwrap();
    }
    db.exec("UPDATE users SET name = 'Renamed' WHERE id = 7")
        .await;
    // The gateway applies the notifications within milliseconds; wait for
    // the last of them, then ask for every key.
    let deadline = Instant::now() + Duration::from_secs(60);
    while get(&gw, "/users/20999").await.status != StatusCode::OK
        || get(&gw2, "/users/20999").await.status != StatusCode::OK
        || get(&gw, "/users/7").await.json()["name"] != "Renamed"
        || get(&gw2, "/users/7").await.json()["name"] != "Renamed"
    {
        assert!(Instant::now() < deadline, "notifications never applied");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let lagging: bool = sqlx::query_scalar("SELECT pg_is_wal_replay_paused()")
        .fetch_one(&replica)
        .await
        .unwrap();
    assert!(
        lagging,
        "the replica must still be behind for this test to mean anything"
    );
    for id in 1000..21000 {
        for g in [&gw, &gw2] {
            let r = get(g, &format!("/users/{id}")).await;
            assert_eq!(r.status, StatusCode::OK, "/users/{id}: {:?}", r.body);
        }
    }
    for _ in 0..20 {
        assert_eq!(get(&gw, "/users/7").await.json()["name"], "Renamed");
        assert_eq!(get(&gw2, "/users/7").await.json()["name"], "Renamed");
    }
    gw2.stop();
    replica
        .execute("SELECT pg_wal_replay_resume()")
        .await
        .unwrap();
    drop(resume);
    // Caught up again: loads return to the replica.
    a_load_goes_to_the_replica(&gw).await;
    gw.stop();
}

/// A replica already behind when the gateway starts. The rows updated and
/// inserted on the primary before start-up are named by no feed event, so
/// nothing raises the LSN loads wait for: loads must still not go to the
/// replica and cache the old rows (or "no such row" for the insert). Nor
/// may the replica read as lag 0 because its lag is measured from the
/// gateway's first check.
#[tokio::test]
async fn a_replica_behind_at_start_up_never_serves_old_rows() {
    let _one = ONE_AT_A_TIME.lock().await;
    // A lag limit the pause stays within, so only the LSN gate can keep
    // loads off the replica; no filter, so start-up has no scan to wait
    // for a replica that has replayed the primary's position.
    let (db, replica, extra) = setup_lag(100, "600s").await;
    let extra = format!("{extra}\n[filter]\nenabled = false\n");
    replica
        .execute("SELECT pg_wal_replay_pause()")
        .await
        .unwrap();
    let resume = Resume;
    db.exec("UPDATE users SET name = 'new ' || id WHERE id <= 10")
        .await;
    db.exec("INSERT INTO users (id, email, name) VALUES (500, 'f@x.org', 'Five hundred')")
        .await;
    // Paused well before the gateway's first check.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let gw = started_with(&db, &extra).await;
    for id in 1..=10 {
        let r = get(&gw, &format!("/users/{id}")).await;
        assert_eq!(r.json()["name"], format!("new {id}"), "/users/{id}");
    }
    assert_eq!(get(&gw, "/users/500").await.status, StatusCode::OK);
    let paused: bool = sqlx::query_scalar("SELECT pg_is_wal_replay_paused()")
        .fetch_one(&replica)
        .await
        .unwrap();
    assert!(
        paused,
        "the replica must still be behind for this to mean anything"
    );
    let member = &gw.db.replicas().unwrap().members()[0];
    assert!(
        member.lag() >= Duration::from_millis(300),
        "a replica paused before start-up reads as lag {:?}",
        member.lag()
    );
    replica
        .execute("SELECT pg_wal_replay_resume()")
        .await
        .unwrap();
    drop(resume);
    a_load_goes_to_the_replica(&gw).await;
    gw.stop();
}

/// Loads keys not yet cached until one goes to the replica; panics after
/// 10 s.
async fn a_load_goes_to_the_replica(gw: &Arc<Gateway>) {
    let before = replica_queries(gw);
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut id = 20;
    while replica_queries(gw) == before {
        assert!(Instant::now() < deadline, "no load went to the replica");
        let _ = get(gw, &format!("/users/{id}")).await;
        id += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The gateway cut off from the primary while the replica is behind (its
/// replay paused): a commit made meanwhile reaches no feed, so no applied
/// position names it, and the replica passes the read-your-writes gate
/// (which covers what the gateway applied). A lookup the feed does not
/// vouch for must read the primary, which has the commit. The checker's
/// `outage` fault, where the replica is cut off with the feed, is the case.
#[tokio::test]
async fn a_lookup_the_feed_cannot_vouch_for_never_reads_a_replica() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (db, replica, extra) = setup_lag(30, "600s").await;
    let proxy = Proxy::start_for(&db).await;
    let gw = started(config(&proxy.url(&db), &extra)).await;
    vouched(&gw, "users").await;
    a_load_goes_to_the_replica(&gw).await;
    let _resume = Resume;
    replica
        .execute("SELECT pg_wal_replay_pause()")
        .await
        .unwrap();
    proxy.cut();
    let users = gw.resource("users").unwrap();
    eventually("the feed's loss noticed", || async { !users.vouch.ok() }).await;
    db.exec("UPDATE users SET name = 'changed while cut off' WHERE id = 1")
        .await;
    proxy.restore();
    let mut answered = 0;
    let began = Instant::now();
    while answered < 20 && began.elapsed() < Duration::from_secs(10) {
        let r = get(&gw, "/users/1").await;
        if r.status == StatusCode::OK {
            answered += 1;
            assert_eq!(
                r.json()["name"],
                "changed while cut off",
                "{} (replica {:?})",
                r.header("cache-status"),
                gw.db.replicas().unwrap().members()[0].snapshot()
            );
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(answered > 0, "never answered once the database was back");
    gw.stop();
}

/// A transaction committed with `synchronous_commit = off` is visible, and
/// announced, before the primary has written its WAL: the WAL writer writes
/// it up to `wal_writer_delay` (200 ms) later. The primary's *write*
/// position read after such a notification can be behind the commit, and a
/// replica that replayed that far still has the old row; a load sent there
/// caches the old row for the whole TTL. The gate must be the *insert*
/// position, which is past every commit another session can see. Checked
/// for both feeds whose changes carry no LSN; a writer of small async
/// commits keeps the WAL writer awake, so it writes on its schedule rather
/// than as soon as a commit wakes it.
#[tokio::test]
async fn an_async_commit_is_never_served_stale_from_a_replica() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (db, _replica, extra) = setup(100).await;
    db.exec("CREATE TABLE noise (at timestamptz)").await;
    for feed in ["notify", "queue"] {
        let gw = started_with(&db, &format!("{extra}freshness = \"{feed}\"\n")).await;
        let pool = db.pool.clone();
        let noise = tokio::spawn(async move {
            let mut c = pool.acquire().await.unwrap();
            c.execute("SET synchronous_commit = off").await.unwrap();
            loop {
                c.execute("INSERT INTO noise VALUES (now())").await.unwrap();
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        });
        let mut c = db.pool.acquire().await.unwrap();
        c.execute("SET synchronous_commit = off").await.unwrap();
        for i in 0..25 {
            // Cached, so the change is what sends the next read to storage.
            assert_eq!(get(&gw, "/users/7").await.status, StatusCode::OK);
            let name = format!("{feed} {i}");
            sqlx::query("UPDATE users SET name = $1 WHERE id = 7")
                .bind(&name)
                .execute(&mut *c)
                .await
                .unwrap();
            fresh(&gw, "/users/7", |r| r.json()["name"] == name.as_str()).await;
        }
        // The replica is in use here (once it has replayed the WAL written
        // so far): the gate alone decides where the loads above went.
        a_load_goes_to_the_replica(&gw).await;
        noise.abort();
        gw.stop();
    }
}

/// Resumes replay when dropped, even if the test fails (over its own
/// connection: the test's pools belong to the test's runtime).
struct Resume;
impl Drop for Resume {
    fn drop(&mut self) {
        let (_, replica) = pair();
        let _ = std::process::Command::new("psql")
            .args([
                &format!("{replica}/postgres"),
                "-qAtc",
                "SELECT pg_wal_replay_resume()",
            ])
            .status();
    }
}

fn pg_ctl(action: &str) {
    let dir = std::env::var("BLOOMGATE_REPLICA_DIR")
        .unwrap_or_else(|_| "/tmp/bloomgate-pg-replica".into());
    if action == "start" {
        let ok = std::process::Command::new("bash")
            .args(["-c", ". scripts/pg.sh && ensure_replica_pair"])
            .status()
            .unwrap()
            .success();
        assert!(ok, "cannot restart the replica");
        return;
    }
    let bindir = std::process::Command::new("bash")
        .args(["-c", ". scripts/pg.sh && bg_pg_bindir"])
        .output()
        .unwrap();
    let bindir = String::from_utf8(bindir.stdout).unwrap().trim().to_string();
    let uid = std::process::Command::new("id").arg("-u").output().unwrap();
    let mut cmd = if String::from_utf8_lossy(&uid.stdout).trim() == "0" {
        let mut c = std::process::Command::new("runuser");
        c.args(["-u", "postgres", "--"]);
        c.arg(format!("{bindir}/pg_ctl"));
        c
    } else {
        std::process::Command::new(format!("{bindir}/pg_ctl"))
    };
    let ok = cmd
        .args(["-D", &dir, "-m", "fast", "-w", action])
        .status()
        .unwrap()
        .success();
    assert!(ok, "pg_ctl {action} failed");
}

#[tokio::test]
async fn a_stopped_replica_falls_back_to_the_primary_and_is_used_again() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (db, _replica, extra) = setup(300).await;
    let gw = started_with(&db, &extra).await;
    assert_eq!(get(&gw, "/users/1").await.status, StatusCode::OK);
    assert!(replica_queries(&gw) >= 1);
    pg_ctl("stop");
    let restart = Restart;
    for id in 2..=100 {
        let r = get(&gw, &format!("/users/{id}")).await;
        assert_eq!(
            r.status,
            StatusCode::OK,
            "/users/{id} with the replica down: {:?}",
            r.body
        );
    }
    drop(restart);
    let before = replica_queries(&gw);
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut id = 101;
    while replica_queries(&gw) == before {
        assert!(
            Instant::now() < deadline,
            "the restarted replica was never used again"
        );
        assert_eq!(
            get(&gw, &format!("/users/{id}")).await.status,
            StatusCode::OK
        );
        id += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    gw.stop();
}

/// Starts the replica again when dropped, even if the test fails.
struct Restart;
impl Drop for Restart {
    fn drop(&mut self) {
        pg_ctl("start");
    }
}

/// A gateway served on `listener` until the returned sender fires; then it
/// drains for 1 s (as `server::run` does on SIGTERM) and stops.
fn serve_on(
    gw: &Arc<Gateway>,
    listener: tokio::net::TcpListener,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<Result<(), bloomgate::server::ServeError>>,
) {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let draining = gw.clone();
    let task = tokio::spawn(bloomgate::server::serve(
        gw.clone(),
        listener,
        None,
        async move {
            let _ = stopped.await;
            draining.begin_drain();
            tokio::time::sleep(Duration::from_secs(1)).await;
        },
    ));
    (stop, task)
}

/// nginx (Debian's package: `apt-get install nginx-light`) started on the
/// shipped deploy/nginx-fleet.conf, its upstreams and port replaced by the
/// test's; stopped when dropped.
struct Nginx {
    child: std::process::Child,
    port: u16,
    dir: std::path::PathBuf,
}

impl Nginx {
    /// The shipped file names two gateways; a third is added after them.
    fn start(upstreams: [u16; 3]) -> Self {
        let dir = std::env::temp_dir().join(format!("bloomgate-nginx-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let d = dir.display();
        // The shipped file is an `http`-level snippet (conf.d): wrapped in
        // a main config of the test's own.
        let snippet = std::fs::read_to_string("deploy/nginx-fleet.conf")
            .unwrap()
            .replace("gateway-a:8080", &format!("127.0.0.1:{}", upstreams[0]))
            .replace(
                "server gateway-b:8080 max_fails=0;",
                &format!(
                    "server 127.0.0.1:{} max_fails=0;\n    server 127.0.0.1:{} max_fails=0;",
                    upstreams[1], upstreams[2]
                ),
            )
            .replace("listen 8080;", &format!("listen 127.0.0.1:{port};"));
        let conf = format!(
            "daemon off;\nuser root;\npid {d}/nginx.pid;\nerror_log {d}/error.log warn;\n\
             events {{ worker_connections 1024; }}\n\
             http {{\n access_log off;\n client_body_temp_path {d}/cb;\n proxy_temp_path {d}/pt;\n\
             fastcgi_temp_path {d}/ft;\n uwsgi_temp_path {d}/ut;\n scgi_temp_path {d}/st;\n{snippet}\n}}\n"
        );
        let path = dir.join("nginx.conf");
        std::fs::write(&path, conf).unwrap();
        let child = std::process::Command::new("nginx")
            .args(["-p", &d.to_string(), "-c", &path.display().to_string()])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("nginx (apt-get install nginx-light)");
        Self { child, port, dir }
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        // TERM: the master stops its workers (a KILL would orphan them).
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Three gateways behind nginx; a client asks without pause while each
/// gateway in turn drains (as on SIGTERM: `/readyz` 503, every answer
/// `Connection: close`), shuts down, and a new one starts on its port (a
/// rolling restart): no request fails at the load balancer.
#[tokio::test]
async fn a_rolling_restart_behind_nginx_fails_no_request() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (db, _replica, extra) = setup(500).await;
    let mut ports = [0u16; 3];
    let mut running = Vec::new();
    for p in &mut ports {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        *p = l.local_addr().unwrap().port();
        let gw = gateway(config(&db.url, &extra));
        running.push(serve_on(&gw, l));
        wait_ready(format!("127.0.0.1:{p}").parse().unwrap(), String::new).await;
    }
    let nginx = Nginx::start(ports);
    let lb = format!("127.0.0.1:{}", nginx.port).parse().unwrap();
    wait_ready(lb, String::new).await;

    let (stop_client, client_stop) = tokio::sync::watch::channel(false);
    let client = tokio::spawn(async move {
        let http = reqwest::Client::new();
        let (mut ok, mut failed) = (0u64, Vec::new());
        let mut id = 0;
        while !*client_stop.borrow() {
            id = id % 500 + 1;
            match http.get(format!("http://{lb}/users/{id}")).send().await {
                Ok(r) if r.status() == reqwest::StatusCode::OK => ok += 1,
                Ok(r) => failed.push(format!("/users/{id}: {}", r.status())),
                Err(e) => failed.push(format!("/users/{id}: {e}")),
            }
        }
        (ok, failed)
    });

    for (i, port) in ports.iter().enumerate() {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let (stop, task) = running.remove(0);
        let _ = stop.send(());
        task.await.unwrap().unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        let l = tokio::net::TcpListener::bind(("127.0.0.1", *port))
            .await
            .unwrap();
        let gw = gateway(config(&db.url, &extra));
        running.push(serve_on(&gw, l));
        wait_ready(format!("127.0.0.1:{port}").parse().unwrap(), || {
            format!("gateway {i} after its restart")
        })
        .await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop_client.send(true).unwrap();
    let (ok, failed) = client.await.unwrap();
    assert!(
        failed.is_empty(),
        "{} failed of {}: {:?}",
        failed.len(),
        ok + failed.len() as u64,
        &failed[..failed.len().min(10)]
    );
    assert!(ok > 100, "only {ok} requests");
    for (stop, task) in running {
        let _ = stop.send(());
        let _ = task.await;
    }
    drop(nginx);
}
