//! The `wal` change feed: logical decoding (`pgoutput`) of the primary's
//! write-ahead log through a replication slot. Writers pay nothing (no
//! trigger, no `NOTIFY`), nobody can forge a change, and a permanent slot
//! resumes where it stopped.
//!
//! # How
//! One replication connection per gateway ([`replication`], the
//! streaming protocol; polled, an ordinary connection, see "Streamed or
//! polled") holds the slot: a **temporary** one by default
//! (`CREATE_REPLICATION_SLOT … TEMPORARY`: Postgres drops it when the
//! connection ends, so a gateway that dies never holds WAL back), or the
//! permanent `database.slot`. `START_REPLICATION … LOGICAL` streams every
//! committed transaction of the publication's tables as it is decoded;
//! the feed reduces each row to the watched key columns as canonical text
//! (`assemble`) and sends one [`Event::Commit`] per transaction, in
//! commit order, as soon as it arrives. The `Visible` delivery (below) and
//! the acknowledgement follow for all commits received meanwhile at most
//! every 5 ms: one snapshot query per commit would cost the primary more
//! than the writes it follows. A second, ordinary connection does the slot
//! bookkeeping of a permanent slot, the checks and the visibility queries
//! (a walsender runs no SQL while it streams).
//!
//! # Streamed or polled
//! Streaming wakes the slot's walsender at every commit, in the writers'
//! commit path, and on a primary without a spare core the walsenders'
//! decoding and wake-ups come out of the writers' TPS.
//! `database.wal_poll_interval` makes the feed poll instead (the polled
//! transport of `session`): one ordinary connection holds
//! the slot and, once per interval, asks it with
//! `pg_logical_slot_peek_binary_changes` for every transaction committed
//! since, decoded in one go (protocol 1: whole transactions, no
//! streaming). The polls take about as much of the primary's CPU as the
//! walsenders do, but in a few bursts instead of a wake-up per commit;
//! where writers fill every core, the decoding's CPU comes out of their
//! TPS in either mode. Commit-to-servable grows by about one interval. The price
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
//! changes (or key bytes) than `assemble` holds per transaction,
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
//! (tests/it/feed/wal/events.rs) and against RFC 7677's SCRAM example.
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
//! - the server is not the one the last stream came from (see below).
//!
//! A permanent slot that resumes at or before the position (on the same
//! timeline) replays what was applied already: no rebuild. A permanent slot another backend holds
//! is waited for (the feed is not streaming, so the gateway is not ready,
//! and says which PID holds it); the polled feed takes a session advisory
//! lock on the slot's name as well, since polling holds the slot only
//! during each poll.
//!
//! # A new server
//! Positions carry their timeline ([`Position`]): LSNs of two timelines
//! are not comparable (see `db::position`). Every session reads the
//! primary's [`Server`] (system identifier, timeline, postmaster start
//! time) on its SQL connection before it opens the slot, and, streamed,
//! checks with `IDENTIFY_SYSTEM` that the replication connection reaches
//! the same system and timeline (during a failover the two connections
//! may reach different servers behind one address: the session is then
//! tried again). A server other than the last session's (a promoted
//! standby on the primary's address, a restore, a restart that may have
//! lost `synchronous_commit = off` commits other sessions had read) is a
//! gap, unless it is a promotion the permanent slot survived and [`fork`]
//! proves the stream from it misses nothing of the new history: a
//! temporary or new slot starts past what the old server had that the new
//! one lacks, and a slot that survived (PostgreSQL 17's failover slots,
//! Patroni's permanent slots) may stand past the fork. A proven promotion
//! is [`Event::Fork`]: caches emptied, filters kept where their builds
//! saw nothing the new timeline lost. The heartbeat's read of
//! the flush position reads the timeline too, so a side connection that
//! was replaced mid-session and reached another server ends the session.
//!
//! # Heartbeats and checks
//! Every [`HEARTBEAT_EVERY`] the feed reads the primary's [`Server`] and
//! its insert and flush positions on the side connection
//! (`db::position::Server::read`, one round trip) and asks the server for
//! a keepalive; a keepalive that comes with nothing half read and reports
//! the server has sent up to the *insert* position or past it means every
//! commit visible at the moment of the reading has been received (see
//! "What a reading proves" in `db::position`: a commit made with
//! `synchronous_commit = off` is visible before it is flushed, and no
//! delay of the WAL writer is assumed). A keepalive that reaches the flush
//! position but not the insert position makes the feed force the flush
//! (`db::position::flush_wal`), once per reading: the rest may be WAL of a
//! transaction still open, left on a partial page. Once those are
//! delivered at `Visible` and applied, the feed sends [`Event::Heartbeat`]
//! with that moment. Polled, a poll that returned everything below the
//! flush position it read does the same, when that flush position had
//! reached the insert position read with it (else it forces the flush, and
//! the next poll proves). A reading of another [`Server`] than the
//! session's ends the session. Every
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

pub(crate) mod assemble;
mod deps;
mod fork;
pub mod pgoutput;
pub mod replication;
mod session;
mod slot;
mod stats;
mod transport;

pub use slot::BrokenSlot;
use slot::broken_at;
pub use stats::{Stats, WalSnapshot};

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgConnection};
use sqlx::{Connection, Row};
use tokio::sync::{mpsc, oneshot, watch};

use super::tracker::Tracker;
use super::{Event, Health, Lsn, NotStarted, Position, PrepareError, Server, Watch};
use crate::db::publication;
use crate::shutdown::Shutdown;
use crate::telemetry::LogThrottle;
use replication::ReplError;

/// How the feed connects and what it reads.
#[derive(Clone)]
pub struct WalOptions {
    pub connect: PgConnectOptions,
    pub publication: String,
    /// A permanent slot's name, or `None` for a temporary one.
    pub slot: Option<String>,
    /// The password for the replication connection (sqlx keeps the pool's
    /// to itself); see [`replication::Endpoint::new`].
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
    /// How far the consumer of this feed already has every change (see "No
    /// gap"): a permanent slot found past it, or created, is a gap. `None`:
    /// nothing depends on the feed yet. The bus's relay passes the stream's
    /// newest position, so a slot someone else advanced is a gap of the bus.
    /// A position on another timeline than the server's is a gap too.
    pub start_position: Option<Position>,
    /// The server `start_position` was applied from, when it is not this
    /// process's own last stream: the bus's relay, continuing the stream
    /// of the epoch before a promotion, passes that epoch's server, so
    /// that the first session judges the promotion as a feed that had
    /// streamed from it would (see `fork`). `None`: nothing before.
    pub start_server: Option<Server>,
    /// Confirm a position received while idle only as far as `applied`
    /// reaches, not as soon as every commit received is applied. The relay
    /// sets it: its `applied` is what the bus holds, heartbeats included,
    /// and a slot confirmed past the bus would make the next relay see a
    /// gap that is none.
    pub idle_confirm_applied: bool,
    /// Where the permanent slot stood when decoding it failed on a
    /// publication that did not exist; its next open here drops and creates
    /// it again if it still stands there (see [`BrokenSlot`]).
    pub broken_slot: Arc<BrokenSlot>,
    /// The gateway's connections, held to the server this feed streams from
    /// (see `db::identity`): each session names it, and one of them that
    /// reached another server ends the session, so that the next follows
    /// the address. `None`: a feed the gateway's connections do not follow
    /// (the bus's relay).
    pub identity: Option<Arc<crate::db::identity::Identity>>,
}

impl std::fmt::Debug for WalOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the password.
        f.debug_struct("WalOptions")
            .field("publication", &self.publication)
            .field("slot", &self.slot)
            .field("poll", &self.poll)
            .field("silence_limit", &self.silence_limit)
            .field("install", &self.install)
            .field("start_position", &self.start_position)
            .field("start_server", &self.start_server)
            .finish_non_exhaustive()
    }
}

/// What start-up checks before it chooses this feed; see [`check`].
#[derive(Debug)]
pub struct Prerequisites {
    pub wal_level: String,
    pub can_replicate: bool,
}

/// `wal_level` and whether the role may use replication slots.
pub async fn prerequisites(pool: &sqlx::PgPool) -> Result<Prerequisites, sqlx::Error> {
    let row = sqlx::query(
        "SELECT current_setting('wal_level') AS wal_level,
                (SELECT rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user) AS can",
    )
    .fetch_one(pool)
    .await?;
    Ok(Prerequisites {
        wal_level: row.get("wal_level"),
        can_replicate: row.get::<Option<bool>, _>("can").unwrap_or(false),
    })
}

/// What the feed needs from the database, each missing piece as an error
/// naming its fix: `wal_level`, the role's `REPLICATION`, a publication
/// that delivers every change of every watched table, and a replica
/// identity that carries the key on UPDATE and DELETE.
pub async fn check(
    pool: &sqlx::PgPool,
    watch: &Watch,
    publication: &str,
) -> Result<(), PrepareError> {
    let failed = |what| move |source| PrepareError::Db { what, source };
    let r = prerequisites(pool)
        .await
        .map_err(failed("reading wal_level and the role's REPLICATION"))?;
    if r.wal_level != "logical" {
        return Err(PrepareError::Refused(format!(
            "database.freshness = \"wal\" needs wal_level = logical (it is {}): set it in postgresql.conf (managed services: rds.logical_replication = 1, cloudsql.logical_decoding = on, Azure wal_level = LOGICAL) and restart, or use freshness = \"notify\"",
            r.wal_level
        )));
    }
    if !r.can_replicate {
        return Err(PrepareError::Refused("database.freshness = \"wal\" needs the REPLICATION attribute: ALTER ROLE <gateway role> REPLICATION".into()));
    }
    let mut conn = pool
        .acquire()
        .await
        .map_err(failed("reading the catalog"))?;
    let checked = publication::check(&mut conn, watch, publication)
        .await
        .map_err(failed("reading the publication"))?;
    if let Some(why) = checked.problems.into_iter().flatten().next() {
        return Err(PrepareError::Refused(why));
    }
    let identity = publication::identity_problems(&mut conn, watch)
        .await
        .map_err(failed("reading the replica identities"))?;
    match identity.into_iter().next() {
        Some(why) => Err(PrepareError::Refused(why)),
        None => Ok(()),
    }
}

/// Runs until `shutdown` fires or the gateway goes (`tx` closes). `ready`
/// gets `Ok` once the stream has started (before the first scan). A
/// session that fails, or cannot start (the slot is held by another
/// backend, the publication is gone, the server is down), is tried again
/// after a back-off, saying why in `health` and in the log (once per
/// interval).
#[allow(clippy::too_many_arguments)]
pub async fn run(
    opts: WalOptions,
    watch: Watch,
    tx: mpsc::Sender<Event>,
    mut applied: watch::Receiver<Position>,
    stats: Arc<Stats>,
    health: Arc<Health>,
    ready: oneshot::Sender<Result<(), NotStarted>>,
    mut shutdown: Shutdown,
) {
    let (position, server) = (opts.start_position, opts.start_server);
    let shapes = super::tracker::Shapes::new(&watch);
    let mut feed = Feed {
        opts,
        watch: Arc::new(watch),
        tx,
        stats,
        health,
        position,
        server,
        changed: None,
        kept_slot: None,
        history: None,
        tracker: Tracker::default(),
        shapes,
        streamed: false,
        slot_seen: None,
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
        feed.streamed = false;
        feed.slot_seen = None;
        feed.kept_slot = None;
        feed.history = None;
        let r = session::run(&mut feed, &mut applied, &temp_name, &mut shutdown).await;
        if feed.tx.is_closed() || shutdown.is_fired() {
            return;
        }
        let Err(e) = r else { return };
        let why = e.to_string();
        // Decoding past a dropped publication fails from the same place
        // every time: a permanent slot must start again elsewhere.
        if feed.opts.slot.is_some() && e.is_missing_publication() {
            feed.opts
                .broken_slot
                .mark(broken_at(feed.slot_seen, feed.position));
        }
        feed.health.waiting(why.clone());
        if feed.tx.send(Event::Interrupted(why.clone())).await.is_err() {
            return;
        }
        if feed.streamed {
            delay = RETRY_FIRST;
        }
        if let Some(not_logged) = feed.throttle.permit() {
            tracing::warn!(error = %why, retry_in = ?delay, not_logged, "WAL change feed not streaming; trying again");
        }
        feed.stats.reconnects.fetch_add(1, Ordering::Relaxed);
        feed.health.reconnected();
        tokio::select! {
            () = shutdown.fired() => return,
            () = tokio::time::sleep(delay) => {}
        }
        delay = (delay * 2).min(RETRY_MAX);
    }
}

/// The first wait before a session is tried again; it doubles up to
/// [`RETRY_MAX`], and starts over after a session that streamed.
const RETRY_FIRST: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(5);

/// The feed across its sessions: what it was given, and what one session
/// hands the next.
struct Feed {
    opts: WalOptions,
    watch: Arc<Watch>,
    tx: mpsc::Sender<Event>,
    stats: Arc<Stats>,
    health: Arc<Health>,
    /// How far this process has applied (see "No gap"); `None` until a
    /// stream has started: nothing depends on the feed yet.
    position: Option<Position>,
    /// The server the last session that started streamed from (see "A new
    /// server" in the module doc).
    server: Option<Server>,
    /// A change of server found at a session's start and not yet answered
    /// (a session that fails before streaming keeps it for the next): the
    /// server before, and what changed in words.
    changed: Option<(Server, String)>,
    /// This session's permanent slot, when it was kept (not created): its
    /// confirmed position (see `fork`).
    kept_slot: Option<Lsn>,
    /// The new timeline's history, read on this session's replication
    /// connection when the timeline changed (see `fork`).
    history: Option<String>,
    tracker: Tracker,
    /// The watched tables' shapes as last read (see "Shapes" in
    /// `feed::tracker`), kept across sessions: a rewrite while the feed was
    /// away is seen at the next session's first reading.
    shapes: super::tracker::Shapes,
    /// This session's stream started.
    streamed: bool,
    /// The permanent slot's confirmed position when this session opened it
    /// (what [`BrokenSlot`] marks, with the stream's own).
    slot_seen: Option<Position>,
    ready: Option<oneshot::Sender<Result<(), NotStarted>>>,
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

/// Silent this long, the replication connection is given up for dead (a
/// crashed host, a failover, a cut network: TCP alone could take many
/// minutes to say so). The default of [`WalOptions::silence_limit`].
pub const SILENCE_LIMIT: Duration = Duration::from_secs(30);

/// Connecting and authenticating the replication connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

/// The feed's ordinary connections: named, so an operator can tell them
/// from the pool's, and with TCP keepalives on the server's side, so that
/// a connection whose gateway vanished (a crashed host, a cut network) is
/// closed within about half a minute. That matters when polled: the
/// connection then holds the slot, and no `wal_sender_timeout` applies
/// to an ordinary backend; the system default would be two hours.
fn feed_connect(opts: &WalOptions) -> PgConnectOptions {
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
