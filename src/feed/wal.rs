//! The `wal` change feed: logical decoding (`pgoutput`) of the primary's
//! write-ahead log through a replication slot. Writers pay nothing (no
//! trigger, no `NOTIFY`), nobody can forge a change, and a permanent slot
//! resumes where it stopped.
//!
//! # How
//! One replication connection per gateway ([`super::replication`], the
//! streaming protocol; polled, an ordinary connection, see "Streamed or
//! polled") holds the slot: a **temporary** one by default
//! (`CREATE_REPLICATION_SLOT … TEMPORARY`: Postgres drops it when the
//! connection ends, so a gateway that dies never holds WAL back), or the
//! permanent `database.slot`. `START_REPLICATION … LOGICAL` streams every
//! committed transaction of the publication's tables as it is decoded;
//! the feed reduces each row to the watched key columns as canonical text
//! and sends one [`Event::Commit`] per transaction, in commit order, as
//! soon as it arrives. The `Visible` delivery (below) and the
//! acknowledgement follow for all commits received meanwhile at most every
//! [`VISIBLE_EVERY`] (5 ms): with one snapshot query per commit, at
//! thousands of commits a second and one feed per gateway, the writers lost
//! about 40 % of their TPS on the 2-core test box, against 28 % with the
//! batching (bench/writer-cost.sh, one run each; BENCHMARKS.md has what
//! the rest is). A second, ordinary connection
//! does the slot bookkeeping of a permanent slot and the visibility checks
//! (a walsender runs no SQL while it streams).
//!
//! # Streamed or polled
//! Streaming wakes the slot's walsender at every commit, in the writers'
//! commit path, and on a primary without a spare core the walsenders'
//! decoding and wake-ups come out of the writers' TPS (16–28 % on the
//! 2-core test box with two gateways, BENCHMARKS.md). `database.wal_poll_interval` makes
//! the feed poll instead ([`poll_session`]): one ordinary connection holds
//! the slot and, once per interval, asks it with
//! `pg_logical_slot_peek_binary_changes` for every transaction committed
//! since, decoded in one go (protocol 1: whole transactions, no
//! streaming). The polls take about as much of the primary's CPU as the
//! walsenders do, but in a few bursts instead of a wake-up per commit:
//! writers lost −2 to 23 % that way against 16 to 24 % streamed
//! (BENCHMARKS.md; where writers fill every core, the decoding's CPU
//! comes out of their TPS in either mode). Commit-to-servable grows by about one interval. The price
//! beyond latency: each poll decodes from the slot's `restart_lsn`, and so
//! does the slot advance after it (the server decodes the range twice);
//! a long-running transaction holds `restart_lsn` back, so polls cost
//! more while one is open. The connection holding the slot is an ordinary
//! backend, which `wal_sender_timeout` does not cover: it gets TCP
//! keepalives instead (`feed_connect`), and a poll or advance that takes
//! ten silence limits (300 s) is given up. Everything else (the slot, `No
//! gap`, `Visible twice`, what is confirmed when) is the same.
//!
//! # Acknowledgement
//! The standby status update's flush position is what the server keeps the
//! slot's WAL for and resumes a permanent slot from, so the feed reports
//! only what the applier has applied ([`crate::apply::Applied`]): the end
//! of the last applied commit, or a keepalive's position received while no
//! transaction was open (everything before it was sent, and applied).
//! Never a keepalive's position while a whole transaction is half read: it
//! can be past that transaction's commit. Reported when it moves, when the
//! server asks, and every second while the feed waits or the stream is
//! quiet; after 10 s of silence the feed asks the server for a sign of life
//! and after 30 s it reconnects. Logical decoding outputs committed
//! transactions only, so a rolled-back one has no effect.
//!
//! # What cannot be carried
//! A message that does not decode, or a transaction with more watched
//! changes than [`MAX_ITEMS`] (or more key bytes than [`MAX_BYTES`]),
//! loses changes: the feed rebuilds every
//! filter (or rescans the tables it touched) once that transaction has
//! committed *and is visible*, so the rebuild's snapshot contains it.
//!
//! Why a hand-written client rather than a crate: sqlx does not speak the
//! protocol (`CopyBoth`). `pg_walstream` (0.1 to 0.9 within a year) builds
//! on libpq (`libpq-sys`/`pq-sys`) or, by default, on rustls with aws-lc-rs,
//! a C toolchain in every build; `pgwire-replication` (0.1 to 0.3, one
//! maintainer, extracted from a CDC project) defaults to rustls with ring
//! and owns the feedback loop. What the feed needs is small (start-up,
//! four authentication methods, two commands, three frame types), adds no
//! crate the build did not already compile for sqlx (hmac, sha2, md-5,
//! base64, stringprep), and is tested against a real server
//! (tests/wal_events.rs) and against RFC 7677's SCRAM example. Before
//! this client the feed polled `pg_logical_slot_peek_binary_changes`
//! through sqlx: every poll decoded the WAL again from the slot's position,
//! and commit-to-servable paid up to one poll interval (BENCHMARKS.md).
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
//! and the second application invalidates again. The price: what a load
//! cached between the two (a row, or "absent" for a just-deleted key) is
//! dropped once more and loaded again by the next request.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use sqlx::postgres::{PgConnectOptions, PgConnection};
use sqlx::{Connection, Row};
use tokio::sync::{mpsc, oneshot, watch};

use super::pgoutput::{self, Datum, Message};
use super::replication::{self, Endpoint, Frame, ReplError, Stream};
use super::{Columns, Commit, Event, Lsn, Op, Phase, Resync, RowChange, Value, Watch};
use crate::db::catalog::canonical_text;

/// How the feed connects and what it reads.
#[derive(Clone)]
pub struct Options {
    pub connect: PgConnectOptions,
    pub publication: String,
    /// A permanent slot's name, or `None` for a temporary one.
    pub slot: Option<String>,
    /// The password for the replication connection (sqlx keeps the pool's
    /// to itself); see [`Endpoint::new`].
    pub password: Option<String>,
    /// `None`: stream. `Some(every)`: poll the slot at this interval
    /// instead (see "Streamed or polled").
    pub poll: Option<Duration>,
    /// A stream silent this long is given up for dead, and reconnected;
    /// the server is asked for a sign of life after a third of it.
    /// [`SILENCE_LIMIT`] unless a test wants it shorter.
    pub silence_limit: Duration,
}

impl std::fmt::Debug for Options {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the password.
        f.debug_struct("Options")
            .field("publication", &self.publication)
            .field("slot", &self.slot)
            .field("poll", &self.poll)
            .field("silence_limit", &self.silence_limit)
            .finish_non_exhaustive()
    }
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
    /// Bytes of WAL between the server's end of WAL (as its last frame
    /// said) and the position the feed has acknowledged.
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
    // Checked and created under the install lock: two gateways starting
    // together would both find no publication and one CREATE would fail.
    let mut tx = pool.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(crate::db::INSTALL_LOCK_KEY)
        .execute(&mut *tx)
        .await?;
    let exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)")
            .bind(publication)
            .fetch_one(&mut *tx)
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
    sqlx::query(&sql).execute(&mut *tx).await?;
    tx.commit().await?;
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
    let mut first = true;
    loop {
        // A new temporary slot name for every session: the server may not
        // yet know that the last connection is gone (a hung or cut-off
        // peer: a walsender notices after `wal_sender_timeout`, a polling
        // backend through the TCP keepalives of `feed_connect`), and its
        // backend keeps the old slot until then; that slot goes with it.
        let temp_name = format!(
            "bloomgate_{}_{:x}",
            std::process::id(),
            rand::random::<u32>()
        );
        let cx = Ctx {
            opts: &opts,
            watch: &watch,
            tx: &tx,
            stats: &stats,
        };
        let r = match opts.poll {
            None => session(cx, &mut applied, &temp_name, first, &mut ready).await,
            Some(_) => poll_session(cx, &mut applied, &temp_name, first, &mut ready).await,
        };
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

/// What every session of one feed reads.
#[derive(Clone, Copy)]
struct Ctx<'a> {
    opts: &'a Options,
    watch: &'a Watch,
    tx: &'a mpsc::Sender<Event>,
    stats: &'a Stats,
}

/// What ends a session: the database refused or went away.
#[derive(Debug)]
enum SessionError {
    Sql(sqlx::Error),
    Repl(ReplError),
}

impl std::fmt::Display for SessionError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SessionError::Sql(e) => e.fmt(f),
            SessionError::Repl(e) => e.fmt(f),
        }
    }
}

impl From<sqlx::Error> for SessionError {
    fn from(e: sqlx::Error) -> Self {
        SessionError::Sql(e)
    }
}

impl From<ReplError> for SessionError {
    fn from(e: ReplError) -> Self {
        SessionError::Repl(e)
    }
}

/// How often the feed tells the server its position when nothing else
/// made it (well inside `wal_sender_timeout`, 60 s by default).
const STATUS_EVERY: Duration = Duration::from_secs(1);

/// Frames taken into one batch at most: one visibility check and one
/// acknowledgement cover them all.
const BATCH_FRAMES: usize = 10_000;

/// Commits are delivered at `Received` as they arrive, and checked for
/// visibility (one query for all of them), delivered at `Visible` and
/// acknowledged at most this often: a query per commit would cost the
/// primary more than the writes it follows.
const VISIBLE_EVERY: Duration = Duration::from_millis(5);

/// Silent this long, the replication connection is given up for dead (a
/// crashed host, a failover, a cut network: TCP alone could take many
/// minutes to say so); the server is asked for a sign of life after a
/// third of it. The default of [`Options::silence_limit`].
pub const SILENCE_LIMIT: Duration = Duration::from_secs(30);

/// Connecting and authenticating the replication connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

async fn session(
    cx: Ctx<'_>,
    applied: &mut watch::Receiver<Lsn>,
    temp_name: &str,
    first: bool,
    ready: &mut Option<oneshot::Sender<Result<(), String>>>,
) -> Result<(), SessionError> {
    let Ctx {
        opts,
        watch,
        tx,
        stats,
    } = cx;
    // Named, so an operator can tell the feed's backends from the pool's.
    let connect = feed_connect(opts);
    // For slot bookkeeping and the visibility checks: a walsender runs no
    // SQL once it streams.
    let mut conn = side_connection(&connect).await?;
    let endpoint = Endpoint::new(&opts.connect, opts.password.clone(), "bloomgate-wal-feed");
    // TLS as the pool has it: the same options.
    let tls = crate::db::tls::Tls::from_options(&opts.connect);
    let mut repl = tokio::time::timeout(
        CONNECT_TIMEOUT,
        replication::Connection::connect_with(&endpoint, &tls),
    )
    .await
    .map_err(|_| ReplError::Io(std::io::ErrorKind::TimedOut.into()))??;
    let slot = opts.slot.as_deref().unwrap_or(temp_name);
    let resync = match &opts.slot {
        None => {
            // On the replication connection: it lives as long as it does.
            repl.create_slot(slot, true).await?;
            // A new slot starts at a new consistent point: whatever
            // committed while there was none was never delivered.
            !first
        }
        Some(name) => permanent_slot(&mut conn, name, stats, first, opts.silence_limit).await?,
    };
    if !slot_ready(ready, resync, tx).await {
        return Ok(());
    }
    // Protocol 2 (Postgres 14+) with streaming: a large transaction comes
    // in blocks while it runs instead of spilling to disk on the server
    // until it commits.
    let version: i32 = bounded(
        opts.silence_limit,
        sqlx::query_scalar("SELECT current_setting('server_version_num')::int")
            .fetch_one(&mut conn),
    )
    .await?;
    let publications = replication::quote_ident(&opts.publication);
    let mut options = vec![("publication_names", publications.as_str())];
    if version >= 140_000 {
        options.extend([("proto_version", "2"), ("streaming", "on")]);
    } else {
        options.push(("proto_version", "1"));
    }
    // Lsn::ZERO: from the slot's confirmed position.
    let mut stream = repl.start(slot, Lsn::ZERO, &options).await?;
    let mut asm = Assembler::new(watch, stats);
    // Received up to (reported as written), and applied up to (reported
    // as flushed: the slot's confirmed position).
    let mut received = Lsn::ZERO;
    let mut confirmed = Lsn::ZERO;
    // The end of what the server has sent, from a keepalive received with
    // no whole transaction half read: nothing before it is still to come.
    let mut idle_upto: Option<Lsn> = None;
    // Delivered at `Received`, waiting for their `Visible` delivery.
    let mut pending = Pending::default();
    // As if checked long ago: the first commit is checked at once.
    let mut checked = Instant::now()
        .checked_sub(VISIBLE_EVERY)
        .unwrap_or_else(Instant::now);
    let mut heard = Instant::now();
    loop {
        let wait = if pending.commits.is_empty() {
            STATUS_EVERY
        } else {
            VISIBLE_EVERY.saturating_sub(checked.elapsed())
        };
        // The server asked for a status; we ask it for a sign of life.
        let mut reply = false;
        let mut ask = false;
        match tokio::time::timeout(wait, stream.recv()).await {
            Ok(first) => {
                heard = Instant::now();
                let mut next = Some(first?);
                let mut taken = 0;
                while let Some(frame) = next.take() {
                    match frame {
                        Frame::XLogData {
                            start,
                            wal_end,
                            data,
                        } => {
                            received = received.max(start);
                            stats
                                .lag_bytes
                                .store(wal_end.0.saturating_sub(confirmed.0), Ordering::Relaxed);
                            match pgoutput::decode_in(&data, asm.in_block()) {
                                Ok((sub, msg)) => {
                                    if let Some(done) = asm.push(sub, msg) {
                                        stats.commits.fetch_add(1, Ordering::Relaxed);
                                        let commit = pending.add(done);
                                        if tx.send(Event::Commit(commit)).await.is_err() {
                                            return Ok(());
                                        }
                                    }
                                }
                                Err(e) => {
                                    // Nothing sane to apply. Its transaction
                                    // may not be committed yet, and a rebuild
                                    // now would not see its rows: rebuild
                                    // once it is (see below).
                                    tracing::error!(error = %e, "undecodable WAL message; every filter is rebuilt after its transaction");
                                    asm.poison();
                                }
                            }
                        }
                        Frame::Keepalive {
                            wal_end,
                            reply_requested,
                        } => {
                            reply |= reply_requested;
                            if !asm.in_transaction() {
                                idle_upto = Some(wal_end);
                            }
                            received = received.max(wal_end);
                            stats
                                .lag_bytes
                                .store(wal_end.0.saturating_sub(confirmed.0), Ordering::Relaxed);
                        }
                        Frame::End => {
                            return Err(
                                ReplError::Protocol("the server ended the stream".into()).into()
                            );
                        }
                    }
                    taken += 1;
                    if taken < BATCH_FRAMES {
                        stream.fill()?;
                        next = stream.try_recv()?;
                    }
                }
                pending.resync |= std::mem::take(&mut asm.stray_error);
            }
            Err(_) if pending.commits.is_empty() => {
                // Quiet. We report every second, so the server never asks
                // us anything: ask it, and give up on a peer that is gone
                // (a crashed host, a failover) instead of waiting for TCP.
                let silent = heard.elapsed();
                if silent >= opts.silence_limit {
                    return Err(ReplError::Protocol(format!(
                        "no word from the server for {}s",
                        silent.as_secs()
                    ))
                    .into());
                }
                ask = silent >= opts.silence_limit / 3;
            }
            // Time for the visibility check.
            Err(_) => {}
        }
        let mut upto = None;
        if checked.elapsed() >= VISIBLE_EVERY || pending.commits.is_empty() {
            // Only a check restarts the clock: a commit after a quiet spell
            // is checked at once (its stale window is one round trip), the
            // rest at most every VISIBLE_EVERY.
            if !pending.commits.is_empty() {
                checked = Instant::now();
                upto = pending.last;
            }
            let p = std::mem::take(&mut pending);
            let last = p.last;
            if !p.commits.is_empty() {
                let xids: Vec<u32> = p.commits.iter().filter_map(|c| c.xid).collect();
                if let Err(e) = wait_visible(
                    &mut conn,
                    &xids,
                    opts.silence_limit,
                    Some((&mut stream, received, confirmed)),
                )
                .await
                {
                    // The side connection may have been closed while idle
                    // (idle_session_timeout, a proxy): one new one, rather
                    // than a new slot and a rebuild of everything.
                    let SessionError::Sql(e) = e else {
                        return Err(e);
                    };
                    tracing::warn!(error = %e, "WAL feed: visibility check failed; reconnecting its side connection");
                    conn = side_connection(&connect).await?;
                    wait_visible(
                        &mut conn,
                        &xids,
                        opts.silence_limit,
                        Some((&mut stream, received, confirmed)),
                    )
                    .await?;
                }
            }
            if !deliver_visible(p, tx).await {
                return Ok(());
            }
            // Confirm only what the applier has applied. It is in this
            // process and applies in order, so this is a short wait; the
            // server hears from us meanwhile.
            if let Some(target) = last {
                while *applied.borrow() < target {
                    match tokio::time::timeout(STATUS_EVERY, applied.changed()).await {
                        Ok(Ok(())) => {}
                        // The applier is gone: the gateway is stopping.
                        Ok(Err(_)) => return Ok(()),
                        Err(_) => stream.send_status(received, confirmed, false).await?,
                    }
                }
            }
            // Everything received is applied and visible now: a keepalive
            // position received meanwhile is safe to confirm too.
            upto = upto.max(idle_upto);
        }
        let moved = upto.is_some_and(|u| u > confirmed);
        if let Some(u) = upto {
            confirmed = confirmed.max(u);
            received = received.max(confirmed);
        }
        if moved || reply || ask || heard.elapsed() >= STATUS_EVERY {
            stream.send_status(received, confirmed, ask).await?;
            stats.applied_lsn.store(confirmed.0, Ordering::Relaxed);
        }
    }
}

/// Changes one poll asks for at most: decoding stops at the first commit
/// past this many rows, so a batch holds whole transactions.
const POLL_CHANGES: i32 = 10_000;

/// A poll (or a slot advance, which decodes the same range again) that
/// takes longer than this many silence limits (300 s by default) is
/// taken for a dead connection. Generous: a poll after a long pause, or
/// with a long transaction open, decodes everything written since.
const POLL_TIMEOUT_LIMITS: u32 = 10;

/// The polled session (`database.wal_poll_interval`; see "Streamed or
/// polled"): one ordinary connection holds the slot and asks it, once per
/// interval, for the transactions that committed before the server's flush
/// position at that moment (`upto`).
///
/// The slot's confirmed position moves only past what was applied, as
/// when streaming: to the last delivered commit's end once the applier has
/// applied it, or to `upto` when the poll returned every transaction
/// committed before it (fewer rows than [`POLL_CHANGES`]). Decoding with
/// `upto_lsn` stops before the first record that starts at or past `upto`,
/// and the server skips, on the next poll, only transactions whose commit
/// record starts before the confirmed position: so nothing between the two
/// polls is skipped, and a quiet publication does not hold WAL back.
async fn poll_session(
    cx: Ctx<'_>,
    applied: &mut watch::Receiver<Lsn>,
    temp_name: &str,
    first: bool,
    ready: &mut Option<oneshot::Sender<Result<(), String>>>,
) -> Result<(), SessionError> {
    let Ctx {
        opts,
        watch,
        tx,
        stats,
    } = cx;
    use futures_util::TryStreamExt;
    let every = opts.poll.unwrap_or(VISIBLE_EVERY);
    let poll_timeout = opts.silence_limit * POLL_TIMEOUT_LIMITS;
    let connect = feed_connect(opts);
    let mut conn = side_connection(&connect).await?;
    let slot = opts.slot.as_deref().unwrap_or(temp_name);
    let resync = match &opts.slot {
        None => {
            // Temporary: dropped when this connection ends.
            sqlx::query("SELECT pg_create_logical_replication_slot($1, 'pgoutput', true)")
                .bind(slot)
                .execute(&mut conn)
                .await?;
            !first
        }
        Some(name) => permanent_slot(&mut conn, name, stats, first, opts.silence_limit).await?,
    };
    if !slot_ready(ready, resync, tx).await {
        return Ok(());
    }
    let publications = replication::quote_ident(&opts.publication);
    // Protocol 1: the SQL interface returns whole transactions only.
    let peek = "SELECT w.upto::text AS upto, c.lsn::text AS lsn, c.data
                  FROM (SELECT pg_current_wal_flush_lsn() AS upto) w
                  LEFT JOIN LATERAL pg_logical_slot_peek_binary_changes(
                      $1, w.upto, $3, 'proto_version', '1', 'publication_names', $2) c ON true";
    let mut asm = Assembler::new(watch, stats);
    let mut confirmed = Lsn::ZERO;
    loop {
        let began = Instant::now();
        let mut pending = Pending::default();
        let mut upto = Lsn::ZERO;
        let mut rows_seen = 0usize;
        let poll = async {
            let mut rows = sqlx::query(peek)
                .bind(slot)
                .bind(&publications)
                .bind(POLL_CHANGES)
                .fetch(&mut conn);
            while let Some(row) = rows.try_next().await? {
                upto = Lsn::parse(row.try_get("upto")?).unwrap_or(Lsn::ZERO);
                let Some(data) = row.try_get::<Option<&[u8]>, _>("data")? else {
                    continue;
                };
                rows_seen += 1;
                match pgoutput::decode_in(data, false) {
                    Ok((sub, msg)) => {
                        if let Some(done) = asm.push(sub, msg) {
                            stats.commits.fetch_add(1, Ordering::Relaxed);
                            let commit = pending.add(done);
                            if tx.send(Event::Commit(commit)).await.is_err() {
                                return Ok::<bool, sqlx::Error>(false);
                            }
                        }
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "undecodable WAL message; every filter is rebuilt after its transaction");
                        asm.poison();
                    }
                }
            }
            Ok(true)
        };
        match tokio::time::timeout(poll_timeout, poll).await {
            Ok(Ok(true)) => {}
            Ok(Ok(false)) => return Ok(()),
            Ok(Err(e)) => return Err(e.into()),
            Err(_) => {
                return Err(ReplError::Protocol(format!(
                    "a poll of the slot took over {}s",
                    poll_timeout.as_secs()
                ))
                .into());
            }
        }
        pending.resync |= std::mem::take(&mut asm.stray_error);
        let last = pending.last;
        if !pending.commits.is_empty() {
            let xids: Vec<u32> = pending.commits.iter().filter_map(|c| c.xid).collect();
            wait_visible(&mut conn, &xids, opts.silence_limit, None).await?;
        }
        if !deliver_visible(pending, tx).await {
            return Ok(());
        }
        if let Some(target) = last {
            while *applied.borrow() < target {
                if applied.changed().await.is_err() {
                    // The applier is gone: the gateway is stopping.
                    return Ok(());
                }
            }
        }
        let whole = rows_seen < POLL_CHANGES as usize;
        let target = if whole { last.max(Some(upto)) } else { last };
        if let Some(target) = target.filter(|t| *t > confirmed) {
            // The advance and the lag in one round trip.
            let lag: Option<i64> = bounded(
                poll_timeout,
                sqlx::query_scalar(
                    "SELECT (pg_current_wal_lsn() - $2::pg_lsn)::int8
                       FROM pg_replication_slot_advance($1, $2::pg_lsn)",
                )
                .bind(slot)
                .bind(target.to_string())
                .fetch_one(&mut conn),
            )
            .await?;
            confirmed = target;
            stats.applied_lsn.store(confirmed.0, Ordering::Relaxed);
            if let Some(lag) = lag {
                stats.lag_bytes.store(lag.max(0) as u64, Ordering::Relaxed);
            }
        }
        if whole {
            tokio::time::sleep(every.saturating_sub(began.elapsed())).await;
        }
    }
}

/// Commits delivered at `Received` and not yet at `Visible`, and what
/// they could not carry.
#[derive(Default)]
struct Pending {
    /// Copies for the `Visible` delivery.
    commits: Vec<Commit>,
    /// The last one's end: confirmed once they are visible and applied.
    last: Option<Lsn>,
    resync: bool,
    rescan: Vec<super::TableName>,
}

impl Pending {
    /// Takes a completed transaction; returns its `Received` delivery.
    fn add(&mut self, done: Done) -> Commit {
        self.resync |= done.resync;
        for t in done.rescan {
            if !self.rescan.contains(&t) {
                self.rescan.push(t);
            }
        }
        self.last = self.last.max(done.commit.lsn);
        self.commits.push(done.commit.clone());
        done.commit
    }
}

/// Changes one transaction may hold in memory until its commit, and the
/// bytes they may take (keys can be long text); past either its changes
/// are dropped and the tables it touched rescanned after it commits (a
/// rebuild sees every row it wrote).
const MAX_ITEMS: usize = 1_000_000;
const MAX_BYTES: usize = 256 << 20;

/// Turns decoded pgoutput messages into commits of watched changes. The
/// server sends a transaction either whole at its commit (Begin … Commit),
/// in commit order, or, with protocol 2's streaming, a large one in blocks
/// while it runs (Stream Start … Stop, any number, interleaved with whole
/// transactions) and then Stream Commit or Stream Abort. Nothing is
/// delivered before its commit, so an aborted transaction, or an aborted
/// subtransaction of a streamed one, has no effect.
///
/// Guarantees (tested below): every watched change of a committed
/// transaction is either in its [`Done::commit`] or covered by a rescan
/// ([`Done::rescan`], [`Done::resync`]) requested once the commit is
/// visible; memory per transaction is bounded by `max_items` changes and
/// about `max_bytes` (each change counted as its key text plus a fixed
/// overhead, when it arrives).
struct Assembler<'a> {
    watch: &'a Watch,
    stats: &'a Stats,
    rels: HashMap<u32, Option<Rel>>,
    /// The whole transaction being received.
    current: Option<(u32, Txn)>,
    /// Streamed transactions not yet committed or aborted.
    streams: HashMap<u32, Txn>,
    /// Inside a Stream Start … Stop block: the transaction's xid.
    block: Option<u32>,
    /// A message that could not be decoded arrived outside any
    /// transaction: every filter is rebuilt at the end of the batch.
    stray_error: bool,
    max_items: usize,
    max_bytes: usize,
}

/// One transaction's watched changes until its commit.
#[derive(Default)]
struct Txn {
    /// Each with the (sub)transaction it belongs to.
    items: Vec<(u32, Item)>,
    /// What `items` took when they arrived (see [`Item::size`]).
    bytes: usize,
    /// Past `max_items` or `max_bytes`: only the tables touched (the items
    /// are dropped).
    overflow: Option<Vec<super::TableName>>,
    /// One of its messages could not be decoded.
    broken: bool,
}

/// One watched change of a transaction, in order.
enum Item {
    Row(RowChange),
    Truncated(super::TableName),
}

impl Item {
    /// Its memory, roughly: the key text it holds plus a fixed overhead
    /// for the row change, each column and the vectors holding them.
    fn size(&self) -> usize {
        let columns = |c: &Option<Columns>| {
            c.as_ref().map_or(0, |c| {
                c.0.iter()
                    .map(|(_, v)| match v {
                        Value::Text(t) => 48 + t.len(),
                        Value::Null | Value::Unknown => 48,
                    })
                    .sum()
            })
        };
        match self {
            Item::Row(r) => 96 + columns(&r.new) + columns(&r.old),
            Item::Truncated(_) => 96,
        }
    }

    fn table(&self) -> &super::TableName {
        match self {
            Item::Row(r) => &r.table,
            Item::Truncated(t) => t,
        }
    }
}

/// A committed transaction, and what must be rescanned once it is visible.
struct Done {
    commit: Commit,
    /// Tables whose changes were too many to hold.
    rescan: Vec<super::TableName>,
    /// A change of it could not be decoded: rebuild every filter.
    resync: bool,
}

impl<'a> Assembler<'a> {
    fn new(watch: &'a Watch, stats: &'a Stats) -> Self {
        Self {
            watch,
            stats,
            rels: HashMap::new(),
            current: None,
            streams: HashMap::new(),
            block: None,
            stray_error: false,
            max_items: MAX_ITEMS,
            max_bytes: MAX_BYTES,
        }
    }

    /// Whether a whole transaction is half received: its commit has been
    /// decoded already, so a position the server reports now may be past
    /// it, and no position to acknowledge. (An open *streamed*
    /// transaction is not: it has not committed, so its commit lies after
    /// anything the server has sent, and after a reconnect the server
    /// streams it again from the start.)
    fn in_transaction(&self) -> bool {
        self.current.is_some()
    }

    /// Whether the next message is inside a streamed block (see
    /// [`pgoutput::decode_in`]).
    fn in_block(&self) -> bool {
        self.block.is_some()
    }

    /// A message could not be decoded: whatever it was is lost.
    fn poison(&mut self) {
        match (self.block, self.current.as_mut()) {
            (Some(xid), _) => self.streams.entry(xid).or_default().broken = true,
            (None, Some((_, txn))) => txn.broken = true,
            (None, None) => self.stray_error = true,
        }
    }

    fn record(&mut self, sub: Option<u32>, item: Item) {
        let (txn, sub) = match self.block {
            Some(xid) => (self.streams.entry(xid).or_default(), sub.unwrap_or(xid)),
            None => match self.current.as_mut() {
                Some((xid, txn)) => (txn, *xid),
                None => return,
            },
        };
        if let Some(tables) = txn.overflow.as_mut() {
            if !tables.contains(item.table()) {
                tables.push(item.table().clone());
            }
            return;
        }
        let size = item.size();
        if txn.items.len() >= self.max_items || txn.bytes + size > self.max_bytes {
            let mut tables: Vec<super::TableName> = Vec::new();
            for t in txn
                .items
                .iter()
                .map(|(_, i)| i.table())
                .chain([item.table()])
            {
                if !tables.contains(t) {
                    tables.push(t.clone());
                }
            }
            tracing::warn!(
                changes = txn.items.len(),
                bytes = txn.bytes,
                "a transaction changed more watched rows (or key bytes) than the feed holds; its tables are rescanned once it commits"
            );
            txn.items = Vec::new();
            txn.bytes = 0;
            txn.overflow = Some(tables);
            return;
        }
        txn.bytes += size;
        txn.items.push((sub, item));
    }

    fn done(&self, xid: u32, end_lsn: u64, commit_time: i64, txn: Txn) -> Done {
        let committed_at = pg_time(commit_time);
        if let Some(at) = committed_at
            && let Ok(d) = SystemTime::now().duration_since(at)
        {
            self.stats
                .lag_us
                .store(d.as_micros() as u64, Ordering::Relaxed);
        }
        let mut changes = Vec::new();
        let mut truncated = Vec::new();
        for (_, item) in txn.items {
            match item {
                Item::Row(r) => changes.push(r),
                Item::Truncated(t) => truncated.push(t),
            }
        }
        Done {
            commit: Commit {
                xid: Some(xid),
                lsn: Some(Lsn(end_lsn)),
                committed_at,
                phase: Phase::Received,
                changes,
                truncated,
            },
            rescan: txn.overflow.unwrap_or_default(),
            resync: txn.broken,
        }
    }

    /// Takes one message (`sub`: the xid a streamed message carries);
    /// returns the transaction it completes, if any.
    fn push(&mut self, sub: Option<u32>, msg: Message) -> Option<Done> {
        let stats = self.stats;
        match msg {
            Message::Begin { xid, .. } => self.current = Some((xid, Txn::default())),
            Message::Relation(r) => {
                let table: super::TableName = Arc::from(format!("{}.{}", r.namespace, r.name));
                let known = self
                    .watch
                    .tables
                    .iter()
                    .find(|t| t.name == table)
                    .map(|t| Rel {
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
                self.rels.insert(r.id, known);
            }
            Message::Insert { rel, new } => {
                if let Some(Some(r)) = self.rels.get(&rel) {
                    stats.inserts.fetch_add(1, Ordering::Relaxed);
                    let change = RowChange {
                        table: r.table.clone(),
                        op: Op::Insert,
                        new: Some(columns(r, &new, false)),
                        old: None,
                    };
                    self.record(sub, Item::Row(change));
                }
            }
            Message::Update { rel, old, new } => {
                if let Some(Some(r)) = self.rels.get(&rel) {
                    stats.updates.fetch_add(1, Ordering::Relaxed);
                    let change = RowChange {
                        table: r.table.clone(),
                        op: Op::Update,
                        new: Some(columns(r, &new, false)),
                        // No old tuple: no replica identity column
                        // changed, and every watched column is in the
                        // identity (checked at start-up).
                        old: old.map(|o| columns(r, &o, true)),
                    };
                    self.record(sub, Item::Row(change));
                }
            }
            Message::Delete { rel, old } => {
                if let Some(Some(r)) = self.rels.get(&rel) {
                    stats.deletes.fetch_add(1, Ordering::Relaxed);
                    let change = RowChange {
                        table: r.table.clone(),
                        op: Op::Delete,
                        new: None,
                        old: Some(columns(r, &old, true)),
                    };
                    self.record(sub, Item::Row(change));
                }
            }
            Message::Truncate { rels: ids } => {
                for id in ids {
                    if let Some(Some(r)) = self.rels.get(&id) {
                        stats.truncates.fetch_add(1, Ordering::Relaxed);
                        let table = r.table.clone();
                        self.record(sub, Item::Truncated(table));
                    }
                }
            }
            Message::Commit {
                end_lsn,
                commit_time,
                ..
            } => {
                let (xid, txn) = self.current.take()?;
                return Some(self.done(xid, end_lsn, commit_time, txn));
            }
            Message::StreamStart { xid, .. } => {
                self.streams.entry(xid).or_default();
                self.block = Some(xid);
            }
            Message::StreamStop => self.block = None,
            Message::StreamCommit {
                xid,
                end_lsn,
                commit_time,
                ..
            } => {
                let txn = self.streams.remove(&xid)?;
                return Some(self.done(xid, end_lsn, commit_time, txn));
            }
            Message::StreamAbort { xid, subxid } => {
                if xid == subxid {
                    self.streams.remove(&xid);
                } else if let Some(txn) = self.streams.get_mut(&xid) {
                    // An overflowed transaction keeps its tables: a rescan
                    // too many is harmless.
                    txn.items.retain(|(sub, _)| *sub != subxid);
                }
            }
            // Origin, type names, logical messages and unknown types
            // change no row.
            Message::Origin { .. }
            | Message::Type { .. }
            | Message::LogicalMessage { .. }
            | Message::Other(_) => {}
        }
        None
    }
}

/// The feed's ordinary connections: named, so an operator can tell them
/// from the pool's, and with TCP keepalives on the server's side, so that
/// a connection whose gateway vanished (a crashed host, a cut network) is
/// closed within about half a minute. That matters when polled: the
/// connection then holds the slot, and no `wal_sender_timeout` applies
/// to an ordinary backend; the system default would be two hours.
fn feed_connect(opts: &Options) -> PgConnectOptions {
    opts.connect
        .clone()
        .application_name("bloomgate-wal-feed")
        .options([
            ("tcp_keepalives_idle", "10"),
            ("tcp_keepalives_interval", "5"),
            ("tcp_keepalives_count", "3"),
        ])
}

async fn side_connection(connect: &PgConnectOptions) -> Result<PgConnection, SessionError> {
    tokio::time::timeout(CONNECT_TIMEOUT, PgConnection::connect_with(connect))
        .await
        .map_err(|_| SessionError::Sql(sqlx::Error::PoolTimedOut))?
        .map_err(SessionError::Sql)
}

/// Opens the permanent slot `name`, creating it if it does not exist and
/// recreating it if `max_slot_wal_keep_size` invalidated it, within
/// `limit` (a hung connection); returns whether changes may have been
/// missed (every filter must be rebuilt).
async fn permanent_slot(
    conn: &mut PgConnection,
    name: &str,
    stats: &Stats,
    first: bool,
    limit: Duration,
) -> Result<bool, sqlx::Error> {
    bounded(limit, open_permanent(conn, name, stats, first)).await
}

async fn open_permanent(
    conn: &mut PgConnection,
    name: &str,
    stats: &Stats,
    first: bool,
) -> Result<bool, sqlx::Error> {
    let status: Option<Option<String>> =
        sqlx::query_scalar("SELECT wal_status FROM pg_replication_slots WHERE slot_name = $1")
            .bind(name)
            .fetch_optional(&mut *conn)
            .await?;
    Ok(match status {
        Some(Some(s)) if s == "lost" => {
            stats.slot_invalidations.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(slot = %name, "replication slot invalidated (max_slot_wal_keep_size): recreating it and rebuilding every filter");
            sqlx::query("SELECT pg_drop_replication_slot($1)")
                .bind(name)
                .execute(&mut *conn)
                .await?;
            create_permanent(conn, name).await?;
            true
        }
        Some(_) => false,
        None => {
            create_permanent(conn, name).await?;
            // A slot that did not exist: unless this is start-up (whose
            // scan follows), changes may have been missed.
            !first
        }
    })
}

/// The slot exists: tells start-up, and asks for a rebuild of every
/// filter if changes may have been missed. False once the gateway is gone.
async fn slot_ready(
    ready: &mut Option<oneshot::Sender<Result<(), String>>>,
    resync: bool,
    tx: &mpsc::Sender<Event>,
) -> bool {
    if let Some(ready) = ready.take() {
        let _ = ready.send(Ok(()));
    }
    !resync
        || tx
            .send(Event::Resync(Resync {
                reason: "WAL feed: new replication slot".into(),
                snapshot: None,
            }))
            .await
            .is_ok()
}

/// Delivers a batch at `Visible` once [`wait_visible`] has seen its
/// transactions finished, then asks for what they could not carry: a
/// rebuild's snapshot, taken after this, sees them. False once the gateway
/// is gone.
async fn deliver_visible(p: Pending, tx: &mpsc::Sender<Event>) -> bool {
    for mut c in p.commits {
        c.phase = Phase::Visible;
        if tx.send(Event::Commit(c)).await.is_err() {
            return false;
        }
    }
    if p.resync {
        let ev = Event::Resync(Resync {
            reason: "WAL feed: undecodable message".into(),
            snapshot: None,
        });
        if tx.send(ev).await.is_err() {
            return false;
        }
    }
    for t in p.rescan {
        if tx.send(Event::Rescan(t)).await.is_err() {
            return false;
        }
    }
    true
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
async fn wait_visible(
    conn: &mut PgConnection,
    xids: &[u32],
    // One check taking longer is a hung connection (an error).
    limit: Duration,
    // Streaming: the stream and the positions to keep reporting on it.
    mut stream: Option<(&mut Stream, Lsn, Lsn)>,
) -> Result<(), SessionError> {
    // Normally microseconds. It can take long when commits wait for a
    // synchronous standby: delivering `Visible` early would reopen the
    // window it closes, so keep waiting, and say so (and keep telling the
    // server we are alive). Past a minute the feed moves on rather than
    // stall every resource (logged as an error).
    let began = Instant::now();
    let mut warned = began;
    let mut told = began;
    loop {
        if bounded(limit, all_visible(conn, xids)).await? {
            return Ok(());
        }
        if told.elapsed() >= STATUS_EVERY {
            if let Some((stream, received, confirmed)) = stream.as_mut() {
                stream.send_status(*received, *confirmed, false).await?;
            }
            told = Instant::now();
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

/// `query`, given up after `limit` as an I/O time-out: a connection to a
/// hung host or across a cut network would otherwise wait forever (sqlx
/// sets no time-out of its own on a query).
async fn bounded<T>(
    limit: Duration,
    query: impl std::future::Future<Output = Result<T, sqlx::Error>>,
) -> Result<T, sqlx::Error> {
    tokio::time::timeout(limit, query)
        .await
        .unwrap_or_else(|_| Err(sqlx::Error::Io(std::io::ErrorKind::TimedOut.into())))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::feed::pgoutput::{Relation, Tuple};
    use crate::feed::{ColumnType, WatchedColumn, WatchedTable};

    fn watch() -> Watch {
        Watch {
            tables: vec![WatchedTable {
                name: Arc::from("public.t"),
                columns: vec![WatchedColumn {
                    name: Arc::from("id"),
                    ty: ColumnType::Int8,
                }],
            }],
        }
    }

    fn relation() -> Message {
        Message::Relation(Relation {
            id: 1,
            namespace: "public".into(),
            name: "t".into(),
            columns: vec!["id".into()],
            identity: vec![true],
        })
    }

    fn insert(id: i64) -> Message {
        Message::Insert {
            rel: 1,
            new: Tuple(vec![Datum::Text(id.to_string())]),
        }
    }

    fn keys(d: &Done) -> Vec<String> {
        d.commit
            .changes
            .iter()
            .map(|c| match c.new.as_ref().and_then(|n| n.get("id")) {
                Some(Value::Text(t)) => t.clone(),
                other => panic!("{other:?}"),
            })
            .collect()
    }

    /// Feeds `msgs` (each with the xid a streamed message carries) and
    /// returns every completed transaction.
    fn run(asm: &mut Assembler<'_>, msgs: Vec<(Option<u32>, Message)>) -> Vec<Done> {
        msgs.into_iter()
            .filter_map(|(sub, m)| asm.push(sub, m))
            .collect()
    }

    fn commit(xid: u32, end: u64) -> Message {
        Message::StreamCommit {
            xid,
            commit_lsn: end - 1,
            end_lsn: end,
            commit_time: 0,
        }
    }

    #[test]
    fn streamed_transactions_keep_only_what_committed() {
        let (w, stats) = (watch(), Stats::default());
        let mut asm = Assembler::new(&w, &stats);
        let done = run(
            &mut asm,
            vec![
                (
                    None,
                    Message::StreamStart {
                        xid: 10,
                        first: true,
                    },
                ),
                (Some(10), relation()),
                (Some(10), insert(1)),
                (Some(11), insert(2)), // subtransaction 11
                (None, Message::StreamStop),
                // A whole transaction between two blocks of 10.
                (
                    None,
                    Message::Begin {
                        final_lsn: 5,
                        xid: 20,
                    },
                ),
                (None, insert(3)),
                (
                    None,
                    Message::Commit {
                        commit_lsn: 5,
                        end_lsn: 6,
                        commit_time: 0,
                    },
                ),
                (
                    None,
                    Message::StreamStart {
                        xid: 10,
                        first: false,
                    },
                ),
                (Some(12), insert(4)),
                (None, Message::StreamStop),
                (
                    None,
                    Message::StreamStart {
                        xid: 30,
                        first: true,
                    },
                ),
                (Some(30), insert(5)),
                (None, Message::StreamStop),
                (
                    None,
                    Message::StreamAbort {
                        xid: 10,
                        subxid: 11,
                    },
                ),
                (
                    None,
                    Message::StreamAbort {
                        xid: 30,
                        subxid: 30,
                    },
                ),
                (None, commit(10, 9)),
            ],
        );
        assert_eq!(done.len(), 2);
        assert_eq!(keys(&done[0]), ["3"]);
        assert_eq!(done[0].commit.xid, Some(20));
        assert_eq!(keys(&done[1]), ["1", "4"], "subtransaction 11 aborted");
        assert_eq!(done[1].commit.lsn, Some(Lsn(9)));
        assert!(asm.streams.is_empty(), "transaction 30 aborted");
        assert!(!asm.in_transaction());
    }

    #[test]
    fn a_whole_transaction_half_read_holds_back_acknowledgement() {
        let (w, stats) = (watch(), Stats::default());
        let mut asm = Assembler::new(&w, &stats);
        asm.push(
            None,
            Message::Begin {
                final_lsn: 5,
                xid: 20,
            },
        );
        assert!(asm.in_transaction());
        asm.push(
            None,
            Message::StreamStart {
                xid: 7,
                first: true,
            },
        );
        asm.push(None, Message::StreamStop);
        asm.push(
            None,
            Message::Commit {
                commit_lsn: 5,
                end_lsn: 6,
                commit_time: 0,
            },
        );
        // Only a streamed transaction is open: its commit is still ahead.
        assert!(!asm.in_transaction());
    }

    /// The byte bound: three inserts of short keys fit in 500 bytes, four
    /// do not; each transaction counts its own.
    #[test]
    fn too_many_bytes_become_a_rescan() {
        let (w, stats) = (watch(), Stats::default());
        let mut asm = Assembler::new(&w, &stats);
        asm.max_items = usize::MAX;
        asm.max_bytes = 500;
        let txn = |xid: u32, ids: std::ops::Range<i64>| {
            let mut m = vec![(
                None,
                Message::Begin {
                    final_lsn: u64::from(xid),
                    xid,
                },
            )];
            m.extend(ids.map(|i| (None, insert(i))));
            m.push((
                None,
                Message::Commit {
                    commit_lsn: u64::from(xid),
                    end_lsn: u64::from(xid) + 1,
                    commit_time: 0,
                },
            ));
            m
        };
        let mut msgs = vec![(None, relation())];
        msgs.extend(txn(10, 0..3));
        msgs.extend(txn(20, 0..4));
        msgs.extend(txn(30, 5..8));
        let done = run(&mut asm, msgs);
        assert_eq!(keys(&done[0]), ["0", "1", "2"]);
        assert!(done[0].rescan.is_empty());
        assert!(done[1].commit.changes.is_empty());
        assert_eq!(done[1].rescan, [Arc::<str>::from("public.t")]);
        assert_eq!(
            keys(&done[2]),
            ["5", "6", "7"],
            "the bound is per transaction"
        );
    }

    #[test]
    fn too_many_changes_become_a_rescan_and_memory_stays_bounded() {
        let (w, stats) = (watch(), Stats::default());
        let mut asm = Assembler::new(&w, &stats);
        asm.max_items = 3;
        let mut msgs = vec![
            (None, relation()),
            (
                None,
                Message::Begin {
                    final_lsn: 5,
                    xid: 20,
                },
            ),
        ];
        msgs.extend((0..10).map(|i| (None, insert(i))));
        msgs.push((
            None,
            Message::Commit {
                commit_lsn: 5,
                end_lsn: 6,
                commit_time: 0,
            },
        ));
        msgs.push((
            None,
            Message::Begin {
                final_lsn: 7,
                xid: 21,
            },
        ));
        msgs.push((None, insert(99)));
        msgs.push((
            None,
            Message::Commit {
                commit_lsn: 7,
                end_lsn: 8,
                commit_time: 0,
            },
        ));
        let done = run(&mut asm, msgs);
        assert!(done[0].commit.changes.is_empty());
        assert_eq!(done[0].rescan, [Arc::<str>::from("public.t")]);
        assert_eq!(
            done[0].commit.lsn,
            Some(Lsn(6)),
            "still acknowledged in order"
        );
        assert_eq!(keys(&done[1]), ["99"]);
        assert!(done[1].rescan.is_empty());
    }

    #[test]
    fn an_undecodable_message_rebuilds_after_its_transaction() {
        let (w, stats) = (watch(), Stats::default());
        let mut asm = Assembler::new(&w, &stats);
        asm.push(None, relation());
        asm.push(
            None,
            Message::StreamStart {
                xid: 10,
                first: true,
            },
        );
        asm.poison();
        asm.push(None, Message::StreamStop);
        asm.push(
            None,
            Message::Begin {
                final_lsn: 5,
                xid: 20,
            },
        );
        asm.push(None, insert(1));
        let whole = asm
            .push(
                None,
                Message::Commit {
                    commit_lsn: 5,
                    end_lsn: 6,
                    commit_time: 0,
                },
            )
            .unwrap();
        assert!(!whole.resync, "another transaction's error");
        let streamed = asm.push(None, commit(10, 9)).unwrap();
        assert!(streamed.resync);
        assert!(!asm.stray_error);
        asm.poison();
        assert!(
            asm.stray_error,
            "outside any transaction: at the batch's end"
        );
    }
}
