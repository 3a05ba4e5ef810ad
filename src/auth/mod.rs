//! Who may read what: authentication (a bearer JWT, an API key),
//! authorisation (scopes, row ownership) and per-caller rate limits, all
//! decided per request before the filter, the cache and the database.
//!
//! # Order on the request path (`http::lookup::begin`)
//! 1. The key is parsed: a malformed key is 400 whoever asks.
//! 2. [`Auth::check`]: the credential is found (401 without one), verified
//!    or found in the verified-credential cache (401 if it does not
//!    verify), its scopes compared (403), the caller's rate limit counted
//!    (429).
//! 3. An owner check on the key ([`Auth::owns_key`]): another owner's key
//!    is answered exactly as a key the filter rejects (404).
//! 4. Filter, cache, database, as for every resource; an owner check on
//!    another column is made on the row the cache returns
//!    ([`Auth::owns_row`]), before anything of it is sent.
//!
//! A request refused at 2 or 3 touches neither the filter nor the cache nor
//! the database: its answer is the same whether the key exists or not, and
//! it costs Postgres nothing. Rows are cached, not responses, and every
//! request is decided before it reads one, so no caller's decision can be
//! served to another through a shared entry.
//!
//! # Cost
//! A hit with a credential seen before costs a keyed hash of it and one
//! read of [`verified::Cache`], no allocation. A new credential costs its
//! verification once.
//!
//! # Memory
//! Bounded by the config alone: the verified cache and the rate limiter are
//! fixed tables (`auth.token_cache_entries`, `auth.rate_limit_callers`),
//! key sets hold at most [`jwks::MAX_KEYS`] keys, a fetched set at most
//! [`jwks::MAX_BYTES`].

pub mod api_key;
mod check;
pub mod jwks;
pub mod jwt;
pub mod key_files;
pub mod keyed;
pub mod limit;
pub mod owner;
pub mod peer;
mod policy;
mod remote;
mod stats;
pub mod verified;
mod view;

use std::sync::atomic::Ordering;

use arc_swap::ArcSwap;

use crate::config::{AuthMode, Config};
use key_files::KeyFiles;
use policy::scope_bits;

pub use crate::config::auth::{MAX_OWNER_CLAIMS, MAX_SCOPES};
pub use check::{API_KEY, Caller, bearer_token};
pub use policy::{Allowance, Owner, Policy, RATELIMIT, RATELIMIT_POLICY};
pub use stats::{REFUSALS, Refusal, Stats};
pub use view::{AuthView, JwksView, TokenCacheView};

/// The access checks of one gateway; see the module doc.
pub struct Auth {
    keyed: keyed::KeyedHash,
    secret: Option<jwt::Secret>,
    file_keys: Vec<jwt::PublicKey>,
    /// The file's keys and the URL's, together.
    keys: ArcSwap<Vec<jwt::PublicKey>>,
    remote: Option<remote::Remote>,
    api_keys: api_key::Keys,
    /// Per API key: its scope bits and its caller hash.
    api_callers: Vec<(u64, u64)>,
    verified: verified::Cache,
    limiter: limit::Limiter,
    rules: jwt::Rules,
    scope_names: Vec<String>,
    max_token: usize,
    /// By resource, in the config's order (the gateway's resources' order).
    pub policies: Vec<Policy>,
    pub stats: Stats,
    /// Dropped with the gateway: ends the refresher.
    stop: crate::shutdown::FiresOnDrop,
}

impl Auth {
    pub fn new(config: &Config, files: &KeyFiles) -> Self {
        let cfg = &config.auth;
        let resources = config.resolved();
        let mut scope_names: Vec<String> = Vec::new();
        let mut owner_claims: Vec<String> = Vec::new();
        for r in &resources {
            for s in &r.access.scopes {
                if !scope_names.contains(s) {
                    scope_names.push(s.clone());
                }
            }
            if let Some(c) = &r.access.owner_claim
                && !owner_claims.contains(c)
            {
                owner_claims.push(c.clone());
            }
        }
        let keyed = keyed::KeyedHash::random();
        let any_auth = resources.iter().any(|r| r.access.mode != AuthMode::None);
        let any_limit = resources.iter().any(|r| r.access.rate_limit.is_some());
        let policies = resources
            .iter()
            .map(|r| Policy::new(r, &scope_names, &owner_claims, &keyed))
            .collect();
        let api_callers = files
            .api_keys
            .iter()
            .map(|e| {
                (
                    scope_bits(&scope_names, &e.scopes),
                    keyed.hash64(b'k', e.name.as_bytes()),
                )
            })
            .collect();
        for s in &files.jwks_skipped {
            tracing::warn!(skipped = %s, "auth.jwks_file: a key was skipped");
        }
        let remote = cfg
            .jwks_url
            .as_ref()
            .map(|url| remote::Remote::new(url, cfg));
        Self {
            api_keys: api_key::Keys::new(&files.api_keys, &keyed),
            keyed,
            // Validated at load (`AuthConfig::validate`).
            secret: cfg.jwt_secret_bytes().map(|s| jwt::Secret::new(&s)),
            file_keys: files.jwks.clone(),
            keys: ArcSwap::from_pointee(files.jwks.clone()),
            remote,
            api_callers,
            // A gateway that checks nothing keeps no tables.
            verified: verified::Cache::new(match any_auth {
                true => cfg.token_cache_entries,
                false => verified::WAYS,
            }),
            limiter: limit::Limiter::new(match any_limit {
                true => cfg.rate_limit_callers,
                false => limit::WAYS,
            }),
            rules: jwt::Rules {
                issuer: cfg.issuer.clone(),
                audience: cfg.audience.clone(),
                leeway: cfg.leeway.as_secs(),
                scope_claim: cfg.scope_claim.clone(),
                owner_claims,
            },
            scope_names,
            max_token: cfg.max_token_bytes,
            policies,
            stats: Stats::default(),
            stop: crate::shutdown::FiresOnDrop::new(),
        }
    }

    /// Any resource rate-limits (so the client address is needed).
    pub fn limits_any(&self) -> bool {
        self.policies.iter().any(|p| p.rate.is_some())
    }

    /// False until a configured `jwks_url` has been fetched once, and
    /// again once its keys are dropped as stale.
    pub fn is_ready(&self) -> bool {
        self.remote
            .as_ref()
            .is_none_or(|r| r.loaded.load(Ordering::Acquire))
    }

    /// Why [`is_ready`](Self::is_ready) is false, for `/readyz`.
    pub fn why_not_ready(&self) -> Option<String> {
        let r = self.remote.as_ref()?;
        if r.loaded.load(Ordering::Acquire) {
            return None;
        }
        Some(
            r.stale
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone()
                .unwrap_or_else(|| "the key set at auth.jwks_url has not been fetched yet".into()),
        )
    }
}
