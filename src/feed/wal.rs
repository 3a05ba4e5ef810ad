//! The `wal` change feed: logical decoding (`pgoutput`) of the primary's
//! write-ahead log through a replication slot. Writers pay nothing (no
//! trigger, no `NOTIFY`), nobody can forge a change, and a permanent slot
//! resumes where it stopped.
//!
//! # How
//! One dedicated connection per gateway holds the slot: a **temporary** one
//! by default (`pg_create_logical_replication_slot(…, temporary => true)`:
//! Postgres drops it when the connection ends, so a gateway that dies never
//! holds WAL back), or the permanent `database.slot`. The feed reads
//! committed transactions with `pg_logical_slot_peek_binary_changes` every
//! `database.wal_poll_interval` (default 5 ms), decodes them
//! ([`super::pgoutput`]), reduces each row to the watched key columns as
//! canonical text, and sends one [`Event::Commit`] per transaction, in
//! commit order. Only once the applier says it has applied a commit
//! ([`crate::apply::Applied`]) is the slot advanced past it
//! (`pg_replication_slot_advance`): after a crash or reconnect, a permanent
//! slot delivers again whatever was not applied. Logical decoding outputs
//! committed transactions only, so a rolled-back one has no effect.
//!
//! Why SQL polling rather than the streaming replication protocol: sqlx
//! does not speak the protocol (CopyBoth), and every Rust crate that does
//! either is unmaintained, or pulls a C TLS stack, or leaves LSN feedback to
//! the caller; the SQL interface gives the same decoded stream over the
//! pool's TLS and authentication, with the position advanced exactly when
//! the applier is done. The cost: one small query per interval on the
//! primary (it returns at once when there is nothing), and up to one
//! interval of delay.
//!
//! # No gap, in LSNs
//! The slot's consistent point `C` is fixed when the slot is created, and it
//! delivers every transaction that commits after `C`. Start-up creates the
//! slot *before* the first scan takes its snapshot, so a transaction either
//! committed before the snapshot (the scan sees it) or after `C` (the feed
//! delivers it); one that does both is applied twice, which is idempotent.
//! A rebuild opens its journal before it scans, and every commit the feed
//! delivers meanwhile is journaled (see `resource`). A reconnect with a
//! temporary slot loses the slot: the new slot's `C'` may be past commits
//! that were never applied, so the feed sends [`Event::Resync`] and every
//! filter is rebuilt from a snapshot taken after `C'`. A permanent slot
//! resumes at its confirmed position, which is never past what was applied:
//! no rebuild. A permanent slot invalidated by `max_slot_wal_keep_size`
//! (`wal_status = 'lost'`) is dropped, recreated, and answered by a resync.
//!
//! # Visible twice
//! A transaction's commit record can be decoded a moment before the
//! transaction is visible to new snapshots on the primary. A load in that
//! moment could read the old row after the applier invalidated it and cache
//! it. So each commit is delivered at [`Phase::Received`] and again at
//! [`Phase::Visible`] once a snapshot taken by `pg_current_snapshot()` sees
//! its xid as finished (`pg_visible_in_snapshot`: not in the running list
//! *and* below `xmax`, see [`all_visible`]); applying twice is idempotent,
//! and the second application invalidates again.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use sqlx::postgres::{PgConnectOptions, PgConnection};
use sqlx::{Connection, Row};
use tokio::sync::{mpsc, oneshot, watch};

use super::pgoutput::{self, Datum, Message};
use super::{Columns, Commit, Event, Lsn, Op, Phase, Resync, RowChange, Value, Watch};
use crate::db::catalog::canonical_text;

/// How the feed connects and what it reads.
#[derive(Clone, Debug)]
pub struct Options {
    pub connect: PgConnectOptions,
    pub publication: String,
    /// A permanent slot's name, or `None` for a temporary one.
    pub slot: Option<String>,
    pub poll: Duration,
}

/// Counters for metrics and the admin API.
#[derive(Debug, Default)]
pub struct Stats {
    pub commits: AtomicU64,
    pub inserts: AtomicU64,
    pub updates: AtomicU64,
    pub deletes: AtomicU64,
    pub truncates: AtomicU64,
    pub reconnects: AtomicU64,
    pub slot_invalidations: AtomicU64,
    /// The last LSN the slot was advanced to (applied).
    pub applied_lsn: AtomicU64,
    /// Bytes of WAL between the primary's position and the slot's, at the
    /// last poll.
    pub lag_bytes: AtomicU64,
    /// Commit to receipt of the latest transaction, in microseconds.
    pub lag_us: AtomicU64,
}

/// What start-up checks before it chooses this feed; see [`check`].
#[derive(Debug)]
pub struct Readiness {
    pub wal_level: String,
    pub can_replicate: bool,
}

/// `wal_level` and whether the role may use replication slots.
pub async fn readiness(pool: &sqlx::PgPool) -> Result<Readiness, sqlx::Error> {
    let row = sqlx::query(
        "SELECT current_setting('wal_level') AS wal_level,
                (SELECT rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user) AS can",
    )
    .fetch_one(pool)
    .await?;
    Ok(Readiness {
        wal_level: row.get("wal_level"),
        can_replicate: row.get::<Option<bool>, _>("can").unwrap_or(false),
    })
}

/// What the feed needs from the database, each missing piece as an error
/// naming its fix: `wal_level`, the role's `REPLICATION`, the publication
/// covering every watched table, and a replica identity that carries the
/// key on UPDATE and DELETE.
pub async fn check(pool: &sqlx::PgPool, watch: &Watch, publication: &str) -> Result<(), String> {
    let r = readiness(pool).await.map_err(|e| e.to_string())?;
    if r.wal_level != "logical" {
        return Err(format!(
            "database.freshness = \"wal\" needs wal_level = logical (it is {}): set it in postgresql.conf (managed services: rds.logical_replication = 1, cloudsql.logical_decoding = on, Azure wal_level = LOGICAL) and restart, or use freshness = \"notify\"",
            r.wal_level
        ));
    }
    if !r.can_replicate {
        return Err("database.freshness = \"wal\" needs the REPLICATION attribute: ALTER ROLE <gateway role> REPLICATION".into());
    }
    let published: Vec<String> = sqlx::query_scalar(
        "SELECT schemaname || '.' || tablename FROM pg_publication_tables WHERE pubname = $1",
    )
    .bind(publication)
    .fetch_all(pool)
    .await
    .map_err(|e| e.to_string())?;
    let missing: Vec<&str> = watch
        .tables
        .iter()
        .filter(|t| !published.iter().any(|p| p.as_str() == &*t.name))
        .map(|t| &*t.name)
        .collect();
    if !missing.is_empty() {
        return Err(format!(
            "publication {publication:?} does not cover {}: run `bloomgate install-feed` (or set database.install_feed = true)",
            missing.join(", ")
        ));
    }
    for t in &watch.tables {
        let Some(info) = crate::db::catalog::table_info(pool, &t.name)
            .await
            .map_err(|e| e.to_string())?
        else {
            continue;
        };
        for c in &t.columns {
            if !info.replica_identity.carries(&c.name) {
                return Err(format!(
                    "table {} does not carry its old {} on UPDATE and DELETE (replica identity): ALTER TABLE {} REPLICA IDENTITY USING INDEX <a unique index on {}>, or REPLICA IDENTITY FULL",
                    t.name, c.name, t.name, c.name
                ));
            }
        }
    }
    Ok(())
}

/// Creates or updates the publication to cover exactly the watched tables
/// (`bloomgate install-feed`).
pub async fn install(
    pool: &sqlx::PgPool,
    watch: &Watch,
    publication: &str,
) -> Result<(), sqlx::Error> {
    use crate::db::catalog::{quote, quote_table};
    let tables: Vec<String> = watch.tables.iter().map(|t| quote_table(&t.name)).collect();
    let exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)")
            .bind(publication)
            .fetch_one(pool)
            .await?;
    let sql = if exists {
        format!(
            "ALTER PUBLICATION {} SET TABLE {}",
            quote(publication),
            tables.join(", ")
        )
    } else {
        format!(
            "CREATE PUBLICATION {} FOR TABLE {} WITH (publish_via_partition_root = true)",
            quote(publication),
            tables.join(", ")
        )
    };
    sqlx::raw_sql(&sql).execute(pool).await?;
    Ok(())
}

/// A watched table as the feed knows it: its key columns' positions are
/// resolved when its `Relation` message arrives.
struct Rel {
    table: super::TableName,
    /// (column name, type, index in the tuple, in the replica identity)
    columns: Vec<(Arc<str>, super::ColumnType, usize, bool)>,
}

/// Runs until aborted or `tx` closes. `ready` gets `Ok` once the slot
/// exists (before the first scan), or the error that prevents it.
pub async fn run(
    opts: Options,
    watch: Watch,
    tx: mpsc::Sender<Event>,
    mut applied: watch::Receiver<Lsn>,
    stats: Arc<Stats>,
    ready: oneshot::Sender<Result<(), String>>,
) {
    let mut ready = Some(ready);
    let mut delay = Duration::from_millis(100);
    let temp_name = format!(
        "bloomgate_{}_{:x}",
        std::process::id(),
        rand::random::<u32>()
    );
    let mut first = true;
    loop {
        let r = session(
            &opts,
            &watch,
            &tx,
            &mut applied,
            &stats,
            &temp_name,
            first,
            &mut ready,
        )
        .await;
        if tx.is_closed() {
            return;
        }
        if let Err(e) = r {
            tracing::warn!(error = %e, retry_in = ?delay, "WAL change feed failed; reconnecting");
            if let Some(ready) = ready.take() {
                // Start-up waits for the slot: report, then keep trying in
                // the background.
                let _ = ready.send(Err(format!("cannot create the replication slot: {e}")));
                return;
            }
        }
        first = false;
        stats.reconnects.fetch_add(1, Ordering::Relaxed);
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_secs(5));
    }
}

#[allow(clippy::too_many_arguments)]
async fn session(
    opts: &Options,
    watch: &Watch,
    tx: &mpsc::Sender<Event>,
    applied: &mut watch::Receiver<Lsn>,
    stats: &Stats,
    temp_name: &str,
    first: bool,
    ready: &mut Option<oneshot::Sender<Result<(), String>>>,
) -> Result<(), sqlx::Error> {
    // Named, so an operator can tell the feed's backend from the pool's.
    let connect = opts.connect.clone().application_name("bloomgate-wal-feed");
    let mut conn = PgConnection::connect_with(&connect).await?;
    let slot = opts.slot.as_deref().unwrap_or(temp_name);
    let resync = match &opts.slot {
        None => {
            sqlx::query("SELECT pg_create_logical_replication_slot($1, 'pgoutput', true)")
                .bind(slot)
                .execute(&mut conn)
                .await?;
            // A new slot starts at a new consistent point: whatever
            // committed while there was none was never delivered.
            !first
        }
        Some(name) => {
            let status: Option<Option<String>> = sqlx::query_scalar(
                "SELECT wal_status FROM pg_replication_slots WHERE slot_name = $1",
            )
            .bind(name)
            .fetch_optional(&mut conn)
            .await?;
            match status {
                Some(Some(s)) if s == "lost" => {
                    stats.slot_invalidations.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(slot = %name, "replication slot invalidated (max_slot_wal_keep_size): recreating it and rebuilding every filter");
                    sqlx::query("SELECT pg_drop_replication_slot($1)")
                        .bind(name)
                        .execute(&mut conn)
                        .await?;
                    create_permanent(&mut conn, name).await?;
                    true
                }
                Some(_) => false,
                None => {
                    create_permanent(&mut conn, name).await?;
                    // A slot that did not exist: unless this is start-up
                    // (whose scan follows), changes may have been missed.
                    !first
                }
            }
        }
    };
    if let Some(ready) = ready.take() {
        let _ = ready.send(Ok(()));
    }
    if resync
        && tx
            .send(Event::Resync(Resync {
                reason: "WAL feed: new replication slot".into(),
                snapshot: None,
            }))
            .await
            .is_err()
    {
        return Ok(());
    }
    let mut rels: HashMap<u32, Option<Rel>> = HashMap::new();
    let peek = "SELECT lsn::text AS lsn, data FROM pg_logical_slot_peek_binary_changes($1, NULL, 10000, 'proto_version', '1', 'publication_names', $2)";
    loop {
        let rows = sqlx::query(peek)
            .bind(slot)
            .bind(&opts.publication)
            .fetch_all(&mut conn)
            .await?;
        if rows.is_empty() {
            tokio::time::sleep(opts.poll).await;
            continue;
        }
        let mut commits = Vec::new();
        let mut current: Option<(u32, Vec<RowChange>, Vec<super::TableName>)> = None;
        let mut last_lsn = Lsn::ZERO;
        for row in &rows {
            let data: Vec<u8> = row.get("data");
            last_lsn = last_lsn.max(Lsn::parse(row.get::<&str, _>("lsn")).unwrap_or(Lsn::ZERO));
            let msg = match pgoutput::decode(&data) {
                Ok(m) => m,
                Err(e) => {
                    // Nothing sane to apply: rebuild rather than guess.
                    tracing::error!(error = %e, "undecodable WAL message; rebuilding every filter");
                    let _ = tx
                        .send(Event::Resync(Resync {
                            reason: "WAL feed: undecodable message".into(),
                            snapshot: None,
                        }))
                        .await;
                    continue;
                }
            };
            match msg {
                Message::Begin { xid, .. } => current = Some((xid, Vec::new(), Vec::new())),
                Message::Relation(r) => {
                    let table: super::TableName = Arc::from(format!("{}.{}", r.namespace, r.name));
                    let known = watch.tables.iter().find(|t| t.name == table).map(|t| Rel {
                        table: t.name.clone(),
                        columns: t
                            .columns
                            .iter()
                            .filter_map(|c| {
                                let i = r.columns.iter().position(|n| *n == *c.name)?;
                                let identity = r.identity.get(i).copied().unwrap_or(false);
                                Some((c.name.clone(), c.ty, i, identity))
                            })
                            .collect(),
                    });
                    rels.insert(r.id, known);
                }
                Message::Insert { rel, new } => {
                    if let (Some(Some(r)), Some(c)) = (rels.get(&rel), current.as_mut()) {
                        stats.inserts.fetch_add(1, Ordering::Relaxed);
                        c.1.push(RowChange {
                            table: r.table.clone(),
                            op: Op::Insert,
                            new: Some(columns(r, &new, false)),
                            old: None,
                        });
                    }
                }
                Message::Update { rel, old, new } => {
                    if let (Some(Some(r)), Some(c)) = (rels.get(&rel), current.as_mut()) {
                        stats.updates.fetch_add(1, Ordering::Relaxed);
                        c.1.push(RowChange {
                            table: r.table.clone(),
                            op: Op::Update,
                            new: Some(columns(r, &new, false)),
                            // No old tuple: no replica identity column
                            // changed, and every watched column is in the
                            // identity (checked at start-up).
                            old: old.map(|o| columns(r, &o, true)),
                        });
                    }
                }
                Message::Delete { rel, old } => {
                    if let (Some(Some(r)), Some(c)) = (rels.get(&rel), current.as_mut()) {
                        stats.deletes.fetch_add(1, Ordering::Relaxed);
                        c.1.push(RowChange {
                            table: r.table.clone(),
                            op: Op::Delete,
                            new: None,
                            old: Some(columns(r, &old, true)),
                        });
                    }
                }
                Message::Truncate { rels: ids } => {
                    if let Some(c) = current.as_mut() {
                        for id in ids {
                            if let Some(Some(r)) = rels.get(&id) {
                                stats.truncates.fetch_add(1, Ordering::Relaxed);
                                c.2.push(r.table.clone());
                            }
                        }
                    }
                }
                Message::Commit {
                    end_lsn,
                    commit_time,
                    ..
                } => {
                    if let Some((xid, changes, truncated)) = current.take() {
                        let committed_at = pg_time(commit_time);
                        if let Some(at) = committed_at
                            && let Ok(d) = SystemTime::now().duration_since(at)
                        {
                            stats.lag_us.store(d.as_micros() as u64, Ordering::Relaxed);
                        }
                        commits.push(Commit {
                            xid: Some(xid),
                            lsn: Some(Lsn(end_lsn)),
                            committed_at,
                            phase: Phase::Received,
                            changes,
                            truncated,
                        });
                    }
                }
                // Origin, type names, logical messages and unknown types
                // change no row.
                Message::Origin { .. }
                | Message::Type { .. }
                | Message::LogicalMessage { .. }
                | Message::Other(_) => {}
            }
        }
        let upto = commits
            .iter()
            .filter_map(|c| c.lsn)
            .max()
            .unwrap_or(last_lsn)
            .max(last_lsn);
        let xids: Vec<u32> = commits.iter().filter_map(|c| c.xid).collect();
        let mut visible = Vec::with_capacity(commits.len());
        for c in commits {
            stats.commits.fetch_add(1, Ordering::Relaxed);
            visible.push(Commit {
                phase: Phase::Visible,
                ..c.clone()
            });
            if tx.send(Event::Commit(c)).await.is_err() {
                return Ok(());
            }
        }
        if !visible.is_empty() {
            wait_visible(&mut conn, &xids).await?;
            for c in visible {
                if tx.send(Event::Commit(c)).await.is_err() {
                    return Ok(());
                }
            }
            // Advance only past what the applier has applied.
            let target = visible_target(upto);
            let deadline = Instant::now() + Duration::from_secs(30);
            while *applied.borrow() < target && Instant::now() < deadline {
                let _ = tokio::time::timeout(Duration::from_millis(100), applied.changed()).await;
            }
            if *applied.borrow() < target {
                // Still not applied: deliver again from the slot.
                continue;
            }
        }
        // One round trip for the advance and the lag: it is on the path of
        // every batch, so of commit-to-servable of the next one.
        let lag: Option<i64> = sqlx::query_scalar(
            "SELECT (pg_current_wal_lsn() - $2::pg_lsn)::int8
               FROM pg_replication_slot_advance($1, $2::pg_lsn)",
        )
        .bind(slot)
        .bind(upto.to_string())
        .fetch_one(&mut conn)
        .await?;
        stats.applied_lsn.store(upto.0, Ordering::Relaxed);
        if let Some(lag) = lag {
            stats.lag_bytes.store(lag.max(0) as u64, Ordering::Relaxed);
        }
    }
}

/// The LSN the applier must have published before the slot may move: the
/// last commit's end (the applier publishes commit LSNs).
fn visible_target(upto: Lsn) -> Lsn {
    upto
}

async fn create_permanent(conn: &mut PgConnection, name: &str) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT pg_create_logical_replication_slot($1, 'pgoutput', false)")
        .bind(name)
        .execute(conn)
        .await?;
    Ok(())
}

/// Waits (briefly) until no snapshot taken now would see any of `xids` as
/// running.
async fn wait_visible(conn: &mut PgConnection, xids: &[u32]) -> Result<(), sqlx::Error> {
    // Normally microseconds. It can take long when commits wait for a
    // synchronous standby: delivering `Visible` early would reopen the
    // window it closes, so keep waiting, and say so. Past a minute the
    // feed moves on rather than stall every resource (logged as an error).
    let began = Instant::now();
    let mut warned = began;
    loop {
        if all_visible(conn, xids).await? {
            return Ok(());
        }
        if began.elapsed() > Duration::from_secs(60) {
            tracing::error!(
                ?xids,
                "transactions decoded a minute ago are still not visible; delivering them as visible anyway"
            );
            return Ok(());
        }
        if warned.elapsed() > Duration::from_secs(5) {
            tracing::warn!(?xids, waited = ?began.elapsed(), "decoded transactions not yet visible (a synchronous standby?): waiting");
            warned = Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Whether a snapshot taken now on the primary sees every transaction in
/// `xids` (32-bit, as pgoutput sends them) as finished.
///
/// Not "absent from the snapshot's running list": that list (`xip`) holds
/// only xids below the snapshot's `xmax`, and the newest transaction, still
/// running, is at or past it. So each xid is widened to its 64-bit form
/// (the one within 2^31 of `xmax`; a transaction just decoded is far
/// closer) and asked with `pg_visible_in_snapshot`, which applies both
/// rules.
pub async fn all_visible(conn: &mut PgConnection, xids: &[u32]) -> Result<bool, sqlx::Error> {
    if xids.is_empty() {
        return Ok(true);
    }
    let xids: Vec<i64> = xids.iter().map(|x| i64::from(*x)).collect();
    let visible: Option<bool> = sqlx::query_scalar(
        "WITH s AS (SELECT pg_current_snapshot() AS s),
              m AS (SELECT s, pg_snapshot_xmax(s)::text::int8 AS xmax FROM s)
         SELECT bool_and(pg_visible_in_snapshot(
                  (xmax + ((x - xmax % 4294967296 + 2147483648) % 4294967296 + 4294967296)
                          % 4294967296 - 2147483648)::text::xid8,
                  s))
         FROM m, unnest($1::int8[]) AS x",
    )
    .bind(&xids)
    .fetch_one(&mut *conn)
    .await?;
    Ok(visible.unwrap_or(true))
}

/// The watched columns of `tuple`. In an `old` tuple, a column outside the
/// replica identity is not carried (pgoutput sends it as null): it is
/// [`Value::Unknown`], never `Null`, or a deleted row's key would stay in
/// the filter and its cached row be served on.
fn columns(rel: &Rel, tuple: &pgoutput::Tuple, old: bool) -> Columns {
    Columns(
        rel.columns
            .iter()
            .map(|(name, ty, i, identity)| {
                if old && !identity {
                    return (name.clone(), Value::Unknown);
                }
                let v = match tuple.0.get(*i) {
                    Some(Datum::Text(t)) => Value::Text(canonical_text(*ty, t).to_string()),
                    Some(Datum::Null) => Value::Null,
                    Some(Datum::Unchanged) | None => Value::Unknown,
                };
                (name.clone(), v)
            })
            .collect(),
    )
}

/// Postgres' microseconds since 2000-01-01 as a `SystemTime`.
fn pg_time(us: i64) -> Option<SystemTime> {
    const PG_EPOCH: u64 = 946_684_800;
    let since = UNIX_EPOCH + Duration::from_secs(PG_EPOCH);
    if us >= 0 {
        since.checked_add(Duration::from_micros(us as u64))
    } else {
        since.checked_sub(Duration::from_micros(us.unsigned_abs()))
    }
}
