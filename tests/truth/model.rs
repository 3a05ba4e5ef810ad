//! What every key's URL was allowed to answer, and when: the versions of
//! each path as Postgres committed them, and the windows in which a fault
//! lets the gateway lag (see the crate doc for the rules).

use std::collections::HashMap;
use std::time::Duration;

use serde_json::Value;

use crate::schema::Path;

/// Any change may take this long to be served, fault or not.
pub const BASE: Duration = Duration::from_secs(2);

/// After an outage ends (the database answers again), how long a gateway
/// may still answer labelled stale: it tries the database once per
/// `db::outage::TRY_EVERY` (250 ms) while it believes it down.
pub const STALE_AFTER: Duration = Duration::from_secs(1);

/// One committed state of a path: `body` (`None`: no such row) from the
/// moment its COMMIT was sent (it cannot be visible before) until the next
/// version's COMMIT returned (it may be visible until then).
#[derive(Clone, Debug)]
pub struct Version {
    pub sent: Duration,
    /// When its COMMIT returned; `None` while it is in flight.
    pub done: Option<Duration>,
    pub body: Option<Value>,
}

/// A fault's allowance: a read that began within `[from, until]` may
/// return a version superseded up to `BASE` before `back_to` (`from`, but
/// for a restore: the copy's moment, which the put-back returns to).
#[derive(Clone, Debug)]
pub struct Window {
    pub what: String,
    pub from: Duration,
    pub until: Duration,
    pub back_to: Duration,
}

#[derive(Default)]
pub struct Model {
    versions: HashMap<Path, Vec<Version>>,
    /// Every path known, in the order first seen (readers pick from it).
    pub paths: Vec<Path>,
    pub windows: Vec<Window>,
    /// When the database could not be reached (every connection cut, the
    /// primary down): an answer labelled `detail=stale` is allowed only
    /// for a read that began inside one (or within [`STALE_AFTER`] of its
    /// end), and must be a version current after `BASE` before it began.
    /// `until` is `Duration::MAX` while it lasts.
    pub outages: Vec<Window>,
    /// Paths whose last version is in flight.
    staged: Vec<Path>,
}

impl Model {
    /// `path` with `body` since before the history began.
    pub fn initial(&mut self, path: Path, body: Option<Value>) {
        assert!(!self.versions.contains_key(&path), "{path:?} twice");
        self.paths.push(path.clone());
        self.versions.insert(
            path,
            vec![Version {
                sent: Duration::ZERO,
                done: Some(Duration::ZERO),
                body,
            }],
        );
    }

    pub fn latest(&self, path: &Path) -> Option<&Value> {
        self.versions
            .get(path)
            .and_then(|v| v.last())
            .and_then(|v| v.body.as_ref())
    }

    /// Records what the transaction about to commit makes of `changes`
    /// (read inside it), before its COMMIT is sent: a reader that sees the
    /// new state finds it here. A path never seen had no row before.
    pub fn stage(&mut self, at: Duration, changes: Vec<(Path, Option<Value>)>) {
        assert!(self.staged.is_empty(), "one transaction at a time");
        for (path, body) in changes {
            if !self.versions.contains_key(&path) {
                self.initial(path.clone(), None);
            }
            let versions = self.versions.get_mut(&path).unwrap();
            if versions.last().unwrap().body == body {
                continue;
            }
            versions.push(Version {
                sent: at,
                done: None,
                body,
            });
            self.staged.push(path);
        }
    }

    /// The staged transaction's COMMIT returned.
    pub fn committed(&mut self, at: Duration) {
        for path in self.staged.drain(..) {
            let v = self.versions.get_mut(&path).unwrap().last_mut().unwrap();
            v.done = Some(at);
        }
    }

    /// The staged transaction did not commit.
    pub fn aborted(&mut self) {
        for path in self.staged.drain(..) {
            self.versions.get_mut(&path).unwrap().pop();
        }
    }

    /// The database is unreachable from `from` on (see [`Model::outages`]).
    pub fn outage_began(&mut self, what: impl Into<String>, from: Duration) {
        self.outages.push(Window {
            what: what.into(),
            from,
            until: Duration::MAX,
            back_to: from,
        });
    }

    /// The open outage ended at `at`.
    pub fn outage_ended(&mut self, at: Duration) {
        if let Some(o) = self.outages.iter_mut().find(|o| o.until == Duration::MAX) {
            o.until = at + STALE_AFTER;
        }
    }

    /// What Postgres has now, read at `at` after a failover or a crash
    /// lost commits the model recorded: each path whose body differs gets
    /// a version committed at `at` (the lost ones stay allowed within the
    /// fault's window, as any superseded version is).
    pub fn reset(&mut self, at: Duration, truth: Vec<(Path, Option<Value>)>) {
        assert!(self.staged.is_empty(), "no transaction in flight");
        for (path, body) in truth {
            if !self.versions.contains_key(&path) {
                self.initial(path.clone(), None);
            }
            let versions = self.versions.get_mut(&path).unwrap();
            if versions.last().unwrap().body == body {
                continue;
            }
            versions.push(Version {
                sent: at,
                done: Some(at),
                body,
            });
        }
    }

    /// A fault's window opened at `from` whose end is not known yet (a
    /// crash or a failover in progress): a read that begins meanwhile is
    /// judged within it, even one that ends before the fault is over (the
    /// new primary answers as soon as the proxy points at it, before the
    /// checker has read what it lost). [`Model::close_window`] ends it.
    pub fn open_window(&mut self, what: impl Into<String>, from: Duration) {
        self.open_window_back_to(what, from, from);
    }

    /// [`Model::open_window`] for a fault that puts the database back to
    /// what it held at `back_to` (a restore from a copy made then): the
    /// restored server answers before the checker has read what it lost,
    /// with versions the model had superseded since the copy.
    pub fn open_window_back_to(
        &mut self,
        what: impl Into<String>,
        from: Duration,
        back_to: Duration,
    ) {
        self.windows.push(Window {
            what: what.into(),
            from,
            until: Duration::MAX,
            back_to: back_to.min(from),
        });
    }

    /// The open window `what` ends at `until`.
    pub fn close_window(&mut self, what: &str, until: Duration) {
        if let Some(w) = self
            .windows
            .iter_mut()
            .find(|w| w.what == what && w.until == Duration::MAX)
        {
            w.until = until;
        }
    }

    pub fn window(&mut self, what: impl Into<String>, from: Duration, bound: Duration) {
        self.windows.push(Window {
            what: what.into(),
            from,
            until: from + bound,
            back_to: from,
        });
    }

    /// Windows and outages opened and not closed yet: a comparison while
    /// one is open would judge leniently what should be strict.
    pub fn still_open(&self) -> Vec<String> {
        self.windows
            .iter()
            .chain(self.outages.iter())
            .filter(|w| w.until == Duration::MAX)
            .map(|w| w.what.clone())
            .collect()
    }

    /// When the last window closes.
    pub fn quiet_from(&self) -> Duration {
        self.windows
            .iter()
            .chain(self.outages.iter())
            .filter(|w| w.until != Duration::MAX)
            .map(|w| w.until)
            .max()
            .unwrap_or_default()
    }

    /// Whether `got` (`None`: 404) may answer `path` for a read that began
    /// at `t0` and ended at `t1`: it must be a version that was committed
    /// by `t1` and was still current at the cutoff (`BASE` before `t0`, or
    /// before the start of a fault window `t0` falls in). An answer
    /// labelled `stale` is allowed only inside an outage (see
    /// [`Model::outages`]), and then back to `BASE` before it began, and
    /// no further whatever other window is open. `Err` says what Postgres
    /// had.
    pub fn judge(
        &self,
        path: &Path,
        got: Option<&Value>,
        t0: Duration,
        t1: Duration,
        stale: bool,
    ) -> Result<(), String> {
        let mut cutoff = t0.saturating_sub(BASE);
        let mut within = Vec::new();
        if stale {
            let Some(o) = self.outages.iter().find(|o| o.from <= t0 && t0 <= o.until) else {
                return Err(format!(
                    "labelled stale outside any outage (read {}..{}); outages: {}",
                    secs(t0),
                    secs(t1),
                    self.outages
                        .iter()
                        .map(|o| format!("{} {}..{}", o.what, secs(o.from), secs(o.until)))
                        .collect::<Vec<_>>()
                        .join(", ")
                ));
            };
            cutoff = o.back_to.saturating_sub(BASE);
            within.push(o.what.as_str());
        } else {
            for w in &self.windows {
                if w.from <= t0 && t0 <= w.until {
                    cutoff = cutoff.min(w.back_to.saturating_sub(BASE));
                    within.push(w.what.as_str());
                }
            }
        }
        let versions = &self.versions[path];
        for (i, v) in versions.iter().enumerate() {
            if v.body.as_ref() != got || v.sent > t1 {
                continue;
            }
            match versions.get(i + 1).map(|next| next.done) {
                None | Some(None) => return Ok(()),
                Some(Some(superseded)) if superseded > cutoff => return Ok(()),
                Some(Some(_)) => {}
            }
        }
        let windows = if within.is_empty() {
            String::new()
        } else {
            format!(", in the window of {}", within.join(", "))
        };
        Err(format!(
            "allowed: versions current after {} (read {}..{}{windows}); Postgres had {}",
            secs(cutoff),
            secs(t0),
            secs(t1),
            history(versions)
        ))
    }

    pub fn describe(&self, path: &Path) -> String {
        history(&self.versions[path])
    }
}

pub fn secs(d: Duration) -> String {
    format!("{:.3}s", d.as_secs_f64())
}

/// The last versions, oldest first: `body since commit sent..returned`.
fn history(versions: &[Version]) -> String {
    let from = versions.len().saturating_sub(4);
    let parts: Vec<String> = versions[from..]
        .iter()
        .map(|v| {
            let body = match &v.body {
                Some(b) => b.to_string(),
                None => "404".into(),
            };
            let done = v.done.map(secs).unwrap_or_else(|| "in flight".into());
            format!("{body} @ {}..{done}", secs(v.sent))
        })
        .collect();
    let skipped = if from > 0 {
        format!("({from} older) ")
    } else {
        String::new()
    };
    format!("{skipped}{}", parts.join(" -> "))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::Res;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// The rules themselves: a checker whose oracle accepts everything
    /// finds nothing.
    #[test]
    fn the_oracle_rejects_what_is_too_old_or_not_yet_committed() {
        let mut m = Model::default();
        let p = Path::new(Res::Users, "1");
        let a = Some(serde_json::json!({"id": 1, "name": "a"}));
        let b = Some(serde_json::json!({"id": 1, "name": "b"}));
        m.initial(p.clone(), a.clone());
        // b committed between 10 s and 10.1 s.
        m.stage(ms(10_000), vec![(p.clone(), b.clone())]);
        // While in flight, both are fine.
        assert!(
            m.judge(&p, a.as_ref(), ms(10_050), ms(10_060), false)
                .is_ok()
        );
        assert!(
            m.judge(&p, b.as_ref(), ms(10_050), ms(10_060), false)
                .is_ok()
        );
        m.committed(ms(10_100));
        // b cannot be seen by a read that ended before its COMMIT was sent.
        assert!(
            m.judge(&p, b.as_ref(), ms(9_000), ms(9_999), false)
                .is_err()
        );
        // a within BASE of b's commit returning, then not.
        assert!(
            m.judge(&p, a.as_ref(), ms(12_000), ms(12_001), false)
                .is_ok()
        );
        assert!(
            m.judge(&p, a.as_ref(), ms(12_200), ms(12_201), false)
                .is_err()
        );
        // Nothing else, ever; a 404 for a row that always existed neither.
        assert!(m.judge(&p, None, ms(10_050), ms(10_060), false).is_err());
        // A fault window from 11 s to 16 s lets a stay until then.
        m.window("kill", ms(11_000), ms(5_000));
        assert!(
            m.judge(&p, a.as_ref(), ms(15_000), ms(15_001), false)
                .is_ok()
        );
        assert!(
            m.judge(&p, a.as_ref(), ms(16_500), ms(16_501), false)
                .is_err()
        );
        assert_eq!(m.quiet_from(), ms(16_000));
        // An aborted transaction leaves no version; an unchanged body none.
        m.stage(ms(20_000), vec![(p.clone(), None)]);
        m.aborted();
        m.stage(ms(20_000), vec![(p.clone(), b.clone())]);
        m.committed(ms(20_001));
        assert_eq!(m.latest(&p), b.as_ref());
        // A key first seen in a transaction had no row before it.
        let q = Path::new(Res::Users, "2");
        m.stage(ms(30_000), vec![(q.clone(), a.clone())]);
        m.committed(ms(30_001));
        assert!(m.judge(&q, None, ms(29_000), ms(29_500), false).is_ok());
        assert!(m.judge(&q, None, ms(32_100), ms(32_200), false).is_err());
    }

    /// Labelled stale answers: only inside an outage, and only versions
    /// current after BASE before it began; a reset after a failover makes
    /// the lost versions wrong once the fault's window has closed.
    #[test]
    fn stale_answers_belong_to_outages_and_lost_commits_to_their_window() {
        let mut m = Model::default();
        let p = Path::new(Res::Users, "1");
        let a = Some(serde_json::json!({"id": 1, "name": "a"}));
        let b = Some(serde_json::json!({"id": 1, "name": "b"}));
        let c = Some(serde_json::json!({"id": 1, "name": "c"}));
        m.initial(p.clone(), a.clone());
        m.stage(ms(1_000), vec![(p.clone(), b.clone())]);
        m.committed(ms(1_010));
        // No outage: stale is never right, even the latest version.
        assert!(m.judge(&p, b.as_ref(), ms(2_000), ms(2_001), true).is_err());
        m.outage_began("outage", ms(10_000));
        assert_eq!(m.still_open(), ["outage"]);
        // Inside it, what was current when it began; not what was gone
        // long before.
        assert!(
            m.judge(&p, b.as_ref(), ms(50_000), ms(50_001), true)
                .is_ok()
        );
        assert!(
            m.judge(&p, a.as_ref(), ms(50_000), ms(50_001), true)
                .is_err()
        );
        m.outage_ended(ms(60_000));
        assert!(
            m.judge(&p, b.as_ref(), ms(60_500), ms(60_501), true)
                .is_ok()
        );
        assert!(
            m.judge(&p, b.as_ref(), ms(61_500), ms(61_501), true)
                .is_err(),
            "past STALE_AFTER"
        );
        // A failover lost b: c is what the new primary has. It answers
        // (c) before the checker has read what it lost: judged within the
        // window opened when the failover began.
        m.stage(ms(69_000), vec![(p.clone(), c.clone())]);
        m.committed(ms(69_010));
        m.stage(ms(69_500), vec![(p.clone(), b.clone())]);
        m.committed(ms(69_510));
        m.open_window("failover", ms(70_000));
        assert_eq!(m.still_open(), ["failover"], "the outage above ended");
        assert!(
            m.judge(&p, c.as_ref(), ms(71_900), ms(71_901), false)
                .is_ok(),
            "the new primary's row, read before the reset"
        );
        m.reset(ms(72_000), vec![(p.clone(), c.clone())]);
        m.close_window("failover", ms(75_000));
        assert!(m.still_open().is_empty());
        assert!(
            m.judge(&p, b.as_ref(), ms(74_000), ms(74_001), false)
                .is_ok()
        );
        assert!(
            m.judge(&p, b.as_ref(), ms(76_000), ms(76_001), false)
                .is_err()
        );
        assert!(
            m.judge(&p, c.as_ref(), ms(76_000), ms(76_001), false)
                .is_ok()
        );
        assert_eq!(m.latest(&p), c.as_ref());
    }

    /// A restore puts the database back to a copy: within its window the
    /// copy's versions may be answered, however long ago they were
    /// superseded; before the put-back and after its window, not.
    #[test]
    fn a_restore_goes_back_to_its_copy() {
        let mut m = Model::default();
        let p = Path::new(Res::Users, "1");
        let a = Some(serde_json::json!({"id": 1, "name": "a"}));
        m.initial(p.clone(), None);
        // The copy is made at 10 s; the row is inserted after it.
        m.stage(ms(11_000), vec![(p.clone(), a.clone())]);
        m.committed(ms(11_010));
        assert!(m.judge(&p, None, ms(15_000), ms(15_001), false).is_err());
        m.open_window_back_to("restore", ms(18_000), ms(10_000));
        assert!(
            m.judge(&p, None, ms(18_300), ms(18_301), false).is_ok(),
            "the restored copy answers before the checker has read it"
        );
        m.reset(ms(18_500), vec![(p.clone(), None)]);
        m.close_window("restore", ms(19_000));
        assert!(
            m.judge(&p, a.as_ref(), ms(21_000), ms(21_001), false)
                .is_err()
        );
        assert!(m.judge(&p, None, ms(21_000), ms(21_001), false).is_ok());
        // Opened without a copy, the same window allows only BASE back.
        let mut m = Model::default();
        m.initial(p.clone(), None);
        m.stage(ms(11_000), vec![(p.clone(), a.clone())]);
        m.committed(ms(11_010));
        m.open_window("failover", ms(18_000));
        assert!(m.judge(&p, None, ms(18_300), ms(18_301), false).is_err());
    }
}
