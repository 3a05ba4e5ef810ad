//! The WAL feed's replication slot: temporary (one per session, gone with
//! its connection) or the permanent `database.slot`, opened so that a new
//! stream never starts past what this process applied without saying so
//! (see "No gap, in LSNs" in [`super`]).

use std::sync::Mutex;
use std::sync::atomic::Ordering;

use sqlx::PgConnection;

use super::{Feed, SessionError};
use crate::db::publication::{self, SlotState};
use crate::feed::wal::replication::ReplError;
use crate::feed::{Lsn, Position, Timeline};

/// Opens the permanent slot `name`: creates it if it does not exist, creates
/// it again if it is lost (invalidated by `max_slot_wal_keep_size`) or stuck
/// behind a dropped publication; returns where its stream starts and whether
/// that is a gap ([`plan`] decides both). Err(Wait) while another backend
/// holds it.
pub(super) async fn open_permanent(
    feed: &mut Feed,
    conn: &mut PgConnection,
    name: &str,
    timeline: Timeline,
) -> Result<(Lsn, bool), SessionError> {
    let state = publication::slot(conn, name).await?;
    if let Some(s) = &state
        && let Some(pid) = s.active_pid
    {
        return Err(held_by(name, pid));
    }
    match plan(
        feed.position,
        state.as_ref(),
        &feed.opts.broken_slot,
        timeline,
    ) {
        Open::Keep { at, gap } => {
            // A mark it does not match is spent (the next failure marks
            // anew), so that no later slot on another history (a restore,
            // another cluster behind the address) is taken for the one
            // that failed.
            feed.opts.broken_slot.clear();
            feed.slot_seen = Some(Position::new(timeline, at));
            // Only a position the slot states proves where its stream
            // starts (see `fork`).
            feed.kept_slot = state.as_ref().and_then(|s| s.confirmed_flush);
            Ok((at, gap))
        }
        Open::Create { again, gap } => {
            if let Some(why) = again {
                if why == Again::Invalidated {
                    feed.stats
                        .slot_invalidations
                        .fetch_add(1, Ordering::Relaxed);
                }
                tracing::warn!(slot = %name, why = why.text(), "recreating the replication slot; every filter is rebuilt");
                sqlx::query("SELECT pg_drop_replication_slot($1)")
                    .bind(name)
                    .execute(&mut *conn)
                    .await?;
            }
            // A new slot has nothing to be broken by. Cleared only once the
            // broken one is dropped: a failed drop is tried again.
            feed.opts.broken_slot.clear();
            let at = create(conn, name, false).await?;
            feed.slot_seen = Some(Position::new(timeline, at));
            Ok((at, gap))
        }
    }
}

/// What opening the permanent slot does with what it found ([`plan`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Open {
    /// The slot is kept: its stream starts at `at`.
    Keep { at: Lsn, gap: bool },
    /// A slot is created (`again`: after dropping the one found, and why).
    Create { again: Option<Again>, gap: bool },
}

/// Why a slot found is dropped and created again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Again {
    Invalidated,
    Broken,
}

impl Again {
    fn text(self) -> &'static str {
        match self {
            Again::Invalidated => "it was invalidated (max_slot_wal_keep_size)",
            Again::Broken => "decoding it failed on a publication that did not exist",
        }
    }
}

/// The permanent slot's fate, from this process's position `had`, the slot
/// found (`state`, not held by anyone), the broken-slot mark and the
/// server's `timeline`. Guarantee: the stream never starts past what this
/// process applied without `gap` saying so:
/// - a slot created (none found, or one dropped) starts at the WAL's end:
///   a gap whenever this process had applied anything;
/// - a slot kept starts at its confirmed position: a gap when that does
///   not lie within this process's history up to its position (confirmed
///   past it, by another reader, or on another timeline than the one this
///   process applied on, as no LSN is compared across histories).
///
/// A lost slot is created again whatever the mark says; a slot the mark
/// names ([`BrokenSlot::is`]) too; any other is kept.
fn plan(
    had: Option<Position>,
    state: Option<&SlotState>,
    broken: &BrokenSlot,
    timeline: Timeline,
) -> Open {
    let Some(s) = state else {
        return Open::Create {
            again: None,
            gap: had.is_some(),
        };
    };
    let again = if s.lost {
        Some(Again::Invalidated)
    } else if broken.is(timeline, s.confirmed_flush) {
        Some(Again::Broken)
    } else {
        None
    };
    match again {
        Some(_) => Open::Create {
            again,
            gap: had.is_some(),
        },
        None => {
            let at = s.confirmed_flush.unwrap_or(Lsn::ZERO);
            Open::Keep {
                at,
                gap: had.is_some_and(|p| !p.reaches(&Position::new(timeline, at))),
            }
        }
    }
}

/// Where a permanent slot stood when decoding it failed on a publication
/// that did not exist (dropped, then created again past the slot's
/// position: decoding reads the catalog as of each change, so the slot
/// fails at the same change every time it is opened). Shared by every feed
/// made from clones of the same options: the relay runs one feed per term,
/// and its next term must know what the last one found.
///
/// Guarantee: the slot that failed is recreated at its next open here,
/// and a slot created anew since (by another gateway that found the same
/// failure) is not. The broken slot cannot be confirmed past the change it
/// fails at, so it stands at or before the mark, the furthest this feed
/// knew it (its confirmed position at this session's open) or its own
/// position to be (which may be one the bus handed it: at most the end of
/// this server's WAL at the failure either way); a slot created since
/// starts where the WAL was at its creation, past that change, so past the
/// mark. The mark is a position: it holds only on its own timeline (a
/// slot on another history, after a promotion or a restore, is never
/// compared with it, as no LSN is compared across histories), and it is
/// spent at the next open whatever it finds (a slot kept clears it too, so
/// a mark never outlives the history it was made on), unless that open
/// fails before the slot it names is dropped: the next open tries again.
/// Where another feed advanced the broken slot beyond the mark (a
/// keepalive's position), or the broken slot stands on another timeline
/// (a PostgreSQL 17 failover slot synchronised to a promoted standby), it
/// is kept once more, fails once more with a mark that covers it, and is
/// recreated then: one failure more, never a healthy slot dropped for it.
/// Either way a slot created anew is a gap, answered by a resync.
#[derive(Debug, Default)]
pub struct BrokenSlot(
    /// The mark; `None` while no failure is known. Read and written only
    /// when a session opens or fails, never per change.
    Mutex<Option<Position>>,
);

impl BrokenSlot {
    /// Decoding failed with the slot and stream known up to `at`.
    pub(super) fn mark(&self, at: Position) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(at);
    }

    pub(super) fn clear(&self) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }

    /// Whether the slot on `timeline` (the server's), confirmed up to
    /// `confirmed`, is the one that failed: the mark's timeline, at or
    /// before it. A slot that does not say how far it is confirmed counts
    /// as it on that timeline.
    pub(super) fn is(&self, timeline: Timeline, confirmed: Option<Lsn>) -> bool {
        let mark = *self.0.lock().unwrap_or_else(|e| e.into_inner());
        mark.is_some_and(|m| m.reaches(&Position::new(timeline, confirmed.unwrap_or(Lsn::ZERO))))
    }
}

/// What a failed session marks: the furthest it knew the slot to be, its
/// confirmed position at the open (`seen`) or the stream's own position
/// when that is further on the same timeline. A stream position of another
/// history (one handed over from before a promotion) says nothing of this
/// slot.
pub(super) fn broken_at(seen: Option<Position>, streamed: Option<Position>) -> Position {
    match (seen, streamed) {
        (Some(s), Some(p)) if p.timeline == s.timeline && p.lsn > s.lsn => p,
        (Some(s), _) => s,
        (None, p) => p.unwrap_or(Position::ZERO),
    }
}

/// What a slot's creation is waiting for, oldest first (at most three):
/// a logical slot's consistent point comes only once every transaction
/// holding an xid when it began has ended, so a prepared transaction
/// nobody commits, or a long one, holds the feed's start for as long
/// (`None`: no such transaction now). Safe to show: ids, names, ages.
pub(super) async fn blockers(conn: &mut PgConnection) -> Result<Option<String>, sqlx::Error> {
    let found: Vec<String> = sqlx::query_scalar(
        "SELECT who FROM (
           SELECT format('prepared transaction %L (%s s)', gid,
                         extract(epoch FROM now() - prepared)::int8) AS who,
                  prepared AS since
             FROM pg_prepared_xacts
           UNION ALL
           SELECT format('the transaction of pid %s (%s, open %s s)', pid,
                         coalesce(nullif(application_name, ''), usename::text, '?'),
                         extract(epoch FROM now() - xact_start)::int8),
                  xact_start
             FROM pg_stat_activity
            WHERE backend_xid IS NOT NULL AND pid <> pg_backend_pid()
              AND backend_type = 'client backend'
         ) b ORDER BY since LIMIT 3",
    )
    .fetch_all(conn)
    .await?;
    Ok((!found.is_empty()).then(|| found.join(", ")))
}

/// Creates a logical slot with SQL (`temporary`: dropped when `conn`
/// ends); returns its consistent point.
pub(super) async fn create(
    conn: &mut PgConnection,
    name: &str,
    temporary: bool,
) -> Result<Lsn, sqlx::Error> {
    let at: String = sqlx::query_scalar(
        "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput', $2)",
    )
    .bind(name)
    .bind(temporary)
    .fetch_one(conn)
    .await?;
    Ok(Lsn::parse(&at).unwrap_or(Lsn::ZERO))
}

/// The first key of the polled feed's advisory lock on a permanent slot's
/// name (the second is the name's hash): "bgsl".
const SLOT_LOCK_CLASS: i32 = 0x6267_736c;

/// Polling holds a slot only during each poll: a second gateway polling it
/// in between would consume what this one has not. A session lock on the
/// slot's name, held by `conn` (the polling connection), keeps it ours;
/// Err(Wait) naming the holder when another connection has it.
pub(super) async fn lock_for_polling(
    conn: &mut PgConnection,
    name: &str,
) -> Result<(), SessionError> {
    let mine: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1, hashtext($2))")
        .bind(SLOT_LOCK_CLASS)
        .bind(name)
        .fetch_one(&mut *conn)
        .await?;
    if mine {
        return Ok(());
    }
    let pid: Option<i32> = sqlx::query_scalar(
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND classid = $1::oid
            AND objid = hashtext($2)::oid AND granted LIMIT 1",
    )
    .bind(SLOT_LOCK_CLASS)
    .bind(name)
    .fetch_optional(&mut *conn)
    .await?
    .flatten();
    Err(held_by(name, pid.unwrap_or(0)))
}

pub(super) fn held_by(slot: &str, pid: i32) -> SessionError {
    SessionError::Wait(format!(
        "replication slot {slot} is active for PID {pid} (another gateway with the same database.slot?): waiting for it"
    ))
}

/// A server error that says the slot is in use (SQLSTATE 55006, object in
/// use): another backend took it between the check and the start.
pub(super) fn in_use(e: SessionError, slot: &str) -> SessionError {
    match e {
        SessionError::Repl(ReplError::Server { code, message }) if code == "55006" => {
            SessionError::Wait(format!("replication slot {slot}: {message}"))
        }
        SessionError::Sql(sqlx::Error::Database(d)) if d.code().as_deref() == Some("55006") => {
            SessionError::Wait(format!("replication slot {slot}: {}", d.message()))
        }
        e => e,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TL1: Timeline = Timeline { system: 7, id: 1 };
    const TL2: Timeline = Timeline { system: 7, id: 2 };

    fn at(lsn: u64) -> Position {
        Position::new(TL1, Lsn(lsn))
    }

    #[test]
    fn no_failure_known_recreates_nothing() {
        let b = BrokenSlot::default();
        assert!(!b.is(TL1, Some(Lsn(0x100))));
        assert!(!b.is(TL1, None));
    }

    #[test]
    fn the_slot_that_failed_is_recreated_and_a_slot_created_since_is_not() {
        let b = BrokenSlot::default();
        b.mark(at(0x500));
        // The broken slot, where it was or behind the stream's furthest.
        assert!(b.is(TL1, Some(Lsn(0x500))));
        assert!(b.is(TL1, Some(Lsn(0x480))));
        assert!(b.is(TL1, None));
        // Another gateway's slot, created past the failing change.
        assert!(!b.is(TL1, Some(Lsn(0x501))));
        // A failure seen further on covers it.
        b.mark(at(0x600));
        assert!(b.is(TL1, Some(Lsn(0x501))));
        b.clear();
        assert!(!b.is(TL1, Some(Lsn(0x480))));
    }

    #[test]
    fn a_mark_says_nothing_of_a_slot_on_another_history() {
        let b = BrokenSlot::default();
        b.mark(at(0x500));
        // Behind the mark in LSN, but on the promoted timeline or another
        // cluster: not comparable, so kept.
        assert!(!b.is(TL2, Some(Lsn(0x100))));
        assert!(!b.is(TL2, None));
        assert!(!b.is(Timeline { system: 8, id: 1 }, Some(Lsn(0x100))));
        // Nor a mark made where the timeline was not known.
        b.mark(Position::new(Timeline::UNKNOWN, Lsn(0x500)));
        assert!(!b.is(Timeline::UNKNOWN, Some(Lsn(0x100))));
    }

    #[test]
    fn a_failed_session_marks_the_furthest_it_knew_on_the_slots_timeline() {
        let seen = Some(at(0x500));
        assert_eq!(broken_at(seen, Some(at(0x600))), at(0x600));
        assert_eq!(broken_at(seen, Some(at(0x400))), at(0x500));
        assert_eq!(broken_at(seen, None), at(0x500));
        // A stream position of another history is not compared.
        let other = Position::new(TL2, Lsn(0x900));
        assert_eq!(broken_at(seen, Some(other)), at(0x500));
        assert_eq!(broken_at(None, Some(other)), other);
        assert_eq!(broken_at(None, None), Position::ZERO);
    }

    fn slot(confirmed: Option<u64>, lost: bool) -> SlotState {
        SlotState {
            active_pid: None,
            lost,
            confirmed_flush: confirmed.map(Lsn),
        }
    }

    #[test]
    fn a_slot_created_is_a_gap_whenever_the_process_had_applied_anything() {
        let none = BrokenSlot::default();
        let create = |again, gap| Open::Create { again, gap };
        assert_eq!(plan(None, None, &none, TL1), create(None, false));
        assert_eq!(plan(Some(at(0x500)), None, &none, TL1), create(None, true));
        // Invalidated: created again, mark or no mark, position or none.
        let lost = slot(Some(0x400), true);
        let inv = Some(Again::Invalidated);
        assert_eq!(plan(None, Some(&lost), &none, TL1), create(inv, false));
        assert_eq!(
            plan(Some(at(0x500)), Some(&lost), &none, TL1),
            create(inv, true)
        );
        let marked = BrokenSlot::default();
        marked.mark(at(0x500));
        assert_eq!(
            plan(Some(at(0x500)), Some(&lost), &marked, TL1),
            create(inv, true)
        );
        // The broken slot: created again, a gap for a process that had applied.
        let broken = slot(Some(0x480), false);
        let brk = Some(Again::Broken);
        assert_eq!(
            plan(Some(at(0x480)), Some(&broken), &marked, TL1),
            create(brk, true)
        );
        assert_eq!(plan(None, Some(&broken), &marked, TL1), create(brk, false));
    }

    #[test]
    fn a_slot_kept_is_a_gap_unless_it_lies_within_what_the_process_applied() {
        let none = BrokenSlot::default();
        let keep = |lsn, gap| Open::Keep { at: Lsn(lsn), gap };
        let s = slot(Some(0x400), false);
        // Behind or at this process's position on its timeline: no gap.
        assert_eq!(
            plan(Some(at(0x500)), Some(&s), &none, TL1),
            keep(0x400, false)
        );
        assert_eq!(
            plan(Some(at(0x400)), Some(&s), &none, TL1),
            keep(0x400, false)
        );
        // Confirmed past it (another reader consumed what it lacks): a gap.
        assert_eq!(
            plan(Some(at(0x3ff)), Some(&s), &none, TL1),
            keep(0x400, true)
        );
        // On another history than the one applied on: a gap, however the
        // LSNs compare.
        assert_eq!(
            plan(Some(at(0x900)), Some(&s), &none, TL2),
            keep(0x400, true)
        );
        let unknown = Position::new(Timeline::UNKNOWN, Lsn(0x900));
        assert_eq!(plan(Some(unknown), Some(&s), &none, TL1), keep(0x400, true));
        // Nothing applied yet: nothing to miss.
        assert_eq!(plan(None, Some(&s), &none, TL1), keep(0x400, false));
        // A slot that says nothing of its position starts at zero.
        let blank = slot(None, false);
        assert_eq!(
            plan(Some(at(0x500)), Some(&blank), &none, TL1),
            keep(0, false)
        );
        // A mark of another slot (created since, past it) or of another
        // history keeps it.
        let marked = BrokenSlot::default();
        marked.mark(at(0x3ff));
        assert_eq!(
            plan(Some(at(0x500)), Some(&s), &marked, TL1),
            keep(0x400, false)
        );
        assert_eq!(
            plan(Some(at(0x500)), Some(&s), &marked, TL2),
            keep(0x400, true)
        );
    }

    #[test]
    fn a_failure_at_the_zero_lsn_still_marks() {
        let b = BrokenSlot::default();
        b.mark(at(0));
        assert!(b.is(TL1, Some(Lsn::ZERO)));
    }
}
