//! A failover on a real high-availability stack: Patroni 3 and etcd from
//! Debian's packages, two PostgreSQL 15 nodes and the permanent logical
//! slot `bloomgate` that Patroni keeps on the replica
//! (`scripts/patroni.sh`). The gateway follows the WAL on that slot
//! through a proxy that sends new connections to the leader and cuts the
//! old ones, as HAProxy with Patroni's `/primary` check does. A
//! `patronictl switchover` (the gateway behind the fork point) and a
//! killed leader whose replica lagged (ahead of it: a tail lost) keep the
//! filter; a filter rebuilt from the old primary after the replica
//! stopped receiving is rebuilt again (see `docs/src/failover.md`, "A
//! failover that keeps the filters").
//!
//! Ignored in the main run: CI gives them a lane of their own
//! (`scripts/test.sh`), which installs the packages first; without them
//! the tests fail, naming what is missing.

use crate::common;

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::http::StatusCode;
use bloomgate::gateway::Gateway;
use common::*;

/// A throwaway Patroni cluster; stopped and removed on drop.
struct Cluster {
    dir: PathBuf,
}

impl Cluster {
    fn script(args: &[&str]) -> HashMap<String, String> {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/patroni.sh");
        let out = Command::new(script).args(args).output().unwrap();
        assert!(
            out.status.success(),
            "scripts/patroni.sh {args:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    async fn start() -> Cluster {
        let available = Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/patroni.sh"))
            .arg("available")
            .status()
            .unwrap()
            .success();
        assert!(
            available,
            "Patroni, etcd or PostgreSQL 15 missing: apt-get install patroni etcd-server postgresql-15"
        );
        let dir = tempdir().join("patroni");
        let c = Cluster { dir };
        c.run(&["start"]).await;
        c
    }

    /// `scripts/patroni.sh CMD DIR ARGS…`, off the runtime: a switchover or
    /// a failover takes seconds, and the gateway and the proxy must live
    /// through them as they happen.
    async fn run(&self, cmd: &[&str]) -> HashMap<String, String> {
        let mut args = vec![cmd[0].to_string(), self.dir.to_str().unwrap().to_string()];
        args.extend(cmd[1..].iter().map(|a| a.to_string()));
        tokio::task::spawn_blocking(move || {
            Self::script(&args.iter().map(String::as_str).collect::<Vec<_>>())
        })
        .await
        .unwrap()
    }

    /// The leader's name and address.
    async fn leader(&self) -> (String, std::net::SocketAddr) {
        let out = self.run(&["leader"]).await;
        let port: u16 = out["port"].parse().unwrap();
        (out["leader"].clone(), ([127, 0, 0, 1], port).into())
    }

    fn url(addr: std::net::SocketAddr) -> String {
        format!("postgres://postgres@{addr}/bloomgate")
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/patroni.sh"))
            .args(["stop", self.dir.to_str().unwrap(), "--clean"])
            .output();
        if let Some(parent) = self.dir.parent() {
            let _ = std::fs::remove_dir(parent);
        }
    }
}

async fn exec(url: &str, sql: &str) {
    let pool = sqlx::PgPool::connect(url).await.unwrap();
    sqlx::raw_sql(sql)
        .execute(&pool)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
    pool.close().await;
}

/// The cluster, the users table on it, a proxy to the leader, and a
/// gateway on the WAL feed with Patroni's permanent slot.
async fn setup() -> (Cluster, Proxy, Arc<Gateway>) {
    let cluster = Cluster::start().await;
    let (_, leader) = cluster.leader().await;
    let pool = sqlx::PgPool::connect(&Cluster::url(leader)).await.unwrap();
    bloomgate::db::MIGRATOR.run(&pool).await.unwrap();
    sqlx::query(
        "INSERT INTO users (id, email, name) SELECT g, 'u' || g || '@example.com', 'User ' || g
         FROM generate_series(1, 10) g",
    )
    .execute(&pool)
    .await
    .unwrap();
    pool.close().await;
    let proxy = Proxy::start_to(leader).await;
    let url = format!(
        "postgres://postgres@127.0.0.1:{}/bloomgate",
        proxy.addr.port()
    );
    let gw = started(wal_config_url(&url, "slot = \"bloomgate\"")).await;
    vouched(&gw, "users").await;
    (cluster, proxy, gw)
}

/// New connections to the new leader, the old ones cut.
async fn follow_the_leader(cluster: &Cluster, proxy: &Proxy) -> std::net::SocketAddr {
    let (_, leader) = cluster.leader().await;
    proxy.retarget(leader);
    proxy.cut();
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    proxy.restore();
    leader
}

/// The leader's walsender to its replica stopped (`SIGSTOP`): the replica
/// receives nothing more, as a replica behind a slow link.
async fn stall_the_replica(leader: std::net::SocketAddr) {
    let pool = sqlx::PgPool::connect(&Cluster::url(leader)).await.unwrap();
    let pid: i32 = sqlx::query_scalar(
        "SELECT pid FROM pg_stat_replication WHERE application_name IN ('n1', 'n2')",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    pool.close().await;
    let ok = Command::new("kill")
        .args(["-STOP", &pid.to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill -STOP {pid}");
}

async fn name_of(gw: &Arc<Gateway>, id: i64) -> (StatusCode, String) {
    let r = get(gw, &format!("/users/{id}")).await;
    let name = match r.status {
        StatusCode::OK => r.json()["name"].as_str().unwrap_or("").to_string(),
        _ => String::new(),
    };
    (r.status, name)
}

fn counts(gw: &Gateway) -> (u64, u64, u64) {
    let users = gw.resource("users").unwrap();
    (
        gw.wal_stats.forks_kept.load(Ordering::Relaxed),
        users.stats.kept_across_failover.load(Ordering::Relaxed),
        users.stats.rebuilds.load(Ordering::Relaxed),
    )
}

/// A switchover, then a failover of the replica that lagged: both keep the
/// filter (no rebuild, no scan of the new primary), and every answer once
/// vouched for is the new timeline's.
#[tokio::test]
#[ignore]
async fn a_switchover_and_a_lagging_failover_keep_the_filter() {
    let (cluster, proxy, gw) = setup().await;
    for _ in 0..2 {
        assert_eq!(name_of(&gw, 1).await.0, StatusCode::OK);
    }
    let (_, _, built) = counts(&gw);

    // A switchover: the old leader ships everything before it steps down
    // (the gateway behind the fork point).
    cluster.run(&["switchover"]).await;
    let leader = follow_the_leader(&cluster, &proxy).await;
    exec(
        &Cluster::url(leader),
        "UPDATE users SET name = 'after the switchover' WHERE id = 1;
         INSERT INTO users (id, email, name) VALUES (500, 'n500@x.org', 'New 500');",
    )
    .await;
    vouched(&gw, "users").await;
    assert_eq!(counts(&gw), (1, 1, built), "kept across the switchover");
    assert_eq!(name_of(&gw, 1).await.1, "after the switchover");
    assert_eq!(name_of(&gw, 500).await.0, StatusCode::OK);

    // The old leader rejoins as the replica, and Patroni copies the slot
    // to it again.
    cluster.run(&["start"]).await;
    // A failover of a replica that lagged: the gateway applies a tail the
    // new timeline loses (ahead of the fork point).
    stall_the_replica(leader).await;
    exec(
        &Cluster::url(leader),
        "INSERT INTO users (id, email, name) VALUES (600, 'lost@x.org', 'Lost');
         UPDATE users SET name = 'a lost update' WHERE id = 2;
         DELETE FROM users WHERE id = 3;",
    )
    .await;
    vouched(&gw, "users").await;
    for _ in 0..2 {
        assert_eq!(name_of(&gw, 2).await.1, "a lost update");
    }
    assert_eq!(name_of(&gw, 3).await.0, StatusCode::NOT_FOUND);
    cluster
        .run(&["set", "maximum_lag_on_failover=1073741824"])
        .await;
    let killed = cluster.run(&["kill-leader"]).await;
    assert_eq!(killed["promoted"], "yes", "{killed:?}");
    let leader = follow_the_leader(&cluster, &proxy).await;
    exec(
        &Cluster::url(leader),
        "INSERT INTO users (id, email, name) VALUES (700, 'n700@x.org', 'New 700')",
    )
    .await;
    vouched(&gw, "users").await;
    assert_eq!(counts(&gw), (2, 2, built), "kept across the failover");
    assert_eq!(name_of(&gw, 2).await, (StatusCode::OK, "User 2".into()));
    assert_eq!(name_of(&gw, 3).await.0, StatusCode::OK, "the lost delete");
    assert_eq!(
        name_of(&gw, 600).await.0,
        StatusCode::NOT_FOUND,
        "the lost insert"
    );
    assert_eq!(name_of(&gw, 700).await.0, StatusCode::OK);
    assert_eq!(name_of(&gw, 1).await.1, "after the switchover");
    gw.stop();
}

/// A rebuild that scanned the leader after its replica stopped receiving
/// saw a delete the new timeline loses: that filter is not kept (kept, the
/// deleted row would be answered 404 on the new timeline, which has it).
#[tokio::test]
#[ignore]
async fn a_filter_scanned_past_the_fork_is_rebuilt_after_a_failover() {
    let (cluster, proxy, gw) = setup().await;
    let (_, leader) = cluster.leader().await;
    stall_the_replica(leader).await;
    exec(&Cluster::url(leader), "DELETE FROM users WHERE id = 3").await;
    let users = gw.resource("users").unwrap().clone();
    users
        .rebuild(true)
        .await
        .expect("a rebuild on the old leader");
    vouched(&gw, "users").await;
    assert_eq!(name_of(&gw, 3).await.0, StatusCode::NOT_FOUND);
    let (_, _, built) = counts(&gw);
    cluster
        .run(&["set", "maximum_lag_on_failover=1073741824"])
        .await;
    let killed = cluster.run(&["kill-leader"]).await;
    assert_eq!(killed["promoted"], "yes", "{killed:?}");
    follow_the_leader(&cluster, &proxy).await;
    vouched(&gw, "users").await;
    assert_eq!(name_of(&gw, 3).await.0, StatusCode::OK, "the lost delete");
    let (forks, kept, rebuilds) = counts(&gw);
    assert_eq!(
        (forks, kept),
        (1, 0),
        "the feed proved the promotion, the filter did not"
    );
    assert!(rebuilds > built, "rebuilt");
    gw.stop();
}
