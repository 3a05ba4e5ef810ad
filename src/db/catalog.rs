//! What the catalog says about a resource's table: its canonical name, its
//! kind, its columns with their real types, and its replica identity.
//!
//! Read once at start-up (and by `check-config` when the database answers),
//! so that every other part works from the database's own description rather
//! than from the config's spelling:
//! - one canonical name per table (`schema.table`, as Postgres names it), so
//!   a change announced for `public.users` reaches the resource configured as
//!   `users`;
//! - each key column's base type (domains resolved), which decides whether
//!   its key type fits and what canonical text its values have
//!   ([`ColumnType`], [`canonical_text`]);
//! - every column's type and nullability, for the response schemas;
//! - the replica identity, which decides whether logical replication carries
//!   a row's old key on UPDATE and DELETE;
//! - the sets of columns the table holds unique ([`TableInfo::key_sets`]):
//!   a resource is served by a key only if one of them lies within its key
//!   columns ([`TableInfo::uniqueness`]), or one key would name several
//!   rows and the row query would answer with any of them (another
//!   tenant's, say).
//!
//! Names go to Postgres quoted (`"public"."users"`), exactly as the row and
//! scan queries quote them, so both resolve to the same relation.

use std::sync::Arc;

use sqlx::{PgConnection, PgPool, Row};

use crate::key::compare::{Comparison, Lowering};
pub use crate::key::{ColumnType, canonical_text};

/// A table as Postgres names it, schema-qualified and unquoted
/// (`public.users`).
pub type TableName = Arc<str>;

/// What the change feeds watch: every table a resource follows, with the
/// key column of every resource on it (read from the catalog at start-up).
#[derive(Clone, Debug, Default)]
pub struct Watch {
    pub tables: Vec<WatchedTable>,
}

impl Watch {
    /// Adds the key `columns` of `table`, which a resource serving `served`
    /// follows (tables kept in name order, each column once); `unique`: the
    /// resource serves this very table by this key, so the feeds' checks
    /// hold the key to stay unique ([`TableInfo::uniqueness`]). A view's
    /// key, followed on its `source_table`, is not held so: that table's
    /// rows are not the view's.
    pub fn follow(
        &mut self,
        table: &TableName,
        columns: Vec<WatchedColumn>,
        unique: bool,
        served: &[String],
    ) {
        let at = match self.tables.binary_search_by(|t| t.name.cmp(table)) {
            Ok(at) => at,
            Err(at) => {
                self.tables.insert(
                    at,
                    WatchedTable {
                        name: table.clone(),
                        columns: Vec::new(),
                        keys: Vec::new(),
                        served: Vec::new(),
                    },
                );
                at
            }
        };
        let t = &mut self.tables[at];
        for s in served {
            if !t.served.iter().any(|c| **c == **s) {
                t.served.push(Arc::from(s.as_str()));
            }
        }
        let key: Vec<Arc<str>> = columns.iter().map(|c| c.name.clone()).collect();
        if unique && !t.keys.contains(&key) {
            t.keys.push(key);
        }
        for column in columns {
            if !t.columns.iter().any(|c| c.name == column.name) {
                t.columns.push(column);
            }
        }
    }
}

#[derive(Clone, Debug)]
pub struct WatchedTable {
    pub name: TableName,
    /// The key columns of every resource on this table (distinct).
    pub columns: Vec<WatchedColumn>,
    /// The keys held unique (see [`Watch::follow`]): each a resource's key
    /// columns, in its order.
    pub keys: Vec<Vec<Arc<str>>>,
    /// Every column a resource on this table serves (distinct): a change of
    /// their type or place that rewrites the table is a change of every row
    /// served (see `feed::tracker`, "Shapes").
    pub served: Vec<Arc<str>>,
}

#[derive(Clone, Debug)]
pub struct WatchedColumn {
    pub name: Arc<str>,
    pub ty: ColumnType,
}

/// What kind of relation a resource reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RelKind {
    Table,
    PartitionedTable,
    View,
    MaterializedView,
    Foreign,
    Other,
}

/// Which columns of the old row an UPDATE or DELETE writes to the WAL
/// (`ALTER TABLE … REPLICA IDENTITY`), as column names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReplicaIdentity {
    /// `DEFAULT`: the primary key's columns (none without a primary key).
    Default(Vec<String>),
    /// `USING INDEX`: that index's columns.
    Index(Vec<String>),
    /// `FULL`: every column.
    Full,
    /// `NOTHING`.
    Nothing,
}

impl ReplicaIdentity {
    /// Whether the old value of `column` is carried.
    pub fn carries(&self, column: &str) -> bool {
        match self {
            ReplicaIdentity::Default(cols) | ReplicaIdentity::Index(cols) => {
                cols.iter().any(|c| c == column)
            }
            ReplicaIdentity::Full => true,
            ReplicaIdentity::Nothing => false,
        }
    }
}

/// One column, its type as declared and as stored.
#[derive(Clone, Debug)]
pub struct ColumnInfo {
    pub name: String,
    /// `format_type` of the declared type: `character(5)`, `my_domain`, ...
    pub declared: String,
    /// `typname` of the base type (domains resolved): `bpchar`, `int4`,
    /// `_int4` for an array, ...
    pub base: String,
    /// For an array: the `typname` of its element's base type.
    pub element: Option<String>,
    /// `NOT NULL` on the column or on any domain on the way to the base.
    pub not_null: bool,
    /// `pg_attribute.attcollation` (0: not collatable).
    pub collation: i64,
    /// The base type as SQL names it, schema-qualified and quoted
    /// (`public.citext`): what the row query casts a key to.
    pub base_sql: String,
}

impl ColumnInfo {
    pub fn column_type(&self) -> ColumnType {
        ColumnType::from_type_name(&self.base)
    }
}

/// A unique index usable as a replica identity (valid, not partial, not
/// deferrable, on NOT NULL plain columns), for error messages that name the
/// fix.
#[derive(Clone, Debug)]
pub struct UniqueIndex {
    pub name: String,
    pub columns: Vec<String>,
}

/// What the catalog says about one relation.
#[derive(Clone, Debug)]
pub struct TableInfo {
    pub name: TableName,
    pub kind: RelKind,
    /// In column order; dropped and system columns left out.
    pub columns: Vec<ColumnInfo>,
    pub replica_identity: ReplicaIdentity,
    pub unique_indexes: Vec<UniqueIndex>,
    /// Every set of columns the table holds unique: the key columns (not
    /// the `INCLUDE`d ones) of its primary key and of every valid,
    /// non-partial unique index on plain columns. Nullable columns count:
    /// `=` never matches NULL, so a key still names at most one row.
    pub key_sets: Vec<UniqueIndex>,
}

/// Why a resource's key columns cannot be shown to name one row at most.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Uniqueness {
    /// A unique set lies within the key columns: this index.
    Proven(String),
    /// A view, or a foreign table: the catalog cannot show it (a view may
    /// join and repeat rows). The row query's second guard applies alone.
    Unprovable,
    /// A table without a unique set within the key columns.
    NotUnique,
}

impl TableInfo {
    pub fn column(&self, name: &str) -> Option<&ColumnInfo> {
        self.columns.iter().find(|c| c.name == name)
    }

    /// Whether `key` (a resource's key columns) names at most one row.
    pub fn uniqueness(&self, key: &[&str]) -> Uniqueness {
        if !matches!(
            self.kind,
            RelKind::Table | RelKind::PartitionedTable | RelKind::MaterializedView
        ) {
            return Uniqueness::Unprovable;
        }
        match self
            .key_sets
            .iter()
            .find(|set| set.columns.iter().all(|c| key.contains(&c.as_str())))
        {
            Some(set) => Uniqueness::Proven(set.name.clone()),
            None => Uniqueness::NotUnique,
        }
    }

    /// What to say of a resource keyed by `key` on this table when
    /// [`TableInfo::uniqueness`] is [`Uniqueness::NotUnique`]: the unique
    /// sets there are, and the statement that would make the key one.
    pub fn not_unique(&self, key: &[&str]) -> String {
        let sets = if self.key_sets.is_empty() {
            "it has no primary key or unique index".to_string()
        } else {
            let named: Vec<String> = self
                .key_sets
                .iter()
                .map(|s| format!("{} ({})", s.name, s.columns.join(", ")))
                .collect();
            format!(
                "its unique sets are {}, none within the key",
                named.join(", ")
            )
        };
        format!(
            "the key ({}) of {} is not unique: {sets}, so one key could name several rows \
             (another tenant's, say) and any of them would be served; key the resource by a \
             unique set, or make this one unique: {}",
            key.join(", "),
            self.name,
            create_unique_index(&self.name, key)
        )
    }
}

/// `CREATE UNIQUE INDEX CONCURRENTLY ON "public"."orders" ("order_no")`:
/// the statement that makes `key` a unique set of `table`.
pub fn create_unique_index(table: &str, key: &[&str]) -> String {
    let cols: Vec<String> = key.iter().map(|c| quote(c)).collect();
    format!(
        "CREATE UNIQUE INDEX CONCURRENTLY ON {} ({})",
        quote_table(table),
        cols.join(", ")
    )
}

/// `users` → `"users"`, `app.users` → `"app"."users"`: the same quoting as
/// the row and scan queries.
pub fn quote_table(table: &str) -> String {
    table.split('.').map(quote).collect::<Vec<_>>().join(".")
}

pub fn quote(ident: &str) -> String {
    format!("\"{}\"", ident.replace('"', "\"\""))
}

/// Reads `table` (as configured) from the catalog; `None` if there is no
/// such relation in the current search path.
pub async fn table_info(pool: &PgPool, table: &str) -> Result<Option<TableInfo>, sqlx::Error> {
    table_info_on(&mut *pool.acquire().await?, table).await
}

/// [`table_info`] on one connection (a transaction's, say).
pub async fn table_info_on(
    conn: &mut PgConnection,
    table: &str,
) -> Result<Option<TableInfo>, sqlx::Error> {
    let Some(rel) = sqlx::query(
        "SELECT c.oid::int8 AS oid, n.nspname::text AS schema, c.relname::text AS name,
                c.relkind::text AS kind, c.relreplident::text AS ident
           FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
          WHERE c.oid = to_regclass($1)",
    )
    .bind(quote_table(table))
    .fetch_optional(&mut *conn)
    .await?
    else {
        return Ok(None);
    };
    let oid: i64 = rel.get("oid");
    let schema: String = rel.get("schema");
    let name: String = rel.get("name");
    let kind = match rel.get::<String, _>("kind").as_str() {
        "r" => RelKind::Table,
        "p" => RelKind::PartitionedTable,
        "v" => RelKind::View,
        "m" => RelKind::MaterializedView,
        "f" => RelKind::Foreign,
        _ => RelKind::Other,
    };

    // Each column's type followed through domains (a domain over a domain
    // too) to its base; a NOT NULL anywhere on the way counts.
    let columns = sqlx::query(
        "WITH RECURSIVE chain(attnum, typid, depth, nn) AS (
             SELECT a.attnum, a.atttypid, 0, a.attnotnull
               FROM pg_attribute a
              WHERE a.attrelid = $1::oid AND a.attnum > 0 AND NOT a.attisdropped
             UNION ALL
             SELECT c.attnum, t.typbasetype, c.depth + 1, c.nn OR t.typnotnull
               FROM chain c JOIN pg_type t ON t.oid = c.typid
              WHERE t.typtype = 'd'
         ), base AS (
             SELECT DISTINCT ON (attnum) attnum, typid, nn
               FROM chain ORDER BY attnum, depth DESC
         )
         SELECT a.attname::text AS name,
                format_type(a.atttypid, a.atttypmod) AS declared,
                bt.typname::text AS base,
                (SELECT et.typname::text FROM pg_type et WHERE et.oid = bt.typelem
                    AND bt.typcategory = 'A') AS element,
                b.nn AS not_null,
                a.attcollation::int8 AS collation,
                quote_ident(btn.nspname) || '.' || quote_ident(bt.typname) AS base_sql
           FROM base b
           JOIN pg_attribute a ON a.attrelid = $1::oid AND a.attnum = b.attnum
           JOIN pg_type bt ON bt.oid = b.typid
           JOIN pg_namespace btn ON btn.oid = bt.typnamespace
          ORDER BY a.attnum",
    )
    .bind(oid)
    .fetch_all(&mut *conn)
    .await?
    .into_iter()
    .map(|r| ColumnInfo {
        name: r.get("name"),
        declared: r.get("declared"),
        base: r.get("base"),
        element: r.get("element"),
        not_null: r.get("not_null"),
        collation: r.get("collation"),
        base_sql: r.get("base_sql"),
    })
    .collect();

    let replica_identity = match rel.get::<String, _>("ident").as_str() {
        "d" => ReplicaIdentity::Default(index_columns(conn, oid, "indisprimary").await?),
        "i" => ReplicaIdentity::Index(index_columns(conn, oid, "indisreplident").await?),
        "f" => ReplicaIdentity::Full,
        _ => ReplicaIdentity::Nothing,
    };

    // Usable as a replica identity: NOT NULL columns, immediate.
    let unique_indexes = indexes(
        conn,
        oid,
        "SELECT ic.relname::text AS name,
                array_agg(a.attname::text ORDER BY k.ord) AS columns
           FROM pg_index i
           JOIN pg_class ic ON ic.oid = i.indexrelid
           JOIN LATERAL unnest(i.indkey) WITH ORDINALITY k(attnum, ord) ON true
           JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
          WHERE i.indrelid = $1::oid AND i.indisunique AND i.indimmediate AND i.indisvalid
            AND i.indpred IS NULL AND i.indexprs IS NULL
          GROUP BY ic.relname
         HAVING bool_and(a.attnotnull)
          ORDER BY ic.relname",
    )
    .await?;
    let key_sets = indexes(
        conn,
        oid,
        &format!(
            "SELECT ic.relname::text AS name, array_agg(a.attname::text ORDER BY k.ord) AS columns
               FROM pg_index i
               JOIN pg_class ic ON ic.oid = i.indexrelid
               JOIN LATERAL unnest(i.indkey) WITH ORDINALITY k(attnum, ord) ON k.ord <= i.indnkeyatts
               JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
              WHERE i.indrelid = $1::oid AND {UNIQUE_SET}
              GROUP BY ic.relname
              ORDER BY bool_or(i.indisprimary) DESC, ic.relname"
        ),
    )
    .await?;

    Ok(Some(TableInfo {
        name: Arc::from(format!("{schema}.{name}")),
        kind,
        columns,
        replica_identity,
        unique_indexes,
        key_sets,
    }))
}

/// The `pg_index` rows (as `i`) that make their key columns a unique set:
/// unique, valid (a `CREATE UNIQUE INDEX CONCURRENTLY` that failed, or is
/// still building, leaves an index that does not hold the rows unique),
/// not partial, on plain columns. Shared with the feeds' check
/// (`feed::tracker`), so that start-up and run time judge alike.
pub const UNIQUE_SET: &str =
    "i.indisunique AND i.indisvalid AND i.indpred IS NULL AND i.indexprs IS NULL";

/// The indexes `sql` lists for the relation `$1` (`name`, `columns`).
async fn indexes(
    conn: &mut PgConnection,
    oid: i64,
    sql: &str,
) -> Result<Vec<UniqueIndex>, sqlx::Error> {
    Ok(sqlx::query(sql)
        .bind(oid)
        .fetch_all(conn)
        .await?
        .into_iter()
        .map(|r| UniqueIndex {
            name: r.get("name"),
            columns: r.get("columns"),
        })
        .collect())
}

/// The columns, in order, of the index of `oid` that has `flag` set
/// (`indisprimary`, `indisreplident`).
async fn index_columns(
    conn: &mut PgConnection,
    oid: i64,
    flag: &'static str,
) -> Result<Vec<String>, sqlx::Error> {
    let sql = format!(
        "SELECT a.attname::text FROM pg_index i
           JOIN LATERAL unnest(i.indkey) WITH ORDINALITY k(attnum, ord) ON true
           JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
          WHERE i.indrelid = $1::oid AND i.{flag}
          ORDER BY k.ord"
    );
    sqlx::query_scalar(&sql).bind(oid).fetch_all(conn).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_are_quoted_like_the_queries() {
        assert_eq!(quote_table("users"), r#""users""#);
        assert_eq!(quote_table("app.users"), r#""app"."users""#);
    }

    fn table(kind: RelKind, sets: &[(&str, &[&str])]) -> TableInfo {
        TableInfo {
            name: Arc::from("public.orders"),
            kind,
            columns: Vec::new(),
            replica_identity: ReplicaIdentity::Nothing,
            unique_indexes: Vec::new(),
            key_sets: sets
                .iter()
                .map(|(name, cols)| UniqueIndex {
                    name: name.to_string(),
                    columns: cols.iter().map(|c| c.to_string()).collect(),
                })
                .collect(),
        }
    }

    #[test]
    fn a_key_is_unique_when_a_unique_set_lies_within_it() {
        let pk_id = table(RelKind::Table, &[("orders_pkey", &["id"])]);
        // A key with more columns than the unique set: still one row.
        assert_eq!(
            pk_id.uniqueness(&["tenant_id", "id"]),
            Uniqueness::Proven("orders_pkey".into())
        );
        assert_eq!(
            pk_id.uniqueness(&["id"]),
            Uniqueness::Proven("orders_pkey".into())
        );
        // The leak: part of the primary key alone names a row per tenant.
        let tenant_pk = table(
            RelKind::PartitionedTable,
            &[("orders_pkey", &["tenant_id", "order_no"])],
        );
        assert_eq!(tenant_pk.uniqueness(&["order_no"]), Uniqueness::NotUnique);
        assert_eq!(
            tenant_pk.uniqueness(&["order_no", "tenant_id"]),
            Uniqueness::Proven("orders_pkey".into())
        );
        let why = tenant_pk.not_unique(&["order_no"]);
        assert!(why.contains("orders_pkey (tenant_id, order_no)"), "{why}");
        assert!(
            why.ends_with(r#"CREATE UNIQUE INDEX CONCURRENTLY ON "public"."orders" ("order_no")"#),
            "{why}"
        );
        let none = table(RelKind::Table, &[]);
        assert_eq!(none.uniqueness(&["id"]), Uniqueness::NotUnique);
        assert!(
            none.not_unique(&["id"])
                .contains("no primary key or unique index")
        );
        // A second unique set is found whatever the order.
        let email = table(
            RelKind::MaterializedView,
            &[("pk", &["id"]), ("email_key", &["email"])],
        );
        assert_eq!(
            email.uniqueness(&["email"]),
            Uniqueness::Proven("email_key".into())
        );
        // A view cannot be shown unique by its catalog: the row query's
        // guard stands alone there.
        assert_eq!(
            table(RelKind::View, &[]).uniqueness(&["id"]),
            Uniqueness::Unprovable
        );
        assert_eq!(
            table(RelKind::Foreign, &[]).uniqueness(&["id"]),
            Uniqueness::Unprovable
        );
    }

    #[test]
    fn replica_identity_carries() {
        let pk = ReplicaIdentity::Default(vec!["id".into()]);
        assert!(pk.carries("id"));
        assert!(!pk.carries("email"));
        assert!(ReplicaIdentity::Full.carries("email"));
        assert!(!ReplicaIdentity::Nothing.carries("id"));
        assert!(!ReplicaIdentity::Default(vec![]).carries("id"));
    }
}

/// Why a column's comparison was not read.
#[derive(Debug, thiserror::Error)]
pub enum ComparisonError {
    /// The database did not answer.
    #[error(transparent)]
    Db(#[from] sqlx::Error),
    /// It compares in a way the gateway cannot reproduce: the message
    /// names the column and says why.
    #[error("{0}")]
    Refused(String),
}

/// How `column` (of `table`, for messages) compares its values, read from
/// the database (see `key::compare`, which holds the argument).
pub async fn comparison(
    pool: &PgPool,
    table: &str,
    column: &ColumnInfo,
) -> Result<Comparison, ComparisonError> {
    let mut conn = pool.acquire().await?;
    comparison_on(&mut conn, table, column).await
}

/// [`comparison`] on a connection.
pub async fn comparison_on(
    conn: &mut PgConnection,
    table: &str,
    column: &ColumnInfo,
) -> Result<Comparison, ComparisonError> {
    use ComparisonError::Refused;
    let ty = column.column_type();
    if column.collation == 0
        || !matches!(
            ty,
            ColumnType::Text | ColumnType::Varchar | ColumnType::Bpchar | ColumnType::Citext
        )
    {
        return Ok(Comparison::Bytes);
    }
    let name = format!("{table}.{}", column.name);
    // `to_jsonb` of the catalog rows: the provider columns differ between
    // Postgres versions (datlocprovider from 15, colllocale from 17).
    let row = sqlx::query(
        "SELECT quote_ident(n.nspname) || '.' || quote_ident(c.collname) AS sql_name,
                c.collname::text AS name,
                c.collisdeterministic AS deterministic,
                CASE c.collprovider WHEN 'd' THEN coalesce(to_jsonb(d) ->> 'datlocprovider', 'c')
                     ELSE c.collprovider::text END AS provider,
                CASE c.collprovider WHEN 'd' THEN coalesce(to_jsonb(d) ->> 'datlocale', d.datctype)
                     ELSE coalesce(to_jsonb(c) ->> 'colllocale', c.collctype) END AS ctype,
                current_setting('server_encoding') AS encoding
           FROM pg_collation c
           JOIN pg_namespace n ON n.oid = c.collnamespace
           JOIN pg_database d ON d.datname = current_database()
          WHERE c.oid = $1::oid",
    )
    .bind(column.collation)
    .fetch_optional(&mut *conn)
    .await?
    .ok_or_else(|| {
        Refused(format!(
            "{name}: its collation (oid {}) is not in pg_collation",
            column.collation
        ))
    })?;
    let coll_name: String = row.get("name");
    let sql_name: String = row.get("sql_name");
    if !row.get::<bool, _>("deterministic") {
        return Err(Refused(format!(
            "key or owner column {name} has the non-deterministic collation {coll_name:?}: \
             Postgres compares its values by that collation (case, accents, ignorable \
             characters), which the filter and cache cannot reproduce; give the column a \
             deterministic collation"
        )));
    }
    match ty {
        ColumnType::Bpchar => return Ok(Comparison::Blank),
        ColumnType::Citext => {}
        _ => return Ok(Comparison::Bytes),
    }
    let provider: String = row.get("provider");
    let ctype: Option<String> = row.get("ctype");
    let ctype = ctype.unwrap_or_default();
    let encoding: String = row.get("encoding");
    let described = format!("collation {coll_name:?} (provider {provider}, ctype {ctype:?})");
    let refuse = |why: &str| {
        Refused(format!(
            "citext key or owner column {name} under {described}: {why}; the gateway cannot \
             reproduce its lower(), so it would answer 404 for rows that exist. Use a libc \
             collation (or the builtin C.UTF-8), or a text column holding lower(value)"
        ))
    };
    if encoding != "UTF8" {
        return Err(refuse(&format!(
            "the database's encoding is {encoding}, not UTF8"
        )));
    }
    let per_code_point = match provider.as_str() {
        "c" => true,
        "b" => matches!(ctype.as_str(), "C" | "C.UTF-8"),
        _ => false,
    };
    if !per_code_point {
        return Err(refuse(
            "its lower() maps some characters by their context (the final sigma) or by language rules",
        ));
    }
    let pairs: Vec<(i32, String)> = sqlx::query_as(&format!(
        "SELECT cp, lower(chr(cp) COLLATE {sql_name})
           FROM generate_series(1, 1114111) AS cp
          WHERE cp NOT BETWEEN 55296 AND 57343
            AND lower(chr(cp) COLLATE {sql_name}) COLLATE \"C\" <> chr(cp) COLLATE \"C\""
    ))
    .fetch_all(&mut *conn)
    .await?;
    let lowering = Lowering::new(
        pairs
            .into_iter()
            .filter_map(|(cp, image)| Some((char::from_u32(cp as u32)?, image))),
        &coll_name,
    )
    .map_err(|why| refuse(&why))?;
    // Where a context-sensitive lower() would differ from the table.
    let probes: Vec<String> = CONTEXT_PROBES.iter().map(|p| p.to_string()).collect();
    let lowered: Vec<(String, String)> = sqlx::query_as(&format!(
        "SELECT p, lower(p COLLATE {sql_name}) FROM unnest($1::text[]) AS p"
    ))
    .bind(&probes)
    .fetch_all(&mut *conn)
    .await?;
    for (probe, db_lower) in lowered {
        if *lowering.lower(&probe) != *db_lower {
            return Err(refuse(&format!(
                "lower({probe:?}) is {db_lower:?}, not what its characters give one by one"
            )));
        }
    }
    Ok(Comparison::Lower(Arc::new(lowering)))
}

/// Strings whose `lower()` depends on context under some provider: the
/// final sigma, the Turkish and Lithuanian dotted and dotless i.
const CONTEXT_PROBES: [&str; 7] = [
    "ΑΣ",
    "ΑΣ Α",
    "AΣB",
    "ΣΑΣ.",
    "I\u{0307}",
    "\u{0130}",
    "I\u{0300}",
];
