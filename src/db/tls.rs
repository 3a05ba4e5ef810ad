//! TLS to Postgres, driven by the connection URL's libpq parameters
//! (`sslmode`, `sslrootcert`, or `PGSSLMODE` / `PGSSLROOTCERT`), for every
//! connection the gateway makes: sqlx's (the pool, the replicas' pools, the
//! feeds' side connections) and the WAL feed's replication connection
//! ([`crate::feed::replication`]), which uses [`Tls::client_config`].
//!
//! One TLS stack: rustls with the `ring` provider, for sqlx and the
//! replication client alike.
//!
//! # Modes, as libpq has them
//! - `disable` (and `allow`, which sqlx treats the same): plaintext.
//! - `prefer` (the default): TLS if the server offers it, no certificate
//!   check; plaintext if it does not.
//! - `require`: TLS or nothing, no certificate check, **unless a root
//!   certificate is given** (`sslrootcert`): then it is `verify-ca`, as
//!   libpq does it for backward compatibility (sqlx documents that rule but
//!   does not apply it, so [`connect_options`] applies it to the pools).
//! - `verify-ca`: the server's chain must lead to a trusted root; the host
//!   name is not checked.
//! - `verify-full`: the chain, and the host name (or IP address) of the URL
//!   against the certificate's names.
//!
//! # Roots
//! The trusted roots are the host's certificate store plus the
//! `sslrootcert` file's certificates (that is how sqlx builds them: libpq
//! would trust the file's alone; the replication client trusts what the
//! pool trusts, so one URL never works for one and fails for the other).
//! The host's store, not a bundle compiled into the binary (webpki-roots):
//! a server product runs where an operator manages trust (a company CA
//! added to the image, a distrusted root removed by an OS update), and a
//! bundle frozen at build time would ignore both. Managed databases
//! (RDS, Cloud SQL, Azure) sign with their own CAs, which are in neither
//! set: they are given with `sslrootcert`.
//!
//! A Unix-socket connection never uses TLS.

use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::WebPkiSupportedAlgorithms;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::ParsedCertificate;
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};
use sqlx::ConnectOptions;
use sqlx::postgres::{PgConnectOptions, PgSslMode};

/// Where the extra trusted roots come from (`sslrootcert`).
#[derive(Clone, PartialEq, Eq)]
pub enum RootCert {
    File(PathBuf),
    /// PEM text (sqlx takes `PGSSLROOTCERT` holding a certificate inline).
    Pem(Vec<u8>),
}

impl std::fmt::Debug for RootCert {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RootCert::File(p) => write!(f, "{}", p.display()),
            RootCert::Pem(b) => write!(f, "<{} bytes of PEM>", b.len()),
        }
    }
}

/// How a connection is secured: the mode in effect (libpq's `require`
/// rule applied) and the extra roots.
#[derive(Clone, Debug)]
pub struct Tls {
    pub mode: PgSslMode,
    pub root_cert: Option<RootCert>,
}

impl Default for Tls {
    /// libpq's default: `prefer`, no root certificate.
    fn default() -> Self {
        Self {
            mode: PgSslMode::Prefer,
            root_cert: None,
        }
    }
}

/// A TLS set-up that cannot work; names the file, never a secret.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("sslrootcert {0:?}: {1}")]
    RootCert(RootCert, String),
    #[error("{0}")]
    Config(String),
}

impl Tls {
    /// The settings sqlx resolved into `opts` (the URL's `sslmode` and
    /// `sslrootcert` or their aliases, else `PGSSLMODE` and `PGSSLROOTCERT`),
    /// with libpq's `require` rule applied.
    pub fn from_options(opts: &PgConnectOptions) -> Self {
        let root_cert = root_cert_of(opts);
        let mode = match opts.get_ssl_mode() {
            PgSslMode::Require if root_cert.is_some() => PgSslMode::VerifyCa,
            m => m,
        };
        Self { mode, root_cert }
    }

    /// Whether the client asks the server for TLS (`SSLRequest`).
    pub fn requested(&self) -> bool {
        !matches!(self.mode, PgSslMode::Disable | PgSslMode::Allow)
    }

    /// Whether a server that refuses TLS is refused.
    pub fn required(&self) -> bool {
        matches!(
            self.mode,
            PgSslMode::Require | PgSslMode::VerifyCa | PgSslMode::VerifyFull
        )
    }

    /// Whether the server's certificate chain is checked.
    pub fn verifies(&self) -> bool {
        matches!(self.mode, PgSslMode::VerifyCa | PgSslMode::VerifyFull)
    }

    /// The mode's name as in a URL, for messages.
    pub fn mode_name(&self) -> &'static str {
        match self.mode {
            PgSslMode::Disable => "disable",
            PgSslMode::Allow => "allow",
            PgSslMode::Prefer => "prefer",
            PgSslMode::Require => "require",
            PgSslMode::VerifyCa => "verify-ca",
            PgSslMode::VerifyFull => "verify-full",
        }
    }

    /// The `sslrootcert` certificates (none without one). A file that
    /// cannot be read, or holds no certificate, is an error, as in libpq.
    pub fn extra_roots(&self) -> Result<Vec<CertificateDer<'static>>, TlsError> {
        let Some(rc) = &self.root_cert else {
            return Ok(Vec::new());
        };
        let bad = |m: String| TlsError::RootCert(rc.clone(), m);
        let pem = match rc {
            RootCert::File(p) => std::fs::read(p).map_err(|e| bad(e.to_string()))?,
            RootCert::Pem(b) => b.clone(),
        };
        let certs = CertificateDer::pem_slice_iter(&pem)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| bad(format!("not PEM certificates: {e}")))?;
        if certs.is_empty() {
            return Err(bad("holds no certificate".into()));
        }
        Ok(certs)
    }

    /// The rustls configuration for this mode, on the provider sqlx uses
    /// (`ring`). Reads the roots now: a rotated `sslrootcert` file is
    /// picked up by the next connection.
    pub fn client_config(&self) -> Result<Arc<ClientConfig>, TlsError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Config(e.to_string()))?;
        let algorithms = provider.signature_verification_algorithms;
        let config = match self.mode {
            PgSslMode::VerifyFull => builder
                .with_root_certificates(self.roots()?)
                .with_no_client_auth(),
            PgSslMode::VerifyCa => builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(Verifier {
                    roots: Some(Arc::new(self.roots()?)),
                    algorithms,
                }))
                .with_no_client_auth(),
            _ => builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(Verifier {
                    roots: None,
                    algorithms,
                }))
                .with_no_client_auth(),
        };
        Ok(Arc::new(config))
    }

    /// The host's roots and the `sslrootcert` ones (see the module doc).
    fn roots(&self) -> Result<RootCertStore, TlsError> {
        let mut store = RootCertStore::empty();
        let native = rustls_native_certs::load_native_certs();
        if !native.errors.is_empty() {
            tracing::debug!(
                errors = native.errors.len(),
                "some of the host's root certificates could not be read"
            );
        }
        // Unparseable host roots are skipped, as sqlx does.
        store.add_parsable_certificates(native.certs);
        if let Some(rc) = &self.root_cert {
            for cert in self.extra_roots()? {
                store
                    .add(cert)
                    .map_err(|e| TlsError::RootCert(rc.clone(), e.to_string()))?;
            }
        }
        Ok(store)
    }
}

/// The name a TLS client checks (`verify-full`) and sends (SNI) for `host`.
pub fn server_name(host: &str) -> Result<ServerName<'static>, TlsError> {
    // An IPv6 host arrives bracketed from a URL.
    let host = host.trim_start_matches('[').trim_end_matches(']');
    ServerName::try_from(host.to_owned()).map_err(|_| {
        TlsError::Config(format!(
            "host {host:?} is neither a DNS name nor an IP address"
        ))
    })
}

/// `sslrootcert` as sqlx resolved it into `opts`. sqlx has no getter for
/// it, but writes it into [`ConnectOptions::to_url_lossy`] (a path as
/// `file: <path>`, PEM as itself), which is read here. The URL is built on
/// a copy with a plain user and host, so its construction cannot fail
/// whatever the real ones are; the password it carries is dropped unread.
fn root_cert_of(opts: &PgConnectOptions) -> Option<RootCert> {
    let url = opts.clone().host("localhost").username("u").to_url_lossy();
    let (_, value) = url.query_pairs().find(|(k, _)| k == "sslrootcert")?;
    let value = value.into_owned();
    if value.trim_start().starts_with("-----BEGIN") {
        return Some(RootCert::Pem(value.into_bytes()));
    }
    let path = value.strip_prefix("file: ").unwrap_or(&value);
    Some(RootCert::File(PathBuf::from(path)))
}

/// The options of a pool on `url`, as sqlx parses them, with libpq's
/// `require` rule applied (see the module doc) and the `sslrootcert` file
/// checked now: a missing or empty file is a start-up error, not a
/// database that never becomes reachable.
pub fn connect_options(url: &str) -> Result<PgConnectOptions, sqlx::Error> {
    let opts = PgConnectOptions::from_str(url)?;
    let tls = Tls::from_options(&opts);
    if tls.verifies() {
        tls.extra_roots()
            .map_err(|e| sqlx::Error::Configuration(e.to_string().into()))?;
    }
    Ok(opts.ssl_mode(tls.mode))
}

/// `verify-ca` (chain checked against `roots`, the name not) or, without
/// roots, no certificate check (`prefer`, `require`). Either way the
/// handshake's signatures are verified: the server proves it holds the key
/// of the certificate it sent.
#[derive(Debug)]
struct Verifier {
    roots: Option<Arc<RootCertStore>>,
    algorithms: WebPkiSupportedAlgorithms,
}

impl ServerCertVerifier for Verifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        if let Some(roots) = &self.roots {
            // What `WebPkiServerVerifier` does, minus `verify_server_name`.
            let cert = ParsedCertificate::try_from(end_entity)?;
            rustls::client::verify_server_cert_signed_by_trust_anchor(
                &cert,
                roots,
                intermediates,
                now,
                self.algorithms.all,
            )?;
        }
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tls(url: &str) -> Tls {
        Tls::from_options(&PgConnectOptions::from_str(url).unwrap())
    }

    #[test]
    fn the_url_decides_mode_and_root_certificate() {
        let t = tls("postgres://u:pw@h/db?sslmode=verify-full&sslrootcert=/etc/ca%20bundle.pem");
        assert!(matches!(t.mode, PgSslMode::VerifyFull));
        assert_eq!(
            t.root_cert,
            Some(RootCert::File("/etc/ca bundle.pem".into()))
        );
        // sqlx's aliases.
        let t = tls("postgres://h/db?ssl-mode=verify-ca&ssl-root-cert=/ca.pem");
        assert!(matches!(t.mode, PgSslMode::VerifyCa));
        assert_eq!(t.root_cert, Some(RootCert::File("/ca.pem".into())));
        // Any user and host, even ones sqlx could not put back in a URL.
        let t = tls("postgres://h/db?host=::1&user=%5B%2F&sslmode=require");
        assert!(matches!(t.mode, PgSslMode::Require));
        assert!(t.required() && !t.verifies());
    }

    #[test]
    fn require_with_a_root_certificate_is_verify_ca_as_in_libpq() {
        let t = tls("postgres://h/db?sslmode=require&sslrootcert=/ca.pem");
        assert!(matches!(t.mode, PgSslMode::VerifyCa));
        // Not prefer: libpq's rule is for require only.
        let t = tls("postgres://h/db?sslmode=prefer&sslrootcert=/ca.pem");
        assert!(matches!(t.mode, PgSslMode::Prefer));
        assert!(t.requested() && !t.required());
        let t = tls("postgres://h/db?sslmode=disable&sslrootcert=/ca.pem");
        assert!(!t.requested());
    }

    #[test]
    fn a_missing_root_certificate_is_a_start_up_error_naming_the_file() {
        let e = connect_options(
            "postgres://u:secret@h/db?sslmode=verify-full&sslrootcert=/nonexistent/ca.pem",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("/nonexistent/ca.pem"), "{e}");
        assert!(!e.contains("secret"), "{e}");
        // Not checked where it is not used.
        connect_options("postgres://h/db?sslmode=prefer&sslrootcert=/nonexistent/ca.pem").unwrap();
        let opts = connect_options("postgres://h/db?sslmode=require").unwrap();
        assert!(matches!(opts.get_ssl_mode(), PgSslMode::Require));
    }

    #[test]
    fn server_names_take_dns_names_and_addresses() {
        assert!(server_name("db.example.com").is_ok());
        assert!(server_name("127.0.0.1").is_ok());
        assert!(server_name("[::1]").is_ok());
        assert!(server_name("not a host").is_err());
    }
}
