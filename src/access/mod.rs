//! Access lines: one per request, written outside `tracing`'s formatter
//! by one writer thread, at about the cost of a counter.
//!
//! `http::front` hands each answered request's [`Line`] to the process's
//! [`Logger`] ([`global`]) while the `bloomgate::access` target is enabled
//! at `info` (the switch operators know: `log.access`, `log.level`,
//! `RUST_LOG`), as the filter said when it was set: at start-up and on
//! SIGHUP (`telemetry::access_on`). The logger formats it ([`format`]: `human` or `json`, the
//! same fields as the rest of the log's frame) into the calling thread's
//! buffer, and its writer thread ([`writer`]) writes the buffers out in
//! batches, to standard output or to `log.access_file`.
//!
//! # Guarantees
//! - A request never waits for the log, and a line allocates nothing: it
//!   is formatted into capacity its thread reserved once
//!   (`tests/access_alloc.rs` counts it).
//! - Memory is bounded: each thread's buffer has a fixed capacity; when
//!   the writer falls behind, lines that do not fit are dropped whole and
//!   counted (`bloomgate_access_lines_dropped_total`, and a line a second
//!   saying how many), never queued without limit.
//! - Written within about 100 ms (`flush_every`), and on [`Logger::stop`]
//!   (the end of `server::run`, SIGTERM included) every line taken before
//!   it; lines logged after it are counted as dropped.
//! - An attack cannot fill the disk: filtered 404s (the filter answered,
//!   nothing else was touched) are logged up to `log.access_filtered_rate`
//!   a second ([`sample`]); the rest are counted
//!   (`bloomgate_access_lines_left_out_total`, and a line a second saying
//!   how many), while the request counters stay exact. Every request that
//!   reached the cache or the database has its line.
//! - SIGHUP ([`Logger::reopen`]) opens `log.access_file` again, after
//!   writing what came before to the old one: a rotation loses no line.
//! - Lines written + dropped + left out = requests logged: each is counted
//!   once ([`Logger::stats`]).
//!
//! No line holds a secret: the route is the template (`/users/{id}`,
//! never the key), and no header but `x-request-id` and `Cache-Status` is
//! read (no `Authorization`, no API key, no query string); a refusal's
//! `reason` is a fixed label, never what the credential held.

pub mod format;
pub mod sample;
pub mod writer;

use std::cell::RefCell;
use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use crate::config::{FilteredRate, LogConfig, LogFormat};
use crate::exposition::{Expose, Exposition, Labels};
pub use sample::UNLIMITED;
pub use writer::Sink;

/// Text escaped once, when it is known (at start-up: route templates,
/// resource names), for a JSON string: a line copies it as it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Escaped(std::borrow::Cow<'static, str>);

impl Escaped {
    pub const EMPTY: Escaped = Escaped(std::borrow::Cow::Borrowed(""));

    pub fn new(text: &str) -> Self {
        let mut out = Vec::with_capacity(text.len());
        format::escape(&mut out, text);
        Self(String::from_utf8(out).expect("escaping keeps UTF-8").into())
    }

    /// The escaped text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// `text`, which needs no escaping.
    #[cfg(test)]
    const fn from_static(text: &'static str) -> Self {
        Self(std::borrow::Cow::Borrowed(text))
    }
}

/// A string of a line: escaped as it is written (`Raw`), or copied as it
/// is (`Clean`) where whoever made it knows that it needs no escaping: a
/// method (`http` holds it to RFC 9110's token characters), one of the
/// lookup's fixed `Cache-Status` values, a request id the gateway made.
/// The formatter checks a `Clean` one in debug builds (every test).
#[derive(Clone, Copy, Debug)]
pub enum Text<'a> {
    /// No `"`, `\` or control character in it.
    Clean(&'a str),
    Raw(&'a str),
}

impl<'a> Text<'a> {
    pub fn as_str(self) -> &'a str {
        match self {
            Text::Clean(s) | Text::Raw(s) => s,
        }
    }
}

/// One request's access line.
#[derive(Clone, Copy, Debug)]
pub struct Line<'a> {
    pub method: Text<'a>,
    /// The route template (`/users/{id}`), empty when none matched.
    pub route: &'a Escaped,
    pub status: u16,
    pub cache_status: Text<'a>,
    /// The resource the route serves, empty for none.
    pub resource: &'a Escaped,
    pub duration: Duration,
    pub request_id: Text<'a>,
    /// None for a request made inside the process. Behind a trusted
    /// proxy, the caller its header named (`http::forwarded`).
    pub client: Option<IpAddr>,
    /// The connection's address, when a trusted proxy named the client;
    /// the field is left out otherwise.
    pub peer: Option<IpAddr>,
    /// Why a request was refused (401, 403, the `invalid_request` 400):
    /// `auth::Refusal`'s label, as `bloomgate_auth_failures_total` says
    /// it; the field is left out otherwise.
    pub reason: Option<&'static str>,
}

/// Which requests a line stands for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Class {
    /// Logged, always.
    Every,
    /// A filtered 404: logged up to `log.access_filtered_rate` a second.
    Filtered,
}

/// How a [`Logger`] writes.
#[derive(Clone, Debug)]
pub struct LoggerOptions {
    pub format: LogFormat,
    /// Filtered 404s a second, or [`UNLIMITED`].
    pub filtered_rate: u64,
    /// Each request thread's buffer: its lines beyond it, while the writer
    /// is behind, are dropped.
    pub slot_bytes: usize,
    /// The longest a line waits in its buffer.
    pub flush_every: Duration,
}

impl LoggerOptions {
    pub const SLOT_BYTES: usize = 256 * 1024;
    pub const FLUSH_EVERY: Duration = Duration::from_millis(100);

    pub fn from_config(cfg: &LogConfig) -> Self {
        Self {
            format: cfg.format,
            filtered_rate: rate(cfg.access_filtered_rate),
            slot_bytes: Self::SLOT_BYTES,
            flush_every: Self::FLUSH_EVERY,
        }
    }
}

fn rate(r: FilteredRate) -> u64 {
    match r {
        FilteredRate::PerSecond(n) => n,
        FilteredRate::Unlimited => UNLIMITED,
    }
}

/// The writer of access lines: formats on the caller's thread, writes on
/// its own.
#[derive(Debug)]
pub struct Logger {
    /// Tells this logger's buffers apart in a thread's cache.
    id: usize,
    json: bool,
    gate: sample::Gate,
    writer: Arc<writer::Writer>,
}

/// The calling thread's buffer of one logger; closed when the thread ends.
struct Mine {
    logger: usize,
    slot: Arc<writer::Slot>,
}

impl Drop for Mine {
    fn drop(&mut self) {
        self.slot.close();
    }
}

thread_local! {
    static MINE: RefCell<Option<Mine>> = const { RefCell::new(None) };
}

impl Logger {
    /// Starts the writer thread on `sink`.
    pub fn start(options: LoggerOptions, sink: Box<dyn Sink>) -> std::io::Result<Self> {
        static IDS: AtomicUsize = AtomicUsize::new(0);
        let json = options.format == LogFormat::Json;
        Ok(Self {
            id: IDS.fetch_add(1, Ordering::Relaxed),
            json,
            gate: sample::Gate::new(options.filtered_rate),
            writer: writer::Writer::start(sink, options.slot_bytes, options.flush_every, json)?,
        })
    }

    /// The logger `cfg` asks for: standard output, or `log.access_file`
    /// (an error if it cannot be opened, naming the key).
    pub fn from_config(cfg: &LogConfig) -> Result<Self, String> {
        let sink: Box<dyn Sink> = match &cfg.access_file {
            None => Box::new(writer::Stdout),
            Some(path) => Box::new(
                writer::File::open(path.clone())
                    .map_err(|e| format!("log.access_file: cannot open {}: {e}", path.display()))?,
            ),
        };
        Self::start(LoggerOptions::from_config(cfg), sink)
            .map_err(|e| format!("cannot start the access log's writer thread: {e}"))
    }

    /// Logs `line`, answered at `now` (a clock read the caller has made
    /// anyway, for the duration), unless it is a filtered 404 over the
    /// rate. Never waits for I/O, never allocates (but once per thread).
    pub fn log(&self, line: &Line<'_>, class: Class, now: Instant) {
        if class == Class::Filtered
            && !self.gate.permit(
                now.saturating_duration_since(self.writer.wall.epoch)
                    .as_secs(),
            )
        {
            self.writer.left_out.add(1);
            return;
        }
        if !self.writer.open() {
            self.writer.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let written = MINE.try_with(|mine| {
            let mut mine = mine.borrow_mut();
            if !matches!(&*mine, Some(m) if m.logger == self.id) {
                // The thread's first line (or a second logger, in tests).
                *mine = Some(Mine {
                    logger: self.id,
                    slot: self.writer.new_slot(),
                });
            }
            let slot = &mine.as_ref().expect("set above").slot;
            let mut buf = slot.lock();
            let bytes = &mut buf.bytes;
            if bytes.capacity() - bytes.len() < format::bound(line) {
                return false;
            }
            let stamp = self.writer.wall.at(now);
            if self.json {
                format::json(bytes, stamp, line);
            } else {
                format::human(bytes, stamp, line);
            }
            let len = bytes.len();
            buf.count += 1;
            drop(buf);
            self.writer.filled(slot, len);
            true
        });
        // Not written: the buffer is full, or the thread is ending.
        if written != Ok(true) {
            self.writer.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Opens `log.access_file` again (SIGHUP), after the lines logged
    /// before the call are written to the file open now. Returns at once.
    pub fn reopen(&self) {
        self.writer.reopen();
    }

    /// A new `log.access_filtered_rate` (SIGHUP).
    pub fn set_filtered_rate(&self, rate: FilteredRate) {
        self.gate.set_rate(self::rate(rate));
    }

    /// Waits until the lines logged before the call are written; false if
    /// `timeout` passed first.
    pub fn flush(&self, timeout: Duration) -> bool {
        self.writer.flush(timeout)
    }

    /// Writes every line logged before the call and ends the writer
    /// thread; false if `timeout` passed first (the destination is stuck;
    /// the thread is left to finish on its own). Lines logged after it are
    /// counted as dropped.
    pub fn stop(&self, timeout: Duration) -> bool {
        self.writer.stop(timeout)
    }

    pub fn stats(&self) -> AccessStats {
        AccessStats {
            lines: self.writer.lines.get(),
            dropped: self.writer.dropped.load(Ordering::Relaxed),
            left_out: self.writer.left_out.get(),
            filtered_rate: self.gate.rate(),
        }
    }
}

/// The access log at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AccessStats {
    /// Access lines written.
    pub lines: u64,
    /// Lines dropped: the writer was behind (a full buffer), the
    /// destination failed, or the logger had stopped.
    pub dropped: u64,
    /// Filtered 404s not logged, over `log.access_filtered_rate`.
    pub left_out: u64,
    pub filtered_rate: u64,
}

impl Expose for AccessStats {
    fn expose(&self, labels: Labels<'_>, out: &mut Exposition) {
        out.counter(
            "bloomgate_access_lines_total",
            "Access lines written.",
            labels,
            self.lines as f64,
        );
        out.counter(
            "bloomgate_access_lines_dropped_total",
            "Access lines dropped because the log's destination fell behind (or failed).",
            labels,
            self.dropped as f64,
        );
        out.counter(
            "bloomgate_access_lines_left_out_total",
            "Filtered 404s not logged, over log.access_filtered_rate (counted in \
             bloomgate_requests_total all the same).",
            labels,
            self.left_out as f64,
        );
    }
}

static GLOBAL: OnceLock<Logger> = OnceLock::new();

/// The process's logger, once [`install`]ed.
pub fn global() -> Option<&'static Logger> {
    GLOBAL.get()
}

/// Makes `logger` the process's; the one already installed stays (and
/// `logger` is handed back).
pub fn install(logger: Logger) -> Result<&'static Logger, Logger> {
    let mut logger = Some(logger);
    let installed = GLOBAL.get_or_init(|| logger.take().expect("taken once"));
    match logger {
        None => Ok(installed),
        Some(l) => Err(l),
    }
}

/// The process's access log counters (zeros before one is installed).
pub fn stats() -> AccessStats {
    global().map(Logger::stats).unwrap_or_default()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::sync::Mutex;

    /// A destination in memory that can be held still: `stall()` makes
    /// the next write wait until `release()`.
    #[derive(Clone, Default)]
    pub(crate) struct Memory {
        pub(crate) out: Arc<Mutex<Vec<u8>>>,
        held: Arc<(Mutex<(bool, bool)>, std::sync::Condvar)>,
    }

    impl Memory {
        pub(crate) fn stall(&self) {
            self.held.0.lock().unwrap().0 = true;
        }
        /// Waits until a write is held.
        pub(crate) fn wait_stalled(&self) {
            let (m, c) = &*self.held;
            let mut g = m.lock().unwrap();
            while !g.1 {
                g = c.wait(g).unwrap();
            }
        }
        pub(crate) fn release(&self) {
            let (m, c) = &*self.held;
            m.lock().unwrap().0 = false;
            c.notify_all();
        }
        pub(crate) fn lines(&self) -> Vec<String> {
            String::from_utf8(self.out.lock().unwrap().clone())
                .unwrap()
                .lines()
                .map(str::to_string)
                .collect()
        }
    }

    impl Sink for Memory {
        fn write_all(&mut self, batch: &[u8]) -> std::io::Result<()> {
            let (m, c) = &*self.held;
            let mut g = m.lock().unwrap();
            while g.0 {
                g.1 = true;
                c.notify_all();
                g = c.wait(g).unwrap();
            }
            g.1 = false;
            drop(g);
            self.out.lock().unwrap().extend_from_slice(batch);
            Ok(())
        }
    }

    pub(crate) fn options(filtered_rate: u64, slot_bytes: usize) -> LoggerOptions {
        LoggerOptions {
            format: LogFormat::Json,
            filtered_rate,
            slot_bytes,
            flush_every: Duration::from_millis(10),
        }
    }

    static ROUTE: Escaped = Escaped::from_static("/users/{id}");
    static USERS: Escaped = Escaped::from_static("users");

    pub(crate) fn line(id: &str) -> Line<'_> {
        Line {
            method: Text::Clean("GET"),
            route: &ROUTE,
            status: 404,
            cache_status: Text::Clean("bloomgate; detail=filter-absent"),
            resource: &USERS,
            duration: Duration::from_micros(3),
            request_id: Text::Raw(id),
            client: None,
            peer: None,
            reason: None,
        }
    }

    /// Written, dropped and left out add up to what was logged; filtered
    /// 404s over the rate are left out and said in a line, the others all
    /// written.
    #[test]
    fn filtered_404s_over_the_rate_are_counted_not_written() {
        let sink = Memory::default();
        let logger = Logger::start(options(5, 1 << 20), Box::new(sink.clone())).unwrap();
        let now = Instant::now();
        for i in 0..100 {
            logger.log(&line(&format!("f{i}")), Class::Filtered, now);
        }
        for i in 0..10 {
            logger.log(&line(&format!("e{i}")), Class::Every, now);
        }
        assert!(logger.stop(Duration::from_secs(30)));
        let stats = logger.stats();
        assert_eq!((stats.lines, stats.left_out, stats.dropped), (15, 95, 0));
        let lines: Vec<serde_json::Value> = sink
            .lines()
            .iter()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let ids: Vec<&str> = lines
            .iter()
            .filter_map(|l| l["fields"]["request_id"].as_str())
            .collect();
        assert_eq!(ids.iter().filter(|i| i.starts_with('f')).count(), 5);
        assert_eq!(ids.iter().filter(|i| i.starts_with('e')).count(), 10);
        let notice = lines
            .iter()
            .find(|l| l["fields"]["left_out"].is_u64())
            .expect("a line saying how many were left out");
        assert_eq!(notice["fields"]["left_out"], 95);
        assert_eq!(notice["target"], "bloomgate::access");
    }

    #[test]
    fn after_stop_lines_are_counted_as_dropped() {
        let logger =
            Logger::start(options(UNLIMITED, 1 << 16), Box::new(Memory::default())).unwrap();
        assert!(logger.stop(Duration::from_secs(30)));
        logger.log(&line("late"), Class::Every, Instant::now());
        assert_eq!(logger.stats().dropped, 1);
        assert_eq!(logger.stats().lines, 0);
    }
}
