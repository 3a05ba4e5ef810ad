//! The admin API's routes and their handlers: metrics, resource state,
//! cache purges and rebuilds, each with its OpenAPI entry (the routes'
//! own annotations make `/admin/openapi.json`).

use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::{HeaderValue, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::views::{ResourceView, StatsView, stats_view, view};
use super::{AdminState, St};
use crate::gateway::Gateway;
use crate::http::openapi::ErrorBody;
use crate::http::response::{json_bytes, json_error};
use crate::rebuild::Reason;
use crate::resource::RebuildError;

/// The authenticated routes with their OpenAPI entries.
pub fn routes() -> OpenApiRouter<Arc<AdminState>> {
    timed_routes().merge(rebuild_routes())
}

/// Routes bounded by `admin.request_timeout`.
pub(super) fn timed_routes() -> OpenApiRouter<Arc<AdminState>> {
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
pub(super) fn rebuild_routes() -> OpenApiRouter<Arc<AdminState>> {
    OpenApiRouter::new().routes(routes!(rebuild))
}

/// Prometheus exposition (the admin token, or the read-only metrics token).
#[utoipa::path(get, path = "/metrics", tag = "admin", security(("bearer" = [])),
    responses((status = 200, description = "Prometheus text format", content_type = "text/plain"),
              (status = 401, description = "Missing or wrong token", body = ErrorBody)))]
async fn metrics(State(s): St) -> Response {
    render_metrics(&s.gateway).await
}

pub(super) async fn render_metrics(gw: &Gateway) -> Response {
    sync_caches(gw).await;
    let mut resp = gw.metrics.render(&gw.snapshot()).into_response();
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4"),
    );
    resp
}

/// Every resource's filter, cache and counters.
#[utoipa::path(get, path = "/admin/resources", tag = "admin", security(("bearer" = [])),
    responses((status = 200, body = Vec<ResourceView>),
              (status = 401, description = "Missing or wrong token", body = ErrorBody)))]
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
              (status = 401, description = "Missing or wrong token", body = ErrorBody),
              (status = 404, description = "No such resource", body = ErrorBody)))]
async fn resource(State(s): St, Path(name): Path<String>) -> Response {
    let Some(r) = s.gateway.resource(&name) else {
        return no_resource();
    };
    r.sync_cache().await;
    json(StatusCode::OK, &view(&s.gateway, r, r.snapshot()))
}

/// Counters for the status page.
#[utoipa::path(get, path = "/admin/stats", tag = "admin", security(("bearer" = [])),
    responses((status = 200, body = StatsView),
              (status = 401, description = "Missing or wrong token", body = ErrorBody)))]
async fn stats(State(s): St) -> Response {
    sync_caches(&s.gateway).await;
    json(StatusCode::OK, &stats_view(&s.gateway))
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
              (status = 400, description = "`force` or `wait` is not `true` or `false`", body = ErrorBody),
              (status = 401, description = "Missing or wrong token", body = ErrorBody),
              (status = 404, description = "No such resource", body = ErrorBody),
              (status = 409, description = "Refused by the shrink guard (the keys it found are served meanwhile), or the filter is disabled", body = ErrorBody),
              (status = 503, description = "The rebuild failed (the old filter stays), or the gateway is stopping", body = ErrorBody)))]
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
/// `keys` included: nothing else lives under `.../cache/keys/`. A
/// composite key is its parts in `key_column` order, separated by `,`
/// (`7,A-12`; a `,` inside a part is written `%2C`).
#[utoipa::path(delete, path = "/admin/resources/{name}/cache/keys/{key}", tag = "admin", security(("bearer" = [])),
    params(("name" = String, Path, description = "Resource name"),
           ("key" = String, Path, description = "The key, as in the resource's route; a composite key's parts in key_column order, separated by ',' (a ',' inside a part percent-encoded)")),
    responses((status = 204, description = "Purged"),
              (status = 400, description = "Malformed key", body = ErrorBody),
              (status = 401, description = "Missing or wrong token", body = ErrorBody),
              (status = 404, description = "No such resource", body = ErrorBody)))]
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
    // Split before decoding: a part's own `,` arrives as `%2C`.
    let raw: Vec<&str> = match r.key_parts().len() {
        1 => vec![raw],
        _ => raw.split(',').collect(),
    };
    match r.parse_key(&raw, s.gateway.config.server.max_key_length) {
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
              (status = 401, description = "Missing or wrong token", body = ErrorBody),
              (status = 404, description = "No such resource", body = ErrorBody)))]
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
              (status = 401, description = "Missing or wrong token", body = ErrorBody),
              (status = 404, description = "No such resource", body = ErrorBody)))]
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
