//! The relay: the gateway that holds the bus's slot, decodes the WAL once
//! and appends it to the bus (see "Who relays" and "Nothing lost at a
//! failover" in [`super`]).
//!
//! Each term as relay is one WAL feed ([`crate::feed::wal::run`]) on the
//! permanent slot, started at the newest position of the stream of the
//! primary's epoch (read as the term starts: see "Epochs" in [`super`]),
//! and ended by its first interruption, or by a commit on another timeline
//! or a reading of another server; then the candidate waits
//! for the slot again and starts a new term at the stream's newest
//! position, so a term never starts from a position another relay has
//! moved past. A slot whose confirmed position is on another timeline
//! than that start (a slot that survived a failover) is a gap the feed
//! answers with a resync, appended first. A stream with no entry at all
//! (a fleet's first relay, a new timeline's stream, a Redis that lost
//! everything) has nobody relying on it: its consumers scan only once
//! they have seen its first entry, so a slot created for it is no gap,
//! and the fleet does not rebuild a second time at start-up.
//! Unless it continues the stream of the epoch before a promotion the
//! slot survived: then the feed judges that promotion, and the stream
//! opens with the fork (see "A promotion the slot survived" in
//! [`super`]).
//!
//! What the feed delivers becomes entries: commits once they are visible
//! (their `Received` delivery is skipped), in batches, resyncs, coverage
//! changes, and an interruption once this relay had the stream.
//!
//! # Batches
//! Redis pays for an entry once per consumer: every blocked read it wakes,
//! every reply it writes. So the relay puts every visible commit it has at
//! hand into one entry ([`Entry::Batch`]): the commits queued behind the
//! first (the WAL feed delivers them `Visible` in bursts, every 5 ms), and
//! any that arrive within `bus.batch_window` of it, up to
//! `bus.batch_max_commits`; any other event closes the batch first, so the
//! stream keeps the feed's order. The window is latency every commit may
//! pay; the default (2 ms) is a fraction of the feed's own visibility
//! check. The feed's `applied` is
//! what the bus acknowledged (a commit appended or refused as already
//! there; a heartbeat's LSN), and with `idle_confirm_applied` the feed
//! confirms the slot no further than that: the slot never gets ahead of
//! the stream. A heartbeat entry carries the primary's insert position
//! read before the feed's heartbeat moment, so every commit ending at or
//! before it has been delivered, and appended, before it.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use sqlx::PgPool;
use tokio::sync::{mpsc, oneshot, watch};

use super::{Appended, Bus, Entry, Forked, Status, primary, primary_where_the_address_leads};
use crate::feed::probes::{Gap, Probes};
use crate::feed::{
    Event, FeedState, HEARTBEAT_EVERY, Health, Lsn, Phase, Position, Resync, Scope, Watch, wal,
};
use crate::shutdown::{self, Shutdown};
use crate::telemetry::LogThrottle;

/// How often a candidate looks whether the slot is free.
pub const LOOK_EVERY: Duration = Duration::from_secs(1);

/// How long a term holds its slot while the bus refuses its appends (a
/// read-only replica, an ACL user without `XADD`, a Redis out of memory),
/// trying again with a growing pause: a refusal is no reason to drop the
/// primary's walsender and start another, twice a second, for as long as
/// it lasts. Below `wal_sender_timeout` (60 s by default): the feed does
/// not read meanwhile.
const HOLD_REFUSED: Duration = Duration::from_secs(20);

/// The longest pause between two terms that ended on refused appends:
/// below a consumer's usual `bus.max_lag`, so that a Redis taking writes
/// again is relayed to before the fleet falls back.
const REFUSED_PAUSE_MAX: Duration = Duration::from_secs(4);

/// How long the relay's name stays on the bus without being said again.
const ANNOUNCE_TTL: Duration = Duration::from_secs(3);

pub struct RelayOptions {
    /// The WAL feed on the bus's slot (`slot` set).
    pub wal: wal::WalOptions,
    /// `bus.batch_window`, `bus.batch_max_commits` (see "Batches").
    pub batch_window: Duration,
    pub batch_max: usize,
    /// The relay's own pool, not held to the server the gateway follows
    /// (`db::identity`): the relay picks its server where the address
    /// leads as each term starts, and a pool that refused every connection
    /// to a restarted primary until the consumer had moved would keep the
    /// new epoch's stream from starting, which is what the consumer waits
    /// for before it moves.
    pub pool: PgPool,
    /// The gateway's: the server its consumer follows. A term on another
    /// one asks where the address leads (and every term does every
    /// `db::identity::ADDRESS_EVERY`), and ends if that is not its own
    /// server either (a cut-over leaves this pool's connections, and the
    /// term's replication connection, on the old server).
    pub identity: Arc<crate::db::identity::Identity>,
    /// This gateway, as the status page names it.
    pub name: String,
    pub status: Arc<Status>,
    pub stats: Arc<wal::Stats>,
}

/// Competes for the slot until `shutdown` fires; relays while it holds it.
pub async fn run<B: Bus>(mut bus: B, opts: RelayOptions, watch: Watch, mut shutdown: Shutdown) {
    let slot = opts.wal.slot.clone().unwrap_or_default();
    let throttle = LogThrottle::new(LogThrottle::INTERVAL);
    let refusals = LogThrottle::new(LogThrottle::INTERVAL);
    let mut first = true;
    let mut pause = LOOK_EVERY;
    loop {
        if !first {
            tokio::select! {
                () = shutdown.fired() => return,
                () = tokio::time::sleep(pause) => {}
            }
        }
        first = false;
        if !slot_free(&opts.pool, &slot).await {
            continue;
        }
        // On a connection of its own: the pool's may still be on a server
        // the address has moved away from.
        let Some((server, _)) = primary_where_the_address_leads(&opts.pool).await else {
            continue;
        };
        bus.set_epoch(server);
        opts.status.set_stream(bus.stream());
        let head = match bus.head().await {
            Ok(h) => h,
            Err(e) => {
                if let Some(not_logged) = throttle.permit() {
                    tracing::warn!(error = %e, not_logged, "bus relay: the bus is unreachable; not taking the slot");
                }
                continue;
            }
        };
        let start = Position::new(server.timeline, Lsn(head.lsn));
        let fresh = head == super::EntryId::START;
        let before = match fresh {
            true => continues(&mut bus, server).await,
            false => None,
        };
        // Counted among the epochs' before anything is appended: a relay
        // after a promotion from this epoch finds two streams to continue,
        // not the one before it (see "A promotion the slot survived").
        if let Err(e) = bus.enter().await {
            if let Some(not_logged) = throttle.permit() {
                tracing::warn!(error = %e, not_logged, "bus relay: the bus is unreachable; not taking the slot");
            }
            continue;
        }
        // The term's readings on a pool of its own, opened now: the
        // relay's pool may hold connections to a server the address has
        // moved away from (a cut-over that leaves the old one up), whose
        // positions would end every term at its first tick.
        let pool = crate::feed::private_pool(&opts.pool.connect_options(), "bloomgate-relay");
        let refused = term(
            &mut bus,
            &opts,
            &pool,
            &watch,
            server,
            start,
            fresh,
            before,
            &refusals,
            &mut shutdown,
        )
        .await;
        // Ended on a bus that refuses writes: the next term waits longer,
        // rather than open the slot again every second.
        pause = match refused {
            true => (pause * 2).min(REFUSED_PAUSE_MAX),
            false => LOOK_EVERY,
        };
        opts.status.set_relaying(false);
        // Only the relay reads Redis' memory: a gateway that no longer
        // relays exports none (a stale reading would keep an alert on).
        opts.status.redis_used.store(0, Ordering::Relaxed);
        if shutdown.is_fired() {
            return;
        }
    }
}

/// The batch `first` opens (see "Batches"): the visible commits of the
/// stream's timeline queued behind it or arriving within the window, up to
/// the limit. Another event ends it and is left in `next`.
async fn gather(
    first: crate::feed::Commit,
    rx: &mut mpsc::Receiver<Event>,
    opts: &RelayOptions,
    epoch: crate::feed::Timeline,
    next: &mut Option<Event>,
) -> Vec<crate::feed::Commit> {
    let began = Instant::now();
    let mut batch = vec![first];
    while batch.len() < opts.batch_max {
        let ev = match rx.try_recv() {
            Ok(ev) => ev,
            Err(mpsc::error::TryRecvError::Disconnected) => break,
            Err(mpsc::error::TryRecvError::Empty) => {
                let left = opts.batch_window.saturating_sub(began.elapsed());
                if left.is_zero() {
                    break;
                }
                match tokio::time::timeout(left, rx.recv()).await {
                    Ok(Some(ev)) => ev,
                    Ok(None) | Err(_) => break,
                }
            }
        };
        match ev {
            Event::Commit(c) if c.phase == Phase::Received => {}
            Event::Commit(c) if c.position.is_some_and(|p| p.timeline == epoch) => batch.push(c),
            other => {
                *next = Some(other);
                break;
            }
        }
    }
    batch
}

/// The stream a new epoch's stream may continue (see "A promotion the
/// slot survived" in [`super`]): the epoch before it, on another
/// timeline, and its newest entry. Another start of the same timeline (a
/// restart, a restore) is no promotion, and an empty stream holds nothing
/// to continue.
async fn continues<B: Bus>(
    bus: &mut B,
    now: crate::feed::Server,
) -> Option<(crate::feed::Server, super::EntryId)> {
    let (before, head) = bus.previous().await.ok().flatten()?;
    (before.timeline.id != now.timeline.id && head != super::EntryId::START)
        .then_some((before, head))
}

/// Whether nobody holds `slot` (or it does not exist yet).
async fn slot_free(pool: &PgPool, slot: &str) -> bool {
    let q = sqlx::query_scalar::<_, bool>(
        "SELECT NOT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1 AND active)",
    )
    .bind(slot)
    .fetch_one(pool);
    matches!(
        tokio::time::timeout(Duration::from_secs(2), q).await,
        Ok(Ok(true))
    )
}

/// How often the relay reads the bus's memory (`INFO memory`): the
/// gauges an alert fires on before Redis refuses appends.
const MEMORY_EVERY: Duration = Duration::from_secs(10);

/// Reads the bus's memory into `status`, and says once (until it changes)
/// what keeps this Redis from holding the stream: an `allkeys-*` policy
/// that may evict it, or `maxmemory` within 20 % (`Memory::problem`).
async fn read_memory<B: Bus>(bus: &mut B, status: &Status, said: &mut Option<&'static str>) {
    let m = match bus.read_memory().await {
        Ok(Some(m)) => m,
        // Unread now: no figure rather than an old one an alert would
        // keep firing (or keep quiet) on.
        _ => {
            status.redis_used.store(0, Ordering::Relaxed);
            return;
        }
    };
    status.redis_used.store(m.used.max(1), Ordering::Relaxed);
    status.redis_max.store(m.max, Ordering::Relaxed);
    // Said once per kind of problem: its text holds the figures, which
    // move with every reading.
    let problem = m.problem();
    let kind = problem.as_ref().map(|_| m.problem_kind());
    if kind != *said {
        match &problem {
            Some(p) => {
                tracing::warn!(problem = %p, "bus relay: the bus's Redis may not keep the stream")
            }
            None => tracing::info!("bus relay: the bus's Redis has room for the stream again"),
        }
        *said = kind;
    }
}

/// One WAL feed on the slot, its events appended, until it is interrupted,
/// the bus fails, or `shutdown` fires. An append the bus refuses is tried
/// again for up to [`HOLD_REFUSED`], the slot held; returns whether the
/// term ended on such refusals (`refusals` rate-limits their lines).
#[allow(clippy::too_many_arguments)]
async fn term<B: Bus>(
    bus: &mut B,
    opts: &RelayOptions,
    pool: &PgPool,
    watch: &Watch,
    server: crate::feed::Server,
    head: Position,
    fresh: bool,
    before: Option<(crate::feed::Server, super::EntryId)>,
    refusals: &LogThrottle,
    shutdown: &mut Shutdown,
) -> bool {
    let epoch = head.timeline;
    let (tx, mut rx) = mpsc::channel(4096);
    let (applied_tx, applied_rx) = watch::channel(head);
    let (stop, signal) = shutdown::channel();
    let health = Arc::new(Health::default());
    let (ready, _) = oneshot::channel();
    let mut wal_opts = opts.wal.clone();
    // A stream that holds nothing yet has no reader to owe a gap to: its
    // consumers wait for its first entry before they scan (`consumer`).
    // Any other is a position the new slot must not start past.
    // A stream that continues another epoch's: the feed judges the
    // promotion from that stream's newest position, as a feed that had
    // applied it would (see `wal::fork`).
    wal_opts.start_position = match before {
        Some((server, at)) => Some(Position::new(server.timeline, Lsn(at.lsn))),
        None => (!fresh).then_some(head),
    };
    wal_opts.start_server = before.map(|(server, _)| server);
    wal_opts.idle_confirm_applied = true;
    let feed = tokio::spawn(wal::run(
        wal_opts,
        watch.clone(),
        tx,
        applied_rx,
        opts.stats.clone(),
        health.clone(),
        ready,
        signal,
    ));
    let mut relaying = false;
    // Readings of the primary, dated when answered: for heartbeats. A feed
    // that proves nothing for a while: the newest few seconds are kept.
    let mut probes = Probes::new(server, 100);
    let mut tick = tokio::time::interval(HEARTBEAT_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut announced: Option<Instant> = None;
    // The last look at where the address leads and which Redis node the
    // sentinels name (once a second).
    let mut checked = Instant::now();
    // The last look at where the address leads.
    let mut looked = Instant::now();
    // The last reading of Redis' memory, and the problem last said of it.
    let mut memory_read: Option<Instant> = None;
    let mut memory_said: Option<&'static str> = None;
    // An event taken from the feed while a batch was gathered, and the
    // first thing handled after the batch is appended.
    let mut next: Option<Event> = None;
    let mut ended_refused = false;
    let mut retired = false;
    let why_ended: String = loop {
        let ev = if let Some(ev) = next.take() {
            ev
        } else {
            tokio::select! {
            () = shutdown.fired() => break "shutdown".into(),
            _ = tick.tick() => {
                if let Some((now, p)) = primary(pool).await {
                    // After the answer: the position was read before it.
                    let answered = Instant::now();
                    // Another epoch (a failover, a restart, a restore): its
                    // own stream, from the next term.
                    if let Err(Gap(why)) = probes.read(answered, now, p.lsn) {
                        break format!("the stream's epoch ended: {why}");
                    }
                }
                if checked.elapsed() >= Duration::from_secs(1) {
                    checked = Instant::now();
                    // Its own look every ADDRESS_EVERY too, not only once its
                    // consumer moved: the consumers of other gateways may
                    // have moved first, and wait for this term's end.
                    let look = opts.identity.followed().is_some_and(|f| f != server)
                        || looked.elapsed() >= crate::db::identity::ADDRESS_EVERY;
                    if look {
                        looked = Instant::now();
                    }
                    if look
                        && let Some((there, _)) = primary_where_the_address_leads(pool).await
                        && there != server
                    {
                        break "the address leads to another server than this term's".into();
                    }
                    // A split brain: the sentinels promoted another node
                    // while this one, cut off from them, is still a
                    // primary and takes the appends no consumer reads.
                    if let Ok(false) = bus.still_primary().await {
                        break "the sentinels name another Redis primary than the node this relay appends to".into();
                    }
                    if memory_read.is_none_or(|r| r.elapsed() >= MEMORY_EVERY) {
                        memory_read = Some(Instant::now());
                        read_memory(bus, &opts.status, &mut memory_said).await;
                    }
                }
                if relaying
                    && announced.is_none_or(|a| a.elapsed() >= Duration::from_secs(1))
                    && bus.announce(&opts.name, ANNOUNCE_TTL).await.is_ok()
                {
                    announced = Some(Instant::now());
                }
                continue;
            }
            ev = rx.recv() => match ev {
                Some(ev) => ev,
                None => break "the WAL feed stopped".into(),
            },
            }
        };
        if !relaying && health.get().state == FeedState::Streaming {
            relaying = true;
            opts.status.set_relaying(true);
            Status::count(&opts.status.terms);
            tracing::info!(slot = ?opts.wal.slot, from = %head, "bus relay: this gateway holds the slot and relays the WAL");
            if bus.announce(&opts.name, ANNOUNCE_TTL).await.is_ok() {
                announced = Some(Instant::now());
            }
        }
        let (entry, acknowledges) = match ev {
            Event::Commit(c) if c.phase == Phase::Received => continue,
            Event::Commit(c) => {
                let Some(at) = c.position else { continue };
                if at.timeline != epoch {
                    break format!(
                        "a commit on timeline {}, the stream on {}",
                        at.timeline.id, epoch.id
                    );
                }
                let batch = gather(c, &mut rx, opts, epoch, &mut next).await;
                let last = batch.last().and_then(|c| c.position).map(|p| p.lsn);
                (Entry::Batch(batch), last)
            }
            Event::Heartbeat(at) => {
                // The newest reading answered at or before the feed's
                // moment (the instant the feed asked for its own reading
                // of the insert position): a reading answered before the
                // feed's was taken before it, so its position is at or
                // below the one the feed's stream reached, and every
                // commit up to it has been relayed (decoding is in LSN
                // order). Dated from the question instead, the reading
                // could be the later one.
                match probes.taken_by(at) {
                    Some(p) => (Entry::Heartbeat(p), Some(p)),
                    None => continue,
                }
            }
            // Placed where it stands (see "Lineage" in `redis`): only a
            // position on this stream's timeline places an entry on it.
            Event::Resync(mut r) => {
                r.upto = r.upto.filter(|p| p.timeline == epoch);
                (Entry::Resync(r), None)
            }
            // The promotion proven from the stream this one continues:
            // the new stream's first entry, where the two meet. Any other
            // is what the relay makes of any new server: a gap.
            Event::Fork(fork) => match before {
                Some((from, at)) if fork.from == from.timeline && fork.to == epoch => {
                    let kept = fork.at.min(Lsn(at.lsn));
                    (Entry::Fork(Forked { from, fork, kept }), Some(kept))
                }
                _ => (
                    Entry::Resync(Resync {
                        reason: format!("the primary was promoted from timeline {}", fork.from.id),
                        scope: Scope::All,
                        upto: None,
                    }),
                    None,
                ),
            },
            Event::Coverage(c) => (Entry::Coverage(c), None),
            Event::Barrier(done) => {
                let _ = done.send(());
                continue;
            }
            Event::Interrupted(why) => {
                if relaying {
                    let _ = bus.append(&Entry::Interrupted(why.clone())).await;
                }
                break why;
            }
        };
        let mut refused_since: Option<Instant> = None;
        // Short: a node demoted by a failover refuses until the sentinels
        // name the new primary, which each retry's new connection asks.
        let mut wait = Duration::from_millis(50);
        let appended = loop {
            match bus.append(&entry).await {
                Err(e)
                    if super::is_refusal(&e)
                        && refused_since.is_none_or(|t| t.elapsed() < HOLD_REFUSED) =>
                {
                    refused_since.get_or_insert_with(Instant::now);
                    if let Some(not_logged) = refusals.permit() {
                        tracing::warn!(error = %e, not_logged, "bus relay: Redis refuses the append; holding the slot and trying again (at most one such line per 10 s)");
                    }
                    // Out of memory, the stream past its retention may be
                    // why: the append trims only when it succeeds.
                    let _ = bus.trim().await;
                    tokio::select! {
                        () = shutdown.fired() => break Err(e),
                        () = tokio::time::sleep(wait) => {}
                    }
                    wait = (wait * 2).min(Duration::from_millis(500));
                }
                other => break other,
            }
        };
        // The streams of other epochs go a while later ("Epochs" in
        // `redis`), once this one holds an entry: until then a term that
        // starts it over finds the stream it continues.
        if appended.is_ok() && !retired {
            retired = true;
            if let Err(e) = bus.retire_others().await {
                tracing::debug!(error = %e, "bus relay: could not retire the streams of other epochs");
            }
        }
        match appended {
            Ok(Appended::At(_)) => Status::count(&opts.status.appended),
            Ok(Appended::Already) => Status::count(&opts.status.duplicates),
            Err(e) => {
                ended_refused = super::is_refusal(&e);
                break format!("appending to the bus: {e}");
            }
        }
        if let Some(l) = acknowledges {
            applied_tx.send_if_modified(|a| a.advance(Position::new(epoch, l)));
        }
    };
    if relaying && (!ended_refused || refusals.permit().is_some()) {
        tracing::warn!(why = %why_ended, "bus relay: this gateway stopped relaying");
    }
    // Closing the channel ends a feed waiting to send; the signal, one
    // waiting on the server. What it received and was not appended is not
    // confirmed: the next relay decodes it again.
    drop(rx);
    drop(applied_tx);
    stop.fire();
    let abort = feed.abort_handle();
    if tokio::time::timeout(Duration::from_secs(5), feed)
        .await
        .is_err()
    {
        tracing::warn!("bus relay: the WAL feed did not stop within 5 s");
        abort.abort();
    }
    ended_refused
}
