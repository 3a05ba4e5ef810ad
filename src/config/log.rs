//! `[log]`: the format, the `tracing` filter, and where access lines go.

use std::path::PathBuf;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::KeyProblem;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Human,
    Json,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    /// `human` or `json`, for every line, access lines included. Default
    /// `human`.
    pub format: LogFormat,
    /// A `tracing` filter such as `info` or `info,bloomgate::http::front=debug`
    /// (a span and a line per request);
    /// `RUST_LOG` overrides it. Reloaded on SIGHUP. Default `info`.
    pub level: String,
    /// One line per request at `info` (target `bloomgate::access`, the
    /// switch: `bloomgate::access=off` in the filter is the same as
    /// `false`): method, route template, status, `Cache-Status`, resource,
    /// duration, request id, client address; and the request id on every
    /// line logged while a request waits (a row load). Default true.
    pub access: bool,
    /// Access lines go to this file (created, appended to; opened again on
    /// SIGHUP, after logrotate moved it) instead of standard output.
    /// Default: unset, standard output.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub access_file: Option<PathBuf>,
    /// Filtered 404s (a key the filter rejected: nothing else was touched)
    /// logged per second at most; the rest are counted, in a line a second
    /// and in `bloomgate_access_lines_left_out_total`. Every other request
    /// has its line. `"unlimited"`: every filtered 404 too; `0`: none.
    /// Reloaded on SIGHUP. Default 100 (BENCHMARKS.md, "Access lines"; the
    /// run: docs/perf-log/2026-11-27-access-lines-outside-tracing.md,
    /// "Access lines under an attack").
    pub access_filtered_rate: FilteredRate,
    /// Access lines for the probes, `GET /healthz` and `/readyz`, of the
    /// public listener. `false` leaves them out (as nginx's `access_log
    /// off` in their `location`): a load balancer and Kubernetes probing
    /// every few seconds per gateway would otherwise be most of a quiet
    /// gateway's log. They are not counted as lines left out. Default
    /// true.
    pub access_probes: bool,
}

impl Default for LogConfig {
    fn default() -> Self {
        Self {
            format: LogFormat::Human,
            level: "info".into(),
            access: true,
            access_file: None,
            access_filtered_rate: FilteredRate::default(),
            access_probes: true,
        }
    }
}

impl LogConfig {
    pub(super) fn validate(&self) -> Result<(), KeyProblem> {
        if let FilteredRate::PerSecond(n) = self.access_filtered_rate
            && n > FilteredRate::MAX
        {
            return Err(KeyProblem::new(
                "log.access_filtered_rate",
                format!(
                    "{n} is above {} lines a second; use \"unlimited\" to log every filtered 404",
                    FilteredRate::MAX
                ),
            ));
        }
        if self
            .access_file
            .as_ref()
            .is_some_and(|p| p.as_os_str().is_empty() || p.is_dir())
        {
            return Err(KeyProblem::new(
                "log.access_file",
                "must name a file (unset it for standard output)",
            ));
        }
        Ok(())
    }
}

/// `log.access_filtered_rate`: lines a second, or every one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FilteredRate {
    PerSecond(u64),
    Unlimited,
}

impl FilteredRate {
    /// The largest number of lines a second (above it, say `"unlimited"`).
    pub const MAX: u64 = 1_000_000_000;
}

impl Default for FilteredRate {
    fn default() -> Self {
        Self::PerSecond(100)
    }
}

impl Serialize for FilteredRate {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::PerSecond(n) => s.serialize_u64(*n),
            Self::Unlimited => s.serialize_str("unlimited"),
        }
    }
}

impl<'de> Deserialize<'de> for FilteredRate {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = FilteredRate;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a number of lines a second, or \"unlimited\"")
            }
            fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<FilteredRate, E> {
                Ok(FilteredRate::PerSecond(n))
            }
            fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<FilteredRate, E> {
                u64::try_from(n)
                    .map(FilteredRate::PerSecond)
                    .map_err(|_| E::custom("a number of lines a second, 0 or more"))
            }
            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<FilteredRate, E> {
                match s {
                    "unlimited" => Ok(FilteredRate::Unlimited),
                    // An environment variable arrives as text.
                    _ => s.parse().map(FilteredRate::PerSecond).map_err(|_| {
                        E::custom(format!(
                            "{s:?}: a number of lines a second, or \"unlimited\""
                        ))
                    }),
                }
            }
        }
        d.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::config::tests::{MINIMAL, err};

    #[test]
    fn the_filtered_rate_is_a_number_or_unlimited() {
        let rate = |text: &str| {
            Config::from_toml(&format!("[log]\naccess_filtered_rate = {text}\n{MINIMAL}"))
                .unwrap()
                .log
                .access_filtered_rate
        };
        assert_eq!(rate("0"), FilteredRate::PerSecond(0));
        assert_eq!(rate("250"), FilteredRate::PerSecond(250));
        assert_eq!(rate("\"unlimited\""), FilteredRate::Unlimited);
        assert_eq!(
            Config::from_toml(MINIMAL).unwrap().log.access_filtered_rate,
            FilteredRate::PerSecond(100)
        );
        // It survives the effective config's round trip (SIGHUP compares it).
        let c = Config::from_toml(&format!(
            "[log]\naccess_filtered_rate = \"unlimited\"\naccess_file = \"/tmp/a.log\"\n{MINIMAL}"
        ))
        .unwrap();
        let again = Config::from_toml(&c.to_redacted_toml()).unwrap();
        assert_eq!(again.log.access_filtered_rate, FilteredRate::Unlimited);
        assert_eq!(again.log.access_file, Some("/tmp/a.log".into()));
    }

    #[test]
    fn bad_values_are_refused_naming_the_key() {
        for (value, key) in [
            ("access_filtered_rate = -1", "access_filtered_rate"),
            ("access_filtered_rate = \"lots\"", "access_filtered_rate"),
            (
                "access_filtered_rate = 2000000000",
                "log.access_filtered_rate",
            ),
            ("access_file = \"\"", "log.access_file"),
            ("access_file = \"/\"", "log.access_file"),
        ] {
            let e = err(&format!("[log]\n{value}\n{MINIMAL}"));
            assert!(e.contains(key), "{value}: {e}");
        }
    }
}
