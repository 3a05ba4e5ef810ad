//! `GET {route}`: one key of one resource.
//!
//! Parse, then the access checks, then filter, then cache, then database: a
//! key that does not parse cannot exist, a caller refused is answered before
//! any storage is asked (the same answer whether the key exists or not),
//! and a key the filter rejects is answered without any storage work. Every
//! response carries RFC 9211 `Cache-Status` saying which of those steps
//! answered it.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, Request, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;

use super::response::{CACHE_STATUS, json_bytes, static_bytes, static_header};
use crate::auth::verified::Verified;
use crate::auth::{Allowance, Auth, Caller, Policy, RATELIMIT, RATELIMIT_POLICY, peer::PeerAddr};
use crate::cache::{Outcome, Row};
use crate::encoding::{self, Coding, Parts};
use crate::error::Error;
use crate::key::Key;
use crate::resource::{Load, Lookup, Now, RequestOutcome, Resource};

/// What a route needs, prepared once.
pub struct Route {
    pub resource: Arc<Resource>,
    pub max_key_length: usize,
    /// `server.request_timeout`: a lookup dropped later than this after it
    /// began was dropped at the deadline (see [`finish`]'s guard).
    pub request_timeout: std::time::Duration,
    /// Which `/`-separated segment of the path is the key; for a composite
    /// key, each part's, in key column order. The key is read from the raw
    /// path rather than from axum's path parameters, which come
    /// percent-decoded already: decoding is ours to do, strictly and once.
    pub key_segments: Box<[usize]>,
    /// The 404 body, the same for every absent key, and its length. These
    /// and the `Cache-Control` values (when visible ASCII, which config
    /// validation ensures) are `'static` (`static_header`): a clone per
    /// response is a copy, not a shared reference count.
    pub not_found: Bytes,
    pub not_found_length: HeaderValue,
    /// `Cache-Control` of a row and of an absent key (`[cache]
    /// http_cache_control`, `http_cache_control_not_found`), checked at
    /// start-up and built once.
    pub row_cache_control: HeaderValue,
    pub not_found_cache_control: HeaderValue,
    /// Rows of this resource may come in several codings: every row
    /// response says `Vary: Accept-Encoding`.
    pub vary: bool,
    /// The gateway's access checks, and this resource's rules among them.
    pub auth: Arc<Auth>,
    policy: usize,
    /// Anything to check before the filter (`Policy::guarded`).
    pub guarded: bool,
    /// Another owner's key is refused before the filter.
    owner_on_key: bool,
    /// Another owner's row is refused once the cache returns it.
    owner_on_row: bool,
    /// With an owner column every 404 reads alike (see [`HIDDEN`]).
    hide_absence: bool,
}

/// `Cache-Status` of every 404 of a resource with an owner column. A
/// caller must not tell another owner's row (found, then refused) from an
/// absent key: a 404 that said which step answered would say the filter
/// passed the key, and so, most likely, that the row exists.
pub const HIDDEN: &str = "bloomgate; detail=not-found";

impl Route {
    /// `policy`: the resource's index among `auth.policies`.
    pub fn new(
        resource: Arc<Resource>,
        server: &crate::config::ServerConfig,
        auth: Arc<Auth>,
        policy: usize,
    ) -> Self {
        let max_key_length = server.max_key_length;
        let not_found = serde_json::json!({
            "error": "not_found",
            "message": format!("no {} with this key", resource.name()),
        })
        .to_string();
        let key_segments = crate::config::route::key_segments(
            &resource.config.route,
            &resource.config.key_columns(),
        )
        .expect("config validation checks the route's parameters")
        .into_boxed_slice();
        let p = &auth.policies[policy];
        // A response to a caller is the caller's: no shared cache in front
        // may keep it (RFC 9111 §3.5 covers `Authorization`, not
        // `X-API-Key`), a private one may.
        let private = p.mode != crate::config::AuthMode::None;
        let header = |v: &str| {
            let v = match private && !v.to_ascii_lowercase().contains("private") {
                true => format!("private, {v}"),
                false => v.to_string(),
            };
            static_header(&v).expect("config validation checks Cache-Control values")
        };
        let cache = &resource.config.cache;
        let (guarded, owner_on_key, owner_on_row) = (
            p.guarded(),
            p.owner.as_ref().is_some_and(|o| o.column.is_none()),
            p.owner_column().is_some(),
        );
        Self {
            guarded,
            owner_on_key,
            owner_on_row,
            hide_absence: owner_on_row,
            policy,
            auth: auth.clone(),
            vary: cache.enabled && cache.compression,
            row_cache_control: header(&cache.http_cache_control),
            not_found_cache_control: header(&cache.http_cache_control_not_found),
            resource,
            max_key_length,
            request_timeout: server.request_timeout,
            key_segments,
            not_found_length: static_header(&not_found.len().to_string())
                .expect("digits are a valid header value"),
            not_found: static_bytes(&not_found),
        }
    }

    pub fn policy(&self) -> &Policy {
        &self.auth.policies[self.policy]
    }
}

/// The route's handler, for what axum's router serves: `HEAD`, and a `GET`
/// the dispatch leaves to it (a path another template could match, a
/// template over `templates::MAX_SEGMENTS` segments). Other `GET`s come
/// through [`super::dispatch`], which calls [`begin`] and [`finish`] itself.
pub async fn handle(route: Arc<Route>, req: Request<Body>) -> Response {
    let began = Instant::now();
    let peer = req.extensions().get::<PeerAddr>().map(|p| p.0);
    match begin(&route, req.uri().path(), req.headers(), peer, began) {
        Begun::Load(load, caller, allowance) => {
            finish(&route, load, caller, allowance, req.headers(), began)
                .await
                .0
        }
        Begun::Answered(answered, _) => answered,
    }
}

/// A response's `Cache-Status` when it is one of this module's fixed
/// values, handed to the access line so that it need not be read back
/// from the headers (`http::front::Tells`); `None` for an error's answer.
pub type CacheStatus = Option<&'static str>;

/// What [`begin`] found.
pub enum Begun {
    /// The whole answer (400 for a malformed key, 404 for a key the filter
    /// rejects, 503 before the first build, a cache hit or negative hit),
    /// already counted.
    Answered(Response, CacheStatus),
    /// A key the filter and cache could not answer at once ([`finish`]),
    /// with the caller when its row must be checked for its owner, and
    /// what the rate limiter said.
    Load(Load, Option<Arc<Verified>>, Option<Allowance>),
}

/// Parse, then the access checks, then filter, then the cache if it can
/// answer without waiting: everything a request can be answered with before
/// it needs a future. `peer` is the client address (rate limits by
/// address).
pub fn begin(
    route: &Route,
    path: &str,
    headers: &HeaderMap,
    peer: Option<IpAddr>,
    began: Instant,
) -> Begun {
    let key = match key_of(route, path) {
        Ok(key) => key,
        Err(e) => return Begun::Answered(rated(route, failed(route, began, e), None), None),
    };
    let (caller, allowance) = match route.guarded {
        false => (Caller::Anonymous, None),
        true => match route.auth.check(route.policy(), headers, peer, began) {
            Ok(admitted) => admitted,
            Err(e) => return Begun::Answered(rated(route, failed(route, began, e), None), None),
        },
    };
    if route.owner_on_key
        && let Some(v) = caller.verified()
        && !owns_key(route, v, &key)
    {
        // Exactly a key the filter rejects: the caller learns nothing of
        // other owners' keys, and nothing past this point is asked.
        let (resp, _, cache_status) = filtered(route);
        let resp = refused_as_absent(route, began, resp);
        return Begun::Answered(rated(route, resp, allowance), Some(cache_status));
    }
    match route.resource.lookup_now(key, began) {
        Ok(Now::Answered(lookup)) => {
            let (resp, outcome, cache_status) = answer(route, lookup, headers, caller.verified());
            let resp = rated(route, done(route, began, resp, outcome), allowance);
            Begun::Answered(resp, Some(cache_status))
        }
        Ok(Now::Load(load)) => {
            let caller = match route.owner_on_row {
                true => caller.into_arc(),
                false => None,
            };
            Begun::Load(load, caller, allowance)
        }
        Err(e) => Begun::Answered(rated(route, failed(route, began, e), allowance), None),
    }
}

/// A rate-limited resource's fields (draft-ietf-httpapi-ratelimit-headers):
/// `RateLimit-Policy` on every answer, so a client can pace itself before
/// its first 429, and `RateLimit` on every answer the limiter let through
/// (a 429 carries its own).
fn rated(route: &Route, mut resp: Response, allowance: Option<Allowance>) -> Response {
    let p = route.policy();
    let Some(policy) = p.rate_policy() else {
        return resp;
    };
    let h = resp.headers_mut();
    h.insert(&RATELIMIT_POLICY, policy.clone());
    if let Some(a) = allowance {
        h.insert(&RATELIMIT, p.rate_state(a));
    }
    resp
}

/// The cache (and through it the database) for a key [`begin`] let through.
pub async fn finish(
    route: &Route,
    load: Load,
    caller: Option<Arc<Verified>>,
    allowance: Option<Allowance>,
    headers: &HeaderMap,
    began: Instant,
) -> (Response, CacheStatus) {
    let mut deadline = DeadlineGuard {
        route,
        began,
        armed: true,
    };
    let (resp, cache_status) = match route.resource.load(load).await {
        Ok(lookup) => {
            let (resp, outcome, cache_status) = answer(route, lookup, headers, caller.as_deref());
            (done(route, began, resp, outcome), Some(cache_status))
        }
        Err(e) => (failed(route, began, e), None),
    };
    deadline.armed = false;
    (rated(route, resp, allowance), cache_status)
}

/// Counts a lookup dropped at its deadline under its resource, as a
/// timeout; a lookup dropped because its client went away is not one.
///
/// Which of the two it is, the guard tells by the clock alone: the front
/// layer arms its deadline, `request_timeout` ahead, once the handler's
/// first poll has returned, and `began` was taken before that poll
/// returned (by the dispatch before it, or by [`handle`] within it), so a
/// drop at the deadline always finds `request_timeout` elapsed (tokio's
/// clock is `std`'s, which `began` reads, and its timers fire no sooner
/// than their deadline). A client that leaves earlier finds it not
/// elapsed, except within the delay between `began` and the arming, a
/// request that has run past `request_timeout` by then anyway.
struct DeadlineGuard<'a> {
    route: &'a Route,
    began: Instant,
    armed: bool,
}

impl Drop for DeadlineGuard<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let elapsed = self.began.elapsed();
        if elapsed >= self.route.request_timeout {
            self.route
                .resource
                .stats
                .record(RequestOutcome::Timeout, elapsed);
        }
    }
}

/// Another owner's key or row: answered as absent, counted as forbidden.
fn refused_as_absent(route: &Route, began: Instant, resp: Response) -> Response {
    done(route, began, resp, RequestOutcome::Forbidden)
}

/// Every request that reaches a resource's route ends here (or in
/// [`failed`], which comes here): its one count (see `resource::stats`).
fn done(route: &Route, began: Instant, resp: Response, outcome: RequestOutcome) -> Response {
    route.resource.stats.record(outcome, began.elapsed());
    resp
}

fn failed(route: &Route, began: Instant, e: Error) -> Response {
    let outcome = match e {
        Error::BadKey(_) | Error::InvalidRequest { .. } => RequestOutcome::BadRequest,
        Error::NotReady | Error::AuthNotReady => RequestOutcome::NotReady,
        Error::Unauthorized { .. } => RequestOutcome::Unauthorized,
        Error::Forbidden { .. } => RequestOutcome::Forbidden,
        Error::RateLimited { .. } => RequestOutcome::RateLimited,
        Error::Overloaded => RequestOutcome::Shed,
        Error::Timeout => RequestOutcome::Timeout,
        Error::Unverified | Error::Unavailable(_) | Error::Internal(_) => {
            RequestOutcome::Unavailable
        }
        Error::KeyNotUnique => RequestOutcome::KeyNotUnique,
    };
    done(route, began, e.into_response(), outcome)
}

/// Whether the caller owns `key`: the key itself, or the composite key's
/// part the owner column names, compared as its column compares.
fn owns_key(route: &Route, v: &crate::auth::verified::Verified, key: &Key) -> bool {
    let r = &route.resource;
    let part = route.policy().owner.as_ref().and_then(|o| o.key_part);
    match (key, part) {
        (Key::Tuple(t), Some(i)) => match t.parts().get(i) {
            Some(owned) => route
                .auth
                .owns_key(route.policy(), v, owned, r.part_comparison(i)),
            None => false,
        },
        _ => route.auth.owns_key(route.policy(), v, key, r.comparison()),
    }
}

fn key_of(route: &Route, path: &str) -> Result<Key, Error> {
    // The path matched this route, so it has the key segments.
    let segment = |n: usize| {
        nth_segment(path, n)
            .ok_or_else(|| Error::Internal("matched path without a key segment".into()))
    };
    match &*route.key_segments {
        [one] => route
            .resource
            .parse_key(&[segment(*one)?], route.max_key_length),
        parts => {
            let raw = parts
                .iter()
                .map(|n| segment(*n))
                .collect::<Result<Vec<_>, _>>()?;
            route.resource.parse_key(&raw, route.max_key_length)
        }
    }
}

/// `path.split('/').nth(n)`, by bytes: `str::split`'s general searcher is
/// a noticeable share of a cached hit for a one-byte separator.
fn nth_segment(path: &str, n: usize) -> Option<&str> {
    let mut rest = path;
    for _ in 0..n {
        let slash = rest.bytes().position(|b| b == b'/')?;
        rest = &rest[slash + 1..];
    }
    let end = rest.bytes().position(|b| b == b'/').unwrap_or(rest.len());
    Some(&rest[..end])
}

/// The row a lookup found, if any.
fn row_of(lookup: &Lookup) -> Option<&Row> {
    match lookup {
        Lookup::Cached(
            Outcome::Hit(row) | Outcome::Loaded { row, .. } | Outcome::Bypassed(Some(row)),
        )
        | Lookup::Unvouched(Some(row))
        | Lookup::Stale { row: Some(row), .. } => Some(row),
        _ => None,
    }
}

/// The response to a lookup, its outcome and its `Cache-Status`.
fn answer(
    route: &Route,
    lookup: Lookup,
    headers: &HeaderMap,
    caller: Option<&Verified>,
) -> (Response, RequestOutcome, &'static str) {
    if route.owner_on_row
        && let (Some(v), Some(row)) = (caller, row_of(&lookup))
        && !route.auth.owns_row(
            route.policy(),
            v,
            row.body(),
            route.resource.owner_comparison(),
        )
    {
        let (resp, cache_status) = not_found(route, HIDDEN);
        return (resp, RequestOutcome::Forbidden, cache_status);
    }
    let (row, cache_status, outcome) = match lookup {
        Lookup::Filtered => return filtered(route),
        // An outage (see "Outages" in `resource`): labelled, with `Age`
        // counted from the moment the feed last vouched for it.
        Lookup::Stale { row, cached, age } => {
            let (mut resp, cache_status) = match (row, cached) {
                (Some(row), _) => {
                    let cache_status = "bloomgate; hit; detail=stale";
                    (found(route, row, headers, cache_status), cache_status)
                }
                (None, true) => not_found(route, "bloomgate; hit; detail=stale"),
                (None, false) => not_found(route, "bloomgate; detail=stale"),
            };
            resp.headers_mut()
                .insert(header::AGE, HeaderValue::from(age.as_secs()));
            return (resp, RequestOutcome::Stale, cache_status);
        }
        Lookup::Unvouched(row) => (
            row,
            "bloomgate; fwd=bypass; detail=unverified",
            RequestOutcome::Miss,
        ),
        Lookup::Cached(o) => match o {
            Outcome::Hit(row) => (Some(row), "bloomgate; hit", RequestOutcome::Hit),
            Outcome::Loaded {
                row,
                collapsed: false,
            } => (
                Some(row),
                "bloomgate; fwd=miss; stored",
                RequestOutcome::Miss,
            ),
            Outcome::Loaded {
                row,
                collapsed: true,
            } => (
                Some(row),
                "bloomgate; fwd=miss; collapsed",
                RequestOutcome::Collapsed,
            ),
            Outcome::Bypassed(row) => (row, "bloomgate; fwd=bypass", RequestOutcome::Miss),
            Outcome::NegativeHit => (
                None,
                "bloomgate; hit; detail=negative",
                RequestOutcome::NegativeHit,
            ),
            Outcome::Absent { collapsed: false } => (
                None,
                "bloomgate; fwd=miss; stored; detail=negative",
                RequestOutcome::Miss,
            ),
            Outcome::Absent { collapsed: true } => (
                None,
                "bloomgate; fwd=miss; collapsed; detail=negative",
                RequestOutcome::Collapsed,
            ),
        },
    };
    match row {
        Some(row) => (
            found(route, row, headers, cache_status),
            outcome,
            cache_status,
        ),
        None => {
            let (resp, cache_status) = not_found(route, cache_status);
            (resp, outcome, cache_status)
        }
    }
}

fn filtered(route: &Route) -> (Response, RequestOutcome, &'static str) {
    let (resp, cache_status) = not_found(route, "bloomgate; detail=filter-absent");
    (resp, RequestOutcome::Filtered, cache_status)
}

/// The 404 and the `Cache-Status` it says.
fn not_found(route: &Route, cache_status: &'static str) -> (Response, &'static str) {
    let cache_status = match route.hide_absence {
        true => HIDDEN,
        false => cache_status,
    };
    let mut resp = json_bytes(StatusCode::NOT_FOUND, route.not_found.clone());
    let h = resp.headers_mut();
    h.insert(header::CONTENT_LENGTH, route.not_found_length.clone());
    h.insert(CACHE_STATUS, HeaderValue::from_static(cache_status));
    h.insert(header::CACHE_CONTROL, route.not_found_cache_control.clone());
    (resp, cache_status)
}

const VARY: HeaderValue = HeaderValue::from_static("accept-encoding");

fn found(
    route: &Route,
    row: Arc<Row>,
    headers: &HeaderMap,
    cache_status: &'static str,
) -> Response {
    // A row too small to compress has one representation: no header to read.
    let coding = if row.variants().is_empty() {
        Coding::Identity
    } else {
        encoding::negotiate(
            headers
                .get_all(header::ACCEPT_ENCODING)
                .iter()
                .map(HeaderValue::as_bytes),
            |c| row.variant(c).is_some(),
        )
    };
    let Parts { etag, length, body } = row.sent(coding);
    let Preconditions {
        if_match,
        not_modified,
    } = preconditions(headers, etag.as_bytes());
    if !if_match {
        return precondition_failed(etag, cache_status);
    }
    let mut resp = if not_modified {
        StatusCode::NOT_MODIFIED.into_response()
    } else {
        json_bytes(StatusCode::OK, body)
    };
    let h = resp.headers_mut();
    // A 304 carries the validators and caching fields, not representation
    // metadata such as Content-Encoding (RFC 9110 §15.4.5).
    if !not_modified {
        h.insert(header::CONTENT_LENGTH, length);
        if coding != Coding::Identity {
            h.insert(
                header::CONTENT_ENCODING,
                HeaderValue::from_static(coding.token()),
            );
        }
    }
    if route.vary {
        h.insert(header::VARY, VARY);
    }
    h.insert(header::ETAG, etag);
    h.insert(CACHE_STATUS, HeaderValue::from_static(cache_status));
    // On the 304 too (RFC 9110 §15.4.5): it refreshes the stored response.
    h.insert(header::CACHE_CONTROL, route.row_cache_control.clone());
    resp
}

/// What a request's conditional headers say of a row with tag `ours`.
#[derive(Debug, PartialEq, Eq)]
struct Preconditions {
    /// RFC 9110 §13.1.1: true without `If-Match`; with it, `*` (a row is
    /// being answered, so it exists) or a strong match of one of its tags
    /// (a weak tag never matches).
    if_match: bool,
    /// §13.1.2: a weak match of a tag in any `If-None-Match`, or `*`.
    not_modified: bool,
}

/// [`Preconditions`], in one pass over the request's headers: two lookups
/// by name would hash each name, on every hit, for headers a request
/// rarely has.
fn preconditions(headers: &HeaderMap, ours: &[u8]) -> Preconditions {
    fn tags(v: &HeaderValue) -> impl Iterator<Item = &str> {
        v.to_str()
            .ok()
            .into_iter()
            .flat_map(|v| v.split(','))
            .map(str::trim)
    }
    let (mut asked, mut matched, mut not_modified) = (false, false, false);
    for (name, value) in headers {
        if name == header::IF_MATCH {
            asked = true;
            matched |= tags(value).any(|tag| tag == "*" || tag.as_bytes() == ours);
        } else if name == header::IF_NONE_MATCH {
            not_modified |= tags(value)
                .any(|tag| tag == "*" || tag.strip_prefix("W/").unwrap_or(tag).as_bytes() == ours);
        }
    }
    Preconditions {
        if_match: !asked || matched,
        not_modified,
    }
}

/// 412 (RFC 9110 §13.1.1): `If-Match` did not match the row's current
/// representation. Its ETag says which that is; nothing here is for a
/// cache to keep.
fn precondition_failed(etag: HeaderValue, cache_status: &'static str) -> Response {
    let mut resp = super::response::json_error(
        StatusCode::PRECONDITION_FAILED,
        "precondition_failed",
        "If-Match does not match the current representation",
    );
    let h = resp.headers_mut();
    h.insert(header::ETAG, etag);
    h.insert(CACHE_STATUS, HeaderValue::from_static(cache_status));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        #[test]
        fn nth_segment_is_split_nth(path in "[a-z/%]{0,12}", n in 0usize..6) {
            proptest::prop_assert_eq!(nth_segment(&path, n), path.split('/').nth(n));
        }
    }

    #[test]
    fn if_match_compares_strongly_and_star_matches_a_row() {
        let etag = b"\"abc\"";
        let matched = |h: &HeaderMap| preconditions(h, etag).if_match;
        let mut h = HeaderMap::new();
        assert!(matched(&h), "no precondition");
        h.insert(header::IF_MATCH, HeaderValue::from_static("\"x\", \"abc\""));
        assert!(matched(&h));
        h.insert(header::IF_MATCH, HeaderValue::from_static("W/\"abc\""));
        assert!(!matched(&h), "a weak tag never matches strongly");
        h.insert(header::IF_MATCH, HeaderValue::from_static("\"abcd\""));
        assert!(!matched(&h));
        h.append(header::IF_MATCH, HeaderValue::from_static("\"abc\""));
        assert!(matched(&h), "any value of any If-Match header");
        h.insert(header::IF_MATCH, HeaderValue::from_static("*"));
        assert!(matched(&h));
    }

    #[test]
    fn if_none_match_compares_weakly_across_lists() {
        let etag = b"\"abc\"";
        let not_modified = |h: &HeaderMap| preconditions(h, etag).not_modified;
        let mut h = HeaderMap::new();
        assert!(!not_modified(&h));
        h.insert(
            header::IF_NONE_MATCH,
            HeaderValue::from_static("\"x\", W/\"abc\""),
        );
        assert!(not_modified(&h));
        h.insert(header::IF_NONE_MATCH, HeaderValue::from_static("\"abcd\""));
        assert!(!not_modified(&h));
        h.append(header::IF_NONE_MATCH, HeaderValue::from_static("\"abc\""));
        assert!(not_modified(&h));
        h.insert(header::IF_NONE_MATCH, HeaderValue::from_static("*"));
        assert!(not_modified(&h));
        // Neither header changes the other's answer.
        h.insert(header::IF_MATCH, HeaderValue::from_static("\"zzz\""));
        assert_eq!(
            preconditions(&h, etag),
            Preconditions {
                if_match: false,
                not_modified: true
            }
        );
    }
}
