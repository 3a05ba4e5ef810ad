//! How many gateways of a fleet may follow the WAL themselves while the
//! bus is not current (`bus.max_direct_fallback`): each direct feed is a
//! walsender decoding the whole WAL on the primary, and a fleet of a
//! hundred falling back at once is the load the bus exists to prevent
//! (and past `max_wal_senders`, refused anyway).
//!
//! A gateway falls back only while it holds a *ticket*: one of `max`
//! session advisory locks (class [`CLASS`], keys `0..max`) on a connection
//! of its own to the primary. Postgres arbitrates: no lease, no clock, and
//! a gateway that dies (or whose connection is cut) releases its ticket
//! with its session. A gateway without one follows nothing: its resources
//! are not vouched for and answer from the database (within
//! `filter.verify_budget` for keys the filter rejects), and it tries again
//! for a ticket, and the bus, every second.
//!
//! # Guarantees (tested in `tests/it/feed/bus.rs`)
//! - At most `max` tickets are held at once, whatever the number of
//!   gateways asking (the lock manager's, per key).
//! - A ticket is held exactly as long as its [`Ticket`] lives: dropped, its
//!   connection closes and the lock with it.

use sqlx::postgres::{PgConnectOptions, PgConnection};
use sqlx::{ConnectOptions, Connection};

/// The advisory locks' first key: "bgfb".
pub const CLASS: i32 = 0x6267_6662;

/// A held ticket (see the module doc).
pub struct Ticket {
    conn: PgConnection,
    pub number: i32,
}

impl Ticket {
    /// One of the `max` tickets, if any is free; `None` also when the
    /// primary cannot be reached (no ticket can be proven free).
    pub async fn take(connect: &PgConnectOptions, max: u32) -> Option<Ticket> {
        if max == 0 {
            return None;
        }
        let opts = connect
            .clone()
            .application_name("bloomgate-bus-fallback")
            .disable_statement_logging();
        let fut = PgConnection::connect_with(&opts);
        let mut conn = tokio::time::timeout(std::time::Duration::from_secs(5), fut)
            .await
            .ok()?
            .ok()?;
        for n in 0..i32::try_from(max).unwrap_or(i32::MAX) {
            let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1, $2)")
                .bind(CLASS)
                .bind(n)
                .fetch_one(&mut conn)
                .await
                .ok()?;
            if got {
                return Some(Ticket { conn, number: n });
            }
        }
        let _ = conn.close().await;
        None
    }

    /// Gives the ticket back.
    pub async fn release(self) {
        let _ = self.conn.close().await;
    }

    /// Whether the session holding it is still there (a cut connection
    /// has lost its lock).
    pub async fn held(&mut self) -> bool {
        self.conn.ping().await.is_ok()
    }
}
