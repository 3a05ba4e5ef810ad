//! `preflight`'s checks of each resource's relation: the table or view,
//! its schema's `USAGE`, its columns and key type, `SELECT` on every column
//! read; and what the feeds will then watch.

use std::sync::Arc;

use sqlx::PgConnection;

use crate::config::Config;
use crate::db::catalog::{self, Uniqueness, Watch, WatchedColumn, quote, quote_table};

use super::{Report, Role, privilege, schema_of};

/// Every resource's relation, columns, key type and `SELECT`; returns what
/// the feeds would watch (each resource's source table and key column).
pub(super) async fn resources(
    conn: &mut PgConnection,
    config: &Config,
    role: &Role,
    r: &mut Report,
) -> Result<Watch, sqlx::Error> {
    let mut watch = Watch::default();
    for res in config.resolved() {
        // A schema the role may not use makes every lookup of a name in it
        // an error ("permission denied for schema"), not an absence: say
        // what to grant, and check the rest of this resource once it is.
        let mut unusable: Vec<String> = Vec::new();
        for table in [&res.table, &res.source_table] {
            if let Some(schema) = unusable_schema(conn, table).await?
                && !unusable.contains(&schema)
            {
                r.missing(format!(
                    "resource {}: USAGE on schema {schema} (its tables, columns and feed are checked once it is granted)",
                    res.name
                ));
                r.statement(format!(
                    "GRANT USAGE ON SCHEMA {} TO {}",
                    quote(&schema),
                    role.quoted
                ));
                unusable.push(schema);
            }
        }
        if !unusable.is_empty() {
            continue;
        }
        let Some(info) = catalog::table_info_on(&mut *conn, &res.table).await? else {
            r.missing(format!(
                "resource {}: no table or view {:?} (names are case-sensitive; schema.table, or in the search path), or no USAGE on its schema",
                res.name, res.table
            ));
            continue;
        };
        let schema = schema_of(&info.name);
        if !privilege(conn, "has_schema_privilege($1, 'USAGE')", &[schema]).await? {
            r.missing(format!("resource {}: USAGE on schema {schema}", res.name));
            r.statement(format!(
                "GRANT USAGE ON SCHEMA {} TO {}",
                quote(schema),
                role.quoted
            ));
        }
        // Each column once, the key first (it is usually among `columns`).
        let key = res.key_columns();
        let key_text = key.join(", ");
        let mut read: Vec<&str> = Vec::new();
        let named = key
            .iter()
            .copied()
            .chain(res.columns.iter().map(String::as_str))
            .chain(res.access.owner_column.as_deref());
        for c in named {
            if !read.contains(&c) {
                read.push(c);
            }
        }
        let absent: Vec<&str> = read
            .iter()
            .copied()
            .filter(|c| info.column(c).is_none())
            .collect();
        if !absent.is_empty() {
            r.missing(format!(
                "resource {}: {} has no column {}",
                res.name,
                info.name,
                absent.join(", ")
            ));
        }
        for part in &res.key {
            if let Some(column) = info.column(&part.column)
                && !part.ty.accepts(column.column_type())
            {
                r.missing(format!(
                    "resource {}: key column {}.{} is {}, which key_type {:?} does not accept ({})",
                    res.name,
                    info.name,
                    part.column,
                    column.declared,
                    part.ty.sql_type(),
                    part.ty.accepted()
                ));
            }
        }
        // One key, one row (start-up refuses the same).
        if key.iter().all(|c| info.column(c).is_some()) {
            match info.uniqueness(&key) {
                Uniqueness::Proven(_) => {}
                Uniqueness::NotUnique => {
                    r.missing(format!("resource {}: {}", res.name, info.not_unique(&key)));
                    r.statement(catalog::create_unique_index(&info.name, &key));
                }
                Uniqueness::Unprovable => r.note(format!(
                    "resource {}: {} is not a table, so its catalog cannot show the key ({}) \
                     unique; a lookup that finds two rows is answered 500 key_not_unique, never \
                     with either",
                    res.name, info.name, key_text
                )),
            }
        }
        // A key or owner column the gateway could not compare as
        // Postgres does (`key::compare`): start-up would refuse it.
        let compared = key
            .iter()
            .copied()
            .chain(res.access.owner_column.as_deref())
            .filter_map(|c| info.column(c));
        for column in compared {
            match catalog::comparison_on(&mut *conn, &info.name, column).await {
                Ok(_) => {}
                Err(catalog::ComparisonError::Refused(why)) => {
                    r.missing(format!("resource {}: {why}", res.name));
                }
                Err(catalog::ComparisonError::Db(e)) => return Err(e),
            }
        }
        let table = quote_table(&info.name);
        let mut denied = Vec::new();
        for c in read.iter().filter(|c| info.column(c).is_some()) {
            if !privilege(conn, "has_column_privilege($1, $2, 'SELECT')", &[&table, c]).await? {
                denied.push(*c);
            }
        }
        if denied.is_empty() {
            // The columns' own types (`citext`, a domain), which `key_type`
            // accepted above.
            let declared: Vec<String> = res
                .key
                .iter()
                .map(|p| {
                    let ty = info
                        .column(&p.column)
                        .map_or(p.ty.sql_type(), |c| c.declared.as_str());
                    format!("{} {ty}", p.column)
                })
                .collect();
            r.ok(format!(
                "resource {}: {} ({}), SELECT on {}",
                res.name,
                info.name,
                declared.join(", "),
                read.join(", ")
            ));
        } else {
            r.missing(format!(
                "resource {}: SELECT on {} ({})",
                res.name,
                info.name,
                denied.join(", ")
            ));
            r.statement(format!("GRANT SELECT ON {table} TO {}", role.quoted));
        }
        let source = if res.source_table == res.table {
            Some(info)
        } else {
            catalog::table_info_on(&mut *conn, &res.source_table).await?
        };
        let Some(source) = source else {
            r.missing(format!(
                "resource {}: no source_table {:?}",
                res.name, res.source_table
            ));
            continue;
        };
        let lacking: Vec<&str> = key
            .iter()
            .copied()
            .filter(|c| source.column(c).is_none())
            .collect();
        if !lacking.is_empty() {
            r.missing(format!(
                "resource {}: source_table {} has no column {}",
                res.name,
                source.name,
                lacking.join(", ")
            ));
            continue;
        }
        let watched = res
            .key
            .iter()
            .filter_map(|p| {
                Some(WatchedColumn {
                    name: Arc::from(p.column.as_str()),
                    ty: source.column(&p.column)?.column_type(),
                })
            })
            .collect();
        watch.follow(
            &source.name,
            watched,
            res.source_table == res.table,
            &res.columns,
        );
    }
    Ok(watch)
}

/// The schema `table` names, if the role may not use it (`None` for a
/// name without a schema: the search path skips such schemas silently).
async fn unusable_schema(
    conn: &mut PgConnection,
    table: &str,
) -> Result<Option<String>, sqlx::Error> {
    let Some((schema, _)) = table.split_once('.') else {
        return Ok(None);
    };
    let usable: Option<bool> = sqlx::query_scalar(
        "SELECT has_schema_privilege(oid, 'USAGE') FROM pg_namespace WHERE nspname = $1",
    )
    .bind(schema)
    .fetch_optional(&mut *conn)
    .await?;
    Ok((usable == Some(false)).then(|| schema.to_string()))
}
