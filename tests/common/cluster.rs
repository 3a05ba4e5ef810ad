//! Throwaway PostgreSQL servers a test starts, stops, crashes, promotes and
//! moves between ports: the database's own lifecycle (failovers, standbys
//! stranded on an old timeline, synchronous standbys, restarts), played on
//! servers no other test shares. From the local binaries (as
//! `scripts/pg.sh` finds them), each in a directory of its own under the
//! temporary directory, on a free port, as the `postgres` user when the
//! tests run as root (initdb refuses root). Dropped, a server is stopped
//! (immediately) and its directory removed. Never touches a server it did
//! not start.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use sqlx::postgres::PgPoolOptions;
use sqlx::{Executor, PgPool};

static SERVERS: AtomicU64 = AtomicU64::new(0);

/// A free TCP port on 127.0.0.1 (bound, then released).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn bindir() -> PathBuf {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .expect(
            "the PostgreSQL binaries (/usr/lib/postgresql/*/bin): scripts/test.sh installs them",
        )
        .filter_map(|e| Some(e.ok()?.path().join("bin")))
        .filter(|d| d.join("initdb").exists())
        .collect();
    dirs.sort_by_key(|d| {
        d.parent()
            .and_then(|v| v.file_name()?.to_str()?.parse::<u32>().ok())
            .unwrap_or(0)
    });
    dirs.pop().expect("no PostgreSQL binaries")
}

fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

/// Runs a PostgreSQL program as the server's owner; panics with its output
/// if it fails (unless `may_fail`).
fn run(program: &str, args: &[&str], may_fail: bool) -> bool {
    let bin = bindir().join(program);
    let mut cmd = if is_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(&bin);
        c
    } else {
        Command::new(&bin)
    };
    let out = cmd
        .args(args)
        .output()
        .expect("running a PostgreSQL program");
    if !out.status.success() && !may_fail {
        panic!(
            "{program} {args:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    out.status.success()
}

/// One server: its data directory and the port it listens on now.
pub struct Server {
    pub dir: PathBuf,
    pub port: u16,
    /// `-c` settings passed at every start.
    settings: Vec<String>,
}

impl Server {
    fn new_dir(what: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "bloomgate-{what}-{}-{}",
            std::process::id(),
            SERVERS.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        if is_root() {
            let ok = Command::new("chown")
                .args(["postgres", dir.to_str().unwrap()])
                .status()
                .unwrap()
                .success();
            assert!(ok, "chown postgres {dir:?}");
        }
        dir
    }

    /// A new primary (`wal_level = logical`, room for walsenders and slots)
    /// with `settings` on top, started on a free port.
    pub fn primary(settings: &[&str]) -> Server {
        let dir = Self::new_dir("primary");
        let data = dir.join("data");
        run(
            "initdb",
            &[
                "-D",
                data.to_str().unwrap(),
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
                "--no-sync",
            ],
            false,
        );
        let mut all: Vec<String> = [
            "wal_level=logical",
            "max_wal_senders=20",
            "max_replication_slots=20",
            "wal_keep_size=256MB",
            "hot_standby=on",
            "fsync=off",
            "max_connections=200",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        all.extend(settings.iter().map(|s| s.to_string()));
        let s = Server {
            dir,
            port: free_port(),
            settings: all,
        };
        s.start();
        s
    }

    /// Another cluster with `self`'s settings (another system identifier):
    /// the green side of a blue/green cut-over.
    pub fn sibling(&self) -> Server {
        let extra: Vec<&str> = self.settings.iter().map(String::as_str).collect();
        Server::primary(&extra)
    }

    /// Database `db` of `self` copied into `to` as `pg_dump | psql` copies
    /// it (created there; no owners or grants).
    pub fn dump_into(&self, db: &str, to: &Server) {
        let bin = bindir();
        let script = format!(
            "set -o pipefail; '{psql}' -q -X -h 127.0.0.1 -p {to} -U postgres -d postgres -c 'CREATE DATABASE \"{db}\"' && \
             '{dump}' -h 127.0.0.1 -p {from} -U postgres --no-owner --no-privileges -d '{db}' | \
             '{psql}' -q -X -v ON_ERROR_STOP=1 -h 127.0.0.1 -p {to} -U postgres -d '{db}'",
            psql = bin.join("psql").display(),
            dump = bin.join("pg_dump").display(),
            from = self.port,
            to = to.port,
        );
        let out = Command::new("bash")
            .args(["-c", &script])
            .output()
            .expect("running pg_dump | psql");
        assert!(
            out.status.success(),
            "pg_dump | psql: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// A streaming standby of `self` (`pg_basebackup -R`: it follows
    /// whatever answers on `self`'s port), started on a free port.
    pub fn standby(&self) -> Server {
        self.standby_through(self.port)
    }

    /// A streaming standby of `self` made, and following, through `port`
    /// (a proxy in front of it: it follows whatever answers there).
    pub fn standby_through(&self, port: u16) -> Server {
        let dir = Self::new_dir("standby");
        let data = dir.join("data");
        run(
            "pg_basebackup",
            &[
                "-h",
                "127.0.0.1",
                "-p",
                &port.to_string(),
                "-U",
                "postgres",
                "-D",
                data.to_str().unwrap(),
                "-R",
                "-X",
                "stream",
                // No waiting for a spread checkpoint.
                "--checkpoint=fast",
                "--no-sync",
            ],
            false,
        );
        let s = Server {
            dir,
            port: free_port(),
            settings: self.settings.clone(),
        };
        s.start();
        s
    }

    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    fn options(&self) -> String {
        let mut o = format!(
            "-p {} -c listen_addresses=127.0.0.1 -k {}",
            self.port,
            self.dir.display()
        );
        for s in &self.settings {
            o.push_str(&format!(" -c {s}"));
        }
        o
    }

    /// `pg_ctl -D <data> -w -t 60 <args>`.
    fn pg_ctl(&self, args: &[&str], may_fail: bool) {
        let data = self.data();
        let mut all = vec!["-D", data.to_str().unwrap(), "-w", "-t", "60"];
        all.extend_from_slice(args);
        run("pg_ctl", &all, may_fail);
    }

    /// Starts it (waits until it accepts connections).
    pub fn start(&self) {
        let log = self.dir.join("server.log");
        let options = self.options();
        self.pg_ctl(
            &["-l", log.to_str().unwrap(), "-o", &options, "start"],
            false,
        );
    }

    /// Starts it listening on `port` from now on (another server's, once
    /// that one is stopped: the address moves, as a failover moves it).
    pub fn start_on(&mut self, port: u16) {
        self.port = port;
        self.start();
    }

    /// `pg_ctl stop -m mode`: `fast` (clean), `immediate` (a crash: no
    /// checkpoint, unflushed WAL lost).
    pub fn stop(&self, mode: &str) {
        self.pg_ctl(&["-m", mode, "stop"], true);
    }

    /// Copies the logical slot `name` from `primary` into this stopped
    /// standby, as Patroni's permanent slots and `pg_failover_slots` keep a
    /// slot on a replica (PostgreSQL 17's failover slots synchronise it):
    /// after a promotion the slot is there, at the position the copy had.
    /// The primary's slot state is written at its checkpoints: run one
    /// first.
    pub fn copy_slot_from(&self, primary: &Server, name: &str) {
        cp_a(
            &primary.data().join("pg_replslot").join(name),
            &self.data().join("pg_replslot"),
        );
    }

    /// `pg_ctl promote`: a standby becomes a primary on a new timeline.
    pub fn promote(&self) {
        self.pg_ctl(&["promote"], false);
    }

    /// `postgres://postgres@127.0.0.1:{port}/{db}`.
    pub fn url(&self, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{db}", self.port)
    }

    /// A pool on database `db` of this server as it answers on its port now.
    pub async fn pool(&self, db: &str) -> PgPool {
        PgPoolOptions::new()
            .max_connections(4)
            .acquire_timeout(Duration::from_secs(10))
            .connect(&self.url(db))
            .await
            .unwrap_or_else(|e| panic!("connecting to {}: {e}", self.url(db)))
    }

    /// Creates the empty database `db`; a pool on it.
    pub async fn create_empty_db(&self, db: &str) -> PgPool {
        let admin = self.pool("postgres").await;
        admin
            .execute(format!("CREATE DATABASE \"{db}\"").as_str())
            .await
            .unwrap();
        admin.close().await;
        self.pool(db).await
    }

    /// Creates database `db` with the gateway's migrations and users
    /// 1..=`users` (as `TestDb` does on the shared servers).
    pub async fn create_db(&self, db: &str, users: i64) -> PgPool {
        let pool = self.create_empty_db(db).await;
        bloomgate::db::MIGRATOR.run(&pool).await.unwrap();
        sqlx::query(
            "INSERT INTO users (id, email, name) SELECT g, 'u' || g || '@example.com', 'User ' || g
             FROM generate_series(1, $1::bigint) g",
        )
        .bind(users)
        .execute(&pool)
        .await
        .unwrap();
        pool
    }

    /// Its log so far (for failure messages).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default()
    }

    pub fn path(&self) -> &Path {
        &self.dir
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop("immediate");
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `cp -a from to`: a server's files, with their owner and modes.
pub fn cp_a(from: &Path, to: &Path) {
    let ok = Command::new("cp")
        .args(["-a", from.to_str().unwrap(), to.to_str().unwrap()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "cp -a {from:?} {to:?}");
}

/// Waits until `standby` has replayed everything `primary` has written (its
/// replay position at or past the primary's current one).
pub async fn caught_up(primary: &PgPool, standby: &PgPool) {
    let target: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
        .fetch_one(primary)
        .await
        .unwrap();
    super::eventually("the standby replayed what the primary wrote", || async {
        sqlx::query_scalar::<_, bool>("SELECT pg_last_wal_replay_lsn() >= $1::pg_lsn")
            .bind(&target)
            .fetch_one(standby)
            .await
            .unwrap_or(false)
    })
    .await;
}

/// Runs `sql` (several statements allowed) on `pool`; panics naming it.
pub async fn exec(pool: &PgPool, sql: &str) {
    sqlx::raw_sql(sql)
        .execute(pool)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

/// The first half of a failover to a standby that was behind: stops
/// `standby`, then writes users 2000..=2100 on the primary only (with a WAL
/// switch in between, as the audit did). [`promote_onto_the_primary_address`]
/// does the rest: afterwards the primary's address answers with a server
/// on a new timeline that never had those rows.
pub async fn fail_over_to_a_standby_that_was_behind(primary_pool: &sqlx::PgPool, standby: &Server) {
    standby.stop("fast");
    exec(
        primary_pool,
        "INSERT INTO users (id, email, name) SELECT g, 'lost' || g, 'Lost ' || g \
         FROM generate_series(2000, 2099) g",
    )
    .await;
    exec(primary_pool, "SELECT pg_switch_wal()").await;
    exec(
        primary_pool,
        "INSERT INTO users (id, email, name) VALUES (2100, 'lost2100', 'Lost 2100')",
    )
    .await;
}

/// The second half: the primary crashed, the standby promoted on its own
/// port, then moved onto the primary's.
pub fn promote_onto_the_primary_address(primary: &Server, standby: &mut Server) {
    let port = primary.port;
    primary.stop("immediate");
    standby.start();
    standby.promote();
    standby.stop("fast");
    standby.start_on(port);
}

/// The permanent slot `slot`, copied to `standby` as Patroni's permanent
/// slots keep it on a replica: the gateway on `primary` (database `db`) has
/// applied and confirmed past the standby's base backup (so the WAL the
/// copy needs is on the standby), the primary's checkpoint wrote the
/// slot's state, and the standby, restarted with the copy, caught up.
pub async fn keep_the_slot_on(
    primary: &Server,
    primary_pool: &PgPool,
    standby: &Server,
    slot: &str,
    db: &str,
) {
    let backup_end: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
        .fetch_one(primary_pool)
        .await
        .unwrap();
    let mut id = 900;
    super::eventually_within(
        "the slot's restart position past the standby's base backup",
        Duration::from_secs(60),
        || {
            id += 1;
            let id = id;
            let backup_end = backup_end.clone();
            async move {
                exec(primary_pool, &format!("INSERT INTO users (id, email, name) VALUES ({id}, 'k{id}', 'Kept {id}') ON CONFLICT (id) DO UPDATE SET name = excluded.name; CHECKPOINT")).await;
                tokio::time::sleep(Duration::from_millis(200)).await;
                sqlx::query_scalar::<_, bool>(
                    "SELECT restart_lsn >= $1::pg_lsn FROM pg_replication_slots WHERE slot_name = $2",
                )
                .bind(&backup_end)
                .bind(slot)
                .fetch_one(primary_pool)
                .await
                .unwrap_or(false)
            }
        },
    )
    .await;
    exec(primary_pool, "CHECKPOINT").await;
    standby.stop("fast");
    standby.copy_slot_from(primary, slot);
    standby.start();
    let standby_pool = standby.pool(db).await;
    caught_up(primary_pool, &standby_pool).await;
    let slots: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1")
            .bind(slot)
            .fetch_one(&standby_pool)
            .await
            .unwrap();
    assert_eq!(slots, 1, "the standby holds the copied slot");
    standby_pool.close().await;
}
