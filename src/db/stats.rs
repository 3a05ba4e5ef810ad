//! The database's counters ([`DbStats`]) and the snapshot the admin API and
//! `/metrics` render ([`DbSnapshot`]): queries by kind and target, their
//! errors and durations, and the pool's connections. Each resource keeps
//! its own [`QueryCounts`] (handed in with every query as a [`Tally`]), so
//! `bloomgate_db_queries_total` says which resource cost the database what;
//! the resource renders them.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::exposition::{Expose, Exposition};
use crate::histogram::{self, Histogram};

/// What a query was for: the `kind` label.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QueryKind {
    /// One row by key for a key the filter passed (a cache miss, or any
    /// lookup while the resource is not vouched for).
    Row,
    /// One row by key for a key the filter rejected, asked anyway: above
    /// the high-water mark, or while not vouched for (`verify_budget`).
    /// Apart from `row` because it is the price of the protection itself.
    Verify,
    /// Every key of a table (a filter build).
    Scan,
    /// The start-up check of a resource's table and columns (a NULL key).
    Probe,
}

/// Where a query ran: the `target` label.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    Primary,
    Replica,
}

const KINDS: [(QueryKind, &str); 4] = [
    (QueryKind::Row, "row"),
    (QueryKind::Verify, "verify"),
    (QueryKind::Scan, "scan"),
    (QueryKind::Probe, "probe"),
];
const TARGETS: [(Target, &str); 2] = [(Target::Primary, "primary"), (Target::Replica, "replica")];

/// One resource's queries by `[kind][target]`.
#[derive(Debug, Default)]
pub struct QueryCounts([[AtomicU64; 2]; KINDS.len()]);

impl QueryCounts {
    /// `[kind][target]`, as [`QueryKind`] and [`Target`] are numbered.
    pub fn snapshot(&self) -> QueriesSnapshot {
        QueriesSnapshot(
            self.0
                .iter()
                .map(|t| [t[0].load(Ordering::Relaxed), t[1].load(Ordering::Relaxed)])
                .collect(),
        )
    }
}

/// Whose query this is and what it is for: counted in the resource's
/// [`QueryCounts`] once it ran, with the target it ran on.
#[derive(Clone, Copy)]
pub struct Tally<'a> {
    pub counts: &'a QueryCounts,
    pub kind: QueryKind,
}

/// One resource's queries at one moment.
#[derive(Clone, Debug, Default)]
pub struct QueriesSnapshot(pub Vec<[u64; 2]>);

impl QueriesSnapshot {
    pub fn get(&self, kind: QueryKind, target: Target) -> u64 {
        self.0[kind as usize][target as usize]
    }

    /// The `bloomgate_db_queries_total` series of one resource.
    pub fn expose(&self, resource: &str, out: &mut Exposition) {
        for ((_, kind), counts) in KINDS.iter().zip(&self.0) {
            for ((_, target), n) in TARGETS.iter().zip(counts) {
                out.counter(
                    "bloomgate_db_queries_total",
                    "Queries sent to Postgres by resource, kind (row: a row load for a key the filter passed; verify: a row load for a key it rejected; scan: a filter build's key scan; probe: the start-up check of the table) and target (primary, replica).",
                    &[("resource", resource), ("kind", kind), ("target", target)],
                    *n as f64,
                );
            }
        }
    }
}

#[derive(Default)]
pub struct DbStats {
    /// Queries of every resource.
    queries: AtomicU64,
    pub errors: AtomicU64,
    /// The last database check's verdict (`Db::check_up`).
    pub up: std::sync::atomic::AtomicBool,
    /// Row loads waiting for a pooled connection now.
    waiting: AtomicU64,
    /// How long row loads waited for a pooled connection.
    acquire: Histogram,
    /// Row loads, from asking the pool to the row (acquire included).
    row_durations: [Histogram; 2],
}

impl std::fmt::Debug for DbStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DbStats")
            .field("queries", &self.total())
            .finish_non_exhaustive()
    }
}

impl DbStats {
    pub fn query(&self, tally: Tally<'_>, target: Target) {
        self.queries.fetch_add(1, Ordering::Relaxed);
        tally.counts.0[tally.kind as usize][target as usize].fetch_add(1, Ordering::Relaxed);
    }

    pub fn row_took(&self, target: Target, d: Duration) {
        self.row_durations[target as usize].record(d);
    }

    /// Counts a wait for a pooled connection while `f` runs.
    pub async fn acquiring<T>(&self, f: impl std::future::Future<Output = T>) -> T {
        let began = std::time::Instant::now();
        self.waiting.fetch_add(1, Ordering::Relaxed);
        let r = f.await;
        self.waiting.fetch_sub(1, Ordering::Relaxed);
        self.acquire.record(began.elapsed());
        r
    }

    /// Every query so far.
    pub fn total(&self) -> u64 {
        self.queries.load(Ordering::Relaxed)
    }

    pub fn snapshot(&self, pool: &sqlx::PgPool) -> DbSnapshot {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let size = u64::from(pool.size());
        let idle = pool.num_idle() as u64;
        DbSnapshot {
            queries: self.total(),
            errors: l(&self.errors),
            up: u64::from(self.up.load(Ordering::Relaxed)),
            pool_max: u64::from(pool.options().get_max_connections()),
            pool_open: size,
            pool_idle: idle,
            pool_in_use: size.saturating_sub(idle),
            pool_waiting: l(&self.waiting),
            acquire: self.acquire.snapshot(),
            row_durations: self.row_durations.iter().map(Histogram::snapshot).collect(),
        }
    }
}

/// The database at one moment.
#[derive(Clone, Debug)]
pub struct DbSnapshot {
    pub queries: u64,
    pub errors: u64,
    /// 1 if the last check reached the database, else 0.
    pub up: u64,
    pub pool_max: u64,
    pub pool_open: u64,
    pub pool_idle: u64,
    pub pool_in_use: u64,
    pub pool_waiting: u64,
    pub acquire: histogram::Snapshot,
    pub row_durations: Vec<histogram::Snapshot>,
}

crate::expose_fields!(DbSnapshot {
    errors => counter("bloomgate_db_errors_total", "Queries that failed."),
    up => gauge("bloomgate_db_up", "1 if the last database check connected, else 0."),
    pool_max => gauge("bloomgate_db_pool_max_connections", "The pool's bound (database.pool_size)."),
    pool_open => gauge("bloomgate_db_pool_connections", "Connections the pool holds open."),
    pool_in_use => gauge("bloomgate_db_pool_in_use_connections", "Pooled connections in use."),
    pool_idle => gauge("bloomgate_db_pool_idle_connections", "Pooled connections idle."),
    pool_waiting => gauge(
        "bloomgate_db_pool_waiting",
        "Row loads waiting for a pooled connection now."
    ),
});

impl DbSnapshot {
    /// The histograms; the table above has the rest (the queries are
    /// each resource's: [`QueriesSnapshot::expose`]).
    pub fn expose_all(&self, out: &mut Exposition) {
        for ((_, target), h) in TARGETS.iter().zip(&self.row_durations) {
            out.histogram(
                "bloomgate_db_query_duration_seconds",
                "One-row queries (the row, verify and probe kinds together), from asking for a connection to the row, by target.",
                &[("kind", "row"), ("target", target)],
                h,
            );
        }
        out.histogram(
            "bloomgate_db_pool_acquire_duration_seconds",
            "How long row loads waited for a pooled connection of the primary.",
            &[],
            &self.acquire,
        );
        self.expose(&[], out);
    }
}
