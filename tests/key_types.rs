//! Every key column type each `key_type` accepts (issue 10, item 3): the key
//! the scan reads, the key the trigger announces and the key a request
//! parses are the same text, so insert, update (of the row and of its key)
//! and delete are all served fresh, before and after a rebuild.

mod common;

use std::time::Duration;

use axum::http::StatusCode;

use common::*;

fn resource(key_type: &str) -> String {
    format!(
        r#"
        [server]
        max_key_length = 64
        [[resource]]
        name = "k"
        route = "/k/{{key}}"
        table = "k"
        key_column = "key"
        key_type = "{key_type}"
        columns = ["key", "label"]
        "#
    )
}

/// `keys`: an existing key, one inserted live, the one the first is renamed
/// to; as SQL literals and as request path segments.
async fn exercise(setup: &str, column_type: &str, key_type: &str, keys: [(&str, &str); 3]) {
    let [(k1, p1), (k2, p2), (k3, p3)] = keys;
    let db = TestDb::new().await;
    db.exec(setup).await;
    db.exec(&format!(
        "CREATE TABLE k (key {column_type} PRIMARY KEY, label text NOT NULL);
         INSERT INTO k VALUES ({k1}, 'one');"
    ))
    .await;
    let gw = started(config(&db.url, &resource(key_type))).await;
    let path = |p: &str| format!("/k/{p}");
    let ok = |label: &'static str| {
        move |r: &Resp| r.status == StatusCode::OK && r.json()["label"] == label
    };
    let gone = |r: &Resp| r.status == StatusCode::NOT_FOUND;

    // The scan's key is the request's.
    let r = get(&gw, &path(p1)).await;
    assert_eq!(
        (r.status, r.header("cache-status")),
        (StatusCode::OK, "bloomgate; fwd=miss; stored"),
        "{column_type}: the scanned key is not what a request parses"
    );
    // The trigger's key is the request's.
    db.exec(&format!("INSERT INTO k VALUES ({k2}, 'two')"))
        .await;
    fresh(&gw, &path(p2), ok("two")).await;
    db.exec(&format!("UPDATE k SET label = 'changed' WHERE key = {k1}"))
        .await;
    fresh(&gw, &path(p1), ok("changed")).await;
    db.exec(&format!("UPDATE k SET key = {k3} WHERE key = {k1}"))
        .await;
    fresh(&gw, &path(p3), ok("changed")).await;
    fresh(&gw, &path(p1), gone).await;
    db.exec(&format!("DELETE FROM k WHERE key = {k2}")).await;
    fresh(&gw, &path(p2), gone).await;
    // And after a rebuild (a scan again), the same keys.
    gw.resource("k").unwrap().rebuild(true).await.unwrap();
    assert_eq!(get(&gw, &path(p3)).await.status, StatusCode::OK);
    for p in [p1, p2] {
        assert_eq!(
            get(&gw, &path(p)).await.header("cache-status"),
            "bloomgate; detail=filter-absent",
            "{column_type}: {p}"
        );
    }
}

#[tokio::test]
async fn smallint() {
    exercise(
        "",
        "int2",
        "bigint",
        [("1", "1"), ("-2", "-2"), ("32767", "32767")],
    )
    .await;
}

#[tokio::test]
async fn integer() {
    exercise(
        "",
        "int4",
        "bigint",
        [("1", "1"), ("2", "2"), ("-2147483648", "-2147483648")],
    )
    .await;
}

#[tokio::test]
async fn bigint() {
    exercise(
        "",
        "int8",
        "bigint",
        [("1", "1"), ("9000000000", "9000000000"), ("-5", "-5")],
    )
    .await;
}

#[tokio::test]
async fn uuid() {
    exercise(
        "",
        "uuid",
        "uuid",
        [
            (
                "'0b7e4a3c-1f2d-4c5b-9a8e-7d6c5b4a3f2e'",
                "0B7E4A3C-1F2D-4C5B-9A8E-7D6C5B4A3F2E",
            ),
            (
                "'00000000-0000-0000-0000-000000000002'",
                "00000000000000000000000000000002",
            ),
            (
                "'ffffffff-ffff-ffff-ffff-ffffffffffff'",
                "ffffffff-ffff-ffff-ffff-ffffffffffff",
            ),
        ],
    )
    .await;
}

#[tokio::test]
async fn text() {
    // Text keeps trailing blanks on every side.
    exercise(
        "",
        "text",
        "text",
        [
            ("'alpha'", "alpha"),
            ("'b c '", "b%20c%20"),
            ("'Γάμμα'", "%CE%93%CE%AC%CE%BC%CE%BC%CE%B1"),
        ],
    )
    .await;
}

#[tokio::test]
async fn varchar() {
    exercise(
        "",
        "varchar(10)",
        "text",
        [("'alpha'", "alpha"), ("'b c '", "b%20c%20"), ("'x'", "x")],
    )
    .await;
}

/// `char(n)`: the value is stored blank-padded; its key is the text without
/// the padding (`::text`), in the scan, the trigger and the request.
#[tokio::test]
async fn char_n() {
    exercise(
        "",
        "char(5)",
        "text",
        [("'ab'", "ab"), ("'cd'", "cd"), ("'e f'", "e%20f")],
    )
    .await;
}

#[tokio::test]
async fn citext() {
    exercise(
        "CREATE EXTENSION IF NOT EXISTS citext",
        "citext",
        "text",
        [
            ("'MixedCase'", "MixedCase"),
            ("'two'", "two"),
            ("'Renamed'", "Renamed"),
        ],
    )
    .await;
}

#[tokio::test]
async fn domain_over_char_n() {
    exercise(
        "CREATE DOMAIN code5 AS char(5) CHECK (VALUE <> ''); CREATE DOMAIN code5b AS code5",
        "code5b",
        "text",
        [("'ab'", "ab"), ("'cd'", "cd"), ("'e'", "e")],
    )
    .await;
}

#[tokio::test]
async fn domain_over_integer() {
    exercise(
        "CREATE DOMAIN pos AS int4 CHECK (VALUE > 0)",
        "pos",
        "bigint",
        [("1", "1"), ("2", "2"), ("3", "3")],
    )
    .await;
}

/// A column the key type cannot serve is refused at start-up, naming the
/// column and its type, rather than failing every request.
#[tokio::test]
async fn a_key_column_the_key_type_does_not_accept_is_a_start_up_error() {
    let db = TestDb::new().await;
    for (column_type, declared, key_type) in [
        ("numeric", "numeric", "bigint"),
        ("int4", "integer", "text"),
        ("text", "text", "uuid"),
        ("bytea", "bytea", "text"),
    ] {
        db.exec(&format!(
            "DROP TABLE IF EXISTS k; CREATE TABLE k (key {column_type} PRIMARY KEY, label text)"
        ))
        .await;
        let gw = gateway(config(&db.url, &resource(key_type)));
        let err = tokio::time::timeout(Duration::from_secs(20), gw.start())
            .await
            .expect("a permanent error")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("\"k\"") && err.contains("public.k.key is") && err.contains(declared),
            "{column_type} for {key_type}: {err}"
        );
        gw.stop();
    }
}
