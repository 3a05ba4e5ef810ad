//! Every key column type each `key_type` accepts (issue 10, item 3): the key
//! the scan reads, the key the trigger announces and the key a request
//! parses are the same text, so insert, update (of the row and of its key)
//! and delete are all served fresh, before and after a rebuild.

use crate::common;

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
/// the padding (`::text`), in the scan, the trigger and the request; a
/// request with trailing spaces names the same row (`bpchareq` ignores
/// them), and is served and invalidated as that key.
#[tokio::test]
async fn char_n() {
    exercise(
        "",
        "char(5)",
        "text",
        [
            ("'ab'", "ab%20%20"),
            ("'cd'", "cd%20"),
            ("'e f'", "e%20f%20%20%20"),
        ],
    )
    .await;
}

/// `citext`: compared by `lower()`. Each row is asked for in another case
/// than it is stored in, so the scan's, the trigger's and the request's
/// keys meet only through the canonical (lower-cased) key, and a change
/// announced as stored invalidates what a request cached in its spelling.
#[tokio::test]
async fn citext() {
    exercise(
        "CREATE EXTENSION IF NOT EXISTS citext",
        "citext",
        "text",
        [
            ("'MixedCase'", "mIXEDcASE"),
            ("'Two'", "TWO"),
            ("'Renamed'", "rEnAmEd"),
        ],
    )
    .await;
}

/// The rule, with Postgres as the oracle: for random spellings (case,
/// padding, Unicode normalization forms, leading zeros, UUID forms) of
/// rows and of absent keys, against every key column type, the gateway
/// answers what `SELECT … WHERE key = '<spelling>'` finds: the same row
/// (status and body), or 404 when it finds none.
#[tokio::test]
async fn every_spelling_gets_the_answer_postgres_gives() {
    use rand::{Rng, SeedableRng};
    let seed: u64 = std::env::var("KEY_TYPES_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let db = TestDb::new().await;
    db.exec("CREATE EXTENSION IF NOT EXISTS citext").await;
    let text_rows = [
        "Alice",
        "bob",
        "Straße",
        "ÀÉÎ õ",
        "Σίσυφος",
        "caf\u{e9}",
        "cafe\u{301}",
        "\u{212a}elvin",
        "İstanbul",
        "ǅemal",
        "\u{23a}x",
        "a b",
        "o'brien",
        "100%",
    ];
    let tables: [(&str, &str, &str); 6] = [
        ("t_text", "text", "text"),
        ("t_varchar", "varchar(40)", "text"),
        ("t_char", "char(24)", "text"),
        ("t_citext", "citext", "text"),
        ("t_int", "int8", "bigint"),
        ("t_uuid", "uuid", "uuid"),
    ];
    let uuids: Vec<uuid::Uuid> = (0..6)
        .map(|_| uuid::Uuid::from_u128(rng.random()))
        .collect();
    let mut extra = String::from("[server]\nmax_key_length = 256\n");
    for (table, column_type, key_type) in tables {
        db.exec(&format!(
            "CREATE TABLE {table} (key {column_type} PRIMARY KEY, label text NOT NULL)"
        ))
        .await;
        let values: Vec<String> = match key_type {
            "text" => text_rows.iter().map(|s| s.to_string()).collect(),
            "bigint" => ["0", "7", "-12", "4500000000"].map(String::from).to_vec(),
            _ => uuids.iter().map(|u| u.to_string()).collect(),
        };
        for (i, v) in values.iter().enumerate() {
            sqlx::query(&format!(
                "INSERT INTO {table} VALUES ($1::text::{column_type}, $2)"
            ))
            .bind(v)
            .bind(format!("row {i}"))
            .execute(&db.pool)
            .await
            .unwrap();
        }
        extra.push_str(&format!(
            "[[resource]]\nname = \"{table}\"\nroute = \"/{table}/{{key}}\"\ntable = \"{table}\"\n\
             key_column = \"key\"\nkey_type = \"{key_type}\"\ncolumns = [\"key\", \"label\"]\n"
        ));
    }
    let gw = started(config(&db.url, &extra)).await;
    let literal = |s: &str| format!("'{}'", s.replace('\'', "''"));
    for round in 0..150 {
        for (table, _, key_type) in tables {
            let spelling = match key_type {
                "text" => {
                    let base = match rng.random_bool(0.7) {
                        true => text_rows[rng.random_range(0..text_rows.len())].to_string(),
                        false => random_text(&mut rng),
                    };
                    respell(&base, &mut rng)
                }
                "bigint" => {
                    let v: i64 = [0, 7, -12, 4500000000, 8, rng.random_range(-50..50)]
                        [rng.random_range(0..6)];
                    let zeros = "0".repeat(rng.random_range(0..3));
                    match v < 0 {
                        true => format!("-{zeros}{}", v.unsigned_abs()),
                        false => format!("{zeros}{v}"),
                    }
                }
                _ => {
                    let u = match rng.random_bool(0.8) {
                        true => uuids[rng.random_range(0..uuids.len())],
                        false => uuid::Uuid::from_u128(rng.random()),
                    };
                    let s = match rng.random_bool(0.5) {
                        true => u.hyphenated().to_string(),
                        false => u.simple().to_string(),
                    };
                    match rng.random_bool(0.5) {
                        true => s.to_uppercase(),
                        false => s,
                    }
                }
            };
            let oracle: Option<String> = sqlx::query_scalar(&format!(
                "SELECT row_to_json(t)::text FROM (SELECT key, label FROM {table} WHERE key = {}) t",
                literal(&spelling)
            ))
            .fetch_optional(&db.pool)
            .await
            .unwrap();
            let path = format!(
                "/{table}/{}",
                percent_encoding::utf8_percent_encode(
                    &spelling,
                    percent_encoding::NON_ALPHANUMERIC
                )
            );
            let r = get(&gw, &path).await;
            let said = format!("seed {seed}, round {round}: {table} {spelling:?}");
            match oracle {
                Some(row) => {
                    assert_eq!(r.status, StatusCode::OK, "{said}: Postgres finds {row}");
                    assert_eq!(
                        r.json(),
                        serde_json::from_str::<serde_json::Value>(&row).unwrap(),
                        "{said}"
                    );
                }
                None => assert_eq!(
                    r.status,
                    StatusCode::NOT_FOUND,
                    "{said}: Postgres finds nothing, the gateway {:?}",
                    r.body
                ),
            }
        }
    }
}

/// Characters whose case or form Postgres and Rust may treat apart.
const ALPHABET: &[char] = &[
    'a', 'B', 'z', 'Q', ' ', '-', 'ß', 'é', 'É', 'Σ', 'σ', 'ς', '\u{212a}', 'K', 'İ', 'ı', 'i',
    '\u{23a}', '\u{2c65}', 'ǅ', '\u{301}', 'Å', '\u{212b}', 'ﬀ', '7', '%', '/', '"',
];

fn random_text(rng: &mut impl rand::Rng) -> String {
    (0..rng.random_range(1..8))
        .map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())])
        .collect()
}

/// A spelling of `base`: each character in its own case or Rust's other
/// case, NFC or NFD for the few composed ones, trailing or leading spaces.
fn respell(base: &str, rng: &mut impl rand::Rng) -> String {
    const FORMS: [(&str, &str); 4] = [
        ("\u{e9}", "e\u{301}"),
        ("\u{c5}", "A\u{30a}"),
        ("\u{f5}", "o\u{303}"),
        ("\u{c9}", "E\u{301}"),
    ];
    let mut out = String::new();
    for c in base.chars() {
        match rng.random_range(0..4) {
            0 => out.extend(c.to_uppercase()),
            1 => out.extend(c.to_lowercase()),
            _ => out.push(c),
        }
    }
    for (composed, decomposed) in FORMS {
        if rng.random_bool(0.5) {
            out = out.replace(composed, decomposed);
        } else {
            out = out.replace(decomposed, composed);
        }
    }
    if rng.random_bool(0.3) {
        out.push_str(&" ".repeat(rng.random_range(1..4)));
    }
    if rng.random_bool(0.1) {
        out.insert(0, ' ');
    }
    out
}

/// A key column whose comparison the gateway cannot reproduce is refused
/// at start-up, naming it: citext under an ICU collation (`lower()` of a
/// final sigma depends on its neighbours), and a non-deterministic
/// collation on any text column.
#[tokio::test]
async fn a_comparison_the_gateway_cannot_reproduce_is_a_start_up_error() {
    let db = TestDb::new().await;
    db.exec(
        "CREATE EXTENSION IF NOT EXISTS citext;
         CREATE COLLATION IF NOT EXISTS ci_level2 (provider = icu, locale = 'und-u-ks-level2', deterministic = false)",
    )
    .await;
    for (column_type, said) in [
        (
            "citext COLLATE \"und-x-icu\"",
            "its lower() maps some characters by their context",
        ),
        ("text COLLATE ci_level2", "non-deterministic collation"),
        (
            "varchar(9) COLLATE ci_level2",
            "non-deterministic collation",
        ),
    ] {
        let err = start_error(&db, column_type, "text").await;
        assert!(
            err.contains("\"k\"") && err.contains("public.k.key") && err.contains(said),
            "{column_type}: {err}"
        );
        // `bloomgate preflight` says so before a start.
        let report = bloomgate::preflight::run(&config(&db.url, &resource("text"))).await;
        let shown = report.to_string();
        assert!(
            !report.passed() && shown.contains("public.k.key") && shown.contains(said),
            "{column_type}: {shown}"
        );
    }
    // A libc collation other than the database's is read, not refused.
    db.exec("DROP TABLE k; CREATE TABLE k (key citext COLLATE \"C\" PRIMARY KEY, label text); INSERT INTO k VALUES ('Ab', 'x')")
        .await;
    let gw = started(config(&db.url, &resource("text"))).await;
    assert_eq!(get(&gw, "/k/aB").await.status, StatusCode::OK);
    assert_eq!(get(&gw, "/k/%C3%80b").await.status, StatusCode::NOT_FOUND);
    assert_eq!(
        gw.resource("k").unwrap().comparison().describe(),
        "lower() under collation C"
    );
    gw.stop();
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
        let err = start_error(&db, column_type, key_type).await;
        assert!(
            err.contains("\"k\"") && err.contains("public.k.key is") && err.contains(declared),
            "{column_type} for {key_type}: {err}"
        );
    }
}

/// The table `k` made anew with a key column of `column_type`: the error a
/// gateway serving it as `key_type` stops with.
async fn start_error(db: &TestDb, column_type: &str, key_type: &str) -> String {
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
    gw.stop();
    err
}

/// A composite key, `(tenant_id bigint, order_no text)`: each part a
/// segment of the route, percent-decoded on its own; the scan, the feed
/// and a request arrive at the same key, through inserts, updates of one
/// part, deletes and a rebuild; `(1, "23")` and `(12, "3")` are two keys.
#[tokio::test]
async fn composite_keys_are_served_fresh_part_by_part() {
    let db = TestDb::new().await;
    db.exec(
        "CREATE TABLE orders (tenant_id bigint, order_no text, item text NOT NULL,
                              PRIMARY KEY (tenant_id, order_no));
         INSERT INTO orders VALUES (1, '23', 'one-23'), (12, '3', 'twelve-3');",
    )
    .await;
    let orders = r#"
        [[resource]]
        name = "orders"
        route = "/tenants/{tenant_id}/orders/{order_no}"
        table = "orders"
        key_column = ["tenant_id", "order_no"]
        key_type = ["bigint", "text"]
        columns = ["tenant_id", "order_no", "item"]
    "#;
    let gw = started(config(&db.url, orders)).await;
    let path = |t: &str, o: &str| format!("/tenants/{t}/orders/{o}");
    let ok =
        |item: &'static str| move |r: &Resp| r.status == StatusCode::OK && r.json()["item"] == item;
    let gone = |r: &Resp| r.status == StatusCode::NOT_FOUND;

    // The scan's keys are the request's, and neither is the other.
    let r = get(&gw, &path("1", "23")).await;
    assert_eq!(
        (r.status, r.header("cache-status")),
        (StatusCode::OK, "bloomgate; fwd=miss; stored")
    );
    assert_eq!(r.json()["item"], "one-23");
    assert_eq!(get(&gw, &path("12", "3")).await.json()["item"], "twelve-3");
    assert_eq!(
        get(&gw, &path("1", "3")).await.status,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        get(&gw, &path("12", "23")).await.status,
        StatusCode::NOT_FOUND
    );
    // A part that does not parse is named, and nothing is asked.
    for (t, o, part) in [("x", "3", "tenant_id"), ("1", "%zz", "order_no")] {
        let r = get(&gw, &path(t, o)).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{t}/{o}");
        let body = String::from_utf8_lossy(&r.body).to_string();
        assert!(body.contains(&format!("key part {part}")), "{body}");
    }

    // The feed's keys are the request's: a new row, a part with a '/'.
    db.exec("INSERT INTO orders VALUES (1, 'a/b', 'slash')")
        .await;
    fresh(&gw, &path("1", "a%2Fb"), ok("slash")).await;
    // One part changes: the old key goes, the new one serves the row.
    db.exec("UPDATE orders SET order_no = '24' WHERE tenant_id = 1 AND order_no = '23'")
        .await;
    fresh(&gw, &path("1", "24"), ok("one-23")).await;
    fresh(&gw, &path("1", "23"), gone).await;
    db.exec("UPDATE orders SET tenant_id = 13 WHERE tenant_id = 12")
        .await;
    fresh(&gw, &path("13", "3"), ok("twelve-3")).await;
    fresh(&gw, &path("12", "3"), gone).await;
    // A value changes; a row goes.
    db.exec("UPDATE orders SET item = 'changed' WHERE tenant_id = 1 AND order_no = '24'")
        .await;
    fresh(&gw, &path("1", "24"), ok("changed")).await;
    db.exec("DELETE FROM orders WHERE tenant_id = 1 AND order_no = 'a/b'")
        .await;
    fresh(&gw, &path("1", "a%2Fb"), gone).await;

    // After a rebuild (a scan again), the same keys.
    gw.resource("orders").unwrap().rebuild(true).await.unwrap();
    assert_eq!(get(&gw, &path("1", "24")).await.json()["item"], "changed");
    assert_eq!(get(&gw, &path("13", "3")).await.json()["item"], "twelve-3");
    for (t, o) in [("1", "23"), ("12", "3"), ("1", "a%2Fb")] {
        assert_eq!(get(&gw, &path(t, o)).await.status, StatusCode::NOT_FOUND);
    }

    // The admin API purges one composite key: parts split by ','.
    assert_eq!(
        get(&gw, &path("1", "24")).await.header("cache-status"),
        "bloomgate; hit"
    );
    let admin = |uri: &str| {
        let req = axum::http::Request::builder()
            .method("DELETE")
            .uri(uri)
            .header("authorization", "Bearer composite-admin-token")
            .body(axum::body::Body::empty())
            .unwrap();
        send(
            bloomgate::http::admin::app(gw.clone(), "composite-admin-token"),
            req,
        )
    };
    let r = admin("/admin/resources/orders/cache/keys/1,24").await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    assert_eq!(
        get(&gw, &path("1", "24")).await.header("cache-status"),
        "bloomgate; fwd=miss; stored"
    );
    let r = admin("/admin/resources/orders/cache/keys/1").await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);

    // OpenAPI types every part.
    let doc = get(&gw, "/openapi.json").await.json();
    let params = &doc["paths"]["/tenants/{tenant_id}/orders/{order_no}"]["get"]["parameters"];
    let named: Vec<(&str, &str)> = params
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["name"].as_str().unwrap(),
                p["schema"]["type"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(named, [("tenant_id", "integer"), ("order_no", "string")]);
    gw.stop();
}

/// A composite key must be a unique set: a key within a wider primary key
/// is refused at start-up, naming the fix.
#[tokio::test]
async fn a_composite_key_that_is_not_unique_is_refused() {
    let db = TestDb::new().await;
    db.exec(
        "CREATE TABLE lines (tenant_id bigint, order_no bigint, line int, item text NOT NULL,
                             PRIMARY KEY (tenant_id, order_no, line))",
    )
    .await;
    let lines = r#"
        [[resource]]
        name = "lines"
        route = "/t/{tenant_id}/o/{order_no}"
        table = "lines"
        key_column = ["tenant_id", "order_no"]
        key_type = "bigint"
        columns = ["item"]
    "#;
    let gw = gateway(config(&db.url, lines));
    let e = gw.start().await.unwrap_err().to_string();
    assert!(
        e.contains("the key (tenant_id, order_no) of public.lines is not unique"),
        "{e}"
    );
    assert!(
        e.contains(
            r#"CREATE UNIQUE INDEX CONCURRENTLY ON "public"."lines" ("tenant_id", "order_no")"#
        ),
        "{e}"
    );
}

/// A composite key whose parts compare otherwise than by bytes: an
/// `integer` column under a `bigint` part, a `uuid` part spelled in any
/// of its forms, a `citext` part in any case. The scan, the feed and a
/// request arrive at the same key, and the row query compares each part
/// as its column does.
#[tokio::test]
async fn a_composite_key_compares_each_part_as_its_column_does() {
    let db = TestDb::new().await;
    db.exec(
        "CREATE EXTENSION IF NOT EXISTS citext;
         CREATE TABLE seats (venue int4, show uuid, seat citext, holder text NOT NULL,
                             PRIMARY KEY (venue, show, seat));
         INSERT INTO seats VALUES
           (7, '0b7e4a3c-1f2d-4c5b-9a8e-7d6c5b4a3f2e', 'Row A-1', 'alice');",
    )
    .await;
    let seats = r#"
        [[resource]]
        name = "seats"
        route = "/venues/{venue}/shows/{show}/seats/{seat}"
        table = "seats"
        key_column = ["venue", "show", "seat"]
        key_type = ["bigint", "uuid", "text"]
        columns = ["venue", "seat", "holder"]
    "#;
    let gw = started(config(&db.url, seats)).await;
    let show = "0b7e4a3c-1f2d-4c5b-9a8e-7d6c5b4a3f2e";
    let path = |v: &str, s: &str, seat: &str| format!("/venues/{v}/shows/{s}/seats/{seat}");
    let holder =
        |who: &'static str| move |r: &Resp| r.status == StatusCode::OK && r.json()["holder"] == who;
    // The scanned key, asked in other spellings of the same row.
    for (s, seat) in [
        (show, "Row%20A-1"),
        ("0B7E4A3C1F2D4C5B9A8E7D6C5B4A3F2E", "row%20a-1"),
        (show, "ROW%20A-1"),
    ] {
        let r = get(&gw, &path("007", s, seat)).await;
        assert_eq!(r.status, StatusCode::OK, "{s} {seat}");
        assert_eq!(r.json()["holder"], "alice");
    }
    // Cached once: every spelling is the one key.
    assert_eq!(
        get(&gw, &path("7", show, "ROW%20a-1"))
            .await
            .header("cache-status"),
        "bloomgate; hit"
    );
    // The feed's keys: a new row asked in another case, the row changed
    // under a cached spelling, then its citext part changed in case only
    // (the same key to Postgres), then to another seat.
    db.exec(&format!(
        "INSERT INTO seats VALUES (8, '{show}', 'Box 2', 'bob')"
    ))
    .await;
    fresh(&gw, &path("8", show, "BOX%202"), holder("bob")).await;
    db.exec("UPDATE seats SET holder = 'carol' WHERE venue = 7")
        .await;
    fresh(&gw, &path("7", show, "row%20a-1"), holder("carol")).await;
    db.exec("UPDATE seats SET seat = 'ROW A-1' WHERE venue = 7")
        .await;
    fresh(&gw, &path("7", show, "Row%20a-1"), holder("carol")).await;
    db.exec("UPDATE seats SET seat = 'Row B-2' WHERE venue = 7")
        .await;
    fresh(&gw, &path("7", show, "row%20b-2"), holder("carol")).await;
    fresh(&gw, &path("7", show, "row%20a-1"), |r| {
        r.status == StatusCode::NOT_FOUND
    })
    .await;
    // A rebuild scans the same keys.
    gw.resource("seats").unwrap().rebuild(true).await.unwrap();
    assert_eq!(
        get(&gw, &path("7", show, "ROW%20B-2")).await.status,
        StatusCode::OK
    );
    assert_eq!(
        get(&gw, &path("8", show, "box%202")).await.status,
        StatusCode::OK
    );
    gw.stop();
}

/// A view keyed by a key it computes cannot be followed on its source
/// table, and the refusal names the way out: the table's own key columns,
/// as a composite key, which a view serves and follows.
#[tokio::test]
async fn a_view_keyed_by_a_computed_key_is_pointed_to_a_composite_key() {
    let db = TestDb::new().await;
    db.exec(
        "CREATE TABLE orders (tenant_id bigint, order_no bigint, item text NOT NULL,
                              PRIMARY KEY (tenant_id, order_no));
         INSERT INTO orders VALUES (1, 23, 'one'), (12, 3, 'twelve');
         CREATE VIEW keyed_orders AS
           SELECT tenant_id || '-' || order_no AS order_key, item FROM orders;
         CREATE VIEW open_orders AS SELECT tenant_id, order_no, item FROM orders;",
    )
    .await;
    let computed = r#"
        [[resource]]
        name = "keyed_orders"
        route = "/keyed-orders/{order_key}"
        table = "keyed_orders"
        source_table = "orders"
        key_column = "order_key"
        key_type = "text"
        columns = ["order_key", "item"]
    "#;
    let gw = gateway(config(&db.url, computed));
    let e = gw.start().await.unwrap_err().to_string();
    gw.stop();
    assert!(
        e.contains(r#"source_table public.orders has no column "order_key""#)
            && e.contains("key_column = [..]"),
        "{e}"
    );
    let composite = r#"
        [[resource]]
        name = "open_orders"
        route = "/tenants/{tenant_id}/open-orders/{order_no}"
        table = "open_orders"
        source_table = "orders"
        key_column = ["tenant_id", "order_no"]
        key_type = "bigint"
        columns = ["tenant_id", "order_no", "item"]
    "#;
    let gw = started(config(&db.url, composite)).await;
    assert_eq!(
        get(&gw, "/tenants/12/open-orders/3").await.json()["item"],
        "twelve"
    );
    db.exec("UPDATE orders SET item = 'changed' WHERE tenant_id = 12")
        .await;
    fresh(&gw, "/tenants/12/open-orders/3", |r| {
        r.status == StatusCode::OK && r.json()["item"] == "changed"
    })
    .await;
    db.exec("INSERT INTO orders VALUES (12, 4, 'new')").await;
    fresh(&gw, "/tenants/12/open-orders/4", |r| {
        r.status == StatusCode::OK
    })
    .await;
    gw.stop();
}
