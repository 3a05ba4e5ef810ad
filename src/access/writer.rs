//! The buffers request threads write lines into, and the one thread that
//! writes them out.
//!
//! # Guarantees (tested below and in `access`'s tests)
//! - A request never waits for the log: a line is copied into its
//!   thread's buffer (a [`Slot`]) under a lock only the writer also takes,
//!   for as long as it takes to swap the buffer for an empty one.
//! - Bounded: a slot never grows past the capacity it was made with. A
//!   line that does not fit (the writer is behind: a slow disk, a stalled
//!   pipe) is dropped and counted, whole: no partial line is ever written.
//! - Every line accepted is written: at least every `flush_every` (100 ms)
//!   the writer takes every slot's lines; [`Writer::stop`] takes what is
//!   left and writes it before the thread ends; lines logged after it are
//!   counted as dropped.
//! - Lines of one thread are written in the order they were logged; the
//!   lines of different threads interleave batch by batch (each line keeps
//!   its own timestamp).
//! - A reopen ([`Writer::reopen`]) first writes every line accepted before
//!   it to the old file, then opens the path again: after logrotate moved
//!   the file, the lines logged before the SIGHUP are in the moved file,
//!   the ones logged once the reopen is done (a [`Writer::flush`] after
//!   it) in the new one, and the ones in between in either; none in
//!   neither, none in both.

use std::io::Write as _;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::Thread;
use std::time::{Duration, Instant};

use super::format::{Stamp, notice};
use crate::counter::Counter;

/// Where batches of lines go.
pub trait Sink: Send {
    /// Writes the whole batch (whole lines).
    fn write_all(&mut self, batch: &[u8]) -> std::io::Result<()>;
    /// Opens the destination again (a file moved by logrotate); a no-op
    /// for a stream.
    fn reopen(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The process's standard output, shared with the rest of the log: a
/// batch is written under stdout's lock, so it never cuts into another
/// line.
pub struct Stdout;

impl Sink for Stdout {
    fn write_all(&mut self, batch: &[u8]) -> std::io::Result<()> {
        let mut out = std::io::stdout().lock();
        out.write_all(batch)?;
        out.flush()
    }
}

/// A file, appended to, opened again by [`Sink::reopen`].
pub struct File {
    path: PathBuf,
    file: std::fs::File,
}

impl File {
    pub fn open(path: PathBuf) -> std::io::Result<Self> {
        let file = Self::open_path(&path)?;
        Ok(Self { path, file })
    }

    fn open_path(path: &std::path::Path) -> std::io::Result<std::fs::File> {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
    }
}

impl Sink for File {
    fn write_all(&mut self, batch: &[u8]) -> std::io::Result<()> {
        self.file.write_all(batch)
    }
    fn reopen(&mut self) -> std::io::Result<()> {
        // The old file stays open until the new one is: if the path cannot
        // be opened, lines keep going where they went.
        self.file = Self::open_path(&self.path)?;
        Ok(())
    }
}

/// One request thread's buffer.
#[derive(Debug)]
pub(super) struct Slot {
    buf: Mutex<Lines>,
    /// The writer was woken for this slot's fill and has not drained it yet.
    woken: AtomicBool,
    /// The thread that wrote into it has ended: drained once more, then
    /// forgotten.
    closed: AtomicBool,
}

/// Whole lines, and how many (counted as they go in: counting them in
/// the writer would read every byte again).
#[derive(Debug, Default)]
pub(super) struct Lines {
    pub(super) bytes: Vec<u8>,
    pub(super) count: u64,
}

impl Slot {
    pub(super) fn lock(&self) -> MutexGuard<'_, Lines> {
        self.buf.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(super) fn close(&self) {
        self.closed.store(true, Ordering::Release);
    }
}

/// Wall-clock time from a monotonic reading: the offset between the two
/// clocks, refreshed by the writer thread every cycle (so a step of the
/// system clock shows in the lines within `flush_every`), so that a line
/// costs one clock reading (the one its duration needs), not two.
#[derive(Debug)]
pub(super) struct Wall {
    pub(super) epoch: Instant,
    /// The wall clock at `epoch`, in microseconds since the Unix epoch.
    at_epoch_us: AtomicU64,
}

impl Wall {
    fn new() -> Self {
        let w = Self {
            epoch: Instant::now(),
            at_epoch_us: AtomicU64::new(0),
        };
        w.refresh();
        w
    }

    fn refresh(&self) {
        let mono = self.epoch.elapsed().as_micros() as u64;
        let wall = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_micros() as u64;
        self.at_epoch_us
            .store(wall.saturating_sub(mono), Ordering::Relaxed);
    }

    /// The wall-clock time of the monotonic reading `now`.
    pub(super) fn at(&self, now: Instant) -> Stamp {
        let since = now.saturating_duration_since(self.epoch).as_micros() as u64;
        Stamp::from_micros(self.at_epoch_us.load(Ordering::Relaxed) + since)
    }
}

/// What the writer thread shares with the loggers.
#[derive(Debug)]
pub(super) struct Writer {
    slots: Mutex<Vec<Arc<Slot>>>,
    slot_bytes: usize,
    flush_every: Duration,
    thread: std::sync::OnceLock<Thread>,
    stop: AtomicBool,
    reopen: AtomicBool,
    /// Drain cycles completed, for [`Writer::flush`].
    cycles: Mutex<u64>,
    cycled: Condvar,
    pub(super) dropped: AtomicU64,
    pub(super) left_out: Counter,
    pub(super) lines: Counter,
    pub(super) wall: Wall,
    /// The format of the writer's own lines.
    json: bool,
    /// Set when the thread has ended.
    done: Mutex<bool>,
    ended: Condvar,
}

impl Writer {
    /// Starts the writer thread on `sink`.
    pub(super) fn start(
        sink: Box<dyn Sink>,
        slot_bytes: usize,
        flush_every: Duration,
        json: bool,
    ) -> std::io::Result<Arc<Self>> {
        let w = Arc::new(Self {
            slots: Mutex::default(),
            slot_bytes,
            flush_every,
            thread: std::sync::OnceLock::new(),
            stop: AtomicBool::new(false),
            reopen: AtomicBool::new(false),
            cycles: Mutex::new(0),
            cycled: Condvar::new(),
            dropped: AtomicU64::new(0),
            left_out: Counter::default(),
            lines: Counter::default(),
            wall: Wall::new(),
            json,
            done: Mutex::new(false),
            ended: Condvar::new(),
        });
        let handle = std::thread::Builder::new()
            .name("access-log".into())
            .spawn({
                let w = w.clone();
                move || w.run(sink)
            })?;
        let _ = w.thread.set(handle.thread().clone());
        Ok(w)
    }

    /// A new slot for the calling thread, with its whole capacity reserved
    /// now (the one allocation a thread's lines cost).
    pub(super) fn new_slot(&self) -> Arc<Slot> {
        let slot = Arc::new(Slot {
            buf: Mutex::new(Lines {
                bytes: Vec::with_capacity(self.slot_bytes),
                count: 0,
            }),
            woken: AtomicBool::new(false),
            closed: AtomicBool::new(false),
        });
        lock(&self.slots).push(slot.clone());
        slot
    }

    /// Whether lines are still taken ([`Writer::stop`] not called).
    pub(super) fn open(&self) -> bool {
        !self.stop.load(Ordering::Acquire)
    }

    /// Called with the slot's buffer after a line went in: wakes the writer
    /// once the buffer is a quarter full, so that a busy thread's lines go
    /// out in batches of that size well before the buffer is.
    pub(super) fn filled(&self, slot: &Slot, len: usize) {
        if len >= self.slot_bytes / 4 && !slot.woken.swap(true, Ordering::Relaxed) {
            self.wake();
        }
    }

    fn wake(&self) {
        if let Some(t) = self.thread.get() {
            t.unpark();
        }
    }

    /// Asks for the destination to be opened again; returns at once (the
    /// writer does it after writing what came before).
    pub(super) fn reopen(&self) {
        self.reopen.store(true, Ordering::Release);
        self.wake();
    }

    /// Waits until every line accepted before the call is written (or
    /// `timeout` passed: false).
    pub(super) fn flush(&self, timeout: Duration) -> bool {
        let until = Instant::now() + timeout;
        let mut cycles = lock(&self.cycles);
        // The cycle running now may have passed our slot already: wait
        // for the one after it to end.
        let target = *cycles + 2;
        self.wake();
        while *cycles < target {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() || *lock(&self.done) {
                return *cycles >= target;
            }
            cycles = self
                .cycled
                .wait_timeout(cycles, left.min(self.flush_every))
                .unwrap_or_else(PoisonError::into_inner)
                .0;
            self.wake();
        }
        true
    }

    /// Takes no more lines, writes what was taken, and ends the thread;
    /// true once it has, false if `timeout` passed first (the sink is
    /// stuck: the thread is left to finish alone).
    pub(super) fn stop(&self, timeout: Duration) -> bool {
        self.stop.store(true, Ordering::Release);
        self.wake();
        let until = Instant::now() + timeout;
        let mut done = lock(&self.done);
        while !*done {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            done = self
                .ended
                .wait_timeout(done, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        true
    }

    fn run(self: Arc<Self>, mut sink: Box<dyn Sink>) {
        let mut spare: Vec<u8> = Vec::with_capacity(self.slot_bytes);
        let mut own: Vec<u8> = Vec::with_capacity(1024);
        let mut reported = (0u64, 0u64);
        let mut next_report = Instant::now() + Duration::from_secs(1);
        let mut failing = false;
        loop {
            // Read before draining: a line taken before `stop` or `reopen`
            // is in a slot by the time the flag is seen, and this drain
            // takes it (to the old file, for a reopen).
            let stopping = self.stop.load(Ordering::Acquire);
            let reopen = self.reopen.swap(false, Ordering::AcqRel);
            let slots = lock(&self.slots).clone();
            for slot in &slots {
                let count = {
                    let mut buf = slot.lock();
                    slot.woken.store(false, Ordering::Relaxed);
                    if buf.bytes.is_empty() {
                        continue;
                    }
                    std::mem::swap(&mut buf.bytes, &mut spare);
                    std::mem::take(&mut buf.count)
                };
                if self.write(&mut *sink, &spare, count, &mut failing) {
                    self.lines.add(count);
                }
                spare.clear();
            }
            lock(&self.slots)
                .retain(|s| !(s.closed.load(Ordering::Acquire) && s.lock().bytes.is_empty()));
            if stopping || Instant::now() >= next_report {
                next_report = Instant::now() + Duration::from_secs(1);
                own.clear();
                self.report(&mut own, &mut reported);
                if !own.is_empty() {
                    let count = own.iter().filter(|&&b| b == b'\n').count() as u64;
                    let _ = self.write(&mut *sink, &own, count, &mut failing);
                }
            }
            self.wall.refresh();
            if reopen {
                match sink.reopen() {
                    Ok(()) => tracing::info!("SIGHUP: access file reopened (log.access_file)"),
                    Err(e) => tracing::error!(
                        error = %e,
                        "SIGHUP: log.access_file cannot be opened again; lines still go to the \
                         file open before"
                    ),
                }
            }
            {
                let mut cycles = lock(&self.cycles);
                *cycles += 1;
                self.cycled.notify_all();
            }
            if stopping {
                *lock(&self.done) = true;
                self.ended.notify_all();
                return;
            }
            std::thread::park_timeout(self.flush_every);
        }
    }

    /// The writer's own lines, once a second at most: how many filtered
    /// 404s were left out (`log.access_filtered_rate`) and how many lines
    /// were dropped since the last report.
    fn report(&self, out: &mut Vec<u8>, reported: &mut (u64, u64)) {
        let left_out = self.left_out.get();
        let dropped = self.dropped.load(Ordering::Relaxed);
        let now = Stamp::now();
        if left_out > reported.0 {
            notice(
                out,
                self.json,
                now,
                "INFO",
                "filtered 404s not logged (log.access_filtered_rate; the counters have them all)",
                &[("left_out", left_out - reported.0)],
            );
        }
        if dropped > reported.1 {
            notice(
                out,
                self.json,
                now,
                "WARN",
                "access lines dropped: the log's destination fell behind \
                 (bloomgate_access_lines_dropped_total)",
                &[("dropped", dropped - reported.1)],
            );
        }
        *reported = (left_out, dropped);
    }

    /// Writes a batch of `lines` lines; false when the sink failed (they
    /// are then counted as dropped, and the failure said once per run of
    /// failures, on the rest of the log, which may be elsewhere).
    fn write(&self, sink: &mut dyn Sink, batch: &[u8], lines: u64, failing: &mut bool) -> bool {
        match sink.write_all(batch) {
            Ok(()) => {
                *failing = false;
                true
            }
            Err(e) => {
                self.dropped.fetch_add(lines, Ordering::Relaxed);
                if !std::mem::replace(failing, true) {
                    tracing::error!(error = %e, "access lines cannot be written; dropping them");
                }
                false
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;
    use std::time::{Duration, Instant};

    use super::super::tests::{Memory, line, options};
    use super::super::{Class, Logger, UNLIMITED};

    fn ids(lines: &[String]) -> Vec<String> {
        lines
            .iter()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .filter_map(|v| v["fields"]["request_id"].as_str().map(str::to_string))
            .collect()
    }

    /// The writer held still: a thread's buffer fills, the lines past it
    /// are dropped whole and counted, and written + dropped is every line.
    #[test]
    fn a_stalled_destination_drops_lines_whole_and_counts_them() {
        let sink = Memory::default();
        let logger = Logger::start(options(UNLIMITED, 4096), Box::new(sink.clone())).unwrap();
        sink.stall();
        logger.log(&line("first"), Class::Every, Instant::now());
        // The writer is now stuck writing "first" (within 10 ms).
        sink.wait_stalled();
        for i in 0..200 {
            logger.log(&line(&format!("r{i}")), Class::Every, Instant::now());
        }
        let dropped = logger.stats().dropped;
        assert!(dropped > 0, "a 4 KiB buffer took 200 lines");
        sink.release();
        assert!(logger.stop(Duration::from_secs(30)));
        let stats = logger.stats();
        assert_eq!(stats.dropped, dropped, "nothing dropped once released");
        assert_eq!(stats.lines + stats.dropped, 201);
        let lines = sink.lines();
        let written = ids(&lines);
        assert_eq!(written.len() as u64, stats.lines);
        // The lines kept are the first ones, in order: a full buffer drops
        // what comes, not what it holds.
        let expected: Vec<String> = std::iter::once("first".to_string())
            .chain((0..).map(|i| format!("r{i}")))
            .take(written.len())
            .collect();
        assert_eq!(written, expected);
        let notice = lines
            .iter()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .find(|v| v["fields"]["dropped"].is_u64())
            .expect("a line saying how many were dropped");
        assert_eq!(notice["fields"]["dropped"], dropped);
        assert_eq!(notice["level"], "WARN");
    }

    /// The wall clock read through the monotonic one says what the wall
    /// clock says (within a second: the readings are not simultaneous).
    #[test]
    fn the_wall_clock_from_a_monotonic_reading() {
        let wall = super::Wall::new();
        let ours = wall.at(Instant::now());
        let theirs = super::Stamp::now();
        let (a, b) = (ours.micros_since_epoch(), theirs.micros_since_epoch());
        assert!(a.abs_diff(b) < 1_000_000, "{ours:?} against {theirs:?}");
    }

    /// Lines from several threads, then `stop`: every one written, once.
    #[test]
    fn every_line_taken_before_stop_is_written_once() {
        let sink = Memory::default();
        let logger = std::sync::Arc::new(
            Logger::start(options(UNLIMITED, 1 << 20), Box::new(sink.clone())).unwrap(),
        );
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let logger = logger.clone();
                std::thread::spawn(move || {
                    for i in 0..2000 {
                        logger.log(&line(&format!("t{t}-{i}")), Class::Every, Instant::now());
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert!(logger.stop(Duration::from_secs(30)));
        let written = ids(&sink.lines());
        assert_eq!(written.len(), 8000);
        assert_eq!(written.iter().collect::<HashSet<_>>().len(), 8000);
        // One thread's lines keep their order.
        let t0: Vec<_> = written.iter().filter(|i| i.starts_with("t0-")).collect();
        let sorted = {
            let mut s = t0.clone();
            s.sort_by_key(|i| i[3..].parse::<u32>().unwrap());
            s
        };
        assert_eq!(t0, sorted);
        assert_eq!(logger.stats().dropped, 0);
        assert_eq!(logger.stats().lines, 8000);
    }

    /// No flush, no stop, no buffer filling up: the line is written all
    /// the same (every `flush_every`).
    #[test]
    fn a_lone_line_is_written_without_a_flush() {
        let sink = Memory::default();
        let logger = Logger::start(options(UNLIMITED, 1 << 16), Box::new(sink.clone())).unwrap();
        logger.log(&line("alone"), Class::Every, Instant::now());
        let began = Instant::now();
        while sink.lines().is_empty() {
            assert!(began.elapsed() < Duration::from_secs(30), "never written");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(ids(&sink.lines()), ["alone"]);
    }

    /// logrotate's move and SIGHUP: the lines before the reopen are in the
    /// moved file, the ones after it in the new file, each once.
    #[test]
    fn a_reopen_after_a_move_loses_no_line() {
        let dir = std::env::temp_dir().join(format!(
            "bloomgate-access-reopen-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("access.log");
        let _ = std::fs::remove_file(&path);
        let sink = super::File::open(path.clone()).unwrap();
        let logger = Logger::start(options(UNLIMITED, 1 << 16), Box::new(sink)).unwrap();
        for i in 0..50 {
            logger.log(&line(&format!("a{i}")), Class::Every, Instant::now());
        }
        let moved = dir.join("access.log.1");
        std::fs::rename(&path, &moved).unwrap();
        for i in 0..50 {
            logger.log(&line(&format!("b{i}")), Class::Every, Instant::now());
        }
        logger.reopen();
        assert!(logger.flush(Duration::from_secs(30)));
        for i in 0..50 {
            logger.log(&line(&format!("c{i}")), Class::Every, Instant::now());
        }
        assert!(logger.stop(Duration::from_secs(30)));
        let read = |p: &std::path::Path| -> Vec<String> {
            ids(&std::fs::read_to_string(p)
                .unwrap()
                .lines()
                .map(str::to_string)
                .collect::<Vec<_>>())
        };
        let old = read(&moved);
        let new = read(&path);
        let expect = |p: char| (0..50).map(move |i| format!("{p}{i}"));
        assert_eq!(old, expect('a').chain(expect('b')).collect::<Vec<_>>());
        assert_eq!(new, expect('c').collect::<Vec<_>>());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
