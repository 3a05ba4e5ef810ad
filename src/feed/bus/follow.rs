//! The consumer's bus mode: the stream turned back into [`Event`]s, proven
//! current by readings of the primary (see "Guarantees" in [`super`]).
//!
//! One turn of [`follow`]'s loop: a reading of the primary when one is due
//! ([`Following::probe`]: a new epoch moves to its stream with a resync),
//! the relay's name now and then, the entries after the last one read
//! ([`Following::take`]: each checked against its predecessor), then what
//! the stream has proven ([`Following::prove`]: a heartbeat for the latest
//! reading it reached, the lag, and whether the mode must end). Each step
//! returns `Err(Ended)` when the mode ends.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use sqlx::PgPool;
use tokio::sync::{mpsc, oneshot};

use super::cursor::{Cursor, Join};
use super::{
    Bus, Entry, EntryId, Follows, Read, Status, primary_and_shapes, primary_through_the_pool,
    primary_where_the_address_leads,
};
use crate::db::identity::Identity;
use crate::feed::probes::{Gap, Probes};
use crate::feed::tracker::Shapes;
use crate::feed::{
    CHECK_EVERY, Event, HEARTBEAT_EVERY, Health, Lsn, NotStarted, Resync, Server, Watch, wal,
};
use crate::shutdown::Shutdown;
use crate::snapshot::Mark;

/// What a consumer is given (see `consumer`).
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
    /// The gateway's connections, held to the server this consumer follows
    /// (see `db::identity`).
    pub identity: Arc<Identity>,
    /// Where it has read to, set after each entry is passed on.
    pub cursor: Arc<Cursor>,
    /// Installs the fleet's snapshots as it first starts on the bus (see
    /// `resource::fleet`).
    pub join: Option<Join>,
}

/// How the bus mode ended.
pub(super) enum Ended {
    Shutdown,
    /// Why the bus is not good enough now.
    Unhealthy(String),
}

/// Entries read at once.
const BATCH: usize = 1024;

/// A blocking read waits at most this long, so readings of the primary's
/// position are taken on time.
const READ_WAIT: Duration = Duration::from_millis(50);

/// Readings of the primary held unproven at most: more than `bus.max_lag`
/// can ever leave (one per 100 ms).
const READINGS: usize = 10_000;

/// The bus mode, until it is unhealthy or the gateway stops. `back`: the
/// gateway followed something else before, so what lies between is a gap.
#[allow(clippy::too_many_arguments)]
pub(super) async fn follow<B: Bus>(
    bus: &mut B,
    opts: &ConsumerOptions,
    watch: &Watch,
    tx: &mpsc::Sender<Event>,
    back: bool,
    ready: &mut Option<oneshot::Sender<Result<(), NotStarted>>>,
    shutdown: &mut Shutdown,
) -> Ended {
    let mut f = match Following::start(bus, opts, watch, tx, back, ready, shutdown).await {
        Ok(f) => f,
        Err(ended) => return ended,
    };
    loop {
        if let Err(ended) = f.turn().await {
            return ended;
        }
    }
}

/// Where the bus mode stands.
struct Following<'a, B> {
    bus: &'a mut B,
    opts: &'a ConsumerOptions,
    watch: &'a Watch,
    /// The watched tables' shapes, read with each reading of the primary
    /// (see "Shapes" in `feed::tracker`).
    shapes: Shapes,
    tx: &'a mpsc::Sender<Event>,
    shutdown: &'a mut Shutdown,
    /// The last entry read: the next must name it as its predecessor.
    last: EntryId,
    /// How far the stream has delivered, on the epoch's timeline.
    proven: Lsn,
    /// Readings of the primary, each proving its moment once the stream
    /// reaches its position; the oldest unproven measures how far behind
    /// the bus is (`bus.max_lag`).
    probes: Probes,
    next_probe: Instant,
    next_relay: Instant,
    /// Since when the bus has failed every read: unreachable for `max_lag`
    /// ends the mode, whether or not the primary's WAL moved (on a quiet
    /// database no reading goes unproven, but nothing would tell this
    /// gateway of the next commit either).
    failing: Option<Instant>,
    /// Whether this unproven spell has had its new connection (see
    /// [`Following::prove`]).
    moved_on: bool,
}

impl<'a, B: Bus> Following<'a, B> {
    /// Waits for the stream of the primary's epoch to have an entry (up to
    /// `bus.max_lag`), then starts after its newest one.
    #[allow(clippy::too_many_arguments)]
    async fn start(
        bus: &'a mut B,
        opts: &'a ConsumerOptions,
        watch: &'a Watch,
        tx: &'a mpsc::Sender<Event>,
        back: bool,
        ready: &mut Option<oneshot::Sender<Result<(), NotStarted>>>,
        shutdown: &'a mut Shutdown,
    ) -> Result<Self, Ended> {
        let began = Instant::now();
        let (server, head) = loop {
            let read = match primary_through_the_pool(&opts.pool, false).await {
                None => Err("the primary's position cannot be read".to_string()),
                Some((server, _)) => {
                    bus.set_epoch(server);
                    match bus.head().await {
                        // Nothing relayed yet: the relay's slot may not
                        // exist, and a scan before it would miss what
                        // commits until it does (see "No gap" in `relay`).
                        Ok(EntryId::START) => Err("waiting for a relay to start the stream".into()),
                        Ok(h) => Ok((server, h)),
                        Err(e) => Err(e.to_string()),
                    }
                }
            };
            match read {
                Ok(read) => break read,
                Err(e) if began.elapsed() >= opts.max_lag => {
                    return Err(Ended::Unhealthy(format!("the bus is unreachable ({e})")));
                }
                Err(e) => opts.health.waiting(format!("bus: {e}")),
            }
            tokio::select! {
                () = shutdown.fired() => return Err(Ended::Shutdown),
                () = tokio::time::sleep(Duration::from_millis(200)) => {}
            }
        };
        opts.identity.follow(server);
        opts.status.set_stream(bus.stream());
        // Joining (start-up only): the snapshots installed before anything
        // is passed on, and the stream read from their place on (see
        // "When a snapshot may be used" in `snapshot`).
        let mut start = head;
        if let (false, Some(join)) = (back, &opts.join) {
            let at = Mark {
                stream: bus.stream().to_string(),
                lsn: head.lsn,
                seq: head.seq,
            };
            if let Some(from) = join(at).await {
                tracing::info!(from = %EntryId { lsn: from.lsn, seq: from.seq }, head = %head, "bus: joined from the fleet's snapshots; reading the stream from their place");
                start = EntryId {
                    lsn: from.lsn,
                    seq: from.seq,
                };
            }
        }
        opts.cursor.set(bus.stream(), start, tx);
        opts.health.streaming();
        opts.status.set_mode(Follows::Bus, None);
        if let Some(r) = ready.take() {
            let _ = r.send(Ok(()));
        }
        let f = Following {
            bus,
            opts,
            watch,
            shapes: Shapes::new(watch),
            tx,
            shutdown,
            last: start,
            // Every commit up to the head was visible before the head was
            // read: the scan that follows (start-up, or the resync below)
            // covers it. From a snapshot's place, what it holds.
            proven: Lsn(start.lsn),
            probes: Probes::new(server, READINGS),
            next_probe: Instant::now(),
            next_relay: Instant::now(),
            failing: None,
            moved_on: false,
        };
        if back {
            f.send(Resync::all(
                "bus: back on the bus after following the WAL directly",
            ))
            .await?;
        }
        Ok(f)
    }

    /// Passes an event on; `Err` once the gateway is gone.
    async fn send(&self, ev: Event) -> Result<(), Ended> {
        self.tx.send(ev).await.map_err(|_| Ended::Shutdown)
    }

    async fn turn(&mut self) -> Result<(), Ended> {
        if self.shutdown.is_fired() || self.tx.is_closed() {
            return Err(Ended::Shutdown);
        }
        if Instant::now() >= self.next_probe {
            self.next_probe = Instant::now() + HEARTBEAT_EVERY;
            self.probe().await?;
        }
        if Instant::now() >= self.next_relay {
            self.next_relay = Instant::now() + CHECK_EVERY;
            if let Ok(who) = self.bus.relay().await {
                self.opts.status.set_relay(who);
            }
        }
        let read = tokio::select! {
            () = self.shutdown.fired() => return Err(Ended::Shutdown),
            r = self.bus.read(self.last, READ_WAIT, BATCH) => r,
        };
        match read {
            Ok(entries) => {
                self.take(entries).await?;
            }
            Err(e) => self.failed(e.to_string()).await?,
        }
        self.prove().await
    }

    /// One reading of the primary (see "Epochs" in [`super`]).
    async fn probe(&mut self) -> Result<(), Ended> {
        // Taken before the question: the position read then covers every
        // commit visible by this moment, not by the answer's.
        let asked = Instant::now();
        // A connection of the gateway reached another server than the one
        // followed (an address moved): the pool's connections that are
        // left may all be on the old one, so the address is asked on a
        // connection of its own.
        let read = match self.opts.identity.take_mismatch() {
            Some(_) => primary_where_the_address_leads(&self.opts.pool)
                .await
                .map(|(s, p)| (s, p, None)),
            None => primary_and_shapes(&self.opts.pool, &self.shapes)
                .await
                .map(|(s, p, tables)| (s, p, Some(tables))),
        };
        let Some((now, p, tables)) = read else {
            return Ok(());
        };
        // A rewrite seen with this reading: its resync goes before the
        // heartbeat the reading may later prove.
        if let Some(tables) = tables {
            for e in self.shapes.update(self.watch, tables) {
                self.send(e).await?;
            }
        }
        let before = self.probes.server();
        match self.probes.read(asked, now, p.lsn) {
            Ok(()) => Ok(()),
            // The same epoch going back (a restore that kept what the
            // epoch is told by): nothing proven on it holds.
            Err(Gap(why)) if before == Some(now) => {
                self.opts.cursor.discard_before_now();
                tracing::warn!(why = %why, "bus: the primary's position went back; every cache is emptied and every filter rebuilt");
                self.send(Resync::all(format!("bus: {why}"))).await
            }
            Err(Gap(change)) => self.move_to(now, &change).await,
        }
    }

    /// A new epoch (a failover, a restart, a restore, another cluster):
    /// its stream, once a relay has started it. Where that stream
    /// continues this one ([`Following::continued`]), from its first
    /// entry; else after its newest entry (a commit in it by then was
    /// visible before the resync's scan). Nothing of the old epoch proves
    /// anything now (the probes dropped what they held).
    async fn move_to(&mut self, now: Server, change: &str) -> Result<(), Ended> {
        let before = self.bus.epoch();
        self.opts.identity.follow(now);
        self.bus.set_epoch(now);
        self.opts.status.set_stream(self.bus.stream());
        let waited = Instant::now();
        let head = loop {
            match self.bus.head().await {
                Ok(EntryId::START) if waited.elapsed() < self.opts.max_lag => {}
                Ok(EntryId::START) => {
                    return Err(Ended::Unhealthy(
                        "no relay has started the new epoch's stream".into(),
                    ));
                }
                Ok(h) => break h,
                Err(e) => {
                    return Err(Ended::Unhealthy(format!(
                        "the bus is unreachable after a new epoch ({e})"
                    )));
                }
            }
            tokio::select! {
                () = self.shutdown.fired() => return Err(Ended::Shutdown),
                () = tokio::time::sleep(Duration::from_millis(50)) => {}
            }
        };
        if self.continued(before, now).await? {
            return Ok(());
        }
        self.last = head;
        self.proven = Lsn(head.lsn);
        // Read before the resync is passed on: a rebuild it starts needs a
        // snapshot of this stream from here on (see `cursor`).
        self.opts.cursor.read(self.bus.stream(), head);
        tracing::warn!(change = %change, stream = %self.bus.stream(), "bus: the primary changed; every cache is emptied and every filter rebuilt");
        self.send(Resync::all(format!("bus: {change}"))).await?;
        self.opts.cursor.set(self.bus.stream(), head, self.tx);
        Ok(())
    }

    /// Whether the new epoch's stream continues the one this consumer read
    /// (see "A promotion the slot survived" in [`super`]), and the move is
    /// made: its first entry is the relay's [`Forked`] from this
    /// consumer's epoch, and the old stream, read to its end, reached the
    /// position where the new one takes over with no entry missing. Then
    /// every commit of the new history up to there is applied, the new
    /// stream brings every one after it, and the applier empties every
    /// cache and keeps each filter whose own proof holds
    /// ([`Event::Fork`]). The old stream's entries past the fork (a tail
    /// the new timeline lost) are applied first: an insert is an extra key
    /// in a filter, and the caches they touched are emptied with the rest.
    async fn continued(&mut self, before: Server, now: Server) -> Result<bool, Ended> {
        let first = match self.bus.read(EntryId::START, READ_WAIT, 1).await {
            Ok(mut read) if !read.is_empty() => read.swap_remove(0),
            _ => return Ok(false),
        };
        let forked = match first.entry {
            Ok(Entry::Fork(f))
                if first.prev == EntryId::START
                    && f.from == before
                    && f.fork.to == now.timeline =>
            {
                f
            }
            _ => return Ok(false),
        };
        self.bus.set_epoch(before);
        let reached = self.read_to_the_end().await;
        self.bus.set_epoch(now);
        if !reached? || Lsn(self.last.lsn) < forked.kept {
            return Ok(false);
        }
        self.last = first.at;
        self.proven = forked.kept;
        // Read before the fork is passed on: a rebuild it starts needs a
        // snapshot of this stream from here on (see `cursor`).
        self.opts.cursor.read(self.bus.stream(), first.at);
        tracing::warn!(from = before.timeline.id, to = now.timeline.id, fork_at = %forked.fork.at, kept = %forked.kept, stream = %self.bus.stream(), "bus: the primary was promoted and the relay's slot survived; every cache is emptied, the filters are kept where their builds saw nothing the new timeline lost");
        self.send(Event::Fork(forked.fork)).await?;
        self.opts.cursor.set(self.bus.stream(), first.at, self.tx);
        Ok(true)
    }

    /// Reads the stream in use up to its newest entry as it is now,
    /// passing every entry on; whether it got there with every entry (a
    /// break is a resync passed on already).
    async fn read_to_the_end(&mut self) -> Result<bool, Ended> {
        let Ok(end) = self.bus.head().await else {
            return Ok(false);
        };
        let mut whole = true;
        while self.last < end {
            match self.bus.read(self.last, READ_WAIT, BATCH).await {
                Ok(read) if !read.is_empty() => whole &= self.take(read).await?,
                _ => return Ok(false),
            }
        }
        Ok(whole)
    }

    /// Entries read: each checked against its predecessor, passed on.
    /// Whether every one continued the one before and decoded (else a
    /// resync was passed on).
    async fn take(&mut self, entries: Vec<Read>) -> Result<bool, Ended> {
        let mut whole = true;
        self.opts.status.set_reading(self.bus.node());
        // Read before anything is passed on: a break among them is a
        // resync whose rebuild needs a snapshot from past it (`cursor`).
        if let Some(newest) = entries.last() {
            self.opts.cursor.read(self.bus.stream(), newest.at);
        }
        if self.failing.take().is_some() {
            self.opts.health.streaming();
            self.opts.status.set_mode(Follows::Bus, None);
        }
        for r in entries {
            Status::count(&self.opts.status.read);
            if r.prev != self.last {
                Status::count(&self.opts.status.breaks);
                whole = false;
                tracing::warn!(expected = %self.last, found = %r.prev, at = %r.at, "bus: the stream no longer holds every entry after this gateway's position (trimmed, or lost by Redis); every filter is rebuilt");
                self.send(Resync::all("bus: entries missing from the stream"))
                    .await?;
            }
            let before = r.prev.lsn;
            self.last = r.at;
            self.proven = self.proven.max(Lsn(r.at.lsn));
            let ev = match r.entry {
                Ok(Entry::Commit(c)) => Event::Commit(c),
                Ok(Entry::Batch(commits)) => {
                    // A relay that took over decodes again from the slot's
                    // confirmed position: what its batch holds at or below
                    // the entry before it was in the stream already.
                    for c in commits {
                        if c.position.is_some_and(|p| p.lsn.0 <= before) {
                            continue;
                        }
                        self.send(Event::Commit(c)).await?;
                    }
                    continue;
                }
                Ok(Entry::Heartbeat(_)) => continue,
                Ok(Entry::Resync(r)) => Event::Resync(r),
                Ok(Entry::Coverage(c)) => Event::Coverage(c),
                Ok(Entry::Interrupted(why)) => Event::Interrupted(format!("bus relay: {why}")),
                // Used only as a stream's first entry, where `continued`
                // reads it; a consumer that came to the stream otherwise
                // (a resync, a start) starts after it, so one met here
                // says nothing it can use and nothing it must do.
                Ok(Entry::Fork(_)) => continue,
                Err(e) => {
                    Status::count(&self.opts.status.breaks);
                    whole = false;
                    tracing::warn!(error = %e, at = %r.at, "bus: an entry that does not decode; every filter is rebuilt");
                    Resync::all("bus: an entry that does not decode")
                }
            };
            self.send(ev).await?;
        }
        self.opts.cursor.set(self.bus.stream(), self.last, self.tx);
        Ok(whole)
    }

    /// A read that failed: said once, and the mode ends once the bus has
    /// failed every read for `bus.max_lag`.
    async fn failed(&mut self, e: String) -> Result<(), Ended> {
        let since = match self.failing {
            Some(since) => since,
            None => {
                self.opts.health.waiting(format!("bus: {e}"));
                self.opts.status.set_mode(Follows::Bus, Some(e.clone()));
                self.send(Event::Interrupted(e.clone())).await?;
                *self.failing.insert(Instant::now())
            }
        };
        if since.elapsed() >= self.opts.max_lag {
            return Err(Ended::Unhealthy(format!("the bus is unreachable ({e})")));
        }
        tokio::select! {
            () = self.shutdown.fired() => Err(Ended::Shutdown),
            () = tokio::time::sleep(Duration::from_millis(100)) => Ok(()),
        }
    }

    /// What the stream has proven: a heartbeat for the latest reading it
    /// reached, the lag, a new connection halfway to `bus.max_lag`, and
    /// the end of the mode past it.
    async fn prove(&mut self) -> Result<(), Ended> {
        if let Some(m) = self.probes.reached(self.proven) {
            self.send(Event::Heartbeat(m)).await?;
        }
        let status = &self.opts.status;
        let newest = self.probes.newest().unwrap_or(self.proven);
        status
            .lag_bytes
            .store(newest.0.saturating_sub(self.proven.0), Ordering::Relaxed);
        let oldest = self.probes.oldest().map(|asked| asked.elapsed());
        status.lag_ms.store(
            oldest.map_or(0, |d| d.as_millis() as u64),
            Ordering::Relaxed,
        );
        // A Redis replica that stopped following its primary freezes the
        // stream without an error, and so does a primary the sentinels no
        // longer name (a split brain: the relay appends elsewhere).
        // Halfway to `max_lag`, one new connection: the node is chosen
        // again (see `redis::replicas`; the sentinels' word),
        // and the read goes on after `last` there. Every node holds the
        // one stream with the same IDs and `p`s, so the continuity check
        // covers the move: no resync is owed unless the node left behind
        // held entries the other lacks (a split brain's), which is a break.
        match oldest {
            Some(d) if d >= self.opts.max_lag / 2 => {
                if !self.moved_on {
                    self.moved_on = true;
                    self.bus.reconnect();
                }
            }
            _ => self.moved_on = false,
        }
        if oldest.is_some_and(|d| d >= self.opts.max_lag) {
            return Err(Ended::Unhealthy(match self.failing {
                Some(_) => "the bus is unreachable".into(),
                None => format!(
                    "the stream has not reached the primary's position of {} ago (no relay, or a relay behind)",
                    humantime::format_duration(self.opts.max_lag)
                ),
            }));
        }
        Ok(())
    }
}
