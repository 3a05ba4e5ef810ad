//! The [`Bus`] on Redis Streams (redis-rs): one stream, appended to by a
//! Lua script that applies the position rules of "The stream" (in
//! [`super`]) atomically, read with `XREAD BLOCK`.
//!
//! The stream's newest position is Redis' `last-generated-id`, not the
//! newest entry still present: an entry trimmed away (or deleted by hand)
//! still counts as the one before the next, and Redis refuses any ID at or
//! below it anyway.

use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, Client, Script, Value};

use super::{Appended, Bus, BusError, Entry, Position, Read};

/// Applies the position rules and appends; returns `{1, id}` or `{0, prev}`.
/// LSNs travel as decimal strings (Lua's numbers are doubles) and are
/// compared as such.
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
local id
if kind == 'c' or kind == 'h' then
  if not after(lsn, tl) then return {0, prev} end
  if kind == 'c' then id = lsn .. '-0' else id = lsn .. '-1' end
else
  id = tl .. '-' .. string.format('%d', ts + 1)
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

pub struct RedisBus {
    client: Client,
    stream: String,
    relay_key: String,
    retention: u64,
    conn: Option<MultiplexedConnection>,
    append: Script,
    head: Script,
}

impl RedisBus {
    /// A bus on the stream `stream` of the server at `url` (not connected
    /// yet). The error never repeats the URL (it may hold a password).
    pub fn new(url: &str, stream: String, retention: u64) -> Result<Self, BusError> {
        let client = Client::open(url)
            .map_err(|e| BusError(format!("bus.url: not a Redis URL ({})", e.category())))?;
        Ok(Self {
            client,
            relay_key: format!("{stream}:relay"),
            stream,
            retention,
            conn: None,
            append: Script::new(APPEND),
            head: Script::new(HEAD),
        })
    }

    /// The same bus on a connection of its own (a blocking read holds one).
    pub fn another(&self) -> Self {
        Self {
            client: self.client.clone(),
            stream: self.stream.clone(),
            relay_key: self.relay_key.clone(),
            retention: self.retention,
            conn: None,
            append: Script::new(APPEND),
            head: Script::new(HEAD),
        }
    }

    pub fn stream(&self) -> &str {
        &self.stream
    }

    async fn conn(&mut self, wait: Duration) -> Result<MultiplexedConnection, BusError> {
        if let Some(c) = &self.conn {
            return Ok(c.clone());
        }
        let cfg = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(2)))
            .set_response_timeout(Some(RESPONSE_TIMEOUT + wait));
        let c = self
            .client
            .get_multiplexed_async_connection_with_config(&cfg)
            .await
            .map_err(failed)?;
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

/// The error without the URL: the kind and the server's words.
fn failed(e: redis::RedisError) -> BusError {
    let what = if e.is_connection_refusal() {
        "connection refused".to_string()
    } else if e.is_timeout() {
        "timed out".to_string()
    } else if e.is_io_error() || e.is_connection_dropped() {
        "connection lost".to_string()
    } else {
        format!("{}: {}", e.category(), e.detail().unwrap_or(""))
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

/// One `[id, [field, value, ...]]` of a stream reply.
fn parse_entry(v: &Value) -> Option<Read> {
    let pair = items(v)?;
    let at = Position::parse(&text(pair.first()?)?)?;
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
    let prev = get("p").and_then(|p| Position::parse(&p))?;
    let entry = match (get("k"), get("d")) {
        (Some(k), Some(d)) => Entry::decode(&k, at.lsn, &d),
        _ => Err("entry without k or d".into()),
    };
    Some(Read { at, prev, entry })
}

impl Bus for RedisBus {
    async fn append(&mut self, entry: &Entry) -> Result<Appended, BusError> {
        let mut conn = self.conn(Duration::ZERO).await?;
        let r: Result<(i64, String), _> = self
            .append
            .key(&self.stream)
            .arg(entry.kind())
            .arg(entry.lsn().to_string())
            .arg(entry.encode())
            .arg(self.retention)
            .invoke_async(&mut conn)
            .await;
        let (added, id) = self.forget_on_error(r)?;
        match (added, Position::parse(&id)) {
            (1, Some(at)) => Ok(Appended::At(at)),
            (0, _) => Ok(Appended::Already),
            _ => Err(BusError(format!("Redis: unexpected answer {id:?}"))),
        }
    }

    async fn head(&mut self) -> Result<Position, BusError> {
        let mut conn = self.conn(Duration::ZERO).await?;
        let r: Result<String, _> = self.head.key(&self.stream).invoke_async(&mut conn).await;
        let id = self.forget_on_error(r)?;
        Position::parse(&id).ok_or_else(|| BusError(format!("Redis: unexpected answer {id:?}")))
    }

    async fn read(
        &mut self,
        after: Position,
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
                    parse_entry(e)
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

    async fn relay(&mut self) -> Result<Option<String>, BusError> {
        let mut conn = self.conn(Duration::ZERO).await?;
        let r: Result<Option<String>, _> = redis::cmd("GET")
            .arg(&self.relay_key)
            .query_async(&mut conn)
            .await;
        self.forget_on_error(r)
    }
}
