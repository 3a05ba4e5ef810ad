//! The WAL feed's counters: what its sessions count as they go, read as
//! one [`WalSnapshot`] by the metrics and the admin API.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::feed::Lsn;

/// Counters for metrics and the admin API.
#[derive(Debug, Default)]
pub struct Stats {
    pub commits: AtomicU64,
    pub inserts: AtomicU64,
    pub updates: AtomicU64,
    pub deletes: AtomicU64,
    pub truncates: AtomicU64,
    pub reconnects: AtomicU64,
    pub slot_invalidations: AtomicU64,
    /// Streams started past this process's position (see "No gap").
    pub gaps: AtomicU64,
    /// Publication repairs (`install_feed`).
    pub repairs: AtomicU64,
    /// The last LSN the slot was advanced to (applied).
    pub applied_lsn: AtomicU64,
    /// Bytes of WAL between the server's end of WAL (as its last frame
    /// said) and the position the feed has acknowledged.
    pub lag_bytes: AtomicU64,
    /// Commit to receipt of the latest transaction, in microseconds.
    pub lag_us: AtomicU64,
    /// Flushes of the primary's WAL the feed forced because its stream had
    /// reached the flush position but not the insert position (see
    /// "Heartbeats and checks").
    pub forced_flushes: AtomicU64,
    /// Promotions the permanent slot survived with a proof of what the new
    /// timeline kept (see `fork`): filters kept, not rebuilt.
    pub forks_kept: AtomicU64,
    /// Since when (Unix milliseconds) the temporary slot's creation has
    /// waited on another transaction, as first seen; 0: not waiting.
    pub slot_blocked_since_ms: AtomicU64,
}

impl Stats {
    /// The counters as of now.
    pub fn snapshot(&self) -> WalSnapshot {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        WalSnapshot {
            commits: l(&self.commits),
            inserts: l(&self.inserts),
            updates: l(&self.updates),
            deletes: l(&self.deletes),
            truncates: l(&self.truncates),
            reconnects: l(&self.reconnects),
            slot_invalidations: l(&self.slot_invalidations),
            applied_lsn: Lsn(l(&self.applied_lsn)).to_string(),
            applied_lsn_value: l(&self.applied_lsn),
            lag_bytes: l(&self.lag_bytes),
            lag_ms: l(&self.lag_us) as f64 / 1000.0,
            forced_flushes: l(&self.forced_flushes),
            forks_kept: l(&self.forks_kept),
            slot_blocked_seconds: match l(&self.slot_blocked_since_ms) {
                0 => 0.0,
                since => crate::feed::now_ms().saturating_sub(since) as f64 / 1e3,
            },
        }
    }
}

/// The WAL feed's counters at one moment (the admin API's `wal`).
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct WalSnapshot {
    pub commits: u64,
    pub inserts: u64,
    pub updates: u64,
    pub deletes: u64,
    pub truncates: u64,
    pub reconnects: u64,
    pub slot_invalidations: u64,
    pub applied_lsn: String,
    #[serde(skip)]
    pub applied_lsn_value: u64,
    pub lag_bytes: u64,
    pub lag_ms: f64,
    pub forced_flushes: u64,
    pub forks_kept: u64,
    /// How long the temporary slot's creation has waited on another
    /// transaction (0: not waiting); `/readyz` names the transaction.
    pub slot_blocked_seconds: f64,
}

impl crate::exposition::Expose for WalSnapshot {
    fn expose(
        &self,
        labels: crate::exposition::Labels<'_>,
        out: &mut crate::exposition::Exposition,
    ) {
        for (op, v) in [
            ("insert", self.inserts),
            ("update", self.updates),
            ("delete", self.deletes),
            ("truncate", self.truncates),
        ] {
            out.counter(
                "bloomgate_wal_changes_total",
                "Row changes the WAL feed delivered, by operation.",
                &[("op", op)],
                v as f64,
            );
        }
        out.counter(
            "bloomgate_wal_commits_total",
            "Transactions the WAL feed delivered.",
            labels,
            self.commits as f64,
        );
        out.counter(
            "bloomgate_wal_forced_flushes_total",
            "WAL flushes the feed forced: its stream had sent all that was flushed, not all that was inserted.",
            labels,
            self.forced_flushes as f64,
        );
        out.counter(
            "bloomgate_wal_failovers_kept_total",
            "Promotions the permanent slot survived with a proof of what the new timeline kept: caches emptied, filters kept instead of rebuilt.",
            labels,
            self.forks_kept as f64,
        );
        out.counter(
            "bloomgate_wal_slot_invalidations_total",
            "Permanent slots found invalidated (and recreated, with a rebuild).",
            labels,
            self.slot_invalidations as f64,
        );
        out.gauge(
            "bloomgate_wal_applied_lsn",
            "The LSN the slot was advanced to (applied).",
            labels,
            self.applied_lsn_value as f64,
        );
        out.gauge(
            "bloomgate_wal_lag_bytes",
            "WAL between the server's end of WAL, as its last message said, and the position acknowledged.",
            labels,
            self.lag_bytes as f64,
        );
        out.gauge(
            "bloomgate_wal_lag_seconds",
            "Commit to receipt of the latest transaction.",
            labels,
            self.lag_ms / 1e3,
        );
        out.gauge(
            "bloomgate_wal_slot_blocked_seconds",
            "How long the temporary slot's creation has waited for another transaction to end (a prepared transaction, a long one holding an xid); 0: not waiting. /readyz and the log name it.",
            labels,
            self.slot_blocked_seconds,
        );
    }
}
