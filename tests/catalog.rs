//! `db::catalog`: what the gateway reads about a table, against a real
//! Postgres: canonical names, domains resolved to base types, nullability,
//! arrays, replica identity and the unique indexes that could serve as one.

mod common;

use bloomgate::db::catalog::{ColumnType, RelKind, ReplicaIdentity, table_info};
use common::*;

#[tokio::test]
async fn the_catalog_resolves_names_types_and_identity() {
    let db = TestDb::new().await;
    db.exec(
        "CREATE EXTENSION IF NOT EXISTS citext;
         CREATE SCHEMA app;
         CREATE DOMAIN code5 AS char(5) NOT NULL;
         CREATE DOMAIN code5b AS code5;
         CREATE TABLE app.things (
             id int4 PRIMARY KEY,
             code code5b UNIQUE,
             tag citext,
             nums int8[],
             note text
         );
         CREATE VIEW app.things_v AS SELECT id, note FROM app.things;",
    )
    .await;
    let t = table_info(&db.pool, "app.things").await.unwrap().unwrap();
    assert_eq!(&*t.name, "app.things");
    assert_eq!(t.kind, RelKind::Table);
    let names: Vec<&str> = t.columns.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, ["id", "code", "tag", "nums", "note"]);
    let code = t.column("code").unwrap();
    assert_eq!(code.declared, "code5b");
    assert_eq!(code.base, "bpchar");
    assert_eq!(code.column_type(), ColumnType::Bpchar);
    assert!(code.not_null, "NOT NULL of the inner domain counts");
    assert_eq!(t.column("tag").unwrap().column_type(), ColumnType::Citext);
    assert_eq!(t.column("id").unwrap().column_type(), ColumnType::Int4);
    assert!(t.column("id").unwrap().not_null);
    assert!(!t.column("note").unwrap().not_null);
    let nums = t.column("nums").unwrap();
    assert_eq!(
        (nums.base.as_str(), nums.element.as_deref()),
        ("_int8", Some("int8"))
    );
    assert_eq!(
        t.replica_identity,
        ReplicaIdentity::Default(vec!["id".into()])
    );
    // A domain's NOT NULL does not make a column usable in a replica
    // identity index; the column's own does.
    let unique: Vec<&str> = t.unique_indexes.iter().map(|i| i.name.as_str()).collect();
    assert_eq!(unique, ["things_pkey"]);
    db.exec("ALTER TABLE app.things ALTER code SET NOT NULL")
        .await;
    let t = table_info(&db.pool, "app.things").await.unwrap().unwrap();
    let unique: Vec<&str> = t.unique_indexes.iter().map(|i| i.name.as_str()).collect();
    assert_eq!(unique, ["things_code_key", "things_pkey"]);

    db.exec("ALTER TABLE app.things REPLICA IDENTITY USING INDEX things_code_key")
        .await;
    let t = table_info(&db.pool, "app.things").await.unwrap().unwrap();
    assert_eq!(
        t.replica_identity,
        ReplicaIdentity::Index(vec!["code".into()])
    );
    db.exec("ALTER TABLE app.things REPLICA IDENTITY FULL")
        .await;
    let t = table_info(&db.pool, "app.things").await.unwrap().unwrap();
    assert!(t.replica_identity.carries("note"));

    // The search path decides an unqualified name, as in the queries.
    let users = table_info(&db.pool, "users").await.unwrap().unwrap();
    assert_eq!(&*users.name, "public.users");
    let v = table_info(&db.pool, "app.things_v").await.unwrap().unwrap();
    assert_eq!(v.kind, RelKind::View);
    // Quoted like the queries: a differently cased name is another relation.
    assert!(table_info(&db.pool, "Users").await.unwrap().is_none());
    assert!(table_info(&db.pool, "nope").await.unwrap().is_none());
}
