//! The WAL feed's replication slot: temporary (one per session, gone with
//! its connection) or the permanent `database.slot`, opened so that a new
//! stream never starts past what this process applied without saying so
//! (see "No gap, in LSNs" in [`super`]).

use std::sync::atomic::Ordering;

use sqlx::PgConnection;

use super::{Feed, SessionError};
use crate::db::publication;
use crate::feed::replication::ReplError;
use crate::feed::{Lsn, Position, Timeline};

/// Opens the permanent slot `name`: creates it if it does not exist, creates
/// it again if it is lost (invalidated by `max_slot_wal_keep_size`) or stuck
/// behind a dropped publication; returns where its stream starts and whether
/// that is a gap (its confirmed position past this process's, or on another
/// timeline than `timeline`, the server's). Err(Wait) while another backend
/// holds it.
pub(super) async fn open_permanent(
    feed: &mut Feed,
    conn: &mut PgConnection,
    name: &str,
    timeline: Timeline,
) -> Result<(Lsn, bool), SessionError> {
    let had = feed.position;
    let state = publication::slot(conn, name).await?;
    if let Some(s) = &state
        && let Some(pid) = s.active_pid
    {
        return Err(held_by(name, pid));
    }
    let recreate = match &state {
        None => None,
        Some(s) if s.lost => {
            feed.stats
                .slot_invalidations
                .fetch_add(1, Ordering::Relaxed);
            Some("it was invalidated (max_slot_wal_keep_size)")
        }
        Some(_) if feed.opts.broken_slot.load(Ordering::Relaxed) => {
            Some("decoding it failed on a publication that did not exist")
        }
        Some(_) => None,
    };
    if let Some(why) = recreate {
        tracing::warn!(slot = %name, why, "recreating the replication slot; every filter is rebuilt");
        sqlx::query("SELECT pg_drop_replication_slot($1)")
            .bind(name)
            .execute(&mut *conn)
            .await?;
        feed.opts.broken_slot.store(false, Ordering::Relaxed);
    }
    match (&state, recreate) {
        (Some(s), None) => {
            let at = s.confirmed_flush.unwrap_or(Lsn::ZERO);
            // Confirmed past what this process applied (someone else read
            // it), or a position of another history: a gap.
            Ok((
                at,
                had.is_some_and(|p| !p.reaches(&Position::new(timeline, at))),
            ))
        }
        _ => {
            // A new slot has nothing to be broken by.
            feed.opts.broken_slot.store(false, Ordering::Relaxed);
            let at = create(conn, name, false).await?;
            Ok((at, had.is_some()))
        }
    }
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
