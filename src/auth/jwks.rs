//! JWK Sets (RFC 7517): parsing them into [`PublicKey`]s, and fetching one
//! from `auth.jwks_url` with the HTTP client hyper already brings (and the
//! rustls the database connections use, for `https`).
//!
//! A key the gateway cannot use (an encryption key, a symmetric `oct` key,
//! a curve or algorithm it does not verify, an RSA key under 2048 bits)
//! is skipped and named in the result, not an error for the whole set: a
//! provider may publish other keys beside the signing ones.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::rt::TokioIo;
use serde::Deserialize;

use super::jwt::{Alg, PublicKey};

/// Why a key set was not fetched or not read. Safe to log: no header and
/// no body is quoted, and the URL is not repeated (the caller names
/// `auth.jwks_url`).
#[derive(Debug, thiserror::Error)]
pub enum JwksError {
    #[error("no answer within {}s", FETCH_TIMEOUT.as_secs())]
    TimedOut,
    #[error("{0}")]
    Url(#[from] url::ParseError),
    #[error("no host")]
    NoHost,
    #[error("no port")]
    NoPort,
    #[error("connect: {0}")]
    Connect(#[source] std::io::Error),
    #[error("{0}")]
    Request(#[source] hyper::http::Error),
    #[error("no TLS configuration")]
    NoTls,
    #[error("{0:?} is not a server name")]
    ServerName(String),
    #[error("TLS: {0}")]
    Tls(#[source] std::io::Error),
    #[error("HTTP: {0}")]
    Http(#[from] hyper::Error),
    #[error("status {0}")]
    Status(hyper::StatusCode),
    /// Larger than [`MAX_BYTES`], or the body broke off.
    #[error("body: {0}")]
    Body(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error("not a JWK Set: {0}")]
    NotASet(#[from] serde_json::Error),
}

/// Most keys kept from one set.
pub const MAX_KEYS: usize = 64;
/// Largest key set document read.
pub const MAX_BYTES: usize = 1 << 20;
/// A fetch, connection to body, takes at most this long.
pub const FETCH_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Deserialize)]
struct Set {
    keys: Vec<serde_json::Value>,
}

#[derive(Deserialize)]
struct Jwk {
    kty: String,
    #[serde(default, rename = "use")]
    use_: Option<String>,
    #[serde(default)]
    key_ops: Option<Vec<String>>,
    #[serde(default)]
    alg: Option<String>,
    #[serde(default)]
    kid: Option<String>,
    #[serde(default)]
    crv: Option<String>,
    #[serde(default)]
    n: Option<String>,
    #[serde(default)]
    e: Option<String>,
    #[serde(default)]
    x: Option<String>,
    #[serde(default)]
    y: Option<String>,
}

fn b64(field: &str, v: Option<&String>) -> Result<Vec<u8>, String> {
    let v = v.ok_or_else(|| format!("no `{field}`"))?;
    URL_SAFE_NO_PAD
        .decode(v)
        .map_err(|_| format!("`{field}` is not base64url"))
}

fn key(v: serde_json::Value) -> Result<PublicKey, String> {
    let k: Jwk = serde_json::from_value(v).map_err(|e| format!("not a JWK: {e}"))?;
    if k.use_.as_deref().is_some_and(|u| u != "sig") {
        return Err("not a signing key (`use`)".into());
    }
    if k.key_ops
        .as_ref()
        .is_some_and(|ops| !ops.iter().any(|o| o == "verify"))
    {
        return Err("not a verification key (`key_ops`)".into());
    }
    let alg = match &k.alg {
        Some(a) => {
            Some(Alg::from_name(a).ok_or_else(|| format!("algorithm {a:?} is not accepted"))?)
        }
        None => None,
    };
    let kid = k.kid.clone();
    if kid.as_ref().is_some_and(|k| k.len() > 256) {
        return Err("`kid` is longer than 256 bytes".into());
    }
    match k.kty.as_str() {
        "RSA" => PublicKey::rsa(
            kid,
            alg.unwrap_or(Alg::RS256),
            &b64("n", k.n.as_ref())?,
            &b64("e", k.e.as_ref())?,
        ),
        "EC" => {
            let curve_alg = match k.crv.as_deref() {
                Some("P-256") => Alg::ES256,
                Some("P-384") => Alg::ES384,
                other => return Err(format!("curve {other:?} is not accepted")),
            };
            if alg.is_some_and(|a| a != curve_alg) {
                return Err("`alg` does not match the curve".into());
            }
            PublicKey::ec(
                kid,
                curve_alg,
                &b64("x", k.x.as_ref())?,
                &b64("y", k.y.as_ref())?,
            )
        }
        "OKP" => {
            if k.crv.as_deref() != Some("Ed25519") {
                return Err(format!("curve {:?} is not accepted", k.crv));
            }
            if alg.is_some_and(|a| a != Alg::EdDSA) {
                return Err("`alg` does not match the curve".into());
            }
            PublicKey::ed25519(kid, &b64("x", k.x.as_ref())?)
        }
        "oct" => Err("symmetric keys are taken from auth.jwt_secret only".into()),
        other => Err(format!("key type {other:?} is not accepted")),
    }
}

/// The usable keys of a JWK Set document, and why each other key was
/// skipped. An error when the document is not a key set at all.
pub fn parse(doc: &[u8]) -> Result<(Vec<PublicKey>, Vec<String>), JwksError> {
    let set: Set = serde_json::from_slice(doc)?;
    let mut keys = Vec::new();
    let mut skipped = Vec::new();
    for (i, v) in set.keys.into_iter().enumerate() {
        let kid = v
            .get("kid")
            .and_then(|k| k.as_str())
            .map(|k| format!(" ({k:.40})"))
            .unwrap_or_default();
        match key(v) {
            Ok(k) if keys.len() < MAX_KEYS => keys.push(k),
            Ok(_) => skipped.push(format!("key {i}{kid}: more than {MAX_KEYS} keys")),
            Err(why) => skipped.push(format!("key {i}{kid}: {why}")),
        }
    }
    Ok((keys, skipped))
}

/// The TLS client configuration for `https` key sets: the host's trusted
/// roots, on the `ring` provider.
pub fn tls_config() -> Result<Arc<rustls::ClientConfig>, String> {
    let mut roots = rustls::RootCertStore::empty();
    let native = rustls_native_certs::load_native_certs();
    for cert in native.certs {
        let _ = roots.add(cert);
    }
    if roots.is_empty() {
        return Err("no trusted root certificates found on this host".into());
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| e.to_string())?
    .with_root_certificates(roots)
    .with_no_client_auth();
    Ok(Arc::new(config))
}

/// GETs `url` (checked by `config::auth::check_jwks_url`) and returns its body: status 200,
/// at most [`MAX_BYTES`], within [`FETCH_TIMEOUT`]. Errors are safe to log
/// (no header or body is quoted).
pub async fn fetch(url: &str, tls: Option<&Arc<rustls::ClientConfig>>) -> Result<Bytes, JwksError> {
    tokio::time::timeout(FETCH_TIMEOUT, fetch_inner(url, tls))
        .await
        .map_err(|_| JwksError::TimedOut)?
}

async fn fetch_inner(
    url: &str,
    tls: Option<&Arc<rustls::ClientConfig>>,
) -> Result<Bytes, JwksError> {
    let parsed = url::Url::parse(url)?;
    let host = parsed.host_str().ok_or(JwksError::NoHost)?.to_string();
    let port = parsed.port_or_known_default().ok_or(JwksError::NoPort)?;
    let bare = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_string();
    let tcp = match bare.parse::<IpAddr>() {
        Ok(ip) => tokio::net::TcpStream::connect((ip, port)).await,
        Err(_) => tokio::net::TcpStream::connect((bare.as_str(), port)).await,
    }
    .map_err(JwksError::Connect)?;
    let _ = tcp.set_nodelay(true);
    let target = match parsed.query() {
        Some(q) => format!("{}?{q}", parsed.path()),
        None => parsed.path().to_string(),
    };
    let authority = match parsed.port() {
        Some(p) => format!("{host}:{p}"),
        None => host.clone(),
    };
    let req = hyper::Request::get(target)
        .header(hyper::header::HOST, authority)
        .header(
            hyper::header::ACCEPT,
            "application/jwk-set+json, application/json",
        )
        .header(
            hyper::header::USER_AGENT,
            concat!("bloomgate/", env!("CARGO_PKG_VERSION")),
        )
        .body(Empty::<Bytes>::new())
        .map_err(JwksError::Request)?;
    if parsed.scheme() == "https" {
        let tls = tls.ok_or(JwksError::NoTls)?;
        let name = rustls::pki_types::ServerName::try_from(bare.clone())
            .map_err(|_| JwksError::ServerName(bare.clone()))?;
        let stream = tokio_rustls::TlsConnector::from(tls.clone())
            .connect(name, tcp)
            .await
            .map_err(JwksError::Tls)?;
        exchange(TokioIo::new(stream), req).await
    } else {
        exchange(TokioIo::new(tcp), req).await
    }
}

/// One request on a connection of its own, and its body. The connection
/// is driven in this future, beside the request, not in a task of its
/// own: it ends with the exchange (the sender dropped once the body is
/// read ends it), and the fetch's timeout or the refresher's shutdown,
/// dropping this future, closes the socket with it.
async fn exchange<T>(io: TokioIo<T>, req: hyper::Request<Empty<Bytes>>) -> Result<Bytes, JwksError>
where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let (mut sender, conn) = hyper::client::conn::http1::handshake(io).await?;
    let body = async move {
        let resp = sender.send_request(req).await?;
        if resp.status() != hyper::StatusCode::OK {
            return Err(JwksError::Status(resp.status()));
        }
        let body = Limited::new(resp.into_body(), MAX_BYTES)
            .collect()
            .await
            .map_err(JwksError::Body)?;
        Ok(body.to_bytes())
    };
    // A connection that fails fails the request too: its error is the
    // request's to report.
    let (body, _) = tokio::join!(body, conn);
    body
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unusable_keys_are_skipped_and_named() {
        let x = URL_SAFE_NO_PAD.encode([7u8; 32]);
        let doc = serde_json::json!({"keys": [
            {"kty": "OKP", "crv": "Ed25519", "x": x, "kid": "ed"},
            {"kty": "oct", "k": "c2VjcmV0", "kid": "sym"},
            {"kty": "RSA", "n": URL_SAFE_NO_PAD.encode([1u8; 128]), "e": "AQAB", "kid": "small"},
            {"kty": "EC", "crv": "P-521", "x": x, "y": x, "kid": "p521"},
            {"kty": "OKP", "crv": "Ed25519", "x": x, "use": "enc"},
            {"kty": "EC", "crv": "P-256", "x": x, "y": x, "alg": "ES384"},
            "not an object"
        ]});
        let (keys, skipped) = parse(doc.to_string().as_bytes()).unwrap();
        assert_eq!(keys.len(), 1);
        assert_eq!(
            (keys[0].kid.as_deref(), keys[0].alg),
            (Some("ed"), Alg::EdDSA)
        );
        assert_eq!(skipped.len(), 6, "{skipped:?}");
        assert!(skipped.iter().any(|s| s.contains("2048")));
        assert!(parse(b"[]").is_err());
        assert!(parse(b"{\"keys\": 1}").is_err());
    }
}
