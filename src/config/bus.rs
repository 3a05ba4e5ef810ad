//! `[bus]`: the change stream shared by a fleet of gateways (see
//! `feed::bus`). Unset `url`: every gateway follows the database by itself,
//! as without this section.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

#[derive(Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct BusConfig {
    /// The Redis server carrying the stream, `redis://[user:password@]host[:port][/db]`,
    /// or `rediss://…` for TLS (the server's certificate checked against
    /// `ca_file`, else the host's certificate store, and the URL's host
    /// against its subject alternative names; there is no way to turn the
    /// check off). Default: none (no bus). `BLOOMGATE_BUS__URL`. Its
    /// password is never logged or shown.
    pub url: Option<String>,
    /// For a `rediss://` URL: the CA certificate file (PEM, one or more
    /// certificates) whose certificates are then the only trusted roots, as
    /// `sslrootcert` is for the database; unset, the host's store (what
    /// managed Redis with a public CA needs). Read at start-up and again
    /// for every new connection (a rotated file is picked up).
    /// `BLOOMGATE_BUS__CA_FILE`. Default none.
    pub ca_file: Option<PathBuf>,
    /// For a `rediss://` URL whose server asks for a client certificate
    /// (`tls-auth-clients yes`): the certificate chain (PEM) and its
    /// private key (PEM: PKCS#8, PKCS#1 or SEC1), both or neither. Read as
    /// `ca_file` is. `BLOOMGATE_BUS__CERT_FILE`, `BLOOMGATE_BUS__KEY_FILE`.
    /// Default none.
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
    /// The permanent logical replication slot the relay holds: whoever
    /// holds it is the relay (one walsender can hold a slot). Default
    /// `bloomgate_bus`. Must differ from `database.slot`.
    pub slot: String,
    /// Entries the stream keeps (trimmed approximately, in whole blocks).
    /// A gateway away for longer than the stream reaches back resyncs (a
    /// rebuild of every filter). Default 100000: about 20 MB of Redis
    /// memory while entries hold one commit each, 0.5-1 GB at 5,000
    /// commits a second (batched entries of 5-10 KB); see docs/src/bus.md
    /// on sizing it.
    pub retention: u64,
    /// Without proof from the bus that it is current for this long (Redis
    /// unreachable, no relay, a relay behind), a gateway falls back to a
    /// direct WAL feed of its own (a temporary slot and a resync), and
    /// returns once the bus is current again. Default `5s`: longer than a
    /// relay's failover after a crash, so a failover alone does not send
    /// the whole fleet to the primary.
    #[serde(with = "crate::config::forms::duration")]
    pub max_lag: Duration,
    /// Prefix of the Redis keys (the stream and the relay's name). Default
    /// `bloomgate`.
    pub prefix: String,
    /// How long the relay waits for more commits to put in the entry the
    /// first one opens (every commit queued already goes in at once):
    /// Redis pays per entry and per consumer, so a fleet's Redis CPU per
    /// commit falls as batches grow, and every commit may wait this long
    /// more. `0s`: only what is queued. At most `100ms`. Default `2ms`.
    #[serde(with = "crate::config::forms::duration")]
    pub batch_window: Duration,
    /// Commits one entry holds at most. Default 500.
    pub batch_max_commits: usize,
    /// While the bus is not current, how many gateways of the fleet may
    /// follow the WAL with a feed of their own (a walsender each on the
    /// primary, decoding the whole WAL): arbitrated by advisory locks on
    /// the primary. The others follow nothing meanwhile: their resources
    /// are not vouched for and answer from the database (keys the filter
    /// rejects within `filter.verify_budget`). `0`: none falls back.
    /// Default 2.
    pub max_direct_fallback: u32,
    /// Redis Sentinel: the sentinels' URLs, `redis://[user:password@]host:port`
    /// (the sentinels' own credentials, if they ask for any: all the same),
    /// `rediss://` when `url` is. Set, the gateway asks them for the
    /// primary named `sentinel_master` at every connection, so it follows
    /// a failover; `url` then gives the data nodes' scheme, user, password
    /// and database, and its host and port are not used. Entries lost to
    /// Redis' asynchronous replication at a failover cost a resync, never
    /// a wrong answer. Default none. `BLOOMGATE_BUS__SENTINELS`: a TOML
    /// array or comma-separated URLs.
    #[serde(deserialize_with = "super::forms::list")]
    pub sentinels: Vec<String>,
    /// The name the sentinels know the primary by (`sentinel monitor
    /// <name> …`); set with `sentinels`. Default none.
    pub sentinel_master: Option<String>,
    /// Where gateways read the stream from. `primary`: the Redis node the
    /// relay appends to (or the one the sentinels name). `replicas`: an
    /// online replica of it, chosen at random for each connection among
    /// those its `INFO replication` lists (their announced addresses, with
    /// `url`'s scheme, credentials and database), so Redis' read fan-out,
    /// which grows with the fleet, is spread over its replicas and the
    /// primary carries the appends and one replication stream each
    /// (docs/src/bus.md, "A read tier"). The primary is read when no
    /// replica is online (a replica is looked for again every 10 s), and
    /// a replica that stops following is left halfway to `max_lag`.
    /// Default `primary`.
    pub read_from: BusReadFrom,
    /// The fleet key: a file holding at least 32 secret bytes (whitespace
    /// around them trimmed: `openssl rand -hex 32 > fleet.key`), the same
    /// file on every gateway of the fleet, readable by the gateway only.
    /// Set, a rebuild's filter is published on the bus as a snapshot, so
    /// a gateway that joins the fleet, or meets a gap the whole fleet
    /// meets, loads it instead of scanning the table: one scan per fleet.
    /// Each build's filter key and the snapshot's encryption key are
    /// derived from it, so what Redis holds lets nobody craft keys that
    /// pass a filter, nor read the set of keys (docs/src/bus.md,
    /// "Snapshots"). Read at start-up. `BLOOMGATE_BUS__FLEET_KEY_FILE`.
    /// Default none: every gateway scans for itself.
    pub fleet_key_file: Option<PathBuf>,
    /// With `fleet_key_file`: how long a rebuild waits for the snapshot of
    /// the scan another gateway of the fleet is making before it scans by
    /// itself (within `max_parallel_scans`). Default `30s`.
    #[serde(with = "crate::config::forms::duration")]
    pub snapshot_wait: Duration,
    /// With `fleet_key_file`: scans of one resource the fleet makes at
    /// once: the fleet's one scan, and gateways that waited past
    /// `snapshot_wait` (leases in Redis, so a gateway that dies mid-scan
    /// frees its slot within 15 s). Without the bus answering, a gateway
    /// scans regardless. Default 2, at least 1.
    pub max_parallel_scans: u32,
    /// With `fleet_key_file`: snapshots kept per resource and stream of
    /// the bus (each about a filter's size: docs/src/bus.md, "Snapshots",
    /// on sizing). Default 2, at most 16.
    pub snapshot_keep: u32,
}

/// `bus.read_from`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BusReadFrom {
    #[default]
    Primary,
    Replicas,
}

impl Default for BusConfig {
    fn default() -> Self {
        Self {
            url: None,
            ca_file: None,
            cert_file: None,
            key_file: None,
            slot: "bloomgate_bus".into(),
            retention: 100_000,
            max_lag: Duration::from_secs(5),
            prefix: "bloomgate".into(),
            batch_window: Duration::from_millis(2),
            batch_max_commits: 500,
            max_direct_fallback: 2,
            sentinels: Vec::new(),
            sentinel_master: None,
            read_from: BusReadFrom::Primary,
            fleet_key_file: None,
            snapshot_wait: Duration::from_secs(30),
            max_parallel_scans: 2,
            snapshot_keep: 2,
        }
    }
}

impl std::fmt::Debug for BusConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BusConfig")
            .field("url", &self.url.as_deref().map(super::redact_url))
            .field("ca_file", &self.ca_file)
            .field("cert_file", &self.cert_file)
            .field("key_file", &self.key_file)
            .field("slot", &self.slot)
            .field("retention", &self.retention)
            .field("max_lag", &self.max_lag)
            .field("prefix", &self.prefix)
            .field("batch_window", &self.batch_window)
            .field("batch_max_commits", &self.batch_max_commits)
            .field("max_direct_fallback", &self.max_direct_fallback)
            .field("sentinels", &self.redacted_sentinels())
            .field("sentinel_master", &self.sentinel_master)
            .field("read_from", &self.read_from)
            .field("fleet_key_file", &self.fleet_key_file)
            .field("snapshot_wait", &self.snapshot_wait)
            .field("max_parallel_scans", &self.max_parallel_scans)
            .field("snapshot_keep", &self.snapshot_keep)
            .finish()
    }
}

impl BusConfig {
    /// The URL with its password replaced, for logs and the status page.
    pub fn redacted_url(&self) -> Option<String> {
        self.url.as_deref().map(super::redact_url)
    }

    /// `sentinels` with their passwords replaced.
    pub fn redacted_sentinels(&self) -> Vec<String> {
        self.sentinels
            .iter()
            .map(|u| super::redact_url(u))
            .collect()
    }

    /// Where the gateway finds Redis, for logs and the status page: the
    /// URL, or the master's name and the sentinels, without passwords.
    pub fn shown(&self) -> Option<String> {
        let url = self.redacted_url()?;
        Some(match &self.sentinel_master {
            Some(master) if !self.sentinels.is_empty() => format!(
                "{url} (the primary `{master}` as sentinels {} name it)",
                self.redacted_sentinels().join(", ")
            ),
            _ => url,
        })
    }
}

/// Checks `[bus]`; `Err((key, problem))`. `database_slot` is
/// `database.slot`, which the bus's slot must not be.
pub fn validate(b: &BusConfig, database_slot: Option<&str>) -> Result<(), (String, String)> {
    let bad = |key: &str, problem: &str| Err((format!("bus.{key}"), problem.to_string()));
    let tls = match &b.url {
        None => false,
        Some(url) => {
            let tls = match url.split_once("://").map(|(s, _)| s) {
                Some("redis") => false,
                Some("rediss") => true,
                _ => return bad("url", "must be a redis:// or rediss:// (TLS) URL"),
            };
            // The problems below never repeat the URL: it may hold a password.
            let Ok(parsed) = url::Url::parse(url) else {
                return bad("url", "is not a valid URL");
            };
            match parsed.fragment() {
                None => {}
                // redis-rs reads `rediss://…#insecure` as "no certificate
                // check". Whoever can sit between a gateway and an
                // unchecked Redis can feed it changes that never happened
                // (a key deleted, a row rewritten) and drop real ones: the
                // bus decides what the fleet serves, so its TLS is checked
                // or not used. A private CA is what `ca_file` is for.
                Some("insecure") => {
                    return bad(
                        "url",
                        "#insecure (TLS without a certificate check) is not supported: a bus \
                         reachable by a man in the middle could be fed forged changes; give \
                         the server's CA certificate as bus.ca_file instead",
                    );
                }
                Some(_) => {
                    return bad(
                        "url",
                        "has a #fragment, which a Redis URL does not take (a password with \
                         '#' in it must be percent-encoded as %23)",
                    );
                }
            }
            if parsed.host_str().is_none_or(str::is_empty) {
                return bad("url", "has no host");
            }
            tls
        }
    };
    sentinels(b, tls)?;
    let files = [
        ("ca_file", &b.ca_file),
        ("cert_file", &b.cert_file),
        ("key_file", &b.key_file),
    ];
    for (key, file) in files {
        // Set without TLS, it would be ignored: a bus the operator meant to
        // secure running in plaintext.
        if file.is_some() && !tls {
            return bad(
                key,
                "is for TLS to Redis and needs a rediss:// bus.url (bus.url is redis:// or unset)",
            );
        }
        if file.as_ref().is_some_and(|p| p.as_os_str().is_empty()) {
            return bad(key, "is empty: give the file's path, or leave it unset");
        }
    }
    match (&b.cert_file, &b.key_file) {
        (Some(_), None) => {
            return bad(
                "key_file",
                "must be set with bus.cert_file (its private key)",
            );
        }
        (None, Some(_)) => {
            return bad(
                "cert_file",
                "must be set with bus.key_file (its certificate)",
            );
        }
        _ => {}
    }
    let identifier = {
        let mut chars = b.slot.chars();
        matches!(chars.next(), Some(c) if c.is_ascii_lowercase() || c == '_')
            && b.slot.len() <= 63
            && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
    };
    if !identifier {
        return bad(
            "slot",
            "must be a slot name: lower-case letters, digits and _, at most 63",
        );
    }
    if database_slot == Some(b.slot.as_str()) {
        return bad(
            "slot",
            "must differ from database.slot: the relay's slot and a gateway's own would be consumed by both",
        );
    }
    if b.retention < 1000 {
        return bad(
            "retention",
            "must be at least 1000 entries (Redis trims in blocks of about 100)",
        );
    }
    if b.max_lag < Duration::from_millis(500) {
        return bad(
            "max_lag",
            "must be at least 500ms (the relay proves the stream current about every 100 ms)",
        );
    }
    if b.prefix.is_empty() || b.prefix.len() > 64 || b.prefix.chars().any(|c| c.is_whitespace()) {
        return bad("prefix", "must be 1 to 64 characters without whitespace");
    }
    if b.batch_window > Duration::from_millis(100) {
        return bad(
            "batch_window",
            "must be at most 100ms (every commit may wait this long)",
        );
    }
    if !(1..=100_000).contains(&b.batch_max_commits) {
        return bad("batch_max_commits", "must be 1 to 100000");
    }
    if b.fleet_key_file.is_some() && b.url.is_none() {
        return bad(
            "fleet_key_file",
            "shares snapshots on the bus and needs bus.url",
        );
    }
    if b.fleet_key_file
        .as_ref()
        .is_some_and(|p| p.as_os_str().is_empty())
    {
        return bad(
            "fleet_key_file",
            "is empty: give the file's path, or leave it unset",
        );
    }
    if b.max_parallel_scans == 0 {
        return bad(
            "max_parallel_scans",
            "must be at least 1 (the fleet's one scan)",
        );
    }
    if !(1..=16).contains(&b.snapshot_keep) {
        return bad("snapshot_keep", "must be 1 to 16");
    }
    if b.max_direct_fallback > 1000 {
        return bad(
            "max_direct_fallback",
            "must be at most 1000 (each is a walsender on the primary)",
        );
    }
    Ok(())
}

/// Checks `sentinels` and `sentinel_master` (`tls`: `url` is `rediss://`).
fn sentinels(b: &BusConfig, tls: bool) -> Result<(), (String, String)> {
    let bad = |key: &str, problem: String| Err((format!("bus.{key}"), problem));
    match (&b.sentinel_master, b.sentinels.is_empty()) {
        (None, true) => return Ok(()),
        (Some(_), true) => {
            return bad(
                "sentinels",
                "must list the sentinels when bus.sentinel_master is set".into(),
            );
        }
        (None, false) => {
            return bad(
                "sentinel_master",
                "must name the primary (sentinel monitor <name> …) when bus.sentinels is set"
                    .into(),
            );
        }
        (Some(m), false) if m.is_empty() || m.chars().any(|c| c.is_whitespace()) => {
            return bad(
                "sentinel_master",
                "must be the master's name as the sentinels know it, without whitespace".into(),
            );
        }
        (Some(_), false) => {}
    }
    if b.url.is_none() {
        return bad(
            "url",
            "must be set with bus.sentinels: its scheme, user, password and database are the data nodes'"
                .into(),
        );
    }
    let scheme = if tls { "rediss" } else { "redis" };
    let mut credentials = None;
    for (i, s) in b.sentinels.iter().enumerate() {
        // The problems never repeat the URL: it may hold a password.
        let which = format!("entry {} of {}", i + 1, b.sentinels.len());
        let Ok(u) = url::Url::parse(s) else {
            return bad("sentinels", format!("{which} is not a valid URL"));
        };
        if u.scheme() != scheme {
            return bad(
                "sentinels",
                format!(
                    "{which} must be a {scheme}:// URL, as bus.url is (TLS to both or to neither)"
                ),
            );
        }
        if u.host_str().is_none_or(str::is_empty) || u.port().is_none() {
            return bad(
                "sentinels",
                format!("{which} must name a host and a port (a sentinel listens on 26379)"),
            );
        }
        if !matches!(u.path(), "" | "/") || u.query().is_some() || u.fragment().is_some() {
            return bad(
                "sentinels",
                format!("{which} must be host and port alone (a sentinel has no database)"),
            );
        }
        let these = (u.username().to_string(), u.password().map(String::from));
        match &credentials {
            None => credentials = Some(these),
            Some(first) if *first != these => {
                return bad(
                    "sentinels",
                    format!(
                        "{which} has other credentials than the first: all sentinels share one"
                    ),
                );
            }
            Some(_) => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_values_are_refused_naming_the_key() {
        let ok = BusConfig {
            url: Some("redis://:secret@127.0.0.1:6379/0".into()),
            ..BusConfig::default()
        };
        assert!(validate(&ok, None).is_ok());
        assert!(!format!("{ok:?}").contains("secret"));
        let cases = [
            (
                BusConfig {
                    url: Some("http://x".into()),
                    ..ok.clone()
                },
                "bus.url",
            ),
            (
                BusConfig {
                    slot: "Bad-Slot".into(),
                    ..ok.clone()
                },
                "bus.slot",
            ),
            (
                BusConfig {
                    retention: 10,
                    ..ok.clone()
                },
                "bus.retention",
            ),
            (
                BusConfig {
                    max_lag: Duration::from_millis(10),
                    ..ok.clone()
                },
                "bus.max_lag",
            ),
            (
                BusConfig {
                    batch_window: Duration::from_secs(1),
                    ..ok.clone()
                },
                "bus.batch_window",
            ),
            (
                BusConfig {
                    batch_max_commits: 0,
                    ..ok.clone()
                },
                "bus.batch_max_commits",
            ),
        ];
        for (cfg, key) in cases {
            assert_eq!(validate(&cfg, None).unwrap_err().0, key);
        }
        assert_eq!(
            validate(&ok, Some("bloomgate_bus")).unwrap_err().0,
            "bus.slot"
        );
    }

    /// `rediss://` is TLS with the certificate checked; nothing turns the
    /// check off, and a TLS option is never silently ignored.
    #[test]
    fn rediss_is_accepted_and_its_options_are_checked() {
        let tls = BusConfig {
            url: Some("rediss://user:s3cret@redis.example.com:6380/0".into()),
            ca_file: Some("/etc/bloomgate/redis-ca.pem".into()),
            cert_file: Some("/etc/bloomgate/client.pem".into()),
            key_file: Some("/etc/bloomgate/client.key".into()),
            ..BusConfig::default()
        };
        assert!(validate(&tls, None).is_ok());
        let bare = BusConfig {
            url: Some("rediss://redis.example.com".into()),
            ..BusConfig::default()
        };
        assert!(validate(&bare, None).is_ok(), "the host's store, no file");
        assert!(!format!("{tls:?}").contains("s3cret"));
        let refused = |cfg: BusConfig| {
            let (key, problem) = validate(&cfg, None).unwrap_err();
            assert!(!problem.contains("s3cret"), "{problem}");
            key
        };
        let url = |u: &str| BusConfig {
            url: Some(u.into()),
            ..tls.clone()
        };
        // No certificate check: refused, naming the key, never the URL.
        assert_eq!(
            refused(url("rediss://:s3cret@h:6380/0#insecure")),
            "bus.url"
        );
        assert_eq!(refused(url("rediss://:s3cret@h:6380/#insecure")), "bus.url");
        // Any other fragment (a '#' in a password, unencoded) too.
        assert_eq!(refused(url("rediss://:s3#cret@h:6380/0")), "bus.url");
        assert_eq!(refused(url("valkeys://h")), "bus.url");
        // TLS files with a plaintext URL would be ignored: refused.
        for (key, cfg) in [
            (
                "bus.ca_file",
                BusConfig {
                    url: Some("redis://:s3cret@h:6379".into()),
                    ..tls.clone()
                },
            ),
            (
                "bus.ca_file",
                BusConfig {
                    url: None,
                    ..tls.clone()
                },
            ),
            (
                "bus.cert_file",
                BusConfig {
                    url: Some("redis://h".into()),
                    ca_file: None,
                    ..tls.clone()
                },
            ),
            (
                "bus.key_file",
                BusConfig {
                    key_file: None,
                    ..tls.clone()
                },
            ),
            (
                "bus.cert_file",
                BusConfig {
                    cert_file: None,
                    ..tls.clone()
                },
            ),
            (
                "bus.ca_file",
                BusConfig {
                    ca_file: Some("".into()),
                    ..tls.clone()
                },
            ),
        ] {
            assert_eq!(refused(cfg), key);
        }
    }

    /// The keys as an operator writes them, in the file and the
    /// environment (`BLOOMGATE_BUS__CA_FILE`).
    #[test]
    #[allow(clippy::result_large_err)] // figment's Jail API returns its own error
    fn the_tls_keys_load_from_the_file_and_the_environment() {
        use std::path::Path;
        figment::Jail::expect_with(|jail| {
            let file = format!(
                "{}\n[bus]\ncert_file = \"/c.pem\"\nkey_file = \"/c.key\"\n",
                crate::config::tests::MINIMAL
            );
            jail.create_file("bg.toml", &file)?;
            jail.set_env(
                "BLOOMGATE_BUS__URL",
                "rediss://:s3cret@redis.internal:6380/0",
            );
            jail.set_env("BLOOMGATE_BUS__CA_FILE", "/run/secrets/redis-ca.pem");
            let c = crate::config::Config::load(Path::new("bg.toml")).map_err(|e| e.to_string())?;
            assert_eq!(
                c.bus.ca_file.as_deref(),
                Some(Path::new("/run/secrets/redis-ca.pem"))
            );
            assert_eq!(c.bus.cert_file.as_deref(), Some(Path::new("/c.pem")));
            assert_eq!(c.bus.key_file.as_deref(), Some(Path::new("/c.key")));
            assert!(!c.to_redacted_toml().contains("s3cret"));
            // `#insecure` from the environment: refused naming the key.
            jail.set_env(
                "BLOOMGATE_BUS__URL",
                "rediss://:s3cret@redis.internal:6380/0#insecure",
            );
            let e = crate::config::Config::load(Path::new("bg.toml"))
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(e.contains("bus.url") && !e.contains("s3cret"), "{e}");
            Ok(())
        });
    }

    /// Sentinel: the master's name and the sentinels go together, with
    /// `url` for the data nodes; every sentinel a host and a port, of
    /// `url`'s scheme, sharing one set of credentials; never shown with a
    /// password.
    #[test]
    fn sentinels_are_checked_and_never_shown_with_their_password() {
        let ok = BusConfig {
            url: Some("redis://bg:s3cret@primary/0".into()),
            sentinels: vec![
                "redis://:sentpass@10.0.0.1:26379".into(),
                "redis://:sentpass@10.0.0.2:26379".into(),
            ],
            sentinel_master: Some("bloomgate".into()),
            ..BusConfig::default()
        };
        assert!(validate(&ok, None).is_ok());
        let shown = format!("{ok:?} {}", ok.shown().unwrap());
        assert!(
            !shown.contains("s3cret") && !shown.contains("sentpass"),
            "{shown}"
        );
        assert!(ok.shown().unwrap().contains("bloomgate"));
        let refused = |cfg: BusConfig| {
            let (key, problem) = validate(&cfg, None).unwrap_err();
            assert!(!problem.contains("sentpass"), "{problem}");
            key
        };
        let with = |sentinels: &[&str]| BusConfig {
            sentinels: sentinels.iter().map(|s| s.to_string()).collect(),
            ..ok.clone()
        };
        assert_eq!(
            refused(BusConfig {
                sentinel_master: None,
                ..ok.clone()
            }),
            "bus.sentinel_master"
        );
        assert_eq!(
            refused(BusConfig {
                sentinel_master: Some("my master".into()),
                ..ok.clone()
            }),
            "bus.sentinel_master"
        );
        assert_eq!(refused(with(&[])), "bus.sentinels");
        assert_eq!(
            refused(BusConfig {
                url: None,
                ..ok.clone()
            }),
            "bus.url"
        );
        for bad in [
            &["redis://10.0.0.1"][..],
            &["rediss://:sentpass@10.0.0.1:26379"],
            &["redis://10.0.0.1:26379/1"],
            &["http://10.0.0.1:26379"],
            &[
                "redis://:sentpass@10.0.0.1:26379",
                "redis://:other@10.0.0.2:26379",
            ],
        ] {
            assert_eq!(refused(with(bad)), "bus.sentinels", "{bad:?}");
        }
        let tls = BusConfig {
            url: Some("rediss://bg:s3cret@primary/0".into()),
            sentinels: vec!["rediss://10.0.0.1:26379".into()],
            ..ok.clone()
        };
        assert!(validate(&tls, None).is_ok());
    }

    /// `BLOOMGATE_BUS__SENTINELS` as comma-separated URLs.
    #[test]
    #[allow(clippy::result_large_err)] // figment's Jail API returns its own error
    fn sentinels_load_from_the_environment() {
        use std::path::Path;
        figment::Jail::expect_with(|jail| {
            let file = format!(
                "{}\n[bus]\nurl = \"redis://bg:pw@bloomgate/0\"\nsentinel_master = \"bloomgate\"\n",
                crate::config::tests::MINIMAL
            );
            jail.create_file("bg.toml", &file)?;
            jail.set_env(
                "BLOOMGATE_BUS__SENTINELS",
                "redis://s1:26379, redis://s2:26379,redis://s3:26379",
            );
            let c = crate::config::Config::load(Path::new("bg.toml")).map_err(|e| e.to_string())?;
            assert_eq!(
                c.bus.sentinels,
                ["redis://s1:26379", "redis://s2:26379", "redis://s3:26379"]
            );
            Ok(())
        });
    }
}
