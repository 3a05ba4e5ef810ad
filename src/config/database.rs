//! `[database]`: the primary, its replicas, and how changes reach the
//! gateway (the feed and its intervals). The URLs carry passwords: `Debug`
//! and [`redact_url`] mask them.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::KeyProblem;

#[derive(Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct DatabaseConfig {
    /// Postgres URL. Default `postgres://postgres@127.0.0.1:5432/bloomgate`;
    /// `DATABASE_URL` overrides it. TLS follows libpq's parameters, for
    /// every connection made to this server (the pool, the feeds, the WAL
    /// feed's replication connection): `sslmode=disable|prefer|require|
    /// verify-ca|verify-full` (default `prefer`; `PGSSLMODE` when unset) and
    /// `sslrootcert=/path/ca.pem` (`PGSSLROOTCERT`), the CA file, the only
    /// trusted roots as in libpq: `verify-ca` and `verify-full` need it, and
    /// `require` with it checks the chain. See `db::tls` and the book's
    /// "TLS to PostgreSQL". `replica_urls` take the same parameters.
    pub url: String,
    /// Connections in the pool: also the most database queries at once.
    /// Default 16.
    pub pool_size: u32,
    /// How long a request waits for a free connection before it is answered
    /// 503. Default `2s`.
    #[serde(with = "crate::config::forms::duration")]
    pub acquire_timeout: Duration,
    /// Server-side limit on one query (`statement_timeout`). Default `5s`;
    /// streaming keys for a rebuild is exempt.
    #[serde(with = "crate::config::forms::duration")]
    pub statement_timeout: Duration,
    /// Apply the embedded migrations (the demo schema: `users`, `articles`)
    /// at start-up. Default false: the gateway creates no table unless
    /// asked (`bloomgate seed` and `bloomgate migrate` apply them).
    pub migrate: bool,
    /// Deprecated: `listen = false` is `freshness = "off"` (the name said
    /// `LISTEN`, but it switched off every feed). Read once at load:
    /// `false` with `freshness` at `"auto"` or `"off"` becomes `"off"`
    /// with a start-up warning; with any other `freshness` it is an error
    /// naming `database.listen`; `true` changes nothing. Unset by default.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub listen: Option<bool>,
    /// Create (or replace) the notification triggers at start-up: one
    /// function and two triggers per table (`source_table` for a view),
    /// announcing the key columns of every resource on it (needs the
    /// privilege to create triggers on those tables). Default false:
    /// `bloomgate install-triggers` does it once; the shipped config sets it.
    pub install_triggers: bool,
    /// How changes committed in Postgres reach the gateway: `"wal"` (logical
    /// decoding of the write-ahead log through a replication slot: writers
    /// pay nothing, nobody can forge a change, a permanent `slot` resumes
    /// without a rebuild; needs `wal_level = logical`, the REPLICATION
    /// attribute and the publication), `"queue"` (the triggers write each
    /// change into the table `public.bloomgate_changes`, which gateways
    /// poll: for a server without logical decoding; no lock at commit, no
    /// forging without the installer's role, nothing lost while a gateway
    /// is away for less than half of `queue_retention`), `"notify"` (the triggers
    /// and `LISTEN`), `"off"`, or `"auto"`: `wal` when the server and role allow
    /// it and the publication covers every resource table (or
    /// `install_feed` may create it), else `notify`, with one log line
    /// saying which and why. Default `"auto"`.
    pub freshness: Freshness,
    /// The publication the `wal` feed reads. Default `"bloomgate"`.
    pub publication: String,
    /// A permanent replication slot for the `wal` feed, resumed after a
    /// reconnect or restart without a rebuild (it holds WAL while the gateway
    /// is away: set `max_slot_wal_keep_size`; an invalidated slot is
    /// detected, recreated, and every filter rebuilt). Default: a temporary
    /// slot per connection, dropped by Postgres when the gateway goes.
    pub slot: Option<String>,
    /// At start-up with the `wal` feed: create or update the publication
    /// and remove bloomgate's notification triggers (what `bloomgate
    /// install-feed` does). Default false.
    pub install_feed: bool,
    /// How the `wal` feed reads the log. Unset (the default): streamed over
    /// a replication connection, each commit as soon as it is decoded
    /// (commit to servable about 0.5 ms at p50), at the price of waking the
    /// slot's walsender on every commit. Set (`"10ms"`): polled through
    /// `pg_logical_slot_peek_binary_changes` at this interval, the
    /// commits of each interval decoded in one go: cheaper for a primary
    /// without a spare core (no wake-up per commit: on a 2-core box shared
    /// with the writers they lost −2 to 23 % TPS polled every 5 ms, 16 to
    /// 24 % streamed; docs/perf-log/2026-11-23-writer-cost-polled.md), about
    /// one interval slower. Between `1ms` and `1s`.
    #[serde(with = "crate::config::forms::duration")]
    pub wal_poll_interval: Option<Duration>,
    /// How often the `queue` feed polls the change table (one small
    /// indexed query per gateway). Between `1ms` and `1s`. Default `5ms`.
    #[serde(with = "crate::config::forms::duration")]
    pub queue_poll_interval: Duration,
    /// How long the `queue` feed's changes stay in the table: the gateways
    /// delete older ones, and a gateway that could not poll for half of it
    /// (or finds rows it had not read deleted, by a gateway with a shorter
    /// retention) rescans every table instead of resuming. At least `10s`.
    /// Default `10m`.
    #[serde(with = "crate::config::forms::duration")]
    pub queue_retention: Duration,
    /// Streaming read replicas of the primary (`url`): row loads and key
    /// scans go to one that has replayed far enough (read-your-writes by
    /// LSN; see `db::replicas`), the change feed stays on the primary.
    /// `BLOOMGATE_DATABASE__REPLICA_URLS='["postgres://…", "postgres://…"]'`.
    /// A plain comma-separated list is taken too (`postgres://a/db,postgres://b/db`).
    /// Default none.
    #[serde(deserialize_with = "super::forms::list")]
    pub replica_urls: Vec<String>,
    /// A replica further behind the primary than this is not used, and a
    /// rebuild waits at most this long for one to catch up before it scans
    /// the primary. Default `1s`.
    #[serde(with = "crate::config::forms::duration")]
    pub max_replica_lag: Duration,
    /// How often each replica's health and replay position are read.
    /// Default `250ms`.
    #[serde(with = "crate::config::forms::duration")]
    pub replica_check_interval: Duration,
    /// The longest the gateway answers from its filters and caches without
    /// the change feed proving it is current (a heartbeat every 100 ms, see
    /// `feed`). Past it (a hung connection, a cut network, a feed far
    /// behind) keys are looked up in the database instead: a row committed
    /// longer ago than this is never answered 404 or old, and a request
    /// that begins longer than this after the latest proof is not answered
    /// from them (see `vouch`). At least `500ms` and four poll intervals.
    /// Default `2s`.
    #[serde(with = "crate::config::forms::duration")]
    pub freshness_bound: Duration,
}

impl Default for DatabaseConfig {
    fn default() -> Self {
        Self {
            url: "postgres://postgres@127.0.0.1:5432/bloomgate".into(),
            pool_size: 16,
            acquire_timeout: Duration::from_secs(2),
            statement_timeout: Duration::from_secs(5),
            migrate: false,
            listen: None,
            install_triggers: false,
            freshness: Freshness::Auto,
            publication: "bloomgate".into(),
            slot: None,
            install_feed: false,
            wal_poll_interval: None,
            queue_poll_interval: Duration::from_millis(5),
            queue_retention: Duration::from_secs(600),
            replica_urls: Vec::new(),
            max_replica_lag: Duration::from_secs(1),
            replica_check_interval: Duration::from_millis(250),
            freshness_bound: Duration::from_secs(2),
        }
    }
}

impl fmt::Debug for DatabaseConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DatabaseConfig")
            .field("url", &redact_url(&self.url))
            .field("pool_size", &self.pool_size)
            .field("acquire_timeout", &self.acquire_timeout)
            .field("statement_timeout", &self.statement_timeout)
            .field("migrate", &self.migrate)
            .field("listen", &self.listen)
            .field("install_triggers", &self.install_triggers)
            .field("freshness", &self.freshness)
            .field("publication", &self.publication)
            .field("slot", &self.slot)
            .field("install_feed", &self.install_feed)
            .field("wal_poll_interval", &self.wal_poll_interval)
            .field("queue_poll_interval", &self.queue_poll_interval)
            .field("queue_retention", &self.queue_retention)
            .field(
                "replica_urls",
                &self
                    .replica_urls
                    .iter()
                    .map(|u| redact_url(u))
                    .collect::<Vec<_>>(),
            )
            .field("max_replica_lag", &self.max_replica_lag)
            .field("replica_check_interval", &self.replica_check_interval)
            .field("freshness_bound", &self.freshness_bound)
            .finish()
    }
}

/// `database.freshness`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Freshness {
    Auto,
    Wal,
    Queue,
    Notify,
    Off,
}

impl Freshness {
    /// As written in the configuration.
    pub fn as_str(self) -> &'static str {
        match self {
            Freshness::Auto => "auto",
            Freshness::Wal => "wal",
            Freshness::Queue => "queue",
            Freshness::Notify => "notify",
            Freshness::Off => "off",
        }
    }
}

impl DatabaseConfig {
    /// Folds the deprecated `listen` into `freshness`: the rest of the
    /// gateway reads `freshness` alone. `Ok(Some(warning))` when it was
    /// used.
    pub(super) fn fold_aliases(&mut self) -> Result<Option<String>, KeyProblem> {
        match self.listen.take() {
            None | Some(true) => Ok(None),
            Some(false) => match self.freshness {
                Freshness::Auto | Freshness::Off => {
                    self.freshness = Freshness::Off;
                    Ok(Some(
                        "database.listen = false is deprecated: set database.freshness = \"off\" (the same thing)".into(),
                    ))
                }
                other => Err(KeyProblem::new(
                    "database.listen",
                    format!(
                        "listen = false (deprecated: it means freshness = \"off\") contradicts freshness = \"{}\"; remove listen",
                        other.as_str()
                    ),
                )),
            },
        }
    }

    /// Intervals within their ranges, the freshness bound above what the
    /// polling feeds can deliver, every URL a PostgreSQL one.
    pub(super) fn validate(&self) -> Result<(), KeyProblem> {
        let bad =
            |key: &str, problem: String| Err(KeyProblem::new(format!("database.{key}"), problem));
        if self.pool_size == 0 {
            return bad("pool_size", "must be at least 1".into());
        }
        if self.acquire_timeout.is_zero() {
            return bad("acquire_timeout", "must be above 0".into());
        }
        let polls = Duration::from_millis(1)..=Duration::from_secs(1);
        if let Some(i) = self.wal_poll_interval
            && !polls.contains(&i)
        {
            return bad(
                "wal_poll_interval",
                "must be between 1ms and 1s (leave it unset to stream)".into(),
            );
        }
        if !polls.contains(&self.queue_poll_interval) {
            return bad("queue_poll_interval", "must be between 1ms and 1s".into());
        }
        let floor = [Some(self.queue_poll_interval), self.wal_poll_interval]
            .into_iter()
            .flatten()
            .map(|p| p * 4)
            .fold(Duration::from_millis(500), Duration::max);
        if self.freshness_bound < floor {
            return bad(
                "freshness_bound",
                format!(
                    "must be at least {} (500ms, and four poll intervals)",
                    humantime::format_duration(floor)
                ),
            );
        }
        if self.queue_retention < Duration::from_secs(10) {
            return bad("queue_retention", "must be at least 10s".into());
        }
        let postgres = |u: &str| u.starts_with("postgres://") || u.starts_with("postgresql://");
        if !postgres(&self.url) {
            return bad("url", "must be a postgres:// or postgresql:// URL".into());
        }
        for (i, u) in self.replica_urls.iter().enumerate() {
            if !postgres(u) {
                return bad(
                    &format!("replica_urls[{i}]"),
                    "must be a postgres:// or postgresql:// URL".into(),
                );
            }
        }
        if !self.replica_urls.is_empty() && self.replica_check_interval.is_zero() {
            return bad("replica_check_interval", "must be above 0".into());
        }
        Ok(())
    }
}

/// `postgres://user:secret@host/db` → `postgres://user:***@host/db`; a
/// `password` query parameter (libpq accepts one) is masked too, with or
/// without a value and however its name is percent-encoded. A `#fragment`
/// is dropped: the driver ignores it, so it carries nothing worth showing,
/// and a line pasted after a `#` could hold anything.
pub fn redact_url(url: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    let base = match base.split_once("://") {
        Some((scheme, rest)) => match rest.rfind('@') {
            Some(at) => match rest[..at].split_once(':') {
                Some((user, _)) => format!("{scheme}://{user}:***{}", &rest[at..]),
                None => base.to_string(),
            },
            None => base.to_string(),
        },
        None => base.to_string(),
    };
    match query {
        Some(q) => {
            // URL parsers end the query at the first '#'.
            let q = q.split_once('#').map_or(q, |(q, _)| q);
            let q: Vec<String> = q
                .split('&')
                .map(|kv| {
                    // The driver percent-decodes keys: `%70assword` is a password.
                    let key = kv.split_once('=').map_or(kv, |(k, _)| k);
                    let decoded = percent_encoding::percent_decode_str(key).decode_utf8_lossy();
                    if decoded.eq_ignore_ascii_case("password") {
                        format!("{key}=***")
                    } else {
                        kv.to_string()
                    }
                })
                .collect();
            format!("{base}?{}", q.join("&"))
        }
        None => base,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::config::tests::{MINIMAL, err};

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(
            redact_url("postgres://app:s3cret@db:5432/x"),
            "postgres://app:***@db:5432/x"
        );
        assert_eq!(
            redact_url("postgres://db/x?user=a&password=s3cret"),
            "postgres://db/x?user=a&password=***"
        );
        // Found by fuzz/config_parse: the driver decodes the key.
        assert_eq!(
            redact_url("postgres://h/db?user=a&%70assword=s3cretpw"),
            "postgres://h/db?user=a&%70assword=***"
        );
        assert_eq!(
            redact_url("postgres://h/db?PASSWORD=s3cret&sslmode=disable"),
            "postgres://h/db?PASSWORD=***&sslmode=disable"
        );
        // Found by fuzz/config_parse in CI: the query ends at '#', so a bare
        // `password` before it is a (blank) password parameter to the
        // driver, and whatever follows the '#' is no part of the query.
        assert_eq!(
            redact_url("postgres://h/db?user=a&password##x?password2=s3cret&n=x"),
            "postgres://h/db?user=a&password=***"
        );
        assert_eq!(
            redact_url("postgres://h/db?password=s3cret#frag"),
            "postgres://h/db?password=***"
        );
        let mut c = Config::from_toml(MINIMAL).unwrap();
        c.database.url = "postgres://app:s3cret@db/x".into();
        assert!(!c.to_redacted_toml().contains("s3cret"));
        assert!(!format!("{c:?}").contains("s3cret"));
    }

    /// `database.listen` is an alias folded into `freshness` at load: the
    /// gateway never reads it, so it must not survive into the config.
    #[test]
    fn listen_false_is_freshness_off_with_a_warning() {
        let c = Config::from_toml(&format!("[database]\nlisten = false\n{MINIMAL}")).unwrap();
        assert_eq!(c.database.freshness, Freshness::Off);
        assert_eq!(c.database.listen, None);
        assert_eq!(c.deprecations.len(), 1, "{:?}", c.deprecations);
        assert!(c.deprecations[0].contains("database.freshness = \"off\""));
        assert!(!c.to_redacted_toml().contains("listen = false"));
        for (extra, want) in [
            ("", Freshness::Auto),
            ("freshness = \"off\"", Freshness::Off),
        ] {
            let c = Config::from_toml(&format!("[database]\nlisten = true\n{extra}\n{MINIMAL}"))
                .unwrap();
            assert_eq!(c.database.freshness, want);
            assert!(c.deprecations.is_empty());
        }
        let c = Config::from_toml(&format!(
            "[database]\nlisten = false\nfreshness = \"off\"\n{MINIMAL}"
        ))
        .unwrap();
        assert_eq!(c.database.freshness, Freshness::Off);
    }

    #[test]
    fn listen_false_contradicting_a_named_feed_is_refused() {
        for feed in ["wal", "queue", "notify"] {
            let e = Config::from_toml(&format!(
                "[database]\nlisten = false\nfreshness = \"{feed}\"\n{MINIMAL}"
            ))
            .unwrap_err()
            .to_string();
            assert!(e.contains("database.listen"), "{e}");
            assert!(e.contains(feed), "{e}");
        }
    }

    #[test]
    fn the_wal_poll_interval_is_unset_by_default_bounded_and_round_trips() {
        assert_eq!(
            Config::from_toml(MINIMAL)
                .unwrap()
                .database
                .wal_poll_interval,
            None
        );
        let c = Config::from_toml(&format!(
            "[database]\nwal_poll_interval = \"10ms\"\n{MINIMAL}"
        ))
        .unwrap();
        assert_eq!(
            c.database.wal_poll_interval,
            Some(Duration::from_millis(10))
        );
        let again = Config::from_toml(&c.to_redacted_toml()).unwrap();
        assert_eq!(
            again.database.wal_poll_interval,
            c.database.wal_poll_interval
        );
        for bad in ["0s", "500us", "2s"] {
            let e = err(&format!(
                "[database]\nwal_poll_interval = \"{bad}\"\n{MINIMAL}"
            ));
            assert!(e.contains("database.wal_poll_interval"), "{bad}: {e}");
        }
    }

    #[test]
    fn the_queue_settings_have_defaults_bounds_and_round_trip() {
        let c = Config::from_toml(MINIMAL).unwrap();
        assert_eq!(c.database.queue_poll_interval, Duration::from_millis(5));
        assert_eq!(c.database.queue_retention, Duration::from_secs(600));
        let c = Config::from_toml(&format!(
            "[database]\nfreshness = \"queue\"\nqueue_poll_interval = \"20ms\"\nqueue_retention = \"1h\"\n{MINIMAL}"
        ))
        .unwrap();
        assert_eq!(c.database.freshness, Freshness::Queue);
        let again = Config::from_toml(&c.to_redacted_toml()).unwrap();
        assert_eq!(again.database.freshness, Freshness::Queue);
        assert_eq!(
            again.database.queue_poll_interval,
            Duration::from_millis(20)
        );
        assert_eq!(again.database.queue_retention, Duration::from_secs(3600));
        for (key, bad) in [
            ("queue_poll_interval", "0s"),
            ("queue_poll_interval", "2s"),
            ("queue_retention", "5s"),
        ] {
            let e = err(&format!("[database]\n{key} = \"{bad}\"\n{MINIMAL}"));
            assert!(e.contains(&format!("database.{key}")), "{key} = {bad}: {e}");
        }
    }

    #[test]
    fn bad_values_are_refused_naming_the_key() {
        for (prefix, key) in [
            ("[database]\npool_size = 0\n", "database.pool_size"),
            ("[database]\nurl = \"mysql://x\"\n", "database.url"),
        ] {
            let e = err(&format!("{prefix}{MINIMAL}"));
            assert!(e.contains(key), "{prefix}: {e}");
        }
    }
}
