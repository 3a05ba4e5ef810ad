//! Running the gateway: bind, start up in the background while `/healthz`
//! already answers, schedule rebuilds, and shut down gracefully. Every
//! connection on either listener is bounded in time and number (see
//! `accept_loop` and the `conn` module).
//!
//! # Signals (the binary, [`run`])
//! - SIGHUP never stops the process: `log.access_file` is opened again
//!   (logrotate's `postrotate`, whatever the config file now says), then
//!   the config file is read again and what can change safely while
//!   serving is applied (the log filter, `log.level` and `log.access`;
//!   `log.access_filtered_rate`; the admin token from
//!   `admin.token_file`); a file that does not load leaves everything as
//!   it was, and other changed settings are said to need a restart.
//! - SIGTERM: `/readyz` answers 503 for `server.shutdown_drain` while
//!   requests are still served (a load balancer takes the gateway out of
//!   rotation), then the listeners stop and shutdown proceeds within
//!   `server.shutdown_timeout`; the access lines of every request answered
//!   are written before [`run`] returns. SIGINT (Ctrl-C) skips the drain.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};

use crate::auth::key_files::KeyFiles;
use crate::config::{Config, ServerConfig};
use crate::gateway::{Gateway, StartError};
use crate::http;
use crate::telemetry::LogThrottle;
use crate::traffic::Traffic;

mod conn;

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
    #[error(transparent)]
    Start(#[from] StartError),
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    #[error("start-up task failed: {0}")]
    Join(#[from] tokio::task::JoinError),
    #[error("server: {0}")]
    Io(#[from] std::io::Error),
    /// The access log could not be set up (`log.access_file`).
    #[error("{0}")]
    AccessLog(String),
}

/// The admin listener and its token, when one is configured.
pub struct Admin {
    pub listener: TcpListener,
    pub token: String,
}

/// What asked the process to stop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stop {
    /// SIGINT (Ctrl-C): stop without the drain.
    Interrupt,
    /// SIGTERM: drain first (`server.shutdown_drain`).
    Terminate,
}

/// How often the binary checks that the database answers
/// (`bloomgate_db_up`, and a log line naming the cause while it does not).
pub const DB_CHECK_EVERY: Duration = Duration::from_secs(5);

/// Binds `server.listen` (and `admin.listen` when an admin token is set) and
/// serves until `stop` resolves; on SIGHUP reloads what it can from
/// `config_path` (see "Signals" in the module doc).
pub async fn run(
    config: Config,
    key_files: &KeyFiles,
    config_path: Option<std::path::PathBuf>,
    stop: impl Future<Output = Stop> + Send,
) -> Result<(), ServeError> {
    // First: until a handler is installed, SIGHUP's default action ends
    // the process.
    let hangups = hangup_signals();
    let access = match crate::access::Logger::from_config(&config.log) {
        Ok(logger) => crate::access::install(logger).unwrap_or_else(|mine| {
            // Installed already (a second `run` in one process): that one
            // stays, this one ends.
            mine.stop(Duration::from_secs(1));
            crate::access::global().expect("installed")
        }),
        Err(e) => return Err(ServeError::AccessLog(e)),
    };
    let flush_within = config.server.shutdown_timeout;
    tracing::info!(
        version = env!("CARGO_PKG_VERSION"),
        config = %redacted_json(&config),
        "starting"
    );
    let admin = match config.admin.token()? {
        Some(token) => Some(Admin {
            listener: bind(config.admin.listen).await?,
            token,
        }),
        None => {
            tracing::info!("admin listener off: no admin token configured");
            None
        }
    };
    let listener = bind(config.server.listen).await?;
    let operator_listeners =
        u64::from(admin.is_some()) + u64::from(config.admin.metrics_listen.is_some());
    check_descriptors(&config, operator_listeners);
    let gateway = Gateway::new(config, key_files)?;
    let (stop_tasks, signal) = crate::shutdown::channel();
    let (tokens_tx, tokens_rx) = watch::channel(None);
    tokio::spawn(reload_on_hangup(
        hangups,
        config_path,
        admin.is_some(),
        gateway.clone(),
        tokens_tx,
        signal.clone(),
    ));
    tokio::spawn(gateway.db.clone().watch_up(DB_CHECK_EVERY, signal));
    let drain = gateway.config.server.shutdown_drain;
    let gw = gateway.clone();
    let shutdown = async move {
        if stop.await == Stop::Terminate && !drain.is_zero() {
            gw.begin_drain();
            tracing::info!(
                drain_s = drain.as_secs_f64(),
                "SIGTERM: /readyz answers 503 while requests are still served \
                 (server.shutdown_drain), then shutting down"
            );
            tokio::time::sleep(drain).await;
        }
    };
    let served = serve_with(gateway, listener, admin, shutdown, Some(tokens_rx)).await;
    stop_tasks.fire();
    // Every request is answered (or was dropped at the deadline): their
    // lines are written before the process exits.
    let stopped = tokio::task::spawn_blocking(move || access.stop(flush_within)).await;
    if !matches!(stopped, Ok(true)) {
        tracing::warn!(
            "access lines not all written within server.shutdown_timeout: their destination \
             is stuck"
        );
    }
    // The last line a supervisor's log shows: the process ended as asked,
    // not killed or crashed (an error is the caller's to say).
    if served.is_ok() {
        tracing::info!("bloomgate stopped");
    }
    served
}

/// The effective config, secrets redacted, as one JSON object (the
/// start-up line).
fn redacted_json(config: &Config) -> String {
    toml::from_str::<toml::Value>(&config.to_redacted_toml())
        .ok()
        .and_then(|v| serde_json::to_string(&v).ok())
        .unwrap_or_default()
}

#[cfg(unix)]
type Hangups = Option<tokio::signal::unix::Signal>;
#[cfg(not(unix))]
type Hangups = Option<()>;

#[cfg(unix)]
fn hangup_signals() -> Hangups {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::hangup()) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!(error = %e, "cannot handle SIGHUP");
            None
        }
    }
}

#[cfg(not(unix))]
fn hangup_signals() -> Hangups {
    None
}

#[cfg(unix)]
async fn next_hangup(h: &mut Hangups) {
    match h {
        Some(s) => {
            if s.recv().await.is_none() {
                std::future::pending::<()>().await;
            }
        }
        None => std::future::pending::<()>().await,
    }
}

#[cfg(not(unix))]
async fn next_hangup(_h: &mut Hangups) {
    std::future::pending::<()>().await
}

/// On each SIGHUP: the config file read again, the log filter and the
/// admin token applied; nothing else changes, and nothing stops.
async fn reload_on_hangup(
    mut hangups: Hangups,
    path: Option<std::path::PathBuf>,
    admin_on: bool,
    gateway: Arc<Gateway>,
    tokens: watch::Sender<Option<String>>,
    mut shutdown: crate::shutdown::Shutdown,
) {
    loop {
        tokio::select! {
            () = shutdown.fired() => return,
            () = next_hangup(&mut hangups) => {}
        }
        // First and whatever the config file holds: logrotate moved the
        // file and waits for nothing else.
        if let Some(access) = crate::access::global()
            && gateway.config.log.access_file.is_some()
        {
            access.reopen();
        }
        let Some(path) = &path else {
            tracing::info!("SIGHUP: no config file to reload");
            continue;
        };
        let new = match Config::load(path) {
            Ok(c) => c,
            Err(e) => {
                tracing::error!(error = %e, "SIGHUP: the config does not load; nothing reloaded");
                continue;
            }
        };
        for d in &new.deprecations {
            tracing::warn!("SIGHUP: {d}");
        }
        match crate::telemetry::reload(&new.log) {
            Ok(filter) => tracing::info!(filter, "SIGHUP: log filter reloaded"),
            Err(e) => tracing::error!(error = %e, "SIGHUP: log filter not reloaded"),
        }
        if let Some(access) = crate::access::global() {
            access.set_filtered_rate(new.log.access_filtered_rate);
        }
        match new.admin.token() {
            Ok(Some(token)) if admin_on => {
                tokens.send_replace(Some(token));
                tracing::info!("SIGHUP: admin token reloaded");
            }
            Ok(Some(_)) => tracing::warn!(
                "SIGHUP: an admin token is configured now, but the admin listener was off at \
                 start: restart to open it"
            ),
            Ok(None) if admin_on => tracing::warn!(
                "SIGHUP: no admin token configured now; the one in force stays (restart to \
                 close the admin listener)"
            ),
            Ok(None) => {}
            Err(e) => tracing::error!(error = %e, "SIGHUP: admin token not reloaded"),
        }
        let restart = needs_restart(&gateway.config, &new);
        if !restart.is_empty() {
            tracing::warn!(
                keys = %restart.join(", "),
                "SIGHUP: {} changed; that takes effect at the next restart (only log.level, \
                 log.access, log.access_filtered_rate and the admin token are reloaded)",
                restart.join(", ")
            );
        }
    }
}

/// The keys `new` changes that SIGHUP does not reload, named (never their
/// values) for the log.
fn needs_restart(old: &Config, new: &Config) -> Vec<String> {
    const RELOADED: [&str; 4] = [
        "log.level",
        "log.access",
        "log.access_filtered_rate",
        "admin.token_file",
    ];
    old.changed_keys(new)
        .into_iter()
        .filter(|k| !RELOADED.contains(&k.as_str()))
        .collect()
}

async fn bind(addr: std::net::SocketAddr) -> Result<TcpListener, ServeError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| ServeError::Bind { addr, source })
}

/// Serves `gateway` on `listener`. Start-up (database, migrations, filters)
/// runs in the background: until it finishes `/readyz` is 503 and lookups
/// are 503 with `Retry-After`. A permanent start-up error (a missing table)
/// stops the server and is returned. On `shutdown`, stops the gateway's
/// background tasks (cancelling a rebuild mid-scan), stops accepting and
/// gives in-flight requests and the pool's connections what is left of
/// `server.shutdown_timeout`: the whole shutdown is bounded by it.
pub async fn serve(
    gateway: Arc<Gateway>,
    listener: TcpListener,
    admin: Option<Admin>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    serve_with(gateway, listener, admin, shutdown, None).await
}

/// [`serve`], with the admin token replaced by each one `tokens` sends.
async fn serve_with(
    gateway: Arc<Gateway>,
    listener: TcpListener,
    admin: Option<Admin>,
    shutdown: impl Future<Output = ()> + Send,
    tokens: Option<watch::Receiver<Option<String>>>,
) -> Result<(), ServeError> {
    let deadline = gateway.config.server.shutdown_timeout;
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "listening");
    }
    let (stop_tx, stop_rx) = watch::channel(false);
    let cfg = gateway.config.server.clone();
    let mut server = tokio::spawn(accept_loop(
        listener,
        http::app(gateway.clone()),
        cfg.clone(),
        stop_rx.clone(),
        gateway.draining(),
        Listener {
            name: "public",
            traffic: Some(gateway.stats.traffic.clone()),
            max_connections: cfg.max_connections,
        },
    ));
    let metrics_token = gateway.config.admin.metrics_token()?;
    let admin_server = admin.map(|Admin { listener, token }| {
        if let Ok(addr) = listener.local_addr() {
            tracing::info!(%addr, "admin listening");
        }
        let token = Arc::new(http::admin::AdminToken::new(&token));
        if let Some(mut tokens) = tokens {
            let token = token.clone();
            tokio::spawn(async move {
                while tokens.changed().await.is_ok() {
                    if let Some(t) = tokens.borrow_and_update().as_deref() {
                        token.replace(t);
                    }
                }
            });
        }
        let app = http::admin::app_with(gateway.clone(), token, metrics_token.as_deref());
        tokio::spawn(accept_loop(
            listener,
            app,
            cfg.clone(),
            stop_rx.clone(),
            gateway.draining(),
            Listener {
                name: "admin",
                traffic: None,
                max_connections: operator_cap(&cfg),
            },
        ))
    });
    // `/metrics` alone, no token: an address only the scraper reaches.
    let metrics_server = match gateway.config.admin.metrics_listen {
        None => None,
        Some(addr) => {
            let listener = bind(addr).await?;
            tracing::info!(%addr, "metrics listening (GET /metrics, no token)");
            Some(tokio::spawn(accept_loop(
                listener,
                http::admin::metrics_app(gateway.clone()),
                cfg.clone(),
                stop_rx.clone(),
                gateway.draining(),
                Listener {
                    name: "metrics",
                    traffic: None,
                    max_connections: operator_cap(&cfg),
                },
            )))
        }
    };

    let mut starter = tokio::spawn({
        let gateway = gateway.clone();
        async move { gateway.start().await }
    });
    tokio::pin!(shutdown);
    let result = tokio::select! {
        started = &mut starter => match started {
            Ok(Ok(())) => {
                gateway.spawn_rebuilds();
                tokio::select! {
                    () = &mut shutdown => Ok(()),
                    served = &mut server => return served.map_err(ServeError::Join),
                }
            }
            Ok(Err(e)) => Err(ServeError::Start(e)),
            Err(e) => Err(ServeError::Join(e)),
        },
        () = &mut shutdown => {
            starter.abort();
            Ok(())
        }
    };

    tracing::info!(
        deadline_s = deadline.as_secs_f64(),
        "shutting down: finishing in-flight requests"
    );
    // One deadline for the whole sequence.
    let until = tokio::time::Instant::now() + deadline;
    // Beside the draining of requests: each task finishes its unit of work
    // (a rebuild mid-scan is cancelled, its query too, so nothing below
    // waits for a scan; an admin request waiting on one is answered at
    // once), and what is left at the deadline is aborted.
    let tasks = tokio::spawn({
        let gateway = gateway.clone();
        async move { gateway.shutdown(deadline).await }
    });
    let _ = stop_tx.send(true);
    match tokio::time::timeout_at(until, &mut server).await {
        Ok(served) => served?,
        Err(_) => {
            tracing::warn!("shutdown deadline passed; dropping the requests still in flight");
            server.abort();
        }
    }
    for mut a in admin_server.into_iter().chain(metrics_server) {
        if tokio::time::timeout_at(until, &mut a).await.is_err() {
            a.abort();
        }
    }
    if tokio::time::timeout_at(until, tasks).await.is_err() {
        tracing::warn!("shutdown deadline passed with background tasks still stopping");
    }
    // `close` waits for every connection to come back, and a load detached
    // from its client may still hold one: what is left of the deadline.
    if tokio::time::timeout_at(until, gateway.db.pool().close())
        .await
        .is_err()
    {
        tracing::warn!("shutdown deadline passed; closing the pool with connections still in use");
    }
    result
}

/// Accepts connections until `stop`, then waits for the open ones to finish
/// their requests. Built on hyper directly rather than `axum::serve` for the
/// limits a listener exposed to anyone needs:
/// - each connection is watched ([`conn`]): a first request within
///   `header_read_timeout` whatever the protocol, each later HTTP/1 head
///   within it too, closed after `idle_timeout` with no request in progress;
///   HTTP/2 PINGs a silent peer after `header_read_timeout` and closes the
///   connection if the PING is not answered within it either;
/// - at most `max_connections` open: at the cap the listener is not polled,
///   so new connections wait in the kernel's listen backlog (as HAProxy's
///   `maxconn` and nginx's `worker_connections` do) instead of being taken
///   and dropped: no descriptor is spent on them, no accept-and-close loop
///   spins under a flood, and a client that arrives while silent sockets
///   hold every slot is served as soon as they time out;
/// - a failing `accept` (out of descriptors, buffers) backs off, doubling
///   from 10 ms to 1 s, and is logged once per 10 s;
/// - header size and count limits, and `TCP_NODELAY`.
///
/// `name` tells the listeners apart in logs. Each listener has its own
/// cap, so a flood of the public address cannot lock the operator out of
/// the admin listener.
async fn accept_loop(
    listener: TcpListener,
    app: http::App,
    cfg: ServerConfig,
    stop: watch::Receiver<bool>,
    drain: watch::Receiver<bool>,
    Listener {
        name,
        traffic,
        max_connections,
    }: Listener,
) {
    let builder = Arc::new(http_builder(&cfg));
    let limits = conn::Limits {
        header_read: cfg.header_read_timeout,
        idle: cfg.idle_timeout,
    };
    // Validated to fit a u32, the unit of `acquire_many`.
    let cap = u32::try_from(max_connections.min(Semaphore::MAX_PERMITS)).unwrap_or(u32::MAX);
    let slots = Arc::new(Semaphore::new(cap as usize));
    let at_cap = LogThrottle::default();
    let failing = LogThrottle::default();
    let mut backoff = Backoff::default();
    let mut stop_rx = stop.clone();
    let stopped = async move {
        let _ = stop_rx.wait_for(|s| *s).await;
    };
    tokio::pin!(stopped);
    loop {
        let slot = match slots.clone().try_acquire_owned() {
            Ok(slot) => slot,
            Err(_) => {
                if let Some(not_logged) = at_cap.permit() {
                    tracing::warn!(
                        listener = name,
                        max_connections,
                        not_logged,
                        "connection cap reached (server.max_connections): new connections wait \
                         in the listen backlog (at most one such line per 10 s)"
                    );
                }
                tokio::select! {
                    slot = slots.clone().acquire_owned() => {
                        slot.expect("the semaphore is never closed")
                    }
                    () = &mut stopped => break,
                }
            }
        };
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = &mut stopped => break,
        };
        match accepted {
            Ok((stream, _)) => {
                backoff.reset();
                let _ = stream.set_nodelay(true);
                tokio::spawn(serve_connection(
                    stream,
                    app.clone(),
                    builder.clone(),
                    limits,
                    (drain.clone(), stop.clone()),
                    (slot, Open::new(traffic.clone())),
                ));
            }
            // The peer gave up between its handshake and our accept: nothing
            // is wrong on this side.
            Err(e) if is_connection_error(&e) => {}
            // Out of descriptors and the like: the pending connection stays
            // in the backlog, so retrying at once would fail again at once.
            // Back off, keep serving the open connections (whose deadlines
            // free descriptors), and say so once per interval, not per
            // failure.
            Err(e) => {
                let delay = backoff.next_delay();
                if let Some(not_logged) = failing.permit() {
                    tracing::warn!(
                        listener = name,
                        error = %e,
                        retry_in_s = delay.as_secs_f64(),
                        not_logged,
                        "accept failed; backing off (at most one such line per 10 s; \
                         not_logged counts the rest)"
                    );
                }
                tokio::select! {
                    () = tokio::time::sleep(delay) => {}
                    () = &mut stopped => break,
                }
            }
        }
    }
    drop(listener);
    // Every slot back means every connection has ended.
    let _ = slots.acquire_many(cap).await;
}

/// hyper's settings for both protocols.
fn http_builder(cfg: &ServerConfig) -> Builder<TokioExecutor> {
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        // Off: the watchdog times request heads. hyper's timer starts the
        // moment a kept-alive connection turns idle, so it would also cut
        // idle connections at `header_read_timeout`.
        .header_read_timeout(None)
        .max_buf_size(cfg.max_header_bytes);
    if cfg.max_headers != crate::config::DEFAULT_MAX_HEADERS {
        builder.http1().max_headers(cfg.max_headers);
    }
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_header_list_size(u32::try_from(cfg.max_header_bytes).unwrap_or(u32::MAX))
        // A peer silent for `header_read_timeout` is PINGed and must answer
        // within as long: a dead peer is found while a request is in
        // progress too, when no idle deadline runs.
        .keep_alive_interval(cfg.header_read_timeout)
        .keep_alive_timeout(cfg.header_read_timeout);
    builder
}

/// Which listener, for logs, and where its traffic is counted (the public
/// one's).
struct Listener {
    name: &'static str,
    traffic: Option<Arc<Traffic>>,
    /// Its connection cap: `server.max_connections` for the public
    /// listener, [`operator_cap`] for the admin and metrics listeners.
    max_connections: usize,
}

/// Connections the admin and the metrics listener each take at most: an
/// operator, a scraper and a status page need a handful, and a cap of
/// their own keeps a flood of the public address from locking them out.
/// Not `server.max_connections`: with it, the shipped defaults (10,000)
/// needed 20,080 descriptors with the admin listener on, past the 20,000
/// many hosts allow.
const OPERATOR_MAX_CONNECTIONS: usize = 256;

fn operator_cap(cfg: &ServerConfig) -> usize {
    cfg.max_connections.min(OPERATOR_MAX_CONNECTIONS)
}

/// One open connection, counted in `Traffic::connections` until dropped.
struct Open(Option<Arc<Traffic>>);

impl Open {
    fn new(traffic: Option<Arc<Traffic>>) -> Self {
        if let Some(t) = &traffic {
            t.connections.fetch_add(1, Ordering::Relaxed);
        }
        Self(traffic)
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        if let Some(t) = &self.0 {
            t.connections.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// Serves one connection under its watchdog; `slot` is its place under
/// `max_connections`, given back when the socket is closed.
async fn serve_connection(
    stream: TcpStream,
    app: http::App,
    builder: Arc<Builder<TokioExecutor>>,
    limits: conn::Limits,
    (drain, stop): (watch::Receiver<bool>, watch::Receiver<bool>),
    slot: (OwnedSemaphorePermit, Open),
) {
    let dog = conn::Watchdog::new(limits);
    let peer = stream.peer_addr().ok().map(|a| a.ip());
    let io = TokioIo::new(conn::Watched::new(stream, dog.clone()));
    let service = conn::Tracked::new(app, dog.clone(), peer);
    let connection = builder.serve_connection_with_upgrades(io, service);
    match conn::drive(connection, &dog, drain, stop).await {
        conn::Ended::Done(Ok(())) => {}
        conn::Ended::Done(Err(e)) => {
            // hyper answers a request head over the limits 431 itself and
            // ends the connection with this error.
            if let Some(t) = &slot.1.0
                && e.downcast_ref::<hyper::Error>()
                    .is_some_and(hyper::Error::is_parse_too_large)
            {
                t.header_too_large.fetch_add(1, Ordering::Relaxed);
            }
            tracing::debug!(error = %e, "connection closed with an error");
        }
        conn::Ended::Expired(why) => tracing::debug!(reason = %why, "connection closed"),
    }
}

/// Errors of one pending connection rather than of the listener.
fn is_connection_error(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::ConnectionRefused
            | std::io::ErrorKind::ConnectionAborted
            | std::io::ErrorKind::ConnectionReset
    )
}

/// The delay before retrying a failed `accept`: doubling from
/// [`Backoff::FIRST`] up to [`Backoff::MAX`], back to the start after a
/// success.
#[derive(Debug, Default)]
struct Backoff {
    next: Option<Duration>,
}

impl Backoff {
    const FIRST: Duration = Duration::from_millis(10);
    const MAX: Duration = Duration::from_secs(1);

    fn next_delay(&mut self) -> Duration {
        let delay = self.next.unwrap_or(Self::FIRST);
        self.next = Some((delay * 2).min(Self::MAX));
        delay
    }

    fn reset(&mut self) {
        self.next = None;
    }
}

/// Descriptors the process needs besides client connections: the
/// runtime, listeners, log output, the change feed.
const FD_RESERVE: u64 = 64;

/// Raises the soft `RLIMIT_NOFILE` to the hard limit (the soft default,
/// often 1024, is far below what a server needs; the hard limit is what the
/// operator allows), then warns, naming the keys, if `max_connections`, the
/// operator listeners' caps and the pool cannot fit in it: past the limit
/// `accept` fails (and so do new database connections) until descriptors
/// free up.
#[cfg(unix)]
fn check_descriptors(config: &Config, operator_listeners: u64) {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut limit = getrlimit(Resource::Nofile);
    if limit.current < limit.maximum {
        let raised = rustix::process::Rlimit {
            current: limit.maximum,
            maximum: limit.maximum,
        };
        match setrlimit(Resource::Nofile, raised) {
            Ok(()) => {
                tracing::info!(
                    from = ?limit.current,
                    to = ?limit.maximum,
                    "raised the file-descriptor limit (RLIMIT_NOFILE) to its hard limit"
                );
                limit = getrlimit(Resource::Nofile);
            }
            Err(e) => tracing::debug!(error = %e, "cannot raise RLIMIT_NOFILE"),
        }
    }
    let needed = descriptors_needed(config, operator_listeners);
    if let Some(soft) = limit.current
        && needed > soft
    {
        tracing::warn!(
            max_connections = config.server.max_connections,
            operator_listeners,
            pool_size = config.database.pool_size,
            needed,
            limit = soft,
            "server.max_connections, {OPERATOR_MAX_CONNECTIONS} for each operator listener, \
             database.pool_size and {FD_RESERVE} for the process need {needed} file descriptors, above the limit (RLIMIT_NOFILE) of \
             {soft}: the cap cannot be honoured, and once descriptors run out `accept` fails \
             until connections close. Raise the limit (ulimit -n, systemd LimitNOFILE=) or \
             lower server.max_connections"
        );
    }
}

#[cfg(not(unix))]
fn check_descriptors(_config: &Config, _operator_listeners: u64) {}

fn descriptors_needed(config: &Config, operator_listeners: u64) -> u64 {
    (config.server.max_connections as u64)
        .saturating_add((operator_cap(&config.server) as u64).saturating_mul(operator_listeners))
        .saturating_add(u64::from(config.database.pool_size))
        .saturating_add(FD_RESERVE)
}

/// Resolves on SIGINT or SIGTERM, saying which.
pub async fn shutdown_signal() -> Stop {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => Stop::Interrupt,
        () = term => Stop::Terminate,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accept_backoff_doubles_to_a_cap_and_restarts_after_a_success() {
        let mut b = Backoff::default();
        let delays: Vec<_> = (0..9).map(|_| b.next_delay().as_millis()).collect();
        assert_eq!(delays, [10, 20, 40, 80, 160, 320, 640, 1000, 1000]);
        b.reset();
        assert_eq!(b.next_delay(), Backoff::FIRST);
    }

    #[test]
    fn descriptors_needed_count_every_listener_and_the_pool() {
        let mut config = Config::default();
        config.server.max_connections = 1000;
        config.database.pool_size = 16;
        assert_eq!(descriptors_needed(&config, 0), 1000 + 16 + FD_RESERVE);
        assert_eq!(descriptors_needed(&config, 2), 1000 + 512 + 16 + FD_RESERVE);
        config.server.max_connections = 100;
        assert_eq!(descriptors_needed(&config, 2), 300 + 16 + FD_RESERVE);
    }

    /// The shipped configuration, admin and metrics listeners on, fits a
    /// descriptor limit of 20,000 (this machine's, and a common one), so
    /// it starts without the warning.
    #[test]
    fn the_shipped_defaults_fit_twenty_thousand_descriptors() {
        let text = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/config/bloomgate.toml"
        ))
        .unwrap();
        let config = Config::from_toml(&text).unwrap();
        assert!(
            descriptors_needed(&config, 2) <= 20_000,
            "{}",
            descriptors_needed(&config, 2)
        );
    }
}
