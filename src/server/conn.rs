//! One accepted connection, watched so that it cannot hold its socket
//! without asking for something.
//!
//! hyper's own timers leave gaps: hyper-util's auto builder reads the first
//! bytes (to tell HTTP/1 from the HTTP/2 preface) with no timeout at all,
//! hyper's HTTP/1 `header_read_timeout` starts only once HTTP/1 is chosen,
//! and HTTP/2 has no header or idle timeout. Rather than patch each
//! protocol, one [`Watchdog`] per connection observes the two events every
//! protocol shares — a request begins (hyper calls the service: an HTTP/1
//! head or an HTTP/2 HEADERS frame has been read in full) and the response
//! to it is ready — and closes the connection when a deadline passes.
//!
//! # Guarantees
//!
//! At every moment a connection either has a request being handled or has
//! a deadline:
//! - **First request.** No request begun within `header_read_timeout` of
//!   the accept: closed. Whatever was sent — nothing, half an HTTP/2
//!   preface, a preface and SETTINGS, part of an HTTP/1 head.
//! - **Next HTTP/1 head.** Once the first byte after a response arrives,
//!   the rest of the head must follow within `header_read_timeout`, or the
//!   connection is closed (slowloris on a kept-alive connection). hyper's
//!   own `header_read_timeout` is off: it starts the moment a connection
//!   turns idle, so it would also be the idle timeout.
//! - **Idle.** No request being handled for `idle_timeout`: shut down
//!   gracefully (HTTP/1: closed; HTTP/2: GOAWAY, closed once the peer
//!   acknowledges), and closed outright [`GRACE`] later if it has not.
//! - **Drain** (SIGTERM, `server.shutdown_drain`, before the listeners
//!   stop): clients are asked to leave while every request is still
//!   answered. Every HTTP/1 response from then on says `Connection: close`
//!   (hyper closes the connection once it is written), so a pooled
//!   connection is closed by the gateway right after an answer, when its
//!   client knows not to reuse it, rather than when the listeners stop,
//!   when a request the client has just sent on it would meet the close
//!   (RFC 9112 §9.6); an HTTP/2 connection gets a GOAWAY (its requests in
//!   flight finish, new ones go to a new connection). A connection that
//!   stays idle through the whole drain is closed at its end: the one
//!   close a request can still meet, sent on it at that instant.
//! - **Server shutdown** (the drain's end; at once on SIGINT). Every
//!   answer from then on says `Connection: close` (HTTP/1). A connection
//!   on which a request has begun gets the graceful shutdown: closed at
//!   once if idle after a response, else once its response is written
//!   (HTTP/2: GOAWAY), then [`GRACE`] once no request is being handled.
//!   One on which no request has begun yet (accepted just before the
//!   stop, or taken from the listen backlog at it: see `accept`) is left
//!   open for [`GRACE`] from the stop (less if its `header_read_timeout`
//!   ends sooner): its client has just connected and
//!   holds it as open, so its first request may be on the way, and hyper's
//!   graceful shutdown would close it at once, under that request. A
//!   request begun within the grace is answered, then the connection is
//!   closed; none: closed at the grace's end. The connection is polled
//!   before the stop is looked at, so a request whose head has arrived is
//!   begun, and answered, rather than cut off. So after the stop a
//!   connection is closed only idle after a response, or silent for
//!   [`GRACE`] (up to 100 ms late); `server.shutdown_timeout`
//!   bounds the whole shutdown, these requests included.
//! - A request is *being handled* from the service call until its future
//!   resolves or is dropped. Delivering the body is not handling: a peer
//!   that stops reading (an HTTP/2 window left at 0) leaves the connection
//!   idle, so the idle deadline bounds it too. While a request is handled
//!   the watchdog sets no deadline: `request_timeout` bounds the handler.
//!
//! # Who tells the connection's task about a new deadline: nobody
//!
//! The task that drives the connection sleeps until the next deadline, but
//! never longer than one *tick*, `min(header_read_timeout, idle_timeout)`
//! (100 ms while shutting down; never under 10 ms), and re-reads the state
//! whenever it wakes.
//! Requests and reads only update the state; they never wake the task.
//! That is enough, because every deadline a request or a read can create
//! is at least one tick after the moment it is created, so after the
//! task's next wake-up: a new head is due `header_read_timeout` after its
//! first byte, an idle connection `idle_timeout` after its last response.
//! The only deadline that can be nearer, the [`GRACE`] after the last
//! response once a shutdown began, is covered by the short tick while
//! shutting down (so it may pass up to 100 ms late). A busy connection
//! thus costs its task one wake-up per tick; a request costs one
//! uncontended mutex lock at each end and no wake-up, and a read one
//! relaxed atomic load: waking the task at the end of every request would
//! cost more than the rest of a cached hit's bookkeeping.

use std::fmt;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::http::header::CONNECTION;
use axum::http::{HeaderValue, Request, Response, Version};
use hyper_util::server::graceful::GracefulConnection;
use pin_project_lite::pin_project;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::shutdown::Shutdown;

/// How long a graceful shutdown may take before the socket is closed
/// outright: an HTTP/2 GOAWAY is followed by a PING that a silent or dead
/// peer never acknowledges. One second, as Go's HTTP/2 server waits after
/// its GOAWAY. Also the time a connection with no request yet has after
/// the server's stop to send its first: a client sends it as soon as it has
/// connected (a pool connects for a request), within a round trip and a
/// busy host's scheduling delay, far below a second; a client that sends
/// nothing (a probe, a preconnect) holds the shutdown no longer than a
/// dead HTTP/2 peer does.
pub const GRACE: Duration = Duration::from_secs(1);

/// How often the task re-reads the state while shutting down: the
/// lateness allowed to [`GRACE`].
const SHUTDOWN_TICK: Duration = Duration::from_millis(100);

/// The shortest tick: timeouts configured below it (unusual: they are
/// seconds in practice) may pass up to this late, rather than the task
/// waking every few microseconds for the connection's whole life.
const MIN_TICK: Duration = Duration::from_millis(10);

#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// `server.header_read_timeout`.
    pub header_read: Duration,
    /// `server.idle_timeout`.
    pub idle: Duration,
}

/// Why a deadline passed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expiry {
    /// No request within `header_read_timeout` of the accept.
    FirstRequest,
    /// An HTTP/1 head begun but not finished within `header_read_timeout`.
    Head,
    /// No request being handled for `idle_timeout`: shut down gracefully.
    Idle,
    /// A graceful shutdown not finished within [`GRACE`].
    Grace,
}

impl fmt::Display for Expiry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::FirstRequest => "no request within server.header_read_timeout",
            Self::Head => "request head not finished within server.header_read_timeout",
            Self::Idle => "idle for server.idle_timeout",
            Self::Grace => "graceful shutdown not finished in time",
        })
    }
}

#[derive(Debug)]
struct State {
    accepted: Instant,
    /// Requests begun so far.
    started: u64,
    in_flight: u32,
    /// The protocol, known from the first request.
    http1: bool,
    /// When `in_flight` last fell to 0 (the accept before any request).
    idle_since: Instant,
    /// First byte of the next HTTP/1 head, read while idle.
    head_since: Option<Instant>,
    /// When a graceful shutdown began.
    closing_since: Option<Instant>,
}

impl State {
    /// The next deadline and why, or `None` while a request is handled.
    fn due(&self, limits: &Limits) -> Option<(Instant, Expiry)> {
        if self.in_flight > 0 {
            return None;
        }
        let mut due: Option<(Instant, Expiry)> = None;
        let mut consider = |at: Instant, why| {
            if due.is_none_or(|(d, _)| at < d) {
                due = Some((at, why));
            }
        };
        if self.started == 0 {
            consider(self.accepted + limits.header_read, Expiry::FirstRequest);
        } else if self.closing_since.is_none() {
            consider(self.idle_since + limits.idle, Expiry::Idle);
        }
        if let Some(head) = self.head_since {
            consider(head + limits.header_read, Expiry::Head);
        }
        if let Some(closing) = self.closing_since {
            consider(closing.max(self.idle_since) + GRACE, Expiry::Grace);
        }
        due
    }
}

/// The deadlines of one connection; see the module doc.
#[derive(Debug)]
pub struct Watchdog {
    limits: Limits,
    state: Mutex<State>,
    /// Set while an HTTP/1 connection is idle and no byte of the next head
    /// has been read: only then does the read path report a byte.
    watch_reads: AtomicBool,
    /// The drain began: HTTP/1 responses say `Connection: close`.
    draining: AtomicBool,
}

impl Watchdog {
    pub fn new(limits: Limits) -> Arc<Self> {
        Self::new_at(limits, Instant::now())
    }

    // The `_at` forms take the time, for the tests.
    fn new_at(limits: Limits, now: Instant) -> Arc<Self> {
        Arc::new(Self {
            limits,
            state: Mutex::new(State {
                accepted: now,
                started: 0,
                in_flight: 0,
                http1: true,
                idle_since: now,
                head_since: None,
                closing_since: None,
            }),
            watch_reads: AtomicBool::new(false),
            draining: AtomicBool::new(false),
        })
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // The state is a few plain fields, consistent after any panic.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The next deadline and why, or `None` while a request is handled.
    pub fn due(&self) -> Option<(Instant, Expiry)> {
        self.state().due(&self.limits)
    }

    /// A request begins; it is handled until the guard drops.
    fn begin(self: &Arc<Self>, version: Version) -> InFlight {
        self.started(version);
        InFlight(self.clone())
    }

    fn started(&self, version: Version) {
        let mut s = self.state();
        if s.started == 0 {
            s.http1 = version < Version::HTTP_2;
        }
        s.started += 1;
        s.in_flight += 1;
        s.head_since = None;
        self.watch_reads.store(false, Ordering::Relaxed);
    }

    fn ended_at(&self, now: Instant) {
        let mut s = self.state();
        s.in_flight -= 1;
        if s.in_flight == 0 {
            s.idle_since = now;
            if s.http1 && s.closing_since.is_none() {
                self.watch_reads.store(true, Ordering::Relaxed);
            }
        }
    }

    /// Bytes arrived; matters only for an idle HTTP/1 connection.
    fn bytes_read_at(&self, now: Instant) {
        if self.watch_reads.swap(false, Ordering::Relaxed) {
            let mut s = self.state();
            if s.in_flight == 0 && s.head_since.is_none() {
                s.head_since = Some(now);
            }
        }
    }

    /// Whether a request has begun on the connection.
    fn begun(&self) -> bool {
        self.state().started > 0
    }

    /// Whether the connection is HTTP/2 (known from its first request).
    fn http2(&self) -> bool {
        let s = self.state();
        s.started > 0 && !s.http1
    }

    fn closing_at(&self, now: Instant) {
        self.watch_reads.store(false, Ordering::Relaxed);
        let mut s = self.state();
        if s.closing_since.is_none() {
            s.closing_since = Some(now);
        }
    }
}

/// Marks a request as being handled until dropped.
pub struct InFlight(Arc<Watchdog>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.ended_at(Instant::now());
    }
}

/// The connection's service, reporting each request to the watchdog.
#[derive(Clone, Debug)]
pub struct Tracked<S> {
    inner: S,
    dog: Arc<Watchdog>,
    /// The client's address, current while the app is called (see
    /// `auth::peer`).
    peer: Option<std::net::IpAddr>,
}

impl<S> Tracked<S> {
    pub fn new(inner: S, dog: Arc<Watchdog>, peer: Option<std::net::IpAddr>) -> Self {
        Self { inner, dog, peer }
    }
}

impl<S, B, RB> hyper::service::Service<Request<B>> for Tracked<S>
where
    S: hyper::service::Service<Request<B>, Response = Response<RB>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = TrackedFuture<S::Future>;

    fn call(&self, req: Request<B>) -> Self::Future {
        let http1 = req.version() < Version::HTTP_2;
        let in_flight = self.dog.begin(req.version());
        let _peer = crate::auth::peer::enter(self.peer);
        TrackedFuture {
            inner: self.inner.call(req),
            in_flight: Some(in_flight),
            http1,
        }
    }
}

pin_project! {
    /// The response future with the request's [`InFlight`] guard, released
    /// as soon as the response is ready (or the future dropped). A struct
    /// rather than a boxed `async` block: no allocation per request.
    pub struct TrackedFuture<F> {
        #[pin]
        inner: F,
        in_flight: Option<InFlight>,
        http1: bool,
    }
}

impl<F, RB, E> Future for TrackedFuture<F>
where
    F: Future<Output = Result<Response<RB>, E>>,
{
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.project();
        let mut out = std::task::ready!(this.inner.poll(cx));
        let in_flight = this.in_flight.take();
        if let Some(InFlight(dog)) = &in_flight
            && *this.http1
            && dog.draining.load(Ordering::Relaxed)
            && let Ok(resp) = &mut out
        {
            resp.headers_mut()
                .insert(CONNECTION, HeaderValue::from_static("close"));
        }
        Poll::Ready(out)
    }
}

/// The connection's socket, reporting reads to the watchdog.
#[derive(Debug)]
pub struct Watched<T> {
    io: T,
    dog: Arc<Watchdog>,
}

impl<T> Watched<T> {
    pub fn new(io: T, dog: Arc<Watchdog>) -> Self {
        Self { io, dog }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Watched<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.io).poll_read(cx, buf);
        if buf.filled().len() > before && self.dog.watch_reads.load(Ordering::Relaxed) {
            self.dog.bytes_read_at(Instant::now());
        }
        polled
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Watched<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// How a connection ended.
#[derive(Debug)]
pub enum Ended<E> {
    /// hyper finished it (the peer closed, an error, a graceful shutdown).
    Done(Result<(), E>),
    /// A deadline passed and the socket was closed outright.
    Expired(Expiry),
}

/// Drives `conn` to its end under `dog`'s deadlines; asks its client to
/// leave once `drain` turns true (see "Drain"); once `stop` fires, a
/// graceful shutdown as soon as a request has begun (see "Server
/// shutdown"). Returning drops `conn`, which closes the socket.
pub async fn drive<C>(
    conn: C,
    dog: &Watchdog,
    mut drain: watch::Receiver<bool>,
    mut stop: Shutdown,
) -> Ended<C::Error>
where
    C: GracefulConnection,
{
    let mut conn = std::pin::pin!(conn);
    let sleep = tokio::time::sleep(Duration::ZERO);
    tokio::pin!(sleep);
    // `graceful_shutdown` called.
    let mut shutting_down = false;
    // `stop` fired.
    let mut stopped = false;
    let mut draining = false;
    let tick = dog.limits.header_read.min(dog.limits.idle).max(MIN_TICK);
    loop {
        // Looked at before the connection is polled, so that a connection
        // accepted during the drain says `Connection: close` in its first
        // answer.
        if !draining && *drain.borrow() {
            draining = true;
            dog.draining.store(true, Ordering::Relaxed);
        }
        // Stopped: the graceful shutdown waits for the first request. Before
        // it, hyper would close the connection at once (still reading the
        // first bytes, or HTTP/1's first head), under a request its client
        // may be sending; its deadline meanwhile is [`GRACE`] from the stop.
        if stopped && !shutting_down && dog.begun() {
            shutting_down = true;
            conn.as_mut().graceful_shutdown();
        }
        // An HTTP/2 connection whose protocol was not known when the drain
        // began (no request yet) gets its GOAWAY once it is.
        if draining && !shutting_down && dog.http2() {
            shutting_down = true;
            dog.closing_at(Instant::now());
            conn.as_mut().graceful_shutdown();
        }
        // See the module doc: no deadline can appear before the next tick.
        let tick = if shutting_down || draining {
            SHUTDOWN_TICK.min(tick)
        } else {
            tick
        };
        let check = Instant::now() + tick;
        let due = dog.due();
        sleep
            .as_mut()
            .reset(due.map_or(check, |(at, _)| at.min(check)));
        tokio::select! {
            // The connection first: a request that has arrived is begun
            // before a stop is acted on.
            biased;
            done = conn.as_mut() => return Ended::Done(done),
            () = stop.fired(), if !stopped => {
                stopped = true;
                // Whether or not a drain came first (SIGINT skips it),
                // every answer from now on says `Connection: close`.
                draining = true;
                dog.draining.store(true, Ordering::Relaxed);
                dog.closing_at(Instant::now());
                if dog.begun() && !shutting_down {
                    shutting_down = true;
                    conn.as_mut().graceful_shutdown();
                }
            }
            () = drained(&mut drain), if !draining => {
                draining = true;
                dog.draining.store(true, Ordering::Relaxed);
            }
            () = &mut sleep => {
                // Re-check: a request may have begun since `due` was read.
                if let Some((at, why)) = dog.due()
                    && at <= Instant::now()
                {
                    if why != Expiry::Idle {
                        return Ended::Expired(why);
                    }
                    shutting_down = true;
                    dog.closing_at(Instant::now());
                    conn.as_mut().graceful_shutdown();
                }
            }
        }
    }
}

/// Resolves once the drain began (or its sender is gone).
async fn drained(drain: &mut watch::Receiver<bool>) {
    let _ = drain.wait_for(|s| *s).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits {
        header_read: Duration::from_secs(10),
        idle: Duration::from_secs(75),
    };

    /// A watchdog accepted at time 0 and a clock in seconds from it.
    fn at_zero() -> (Arc<Watchdog>, impl Fn(f64) -> Instant) {
        let zero = Instant::now();
        (Watchdog::new_at(LIMITS, zero), move |secs| {
            zero + Duration::from_secs_f64(secs)
        })
    }

    #[test]
    fn the_first_request_is_due_within_header_read_timeout_of_the_accept() {
        let (dog, t) = at_zero();
        assert_eq!(dog.due(), Some((t(10.0), Expiry::FirstRequest)));
        // Bytes before the first request change nothing.
        dog.bytes_read_at(t(4.0));
        assert_eq!(dog.due(), Some((t(10.0), Expiry::FirstRequest)));
    }

    #[test]
    fn no_deadline_while_handling_then_idle_from_the_last_response() {
        let (dog, t) = at_zero();
        dog.started(Version::HTTP_11);
        dog.started(Version::HTTP_11);
        assert_eq!(dog.due(), None);
        dog.ended_at(t(100.0));
        assert_eq!(dog.due(), None, "one request still handled");
        dog.ended_at(t(101.0));
        assert_eq!(dog.due(), Some((t(176.0), Expiry::Idle)));
    }

    #[test]
    fn an_http1_head_begun_while_idle_is_due_within_header_read_timeout() {
        let (dog, t) = at_zero();
        dog.started(Version::HTTP_11);
        dog.ended_at(t(1.0));
        dog.bytes_read_at(t(30.0));
        assert_eq!(dog.due(), Some((t(40.0), Expiry::Head)));
        // Further bytes do not push it back.
        dog.bytes_read_at(t(35.0));
        assert_eq!(dog.due(), Some((t(40.0), Expiry::Head)));
        // The head completes: a request, then the idle clock restarts.
        dog.started(Version::HTTP_11);
        assert_eq!(dog.due(), None);
        dog.ended_at(t(36.0));
        assert_eq!(dog.due(), Some((t(111.0), Expiry::Idle)));
        // A head begun near the end of the idle period cannot extend it.
        dog.bytes_read_at(t(106.0));
        assert_eq!(dog.due(), Some((t(111.0), Expiry::Idle)));
    }

    #[test]
    fn http2_frames_between_requests_do_not_count_as_a_head() {
        let (dog, t) = at_zero();
        dog.started(Version::HTTP_2);
        dog.ended_at(t(1.0));
        dog.bytes_read_at(t(30.0)); // a PING, a WINDOW_UPDATE
        assert_eq!(dog.due(), Some((t(76.0), Expiry::Idle)));
    }

    #[test]
    fn a_graceful_shutdown_is_cut_short_after_grace_once_nothing_is_handled() {
        let (dog, t) = at_zero();
        dog.started(Version::HTTP_2);
        dog.ended_at(t(1.0));
        assert_eq!(dog.due(), Some((t(76.0), Expiry::Idle)));
        dog.closing_at(t(76.0));
        assert_eq!(
            dog.due(),
            Some((t(77.0), Expiry::Grace)),
            "idle is not due again"
        );
        // A request that slipped in before the GOAWAY is handled in full.
        dog.started(Version::HTTP_2);
        assert_eq!(dog.due(), None);
        dog.ended_at(t(80.0));
        assert_eq!(dog.due(), Some((t(81.0), Expiry::Grace)));
    }

    #[test]
    fn an_http1_head_during_shutdown_is_not_timed_separately() {
        let (dog, t) = at_zero();
        dog.started(Version::HTTP_11);
        dog.closing_at(t(5.0));
        dog.ended_at(t(6.0));
        dog.bytes_read_at(t(6.5));
        assert_eq!(dog.due(), Some((t(7.0), Expiry::Grace)));
    }

    #[test]
    fn shutdown_before_any_request_keeps_the_earlier_deadline() {
        let (dog, t) = at_zero();
        dog.closing_at(t(2.0));
        assert_eq!(dog.due(), Some((t(3.0), Expiry::Grace)));
        let (dog, t) = at_zero();
        dog.closing_at(t(9.5));
        assert_eq!(dog.due(), Some((t(10.0), Expiry::FirstRequest)));
    }

    #[test]
    fn a_request_ends_when_its_future_resolves_or_is_dropped() {
        let dog = Watchdog::new(LIMITS);
        /// Answers at once if the request says so, else never.
        struct Svc;
        impl hyper::service::Service<Request<bool>> for Svc {
            type Response = Response<()>;
            type Error = std::convert::Infallible;
            type Future = Pin<Box<dyn Future<Output = Result<Response<()>, Self::Error>> + Send>>;
            fn call(&self, req: Request<bool>) -> Self::Future {
                let answer = *req.body();
                Box::pin(async move {
                    if !answer {
                        std::future::pending::<()>().await;
                    }
                    Ok(Response::new(()))
                })
            }
        }
        let svc = Tracked::new(Svc, dog.clone(), None);
        let pending = hyper::service::Service::call(&svc, Request::new(false));
        assert_eq!(dog.due(), None);
        drop(pending); // the client went away mid-request
        assert_eq!(dog.due().map(|(_, why)| why), Some(Expiry::Idle));

        let done = hyper::service::Service::call(&svc, Request::new(true));
        assert_eq!(dog.due(), None);
        futures_util::FutureExt::now_or_never(done)
            .unwrap()
            .unwrap();
        assert_eq!(dog.due().map(|(_, why)| why), Some(Expiry::Idle));
    }

    /// Once the drain began, every HTTP/1 response says `Connection:
    /// close`; an HTTP/2 one never carries the header (it is not allowed
    /// there: the connection gets a GOAWAY instead); before it, none does.
    #[test]
    fn responses_during_the_drain_ask_http1_clients_to_leave() {
        struct Svc;
        impl hyper::service::Service<Request<()>> for Svc {
            type Response = Response<()>;
            type Error = std::convert::Infallible;
            type Future = std::future::Ready<Result<Response<()>, Self::Error>>;
            fn call(&self, _: Request<()>) -> Self::Future {
                std::future::ready(Ok(Response::new(())))
            }
        }
        let answer = |dog: &Arc<Watchdog>, version: Version| {
            let svc = Tracked::new(Svc, dog.clone(), None);
            let mut req = Request::new(());
            *req.version_mut() = version;
            let fut = hyper::service::Service::call(&svc, req);
            futures_util::FutureExt::now_or_never(fut).unwrap().unwrap()
        };
        let dog = Watchdog::new(LIMITS);
        assert!(
            answer(&dog, Version::HTTP_11)
                .headers()
                .get(CONNECTION)
                .is_none()
        );
        dog.draining.store(true, Ordering::Relaxed);
        assert_eq!(
            answer(&dog, Version::HTTP_11).headers()[CONNECTION],
            "close"
        );
        assert_eq!(
            answer(&dog, Version::HTTP_10).headers()[CONNECTION],
            "close"
        );
        let h2 = Watchdog::new(LIMITS);
        h2.draining.store(true, Ordering::Relaxed);
        assert!(
            answer(&h2, Version::HTTP_2)
                .headers()
                .get(CONNECTION)
                .is_none()
        );
        assert_eq!(dog.due().map(|(_, why)| why), Some(Expiry::Idle));
    }
}
