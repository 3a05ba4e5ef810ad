//! # bloomgate
//!
//! An HTTP caching gateway in front of PostgreSQL that keeps requests for
//! keys that do not exist ("cache penetration") away from the database: every
//! valid key of each resource is held in a keyed Bloom filter (or an exact
//! bitmap for dense integer ids), and a key the filter rejects is answered
//! 404 without any cache or database work.
//!
//! # Layout
//!
//! A request: [`server`] accepts it, [`http`] matches its route
//! ([`http::front`], then [`http::dispatch`], whose `http::lookup::begin`
//! answers all that needs no I/O), [`key`] parses the key, [`auth`] checks
//! the caller, and the [`resource`] asks its [`filter`] (absent: 404,
//! nothing else touched), its [`cache`] (a hit), then [`db`] (a miss: one
//! query per key, however many wait, in `http::lookup`'s future).
//!
//! A change: a [`feed`] (the WAL, `NOTIFY`, a change table, or the WAL
//! through the bus, [`feed::bus`]) sends [`feed::Event`]s; [`apply`]
//! applies them to every resource on the table (new keys into the filter,
//! stale rows out of the cache), and [`vouch`] says whether a resource's
//! filter and cache may answer at all.
//!
//! Those are orders of work, not of imports (`auth` imports `key`, `key`
//! imports `cache`, `db` imports `key`): the import graph has no cycle at
//! any level (`scripts/modules.py`), and `ARCHITECTURE.md` draws its layers.
//!
//! - [`server`]: binding, background start-up, rebuild schedules, signals
//!   (SIGHUP reloads, SIGTERM drains), graceful shutdown, connection bounds.
//! - [`http`]: the public router behind one middleware layer
//!   ([`http::front`]: the caller behind trusted proxies,
//!   [`http::forwarded`]; CORS, [`http::cors`]), a resource's `GET`
//!   answered before the router ([`http::dispatch`]), the admin API and
//!   status page, the OpenAPI document.
//! - [`key`]: a raw path segment (one per column of a composite key)
//!   parsed into a typed [`key::Key`].
//! - [`auth`]: who may read what (JWTs, API keys, scopes, owners, rate
//!   limits), decided before the filter.
//! - [`resource`]: one table served by key: its [`resource::LiveFilter`]
//!   (the never-miss invariant), its row cache and its queries.
//! - [`filter`]: the membership filter ([`filter::KeySet`]): a blocked Bloom
//!   filter on secret-keyed HighwayHash, or an exact roaring bitmap. No I/O.
//! - [`cache`]: the moka row and negative caches around a loader closure;
//!   knows nothing of the database.
//! - [`encoding`]: a row's content codings (gzip, br, zstd), compressed once
//!   as the row enters the cache.
//! - [`db`]: the pool, the row query, keys streamed by binary COPY (`scan`), the
//!   catalog, replica identities and the publication, the triggers' SQL, WAL
//!   positions and what a reading of them proves, which server each
//!   connection reached and where the address leads ([`db::identity`]),
//!   whether the server answers at all ([`db::outage`], [`db::reach`],
//!   queries bounded against a hung one), read replicas, TLS.
//! - [`feed`]: the change feeds (`wal`, `notify`, `queue`, the bus) as one
//!   [`feed::Event`] type; [`feed::supervisor`] picks and starts one.
//! - [`apply`]: every feed event, in order, to every resource on its table;
//!   publishes the position applied up to.
//! - [`vouch`]: whether a resource's filter and cache may answer.
//! - [`rebuild`]: a resource's rebuilds, at most one running and one pending.
//! - [`snapshot`]: a filter sealed for the fleet (`bus.fleet_key_file`):
//!   what a snapshot is complete at, its manifest, its encryption under the
//!   fleet key, and the store (the bus's Redis) it is kept in.
//! - [`gateway`]: the database, resources, access checks, applier and feed:
//!   start-up, and every background task.
//! - [`config`]: the TOML file and environment, read into typed structs, one
//!   file per section, each validating itself.
//! - [`error`]: the request path's error type.
//! - [`access`]: access lines, formatted by hand, written by their own thread.
//! - [`telemetry`]: logging: the reloadable filter, JSON lines, the targets.
//! - [`metrics`]: `/metrics` from the components' snapshots, with the build
//!   and the process.
//! - [`exposition`]: the Prometheus text format, and the table in which each
//!   snapshot names its metrics.
//! - [`histogram`]: request latency in fixed buckets, sharded by thread.
//! - [`counter`]: a count sharded by thread, for the fast paths.
//! - [`traffic`]: what the listeners see before any resource does.
//! - [`budget`]: a token bucket (the database checks a filter may ask for).
//! - [`shutdown`]: the signal every long-lived task is handed.
//! - [`preflight`]: `bloomgate preflight`: what a configuration needs of the
//!   database, checked as its role, with the statements that are missing.
//! - [`seed`]: `bloomgate seed`: demo data.
//!
//! `src/main.rs` is the binary and its commands. `ARCHITECTURE.md` has the
//! picture of the modules, both flows step by step, who owns which
//! invariant and where to add things.

pub mod access;
pub mod apply;
pub mod auth;
pub mod budget;
pub mod cache;
pub mod config;
pub mod counter;
pub mod db;
pub mod encoding;
pub mod error;
pub mod exposition;
pub mod feed;
pub mod filter;
pub mod gateway;
pub mod histogram;
pub mod http;
pub mod key;
pub mod metrics;
pub mod preflight;
pub mod rebuild;
pub mod resource;
pub mod seed;
pub mod server;
pub mod shutdown;
pub mod snapshot;
pub mod telemetry;
pub mod traffic;
pub mod vouch;
