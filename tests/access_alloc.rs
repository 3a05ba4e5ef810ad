//! What access lines cost a request in the front layer (`http::front`),
//! counted exactly by a global allocator that counts this thread's
//! allocations: off (`log.access = false`, or a level above `info`), and
//! on (each line formatted and handed to the access logger's writer
//! thread), not one allocation more than with no subscriber at all; the
//! lines are really written (one per request); the time per request is
//! printed (recorded in docs/perf-log/2026-11-27-access-lines-outside-tracing.md,
//! "What the front layer allocates"; not asserted: timings).

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::response::{IntoResponse, Response};
use bloomgate::access::{Logger, LoggerOptions, Sink};
use bloomgate::config::LogFormat;
use bloomgate::http::front::{Counters, FrontLayer};
use futures_util::FutureExt;
use tower::{Layer, Service};

#[path = "common/counting.rs"]
mod counting;
use counting::allocations;

#[global_allocator]
static GLOBAL: counting::Counting = counting::Counting;

/// Counts the lines it is given, and keeps the last batch's first line.
#[derive(Clone, Default)]
struct Counted(Arc<Mutex<(u64, String)>>);

impl Sink for Counted {
    fn write_all(&mut self, batch: &[u8]) -> std::io::Result<()> {
        let mut c = self.0.lock().unwrap();
        c.0 += batch.iter().filter(|&&b| b == b'\n').count() as u64;
        let text = String::from_utf8_lossy(batch);
        c.1 = text.lines().next().unwrap_or_default().to_string();
        Ok(())
    }
}

/// Allocations per request and nanoseconds per request through the front
/// layer (access templates as the public router has them) around a handler
/// that answers at once, as a cache hit does; `n` requests measured.
fn per_request(n: u64) -> (u64, f64) {
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

/// One test: the access logger is the process's, installed once.
#[test]
fn access_lines_add_no_allocation_on_or_off_and_one_line_per_request() {
    const N: u64 = 20_000;
    // The switch as the binary sets it: read from the filter once it is in
    // place.
    let with = |filter: &str| {
        tracing::subscriber::with_default(subscriber(filter), || {
            bloomgate::telemetry::read_access_switch();
            per_request(N)
        })
    };
    // Before the logger is installed: nothing to write to.
    let (bare, bare_ns) = per_request(N);

    let sink = Counted::default();
    let options = |format| LoggerOptions {
        format,
        filtered_rate: bloomgate::access::UNLIMITED,
        // Large enough that the writer, a thread of its own, never falls
        // behind this loop: every line is written and the count is exact.
        slot_bytes: 64 << 20,
        flush_every: Duration::from_millis(100),
    };
    let logger = bloomgate::access::install(
        Logger::start(options(LogFormat::Human), Box::new(sink.clone())).unwrap(),
    )
    .map_err(|_| "installed twice")
    .unwrap();

    let (off_switch, off_ns) = with("info,bloomgate::access=off");
    let (off_level, _) = with("warn");
    assert_eq!(off_switch, bare, "log.access = false adds allocations");
    assert_eq!(off_level, bare, "a level above info adds allocations");
    assert!(logger.flush(Duration::from_secs(60)));
    assert_eq!(sink.0.lock().unwrap().0, 0, "lines written while off");

    let (on, on_ns) = with("info");
    assert_eq!(on, bare, "an access line allocates");
    assert!(logger.flush(Duration::from_secs(60)));
    let (lines, first) = sink.0.lock().unwrap().clone();
    assert_eq!(lines, N + 1000, "one line per request (warm-up included)");
    assert_eq!(logger.stats().dropped, 0);
    assert!(
        first.contains("route=\"/users/{id}\" status=200")
            && first.contains("request_id=\"fixed-id\""),
        "{first}"
    );
    println!(
        "front layer per request: no subscriber {bare} allocations {bare_ns:.0} ns; \
         access off {off_switch} allocations {off_ns:.0} ns; \
         access on (human lines, written by the access logger's thread) {on} allocations \
         {on_ns:.0} ns"
    );
}
