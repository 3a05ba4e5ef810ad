//! Commit → servable: how long after an INSERT commits its key answers 200
//! through the gateway, for BENCHMARKS.md ("Freshness: commit to servable").
//!
//!     cargo run --release --example freshness_latency -- <server URL> <wal|wal-poll[:interval]|notify> [N] [replica URL]
//!
//! Creates a scratch database on the server (`postgres://user@host:port`,
//! no database), starts a gateway on it in this process with the given
//! change feed, then N times (default 1000): inserts one row, and from the
//! moment the COMMIT returns asks the router (no socket) for the key every
//! 100 µs until it answers 200. Prints p50/p90/p99/max. `wal-poll` is the
//! WAL feed polled (`database.wal_poll_interval`, default here `5ms`:
//! `wal-poll:20ms` for another). The WAL feed needs
//! `wal_level = logical` (`scripts/pg.sh replicas` starts such a server on
//! :54332).
//!
//! With a replica URL (a streaming replica of the server, e.g. :54333), row
//! loads go to it (`replica_urls`), gated by LSN: the figure then includes
//! the wait for the replica to replay the insert (issue 13, "added latency
//! of the LSN wait").

use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Request, StatusCode};
use sqlx::Executor;
use sqlx::postgres::PgPoolOptions;
use tower::ServiceExt;

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let server = args
        .get(1)
        .expect("server URL")
        .trim_end_matches('/')
        .to_string();
    let mode = args
        .get(2)
        .map(String::as_str)
        .unwrap_or("notify")
        .to_string();
    let n: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(1000);
    let replica = args.get(4).map(|r| r.trim_end_matches('/').to_string());
    let name = format!("bloomgate_latency_{}", std::process::id());
    let admin = PgPoolOptions::new()
        .max_connections(1)
        .connect(&format!("{server}/postgres"))
        .await
        .expect("server");
    admin
        .execute(format!("CREATE DATABASE \"{name}\"").as_str())
        .await
        .unwrap();
    let url = format!("{server}/{name}");
    if let Some(r) = &replica {
        // The new database reaches the replica by replay.
        let began = Instant::now();
        while PgPoolOptions::new()
            .max_connections(1)
            .connect(&format!("{r}/{name}"))
            .await
            .is_err()
        {
            assert!(
                began.elapsed() < Duration::from_secs(30),
                "replica never saw {name}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    // `wal-poll:10ms`: the WAL feed, polled.
    let (freshness, poll) = match mode.strip_prefix("wal-poll") {
        Some(rest) => (
            "wal",
            format!(
                "wal_poll_interval = \"{}\"",
                rest.strip_prefix(':').unwrap_or("5ms")
            ),
        ),
        None => (mode.as_str(), String::new()),
    };
    let replicas = match &replica {
        Some(r) => format!("replica_urls = [\"{r}/{name}\"]"),
        None => String::new(),
    };
    let toml = format!(
        r#"
        [database]
        url = "{url}"
        freshness = "{freshness}"
        {poll}
        install_feed = {wal}
        install_triggers = {notify}
        {replicas}
        [log]
        level = "warn"
        [[resource]]
        name = "users"
        route = "/users/{{id}}"
        table = "users"
        key_column = "id"
        key_type = "bigint"
        columns = ["id", "email", "name"]
        "#,
        wal = freshness == "wal",
        notify = mode == "notify",
    );
    let config = bloomgate::config::Config::from_toml(&toml).expect("config");
    let gw = bloomgate::gateway::Gateway::new(config, &Default::default()).unwrap();
    gw.start().await.expect("start");
    let app = bloomgate::http::app(gw.clone());
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect(&url)
        .await
        .unwrap();
    let mut lat = Vec::with_capacity(n);
    for i in 0..n as i64 {
        let id = 1_000_000 + i;
        sqlx::query("INSERT INTO users (id, email, name) VALUES ($1, $2, 'L')")
            .bind(id)
            .bind(format!("l{id}@x.org"))
            .execute(&pool)
            .await
            .unwrap();
        let committed = Instant::now();
        let path = format!("/users/{id}");
        loop {
            let r = app
                .clone()
                .oneshot(Request::get(&path).body(Body::empty()).unwrap())
                .await
                .unwrap();
            if r.status() == StatusCode::OK {
                break;
            }
            assert!(
                committed.elapsed() < Duration::from_secs(10),
                "{path} never servable"
            );
            tokio::time::sleep(Duration::from_micros(100)).await;
        }
        lat.push(committed.elapsed());
    }
    gw.stop();
    pool.close().await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _ = admin
        .execute(format!("DROP DATABASE \"{name}\" WITH (FORCE)").as_str())
        .await;
    lat.sort();
    let q = |p: f64| lat[((lat.len() as f64 * p) as usize).min(lat.len() - 1)];
    let via = if replica.is_some() {
        " (loads from the replica)"
    } else {
        ""
    };
    println!(
        "{mode}{via}: {n} inserts, commit -> servable p50 {:.2} ms, p90 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
        q(0.50).as_secs_f64() * 1e3,
        q(0.90).as_secs_f64() * 1e3,
        q(0.99).as_secs_f64() * 1e3,
        lat[lat.len() - 1].as_secs_f64() * 1e3
    );
}
