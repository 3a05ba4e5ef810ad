//! The accept loop of each listener and the connections it serves: a cap
//! on open connections (at the cap the listener is not polled, so new ones
//! wait in the kernel's backlog), back-off when `accept` fails, the
//! backlog taken at the close, hyper's settings, and each connection
//! handed to its watchdog (`conn`).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};

use super::conn;
use crate::config::ServerConfig;
use crate::http;
use crate::shutdown::Shutdown;
use crate::telemetry::LogThrottle;
use crate::traffic::Traffic;

/// Accepts connections until `stop`; then takes every connection already
/// waiting in the listen backlog, closes the listener (a connection
/// attempted later is refused, never taken and dropped), and waits for the
/// open connections to end: each that has not sent its first request has
/// `conn::GRACE` to send it, and every request begun is answered (see
/// "Server shutdown" in `conn`). Built on hyper directly rather than
/// `axum::serve` for the limits a listener exposed to anyone needs:
/// - each connection is watched ([`conn`]): a first request within
///   `header_read_timeout` whatever the protocol, each later HTTP/1 head
///   within it too, closed after `idle_timeout` with no request in progress;
///   HTTP/2 PINGs a silent peer after `header_read_timeout` and closes the
///   connection if the PING is not answered within it either;
/// - at most `max_connections` open: at the cap the listener is not polled,
///   so new connections wait in the kernel's listen backlog (as HAProxy's
///   `maxconn` and nginx's `worker_connections` do) instead of being taken
///   and dropped: no descriptor is spent on them, no accept-and-close loop
///   spins under a flood, and a client that arrives while silent sockets
///   hold every slot is served as soon as they time out;
/// - a failing `accept` (out of descriptors, buffers) backs off, doubling
///   from 10 ms to 1 s, and is logged once per 10 s;
/// - header size and count limits, and `TCP_NODELAY`.
///
/// `name` tells the listeners apart in logs. Each listener has its own
/// cap, so a flood of the public address cannot lock the operator out of
/// the admin listener.
pub(super) async fn accept_loop(
    listener: TcpListener,
    app: http::App,
    cfg: ServerConfig,
    stop: Shutdown,
    drain: watch::Receiver<bool>,
    Listener {
        name,
        traffic,
        max_connections,
    }: Listener,
) {
    let builder = Arc::new(http_builder(&cfg));
    let limits = conn::Limits {
        header_read: cfg.header_read_timeout,
        idle: cfg.idle_timeout,
    };
    // Validated to fit a u32, the unit of `acquire_many`.
    let cap = u32::try_from(max_connections.min(Semaphore::MAX_PERMITS)).unwrap_or(u32::MAX);
    let slots = Arc::new(Semaphore::new(cap as usize));
    let at_cap = LogThrottle::default();
    let failing = LogThrottle::default();
    let mut backoff = Backoff::default();
    let mut stop_rx = stop.clone();
    let stopped = async move { stop_rx.fired().await };
    tokio::pin!(stopped);
    let serve = |stream: TcpStream, slot| {
        let _ = stream.set_nodelay(true);
        tokio::spawn(serve_connection(
            stream,
            app.clone(),
            builder.clone(),
            limits,
            (drain.clone(), stop.clone()),
            (slot, Open::new(traffic.clone())),
        ));
    };
    loop {
        let slot = match slots.clone().try_acquire_owned() {
            Ok(slot) => slot,
            Err(_) => {
                if let Some(not_logged) = at_cap.permit() {
                    // The public listener's cap is the operator's key; the
                    // admin and metrics listeners' is fixed.
                    let cap = if name == "public" {
                        "server.max_connections"
                    } else {
                        "the operator listeners' own cap"
                    };
                    tracing::warn!(
                        listener = name,
                        max_connections,
                        not_logged,
                        "connection cap reached ({cap}): new connections wait in the listen \
                         backlog (at most one such line per 10 s)"
                    );
                }
                tokio::select! {
                    // The stop first: a slot freed by the stop itself (a
                    // connection closed idle) must not take a connection
                    // through this path once stopped; the backlog's are
                    // taken below.
                    biased;
                    () = &mut stopped => break,
                    slot = slots.clone().acquire_owned() => {
                        slot.expect("the semaphore is never closed")
                    }
                }
            }
        };
        let accepted = tokio::select! {
            biased;
            () = &mut stopped => break,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, _)) => {
                backoff.reset();
                serve(stream, slot);
            }
            // The peer gave up between its handshake and our accept: nothing
            // is wrong on this side.
            Err(e) if is_connection_error(&e) => {}
            // Out of descriptors and the like: the pending connection stays
            // in the backlog, so retrying at once would fail again at once.
            // Back off, keep serving the open connections (whose deadlines
            // free descriptors), and say so once per interval, not per
            // failure.
            Err(e) => {
                let delay = backoff.next_delay();
                if let Some(not_logged) = failing.permit() {
                    tracing::warn!(
                        listener = name,
                        error = %e,
                        retry_in_s = delay.as_secs_f64(),
                        not_logged,
                        "accept failed; backing off (at most one such line per 10 s; \
                         not_logged counts the rest)"
                    );
                }
                tokio::select! {
                    () = tokio::time::sleep(delay) => {}
                    () = &mut stopped => break,
                }
            }
        }
    }
    // Stopped. Every connection in the listen backlog has completed its
    // handshake, so its client holds it as open and may have sent a request
    // on it already; closing the listener would reset them all. So they are
    // taken first, as many as the backlog holds, past the cap if need be
    // (each is bounded by the first-request grace, then by its request:
    // see "Server shutdown" in `conn`), and served as any other; then the
    // listener closes and new connections are refused.
    let mut past_cap = 0u32;
    for stream in backlog(listener, name) {
        let slot = match slots.clone().try_acquire_owned() {
            Ok(slot) => slot,
            Err(_) => {
                slots.add_permits(1);
                past_cap = past_cap.saturating_add(1);
                slots
                    .clone()
                    .try_acquire_owned()
                    .expect("a permit was just added, and nothing else waits for one")
            }
        };
        serve(stream, slot);
    }
    // Every slot back means every connection has ended.
    let _ = slots.acquire_many(cap.saturating_add(past_cap)).await;
}

/// Takes what `listener`'s backlog holds now, without waiting, then closes
/// the listener. `accept` is called directly until the kernel says
/// `WouldBlock`: tokio's `accept` would not call it again until its
/// reactor has seen the listener readable, and a connection completed
/// since its last poll would be left behind. A handshake the kernel
/// completes between the last `accept` and the close (a short window, wider
/// when the host is loaded and its network processing deferred) is still
/// reset, as at any listener's close; only a socket filter dropping new
/// SYNs for a while before the last `accept` would close that window.
fn backlog(listener: TcpListener, name: &'static str) -> Vec<TcpStream> {
    let listener = match listener.into_std() {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!(listener = name, error = %e, "cannot take the listen backlog at the close");
            return Vec::new();
        }
    };
    let mut taken = Vec::new();
    loop {
        match listener.accept() {
            Ok((stream, _)) => {
                match stream
                    .set_nonblocking(true)
                    .and_then(|()| TcpStream::from_std(stream))
                {
                    Ok(stream) => taken.push(stream),
                    Err(e) => tracing::debug!(error = %e, "a connection of the backlog dropped"),
                }
            }
            Err(e) if is_connection_error(&e) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            // Out of descriptors: what is left is reset at the close.
            Err(e) => {
                tracing::warn!(
                    listener = name,
                    error = %e,
                    "accept failed at the close: the connections left in the listen backlog are reset"
                );
                break;
            }
        }
    }
    taken
}

/// hyper's settings for both protocols.
fn http_builder(cfg: &ServerConfig) -> Builder<TokioExecutor> {
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        // Off: the watchdog times request heads. hyper's timer starts the
        // moment a kept-alive connection turns idle, so it would also cut
        // idle connections at `header_read_timeout`.
        .header_read_timeout(None)
        .max_buf_size(cfg.max_header_bytes);
    if cfg.max_headers != crate::config::DEFAULT_MAX_HEADERS {
        builder.http1().max_headers(cfg.max_headers);
    }
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_header_list_size(u32::try_from(cfg.max_header_bytes).unwrap_or(u32::MAX))
        // A peer silent for `header_read_timeout` is PINGed and must answer
        // within as long: a dead peer is found while a request is in
        // progress too, when no idle deadline runs.
        .keep_alive_interval(cfg.header_read_timeout)
        .keep_alive_timeout(cfg.header_read_timeout);
    builder
}

/// Which listener, for logs, and where its traffic is counted (the public
/// one's).
pub(super) struct Listener {
    pub(super) name: &'static str,
    pub(super) traffic: Option<Arc<Traffic>>,
    /// Its connection cap: `server.max_connections` for the public
    /// listener, [`operator_cap`] for the admin and metrics listeners.
    pub(super) max_connections: usize,
}

/// Connections the admin and the metrics listener each take at most: an
/// operator, a scraper and a status page need a handful, and a cap of
/// their own keeps a flood of the public address from locking them out.
/// Not `server.max_connections`: with it, the shipped defaults (10,000)
/// needed 20,080 descriptors with the admin listener on, past the 20,000
/// many hosts allow.
pub(super) const OPERATOR_MAX_CONNECTIONS: usize = 256;

pub(super) fn operator_cap(cfg: &ServerConfig) -> usize {
    cfg.max_connections.min(OPERATOR_MAX_CONNECTIONS)
}

/// One open connection, counted in `Traffic::connections` until dropped.
struct Open(Option<Arc<Traffic>>);

impl Open {
    fn new(traffic: Option<Arc<Traffic>>) -> Self {
        if let Some(t) = &traffic {
            t.connections.fetch_add(1, Ordering::Relaxed);
        }
        Self(traffic)
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        if let Some(t) = &self.0 {
            t.connections.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// Serves one connection under its watchdog; `slot` is its place under
/// `max_connections`, given back when the socket is closed.
async fn serve_connection(
    stream: TcpStream,
    app: http::App,
    builder: Arc<Builder<TokioExecutor>>,
    limits: conn::Limits,
    (drain, stop): (watch::Receiver<bool>, Shutdown),
    slot: (OwnedSemaphorePermit, Open),
) {
    let dog = conn::Watchdog::new(limits);
    let peer = stream.peer_addr().ok().map(|a| a.ip());
    let io = TokioIo::new(conn::Watched::new(stream, dog.clone()));
    let service = conn::Tracked::new(app, dog.clone(), peer);
    let connection = builder.serve_connection_with_upgrades(io, service);
    match conn::drive(connection, &dog, drain, stop).await {
        conn::Ended::Done(Ok(())) => {}
        conn::Ended::Done(Err(e)) => {
            // hyper answers a request head over the limits 431 itself and
            // ends the connection with this error.
            if let Some(t) = &slot.1.0
                && e.downcast_ref::<hyper::Error>()
                    .is_some_and(hyper::Error::is_parse_too_large)
            {
                t.header_too_large.fetch_add(1, Ordering::Relaxed);
            }
            tracing::debug!(error = %e, "connection closed with an error");
        }
        conn::Ended::Expired(why) => tracing::debug!(reason = %why, "connection closed"),
    }
}

/// Errors of one pending connection rather than of the listener.
fn is_connection_error(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::ConnectionRefused
            | std::io::ErrorKind::ConnectionAborted
            | std::io::ErrorKind::ConnectionReset
    )
}

/// The delay before retrying a failed `accept`: doubling from
/// [`Backoff::FIRST`] up to [`Backoff::MAX`], back to the start after a
/// success.
#[derive(Debug, Default)]
struct Backoff {
    next: Option<Duration>,
}

impl Backoff {
    const FIRST: Duration = Duration::from_millis(10);
    const MAX: Duration = Duration::from_secs(1);

    fn next_delay(&mut self) -> Duration {
        let delay = self.next.unwrap_or(Self::FIRST);
        self.next = Some((delay * 2).min(Self::MAX));
        delay
    }

    fn reset(&mut self) {
        self.next = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accept_backoff_doubles_to_a_cap_and_restarts_after_a_success() {
        let mut b = Backoff::default();
        let delays: Vec<_> = (0..9).map(|_| b.next_delay().as_millis()).collect();
        assert_eq!(delays, [10, 20, 40, 80, 160, 320, 640, 1000, 1000]);
        b.reset();
        assert_eq!(b.next_delay(), Backoff::FIRST);
    }
}
