//! A client for Postgres' streaming replication protocol, logical flavour:
//! what the `wal` feed reads the slot through.
//!
//! sqlx cannot speak it (a replication stream is a `CopyBoth` exchange, which
//! sqlx does not implement), and the crates that do either pull a C TLS
//! stack into every build or are young and thin; what the feed needs is
//! small, so it is written here against the protocol documentation
//! ("Streaming Replication Protocol", "Message Formats"):
//!
//! - TLS over TCP as the pool has it ([`crate::db::tls`]: the URL's
//!   `sslmode` and `sslrootcert`, libpq's meaning of each mode, the
//!   `sslrootcert` certificates the only roots, rustls on the provider sqlx
//!   uses): `SSLRequest` first, then the handshake on the server's `S`;
//!   its `N` is refused unless the mode is `prefer`. `verify-ca` does not
//!   check the host name here, as in libpq (the pool does, with sqlx
//!   0.8.6: see `db::tls`). A Unix socket never uses TLS.
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

use std::fmt;
use std::future::Future;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::Lsn;
use crate::db::tls::{self, Tls};

/// Longest backend message accepted. A pgoutput message carries a whole
/// row of a published table (every column, unchanged TOASTed values
/// excepted), and the server builds it in one buffer, which Postgres caps at
/// 1 GiB; past that (and the frame's header) it is a broken stream.
pub const MAX_MESSAGE: usize = (1 << 30) + 1024;

/// Where and as whom to connect.
#[derive(Clone)]
pub struct Endpoint {
    pub host: String,
    pub port: u16,
    /// A Unix socket: its directory (`.s.PGSQL.<port>` is appended) or the
    /// socket itself. Used instead of `host` when set.
    pub socket: Option<std::path::PathBuf>,
    pub user: String,
    pub password: Option<String>,
    pub database: String,
    pub application_name: String,
}

impl Endpoint {
    /// The pool's connection settings (host, port, socket, user, database,
    /// as sqlx resolved them from the URL and `PG*` variables) and the
    /// password ([`password_from_url`]: sqlx does not hand it out), else
    /// the password file's ([`super::pgpass`]), as sqlx and libpq do.
    /// How to secure it comes from the same options, with
    /// [`Tls::from_options`], and is passed to [`Connection::connect_with`].
    pub fn new(
        opts: &sqlx::postgres::PgConnectOptions,
        password: Option<String>,
        application_name: &str,
    ) -> Self {
        let database = opts
            .get_database()
            .unwrap_or(opts.get_username())
            .to_owned();
        // Looked up as sqlx looks it up for the pool (see `pgpass`).
        let password = password.or_else(|| {
            super::pgpass::lookup(
                opts.get_host(),
                opts.get_port(),
                opts.get_database(),
                opts.get_username(),
            )
        });
        Self {
            host: opts.get_host().to_owned(),
            port: opts.get_port(),
            // A socket directory given as `host` (sqlx takes `PGHOST` so).
            socket: opts.get_socket().cloned().or_else(|| {
                tls::over_socket(opts).then(|| std::path::PathBuf::from(opts.get_host()))
            }),
            user: opts.get_username().to_owned(),
            password,
            database,
            application_name: application_name.to_owned(),
        }
    }
}

/// The password a connection URL carries (`user:password@` or
/// `?password=`), else `PGPASSWORD`'s. (The password file comes next, in
/// [`Endpoint::new`].)
pub fn password_from_url(url: &str) -> Option<String> {
    let parsed = url::Url::parse(url).ok();
    let in_authority = parsed.as_ref().and_then(|u| {
        u.password().map(|p| {
            percent_encoding::percent_decode_str(p)
                .decode_utf8_lossy()
                .into_owned()
        })
    });
    let in_query = || {
        parsed.as_ref().and_then(|u| {
            u.query_pairs()
                .find(|(k, _)| k == "password")
                .map(|(_, v)| v.into_owned())
        })
    };
    in_authority
        .or_else(in_query)
        .or_else(|| std::env::var("PGPASSWORD").ok())
}

impl fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the password.
        f.debug_struct("Endpoint")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("socket", &self.socket)
            .field("user", &self.user)
            .field("database", &self.database)
            .finish_non_exhaustive()
    }
}

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

trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// A replication connection outside `COPY` mode: it runs commands.
pub struct Connection {
    io: Box<dyn Io>,
    buf: BytesMut,
}

/// One backend message: its type byte and body.
struct Msg {
    tag: u8,
    body: Bytes,
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
        let io: Box<dyn Io> = if let Some(socket) = &ep.socket {
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
            secure(s, &ep.host, tls).await?
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

    async fn authenticate(&mut self, ep: &Endpoint) -> Result<(), ReplError> {
        let mut scram: Option<Scram> = None;
        loop {
            let m = self.read().await?;
            match m.tag {
                b'R' => {}
                b'E' => return Err(server_error(&m.body)),
                b'N' => continue,
                t => {
                    return Err(protocol(format!(
                        "unexpected message {:?} during authentication",
                        t as char
                    )));
                }
            }
            let mut b = m.body;
            let kind = get_u32(&mut b)?;
            match kind {
                0 if scram.is_some() => {
                    return Err(ReplError::Auth(
                        "the server ended SCRAM without proving it knows the password".into(),
                    ));
                }
                0 => return Ok(()),
                3 => {
                    let pw = password(ep)?;
                    let mut p = BytesMut::new();
                    put_cstr(&mut p, pw);
                    self.send(b'p', &p).await?;
                }
                5 => {
                    if b.len() < 4 {
                        return Err(protocol("short MD5 salt"));
                    }
                    let salt = b.split_to(4);
                    let hashed = md5_password(&ep.user, password(ep)?, &salt);
                    let mut p = BytesMut::new();
                    put_cstr(&mut p, &hashed);
                    self.send(b'p', &p).await?;
                }
                10 => {
                    // SASL: the mechanisms, NUL-terminated, then an empty one.
                    let mechs: Vec<&[u8]> = b.split(|&c| c == 0).collect();
                    if !mechs.contains(&&b"SCRAM-SHA-256"[..]) {
                        return Err(ReplError::Auth(
                            "the server offers no SASL mechanism this client speaks (SCRAM-SHA-256 without channel binding)".into(),
                        ));
                    }
                    let s = Scram::new(password(ep)?, &nonce());
                    let first = s.client_first();
                    let mut p = BytesMut::new();
                    put_cstr(&mut p, "SCRAM-SHA-256");
                    p.put_i32(len32(first.len())? as i32);
                    p.extend_from_slice(first.as_bytes());
                    self.send(b'p', &p).await?;
                    scram = Some(s);
                }
                11 => {
                    let mut s = scram
                        .take()
                        .ok_or_else(|| protocol("SASL continue without a SASL start"))?;
                    let server_first = std::str::from_utf8(&b)
                        .map_err(|_| protocol("SCRAM server-first is not UTF-8"))?
                        .to_owned();
                    // Thousands of HMAC rounds: off the runtime's threads.
                    let (s, fin) = tokio::task::spawn_blocking(move || {
                        let fin = s.client_final(&server_first);
                        (s, fin)
                    })
                    .await
                    .map_err(|_| ReplError::Auth("the SCRAM computation failed".into()))?;
                    self.send(b'p', fin?.as_bytes()).await?;
                    scram = Some(s);
                }
                12 => {
                    let s = scram
                        .take()
                        .ok_or_else(|| protocol("SASL final without a SASL exchange"))?;
                    let server_final = std::str::from_utf8(&b)
                        .map_err(|_| protocol("SCRAM server-final is not UTF-8"))?;
                    s.verify_server(server_final)?;
                }
                other => {
                    return Err(ReplError::Auth(format!(
                        "authentication method {other} is not supported (trust, password, md5 and scram-sha-256 are)"
                    )));
                }
            }
        }
    }

    /// Runs one command; returns its rows, every field as text (`None`:
    /// NULL).
    pub async fn simple_query(&mut self, sql: &str) -> Result<Vec<Vec<Option<String>>>, ReplError> {
        let mut q = BytesMut::new();
        put_cstr(&mut q, sql);
        self.send(b'Q', &q).await?;
        let mut rows = Vec::new();
        let mut error = None;
        loop {
            let m = self.read().await?;
            match m.tag {
                b'D' => rows.push(data_row(m.body)?),
                b'T' | b'C' | b'I' | b'N' | b'S' => {}
                b'E' => error = Some(server_error(&m.body)),
                b'Z' => {
                    return match error {
                        Some(e) => Err(e),
                        None => Ok(rows),
                    };
                }
                t => {
                    return Err(protocol(format!(
                        "unexpected message {:?} after a query",
                        t as char
                    )));
                }
            }
        }
    }

    /// Creates a logical slot with `pgoutput`; returns its consistent
    /// point. A temporary slot lives exactly as long as this connection.
    pub async fn create_slot(&mut self, name: &str, temporary: bool) -> Result<Lsn, ReplError> {
        // The pre-15 spelling (NOEXPORT_SNAPSHOT) is accepted by every
        // version since 10.
        let sql = format!(
            "CREATE_REPLICATION_SLOT {} {}LOGICAL pgoutput NOEXPORT_SNAPSHOT",
            quote_ident(name),
            if temporary { "TEMPORARY " } else { "" }
        );
        let rows = self.simple_query(&sql).await?;
        let point = rows
            .first()
            .and_then(|r| r.get(1))
            .and_then(|v| v.as_deref())
            .and_then(Lsn::parse)
            .ok_or_else(|| protocol("CREATE_REPLICATION_SLOT returned no consistent point"))?;
        Ok(point)
    }

    /// `START_REPLICATION SLOT name LOGICAL start (options)`; `Lsn::ZERO`
    /// starts at the slot's confirmed position.
    pub async fn start(
        mut self,
        slot: &str,
        start: Lsn,
        options: &[(&str, &str)],
    ) -> Result<Stream, ReplError> {
        let opts: Vec<String> = options
            .iter()
            .map(|(k, v)| format!("{} {}", quote_ident(k), quote_literal(v)))
            .collect();
        let sql = format!(
            "START_REPLICATION SLOT {} LOGICAL {} ({})",
            quote_ident(slot),
            start,
            opts.join(", ")
        );
        let mut q = BytesMut::new();
        put_cstr(&mut q, &sql);
        self.send(b'Q', &q).await?;
        loop {
            let m = self.read().await?;
            match m.tag {
                b'W' => break,
                b'N' | b'S' => {}
                b'E' => return Err(server_error(&m.body)),
                t => {
                    return Err(protocol(format!(
                        "unexpected message {:?} after START_REPLICATION",
                        t as char
                    )));
                }
            }
        }
        Ok(Stream { conn: self })
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
        if self.buf.len() < 5 {
            return Ok(None);
        }
        let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
        if !(4..=MAX_MESSAGE).contains(&len) {
            return Err(protocol(format!("message length {len} out of range")));
        }
        if self.buf.len() < len + 1 {
            self.buf.reserve(len + 1 - self.buf.len());
            return Ok(None);
        }
        let tag = self.buf[0];
        let mut m = self.buf.split_to(len + 1);
        m.advance(5);
        Ok(Some(Msg {
            tag,
            body: m.freeze(),
        }))
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

/// What the server streams after `START_REPLICATION`.
#[derive(Debug, PartialEq, Eq)]
pub enum Frame {
    /// WAL data: one pgoutput message.
    XLogData {
        /// Where the data starts in the WAL.
        start: Lsn,
        /// The server's current end of WAL.
        wal_end: Lsn,
        data: Bytes,
    },
    /// The server is alive; everything before `wal_end` was sent.
    Keepalive { wal_end: Lsn, reply_requested: bool },
    /// The server ended the stream (`CopyDone`).
    End,
}

/// A replication connection in `CopyBoth` mode.
pub struct Stream {
    conn: Connection,
}

impl Stream {
    /// The next frame, waiting for it.
    pub async fn recv(&mut self) -> Result<Frame, ReplError> {
        loop {
            let m = self.conn.read().await?;
            if let Some(f) = frame(m)? {
                return Ok(f);
            }
        }
    }

    /// The next frame if one has already arrived whole, without waiting.
    pub fn try_recv(&mut self) -> Result<Option<Frame>, ReplError> {
        while let Some(m) = self.conn.buffered()? {
            if let Some(f) = frame(m)? {
                return Ok(Some(f));
            }
        }
        Ok(None)
    }

    /// Reads what the socket holds into the buffer without waiting (so that
    /// [`try_recv`](Self::try_recv) sees frames that arrived meanwhile).
    pub fn fill(&mut self) -> Result<(), ReplError> {
        use std::task::{Context, Poll};
        let waker = futures_util::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        for _ in 0..64 {
            let before = self.conn.buf.len();
            if self.conn.buf.capacity() - before < 8192 {
                self.conn.buf.reserve(64 * 1024);
            }
            let fut = self.conn.io.read_buf(&mut self.conn.buf);
            tokio::pin!(fut);
            match fut.as_mut().poll(&mut cx) {
                Poll::Ready(Ok(0)) => {
                    return Err(ReplError::Io(std::io::ErrorKind::UnexpectedEof.into()));
                }
                Poll::Ready(Ok(_)) => continue,
                Poll::Ready(Err(e)) => return Err(e.into()),
                Poll::Pending => return Ok(()),
            }
        }
        Ok(())
    }

    /// A standby status update: received up to `written`, durably applied
    /// up to `flushed` (the slot's confirmed position: the server may
    /// recycle WAL before it).
    pub async fn send_status(
        &mut self,
        written: Lsn,
        flushed: Lsn,
        reply_requested: bool,
    ) -> Result<(), ReplError> {
        let mut b = BytesMut::with_capacity(34);
        b.put_u8(b'r');
        b.put_u64(written.0);
        b.put_u64(flushed.0);
        b.put_u64(flushed.0);
        b.put_i64(pg_now());
        b.put_u8(u8::from(reply_requested));
        self.conn.send(b'd', &b).await
    }
}

/// `SSLRequest`: length 8, then the code 1234 5679 (80877103).
const SSL_REQUEST: [u8; 8] = [0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f];

/// Asks the server on `s` for TLS when `tls` says so, and acts on its
/// one-byte answer: `S`, the handshake (the certificate checked as the
/// mode says, against `host`); `N`, plaintext under `prefer` and an error
/// otherwise; anything else, a protocol error.
async fn secure<S>(mut s: S, host: &str, tls: &Tls) -> Result<Box<dyn Io>, ReplError>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    if !tls.requested() {
        return Ok(Box::new(s));
    }
    // Set up before anything is sent: a bad sslrootcert fails here.
    let config = match tls.client_config() {
        Ok(c) => c,
        Err(e) => return Err(ReplError::Tls(e.to_string())),
    };
    s.write_all(&SSL_REQUEST).await?;
    let mut reply = [0u8; 1];
    s.read_exact(&mut reply).await?;
    match reply[0] {
        b'S' => {
            let name = tls::server_name(host).map_err(|e| ReplError::Tls(e.to_string()))?;
            // Exactly one byte was read, nothing buffered: whatever the
            // server (or a man in the middle) sent after the `S` goes to
            // the handshake, which fails on it (CVE-2021-23222).
            let stream = tokio_rustls::TlsConnector::from(config)
                .connect(name, s)
                .await
                .map_err(tls_failure)?;
            Ok(Box::new(stream))
        }
        b'N' if tls.required() => Err(ReplError::Tls(format!(
            "the server does not accept TLS, and sslmode={} requires it",
            tls.mode_name()
        ))),
        b'N' => Ok(Box::new(s)),
        other => Err(protocol(format!(
            "unexpected reply 0x{other:02x} to the TLS request"
        ))),
    }
}

/// A failed handshake: rustls' reason (a certificate problem reads
/// "invalid peer certificate: …"), or the socket's error.
fn tls_failure(e: std::io::Error) -> ReplError {
    match e.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>()) {
        Some(r) => ReplError::Tls(format!("handshake failed: {r}")),
        None => ReplError::Io(e),
    }
}

fn frame(m: Msg) -> Result<Option<Frame>, ReplError> {
    match m.tag {
        b'd' => {
            let mut b = m.body;
            let kind = get_u8(&mut b)?;
            match kind {
                b'w' => {
                    let start = Lsn(get_u64(&mut b)?);
                    let wal_end = Lsn(get_u64(&mut b)?);
                    let _sent_at = get_u64(&mut b)?;
                    Ok(Some(Frame::XLogData {
                        start,
                        wal_end,
                        data: b,
                    }))
                }
                b'k' => {
                    let wal_end = Lsn(get_u64(&mut b)?);
                    let _sent_at = get_u64(&mut b)?;
                    let reply = get_u8(&mut b)? != 0;
                    Ok(Some(Frame::Keepalive {
                        wal_end,
                        reply_requested: reply,
                    }))
                }
                k => Err(protocol(format!("unknown CopyData kind {:?}", k as char))),
            }
        }
        b'c' => Ok(Some(Frame::End)),
        b'N' | b'S' => Ok(None),
        b'E' => Err(server_error(&m.body)),
        t => Err(protocol(format!(
            "unexpected message {:?} in the stream",
            t as char
        ))),
    }
}

/// Microseconds since 2000-01-01, Postgres' clock.
fn pg_now() -> i64 {
    const PG_EPOCH: Duration = Duration::from_secs(946_684_800);
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .ok()
        .and_then(|d| d.checked_sub(PG_EPOCH))
        .map_or(0, |d| d.as_micros() as i64)
}

fn password(ep: &Endpoint) -> Result<&str, ReplError> {
    ep.password.as_deref().ok_or_else(|| {
        ReplError::Auth("the server asks for a password and none is configured".into())
    })
}

fn len32(n: usize) -> Result<u32, ReplError> {
    u32::try_from(n).map_err(|_| protocol("message too long"))
}

fn put_cstr(b: &mut BytesMut, s: &str) {
    b.extend_from_slice(s.as_bytes());
    b.put_u8(0);
}

fn get_u8(b: &mut Bytes) -> Result<u8, ReplError> {
    if b.is_empty() {
        return Err(protocol("short message"));
    }
    Ok(b.get_u8())
}

fn get_u32(b: &mut Bytes) -> Result<u32, ReplError> {
    if b.len() < 4 {
        return Err(protocol("short message"));
    }
    Ok(b.get_u32())
}

fn get_u64(b: &mut Bytes) -> Result<u64, ReplError> {
    if b.len() < 8 {
        return Err(protocol("short message"));
    }
    Ok(b.get_u64())
}

fn data_row(mut b: Bytes) -> Result<Vec<Option<String>>, ReplError> {
    if b.len() < 2 {
        return Err(protocol("short DataRow"));
    }
    let n = b.get_u16() as usize;
    let mut row = Vec::with_capacity(n);
    for _ in 0..n {
        let len = get_u32(&mut b)? as i32;
        if len < 0 {
            row.push(None);
            continue;
        }
        let len = len as usize;
        if b.len() < len {
            return Err(protocol("short DataRow field"));
        }
        let v = b.split_to(len);
        row.push(Some(String::from_utf8_lossy(&v).into_owned()));
    }
    Ok(row)
}

/// An `ErrorResponse`'s SQLSTATE and message.
fn server_error(body: &[u8]) -> ReplError {
    let mut code = String::new();
    let mut message = String::new();
    for field in body.split(|&c| c == 0) {
        let Some((&kind, text)) = field.split_first() else {
            continue;
        };
        match kind {
            b'C' => code = String::from_utf8_lossy(text).into_owned(),
            b'M' => message = String::from_utf8_lossy(text).into_owned(),
            _ => {}
        }
    }
    ReplError::Server { code, message }
}

pub fn quote_ident(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

fn quote_literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

fn md5_password(user: &str, password: &str, salt: &[u8]) -> String {
    use md5::Md5;
    let inner = hex(&Md5::digest(format!("{password}{user}").as_bytes()));
    let mut h = Md5::new();
    h.update(inner.as_bytes());
    h.update(salt);
    format!("md5{}", hex(&h.finalize()))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn nonce() -> String {
    use base64::Engine;
    let raw: [u8; 18] = rand::random();
    base64::engine::general_purpose::STANDARD.encode(raw)
}

/// One SCRAM-SHA-256 exchange (RFC 5802, RFC 7677), without channel
/// binding (`n,,`). Postgres takes the user from the start-up packet and
/// ignores the one in these messages, so the client sends `n=`.
struct Scram {
    password: String,
    nonce: String,
    client_first_bare: String,
    /// After the client-final: what the server's signature must be.
    expected_server_signature: Option<Vec<u8>>,
}

type HmacSha256 = Hmac<Sha256>;

fn hmac(key: &[u8], data: &[u8]) -> Vec<u8> {
    let mut m = HmacSha256::new_from_slice(key).expect("HMAC takes any key length");
    m.update(data);
    m.finalize().into_bytes().to_vec()
}

impl Scram {
    fn new(password: &str, nonce: &str) -> Self {
        Self::with_user("", password, nonce)
    }

    fn with_user(user: &str, password: &str, nonce: &str) -> Self {
        // SASLprep where it applies; Postgres uses the raw bytes otherwise.
        let password = stringprep::saslprep(password)
            .map(|p| p.into_owned())
            .unwrap_or_else(|_| password.to_owned());
        Self {
            password,
            nonce: nonce.to_owned(),
            client_first_bare: format!("n={user},r={nonce}"),
            expected_server_signature: None,
        }
    }

    fn client_first(&self) -> String {
        format!("n,,{}", self.client_first_bare)
    }

    fn client_final(&mut self, server_first: &str) -> Result<String, ReplError> {
        use base64::Engine;
        let b64 = base64::engine::general_purpose::STANDARD;
        let bad = || ReplError::Auth("malformed SCRAM server-first message".into());
        let mut nonce = None;
        let mut salt = None;
        let mut iterations = None;
        for attr in server_first.split(',') {
            match attr.split_once('=') {
                Some(("r", v)) => nonce = Some(v),
                Some(("s", v)) => salt = Some(b64.decode(v).map_err(|_| bad())?),
                Some(("i", v)) => iterations = Some(v.parse::<u32>().map_err(|_| bad())?),
                _ => {}
            }
        }
        let (Some(nonce), Some(salt), Some(iterations)) = (nonce, salt, iterations) else {
            return Err(bad());
        };
        if !nonce.starts_with(&self.nonce) || nonce.len() == self.nonce.len() {
            return Err(ReplError::Auth(
                "the server's SCRAM nonce does not extend ours".into(),
            ));
        }
        // Postgres' default is 4,096; this bounds the work a hostile server
        // can ask for (about a second).
        if iterations == 0 || iterations > 1_000_000 {
            return Err(bad());
        }
        let salted = pbkdf2_sha256(self.password.as_bytes(), &salt, iterations);
        let client_key = hmac(&salted, b"Client Key");
        let stored_key = Sha256::digest(&client_key);
        let without_proof = format!("c=biws,r={nonce}");
        let auth_message = format!("{},{server_first},{without_proof}", self.client_first_bare);
        let signature = hmac(&stored_key, auth_message.as_bytes());
        let proof: Vec<u8> = client_key
            .iter()
            .zip(&signature)
            .map(|(a, b)| a ^ b)
            .collect();
        let server_key = hmac(&salted, b"Server Key");
        self.expected_server_signature = Some(hmac(&server_key, auth_message.as_bytes()));
        Ok(format!("{without_proof},p={}", b64.encode(proof)))
    }

    fn verify_server(&self, server_final: &str) -> Result<(), ReplError> {
        use base64::Engine;
        if let Some(e) = server_final.strip_prefix("e=") {
            return Err(ReplError::Auth(format!("the server refused: {e}")));
        }
        let got = server_final
            .strip_prefix("v=")
            .and_then(|v| base64::engine::general_purpose::STANDARD.decode(v).ok());
        match (&self.expected_server_signature, got) {
            (Some(want), Some(got)) if *want == got => Ok(()),
            _ => Err(ReplError::Auth(
                "the server's SCRAM signature is wrong: it does not know the password".into(),
            )),
        }
    }
}

fn pbkdf2_sha256(password: &[u8], salt: &[u8], iterations: u32) -> Vec<u8> {
    let mut block = salt.to_vec();
    block.extend_from_slice(&1u32.to_be_bytes());
    let mut u = hmac(password, &block);
    let mut out = u.clone();
    for _ in 1..iterations {
        u = hmac(password, &u);
        for (o, x) in out.iter_mut().zip(&u) {
            *o ^= x;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RFC 7677's example exchange (user "user", password "pencil").
    #[test]
    fn scram_matches_the_rfc_7677_example() {
        let mut s = Scram::with_user("user", "pencil", "rOprNGfwEbeRWgbNEkqO");
        assert_eq!(s.client_first(), "n,,n=user,r=rOprNGfwEbeRWgbNEkqO");
        let fin = s
            .client_final("r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096")
            .unwrap();
        assert_eq!(
            fin,
            "c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ="
        );
        s.verify_server("v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4=")
            .unwrap();
        assert!(
            s.verify_server("v=AAAATRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4=")
                .is_err()
        );
        assert!(s.verify_server("e=invalid-proof").is_err());
    }

    #[test]
    fn scram_refuses_a_server_that_does_not_extend_our_nonce() {
        for first in [
            "r=someoneelse,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096",
            "r=abc,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096",
            "r=abcdef,s=!!,i=4096",
            "r=abcdef,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=0",
            "r=abcdef,s=W22ZaJ0SNY7soEsUEjb6gQ==",
        ] {
            let mut s = Scram::new("pw", "abc");
            assert!(s.client_final(first).is_err(), "{first}");
        }
    }

    #[test]
    fn md5_password_is_postgres_form() {
        // md5(md5("secret" || "alice") || salt), as libpq computes it.
        let inner = hex(&md5::Md5::digest(b"secretalice"));
        let mut h = md5::Md5::new();
        h.update(inner.as_bytes());
        h.update([1, 2, 3, 4]);
        let want = format!("md5{}", hex(&h.finalize()));
        assert_eq!(md5_password("alice", "secret", &[1, 2, 3, 4]), want);
        assert_eq!(want.len(), 35);
    }

    fn msg(tag: u8, body: &[u8]) -> Msg {
        Msg {
            tag,
            body: Bytes::copy_from_slice(body),
        }
    }

    #[test]
    fn frames_parse_and_short_ones_are_errors() {
        let mut w = vec![b'w'];
        w.extend_from_slice(&0x1_0000_0010u64.to_be_bytes());
        w.extend_from_slice(&0x1_0000_0020u64.to_be_bytes());
        w.extend_from_slice(&0u64.to_be_bytes());
        w.extend_from_slice(b"BEGIN");
        assert_eq!(
            frame(msg(b'd', &w)).unwrap(),
            Some(Frame::XLogData {
                start: Lsn(0x1_0000_0010),
                wal_end: Lsn(0x1_0000_0020),
                data: Bytes::from_static(b"BEGIN"),
            })
        );
        let mut k = vec![b'k'];
        k.extend_from_slice(&7u64.to_be_bytes());
        k.extend_from_slice(&0u64.to_be_bytes());
        k.push(1);
        assert_eq!(
            frame(msg(b'd', &k)).unwrap(),
            Some(Frame::Keepalive {
                wal_end: Lsn(7),
                reply_requested: true
            })
        );
        for cut in 0..k.len() {
            assert!(
                frame(msg(b'd', &k[..cut])).is_err(),
                "keepalive cut at {cut}"
            );
        }
        for cut in 0..25 {
            assert!(
                frame(msg(b'd', &w[..cut])).is_err(),
                "XLogData cut at {cut}"
            );
        }
        assert_eq!(frame(msg(b'c', b"")).unwrap(), Some(Frame::End));
        assert_eq!(frame(msg(b'N', b"")).unwrap(), None);
        assert!(matches!(
            frame(msg(b'E', b"SERROR\0C58P01\0Mslot gone\0\0")),
            Err(ReplError::Server { code, message }) if code == "58P01" && message == "slot gone"
        ));
        assert!(frame(msg(b'd', b"x")).is_err());
    }

    #[test]
    fn data_rows_parse_and_never_overrun() {
        let mut d = vec![0, 2];
        d.extend_from_slice(&3u32.to_be_bytes());
        d.extend_from_slice(b"0/1");
        d.extend_from_slice(&(-1i32).to_be_bytes());
        assert_eq!(
            data_row(Bytes::from(d.clone())).unwrap(),
            vec![Some("0/1".to_string()), None]
        );
        for cut in 0..d.len() {
            assert!(
                data_row(Bytes::copy_from_slice(&d[..cut])).is_err(),
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn the_password_comes_from_the_url() {
        assert_eq!(
            password_from_url("postgres://u:p%40ss%3Aw@h/db").as_deref(),
            Some("p@ss:w")
        );
        assert_eq!(
            password_from_url("postgres://u@h/db?sslmode=disable&password=s%20t").as_deref(),
            Some("s t")
        );
    }

    #[test]
    fn identifiers_and_literals_are_quoted() {
        assert_eq!(quote_ident("a\"b"), "\"a\"\"b\"");
        assert_eq!(quote_literal("it's"), "'it''s'");
    }

    // TLS negotiation over an in-memory stream. The certificates were
    // made once with the openssl CLI, valid 2000-2100: a CA, a server
    // certificate it signed for DNS:localhost, and a second CA that signed
    // nothing. The key is a test key and protects nothing.
    const CA: &str = include_str!("../../tests/data/tls/unit-ca.pem");
    const OTHER_CA: &str = include_str!("../../tests/data/tls/unit-other-ca.pem");
    const SERVER_CERT: &str = include_str!("../../tests/data/tls/localhost.pem");
    const SERVER_KEY: &str = include_str!("../../tests/data/tls/localhost.key");

    use std::sync::Arc;

    use sqlx::postgres::PgSslMode;
    use tokio::io::DuplexStream;

    fn tls_of(mode: PgSslMode, ca: Option<&str>) -> Tls {
        Tls {
            mode,
            root_cert: ca.map(|c| tls::RootCert::Pem(c.as_bytes().to_vec())),
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

    /// Negotiates `tls` against a server that answers `reply` and then
    /// does `then` with its end; returns the client's outcome.
    async fn negotiate<F, Fut>(
        tls: Tls,
        host: &str,
        reply: &'static [u8],
        then: F,
    ) -> Result<Box<dyn Io>, ReplError>
    where
        F: FnOnce(DuplexStream) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send,
    {
        let (client, mut server) = tokio::io::duplex(64 * 1024);
        let server = tokio::spawn(async move {
            answers(&mut server, reply).await;
            then(server).await;
        });
        let r = bounded(secure(client, host, &tls)).await;
        if r.is_err() {
            server.abort();
        }
        r
    }

    /// Whether bytes written through the client end arrive at `server`.
    async fn passes(mut client: Box<dyn Io>, server: tokio::task::JoinHandle<Vec<u8>>) {
        client.write_all(b"ping").await.unwrap();
        client.flush().await.unwrap();
        assert_eq!(bounded(server).await.unwrap(), b"ping");
    }

    #[tokio::test]
    async fn disable_sends_nothing_before_the_start_up() {
        let (client, mut server) = tokio::io::duplex(1024);
        let c = bounded(secure(
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
        let c = negotiate(
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
            let r = negotiate(tls_of(mode, Some(CA)), "localhost", b"N", |_| async {}).await;
            match r {
                Err(ReplError::Tls(m)) => {
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
                let r = negotiate(tls_of(mode, None), "localhost", reply, |_| async {}).await;
                assert!(
                    matches!(&r, Err(ReplError::Protocol(m)) if m.contains("TLS request")),
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
        let r = bounded(secure(
            client,
            "localhost",
            &tls_of(PgSslMode::Require, None),
        ))
        .await;
        bounded(hang_up).await.unwrap();
        assert!(matches!(r, Err(ReplError::Io(_))), "{:?}", r.err());
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
    async fn handshake(tls: Tls, host: &str) -> Result<(), ReplError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let c = negotiate(tls, host, b"S", |s| async move {
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

    fn is_certificate_error(r: Result<(), ReplError>) -> bool {
        matches!(&r, Err(ReplError::Tls(m)) if m.contains("certificate"))
    }

    #[tokio::test]
    async fn s_starts_the_handshake_and_the_modes_check_what_libpq_checks() {
        // Chain and name.
        handshake(tls_of(PgSslMode::VerifyFull, Some(CA)), "localhost")
            .await
            .unwrap();
        let wrong_ca = handshake(tls_of(PgSslMode::VerifyFull, Some(OTHER_CA)), "localhost").await;
        assert!(is_certificate_error(wrong_ca));
        let wrong_name = handshake(tls_of(PgSslMode::VerifyFull, Some(CA)), "db.example.org").await;
        assert!(is_certificate_error(wrong_name));
        // The chain only.
        handshake(tls_of(PgSslMode::VerifyCa, Some(CA)), "db.example.org")
            .await
            .unwrap();
        let wrong_ca = handshake(tls_of(PgSslMode::VerifyCa, Some(OTHER_CA)), "localhost").await;
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
            let r = negotiate(
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
                matches!(r, Err(ReplError::Tls(_))),
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
            root_cert: Some(tls::RootCert::File("/nonexistent/bloomgate-ca.pem".into())),
        };
        let r = bounded(secure(client, "localhost", &bad)).await;
        assert!(
            matches!(&r, Err(ReplError::Tls(m)) if m.contains("/nonexistent/bloomgate-ca.pem")),
            "{:?}",
            r.err()
        );
        let mut b = Vec::new();
        bounded(server.read_to_end(&mut b)).await.unwrap();
        assert!(b.is_empty(), "sent {b:?}");
    }
}
