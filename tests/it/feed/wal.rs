//! The `wal` change feed against a real server with `wal_level = logical`
//! (the throwaway primary of `scripts/pg.sh replicas`, started by
//! `scripts/test.sh`; the server on :5432 is never reconfigured).

use crate::common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::http::StatusCode;
use bloomgate::config::Freshness;
use common::*;
use sqlx::{Connection, Executor};

// Tests that kill the feed's backend must not kill another test's.
use crate::common::ON_THE_PRIMARY as ONE_AT_A_TIME;

#[tokio::test]
async fn the_wal_feed_keeps_two_resources_on_one_table_fresh() {
    let _one = ONE_AT_A_TIME.lock().await;
    let db = logical_db(10).await;
    // The email route needs the old email on UPDATE and DELETE.
    db.exec("ALTER TABLE users REPLICA IDENTITY FULL").await;
    let gw = started(wal_config(&db, BY_EMAIL)).await;
    assert_eq!(gw.freshness(), Some(Freshness::Wal));
    let triggers: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_trigger WHERE tgrelid = 'users'::regclass AND NOT tgisinternal",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(triggers, 0, "writers must not pay for triggers in wal mode");

    db.exec("INSERT INTO users (id, email, name) VALUES (500, 'five@x.org', 'Five')")
        .await;
    eventually("insert servable on both routes", || async {
        get_status(&gw, "/users/500").await == StatusCode::OK
            && get_status(&gw, "/users-by-email/five@x.org").await == StatusCode::OK
    })
    .await;
    db.exec("UPDATE users SET email = 'cinq@x.org' WHERE id = 500")
        .await;
    eventually("update of the key column on both routes", || async {
        get(&gw, "/users/500").await.json()["email"] == "cinq@x.org"
            && get_status(&gw, "/users-by-email/cinq@x.org").await == StatusCode::OK
            && get_status(&gw, "/users-by-email/five@x.org").await == StatusCode::NOT_FOUND
    })
    .await;
    db.exec("DELETE FROM users WHERE id = 500").await;
    eventually("delete on both routes", || async {
        get_status(&gw, "/users/500").await == StatusCode::NOT_FOUND
            && get_status(&gw, "/users-by-email/cinq@x.org").await == StatusCode::NOT_FOUND
    })
    .await;

    // A rolled-back transaction has no effect; a forged NOTIFY neither.
    db.exec(
        "BEGIN; INSERT INTO users (id, email, name) VALUES (600, 'six@x.org', 'Six'); ROLLBACK",
    )
    .await;
    db.exec(r#"NOTIFY bloomgate, '{"t":"public.users","op":"INSERT","k":{"id":"777"}}'"#)
        .await;
    // A later commit has been applied, so anything before it was too.
    db.exec("INSERT INTO users (id, email, name) VALUES (501, 'x@x.org', 'X')")
        .await;
    eventually("the later insert", || async {
        get_status(&gw, "/users/501").await == StatusCode::OK
    })
    .await;
    for path in ["/users/600", "/users/777"] {
        let r = get(&gw, path).await;
        assert_eq!(r.status, StatusCode::NOT_FOUND, "{path}");
        assert_eq!(
            r.header("cache-status"),
            "bloomgate; detail=filter-absent",
            "{path}"
        );
    }
    assert!(gw.wal_stats.commits.load(Ordering::Relaxed) >= 4);
    gw.stop();
}

#[tokio::test]
async fn a_big_transaction_and_a_truncate() {
    let _one = ONE_AT_A_TIME.lock().await;
    let db = logical_db(10).await;
    let gw = started(wal_config(&db, "")).await;
    db.exec(
        "INSERT INTO users (id, email, name) SELECT g, 'b' || g || '@x.org', 'B' \
         FROM generate_series(1000, 100999) g",
    )
    .await;
    eventually("the last row of a 100,000-row transaction", || async {
        get_status(&gw, "/users/100999").await == StatusCode::OK
    })
    .await;
    for id in (1000..=100_999).step_by(997) {
        assert_eq!(
            get_status(&gw, &format!("/users/{id}")).await,
            StatusCode::OK,
            "{id}"
        );
    }
    let _ = get(&gw, "/users/5").await;
    assert_eq!(
        get(&gw, "/users/5").await.header("cache-status"),
        "bloomgate; hit"
    );
    db.exec("TRUNCATE users CASCADE").await;
    // The cache is cleared at once (the rebuild that follows is refused by
    // the shrink guard, which keeps every key it had: no false negative).
    eventually("a cleared cache after TRUNCATE", || async {
        get_status(&gw, "/users/5").await == StatusCode::NOT_FOUND
    })
    .await;
    gw.stop();
}

/// The feed's backend killed while rows are inserted: no key is lost. With
/// a temporary slot the reconnect resyncs (a rebuild); with a permanent one
/// it resumes where it was, without a rebuild. Streamed and polled.
#[tokio::test]
async fn a_killed_feed_loses_nothing_and_a_permanent_slot_resumes_without_a_rebuild() {
    let _one = ONE_AT_A_TIME.lock().await;
    for (permanent, polled) in [(false, false), (true, false), (false, true), (true, true)] {
        let db = logical_db(10).await;
        let slot = format!("bg_test_{}", db.name.rsplit('_').next().unwrap());
        let mut extra = if permanent {
            format!("slot = \"{slot}\"\n")
        } else {
            String::new()
        };
        if polled {
            extra.push_str("wal_poll_interval = \"5ms\"\n");
        }
        let gw = started(wal_config(&db, &extra)).await;
        let users = gw.resource("users").unwrap();
        let rebuilds = users.stats.rebuilds.load(Ordering::Relaxed);
        for batch in 0..10i64 {
            db.exec(&format!(
                "INSERT INTO users (id, email, name) SELECT g, 'k' || g || '@x.org', 'K' \
                 FROM generate_series({}, {}) g",
                2000 + batch * 100,
                2099 + batch * 100
            ))
            .await;
            if batch == 4 {
                db.exec(&format!(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                     WHERE datname = '{}' AND application_name = 'bloomgate-wal-feed'",
                    db.name
                ))
                .await;
            }
        }
        // Every insert above committed before this: once a heartbeat made
        // after it is applied and the resource is vouched for again (a
        // temporary slot's gap closed by its rebuild), each key must be in
        // the filter, not merely found by the database within the verify
        // budget.
        vouched(&gw, "users").await;
        for id in 2000..3000 {
            assert_eq!(
                get_status(&gw, &format!("/users/{id}")).await,
                StatusCode::OK,
                "{id} (permanent slot: {permanent}, polled: {polled})"
            );
        }
        assert!(
            gw.wal_stats.reconnects.load(Ordering::Relaxed) >= 1,
            "the kill did not land"
        );
        let after = users.stats.rebuilds.load(Ordering::Relaxed);
        if permanent {
            assert_eq!(
                after, rebuilds,
                "a permanent slot resumes without a rebuild"
            );
        } else {
            eventually("a resync after a temporary slot was lost", || async {
                users.stats.rebuilds.load(Ordering::Relaxed) > rebuilds
            })
            .await;
        }
        gw.stop();
        if permanent {
            // Not held by anyone now: drop it, or it keeps WAL.
            tokio::time::sleep(Duration::from_millis(200)).await;
            let _ = sqlx::query("SELECT pg_drop_replication_slot($1)")
                .bind(&slot)
                .execute(&db.pool)
                .await;
        }
    }
}

#[tokio::test]
async fn auto_takes_the_wal_where_it_can_and_notify_elsewhere() {
    let _one = ONE_AT_A_TIME.lock().await;
    let db = logical_db(3).await;
    let gw = started(config(&db.url, "install_feed = true\n")).await;
    assert_eq!(gw.freshness(), Some(Freshness::Wal));
    // The admin API and the status page's stats say which feed is in force.
    for path in ["/admin/resources", "/admin/stats"] {
        let token = "s3cret-admin-token-for-tests";
        let r = send(
            bloomgate::http::admin::app(gw.clone(), token),
            axum::http::Request::get(path)
                .header("authorization", format!("Bearer {token}"))
                .body(axum::body::Body::empty())
                .unwrap(),
        )
        .await;
        assert_eq!(r.status, StatusCode::OK, "{path}");
        let j = r.json();
        let freshness = if path == "/admin/stats" {
            &j["freshness"]
        } else {
            &j[0]["freshness"]
        };
        assert_eq!(freshness, "wal", "{path}: {j}");
        if path == "/admin/stats" {
            assert!(j["wal"]["applied_lsn"].is_string(), "{j}");
            assert!(j["wal"]["reconnects"].is_u64(), "{j}");
        }
    }
    gw.stop();
    // Without the publication and not allowed to make it: notify.
    let db = logical_db(3).await;
    let gw = started(config(&db.url, "publication = \"nope\"\n")).await;
    assert_eq!(gw.freshness(), Some(Freshness::Notify));
    gw.stop();
    // Asked for explicitly without what it needs: a start-up error naming
    // the fix.
    let err = gateway(config(
        &db.url,
        "freshness = \"wal\"\npublication = \"nope\"\n",
    ))
    .start()
    .await
    .unwrap_err()
    .to_string();
    assert!(err.contains("install-feed"), "{err}");
}

/// A statement the database gave up on is not its answer. The
/// publication's install waits behind a lock another session holds (as
/// it waits behind a hung network and then runs), `statement_timeout`
/// cancels it, and start-up tries again once the database is asked again,
/// rather than stop the gateway with "cannot install the publication".
#[tokio::test]
async fn a_publication_install_cancelled_by_statement_timeout_is_tried_again() {
    let _one = ONE_AT_A_TIME.lock().await;
    let db = logical_db(3).await;
    let mut holder = sqlx::PgConnection::connect(&db.url).await.unwrap();
    holder.execute("BEGIN").await.unwrap();
    holder
        .execute("LOCK TABLE users IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let gw = gateway(wal_config(&db, "statement_timeout = \"300ms\"\n"));
    let starting = tokio::spawn({
        let gw = gw.clone();
        async move { gw.start().await.map_err(|e| e.to_string()) }
    });
    // Several statement timeouts while the lock is held: said on
    // `/readyz` meanwhile.
    eventually("/readyz names the step the database gave up on", || async {
        gw.readiness()
            .database
            .is_some_and(|why| why.contains("cannot install the publication"))
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!starting.is_finished(), "{:?}", starting.await);
    holder.execute("COMMIT").await.unwrap();
    let started = tokio::time::timeout(Duration::from_secs(60), starting)
        .await
        .expect("start-up goes on once the lock is gone")
        .unwrap();
    assert_eq!(started, Ok(()));
    assert_eq!(gw.freshness(), Some(Freshness::Wal));
    gw.stop();
}

#[tokio::test]
async fn a_published_table_outside_the_resources_is_ignored() {
    let _one = ONE_AT_A_TIME.lock().await;
    let db = logical_db(3).await;
    let gw = started(wal_config(&db, "")).await;
    // Published (someone else's publication change, or FOR ALL TABLES),
    // but no resource serves it: its rows must reach no filter, even with
    // ids and a column named like a watched table's key.
    db.exec(
        "CREATE TABLE other_users (id bigint PRIMARY KEY, email text);
         ALTER PUBLICATION bloomgate ADD TABLE other_users;
         INSERT INTO other_users VALUES (900, 'nine@x.org');
         UPDATE other_users SET id = 901 WHERE id = 900;",
    )
    .await;
    // A later commit on a watched table has been applied, so the earlier
    // ones on other_users were read (and skipped) before it.
    db.exec("INSERT INTO users (id, email, name) VALUES (902, 'w@x.org', 'W')")
        .await;
    eventually("the later insert", || async {
        get_status(&gw, "/users/902").await == StatusCode::OK
    })
    .await;
    for path in ["/users/900", "/users/901"] {
        let r = get(&gw, path).await;
        assert_eq!(r.status, StatusCode::NOT_FOUND, "{path}");
        assert_eq!(
            r.header("cache-status"),
            "bloomgate; detail=filter-absent",
            "{path}"
        );
    }
    gw.stop();
}

/// A gateway that starts while the publication already delivers every
/// change of its tables leaves the publication's catalog rows as they are:
/// a rewrite is an edit every running feed resyncs for (`feed::tracker`), so
/// each start of a fleet's member (a rolling deploy) would make every
/// gateway rebuild every filter, as `tests/it/feed/bus.rs`
/// `a_first_start_builds_every_filter_once` shows once start-up takes
/// longer than the first gateway's first check.
#[tokio::test]
async fn a_start_leaves_a_publication_that_is_right_untouched() {
    let _one = ONE_AT_A_TIME.lock().await;
    let db = logical_db(3).await;
    let rows = || async {
        sqlx::query_scalar::<_, String>(
            "SELECT (SELECT oid::text || ':' || xmin::text FROM pg_publication
                      WHERE pubname = 'bloomgate')
                    || ' ' || string_agg(r.oid::text || ':' || r.xmin::text, ',' ORDER BY r.oid)
               FROM pg_publication_rel r",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap()
    };
    let first = started(wal_config(&db, "")).await;
    let before = rows().await;
    let second = started(wal_config(&db, "")).await;
    assert_eq!(
        rows().await,
        before,
        "the second start rewrote the publication"
    );
    // One that does not deliver a watched table's changes is still
    // repaired at start-up (by the third: the running ones, which repair
    // it too, are stopped first).
    first.stop();
    second.stop();
    db.exec("ALTER PUBLICATION bloomgate SET (publish = 'insert')")
        .await;
    let third = started(wal_config(&db, "")).await;
    let publishes: bool =
        sqlx::query_scalar("SELECT pubdelete FROM pg_publication WHERE pubname = 'bloomgate'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert!(publishes, "not repaired");
    third.stop();
}

/// The publication installed by several gateways at once on a database
/// with none (a fleet starting together, released here at one instant):
/// every one succeeds. Checked
/// and created without a lock, two would find none and the second CREATE
/// PUBLICATION would fail.
#[tokio::test]
async fn gateways_installing_the_publication_at_once_all_succeed() {
    for _ in 0..5 {
        let db = logical_db(1).await;
        let gws: Vec<_> = (0..8).map(|_| gateway(wal_config(&db, ""))).collect();
        // A connection ready in each, so the installs start together.
        for g in &gws {
            let _ = sqlx::query("SELECT 1").execute(g.db.pool()).await.unwrap();
        }
        let watch = bloomgate::feed::Watch {
            tables: vec![bloomgate::feed::WatchedTable {
                name: "public.users".into(),
                columns: vec![],
                keys: Vec::new(),
                served: Vec::new(),
            }],
        };
        let results = futures_util::future::join_all(gws.iter().map(|g| {
            let watch = &watch;
            async move {
                let mut conn = g.db.pool().acquire().await.unwrap();
                bloomgate::db::publication::install(&mut conn, watch, "bloomgate_race").await
            }
        }))
        .await;
        for r in &results {
            assert!(r.is_ok(), "{results:?}");
        }
        // The publications of these databases go with them.
    }
}

/// The publication install-feed makes lists, on Postgres 15 and later,
/// only the columns the feed needs (each resource's key, the replica
/// identity's columns): the gateway is never sent another column of a row
/// (a `password_hash`), and still gets every change, an UPDATE of a column
/// left out included, which must take the cached row out.
#[tokio::test]
async fn the_publication_sends_only_the_keys_and_still_every_change() {
    let _one = ONE_AT_A_TIME.lock().await;
    let db = logical_db(10).await;
    db.exec("ALTER TABLE users ADD COLUMN password_hash text NOT NULL DEFAULT 'initial'")
        .await;
    let gw = started(wal_config(&db, "")).await;
    let published: Vec<(String, Vec<String>)> = sqlx::query_as(
        "SELECT tablename::text, attnames::text[] FROM pg_publication_tables
          WHERE pubname = 'bloomgate' ORDER BY tablename",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let want = |t: &str| (t.to_string(), vec!["id".to_string()]);
    assert_eq!(published, [want("articles"), want("users")]);

    // A change of a column outside the list still reaches the feed, with
    // the row's key: the cached row goes.
    let _ = get(&gw, "/users/5").await;
    assert_eq!(
        get(&gw, "/users/5").await.header("cache-status"),
        "bloomgate; hit"
    );
    db.exec("UPDATE users SET name = 'five' WHERE id = 5").await;
    eventually("the renamed row served", || async {
        get(&gw, "/users/5").await.json()["name"] == "five"
    })
    .await;
    db.exec("INSERT INTO users (id, email, name) VALUES (500, 'f@x.org', 'F')")
        .await;
    eventually("an insert", || async {
        get_status(&gw, "/users/500").await == StatusCode::OK
    })
    .await;
    db.exec("DELETE FROM users WHERE id = 500").await;
    eventually("a delete", || async {
        get_status(&gw, "/users/500").await == StatusCode::NOT_FOUND
    })
    .await;
    gw.stop();

    // What pgoutput sends for this publication, read from a slot of the
    // test's own: the update of the hash is sent (an 'U' message), and no
    // byte of the hash or of the other columns.
    let slot = format!("{}_peek", db.name);
    db.exec(&format!(
        "SELECT pg_create_logical_replication_slot('{slot}', 'pgoutput')"
    ))
    .await;
    db.exec("UPDATE users SET password_hash = 'hunter2-secret' WHERE id = 6")
        .await;
    let messages: Vec<Vec<u8>> = sqlx::query_scalar(&format!(
        "SELECT data FROM pg_logical_slot_get_binary_changes('{slot}', NULL, NULL,
                'proto_version', '1', 'publication_names', 'bloomgate')"
    ))
    .fetch_all(&db.pool)
    .await
    .unwrap();
    db.exec(&format!("SELECT pg_drop_replication_slot('{slot}')"))
        .await;
    let contains = |needle: &[u8]| {
        messages
            .iter()
            .any(|m| m.windows(needle.len()).any(|w| w == needle))
    };
    assert!(
        messages.iter().any(|m| m.first() == Some(&b'U')),
        "{messages:?}"
    );
    assert!(contains(b"6"), "the key is sent: {messages:?}");
    for left_out in [
        &b"hunter2-secret"[..],
        b"User 6",
        b"u6@example.com",
        b"password_hash",
    ] {
        assert!(
            !contains(left_out),
            "{:?} reached the slot: {messages:?}",
            String::from_utf8_lossy(left_out)
        );
    }
}

/// The feed's check of the publication takes a column list that holds
/// the keys (or more), and refuses one that leaves a key out, or the
/// replica identity's columns (Postgres then refuses the application's
/// UPDATE and DELETE on the table); a start with `install_feed` sets the
/// list back. Under a list of keys and identity, an UPDATE of a key (its
/// old value in the old row, through the identity) is followed on both
/// routes.
#[tokio::test]
async fn a_column_list_is_checked_for_the_keys_and_the_identity() {
    use bloomgate::db::publication;
    use bloomgate::feed::{ColumnType, Watch, WatchedColumn, WatchedTable};
    let _one = ONE_AT_A_TIME.lock().await;
    let db = logical_db(10).await;
    db.exec(
        "CREATE UNIQUE INDEX users_id_email ON users (id, email);
         ALTER TABLE users REPLICA IDENTITY USING INDEX users_id_email",
    )
    .await;
    let gw = started(wal_config(&db, BY_EMAIL)).await;
    let users_list = || async {
        sqlx::query_scalar::<_, Vec<String>>(
            "SELECT attnames::text[] FROM pg_publication_tables
              WHERE pubname = 'bloomgate' AND tablename = 'users'",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap()
    };
    assert_eq!(users_list().await, ["id", "email"]);
    assert_eq!(
        get(&gw, "/users-by-email/u3@example.com").await.json()["id"],
        3
    );
    db.exec("UPDATE users SET email = 'three@x.org' WHERE id = 3")
        .await;
    eventually("the old email gone, the new one served", || async {
        get_status(&gw, "/users-by-email/u3@example.com").await == StatusCode::NOT_FOUND
            && get_status(&gw, "/users-by-email/three@x.org").await == StatusCode::OK
    })
    .await;
    gw.stop();

    let column = |name: &str, ty| WatchedColumn {
        name: name.into(),
        ty,
    };
    let watch = Watch {
        tables: vec![WatchedTable {
            name: "public.users".into(),
            columns: vec![
                column("id", ColumnType::Int8),
                column("email", ColumnType::Text),
            ],
            keys: vec![vec!["id".into()], vec!["email".into()]],
            served: Vec::new(),
        }],
    };
    let mut conn = db.pool.acquire().await.unwrap();
    let mut problem = async |sql: &str| {
        db.exec(sql).await;
        publication::check(&mut conn, &watch, "bloomgate")
            .await
            .unwrap()
            .problems
            .remove(0)
    };
    assert_eq!(problem("SELECT 1").await, None, "the list installed");
    assert_eq!(
        problem("ALTER PUBLICATION bloomgate SET TABLE users (id, email, name)").await,
        None,
        "a wider list"
    );
    let why = problem("ALTER PUBLICATION bloomgate SET TABLE users (id, name)")
        .await
        .unwrap();
    assert!(
        why.contains("leaves email of public.users out of its column list"),
        "{why}"
    );
    let why = problem("ALTER TABLE users REPLICA IDENTITY DEFAULT; ALTER PUBLICATION bloomgate SET TABLE users (email)")
        .await
        .unwrap();
    assert!(why.contains("leaves id of public.users out"), "{why}");
    let why = problem(
        "ALTER TABLE users REPLICA IDENTITY USING INDEX users_email_key;
         ALTER PUBLICATION bloomgate SET TABLE users (id, name)",
    )
    .await
    .unwrap();
    assert!(why.contains("leaves email of public.users out"), "{why}");
    let why = problem(
        "ALTER PUBLICATION bloomgate SET TABLE users (id, email);
         ALTER TABLE users REPLICA IDENTITY FULL",
    )
    .await
    .unwrap();
    assert!(
        why.starts_with("PostgreSQL refuses every UPDATE and DELETE on public.users (its replica identity is FULL"),
        "{why}"
    );
    drop(conn);
    // Started with install_feed: the list is what the identity needs.
    db.exec("ALTER TABLE users REPLICA IDENTITY USING INDEX users_id_email; ALTER PUBLICATION bloomgate SET TABLE users (id)")
        .await;
    let gw = started(wal_config(&db, BY_EMAIL)).await;
    assert_eq!(users_list().await, ["id", "email"]);
    gw.stop();
}

/// Preflight's replica-identity and publication advice, applied once,
/// makes preflight pass, for every set of resources on one table (each
/// subset of four keys: the primary key, a citext and a text column
/// unique and NOT NULL, a unique nullable one), from a table with its
/// primary key as identity and no publication, and from one whose identity
/// is the email index with a publication listing id and email. The
/// advice used to go in a circle: with `id` and `email` served, "use the
/// email index", then "use the primary key", and so on.
#[tokio::test]
async fn preflights_advice_applied_once_passes_for_every_set_of_resources() {
    use sqlx::{Connection, Executor};
    let db = logical_db(0).await;
    db.exec(
        "CREATE EXTENSION IF NOT EXISTS citext;
         CREATE TABLE accounts (id bigint PRIMARY KEY, email citext NOT NULL UNIQUE,
                                handle text NOT NULL UNIQUE, code text UNIQUE,
                                password_hash text NOT NULL);
         INSERT INTO accounts VALUES (1, 'a@x.org', 'a', NULL, 'secret')",
    )
    .await;
    let keys = [
        ("id", "bigint"),
        ("email", "text"),
        ("handle", "text"),
        ("code", "text"),
    ];
    let starts = [
        "ALTER TABLE accounts REPLICA IDENTITY DEFAULT",
        "ALTER TABLE accounts REPLICA IDENTITY USING INDEX accounts_email_key;
         CREATE PUBLICATION bloomgate FOR TABLE accounts (id, email)",
    ];
    for mask in 1..(1 << keys.len()) {
        let served: Vec<(&str, &str)> = (0..keys.len())
            .filter(|i| mask & (1 << i) != 0)
            .map(|i| keys[i])
            .collect();
        for start in starts {
            db.exec(
                "DROP PUBLICATION IF EXISTS bloomgate;
                 ALTER TABLE accounts REPLICA IDENTITY DEFAULT;
                 DO $$ DECLARE i text; BEGIN
                     FOR i IN SELECT indexrelid::regclass::text FROM pg_index
                               WHERE indrelid = 'accounts'::regclass
                                 AND indexrelid::regclass::text LIKE '%identity'
                     LOOP EXECUTE 'DROP INDEX ' || i; END LOOP;
                 END $$",
            )
            .await;
            db.exec(start).await;
            let mut text = format!(
                "[database]\nurl = \"{}\"\nfreshness = \"wal\"\ninstall_feed = false\nmigrate = false\n",
                db.url
            );
            for (key, ty) in &served {
                text.push_str(&format!(
                    "[[resource]]\nname = \"by_{key}\"\nroute = \"/by-{key}/{{k}}\"\ntable = \"accounts\"\n\
                     key_column = \"{key}\"\nkey_type = \"{ty}\"\ncolumns = [\"id\", \"{key}\"]\n"
                ));
            }
            let cfg = bloomgate::config::Config::from_toml(&text).unwrap();
            let case = format!("{served:?} from {start:?}");
            let report = bloomgate::preflight::run(&cfg).await;
            let said = report.to_string();
            let missing: Vec<&str> = said.lines().filter(|l| l.starts_with("MISSING")).collect();
            for (i, line) in missing.iter().enumerate() {
                assert!(!missing[..i].contains(line), "{case}: said twice:\n{said}");
            }
            assert!(
                !said.contains(", id, email"),
                "{case}: a column twice:\n{said}"
            );
            if served.iter().any(|(k, _)| *k == "email") {
                assert!(said.contains("(email citext)"), "{case}:\n{said}");
            }
            if !report.passed() {
                assert!(
                    !report.statements().is_empty(),
                    "{case}: nothing to run:\n{said}"
                );
                let mut admin = sqlx::PgConnection::connect(&db.url).await.unwrap();
                for sql in report.statements() {
                    admin
                        .execute(sql.as_str())
                        .await
                        .unwrap_or_else(|e| panic!("{case}: {sql}: {e}\n{said}"));
                }
                admin.close().await.unwrap();
                let again = bloomgate::preflight::run(&cfg).await;
                assert!(
                    again.passed(),
                    "{case}: not passed after one round:\n{said}\n{again}"
                );
            }
            // Only the columns the feed needs reach it, unless the identity
            // must be FULL (a nullable key).
            let published: Vec<String> = sqlx::query_scalar(
                "SELECT unnest(attnames)::text FROM pg_publication_tables
                  WHERE pubname = 'bloomgate' AND tablename = 'accounts'",
            )
            .fetch_all(&db.pool)
            .await
            .unwrap();
            for (key, _) in &served {
                assert!(published.iter().any(|c| c == key), "{case}: {published:?}");
            }
            let full = served.iter().any(|(k, _)| *k == "code");
            assert_eq!(
                published.iter().any(|c| c == "password_hash"),
                full,
                "{case}: {published:?}"
            );
        }
    }
}

/// A prepared transaction nobody commits (or any long transaction holding
/// an xid) blocks `CREATE_REPLICATION_SLOT`, which waits for it to end. A
/// gateway starting meanwhile does not say only "the change feed is
/// starting": `/readyz` names what it waits for, and the gateway starts
/// once it ends. On a server of the test's own (the prepared transaction
/// would hold every other test's slots).
#[tokio::test]
async fn a_prepared_transaction_that_blocks_the_slot_is_named() {
    use common::cluster::{Server, exec};
    let server = Server::primary(&["max_prepared_transactions=5"]);
    let pool = server.create_db("blocked", 5).await;
    let mut holder = pool.acquire().await.unwrap();
    sqlx::raw_sql(
        "BEGIN; UPDATE users SET name = 'held' WHERE id = 1; PREPARE TRANSACTION 'bg_blocker_slot'",
    )
    .execute(&mut *holder)
    .await
    .unwrap();
    let gw = gateway(config(
        &server.url("blocked"),
        "freshness = \"wal\"\ninstall_feed = true",
    ));
    let starting = tokio::spawn({
        let gw = gw.clone();
        async move { gw.start().await }
    });
    eventually("readyz names the prepared transaction", || async {
        let r = get(&gw, "/readyz").await;
        assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
        r.json()["reasons"]["change_feed"]
            .as_str()
            .is_some_and(|w| w.contains("prepared transaction 'bg_blocker_slot'"))
    })
    .await;
    assert!(!starting.is_finished());
    // And a metric says how long, for the alert (BloomgateSlotBlocked).
    let blocked = async || {
        let text = gateway_metrics(&gw).await;
        text.lines()
            .find_map(|l| l.strip_prefix("bloomgate_wal_slot_blocked_seconds "))
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or_else(|| panic!("no slot-blocked gauge in\n{text}"))
    };
    assert!(blocked().await >= 2.0, "blocked since the wait began");
    exec(&pool, "COMMIT PREPARED 'bg_blocker_slot'").await;
    tokio::time::timeout(Duration::from_secs(30), starting)
        .await
        .expect("start-up goes on once the transaction ended")
        .unwrap()
        .unwrap();
    assert_eq!(get(&gw, "/users/1").await.json()["name"], "held");
    assert_eq!(blocked().await, 0.0, "not waiting any more");
    gw.stop();
}

mod events;
