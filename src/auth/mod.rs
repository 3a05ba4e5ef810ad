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
pub mod jwks;
pub mod jwt;
pub mod key_files;
pub mod keyed;
pub mod limit;
pub mod owner;
pub mod peer;
mod remote;
pub mod verified;

use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use arc_swap::ArcSwap;
use axum::http::{HeaderMap, HeaderName, HeaderValue, header};
use serde::Serialize;

use crate::config::{AuthMode, Config};
use crate::counter::Counter;
use crate::error::Error;
use crate::key::Key;
use crate::key::compare::Comparison;
use jwt::Invalid;
use key_files::KeyFiles;
use verified::{Held, Verified};

pub use crate::config::auth::{MAX_OWNER_CLAIMS, MAX_SCOPES};

/// The header an API key comes in.
pub static API_KEY: HeaderName = HeaderName::from_static("x-api-key");
const REALM: &str = "bloomgate";

/// Why a request was refused, for `bloomgate_auth_failures_total{reason}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    Missing,
    Token(Invalid),
    UnknownApiKey,
    TwoCredentials,
    InsufficientScope,
    NoOwnerClaim,
    NotOwner,
    RateLimited,
}

/// Every reason, in the order of [`Stats::failures`].
pub const REASONS: [Reason; 17] = [
    Reason::Missing,
    Reason::Token(Invalid::TooLong),
    Reason::Token(Invalid::Malformed),
    Reason::Token(Invalid::Algorithm),
    Reason::Token(Invalid::UnknownKey),
    Reason::Token(Invalid::Signature),
    Reason::Token(Invalid::Expired),
    Reason::Token(Invalid::NotYetValid),
    Reason::Token(Invalid::Issuer),
    Reason::Token(Invalid::Audience),
    Reason::Token(Invalid::Claims),
    Reason::UnknownApiKey,
    Reason::TwoCredentials,
    Reason::InsufficientScope,
    Reason::NoOwnerClaim,
    Reason::NotOwner,
    Reason::RateLimited,
];

impl Reason {
    pub fn label(self) -> &'static str {
        match self {
            Reason::Missing => "missing",
            Reason::Token(i) => i.reason(),
            Reason::UnknownApiKey => "unknown_api_key",
            Reason::TwoCredentials => "two_credentials",
            Reason::InsufficientScope => "insufficient_scope",
            Reason::NoOwnerClaim => "no_owner_claim",
            Reason::NotOwner => "not_owner",
            Reason::RateLimited => "rate_limited",
        }
    }

    fn index(self) -> usize {
        REASONS
            .iter()
            .position(|r| *r == self)
            .expect("every reason is listed")
    }
}

/// Counters of the access checks (not per resource: those are the
/// resources' `unauthorized`, `forbidden` and `rate_limited` outcomes).
#[derive(Default)]
pub struct Stats {
    /// Sharded: counted on every authenticated hit.
    pub token_cache_hits: Counter,
    pub token_cache_misses: AtomicU64,
    pub failures: [AtomicU64; REASONS.len()],
    pub jwks_fetches: AtomicU64,
    pub jwks_fetch_failures: AtomicU64,
    pub jwks_changes: AtomicU64,
    /// Refetches asked for by a token naming an unknown `kid`.
    pub jwks_refetches_asked: AtomicU64,
}

impl Stats {
    pub fn count(&self, r: Reason) {
        self.failures[r.index()].fetch_add(1, Ordering::Relaxed);
    }
}

/// A resource's rules, prepared once.
pub struct Policy {
    pub resource: String,
    pub mode: AuthMode,
    /// Bits of [`Auth`]'s scope list that must all be held.
    required: u64,
    pub scopes: Vec<String>,
    pub owner: Option<Owner>,
    pub rate: Option<limit::Rate>,
    /// Mixed into the limiter's key, so a caller's limits are per resource.
    salt: u64,
    challenge_missing: HeaderValue,
    challenge_token: HeaderValue,
    challenge_key: HeaderValue,
    challenge_scope: HeaderValue,
    rate_policy: Option<HeaderValue>,
}

/// An owner check: the claim (an index into the owner claims) and the
/// column it is compared with (`None`: the key).
#[derive(Clone, Debug)]
pub struct Owner {
    pub claim: usize,
    pub claim_name: String,
    pub column: Option<String>,
}

impl Policy {
    /// Whether anything is checked at all: false for a public resource
    /// without a rate limit, whose requests skip [`Auth::check`].
    pub fn guarded(&self) -> bool {
        self.mode != AuthMode::None || self.rate.is_some()
    }

    /// `RateLimit-Policy`, sent with every answer of a rate-limited
    /// resource.
    pub fn rate_policy(&self) -> Option<&HeaderValue> {
        self.rate_policy.as_ref()
    }

    /// The `RateLimit` field of a request the limiter let through.
    pub fn rate_state(&self, a: Allowance) -> HeaderValue {
        HeaderValue::from_str(&format!(
            "\"{}\";r={};t={}",
            self.resource, a.remaining, a.reset
        ))
        .unwrap_or(HeaderValue::from_static("r=0"))
    }

    pub fn owner_column(&self) -> Option<&str> {
        self.owner.as_ref().and_then(|o| o.column.as_deref())
    }
}

/// What the rate limiter said of a request it let through: the
/// `RateLimit` field of its answer (draft-ietf-httpapi-ratelimit-headers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Allowance {
    /// Requests that could be sent at once now.
    pub remaining: u32,
    /// Seconds until the whole burst is back (at least 1).
    pub reset: u64,
}

/// `RateLimit-Policy` and `RateLimit`, as they are sent.
pub static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
pub static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

/// Who is asking, once [`Auth::check`] let the request through.
pub enum Caller {
    /// A public resource (rate-limited by address, perhaps).
    Anonymous,
    /// A credential found in the verified cache.
    Held(Held),
    /// A credential verified by this request.
    Fresh(Arc<Verified>),
}

impl Caller {
    pub fn verified(&self) -> Option<&Verified> {
        match self {
            Caller::Anonymous => None,
            Caller::Held(h) => h.as_deref(),
            Caller::Fresh(v) => Some(v),
        }
    }

    /// For a request that goes on past `call` (a cache miss).
    pub fn into_arc(self) -> Option<Arc<Verified>> {
        match self {
            Caller::Anonymous => None,
            Caller::Held(h) => arc_swap::Guard::into_inner(h),
            Caller::Fresh(v) => Some(v),
        }
    }
}

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
    stop: tokio::sync::watch::Sender<()>,
}

/// A header value made once per resource and cloned on each refusal (never
/// on a request that is let through).
fn static_value(v: &str) -> HeaderValue {
    HeaderValue::from_str(v).unwrap_or_else(|_| HeaderValue::from_static("Bearer"))
}

fn scope_bits(names: &[String], held: impl IntoIterator<Item = impl AsRef<str>>) -> u64 {
    held.into_iter().fold(0, |bits, s| {
        match names.iter().position(|n| n == s.as_ref()) {
            Some(i) => bits | 1 << i,
            None => bits,
        }
    })
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
            .map(|r| {
                let a = &r.access;
                let scope = a.scopes.join(" ");
                let bearer = format!("Bearer realm=\"{REALM}\"");
                let api = format!("ApiKey realm=\"{REALM}\", header=\"X-API-Key\"");
                let both = |jwt: &str, key: &str| match a.mode {
                    AuthMode::Jwt => jwt.to_string(),
                    AuthMode::ApiKey => key.to_string(),
                    _ => format!("{jwt}, {key}"),
                };
                let bearer_bad = format!("{bearer}, error=\"invalid_token\"");
                let api_bad = format!("{api}, error=\"invalid_key\"");
                let bearer_scope =
                    format!("{bearer}, error=\"insufficient_scope\", scope=\"{scope}\"");
                let api_scope = format!("{api}, error=\"insufficient_scope\", scope=\"{scope}\"");
                let rate = a
                    .rate_limit
                    .map(|l| limit::Rate::new(l.per_second, l.burst));
                Policy {
                    resource: r.name.clone(),
                    mode: a.mode,
                    required: scope_bits(&scope_names, &a.scopes),
                    scopes: a.scopes.clone(),
                    owner: a.owner_claim.as_ref().map(|c| Owner {
                        claim: owner_claims
                            .iter()
                            .position(|x| x == c)
                            .expect("collected above"),
                        claim_name: c.clone(),
                        column: a.owner_column.clone(),
                    }),
                    rate,
                    salt: keyed.hash64(b'r', r.name.as_bytes()),
                    challenge_missing: static_value(&both(&bearer, &api)),
                    challenge_token: static_value(&both(&bearer_bad, &api)),
                    challenge_key: static_value(&both(&bearer, &api_bad)),
                    challenge_scope: static_value(&both(&bearer_scope, &api_scope)),
                    rate_policy: rate.map(|rate| {
                        static_value(&format!(
                            "\"{}\";q={};w={}",
                            r.name,
                            rate.burst,
                            rate.window_ns().div_ceil(1_000_000_000).max(1)
                        ))
                    }),
                }
            })
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
            stop: tokio::sync::watch::channel(()).0,
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

    /// Decides whether the request may go on to the filter; see the module
    /// doc. `now` is when the request began (the rate limiter's clock).
    pub fn check(
        &self,
        p: &Policy,
        headers: &HeaderMap,
        peer: Option<IpAddr>,
        now: Instant,
    ) -> Result<(Caller, Option<Allowance>), Error> {
        if p.mode == AuthMode::None {
            let allowance = self.limit(p, 0, peer, now)?;
            return Ok((Caller::Anonymous, allowance));
        }
        let bearer = match p.mode.takes_jwt() {
            true => header_once(headers, &header::AUTHORIZATION).map_err(|_| self.two(p))?,
            false => None,
        };
        let api_key = match p.mode.takes_api_key() {
            true => header_once(headers, &API_KEY).map_err(|_| self.two(p))?,
            false => None,
        };
        let caller = match (bearer, api_key) {
            (Some(_), Some(_)) => return Err(self.two(p)),
            (None, None) => return Err(self.refuse(p, Reason::Missing)),
            (Some(auth), None) => {
                let token = bearer_token(auth.as_bytes())
                    .ok_or_else(|| self.refuse(p, Reason::Token(Invalid::Malformed)))?;
                self.credential(p, b'j', token)?
            }
            (None, Some(key)) => self.credential(p, b'k', key.as_bytes())?,
        };
        let Some(v) = caller.verified() else {
            return Err(Error::Internal(
                "a checked credential without its claims".into(),
            ));
        };
        if v.scopes & p.required != p.required {
            return Err(self.refuse(p, Reason::InsufficientScope));
        }
        if let Some(o) = &p.owner
            && v.owners.get(o.claim).is_none_or(Option::is_none)
        {
            return Err(self.refuse(p, Reason::NoOwnerClaim));
        }
        let allowance = self.limit(p, v.caller, peer, now)?;
        Ok((caller, allowance))
    }

    /// The cached or freshly verified credential `token` (`domain`: `j` a
    /// JWT, `k` an API key).
    fn credential(&self, p: &Policy, domain: u8, token: &[u8]) -> Result<Caller, Error> {
        if token.len() > self.max_token {
            let reason = match domain {
                b'j' => Reason::Token(Invalid::TooLong),
                _ => Reason::UnknownApiKey,
            };
            return Err(self.refuse(p, reason));
        }
        let now = unix_now();
        let digest = self.keyed.digest_in(domain, token);
        if let Some(held) = self.verified.get(&digest, now) {
            self.stats.token_cache_hits.add(1);
            return Ok(Caller::Held(held));
        }
        self.stats
            .token_cache_misses
            .fetch_add(1, Ordering::Relaxed);
        // Read before the keys: an entry verified against keys replaced
        // meanwhile is then of an old generation, never served.
        let generation = self.verified.generation();
        let v = match domain {
            b'j' => self.verify_jwt(token, digest, generation, now),
            _ => self.verify_api_key(token, digest, generation),
        };
        let v = Arc::new(v.map_err(|r| match r {
            Err(e) => e,
            Ok(reason) => self.refuse(p, reason),
        })?);
        self.verified.insert(v.clone(), now);
        Ok(Caller::Fresh(v))
    }

    /// `Err(Ok(reason))` refuses with 401; `Err(Err(e))` answers `e`.
    fn verify_jwt(
        &self,
        token: &[u8],
        digest: [u8; 32],
        generation: u64,
        now: u64,
    ) -> Result<Verified, Result<Reason, Error>> {
        let bad = |i: Invalid| Ok(Reason::Token(i));
        let parsed = jwt::parse(token, self.max_token).map_err(bad)?;
        if parsed.alg.is_hmac() {
            jwt::verify_signature(&parsed, None, self.secret.as_ref()).map_err(bad)?;
        } else {
            let keys = self.keys.load();
            match jwt::choose(&parsed, &keys) {
                Ok(key) => jwt::verify_signature(&parsed, Some(key), None).map_err(bad)?,
                Err(Invalid::UnknownKey) => {
                    if let Some(r) = &self.remote {
                        if !r.loaded.load(Ordering::Acquire) {
                            return Err(Err(Error::AuthNotReady));
                        }
                        self.stats
                            .jwks_refetches_asked
                            .fetch_add(1, Ordering::Relaxed);
                        r.wanted.notify_one();
                    }
                    return Err(bad(Invalid::UnknownKey));
                }
                Err(e) => return Err(bad(e)),
            }
        }
        let claims = jwt::claims(&parsed, &self.rules, now).map_err(bad)?;
        Ok(Verified {
            digest,
            generation,
            valid_from: claims.valid_from,
            valid_until: claims.valid_until,
            scopes: scope_bits(&self.scope_names, &claims.scopes),
            caller: claims
                .sub
                .as_ref()
                .map_or(0, |s| self.keyed.hash64(b's', s.as_bytes())),
            owners: claims
                .owners
                .into_iter()
                .map(|o| o.map(String::into_boxed_str))
                .collect(),
        })
    }

    fn verify_api_key(
        &self,
        key: &[u8],
        digest: [u8; 32],
        generation: u64,
    ) -> Result<Verified, Result<Reason, Error>> {
        let i = self
            .api_keys
            .find(key, &self.keyed)
            .ok_or(Ok(Reason::UnknownApiKey))?;
        let (scopes, caller) = self.api_callers[i];
        Ok(Verified {
            digest,
            generation,
            valid_from: 0,
            valid_until: u64::MAX,
            scopes,
            caller,
            owners: vec![None; self.rules.owner_claims.len()].into_boxed_slice(),
        })
    }

    fn limit(
        &self,
        p: &Policy,
        caller: u64,
        peer: Option<IpAddr>,
        now: Instant,
    ) -> Result<Option<Allowance>, Error> {
        let Some(rate) = &p.rate else {
            return Ok(None);
        };
        let who = match caller {
            0 => self.address(peer),
            c => c,
        };
        // Per resource: the caller's hash mixed with the resource's.
        let key = mix(who ^ p.salt).max(1);
        match self.limiter.check(key, rate, now) {
            limit::Decision::Allowed { remaining, reset } => Ok(Some(Allowance {
                remaining,
                reset: reset.as_nanos().div_ceil(1_000_000_000).max(1) as u64,
            })),
            limit::Decision::Limited { retry_after } => {
                self.stats.count(Reason::RateLimited);
                let secs = retry_after.as_nanos().div_ceil(1_000_000_000).max(1) as u64;
                Err(Error::RateLimited {
                    retry_after: secs,
                    policy: p
                        .rate_policy
                        .clone()
                        .unwrap_or(HeaderValue::from_static("default")),
                    state: HeaderValue::from_str(&format!("\"{}\";r=0;t={secs}", p.resource))
                        .unwrap_or(HeaderValue::from_static("r=0")),
                })
            }
        }
    }

    /// The rate limiter's caller for an address: an IPv6 address by its
    /// /64 (one host usually holds a whole /64), an IPv4-mapped one as the
    /// IPv4 address.
    fn address(&self, peer: Option<IpAddr>) -> u64 {
        match peer.map(|a| a.to_canonical()) {
            None => 1,
            Some(IpAddr::V4(a)) => self.keyed.hash64(b'4', &a.octets()),
            Some(IpAddr::V6(a)) => self.keyed.hash64(b'6', &a.octets()[..8]),
        }
    }

    /// Whether `v`'s owner claim names `key`, a key of a column compared
    /// as `cmp` says (the claim is canonicalised as the key was: a citext
    /// key owned by `Alice` is the key `alice`). An integer claim counts
    /// only in its canonical decimal form: `"03"` and `"+3"` own nothing.
    /// Counts a refusal.
    pub fn owns_key(&self, p: &Policy, v: &Verified, key: &Key, cmp: &Comparison) -> bool {
        let Some(claim) = self.owner_value(p, v) else {
            return true;
        };
        let owns = match key {
            Key::Int(k) => owner::canonical_int(claim) == Some(*k),
            Key::Uuid(k) => uuid::Uuid::parse_str(claim).is_ok_and(|c| c == *k),
            Key::Text(k) => *cmp.text(claim) == **k,
        };
        if !owns {
            self.stats.count(Reason::NotOwner);
        }
        owns
    }

    /// Whether `v`'s owner claim equals the row's `owner_column`, a column
    /// compared as `cmp` says. Counts a refusal.
    pub fn owns_row(&self, p: &Policy, v: &Verified, row: &[u8], cmp: &Comparison) -> bool {
        let (Some(claim), Some(column)) = (self.owner_value(p, v), p.owner_column()) else {
            return true;
        };
        let owns = owner::column(row, column).is_some_and(|value| owner::equals(value, claim, cmp));
        if !owns {
            self.stats.count(Reason::NotOwner);
        }
        owns
    }

    fn owner_value<'v>(&self, p: &Policy, v: &'v Verified) -> Option<&'v str> {
        let o = p.owner.as_ref()?;
        // `check` refused a caller without the claim.
        Some(v.owners.get(o.claim)?.as_deref().unwrap_or("\u{0}"))
    }

    fn refuse(&self, p: &Policy, reason: Reason) -> Error {
        self.stats.count(reason);
        match reason {
            Reason::Missing => Error::Unauthorized {
                code: "unauthorized",
                message: match p.mode {
                    AuthMode::ApiKey => "an API key is required (X-API-Key)",
                    AuthMode::Any => "a bearer token or an API key (X-API-Key) is required",
                    _ => "a bearer token is required",
                },
                challenge: p.challenge_missing.clone(),
            },
            Reason::Token(i) => Error::Unauthorized {
                code: "invalid_token",
                message: i.message(),
                challenge: p.challenge_token.clone(),
            },
            Reason::UnknownApiKey => Error::Unauthorized {
                code: "invalid_key",
                message: "the API key is not valid",
                challenge: p.challenge_key.clone(),
            },
            Reason::TwoCredentials => Error::InvalidRequest {
                challenge: p.challenge_missing.clone(),
            },
            Reason::InsufficientScope => Error::Forbidden {
                message: "the credential lacks a scope this resource requires",
                challenge: p.challenge_scope.clone(),
            },
            Reason::NoOwnerClaim => Error::Forbidden {
                message: "the credential lacks the claim that names its owner",
                challenge: p.challenge_scope.clone(),
            },
            // Never refused here: another owner's row is answered as absent
            // (`http::lookup`), a rate limit by `limit`.
            Reason::NotOwner | Reason::RateLimited => {
                Error::Internal("refused without a refusal".into())
            }
        }
    }

    fn two(&self, p: &Policy) -> Error {
        self.refuse(p, Reason::TwoCredentials)
    }

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
            failures: REASONS
                .iter()
                .map(|r| (r.label(), l(&self.stats.failures[r.index()])))
                .collect(),
        }
    }
}

/// The value of `name` if it appears at most once (`Err` if more).
fn header_once<'h>(
    headers: &'h HeaderMap,
    name: &HeaderName,
) -> Result<Option<&'h HeaderValue>, ()> {
    let mut all = headers.get_all(name).iter();
    match (all.next(), all.next()) {
        (first, None) => Ok(first),
        _ => Err(()),
    }
}

/// The token of `Authorization: Bearer <token>` (the scheme in any case,
/// RFC 9110 §11.1): the public routes' and the admin API's.
pub fn bearer_token(value: &[u8]) -> Option<&[u8]> {
    if value.len() < 7 || !value[..6].eq_ignore_ascii_case(b"bearer") || value[6] != b' ' {
        return None;
    }
    let token = value[7..].trim_ascii();
    (!token.is_empty()).then_some(token)
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A 64-bit finaliser (splitmix64's): spreads a keyed hash mixed with a
/// resource's salt over the limiter's sets.
fn mix(mut x: u64) -> u64 {
    x ^= x >> 30;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_tokens_are_found_in_any_case_of_the_scheme_only() {
        assert_eq!(bearer_token(b"Bearer abc"), Some(&b"abc"[..]));
        assert_eq!(bearer_token(b"bearer  abc "), Some(&b"abc"[..]));
        assert_eq!(bearer_token(b"BEARER abc"), Some(&b"abc"[..]));
        assert_eq!(bearer_token(b"Basic abc"), None);
        assert_eq!(bearer_token(b"Bearer "), None);
        assert_eq!(bearer_token(b"Bearerabc"), None);
    }

    #[test]
    fn every_reason_has_its_own_label() {
        let labels: std::collections::HashSet<_> = REASONS.iter().map(|r| r.label()).collect();
        assert_eq!(labels.len(), REASONS.len());
    }
}
