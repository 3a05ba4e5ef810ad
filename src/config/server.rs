//! `[server]`: the public listener and the limits every request and
//! connection is held to.

use std::net::SocketAddr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::KeyProblem;
use super::cidr::Cidr;
use super::cors::CorsConfig;

/// `server.max_headers` by default: hyper's `DEFAULT_MAX_HEADERS`, the size of
/// the header arrays it keeps inline. Left at it, hyper is not told a limit
/// at all and the 431 past 100 headers is its own.
pub const DEFAULT_MAX_HEADERS: usize = 100;

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// Address the public API listens on. Default `127.0.0.1:8080`.
    pub listen: SocketAddr,
    /// Whole-request deadline; past it the client gets 504. Default `5s`.
    #[serde(with = "crate::config::forms::duration")]
    pub request_timeout: Duration,
    /// Longest key accepted, in bytes after percent-decoding. Default 256.
    pub max_key_length: usize,
    /// Requests handled at once; past it requests are shed with 503. Row
    /// loads in flight are bounded by the same number, counted separately:
    /// a load whose clients went away keeps its slot until its query
    /// returns. Default 1024.
    pub max_concurrency: usize,
    /// How long shutdown waits for in-flight requests. Default `10s`.
    #[serde(with = "crate::config::forms::duration")]
    pub shutdown_timeout: Duration,
    /// On SIGTERM, how long `/readyz` answers 503 while requests are still
    /// served, before the listeners stop accepting: a load balancer or
    /// Kubernetes takes the gateway out of rotation first. Meanwhile every
    /// HTTP/1 answer says `Connection: close` and HTTP/2 connections get a
    /// GOAWAY, so pooled connections leave after an answer instead of
    /// meeting the close under a request. Then shutdown proceeds within
    /// `shutdown_timeout`. `0s` stops at once. Default `5s`.
    #[serde(with = "crate::config::forms::duration")]
    pub shutdown_drain: Duration,
    /// A new connection must have sent its first request (a complete
    /// HTTP/1 head or HTTP/2 HEADERS frame) within this time, whatever it
    /// sent before (nothing, half an HTTP/2 preface), and a later HTTP/1
    /// head must be complete this long after its first byte, or the
    /// connection is closed (silent sockets, slowloris). An HTTP/2 peer
    /// silent this long is PINGed and must answer within it. Default `10s`.
    #[serde(with = "crate::config::forms::duration")]
    pub header_read_timeout: Duration,
    /// Largest request head (request line and headers) accepted, in bytes;
    /// at least 8192. Larger: 431. Default 16384.
    pub max_header_bytes: usize,
    /// Most request headers accepted. More: 431. Default 100, hyper's own
    /// limit, which it parses into arrays on the stack; any other value
    /// makes hyper size and initialise them on every request (about 1,400
    /// instructions per request, docs/perf-log/2026-11-23-what-was-cut.md).
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
    #[serde(with = "crate::config::forms::duration")]
    pub idle_timeout: Duration,
    /// Open connections on the public listener (the admin and metrics
    /// listeners take at most 256 each, of their own). At the cap the
    /// listener stops accepting: new connections wait in the kernel's
    /// listen backlog and are served as slots free up. Must fit the
    /// file-descriptor limit (checked at start-up). Default 10000.
    pub max_connections: usize,
    /// What keeps `/readyz` at 503. `"local"` (the default): only what is
    /// this gateway's own: starting (filters loading, the feed not yet
    /// current once), shutting down, the key set at `auth.jwks_url`
    /// missing. What every gateway of a fleet shares (the database
    /// unreachable, the change feed or the bus unable to prove the filters
    /// current, a resync after a failover) is reported in the body
    /// (`"status": "degraded"`), in `bloomgate_degraded` and by the
    /// `BloomgateDegraded` alert, with a 200: such a gateway still answers
    /// correctly, from the database, and a probe that failed on every
    /// gateway at once would leave the load balancer nothing (Kubernetes'
    /// guidance: readiness checks what is local to the pod). `"strict"`:
    /// 503 whenever any resource's filter and cache are not vouched for,
    /// for a single gateway whose load balancer has somewhere else to go.
    pub readiness: ReadinessPolicy,
    /// The proxies in front (load balancers, ingresses) whose
    /// `forwarded_header` names the caller: networks (`10.0.0.0/8`) or
    /// addresses. A request from one of them is attributed, for rate
    /// limits and the access line (which keeps the connection's address
    /// too), to the first address in that header, read from the right,
    /// that is not itself trusted (`http::forwarded`); from any other
    /// address the header is ignored. Nothing else reads it. Default
    /// empty: every caller is the connection's address.
    #[serde(deserialize_with = "super::cidr::list")]
    pub trusted_proxies: Vec<Cidr>,
    /// The one header the trusted proxies write: `"x-forwarded-for"` or
    /// `"forwarded"` (RFC 7239, its `for=` parameters). Only that one is
    /// read, so a client cannot speak through the other. Default
    /// `"x-forwarded-for"`.
    pub forwarded_header: ForwardedHeader,
    /// Reads from web pages of other origins (CORS); see [`CorsConfig`].
    /// Default off.
    pub cors: CorsConfig,
}

/// `server.forwarded_header`.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
pub enum ForwardedHeader {
    #[default]
    #[serde(rename = "x-forwarded-for")]
    XForwardedFor,
    #[serde(rename = "forwarded")]
    Forwarded,
}

/// `server.readiness`.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ReadinessPolicy {
    #[default]
    Local,
    Strict,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            request_timeout: Duration::from_secs(5),
            max_key_length: 256,
            max_concurrency: 1024,
            shutdown_timeout: Duration::from_secs(10),
            shutdown_drain: Duration::from_secs(5),
            header_read_timeout: Duration::from_secs(10),
            max_header_bytes: 16 * 1024,
            max_headers: DEFAULT_MAX_HEADERS,
            max_body_bytes: 64 * 1024,
            idle_timeout: Duration::from_secs(75),
            max_connections: 10_000,
            readiness: ReadinessPolicy::Local,
            trusted_proxies: Vec::new(),
            forwarded_header: ForwardedHeader::XForwardedFor,
            cors: CorsConfig::default(),
        }
    }
}

impl ServerConfig {
    /// Every bound must let at least one request through.
    pub(super) fn validate(&self) -> Result<(), KeyProblem> {
        let bad = |key: &str, problem: &str| Err(KeyProblem::new(format!("server.{key}"), problem));
        if self.max_key_length == 0 {
            return bad("max_key_length", "must be at least 1");
        }
        if self.max_concurrency == 0 {
            return bad("max_concurrency", "must be at least 1");
        }
        if self.max_header_bytes < 8192 {
            return bad("max_header_bytes", "must be at least 8192");
        }
        if self.max_headers == 0 {
            return bad("max_headers", "must be at least 1");
        }
        if self.header_read_timeout.is_zero() {
            return bad("header_read_timeout", "must be above 0");
        }
        if self.idle_timeout.is_zero() {
            return bad("idle_timeout", "must be above 0");
        }
        if self.max_connections == 0 || u32::try_from(self.max_connections).is_err() {
            return Err(KeyProblem::new(
                "server.max_connections",
                format!("must be between 1 and {}", u32::MAX),
            ));
        }
        if self.request_timeout.is_zero() {
            return bad("request_timeout", "must be above 0");
        }
        self.cors.validate("server.cors")
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::config::Config;
    use crate::config::tests::{MINIMAL, err};

    #[test]
    fn connection_limits_have_defaults() {
        let c = Config::from_toml(MINIMAL).unwrap();
        assert_eq!(c.server.idle_timeout, Duration::from_secs(75));
        assert_eq!(c.server.max_connections, 10_000);
    }

    #[test]
    fn trusted_proxies_take_networks_as_a_list_or_as_text() {
        let c = Config::from_toml(&format!(
            "[server]\ntrusted_proxies = [\"10.0.0.0/8\", \"127.0.0.1\"]\nforwarded_header = \"forwarded\"\n{MINIMAL}"
        ))
        .unwrap();
        assert_eq!(c.server.trusted_proxies.len(), 2);
        assert_eq!(c.server.forwarded_header, super::ForwardedHeader::Forwarded);
        assert!(c.server.trusted_proxies[1].contains("127.0.0.1".parse().unwrap()));
        let c = Config::from_toml(MINIMAL).unwrap();
        assert!(c.server.trusted_proxies.is_empty());
        assert_eq!(
            c.server.forwarded_header,
            super::ForwardedHeader::XForwardedFor
        );
        // As an environment variable gives it: one text.
        let c = Config::from_toml(&format!(
            "[server]\ntrusted_proxies = \"10.0.0.0/8, 192.168.0.0/16\"\n{MINIMAL}"
        ))
        .unwrap();
        assert_eq!(c.server.trusted_proxies.len(), 2);
    }

    #[test]
    fn bad_values_are_refused_naming_the_key() {
        for (prefix, key) in [
            ("[server]\nmax_key_length = 0\n", "server.max_key_length"),
            ("[server]\nidle_timeout = \"0s\"\n", "server.idle_timeout"),
            ("[server]\nmax_connections = 0\n", "server.max_connections"),
            (
                "[server]\nmax_connections = 5000000000\n",
                "server.max_connections",
            ),
            (
                "[server]\ntrusted_proxies = [\"10.0.0.1/8\"]\n",
                "server.trusted_proxies",
            ),
            (
                "[server]\nforwarded_header = \"x-real-ip\"\n",
                "server.forwarded_header",
            ),
        ] {
            let e = err(&format!("{prefix}{MINIMAL}"));
            assert!(e.contains(key), "{prefix}: {e}");
        }
    }
}
