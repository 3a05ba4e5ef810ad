//! The `wal` source at the [`Event`] level, without a gateway: exactly
//! what `feed::wal::run` sends for each kind of change, on the
//! `wal_level = logical` throwaway primary that `scripts/test.sh` starts
//! (`ensure_replica_pair`). Each test has its own database.

mod common;

use std::sync::Arc;
use std::time::Duration;

use bloomgate::db::catalog::ColumnType;
use bloomgate::feed::{
    self, Commit, Event, Lsn, Op, Phase, RowChange, Value, Watch, WatchedColumn, WatchedTable,
};
use common::*;
use sqlx::postgres::PgConnectOptions;
use tokio::sync::{mpsc, oneshot, watch};

async fn logical_db() -> TestDb {
    let primary = std::env::var("BLOOMGATE_TEST_PRIMARY_URL")
        .expect("run with scripts/test.sh, which starts a server with wal_level = logical");
    // TestDb creates (and drops) its database on the logical server.
    unsafe { std::env::set_var("BLOOMGATE_TEST_DATABASE_URL", format!("{primary}/postgres")) };
    TestDb::new().await
}

fn watch_of(tables: &[(&str, &str, ColumnType)]) -> Watch {
    Watch {
        tables: tables
            .iter()
            .map(|(t, c, ty)| WatchedTable {
                name: Arc::from(*t),
                columns: vec![WatchedColumn {
                    name: Arc::from(*c),
                    ty: *ty,
                }],
            })
            .collect(),
    }
}

/// A running feed whose "applier" is the test: it acknowledges every
/// commit it reads, as the gateway's applier would.
struct Feed {
    rx: mpsc::Receiver<Event>,
    applied: watch::Sender<Lsn>,
    task: tokio::task::JoinHandle<()>,
}

impl Feed {
    async fn start(db: &TestDb, watch: Watch, publication: &str) -> Feed {
        feed::wal::install(&db.pool, &watch, publication)
            .await
            .unwrap();
        let (tx, rx) = mpsc::channel(1024);
        let (applied, applied_rx) = watch::channel(Lsn::ZERO);
        let (ready_tx, ready) = oneshot::channel();
        let opts = feed::wal::Options {
            connect: db.url.parse::<PgConnectOptions>().unwrap(),
            publication: publication.into(),
            slot: None,
            poll: Duration::from_millis(2),
        };
        let task = tokio::spawn(feed::wal::run(
            opts,
            watch,
            tx,
            applied_rx,
            Arc::new(feed::wal::Stats::default()),
            ready_tx,
        ));
        ready.await.unwrap().expect("the slot is created");
        Feed { rx, applied, task }
    }

    /// The next commit at `Phase::Received`, acknowledging each commit at
    /// `Phase::Visible` as it passes. A Resync here is a failure: nothing
    /// in these tests may lose the slot.
    async fn next_received(&mut self) -> Commit {
        loop {
            let ev = tokio::time::timeout(Duration::from_secs(30), self.rx.recv())
                .await
                .expect("the feed delivers within 30 s")
                .expect("the feed is running");
            match ev {
                Event::Commit(c) if c.phase == Phase::Received => return c,
                Event::Commit(c) => {
                    if let Some(lsn) = c.lsn {
                        self.applied.send_modify(|a| *a = (*a).max(lsn));
                    }
                }
                other => panic!("unexpected {other:?}"),
            }
        }
    }
}

impl Drop for Feed {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn text(v: &str) -> Value {
    Value::Text(v.into())
}

fn key(change: &RowChange, side: &str, column: &str) -> Option<Value> {
    let cols = if side == "new" {
        change.new.as_ref()
    } else {
        change.old.as_ref()
    };
    cols.and_then(|c| c.get(column).cloned())
}

#[tokio::test]
async fn insert_update_with_key_change_delete_truncate_and_rollback_as_events() {
    let db = logical_db().await;
    db.exec("CREATE TABLE things (code text PRIMARY KEY, label text NOT NULL)")
        .await;
    // Outside the watch, but in the publication: its changes must not show.
    db.exec("CREATE TABLE other (id int PRIMARY KEY)").await;
    let mut feed = Feed::start(
        &db,
        watch_of(&[("public.things", "code", ColumnType::Text)]),
        "bloomgate",
    )
    .await;
    db.exec("ALTER PUBLICATION bloomgate ADD TABLE other").await;

    db.exec("INSERT INTO things VALUES ('a', 'A'); INSERT INTO other VALUES (1)")
        .await;
    let c = feed.next_received().await;
    assert!(c.xid.is_some() && c.lsn.is_some() && c.committed_at.is_some());
    assert_eq!(
        c.changes.len(),
        1,
        "only the watched table: {:?}",
        c.changes
    );
    assert_eq!(c.changes[0].op, Op::Insert);
    assert_eq!(&*c.changes[0].table, "public.things");
    assert_eq!(key(&c.changes[0], "new", "code"), Some(text("a")));
    let first_lsn = c.lsn.unwrap();

    // Rolled back: nothing. The next commit the feed sends is the update.
    db.exec("BEGIN; INSERT INTO things VALUES ('ghost', 'G'); ROLLBACK")
        .await;
    db.exec("UPDATE things SET code = 'b' WHERE code = 'a'")
        .await;
    let c = feed.next_received().await;
    assert!(c.lsn.unwrap() > first_lsn, "commit order");
    assert_eq!(c.changes.len(), 1, "{:?}", c.changes);
    assert_eq!(c.changes[0].op, Op::Update);
    assert_eq!(key(&c.changes[0], "old", "code"), Some(text("a")));
    assert_eq!(key(&c.changes[0], "new", "code"), Some(text("b")));

    // A transaction touching only the unwatched table is an empty commit
    // (or none); never a change.
    db.exec("INSERT INTO other VALUES (2)").await;
    db.exec("DELETE FROM things WHERE code = 'b'").await;
    let c = loop {
        let c = feed.next_received().await;
        if !c.changes.is_empty() {
            break c;
        }
        assert!(c.truncated.is_empty());
    };
    assert_eq!(c.changes.len(), 1);
    assert_eq!(c.changes[0].op, Op::Delete);
    assert_eq!(key(&c.changes[0], "old", "code"), Some(text("b")));
    assert!(c.changes[0].new.is_none());

    db.exec("INSERT INTO things VALUES ('c', 'C')").await;
    let _ = feed.next_received().await;
    db.exec("TRUNCATE things").await;
    let c = feed.next_received().await;
    assert!(c.changes.is_empty());
    assert_eq!(c.truncated, vec![Arc::<str>::from("public.things")]);
}

/// A key column outside the replica identity, stored out of line (TOAST):
/// an UPDATE that leaves it alone does not carry it, and the feed must say
/// `Value::Unknown` rather than invent a value.
#[tokio::test]
async fn an_unchanged_toasted_key_outside_the_replica_identity_is_unknown() {
    let db = logical_db().await;
    db.exec(
        "CREATE TABLE docs (id int PRIMARY KEY, code text NOT NULL, body text NOT NULL);
         ALTER TABLE docs ALTER COLUMN code SET STORAGE EXTERNAL",
    )
    .await;
    let mut feed = Feed::start(
        &db,
        watch_of(&[("public.docs", "code", ColumnType::Text)]),
        "bloomgate",
    )
    .await;
    // EXTERNAL storage, no compression: 10 kB is stored out of line.
    let long = "k".repeat(10_000);
    sqlx::query("INSERT INTO docs VALUES (1, $1, 'x')")
        .bind(&long)
        .execute(&db.pool)
        .await
        .unwrap();
    let c = feed.next_received().await;
    assert_eq!(key(&c.changes[0], "new", "code"), Some(text(&long)));

    db.exec("UPDATE docs SET body = 'y' WHERE id = 1").await;
    let c = feed.next_received().await;
    assert_eq!(c.changes.len(), 1);
    assert_eq!(c.changes[0].op, Op::Update);
    assert_eq!(key(&c.changes[0], "new", "code"), Some(Value::Unknown));
    // The identity (id) did not change: no old tuple.
    assert!(c.changes[0].old.is_none());

    // A DELETE's old tuple carries only the identity: the key is unknown.
    db.exec("DELETE FROM docs WHERE id = 1").await;
    let c = feed.next_received().await;
    assert_eq!(c.changes[0].op, Op::Delete);
    assert_eq!(key(&c.changes[0], "old", "code"), Some(Value::Unknown));
}

/// 100,000 rows in one transaction arrive as one commit, every key once.
#[tokio::test]
async fn a_hundred_thousand_row_transaction_is_one_commit() {
    let db = logical_db().await;
    db.exec("CREATE TABLE nums (n bigint PRIMARY KEY)").await;
    let mut feed = Feed::start(
        &db,
        watch_of(&[("public.nums", "n", ColumnType::Int8)]),
        "bloomgate",
    )
    .await;
    db.exec("INSERT INTO nums SELECT generate_series(1, 100000)")
        .await;
    let c = feed.next_received().await;
    assert_eq!(c.changes.len(), 100_000);
    let mut seen = vec![false; 100_001];
    for ch in &c.changes {
        let Some(Value::Text(t)) = key(ch, "new", "n") else {
            panic!("{ch:?}")
        };
        let n: usize = t.parse().unwrap();
        assert!(!seen[n], "{n} twice");
        seen[n] = true;
    }
    assert!(seen[1..].iter().all(|s| *s));
}

/// The Visible phase waits for a committed transaction to be visible to
/// new snapshots. A transaction still running is not visible, also when it
/// is the newest one (its xid at or past the snapshot's xmax, so absent
/// from the snapshot's list of running xids).
#[tokio::test]
async fn a_running_transaction_is_not_visible_even_the_newest() {
    let db = logical_db().await;
    let mut open = db.pool.acquire().await.unwrap();
    sqlx::query("BEGIN").execute(&mut *open).await.unwrap();
    let xid: i64 = sqlx::query_scalar("SELECT pg_current_xact_id()::text::int8 % 4294967296")
        .fetch_one(&mut *open)
        .await
        .unwrap();
    let mut probe = db.pool.acquire().await.unwrap();
    assert!(
        !feed::wal::all_visible(&mut probe, &[xid as u32])
            .await
            .unwrap(),
        "a running transaction reported visible"
    );
    sqlx::query("COMMIT").execute(&mut *open).await.unwrap();
    assert!(
        feed::wal::all_visible(&mut probe, &[xid as u32])
            .await
            .unwrap()
    );
}
