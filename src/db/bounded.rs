//! A query on a pool connection of the primary, bounded against a server
//! that hangs: the request path's loads and the periodic check go through
//! it, so that a frozen server is an outage from the first query that
//! finds it, not after TCP gives up.
//!
//! # Guarantees
//! - A query not answered within `acquire_timeout` has the server asked
//!   from outside the pool ([`super::reach`]) while it goes on waiting:
//!   hung, the query is abandoned at once and the outage begins
//!   (`outage`); busy, the query waits on, up to `statement_timeout +
//!   acquire_timeout` (the server cancels it at `statement_timeout`, so a
//!   connection silent past that is hung itself).
//!   So a query waits at most `statement_timeout + 2 × acquire_timeout`
//!   (the first interval, then the probe's own).
//! - A connection never goes back to the pool in an unknown state, nor
//!   holds its slot unbounded: sqlx pings a returned connection without a
//!   bound, and a hung one would hold its slot for as long as TCP waits,
//!   shrinking the pool under the very outage it should ride through. One
//!   whose query failed without an answer (given up here, a socket error)
//!   is closed. One whose request went away mid-query (a client gone, the
//!   request's deadline) is still the pool's until the query ends: it goes
//!   back if it answers a ping within `statement_timeout + acquire_timeout`
//!   (the server ends the query by then), else it is closed, so that
//!   `pool_size` still bounds the queries running on the server.

use sqlx::pool::PoolConnection;
use sqlx::{Connection, Postgres};

use super::Db;

/// The error of a query abandoned because the server does not answer.
pub(super) fn hung() -> sqlx::Error {
    sqlx::Error::Io(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        "the database does not answer (a new connection and SELECT 1 not done within database.acquire_timeout)",
    ))
}

/// A pool connection and what became of its query (see the module doc).
pub(super) struct Guard {
    conn: Option<PoolConnection<Postgres>>,
    state: Query,
    /// How long a connection whose request went away may take to answer a
    /// ping before it is closed.
    settle: std::time::Duration,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Query {
    /// Not finished: its request went away if the guard drops now.
    Running,
    /// A complete answer: a row, or the server's error.
    Answered,
    /// No answer: a timeout or a socket error.
    Broken,
}

impl Guard {
    pub fn conn(&mut self) -> &mut sqlx::PgConnection {
        self.conn.as_mut().expect("held until dropped")
    }

    /// What `r` says of the connection's state.
    pub fn finish<T>(&mut self, r: &Result<T, sqlx::Error>) {
        self.state = match r {
            Err(sqlx::Error::Io(_) | sqlx::Error::Protocol(_)) => Query::Broken,
            _ => Query::Answered,
        };
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        let Some(mut conn) = self.conn.take() else {
            return;
        };
        match (self.state, tokio::runtime::Handle::try_current()) {
            (Query::Answered, _) => {}
            (Query::Running, Ok(rt)) => {
                let settle = self.settle;
                rt.spawn(async move {
                    // sqlx waits for the query's end before the ping.
                    if !matches!(tokio::time::timeout(settle, conn.ping()).await, Ok(Ok(()))) {
                        conn.close_on_drop();
                    }
                });
            }
            _ => conn.close_on_drop(),
        }
    }
}

impl Db {
    /// A connection of the pool for [`Db::bounded`].
    pub(super) async fn acquire_guarded(&self) -> Result<Guard, sqlx::Error> {
        let conn = self.stats.acquiring(self.pool.acquire()).await?;
        Ok(Guard {
            conn: Some(conn),
            state: Query::Running,
            settle: self.query_deadline,
        })
    }

    /// `run` (a query on a [`Guard`]'s connection) within the bounds
    /// above.
    pub(super) async fn bounded<T>(
        &self,
        run: impl Future<Output = Result<T, sqlx::Error>>,
    ) -> Result<T, sqlx::Error> {
        let acquire_timeout = self.pool.options().get_acquire_timeout();
        let mut run = std::pin::pin!(run);
        tokio::select! {
            r = &mut run => return r,
            () = tokio::time::sleep(acquire_timeout) => {}
        }
        tokio::select! {
            r = &mut run => r,
            answered = self.judge_by_probe() => {
                if !answered {
                    return Err(hung());
                }
                let rest = self.query_deadline.saturating_sub(acquire_timeout);
                match tokio::time::timeout(rest, run).await {
                    Ok(r) => r,
                    Err(_) => Err(sqlx::Error::Protocol(
                        "no answer on this connection within database.statement_timeout + acquire_timeout while the server answers others".into(),
                    )),
                }
            }
        }
    }
}
