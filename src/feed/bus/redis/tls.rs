//! `rediss://`: the files of a TLS bus, read for every connection.
//!
//! redis-rs's rustls (`tokio-rustls-comp`), on the gateway's one TLS stack
//! (rustls, `ring`; see `Cargo.toml`). The server's certificate is checked
//! as the web does it: the chain against the roots, the URL's host (or IP
//! address) against its subject alternative names. The roots are
//! `bus.ca_file`'s certificates alone when it is set (libpq's rule for
//! `sslrootcert`), else the host's store. redis-rs reads the host's store on
//! every TLS connection even when `bus.ca_file` replaces it, and fails the
//! connection if that read reports an error (an `SSL_CERT_FILE` that does
//! not exist): such a failure is reported as one of the store. Nothing
//! turns the check off: `#insecure` is refused by the config, and redis-rs
//! is built without `tls-rustls-insecure`, so it could not honour it
//! anyway. The files are read again for every new connection, so a rotated
//! CA or client certificate is picked up without a restart; a file gone
//! bad makes the bus unreachable (the gateway follows the WAL itself), not
//! the gateway wrong.

use std::path::{Path, PathBuf};
use std::sync::Once;

use redis::{ClientTlsConfig, TlsCertificates};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use crate::feed::bus::BusError;

/// `bus.ca_file`, `bus.cert_file`, `bus.key_file`: the files of a
/// `rediss://` bus (see the module doc).
#[derive(Clone, Debug, Default)]
pub struct TlsFiles {
    pub ca_file: Option<PathBuf>,
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
}

impl TlsFiles {
    pub(super) fn is_empty(&self) -> bool {
        self.ca_file.is_none() && self.cert_file.is_none() && self.key_file.is_none()
    }

    /// The files read and checked, as redis-rs takes them. Errors name the
    /// key and the path, never what the files hold.
    pub(super) fn certificates(&self) -> Result<TlsCertificates, BusError> {
        let root_cert = match &self.ca_file {
            None => None,
            Some(path) => {
                let pem = read("bus.ca_file", path)?;
                certificates("bus.ca_file", path, &pem)?;
                Some(pem)
            }
        };
        let client_tls = match (&self.cert_file, &self.key_file) {
            (Some(cert), Some(key)) => {
                let client_cert = read("bus.cert_file", cert)?;
                certificates("bus.cert_file", cert, &client_cert)?;
                let client_key = read("bus.key_file", key)?;
                PrivateKeyDer::from_pem_slice(&client_key).map_err(|_| {
                    BusError(format!(
                        "bus.key_file {}: holds no PEM private key (PKCS#8, PKCS#1 or SEC1)",
                        key.display()
                    ))
                })?;
                Some(ClientTlsConfig {
                    client_cert,
                    client_key,
                })
            }
            (None, None) => None,
            _ => {
                return Err(BusError(
                    "bus.cert_file and bus.key_file go together".into(),
                ));
            }
        };
        Ok(TlsCertificates {
            client_tls,
            root_cert,
        })
    }
}

fn read(key: &str, path: &Path) -> Result<Vec<u8>, BusError> {
    std::fs::read(path).map_err(|e| BusError(format!("{key} {}: {e}", path.display())))
}

/// Checks that `pem` holds certificates and nothing else unreadable
/// (redis-rs would say only "Unable to parse", without the file).
fn certificates(key: &str, path: &Path, pem: &[u8]) -> Result<(), BusError> {
    let bad = |m: String| BusError(format!("{key} {}: {m}", path.display()));
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(format!("not PEM certificates: {e}")))?;
    if certs.is_empty() {
        return Err(bad("holds no certificate".into()));
    }
    Ok(())
}

/// redis-rs builds its rustls configuration on the process-default
/// provider (`ClientConfig::builder()`) and takes none of ours. Left to
/// itself, rustls installs the one its crate features name, and panics if
/// they name two (a dependency enabling aws-lc-rs one day). Installing
/// `ring`, the provider of every other TLS connection of the gateway,
/// makes that choice explicit and the same as theirs. A provider some
/// other code installed first would stay (none does in this gateway).
pub(super) fn install_ring_provider() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

/// The TLS layer's words when `e` comes from it: a certificate refused, a
/// handshake that failed, the host's certificate store unreadable. Safe to
/// show: rustls names the problem, never the URL.
pub(super) fn tls_problem(e: &redis::RedisError) -> Option<String> {
    type Shared = std::sync::Arc<dyn std::error::Error + Send + Sync>;
    // redis-rs keeps the cause as `Arc<dyn Error>`, whose `source()` skips
    // the cause itself, and `io::Error::source()` skips the error it
    // wraps (tokio-rustls wraps rustls' that way): each layer is opened
    // by hand.
    let mut next: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
    while let Some(s) = next {
        let s: &(dyn std::error::Error + 'static) = match s.downcast_ref::<Shared>() {
            Some(inner) => &**inner,
            None => s,
        };
        if let Some(t) = s.downcast_ref::<rustls::Error>() {
            return Some(format!("TLS: {t}"));
        }
        if let Some(t) = s.downcast_ref::<rustls_native_certs::Error>() {
            return Some(format!("TLS: reading the host's certificate store: {t}"));
        }
        if let Some(inner) = s
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
        {
            next = Some(inner);
            continue;
        }
        next = s.source();
    }
    None
}
