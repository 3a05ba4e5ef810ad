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
//! A commit's ID is its LSN and a heartbeat's the primary's insert
//! position: whoever appends them, the same ID says the same thing on one
//! timeline. A resync that stands for a position (a new term's stream
//! starting past the stream's newest entry: [`crate::feed::Resync::upto`]) is placed
//! at that position's LSN. A stream can hold two histories under one key
//! (a Sentinel split brain: the old node took entries the promoted one
//! never had), and places are compared by number across them (a
//! snapshot's label, [`crate::snapshot::Mark`]): placed at the newest
//! entry of the node it lands on, such a resync would let a snapshot
//! labelled on the other node, behind the position the resync stands
//! for, pass for complete past it, and the commits between them (on the
//! other node only, and never appended again) would be in neither. At
//! the position, only a place past every commit it stands for is past
//! it. A resync, a coverage change or an interruption with no such
//! position is placed after the newest entry, at the same LSN with a
//! greater sequence. Were that sequence the next one, two relays placing
//! such an entry after the same entry would give both one ID: the old
//! relay's on a Redis that then lost it (with commits after it), the new
//! relay's resync on the node promoted in its place (a resync placed at
//! its position draws its sequence at random too). A consumer that
//! read the lost one reads on *after* that ID, skips the resync, and finds
//! the next entry's `p` equal to its position: the lost commits gone
//! without a break. So the sequence steps by a number drawn at random per
//! append (1 to 2^32): a later such entry on the same LSN lands on the
//! lost one's ID with odds of about 2^-32, and otherwise the consumer sees
//! a break whichever comes first (tested in `tests/it/feed/bus.rs`). IDs still
//! increase and consumers need nothing new; relays do: an older relay
//! steps by one, so during a rolling upgrade the guarantee holds where
//! the relay after the failover runs this code.
//!
//! # Epochs
//! One stream per epoch of the primary: its system identifier, timeline
//! and postmaster start time ([`epoch_key`]). A relay whose term has
//! appended to an epoch's stream marks the streams of every other epoch of
//! the same base to expire ([`Bus::retire_others`]; the term counted its
//! stream among the epochs' as it started, [`Bus::enter`]): their consumers have
//! moved on (each reads the primary every 100 ms), and a stream nobody
//! appends to would otherwise stay for good. Until then the one before
//! stays in the set, where a relay finds the stream it continues
//! ([`Bus::previous`]: see "A promotion the slot survived" in [`super`]).
//!
//! The rest lives in rooms of its own: [`sentinel`] (connections to the
//! primary the sentinels name), [`tls`] (`rediss://` and its files),
//! [`replicas`] (the read tier, `bus.read_from = "replicas"`) and
//! [`snapshots`] (the fleet's filters beside the stream).

mod replicas;
mod sentinel;
pub mod snapshots;
mod tls;
pub mod writes;

pub use writes::Memory;

pub use sentinel::Sentinels;
pub use tls::TlsFiles;

use std::sync::Arc;
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, Client, Script, Value};

use super::{Appended, Bus, BusError, Entry, EntryId, Read, epoch_key, epoch_of};
use crate::feed::Server;
use sentinel::SentinelTarget;
use tls::{install_ring_provider, tls_problem};

/// Applies the position rules and appends; returns `{1, id}`, `{0, prev}`
/// (already there), or `{2, prev}` when the stream's newest position is
/// below `ARGV[5]`, the newest this handle saw (see "A stream that went
/// back"). LSNs travel as decimal strings (Lua's numbers are doubles) and
/// are compared as such. A resync that stands for an LSN past the newest
/// entry's is placed at that LSN with the sequence `ARGV[6]`; any other
/// entry without an LSN of its own is placed
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
elseif lsn ~= '0' and after(lsn, tl) then
  id = lsn .. '-' .. ARGV[6]
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

/// Marks `KEYS[2]` the stream in use (no expiry) in the set `KEYS[1]`, and
/// every other stream in it to expire after `ARGV[1]` milliseconds, out of
/// the set (see "Epochs"). The other streams are named by the set, not by
/// `KEYS`: a bus on one Redis, or its replicas and sentinels, never on a
/// cluster.
const RETIRE: &str = r#"
redis.call('PERSIST', KEYS[2])
for _, k in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if k ~= KEYS[2] then
    redis.call('PEXPIRE', k, ARGV[1])
    redis.call('SREM', KEYS[1], k)
  end
end
redis.call('SADD', KEYS[1], KEYS[2])
return 1
"#;

/// How long a stream of another epoch stays once a relay has started on a
/// new one: every consumer reads the primary ten times a second and moves
/// on within one reading; the rest is room for one that was paused.
pub const RETIRE_AFTER: Duration = Duration::from_secs(600);

/// How long a command may take before the connection is given up (a
/// blocking read adds its own wait).
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(2);

/// How long opening a connection may take; with Sentinel, asking the
/// sentinels too.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// How long choosing a replica to read may take, every one tried
/// included (see [`replicas`]); then the primary is read.
const REPLICA_CHOICE_TIMEOUT: Duration = Duration::from_secs(3);

/// How long a reader meant for the replicas reads the primary before it
/// looks for a replica again.
const CHOOSE_AGAIN_EVERY: Duration = Duration::from_secs(10);

/// Where connections go.
#[derive(Clone)]
enum Target {
    /// `bus.url`'s server.
    Server(Box<Client>),
    /// The primary the sentinels name, asked at every connection.
    Sentinel(Arc<SentinelTarget>),
}

pub struct RedisBus {
    target: Target,
    /// `Some` for `rediss://`: the files, read for every connection.
    tls: Option<TlsFiles>,
    /// The key without the timeline (see "The stream" in [`super`]).
    base: String,
    epoch: Server,
    /// `base` with `epoch`'s suffix: the stream in use.
    stream: String,
    relay_key: String,
    /// The set of the streams of `base` a relay has appended to (see
    /// "Epochs").
    epochs_key: String,
    retention: u64,
    /// Read an online replica of the primary (see [`replicas`]).
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
    retire: Script,
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
        epoch: Server,
        retention: u64,
    ) -> Result<Self, BusError> {
        Self::with_sentinels(url, None, tls, base, epoch, retention)
    }

    /// [`Self::new`], and with `sentinels`, the primary they name (see
    /// [`sentinel`]): `url` then gives its scheme, credentials and database.
    pub fn with_sentinels(
        url: &str,
        sentinels: Option<&Sentinels>,
        tls: &TlsFiles,
        base: String,
        epoch: Server,
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
        Ok(Self::on(target, tls, base, epoch, retention))
    }

    /// A bus on `target` with no connection yet, reading the primary.
    fn on(
        target: Target,
        tls: Option<TlsFiles>,
        base: String,
        epoch: Server,
        retention: u64,
    ) -> Self {
        Self {
            target,
            tls,
            relay_key: format!("{base}:relay"),
            epochs_key: format!("{base}:epochs"),
            stream: epoch_key(&base, &epoch),
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
            retire: Script::new(RETIRE),
        }
    }

    /// The same bus on a connection of its own (a blocking read holds one).
    pub fn another(&self) -> Self {
        Self::on(
            self.target.clone(),
            self.tls.clone(),
            self.base.clone(),
            self.epoch,
            self.retention,
        )
    }

    /// [`Self::another`] for a consumer: with `replicas`
    /// (`bus.read_from = "replicas"`), it reads an online replica of the
    /// primary when there is one (see [`replicas`]). It never appends.
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

    /// Runs `f` on the connection; a failure drops the connection, so the
    /// next call opens a new one.
    fn forget_on_error<T>(&mut self, r: Result<T, redis::RedisError>) -> Result<T, BusError> {
        if r.is_err() {
            self.conn = None;
        }
        r.map_err(failed)
    }
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
        // The server's error code last, for `is_refusal`.
        let code = e.code().map(|c| format!(" ({c})")).unwrap_or_default();
        match e.detail().filter(|d| !d.is_empty()) {
            Some(d) => format!("{}: {d}{code}", e.category()),
            None => format!("{}{code}", e.category()),
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
fn parse_entry(v: &Value, epoch: crate::feed::Timeline) -> Option<Read> {
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
    async fn read_memory(&mut self) -> Result<Option<writes::Memory>, BusError> {
        self.memory().await.map(Some)
    }

    fn set_epoch(&mut self, server: Server) {
        if server != self.epoch {
            self.seen = EntryId::START;
        }
        self.epoch = server;
        self.stream = epoch_key(&self.base, &server);
    }

    fn epoch(&self) -> Server {
        self.epoch
    }

    async fn retire_others(&mut self) -> Result<(), BusError> {
        let mut conn = self.conn(Duration::ZERO).await?;
        let r: Result<(), _> = self
            .retire
            .key(&self.epochs_key)
            .key(&self.stream)
            .arg(RETIRE_AFTER.as_millis() as u64)
            .invoke_async(&mut conn)
            .await;
        self.forget_on_error(r)
    }

    async fn enter(&mut self) -> Result<(), BusError> {
        let mut conn = self.conn(Duration::ZERO).await?;
        let r: Result<(), _> = redis::cmd("SADD")
            .arg(&self.epochs_key)
            .arg(&self.stream)
            .query_async(&mut conn)
            .await;
        self.forget_on_error(r)
    }

    async fn previous(&mut self) -> Result<Option<(Server, EntryId)>, BusError> {
        let mut conn = self.conn(Duration::ZERO).await?;
        let r: Result<Vec<String>, _> = redis::cmd("SMEMBERS")
            .arg(&self.epochs_key)
            .query_async(&mut conn)
            .await;
        let members = self.forget_on_error(r)?;
        let mut others = members.into_iter().filter(|k| *k != self.stream);
        let (Some(key), None) = (others.next(), others.next()) else {
            return Ok(None);
        };
        let Some(before) = epoch_of(&self.base, &key, self.epoch.timeline.system) else {
            return Ok(None);
        };
        let r: Result<String, _> = self.head.key(&key).invoke_async(&mut conn).await;
        let id = self.forget_on_error(r)?;
        Ok(EntryId::parse(&id).map(|head| (before, head)))
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
                    parse_entry(e, self.epoch.timeline)
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
        // Reading the primary by its address, a new connection would reach
        // the same node: the open one stays. Through the sentinels, the
        // next one reaches the primary they name now, which may be
        // another node even though the old one answers: a split brain
        // leaves it a primary, with a stream no relay appends to.
        if self.replicas {
            self.left = self.reading.take();
            self.conn = None;
        } else if matches!(self.target, Target::Sentinel(_)) {
            self.conn = None;
        }
    }

    async fn trim(&mut self) -> Result<(), BusError> {
        self.trim_stream().await
    }

    async fn still_primary(&mut self) -> Result<bool, BusError> {
        let Target::Sentinel(s) = &self.target else {
            return Ok(true);
        };
        if self.conn.is_none() || self.replicas {
            return Ok(true);
        }
        let named = s.primary(self.tls.as_ref()).await?;
        let same = self.node == format!("primary {}", named.get_connection_info().addr());
        if !same {
            self.conn = None;
        }
        Ok(same)
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
