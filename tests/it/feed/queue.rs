//! The `queue` feed's own mechanics (`feed::queue`): which rows a poll
//! delivers, resuming after a lost connection, who may write the change
//! table, pruning, and what start-up says about a missing or mismatched
//! trigger. Everything else about freshness runs on this feed too:
//! `BLOOMGATE_TEST_FRESHNESS=queue` runs tests/it/feed/freshness.rs on it
//! (scripts/test.sh).

use crate::common;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use bloomgate::config::Freshness;
use bloomgate::key::Key;
use common::*;

const QUEUE: &str = "freshness = \"queue\"\ninstall_triggers = true";

async fn wait_for(what: &str, limit: Duration, mut done: impl AsyncFnMut() -> bool) {
    let began = Instant::now();
    while !done().await {
        assert!(began.elapsed() < limit, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Why a gateway on the queue feed that installs nothing cannot start.
async fn start_without_installing(db: &TestDb) -> String {
    gateway(config(
        &db.url,
        "freshness = \"queue\"\ninstall_triggers = false",
    ))
    .start()
    .await
    .unwrap_err()
    .to_string()
}

/// Rows in the change table.
async fn change_rows(db: &TestDb) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM public.bloomgate_changes")
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

/// A transaction that took its id before another, and commits after it,
/// is delivered: the feed reads by snapshot, not by "ids above the last
/// one read", which would have passed it by for good.
#[tokio::test]
async fn a_transaction_that_commits_after_a_younger_one_is_delivered() {
    let db = TestDb::new().await;
    db.seed_users(10).await;
    let gw = started(config(&db.url, QUEUE)).await;
    assert_eq!(gw.freshness(), Some(Freshness::Queue));
    let users = gw.resource("users").unwrap().clone();
    let gen0 = users.generation();

    let mut old = db.pool.begin().await.unwrap();
    insert_user(&mut *old, 500).await;
    // Younger, committed first, and delivered while the older is open.
    insert_user(&db.pool, 501).await;
    fresh(&gw, "/users/501", |r| r.status == StatusCode::OK).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(
        get(&gw, "/users/500").await.status,
        StatusCode::NOT_FOUND,
        "not committed yet"
    );
    old.commit().await.unwrap();
    fresh(&gw, "/users/500", |r| r.status == StatusCode::OK).await;
    assert_eq!(users.generation(), gen0, "through the feed, not a rebuild");
    // A rolled-back transaction's row is never delivered.
    let mut gone = db.pool.begin().await.unwrap();
    insert_user(&mut *gone, 502).await;
    gone.rollback().await.unwrap();
    insert_user(&db.pool, 503).await;
    fresh(&gw, "/users/503", |r| r.status == StatusCode::OK).await;
    assert!(!users.filter_contains(&Key::Int(502)));
}

/// The feed's connection killed while a writer inserts: every key arrives,
/// with no rebuild (the rows waited in the table), and the feed goes on.
#[tokio::test]
async fn a_killed_connection_resumes_without_a_rebuild() {
    let db = TestDb::new().await;
    db.seed_users(100).await;
    let gw = started(config(&db.url, QUEUE)).await;
    let users = gw.resource("users").unwrap().clone();
    let gen0 = users.generation();
    let writer = paced_inserts(&db.pool, 10_000..10_300, Duration::from_millis(2));
    tokio::time::sleep(Duration::from_millis(150)).await;
    let killed: Vec<bool> = sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
          WHERE datname = current_database() AND application_name = $1",
    )
    .bind(bloomgate::feed::queue::APPLICATION_NAME)
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert!(
        !killed.is_empty() && killed.iter().all(|k| *k),
        "the feed's connections: {killed:?}"
    );
    writer.await.unwrap();
    wait_for("every key", Duration::from_secs(10), async || {
        (10_000..10_300).all(|k| users.filter_contains(&Key::Int(k)))
    })
    .await;
    assert_eq!(users.generation(), gen0, "resumed, not rebuilt");
    insert_user(&db.pool, 77_777).await;
    fresh(&gw, "/users/77777", |r| r.status == StatusCode::OK).await;
}

/// Cut off from the database for a while (shorter than half the
/// retention): polls fail and are counted, and once the database is back
/// the changes committed meanwhile arrive without a rebuild.
#[tokio::test]
async fn an_outage_shorter_than_the_retention_loses_nothing() {
    let db = TestDb::new().await;
    db.seed_users(10).await;
    let proxy = Proxy::start().await;
    let gw = started(config(&proxy.url(&db), QUEUE)).await;
    let users = gw.resource("users").unwrap().clone();
    let gen0 = users.generation();
    proxy.cut();
    for id in 600..620 {
        insert_user(&db.pool, id).await;
    }
    let failed = || gw.stats.feed.listener_reconnects.load(Ordering::Relaxed);
    wait_for("a failed poll", Duration::from_secs(10), async || {
        failed() > 0
    })
    .await;
    proxy.restore();
    wait_for(
        "the outage's inserts",
        Duration::from_secs(10),
        async || (600..620).all(|k| users.filter_contains(&Key::Int(k))),
    )
    .await;
    assert_eq!(users.generation(), gen0, "no rebuild");
}

/// Nobody but the table's owner may write the change table, even a role
/// that default privileges grant every new table to; nobody may attach the
/// definer's function to a table of their own; and a writer with no
/// privilege on the change table still gets its changes through (the
/// trigger writes as its definer).
#[tokio::test]
async fn only_the_triggers_write_the_change_table() {
    let db = TestDb::new().await;
    db.seed_users(10).await;
    let role = format!("{}_writer", db.name);
    db.exec(&format!("CREATE ROLE \"{role}\"")).await;
    db.exec(&format!(
        "ALTER DEFAULT PRIVILEGES IN SCHEMA public GRANT ALL ON TABLES TO \"{role}\""
    ))
    .await;
    let gw = started(config(&db.url, QUEUE)).await;
    db.exec(&format!("GRANT INSERT, SELECT ON users TO \"{role}\""))
        .await;
    db.exec(&format!("GRANT CREATE ON SCHEMA public TO \"{role}\""))
        .await;
    let mut conn = db.pool.acquire().await.unwrap();
    sqlx::query(&format!("SET ROLE \"{role}\""))
        .execute(&mut *conn)
        .await
        .unwrap();
    let forged = sqlx::query(
        "INSERT INTO public.bloomgate_changes (payload)
         VALUES ('{\"table\":\"public.users\",\"op\":\"INSERT\",\"new\":{\"id\":\"900\"}}')",
    )
    .execute(&mut *conn)
    .await
    .unwrap_err();
    let code = forged.as_database_error().and_then(|e| e.code());
    assert_eq!(code.as_deref(), Some("42501"), "{forged}");
    // The function on a table of one's own would write as the definer.
    let function: String = sqlx::query_scalar(
        "SELECT p.oid::regprocedure::text FROM pg_proc p WHERE p.proname LIKE 'bloomgate_notify_users_%'",
    )
    .fetch_one(&mut *conn)
    .await
    .unwrap();
    sqlx::query("CREATE TABLE mine (id bigint, email text)")
        .execute(&mut *conn)
        .await
        .unwrap();
    let attach = sqlx::query(&format!(
        "CREATE TRIGGER t AFTER INSERT ON mine FOR EACH ROW EXECUTE FUNCTION {function}"
    ))
    .execute(&mut *conn)
    .await
    .unwrap_err();
    let code = attach.as_database_error().and_then(|e| e.code());
    assert_eq!(code.as_deref(), Some("42501"), "{attach}");
    insert_user(&mut *conn, 700).await;
    sqlx::query("RESET ROLE").execute(&mut *conn).await.unwrap();
    drop(conn);
    fresh(&gw, "/users/700", |r| r.status == StatusCode::OK).await;
    gw.stop();
    // Granted later: a start that does not install refuses, naming the
    // role; installing again revokes it.
    db.exec(&format!(
        "GRANT INSERT ON public.bloomgate_changes TO \"{role}\""
    ))
    .await;
    let e = start_without_installing(&db).await;
    assert!(
        e.contains("other than its owner") && e.contains(&role),
        "{e}"
    );
    started(config(&db.url, QUEUE)).await.stop();
    db.exec(&format!("DROP OWNED BY \"{role}\"; DROP ROLE \"{role}\""))
        .await;
}

/// A connection that hangs (a cut network, a frozen host) delays changes
/// by the statement deadline, no more: the feed drops it, connects again,
/// checks it is the same server and resumes without a rebuild.
#[tokio::test]
async fn a_hung_connection_is_replaced_within_the_deadline() {
    let db = TestDb::new().await;
    db.seed_users(10).await;
    let proxy = Proxy::start().await;
    let gw = started(config(&proxy.url(&db), QUEUE)).await;
    let users = gw.resource("users").unwrap().clone();
    let gen0 = users.generation();
    proxy.freeze();
    insert_user(&db.pool, 650).await;
    let deadline = bloomgate::feed::queue::STATEMENT_DEADLINE;
    wait_for("the insert made while hung", deadline * 3, async || {
        users.filter_contains(&Key::Int(650))
    })
    .await;
    assert!(gw.stats.feed.listener_reconnects.load(Ordering::Relaxed) >= 1);
    assert_eq!(users.generation(), gen0, "resumed, not rebuilt");
}

/// Rows are deleted once a whole retention old, and not while another
/// gateway holds the pruning lock; a gateway cut off for half the
/// retention cannot know what was pruned meanwhile, and rebuilds.
#[tokio::test]
async fn old_rows_are_pruned_and_a_long_outage_rebuilds() {
    let db = TestDb::new().await;
    db.seed_users(10).await;
    // "Another gateway" pruning, for the first 13 s.
    let mut other = db.pool.acquire().await.unwrap();
    sqlx::query("SELECT pg_advisory_lock($1)")
        .bind(bloomgate::feed::queue::PRUNE_LOCK_KEY)
        .execute(&mut *other)
        .await
        .unwrap();
    let proxy = Proxy::start().await;
    let gw = started(config(
        &proxy.url(&db),
        &format!("{QUEUE}\nqueue_retention = \"10s\""),
    ))
    .await;
    insert_user(&db.pool, 800).await;
    fresh(&gw, "/users/800", |r| r.status == StatusCode::OK).await;
    assert!(change_rows(&db).await >= 1);
    // Past the retention and a pruning turn (a tenth of it).
    tokio::time::sleep(Duration::from_secs(13)).await;
    assert!(
        change_rows(&db).await >= 1,
        "pruned while another gateway held the lock"
    );
    sqlx::query("SELECT pg_advisory_unlock($1)")
        .bind(bloomgate::feed::queue::PRUNE_LOCK_KEY)
        .execute(&mut *other)
        .await
        .unwrap();
    drop(other);
    // A younger change: pruning takes the old row and leaves this one (in
    // one statement both would go at once, and the count never be 1).
    insert_user(&db.pool, 803).await;
    let young = Instant::now();
    wait_for("the old row pruned", Duration::from_secs(30), async || {
        change_rows(&db).await == 1
    })
    .await;
    wait_for(
        "the young row pruned",
        Duration::from_secs(30),
        async || change_rows(&db).await == 0,
    )
    .await;
    assert!(
        young.elapsed() >= Duration::from_secs(8),
        "pruned after {:?}, before the retention",
        young.elapsed()
    );

    // A cached row, changed during a long outage, and the change's row
    // pruned (by another gateway, say) before this one could read it.
    assert_eq!(get(&gw, "/users/3").await.json()["name"], "User 3");
    let users = gw.resource("users").unwrap().clone();
    let gen0 = users.generation();
    proxy.cut();
    db.exec("UPDATE users SET name = 'Changed while away' WHERE id = 3")
        .await;
    insert_user(&db.pool, 802).await;
    db.exec("DELETE FROM public.bloomgate_changes").await;
    tokio::time::sleep(Duration::from_secs(6)).await;
    proxy.restore();
    wait_for(
        "a rebuild after the outage",
        Duration::from_secs(20),
        async || users.generation() > gen0,
    )
    .await;
    // The rescan found the insert, and cleared the cache.
    fresh(&gw, "/users/802", |r| r.status == StatusCode::OK).await;
    fresh(&gw, "/users/3", |r| {
        r.json()["name"] == "Changed while away"
    })
    .await;
    insert_user(&db.pool, 801).await;
    fresh(&gw, "/users/801", |r| r.status == StatusCode::OK).await;
}

/// Start-up names what is wrong: no change table (nothing installed), or
/// triggers that notify while the queue is polled.
#[tokio::test]
async fn a_missing_table_or_a_trigger_for_the_other_feed_is_named_and_not_ready() {
    let db = TestDb::new().await;
    db.seed_users(3).await;
    let e = start_without_installing(&db).await;
    assert!(
        e.contains("public.bloomgate_changes") && e.contains("install-triggers"),
        "{e}"
    );
    // Notify triggers installed; then the queue table, but no queue
    // triggers.
    started(config(
        &db.url,
        "freshness = \"notify\"\ninstall_triggers = true",
    ))
    .await
    .stop();
    db.exec(bloomgate::db::triggers::QUEUE_TABLE_SQL).await;
    let (logs, _guard) = capture_logs();
    let gw = started(config(
        &db.url,
        "freshness = \"queue\"\ninstall_triggers = false",
    ))
    .await;
    let text = logs.text();
    assert!(
        text.lines()
            .any(|l| l.contains("delivers to the other feed") && l.contains("public.users")),
        "{text}"
    );
    // Its changes cannot be followed: not ready, and it says why.
    assert!(!gw.is_ready());
    let why = gw.readiness().to_string();
    assert!(why.contains("delivers to the other feed"), "{why}");
    gw.stop();
    // Installing for the queue replaces them: no warning, ready, fresh.
    let (logs, _guard) = capture_logs();
    let gw = started(config(&db.url, QUEUE)).await;
    assert!(!logs.text().contains("other feed"), "{}", logs.text());
    assert!(gw.is_ready(), "{}", gw.readiness());
    insert_user(&db.pool, 42).await;
    fresh(&gw, "/users/42", |r| r.status == StatusCode::OK).await;
}

/// Two gateways with different retentions: the one with the longer
/// retention, cut off while the other prunes changes it had not read,
/// learns it from the pruning mark (its own clock says nothing is lost)
/// and rescans: the pruned insert and update reach it all the same.
#[tokio::test]
async fn a_gateway_whose_unread_changes_were_pruned_rescans() {
    let db = TestDb::new().await;
    db.seed_users(10).await;
    let pruner = started(config(
        &db.url,
        &format!("{QUEUE}\nqueue_retention = \"10s\""),
    ))
    .await;
    let proxy = Proxy::start().await;
    let behind = started(config(
        &proxy.url(&db),
        &format!("{QUEUE}\nqueue_retention = \"1h\""),
    ))
    .await;
    assert_eq!(get(&behind, "/users/3").await.json()["name"], "User 3");
    let users = behind.resource("users").unwrap().clone();
    let gen0 = users.generation();
    proxy.cut();
    db.exec("UPDATE users SET name = 'Changed while cut off' WHERE id = 3")
        .await;
    insert_user(&db.pool, 900).await;
    fresh(&pruner, "/users/900", |r| r.status == StatusCode::OK).await;
    wait_for(
        "the other gateway's pruning",
        Duration::from_secs(30),
        async || change_rows(&db).await == 0,
    )
    .await;
    proxy.restore();
    wait_for("a rescan", Duration::from_secs(20), async || {
        users.generation() > gen0
    })
    .await;
    fresh(&behind, "/users/900", |r| r.status == StatusCode::OK).await;
    fresh(&behind, "/users/3", |r| {
        r.json()["name"] == "Changed while cut off"
    })
    .await;
    pruner.stop();
    behind.stop();
}

/// Drops a database on another server when dropped.
struct DropElsewhere(String, String);
impl Drop for DropElsewhere {
    fn drop(&mut self) {
        let _ = std::process::Command::new("psql")
            .args([
                &format!("{}/postgres", self.0),
                "-qAtc",
                &format!("DROP DATABASE IF EXISTS \"{}\" WITH (FORCE)", self.1),
            ])
            .status();
    }
}

async fn system_identifier(pool: &sqlx::PgPool) -> String {
    sqlx::query_scalar("SELECT system_identifier::text FROM pg_control_system()")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// The database's address starts answering from another server history (a
/// failover, a restore from backup; here another cluster holding a
/// database of the same name, reached through the same proxy). Its
/// transaction ids say nothing about the old snapshot, so the feed must
/// not resume from it: it notices the new `system_identifier` and rescans
/// every table. The row the gateway cached from the old server is served
/// as the new one has it, and a key only the new one has is found.
#[tokio::test]
async fn a_failover_to_another_server_history_rescans() {
    let db = TestDb::new().await;
    db.seed_users(10).await;
    let other = std::env::var("BLOOMGATE_TEST_PRIMARY_URL")
        .expect("run with scripts/test.sh, which starts a second cluster");
    let admin = sqlx::PgPool::connect(&format!("{other}/postgres"))
        .await
        .unwrap();
    assert_ne!(
        system_identifier(&admin).await,
        system_identifier(&db.pool).await,
        "BLOOMGATE_TEST_PRIMARY_URL must be another cluster than the test database's"
    );
    sqlx::query(&format!("CREATE DATABASE \"{}\"", db.name))
        .execute(&admin)
        .await
        .unwrap();
    let _drop = DropElsewhere(other.clone(), db.name.clone());
    // The new server: the same schema, data that differs, and the triggers
    // and change table (installed by a gateway of its own), empty: the
    // differences are in no change row, as after a restore whose rows were
    // pruned, or whose transaction ids all lie below the old snapshot's.
    let elsewhere = format!("{other}/{}", db.name);
    let pool = sqlx::PgPool::connect(&elsewhere).await.unwrap();
    bloomgate::db::MIGRATOR.run(&pool).await.unwrap();
    sqlx::query(
        "INSERT INTO users (id, email, name) SELECT g, 'u' || g || '@example.com', 'Restored ' || g
         FROM generate_series(1, 50) g",
    )
    .execute(&pool)
    .await
    .unwrap();
    started(config(&elsewhere, QUEUE)).await.stop();
    pool.close().await;

    let proxy = Proxy::start().await;
    let gw = started(config(&proxy.url(&db), QUEUE)).await;
    assert_eq!(get(&gw, "/users/3").await.json()["name"], "User 3");
    assert_eq!(get(&gw, "/users/50").await.status, StatusCode::NOT_FOUND);

    let opts: sqlx::postgres::PgConnectOptions = other.parse().unwrap();
    let host = opts.get_host().replace("localhost", "127.0.0.1");
    proxy.retarget(format!("{host}:{}", opts.get_port()).parse().unwrap());
    proxy.cut();
    wait_for("a failed poll", Duration::from_secs(10), async || {
        gw.stats.feed.listener_reconnects.load(Ordering::Relaxed) > 0
    })
    .await;
    proxy.restore();
    fresh(&gw, "/users/3", |r| r.json()["name"] == "Restored 3").await;
    fresh(&gw, "/users/50", |r| r.status == StatusCode::OK).await;
    gw.stop();
}

/// The install itself, from eight connections released at one instant:
/// without serialising, concurrent `CREATE TABLE IF NOT EXISTS` and
/// `CREATE OR REPLACE FUNCTION` fail on the catalog's unique indexes
/// ("duplicate key value", "tuple concurrently updated").
#[tokio::test]
async fn installs_released_at_one_instant_all_succeed() {
    use bloomgate::db::triggers::Sink;
    for round in 0..10 {
        let db = TestDb::new().await;
        let gws: Vec<_> = (0..8).map(|_| gateway(config(&db.url, QUEUE))).collect();
        for g in &gws {
            // A connection ready, so the installs start together.
            let _ = sqlx::query("SELECT 1").execute(g.db.pool()).await.unwrap();
        }
        let table: bloomgate::db::catalog::TableName = "public.users".into();
        let sink = if round % 2 == 0 {
            Sink::Queue
        } else {
            Sink::Notify
        };
        let results = futures_util::future::join_all(
            gws.iter()
                .map(|g| g.db.install_triggers(&table, &["id"], sink)),
        )
        .await;
        for r in &results {
            assert!(r.is_ok(), "round {round}: {results:?}");
        }
    }
}
