//! What a resource tells the admin API and the status page about its
//! filter: the last build, the last refusal, how the latest rebuild ended,
//! and how far the live filter has decayed. Plain data, serialised as is.

use std::time::SystemTime;

use serde::Serialize;

use crate::filter::FilterStats;

/// What the last successful build did.
#[derive(Clone, Debug, Serialize)]
pub struct BuildReport {
    /// `scan` (the table read) or `snapshot` (the fleet's, from the bus).
    pub source: &'static str,
    pub generation: u64,
    pub keys: u64,
    pub rows_counted: u64,
    pub replayed: u64,
    pub duration_ms: u64,
    #[serde(with = "humantime_serde")]
    pub built_at: SystemTime,
    /// What asked for it (several requests merge into one build).
    pub reasons: Vec<&'static str>,
    pub filter: FilterStats,
}

/// The latest swap the shrink guard refused, for the admin API.
#[derive(Clone, Debug, Serialize)]
pub struct RefusalReport {
    #[serde(with = "humantime_serde")]
    pub at: SystemTime,
    /// Keys of the last accepted build.
    pub keys_before: u64,
    /// Keys the refused scan found.
    pub keys_found: u64,
    /// Fewest keys an unforced swap accepts.
    pub min_keys: u64,
    /// Found keys the live filter did not hold, added to it (the keys of
    /// lost notifications, now servable).
    pub recovered: u64,
    pub reasons: Vec<&'static str>,
}

/// How the latest rebuild ended, by ticket, for `GET /admin/resources/{name}`
/// (where `POST .../rebuild` tells a client to watch).
#[derive(Clone, Debug, Serialize)]
pub struct LastOutcome {
    /// The coordinator's ticket of that rebuild (see [`crate::rebuild`]).
    pub ticket: u64,
    #[serde(with = "humantime_serde")]
    pub at: SystemTime,
    /// `built`, `refused`, `failed`, `disabled` or `cancelled`.
    pub result: &'static str,
    /// The generation swapped in (`built`).
    pub generation: Option<u64>,
    /// What happened, safe to show (no SQL, no database text).
    pub message: String,
}

/// How far the live filter has decayed since its build, and where the
/// rebuild triggers are. Every figure is O(1) to get (no scan of the bits).
#[derive(Clone, Debug, Serialize)]
pub struct Protection {
    /// Keys at the build plus live inserts that changed the filter since.
    pub keys: u64,
    pub keys_at_build: u64,
    /// `false_positive_rate`.
    pub target_fp_rate: f64,
    /// The sizing model's false-positive rate at `keys` (0 for an exact
    /// set).
    pub estimated_fp_rate: f64,
    /// A rebuild is requested past this estimate (`rebuild_fp_multiple` ×
    /// the target); `null` when off or for an exact set.
    pub rebuild_fp_rate: Option<f64>,
    /// The key count at which the estimate crosses `rebuild_fp_rate`.
    pub rebuild_at_keys: Option<u64>,
    pub inserts_since_build: u64,
    pub rebuild_at_inserts: Option<u64>,
    pub deletes_since_build: u64,
    pub rebuild_at_deletes: Option<u64>,
    /// One of these limits has asked for a rebuild of this build already.
    pub rebuild_requested: bool,
}
