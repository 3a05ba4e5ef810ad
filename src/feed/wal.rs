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
//! server asks, with every heartbeat's request for a keepalive, and every
//! second while the feed waits; a stream silent for 30 s is given up and
//! opened again. Logical decoding outputs committed transactions only, so
//! a rolled-back one has no effect.
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
//! delivers every transaction that commits after `C`. Start-up waits until
//! the stream has *started* (`START_REPLICATION` answered; polled: the slot
//! held) before the first scan takes its snapshot, so a transaction either
//! committed before the snapshot (the scan sees it) or after the stream's
//! start (the feed delivers it); one that does both is applied twice, which
//! is idempotent. A rebuild opens its journal before it scans, and every
//! commit the feed delivers meanwhile is journaled (see `resource`).
//!
//! The feed keeps its *position*: how far this process has applied (the
//! position it confirmed last, or where its first stream started). A new
//! stream that may start past it is a gap, answered by [`Event::Resync`]
//! once the stream is in place (see "The principle" in [`super`]):
//! - a temporary slot is lost with its connection: the new slot's `C'` may
//!   be past commits never applied;
//! - a permanent slot that is gone (dropped from outside), invalidated by
//!   `max_slot_wal_keep_size` (`wal_status = 'lost'`, dropped and created
//!   again here) or stuck behind a dropped publication (decoding from where
//!   it stands fails again and again: created again here);
//! - a permanent slot whose confirmed position is past this process's
//!   position: someone else consumed it meanwhile (another gateway with the
//!   same `database.slot`).
//!
//! A permanent slot that resumes at or before the position replays what
//! was applied already: no rebuild. A permanent slot another backend holds
//! is waited for (the feed is not streaming, so the gateway is not ready,
//! and says which PID holds it); the polled feed takes a session advisory
//! lock on the slot's name as well, since polling holds the slot only
//! during each poll.
//!
//! # Heartbeats and checks
//! Every [`HEARTBEAT_EVERY`] the feed reads the primary's flush position
//! `P` and asks the server for a keepalive; a keepalive that comes with
//! nothing half read and reports the server has sent up to `P` or past it
//! means every commit before the moment `P` was read has been received.
//! Once those are delivered at `Visible` and applied, the feed sends
//! [`Event::Heartbeat`] with that moment. Polled, a poll that returned
//! everything below the flush position it read does the same. Every
//! [`CHECK_EVERY`] it checks the publication and the watched tables
//! ([`super::watch`], `db::publication`), repairing the publication with
//! `database.install_feed` (and rescanning the tables it repaired);
//! without it a table the publication does not follow completely is
//! reported ([`Event::Coverage`]). A publication that does not exist at
//! all stops the feed from streaming (decoding would fail at the first
//! change, and reconnecting would fail the same way): it waits, and checks
//! again.
//!
//! # Replica identity
//! pgoutput sends an UPDATE's old row only when a replica identity column
//! changed, and a DELETE's old row as its identity columns. A watched
//! column outside the identity (an `ALTER TABLE … REPLICA IDENTITY` at run
//! time, say) is therefore [`Value::Unknown`] in the old row, whichever
//! way the old row came or did not come: the gateway clears that
//! resource's cache rather than guess. Each `Relation` message carries the
//! identity as it is now; one that no longer carries a watched column is
//! logged, naming the fix. A value sent as "unchanged" (TOASTed and not
//! rewritten) in the new row is the old row's, when the old row carries it.
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

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use sqlx::postgres::{PgConnectOptions, PgConnection};
use sqlx::{Connection, Row};
use tokio::sync::{mpsc, oneshot, watch};

use super::pgoutput::{self, Datum, Message};
use super::replication::{self, Endpoint, Frame, ReplError, Stream};
use super::{
    CHECK_EVERY, Columns, Commit, Coverage, Event, HEARTBEAT_EVERY, Health, Lsn, Op, Phase, Resync,
    RowChange, Value, Watch,
};
use crate::db::catalog::canonical_text;
use crate::db::publication::{self, InstallError};
use crate::telemetry::LogThrottle;

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
    /// A stream silent this long is given up for dead, and reconnected.
    /// [`SILENCE_LIMIT`] unless a test wants it shorter.
    pub silence_limit: Duration,
    /// `database.install_feed`: repair the publication when a check finds
    /// it wrong.
    pub install: bool,
}

impl std::fmt::Debug for Options {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the password.
        f.debug_struct("Options")
            .field("publication", &self.publication)
            .field("slot", &self.slot)
            .field("poll", &self.poll)
            .field("silence_limit", &self.silence_limit)
            .field("install", &self.install)
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
    /// Streams started past this process's position (see "No gap").
    pub gaps: AtomicU64,
    /// Publication repairs (`install_feed`).
    pub repairs: AtomicU64,
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
/// naming its fix: `wal_level`, the role's `REPLICATION`, a publication
/// that delivers every change of every watched table, and a replica
/// identity that carries the key on UPDATE and DELETE.
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
    let mut conn = pool.acquire().await.map_err(|e| e.to_string())?;
    let checked = publication::check(&mut conn, watch, publication)
        .await
        .map_err(|e| e.to_string())?;
    if let Some(why) = checked.problems.into_iter().flatten().next() {
        return Err(why);
    }
    let identity = publication::identity_problems(&mut conn, watch)
        .await
        .map_err(|e| e.to_string())?;
    match identity.into_iter().next() {
        Some(why) => Err(why),
        None => Ok(()),
    }
}

/// A watched table as the feed knows it: its key columns' positions are
/// resolved when its `Relation` message arrives.
struct Rel {
    table: super::TableName,
    /// (column name, type, index in the tuple, in the replica identity)
    columns: Vec<(Arc<str>, super::ColumnType, usize, bool)>,
}

/// Runs until aborted or `tx` closes. `ready` gets `Ok` once the stream
/// has started (before the first scan). A session that fails, or cannot
/// start (the slot is held by another backend, the publication is gone, the
/// server is down), is tried again after a back-off, saying why in `health`
/// and in the log (once per interval).
pub async fn run(
    opts: Options,
    watch: Watch,
    tx: mpsc::Sender<Event>,
    mut applied: watch::Receiver<Lsn>,
    stats: Arc<Stats>,
    health: Arc<Health>,
    ready: oneshot::Sender<Result<(), String>>,
) {
    let mut carry = Carry {
        position: None,
        tracker: super::watch::Tracker::default(),
        slot_broken: false,
        streamed: false,
        ready: Some(ready),
        throttle: LogThrottle::default(),
    };
    let mut delay = RETRY_FIRST;
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
        carry.streamed = false;
        let mut cx = Ctx {
            opts: &opts,
            watch: &watch,
            tx: &tx,
            stats: &stats,
            health: &health,
            carry: &mut carry,
        };
        let r = match opts.poll {
            None => session(&mut cx, &mut applied, &temp_name).await,
            Some(_) => poll_session(&mut cx, &mut applied, &temp_name).await,
        };
        if tx.is_closed() {
            return;
        }
        let Err(e) = r else { return };
        let why = e.to_string();
        // Decoding past a dropped publication fails from the same place
        // every time: a permanent slot must start again elsewhere.
        carry.slot_broken = opts.slot.is_some() && e.is_missing_publication();
        health.waiting(why.clone());
        if tx.send(Event::Interrupted(why.clone())).await.is_err() {
            return;
        }
        if carry.streamed {
            delay = RETRY_FIRST;
        }
        if let Some(not_logged) = carry.throttle.permit() {
            tracing::warn!(error = %why, retry_in = ?delay, not_logged, "WAL change feed not streaming; trying again");
        }
        stats.reconnects.fetch_add(1, Ordering::Relaxed);
        health.reconnected();
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(RETRY_MAX);
    }
}

/// The first wait before a session is tried again; it doubles up to
/// [`RETRY_MAX`], and starts over after a session that streamed.
const RETRY_FIRST: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(5);

/// What every session of one feed reads, and what one hands the next.
struct Ctx<'a> {
    opts: &'a Options,
    watch: &'a Watch,
    tx: &'a mpsc::Sender<Event>,
    stats: &'a Stats,
    health: &'a Health,
    carry: &'a mut Carry,
}

struct Carry {
    /// How far this process has applied (see "No gap"); `None` until a
    /// stream has started: nothing depends on the feed yet.
    position: Option<Lsn>,
    tracker: super::watch::Tracker,
    /// The last session ended on a missing publication (see `run`).
    slot_broken: bool,
    /// This session's stream started.
    streamed: bool,
    ready: Option<oneshot::Sender<Result<(), String>>>,
    /// "Not streaming" and "cannot repair" at most once per interval.
    throttle: LogThrottle,
}

/// What ends a session: the database refused or went away, or the feed
/// cannot stream yet (and says why).
#[derive(Debug)]
enum SessionError {
    Sql(sqlx::Error),
    Repl(ReplError),
    Wait(String),
}

impl SessionError {
    /// The server could not decode past a publication that did not exist
    /// (streamed: the walsender's error; polled: the peek's).
    fn is_missing_publication(&self) -> bool {
        match self {
            SessionError::Repl(ReplError::Server { code, message }) => {
                publication::is_missing_publication(code, message)
            }
            SessionError::Sql(sqlx::Error::Database(d)) => d
                .code()
                .is_some_and(|c| publication::is_missing_publication(&c, d.message())),
            _ => false,
        }
    }
}

impl std::fmt::Display for SessionError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SessionError::Sql(e) => e.fmt(f),
            SessionError::Repl(e) => e.fmt(f),
            SessionError::Wait(why) => f.write_str(why),
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
/// minutes to say so). The default of [`Options::silence_limit`].
pub const SILENCE_LIMIT: Duration = Duration::from_secs(30);

/// Connecting and authenticating the replication connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

/// Checks what the feed depends on ([`super::watch`], the publication),
/// repairs the publication where allowed, and tells the gateway what
/// changed. Err(Wait) when there is no publication to stream from.
async fn check_dependencies(cx: &mut Ctx<'_>, conn: &mut PgConnection) -> Result<(), SessionError> {
    let (opts, watch) = (cx.opts, cx.watch);
    let mut checked = publication::check(conn, watch, &opts.publication).await?;
    let mut repaired: Vec<usize> = Vec::new();
    if opts.install && checked.problems.iter().any(Option::is_some) {
        match publication::install(&mut *conn, watch, &opts.publication).await {
            Ok(()) => {
                cx.stats.repairs.fetch_add(1, Ordering::Relaxed);
                let problems = &checked.problems;
                repaired = (0..problems.len())
                    .filter(|i| problems[*i].is_some())
                    .collect();
                for i in &repaired {
                    tracing::warn!(table = %watch.tables[*i].name, problem = problems[*i].as_deref().unwrap_or_default(), "publication repaired (database.install_feed); the table is rescanned");
                }
                checked = publication::check(conn, watch, &opts.publication).await?;
            }
            Err(InstallError::Sql(e)) => return Err(e.into()),
            Err(e) => {
                if let Some(not_logged) = cx.carry.throttle.permit() {
                    tracing::error!(error = %e, not_logged, "cannot repair the publication");
                }
            }
        }
    }
    let no_publication = !checked.exists;
    let mut seen = super::watch::tables(conn, watch).await?;
    let prints = publication::fingerprints(conn, watch, &opts.publication).await?;
    for (s, print) in seen.iter_mut().zip(prints) {
        s.dependency = print;
    }
    let now = seen
        .into_iter()
        .zip(checked.problems)
        .zip(&watch.tables)
        .map(|((seen, problem), t)| {
            let problem = match seen.oid {
                None => Some(format!("table {} does not exist", t.name)),
                Some(_) => problem,
            };
            (seen, problem)
        })
        .collect();
    let mut events = cx.carry.tracker.update(watch, now);
    for i in repaired {
        let name = &watch.tables[i].name;
        let covered = events
            .iter()
            .any(|e| matches!(e, Event::Resync(r) if r.scope.covers(name)));
        if !covered {
            events.push(Resync::table(name.clone(), "the publication was repaired"));
        }
    }
    for e in events {
        if let Event::Coverage(Coverage { table, problem }) = &e {
            match problem {
                Some(p) => {
                    tracing::error!(table = %table, problem = %p, "the WAL feed cannot follow this table: its resources are not ready")
                }
                None => tracing::info!(table = %table, "the WAL feed follows this table again"),
            }
        }
        if cx.tx.send(e).await.is_err() {
            return Ok(());
        }
    }
    if no_publication {
        return Err(SessionError::Wait(format!(
            "publication {:?} does not exist: run `bloomgate install-feed` (or set database.install_feed = true)",
            opts.publication
        )));
    }
    Ok(())
}

/// Opens the permanent slot `name` (see "No gap"): creates it if it does not
/// exist, creates it again if it is lost or stuck; returns where its stream
/// starts and whether that is a gap. Err(Wait) while another backend holds
/// it.
async fn open_permanent(
    cx: &mut Ctx<'_>,
    conn: &mut PgConnection,
    name: &str,
) -> Result<(Lsn, bool), SessionError> {
    let had = cx.carry.position;
    let state = publication::slot(conn, name).await?;
    if let Some(s) = &state
        && let Some(pid) = s.active_pid
    {
        return Err(held_by(name, pid));
    }
    let recreate = match &state {
        None => None,
        Some(s) if s.lost => {
            cx.stats.slot_invalidations.fetch_add(1, Ordering::Relaxed);
            Some("it was invalidated (max_slot_wal_keep_size)")
        }
        Some(_) if cx.carry.slot_broken => {
            Some("decoding it failed on a publication that did not exist")
        }
        Some(_) => None,
    };
    if let Some(why) = recreate {
        tracing::warn!(slot = %name, why, "recreating the replication slot; every filter is rebuilt");
        sqlx::query("SELECT pg_drop_replication_slot($1)")
            .bind(name)
            .execute(&mut *conn)
            .await?;
        cx.carry.slot_broken = false;
    }
    match (&state, recreate) {
        (Some(s), None) => {
            let at = s.confirmed_flush.unwrap_or(Lsn::ZERO);
            // Confirmed past what this process applied: someone else read it.
            Ok((at, had.is_some_and(|p| at > p)))
        }
        _ => {
            let at = create_permanent(conn, name).await?;
            Ok((at, had.is_some()))
        }
    }
}

fn held_by(slot: &str, pid: i32) -> SessionError {
    SessionError::Wait(format!(
        "replication slot {slot} is active for PID {pid} (another gateway with the same database.slot?): waiting for it"
    ))
}

/// A server error that says the slot is in use (SQLSTATE 55006, object in
/// use): another backend took it between the check and the start.
fn in_use(e: SessionError, slot: &str) -> SessionError {
    match e {
        SessionError::Repl(ReplError::Server { code, message }) if code == "55006" => {
            SessionError::Wait(format!("replication slot {slot}: {message}"))
        }
        SessionError::Sql(sqlx::Error::Database(d)) if d.code().as_deref() == Some("55006") => {
            SessionError::Wait(format!("replication slot {slot}: {}", d.message()))
        }
        e => e,
    }
}

/// The stream has started at `start`: from here on every commit after it
/// is delivered. Tells start-up, and the gateway of a gap.
async fn streaming(cx: &mut Ctx<'_>, start: Lsn, gap: bool) -> bool {
    cx.health.streaming();
    cx.carry.streamed = true;
    let was = cx.carry.position;
    cx.carry.position = Some(match was {
        Some(p) if !gap => p.max(start),
        _ => start,
    });
    if gap {
        cx.stats.gaps.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(start = %start, applied = ?was, "WAL feed: the new stream may start past changes never applied; every filter is rebuilt");
        let ev = Resync::all("WAL feed: the stream started past what was applied");
        if cx.tx.send(ev).await.is_err() {
            return false;
        }
    }
    if let Some(ready) = cx.carry.ready.take() {
        let _ = ready.send(Ok(()));
    }
    true
}

/// The primary's flush position: what a walsender can have sent.
async fn flush_lsn(conn: &mut PgConnection) -> Result<Lsn, sqlx::Error> {
    let text: String = sqlx::query_scalar("SELECT pg_current_wal_flush_lsn()::text")
        .fetch_one(conn)
        .await?;
    Ok(Lsn::parse(&text).unwrap_or(Lsn::ZERO))
}

async fn session(
    cx: &mut Ctx<'_>,
    applied: &mut watch::Receiver<Lsn>,
    temp_name: &str,
) -> Result<(), SessionError> {
    let (opts, watch, tx, stats) = (cx.opts, cx.watch, cx.tx, cx.stats);
    // Named, so an operator can tell the feed's backends from the pool's.
    let connect = feed_connect(opts);
    // For slot bookkeeping, checks, heartbeats and visibility: a walsender
    // runs no SQL once it streams.
    let mut conn = side_connection(&connect).await?;
    bounded(opts.silence_limit, check_dependencies(cx, &mut conn)).await?;
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
    let (start, gap) = match &opts.slot {
        // On the replication connection: it lives as long as it does.
        None => (
            repl.create_slot(slot, true).await?,
            cx.carry.position.is_some(),
        ),
        Some(name) => bounded(opts.silence_limit, open_permanent(cx, &mut conn, name)).await?,
    };
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
    let mut stream = repl
        .start(slot, Lsn::ZERO, &options)
        .await
        .map_err(|e| in_use(e.into(), slot))?;
    if !streaming(cx, start, gap).await {
        return Ok(());
    }
    let mut asm = Assembler::new(watch, stats);
    // Received up to (reported as written), and applied up to (reported
    // as flushed: the slot's confirmed position).
    let mut received = start;
    let mut confirmed = start;
    // The end of what the server has sent, from a keepalive received with
    // no whole transaction half read: nothing before it is still to come.
    let mut idle_upto: Option<Lsn> = None;
    // Delivered at `Received`, waiting for their `Visible` delivery.
    let mut pending = Pending::default();
    // As if checked long ago: the first commit is checked at once.
    let long_ago = |d: Duration| Instant::now().checked_sub(d).unwrap_or_else(Instant::now);
    let mut checked = long_ago(VISIBLE_EVERY);
    let mut heard = Instant::now();
    // The heartbeat (see "Heartbeats and checks"): when the flush position
    // was read, and what it was, until a keepalive proves it sent; then
    // that moment, until what came before it is applied.
    let mut probe: Option<(Instant, Lsn)> = None;
    let mut asked = long_ago(HEARTBEAT_EVERY);
    let mut proven: Option<Instant> = None;
    let mut dependencies = Instant::now();
    loop {
        if asked.elapsed() >= HEARTBEAT_EVERY {
            if probe.is_none() {
                let at = Instant::now();
                let flush = bounded(opts.silence_limit, flush_lsn(&mut conn)).await?;
                probe = Some((at, flush));
            }
            // Asked again while unanswered: a walsender catching up sends
            // no keepalive of its own once it has.
            stream.send_status(received, confirmed, true).await?;
            asked = Instant::now();
        }
        let wait = if pending.commits.is_empty() {
            HEARTBEAT_EVERY.saturating_sub(asked.elapsed())
        } else {
            VISIBLE_EVERY.saturating_sub(checked.elapsed())
        };
        // The server asked for a status.
        let mut reply = false;
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
                                if let Some((at, flush)) = probe
                                    && wal_end >= flush
                                {
                                    proven = Some(at);
                                    probe = None;
                                }
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
            Err(_) => {
                // Quiet: give up on a peer that is gone (a crashed host, a
                // failover) instead of waiting for TCP. A live one answers
                // every heartbeat's request.
                let silent = heard.elapsed();
                if silent >= opts.silence_limit {
                    return Err(ReplError::Protocol(format!(
                        "no word from the server for {}s",
                        silent.as_secs()
                    ))
                    .into());
                }
            }
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
            // position received meanwhile is safe to confirm too, and a
            // proven heartbeat to send.
            upto = upto.max(idle_upto);
            if let Some(at) = proven.take()
                && tx.send(Event::Heartbeat(at)).await.is_err()
            {
                return Ok(());
            }
        }
        let moved = upto.is_some_and(|u| u > confirmed);
        if let Some(u) = upto {
            confirmed = confirmed.max(u);
            received = received.max(confirmed);
            cx.carry.position = Some(confirmed);
        }
        if moved || reply || heard.elapsed() >= STATUS_EVERY {
            stream.send_status(received, confirmed, false).await?;
            stats.applied_lsn.store(confirmed.0, Ordering::Relaxed);
        }
        if dependencies.elapsed() >= CHECK_EVERY {
            bounded(opts.silence_limit, check_dependencies(cx, &mut conn)).await?;
            dependencies = Instant::now();
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
/// polls is skipped, and a quiet publication does not hold WAL back. Such a
/// whole poll is also the heartbeat: every commit before it was read is
/// delivered.
async fn poll_session(
    cx: &mut Ctx<'_>,
    applied: &mut watch::Receiver<Lsn>,
    temp_name: &str,
) -> Result<(), SessionError> {
    use futures_util::TryStreamExt;
    let (opts, watch, tx, stats) = (cx.opts, cx.watch, cx.tx, cx.stats);
    let every = opts.poll.unwrap_or(VISIBLE_EVERY);
    let poll_timeout = opts.silence_limit * POLL_TIMEOUT_LIMITS;
    let connect = feed_connect(opts);
    let mut conn = side_connection(&connect).await?;
    bounded(opts.silence_limit, check_dependencies(cx, &mut conn)).await?;
    let slot = opts.slot.as_deref().unwrap_or(temp_name);
    let (start, gap) = match &opts.slot {
        None => {
            // Temporary: dropped when this connection ends.
            let at: String = sqlx::query_scalar(
                "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput', true)",
            )
            .bind(slot)
            .fetch_one(&mut conn)
            .await?;
            (
                Lsn::parse(&at).unwrap_or(Lsn::ZERO),
                cx.carry.position.is_some(),
            )
        }
        Some(name) => {
            // Polling holds the slot only during each poll: a second
            // gateway polling it in between would consume what this one has
            // not. A lock on its name, held by this connection, keeps it
            // ours.
            let mine: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1, hashtext($2))")
                .bind(SLOT_LOCK_CLASS)
                .bind(name)
                .fetch_one(&mut conn)
                .await?;
            if !mine {
                let pid: Option<i32> = sqlx::query_scalar(
                    "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND classid = $1::oid
                        AND objid = hashtext($2)::oid AND granted LIMIT 1",
                )
                .bind(SLOT_LOCK_CLASS)
                .bind(name)
                .fetch_optional(&mut conn)
                .await?
                .flatten();
                return Err(held_by(name, pid.unwrap_or(0)));
            }
            bounded(opts.silence_limit, open_permanent(cx, &mut conn, name)).await?
        }
    };
    if !streaming(cx, start, gap).await {
        return Ok(());
    }
    let publications = replication::quote_ident(&opts.publication);
    // Protocol 1: the SQL interface returns whole transactions only.
    let peek = "SELECT w.upto::text AS upto, c.lsn::text AS lsn, c.data
                  FROM (SELECT pg_current_wal_flush_lsn() AS upto) w
                  LEFT JOIN LATERAL pg_logical_slot_peek_binary_changes(
                      $1, w.upto, $3, 'proto_version', '1', 'publication_names', $2) c ON true";
    let mut asm = Assembler::new(watch, stats);
    let mut confirmed = start;
    let mut dependencies = Instant::now();
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
        if whole && tx.send(Event::Heartbeat(began)).await.is_err() {
            return Ok(());
        }
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
            cx.carry.position = Some(confirmed);
            stats.applied_lsn.store(confirmed.0, Ordering::Relaxed);
            if let Some(lag) = lag {
                stats.lag_bytes.store(lag.max(0) as u64, Ordering::Relaxed);
            }
        }
        if dependencies.elapsed() >= CHECK_EVERY {
            bounded(opts.silence_limit, check_dependencies(cx, &mut conn)).await?;
            dependencies = Instant::now();
        }
        if whole {
            tokio::time::sleep(every.saturating_sub(began.elapsed())).await;
        }
    }
}

/// The first key of the polled feed's advisory lock on a permanent slot's
/// name (the second is the name's hash): "bgsl".
const SLOT_LOCK_CLASS: i32 = 0x6267_736c;

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
    /// Tables logged for a replica identity that misses a watched column.
    identity_warned: HashSet<super::TableName>,
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
            identity_warned: HashSet::new(),
            max_items: MAX_ITEMS,
            max_bytes: MAX_BYTES,
        }
    }

    /// Logs a table whose replica identity no longer carries a watched
    /// column, once until it does again (see "Replica identity").
    fn note_identity(&mut self, rel: &Rel) {
        let outside: Vec<&str> = rel
            .columns
            .iter()
            .filter(|(_, _, _, identity)| !identity)
            .map(|(name, ..)| &**name)
            .collect();
        if outside.is_empty() {
            self.identity_warned.remove(&rel.table);
        } else if self.identity_warned.insert(rel.table.clone()) {
            tracing::warn!(
                table = %rel.table,
                columns = ?outside,
                "the table's replica identity does not carry these key columns: each UPDATE or DELETE of it clears the cache of their resources; ALTER TABLE {} REPLICA IDENTITY FULL (or USING INDEX a unique index on them)",
                rel.table
            );
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
                if let Some(rel) = &known {
                    self.note_identity(rel);
                }
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
                    let old = match &old {
                        Some(o) => columns(r, o, true),
                        // No old tuple: no replica identity column changed.
                        // A watched column in the identity kept its value;
                        // one outside it may have changed, to what is not
                        // said (see "Replica identity").
                        None => Columns(
                            r.columns
                                .iter()
                                .map(|(name, ty, i, identity)| {
                                    let v = match identity {
                                        true => value(*ty, new.0.get(*i)),
                                        false => Value::Unknown,
                                    };
                                    (name.clone(), v)
                                })
                                .collect(),
                        ),
                    };
                    let mut new = columns(r, &new, false);
                    // Sent as unchanged (TOASTed, not rewritten): the old
                    // row's value, when the old row carries it.
                    for ((_, n), (_, o)) in new.0.iter_mut().zip(&old.0) {
                        if *n == Value::Unknown && *o != Value::Unknown {
                            *n = o.clone();
                        }
                    }
                    let change = RowChange {
                        table: r.table.clone(),
                        op: Op::Update,
                        new: Some(new),
                        old: Some(old),
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
    if p.resync
        && tx
            .send(Resync::all("WAL feed: undecodable message"))
            .await
            .is_err()
    {
        return false;
    }
    for t in p.rescan {
        let ev = Resync::table(t, "WAL feed: a transaction too large to hold");
        if tx.send(ev).await.is_err() {
            return false;
        }
    }
    true
}

/// Creates the permanent slot `name`; returns its consistent point.
async fn create_permanent(conn: &mut PgConnection, name: &str) -> Result<Lsn, sqlx::Error> {
    let at: String = sqlx::query_scalar(
        "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput', false)",
    )
    .bind(name)
    .fetch_one(conn)
    .await?;
    Ok(Lsn::parse(&at).unwrap_or(Lsn::ZERO))
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
async fn bounded<T, E: From<sqlx::Error>>(
    limit: Duration,
    query: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, E> {
    tokio::time::timeout(limit, query)
        .await
        .unwrap_or_else(|_| Err(sqlx::Error::Io(std::io::ErrorKind::TimedOut.into()).into()))
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
                (name.clone(), value(*ty, tuple.0.get(*i)))
            })
            .collect(),
    )
}

/// One column's value as a tuple carries it.
fn value(ty: super::ColumnType, datum: Option<&Datum>) -> Value {
    match datum {
        Some(Datum::Text(t)) => Value::Text(canonical_text(ty, t).to_string()),
        Some(Datum::Null) => Value::Null,
        Some(Datum::Unchanged) | None => Value::Unknown,
    }
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
