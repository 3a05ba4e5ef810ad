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
//! A request flows one way, `http → key → auth → filter → cache → db`;
//! lower modules never import higher ones.
//!
//! - [`http`]: the router ([`http::app`]) behind its one middleware layer
//!   ([`http::front`]: request id, access line, trace span, body limit,
//!   load shedding, deadline), a resource's `GET` matched before the router
//!   ([`http::dispatch`]: a filtered key or a cache hit answered without a
//!   future; the connection calls the app in place, not a clone), and
//!   the one mapping from [`error::Error`] to status codes.
//! - [`resource`]: one table served by key, a thin composition of its
//!   live filter, its row cache and its queries; puts the request path
//!   together ([`resource::Resource::lookup_now`], then
//!   [`resource::Resource::load`]). [`resource::LiveFilter`] owns the
//!   published key set, the rebuild journal, the high-water mark and decay:
//!   the never-miss invariant, and nothing else does.
//! - [`rebuild`]: the per-resource rebuild coordinator every rebuild request
//!   goes through: at most one running and one pending, owned by the
//!   gateway's task for that resource.
//! - [`key`]: parsing a path segment into a typed [`key::Key`].
//! - [`auth`]: who may read what, decided per request before the filter:
//!   bearer JWTs verified with `ring` ([`auth::jwt`], key sets from a file
//!   or a URL: [`auth::jwks`]; the files `[auth]` names read once at
//!   start-up by [`auth::key_files`]), API keys held as keyed hashes
//!   ([`auth::api_key`]), a fixed table of verified credentials
//!   ([`auth::verified`]), per-caller GCRA rate limits in a fixed table
//!   ([`auth::limit`]), owner checks on the key or on a column of the
//!   cached row ([`auth::owner`]).
//! - [`filter`]: the membership filter ([`filter::KeySet`]): a cache-line
//!   blocked Bloom filter on secret-keyed HighwayHash, or an exact roaring
//!   bitmap. No I/O.
//! - [`encoding`]: content codings of a row (gzip, br, zstd), compressed
//!   once when it enters the cache, chosen per request from
//!   `Accept-Encoding`; each stored as one buffer (ETag, length, body)
//!   that a response cuts its parts from.
//! - [`cache`]: moka row cache and negative cache around a loader closure;
//!   knows nothing of the database. [`cache::Row`]: a row as HTTP sends it;
//!   [`cache::Inflight`]: the loads running per key, so that an
//!   invalidation during one is never undone; [`cache::DetachOnDrop`]: a
//!   load finishes when its caller goes away.
//! - [`db`]: the pool, the row query, streaming keys with binary COPY,
//!   [`db::position`]: a WAL position as (system identifier, timeline,
//!   LSN), and the primary's identity ([`db::position::Server`]) whose
//!   change is a gap for everything,
//!   [`db::outage`]: whether the primary can be reached at all,
//!   [`db::catalog`]: canonical table names, column types, replica identity,
//!   [`db::triggers`]: the triggers' SQL (notifying, or writing the
//!   queue feed's change table), and
//!   [`db::replicas`]: streaming read replicas for loads and scans, used
//!   only on the primary's timeline once they have replayed past every
//!   applied change, and
//!   [`db::tls`]: TLS for every connection (sqlx's, and the replication
//!   client's, whose `SSLRequest` and handshake [`db::tls::negotiate`]
//!   makes) as the URL's `sslmode` / `sslrootcert` say.
//! - [`feed`]: change feeds turned into one [`feed::Event`] type; they know
//!   nothing of the gateway, which applies their events.
//!   [`feed::supervisor`]: the one interface the gateway uses (which feed,
//!   what it needs installed, its task, its health). [`feed::notify`]:
//!   `LISTEN bloomgate`, fed by the triggers [`db::triggers`] generates (one
//!   small function per table, its key columns written in); resyncs after
//!   every reconnect, refuses a hot standby. [`feed::queue`]: the same
//!   triggers writing rows of a change table instead, polled by snapshot
//!   (no lock at commit; resumes after a reconnect; prunes old rows).
//!   [`feed::wal`]: logical decoding
//!   of the WAL streamed from a replication slot over the replication
//!   protocol ([`feed::replication`], a small client of it: its endpoint
//!   and password file, wire framing, MD5 and SCRAM, replication commands;
//!   [`feed::pgoutput`] decodes the messages) or polled from it with SQL (`database.wal_poll_interval`),
//!   acknowledged only up to what the applier has applied.
//!   [`feed::bus`] (`bus.url`): a fleet decodes the WAL once; the gateway
//!   holding the slot `bus.slot` relays it ([`feed::bus::relay`]) into a
//!   Redis Stream ([`feed::bus::redis`], behind the small
//!   [`feed::bus::Bus`] trait; entries in [`feed::bus::entry`]), and every
//!   gateway reads it back into the same events ([`feed::bus::consumer`]),
//!   falling back to a direct WAL feed while the bus is not current.
//!   [`feed::supervisor`] chooses and starts the feed in force.
//! - [`apply`]: the gateway's applier: every feed event, in order, to every
//!   resource on its table, each by its own key column (new keys into the
//!   filter, stale rows out of the cache, rebuilds on truncate, resync and
//!   rescan); publishes the commit LSN applied up to.
//! - [`gateway`]: the database plus all resources, and start-up: reads the
//!   catalog (canonical table names, key column types), installs the
//!   triggers, subscribes the feed, builds every filter.
//! - Counters and gauges: each component keeps its own and hands out one
//!   plain snapshot of them (`resource::stats`, [`db::stats`],
//!   [`feed::stats`], [`traffic`] for the listeners, `auth::AuthView`),
//!   gathered by `gateway::snapshot`; the admin JSON serializes the
//!   snapshots and `/metrics` renders them ([`exposition`]: the text
//!   format and the table each snapshot declares its metric names in), so
//!   a counter is named once. [`metrics`] adds the build and the process
//!   (`/proc`) and knows no component. Request latency goes into
//!   [`histogram`]s and the fast paths' counts into [`counter`]s, both
//!   sharded by thread so that recording them writes no memory another
//!   core writes.
//! - [`vouch`]: whether a resource's filter and cache may answer, from the
//!   feed's heartbeats, interruptions and resyncs.
//! - [`shutdown`]: the signal every long-lived task is handed; each finishes
//!   its unit of work when it fires.
//! - [`budget`]: a token bucket (database checks above the high-water mark).
//! - [`server`]: binding, background start-up, graceful shutdown, signals
//!   (SIGHUP reloads the log filter and admin token; SIGTERM drains:
//!   `/readyz` 503 for `server.shutdown_drain` first), the database check
//!   behind `bloomgate_db_up`, and the bounds on connections: deadlines per
//!   connection (`server::conn`), the `max_connections` cap, back-off when
//!   `accept` fails.
//! - [`config`]: the TOML file and environment, read once into typed structs,
//!   one file per section, each validating itself ([`config::server`],
//!   [`config::database`], [`config::resource`], ...); [`config::env`]'s
//!   sources and typo checks, the `Cache-Control` grammar
//!   ([`config::cache_control`]) and the one route grammar with the paths
//!   the gateway keeps for itself ([`config::route`], which
//!   [`http::dispatch`] matches by). It names no module above it.
//! - [`error`]: the error type of the request path.
//! - [`preflight`]: `bloomgate preflight`, everything a config needs of the
//!   database checked as the configured role, with the `GRANT` / `ALTER`
//!   statements that are missing.
//! - [`seed`]: demo data (and the demo schema's migrations).
//!   [`telemetry`]: logging (reloadable filter, typed JSON fields, the
//!   access and audit targets).
//! - [`access`]: access lines, one per request, formatted by hand
//!   ([`access::format`]) into the request thread's buffer and written by
//!   one thread ([`access::writer`]: bounded, dropped lines counted, flushed
//!   every 100 ms and at shutdown, the file reopened on SIGHUP); filtered
//!   404s limited to `log.access_filtered_rate` a second
//!   ([`access::sample`]).
//!
//! See `ARCHITECTURE.md` for a picture of the modules and who owns which
//! invariant.
//!
//! # Request flow
//!
//! 1. The router matches `GET {route}`; the raw path segment is parsed for the
//!    resource's key type. Malformed: 400.
//! 2. A resource with `auth` or a `rate_limit` checks the caller: 401 (no
//!    valid credential), 403 (a scope or the owner claim missing), 429;
//!    another owner's key is answered as absent (404). Nothing below is
//!    touched for a refused request.
//! 3. The filter is asked. Absent: 404 (`Cache-Status: bloomgate;
//!    detail=filter-absent`), nothing else touched.
//! 4. The cache is asked. A row: 200; a recent "no such row": 404.
//! 5. On a miss one query per key runs, however many requests wait on it, in
//!    a task that survives clients disconnecting. Found rows and absences are
//!    cached; database errors are not (503 with `Retry-After`).
//!
//! # Change flow
//!
//! 1. [`feed::supervisor`] picks the feed (`database.freshness`), installs
//!    what it needs in the database (publication or triggers) and starts it.
//! 2. The feed sends [`feed::Event`]s down a channel: commits (row changes
//!    reduced to the watched key columns, in commit order), truncates,
//!    heartbeats, interruptions, resyncs, coverage changes.
//! 3. [`apply`] applies each, in order, to every resource following the
//!    table: new keys into the live filter, changed and deleted rows out of
//!    the cache, rebuilds on truncate and resync; then publishes the LSN
//!    applied up to, which the WAL feed acknowledges and read replicas are
//!    gated on.
//! 4. [`vouch`] turns heartbeats, interruptions and resyncs into whether a
//!    resource's filter and cache may answer at all: never longer than
//!    `database.freshness_bound` past the last proof that they are complete.

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
pub mod telemetry;
pub mod traffic;
pub mod vouch;
