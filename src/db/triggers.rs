//! The triggers behind the `notify` and `queue` feeds: one small function
//! and two triggers per table, generated with every watched key column
//! written in. The function hands its payload to a [`Sink`]: `pg_notify`
//! (the `notify` feed), or a row in the change table [`QUEUE_TABLE`] (the
//! `queue` feed, `feed::queue`).
//!
//! # What a trigger guarantees
//! - **Every resource gets its own key.** The function announces the value
//!   of every key column of every resource on the table (`users` by `id` and
//!   `users_by_email` by `email`: both), in the new row (INSERT, UPDATE) and,
//!   when any of them changed, the old row (UPDATE, DELETE).
//! - **Canonical text.** Each value is `NEW.col::text`, exactly what the key
//!   scan reads (`feed` module doc): a `char(n)` key loses its padding on
//!   both sides, a `uuid` is lower case on both sides. "Changed" is decided
//!   on that text too, so a `citext` key whose case changed counts as
//!   changed (the gateway's keys are case-sensitive).
//! - **Only the key columns are read.** Never `to_jsonb(NEW)`: a row's
//!   other columns, TOASTed or not, are neither detoasted nor serialised, so
//!   a write costs the same whatever the row holds besides its keys.
//! - **A write never fails because of the trigger.** `pg_notify` refuses a
//!   payload of 8000 bytes or more; the length is measured on the final JSON
//!   text (after escaping: one `"` is two bytes, one `chr(1)` six), and a
//!   payload that would not fit is replaced by a `RESCAN` of the table,
//!   which makes the gateways rebuild its filters instead. The change table
//!   takes any length, so the queue sink never needs that.
//! - **The queue sink takes no lock at commit and cannot be forged from
//!   the outside.** A notifying transaction takes a cluster-wide lock at
//!   commit (Postgres keeps notifications in commit order that way), which
//!   serialises every writer's commit; a row in a table does not. Nobody
//!   but the change table's owner may write to it (`REVOKE ALL ... FROM
//!   PUBLIC`): the function is `SECURITY DEFINER`, owned by whoever
//!   installed it, with a fixed `search_path`, so the application's roles
//!   need no privilege on the table and cannot insert into it directly;
//!   nobody may execute the function (so nobody can attach it to a table
//!   of their own), which firing the installed triggers does not need.
//! - **The table is named as the gateway names it**: the canonical
//!   `schema.table` ([`TableName`]) written in as a literal, so a trigger on
//!   a partitioned table (which Postgres clones onto every partition)
//!   announces the parent.
//!
//! # Payload
//! JSON, put together by concatenation (values escaped by `to_json(text)`):
//! `{"table": "public.users", "op": "INSERT"|"UPDATE"|"DELETE"|"TRUNCATE"|"RESCAN",
//!   "new": {"id": "1", "email": "a@b"}, "old": {...}, "ts": <epoch seconds>}`;
//! `new`/`old` only where they apply, `old` on UPDATE only when a key
//! changed. A NULL key is JSON `null`.
//!
//! # Names
//! Function and triggers are named `bloomgate_notify_<table>_<hash>` (the
//! hash of the canonical name keeps names distinct and under 63 bytes), in
//! the table's schema. Installing again replaces them (`CREATE OR
//! REPLACE`), so the key columns written in are those of the config that
//! installed last: one config per database.

use super::catalog::{TableName, quote, quote_table};

/// The channel every trigger notifies.
pub const CHANNEL: &str = "bloomgate";

/// The change table of the `queue` sink.
pub const QUEUE_TABLE: &str = "public.bloomgate_changes";

/// Where a trigger function puts its payload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sink {
    /// `pg_notify` on [`CHANNEL`].
    Notify,
    /// A row of [`QUEUE_TABLE`].
    Queue,
}

impl Sink {
    /// A text only this sink's generated function contains (to tell which
    /// one is installed).
    pub fn marker(self) -> &'static str {
        match self {
            Sink::Notify => "pg_notify(",
            Sink::Queue => "INSERT INTO public.bloomgate_changes",
        }
    }
}

/// The change table of the `queue` sink, created if missing, and its
/// pruning mark. `xid` is the writer's top-level transaction id, by which
/// the feed tells which changes a snapshot shows (see `feed::queue`); it is
/// indexed for that, and for the deletion of old rows.
/// `bloomgate_changes_pruned.below` only rises: every row of a transaction
/// below it may have been deleted (a gateway raises it before it deletes).
/// Only the owner may touch either table: every privilege anyone else
/// holds on them is revoked, those that default privileges (`ALTER DEFAULT
/// PRIVILEGES ... GRANT ... ON TABLES`) gave at creation included;
/// `feed::queue` refuses to start on a table someone else may write (see
/// [`QUEUE_TABLE_CHECK`]).
pub const QUEUE_TABLE_SQL: &str = "DO $bloomgate$
DECLARE
    t text;
    grantee oid;
BEGIN
    -- Only what is missing: an install must not lock a change table that
    -- exists, or it deadlocks with writers whose triggers write to it
    -- (see the install's lock order, `Db::install_triggers`).
    IF to_regclass('public.bloomgate_changes') IS NULL THEN
        CREATE TABLE public.bloomgate_changes (
            xid     xid8 NOT NULL DEFAULT pg_current_xact_id(),
            payload text NOT NULL
        );
        COMMENT ON TABLE public.bloomgate_changes IS
            'Written by bloomgate''s triggers, read and pruned by its gateways (database.freshness = queue).';
        CREATE INDEX bloomgate_changes_xid ON public.bloomgate_changes (xid);
    END IF;
    IF to_regclass('public.bloomgate_changes_pruned') IS NULL THEN
        CREATE TABLE public.bloomgate_changes_pruned (below xid8 NOT NULL);
        INSERT INTO public.bloomgate_changes_pruned VALUES ('0');
    END IF;
    FOREACH t IN ARRAY ARRAY['public.bloomgate_changes', 'public.bloomgate_changes_pruned'] LOOP
        FOR grantee IN
            SELECT DISTINCT a.grantee FROM pg_class c, aclexplode(c.relacl) a
             WHERE c.oid = t::regclass AND a.grantee <> c.relowner
        LOOP
            IF grantee = 0 THEN
                EXECUTE format('REVOKE ALL ON TABLE %s FROM PUBLIC', t);
            ELSE
                EXECUTE format('REVOKE ALL ON TABLE %s FROM %I', t, pg_get_userbyid(grantee));
            END IF;
        END LOOP;
    END LOOP;
END
$bloomgate$;
";

/// Why the change table or its pruning mark cannot be trusted, or no row:
/// each must exist as a plain table, owned by the current role or a
/// superuser (on Postgres 14 and older anyone may create tables in
/// `public`, so an attacker could have created one first), with no
/// triggers or rules (which would run inside the definer's functions), and
/// nobody but its owner may write it.
pub const QUEUE_TABLE_CHECK: &str = "SELECT why FROM (SELECT n || CASE
    WHEN c.oid IS NULL THEN ' is missing'
    WHEN c.relkind <> 'r' THEN ' is not a plain table'
    WHEN c.relowner <> (SELECT oid FROM pg_roles WHERE rolname = current_user)
         AND NOT (SELECT rolsuper FROM pg_roles WHERE oid = c.relowner)
        THEN ' is owned by ' || quote_ident(pg_get_userbyid(c.relowner)) || ', neither this role nor a superuser'
    WHEN c.relhastriggers OR c.relhasrules THEN ' has triggers or rules'
    WHEN EXISTS (SELECT 1 FROM aclexplode(c.relacl) a
                  WHERE a.grantee <> c.relowner
                    AND a.privilege_type IN ('INSERT', 'UPDATE', 'DELETE', 'TRUNCATE', 'TRIGGER', 'REFERENCES'))
        THEN ' may be written by roles other than its owner: ' || (
            SELECT string_agg(DISTINCT CASE a.grantee WHEN 0 THEN 'PUBLIC' ELSE quote_ident(pg_get_userbyid(a.grantee)) END, ', ')
              FROM aclexplode(c.relacl) a WHERE a.grantee <> c.relowner)
END
AS why
FROM unnest(ARRAY['public.bloomgate_changes', 'public.bloomgate_changes_pruned']) n
LEFT JOIN pg_class c ON c.oid = to_regclass(n)) checked
WHERE why IS NOT NULL ORDER BY why LIMIT 1";
/// `pg_notify` refuses payloads of this many bytes or more.
pub const MAX_PAYLOAD: usize = 8000;

/// The name of `table`'s function and row trigger (the truncate trigger
/// adds `_t`): `bloomgate_notify_<table>_<8 hex>`.
pub fn function_name(table: &str) -> String {
    let rel = table.rsplit('.').next().unwrap_or(table);
    let short: String = rel
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' {
                c.to_ascii_lowercase()
            } else {
                '_'
            }
        })
        .take(30)
        .collect();
    format!("bloomgate_notify_{short}_{:08x}", fnv1a(table) as u32)
}

/// FNV-1a: stable across builds and platforms (names must not change
/// between versions, or an upgrade leaves the old triggers behind).
fn fnv1a(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

fn literal(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

/// The SQL (several statements, one simple-protocol query: Postgres runs it
/// as one transaction) that creates or replaces the function and triggers
/// of `table` announcing `columns` (distinct key column names, as they are
/// spelled in the table) to `sink`. The queue sink needs [`QUEUE_TABLE_SQL`]
/// run after it, in the same transaction (see [`install_with_table`]).
pub fn install_sql(table: &TableName, columns: &[&str], sink: Sink) -> String {
    assert!(
        !columns.is_empty(),
        "a table is watched for some key column"
    );
    let name = function_name(table);
    let schema = table.split_once('.').map_or("public", |(s, _)| s);
    let function = format!("{}.{}", quote(schema), quote(&name));
    let target = quote_table(table);
    // The payload is put together by concatenation: the table, the ops and
    // the column names are JSON-escaped here, once; each value goes through
    // `to_json(text)`, which escapes it. About 4 % cheaper per row than
    // `json_build_object` (bench/trigger-cost.sh).
    let json = |text: &str| serde_json::to_string(text).expect("a string serialises");
    let head = |op: &str| literal(&format!(r#"{{"table":{},"op":"{op}""#, json(table)));
    let object = |row: &str| {
        let fields = columns
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let sep = if i == 0 { "{" } else { "," };
                format!(
                    "{} || coalesce(to_json({row}.{}::text)::text, 'null')",
                    literal(&format!("{sep}{}:", json(c))),
                    quote(c)
                )
            })
            .collect::<Vec<_>>()
            .join(" || ");
        format!("{fields} || '}}'")
    };
    let (new, old) = (object("NEW"), object("OLD"));
    let unchanged = columns
        .iter()
        .map(|c| {
            let c = quote(c);
            format!("NEW.{c}::text IS NOT DISTINCT FROM OLD.{c}::text")
        })
        .collect::<Vec<_>>()
        .join(" AND ");
    let ts = r#"',"ts":' || extract(epoch FROM clock_timestamp()) || '}'"#;
    let (insert, update, delete, truncate, rescan) = (
        head("INSERT"),
        head("UPDATE"),
        head("DELETE"),
        head("TRUNCATE"),
        head("RESCAN"),
    );
    // The queue sink: a definer's function with a search path nobody else
    // can put objects in front of (pg_catalog first, temporary schemas
    // last), every name in it qualified.
    // Anyone may execute a new function, and `CREATE TRIGGER` needs only
    // that: a definer's function attached to a table of one's own would
    // write forged rows as the definer. Firing the installed triggers
    // checks no privilege, so the writers lose nothing.
    let revoke = match sink {
        Sink::Notify => String::new(),
        Sink::Queue => format!("REVOKE ALL ON FUNCTION {function}() FROM PUBLIC;\n"),
    };
    let (attributes, destination, deliver) = match sink {
        Sink::Notify => (
            "",
            format!("on channel '{CHANNEL}'"),
            format!(
                "-- Measured on the final text: pg_notify refuses {MAX_PAYLOAD} bytes or
    -- more, and failing here would roll back the writer's transaction.
    IF octet_length(payload) >= {MAX_PAYLOAD} THEN
        payload := {rescan} || {ts};
    END IF;
    PERFORM pg_notify('{CHANNEL}', payload);"
            ),
        ),
        Sink::Queue => (
            "\nSECURITY DEFINER SET search_path = pg_catalog, pg_temp",
            format!("into {QUEUE_TABLE}"),
            "INSERT INTO public.bloomgate_changes (payload) VALUES (payload);".to_string(),
        ),
    };
    format!(
        r#"CREATE OR REPLACE FUNCTION {function}() RETURNS trigger
LANGUAGE plpgsql{attributes} AS $bloomgate$
-- Generated by bloomgate (db::triggers): announces the key columns of
-- {table} {destination}. Reads only those columns.
DECLARE
    payload text;
BEGIN
    IF TG_OP = 'INSERT' THEN
        payload := {insert} || ',"new":' || {new} || {ts};
    ELSIF TG_OP = 'DELETE' THEN
        payload := {delete} || ',"old":' || {old} || {ts};
    ELSIF TG_OP = 'UPDATE' THEN
        IF {unchanged} THEN
            payload := {update} || ',"new":' || {new} || {ts};
        ELSE
            payload := {update} || ',"new":' || {new} || ',"old":' || {old} || {ts};
        END IF;
    ELSE
        payload := {truncate} || {ts};
    END IF;
    {deliver}
    RETURN NULL;
END
$bloomgate$;
CREATE OR REPLACE TRIGGER {trigger} AFTER INSERT OR UPDATE OR DELETE ON {target}
    FOR EACH ROW EXECUTE FUNCTION {function}();
CREATE OR REPLACE TRIGGER {trigger_t} AFTER TRUNCATE ON {target}
    FOR EACH STATEMENT EXECUTE FUNCTION {function}();
{revoke}"#,
        trigger = quote(&name),
        trigger_t = quote(&format!("{name}_t")),
    )
}

/// The SQL that drops what [`install_sql`] created for `table`.
pub fn uninstall_sql(table: &TableName) -> String {
    let name = function_name(table);
    let schema = table.split_once('.').map_or("public", |(s, _)| s);
    let target = quote_table(table);
    format!(
        "DROP TRIGGER IF EXISTS {t} ON {target};
         DROP TRIGGER IF EXISTS {tt} ON {target};
         DROP FUNCTION IF EXISTS {s}.{t}();",
        t = quote(&name),
        tt = quote(&format!("{name}_t")),
        s = quote(schema),
    )
}

/// The whole install of `table`'s triggers as one transaction: the install
/// lock, the function and triggers, then (queue sink) whatever of the
/// change table is missing. In that order a writer's order (its table,
/// then through its trigger the change table) is the install's too, and
/// an existing change table is not locked at all: installing while the
/// application writes cannot deadlock with it.
pub fn install_with_table(table: &TableName, columns: &[&str], sink: Sink) -> String {
    let mut sql = String::from(super::INSTALL_LOCK);
    sql.push_str(&install_sql(table, columns, sink));
    if sink == Sink::Queue {
        sql.push('\n');
        sql.push_str(QUEUE_TABLE_SQL);
    }
    sql
}

/// `table`'s triggers and their function as catalog rows (OIDs and row
/// versions), for `feed::tracker`: any edit changes it, even one undone.
pub async fn fingerprint(
    conn: &mut sqlx::PgConnection,
    table: &TableName,
) -> Result<String, sqlx::Error> {
    let name = function_name(table);
    sqlx::query_scalar(
        "SELECT coalesce(string_agg(g.oid::text || ':' || g.xmin::text || ':' || p.oid::text
                                    || ':' || p.xmin::text, ',' ORDER BY g.tgname), '-')
           FROM pg_trigger g JOIN pg_proc p ON p.oid = g.tgfoid
          WHERE g.tgrelid = to_regclass($1) AND g.tgname IN ($2, $2 || '_t')",
    )
    .bind(quote_table(table))
    .bind(&name)
    .fetch_one(conn)
    .await
}

/// What is wrong with `table`'s trigger for a feed reading `sink` and keys
/// `columns`, naming the fix; `None` when it announces every change with
/// every key column. Missing, disabled, delivering to the other feed, or
/// installed by a config that watched other key columns: the table's
/// changes would be seen only at rebuilds.
pub async fn problem(
    conn: &mut sqlx::PgConnection,
    table: &TableName,
    columns: &[&str],
    sink: Sink,
) -> Result<Option<String>, sqlx::Error> {
    let name = function_name(table);
    let source: Option<(String, bool)> = sqlx::query_as(
        "SELECT p.prosrc, g.tgenabled <> 'D' FROM pg_trigger g JOIN pg_proc p ON p.oid = g.tgfoid
          WHERE g.tgrelid = to_regclass($1) AND g.tgname = $2",
    )
    .bind(quote_table(table))
    .bind(&name)
    .fetch_optional(&mut *conn)
    .await?;
    let fix = "run `bloomgate install-triggers` (or set database.install_triggers = true)";
    Ok(match source {
        None => Some(format!("table {table} has no bloomgate trigger: {fix}")),
        Some((_, false)) => Some(format!(
            "the bloomgate trigger of {table} is disabled: {fix}"
        )),
        Some((src, true)) if !src.contains(sink.marker()) => Some(format!(
            "the bloomgate trigger of {table} delivers to the other feed (installed for another database.freshness?): {fix}"
        )),
        Some((src, true)) => {
            let missing: Vec<&str> = columns
                .iter()
                .copied()
                .filter(|c| !src.contains(&format!("NEW.{}::text", quote(c))))
                .collect();
            (!missing.is_empty()).then(|| {
                format!(
                    "the bloomgate trigger of {table} does not announce {} (installed by another config?): {fix}",
                    missing.join(", ")
                )
            })
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn names_are_stable_short_and_distinct() {
        assert_eq!(function_name("public.users"), function_name("public.users"));
        assert_ne!(function_name("public.users"), function_name("app.users"));
        let long = format!("public.{}", "x".repeat(63));
        assert!(function_name(&long).len() <= 63);
        assert!(function_name("public.users").starts_with("bloomgate_notify_users_"));
        // Pinned: a change would leave old triggers behind on upgrade.
        assert_eq!(
            function_name("public.users"),
            "bloomgate_notify_users_896e6dda"
        );
    }

    #[test]
    fn the_function_reads_only_the_key_columns() {
        let t: TableName = Arc::from("public.users");
        let sql = install_sql(&t, &["id", "email"], Sink::Notify);
        assert!(!sql.contains("to_jsonb"), "{sql}");
        // `to_json` only ever of one key column's text.
        assert_eq!(
            sql.matches("to_json(").count(),
            sql.matches("to_json(NEW.\"").count() + sql.matches("to_json(OLD.\"").count()
        );
        assert!(!sql.contains("to_json(NEW)") && !sql.contains("to_json(OLD)"));
        assert!(!sql.contains("row_to_json"), "{sql}");
        assert!(sql.contains(r#"'{"id":' || coalesce(to_json(NEW."id"::text)::text, 'null') || ',"email":' || coalesce(to_json(NEW."email"::text)::text, 'null') || '}'"#), "{sql}");
        assert!(sql.contains(r#"coalesce(to_json(OLD."email"::text)::text, 'null')"#));
        assert!(sql.contains(r#"'{"table":"public.users","op":"INSERT"'"#));
        assert!(sql.contains(r#"ON "public"."users""#));
        assert!(sql.contains("octet_length(payload) >= 8000"));
        assert!(sql.contains(Sink::Notify.marker()) && !sql.contains(Sink::Queue.marker()));
        assert!(!sql.contains("SECURITY DEFINER"));
    }

    #[test]
    fn the_queue_sink_writes_one_row_as_the_definer() {
        let t: TableName = Arc::from("public.users");
        let notify = install_sql(&t, &["id"], Sink::Notify);
        let queue = install_sql(&t, &["id"], Sink::Queue);
        assert!(queue.contains(Sink::Queue.marker()) && !queue.contains(Sink::Notify.marker()));
        assert!(queue.contains("SECURITY DEFINER SET search_path = pg_catalog, pg_temp"));
        assert!(queue.contains(
            "REVOKE ALL ON FUNCTION \"public\".\"bloomgate_notify_users_896e6dda\"() FROM PUBLIC;"
        ));
        assert!(!queue.contains("octet_length"), "a table takes any length");
        // The same function name: switching sinks replaces it.
        assert_eq!(
            notify.lines().next(),
            queue.lines().next(),
            "one function per table, whichever the sink"
        );
        // Both tables lose every grant (checked on a server in
        // tests/it/feed/queue.rs `only_the_triggers_write_the_change_table`).
        for t in [
            "'public.bloomgate_changes'",
            "'public.bloomgate_changes_pruned'",
        ] {
            assert!(QUEUE_TABLE_SQL.contains(t), "{t}");
            assert!(QUEUE_TABLE_CHECK.contains(t), "{t}");
        }
        assert!(QUEUE_TABLE_SQL.contains("REVOKE ALL ON TABLE %s FROM PUBLIC"));
    }
}
