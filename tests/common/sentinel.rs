//! Redis Sentinel for the bus's tests: a primary, a replica and three
//! sentinels (`redis-server --sentinel`) on free ports. The data nodes have
//! no default user, only an ACL user with a password; the sentinels have a
//! password of their own. tests/it/feed/bus/sentinel.rs fails it over once; the
//! checker (tests/truth, `redis-failover`) again and again, which is why a
//! killed primary can come back as the new primary's replica
//! ([`Site::rejoin`]) and the roles are swapped: `primary` is always the
//! node the sentinels were last seen to name.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use super::redis_server::{Fleet, Redis, free_port};
use super::{eventually, eventually_within};

pub const USER: &str = "bg";
pub const PASSWORD: &str = "s3cret-bus-password";
pub const SENTINEL_PASSWORD: &str = "s3cret-sentinel-password";
pub const MASTER: &str = "bgm";

/// A primary, its replica and three sentinels watching them.
pub struct Site {
    pub primary: Redis,
    pub replica: Redis,
    pub sentinels: Vec<(Child, u16)>,
    pub dir: PathBuf,
}

/// A data node's options: no default user, the ACL user the gateways log in
/// as, and `repl`, the one replicas log in as (so a test can turn it away
/// and cut replication), with `extra` after them.
fn acl(extra: &[String]) -> Vec<String> {
    let mut a: Vec<String> = [
        "--user",
        "default",
        "off",
        "--user",
        USER,
        "on",
        &format!(">{PASSWORD}"),
        "~*",
        "&*",
        "+@all",
        "--user",
        "repl",
        "on",
        &format!(">{PASSWORD}"),
        "+@all",
        "--masteruser",
        "repl",
        "--masterauth",
        PASSWORD,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    a.extend_from_slice(extra);
    a
}

fn login() -> String {
    format!("{USER}:{PASSWORD}")
}

fn replica_of(port: u16) -> Vec<String> {
    acl(&["--replicaof".into(), "127.0.0.1".into(), port.to_string()])
}

/// `args` with a directory of the node's own under `dir`: a replica writes
/// the copy a full sync sends it there, not into the test's working
/// directory (the crate's, where it would be left behind).
fn node(dir: &std::path::Path, port: u16, mut args: Vec<String>) -> Vec<String> {
    let own = dir.join(format!("node-{port}"));
    std::fs::create_dir_all(&own).unwrap();
    args.extend(["--dir".to_string(), own.to_str().unwrap().to_string()]);
    // A replica's full sync at once, not after the 5 s a primary waits by
    // default for more replicas to share it.
    args.extend(["--repl-diskless-sync-delay".to_string(), "0".to_string()]);
    args
}

impl Site {
    pub async fn start() -> Self {
        let dir =
            std::env::temp_dir().join(format!("bloomgate-sentinel-{:x}", rand::random::<u32>()));
        std::fs::create_dir_all(&dir).unwrap();
        let port = free_port();
        let primary = Redis::start_with(port, &node(&dir, port, acl(&[])), Some(&login())).await;
        let port = free_port();
        let replica = Redis::start_with(
            port,
            &node(&dir, port, replica_of(primary.port)),
            Some(&login()),
        )
        .await;
        let bin = std::env::var("BLOOMGATE_REDIS_SERVER").unwrap_or_else(|_| "redis-server".into());
        let mut sentinels = Vec::new();
        for i in 0..3 {
            let port = free_port();
            let conf = dir.join(format!("sentinel{i}.conf"));
            // Sentinel rewrites its file: each has its own.
            std::fs::write(
                &conf,
                format!(
                    "port {port}\nbind 127.0.0.1\ndir {dir}\n\
                     sentinel monitor {MASTER} 127.0.0.1 {p} 2\n\
                     sentinel down-after-milliseconds {MASTER} 1000\n\
                     sentinel failover-timeout {MASTER} 4000\n\
                     sentinel auth-user {MASTER} {USER}\n\
                     sentinel auth-pass {MASTER} {PASSWORD}\n\
                     requirepass {SENTINEL_PASSWORD}\n\
                     sentinel sentinel-pass {SENTINEL_PASSWORD}\n\
                     logfile {dir}/sentinel{i}.log\n",
                    dir = dir.display(),
                    p = primary.port,
                ),
            )
            .unwrap();
            let child = Command::new(&bin)
                .arg(&conf)
                .arg("--sentinel")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("redis-server --sentinel");
            sentinels.push((child, port));
        }
        let site = Site {
            primary,
            replica,
            sentinels,
            dir,
        };
        // A failover needs the replica in sync, and the sentinels to know
        // it and each other.
        eventually("the replica in sync with the primary", || async {
            replica_in_sync(&site.replica).await.is_ok()
        })
        .await;
        // A sentinel finds the replica in the primary's INFO, which it
        // reads every 10 s, and the other sentinels by their hellos (every
        // 2 s): on a loaded machine that takes more than `eventually`'s
        // 15 s (CI, once).
        let discovery = std::time::Duration::from_secs(60);
        eventually_within(
            "the sentinels know the replica and each other",
            discovery,
            || async {
                let mut all = true;
                for (_, port) in &site.sentinels {
                    let replicas = site.sentinel_count(*port, "replicas").await;
                    let others = site.sentinel_count(*port, "sentinels").await;
                    all &= replicas == Some(1) && others == Some(2);
                }
                all
            },
        )
        .await;
        site
    }

    async fn ask<T: redis::FromRedisValue>(port: u16, what: &str) -> Option<T> {
        let client =
            redis::Client::open(format!("redis://:{SENTINEL_PASSWORD}@127.0.0.1:{port}")).ok()?;
        let mut c = client.get_multiplexed_async_connection().await.ok()?;
        redis::cmd("SENTINEL")
            .arg(what)
            .arg(MASTER)
            .query_async(&mut c)
            .await
            .ok()
    }

    /// How many `what` (`replicas`, `sentinels`) the sentinel on `port`
    /// knows of the master.
    pub async fn sentinel_count(&self, port: u16, what: &str) -> Option<usize> {
        let v: Vec<redis::Value> = Self::ask(port, what).await?;
        Some(v.len())
    }

    /// The primary's port as the sentinel on `port` names it.
    async fn named_by(port: u16) -> Option<u16> {
        let (_, p): (String, u16) = Self::ask(port, "get-master-addr-by-name").await?;
        Some(p)
    }

    /// The primary's port as the first sentinel names it.
    pub async fn primary_port(&self) -> Option<u16> {
        Self::named_by(self.sentinels[0].1).await
    }

    /// The sentinels' URLs, with `sentinel_password`.
    pub fn sentinel_urls(&self, sentinel_password: &str) -> Vec<String> {
        self.sentinels
            .iter()
            .map(|(_, p)| format!("redis://:{sentinel_password}@127.0.0.1:{p}"))
            .collect()
    }

    /// `bus.url`: its host is the master's name (not used), its user and
    /// password the data nodes'.
    pub fn url(password: &str) -> String {
        format!("redis://{USER}:{password}@{MASTER}/0")
    }

    /// The `[bus]` section: the sentinels' URLs (with their password), the
    /// master's name, and [`Site::url`].
    pub fn bus_toml(&self, fleet: &Fleet, password: &str, sentinel_password: &str) -> String {
        let sentinels: Vec<String> = self
            .sentinel_urls(sentinel_password)
            .iter()
            .map(|u| format!("\"{u}\""))
            .collect();
        format!(
            "[bus]\nurl = \"{}\"\nsentinels = [{}]\n\
             sentinel_master = \"{MASTER}\"\nslot = \"{}\"\nprefix = \"{}\"\nmax_lag = \"1s\"\n",
            Self::url(password),
            sentinels.join(", "),
            fleet.slot,
            fleet.prefix
        )
    }

    /// The replica loses its link: its replication user is turned away on
    /// the primary, which goes on taking writes the replica will not have.
    pub async fn cut_replication(&self) {
        self.primary.turn_away("repl").await;
    }

    /// Whether the promotion is done as every client sees it: every
    /// sentinel names the replica, and it says it is a master.
    pub async fn promoted(&self) -> bool {
        for (_, port) in &self.sentinels {
            if Self::named_by(*port).await != Some(self.replica.port) {
                return false;
            }
        }
        let Some(mut c) = self.replica.conn().await else {
            return false;
        };
        let role: Result<Vec<redis::Value>, _> = redis::cmd("ROLE").query_async(&mut c).await;
        matches!(role.as_deref(), Ok([redis::Value::BulkString(r), ..]) if r == b"master")
    }

    /// After a promotion: the killed primary started again on its port
    /// (empty: the data nodes keep nothing on disk) as a replica of the
    /// new one, and the roles swapped. If what answers there is not a
    /// replica, another process took the port while it was free (ours then
    /// could not bind it; a 10-minute run of the checker met that once and
    /// starved its later failovers): on a new port, which the sentinels
    /// learn from the primary.
    pub async fn rejoin(&mut self) {
        let mut port = self.primary.port;
        for _ in 0..3 {
            let _ = std::fs::remove_dir_all(self.dir.join(format!("node-{port}")));
            let args = node(&self.dir, port, replica_of(self.replica.port));
            let rejoined = Redis::start_with(port, &args, Some(&login())).await;
            if is_replica(&rejoined).await {
                self.primary = std::mem::replace(&mut self.replica, rejoined);
                return;
            }
            port = free_port();
        }
        panic!("the killed primary could not be started again as a replica");
    }

    /// A split brain: the replica made a primary and every sentinel told
    /// to watch it (as a majority cut off from the primary would promote
    /// it), while the primary, which no sentinel watches now, stays a
    /// primary and takes writes on the connections open to it. The
    /// sentinels keep the site's settings (a second to judge a node down).
    pub async fn split(&self) {
        let mut replica = self.replica.conn().await.unwrap();
        let _: () = redis::cmd("REPLICAOF")
            .arg("NO")
            .arg("ONE")
            .query_async(&mut replica)
            .await
            .unwrap();
        let port = self.replica.port.to_string();
        for (_, sentinel) in &self.sentinels {
            let client =
                redis::Client::open(format!("redis://:{SENTINEL_PASSWORD}@127.0.0.1:{sentinel}"))
                    .unwrap();
            let mut c = client.get_multiplexed_async_connection().await.unwrap();
            for args in [
                vec!["REMOVE", MASTER],
                vec!["MONITOR", MASTER, "127.0.0.1", &port, "2"],
                vec!["SET", MASTER, "auth-user", USER],
                vec!["SET", MASTER, "auth-pass", PASSWORD],
                vec!["SET", MASTER, "down-after-milliseconds", "1000"],
                vec!["SET", MASTER, "failover-timeout", "4000"],
            ] {
                let mut cmd = redis::cmd("SENTINEL");
                for a in args {
                    cmd.arg(a);
                }
                let _: () = cmd.query_async(&mut c).await.unwrap();
            }
        }
    }

    /// The end of a split brain: the isolated primary made a replica of
    /// the one the sentinels name (what it took alone is lost), and the
    /// roles swapped.
    pub async fn heal(&mut self) {
        let mut old = self.primary.conn().await.unwrap();
        let _: () = redis::cmd("REPLICAOF")
            .arg("127.0.0.1")
            .arg(self.replica.port)
            .query_async(&mut old)
            .await
            .unwrap();
        std::mem::swap(&mut self.primary, &mut self.replica);
    }

    /// Follows a failover the sentinels made on their own (they judged
    /// the primary down: on a loaded machine a primary can miss
    /// `down-after-milliseconds`): once it is done ([`Site::promoted`]),
    /// the roles are swapped, and `Some` says what the first sentinel
    /// logged of it (its last `+odown` and `+switch-master`). Without this
    /// the site would go on calling the new primary its replica, and no
    /// later failover could be injected.
    pub async fn follow(&mut self) -> Option<String> {
        if !self.promoted().await {
            return None;
        }
        std::mem::swap(&mut self.primary, &mut self.replica);
        let log = std::fs::read_to_string(self.dir.join("sentinel0.log")).unwrap_or_default();
        let last = |what: &str| {
            log.lines()
                .rev()
                .find(|l| l.contains(what))
                .map(str::trim)
                .unwrap_or("(not in its log)")
                .to_string()
        };
        Some(format!("{} | {}", last("+odown"), last("+switch-master")))
    }

    /// Whether another failover can promote the replica (`Err`: why
    /// not): it has finished its sync with the primary (its own word: the
    /// sentinels ask a replica every 10 s, and every second once the
    /// primary is down), and every sentinel names the primary, sees the
    /// replica up and knows the two other sentinels (a leader needs a
    /// majority).
    pub async fn steady(&self) -> Result<(), String> {
        replica_in_sync(&self.replica).await?;
        for (_, port) in &self.sentinels {
            let named = Self::named_by(*port).await;
            if named != Some(self.primary.port) {
                return Err(format!("the sentinel on {port} names {named:?}"));
            }
            let others = self.sentinel_count(*port, "sentinels").await;
            if others != Some(2) {
                return Err(format!("the sentinel on {port} knows {others:?} others"));
            }
            let Some(replicas) = Self::ask::<Vec<Vec<String>>>(*port, "replicas").await else {
                return Err(format!("the sentinel on {port} lists no replicas"));
            };
            let seen: Vec<(String, String)> = replicas
                .iter()
                .map(|r| {
                    let field = |k: &str| {
                        r.chunks(2)
                            .find(|kv| kv[0] == k)
                            .map(|kv| kv[1].clone())
                            .unwrap_or_default()
                    };
                    (field("port"), field("flags"))
                })
                .collect();
            let port_text = self.replica.port.to_string();
            if !seen.iter().any(|(p, f)| *p == port_text && f == "slave") {
                return Err(format!(
                    "the sentinel on {port} sees the replicas (port, flags) {seen:?}"
                ));
            }
        }
        Ok(())
    }
}

/// `Ok` once `r`, a replica, has finished its sync with its primary.
async fn replica_in_sync(r: &Redis) -> Result<(), String> {
    let Some(mut c) = r.conn().await else {
        return Err(format!("the replica (port {}) does not answer", r.port));
    };
    let info: String = redis::cmd("INFO")
        .arg("replication")
        .query_async(&mut c)
        .await
        .map_err(|e| format!("INFO on the replica: {e}"))?;
    if info.contains("master_link_status:up") {
        return Ok(());
    }
    let said: Vec<&str> = info
        .lines()
        .filter(|l| l.starts_with("role") || l.starts_with("master_"))
        .map(str::trim)
        .collect();
    Err(format!(
        "the replica (port {}) is not in sync: {}",
        r.port,
        said.join(" ")
    ))
}

/// Whether `r` says it is a replica (`ROLE`).
async fn is_replica(r: &Redis) -> bool {
    let Some(mut c) = r.conn().await else {
        return false;
    };
    let role: Result<Vec<redis::Value>, _> = redis::cmd("ROLE").query_async(&mut c).await;
    matches!(role.as_deref(), Ok([redis::Value::BulkString(r), ..]) if r == b"slave")
}

impl Drop for Site {
    fn drop(&mut self) {
        for (c, _) in &mut self.sentinels {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
