//! The admin listener: `/metrics`, the admin API under `/admin/...`, and the
//! status page at `/admin/`.
//!
//! Everything but the status page itself (static HTML holding no data)
//! needs `Authorization: Bearer <token>`. The check hashes the presented
//! token with a per-process secret key and compares the digests in constant
//! time, so its timing reveals nothing about the token, not even how much of
//! a guess matched. Nothing here changes state without the token.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderValue, StatusCode, Uri, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use bytes::Bytes;
use highway::{HighwayHash, HighwayHasher};
use serde::{Deserialize, Serialize};
use subtle::ConstantTimeEq;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::response::{json_bytes, json_error};
use super::with_middleware;
use crate::gateway::Gateway;
use crate::metrics::OUTCOMES;
use crate::resource::{RebuildError, Resource};

const PAGE: &str = include_str!("status.html");

/// Verifies bearer tokens without keeping or comparing the token itself.
pub struct TokenCheck {
    key: highway::Key,
    digest: [u8; 32],
}

impl TokenCheck {
    pub fn new(token: &str) -> Self {
        let mut seed = [0u8; 32];
        getrandom::fill(&mut seed).expect("the OS random source is available");
        let key = highway::Key(std::array::from_fn(|i| {
            u64::from_le_bytes(seed[i * 8..i * 8 + 8].try_into().unwrap())
        }));
        let digest = digest(&key, token.as_bytes());
        Self { key, digest }
    }

    pub fn verify(&self, presented: &[u8]) -> bool {
        digest(&self.key, presented).ct_eq(&self.digest).into()
    }
}

impl std::fmt::Debug for TokenCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TokenCheck(..)")
    }
}

fn digest(key: &highway::Key, data: &[u8]) -> [u8; 32] {
    let words = HighwayHasher::new(*key).hash256(data);
    let mut out = [0u8; 32];
    for (chunk, w) in out.chunks_exact_mut(8).zip(words) {
        chunk.copy_from_slice(&w.to_le_bytes());
    }
    out
}

pub struct AdminState {
    pub gateway: Arc<Gateway>,
    pub token: TokenCheck,
}

type St = State<Arc<AdminState>>;

/// The admin router for `gateway`, guarded by `token`.
pub fn app(gateway: Arc<Gateway>, token: &str) -> Router {
    let state = Arc::new(AdminState {
        gateway: gateway.clone(),
        token: TokenCheck::new(token),
    });
    let (api, _) = routes().split_for_parts();
    let router = api
        .route_layer(middleware::from_fn_with_state(state.clone(), require_token))
        .route("/admin/", get(page))
        .route(
            "/admin",
            get(|| async { axum::response::Redirect::permanent("/admin/") }),
        )
        .fallback(|| async { json_error(StatusCode::NOT_FOUND, "no_route", "no such route") })
        .with_state(state);
    with_middleware(router, &gateway)
}

/// The authenticated routes with their OpenAPI entries.
pub fn routes() -> OpenApiRouter<Arc<AdminState>> {
    OpenApiRouter::new()
        .routes(routes!(metrics))
        .routes(routes!(resources))
        .routes(routes!(stats))
        .routes(routes!(rebuild))
        .routes(routes!(purge_key))
        .routes(routes!(clear_cache))
}

async fn require_token(State(state): St, req: Request, next: Next) -> Response {
    let presented = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "));
    match presented {
        Some(t) if state.token.verify(t) => next.run(req).await,
        _ => {
            let mut resp = json_error(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "a valid bearer token is required",
            );
            resp.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"bloomgate-admin\""),
            );
            resp
        }
    }
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

/// Prometheus exposition.
#[utoipa::path(get, path = "/metrics", tag = "admin", security(("bearer" = [])),
    responses((status = 200, description = "Prometheus text format", content_type = "text/plain"),
              (status = 401, description = "Missing or wrong token", body = super::openapi::ErrorBody)))]
async fn metrics(State(s): St) -> Response {
    sync_caches(&s.gateway).await;
    let mut resp = s.gateway.metrics.render(&s.gateway).into_response();
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4"),
    );
    resp
}

/// One resource's state, as `GET /admin/resources` lists it.
#[derive(Serialize, ToSchema)]
pub struct ResourceView {
    name: String,
    route: String,
    table: String,
    key_type: String,
    ready: bool,
    generation: u64,
    #[schema(value_type = Object)]
    filter: Option<crate::filter::FilterStats>,
    #[schema(value_type = Object)]
    last_build: Option<crate::resource::BuildReport>,
    cache_rows: u64,
    cache_negative: u64,
    /// Lookups by outcome.
    requests: BTreeMap<String, u64>,
    /// Keys the filter passed that the database did not have.
    observed_false_positives: u64,
    /// observed false positives / absent keys looked up (filtered + observed).
    observed_fp_rate: f64,
    rebuilds: u64,
    rebuild_failures: u64,
    rebuild_refused: u64,
    live_inserts: u64,
}

fn view(r: &Resource) -> ResourceView {
    let s = &r.stats;
    let l = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    let counts = s.by_outcome();
    let observed = l(&s.observed_absent);
    let absent_asked = l(&s.filtered) + observed;
    let (rows, negative) = r.cache_entries();
    ResourceView {
        name: r.name().into(),
        route: r.config.route.clone(),
        table: r.config.table.clone(),
        key_type: r.config.key_type.sql_type().into(),
        ready: r.is_ready(),
        generation: r.generation(),
        filter: r.filter_stats(),
        last_build: r.last_build(),
        cache_rows: rows,
        cache_negative: negative,
        requests: OUTCOMES.iter().map(|o| o.to_string()).zip(counts).collect(),
        observed_false_positives: observed,
        observed_fp_rate: if absent_asked == 0 {
            0.0
        } else {
            observed as f64 / absent_asked as f64
        },
        rebuilds: l(&s.rebuilds),
        rebuild_failures: l(&s.rebuild_failures),
        rebuild_refused: l(&s.refused_swaps),
        live_inserts: l(&s.live_inserts),
    }
}

/// Every resource's filter, cache and counters.
#[utoipa::path(get, path = "/admin/resources", tag = "admin", security(("bearer" = [])),
    responses((status = 200, body = Vec<ResourceView>),
              (status = 401, description = "Missing or wrong token", body = super::openapi::ErrorBody)))]
async fn resources(State(s): St) -> Response {
    sync_caches(&s.gateway).await;
    let all: Vec<ResourceView> = s.gateway.resources.iter().map(|r| view(r)).collect();
    json(StatusCode::OK, &all)
}

/// A snapshot for the status page's charts: counters with a timestamp, so
/// the page can turn successive snapshots into rates.
#[derive(Serialize, ToSchema)]
pub struct StatsView {
    /// Milliseconds since the Unix epoch.
    time_ms: u64,
    db_queries: u64,
    db_errors: u64,
    notifications: u64,
    listener_reconnects: u64,
    shed: u64,
    timeouts: u64,
    resources: Vec<ResourceView>,
}

/// Counters for the status page.
#[utoipa::path(get, path = "/admin/stats", tag = "admin", security(("bearer" = [])),
    responses((status = 200, body = StatsView),
              (status = 401, description = "Missing or wrong token", body = super::openapi::ErrorBody)))]
async fn stats(State(s): St) -> Response {
    sync_caches(&s.gateway).await;
    let gw = &s.gateway;
    let l = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    let body = StatsView {
        time_ms: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_millis() as u64,
        db_queries: gw.db.queries(),
        db_errors: gw.db.errors(),
        notifications: l(&gw.stats.notifications),
        listener_reconnects: l(&gw.stats.listener_reconnects),
        shed: l(&gw.stats.shed),
        timeouts: l(&gw.stats.timeouts),
        resources: gw.resources.iter().map(|r| view(r)).collect(),
    };
    json(StatusCode::OK, &body)
}

#[derive(Deserialize, utoipa::IntoParams)]
struct RebuildParams {
    /// Swap even if the scan shrank past `max_shrink`.
    force: Option<bool>,
}

/// Rebuilds a resource's filter now and swaps it in.
#[utoipa::path(post, path = "/admin/resources/{name}/rebuild", tag = "admin", security(("bearer" = [])),
    params(("name" = String, Path, description = "Resource name"), RebuildParams),
    responses((status = 200, description = "The new filter's build report", body = Object),
              (status = 401, description = "Missing or wrong token", body = super::openapi::ErrorBody),
              (status = 404, description = "No such resource", body = super::openapi::ErrorBody),
              (status = 409, description = "Refused by the shrink guard, or the filter is disabled", body = super::openapi::ErrorBody),
              (status = 503, description = "Database unavailable; the old filter stays", body = super::openapi::ErrorBody)))]
async fn rebuild(
    State(s): St,
    Path(name): Path<String>,
    Query(p): Query<RebuildParams>,
) -> Response {
    let Some(r) = s.gateway.resource(&name) else {
        return no_resource();
    };
    match r.rebuild(p.force.unwrap_or(false)).await {
        Ok(report) => json(StatusCode::OK, &report),
        Err(e @ (RebuildError::Shrunk { .. } | RebuildError::Disabled)) => {
            json_error(StatusCode::CONFLICT, "refused", &e.to_string())
        }
        Err(e) => {
            tracing::warn!(resource = %name, error = %e, "admin rebuild failed");
            json_error(
                StatusCode::SERVICE_UNAVAILABLE,
                "rebuild_failed",
                "the rebuild failed; the current filter stays (see the logs)",
            )
        }
    }
}

/// Drops one key's cached row or negative entry.
#[utoipa::path(delete, path = "/admin/resources/{name}/cache/{key}", tag = "admin", security(("bearer" = [])),
    params(("name" = String, Path, description = "Resource name"),
           ("key" = String, Path, description = "The key, as in the resource's route")),
    responses((status = 204, description = "Purged"),
              (status = 400, description = "Malformed key", body = super::openapi::ErrorBody),
              (status = 401, description = "Missing or wrong token", body = super::openapi::ErrorBody),
              (status = 404, description = "No such resource", body = super::openapi::ErrorBody)))]
async fn purge_key(State(s): St, uri: Uri) -> Response {
    // /admin/resources/{name}/cache/{key}: read the raw segments, so the key
    // is percent-decoded once, by the same parser as on the public side.
    let mut parts = uri.path().split('/').skip(3);
    let (Some(name), Some(raw)) = (parts.next(), parts.nth(1)) else {
        return no_resource();
    };
    let Some(r) = s.gateway.resource(name) else {
        return no_resource();
    };
    match r.parse_key(raw, s.gateway.config.server.max_key_length) {
        Ok(key) => {
            r.invalidate(&key).await;
            StatusCode::NO_CONTENT.into_response()
        }
        Err(e) => e.into_response(),
    }
}

/// Empties a resource's row and negative caches.
#[utoipa::path(post, path = "/admin/resources/{name}/cache/clear", tag = "admin", security(("bearer" = [])),
    params(("name" = String, Path, description = "Resource name")),
    responses((status = 204, description = "Cleared"),
              (status = 401, description = "Missing or wrong token", body = super::openapi::ErrorBody),
              (status = 404, description = "No such resource", body = super::openapi::ErrorBody)))]
async fn clear_cache(State(s): St, Path(name): Path<String>) -> Response {
    match s.gateway.resource(&name) {
        Some(r) => {
            r.clear_cache();
            StatusCode::NO_CONTENT.into_response()
        }
        None => no_resource(),
    }
}

async fn sync_caches(gw: &Gateway) {
    for r in &gw.resources {
        r.sync_cache().await;
    }
}

fn no_resource() -> Response {
    json_error(StatusCode::NOT_FOUND, "no_resource", "no such resource")
}

fn json<T: Serialize>(status: StatusCode, body: &T) -> Response {
    match serde_json::to_vec(body) {
        Ok(b) => json_bytes(status, Bytes::from(b)),
        Err(e) => crate::error::Error::Internal(e.to_string()).into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_verify_only_exactly() {
        let t = TokenCheck::new("correct horse battery staple");
        assert!(t.verify(b"correct horse battery staple"));
        assert!(!t.verify(b"correct horse battery stapl"));
        assert!(!t.verify(b"correct horse battery staple "));
        assert!(!t.verify(b""));
        assert!(!format!("{t:?}").contains("horse"));
    }
}
