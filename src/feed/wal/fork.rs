//! A failover the filters survive: when the permanent slot survived a
//! promotion (Patroni's permanent slots, PostgreSQL 17's failover slots,
//! `pg_failover_slots`), the feed proves what the new timeline kept of
//! what this process applied, and the resources keep their filters instead
//! of rebuilding them (see "A failover that keeps the filters" in
//! [`super`]).
//!
//! # What is proven here
//! Let `T` be the timeline the last stream followed, `A` the position this
//! process applied on it, `T'` the new server's timeline, `F` the position
//! where `T'` forked from `T` (its history file: `TIMELINE_HISTORY`, or
//! over SQL for the polled feed), and
//! `S` the slot's confirmed position on the new server. The new history is
//! `T` up to `F`, then `T'`. The feed's side of the proof ([`judge`]):
//! - the same database system (a restore elsewhere, another cluster: no);
//! - `T` is in `T'`'s history, so `F` exists;
//! - the slot was kept, not created, and `S <= min(A, F)`: the stream from
//!   `S` delivers every commit of the new history past `min(A, F)`, and
//!   everything up to `min(A, F)` was applied (a commit applied twice is
//!   harmless: an insert is idempotent, an invalidation too). A slot past
//!   `F` was consumed on the new timeline by someone else, or stands on
//!   WAL the new history lacks: a gap.
//!
//! Timelines are told apart by their ID: `T` found in `T'`'s history is
//! taken to be the `T` followed. That holds where every promotion of the
//! cluster picks an ID none of its servers used (a shared WAL archive,
//! Patroni's DCS, a managed service); two standbys promoted independently
//! can both start a timeline 2 with identical history files, which no
//! reading tells apart (the book's failover page says so).
//!
//! Then the feed's position becomes `min(A, F)` on `T'`, and the stream
//! from `S` goes on. The tail `(F, A]`, if any, was lost with `T`: the
//! resources' side of the proof (`resource::Resource::keep_across`) asks
//! what it left in each filter.

use crate::feed::{Fork, Lsn, Position, Server};

/// Where timeline `from` ended in the history file `history` of a later
/// timeline: the switch point of its line. `None` when `from` is not in
/// that history (a history of another branch), or the file does not parse
/// there. The file's lines are `parent_tli <tab> switch_point <tab>
/// reason`; comments start with `#`.
pub(super) fn fork_point(history: &str, from: u32) -> Option<Lsn> {
    history
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .find_map(|line| {
            let mut fields = line.split_whitespace();
            let tli: u32 = fields.next()?.parse().ok()?;
            let at = Lsn::parse(fields.next()?)?;
            (tli == from).then_some(at)
        })
}

/// What the session found when it opened, for [`judge`].
pub(super) struct Found<'a> {
    /// The server the last stream followed, and the new one.
    pub before: Server,
    pub now: Server,
    /// Where this process applied up to.
    pub applied: Option<Position>,
    /// The permanent slot's confirmed position, when it was kept rather
    /// than created.
    pub kept_slot: Option<Lsn>,
    /// The new timeline's history file, when it could be read.
    pub history: Option<&'a str>,
}

/// Whether the filters may be kept across the change from `before` to
/// `now` (the module doc's proof, the feed's side): the fork, and where
/// the feed stands on the new timeline; else why not, for the log.
pub(super) fn judge(f: &Found<'_>) -> Result<(Fork, Position), String> {
    let (t, t2) = (f.before.timeline, f.now.timeline);
    if t.system != t2.system || t2.system == 0 {
        return Err("not the same database system (or its identifier cannot be read)".into());
    }
    if t.id == t2.id {
        return Err("the same timeline (a restart, not a promotion)".into());
    }
    let Some(a) = f.applied.filter(|a| a.timeline == t) else {
        return Err("nothing applied on the timeline the feed followed".into());
    };
    let Some(s) = f.kept_slot else {
        return Err(
            "the replication slot did not survive (a temporary slot, or one created anew)".into(),
        );
    };
    let Some(history) = f.history else {
        return Err("the new timeline's history could not be read".into());
    };
    let Some(fork) = fork_point(history, t.id) else {
        return Err(format!(
            "timeline {} is not in the history of timeline {}",
            t.id, t2.id
        ));
    };
    let kept = a.lsn.min(fork);
    if s > kept {
        return Err(format!(
            "the slot stands at {s}, past {kept}, the last position both applied here and kept by the new timeline (forked at {fork})"
        ));
    }
    Ok((
        Fork {
            from: t,
            at: fork,
            to: t2,
        },
        Position::new(t2, kept),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::feed::Timeline;
    use proptest::prelude::*;

    const HISTORY: &str = "1\t0/3000060\tno recovery target specified\n\n\
                           2\t0/5000000\tno recovery target specified\n";

    fn server(system: u64, id: u32, started_us: i64) -> Server {
        Server {
            timeline: Timeline { system, id },
            started_us,
        }
    }

    #[test]
    fn the_fork_point_is_where_the_followed_timeline_ends() {
        assert_eq!(fork_point(HISTORY, 1), Lsn::parse("0/3000060"));
        assert_eq!(fork_point(HISTORY, 2), Lsn::parse("0/5000000"));
        // Timeline 3's own file does not name 3; nor a branch elsewhere.
        assert_eq!(fork_point(HISTORY, 3), None);
        assert_eq!(fork_point("# comment\n\n", 1), None);
        assert_eq!(fork_point("1 garbage reason\n", 1), None);
    }

    fn found(applied: u64, slot: Option<u64>, history: Option<&str>) -> Found<'_> {
        Found {
            before: server(7, 1, 10),
            now: server(7, 2, 20),
            applied: Some(Position::new(Timeline { system: 7, id: 1 }, Lsn(applied))),
            kept_slot: slot.map(Lsn),
            history,
        }
    }

    #[test]
    fn a_kept_slot_at_or_before_both_the_fork_and_the_applied_position_keeps() {
        let fork = 0x300_0060;
        // A <= F and A > F, slot at or before min(A, F).
        for (applied, slot, at) in [
            (0x200_0000, 0x100_0000, 0x200_0000),
            (0x200_0000, 0x200_0000, 0x200_0000),
            (0x400_0000, 0x300_0060, fork),
            (0x400_0000, 0x100_0000, fork),
        ] {
            let (f, pos) = judge(&found(applied, Some(slot), Some(HISTORY))).expect("kept");
            assert_eq!(f.at, Lsn(fork));
            assert_eq!(f.from.id, 1);
            assert_eq!(f.to.id, 2);
            assert_eq!(pos, Position::new(Timeline { system: 7, id: 2 }, Lsn(at)));
        }
    }

    #[test]
    fn every_missing_proof_falls_back() {
        // The slot past the fork, or past what was applied.
        assert!(judge(&found(0x400_0000, Some(0x300_0061), Some(HISTORY))).is_err());
        assert!(judge(&found(0x200_0000, Some(0x200_0001), Some(HISTORY))).is_err());
        // No slot kept, no history, a history without the old timeline.
        assert!(judge(&found(0x200_0000, None, Some(HISTORY))).is_err());
        assert!(judge(&found(0x200_0000, Some(0), None)).is_err());
        assert!(judge(&found(0x200_0000, Some(0), Some("5\t0/1\tx\n"))).is_err());
        // Another system, an unreadable one, the same timeline.
        let mut f = found(0x200_0000, Some(0), Some(HISTORY));
        f.now = server(8, 2, 20);
        assert!(judge(&f).is_err());
        f.before = server(0, 1, 10);
        f.now = server(0, 2, 20);
        assert!(judge(&f).is_err());
        f.before = server(7, 1, 10);
        f.now = server(7, 1, 20);
        assert!(judge(&f).is_err());
        // Nothing applied on the followed timeline.
        let mut f = found(0x200_0000, Some(0), Some(HISTORY));
        f.applied = Some(Position::new(Timeline { system: 7, id: 2 }, Lsn(5)));
        assert!(judge(&f).is_err());
        f.applied = None;
        assert!(judge(&f).is_err());
    }

    proptest! {
        /// Whatever the positions: kept only when the stream from the slot
        /// misses nothing of the new history past what it says it kept,
        /// and what it says it kept was applied and is in the new history.
        #[test]
        fn kept_only_when_the_stream_misses_nothing(
            applied in 0u64..1000, slot in 0u64..1000, fork in 0u64..1000,
        ) {
            let history = format!("1\t0/{fork:X}\tpromoted\n");
            match judge(&found(applied, Some(slot), Some(&history))) {
                Ok((f, pos)) => {
                    prop_assert_eq!(f.at, Lsn(fork));
                    prop_assert!(pos.lsn.0 <= applied && pos.lsn.0 <= fork);
                    prop_assert!(slot <= pos.lsn.0);
                }
                Err(_) => prop_assert!(slot > applied.min(fork)),
            }
        }
    }
}
