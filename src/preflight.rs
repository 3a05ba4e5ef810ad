//! `bloomgate preflight`: connects as the configured role and checks
//! everything the configuration needs of the database before a gateway is
//! started on it, naming the statement that provides each missing piece.
//!
//! Checked, per resource: its table or view exists, every configured column
//! exists, the key column's type is one its `key_type` accepts, and the role
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
//!
//! Nothing is changed. The statements are printed for an administrator to
//! run; the exit status is 1 while anything is missing.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use sqlx::{PgConnection, PgPool};

use crate::config::{Config, Freshness};
use crate::db::catalog::{self, TableName, Watch, WatchedColumn, WatchedTable, quote, quote_table};
use crate::db::triggers::{self, Sink};
use crate::db::{Db, publication};

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

    fn missing(&mut self, line: String) {
        self.lines.push((Verdict::Missing, line));
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
            let wal = role.wal_level == "logical" && (role.replication || role.superuser);
            let chosen = if wal {
                Freshness::Wal
            } else {
                Freshness::Notify
            };
            r.note(format!(
                "database.freshness = auto: {} here (wal_level = {}, REPLICATION: {}); set it explicitly to check another feed",
                crate::feed::supervisor::name(chosen),
                role.wal_level,
                if role.replication || role.superuser { "yes" } else { "no" }
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

/// Every resource's relation, columns, key type and `SELECT`; returns what
/// the feeds would watch (each resource's source table and key column).
async fn resources(
    conn: &mut PgConnection,
    config: &Config,
    role: &Role,
    r: &mut Report,
) -> Result<Watch, sqlx::Error> {
    let mut tables: BTreeMap<TableName, Vec<WatchedColumn>> = BTreeMap::new();
    for res in config.resolved() {
        // A schema the role may not use makes every lookup of a name in it
        // an error ("permission denied for schema"), not an absence: say
        // what to grant, and check the rest of this resource once it is.
        if let Some((schema, _)) = res.table.split_once('.') {
            let usable: Option<bool> = sqlx::query_scalar(
                "SELECT has_schema_privilege(oid, 'USAGE') FROM pg_namespace WHERE nspname = $1",
            )
            .bind(schema)
            .fetch_optional(&mut *conn)
            .await?;
            if usable == Some(false) {
                r.missing(format!(
                    "resource {}: USAGE on schema {schema} (its table, columns and feed are checked once it is granted)",
                    res.name
                ));
                r.statement(format!(
                    "GRANT USAGE ON SCHEMA {} TO {}",
                    quote(schema),
                    role.quoted
                ));
                continue;
            }
        }
        let Some(info) = catalog::table_info_on(&mut *conn, &res.table).await? else {
            r.missing(format!(
                "resource {}: no table or view {:?} (names are case-sensitive; schema.table, or in the search path), or no USAGE on its schema",
                res.name, res.table
            ));
            continue;
        };
        let schema = schema_of(&info.name);
        if !privilege(conn, "has_schema_privilege($1, 'USAGE')", &[schema]).await? {
            r.missing(format!("resource {}: USAGE on schema {schema}", res.name));
            r.statement(format!(
                "GRANT USAGE ON SCHEMA {} TO {}",
                quote(schema),
                role.quoted
            ));
        }
        let mut read: Vec<&str> = vec![&res.key_column];
        read.extend(res.columns.iter().map(String::as_str));
        if let Some(owner) = res.access.owner_column.as_deref() {
            read.push(owner);
        }
        read.dedup();
        let absent: Vec<&str> = read
            .iter()
            .copied()
            .filter(|c| info.column(c).is_none())
            .collect();
        if !absent.is_empty() {
            r.missing(format!(
                "resource {}: {} has no column {}",
                res.name,
                info.name,
                absent.join(", ")
            ));
        }
        if let Some(key) = info.column(&res.key_column)
            && !res.key_type.accepts(key.column_type())
        {
            r.missing(format!(
                "resource {}: key column {}.{} is {}, which key_type {:?} does not accept ({})",
                res.name,
                info.name,
                res.key_column,
                key.declared,
                res.key_type.sql_type(),
                res.key_type.accepted()
            ));
        }
        // A key or owner column the gateway could not compare as
        // Postgres does (`key::compare`): start-up would refuse it.
        let compared = std::iter::once(res.key_column.as_str())
            .chain(res.access.owner_column.as_deref())
            .filter_map(|c| info.column(c));
        for column in compared {
            match catalog::comparison_on(&mut *conn, &info.name, column).await {
                Ok(_) => {}
                Err(catalog::ComparisonError::Refused(why)) => {
                    r.missing(format!("resource {}: {why}", res.name));
                }
                Err(catalog::ComparisonError::Db(e)) => return Err(e),
            }
        }
        let table = quote_table(&info.name);
        let mut denied = Vec::new();
        for c in read.iter().filter(|c| info.column(c).is_some()) {
            if !privilege(conn, "has_column_privilege($1, $2, 'SELECT')", &[&table, c]).await? {
                denied.push(*c);
            }
        }
        if denied.is_empty() {
            r.ok(format!(
                "resource {}: {} ({} {}), SELECT on {}",
                res.name,
                info.name,
                res.key_column,
                res.key_type.sql_type(),
                read.join(", ")
            ));
        } else {
            r.missing(format!(
                "resource {}: SELECT on {} ({})",
                res.name,
                info.name,
                denied.join(", ")
            ));
            r.statement(format!("GRANT SELECT ON {table} TO {}", role.quoted));
        }
        let source = if res.source_table == res.table {
            Some(info)
        } else {
            catalog::table_info_on(&mut *conn, &res.source_table).await?
        };
        let Some(source) = source else {
            r.missing(format!(
                "resource {}: no source_table {:?}",
                res.name, res.source_table
            ));
            continue;
        };
        let Some(key) = source.column(&res.key_column) else {
            r.missing(format!(
                "resource {}: source_table {} has no column {}",
                res.name, source.name, res.key_column
            ));
            continue;
        };
        let columns = tables.entry(source.name.clone()).or_default();
        if !columns.iter().any(|c| *c.name == *res.key_column) {
            columns.push(WatchedColumn {
                name: Arc::from(res.key_column.as_str()),
                ty: key.column_type(),
            });
        }
    }
    Ok(Watch {
        tables: tables
            .into_iter()
            .map(|(name, columns)| WatchedTable { name, columns })
            .collect(),
    })
}

/// The WAL feed's needs.
async fn wal(
    conn: &mut PgConnection,
    config: &Config,
    role: &Role,
    watch: &Watch,
    r: &mut Report,
) -> Result<(), sqlx::Error> {
    let cfg = &config.database;
    r.note(format!(
        "change feed: wal (publication {:?})",
        cfg.publication
    ));
    if role.wal_level == "logical" {
        r.ok("wal_level = logical".into());
    } else {
        r.missing(format!("wal_level = logical (it is {})", role.wal_level));
        r.statement("ALTER SYSTEM SET wal_level = logical".into());
        r.step("restart PostgreSQL for wal_level (managed services: rds.logical_replication = 1, cloudsql.logical_decoding = on)".into());
    }
    if role.replication || role.superuser {
        r.ok("REPLICATION".into());
    } else {
        r.missing("the REPLICATION attribute (a logical replication slot)".into());
        r.statement(format!("ALTER ROLE {} REPLICATION", role.quoted));
    }
    if watch.tables.is_empty() {
        return Ok(());
    }
    let checked = publication::check(&mut *conn, watch, &cfg.publication).await?;
    let problems: Vec<&String> = checked.problems.iter().flatten().collect();
    if checked.exists && problems.is_empty() {
        r.ok(format!(
            "publication {:?} delivers every change of {}",
            cfg.publication,
            names(watch)
        ));
    } else {
        let owned = owns_all(conn, watch).await?;
        if cfg.install_feed && (owned || role.superuser) {
            r.ok(format!(
                "publication {:?} is created or repaired at start-up (database.install_feed; the role owns the tables)",
                cfg.publication
            ));
        } else {
            if !checked.exists {
                r.missing(format!("publication {:?} does not exist", cfg.publication));
            }
            for p in &problems {
                r.missing((*p).clone());
            }
            if cfg.install_feed {
                r.note("database.install_feed = true, but only the tables' owner may add them to a publication: create it as below and set install_feed = false".into());
            }
            let all_tables: Option<bool> =
                sqlx::query_scalar("SELECT puballtables FROM pg_publication WHERE pubname = $1")
                    .bind(&cfg.publication)
                    .fetch_optional(&mut *conn)
                    .await?;
            for sql in publication::statements(all_tables, watch, &cfg.publication) {
                r.statement(sql);
            }
        }
    }
    let identity = publication::identity_problems(&mut *conn, watch).await?;
    if identity.is_empty() {
        r.ok("every table's replica identity carries its key columns".into());
    }
    for p in identity {
        r.missing(p);
    }
    Ok(())
}

/// The bus's needs (see the module doc).
async fn bus(conn: &mut PgConnection, config: &Config, r: &mut Report) -> Result<(), sqlx::Error> {
    use crate::feed::bus::Bus;
    let b = &config.bus;
    let shown = b.shown().unwrap_or_default();
    let sentinels = b
        .sentinel_master
        .as_ref()
        .map(|m| crate::feed::bus::redis::Sentinels {
            urls: b.sentinels.clone(),
            master: m.clone(),
        });
    let tls = crate::feed::bus::redis::TlsFiles {
        ca_file: b.ca_file.clone(),
        cert_file: b.cert_file.clone(),
        key_file: b.key_file.clone(),
    };
    // The relay's script on a key of its own: EVAL, EXISTS and XINFO as
    // the configured user, nothing written.
    let probe = crate::feed::bus::redis::RedisBus::with_sentinels(
        b.url.as_deref().unwrap_or_default(),
        sentinels.as_ref(),
        &tls,
        format!("{}:preflight", b.prefix),
        crate::feed::Timeline { system: 0, id: 1 },
        b.retention,
    );
    let answered = match probe {
        Err(e) => Err(e.to_string()),
        Ok(mut bus) => match tokio::time::timeout(Duration::from_secs(10), bus.head()).await {
            Err(_) => Err("no answer within 10 s".into()),
            Ok(r) => r.map(|_| ()).map_err(|e| e.to_string()),
        },
    };
    match answered {
        Ok(()) => r.ok(format!("bus: Redis answers the relay's script ({shown})")),
        Err(e) => r.missing(format!(
            "bus: Redis ({shown}): {e}; until it answers every gateway follows the WAL itself (at most bus.max_direct_fallback of them) or nothing"
        )),
    }
    let slot: Option<(Option<String>, bool)> =
        sqlx::query_as("SELECT wal_status, active FROM pg_replication_slots WHERE slot_name = $1")
            .bind(&b.slot)
            .fetch_optional(&mut *conn)
            .await?;
    match &slot {
        None => r.ok(format!(
            "bus.slot {:?}: created by the first relay (REPLICATION)",
            b.slot
        )),
        Some((Some(status), _)) if status == "lost" => {
            r.missing(format!(
                "bus.slot {:?} was invalidated (max_slot_wal_keep_size): the relay cannot use it",
                b.slot
            ));
            // A slot name is lower-case letters, digits and `_` (config).
            r.statement(format!("SELECT pg_drop_replication_slot('{}')", b.slot));
        }
        Some((_, active)) => r.ok(format!(
            "bus.slot {:?} exists ({})",
            b.slot,
            if *active { "a relay holds it" } else { "free" }
        )),
    }
    // Room for the relay, and for the fall-back's walsenders and temporary
    // slots, beside what the primary serves already.
    let (senders, slots, used_senders, used_slots): (i32, i32, i64, i64) = sqlx::query_as(
        "SELECT current_setting('max_wal_senders')::int,
                current_setting('max_replication_slots')::int,
                (SELECT count(*) FROM pg_stat_replication),
                (SELECT count(*) FROM pg_replication_slots)",
    )
    .fetch_one(&mut *conn)
    .await?;
    let relay_senders = i64::from(!matches!(slot, Some((_, true))));
    let relay_slots = i64::from(slot.is_none());
    let fallback = i64::from(b.max_direct_fallback);
    let need_senders = used_senders + relay_senders + fallback;
    let need_slots = used_slots + relay_slots + fallback;
    if need_senders <= i64::from(senders) && need_slots <= i64::from(slots) {
        r.ok(format!(
            "room for the relay and bus.max_direct_fallback = {fallback}: max_wal_senders {senders} ({used_senders} in use), max_replication_slots {slots} ({used_slots} in use)"
        ));
    } else {
        r.missing(format!(
            "no room for the relay and bus.max_direct_fallback = {fallback} walsenders: {need_senders} needed of max_wal_senders {senders}, {need_slots} of max_replication_slots {slots}"
        ));
        r.statement(format!(
            "ALTER SYSTEM SET max_wal_senders = {}",
            need_senders.max(i64::from(senders)) + 2
        ));
        r.statement(format!(
            "ALTER SYSTEM SET max_replication_slots = {}",
            need_slots.max(i64::from(slots)) + 2
        ));
        r.step("restart PostgreSQL for max_wal_senders and max_replication_slots (or lower bus.max_direct_fallback)".into());
    }
    Ok(())
}

/// The trigger feeds' needs (`notify`, `queue`).
async fn trigger_feed(
    conn: &mut PgConnection,
    config: &Config,
    role: &Role,
    watch: &Watch,
    sink: Sink,
    r: &mut Report,
) -> Result<(), sqlx::Error> {
    let cfg = &config.database;
    let feed = match sink {
        Sink::Notify => "notify",
        Sink::Queue => "queue",
    };
    r.note(format!(
        "change feed: {feed} (database.install_triggers = {})",
        cfg.install_triggers
    ));
    for t in &watch.tables {
        let columns: Vec<&str> = t.columns.iter().map(|c| &*c.name).collect();
        let problem = triggers::problem(&mut *conn, &t.name, &columns, sink).await?;
        let table = quote_table(&t.name);
        if !cfg.install_triggers {
            match problem {
                None => r.ok(format!(
                    "{}: its trigger announces {}",
                    t.name,
                    columns.join(", ")
                )),
                Some(p) => {
                    r.missing(p);
                    r.step(
                        "as the tables' owner: bloomgate install-triggers --config <this config> (or set database.install_triggers = true and grant what it needs: docs/src/production.md)"
                            .into(),
                    );
                }
            }
            continue;
        }
        let schema = schema_of(&t.name);
        let mut fine = true;
        if !privilege(conn, "has_table_privilege($1, 'TRIGGER')", &[&table]).await? {
            fine = false;
            r.missing(format!(
                "{}: the TRIGGER privilege (database.install_triggers)",
                t.name
            ));
            r.statement(format!("GRANT TRIGGER ON {table} TO {}", role.quoted));
        }
        if !privilege(conn, "has_schema_privilege($1, 'CREATE')", &[schema]).await? {
            fine = false;
            r.missing(format!(
                "{}: CREATE on schema {schema}, for its trigger function (database.install_triggers)",
                t.name
            ));
            r.statement(format!(
                "GRANT CREATE ON SCHEMA {} TO {}",
                quote(schema),
                role.quoted
            ));
        }
        let function = format!(
            "{}.{}",
            quote(schema),
            quote(&triggers::function_name(&t.name))
        );
        let owner: Option<(String, bool)> = sqlx::query_as(
            "SELECT pg_get_userbyid(proowner)::text, pg_has_role(proowner, 'USAGE')
               FROM pg_proc WHERE oid = to_regprocedure($1)",
        )
        .bind(format!("{function}()"))
        .fetch_optional(&mut *conn)
        .await?;
        if let Some((owner, false)) = owner {
            fine = false;
            r.missing(format!(
                "{}: its trigger function {function}() belongs to {owner}, so this role cannot replace it",
                t.name
            ));
            r.statement(format!(
                "ALTER FUNCTION {function}() OWNER TO {}",
                role.quoted
            ));
        }
        if fine {
            r.ok(format!(
                "{}: the role may install its trigger{}",
                t.name,
                if problem.is_none() {
                    " (installed already)"
                } else {
                    " (installed at start-up)"
                }
            ));
        }
    }
    if sink == Sink::Queue {
        queue_table(conn, cfg.install_triggers, role, r).await?;
    }
    Ok(())
}

/// The queue feed's change table: this role's (or, before it exists,
/// creatable by it with `install_triggers`).
async fn queue_table(
    conn: &mut PgConnection,
    install: bool,
    role: &Role,
    r: &mut Report,
) -> Result<(), sqlx::Error> {
    let exists: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
        .bind(triggers::QUEUE_TABLE)
        .fetch_one(&mut *conn)
        .await?;
    if !exists {
        if !install {
            r.missing(format!(
                "the change table {} does not exist",
                triggers::QUEUE_TABLE
            ));
            r.step("as the gateway's role: bloomgate install-triggers --config <this config> (it creates the change table, which the gateway must own)".into());
        } else if privilege(conn, "has_schema_privilege($1, 'CREATE')", &["public"]).await? {
            r.ok(format!(
                "the change table {} is created at start-up",
                triggers::QUEUE_TABLE
            ));
        } else {
            r.missing(format!(
                "CREATE on schema public, for the change table {}",
                triggers::QUEUE_TABLE
            ));
            r.statement(format!("GRANT CREATE ON SCHEMA public TO {}", role.quoted));
        }
        return Ok(());
    }
    let why: Option<String> = sqlx::query_scalar(triggers::QUEUE_TABLE_CHECK)
        .fetch_optional(&mut *conn)
        .await?;
    match why {
        None => r.ok(format!(
            "the change table {} is this role's",
            triggers::QUEUE_TABLE
        )),
        Some(why) => {
            r.missing(why);
            for t in [
                "public.bloomgate_changes",
                "public.bloomgate_changes_pruned",
            ] {
                r.statement(format!("ALTER TABLE {t} OWNER TO {}", role.quoted));
            }
        }
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
