//! The bus feed's `redis-server`: one per history, on a free port, that
//! the `restart-redis` fault kills (`SIGKILL`) and starts again on the
//! same port, empty, with everything it had, or with an older copy of its
//! data (a stream that lost its tail, as after a failover to a lagging
//! replica), and that `redis-refuses` makes refuse writes for a while.
//! The minimum of tests/it/feed/bus.rs's `Redis`, plus persistence.
//!
//! It always runs with an append-only file fsynced at every write
//! (`appendfsync always`), so "with everything" is every write it
//! acknowledged; "empty" removes the files before the restart, "older"
//! puts back a copy of them taken earlier.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// What a restarted server has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Restart {
    Empty,
    Kept,
    Older,
}

impl Restart {
    pub fn name(self) -> &'static str {
        match self {
            Restart::Empty => "empty",
            Restart::Kept => "with all its data",
            Restart::Older => "with an older copy of its data (the stream's tail lost)",
        }
    }
}

pub struct Redis {
    child: Option<Child>,
    pub port: u16,
    dir: PathBuf,
}

const AOF: &str = "appendonlydir";
const OLDER: &str = "older";

impl Redis {
    /// Starts one on a free port; panics when `redis-server` is missing:
    /// the bus feed must not pass without its bus.
    pub async fn start() -> Redis {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let dir = std::env::temp_dir().join(format!(
            "bloomgate-truth-redis-{}-{port}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mut r = Redis {
            child: None,
            port,
            dir,
        };
        r.spawn().await;
        r
    }

    async fn spawn(&mut self) {
        let bin = std::env::var("BLOOMGATE_REDIS_SERVER").unwrap_or_else(|_| "redis-server".into());
        let child = Command::new(&bin)
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--dir", self.dir.to_str().unwrap()])
            .args([
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
            ])
            .args(["--appenddirname", AOF, "--auto-aof-rewrite-percentage", "0"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("{bin}: {e}: the bus feed needs redis-server (scripts/test.sh installs it)")
            });
        self.child = Some(child);
        let began = Instant::now();
        while !self.answers().await {
            assert!(
                began.elapsed() < Duration::from_secs(20),
                "redis-server on port {} does not answer after 20 s",
                self.port
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    async fn answers(&self) -> bool {
        let Ok(client) = redis::Client::open(self.url()) else {
            return false;
        };
        let Ok(mut c) = client.get_multiplexed_async_connection().await else {
            return false;
        };
        let pong: Result<String, _> = redis::cmd("PING").query_async(&mut c).await;
        pong.is_ok_and(|p| p == "PONG")
    }

    /// A copy of its files as they are now, for [`Restart::Older`]. With
    /// `appendfsync always` every acknowledged write is in them; a write
    /// caught half-way is a truncated tail, which Redis loads without it.
    pub fn copy_now(&self) {
        let older = self.dir.join(OLDER);
        let _ = std::fs::remove_dir_all(&older);
        copy_dir(&self.dir.join(AOF), &older);
    }

    /// `SIGKILL`: nothing it had in memory only survives, and no client is
    /// told.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again on the same port (after [`Redis::kill`]).
    pub async fn restart(&mut self, with: Restart) {
        assert!(self.child.is_none(), "restart of a running redis-server");
        let aof = self.dir.join(AOF);
        match with {
            Restart::Kept => {}
            Restart::Empty => {
                let _ = std::fs::remove_dir_all(&aof);
            }
            Restart::Older => {
                let _ = std::fs::remove_dir_all(&aof);
                copy_dir(&self.dir.join(OLDER), &aof);
            }
        }
        self.spawn().await;
    }
}

/// How `redis-refuses` makes the server refuse writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refuse {
    /// `maxmemory` below what it holds, under `noeviction`: `OOM` for
    /// every command that may grow it (an append among them).
    Full,
    /// `min-replicas-to-write 1` and no replica: `NOREPLICAS` for every
    /// write.
    NoReplicas,
}

impl Refuse {
    pub fn name(self) -> &'static str {
        match self {
            Refuse::Full => "full (maxmemory below its use, noeviction: OOM)",
            Refuse::NoReplicas => "short of replicas (min-replicas-to-write 1: NOREPLICAS)",
        }
    }
}

impl Redis {
    async fn config_set(&self, pairs: &[(&str, &str)]) {
        let client = redis::Client::open(self.url()).unwrap();
        let mut c = client.get_multiplexed_async_connection().await.unwrap();
        for (k, v) in pairs {
            let _: () = redis::cmd("CONFIG")
                .arg("SET")
                .arg(*k)
                .arg(*v)
                .query_async(&mut c)
                .await
                .unwrap_or_else(|e| panic!("CONFIG SET {k} {v}: {e}"));
        }
    }

    /// From now on, writes are refused (reads still answer).
    pub async fn refuse(&self, how: Refuse) {
        match how {
            Refuse::Full => {
                self.config_set(&[("maxmemory-policy", "noeviction"), ("maxmemory", "1")])
                    .await
            }
            Refuse::NoReplicas => self.config_set(&[("min-replicas-to-write", "1")]).await,
        }
    }

    /// Writes are taken again.
    pub async fn accept(&self) {
        self.config_set(&[("maxmemory", "0"), ("min-replicas-to-write", "0")])
            .await;
    }
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    if let Ok(entries) = std::fs::read_dir(from) {
        for e in entries.flatten() {
            let _ = std::fs::copy(e.path(), to.join(e.file_name()));
        }
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
