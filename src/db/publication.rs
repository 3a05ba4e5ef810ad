//! The WAL feed's publication: what it must be for the feed to see every
//! change of every watched table, what is wrong with it now, and the one
//! transaction that makes it right (`bloomgate install-feed`,
//! `database.install_feed`).
//!
//! A publication delivers every change of a table only if it holds the
//! table itself (by OID: the catalog's current name for it), publishes
//! insert, update, delete and truncate, filters no rows, leaves no key
//! column out of a column list, and, for a partitioned table, publishes its
//! partitions' changes under the table's own name
//! (`publish_via_partition_root`). A table's replica identity must carry
//! every key column of its resources, or an UPDATE or DELETE does not say
//! which key it touched ([`super::identity`]); and a table without a usable
//! replica identity must never be added at all: Postgres then refuses every
//! UPDATE and DELETE on it, the application's writes included.
//!
//! # The column list
//! The feed reads nothing of a change but its keys, so on Postgres 15 and
//! later the publication it installs lists, for each plain table, only the
//! key columns of the table's resources and its replica identity's columns
//! ([`Plan::columns`]): no other column (a `password_hash`, say) is ever
//! decoded or sent to the gateway, whatever its grants. pgoutput then sends
//! only those columns of a row, and still sends every change of every row:
//! an UPDATE of a column left out arrives, with the row's key. The identity's
//! columns must be in the list, or Postgres refuses the table's UPDATE and
//! DELETE (the application's); so a table whose identity is `FULL` gets no
//! list (every column), nor does a partitioned table, whose partitions each
//! have an identity of their own (a partition attached later with another
//! one would have its writes refused).

use sqlx::{Connection, PgConnection, Row};

use super::catalog::{self, RelKind, TableInfo, Watch, WatchedTable, quote, quote_table};
use super::lsn::Lsn;
use super::replica_identity::{self, Needed};

/// The fix every publication problem shares.
const FIX: &str = "run `bloomgate install-feed` (or set database.install_feed = true)";

/// A watched table's column list in the publication (`None`: every
/// column), its `relreplident` and its identity index's columns.
type ListAndIdentity = (Option<Vec<String>>, Option<String>, Option<Vec<String>>);

/// What [`check`] found.
#[derive(Debug)]
pub struct Checked {
    /// Whether the publication exists at all.
    pub exists: bool,
    /// Its problem for each watched table (in `watch` order), `None` where
    /// the table is followed completely.
    pub problems: Vec<Option<String>>,
    /// The column list of each watched table in it (in `watch` order):
    /// `None` where it publishes every column, or does not hold the table.
    pub columns: Vec<Option<Vec<String>>>,
}

/// What the publication does not deliver, per watched table. Replica
/// identities are [`identity_problems`]'.
pub async fn check(
    conn: &mut PgConnection,
    watch: &Watch,
    publication: &str,
) -> Result<Checked, sqlx::Error> {
    let flags: Option<(bool, bool, bool, bool, bool)> = sqlx::query_as(
        "SELECT pubinsert, pubupdate, pubdelete, pubtruncate, pubviaroot
           FROM pg_publication WHERE pubname = $1",
    )
    .bind(publication)
    .fetch_optional(&mut *conn)
    .await?;
    let Some((ins, upd, del, trunc, via_root)) = flags else {
        let why = format!("publication {publication:?} does not exist: {FIX}");
        return Ok(Checked {
            exists: false,
            problems: vec![Some(why); watch.tables.len()],
            columns: vec![None; watch.tables.len()],
        });
    };
    let missing_ops: Vec<&str> = [
        (ins, "insert"),
        (upd, "update"),
        (del, "delete"),
        (trunc, "truncate"),
    ]
    .into_iter()
    .filter(|(on, _)| !on)
    .map(|(_, op)| op)
    .collect();
    // Row filters and column lists exist from Postgres 15 on.
    let version: i32 = sqlx::query_scalar("SELECT current_setting('server_version_num')::int")
        .fetch_one(&mut *conn)
        .await?;
    let sql = if version >= 150_000 {
        "SELECT schemaname || '.' || tablename, attnames::text[], rowfilter IS NOT NULL
           FROM pg_publication_tables WHERE pubname = $1"
    } else {
        "SELECT schemaname || '.' || tablename, NULL::text[], false
           FROM pg_publication_tables WHERE pubname = $1"
    };
    let published: Vec<(String, Option<Vec<String>>, bool)> = sqlx::query_as(sql)
        .bind(publication)
        .fetch_all(&mut *conn)
        .await?;
    let partitioned: Vec<bool> = sqlx::query_scalar(
        "SELECT coalesce(c.relkind = 'p', false)
           FROM unnest($1::text[]) WITH ORDINALITY AS t(name, i)
           LEFT JOIN pg_class c ON c.oid = to_regclass(t.name) ORDER BY t.i",
    )
    .bind(quoted_tables(watch))
    .fetch_all(&mut *conn)
    .await?;
    // The list as written (`prattrs`): the view's `attnames` names every
    // column of a table published without one. With it, the replica
    // identity in force (`f`: FULL; else its index's columns), which the
    // list must hold.
    let rows: Vec<ListAndIdentity> = if version >= 150_000 {
        sqlx::query_as(
            "SELECT (SELECT array_agg(a.attname::text ORDER BY a.attnum)
                       FROM pg_publication_rel r
                       JOIN pg_publication p ON p.oid = r.prpubid
                       JOIN pg_attribute a ON a.attrelid = r.prrelid AND a.attnum = ANY (r.prattrs)
                      WHERE p.pubname = $1 AND r.prrelid = c.oid),
                    c.relreplident::text,
                    (SELECT array_agg(a.attname::text)
                       FROM pg_index i
                       JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY (i.indkey)
                      WHERE i.indrelid = c.oid
                        AND CASE c.relreplident WHEN 'd' THEN i.indisprimary
                                                WHEN 'i' THEN i.indisreplident ELSE false END)
               FROM unnest($2::text[]) WITH ORDINALITY AS t(name, i)
               LEFT JOIN pg_class c ON c.oid = to_regclass(t.name)
              ORDER BY t.i",
        )
        .bind(publication)
        .bind(quoted_tables(watch))
        .fetch_all(&mut *conn)
        .await?
    } else {
        vec![(None, None, None); watch.tables.len()]
    };
    let problems = watch
        .tables
        .iter()
        .zip(partitioned)
        .zip(&rows)
        .map(|((t, partitioned), (list, ident, ident_columns))| {
            let p = publication;
            if !missing_ops.is_empty() {
                return Some(format!(
                    "publication {p:?} does not publish {}: {FIX}",
                    missing_ops.join(", ")
                ));
            }
            if partitioned && !via_root {
                return Some(format!(
                    "table {} is partitioned and publication {p:?} does not publish_via_partition_root: {FIX}",
                    t.name
                ));
            }
            let Some((_, columns, filtered)) = published.iter().find(|(n, ..)| *n == *t.name)
            else {
                return Some(format!("table {} is not in publication {p:?}: {FIX}", t.name));
            };
            if *filtered {
                return Some(format!(
                    "publication {p:?} filters the rows of {} (a WHERE clause): {FIX}",
                    t.name
                ));
            }
            let left_out: Vec<&str> = t
                .columns
                .iter()
                .map(|c| &*c.name)
                .filter(|c| columns.as_ref().is_some_and(|l| !l.iter().any(|n| n == c)))
                .collect();
            if !left_out.is_empty() {
                return Some(format!(
                    "publication {p:?} leaves {} of {} out of its column list: {FIX}",
                    left_out.join(", "),
                    t.name
                ));
            }
            // Not the feed's loss (no such change is made), but the
            // application's: the gateway's list is what refuses them.
            let list = list.as_ref()?;
            let refused = |what: String| {
                Some(format!(
                    "PostgreSQL refuses every UPDATE and DELETE on {} ({what}): {FIX}",
                    t.name
                ))
            };
            if ident.as_deref() == Some("f") {
                return refused(format!(
                    "its replica identity is FULL and publication {p:?} lists only some of its columns"
                ));
            }
            let outside: Vec<&str> = ident_columns
                .iter()
                .flatten()
                .filter(|c| !list.contains(c))
                .map(String::as_str)
                .collect();
            if !outside.is_empty() {
                return refused(format!(
                    "publication {p:?} leaves its replica identity's {} out of its column list",
                    outside.join(", ")
                ));
            }
            None
        })
        .collect();
    Ok(Checked {
        exists: true,
        problems,
        columns: rows.into_iter().map(|(list, ..)| list).collect(),
    })
}

/// Each watched table's entry in the publication as catalog rows (the
/// publication's own row, the table's entry, its schema's entry: OIDs and
/// row versions), in `watch` order, for `feed::tracker`: any edit changes
/// it, even one undone before the next check.
pub async fn fingerprints(
    conn: &mut PgConnection,
    watch: &Watch,
    publication: &str,
) -> Result<Vec<String>, sqlx::Error> {
    let version: i32 = sqlx::query_scalar("SELECT current_setting('server_version_num')::int")
        .fetch_one(&mut *conn)
        .await?;
    // Schemas in a publication exist from Postgres 15 on.
    let schemas = if version >= 150_000 {
        "(SELECT string_agg(n.oid::text || ':' || n.xmin::text, ',')
            FROM pg_publication_namespace n JOIN pg_class c ON c.relnamespace = n.pnnspid
           WHERE n.pnpubid = p.oid AND c.oid = to_regclass(t.name))"
    } else {
        "NULL::text"
    };
    let sql = format!(
        "SELECT coalesce((SELECT p.oid::text || ':' || p.xmin::text), '-') || '/' ||
                coalesce((SELECT string_agg(r.oid::text || ':' || r.xmin::text, ',')
                            FROM pg_publication_rel r
                           WHERE r.prpubid = p.oid AND r.prrelid = to_regclass(t.name)), '-') || '/' ||
                coalesce({schemas}, '-')
           FROM unnest($2::text[]) WITH ORDINALITY AS t(name, i)
           LEFT JOIN pg_publication p ON p.pubname = $1
          ORDER BY t.i"
    );
    sqlx::query_scalar(&sql)
        .bind(publication)
        .bind(quoted_tables(watch))
        .fetch_all(conn)
        .await
}

/// What each watched table needs of its replica identity and of the
/// publication, in `watch` order (see "The column list").
#[derive(Debug)]
pub struct Plan {
    /// What the identity needs; `None` for a table that does not exist.
    pub identity: Option<Needed>,
    /// The column list to publish the table with once the identity is as
    /// [`Plan::identity`] advises, in the table's column order; `None`:
    /// every column (before Postgres 15, for `FULL`, or a partitioned
    /// table).
    pub columns: Option<Vec<String>>,
}

/// Each watched table's [`Plan`], read from the catalog.
pub async fn plan(conn: &mut PgConnection, watch: &Watch) -> Result<Vec<Plan>, sqlx::Error> {
    let version: i32 = sqlx::query_scalar("SELECT current_setting('server_version_num')::int")
        .fetch_one(&mut *conn)
        .await?;
    let mut out = Vec::new();
    for t in &watch.tables {
        let Some(info) = catalog::table_info_on(&mut *conn, &t.name).await? else {
            out.push(Plan {
                identity: None,
                columns: None,
            });
            continue;
        };
        let needed = replica_identity::needed(t, &info);
        let columns = column_list(t, &info, needed.columns.as_deref(), version);
        out.push(Plan {
            identity: Some(needed),
            columns,
        });
    }
    Ok(out)
}

/// The column list `t` is published with (see "The column list"), given
/// its identity's columns (`None`: `FULL`).
fn column_list(
    t: &WatchedTable,
    info: &TableInfo,
    identity: Option<&[String]>,
    version: i32,
) -> Option<Vec<String>> {
    let identity = identity?;
    if version < 150_000 || info.kind != RelKind::Table {
        return None;
    }
    Some(
        info.columns
            .iter()
            .map(|c| &c.name)
            .filter(|c| identity.contains(c) || t.columns.iter().any(|w| *w.name == ***c))
            .cloned()
            .collect(),
    )
}

/// Every watched table whose replica identity does not carry every key
/// column of its resources, each as an error naming the fix.
pub async fn identity_problems(
    conn: &mut PgConnection,
    watch: &Watch,
) -> Result<Vec<String>, sqlx::Error> {
    Ok(plan(conn, watch)
        .await?
        .into_iter()
        .filter_map(|p| p.identity.and_then(|n| n.problem))
        .collect())
}

/// Why the publication cannot be installed.
#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    /// A table whose replica identity cannot carry its keys: adding it would
    /// make Postgres refuse every UPDATE and DELETE on it. Nothing changed.
    #[error("{0}; nothing was changed")]
    Identity(String),
    #[error(transparent)]
    Sql(#[from] sqlx::Error),
}

/// Makes the publication deliver every change of the watched tables, in
/// one transaction under the install lock, after checking every table's
/// replica identity: nothing changes unless every table passes.
///
/// A publication that delivers them already is left as it is, tables it
/// holds besides them and wider column lists included: every rewrite of
/// its catalog rows is an edit every running feed must resync for
/// (`feed::tracker`), so a gateway that starts (a rolling deploy, a fleet's
/// next member) would otherwise make the whole fleet rebuild its filters;
/// and a gateway of an older config would take away tables a newer one
/// added. When it must change, it is set to exactly the watched tables,
/// each with its column list ([`Plan::columns`]).
pub async fn install(
    conn: &mut PgConnection,
    watch: &Watch,
    publication: &str,
) -> Result<(), InstallError> {
    install_as(conn, watch, publication, false).await
}

/// [`install`], and a publication that delivers every change but sends
/// columns the feed does not need (one made before column lists, or by
/// hand) narrowed to the column lists too: `bloomgate install-feed`, run by
/// an operator who accepts that every running gateway resyncs once.
pub async fn install_narrowed(
    conn: &mut PgConnection,
    watch: &Watch,
    publication: &str,
) -> Result<(), InstallError> {
    install_as(conn, watch, publication, true).await
}

async fn install_as(
    conn: &mut PgConnection,
    watch: &Watch,
    publication: &str,
    narrow: bool,
) -> Result<(), InstallError> {
    let mut tx = conn.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(super::INSTALL_LOCK_KEY)
        .execute(&mut *tx)
        .await?;
    let plans = plan(&mut tx, watch).await?;
    let bad: Vec<String> = plans
        .iter()
        .filter_map(|p| p.identity.as_ref()?.problem.clone())
        .collect();
    if !bad.is_empty() {
        return Err(InstallError::Identity(bad.join("; ")));
    }
    let now = check(&mut tx, watch, publication).await?;
    let narrowed = now
        .columns
        .iter()
        .zip(&plans)
        .all(|(now, plan)| same_columns(now.as_deref(), plan.columns.as_deref()));
    if now.exists && now.problems.iter().all(Option::is_none) && (!narrow || narrowed) {
        tx.commit().await?;
        return Ok(());
    }
    let all_tables: Option<bool> =
        sqlx::query_scalar("SELECT puballtables FROM pg_publication WHERE pubname = $1")
            .bind(publication)
            .fetch_optional(&mut *tx)
            .await?;
    let lists: Vec<Option<Vec<String>>> = plans.into_iter().map(|p| p.columns).collect();
    for sql in statements(all_tables, watch, publication, &lists) {
        sqlx::query(&sql).execute(&mut *tx).await?;
    }
    tx.commit().await?;
    Ok(())
}

/// Whether two column lists hold the same columns (`None`: every column).
pub fn same_columns(a: Option<&[String]>, b: Option<&[String]>) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(a), Some(b)) => a.len() == b.len() && a.iter().all(|c| b.contains(c)),
        _ => false,
    }
}

/// The watched tables, each as SQL names it (`quote_table`).
fn quoted_tables(watch: &Watch) -> Vec<String> {
    watch.tables.iter().map(|t| quote_table(&t.name)).collect()
}

/// The DDL that makes `publication` deliver every change of every watched
/// table, each with its column list (`lists`, in `watch` order; `None`:
/// every column), given whether it exists (`None`) and is `FOR ALL
/// TABLES`: what [`install`] runs, and what `bloomgate preflight` prints.
pub fn statements(
    all_tables: Option<bool>,
    watch: &Watch,
    publication: &str,
    lists: &[Option<Vec<String>>],
) -> Vec<String> {
    let tables: Vec<String> = quoted_tables(watch)
        .into_iter()
        .zip(lists.iter().chain(std::iter::repeat(&None)))
        .map(|(t, list)| match list {
            Some(cols) => {
                let cols: Vec<String> = cols.iter().map(|c| quote(c)).collect();
                format!("{t} ({})", cols.join(", "))
            }
            None => t,
        })
        .collect();
    let with = "publish = 'insert, update, delete, truncate', publish_via_partition_root = true";
    let p = quote(publication);
    match all_tables {
        None => vec![format!(
            "CREATE PUBLICATION {p} FOR TABLE {} WITH ({with})",
            tables.join(", ")
        )],
        // FOR ALL TABLES holds every table already, every column of each;
        // its list cannot be set.
        Some(true) => vec![format!("ALTER PUBLICATION {p} SET ({with})")],
        // Tables named without a WHERE, each with its column list.
        Some(false) => vec![
            format!("ALTER PUBLICATION {p} SET TABLE {}", tables.join(", ")),
            format!("ALTER PUBLICATION {p} SET ({with})"),
        ],
    }
}

/// Whether a server error says the publication does not exist (SQLSTATE
/// 42704, undefined object), as a walsender reports while decoding a
/// change after `DROP PUBLICATION`.
pub fn is_missing_publication(code: &str, message: &str) -> bool {
    code == "42704" && message.contains("publication")
}

/// The row of `pg_replication_slots` the WAL feed needs.
#[derive(Debug, Clone)]
pub struct SlotState {
    /// The backend holding it now, if any.
    pub active_pid: Option<i32>,
    /// `wal_status = 'lost'`: invalidated by `max_slot_wal_keep_size`.
    pub lost: bool,
    /// Where it resumes: everything before was confirmed by some consumer.
    pub confirmed_flush: Option<Lsn>,
}

/// The slot `name`, if it exists.
pub async fn slot(conn: &mut PgConnection, name: &str) -> Result<Option<SlotState>, sqlx::Error> {
    let row = sqlx::query(
        "SELECT active_pid, coalesce(wal_status = 'lost', false) AS lost,
                confirmed_flush_lsn::text AS confirmed
           FROM pg_replication_slots WHERE slot_name = $1",
    )
    .bind(name)
    .fetch_optional(&mut *conn)
    .await?;
    Ok(row.map(|r| SlotState {
        active_pid: r.get("active_pid"),
        lost: r.get("lost"),
        confirmed_flush: r
            .get::<Option<String>, _>("confirmed")
            .and_then(|t| Lsn::parse(&t)),
    }))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::db::catalog::{ColumnType, WatchedColumn};

    fn watch(tables: &[&str]) -> Watch {
        Watch {
            tables: tables
                .iter()
                .map(|t| WatchedTable {
                    name: Arc::from(*t),
                    columns: vec![WatchedColumn {
                        name: Arc::from("id"),
                        ty: ColumnType::Int8,
                    }],
                    keys: Vec::new(),
                    served: Vec::new(),
                })
                .collect(),
        }
    }

    #[test]
    fn the_statements_name_each_tables_column_list() {
        let w = watch(&["public.users", "public.events"]);
        let lists = [Some(vec!["id".to_string(), "email".to_string()]), None];
        let with = "WITH (publish = 'insert, update, delete, truncate', publish_via_partition_root = true)";
        assert_eq!(
            statements(None, &w, "bloomgate", &lists),
            [format!(
                r#"CREATE PUBLICATION "bloomgate" FOR TABLE "public"."users" ("id", "email"), "public"."events" {with}"#
            )]
        );
        assert_eq!(
            statements(Some(false), &w, "bloomgate", &lists)[0],
            r#"ALTER PUBLICATION "bloomgate" SET TABLE "public"."users" ("id", "email"), "public"."events""#
        );
        // FOR ALL TABLES: every column of every table, its list not ours.
        assert_eq!(statements(Some(true), &w, "bloomgate", &lists).len(), 1);
    }

    #[test]
    fn column_lists_compare_as_sets() {
        let l = |c: &[&str]| c.iter().map(|c| c.to_string()).collect::<Vec<_>>();
        assert!(same_columns(None, None));
        assert!(same_columns(
            Some(&l(&["id", "email"])),
            Some(&l(&["email", "id"]))
        ));
        assert!(!same_columns(Some(&l(&["id"])), Some(&l(&["id", "email"]))));
        assert!(!same_columns(None, Some(&l(&["id"]))));
    }

    #[test]
    fn a_missing_publication_is_told_by_its_sqlstate() {
        assert!(is_missing_publication(
            "42704",
            "publication \"bloomgate\" does not exist"
        ));
        assert!(!is_missing_publication(
            "42704",
            "type \"x\" does not exist"
        ));
        assert!(!is_missing_publication("XX000", "publication"));
    }
}
