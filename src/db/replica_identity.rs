//! A watched table's replica identity: whether it carries, on UPDATE and
//! DELETE, the old value of every key column of the table's resources, and
//! when it does not, the one identity that does.
//!
//! The identity advised is chosen against every watched column of the
//! table at once, never against the columns missing now: an advice that
//! fixed only those went in a circle (with a table served by `id` and by
//! `email`, "use the email index", then "use the primary key", and so on).
//! In order of preference:
//! 1. a unique index that may serve as an identity (not partial, immediate,
//!    on NOT NULL plain columns) holding every watched column, the
//!    narrowest first: only its columns are logged;
//! 2. on a plain table whose watched columns are all NOT NULL and hold one
//!    of its unique sets (a set holding a unique set is unique), a new
//!    unique index on exactly them: one more index to maintain, but the
//!    identity stays narrow, so a publication's column list can still
//!    leave the other columns out;
//! 3. `FULL`: the whole old row is logged, and a publication must then
//!    send every column of the table (PostgreSQL refuses UPDATE and DELETE
//!    on a table whose publication's column list leaves out an identity
//!    column).

use super::catalog::{
    RelKind, ReplicaIdentity, TableInfo, Uniqueness, WatchedTable, quote, quote_table,
};

/// What a watched table's replica identity needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Needed {
    /// Why the identity in force does not do, naming the fix; `None` when
    /// it carries every watched column.
    pub problem: Option<String>,
    /// The statements that set the identity advised, in order (none when
    /// the identity in force does).
    pub fix: Vec<String>,
    /// The identity's columns once `fix` has run (the identity in force
    /// when there is nothing to fix); `None` for `FULL`: every column.
    pub columns: Option<Vec<String>>,
}

/// Postgres' limit on an identifier, in bytes.
const NAME_MAX: usize = 63;

/// What `t`'s identity needs, from its catalog entry `info`.
pub fn needed(t: &WatchedTable, info: &TableInfo) -> Needed {
    let identity = &info.replica_identity;
    let missing: Vec<&str> = t
        .columns
        .iter()
        .map(|c| &*c.name)
        .filter(|c| !identity.carries(c))
        .collect();
    if missing.is_empty() {
        return Needed {
            problem: None,
            fix: Vec::new(),
            columns: columns_of(identity),
        };
    }
    let watched: Vec<&str> = t.columns.iter().map(|c| &*c.name).collect();
    let table = quote_table(&t.name);
    let existing = info
        .unique_indexes
        .iter()
        .filter(|i| watched.iter().all(|w| i.columns.iter().any(|c| c == w)))
        .min_by(|a, b| (a.columns.len(), &a.name).cmp(&(b.columns.len(), &b.name)));
    let not_null = watched
        .iter()
        .all(|w| info.column(w).is_some_and(|c| c.not_null));
    let unique = matches!(info.uniqueness(&watched), Uniqueness::Proven(_));
    let (fix, columns) = match existing {
        Some(i) => (
            vec![format!(
                "ALTER TABLE {table} REPLICA IDENTITY USING INDEX {}",
                quote(&i.name)
            )],
            Some(i.columns.clone()),
        ),
        None if info.kind == RelKind::Table && not_null && unique => {
            let name = index_name(&t.name, &watched);
            let cols: Vec<String> = watched.iter().map(|c| quote(c)).collect();
            (
                vec![
                    format!(
                        "CREATE UNIQUE INDEX CONCURRENTLY {} ON {table} ({})",
                        quote(&name),
                        cols.join(", ")
                    ),
                    format!(
                        "ALTER TABLE {table} REPLICA IDENTITY USING INDEX {}",
                        quote(&name)
                    ),
                ],
                Some(watched.iter().map(|c| c.to_string()).collect()),
            )
        }
        None => (
            vec![format!("ALTER TABLE {table} REPLICA IDENTITY FULL")],
            None,
        ),
    };
    let what = match identity {
        ReplicaIdentity::Default(cols) if cols.is_empty() => "no primary key",
        ReplicaIdentity::Nothing => "REPLICA IDENTITY NOTHING",
        _ => "a replica identity without it",
    };
    Needed {
        problem: Some(format!(
            "table {} does not carry its old {} on UPDATE and DELETE ({what}): {}",
            t.name,
            missing.join(", "),
            fix.join("; ")
        )),
        fix,
        columns,
    }
}

/// The columns `identity` logs; `None` for `FULL` (every column).
fn columns_of(identity: &ReplicaIdentity) -> Option<Vec<String>> {
    match identity {
        ReplicaIdentity::Default(cols) | ReplicaIdentity::Index(cols) => Some(cols.clone()),
        ReplicaIdentity::Full => None,
        ReplicaIdentity::Nothing => Some(Vec::new()),
    }
}

/// `accounts_id_email_identity` for the new index on `public.accounts
/// (id, email)`, cut to Postgres' 63 bytes on a character boundary.
fn index_name(table: &str, columns: &[&str]) -> String {
    let relname = table.rsplit_once('.').map_or(table, |(_, r)| r);
    let mut name = format!("{relname}_{}_identity", columns.join("_"));
    while name.len() > NAME_MAX {
        name.pop();
    }
    name
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::db::catalog::{ColumnInfo, ColumnType, UniqueIndex, WatchedColumn};

    fn watched(columns: &[&str]) -> WatchedTable {
        WatchedTable {
            name: Arc::from("public.users"),
            columns: columns
                .iter()
                .map(|c| WatchedColumn {
                    name: Arc::from(*c),
                    ty: ColumnType::Text,
                })
                .collect(),
            keys: Vec::new(),
            served: Vec::new(),
        }
    }

    fn info(
        identity: ReplicaIdentity,
        indexes: &[(&str, &[&str])],
        nullable: &[&str],
    ) -> TableInfo {
        TableInfo {
            name: Arc::from("public.users"),
            kind: RelKind::Table,
            columns: ["id", "email", "handle", "name"]
                .iter()
                .map(|c| ColumnInfo {
                    name: c.to_string(),
                    declared: "text".into(),
                    base: "text".into(),
                    element: None,
                    not_null: !nullable.contains(c),
                    collation: 0,
                    base_sql: "pg_catalog.text".into(),
                })
                .collect(),
            replica_identity: identity,
            unique_indexes: indexes
                .iter()
                .map(|(n, cols)| UniqueIndex {
                    name: n.to_string(),
                    columns: cols.iter().map(|c| c.to_string()).collect(),
                })
                .collect(),
            // The primary key: every watched set here holds `id`.
            key_sets: vec![UniqueIndex {
                name: "users_pkey".into(),
                columns: vec!["id".into()],
            }],
        }
    }

    fn pk() -> ReplicaIdentity {
        ReplicaIdentity::Default(vec!["id".into()])
    }

    #[test]
    fn an_identity_that_carries_every_key_needs_nothing() {
        let n = needed(&watched(&["id"]), &info(pk(), &[], &[]));
        assert_eq!(n.problem, None);
        assert!(n.fix.is_empty());
        assert_eq!(n.columns, Some(vec!["id".to_string()]));
        let full = needed(&watched(&["email"]), &info(ReplicaIdentity::Full, &[], &[]));
        assert_eq!((full.problem, full.columns), (None, None));
    }

    /// The circle: served by `id` and by `email`, with the primary key and
    /// a unique index on `email`, neither of which holds both. The advice
    /// is the same whichever of the two is in force, and carries both.
    #[test]
    fn the_advice_carries_every_key_whichever_identity_is_in_force() {
        let indexes: &[(&str, &[&str])] =
            &[("users_pkey", &["id"]), ("users_email_key", &["email"])];
        let by_pk = needed(&watched(&["id", "email"]), &info(pk(), indexes, &[]));
        let by_email = needed(
            &watched(&["id", "email"]),
            &info(ReplicaIdentity::Index(vec!["email".into()]), indexes, &[]),
        );
        assert_eq!(by_pk.fix, by_email.fix);
        assert_eq!(
            by_pk.fix,
            [
                r#"CREATE UNIQUE INDEX CONCURRENTLY "users_id_email_identity" ON "public"."users" ("id", "email")"#,
                r#"ALTER TABLE "public"."users" REPLICA IDENTITY USING INDEX "users_id_email_identity""#,
            ]
        );
        assert_eq!(
            by_pk.columns,
            Some(vec!["id".to_string(), "email".to_string()])
        );
        let why = by_pk.problem.unwrap();
        assert!(why.contains("old email on UPDATE"), "{why}");
        assert!(
            why.ends_with(r#"USING INDEX "users_id_email_identity""#),
            "{why}"
        );
    }

    #[test]
    fn an_existing_index_holding_every_key_is_preferred_the_narrowest_first() {
        let indexes: &[(&str, &[&str])] = &[
            ("wide", &["handle", "email", "id"]),
            ("users_email_id", &["email", "id"]),
            ("users_email_key", &["email"]),
        ];
        let n = needed(
            &watched(&["id", "email"]),
            &info(ReplicaIdentity::Nothing, indexes, &[]),
        );
        assert_eq!(
            n.fix,
            [r#"ALTER TABLE "public"."users" REPLICA IDENTITY USING INDEX "users_email_id""#]
        );
        assert_eq!(n.columns, Some(vec!["email".to_string(), "id".to_string()]));
        assert!(n.problem.unwrap().contains("REPLICA IDENTITY NOTHING"));
    }

    #[test]
    fn a_nullable_key_a_set_not_unique_or_a_partitioned_table_leaves_full() {
        let n = needed(&watched(&["id", "handle"]), &info(pk(), &[], &["handle"]));
        assert_eq!(
            n.fix,
            [r#"ALTER TABLE "public"."users" REPLICA IDENTITY FULL"#]
        );
        assert_eq!(n.columns, None);
        // A view's key followed on its source table need not be unique
        // there: no unique index can be made on it alone.
        let n = needed(&watched(&["email", "handle"]), &info(pk(), &[], &[]));
        assert_eq!(
            n.fix,
            [r#"ALTER TABLE "public"."users" REPLICA IDENTITY FULL"#]
        );
        let mut partitioned = info(ReplicaIdentity::Default(vec![]), &[], &[]);
        partitioned.kind = RelKind::PartitionedTable;
        let n = needed(&watched(&["email"]), &partitioned);
        assert!(n.problem.unwrap().contains("no primary key"));
        assert_eq!(
            n.fix,
            [r#"ALTER TABLE "public"."users" REPLICA IDENTITY FULL"#]
        );
    }

    #[test]
    fn a_new_index_name_fits_postgres_limit() {
        let long = "c".repeat(40);
        let name = index_name("public.t", &[&long, &long]);
        assert_eq!(name.len(), NAME_MAX);
        assert!(name.starts_with("t_ccc"));
        assert_eq!(index_name("s.accounts", &["id"]), "accounts_id_identity");
    }
}
