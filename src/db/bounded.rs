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
//! - A connection whose query did not finish (abandoned here, or its
//!   request dropped at its deadline) is closed, never returned to the
//!   pool: sqlx pings a returned connection without a bound, and a hung
//!   one would hold its pool slot for as long as TCP waits, shrinking the
//!   pool under the very outage it should ride through.

use sqlx::Postgres;
use sqlx::pool::PoolConnection;

use super::Db;

/// The error of a query abandoned because the server does not answer.
pub(super) fn hung() -> sqlx::Error {
    sqlx::Error::Io(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        "the database does not answer (a new connection and SELECT 1 not done within database.acquire_timeout)",
    ))
}

/// A pool connection closed when dropped, unless [`Guard::finish`] saw
/// its query end with an answer.
pub(super) struct Guard(pub PoolConnection<Postgres>, bool);

impl Guard {
    /// Keeps the connection for the pool if `r` is a complete answer (a
    /// row, or the server's error): a timeout or a socket error leaves the
    /// connection in an unknown state.
    pub fn finish<T>(&mut self, r: &Result<T, sqlx::Error>) {
        self.1 = !matches!(r, Err(sqlx::Error::Io(_) | sqlx::Error::Protocol(_)));
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if !self.1 {
            self.0.close_on_drop();
        }
    }
}

impl Db {
    /// A connection of the pool for [`Db::bounded`].
    pub(super) async fn acquire_guarded(&self) -> Result<Guard, sqlx::Error> {
        let conn = self.stats.acquiring(self.pool.acquire()).await?;
        Ok(Guard(conn, false))
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
