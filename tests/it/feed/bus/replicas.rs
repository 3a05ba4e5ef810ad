//! The bus's read tier (`bus.read_from = "replicas"`, "A read tier" in
//! `feed::bus::redis`): each test starts a Redis primary and a replica of
//! it on free ports (plaintext, or TLS with certificates made by
//! `openssl`), and two gateways on the throwaway `wal_level = logical`
//! primary of `scripts/test.sh`. What is asserted is counted by Redis
//! itself (`INFO commandstats`): which node served the fleet's reads.

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bloomgate::feed::bus::Follows;
use bloomgate::gateway::Gateway;
use common::redis_server::*;
use common::*;

// Tests that count walsenders and Redis commands run one at a time.
use crate::common::ON_THE_PRIMARY as ONE_AT_A_TIME;

/// A primary and its replica, in sync; with `certs`, TLS only (the
/// replication link too).
struct Pair {
    primary: Redis,
    replica: Redis,
    dir: std::path::PathBuf,
}

impl Pair {
    async fn start(certs: Option<&Arc<Certs>>) -> Self {
        let dir = std::env::temp_dir().join(unique("bloomgate-bus-replicas"));
        let node = |port: u16, replica_of: Option<u16>| -> Vec<String> {
            let own = dir.join(format!("node-{port}"));
            std::fs::create_dir_all(&own).unwrap();
            let mut a: Vec<String> = Vec::new();
            if let Some(c) = certs {
                a.extend(
                    [
                        "--tls-port",
                        "PORT",
                        "--port",
                        "0",
                        "--tls-cert-file",
                        &c.path("server.crt"),
                        "--tls-key-file",
                        &c.path("server.key"),
                        "--tls-ca-cert-file",
                        &c.path("ca.crt"),
                        "--tls-auth-clients",
                        "no",
                        "--tls-replication",
                        "yes",
                        "--bind",
                        "127.0.0.1",
                    ]
                    .map(String::from),
                );
            }
            // Replicas log in as `repl`, which the primary can turn away.
            a.extend(
                [
                    "--user",
                    "repl",
                    "on",
                    ">repl-password",
                    "+@all",
                    "--masteruser",
                    "repl",
                    "--masterauth",
                    "repl-password",
                ]
                .map(String::from),
            );
            if let Some(p) = replica_of {
                a.extend(["--replicaof".into(), "127.0.0.1".into(), p.to_string()]);
            }
            // A replica writes the snapshot a full sync sends it into its
            // directory; the sync starts at once, not after 5 s.
            a.extend([
                "--dir".into(),
                own.to_str().unwrap().into(),
                "--repl-diskless-sync-delay".into(),
                "0".into(),
            ]);
            a
        };
        let spawn = |port: u16, args: Vec<String>| async move {
            match certs {
                Some(c) => Redis::spawn(port, Some(c.clone()), &args).await,
                None => Redis::start_with(port, &args, None).await,
            }
        };
        let p = free_port();
        let primary = spawn(p, node(p, None)).await;
        let r = free_port();
        let replica = spawn(r, node(r, Some(p))).await;
        eventually("the replica in sync", || async {
            replica
                .info("replication")
                .await
                .contains("master_link_status:up")
        })
        .await;
        Pair {
            primary,
            replica,
            dir,
        }
    }

    /// The replica's link breaks (its replication user turned away by the
    /// primary), and it keeps answering reads with what it had (Redis'
    /// default, `replica-serve-stale-data yes`): its clients see no error,
    /// only a stream that stops. (`REPLICAOF` elsewhere would disconnect
    /// its blocked clients, an error the consumer already answers.)
    async fn strand_the_replica(&self) {
        self.primary.turn_away("repl").await;
        eventually("the replica's link down", || async {
            self.replica
                .info("replication")
                .await
                .contains("master_link_status:down")
        })
        .await;
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        self.replica.kill();
        self.primary.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Two gateways reading the bus from `pair`'s replicas.
async fn fleet_on(db: &TestDb, fleet: &Fleet, pair: &Pair) -> Vec<Arc<Gateway>> {
    let ca = pair.primary.tls.as_ref().map(|c| c.path("ca.crt"));
    // `max_lag` long enough that a loaded machine does not fall back on
    // its own: the move away from a stranded replica comes halfway.
    let bus = format!(
        "{}read_from = \"replicas\"\n",
        fleet
            .bus_toml_with(&pair.primary.url(), ca.as_deref())
            .replace("max_lag = \"1s\"", "max_lag = \"10s\"")
    );
    let config = || wal_config(db, &format!("{BY_EMAIL}\n{bus}"));
    let gws = vec![started(config()).await, started(config()).await];
    wait_all_on_bus(&gws).await;
    gws
}

/// Both gateways serve `name` for `/users/{id}`, fresh.
async fn serves(gws: &[Arc<Gateway>], id: i64, name: &str) {
    for gw in gws {
        fresh(gw, &format!("/users/{id}"), |r| {
            r.status == 200 && r.json()["name"] == name
        })
        .await;
    }
}

/// `gw`'s bus status names `redis` as the node it reads, in `role`.
fn reads(gw: &Gateway, role: &str, redis: &Redis) -> bool {
    let node = gw.bus_status().unwrap().get().reading;
    node == format!("{role} 127.0.0.1:{}", redis.port)
}

async fn rename(db: &TestDb, id: i64, name: &str) -> Instant {
    sqlx::query("UPDATE users SET name = $1 WHERE id = $2")
        .bind(name)
        .bind(id)
        .execute(&db.pool)
        .await
        .unwrap();
    Instant::now()
}

/// The fleet reads the replica, never the primary, and changes reach it
/// through the replica. Then the replica is stranded (its link to the
/// primary broken, its data frozen): no gateway serves a row older than
/// one committed `bound` before the request meanwhile, and each moves to
/// the primary (the only node then online) halfway to `bus.max_lag`,
/// without a fall-back or a resync, and serves every change.
async fn the_fleet_reads_the_replica_and_leaves_it_when_stranded(certs: Option<Arc<Certs>>) {
    let _one = ONE_AT_A_TIME.lock().await;
    let pair = Pair::start(certs.as_ref()).await;
    let db = bus_db().await;
    let fleet = Fleet::new();
    let gws = fleet_on(&db, &fleet, &pair).await;

    rename(&db, 3, "through the replica").await;
    serves(&gws, 3, "through the replica").await;
    eventually(
        "both gateways reading the replica, none the primary",
        || async {
            pair.replica.clients_reading().await == 2 && pair.primary.clients_reading().await == 0
        },
    )
    .await;
    // And each says so (the admin view, the status page).
    eventually("both gateways say they read the replica", || async {
        gws.iter().all(|gw| reads(gw, "replica", &pair.replica))
    })
    .await;

    // Cached on both, then stranded on the replica.
    for gw in &gws {
        assert_eq!(get(gw, "/users/4").await.json()["name"], "User 4");
    }
    pair.strand_the_replica().await;
    let committed = rename(&db, 4, "after the strand").await;
    let bound = Duration::from_secs(2);
    let mut checked = 0;
    while committed.elapsed() < Duration::from_secs(6) {
        for gw in &gws {
            let sent = Instant::now();
            let r = get(gw, "/users/4").await;
            if sent.duration_since(committed) > bound && r.status != 503 {
                assert_eq!(r.status, 200);
                assert_eq!(
                    r.json()["name"],
                    "after the strand",
                    "stale {:?} after the commit ({})",
                    sent.duration_since(committed),
                    r.header("cache-status")
                );
                checked += 1;
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(checked > 50, "{checked} answers checked");

    eventually("both gateways reading the primary", || async {
        pair.primary.xreads().await > 10 && pair.primary.clients_reading().await == 2
    })
    .await;
    eventually("both gateways say they read the primary", || async {
        gws.iter().all(|gw| reads(gw, "primary", &pair.primary))
    })
    .await;
    rename(&db, 5, "through the primary").await;
    serves(&gws, 5, "through the primary").await;
    serves(&gws, 4, "after the strand").await;
    // The move cost no fall-back to a direct feed, and no resync: the
    // stream went on from where the replica froze.
    for gw in &gws {
        let b = gw.bus_status().unwrap();
        assert_eq!(mode(gw), Follows::Bus);
        assert_eq!(b.fallbacks.load(std::sync::atomic::Ordering::Relaxed), 0);
        assert_eq!(b.breaks.load(std::sync::atomic::Ordering::Relaxed), 0);
    }
    fleet.stop(&gws, &db).await;
}

#[tokio::test]
async fn a_fleet_reads_a_replica_and_leaves_it_when_stranded() {
    the_fleet_reads_the_replica_and_leaves_it_when_stranded(None).await;
}

/// The same over TLS (the replica's address checked against its
/// certificate, with `bus.ca_file`).
#[tokio::test]
async fn a_fleet_reads_a_replica_over_tls_and_leaves_it_when_stranded() {
    the_fleet_reads_the_replica_and_leaves_it_when_stranded(Some(Certs::make())).await;
}

/// With `read_from = "primary"` (the default) the replica serves nothing:
/// the setting is what moves the reads.
#[tokio::test]
async fn by_default_the_fleet_reads_the_primary() {
    let _one = ONE_AT_A_TIME.lock().await;
    let pair = Pair::start(None).await;
    let db = bus_db().await;
    let fleet = Fleet::new();
    let config = || fleet.config(&db, &pair.primary);
    let gws = vec![started(config()).await, started(config()).await];
    wait_all_on_bus(&gws).await;
    rename(&db, 3, "through the primary").await;
    serves(&gws, 3, "through the primary").await;
    assert!(pair.primary.xreads().await > 0);
    assert_eq!(pair.replica.xreads().await, 0);
    for gw in &gws {
        assert!(reads(gw, "primary", &pair.primary));
    }
    fleet.stop(&gws, &db).await;
}

/// `bloomgate preflight` with `read_from = "replicas"` names the online
/// replicas the fleet would read, and notes (without failing) when there
/// is none: the gateways then read the primary.
#[tokio::test]
async fn preflight_names_the_replicas_the_fleet_would_read() {
    let _one = ONE_AT_A_TIME.lock().await;
    let pair = Pair::start(None).await;
    let db = bus_db().await;
    let fleet = Fleet::new();
    let mut config = fleet.config(&db, &pair.primary);
    config.bus.read_from = bloomgate::config::BusReadFrom::Replicas;
    let report = bloomgate::preflight::run(&config).await.to_string();
    assert!(
        report.contains(&format!(
            "ok      bus.read_from = \"replicas\": the primary lists 1 online (127.0.0.1:{})",
            pair.replica.port
        )),
        "{report}"
    );
    pair.strand_the_replica().await;
    eventually("the primary lists the replica no more", || async {
        !pair
            .primary
            .info("replication")
            .await
            .contains("state=online")
    })
    .await;
    let report = bloomgate::preflight::run(&config).await;
    let text = report.to_string();
    assert!(
        text.contains("note    bus.read_from = \"replicas\": the primary lists no online replica"),
        "{text}"
    );
    assert!(!text.contains("MISSING bus.read_from"), "{text}");
}
