//! The database's own lifecycle (see "The database's lifecycle" in the
//! crate doc): a history on a cluster of its own, a primary, a standby that
//! a failover promotes and a read replica that it strands, with every
//! gateway connecting through a proxy that an outage cuts and a failover
//! moves to the new primary; and the faults played on it.

use std::net::SocketAddr;
use std::time::Duration;

use sqlx::{Connection, Executor, PgConnection};
use tokio::task::JoinHandle;

use super::{Action, FEED_GAP, World, read_back};
use crate::common::Proxy;
use crate::common::cluster::Server;
use crate::ops::Focus;
use crate::rng::Rng;
use crate::{Fault, Opts};

/// Whether the history runs on a cluster of its own: when its faults are all
/// lifecycle faults (or played in turn), never when none is, else as the seed's
/// own stream says (a stream apart, so that the other histories' choices are
/// those of the seeds they had before these faults existed).
pub(crate) fn private_cluster(opts: &Opts) -> bool {
    if opts.in_turn {
        return true;
    }
    let life = opts.faults.iter().filter(|f| f.needs_cluster()).count();
    match life {
        0 => false,
        n if n == opts.faults.len() => true,
        _ => Rng::new(opts.seed ^ LIFE_SALT).chance(50),
    }
}

/// How soon the book promises a gateway looks where the address leads (a
/// literal, not the gateway's constant: raising that must fail here).
pub(super) const ADDRESS_BOUND: Duration = Duration::from_secs(5);

/// Salts the lifecycle's own stream of random choices.
const LIFE_SALT: u64 = 0x6c69_6665_6379_639e;

/// The cluster and what the lifecycle faults keep between them.
pub(super) struct Life {
    pub primary: Server,
    /// A standby streaming from the primary directly: a failover promotes
    /// it (and makes a new one of the new primary).
    pub standby: Option<Server>,
    /// The gateways' read replica (when the history has one), streaming
    /// through the proxy: a failover strands it on the old timeline, as a
    /// replica that had replayed past the fork point is stranded.
    pub replica: Option<Server>,
    /// A failover stranded the replica: it replays nothing more.
    pub stranded: bool,
    /// A `cut-over` left the gateways' look at where the address leads
    /// silent (its connections stall at the proxy) until the round's
    /// quiescence.
    pub look_held: bool,
    /// Every gateway's connections to the primary.
    pub proxy: Proxy,
    /// The writer commits with `synchronous_commit = off` (a crash loses
    /// what it committed last).
    pub async_commits: bool,
    pub rng: Rng,
    /// A lifecycle fault in progress: one at a time.
    pub open: Option<(Fault, Duration)>,
    /// A synchronous standby's hold, released by this task.
    pub hold: Option<JoinHandle<()>>,
    /// An outage is not restored before this.
    pub back_at: Duration,
    /// `failover-kept-slot`: the stream its failovers draw from whether
    /// the permanent slot survives (see [`kept_slot_draw`]); `None`: never.
    pub kept: Option<Rng>,
    /// Every failover keeps the slot (a replay of the fault alone).
    pub kept_only: bool,
    /// The failover under way keeps the slot: how.
    pub keeping: Option<Keep>,
    /// The clusters a `cut-over` left: alive to the history's end, as the
    /// blue side of a blue/green cut-over lives on, with the connections
    /// established there.
    pub left: Vec<Server>,
}

/// How a failover that keeps the slot goes (see `failover-kept-slot` in the
/// crate doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Keep {
    /// The standby streams to the end: the old primary stops cleanly and
    /// ships it everything first, so the gateways applied nothing the new
    /// timeline lacks (A <= F).
    Behind,
    /// The standby stopped receiving: the gateways apply a tail the new
    /// timeline loses (A > F); `rebuild`: every gateway rebuilds its
    /// filters from the old primary meanwhile, so their scans see past the
    /// fork and the filters must not be kept.
    Ahead { rebuild: bool },
}

/// Salts the stream `failover-kept-slot` draws from.
const KEPT_SALT: u64 = 0x6b65_7074_736c_6f74;

/// The stream a history's failovers draw from whether the slot survives:
/// one of its own, so that the seeds' other choices, CI's among them, stay
/// what they were before the fault existed. Only with a permanent slot
/// (every bus history; a WAL history as its seed chose); every failover
/// keeps the slot when `failover-kept-slot` is the only fault selected
/// (a replay of it), else half of them.
pub(super) fn kept_slot_draw(opts: &Opts, permanent: bool) -> Option<(Rng, bool)> {
    if !permanent || !opts.faults.contains(&Fault::FailoverKeptSlot) {
        return None;
    }
    let only = opts.faults.iter().all(|f| *f == Fault::FailoverKeptSlot);
    Some((Rng::new(opts.seed ^ KEPT_SALT), only))
}

impl Life {
    /// The primary, its proxy, and database `db` on it (empty).
    pub async fn start(seed: u64, db: &str) -> (Life, sqlx::PgPool) {
        let mut rng = Rng::new(seed ^ LIFE_SALT);
        let _ = rng.chance(50);
        let async_commits = rng.chance(50);
        let mut settings = vec!["max_prepared_transactions=20"];
        if async_commits {
            // An asynchronous commit reaches the disk within three of
            // these (or when a feed forces the flush): a crash loses the
            // last second or so.
            settings.push("wal_writer_delay=300ms");
        }
        let primary = Server::primary(&settings);
        let pool = primary.create_empty_db(db).await;
        // As `TestDb::new` leaves a database of the shared servers.
        bloomgate::db::MIGRATOR.run(&pool).await.unwrap();
        let proxy = Proxy::start_to(addr(&primary)).await;
        (
            Life {
                primary,
                standby: None,
                replica: None,
                stranded: false,
                look_held: false,
                proxy,
                async_commits,
                rng,
                open: None,
                hold: None,
                back_at: Duration::ZERO,
                kept: None,
                kept_only: false,
                keeping: None,
                left: Vec::new(),
            },
            pool,
        )
    }

    /// The standby, and the replica when `replica`; after the database
    /// holds what the history starts with.
    pub fn add_servers(&mut self, replica: bool) {
        self.standby = Some(self.primary.standby());
        if replica {
            self.replica = Some(self.primary.standby_through(self.proxy.addr.port()));
        }
    }

    /// `db` on the primary, as the gateways reach it (through the proxy).
    pub fn gateway_url(&self, db: &str) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{}/{db}",
            self.proxy.addr.port()
        )
    }

    /// `db` on the primary directly (the writer: an outage does not cut it).
    pub fn writer_url(&self, db: &str) -> String {
        self.primary.url(db)
    }

    pub fn describe(&self) -> String {
        format!(
            "a cluster of its own (primary :{}, standby, {}, gateways through a proxy), {} commits",
            self.primary.port,
            if self.replica.is_some() {
                "a replica through the proxy"
            } else {
                "no replica"
            },
            if self.async_commits {
                "asynchronous"
            } else {
                "synchronous"
            }
        )
    }

    /// Ends the primary's WAL segment, as the audit's failover did, and
    /// waits (up to 5 s) for the read replica to replay the switch: the
    /// old timeline then ends a segment past where the standby stopped,
    /// so the replica that failover strands stands *ahead* of every
    /// position the new primary reaches for its first 16 MB of WAL. Only
    /// its timeline tells that it is not the primary's history; compared
    /// by LSN alone it looks current, with lag 0.
    ///
    /// What it did, for the journal: a switch that failed leaves the
    /// failover without it (the replica then stands where the standby
    /// did, not ahead), which a history's reader must know.
    async fn switch_wal(&self) -> String {
        let c = PgConnection::connect(&self.primary.url("postgres")).await;
        let mut c = match c {
            Ok(c) => c,
            Err(e) => return format!("the WAL switch could not connect ({e}): played without it"),
        };
        let switched = sqlx::query_scalar::<_, String>("SELECT pg_switch_wal()::text")
            .fetch_one(&mut c)
            .await;
        let switched = match switched {
            Ok(s) => s,
            Err(e) => return format!("the WAL switch failed ({e}): played without it"),
        };
        let Some(replica) = self.replica.as_ref().filter(|_| !self.stranded) else {
            return format!("WAL switched at {switched}");
        };
        let Ok(mut r) = PgConnection::connect(&replica.url("postgres")).await else {
            return format!("WAL switched at {switched}; the replica could not be asked");
        };
        for _ in 0..100 {
            let replayed = sqlx::query_scalar::<_, bool>(
                "SELECT coalesce(pg_last_wal_replay_lsn() >= $1::pg_lsn, false)",
            )
            .bind(&switched)
            .fetch_one(&mut r)
            .await;
            match replayed {
                Ok(true) => return format!("WAL switched at {switched}, replayed by the replica"),
                Ok(false) => tokio::time::sleep(Duration::from_millis(50)).await,
                Err(e) => {
                    return format!("WAL switched at {switched}; the replica could not say ({e})");
                }
            }
        }
        format!("WAL switched at {switched}; the replica had not replayed it after 5 s")
    }
}

fn addr(s: &Server) -> SocketAddr {
    format!("127.0.0.1:{}", s.port).parse().unwrap()
}

impl World {
    /// Connects the writer to the current primary again (after a crash or
    /// a failover), with the history's commit mode.
    pub(super) async fn reconnect_writer(&mut self) {
        let url = self.writer_url();
        let mut tries = 0;
        self.writer = loop {
            match PgConnection::connect(&url).await {
                Ok(c) => break c,
                Err(e) if tries < 100 => {
                    tries += 1;
                    let _ = e;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => panic!("seed {}: the writer cannot reconnect: {e}", self.opts.seed),
            }
        };
        if self.life.as_ref().is_some_and(|l| l.async_commits) {
            self.writer
                .execute("SET synchronous_commit = off")
                .await
                .unwrap();
        }
    }

    /// What Postgres has now for every path, as the new truth (commits the
    /// model recorded may have been lost), and the writer's idea of which
    /// rows and partitions exist read again: its next statements are
    /// about the rows the new primary has (a row the failover brought
    /// back must be in a `TRUNCATE`'s paths, a partition it lost must not
    /// be detached).
    pub(super) async fn reset_model(&mut self) {
        let paths = self.shared.model.lock().unwrap().paths.clone();
        let truth = read_back(&mut self.writer, &paths).await.unwrap();
        let now = self.now();
        self.shared.model.lock().unwrap().reset(now, truth);
        let w = &mut self.writer;
        let users: Vec<(i64, String)> = sqlx::query_as("SELECT id, email FROM users")
            .fetch_all(&mut *w)
            .await
            .unwrap();
        let docs: Vec<String> = sqlx::query_scalar("SELECT id::text FROM docs")
            .fetch_all(&mut *w)
            .await
            .unwrap();
        let tags: Vec<String> = sqlx::query_scalar("SELECT code FROM tags")
            .fetch_all(&mut *w)
            .await
            .unwrap();
        let events: Vec<i64> = sqlx::query_scalar("SELECT id FROM events")
            .fetch_all(&mut *w)
            .await
            .unwrap();
        let orders: Vec<(i64, String)> = sqlx::query_as("SELECT tenant_id, order_no FROM orders")
            .fetch_all(&mut *w)
            .await
            .unwrap();
        let attached: Vec<String> = sqlx::query_scalar(
            "SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
              WHERE i.inhparent = 'events'::regclass",
        )
        .fetch_all(&mut *w)
        .await
        .unwrap();
        let shadow = &mut self.writes.shadow;
        shadow.users = users.into_iter().collect();
        shadow.docs = docs.into_iter().collect();
        shadow.tags = tags.into_iter().collect();
        shadow.events = events.into_iter().collect();
        shadow.orders = orders.into_iter().collect();
        shadow.attached = attached
            .iter()
            .filter_map(|n| n.strip_prefix("events_p")?.parse().ok())
            .filter(|n| *n != 0)
            .collect();
        let (users, tags) = (&shadow.users, &shadow.tags);
        shadow
            .dead_users
            .retain(|(id, email)| !users.contains_key(id) && !users.values().any(|e| e == email));
        shadow.dead_tags.retain(|t| !tags.contains(t));
        let orders = &shadow.orders;
        shadow.dead_orders.retain(|o| !orders.contains(o));
    }

    /// On a cluster of the history's own, with nothing played on it now:
    /// no lifecycle fault open, no copy to put back, no hold in force.
    pub(super) fn cluster_idle(&self) -> bool {
        self.life.as_ref().is_some_and(|life| {
            life.open.is_none()
                && self.copy.is_none()
                && life.hold.as_ref().is_none_or(|h| h.is_finished())
        })
    }

    /// A lifecycle fault, if it applies now: on a cluster of the history's
    /// own, none other in progress. `false`: not injected.
    pub(super) async fn inject_lifecycle(&mut self, f: Fault) -> bool {
        let Some(life) = &mut self.life else {
            return false;
        };
        if let Some(h) = &life.hold
            && !h.is_finished()
        {
            return false;
        }
        if life.open.is_some() || (f == Fault::Failover && life.standby.is_none()) {
            return false;
        }
        let paths = self.warm(6, false).await;
        let now = self.now();
        let life = self.life.as_mut().unwrap();
        match f {
            Fault::Failover => {
                let keep = match (&mut life.kept, &self.slot) {
                    (Some(r), Some(_)) => {
                        let only = life.kept_only;
                        (only || r.chance(50)).then(|| match r.chance(50) {
                            true => Keep::Behind,
                            false => Keep::Ahead {
                                rebuild: r.chance(50),
                            },
                        })
                    }
                    _ => None,
                };
                let kept = match keep {
                    Some(k) => self.keep_slot(k).await,
                    None => None,
                };
                let life = self.life.as_mut().unwrap();
                life.keeping = kept;
                if kept != Some(Keep::Behind) {
                    // Stopped, the standby falls behind what is written
                    // next: those commits are lost when it is promoted.
                    life.standby.as_ref().unwrap().stop("fast");
                }
                life.open = Some((f, now));
                self.shared.note(format!(
                    "fault failover: {}; the primary {} in a few steps",
                    match kept {
                        None => "the standby stopped".to_string(),
                        Some(Keep::Behind) => "the permanent slot copied to the standby, which streams on".to_string(),
                        Some(Keep::Ahead { rebuild }) => format!(
                            "the permanent slot copied to the standby, which stopped{}",
                            if rebuild { "; every filter rebuilt from the old primary" } else { "" }
                        ),
                    },
                    if kept == Some(Keep::Behind) { "stops cleanly" } else { "crashes" }
                ));
                if let Some(Keep::Ahead { rebuild: true }) = kept {
                    self.rebuild_filters().await;
                }
                self.later(2, 5, Action::Promote);
            }
            Fault::Crash => {
                self.crash().await;
            }
            Fault::SyncHold => {
                let hold = match life.rng.below(10) {
                    0..=1 => Duration::from_secs(62),
                    2..=5 => Duration::from_secs(8),
                    _ => Duration::from_secs(3),
                };
                let admin = life.primary.url("postgres");
                let mut c = PgConnection::connect(&admin).await.unwrap();
                c.execute("ALTER SYSTEM SET synchronous_standby_names = 'ghost'")
                    .await
                    .unwrap();
                c.execute("SELECT pg_reload_conf()").await.unwrap();
                life.hold = Some(tokio::spawn(async move {
                    tokio::time::sleep(hold).await;
                    c.execute("ALTER SYSTEM RESET synchronous_standby_names")
                        .await
                        .unwrap();
                    c.execute("SELECT pg_reload_conf()").await.unwrap();
                }));
                self.shared.note(format!(
                    "fault sync-hold: synchronous_standby_names = 'ghost' for {}s (the writer's next commit waits)",
                    hold.as_secs()
                ));
            }
            Fault::Outage => {
                self.shared
                    .model
                    .lock()
                    .unwrap()
                    .outage_began("outage", now);
                let life = self.life.as_mut().unwrap();
                life.proxy.cut();
                let down = *life.rng.pick(&[
                    Duration::from_secs(1),
                    Duration::from_secs(3),
                    Duration::from_secs(8),
                ]);
                life.back_at = now + down;
                life.open = Some((f, now));
                self.shared
                    .model
                    .lock()
                    .unwrap()
                    .window("outage", now, FEED_GAP);
                self.shared.note(format!(
                    "fault outage: every gateway connection cut, at least {}s",
                    down.as_secs()
                ));
                self.later(2, 8, Action::Restore);
            }
            _ => unreachable!("not a lifecycle fault"),
        }
        self.writes.focus(
            Focus::Update {
                paths,
                emails: false,
            },
            6,
        );
        true
    }

    /// `crash`: the primary stopped with `-m immediate` and started again
    /// (same timeline; asynchronous commits not yet flushed are lost).
    async fn crash(&mut self) {
        // Recorded first: readers judge answers while the server stops.
        let t = self.now();
        {
            let mut m = self.shared.model.lock().unwrap();
            m.outage_began("crash", t);
            m.open_window("crash", t);
        }
        let life = self.life.as_mut().unwrap();
        life.primary.stop("immediate");
        life.primary.start();
        self.reconnect_writer().await;
        self.reset_model().await;
        let back = self.now();
        let mut m = self.shared.model.lock().unwrap();
        m.outage_ended(back);
        m.close_window("crash", back + FEED_GAP);
        drop(m);
        self.shared.note(format!(
            "fault crash: the primary crashed and restarted in {}ms",
            (back - t).as_millis()
        ));
    }

    /// The rest of `failover`: the primary crashes, the standby (behind
    /// it) is promoted, and the proxy sends every new connection to it;
    /// then a new standby of the new primary for the next failover.
    pub(super) async fn promote(&mut self) {
        // Before the window opens: the primary serves throughout the switch.
        let switch = self.life.as_ref().unwrap().switch_wal().await;
        let t = self.now();
        {
            let mut m = self.shared.model.lock().unwrap();
            m.outage_began("failover", t);
            m.open_window("failover", t);
        }
        let life = self.life.as_mut().unwrap();
        let standby = life.standby.take().unwrap();
        if life.keeping.take() == Some(Keep::Behind) {
            // A switchover: the old primary ships everything as it stops.
            life.primary.stop("fast");
            standby.stop("fast");
        } else {
            life.primary.stop("immediate");
        }
        standby.start();
        standby.promote();
        life.proxy.retarget(addr(&standby));
        // The old primary's directory goes with it.
        let _old = std::mem::replace(&mut life.primary, standby);
        self.reconnect_writer().await;
        self.reset_model().await;
        let back = self.now();
        {
            let mut m = self.shared.model.lock().unwrap();
            m.outage_ended(back);
            m.close_window("failover", back + FEED_GAP);
        }
        let life = self.life.as_mut().unwrap();
        life.standby = Some(life.primary.standby());
        life.stranded = life.replica.is_some();
        life.open = None;
        self.shared.note(format!(
            "failover: {switch}; the primary crashed, the standby promoted and behind the proxy in {}ms{}",
            (back - t).as_millis(),
            if life.replica.is_some() {
                "; the replica is stranded on the old timeline"
            } else {
                ""
            }
        ));
    }

    /// `cut-over`: a blue/green cut-over by DNS or an HAProxy reload. The
    /// history's database is copied (`pg_dump | psql`) to a new cluster of its
    /// own (another system identifier) while the writer waits between steps;
    /// the proxy sends new connections there and, half the time, closes the
    /// gateways' pool connections (`application_name` `bloomgate`), as
    /// connections age out; every other connection (the feeds', the relay's,
    /// the read replica's; the pool's the other half) stays on the old cluster,
    /// which lives on; the writer moves. The old cluster's standby goes, a new
    /// one is made, and the replica, streaming from the old cluster, is
    /// stranded there. Window: from the retarget until [`ADDRESS_BOUND`] (the
    /// gateway's own look at where the address leads) and `FEED_GAP` past the
    /// move; played in turn, the pool's connections always stay. Half the
    /// times the pool's connections close, on a direct feed, the look is
    /// silent too until the round's quiescence (its connections,
    /// `bloomgate-address`, stall at the proxy): then only the pool's new
    /// connections, each reading the server it reached, can move the feed
    /// (a miss opens one), and the window lasts until the quiescence lets
    /// the look speak again, and [`ADDRESS_BOUND`] and `FEED_GAP` past it.
    pub(super) async fn cut_over(&mut self) -> bool {
        if !self.cluster_idle() {
            return false;
        }
        // A slowed WAL writer is the old cluster's: as it was, first.
        self.wal_writer_back(true).await;
        // Played in turn (CI), never aged: only the gateway's own look at
        // the address moves it then.
        let aged = self
            .assume_rng
            .as_mut()
            .expect("drawn from its stream")
            .chance(50)
            && !self.opts.in_turn;
        let look_held = aged
            && self.opts.feed != crate::Feed::Bus
            && self
                .assume_rng
                .as_mut()
                .expect("drawn from its stream")
                .chance(50);
        let paths = self.warm(6, false).await;
        let life = self.life.as_mut().unwrap();
        let green = life.primary.sibling();
        life.primary.dump_into(&self.db.name, &green);
        // Nothing the gateways see changes before the retarget.
        let t = self.now();
        self.shared.model.lock().unwrap().open_window("cut-over", t);
        let life = self.life.as_mut().unwrap();
        if look_held {
            life.proxy.stall_named(&format!(
                "application_name\0{}\0",
                bloomgate::db::identity::ADDRESS_APPLICATION_NAME
            ));
            life.look_held = true;
        }
        life.proxy.retarget(addr(&green));
        if aged {
            life.proxy.cut_named("application_name\0bloomgate\0");
        }
        let blue = std::mem::replace(&mut life.primary, green);
        life.left.push(blue);
        if let Some(s) = life.standby.take() {
            s.stop("fast");
        }
        self.reconnect_writer().await;
        self.reset_model().await;
        let back = self.now();
        // With the look silent, only a pool connection the gateway opens
        // (a miss) moves the feed, and nothing bounds when one comes: the
        // window stays open until the quiescence lets the look speak.
        if !look_held {
            self.shared
                .model
                .lock()
                .unwrap()
                .close_window("cut-over", back + ADDRESS_BOUND + FEED_GAP);
        }
        let life = self.life.as_mut().unwrap();
        life.standby = Some(life.primary.standby());
        life.stranded = life.replica.is_some();
        self.shared.note(format!(
            "fault cut-over: the database copied to another cluster (:{}) and new connections sent there in {}ms; {}{}",
            life.primary.port,
            (back - t).as_millis(),
            if look_held {
                "the pool's connections closed, the feeds' left on the old one, the look at the address silent"
            } else if aged {
                "the pool's connections closed, the feeds' left on the old one"
            } else {
                "every established connection left on the old one"
            },
            if life.replica.is_some() {
                "; the replica is stranded on the old cluster"
            } else {
                ""
            }
        ));
        self.writes.focus(
            Focus::Update {
                paths,
                emails: false,
            },
            6,
        );
        true
    }

    /// Copies the permanent slot onto the standby, as Patroni's permanent
    /// slots keep it there: once the WAL it needs from is on the standby
    /// (the gateways' confirmations move it; up to 10 s of checkpoints),
    /// after a checkpoint wrote its state; the standby stopped for the
    /// copy, and started again for `Keep::Behind`. `None`: the WAL never
    /// reached the standby's, and the failover is a plain one.
    async fn keep_slot(&mut self, keep: Keep) -> Option<Keep> {
        let slot = self.slot.clone()?;
        let life = self.life.as_ref().unwrap();
        let standby = life.standby.as_ref().unwrap();
        let mut c = PgConnection::connect(&life.primary.url("postgres"))
            .await
            .ok()?;
        let pg_wal = standby.path().join("data").join("pg_wal");
        let mut ready = false;
        for _ in 0..50 {
            let _ = c.execute("CHECKPOINT").await;
            let file = sqlx::query_scalar::<_, Option<String>>(
                "SELECT pg_walfile_name(restart_lsn) FROM pg_replication_slots WHERE slot_name = $1",
            )
            .bind(&slot)
            .fetch_optional(&mut c)
            .await
            .ok()
            .flatten()
            .flatten();
            // The standby's segments are of the same timeline (it follows
            // this primary), named alike.
            if file.is_some_and(|f| pg_wal.join(&f).exists()) {
                ready = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        if !ready {
            self.shared.note(
                "failover-kept-slot: the slot's WAL is not on the standby; a plain failover".into(),
            );
            return None;
        }
        let _ = c.execute("CHECKPOINT").await;
        standby.stop("fast");
        let primary = &self.life.as_ref().unwrap().primary;
        standby.copy_slot_from(primary, &slot);
        if keep == Keep::Behind {
            standby.start();
        }
        Some(keep)
    }

    /// Every gateway's filters rebuilt now, from the old primary (the
    /// writes continue meanwhile; a gateway that is not up is left).
    async fn rebuild_filters(&mut self) {
        for g in self.shared.live() {
            for r in &g.gw.resources {
                let r = r.clone();
                let _ = tokio::time::timeout(Duration::from_secs(10), r.rebuild(false)).await;
            }
        }
    }

    /// The end of `outage` or `hang`: connections pass again (after a
    /// hang, the open ones go on with what they held).
    pub(super) async fn restore(&mut self) {
        let life = self.life.as_mut().unwrap();
        let wait = life.back_at.saturating_sub(self.shared.now());
        tokio::time::sleep(wait).await;
        let life = self.life.as_mut().unwrap();
        let what = match life.open {
            Some((Fault::Hang, _)) => {
                life.proxy.unhang();
                "hang over: what the connections held passes, and they go on"
            }
            _ => {
                life.proxy.restore();
                "outage over: connections pass again"
            }
        };
        life.open = None;
        let now = self.now();
        self.shared.model.lock().unwrap().outage_ended(now);
        self.shared.note(what.into());
    }

    /// Every lifecycle fault in progress brought to its end (a history's
    /// last comparison is strict): a failover promoted, an outage over,
    /// a hold released.
    pub(super) async fn end_lifecycle(&mut self) {
        self.wal_writer_back(true).await;
        self.put_back_copy().await;
        let Some(life) = &mut self.life else {
            return;
        };
        if let Some(h) = life.hold.take() {
            let _ = h.await;
        }
    }
}
