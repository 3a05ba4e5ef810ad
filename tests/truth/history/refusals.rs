//! Redis refusing the relay (see "Redis refusing the relay" in the crate
//! doc): writes refused for a while (`redis-refuses`), and a Sentinel split
//! brain that leaves the relay's node a primary no sentinel names
//! (`redis-split-brain`). Both leave Redis answering reads: nothing tells a
//! consumer that the stream it reads stopped growing, or grows elsewhere,
//! but the proofs it no longer gets.

use std::time::Duration;

use super::{Action, FEED_GAP, World};
use crate::ops::Focus;
use crate::redis::Refuse;

/// How long `redis-refuses` lasts at least: within a short `bus.max_lag`
/// (1 s), past it, and past the long one (5 s).
const REFUSE_FOR: [Duration; 3] = [
    Duration::from_secs(1),
    Duration::from_secs(3),
    Duration::from_secs(6),
];

/// How long a split brain waits for a steady site before it is not
/// injected (as `redis-failover` does).
const STEADY_WITHIN: Duration = Duration::from_secs(20);

impl World {
    /// `redis-refuses`: the history's Redis refuses writes, right after
    /// caching rows that are updated next; `Action::RedisAccepts` ends it.
    pub(super) async fn redis_refuses(&mut self) -> bool {
        if self.open_redis || self.redis.is_none() {
            return false;
        }
        let r = self.redis_rng.as_mut().expect("drawn from its stream");
        let how = if r.chance(50) {
            Refuse::Full
        } else {
            Refuse::NoReplicas
        };
        let down = *r.pick(&REFUSE_FOR);
        self.open_redis = true;
        let paths = self.warm(6, false).await;
        self.redis.as_ref().unwrap().refuse(how).await;
        let now = self.now();
        self.redis_back_at = now + down;
        self.shared
            .model
            .lock()
            .unwrap()
            .window("redis-refuses", now, FEED_GAP);
        self.shared.note(format!(
            "fault redis-refuses: writes refused, {}, at least {}s",
            how.name(),
            down.as_secs()
        ));
        self.later(2, 8, Action::RedisAccepts);
        self.writes.focus(
            Focus::Update {
                paths,
                emails: false,
            },
            6,
        );
        true
    }

    /// The end of `redis-refuses`, no sooner than it drew. No window
    /// opens: the relay held its slot across the refused appends, and the
    /// stream goes on where it stopped.
    pub(super) async fn redis_accepts(&mut self) {
        let now = self.now();
        if self.redis_back_at > now {
            tokio::time::sleep(self.redis_back_at - now).await;
        }
        self.redis.as_ref().unwrap().accept().await;
        self.open_redis = false;
        self.shared
            .note("redis-refuses over: writes taken again".into());
    }

    /// `redis-split-brain`: once the site is steady, the replica promoted
    /// by the sentinels' word alone while the primary, which none of them
    /// watches now, stays a primary (see `Site::split`); healed by
    /// `Action::Heal`.
    pub(super) async fn split_brain(&mut self) -> bool {
        if self.failover.is_some() || self.split || self.site.is_none() {
            return false;
        }
        let began = std::time::Instant::now();
        loop {
            let site = self.site.as_mut().unwrap();
            if let Some(said) = site.follow().await {
                self.shared.note(format!(
                    "redis-split-brain: the sentinels failed over on their own; the primary is now on port {} (sentinel: {said})",
                    site.primary.port
                ));
            }
            match self.site.as_ref().unwrap().steady().await {
                Ok(()) => break,
                Err(why) if began.elapsed() > STEADY_WITHIN => {
                    self.shared.note(format!(
                        "fault redis-split-brain: not injected, the site is not steady within 20 s: {why}"
                    ));
                    return false;
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
        let paths = self.warm(6, false).await;
        let site = self.site.as_ref().unwrap();
        let (old, new) = (site.primary.port, site.replica.port);
        site.split().await;
        self.split = true;
        let now = self.now();
        self.shared
            .model
            .lock()
            .unwrap()
            .window("redis-split-brain", now, FEED_GAP);
        self.shared.note(format!(
            "fault redis-split-brain: the sentinels name port {new}, a primary now; port {old} stays a primary no sentinel watches"
        ));
        // Half the time it lasts past the round's quiescence (no round
        // has 40 steps): the fleet must then be current on the node the
        // sentinels name, with the other still taking writes.
        if self.redis_rng.as_mut().unwrap().chance(50) {
            self.later(2, 8, Action::Heal);
        } else {
            self.later(40, 60, Action::Heal);
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

    /// The end of a split brain: the isolated node made the new primary's
    /// replica (what it took alone is lost: a consumer that read it meets
    /// a stream that went back).
    pub(super) async fn heal(&mut self) {
        if !self.split {
            return;
        }
        let paths = self.warm(6, false).await;
        let site = self.site.as_mut().unwrap();
        let old = site.primary.port;
        site.heal().await;
        self.split = false;
        let now = self.now();
        self.shared
            .model
            .lock()
            .unwrap()
            .window("redis-split-brain: healed", now, FEED_GAP);
        self.shared.note(format!(
            "redis-split-brain over: port {old} made the replica of port {}",
            self.site.as_ref().unwrap().primary.port
        ));
        self.writes.focus(
            Focus::Update {
                paths,
                emails: false,
            },
            6,
        );
    }
}
