//! Running the gateway: bind, start up in the background while `/healthz`
//! already answers, schedule rebuilds, and shut down gracefully. Every
//! connection on either listener is bounded in time and number (see
//! the `accept` and `conn` modules).
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
//!   rotation), then the listeners stop (what their listen queues hold is
//!   still taken and answered: see `accept`) and shutdown proceeds within
//!   `server.shutdown_timeout`; the access lines of every request answered
//!   are written before [`run`] returns. SIGINT (Ctrl-C) skips the drain.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::auth::key_files::KeyFiles;
use crate::config::Config;
use crate::gateway::{Gateway, StartError};
use crate::http;
use accept::{Listener, accept_loop, operator_cap};
use descriptors::check_descriptors;
use reload::{hangup_signals, reload_on_hangup};

mod accept;
mod conn;
mod descriptors;
mod reload;

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
    // Fires on drop too: a serve future dropped mid-way (or returning
    // early) stops its listeners as a clean shutdown does.
    let stop = crate::shutdown::FiresOnDrop::new();
    let cfg = gateway.config.server.clone();
    let mut server = tokio::spawn(accept_loop(
        listener,
        http::app(gateway.clone()),
        cfg.clone(),
        stop.signal(),
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
            let mut stop = stop.signal();
            tokio::spawn(async move {
                loop {
                    tokio::select! {
                        changed = tokens.changed() => if changed.is_err() { return },
                        () = stop.fired() => return,
                    }
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
            stop.signal(),
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
                stop.signal(),
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
    stop.fire();
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
