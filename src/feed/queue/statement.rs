//! How long the feed's statements may take, and what a failed one costs:
//! every statement has [`STATEMENT_DEADLINE`] (past it the connection is
//! dropped, so a hung connection delays changes by that much, no more), and
//! a failed poll is counted, logged at most once per interval and retried
//! with capped back-off.

use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::feed::notify::Stats;
use crate::telemetry::LogThrottle;

/// Longest any of the feed's statements may take before its connection is
/// dropped and the statement retried on a new one.
pub const STATEMENT_DEADLINE: Duration = Duration::from_secs(10);

/// Why a statement failed.
#[derive(Debug, thiserror::Error)]
pub(super) enum Failure {
    #[error("{0}")]
    Sql(#[from] sqlx::Error),
    #[error("no answer within {STATEMENT_DEADLINE:?}")]
    Deadline,
}

pub(super) async fn timed<T>(
    f: impl Future<Output = Result<T, sqlx::Error>>,
) -> Result<T, Failure> {
    match tokio::time::timeout(STATEMENT_DEADLINE, f).await {
        Ok(r) => Ok(r?),
        Err(_) => Err(Failure::Deadline),
    }
}

/// A failed statement: counted, logged at most once per interval (as an
/// error when retrying cannot fix it), retried with capped back-off from
/// the same snapshot.
pub(super) fn failed(
    counters: &Stats,
    log: &LogThrottle,
    e: &Failure,
    delay: Duration,
    interval: Duration,
) -> Duration {
    counters.listener_reconnects.fetch_add(1, Ordering::Relaxed);
    if let Some(not_logged) = log.permit() {
        let code = match e {
            Failure::Sql(sqlx::Error::Database(d)) => d.code().map(|c| c.into_owned()),
            _ => None,
        };
        // No privilege, no table, a standby: needs an operator.
        if matches!(code.as_deref(), Some("42501" | "42P01" | "25006")) {
            tracing::error!(error = %e, not_logged, "cannot read the change queue: changes are not followed until this is fixed");
        } else {
            tracing::warn!(error = %e, not_logged, "cannot read the change queue; retrying from the last snapshot (nothing is lost)");
        }
    }
    (delay * 2).min(Duration::from_secs(1)).max(interval)
}
