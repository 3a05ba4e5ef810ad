//! Pruning the change table: when a gateway may delete rows (a note of its
//! snapshots' `xmin` a whole `database.queue_retention` old), and the
//! deletion itself, in batches on the pool's second connection under an
//! advisory lock, raising the pruning mark first (see the module doc).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use sqlx::PgPool;
use tokio::task::JoinHandle;

use super::position::xmin;
use super::statement::{Failure, timed};
use crate::telemetry::LogThrottle;

/// Rows deleted per statement when pruning.
const PRUNE_BATCH: i64 = 10_000;

/// The transaction-level advisory lock each pruning batch takes, so one
/// gateway prunes at a time and the others, finding it taken, leave it to
/// that one (rather than every gateway deleting the same rows, each
/// waiting on the other's row locks).
pub const PRUNE_LOCK_KEY: i64 = crate::db::INSTALL_LOCK_KEY + 1;

/// A task aborted when this is dropped (the feed's pruning: it stops with
/// the feed).
pub(super) struct AbortOnDrop(pub(super) Option<JoinHandle<()>>);

impl AbortOnDrop {
    pub(super) fn running(&self) -> bool {
        self.0.as_ref().is_some_and(|t| !t.is_finished())
    }
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if let Some(t) = &self.0 {
            t.abort();
        }
    }
}

/// Deletes the rows of transactions below `below`, in batches (each its
/// own transaction and deadline: [`prune_batch`]), on the pool's second
/// connection, once the pruning mark says so (a gateway that had not read
/// them learns it from the mark, whatever its own retention or clock).
pub(super) async fn prune(pool: PgPool, below: String) {
    static FAILURES: std::sync::OnceLock<LogThrottle> = std::sync::OnceLock::new();
    let log = |e: &Failure| {
        if let Some(not_logged) = FAILURES.get_or_init(LogThrottle::default).permit() {
            tracing::warn!(error = %e, not_logged, "cannot delete old rows of the change queue");
        }
    };
    let mut deleted = 0;
    let mut first = true;
    loop {
        match timed(prune_batch(&pool, &below, first)).await {
            Ok(Some(n)) => {
                deleted += n;
                first = false;
                if n < PRUNE_BATCH as u64 {
                    break;
                }
            }
            Ok(None) => {
                tracing::debug!("another gateway is deleting old change rows");
                break;
            }
            Err(e) => {
                log(&e);
                break;
            }
        }
    }
    tracing::debug!(deleted, "old change rows deleted");
}

/// One batch of pruning in its own transaction, under [`PRUNE_LOCK_KEY`]
/// (`None`: another gateway holds it, and prunes); the first batch also
/// raises the mark, committed with its deletions, so no snapshot sees
/// rows gone and the mark not raised.
async fn prune_batch(pool: &PgPool, below: &str, mark: bool) -> Result<Option<u64>, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let locked: bool = sqlx::query_scalar("SELECT pg_try_advisory_xact_lock($1)")
        .bind(PRUNE_LOCK_KEY)
        .fetch_one(&mut *tx)
        .await?;
    if !locked {
        return Ok(None);
    }
    if mark {
        sqlx::query(
            "UPDATE public.bloomgate_changes_pruned SET below = $1::text::xid8
              WHERE below < $1::text::xid8",
        )
        .bind(below)
        .execute(&mut *tx)
        .await?;
    }
    let r = sqlx::query(
        "DELETE FROM public.bloomgate_changes WHERE ctid = ANY(ARRAY(
           SELECT ctid FROM public.bloomgate_changes WHERE xid < $1::text::xid8 LIMIT $2))",
    )
    .bind(below)
    .bind(PRUNE_BATCH)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(Some(r.rows_affected()))
}

/// When to prune, and below which transaction id (see the module doc).
pub(super) struct Pruner {
    retention: Duration,
    every: Duration,
    /// (when, the `xmin` of a snapshot taken then), oldest first.
    notes: VecDeque<(Instant, String)>,
    last: Option<Instant>,
}

impl Pruner {
    pub(super) fn new(retention: Duration) -> Self {
        Self {
            retention,
            every: (retention / 10).max(Duration::from_secs(1)),
            notes: VecDeque::new(),
            last: None,
        }
    }

    /// Notes `snapshot` once per tenth of the retention; then, if a note is
    /// old enough, the `xmin` to delete below (the newest such note's).
    pub(super) fn due(&mut self, snapshot: &str) -> Option<String> {
        self.due_at(Instant::now(), snapshot)
    }

    fn due_at(&mut self, now: Instant, snapshot: &str) -> Option<String> {
        if self
            .last
            .is_some_and(|t| now.duration_since(t) < self.every)
        {
            return None;
        }
        self.last = Some(now);
        let current = xmin(snapshot)?;
        // Within one server history `xmin` never goes back. A note above
        // the current one is from another history (a failover or restore to
        // lower ids): deleting below it, and raising the pruning mark to it,
        // would make every gateway rescan on every poll until the ids
        // caught up. Such notes are dropped.
        let ahead = |x: &str| x.parse::<u64>().ok() > current.parse::<u64>().ok();
        if self.notes.iter().any(|(_, x)| ahead(x)) {
            self.notes.clear();
        }
        self.notes.push_back((now, current.to_string()));
        let mut below = None;
        while let Some((at, _)) = self.notes.front()
            && now.duration_since(*at) >= self.retention
        {
            below = self.notes.pop_front().map(|(_, x)| x);
        }
        below
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows go only once a note is a whole retention old, and only below
    /// that note's `xmin`, never a younger one.
    #[test]
    fn pruning_waits_a_whole_retention_and_uses_the_newest_old_enough_note() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut p = Pruner::new(s(100));
        assert_eq!(p.every, s(10));
        assert_eq!(p.due_at(t0, "100:100:"), None);
        // Within the same tenth: not even noted.
        assert_eq!(p.due_at(t0 + s(5), "150:150:"), None);
        assert_eq!(p.notes.len(), 1);
        for i in 1..10u64 {
            let snapshot = format!("{}:{}:", 100 + i * 10, 100 + i * 10);
            assert_eq!(p.due_at(t0 + s(i * 10), &snapshot), None, "at {i}0 s");
        }
        // 100 s after the first note: below its xmin, nothing younger.
        assert_eq!(p.due_at(t0 + s(100), "200:200:").as_deref(), Some("100"));
        // A long gap: the newest note at least 100 s old wins.
        assert_eq!(p.due_at(t0 + s(195), "300:300:").as_deref(), Some("190"));
        assert!(p.notes.iter().all(|(at, _)| t0 + s(195) - *at < s(100)));
    }

    /// After a switch to a server history with lower transaction ids, the
    /// old history's notes are never used to prune.
    #[test]
    fn notes_from_a_history_with_higher_ids_are_dropped() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut p = Pruner::new(s(100));
        for i in 0..10u64 {
            let snapshot = format!("{}:{}:", 9000 + i, 9000 + i);
            assert_eq!(p.due_at(t0 + s(i * 10), &snapshot), None);
        }
        // The new history: ids around 500, and the old notes old enough.
        assert_eq!(p.due_at(t0 + s(150), "500:500:"), None);
        assert_eq!(p.notes.len(), 1);
        assert_eq!(p.due_at(t0 + s(250), "600:600:").as_deref(), Some("500"));
    }
}
