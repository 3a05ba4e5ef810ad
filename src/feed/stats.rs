//! How current the change feed is, whichever feed it is ([`Progress`],
//! written by the applier as it applies events), and the snapshot of the
//! feed in force that the admin API and `/metrics` render
//! ([`FeedSnapshot`]): generic families with a `feed` label, and each
//! feed's own families only for the feed in force.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use super::notify::NotifySnapshot;
use super::wal::WalSnapshot;
use super::{HealthState, now_ms};
use crate::exposition::{Exposition, Labels};

/// What the applier has applied, in Unix milliseconds (0: nothing yet).
#[derive(Debug, Default)]
pub struct Progress {
    /// When the latest commit was applied.
    last_event_ms: AtomicU64,
    /// The moment the latest heartbeat vouches for: every change committed
    /// before it has been applied.
    last_heartbeat_ms: AtomicU64,
    /// The primary's WAL position at the latest read (WAL feed), as a
    /// number; 0: not read.
    pub primary_lsn: AtomicU64,
}

impl Progress {
    pub fn event(&self) {
        self.last_event_ms.store(now_ms(), Ordering::Relaxed);
    }

    /// A heartbeat made at `at`, applied now.
    pub fn heartbeat(&self, at: Instant) {
        let ms = now_ms().saturating_sub(at.elapsed().as_millis() as u64);
        self.last_heartbeat_ms.fetch_max(ms, Ordering::Relaxed);
    }

    /// The moment, in Unix milliseconds, before which every committed
    /// change has been applied, as the latest heartbeat vouches (0: none).
    pub fn heartbeat_ms(&self) -> u64 {
        self.last_heartbeat_ms.load(Ordering::Relaxed)
    }
}

/// The feed in force at one moment.
#[derive(Clone, Debug, Default)]
pub struct FeedSnapshot {
    /// `wal`, `queue`, `notify` or `off`; empty before start-up chose.
    pub feed: &'static str,
    /// How the WAL feed reads (`streamed`, `polled every 5ms`); empty for
    /// the others.
    pub delivery: String,
    pub health: HealthState,
    pub last_event_seconds: f64,
    pub last_heartbeat_seconds: f64,
    /// The primary's position less the applied one (WAL feed, once read).
    pub lag_bytes: Option<u64>,
    pub notify: NotifySnapshot,
    pub wal: WalSnapshot,
}

impl FeedSnapshot {
    pub fn new(
        feed: &'static str,
        delivery: String,
        health: HealthState,
        progress: &Progress,
        applied_lsn: u64,
        notify: NotifySnapshot,
        wal: WalSnapshot,
    ) -> Self {
        let primary = progress.primary_lsn.load(Ordering::Relaxed);
        Self {
            feed,
            delivery,
            health,
            last_event_seconds: progress.last_event_ms.load(Ordering::Relaxed) as f64 / 1e3,
            last_heartbeat_seconds: progress.last_heartbeat_ms.load(Ordering::Relaxed) as f64 / 1e3,
            lag_bytes: (feed == "wal" && primary != 0).then(|| primary.saturating_sub(applied_lsn)),
            notify,
            wal,
        }
    }

    pub fn is_up(&self) -> bool {
        self.health.state == super::FeedState::Streaming
    }

    pub fn expose_all(&self, out: &mut Exposition) {
        if self.feed.is_empty() {
            return;
        }
        out.info(
            "bloomgate_feed_info",
            "The change feed in force (database.freshness resolved) and how it reads.",
            &[("feed", self.feed), ("delivery", &self.delivery)],
        );
        if self.feed == "off" {
            return;
        }
        let feed = [("feed", self.feed)];
        let l: Labels<'_> = &feed;
        let up = self.is_up();
        out.gauge(
            "bloomgate_feed_up",
            "1 while the change feed streams, 0 while it cannot (see bloomgate_feed_failures_total and the log).",
            l,
            f64::from(u8::from(up)),
        );
        out.counter(
            "bloomgate_feed_failures_total",
            "Times the change feed could not stream (a failed connection attempt, a broken stream), counted as they happen.",
            l,
            self.health.failures as f64,
        );
        out.counter(
            "bloomgate_feed_reconnects_total",
            "Sessions of the change feed that ended and were opened again.",
            l,
            self.health.reconnects as f64,
        );
        out.gauge(
            "bloomgate_feed_last_event_timestamp_seconds",
            "Unix time the latest change was applied; 0: none since start.",
            l,
            self.last_event_seconds,
        );
        out.gauge(
            "bloomgate_feed_last_heartbeat_timestamp_seconds",
            "The moment the latest applied heartbeat vouches for (every change committed before it is applied), as Unix time; 0: none yet. time() minus it is the feed's lag in seconds, and grows while nothing vouches, written to or not.",
            l,
            self.last_heartbeat_seconds,
        );
        if let Some(b) = self.lag_bytes {
            out.gauge(
                "bloomgate_feed_lag_bytes",
                "WAL between the primary's current position (read every second) and the position applied.",
                l,
                b as f64,
            );
        }
        match self.feed {
            "wal" => {
                use crate::exposition::Expose;
                self.wal.expose(&[], out);
            }
            "notify" => {
                out.counter(
                    "bloomgate_notifications_total",
                    "Key-change notifications received.",
                    &[],
                    self.notify.notifications as f64,
                );
                if up {
                    out.gauge(
                        "bloomgate_notification_lag_seconds",
                        "Trigger to receipt of the latest notification (absent while the feed is down).",
                        &[],
                        self.notify.last_lag_seconds,
                    );
                }
            }
            "queue" => {
                out.counter(
                    "bloomgate_queue_changes_total",
                    "Change rows the queue feed read.",
                    &[],
                    self.notify.notifications as f64,
                );
                out.counter(
                    "bloomgate_queue_failed_polls_total",
                    "Polls of the change table that failed (resumed without a rebuild).",
                    &[],
                    self.notify.listener_reconnects as f64,
                );
                if up {
                    out.gauge(
                        "bloomgate_queue_lag_seconds",
                        "Trigger to receipt of the latest change row (absent while the feed is down).",
                        &[],
                        self.notify.last_lag_seconds,
                    );
                }
            }
            _ => {}
        }
    }
}
