//! Where the feed stands: the snapshot of its last successful poll, the
//! backend and server history it was taken on (snapshots compare only
//! within one history), and how a position is first taken, after checking
//! that the server is a primary with a change table nobody else may write.

use std::time::{Duration, Instant};

use sqlx::PgPool;
use tokio::sync::mpsc;

use super::QueueError;
use super::statement::{Failure, timed};
use crate::db::position::Server;
use crate::db::triggers::QUEUE_TABLE_CHECK;
use crate::feed::{Event, Resync};

/// Which backend a statement ran on: its pid and its server's start time
/// (a pid alone could repeat on another server after a failover).
const BACKEND: &str = "pg_backend_pid()::text || '@' || pg_postmaster_start_time()::text";

/// Where the feed stands: the snapshot of its last successful poll.
pub(super) struct Position {
    pub(super) snapshot: String,
    /// When that snapshot was taken (no later than this).
    pub(super) taken: Instant,
    /// The backend that took it.
    pub(super) backend: String,
    /// The server it was taken on (`db::position::Server`: its history and
    /// start time).
    pub(super) server: Server,
}

/// A new starting position, then a rescan of every watched table (caches
/// cleared, filters rebuilt from a later snapshot); `None` when nobody
/// receives events any more.
pub(super) async fn restart(
    pool: &PgPool,
    tx: &mpsc::Sender<Event>,
) -> Result<Option<Position>, Failure> {
    let p = timed(position(pool)).await?;
    if tx
        .send(Resync::all(
            "queue feed: changes may have been pruned unread",
        ))
        .await
        .is_err()
    {
        return Ok(None);
    }
    Ok(Some(p))
}

/// A snapshot and what it belongs to, read on one connection.
async fn position(pool: &PgPool) -> Result<Position, sqlx::Error> {
    let mut conn = pool.acquire().await?;
    let (snapshot, backend): (String, String) =
        sqlx::query_as(&format!("SELECT pg_current_snapshot()::text, {BACKEND}"))
            .fetch_one(&mut *conn)
            .await?;
    let (server, _) = Server::read(&mut *conn).await?;
    Ok(Position {
        snapshot,
        taken: Instant::now(),
        backend,
        server,
    })
}

/// The starting position, once the server is known to be a primary with a
/// change table nobody else may write; transient failures are retried with
/// capped back-off.
pub(super) async fn first_position(pool: &PgPool) -> Result<Position, QueueError> {
    let mut delay = Duration::from_millis(100);
    loop {
        let attempt = async {
            let (standby, table): (bool, bool) = sqlx::query_as(
                "SELECT pg_is_in_recovery(), to_regclass('public.bloomgate_changes') IS NOT NULL",
            )
            .fetch_one(pool)
            .await?;
            if standby {
                return Ok(Err(QueueError::Standby));
            }
            if !table {
                return Ok(Err(QueueError::NoTable));
            }
            let unsafe_: Option<String> = sqlx::query_scalar(QUEUE_TABLE_CHECK)
                .fetch_optional(pool)
                .await?
                .flatten();
            if let Some(why) = unsafe_ {
                return Ok(Err(QueueError::Unsafe(why)));
            }
            Ok::<_, sqlx::Error>(Ok(position(pool).await?))
        };
        match timed(attempt).await {
            Ok(r) => return r,
            Err(e) => {
                tracing::warn!(error = %e, retry_in = ?delay, "cannot read the change queue yet");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(5));
            }
        }
    }
}

/// `xmin` of a snapshot's text (`xmin:xmax:xip,...`).
pub(super) fn xmin(snapshot: &str) -> Option<&str> {
    let x = snapshot.split(':').next()?;
    (!x.is_empty() && x.bytes().all(|b| b.is_ascii_digit())).then_some(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xmin_is_the_first_field_of_a_snapshot() {
        assert_eq!(xmin("740:745:740,742"), Some("740"));
        assert_eq!(xmin("3:3:"), Some("3"));
        for bad in ["", ":1:", "x:1:", "1 :2:"] {
            assert_eq!(xmin(bad), None, "{bad:?}");
        }
    }
}
