//! What a cache hit and a filtered 404 cost inside the gateway, piece by
//! piece: nanoseconds and heap allocations per operation, for
//! docs/perf-log/early-where-a-hit-spends-its-time.md.
//!
//!     cargo run --release --example hit_cost
//!     DATABASE_URL=postgres://postgres@127.0.0.1:5432/bloomgate_bench \
//!         cargo run --release --example hit_cost
//!
//! Part 1 needs nothing: each piece of the request path alone (key parse,
//! filter lookup, moka's `future` and `sync` `get`, the request id, the
//! span, the histogram, the timeout's timer, the semaphore, response
//! assembly). Part 2 runs whole requests through routers without hyper or
//! TCP (`tower::ServiceExt::oneshot`): the gateway's `http::app` (every
//! middleware layer) and its routes without the middleware, started on the
//! `bloomgate_bench` database of `bench/run.sh` when `DATABASE_URL` is set,
//! beside `examples/bare_axum.rs`'s router, which needs no database.
//!
//! Allocations are counted by a global allocator that wraps the system one
//! and counts, per thread, every `alloc` and `realloc`; every future here is
//! polled on the measuring thread, so the counts are exact. Times are the
//! median of 7 rounds: on a shared 2-core machine read them as orders of
//! magnitude and compare within one run; the allocation counts are exact.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::future::Future;
use std::hint::black_box;
use std::pin::pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, Request, StatusCode, header};
use axum::response::IntoResponse;
use bloomgate::cache::Row;
use bloomgate::config::{Config, LogConfig, LogFormat};
use bloomgate::encoding::Coding;
use bloomgate::filter::{FilterKey, Item, KeyKind, KeySetBuilder, Mode};
use bloomgate::gateway::Gateway;
use bloomgate::key::{self, Key, KeyType};
use bytes::Bytes;
use std::convert::Infallible;
use tower::ServiceExt;

struct Counting;

thread_local! {
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

fn count() {
    // `try_with`: the thread-local may already be gone while a thread exits.
    let _ = ALLOCS.try_with(|n| n.set(n.get() + 1));
}

// SAFETY: every call is forwarded unchanged to the system allocator.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count();
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn allocs() -> u64 {
    ALLOCS.with(Cell::get)
}

const ROUNDS: usize = 7;

/// Runs `op` `n` times per round: (median ns per op, allocations per op).
fn measure(n: u64, mut op: impl FnMut(u64)) -> (f64, f64) {
    for i in 0..n.min(1000) {
        op(i); // warm caches and lazily built state
    }
    let mut times = Vec::with_capacity(ROUNDS);
    let a0 = allocs();
    for _ in 0..ROUNDS {
        let t0 = Instant::now();
        for i in 0..n {
            op(i);
        }
        times.push(t0.elapsed().as_nanos() as f64 / n as f64);
    }
    let per_op = (allocs() - a0) as f64 / (n * ROUNDS as u64) as f64;
    times.sort_by(f64::total_cmp);
    (times[ROUNDS / 2], per_op)
}

fn row(name: &str, n: u64, op: impl FnMut(u64)) {
    let (ns, a) = measure(n, op);
    println!("| {name} | {ns:.0} | {a:.2} |");
}

/// `op` on two threads at once, `n` times each per round, as the gateway's
/// two workers run the fast paths: what memory both write costs shows here
/// and not in [`row`]. Median wall-clock ns per op per thread, and
/// allocations per op.
fn row2(name: &str, n: u64, op: impl Fn(u64) + Sync) {
    let mut times = Vec::with_capacity(ROUNDS);
    let mut total_allocs = 0;
    for _ in 0..ROUNDS {
        let t0 = Instant::now();
        total_allocs += std::thread::scope(|s| {
            let run = || {
                let a0 = allocs();
                for i in 0..n {
                    op(i);
                }
                allocs() - a0
            };
            let a = s.spawn(run);
            let b = s.spawn(run);
            a.join().unwrap() + b.join().unwrap()
        });
        times.push(t0.elapsed().as_nanos() as f64 / n as f64);
    }
    times.sort_by(f64::total_cmp);
    let a = total_allocs as f64 / (2 * n * ROUNDS as u64) as f64;
    println!(
        "| {name}, two threads at once | {:.0} | {a:.2} |",
        times[ROUNDS / 2]
    );
}

/// Polls a future that is expected to be ready at once (a hit, a filtered
/// 404: nothing on those paths waits), as a server's first poll would.
fn ready<F: Future>(f: F) -> F::Output {
    let mut f = pin!(f);
    match f.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(v) => v,
        Poll::Pending => panic!("expected a future that completes on its first poll"),
    }
}

/// `examples/bare_axum.rs`: its handler and router are measured here as
/// they are served there. (Its `main` is that binary's, unused here.)
#[allow(dead_code)]
#[path = "bare_axum.rs"]
mod bare_axum;
use bare_axum::BODY;

fn pieces(rt: &tokio::runtime::Runtime) {
    println!("| piece | ns / op | allocations / op |");
    println!("|---|---:|---:|");
    let n = 200_000;

    row("key parse (`key::parse`, bigint)", n, |i| {
        black_box(
            key::parse(
                black_box(if i & 1 == 0 { "500000" } else { "1234567890" }),
                KeyType::Bigint,
                256,
            )
            .ok(),
        );
    });

    for (label, mode) in [
        ("exact (shipped: `auto` on 1M dense ids)", Mode::Auto),
        ("Bloom", Mode::Bloom),
    ] {
        let mut b = KeySetBuilder::new(mode, KeyKind::Int, 1_500_000, 0.01, FilterKey::random())
            .expect("filter");
        for v in 1..=1_000_000 {
            b.insert(Item::Int(v));
        }
        let set = b.finish();
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        row(&format!("filter lookup, absent key, {label}"), n, |_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let k = 1_000_000_001 + (x % 1_000_000_000) as i64;
            black_box(set.contains(Item::Int(k)));
        });
    }

    // The gateway's row cache as configured: 100k rows, 60 s TTL, holding the
    // hit workload's 10,000 rows.
    let fcache: moka::future::Cache<Key, Arc<Row>> = moka::future::Cache::builder()
        .max_capacity(100_000)
        .time_to_live(Duration::from_secs(60))
        .build();
    let scache: moka::sync::Cache<Key, Arc<Row>> = moka::sync::Cache::builder()
        .max_capacity(100_000)
        .time_to_live(Duration::from_secs(60))
        .build();
    let r = Arc::new(Row::new(Bytes::from_static(BODY)));
    for k in 1..=10_000 {
        ready(fcache.insert(Key::Int(k), r.clone()));
        scache.insert(Key::Int(k), r.clone());
    }
    ready(fcache.run_pending_tasks());
    scache.run_pending_tasks();
    row("moka `future::Cache::get`, hit (10k of 100k)", n, |i| {
        black_box(ready(fcache.get(&Key::Int((i % 10_000) as i64 + 1))));
    });
    row("moka `sync::Cache::get`, hit (10k of 100k)", n, |i| {
        black_box(scache.get(&Key::Int((i % 10_000) as i64 + 1)));
    });

    // SetRequestId with MakeRequestUuid: uuid v4, to a String, parsed into a
    // HeaderValue (tower-http 0.7 `MakeRequestUuid`).
    row(
        "request id: `Uuid::new_v4().to_string().parse::<HeaderValue>()`",
        n,
        |_| {
            black_box(uuid::Uuid::new_v4().to_string().parse::<HeaderValue>().ok());
        },
    );
    let mut req_headers = HeaderMap::new();
    req_headers.insert(header::HOST, HeaderValue::from_static("127.0.0.1:18080"));
    row(
        "header lookup by `&str` name (`get(\"x-request-id\")`)",
        n,
        |_| {
            black_box(black_box(&req_headers).get("x-request-id"));
        },
    );
    row(
        "extensions: insert one value into a fresh `Extensions`",
        n,
        |_| {
            let mut e = axum::http::Extensions::new();
            e.insert(black_box(7u64));
            black_box(e);
        },
    );

    // The serve command's subscriber at its default level, so `debug_span!`
    // is as disabled as in production.
    bloomgate::telemetry::init(&LogConfig {
        format: LogFormat::Json,
        level: "info".into(),
        access: false,
        ..LogConfig::default()
    });
    let m = "GET";
    row("`debug_span!` while debug is off", n, |_| {
        black_box(tracing::debug_span!("request", method = %m, path = %"/users/1", id = ""));
    });
    row("`Instant::now()` and `elapsed()`", n, |_| {
        black_box(Instant::now().elapsed());
    });

    let latency = bloomgate::histogram::Histogram::default();
    row(
        "histogram record (bloomgate's, sharded by thread)",
        n,
        |i| {
            latency.record(black_box(Duration::from_nanos(i)));
        },
    );
    // What the gateway used before: the exporter's histogram, which keeps
    // samples until an upkeep pass folds them.
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new()
        .set_buckets(&bloomgate::histogram::BOUNDS)
        .expect("buckets")
        .build_recorder();
    let handle = recorder.handle();
    let exporter = metrics::with_local_recorder(
        &recorder,
        || metrics::histogram!("latency", "resource" => "users", "outcome" => "hit"),
    );
    row("histogram record (metrics-exporter-prometheus)", n, |i| {
        exporter.record(black_box(i as f64 * 1e-9));
        if i % 100_000 == 0 {
            handle.run_upkeep(); // as the gateway ran it every few seconds
        }
    });
    row2(
        "histogram record (bloomgate's, sharded by thread)",
        n,
        |i| {
            latency.record(black_box(Duration::from_nanos(i)));
        },
    );
    row2("histogram record (metrics-exporter-prometheus)", n, |i| {
        exporter.record(black_box(i as f64 * 1e-9));
        if i % 100_000 == 0 {
            handle.run_upkeep();
        }
    });
    let plain = std::sync::atomic::AtomicU64::new(0);
    let sharded = bloomgate::counter::Counter::default();
    row2("counter: one shared `AtomicU64`", n, |_| {
        plain.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    });
    row2("counter: `counter::Counter` (sharded by thread)", n, |_| {
        sharded.add(1);
    });

    let _guard = rt.enter();
    row(
        "timeout timer: `tokio::time::sleep(5 s)` built and dropped unpolled",
        n,
        |_| {
            drop(black_box(tokio::time::sleep(Duration::from_secs(5))));
        },
    );
    let sem = Arc::new(tokio::sync::Semaphore::new(1024));
    row("semaphore: `try_acquire_owned` + release", n, |_| {
        black_box(sem.clone().try_acquire_owned().ok());
    });

    row(
        "response, bare: bare_axum's handler (200, body, content-type)",
        n,
        |_| {
            black_box(ready(bare_axum::user()));
        },
    );
    let rid = HeaderValue::from_static("0b7c6f1e-3f0e-4d52-9a8b-2c1d5e6f7a8b");
    row(
        "response, hit: + ETag cut from the row + Cache-Status + x-request-id",
        n,
        |_| {
            let sent = r.clone().sent(Coding::Identity);
            let mut resp = (StatusCode::OK, sent.body).into_response();
            let h = resp.headers_mut();
            h.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            h.insert(header::ETAG, sent.etag);
            h.insert("cache-status", HeaderValue::from_static("bloomgate; hit"));
            h.insert("x-request-id", rid.clone());
            black_box(resp);
        },
    );
    println!();
}

fn request(path: &'static str) -> Request<Body> {
    Request::get(path)
        .header(header::HOST, "127.0.0.1:18080")
        .body(Body::empty())
        .expect("request")
}

/// One request through `router`, answered on the first poll.
fn through<S>(router: &S, path: &'static str, status: StatusCode)
where
    S: tower::Service<Request<Body>, Response = axum::response::Response, Error = Infallible>
        + Clone,
{
    let resp = ready(router.clone().oneshot(request(path))).expect("infallible");
    assert_eq!(resp.status(), status, "{path}");
    black_box(resp);
}

fn routers(rt: &tokio::runtime::Runtime) {
    let n = 50_000;
    println!("| whole request, no hyper (`oneshot`) | ns / op | allocations / op |");
    println!("|---|---:|---:|");
    row(
        "building the request alone (subtract it from the rows below)",
        n,
        |_| {
            black_box(request("/users/500000"));
        },
    );
    let bare = bare_axum::app();
    row("bare_axum router", n, |_| {
        through(&bare, "/users/500000", StatusCode::OK)
    });

    let Ok(url) = std::env::var("DATABASE_URL") else {
        println!(
            "\n(DATABASE_URL unset: the gateway's rows need `bloomgate_bench`, see the module doc)"
        );
        return;
    };
    let mut config = Config::load(std::path::Path::new("config/bloomgate.toml")).expect("config");
    config.database.url = url;
    config.database.freshness = bloomgate::config::Freshness::Off;
    let _guard = rt.enter(); // the pool's maintenance task is spawned at once
    let gw = Gateway::new(config, &Default::default()).expect("gateway");
    rt.block_on(gw.start()).expect("start-up");
    let app = bloomgate::http::app(gw.clone());
    let (routes, _) = bloomgate::http::public_routes(&gw).split_for_parts();
    let bare_routes: Router = routes.with_state(gw.clone());
    // Load the row once; from then on it is a hit.
    rt.block_on(bare_routes.clone().oneshot(request("/users/500000")))
        .expect("infallible");
    let label = "gateway `http::app` (every layer)";
    row(&format!("{label}: hit"), n, |_| {
        through(&app, "/users/500000", StatusCode::OK)
    });
    row(&format!("{label}: filtered 404"), n, |_| {
        through(&app, "/users/1500000000", StatusCode::NOT_FOUND)
    });
    let label = "gateway routes without the middleware";
    row(&format!("{label}: hit"), n, |_| {
        through(&bare_routes, "/users/500000", StatusCode::OK)
    });
    row(&format!("{label}: filtered 404"), n, |_| {
        through(&bare_routes, "/users/1500000000", StatusCode::NOT_FOUND)
    });
    gw.stop();
}

fn main() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    pieces(&rt);
    routers(&rt);
}
