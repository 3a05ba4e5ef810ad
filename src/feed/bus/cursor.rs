//! Where the consumer has read the bus to, for snapshots (see "What a
//! snapshot is complete at" in `snapshot`). Two places:
//!
//! - **read** ([`Cursor::mark`]): the newest entry read, set as soon as
//!   entries are read, before anything of them is passed on. At or past
//!   everything applied, and past every entry a break or an epoch change
//!   skipped (the consumer reads the entry that shows the break before it
//!   passes on the resync): what a rebuild's window needs a snapshot to
//!   reach.
//! - **passed** ([`Cursor::settled`]): set *after* the events of the
//!   entries up to it are passed on, on the queue it holds: so a barrier
//!   sent on that queue after it was read is answered only once those
//!   events are applied. What a publisher labels its snapshot with.
//!
//! Off the bus (starting, following the WAL itself) the cursor is empty:
//! nothing is published or loaded against it.

use std::sync::Mutex;
use std::time::Duration;

use futures_util::future::BoxFuture;
use tokio::sync::{mpsc, oneshot};

use super::EntryId;
use crate::feed::Event;
use crate::snapshot::Mark;

/// Given the stream's newest place as the consumer first starts, installs
/// what snapshots it can and returns the place to read from (`None`:
/// none installed, read from the newest).
pub type Join = std::sync::Arc<dyn Fn(Mark) -> BoxFuture<'static, Option<Mark>> + Send + Sync>;

/// How long [`Cursor::settled`] waits for the applier: a queue this far
/// behind is not worth a snapshot now.
const SETTLE_WITHIN: Duration = Duration::from_secs(5);

#[derive(Default)]
struct Places {
    read: Option<Mark>,
    passed: Option<(Mark, mpsc::Sender<Event>)>,
}

#[derive(Default)]
pub struct Cursor {
    at: Mutex<Places>,
    /// Snapshots published before this (Unix ms) are not used: the
    /// primary's position went back within its epoch (a restore that kept
    /// what the epoch is told by), and a snapshot labelled on this stream
    /// before then may hold what the restored primary never had.
    not_before_ms: std::sync::atomic::AtomicU64,
}

fn mark(stream: &str, at: EntryId) -> Mark {
    Mark {
        stream: stream.to_string(),
        lsn: at.lsn,
        seq: at.seq,
    }
}

impl Cursor {
    fn lock(&self) -> std::sync::MutexGuard<'_, Places> {
        self.at.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The consumer has read the entries of `stream` up to `at`.
    pub fn read(&self, stream: &str, at: EntryId) {
        self.lock().read = Some(mark(stream, at));
    }

    /// The consumer has passed on every entry of `stream` up to `at` on
    /// `tx` (and read them).
    pub fn set(&self, stream: &str, at: EntryId, tx: &mpsc::Sender<Event>) {
        let mut g = self.lock();
        let m = mark(stream, at);
        if !g.read.as_ref().is_some_and(|r| r.reaches(&m)) {
            g.read = Some(m.clone());
        }
        g.passed = Some((m, tx.clone()));
    }

    /// The primary's position went back within its epoch: no snapshot
    /// published until now is used.
    pub fn discard_before_now(&self) {
        self.not_before_ms
            .store(crate::feed::now_ms(), std::sync::atomic::Ordering::Relaxed);
    }

    pub fn not_before_ms(&self) -> u64 {
        self.not_before_ms
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The consumer left the bus.
    pub fn clear(&self) {
        *self.lock() = Places::default();
    }

    /// The read place.
    pub fn mark(&self) -> Option<Mark> {
        self.lock().read.clone()
    }

    /// The passed place, once the applier has applied everything passed
    /// on before it; `None` off the bus or past [`SETTLE_WITHIN`].
    pub async fn settled(&self) -> Option<Mark> {
        let (mark, tx) = self.lock().passed.clone()?;
        let (done, applied) = oneshot::channel();
        tx.send(Event::Barrier(done)).await.ok()?;
        tokio::time::timeout(SETTLE_WITHIN, applied)
            .await
            .ok()?
            .ok()?;
        Some(mark)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn settled_waits_for_the_events_before_it() {
        let (tx, mut rx) = mpsc::channel(8);
        let c = Cursor::default();
        assert!(c.settled().await.is_none(), "off the bus");
        tx.send(Event::Heartbeat(std::time::Instant::now()))
            .await
            .unwrap();
        c.set("s", EntryId { lsn: 5, seq: 0 }, &tx);
        let settled = tokio::spawn(async move { c.settled().await });
        // The heartbeat first, then the barrier: applied in order.
        assert!(matches!(rx.recv().await, Some(Event::Heartbeat(_))));
        assert!(!settled.is_finished());
        match rx.recv().await {
            Some(Event::Barrier(done)) => done.send(()).unwrap(),
            other => panic!("{other:?}"),
        }
        let m = settled.await.unwrap().unwrap();
        assert_eq!((m.stream.as_str(), m.lsn), ("s", 5));
    }

    #[tokio::test]
    async fn the_read_place_leads_the_passed_one() {
        let (tx, mut rx) = mpsc::channel(4);
        let c = std::sync::Arc::new(Cursor::default());
        c.set("a", EntryId { lsn: 9, seq: 0 }, &tx);
        c.read("a", EntryId { lsn: 20, seq: 0 });
        assert_eq!(c.mark().unwrap().lsn, 20);
        let settle = tokio::spawn({
            let c = c.clone();
            async move { c.settled().await }
        });
        match rx.recv().await {
            Some(Event::Barrier(done)) => done.send(()).unwrap(),
            other => panic!("{other:?}"),
        }
        assert_eq!(
            settle.await.unwrap().unwrap().lsn,
            9,
            "labelled with what was passed on"
        );
        // A new stream (an epoch): read first, then passed.
        c.read("b", EntryId { lsn: 2, seq: 1 });
        let m = c.mark().unwrap();
        assert_eq!((m.stream.as_str(), m.lsn, m.seq), ("b", 2, 1));
        c.set("b", EntryId { lsn: 2, seq: 1 }, &tx);
        assert_eq!(c.mark().unwrap().stream, "b");
        c.clear();
        assert!(c.mark().is_none());
    }
}
