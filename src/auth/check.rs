//! The request check: finds the one credential a request carries, verifies
//! it (or finds it in the verified-credential cache), compares its scopes
//! and owner claim with the resource's [`Policy`], counts the caller's rate
//! limit, and turns each refusal into its answer (401, 403, 429). The
//! order, and why a refusal touches nothing else, is in the `auth` module
//! doc.

use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::http::{HeaderMap, HeaderName, HeaderValue, header};

use super::Auth;
use super::jwt::{self, Invalid};
use super::limit;
use super::owner;
use super::policy::{Allowance, Policy, scope_bits};
use super::stats::Refusal;
use super::verified::{Held, Verified};
use crate::config::AuthMode;
use crate::error::Error;
use crate::key::Key;
use crate::key::compare::Comparison;

/// The header an API key comes in.
pub static API_KEY: HeaderName = HeaderName::from_static("x-api-key");

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

impl Auth {
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
            (None, None) => return Err(self.refuse(p, Refusal::Missing)),
            (Some(auth), None) => {
                let token = bearer_token(auth.as_bytes())
                    .ok_or_else(|| self.refuse(p, Refusal::Token(Invalid::Malformed)))?;
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
            return Err(self.refuse(p, Refusal::InsufficientScope));
        }
        if let Some(o) = &p.owner
            && v.owners.get(o.claim).is_none_or(Option::is_none)
        {
            return Err(self.refuse(p, Refusal::NoOwnerClaim));
        }
        let allowance = self.limit(p, v.caller, peer, now)?;
        Ok((caller, allowance))
    }

    /// The cached or freshly verified credential `token` (`domain`: `j` a
    /// JWT, `k` an API key).
    fn credential(&self, p: &Policy, domain: u8, token: &[u8]) -> Result<Caller, Error> {
        if token.len() > self.max_token {
            let reason = match domain {
                b'j' => Refusal::Token(Invalid::TooLong),
                _ => Refusal::UnknownApiKey,
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
    ) -> Result<Verified, Result<Refusal, Error>> {
        let bad = |i: Invalid| Ok(Refusal::Token(i));
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
    ) -> Result<Verified, Result<Refusal, Error>> {
        let i = self
            .api_keys
            .find(key, &self.keyed)
            .ok_or(Ok(Refusal::UnknownApiKey))?;
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
                self.stats.count(Refusal::RateLimited);
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
            self.stats.count(Refusal::NotOwner);
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
            self.stats.count(Refusal::NotOwner);
        }
        owns
    }

    fn owner_value<'v>(&self, p: &Policy, v: &'v Verified) -> Option<&'v str> {
        let o = p.owner.as_ref()?;
        // `check` refused a caller without the claim.
        Some(v.owners.get(o.claim)?.as_deref().unwrap_or("\u{0}"))
    }

    fn refuse(&self, p: &Policy, reason: Refusal) -> Error {
        self.stats.count(reason);
        match reason {
            Refusal::Missing => Error::Unauthorized {
                code: "unauthorized",
                message: match p.mode {
                    AuthMode::ApiKey => "an API key is required (X-API-Key)",
                    AuthMode::Any => "a bearer token or an API key (X-API-Key) is required",
                    _ => "a bearer token is required",
                },
                challenge: p.challenge_missing.clone(),
            },
            Refusal::Token(i) => Error::Unauthorized {
                code: "invalid_token",
                message: i.message(),
                challenge: p.challenge_token.clone(),
            },
            Refusal::UnknownApiKey => Error::Unauthorized {
                code: "invalid_key",
                message: "the API key is not valid",
                challenge: p.challenge_key.clone(),
            },
            Refusal::TwoCredentials => Error::InvalidRequest {
                challenge: p.challenge_missing.clone(),
            },
            Refusal::InsufficientScope => Error::Forbidden {
                message: "the credential lacks a scope this resource requires",
                challenge: p.challenge_scope.clone(),
            },
            Refusal::NoOwnerClaim => Error::Forbidden {
                message: "the credential lacks the claim that names its owner",
                challenge: p.challenge_scope.clone(),
            },
            // Never refused here: another owner's row is answered as absent
            // (`http::lookup`), a rate limit by `limit`.
            Refusal::NotOwner | Refusal::RateLimited => {
                Error::Internal("refused without a refusal".into())
            }
        }
    }

    fn two(&self, p: &Policy) -> Error {
        self.refuse(p, Refusal::TwoCredentials)
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
}
