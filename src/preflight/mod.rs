//! `bloomgate preflight`: connects as the configured role and checks
//! everything the configuration needs of the database before a gateway is
//! started on it, naming the statement that provides each missing piece.
//!
//! Checked, per resource: its table or view exists, every configured column
//! exists, each key column's type is one its `key_type` accepts, and the role
//! may `SELECT` every column read (and use the schema). Then for the change
//! feed `database.freshness` asks for (`auto` resolved as start-up would,
//! from `wal_level` and the role's `REPLICATION`):
//! - `wal`: `wal_level = logical`, `REPLICATION`, a publication that
//!   delivers every change of every watched table (or, with `install_feed`,
//!   tables the role owns so that it may create one), and a replica
//!   identity that carries every key column;
//! - `notify` and `queue`: with `install_triggers`, the `TRIGGER` privilege
//!   on every watched table and `CREATE` on its schema (and ownership of a
//!   trigger function left by another role); without, a bloomgate trigger
//!   on every table that announces every key column (`bloomgate
//!   install-triggers`, run once by the tables' owner);
//! - `queue` also: the change table owned by this role (or created by it).
//!
//! With `bus.url` (the WAL feed through the bus): Redis answers the
//! relay's script as the configured user (through the sentinels, with
//! `bus.sentinels`); the bus's slot, if it exists, is not invalidated; and
//! the primary has room for the relay's walsender and slot plus the
//! `bus.max_direct_fallback` gateways that may follow the WAL themselves
//! while the bus is down (`max_wal_senders`, `max_replication_slots`).
//! With `bus.read_from = "replicas"`, the online replicas the primary
//! lists (a note, not a failure, when there are none: the primary is read).
//!
//! Nothing is changed. The statements are printed for an administrator to
//! run; the exit status is 1 while anything is missing.

use std::fmt;
use std::time::Duration;

use sqlx::{PgConnection, PgPool};

use crate::config::{Config, Freshness};
use crate::db::Db;
use crate::db::catalog::{Watch, quote, quote_table};
use crate::db::triggers::Sink;

mod feeds;
mod tables;

use feeds::{auto_not_wal, bus, trigger_feed, wal};
use tables::resources;

/// What the checks found, in order, and the statements that fix it.
#[derive(Debug, Default)]
pub struct Report {
    lines: Vec<(Verdict, String)>,
    /// SQL for an administrator (the tables' owner or a superuser).
    statements: Vec<String>,
    /// Other steps (a command to run, a setting to change).
    steps: Vec<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Verdict {
    Ok,
    Missing,
    Note,
}

impl Report {
    fn ok(&mut self, line: String) {
        self.lines.push((Verdict::Ok, line));
    }

    /// A line said once: several resources on one table, or one problem
    /// of every table, would otherwise repeat it.
    fn missing(&mut self, line: String) {
        let line = (Verdict::Missing, line);
        if !self.lines.contains(&line) {
            self.lines.push(line);
        }
    }

    fn note(&mut self, line: String) {
        self.lines.push((Verdict::Note, line));
    }

    fn statement(&mut self, sql: String) {
        if !self.statements.contains(&sql) {
            self.statements.push(sql);
        }
    }

    fn step(&mut self, step: String) {
        if !self.steps.contains(&step) {
            self.steps.push(step);
        }
    }

    /// Nothing is missing.
    pub fn passed(&self) -> bool {
        self.missing_count() == 0
    }

    pub fn missing_count(&self) -> usize {
        self.lines
            .iter()
            .filter(|(v, _)| *v == Verdict::Missing)
            .count()
    }

    /// The statements that provide what is missing, in order.
    pub fn statements(&self) -> &[String] {
        &self.statements
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (verdict, line) in &self.lines {
            let tag = match verdict {
                Verdict::Ok => "ok      ",
                Verdict::Missing => "MISSING ",
                Verdict::Note => "note    ",
            };
            writeln!(f, "{tag}{line}")?;
        }
        if !self.statements.is_empty() {
            writeln!(
                f,
                "\n-- Missing: run as the tables' owner or a superuser\n-- (psql \"$ADMIN_URL\" -v ON_ERROR_STOP=1 -f this-file):"
            )?;
            for sql in &self.statements {
                writeln!(f, "{sql};")?;
            }
        }
        if !self.steps.is_empty() {
            writeln!(f, "\n-- Then:")?;
            for step in &self.steps {
                writeln!(f, "--   {step}")?;
            }
        }
        if self.passed() {
            writeln!(f, "\npreflight passed: the gateway has what it needs")?;
        }
        Ok(())
    }
}

/// Runs every check (see the module doc) against `config.database.url`.
pub async fn run(config: &Config) -> Report {
    let mut report = Report::default();
    let db = match Db::connect_lazy(&config.database) {
        Ok(db) => db,
        Err(e) => {
            report.missing(format!("database.url: {e}"));
            return report;
        }
    };
    match tokio::time::timeout(Duration::from_secs(15), db.check_up()).await {
        Err(_) => {
            report.missing("the database did not answer within 15 s".into());
            return report;
        }
        Ok(Err(cause)) => {
            report.missing(format!("cannot connect: {cause}"));
            return report;
        }
        Ok(Ok(())) => {}
    }
    if let Err(e) = check(db.pool(), config, &mut report).await {
        report.missing(format!("reading the catalog: {e}"));
    }
    db.pool().close().await;
    report
}

/// The role and server facts every check needs.
struct Role {
    /// Quoted, for statements.
    quoted: String,
    superuser: bool,
    replication: bool,
    wal_level: String,
    standby: bool,
}

async fn check(pool: &PgPool, config: &Config, r: &mut Report) -> Result<(), sqlx::Error> {
    let (name, superuser, replication, wal_level, standby): (String, bool, bool, String, bool) =
        sqlx::query_as(
            "SELECT current_user::text, rolsuper, rolreplication, current_setting('wal_level'),
                    pg_is_in_recovery()
               FROM pg_roles WHERE rolname = current_user",
        )
        .fetch_one(pool)
        .await?;
    let role = Role {
        quoted: quote(&name),
        superuser,
        replication,
        wal_level,
        standby,
    };
    if role.superuser {
        r.note(format!(
            "connected as {name}, a superuser: every privilege below is granted; run the gateway as a role of its own (the book: docs/src/production.md)"
        ));
    } else {
        r.ok(format!("connected as {name}"));
    }
    let mut conn = pool.acquire().await?;
    let watch = resources(&mut conn, config, &role, r).await?;
    let cfg = &config.database;
    let freshness = match cfg.freshness {
        Freshness::Auto => {
            // The rule start-up applies (`feed::supervisor`), so that this
            // checks the feed `serve` will run.
            let (chosen, why) = match auto_not_wal(&mut conn, config, &role, &watch).await? {
                None => (
                    Freshness::Wal,
                    "wal_level = logical, REPLICATION, and a publication in place or one start-up installs".to_string(),
                ),
                Some(why) => (Freshness::Notify, why),
            };
            r.note(format!(
                "database.freshness = auto: {} here ({why}); set it explicitly to check another feed",
                crate::feed::supervisor::name(chosen),
            ));
            chosen
        }
        f => f,
    };
    if freshness != Freshness::Off && role.standby {
        r.missing(
            "the database is a hot standby: the change feed needs the primary (database.url)"
                .into(),
        );
    }
    match freshness {
        Freshness::Off | Freshness::Auto => {
            r.ok("change feed off: nothing more is needed".into());
        }
        Freshness::Wal => {
            wal(&mut conn, config, &role, &watch, r).await?;
            if config.bus.url.is_some() {
                bus(&mut conn, config, r).await?;
            }
        }
        Freshness::Notify => {
            trigger_feed(&mut conn, config, &role, &watch, Sink::Notify, r).await?
        }
        Freshness::Queue => trigger_feed(&mut conn, config, &role, &watch, Sink::Queue, r).await?,
    }
    if !cfg.replica_urls.is_empty() {
        r.note(format!(
            "{} read replica(s) not checked: they replay the primary's grants",
            cfg.replica_urls.len()
        ));
    }
    Ok(())
}

/// Whether the current role owns (or is a member of the owner of) every
/// watched table: who may add them to a publication.
async fn owns_all(conn: &mut PgConnection, watch: &Watch) -> Result<bool, sqlx::Error> {
    let names: Vec<String> = watch.tables.iter().map(|t| quote_table(&t.name)).collect();
    sqlx::query_scalar(
        "SELECT coalesce(bool_and(pg_has_role(c.relowner, 'USAGE')), true)
           FROM unnest($1::text[]) t(name) JOIN pg_class c ON c.oid = to_regclass(t.name)",
    )
    .bind(&names)
    .fetch_one(conn)
    .await
}

/// One of PostgreSQL's `has_*_privilege` checks, for the current role.
async fn privilege(
    conn: &mut PgConnection,
    check: &str,
    args: &[&str],
) -> Result<bool, sqlx::Error> {
    let sql = format!("SELECT {check}");
    let mut q = sqlx::query_scalar::<_, Option<bool>>(&sql);
    for a in args {
        q = q.bind(*a);
    }
    Ok(q.fetch_one(conn).await?.unwrap_or(false))
}

fn schema_of(table: &str) -> &str {
    table.split_once('.').map_or("public", |(s, _)| s)
}

fn names(watch: &Watch) -> String {
    watch
        .tables
        .iter()
        .map(|t| t.name.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}
