//! The request check: finds the one credential a request carries, verifies
//! it (or finds it in the verified-credential cache), compares its scopes
//! and owner claim with the resource's [`Policy`], counts the caller's rate
//! limit, and turns each refusal into its answer (401, 403, 429). The
//! order, and why a refusal touches nothing else, is in the `auth` module
//! doc.
//!
//! Every refusal names its cause ([`Refusal`], the JSON error's `reason`
//! and the access line's) and says it in words a caller can act on: the
//! token's `aud` and what would fix it, how long ago it expired, which
//! `kid` no key has, which scopes are missing, what the owner claim holds.
//! What a verified token says is known from the verified cache; what a
//! refused one says is read again from the token only on the refusal
//! ([`jwt::explain`]), so the path of a token that verifies is unchanged.
//! The token itself is never quoted.

use std::borrow::Cow;
use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::http::{HeaderMap, HeaderName, HeaderValue, header};

use super::Auth;
use super::jwt::{self, Invalid, OwnerClaim};
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
            (None, None) => return Err(self.refuse(p, Refused::of(Refusal::Missing))),
            (Some(auth), None) => {
                let token = bearer_token(auth.as_bytes()).ok_or_else(|| {
                    self.refuse(p, Refused::of(Refusal::Token(Invalid::Malformed)))
                })?;
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
            return Err(self.refuse(p, self.lacking_scopes(p, v.scopes)));
        }
        if let Some(o) = &p.owner
            && v.owners.get(o.claim).and_then(OwnerClaim::owners).is_none()
        {
            return Err(self.refuse(p, no_owner(p, o, v.owners.get(o.claim))));
        }
        let allowance = self.limit(p, v.caller, peer, now)?;
        Ok((caller, allowance))
    }

    /// The 403 of a credential without every scope `p` requires: which
    /// ones, and where they are read from.
    fn lacking_scopes(&self, p: &Policy, held: u64) -> Refused {
        let missing: Vec<&str> = p
            .scopes
            .iter()
            .filter(|s| held & scope_bits(&self.scope_names, [s.as_str()]) == 0)
            .map(String::as_str)
            .collect();
        let token = format!(
            "a token's scopes are read from its claim {:?}, auth.scope_claim",
            self.rules.scope_claim
        );
        let key = "an API key's are its entry's in auth.api_keys_file";
        let from = match p.mode {
            AuthMode::ApiKey => key.to_string(),
            AuthMode::Jwt => token,
            _ => format!("{token}; {key}"),
        };
        Refused::new(
            Refusal::InsufficientScope,
            format!(
                "the credential lacks {}, which this resource requires ({from})",
                missing
                    .iter()
                    .map(|s| format!("{s:?}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        )
    }

    /// The cached or freshly verified credential `token` (`domain`: `j` a
    /// JWT, `k` an API key).
    fn credential(&self, p: &Policy, domain: u8, token: &[u8]) -> Result<Caller, Error> {
        if token.len() > self.max_token {
            let reason = match domain {
                b'j' => Refusal::Token(Invalid::TooLong),
                _ => Refusal::UnknownApiKey,
            };
            return Err(self.refuse(p, Refused::of(reason)));
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
            Ok(refused) => self.refuse(p, refused),
        })?);
        self.verified.insert(v.clone(), now);
        Ok(Caller::Fresh(v))
    }

    /// `Err(Ok(refused))` refuses with 401; `Err(Err(e))` answers `e`.
    fn verify_jwt(
        &self,
        token: &[u8],
        digest: [u8; 32],
        generation: u64,
        now: u64,
    ) -> Result<Verified, Result<Refused, Error>> {
        let bad = |i: Invalid| Ok(Refused::of(Refusal::Token(i)));
        let parsed = jwt::parse(token, self.max_token).map_err(bad)?;
        if parsed.alg.is_hmac() {
            if self.secret.is_none() {
                return Err(Ok(Refused::new(
                    Refusal::Token(Invalid::Algorithm),
                    format!(
                        "the token is signed {}, with a shared secret, and auth.jwt_secret is not \
                         set: tokens are verified here by the public keys of auth.jwks_file and \
                         auth.jwks_url",
                        parsed.alg.name()
                    ),
                )));
            }
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
                    return Err(Ok(self.unknown_key(&parsed, &keys)));
                }
                Err(Invalid::Algorithm) => {
                    let held = keys
                        .iter()
                        .find(|k| k.kid == parsed.kid)
                        .map_or("another", |k| k.alg.name());
                    return Err(Ok(Refused::new(
                        Refusal::Token(Invalid::Algorithm),
                        format!(
                            "the token says {}, and its key (kid {}) is for {held}",
                            parsed.alg.name(),
                            jwt::shown(&parsed.kid.clone().unwrap_or_default().into())
                        ),
                    )));
                }
                Err(e) => return Err(bad(e)),
            }
        }
        let claims = jwt::claims(&parsed, &self.rules, now).map_err(|i| {
            Ok(Refused {
                reason: Refusal::Token(i),
                detail: jwt::explain(&parsed, &self.rules, now, i).map(Cow::Owned),
            })
        })?;
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
            owners: claims.owners.into_boxed_slice(),
        })
    }

    /// The 401 of a token whose key is not held: which `kid`, or why none
    /// could be chosen without one.
    fn unknown_key(&self, parsed: &jwt::Parsed<'_>, keys: &[jwt::PublicKey]) -> Refused {
        let sources = match (self.file_keys.is_empty(), &self.remote) {
            (_, Some(_)) => {
                "auth.jwks_url (fetched again for an unknown kid, at most once per \
                 auth.jwks_min_refetch_interval)"
            }
            (false, None) => "auth.jwks_file",
            (true, None) => "auth.jwks_file and auth.jwks_url, neither of which is set",
        };
        let detail = match &parsed.kid {
            Some(kid) => format!(
                "the token's kid {} is not among the {} keys held, from {sources}: is the token \
                 from another realm or tenant, or signed by a key the set no longer lists?",
                jwt::shown(&kid.as_str().into()),
                keys.len()
            ),
            None => {
                let of_alg = keys.iter().filter(|k| k.alg == parsed.alg).count();
                match of_alg {
                    0 => format!("no key for {} is held, from {sources}", parsed.alg.name()),
                    n => format!(
                        "the token has no kid, and {n} keys for {} are held: a kid says which",
                        parsed.alg.name()
                    ),
                }
            }
        };
        Refused::new(Refusal::Token(Invalid::UnknownKey), detail)
    }

    fn verify_api_key(
        &self,
        key: &[u8],
        digest: [u8; 32],
        generation: u64,
    ) -> Result<Verified, Result<Refused, Error>> {
        let i = self
            .api_keys
            .find(key, &self.keyed)
            .ok_or(Ok(Refused::of(Refusal::UnknownApiKey)))?;
        let (scopes, caller) = self.api_callers[i];
        Ok(Verified {
            digest,
            generation,
            valid_from: 0,
            valid_until: u64::MAX,
            scopes,
            caller,
            owners: vec![OwnerClaim::Absent; self.rules.owner_claims.len()].into_boxed_slice(),
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
    /// With several owners in the claim, any of them may own it. `key` is
    /// the key, or the composite key's part the owner column names.
    pub fn owns_key(&self, p: &Policy, v: &Verified, key: &Key, cmp: &Comparison) -> bool {
        let Some(claims) = self.owner_values(p, v) else {
            return true;
        };
        let owns = claims.iter().any(|claim| match key {
            Key::Int(k) => owner::canonical_int(claim) == Some(*k),
            Key::Uuid(k) => uuid::Uuid::parse_str(claim).is_ok_and(|c| c == *k),
            Key::Text(k) => *cmp.text(claim) == **k,
            // A whole composite key names no owner (the configuration
            // refuses an owner claim on one without owner_column).
            Key::Tuple(_) => false,
        });
        if !owns {
            self.stats.count(Refusal::NotOwner);
        }
        owns
    }

    /// Whether `v`'s owner claim (any of its owners) equals the row's
    /// `owner_column`, a column compared as `cmp` says. Counts a refusal.
    pub fn owns_row(&self, p: &Policy, v: &Verified, row: &[u8], cmp: &Comparison) -> bool {
        let (Some(claims), Some(column)) = (self.owner_values(p, v), p.owner_column()) else {
            return true;
        };
        let owns = owner::column(row, column)
            .is_some_and(|value| claims.iter().any(|claim| owner::equals(value, claim, cmp)));
        if !owns {
            self.stats.count(Refusal::NotOwner);
        }
        owns
    }

    /// The owners `v`'s claim names, if `p` has an owner rule. `check`
    /// refused a caller whose claim names none: here that reads as an
    /// empty list, which owns nothing.
    fn owner_values<'v>(&self, p: &Policy, v: &'v Verified) -> Option<&'v [Box<str>]> {
        let o = p.owner.as_ref()?;
        Some(v.owners.get(o.claim)?.owners().unwrap_or(&[]))
    }

    fn refuse(&self, p: &Policy, refused: Refused) -> Error {
        let Refused { reason, detail } = refused;
        self.stats.count(reason);
        let label = reason.label();
        match reason {
            Refusal::Missing => Error::Unauthorized {
                code: "unauthorized",
                reason: label,
                message: Cow::Borrowed(match p.mode {
                    AuthMode::ApiKey => "an API key is required (X-API-Key)",
                    AuthMode::Any => "a bearer token or an API key (X-API-Key) is required",
                    _ => "a bearer token is required",
                }),
                challenge: p.challenge_missing.clone(),
            },
            Refusal::Token(i) => Error::Unauthorized {
                code: "invalid_token",
                reason: label,
                message: detail.unwrap_or(Cow::Borrowed(i.message())),
                challenge: p.challenge_token.clone(),
            },
            Refusal::UnknownApiKey => Error::Unauthorized {
                code: "invalid_key",
                reason: label,
                message: Cow::Borrowed("the API key is not valid"),
                challenge: p.challenge_key.clone(),
            },
            Refusal::TwoCredentials => Error::InvalidRequest {
                challenge: p.challenge_missing.clone(),
            },
            Refusal::InsufficientScope => Error::Forbidden {
                reason: label,
                message: detail.unwrap_or(Cow::Borrowed(
                    "the credential lacks a scope this resource requires",
                )),
                challenge: p.challenge_scope.clone(),
            },
            Refusal::NoOwnerClaim | Refusal::OwnerClaimType => Error::Forbidden {
                reason: label,
                message: detail.unwrap_or(Cow::Borrowed(
                    "the credential lacks the claim that names its owner",
                )),
                challenge: p.challenge_owner.clone(),
            },
            // Never refused here: another owner's row is answered as absent
            // (`http::lookup`), a rate limit by `limit`.
            Refusal::NotOwner | Refusal::RateLimited => {
                Error::Internal("refused without a refusal".into())
            }
        }
    }

    fn two(&self, p: &Policy) -> Error {
        self.refuse(p, Refused::of(Refusal::TwoCredentials))
    }
}

/// A refusal, and what it says beyond its reason's fixed sentence.
struct Refused {
    reason: Refusal,
    detail: Option<Cow<'static, str>>,
}

impl Refused {
    fn of(reason: Refusal) -> Self {
        Self {
            reason,
            detail: None,
        }
    }

    fn new(reason: Refusal, detail: String) -> Self {
        Self {
            reason,
            detail: Some(Cow::Owned(detail)),
        }
    }
}

/// The 403 of a credential whose owner claim (`o`, holding `held`) names
/// no owner: the claim, and what it holds instead. Not a scope: no scope
/// would help.
fn no_owner(p: &Policy, o: &super::Owner, held: Option<&OwnerClaim>) -> Refused {
    let claim = &o.claim_name;
    match held {
        Some(OwnerClaim::Unusable(what)) => Refused::new(
            Refusal::OwnerClaimType,
            format!(
                "the owner claim {claim:?} (resource.owner_claim) holds {what}: an owner is a \
                 string or an integer, or an array of at most {} of them (any one matches)",
                super::jwt::MAX_OWNERS
            ),
        ),
        _ => Refused::new(
            Refusal::NoOwnerClaim,
            match p.mode {
                AuthMode::ApiKey => format!(
                    "an API key names no owner: this resource's rows are read by a token with \
                     the claim {claim:?} (resource.owner_claim)"
                ),
                _ => format!(
                    "the credential has no claim {claim:?}, which names the owner of this \
                     resource's rows (resource.owner_claim)"
                ),
            },
        ),
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
