//! Connections that hold a socket without asking for anything, over real
//! sockets: silent ones (no byte, half an HTTP/2 preface, a preface and
//! SETTINGS then nothing) are closed within `header_read_timeout` on both
//! listeners; idle HTTP/1 and HTTP/2 connections after `idle_timeout`; an
//! HTTP/2 peer that stops answering PINGs is detected; `max_connections`
//! holds new connections in the backlog until slots free up; and a process
//! out of file descriptors backs off and logs its failing `accept` once per
//! interval, then serves again once the silent sockets are gone.
//!
//! Timings are printed (`-- --nocapture`); the bounds asserted are the ones
//! the behaviour promises (a timeout and at most 1 s more), never a speed.

use crate::common;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use bloomgate::server::Admin;
use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const TOKEN: &str = "connections-test-token-0123456789";
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// A gateway on real sockets with `server` keys added, and its admin
/// listener when `admin` is set.
async fn serve(server: &str, admin: bool) -> (TestDb, Served, Option<SocketAddr>) {
    let db = TestDb::new().await;
    db.seed_users(10).await;
    let gw = gateway(config(
        &db.url,
        &format!("freshness = \"off\"\n[server]\n{server}"),
    ));
    let (admin, admin_addr) = if admin {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let admin = Admin {
            listener,
            token: TOKEN.into(),
        };
        (Some(admin), Some(addr))
    } else {
        (None, None)
    };
    let served = serve_socket(&gw, admin).await;
    // serve_socket's readiness client has gone: let its connection close so
    // it holds no slot.
    tokio::time::sleep(Duration::from_millis(200)).await;
    (db, served, admin_addr)
}

/// How much later than its timeout a connection may be closed.
const SLACK: Duration = Duration::from_secs(1);

/// Reads (discarding) until the server closes `s` (EOF or reset): the time
/// from `began`, or `None` if still open `timeout` + [`SLACK`] after it.
async fn closed_after(mut s: TcpStream, began: Instant, timeout: Duration) -> Option<Duration> {
    let mut buf = [0u8; 4096];
    let read_all = async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    };
    let limit = (began + timeout + SLACK).into();
    tokio::time::timeout_at(limit, read_all).await.ok()?;
    Some(began.elapsed())
}

/// A close `after` (`None`: never) checked against `timeout`: at most
/// [`SLACK`] later, and not before it (90 % of it: the test's clock starts
/// a little after the server's).
fn in_window(what: &str, after: Option<Duration>, timeout: Duration) -> Result<Duration, String> {
    match after {
        None => Err(format!("{what}: still open {:?} later", timeout + SLACK)),
        Some(a) if a < timeout.mul_f64(0.9) => Err(format!(
            "{what}: closed after {a:?}, before the {timeout:?} timeout"
        )),
        Some(a) => {
            println!("{what}: closed after {a:?}");
            Ok(a)
        }
    }
}

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

const DATA: u8 = 0;
const HEADERS: u8 = 1;
const RST_STREAM: u8 = 3;
const SETTINGS: u8 = 4;
const PING: u8 = 6;
const GOAWAY: u8 = 7;
const END_STREAM: u8 = 1;
const ACK: u8 = 1;
const END_HEADERS: u8 = 4;

/// A HEADERS frame for `GET path` on `stream`, HPACK-encoded by hand:
/// indexed `:method GET` and `:scheme http`, then `:path` and `:authority`
/// as literals without indexing.
fn get_headers(stream: u32, path: &str) -> Vec<u8> {
    let mut block = vec![0x82, 0x86, 0x04, path.len() as u8];
    block.extend_from_slice(path.as_bytes());
    block.extend_from_slice(&[0x01, 1, b'x']);
    frame(HEADERS, END_STREAM | END_HEADERS, stream, &block)
}

/// Reads one frame: (type, flags, stream, payload); `None` on close.
async fn read_frame(s: &mut TcpStream) -> Option<(u8, u8, u32, Vec<u8>)> {
    let mut head = [0u8; 9];
    s.read_exact(&mut head).await.ok()?;
    let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
    let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
    let mut payload = vec![0u8; len];
    s.read_exact(&mut payload).await.ok()?;
    Some((head[3], head[4], stream, payload))
}

/// An HTTP/2 (prior knowledge) connection that has completed one `GET
/// /healthz` (status 200 checked).
async fn h2_after_one_request(addr: SocketAddr) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(PREFACE).await.unwrap();
    s.write_all(&frame(SETTINGS, 0, 0, &[])).await.unwrap();
    s.write_all(&get_headers(1, "/healthz")).await.unwrap();
    let mut status_ok = false;
    loop {
        let (kind, flags, stream, payload) =
            tokio::time::timeout(Duration::from_secs(10), read_frame(&mut s))
                .await
                .expect("no response within 10 s")
                .expect("closed before the response");
        if kind == SETTINGS && flags & ACK == 0 {
            s.write_all(&frame(SETTINGS, ACK, 0, &[])).await.unwrap();
        }
        if kind == HEADERS && stream == 1 {
            // `:status 200` is the static table's entry 8.
            status_ok = payload.first() == Some(&0x88);
        }
        if (kind == HEADERS || kind == DATA) && stream == 1 && flags & END_STREAM != 0 {
            break;
        }
    }
    assert!(status_ok, "GET /healthz over HTTP/2 was not 200");
    s
}

/// A live but idle HTTP/2 client: answers PINGs and SETTINGS, sends no
/// request, until the server closes the connection. Checks the close is at
/// `idle` (see [`in_window`]) and preceded by a GOAWAY; returns how many
/// PINGs it answered.
async fn h2_closed_when_idle(mut s: TcpStream, what: &str, idle: Duration) -> usize {
    let began = Instant::now();
    let mut pings = 0;
    let mut goaway = false;
    let run = async {
        while let Some((kind, flags, _, payload)) = read_frame(&mut s).await {
            match kind {
                PING if flags & ACK == 0 => {
                    pings += 1;
                    if s.write_all(&frame(PING, ACK, 0, &payload)).await.is_err() {
                        break;
                    }
                }
                SETTINGS if flags & ACK == 0 => {
                    let _ = s.write_all(&frame(SETTINGS, ACK, 0, &[])).await;
                }
                GOAWAY => goaway = true,
                _ => {}
            }
        }
    };
    let limit = (began + idle + SLACK).into();
    let after = tokio::time::timeout_at(limit, run)
        .await
        .ok()
        .map(|()| began.elapsed());
    in_window(what, after, idle).unwrap_or_else(|e| panic!("{e}"));
    assert!(goaway, "{what}: closed without a GOAWAY");
    pings
}

/// Sends one keep-alive `GET path` over HTTP/1.1 on `s` and reads the whole
/// response; its status.
async fn h1_get(s: &mut TcpStream, path: &str) -> std::io::Result<u16> {
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
        .await?;
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = s.read(&mut buf).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        got.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&got).into_owned();
        if let Some(end) = text.find("\r\n\r\n") {
            let head = text[..end].to_ascii_lowercase();
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .map(|v| v.trim().parse().unwrap())
                .unwrap_or(0);
            if got.len() >= end + 4 + len {
                return Ok(text.split(' ').nth(1).unwrap().parse().unwrap());
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_silent_kind_is_closed_within_header_read_timeout_on_both_listeners() {
    let timeout = Duration::from_secs(1);
    // idle_timeout far above: only the first-request deadline may act.
    let (_db, served, admin) =
        serve("header_read_timeout = \"1s\"\nidle_timeout = \"60s\"", true).await;
    let kinds: [(&str, Vec<u8>); 3] = [
        ("no byte", Vec::new()),
        ("half the HTTP/2 preface", PREFACE[..12].to_vec()),
        ("HTTP/2 preface + SETTINGS, then silence", {
            let mut b = PREFACE.to_vec();
            b.extend(frame(SETTINGS, 0, 0, &[]));
            b
        }),
    ];
    let mut checks = Vec::new();
    for (listener, addr) in [("public", served.addr), ("admin", admin.unwrap())] {
        for (kind, bytes) in &kinds {
            let (kind, bytes) = (*kind, bytes.clone());
            checks.push(tokio::spawn(async move {
                let mut s = TcpStream::connect(addr).await.unwrap();
                let began = Instant::now();
                s.write_all(&bytes).await.unwrap();
                let after = closed_after(s, began, timeout).await;
                in_window(&format!("{listener}: {kind}"), after, timeout)
            }));
        }
    }
    let mut wrong = Vec::new();
    for c in checks {
        if let Err(e) = c.await.unwrap() {
            wrong.push(e);
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
    served.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_http1_keep_alive_connection_is_closed_after_idle_timeout() {
    let idle = Duration::from_secs(3);
    let (_db, served, _) =
        serve("header_read_timeout = \"1s\"\nidle_timeout = \"3s\"", false).await;
    let mut s = TcpStream::connect(served.addr).await.unwrap();
    assert_eq!(h1_get(&mut s, "/users/1").await.unwrap(), 200);
    // Idle for longer than header_read_timeout: still open, still served.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let second = h1_get(&mut s, "/users/2").await;
    assert!(
        matches!(second, Ok(200)),
        "a keep-alive connection idle 2 s (header_read_timeout 1 s, idle_timeout 3 s) was not served: {second:?}"
    );
    let after = closed_after(s, Instant::now(), idle).await;
    in_window(
        "idle HTTP/1 connection, from its last response",
        after,
        idle,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    served.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_http2_connection_gets_pings_then_goaway_after_idle_timeout() {
    let idle = Duration::from_secs(3);
    let (_db, served, _) =
        serve("header_read_timeout = \"1s\"\nidle_timeout = \"3s\"", false).await;
    let s = h2_after_one_request(served.addr).await;
    let what = "idle HTTP/2 connection, from its last response";
    let pings = h2_closed_when_idle(s, what, idle).await;
    println!("{pings} keep-alive PINGs answered while idle");
    assert!(pings >= 1, "no keep-alive PING in {idle:?} of silence");
    served.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_peer_that_stops_answering_pings_is_closed() {
    // The PING goes out after header_read_timeout of silence and must be
    // answered within header_read_timeout: 2 s here, far below idle_timeout.
    let (_db, served, _) = serve(
        "header_read_timeout = \"1s\"\nidle_timeout = \"60s\"",
        false,
    )
    .await;
    let s = h2_after_one_request(served.addr).await;
    let timeout = Duration::from_secs(2);
    let after = closed_after(s, Instant::now(), timeout).await;
    in_window("HTTP/2 peer answering no PING", after, timeout).unwrap_or_else(|e| panic!("{e}"));
    served.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_streams_the_client_never_ends_neither_pile_up_nor_keep_the_connection_open() {
    // 150 GETs whose HEADERS lack END_STREAM: the client never finishes
    // sending. Each is answered and reset (RST_STREAM NO_ERROR, as RFC 9113
    // 8.1 asks of a server that answers early), and the connection, left
    // with nothing being handled, is closed after idle_timeout.
    let idle = Duration::from_secs(3);
    let (_db, served, _) =
        serve("header_read_timeout = \"1s\"\nidle_timeout = \"3s\"", false).await;
    let mut s = TcpStream::connect(served.addr).await.unwrap();
    s.write_all(PREFACE).await.unwrap();
    s.write_all(&frame(SETTINGS, 0, 0, &[])).await.unwrap();
    let streams = 150u32;
    for i in 0..streams {
        let mut f = get_headers(2 * i + 1, "/healthz");
        f[4] = END_HEADERS;
        s.write_all(&f).await.unwrap();
    }
    let (mut answered, mut reset) = (0, 0);
    while answered < streams || reset < streams {
        let (kind, flags, stream, payload) =
            tokio::time::timeout(Duration::from_secs(10), read_frame(&mut s))
                .await
                .unwrap_or_else(|_| panic!("{answered} answered, {reset} reset after 10 s"))
                .expect("closed while answering");
        match kind {
            HEADERS if stream % 2 == 1 => {
                assert_eq!(payload.first(), Some(&0x88), "stream {stream} not 200");
                answered += 1;
            }
            RST_STREAM => {
                assert_eq!(payload, [0, 0, 0, 0], "stream {stream} reset with an error");
                reset += 1;
            }
            SETTINGS if flags & ACK == 0 => {
                s.write_all(&frame(SETTINGS, ACK, 0, &[])).await.unwrap();
            }
            _ => {}
        }
    }
    println!("{streams} unfinished streams: {answered} answered, {reset} reset");
    let what = "connection whose streams the client never ended, from the last answer";
    h2_closed_when_idle(s, what, idle).await;
    served.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_connection_cap_new_clients_wait_and_are_served_once_silent_ones_time_out() {
    let (_db, served, _) = serve("header_read_timeout = \"2s\"\nmax_connections = 4", false).await;
    let addr = served.addr;
    let mut silent = Vec::new();
    for _ in 0..4 {
        silent.push(TcpStream::connect(addr).await.unwrap());
    }
    let began = Instant::now();
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Over the cap: connected (the kernel's backlog) but not served yet.
    let mut raw = TcpStream::connect(addr).await.unwrap();
    raw.write_all(b"GET /users/1 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut byte = [0u8; 1];
    let early = tokio::time::timeout(Duration::from_millis(500), raw.read(&mut byte)).await;
    assert!(
        early.is_err(),
        "a fifth connection was answered while 4 silent ones held every slot of max_connections = 4: {early:?}"
    );
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let (raw_resp, resp) = tokio::join!(
        async {
            let mut rest = Vec::new();
            raw.read_to_end(&mut rest)
                .await
                .map(|_| String::from_utf8_lossy(&rest).into_owned())
        },
        client.get(format!("http://{addr}/users/1")).send()
    );
    let raw_resp = raw_resp.unwrap();
    assert!(raw_resp.starts_with("HTTP/1.1 200"), "{raw_resp}");
    let resp = resp.expect("a real client got no answer after the silent connections timed out");
    assert_eq!(resp.status(), StatusCode::OK);
    println!(
        "at the cap: served {:?} after the silent connections were opened (header_read_timeout 2 s)",
        began.elapsed()
    );
    drop(silent);
    served.shutdown().await.unwrap();
}

/// Reads one whole HTTP/1.1 answer from `s`: its head, lower-cased; or how
/// the connection ended before it.
async fn whole_answer(s: &mut TcpStream) -> Result<String, String> {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        if let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&got[..end + 4]).to_ascii_lowercase();
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .map_or(0, |v| v.trim().parse().unwrap());
            if got.len() >= end + 4 + len {
                return Ok(head);
            }
        }
        match s.read(&mut buf).await {
            Ok(0) => return Err(format!("closed after {} bytes of answer", got.len())),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) => return Err(format!("{e} after {} bytes of answer", got.len())),
        }
    }
}

/// The grace a connection accepted before the stop, or taken from the
/// backlog at it, has to send its first request (`server::conn::GRACE`).
const FIRST_REQUEST_GRACE: Duration = Duration::from_secs(1);

/// At the stop the listener closes, but the connections already in its
/// backlog (held there by `max_connections = 1`), each with its request
/// sent, are taken first and answered with `Connection: close`, not
/// reset; the kept-alive connection idle after an answer is closed; new
/// connections are then refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_stop_the_connections_in_the_listen_backlog_are_answered() {
    let (_db, served, _) = serve("max_connections = 1", false).await;
    let addr = served.addr;
    let mut held = TcpStream::connect(addr).await.unwrap();
    assert_eq!(h1_get(&mut held, "/users/1").await.unwrap(), 200);
    let mut waiting = Vec::new();
    for k in 2..5 {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(format!("GET /users/{k} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
            .await
            .unwrap();
        waiting.push(s);
    }
    let mut byte = [0u8; 1];
    let early = tokio::time::timeout(Duration::from_millis(300), waiting[0].peek(&mut byte)).await;
    assert!(
        early.is_err(),
        "answered over max_connections = 1 before the stop: {early:?}"
    );
    let began = Instant::now();
    let stopping = tokio::spawn(served.shutdown());
    for (i, s) in waiting.iter_mut().enumerate() {
        let head = whole_answer(s)
            .await
            .unwrap_or_else(|e| panic!("connection {i} of the backlog, its request sent: {e}"));
        assert!(head.starts_with("http/1.1 200"), "{head}");
        assert!(head.contains("\r\nconnection: close\r\n"), "{head}");
    }
    assert!(
        closed_after(held, began, Duration::ZERO).await.is_some(),
        "a connection idle after its answer still open {SLACK:?} after the stop"
    );
    stopping.await.unwrap().unwrap();
    let after = TcpStream::connect(addr).await.map(|_| ());
    assert_eq!(
        after.map_err(|e| e.kind()),
        Err(std::io::ErrorKind::ConnectionRefused)
    );
}

/// At the stop a connection that has not sent its first request yet (a
/// client that has just connected) is given [`FIRST_REQUEST_GRACE`] to send
/// it, and is answered with `Connection: close`, then closed; one that
/// sends nothing is closed at the grace's end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_stop_a_connection_yet_to_send_its_first_request_is_answered() {
    let (_db, served, _) = serve("", false).await;
    let addr = served.addr;
    let mut late = TcpStream::connect(addr).await.unwrap();
    let silent = TcpStream::connect(addr).await.unwrap();
    // Accepted (no cap here): a request on another connection is answered
    // after the accept loop took these two.
    let mut other = TcpStream::connect(addr).await.unwrap();
    assert_eq!(h1_get(&mut other, "/users/1").await.unwrap(), 200);
    drop(other);
    let began = Instant::now();
    let stopping = tokio::spawn(served.shutdown());
    tokio::time::sleep(FIRST_REQUEST_GRACE / 3).await;
    late.write_all(b"GET /users/2 HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let head = whole_answer(&mut late)
        .await
        .unwrap_or_else(|e| panic!("the first request, sent after the stop: {e}"));
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(head.contains("\r\nconnection: close\r\n"), "{head}");
    let mut rest = Vec::new();
    assert_eq!(
        late.read_to_end(&mut rest).await.unwrap(),
        0,
        "closed after it"
    );
    in_window(
        "a connection silent at the stop",
        closed_after(silent, began, FIRST_REQUEST_GRACE).await,
        FIRST_REQUEST_GRACE,
    )
    .unwrap();
    stopping.await.unwrap().unwrap();
}

/// The gateway binary in a child process with `ulimit -n 64`, its stdout
/// collected; killed on drop.
struct Child {
    child: std::process::Child,
    log: Arc<Mutex<String>>,
    dir: std::path::PathBuf,
}

impl Child {
    /// `config` runs with `ulimit -n nofile` (soft and hard limit), on
    /// 127.0.0.1 port 0.
    fn start(mut config: bloomgate::config::Config, nofile: u32) -> Self {
        config.server.listen = "127.0.0.1:0".parse().unwrap();
        config.admin.listen = "127.0.0.1:9".parse().unwrap(); // off: no token
        let dir = std::env::temp_dir().join(format!("bloomgate-conn-{:x}", rand::random::<u64>()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("bloomgate.toml");
        std::fs::write(&path, toml::to_string(&config).unwrap()).unwrap();
        let mut child = std::process::Command::new("sh")
            .arg("-c")
            .arg(format!(
                "ulimit -n {nofile} && exec \"$0\" serve --config \"$1\""
            ))
            .arg(env!("CARGO_BIN_EXE_bloomgate"))
            .arg(&path)
            .env_remove("DATABASE_URL")
            .env_remove("BLOOMGATE_ADMIN_TOKEN")
            .env_remove("RUST_LOG")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let log = Arc::new(Mutex::new(String::new()));
        for pipe in [
            Box::new(child.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>,
            Box::new(child.stderr.take().unwrap()),
        ] {
            let log = log.clone();
            std::thread::spawn(move || {
                use std::io::BufRead;
                for line in std::io::BufReader::new(pipe).lines() {
                    let Ok(line) = line else { return };
                    let mut l = log.lock().unwrap();
                    l.push_str(&line);
                    l.push('\n');
                }
            });
        }
        Self { child, log, dir }
    }

    fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// The public address, from the "listening" log line.
    async fn addr(&self) -> SocketAddr {
        let began = Instant::now();
        loop {
            let log = self.log();
            if let Some(addr) = log
                .lines()
                .filter(|l| l.contains("listening") && !l.contains("admin"))
                .find_map(|l| l.split("addr=").nth(1))
                .and_then(|a| a.split_whitespace().next())
            {
                return addr.parse().unwrap();
            }
            assert!(
                began.elapsed() < Duration::from_secs(20),
                "never listened:\n{log}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_file_descriptors_accept_backs_off_logs_once_and_recovers() {
    let db = TestDb::new().await;
    db.seed_users(10).await;
    let mut config = config(&db.url, "freshness = \"off\"");
    config.database.pool_size = 2;
    config.server.header_read_timeout = Duration::from_secs(3);
    let gw = Child::start(config, 64);
    let addr = gw.addr().await;
    wait_ready(addr, || gw.log()).await;

    // More silent sockets than the process has descriptors: the kernel
    // completes every handshake, the gateway's accept fails with EMFILE.
    let before = gw.log().matches("accept failed").count();
    let flooded = Instant::now();
    let mut silent = Vec::new();
    for _ in 0..120 {
        silent.push(TcpStream::connect(addr).await.unwrap());
    }
    tokio::time::sleep_until((flooded + Duration::from_millis(2500)).into()).await;
    let log = gw.log();
    let lines = log.matches("accept failed").count() - before;
    println!(
        "{lines} \"accept failed\" lines in {:?} of EMFILE",
        flooded.elapsed()
    );
    assert!(
        lines >= 1,
        "accept never failed: the test did not exhaust descriptors:\n{log}"
    );
    assert!(
        lines <= 3,
        "{lines} \"accept failed\" lines in 2.5 s:\n{log}"
    );

    // The silent ones time out, batch after batch: a real client is served.
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let asked = Instant::now();
    let resp = client.get(format!("http://{addr}/users/1")).send().await;
    let resp = resp.unwrap_or_else(|e| panic!("real client locked out: {e}\n{}", gw.log()));
    assert_eq!(resp.status(), StatusCode::OK);
    println!(
        "real client behind 120 silent sockets served after {:?}",
        asked.elapsed()
    );
    drop(silent);

    // Warned at start-up: 10,000 connections cannot fit in 64 descriptors.
    let log = gw.log();
    assert!(
        log.contains("server.max_connections") && log.contains("RLIMIT_NOFILE"),
        "no start-up warning that max_connections exceeds the descriptor limit:\n{log}"
    );
}

/// Sends `request` raw on a new connection; the status and the head.
async fn raw(addr: SocketAddr, request: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(request.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !got.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = s.read(&mut buf).await.unwrap();
        assert!(n > 0, "closed before a response to {request:?}");
        got.extend_from_slice(&buf[..n]);
    }
    let head = String::from_utf8_lossy(&got).to_ascii_lowercase();
    let status = head[9..12].parse().unwrap();
    (status, head)
}

/// RFC 9112 §3.2: an HTTP/1.1 request without exactly one `Host` is 400
/// (HTTP/1.0 may omit it); `CONNECT` and `OPTIONS *` are methods the
/// gateway does not take: 405 with `Allow`, as the book's response table says;
/// the admin API takes its auth-scheme in any case (RFC 9110 §11.1).
#[tokio::test]
async fn hosts_methods_and_schemes_are_read_as_the_rfcs_say() {
    let (_db, served, admin) = serve("", true).await;
    let addr = served.addr;
    for (request, want) in [
        ("GET /users/3 HTTP/1.1\r\n\r\n", 400),
        ("GET /users/3 HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400),
        ("GET /users/3 HTTP/1.1\r\nHost: a\r\n\r\n", 200),
        ("GET /users/3 HTTP/1.0\r\n\r\n", 200),
        (
            "CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n",
            405,
        ),
        ("OPTIONS * HTTP/1.1\r\nHost: a\r\n\r\n", 405),
        ("DELETE /users/3 HTTP/1.1\r\nHost: a\r\n\r\n", 405),
    ] {
        let (status, head) = raw(addr, request).await;
        assert_eq!(status, want, "{request:?}: {head}");
        if want == 405 {
            assert!(head.contains("\r\nallow: get,head"), "{request:?}: {head}");
        }
        if want == 400 {
            assert!(head.contains("application/json"), "{head}");
        }
    }
    let admin = admin.unwrap();
    for scheme in ["Bearer", "bearer", "BEARER"] {
        let (status, _) = raw(
            admin,
            &format!(
                "GET /admin/stats HTTP/1.1\r\nHost: a\r\nAuthorization: {scheme} {TOKEN}\r\n\r\n"
            ),
        )
        .await;
        assert_eq!(status, 200, "{scheme}");
    }
    let (status, _) = raw(
        admin,
        &format!("GET /admin/stats HTTP/1.1\r\nHost: a\r\nAuthorization: Basic {TOKEN}\r\n\r\n"),
    )
    .await;
    assert_eq!(status, 401);
    served.shutdown().await.unwrap();
}
