//! The `notify` source: `LISTEN bloomgate`, fed by the triggers
//! `db::triggers` generates, turned into [`Event`]s.
//!
//! Each notification is one row change (INSERT, UPDATE, DELETE) carrying the
//! canonical text of every watched key column, old and new, or a table
//! event (TRUNCATE, RESCAN: a payload too long to carry). Notifications are
//! delivered at commit, in commit order, so every [`Commit`] sent has
//! [`Phase::Received`] only, no xid and no LSN.
//!
//! # Nothing falls through a gap
//! `ready` fires once `LISTEN` is in place, and start-up waits for it before
//! the first scan takes its snapshot: every change committed after that
//! snapshot is announced to a connection that is already listening.
//! Notifications sent while the connection is down are lost, and Postgres
//! cannot tell which, so every reconnect is followed by a [`Event::Resync`]
//! (the gateway rebuilds every filter, from a snapshot taken after `LISTEN`
//! is in place again).
//!
//! # A lost listener is replaced
//! When the listener's connection is lost (the stream ends, an error, a
//! heartbeat that fails or times out), the `PgListener` is dropped and a
//! new one connects and `LISTEN`s, and only then is the resync sent. sqlx
//! can reconnect a listener by itself (in `try_recv`, or in a query run on
//! it), moving its notification buffer to the new connection; but that
//! reconnect runs inside a future our `select!` may drop. Dropped during
//! its `LISTEN`, the new connection goes back to sqlx's pool still
//! listening and holding the buffer, and the listener connects again
//! without one: a notification that then arrives during a heartbeat's
//! query is handed to the query, which fails on it, and whether the change
//! reaches the gateway depends on stray copies. So the listener is built
//! with sqlx's eager reconnect off and never reused after a loss (`tests/it/feed/freshness.rs`,
//! `a_listener_reconnect_cut_short_loses_no_notification`).
//!
//! # Heartbeats and checks
//! Every [`HEARTBEAT_EVERY`] the source makes a round trip on the
//! listener's own connection. A listening session is sent the
//! notifications of every transaction that committed before its query
//! arrived ahead of the query's answer (the server delivers pending
//! notifications before `ReadyForQuery`), so once the answer is in, every
//! change committed before the query began has been received:
//! [`Event::Heartbeat`]. Every [`CHECK_EVERY`] it checks, on a second
//! connection, each watched table and its trigger
//! ([`super::tracker::check_triggers`]): a table dropped and created again
//! has lost its trigger, a partition attached brings rows no trigger
//! announced.
//!
//! # Forged notifications
//! Anyone who can connect can `NOTIFY bloomgate`. A payload that does not
//! parse, names a table nobody watches or an unknown op is dropped (logged
//! at most once per interval). One that does parse is applied like a real
//! one: the gateway treats its keys as *announced*, not trusted (see
//! `resource`), and coalesces the rebuilds it asks for. A forged `RESCAN`
//! is a gap of its table like a real one: until the rebuild it asks for,
//! keys its filters reject are checked against the database within
//! `filter.verify_budget`, and answered 503 past it.
//!
//! # A hot standby
//! `LISTEN` cannot run during recovery. Rather than retrying forever, the
//! source checks `pg_is_in_recovery()` first and fails `ready` with an error
//! naming the cause; start-up reports it and stops.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::Deserialize;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgListener};
use tokio::sync::{mpsc, oneshot};

use super::tracker::{Shapes, Tracker};
use super::{
    CHECK_EVERY, Columns, Commit, Event, HEARTBEAT_EVERY, Health, NotStarted, Op, Phase, Resync,
    RowChange, TableName, Value, Watch,
};
use crate::db::identity::Identity;
use crate::db::position::Server;
use crate::db::triggers::Sink;
use crate::shutdown::Shutdown;
use crate::telemetry::LogThrottle;

pub use crate::db::triggers::CHANNEL;

/// The source's counters, live (see `NotifySnapshot` for their reading
/// at one moment), shared with whoever reports them.
#[derive(Debug, Default)]
pub struct Stats {
    /// Notifications received on the channel (junk included).
    pub notifications: AtomicU64,
    /// Times the connection was lost and `LISTEN` re-established.
    pub listener_reconnects: AtomicU64,
    /// Trigger time to receipt of the latest notification, in microseconds.
    pub last_notification_lag_us: AtomicU64,
}

impl Stats {
    /// The counters as of now.
    pub fn snapshot(&self) -> NotifySnapshot {
        NotifySnapshot {
            notifications: self.notifications.load(Ordering::Relaxed),
            listener_reconnects: self.listener_reconnects.load(Ordering::Relaxed),
            last_lag_seconds: self.last_notification_lag_us.load(Ordering::Relaxed) as f64 / 1e6,
        }
    }
}

/// The notify or queue feed's counters at one moment.
#[derive(Clone, Copy, Debug, Default)]
pub struct NotifySnapshot {
    /// Notify: notifications received. Queue: change rows read.
    pub notifications: u64,
    /// Notify: reconnects. Queue: failed polls.
    pub listener_reconnects: u64,
    /// Trigger to receipt of the latest notification or change row.
    pub last_lag_seconds: f64,
}

pub struct NotifyOptions {
    /// Where to listen: the primary (a standby cannot `LISTEN`).
    pub connect: PgConnectOptions,
    pub counters: Arc<Stats>,
    pub health: Arc<Health>,
    /// `database.install_triggers`: a check that finds a trigger missing or
    /// outdated installs it (and rescans its table).
    pub install: bool,
    /// The gateway's connections follow the server the listener reached
    /// (see `db::identity`); one of them that reached another is a move.
    pub identity: Arc<Identity>,
}

/// The feed's connections, as `pg_stat_activity` shows them.
pub const APPLICATION_NAME: &str = "bloomgate-notify-feed";

/// Why the source cannot start.
#[derive(Debug, thiserror::Error)]
pub enum NotifyError {
    #[error(
        "the database is a hot standby (pg_is_in_recovery() is true): LISTEN cannot run during recovery, so key changes cannot be followed there; point database.url at the primary (or set database.freshness = \"off\")"
    )]
    Standby,
    #[error("cannot LISTEN: {0}")]
    Refused(sqlx::Error),
}

#[derive(Debug, Deserialize)]
struct Payload {
    table: String,
    op: String,
    new: Option<BTreeMap<String, Option<String>>>,
    old: Option<BTreeMap<String, Option<String>>>,
    ts: Option<f64>,
}

/// Listens until `shutdown` fires or `tx` closes. `ready` gets `Ok` once
/// the first `LISTEN` is in place and the first check is done, or the error
/// that prevents it for good (a standby); transient failures are retried.
pub async fn run(
    opts: NotifyOptions,
    watch: Watch,
    tx: mpsc::Sender<Event>,
    ready: oneshot::Sender<Result<(), NotStarted>>,
    mut shutdown: Shutdown,
) {
    // The listener holds its connection for good; the other is for the
    // checks.
    let mut pool = super::private_pool(&opts.connect, APPLICATION_NAME);
    let (mut listener, mut server) = match connect(&pool).await {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(error = %e, "cannot follow key changes");
            let _ = ready.send(Err(e.into()));
            return;
        }
    };
    opts.identity.follow(server);
    let counters = &opts.counters;
    let mut tracker = Tracker::default();
    let mut shapes = Shapes::new(&watch);
    let mut ready = Some(ready);
    // A loop of junk must not become a flood of log lines.
    let ignored = LogThrottle::default();
    let mut beat = tokio::time::interval(HEARTBEAT_EVERY);
    beat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // As if checked long ago: the first heartbeat checks.
    let mut checked: Option<Instant> = None;
    // The backend the listener is on: sqlx reconnects its listener by
    // itself (in `try_recv`, and in a query run on it), and a reconnect it
    // made inside a future dropped by the `select!` below is never
    // reported; a heartbeat that finds another backend is that reconnect.
    let mut backend: Option<i32> = None;
    let mut events = Vec::new();
    let mut lost: Option<String> = None;
    loop {
        tokio::select! {
            // The notifications received are applied already; the
            // connections go with the listener and the pool.
            () = shutdown.fired() => return,
            n = listener.try_recv() => match n {
                Ok(Some(n)) => {
                    counters.notifications.fetch_add(1, Ordering::Relaxed);
                    received(&watch, n.payload(), counters, &ignored, &mut events);
                }
                Ok(None) => lost = Some(String::from("connection lost")),
                Err(e) => lost = Some(e.to_string()),
            },
            _ = beat.tick() => {
                // A connection of the gateway reached another server than
                // the listener's (an address moved): listen again where the
                // address leads, on connections of a new pool.
                if let Some(found) = opts.identity.take_mismatch()
                    && let Some(change) = found.change_from(&server)
                {
                    pool = super::private_pool(&opts.connect, APPLICATION_NAME);
                    lost = Some(format!("a connection of the gateway reached another server ({change})"));
                } else {
                let due = checked.is_none_or(|at| at.elapsed() >= CHECK_EVERY);
                match heartbeat(&mut listener, &pool, &watch, &opts, &mut tracker, &mut shapes, due).await {
                    Ok((at, pid, checks)) => {
                        if backend.is_some_and(|b| b != pid) {
                            opts.health.reconnected();
                            events.push(reconnected(counters, "the listener's connection was replaced"));
                            // sqlx reconnected it: to whatever the address
                            // leads to now.
                            match Server::read(&mut listener).await {
                                Ok((s, _)) => {
                                    server = s;
                                    opts.identity.follow(s);
                                }
                                Err(e) => lost = Some(format!("reading the listener's server: {e}")),
                            }
                        }
                        backend = Some(pid);
                        // Notifications that came with the round trip first:
                        // they committed before `at`.
                        while let Some(n) = listener.next_buffered() {
                            counters.notifications.fetch_add(1, Ordering::Relaxed);
                            received(&watch, n.payload(), counters, &ignored, &mut events);
                        }
                        if due {
                            checked = Some(Instant::now());
                        }
                        events.extend(checks);
                        events.push(Event::Heartbeat(at));
                        opts.health.streaming();
                        if let Some(ready) = ready.take() {
                            // Sent after these events: start-up's scan
                            // follows what they say.
                            for e in std::mem::take(&mut events) {
                                if tx.send(e).await.is_err() {
                                    return;
                                }
                            }
                            let _ = ready.send(Ok(()));
                        }
                    }
                    // The round trip on the listener failed or timed out:
                    // its connection is in no state to trust.
                    Err(Beat::Listener(e)) => lost = Some(format!("heartbeat: {e}")),
                    // The second connection's checks: the next ones retry.
                    Err(Beat::Checks(e)) => tracing::debug!(error = %e, "notify feed checks failed"),
                }
                }
            }
        }
        // A listener whose connection was lost is dropped, never reused:
        // see "A lost listener is replaced" in the module doc.
        if let Some(why) = lost.take() {
            tracing::warn!(error = %why, "notification listener lost; listening again");
            opts.health.waiting(format!("notification listener: {why}"));
            if tx.send(Event::Interrupted(why.clone())).await.is_err() {
                return;
            }
            drop(listener);
            // A pool of its own for the new listener: the old one's
            // connection stays in its pool's hands until its UNLISTEN
            // returns (sqlx's drop), which on a frozen server is as long
            // as TCP waits, and the checks would find no connection left.
            pool = super::private_pool(&opts.connect, APPLICATION_NAME);
            (listener, server) = tokio::select! {
                () = shutdown.fired() => return,
                l = listen_again(&pool) => l,
            };
            opts.identity.follow(server);
            opts.health.reconnected();
            backend = None;
            // Checked before the next heartbeat vouches: the listener may
            // have reached another server, whose tables and triggers are
            // not those last checked.
            checked = None;
            events.push(reconnected(counters, &why));
        }
        for e in std::mem::take(&mut events) {
            if tx.send(e).await.is_err() {
                return;
            }
        }
    }
}

/// How long a heartbeat's round trip, and its checks, may take before the
/// connection is taken for hung.
const BEAT_WITHIN: Duration = Duration::from_secs(5);

/// One heartbeat: a round trip on the listener's own connection (the
/// server sends the notifications of every transaction committed before
/// the query arrived ahead of its answer, see "Nothing falls through a
/// gap"), with the watched tables' shapes (a rewrite, see "Shapes" in
/// `feed::tracker`), and, when `check`, the checks on the pool's other
/// connection. Returns the moment the round trip began, the listener's
/// backend and what the shapes and the checks found.
#[allow(clippy::too_many_arguments)]
async fn heartbeat(
    listener: &mut PgListener,
    pool: &PgPool,
    watch: &Watch,
    opts: &NotifyOptions,
    tracker: &mut Tracker,
    shapes: &mut Shapes,
    check: bool,
) -> Result<(Instant, i32, Vec<Event>), Beat> {
    let at = Instant::now();
    let events = if check {
        let mut conn = pool.acquire().await.map_err(Beat::Checks)?;
        // Bounded as the listener's round trip is: a connection to a
        // frozen server would hold this heartbeat, and every later one,
        // for as long as TCP waits. Closed, not returned: sqlx's ping on
        // return would hang on it and hold its pool slot as long.
        let checked = tokio::time::timeout(
            BEAT_WITHIN,
            super::tracker::check_triggers(&mut conn, watch, Sink::Notify, opts.install, tracker),
        )
        .await;
        match checked {
            Ok(r) => r.map_err(Beat::Checks)?,
            Err(_) => {
                conn.close_on_drop();
                return Err(Beat::Checks(sqlx::Error::Io(
                    std::io::ErrorKind::TimedOut.into(),
                )));
            }
        }
    } else {
        Vec::new()
    };
    let sql = format!("SELECT pg_backend_pid(), {}", Shapes::sql(1, 2));
    let (pid, tables): (i32, Vec<Option<String>>) = tokio::time::timeout(
        BEAT_WITHIN,
        sqlx::query_as(&sql)
            .bind(shapes.names())
            .bind(shapes.columns())
            .fetch_one(&mut *listener),
    )
    .await
    .map_err(|_| Beat::Listener(sqlx::Error::Io(std::io::ErrorKind::TimedOut.into())))?
    .map_err(Beat::Listener)?;
    let mut events = events;
    let rewritten = shapes.update(watch, tables);
    if opts.install
        && !rewritten.is_empty()
        && let Ok(mut conn) = pool.acquire().await
    {
        super::tracker::replace_triggers(&mut conn, watch, &rewritten, Sink::Notify).await;
    }
    events.extend(rewritten);
    Ok((at, pid, events))
}

/// Which connection a heartbeat failed on.
enum Beat {
    /// The listener's: it is replaced.
    Listener(sqlx::Error),
    /// The checks': they are made again at the next heartbeat.
    Checks(sqlx::Error),
}

/// A new listener, however long it takes: a failover to a standby is
/// waited out, the primary may come back.
async fn listen_again(pool: &PgPool) -> (PgListener, Server) {
    loop {
        match connect(pool).await {
            Ok(l) => return l,
            Err(e) => {
                tracing::warn!(error = %e, "cannot LISTEN again yet");
                tokio::time::sleep(Duration::from_secs(5)).await;
            }
        }
    }
}

/// One notification's event, if it is one (junk logged within `ignored`).
fn received(
    watch: &Watch,
    payload: &str,
    counters: &Stats,
    ignored: &LogThrottle,
    events: &mut Vec<Event>,
) {
    match parse(watch, payload, counters) {
        Ok(Some(e)) => events.push(e),
        Ok(None) => {}
        Err(why) => {
            if let Some(not_logged) = ignored.permit() {
                tracing::warn!(problem = %why, not_logged, "ignoring a notification");
            }
        }
    }
}

/// Connects and `LISTEN`s, retrying transient failures with capped
/// back-off; a standby (or a refusal that retrying cannot fix) is returned.
async fn connect(pool: &PgPool) -> Result<(PgListener, Server), NotifyError> {
    let mut delay = Duration::from_millis(100);
    loop {
        let attempt = async {
            let mut l = PgListener::connect_with(pool).await?;
            // sqlx would otherwise reconnect inside `try_recv` and hand the
            // notification buffer to the new connection there; a `select!`
            // that drops that future mid-reconnect loses the buffer, and
            // with it every notification that later arrives during a
            // heartbeat (the module doc, "A lost listener is replaced").
            l.eager_reconnect(false);
            // Checked on the listener's own connection: the server it
            // actually reached.
            let standby: bool = sqlx::query_scalar("SELECT pg_is_in_recovery()")
                .fetch_one(&mut l)
                .await?;
            if standby {
                return Ok(Err(NotifyError::Standby));
            }
            // The server the listener reached: the one this feed follows,
            // and every connection of the gateway with it (`db::identity`).
            let (server, _) = Server::read(&mut l).await?;
            l.listen(CHANNEL).await?;
            Ok::<_, sqlx::Error>(Ok((l, server)))
        };
        match attempt.await {
            Ok(r) => return r,
            // 25006: read-only transaction ("cannot execute LISTEN during
            // recovery"), should the server enter recovery in between.
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("25006") => {
                return Err(NotifyError::Refused(sqlx::Error::Database(e)));
            }
            Err(e) => {
                tracing::warn!(error = %e, retry_in = ?delay, "cannot subscribe to key changes yet");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(5));
            }
        }
    }
}

/// Changes may have been missed while the connection was down.
fn reconnected(counters: &Stats, why: &str) -> Event {
    counters.listener_reconnects.fetch_add(1, Ordering::Relaxed);
    tracing::warn!(
        reason = why,
        "notification listener reconnected; every filter is rebuilt in case changes were missed"
    );
    Resync::all(format!("notify: {why}"))
}

/// One payload to an event: `Ok(None)` for a table nobody watches (a
/// trigger left from another config), `Err` for junk. The message is safe to
/// log (no payload text).
pub(super) fn parse(
    watch: &Watch,
    payload: &str,
    counters: &Stats,
) -> Result<Option<Event>, String> {
    let p: Payload = serde_json::from_str(payload).map_err(|e| format!("not a payload: {e}"))?;
    let Some(watched) = watch.tables.iter().find(|t| *t.name == *p.table) else {
        return Ok(None);
    };
    let table: TableName = watched.name.clone();
    let ts = p.ts.filter(|t| t.is_finite() && *t > 0.0);
    if let Some(ts) = ts {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs_f64();
        let lag_us = ((now - ts).max(0.0) * 1e6) as u64;
        counters
            .last_notification_lag_us
            .store(lag_us, Ordering::Relaxed);
    }
    // Only the watched columns, under the watch's names (shared Arcs).
    let columns = |m: Option<BTreeMap<String, Option<String>>>| {
        m.map(|mut m| {
            Columns(
                watched
                    .columns
                    .iter()
                    .filter_map(|c| {
                        let v = m.remove(&*c.name)?;
                        Some((c.name.clone(), v.map_or(Value::Null, Value::Text)))
                    })
                    .collect(),
            )
        })
    };
    let op = match p.op.as_str() {
        "INSERT" => Op::Insert,
        "UPDATE" => Op::Update,
        "DELETE" => Op::Delete,
        "TRUNCATE" => {
            return Ok(Some(Event::Commit(commit(ts, Vec::new(), vec![table]))));
        }
        "RESCAN" => {
            return Ok(Some(Resync::table(
                table,
                "notify: a change too large to announce",
            )));
        }
        other => {
            // Debug-quoted and cut short: the text is whatever the sender
            // chose, newlines included.
            let op: String = other.chars().take(32).collect();
            return Err(format!("unknown op {op:?}"));
        }
    };
    let (new, old) = (columns(p.new), columns(p.old));
    let well_formed = match op {
        Op::Insert => new.is_some(),
        Op::Update => new.is_some(),
        Op::Delete => old.is_some(),
    };
    if !well_formed {
        return Err(format!("{op:?} without the row it needs"));
    }
    let change = RowChange {
        table,
        op,
        new,
        old,
    };
    Ok(Some(Event::Commit(commit(ts, vec![change], Vec::new()))))
}

fn commit(ts: Option<f64>, changes: Vec<RowChange>, truncated: Vec<TableName>) -> Commit {
    Commit {
        xid: None,
        position: None,
        committed_at: ts.and_then(|t| UNIX_EPOCH.checked_add(Duration::try_from_secs_f64(t).ok()?)),
        phase: Phase::Received,
        changes,
        truncated,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::feed::{ColumnType, WatchedColumn, WatchedTable};

    fn watch() -> Watch {
        let col = |n: &str| WatchedColumn {
            name: Arc::from(n),
            ty: ColumnType::Text,
        };
        Watch {
            tables: vec![WatchedTable {
                name: Arc::from("public.users"),
                columns: vec![col("id"), col("email")],
                keys: Vec::new(),
                served: Vec::new(),
            }],
        }
    }

    fn event(payload: &str) -> Result<Option<Event>, String> {
        parse(&watch(), payload, &Stats::default())
    }

    #[test]
    fn an_update_carries_every_watched_key_old_and_new() {
        let e = event(
            r#"{"table":"public.users","op":"UPDATE","new":{"id":"1","email":"b@x","other":"z"},
                "old":{"id":"1","email":null},"ts":1700000000.5}"#,
        )
        .unwrap()
        .unwrap();
        let Event::Commit(c) = e else { panic!() };
        assert_eq!((c.position, c.phase), (None, Phase::Received));
        assert!(c.committed_at.is_some());
        let ch = &c.changes[0];
        assert_eq!((&*ch.table, ch.op), ("public.users", Op::Update));
        let new = ch.new.as_ref().unwrap();
        assert_eq!(new.get("email"), Some(&Value::Text("b@x".into())));
        assert_eq!(new.get("other"), None, "unwatched columns are dropped");
        assert_eq!(ch.old.as_ref().unwrap().get("email"), Some(&Value::Null));
    }

    #[test]
    fn table_events_and_junk() {
        assert!(matches!(
            event(r#"{"table":"public.users","op":"RESCAN"}"#),
            Ok(Some(Event::Resync(Resync { scope: crate::feed::Scope::Table(t), .. }))) if &*t == "public.users"
        ));
        let Ok(Some(Event::Commit(c))) = event(r#"{"table":"public.users","op":"TRUNCATE"}"#)
        else {
            panic!()
        };
        assert_eq!(c.truncated.len(), 1);
        assert!(c.changes.is_empty());
        // Another config's table: not ours, not junk.
        assert!(matches!(
            event(r#"{"table":"public.other","op":"INSERT","new":{}}"#),
            Ok(None)
        ));
        // The old payload format names the table `users`: not watched.
        assert!(matches!(
            event(r#"{"table":"users","op":"INSERT","key":"1"}"#),
            Ok(None)
        ));
        for junk in [
            "junk",
            r#"{"table":"public.users","op":"DROP\nFORGED"}"#,
            r#"{"table":"public.users","op":"INSERT"}"#,
            r#"{"table":"public.users","op":"DELETE","new":{"id":"1"}}"#,
        ] {
            let e = event(junk).unwrap_err();
            assert!(!e.contains('\n'), "{e}");
        }
    }
}
