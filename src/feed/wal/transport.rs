//! How a session reads its slot: over the replication protocol's
//! `CopyBoth` stream ([`Streamed`]), or with SQL once per interval
//! ([`Polled`]). Each delivers pgoutput messages and positions in stream
//! order, says what proves the feed current, confirms a position to the
//! slot, and tells the server the feed is alive while it waits.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::Bytes;
use sqlx::PgConnection;
use sqlx::Row;

use super::{CONNECT_TIMEOUT, Feed, SessionError, Stats, bounded, slot};
use crate::db::position::flush_wal;
use crate::feed::probes::{Gap, Probes};
use crate::feed::tracker::Shapes;
use crate::feed::wal::replication::{self, Endpoint, Frame, ReplError, Stream};
use crate::feed::{HEARTBEAT_EVERY, Lsn, Server};

/// How often the feed tells the server its position when nothing else
/// made it (well inside `wal_sender_timeout`, 60 s by default). The
/// session waits on its applier no longer than this either, so a reply
/// is never owed longer.
pub(super) const STATUS_EVERY: Duration = Duration::from_secs(1);

/// Frames taken into one batch at most: one visibility check and one
/// acknowledgement cover them all.
const BATCH_FRAMES: usize = 10_000;

/// Changes one poll asks for at most: decoding stops at the first commit
/// past this many rows, so a batch holds whole transactions.
const POLL_CHANGES: i32 = 10_000;

/// A poll (or a slot advance, which decodes the same range again) that
/// takes longer than this many silence limits (300 s by default) is
/// taken for a dead connection. Generous: a poll after a long pause, or
/// with a long transaction open, decodes everything written since.
const POLL_TIMEOUT_LIMITS: u32 = 10;

/// What a transport delivers, in stream order.
pub(super) enum Item {
    /// One pgoutput message.
    Data(Bytes),
    /// Everything before this position has been sent.
    Position(Lsn),
    /// The watched tables' shapes, read with the reading a later position
    /// may prove (see "Shapes" in `feed::tracker`).
    Shapes(Vec<Option<String>>),
}

/// Received up to (reported to the server as written), and applied up to
/// (reported as flushed: the slot's confirmed position).
pub(super) struct Positions {
    pub(super) received: Lsn,
    pub(super) confirmed: Lsn,
}

/// How a session reads its slot.
pub(super) enum Transport {
    Streamed(Streamed),
    Polled(Polled),
}

impl Transport {
    /// The next changes and positions, in order: waits up to `wait` for
    /// the first (streamed), or until the next poll is due (polled).
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn receive(
        &mut self,
        conn: &mut PgConnection,
        wait: Duration,
        pos: &mut Positions,
        stats: &Stats,
        shapes: &Shapes,
        items: &mut Vec<Item>,
    ) -> Result<(), SessionError> {
        match self {
            Transport::Streamed(s) => s.receive(conn, wait, pos, stats, shapes, items).await,
            Transport::Polled(p) => p.receive(conn, stats, shapes, items).await,
        }
    }

    /// The moment that a position received with nothing half read proves
    /// every commit before it was received, if it does.
    pub(super) fn proves(&mut self, at: Lsn) -> Option<Instant> {
        match self {
            Transport::Streamed(s) => s.proves(at),
            Transport::Polled(p) => p.proves(at),
        }
    }

    /// Polled, each poll is a batch of its own; streamed, batches are
    /// checked for visibility at most every [`VISIBLE_EVERY`].
    pub(super) fn delivers_every_turn(&self) -> bool {
        matches!(self, Transport::Polled(_))
    }

    /// Tells the server the feed is alive while it waits.
    pub(super) async fn keep_alive(&mut self, pos: &Positions) -> Result<(), SessionError> {
        match self {
            Transport::Streamed(s) => Ok(s
                .stream
                .send_status(pos.received, pos.confirmed, false)
                .await?),
            Transport::Polled(_) => Ok(()),
        }
    }

    /// Confirms `pos.confirmed` to the slot when it `moved` (and, streamed,
    /// reports when the server asked or a second passed).
    pub(super) async fn confirm(
        &mut self,
        conn: &mut PgConnection,
        pos: &Positions,
        moved: bool,
        stats: &Stats,
    ) -> Result<(), SessionError> {
        match self {
            Transport::Streamed(s) => {
                if moved || s.reply_owed || s.told.elapsed() >= STATUS_EVERY {
                    s.stream
                        .send_status(pos.received, pos.confirmed, false)
                        .await?;
                    s.reply_owed = false;
                    s.told = Instant::now();
                    stats.applied_lsn.store(pos.confirmed.0, Ordering::Relaxed);
                }
                Ok(())
            }
            Transport::Polled(p) => {
                if moved {
                    p.advance(conn, pos.confirmed, stats).await?;
                }
                Ok(())
            }
        }
    }
}

/// The replication protocol's `CopyBoth` stream.
pub(super) struct Streamed {
    stream: Stream,
    /// Last frame from the server.
    heard: Instant,
    /// Last status sent to it.
    told: Instant,
    /// The last heartbeat's request for a keepalive.
    asked: Instant,
    /// The primary's reading for a heartbeat, one at a time, until a
    /// keepalive proves its insert position sent (see "Heartbeats and
    /// checks"); of the session's server only.
    probes: Probes,
    /// The flush was forced for the reading held, once
    /// (`db::position::flush_wal`).
    forced: bool,
    /// The furthest position a keepalive reported, now and at the last
    /// heartbeat.
    reached: Lsn,
    reached_before: Lsn,
    /// The server asked for a status.
    reply_owed: bool,
    silence_limit: Duration,
}

/// How long a slot's creation may wait before what it waits for is named.
const BLOCKED_AFTER: Duration = Duration::from_secs(2);

impl Streamed {
    pub(super) async fn open(
        feed: &mut Feed,
        conn: &mut PgConnection,
        temp_name: &str,
        server: Server,
    ) -> Result<(Transport, Lsn, bool), SessionError> {
        let timeline = server.timeline;
        let opts = &feed.opts;
        let endpoint = Endpoint::new(&opts.connect, opts.password.clone(), "bloomgate-wal-feed");
        // TLS as the pool has it: the same options.
        let tls = crate::db::tls::Tls::from_options(&opts.connect);
        let mut repl = tokio::time::timeout(
            CONNECT_TIMEOUT,
            replication::Connection::connect_with(&endpoint, &tls),
        )
        .await
        .map_err(|_| ReplError::Io(std::io::ErrorKind::TimedOut.into()))??;
        let limit = opts.silence_limit;
        // The SQL connection read the server's identity; this one must
        // reach the same history (a failover can put the two on different
        // servers for a moment). The system identifier is compared only
        // where the role could read it on the SQL connection.
        let here = bounded(limit, async {
            repl.identify_system().await.map_err(SessionError::from)
        })
        .await?;
        if here.id != timeline.id || (timeline.system != 0 && here.system != timeline.system) {
            return Err(SessionError::Wait(format!(
                "the replication connection reaches {here}, the SQL connection {timeline} (a failover under way?): trying again"
            )));
        }
        // A promotion since the last stream: what the new timeline kept is
        // in its history (see `fork`). Unread, the change is a gap.
        if let Some(before) = feed.server
            && before.timeline.system == here.system
            && before.timeline.id != here.id
        {
            match bounded(limit, async {
                repl.timeline_history(here.id)
                    .await
                    .map_err(SessionError::from)
            })
            .await
            {
                Ok(h) => feed.history = Some(h),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot read the new timeline's history; the promotion is a gap");
                }
            }
        }
        let name = opts.slot.clone().unwrap_or_else(|| temp_name.to_string());
        let (start, gap) = match opts.slot.clone() {
            // On the replication connection: it lives as long as it does.
            // The creation waits for every transaction holding an xid to
            // end: what it waits for is named meanwhile (`/readyz`, the
            // log), not left as "starting".
            None => {
                let create = repl.create_slot(&name, true);
                tokio::pin!(create);
                let waits_since = crate::feed::now_ms();
                let mut named = false;
                let created = loop {
                    tokio::select! {
                        r = &mut create => break r,
                        () = tokio::time::sleep(BLOCKED_AFTER) => {
                            let found = bounded(limit, async {
                                slot::blockers(conn).await.map_err(SessionError::from)
                            })
                            .await;
                            if let Ok(Some(who)) = found {
                                let why = format!(
                                    "creating the temporary replication slot waits for {who} to end (a permanent database.slot, created once, does not wait at each start)"
                                );
                                if !named {
                                    tracing::warn!(why = %why, "WAL change feed blocked");
                                    named = true;
                                    // Blocked since the wait began, not since it was named.
                                    feed.stats
                                        .slot_blocked_since_ms
                                        .store(waits_since, Ordering::Relaxed);
                                }
                                feed.health.waiting(why);
                            }
                        }
                    }
                };
                feed.stats.slot_blocked_since_ms.store(0, Ordering::Relaxed);
                let start = created?;
                (start, feed.position.is_some())
            }
            Some(permanent) => {
                bounded(
                    limit,
                    slot::open_permanent(feed, conn, &permanent, timeline),
                )
                .await?
            }
        };
        // Protocol 2 (Postgres 14+) with streaming: a large transaction
        // comes in blocks while it runs instead of spilling to disk on the
        // server until it commits.
        let version: i32 = bounded(
            limit,
            sqlx::query_scalar("SELECT current_setting('server_version_num')::int")
                .fetch_one(&mut *conn),
        )
        .await?;
        let publications = replication::quote_ident(&feed.opts.publication);
        let mut options = vec![("publication_names", publications.as_str())];
        if version >= 140_000 {
            options.extend([("proto_version", "2"), ("streaming", "on")]);
        } else {
            options.push(("proto_version", "1"));
        }
        // Lsn::ZERO: from the slot's confirmed position.
        let stream = repl
            .start(&name, Lsn::ZERO, &options)
            .await
            .map_err(|e| slot::in_use(e.into(), &name))?;
        let now = Instant::now();
        let transport = Transport::Streamed(Streamed {
            stream,
            heard: now,
            told: now,
            // As if asked long ago: the first heartbeat is asked at once.
            asked: now.checked_sub(HEARTBEAT_EVERY).unwrap_or(now),
            probes: Probes::new(server, 1),
            forced: false,
            reached: Lsn::ZERO,
            reached_before: Lsn::ZERO,
            reply_owed: false,
            silence_limit: limit,
        });
        Ok((transport, start, gap))
    }

    async fn receive(
        &mut self,
        conn: &mut PgConnection,
        wait: Duration,
        pos: &mut Positions,
        stats: &Stats,
        shapes: &Shapes,
        items: &mut Vec<Item>,
    ) -> Result<(), SessionError> {
        if self.asked.elapsed() >= HEARTBEAT_EVERY {
            match (self.probes.oldest(), self.probes.newest()) {
                (None, _) => {
                    // Taken before the question: the insert position read
                    // then covers every commit visible by this moment.
                    let asked = Instant::now();
                    let (now, reading, tables) =
                        bounded(self.silence_limit, shapes.read_with_proof(&mut *conn)).await?;
                    items.push(Item::Shapes(tables));
                    // The whole identity, not the timeline alone: a side
                    // connection that reached another server (a restore,
                    // a restart, another cluster) proves nothing here.
                    if let Err(Gap(why)) = self.probes.read(asked, now, reading.insert.lsn) {
                        return Err(ReplError::Protocol(format!(
                            "the side connection reaches another server than the stream: {why}"
                        ))
                        .into());
                    }
                    self.forced = false;
                }
                // A heartbeat later the stream has not moved, and has not
                // sent all that was inserted: it has sent what was flushed
                // (a keepalive reports the end of the last whole record, so
                // the flush position itself, often mid-record, is no
                // test), and the rest may sit on a partial page no commit
                // flushes (a writer idle in its transaction), or behind a
                // WAL writer that is slow or stopped. Flushed by this
                // connection itself, once per reading.
                (Some(asked), Some(insert))
                    if !self.forced
                        && self.reached < insert
                        && self.reached == self.reached_before
                        && asked.elapsed() >= HEARTBEAT_EVERY =>
                {
                    bounded(self.silence_limit, flush_wal(conn)).await?;
                    stats.forced_flushes.fetch_add(1, Ordering::Relaxed);
                    self.forced = true;
                }
                _ => {}
            }
            self.reached_before = self.reached;
            // Asked again while unanswered: a walsender catching up sends
            // no keepalive of its own once it has.
            self.stream
                .send_status(pos.received, pos.confirmed, true)
                .await?;
            self.asked = Instant::now();
            self.told = self.asked;
        }
        let wait = wait.min(HEARTBEAT_EVERY.saturating_sub(self.asked.elapsed()));
        let first = match tokio::time::timeout(wait, self.stream.recv()).await {
            Ok(first) => first?,
            Err(_) => {
                // Quiet: give up on a peer that is gone (a crashed host, a
                // failover) instead of waiting for TCP. A live one answers
                // every heartbeat's request.
                let silent = self.heard.elapsed();
                if silent >= self.silence_limit {
                    return Err(ReplError::Protocol(format!(
                        "no word from the server for {}s",
                        silent.as_secs()
                    ))
                    .into());
                }
                return Ok(());
            }
        };
        self.heard = Instant::now();
        let mut next = Some(first);
        let mut taken = 0;
        while let Some(frame) = next.take() {
            match frame {
                Frame::XLogData {
                    start,
                    wal_end,
                    data,
                } => {
                    pos.received = pos.received.max(start);
                    stats
                        .lag_bytes
                        .store(wal_end.0.saturating_sub(pos.confirmed.0), Ordering::Relaxed);
                    items.push(Item::Data(data));
                }
                Frame::Keepalive {
                    wal_end,
                    reply_requested,
                } => {
                    self.reply_owed |= reply_requested;
                    self.reached = self.reached.max(wal_end);
                    stats
                        .lag_bytes
                        .store(wal_end.0.saturating_sub(pos.confirmed.0), Ordering::Relaxed);
                    items.push(Item::Position(wal_end));
                }
                Frame::End => {
                    return Err(ReplError::Protocol("the server ended the stream".into()).into());
                }
            }
            taken += 1;
            if taken < BATCH_FRAMES {
                self.stream.fill()?;
                next = self.stream.try_recv()?;
            }
        }
        Ok(())
    }

    /// A keepalive at or past the insert position read when the heartbeat
    /// asked proves every commit visible at that moment sent.
    fn proves(&mut self, at: Lsn) -> Option<Instant> {
        self.probes.reached(at)
    }
}

/// The slot polled with `pg_logical_slot_peek_binary_changes` on the
/// session's connection (see "Streamed or polled" in [`super`]): once per
/// interval, the transactions that committed before the server's flush
/// position at that moment (`upto`). A whole poll proves the moment it
/// began only when `upto` reached the insert position read with it (every
/// commit visible then ends at or before that); otherwise the flush is
/// forced (`db::position::flush_wal`) and the next poll proves.
///
/// The slot's confirmed position moves only past what was applied: to the
/// last delivered commit's end once the applier has applied it, or to
/// `upto` when the poll returned every transaction committed before it
/// (fewer rows than [`POLL_CHANGES`]). Decoding with `upto_lsn` stops
/// before the first record that starts at or past `upto`, and the server
/// skips, on the next poll, only transactions whose commit record starts
/// before the confirmed position: so nothing between two polls is skipped,
/// and a quiet publication does not hold WAL back. Such a whole poll is also
/// the heartbeat: every commit before it began is delivered.
pub(super) struct Polled {
    slot: String,
    publications: String,
    every: Duration,
    timeout: Duration,
    /// When the last poll began, and whether it was whole.
    began: Instant,
    whole: bool,
    /// The last poll was whole and its `upto` reached the insert position.
    proven: bool,
}

/// The history file of timeline `id` (`pg_wal/0000000N.history`, what
/// `TIMELINE_HISTORY` sends), read over SQL: `pg_read_file` runs for a
/// superuser, a member of `pg_read_server_files`, or a role granted it.
/// `None`: no such file.
async fn history_file(conn: &mut PgConnection, id: u32) -> Result<Option<String>, sqlx::Error> {
    sqlx::query_scalar("SELECT pg_read_file($1, 0, 1048576, true)")
        .bind(format!("pg_wal/{id:08X}.history"))
        .fetch_one(conn)
        .await
}

impl Polled {
    pub(super) async fn open(
        feed: &mut Feed,
        conn: &mut PgConnection,
        temp_name: &str,
        every: Duration,
        server: Server,
    ) -> Result<(Transport, Lsn, bool), SessionError> {
        let timeline = server.timeline;
        let limit = feed.opts.silence_limit;
        // A promotion since the last stream, as `Streamed::open` reads it,
        // but with no replication connection: the history file itself.
        if let Some(before) = feed.server
            && before.timeline.system == timeline.system
            && before.timeline.id != timeline.id
        {
            match bounded(limit, async {
                history_file(conn, timeline.id)
                    .await
                    .map_err(SessionError::from)
            })
            .await
            {
                Ok(Some(h)) => feed.history = Some(h),
                Ok(None) => {
                    tracing::warn!(
                        timeline = timeline.id,
                        "the new timeline's history file is not in pg_wal; the promotion is a gap"
                    );
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot read the new timeline's history file (pg_read_file needs pg_read_server_files or its own grant); the promotion is a gap");
                }
            }
        }
        let (slot_name, start, gap) = match feed.opts.slot.clone() {
            // Temporary: dropped when this connection ends.
            None => {
                let start = slot::create(conn, temp_name, true).await?;
                (temp_name.to_string(), start, feed.position.is_some())
            }
            Some(name) => {
                slot::lock_for_polling(conn, &name).await?;
                let (start, gap) =
                    bounded(limit, slot::open_permanent(feed, conn, &name, timeline)).await?;
                (name, start, gap)
            }
        };
        let transport = Transport::Polled(Polled {
            slot: slot_name,
            publications: replication::quote_ident(&feed.opts.publication),
            every,
            timeout: limit * POLL_TIMEOUT_LIMITS,
            // As if a whole poll ended long ago: the first is at once.
            began: Instant::now()
                .checked_sub(every)
                .unwrap_or_else(Instant::now),
            whole: true,
            proven: false,
        });
        Ok((transport, start, gap))
    }

    async fn receive(
        &mut self,
        conn: &mut PgConnection,
        stats: &Stats,
        shapes: &Shapes,
        items: &mut Vec<Item>,
    ) -> Result<(), SessionError> {
        use futures_util::TryStreamExt;
        if self.whole {
            tokio::time::sleep(self.every.saturating_sub(self.began.elapsed())).await;
        }
        self.began = Instant::now();
        // Protocol 1: the SQL interface returns whole transactions only.
        // The shapes in the same statement: read with the positions this
        // poll proves (see "Shapes" in `feed::tracker`).
        let peek = format!(
            "SELECT w.ins::text AS ins, w.upto::text AS upto, w.shapes, c.lsn::text AS lsn, c.data
               FROM (SELECT pg_current_wal_insert_lsn() AS ins,
                            pg_current_wal_flush_lsn() AS upto,
                            {} AS shapes) w
               LEFT JOIN LATERAL pg_logical_slot_peek_binary_changes(
                   $1, w.upto, $3, 'proto_version', '1', 'publication_names', $2) c ON true",
            Shapes::sql(4, 5)
        );
        let mut upto = Lsn::ZERO;
        let mut inserted = Lsn::ZERO;
        let mut tables: Option<Vec<Option<String>>> = None;
        let mut rows_seen = 0usize;
        let poll = async {
            let mut rows = sqlx::query(&peek)
                .bind(&self.slot)
                .bind(&self.publications)
                .bind(POLL_CHANGES)
                .bind(shapes.names())
                .bind(shapes.columns())
                .fetch(&mut *conn);
            while let Some(row) = rows.try_next().await? {
                upto = Lsn::parse(row.try_get("upto")?).unwrap_or(Lsn::ZERO);
                inserted = Lsn::parse(row.try_get("ins")?).unwrap_or(Lsn::ZERO);
                if tables.is_none() {
                    tables = Some(row.try_get("shapes")?);
                }
                if let Some(data) = row.try_get::<Option<&[u8]>, _>("data")? {
                    rows_seen += 1;
                    items.push(Item::Data(Bytes::copy_from_slice(data)));
                }
            }
            Ok::<(), sqlx::Error>(())
        };
        match tokio::time::timeout(self.timeout, poll).await {
            Ok(r) => r?,
            Err(_) => {
                return Err(ReplError::Protocol(format!(
                    "a poll of the slot took over {}s",
                    self.timeout.as_secs()
                ))
                .into());
            }
        }
        if let Some(tables) = tables {
            items.push(Item::Shapes(tables));
        }
        self.whole = rows_seen < POLL_CHANGES as usize;
        self.proven = self.whole && upto >= inserted;
        if self.whole && !self.proven {
            // What is inserted and not flushed may stay so (a writer idle
            // in its transaction, a WAL writer stalled): the next poll
            // finds it flushed.
            bounded(self.timeout, flush_wal(conn)).await?;
            stats.forced_flushes.fetch_add(1, Ordering::Relaxed);
        }
        if self.whole {
            items.push(Item::Position(upto));
        }
        Ok(())
    }

    /// Only a whole poll that reached the insert position read with it
    /// proves: every commit visible when it began.
    fn proves(&mut self, _at: Lsn) -> Option<Instant> {
        self.proven.then_some(self.began)
    }

    /// The advance and the lag in one round trip.
    async fn advance(
        &mut self,
        conn: &mut PgConnection,
        to: Lsn,
        stats: &Stats,
    ) -> Result<(), SessionError> {
        let lag: Option<i64> = bounded(
            self.timeout,
            sqlx::query_scalar(
                "SELECT (pg_current_wal_lsn() - $2::pg_lsn)::int8
                   FROM pg_replication_slot_advance($1, $2::pg_lsn)",
            )
            .bind(&self.slot)
            .bind(to.to_string())
            .fetch_one(conn),
        )
        .await?;
        stats.applied_lsn.store(to.0, Ordering::Relaxed);
        if let Some(lag) = lag {
            stats.lag_bytes.store(lag.max(0) as u64, Ordering::Relaxed);
        }
        Ok(())
    }
}
