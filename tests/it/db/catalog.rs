//! `db::catalog`: what the gateway reads about a table, against a real
//! Postgres: canonical names, domains resolved to base types, nullability,
//! arrays, replica identity and the unique indexes that could serve as one.

use crate::common;

use axum::http::StatusCode;
use bloomgate::db::catalog::{ColumnType, RelKind, ReplicaIdentity, Uniqueness, table_info};
use bloomgate::resource::RequestOutcome;
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

/// The unique sets a key may rest on: the primary key and every valid,
/// non-partial unique index on plain columns, nullable or not, by its key
/// columns only (not those it `INCLUDE`s).
#[tokio::test]
async fn the_catalog_lists_every_unique_set_a_key_may_rest_on() {
    let db = TestDb::new().await;
    db.exec(
        "CREATE TABLE t (id int8 PRIMARY KEY, email text UNIQUE, a int, b int, c int, d text);
         CREATE UNIQUE INDEX t_ab ON t (a, b) INCLUDE (c);
         CREATE UNIQUE INDEX t_partial ON t (c) WHERE c > 0;
         CREATE UNIQUE INDEX t_lower ON t (lower(d));
         INSERT INTO t (id, d) VALUES (1, 'x'), (2, 'y');
         UPDATE t SET c = 0;",
    )
    .await;
    // A concurrent build that fails on duplicates leaves an invalid index:
    // it does not hold the rows unique.
    let failed = sqlx::query("CREATE UNIQUE INDEX CONCURRENTLY t_c ON t (c)")
        .execute(&db.pool)
        .await;
    assert!(failed.is_err(), "two rows share c = 0");
    let t = table_info(&db.pool, "t").await.unwrap().unwrap();
    let sets: Vec<(&str, Vec<&str>)> = t
        .key_sets
        .iter()
        .map(|s| {
            (
                s.name.as_str(),
                s.columns.iter().map(String::as_str).collect(),
            )
        })
        .collect();
    assert_eq!(
        sets,
        [
            ("t_pkey", vec!["id"]),
            ("t_ab", vec!["a", "b"]),
            ("t_email_key", vec!["email"]),
        ]
    );
    assert_eq!(
        t.uniqueness(&["email"]),
        Uniqueness::Proven("t_email_key".into())
    );
    assert_eq!(
        t.uniqueness(&["c"]),
        Uniqueness::NotUnique,
        "partial or invalid"
    );
    assert_eq!(t.uniqueness(&["d"]), Uniqueness::NotUnique, "an expression");
    assert_eq!(
        t.uniqueness(&["a"]),
        Uniqueness::NotUnique,
        "half of (a, b)"
    );
}

/// The leak: `orders` keyed by `(tenant_id, order_no)` served by
/// `order_no` alone answered `/orders/5` with tenant 1's row to anyone.
/// Start-up and preflight refuse it now, naming the fix; a key held
/// unique by a nullable column's index is accepted.
#[tokio::test]
async fn a_key_that_is_not_unique_is_refused_at_start_and_preflight_names_the_fix() {
    let db = TestDb::new().await;
    db.exec(
        "CREATE TABLE orders (tenant_id bigint, order_no bigint, item text NOT NULL,
                              PRIMARY KEY (tenant_id, order_no));
         INSERT INTO orders VALUES (1, 5, 'tenant 1''s order'), (2, 6, 'tenant 2''s order');
         CREATE TABLE accounts (id bigint PRIMARY KEY, email text UNIQUE, name text);
         INSERT INTO accounts VALUES (1, 'a@x.org', 'A'), (2, NULL, 'B'), (3, NULL, 'C');",
    )
    .await;
    let orders = r#"
        [[resource]]
        name = "orders"
        route = "/orders/{order_no}"
        table = "orders"
        key_column = "order_no"
        key_type = "bigint"
        columns = ["tenant_id", "order_no", "item"]
    "#;
    let accounts = r#"
        [[resource]]
        name = "accounts_by_email"
        route = "/accounts-by-email/{email}"
        table = "accounts"
        key_column = "email"
        key_type = "text"
        columns = ["id", "email", "name"]
    "#;
    let fix = r#"CREATE UNIQUE INDEX CONCURRENTLY ON "public"."orders" ("order_no")"#;
    let cfg = config(&db.url, orders);
    let report = bloomgate::preflight::run(&cfg).await;
    let text = report.to_string();
    assert!(!report.passed(), "{text}");
    assert!(
        text.contains("MISSING resource orders: the key (order_no) of public.orders is not unique")
            && text.contains("orders_pkey (tenant_id, order_no)"),
        "{text}"
    );
    assert!(report.statements().iter().any(|s| s == fix), "{text}");
    let gw = gateway(cfg.clone());
    let err = gw.start().await.unwrap_err().to_string();
    gw.stop();
    assert!(
        err.starts_with("resource \"orders\": the key (order_no) of public.orders is not unique")
            && err.ends_with(fix),
        "{err}"
    );
    // Preflight's statement, applied where the rows allow it, converges.
    db.exec(fix).await;
    let report = bloomgate::preflight::run(&cfg).await;
    assert!(report.passed(), "{report}");
    let gw = started(cfg).await;
    let r = get(&gw, "/orders/5").await;
    assert_eq!(r.status, StatusCode::OK);
    gw.stop();
    // A nullable UNIQUE column: `=` never matches NULL, so a key is one row.
    let gw = started(config(&db.url, accounts)).await;
    let r = get(&gw, "/accounts-by-email/a@x.org").await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.json()["id"], 1);
    gw.stop();
}

/// A key's unique index dropped while the gateway runs: its resource
/// stops answering from filter and cache, says why, and a key that comes
/// to name two rows is answered 500 `key_not_unique`, never with either.
/// The index back, it is ready again.
#[tokio::test]
async fn a_unique_index_dropped_at_run_time_takes_the_resource_off_its_filter_and_cache() {
    let db = TestDb::new().await;
    db.exec(
        "CREATE TABLE codes (code text NOT NULL, label text NOT NULL);
         CREATE UNIQUE INDEX codes_code ON codes (code);
         INSERT INTO codes VALUES ('a', 'first'), ('b', 'second');",
    )
    .await;
    let codes = r#"
        [[resource]]
        name = "codes"
        route = "/codes/{code}"
        table = "codes"
        key_column = "code"
        key_type = "text"
        columns = ["code", "label"]
    "#;
    let gw = started(config(&db.url, codes)).await;
    vouched(&gw, "codes").await;
    get(&gw, "/codes/a").await;
    assert_eq!(
        get(&gw, "/codes/a").await.header("cache-status"),
        "bloomgate; hit"
    );
    db.exec("DROP INDEX codes_code").await;
    eventually("codes reported not ready", || async {
        !gw.resource("codes").unwrap().is_ready()
    })
    .await;
    let why = gw.readiness().to_string();
    assert!(
        why.contains("key column code of public.codes is no longer unique")
            && why.contains(r#"CREATE UNIQUE INDEX CONCURRENTLY ON "public"."codes" ("code")"#),
        "{why}"
    );
    let r = get(&gw, "/codes/a").await;
    assert_eq!(r.status, StatusCode::OK);
    assert!(
        r.header("cache-status").contains("detail=unverified"),
        "not from the cache: {}",
        r.header("cache-status")
    );
    db.exec("INSERT INTO codes VALUES ('a', 'another tenant''s')")
        .await;
    let (logs, _guard) = capture_logs();
    for _ in 0..3 {
        let r = get(&gw, "/codes/a").await;
        assert_eq!(r.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(r.json()["error"], "key_not_unique");
        assert!(!String::from_utf8_lossy(&r.body).contains("label"));
    }
    let codes_res = gw.resource("codes").unwrap();
    assert_eq!(codes_res.stats.count(RequestOutcome::KeyNotUnique), 3);
    let said = logs.text();
    assert_eq!(
        said.matches("a key matched more than one row").count(),
        1,
        "once per interval: {said}"
    );
    assert!(said.contains("codes"), "{said}");
    // The other key is still one row.
    assert_eq!(get(&gw, "/codes/b").await.status, StatusCode::OK);
    db.exec("DELETE FROM codes WHERE label = 'another tenant''s'; CREATE UNIQUE INDEX codes_code ON codes (code)")
        .await;
    vouched(&gw, "codes").await;
    assert_eq!(get(&gw, "/codes/a").await.json()["label"], "first");
    gw.stop();
}

/// A view cannot be proven to hold a key once (it may join and repeat
/// rows): start-up accepts it, and the row query's second row refuses the
/// key.
#[tokio::test]
async fn a_view_that_repeats_a_key_is_answered_500_key_not_unique() {
    let db = TestDb::new().await;
    db.seed_users(3).await;
    db.exec(
        "CREATE VIEW user_rows AS
             SELECT id, name FROM users UNION ALL SELECT id, 'copy' FROM users WHERE id = 3",
    )
    .await;
    let view = r#"
        [[resource]]
        name = "user_rows"
        route = "/user-rows/{id}"
        table = "user_rows"
        source_table = "users"
        key_column = "id"
        key_type = "bigint"
        columns = ["id", "name"]
    "#;
    let cfg = config(&db.url, view);
    let report = bloomgate::preflight::run(&cfg).await.to_string();
    assert!(
        report.contains("note    resource user_rows: public.user_rows is not a table"),
        "{report}"
    );
    let gw = started(cfg).await;
    assert_eq!(get(&gw, "/user-rows/2").await.json()["name"], "User 2");
    let r = get(&gw, "/user-rows/3").await;
    assert_eq!(r.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        r.header("cache-status"),
        "bloomgate; fwd=miss; detail=key-not-unique"
    );
    assert_eq!(r.json()["error"], "key_not_unique");
    let res = gw.resource("user_rows").unwrap();
    assert_eq!(res.stats.count(RequestOutcome::KeyNotUnique), 1);
    // The snapshot `/metrics` renders `bloomgate_requests_total` from.
    let requests = serde_json::to_value(res.stats.snapshot()).unwrap()["requests"].clone();
    assert_eq!(requests["key_not_unique"], 1, "{requests}");
    gw.stop();
}

/// A composite key is held unique as a set: preflight and start-up accept
/// a unique index within it, and the same index dropped at run time takes
/// the resource off its filter and cache, naming the set and the fix,
/// until it is back.
#[tokio::test]
async fn a_composite_key_is_held_unique_as_a_set() {
    let db = TestDb::new().await;
    db.exec(
        "CREATE TABLE lines (tenant_id bigint NOT NULL, order_no text NOT NULL, item text NOT NULL);
         CREATE UNIQUE INDEX lines_key ON lines (tenant_id, order_no);
         INSERT INTO lines VALUES (1, 'a', 'first'), (2, 'a', 'second');",
    )
    .await;
    let lines = r#"
        [[resource]]
        name = "lines"
        route = "/t/{tenant_id}/lines/{order_no}"
        table = "lines"
        key_column = ["tenant_id", "order_no"]
        key_type = ["bigint", "text"]
        columns = ["tenant_id", "order_no", "item"]
    "#;
    let cfg = config(&db.url, lines);
    let report = bloomgate::preflight::run(&cfg).await;
    let text = report.to_string();
    assert!(report.passed(), "{text}");
    assert!(
        text.contains("resource lines: public.lines (tenant_id bigint, order_no text)"),
        "{text}"
    );
    let gw = started(cfg).await;
    vouched(&gw, "lines").await;
    assert_eq!(get(&gw, "/t/2/lines/a").await.json()["item"], "second");
    db.exec("DROP INDEX lines_key").await;
    eventually("lines reported not ready", || async {
        !gw.resource("lines").unwrap().is_ready()
    })
    .await;
    let why = gw.readiness().to_string();
    assert!(
        why.contains("key column (tenant_id, order_no) of public.lines is no longer unique")
            && why.contains(
                r#"CREATE UNIQUE INDEX CONCURRENTLY ON "public"."lines" ("tenant_id", "order_no")"#
            ),
        "{why}"
    );
    db.exec("CREATE UNIQUE INDEX lines_key ON lines (tenant_id, order_no)")
        .await;
    eventually("lines ready again", || async {
        gw.resource("lines").unwrap().is_ready()
    })
    .await;
    gw.stop();
}
