//! Whether the gateway can vouch for one resource's filter and cache (see
//! "The principle" in `feed`): the change feed has proven itself current
//! within the bound (*fresh*), no gap is open (every resync since has been
//! covered by a rebuild that swapped its filter in), and the feed can
//! follow the resource's table (no *problem*).
//!
//! The request path reads one flag and one deadline, [`Vouch::ok_at`]; the
//! applier and the rebuilds change the inputs, rarely, under a mutex that
//! recomputes the flag.
//!
//! # Why a deadline as well as the flag
//! The flag turns false when the applier's timer (every eighth of the
//! bound) finds the latest proof too old. A gateway paused past the bound
//! (SIGSTOP, a VM frozen, a host starved) resumes with the flag still
//! true, and the requests queued meanwhile would run before the timer
//! does: answered from the cache for a moment the proof does not cover.
//! So each resource also holds the moment its latest proof expires
//! ([`Vouch::proven_until`]), and a request compares it with the instant
//! it began: a proof covers only requests that begin within the bound of
//! it, whatever any timer has done.
//!
//! # Guarantees (tested below)
//! - `ok` holds exactly while fresh, with no problem, and every gap opened
//!   is closed.
//! - A gap opened by [`Vouch::open_gap`] is closed only by a rebuild that
//!   called [`Vouch::rebuild_began`] after it (its journal opened, so its
//!   scan's snapshot is later than the gap's event), once that rebuild's
//!   filter is in place ([`Vouch::rebuild_covered`]). A rebuild that began
//!   before the gap closes only the gaps before it.
//! - [`Vouch::stale_since`]: the moment `ok` last turned false, if it did
//!   so for want of freshness alone (an interrupted feed, a silent one:
//!   what the filter and cache hold is what was vouched for then, since
//!   nothing is stored in the cache while not vouched), and no gap or
//!   problem has been opened since (a gap empties the cache and makes the
//!   filter untrustworthy). `None` while `ok`. It is what an outage may
//!   answer from (`cache.stale_if_error`, see `resource`).
//! - [`ProofClock`], the feed's side of *fresh*, shared by every resource
//!   it follows: fresh while the latest proof (a heartbeat's moment) is
//!   within the bound, or always without one; a proof older than one heard
//!   already never moves it back; after an interruption, not fresh until
//!   the next proof; each change is told once, in order (the telling runs
//!   under its lock).
//! - [`Vouch::ok_at`] holds only while `ok` does and the instant is at or
//!   before the latest proof's moment plus the bound (no proof told: no
//!   limit, for a resource no feed follows or a feed that is off).
//! - Memory order: `ok` is stored with `Release` after whatever made it
//!   true (a filter swapped in), and the request path loads it with
//!   `Acquire` *before* it reads the filter; so a request that sees it true
//!   reads that filter or a later one, never the one the gap made
//!   untrustworthy.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{LazyLock, Mutex};
use std::time::{Duration, Instant};

/// The instant [`Vouch::proven_until`]'s deadlines count from.
static BASE: LazyLock<Instant> = LazyLock::new(Instant::now);

/// `at` as nanoseconds since [`BASE`] (0 for an instant before it).
fn nanos(at: Instant) -> u64 {
    u64::try_from(at.saturating_duration_since(*BASE).as_nanos()).unwrap_or(u64::MAX)
}

/// The gaps a rebuild will close once its filter is in place: those opened
/// before its window ([`Vouch::rebuild_began`]).
#[derive(Debug)]
#[must_use = "a rebuild's ticket closes its gaps once its filter is in place"]
pub struct Covers(u64);

impl Covers {
    /// Gaps opened before the window (what it covers).
    pub fn gaps(&self) -> u64 {
        self.0
    }
}

#[derive(Debug)]
pub struct Vouch {
    ok: AtomicBool,
    /// The latest proof's moment plus the bound, in [`nanos`]; `u64::MAX`
    /// before any (see "Why a deadline as well as the flag").
    until: AtomicU64,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    fresh: bool,
    /// Gaps opened, and the latest one a rebuild has covered.
    opened: u64,
    closed: u64,
    /// Why the last gap was opened (for readiness).
    gap: Option<String>,
    problem: Option<String>,
    /// See [`Vouch::stale_since`].
    stale_since: Option<Instant>,
}

impl State {
    fn ok(&self) -> bool {
        self.fresh && self.closed >= self.opened && self.problem.is_none()
    }
}

impl Default for Vouch {
    /// Not fresh: nothing is vouched for until the feed (or the gateway,
    /// without one) says so.
    fn default() -> Self {
        Self {
            ok: AtomicBool::new(false),
            until: AtomicU64::new(u64::MAX),
            state: Mutex::default(),
        }
    }
}

impl Vouch {
    /// Whether the filter's "absent" and the cache's answers may be given,
    /// as the applier last computed it. A request asks [`Vouch::ok_at`].
    #[inline]
    pub fn ok(&self) -> bool {
        self.ok.load(Ordering::Acquire)
    }

    /// Whether they may be given to a request that began at `began`: the
    /// flag, and the latest proof still covers that instant. Read it before
    /// the filter (see the module doc).
    #[inline]
    pub fn ok_at(&self, began: Instant) -> bool {
        self.ok.load(Ordering::Acquire) && nanos(began) <= self.until.load(Ordering::Relaxed)
    }

    /// The latest proof covers requests that begin up to `until` (a later
    /// deadline only ever replaces an earlier one).
    pub fn proven_until(&self, until: Instant) {
        let until = nanos(until);
        // The first proof replaces "no limit"; after it, only later ones.
        let _ = self
            .until
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |now| {
                (now == u64::MAX || until > now).then_some(until)
            });
    }

    fn change(&self, f: impl FnOnce(&mut State)) {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let was = s.ok();
        f(&mut s);
        let ok = s.ok();
        if ok {
            s.stale_since = None;
        } else if was {
            // Lost for want of freshness only: what is held was vouched
            // for until now.
            let intact = s.closed >= s.opened && s.problem.is_none();
            s.stale_since = intact.then(Instant::now);
        }
        self.ok.store(ok, Ordering::Release);
    }

    /// When the filter and cache were last vouched for, if they still hold
    /// exactly what was vouched for then (see the module doc).
    pub fn stale_since(&self) -> Option<Instant> {
        self.state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .stale_since
    }

    /// What [`Vouch::set_fresh`] last said.
    pub fn is_fresh(&self) -> bool {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).fresh
    }

    /// Whether the feed has proven itself current within the bound.
    pub fn set_fresh(&self, fresh: bool) {
        self.change(|s| s.fresh = fresh);
    }

    /// Changes may have been missed: not vouched for until a rebuild that
    /// begins after this has swapped in.
    pub fn open_gap(&self, why: &str) {
        self.change(|s| {
            s.opened += 1;
            s.gap = Some(why.to_string());
            s.stale_since = None;
        });
    }

    /// Gaps opened so far (compared with [`Covers::gaps`]: one opened
    /// since a window opened).
    pub fn gaps_opened(&self) -> u64 {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).opened
    }

    /// A rebuild's journal has opened: returns what it will cover. Called
    /// by `LiveFilter::open_rebuild_window` only, right after it opens the
    /// window, so the order cannot be written the other way round.
    pub(crate) fn rebuild_began(&self) -> Covers {
        Covers(self.state.lock().unwrap_or_else(|p| p.into_inner()).opened)
    }

    /// That rebuild's filter is in place (or merged into the live one):
    /// every gap up to `began` is closed.
    pub fn rebuild_covered(&self, began: Covers) {
        self.change(|s| {
            s.closed = s.closed.max(began.0);
            if s.closed >= s.opened {
                s.gap = None;
            }
        });
    }

    /// Whether the feed can follow the table, and if not why.
    pub fn set_problem(&self, problem: Option<String>) {
        self.change(|s| {
            if problem.is_some() {
                s.stale_since = None;
            }
            s.problem = problem;
        });
    }

    /// Whether the feed cannot follow the table ([`Vouch::set_problem`]):
    /// a configuration's cause (a missing trigger, a table outside the
    /// publication), not a moment's.
    pub fn has_problem(&self) -> bool {
        self.state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .problem
            .is_some()
    }

    /// Why not vouched, for readiness; `None` when vouched.
    pub fn why_not(&self) -> Option<String> {
        let s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(p) = &s.problem {
            return Some(p.clone());
        }
        if s.closed < s.opened {
            return Some(format!(
                "resyncing: {}",
                s.gap.as_deref().unwrap_or("changes may have been missed")
            ));
        }
        if !s.fresh {
            return Some("the change feed has not confirmed it is current".into());
        }
        None
    }
}

/// See the module doc.
#[derive(Debug, Default)]
pub struct ProofClock {
    /// `database.freshness_bound`; `None`: no feed proves anything (the
    /// feed is off), so freshness is not its to prove.
    bound: Option<Duration>,
    state: Mutex<Told>,
}

#[derive(Debug, Default)]
struct Told {
    /// The latest proof's moment, `None` since an interruption.
    heard: Option<Instant>,
    /// What the resources were last told.
    told: Option<bool>,
}

/// A change of [`ProofClock`], to tell every resource.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Change {
    pub fresh: bool,
    /// The first word since start: nothing was said before it.
    pub first: bool,
}

impl ProofClock {
    pub fn new(bound: Option<Duration>) -> Self {
        Self {
            bound,
            state: Mutex::default(),
        }
    }

    pub fn bound(&self) -> Option<Duration> {
        self.bound
    }

    /// The feed is current up to `at`.
    pub fn heard(&self, at: Instant) {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        s.heard = Some(s.heard.map_or(at, |h| h.max(at)));
    }

    /// The feed was interrupted: nothing is proven until the next proof.
    pub fn interrupted(&self) {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).heard = None;
    }

    /// Calls `tell` with the change, if fresh now differs from what was
    /// told last, under the lock (so changes are told in order).
    pub fn check(&self, tell: impl FnOnce(Change)) {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let fresh = match self.bound {
            None => true,
            Some(bound) => s.heard.is_some_and(|at| at.elapsed() <= bound),
        };
        if s.told == Some(fresh) {
            return;
        }
        let first = s.told.is_none();
        s.told = Some(fresh);
        tell(Change { fresh, first });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `check` tells, if anything.
    fn told(f: &ProofClock) -> Option<Change> {
        let mut out = None;
        f.check(|c| out = Some(c));
        out
    }

    #[test]
    fn freshness_follows_the_latest_proof_and_tells_each_change_once() {
        let fresh = |first| Some(Change { fresh: true, first });
        let stale = |first| {
            Some(Change {
                fresh: false,
                first,
            })
        };
        // No bound: fresh from the start, said once.
        let off = ProofClock::new(None);
        assert_eq!(told(&off), fresh(true));
        assert_eq!(told(&off), None);

        let f = ProofClock::new(Some(Duration::from_secs(5)));
        assert_eq!(told(&f), stale(true), "nothing proven yet");
        assert_eq!(told(&f), None);
        let long_ago = Instant::now().checked_sub(Duration::from_secs(60));
        if let Some(old) = long_ago {
            f.heard(old);
            assert_eq!(told(&f), None, "a proof older than the bound");
        }
        f.heard(Instant::now());
        assert_eq!(told(&f), fresh(false));
        assert_eq!(told(&f), None);
        if let Some(old) = long_ago {
            f.heard(old);
            assert_eq!(told(&f), None, "an older proof never moves it back");
        }
        f.interrupted();
        assert_eq!(told(&f), stale(false));
        f.heard(Instant::now());
        assert_eq!(told(&f), fresh(false));
    }

    #[test]
    fn a_request_is_vouched_for_only_within_the_bound_of_the_latest_proof() {
        let v = Vouch::default();
        v.set_fresh(true);
        let now = Instant::now();
        assert!(v.ok_at(now), "no proof told: no limit");
        v.proven_until(now + Duration::from_secs(2));
        assert!(v.ok_at(now + Duration::from_secs(2)));
        // The timer has not run (a paused process): the flag still says
        // yes, the deadline no.
        assert!(v.ok());
        assert!(!v.ok_at(now + Duration::from_millis(2001)));
        v.proven_until(now + Duration::from_secs(1));
        assert!(
            v.ok_at(now + Duration::from_secs(2)),
            "an older proof never moves it back"
        );
        v.proven_until(now + Duration::from_secs(5));
        assert!(v.ok_at(now + Duration::from_secs(4)));
        v.set_fresh(false);
        assert!(!v.ok_at(now), "the flag still counts");
    }

    #[test]
    fn vouched_exactly_while_fresh_without_gap_or_problem() {
        let v = Vouch::default();
        assert!(!v.ok(), "nothing is vouched for before the feed says so");
        v.set_fresh(true);
        assert!(v.ok());
        assert_eq!(v.why_not(), None);
        v.set_problem(Some("not in the publication".into()));
        assert!(!v.ok());
        assert_eq!(v.why_not().as_deref(), Some("not in the publication"));
        v.set_problem(None);
        v.set_fresh(false);
        assert!(!v.ok());
        assert!(v.why_not().unwrap().contains("current"));
        v.set_fresh(true);
        assert!(v.ok());
    }

    #[test]
    fn a_gap_is_closed_only_by_a_rebuild_that_began_after_it() {
        let v = Vouch::default();
        v.set_fresh(true);
        let early = v.rebuild_began();
        v.open_gap("reconnect");
        assert!(!v.ok());
        assert!(v.why_not().unwrap().contains("reconnect"));
        v.rebuild_covered(early);
        assert!(!v.ok(), "a rebuild that began before the gap");
        let late = v.rebuild_began();
        v.open_gap("another");
        v.rebuild_covered(late);
        assert!(!v.ok(), "the second gap came after that rebuild began");
        let last = v.rebuild_began();
        v.rebuild_covered(last);
        assert!(v.ok());
        assert_eq!(v.why_not(), None);
    }

    #[test]
    fn what_was_vouched_for_is_kept_only_until_a_gap_or_a_problem() {
        let v = Vouch::default();
        assert_eq!(v.stale_since(), None, "never vouched for");
        v.set_fresh(true);
        assert_eq!(v.stale_since(), None, "vouched: nothing stale");
        v.set_fresh(false);
        let since = v.stale_since().expect("lost for want of freshness");
        v.set_fresh(false);
        assert_eq!(v.stale_since(), Some(since), "still the same moment");
        v.open_gap("a new server");
        assert_eq!(v.stale_since(), None, "a gap: the cache was emptied");
        let began = v.rebuild_began();
        v.rebuild_covered(began);
        v.set_fresh(true);
        assert!(v.ok());
        v.open_gap("a resync while vouched");
        assert_eq!(v.stale_since(), None, "lost to a gap: nothing to keep");
        let began = v.rebuild_began();
        v.rebuild_covered(began);
        assert!(v.ok());
        v.set_fresh(false);
        assert!(v.stale_since().is_some());
        v.set_problem(Some("not in the publication".into()));
        assert_eq!(v.stale_since(), None, "a table the feed cannot follow");
    }

    proptest::proptest! {
        /// Any interleaving of gaps and rebuilds: vouched exactly when the
        /// last gap precedes the start of some covered rebuild.
        #[test]
        fn gaps_and_rebuilds_in_any_order(ops in proptest::collection::vec(0u8..3, 0..40)) {
            let v = Vouch::default();
            v.set_fresh(true);
            let (mut last_gap, mut began, mut covered_from) = (0u64, Vec::new(), 0u64);
            let mut clock = 0u64;
            for op in ops {
                clock += 1;
                match op {
                    0 => { v.open_gap("g"); last_gap = clock; }
                    1 => began.push((clock, v.rebuild_began())),
                    _ => if let Some((at, epoch)) = began.pop() {
                        v.rebuild_covered(epoch);
                        covered_from = covered_from.max(at);
                    },
                }
                proptest::prop_assert_eq!(v.ok(), last_gap < covered_from || last_gap == 0);
            }
        }
    }
}
