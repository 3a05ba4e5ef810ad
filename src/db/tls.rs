//! TLS to Postgres, driven by the connection URL's libpq parameters
//! (`sslmode`, `sslrootcert`, or `PGSSLMODE` / `PGSSLROOTCERT`), for every
//! connection the gateway makes: sqlx's (the pool, the replicas' pools, the
//! feeds' side connections) and the WAL feed's replication connection,
//! whose `SSLRequest` and handshake [`negotiate`] carries out.
//!
//! One TLS stack: rustls with the `ring` provider, for sqlx and the
//! replication client alike.
//!
//! # Modes, as libpq has them
//! - `disable`: plaintext. `allow` is `disable` here (libpq would retry
//!   with TLS after a refusal; sqlx and the replication client never ask).
//! - `prefer` (the default): TLS if the server offers it, no certificate
//!   check; plaintext if it answers that it does not. A handshake that
//!   fails is an error (libpq would retry in plaintext).
//! - `require`: TLS or nothing, no certificate check, **unless a root
//!   certificate is given** (`sslrootcert`): then it is `verify-ca`, as
//!   libpq does it for backward compatibility (sqlx documents that rule but
//!   does not apply it, so [`connect_options`] applies it to the pools).
//! - `verify-ca`: the server's chain must lead to an `sslrootcert` root;
//!   the host name is not checked (the replication client). **The pools
//!   check it anyway** with sqlx 0.8.6: its verifier lets only
//!   `CertificateError::NotValidForName` through, while rustls 0.23 reports
//!   `NotValidForNameContext` (sqlx issue #3793, fixed after 0.8.6). So a
//!   certificate that does not name the URL's host fails the pool under
//!   `verify-ca` too, and the gateway, which needs both, does not start.
//!   The stricter direction; it ends when sqlx is upgraded.
//! - `verify-full`: the chain, and the host name (or IP address) of the URL
//!   against the certificate's subject alternative names (rustls never
//!   falls back to the common name).
//!
//! # Roots
//! libpq's rule: under `verify-ca` and `verify-full` (and `require` with a
//! root certificate) the trusted roots are the `sslrootcert` certificates
//! and nothing else; the host's store never is, or any publicly trusted
//! certificate would pass `verify-ca`. Those modes without `sslrootcert`
//! are a start-up error (libpq fails too without its default
//! `~/.postgresql/root.crt`, which is not read here: the file is named).
//! `sslrootcert=system` (PostgreSQL 16: the host's store) is not supported
//! and is refused, not read as a file named `system`.
//!
//! The replication client follows the rule exactly. sqlx 0.8.6 cannot:
//! every rustls feature of it puts a root set under `sslrootcert` (the
//! Mozilla bundle compiled in with `tls-rustls-ring-webpki` and
//! `tls-rustls-aws-lc-rs`, the host's store with
//! `tls-rustls-ring-native-roots`, which native-tls does too), and it has
//! no hook for a client configuration of ours. The host's store is the
//! least bad: unlike a compiled bundle it can be emptied without a rebuild,
//! as `rustls-native-certs` reads `SSL_CERT_FILE` / `SSL_CERT_DIR` instead
//! of the system paths when they are set. Under `verify-ca`,
//! [`connect_options`] warns when the pool would trust a root that
//! `sslrootcert` does not hold; set
//! `SSL_CERT_FILE` to the `sslrootcert` file and the pool's roots are
//! exactly libpq's. (Under `verify-full`, the only mode that stops a man in
//! the middle, a stray root still needs a certificate for the URL's own
//! host name.)
//!
//! A Unix-socket connection never uses TLS (PostgreSQL refuses TLS there):
//! [`connect_options`] sets `disable` for one, whatever the URL or
//! `PGSSLMODE` say.

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
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Where the trusted roots come from (`sslrootcert`).
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
/// rule applied) and the roots.
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
    #[error(
        "sslmode={0} needs sslrootcert, the CA certificate file to trust \
         (in the URL, e.g. database.url's `?sslrootcert=/path/ca.pem`, or \
         PGSSLROOTCERT): the host's certificate store is not used in its place, as in libpq"
    )]
    NoRootCert(&'static str),
    #[error(
        "sslrootcert=system (PostgreSQL 16's host certificate store) is not \
         supported: set sslrootcert to the CA certificate file"
    )]
    SystemRoots,
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

    /// The `sslrootcert` certificates, the only roots trusted. None given,
    /// `system`, a file that cannot be read or one that holds no
    /// certificate is an error, as in libpq.
    pub fn root_certs(&self) -> Result<Vec<CertificateDer<'static>>, TlsError> {
        let Some(rc) = &self.root_cert else {
            return Err(TlsError::NoRootCert(self.mode_name()));
        };
        if *rc == RootCert::File("system".into()) {
            return Err(TlsError::SystemRoots);
        }
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

    /// Whether the set-up can work: under the modes that check the chain,
    /// the `sslrootcert` certificates can be read (see the module doc).
    pub fn check(&self) -> Result<(), TlsError> {
        if self.verifies() {
            self.roots()?;
        }
        Ok(())
    }

    /// The trusted roots: the `sslrootcert` certificates, nothing else
    /// (see the module doc).
    pub fn roots(&self) -> Result<RootCertStore, TlsError> {
        let mut store = RootCertStore::empty();
        for cert in self.root_certs()? {
            store.add(cert).map_err(|e| {
                TlsError::RootCert(self.root_cert.clone().expect("read"), e.to_string())
            })?;
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

/// Whether `opts` reach the server over a Unix socket: a `host` (or
/// `PGHOST`) that is a directory, as sqlx and libpq read it.
pub fn over_socket(opts: &PgConnectOptions) -> bool {
    opts.get_socket().is_some() || opts.get_host().starts_with('/')
}

/// The options of a pool on `url`, as sqlx parses them, with libpq's
/// `require` rule applied (see the module doc) and the `sslrootcert` file
/// checked now: a missing, empty or absent one where the mode needs it is
/// a start-up error, not a database that never becomes reachable. Over a
/// Unix socket, `disable`: sqlx would ask for TLS there too, and the
/// server's refusal would fail `require` and above.
pub fn connect_options(url: &str) -> Result<PgConnectOptions, sqlx::Error> {
    use sqlx::ConnectOptions;
    // sqlx logs every statement (and, from `warn`, every one slower than
    // a second: each rebuild's scan) with its SQL text: no SQL in logs.
    secured(url).map(|o| o.disable_statement_logging())
}

fn secured(url: &str) -> Result<PgConnectOptions, sqlx::Error> {
    let opts = PgConnectOptions::from_str(url)?;
    if over_socket(&opts) {
        return Ok(opts.ssl_mode(PgSslMode::Disable));
    }
    let tls = Tls::from_options(&opts);
    let config = |e: TlsError| sqlx::Error::Configuration(e.to_string().into());
    if tls.verifies() {
        let roots = tls.root_certs().map_err(config)?;
        tls.roots().map_err(config)?;
        // Under verify-full a root from the host's store must still have
        // signed a certificate naming the server: the web's rule, no
        // warning. Under verify-ca it could vouch for any name.
        if matches!(tls.mode, PgSslMode::VerifyCa) {
            warn_of_the_pools_extra_roots(&tls, &roots);
        }
    }
    Ok(opts.ssl_mode(tls.mode))
}

/// sqlx 0.8.6 trusts the host's store besides `roots` (see the module
/// doc): says so when that store holds a certificate `roots` do not.
fn warn_of_the_pools_extra_roots(tls: &Tls, roots: &[CertificateDer<'static>]) {
    let host = rustls_native_certs::load_native_certs();
    let extra = host.certs.iter().filter(|c| !roots.contains(c)).count();
    if extra > 0 {
        tracing::warn!(
            sslmode = tls.mode_name(),
            sslrootcert = ?tls.root_cert,
            extra_roots = extra,
            "the pool (sqlx 0.8.6) trusts the host's certificate store as well as \
             sslrootcert; set SSL_CERT_FILE to the sslrootcert file to trust that \
             file only, as libpq and the replication connection do"
        );
    }
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

/// A byte stream a PostgreSQL connection runs over: a socket, or TLS on one.
pub trait Transport: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Transport for T {}

/// Why [`negotiate`] failed. Names the mode, the certificate problem or
/// the `sslrootcert` file, never the URL.
#[derive(Debug)]
pub enum NegotiateError {
    Io(std::io::Error),
    /// TLS was required and refused, the handshake failed (a certificate
    /// the mode does not accept, among others), or the TLS set-up cannot
    /// work (an unreadable `sslrootcert`).
    Tls(String),
    /// The answer to `SSLRequest` was neither `S` nor `N`.
    Protocol(String),
}

impl std::fmt::Display for NegotiateError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NegotiateError::Io(e) => write!(f, "{e}"),
            NegotiateError::Tls(m) | NegotiateError::Protocol(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for NegotiateError {}

impl From<std::io::Error> for NegotiateError {
    fn from(e: std::io::Error) -> Self {
        NegotiateError::Io(e)
    }
}

/// `SSLRequest`: length 8, then the code 1234 5679 (80877103).
const SSL_REQUEST: [u8; 8] = [0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f];

/// Asks the PostgreSQL server on `s` for TLS when `tls` says so (the
/// replication client does; sqlx negotiates its own), and acts on its
/// one-byte answer: `S`, the handshake (the certificate checked as the
/// mode says, against `host`); `N`, plaintext under `prefer` and an error
/// otherwise; anything else, a protocol error.
pub async fn negotiate<S>(
    mut s: S,
    host: &str,
    tls: &Tls,
) -> Result<Box<dyn Transport>, NegotiateError>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    if !tls.requested() {
        return Ok(Box::new(s));
    }
    // Set up before anything is sent: a bad sslrootcert fails here.
    let config = match tls.client_config() {
        Ok(c) => c,
        Err(e) => return Err(NegotiateError::Tls(e.to_string())),
    };
    s.write_all(&SSL_REQUEST).await?;
    let mut reply = [0u8; 1];
    s.read_exact(&mut reply).await?;
    match reply[0] {
        b'S' => {
            let name = server_name(host).map_err(|e| NegotiateError::Tls(e.to_string()))?;
            // Exactly one byte was read, nothing buffered: whatever the
            // server (or a man in the middle) sent after the `S` goes to
            // the handshake, which fails on it (CVE-2021-23222).
            let stream = tokio_rustls::TlsConnector::from(config)
                .connect(name, s)
                .await
                .map_err(tls_failure)?;
            Ok(Box::new(stream))
        }
        b'N' if tls.required() => Err(NegotiateError::Tls(format!(
            "the server does not accept TLS, and sslmode={} requires it",
            tls.mode_name()
        ))),
        b'N' => Ok(Box::new(s)),
        other => Err(NegotiateError::Protocol(format!(
            "unexpected reply 0x{other:02x} to the TLS request"
        ))),
    }
}

/// A failed handshake: rustls' reason (a certificate problem reads
/// "invalid peer certificate: …"), or the socket's error.
fn tls_failure(e: std::io::Error) -> NegotiateError {
    match e.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>()) {
        Some(r) => NegotiateError::Tls(format!("handshake failed: {r}")),
        None => NegotiateError::Io(e),
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

    // The unit CA of the negotiation tests below (a test certificate).
    const CA: &str = include_str!("../../tests/data/tls/unit-ca.pem");

    /// `CA` in a file of this test's own.
    fn ca_file(name: &str) -> PathBuf {
        let p = std::env::temp_dir().join(format!(
            "bloomgate-tls-unit-{}-{name}.pem",
            std::process::id()
        ));
        std::fs::write(&p, CA).unwrap();
        p
    }

    /// The store a client that trusts `CA` alone has.
    fn ca_only() -> RootCertStore {
        let mut store = RootCertStore::empty();
        store
            .add(CertificateDer::from_pem_slice(CA.as_bytes()).unwrap())
            .unwrap();
        store
    }

    #[test]
    fn the_trusted_roots_are_the_sslrootcert_certificates_and_nothing_else() {
        // Not the host's store (where a public CA would make any publicly
        // trusted certificate pass verify-ca): exactly the file's.
        let file = ca_file("only");
        for mode in ["verify-ca", "verify-full", "require"] {
            let t = tls(&format!(
                "postgres://h/db?sslmode={mode}&sslrootcert={}",
                file.display()
            ));
            assert!(t.verifies(), "{mode}");
            let roots = t.roots().unwrap();
            assert_eq!(roots.roots, ca_only().roots, "{mode}");
            // The pool's options are built from the same file.
            connect_options(&format!(
                "postgres://h/db?sslmode={mode}&sslrootcert={}",
                file.display()
            ))
            .unwrap();
        }
        std::fs::remove_file(file).unwrap();
    }

    #[test]
    fn verify_modes_without_sslrootcert_are_refused_at_start_up() {
        for mode in ["verify-ca", "verify-full"] {
            let e = connect_options(&format!("postgres://u:secret@h/db?sslmode={mode}"))
                .unwrap_err()
                .to_string();
            assert!(e.contains("sslrootcert"), "{e}");
            assert!(e.contains(&format!("sslmode={mode}")), "{e}");
            assert!(!e.contains("secret"), "{e}");
            // The replication client's configuration, likewise.
            let e = tls(&format!("postgres://h/db?sslmode={mode}"))
                .client_config()
                .unwrap_err()
                .to_string();
            assert!(e.contains("sslrootcert"), "{e}");
        }
        // PostgreSQL 16's `system` is refused, not read as a file.
        for mode in ["verify-ca", "verify-full", "require"] {
            let e = connect_options(&format!(
                "postgres://h/db?sslmode={mode}&sslrootcert=system"
            ))
            .unwrap_err()
            .to_string();
            assert!(
                e.contains("sslrootcert=system") && e.contains("not supported"),
                "{e}"
            );
        }
        // A URL's sslrootcert is a file name, as sqlx reads it (PEM text
        // only from PGSSLROOTCERT, see the environment test).
        let e = connect_options(
            "postgres://h/db?sslmode=verify-ca&sslrootcert=-----BEGIN%20CERTIFICATE-----",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("No such file"), "{e}");
        // Modes that check nothing need none.
        for mode in ["disable", "allow", "prefer", "require"] {
            connect_options(&format!("postgres://h/db?sslmode={mode}")).unwrap();
        }
    }

    #[test]
    fn unix_sockets_never_use_tls() {
        for url in [
            "postgres:///db?host=/var/run/postgresql&sslmode=verify-full",
            "postgres://%2Fvar%2Frun%2Fpostgresql/db?sslmode=require",
            "postgres://u@localhost/db?host=/tmp&sslmode=verify-ca&sslrootcert=/nonexistent.pem",
        ] {
            let opts = connect_options(url).unwrap();
            assert!(over_socket(&opts), "{url}");
            assert!(matches!(opts.get_ssl_mode(), PgSslMode::Disable), "{url}");
        }
        let opts = connect_options("postgres://localhost/db?sslmode=require").unwrap();
        assert!(!over_socket(&opts));
        assert!(matches!(opts.get_ssl_mode(), PgSslMode::Require));
    }

    /// Set by [`pgsslmode_and_pgsslrootcert_come_from_the_environment`] in
    /// the child it runs; the child test does nothing without it.
    const CHILD: &str = "BLOOMGATE_TLS_ENV_CHILD";

    #[test]
    fn pgsslmode_and_pgsslrootcert_come_from_the_environment() {
        // In a child process of this test binary: setting variables here
        // would race the tests that run alongside. PGSSLROOTCERT a file,
        // then the PEM itself (which sqlx takes there, not in a URL).
        let file = ca_file("env");
        for root_cert in [file.as_os_str(), CA.as_ref()] {
            let out = std::process::Command::new(std::env::current_exe().unwrap())
                .args([
                    "--exact",
                    "db::tls::tests::environment_child",
                    "--test-threads=1",
                ])
                .env(CHILD, "1")
                .env("PGSSLMODE", "require")
                .env("PGSSLROOTCERT", root_cert)
                .env("PGHOST", "/run/bloomgate-test-socket")
                .env_remove("PGHOSTADDR")
                .output()
                .unwrap();
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success() && stdout.contains("1 passed"),
                "{stdout}\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::fs::remove_file(file).unwrap();
    }

    #[test]
    fn environment_child() {
        if std::env::var_os(CHILD).is_none() {
            return;
        }
        let root_cert = std::env::var("PGSSLROOTCERT").unwrap();
        let expected = if root_cert.starts_with("-----BEGIN") {
            RootCert::Pem(CA.as_bytes().to_vec())
        } else {
            RootCert::File(root_cert.into())
        };
        // PGSSLMODE=require with PGSSLROOTCERT: verify-ca, libpq's rule.
        let t = tls("postgres://h/db");
        assert!(matches!(t.mode, PgSslMode::VerifyCa), "{t:?}");
        assert_eq!(t.root_cert, Some(expected));
        assert_eq!(t.roots().unwrap().roots, ca_only().roots);
        let opts = connect_options("postgres://h/db").unwrap();
        assert!(matches!(opts.get_ssl_mode(), PgSslMode::VerifyCa));
        // The URL wins over the environment.
        let t = tls("postgres://h/db?sslmode=verify-full&sslrootcert=/other.pem");
        assert!(matches!(t.mode, PgSslMode::VerifyFull));
        assert_eq!(t.root_cert, Some(RootCert::File("/other.pem".into())));
        assert!(!tls("postgres://h/db?sslmode=disable").requested());
        // PGHOST a directory: a Unix socket, never TLS, whatever PGSSLMODE says.
        let opts = connect_options("postgres:").unwrap();
        assert_eq!(opts.get_host(), "/run/bloomgate-test-socket");
        assert!(opts.get_socket().is_none() && over_socket(&opts));
        assert!(matches!(opts.get_ssl_mode(), PgSslMode::Disable));
    }

    #[test]
    fn server_names_take_dns_names_and_addresses() {
        assert!(server_name("db.example.com").is_ok());
        assert!(server_name("127.0.0.1").is_ok());
        assert!(server_name("[::1]").is_ok());
        assert!(server_name("not a host").is_err());
    }

    mod negotiation {
        use std::future::Future;
        use std::time::Duration;

        use tokio::io::{AsyncReadExt, AsyncWriteExt};

        use super::*;

        // TLS negotiation over an in-memory stream. The certificates were
        // made once with the openssl CLI, valid 2000-2100: a CA, a server
        // certificate it signed for DNS:localhost, and a second CA that signed
        // nothing. The key is a test key and protects nothing.
        const CA: &str = include_str!("../../tests/data/tls/unit-ca.pem");
        const OTHER_CA: &str = include_str!("../../tests/data/tls/unit-other-ca.pem");
        const SERVER_CERT: &str = include_str!("../../tests/data/tls/localhost.pem");
        const SERVER_KEY: &str = include_str!("../../tests/data/tls/localhost.key");

        use tokio::io::DuplexStream;

        fn tls_of(mode: PgSslMode, ca: Option<&str>) -> Tls {
            Tls {
                mode,
                root_cert: ca.map(|c| RootCert::Pem(c.as_bytes().to_vec())),
            }
        }

        /// Every exchange here is bounded: a failure must not hang the suite.
        async fn bounded<T>(f: impl Future<Output = T>) -> T {
            tokio::time::timeout(Duration::from_secs(20), f)
                .await
                .expect("the exchange hung")
        }

        /// A server end that expects the SSLRequest and answers `reply`.
        async fn answers(server: &mut DuplexStream, reply: &[u8]) {
            let mut req = [0u8; 8];
            server.read_exact(&mut req).await.unwrap();
            assert_eq!(req, SSL_REQUEST, "an SSLRequest first");
            server.write_all(reply).await.unwrap();
        }

        /// [`negotiate`]s `tls` against a server that answers `reply` and then
        /// does `then` with its end; returns the client's outcome.
        async fn exchange<F, Fut>(
            tls: Tls,
            host: &str,
            reply: &'static [u8],
            then: F,
        ) -> Result<Box<dyn Transport>, NegotiateError>
        where
            F: FnOnce(DuplexStream) -> Fut + Send + 'static,
            Fut: Future<Output = ()> + Send,
        {
            let (client, mut server) = tokio::io::duplex(64 * 1024);
            let server = tokio::spawn(async move {
                answers(&mut server, reply).await;
                then(server).await;
            });
            let r = bounded(negotiate(client, host, &tls)).await;
            if r.is_err() {
                server.abort();
            }
            r
        }

        /// Whether bytes written through the client end arrive at `server`.
        async fn passes(mut client: Box<dyn Transport>, server: tokio::task::JoinHandle<Vec<u8>>) {
            client.write_all(b"ping").await.unwrap();
            client.flush().await.unwrap();
            assert_eq!(bounded(server).await.unwrap(), b"ping");
        }

        #[tokio::test]
        async fn disable_sends_nothing_before_the_start_up() {
            let (client, mut server) = tokio::io::duplex(1024);
            let c = bounded(negotiate(
                client,
                "localhost",
                &tls_of(PgSslMode::Disable, Some(CA)),
            ))
            .await
            .unwrap();
            let read = tokio::spawn(async move {
                let mut b = vec![0u8; 4];
                server.read_exact(&mut b).await.unwrap();
                b
            });
            passes(c, read).await;
        }

        #[tokio::test]
        async fn n_is_plaintext_under_prefer_and_refused_otherwise() {
            let (tx, rx) = tokio::sync::oneshot::channel();
            let c = exchange(
                tls_of(PgSslMode::Prefer, None),
                "localhost",
                b"N",
                |mut s| async move {
                    let mut b = vec![0u8; 4];
                    s.read_exact(&mut b).await.unwrap();
                    let _ = tx.send(b);
                },
            )
            .await
            .unwrap();
            passes(c, tokio::spawn(async move { rx.await.unwrap() })).await;

            for (mode, name) in [
                (PgSslMode::Require, "require"),
                (PgSslMode::VerifyCa, "verify-ca"),
                (PgSslMode::VerifyFull, "verify-full"),
            ] {
                let r = exchange(tls_of(mode, Some(CA)), "localhost", b"N", |_| async {}).await;
                match r {
                    Err(NegotiateError::Tls(m)) => {
                        assert!(m.contains("does not accept TLS"), "{m}");
                        assert!(m.contains(name), "{m}");
                    }
                    Err(e) => panic!("{name}: {e}"),
                    Ok(_) => panic!("{name}: a server without TLS accepted"),
                }
            }
        }

        #[tokio::test]
        async fn any_other_reply_is_a_protocol_error() {
            for reply in [&b"X"[..], b"E", b"\0"] {
                let reply: &'static [u8] = reply;
                for mode in [PgSslMode::Prefer, PgSslMode::Require] {
                    let r = exchange(tls_of(mode, None), "localhost", reply, |_| async {}).await;
                    assert!(
                        matches!(&r, Err(NegotiateError::Protocol(m)) if m.contains("TLS request")),
                        "{reply:?} under {mode:?}: {:?}",
                        r.err()
                    );
                }
            }
            // A server that hangs up instead of answering.
            let (client, mut server) = tokio::io::duplex(1024);
            let hang_up = tokio::spawn(async move {
                let mut req = [0u8; 8];
                server.read_exact(&mut req).await.unwrap();
            });
            let r = bounded(negotiate(
                client,
                "localhost",
                &tls_of(PgSslMode::Require, None),
            ))
            .await;
            bounded(hang_up).await.unwrap();
            assert!(matches!(r, Err(NegotiateError::Io(_))), "{:?}", r.err());
        }

        /// A TLS server on `s` with the test certificate; what it reads first.
        async fn tls_server(s: DuplexStream) -> Result<Vec<u8>, std::io::Error> {
            use rustls::pki_types::pem::PemObject;
            use rustls::pki_types::{CertificateDer, PrivateKeyDer};
            let provider = Arc::new(rustls::crypto::ring::default_provider());
            let config = rustls::ServerConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_no_client_auth()
                .with_single_cert(
                    vec![CertificateDer::from_pem_slice(SERVER_CERT.as_bytes()).unwrap()],
                    PrivateKeyDer::from_pem_slice(SERVER_KEY.as_bytes()).unwrap(),
                )
                .unwrap();
            let mut tls = tokio_rustls::TlsAcceptor::from(Arc::new(config))
                .accept(s)
                .await?;
            let mut b = vec![0u8; 4];
            tls.read_exact(&mut b).await?;
            Ok(b)
        }

        /// `S`, then a handshake with the test server as `tls` and `host` say.
        async fn handshake(tls: Tls, host: &str) -> Result<(), NegotiateError> {
            let (tx, rx) = tokio::sync::oneshot::channel();
            let c = exchange(tls, host, b"S", |s| async move {
                let _ = tx.send(tls_server(s).await);
            })
            .await?;
            passes(
                c,
                tokio::spawn(async move { rx.await.unwrap().expect("the server's side") }),
            )
            .await;
            Ok(())
        }

        fn is_certificate_error(r: Result<(), NegotiateError>) -> bool {
            matches!(&r, Err(NegotiateError::Tls(m)) if m.contains("certificate"))
        }

        #[tokio::test]
        async fn s_starts_the_handshake_and_the_modes_check_what_libpq_checks() {
            // Chain and name.
            handshake(tls_of(PgSslMode::VerifyFull, Some(CA)), "localhost")
                .await
                .unwrap();
            let wrong_ca =
                handshake(tls_of(PgSslMode::VerifyFull, Some(OTHER_CA)), "localhost").await;
            assert!(is_certificate_error(wrong_ca));
            let wrong_name =
                handshake(tls_of(PgSslMode::VerifyFull, Some(CA)), "db.example.org").await;
            assert!(is_certificate_error(wrong_name));
            // The chain only.
            handshake(tls_of(PgSslMode::VerifyCa, Some(CA)), "db.example.org")
                .await
                .unwrap();
            let wrong_ca =
                handshake(tls_of(PgSslMode::VerifyCa, Some(OTHER_CA)), "localhost").await;
            assert!(is_certificate_error(wrong_ca));
            // Encryption, no check.
            handshake(tls_of(PgSslMode::Require, None), "db.example.org")
                .await
                .unwrap();
            handshake(tls_of(PgSslMode::Prefer, None), "localhost")
                .await
                .unwrap();
        }

        #[tokio::test]
        async fn bytes_after_s_go_to_the_handshake_not_to_the_start_up() {
            // A man in the middle answering `S` and, in the same packet,
            // plaintext meant to pass as the server's (CVE-2021-23222).
            for mode in [PgSslMode::Require, PgSslMode::VerifyFull] {
                let r = exchange(
                    tls_of(mode, Some(CA)),
                    "localhost",
                    b"SR\0\0\0\x08\0\0\0\0",
                    |mut s| async move {
                        let mut sink = vec![0u8; 4096];
                        while matches!(s.read(&mut sink).await, Ok(n) if n > 0) {}
                    },
                )
                .await;
                assert!(
                    matches!(r, Err(NegotiateError::Tls(_))),
                    "{mode:?}: {:?}",
                    r.err()
                );
            }
        }

        #[tokio::test]
        async fn a_bad_root_certificate_fails_before_anything_is_sent() {
            let (client, mut server) = tokio::io::duplex(1024);
            let bad = Tls {
                mode: PgSslMode::VerifyCa,
                root_cert: Some(RootCert::File("/nonexistent/bloomgate-ca.pem".into())),
            };
            let r = bounded(negotiate(client, "localhost", &bad)).await;
            assert!(
                matches!(&r, Err(NegotiateError::Tls(m)) if m.contains("/nonexistent/bloomgate-ca.pem")),
                "{:?}",
                r.err()
            );
            let mut b = Vec::new();
            bounded(server.read_to_end(&mut b)).await.unwrap();
            assert!(b.is_empty(), "sent {b:?}");
        }
    }
}
