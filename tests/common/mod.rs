//! Shared test support: a fresh Postgres database per test, a gateway built
//! on it, requests through the router, and a TCP proxy that can cut the
//! database off.
//!
//! The server comes from `BLOOMGATE_TEST_DATABASE_URL` (set by
//! `scripts/test.sh`, which starts one if needed), defaulting to the local
//! `postgres://postgres@127.0.0.1:5432/postgres`.
#![allow(dead_code)]

pub mod cluster;
pub mod redis_server;
pub mod sentinel;

use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::body::Body;
use axum::http::{HeaderMap, Request, StatusCode};
use bloomgate::config::Config;
use bloomgate::gateway::Gateway;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Executor, PgPool};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tower::ServiceExt;

pub fn admin_url() -> String {
    if wal_mode() {
        let primary = std::env::var("BLOOMGATE_TEST_PRIMARY_URL").expect(
            "BLOOMGATE_TEST_FRESHNESS=wal needs the logical server: run with scripts/test.sh",
        );
        return format!("{primary}/postgres");
    }
    std::env::var("BLOOMGATE_TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

/// Whether this run's gateways take their changes from the WAL:
/// `BLOOMGATE_TEST_FRESHNESS=wal` or `wal-poll` (scripts/test.sh runs
/// tests/it/feed/freshness.rs without, with `wal` and with `wal-poll`) puts every [`TestDb`] on the
/// `wal_level = logical` server and every [`config`] on the `wal` feed,
/// unless the test chose a feed itself.
pub fn wal_mode() -> bool {
    std::env::var("BLOOMGATE_TEST_FRESHNESS").is_ok_and(|m| m == "wal" || m == "wal-poll")
}

/// `BLOOMGATE_TEST_FRESHNESS=queue`: every [`config`] on the `queue` feed
/// (the triggers writing to the change table, polled), unless the test
/// chose a feed itself.
pub fn queue_mode() -> bool {
    std::env::var("BLOOMGATE_TEST_FRESHNESS").is_ok_and(|m| m == "queue")
}

/// `BLOOMGATE_TEST_ROLE=least`: every gateway connects as a role of its
/// own (one per [`TestDb`], dropped with it) that holds only what the
/// book's "A role of its own" grants for this run's feed (the SQL blocks
/// marked `-- bloomgate role, as ...: ...`), applied by the superuser; the tables a
/// test adds later get what `bloomgate preflight` says is missing, applied
/// the same way (see [`gateway`]). The test's own writes stay the
/// superuser's. `scripts/test.sh` runs tests/it/feed/freshness.rs so on the `wal`
/// and the `notify` feed.
pub fn least_privilege() -> bool {
    std::env::var("BLOOMGATE_TEST_ROLE").is_ok_and(|m| m == "least")
}

/// The gateway's role of database `db` under [`least_privilege`].
pub fn gateway_role(db: &str) -> String {
    format!("{db}_gw")
}

/// Who runs a block of the book's SQL for the gateway's role.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Grantor {
    Superuser,
    Owner,
}

/// The book's SQL for the gateway's role (docs/src/production.md, "A role
/// of its own") on `feed`: the blocks for every feed, then the feed's own,
/// each with who runs it and its text as written (`psql` meta-commands
/// included), the role named `role`. A feed may have no superuser block.
pub fn documented_blocks(feed: &str, role: &str) -> Vec<(Grantor, String)> {
    let page = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/docs/src/production.md"
    ))
    .expect("docs/src/production.md");
    let mut out = Vec::new();
    for wanted in ["every feed", feed] {
        for (who, grantor) in [
            ("a superuser", Grantor::Superuser),
            ("the tables' owner", Grantor::Owner),
        ] {
            let marker = format!("-- bloomgate role, as {who}: {wanted}\n");
            let Some(start) = page.find(&marker) else {
                assert!(
                    grantor == Grantor::Superuser && wanted != "every feed",
                    "docs/src/production.md has no SQL block marked {marker:?}"
                );
                continue;
            };
            let block = &page[start..];
            let block = &block[..block.find("```").expect("the block ends")];
            out.push((grantor, block.replace("bloomgate_gateway", role)));
        }
    }
    out
}

/// [`documented_blocks`] for this run's feed as statements, comments and
/// `psql` meta-commands left out, all run by the test's superuser.
pub fn documented_grants(role: &str) -> Vec<String> {
    let feed = if wal_mode() {
        "wal"
    } else if queue_mode() {
        "queue"
    } else {
        "notify"
    };
    let mut out = Vec::new();
    for (_, block) in documented_blocks(feed, role) {
        let sql: String = block
            .lines()
            .filter(|l| !l.trim_start().starts_with("--") && !l.trim_start().starts_with('\\'))
            .collect::<Vec<_>>()
            .join("\n");
        out.extend(
            sql.split(';')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(String::from),
        );
    }
    out
}

/// `url` with its user replaced by the gateway's role under
/// [`least_privilege`] (the database named in it decides which).
pub fn as_gateway_role(url: &str) -> String {
    if !least_privilege() {
        return url.to_string();
    }
    let (scheme, rest) = url.split_once("://").unwrap();
    let slash = rest.find('/').unwrap();
    let (authority, path) = rest.split_at(slash);
    let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    let db = path[1..].split('?').next().unwrap();
    format!("{scheme}://{}@{host}{path}", gateway_role(db))
}

/// Under [`least_privilege`], runs `bloomgate preflight` for `config` and
/// applies the statements it prints, as the superuser: what an operator
/// does for a table added after the book's grants.
fn grant_what_preflight_asks(config: &Config) {
    if !least_privilege() {
        return;
    }
    let config = config.clone();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let report = bloomgate::preflight::run(&config).await;
            if report.statements().is_empty() {
                return;
            }
            let db = config.database.url.rsplit('/').next().unwrap();
            let db = db.split('?').next().unwrap().to_string();
            // One connection: the statements may hold a BEGIN … COMMIT.
            use sqlx::Connection;
            let mut admin = sqlx::PgConnection::connect(&db_url(&db)).await.unwrap();
            for sql in report.statements() {
                admin
                    .execute(sql.as_str())
                    .await
                    .unwrap_or_else(|e| panic!("applying preflight's {sql:?}: {e}\n{report}"));
            }
            admin.close().await.unwrap();
        });
    })
    .join()
    .unwrap();
}

/// `BLOOMGATE_TEST_FRESHNESS=wal-poll`: the WAL feed polled
/// (`database.wal_poll_interval`) instead of streamed.
pub fn wal_polled() -> bool {
    std::env::var("BLOOMGATE_TEST_FRESHNESS").is_ok_and(|m| m == "wal-poll")
}

/// Changes the gateway has received from its feed: notifications, or
/// commits read from the WAL.
pub fn changes_received(gw: &Gateway) -> u64 {
    use std::sync::atomic::Ordering::Relaxed;
    if wal_mode() {
        gw.wal_stats.commits.load(Relaxed)
    } else {
        gw.stats.feed.notifications.load(Relaxed)
    }
}

/// A second resource on `users`, by email (two resources on one table).
pub const BY_EMAIL: &str = r#"
    [[resource]]
    name = "users_by_email"
    route = "/users-by-email/{email}"
    table = "users"
    key_column = "email"
    key_type = "text"
    columns = ["id", "email", "name"]
"#;

/// A resource served from the `slow_users` view (see `add_slow_view`).
pub const SLOW: &str = r#"
    [[resource]]
    name = "slow"
    route = "/slow/{id}"
    table = "slow_users"
    key_column = "id"
    key_type = "bigint"
    columns = ["id", "name"]
"#;

/// A resource with text keys served from the `things` table (see
/// [`TestDb::add_things`]).
pub const THINGS: &str = r#"
    [[resource]]
    name = "things"
    route = "/things/{code}"
    table = "things"
    key_column = "code"
    key_type = "text"
    columns = ["code", "label"]
"#;

/// Held by every test that streams from or counts on the shared logical
/// primary (`BLOOMGATE_TEST_PRIMARY_URL`: its walsenders and slots, 20 of
/// each, two held by its replicas; preflight counts them server-wide), so
/// that such tests of different modules run one at a time, as they did
/// when each module was a binary of its own and held a lock of its own.
pub static ON_THE_PRIMARY: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A database that exists for one test and is dropped with this value.
pub struct TestDb {
    pub name: String,
    pub url: String,
    pub pool: PgPool,
    /// The maintenance database of the server it lives on (`postgres`),
    /// which created it and drops it.
    pub admin: String,
}

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// Which server each live [`TestDb`] is on (name → [`TestDb::admin`]), so
/// that [`db_url`] finds a database on any server. Tests of different
/// files share the process: the server is named per database, never by
/// setting an environment variable.
static SERVERS: std::sync::Mutex<Vec<(String, String)>> = std::sync::Mutex::new(Vec::new());

impl TestDb {
    /// Creates an empty database with the migrations applied, on this
    /// run's server ([`admin_url`]).
    pub async fn new() -> Self {
        Self::on(&admin_url()).await
    }

    /// [`TestDb::new`] on the server whose maintenance database `admin`
    /// names (one `scripts/test.sh` started: the logical primary, the TLS
    /// server).
    pub async fn on(admin_of: &str) -> Self {
        let name = format!(
            "bloomgate_test_{}_{}_{:x}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed),
            rand::random::<u32>()
        );
        let admin = PgPoolOptions::new()
            .max_connections(1)
            .connect(admin_of)
            .await
            .expect("cannot reach the test Postgres: run the tests with scripts/test.sh");
        admin
            .execute(format!("CREATE DATABASE \"{name}\"").as_str())
            .await
            .unwrap();
        admin.close().await;
        SERVERS
            .lock()
            .unwrap()
            .push((name.clone(), admin_of.to_string()));
        let url = url_on(admin_of, &name);
        let pool = PgPoolOptions::new()
            .max_connections(8)
            .connect(&url)
            .await
            .unwrap();
        bloomgate::db::MIGRATOR.run(&pool).await.unwrap();
        if least_privilege() {
            // The book's CREATE ROLE and grants, the role named for this
            // database (roles are cluster-wide; it is dropped with it).
            let role = gateway_role(&name);
            pool.execute(format!("DROP ROLE IF EXISTS \"{role}\"").as_str())
                .await
                .unwrap();
            for sql in documented_grants(&role) {
                pool.execute(sql.as_str())
                    .await
                    .unwrap_or_else(|e| panic!("the book's {sql:?}: {e}"));
            }
        }
        Self {
            name,
            url,
            pool,
            admin: admin_of.to_string(),
        }
    }

    /// Users 1..=n with deterministic emails.
    pub async fn seed_users(&self, n: i64) {
        sqlx::query(
            "INSERT INTO users (id, email, name) SELECT g, 'u' || g || '@example.com', 'User ' || g
             FROM generate_series(1, $1::bigint) g",
        )
        .bind(n)
        .execute(&self.pool)
        .await
        .unwrap();
    }

    pub async fn exec(&self, sql: &str) {
        self.pool.execute(sql).await.unwrap();
    }

    /// Adds the `things` table (text keys, see [`THINGS`]) holding `codes`,
    /// each labelled with its upper case.
    pub async fn add_things(&self, codes: &[&str]) {
        self.exec("CREATE TABLE things (code text PRIMARY KEY, label text NOT NULL)")
            .await;
        for code in codes {
            sqlx::query("INSERT INTO things VALUES ($1, upper($1))")
                .bind(code)
                .execute(&self.pool)
                .await
                .unwrap();
        }
    }

    /// Adds `slow_users`: a view of `users` whose row lookups sleep for
    /// `test_delay.seconds` (0 until set), for slow-database tests.
    pub async fn add_slow_view(&self) {
        self.exec(
            "CREATE TABLE test_delay (seconds float8 NOT NULL);
             INSERT INTO test_delay VALUES (0);
             CREATE FUNCTION test_pause() RETURNS boolean LANGUAGE plpgsql VOLATILE AS $$
             BEGIN PERFORM pg_sleep((SELECT seconds FROM test_delay)); RETURN true; END $$;
             CREATE VIEW slow_users AS SELECT * FROM users WHERE test_pause();
             -- Read by whoever runs the view's function: the gateway's role.
             GRANT SELECT ON test_delay TO PUBLIC;",
        )
        .await;
    }

    pub async fn set_delay(&self, seconds: f64) {
        sqlx::query("UPDATE test_delay SET seconds = $1")
            .bind(seconds)
            .execute(&self.pool)
            .await
            .unwrap();
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let name = self.name.clone();
        let admin_url = self.admin.clone();
        SERVERS.lock().unwrap().retain(|(n, _)| *n != name);
        // Drop runs inside the test's runtime, which cannot block on async
        // work: do it on a thread with its own.
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                if let Ok(admin) = PgPoolOptions::new()
                    .max_connections(1)
                    .connect(&admin_url)
                    .await
                {
                    // A database with an active logical slot is refused
                    // before FORCE ends anything ("used by an active logical
                    // replication slot"), and a gateway still streaming
                    // would leave it behind: its walsenders are ended first,
                    // and the drop tried again while they let go.
                    for _ in 0..20 {
                        let _ = sqlx::query(
                            "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots \
                             WHERE database = $1 AND active_pid IS NOT NULL",
                        )
                        .bind(&name)
                        .execute(&admin)
                        .await;
                        let dropped = admin
                            .execute(
                                format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)").as_str(),
                            )
                            .await;
                        if dropped.is_ok() {
                            break;
                        }
                        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
                    }
                    if least_privilege() {
                        let role = gateway_role(&name);
                        let _ = admin
                            .execute(format!("DROP ROLE IF EXISTS \"{role}\"").as_str())
                            .await;
                    }
                    admin.close().await;
                }
            });
        })
        .join();
    }
}

/// The URL of the database `name`: on the server its [`TestDb`] lives on,
/// else on this run's ([`admin_url`]).
pub fn db_url(name: &str) -> String {
    let admin = SERVERS
        .lock()
        .unwrap()
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, a)| a.clone())
        .unwrap_or_else(admin_url);
    url_on(&admin, name)
}

/// `admin` (a server's maintenance database URL) with its database
/// replaced by `name`.
fn url_on(admin: &str, name: &str) -> String {
    let (base, query) = match admin.split_once('?') {
        Some((b, q)) => (b.to_string(), format!("?{q}")),
        None => (admin.to_string(), String::new()),
    };
    let base = base.rsplit_once('/').map(|(b, _)| b.to_string()).unwrap();
    format!("{base}/{name}{query}")
}

/// Host and port of the test server, for the proxy.
pub fn db_addr() -> SocketAddr {
    addr_of(&admin_url())
}

/// Host and port of the server `url` names.
pub fn addr_of(url: &str) -> SocketAddr {
    let opts = PgConnectOptions::from_str(url).unwrap();
    let host = match opts.get_host() {
        "localhost" => "127.0.0.1",
        h => h,
    };
    format!("{host}:{}", opts.get_port()).parse().unwrap()
}

/// Inserts the users `ids`, one every `pace`, in a task of its own: a
/// writer running while a test cuts, kills or starts something.
pub fn paced_inserts(
    pool: &PgPool,
    ids: std::ops::Range<i64>,
    pace: std::time::Duration,
) -> tokio::task::JoinHandle<()> {
    let pool = pool.clone();
    tokio::spawn(async move {
        for id in ids {
            sqlx::query("INSERT INTO users (id, email, name) VALUES ($1, 'p' || $1, 'P')")
                .bind(id)
                .execute(&pool)
                .await
                .unwrap();
            tokio::time::sleep(pace).await;
        }
    })
}

/// Commit to servable: for each of `ids`, the time from its `INSERT`
/// returning until the key passes the filter of every one of `resources`;
/// "p50 …, p99 …, max … over N inserts". Polled by yielding for the first
/// millisecond (exact below it), then every millisecond (tokio's timer
/// granularity: a figure above 1 ms is an upper bound within 1-2 ms), as
/// a busy loop for longer would take a core from the gateways it measures.
/// Printed for BENCHMARKS.md ("Freshness: commit to servable"), never
/// asserted.
pub async fn commit_to_servable(
    pool: &PgPool,
    ids: std::ops::Range<i64>,
    resources: &[Arc<bloomgate::resource::Resource>],
) -> String {
    let mut lat = Vec::new();
    for id in ids {
        sqlx::query("INSERT INTO users (id, email, name) VALUES ($1, 'c' || $1, 'C')")
            .bind(id)
            .execute(pool)
            .await
            .unwrap();
        let committed = std::time::Instant::now();
        let key = bloomgate::key::Key::Int(id);
        while !resources.iter().all(|r| r.filter_contains(&key)) {
            assert!(
                committed.elapsed() < std::time::Duration::from_secs(10),
                "{id} never arrived"
            );
            if committed.elapsed() < std::time::Duration::from_millis(1) {
                tokio::task::yield_now().await;
            } else {
                tokio::time::sleep(std::time::Duration::from_millis(1)).await;
            }
        }
        lat.push(committed.elapsed());
    }
    lat.sort();
    let pct = |p: f64| lat[((lat.len() as f64 * p) as usize).min(lat.len() - 1)];
    format!(
        "p50 {:?}, p99 {:?}, max {:?} over {} inserts",
        pct(0.5),
        pct(0.99),
        lat[lat.len() - 1],
        lat.len()
    )
}

/// The two resources every test gateway serves, over `TestDb`'s tables.
pub const RESOURCES: &str = r#"
[[resource]]
name = "users"
route = "/users/{id}"
table = "users"
key_column = "id"
key_type = "bigint"
columns = ["id", "email", "name"]

[[resource]]
name = "articles"
route = "/articles/{id}"
table = "articles"
key_column = "id"
key_type = "uuid"
columns = ["id", "title"]
"#;

/// The shipped resources (users: bigint, articles: uuid), triggers
/// installed at start-up, with `extra` TOML appended and the database URL pointed at `url`.
pub fn config(url: &str, extra: &str) -> Config {
    // The notification triggers are installed at start-up unless `extra`
    // says otherwise.
    let chose_feed = extra.contains("freshness =");
    // Under least privilege the publication is the book's (its owner
    // made it), not the gateway's to change.
    let install_feed = if least_privilege() {
        "install_feed = false"
    } else {
        "install_feed = true"
    };
    let feed = if wal_polled() && !chose_feed {
        format!("freshness = \"wal\"\n{install_feed}\nwal_poll_interval = \"5ms\"")
    } else if wal_mode() && !chose_feed {
        format!("freshness = \"wal\"\n{install_feed}")
    } else if queue_mode() && !chose_feed {
        "freshness = \"queue\"".to_string()
    } else {
        String::new()
    };
    // The WAL feed needs none (and its `install_feed` removes them).
    let triggers = if extra.contains("install_triggers") || feed.contains("\"wal\"") {
        ""
    } else {
        "install_triggers = true"
    };
    let url = as_gateway_role(url);
    let text = format!(
        r#"
        [database]
        url = "{url}"
        pool_size = 8
        acquire_timeout = "1s"
        migrate = false
        {triggers}
        {feed}
        {extra}
        {RESOURCES}
        "#
    );
    let mut config = Config::from_toml(&text).unwrap();
    // Tests stop their servers directly: no SIGTERM drain.
    config.server.shutdown_drain = std::time::Duration::ZERO;
    config
}

/// Asks for `path` until `done` holds for the response, or panics after
/// 10 s (which only catches "never"; no latency is asserted).
pub async fn fresh(gw: &Arc<Gateway>, path: &str, done: impl Fn(&Resp) -> bool) {
    fresh_within(gw, path, std::time::Duration::from_secs(10), done).await;
}

/// [`fresh`] with a deadline of its own.
pub async fn fresh_within(
    gw: &Arc<Gateway>,
    path: &str,
    within: std::time::Duration,
    done: impl Fn(&Resp) -> bool,
) {
    let began = std::time::Instant::now();
    loop {
        let r = get(gw, path).await;
        if done(&r) {
            return;
        }
        assert!(
            began.elapsed() < within,
            "{path} never became fresh: last {:?} {} {:?}",
            r.status,
            r.header("cache-status"),
            r.body.slice(..r.body.len().min(200))
        );
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
}

/// The gateway's `/metrics` text, through the admin API.
pub async fn gateway_metrics(gw: &Arc<Gateway>) -> String {
    const TOKEN: &str = "metrics-text-token";
    let req = Request::builder()
        .uri("/metrics")
        .header("authorization", format!("Bearer {TOKEN}"))
        .body(Body::empty())
        .unwrap();
    let m = send(bloomgate::http::admin::app(gw.clone(), TOKEN), req).await;
    String::from_utf8_lossy(&m.body).to_string()
}

/// A gateway on `config` whose pool counts queries; not started.
pub fn gateway(config: Config) -> Arc<Gateway> {
    grant_what_preflight_asks(&config);
    let key_files = bloomgate::auth::key_files::KeyFiles::read(&config.auth, "config").unwrap();
    Gateway::new(config, &key_files).unwrap()
}

/// A gateway on `config`, started (filters built).
pub async fn started(config: Config) -> Arc<Gateway> {
    let gw = gateway(config);
    gw.start().await.unwrap();
    gw
}

pub struct Resp {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: bytes::Bytes,
}

impl Resp {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "body is not JSON ({e}): {:?}",
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    pub fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .map(|v| v.to_str().unwrap())
            .unwrap_or_default()
    }
}

/// A fresh directory under the system's temporary one, for a test's
/// config and key files.
pub fn tempdir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "bloomgate-test-{}-{:x}",
        std::process::id(),
        rand::random::<u64>()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// User `id`, with the email `n<id>@example.com` and the name `New <id>`.
pub async fn insert_user<'e>(on: impl sqlx::PgExecutor<'e>, id: i64) {
    sqlx::query(
        "INSERT INTO users (id, email, name) VALUES ($1, 'n' || $1 || '@example.com', 'New ' || $1)",
    )
    .bind(id)
    .execute(on)
    .await
    .unwrap();
}

/// The status `gw` answers `GET path` with.
pub async fn get_status(gw: &Arc<Gateway>, path: &str) -> StatusCode {
    get(gw, path).await.status
}

/// One request through the router, no socket.
pub async fn get(gw: &Arc<Gateway>, path: &str) -> Resp {
    get_with(gw, Request::get(path).body(Body::empty()).unwrap()).await
}

pub async fn get_with(gw: &Arc<Gateway>, req: Request<Body>) -> Resp {
    send(bloomgate::http::app(gw.clone()), req).await
}

/// One request through any router, the whole response collected.
pub async fn send(app: bloomgate::http::App, req: Request<Body>) -> Resp {
    let resp = app.oneshot(req).await.unwrap();
    let status = resp.status();
    let headers = resp.headers().clone();
    let body = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .unwrap();
    Resp {
        status,
        headers,
        body,
    }
}

pub fn queries(gw: &Gateway) -> u64 {
    gw.db.queries()
}

/// A gateway served on a real socket by `server::serve`.
pub struct Served {
    pub addr: SocketAddr,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<(), bloomgate::server::ServeError>>,
}

/// Serves `gw` (not yet started: `serve` starts it) on 127.0.0.1, with the
/// admin listener if given, and returns once `/readyz` says 200.
pub async fn serve_socket(gw: &Arc<Gateway>, admin: Option<bloomgate::server::Admin>) -> Served {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(bloomgate::server::serve(
        gw.clone(),
        listener,
        admin,
        async {
            let _ = stopped.await;
        },
    ));
    wait_ready(addr, String::new).await;
    Served { addr, stop, task }
}

/// Returns once `http://addr/readyz` answers 200; panics after 20 s with
/// `context()` (a log, say).
pub async fn wait_ready(addr: SocketAddr, context: impl Fn() -> String) {
    let began = std::time::Instant::now();
    let client = reqwest::Client::builder()
        .timeout(std::time::Duration::from_secs(2))
        .build()
        .unwrap();
    while client
        .get(format!("http://{addr}/readyz"))
        .send()
        .await
        .ok()
        .map(|r| r.status())
        != Some(StatusCode::OK)
    {
        assert!(
            began.elapsed() < std::time::Duration::from_secs(20),
            "never became ready\n{}",
            context()
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

impl Served {
    /// Signals shutdown and waits for `serve` to return.
    pub async fn shutdown(self) -> Result<(), bloomgate::server::ServeError> {
        let _ = self.stop.send(());
        tokio::time::timeout(std::time::Duration::from_secs(10), self.task)
            .await
            .expect("server did not stop")
            .unwrap()
    }
}

/// A TCP proxy to the test database that can be cut: existing connections
/// are closed and new ones refused until restored. Or frozen: the
/// connections open at that moment stay open and pass nothing more (a hung
/// host, a cut network), new ones pass. Or hung: every connection, open or
/// new, passes nothing until it is unhung, and then everything held passes
/// (a server stopped with SIGSTOP and continued, a network that dropped
/// packets and healed).
pub struct Proxy {
    pub addr: SocketAddr,
    /// Where new connections go (the test database's server at first).
    upstream: watch::Sender<SocketAddr>,
    cut: watch::Sender<bool>,
    /// How many times it was frozen.
    frozen: watch::Sender<u64>,
    /// New connections wait, accepted but not yet passed on, while this is
    /// true: a slow connect, not a refused one.
    held: watch::Sender<bool>,
    /// Nothing passes, either way, on any connection while this is true.
    hung: watch::Sender<bool>,
    /// Open connections whose client sent this (an application_name) are
    /// closed, without a word: a cut network, seen by that client alone.
    named: watch::Sender<String>,
    /// Client bytes holding this text wait this long before they pass.
    slowed: watch::Sender<Vec<(String, std::time::Duration)>>,
    /// What a client sends on a connection whose start-up message carried
    /// this (an application_name) passes nothing while it is set: that
    /// client alone finds the server silent.
    stalled: watch::Sender<String>,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    /// A proxy to this run's server ([`admin_url`]).
    pub async fn start() -> Self {
        Self::start_to(db_addr()).await
    }

    /// A proxy to the server `db` lives on.
    pub async fn start_for(db: &TestDb) -> Self {
        Self::start_to(addr_of(&db.admin)).await
    }

    /// A proxy to `upstream` (a server the test started).
    pub async fn start_to(upstream: SocketAddr) -> Self {
        let (upstream, upstream_rx) = watch::channel(upstream);
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (cut, cut_rx) = watch::channel(false);
        let (frozen, frozen_rx) = watch::channel(0u64);
        let (held, held_rx) = watch::channel(false);
        let (hung, hung_rx) = watch::channel(false);
        let (named, named_rx) = watch::channel(String::new());
        let (slowed, slowed_rx) = watch::channel(Vec::<(String, std::time::Duration)>::new());
        let (stalled, stalled_rx) = watch::channel(String::new());
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut client, _)) = listener.accept().await else {
                    return;
                };
                if *cut_rx.borrow() {
                    drop(client);
                    continue;
                }
                let mut cut_rx = cut_rx.clone();
                let mut frozen_rx = frozen_rx.clone();
                let mut held_rx = held_rx.clone();
                let (mut hung_up, mut hung_down) = (hung_rx.clone(), hung_rx.clone());
                let born = *frozen_rx.borrow();
                let upstream = *upstream_rx.borrow();
                let mut named_rx = named_rx.clone();
                named_rx.mark_unchanged();
                let slowed_rx = slowed_rx.clone();
                let mut stalled_rx = stalled_rx.clone();
                tokio::spawn(async move {
                    // Held or hung, it waits; cut meanwhile, it is closed.
                    let passes = async {
                        held_rx.wait_for(|h| !*h).await.is_ok()
                            && hung_up.wait_for(|h| !*h).await.is_ok()
                    };
                    let passes = tokio::select! {
                        p = passes => p,
                        _ = cut_rx.wait_for(|c| *c) => false,
                    };
                    if !passes {
                        return;
                    }
                    let Ok(mut server) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    // What the client sent first (its start-up message, with
                    // its application_name), for `cut_named`.
                    let seen = std::sync::Mutex::new(Vec::new());
                    let frozen = {
                        let (mut cr, mut cw) = client.split();
                        let (mut sr, mut sw) = server.split();
                        let up = async {
                            let mut buf = vec![0u8; 16 * 1024];
                            loop {
                                let n = match cr.read(&mut buf).await {
                                    Ok(0) | Err(_) => return,
                                    Ok(n) => n,
                                };
                                {
                                    let mut seen = seen.lock().unwrap();
                                    if seen.len() < 4096 {
                                        seen.extend_from_slice(&buf[..n]);
                                    }
                                }
                                let slow = slowed_rx
                                    .borrow()
                                    .iter()
                                    .find(|(what, _)| {
                                        buf[..n].windows(what.len()).any(|w| w == what.as_bytes())
                                    })
                                    .map(|(_, by)| *by);
                                if let Some(by) = slow {
                                    tokio::time::sleep(by).await;
                                }
                                let passes = |name: &String| {
                                    name.is_empty()
                                        || !seen
                                            .lock()
                                            .unwrap()
                                            .windows(name.len())
                                            .any(|w| w == name.as_bytes())
                                };
                                if stalled_rx.wait_for(passes).await.is_err()
                                    || hung_up.wait_for(|h| !*h).await.is_err()
                                    || sw.write_all(&buf[..n]).await.is_err()
                                {
                                    return;
                                }
                            }
                        };
                        let down = async {
                            let mut buf = vec![0u8; 16 * 1024];
                            loop {
                                let n = match sr.read(&mut buf).await {
                                    Ok(0) | Err(_) => return,
                                    Ok(n) => n,
                                };
                                if hung_down.wait_for(|h| !*h).await.is_err()
                                    || cw.write_all(&buf[..n]).await.is_err()
                                {
                                    return;
                                }
                            }
                        };
                        let named = async {
                            loop {
                                if named_rx.changed().await.is_err() {
                                    std::future::pending::<()>().await;
                                }
                                let name = named_rx.borrow_and_update().clone();
                                let seen = seen.lock().unwrap();
                                if seen.windows(name.len()).any(|w| w == name.as_bytes()) {
                                    return;
                                }
                            }
                        };
                        tokio::select! {
                            // A freeze wins over bytes ready to pass.
                            biased;
                            f = frozen_rx.wait_for(|f| *f > born) => f.is_ok(),
                            _ = up => false,
                            () = down => false,
                            _ = cut_rx.wait_for(|c| *c) => false,
                            () = named => false,
                        }
                    };
                    if frozen {
                        // Both ends held open, nothing passed.
                        let _ = cut_rx.wait_for(|c| *c).await.is_ok();
                    }
                    drop((client, server));
                });
            }
        });
        Self {
            addr,
            upstream,
            cut,
            frozen,
            held,
            hung,
            named,
            slowed,
            stalled,
            task,
        }
    }

    /// New connections go to `to` (a failover, a restore elsewhere);
    /// connections open now stay where they are until cut.
    pub fn retarget(&self, to: SocketAddr) {
        self.upstream.send_replace(to);
    }

    /// Every connection open now stops passing bytes, and stays open.
    pub fn freeze(&self) {
        self.frozen.send_modify(|f| *f += 1);
    }

    /// `url` rewritten to go through this proxy.
    pub fn url(&self, db: &TestDb) -> String {
        // postgres://[user[:pw]@]host[:port]/db[?query]: swap host and port.
        let (scheme, rest) = db.url.split_once("://").unwrap();
        let slash = rest.find('/').unwrap();
        let (authority, path) = rest.split_at(slash);
        let userinfo = authority.rsplit_once('@').map(|(u, _)| format!("{u}@"));
        format!(
            "{scheme}://{}127.0.0.1:{}{path}",
            userinfo.unwrap_or_default(),
            self.addr.port()
        )
    }

    pub fn cut(&self) {
        self.cut.send_replace(true);
    }

    /// New connections are accepted and wait, passing nothing, until
    /// [`Self::release`]; connections open now go on as before.
    pub fn hold(&self) {
        self.held.send_replace(true);
    }

    /// Closes the open connections whose start-up message carried `name`
    /// (their `application_name`), as a cut network would: no error
    /// message, just the end of the stream. The others go on.
    pub fn cut_named(&self, name: &str) {
        self.named.send_replace(name.to_owned());
    }

    /// Connections whose start-up message carries `name` (their
    /// `application_name`), open or new, pass nothing more from their
    /// client until [`Self::unstall`]: that client alone finds the server
    /// silent (it sends its start-up, no answer comes).
    pub fn stall_named(&self, name: &str) {
        self.stalled.send_replace(name.to_owned());
    }

    pub fn unstall(&self) {
        self.stalled.send_replace(String::new());
    }

    /// From now on, what a client sends that holds `text` (a statement)
    /// reaches the server `by` later: a slow statement, on the wire.
    pub fn slow_down(&self, text: &str, by: std::time::Duration) {
        self.slowed.send_modify(|s| s.push((text.to_owned(), by)));
    }

    /// Every connection, open or new, passes nothing, either way, until
    /// [`Self::unhang`]: no error, no end of stream, as a server stopped
    /// with SIGSTOP or a network that drops packets. [`Self::cut`] still
    /// closes them.
    pub fn hang(&self) {
        self.hung.send_replace(true);
    }

    /// What the hung connections held passes, and they go on.
    pub fn unhang(&self) {
        self.hung.send_replace(false);
    }

    /// The held connections, and new ones, pass again.
    pub fn release(&self) {
        self.held.send_replace(false);
    }

    pub fn restore(&self) {
        self.cut.send_replace(false);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Log lines written while a test runs, for asserting on what the gateway
/// logs (a `MakeWriter` into a shared buffer).
#[derive(Clone, Default)]
pub struct Captured(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl Captured {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Captured {
    type Writer = Captured;
    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

/// Captures INFO and above, human format, on this thread until the guard
/// drops: under a `current_thread` runtime that is every task of the test.
pub fn capture_logs() -> (Captured, tracing::subscriber::DefaultGuard) {
    // tracing-core caches each callsite's interest once, process-wide, when
    // the callsite is first reached; while exactly one `Dispatch` is
    // registered it asks the *reaching thread's* default (tokio-rs/tracing
    // #3611). A sibling test without a subscriber that reaches a callsite
    // first (another test's failing row load) then caches `never` for it,
    // and this capture misses every later event of it: 2 runs in 10 of
    // `tests/it/http/hostile.rs` under load. A second dispatcher, kept for the
    // life of the process, sends tracing down its general path, which asks
    // every registered dispatcher; this one wants every callsite, so none
    // is ever cached as `never`.
    static PINNED: std::sync::OnceLock<tracing::Dispatch> = std::sync::OnceLock::new();
    PINNED.get_or_init(|| tracing::Dispatch::new(tracing_subscriber::registry()));
    let logs = Captured::default();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::INFO)
        .with_ansi(false)
        .with_writer(logs.clone())
        .finish();
    (logs, tracing::subscriber::set_default(subscriber))
}

/// Polls until `f` holds, every 10 ms; panics naming `what` after 15 s,
/// which only catches "never" (no latency is asserted).
pub async fn eventually<F, Fut>(what: &str, f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    eventually_within(what, std::time::Duration::from_secs(15), f).await
}

/// [`eventually`] with a budget of its own, for a wait whose pace a server
/// sets (only "never" fails, as there).
pub async fn eventually_within<F, Fut>(what: &str, budget: std::time::Duration, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = std::time::Instant::now() + budget;
    while !f().await {
        assert!(std::time::Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

/// Waits until `resource` answers from its filter and cache again, and the
/// feed has proven that every change committed before this call has been
/// applied (a heartbeat made after it: see "The principle" in
/// `bloomgate::feed`). That is the state a "nothing lost after a fault"
/// assertion is about; one key answering 200 is not (it may come from the
/// database while the resource is not vouched for, within
/// `filter.verify_budget`). Panics after 60 s, saying why not.
pub async fn vouched(gw: &Gateway, resource: &str) {
    let r = gw
        .resource(resource)
        .unwrap_or_else(|| panic!("no resource {resource}"));
    let needs_heartbeat = gw
        .freshness()
        .is_some_and(|f| f != bloomgate::config::Freshness::Off);
    // Strictly after this call, whatever the rounding to milliseconds.
    let since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
        + 1;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let heard = gw.stats.progress.heartbeat_ms();
        if r.is_ready() && (!needs_heartbeat || heard > since) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{resource} never vouched for again: {:?}; latest heartbeat {} ms before the wait began; feed {:?}",
            r.why_not_ready(),
            since.saturating_sub(heard) as i64,
            gw.readiness().feed,
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

/// A database on the throwaway `wal_level = logical` primary that
/// `scripts/test.sh` starts (`TestDb` creates and drops it there), with
/// `n` users.
pub async fn logical_db(n: i64) -> TestDb {
    let primary = std::env::var("BLOOMGATE_TEST_PRIMARY_URL")
        .expect("run with scripts/test.sh, which starts a server with wal_level = logical");
    let db = TestDb::on(&format!("{primary}/postgres")).await;
    if n > 0 {
        db.seed_users(n).await;
    }
    db
}

/// [`config`] on the WAL feed, the publication installed at start-up.
pub fn wal_config(db: &TestDb, extra: &str) -> Config {
    wal_config_url(&db.url, extra)
}

/// [`wal_config`] for the database at `url` (a server the test started).
pub fn wal_config_url(url: &str, extra: &str) -> Config {
    config(
        url,
        &format!("freshness = \"wal\"\ninstall_feed = true\n{extra}"),
    )
}
