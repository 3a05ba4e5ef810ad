//! Redis for the bus's tests: a `redis-server` of the test's own on a free
//! port (plaintext or TLS, with certificates made by `openssl`), a fleet's
//! slot and key prefix, and what the tests ask of a fleet.

use std::net::TcpListener as StdListener;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bloomgate::config::Config;
use bloomgate::feed::bus::Follows;
use bloomgate::gateway::Gateway;

use super::*;

/// Ten users; the by-email route needs the old email on UPDATE and DELETE.
pub async fn bus_db() -> TestDb {
    let db = logical_db(10).await;
    db.exec("ALTER TABLE users REPLICA IDENTITY FULL").await;
    db
}

pub fn free_port() -> u16 {
    StdListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A `redis-server` of this test's own, without persistence; with `tls`,
/// TLS only (no plaintext port).
pub struct Redis {
    child: Option<Child>,
    pub port: u16,
    pub tls: Option<Arc<Certs>>,
    /// `user:password` for the test's own connections (an ACL user).
    pub login: Option<String>,
}

impl Redis {
    pub async fn start() -> Self {
        Self::start_on(free_port()).await
    }

    pub async fn start_on(port: u16) -> Self {
        Self::spawn(port, None, &[]).await
    }

    /// TLS only, the server's certificate signed by `certs.ca`; `auth`
    /// the `--tls-auth-clients` setting (`no`: no client certificate).
    pub async fn start_tls(certs: &Arc<Certs>, auth: &str) -> Self {
        let p = |f: &str| certs.dir.join(f).to_str().unwrap().to_string();
        let args = [
            "--tls-port".to_string(),
            "PORT".into(),
            "--port".into(),
            "0".into(),
            "--tls-cert-file".into(),
            p("server.crt"),
            "--tls-key-file".into(),
            p("server.key"),
            "--tls-ca-cert-file".into(),
            p("ca.crt"),
            "--tls-auth-clients".into(),
            auth.into(),
            // 127.0.0.2 too, an address the certificate does not name.
            "--bind".into(),
            "127.0.0.1".into(),
            "127.0.0.2".into(),
        ];
        Self::spawn(free_port(), Some(certs.clone()), &args).await
    }

    pub async fn spawn(port: u16, tls: Option<Arc<Certs>>, tls_args: &[String]) -> Self {
        let bin = std::env::var("BLOOMGATE_REDIS_SERVER").unwrap_or_else(|_| "redis-server".into());
        let mut cmd = Command::new(bin);
        if tls_args.is_empty() {
            cmd.args(["--port", &port.to_string(), "--bind", "127.0.0.1"]);
        } else {
            cmd.args(tls_args.iter().map(|a| match a.as_str() {
                "PORT" => port.to_string(),
                _ => a.clone(),
            }));
        }
        Self::launched(cmd, port, tls, None).await
    }

    /// `cmd` (a `redis-server` with its port and options) started without
    /// persistence, once it answers.
    async fn launched(
        mut cmd: Command,
        port: u16,
        tls: Option<Arc<Certs>>,
        login: Option<String>,
    ) -> Self {
        let child = cmd
            .args(["--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server: run with scripts/test.sh, which installs it");
        let r = Redis {
            child: Some(child),
            port,
            tls,
            login,
        };
        eventually("redis-server answers", || async {
            r.conn().await.is_some()
        })
        .await;
        r
    }

    pub fn url(&self) -> String {
        let scheme = if self.tls.is_some() {
            "rediss"
        } else {
            "redis"
        };
        let login = self
            .login
            .as_ref()
            .map_or(String::new(), |l| format!("{l}@"));
        format!("{scheme}://{login}127.0.0.1:{}/0", self.port)
    }

    /// Plaintext, with `args` added, its own connections as `login`
    /// (`user:password`).
    pub async fn start_with(port: u16, args: &[String], login: Option<&str>) -> Self {
        let bin = std::env::var("BLOOMGATE_REDIS_SERVER").unwrap_or_else(|_| "redis-server".into());
        let mut cmd = Command::new(bin);
        cmd.args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(args);
        Self::launched(cmd, port, None, login.map(String::from)).await
    }

    /// The server's process id (for `SIGSTOP`).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The stream's length now.
    pub async fn xlen(&self, stream: &str) -> u64 {
        let mut c = self.conn().await.unwrap();
        redis::cmd("XLEN")
            .arg(stream)
            .query_async(&mut c)
            .await
            .unwrap()
    }

    /// A connection of the test's own (TLS with the right CA, and the
    /// client certificate, for a TLS server).
    pub async fn conn(&self) -> Option<redis::aio::MultiplexedConnection> {
        let client = match &self.tls {
            None => redis::Client::open(self.url()).ok()?,
            Some(certs) => redis::Client::build_with_tls(
                self.url(),
                redis::TlsCertificates {
                    client_tls: Some(redis::ClientTlsConfig {
                        client_cert: std::fs::read(certs.dir.join("client.crt")).ok()?,
                        client_key: std::fs::read(certs.dir.join("client.key")).ok()?,
                    }),
                    root_cert: Some(std::fs::read(certs.dir.join("ca.crt")).ok()?),
                },
            )
            .ok()?,
        };
        let mut c = client.get_multiplexed_async_connection().await.ok()?;
        let pong: String = redis::cmd("PING").query_async(&mut c).await.ok()?;
        (pong == "PONG").then_some(c)
    }

    /// `SIGKILL`: everything it held is gone.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Replication as `user` is refused from now on, and its connections
    /// are cut: a replica logging in as it loses its link and keeps what it
    /// had.
    pub async fn turn_away(&self, user: &str) {
        let mut c = self.conn().await.unwrap();
        let _: () = redis::cmd("ACL")
            .arg("SETUSER")
            .arg(user)
            .arg("off")
            .query_async(&mut c)
            .await
            .unwrap();
        let _: i64 = redis::cmd("CLIENT")
            .arg("KILL")
            .arg("USER")
            .arg(user)
            .query_async(&mut c)
            .await
            .unwrap();
    }

    /// `INFO section`; empty if the server does not answer.
    pub async fn info(&self, section: &str) -> String {
        let Some(mut c) = self.conn().await else {
            return String::new();
        };
        redis::cmd("INFO")
            .arg(section)
            .query_async(&mut c)
            .await
            .unwrap_or_default()
    }

    /// `XREAD`s the server has served (its `INFO commandstats`).
    pub async fn xreads(&self) -> u64 {
        self.info("commandstats")
            .await
            .lines()
            .find_map(|l| l.strip_prefix("cmdstat_xread:calls="))
            .and_then(|rest| rest.split(',').next()?.parse().ok())
            .unwrap_or(0)
    }

    /// Connections whose last command was a (blocking) `XREAD`: the
    /// consumers reading this server now.
    pub async fn clients_reading(&self) -> usize {
        let Some(mut c) = self.conn().await else {
            return 0;
        };
        let list: String = redis::cmd("CLIENT")
            .arg("LIST")
            .query_async(&mut c)
            .await
            .unwrap_or_default();
        list.lines().filter(|l| l.contains(" cmd=xread ")).count()
    }

    /// The keys matching `pattern`.
    pub async fn keys(&self, pattern: &str) -> Vec<String> {
        let mut c = self.conn().await.unwrap();
        redis::cmd("KEYS")
            .arg(pattern)
            .query_async(&mut c)
            .await
            .unwrap()
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Throwaway certificates made with `openssl`, as `ensure_tls_server` in
/// `scripts/pg.sh` makes the Postgres TLS test's: a CA (`ca.crt`), another
/// CA that signed nothing here (`other-ca.crt`), the server's certificate
/// (`CA:FALSE`, for 127.0.0.1 and localhost: rustls checks the URL's host
/// against it, and refuses a CA certificate as a server's) and a client
/// certificate (for `--tls-auth-clients yes`), both signed by `ca.crt`.
pub struct Certs {
    pub dir: std::path::PathBuf,
}

impl Certs {
    pub fn make() -> Arc<Self> {
        let dir = std::env::temp_dir().join(unique("bloomgate-redis-tls"));
        std::fs::create_dir_all(&dir).unwrap();
        let openssl = |args: &[&str]| {
            let out = Command::new("openssl")
                .args(args)
                .current_dir(&dir)
                .output()
                .expect("openssl: the TLS tests make their certificates with it");
            assert!(
                out.status.success(),
                "openssl {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        for ca in ["ca", "other-ca"] {
            openssl(&[
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:P-256",
                "-nodes",
                "-days",
                "2",
                "-subj",
                &format!("/CN=bloomgate bus test {ca}"),
                "-addext",
                "basicConstraints=critical,CA:TRUE",
                "-addext",
                "keyUsage=critical,keyCertSign,cRLSign",
                "-keyout",
                &format!("{ca}.key"),
                "-out",
                &format!("{ca}.crt"),
            ]);
        }
        for (who, cn, usage, san) in [
            (
                "server",
                "localhost",
                "serverAuth",
                "subjectAltName=DNS:localhost,IP:127.0.0.1\n",
            ),
            ("client", "bloomgate", "clientAuth", ""),
        ] {
            std::fs::write(
                dir.join(format!("{who}.ext")),
                format!(
                    "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage={usage}\n{san}"
                ),
            )
            .unwrap();
            openssl(&[
                "req",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:P-256",
                "-nodes",
                "-subj",
                &format!("/CN={cn}"),
                "-keyout",
                &format!("{who}.key"),
                "-out",
                &format!("{who}.csr"),
            ]);
            openssl(&[
                "x509",
                "-req",
                "-in",
                &format!("{who}.csr"),
                "-CA",
                "ca.crt",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-days",
                "2",
                "-extfile",
                &format!("{who}.ext"),
                "-out",
                &format!("{who}.crt"),
            ]);
        }
        Arc::new(Certs { dir })
    }

    pub fn path(&self, file: &str) -> String {
        self.dir.join(file).to_str().unwrap().to_string()
    }
}

impl Drop for Certs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A fresh name for this test's slot and key prefix.
pub fn unique(what: &str) -> String {
    format!("{what}_{:x}", rand::random::<u32>())
}

pub struct Fleet {
    pub slot: String,
    pub prefix: String,
}

impl Fleet {
    pub fn new() -> Self {
        Fleet {
            slot: unique("bg_bus"),
            prefix: unique("bgtest"),
        }
    }

    /// The `[bus]` section for `redis`: its URL, and for a TLS server the
    /// CA that signed its certificate as `bus.ca_file`.
    pub fn bus_toml(&self, redis: &Redis) -> String {
        let ca = redis.tls.as_ref().map(|c| c.path("ca.crt"));
        self.bus_toml_with(&redis.url(), ca.as_deref())
    }

    pub fn bus_toml_with(&self, url: &str, ca_file: Option<&str>) -> String {
        let ca = ca_file.map_or(String::new(), |f| format!("ca_file = \"{f}\"\n"));
        format!(
            "[bus]\nurl = \"{url}\"\n{ca}slot = \"{}\"\nprefix = \"{}\"\nmax_lag = \"1s\"\n",
            self.slot, self.prefix
        )
    }

    pub fn config(&self, db: &TestDb, redis: &Redis) -> Config {
        self.config_url(&db.url, redis)
    }

    /// As [`Fleet::config`], with `bus.max_lag` at 60 s: for a test whose
    /// premise is that no gateway falls back to a direct feed (a resync),
    /// which a loaded machine can otherwise make happen after 1 s.
    pub fn patient_config(&self, db: &TestDb, redis: &Redis) -> Config {
        wal_config(
            db,
            &format!(
                "{BY_EMAIL}\n{}",
                self.bus_toml(redis)
                    .replace("max_lag = \"1s\"", "max_lag = \"60s\"")
            ),
        )
    }

    pub fn config_url(&self, url: &str, redis: &Redis) -> Config {
        wal_config_url(url, &format!("{BY_EMAIL}\n{}", self.bus_toml(redis)))
    }

    pub fn config_with(&self, db: &TestDb, url: &str, ca_file: Option<&str>) -> Config {
        wal_config(
            db,
            &format!("{BY_EMAIL}\n{}", self.bus_toml_with(url, ca_file)),
        )
    }

    pub async fn stream(&self, redis: &Redis) -> String {
        let began = Instant::now();
        loop {
            let keys: Vec<String> = redis
                .keys(&format!("{}:*", self.prefix))
                .await
                .into_iter()
                .filter(|k| {
                    !k.ends_with(":relay")
                        && !k.ends_with(":epochs")
                        && !k.contains(":snap:")
                        && !k.contains(":scan:")
                })
                .collect();
            if let Some(k) = keys.into_iter().next() {
                return k;
            }
            assert!(
                began.elapsed() < Duration::from_secs(15),
                "never: the stream"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Stops the fleet's gateways and drops its slot once it is free.
    pub async fn stop(&self, gws: &[Arc<Gateway>], db: &TestDb) {
        for g in gws {
            g.stop();
        }
        self.drop_slot(db).await;
    }

    /// Waits until the slot is free (its holder gone), then drops it.
    pub async fn drop_slot(&self, db: &TestDb) {
        eventually("the bus slot released", || async {
            let active: Option<bool> =
                sqlx::query_scalar("SELECT active FROM pg_replication_slots WHERE slot_name = $1")
                    .bind(&self.slot)
                    .fetch_optional(&db.pool)
                    .await
                    .unwrap();
            active != Some(true)
        })
        .await;
        let _ = sqlx::query("SELECT pg_drop_replication_slot($1)")
            .bind(&self.slot)
            .execute(&db.pool)
            .await;
    }
}

/// Walsenders serving this database (the bus's and any direct feed's).
pub async fn walsenders(db: &TestDb) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_replication r JOIN pg_stat_activity a USING (pid)
         WHERE a.datname = $1",
    )
    .bind(&db.name)
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

pub fn mode(gw: &Gateway) -> Follows {
    gw.bus_status().unwrap().get().mode
}

pub fn relaying(gw: &Gateway) -> bool {
    gw.bus_status().unwrap().get().relaying
}

pub async fn wait_all_on_bus(gws: &[Arc<Gateway>]) {
    eventually("every gateway on the bus, one of them relaying", || async {
        gws.iter().all(|g| mode(g) == Follows::Bus)
            && gws.iter().filter(|g| relaying(g)).count() == 1
    })
    .await;
}

/// The release (or debug) binary, serving on a port of its own, with an
/// admin listener.
pub struct Binary {
    child: Child,
    pub public: u16,
    pub admin: u16,
    _dir: std::path::PathBuf,
}

pub const TOKEN: &str = "bus-test-admin-token-0123456789";

impl Binary {
    pub fn spawn(db: &TestDb, fleet: &Fleet, redis: &Redis) -> Self {
        Self::spawn_with(db, &fleet.bus_toml(redis), None)
    }

    /// With `bus` as its `[bus]` section, its output (the log) into `log`.
    pub fn spawn_with(db: &TestDb, bus: &str, log: Option<&std::path::Path>) -> Self {
        let (public, admin) = (free_port(), free_port());
        let dir = std::env::temp_dir().join(unique("bloomgate-bus"));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("bloomgate.toml");
        let text = format!(
            r#"
            [server]
            listen = "127.0.0.1:{public}"
            [admin]
            listen = "127.0.0.1:{admin}"
            [database]
            url = "{url}"
            pool_size = 4
            freshness = "wal"
            install_feed = true
            {BY_EMAIL}
            {bus}
            {RESOURCES}
            "#,
            url = db.url,
        );
        std::fs::write(&path, text).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_bloomgate"))
            .args(["serve", "--config", path.to_str().unwrap()])
            .env_remove("DATABASE_URL")
            .env("BLOOMGATE_ADMIN_TOKEN", TOKEN)
            // Every line a log would have, where it is read.
            .env("RUST_LOG", if log.is_some() { "info" } else { "warn" })
            .stdout(log.map_or(Stdio::null(), |p| std::fs::File::create(p).unwrap().into()))
            .stderr(log.map_or(Stdio::null(), |p| {
                std::fs::OpenOptions::new()
                    .append(true)
                    .open(p)
                    .unwrap()
                    .into()
            }))
            .spawn()
            .unwrap();
        Binary {
            child,
            public,
            admin,
            _dir: dir,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub async fn get(&self, path: &str) -> Option<(u16, String)> {
        let r = reqwest::get(format!("http://127.0.0.1:{}{path}", self.public))
            .await
            .ok()?;
        let code = r.status().as_u16();
        Some((code, r.text().await.ok()?))
    }

    pub async fn stats(&self) -> Option<serde_json::Value> {
        let r = reqwest::Client::new()
            .get(format!("http://127.0.0.1:{}/admin/stats", self.admin))
            .bearer_auth(TOKEN)
            .send()
            .await
            .ok()?;
        r.json().await.ok()
    }

    pub fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([sig, &self.pid().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill {sig}");
    }
}

impl Drop for Binary {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub async fn ready(b: &Binary) {
    eventually("the binary is ready", || async {
        matches!(b.get("/readyz").await, Some((200, _)))
    })
    .await;
}
