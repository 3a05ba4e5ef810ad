//! The database: a connection pool and the only two things bloomgate asks of
//! Postgres, "this row as JSON" and "every key of this table".
//!
//! SQL text is built once per resource from validated identifiers (see
//! [`Queries`]) and every value is a bind parameter. Every query made is
//! counted, so tests can prove that a request did not reach the database.

/// Taken first by every statement that installs or removes bloomgate's
/// objects in a database (triggers, their functions, the change table, the
/// publication), as a transaction-level advisory lock: gateways starting
/// together would otherwise run the same DDL at once, and concurrent
/// `CREATE TABLE IF NOT EXISTS` or `CREATE OR REPLACE FUNCTION` fail on the
/// catalog's unique indexes instead of waiting.
pub const INSTALL_LOCK: &str = "SELECT pg_advisory_xact_lock(7092166037569233268);\n";
/// [`INSTALL_LOCK`]'s key ("bloomgat" in ASCII), for a bound parameter.
pub const INSTALL_LOCK_KEY: i64 = 7092166037569233268;

/// The cluster's system identifier as text where the role may read it,
/// else NULL: one SQL expression for every query that reads a position's
/// system, so that positions read by different parts of the gateway
/// compare (see `position`).
macro_rules! system_identifier_sql {
    () => {
        "CASE WHEN has_function_privilege('pg_control_system()', 'execute') \
         THEN (SELECT system_identifier::text FROM pg_control_system()) END"
    };
}
pub(crate) use system_identifier_sql;

mod bounded;
pub mod catalog;
pub mod copy;
pub mod identity;
pub mod lsn;
pub mod outage;
pub mod position;
pub mod publication;
pub mod reach;
pub mod replica_identity;
pub mod replicas;
mod scan;
pub mod stats;
pub mod tls;
pub mod triggers;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::Bytes;
use sqlx::postgres::{PgConnection, PgPoolOptions};
use sqlx::{Connection, Encode, PgPool, Postgres, Type};

use crate::config::DatabaseConfig;
use crate::key::Key;
use copy::CopyError;
use stats::{Tally, Target};

/// Where a row load may read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoadFrom {
    /// A replica that has replayed past every change the gateway has
    /// applied (`replicas`), else the primary.
    UpToDateReplica,
    /// The primary, whatever replicas there are: for a lookup the feed
    /// does not vouch for. A replica is read only past the changes the
    /// gateway has *applied*, and while the feed cannot vouch, commits it
    /// has not applied may be missing from a replica that looks current
    /// (cut off from the primary with the feed, say): only the primary
    /// answers what is committed now.
    Primary,
}

/// Whether `e` says the connection is gone rather than anything about the
/// query: a socket error, or the server ending the session (SQLSTATE class
/// 08, connection exception, or 57P01/57P02: `pg_terminate_backend`, a
/// shutdown). The next connection may well work.
fn is_dead_connection(e: &sqlx::Error) -> bool {
    match e {
        // Not a timeout: a server that does not answer (see `bounded`) is
        // no better on the next connection.
        sqlx::Error::Io(e) => e.kind() != std::io::ErrorKind::TimedOut,
        sqlx::Error::Database(db) => db
            .code()
            .is_some_and(|c| c.starts_with("08") || c == "57P01" || c == "57P02"),
        _ => false,
    }
}

/// A pooled connection idle for this long is pinged before it is used.
const PING_IF_IDLE_FOR: Duration = Duration::from_secs(1);

/// Migrations embedded in the binary.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error(transparent)]
    Sqlx(#[from] sqlx::Error),
    #[error("key stream: {0}")]
    Copy(#[from] CopyError),
    /// The row query found two rows for one key: the key is not unique
    /// (a view that repeats rows, or a unique index dropped). Neither row
    /// is served.
    #[error("the key matches more than one row")]
    NotUnique,
}

/// The pool plus counters, and the read replicas if any.
pub struct Db {
    pool: PgPool,
    pub stats: stats::DbStats,
    replicas: Option<Arc<replicas::Replicas>>,
    /// Whether the primary can be reached, as the row loads and the checks
    /// find it (see [`outage`]).
    pub outage: Arc<outage::Outage>,
    /// Whether the primary answers at all, asked when the pool cannot tell
    /// hung from busy (see [`reach`]).
    reach: reach::Reach,
    /// How long a query on the primary may go unanswered before its
    /// connection is taken for hung: `statement_timeout + acquire_timeout`
    /// (see [`bounded`]).
    query_deadline: Duration,
    /// Why the database could not be reached at the last try of
    /// [`Db::wait_until_reachable`], while it goes on trying (start-up's
    /// readiness names it: a database that does not exist, a refused
    /// login).
    waiting_on: std::sync::Mutex<Option<String>>,
    /// The server the change feed follows, which every connection is held
    /// to as it opens (see [`identity`]).
    pub identity: Arc<identity::Identity>,
}

/// The SQL for one resource, built from identifiers that config validation
/// has already restricted to `[A-Za-z_][A-Za-z0-9_]*` and quoted here anyway.
#[derive(Clone, Debug)]
pub struct Queries {
    /// One row as a JSON object, or no row; `$1` is the key. It asks for
    /// two rows: start-up proves a table's key unique, but a view cannot be
    /// proven so, and an index may be dropped between two checks, so a
    /// second row is the sign that the key names several (see
    /// [`DbError::NotUnique`]). Shared: every cache load holds a reference.
    pub row: Arc<str>,
    /// Exact row count, for sizing the filter.
    pub count: String,
    /// Every non-NULL key in binary COPY format.
    pub keys: String,
}

impl Queries {
    /// `key`: each key column with the type its bound value is cast to
    /// (`bigint`; `text::citext` to compare as the column does).
    pub fn new(table: &str, key: &[(&str, &str)], columns: &[String]) -> Self {
        let table_q = quote_table_name(table);
        let not_null = key
            .iter()
            .map(|(c, _)| format!("{} IS NOT NULL", quote(c)))
            .collect::<Vec<_>>()
            .join(" AND ");
        let typed = key
            .iter()
            .map(|(c, ty)| format!("{}::{ty}", quote(c)))
            .collect::<Vec<_>>()
            .join(", ");
        Self {
            row: Arc::from(Self::row_query(table, key, columns)),
            count: match key {
                [(c, _)] => format!("SELECT count({}) FROM {table_q}", quote(c)),
                _ => format!("SELECT count(*) FROM {table_q} WHERE {not_null}"),
            },
            keys: format!(
                // The cast makes the wire format the key type's, whatever the
                // column's own type (int4, varchar, ...).
                "COPY (SELECT {typed} FROM {table_q} WHERE {not_null}) TO STDOUT (FORMAT binary)"
            ),
        }
    }

    /// The row query for `key` (as [`Queries::new`] takes it). A key of
    /// one column is bound as itself; a composite key as one `text[]` of
    /// its parts' texts (`Key::db_texts`), each cast to its column's type,
    /// so that one query shape serves every mix of part types.
    pub fn row_query(table: &str, key: &[(&str, &str)], columns: &[String]) -> String {
        let table = quote_table_name(table);
        let cols = columns
            .iter()
            .map(|c| quote(c))
            .collect::<Vec<_>>()
            .join(", ");
        let filter = match key {
            [(c, ty)] => format!("{} = $1::{ty}", quote(c)),
            parts => parts
                .iter()
                .enumerate()
                .map(|(i, (c, ty))| format!("{} = ($1::text[])[{}]::{ty}", quote(c), i + 1))
                .collect::<Vec<_>>()
                .join(" AND "),
        };
        format!(
            "SELECT row_to_json(t)::text FROM (SELECT {cols} FROM {table} WHERE {filter} LIMIT 2) t"
        )
    }
}

fn quote_table_name(table: &str) -> String {
    table.split('.').map(quote).collect::<Vec<_>>().join(".")
}

fn quote(ident: &str) -> String {
    format!("\"{}\"", ident.replace('"', "\"\""))
}

impl Db {
    /// A lazy pool: nothing connects until the first query, so start-up does
    /// not fail while the database is still coming up.
    pub fn connect_lazy(cfg: &DatabaseConfig) -> Result<Self, sqlx::Error> {
        let timeout_ms = cfg.statement_timeout.as_millis().to_string();
        // TLS as the URL's libpq parameters say (see `tls`).
        let opts = tls::connect_options(&cfg.url)?
            .application_name("bloomgate")
            .options([("statement_timeout", timeout_ms.as_str())]);
        let identity = Arc::new(identity::Identity::default());
        let outage = Arc::new(outage::Outage::default());
        let pool = PgPoolOptions::new()
            .max_connections(cfg.pool_size)
            .acquire_timeout(cfg.acquire_timeout)
            // Which server it reached, before any row is read from it.
            .after_connect({
                let identity = identity.clone();
                let outage = outage.clone();
                move |conn, _| {
                    let identity = identity.clone();
                    let outage = outage.clone();
                    Box::pin(async move {
                        if identity.followed().is_none() {
                            return Ok(());
                        }
                        let (found, _) = position::Server::read(conn).await?;
                        // A server answered, whatever the verdict: a
                        // connection refused for reaching another one than
                        // the feed follows is no outage (see `outage`).
                        outage.answered();
                        identity.judge_primary(found)
                    })
                }
            })
            // sqlx pings a connection when it goes back to the pool, and by
            // default again when it is taken out: with the query, three round
            // trips per cache miss. A connection released moments ago was
            // alive then; only one that sat idle is pinged before use (the
            // idea of HikariCP's aliveBypassWindow). One that died in between
            // fails its query, and `fetch_json` retries it elsewhere.
            .test_before_acquire(false)
            .before_acquire({
                let identity = identity.clone();
                move |conn, meta| {
                    // Opened before the feed moved to another server: it may
                    // be on the old one (see `identity`).
                    let old = identity.opened_before_change(meta.age);
                    Box::pin(async move {
                        if old {
                            return Ok(false);
                        }
                        if meta.idle_for < PING_IF_IDLE_FOR {
                            return Ok(true);
                        }
                        conn.ping().await.map(|()| true)
                    })
                }
            })
            .connect_lazy_with(opts);
        let replicas = replicas::Replicas::new(cfg, pool.clone(), &identity)?.map(Arc::new);
        Ok(Self {
            replicas,
            identity,
            outage,
            query_deadline: cfg.statement_timeout.saturating_add(cfg.acquire_timeout),
            ..Self::from_pool(pool)
        })
    }

    pub fn from_pool(pool: PgPool) -> Self {
        Self {
            pool,
            stats: stats::DbStats::default(),
            replicas: None,
            outage: Arc::default(),
            reach: reach::Reach::default(),
            query_deadline: Duration::from_secs(60),
            waiting_on: std::sync::Mutex::default(),
            identity: Arc::default(),
        }
    }

    /// The read replicas, if `database.replica_urls` names any.
    pub fn replicas(&self) -> Option<&Arc<replicas::Replicas>> {
        self.replicas.as_ref()
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Queries sent so far (row fetches and key scans).
    pub fn queries(&self) -> u64 {
        self.stats.total()
    }

    /// Queries that failed so far.
    pub fn errors(&self) -> u64 {
        self.stats.errors.load(Ordering::Relaxed)
    }

    /// Counters, and the pool's connections, as of now.
    pub fn snapshot(&self) -> stats::DbSnapshot {
        self.stats.snapshot(&self.pool)
    }

    fn count<T, E>(&self, r: Result<T, E>) -> Result<T, E> {
        if r.is_err() {
            self.stats.errors.fetch_add(1, Ordering::Relaxed);
        }
        r
    }

    /// Why [`Db::wait_until_reachable`] is still waiting, if it is: the
    /// cause of its last failed try (no URL, no password).
    pub fn waiting_on(&self) -> Option<String> {
        self.waiting_on
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Start-up's step the database gave up on for now (a statement
    /// cancelled by `statement_timeout`, say), said where
    /// [`Db::waiting_on`] is: `/readyz` names it until the next try.
    pub fn note_waiting_on(&self, why: String) {
        *self.waiting_on.lock().unwrap_or_else(|p| p.into_inner()) = Some(why);
    }

    /// Whether the last check ([`Db::check_up`]) reached the database.
    pub fn is_up(&self) -> bool {
        self.stats.up.load(Ordering::Relaxed)
    }

    /// Records what a query's result says of the primary's reachability
    /// ([`Db::outage`]). A pool that timed out while holding connections
    /// (all busy, or hung on a frozen server) cannot say which: the server
    /// is asked from outside the pool ([`reach`]).
    async fn note_reach<T>(&self, r: &Result<T, sqlx::Error>) {
        match r {
            Ok(_) => self.outage.answered(),
            Err(sqlx::Error::PoolTimedOut)
                if self.pool.size() > 0
                    && !self
                        .identity
                        .refused_within(self.pool.options().get_acquire_timeout()) =>
            {
                self.judge_by_probe().await;
            }
            // A pool that timed out because every connection it opened was
            // refused for reaching another server than the one followed
            // (see `identity`) reached a server that answers: no outage,
            // and none goes on (nothing vouched for on the old server is
            // answered as stale while the feed moves).
            Err(e) if outage::is_unreachable(e, self.pool.size()) => {
                match self
                    .identity
                    .refused_within(self.pool.options().get_acquire_timeout())
                {
                    true => self.outage.answered(),
                    false => self.outage.failed(),
                }
            }
            Err(_) => {}
        }
    }

    /// The verdict of [`reach`] recorded: a server that does not answer a
    /// new connection within `acquire_timeout` is an outage; one that does
    /// is up (busy at most). Returns whether it answered.
    async fn judge_by_probe(&self) -> bool {
        let answered = self
            .reach
            .answers(
                &self.pool.connect_options(),
                self.pool.options().get_acquire_timeout(),
            )
            .await;
        match answered {
            true => self.outage.answered(),
            false => self.outage.failed(),
        }
        answered
    }

    /// One round trip through the pool; records the verdict ([`Db::is_up`]).
    /// The error names the cause: the pool says only "pool timed out" when
    /// every connection attempt failed, so one connection is then opened
    /// directly to hear why (a refused password, a database that does not
    /// exist, a refused TCP connection). No URL, no password in it.
    pub async fn check_up(&self) -> Result<(), String> {
        // Bounded: a pooled connection to a frozen server would hold this
        // check (and the readiness it feeds) for as long as TCP waits.
        let r = async {
            let mut conn = self.acquire_guarded().await?;
            let r = self
                .bounded(sqlx::query("SELECT 1").execute(conn.conn()))
                .await;
            conn.finish(&r);
            r
        }
        .await;
        self.stats.up.store(r.is_ok(), Ordering::Relaxed);
        self.note_reach(&r).await;
        match r {
            Ok(_) => Ok(()),
            Err(sqlx::Error::PoolTimedOut) => {
                let opts = (*self.pool.connect_options()).clone();
                let direct = tokio::time::timeout(
                    Duration::from_secs(10),
                    PgConnection::connect_with(&opts),
                )
                .await;
                Err(match direct {
                    Ok(Err(e)) => e.to_string(),
                    Ok(Ok(mut conn)) => {
                        // It connects: the pool's connections may be refused
                        // for reaching another server (see `identity`).
                        let judged = self.identity.check_primary(&mut conn).await;
                        let _ = conn.close().await;
                        match judged {
                            Err(e) => e.to_string(),
                            Ok(()) => {
                                "no connection free in the pool within database.acquire_timeout"
                                    .into()
                            }
                        }
                    }
                    Err(_) => "connecting timed out".into(),
                })
            }
            Err(e) => Err(e.to_string()),
        }
    }

    /// Waits until the database answers, retrying with capped exponential
    /// backoff; logs the cause (a refused password, say) at most once per
    /// [`crate::telemetry::LogThrottle::INTERVAL`] (and whenever it
    /// changes), without the URL, which may hold a password.
    pub async fn wait_until_reachable(&self) {
        let mut delay = Duration::from_millis(100);
        let mut attempt = 1u32;
        let throttle = crate::telemetry::LogThrottle::default();
        let mut last_cause = String::new();
        loop {
            let checked = self.check_up().await;
            *self.waiting_on.lock().unwrap_or_else(|p| p.into_inner()) = checked.clone().err();
            match checked {
                Ok(()) => return,
                Err(cause) => {
                    let changed = cause != last_cause;
                    if let Some(not_logged) = throttle.permit().or(changed.then_some(0)) {
                        tracing::warn!(
                            attempt,
                            retry_in_s = delay.as_secs_f64(),
                            cause = %cause,
                            not_logged,
                            "database not reachable yet; retrying (at most one such line per 10 s)"
                        );
                    }
                    last_cause = cause;
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(5));
                    attempt += 1;
                }
            }
        }
    }

    /// Checks the database every `every` until `shutdown`, keeping
    /// [`Db::is_up`] current, and logs the cause while it fails (at most
    /// once per 10 s), and when it answers again.
    pub async fn watch_up(
        self: Arc<Self>,
        every: Duration,
        mut shutdown: crate::shutdown::Shutdown,
    ) {
        let throttle = crate::telemetry::LogThrottle::default();
        let mut was_up = true;
        loop {
            tokio::select! {
                () = shutdown.fired() => return,
                () = tokio::time::sleep(every) => {}
            }
            match self.check_up().await {
                Ok(()) => {
                    if !was_up {
                        tracing::info!("database reachable again");
                    }
                    was_up = true;
                }
                Err(cause) => {
                    if let Some(not_logged) = throttle.permit() {
                        tracing::warn!(cause = %cause, not_logged, "database not reachable (at most one such line per 10 s)");
                    }
                    was_up = false;
                }
            }
        }
    }

    pub async fn migrate(&self) -> Result<(), sqlx::migrate::MigrateError> {
        MIGRATOR.run(&self.pool).await
    }

    /// Creates (or replaces) the trigger function and triggers of `table`
    /// (canonical, see [`catalog`]) announcing the key `columns` of every
    /// resource on it to `sink` (the queue sink's table too, if missing);
    /// see [`triggers`].
    pub async fn install_triggers(
        &self,
        table: &catalog::TableName,
        columns: &[&str],
        sink: triggers::Sink,
    ) -> Result<(), DbError> {
        // One implicit transaction (a multi-statement simple query): the
        // lock is held to its end.
        let sql = triggers::install_with_table(table, columns, sink);
        sqlx::raw_sql(&sql).execute(&self.pool).await?;
        Ok(())
    }

    /// Drops bloomgate's function and triggers from `table`, under the
    /// install lock.
    pub async fn remove_triggers(&self, table: &catalog::TableName) -> Result<(), DbError> {
        let sql = format!("{INSTALL_LOCK}{}", triggers::uninstall_sql(table));
        sqlx::raw_sql(&sql).execute(&self.pool).await?;
        Ok(())
    }

    /// The row for `key` as JSON text, or `None` when there is no such row
    /// (the primary or an up-to-date replica; a lookup by a [`Key`] uses
    /// [`Db::fetch_key`]).
    ///
    /// A dead connection ([`is_dead_connection`]) is retried on another, at
    /// most once per pool slot: it is a pooled connection that died after
    /// its last use (see `connect_lazy`), and repeating a one-row read is
    /// harmless. A database
    /// that is down fails to connect instead, which is not retried here (the
    /// pool already retries refused connections until `acquire_timeout`).
    pub async fn fetch_json<K>(
        &self,
        sql: &str,
        key: K,
        tally: Tally<'_>,
    ) -> Result<Option<Bytes>, DbError>
    where
        K: for<'q> Encode<'q, Postgres> + Type<Postgres> + Clone + Send + 'static,
    {
        self.fetch_json_from(sql, key, tally, true).await
    }

    /// The row for `key` as JSON text, read where `from` allows (see
    /// [`Db::fetch_json`] for the retries): the one place a [`Key`]'s
    /// variant becomes a bound parameter of the row query.
    pub async fn fetch_key(
        &self,
        sql: &str,
        key: &Key,
        tally: Tally<'_>,
        from: LoadFrom,
    ) -> Result<Option<Bytes>, DbError> {
        let replicas = from == LoadFrom::UpToDateReplica;
        match key {
            Key::Int(v) => self.fetch_json_from(sql, *v, tally, replicas).await,
            Key::Uuid(u) => self.fetch_json_from(sql, *u, tally, replicas).await,
            Key::Text(s) => {
                self.fetch_json_from(sql, s.to_string(), tally, replicas)
                    .await
            }
            Key::Tuple(_) => {
                self.fetch_json_from(sql, key.db_texts(), tally, replicas)
                    .await
            }
        }
    }

    async fn fetch_json_from<K>(
        &self,
        sql: &str,
        key: K,
        tally: Tally<'_>,
        replicas: bool,
    ) -> Result<Option<Bytes>, DbError>
    where
        K: for<'q> Encode<'q, Postgres> + Type<Postgres> + Clone + Send + 'static,
    {
        // A replica far enough along for this load (see `replicas`); if its
        // query fails, the primary answers instead.
        if replicas
            && let Some(reps) = &self.replicas
            && let Some(replica) = reps.for_load().await
        {
            let began = Instant::now();
            let r = sqlx::query_scalar::<_, String>(sql)
                .bind(key.clone())
                .fetch_all(replica.pool())
                .await;
            match r {
                Ok(rows) => {
                    replica.queries.fetch_add(1, Ordering::Relaxed);
                    self.stats.query(tally, Target::Replica);
                    self.stats.row_took(Target::Replica, began.elapsed());
                    return one_row(rows);
                }
                Err(e) => {
                    tracing::debug!(replica = %replica.name, error = %e, "replica load failed; using the primary");
                    replica.failed();
                }
            }
        }
        let mut stale = 0;
        loop {
            let began = Instant::now();
            let r = async {
                let mut conn = self.acquire_guarded().await?;
                let r = self
                    .bounded(
                        sqlx::query_scalar::<_, String>(sql)
                            .bind(key.clone())
                            .fetch_all(conn.conn()),
                    )
                    .await;
                conn.finish(&r);
                r
            }
            .await;
            match r {
                Err(e)
                    if is_dead_connection(&e)
                        && stale < self.pool.options().get_max_connections() =>
                {
                    stale += 1;
                }
                // Counted once it ran (or failed for good): a dead
                // connection never executed its query.
                r => {
                    self.stats.query(tally, Target::Primary);
                    self.stats.row_took(Target::Primary, began.elapsed());
                    self.note_reach(&r).await;
                    return one_row(self.count(r)?);
                }
            }
        }
    }
}

/// The row query's answer (at most two rows, see [`Queries::row`]): none,
/// the row, or [`DbError::NotUnique`].
fn one_row(mut rows: Vec<String>) -> Result<Option<Bytes>, DbError> {
    match rows.len() {
        0 => Ok(None),
        1 => Ok(rows.pop().map(Bytes::from)),
        _ => Err(DbError::NotUnique),
    }
}

pub use scan::CANCEL_WITHIN;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_install_lock_statement_and_its_key_agree() {
        assert!(INSTALL_LOCK.contains(&format!("({INSTALL_LOCK_KEY})")));
        assert_eq!(INSTALL_LOCK_KEY.to_be_bytes(), *b"bloomgat");
    }

    #[test]
    fn queries_quote_identifiers_and_bind_the_key() {
        let q = Queries::new(
            "public.users",
            &[("id", "bigint")],
            &["id".into(), "name".into()],
        );
        assert_eq!(
            &*q.row,
            r#"SELECT row_to_json(t)::text FROM (SELECT "id", "name" FROM "public"."users" WHERE "id" = $1::bigint LIMIT 2) t"#
        );
        assert!(
            q.keys
                .starts_with(r#"COPY (SELECT "id"::bigint FROM "public"."users""#)
        );
        assert!(q.keys.ends_with("(FORMAT binary)"));
        let q = Queries::new(
            "orders",
            &[("tenant_id", "bigint"), ("order_no", "text")],
            &["item".into()],
        );
        assert_eq!(
            &*q.row,
            r#"SELECT row_to_json(t)::text FROM (SELECT "item" FROM "orders" WHERE "tenant_id" = ($1::text[])[1]::bigint AND "order_no" = ($1::text[])[2]::text LIMIT 2) t"#
        );
        assert_eq!(
            q.keys,
            r#"COPY (SELECT "tenant_id"::bigint, "order_no"::text FROM "orders" WHERE "tenant_id" IS NOT NULL AND "order_no" IS NOT NULL) TO STDOUT (FORMAT binary)"#
        );
        assert_eq!(
            q.count,
            r#"SELECT count(*) FROM "orders" WHERE "tenant_id" IS NOT NULL AND "order_no" IS NOT NULL"#
        );
    }
}
