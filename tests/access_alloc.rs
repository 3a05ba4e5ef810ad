//! What access lines cost a request in the front layer (`http::front`),
//! counted exactly by a global allocator that counts this thread's
//! allocations: off (`log.access = false`, or a level above `info`), not
//! one allocation more than with no subscriber at all; on, what the span
//! and the line take, printed with the time per request (recorded in
//! BENCHMARKS.md, "Access lines"; not asserted: timings).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::response::{IntoResponse, Response};
use bloomgate::http::front::{Counters, FrontLayer};
use futures_util::FutureExt;
use tower::{Layer, Service};

#[path = "common/counting.rs"]
mod counting;
use counting::allocations;

#[global_allocator]
static GLOBAL: counting::Counting = counting::Counting;

/// Allocations per request and nanoseconds per request through the front
/// layer (access templates as the public router has them) around a handler
/// that answers at once, as a cache hit does.
fn per_request() -> (u64, f64) {
    let layer = FrontLayer::new(
        1 << 20,
        1024,
        None,
        Counters {
            traffic: Arc::default(),
            on_shed: None,
        },
    )
    .with_access(vec![
        ("/users/{id}".into(), Some("users".into())),
        ("/healthz".into(), None),
        ("/readyz".into(), None),
    ]);
    let mut svc = layer.layer(tower::service_fn(|_req: Request<Body>| {
        std::future::ready(Ok::<Response, Infallible>(StatusCode::OK.into_response()))
    }));
    let mut once = || {
        let req = Request::get("/users/42")
            .header("x-request-id", "fixed-id")
            .body(Body::empty())
            .unwrap();
        let resp = svc.call(req).now_or_never().unwrap().unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
    };
    for _ in 0..1000 {
        once();
    }
    let n = 20_000u64;
    let a0 = allocations();
    let t0 = Instant::now();
    for _ in 0..n {
        once();
    }
    let ns = t0.elapsed().as_nanos() as f64 / n as f64;
    ((allocations() - a0) / n, ns)
}

fn subscriber(filter: &str) -> impl tracing::Subscriber + Send + Sync {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_ansi(false)
        .with_writer(std::io::sink)
        .finish()
}

#[test]
fn access_lines_off_add_no_allocation_and_on_cost_this_much() {
    let (bare, bare_ns) = per_request();
    let off = |filter: &str| tracing::subscriber::with_default(subscriber(filter), per_request);
    let (off_switch, off_ns) = off("info,bloomgate::access=off");
    let (off_level, _) = off("warn");
    assert_eq!(off_switch, bare, "log.access = false adds allocations");
    assert_eq!(off_level, bare, "a level above info adds allocations");
    let (on, on_ns) = off("info");
    assert!(
        on > bare,
        "access lines on, yet nothing allocated: not logged?"
    );
    println!(
        "front layer per request: no subscriber {bare} allocations {bare_ns:.0} ns; \
         access off {off_switch} allocations {off_ns:.0} ns; \
         access on (human lines to a sink) {on} allocations {on_ns:.0} ns"
    );
}
