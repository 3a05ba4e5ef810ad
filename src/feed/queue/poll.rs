//! One poll: a single statement reads the server's current snapshot, the
//! pruning mark and the change rows of every transaction that snapshot shows
//! as committed and the previous one did not (why that delivers each
//! change exactly once is in the module doc), and sends their events.

use std::sync::atomic::Ordering;

use futures_util::TryStreamExt;
use sqlx::{PgPool, Row};
use tokio::sync::mpsc;

use super::position::{Position, xmin};
use super::statement::{Failure, timed};
use crate::db::position::Server;
use crate::feed::notify::{self, Stats};
use crate::feed::tracker::Shapes;
use crate::feed::{Event, Watch};
use crate::telemetry::LogThrottle;

/// One poll: the statement's snapshot, the backend (see `BACKEND` in
/// `position`: a new one means a new connection), the pruning mark, the
/// watched tables' shapes (`$2`, `$3`: see "Shapes" in `feed::tracker`), and
/// the payloads of the transactions the snapshot shows as committed that
/// `$1` did not (see the module doc). One row with a NULL payload when
/// there are none.
fn poll_sql() -> String {
    format!(
        "SELECT s.cur::text, s.backend, s.pruned::text, c.payload, s.shapes
  FROM (SELECT pg_current_snapshot() AS cur,
               pg_backend_pid()::text || '@' || pg_postmaster_start_time()::text AS backend,
               (SELECT below FROM public.bloomgate_changes_pruned LIMIT 1) AS pruned,
               {} AS shapes) s
  LEFT JOIN public.bloomgate_changes c
    ON c.xid >= pg_snapshot_xmax($1::pg_snapshot)
    OR c.xid = ANY(ARRAY(SELECT pg_snapshot_xip($1::pg_snapshot)))
 ORDER BY c.xid",
        Shapes::sql(2, 3)
    )
}

pub(super) enum Polled {
    /// The new snapshot, the backend that took it, and the watched tables'
    /// shapes read with it.
    At(String, String, Option<Vec<Option<String>>>),
    /// Nobody receives events any more.
    Stopped,
    /// Rows the previous snapshot had not shown may have been deleted.
    Pruned,
    /// A new connection reached another server history (failover,
    /// restore): the position means nothing there.
    Elsewhere,
}

/// Reads one poll's changes and sends them.
pub(super) async fn poll(
    pool: &PgPool,
    at: &Position,
    watch: &Watch,
    tx: &mpsc::Sender<Event>,
    counters: &Stats,
    ignored: &LogThrottle,
    shapes: &Shapes,
) -> Result<Polled, Failure> {
    let mut conn = timed(pool.acquire()).await?;
    let sql = poll_sql();
    let mut rows = sqlx::query(&sql)
        .bind(&at.snapshot)
        .bind(shapes.names())
        .bind(shapes.columns())
        .fetch(&mut *conn);
    let mut cur = None;
    let mut tables = None;
    // The deadline is for the server's answers; the applier's pace is the
    // applier's business (`send` waits for room in the channel).
    while let Some(row) = timed(rows.try_next()).await? {
        if cur.is_none() {
            cur = Some((row.try_get::<String, _>(0)?, row.try_get::<String, _>(1)?));
            tables = Some(row.try_get::<Vec<Option<String>>, _>(4)?);
            // Rows of transactions below the mark may be gone; those the
            // previous snapshot did not show are all at or above its xmin.
            let pruned: Option<String> = row.try_get(2)?;
            let mark = pruned.as_deref().and_then(|p| p.parse::<u64>().ok());
            let from = xmin(&at.snapshot).and_then(|x| x.parse::<u64>().ok());
            if let (Some(mark), Some(from)) = (mark, from)
                && mark > from
            {
                return Ok(Polled::Pruned);
            }
        }
        let Some(payload) = row.try_get::<Option<String>, _>(3)? else {
            continue;
        };
        counters.notifications.fetch_add(1, Ordering::Relaxed);
        let event = match notify::parse(watch, &payload, counters) {
            Ok(Some(e)) => e,
            Ok(None) => continue,
            Err(why) => {
                if let Some(not_logged) = ignored.permit() {
                    tracing::warn!(problem = %why, not_logged, "ignoring a change row");
                }
                continue;
            }
        };
        if tx.send(event).await.is_err() {
            return Ok(Polled::Stopped);
        }
    }
    drop(rows);
    let (snapshot, backend) = cur.ok_or(sqlx::Error::RowNotFound)?;
    if backend != at.backend {
        // A new connection: is it still the same server history? Asked on
        // this connection: another in the pool (the pruner's) may still be
        // on the old server while this one reached a new one.
        let (server, _) = timed(Server::read(&mut *conn)).await?;
        if server.change_from(&at.server).is_some() {
            return Ok(Polled::Elsewhere);
        }
    }
    Ok(Polled::At(snapshot, backend, tables))
}
