//! Whether the bus's Redis takes the relay's writes, and keeps them: what
//! `preflight` asks beyond the read script.
//!
//! A Redis that answers reads but refuses writes (`bus.url` on a read-only
//! replica, an ACL user without `XADD`, `maxmemory` reached under
//! `noeviction` or a `volatile-*` policy with no volatile key) passes a
//! read, and then the relay cannot append a single entry. One that evicts
//! any key (`allkeys-*`) may drop the stream itself, and every consumer's
//! continuity with it (a rescan of every table on every gateway).
//!
//! # Guarantees (tested below and in `tests/it/feed/bus.rs`)
//! - [`RedisBus::try_append`] runs the relay's own append script, as the
//!   configured user, on the probe's scratch stream, then deletes it.
//! - [`Memory::problem`] refuses an `allkeys-*` policy, and names a Redis
//!   within 20 % of its `maxmemory`.

use std::time::Duration;

use super::super::{Bus, Entry};
use super::{BusError, RedisBus};
use crate::feed::Lsn;

/// `INFO memory`'s figures the bus depends on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Memory {
    /// `maxmemory` in bytes; 0: no limit.
    pub max: u64,
    pub used: u64,
    pub policy: String,
}

impl Memory {
    fn parse(info: &str) -> Option<Memory> {
        let field = |name: &str| {
            info.lines()
                .find_map(|l| l.trim().strip_prefix(name)?.strip_prefix(':'))
                .map(str::trim)
        };
        Some(Memory {
            max: field("maxmemory")?.parse().ok()?,
            used: field("used_memory")?.parse().ok()?,
            policy: field("maxmemory_policy")?.to_string(),
        })
    }

    /// Which of [`Memory::problem`]'s problems it has: `"policy"` or
    /// `"headroom"` (its text holds figures that change with each reading).
    pub fn problem_kind(&self) -> &'static str {
        match self.policy.starts_with("allkeys-") {
            true => "policy",
            false => "headroom",
        }
    }

    /// What keeps this Redis from holding the stream, if anything.
    pub fn problem(&self) -> Option<String> {
        if self.policy.starts_with("allkeys-") {
            return Some(format!(
                "maxmemory-policy is {}: Redis may evict the stream itself when full, and every gateway rescans every table; use noeviction (or volatile-lru with headroom) and size maxmemory for bus.retention",
                self.policy
            ));
        }
        if self.max > 0 && self.used.saturating_mul(5) >= self.max.saturating_mul(4) {
            return Some(format!(
                "used_memory is {} of maxmemory {} ({}): at maxmemory Redis refuses the relay's appends and the stream stops",
                self.used, self.max, self.policy
            ));
        }
        None
    }
}

impl RedisBus {
    /// The relay's append, once, on this handle's stream (the probe's
    /// scratch key), which is then deleted.
    pub async fn try_append(&mut self) -> Result<(), BusError> {
        self.append(&Entry::Heartbeat(Lsn(1))).await?;
        let mut conn = self.conn(Duration::ZERO).await?;
        let r: Result<i64, _> = redis::cmd("DEL")
            .arg(&self.stream)
            .query_async(&mut conn)
            .await;
        self.forget_on_error(r).map(|_| ())
    }

    /// `XTRIM` to the retention (see [`Bus::trim`]); allowed when Redis is
    /// out of memory, since it frees some.
    pub(super) async fn trim_stream(&mut self) -> Result<(), BusError> {
        let mut conn = self.conn(Duration::ZERO).await?;
        let r: Result<i64, _> = redis::cmd("XTRIM")
            .arg(&self.stream)
            .arg("MAXLEN")
            .arg("~")
            .arg(self.retention)
            .query_async(&mut conn)
            .await;
        self.forget_on_error(r).map(|_| ())
    }

    /// `INFO memory`'s figures.
    pub async fn memory(&mut self) -> Result<Memory, BusError> {
        let mut conn = self.conn(Duration::ZERO).await?;
        let r: Result<String, _> = redis::cmd("INFO")
            .arg("memory")
            .query_async(&mut conn)
            .await;
        let info = self.forget_on_error(r)?;
        Memory::parse(&info)
            .ok_or_else(|| BusError("Redis: INFO memory lacks maxmemory or its policy".into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn memory(max: u64, used: u64, policy: &str) -> Memory {
        Memory {
            max,
            used,
            policy: policy.into(),
        }
    }

    #[test]
    fn info_memory_is_read() {
        let info = "# Memory\r\nused_memory:1048576\r\nused_memory_human:1.00M\r\nmaxmemory:0\r\nmaxmemory_human:0B\r\nmaxmemory_policy:noeviction\r\n";
        assert_eq!(
            Memory::parse(info),
            Some(memory(0, 1_048_576, "noeviction"))
        );
        assert_eq!(Memory::parse("# Memory\r\nused_memory:1\r\n"), None);
    }

    #[test]
    fn an_evicting_policy_and_a_full_redis_are_problems() {
        assert!(memory(0, 5, "noeviction").problem().is_none());
        assert!(memory(100, 79, "volatile-lru").problem().is_none());
        for p in ["allkeys-lru", "allkeys-lfu", "allkeys-random"] {
            assert!(memory(0, 5, p).problem().unwrap().contains(p));
        }
        assert!(
            memory(100, 80, "noeviction")
                .problem()
                .unwrap()
                .contains("refuses")
        );
    }
}
