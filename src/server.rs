//! Running the gateway: bind, start up in the background while `/healthz`
//! already answers, schedule rebuilds, and shut down gracefully.

use std::future::Future;
use std::sync::Arc;

use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::config::{Config, ServerConfig};
use crate::gateway::{Gateway, StartError};
use crate::http;

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
}

/// The admin listener and its token, when one is configured.
pub struct Admin {
    pub listener: TcpListener,
    pub token: String,
}

/// Binds `server.listen` (and `admin.listen` when an admin token is set) and
/// serves until `shutdown` resolves.
pub async fn run(
    config: Config,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
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
    let gateway = Gateway::new(config)?;
    serve(gateway, listener, admin, shutdown).await
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
    ));
    let admin_server = admin.map(|Admin { listener, token }| {
        if let Ok(addr) = listener.local_addr() {
            tracing::info!(%addr, "admin listening");
        }
        let app = http::admin::app(gateway.clone(), &token);
        tokio::spawn(accept_loop(listener, app, cfg.clone(), stop_rx.clone()))
    });

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

    tracing::info!(deadline = ?deadline, "shutting down: finishing in-flight requests");
    // One deadline for the whole sequence. The gateway's tasks go first:
    // a rebuild mid-scan is cancelled (its query too, on the server), so
    // nothing below waits for a scan; an admin request waiting on one is
    // answered at once.
    let until = tokio::time::Instant::now() + deadline;
    gateway.stop();
    let _ = stop_tx.send(true);
    match tokio::time::timeout_at(until, &mut server).await {
        Ok(served) => served?,
        Err(_) => {
            tracing::warn!("shutdown deadline passed; dropping the requests still in flight");
            server.abort();
        }
    }
    if let Some(mut a) = admin_server
        && tokio::time::timeout_at(until, &mut a).await.is_err()
    {
        a.abort();
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
/// limits a public listener needs: a deadline for request headers (slow
/// clients cannot hold connections open), header size and count limits, and
/// `TCP_NODELAY`.
async fn accept_loop(
    listener: TcpListener,
    app: axum::Router,
    cfg: ServerConfig,
    mut stop: watch::Receiver<bool>,
) {
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(cfg.header_read_timeout)
        .max_buf_size(cfg.max_header_bytes)
        .max_headers(cfg.max_headers);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_header_list_size(u32::try_from(cfg.max_header_bytes).unwrap_or(u32::MAX));
    let graceful = GracefulShutdown::new();
    let stopped = async move {
        let _ = stop.wait_for(|s| *s).await;
    };
    tokio::pin!(stopped);
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    let _ = stream.set_nodelay(true);
                    let service = TowerToHyperService::new(app.clone());
                    let conn = builder
                        .serve_connection_with_upgrades(TokioIo::new(stream), service)
                        .into_owned();
                    let conn = graceful.watch(conn);
                    tokio::spawn(async move {
                        if let Err(e) = conn.await {
                            tracing::debug!(error = %e, "connection closed with an error");
                        }
                    });
                }
                Err(e) => {
                    // Out of file descriptors and the like: back off rather
                    // than spin, and keep serving the open connections.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            () = &mut stopped => break,
        }
    }
    drop(listener);
    graceful.shutdown().await;
}

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
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
        () = ctrl_c => {},
        () = term => {},
    }
}
