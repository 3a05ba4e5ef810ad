//! `preflight`'s checks of the change feed `database.freshness` names:
//! the WAL feed (`wal_level`, `REPLICATION`, the publication, replica
//! identities, the bus), the triggers (`TRIGGER`, `CREATE`, or the
//! installed ones) and the queue feed's change table.

use std::time::Duration;

use sqlx::PgConnection;

use crate::config::Config;
use crate::db::catalog::{Watch, quote, quote_table};
use crate::db::publication;
use crate::db::triggers::{self, Sink};

use super::{Report, Role, names, owns_all, privilege, schema_of};

/// Why `database.freshness = "auto"` would not pick the WAL feed at
/// start-up, by the rule `feed::supervisor` applies there: `wal_level =
/// logical` and `REPLICATION`, and a publication that delivers every
/// change of the tables, or that start-up can create or repair
/// (`install_feed`, and the role owns the tables). `None`: it would.
pub(super) async fn auto_not_wal(
    conn: &mut PgConnection,
    config: &Config,
    role: &Role,
    watch: &Watch,
) -> Result<Option<String>, sqlx::Error> {
    if role.wal_level != "logical" {
        return Ok(Some(format!(
            "wal_level is {}, not logical",
            role.wal_level
        )));
    }
    if !(role.replication || role.superuser) {
        return Ok(Some("the role lacks REPLICATION".into()));
    }
    if watch.tables.is_empty() {
        return Ok(None);
    }
    let cfg = &config.database;
    // Start-up checks the replica identities first, and falls back to
    // notify on any problem there, whatever the publication.
    if let Some(problem) = publication::identity_problems(&mut *conn, watch)
        .await?
        .into_iter()
        .next()
    {
        return Ok(Some(problem));
    }
    let checked = publication::check(&mut *conn, watch, &cfg.publication).await?;
    if checked.exists && checked.problems.iter().flatten().next().is_none() {
        return Ok(None);
    }
    if cfg.install_feed && (role.superuser || owns_all(conn, watch).await?) {
        return Ok(None);
    }
    Ok(Some(format!(
        "publication {:?} does not deliver every change of {}, and start-up cannot create or repair it ({})",
        cfg.publication,
        names(watch),
        if cfg.install_feed {
            "the role does not own the tables"
        } else {
            "database.install_feed is off"
        }
    )))
}

/// The WAL feed's needs.
pub(super) async fn wal(
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
    let p = &cfg.publication;
    let plans = publication::plan(&mut *conn, watch).await?;
    let checked = publication::check(&mut *conn, watch, p).await?;
    let mut problems: Vec<&String> = Vec::new();
    for problem in checked.problems.iter().flatten() {
        if !problems.contains(&problem) {
            problems.push(problem);
        }
    }
    let lists: Vec<Option<Vec<String>>> = plans.iter().map(|p| p.columns.clone()).collect();
    let all_tables: Option<bool> =
        sqlx::query_scalar("SELECT puballtables FROM pg_publication WHERE pubname = $1")
            .bind(p)
            .fetch_optional(&mut *conn)
            .await?;
    // The publication statements, run with the identities' in one
    // transaction (below).
    let mut rewrite = Vec::new();
    if checked.exists && problems.is_empty() {
        r.ok(format!(
            "publication {p:?} delivers every change of {}",
            names(watch)
        ));
        // FOR ALL TABLES sends every column of every table: it has no
        // lists to narrow.
        if all_tables != Some(true) {
            wider(watch, &checked, &plans, p, r);
        }
    } else {
        let owned = owns_all(conn, watch).await?;
        if cfg.install_feed && (owned || role.superuser) {
            r.ok(format!(
                "publication {p:?} is created or repaired at start-up (database.install_feed; the role owns the tables)"
            ));
        } else {
            for problem in problems {
                r.missing(problem.clone());
            }
            if cfg.install_feed {
                r.note("database.install_feed = true, but only the tables' owner may add them to a publication: create it as below and set install_feed = false".into());
            }
            rewrite = publication::statements(all_tables, watch, p, &lists);
        }
    }
    // An identity advised below with a column the table's list in the
    // publication lacks: the list goes with it, or Postgres would refuse
    // the table's writes from the moment it is set.
    let outgrown =
        watch
            .tables
            .iter()
            .zip(&checked.columns)
            .zip(&plans)
            .any(|((_, list), plan)| {
                let (Some(list), Some(needed)) = (list, &plan.identity) else {
                    return false;
                };
                !needed.fix.is_empty()
                    && needed
                        .columns
                        .as_ref()
                        .is_none_or(|cols| cols.iter().any(|c| !list.contains(c)))
            });
    if outgrown && rewrite.is_empty() {
        rewrite = publication::statements(all_tables, watch, p, &lists);
    }
    let mut fine = true;
    let mut together = Vec::new();
    for needed in plans.iter().filter_map(|p| p.identity.as_ref()) {
        let Some(problem) = &needed.problem else {
            continue;
        };
        fine = false;
        r.missing(problem.clone());
        for sql in &needed.fix {
            // Not in a transaction block: Postgres refuses CONCURRENTLY there.
            if sql.starts_with("CREATE UNIQUE INDEX CONCURRENTLY") {
                r.statement(sql.clone());
            } else {
                together.push(sql.clone());
            }
        }
    }
    if fine {
        r.ok("every table's replica identity carries its key columns".into());
    }
    // A new identity and a column list that holds it, at once: in either
    // order one statement alone may leave a list without the identity's
    // columns, and the application's writes refused until the next runs.
    together.extend(rewrite);
    if together.len() > 1 {
        r.statement("BEGIN".into());
        together.into_iter().for_each(|sql| r.statement(sql));
        r.statement("COMMIT".into());
    } else {
        together.into_iter().for_each(|sql| r.statement(sql));
    }
    Ok(())
}

/// Notes each table the publication sends more columns of than the feed
/// needs (one made before column lists, or by hand): `bloomgate
/// install-feed` narrows it.
fn wider(
    watch: &crate::db::catalog::Watch,
    checked: &publication::Checked,
    plans: &[publication::Plan],
    p: &str,
    r: &mut Report,
) {
    for ((t, now), plan) in watch.tables.iter().zip(&checked.columns).zip(plans) {
        let Some(wanted) = &plan.columns else {
            continue;
        };
        let extra = match now {
            None => "every column".to_string(),
            Some(now) if !publication::same_columns(Some(now), Some(wanted)) => {
                let extra: Vec<&str> = now
                    .iter()
                    .filter(|c| !wanted.contains(c))
                    .map(String::as_str)
                    .collect();
                if extra.is_empty() {
                    continue;
                }
                extra.join(", ")
            }
            Some(_) => continue,
        };
        r.note(format!(
            "publication {p:?} sends {extra} of {}, where the feed needs only {}: `bloomgate install-feed` (as the tables' owner) narrows it to those (every running gateway resyncs once)",
            t.name,
            wanted.join(", ")
        ));
    }
}

/// The bus's needs (see the module doc).
pub(super) async fn bus(
    conn: &mut PgConnection,
    config: &Config,
    r: &mut Report,
) -> Result<(), sqlx::Error> {
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
    // the configured user (the append is tried below, on the same scratch
    // key).
    let probe = crate::feed::bus::redis::RedisBus::with_sentinels(
        b.url.as_deref().unwrap_or_default(),
        sentinels.as_ref(),
        &tls,
        format!("{}:preflight", b.prefix),
        crate::feed::Server {
            timeline: crate::feed::Timeline { system: 0, id: 1 },
            started_us: 0,
        },
        b.retention,
    );
    let mut probe = probe.map_err(|e| e.to_string());
    let answered = match &mut probe {
        Err(e) => Err(e.clone()),
        Ok(bus) => match tokio::time::timeout(Duration::from_secs(10), bus.head()).await {
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
    // A Redis that answers reads may still refuse the relay's writes (a
    // read-only replica, an ACL user without XADD, maxmemory reached), or
    // evict the stream (`feed::bus::redis`'s `writes`).
    if let Ok(bus) = &mut probe {
        match tokio::time::timeout(Duration::from_secs(10), bus.try_append()).await {
            Err(_) => r.missing("bus: the relay's append got no answer within 10 s".into()),
            Ok(Err(e)) => r.missing(format!(
                "bus: Redis refuses the relay's append ({e}): a read-only replica at bus.url, an ACL user without XADD, or maxmemory reached; no entry would ever be relayed"
            )),
            Ok(Ok(())) => r.ok("bus: Redis takes the relay's append (on a scratch key, deleted)".into()),
        }
        match tokio::time::timeout(Duration::from_secs(10), bus.memory()).await {
            Ok(Ok(m)) => match m.problem() {
                Some(problem) => r.missing(format!("bus: {problem}")),
                None => r.ok(format!(
                    "bus: maxmemory-policy {}, maxmemory {}",
                    m.policy,
                    match m.max {
                        0 => "unlimited".to_string(),
                        max => format!("{max} bytes, {} used", m.used),
                    }
                )),
            },
            Ok(Err(e)) => r.note(format!("bus: Redis' memory and eviction policy could not be read ({e}): check that maxmemory-policy is not allkeys-*")),
            Err(_) => r.note("bus: INFO memory got no answer within 10 s".into()),
        }
    }
    if b.read_from == crate::config::BusReadFrom::Replicas
        && let Ok(bus) = &mut probe
    {
        let listed = tokio::time::timeout(Duration::from_secs(10), bus.replicas_online()).await;
        match listed {
            Ok(Ok(online)) if !online.is_empty() => r.ok(format!(
                "bus.read_from = \"replicas\": the primary lists {} online ({}); each must know the gateways' ACL user, and answer at that address",
                online.len(),
                online.join(", ")
            )),
            Ok(Ok(_)) => r.note(
                "bus.read_from = \"replicas\": the primary lists no online replica; the gateways read the primary until one is".into(),
            ),
            Ok(Err(e)) => r.note(format!("bus.read_from = \"replicas\": the primary's replicas could not be listed ({e})")),
            Err(_) => r.note("bus.read_from = \"replicas\": the primary's replicas could not be listed (no answer within 10 s)".into()),
        }
    }
    // Snapshots: the fleet key as start-up reads it (never quoted).
    if let Some(path) = &b.fleet_key_file {
        match crate::snapshot::FleetKey::from_file(path) {
            Ok(k) => r.ok(format!(
                "bus.fleet_key_file: a fleet key (id {}; every gateway of the fleet must show the same)",
                k.id()
            )),
            Err(e) => r.missing(format!("bus.fleet_key_file: {e}")),
        }
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
        Some((_, true)) => r.ok(format!("bus.slot {:?} exists (a relay holds it)", b.slot)),
        Some((_, false)) => {
            r.ok(format!("bus.slot {:?} exists (free)", b.slot));
            // A permanent slot outlives the fleet: with no relay it keeps
            // every byte of WAL since, without limit unless
            // max_slot_wal_keep_size sets one.
            let (retained, keep): (Option<i64>, String) = sqlx::query_as(
                "SELECT (SELECT pg_current_wal_lsn() - restart_lsn FROM pg_replication_slots WHERE slot_name = $1)::int8,
                        current_setting('max_slot_wal_keep_size')",
            )
            .bind(&b.slot)
            .fetch_one(&mut *conn)
            .await?;
            r.note(format!(
                "bus.slot {:?} is held by no relay and keeps {} MB of WAL on the primary (max_slot_wal_keep_size = {keep}){}: a fleet taken down for good leaves it behind; drop it then with SELECT pg_drop_replication_slot('{}')",
                b.slot,
                retained.unwrap_or(0) / (1024 * 1024),
                if keep == "-1" { ", without limit" } else { "" },
                b.slot
            ));
        }
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
pub(super) async fn trigger_feed(
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
pub(super) async fn queue_table(
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
