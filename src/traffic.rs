//! `Traffic`: what the listeners see before any resource does: requests
//! refused by the front layer (shed, timed out, body too large), by the
//! router (no route, wrong method) or by hyper (request head too large),
//! requests and connections in flight against their bounds. Its snapshot
//! puts the requests no resource answered into `bloomgate_requests_total`
//! without a `resource` label, so that the sum over every series of that
//! family is all traffic.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::exposition::{Exposition, Labels};

/// The request counter's family, shared by every resource's samples
/// (`resource::stats`) and the requests no resource answered (here).
pub const REQUESTS_TOTAL: &str = "bloomgate_requests_total";
pub const REQUESTS_TOTAL_HELP: &str =
    "Requests to each resource by outcome: every request, shed and timed out included.";

type Probe = Box<dyn Fn() -> usize + Send + Sync>;

#[derive(Default)]
pub struct Traffic {
    /// Requests refused at `max_concurrency` in flight (every router).
    pub shed: AtomicU64,
    /// Requests past their deadline (every router).
    pub timeouts: AtomicU64,
    pub no_route: AtomicU64,
    pub method_not_allowed: AtomicU64,
    pub body_too_large: AtomicU64,
    /// Request heads over `max_header_bytes` or `max_headers` (hyper's 431).
    pub header_too_large: AtomicU64,
    /// Client connections open on the public listener.
    pub connections: AtomicU64,
    /// Requests in flight on the public router, as its front layer counts
    /// them (set when the router is built).
    in_flight: Mutex<Option<Probe>>,
}

impl std::fmt::Debug for Traffic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Traffic")
            .field("shed", &self.shed)
            .field("timeouts", &self.timeouts)
            .finish_non_exhaustive()
    }
}

impl Traffic {
    /// Where the public router's requests in flight are read.
    pub fn set_in_flight(&self, probe: impl Fn() -> usize + Send + Sync + 'static) {
        *self.in_flight.lock().unwrap_or_else(|p| p.into_inner()) = Some(Box::new(probe));
    }

    pub fn snapshot(&self) -> TrafficSnapshot {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let in_flight = self
            .in_flight
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map_or(0, |f| f());
        TrafficSnapshot {
            shed: l(&self.shed),
            timeouts: l(&self.timeouts),
            no_route: l(&self.no_route),
            method_not_allowed: l(&self.method_not_allowed),
            body_too_large: l(&self.body_too_large),
            header_too_large: l(&self.header_too_large),
            connections: l(&self.connections),
            in_flight: in_flight as u64,
            ..TrafficSnapshot::default()
        }
    }
}

/// The listeners at one moment. The bounds and the resources' shares of
/// `shed` and `timeouts` are filled in by whoever knows them (the gateway).
#[derive(Clone, Debug, Default)]
pub struct TrafficSnapshot {
    pub shed: u64,
    pub timeouts: u64,
    pub no_route: u64,
    pub method_not_allowed: u64,
    pub body_too_large: u64,
    pub header_too_large: u64,
    pub connections: u64,
    pub in_flight: u64,
    /// Of `shed` and `timeouts`, those counted under a resource.
    pub shed_by_resources: u64,
    pub timeouts_by_resources: u64,
    pub max_connections: u64,
    pub max_concurrency: u64,
    pub loads_in_flight: u64,
}

crate::expose_fields!(TrafficSnapshot {
    connections => gauge("bloomgate_connections", "Client connections open on the public listener."),
    max_connections => gauge(
        "bloomgate_connections_max",
        "server.max_connections: at the bound, new connections wait in the listen backlog."
    ),
    in_flight => gauge("bloomgate_requests_in_flight", "Requests being handled on the public listener."),
    max_concurrency => gauge(
        "bloomgate_requests_in_flight_max",
        "server.max_concurrency: past it, requests and row loads are shed (503)."
    ),
    loads_in_flight => gauge(
        "bloomgate_row_loads_in_flight",
        "Row loads running, attached to a request or not (bounded by server.max_concurrency)."
    ),
});

impl TrafficSnapshot {
    /// The table above, and the requests no resource answered as
    /// `bloomgate_requests_total` without a `resource` label.
    pub fn expose_all(&self, out: &mut Exposition) {
        use crate::exposition::Expose;
        let none: Labels<'_> = &[];
        self.expose(none, out);
        for (outcome, n) in [
            ("shed", self.shed.saturating_sub(self.shed_by_resources)),
            (
                "timeout",
                self.timeouts.saturating_sub(self.timeouts_by_resources),
            ),
            ("no_route", self.no_route),
            ("method_not_allowed", self.method_not_allowed),
            ("body_too_large", self.body_too_large),
            ("header_too_large", self.header_too_large),
        ] {
            out.counter(
                REQUESTS_TOTAL,
                REQUESTS_TOTAL_HELP,
                &[("outcome", outcome)],
                n as f64,
            );
        }
    }
}
