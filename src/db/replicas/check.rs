//! The replicas' check (see "Health" in [`super`]): once per
//! `replica_check_interval`, the primary's position and every replica's
//! state read, each replica judged usable or not, and its lag measured
//! against the history of the primary's positions.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::{PRIMARY_WRITE_LSN, Replicas, primary_timeline, replica_position};
use crate::db::lsn::Lsn;
use crate::db::position::Position;
use crate::shutdown::Shutdown;

impl Replicas {
    /// Reads the primary's position and every replica's state once.
    pub async fn check(&self) {
        let now = Instant::now();
        let unknown = self.unknown.load(Ordering::SeqCst);
        if unknown != 0
            && let Ok(at) = self.primary_lsn().await
        {
            // Those changes committed before this read: past them now.
            self.note_change(at);
            let _ = self
                .unknown
                .compare_exchange(unknown, 0, Ordering::SeqCst, Ordering::SeqCst);
        }
        let written: Result<(i64, String, Option<String>, i64), _> =
            sqlx::query_as(PRIMARY_WRITE_LSN)
                .fetch_one(&self.primary)
                .await;
        let mut written_lsn = 0;
        let primary = match written {
            Ok((lsn, file, system, started)) => {
                let timeline = primary_timeline(system.as_deref(), &file);
                let lsn = u64::try_from(lsn).unwrap_or(0);
                written_lsn = lsn;
                let mut h = self.history.lock().unwrap_or_else(|p| p.into_inner());
                if h.timeline.is_none_or(|(t, _)| t != timeline) || h.started != Some(started) {
                    // A new history (a failover; a restart or a restore of
                    // the primary, which may go back in the WAL): positions
                    // of the old one mean nothing.
                    if h.timeline.is_some() {
                        tracing::warn!(
                            timeline = timeline.id,
                            "the primary is on a new timeline, or started again: every read replica is judged afresh"
                        );
                    }
                    h.timeline = Some((timeline, now));
                    h.started = Some(started);
                    h.positions.clear();
                }
                if h.positions.back().is_none_or(|&(_, last)| lsn > last) {
                    h.positions.push_back((now, lsn));
                }
                // Enough history to tell a lag beyond the limit.
                while h.positions.len() > 2
                    && h.positions
                        .get(1)
                        .is_some_and(|&(t, _)| now.duration_since(t) > self.max_lag * 4)
                {
                    h.positions.pop_front();
                }
                Some(timeline)
            }
            Err(_) => None,
        };
        for r in &self.members {
            let state: Result<CheckRow, sqlx::Error> =
                sqlx::query_as(CHECK).fetch_one(&r.pool).await;
            let (usable, detail) = match (state, primary) {
                (Err(e), _) => {
                    let refused = r.refused.lock().unwrap_or_else(|p| p.into_inner()).clone();
                    (
                        false,
                        Some(refused.unwrap_or_else(|| format!("not answering ({e})"))),
                    )
                }
                (Ok(_), None) => (false, Some("the primary's position cannot be read".into())),
                (Ok((in_recovery, system, timeline, replay, since_replayed)), Some(primary)) => {
                    let at = replica_position(system.as_deref(), timeline, replay);
                    r.replayed(at);
                    let since = since_replayed
                        .filter(|s| s.is_finite() && *s >= 0.0)
                        .map(Duration::from_secs_f64);
                    let lag = self.lag_of(r.replay_position(), since, now);
                    r.lag_ms.store(
                        lag.as_millis().try_into().unwrap_or(u64::MAX),
                        Ordering::Relaxed,
                    );
                    if !in_recovery {
                        // A replica promoted to primary is a different
                        // server: its positions are not the primary's.
                        (false, Some("not in recovery (promoted?)".into()))
                    } else if at.timeline == primary
                        && at.lsn.0 > written_lsn
                        && self.ahead_of_primary(at.lsn.0).await
                    {
                        // No replica replays what its primary has not
                        // written: this one has WAL of another history (a
                        // primary restored from an older copy), and its
                        // rows may be ones the primary never had.
                        (
                            false,
                            Some(format!(
                                "replayed to {} where the primary has written only to {} (the primary restored from an older copy?): it holds WAL the primary does not",
                                at.lsn,
                                Lsn(written_lsn)
                            )),
                        )
                    } else if at.timeline != primary {
                        (
                            false,
                            Some(format!(
                                "on timeline {} of system {}; the primary is on timeline {} of system {} (stranded by a failover, or not following yet)",
                                at.timeline.id, at.timeline.system, primary.id, primary.system
                            )),
                        )
                    } else if lag > self.max_lag {
                        (false, Some(format!("lagging {} ms", lag.as_millis())))
                    } else {
                        (true, None)
                    }
                }
            };
            if usable != r.is_usable() {
                if usable {
                    tracing::info!(replica = %r.name, "read replica in use");
                } else {
                    tracing::warn!(replica = %r.name, why = detail.as_deref().unwrap_or(""), "read replica not used: using the primary");
                }
            }
            *r.detail.lock().unwrap_or_else(|p| p.into_inner()) = detail;
            r.usable.store(usable, Ordering::Relaxed);
        }
    }

    /// How long ago the primary first had WAL past `replay`: zero if the
    /// replica has everything the primary had at the last check. When the
    /// primary was past it already at the oldest check remembered (a replica
    /// behind since before the gateway started, or for longer than the
    /// history keeps), at least that long, and at least the time since the
    /// replica last replayed a commit (`since_replayed`, the replica's own
    /// clock): a replica paused for hours is never "lag 0". A replica on
    /// another timeline than the primary has none of its WAL since the
    /// timeline began: at least as long as this gateway has seen the
    /// primary on it, and never zero.
    fn lag_of(&self, replay: Position, since_replayed: Option<Duration>, now: Instant) -> Duration {
        let h = self.history.lock().unwrap_or_else(|p| p.into_inner());
        match h.timeline {
            Some((t, _)) if t == replay.timeline => {
                lag_in(&h.positions, replay.lsn.0, since_replayed, now)
            }
            Some((_, seen)) => now
                .duration_since(seen)
                .max(since_replayed.unwrap_or(Duration::ZERO))
                .max(Duration::from_millis(1)),
            None => Duration::ZERO,
        }
    }

    /// Whether the primary's write position, read now (after the replica's
    /// replay position was), is still behind `replay`: a replica may have
    /// replayed WAL written since the check's first reading.
    async fn ahead_of_primary(&self, replay: u64) -> bool {
        let now: Result<(i64, String, Option<String>, i64), _> = sqlx::query_as(PRIMARY_WRITE_LSN)
            .fetch_one(&self.primary)
            .await;
        matches!(now, Ok((lsn, ..)) if u64::try_from(lsn).unwrap_or(0) < replay)
    }

    /// Checks until `shutdown` fires (between two checks).
    pub async fn run_checks(self: Arc<Self>, every: Duration, mut shutdown: Shutdown) {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = shutdown.fired() => return,
                _ = tick.tick() => self.check().await,
            }
        }
    }
}

/// [`CHECK`]'s row: in recovery, system identifier, timeline, replay
/// position, seconds since the last commit replayed.
type CheckRow = (bool, Option<String>, Option<i64>, i64, Option<f64>);

/// A replica's state at a check: in recovery, its [`REPLAY`] columns, and
/// the time since it last replayed a commit.
const CHECK: &str = concat!(
    "SELECT pg_is_in_recovery(), ",
    system_identifier_sql!(),
    ", coalesce((SELECT received_tli FROM pg_stat_wal_receiver), \
              (SELECT timeline_id FROM pg_control_checkpoint()))::int8, \
     (coalesce(pg_last_wal_replay_lsn(), '0/0') - '0/0'::pg_lsn)::int8, \
     extract(epoch FROM clock_timestamp() - pg_last_xact_replay_timestamp())::float8"
);

/// [`Replicas::lag_of`] over a history of (check, primary position),
/// oldest first.
pub(super) fn lag_in(
    history: &VecDeque<(Instant, u64)>,
    replay: u64,
    since_replayed: Option<Duration>,
    now: Instant,
) -> Duration {
    let Some(&(oldest, first_lsn)) = history.front() else {
        return Duration::ZERO;
    };
    if history.back().is_none_or(|&(_, latest)| replay >= latest) {
        return Duration::ZERO;
    }
    if first_lsn <= replay {
        // The first check that saw the primary past it.
        return history
            .iter()
            .find(|&&(_, lsn)| lsn > replay)
            .map_or(Duration::ZERO, |&(t, _)| now.duration_since(t));
    }
    now.duration_since(oldest)
        .max(since_replayed.unwrap_or(Duration::ZERO))
}
