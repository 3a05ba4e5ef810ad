//! The tables, the resources serving them, the gateway's config, and the
//! oracle's query.

use std::collections::HashMap;

use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, utf8_percent_encode};
use serde_json::Value;
use sqlx::PgConnection;

use crate::Feed;

/// A resource the checker compares. The marker resource (see `history`)
/// is not one: it only tells how far a gateway got.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Res {
    Users,
    UsersByEmail,
    Docs,
    Tags,
    Events,
    /// A composite key, `(tenant_id bigint, order_no text)`: its path's
    /// key is `{tenant_id}/{order_no}` (see [`Path::order`]).
    Orders,
}

impl Res {
    pub const ALL: [Res; 6] = [
        Res::Users,
        Res::UsersByEmail,
        Res::Docs,
        Res::Tags,
        Res::Events,
        Res::Orders,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Res::Users => "users",
            Res::UsersByEmail => "users_by_email",
            Res::Docs => "docs",
            Res::Tags => "tags",
            Res::Events => "events",
            Res::Orders => "orders",
        }
    }

    /// The config's `route`.
    pub fn route(self) -> &'static str {
        match self {
            Res::Users => "/users/{key}",
            Res::UsersByEmail => "/users-by-email/{key}",
            Res::Docs => "/docs/{key}",
            Res::Tags => "/tags/{key}",
            Res::Events => "/events/{key}",
            Res::Orders => "/tenants/{tenant_id}/orders/{order_no}",
        }
    }

    pub fn table(self) -> &'static str {
        match self {
            Res::Users | Res::UsersByEmail => "users",
            Res::Docs => "docs",
            Res::Tags => "tags",
            Res::Events => "events",
            Res::Orders => "orders",
        }
    }

    /// The config's `key_column`, in the route's order (one column but
    /// for a composite key).
    pub fn keys(self) -> &'static [&'static str] {
        match self {
            Res::UsersByEmail => &["email"],
            Res::Tags => &["code"],
            Res::Orders => &["tenant_id", "order_no"],
            _ => &["id"],
        }
    }

    /// The key column of a resource with one.
    pub fn key(self) -> &'static str {
        match self.keys() {
            [k] => k,
            _ => panic!("{self:?} has a composite key"),
        }
    }

    /// The config's `key_type`, which is also the SQL type of each key
    /// column.
    pub fn key_types(self) -> &'static [&'static str] {
        match self {
            Res::Users | Res::Events => &["bigint"],
            Res::Docs => &["uuid"],
            Res::UsersByEmail | Res::Tags => &["text"],
            Res::Orders => &["bigint", "text"],
        }
    }

    pub fn columns(self) -> &'static [&'static str] {
        match self {
            Res::Users | Res::UsersByEmail => &["id", "email", "name"],
            Res::Docs => &["id", "title", "rev"],
            Res::Tags => &["code", "label", "rev"],
            Res::Events => &["id", "kind", "rev"],
            Res::Orders => &["tenant_id", "order_no", "item", "rev"],
        }
    }
}

/// One key of one resource: one URL. A composite key's parts are joined
/// with `/` (`orders`: `{tenant_id}/{order_no}`; a bigint has no `/`, so
/// the first one splits them).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Path {
    pub res: Res,
    pub key: String,
}

/// RFC 3986 unreserved characters stay; everything else is escaped, so a
/// text key with spaces, `%`, `/` or non-ASCII letters is one segment.
const SEGMENT: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

impl Path {
    pub fn new(res: Res, key: impl Into<String>) -> Self {
        Path {
            res,
            key: key.into(),
        }
    }

    /// A row of `orders`.
    pub fn order(tenant: i64, order_no: &str) -> Self {
        Path::new(Res::Orders, format!("{tenant}/{order_no}"))
    }

    /// An `orders` path's key: `(tenant_id, order_no)`.
    pub fn order_key(&self) -> (i64, String) {
        assert_eq!(self.res, Res::Orders, "{self:?}");
        let (tenant, order_no) = self.key.split_once('/').expect("tenant/order_no");
        (
            tenant.parse().expect("a bigint tenant"),
            order_no.to_string(),
        )
    }

    /// The route with each key part percent-encoded as one segment.
    pub fn url(&self) -> String {
        let enc = |part: &str| utf8_percent_encode(part, SEGMENT).to_string();
        match self.res {
            Res::Orders => {
                let (tenant, order_no) = self.order_key();
                format!(
                    "/tenants/{}/orders/{}",
                    enc(&tenant.to_string()),
                    enc(&order_no)
                )
            }
            res => res.route().replace("{key}", &enc(&self.key)),
        }
    }
}

/// Run once on a fresh database (migrated: `users` and `articles` exist).
/// No foreign keys: `TRUNCATE` of one table must not need `CASCADE`.
/// `users` carries its old email on UPDATE and DELETE (`REPLICA IDENTITY
/// FULL`), which the WAL feed needs for `users_by_email`.
pub const SETUP: &str = "
    DROP TABLE articles;
    ALTER TABLE users REPLICA IDENTITY FULL;
    CREATE TABLE docs (id uuid PRIMARY KEY, title text NOT NULL, rev int NOT NULL);
    CREATE TABLE tags (code text PRIMARY KEY, label text NOT NULL, rev int NOT NULL);
    CREATE TABLE events (id bigint PRIMARY KEY, kind text NOT NULL, rev int NOT NULL)
        PARTITION BY RANGE (id);
    CREATE TABLE events_p0 PARTITION OF events FOR VALUES FROM (0) TO (1000000);
    CREATE TABLE orders (tenant_id bigint NOT NULL, order_no text NOT NULL,
        item text NOT NULL, rev int NOT NULL, PRIMARY KEY (tenant_id, order_no));
    CREATE TABLE marker (id bigint PRIMARY KEY);
";

/// Every table a resource serves: what the publication must cover.
pub const TABLES: &str = "users, docs, tags, events, orders, marker";

/// Keys of `events` partition `n` (0 is `events_p0`, always attached; the
/// others are attached and detached by the partition fault).
pub fn partition_range(n: u32) -> (i64, i64) {
    let lo = i64::from(n) * 1_000_000;
    (lo, lo + 1_000_000)
}

/// What a history's gateways are configured with.
pub struct Setup<'a> {
    pub url: &'a str,
    pub feed: Feed,
    /// A permanent `database.slot`, else temporary slots.
    pub slot: Option<&'a str>,
    /// Streaming replicas' URLs for `replica_urls` (none: no replicas).
    pub replicas: &'a [String],
    /// The bus feed's `[bus]`.
    pub bus: Option<&'a BusSetup>,
}

/// The `[bus]` every gateway of a bus history shares.
pub struct BusSetup {
    pub url: String,
    /// `bus.sentinels` (with their password) and `bus.sentinel_master`,
    /// on a Sentinel history; `url` then names the master (not used as a
    /// host) with the data nodes' user and password.
    pub sentinels: Vec<String>,
    pub sentinel_master: Option<String>,
    /// `bus.slot`, the relay's permanent slot.
    pub slot: String,
    pub prefix: String,
    /// `bus.max_lag`, as TOML text (`"1s"`).
    pub max_lag: &'static str,
    /// `bus.max_direct_fallback`: below the fleet's size.
    pub max_direct_fallback: usize,
    /// `bus.read_from`: `"replicas"` on half the Sentinel histories.
    pub read_from: &'static str,
    /// `bus.fleet_key_file` and `bus.snapshot_wait`, on half the histories.
    pub snapshots: Option<(String, &'static str)>,
}

pub fn config(s: &Setup<'_>) -> bloomgate::config::Config {
    // The gateway's bound (`freshness_bound`, checked every eighth of it)
    // inside the oracle's (`model::BASE`, 2 s): a silent feed is caught by
    // the gateway before the oracle would call it a violation.
    let mut db = format!(
        "url = \"{}\"\npool_size = 8\nacquire_timeout = \"2s\"\nmigrate = false\nfreshness_bound = \"1500ms\"\n",
        s.url
    );
    db.push_str(match s.feed {
        Feed::Wal => "freshness = \"wal\"\ninstall_feed = true\n",
        Feed::WalPoll => "freshness = \"wal\"\ninstall_feed = true\nwal_poll_interval = \"5ms\"\n",
        Feed::Notify => "freshness = \"notify\"\ninstall_triggers = true\n",
        Feed::Queue => "freshness = \"queue\"\ninstall_triggers = true\n",
        // The relay's WAL feed, and each consumer's direct one while the
        // bus is not proven current.
        Feed::Bus => "freshness = \"wal\"\ninstall_feed = true\n",
    });
    if let Some(slot) = s.slot {
        db.push_str(&format!("slot = \"{slot}\"\n"));
    }
    if !s.replicas.is_empty() {
        // The lag limit is small enough that a rebuild never waits long for
        // a paused replica; below it, only the LSN check keeps a load off a
        // replica that has not replayed a change.
        let urls: Vec<String> = s.replicas.iter().map(|r| format!("\"{r}\"")).collect();
        db.push_str(&format!(
            "replica_urls = [{}]\nmax_replica_lag = \"2s\"\nreplica_check_interval = \"50ms\"\n",
            urls.join(", ")
        ));
    }
    let mut text = format!("[database]\n{db}\n");
    if let Some(b) = s.bus {
        text.push_str(&format!(
            "[bus]\nurl = \"{}\"\nslot = \"{}\"\nprefix = \"{}\"\nmax_lag = \"{}\"\nmax_direct_fallback = {}\nread_from = \"{}\"\n",
            b.url, b.slot, b.prefix, b.max_lag, b.max_direct_fallback, b.read_from
        ));
        if let Some((key, wait)) = &b.snapshots {
            text.push_str(&format!(
                "fleet_key_file = \"{key}\"\nsnapshot_wait = \"{wait}\"\n"
            ));
        }
        if let Some(master) = &b.sentinel_master {
            let urls: Vec<String> = b.sentinels.iter().map(|u| format!("\"{u}\"")).collect();
            text.push_str(&format!(
                "sentinels = [{}]\nsentinel_master = \"{master}\"\n",
                urls.join(", ")
            ));
        }
        text.push('\n');
    }
    // A key of one column is written alone, a composite one as arrays.
    let toml = |items: &[&str]| match items {
        [one] => format!("\"{one}\""),
        _ => {
            let quoted: Vec<String> = items.iter().map(|c| format!("\"{c}\"")).collect();
            format!("[{}]", quoted.join(", "))
        }
    };
    for r in Res::ALL {
        let columns: Vec<String> = r.columns().iter().map(|c| format!("\"{c}\"")).collect();
        text.push_str(&format!(
            "[[resource]]\nname = \"{}\"\nroute = \"{}\"\ntable = \"{}\"\nkey_column = {}\nkey_type = {}\ncolumns = [{}]\n\n",
            r.name(),
            r.route(),
            r.table(),
            toml(r.keys()),
            toml(r.key_types()),
            columns.join(", ")
        ));
    }
    text.push_str(
        "[[resource]]\nname = \"marker\"\nroute = \"/marker/{id}\"\ntable = \"marker\"\nkey_column = \"id\"\nkey_type = \"bigint\"\ncolumns = [\"id\"]\n",
    );
    bloomgate::config::Config::from_toml(&text).unwrap_or_else(|e| panic!("{e}\n{text}"))
}

/// The rows of `keys` as the gateway would serve them: the same columns
/// through the same `row_to_json`, by key text (a composite key's as
/// [`Path`] joins it).
pub async fn fetch(
    conn: &mut PgConnection,
    res: Res,
    keys: &[String],
) -> Result<HashMap<String, Value>, sqlx::Error> {
    let cols: Vec<String> = res.columns().iter().map(|c| format!("\"{c}\"")).collect();
    let rows: Vec<(String, String)> = if res == Res::Orders {
        // Both parts of each key, as two arrays unnested side by side.
        let (tenants, order_nos): (Vec<i64>, Vec<String>) = keys
            .iter()
            .map(|k| Path::new(res, k.as_str()).order_key())
            .unzip();
        let sql = format!(
            "SELECT t.tenant_id::text || '/' || t.order_no, row_to_json(t)::text FROM \
             (SELECT {cols} FROM orders WHERE (tenant_id, order_no) IN \
               (SELECT * FROM unnest($1::bigint[], $2::text[]))) t",
            cols = cols.join(", "),
        );
        sqlx::query_as(&sql)
            .bind(tenants)
            .bind(order_nos)
            .fetch_all(conn)
            .await?
    } else {
        let sql = format!(
            "SELECT t.\"{key}\"::text, row_to_json(t)::text FROM \
             (SELECT {cols} FROM \"{table}\" WHERE \"{key}\" = ANY($1::text[]::{ty}[])) t",
            key = res.key(),
            cols = cols.join(", "),
            table = res.table(),
            ty = res.key_types()[0],
        );
        sqlx::query_as(&sql).bind(keys).fetch_all(conn).await?
    };
    Ok(rows
        .into_iter()
        .map(|(k, json)| (k, serde_json::from_str(&json).expect("row_to_json")))
        .collect())
}

/// Quotes `s` as an SQL string literal (the generated statements are
/// printed to replay a history by hand, so they carry their values).
pub fn lit(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}
