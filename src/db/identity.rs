//! Which server each connection the gateway opens has reached.
//!
//! An address (a DNS name, a proxy, a virtual IP) does not name a server:
//! a blue/green cut-over, an HAProxy reload or a restore elsewhere sends
//! *new* connections to another server while established ones stay where
//! they are. The change feed's connections are established: it keeps
//! following the old server, while pool connections opened since (aged
//! out, or grown under load) reach the new one. Rows loaded there were
//! cached, and the new server's later changes were never heard of: old
//! rows as hits, its inserts 404, all while ready.
//!
//! # The rule
//! The change feed names the server it follows ([`Identity::follow`]):
//! system identifier, timeline and postmaster start time. Every other
//! connection reads the server it reached as it opens
//! ([`Identity::check_primary`]; a replica's pool reads its system and
//! timeline and asks [`Identity::judge_replica`]), and:
//! - a primary's connection must reach that server: the same system,
//!   timeline and start time;
//! - a replica's must be of that system and on that timeline (it has a
//!   start time of its own);
//! - a connection that does not is refused: never used for a row. On a
//!   primary's connection that is a *mismatch*, which the feed hears
//!   ([`Identity::mismatched`]): it ends its session and follows the
//!   address again. Reaching the other server there is a gap (a new
//!   server: everything resynced), and the feed follows it from then on,
//!   so that the connections still on the old server are the ones refused
//!   (without this, after a cut-over every new connection would be refused
//!   while the feed stayed on the old server);
//! - a connection opened before the followed server last changed is
//!   closed before its next use ([`Identity::opened_before_change`], by its
//!   age): it may be on the old server;
//! - the address itself is asked every [`ADDRESS_EVERY`] on a connection
//!   of its own ([`Identity::watch_address`], `application_name`
//!   `bloomgate-address`): another server there is a mismatch as a
//!   primary's connection's is. Without it, a gateway whose reads all hit
//!   its cache opens no connection after a cut-over: its feed stays on the
//!   old server, and the new server's changes are never heard of for as
//!   long as the old one lives. So a cut-over that leaves the old server
//!   up is followed within `ADDRESS_EVERY` plus `ADDRESS_WITHIN` and a
//!   feed's restart, whatever the load (behind a pooler, once the pooler's
//!   own server connections reach the new server).
//!
//! Until a feed follows anything (start-up, `freshness = "off"`), every
//! connection is accepted: nothing is cached or vouched for from a
//! connection before the feed's first session, and without a feed there is
//! no server to compare with.
//!
//! # Guarantees (tested below)
//! - A connection is accepted only if no server is followed, or it reached
//!   the followed one (a replica: its system and timeline).
//! - A refused primary connection is recorded as a mismatch, taken once,
//!   and as a refusal [`Identity::refused_within`] reports: a pool that
//!   timed out meanwhile reached a server, so the database is not
//!   unreachable (`db::outage`), and nothing vouched for on the old server
//!   is answered as stale.
//! - A connection older than the last change of the followed server is
//!   old; one opened after it is not. Following the same server again is
//!   no change.
//! - The look at the address records another server as a mismatch (which
//!   wakes the feed), not as a refusal; the followed server, a standby or
//!   no answer records nothing (`tests/it/db/failover.rs`
//!   `a_cut_over_no_pool_connection_reaches_is_followed` on real servers).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{LazyLock, Mutex};
use std::time::{Duration, Instant};

use sqlx::PgConnection;

use super::position::{Server, Timeline};

/// How often [`Identity::watch_address`] asks where the address leads: one
/// new connection per gateway per interval (with TLS, a handshake), the
/// price of following a cut-over that no connection of the pool reached.
pub const ADDRESS_EVERY: Duration = Duration::from_secs(5);

/// How long that look may take: a server that has not answered by then
/// says nothing this time (the next look comes one interval after this
/// one began).
pub const ADDRESS_WITHIN: Duration = Duration::from_secs(2);

/// The look's `application_name`, so that `pg_stat_activity` and the
/// server's log tell it from the pool's connections.
pub const ADDRESS_APPLICATION_NAME: &str = "bloomgate-address";

/// The server `connect` reaches now and its reading, on a connection of
/// its own closed at once, if it answers within `within` (a standby does
/// not: it cannot say where its WAL is inserted).
pub async fn where_the_address_leads(
    connect: &sqlx::postgres::PgConnectOptions,
    within: Duration,
) -> Option<(Server, super::position::Reading)> {
    use sqlx::Connection;
    let read = async {
        let mut conn = PgConnection::connect_with(connect).await?;
        let read = Server::read(&mut conn).await;
        let _ = conn.close().await;
        read
    };
    tokio::time::timeout(within, read).await.ok()?.ok()
}

/// The instant [`Identity`]'s moments count from.
static BASE: LazyLock<Instant> = LazyLock::new(Instant::now);

/// What connections are held to; one per gateway, shared by its pools and
/// its feed.
#[derive(Debug, Default)]
pub struct Identity {
    followed: Mutex<Option<Server>>,
    /// Nanoseconds after [`BASE`] of the last change of the followed
    /// server, plus one (0: never changed).
    changed: AtomicU64,
    /// The last server a primary's connection reached that is not the
    /// followed one, until the feed takes it.
    mismatch: Mutex<Option<Server>>,
    wake: tokio::sync::Notify,
    /// Connections refused so far (metrics).
    pub refused: AtomicU64,
    /// Nanoseconds after [`BASE`] of the last refused primary connection,
    /// plus one (0: none yet).
    last_refused: AtomicU64,
}

/// Nanoseconds since [`BASE`].
fn since_base() -> u64 {
    u64::try_from(Instant::now().saturating_duration_since(*BASE).as_nanos())
        .unwrap_or(u64::MAX - 1)
}

/// Why a connection was refused; the message names both servers.
fn refusal(what: &str, change: &str) -> sqlx::Error {
    sqlx::Error::Protocol(format!(
        "{what} reached another server than the one the change feed follows ({change}): not used"
    ))
}

impl Identity {
    /// The change feed follows `server` from now on.
    pub fn follow(&self, server: Server) {
        let mut followed = self.followed.lock().unwrap_or_else(|p| p.into_inner());
        if *followed != Some(server) {
            let now = Instant::now().saturating_duration_since(*BASE).as_nanos();
            self.changed.store(
                u64::try_from(now).unwrap_or(u64::MAX - 1) + 1,
                Ordering::Release,
            );
            *followed = Some(server);
        }
        let mut m = self.mismatch.lock().unwrap_or_else(|p| p.into_inner());
        if m.is_some_and(|found| found == server) {
            *m = None;
        }
    }

    /// Whether a primary's connection was refused within the last `d`: a
    /// pool that timed out meanwhile reached a server, just not the one
    /// followed, so the database is not unreachable (no outage, no stale
    /// answers from what was vouched for on the old server).
    pub fn refused_within(&self, d: Duration) -> bool {
        match self.last_refused.load(Ordering::Acquire) {
            0 => false,
            at => u128::from(since_base()).saturating_sub(u128::from(at - 1)) <= d.as_nanos(),
        }
    }

    /// The server the feed follows, if any yet.
    pub fn followed(&self) -> Option<Server> {
        *self.followed.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether a connection `age` old was opened before the followed server
    /// last changed (so it may be on the old one).
    pub fn opened_before_change(&self, age: Duration) -> bool {
        let changed = self.changed.load(Ordering::Acquire);
        if changed == 0 {
            return false;
        }
        let since = Instant::now()
            .saturating_duration_since(*BASE)
            .as_nanos()
            .saturating_sub(u128::from(changed - 1));
        age.as_nanos() >= since
    }

    /// A server a primary's connection reached, other than the followed
    /// one, once: what the feed follows next, if the address says so.
    pub fn take_mismatch(&self) -> Option<Server> {
        self.mismatch
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }

    /// Resolves once a primary's connection has been refused since the
    /// last [`Identity::take_mismatch`] (at once if one is waiting).
    pub async fn mismatched(&self) {
        loop {
            let woken = self.wake.notified();
            if self
                .mismatch
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .is_some()
            {
                return;
            }
            woken.await;
        }
    }

    /// Judges a primary's connection that reached `found`.
    pub fn judge_primary(&self, found: Server) -> Result<(), sqlx::Error> {
        let Some(followed) = self.followed() else {
            return Ok(());
        };
        let Some(change) = found.change_from(&followed) else {
            return Ok(());
        };
        self.refused.fetch_add(1, Ordering::Relaxed);
        self.last_refused.store(since_base() + 1, Ordering::Release);
        self.mismatch_found(found);
        Err(refusal("a connection to the primary", &change))
    }

    /// `found` is where the feed should look next: recorded, the feed woken.
    fn mismatch_found(&self, found: Server) {
        *self.mismatch.lock().unwrap_or_else(|p| p.into_inner()) = Some(found);
        self.wake.notify_waiters();
    }

    /// Judges a replica's connection on `found` (its system and timeline).
    pub fn judge_replica(&self, found: Timeline) -> Result<(), sqlx::Error> {
        let Some(followed) = self.followed() else {
            return Ok(());
        };
        let ours = followed.timeline;
        // A system identifier the role could not read (0) compares on
        // the timeline alone, as positions do.
        let system = found.system == ours.system || found.system == 0 || ours.system == 0;
        if system && found.id == ours.id {
            return Ok(());
        }
        self.refused.fetch_add(1, Ordering::Relaxed);
        Err(refusal(
            "a connection to a read replica",
            &format!("it is on {found}, the primary on {ours}"),
        ))
    }

    /// Asks where `connect` leads every `every` until `shutdown`, on a
    /// connection of its own (bounded by [`ADDRESS_WITHIN`]), while a feed
    /// follows a server: another server is a mismatch the feed hears (see
    /// the module doc), not a refusal (nothing was refused a row; the
    /// outage's "a server answered" counts the pool's connections only).
    /// A server that does not answer, or is a standby, says nothing here:
    /// the feed's own connections and `outage` judge those. Said in the log
    /// once per server found.
    pub async fn watch_address(
        self: std::sync::Arc<Self>,
        connect: sqlx::postgres::PgConnectOptions,
        every: Duration,
        mut shutdown: crate::shutdown::Shutdown,
    ) {
        let connect = connect.application_name(ADDRESS_APPLICATION_NAME);
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut said: Option<Server> = None;
        loop {
            tokio::select! {
                () = shutdown.fired() => return,
                _ = tick.tick() => {}
            }
            let Some(followed) = self.followed() else {
                continue;
            };
            let found = tokio::select! {
                () = shutdown.fired() => return,
                r = where_the_address_leads(&connect, ADDRESS_WITHIN) => match r {
                    Some((found, _)) => found,
                    None => continue,
                },
            };
            let Some(change) = found.change_from(&followed) else {
                continue;
            };
            self.mismatch_found(found);
            if said != Some(found) {
                said = Some(found);
                tracing::info!(
                    change = %change,
                    "the database's address leads to another server than the one the change feed follows: the feed is told to follow it"
                );
            }
        }
    }

    /// Reads the server a new primary connection reached and judges it
    /// (the pool's `after_connect`).
    pub async fn check_primary(&self, conn: &mut PgConnection) -> Result<(), sqlx::Error> {
        if self.followed().is_none() {
            return Ok(());
        }
        let (found, _) = Server::read(conn).await?;
        self.judge_primary(found)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server(system: u64, id: u32, started_us: i64) -> Server {
        Server {
            timeline: Timeline { system, id },
            started_us,
        }
    }

    #[test]
    fn connections_are_held_to_the_followed_server() {
        let i = Identity::default();
        assert!(i.judge_primary(server(8, 1, 5)).is_ok(), "nothing followed");
        assert!(i.judge_replica(Timeline { system: 8, id: 1 }).is_ok());
        i.follow(server(7, 1, 5));
        assert!(i.judge_primary(server(7, 1, 5)).is_ok());
        assert_eq!(i.take_mismatch(), None);
        assert!(
            !i.refused_within(Duration::from_secs(3600)),
            "none refused yet"
        );
        for other in [server(8, 1, 5), server(7, 2, 5), server(7, 1, 6)] {
            let e = i.judge_primary(other).unwrap_err().to_string();
            assert!(e.contains("another server"), "{e}");
            assert_eq!(i.take_mismatch(), Some(other));
            assert_eq!(i.take_mismatch(), None, "taken once");
        }
        assert_eq!(i.refused.load(Ordering::Relaxed), 3);
        assert!(i.refused_within(Duration::from_secs(3600)));
        std::thread::sleep(Duration::from_millis(5));
        assert!(!i.refused_within(Duration::from_millis(1)), "only lately");
        // A replica: its own start time, the primary's system and timeline.
        assert!(i.judge_replica(Timeline { system: 7, id: 1 }).is_ok());
        assert!(i.judge_replica(Timeline { system: 0, id: 1 }).is_ok());
        assert!(i.judge_replica(Timeline { system: 7, id: 2 }).is_err());
        assert!(i.judge_replica(Timeline { system: 9, id: 1 }).is_err());
        assert_eq!(i.take_mismatch(), None, "a replica is not the feed's");
    }

    #[test]
    fn connections_older_than_a_change_are_old() {
        let i = Identity::default();
        assert!(!i.opened_before_change(Duration::from_secs(3600)));
        i.follow(server(7, 1, 5));
        assert!(i.opened_before_change(Duration::from_secs(3600)));
        std::thread::sleep(Duration::from_millis(20));
        assert!(
            !i.opened_before_change(Duration::from_millis(5)),
            "opened since"
        );
        assert!(i.opened_before_change(Duration::from_millis(500)));
        // The same server again: no change.
        i.follow(server(7, 1, 5));
        assert!(!i.opened_before_change(Duration::from_millis(5)));
        // Following the mismatched server clears it.
        let _ = i.judge_primary(server(8, 1, 5));
        i.follow(server(8, 1, 5));
        assert_eq!(i.take_mismatch(), None);
        assert!(i.opened_before_change(Duration::from_millis(5)));
    }

    #[test]
    fn the_address_look_records_a_mismatch_not_a_refusal() {
        let i = Identity::default();
        i.follow(server(7, 1, 5));
        i.mismatch_found(server(8, 1, 5));
        assert_eq!(i.take_mismatch(), Some(server(8, 1, 5)));
        assert_eq!(i.refused.load(Ordering::Relaxed), 0);
        assert!(!i.refused_within(Duration::from_secs(3600)));
    }

    #[tokio::test]
    async fn a_mismatch_wakes_the_feed() {
        let i = std::sync::Arc::new(Identity::default());
        i.follow(server(7, 1, 5));
        let waiting = tokio::spawn({
            let i = i.clone();
            async move { i.mismatched().await }
        });
        tokio::task::yield_now().await;
        let _ = i.judge_primary(server(8, 1, 5));
        tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("woken")
            .unwrap();
        // Waiting: at once.
        tokio::time::timeout(Duration::from_secs(5), i.mismatched())
            .await
            .expect("at once");
    }
}
