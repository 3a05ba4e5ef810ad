//! What the admin API answers about the gateway: one resource's state
//! (`GET /admin/resources`, `/admin/resources/{name}`) and the status
//! page's counters (`GET /admin/stats`), built from the gateway's snapshots.

use serde::Serialize;
use utoipa::ToSchema;

use crate::gateway::Gateway;
use crate::resource::{Resource, ResourceSnapshot, StatsSnapshot};

/// One resource's state, as `GET /admin/resources` lists it.
#[derive(Serialize, ToSchema)]
pub struct ResourceView {
    name: String,
    route: String,
    table: String,
    key_type: String,
    /// How its keys compare, as the key column's type and collation say
    /// (per part of a composite key, comma-separated)
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

pub(super) fn view(gw: &Gateway, r: &Resource, snap: ResourceSnapshot) -> ResourceView {
    let c = snap.stats;
    ResourceView {
        name: snap.name,
        route: r.config.route.clone(),
        table: r.config.table.clone(),
        key_type: r.config.key_type_name(),
        key_comparison: (0..r.config.key.len())
            .map(|i| r.part_comparison(i).describe())
            .collect::<Vec<_>>()
            .join(", "),
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
    /// The Redis node read: `primary HOST:PORT` or `replica HOST:PORT`.
    reading: String,
    mode: &'static str,
    relaying: bool,
    relay: Option<String>,
    detail: Option<String>,
    #[serde(flatten)]
    counters: crate::feed::bus::Counters,
}

/// The status page's snapshot of `gw` (whose caches the caller synced).
pub(super) fn stats_view(gw: &Gateway) -> StatsView {
    let snap = gw.snapshot();
    StatsView {
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
                reading: st.reading,
                mode: st.mode.name(),
                relaying: st.relaying,
                relay: st.relay,
                detail: st.detail,
                counters: b.counters(),
            }
        }),
    }
}
