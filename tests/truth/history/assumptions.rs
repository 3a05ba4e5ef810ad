//! The faults of what the promise once assumed instead of proving (see
//! "What was assumed" in the crate doc): a table rewritten under the feed
//! (`rewrite`), a gateway paused past its bound (`pause`), a WAL writer
//! slowed or stopped under asynchronous commits (`wal-writer`), the
//! primary restored from an older copy of itself (`restore`), and new
//! connections sent to another cluster while established ones stay
//! (`cut-over`, in `life`), and the database hung to every gateway
//! (`hang`). `rewrite`, `pause` and `wal-writer` open no
//! window of the oracle's: the promise holds through each within
//! `model::BASE`, as it must for writes at any time.

use std::time::Duration;

use sqlx::{Connection, Executor, PgConnection};

use super::{Action, FEED_GAP, World, read_back};
use crate::Fault;
use crate::model::secs;
use crate::ops::{Focus, Table};
use crate::schema;

/// How long `hang` holds at least: past the gateways' `acquire_timeout`
/// (2 s), so that a pool waiting on a hung server times out, and past it
/// by far.
const HANG_FOR: [Duration; 2] = [Duration::from_secs(3), Duration::from_secs(8)];

/// `wal-writer` in force, and how it is undone.
pub(crate) enum WalWriter {
    /// `wal_writer_delay` raised with `ALTER SYSTEM` (reset after).
    Delayed,
    /// The WAL writer stopped with `SIGSTOP` (continued after).
    Stopped(i32),
}

impl World {
    /// `hang`: every gateway connection, open or new, passes nothing
    /// (the proxy's `hang`) while the writer goes on; ended by
    /// `Action::Restore` (`life`'s `restore`), when everything held
    /// passes. The database is unreachable to the gateways, as in an
    /// outage, but nothing tells them: no refusal, no reset, only
    /// silence. A gateway must stop vouching within its bound and may
    /// then answer labelled stale rows or 503, as in any outage.
    async fn hang(&mut self) -> bool {
        if !self.cluster_idle() {
            return false;
        }
        let down = *self
            .assume_rng
            .as_mut()
            .expect("drawn from its stream")
            .pick(&HANG_FOR);
        let paths = self.warm(6, false).await;
        let now = self.now();
        {
            let mut m = self.shared.model.lock().unwrap();
            m.outage_began("hang", now);
            m.window("hang", now, FEED_GAP);
        }
        let life = self.life.as_mut().unwrap();
        life.proxy.hang();
        life.back_at = now + down;
        life.open = Some((Fault::Hang, now));
        self.shared.note(format!(
            "fault hang: every gateway connection passes nothing, at least {}s",
            down.as_secs()
        ));
        self.later(2, 8, Action::Restore);
        self.writes.focus(
            Focus::Update {
                paths,
                emails: false,
            },
            6,
        );
        true
    }

    pub(super) async fn inject_assumption(&mut self, f: Fault) -> bool {
        match f {
            Fault::Rewrite => self.rewrite().await,
            Fault::Pause => self.pause().await,
            Fault::WalWriter => self.slow_wal_writer().await,
            Fault::Restore => self.copy_primary().await,
            Fault::CutOver => self.cut_over().await,
            Fault::Hang => self.hang().await,
            _ => unreachable!("not a fault of what was assumed"),
        }
    }

    /// `rewrite`: one table rewritten, with no row change any feed sees:
    /// a served column's type changed with `USING` (every value changes),
    /// a served column renamed and another added under its name, or the
    /// key's type changed (the values stay; on the WAL feeds the
    /// publication's column list is taken off first, as PostgreSQL refuses
    /// to change the type of a listed column). The new values are read in
    /// the rewriting transaction, as the writer's are. `orders` is
    /// rewritten with it a quarter of the time (drawn from its stream).
    async fn rewrite(&mut self) -> bool {
        let rng = self.assume_rng.as_mut().expect("drawn from its stream");
        let (table, column) = *rng.pick(&[
            (Table::Users, "name"),
            (Table::Docs, "title"),
            (Table::Tags, "label"),
            (Table::Events, "kind"),
        ]);
        let how = rng.below(3);
        let name = table.name();
        let n = self.step;
        let statements: Vec<String> = match how {
            0 => vec![format!(
                "ALTER TABLE {name} ALTER COLUMN {column} TYPE text USING {column} || '~'"
            )],
            1 => vec![
                format!("ALTER TABLE {name} RENAME COLUMN {column} TO {column}_was_{n}"),
                format!("ALTER TABLE {name} ALTER COLUMN {column}_was_{n} DROP NOT NULL"),
                format!(
                    "ALTER TABLE {name} ADD COLUMN {column} text NOT NULL DEFAULT 'renamed at {n}'"
                ),
            ],
            // The key: the same values, another type (or the same with
            // USING: a rewrite either way). `events` is partitioned by its
            // key, whose type PostgreSQL will not change.
            _ => match table {
                Table::Docs => vec!["ALTER TABLE docs ALTER COLUMN id TYPE uuid USING id".into()],
                Table::Tags => vec![format!(
                    "ALTER TABLE tags ALTER COLUMN code TYPE {} USING code",
                    if n.is_multiple_of(2) {
                        "varchar(300)"
                    } else {
                        "text"
                    }
                )],
                _ => vec![format!(
                    "ALTER TABLE {name} ALTER COLUMN {column} TYPE text USING {column} || '~'"
                )],
            },
        };
        let key = how == 2 && matches!(table, Table::Docs | Table::Tags);
        // `orders` rewritten too, in the same transaction, a quarter of
        // the time (its own draw): its value column as above, or its
        // key's two columns (`order_no` between `varchar(300)` and `text`,
        // `tenant_id` to itself), not while it is empty (the trigger's
        // probe below needs a row).
        let orders_how = self
            .writes
            .orders_rng
            .chance(25)
            .then(|| self.writes.orders_rng.below(3))
            .map(|h| {
                if h == 2 && self.writes.shadow.orders.is_empty() {
                    0
                } else {
                    h
                }
            });
        let mut statements = statements;
        statements.extend(match orders_how {
            None => Vec::new(),
            Some(0) => {
                vec!["ALTER TABLE orders ALTER COLUMN item TYPE text USING item || '~'".into()]
            }
            Some(1) => vec![
                format!("ALTER TABLE orders RENAME COLUMN item TO item_was_{n}"),
                format!("ALTER TABLE orders ALTER COLUMN item_was_{n} DROP NOT NULL"),
                format!(
                    "ALTER TABLE orders ADD COLUMN item text NOT NULL DEFAULT 'renamed at {n}'"
                ),
            ],
            Some(_) => vec![format!(
                "ALTER TABLE orders ALTER COLUMN order_no TYPE {} USING order_no, \
                 ALTER COLUMN tenant_id TYPE bigint USING tenant_id",
                if n.is_multiple_of(2) {
                    "varchar(300)"
                } else {
                    "text"
                }
            )],
        });
        let mut keys_changed = Vec::new();
        if key {
            keys_changed.push(name);
        }
        if orders_how == Some(2) {
            keys_changed.push("orders");
        }
        if !keys_changed.is_empty() && self.opts.feed.is_wal() {
            self.sql(&format!(
                "ALTER PUBLICATION bloomgate SET TABLE {}",
                schema::TABLES
            ))
            .await;
        }
        let paths = self.warm(6, table == Table::Users).await;
        let mut all = self.writes.shadow.paths(table);
        if orders_how.is_some() {
            all.extend(self.writes.shadow.paths(Table::Orders));
        }
        let c = &mut self.writer;
        let done = async {
            c.execute("BEGIN").await?;
            for s in &statements {
                c.execute(s.as_str()).await?;
            }
            let changes = read_back(c, &all).await?;
            self.shared
                .model
                .lock()
                .unwrap()
                .stage(self.shared.now(), changes);
            c.execute("COMMIT").await?;
            self.shared
                .model
                .lock()
                .unwrap()
                .committed(self.shared.now());
            Ok::<_, sqlx::Error>(())
        }
        .await;
        if let Err(e) = done {
            // A deadlock with a gateway's DDL: not injected.
            let _ = self.writer.execute("ROLLBACK").await;
            self.shared
                .note(format!("fault rewrite of {name}: not played ({e})"));
            return false;
        }
        self.shared
            .note(format!("fault rewrite: {}", statements.join("; ")));
        if self.opts.feed.is_wal() {
            keys_changed.clear();
        }
        for name in keys_changed {
            // The writer's session planned the table's trigger with the
            // key's old type, and PL/pgSQL fails its writes there until
            // the function is replaced, which the gateway does when it
            // sees the rewrite (`install_triggers`): a delete, an insert
            // and an update of one row (each of the function's branches
            // has plans of its own), rolled back, until they pass.
            let probe = format!(
                "BEGIN;
                 CREATE TEMP TABLE truth_probe ON COMMIT DROP AS
                   SELECT * FROM {name} WHERE ctid = (SELECT ctid FROM {name} LIMIT 1);
                 DELETE FROM {name} WHERE ctid = (SELECT ctid FROM {name} LIMIT 1);
                 INSERT INTO {name} SELECT * FROM truth_probe;
                 UPDATE {name} SET rev = rev WHERE ctid = (SELECT ctid FROM {name} LIMIT 1);
                 ROLLBACK;"
            );
            let began = self.now();
            loop {
                match sqlx::raw_sql(&probe).execute(&mut self.writer).await {
                    Ok(_) => break,
                    Err(e) if self.now() - began < Duration::from_secs(10) => {
                        let _ = e;
                        let _ = self.writer.execute("ROLLBACK").await;
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    Err(e) => panic!(
                        "seed {}: the trigger of {name} was not replaced after its key's type changed: {e}",
                        self.opts.seed
                    ),
                }
            }
            self.shared.note(format!(
                "rewrite: the writer's session writes {name} again after {}ms",
                (self.now() - began).as_millis()
            ));
        }
        self.writes.focus(
            Focus::Update {
                paths,
                emails: false,
            },
            6,
        );
        true
    }

    /// `pause`: a gateway stopped as `SIGSTOP` stops a process, past its
    /// `freshness_bound` (1.5 s): both workers of its runtime held, so
    /// nothing of it runs (its timers, its feed, its requests) until they
    /// are let go, while the writer changes rows it cached and the readers'
    /// requests to it wait. Then its requests are answered: none from a
    /// proof older than the bound.
    async fn pause(&mut self) -> bool {
        let live = self.shared.live();
        if live.is_empty() {
            return false;
        }
        let g = live[self.writes.rng.below(live.len())].clone();
        let Some(h) = g.handle.clone() else {
            return false;
        };
        let rng = self.assume_rng.as_mut().expect("drawn from its stream");
        let hold = *rng.pick(&[Duration::from_secs(3), Duration::from_secs(4)]);
        let paths = self.warm(6, false).await;
        // Requests queued late in the pause, past the bound after the
        // writes below (the readers each wait on their own request, sent
        // as it began): answered on resume, judged as any read.
        let (shared, late, queued) = (self.shared.clone(), g.clone(), paths.clone());
        tokio::spawn(async move {
            tokio::time::sleep(hold.saturating_sub(Duration::from_millis(300))).await;
            let reads = queued
                .iter()
                .map(|p| super::reads::read_and_judge(&shared, &late, p));
            futures_util::future::join_all(reads).await;
        });
        // Two tasks, one per worker: each waits for the other on a
        // barrier (so both workers are held at once) and then sleeps.
        let barrier = std::sync::Arc::new(std::sync::Barrier::new(2));
        for _ in 0..2 {
            let b = barrier.clone();
            h.spawn(async move {
                b.wait();
                std::thread::sleep(hold);
            });
        }
        self.shared.note(format!(
            "fault pause: gw{} stopped for {} ms",
            g.id,
            hold.as_millis()
        ));
        self.writes.focus(
            Focus::Update {
                paths,
                emails: false,
            },
            8,
        );
        true
    }

    /// `wal-writer`: asynchronous commits while the WAL writer is slowed
    /// (`wal_writer_delay` 10 s, set at run time) or stopped (`SIGSTOP`, as
    /// a stalled WAL disk stops it): visible commits stay unflushed, so
    /// nothing decodes them until a feed forces the flush. Undone 4-10
    /// steps later. On the history's own cluster.
    async fn slow_wal_writer(&mut self) -> bool {
        let Some(life) = &self.life else {
            return false;
        };
        if life.open.is_some() || self.wal_writer.is_some() {
            return false;
        }
        let admin = life.primary.url("postgres");
        let Ok(mut c) = PgConnection::connect(&admin).await else {
            return false;
        };
        let rng = self.assume_rng.as_mut().expect("drawn from its stream");
        let stop = rng.chance(50);
        let how = if stop {
            let pid: Option<i32> = sqlx::query_scalar(
                "SELECT pid FROM pg_stat_activity WHERE backend_type = 'walwriter'",
            )
            .fetch_optional(&mut c)
            .await
            .ok()
            .flatten();
            let Some(pid) = pid else {
                return false;
            };
            signal(pid, "-STOP");
            WalWriter::Stopped(pid)
        } else {
            c.execute("ALTER SYSTEM SET wal_writer_delay = '10s'")
                .await
                .unwrap();
            c.execute("SELECT pg_reload_conf()").await.unwrap();
            WalWriter::Delayed
        };
        // The writer's commits are asynchronous while it lasts.
        self.writer
            .execute("SET synchronous_commit = off")
            .await
            .unwrap();
        let paths = self.warm(6, false).await;
        self.shared.note(format!(
            "fault wal-writer: the WAL writer {} under asynchronous commits",
            if stop {
                "stopped"
            } else {
                "at wal_writer_delay = 10s"
            }
        ));
        let hold = *rng_pick_hold(self.assume_rng.as_mut().unwrap());
        self.wal_writer = Some((how, self.now() + hold));
        self.later(4, 10, Action::WalWriterBack);
        self.writes.focus(
            Focus::Update {
                paths,
                emails: false,
            },
            8,
        );
        true
    }

    /// The end of `wal-writer`: as it was, once it has lasted what was
    /// drawn (the steps go by in milliseconds; until then, a few steps
    /// more). `now`: at once (the history's end).
    pub(super) async fn wal_writer_back(&mut self, now: bool) {
        let Some((how, until)) = self.wal_writer.take() else {
            return;
        };
        if !now && self.now() < until {
            self.wal_writer = Some((how, until));
            self.later(2, 4, Action::WalWriterBack);
            return;
        }
        let life = self.life.as_ref().expect("on its cluster");
        match how {
            // Gone when the primary restarted meanwhile (a crash, a
            // restore, a failover): its WAL writer is a new process.
            WalWriter::Stopped(pid) => {
                let _ = std::process::Command::new("kill")
                    .args(["-CONT", &pid.to_string()])
                    .status();
            }
            WalWriter::Delayed => {
                let mut c = PgConnection::connect(&life.primary.url("postgres"))
                    .await
                    .unwrap();
                c.execute("ALTER SYSTEM RESET wal_writer_delay")
                    .await
                    .unwrap();
                c.execute("SELECT pg_reload_conf()").await.unwrap();
            }
        }
        if !life.async_commits {
            self.writer
                .execute("SET synchronous_commit = on")
                .await
                .unwrap();
        }
        self.shared.note("wal-writer: as it was".into());
    }

    /// `restore`'s first half: the primary stopped (`-m immediate`), its
    /// data directory copied, started again; the writer goes on, and 3-8
    /// steps later the copy is put back ([`World::put_back_copy`]).
    async fn copy_primary(&mut self) -> bool {
        let Some(life) = &mut self.life else {
            return false;
        };
        if life.open.is_some() {
            return false;
        }
        let t = self.now();
        {
            let mut m = self.shared.model.lock().unwrap();
            m.outage_began("restore", t);
            m.open_window("restore", t);
        }
        let life = self.life.as_mut().unwrap();
        let data = life.primary.dir.join("data");
        let copy = life.primary.dir.join("data.copy");
        let _ = std::fs::remove_dir_all(&copy);
        life.primary.stop("immediate");
        copy_dir(&data, &copy);
        life.primary.start();
        life.open = Some((Fault::Restore, t));
        self.copy = Some((copy, t));
        self.reconnect_writer().await;
        self.reset_model().await;
        let back = self.now();
        {
            let mut m = self.shared.model.lock().unwrap();
            m.outage_ended(back);
            m.close_window("restore", back + FEED_GAP);
        }
        self.shared.note(format!(
            "fault restore: the primary's data copied (a restart of {}ms); put back in a few steps",
            (back - t).as_millis()
        ));
        // WAL past the copy's end, as much as a busy primary writes in a
        // while (the audit wrote 57 MiB): the restored primary then stands
        // far behind every position read since, and a bus stream kept
        // across the restore would refuse its commits as duplicates for
        // that long. The table goes with the restore.
        let junk = format!(
            "CREATE TABLE truth_junk_{} AS SELECT g, repeat('x', 300) AS pad FROM generate_series(1, 60000) g",
            self.step
        );
        self.sql(&junk).await;
        self.later(3, 8, Action::PutBackCopy);
        true
    }

    /// `restore`'s second half: the primary stopped, the copy put back,
    /// started again: the same system identifier and timeline, at the
    /// copy's lower position; what was committed since the copy is gone.
    /// The standby and the read replica hold WAL the restored primary does
    /// not: a new standby is made of it, and the replica is left stranded
    /// (ahead of it, never to be read).
    pub(super) async fn put_back_copy(&mut self) {
        let Some((copy, copied)) = self.copy.take() else {
            return;
        };
        let t = self.now();
        {
            let mut m = self.shared.model.lock().unwrap();
            m.outage_began("restore", t);
            m.open_window_back_to("restore", t, copied);
        }
        let life = self.life.as_mut().unwrap();
        let data = life.primary.dir.join("data");
        life.primary.stop("immediate");
        std::fs::remove_dir_all(&data).unwrap();
        std::fs::rename(&copy, &data).unwrap();
        life.primary.start();
        if let Some(s) = life.standby.take() {
            s.stop("immediate");
        }
        self.reconnect_writer().await;
        self.reset_model().await;
        let back = self.now();
        {
            let mut m = self.shared.model.lock().unwrap();
            m.outage_ended(back);
            m.close_window("restore", back + FEED_GAP);
        }
        let life = self.life.as_mut().unwrap();
        life.standby = Some(life.primary.standby());
        life.stranded = life.replica.is_some();
        life.open = None;
        self.shared.note(format!(
            "restore: the copy put back in {}ms (t={}){}",
            (back - t).as_millis(),
            secs(back),
            if life.replica.is_some() {
                "; the replica holds WAL the primary does not"
            } else {
                ""
            }
        ));
    }
}

/// How long `wal-writer` lasts: past the gateways' bound (1.5 s), and past
/// the oracle's (2 s).
fn rng_pick_hold(rng: &mut crate::rng::Rng) -> &'static Duration {
    const HOLDS: [Duration; 2] = [Duration::from_secs(3), Duration::from_secs(8)];
    rng.pick(&HOLDS)
}

fn signal(pid: i32, sig: &str) {
    let ok = std::process::Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "kill {sig} {pid}");
}

fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
    let ok = std::process::Command::new("cp")
        .args(["-a", from.to_str().unwrap(), to.to_str().unwrap()])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "cp -a {from:?} {to:?}");
}
