//! The HTTP surface: `app` builds the public router every caller (the
//! server, the tests) uses; [`admin::app`] the admin one.
//!
//! Public routes: one `GET` per configured resource, `/healthz` (the process
//! is alive), `/readyz` (every filter is built) and `/openapi.json`. Routes
//! and their OpenAPI entries are registered together (utoipa-axum), so the
//! document lists exactly what is served.
//!
//! Dispatch: a resource's `GET` goes straight to its lookup in
//! [`dispatch::Dispatch`], before axum's router, which serves every other
//! request (the router would cost a hit more than the rest of it, and four
//! allocations). `lookup::begin` answers there whatever needs no I/O: a
//! malformed key (400), a key the filter rejects (404), a filter not built
//! yet (503), a cached row or absence; only a miss gets a future.
//!
//! Middleware: one layer, [`front::FrontLayer`], wrapped once around the
//! whole router ([`App`]): request id, the caller behind trusted proxies
//! ([`forwarded`]), CORS ([`cors`]), access line and trace span, 413 for a
//! declared body over `max_body_bytes`, 503 past `max_concurrency`
//! requests in flight, 504 past the request timeout.
//! Around the router rather than inside it (`Router::layer`): axum would
//! wrap each route in its own boxed copy of the layer and clone those boxes
//! on every request (three allocations a hit); and not in an outer `Router`, which would route every
//! request twice.

pub mod admin;
pub mod cors;
pub mod dispatch;
pub mod forwarded;
pub mod front;
mod lookup;
pub mod openapi;
pub mod response;
pub mod templates;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderValue, Request, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{BoxError, Router};
use bytes::Bytes;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::config::route;
use crate::error::Error;
use crate::gateway::Gateway;
use crate::resource::RequestOutcome;
use dispatch::Dispatch;
use lookup::Route;
use response::{json_bytes, json_error};
use templates::Templates;

/// What [`app`] and [`admin::app`] return: the router behind the front
/// layer, with the resources' `GET`s answered before it ([`Dispatch`]). The
/// layer wraps the whole router once rather than each route
/// (`Router::layer`), which would box and clone every route's service
/// stack per request.
pub type App = front::Front<Dispatch>;

/// The public router for `gateway`, behind the front layer.
pub fn app(gateway: Arc<Gateway>) -> App {
    gateway.auth.start();
    let routes = resource_routes(&gateway);
    let (router, doc) = with_resources(&routes).split_for_parts();
    // The router serves nothing but the resources and its own paths, which
    // no resource may take (`config::route`): the lists below name them all.
    for path in doc.paths.paths.keys() {
        debug_assert!(
            routes.iter().any(|r| r.resource.config.route == *path)
                || route::SERVED.contains(&path.as_str()),
            "{path} is served but not in config::route::SERVED"
        );
    }
    let (direct, templates) = route_templates(routes.iter().map(|r| {
        (
            r.resource.config.route.clone(),
            r.resource.name().to_string(),
            r.clone(),
        )
    }));
    let doc = Arc::new(openapi::Served::new(doc, gateway.clone()));
    let router = router.route(
        "/openapi.json",
        get(move || async move { json_bytes(StatusCode::OK, doc.json().await) }),
    );
    let traffic = gateway.stats.traffic.clone();
    let router = router
        .fallback(no_route)
        .with_state(gateway.clone())
        .method_not_allowed_fallback(move || method_not_allowed(traffic.clone()));
    let server = &gateway.config.server;
    let mut front = front_layer(&gateway, Some(server.request_timeout))
        .with_access(templates)
        .with_forwarded(forwarded::Forwarded::new(
            &server.trusted_proxies,
            server.forwarded_header,
        ))
        .with_cors(cors::Cors::new(&server.cors));
    if !gateway.config.log.access_probes {
        front = front.without_lines_for(&route::PROBES);
    }
    // Shed requests count under the resource their path names. Asked only
    // when shedding: the direct match, as the dispatch does it.
    let mut by_path = Templates::default();
    for route in &routes {
        by_path.add(&route.resource.config.route, Some(route.resource.clone()));
    }
    front = front.on_shed(move |path| {
        if let Some(r) = by_path.find(path) {
            r.stats.shed_in_front.fetch_add(1, Ordering::Relaxed);
            r.stats.record(RequestOutcome::Shed, Duration::ZERO);
        }
    });
    let probe = front.clone();
    gateway
        .stats
        .traffic
        .set_in_flight(move || probe.in_flight());
    tower::Layer::layer(
        &front,
        Dispatch::with_peer(router, direct, gateway.auth.limits_any()),
    )
}

/// The route templates the dispatch and the access lines match, from one
/// list so that the two cannot drift: resource `i` is template `i` of both
/// (the dispatch tells the access line that index in place of a second
/// match, see [`Dispatch::with_peer`]), then the router's own paths
/// ([`route::SERVED`]), which the dispatch leaves to the router (a path two
/// templates could match goes by the router's precedence) and the access
/// lines name. `resources`: each resource's template, name and target.
/// `a_told_route_is_the_route_the_access_line_would_match` checks it.
fn route_templates<T>(
    resources: impl IntoIterator<Item = (String, String, T)>,
) -> (Templates<(usize, T)>, front::AccessTemplates) {
    let mut direct = Templates::default();
    let mut access = Vec::new();
    for (i, (template, name, target)) in resources.into_iter().enumerate() {
        direct.add(&template, Some((i, target)));
        access.push((template, Some(name)));
    }
    for path in route::SERVED {
        direct.add(path, None);
        access.push((path.to_string(), None));
    }
    (direct, access)
}

/// Every public route with its OpenAPI entry, except `/openapi.json` itself
/// (which `openapi::document` adds to the document).
pub fn public_routes(gateway: &Arc<Gateway>) -> OpenApiRouter<Arc<Gateway>> {
    with_resources(&resource_routes(gateway))
}

/// What each resource's route needs, prepared once.
fn resource_routes(gateway: &Arc<Gateway>) -> Vec<Arc<Route>> {
    let server = &gateway.config.server;
    gateway
        .resources
        .iter()
        .enumerate()
        .map(|(i, resource)| {
            Arc::new(Route::new(
                resource.clone(),
                server,
                gateway.auth.clone(),
                i,
            ))
        })
        .collect()
}

fn with_resources(routes: &[Arc<Route>]) -> OpenApiRouter<Arc<Gateway>> {
    let mut router = OpenApiRouter::new()
        .routes(routes!(healthz))
        .routes(routes!(readyz));
    for route in routes {
        let path = route.resource.config.route.clone();
        let route = route.clone();
        router = router.route(
            &path,
            // `HEAD`, and a `GET` `Dispatch` leaves to the router (see
            // `lookup::handle`). The whole request, by value: the `HeaderMap` and `Uri`
            // extractors would copy every header. The closure gives its
            // `route` away (axum calls a fresh clone of it per request).
            get(move |req: Request<Body>| lookup::handle(route, req)),
        );
    }
    router
}

/// The front layer around a router with no direct routes, with a
/// whole-request deadline or none: the admin router, whose routes set their
/// own (`admin.request_timeout`, and none for a rebuild that waits for its
/// outcome).
/// `templates` name its routes in access lines (see
/// [`front::FrontLayer::with_access`]); each request carries its client
/// address as an extension, for the admin router's audit lines.
pub fn with_middleware_timeout(
    router: Router,
    gateway: &Arc<Gateway>,
    timeout: Option<std::time::Duration>,
    templates: Vec<(String, Option<String>)>,
) -> App {
    let traffic = gateway.stats.traffic.clone();
    tower::Layer::layer(
        &front_layer(gateway, timeout)
            .with_access(templates)
            .with_peer_extension(),
        Dispatch::new(
            router.method_not_allowed_fallback(move || method_not_allowed(traffic.clone())),
            Templates::default(),
        ),
    )
}

/// The [`front::FrontLayer`] of a router: one in-flight count per call.
pub fn front_layer(
    gateway: &Arc<Gateway>,
    timeout: Option<std::time::Duration>,
) -> front::FrontLayer {
    let server = &gateway.config.server;
    front::FrontLayer::new(
        server.max_body_bytes,
        server.max_concurrency,
        timeout,
        front::Counters {
            traffic: gateway.stats.traffic.clone(),
            on_shed: None,
        },
    )
}

async fn method_not_allowed(traffic: Arc<crate::traffic::Traffic>) -> Response {
    traffic.method_not_allowed.fetch_add(1, Ordering::Relaxed);
    json_error(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        "this route does not take that method; see Allow",
    )
}

/// The response for an error of a tower layer (the admin routes' deadline:
/// 504), counted in the gateway's stats.
pub fn middleware_error(gw: &Gateway, err: BoxError) -> Response {
    if err.is::<tower::timeout::error::Elapsed>() {
        gw.stats.traffic.timeouts.fetch_add(1, Ordering::Relaxed);
        Error::Timeout.into_response()
    } else if err.is::<tower::load_shed::error::Overloaded>() {
        gw.stats.traffic.shed.fetch_add(1, Ordering::Relaxed);
        Error::Overloaded.into_response()
    } else {
        Error::Internal(err.to_string()).into_response()
    }
}

/// Liveness: 200 while the process runs.
#[utoipa::path(get, path = "/healthz", tag = "health",
    responses((status = 200, description = "The process is alive", body = openapi::StatusBody)))]
async fn healthz() -> Response {
    json_bytes(StatusCode::OK, Bytes::from_static(br#"{"status":"ok"}"#))
}

/// Readiness: 200 once every resource's filter is built and vouched for by
/// the change feed (see `vouch`), and the key set at `auth.jwks_url`
/// fetched; 503 with the reasons otherwise.
#[utoipa::path(get, path = "/readyz", tag = "health",
    responses(
        (status = 200, description = "Every filter is built and the change feed has confirmed it is current", body = openapi::StatusBody),
        (status = 503, description = "Not ready: `loading` names the resources whose filter is still loading, `reasons` says for each resource (and for the change feed) what it waits for", body = openapi::StatusBody),
    ))]
async fn readyz(State(gw): State<Arc<Gateway>>) -> Response {
    let readiness = gw.readiness();
    if readiness.is_empty() && readiness.degraded.is_empty() {
        json_bytes(StatusCode::OK, Bytes::from_static(br#"{"status":"ready"}"#))
    } else if readiness.is_empty() {
        // Shared by the fleet (see `Readiness::degraded`): ready, and says
        // what is wrong.
        let degraded: serde_json::Map<String, serde_json::Value> = readiness
            .degraded
            .into_iter()
            .map(|(r, why)| (r, why.into()))
            .collect();
        let body = serde_json::json!({ "status": "degraded", "degraded": degraded });
        json_bytes(StatusCode::OK, Bytes::from(body.to_string()))
    } else {
        let loading: Vec<&str> = gw
            .resources
            .iter()
            .filter(|r| !r.answers())
            .map(|r| r.name())
            .collect();
        let mut reasons: serde_json::Map<String, serde_json::Value> = readiness
            .resources
            .into_iter()
            .map(|(r, why)| (r, why.into()))
            .collect();
        if let Some(database) = readiness.database {
            reasons.insert("database".into(), database.into());
        }
        if let Some(feed) = readiness.feed {
            reasons.insert("change_feed".into(), feed.into());
        }
        if let Some(auth) = readiness.auth {
            reasons.insert("auth".into(), auth.into());
        }
        if let Some(shutdown) = readiness.shutdown {
            reasons.insert("shutdown".into(), shutdown.into());
        }
        for (r, why) in readiness.degraded {
            reasons.entry(r).or_insert_with(|| why.into());
        }
        let status = if loading.is_empty() {
            "not_ready"
        } else {
            "starting"
        };
        let body = serde_json::json!({ "status": status, "loading": loading, "reasons": reasons });
        let mut resp = json_bytes(
            StatusCode::SERVICE_UNAVAILABLE,
            Bytes::from(body.to_string()),
        );
        resp.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        resp
    }
}

async fn no_route(State(gw): State<Arc<Gateway>>) -> Response {
    gw.stats.traffic.no_route.fetch_add(1, Ordering::Relaxed);
    json_error(StatusCode::NOT_FOUND, "no_route", "no such route")
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const LITERALS: &[&str] = &[
        "users",
        "articles",
        "v1",
        "a",
        "healthz",
        "readyz",
        "openapi.json",
        "admin",
    ];

    /// A template a config can hold (`route::check`: literal segments and
    /// one parameter `{id}`, or a composite key's two, `{id}` and `{id2}`,
    /// not reserved), or `None` (one under `/admin`, which `route::check`
    /// refuses).
    fn template() -> impl Strategy<Value = Option<String>> {
        (
            prop::collection::vec(prop::sample::select(LITERALS.to_vec()), 0..4),
            0usize..4,
            prop::option::of(0usize..5),
        )
            .prop_map(|(mut segments, at, second)| {
                segments.insert(at.min(segments.len()), "{id}");
                let key: &[&str] = match second {
                    Some(at) => {
                        segments.insert(at.min(segments.len()), "{id2}");
                        &["id", "id2"]
                    }
                    None => &["id"],
                };
                let t = format!("/{}", segments.join("/"));
                route::check(&t, key).is_ok().then_some(t)
            })
    }

    /// Up to four distinct templates, and paths: each either random
    /// segments or one of the templates with its parameter filled in (so
    /// that most cases reach a direct route).
    fn case() -> impl Strategy<Value = (Vec<String>, Vec<String>)> {
        prop::collection::vec(template(), 1..5).prop_flat_map(|ts| {
            let mut set: Vec<String> = Vec::new();
            for t in ts.into_iter().flatten() {
                if !set.contains(&t) {
                    set.push(t);
                }
            }
            let random = prop::collection::vec(
                prop::sample::select(
                    LITERALS
                        .iter()
                        .copied()
                        .chain(["", "5", "x.y", "%2F"])
                        .collect::<Vec<_>>(),
                ),
                0..5,
            )
            .prop_map(|s| format!("/{}", s.join("/")));
            let filled = (
                prop::sample::select(if set.is_empty() {
                    vec!["/".to_string()]
                } else {
                    set.clone()
                }),
                prop::sample::select(vec!["5", "users", "healthz", "x.y", "%2F"]),
            )
                .prop_map(|(t, v)| t.replace("{id}", v).replace("{id2}", v));
            let paths = prop::collection::vec(prop_oneof![random, filled], 1..16);
            (Just(set), paths)
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(500))]

        /// Wherever the dispatch takes the direct path (and tells the
        /// access line the route's index, in place of a second match),
        /// the access line's own match names the same route.
        #[test]
        fn a_told_route_is_the_route_the_access_line_would_match((set, paths) in case()) {
            let (direct, access) = route_templates(
                set.iter().enumerate().map(|(i, t)| (t.clone(), format!("r{i}"), ())),
            );
            // Each resource's entry names it, at its index.
            for (i, t) in set.iter().enumerate() {
                prop_assert_eq!(&access[i], &(t.clone(), Some(format!("r{i}"))));
            }
            let access = front::access_index(&access);
            for path in &paths {
                let told = direct.find(path).map(|(i, ())| *i);
                let matched = access.find(path).copied();
                if let Some(i) = told {
                    prop_assert_eq!(matched, Some(i), "set {:?} path {}", set, path);
                }
            }
        }
    }

    /// The lists hold the resources first, in order, then the router's
    /// own paths, which the dispatch leaves to the router.
    #[test]
    fn the_lists_name_resources_first_then_the_routers_own_paths() {
        let (direct, access) = route_templates([
            ("/users/{id}".to_string(), "users".to_string(), 'u'),
            ("/{id}".to_string(), "root".to_string(), 'r'),
        ]);
        let mut want = vec![
            ("/users/{id}".to_string(), Some("users".to_string())),
            ("/{id}".to_string(), Some("root".to_string())),
        ];
        want.extend(route::SERVED.iter().map(|p| (p.to_string(), None)));
        assert_eq!(access, want);
        assert_eq!(direct.find("/users/5"), Some(&(0, 'u')));
        assert_eq!(direct.find("/5"), Some(&(1, 'r')));
        // `/{id}` could match it too: the router's precedence decides.
        assert_eq!(direct.find("/healthz"), None);
        let index = front::access_index(&access);
        assert_eq!(index.find("/users/5"), Some(&0));
        assert_eq!(index.find("/healthz"), None);
        assert_eq!(index.find("/a/b"), None);
    }
}
