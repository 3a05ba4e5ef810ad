//! Connections to the primary the sentinels name (`bus.sentinels`).
//!
//! With `bus.sentinels`, every new connection asks the sentinels for the
//! primary named `bus.sentinel_master` (redis-rs checks that the server
//! says it is a master), so after a failover the next connection reaches
//! the new primary. A demoted primary refuses writes (`READONLY`), which
//! drops the connection like any error. The sentinels are asked in a
//! handle of their own, built for each connection (so a rotated TLS file
//! is read again), bounded by the connection timeout.
//!

use redis::sentinel::{SentinelClientBuilder, SentinelServerType};
use redis::{Client, ConnectionAddr, IntoConnectionInfo, TlsMode};

use super::{BusError, CONNECT_TIMEOUT, TlsFiles, failed};

/// `bus.sentinels` and `bus.sentinel_master`, as [`RedisBus::new`] takes them.
#[derive(Clone, Debug, Default)]
pub struct Sentinels {
    pub urls: Vec<String>,
    pub master: String,
}

pub(super) struct SentinelTarget {
    sentinels: Vec<ConnectionAddr>,
    /// The sentinels' own user and password (the same for all).
    user: Option<String>,
    password: Option<String>,
    master: String,
    /// `bus.url`'s user, password and database: the data nodes'.
    node: redis::RedisConnectionInfo,
}

impl SentinelTarget {
    pub(super) fn new(url: &str, sentinels: &Sentinels) -> Result<Self, BusError> {
        let node = url
            .into_connection_info()
            .map_err(|e| BusError(format!("bus.url: not a Redis URL ({})", e.category())))?
            .redis_settings()
            .clone();
        let mut addrs = Vec::new();
        let (mut user, mut password) = (None, None);
        for (i, s) in sentinels.urls.iter().enumerate() {
            let info = s.as_str().into_connection_info().map_err(|e| {
                BusError(format!(
                    "bus.sentinels: entry {} is not a Redis URL ({})",
                    i + 1,
                    e.category()
                ))
            })?;
            user = info.redis_settings().username().map(String::from);
            password = info.redis_settings().password().map(String::from);
            addrs.push(info.addr().clone());
        }
        Ok(Self {
            sentinels: addrs,
            user,
            password,
            master: sentinels.master.clone(),
            node,
        })
    }

    /// A client for the primary the sentinels name now, with `tls`'s
    /// certificates for both the sentinels and the primary.
    pub(super) async fn primary(&self, tls: Option<&TlsFiles>) -> Result<Client, BusError> {
        let mut b = SentinelClientBuilder::new(
            self.sentinels.clone(),
            &self.master,
            SentinelServerType::Master,
        )
        .map_err(failed)?
        .set_client_to_redis_db(self.node.db());
        if let Some(u) = self.node.username() {
            b = b.set_client_to_redis_username(u);
        }
        if let Some(p) = self.node.password() {
            b = b.set_client_to_redis_password(p);
        }
        if let Some(u) = &self.user {
            b = b.set_client_to_sentinel_username(u);
        }
        if let Some(p) = &self.password {
            b = b.set_client_to_sentinel_password(p);
        }
        if let Some(files) = tls {
            b = b
                .set_client_to_redis_tls_mode(TlsMode::Secure)
                .set_client_to_redis_certificates(files.certificates()?)
                .set_client_to_sentinel_certificates(files.certificates()?);
        }
        let mut sentinel = b.build().map_err(failed)?;
        let asked = tokio::time::timeout(CONNECT_TIMEOUT, sentinel.async_get_client()).await;
        let e = match asked {
            Ok(Ok(client)) => return Ok(client),
            Ok(Err(e)) => failed(e),
            Err(_) => BusError("Redis: timed out".into()),
        };
        // redis-rs asks the sentinels, then the primary they name (its
        // ROLE): an error of either reads alike. Asking a sentinel alone
        // tells which.
        let sentinels_answer = matches!(
            tokio::time::timeout(CONNECT_TIMEOUT, sentinel.async_get_sentinel_client()).await,
            Ok(Ok(_))
        );
        Err(BusError(if sentinels_answer {
            format!("the primary `{}` the sentinels name: {}", self.master, e.0)
        } else {
            format!(
                "the sentinels (asked for the primary `{}`): {}",
                self.master, e.0
            )
        }))
    }
}
