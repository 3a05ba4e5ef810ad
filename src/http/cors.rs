//! Cross-origin reads (CORS, the Fetch standard) for the pages
//! `[server.cors]` lists: the front layer asks [`Cors::ask`] before any
//! other work on a request and [`Cors::apply`] to its answer.
//!
//! # Guarantees (tested below and in `tests/it/http/cors.rs`)
//! - A preflight (`OPTIONS` with `Origin` and
//!   `Access-Control-Request-Method`) from a listed origin is answered 204
//!   by the front layer, before any access check: a preflight carries no
//!   credential, so a check would refuse every one. It says the origin,
//!   `GET, HEAD`, the allowed request headers and `Access-Control-Max-Age`;
//!   the browser compares them with what its request needs.
//! - Any other request from a listed origin is answered as without CORS,
//!   plus `Access-Control-Allow-Origin` (the origin, or `*`) and
//!   `Access-Control-Expose-Headers` (the headers a script may read
//!   besides the safelisted ones): every status, errors included, so a
//!   page can read a 401's reason or a 429's `Retry-After`.
//! - An origin not listed, or none, gets no `Access-Control-*` header, and
//!   its `OPTIONS` is the 405 it would be without CORS.
//! - While CORS is on, every answer says `Vary: Origin` (merged with the
//!   `Vary` already there), whatever the origin: an HTTP cache in front
//!   keeps each origin's answer apart from the others'.
//! - `Access-Control-Allow-Credentials` is never sent: bearer tokens and
//!   API keys are headers a script sets, which a preflight allows; cookies
//!   are not read.
//!
//! Off (`allow_origins` empty) there is no `Cors` and the front layer
//! does nothing of this: one branch on an `Option`.

use std::sync::Mutex;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, Request, StatusCode, header};
use axum::response::Response;

use super::response::static_header;
use crate::config::CorsConfig;

/// What a script may read of an answer besides the safelisted headers.
const EXPOSE: HeaderValue =
    HeaderValue::from_static("ETag, Cache-Status, Retry-After, RateLimit, RateLimit-Policy");
const METHODS: HeaderValue = HeaderValue::from_static("GET, HEAD");
const ORIGIN: HeaderValue = HeaderValue::from_static("origin");
/// `Vary` of a row that may come in several codings, with `Origin` added
/// (`http::lookup`'s value): merged without a second header line.
const ENCODING_AND_ORIGIN: HeaderValue = HeaderValue::from_static("accept-encoding, origin");
const ANY: HeaderValue = HeaderValue::from_static("*");
static REQUEST_METHOD: HeaderName = HeaderName::from_static("access-control-request-method");

/// `[server.cors]`, prepared once; every header value is `'static`
/// (`response::static_header`), so an answer copies it.
#[derive(Debug, PartialEq, Eq)]
pub struct Cors {
    /// Each listed origin as it is compared, and as it is answered.
    origins: Vec<(Box<[u8]>, HeaderValue)>,
    any: bool,
    allow_headers: Option<HeaderValue>,
    max_age: HeaderValue,
}

/// What a request's answer carries ([`Cors::apply`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Answer {
    /// CORS is off: nothing.
    Off,
    /// An origin not listed, or none: `Vary: Origin` alone.
    Vary,
    /// The origin listed at this index (any origin for `"*"`).
    Allow(u16),
}

/// What [`Cors::ask`] found.
pub enum Asked {
    /// A preflight of a listed origin, answered.
    Preflight(Response),
    /// Anything else: what its answer will carry.
    Answer(Answer),
}

impl Cors {
    /// `None` while CORS is off. The same configuration gives the same
    /// `&'static Cors` (kept once per distinct configuration, as
    /// `response::static_header` keeps values): the front layer's future
    /// reads it without holding a reference count.
    pub fn new(cfg: &CorsConfig) -> Option<&'static Cors> {
        if !cfg.enabled() {
            return None;
        }
        let value = |v: &str| static_header(v).expect("config validation checks origins");
        let cors = Cors {
            any: cfg.any_origin(),
            origins: cfg
                .allow_origins
                .iter()
                .filter(|o| *o != "*")
                .map(|o| (o.as_bytes().into(), value(o)))
                .collect(),
            allow_headers: (!cfg.allow_headers.is_empty())
                .then(|| value(&cfg.allow_headers.join(", "))),
            max_age: value(&cfg.max_age.as_secs().to_string()),
        };
        Some(interned(cors))
    }

    /// What `req` asks of CORS: a preflight of a listed origin (answered
    /// here), or what its answer will carry.
    pub fn ask<B>(&self, req: &Request<B>) -> Asked {
        let answer = match self.listed(req.headers()) {
            Some(i) => Answer::Allow(i),
            None => return Asked::Answer(Answer::Vary),
        };
        if req.method() == Method::OPTIONS
            && req.uri() != "*"
            && req.headers().contains_key(&REQUEST_METHOD)
        {
            let mut resp = Response::new(Body::empty());
            *resp.status_mut() = StatusCode::NO_CONTENT;
            let h = resp.headers_mut();
            h.insert(header::ACCESS_CONTROL_ALLOW_METHODS, METHODS);
            if let Some(allowed) = &self.allow_headers {
                h.insert(header::ACCESS_CONTROL_ALLOW_HEADERS, allowed.clone());
            }
            h.insert(header::ACCESS_CONTROL_MAX_AGE, self.max_age.clone());
            if let Answer::Allow(i) = answer {
                h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, self.origin(i));
            }
            vary_origin(h);
            return Asked::Preflight(resp);
        }
        Asked::Answer(answer)
    }

    /// The index of the request's one `Origin` among the listed origins
    /// (0 for any origin, with `"*"`).
    fn listed(&self, headers: &HeaderMap) -> Option<u16> {
        let mut all = headers.get_all(header::ORIGIN).iter();
        let (Some(origin), None) = (all.next(), all.next()) else {
            return None;
        };
        if self.any {
            return Some(0);
        }
        let origin = origin.as_bytes();
        self.origins
            .iter()
            .position(|(o, _)| **o == *origin)
            .and_then(|i| u16::try_from(i).ok())
    }

    /// Adds to `resp` what `answer` says it carries.
    pub fn apply(&self, answer: Answer, resp: &mut Response) {
        let h = resp.headers_mut();
        match answer {
            Answer::Off => return,
            Answer::Vary => {}
            Answer::Allow(i) => {
                h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, self.origin(i));
                h.insert(header::ACCESS_CONTROL_EXPOSE_HEADERS, EXPOSE);
            }
        }
        vary_origin(h);
    }

    /// `Access-Control-Allow-Origin` for the origin listed at `i`.
    fn origin(&self, i: u16) -> HeaderValue {
        match self.any {
            true => ANY,
            false => self.origins[usize::from(i)].1.clone(),
        }
    }
}

/// `Vary` with `origin` in it: set, merged into `accept-encoding` (the one
/// value the gateway sets), or added as a line of its own.
fn vary_origin(h: &mut HeaderMap) {
    match h.get(header::VARY) {
        None => {
            h.insert(header::VARY, ORIGIN);
        }
        Some(v) if v.as_bytes().eq_ignore_ascii_case(b"accept-encoding") => {
            h.insert(header::VARY, ENCODING_AND_ORIGIN);
        }
        Some(_) => {
            h.append(header::VARY, ORIGIN);
        }
    }
}

/// `c` for the rest of the process, kept once per distinct configuration
/// (tests build many apps with the same few).
fn interned(c: Cors) -> &'static Cors {
    static KEPT: Mutex<Vec<&'static Cors>> = Mutex::new(Vec::new());
    let mut kept = KEPT.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(k) = kept.iter().find(|k| ***k == c) {
        return k;
    }
    let c: &'static Cors = Box::leak(Box::new(c));
    kept.push(c);
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cors(origins: &[&str]) -> &'static Cors {
        Cors::new(&CorsConfig {
            allow_origins: origins.iter().map(|o| o.to_string()).collect(),
            ..CorsConfig::default()
        })
        .unwrap()
    }

    fn req(method: Method, origin: Option<&str>, preflight: bool) -> Request<Body> {
        let mut r = Request::builder().method(method).uri("/users/1");
        if let Some(o) = origin {
            r = r.header("origin", o);
        }
        if preflight {
            r = r.header("access-control-request-method", "GET");
        }
        r.body(Body::empty()).unwrap()
    }

    fn answered(c: &Cors, r: &Request<Body>) -> Response {
        match c.ask(r) {
            Asked::Preflight(resp) => resp,
            Asked::Answer(a) => {
                let mut resp = Response::new(Body::empty());
                c.apply(a, &mut resp);
                resp
            }
        }
    }

    #[test]
    fn off_is_none() {
        assert!(Cors::new(&CorsConfig::default()).is_none());
    }

    #[test]
    fn a_listed_origins_preflight_is_answered_and_its_reads_may_be_read() {
        let c = cors(&["https://a.example", "http://localhost:3000"]);
        let pre = answered(
            c,
            &req(Method::OPTIONS, Some("http://localhost:3000"), true),
        );
        assert_eq!(pre.status(), StatusCode::NO_CONTENT);
        let h = pre.headers();
        assert_eq!(h["access-control-allow-origin"], "http://localhost:3000");
        assert_eq!(h["access-control-allow-methods"], "GET, HEAD");
        assert_eq!(
            h["access-control-allow-headers"],
            "Authorization, If-None-Match, If-Match, X-Request-Id"
        );
        assert_eq!(h["access-control-max-age"], "600");
        assert_eq!(h["vary"], "origin");
        assert!(!h.contains_key("access-control-expose-headers"));
        let get = answered(c, &req(Method::GET, Some("https://a.example"), false));
        assert_eq!(
            get.headers()["access-control-allow-origin"],
            "https://a.example"
        );
        assert_eq!(
            get.headers()["access-control-expose-headers"],
            "ETag, Cache-Status, Retry-After, RateLimit, RateLimit-Policy"
        );
    }

    #[test]
    fn an_unlisted_origin_or_none_gets_vary_alone() {
        let c = cors(&["https://a.example"]);
        for r in [
            req(Method::GET, Some("https://evil.example"), false),
            req(Method::GET, Some("https://a.example.evil"), false),
            req(Method::GET, Some("https://A.example"), false),
            req(Method::GET, None, false),
            req(Method::OPTIONS, Some("https://evil.example"), true),
        ] {
            assert!(matches!(c.ask(&r), Asked::Answer(Answer::Vary)), "{r:?}");
            let resp = answered(c, &r);
            assert!(
                !resp
                    .headers()
                    .keys()
                    .any(|k| k.as_str().starts_with("access-control-")),
                "{r:?}"
            );
            assert_eq!(resp.headers()["vary"], "origin");
        }
        // An OPTIONS that is no preflight goes on (to its 405), with the
        // origin's headers as any answer.
        let r = req(Method::OPTIONS, Some("https://a.example"), false);
        assert!(matches!(c.ask(&r), Asked::Answer(Answer::Allow(0))));
        // Two Origin lines: which one? Neither.
        let mut r = req(Method::GET, Some("https://a.example"), false);
        r.headers_mut()
            .append("origin", HeaderValue::from_static("https://a.example"));
        assert!(matches!(c.ask(&r), Asked::Answer(Answer::Vary)));
    }

    #[test]
    fn any_origin_is_answered_with_a_star() {
        let c = cors(&["*"]);
        let resp = answered(c, &req(Method::GET, Some("https://whoever.example"), false));
        assert_eq!(resp.headers()["access-control-allow-origin"], "*");
    }

    #[test]
    fn vary_is_merged_with_what_is_there() {
        let mut h = HeaderMap::new();
        vary_origin(&mut h);
        assert_eq!(h["vary"], "origin");
        let mut h = HeaderMap::new();
        h.insert(header::VARY, HeaderValue::from_static("accept-encoding"));
        vary_origin(&mut h);
        assert_eq!(h.get_all(header::VARY).iter().count(), 1);
        assert_eq!(h["vary"], "accept-encoding, origin");
        let mut h = HeaderMap::new();
        h.insert(header::VARY, HeaderValue::from_static("x-other"));
        vary_origin(&mut h);
        let all: Vec<_> = h.get_all(header::VARY).iter().collect();
        assert_eq!(all, ["x-other", "origin"]);
    }

    /// Through the front layer: the preflight never reaches the service
    /// (which would ask for a credential), every other answer, a refusal
    /// of the front layer's own included, carries the origin's headers.
    #[test]
    fn the_front_layer_answers_preflights_and_marks_every_answer() {
        use crate::http::front::{Counters, FrontLayer};
        use futures_util::FutureExt;
        use tower::{Layer, Service};

        let counters = Counters {
            traffic: Default::default(),
            on_shed: None,
        };
        let mut svc = FrontLayer::new(100, 16, None, counters)
            .with_cors(Some(cors(&["https://a.example"])))
            .layer(tower::service_fn(|req: Request<Body>| {
                assert_ne!(
                    req.method(),
                    Method::OPTIONS,
                    "a preflight reached the service"
                );
                let mut resp = Response::new(Body::empty());
                *resp.status_mut() = StatusCode::UNAUTHORIZED;
                std::future::ready(Ok::<_, std::convert::Infallible>(resp))
            }));
        let mut call = |r: Request<Body>| svc.call(r).now_or_never().unwrap().unwrap();
        let pre = call(req(Method::OPTIONS, Some("https://a.example"), true));
        assert_eq!(pre.status(), StatusCode::NO_CONTENT);
        assert_eq!(
            pre.headers()["access-control-allow-origin"],
            "https://a.example"
        );
        assert!(pre.headers().contains_key("x-request-id"));
        let refused = call(req(Method::GET, Some("https://a.example"), false));
        assert_eq!(refused.status(), StatusCode::UNAUTHORIZED);
        assert_eq!(
            refused.headers()["access-control-allow-origin"],
            "https://a.example"
        );
        assert_eq!(refused.headers()["vary"], "origin");
        let mut big = req(Method::GET, Some("https://a.example"), false);
        big.headers_mut()
            .insert(header::CONTENT_LENGTH, HeaderValue::from_static("101"));
        let too_large = call(big);
        assert_eq!(too_large.status(), StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(
            too_large.headers()["access-control-allow-origin"],
            "https://a.example"
        );
        let other = call(req(Method::GET, Some("https://b.example"), false));
        assert!(!other.headers().contains_key("access-control-allow-origin"));
        assert_eq!(other.headers()["vary"], "origin");
    }

    #[test]
    fn one_configuration_is_kept_once() {
        assert!(std::ptr::eq(
            cors(&["https://a.example"]),
            cors(&["https://a.example"])
        ));
        assert!(!std::ptr::eq(
            cors(&["https://a.example"]),
            cors(&["https://b.example"])
        ));
    }
}
