//! What a feed depends on besides its stream, checked while it runs (see
//! "The principle" in [`super`]): which relation each watched table's name
//! leads to, its partitions, and the feed's own dependency (the
//! publication, the triggers) as a problem per table.
//!
//! # Guarantees (tested below)
//! [`Tracker::update`] turns successive checks into events such that:
//! - a table whose relation changed since the last check (dropped and
//!   created again, swapped in by a rename: another OID) or whose leaf
//!   partitions changed (ATTACH, DETACH, a partition dropped) gets a
//!   [`Event::Resync`] of that table: its rows may have changed without a
//!   row change any feed sees;
//! - a table whose publication entry or trigger rows changed since the
//!   last check ([`Observed::dependency`]) gets one too: an edit undone within
//!   one check (a table dropped from the publication and added back, a
//!   trigger disabled and enabled) kept changes from the feed meanwhile;
//! - a table the feed cannot follow gets [`Event::Coverage`] with the
//!   problem, once per distinct problem; when it can again, a
//!   [`Event::Coverage`] without one, then a [`Event::Resync`] of it (what
//!   changed meanwhile was not delivered);
//! - the first check only records (the first scan follows it), except that
//!   a problem is reported at once;
//! - a key (one column, or a composite key's columns) a resource serves
//!   its table by that is no longer a unique set (its unique index dropped, say: see
//!   `db::catalog::TableInfo::uniqueness`) is a problem of that table
//!   ([`Observed::problem`]): one key could now name several rows, so its
//!   resources answer from the database, whose row query refuses two rows.
//!   The same check the feed's own dependency has, so every feed (and the
//!   bus, which carries the coverage) says it;
//! - a column a resource serves that no longer exists (renamed, dropped)
//!   is a problem of its table, naming it: its lookups would fail.
//!
//! # Shapes: a rewrite is a change
//! A table rewrite keeps the table's OID, and no feed sees a row change
//! for it: `ALTER TABLE … ALTER COLUMN … TYPE … USING` (every served value
//! may have changed, keys included), `RENAME COLUMN` then `ADD COLUMN` of
//! the old name (another column served under that name), `VACUUM FULL`,
//! `CLUSTER`. pgoutput says nothing of the rewrite, and its `Relation`
//! message comes only before the table's next row change and carries no
//! storage. So the catalog is the authority: a table's *shape* is the
//! `relfilenode` of each of its leaves (a rewrite gives new storage) and
//! the `pg_attribute` rows (name, number, type, modifier) of the columns
//! its resources serve and are keyed by ([`Shapes`]). Every feed reads the
//! shapes in the same round trip as the reading that proves it current (a
//! WAL session's reading of the primary, a poll, a notify heartbeat, a bus
//! consumer's reading), so that no proof covers a moment after a rewrite
//! it did not see: [`Shapes::update`] turns a changed shape into a
//! [`Event::Resync`] of that table, sent before the heartbeat of that
//! reading. The first reading only records. A shape that cannot be read
//! (the table gone) changes nothing here: the checks above report it.
//! Each rewrite therefore costs one rebuild scan of its table; a `VACUUM
//! FULL` or a `CLUSTER` too.

use sqlx::PgConnection;

use super::{Coverage, Event, Resync, Watch, WatchedTable};
use crate::db::catalog::{UNIQUE_SET, create_unique_index, quote_table};
use crate::db::position::{Reading, Server, from_read_row, read_sql};
use crate::db::triggers::{self, Sink};

/// One watched table as the catalog has it now.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Observed {
    /// The relation its name leads to; `None`: no such relation now.
    pub oid: Option<u32>,
    /// `relkind = 'p'`.
    pub partitioned: bool,
    /// Leaf partitions of a partitioned table, sorted.
    pub partitions: Vec<u32>,
    /// The catalog rows of the feed's own dependency for this table (its
    /// publication entry, its trigger), as their OIDs and row versions
    /// (`xmin`): an edit undone before the next check still changes them,
    /// and the changes it kept from the feed meanwhile are rescanned.
    pub dependency: String,
    /// The keys held unique ([`WatchedTable::keys`]) that no unique set of
    /// the table lies within now, each its columns.
    pub not_unique: Vec<Vec<String>>,
    /// The columns its resources serve, or are keyed by, that it no longer
    /// has.
    pub missing: Vec<String>,
}

impl Observed {
    /// What the catalog alone says keeps `t` from being followed: it does
    /// not exist, or a key it is served by is not unique. A feed's own
    /// problem (its publication, its trigger) comes after these.
    pub fn problem(&self, t: &WatchedTable) -> Option<String> {
        if self.oid.is_none() {
            return Some(format!("table {} does not exist", t.name));
        }
        if !self.missing.is_empty() {
            return Some(format!(
                "{} has no column {} any more, which its resources serve: restore the column \
                 (or give the resources' `columns` and `key_column` the new names, and restart)",
                t.name,
                self.missing.join(", ")
            ));
        }
        if self.not_unique.is_empty() {
            return None;
        }
        let named: Vec<String> = self
            .not_unique
            .iter()
            .map(|k| match k.as_slice() {
                [one] => one.clone(),
                k => format!("({})", k.join(", ")),
            })
            .collect();
        Some(format!(
            "key column {} of {} is no longer unique (no primary key or valid unique index \
             within it), so one key could name several rows: its resources answer from the \
             database, which refuses a key with two rows; {}",
            named.join(", "),
            t.name,
            self.not_unique
                .iter()
                .map(|k| create_unique_index(
                    &t.name,
                    &k.iter().map(String::as_str).collect::<Vec<_>>()
                ))
                .collect::<Vec<_>>()
                .join("; ")
        ))
    }
}

/// Every watched table as the catalog has it now, in `watch` order: one
/// round trip.
pub async fn tables(conn: &mut PgConnection, watch: &Watch) -> Result<Vec<Observed>, sqlx::Error> {
    let names: Vec<String> = watch.tables.iter().map(|t| quote_table(&t.name)).collect();
    let rows: Vec<(Option<i64>, Option<bool>, Vec<i64>)> = sqlx::query_as(
        "SELECT c.oid::int8, c.relkind = 'p',
                coalesce((SELECT array_agg(p.relid::int8 ORDER BY p.relid::int8)
                            FROM pg_partition_tree(c.oid) p
                           WHERE c.relkind = 'p' AND p.isleaf), '{}')
           FROM unnest($1::text[]) WITH ORDINALITY AS t(name, i)
           LEFT JOIN pg_class c ON c.oid = to_regclass(t.name)
          ORDER BY t.i",
    )
    .bind(&names)
    .fetch_all(&mut *conn)
    .await?;
    let mut seen: Vec<Observed> = rows
        .into_iter()
        .map(|(oid, partitioned, partitions)| Observed {
            oid: oid.and_then(|o| u32::try_from(o).ok()),
            partitioned: partitioned.unwrap_or(false),
            partitions: partitions
                .into_iter()
                .filter_map(|p| u32::try_from(p).ok())
                .collect(),
            dependency: String::new(),
            not_unique: Vec::new(),
            missing: Vec::new(),
        })
        .collect();
    // The columns served or keyed by, that the table lacks now.
    let missing: Vec<Vec<String>> = sqlx::query_scalar(
        "SELECT coalesce(ARRAY(
                    SELECT n FROM jsonb_array_elements_text(t.cols::jsonb) AS n
                     WHERE NOT EXISTS (SELECT 1 FROM pg_attribute a
                                        WHERE a.attrelid = c.oid AND a.attname = n
                                          AND a.attnum > 0 AND NOT a.attisdropped)
                     ORDER BY n), '{}')
           FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS t(name, cols, i)
           LEFT JOIN pg_class c ON c.oid = to_regclass(t.name)
          ORDER BY t.i",
    )
    .bind(&names)
    .bind(watch.tables.iter().map(served_json).collect::<Vec<_>>())
    .fetch_all(&mut *conn)
    .await?;
    for (s, missing) in seen.iter_mut().zip(missing) {
        if s.oid.is_some() {
            s.missing = missing;
        }
    }
    // Each key held unique, and whether a unique set lies within it: the
    // rule start-up applies (`TableInfo::uniqueness`), by the same
    // `pg_index` predicate.
    let (mut at, mut keys, mut named) = (Vec::new(), Vec::new(), Vec::new());
    for (i, t) in watch.tables.iter().enumerate() {
        for key in &t.keys {
            at.push(i as i32);
            let names: Vec<&str> = key.iter().map(|c| &**c).collect();
            keys.push(serde_json::to_string(&names).unwrap_or_else(|_| "[]".into()));
            named.push(key);
        }
    }
    if !at.is_empty() {
        let unique: Vec<bool> = sqlx::query_scalar(&format!(
            "SELECT EXISTS (
                 SELECT 1 FROM pg_index i
                  WHERE i.indrelid = to_regclass(($1::text[])[k.at + 1]) AND {UNIQUE_SET}
                    AND NOT EXISTS (
                        SELECT 1 FROM unnest(i.indkey) WITH ORDINALITY u(attnum, ord)
                          JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = u.attnum
                         WHERE u.ord <= i.indnkeyatts
                           AND a.attname::text NOT IN (
                               SELECT jsonb_array_elements_text(k.cols::jsonb))))
               FROM unnest($2::int4[], $3::text[]) WITH ORDINALITY AS k(at, cols, n)
              ORDER BY k.n"
        ))
        .bind(&names)
        .bind(&at)
        .bind(&keys)
        .fetch_all(&mut *conn)
        .await?;
        for ((i, key), unique) in at.into_iter().zip(named).zip(unique) {
            let s = &mut seen[i as usize];
            if !unique && s.oid.is_some() {
                s.not_unique
                    .push(key.iter().map(|c| c.to_string()).collect());
            }
        }
    }
    Ok(seen)
}

/// The key and served columns of `t`, as a JSON array (a bound parameter
/// per table: names may hold any character).
fn served_json(t: &WatchedTable) -> String {
    let mut names: Vec<&str> = t.columns.iter().map(|c| &*c.name).collect();
    names.extend(t.served.iter().map(|c| &**c));
    names.sort_unstable();
    names.dedup();
    serde_json::to_string(&names).unwrap_or_else(|_| "[]".into())
}

/// The shapes of the watched tables (see "Shapes"), and what the last
/// reading found.
#[derive(Debug)]
pub struct Shapes {
    /// Per watched table: its name quoted, and its columns as JSON.
    names: Vec<String>,
    columns: Vec<String>,
    last: Vec<Option<String>>,
}

impl Shapes {
    pub fn new(watch: &Watch) -> Self {
        Self {
            names: watch.tables.iter().map(|t| quote_table(&t.name)).collect(),
            columns: watch.tables.iter().map(served_json).collect(),
            last: Vec::new(),
        }
    }

    /// An SQL expression (a `text[]`, one shape per table in watch order,
    /// NULL for a table that does not exist) to read with a feed's proof;
    /// `names` and `columns` are the numbers of the parameters bound to
    /// [`Shapes::names`] and [`Shapes::columns`].
    pub fn sql(names: usize, columns: usize) -> String {
        format!(
            "ARRAY(SELECT CASE WHEN c.oid IS NULL THEN NULL ELSE
                     CASE WHEN c.relkind <> 'p' THEN c.relfilenode::text ELSE
                     coalesce((SELECT string_agg(l.relfilenode::text, ',' ORDER BY l.oid)
                                 FROM pg_partition_tree(c.oid) p
                                 JOIN pg_class l ON l.oid = p.relid
                                WHERE p.isleaf), '') END
                     || '|' ||
                     coalesce((SELECT string_agg(a.attname || ':' || a.attnum || ':' || a.atttypid
                                                 || ':' || a.atttypmod, ',' ORDER BY a.attname)
                                 FROM pg_attribute a
                                WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
                                  AND a.attname IN (SELECT jsonb_array_elements_text(t.cols::jsonb))),
                              '') END
                     FROM unnest(${names}::text[], ${columns}::text[]) WITH ORDINALITY AS t(name, cols, i)
                     LEFT JOIN pg_class c ON c.oid = to_regclass(t.name)
                    ORDER BY t.i)"
        )
    }

    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// The primary's reading (`db::position::Server::read`) and the shapes,
    /// in one round trip.
    pub async fn read_with_proof<'c>(
        &self,
        conn: impl sqlx::PgExecutor<'c>,
    ) -> Result<(Server, Reading, Vec<Option<String>>), sqlx::Error> {
        let sql = read_sql(&format!(", {}", Self::sql(1, 2)));
        let (system, file, started, insert, flush, shapes): (
            Option<String>,
            String,
            i64,
            String,
            String,
            Vec<Option<String>>,
        ) = sqlx::query_as(&sql)
            .bind(&self.names)
            .bind(&self.columns)
            .fetch_one(conn)
            .await?;
        let (server, reading) = from_read_row((system, file, started, insert, flush));
        Ok((server, reading, shapes))
    }

    pub fn columns(&self) -> &[String] {
        &self.columns
    }

    /// Takes a reading ([`Shapes::sql`]'s array); returns a resync for each
    /// table whose shape changed since the last reading, in order (the
    /// first reading only records).
    pub fn update(&mut self, watch: &Watch, now: Vec<Option<String>>) -> Vec<Event> {
        let first = self.last.is_empty();
        self.last.resize(now.len(), None);
        let mut events = Vec::new();
        for ((t, last), now) in watch.tables.iter().zip(&mut self.last).zip(now) {
            if let (Some(before), Some(shape)) = (&*last, &now)
                && before != shape
                && !first
            {
                tracing::warn!(table = %t.name, "the table was rewritten (its storage or a served column's type or place changed): its caches are emptied and its filters rebuilt");
                events.push(Resync::table(
                    t.name.clone(),
                    format!("{} was rewritten", t.name),
                ));
            }
            if now.is_some() {
                *last = now;
            }
        }
        events
    }
}

/// What the checks of one feed have seen so far (kept across its sessions:
/// a table replaced while the feed was away is found at the next check).
#[derive(Debug, Default)]
pub struct Tracker {
    /// Per watched table: the last check's view and problem.
    last: Vec<Option<(Observed, Option<String>)>>,
}

impl Tracker {
    /// Takes a check's result, one `(seen, problem)` per watched table in
    /// `watch` order; returns what the gateway must be told, in order.
    pub fn update(&mut self, watch: &Watch, now: Vec<(Observed, Option<String>)>) -> Vec<Event> {
        self.last.resize(watch.tables.len(), None);
        let mut events = Vec::new();
        for ((t, last), (seen, problem)) in watch.tables.iter().zip(&mut self.last).zip(now) {
            let coverage = |problem: Option<String>| {
                Event::Coverage(Coverage {
                    table: t.name.clone(),
                    problem,
                })
            };
            match last.take() {
                None => {
                    if problem.is_some() {
                        events.push(coverage(problem.clone()));
                    }
                }
                Some((before, had)) => {
                    if had != problem {
                        events.push(coverage(problem.clone()));
                    }
                    let why = if before.oid != seen.oid {
                        Some(format!("table {} was dropped or replaced", t.name))
                    } else if before.partitions != seen.partitions {
                        Some(format!("the partitions of {} changed", t.name))
                    } else if before.dependency != seen.dependency {
                        Some(format!(
                            "the publication entry or trigger of {} was edited",
                            t.name
                        ))
                    } else if had.is_some() && problem.is_none() {
                        Some(format!("{} is followed again", t.name))
                    } else {
                        None
                    };
                    if let Some(why) = why {
                        events.push(Resync::table(t.name.clone(), why));
                    }
                }
            }
            *last = Some((seen, problem));
        }
        events
    }

    /// Whether the last check found any problem.
    pub fn has_problem(&self) -> bool {
        self.last
            .iter()
            .any(|l| l.as_ref().is_some_and(|(_, p)| p.is_some()))
    }
}

/// After a table was rewritten (see "Shapes"), its trigger function is
/// replaced, where `database.install_triggers` allows: PL/pgSQL keeps, in
/// every session that ran the trigger, a plan typed by the key column's
/// old type, and after a type change every write of such a session to the
/// table fails ("type of parameter … does not match that when preparing
/// the plan") until the function is replaced or the session ends. A new
/// version of the function makes each session compile it again. Failures
/// are logged: the writes that fail are the application's to see.
pub async fn replace_triggers(
    conn: &mut PgConnection,
    watch: &Watch,
    rewritten: &[Event],
    sink: Sink,
) {
    for e in rewritten {
        let Event::Resync(Resync {
            scope: super::Scope::Table(name),
            ..
        }) = e
        else {
            continue;
        };
        let Some(t) = watch.tables.iter().find(|t| t.name == *name) else {
            continue;
        };
        let columns: Vec<&str> = t.columns.iter().map(|c| &*c.name).collect();
        let sql = triggers::install_with_table(&t.name, &columns, sink);
        match sqlx::Executor::execute(&mut *conn, sqlx::raw_sql(&sql)).await {
            Ok(_) => {
                tracing::info!(table = %t.name, "the rewritten table's trigger function replaced (database.install_triggers), so that sessions plan it again")
            }
            Err(e) => {
                tracing::warn!(table = %t.name, error = %e, "cannot replace the rewritten table's trigger function; sessions that ran it may fail their writes to the table until they reconnect: run `bloomgate install-triggers`")
            }
        }
    }
}

/// The trigger feeds' check (`notify`, `queue`): every watched table's
/// relation and partitions, and its trigger ([`triggers::problem`]). With
/// `install`, a missing or outdated trigger is installed (and its table
/// rescanned: what changed without it was missed). Returns the events for
/// the gateway.
pub async fn check_triggers(
    conn: &mut PgConnection,
    watch: &Watch,
    sink: Sink,
    install: bool,
    tracker: &mut Tracker,
) -> Result<Vec<Event>, sqlx::Error> {
    let seen = tables(conn, watch).await?;
    let mut problems = Vec::with_capacity(seen.len());
    let mut repaired = Vec::new();
    for (t, s) in watch.tables.iter().zip(&seen) {
        if s.oid.is_none() {
            problems.push(s.problem(t));
            continue;
        }
        let columns: Vec<&str> = t.columns.iter().map(|c| &*c.name).collect();
        let mut problem = triggers::problem(conn, &t.name, &columns, sink).await?;
        if problem.is_some() && install {
            let sql = triggers::install_with_table(&t.name, &columns, sink);
            match sqlx::Executor::execute(&mut *conn, sqlx::raw_sql(&sql)).await {
                Ok(_) => {
                    tracing::warn!(table = %t.name, problem = problem.as_deref().unwrap_or_default(), "trigger installed again (database.install_triggers); the table is rescanned");
                    repaired.push(t.name.clone());
                    problem = triggers::problem(conn, &t.name, &columns, sink).await?;
                }
                // Tried again at every check (each second): said once per
                // interval; the problem keeps the table's resources not ready.
                Err(e) => {
                    static FAILED: std::sync::OnceLock<crate::telemetry::LogThrottle> =
                        std::sync::OnceLock::new();
                    if let Some(not_logged) = FAILED.get_or_init(Default::default).permit() {
                        tracing::error!(table = %t.name, error = %e, not_logged, "cannot install the trigger (at most one such line per 10 s)")
                    }
                }
            }
        }
        problems.push(s.problem(t).or(problem));
    }
    let mut seen = seen;
    for (t, s) in watch.tables.iter().zip(&mut seen) {
        s.dependency = triggers::fingerprint(conn, &t.name).await?;
    }
    let mut events = tracker.update(watch, seen.into_iter().zip(problems).collect());
    for name in repaired {
        if !events
            .iter()
            .any(|e| matches!(e, Event::Resync(r) if r.scope.covers(&name)))
        {
            events.push(Resync::table(name, "its trigger was installed again"));
        }
    }
    for e in &events {
        if let Event::Coverage(Coverage { table, problem }) = e {
            match problem {
                Some(p) => {
                    tracing::error!(table = %table, problem = %p, "changes to this table cannot be followed: its resources are not ready")
                }
                None => tracing::info!(table = %table, "changes to this table are followed again"),
            }
        }
    }
    Ok(events)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::feed::{ColumnType, Scope, WatchedColumn, WatchedTable};

    fn watch() -> Watch {
        let t = |n: &str| WatchedTable {
            name: Arc::from(n),
            columns: vec![WatchedColumn {
                name: Arc::from("id"),
                ty: ColumnType::Int8,
            }],
            keys: vec![vec![Arc::from("id")]],
            served: Vec::new(),
        };
        Watch {
            tables: vec![t("public.a"), t("public.b")],
        }
    }

    fn seen(oid: u32, partitions: &[u32]) -> Observed {
        Observed {
            oid: Some(oid),
            partitioned: !partitions.is_empty(),
            partitions: partitions.to_vec(),
            dependency: String::new(),
            not_unique: Vec::new(),
            missing: Vec::new(),
        }
    }

    /// What the events say, as text: `resync a`, `problem a: …`, `ok a`.
    fn said(events: &[Event]) -> Vec<String> {
        events
            .iter()
            .map(|e| match e {
                Event::Resync(r) => match &r.scope {
                    Scope::Table(t) => format!("resync {t}"),
                    Scope::All => "resync all".into(),
                },
                Event::Coverage(c) => match &c.problem {
                    Some(p) => format!("problem {}: {p}", c.table),
                    None => format!("ok {}", c.table),
                },
                other => format!("{other:?}"),
            })
            .collect()
    }

    #[test]
    fn the_first_check_only_records_but_says_a_problem() {
        let w = watch();
        let mut t = Tracker::default();
        let e = t.update(
            &w,
            vec![(seen(1, &[]), None), (seen(2, &[]), Some("x".into()))],
        );
        assert_eq!(said(&e), ["problem public.b: x"]);
        assert!(t.has_problem());
        // Unchanged: nothing.
        let e = t.update(
            &w,
            vec![(seen(1, &[]), None), (seen(2, &[]), Some("x".into()))],
        );
        assert!(e.is_empty());
    }

    #[test]
    fn a_replaced_table_or_changed_partitions_are_rescanned() {
        let w = watch();
        let mut t = Tracker::default();
        t.update(&w, vec![(seen(1, &[]), None), (seen(2, &[10, 11]), None)]);
        let e = t.update(&w, vec![(seen(3, &[]), None), (seen(2, &[10, 11]), None)]);
        assert_eq!(said(&e), ["resync public.a"]);
        let e = t.update(
            &w,
            vec![(seen(3, &[]), None), (seen(2, &[10, 11, 12]), None)],
        );
        assert_eq!(said(&e), ["resync public.b"], "attached");
        let e = t.update(&w, vec![(seen(3, &[]), None), (seen(2, &[11, 12]), None)]);
        assert_eq!(said(&e), ["resync public.b"], "detached");
        let gone = Observed::default();
        let e = t.update(
            &w,
            vec![
                (gone.clone(), Some("gone".into())),
                (seen(2, &[11, 12]), None),
            ],
        );
        assert_eq!(said(&e), ["problem public.a: gone", "resync public.a"]);
        let e = t.update(&w, vec![(seen(4, &[]), None), (seen(2, &[11, 12]), None)]);
        assert_eq!(said(&e), ["ok public.a", "resync public.a"]);
    }

    #[test]
    fn an_edit_undone_between_two_checks_is_rescanned() {
        let w = watch();
        let mut t = Tracker::default();
        let with = |dep: &str| {
            let mut s = seen(1, &[]);
            s.dependency = dep.into();
            vec![(s, None), (seen(2, &[]), None)]
        };
        t.update(&w, with("10:500"));
        assert!(t.update(&w, with("10:500")).is_empty());
        // Dropped from the publication and added back: another row.
        assert_eq!(said(&t.update(&w, with("11:530"))), ["resync public.a"]);
        assert!(t.update(&w, with("11:530")).is_empty());
    }

    #[test]
    fn a_key_no_longer_unique_is_a_problem_until_it_is_again() {
        let w = watch();
        let mut t = Tracker::default();
        let at = |not_unique: &[&str]| {
            let mut s = seen(1, &[]);
            s.not_unique = not_unique.iter().map(|c| vec![c.to_string()]).collect();
            let problem = s.problem(&w.tables[0]);
            vec![(s, problem), (seen(2, &[]), None)]
        };
        t.update(&w, at(&[]));
        let e = said(&t.update(&w, at(&["id"])));
        assert_eq!(e.len(), 1, "{e:?}");
        assert!(
            e[0].starts_with("problem public.a: key column id of public.a is no longer unique"),
            "{e:?}"
        );
        assert!(
            e[0].ends_with(r#"CREATE UNIQUE INDEX CONCURRENTLY ON "public"."a" ("id")"#),
            "{e:?}"
        );
        assert!(t.has_problem());
        assert_eq!(
            said(&t.update(&w, at(&[]))),
            ["ok public.a", "resync public.a"],
            "unique again: rows inserted meanwhile may share a key the cache holds"
        );
        // A missing table says that, not uniqueness.
        let gone = Observed::default();
        assert_eq!(
            gone.problem(&w.tables[0]).as_deref(),
            Some("table public.a does not exist")
        );
    }

    #[test]
    fn a_changed_shape_is_a_rescan_of_that_table_and_the_first_only_records() {
        let w = watch();
        let mut shapes = Shapes::new(&w);
        let s = |a: &str, b: &str| vec![Some(a.to_string()), Some(b.to_string())];
        assert!(
            shapes
                .update(&w, s("10|id:1:20:-1", "11|id:1:20:-1"))
                .is_empty()
        );
        assert!(
            shapes
                .update(&w, s("10|id:1:20:-1", "11|id:1:20:-1"))
                .is_empty()
        );
        // Storage rewritten (VACUUM FULL, a type change with USING).
        assert_eq!(
            said(&shapes.update(&w, s("12|id:1:20:-1", "11|id:1:20:-1"))),
            ["resync public.a"]
        );
        // A served column's place or type.
        assert_eq!(
            said(&shapes.update(&w, s("12|id:1:20:-1", "11|id:2:20:-1"))),
            ["resync public.b"]
        );
        // A table that is gone is the checks' to report; back as it was,
        // nothing changed.
        assert!(
            shapes
                .update(&w, vec![None, Some("11|id:2:20:-1".into())])
                .is_empty()
        );
        assert!(
            shapes
                .update(&w, s("12|id:1:20:-1", "11|id:2:20:-1"))
                .is_empty()
        );
    }

    #[test]
    fn a_served_column_that_is_gone_is_named() {
        let w = watch();
        let mut gone = seen(1, &[]);
        gone.missing = vec!["name".into()];
        let p = gone.problem(&w.tables[0]).unwrap();
        assert!(p.contains("public.a has no column name any more"), "{p}");
    }

    #[test]
    fn a_problem_is_said_once_and_its_end_rescans() {
        let w = watch();
        let mut t = Tracker::default();
        let ok = || vec![(seen(1, &[]), None), (seen(2, &[]), None)];
        t.update(&w, ok());
        let bad = |p: &str| vec![(seen(1, &[]), Some(p.to_string())), (seen(2, &[]), None)];
        assert_eq!(said(&t.update(&w, bad("p1"))), ["problem public.a: p1"]);
        assert!(t.update(&w, bad("p1")).is_empty(), "said once");
        assert_eq!(said(&t.update(&w, bad("p2"))), ["problem public.a: p2"]);
        assert_eq!(
            said(&t.update(&w, ok())),
            ["ok public.a", "resync public.a"],
            "followed again: what changed meanwhile was missed"
        );
        assert!(!t.has_problem());
    }
}
