//! Rebuild coordination: one [`Coordinator`] per resource, through which
//! every request to rebuild its filter goes, whatever asked (the schedule, a
//! change feed's resync, rescan or truncate, the admin API, the filter's own
//! decay triggers).
//!
//! A rebuild is a full scan of the table, and some of those sources can be
//! driven by anyone who can connect to the database (a forged `NOTIFY`), so
//! requests must cost nothing by themselves: a request only marks a rebuild
//! as wanted, and the coordinator's one task runs them, one at a time.
//!
//! # Guarantees (tested below)
//! * **At most one running and one pending.** A request made while a rebuild
//!   is pending merges into it (a forced request makes it forced); N requests
//!   cost at most the running rebuild plus one more, whatever N.
//! * **A request is covered by a rebuild that starts after it.** It never
//!   merges into the running one, whose snapshot may predate the request
//!   (a request after lost notifications must scan again).
//! * **Every ticket resolves**: with the outcome of the rebuild that covered
//!   it, or with `None` once the coordinator has stopped (its task aborted,
//!   e.g. by `Gateway::stop`) before that rebuild finished. Requests after
//!   the stop resolve at once with `None`.
//! * **The rebuild runs inside the coordinator's task**, so aborting that task
//!   drops the rebuild future mid-scan: whatever it holds (the scan's
//!   connection, the resource's journal) must be released by guards on drop,
//!   which is the resource's and the database's business.
//!
//! Knows nothing of resources or filters: the outcome type is a parameter.

use std::future::Future;
use std::sync::Mutex;
use std::time::SystemTime;

use serde::Serialize;
use tokio::sync::{Notify, watch};

/// Why a rebuild was asked for: logged with the build and shown in the
/// admin API, so an operator can tell a schedule from a storm of forged
/// rescans.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// The first build at start-up.
    Startup,
    /// `filter.rebuild_interval` elapsed.
    Schedule,
    /// `POST /admin/resources/{name}/rebuild`.
    Admin,
    /// A change feed may have missed changes (reconnect, new slot).
    Resync,
    /// A change feed asked for this table only (a notify `RESCAN`).
    Rescan,
    /// The table was truncated.
    Truncate,
    /// A feed delivered an insert whose key it could not carry.
    UnknownKey,
    /// The estimated false-positive rate passed `filter.rebuild_fp_multiple`
    /// × the target.
    FalsePositives,
    /// Deletes since the build passed `filter.rebuild_delete_fraction`.
    Deletes,
    /// Live inserts since the build passed `filter.rebuild_insert_fraction`.
    Growth,
    /// A caller awaiting `Resource::rebuild` directly.
    Direct,
    /// Joining the fleet: the filter installed from its snapshot on the
    /// bus (`resource::fleet`).
    Join,
}

impl Reason {
    const ALL: [Reason; 12] = [
        Reason::Startup,
        Reason::Schedule,
        Reason::Admin,
        Reason::Resync,
        Reason::Rescan,
        Reason::Truncate,
        Reason::UnknownKey,
        Reason::FalsePositives,
        Reason::Deletes,
        Reason::Growth,
        Reason::Direct,
        Reason::Join,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Startup => "startup",
            Reason::Schedule => "schedule",
            Reason::Admin => "admin",
            Reason::Resync => "resync",
            Reason::Rescan => "rescan",
            Reason::Truncate => "truncate",
            Reason::UnknownKey => "unknown_key",
            Reason::FalsePositives => "false_positives",
            Reason::Deletes => "deletes",
            Reason::Growth => "growth",
            Reason::Direct => "direct",
            Reason::Join => "join",
        }
    }

    /// Whether, until a rebuild for this reason succeeds, the filter may
    /// lack keys that exist (changes were missed, or came without their
    /// keys): such a rebuild that fails must be tried again, or those rows
    /// answer 404 until the next scheduled one. The other reasons only
    /// restore the filter's precision.
    pub fn recovers_keys(self) -> bool {
        matches!(self, Reason::Resync | Reason::Rescan | Reason::UnknownKey)
    }

    fn bit(self) -> u16 {
        1 << Reason::ALL.iter().position(|r| *r == self).unwrap_or(0)
    }
}

/// The reasons merged into one rebuild.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Reasons(u16);

impl Reasons {
    pub fn contains(self, r: Reason) -> bool {
        self.0 & r.bit() != 0
    }

    /// The reasons, in [`Reason`] order.
    pub fn iter(self) -> impl Iterator<Item = Reason> {
        Reason::ALL.into_iter().filter(move |r| self.contains(*r))
    }

    /// Names, in [`Reason`] order.
    pub fn names(self) -> Vec<&'static str> {
        self.iter().map(Reason::as_str).collect()
    }
}

impl Serialize for Reasons {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.names().serialize(s)
    }
}

/// One rebuild, pending or running, as the admin API shows it.
#[derive(Clone, Debug, Serialize)]
pub struct Job {
    /// The ticket every request merged into it holds.
    pub ticket: u64,
    pub force: bool,
    pub reasons: Reasons,
    /// Requests merged into it.
    pub requests: u64,
    /// When the first of them was made.
    #[serde(with = "humantime_serde")]
    pub requested_at: SystemTime,
}

/// The coordinator's state, for the admin API.
#[derive(Clone, Debug, Serialize)]
pub struct Status {
    /// Requests made so far.
    pub requests: u64,
    /// Rebuilds run to an outcome so far.
    pub completed: u64,
    /// The ticket of the latest rebuild that finished (0: none yet): a
    /// ticket at or below it has its outcome.
    pub completed_ticket: u64,
    pub running: Option<Job>,
    pub pending: Option<Job>,
    /// The coordinator's task has ended; requests are not served.
    pub stopped: bool,
}

/// A request's claim on the outcome of the rebuild that covers it.
#[derive(Debug)]
pub struct Ticket<O> {
    id: u64,
    rx: watch::Receiver<Option<O>>,
}

impl<O: Clone> Ticket<O> {
    /// The covering rebuild's ticket number (0 when the coordinator had
    /// stopped already), comparable with [`Status::completed_ticket`].
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Waits for the covering rebuild's outcome; `None` if the coordinator
    /// stopped first. Dropping the future (or the ticket) cancels nothing:
    /// the rebuild runs on.
    pub async fn outcome(mut self) -> Option<O> {
        match self.rx.wait_for(Option::is_some).await {
            Ok(v) => v.clone(),
            Err(_) => None,
        }
    }
}

struct Pending<O> {
    job: Job,
    done: watch::Sender<Option<O>>,
}

struct State<O> {
    pending: Option<Pending<O>>,
    running: Option<Job>,
    last_ticket: u64,
    requests: u64,
    completed: u64,
    completed_ticket: u64,
    stopped: bool,
}

/// See the module doc.
pub struct Coordinator<O> {
    state: Mutex<State<O>>,
    wake: Notify,
}

impl<O> Default for Coordinator<O> {
    fn default() -> Self {
        Self {
            state: Mutex::new(State {
                pending: None,
                running: None,
                last_ticket: 0,
                requests: 0,
                completed: 0,
                completed_ticket: 0,
                stopped: false,
            }),
            wake: Notify::new(),
        }
    }
}

impl<O: Clone + Send + Sync> Coordinator<O> {
    fn lock(&self) -> std::sync::MutexGuard<'_, State<O>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Asks for a rebuild; returns at once. Merges into the pending rebuild
    /// if there is one, else makes one pending. The ticket may be dropped.
    pub fn request(&self, reason: Reason, force: bool) -> Ticket<O> {
        let mut s = self.lock();
        s.requests += 1;
        if s.stopped {
            let (_, rx) = watch::channel(None);
            return Ticket { id: 0, rx };
        }
        if s.pending.is_none() {
            s.last_ticket += 1;
            s.pending = Some(Pending {
                job: Job {
                    ticket: s.last_ticket,
                    force: false,
                    reasons: Reasons::default(),
                    requests: 0,
                    requested_at: SystemTime::now(),
                },
                done: watch::Sender::new(None),
            });
        }
        let p = s.pending.as_mut().expect("made pending above");
        p.job.force |= force;
        p.job.reasons.0 |= reason.bit();
        p.job.requests += 1;
        let ticket = Ticket {
            id: p.job.ticket,
            rx: p.done.subscribe(),
        };
        drop(s);
        // A permit is stored if the task is not waiting yet: no lost wake-up.
        self.wake.notify_one();
        ticket
    }

    pub fn status(&self) -> Status {
        let s = self.lock();
        Status {
            requests: s.requests,
            completed: s.completed,
            completed_ticket: s.completed_ticket,
            running: s.running.clone(),
            pending: s.pending.as_ref().map(|p| p.job.clone()),
            stopped: s.stopped,
        }
    }

    /// Runs pending rebuilds, one at a time, until the future is dropped
    /// (the task aborted). `rebuild` gets the job (its `force` and reasons).
    pub async fn run<F, Fut>(&self, mut rebuild: F)
    where
        F: FnMut(Job) -> Fut,
        Fut: Future<Output = O>,
    {
        let _stopped = StopOnDrop(self);
        loop {
            let next = {
                let mut s = self.lock();
                let next = s.pending.take();
                s.running = next.as_ref().map(|p| p.job.clone());
                next
            };
            let Some(Pending { job, done }) = next else {
                self.wake.notified().await;
                continue;
            };
            let ticket = job.ticket;
            // If this future is dropped here, `done` goes with it and every
            // ticket on this rebuild resolves to `None`.
            let outcome = rebuild(job).await;
            {
                let mut s = self.lock();
                s.running = None;
                s.completed += 1;
                s.completed_ticket = ticket;
            }
            done.send_replace(Some(outcome));
        }
    }
}

/// Marks the coordinator stopped when its `run` future goes away, and drops
/// the pending rebuild so that its tickets resolve.
struct StopOnDrop<'a, O>(&'a Coordinator<O>);

impl<O> Drop for StopOnDrop<'_, O> {
    fn drop(&mut self) {
        let mut s = self.0.state.lock().unwrap_or_else(|p| p.into_inner());
        s.stopped = true;
        s.running = None;
        s.pending = None;
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};

    use tokio::sync::Semaphore;

    use super::*;

    /// The coordinator, its run count, the gate and its task.
    type Harness = (
        Arc<Coordinator<(u64, bool)>>,
        Arc<AtomicU64>,
        Arc<Semaphore>,
        tokio::task::JoinHandle<()>,
    );

    /// A coordinator whose rebuilds count themselves and wait for a permit
    /// each, so the test decides when one finishes.
    fn harness() -> Harness {
        let c = Arc::new(Coordinator::default());
        let runs = Arc::new(AtomicU64::new(0));
        let gate = Arc::new(Semaphore::new(0));
        let task = tokio::spawn({
            let (c, runs, gate) = (c.clone(), runs.clone(), gate.clone());
            async move {
                c.run(|job| {
                    let (runs, gate) = (runs.clone(), gate.clone());
                    async move {
                        let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
                        gate.acquire().await.unwrap().forget();
                        (n, job.force)
                    }
                })
                .await
            }
        });
        (c, runs, gate, task)
    }

    async fn until(mut cond: impl FnMut() -> bool) {
        for _ in 0..10_000 {
            if cond() {
                return;
            }
            tokio::task::yield_now().await;
        }
        panic!("condition never held");
    }

    #[tokio::test]
    async fn requests_coalesce_into_one_running_and_one_pending() {
        let (c, runs, gate, _task) = harness();
        let first = c.request(Reason::Schedule, false);
        until(|| c.status().running.is_some()).await;
        // 200 requests while one runs, as 200 forged RESCANs would make.
        let tickets: Vec<_> = (0..200)
            .map(|i| c.request(Reason::Rescan, i == 150))
            .collect();
        let pending = c.status().pending.unwrap();
        assert_eq!((pending.requests, pending.force), (200, true));
        assert!(tickets.iter().all(|t| t.id() == pending.ticket));
        assert_ne!(first.id(), pending.ticket, "not covered by the running one");
        gate.add_permits(2);
        assert_eq!(first.outcome().await, Some((1, false)));
        for t in tickets {
            assert_eq!(t.outcome().await, Some((2, true)));
        }
        assert_eq!(runs.load(Ordering::SeqCst), 2);
        let s = c.status();
        assert_eq!((s.completed, s.requests), (2, 201));
        assert!(s.running.is_none() && s.pending.is_none());
        assert_eq!(
            serde_json::to_value(pending.reasons).unwrap(),
            serde_json::json!(["rescan"])
        );
    }

    #[tokio::test]
    async fn stopping_resolves_every_ticket_and_later_requests() {
        let (c, runs, _gate, task) = harness();
        let running = c.request(Reason::Admin, false);
        until(|| c.status().running.is_some()).await;
        let pending = c.request(Reason::Resync, true);
        task.abort();
        let _ = task.await;
        assert_eq!(running.outcome().await, None);
        assert_eq!(pending.outcome().await, None);
        let s = c.status();
        assert!(s.stopped && s.running.is_none() && s.pending.is_none());
        let late = c.request(Reason::Schedule, false);
        assert_eq!((late.id(), late.outcome().await), (0, None));
        assert_eq!(runs.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_request_before_the_task_runs_is_served_when_it_starts() {
        let c = Arc::new(Coordinator::<u32>::default());
        let t = c.request(Reason::Startup, true);
        let task = tokio::spawn({
            let c = c.clone();
            async move { c.run(|job| async move { u32::from(job.force) }).await }
        });
        assert_eq!(t.outcome().await, Some(1));
        task.abort();
    }
}
