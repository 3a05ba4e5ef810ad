//! The rest of a lookup [`Resource::lookup_now`] could not answer: the
//! database, through the cache (one coalesced load per key, stored) or past
//! it (a key the filter cannot vouch for, verified within
//! `verify_budget`), and what each answer counts.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::{How, Load, LoadError, Lookup, Provenance, Resource};
use crate::cache::{Outcome, Row};
use crate::db::stats::{QueryKind, Tally};
use crate::db::{DbError, LoadFrom};
use crate::error::Error;
use crate::key::Key;

impl Resource {
    /// The rest of a lookup [`Resource::lookup_now`] could not answer: the
    /// database, through the cache (coalesced, stored) or past it.
    pub async fn load(&self, load: Load) -> Result<Lookup, Error> {
        let Load { key, how } = load;
        // A row read across a promotion the filter was kept over may be
        // one the new timeline lost: into the filter, but not the mark.
        let forks = self.live.forks();
        let read = || match self.live.forks() == forks {
            true => Provenance::Trusted,
            false => Provenance::Announced,
        };
        match how {
            How::Cached { read_first } => {
                self.load_through_cache(key, read_first, QueryKind::Row)
                    .await
            }
            How::Direct { rejected } => {
                let result = self.load_direct(&key, rejected).await;
                if rejected && let Ok(Lookup::Unvouched(Some(_))) = &result {
                    // Read by the gateway itself: it exists.
                    self.add_to_filter(&key, read());
                }
                result
            }
            How::Verify => {
                let result = self
                    .load_through_cache(key.clone(), true, QueryKind::Verify)
                    .await;
                if let Ok(Lookup::Cached(Outcome::Loaded { .. })) = &result {
                    // The row exists and its change has not arrived yet;
                    // the gateway read it itself, so it may raise the mark.
                    self.add_to_filter(&key, read());
                }
                result
            }
        }
    }

    /// A rejected key above the high-water mark may be a row committed a
    /// moment ago; check it against the database while the budget allows.
    pub(super) fn may_verify(&self, key: &Key) -> bool {
        self.config.filter.verify_above_high_water
            && self.live.above_high_water(key)
            && self.verify_budget.try_take()
    }

    /// One load from the database for a lookup not vouched for: no cache
    /// read, nothing stored, no coalescing (each such request is one query,
    /// within the load slots and, for keys the filter rejected,
    /// `verify_budget`), on the primary (see `db::LoadFrom::Primary`).
    async fn load_direct(&self, key: &Key, rejected: bool) -> Result<Lookup, Error> {
        self.stats.unvouched_loads.fetch_add(1, Ordering::Relaxed);
        let Ok(_slot) = self.loads.clone().try_acquire_owned() else {
            self.stats.shed_loads.fetch_add(1, Ordering::Relaxed);
            return Err(Error::Overloaded);
        };
        let sql = self.row_sql();
        let tally = Tally {
            counts: &self.stats.db_queries,
            kind: if rejected {
                QueryKind::Verify
            } else {
                QueryKind::Row
            },
        };
        let loaded = self.db.fetch_key(sql, key, tally, LoadFrom::Primary).await;
        match loaded {
            Ok(row) => {
                self.observe_load(false, row.is_none(), !rejected);
                Ok(Lookup::Unvouched(row.map(|b| Arc::new(Row::new(b)))))
            }
            Err(DbError::NotUnique) => Err(self.not_unique()),
            Err(e) => {
                if self.db.outage.is_down()
                    && let Some(age) = self.stale_age()
                    && let Some(stale) = self.stale(key, age)
                {
                    return Ok(stale);
                }
                let detail = e.to_string();
                if let Some(not_logged) = self.load_failure_log.permit() {
                    tracing::warn!(resource = %self.config.name, error = %detail, not_logged, "row load failed (at most one such line per 10 s; not_logged counts the rest)");
                }
                Err(Error::Unavailable(detail))
            }
        }
    }

    /// `read_first`: false when [`Resource::lookup_now`] has just missed.
    async fn load_through_cache(
        &self,
        key: Key,
        read_first: bool,
        kind: QueryKind,
    ) -> Result<Lookup, Error> {
        let make_load = |key: &Key| {
            let db = self.db.clone();
            let counts = self.stats.db_queries.clone();
            let sql = self.row_sql().clone();
            let k = key.clone();
            let loads = self.loads.clone();
            move || async move {
                // Taken by the load itself, so held until its query returns even
                // when every client waiting on it has gone and the cache has
                // detached it: the request's own slot is released when the
                // client goes, this one is not (see [`LoadError::Overloaded`]).
                let Ok(_slot) = loads.try_acquire_owned() else {
                    return Err(LoadError::Overloaded);
                };
                let tally = Tally {
                    counts: &counts,
                    kind,
                };
                db.fetch_key(&sql, &k, tally, LoadFrom::UpToDateReplica)
                    .await
                    .map_err(LoadError::Db)
            }
        };
        let loaded = match read_first {
            true => self.cache.get_or_load_with(key, make_load).await,
            false => self.cache.load_missed_with(key, make_load).await,
        };
        match loaded {
            Ok(outcome) => {
                self.observe(&outcome, kind == QueryKind::Row);
                Ok(Lookup::Cached(outcome))
            }
            Err(e) => {
                match e.source() {
                    Some(LoadError::Overloaded) => {
                        self.stats.shed_loads.fetch_add(1, Ordering::Relaxed);
                        return Err(Error::Overloaded);
                    }
                    Some(LoadError::Db(DbError::NotUnique)) => return Err(self.not_unique()),
                    _ => {}
                }
                let detail = match e.source() {
                    Some(LoadError::Db(db)) => db.to_string(),
                    _ => "load aborted".to_string(),
                };
                if let Some(not_logged) = self.load_failure_log.permit() {
                    tracing::warn!(
                        resource = %self.config.name,
                        error = %detail,
                        not_logged,
                        "row load failed (at most one such line per 10 s; not_logged counts the rest)"
                    );
                }
                Err(Error::Unavailable(detail))
            }
        }
    }

    /// A key that matched two rows: neither is served. Said once per
    /// interval with the resource's name (counted per request as the
    /// `key_not_unique` outcome).
    fn not_unique(&self) -> Error {
        if let Some(not_logged) = self.not_unique_log.permit() {
            tracing::error!(
                resource = %self.config.name,
                table = %self.config.table,
                key_column = %self.config.key_columns().join(", "),
                not_logged,
                "a key matched more than one row: answered 500 key_not_unique, neither row served; \
                 key the resource by a unique set of columns (at most one such line per 10 s)"
            );
        }
        Error::KeyNotUnique
    }

    /// What a load tells of the filter (the request itself is counted
    /// where it is answered: see `resource::stats`); `passed`: the filter
    /// passed the key (a load of a key it rejected is a verification).
    fn observe(&self, outcome: &Outcome, passed: bool) {
        match outcome {
            Outcome::Hit(_) | Outcome::NegativeHit | Outcome::Loaded { .. } => {}
            Outcome::Absent { collapsed } => self.observe_load(*collapsed, true, passed),
            Outcome::Bypassed(row) => self.observe_load(false, row.is_none(), passed),
        }
    }

    /// A key the filter passed and the database does not have, once per
    /// query (not per request collapsed onto it): an observed false
    /// positive, or a deleted row the filter still holds. An absent key the
    /// filter rejected and the gateway checked anyway (above the high-water
    /// mark, or while not vouched for) says nothing against the filter.
    fn observe_load(&self, collapsed: bool, absent: bool, passed: bool) {
        if absent && passed && !collapsed && self.config.filter.enabled {
            self.stats.observed_absent.fetch_add(1, Ordering::Relaxed);
        }
    }
}
