//! A gateway's side of the bus: the stream turned back into [`Event`]s,
//! and the fall-back to a direct WAL feed while the bus cannot prove
//! itself current (see "Guarantees" in [`super`]).
//!
//! Two modes, one at a time, each feeding the applier's channel:
//!
//! - **bus** ([`super::follow`]): read after the newest position of the
//!   stream of the primary's epoch (read before the first scan, or, coming
//!   back, followed by a resync); check each entry's predecessor; commits,
//!   resyncs, coverage changes and interruptions passed on as they come;
//!   the primary's insert position and server read every 100 ms, and a
//!   heartbeat sent for the moment of each reading the stream has reached.
//!   A reading of another server (a failover, a restart, a restore) moves
//!   to that epoch's stream with a resync (see "Epochs" in [`super`]). A
//!   reading unproven for `bus.max_lag` ends the mode, and so does a bus
//!   that failed every read for that long (a quiet primary leaves no
//!   reading unproven).
//! - **direct**: a WAL feed of this gateway's own on a temporary slot
//!   ([`crate::feed::wal::run`]), and a resync as it starts streaming,
//!   sent by the feed before anything of its stream, so no heartbeat of it
//!   vouches for the caches first (what the bus had not delivered is
//!   unknown). Every [`CHECK_EVERY`] the bus is
//!   looked at: once its stream reaches an insert position of the primary
//!   read just before, the feed is stopped and the bus followed again.

use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot, watch};

use super::fallback::Ticket;
pub use super::follow::ConsumerOptions;
use super::follow::{Ended, follow};
use super::{Bus, EntryId, Follows, Status, primary_through_the_pool};
use crate::feed::{CHECK_EVERY, Event, NotStarted, Position, Resync, Watch, wal};
use crate::shutdown::{self, Shutdown};
use crate::telemetry::LogThrottle;

/// Runs until `shutdown` fires or the applier goes. `ready` gets `Ok` once
/// the first mode's stream is in place (before the first scan).
pub async fn run<B: Bus>(
    mut bus: B,
    opts: ConsumerOptions,
    watch: Watch,
    tx: mpsc::Sender<Event>,
    applied: watch::Receiver<Position>,
    ready: oneshot::Sender<Result<(), NotStarted>>,
    mut shutdown: Shutdown,
) {
    let mut ready = Some(ready);
    let throttle = LogThrottle::new(LogThrottle::INTERVAL);
    let mut back = false;
    loop {
        let why = match follow(
            &mut bus,
            &opts,
            &watch,
            &tx,
            back,
            &mut ready,
            &mut shutdown,
        )
        .await
        {
            Ended::Shutdown => {
                opts.cursor.clear();
                return;
            }
            Ended::Unhealthy(why) => why,
        };
        // Off the bus: nothing is published or loaded against it.
        opts.cursor.clear();
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
        opts.status.set_mode(Follows::Direct, Some(why.clone()));
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
    ready: &mut Option<oneshot::Sender<Result<(), NotStarted>>>,
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
                    opts.status.set_mode(Follows::Direct, Some(why.to_string()));
                    feed = Some(Direct::start(opts, watch, tx, applied, ready.is_none()));
                    ticket = Some(t);
                }
                None => {
                    let lost = format!(
                        "{why}; bus.max_direct_fallback ({}) gateways follow the WAL themselves: answering from the database",
                        opts.max_direct
                    );
                    opts.status.set_mode(Follows::Lost, Some(lost.clone()));
                    opts.health.waiting(format!("bus: {lost}"));
                    // At start-up: the gateway goes on without a feed
                    // (`Resource::answer_unbuilt`) rather than wait for the
                    // bus, which would keep every gateway started during
                    // its outage out of the load balancer; the feed's
                    // resync when it returns builds the filters.
                    if let Some(r) = ready.take() {
                        let _ = r.send(Ok(()));
                    }
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
        let (is_current, moved) = current(bus, opts, feed.is_none()).await;
        // Held to another server with no feed: what was vouched for on the
        // old one may be what a restart or a failover lost, so it is never
        // answered as stale in a later outage (a gap clears it), and the
        // filters are rebuilt from the server followed now.
        if let Some(change) = moved
            && tx
                .send(Resync::all(format!(
                    "bus: the primary changed while no feed ran ({change})"
                )))
                .await
                .is_err()
        {
            break false;
        }
        if is_current {
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
    streams: oneshot::Receiver<Result<(), NotStarted>>,
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
    fn started(&mut self) -> Option<Result<(), NotStarted>> {
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
///
/// The primary is asked on a connection of its own. With no feed
/// (`feedless`: no ticket), the gateway's connections are then held to the
/// server found (`db::identity`): nothing is vouched for, and a pool held
/// to a server the address has moved away from (a restart, a restore)
/// would refuse every connection, so that neither this question nor any
/// lookup would be answered again. A direct feed holds them to its own
/// server itself: one it has not followed yet must not serve what it
/// vouches for.
///
/// Returns whether the stream is current, and the change of server
/// followed, if it moved.
async fn current<B: Bus>(
    bus: &mut B,
    opts: &ConsumerOptions,
    feedless: bool,
) -> (bool, Option<String>) {
    // A connection of the pool that reached another server: the address
    // moved, and the pool's other connections may all be on the old one.
    let moved = opts.identity.take_mismatch().is_some();
    let Some((server, p)) = primary_through_the_pool(&opts.pool, moved).await else {
        return (false, None);
    };
    let mut moved = None;
    if feedless && opts.identity.followed() != Some(server) {
        // None followed yet (a gateway started with no feed): nothing was
        // vouched for, nothing to rebuild.
        moved = opts.identity.followed().map(|old| {
            server
                .change_from(&old)
                .unwrap_or_else(|| "another server".into())
        });
        opts.identity.follow(server);
    }
    bus.set_epoch(server);
    let began = Instant::now();
    while began.elapsed() < Duration::from_secs(1) {
        match bus.head().await {
            Ok(EntryId { lsn, .. }) if lsn >= p.lsn.0 => return (true, moved),
            Ok(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            Err(_) => return (false, moved),
        }
    }
    bus.reconnect();
    (false, moved)
}
