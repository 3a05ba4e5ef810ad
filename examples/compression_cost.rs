//! What the compression layer adds to a cache hit, counted in instructions
//! (callgrind `Ir`), for BENCHMARKS.md's `## Compression` (the run:
//! docs/perf-log/2026-11-22-compressed-rows.md).
//!
//! One cached row is requested `N` times through the gateway's whole router
//! (`http::app`, every middleware layer, `tower::ServiceExt::oneshot`, no
//! hyper or TCP), each request answered on its first poll. Only the function
//! `measured_hits` is counted:
//!
//!     DATABASE_URL=postgres://postgres@127.0.0.1:5432/bloomgate_comp \
//!       valgrind --tool=callgrind --toggle-collect='*measured_hits*' \
//!       target/release/examples/compression_cost
//!
//! `bench/compression.sh` builds this example for the commit under test and
//! for the commit before the compression layer, and runs both (and the new
//! build with `BLOOMGATE_CACHE__COMPRESSION=false`): instructions per hit
//! are the counted total over `N`. Environment: `HIT_PATH` [/users/500],
//! `N` [20000], `ACCEPT_ENCODING` [`gzip, deflate, br, zstd`, what browsers
//! send; empty: no header].
//!
//! It only uses what every build since the layer's parent has (`Config`,
//! `Gateway`, `http::app`), so the same file measures both.

use std::future::Future;
use std::hint::black_box;
use std::pin::pin;
use std::task::{Context, Poll, Waker};
use std::time::Instant;

use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use bloomgate::config::Config;
use bloomgate::gateway::Gateway;
use bloomgate::http::App;
use tower::ServiceExt;

/// Polls a future that must be ready at once (a hit waits on nothing).
fn ready<F: Future>(f: F) -> F::Output {
    let mut f = pin!(f);
    match f.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(v) => v,
        Poll::Pending => panic!("a hit must complete on its first poll"),
    }
}

fn request(path: &str, accept: &str) -> Request<Body> {
    let mut b = Request::get(path).header(header::HOST, "127.0.0.1:18080");
    if !accept.is_empty() {
        b = b.header(header::ACCEPT_ENCODING, accept);
    }
    b.body(Body::empty()).expect("request")
}

/// The counted part: `n` hits, request built, routed, answered, dropped.
#[inline(never)]
fn measured_hits(router: &App, path: &str, accept: &str, n: u64) -> u64 {
    let mut bytes = 0;
    for _ in 0..n {
        let resp = ready(router.clone().oneshot(request(path, accept))).expect("infallible");
        assert_eq!(resp.status(), StatusCode::OK);
        bytes += resp.headers().len() as u64;
        black_box(resp);
    }
    bytes
}

fn main() {
    let path = std::env::var("HIT_PATH").unwrap_or_else(|_| "/users/500".into());
    let accept =
        std::env::var("ACCEPT_ENCODING").unwrap_or_else(|_| "gzip, deflate, br, zstd".into());
    let n: u64 = std::env::var("N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000);
    let url = std::env::var("DATABASE_URL").expect("DATABASE_URL: see the module doc");

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let mut config = Config::load(std::path::Path::new("config/bloomgate.toml")).expect("config");
    config.database.url = url;
    config.database.freshness = bloomgate::config::Freshness::Off;
    let _guard = rt.enter(); // the pool's maintenance task is spawned at once
    let gw = Gateway::new(config, &Default::default()).expect("gateway");
    rt.block_on(gw.start()).expect("start-up");
    let app = bloomgate::http::app(gw.clone());

    // Load the row (and compress it, if the build does); from then on a hit.
    let first = rt
        .block_on(app.clone().oneshot(request(&path, &accept)))
        .expect("infallible");
    assert_eq!(first.status(), StatusCode::OK, "{path}");
    let coding = first
        .headers()
        .get(header::CONTENT_ENCODING)
        .map_or("identity".into(), |v| v.to_str().unwrap_or("?").to_string());
    // A few unmeasured hits: lazily built state, moka's first read.
    measured_warmup(&app, &path, &accept);

    let t0 = Instant::now();
    black_box(measured_hits(&app, &path, &accept, n));
    let ns = t0.elapsed().as_nanos() as f64 / n as f64;
    println!("path={path} accept={accept:?} coding={coding} n={n} ns_per_hit={ns:.0}");
    gw.stop();
}

#[inline(never)]
fn measured_warmup(router: &App, path: &str, accept: &str) {
    for _ in 0..100 {
        let resp = ready(router.clone().oneshot(request(path, accept))).expect("infallible");
        black_box(resp);
    }
}
