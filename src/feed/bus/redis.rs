//! The [`Bus`] on Redis Streams (redis-rs): one stream, appended to by a
//! Lua script that applies the position rules of "The stream" (in
//! [`super`]) atomically, read with `XREAD BLOCK`.
//!
//! The stream's newest position is Redis' `last-generated-id`, not the
//! newest entry still present: an entry trimmed away (or deleted by hand)
//! still counts as the one before the next, and Redis refuses any ID at or
//! below it anyway.
//!
//! # A stream that went back
//! A Redis that restarted from an older snapshot, or a replica promoted by
//! Sentinel before it had every entry (replication is asynchronous), holds
//! the stream without its newest entries. A consumer that read them sees
//! the next entry's `p` miss its position: a continuity break, a resync. A
//! consumer that had not read them yet would not: the next entry continues
//! from the position it holds, and the commits of the lost entries would
//! be skipped without a word. So the relay must never append to such a
//! stream as if nothing happened: each handle remembers the newest
//! position it has seen on its stream (its `head`, every append's answer),
//! and the append script refuses, atomically, to append below it
//! ([`BusError`]). The relay's term ends there; the next one starts at the
//! stream's head, which its slot has been confirmed past, and that gap is
//! a resync appended before anything else ("Nothing lost at a failover"
//! in [`super`]).
//!
//! # Lineage
//! A commit's ID is its LSN and a heartbeat's the primary's flush
//! position: whoever appends them, the same ID says the same thing on one
//! timeline. A resync, a coverage change or an interruption has no LSN of
//! its own and is placed after the newest entry, at the same LSN with a
//! greater sequence. Were that sequence the next one, two relays placing
//! such an entry after the same entry would give both one ID: the old
//! relay's on a Redis that then lost it (with commits after it), the new
//! relay's gap resync on the node promoted in its place. A consumer that
//! read the lost one reads on *after* that ID, skips the resync, and finds
//! the next entry's `p` equal to its position: the lost commits gone
//! without a break. So the sequence steps by a number drawn at random per
//! append (1 to 2^32): a later such entry on the same LSN lands on the
//! lost one's ID with odds of about 2^-32, and otherwise the consumer sees
//! a break whichever comes first (tested in `tests/bus.rs`). IDs still
//! increase and consumers need nothing new; relays do: an older relay
//! steps by one, so during a rolling upgrade the guarantee holds where
//! the relay after the failover runs this code.
//!
//! # Sentinel
//! With `bus.sentinels`, every new connection asks the sentinels for the
//! primary named `bus.sentinel_master` (redis-rs checks that the server
//! says it is a master), so after a failover the next connection reaches
//! the new primary. A demoted primary refuses writes (`READONLY`), which
//! drops the connection like any error. The sentinels are asked in a
//! handle of their own, built for each connection (so a rotated TLS file
//! is read again), bounded by the connection timeout.
//!
//! # A read tier (`bus.read_from = "replicas"`)
//! Redis pays for every entry once per reader: each blocked `XREAD` it
//! wakes and each reply it writes (BENCHMARKS.md, "The fleet simulator").
//! A consumer's handle ([`RedisBus::reader`]) may read an online replica
//! of the primary instead, so that cost is spread over the replicas and
//! the primary carries the appends and one replication stream per replica.
//! Nothing of the consumer's reasoning changes: a replica applies the
//! primary's stream in order with the same entry IDs (the append script
//! is replicated by its effects), so what a replica holds is a prefix of
//! the primary's stream, every entry with the same `p`; a replica behind
//! only delays the entries and heartbeats a consumer reads, and a replica
//! that lost entries (a full resync from a new primary) shows as a
//! continuity break. The consumer vouches only with readings of the
//! Postgres primary's position that the stream has reached, whichever
//! node served it.
//!
//! Which replica: at each new connection, one chosen at random among those
//! the primary's `INFO replication` lists as `online` and acknowledging
//! (`lag` ≤ 2 s), at its announced address (`replica-announce-ip`
//! behind NAT; with TLS its certificate must name that address), with
//! `bus.url`'s scheme, credentials, database and files; accepted only if
//! it says it is a replica whose link is up and that follows this
//! primary's replication ID (`master_replid`: not another deployment's
//! Redis answering at a reused address). No such
//! replica (or none found within 3 s, every one tried included): the
//! primary is read. A replica that stops following its
//! primary while in use (its link broken: it keeps serving what it had,
//! without an error) leaves the consumer unproven; halfway to
//! `bus.max_lag` the consumer drops the connection ([`Bus::reconnect`]),
//! and the next one chooses again, among the replicas the primary still
//! lists online other than the one it left (that one alone: the primary);
//! the consumer reads on after its last entry there. A reader on the
//! primary for want of a replica chooses again every 10 s, so replicas
//! that come back take the reads again.
//!
//! Trust: the gateway sends `bus.url`'s credentials to the addresses the
//! primary lists, which whoever may `CONFIG SET replica-announce-ip` on a
//! replica chooses; with TLS, give `bus.ca_file` (a private CA) rather
//! than the host's store, so only your replicas' certificates pass.
//!
//! # TLS (`rediss://`)
//! redis-rs's rustls (`tokio-rustls-comp`), on the gateway's one TLS stack
//! (rustls, `ring`; see `Cargo.toml`). The server's certificate is checked
//! as the web does it: the chain against the roots, the URL's host (or IP
//! address) against its subject alternative names. The roots are
//! `bus.ca_file`'s certificates alone when it is set (libpq's rule for
//! `sslrootcert`), else the host's store. redis-rs reads the host's store on
//! every TLS connection even when `bus.ca_file` replaces it, and fails the
//! connection if that read reports an error (an `SSL_CERT_FILE` that does
//! not exist): such a failure is reported as one of the store. Nothing
//! turns the check off: `#insecure` is refused by the config, and redis-rs
//! is built without `tls-rustls-insecure`, so it could not honour it
//! anyway. The files are read again for every new connection, so a rotated
//! CA or client certificate is picked up without a restart; a file gone
//! bad makes the bus unreachable (the gateway follows the WAL itself), not
//! the gateway wrong.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Once};
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::sentinel::{SentinelClientBuilder, SentinelServerType};
use redis::{
    AsyncConnectionConfig, Client, ClientTlsConfig, ConnectionAddr, IntoConnectionInfo, Script,
    TlsCertificates, TlsMode, Value,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use super::{Appended, Bus, BusError, Entry, EntryId, Read, epoch_key};
use crate::feed::Timeline;

/// Applies the position rules and appends; returns `{1, id}`, `{0, prev}`
/// (already there), or `{2, prev}` when the stream's newest position is
/// below `ARGV[5]`, the newest this handle saw (see "A stream that went
/// back"). LSNs travel as decimal strings (Lua's numbers are doubles) and
/// are compared as such. An entry without an LSN of its own is placed
/// `ARGV[6]` (drawn at random, see "Lineage") after the newest entry's
/// sequence; sequences stay below 2^53, where doubles are exact: past it
/// the step is 1 (after 2^21 such entries on one LSN, which no stream
/// reaches: every commit and heartbeat moves the LSN on). Printed with
/// `%.0f`, exact below 2^53 on any build: `%d` goes through a C `long`,
/// 32 bits on a 32-bit Redis.
const APPEND: &str = r#"
local function after(a, b)
  if #a ~= #b then return #a > #b end
  return a > b
end
local prev = '0-0'
if redis.call('EXISTS', KEYS[1]) == 1 then
  local info = redis.call('XINFO', 'STREAM', KEYS[1])
  for i = 1, #info, 2 do
    if info[i] == 'last-generated-id' then prev = info[i + 1] end
  end
end
local d = string.find(prev, '-', 1, true)
local tl = string.sub(prev, 1, d - 1)
local ts = tonumber(string.sub(prev, d + 1))
local kind, lsn = ARGV[1], ARGV[2]
local f = ARGV[5]
local fd = string.find(f, '-', 1, true)
local ftl = string.sub(f, 1, fd - 1)
if after(ftl, tl) or (ftl == tl and tonumber(string.sub(f, fd + 1)) > ts) then
  return {2, prev}
end
local id
if kind == 'c' or kind == 'b' or kind == 'h' then
  if not after(lsn, tl) then return {0, prev} end
  if kind == 'h' then id = lsn .. '-1' else id = lsn .. '-0' end
else
  local step = tonumber(ARGV[6])
  if ts + step >= 9007199254740992 then step = 1 end
  id = tl .. '-' .. string.format('%.0f', ts + step)
end
redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[4], id, 'k', kind, 'p', prev, 'd', ARGV[3])
return {1, id}
"#;

/// The newest position, `0-0` for no stream.
const HEAD: &str = r#"
if redis.call('EXISTS', KEYS[1]) == 0 then return '0-0' end
local info = redis.call('XINFO', 'STREAM', KEYS[1])
for i = 1, #info, 2 do
  if info[i] == 'last-generated-id' then return info[i + 1] end
end
return '0-0'
"#;

/// How long a command may take before the connection is given up (a
/// blocking read adds its own wait).
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(2);

/// How long opening a connection may take; with Sentinel, asking the
/// sentinels too.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// How long choosing a replica to read may take, every one tried
/// included (see "A read tier"); then the primary is read.
const REPLICA_CHOICE_TIMEOUT: Duration = Duration::from_secs(3);

/// How long a reader meant for the replicas reads the primary before it
/// looks for a replica again.
const CHOOSE_AGAIN_EVERY: Duration = Duration::from_secs(10);

/// `bus.sentinels` and `bus.sentinel_master`, as [`RedisBus::new`] takes them.
#[derive(Clone, Debug, Default)]
pub struct Sentinels {
    pub urls: Vec<String>,
    pub master: String,
}

/// Where connections go.
#[derive(Clone)]
enum Target {
    /// `bus.url`'s server.
    Server(Box<Client>),
    /// The primary the sentinels name, asked at every connection.
    Sentinel(Arc<SentinelTarget>),
}

struct SentinelTarget {
    sentinels: Vec<ConnectionAddr>,
    /// The sentinels' own user and password (the same for all).
    user: Option<String>,
    password: Option<String>,
    master: String,
    /// `bus.url`'s user, password and database: the data nodes'.
    node: redis::RedisConnectionInfo,
}

impl SentinelTarget {
    fn new(url: &str, sentinels: &Sentinels) -> Result<Self, BusError> {
        let node = url
            .into_connection_info()
            .map_err(|e| BusError(format!("bus.url: not a Redis URL ({})", e.category())))?
            .redis_settings()
            .clone();
        let mut addrs = Vec::new();
        let (mut user, mut password) = (None, None);
        for (i, s) in sentinels.urls.iter().enumerate() {
            let info = s.as_str().into_connection_info().map_err(|e| {
                BusError(format!(
                    "bus.sentinels: entry {} is not a Redis URL ({})",
                    i + 1,
                    e.category()
                ))
            })?;
            user = info.redis_settings().username().map(String::from);
            password = info.redis_settings().password().map(String::from);
            addrs.push(info.addr().clone());
        }
        Ok(Self {
            sentinels: addrs,
            user,
            password,
            master: sentinels.master.clone(),
            node,
        })
    }

    /// A client for the primary the sentinels name now, with `tls`'s
    /// certificates for both the sentinels and the primary.
    async fn primary(&self, tls: Option<&TlsFiles>) -> Result<Client, BusError> {
        let mut b = SentinelClientBuilder::new(
            self.sentinels.clone(),
            &self.master,
            SentinelServerType::Master,
        )
        .map_err(failed)?
        .set_client_to_redis_db(self.node.db());
        if let Some(u) = self.node.username() {
            b = b.set_client_to_redis_username(u);
        }
        if let Some(p) = self.node.password() {
            b = b.set_client_to_redis_password(p);
        }
        if let Some(u) = &self.user {
            b = b.set_client_to_sentinel_username(u);
        }
        if let Some(p) = &self.password {
            b = b.set_client_to_sentinel_password(p);
        }
        if let Some(files) = tls {
            b = b
                .set_client_to_redis_tls_mode(TlsMode::Secure)
                .set_client_to_redis_certificates(files.certificates()?)
                .set_client_to_sentinel_certificates(files.certificates()?);
        }
        let mut sentinel = b.build().map_err(failed)?;
        let asked = tokio::time::timeout(CONNECT_TIMEOUT, sentinel.async_get_client()).await;
        let e = match asked {
            Ok(Ok(client)) => return Ok(client),
            Ok(Err(e)) => failed(e),
            Err(_) => BusError("Redis: timed out".into()),
        };
        // redis-rs asks the sentinels, then the primary they name (its
        // ROLE): an error of either reads alike. Asking a sentinel alone
        // tells which.
        let sentinels_answer = matches!(
            tokio::time::timeout(CONNECT_TIMEOUT, sentinel.async_get_sentinel_client()).await,
            Ok(Ok(_))
        );
        Err(BusError(if sentinels_answer {
            format!("the primary `{}` the sentinels name: {}", self.master, e.0)
        } else {
            format!(
                "the sentinels (asked for the primary `{}`): {}",
                self.master, e.0
            )
        }))
    }
}

/// `bus.ca_file`, `bus.cert_file`, `bus.key_file`: the files of a
/// `rediss://` bus (see "TLS" above).
#[derive(Clone, Debug, Default)]
pub struct TlsFiles {
    pub ca_file: Option<PathBuf>,
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
}

impl TlsFiles {
    fn is_empty(&self) -> bool {
        self.ca_file.is_none() && self.cert_file.is_none() && self.key_file.is_none()
    }

    /// The files read and checked, as redis-rs takes them. Errors name the
    /// key and the path, never what the files hold.
    fn certificates(&self) -> Result<TlsCertificates, BusError> {
        let root_cert = match &self.ca_file {
            None => None,
            Some(path) => {
                let pem = read("bus.ca_file", path)?;
                certificates("bus.ca_file", path, &pem)?;
                Some(pem)
            }
        };
        let client_tls = match (&self.cert_file, &self.key_file) {
            (Some(cert), Some(key)) => {
                let client_cert = read("bus.cert_file", cert)?;
                certificates("bus.cert_file", cert, &client_cert)?;
                let client_key = read("bus.key_file", key)?;
                PrivateKeyDer::from_pem_slice(&client_key).map_err(|_| {
                    BusError(format!(
                        "bus.key_file {}: holds no PEM private key (PKCS#8, PKCS#1 or SEC1)",
                        key.display()
                    ))
                })?;
                Some(ClientTlsConfig {
                    client_cert,
                    client_key,
                })
            }
            (None, None) => None,
            _ => {
                return Err(BusError(
                    "bus.cert_file and bus.key_file go together".into(),
                ));
            }
        };
        Ok(TlsCertificates {
            client_tls,
            root_cert,
        })
    }
}

fn read(key: &str, path: &Path) -> Result<Vec<u8>, BusError> {
    std::fs::read(path).map_err(|e| BusError(format!("{key} {}: {e}", path.display())))
}

/// Checks that `pem` holds certificates and nothing else unreadable
/// (redis-rs would say only "Unable to parse", without the file).
fn certificates(key: &str, path: &Path, pem: &[u8]) -> Result<(), BusError> {
    let bad = |m: String| BusError(format!("{key} {}: {m}", path.display()));
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(format!("not PEM certificates: {e}")))?;
    if certs.is_empty() {
        return Err(bad("holds no certificate".into()));
    }
    Ok(())
}

/// redis-rs builds its rustls configuration on the process-default
/// provider (`ClientConfig::builder()`) and takes none of ours. Left to
/// itself, rustls installs the one its crate features name, and panics if
/// they name two (a dependency enabling aws-lc-rs one day). Installing
/// `ring`, the provider of every other TLS connection of the gateway,
/// makes that choice explicit and the same as theirs. A provider some
/// other code installed first would stay (none does in this gateway).
fn install_ring_provider() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

pub struct RedisBus {
    target: Target,
    /// `Some` for `rediss://`: the files, read for every connection.
    tls: Option<TlsFiles>,
    /// The key without the timeline (see "The stream" in [`super`]).
    base: String,
    epoch: Timeline,
    /// `base` with `epoch`'s suffix: the stream in use.
    stream: String,
    relay_key: String,
    retention: u64,
    /// Read an online replica of the primary (see "A read tier").
    replicas: bool,
    /// With `replicas`: the replica `conn` reads (`None`: the primary, and
    /// since when), and the one a [`Bus::reconnect`] left, not chosen
    /// again at once.
    reading: Option<(String, u16)>,
    /// The node the last connection reached, for the status page:
    /// `primary HOST:PORT` or `replica HOST:PORT`.
    node: String,
    on_primary_since: Option<std::time::Instant>,
    left: Option<(String, u16)>,
    conn: Option<MultiplexedConnection>,
    /// The newest position this handle has seen on `stream` (see "A
    /// stream that went back"): the append script refuses to append
    /// below it.
    seen: EntryId,
    append: Script,
    head: Script,
}

impl RedisBus {
    /// A bus on the streams `base` of the server at `url` (not connected
    /// yet), on `epoch`'s, with `tls`'s files for a `rediss://` URL, read
    /// and checked now: a file that cannot work is a start-up error naming
    /// its key. The error never repeats the URL (it may hold a password).
    pub fn new(
        url: &str,
        tls: &TlsFiles,
        base: String,
        epoch: Timeline,
        retention: u64,
    ) -> Result<Self, BusError> {
        Self::with_sentinels(url, None, tls, base, epoch, retention)
    }

    /// [`Self::new`], and with `sentinels`, the primary they name (see
    /// "Sentinel"): `url` then gives its scheme, credentials and database.
    pub fn with_sentinels(
        url: &str,
        sentinels: Option<&Sentinels>,
        tls: &TlsFiles,
        base: String,
        epoch: Timeline,
        retention: u64,
    ) -> Result<Self, BusError> {
        let client = Client::open(url)
            .map_err(|e| BusError(format!("bus.url: not a Redis URL ({})", e.category())))?;
        let tls = match url.split_once("://").map(|(s, _)| s) {
            Some("rediss") => {
                install_ring_provider();
                Self::tls_client(&client, tls)?;
                Some(tls.clone())
            }
            // The config refuses these; here too, so no caller can run a
            // bus in plaintext that was meant to be secured.
            _ if !tls.is_empty() => {
                return Err(BusError(
                    "bus.ca_file, bus.cert_file and bus.key_file need a rediss:// bus.url".into(),
                ));
            }
            _ => None,
        };
        let target = match sentinels {
            Some(s) => Target::Sentinel(Arc::new(SentinelTarget::new(url, s)?)),
            None => Target::Server(Box::new(client)),
        };
        Ok(Self {
            target,
            tls,
            relay_key: format!("{base}:relay"),
            stream: epoch_key(&base, epoch),
            base,
            epoch,
            retention,
            replicas: false,
            reading: None,
            node: String::new(),
            on_primary_since: None,
            left: None,
            conn: None,
            seen: EntryId::START,
            append: Script::new(APPEND),
            head: Script::new(HEAD),
        })
    }

    /// The same bus on a connection of its own (a blocking read holds one).
    pub fn another(&self) -> Self {
        Self {
            target: self.target.clone(),
            tls: self.tls.clone(),
            base: self.base.clone(),
            epoch: self.epoch,
            stream: self.stream.clone(),
            relay_key: self.relay_key.clone(),
            retention: self.retention,
            replicas: false,
            reading: None,
            node: String::new(),
            on_primary_since: None,
            left: None,
            conn: None,
            seen: EntryId::START,
            append: Script::new(APPEND),
            head: Script::new(HEAD),
        }
    }

    /// [`Self::another`] for a consumer: with `replicas`
    /// (`bus.read_from = "replicas"`), it reads an online replica of the
    /// primary when there is one (see "A read tier"). It never appends.
    pub fn reader(&self, replicas: bool) -> Self {
        Self {
            replicas,
            ..self.another()
        }
    }

    /// `client` with the TLS files read now.
    fn tls_client(client: &Client, files: &TlsFiles) -> Result<Client, BusError> {
        Client::build_with_tls(client.get_connection_info().clone(), files.certificates()?).map_err(
            |e| {
                BusError(format!(
                    "bus: the TLS set-up does not work ({})",
                    e.category()
                ))
            },
        )
    }

    async fn conn(&mut self, wait: Duration) -> Result<MultiplexedConnection, BusError> {
        // Reading the primary for want of a replica: choose again now and
        // then, so replicas that came (back) take the reads again.
        if self
            .on_primary_since
            .is_some_and(|t| t.elapsed() >= CHOOSE_AGAIN_EVERY)
        {
            self.conn = None;
            self.left = None;
        }
        if let Some(c) = &self.conn {
            return Ok(c.clone());
        }
        let cfg = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(CONNECT_TIMEOUT))
            .set_response_timeout(Some(RESPONSE_TIMEOUT + wait));
        let client = match (&self.target, &self.tls) {
            (Target::Server(c), Some(files)) => Self::tls_client(c, files)?,
            (Target::Server(c), None) => (**c).clone(),
            (Target::Sentinel(s), tls) => s.primary(tls.as_ref()).await?,
        };
        let mut c = client
            .get_multiplexed_async_connection_with_config(&cfg)
            .await
            .map_err(|e| connecting(e, self.tls.is_some()))?;
        // Bounded as a whole: replicas that accept and then hang would
        // otherwise cost a connection and a response time-out each.
        if self.replicas {
            let chosen =
                tokio::time::timeout(REPLICA_CHOICE_TIMEOUT, self.replica(&client, &mut c, &cfg))
                    .await;
            match chosen {
                Ok(Some((r, at))) => {
                    c = r;
                    self.reading = Some(at);
                    self.on_primary_since = None;
                }
                _ => {
                    self.reading = None;
                    self.on_primary_since = Some(std::time::Instant::now());
                }
            }
        }
        self.node = match &self.reading {
            Some((host, port)) => format!("replica {host}:{port}"),
            None => format!("primary {}", client.get_connection_info().addr()),
        };
        self.conn = Some(c.clone());
        Ok(c)
    }

    /// The replicas a reader could choose now (see "A read tier"): those
    /// the primary lists online and acknowledging, as `host:port`.
    pub async fn replicas_online(&mut self) -> Result<Vec<String>, BusError> {
        let mut conn = self.conn(Duration::ZERO).await?;
        let r: Result<String, _> = redis::cmd("INFO")
            .arg("replication")
            .query_async(&mut conn)
            .await;
        let info = self.forget_on_error(r)?;
        Ok(online_replicas(&info)
            .into_iter()
            .map(|(h, p)| format!("{h}:{p}"))
            .collect())
    }

    /// A connection to an online replica of the primary `primary` is
    /// connected to, chosen as "A read tier" says; `None`: read the
    /// primary.
    async fn replica(
        &self,
        client: &Client,
        primary: &mut MultiplexedConnection,
        cfg: &AsyncConnectionConfig,
    ) -> Option<(MultiplexedConnection, (String, u16))> {
        let info: String = redis::cmd("INFO")
            .arg("replication")
            .query_async(primary)
            .await
            .ok()?;
        let replid = field(&info, "master_replid")?.to_string();
        let mut online = online_replicas(&info);
        // Not the one just left (it did not keep the stream current) while
        // another is online; alone, the primary is read instead.
        online.retain(|r| Some(r) != self.left.as_ref());
        while !online.is_empty() {
            let (host, port) = online.swap_remove(random_below(online.len()));
            let addr = match client.get_connection_info().addr() {
                ConnectionAddr::TcpTls { .. } => ConnectionAddr::TcpTls {
                    host: host.clone(),
                    port,
                    insecure: false,
                    tls_params: None,
                },
                _ => ConnectionAddr::Tcp(host.clone(), port),
            };
            let info = client.get_connection_info().clone().set_addr(addr);
            let replica = match &self.tls {
                Some(files) => match files.certificates() {
                    Ok(certs) => Client::build_with_tls(info, certs),
                    Err(_) => return None,
                },
                None => Client::open(info),
            };
            let Ok(replica) = replica else { continue };
            let Ok(mut c) = replica
                .get_multiplexed_async_connection_with_config(cfg)
                .await
            else {
                continue;
            };
            let said: Result<String, _> = redis::cmd("INFO")
                .arg("replication")
                .query_async(&mut c)
                .await;
            if said.is_ok_and(|i| {
                replica_link_up(&i) && field(&i, "master_replid") == Some(replid.as_str())
            }) {
                tracing::debug!(replica = %format!("{host}:{port}"), "bus: reading a replica");
                return Some((c, (host, port)));
            }
        }
        None
    }

    /// Runs `f` on the connection; a failure drops the connection, so the
    /// next call opens a new one.
    fn forget_on_error<T>(&mut self, r: Result<T, redis::RedisError>) -> Result<T, BusError> {
        if r.is_err() {
            self.conn = None;
        }
        r.map_err(failed)
    }
}

/// The replicas a primary's `INFO replication` lists as `online` and
/// acknowledging (`lag` ≤ 2 s: replicas acknowledge every second), as
/// (announced host, port).
fn online_replicas(info: &str) -> Vec<(String, u16)> {
    let mut out = Vec::new();
    for line in info.lines() {
        let Some((name, fields)) = line.trim_end().split_once(':') else {
            continue;
        };
        if !name.starts_with("slave") || !name[5..].bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let field = |k: &str| {
            fields
                .split(',')
                .find_map(|kv| kv.strip_prefix(k)?.strip_prefix('='))
        };
        let (Some(ip), Some(port), Some("online"), Some(lag)) =
            (field("ip"), field("port"), field("state"), field("lag"))
        else {
            continue;
        };
        let (Ok(port), Ok(lag)) = (port.parse::<u16>(), lag.parse::<u64>()) else {
            continue;
        };
        if lag <= 2 && !ip.is_empty() {
            out.push((ip.to_string(), port));
        }
    }
    out
}

/// The value of `key` in an `INFO` reply.
fn field<'a>(info: &'a str, key: &str) -> Option<&'a str> {
    info.lines()
        .find_map(|l| l.trim_end().strip_prefix(key)?.strip_prefix(':'))
}

/// Whether a node's `INFO replication` says it is a replica whose link to
/// its primary is up.
fn replica_link_up(info: &str) -> bool {
    let lines: Vec<&str> = info.lines().map(str::trim_end).collect();
    lines.contains(&"role:slave") && lines.contains(&"master_link_status:up")
}

/// A number below `n` (> 0), different from one connection to the next:
/// spreads a fleet's readers over the replicas.
fn random_below(n: usize) -> usize {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    (h.finish() % n as u64) as usize
}

/// A connection that could not be opened: [`failed`]'s words, and for a
/// plaintext one closed by the server, the likeliest reason (a server that
/// wants TLS drops a plaintext client without a word).
fn connecting(e: redis::RedisError, tls: bool) -> BusError {
    let lost = (e.is_io_error() || e.is_connection_dropped())
        && !e.is_connection_refusal()
        && !e.is_timeout()
        && tls_problem(&e).is_none();
    let err = failed(e);
    if lost && !tls {
        return BusError(format!(
            "{} while connecting (a server that accepts only TLS does that to a redis:// client: rediss://?)",
            err.0
        ));
    }
    err
}

/// The TLS layer's words when `e` comes from it: a certificate refused, a
/// handshake that failed, the host's certificate store unreadable. Safe to
/// show: rustls names the problem, never the URL.
fn tls_problem(e: &redis::RedisError) -> Option<String> {
    type Shared = std::sync::Arc<dyn std::error::Error + Send + Sync>;
    // redis-rs keeps the cause as `Arc<dyn Error>`, whose `source()` skips
    // the cause itself, and `io::Error::source()` skips the error it
    // wraps (tokio-rustls wraps rustls' that way): each layer is opened
    // by hand.
    let mut next: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
    while let Some(s) = next {
        let s: &(dyn std::error::Error + 'static) = match s.downcast_ref::<Shared>() {
            Some(inner) => &**inner,
            None => s,
        };
        if let Some(t) = s.downcast_ref::<rustls::Error>() {
            return Some(format!("TLS: {t}"));
        }
        if let Some(t) = s.downcast_ref::<rustls_native_certs::Error>() {
            return Some(format!("TLS: reading the host's certificate store: {t}"));
        }
        if let Some(inner) = s
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
        {
            next = Some(inner);
            continue;
        }
        next = s.source();
    }
    None
}

/// The error without the URL: the kind and the server's words.
fn failed(e: redis::RedisError) -> BusError {
    let what = if let Some(tls) = tls_problem(&e) {
        tls
    } else if e.is_connection_refusal() {
        "connection refused".to_string()
    } else if e.is_timeout() {
        "timed out".to_string()
    } else if e.is_io_error() || e.is_connection_dropped() {
        "connection lost".to_string()
    } else {
        match e.detail().filter(|d| !d.is_empty()) {
            Some(d) => format!("{}: {d}", e.category()),
            None => e.category().to_string(),
        }
    };
    BusError(format!("Redis: {what}"))
}

fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        Value::VerbatimString { text, .. } => Some(text.clone()),
        Value::Int(i) => Some(i.to_string()),
        _ => None,
    }
}

fn items(v: &Value) -> Option<&[Value]> {
    match v {
        Value::Array(a) | Value::Set(a) => Some(a),
        _ => None,
    }
}

/// One `[id, [field, value, ...]]` of a stream reply, on `epoch`.
fn parse_entry(v: &Value, epoch: Timeline) -> Option<Read> {
    let pair = items(v)?;
    let at = EntryId::parse(&text(pair.first()?)?)?;
    let fields: Vec<String> = match pair.get(1)? {
        Value::Map(m) => m
            .iter()
            .flat_map(|(k, v)| [text(k), text(v)])
            .collect::<Option<_>>()?,
        other => items(other)?.iter().map(text).collect::<Option<_>>()?,
    };
    let get = |name: &str| {
        fields
            .chunks(2)
            .find(|kv| kv[0] == name)
            .and_then(|kv| kv.get(1))
            .cloned()
    };
    let prev = get("p").and_then(|p| EntryId::parse(&p))?;
    let entry = match (get("k"), get("d")) {
        (Some(k), Some(d)) => Entry::decode(&k, epoch, at.lsn, &d),
        _ => Err("entry without k or d".into()),
    };
    Some(Read { at, prev, entry })
}

impl Bus for RedisBus {
    fn set_epoch(&mut self, timeline: Timeline) {
        if timeline != self.epoch {
            self.seen = EntryId::START;
        }
        self.epoch = timeline;
        self.stream = epoch_key(&self.base, timeline);
    }

    fn epoch(&self) -> Timeline {
        self.epoch
    }

    fn stream(&self) -> &str {
        &self.stream
    }

    fn node(&self) -> &str {
        &self.node
    }

    async fn append(&mut self, entry: &Entry) -> Result<Appended, BusError> {
        let mut conn = self.conn(Duration::ZERO).await?;
        let r: Result<(i64, String), _> = self
            .append
            .key(&self.stream)
            .arg(entry.kind())
            .arg(entry.lsn().to_string())
            .arg(entry.encode())
            .arg(self.retention)
            .arg(self.seen.to_string())
            .arg(u64::from(rand::random::<u32>()) + 1)
            .invoke_async(&mut conn)
            .await;
        let (added, id) = self.forget_on_error(r)?;
        match (added, EntryId::parse(&id)) {
            (1, Some(at)) => {
                self.seen = at;
                Ok(Appended::At(at))
            }
            (0, Some(prev)) => {
                self.seen = self.seen.max(prev);
                Ok(Appended::Already)
            }
            (2, Some(prev)) => Err(BusError(format!(
                "Redis: the stream went back from {} to {prev} (a Redis failover or restart lost entries)",
                self.seen
            ))),
            _ => Err(BusError(format!("Redis: unexpected answer {id:?}"))),
        }
    }

    async fn head(&mut self) -> Result<EntryId, BusError> {
        let mut conn = self.conn(Duration::ZERO).await?;
        let r: Result<String, _> = self.head.key(&self.stream).invoke_async(&mut conn).await;
        let id = self.forget_on_error(r)?;
        let head = EntryId::parse(&id)
            .ok_or_else(|| BusError(format!("Redis: unexpected answer {id:?}")))?;
        // The caller starts from here: appends are checked against it.
        self.seen = head;
        Ok(head)
    }

    async fn read(
        &mut self,
        after: EntryId,
        wait: Duration,
        max: usize,
    ) -> Result<Vec<Read>, BusError> {
        let mut conn = self.conn(wait).await?;
        let r: Result<Value, _> = redis::cmd("XREAD")
            .arg("COUNT")
            .arg(max)
            .arg("BLOCK")
            .arg(wait.as_millis().max(1) as u64)
            .arg("STREAMS")
            .arg(&self.stream)
            .arg(after.to_string())
            .query_async(&mut conn)
            .await;
        let v = self.forget_on_error(r)?;
        let streams: Vec<&Value> = match &v {
            Value::Nil => return Ok(Vec::new()),
            Value::Map(m) => m.iter().map(|(_, v)| v).collect(),
            other => items(other)
                .ok_or_else(|| BusError("Redis: unexpected XREAD answer".into()))?
                .iter()
                .filter_map(|s| items(s)?.get(1))
                .collect(),
        };
        let mut out = Vec::new();
        for s in streams {
            for e in items(s).unwrap_or_default() {
                out.push(
                    parse_entry(e, self.epoch)
                        .ok_or_else(|| BusError("Redis: an entry not in the bus's form".into()))?,
                );
            }
        }
        Ok(out)
    }

    async fn announce(&mut self, who: &str, ttl: Duration) -> Result<(), BusError> {
        let mut conn = self.conn(Duration::ZERO).await?;
        let r: Result<(), _> = redis::cmd("SET")
            .arg(&self.relay_key)
            .arg(who)
            .arg("PX")
            .arg(ttl.as_millis() as u64)
            .query_async(&mut conn)
            .await;
        self.forget_on_error(r)
    }

    fn reconnect(&mut self) {
        // Reading the primary, a new connection would reach the same node.
        if self.replicas {
            self.left = self.reading.take();
            self.conn = None;
        }
    }

    async fn relay(&mut self) -> Result<Option<String>, BusError> {
        let mut conn = self.conn(Duration::ZERO).await?;
        let r: Result<Option<String>, _> = redis::cmd("GET")
            .arg(&self.relay_key)
            .query_async(&mut conn)
            .await;
        self.forget_on_error(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Redis 7's `INFO replication` of a primary with three replicas: one
    /// online, one still loading its snapshot, one online but not
    /// acknowledging for 5 s.
    const PRIMARY: &str = "# Replication\r\nrole:master\r\nconnected_slaves:3\r\n\
        slave0:ip=10.0.0.5,port=6379,state=online,offset=8123,lag=0\r\n\
        slave1:ip=10.0.0.6,port=6380,state=wait_bgsave,offset=0,lag=0\r\n\
        slave2:ip=10.0.0.7,port=6379,state=online,offset=7000,lag=5\r\n\
        slave3:ip=redis-3.internal,port=6381,state=online,offset=8123,lag=1\r\n\
        master_failover_state:no-failover\r\nmaster_replid:abc\r\n";

    #[test]
    fn only_online_replicas_that_acknowledge_within_a_second_are_read() {
        assert_eq!(
            online_replicas(PRIMARY),
            vec![
                ("10.0.0.5".to_string(), 6379),
                ("redis-3.internal".to_string(), 6381)
            ]
        );
        assert!(
            online_replicas("# Replication\r\nrole:master\r\nconnected_slaves:0\r\n").is_empty()
        );
        // A replica's own INFO lists no replicas (and `slave_read_only` or
        // `slave_repl_offset` are not replicas).
        assert!(online_replicas(REPLICA).is_empty());
    }

    const REPLICA: &str = "# Replication\r\nrole:slave\r\nmaster_host:10.0.0.4\r\n\
        master_port:6379\r\nmaster_link_status:up\r\nslave_repl_offset:8123\r\n\
        slave_read_only:1\r\nconnected_slaves:0\r\n";

    #[test]
    fn a_replica_is_read_only_while_its_link_is_up() {
        assert!(replica_link_up(REPLICA));
        assert!(!replica_link_up(
            &REPLICA.replace("master_link_status:up", "master_link_status:down")
        ));
        // A replica promoted meanwhile is a primary: not read as a replica.
        assert!(!replica_link_up(PRIMARY));
    }

    #[test]
    fn info_fields_are_read_by_their_whole_name() {
        assert_eq!(field(PRIMARY, "master_replid"), Some("abc"));
        assert_eq!(field(PRIMARY, "master_repl"), None);
        assert_eq!(field(REPLICA, "master_port"), Some("6379"));
    }

    #[test]
    fn the_choice_stays_in_range_and_varies() {
        let picks: std::collections::HashSet<usize> = (0..200).map(|_| random_below(4)).collect();
        assert!(picks.iter().all(|&i| i < 4));
        assert!(picks.len() > 1, "{picks:?}");
    }
}
