//! The admin listener: `/metrics`, the admin API under `/admin/...`, and the
//! status page at `/admin/`.
//!
//! Limits of its own: every admin request has `admin.request_timeout` (not
//! the public `server.request_timeout`), except a rebuild: `POST
//! .../rebuild` only requests one (answers 202 at once, with where to
//! watch it), and `?wait=true` waits up to `admin.rebuild_wait` for its
//! outcome. The rebuild itself runs in the resource's coordinator task, so
//! a request that times out or is dropped cancels nothing and leaves no
//! journal open.
//!
//! Cache paths, unambiguous for every key: `DELETE .../cache` empties the
//! caches (as does `POST .../cache/clear`, kept); `DELETE
//! .../cache/keys/{key}` purges one key, whatever it is (`clear`, `keys`).
//!
//! Everything but the status page itself (static HTML holding no data)
//! needs `Authorization: Bearer <token>`; `GET /metrics` also takes the
//! read-only metrics token (`admin.metrics_token_file`,
//! `BLOOMGATE_METRICS_TOKEN`), which opens nothing else, and
//! [`metrics_app`] serves `/metrics` alone without a token, for a listener
//! of its own on an internal address (`admin.metrics_listen`). The check hashes the presented
//! token with a per-process secret key and compares the digests in constant
//! time, so its timing reveals nothing about the token, not even how much of
//! a guess matched (the same scheme holds the public routes' API keys:
//! `auth::keyed`, `auth::api_key`). Nothing here changes state without the
//! token. The token can be replaced while serving ([`AdminToken`], SIGHUP).
//!
//! Audit: every refused token, and every request that may change state
//! (any method but `GET` and `HEAD`), is logged on the target
//! `bloomgate::audit` with method, path, status and client address; never
//! the token.

mod handlers;
mod token;
mod views;

use std::sync::Arc;

use axum::BoxError;
use axum::error_handling::HandleErrorLayer;
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use tower::ServiceBuilder;

use super::response::{json_bytes, json_error};
use super::{middleware_error, with_middleware_timeout};
use crate::gateway::Gateway;
use handlers::{rebuild_routes, render_metrics, timed_routes};
use token::require_token;

pub use handlers::routes;
pub use token::{AdminToken, TokenCheck};
pub use views::{ResourceView, StatsView};

const PAGE: &str = include_str!("../status.html");

pub struct AdminState {
    pub gateway: Arc<Gateway>,
    pub token: Arc<AdminToken>,
    /// Accepted for `GET /metrics` only.
    pub metrics_token: Option<TokenCheck>,
}

type St = State<Arc<AdminState>>;

/// The admin router for `gateway`, guarded by `token`.
pub fn app(gateway: Arc<Gateway>, token: &str) -> super::App {
    app_with(gateway, Arc::new(AdminToken::new(token)), None)
}

/// [`app`], with `GET /metrics` taking `metrics_token` too.
pub fn app_with_metrics_token(
    gateway: Arc<Gateway>,
    token: &str,
    metrics_token: Option<&str>,
) -> super::App {
    app_with(gateway, Arc::new(AdminToken::new(token)), metrics_token)
}

/// The admin router guarded by a token that can be replaced while it
/// serves, and `GET /metrics` by `metrics_token` too.
pub fn app_with(
    gateway: Arc<Gateway>,
    token: Arc<AdminToken>,
    metrics_token: Option<&str>,
) -> super::App {
    let state = Arc::new(AdminState {
        gateway: gateway.clone(),
        token,
        metrics_token: metrics_token.map(TokenCheck::new),
    });
    let (timed, _) = timed_routes().split_for_parts();
    let (rebuild, _) = rebuild_routes().split_for_parts();
    let gw = gateway.clone();
    let deadline = ServiceBuilder::new()
        .layer(HandleErrorLayer::new(move |err: BoxError| {
            let gw = gw.clone();
            async move { middleware_error(&gw, err) }
        }))
        .timeout(gateway.config.admin.request_timeout);
    let doc = super::openapi::to_json(&super::openapi::admin_document(
        routes().split_for_parts().1,
    ));
    let router = timed
        .route(
            "/admin/openapi.json",
            get(move || async move { json_bytes(StatusCode::OK, doc.clone()) }),
        )
        .route_layer(deadline)
        .merge(rebuild)
        .route_layer(middleware::from_fn_with_state(state.clone(), require_token))
        .route("/admin/", get(page))
        .route(
            "/admin",
            get(|| async { axum::response::Redirect::permanent("/admin/") }),
        )
        .fallback(|| async { json_error(StatusCode::NOT_FOUND, "no_route", "no such route") })
        .with_state(state);
    let mut templates: Vec<(String, Option<String>)> = routes()
        .split_for_parts()
        .1
        .paths
        .paths
        .keys()
        .map(|p| (p.clone(), None))
        .collect();
    for fixed in ["/admin/openapi.json", "/admin/", "/admin", "/metrics"] {
        templates.push((fixed.to_string(), None));
    }
    with_middleware_timeout(router, &gateway, None, templates)
}

/// `GET /metrics` and nothing else, with no token: for a listener of its
/// own (`admin.metrics_listen`) on an address only the scraper reaches.
pub fn metrics_app(gateway: Arc<Gateway>) -> super::App {
    let gw = gateway.clone();
    let router = axum::Router::new()
        .route(
            "/metrics",
            get(move || {
                let gw = gw.clone();
                async move { render_metrics(&gw).await }
            }),
        )
        .fallback(|| async { json_error(StatusCode::NOT_FOUND, "no_route", "no such route") });
    with_middleware_timeout(
        router,
        &gateway,
        Some(gateway.config.admin.request_timeout),
        vec![("/metrics".to_string(), None)],
    )
}

async fn page() -> Response {
    let mut resp = PAGE.into_response();
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    // Only our own inline script and same-origin fetches.
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; img-src 'self' data:",
        ),
    );
    resp
}
