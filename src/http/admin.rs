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

use std::sync::Arc;

use axum::BoxError;
use axum::error_handling::HandleErrorLayer;
use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderValue, StatusCode, Uri, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use subtle::ConstantTimeEq;
use tower::ServiceBuilder;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::response::{json_bytes, json_error};
use super::{middleware_error, with_middleware_timeout};
use crate::auth::keyed::KeyedHash;
use crate::gateway::Gateway;
use crate::rebuild::Reason;
use crate::resource::{RebuildError, Resource, ResourceSnapshot, StatsSnapshot};

const PAGE: &str = include_str!("status.html");

/// Verifies bearer tokens without keeping or comparing the token itself.
pub struct TokenCheck {
    key: KeyedHash,
    digest: [u8; 32],
}

impl TokenCheck {
    pub fn new(token: &str) -> Self {
        let key = KeyedHash::random();
        let digest = key.digest(token.as_bytes());
        Self { key, digest }
    }

    pub fn verify(&self, presented: &[u8]) -> bool {
        self.key.digest(presented).ct_eq(&self.digest).into()
    }
}

impl std::fmt::Debug for TokenCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TokenCheck(..)")
    }
}

/// The admin token in force, replaced as a whole (SIGHUP re-reads
/// `admin.token_file`): a request is checked against the old token or the
/// new one, never a mix.
pub struct AdminToken(arc_swap::ArcSwap<TokenCheck>);

impl AdminToken {
    pub fn new(token: &str) -> Self {
        Self(arc_swap::ArcSwap::from_pointee(TokenCheck::new(token)))
    }

    pub fn replace(&self, token: &str) {
        self.0.store(Arc::new(TokenCheck::new(token)));
    }

    pub fn verify(&self, presented: &[u8]) -> bool {
        self.0.load().verify(presented)
    }
}

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

/// The authenticated routes with their OpenAPI entries.
pub fn routes() -> OpenApiRouter<Arc<AdminState>> {
    timed_routes().merge(rebuild_routes())
}

/// Routes bounded by `admin.request_timeout`.
fn timed_routes() -> OpenApiRouter<Arc<AdminState>> {
    OpenApiRouter::new()
        .routes(routes!(metrics))
        .routes(routes!(resources))
        .routes(routes!(resource))
        .routes(routes!(stats))
        .routes(routes!(purge_key))
        .routes(routes!(clear_cache))
        .routes(routes!(clear_cache_post))
}

/// The rebuild route: answers at once, or waits up to `admin.rebuild_wait`.
fn rebuild_routes() -> OpenApiRouter<Arc<AdminState>> {
    OpenApiRouter::new().routes(routes!(rebuild))
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

async fn require_token(State(state): St, req: Request, next: Next) -> Response {
    let presented = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| crate::auth::bearer_token(v.as_bytes()));
    let client = req
        .extensions()
        .get::<crate::auth::peer::PeerAddr>()
        .map(|p| p.0.to_string())
        .unwrap_or_default();
    let allowed = presented.is_some_and(|t| {
        state.token.verify(t)
            || (req.uri().path() == "/metrics"
                && state.metrics_token.as_ref().is_some_and(|m| m.verify(t)))
    });
    match allowed {
        true => {
            let method = req.method().clone();
            let path = req.uri().path().to_string();
            let resp = next.run(req).await;
            if method != axum::http::Method::GET && method != axum::http::Method::HEAD {
                tracing::info!(
                    target: crate::telemetry::AUDIT,
                    method = %method,
                    path,
                    status = resp.status().as_u16(),
                    client,
                    "admin action"
                );
            }
            resp
        }
        false => {
            tracing::warn!(
                target: crate::telemetry::AUDIT,
                method = %req.method(),
                path = req.uri().path(),
                client,
                token = if presented.is_some() { "wrong" } else { "missing" },
                "admin token refused"
            );
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

/// Prometheus exposition (the admin token, or the read-only metrics token).
#[utoipa::path(get, path = "/metrics", tag = "admin", security(("bearer" = [])),
    responses((status = 200, description = "Prometheus text format", content_type = "text/plain"),
              (status = 401, description = "Missing or wrong token", body = super::openapi::ErrorBody)))]
async fn metrics(State(s): St) -> Response {
    render_metrics(&s.gateway).await
}

async fn render_metrics(gw: &Gateway) -> Response {
    sync_caches(gw).await;
    let mut resp = gw.metrics.render(&gw.snapshot()).into_response();
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
    /// How its keys compare, as the key column's type and collation say
    /// (`bytes`, `trailing spaces ignored (char(n))`, `lower() under
    /// collation …`): see docs/src/your-tables.md, key types.
    key_comparison: String,
    /// The change feed keeping this resource fresh: `wal`, `notify` or
    /// `off` (`database.freshness`; `auto` is resolved at start-up).
    /// `null` before start-up has chosen.
    freshness: Option<&'static str>,
    ready: bool,
    /// Why not ready (a filter loading, a resync, a table the change feed
    /// cannot follow, a feed not proven current); `null` when ready.
    not_ready_because: Option<String>,
    generation: u64,
    #[schema(value_type = Option<Object>)]
    filter: Option<crate::filter::FilterStats>,
    #[schema(value_type = Option<Object>)]
    last_build: Option<crate::resource::BuildReport>,
    cache_rows: u64,
    cache_negative: u64,
    /// The resource's counters: requests by outcome, rebuilds, live
    /// inserts and deletes, observed false positives.
    #[serde(flatten)]
    stats: StatsSnapshot,
    /// The rebuild coordinator: running and pending rebuilds, tickets, and
    /// how the latest one ended.
    #[schema(value_type = Object)]
    rebuild: RebuildView,
    /// The latest swap the shrink guard refused: when, and how many of the
    /// keys its scan found were missing from the live filter and added.
    #[schema(value_type = Option<Object>)]
    last_refusal: Option<crate::resource::RefusalReport>,
    /// How far the filter decayed since its build (estimated false-positive
    /// rate, inserts, deletes) and the limits past which it is rebuilt.
    #[schema(value_type = Option<Object>)]
    protection: Option<crate::resource::Protection>,
    /// bigint keys: the highest key known to exist (keys above it are
    /// checked with `verify_above_high_water`).
    high_water: Option<i64>,
    /// Who may read it, and how many requests were refused.
    #[schema(value_type = Object)]
    access: AccessView,
}

/// A resource's access rules and refusals.
#[derive(Serialize)]
struct AccessView {
    /// `none`, `jwt`, `api_key` or `any`.
    auth: &'static str,
    scopes: Vec<String>,
    owner_claim: Option<String>,
    /// `null` with an owner claim: the key is compared.
    owner_column: Option<String>,
    /// Requests per second per caller, and the burst.
    rate_limit: Option<crate::config::RateLimit>,
    /// Answered 401 (no valid credential).
    unauthorized: u64,
    /// Answered 403 (a scope or the owner claim missing), or 404 for
    /// another owner's key or row.
    forbidden: u64,
    /// Answered 429.
    rate_limited: u64,
}

/// The coordinator's state plus the latest outcome.
#[derive(Serialize)]
struct RebuildView {
    #[serde(flatten)]
    status: crate::rebuild::Status,
    last: Option<crate::resource::LastOutcome>,
}

fn view(gw: &Gateway, r: &Resource, snap: ResourceSnapshot) -> ResourceView {
    let c = snap.stats;
    ResourceView {
        name: snap.name,
        route: r.config.route.clone(),
        table: r.config.table.clone(),
        key_type: r.config.key_type.sql_type().into(),
        key_comparison: r.comparison().describe(),
        freshness: gw.freshness().map(crate::feed::supervisor::name),
        ready: r.is_ready(),
        not_ready_because: r.why_not_ready(),
        generation: snap.generation,
        filter: snap.filter,
        last_build: snap.last_build,
        cache_rows: snap.cache_rows,
        cache_negative: snap.cache_negative,
        rebuild: RebuildView {
            status: r.rebuild_status(),
            last: r.last_outcome(),
        },
        last_refusal: r.last_refusal(),
        protection: r.protection(),
        high_water: r.high_water(),
        access: AccessView {
            auth: r.config.access.mode.as_str(),
            scopes: r.config.access.scopes.clone(),
            owner_claim: r.config.access.owner_claim.clone(),
            owner_column: r.config.access.owner_column.clone(),
            rate_limit: r.config.access.rate_limit,
            unauthorized: c.unauthorized,
            forbidden: c.forbidden,
            rate_limited: c.rate_limited,
        },
        stats: c,
    }
}

/// Every resource's filter, cache and counters.
#[utoipa::path(get, path = "/admin/resources", tag = "admin", security(("bearer" = [])),
    responses((status = 200, body = Vec<ResourceView>),
              (status = 401, description = "Missing or wrong token", body = super::openapi::ErrorBody)))]
async fn resources(State(s): St) -> Response {
    sync_caches(&s.gateway).await;
    let all: Vec<ResourceView> = s
        .gateway
        .resources
        .iter()
        .map(|r| view(&s.gateway, r, r.snapshot()))
        .collect();
    json(StatusCode::OK, &all)
}

/// One resource's filter, cache, counters and rebuild state: where `POST
/// .../rebuild` says to watch (`rebuild.completed_ticket` reaches the ticket
/// it gave, and `rebuild.last` says how it ended).
#[utoipa::path(get, path = "/admin/resources/{name}", tag = "admin", security(("bearer" = [])),
    params(("name" = String, Path, description = "Resource name")),
    responses((status = 200, body = ResourceView),
              (status = 401, description = "Missing or wrong token", body = super::openapi::ErrorBody),
              (status = 404, description = "No such resource", body = super::openapi::ErrorBody)))]
async fn resource(State(s): St, Path(name): Path<String>) -> Response {
    let Some(r) = s.gateway.resource(&name) else {
        return no_resource();
    };
    r.sync_cache().await;
    json(StatusCode::OK, &view(&s.gateway, r, r.snapshot()))
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
    /// The change feed in force: `wal`, `notify` or `off` (`database.freshness`
    /// resolved at start-up; absent before).
    freshness: Option<&'static str>,
    /// The `wal` feed's counters (zero in the other modes).
    #[schema(value_type = Object)]
    wal: crate::feed::wal::WalSnapshot,
    /// The bus (`bus.url`; absent without): which feed this gateway
    /// follows (`bus`, or `direct` while the bus is not current), whether
    /// it is the relay, who is, its lag, and the fall-backs and resyncs.
    #[schema(value_type = Option<Object>)]
    bus: Option<BusView>,
    /// Each read replica: in use or not, lag, replay position, queries.
    #[schema(value_type = Vec<Object>)]
    replicas: Vec<crate::db::replicas::ReplicaSnapshot>,
    /// The access checks: key sets, the verified-credential cache, refusals
    /// by reason.
    #[schema(value_type = Object)]
    auth: crate::auth::AuthView,
    resources: Vec<ResourceView>,
}

#[derive(Serialize)]
struct BusView {
    url: String,
    stream: String,
    mode: &'static str,
    relaying: bool,
    relay: Option<String>,
    detail: Option<String>,
    lag_bytes: u64,
    lag_ms: u64,
    fallbacks: u64,
    returns: u64,
    breaks: u64,
    read: u64,
    appended: u64,
    duplicates: u64,
    terms: u64,
}

/// Counters for the status page.
#[utoipa::path(get, path = "/admin/stats", tag = "admin", security(("bearer" = [])),
    responses((status = 200, body = StatsView),
              (status = 401, description = "Missing or wrong token", body = super::openapi::ErrorBody)))]
async fn stats(State(s): St) -> Response {
    sync_caches(&s.gateway).await;
    let gw = &s.gateway;
    let snap = gw.snapshot();
    let l = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
    let body = StatsView {
        time_ms: snap.time_ms,
        db_queries: snap.db.queries,
        db_errors: snap.db.errors,
        notifications: snap.feed.notify.notifications,
        listener_reconnects: snap.feed.notify.listener_reconnects,
        shed: snap.traffic.shed,
        timeouts: snap.traffic.timeouts,
        freshness: gw.freshness().map(crate::feed::supervisor::name),
        wal: snap.feed.wal,
        replicas: snap.replicas,
        auth: snap.auth,
        resources: gw
            .resources
            .iter()
            .zip(snap.resources)
            .map(|(r, rs)| view(gw, r, rs))
            .collect(),
        bus: gw.bus_status().map(|b| {
            let st = b.get();
            BusView {
                url: st.url,
                stream: st.stream,
                mode: st.mode.name(),
                relaying: st.relaying,
                relay: st.relay,
                detail: st.detail,
                lag_bytes: l(&b.lag_bytes),
                lag_ms: l(&b.lag_ms),
                fallbacks: l(&b.fallbacks),
                returns: l(&b.returns),
                breaks: l(&b.breaks),
                read: l(&b.read),
                appended: l(&b.appended),
                duplicates: l(&b.duplicates),
                terms: l(&b.terms),
            }
        }),
    };
    json(StatusCode::OK, &body)
}

#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
struct RebuildParams {
    /// Swap even if the scan shrank past `max_shrink`. Default false.
    #[param(nullable = false)]
    force: Option<bool>,
    /// Wait for the outcome (up to `admin.rebuild_wait`) instead of
    /// answering 202 at once. Default false.
    #[param(nullable = false)]
    wait: Option<bool>,
}

/// What `POST .../rebuild` answers while the rebuild has not ended.
#[derive(Serialize, ToSchema)]
struct Accepted {
    status: &'static str,
    resource: String,
    /// The ticket of the rebuild that covers this request: done once the
    /// resource's `rebuild.completed_ticket` reaches it.
    ticket: u64,
    /// Where to watch: `GET` it for `rebuild` and `generation`.
    watch: String,
    /// The generation when requested: a successful rebuild swaps in a
    /// higher one.
    generation: u64,
}

/// Requests a rebuild of a resource's filter. It runs in the background,
/// coalesced with every other rebuild request for the resource (at most
/// one running and one pending): 202 at once with the ticket and where to
/// watch it; with `wait=true`, the outcome (200, 409, 503) once it ends, or
/// 202 after `admin.rebuild_wait`. Never cut off by a timeout.
#[utoipa::path(post, path = "/admin/resources/{name}/rebuild", tag = "admin", security(("bearer" = [])),
    params(("name" = String, Path, description = "Resource name"), RebuildParams),
    responses((status = 200, description = "`wait=true`: the new filter's build report", body = Object),
              (status = 202, description = "Requested (or still running after `admin.rebuild_wait`); `Location` is where to watch", body = Accepted),
              (status = 400, description = "`force` or `wait` is not `true` or `false`", body = super::openapi::ErrorBody),
              (status = 401, description = "Missing or wrong token", body = super::openapi::ErrorBody),
              (status = 404, description = "No such resource", body = super::openapi::ErrorBody),
              (status = 409, description = "Refused by the shrink guard (the keys it found are served meanwhile), or the filter is disabled", body = super::openapi::ErrorBody),
              (status = 503, description = "The rebuild failed (the old filter stays), or the gateway is stopping", body = super::openapi::ErrorBody)))]
async fn rebuild(
    State(s): St,
    Path(name): Path<String>,
    p: Result<Query<RebuildParams>, axum::extract::rejection::QueryRejection>,
) -> Response {
    // axum's own rejection is plain text; every error here is JSON.
    let Ok(Query(p)) = p else {
        return json_error(
            StatusCode::BAD_REQUEST,
            "bad_query",
            "force and wait take true or false",
        );
    };
    let Some(r) = s.gateway.resource(&name) else {
        return no_resource();
    };
    if !r.config.filter.enabled {
        return refused(&RebuildError::Disabled);
    }
    let generation = r.generation();
    let ticket = r.request_rebuild(Reason::Admin, p.force.unwrap_or(false));
    let accepted = Accepted {
        status: "accepted",
        resource: name.clone(),
        ticket: ticket.id(),
        watch: format!("/admin/resources/{name}"),
        generation,
    };
    if !p.wait.unwrap_or(false) {
        return accepted_response(&accepted);
    }
    let wait = s.gateway.config.admin.rebuild_wait;
    match tokio::time::timeout(wait, ticket.outcome()).await {
        Err(_) => accepted_response(&accepted),
        Ok(Some(Ok(report))) => json(StatusCode::OK, &report),
        Ok(Some(Err(e @ (RebuildError::Shrunk { .. } | RebuildError::Disabled)))) => refused(&e),
        Ok(None | Some(Err(RebuildError::Cancelled))) => json_error(
            StatusCode::SERVICE_UNAVAILABLE,
            "stopping",
            "the gateway is stopping; the rebuild did not finish",
        ),
        Ok(Some(Err(e))) => {
            tracing::warn!(resource = %name, error = %e, "admin rebuild failed");
            json_error(
                StatusCode::SERVICE_UNAVAILABLE,
                "rebuild_failed",
                "the rebuild failed; the current filter stays (see the logs)",
            )
        }
    }
}

fn refused(e: &RebuildError) -> Response {
    json_error(StatusCode::CONFLICT, "refused", &e.to_string())
}

fn accepted_response(a: &Accepted) -> Response {
    let mut resp = json(StatusCode::ACCEPTED, a);
    if let Ok(v) = HeaderValue::from_str(&a.watch) {
        resp.headers_mut().insert(header::LOCATION, v);
    }
    resp
}

/// Drops one key's cached row or negative entry. Any key, `clear` and
/// `keys` included: nothing else lives under `.../cache/keys/`.
#[utoipa::path(delete, path = "/admin/resources/{name}/cache/keys/{key}", tag = "admin", security(("bearer" = [])),
    params(("name" = String, Path, description = "Resource name"),
           ("key" = String, Path, description = "The key, as in the resource's route")),
    responses((status = 204, description = "Purged"),
              (status = 400, description = "Malformed key", body = super::openapi::ErrorBody),
              (status = 401, description = "Missing or wrong token", body = super::openapi::ErrorBody),
              (status = 404, description = "No such resource", body = super::openapi::ErrorBody)))]
async fn purge_key(State(s): St, uri: Uri) -> Response {
    // /admin/resources/{name}/cache/keys/{key}: read the raw segments, so
    // the key is percent-decoded once, by the same parser as on the public
    // side.
    let mut parts = uri.path().split('/').skip(3);
    let (Some(name), Some(raw)) = (parts.next(), parts.nth(2)) else {
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
#[utoipa::path(delete, path = "/admin/resources/{name}/cache", tag = "admin", security(("bearer" = [])),
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

/// Empties a resource's row and negative caches (the older spelling of
/// `DELETE .../cache`, kept: no other route takes POST there).
#[utoipa::path(post, path = "/admin/resources/{name}/cache/clear", tag = "admin", security(("bearer" = [])),
    params(("name" = String, Path, description = "Resource name")),
    responses((status = 204, description = "Cleared"),
              (status = 401, description = "Missing or wrong token", body = super::openapi::ErrorBody),
              (status = 404, description = "No such resource", body = super::openapi::ErrorBody)))]
async fn clear_cache_post(state: St, name: Path<String>) -> Response {
    clear_cache(state, name).await
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
