//! A client for Postgres' streaming replication protocol, logical flavour:
//! what the `wal` feed reads the slot through.
//!
//! sqlx cannot speak it (a replication stream is a `CopyBoth` exchange, which
//! sqlx does not implement), and the crates that do either pull a C TLS
//! stack into every build or are young and thin; what the feed needs is
//! small, so it is written here against the protocol documentation
//! ("Streaming Replication Protocol", "Message Formats"):
//!
//! - TLS over TCP as the pool has it, negotiated by [`crate::db::tls::negotiate`]
//!   (the URL's `sslmode` and `sslrootcert`, libpq's meaning of each mode):
//!   `SSLRequest` first, then the handshake on the server's `S`; its `N`
//!   is refused unless the mode is `prefer`. A Unix socket never uses TLS.
//! - start-up with `replication=database`, authentication by trust,
//!   cleartext, MD5 or SCRAM-SHA-256 (no channel binding);
//! - simple queries (replication commands such as `CREATE_REPLICATION_SLOT`),
//!   rows as text;
//! - `START_REPLICATION … LOGICAL`, then [`Frame`]s out of `CopyData`
//!   (`XLogData`, primary keepalive) and standby status updates back.
//!
//! # Guarantees
//! - **Never panics on what the server sends.** Every read is bounds
//!   checked; a message that does not parse, or one longer than
//!   [`MAX_MESSAGE`], is a [`ReplError::Protocol`] and the caller
//!   reconnects.
//! - **No secret in an error.** Errors carry the server's message, never the
//!   password or a SCRAM value; a TLS error names the mode, the certificate
//!   problem or the `sslrootcert` file, never the URL.
//! - **The mode is kept.** Under `require` and `verify-*` nothing but the
//!   `SSLRequest` is sent before the handshake succeeds; under
//!   `verify-ca`/`verify-full` a certificate that does not chain to a
//!   trusted root (or, for `verify-full`, does not name the host) ends the
//!   connection before any start-up message.
//! - **The server's word is checked.** A SCRAM exchange fails unless the
//!   server proves it knows the password too (its signature is verified);
//!   "authenticated" before that proof is refused.
//! - **Frames arrive in WAL order, and nothing is acknowledged by itself.**
//!   The position the server may recycle WAL up to is only what the caller
//!   passes to [`Stream::send_status`].
//!
//! # Layout
//! - [`endpoint`]: where and as whom to connect, the password from the URL,
//!   `PGPASSWORD` or the password file ([`pgpass`]);
//! - [`frame`]: the wire format: messages cut out of the byte stream, the
//!   fields read out of them with bounds checks, [`Frame`]s;
//! - [`auth`]: cleartext, MD5 and SCRAM-SHA-256;
//! - [`commands`]: simple queries, the slot, `START_REPLICATION`, and the
//!   [`Stream`] that follows it;
//! - here: the [`Connection`] (connect, start-up, send and read messages)
//!   and [`ReplError`].

pub mod auth;
pub mod commands;
pub mod endpoint;
pub mod frame;
pub mod pgpass;

use std::fmt;

use bytes::{BufMut, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::db::tls::{self, NegotiateError, Tls, Transport};
pub use commands::{Stream, quote_ident};
pub use endpoint::{Endpoint, password_from_url};
pub use frame::{Frame, MAX_MESSAGE};
use frame::{Msg, len32, put_cstr, server_error};

/// Why the replication connection failed; never carries a secret.
#[derive(Debug)]
pub enum ReplError {
    Io(std::io::Error),
    /// The server refused (an `ErrorResponse`): its SQLSTATE and message.
    Server {
        code: String,
        message: String,
    },
    /// What the server sent makes no sense here.
    Protocol(String),
    /// TLS was required and refused, the handshake failed (a certificate
    /// the mode does not accept, among others), or the TLS set-up cannot
    /// work (an unreadable `sslrootcert`).
    Tls(String),
    /// An authentication method this client does not speak, or a password
    /// needed and not given.
    Auth(String),
}

impl fmt::Display for ReplError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReplError::Io(e) => write!(f, "replication connection: {e}"),
            ReplError::Server { code, message } => {
                write!(f, "replication connection: {message} (SQLSTATE {code})")
            }
            ReplError::Protocol(m) => write!(f, "replication protocol: {m}"),
            ReplError::Tls(m) => write!(f, "replication connection TLS: {m}"),
            ReplError::Auth(m) => write!(f, "replication authentication: {m}"),
        }
    }
}

impl std::error::Error for ReplError {}

impl From<std::io::Error> for ReplError {
    fn from(e: std::io::Error) -> Self {
        ReplError::Io(e)
    }
}

fn protocol(m: impl Into<String>) -> ReplError {
    ReplError::Protocol(m.into())
}

impl From<NegotiateError> for ReplError {
    fn from(e: NegotiateError) -> Self {
        match e {
            NegotiateError::Io(e) => ReplError::Io(e),
            NegotiateError::Tls(m) => ReplError::Tls(m),
            NegotiateError::Protocol(m) => ReplError::Protocol(m),
        }
    }
}

/// A replication connection outside `COPY` mode: it runs commands.
pub struct Connection {
    io: Box<dyn Transport>,
    buf: BytesMut,
}

impl Connection {
    /// [`Connection::connect_with`] as libpq's default, `sslmode=prefer`,
    /// does it: TLS if the server offers it, no certificate check.
    pub async fn connect(ep: &Endpoint) -> Result<Self, ReplError> {
        Self::connect_with(ep, &Tls::default()).await
    }

    /// Connects (over TCP secured as `tls` says; see [`Tls::from_options`]
    /// for the pool's settings), starts a logical replication session on
    /// the endpoint's database and authenticates.
    pub async fn connect_with(ep: &Endpoint, tls: &Tls) -> Result<Self, ReplError> {
        let io: Box<dyn Transport> = if let Some(socket) = &ep.socket {
            #[cfg(unix)]
            {
                let path = if socket.is_dir() {
                    socket.join(format!(".s.PGSQL.{}", ep.port))
                } else {
                    socket.clone()
                };
                Box::new(tokio::net::UnixStream::connect(path).await?)
            }
            #[cfg(not(unix))]
            {
                return Err(protocol("Unix sockets are not supported here"));
            }
        } else {
            let s = tokio::net::TcpStream::connect((ep.host.as_str(), ep.port)).await?;
            s.set_nodelay(true)?;
            tls::negotiate(s, &ep.host, tls).await?
        };
        let mut c = Connection {
            io,
            buf: BytesMut::with_capacity(64 * 1024),
        };
        c.startup(ep).await?;
        Ok(c)
    }

    async fn startup(&mut self, ep: &Endpoint) -> Result<(), ReplError> {
        let mut body = BytesMut::new();
        body.put_u32(196_608); // protocol 3.0
        for (k, v) in [
            ("user", ep.user.as_str()),
            ("database", ep.database.as_str()),
            ("replication", "database"),
            ("application_name", ep.application_name.as_str()),
            ("client_encoding", "UTF8"),
        ] {
            put_cstr(&mut body, k);
            put_cstr(&mut body, v);
        }
        body.put_u8(0);
        let mut out = BytesMut::with_capacity(body.len() + 4);
        out.put_u32(len32(body.len() + 4)?);
        out.extend_from_slice(&body);
        self.io.write_all(&out).await?;
        self.authenticate(ep).await?;
        // ParameterStatus, BackendKeyData, notices: until ReadyForQuery.
        loop {
            let m = self.read().await?;
            match m.tag {
                b'Z' => return Ok(()),
                b'S' | b'K' | b'N' => {}
                b'E' => return Err(server_error(&m.body)),
                t => {
                    return Err(protocol(format!(
                        "unexpected message {:?} at start-up",
                        t as char
                    )));
                }
            }
        }
    }

    async fn send(&mut self, tag: u8, body: &[u8]) -> Result<(), ReplError> {
        let mut out = BytesMut::with_capacity(body.len() + 5);
        out.put_u8(tag);
        out.put_u32(len32(body.len() + 4)?);
        out.extend_from_slice(body);
        self.io.write_all(&out).await?;
        Ok(())
    }

    /// The next complete message in the buffer, if there is one.
    fn buffered(&mut self) -> Result<Option<Msg>, ReplError> {
        Msg::split_off(&mut self.buf)
    }

    async fn read(&mut self) -> Result<Msg, ReplError> {
        loop {
            if let Some(m) = self.buffered()? {
                return Ok(m);
            }
            if self.io.read_buf(&mut self.buf).await? == 0 {
                return Err(ReplError::Io(std::io::ErrorKind::UnexpectedEof.into()));
            }
        }
    }
}
