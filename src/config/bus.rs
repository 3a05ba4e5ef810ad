//! `[bus]`: the change stream shared by a fleet of gateways (see
//! `feed::bus`). Unset `url`: every gateway follows the database by itself,
//! as without this section.

use std::time::Duration;

use serde::{Deserialize, Serialize};

#[derive(Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct BusConfig {
    /// The Redis server carrying the stream, `redis://[user:password@]host[:port][/db]`.
    /// Default: none (no bus). `BLOOMGATE_BUS__URL`. Its password is never
    /// logged or shown.
    pub url: Option<String>,
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
}

impl Default for BusConfig {
    fn default() -> Self {
        Self {
            url: None,
            slot: "bloomgate_bus".into(),
            retention: 100_000,
            max_lag: Duration::from_secs(5),
            prefix: "bloomgate".into(),
        }
    }
}

impl std::fmt::Debug for BusConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BusConfig")
            .field("url", &self.url.as_deref().map(super::redact_url))
            .field("slot", &self.slot)
            .field("retention", &self.retention)
            .field("max_lag", &self.max_lag)
            .field("prefix", &self.prefix)
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
    if let Some(url) = &b.url {
        match url.split_once("://").map(|(s, _)| s) {
            Some("redis") => {}
            Some("rediss") => {
                return bad(
                    "url",
                    "TLS to Redis (rediss://) is not built in: reach Redis over a private network or a TLS tunnel, with redis://",
                );
            }
            _ => return bad("url", "must be a redis:// URL"),
        }
        if url::Url::parse(url).is_err() {
            return bad("url", "is not a valid URL");
        }
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
                    url: Some("rediss://x".into()),
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
        ];
        for (cfg, key) in cases {
            assert_eq!(validate(&cfg, None).unwrap_err().0, key);
        }
        assert_eq!(
            validate(&ok, Some("bloomgate_bus")).unwrap_err().0,
            "bus.slot"
        );
    }
}
