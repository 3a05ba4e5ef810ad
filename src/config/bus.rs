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
    /// memory with small keys; see the README on sizing it.
    pub retention: u64,
    /// Without proof from the bus that it is current for this long (Redis
    /// unreachable, no relay, a relay behind), a gateway falls back to a
    /// direct WAL feed of its own (a temporary slot and a resync), and
    /// returns once the bus is current again. Default `5s`: longer than a
    /// relay's failover after a crash, so a failover alone does not send
    /// the whole fleet to the primary.
    #[serde(with = "humantime_serde")]
    pub max_lag: Duration,
    /// Prefix of the Redis keys (the stream and the relay's name). Default
    /// `bloomgate`.
    pub prefix: String,
    /// How long the relay waits for more commits to put in the entry the
    /// first one opens (every commit queued already goes in at once):
    /// Redis pays per entry and per consumer, so a fleet's Redis CPU per
    /// commit falls as batches grow, and every commit may wait this long
    /// more. `0s`: only what is queued. At most `100ms`. Default `2ms`.
    #[serde(with = "humantime_serde")]
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
            .finish()
    }
}

impl BusConfig {
    /// The URL with its password replaced, for logs and the status page.
    pub fn redacted_url(&self) -> Option<String> {
        self.url.as_deref().map(super::redact_url)
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
    if b.max_direct_fallback > 1000 {
        return bad(
            "max_direct_fallback",
            "must be at most 1000 (each is a walsender on the primary)",
        );
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
}
