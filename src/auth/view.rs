//! What the access checks hold and have counted, as the admin API, the
//! status page and `/metrics` (`bloomgate_auth_*`) show it: key sets, the
//! `jwks_url` fetches, the verified-credential cache, refusals by reason.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::SystemTime;

use serde::Serialize;

use super::Auth;
use super::stats::REFUSALS;

impl Auth {
    /// For the admin API and the status page.
    pub fn view(&self) -> AuthView {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        AuthView {
            jwt_secret: self.secret.is_some(),
            jwks_keys: self.keys.load().len(),
            jwks_url: self.remote.as_ref().map(|r| JwksView {
                loaded: r.loaded.load(Ordering::Relaxed),
                last_ok: *r.last_ok.lock().unwrap_or_else(|e| e.into_inner()),
                fetches: l(&self.stats.jwks_fetches),
                failures: l(&self.stats.jwks_fetch_failures),
                changes: l(&self.stats.jwks_changes),
                refetches_asked: l(&self.stats.jwks_refetches_asked),
            }),
            api_keys: self.api_callers.len(),
            token_cache: TokenCacheView {
                entries: self.verified.len(),
                capacity: self.verified.capacity(),
                hits: self.stats.token_cache_hits.get(),
                misses: l(&self.stats.token_cache_misses),
            },
            rate_limit_callers: self.limiter.capacity(),
            failures: REFUSALS
                .iter()
                .map(|r| (r.label(), l(&self.stats.failures[r.index()])))
                .collect(),
        }
    }
}

#[derive(Serialize)]
pub struct AuthView {
    pub jwt_secret: bool,
    /// Public keys held (the file's and the URL's).
    pub jwks_keys: usize,
    pub jwks_url: Option<JwksView>,
    pub api_keys: usize,
    pub token_cache: TokenCacheView,
    pub rate_limit_callers: usize,
    /// Refusals by reason, since start-up.
    pub failures: std::collections::BTreeMap<&'static str, u64>,
}

impl crate::exposition::Expose for AuthView {
    fn expose(
        &self,
        labels: crate::exposition::Labels<'_>,
        out: &mut crate::exposition::Exposition,
    ) {
        for (reason, n) in &self.failures {
            out.counter(
                "bloomgate_auth_failures_total",
                "Requests refused by the access checks, by reason (missing, expired, signature, insufficient_scope, not_owner, rate_limited, ...).",
                &[("reason", reason)],
                *n as f64,
            );
        }
        let cache = "bloomgate_auth_token_cache_total";
        let cache_help = "Credentials found in the verified-credential cache (result=hit) or verified (result=miss).";
        let t = &self.token_cache;
        out.counter(cache, cache_help, &[("result", "hit")], t.hits as f64);
        out.counter(cache, cache_help, &[("result", "miss")], t.misses as f64);
        out.gauge(
            "bloomgate_auth_token_cache_entries",
            "Verified credentials held (bounded by auth.token_cache_entries).",
            labels,
            t.entries as f64,
        );
        out.gauge(
            "bloomgate_auth_jwks_keys",
            "Public keys held for verifying tokens (auth.jwks_file and auth.jwks_url).",
            labels,
            self.jwks_keys as f64,
        );
        if let Some(j) = &self.jwks_url {
            let fetches = "bloomgate_auth_jwks_fetches_total";
            let help = "Fetches of auth.jwks_url, by result (ok, failed), and the changes of the key set they brought (changed).";
            out.counter(
                fetches,
                help,
                &[("result", "ok")],
                (j.fetches - j.failures) as f64,
            );
            out.counter(fetches, help, &[("result", "failed")], j.failures as f64);
            out.counter(fetches, help, &[("result", "changed")], j.changes as f64);
        }
    }
}

#[derive(Serialize)]
pub struct JwksView {
    pub loaded: bool,
    #[serde(with = "humantime_serde")]
    pub last_ok: Option<SystemTime>,
    pub fetches: u64,
    pub failures: u64,
    pub changes: u64,
    pub refetches_asked: u64,
}

#[derive(Serialize)]
pub struct TokenCacheView {
    pub entries: usize,
    pub capacity: usize,
    pub hits: u64,
    pub misses: u64,
}
