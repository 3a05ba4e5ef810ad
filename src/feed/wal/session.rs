//! One session of the WAL feed: the slot opened, its changes read through a
//! [`Transport`] (streamed over the replication protocol, or polled with
//! SQL), each commit delivered at `Received` as it arrives, delivered again
//! at `Visible` once new snapshots see it, and only then confirmed to the
//! slot, with a heartbeat whenever the feed has proven itself current.
//!
//! The loop is one for both transports (receive → assemble → visible →
//! confirm); what differs is behind [`Transport`]: how changes arrive, what
//! proves the feed current, how a position is confirmed, and how the server
//! is told the feed is alive while it waits.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use sqlx::postgres::{PgConnectOptions, PgConnection};
use tokio::sync::{mpsc, watch};

use super::assemble::{Assembler, Pending};
use super::transport::{Item, Polled, Positions, STATUS_EVERY, Streamed, Transport};
use super::{Feed, SessionError, bounded, deps, feed_connect, fork, side_connection};
use crate::feed::wal::pgoutput;
use crate::feed::{CHECK_EVERY, Event, Lsn, Phase, Position, Resync, Server};
use crate::shutdown::Shutdown;

/// Streamed, commits are delivered at `Received` as they arrive, and
/// checked for visibility (one query for all of them), delivered at
/// `Visible` and acknowledged at most this often: a query per commit would
/// cost the primary more than the writes it follows.
pub(super) const VISIBLE_EVERY: Duration = Duration::from_millis(5);

/// Runs one session until it fails (the error says why: to retry, or to
/// wait), the gateway goes, or `shutdown` fires.
pub(super) async fn run(
    feed: &mut Feed,
    applied: &mut watch::Receiver<Position>,
    temp_name: &str,
    shutdown: &mut Shutdown,
) -> Result<(), SessionError> {
    let connect = feed_connect(&feed.opts);
    let limit = feed.opts.silence_limit;
    // For slot bookkeeping, checks, heartbeats and visibility (streamed: a
    // walsender runs no SQL once it streams); polled, it holds the slot.
    let mut conn = side_connection(&connect).await?;
    let (server, _) = bounded(limit, Server::read(&mut conn)).await?;
    if let Some(before) = feed.server
        && let Some(change) = server.change_from(&before)
    {
        feed.changed = Some((before, change));
    }
    bounded(limit, deps::check(feed, &mut conn)).await?;
    let timeline = server.timeline;
    let (mut transport, start, gap) = match feed.opts.poll {
        None => Streamed::open(feed, &mut conn, temp_name, server).await?,
        Some(every) => Polled::open(feed, &mut conn, temp_name, every, server).await?,
    };
    if !started(feed, server, Position::new(timeline, start), gap).await {
        return Ok(());
    }
    let (watch, stats, tx) = (feed.watch.clone(), feed.stats.clone(), feed.tx.clone());
    let mut asm = Assembler::new(&watch, &stats, timeline);
    let mut pos = Positions {
        received: start,
        confirmed: start,
    };
    // The end of what the server has sent, from a position received with
    // no whole transaction half read: nothing before it is still to come.
    let mut idle_upto: Option<Lsn> = None;
    // Delivered at `Received`, waiting for their `Visible` delivery.
    let mut pending = Pending::default();
    // As if checked long ago: the first commit is checked at once.
    let mut checked = Instant::now()
        .checked_sub(VISIBLE_EVERY)
        .unwrap_or_else(Instant::now);
    // A moment before which every commit has been received, until what
    // came before it is delivered and applied (then: a heartbeat).
    let mut proven: Option<Instant> = None;
    let mut dependencies = Instant::now();
    let mut items = Vec::new();
    loop {
        // A connection of the gateway reached another server than this
        // session's (an address moved: a cut-over, a restore elsewhere):
        // the next session follows the address, and a new server there is
        // a gap (see `db::identity`).
        if let Some(identity) = &feed.opts.identity
            && let Some(found) = identity.take_mismatch()
            && let Some(change) = found.change_from(&server)
        {
            return Err(SessionError::Wait(format!(
                "a connection of the gateway reached another server ({change}): following the address"
            )));
        }
        let wait = if pending.commits.is_empty() {
            STATUS_EVERY
        } else {
            VISIBLE_EVERY.saturating_sub(checked.elapsed())
        };
        tokio::select! {
            biased;
            // What was received is delivered and confirmed already, or
            // will be by the next session (nothing is confirmed unapplied).
            () = shutdown.fired() => return Ok(()),
            r = transport.receive(&mut conn, wait, &mut pos, &stats, &feed.shapes, &mut items) => r?,
        }
        for item in items.drain(..) {
            match item {
                Item::Data(data) => match pgoutput::decode_in(&data, asm.in_block()) {
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
                        // Nothing sane to apply. Its transaction may not be
                        // committed yet, and a rebuild now would not see its
                        // rows: rebuild once it is (`Pending`).
                        tracing::error!(error = %e, "undecodable WAL message; every filter is rebuilt after its transaction");
                        asm.poison();
                    }
                },
                // Sent before the heartbeat this reading may prove.
                Item::Shapes(tables) => {
                    for e in feed.shapes.update(&watch, tables) {
                        if tx.send(e).await.is_err() {
                            return Ok(());
                        }
                    }
                }
                Item::Position(at) => {
                    if !asm.in_transaction() {
                        idle_upto = Some(at);
                        if let Some(moment) = transport.proves(at) {
                            proven = Some(proven.map_or(moment, |p| p.max(moment)));
                        }
                    }
                    pos.received = pos.received.max(at);
                }
            }
        }
        pending.resync |= asm.take_stray_error();
        let mut upto = None;
        if transport.delivers_every_turn()
            || checked.elapsed() >= VISIBLE_EVERY
            || pending.commits.is_empty()
        {
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
                wait_visible(
                    &mut conn,
                    &connect,
                    server,
                    &xids,
                    limit,
                    &mut transport,
                    &pos,
                    &feed.health,
                )
                .await?;
            }
            if !deliver_visible(p, &tx).await {
                return Ok(());
            }
            // Confirm only what the applier has applied. It is in this
            // process and applies in order, so this is a short wait; the
            // server hears from us meanwhile.
            if let Some(target) = last {
                let target = Position::new(timeline, target);
                while !applied.borrow().reaches(&target) {
                    match tokio::time::timeout(STATUS_EVERY, applied.changed()).await {
                        Ok(Ok(())) => {}
                        // The applier is gone: the gateway is stopping.
                        Ok(Err(_)) => return Ok(()),
                        Err(_) => transport.keep_alive(&pos).await?,
                    }
                }
            }
            // Everything received is applied and visible now: a position
            // received meanwhile is safe to confirm too, and a proven
            // moment to send.
            let idle = match feed.opts.idle_confirm_applied {
                // On another timeline `applied` covers nothing of this one.
                true => idle_upto.map(|u| {
                    let a = *applied.borrow();
                    if a.timeline == timeline {
                        u.min(a.lsn)
                    } else {
                        Lsn::ZERO
                    }
                }),
                false => idle_upto,
            };
            upto = upto.max(idle);
            if let Some(at) = proven.take()
                && tx.send(Event::Heartbeat(at)).await.is_err()
            {
                return Ok(());
            }
        }
        let moved = upto.filter(|u| *u > pos.confirmed);
        if let Some(u) = moved {
            pos.confirmed = u;
            pos.received = pos.received.max(u);
            feed.position = Some(Position::new(timeline, u));
        }
        transport
            .confirm(&mut conn, &pos, moved.is_some(), &stats)
            .await?;
        if dependencies.elapsed() >= CHECK_EVERY {
            bounded(limit, deps::check(feed, &mut conn)).await?;
            dependencies = Instant::now();
        }
    }
}

/// The stream from `server` has started at `start`: from here on every
/// commit after it is delivered. Tells start-up, and the gateway of a gap
/// (the slot's, or a new server's). False once the gateway is gone.
async fn started(feed: &mut Feed, server: Server, start: Position, gap: bool) -> bool {
    feed.health.streaming();
    feed.streamed = true;
    feed.server = Some(server);
    if let Some(identity) = &feed.opts.identity {
        identity.follow(server);
    }
    let changed = feed.changed.take();
    let was = feed.position;
    // A promotion the filters survive (see `fork`): not a gap; the feed
    // stands where the new history and what was applied agree.
    let fork = changed.as_ref().map(|(before, _)| {
        fork::judge(&fork::Found {
            before: *before,
            now: server,
            applied: was,
            kept_slot: feed.kept_slot,
            history: feed.history.as_deref(),
        })
    });
    let (position, event) = match (fork, changed) {
        (Some(Ok((fork, mut kept))), _) => {
            kept.advance(start);
            feed.stats.forks_kept.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(start = %start, applied = ?was, fork_at = %fork.at, from = fork.from.id, to = fork.to.id, "WAL feed: a promotion the replication slot survived; every cache is emptied, the filters are kept where their builds saw nothing the new timeline lost");
            (kept, Some(Event::Fork(fork)))
        }
        (fork, changed) => {
            let gap = gap || changed.is_some();
            let position = match was {
                Some(mut p) if !gap => {
                    p.advance(start);
                    p
                }
                _ => start,
            };
            let event = match (gap, changed) {
                (false, _) => None,
                (true, Some((_, change))) => {
                    if let Some(Err(why)) = &fork {
                        tracing::info!(why = %why, "WAL feed: the filters cannot be kept across this change");
                    }
                    tracing::warn!(start = %start, applied = ?was, change = %change, "WAL feed: a new server; every cache is emptied and every filter rebuilt");
                    Some(Resync::all_upto(format!("WAL feed: {change}"), start))
                }
                (true, None) => {
                    tracing::warn!(start = %start, applied = ?was, "WAL feed: the new stream may start past changes never applied; every filter is rebuilt");
                    Some(Resync::all_upto(
                        "WAL feed: the stream started past what was applied",
                        start,
                    ))
                }
            };
            if event.is_some() {
                feed.stats.gaps.fetch_add(1, Ordering::Relaxed);
            }
            (position, event)
        }
    };
    feed.position = Some(position);
    if let Some(ev) = event
        && feed.tx.send(ev).await.is_err()
    {
        return false;
    }
    if let Some(ready) = feed.ready.take() {
        let _ = ready.send(Ok(()));
    }
    true
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
        let ev = Resync::table(
            t,
            "WAL feed: a transaction too large to hold, or one after which the table is described anew",
        );
        if tx.send(ev).await.is_err() {
            return false;
        }
    }
    true
}

/// Waits until no snapshot taken now would see any of `xids` as running
/// (see "Visible twice" in [`super`]), telling the server the feed is alive
/// meanwhile.
///
/// Normally microseconds. It can take as long as a synchronous standby
/// holds the commits (`synchronous_standby_names` naming a standby that
/// does not answer): the transactions are committed locally and decoded,
/// but invisible to every other session until the standby confirms or the
/// writer cancels. Delivering them `Visible` before that would reopen the
/// window the second delivery closes (a load reading the old row after
/// the last invalidation, cached until the TTL), so the feed never does:
/// it waits, with no cap. Meanwhile no heartbeat is sent, so past
/// `database.freshness_bound` no resource is vouched for and every lookup
/// goes to the database (which answers what is visible), and the feed's
/// health says why; once the transactions are visible they are delivered
/// and the heartbeats resume. The side connection may have been closed
/// while idle (`idle_session_timeout`, a proxy): streamed, one new one is
/// made, rather than a new slot and a rebuild of everything, and it must
/// reach the server the session streams from (behind one address, a new
/// connection may reach another: its snapshot says nothing of these
/// transactions); polled, it holds the slot and the session ends.
#[allow(clippy::too_many_arguments)]
async fn wait_visible(
    conn: &mut PgConnection,
    connect: &PgConnectOptions,
    server: Server,
    xids: &[u32],
    limit: Duration,
    transport: &mut Transport,
    pos: &Positions,
    health: &crate::feed::Health,
) -> Result<(), SessionError> {
    let began = Instant::now();
    let mut warned: Option<Instant> = None;
    let mut told = began;
    let mut replaced = false;
    loop {
        match bounded(limit, super::all_visible(conn, xids)).await {
            Ok(true) => {
                if warned.is_some() {
                    tracing::info!(waited = ?began.elapsed(), "the transactions the WAL feed waited for are visible: delivered");
                    health.streaming();
                }
                return Ok(());
            }
            Ok(false) => {}
            Err(e) if !replaced && matches!(transport, Transport::Streamed(_)) => {
                tracing::warn!(error = %e, "WAL feed: visibility check failed; reconnecting its side connection");
                let mut new = side_connection(connect).await?;
                let (now, _) = bounded(limit, Server::read(&mut new)).await?;
                if let Some(change) = now.change_from(&server) {
                    return Err(SessionError::Sql(sqlx::Error::Protocol(format!(
                        "the side connection's replacement reaches another server: {change}"
                    ))));
                }
                *conn = new;
                replaced = true;
                continue;
            }
            Err(e) => return Err(e.into()),
        }
        if told.elapsed() >= STATUS_EVERY {
            transport.keep_alive(pos).await?;
            told = Instant::now();
        }
        let every = if began.elapsed() < Duration::from_secs(60) {
            Duration::from_secs(5)
        } else {
            Duration::from_secs(60)
        };
        if began.elapsed() >= Duration::from_secs(5) && warned.is_none_or(|w| w.elapsed() >= every)
        {
            let why = format!(
                "transactions decoded {}s ago are not visible yet (a synchronous standby holding their commits?): waiting; the database answers meanwhile",
                began.elapsed().as_secs()
            );
            if began.elapsed() >= Duration::from_secs(60) {
                tracing::error!(?xids, waited = ?began.elapsed(), "{why}");
            } else {
                tracing::warn!(?xids, waited = ?began.elapsed(), "{why}");
            }
            health.held(why);
            warned = Some(Instant::now());
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}
