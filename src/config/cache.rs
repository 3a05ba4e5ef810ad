//! `[cache]` and a resource's `[resource.cache]`: the row cache's bounds
//! and lifetimes, compression, and the `Cache-Control` sent downstream.

use std::time::Duration;

use bytesize::ByteSize;
use serde::{Deserialize, Serialize};

use super::KeyProblem;
use super::cache_control;

/// The row cache's budget when a section names none: 64 MiB per resource,
/// about 150,000 rows of the demo's ~150-byte users (docs/src/sizing.md).
pub const DEFAULT_MAX_BYTES: u64 = 64 << 20;

/// What bounds a resource's row cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheBound {
    /// Bytes, as `cache.max_bytes` counts them.
    Bytes(u64),
    /// Rows, whatever their width.
    Entries(u64),
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct CacheConfig {
    /// Off means every request that passes the filter is a query. Default
    /// true.
    pub enabled: bool,
    /// Rows cached at most, instead of a byte budget: a resource whose rows
    /// have a known, narrow width may prefer a count. Default: unset (the
    /// cache is bounded by `max_bytes`). Setting both in one section is an
    /// error; a resource that sets only this is bounded by entries whatever
    /// `[cache]` says.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_entries: Option<u64>,
    /// Memory for one resource's cached rows, as `"256 MiB"`, `"1 GB"` or a
    /// number of bytes. Each row counts its JSON body and compressed forms,
    /// their ETags and lengths, and its key, plus a fixed per-entry overhead
    /// ([`crate::cache::ENTRY_OVERHEAD`]), so the cache's memory is bounded
    /// however wide the rows are (docs/src/sizing.md). Default
    /// [`DEFAULT_MAX_BYTES`] (64 MiB) per resource, unless `max_entries` is
    /// set.
    #[serde(
        skip_serializing_if = "Option::is_none",
        serialize_with = "crate::config::forms::option_bytes"
    )]
    pub max_bytes: Option<ByteSize>,
    /// How long a row is served from cache. Default `60s`.
    #[serde(with = "crate::config::forms::duration")]
    pub ttl: Duration,
    /// How long "no such row" is remembered. Default `5s`.
    #[serde(with = "crate::config::forms::duration")]
    pub negative_ttl: Duration,
    /// While the database cannot be reached at all (connections refused
    /// or cut: not merely slow), a resource answers from what its filter
    /// and cache held when the change feed last vouched for them, for at
    /// most this long after that moment: a cached row 200 and a key the
    /// filter (or a negative entry) rejects 404, each with
    /// `Cache-Status: bloomgate; ...; detail=stale` and `Age`; a key held
    /// by neither 503 as before. As nginx's `proxy_cache_use_stale error`
    /// and Varnish's grace do, and as `http_cache_control`'s
    /// `stale-if-error` tells the caches in front. Who must never see a
    /// row that may have changed sets `"0s"` (off). Default `300s`.
    #[serde(with = "crate::config::forms::duration")]
    pub stale_if_error: Duration,
    /// Negative entries kept at most, separate from rows so a flood of
    /// absent keys cannot evict real rows. Default 100000.
    pub negative_max_entries: u64,
    /// `Cache-Control` of a row (200, and the 304 that revalidates it), for
    /// the browsers, CDNs and shared caches in front of the gateway. Default
    /// `"max-age=0, stale-if-error=300"`: a downstream cache may store the
    /// row but it is stale at once, so it is revalidated on every use (a
    /// cheap 304 thanks to the ETag) and never served after the gateway
    /// invalidated it; while the gateway is unreachable it may serve what it
    /// has for 5 minutes (RFC 5861). Not `no-cache`: that forbids any use
    /// without revalidation and so overrides `stale-if-error`.
    /// `"max-age=N, stale-while-revalidate=M"` trades N seconds of possible
    /// staleness for fewer requests. Directives are checked at start-up.
    pub http_cache_control: String,
    /// `Cache-Control` of a 404 for an absent key (from the filter or a
    /// negative entry). Default `"no-cache"`: a downstream cache that keeps
    /// a 404 for N seconds answers 404 for a row inserted meanwhile. A
    /// `max-age` (or `s-maxage`) may not exceed `negative_ttl`.
    pub http_cache_control_not_found: String,
    /// Store each cached row gzip-, br- and zstd-compressed too (made once,
    /// when it enters the cache) and send the coding the client prefers
    /// (`Accept-Encoding`). Default true.
    pub compression: bool,
    /// Rows shorter than this are sent as they are: compressing them saves
    /// less than it costs. Default `"1 KiB"` (1024 bytes).
    #[serde(serialize_with = "crate::config::forms::bytes")]
    pub compress_min_bytes: ByteSize,
}

impl Default for CacheConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            max_entries: None,
            max_bytes: None,
            ttl: Duration::from_secs(60),
            negative_ttl: Duration::from_secs(5),
            stale_if_error: Duration::from_secs(300),
            negative_max_entries: 100_000,
            http_cache_control: "max-age=0, stale-if-error=300".into(),
            http_cache_control_not_found: "no-cache".into(),
            compression: true,
            compress_min_bytes: ByteSize::b(1024),
        }
    }
}

/// Any field left out keeps the global `[cache]` value.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct CacheOverrides {
    pub enabled: Option<bool>,
    pub max_entries: Option<u64>,
    #[serde(default, serialize_with = "crate::config::forms::option_bytes")]
    pub max_bytes: Option<ByteSize>,
    #[serde(default, with = "crate::config::forms::duration")]
    pub ttl: Option<Duration>,
    #[serde(default, with = "crate::config::forms::duration")]
    pub negative_ttl: Option<Duration>,
    #[serde(default, with = "crate::config::forms::duration")]
    pub stale_if_error: Option<Duration>,
    pub negative_max_entries: Option<u64>,
    pub http_cache_control: Option<String>,
    pub http_cache_control_not_found: Option<String>,
    pub compression: Option<bool>,
    #[serde(default, serialize_with = "crate::config::forms::option_bytes")]
    pub compress_min_bytes: Option<ByteSize>,
}

impl CacheOverrides {
    /// The section with this resource's values where it has them.
    pub(super) fn apply(&self, base: &CacheConfig) -> CacheConfig {
        CacheConfig {
            enabled: self.enabled.unwrap_or(base.enabled),
            // A resource that names either bound replaces `[cache]`'s: one
            // that sets only `max_entries` is bounded by entries, whatever
            // byte budget `[cache]` has.
            max_entries: match (self.max_bytes, self.max_entries) {
                (None, None) => base.max_entries,
                (_, own) => own,
            },
            max_bytes: match (self.max_bytes, self.max_entries) {
                (None, None) => base.max_bytes,
                (own, _) => own,
            },
            ttl: self.ttl.unwrap_or(base.ttl),
            negative_ttl: self.negative_ttl.unwrap_or(base.negative_ttl),
            stale_if_error: self.stale_if_error.unwrap_or(base.stale_if_error),
            negative_max_entries: self
                .negative_max_entries
                .unwrap_or(base.negative_max_entries),
            http_cache_control: self
                .http_cache_control
                .clone()
                .unwrap_or_else(|| base.http_cache_control.clone()),
            http_cache_control_not_found: self
                .http_cache_control_not_found
                .clone()
                .unwrap_or_else(|| base.http_cache_control_not_found.clone()),
            compression: self.compression.unwrap_or(base.compression),
            compress_min_bytes: self.compress_min_bytes.unwrap_or(base.compress_min_bytes),
        }
    }
}

/// The smallest `cache.max_bytes` accepted: a bare number is bytes, and
/// `max_bytes = 256` meant as MiB would otherwise cache nothing, silently.
const MIN_CACHE_BYTES: u64 = 64 * 1024;

impl CacheConfig {
    /// The bound this section gives: `max_bytes`, else `max_entries`, else
    /// [`DEFAULT_MAX_BYTES`].
    pub fn bound(&self) -> CacheBound {
        match (self.max_bytes, self.max_entries) {
            (Some(b), _) => CacheBound::Bytes(b.as_u64()),
            (None, Some(n)) => CacheBound::Entries(n),
            (None, None) => CacheBound::Bytes(DEFAULT_MAX_BYTES),
        }
    }

    /// `at` is where the section is: `cache`, or `resource[i].cache` for a
    /// resource's resolved one.
    pub(super) fn validate(&self, at: &str) -> Result<(), KeyProblem> {
        let key = |field: &str| format!("{at}.{field}");
        if self.max_entries.is_some() && self.max_bytes.is_some() {
            return Err(KeyProblem::new(
                key("max_entries"),
                "set max_bytes or max_entries, not both (max_bytes bounds memory however wide \
                 the rows are)",
            ));
        }
        if self.enabled && self.max_entries == Some(0) {
            return Err(KeyProblem::new(
                key("max_entries"),
                "must be at least 1 (set enabled = false to turn the cache off)",
            ));
        }
        if let Some(b) = self.max_bytes
            && self.enabled
            && b.as_u64() < MIN_CACHE_BYTES
        {
            return Err(KeyProblem::new(
                key("max_bytes"),
                format!(
                    "{} bytes cannot hold even a few rows; give at least {MIN_CACHE_BYTES} \
                     (units need a suffix: \"256 MiB\")",
                    b.as_u64()
                ),
            ));
        }
        if self.enabled && self.ttl.is_zero() {
            return Err(KeyProblem::new(key("ttl"), "must be above 0"));
        }
        cache_control::max_age(&self.http_cache_control)
            .map_err(|e| KeyProblem::new(key("http_cache_control"), e))?;
        let not_found = key("http_cache_control_not_found");
        let max_age = cache_control::max_age(&self.http_cache_control_not_found)
            .map_err(|e| KeyProblem::new(not_found.clone(), e))?;
        if let Some(secs) = max_age
            && Duration::from_secs(secs) > self.negative_ttl
        {
            return Err(KeyProblem::new(
                not_found,
                format!(
                    "a 404 may be cached downstream for at most negative_ttl ({}s), not {secs}s",
                    self.negative_ttl.as_secs()
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::config::tests::{MINIMAL, err};

    #[test]
    fn a_byte_budget_parses_with_units_and_is_inherited_unless_entries_are_set() {
        let c = Config::from_toml(&format!("[cache]\nmax_bytes = \"256 MiB\"\n{MINIMAL}")).unwrap();
        assert_eq!(c.cache.max_bytes.map(|b| b.as_u64()), Some(256 << 20));
        assert_eq!(c.resolved()[0].cache.max_bytes, c.cache.max_bytes);
        let c = Config::from_toml(&format!("[cache]\nmax_bytes = 1048576\n{MINIMAL}")).unwrap();
        assert_eq!(c.cache.max_bytes.map(|b| b.as_u64()), Some(1 << 20));
        // A resource that bounds itself by entries is bounded by entries.
        let c = Config::from_toml(&format!(
            "[cache]\nmax_bytes = \"1 GiB\"\n{MINIMAL}\n[resource.cache]\nmax_entries = 10\n"
        ))
        .unwrap();
        let r = &c.resolved()[0].cache;
        assert_eq!((r.max_entries, r.max_bytes), (Some(10), None));
        assert_eq!(r.bound(), CacheBound::Entries(10));
        // And one with its own budget keeps it.
        let c = Config::from_toml(&format!(
            "{MINIMAL}\n[resource.cache]\nmax_bytes = \"2 MB\"\n"
        ))
        .unwrap();
        assert_eq!(c.cache.max_bytes, None);
        assert_eq!(
            c.resolved()[0].cache.max_bytes.map(|b| b.as_u64()),
            Some(2_000_000)
        );
        // Neither set: the default budget, which check-config prints.
        let c = Config::from_toml(MINIMAL).unwrap();
        assert_eq!(
            c.resolved()[0].cache.bound(),
            CacheBound::Bytes(DEFAULT_MAX_BYTES)
        );
        assert!(
            c.to_redacted_toml().contains("max_bytes = \"64 MiB\""),
            "{}",
            c.to_redacted_toml()
        );
        // The redacted TOML (check-config) round-trips it exactly.
        let c =
            Config::from_toml(&format!("[cache]\nmax_bytes = \"1000001 B\"\n{MINIMAL}")).unwrap();
        assert_eq!(c.cache.max_bytes.map(|b| b.as_u64()), Some(1_000_001));
        let again = Config::from_toml(&c.to_redacted_toml()).unwrap();
        assert_eq!(again.cache.max_bytes, c.cache.max_bytes);
    }

    #[test]
    fn bad_values_are_refused_naming_the_key() {
        for (prefix, key) in [
            ("[cache]\nmax_entries = 0\n", "cache.max_entries"),
            (
                "[cache]\nmax_entries = 10\nmax_bytes = \"1 MiB\"\n",
                "cache.max_entries",
            ),
            ("[cache]\nmax_bytes = 256\n", "cache.max_bytes"),
            ("[cache]\nmax_bytes = \"lots\"\n", "cache.max_bytes"),
        ] {
            let e = err(&format!("{prefix}{MINIMAL}"));
            assert!(e.contains(key), "{prefix}: {e}");
        }
    }
}
