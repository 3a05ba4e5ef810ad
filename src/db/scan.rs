//! "Every key of this table": the scan a filter is built from, streamed
//! over `COPY` from one REPEATABLE READ snapshot, with the position that
//! snapshot saw nothing past, and a drop that cancels it on the server
//! (see [`Db::scan_keys`]).

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use futures_util::TryStreamExt;
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnectOptions, PgConnection};
use sqlx::{Connection, Postgres};

use super::copy::{self, CopyParser};
use super::stats::{QueryCounts, QueryKind, Tally, Target};
use super::{Db, DbError, Queries, position};

impl Db {
    /// Streams every key of a table through `add`, after telling `start` how
    /// many there are. Count and keys come from one REPEATABLE READ snapshot,
    /// and the scan is exempt from `statement_timeout` (a large table takes a
    /// while). Memory stays constant: keys are handed over chunk by chunk.
    ///
    /// Also returns a position the snapshot saw nothing past, read in its
    /// transaction once the snapshot is taken: on the primary its insert
    /// position (every commit it sees ends at or before it; see "What a
    /// reading proves" in `position`), on a read replica its replay
    /// position (a standby's snapshot holds what it had replayed when it
    /// was taken, at or before what it has replayed when asked after).
    /// `None` where it could not be read. A filter's survival of a
    /// promotion rests on it (`feed::wal::fork`).
    ///
    /// # Cancellation
    /// Dropping the future mid-scan (a rebuild task aborted at shutdown)
    /// cancels the query on the server: the scan's connection is taken out of
    /// the pool, and a task spawned on the current runtime asks Postgres to
    /// cancel its backend (`pg_cancel_backend`, over a fresh connection,
    /// within [`CANCEL_WITHIN`]) and then closes it. So neither the pool's
    /// `close()` nor the server waits for a scan nobody wants, and the pid
    /// cannot be reused by another session before the cancel lands. A scan
    /// that fails is closed too rather than pooled, as it may have stopped
    /// in the middle of a COPY.
    pub async fn scan_keys<S>(
        &self,
        q: &Queries,
        counts: &QueryCounts,
        start: impl FnOnce(u64) -> S,
        mut add: impl FnMut(&mut S, copy::Fields<'_>),
    ) -> Result<(S, u64, Option<position::Position>), DbError> {
        // On a replica that has replayed everything applied before this
        // call (the caller opened its journal first; see `replicas`).
        let replica = match &self.replicas {
            Some(reps) => reps.for_scan().await,
            None => None,
        };
        let pool = replica.as_ref().map_or(&self.pool, |r| r.pool());
        let target = match replica {
            Some(_) => Target::Replica,
            None => Target::Primary,
        };
        self.stats.query(
            Tally {
                counts,
                kind: QueryKind::Scan,
            },
            target,
        );
        if let Some(r) = &replica {
            r.queries.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(replica = %r.name, "key scan on a read replica");
        }
        let r = async {
            let mut scan = ScanConn {
                conn: Some(pool.acquire().await?),
                pid: None,
                state: ScanState::Running,
                connect: (*pool.connect_options()).clone(),
            };
            let r = scan_keys_on(&mut scan, q, target == Target::Primary, start, &mut add).await;
            scan.state = match r {
                Ok(_) => ScanState::Done,
                Err(_) => ScanState::Failed,
            };
            r
        }
        .await;
        self.count(r)
    }
}

/// How long the cancellation of a dropped scan may take (connect, cancel).
pub const CANCEL_WITHIN: Duration = Duration::from_secs(5);

#[derive(Clone, Copy, PartialEq, Eq)]
enum ScanState {
    Running,
    Done,
    Failed,
}

/// A scan's connection; see [`Db::scan_keys`] for what its drop does.
struct ScanConn {
    conn: Option<PoolConnection<Postgres>>,
    /// The backend serving the scan, once known.
    pid: Option<i32>,
    state: ScanState,
    connect: PgConnectOptions,
}

impl ScanConn {
    fn conn(&mut self) -> &mut PgConnection {
        self.conn.as_mut().expect("present until drop")
    }
}

impl Drop for ScanConn {
    fn drop(&mut self) {
        let Some(conn) = self.conn.take() else {
            return;
        };
        match (self.state, self.pid, tokio::runtime::Handle::try_current()) {
            (ScanState::Done, ..) => drop(conn),
            (ScanState::Running, Some(pid), Ok(rt)) => {
                let scan = conn.detach();
                let connect = self.connect.clone();
                rt.spawn(async move {
                    let cancel = async {
                        let mut c = PgConnection::connect_with(&connect).await?;
                        sqlx::query("SELECT pg_cancel_backend($1)")
                            .bind(pid)
                            .execute(&mut c)
                            .await?;
                        c.close().await
                    };
                    match tokio::time::timeout(CANCEL_WITHIN, cancel).await {
                        Ok(Ok(())) => tracing::debug!(pid, "abandoned key scan cancelled"),
                        Ok(Err(e)) => {
                            tracing::warn!(pid, error = %e, "cannot cancel an abandoned key scan; closing its connection")
                        }
                        Err(_) => {
                            tracing::warn!(pid, "cancelling an abandoned key scan timed out; closing its connection")
                        }
                    }
                    // Only now: until the cancel landed, the pid was ours.
                    drop(scan);
                });
            }
            _ => drop(conn.detach()),
        }
    }
}

async fn scan_keys_on<S>(
    scan: &mut ScanConn,
    q: &Queries,
    primary: bool,
    start: impl FnOnce(u64) -> S,
    add: &mut impl FnMut(&mut S, copy::Fields<'_>),
) -> Result<(S, u64, Option<position::Position>), DbError> {
    scan.pid = Some(
        sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(scan.conn())
            .await?,
    );
    let mut tx = scan.conn().begin().await?;
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        .execute(&mut *tx)
        .await?;
    sqlx::query("SET LOCAL statement_timeout = 0")
        .execute(&mut *tx)
        .await?;
    let count: i64 = sqlx::query_scalar(&q.count).fetch_one(&mut *tx).await?;
    // After the count: the snapshot is taken by then.
    let seen_upto = bound(&mut tx, primary).await?;
    let mut sink = start(count.max(0) as u64);

    let began = Instant::now();
    let mut last_log = began;
    let mut parser = CopyParser::default();
    let mut keys = 0u64;
    {
        let mut stream = tx.copy_out_raw(&q.keys).await?;
        while let Some(chunk) = stream.try_next().await? {
            parser.feed(&chunk, |k| {
                add(&mut sink, k);
                keys += 1;
            })?;
            if last_log.elapsed() >= Duration::from_secs(5) {
                last_log = Instant::now();
                let secs = began.elapsed().as_secs_f64();
                tracing::info!(
                    rows = keys,
                    of = count,
                    rows_per_sec = (keys as f64 / secs) as u64,
                    elapsed = ?began.elapsed(),
                    "streaming keys"
                );
            }
        }
    }
    parser.finish()?;
    tx.commit().await?;
    Ok((sink, keys, seen_upto))
}

/// The position the scan's snapshot saw nothing past, read in `tx` (see
/// [`Db::scan_keys`]): the insert position on the `primary`, the replay
/// position on a replica. `None` where the server refuses it (in recovery:
/// a replica behind the primary's address), which must not fail the
/// scan: under a savepoint.
async fn bound(
    tx: &mut sqlx::Transaction<'_, Postgres>,
    primary: bool,
) -> Result<Option<position::Position>, sqlx::Error> {
    sqlx::query("SAVEPOINT bloomgate_bound")
        .execute(&mut **tx)
        .await?;
    let read = match primary {
        true => position::Server::read(&mut **tx)
            .await
            .map(|(_, reading)| reading.insert),
        false => super::replicas::read_replay(tx).await,
    };
    match read {
        Ok(at) => {
            sqlx::query("RELEASE SAVEPOINT bloomgate_bound")
                .execute(&mut **tx)
                .await?;
            Ok(Some(at))
        }
        Err(_) => {
            sqlx::query("ROLLBACK TO SAVEPOINT bloomgate_bound")
                .execute(&mut **tx)
                .await?;
            Ok(None)
        }
    }
}
