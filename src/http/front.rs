//! `FrontLayer`: the one middleware in front of every route, public and
//! admin. In order, for each request:
//!
//! 1. **Request id.** The client's `x-request-id` if it sent one, else a new
//!    UUID v4; the response carries it (unless the handler set its own).
//!    **The caller**: from a trusted proxy, the address its forwarding
//!    header names ([`super::forwarded`], `server.trusted_proxies`), which
//!    the service below sees as the client address (`auth::peer`, for rate
//!    limits) and the access line as `client`, beside the connection's
//!    `peer`. **CORS** ([`super::cors`], `[server.cors]`): a listed
//!    origin's preflight is answered here, before anything below could ask
//!    for a credential; every other answer gets its headers on the way out.
//! 2. **Access line and trace span** (the line's own room: [`access`]).
//!    With access lines on (`log.access`,
//!    the target `bloomgate::access` at INFO, and the process's
//!    [`crate::access`] logger installed): one access line when the
//!    response is ready (method, route template, status, `Cache-Status`,
//!    resource, duration, request id, client address; the peer when a proxy
//!    named the client; the `reason` of a refusal, from the answer's
//!    [`super::response::Refused`]), handed to the
//!    access logger, which formats it without allocating and writes it on
//!    its own thread. A request that waits (its handler is pending: a row
//!    load) gets a `request` span holding the id from then on, so every
//!    line logged while it waits carries it; a hit or a filtered 404,
//!    answered at once and logging nothing, gets none (a span costs more
//!    than the line). With access lines off: `request` at DEBUG with
//!    method, path and id, and one DEBUG event with status and latency;
//!    neither built, no clock read and nothing allocated while both are
//!    off (one atomic load per request: `telemetry::access_on`, set when
//!    the filter is). The service below tells the line what it found
//!    ([`Tells`]): the dispatch, the route it matched and the lookup's
//!    `Cache-Status`, which the line would otherwise match and read back
//!    from the headers again (about 40 % of what the line costs a hit).
//!    The probes (`/healthz`, `/readyz`) have no line with
//!    `log.access_probes = false` ([`FrontLayer::without_lines_for`]).
//! 3. **What no route may see** ([`refused_target`]): an HTTP/1.1 request
//!    over a connection without exactly one `Host` gets 400; `CONNECT` and
//!    `OPTIONS *` get 405 with `Allow`. Checked before everything below,
//!    the preflight answer of step 1 included.
//! 4. **Body limit.** A request declaring a body over `server.max_body_bytes`
//!    gets 413 before any other work. Bodies are never read (every route is
//!    a GET), so a smaller one is simply ignored.
//! 5. **Load shedding.** At most `server.max_concurrency` requests are
//!    handled at once (per router: the public and the admin router count
//!    apart); one more is answered 503 with `Retry-After` at once and counted
//!    in `shed` (and under its resource, when its path names one: see
//!    [`Counters::on_shed`]), rather than queued without bound.
//! 6. **Deadline.** A request not answered within the timeout gets 504 and
//!    is counted in `timeouts`; its handler future is dropped then, no
//!    sooner than the timeout after its first poll, so that a handler that
//!    knows its resource can tell this drop from its client's leaving by
//!    the time it has run, and count the timeout there (`lookup::finish`).
//!
//! # Why one layer, and what it costs
//!
//! This replaces tower-http's `SetRequestId` + `Trace` + `PropagateRequestId`
//! and tower's `HandleError` + `Timeout` + `LoadShed` +
//! `GlobalConcurrencyLimit`, with the same responses and counters. Those
//! seven layers would cost a cached hit more than everything else it does,
//! and fourteen heap allocations on top of a bare handler: the id formatted into a `String`, copied
//! into the request's headers and a boxed `Extensions` entry and back out;
//! a `Sleep` built for every request; `HandleError`'s per-request `Box::pin`
//! of the whole nest of futures. Here:
//! - the id is made once, straight into the `HeaderValue` the response
//!   carries (one allocation), and never stored in the request;
//! - the concurrency limit is one shared atomic counter (no semaphore, no
//!   `poll_ready` handshake); the slot is given back when the response
//!   future completes or is dropped;
//! - the deadline's timer is armed only if the handler does not answer on
//!   its first poll: a hit or a filtered 404 answers there and never touches
//!   the timer wheel; a load that waits on Postgres arms it, from the first
//!   poll, which follows the call immediately;
//! - the future is a plain struct, not boxed, so nothing is moved into a
//!   second allocation.
//!
//! # Called in place
//!
//! hyper calls a connection's service through a shared reference
//! (`hyper::service::Service`), tower through an exclusive one. hyper-util's
//! adapter between the two clones the whole app for every request and
//! drives it through tower's `Oneshot`: two reference counts on memory both
//! cores write, and the request moved twice more. `Front` and
//! [`super::dispatch::Dispatch`] implement hyper's trait themselves, so the
//! connection calls the app where it is. Tower's `poll_ready` is skipped on
//! that path, which is sound because no service below has a readiness to
//! wait for: the front layer's limit is taken in `call`, the dispatch and
//! axum's `Router` are always ready. The tower impl stays for `oneshot`
//! tests and for layering.
//!
//! What `call` does now includes a whole cache hit (`dispatch`). Over
//! HTTP/1 that changes nothing: one request at a time per connection. Over
//! HTTP/2 hyper calls the service on the connection's task and spawns each
//! stream's future, so hits on one connection are answered one after
//! another on one core rather than spread over streams: about a
//! microsecond each, where a miss, which waits, still gets its own task.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use axum::http::{HeaderName, HeaderValue, Request, StatusCode, header};
use axum::response::{IntoResponse, Response};
use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep};
use tower::{Layer, Service};
use tracing::Span;

mod access;

pub use access::AccessTemplates;
#[cfg(test)]
pub(super) use access::access_index;
use access::{Access, AccessRoutes, access_line};

use super::cors::{self, Asked, Cors};
use super::response::json_error;
use crate::error::Error;
use crate::telemetry::ACCESS;
use crate::traffic::Traffic;

pub static X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// Told the path of a request shed.
pub type OnShed = Arc<dyn Fn(&str) + Send + Sync>;

/// Where the front layer counts what it refuses.
#[derive(Clone)]
pub struct Counters {
    pub traffic: Arc<Traffic>,
    /// Told the path of every request shed (only then, off the fast
    /// paths), to count it under the resource it names.
    pub on_shed: Option<OnShed>,
}

impl std::fmt::Debug for Counters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Counters")
            .field("traffic", &self.traffic)
            .finish_non_exhaustive()
    }
}

/// The layer; every route's copy (axum clones it per route) shares one
/// in-flight count.
#[derive(Clone, Debug)]
pub struct FrontLayer {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    max_body: u64,
    max_in_flight: usize,
    in_flight: AtomicUsize,
    timeout: Option<Duration>,
    counters: Counters,
    /// The route templates access lines name (see [`FrontLayer::with_access`]).
    access: Option<Arc<AccessRoutes>>,
    /// Put the client address into each request's extensions (the admin
    /// router: its audit lines name the client).
    peer_extension: bool,
    /// `server.trusted_proxies`: who may name the caller.
    forwarded: Option<super::forwarded::Forwarded>,
    /// `[server.cors]`, while on.
    cors: Option<&'static Cors>,
}

impl FrontLayer {
    pub fn new(
        max_body: u64,
        max_in_flight: usize,
        timeout: Option<Duration>,
        counters: Counters,
    ) -> Self {
        Self {
            shared: Arc::new(Shared {
                max_body,
                max_in_flight,
                in_flight: AtomicUsize::new(0),
                timeout,
                counters,
                access: None,
                peer_extension: false,
                forwarded: None,
                cors: None,
            }),
        }
    }

    /// Access lines name these route templates (`(template, resource)`,
    /// the resource empty for routes that serve none); a path no template
    /// matches alone is logged with an empty route. Call before cloning.
    pub fn with_access(mut self, routes: AccessTemplates) -> Self {
        if let Some(shared) = Arc::get_mut(&mut self.shared) {
            shared.access = Some(Arc::new(AccessRoutes::new(&routes)));
        }
        self
    }

    /// Requests whose route is one of `templates` have no access line
    /// (`log.access_probes = false`: the probes). Call after
    /// [`with_access`](Self::with_access), before cloning.
    pub fn without_lines_for(mut self, templates: &[&str]) -> Self {
        if let Some(shared) = Arc::get_mut(&mut self.shared)
            && let Some(routes) = shared.access.as_mut().and_then(Arc::get_mut)
        {
            routes.without_lines_for(templates);
        }
        self
    }

    /// The caller of a request from one of `forwarded`'s trusted proxies
    /// is the address its header names ([`super::forwarded`]). Call
    /// before cloning.
    pub fn with_forwarded(mut self, forwarded: Option<super::forwarded::Forwarded>) -> Self {
        if let Some(shared) = Arc::get_mut(&mut self.shared) {
            shared.forwarded = forwarded;
        }
        self
    }

    /// Answers CORS as `cors` says ([`super::cors`]). Call before cloning.
    pub fn with_cors(mut self, cors: Option<&'static Cors>) -> Self {
        if let Some(shared) = Arc::get_mut(&mut self.shared) {
            shared.cors = cors;
        }
        self
    }

    /// Each request carries its client address as an extension
    /// ([`crate::auth::peer::PeerAddr`]). Call before cloning.
    pub fn with_peer_extension(mut self) -> Self {
        if let Some(shared) = Arc::get_mut(&mut self.shared) {
            shared.peer_extension = true;
        }
        self
    }

    /// Tells `f` the path of every request shed (see [`Counters::on_shed`]).
    /// Only before the layer is first used: its copies share the counters.
    pub fn on_shed(self, f: impl Fn(&str) + Send + Sync + 'static) -> Self {
        let mut shared = Arc::try_unwrap(self.shared).unwrap_or_else(|_| {
            panic!("FrontLayer::on_shed after the layer was copied");
        });
        shared.counters.on_shed = Some(Arc::new(f));
        Self {
            shared: Arc::new(shared),
        }
    }

    /// Requests being handled now.
    pub fn in_flight(&self) -> usize {
        self.shared.in_flight.load(Ordering::Relaxed)
    }
}

impl<S> Layer<S> for FrontLayer {
    type Service = Front<S>;

    fn layer(&self, inner: S) -> Front<S> {
        Front {
            inner,
            shared: self.shared.clone(),
        }
    }
}

#[derive(Clone, Debug)]
pub struct Front<S> {
    inner: S,
    shared: Arc<Shared>,
}

/// A slot under `max_concurrency`, given back on drop.
struct Slot(Arc<Shared>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Release);
    }
}

fn new_request_id() -> HeaderValue {
    let mut buf = [0u8; uuid::fmt::Hyphenated::LENGTH];
    let id = uuid::Uuid::new_v4().hyphenated().encode_lower(&mut buf);
    HeaderValue::from_str(id).expect("a hyphenated UUID is a valid header value")
}

impl<S, B> Service<Request<B>> for Front<S>
where
    S: Service<Request<B>, Response = Response, Error = std::convert::Infallible>
        + Tells<<S as Service<Request<B>>>::Future>,
{
    type Response = Response;
    type Error = std::convert::Infallible;
    type Future = FrontFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let inner = &mut self.inner;
        start::<B, _, S>(&self.shared, req, |req| inner.call(req))
    }
}

/// The app as hyper calls it: through a shared reference, in place. See
/// "Called in place" in the module doc.
impl<S, B> hyper::service::Service<Request<B>> for Front<S>
where
    S: hyper::service::Service<Request<B>, Response = Response, Error = std::convert::Infallible>
        + Tells<<S as hyper::service::Service<Request<B>>>::Future>,
{
    type Response = Response;
    type Error = std::convert::Infallible;
    type Future = FrontFuture<S::Future>;

    fn call(&self, req: Request<B>) -> Self::Future {
        start::<B, _, S>(&self.shared, req, |req| self.inner.call(req))
    }
}

/// What the service under the front layer tells the access line that it
/// knows already, so that the line need not find it again: the route it
/// matched and its answer's `Cache-Status`. The defaults tell nothing:
/// the line then matches the path and reads the header itself.
pub trait Tells<F> {
    /// Whether [`Tells::route`] tells the route; if not, the front layer
    /// matches the path before calling the service.
    const ROUTE: bool = false;

    /// The route of the request `future` answers, asked once the service
    /// has been called, before the future is first polled.
    fn route(_future: &F) -> Told<'_> {
        Told::Unknown
    }

    /// The `Cache-Status` of the response `future` has just answered with,
    /// when it is a fixed value (no line need escape or look it up).
    fn cache_status(_future: &F) -> Option<&'static str> {
        None
    }
}

/// A function made a service tells nothing (tests, tools).
impl<T, F> Tells<F> for tower::util::ServiceFn<T> {}

/// The route a service tells ([`Tells::route`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Told<'a> {
    /// Its index among the access templates ([`FrontLayer::with_access`]).
    Index(usize),
    /// The request's path, for the line to match.
    Path(&'a str),
    /// Nothing: the line names no route.
    Unknown,
}

/// The front layer's work before the inner service, then `call_inner`;
/// `S` tells the access line what it knows ([`Tells`]).
fn start<B, F, S: Tells<F>>(
    shared: &Arc<Shared>,
    mut req: Request<B>,
    call_inner: impl FnOnce(Request<B>) -> F,
) -> FrontFuture<F> {
    let (id, id_made) = match req.headers().get(&X_REQUEST_ID) {
        Some(v) => (v.clone(), false),
        None => (new_request_id(), true),
    };
    if shared.peer_extension
        && let Some(peer) = crate::auth::peer::current()
    {
        req.extensions_mut()
            .insert(crate::auth::peer::PeerAddr(peer));
    }
    // Behind a trusted proxy, the caller it names (never while the list
    // is empty: one branch).
    let named = match &shared.forwarded {
        Some(f) => crate::auth::peer::current().and_then(|peer| f.named(peer, req.headers())),
        None => None,
    };
    let mut access = match &shared.access {
        Some(routes) if crate::telemetry::access_on() && crate::access::global().is_some() => {
            Some(Access {
                began: std::time::Instant::now(),
                method: req.method().clone(),
                id_made,
                // Told by the inner service once called if it tells it.
                route: match S::ROUTE {
                    true => None,
                    false => routes.route_of(req.uri().path()),
                },
                client: match named {
                    Some(n) => Some(n.caller),
                    None => crate::auth::peer::current(),
                },
                peer: named.map(|n| n.peer),
            })
        }
        _ => None,
    };
    let (cors_answer, preflight) = match shared.cors {
        None => (cors::Answer::Off, None),
        Some(c) => match c.ask(&req) {
            Asked::Answer(a) => (a, None),
            Asked::Preflight(resp) => (cors::Answer::Off, Some(resp)),
        },
    };
    // With access lines on, the `request` span is made only if the request
    // waits (see the module doc).
    let span = if access.is_some() {
        Span::none()
    } else {
        tracing::debug_span!(
            "request",
            method = %req.method(),
            path = %req.uri().path(),
            id = id.to_str().unwrap_or_default(),
        )
    };
    let began = (access.is_none() && !span.is_disabled()).then(std::time::Instant::now);
    let refused = if let Some(response) = refused_target(&req, &shared.counters.traffic) {
        Some(response)
    } else if preflight.is_some() {
        preflight
    } else if declared_body(&req).is_some_and(|n| n > shared.max_body) {
        shared
            .counters
            .traffic
            .body_too_large
            .fetch_add(1, Ordering::Relaxed);
        Some(json_error(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body_too_large",
            &format!("request bodies are limited to {} bytes", shared.max_body),
        ))
    } else if shared
        .in_flight
        // Never above the limit, not even for a moment: a refused
        // request must not hide a slot that was just given back.
        .fetch_update(Ordering::Acquire, Ordering::Relaxed, |n| {
            (n < shared.max_in_flight).then_some(n + 1)
        })
        .is_err()
    {
        shared.counters.traffic.shed.fetch_add(1, Ordering::Relaxed);
        if let Some(on_shed) = &shared.counters.on_shed {
            on_shed(req.uri().path());
        }
        Some(Error::Overloaded.into_response())
    } else {
        None
    };
    let state = match refused {
        Some(mut response) => {
            if let Some(c) = shared.cors {
                c.apply(cors_answer, &mut response);
            }
            // Refused before any handler: the line now, while the layer's
            // route templates are at hand (the future holds no reference
            // to them).
            if let Some(routes) = &shared.access
                && let Some(mut a) = access.take()
            {
                if S::ROUTE {
                    a.route = routes.route_of(req.uri().path());
                }
                access_line(&a, routes, &response, id.to_str().unwrap_or_default(), None);
            }
            State::Ready {
                response: Some(response),
            }
        }
        None => {
            let slot = Slot(shared.clone());
            let inner = {
                let _entered = span.enter();
                // The service below takes the named caller for the client.
                let _caller = named.map(|n| crate::auth::peer::enter(Some(n.caller)));
                call_inner(req)
            };
            if S::ROUTE
                && let Some(a) = &mut access
                && let Some(routes) = &shared.access
            {
                a.route = match S::route(&inner) {
                    Told::Index(i) => Some(i),
                    Told::Path(path) => routes.route_of(path),
                    Told::Unknown => None,
                };
            }
            State::Running {
                inner,
                sleep: None,
                slot: Some(slot),
            }
        }
    };
    FrontFuture {
        state,
        id: Some(id),
        span,
        began,
        timeout: shared.timeout,
        access,
        cache_status: S::cache_status,
        cors: cors_answer,
    }
}

/// What no route may see: an HTTP/1.1 request without exactly one `Host`
/// (RFC 9112 §3.2: 400; HTTP/1.0 may omit it, HTTP/2 and 3 carry
/// `:authority`), and the two request forms no route can match, `CONNECT`
/// (authority-form) and `OPTIONS *` (asterisk-form), which are methods
/// the gateway does not take (405 with `Allow`, as for any other).
fn refused_target<B>(req: &Request<B>, traffic: &crate::traffic::Traffic) -> Option<Response> {
    // Only what came over a connection (its client address is set, see
    // `auth::peer`): a request made in the process has no Host to check.
    if req.version() == axum::http::Version::HTTP_11 && crate::auth::peer::current().is_some() {
        let mut hosts = req.headers().get_all(axum::http::header::HOST).iter();
        if hosts.next().is_none() || hosts.next().is_some() {
            return Some(super::response::json_error(
                StatusCode::BAD_REQUEST,
                "bad_request",
                "an HTTP/1.1 request carries exactly one Host header (RFC 9112 section 3.2)",
            ));
        }
    }
    let method = req.method();
    if method == axum::http::Method::CONNECT
        || (method == axum::http::Method::OPTIONS && req.uri() == "*")
    {
        traffic.method_not_allowed.fetch_add(1, Ordering::Relaxed);
        let mut resp = super::response::json_error(
            StatusCode::METHOD_NOT_ALLOWED,
            "method_not_allowed",
            "this route does not take that method; see Allow",
        );
        resp.headers_mut().insert(
            axum::http::header::ALLOW,
            HeaderValue::from_static("GET,HEAD"),
        );
        return Some(resp);
    }
    None
}

fn declared_body<B>(req: &Request<B>) -> Option<u64> {
    req.headers()
        .get(header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .parse()
        .ok()
}

pin_project! {
    #[project = StateProj]
    enum State<F> {
        Running {
            #[pin]
            inner: F,
            // Armed on the first poll that finds the handler pending.
            #[pin]
            sleep: Option<Sleep>,
            // Also where a timeout is counted and where the access line
            // finds the route templates: the future holds no other
            // reference to the shared state. Taken when answered.
            slot: Option<Slot>,
        },
        Ready { response: Option<Response> },
    }
}

pin_project! {
    pub struct FrontFuture<F> {
        #[pin]
        state: State<F>,
        id: Option<HeaderValue>,
        span: Span,
        began: Option<std::time::Instant>,
        timeout: Option<Duration>,
        access: Option<Access>,
        // The inner service's [`Tells::cache_status`], asked when it answers.
        cache_status: fn(&F) -> Option<&'static str>,
        // What the answer carries of CORS (`Off` without it, and once
        // applied: a refusal's in `start`).
        cors: cors::Answer,
    }
}

impl<F> Future for FrontFuture<F>
where
    F: Future<Output = Result<Response, std::convert::Infallible>>,
{
    type Output = Result<Response, std::convert::Infallible>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        let _entered = (!this.span.is_disabled()).then(|| this.span.clone().entered());
        let mut told = None;
        let (mut response, slot) = match this.state.as_mut().project() {
            StateProj::Ready { response } => {
                (response.take().expect("polled after completion"), None)
            }
            StateProj::Running {
                mut inner,
                mut sleep,
                slot,
            } => match inner.as_mut().poll(cx) {
                Poll::Ready(Ok(response)) => {
                    told = (this.cache_status)(inner.as_ref().get_ref());
                    (response, slot.take())
                }
                Poll::Ready(Err(never)) => match never {},
                Poll::Pending => {
                    if this.access.is_some() && this.span.is_none() {
                        // It waits: from now on, lines logged inside it
                        // carry its id.
                        let id = this.id.as_ref().and_then(|v| v.to_str().ok());
                        *this.span = tracing::info_span!(
                            target: ACCESS,
                            "request",
                            id = id.unwrap_or_default()
                        );
                    }
                    let Some(timeout) = *this.timeout else {
                        return Poll::Pending;
                    };
                    if sleep.is_none() {
                        sleep.set(Some(tokio::time::sleep_until(Instant::now() + timeout)));
                    }
                    let sleep = sleep.as_pin_mut().expect("armed above");
                    ready!(sleep.poll(cx));
                    let slot = slot.take();
                    if let Some(s) = &slot {
                        s.0.counters
                            .traffic
                            .timeouts
                            .fetch_add(1, Ordering::Relaxed);
                    }
                    this.state.set(State::Ready { response: None });
                    (Error::Timeout.into_response(), slot)
                }
            },
        };
        // Answered: the handler's future goes now, not when whoever polled
        // this drops it; the slot once the line is written.
        this.state.set(State::Ready { response: None });
        if *this.cors != cors::Answer::Off
            && let Some(s) = &slot
            && let Some(c) = s.0.cors
        {
            c.apply(*this.cors, &mut response);
        }
        let id = this.id.take();
        if let (Some(a), Some(slot)) = (this.access.take(), &slot)
            && let Some(routes) = &slot.0.access
        {
            let id = id.as_ref().and_then(|v| v.to_str().ok());
            access_line(&a, routes, &response, id.unwrap_or_default(), told);
        }
        drop(slot);
        if let Some(id) = id {
            response.headers_mut().entry(&X_REQUEST_ID).or_insert(id);
        }
        if let Some(began) = this.began {
            tracing::debug!(
                status = response.status().as_u16(),
                latency_ms = began.elapsed().as_secs_f64() * 1e3,
                "finished processing request"
            );
        }
        Poll::Ready(Ok(response))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use std::convert::Infallible;
    use tokio::sync::oneshot;

    fn layer(max_in_flight: usize, timeout: Option<Duration>) -> (FrontLayer, Arc<Traffic>) {
        let counters = Counters {
            traffic: Arc::default(),
            on_shed: None,
        };
        (
            FrontLayer::new(100, max_in_flight, timeout, counters.clone()),
            counters.traffic,
        )
    }

    fn ok() -> Result<Response, Infallible> {
        Ok(StatusCode::OK.into_response())
    }

    fn get() -> Request<Body> {
        Request::get("/").body(Body::empty()).unwrap()
    }

    #[tokio::test]
    async fn a_request_id_is_made_unless_the_client_sent_one_and_the_response_carries_it() {
        let (l, _) = layer(4, None);
        let mut svc = l.layer(tower::service_fn(|_req: Request<Body>| async { ok() }));
        let a = svc.call(get()).await.unwrap();
        let b = svc.call(get()).await.unwrap();
        let (a, b) = (&a.headers()[&X_REQUEST_ID], &b.headers()[&X_REQUEST_ID]);
        assert_ne!(a, b, "every request gets its own id");
        assert!(uuid::Uuid::parse_str(a.to_str().unwrap()).is_ok());
        let mut req = get();
        req.headers_mut()
            .insert(&X_REQUEST_ID, HeaderValue::from_static("abc-123"));
        let c = svc.call(req).await.unwrap();
        assert_eq!(c.headers()[&X_REQUEST_ID], "abc-123");
    }

    #[tokio::test]
    async fn a_declared_body_over_the_limit_is_refused_before_the_handler() {
        let (l, _) = layer(4, None);
        let mut svc = l.layer(tower::service_fn(|_req: Request<Body>| async {
            panic!("the handler must not run")
        }));
        let mut req = get();
        req.headers_mut()
            .insert(header::CONTENT_LENGTH, HeaderValue::from_static("101"));
        let resp = svc.call(req).await.unwrap();
        assert_eq!(resp.status(), StatusCode::PAYLOAD_TOO_LARGE);
        assert!(resp.headers().contains_key(&X_REQUEST_ID));
    }

    /// The limit holds, counts what it refuses, and a slot comes back when a
    /// response future completes *or is dropped*.
    #[tokio::test]
    async fn past_the_limit_requests_are_shed_and_slots_come_back() {
        let (l, counters) = layer(2, None);
        let (tx, rx) = tokio::sync::watch::channel(false);
        let svc = l.layer(tower::service_fn(move |_req: Request<Body>| {
            let mut rx = rx.clone();
            async move {
                let _ = rx.wait_for(|open| *open).await;
                ok()
            }
        }));
        let mut a = Box::pin(svc.clone().call(get()));
        let mut b = Box::pin(svc.clone().call(get()));
        assert!(futures_util::poll!(&mut a).is_pending());
        assert!(futures_util::poll!(&mut b).is_pending());
        assert_eq!(l.in_flight(), 2);
        let shed = svc.clone().call(get()).await.unwrap();
        assert_eq!(shed.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(shed.headers().contains_key(header::RETRY_AFTER));
        assert_eq!(counters.shed.load(Ordering::Relaxed), 1);
        drop(b);
        assert_eq!(l.in_flight(), 1, "a dropped request gives its slot back");
        tx.send(true).unwrap();
        assert_eq!((&mut a).await.unwrap().status(), StatusCode::OK);
        assert_eq!(
            l.in_flight(),
            0,
            "given back once answered, before the future is dropped"
        );
        drop(a);
        let again = svc.clone().call(get()).await.unwrap();
        assert_eq!(again.status(), StatusCode::OK);
        assert_eq!(counters.shed.load(Ordering::Relaxed), 1);
    }

    // Real time, short deadlines: no paused clock (tokio's `test-util`
    // would put a mutex into every `Instant::now` of every build that
    // includes the dev-dependencies, the benchmarks' included).
    #[tokio::test]
    async fn a_handler_past_the_deadline_gets_504_and_is_dropped() {
        let (l, counters) = layer(4, Some(Duration::from_millis(20)));
        let (dropped_tx, dropped_rx) = oneshot::channel::<()>();
        let dropped_tx = Arc::new(std::sync::Mutex::new(Some(dropped_tx)));
        let mut svc = l.layer(tower::service_fn(move |_req: Request<Body>| {
            let guard = dropped_tx.lock().unwrap().take();
            async move {
                let _guard = guard;
                std::future::pending::<()>().await;
                ok()
            }
        }));
        let mut fut = Box::pin(svc.call(get()));
        let resp = (&mut fut).await.unwrap();
        assert_eq!(resp.status(), StatusCode::GATEWAY_TIMEOUT);
        assert!(resp.headers().contains_key(&X_REQUEST_ID));
        assert_eq!(counters.timeouts.load(Ordering::Relaxed), 1);
        // Both gone at the 504, while the response future still exists.
        let dropped = tokio::time::timeout(Duration::from_secs(5), dropped_rx).await;
        assert!(
            matches!(dropped, Ok(Err(_))),
            "the handler future is dropped at the 504"
        );
        assert_eq!(l.in_flight(), 0);
        drop(fut);
    }

    #[tokio::test]
    async fn a_slow_handler_within_the_deadline_is_answered() {
        let (l, counters) = layer(4, Some(Duration::from_secs(30)));
        let mut svc = l.layer(tower::service_fn(|_req: Request<Body>| async {
            tokio::time::sleep(Duration::from_millis(20)).await;
            ok()
        }));
        let resp = svc.call(get()).await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        assert_eq!(counters.timeouts.load(Ordering::Relaxed), 0);
    }
}
