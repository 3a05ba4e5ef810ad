//! A gateway's side of the bus: the stream turned back into [`Event`]s,
//! and the fall-back to a direct WAL feed while the bus cannot prove
//! itself current (see "Guarantees" in [`super`]).
//!
//! Two modes, one at a time, each feeding the applier's channel:
//!
//! - **bus**: read after the newest position of the stream of the
//!   primary's timeline (read before the first scan, or, coming back,
//!   followed by a resync); check each entry's predecessor; commits,
//!   resyncs, coverage changes and interruptions passed on as they come;
//!   the primary's flush position and [`Server`] read every
//!   [`HEARTBEAT_EVERY`], and a heartbeat sent for the moment of each
//!   reading the stream has reached. A reading on another timeline moves
//!   to that timeline's stream with a resync; one of a primary that
//!   restarted resyncs (see "Epochs" in [`super`]). A reading unproven for
//!   `bus.max_lag` ends the mode, and so does a bus that failed every read
//!   for that long (a quiet primary leaves no reading unproven).
//! - **direct**: a WAL feed of this gateway's own on a temporary slot
//!   ([`crate::feed::wal::run`]), and a resync as it starts streaming,
//!   sent by the feed before anything of its stream, so no heartbeat of it
//!   vouches for the caches first (what the bus had not delivered is
//!   unknown). Every [`CHECK_EVERY`] the bus is
//!   looked at: once its stream reaches a flush position of the primary
//!   read just before, the feed is stopped and the bus followed again.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx::PgPool;
use tokio::sync::{mpsc, oneshot, watch};

use super::fallback::Ticket;
use super::{Bus, Entry, EntryId, Mode, Status, primary};
use crate::feed::{CHECK_EVERY, Event, HEARTBEAT_EVERY, Health, Lsn, Position, Resync, Watch, wal};
use crate::shutdown::{self, Shutdown};
use crate::telemetry::LogThrottle;

/// Entries read at once.
const BATCH: usize = 1024;

/// A blocking read waits at most this long, so readings of the primary's
/// position are taken on time.
const READ_WAIT: Duration = Duration::from_millis(50);

pub struct ConsumerOptions {
    pub pool: PgPool,
    /// `bus.max_lag`.
    pub max_lag: Duration,
    /// The direct feed's options (a temporary slot).
    pub direct: wal::WalOptions,
    pub status: Arc<Status>,
    pub health: Arc<Health>,
    pub wal_stats: Arc<wal::Stats>,
    /// `bus.max_direct_fallback` (see `fallback`).
    pub max_direct: u32,
}

enum Ended {
    Shutdown,
    /// Why the bus is not good enough now.
    Unhealthy(String),
}

/// Runs until `shutdown` fires or the applier goes. `ready` gets `Ok` once
/// the first mode's stream is in place (before the first scan).
pub async fn run<B: Bus>(
    mut bus: B,
    opts: ConsumerOptions,
    watch: Watch,
    tx: mpsc::Sender<Event>,
    applied: watch::Receiver<Position>,
    ready: oneshot::Sender<Result<(), String>>,
    mut shutdown: Shutdown,
) {
    let mut ready = Some(ready);
    let throttle = LogThrottle::new(LogThrottle::INTERVAL);
    let mut back = false;
    loop {
        let why = match follow(&mut bus, &opts, &tx, back, &mut ready, &mut shutdown).await {
            Ended::Shutdown => return,
            Ended::Unhealthy(why) => why,
        };
        if shutdown.is_fired() || tx.is_closed() {
            return;
        }
        // The server it read may be what is behind (a Redis replica whose
        // link broke): the next look opens a new connection.
        bus.reconnect();
        Status::count(&opts.status.fallbacks);
        if let Some(not_logged) = throttle.permit() {
            tracing::warn!(why = %why, not_logged, "bus: not current; following the WAL with a direct feed of this gateway's own (within bus.max_direct_fallback) until it is");
        }
        opts.status.set_mode(Mode::Direct, Some(why.clone()));
        if tx.send(Event::Interrupted(why.clone())).await.is_err() {
            return;
        }
        let direct = direct(
            &mut bus,
            &opts,
            &why,
            &watch,
            &tx,
            &applied,
            &mut ready,
            &mut shutdown,
        );
        if !direct.await {
            return;
        }
        Status::count(&opts.status.returns);
        tracing::info!("bus: current again; following it instead of the direct feed");
        back = true;
    }
}

/// The bus mode, until it is unhealthy or the gateway stops. `back`: the
/// gateway followed something else before, so what lies between is a gap.
async fn follow<B: Bus>(
    bus: &mut B,
    opts: &ConsumerOptions,
    tx: &mpsc::Sender<Event>,
    back: bool,
    ready: &mut Option<oneshot::Sender<Result<(), String>>>,
    shutdown: &mut Shutdown,
) -> Ended {
    let began = Instant::now();
    let (mut server, head) = loop {
        let read = match primary(&opts.pool).await {
            None => Err("the primary's position cannot be read".to_string()),
            Some((server, _)) => {
                bus.set_epoch(server.timeline);
                match bus.head().await {
                    // Nothing relayed yet: the relay's slot may not exist,
                    // and a scan before it would miss what commits until
                    // it does (see "No gap" in `relay`).
                    Ok(EntryId::START) => Err("waiting for a relay to start the stream".into()),
                    Ok(h) => Ok((server, h)),
                    Err(e) => Err(e.to_string()),
                }
            }
        };
        match read {
            Ok(read) => break read,
            Err(e) if began.elapsed() >= opts.max_lag => {
                return Ended::Unhealthy(format!("the bus is unreachable ({e})"));
            }
            Err(e) => opts.health.waiting(format!("bus: {e}")),
        }
        tokio::select! {
            () = shutdown.fired() => return Ended::Shutdown,
            () = tokio::time::sleep(Duration::from_millis(200)) => {}
        }
    };
    opts.status.set_stream(bus.stream());
    let mut last = head;
    // Every commit up to the head was visible before the head was read:
    // the scan that follows (start-up, or the resync below) covers it.
    // Compared only with readings of the stream's timeline.
    let mut proven = Lsn(head.lsn);
    opts.health.streaming();
    opts.status.set_mode(Mode::Bus, None);
    if let Some(r) = ready.take() {
        let _ = r.send(Ok(()));
    }
    if back {
        let ev = Resync::all("bus: back on the bus after following the WAL directly");
        if tx.send(ev).await.is_err() {
            return Ended::Shutdown;
        }
    }
    // (the moment a reading proves, if the lag is known; when it was
    // asked for; the primary's flush position): the first proves once the
    // stream reaches the position, the second measures how far behind the
    // bus is (`bus.max_lag`), without the asynchronous commit lag in it.
    let mut probes: VecDeque<(Option<Instant>, Instant, Lsn)> = VecDeque::new();
    // Each reading proves the moment this much before it
    // (`db::position::async_commit_lag`); unknown, nothing is proven.
    let mut async_lag: Option<Duration> = None;
    let mut lag_read: Option<Instant> = None;
    let mut next_probe = Instant::now();
    let mut next_relay = Instant::now();
    // Since when the bus has failed every read: unreachable for
    // `max_lag` ends the mode, whether or not the primary's WAL moved (on
    // a quiet database no reading goes unproven, but nothing would tell
    // this gateway of the next commit either).
    let mut failing: Option<Instant> = None;
    // Whether this unproven spell has had its new connection (below).
    let mut moved_on = false;
    loop {
        if shutdown.is_fired() || tx.is_closed() {
            return Ended::Shutdown;
        }
        if Instant::now() >= next_probe {
            next_probe = Instant::now() + HEARTBEAT_EVERY;
            // Read again every 10 s (a reload may change
            // `wal_writer_delay`); readings dated by another lag go.
            if lag_read.is_none_or(|r| r.elapsed() >= Duration::from_secs(10))
                && let Some(l) = super::async_lag(&opts.pool).await
            {
                if async_lag.is_some_and(|old| old != l) {
                    probes.clear();
                }
                async_lag = Some(l);
                lag_read = Some(Instant::now());
            }
            // Taken before the question: the position read then covers
            // every commit visible by this moment, not by the answer's.
            let asked = Instant::now();
            let probe = |lsn| {
                let dated = async_lag.and_then(|l| crate::db::position::proof_moment(asked, l));
                (dated, asked, lsn)
            };
            if let Some((now, p)) = primary(&opts.pool).await {
                match now.change_from(&server) {
                    None => probes.push_back(probe(p.lsn)),
                    Some(change) => {
                        let moved = now.timeline != bus.epoch();
                        server = now;
                        if moved {
                            // A new epoch: its stream, after its newest
                            // entry (a commit in it by then was visible
                            // before the resync's scan), once a relay has
                            // started it; nothing of the old timeline
                            // proves anything now.
                            bus.set_epoch(now.timeline);
                            opts.status.set_stream(bus.stream());
                            let waited = Instant::now();
                            let head = loop {
                                match bus.head().await {
                                    Ok(EntryId::START) if waited.elapsed() < opts.max_lag => {}
                                    Ok(EntryId::START) => {
                                        return Ended::Unhealthy(
                                            "no relay has started the new timeline's stream".into(),
                                        );
                                    }
                                    Ok(h) => break h,
                                    Err(e) => {
                                        return Ended::Unhealthy(format!(
                                            "the bus is unreachable after a new timeline ({e})"
                                        ));
                                    }
                                }
                                tokio::select! {
                                    () = shutdown.fired() => return Ended::Shutdown,
                                    () = tokio::time::sleep(Duration::from_millis(50)) => {}
                                }
                            };
                            last = head;
                            proven = Lsn(head.lsn);
                            probes.clear();
                        }
                        tracing::warn!(change = %change, stream = %bus.stream(), "bus: the primary changed; every cache is emptied and every filter rebuilt");
                        let ev = Resync::all(format!("bus: {change}"));
                        if tx.send(ev).await.is_err() {
                            return Ended::Shutdown;
                        }
                        if !moved {
                            probes.push_back(probe(p.lsn));
                        }
                    }
                }
            }
        }
        if Instant::now() >= next_relay {
            next_relay = Instant::now() + CHECK_EVERY;
            if let Ok(who) = bus.relay().await {
                opts.status.set_relay(who);
            }
        }
        let read = tokio::select! {
            () = shutdown.fired() => return Ended::Shutdown,
            r = bus.read(last, READ_WAIT, BATCH) => r,
        };
        match read {
            Ok(entries) => {
                opts.status.set_reading(bus.node());
                if failing.take().is_some() {
                    opts.health.streaming();
                    opts.status.set_mode(Mode::Bus, None);
                }
                for r in entries {
                    Status::count(&opts.status.read);
                    if r.prev != last {
                        Status::count(&opts.status.breaks);
                        tracing::warn!(expected = %last, found = %r.prev, at = %r.at, "bus: the stream no longer holds every entry after this gateway's position (trimmed, or lost by Redis); every filter is rebuilt");
                        let ev = Resync::all("bus: entries missing from the stream");
                        if tx.send(ev).await.is_err() {
                            return Ended::Shutdown;
                        }
                    }
                    let before = r.prev.lsn;
                    last = r.at;
                    proven = proven.max(Lsn(r.at.lsn));
                    let ev = match r.entry {
                        Ok(Entry::Commit(c)) => Event::Commit(c),
                        Ok(Entry::Batch(commits)) => {
                            // A relay that took over decodes again from
                            // the slot's confirmed position: what its batch
                            // holds at or below the entry before it was in
                            // the stream already.
                            for c in commits {
                                if c.position.is_some_and(|p| p.lsn.0 <= before) {
                                    continue;
                                }
                                if tx.send(Event::Commit(c)).await.is_err() {
                                    return Ended::Shutdown;
                                }
                            }
                            continue;
                        }
                        Ok(Entry::Heartbeat(_)) => continue,
                        Ok(Entry::Resync(r)) => Event::Resync(r),
                        Ok(Entry::Coverage(c)) => Event::Coverage(c),
                        Ok(Entry::Interrupted(why)) => {
                            Event::Interrupted(format!("bus relay: {why}"))
                        }
                        Err(e) => {
                            Status::count(&opts.status.breaks);
                            tracing::warn!(error = %e, at = %r.at, "bus: an entry that does not decode; every filter is rebuilt");
                            Resync::all("bus: an entry that does not decode")
                        }
                    };
                    if tx.send(ev).await.is_err() {
                        return Ended::Shutdown;
                    }
                }
            }
            Err(e) => {
                let since = match failing {
                    Some(since) => since,
                    None => {
                        opts.health.waiting(format!("bus: {e}"));
                        opts.status.set_mode(Mode::Bus, Some(e.to_string()));
                        if tx.send(Event::Interrupted(e.to_string())).await.is_err() {
                            return Ended::Shutdown;
                        }
                        *failing.insert(Instant::now())
                    }
                };
                if since.elapsed() >= opts.max_lag {
                    return Ended::Unhealthy(format!("the bus is unreachable ({e})"));
                }
                tokio::select! {
                    () = shutdown.fired() => return Ended::Shutdown,
                    () = tokio::time::sleep(Duration::from_millis(100)) => {}
                }
            }
        }
        let mut moment = None;
        while let Some(&(m, _, p)) = probes.front() {
            if p > proven {
                break;
            }
            moment = m.or(moment);
            probes.pop_front();
        }
        if let Some(m) = moment
            && tx.send(Event::Heartbeat(m)).await.is_err()
        {
            return Ended::Shutdown;
        }
        let newest = probes.back().map_or(proven, |(_, _, p)| *p);
        opts.status.lag_bytes.store(
            newest.0.saturating_sub(proven.0),
            std::sync::atomic::Ordering::Relaxed,
        );
        let oldest = probes.front().map(|(_, asked, _)| asked.elapsed());
        opts.status.lag_ms.store(
            oldest.map_or(0, |d| d.as_millis() as u64),
            std::sync::atomic::Ordering::Relaxed,
        );
        // A Redis replica that stopped following its primary freezes the
        // stream without an error. Halfway to `max_lag`, one new
        // connection: the node is chosen again (see "A read tier" in
        // `redis`), and the read goes on after `last` there. Every node
        // holds the one stream with the same IDs and `p`s, so the
        // continuity check covers the move, and no resync is owed.
        match oldest {
            Some(d) if d >= opts.max_lag / 2 => {
                if !moved_on {
                    moved_on = true;
                    bus.reconnect();
                }
            }
            _ => moved_on = false,
        }
        if oldest.is_some_and(|d| d >= opts.max_lag) {
            return Ended::Unhealthy(match failing {
                Some(_) => "the bus is unreachable".into(),
                None => format!(
                    "the stream has not reached the primary's position of {} ago (no relay, or a relay behind)",
                    humantime::format_duration(opts.max_lag)
                ),
            });
        }
    }
}

/// The direct mode, until the bus is current again (true) or the gateway
/// stops (false): a WAL feed of this gateway's own while it holds one of
/// the `bus.max_direct_fallback` tickets ([`Ticket`]); without one, no
/// feed at all (nothing vouched for: the database answers), asking for a
/// ticket again every [`CHECK_EVERY`].
#[allow(clippy::too_many_arguments)]
async fn direct<B: Bus>(
    bus: &mut B,
    opts: &ConsumerOptions,
    why: &str,
    watch: &Watch,
    tx: &mpsc::Sender<Event>,
    applied: &watch::Receiver<Position>,
    ready: &mut Option<oneshot::Sender<Result<(), String>>>,
    shutdown: &mut Shutdown,
) -> bool {
    let mut feed: Option<Direct> = None;
    let mut ticket: Option<Ticket> = None;
    let healthy = loop {
        if let Some(t) = &mut ticket
            && !t.held().await
        {
            // Its session is gone, and its lock with it: another gateway
            // may hold the ticket now.
            tracing::warn!(
                "bus: lost the direct-feed ticket's connection; stopping the direct feed"
            );
            if let Some(f) = feed.take() {
                f.stop().await;
            }
            ticket = None;
            let why = "bus: the direct feed's ticket was lost".to_string();
            if tx.send(Event::Interrupted(why)).await.is_err() {
                break false;
            }
        }
        if ticket.is_none() {
            match Ticket::take(&opts.direct.connect, opts.max_direct).await {
                Some(t) => {
                    tracing::info!(
                        ticket = t.number,
                        "bus: following the WAL with a direct feed of this gateway's own"
                    );
                    opts.status.set_mode(Mode::Direct, Some(why.to_string()));
                    feed = Some(Direct::start(opts, watch, tx, applied, ready.is_none()));
                    ticket = Some(t);
                }
                None => {
                    let lost = format!(
                        "{why}; bus.max_direct_fallback ({}) gateways follow the WAL themselves: answering from the database",
                        opts.max_direct
                    );
                    opts.status.set_mode(Mode::Lost, Some(lost.clone()));
                    opts.health.waiting(format!("bus: {lost}"));
                }
            }
        }
        tokio::select! {
            () = shutdown.fired() => break false,
            () = tokio::time::sleep(CHECK_EVERY) => {}
        }
        if tx.is_closed() {
            break false;
        }
        if let Some(f) = &mut feed {
            match f.started() {
                Some(Ok(())) => {
                    // Start-up: the first scan comes after this. Later,
                    // the feed has sent the resync (see `Direct::start`).
                    if let Some(r) = ready.take() {
                        let _ = r.send(Ok(()));
                    }
                }
                Some(Err(e)) => {
                    if let Some(r) = ready.take() {
                        let _ = r.send(Err(e));
                    }
                    break false;
                }
                None => {}
            }
        }
        if current(bus, &opts.pool).await {
            break true;
        }
    };
    if let Some(f) = feed {
        f.stop().await;
    }
    if let Some(t) = ticket {
        t.release().await;
    }
    healthy
}

/// A direct WAL feed of this gateway's own.
struct Direct {
    task: tokio::task::JoinHandle<()>,
    stop: shutdown::Trigger,
    streams: oneshot::Receiver<Result<(), String>>,
    streaming: bool,
}

impl Direct {
    /// Past start-up (`resync`), what the bus had not delivered is unknown:
    /// a gap. A feed given a position sends the resync itself as its
    /// stream starts, before any commit or heartbeat of it; a resync sent
    /// from here once it streams would come after its first heartbeats,
    /// which vouch for the caches the bus left stale (found by
    /// tests/truth's bus feed).
    fn start(
        opts: &ConsumerOptions,
        watch: &Watch,
        tx: &mpsc::Sender<Event>,
        applied: &watch::Receiver<Position>,
        resync: bool,
    ) -> Direct {
        let (stop, signal) = shutdown::channel();
        let (streams_tx, streams) = oneshot::channel();
        let mut direct = opts.direct.clone();
        if resync {
            direct.start_position = Some(*applied.borrow());
        }
        let task = tokio::spawn(wal::run(
            direct,
            watch.clone(),
            tx.clone(),
            applied.clone(),
            opts.wal_stats.clone(),
            opts.health.clone(),
            streams_tx,
            signal,
        ));
        Direct {
            task,
            stop,
            streams,
            streaming: false,
        }
    }

    /// Whether its stream started, once (`None`: not yet, or told already).
    fn started(&mut self) -> Option<Result<(), String>> {
        if self.streaming {
            return None;
        }
        match self.streams.try_recv() {
            Ok(r) => {
                self.streaming = true;
                Some(r)
            }
            Err(_) => None,
        }
    }

    async fn stop(self) {
        self.stop.fire();
        let abort = self.task.abort_handle();
        if tokio::time::timeout(Duration::from_secs(5), self.task)
            .await
            .is_err()
        {
            abort.abort();
        }
    }
}

/// Whether the stream of the primary's timeline reaches the primary's
/// flush position read now, within a second. Not: the next look opens a
/// new connection (a Redis replica behind is left for another choice).
async fn current<B: Bus>(bus: &mut B, pool: &PgPool) -> bool {
    let Some((server, p)) = primary(pool).await else {
        return false;
    };
    bus.set_epoch(server.timeline);
    let began = Instant::now();
    while began.elapsed() < Duration::from_secs(1) {
        match bus.head().await {
            Ok(EntryId { lsn, .. }) if lsn >= p.lsn.0 => return true,
            Ok(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            Err(_) => return false,
        }
    }
    bus.reconnect();
    false
}
