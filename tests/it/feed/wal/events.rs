//! The `wal` source at the [`Event`] level, without a gateway: exactly
//! what `feed::wal::run` sends for each kind of change, on the
//! `wal_level = logical` throwaway primary that `scripts/test.sh` starts
//! (`ensure_replica_pair`). Each test has its own database.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use bloomgate::db::catalog::ColumnType;
use bloomgate::feed::{
    self, Commit, Event, Lsn, Op, Phase, RowChange, Value, Watch, WatchedColumn, WatchedTable,
};
use common::*;
use sqlx::postgres::PgConnectOptions;
use tokio::sync::{mpsc, oneshot, watch};

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
                keys: Vec::new(),
                served: Vec::new(),
            })
            .collect(),
    }
}

/// A running feed whose "applier" is the test: it acknowledges every
/// commit it reads, as the gateway's applier would.
struct Feed {
    rx: mpsc::Receiver<Event>,
    applied: watch::Sender<feed::Position>,
    task: tokio::task::JoinHandle<()>,
}

impl Feed {
    async fn start(db: &TestDb, watch: Watch, publication: &str) -> Feed {
        Feed::start_with(db, watch, publication, None).await
    }

    /// `poll`: the polled feed (`database.wal_poll_interval`).
    async fn start_with(
        db: &TestDb,
        watch: Watch,
        publication: &str,
        poll: Option<Duration>,
    ) -> Feed {
        Feed::start_full(
            db,
            &db.url,
            watch,
            publication,
            poll,
            feed::wal::SILENCE_LIMIT,
        )
        .await
    }

    /// `url`: where the feed connects (a [`Proxy`]'s, say).
    async fn start_full(
        db: &TestDb,
        url: &str,
        watch: Watch,
        publication: &str,
        poll: Option<Duration>,
        silence_limit: Duration,
    ) -> Feed {
        // A test may have made the publication itself (for a table whose
        // identity `install` refuses).
        let made: bool =
            sqlx::query_scalar("SELECT EXISTS (SELECT FROM pg_publication WHERE pubname = $1)")
                .bind(publication)
                .fetch_one(&db.pool)
                .await
                .unwrap();
        if !made {
            let mut conn = db.pool.acquire().await.unwrap();
            bloomgate::db::publication::install(&mut conn, &watch, publication)
                .await
                .unwrap();
        }
        let (tx, rx) = mpsc::channel(1024);
        let (applied, applied_rx) = watch::channel(feed::Position::ZERO);
        let (ready_tx, ready) = oneshot::channel();
        let opts = feed::wal::WalOptions {
            connect: url.parse::<PgConnectOptions>().unwrap(),
            publication: publication.into(),
            slot: None,
            password: None,
            poll,
            silence_limit,
            install: false,
            start_position: None,
            start_server: None,
            idle_confirm_applied: false,
            broken_slot: Default::default(),
            identity: None,
        };
        let task = tokio::spawn(feed::wal::run(
            opts,
            watch,
            tx,
            applied_rx,
            Arc::new(feed::wal::Stats::default()),
            Arc::new(feed::Health::default()),
            ready_tx,
            bloomgate::shutdown::Shutdown::never(),
        ));
        ready.await.unwrap().expect("the slot is created");
        Feed { rx, applied, task }
    }

    /// The next commit at `Phase::Received`, acknowledging each commit at
    /// `Phase::Visible` as it passes and skipping heartbeats. A Resync here
    /// is a failure: nothing in these tests may lose the slot.
    async fn next_received(&mut self) -> Commit {
        loop {
            let ev = tokio::time::timeout(Duration::from_secs(30), self.rx.recv())
                .await
                .expect("the feed delivers within 30 s")
                .expect("the feed is running");
            match ev {
                Event::Commit(c) if c.phase == Phase::Received => return c,
                Event::Commit(c) => {
                    if let Some(p) = c.position {
                        self.applied.send_modify(|a| {
                            a.advance(p);
                        });
                    }
                }
                Event::Heartbeat(_) => {}
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
    every_kind_of_change(None).await;
}

#[tokio::test]
async fn the_polled_feed_sends_the_same_events() {
    every_kind_of_change(Some(Duration::from_millis(5))).await;
}

async fn every_kind_of_change(poll: Option<Duration>) {
    let db = logical_db(0).await;
    db.exec("CREATE TABLE things (code text PRIMARY KEY, label text NOT NULL)")
        .await;
    // Outside the watch, but in the publication: its changes must not show.
    db.exec("CREATE TABLE other (id int PRIMARY KEY)").await;
    let mut feed = Feed::start_with(
        &db,
        watch_of(&[("public.things", "code", ColumnType::Text)]),
        "bloomgate",
        poll,
    )
    .await;
    db.exec("ALTER PUBLICATION bloomgate ADD TABLE other").await;

    db.exec("INSERT INTO things VALUES ('a', 'A'); INSERT INTO other VALUES (1)")
        .await;
    let c = feed.next_received().await;
    assert!(c.xid.is_some() && c.position.is_some() && c.committed_at.is_some());
    assert_eq!(
        c.changes.len(),
        1,
        "only the watched table: {:?}",
        c.changes
    );
    assert_eq!(c.changes[0].op, Op::Insert);
    assert_eq!(&*c.changes[0].table, "public.things");
    assert_eq!(key(&c.changes[0], "new", "code"), Some(text("a")));
    let first_lsn = c.position.unwrap().lsn;

    // Rolled back: nothing. The next commit the feed sends is the update.
    db.exec("BEGIN; INSERT INTO things VALUES ('ghost', 'G'); ROLLBACK")
        .await;
    db.exec("UPDATE things SET code = 'b' WHERE code = 'a'")
        .await;
    let c = feed.next_received().await;
    assert!(c.position.unwrap().lsn > first_lsn, "commit order");
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
    let db = logical_db(0).await;
    // `install` refuses such a table (its identity does not carry the key):
    // the publication is made by hand, as a DBA could.
    db.exec(
        "CREATE TABLE docs (id int PRIMARY KEY, code text NOT NULL, body text NOT NULL);
         ALTER TABLE docs ALTER COLUMN code SET STORAGE EXTERNAL;
         CREATE PUBLICATION bloomgate FOR TABLE docs",
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
    // The identity (id) did not change: no old tuple was sent, and the key,
    // outside the identity, is not said to be unchanged.
    assert_eq!(key(&c.changes[0], "old", "code"), Some(Value::Unknown));

    // A DELETE's old tuple carries only the identity: the key is unknown.
    db.exec("DELETE FROM docs WHERE id = 1").await;
    let c = feed.next_received().await;
    assert_eq!(c.changes[0].op, Op::Delete);
    assert_eq!(key(&c.changes[0], "old", "code"), Some(Value::Unknown));
}

/// Under `REPLICA IDENTITY FULL` an UPDATE of another column sends the
/// unchanged, TOASTed key as "unchanged" in the new row, while the old row
/// carries it whole. Read as unknown, every such update would clear the
/// resource's cache and ask for a rebuild; the key is the old row's.
#[tokio::test]
async fn an_unchanged_toasted_key_under_full_identity_is_the_old_rows() {
    let db = logical_db(0).await;
    db.exec(
        "CREATE TABLE notes (code text NOT NULL, body text NOT NULL);
         ALTER TABLE notes ALTER COLUMN code SET STORAGE EXTERNAL;
         ALTER TABLE notes REPLICA IDENTITY FULL",
    )
    .await;
    let mut feed = Feed::start(
        &db,
        watch_of(&[("public.notes", "code", ColumnType::Text)]),
        "bloomgate",
    )
    .await;
    let long = "n".repeat(10_000);
    sqlx::query("INSERT INTO notes VALUES ($1, 'x')")
        .bind(&long)
        .execute(&db.pool)
        .await
        .unwrap();
    feed.next_received().await;
    db.exec("UPDATE notes SET body = 'y'").await;
    let c = feed.next_received().await;
    assert_eq!(c.changes[0].op, Op::Update);
    // Compared, not printed: the key is 10 kB.
    assert!(key(&c.changes[0], "old", "code") == Some(text(&long)));
    assert!(
        key(&c.changes[0], "new", "code") == Some(text(&long)),
        "an unchanged key read as {}",
        match key(&c.changes[0], "new", "code") {
            Some(Value::Text(_)) => "another text",
            _ => "unknown",
        }
    );
}

/// 100,000 rows in one transaction arrive as one commit, every key once;
/// polled, the same (one poll returns ten times its row limit, and the
/// slot moves only to that commit's end), and the commit after it too.
#[tokio::test]
async fn a_hundred_thousand_row_transaction_is_one_commit() {
    hundred_thousand_rows(None).await;
}

#[tokio::test]
async fn a_hundred_thousand_row_transaction_is_one_commit_polled() {
    hundred_thousand_rows(Some(Duration::from_millis(5))).await;
}

async fn hundred_thousand_rows(poll: Option<Duration>) {
    let db = logical_db(0).await;
    db.exec("CREATE TABLE nums (n bigint PRIMARY KEY)").await;
    let mut feed = Feed::start_with(
        &db,
        watch_of(&[("public.nums", "n", ColumnType::Int8)]),
        "bloomgate",
        poll,
    )
    .await;
    db.exec("INSERT INTO nums SELECT generate_series(1, 100000)")
        .await;
    db.exec("INSERT INTO nums VALUES (0)").await;
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
    let c = feed.next_received().await;
    assert_eq!(c.changes.len(), 1);
    assert_eq!(key(&c.changes[0], "new", "n"), Some(text("0")));
}

/// Writes to tables outside the publication produce no change to deliver,
/// yet the slot's confirmed position must follow the end of the WAL, or
/// the slot holds WAL back (and, polled, every poll decodes more of it).
#[tokio::test]
async fn a_quiet_publication_does_not_hold_wal_back() {
    for poll in [None, Some(Duration::from_millis(5))] {
        let db = logical_db(0).await;
        db.exec("CREATE TABLE watched (n bigint PRIMARY KEY); CREATE TABLE busy (n bigint)")
            .await;
        let _feed = Feed::start_with(
            &db,
            watch_of(&[("public.watched", "n", ColumnType::Int8)]),
            "bloomgate",
            poll,
        )
        .await;
        db.exec("INSERT INTO busy SELECT generate_series(1, 20000)")
            .await;
        let end: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
            .fetch_one(&db.pool)
            .await
            .unwrap();
        let began = std::time::Instant::now();
        loop {
            // Each test has its own database: the slot is this feed's.
            let past: Option<bool> = sqlx::query_scalar(
                "SELECT confirmed_flush_lsn >= $1::pg_lsn FROM pg_replication_slots
                  WHERE database = current_database()",
            )
            .bind(&end)
            .fetch_optional(&db.pool)
            .await
            .unwrap()
            .flatten();
            if past == Some(true) {
                break;
            }
            assert!(
                began.elapsed() < Duration::from_secs(30),
                "poll {poll:?}: the slot stays behind {end}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Protocol 2's streaming: with `logical_decoding_work_mem` at its minimum
/// (set on this test's database, which the walsender reads), a large
/// transaction comes in blocks while it runs. It is delivered once, at its
/// commit, without the rows of a subtransaction rolled back inside it; a
/// streamed transaction that aborts is never delivered. The server's
/// `pg_stat_replication_slots.stream_txns` proves the streaming happened.
#[tokio::test]
async fn a_streamed_transaction_is_delivered_at_commit_without_its_aborts() {
    let db = logical_db(0).await;
    db.exec(&format!(
        "ALTER DATABASE {} SET logical_decoding_work_mem = '64kB'",
        db.name
    ))
    .await;
    db.exec("CREATE TABLE nums (n bigint PRIMARY KEY, pad text)")
        .await;
    let mut feed = Feed::start(
        &db,
        watch_of(&[("public.nums", "n", ColumnType::Int8)]),
        "bloomgate",
    )
    .await;
    // Aborted, and large enough to be streamed first.
    let mut c = db.pool.acquire().await.unwrap();
    sqlx::raw_sql(
        "BEGIN;
         INSERT INTO nums SELECT g, repeat('x', 100) FROM generate_series(100001, 105000) g;
         ROLLBACK;",
    )
    .execute(&mut *c)
    .await
    .unwrap();
    // Committed, with a rolled-back subtransaction in the middle.
    sqlx::raw_sql(
        "BEGIN;
         INSERT INTO nums SELECT g, repeat('x', 100) FROM generate_series(1, 5000) g;
         SAVEPOINT s;
         INSERT INTO nums SELECT g, repeat('x', 100) FROM generate_series(200001, 205000) g;
         ROLLBACK TO SAVEPOINT s;
         INSERT INTO nums SELECT g, repeat('x', 100) FROM generate_series(5001, 6000) g;
         COMMIT;",
    )
    .execute(&mut *c)
    .await
    .unwrap();
    let got = feed.next_received().await;
    let mut keys: Vec<i64> = got
        .changes
        .iter()
        .map(|ch| match key(ch, "new", "n") {
            Some(Value::Text(t)) => t.parse().unwrap(),
            other => panic!("{other:?}"),
        })
        .collect();
    keys.sort_unstable();
    assert_eq!(keys, (1..=6000).collect::<Vec<i64>>());
    let mut streamed = 0i64;
    for _ in 0..500 {
        streamed = sqlx::query_scalar(
            "SELECT coalesce(sum(stream_txns), 0)::int8 FROM pg_stat_replication_slots s
               JOIN pg_replication_slots r USING (slot_name) WHERE r.database = current_database()",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap();
        if streamed >= 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(streamed >= 2, "the server streamed {streamed} transactions");
}

/// A server that stops talking (the connections open at that moment frozen
/// in a proxy: a hung host or a cut network looks so, and TCP alone would
/// take many minutes to say it) is given up after the silence limit: the
/// feed reconnects at once on a new temporary slot (the server's old
/// walsender, not yet aware, still holds the old one), asks for a rebuild
/// (changes may have been missed meanwhile), and delivers what commits
/// next. Polled, the poll gives up after ten silence limits.
#[tokio::test]
async fn a_silent_server_is_given_up_and_the_feed_reconnects() {
    let silence = Duration::from_secs(3);
    silent_server(None, silence, silence).await;
}

#[tokio::test]
async fn a_silent_server_is_given_up_and_the_polled_feed_reconnects() {
    // A poll gives up after ten silence limits.
    let silence = Duration::from_secs(2);
    silent_server(Some(Duration::from_millis(5)), silence, silence * 10).await;
}

/// `gives_up`: how long the feed must wait before it gives up (the
/// silence limit, or a poll's time-out).
async fn silent_server(poll: Option<Duration>, silence: Duration, gives_up: Duration) {
    let db = logical_db(0).await;
    db.exec("CREATE TABLE nums (n bigint PRIMARY KEY)").await;
    let proxy = Proxy::start_for(&db).await;
    let mut feed = Feed::start_full(
        &db,
        &proxy.url(&db),
        watch_of(&[("public.nums", "n", ColumnType::Int8)]),
        "bloomgate",
        poll,
        silence,
    )
    .await;
    db.exec("INSERT INTO nums VALUES (1)").await;
    let first = feed.next_received().await;
    assert_eq!(first.changes.len(), 1);
    // Its Visible delivery, acknowledged: the feed is done with it and back
    // to waiting for the server when the freeze comes.
    loop {
        match feed.rx.recv().await.expect("the feed is running") {
            Event::Commit(c) if c.phase == Phase::Visible && c.position == first.position => break,
            Event::Heartbeat(_) => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    feed.applied.send_modify(|a| {
        a.advance(first.position.unwrap());
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    proxy.freeze();
    let began = std::time::Instant::now();
    // Frozen, nothing reaches the feed (not even this insert); the next
    // event must be the resync of a new session.
    db.exec("INSERT INTO nums VALUES (2)").await;
    loop {
        // Generous: creating the new slot waits for every transaction
        // running in the cluster to end (other tests hold some open) and
        // then for a running-transactions record.
        let ev = tokio::time::timeout(Duration::from_secs(120), feed.rx.recv())
            .await
            .expect("the feed gives up on a silent server and reconnects within 120 s")
            .expect("the feed is running");
        match ev {
            Event::Resync(_) => break,
            Event::Commit(c) => {
                let keys: Vec<_> = c.changes.iter().map(|ch| key(ch, "new", "n")).collect();
                assert!(
                    keys.is_empty() || keys == [Some(text("1"))],
                    "a frozen connection passed {keys:?}"
                );
                if let Some(p) = c.position {
                    feed.applied.send_modify(|a| {
                        a.advance(p);
                    });
                }
            }
            Event::Heartbeat(_) | Event::Interrupted(_) => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    // Counted from the last word heard, which came a little before the
    // freeze: a third of slack.
    assert!(
        began.elapsed() >= gives_up * 2 / 3,
        "the feed gave up after {:?}, well before {gives_up:?}",
        began.elapsed()
    );
    db.exec("INSERT INTO nums VALUES (3)").await;
    let c = feed.next_received().await;
    assert_eq!(key(&c.changes[0], "new", "n"), Some(text("3")));
    proxy.cut();
}

/// The Visible phase waits for a committed transaction to be visible to
/// new snapshots. A transaction still running is not visible, also when it
/// is the newest one (its xid at or past the snapshot's xmax, so absent
/// from the snapshot's list of running xids).
#[tokio::test]
async fn a_running_transaction_is_not_visible_even_the_newest() {
    let db = logical_db(0).await;
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

/// The replication client (`feed::wal::replication`) against a real server:
/// each password method `scripts/pg.sh` configures for its three roles
/// (SCRAM-SHA-256, MD5, cleartext) admits the right password and refuses a
/// wrong or missing one without echoing it; then, as the superuser, a
/// temporary slot streams a committed insert and the server takes the
/// acknowledged position as the slot's confirmed one.
#[tokio::test]
async fn the_replication_client_authenticates_and_streams() {
    use bloomgate::feed::wal::pgoutput::{self, Message};
    use bloomgate::feed::wal::replication::{Connection, Endpoint, Frame, ReplError};

    let db = logical_db(0).await;
    let opts: PgConnectOptions = db.url.parse().unwrap();
    let endpoint = |user: &str, password: Option<&str>| Endpoint {
        host: opts.get_host().to_owned(),
        port: opts.get_port(),
        socket: None,
        user: user.to_owned(),
        password: password.map(str::to_owned),
        database: db.name.clone(),
        application_name: "bloomgate-test".into(),
    };
    let password = "pässwörd 1'\"";
    let mut admin = db.pool.acquire().await.unwrap();
    for (role, method, stored) in [
        ("bloomgate_scram", "scram-sha-256", "scram-sha-256"),
        ("bloomgate_md5", "md5", "md5"),
        ("bloomgate_clear", "password", "scram-sha-256"),
    ] {
        let rule: Option<String> = sqlx::query_scalar(
            "SELECT auth_method FROM pg_hba_file_rules WHERE $1 = ANY(user_name) LIMIT 1",
        )
        .bind(role)
        .fetch_optional(&mut *admin)
        .await
        .unwrap();
        assert_eq!(
            rule.as_deref(),
            Some(method),
            "the logical server lacks scripts/pg.sh's pg_hba line for {role}: run scripts/test.sh"
        );
        sqlx::raw_sql(&format!(
            "DO $$ BEGIN CREATE ROLE {role} LOGIN REPLICATION; EXCEPTION WHEN duplicate_object THEN NULL; END $$;
             SET password_encryption = '{stored}';
             ALTER ROLE {role} PASSWORD '{}';
             RESET password_encryption;",
            password.replace('\'', "''")
        ))
        .execute(&mut *admin)
        .await
        .unwrap();

        let mut c = Connection::connect(&endpoint(role, Some(password)))
            .await
            .unwrap_or_else(|e| panic!("{method}: {e}"));
        let rows = c.simple_query("IDENTIFY_SYSTEM").await.unwrap();
        assert_eq!(rows.len(), 1, "{method}");
        assert!(
            rows[0][2].as_deref().and_then(Lsn::parse).is_some(),
            "{method}: {rows:?}"
        );

        let wrong = "not the password";
        match Connection::connect(&endpoint(role, Some(wrong))).await {
            Err(e @ ReplError::Server { .. }) => {
                let text = e.to_string();
                assert!(text.contains("28P01"), "{method}: {text}");
                assert!(!text.contains(wrong) && !text.contains(password), "{text}");
            }
            Err(e) => panic!("{method}: wrong password refused oddly: {e}"),
            Ok(_) => panic!("{method}: a wrong password was accepted"),
        }
        assert!(
            matches!(
                Connection::connect(&endpoint(role, None)).await,
                Err(ReplError::Auth(_))
            ),
            "{method}: no password"
        );
    }
    drop(admin);

    // No password in the URL or the environment: the password file's, as
    // libpq and sqlx read it (its line escapes `:` and `\\`).
    let dir = std::env::temp_dir().join(format!("bloomgate-pgpass-{}", db.name));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("pgpass");
    let escaped = password.replace('\\', "\\\\").replace(':', "\\:");
    std::fs::write(
        &file,
        format!(
            "# the first line that matches wins\nelsewhere:*:*:*:wrong\n{}:{}:{}:bloomgate_scram:{escaped}\n*:*:*:bloomgate_scram:wrong\n",
            opts.get_host(),
            opts.get_port(),
            db.name
        ),
    )
    .unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    // Looked up as `Endpoint::new` looks it up (without setting
    // `PGPASSFILE`: other tests run in this process).
    let found = bloomgate::feed::wal::replication::pgpass::lookup_in(
        &file,
        opts.get_host(),
        opts.get_port(),
        opts.get_database(),
        "bloomgate_scram",
    );
    assert_eq!(found.as_deref(), Some(password), "the password file's line");
    let via_file = Endpoint::new(
        &opts.clone().username("bloomgate_scram"),
        found,
        "bloomgate-test",
    );
    std::fs::remove_dir_all(&dir).unwrap();
    let mut c = Connection::connect(&via_file)
        .await
        .unwrap_or_else(|e| panic!("with the password file: {e}"));
    assert_eq!(c.simple_query("IDENTIFY_SYSTEM").await.unwrap().len(), 1);
    drop(c);

    db.exec("CREATE TABLE t (id int PRIMARY KEY)").await;
    db.exec("CREATE PUBLICATION p FOR TABLE t").await;
    let mut c = Connection::connect(&endpoint("postgres", None))
        .await
        .unwrap();
    let slot = format!("bloomgate_test_{}", std::process::id());
    c.create_slot(&slot, true).await.unwrap();
    let mut stream = c
        .start(
            &slot,
            Lsn::ZERO,
            &[("proto_version", "1"), ("publication_names", "\"p\"")],
        )
        .await
        .unwrap();
    db.exec("INSERT INTO t VALUES (42)").await;
    let mut inserted = false;
    let end = loop {
        let frame = tokio::time::timeout(Duration::from_secs(30), stream.recv())
            .await
            .expect("the insert is streamed within 30 s")
            .unwrap();
        if let Frame::XLogData { data, .. } = frame {
            match pgoutput::decode(&data).unwrap() {
                Message::Insert { .. } => inserted = true,
                Message::Commit { end_lsn, .. } => break Lsn(end_lsn),
                _ => {}
            }
        }
    };
    assert!(inserted);
    stream.send_status(end, end, false).await.unwrap();
    let mut confirmed = Lsn::ZERO;
    for _ in 0..1000 {
        let at: Option<String> = sqlx::query_scalar(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
        )
        .bind(&slot)
        .fetch_optional(&db.pool)
        .await
        .unwrap()
        .flatten();
        confirmed = at.as_deref().and_then(Lsn::parse).unwrap_or(Lsn::ZERO);
        if confirmed >= end {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        confirmed >= end,
        "confirmed {confirmed}, acknowledged {end}"
    );
    drop(stream);
}
