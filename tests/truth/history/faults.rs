//! The faults: how each is injected, and what follows it (repairs,
//! resumptions, a gateway stopped).

use std::time::{Duration, Instant};

use sqlx::{Executor, PgPool};

use super::reads::get;
use super::{FEED_GAP, WATCHED, World};

/// `redis-failover`: the sentinels must have promoted the replica within
/// this of the kill (they take about 2 s: 1 s to call the primary down,
/// an election, the promotion); past it the test's Redis set-up is
/// broken, not the gateway.
const PROMOTION_LIMIT: Duration = Duration::from_secs(60);
use crate::model::secs;
use crate::ops::{Focus, OrdersFocus, Table, user_paths};
use crate::redis::Restart;
use crate::schema::{self, Path, Res};
use crate::{Fault, Feed};

/// Repairs and other actions that come a number of steps after a fault.
#[derive(Clone, Copy, Debug)]
pub(super) enum Action {
    RepairPublication,
    RepairIdentity,
    StopOne,
    RestartAll,
    Resume,
    /// `restart-redis`, with a copy of its data taken some steps before.
    RedisKill(Restart),
    RedisBack(Restart),
    /// `redis-failover`: the kill, some steps after the replica's link was
    /// cut; then the promotion looked for until the sentinels have made it.
    FailoverKill,
    RedisPromoted,
    /// `failover`'s second half (see `life`).
    Promote,
    /// `outage`'s end.
    Restore,
    /// `wal-writer`'s end (see `assumptions`).
    WalWriterBack,
    /// `restore`'s second half: the copy put back.
    PutBackCopy,
    /// `redis-refuses`' end (see `refusals`).
    RedisAccepts,
    /// `redis-split-brain`'s end.
    Heal,
}

impl World {
    /// A statement of a fault, on its own (retried if Postgres aborts it
    /// for a deadlock, as the writer's transactions are).
    pub(super) async fn sql(&mut self, sql: &str) {
        if self.opts.trace {
            eprintln!("truth: t={} {sql}", secs(self.now()));
        }
        for attempt in 0.. {
            match self.writer.execute(sql).await {
                Ok(_) => return,
                Err(e) if super::aborted(&e) && attempt < 10 => {
                    self.report.writer_aborts += 1;
                    self.shared
                        .note(format!("the fault's statement was aborted, retried: {e}"));
                }
                Err(e) => panic!("seed {}: {sql}: {e}", self.opts.seed),
            }
        }
    }

    /// Loads `n` random rows into every gateway's cache (GET once), and
    /// 1-3 of `orders` (drawn from its own stream), and returns their
    /// paths: a fault followed by writes to them shows whether the gateway
    /// drops what it cached.
    pub(super) async fn warm(&mut self, n: usize, by_email: bool) -> Vec<Path> {
        let mut paths = Vec::new();
        for _ in 0..n {
            let t = if by_email {
                Table::Users
            } else {
                *self.writes.rng.pick(&Table::ALL)
            };
            let all = self.writes.shadow.paths(t);
            if all.is_empty() {
                continue;
            }
            let p = all[self.writes.rng.below(all.len())].clone();
            let p = if by_email && p.res == Res::Users {
                let id: i64 = p.key.parse().unwrap();
                user_paths(id, &self.writes.shadow.users[&id])[1].clone()
            } else {
                p
            };
            paths.push(p);
        }
        let orders = self.writes.shadow.paths(Table::Orders);
        if !orders.is_empty() {
            for _ in 0..self.writes.orders_rng.range(1, 3) {
                let i = self.writes.orders_rng.below(orders.len());
                paths.push(orders[i].clone());
            }
        }
        for g in self.shared.live() {
            for p in &paths {
                let _ = get(&g, &p.url()).await;
            }
        }
        paths
    }

    pub(super) async fn inject(&mut self, f: Fault) {
        let injected = match f {
            Fault::Rewrite
            | Fault::Pause
            | Fault::WalWriter
            | Fault::Restore
            | Fault::CutOver
            | Fault::Hang => self.inject_assumption(f).await,
            Fault::Failover | Fault::Crash | Fault::SyncHold | Fault::Outage => {
                self.inject_lifecycle(f).await
            }
            // Never drawn as a round's fault: a way a failover goes.
            Fault::FailoverKeptSlot => false,
            Fault::KillWalsender | Fault::KillListener | Fault::DropSlot => {
                if f == Fault::DropSlot && self.slot.is_none() {
                    false
                } else {
                    let paths = self.warm(6, false).await;
                    let what = match f {
                        Fault::DropSlot => self.drop_slot().await,
                        _ => self.kill_feed().await,
                    };
                    self.shared.note(format!("fault {}: {what}", f.name()));
                    let now = self.now();
                    self.shared
                        .model
                        .lock()
                        .unwrap()
                        .window(f.name(), now, FEED_GAP);
                    self.writes.focus(
                        Focus::Update {
                            paths,
                            emails: false,
                        },
                        6,
                    );
                    true
                }
            }
            Fault::Restart => {
                let live = self.shared.live();
                let g = live[self.writes.rng.below(live.len())].clone();
                self.shared.note(format!("fault restart: gw{}", g.id));
                self.retire(&g);
                self.spawn_gateway("restart");
                true
            }
            Fault::SecondGateway => {
                if self.open_second || self.shared.live().len() > 1 {
                    false
                } else {
                    self.shared.note(format!(
                        "fault second-gateway{}",
                        self.slot
                            .as_ref()
                            .map(|s| format!(" on slot {s}"))
                            .unwrap_or_default()
                    ));
                    self.spawn_gateway("second");
                    self.open_second = true;
                    self.later(10, 40, Action::StopOne);
                    self.writes.focus(Focus::Inserts, 8);
                    true
                }
            }
            Fault::Publication => {
                if self.open_publication {
                    false
                } else {
                    self.edit_publication().await;
                    self.open_publication = true;
                    *self.shared.publication_excuse.lock().unwrap() = Some(Duration::MAX);
                    self.later(8, 30, Action::RepairPublication);
                    true
                }
            }
            Fault::ReplicaIdentity => {
                if self.open_identity {
                    false
                } else {
                    let paths = self.warm(6, true).await;
                    let to = if self.writes.rng.chance(70) {
                        "DEFAULT"
                    } else {
                        "USING INDEX users_email_key"
                    };
                    self.sql(&format!("ALTER TABLE users REPLICA IDENTITY {to}"))
                        .await;
                    self.shared
                        .note(format!("fault replica-identity: users now {to}"));
                    let now = self.now();
                    self.shared
                        .model
                        .lock()
                        .unwrap()
                        .window("replica-identity", now, WATCHED);
                    self.writes.focus(
                        Focus::Update {
                            paths,
                            emails: true,
                        },
                        6,
                    );
                    self.open_identity = true;
                    *self.shared.identity_excuse.lock().unwrap() = Some(Duration::MAX);
                    self.later(8, 30, Action::RepairIdentity);
                    true
                }
            }
            Fault::Partition => {
                let detach = !self.writes.shadow.attached.is_empty()
                    && (self.writes.shadow.attached.len() >= 3 || self.writes.rng.chance(50));
                if detach {
                    self.detach().await;
                } else {
                    self.attach().await;
                }
                true
            }
            Fault::AddColumn => {
                if self.columns_added >= 6 {
                    false
                } else {
                    self.columns_added += 1;
                    let t = self.writes.rng.pick(&Table::ALL).name();
                    let n = self.columns_added;
                    let int = self.writes.rng.chance(50);
                    // `orders` too, a quarter of the time (its own draw).
                    let orders = self.writes.orders_rng.chance(25);
                    for t in std::iter::once(t).chain(orders.then_some("orders")) {
                        let sql = if int {
                            format!("ALTER TABLE {t} ADD COLUMN extra{n} int DEFAULT {n}")
                        } else {
                            format!("ALTER TABLE {t} ADD COLUMN extra{n} text")
                        };
                        self.sql(&sql).await;
                        self.shared.note(format!("fault add-column: {sql}"));
                    }
                    true
                }
            }
            Fault::KillRelay => self.kill_relay().await,
            Fault::DamagedSnapshots => self.damage_snapshots().await,
            Fault::RestartRedis => {
                if self.open_redis || self.redis.is_none() {
                    false
                } else {
                    self.open_redis = true;
                    let with = match self.writes.rng.below(3) {
                        0 => Restart::Empty,
                        1 => Restart::Kept,
                        _ => Restart::Older,
                    };
                    if with == Restart::Older {
                        // The commits appended from here to the kill are
                        // what the restarted stream lacks.
                        self.redis.as_ref().unwrap().copy_now();
                        self.shared.note(
                            "fault restart-redis: its data copied; killed some transactions later"
                                .into(),
                        );
                        self.later(2, 6, Action::RedisKill(with));
                    } else {
                        self.redis_kill(with).await;
                    }
                    true
                }
            }
            Fault::RedisFailover => {
                if self.split {
                    false
                } else {
                    self.redis_failover().await
                }
            }
            Fault::RedisRefuses => self.redis_refuses().await,
            Fault::SplitBrain => self.split_brain().await,
            Fault::ReplicaPause => {
                if self.replica_admin.is_none() || self.paused.is_some() {
                    false
                } else {
                    let (pool, url) = self.replica_admin.clone().unwrap();
                    pool.execute("SELECT pg_wal_replay_pause()").await.unwrap();
                    self.shared
                        .note(format!("fault replica-pause: replay paused on {url}"));
                    self.paused = Some(Resume {
                        pool: Some(pool),
                        url,
                    });
                    // Half the time the gateways start while it is behind
                    // (the rows written meanwhile are what it lacks).
                    if self.writes.rng.chance(50) {
                        self.later(5, 12, Action::RestartAll);
                        self.later(15, 40, Action::Resume);
                    } else {
                        self.later(5, 30, Action::Resume);
                    }
                    true
                }
            }
        };
        if injected {
            self.report.faults += 1;
        }
    }

    /// `kill-relay`: the gateway holding `bus.slot` killed ([`World::kill`])
    /// right after caching rows that are updated next, and a new gateway
    /// started in its place (the fleet keeps its size, as an orchestrator
    /// would keep it). Not injected when no gateway has relayed for 5 s.
    async fn kill_relay(&mut self) -> bool {
        let paths = self.warm(6, false).await;
        let began = Instant::now();
        let relay = loop {
            let relay = self
                .shared
                .live()
                .into_iter()
                .find(|g| g.gw.bus_status().is_some_and(|s| s.get().relaying));
            if relay.is_some() || began.elapsed() > Duration::from_secs(5) {
                break relay;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let Some(g) = relay else {
            self.shared
                .note("fault kill-relay: no gateway has relayed for 5 s: not injected".into());
            return false;
        };
        let slot = self.slot.clone().unwrap();
        let walsender = self.slot_holder(&slot).await;
        self.kill(&g);
        let now = self.now();
        self.shared
            .model
            .lock()
            .unwrap()
            .window("kill-relay", now, FEED_GAP);
        // Postgres sees the killed relay's connection close: its
        // walsender exits and the slot is free for the next candidate.
        let killed = Instant::now();
        let freed = match walsender {
            None => "no walsender held the slot".to_string(),
            Some(pid) => loop {
                if self.slot_holder(&slot).await != Some(pid) {
                    break format!(
                        "its walsender (pid {pid}) gone after {:?}",
                        killed.elapsed()
                    );
                }
                if killed.elapsed() > Duration::from_secs(3) {
                    break format!("its walsender (pid {pid}) still holds the slot after 3 s");
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            },
        };
        self.shared
            .note(format!("fault kill-relay: gw{} killed; {freed}", g.id));
        self.writes.focus(
            Focus::Update {
                paths,
                emails: false,
            },
            6,
        );
        self.spawn_gateway("replaces the killed relay");
        true
    }

    /// `damaged-snapshots`: every snapshot on the bus damaged (a byte of
    /// its first chunk flipped) or deleted, half and half; then a gateway
    /// restarted, which joins over them: what does not open is scanned.
    async fn damage_snapshots(&mut self) -> bool {
        let (Some(redis), Some(bus)) = (&self.redis, &self.bus) else {
            self.shared
                .note("fault damaged-snapshots: not on one redis-server: not injected".into());
            return false;
        };
        if bus.snapshots.is_none() {
            return false;
        }
        let client = redis::Client::open(redis.url()).unwrap();
        let Ok(mut c) = client.get_multiplexed_async_connection().await else {
            self.shared
                .note("fault damaged-snapshots: Redis does not answer: not injected".into());
            return false;
        };
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{}:*:snap:*", bus.prefix))
            .query_async(&mut c)
            .await
            .unwrap_or_default();
        let (mut damaged, mut deleted) = (0, 0);
        // The hashes end in a nonce of 32 hex digits; the lists in a name.
        for k in keys
            .iter()
            .filter(|k| k.rsplit(':').next().is_some_and(|n| n.len() == 32))
        {
            if self.writes.rng.chance(50) {
                let _: Result<(), _> = redis::cmd("DEL").arg(k).query_async(&mut c).await;
                deleted += 1;
                continue;
            }
            let chunk: Option<Vec<u8>> = redis::cmd("HGET")
                .arg(k)
                .arg("0")
                .query_async(&mut c)
                .await
                .unwrap_or_default();
            if let Some(mut chunk) = chunk.filter(|c| !c.is_empty()) {
                let at = self.writes.rng.below(chunk.len());
                chunk[at] ^= 1 << self.writes.rng.below(8);
                let _: Result<(), _> = redis::cmd("HSET")
                    .arg(k)
                    .arg("0")
                    .arg(chunk)
                    .query_async(&mut c)
                    .await;
                damaged += 1;
            }
        }
        let live = self.shared.live();
        let g = live[self.writes.rng.below(live.len())].clone();
        self.shared.note(format!(
            "fault damaged-snapshots: {damaged} damaged, {deleted} deleted; gw{} restarted over them",
            g.id
        ));
        self.retire(&g);
        self.spawn_gateway("restarted over damaged snapshots");
        true
    }

    /// The backend holding `slot`, if one does.
    async fn slot_holder(&mut self, slot: &str) -> Option<i32> {
        sqlx::query_scalar("SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1")
            .bind(slot)
            .fetch_optional(&mut self.writer)
            .await
            .unwrap()
            .flatten()
    }

    /// `restart-redis`: `SIGKILL` after caching rows that are updated next;
    /// started again on the same port some transactions later.
    async fn redis_kill(&mut self, with: Restart) {
        let paths = self.warm(6, false).await;
        // Down for less than either `bus.max_lag`, for more than 1 s, or
        // for more than 5 s, while the writer goes on.
        let down = Duration::from_millis([0, 2000, 6000][self.writes.rng.below(3)]);
        self.redis.as_mut().unwrap().kill();
        self.redis_back_at = self.now() + down;
        self.shared.note(format!(
            "fault restart-redis: redis-server killed (SIGKILL); it comes back {}, {down:?} or more later",
            with.name()
        ));
        let now = self.now();
        self.shared
            .model
            .lock()
            .unwrap()
            .window("restart-redis: killed", now, FEED_GAP);
        self.writes.focus(
            Focus::Update {
                paths,
                emails: false,
            },
            6,
        );
        self.later(1, 8, Action::RedisBack(with));
    }

    /// `redis-failover` on a Sentinel history: once the replica is in sync
    /// and every sentinel sees it (else not injected), half the time its
    /// link is cut first (its replication user turned away), so that the
    /// primary, killed 2-6 transactions later, dies with entries the
    /// replica never had (asynchronous replication's loss, made certain);
    /// else the primary is killed at once.
    async fn redis_failover(&mut self) -> bool {
        if self.failover.is_some() || self.site.is_none() {
            return false;
        }
        let site = self.site.as_mut().unwrap();
        // Steady within 20 s, following any failover the sentinels make
        // on their own meanwhile (one under way when the wait begins
        // included).
        let began = Instant::now();
        loop {
            if let Some(said) = site.follow().await {
                self.shared.note(format!(
                    "redis-failover: the sentinels failed over on their own; the primary is now on port {} (sentinel: {said})",
                    site.primary.port
                ));
            }
            match site.steady().await {
                Ok(()) => break,
                Err(why) if began.elapsed() > Duration::from_secs(20) => {
                    self.shared.note(format!(
                        "fault redis-failover: not injected, no promotion possible within 20 s: {why}"
                    ));
                    return false;
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
        self.failover = Some(None);
        if self.writes.rng.chance(50) {
            site.cut_replication().await;
            self.shared.note(format!(
                "fault redis-failover: the replica's link cut (port {} turns its replication user away); the primary killed some transactions later",
                site.primary.port
            ));
            self.later(2, 6, Action::FailoverKill);
        } else {
            self.failover_kill().await;
        }
        true
    }

    /// `redis-failover`'s kill: the Sentinel site's primary `SIGKILL`ed
    /// right after caching rows that are updated next, while the writer
    /// goes on; the sentinels promote the replica on their own.
    pub(super) async fn failover_kill(&mut self) {
        let paths = self.warm(6, false).await;
        let site = self.site.as_mut().unwrap();
        let (old, new) = (site.primary.port, site.replica.port);
        site.primary.kill();
        let now = self.now();
        self.failover = Some(Some(now));
        self.shared.note(format!(
            "fault redis-failover: the primary (port {old}) killed (SIGKILL); the sentinels are to promote the replica (port {new})"
        ));
        self.shared
            .model
            .lock()
            .unwrap()
            .window("redis-failover: killed", now, FEED_GAP);
        self.writes.focus(
            Focus::Update {
                paths,
                emails: false,
            },
            6,
        );
        self.later(1, 8, Action::RedisPromoted);
    }

    /// Whether the sentinels have promoted the replica (every sentinel
    /// names it, it says it is a master): if so the window from the
    /// promotion opens, as `restart-redis`'s from the restart, and the
    /// killed node joins again as the new primary's replica (empty), so a
    /// later round can fail over again; if not, asked again a few
    /// transactions later, or, with `wait` (a quiescence), until it is.
    pub(super) async fn failover_promoted(&mut self, wait: bool) {
        let Some(Some(killed)) = self.failover else {
            return;
        };
        while !self.site.as_ref().unwrap().promoted().await {
            assert!(
                self.now() < killed + PROMOTION_LIMIT,
                "seed {}: the sentinels have not promoted the replica within {PROMOTION_LIMIT:?} of the kill",
                self.opts.seed
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
            if !wait {
                self.later(1, 3, Action::RedisPromoted);
                return;
            }
        }
        let now = self.now();
        self.shared
            .model
            .lock()
            .unwrap()
            .window("redis-failover: promoted", now, FEED_GAP);
        let paths = self.warm(6, false).await;
        let site = self.site.as_mut().unwrap();
        let (old, new) = (site.primary.port, site.replica.port);
        site.rejoin().await;
        self.shared.note(format!(
            "redis-failover: the replica (port {new}) promoted, seen {} after the kill; the killed node (port {old}) back as its replica, empty",
            crate::model::secs(now - killed)
        ));
        self.writes.focus(
            Focus::Update {
                paths,
                emails: false,
            },
            6,
        );
        self.failover = None;
    }

    /// Kills the feed's own connections (not the pool's): the walsender
    /// (and its side connection), the listener, or the queue's poller.
    async fn kill_feed(&mut self) -> String {
        let filter = match self.opts.feed {
            Feed::Wal | Feed::WalPoll | Feed::Bus => "application_name = 'bloomgate-wal-feed'",
            Feed::Notify => "application_name = 'bloomgate-notify-feed'",
            Feed::Queue => "application_name = 'bloomgate-queue-feed'",
        };
        let sql = format!(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
             WHERE datname = current_database() AND pid <> pg_backend_pid() AND {filter}"
        );
        let n: i64 = sqlx::query_scalar(&sql)
            .fetch_one(&mut self.writer)
            .await
            .unwrap();
        format!("{n} backends terminated ({filter})")
    }

    /// Drops the permanent slot from outside: its holder killed, then the
    /// slot dropped before the gateway takes it again.
    async fn drop_slot(&mut self) -> String {
        let slot = self.slot.clone().unwrap();
        let began = Instant::now();
        while began.elapsed() < Duration::from_secs(3) {
            let _ = sqlx::query(
                "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots \
                 WHERE slot_name = $1 AND active_pid IS NOT NULL",
            )
            .bind(&slot)
            .execute(&mut self.writer)
            .await;
            let dropped = sqlx::query("SELECT pg_drop_replication_slot($1)")
                .bind(&slot)
                .execute(&mut self.writer)
                .await;
            match dropped {
                Ok(_) => return format!("slot {slot} dropped"),
                Err(_) => tokio::time::sleep(Duration::from_millis(2)).await,
            }
        }
        format!("slot {slot} could not be dropped within 3 s")
    }

    async fn edit_publication(&mut self) {
        let (sql, focus) = match self.writes.rng.below(3) {
            0 => (
                "ALTER PUBLICATION bloomgate SET (publish = 'insert')".to_string(),
                Focus::Update {
                    paths: self.warm(6, false).await,
                    emails: false,
                },
            ),
            1 => {
                let t = *self.writes.rng.pick(&Table::ALL);
                // `orders` dropped with it a third of the time (its own
                // draw), then written for as long.
                let orders = if self.writes.orders_rng.chance(35) {
                    self.writes.focus_orders(OrdersFocus::Writes, 8);
                    ", orders"
                } else {
                    ""
                };
                (
                    format!(
                        "ALTER PUBLICATION bloomgate DROP TABLE {}{orders}",
                        t.name()
                    ),
                    Focus::Table(t),
                )
            }
            _ => ("DROP PUBLICATION bloomgate".to_string(), Focus::Inserts),
        };
        self.sql(&sql).await;
        self.shared.note(format!("fault publication: {sql}"));
        let now = self.now();
        self.shared
            .model
            .lock()
            .unwrap()
            .window("publication", now, WATCHED);
        self.writes.focus(focus, 8);
    }

    async fn attach(&mut self) {
        let n = self.next_part;
        self.next_part += 1;
        let (create, fill, step) = self.writes.attach(n);
        self.sql(&create).await;
        self.sql(&fill).await;
        self.exec(step).await;
        self.shared.note(format!(
            "fault partition: events_p{n} attached with its rows"
        ));
        let now = self.now();
        self.shared
            .model
            .lock()
            .unwrap()
            .window("partition", now, WATCHED);
    }

    async fn detach(&mut self) {
        let (n, step) = self.writes.detach();
        self.exec(step).await;
        self.shared
            .note(format!("fault partition: events_p{n} detached"));
        let now = self.now();
        self.shared
            .model
            .lock()
            .unwrap()
            .window("partition", now, WATCHED);
        self.sql(&format!("DROP TABLE events_p{n}")).await;
    }

    pub(super) async fn act(&mut self, action: Action) {
        match action {
            Action::Promote => self.promote().await,
            Action::Restore => self.restore().await,
            Action::WalWriterBack => self.wal_writer_back(false).await,
            Action::PutBackCopy => self.put_back_copy().await,
            Action::RedisAccepts => self.redis_accepts().await,
            Action::Heal => self.heal().await,
            Action::RepairPublication => {
                let sql = format!(
                    "DO $$ BEGIN
                       IF NOT EXISTS (SELECT FROM pg_publication WHERE pubname = 'bloomgate') THEN
                         CREATE PUBLICATION bloomgate FOR TABLE {t} WITH (publish_via_partition_root = true);
                       END IF;
                     END $$;
                     ALTER PUBLICATION bloomgate SET TABLE {t};
                     ALTER PUBLICATION bloomgate SET (publish = 'insert, update, delete, truncate', publish_via_partition_root = true);",
                    t = schema::TABLES
                );
                self.sql(&sql).await;
                self.open_publication = false;
                self.shared.note("repair: publication as installed".into());
                let now = self.now();
                *self.shared.publication_excuse.lock().unwrap() = Some(now + WATCHED);
                self.shared
                    .model
                    .lock()
                    .unwrap()
                    .window("publication repaired", now, WATCHED);
            }
            Action::RepairIdentity => {
                self.sql("ALTER TABLE users REPLICA IDENTITY FULL").await;
                self.open_identity = false;
                self.shared
                    .note("repair: users REPLICA IDENTITY FULL".into());
                let now = self.now();
                *self.shared.identity_excuse.lock().unwrap() = Some(now + WATCHED);
                self.shared
                    .model
                    .lock()
                    .unwrap()
                    .window("replica identity repaired", now, WATCHED);
            }
            Action::StopOne => {
                let live = self.shared.live();
                if live.len() > 1 {
                    let g = live[self.writes.rng.below(live.len())].clone();
                    self.retire(&g);
                    self.shared.note(format!(
                        "second-gateway: gw{} stopped, the other serves on",
                        g.id
                    ));
                }
                self.open_second = false;
            }
            Action::RestartAll => {
                self.shared
                    .note("replica-pause: every gateway restarted while replay is paused".into());
                for g in self.shared.live() {
                    self.retire(&g);
                    self.spawn_gateway("restart while the replica is behind");
                }
            }
            Action::Resume => {
                if let Some(r) = self.paused.take() {
                    r.resume().await;
                    self.shared.note("replica-pause: replay resumed".into());
                }
            }
            Action::RedisKill(with) => self.redis_kill(with).await,
            Action::FailoverKill => self.failover_kill().await,
            Action::RedisPromoted => self.failover_promoted(false).await,
            Action::RedisBack(with) => {
                if self.now() < self.redis_back_at {
                    // Not down long enough yet: a few transactions more
                    // (the pause: at the end, nothing else runs).
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    self.later(1, 3, Action::RedisBack(with));
                    return;
                }
                let paths = self.warm(6, false).await;
                self.redis.as_mut().unwrap().restart(with).await;
                self.shared.note(format!(
                    "restart-redis: redis-server back on its port, {}",
                    with.name()
                ));
                let now = self.now();
                self.shared
                    .model
                    .lock()
                    .unwrap()
                    .window("restart-redis: back", now, FEED_GAP);
                self.writes.focus(
                    Focus::Update {
                        paths,
                        emails: false,
                    },
                    6,
                );
                self.open_redis = false;
            }
        }
    }
}

/// Replay paused on the last replica (its `postgres` database's pool):
/// resumed by [`Resume::resume`], or when dropped if a history ends in a
/// panic (over psql: the test's runtime may be gone).
pub(super) struct Resume {
    pool: Option<PgPool>,
    /// The replica's `postgres` database.
    url: String,
}

impl Resume {
    pub(super) async fn resume(mut self) {
        let pool = self.pool.take().unwrap();
        pool.execute("SELECT pg_wal_replay_resume()").await.unwrap();
    }
}

impl Drop for Resume {
    fn drop(&mut self) {
        if self.pool.is_some() {
            let _ = std::process::Command::new("psql")
                .args([&self.url, "-qAtc", "SELECT pg_wal_replay_resume()"])
                .status();
        }
    }
}
