//! The `queue` feed's own mechanics (`feed::queue`): which rows a poll
//! delivers, resuming after a lost connection, who may write the change
//! table, pruning, and what start-up says about a missing or mismatched
//! trigger. Everything else about freshness runs on this feed too:
//! `BLOOMGATE_TEST_FRESHNESS=queue` runs tests/freshness.rs on it
//! (scripts/test.sh).

mod common;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use bloomgate::gateway::{FeedMode, Gateway};
use bloomgate::key::Key;
use common::*;

const QUEUE: &str = "freshness = \"queue\"\ninstall_triggers = true";

async fn eventually(gw: &Arc<Gateway>, path: &str, done: impl Fn(&Resp) -> bool) {
    let began = Instant::now();
    loop {
        let r = get(gw, path).await;
        if done(&r) {
            return;
        }
        assert!(
            began.elapsed() < Duration::from_secs(10),
            "{path} never became fresh: last {:?}",
            r.status
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

async fn wait_for(what: &str, limit: Duration, mut done: impl AsyncFnMut() -> bool) {
    let began = Instant::now();
    while !done().await {
        assert!(began.elapsed() < limit, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn insert_user<'e>(on: impl sqlx::PgExecutor<'e>, id: i64) {
    sqlx::query("INSERT INTO users (id, email, name) VALUES ($1, 'q' || $1, 'Q ' || $1)")
        .bind(id)
        .execute(on)
        .await
        .unwrap();
}

/// A transaction that took its id before another, and commits after it,
/// is delivered: the feed reads by snapshot, not by "ids above the last
/// one read", which would have passed it by for good.
#[tokio::test]
async fn a_transaction_that_commits_after_a_younger_one_is_delivered() {
    let db = TestDb::new().await;
    db.seed_users(10).await;
    let gw = started(config(&db.url, QUEUE)).await;
    assert_eq!(gw.feed_mode(), Some(FeedMode::Queue));
    let users = gw.resource("users").unwrap().clone();
    let gen0 = users.generation();

    let mut old = db.pool.begin().await.unwrap();
    insert_user(&mut *old, 500).await;
    // Younger, committed first, and delivered while the older is open.
    insert_user(&db.pool, 501).await;
    eventually(&gw, "/users/501", |r| r.status == StatusCode::OK).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(
        get(&gw, "/users/500").await.status,
        StatusCode::NOT_FOUND,
        "not committed yet"
    );
    old.commit().await.unwrap();
    eventually(&gw, "/users/500", |r| r.status == StatusCode::OK).await;
    assert_eq!(users.generation(), gen0, "through the feed, not a rebuild");
    // A rolled-back transaction's row is never delivered.
    let mut gone = db.pool.begin().await.unwrap();
    insert_user(&mut *gone, 502).await;
    gone.rollback().await.unwrap();
    insert_user(&db.pool, 503).await;
    eventually(&gw, "/users/503", |r| r.status == StatusCode::OK).await;
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
    let writer = tokio::spawn({
        let pool = db.pool.clone();
        async move {
            for id in 10_000..10_300i64 {
                insert_user(&pool, id).await;
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
    });
    tokio::time::sleep(Duration::from_millis(150)).await;
    let killed: Vec<bool> = sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
          WHERE datname = current_database() AND application_name = $1",
    )
    .bind(bloomgate::feed::queue::APPLICATION_NAME)
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(killed, vec![true], "exactly one feed connection");
    writer.await.unwrap();
    wait_for("every key", Duration::from_secs(10), async || {
        (10_000..10_300).all(|k| users.filter_contains(&Key::Int(k)))
    })
    .await;
    assert_eq!(users.generation(), gen0, "resumed, not rebuilt");
    insert_user(&db.pool, 77_777).await;
    eventually(&gw, "/users/77777", |r| r.status == StatusCode::OK).await;
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
    let failed = || gw.stats.listener_reconnects.load(Ordering::Relaxed);
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

/// Nobody but the table's owner may write the change table, and a writer
/// with no privilege on it still gets its changes through (the trigger
/// writes as its definer).
#[tokio::test]
async fn only_the_triggers_write_the_change_table() {
    let db = TestDb::new().await;
    db.seed_users(10).await;
    let gw = started(config(&db.url, QUEUE)).await;
    let role = format!("{}_writer", db.name);
    db.exec(&format!("CREATE ROLE \"{role}\"")).await;
    db.exec(&format!("GRANT INSERT, SELECT ON users TO \"{role}\""))
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
    insert_user(&mut *conn, 700).await;
    sqlx::query("RESET ROLE").execute(&mut *conn).await.unwrap();
    drop(conn);
    eventually(&gw, "/users/700", |r| r.status == StatusCode::OK).await;
    gw.stop();
    db.exec(&format!("DROP OWNED BY \"{role}\"; DROP ROLE \"{role}\""))
        .await;
}

/// Rows are deleted once a whole retention old; a gateway cut off for half
/// the retention cannot know what was pruned meanwhile, and rebuilds.
#[tokio::test]
async fn old_rows_are_pruned_and_a_long_outage_rebuilds() {
    let db = TestDb::new().await;
    db.seed_users(10).await;
    let proxy = Proxy::start().await;
    let gw = started(config(
        &proxy.url(&db),
        &format!("{QUEUE}\nqueue_retention = \"10s\""),
    ))
    .await;
    insert_user(&db.pool, 800).await;
    eventually(&gw, "/users/800", |r| r.status == StatusCode::OK).await;
    let rows = async || -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM public.bloomgate_changes")
            .fetch_one(&db.pool)
            .await
            .unwrap()
    };
    assert!(rows().await >= 1);
    let began = Instant::now();
    wait_for("pruning", Duration::from_secs(30), async || {
        rows().await == 0
    })
    .await;
    assert!(
        began.elapsed() >= Duration::from_secs(8),
        "pruned after {:?}, before the retention",
        began.elapsed()
    );

    let users = gw.resource("users").unwrap().clone();
    let gen0 = users.generation();
    proxy.cut();
    tokio::time::sleep(Duration::from_secs(6)).await;
    proxy.restore();
    wait_for(
        "a rebuild after the outage",
        Duration::from_secs(20),
        async || users.generation() > gen0,
    )
    .await;
    insert_user(&db.pool, 801).await;
    eventually(&gw, "/users/801", |r| r.status == StatusCode::OK).await;
}

/// Start-up names what is wrong: no change table (nothing installed), or
/// triggers that notify while the queue is polled.
#[tokio::test]
async fn a_missing_table_or_a_trigger_for_the_other_feed_is_named_at_start_up() {
    let db = TestDb::new().await;
    db.seed_users(3).await;
    let e = gateway(config(
        &db.url,
        "freshness = \"queue\"\ninstall_triggers = false",
    ))
    .start()
    .await
    .unwrap_err()
    .to_string();
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
            .any(|l| l.contains("delivers changes to the other feed") && l.contains("public.users")),
        "{text}"
    );
    gw.stop();
    // Installing for the queue replaces them: no warning, and fresh.
    let (logs, _guard) = capture_logs();
    let gw = started(config(&db.url, QUEUE)).await;
    assert!(!logs.text().contains("other feed"), "{}", logs.text());
    insert_user(&db.pool, 42).await;
    eventually(&gw, "/users/42", |r| r.status == StatusCode::OK).await;
}
