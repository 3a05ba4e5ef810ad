//! A gateway shut down under pooled keep-alive connections, as a load
//! balancer's upstream pool or a service mesh holds them (SIGTERM, then
//! `server.shutdown_drain`): the drain asks each client to leave with its
//! next answer (`Connection: close`), so no request sent on a kept-alive
//! connection meets the close when the listeners stop. Clients that
//! reconnect when told to leave, as a balancer's pool does, keep new
//! connections arriving until the listener closes: those accepted just
//! before its close, and those still in its listen backlog then, are
//! answered too. The clients here are raw HTTP/1.1 over TCP, so nothing
//! retries a request for them.

use crate::binary;
use crate::common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use binary::*;
use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// What the clients saw.
#[derive(Default)]
struct Tally {
    answered: AtomicU64,
    /// Answers that said `Connection: close`.
    told_to_leave: AtomicU64,
    /// Requests sent on a connection that had answered before, which then
    /// closed without an answer: the request lost.
    lost: std::sync::Mutex<Vec<String>>,
    /// Answers other than 200.
    not_ok: std::sync::Mutex<Vec<String>>,
}

/// One answer on `conn`: `None` when the connection ended first; else
/// the head (lower-cased) and whether it said `Connection: close`.
async fn exchange(conn: &mut TcpStream, path: &str) -> Option<(String, bool)> {
    let req = format!("GET {path} HTTP/1.1\r\nHost: gateway\r\n\r\n");
    conn.write_all(req.as_bytes()).await.ok()?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(at) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
        let n = conn.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    while buf.len() < head_end + length {
        let n = conn.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let close = head.lines().any(|l| l.trim() == "connection: close");
    Some((head, close))
}

/// Asks for rows on kept-alive connections until `done`: a new
/// connection whenever the gateway says `Connection: close` or closes one.
async fn client(addr: SocketAddr, tally: Arc<Tally>, done: Arc<AtomicBool>, seed: u64) {
    let mut k = seed;
    while !done.load(Ordering::Relaxed) {
        let Ok(mut conn) = TcpStream::connect(addr).await else {
            tokio::time::sleep(Duration::from_millis(5)).await;
            continue;
        };
        let mut answered_here = 0u64;
        loop {
            k = k % 10 + 1;
            let path = format!("/users/{k}");
            match exchange(&mut conn, &path).await {
                None => {
                    if answered_here > 0 {
                        tally.lost.lock().unwrap().push(format!(
                            "{path}: the connection closed under it after {answered_here} answers"
                        ));
                    }
                    break;
                }
                Some((head, close)) => {
                    answered_here += 1;
                    tally.answered.fetch_add(1, Ordering::Relaxed);
                    if !head.starts_with("http/1.1 200") {
                        let status = head.lines().next().unwrap_or_default().to_string();
                        tally
                            .not_ok
                            .lock()
                            .unwrap()
                            .push(format!("{path}: {status}"));
                    }
                    if close {
                        tally.told_to_leave.fetch_add(1, Ordering::Relaxed);
                        break;
                    }
                }
            }
            if done.load(Ordering::Relaxed) {
                return;
            }
        }
    }
}

/// Sixteen pooled connections asking without pause; SIGTERM. During the
/// drain each is told to leave with an answer, and no request sent on a
/// connection that had answered before goes unanswered; the process then
/// exits 0.
#[tokio::test]
async fn a_drain_under_pooled_connections_loses_no_request() {
    let db = TestDb::new().await;
    db.seed_users(10).await;
    let dir = tempdir();
    let config = write_config(&dir, &db.url, "level = \"info\"\naccess = false", TOKEN_A);
    let text = std::fs::read_to_string(&config)
        .unwrap()
        .replace("shutdown_drain = \"30s\"", "shutdown_drain = \"2s\"");
    std::fs::write(&config, text).unwrap();
    let mut gw = Running::start(&config, &[]);
    let addr = gw.addr(false).await;
    wait_ready(addr, || gw.log()).await;

    let tally = Arc::new(Tally::default());
    let done = Arc::new(AtomicBool::new(false));
    const CONNECTIONS: u64 = 16;
    let clients: Vec<_> = (0..CONNECTIONS)
        .map(|i| tokio::spawn(client(addr, tally.clone(), done.clone(), i)))
        .collect();
    eventually("every connection answered a few times", || async {
        tally.answered.load(Ordering::Relaxed) > 20 * CONNECTIONS
    })
    .await;
    assert_eq!(
        tally.told_to_leave.load(Ordering::Relaxed),
        0,
        "nobody is told to leave before the drain"
    );
    gw.signal("TERM");
    assert!(gw.exited().await.success(), "{}", gw.log());
    done.store(true, Ordering::Relaxed);
    for c in clients {
        c.await.unwrap();
    }
    let lost = tally.lost.lock().unwrap().clone();
    let not_ok = tally.not_ok.lock().unwrap().clone();
    let told = tally.told_to_leave.load(Ordering::Relaxed);
    eprintln!(
        "{} answered, {told} told to leave, {} lost",
        tally.answered.load(Ordering::Relaxed),
        lost.len()
    );
    assert!(
        lost.is_empty(),
        "{} requests lost on kept-alive connections: {:?}",
        lost.len(),
        &lost[..lost.len().min(5)]
    );
    assert!(not_ok.is_empty(), "{not_ok:?}");
    assert!(
        told >= CONNECTIONS,
        "each pooled connection told to leave during the drain: {told}"
    );
}

/// How one request on an open connection ended, for
/// [`a_reconnecting_pool_loses_no_request_at_the_drain_s_end`].
enum Asked {
    /// A whole answer: its status line and whether it said `Connection:
    /// close`.
    Answered(String, bool),
    /// The connection ended before a whole answer: the request lost.
    Lost(String),
}

/// [`exchange`], saying how a request was lost.
async fn ask(conn: &mut TcpStream, path: &str) -> Asked {
    let req = format!("GET {path} HTTP/1.1\r\nHost: gateway\r\n\r\n");
    if let Err(e) = conn.write_all(req.as_bytes()).await {
        return Asked::Lost(format!("write: {e}"));
    }
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let mut head_end = None;
    loop {
        if head_end.is_none() {
            head_end = buf
                .windows(4)
                .position(|w| w == b"\r\n\r\n")
                .map(|at| at + 4);
        }
        if let Some(end) = head_end {
            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
            let length: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0);
            if buf.len() >= end + length {
                let close = head.lines().any(|l| l.trim() == "connection: close");
                let status = head.lines().next().unwrap_or_default().to_string();
                return Asked::Answered(status, close);
            }
        }
        match conn.read(&mut chunk).await {
            Ok(0) => return Asked::Lost(format!("closed after {} bytes of answer", buf.len())),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) => return Asked::Lost(format!("read after {} bytes: {e}", buf.len())),
        }
    }
}

/// What the reconnecting clients saw.
#[derive(Default)]
struct Pool {
    answered: AtomicU64,
    told_to_leave: AtomicU64,
    connections: AtomicU64,
    /// Connections that failed at `connect`, no request sent: refused
    /// once the listener had closed, or reset by its close during the
    /// handshake (a client whose handshake the kernel completes in the
    /// instant between the last `accept` and the close: 3 runs in 156
    /// met one).
    refused: AtomicU64,
    /// Requests sent on an open connection, first or not, that got no
    /// whole answer.
    lost: std::sync::Mutex<Vec<String>>,
    /// Connections that failed otherwise at `connect`, and answers other
    /// than 200.
    odd: std::sync::Mutex<Vec<String>>,
}

/// A client of a balancer's upstream pool: a request at a time on a kept-
/// alive connection, and a new connection at once whenever an answer says
/// `Connection: close`. Until `done`, or `MAX_REQUESTS`.
async fn reconnecting_client(addr: SocketAddr, pool: Arc<Pool>, done: Arc<AtomicBool>, seed: u64) {
    const MAX_REQUESTS: u64 = 200_000;
    let mut k = seed;
    let mut sent = 0u64;
    while !done.load(Ordering::Relaxed) && sent < MAX_REQUESTS {
        let mut conn = match TcpStream::connect(addr).await {
            Ok(conn) => conn,
            Err(e) => {
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::ConnectionReset
                ) {
                    pool.refused.fetch_add(1, Ordering::Relaxed);
                } else {
                    pool.odd.lock().unwrap().push(format!("connect: {e}"));
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
                continue;
            }
        };
        let _ = conn.set_nodelay(true);
        pool.connections.fetch_add(1, Ordering::Relaxed);
        let mut answered_here = 0u64;
        while sent < MAX_REQUESTS {
            k = k % 10 + 1;
            let path = format!("/users/{k}");
            sent += 1;
            match ask(&mut conn, &path).await {
                Asked::Lost(how) => {
                    pool.lost.lock().unwrap().push(format!(
                        "{path}, request {} on its connection: {how}",
                        answered_here + 1
                    ));
                    break;
                }
                Asked::Answered(status, close) => {
                    answered_here += 1;
                    pool.answered.fetch_add(1, Ordering::Relaxed);
                    if !status.starts_with("http/1.1 200") {
                        pool.odd.lock().unwrap().push(format!("{path}: {status}"));
                    }
                    if close {
                        pool.told_to_leave.fetch_add(1, Ordering::Relaxed);
                        break;
                    }
                }
            }
            if done.load(Ordering::Relaxed) {
                return;
            }
        }
    }
}

/// Sixteen clients of a balancer's pool, each opening a new connection at
/// once when told `Connection: close`, so that new connections keep
/// arriving until the listener closes; SIGTERM. Every request sent on a
/// connection the gateway took, the first on a connection as well as
/// later ones, gets a whole answer: connections accepted just before the
/// drain's end and those still in the listen backlog then are answered,
/// not closed with their request unread. After the close a connection is
/// refused at `connect`, never taken and dropped. The one loss left is the
/// close's own race: a handshake the kernel completes between the last
/// `accept` and the close is reset, and when its client has written its
/// request by then, that request is lost (1 run in 181 on a loaded
/// machine, one request; `docs/src/production.md`, "Signals"), so one loss
/// is let through: before the backlog and the first-request grace, 11 to
/// 15 were lost in 5 runs of 7 (the deterministic tests of each cause are
/// in `tests/it/server/connections.rs`, `at_the_stop_…`).
#[tokio::test]
async fn a_reconnecting_pool_loses_no_request_at_the_drain_s_end() {
    let db = TestDb::new().await;
    db.seed_users(10).await;
    let dir = tempdir();
    let config = write_config(&dir, &db.url, "level = \"info\"\naccess = false", TOKEN_A);
    let text = std::fs::read_to_string(&config)
        .unwrap()
        .replace("shutdown_drain = \"30s\"", "shutdown_drain = \"2s\"");
    std::fs::write(&config, text).unwrap();
    let mut gw = Running::start(&config, &[]);
    let addr = gw.addr(false).await;
    wait_ready(addr, || gw.log()).await;

    let pool = Arc::new(Pool::default());
    let done = Arc::new(AtomicBool::new(false));
    const CONNECTIONS: u64 = 16;
    let clients: Vec<_> = (0..CONNECTIONS)
        .map(|i| tokio::spawn(reconnecting_client(addr, pool.clone(), done.clone(), i)))
        .collect();
    eventually("every connection answered a few times", || async {
        pool.answered.load(Ordering::Relaxed) > 20 * CONNECTIONS
    })
    .await;
    assert_eq!(pool.told_to_leave.load(Ordering::Relaxed), 0);
    let before = pool.connections.load(Ordering::Relaxed);
    gw.signal("TERM");
    assert!(gw.exited().await.success(), "{}", gw.log());
    done.store(true, Ordering::Relaxed);
    for c in clients {
        c.await.unwrap();
    }
    let lost = pool.lost.lock().unwrap().clone();
    let odd = pool.odd.lock().unwrap().clone();
    let connections = pool.connections.load(Ordering::Relaxed);
    eprintln!(
        "{} answered, {} told to leave, {} connections ({before} before SIGTERM), {} refused \
         or reset at connect, {} lost",
        pool.answered.load(Ordering::Relaxed),
        pool.told_to_leave.load(Ordering::Relaxed),
        connections,
        pool.refused.load(Ordering::Relaxed),
        lost.len()
    );
    assert!(
        lost.len() <= 1,
        "{} requests lost: {:?}",
        lost.len(),
        &lost[..lost.len().min(8)]
    );
    assert!(odd.is_empty(), "{odd:?}");
    // The clients did reconnect through the drain: the end met new
    // connections, not only a pool that had gone quiet.
    assert!(
        connections > before + 10 * CONNECTIONS,
        "{connections} connections, {before} before SIGTERM"
    );
}
