//! Whether the primary answers at all, asked when the pool cannot tell a
//! hung server from a busy one: a pool whose connections are all in use
//! times out the same way whether the server is slow or frozen (SIGSTOP, a
//! network that drops packets without a reset, a proxy whose backend went
//! away), and a query on a connection to a frozen server waits until TCP
//! gives up (`tcp_retries2`, about 15 minutes).
//!
//! *Hung* is defined from outside the pool: a new connection, and `SELECT
//! 1` on it, not both done within `database.acquire_timeout`. A server
//! that does both in time is *busy*, not down, however long the pool's
//! queries wait (`docs/src/failover.md`): the gateway keeps asking it.
//! A server that refuses the login answers too (an outage is the server
//! unreachable, see `outage`).
//!
//! # Guarantees (tested below)
//! - A frozen server (one that accepts a connection and never answers) is
//!   hung; a closed port is hung (nothing answers there); a server that
//!   answers `SELECT 1` is not.
//! - One probe at a time: callers that arrive while one runs wait for its
//!   verdict, and a verdict younger than [`outage::TRY_EVERY`] is reused,
//!   so that a flood of timed-out loads costs the server one connection
//!   per interval, not one per request.

use std::time::{Duration, Instant};

use sqlx::Connection;
use sqlx::postgres::{PgConnectOptions, PgConnection};

use super::outage;

/// The last verdict, shared by the callers of one pool.
#[derive(Debug, Default)]
pub struct Reach {
    last: tokio::sync::Mutex<Option<(Instant, bool)>>,
}

impl Reach {
    /// Whether the server at `connect` answers within `within` (see the
    /// module doc); the verdict of a probe that ran within the last
    /// [`outage::TRY_EVERY`] if there is one.
    pub async fn answers(&self, connect: &PgConnectOptions, within: Duration) -> bool {
        let mut last = self.last.lock().await;
        if let Some((at, answered)) = *last
            && at.elapsed() < outage::TRY_EVERY
        {
            return answered;
        }
        let answered = probe(connect, within).await;
        *last = Some((Instant::now(), answered));
        answered
    }
}

/// A new connection and `SELECT 1` on it, within `within` as a whole.
async fn probe(connect: &PgConnectOptions, within: Duration) -> bool {
    let asked = async {
        let mut conn = PgConnection::connect_with(connect).await?;
        let r = sqlx::query("SELECT 1").execute(&mut conn).await.map(|_| ());
        // Closed at once: a probe holds nothing of the server's.
        let _ = conn.close().await;
        r
    };
    match tokio::time::timeout(within, asked).await {
        Err(_) => false,
        Ok(Ok(())) => true,
        // The server said no (a refused login, too many connections): it
        // answers.
        Ok(Err(e)) => !outage::is_unreachable(&e, 0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn options(port: u16) -> PgConnectOptions {
        PgConnectOptions::new()
            .host("127.0.0.1")
            .port(port)
            .username("postgres")
            .database("postgres")
    }

    /// A server that accepts connections and never says a word, as a
    /// frozen postmaster does (the kernel completes the handshake); counts
    /// the connections it took.
    async fn frozen() -> (u16, Arc<AtomicUsize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let taken = Arc::new(AtomicUsize::new(0));
        let count = taken.clone();
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((s, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                held.push(s);
            }
        });
        (port, taken)
    }

    #[tokio::test]
    async fn a_frozen_server_and_a_closed_port_are_hung() {
        let (port, _) = frozen().await;
        assert!(!probe(&options(port), Duration::from_millis(300)).await);
        let closed = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        assert!(!probe(&options(closed), Duration::from_millis(300)).await);
    }

    /// The test database's server (scripts/test.sh sets its URL).
    #[tokio::test]
    async fn a_server_that_answers_is_not_hung() {
        let url = std::env::var("BLOOMGATE_TEST_DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
        let opts: PgConnectOptions = url.parse().unwrap();
        assert!(probe(&opts, Duration::from_secs(10)).await);
        // A wrong password is an answer too.
        let refused = opts.clone().username("bloomgate_no_such_role");
        assert!(probe(&refused, Duration::from_secs(10)).await);
    }

    #[tokio::test]
    async fn one_probe_at_a_time_and_a_fresh_verdict_is_reused() {
        let (port, taken) = frozen().await;
        let reach = Arc::new(Reach::default());
        let opts = options(port);
        let asks: Vec<_> = (0..8)
            .map(|_| {
                let (reach, opts) = (reach.clone(), opts.clone());
                tokio::spawn(async move { reach.answers(&opts, Duration::from_millis(200)).await })
            })
            .collect();
        for a in asks {
            assert!(!a.await.unwrap());
        }
        assert_eq!(
            taken.load(Ordering::SeqCst),
            1,
            "one connection for eight callers"
        );
        tokio::time::sleep(outage::TRY_EVERY).await;
        assert!(!reach.answers(&opts, Duration::from_millis(200)).await);
        assert_eq!(
            taken.load(Ordering::SeqCst),
            2,
            "asked again once the verdict aged"
        );
    }
}
