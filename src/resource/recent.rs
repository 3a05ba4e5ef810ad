//! The keys recent commits inserted into a resource's filter, with each
//! commit's LSN: what lets a snapshot a little behind a rebuild's window
//! be used (see `fleet`, and "When a snapshot may be used" in `snapshot`).
//!
//! A snapshot at `R` behind the window's mark `W` lacks the keys of the
//! commits this gateway applied in `(R, W]` before its window opened (the
//! journal has only those after). So the resource keeps the keys the last
//! [`RECENT_KEYS`] inserts of positioned commits put in the filter, with
//! each commit's LSN, and remembers the highest LSN it let go of. When
//! that is at or below `R`'s, every key applied before the window from a
//! commit past `R` is still kept: the snapshot plus those keys is complete
//! at `W`, and is used. This is what lets a gateway that opened its window
//! a moment after the fleet's scanner labelled its snapshot (it read one
//! more heartbeat) load instead of scanning, and lets rebuilds that only
//! restore precision (the schedule, the decay limits) load a snapshot a
//! little older than their window.
//!
//! On the bus, a commit's LSN and the entries agree: the commits of the
//! entries up to `R` end at or below `R`'s LSN, and every commit applied
//! from a later entry ends past it (a relay's batch that repeats commits
//! at or below the entry before it has them skipped by the consumer). A
//! key kept from another epoch (a position on another timeline, or an
//! older start of the primary) is at worst an extra key, which a filter
//! may hold; and a key let go of from one makes the rule refuse, never
//! accept wrongly. A gap (a resync: changes missed, which no kept key
//! names) makes every place unusable until a rebuild that began after it
//! has swapped in; from then on, places at or past where that rebuild's
//! set was complete. Memory: at most [`RECENT_KEYS`] keys per resource
//! (about 3 MiB of `bigint` keys, more for long text keys), and nothing
//! without `bus.fleet_key_file`.

use std::collections::VecDeque;

use crate::key::Key;

/// Inserts a resource keeps (see the module doc): at 5,000 inserts a
/// second, the last 13 seconds.
pub const RECENT_KEYS: usize = 65_536;

/// The keys recent commits inserted (see the module doc).
pub(super) struct Recent {
    keys: VecDeque<(u64, Key)>,
    /// The highest LSN of a key let go of (0: none).
    dropped: u64,
    /// The filter is known complete at this LSN, by a rebuild that left
    /// no gap open; `u64::MAX` while a gap is open, or before the first
    /// build: changes may have been missed that no kept key names.
    floor: u64,
    /// Where the running rebuild's set is complete (its window's mark, or
    /// the snapshot's place it joined at): the floor once it covers every
    /// gap.
    pub(super) pending: Option<u64>,
}

impl Default for Recent {
    fn default() -> Self {
        Self {
            keys: VecDeque::new(),
            dropped: 0,
            floor: u64::MAX,
            pending: None,
        }
    }
}

impl Recent {
    /// A gap: what was missed is in no kept key.
    pub(super) fn poison(&mut self) {
        self.floor = u64::MAX;
        self.pending = None;
    }

    /// The running rebuild covered every gap opened: its set is complete
    /// where it said.
    pub(super) fn settle(&mut self, covered: bool) {
        match self.pending.take() {
            Some(at) if covered => self.floor = at,
            _ => {}
        }
    }

    pub(super) fn push(&mut self, lsn: u64, key: &Key) {
        if self.keys.len() >= RECENT_KEYS
            && let Some((old, _)) = self.keys.pop_front()
        {
            self.dropped = self.dropped.max(old);
        }
        self.keys.push_back((lsn, key.clone()));
    }

    /// Whether every key applied past `lsn` is kept: none past it was let
    /// go of, and no change past it may have been missed.
    pub(super) fn covers(&self, lsn: u64) -> bool {
        self.dropped <= lsn && self.floor <= lsn
    }

    /// Every key kept past `lsn`, if [`Recent::covers`] it.
    pub(super) fn after(&self, lsn: u64) -> Option<Vec<Key>> {
        self.covers(lsn).then(|| {
            self.keys
                .iter()
                .filter(|(at, _)| *at > lsn)
                .map(|(_, k)| k.clone())
                .collect()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recent_keys_past_a_place_are_given_while_none_past_it_was_let_go() {
        let mut r = settled();
        for i in 1..=10u64 {
            r.push(i * 10, &Key::Int(i as i64));
        }
        assert_eq!(r.after(100), Some(vec![]));
        assert_eq!(
            r.after(75),
            Some(vec![Key::Int(8), Key::Int(9), Key::Int(10)])
        );
        assert_eq!(r.after(0).map(|k| k.len()), Some(10));
        for i in 0..RECENT_KEYS as u64 {
            r.push(1000 + i, &Key::Int(0));
        }
        // The first ten let go of: the last at 100.
        assert!(r.after(99).is_none());
        assert_eq!(r.after(100).map(|k| k.len()), Some(RECENT_KEYS));
        let last = 1000 + RECENT_KEYS as u64 - 1;
        assert_eq!(r.after(last).map(|k| k.len()), Some(0));
        assert_eq!(r.after(last - 1).map(|k| k.len()), Some(1));
    }

    fn settled() -> Recent {
        let mut r = Recent {
            pending: Some(0),
            ..Recent::default()
        };
        r.settle(true);
        r
    }

    #[test]
    fn a_gap_refuses_every_place_until_a_rebuild_covers_it() {
        let mut r = Recent::default();
        r.push(10, &Key::Int(1));
        assert_eq!(r.after(5), None, "before the first build");
        assert!(!r.covers(5));
        let mut r = settled();
        r.push(10, &Key::Int(1));
        assert!(r.after(5).is_some());
        r.poison();
        assert_eq!(r.after(5), None);
        assert_eq!(r.after(500), None);
        // A rebuild complete at 300 that a later gap interrupted: still none.
        r.pending = Some(300);
        r.poison();
        r.settle(true);
        assert_eq!(r.after(500), None);
        // One that covered it: places from 300 on.
        r.pending = Some(300);
        r.settle(true);
        assert_eq!(r.after(299), None);
        assert!(r.after(300).is_some());
        // One that did not cover every gap leaves it so.
        r.poison();
        r.pending = Some(400);
        r.settle(false);
        assert_eq!(r.after(450), None);
    }

    #[test]
    fn a_key_let_go_of_from_another_epoch_refuses_never_accepts() {
        let mut r = settled();
        // An older epoch reached far higher LSNs.
        for i in 0..RECENT_KEYS as u64 {
            r.push(1_000_000 + i, &Key::Int(1));
        }
        r.push(50, &Key::Int(2));
        assert!(
            r.after(40).is_none(),
            "a key of the old epoch past 40 was let go of"
        );
    }
}
