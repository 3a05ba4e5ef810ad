//! `Dispatch`: a resource's `GET` goes straight to its lookup; every other
//! request goes to axum's router.
//!
//! # Why
//!
//! axum's router costs more than the rest of a cached hit or a filtered 404
//! together, and allocates four times on each:
//! - the body is boxed into `axum::body::Body`;
//! - `matchit` walks its tree;
//! - the path parameters are copied into a new `Extensions` map, with
//!   `MatchedPath` beside them;
//! - the route's service is cloned, and the handler's future is boxed.
//!
//! The lookup needs none of that. It reads its key from the raw path itself
//! (`lookup::Route::key_segments`). Here:
//! - a `GET` on a resource route is matched segment by segment against the
//!   few route templates;
//! - the key is parsed and filtered, and the cache read, inside `call`. A
//!   malformed key (400), a key the filter rejects (404), a filter not built
//!   yet (503), a cached row (200 or 304) or a cached absence (404) is
//!   answered there, with no future to box, no reference to the route to
//!   take, and nothing allocated but the response (`lookup::begin`);
//! - only a key the cache cannot answer at once (a miss, a key to verify,
//!   the rare read that would wait inside moka: `RowCache::cached`) gets a
//!   boxed future, as axum's handler did.
//!
//! # Guarantee: the same route as axum's router
//!
//! A request takes the direct path only when it is a `GET` and exactly one
//! route template *could* match its path: same number of segments, every
//! literal segment equal, the parameter's segment non-empty. The templates are
//! the resources' and the router's own fixed paths ([`crate::config::route::SERVED`]). For
//! such a path the router has one candidate, and `matchit` picks it.
//!
//! Everything else goes to the router unchanged:
//! - `HEAD`, whose body axum strips, and other methods (405 with `Allow`);
//! - unknown paths (the JSON 404);
//! - a path two templates could match, such as `/healthz` when a resource is
//!   routed at `/{id}`. There `matchit`'s precedence decides.
//!
//! `the_direct_path_is_taken_only_where_the_router_would_go` checks this
//! against a real router, for random paths.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Instant;

use axum::Router;
use axum::body::HttpBody;
use axum::http::{HeaderMap, HeaderValue, Method, Request, Uri, header};
use axum::response::Response;
use axum::routing::future::RouteFuture;
use tower::Service;

use super::front::{Tells, Told};
use super::lookup::{self, Begun, CacheStatus, Route};
use super::templates::Templates;
use crate::auth::peer::{self, PeerAddr};

/// The public service under the front layer; see the module doc.
#[derive(Clone)]
pub struct Dispatch(Arc<Inner>);

struct Inner {
    router: Router,
    /// Each direct route with its index among the access lines' templates
    /// (see [`Dispatch::with_peer`]).
    direct: Templates<(usize, Arc<Route>)>,
    /// Some resource limits callers by address: requests the router
    /// serves carry the client address as an extension (see `auth::peer`).
    peer_to_router: bool,
}

impl Dispatch {
    /// `router` serves everything; `direct` names the `GET`s answered
    /// without it (none for the admin router).
    pub fn new(router: Router, direct: Templates<(usize, Arc<Route>)>) -> Self {
        Self::with_peer(router, direct, false)
    }

    /// As [`Dispatch::new`]; `peer_to_router`: hand the client address to
    /// the requests the router serves. Each direct route comes with its
    /// index among the front layer's access templates, which it tells the
    /// access line ([`Tells`]) in place of a second match: the access
    /// templates must hold every direct template at that index and no
    /// template the direct ones lack, so that a path exactly one direct
    /// template could match is matched by that one there too.
    pub fn with_peer(
        router: Router,
        direct: Templates<(usize, Arc<Route>)>,
        peer_to_router: bool,
    ) -> Self {
        Self(Arc::new(Inner {
            router,
            direct,
            peer_to_router,
        }))
    }
}

impl<B> Service<Request<B>> for Dispatch
where
    B: HttpBody<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<axum::BoxError>,
{
    type Response = Response;
    type Error = Infallible;
    type Future = DispatchFuture;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<B>) -> DispatchFuture {
        hyper::service::Service::call(self, req)
    }
}

/// The same through a shared reference, as hyper calls a connection's
/// service (see [`super::front`]'s "Called in place").
impl<B> hyper::service::Service<Request<B>> for Dispatch
where
    B: HttpBody<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<axum::BoxError>,
{
    type Response = Response;
    type Error = Infallible;
    type Future = DispatchFuture;

    fn call(&self, req: Request<B>) -> DispatchFuture {
        let route = match *req.method() == Method::GET {
            true => self.0.direct.find(req.uri().path()),
            false => None,
        };
        let Some((index, route)) = route else {
            let mut req = req;
            if self.0.peer_to_router
                && let Some(ip) = peer::current()
            {
                req.extensions_mut().insert(PeerAddr(ip));
            }
            // The access line matches this path itself (off the fast paths;
            // kept only while lines are on).
            let uri = crate::telemetry::access_on().then(|| req.uri().clone());
            return DispatchFuture {
                state: Dispatched::Router(Box::new((self.0.router.clone().call(req), uri))),
                route: None,
                cache_status: None,
            };
        };
        let index = *index;
        let began = Instant::now();
        let peer = match route.guarded {
            true => peer::current(),
            false => None,
        };
        match lookup::begin(route, req.uri().path(), req.headers(), peer, began) {
            Begun::Answered(answered, cache_status) => DispatchFuture {
                state: Dispatched::Ready(Some(answered)),
                route: Some(index),
                cache_status,
            },
            Begun::Load(load, caller, allowance) => {
                let route = route.clone();
                // The body is never read (every route is a GET): only the
                // headers go on, for the validators and the coding.
                let headers: HeaderMap = req.into_parts().0.headers;
                DispatchFuture {
                    state: Dispatched::Lookup(Box::pin(async move {
                        lookup::finish(&route, load, caller, allowance, &headers, began).await
                    })),
                    route: Some(index),
                    cache_status: None,
                }
            }
        }
    }
}

/// [`Dispatch`]'s response future, and what it tells the access line.
pub struct DispatchFuture {
    state: Dispatched,
    /// The route's index among the access templates; `None` for the router.
    route: Option<usize>,
    /// Set with the response, when it is a lookup's fixed value.
    cache_status: CacheStatus,
}

enum Dispatched {
    /// Answered inside `call`.
    Ready(Option<Response>),
    /// A key the cache must be asked about.
    Lookup(Pin<Box<dyn Future<Output = (Response, CacheStatus)> + Send>>),
    /// With the request's target, for the access line to match. Boxed:
    /// axum's future is three times the size of the others, and a hit's
    /// future is moved whole, more than once, on its way to the
    /// connection; the router allocates on every request anyway.
    Router(Box<(RouteFuture<Infallible>, Option<Uri>)>),
}

impl Future for DispatchFuture {
    type Output = Result<Response, Infallible>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        // Every field is `Unpin` (the lookup is boxed, `RouteFuture` is
        // `Unpin`), so the future is too.
        let this = self.get_mut();
        let response = match &mut this.state {
            Dispatched::Ready(response) => response.take().expect("polled after completion"),
            Dispatched::Lookup(lookup) => {
                let (response, cache_status) = ready!(lookup.as_mut().poll(cx));
                this.cache_status = cache_status;
                response
            }
            Dispatched::Router(router) => return Pin::new(&mut router.0).poll(cx),
        };
        Poll::Ready(Ok(with_content_length(response)))
    }
}

impl Tells<DispatchFuture> for Dispatch {
    const ROUTE: bool = true;

    fn route(future: &DispatchFuture) -> Told<'_> {
        match (&future.state, future.route) {
            (_, Some(index)) => Told::Index(index),
            (Dispatched::Router(router), None) => match &router.1 {
                Some(uri) => Told::Path(uri.path()),
                None => Told::Unknown,
            },
            (_, None) => Told::Unknown,
        }
    }

    fn cache_status(future: &DispatchFuture) -> CacheStatus {
        future.cache_status
    }
}

/// `Content-Length` as axum's router sets it (hyper would write it too, but
/// only on the wire): a response reads the same whichever path made it,
/// and a `HEAD` (through the router) describes its `GET` exactly.
fn with_content_length(mut response: Response) -> Response {
    if let Some(n) = response.body().size_hint().exact()
        && !response.headers().contains_key(header::CONTENT_LENGTH)
    {
        let value = match n {
            0 => HeaderValue::from_static("0"),
            n => HeaderValue::from(n),
        };
        response.headers_mut().insert(header::CONTENT_LENGTH, value);
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::routing::get;
    use proptest::prelude::*;
    use tower::ServiceExt;

    /// Template sets a config can produce (`config::route::check`: literal
    /// segments and one parameter anywhere), beside the router's own paths.
    const SETS: &[&[&str]] = &[
        &["/users/{id}", "/articles/{slug}"],
        &["/{id}", "/users/{id}"],
        &["/users/{id}", "/users/{id}/profile", "/v1/users/{id}"],
        &["/{key}", "/a/{key}", "/{key}/b"],
        &["/healthz/{id}", "/openapi.json/{id}"],
        // Longer than `find`'s buffer, and as long as it.
        &["/a/b/a/b/a/b/a/b/{id}", "/a/b/a/b/a/b/a/{id}", "/a/{id}"],
    ];
    const FIXED: &[&str] = &crate::config::route::SERVED;

    /// The router as `http::app` builds it, each handler answering with its
    /// own name, and the dispatch's templates for the same routes.
    fn both(set: &[&str]) -> (Router, Templates<String>) {
        let mut router = Router::new();
        let mut templates = Templates::default();
        for (i, t) in set.iter().enumerate() {
            let name = format!("resource {i}");
            templates.add(t, Some(name.clone()));
            router = router.route(t, get(move || async move { name }));
        }
        for f in FIXED {
            templates.add(f, None);
            router = router.route(f, get(|| async { "fixed" }));
        }
        (router.fallback(|| async { "none" }), templates)
    }

    fn routed(router: &Router, path: &str) -> String {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let Ok(req) = Request::get(path).body(Body::empty()) else {
            return "unparsable".into();
        };
        let resp = rt.block_on(router.clone().oneshot(req)).unwrap();
        let body = rt
            .block_on(axum::body::to_bytes(resp.into_body(), 1024))
            .unwrap();
        String::from_utf8(body.to_vec()).unwrap()
    }

    fn path() -> impl Strategy<Value = String> {
        let segment = prop::sample::select(vec![
            "",
            "users",
            "articles",
            "a",
            "b",
            "v1",
            "profile",
            "healthz",
            "readyz",
            "openapi.json",
            "5",
            "x.y",
            "%2F",
            "me",
        ]);
        prop::collection::vec(segment, 0..4)
            .prop_union(prop::collection::vec(
                prop::sample::select(vec!["a", "b", "", "5"]),
                6..11,
            ))
            .prop_map(|s| format!("/{}", s.join("/")))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(400))]

        /// Whenever the dispatch takes the direct path, the router would
        /// have called the same resource's handler.
        #[test]
        fn the_direct_path_is_taken_only_where_the_router_would_go(
            set in prop::sample::select(SETS.to_vec()),
            path in path(),
        ) {
            let (router, templates) = both(set);
            if let Some(direct) = templates.find(&path) {
                prop_assert_eq!(&routed(&router, &path), direct, "path {}", path);
            }
        }
    }

    /// And it is taken wherever no other template could match.
    #[test]
    fn a_resource_path_goes_direct_unless_another_template_could_match() {
        let (_, t) = both(SETS[0]);
        assert_eq!(t.find("/users/5").map(String::as_str), Some("resource 0"));
        assert_eq!(
            t.find("/articles/x.y").map(String::as_str),
            Some("resource 1")
        );
        assert_eq!(t.find("/users/%2F").map(String::as_str), Some("resource 0"));
        for path in [
            "/users/",
            "/users",
            "/users/5/",
            "/users//5",
            "/healthz",
            "",
            "/",
        ] {
            assert_eq!(t.find(path), None, "{path:?}");
        }
        let (_, t) = both(SETS[1]);
        assert_eq!(t.find("/7").map(String::as_str), Some("resource 0"));
        assert_eq!(t.find("/users/7").map(String::as_str), Some("resource 1"));
        // `/healthz` fits `/{id}` too: the router's precedence decides.
        assert_eq!(t.find("/healthz"), None);
        // A template as long as `find`'s buffer goes direct; a longer one,
        // and any path longer than every template, stays with the router.
        let (_, t) = both(SETS[5]);
        assert_eq!(
            t.find("/a/b/a/b/a/b/a/5").map(String::as_str),
            Some("resource 1")
        );
        assert_eq!(t.find("/a/5").map(String::as_str), Some("resource 2"));
        assert_eq!(t.find("/a/b/a/b/a/b/a/b/5"), None);
        assert_eq!(t.find("/a/b/a/b/a/b/a/5/"), None);
    }
}
