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
//! needs `Authorization: Bearer <token>`. The check hashes the presented
//! token with a per-process secret key and compares the digests in constant
//! time, so its timing reveals nothing about the token, not even how much of
//! a guess matched (the same scheme holds the public routes' API keys:
//! `auth::keyed`, `auth::api_key`). Nothing here changes state without the
//! token.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{SystemTime, UNIX_EPOCH};

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
use crate::metrics::OUTCOMES;
use crate::rebuild::Reason;
use crate::resource::{RebuildError, Resource};

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

pub struct AdminState {
    pub gateway: Arc<Gateway>,
    pub token: TokenCheck,
}

type St = State<Arc<AdminState>>;

/// The admin router for `gateway`, guarded by `token`.
pub fn app(gateway: Arc<Gateway>, token: &str) -> super::App {
    let state = Arc::new(AdminState {
        gateway: gateway.clone(),
        token: TokenCheck::new(token),
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
    let doc = super::openapi::to_json(&super::openapi::admin_document());
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
    with_middleware_timeout(router, &gateway, None)
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
    /// The change feed keeping this resource fresh: `wal`, `notify` or
    /// `off` (`database.freshness`; `auto` is resolved at start-up).
    /// `null` before start-up has chosen.
    freshness: Option<&'static str>,
    ready: bool,
    /// Why not ready (a filter loading, a resync, a table the change feed
    /// cannot follow, a feed not proven current); `null` when ready.
    not_ready_because: Option<String>,
    /// Lookups answered from the database past filter and cache while not
    /// vouched for, and keys rejected then past `verify_budget` (503).
    unverified_loads: u64,
    unverified_refused: u64,
    generation: u64,
    #[schema(value_type = Option<Object>)]
    filter: Option<crate::filter::FilterStats>,
    #[schema(value_type = Option<Object>)]
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
    /// Failed rebuilds that recover missed keys, asked for again.
    rebuild_retries: u64,
    rebuild_refused: u64,
    live_inserts: u64,
    /// Deletes applied (counted towards `rebuild_delete_fraction`).
    deletes: u64,
    /// The rebuild coordinator: running and pending rebuilds, tickets, and
    /// how the latest one ended.
    #[schema(value_type = Object)]
    rebuild: RebuildView,
    /// The latest swap the shrink guard refused: when, and how many of the
    /// keys its scan found were missing from the live filter and added.
    #[schema(value_type = Option<Object>)]
    last_refusal: Option<crate::resource::RefusalReport>,
    /// Keys a refused rebuild found missing from the filter and added, in
    /// all.
    recovered_keys: u64,
    /// How far the filter decayed since its build (estimated false-positive
    /// rate, inserts, deletes) and the limits past which it is rebuilt.
    #[schema(value_type = Option<Object>)]
    protection: Option<crate::resource::Protection>,
    /// Rebuilds the decay limits asked for.
    decay_rebuilds: u64,
    /// bigint keys: the highest key known to exist (keys above it are
    /// checked with `verify_above_high_water`).
    high_water: Option<i64>,
    /// Announced keys above the mark the database did not confirm.
    announced_unconfirmed: u64,
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

fn view(gw: &Gateway, r: &Resource) -> ResourceView {
    let s = &r.stats;
    let l = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    let counts = s.by_outcome();
    let observed = l(&s.observed_absent);
    let absent_asked = s.filtered.get() + observed;
    let (rows, negative) = r.cache_entries();
    ResourceView {
        name: r.name().into(),
        route: r.config.route.clone(),
        table: r.config.table.clone(),
        key_type: r.config.key_type.sql_type().into(),
        freshness: gw.freshness().map(crate::feed::supervisor::name),
        ready: r.is_ready(),
        not_ready_because: r.why_not_ready(),
        unverified_loads: l(&s.unvouched_loads),
        unverified_refused: l(&s.unverified),
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
        rebuild_retries: l(&s.rebuild_retries),
        rebuild_refused: l(&s.refused_swaps),
        live_inserts: l(&s.live_inserts),
        deletes: l(&s.deletes),
        rebuild: RebuildView {
            status: r.rebuild_status(),
            last: r.last_outcome(),
        },
        last_refusal: r.last_refusal(),
        recovered_keys: l(&s.recovered_keys),
        protection: r.protection(),
        decay_rebuilds: l(&s.decay_rebuilds),
        high_water: r.high_water(),
        announced_unconfirmed: l(&s.announced_unconfirmed),
        access: AccessView {
            auth: r.config.access.mode.as_str(),
            scopes: r.config.access.scopes.clone(),
            owner_claim: r.config.access.owner_claim.clone(),
            owner_column: r.config.access.owner_column.clone(),
            rate_limit: r.config.access.rate_limit,
            unauthorized: l(&s.unauthorized),
            forbidden: l(&s.forbidden),
            rate_limited: l(&s.rate_limited),
        },
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
        .map(|r| view(&s.gateway, r))
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
    json(StatusCode::OK, &view(&s.gateway, r))
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
    wal: WalView,
    /// The bus (`bus.url`; absent without): which feed this gateway
    /// follows (`bus`, or `direct` while the bus is not current), whether
    /// it is the relay, who is, its lag, and the fall-backs and resyncs.
    #[schema(value_type = Option<Object>)]
    bus: Option<BusView>,
    /// Each read replica: in use or not, lag, replay position, queries.
    #[schema(value_type = Vec<Object>)]
    replicas: Vec<ReplicaView>,
    /// The access checks: key sets, the verified-credential cache, refusals
    /// by reason.
    #[schema(value_type = Object)]
    auth: crate::auth::AuthView,
    resources: Vec<ResourceView>,
}

#[derive(Serialize)]
struct WalView {
    commits: u64,
    inserts: u64,
    updates: u64,
    deletes: u64,
    truncates: u64,
    reconnects: u64,
    slot_invalidations: u64,
    applied_lsn: String,
    lag_bytes: u64,
    lag_ms: f64,
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

#[derive(Serialize)]
struct ReplicaView {
    name: String,
    usable: bool,
    lag_ms: u64,
    replay_lsn: String,
    queries: u64,
    errors: u64,
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
        freshness: gw.freshness().map(crate::feed::supervisor::name),
        wal: {
            let w = &gw.wal_stats;
            WalView {
                commits: l(&w.commits),
                inserts: l(&w.inserts),
                updates: l(&w.updates),
                deletes: l(&w.deletes),
                truncates: l(&w.truncates),
                reconnects: l(&w.reconnects),
                slot_invalidations: l(&w.slot_invalidations),
                applied_lsn: crate::feed::Lsn(l(&w.applied_lsn)).to_string(),
                lag_bytes: l(&w.lag_bytes),
                lag_ms: l(&w.lag_us) as f64 / 1000.0,
            }
        },
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
        replicas: gw
            .db
            .replicas()
            .map(|reps| {
                reps.members()
                    .iter()
                    .map(|r| ReplicaView {
                        name: r.name.clone(),
                        usable: r.is_usable(),
                        lag_ms: r.lag().as_millis() as u64,
                        replay_lsn: crate::feed::Lsn(r.replay_lsn()).to_string(),
                        queries: l(&r.queries),
                        errors: l(&r.errors),
                    })
                    .collect()
            })
            .unwrap_or_default(),
        auth: gw.auth.view(),
        resources: gw.resources.iter().map(|r| view(gw, r)).collect(),
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
