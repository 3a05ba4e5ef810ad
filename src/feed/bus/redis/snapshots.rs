//! The fleet's snapshots on the bus's Redis ([`Store`]), beside the
//! streams they continue. Keys, under the stream's own name (so a
//! snapshot is of one stream, hence one epoch, by where it lives as well as
//! by its authenticated manifest):
//!
//! | key | type | holds |
//! |---|---|---|
//! | `{stream}:snap:{resource}` | list | the snapshots' nonces, newest first, at most `bus.snapshot_keep` |
//! | `{stream}:snap:{resource}:{nonce}` | hash | `m`: the manifest; `0`…`n-1`: the sealed chunks |
//! | `{stream}:scan:{resource}:{slot}` | string | a scan lease's token, with a time to live |
//!
//! A snapshot is written whole (its hash) before its nonce is pushed on the
//! list, and the push deletes the hashes it trims off: readers see a
//! snapshot complete, or gone (a chunk missing: unusable, a scan). Every
//! key expires [`SNAPSHOT_TTL`] after its last write, so the snapshots of
//! a stream nobody appends to any more go with it.
//!
//! Writes go to the primary (the Sentinel's, when configured), never to the
//! read tier's replicas.

use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use futures_util::future::BoxFuture;
use redis::{Script, Value};
use tokio::sync::Mutex;

use sqlx::PgPool;

use super::{RedisBus, items, parse_entry, text};
use crate::feed::Watch;
use crate::feed::bus::cursor::Cursor;
use crate::feed::bus::{BusError, EntryId};
use crate::feed::tracker::{self, Shapes};
use crate::snapshot::{FleetKey, Lease, Mark, Settings, SnapshotError, Stats, Store, Stored};

/// How long a snapshot outlives its last write.
pub const SNAPSHOT_TTL: Duration = Duration::from_secs(24 * 3600);

/// Pushes `ARGV[1]` on the list `KEYS[1]`, keeps `ARGV[2]`, deletes the
/// hashes (`KEYS[2]` prefix) of the nonces trimmed off.
const PUSH: &str = r#"
redis.call('LPUSH', KEYS[1], ARGV[1])
local old = redis.call('LRANGE', KEYS[1], tonumber(ARGV[2]), -1)
for _, n in ipairs(old) do redis.call('DEL', KEYS[2] .. n) end
redis.call('LTRIM', KEYS[1], 0, tonumber(ARGV[2]) - 1)
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return #old
"#;

/// Extends (`ARGV[2]` > 0) or deletes the lease `KEYS[1]` if it holds
/// the token `ARGV[1]`.
const LEASE: &str = r#"
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if tonumber(ARGV[2]) > 0 then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
else
  redis.call('DEL', KEYS[1])
end
return 1
"#;

pub struct RedisSnapshots {
    bus: Mutex<RedisBus>,
    /// For [`Store::catalog`]: the primary, and the watched tables.
    pool: PgPool,
    watch: Watch,
    fleet: FleetKey,
    settings: Settings,
    stats: Stats,
    cursor: Arc<Cursor>,
    push: Script,
    lease: Script,
}

impl RedisSnapshots {
    /// On `bus`'s server (a connection of its own); `pool` and `watch`
    /// read the watched tables' catalog state.
    pub fn new(
        bus: &RedisBus,
        fleet: FleetKey,
        settings: Settings,
        cursor: Arc<Cursor>,
        pool: PgPool,
        watch: Watch,
    ) -> Self {
        Self {
            bus: Mutex::new(bus.another()),
            pool,
            watch,
            fleet,
            settings,
            stats: Stats::default(),
            cursor,
            push: Script::new(PUSH),
            lease: Script::new(LEASE),
        }
    }

    async fn query<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> Result<T, SnapshotError> {
        let mut bus = self.bus.lock().await;
        let mut conn = bus.conn(Duration::ZERO).await?;
        let r = cmd.query_async(&mut conn).await;
        Ok(bus.forget_on_error(r)?)
    }

    async fn script<T: redis::FromRedisValue>(
        &self,
        script: &Script,
        keys: &[&str],
        args: &[String],
    ) -> Result<T, SnapshotError> {
        let mut bus = self.bus.lock().await;
        let mut conn = bus.conn(Duration::ZERO).await?;
        let mut inv = script.prepare_invoke();
        for k in keys {
            inv.key(*k);
        }
        for a in args {
            inv.arg(a);
        }
        let r = inv.invoke_async(&mut conn).await;
        Ok(bus.forget_on_error(r)?)
    }
}

impl RedisSnapshots {
    /// The snapshot's hash: the manifest and its time to live first, then
    /// chunk by chunk (one command moves at most a chunk).
    async fn write_hash(&self, key: &str, stored: &Stored) -> Result<(), SnapshotError> {
        let mut first = redis::pipe();
        first
            .atomic()
            .cmd("HSET")
            .arg(key)
            .arg("m")
            .arg(stored.manifest.as_slice())
            .ignore()
            .cmd("PEXPIRE")
            .arg(key)
            .arg(millis(SNAPSHOT_TTL))
            .ignore();
        {
            let mut bus = self.bus.lock().await;
            let mut conn = bus.conn(Duration::ZERO).await?;
            let r: Result<(), _> = first.query_async(&mut conn).await;
            bus.forget_on_error(r)?;
        }
        for (i, c) in stored.chunks.iter().enumerate() {
            self.query::<()>(redis::cmd("HSET").arg(key).arg(i).arg(c.as_slice()))
                .await?;
        }
        Ok(())
    }
}

impl From<BusError> for SnapshotError {
    fn from(e: BusError) -> Self {
        SnapshotError::Store(Box::new(e))
    }
}

/// The store answered what the bus never writes.
fn unexpected(what: &str) -> SnapshotError {
    SnapshotError::Store(Box::new(BusError(what.to_string())))
}

fn list_key(stream: &str, resource: &str) -> String {
    format!("{stream}:snap:{resource}")
}

fn hash_key(stream: &str, resource: &str, nonce: &str) -> String {
    format!("{stream}:snap:{resource}:{nonce}")
}

fn lease_key(stream: &str, resource: &str, slot: u32) -> String {
    format!("{stream}:scan:{resource}:{slot}")
}

fn millis(d: Duration) -> String {
    d.as_millis().max(1).to_string()
}

impl Store for RedisSnapshots {
    fn fleet(&self) -> &FleetKey {
        &self.fleet
    }

    fn settings(&self) -> &Settings {
        &self.settings
    }

    fn stats(&self) -> &Stats {
        &self.stats
    }

    fn mark(&self) -> Option<Mark> {
        self.cursor.mark()
    }

    fn settled(&self) -> BoxFuture<'_, Option<Mark>> {
        self.cursor.settled().boxed()
    }

    fn not_before_ms(&self) -> u64 {
        self.cursor.not_before_ms()
    }

    fn put<'a>(
        &'a self,
        resource: &'a str,
        stored: &'a Stored,
    ) -> BoxFuture<'a, Result<(), SnapshotError>> {
        async move {
            let m = crate::snapshot::manifest(&stored.manifest)?;
            let stream = &m.at.stream;
            let key = hash_key(stream, resource, &m.nonce);
            if let Err(e) = self.write_hash(&key, stored).await {
                // Not left without its time to live (Redis may be short of
                // memory: that is often why a write failed).
                let _ = self.query::<()>(redis::cmd("DEL").arg(&key)).await;
                return Err(e);
            }
            let list = list_key(stream, resource);
            let prefix = hash_key(stream, resource, "");
            self.script::<i64>(
                &self.push,
                &[&list, &prefix],
                &[
                    m.nonce.clone(),
                    self.settings.keep.max(1).to_string(),
                    millis(SNAPSHOT_TTL),
                ],
            )
            .await?;
            Ok(())
        }
        .boxed()
    }

    fn manifests<'a>(
        &'a self,
        stream: &'a str,
        resource: &'a str,
    ) -> BoxFuture<'a, Result<Vec<Vec<u8>>, SnapshotError>> {
        async move {
            let nonces: Vec<String> = self
                .query(
                    redis::cmd("LRANGE")
                        .arg(list_key(stream, resource))
                        .arg(0)
                        .arg(i64::from(self.settings.keep.max(1)) - 1),
                )
                .await?;
            let mut out = Vec::new();
            for n in nonces {
                let m: Option<Vec<u8>> = self
                    .query(
                        redis::cmd("HGET")
                            .arg(hash_key(stream, resource, &n))
                            .arg("m"),
                    )
                    .await?;
                out.extend(m);
            }
            Ok(out)
        }
        .boxed()
    }

    fn chunks<'a>(
        &'a self,
        stream: &'a str,
        resource: &'a str,
        nonce: &'a str,
        n: u32,
    ) -> BoxFuture<'a, Result<Option<Vec<Vec<u8>>>, SnapshotError>> {
        async move {
            let key = hash_key(stream, resource, nonce);
            // `n` is the manifest's word, not yet authenticated: bounded
            // by the caller, and nothing allocated for it up front.
            let mut out = Vec::new();
            for i in 0..n {
                let c: Option<Vec<u8>> = self.query(redis::cmd("HGET").arg(&key).arg(i)).await?;
                match c {
                    Some(c) => out.push(c),
                    None => return Ok(None),
                }
            }
            Ok(Some(out))
        }
        .boxed()
    }

    fn lease<'a>(
        &'a self,
        stream: &'a str,
        resource: &'a str,
        slot: u32,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Option<String>, SnapshotError>> {
        async move {
            let token = crate::snapshot::Nonce::random().hex();
            let set: Option<String> = self
                .query(
                    redis::cmd("SET")
                        .arg(lease_key(stream, resource, slot))
                        .arg(&token)
                        .arg("NX")
                        .arg("PX")
                        .arg(millis(ttl)),
                )
                .await?;
            Ok(set.map(|_| token))
        }
        .boxed()
    }

    fn renew<'a>(
        &'a self,
        lease: &'a Lease,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<bool, SnapshotError>> {
        async move {
            let key = lease_key(&lease.stream, &lease.resource, lease.slot);
            let held: i64 = self
                .script(&self.lease, &[&key], &[lease.token.clone(), millis(ttl)])
                .await?;
            Ok(held == 1)
        }
        .boxed()
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, ()> {
        async move {
            let key = lease_key(&lease.stream, &lease.resource, lease.slot);
            // Not released (Redis away): it expires.
            let _ = self
                .script::<i64>(&self.lease, &[&key], &[lease.token.clone(), "0".into()])
                .await;
        }
        .boxed()
    }

    fn catalog<'a>(&'a self, table: &'a str) -> BoxFuture<'a, Result<String, SnapshotError>> {
        async move {
            let i = self
                .watch
                .tables
                .iter()
                .position(|t| &*t.name == table)
                .ok_or(SnapshotError::NotWatched)?;
            let shapes = Shapes::new(&self.watch);
            let read = async {
                let mut conn = self.pool.acquire().await?;
                let sql = format!("SELECT {}", Shapes::sql(1, 2));
                let now: Vec<Option<String>> = sqlx::query_scalar(&sql)
                    .bind(shapes.names())
                    .bind(shapes.columns())
                    .fetch_one(&mut *conn)
                    .await?;
                let seen = tracker::tables(&mut conn, &self.watch).await?;
                Ok::<_, sqlx::Error>((now, seen))
            };
            let (now, seen) = tokio::time::timeout(Duration::from_secs(5), read)
                .await
                .map_err(|_| SnapshotError::CatalogTimedOut)?
                .map_err(SnapshotError::Catalog)?;
            let (Some(Some(shape)), Some(seen)) = (now.get(i), seen.get(i)) else {
                return Err(SnapshotError::NoTable);
            };
            Ok(format!(
                "{shape}|{:?}|{:?}|{}",
                seen.oid, seen.partitions, seen.dependency
            ))
        }
        .boxed()
    }

    fn head<'a>(&'a self, stream: &'a str) -> BoxFuture<'a, Result<Mark, SnapshotError>> {
        async move {
            let head: Value = self
                .query(redis::cmd("EVAL").arg(super::HEAD).arg(1).arg(stream))
                .await?;
            let id = text(&head)
                .and_then(|h| EntryId::parse(&h))
                .ok_or_else(|| unexpected("Redis: an unexpected answer for the stream's head"))?;
            Ok(Mark {
                stream: stream.to_string(),
                lsn: id.lsn,
                seq: id.seq,
            })
        }
        .boxed()
    }

    fn continues<'a>(&'a self, at: &'a Mark) -> BoxFuture<'a, Result<bool, SnapshotError>> {
        async move {
            let id = EntryId {
                lsn: at.lsn,
                seq: at.seq,
            };
            let next: Value = self
                .query(
                    redis::cmd("XRANGE")
                        .arg(&at.stream)
                        .arg(format!("({id}"))
                        .arg("+")
                        .arg("COUNT")
                        .arg(1),
                )
                .await?;
            let timeline = self.bus.lock().await.epoch.timeline;
            match items(&next).and_then(|e| e.first()) {
                Some(e) => {
                    let read = parse_entry(e, timeline)
                        .ok_or_else(|| unexpected("Redis: an entry not in the bus's form"))?;
                    Ok(read.prev == id)
                }
                // Nothing after it: it must be the newest position.
                None => {
                    let head: Value = self
                        .query(redis::cmd("EVAL").arg(super::HEAD).arg(1).arg(&at.stream))
                        .await?;
                    Ok(text(&head).and_then(|h| EntryId::parse(&h)) == Some(id))
                }
            }
        }
        .boxed()
    }
}
