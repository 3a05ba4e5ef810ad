//! Configuration: read once, at start-up, into typed structs.
//!
//! Sources, later ones winning: the built-in defaults documented on each
//! field, the TOML file (`config/bloomgate.toml` unless `--config` says
//! otherwise), then environment variables `BLOOMGATE_<PATH>` where `__`
//! separates nesting levels (`BLOOMGATE_SERVER__LISTEN=0.0.0.0:8080`,
//! `BLOOMGATE_FILTER__FALSE_POSITIVE_RATE=0.001`). `DATABASE_URL`, when set,
//! overrides `database.url` (and `BLOOMGATE_DATABASE__URL` overrides both).
//! Unknown keys are errors, and every error names the key and its source.

use std::collections::HashSet;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use bytesize::ByteSize;
use figment::Figment;
use figment::providers::{Env, Format, Serialized, Toml};
use serde::{Deserialize, Serialize};

use crate::filter::Mode;
use crate::key::KeyType;

mod bus;
pub use bus::BusConfig;

/// The path used when `--config` is not given.
pub const DEFAULT_PATH: &str = "config/bloomgate.toml";

/// `server.max_headers` by default: hyper's `DEFAULT_MAX_HEADERS`, the size of
/// the header arrays it keeps inline. Left at it, hyper is not told a limit
/// at all and the 431 past 100 headers is its own.
pub const DEFAULT_MAX_HEADERS: usize = 100;

#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub server: ServerConfig,
    pub admin: AdminConfig,
    pub database: DatabaseConfig,
    pub log: LogConfig,
    /// Defaults for every resource's filter; each resource may override.
    pub filter: FilterConfig,
    /// Defaults for every resource's cache; each resource may override.
    pub cache: CacheConfig,
    /// Who may read what: token and key sources, shared by every resource
    /// whose `auth` is not `none` (see [`AuthConfig`]).
    pub auth: AuthConfig,
    /// The change stream a fleet shares (see [`BusConfig`]); unset, none.
    pub bus: BusConfig,
    /// The resources served, one `[[resource]]` table each.
    #[serde(rename = "resource")]
    pub resources: Vec<ResourceConfig>,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// Address the public API listens on. Default `127.0.0.1:8080`.
    pub listen: SocketAddr,
    /// Whole-request deadline; past it the client gets 504. Default `5s`.
    #[serde(with = "humantime_serde")]
    pub request_timeout: Duration,
    /// Longest key accepted, in bytes after percent-decoding. Default 256.
    pub max_key_length: usize,
    /// Requests handled at once; past it requests are shed with 503. Row
    /// loads in flight are bounded by the same number, counted separately:
    /// a load whose clients went away keeps its slot until its query
    /// returns. Default 1024.
    pub max_concurrency: usize,
    /// How long shutdown waits for in-flight requests. Default `10s`.
    #[serde(with = "humantime_serde")]
    pub shutdown_timeout: Duration,
    /// A new connection must have sent its first request (a complete
    /// HTTP/1 head or HTTP/2 HEADERS frame) within this time, whatever it
    /// sent before (nothing, half an HTTP/2 preface), and a later HTTP/1
    /// head must be complete this long after its first byte, or the
    /// connection is closed (silent sockets, slowloris). An HTTP/2 peer
    /// silent this long is PINGed and must answer within it. Default `10s`.
    #[serde(with = "humantime_serde")]
    pub header_read_timeout: Duration,
    /// Largest request head (request line and headers) accepted, in bytes;
    /// at least 8192. Larger: 431. Default 16384.
    pub max_header_bytes: usize,
    /// Most request headers accepted. More: 431. Default 100, hyper's own
    /// limit, which it parses into arrays on the stack; any other value
    /// makes hyper size and initialise them on every request (about 1,400
    /// instructions per request, BENCHMARKS.md).
    pub max_headers: usize,
    /// A request declaring a larger body gets 413; smaller bodies are
    /// ignored (every route is a GET). Default 65536.
    pub max_body_bytes: u64,
    /// A connection with no request in progress for this long is closed:
    /// an HTTP/1 keep-alive connection between requests, an HTTP/2
    /// connection with no stream being answered (after a GOAWAY). Default
    /// `75s`: longer than the 60 s idle timeout of the proxies usually in
    /// front (AWS ALB, nginx's upstream keep-alive), so the proxy, not the
    /// gateway, closes an idle connection and never sends a request on one
    /// the gateway is closing; short enough that departed clients' sockets
    /// are reclaimed within about a minute.
    #[serde(with = "humantime_serde")]
    pub idle_timeout: Duration,
    /// Open connections per listener (the public and the admin listener
    /// each have this many). At the cap the listener stops accepting: new
    /// connections wait in the kernel's listen backlog and are served as
    /// slots free up. Must fit the file-descriptor limit (checked at
    /// start-up). Default 10000.
    pub max_connections: usize,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            request_timeout: Duration::from_secs(5),
            max_key_length: 256,
            max_concurrency: 1024,
            shutdown_timeout: Duration::from_secs(10),
            header_read_timeout: Duration::from_secs(10),
            max_header_bytes: 16 * 1024,
            max_headers: DEFAULT_MAX_HEADERS,
            max_body_bytes: 64 * 1024,
            idle_timeout: Duration::from_secs(75),
            max_connections: 10_000,
        }
    }
}

/// The admin listener: metrics, the admin API and the status page. It runs
/// only when a token is configured, in `BLOOMGATE_ADMIN_TOKEN` or the file
/// `token_file` names (at least 16 characters; never logged).
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    /// Address of the admin listener; keep it private. Default
    /// `127.0.0.1:9090`.
    pub listen: SocketAddr,
    /// A file holding the bearer token (trailing whitespace ignored).
    /// Default: none; `BLOOMGATE_ADMIN_TOKEN` takes precedence.
    pub token_file: Option<PathBuf>,
    /// Whole-request deadline for admin requests (the admin listener does
    /// not use `server.request_timeout`); past it: 504. A rebuild is never
    /// cut off by it: it runs in the background (see `rebuild_wait`).
    /// Default `30s`.
    #[serde(with = "humantime_serde")]
    pub request_timeout: Duration,
    /// How long `POST /admin/resources/{name}/rebuild?wait=true` waits for
    /// the rebuild's outcome before answering 202 (the rebuild goes on).
    /// Not bounded by `request_timeout`. Default `10m`.
    #[serde(with = "humantime_serde")]
    pub rebuild_wait: Duration,
}

impl Default for AdminConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 9090)),
            token_file: None,
            request_timeout: Duration::from_secs(30),
            rebuild_wait: Duration::from_secs(600),
        }
    }
}

/// The minimum length of an admin token.
pub const MIN_TOKEN_LEN: usize = 16;

impl AdminConfig {
    /// The configured token: `BLOOMGATE_ADMIN_TOKEN`, else `token_file`,
    /// else none (the admin listener stays off).
    pub fn token(&self) -> Result<Option<String>, ConfigError> {
        let (token, from) = match std::env::var("BLOOMGATE_ADMIN_TOKEN") {
            Ok(t) => (t, "BLOOMGATE_ADMIN_TOKEN".to_string()),
            Err(_) => match &self.token_file {
                Some(path) => {
                    let t = std::fs::read_to_string(path).map_err(|e| ConfigError::Invalid {
                        file: "config".into(),
                        key: "admin.token_file".into(),
                        problem: format!("cannot read {}: {e}", path.display()),
                    })?;
                    (t.trim_end().to_string(), path.display().to_string())
                }
                None => return Ok(None),
            },
        };
        if token.len() < MIN_TOKEN_LEN {
            return Err(ConfigError::Invalid {
                file: from,
                key: "admin token".into(),
                problem: format!("must be at least {MIN_TOKEN_LEN} characters"),
            });
        }
        Ok(Some(token))
    }
}

#[derive(Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct DatabaseConfig {
    /// Postgres URL. Default `postgres://postgres@127.0.0.1:5432/bloomgate`;
    /// `DATABASE_URL` overrides it. TLS follows libpq's parameters, for
    /// every connection made to this server (the pool, the feeds, the WAL
    /// feed's replication connection): `sslmode=disable|prefer|require|
    /// verify-ca|verify-full` (default `prefer`; `PGSSLMODE` when unset) and
    /// `sslrootcert=/path/ca.pem` (`PGSSLROOTCERT`), the CA file, the only
    /// trusted roots as in libpq: `verify-ca` and `verify-full` need it, and
    /// `require` with it checks the chain. See `db::tls` and the README's
    /// "TLS to PostgreSQL". `replica_urls` take the same parameters.
    pub url: String,
    /// Connections in the pool: also the most database queries at once.
    /// Default 16.
    pub pool_size: u32,
    /// How long a request waits for a free connection before it is answered
    /// 503. Default `2s`.
    #[serde(with = "humantime_serde")]
    pub acquire_timeout: Duration,
    /// Server-side limit on one query (`statement_timeout`). Default `5s`;
    /// streaming keys for a rebuild is exempt.
    #[serde(with = "humantime_serde")]
    pub statement_timeout: Duration,
    /// Apply the embedded migrations at start-up. Default true.
    pub migrate: bool,
    /// Listen on channel `bloomgate` for key changes announced by the
    /// notification triggers: new keys are servable within milliseconds,
    /// changed rows are not served stale. Needs the primary: pointed at a
    /// hot standby, start-up fails (`LISTEN` cannot run during recovery).
    /// Default true.
    pub listen: bool,
    /// Create (or replace) the notification triggers at start-up: one
    /// function and two triggers per table (`source_table` for a view),
    /// announcing the key column of every resource on it (needs the
    /// privilege to create triggers on those tables). Default false:
    /// `bloomgate install-triggers` does it once; the shipped config sets it.
    pub install_triggers: bool,
    /// How changes committed in Postgres reach the gateway: `"wal"` (logical
    /// decoding of the write-ahead log through a replication slot: writers
    /// pay nothing, nobody can forge a change, a permanent `slot` resumes
    /// without a rebuild; needs `wal_level = logical`, the REPLICATION
    /// attribute and the publication), `"queue"` (the triggers write each
    /// change into the table `public.bloomgate_changes`, which gateways
    /// poll: for a server without logical decoding; no lock at commit, no
    /// forging without the installer's role, nothing lost while a gateway
    /// is away for less than half of `queue_retention`), `"notify"` (the triggers
    /// and `LISTEN`), `"off"`, or `"auto"`: `wal` when the server and role allow
    /// it and the publication covers every resource table (or
    /// `install_feed` may create it), else `notify`, with one log line
    /// saying which and why. Default `"auto"`. `listen = false` is `"off"`.
    pub freshness: Freshness,
    /// The publication the `wal` feed reads. Default `"bloomgate"`.
    pub publication: String,
    /// A permanent replication slot for the `wal` feed, resumed after a
    /// reconnect or restart without a rebuild (it holds WAL while the gateway
    /// is away: set `max_slot_wal_keep_size`; an invalidated slot is
    /// detected, recreated, and every filter rebuilt). Default: a temporary
    /// slot per connection, dropped by Postgres when the gateway goes.
    pub slot: Option<String>,
    /// At start-up with the `wal` feed: create or update the publication
    /// and remove bloomgate's notification triggers (what `bloomgate
    /// install-feed` does). Default false.
    pub install_feed: bool,
    /// How the `wal` feed reads the log. Unset (the default): streamed over
    /// a replication connection, each commit as soon as it is decoded
    /// (commit to servable about 0.5 ms at p50), at the price of waking the
    /// slot's walsender on every commit. Set (`"10ms"`): polled through
    /// `pg_logical_slot_peek_binary_changes` at this interval, the
    /// commits of each interval decoded in one go: cheaper for a primary
    /// without a spare core (no wake-up per commit: on a 2-core box shared
    /// with the writers they lost −2 to 23 % TPS polled every 5 ms, 16 to
    /// 24 % streamed; BENCHMARKS.md), about one interval slower. Between `1ms` and `1s`.
    #[serde(with = "humantime_serde::option")]
    pub wal_poll_interval: Option<Duration>,
    /// How often the `queue` feed polls the change table (one small
    /// indexed query per gateway). Between `1ms` and `1s`. Default `5ms`.
    #[serde(with = "humantime_serde")]
    pub queue_poll_interval: Duration,
    /// How long the `queue` feed's changes stay in the table: the gateways
    /// delete older ones, and a gateway that could not poll for half of it
    /// (or finds rows it had not read deleted, by a gateway with a shorter
    /// retention) rescans every table instead of resuming. At least `10s`.
    /// Default `10m`.
    #[serde(with = "humantime_serde")]
    pub queue_retention: Duration,
    /// Streaming read replicas of the primary (`url`): row loads and key
    /// scans go to one that has replayed far enough (read-your-writes by
    /// LSN; see `db::replicas`), the change feed stays on the primary.
    /// `BLOOMGATE_DATABASE__REPLICA_URLS='["postgres://…", "postgres://…"]'`.
    /// A plain comma-separated list is taken too (`postgres://a/db,postgres://b/db`).
    /// Default none.
    #[serde(deserialize_with = "url_list")]
    pub replica_urls: Vec<String>,
    /// A replica further behind the primary than this is not used, and a
    /// rebuild waits at most this long for one to catch up before it scans
    /// the primary. Default `1s`.
    #[serde(with = "humantime_serde")]
    pub max_replica_lag: Duration,
    /// How often each replica's health and replay position are read.
    /// Default `250ms`.
    #[serde(with = "humantime_serde")]
    pub replica_check_interval: Duration,
    /// The longest the gateway answers from its filters and caches without
    /// the change feed proving it is current (a heartbeat every 100 ms, see
    /// `feed`). Past it (a hung connection, a cut network, a feed far
    /// behind) keys are looked up in the database instead: a row committed
    /// longer ago than this is never answered 404 or old. At least `500ms`
    /// and four poll intervals. Default `2s`.
    #[serde(with = "humantime_serde")]
    pub freshness_bound: Duration,
}

/// A list of URLs, or one text of comma-separated URLs: what an
/// environment variable holding plain text gives (`postgres://h/db` alone is
/// not a TOML array).
fn url_list<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        Many(Vec<String>),
        One(String),
    }
    Ok(match OneOrMany::deserialize(d)? {
        OneOrMany::Many(v) => v,
        OneOrMany::One(s) => s
            .split(',')
            .map(str::trim)
            .filter(|u| !u.is_empty())
            .map(String::from)
            .collect(),
    })
}

impl Default for DatabaseConfig {
    fn default() -> Self {
        Self {
            url: "postgres://postgres@127.0.0.1:5432/bloomgate".into(),
            pool_size: 16,
            acquire_timeout: Duration::from_secs(2),
            statement_timeout: Duration::from_secs(5),
            migrate: true,
            listen: true,
            install_triggers: false,
            freshness: Freshness::Auto,
            publication: "bloomgate".into(),
            slot: None,
            install_feed: false,
            wal_poll_interval: None,
            queue_poll_interval: Duration::from_millis(5),
            queue_retention: Duration::from_secs(600),
            replica_urls: Vec::new(),
            max_replica_lag: Duration::from_secs(1),
            replica_check_interval: Duration::from_millis(250),
            freshness_bound: Duration::from_secs(2),
        }
    }
}

impl fmt::Debug for DatabaseConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DatabaseConfig")
            .field("url", &redact_url(&self.url))
            .field("pool_size", &self.pool_size)
            .field("acquire_timeout", &self.acquire_timeout)
            .field("statement_timeout", &self.statement_timeout)
            .field("migrate", &self.migrate)
            .field("listen", &self.listen)
            .field("install_triggers", &self.install_triggers)
            .field("freshness", &self.freshness)
            .field("publication", &self.publication)
            .field("slot", &self.slot)
            .field("install_feed", &self.install_feed)
            .field("wal_poll_interval", &self.wal_poll_interval)
            .field("queue_poll_interval", &self.queue_poll_interval)
            .field("queue_retention", &self.queue_retention)
            .field(
                "replica_urls",
                &self
                    .replica_urls
                    .iter()
                    .map(|u| redact_url(u))
                    .collect::<Vec<_>>(),
            )
            .field("max_replica_lag", &self.max_replica_lag)
            .field("replica_check_interval", &self.replica_check_interval)
            .field("freshness_bound", &self.freshness_bound)
            .finish()
    }
}

/// `database.freshness`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Freshness {
    Auto,
    Wal,
    Queue,
    Notify,
    Off,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Human,
    Json,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    /// `human` or `json`. Default `human`.
    pub format: LogFormat,
    /// A `tracing` filter such as `info` or `info,bloomgate::http::front=debug`
    /// (a span and a line per request);
    /// `RUST_LOG` overrides it. Default `info`.
    pub level: String,
}

impl Default for LogConfig {
    fn default() -> Self {
        Self {
            format: LogFormat::Human,
            level: "info".into(),
        }
    }
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct FilterConfig {
    /// Off means every request goes to the cache and database (for
    /// measuring what the filter saves). Default true.
    pub enabled: bool,
    /// `bloom`, `exact` (bigint keys only) or `auto` (the smaller of the two
    /// for the actual keys). Default `auto`.
    pub mode: Mode,
    /// Target false-positive rate of the Bloom filter, in (0, 1).
    /// Default 0.01.
    pub false_positive_rate: f64,
    /// The filter is sized for `rows × headroom` keys so inserts between
    /// rebuilds do not push the false-positive rate over target. Default 1.5.
    pub headroom: f64,
    /// Time between scheduled rebuilds, jittered ±10 %; `0s` disables them.
    /// Default `10m`.
    #[serde(with = "humantime_serde")]
    pub rebuild_interval: Duration,
    /// A rebuild that finds fewer than `(1 - max_shrink) × ` the current key
    /// count is refused as suspicious (truncated table, wrong database)
    /// unless forced. Default 0.5.
    pub max_shrink: f64,
    /// For `bigint` keys: a key above the highest one the filter holds (a
    /// row committed a moment ago, its notification still on the way) is
    /// checked against the database instead of rejected, at most
    /// `verify_budget` times a second; past that budget it is rejected as
    /// usual. Default false.
    pub verify_above_high_water: bool,
    /// Database checks per second allowed by `verify_above_high_water`
    /// (also spent on confirming announced keys above the mark before they
    /// may raise it). Default 100.
    pub verify_budget: u32,
    /// Rebuild as soon as the estimated false-positive rate of the live
    /// Bloom filter (the sizing model at its key count) exceeds this
    /// multiple of `false_positive_rate`; `0` disables. At least 1.
    /// Default 2.
    pub rebuild_fp_multiple: f64,
    /// Rebuild as soon as the deletes applied since the last build exceed
    /// this fraction of the keys it found (deleted keys stay in the filter
    /// and pass it); `0` disables. Must be below `max_shrink`, or that
    /// rebuild would be refused. Default 0.25.
    pub rebuild_delete_fraction: f64,
    /// Rebuild as soon as live inserts since the last build exceed this
    /// multiple of the keys it found (at least 1024 inserts): bounds the
    /// growth of an exact set that forged notifications could otherwise
    /// grow until the next scheduled rebuild; `0` disables. Default 1.
    pub rebuild_insert_fraction: f64,
}

impl Default for FilterConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            mode: Mode::Auto,
            false_positive_rate: 0.01,
            headroom: 1.5,
            rebuild_interval: Duration::from_secs(600),
            max_shrink: 0.5,
            verify_above_high_water: false,
            verify_budget: 100,
            rebuild_fp_multiple: 2.0,
            rebuild_delete_fraction: 0.25,
            rebuild_insert_fraction: 1.0,
        }
    }
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct CacheConfig {
    /// Off means every request that passes the filter is a query. Default
    /// true.
    pub enabled: bool,
    /// Rows cached at most. Default 100000. Not used when `max_bytes` is
    /// set.
    pub max_entries: u64,
    /// Memory for cached rows, as `"256 MiB"`, `"1 GB"` or a number of
    /// bytes. Each row counts its JSON body and compressed forms, their ETags
    /// and lengths, and its key, plus a
    /// fixed per-entry overhead ([`crate::cache::ENTRY_OVERHEAD`]), so the
    /// cache's memory is bounded however wide the rows are. When set, it
    /// bounds the cache instead of `max_entries`. Default: unset.
    #[serde(
        skip_serializing_if = "Option::is_none",
        serialize_with = "exact_bytes"
    )]
    pub max_bytes: Option<ByteSize>,
    /// How long a row is served from cache. Default `60s`.
    #[serde(with = "humantime_serde")]
    pub ttl: Duration,
    /// How long "no such row" is remembered. Default `5s`.
    #[serde(with = "humantime_serde")]
    pub negative_ttl: Duration,
    /// Negative entries kept at most, separate from rows so a flood of
    /// absent keys cannot evict real rows. Default 100000.
    pub negative_max_entries: u64,
    /// `Cache-Control` of a row (200, and the 304 that revalidates it), for
    /// the browsers, CDNs and shared caches in front of the gateway. Default
    /// `"max-age=0, stale-if-error=300"`: a downstream cache may store the
    /// row but it is stale at once, so it is revalidated on every use (a
    /// cheap 304 thanks to the ETag) and never served after the gateway
    /// invalidated it; while the gateway is unreachable it may serve what it
    /// has for 5 minutes (RFC 5861). Not `no-cache`: that forbids any use
    /// without revalidation and so overrides `stale-if-error`.
    /// `"max-age=N, stale-while-revalidate=M"` trades N seconds of possible
    /// staleness for fewer requests. Directives are checked at start-up.
    pub http_cache_control: String,
    /// `Cache-Control` of a 404 for an absent key (from the filter or a
    /// negative entry). Default `"no-cache"`: a downstream cache that keeps
    /// a 404 for N seconds answers 404 for a row inserted meanwhile. A
    /// `max-age` (or `s-maxage`) may not exceed `negative_ttl`.
    pub http_cache_control_not_found: String,
    /// Store each cached row gzip-, br- and zstd-compressed too (made once,
    /// when it enters the cache) and send the coding the client prefers
    /// (`Accept-Encoding`). Default true.
    pub compression: bool,
    /// Rows shorter than this are sent as they are: compressing them saves
    /// less than it costs. Default `"1 KiB"` (1024 bytes).
    #[serde(serialize_with = "exact_bytes_always")]
    pub compress_min_bytes: ByteSize,
}

impl Default for CacheConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            max_entries: 100_000,
            max_bytes: None,
            ttl: Duration::from_secs(60),
            negative_ttl: Duration::from_secs(5),
            negative_max_entries: 100_000,
            http_cache_control: "max-age=0, stale-if-error=300".into(),
            http_cache_control_not_found: "no-cache".into(),
            compression: true,
            compress_min_bytes: ByteSize::b(1024),
        }
    }
}

/// One `[[resource]]`: a table served by key.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ResourceConfig {
    /// Unique name, used in logs, metrics and the admin API.
    pub name: String,
    /// Route with one `{param}` for the key, e.g. `/users/{id}`.
    pub route: String,
    /// Table or view, optionally schema-qualified (`public.users`).
    pub table: String,
    /// The table whose changes this resource follows, when `table` is a view
    /// (triggers and logical replication see tables only): its key column
    /// must have the same name and values there. Default: `table` itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_table: Option<String>,
    /// Column holding the key; should be unique (a primary key).
    pub key_column: String,
    /// `bigint`, `uuid` or `text`.
    pub key_type: KeyType,
    /// Columns returned as the JSON object, in order.
    pub columns: Vec<String>,
    /// Per-resource overrides of `[filter]`.
    #[serde(default)]
    pub filter: FilterOverrides,
    /// Per-resource overrides of `[cache]`.
    #[serde(default)]
    pub cache: CacheOverrides,
    /// Who may read this resource: `none` (anyone, the default), `jwt` (a
    /// bearer JWT), `api_key` (an `X-API-Key` from `auth.api_keys_file`)
    /// or `any` (either).
    #[serde(default, skip_serializing_if = "AuthMode::is_none")]
    pub auth: AuthMode,
    /// Scopes the caller must hold, all of them (a JWT's `auth.scope_claim`,
    /// an API key's `scopes`). Default none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub scopes: Vec<String>,
    /// A JWT claim (`sub`, say) naming the only row the caller may read:
    /// the one whose key, or `owner_column`, equals the claim's value.
    /// Another owner's row is answered 404, exactly as an absent key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner_claim: Option<String>,
    /// The column `owner_claim` is compared with, read from the cached row
    /// (so it must be one of `columns`). Default: the key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner_column: Option<String>,
    /// Requests per caller (`"20/s"`, `"600/m"`, `"10000/h"`): the token's
    /// `sub` or the API key's name, else the client address (an IPv6
    /// address by its /64). Past it: 429. Default: no limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_limit: Option<String>,
    /// Requests a caller may send at once above the rate, after a pause.
    /// Default: one second's worth of `rate_limit` (at least 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_limit_burst: Option<u32>,
}

/// `[[resource]] auth`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AuthMode {
    #[default]
    None,
    Jwt,
    ApiKey,
    Any,
}

impl AuthMode {
    pub fn is_none(&self) -> bool {
        *self == AuthMode::None
    }

    pub fn as_str(self) -> &'static str {
        match self {
            AuthMode::None => "none",
            AuthMode::Jwt => "jwt",
            AuthMode::ApiKey => "api_key",
            AuthMode::Any => "any",
        }
    }

    /// Takes a bearer JWT.
    pub fn takes_jwt(self) -> bool {
        matches!(self, AuthMode::Jwt | AuthMode::Any)
    }

    /// Takes an `X-API-Key`.
    pub fn takes_api_key(self) -> bool {
        matches!(self, AuthMode::ApiKey | AuthMode::Any)
    }
}

/// `rate_limit` and its burst, parsed.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct RateLimit {
    pub per_second: f64,
    pub burst: u32,
}

/// A resource's access rules, checked (see `auth`).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Access {
    pub mode: AuthMode,
    pub scopes: Vec<String>,
    pub owner_claim: Option<String>,
    /// `None` with an `owner_claim`: the key is compared.
    pub owner_column: Option<String>,
    pub rate_limit: Option<RateLimit>,
}

/// `"N/s"`, `"N/m"` (`/min`) or `"N/h"`, N a positive number: requests per
/// second.
pub fn parse_rate(text: &str) -> Result<f64, String> {
    let bad = || format!("{text:?} is not a rate such as \"20/s\", \"600/m\" or \"10000/h\"");
    let (n, unit) = text.split_once('/').ok_or_else(bad)?;
    let n: f64 = n.trim().parse().map_err(|_| bad())?;
    let seconds = match unit.trim() {
        "s" | "sec" | "second" => 1.0,
        "m" | "min" | "minute" => 60.0,
        "h" | "hour" => 3600.0,
        _ => return Err(bad()),
    };
    let per_second = n / seconds;
    if !(n.is_finite() && n > 0.0 && (1e-4..=1e9).contains(&per_second)) {
        return Err(format!(
            "{text:?}: the rate must be above 0 and between one request in about 3 hours and 1e9 a second"
        ));
    }
    Ok(per_second)
}

/// `[auth]`: where tokens and keys are checked from. Nothing here applies
/// to a resource whose `auth` is `none` (the default).
#[derive(Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuthConfig {
    /// The HS256/384/512 secret, at least 32 bytes; never logged, redacted
    /// in `check-config`. `BLOOMGATE_AUTH__JWT_SECRET` sets it from the
    /// environment. Default none.
    pub jwt_secret: Option<String>,
    /// A JWK Set (RFC 7517) of RS*, PS*, ES256, ES384 or EdDSA (Ed25519)
    /// public keys, read at start-up. Default none.
    pub jwks_file: Option<PathBuf>,
    /// A JWK Set fetched at start-up, every `jwks_refresh_interval`, and
    /// when a token names a `kid` it lacks (at most once per
    /// `jwks_min_refetch_interval`, so no caller can make the gateway fetch
    /// at will). `https://`, or `http://` to a loopback address. Default
    /// none.
    pub jwks_url: Option<String>,
    /// Default `5m`.
    #[serde(with = "humantime_serde")]
    pub jwks_refresh_interval: Duration,
    /// Default `30s`.
    #[serde(with = "humantime_serde")]
    pub jwks_min_refetch_interval: Duration,
    /// When set, a token's `iss` must equal it. Default none.
    pub issuer: Option<String>,
    /// When set, a token's `aud` (a string or an array) must hold it; when
    /// not, a token that has an `aud` is refused (RFC 7519 §4.1.3: it is
    /// meant for someone else). Default none.
    pub audience: Option<String>,
    /// Clock skew allowed on `exp` and `nbf`. At most `5m`. Default `30s`.
    #[serde(with = "humantime_serde")]
    pub leeway: Duration,
    /// The claim holding a token's scopes: a space-separated string
    /// (`scope`, RFC 8693) or an array of strings (`scp`, `roles`).
    /// Default `scope`.
    pub scope_claim: String,
    /// A TOML file of named API keys (`[[key]]` with `name`, `key` or
    /// `sha256`, `scopes`), read at start-up. Default none.
    pub api_keys_file: Option<PathBuf>,
    /// Longest token or key looked at; longer ones are refused (401)
    /// before any decoding. Between 512 and 65536. Default 8192.
    pub max_token_bytes: usize,
    /// Verified tokens and keys remembered (until their `exp`), so a hit
    /// does not verify a signature: at most this many, about 200 bytes
    /// each plus the owner claims. Default 65536.
    pub token_cache_entries: usize,
    /// Callers whose rate-limit state is kept, across resources: a fixed
    /// table of this many 16-byte slots; an idle caller's slot is reused
    /// first. Default 65536.
    pub rate_limit_callers: usize,
    /// What the files above held, checked and parsed at load.
    #[serde(skip)]
    pub loaded: crate::auth::Loaded,
}

impl Default for AuthConfig {
    fn default() -> Self {
        Self {
            jwt_secret: None,
            jwks_file: None,
            jwks_url: None,
            jwks_refresh_interval: Duration::from_secs(300),
            jwks_min_refetch_interval: Duration::from_secs(30),
            issuer: None,
            audience: None,
            leeway: Duration::from_secs(30),
            scope_claim: "scope".into(),
            api_keys_file: None,
            max_token_bytes: 8192,
            token_cache_entries: 65536,
            rate_limit_callers: 65536,
            loaded: crate::auth::Loaded::default(),
        }
    }
}

impl fmt::Debug for AuthConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AuthConfig")
            .field("jwt_secret", &self.jwt_secret.as_ref().map(|_| REDACTED))
            .field("jwks_file", &self.jwks_file)
            .field("jwks_url", &self.jwks_url)
            .field("jwks_refresh_interval", &self.jwks_refresh_interval)
            .field("jwks_min_refetch_interval", &self.jwks_min_refetch_interval)
            .field("issuer", &self.issuer)
            .field("audience", &self.audience)
            .field("leeway", &self.leeway)
            .field("scope_claim", &self.scope_claim)
            .field("api_keys_file", &self.api_keys_file)
            .field("max_token_bytes", &self.max_token_bytes)
            .field("token_cache_entries", &self.token_cache_entries)
            .field("rate_limit_callers", &self.rate_limit_callers)
            .finish_non_exhaustive()
    }
}

/// What a secret is shown as.
pub const REDACTED: &str = "<redacted>";

/// `auth.jwt_secret` in `check-config`: long enough to be accepted, so the
/// printed config still loads (`fuzz/config_parse` checks it does), and
/// plainly not the secret.
pub const REDACTED_SECRET: &str = "<redacted: the secret is never shown>";

/// The shortest `auth.jwt_secret`: 256 bits, the size of HS256's output
/// (RFC 7518 §3.2).
pub const MIN_JWT_SECRET: usize = 32;

/// Any field left out keeps the global `[filter]` value.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct FilterOverrides {
    pub enabled: Option<bool>,
    pub mode: Option<Mode>,
    pub false_positive_rate: Option<f64>,
    pub headroom: Option<f64>,
    #[serde(default, with = "humantime_serde")]
    pub rebuild_interval: Option<Duration>,
    pub max_shrink: Option<f64>,
    pub verify_above_high_water: Option<bool>,
    pub verify_budget: Option<u32>,
    pub rebuild_fp_multiple: Option<f64>,
    pub rebuild_delete_fraction: Option<f64>,
    pub rebuild_insert_fraction: Option<f64>,
}

/// A byte count as a plain integer: `ByteSize`'s own form rounds
/// ("976.6 KiB"), and `check-config` should print what will be used.
fn exact_bytes<S: serde::Serializer>(b: &Option<ByteSize>, s: S) -> Result<S::Ok, S::Error> {
    match b {
        Some(b) => s.serialize_u64(b.as_u64()),
        None => s.serialize_none(),
    }
}

fn exact_bytes_always<S: serde::Serializer>(b: &ByteSize, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u64(b.as_u64())
}

/// Any field left out keeps the global `[cache]` value.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct CacheOverrides {
    pub enabled: Option<bool>,
    pub max_entries: Option<u64>,
    pub max_bytes: Option<ByteSize>,
    #[serde(default, with = "humantime_serde")]
    pub ttl: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub negative_ttl: Option<Duration>,
    pub negative_max_entries: Option<u64>,
    pub http_cache_control: Option<String>,
    pub http_cache_control_not_found: Option<String>,
    pub compression: Option<bool>,
    pub compress_min_bytes: Option<ByteSize>,
}

impl ResourceConfig {
    /// The access rules; `rate_limit` unparsable reads as none here (the
    /// config was validated before anything calls this).
    fn access(&self) -> Access {
        let owner_column = self
            .owner_column
            .clone()
            .filter(|c| *c != self.key_column && self.owner_claim.is_some());
        Access {
            mode: self.auth,
            scopes: self.scopes.clone(),
            owner_claim: self.owner_claim.clone(),
            owner_column,
            rate_limit: self
                .rate_limit
                .as_deref()
                .and_then(|r| parse_rate(r).ok())
                .map(|per_second| RateLimit {
                    per_second,
                    burst: self
                        .rate_limit_burst
                        .unwrap_or((per_second.ceil() as u32).max(1)),
                }),
        }
    }
}

impl FilterOverrides {
    fn apply(&self, base: &FilterConfig) -> FilterConfig {
        FilterConfig {
            enabled: self.enabled.unwrap_or(base.enabled),
            mode: self.mode.unwrap_or(base.mode),
            false_positive_rate: self.false_positive_rate.unwrap_or(base.false_positive_rate),
            headroom: self.headroom.unwrap_or(base.headroom),
            rebuild_interval: self.rebuild_interval.unwrap_or(base.rebuild_interval),
            max_shrink: self.max_shrink.unwrap_or(base.max_shrink),
            verify_above_high_water: self
                .verify_above_high_water
                .unwrap_or(base.verify_above_high_water),
            verify_budget: self.verify_budget.unwrap_or(base.verify_budget),
            rebuild_fp_multiple: self.rebuild_fp_multiple.unwrap_or(base.rebuild_fp_multiple),
            rebuild_delete_fraction: self
                .rebuild_delete_fraction
                .unwrap_or(base.rebuild_delete_fraction),
            rebuild_insert_fraction: self
                .rebuild_insert_fraction
                .unwrap_or(base.rebuild_insert_fraction),
        }
    }
}

impl CacheOverrides {
    fn apply(&self, base: &CacheConfig) -> CacheConfig {
        CacheConfig {
            enabled: self.enabled.unwrap_or(base.enabled),
            max_entries: self.max_entries.unwrap_or(base.max_entries),
            // A resource that sets only `max_entries` is bounded by entries,
            // whatever byte budget `[cache]` has.
            max_bytes: match (self.max_bytes, self.max_entries) {
                (Some(b), _) => Some(b),
                (None, Some(_)) => None,
                (None, None) => base.max_bytes,
            },
            ttl: self.ttl.unwrap_or(base.ttl),
            negative_ttl: self.negative_ttl.unwrap_or(base.negative_ttl),
            negative_max_entries: self
                .negative_max_entries
                .unwrap_or(base.negative_max_entries),
            http_cache_control: self
                .http_cache_control
                .clone()
                .unwrap_or_else(|| base.http_cache_control.clone()),
            http_cache_control_not_found: self
                .http_cache_control_not_found
                .clone()
                .unwrap_or_else(|| base.http_cache_control_not_found.clone()),
            compression: self.compression.unwrap_or(base.compression),
            compress_min_bytes: self.compress_min_bytes.unwrap_or(base.compress_min_bytes),
        }
    }
}

/// A resource with its overrides applied: what the gateway runs.
#[derive(Clone, Debug, Serialize)]
pub struct Resolved {
    pub name: String,
    pub route: String,
    pub table: String,
    /// `source_table`, or `table` when not set.
    pub source_table: String,
    pub key_column: String,
    pub key_type: KeyType,
    pub columns: Vec<String>,
    pub filter: FilterConfig,
    pub cache: CacheConfig,
    pub access: Access,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config file {0} not found")]
    NotFound(PathBuf),
    /// Parse and type errors; figment's message names the key and source.
    #[error("{0}")]
    Load(Box<figment::Error>),
    #[error("{file}: `{key}`: {problem}")]
    Invalid {
        file: String,
        key: String,
        problem: String,
    },
}

impl Config {
    /// Reads the file at `path` and the environment.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        if !path.is_file() {
            return Err(ConfigError::NotFound(path.to_path_buf()));
        }
        let source = path.display().to_string();
        Self::from_figment(Figment::from(Toml::file_exact(path)), &source, true)
    }

    /// Parses TOML text alone, without the environment (tests, tools).
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        Self::from_figment(Figment::from(Toml::string(text)), "config", false)
    }

    fn from_figment(file: Figment, source: &str, env: bool) -> Result<Self, ConfigError> {
        let mut fig = Figment::from(Serialized::defaults(Config::default())).merge(file);
        if !env {
            // Skip the environment entirely.
        } else if let Ok(url) = std::env::var("DATABASE_URL") {
            fig = fig.merge(Serialized::default("database.url", url));
        }
        if env {
            check_env_typos()?;
            // Every key settable from the environment is `SECTION__KEY`.
            // A variable without `__` is not a config path (the admin token,
            // the scripts' own BLOOMGATE_PG_PORT, ...), so it is left alone.
            fig = fig.merge(
                Env::prefixed("BLOOMGATE_")
                    .filter(|k| k.as_str().contains("__"))
                    .split("__"),
            );
        }
        let mut config: Config = fig.extract().map_err(|e| ConfigError::Load(Box::new(e)))?;
        config.validate(source)?;
        config.auth.loaded =
            crate::auth::load(&config.auth).map_err(|(key, problem)| ConfigError::Invalid {
                file: source.to_string(),
                key,
                problem,
            })?;
        Ok(config)
    }

    /// Every resource with overrides applied.
    pub fn resolved(&self) -> Vec<Resolved> {
        self.resources
            .iter()
            .map(|r| Resolved {
                name: r.name.clone(),
                route: r.route.clone(),
                table: r.table.clone(),
                source_table: r.source_table.clone().unwrap_or_else(|| r.table.clone()),
                key_column: r.key_column.clone(),
                key_type: r.key_type,
                columns: r.columns.clone(),
                filter: r.filter.apply(&self.filter),
                cache: r.cache.apply(&self.cache),
                access: r.access(),
            })
            .collect()
    }

    /// The effective config as TOML with secrets redacted.
    pub fn to_redacted_toml(&self) -> String {
        let mut c = self.clone();
        c.database.url = redact_url(&c.database.url);
        c.bus.url = c.bus.redacted_url();
        for u in &mut c.database.replica_urls {
            *u = redact_url(u);
        }
        if c.auth.jwt_secret.is_some() {
            c.auth.jwt_secret = Some(REDACTED_SECRET.into());
        }
        toml::to_string_pretty(&c).unwrap_or_else(|e| format!("# cannot render config: {e}\n"))
    }

    fn validate(&self, source: &str) -> Result<(), ConfigError> {
        let bad = |key: String, problem: String| ConfigError::Invalid {
            file: source.to_string(),
            key,
            problem,
        };
        let s = &self.server;
        if s.max_key_length == 0 {
            return Err(bad(
                "server.max_key_length".into(),
                "must be at least 1".into(),
            ));
        }
        if s.max_concurrency == 0 {
            return Err(bad(
                "server.max_concurrency".into(),
                "must be at least 1".into(),
            ));
        }
        if s.max_header_bytes < 8192 {
            return Err(bad(
                "server.max_header_bytes".into(),
                "must be at least 8192".into(),
            ));
        }
        if s.max_headers == 0 {
            return Err(bad(
                "server.max_headers".into(),
                "must be at least 1".into(),
            ));
        }
        if s.header_read_timeout.is_zero() {
            return Err(bad(
                "server.header_read_timeout".into(),
                "must be above 0".into(),
            ));
        }
        if s.idle_timeout.is_zero() {
            return Err(bad("server.idle_timeout".into(), "must be above 0".into()));
        }
        if s.max_connections == 0 || u32::try_from(s.max_connections).is_err() {
            return Err(bad(
                "server.max_connections".into(),
                format!("must be between 1 and {}", u32::MAX),
            ));
        }
        if self.admin.request_timeout.is_zero() {
            return Err(bad(
                "admin.request_timeout".into(),
                "must be above 0".into(),
            ));
        }
        if self.admin.rebuild_wait.is_zero() {
            return Err(bad("admin.rebuild_wait".into(), "must be above 0".into()));
        }
        if self.admin.listen == s.listen {
            return Err(bad(
                "admin.listen".into(),
                "must differ from server.listen: the admin API is never on the public address"
                    .into(),
            ));
        }
        if s.request_timeout.is_zero() {
            return Err(bad(
                "server.request_timeout".into(),
                "must be above 0".into(),
            ));
        }
        if self.database.pool_size == 0 {
            return Err(bad(
                "database.pool_size".into(),
                "must be at least 1".into(),
            ));
        }
        if self.database.acquire_timeout.is_zero() {
            return Err(bad(
                "database.acquire_timeout".into(),
                "must be above 0".into(),
            ));
        }
        if let Some(i) = self.database.wal_poll_interval
            && !(Duration::from_millis(1)..=Duration::from_secs(1)).contains(&i)
        {
            return Err(bad(
                "database.wal_poll_interval".into(),
                "must be between 1ms and 1s (leave it unset to stream)".into(),
            ));
        }
        if !(Duration::from_millis(1)..=Duration::from_secs(1))
            .contains(&self.database.queue_poll_interval)
        {
            return Err(bad(
                "database.queue_poll_interval".into(),
                "must be between 1ms and 1s".into(),
            ));
        }
        let polls = [
            Some(self.database.queue_poll_interval),
            self.database.wal_poll_interval,
        ];
        let floor = polls
            .into_iter()
            .flatten()
            .map(|p| p * 4)
            .fold(Duration::from_millis(500), Duration::max);
        if self.database.freshness_bound < floor {
            return Err(bad(
                "database.freshness_bound".into(),
                format!(
                    "must be at least {} (500ms, and four poll intervals)",
                    humantime::format_duration(floor)
                ),
            ));
        }
        if self.database.queue_retention < Duration::from_secs(10) {
            return Err(bad(
                "database.queue_retention".into(),
                "must be at least 10s".into(),
            ));
        }
        if !self.database.url.starts_with("postgres://")
            && !self.database.url.starts_with("postgresql://")
        {
            return Err(bad(
                "database.url".into(),
                "must be a postgres:// or postgresql:// URL".into(),
            ));
        }
        for (i, u) in self.database.replica_urls.iter().enumerate() {
            if !u.starts_with("postgres://") && !u.starts_with("postgresql://") {
                return Err(bad(
                    format!("database.replica_urls[{i}]"),
                    "must be a postgres:// or postgresql:// URL".into(),
                ));
            }
        }
        if !self.database.replica_urls.is_empty() && self.database.replica_check_interval.is_zero()
        {
            return Err(bad(
                "database.replica_check_interval".into(),
                "must be above 0".into(),
            ));
        }
        validate_filter(&self.filter, "filter").map_err(|(k, p)| bad(k, p))?;
        validate_cache(&self.cache, "cache").map_err(|(k, p)| bad(k, p))?;
        validate_auth(&self.auth).map_err(|(k, p)| bad(k, p))?;
        bus::validate(&self.bus, self.database.slot.as_deref()).map_err(|(k, p)| bad(k, p))?;
        if self.resources.is_empty() {
            return Err(bad(
                "resource".into(),
                "at least one [[resource]] is required".into(),
            ));
        }
        let mut names = HashSet::new();
        let mut routes = HashSet::new();
        for (i, (r, res)) in self.resources.iter().zip(self.resolved()).enumerate() {
            let at = |field: &str| format!("resource[{i}].{field}");
            if !is_name(&r.name) {
                return Err(bad(
                    at("name"),
                    format!("{:?} must be 1-63 letters, digits, '_' or '-'", r.name),
                ));
            }
            if !names.insert(&r.name) {
                return Err(bad(at("name"), format!("{:?} is used twice", r.name)));
            }
            check_route(&r.route).map_err(|p| bad(at("route"), p))?;
            let shape = route_shape(&r.route);
            if !routes.insert(shape) {
                return Err(bad(
                    at("route"),
                    format!("{:?} clashes with another resource", r.route),
                ));
            }
            if !r.table.split('.').all(is_identifier) || r.table.split('.').count() > 2 {
                return Err(bad(
                    at("table"),
                    format!(
                        "{:?} is not a valid SQL identifier (letters, digits, '_', optionally schema.table)",
                        r.table
                    ),
                ));
            }
            if let Some(t) = &r.source_table
                && (!t.split('.').all(is_identifier) || t.split('.').count() > 2)
            {
                return Err(bad(
                    at("source_table"),
                    format!("{t:?} is not a valid SQL identifier (optionally schema.table)"),
                ));
            }
            if !is_identifier(&r.key_column) {
                return Err(bad(
                    at("key_column"),
                    format!("{:?} is not a valid SQL identifier", r.key_column),
                ));
            }
            if r.columns.is_empty() {
                return Err(bad(at("columns"), "must name at least one column".into()));
            }
            for c in &r.columns {
                if !is_identifier(c) {
                    return Err(bad(
                        at("columns"),
                        format!("{c:?} is not a valid SQL identifier"),
                    ));
                }
            }
            validate_filter(&res.filter, &at("filter")).map_err(|(k, p)| bad(k, p))?;
            validate_cache(&res.cache, &at("cache")).map_err(|(k, p)| bad(k, p))?;
            validate_access(r, &self.auth, i).map_err(|(k, p)| bad(k, p))?;
            if r.auth != AuthMode::None {
                for (field, value) in [
                    ("http_cache_control", &res.cache.http_cache_control),
                    (
                        "http_cache_control_not_found",
                        &res.cache.http_cache_control_not_found,
                    ),
                ] {
                    if value
                        .split(',')
                        .any(|d| d.trim().eq_ignore_ascii_case("public"))
                    {
                        return Err(bad(
                            at(&format!("cache.{field}")),
                            "\"public\" would let a shared cache keep one caller's answer for \
                             others; a resource with auth is sent private"
                                .into(),
                        ));
                    }
                }
            }
            if res.filter.mode == Mode::Exact && r.key_type != KeyType::Bigint {
                return Err(bad(
                    at("filter.mode"),
                    "`exact` needs key_type = \"bigint\"; use `bloom` or `auto`".into(),
                ));
            }
        }
        let scopes: HashSet<&String> = self.resources.iter().flat_map(|r| &r.scopes).collect();
        if scopes.len() > crate::auth::MAX_SCOPES {
            return Err(bad(
                "resource[].scopes".into(),
                format!(
                    "{} distinct scopes; at most {} are supported",
                    scopes.len(),
                    crate::auth::MAX_SCOPES
                ),
            ));
        }
        let claims: HashSet<&String> = self
            .resources
            .iter()
            .filter_map(|r| r.owner_claim.as_ref())
            .collect();
        if claims.len() > crate::auth::MAX_OWNER_CLAIMS {
            return Err(bad(
                "resource[].owner_claim".into(),
                format!(
                    "{} distinct owner claims; at most {} are supported",
                    claims.len(),
                    crate::auth::MAX_OWNER_CLAIMS
                ),
            ));
        }
        Ok(())
    }
}

fn validate_auth(a: &AuthConfig) -> Result<(), (String, String)> {
    let bad = |key: &str, problem: String| Err((format!("auth.{key}"), problem));
    if let Some(s) = &a.jwt_secret
        && s.len() < MIN_JWT_SECRET
    {
        return bad(
            "jwt_secret",
            format!(
                "must be at least {MIN_JWT_SECRET} bytes (HS256 needs 256 bits); it has {}",
                s.len()
            ),
        );
    }
    if let Some(u) = &a.jwks_url {
        crate::auth::jwks::check_url(u).map_err(|p| ("auth.jwks_url".to_string(), p))?;
    }
    if !(Duration::from_secs(1)..=Duration::from_secs(86_400)).contains(&a.jwks_refresh_interval) {
        return bad("jwks_refresh_interval", "must be between 1s and 1d".into());
    }
    if a.jwks_min_refetch_interval < Duration::from_secs(1)
        || a.jwks_min_refetch_interval > a.jwks_refresh_interval
    {
        return bad(
            "jwks_min_refetch_interval",
            "must be at least 1s and at most jwks_refresh_interval".into(),
        );
    }
    if a.leeway > Duration::from_secs(300) {
        return bad("leeway", "must be at most 5m".into());
    }
    if a.scope_claim.is_empty() {
        return bad("scope_claim", "must name a claim".into());
    }
    if !(512..=65_536).contains(&a.max_token_bytes) {
        return bad("max_token_bytes", "must be between 512 and 65536".into());
    }
    if !(16..=1 << 24).contains(&a.token_cache_entries) {
        return bad(
            "token_cache_entries",
            "must be between 16 and 16777216".into(),
        );
    }
    if !(16..=1 << 24).contains(&a.rate_limit_callers) {
        return bad(
            "rate_limit_callers",
            "must be between 16 and 16777216".into(),
        );
    }
    Ok(())
}

/// A scope token (RFC 6749 §3.3): printable ASCII, no space, `"` or `\`,
/// so it can be quoted in `WWW-Authenticate`.
fn is_scope(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 128
        && s.bytes()
            .all(|b| b == 0x21 || (0x23..=0x5b).contains(&b) || (0x5d..=0x7e).contains(&b))
}

fn validate_access(r: &ResourceConfig, a: &AuthConfig, i: usize) -> Result<(), (String, String)> {
    let at = |field: &str| format!("resource[{i}].{field}");
    let has_jwt = a.jwt_secret.is_some() || a.jwks_file.is_some() || a.jwks_url.is_some();
    let has_keys = a.api_keys_file.is_some();
    match r.auth {
        AuthMode::Jwt if !has_jwt => {
            return Err((
                at("auth"),
                "\"jwt\" needs auth.jwt_secret, auth.jwks_file or auth.jwks_url".into(),
            ));
        }
        AuthMode::ApiKey if !has_keys => {
            return Err((at("auth"), "\"api_key\" needs auth.api_keys_file".into()));
        }
        AuthMode::Any if !has_jwt && !has_keys => {
            return Err((
                at("auth"),
                "\"any\" needs a token source (auth.jwt_secret, auth.jwks_file, auth.jwks_url) or auth.api_keys_file".into(),
            ));
        }
        _ => {}
    }
    if r.auth == AuthMode::None {
        for (field, set) in [
            ("scopes", !r.scopes.is_empty()),
            ("owner_claim", r.owner_claim.is_some()),
        ] {
            if set {
                return Err((
                    at(field),
                    "needs a caller: set auth to \"jwt\", \"api_key\" or \"any\"".into(),
                ));
            }
        }
    }
    if let Some(s) = r.scopes.iter().find(|s| !is_scope(s)) {
        return Err((
            at("scopes"),
            format!(
                "{s:?} is not a scope (printable ASCII without space, '\"' or '\\', at most 128)"
            ),
        ));
    }
    if let Some(c) = &r.owner_claim {
        if r.auth == AuthMode::ApiKey {
            return Err((
                at("owner_claim"),
                "API keys carry no claims: use auth = \"jwt\" or \"any\"".into(),
            ));
        }
        if c.is_empty() || c.len() > 128 {
            return Err((at("owner_claim"), "must name a claim".into()));
        }
    }
    if let Some(c) = &r.owner_column {
        if r.owner_claim.is_none() {
            return Err((at("owner_column"), "needs owner_claim".into()));
        }
        if *c != r.key_column && !r.columns.contains(c) {
            return Err((
                at("owner_column"),
                format!("{c:?} must be one of columns: the check reads it from the cached row"),
            ));
        }
    }
    match (&r.rate_limit, r.rate_limit_burst) {
        (Some(rate), burst) => {
            parse_rate(rate).map_err(|p| (at("rate_limit"), p))?;
            if burst.is_some_and(|b| b == 0 || b > 1_000_000) {
                return Err((
                    at("rate_limit_burst"),
                    "must be between 1 and 1000000".into(),
                ));
            }
        }
        (None, Some(_)) => {
            return Err((at("rate_limit_burst"), "needs rate_limit".into()));
        }
        (None, None) => {}
    }
    Ok(())
}

fn validate_filter(f: &FilterConfig, at: &str) -> Result<(), (String, String)> {
    let p = f.false_positive_rate;
    if !(p > 0.0 && p < 1.0) {
        return Err((
            format!("{at}.false_positive_rate"),
            format!("{p} is not in (0, 1)"),
        ));
    }
    if !(f.headroom >= 1.0 && f.headroom <= 100.0) {
        return Err((
            format!("{at}.headroom"),
            format!("{} is not in [1, 100]", f.headroom),
        ));
    }
    if !(0.0..=1.0).contains(&f.max_shrink) {
        return Err((
            format!("{at}.max_shrink"),
            format!("{} is not in [0, 1]", f.max_shrink),
        ));
    }
    let m = f.rebuild_fp_multiple;
    if !(m == 0.0 || (1.0..=1e6).contains(&m)) {
        return Err((
            format!("{at}.rebuild_fp_multiple"),
            format!("{m} is neither 0 (off) nor in [1, 1e6]"),
        ));
    }
    let d = f.rebuild_delete_fraction;
    if !(0.0..=1.0).contains(&d) {
        return Err((
            format!("{at}.rebuild_delete_fraction"),
            format!("{d} is not in [0, 1]"),
        ));
    }
    if d > 0.0 && f.max_shrink < 1.0 && d >= f.max_shrink {
        return Err((
            format!("{at}.rebuild_delete_fraction"),
            format!(
                "{d} must be below max_shrink ({}): the rebuild it asks for would be refused as a shrink",
                f.max_shrink
            ),
        ));
    }
    let g = f.rebuild_insert_fraction;
    if !(0.0..=1e6).contains(&g) {
        return Err((
            format!("{at}.rebuild_insert_fraction"),
            format!("{g} is not in [0, 1e6]"),
        ));
    }
    if !f.rebuild_interval.is_zero() && f.rebuild_interval < Duration::from_secs(1) {
        return Err((
            format!("{at}.rebuild_interval"),
            "must be at least 1s, or 0s to disable scheduled rebuilds".into(),
        ));
    }
    Ok(())
}

/// The smallest `cache.max_bytes` accepted: a bare number is bytes, and
/// `max_bytes = 256` meant as MiB would otherwise cache nothing, silently.
const MIN_CACHE_BYTES: u64 = 64 * 1024;

fn validate_cache(c: &CacheConfig, at: &str) -> Result<(), (String, String)> {
    if c.enabled && c.max_entries == 0 {
        return Err((
            format!("{at}.max_entries"),
            "must be at least 1 (set enabled = false to turn the cache off)".into(),
        ));
    }
    if let Some(b) = c.max_bytes
        && c.enabled
        && b.as_u64() < MIN_CACHE_BYTES
    {
        return Err((
            format!("{at}.max_bytes"),
            format!(
                "{} bytes cannot hold even a few rows; give at least {MIN_CACHE_BYTES} \
                 (units need a suffix: \"256 MiB\")",
                b.as_u64()
            ),
        ));
    }
    if c.enabled && c.ttl.is_zero() {
        return Err((format!("{at}.ttl"), "must be above 0".into()));
    }
    let key = format!("{at}.http_cache_control");
    cache_control_max_age(&c.http_cache_control).map_err(|e| (key, e))?;
    let key = format!("{at}.http_cache_control_not_found");
    let max_age =
        cache_control_max_age(&c.http_cache_control_not_found).map_err(|e| (key.clone(), e))?;
    if let Some(secs) = max_age
        && Duration::from_secs(secs) > c.negative_ttl
    {
        return Err((
            key,
            format!(
                "a 404 may be cached downstream for at most negative_ttl ({}s), not {secs}s",
                c.negative_ttl.as_secs()
            ),
        ));
    }
    Ok(())
}

/// Checks a `Cache-Control` value against the response directives of RFC
/// 9111 §5.2.2 and RFC 5861; returns its largest freshness lifetime
/// (`max-age`, `s-maxage`), if it has one.
pub fn cache_control_max_age(value: &str) -> Result<Option<u64>, String> {
    const FLAGS: [&str; 9] = [
        "no-cache",
        "no-store",
        "must-revalidate",
        "proxy-revalidate",
        "must-understand",
        "no-transform",
        "public",
        "private",
        "immutable",
    ];
    const SECONDS: [&str; 4] = [
        "max-age",
        "s-maxage",
        "stale-while-revalidate",
        "stale-if-error",
    ];
    if value.trim().is_empty() {
        return Err("must name at least one directive (\"no-cache\", \"max-age=60\")".into());
    }
    let mut max_age = None;
    for d in value.split(',').map(str::trim) {
        let (name, arg) = match d.split_once('=') {
            Some((n, a)) => (n.trim().to_ascii_lowercase(), Some(a.trim())),
            None => (d.to_ascii_lowercase(), None),
        };
        match arg {
            None if FLAGS.contains(&name.as_str()) => {}
            Some(a) if SECONDS.contains(&name.as_str()) => {
                let secs: u64 = a
                    .parse()
                    .map_err(|_| format!("{name} takes a number of seconds, not {a:?}"))?;
                if name == "max-age" || name == "s-maxage" {
                    max_age = max_age.max(Some(secs));
                }
            }
            _ => {
                return Err(format!(
                    "{d:?} is not a response directive this gateway sends \
                     (one of {}, or {}=N)",
                    FLAGS.join(", "),
                    SECONDS.join("=N, ")
                ));
            }
        }
    }
    Ok(max_age)
}

/// `BLOOMGATE_SERVER_LISTEN` (one underscore) looks like a config key but
/// would be ignored: refuse it rather than run with the file's value.
fn check_env_typos() -> Result<(), ConfigError> {
    const SECTIONS: [&str; 8] = [
        "server", "admin", "database", "log", "filter", "cache", "auth", "bus",
    ];
    for (name, _) in std::env::vars_os() {
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix("BLOOMGATE_")) else {
            continue;
        };
        let lower = rest.to_ascii_lowercase();
        if lower.contains("__") || lower == "admin_token" {
            continue;
        }
        if let Some(section) = SECTIONS
            .iter()
            .find(|s| lower.strip_prefix(*s).is_some_and(|r| r.starts_with('_')))
        {
            let key = &lower[section.len() + 1..];
            return Err(ConfigError::Invalid {
                file: "environment".into(),
                key: format!("BLOOMGATE_{rest}"),
                problem: format!(
                    "sections and keys are separated by two underscores: BLOOMGATE_{}__{}",
                    section.to_ascii_uppercase(),
                    key.to_ascii_uppercase()
                ),
            });
        }
    }
    Ok(())
}

/// A plain SQL identifier: we quote it anyway, but refusing anything else
/// keeps SQL out of the config entirely.
fn is_identifier(s: &str) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && s.len() <= 63
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

fn is_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

/// A route is `/segment/.../{param}`: literal segments and exactly one
/// parameter, which must be a whole segment.
fn check_route(route: &str) -> Result<(), String> {
    if !route.starts_with('/') {
        return Err(format!("{route:?} must start with '/'"));
    }
    let mut params = 0;
    for seg in route[1..].split('/') {
        if seg.is_empty() {
            return Err(format!("{route:?} has an empty segment"));
        }
        if let Some(name) = seg.strip_prefix('{').and_then(|s| s.strip_suffix('}')) {
            if !is_identifier(name) {
                return Err(format!(
                    "{route:?}: parameter {{{name}}} must be an identifier"
                ));
            }
            params += 1;
        } else if !seg
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.~".contains(c))
        {
            return Err(format!(
                "{route:?}: segment {seg:?} may hold only letters, digits and -_.~"
            ));
        }
    }
    if params != 1 {
        return Err(format!(
            "{route:?} must have exactly one {{param}} segment for the key"
        ));
    }
    if route.starts_with("/admin") || route == "/healthz" || route == "/readyz" {
        return Err(format!("{route:?} is reserved"));
    }
    Ok(())
}

/// Routes that differ only in the parameter name clash in the router.
fn route_shape(route: &str) -> String {
    route
        .split('/')
        .map(|s| if s.starts_with('{') { "{}" } else { s })
        .collect::<Vec<_>>()
        .join("/")
}

/// `postgres://user:secret@host/db` → `postgres://user:***@host/db`; a
/// `password` query parameter (libpq accepts one) is masked too, with or
/// without a value and however its name is percent-encoded. A `#fragment`
/// is dropped: the driver ignores it, so it carries nothing worth showing,
/// and a line pasted after a `#` could hold anything.
pub fn redact_url(url: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    let base = match base.split_once("://") {
        Some((scheme, rest)) => match rest.rfind('@') {
            Some(at) => match rest[..at].split_once(':') {
                Some((user, _)) => format!("{scheme}://{user}:***{}", &rest[at..]),
                None => base.to_string(),
            },
            None => base.to_string(),
        },
        None => base.to_string(),
    };
    match query {
        Some(q) => {
            // URL parsers end the query at the first '#'.
            let q = q.split_once('#').map_or(q, |(q, _)| q);
            let q: Vec<String> = q
                .split('&')
                .map(|kv| {
                    // The driver percent-decodes keys: `%70assword` is a password.
                    let key = kv.split_once('=').map_or(kv, |(k, _)| k);
                    let decoded = percent_encoding::percent_decode_str(key).decode_utf8_lossy();
                    if decoded.eq_ignore_ascii_case("password") {
                        format!("{key}=***")
                    } else {
                        kv.to_string()
                    }
                })
                .collect();
            format!("{base}?{}", q.join("&"))
        }
        None => base,
    }
}

#[cfg(test)]
mod tests {
    /// `BLOOMGATE_DATABASE__REPLICA_URLS` as a TOML array, as one URL and as
    /// comma-separated URLs: figment's environment provider hands the
    /// latter two over as plain strings.
    #[test]
    fn replica_urls_from_the_environment_take_an_array_or_plain_text() {
        use figment::providers::Env;
        let both = ["postgres://u:p@a:5432/db", "postgres://b/db"];
        for (text, want) in [
            (format!("[\"{}\", \"{}\"]", both[0], both[1]), &both[..]),
            (format!("{},{}", both[0], both[1]), &both[..]),
            (format!(" {} ", both[0]), &both[..1]),
        ] {
            // A prefix of its own: nothing else reads these variables.
            #[allow(clippy::result_large_err)] // figment's Jail signature
            figment::Jail::expect_with(|jail| {
                jail.set_env("BGTEST_DATABASE__REPLICA_URLS", &text);
                let fig = Figment::from(Serialized::defaults(Config::default()))
                    .merge(Env::prefixed("BGTEST_").split("__"));
                let c: Config = fig.extract()?;
                assert_eq!(c.database.replica_urls, want, "{text}");
                Ok(())
            });
        }
    }

    use super::*;

    const MINIMAL: &str = r#"
        [[resource]]
        name = "users"
        route = "/users/{id}"
        table = "users"
        key_column = "id"
        key_type = "bigint"
        columns = ["id", "name"]
    "#;

    fn err(text: &str) -> String {
        Config::from_toml(text).unwrap_err().to_string()
    }

    #[test]
    fn minimal_config_gets_defaults() {
        let c = Config::from_toml(MINIMAL).unwrap();
        assert_eq!(c.server.max_key_length, 256);
        assert_eq!(c.filter.false_positive_rate, 0.01);
        let r = &c.resolved()[0];
        assert_eq!(r.filter, c.filter);
        assert_eq!(r.cache, c.cache);
    }

    #[test]
    fn the_wal_poll_interval_is_unset_by_default_bounded_and_round_trips() {
        assert_eq!(
            Config::from_toml(MINIMAL)
                .unwrap()
                .database
                .wal_poll_interval,
            None
        );
        let c = Config::from_toml(&format!(
            "[database]\nwal_poll_interval = \"10ms\"\n{MINIMAL}"
        ))
        .unwrap();
        assert_eq!(
            c.database.wal_poll_interval,
            Some(Duration::from_millis(10))
        );
        let again = Config::from_toml(&c.to_redacted_toml()).unwrap();
        assert_eq!(
            again.database.wal_poll_interval,
            c.database.wal_poll_interval
        );
        for bad in ["0s", "500us", "2s"] {
            let e = err(&format!(
                "[database]\nwal_poll_interval = \"{bad}\"\n{MINIMAL}"
            ));
            assert!(e.contains("database.wal_poll_interval"), "{bad}: {e}");
        }
    }

    #[test]
    fn the_queue_settings_have_defaults_bounds_and_round_trip() {
        let c = Config::from_toml(MINIMAL).unwrap();
        assert_eq!(c.database.queue_poll_interval, Duration::from_millis(5));
        assert_eq!(c.database.queue_retention, Duration::from_secs(600));
        let c = Config::from_toml(&format!(
            "[database]\nfreshness = \"queue\"\nqueue_poll_interval = \"20ms\"\nqueue_retention = \"1h\"\n{MINIMAL}"
        ))
        .unwrap();
        assert_eq!(c.database.freshness, Freshness::Queue);
        let again = Config::from_toml(&c.to_redacted_toml()).unwrap();
        assert_eq!(again.database.freshness, Freshness::Queue);
        assert_eq!(
            again.database.queue_poll_interval,
            Duration::from_millis(20)
        );
        assert_eq!(again.database.queue_retention, Duration::from_secs(3600));
        for (key, bad) in [
            ("queue_poll_interval", "0s"),
            ("queue_poll_interval", "2s"),
            ("queue_retention", "5s"),
        ] {
            let e = err(&format!("[database]\n{key} = \"{bad}\"\n{MINIMAL}"));
            assert!(e.contains(&format!("database.{key}")), "{key} = {bad}: {e}");
        }
    }

    #[test]
    fn overrides_apply_per_resource() {
        let text = format!(
            "{MINIMAL}\n[resource.filter]\nfalse_positive_rate = 0.001\nrebuild_interval = \"30s\"\n[resource.cache]\nttl = \"2m\"\n"
        );
        let c = Config::from_toml(&text).unwrap();
        let r = &c.resolved()[0];
        assert_eq!(r.filter.false_positive_rate, 0.001);
        assert_eq!(r.filter.rebuild_interval, Duration::from_secs(30));
        assert_eq!(r.filter.headroom, c.filter.headroom);
        assert_eq!(r.cache.ttl, Duration::from_secs(120));
        assert_eq!(r.cache.negative_ttl, c.cache.negative_ttl);
    }

    #[test]
    fn a_byte_budget_parses_with_units_and_is_inherited_unless_entries_are_set() {
        let c = Config::from_toml(&format!("[cache]\nmax_bytes = \"256 MiB\"\n{MINIMAL}")).unwrap();
        assert_eq!(c.cache.max_bytes.map(|b| b.as_u64()), Some(256 << 20));
        assert_eq!(c.resolved()[0].cache.max_bytes, c.cache.max_bytes);
        let c = Config::from_toml(&format!("[cache]\nmax_bytes = 1048576\n{MINIMAL}")).unwrap();
        assert_eq!(c.cache.max_bytes.map(|b| b.as_u64()), Some(1 << 20));
        // A resource that bounds itself by entries is bounded by entries.
        let c = Config::from_toml(&format!(
            "[cache]\nmax_bytes = \"1 GiB\"\n{MINIMAL}\n[resource.cache]\nmax_entries = 10\n"
        ))
        .unwrap();
        let r = &c.resolved()[0].cache;
        assert_eq!((r.max_entries, r.max_bytes), (10, None));
        // And one with its own budget keeps it.
        let c = Config::from_toml(&format!(
            "{MINIMAL}\n[resource.cache]\nmax_bytes = \"2 MB\"\n"
        ))
        .unwrap();
        assert_eq!(c.cache.max_bytes, None);
        assert_eq!(
            c.resolved()[0].cache.max_bytes.map(|b| b.as_u64()),
            Some(2_000_000)
        );
        // The redacted TOML (check-config) round-trips it exactly.
        let c =
            Config::from_toml(&format!("[cache]\nmax_bytes = \"1000001 B\"\n{MINIMAL}")).unwrap();
        assert_eq!(c.cache.max_bytes.map(|b| b.as_u64()), Some(1_000_001));
        let again = Config::from_toml(&c.to_redacted_toml()).unwrap();
        assert_eq!(again.cache.max_bytes, c.cache.max_bytes);
    }

    #[test]
    fn unknown_keys_are_errors_naming_the_key() {
        let e = err(&format!("[server]\nlisten_addr = \"x\"\n{MINIMAL}"));
        assert!(e.contains("listen_addr"), "{e}");
        let e = err(&MINIMAL.replace("columns", "colums"));
        assert!(e.contains("colums"), "{e}");
    }

    #[test]
    fn type_errors_name_the_key() {
        let e = err(&format!("[server]\nmax_key_length = \"long\"\n{MINIMAL}"));
        assert!(e.contains("max_key_length"), "{e}");
        let e = err(&format!("[filter]\nrebuild_interval = \"soon\"\n{MINIMAL}"));
        assert!(e.contains("rebuild_interval"), "{e}");
        let e = err(&MINIMAL.replace("\"bigint\"", "\"float\""));
        assert!(e.contains("key_type"), "{e}");
    }

    #[test]
    fn sql_in_identifiers_is_refused() {
        for (field, value) in [
            ("table = \"users\"", "table = \"users; DROP TABLE users\""),
            ("key_column = \"id\"", "key_column = \"id\\\" OR 1=1 --\""),
            (
                "columns = [\"id\", \"name\"]",
                "columns = [\"id\", \"pg_sleep(10)\"]",
            ),
        ] {
            let e = err(&MINIMAL.replace(field, value));
            assert!(e.contains("not a valid SQL identifier"), "{e}");
            assert!(e.contains("resource[0]."), "{e}");
        }
        assert!(
            Config::from_toml(
                &MINIMAL.replace("\"users\"\n        key", "\"public.users\"\n        key")
            )
            .is_ok()
        );
    }

    #[test]
    fn bad_values_are_refused() {
        let cases = [
            (
                "[filter]\nfalse_positive_rate = 1.5\n",
                "filter.false_positive_rate",
            ),
            (
                "[filter]\nfalse_positive_rate = 0.0\n",
                "filter.false_positive_rate",
            ),
            ("[filter]\nheadroom = 0.5\n", "filter.headroom"),
            ("[filter]\nmax_shrink = 2.0\n", "filter.max_shrink"),
            (
                "[filter]\nrebuild_fp_multiple = 0.5\n",
                "filter.rebuild_fp_multiple",
            ),
            (
                "[filter]\nrebuild_delete_fraction = 1.5\n",
                "filter.rebuild_delete_fraction",
            ),
            (
                "[filter]\nrebuild_delete_fraction = 0.6\n",
                "filter.rebuild_delete_fraction",
            ),
            (
                "[filter]\nrebuild_insert_fraction = -1.0\n",
                "filter.rebuild_insert_fraction",
            ),
            (
                "[admin]\nrequest_timeout = \"0s\"\n",
                "admin.request_timeout",
            ),
            ("[admin]\nrebuild_wait = \"0s\"\n", "admin.rebuild_wait"),
            (
                "[filter]\nrebuild_interval = \"10ms\"\n",
                "filter.rebuild_interval",
            ),
            ("[cache]\nmax_entries = 0\n", "cache.max_entries"),
            ("[cache]\nmax_bytes = 256\n", "cache.max_bytes"),
            ("[cache]\nmax_bytes = \"lots\"\n", "cache.max_bytes"),
            ("[database]\npool_size = 0\n", "database.pool_size"),
            ("[database]\nurl = \"mysql://x\"\n", "database.url"),
            ("[server]\nmax_key_length = 0\n", "server.max_key_length"),
        ];
        for (prefix, key) in cases {
            let e = err(&format!("{prefix}{MINIMAL}"));
            assert!(e.contains(key), "{prefix}: {e}");
        }
        // Per resource, the key names the resource.
        let e = err(&format!(
            "{MINIMAL}\n[resource.filter]\nrebuild_fp_multiple = 0.9\n"
        ));
        assert!(e.contains("resource[0].filter.rebuild_fp_multiple"), "{e}");
        // Off is 0 for every trigger.
        assert!(
            Config::from_toml(&format!(
                "[filter]\nrebuild_fp_multiple = 0\nrebuild_delete_fraction = 0\nrebuild_insert_fraction = 0\n{MINIMAL}"
            ))
            .is_ok()
        );
    }

    #[test]
    fn connection_limits_are_checked() {
        let c = Config::from_toml(MINIMAL).unwrap();
        assert_eq!(c.server.idle_timeout, Duration::from_secs(75));
        assert_eq!(c.server.max_connections, 10_000);
        let cases = [
            ("[server]\nidle_timeout = \"0s\"\n", "server.idle_timeout"),
            ("[server]\nmax_connections = 0\n", "server.max_connections"),
            (
                "[server]\nmax_connections = 5000000000\n",
                "server.max_connections",
            ),
        ];
        for (prefix, key) in cases {
            let e = err(&format!("{prefix}{MINIMAL}"));
            assert!(e.contains(key), "{prefix}: {e}");
        }
    }

    #[test]
    fn routes_are_checked() {
        for (route, problem) in [
            ("users/{id}", "start with '/'"),
            ("/users/{id}/{x}", "exactly one"),
            ("/users", "exactly one"),
            ("/users//{id}", "empty segment"),
            ("/us ers/{id}", "segment"),
            ("/admin/{id}", "reserved"),
        ] {
            let e = err(&MINIMAL.replace("/users/{id}", route));
            assert!(e.contains(problem), "{route}: {e}");
        }
        let two = format!(
            "{MINIMAL}{}",
            MINIMAL
                .replace("\"users\"\n        route", "\"u2\"\n        route")
                .replace("{id}", "{key}")
        );
        assert!(err(&two).contains("clashes"));
        let dup = format!("{MINIMAL}{}", MINIMAL.replace("/users/", "/people/"));
        assert!(err(&dup).contains("used twice"));
    }

    #[test]
    fn exact_mode_needs_integer_keys() {
        let text =
            MINIMAL.replace("\"bigint\"", "\"uuid\"") + "[resource.filter]\nmode = \"exact\"\n";
        assert!(err(&text).contains("resource[0].filter.mode"));
    }

    #[test]
    #[allow(clippy::result_large_err)] // figment's Jail API returns its own error
    fn environment_overrides_the_file() {
        figment::Jail::expect_with(|jail| {
            jail.create_file("bg.toml", MINIMAL)?;
            jail.set_env("BLOOMGATE_SERVER__LISTEN", "0.0.0.0:9999");
            jail.set_env("BLOOMGATE_FILTER__FALSE_POSITIVE_RATE", "0.001");
            jail.set_env("DATABASE_URL", "postgres://a:pw@h/db");
            jail.set_env("BLOOMGATE_ADMIN_TOKEN", "not-a-config-key");
            let c = Config::load(Path::new("bg.toml")).map_err(|e| e.to_string())?;
            assert_eq!(c.server.listen.port(), 9999);
            assert_eq!(c.resolved()[0].filter.false_positive_rate, 0.001);
            assert_eq!(c.database.url, "postgres://a:pw@h/db");
            jail.set_env("BLOOMGATE_DATABASE__URL", "postgres://h2/db");
            assert_eq!(
                Config::load(Path::new("bg.toml")).unwrap().database.url,
                "postgres://h2/db"
            );
            // The scripts' and tests' own variables are not config keys.
            jail.set_env("BLOOMGATE_TEST_DATABASE_URL", "postgres://x/y");
            jail.set_env("BLOOMGATE_PG_PORT", "54329");
            assert!(Config::load(Path::new("bg.toml")).is_ok());
            jail.set_env("BLOOMGATE_SERVER__NOPE", "1");
            let e = Config::load(Path::new("bg.toml")).unwrap_err().to_string();
            assert!(e.contains("nope") && e.contains("BLOOMGATE_"), "{e}");
            // A one-underscore typo is refused with the right spelling
            // (Jail restores the environment afterwards).
            jail.set_env("BLOOMGATE_SERVER__NOPE", "");
            jail.set_env("BLOOMGATE_SERVER_LISTEN", "0.0.0.0:1");
            let e = Config::load(Path::new("bg.toml")).unwrap_err().to_string();
            assert!(e.contains("BLOOMGATE_SERVER__LISTEN"), "{e}");
            Ok(())
        });
    }

    #[test]
    fn missing_file_is_named() {
        let e = Config::load(Path::new("/nonexistent/bg.toml"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("/nonexistent/bg.toml"), "{e}");
    }

    #[test]
    fn no_resources_is_an_error() {
        assert!(err("").contains("[[resource]]"));
    }

    const PRIVATE: &str = r#"
        [[resource]]
        name = "me"
        route = "/me/{id}"
        table = "users"
        key_column = "id"
        key_type = "bigint"
        columns = ["id", "owner_id", "email"]
        auth = "jwt"
        scopes = ["users:read"]
        owner_claim = "sub"
        owner_column = "owner_id"
        rate_limit = "600/m"
    "#;
    const SECRET: &str = "0123456789abcdef0123456789abcdef";

    #[test]
    fn access_rules_have_defaults_and_resolve() {
        let c = Config::from_toml(MINIMAL).unwrap();
        assert_eq!(c.resolved()[0].access, Access::default());
        assert_eq!(c.auth.leeway, Duration::from_secs(30));
        assert_eq!(c.auth.scope_claim, "scope");
        assert_eq!(c.auth.max_token_bytes, 8192);
        let c = Config::from_toml(&format!(
            "[auth]\njwt_secret = \"{SECRET}\"\n{MINIMAL}{PRIVATE}"
        ))
        .unwrap();
        let a = &c.resolved()[1].access;
        assert_eq!(a.mode, AuthMode::Jwt);
        assert_eq!(a.owner_column.as_deref(), Some("owner_id"));
        let rate = a.rate_limit.unwrap();
        assert_eq!((rate.per_second, rate.burst), (10.0, 10));
        // An owner column that is the key is the key.
        let c = Config::from_toml(&format!(
            "[auth]\njwt_secret = \"{SECRET}\"\n{}",
            PRIVATE.replace("\"owner_id\"\n", "\"id\"\n")
        ))
        .unwrap();
        assert_eq!(c.resolved()[0].access.owner_column, None);
    }

    #[test]
    fn access_errors_name_the_key() {
        let with = |auth: &str, res: &str| err(&format!("[auth]\n{auth}\n{res}"));
        let s = format!("jwt_secret = \"{SECRET}\"");
        for (auth, res, key) in [
            (
                "jwt_secret = \"short\"",
                PRIVATE.to_string(),
                "auth.jwt_secret",
            ),
            ("", PRIVATE.to_string(), "resource[0].auth"),
            (
                &s,
                PRIVATE.replace("\"jwt\"", "\"api_key\""),
                "resource[0].auth",
            ),
            (
                &s,
                PRIVATE.replace("auth = \"jwt\"", "auth = \"none\""),
                "resource[0].scopes",
            ),
            (
                &s,
                PRIVATE.replace("\"users:read\"", "\"a b\""),
                "resource[0].scopes",
            ),
            (
                &s,
                PRIVATE.replace("\"owner_id\"\n", "\"other\"\n"),
                "resource[0].owner_column",
            ),
            (
                &s,
                PRIVATE.replace("600/m", "fast"),
                "resource[0].rate_limit",
            ),
            (
                &s,
                PRIVATE.replace("600/m", "0/s"),
                "resource[0].rate_limit",
            ),
            (
                &s,
                format!("{PRIVATE}rate_limit_burst = 0\n"),
                "resource[0].rate_limit_burst",
            ),
            (
                &format!("{s}\njwks_url = \"http://idp.example.com/jwks\""),
                PRIVATE.into(),
                "auth.jwks_url",
            ),
            (
                &format!("{s}\nleeway = \"1h\""),
                PRIVATE.into(),
                "auth.leeway",
            ),
            (
                &format!("{s}\nmax_token_bytes = 10"),
                PRIVATE.into(),
                "auth.max_token_bytes",
            ),
            (
                &format!("{s}\njwks_file = \"/nonexistent/jwks.json\""),
                PRIVATE.into(),
                "auth.jwks_file",
            ),
            (
                &format!("{s}\napi_keys_file = \"/nonexistent/keys.toml\""),
                PRIVATE.into(),
                "auth.api_keys_file",
            ),
        ] {
            let e = with(auth, &res);
            assert!(e.contains(key), "{key}: {e}");
            assert!(!e.contains(SECRET), "{e}");
        }
    }

    /// The secret comes from the environment, is redacted in
    /// `check-config` and in `Debug`, and never shown.
    #[test]
    #[allow(clippy::result_large_err)] // figment's Jail API returns its own error
    fn the_jwt_secret_comes_from_the_environment_and_is_never_shown() {
        figment::Jail::expect_with(|jail| {
            jail.create_file("bg.toml", &format!("{MINIMAL}{PRIVATE}"))?;
            jail.set_env("BLOOMGATE_AUTH__JWT_SECRET", SECRET);
            let c = Config::load(Path::new("bg.toml")).map_err(|e| e.to_string())?;
            assert_eq!(c.auth.jwt_secret.as_deref(), Some(SECRET));
            let shown = format!("{}\n{c:?}", c.to_redacted_toml());
            assert!(!shown.contains(SECRET), "{shown}");
            assert!(shown.contains(REDACTED));
            jail.set_env("BLOOMGATE_AUTH_JWT_SECRET", SECRET);
            let e = Config::load(Path::new("bg.toml")).unwrap_err().to_string();
            assert!(
                e.contains("BLOOMGATE_AUTH__JWT_SECRET") && !e.contains(SECRET),
                "{e}"
            );
            Ok(())
        });
    }

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(
            redact_url("postgres://app:s3cret@db:5432/x"),
            "postgres://app:***@db:5432/x"
        );
        assert_eq!(
            redact_url("postgres://db/x?user=a&password=s3cret"),
            "postgres://db/x?user=a&password=***"
        );
        // Found by fuzz/config_parse: the driver decodes the key.
        assert_eq!(
            redact_url("postgres://h/db?user=a&%70assword=s3cretpw"),
            "postgres://h/db?user=a&%70assword=***"
        );
        assert_eq!(
            redact_url("postgres://h/db?PASSWORD=s3cret&sslmode=disable"),
            "postgres://h/db?PASSWORD=***&sslmode=disable"
        );
        // Found by fuzz/config_parse in CI: the query ends at '#', so a bare
        // `password` before it is a (blank) password parameter to the
        // driver, and whatever follows the '#' is no part of the query.
        assert_eq!(
            redact_url("postgres://h/db?user=a&password##x?password2=s3cret&n=x"),
            "postgres://h/db?user=a&password=***"
        );
        assert_eq!(
            redact_url("postgres://h/db?password=s3cret#frag"),
            "postgres://h/db?password=***"
        );
        let mut c = Config::from_toml(MINIMAL).unwrap();
        c.database.url = "postgres://app:s3cret@db/x".into();
        assert!(!c.to_redacted_toml().contains("s3cret"));
        assert!(!format!("{c:?}").contains("s3cret"));
    }
}
