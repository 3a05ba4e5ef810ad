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
//! which key it touched; and a table without a usable replica identity must
//! never be added at all: Postgres then refuses every UPDATE and DELETE on
//! it, the application's writes included.

use sqlx::{Connection, PgConnection, Row};

use super::catalog::{self, ReplicaIdentity, quote, quote_table};
use super::catalog::{Watch, WatchedTable};
use super::lsn::Lsn;

/// The fix every publication problem shares.
const FIX: &str = "run `bloomgate install-feed` (or set database.install_feed = true)";

/// What [`check`] found.
#[derive(Debug)]
pub struct Checked {
    /// Whether the publication exists at all.
    pub exists: bool,
    /// Its problem for each watched table (in `watch` order), `None` where
    /// the table is followed completely.
    pub problems: Vec<Option<String>>,
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
    let problems = watch
        .tables
        .iter()
        .zip(partitioned)
        .map(|(t, partitioned)| {
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
            None
        })
        .collect();
    Ok(Checked {
        exists: true,
        problems,
    })
}

/// Each watched table's entry in the publication as catalog rows (the
/// publication's own row, the table's entry, its schema's entry: OIDs and
/// row versions), in `watch` order, for `feed::watch`: any edit changes
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

/// Every watched table whose replica identity does not carry every key
/// column of its resources, each as an error naming the fix.
pub async fn identity_problems(
    conn: &mut PgConnection,
    watch: &Watch,
) -> Result<Vec<String>, sqlx::Error> {
    let mut out = Vec::new();
    for t in &watch.tables {
        let Some(info) = catalog::table_info_on(&mut *conn, &t.name).await? else {
            continue;
        };
        if let Some(why) = identity_problem(t, &info.replica_identity, &info.unique_indexes) {
            out.push(why);
        }
    }
    Ok(out)
}

/// Why `identity` cannot carry `t`'s key columns, naming the `ALTER TABLE`
/// that fixes it; `None` if it can.
fn identity_problem(
    t: &WatchedTable,
    identity: &ReplicaIdentity,
    unique: &[catalog::UniqueIndex],
) -> Option<String> {
    let missing: Vec<&str> = t
        .columns
        .iter()
        .map(|c| &*c.name)
        .filter(|c| !identity.carries(c))
        .collect();
    if missing.is_empty() {
        return None;
    }
    // A unique index covering every key column would do, and costs writers
    // less than FULL (only its columns are logged).
    let index = unique
        .iter()
        .find(|i| missing.iter().all(|m| i.columns.iter().any(|c| c == m)));
    let fix = match index {
        Some(i) => format!(
            "ALTER TABLE {} REPLICA IDENTITY USING INDEX {}",
            t.name,
            quote(&i.name)
        ),
        None => format!("ALTER TABLE {} REPLICA IDENTITY FULL", t.name),
    };
    let what = match identity {
        ReplicaIdentity::Default(cols) if cols.is_empty() => "no primary key",
        ReplicaIdentity::Nothing => "REPLICA IDENTITY NOTHING",
        _ => "a replica identity without it",
    };
    Some(format!(
        "table {} does not carry its old {} on UPDATE and DELETE ({what}): {fix}",
        t.name,
        missing.join(", ")
    ))
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
/// holds besides them included: every rewrite of its catalog rows is an
/// edit every running feed must resync for (`feed::watch`), so a gateway
/// that starts (a rolling deploy, a fleet's next member) would otherwise
/// make the whole fleet rebuild its filters; and a gateway of an older
/// config would take away tables a newer one added. When it must change,
/// it is set to exactly the watched tables.
pub async fn install(
    conn: &mut PgConnection,
    watch: &Watch,
    publication: &str,
) -> Result<(), InstallError> {
    let mut tx = conn.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(super::INSTALL_LOCK_KEY)
        .execute(&mut *tx)
        .await?;
    let bad = identity_problems(&mut tx, watch).await?;
    if !bad.is_empty() {
        return Err(InstallError::Identity(bad.join("; ")));
    }
    let now = check(&mut tx, watch, publication).await?;
    if now.exists && now.problems.iter().all(Option::is_none) {
        tx.commit().await?;
        return Ok(());
    }
    let all_tables: Option<bool> =
        sqlx::query_scalar("SELECT puballtables FROM pg_publication WHERE pubname = $1")
            .bind(publication)
            .fetch_optional(&mut *tx)
            .await?;
    for sql in statements(all_tables, watch, publication) {
        sqlx::query(&sql).execute(&mut *tx).await?;
    }
    tx.commit().await?;
    Ok(())
}

/// The watched tables, each as SQL names it (`quote_table`).
fn quoted_tables(watch: &Watch) -> Vec<String> {
    watch.tables.iter().map(|t| quote_table(&t.name)).collect()
}

/// The DDL that makes `publication` deliver every change of every watched
/// table, given whether it exists (`None`) and is `FOR ALL TABLES`: what
/// [`install`] runs, and what `bloomgate preflight` prints.
pub fn statements(all_tables: Option<bool>, watch: &Watch, publication: &str) -> Vec<String> {
    let tables = quoted_tables(watch);
    let with = "publish = 'insert, update, delete, truncate', publish_via_partition_root = true";
    let p = quote(publication);
    match all_tables {
        None => vec![format!(
            "CREATE PUBLICATION {p} FOR TABLE {} WITH ({with})",
            tables.join(", ")
        )],
        // FOR ALL TABLES holds every table already; its list cannot be set.
        Some(true) => vec![format!("ALTER PUBLICATION {p} SET ({with})")],
        // Tables named without a WHERE or a column list: none is left.
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
    use crate::db::catalog::UniqueIndex;
    use crate::db::catalog::{ColumnType, WatchedColumn};

    fn table(columns: &[&str]) -> WatchedTable {
        WatchedTable {
            name: Arc::from("public.users"),
            columns: columns
                .iter()
                .map(|c| WatchedColumn {
                    name: Arc::from(*c),
                    ty: ColumnType::Text,
                    unique: false,
                })
                .collect(),
        }
    }

    #[test]
    fn an_identity_problem_names_the_cheapest_fix() {
        let pk = ReplicaIdentity::Default(vec!["id".into()]);
        assert_eq!(identity_problem(&table(&["id"]), &pk, &[]), None);
        let email = UniqueIndex {
            name: "users_email_key".into(),
            columns: vec!["email".into()],
        };
        let why = identity_problem(&table(&["id", "email"]), &pk, &[email]).unwrap();
        assert!(why.contains("old email"), "{why}");
        assert!(
            why.ends_with(
                r#"ALTER TABLE public.users REPLICA IDENTITY USING INDEX "users_email_key""#
            ),
            "{why}"
        );
        let why = identity_problem(&table(&["k"]), &ReplicaIdentity::Default(vec![]), &[]).unwrap();
        assert!(
            why.contains("no primary key") && why.ends_with("REPLICA IDENTITY FULL"),
            "{why}"
        );
        assert_eq!(
            identity_problem(&table(&["k"]), &ReplicaIdentity::Full, &[]),
            None
        );
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
