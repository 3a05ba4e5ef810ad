//! A resource's access rules, prepared once from its config: which
//! credentials it takes, the scope bits it requires, its owner check, its
//! rate, and the challenge and `RateLimit-Policy` headers it answers with,
//! made up front so a request only compares and clones.

use axum::http::{HeaderName, HeaderValue};

use super::{keyed, limit};
use crate::config::{AuthMode, Resolved};

const REALM: &str = "bloomgate";

/// A resource's rules, prepared once.
pub struct Policy {
    pub resource: String,
    pub mode: AuthMode,
    /// Bits of [`Auth`](super::Auth)'s scope list that must all be held.
    pub(super) required: u64,
    pub scopes: Vec<String>,
    pub owner: Option<Owner>,
    pub rate: Option<limit::Rate>,
    /// Mixed into the limiter's key, so a caller's limits are per resource.
    pub(super) salt: u64,
    pub(super) challenge_missing: HeaderValue,
    pub(super) challenge_token: HeaderValue,
    pub(super) challenge_key: HeaderValue,
    pub(super) challenge_scope: HeaderValue,
    /// A 403 for the owner claim: `insufficient_scope` (RFC 6750 has no
    /// other 403) without a `scope`, since no scope would help.
    pub(super) challenge_owner: HeaderValue,
    pub(super) rate_policy: Option<HeaderValue>,
}

/// An owner check: the claim (an index into the owner claims) and the
/// column it is compared with (`None`: the key).
#[derive(Clone, Debug)]
pub struct Owner {
    pub claim: usize,
    pub claim_name: String,
    /// The column compared with the claim, read from the row; `None`: the
    /// key, or its part `key_part`, before the filter.
    pub column: Option<String>,
    pub key_part: Option<usize>,
}

impl Policy {
    /// `r`'s rules; `scope_names` and `owner_claims` are the gateway's
    /// lists (a scope's bit is its index), `keyed` salts the limiter's keys.
    pub(super) fn new(
        r: &Resolved,
        scope_names: &[String],
        owner_claims: &[String],
        keyed: &keyed::KeyedHash,
    ) -> Self {
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
        let bearer_scope = format!("{bearer}, error=\"insufficient_scope\", scope=\"{scope}\"");
        let api_scope = format!("{api}, error=\"insufficient_scope\", scope=\"{scope}\"");
        let bearer_owner = format!("{bearer}, error=\"insufficient_scope\"");
        let api_owner = format!("{api}, error=\"insufficient_scope\"");
        let rate = a
            .rate_limit
            .map(|l| limit::Rate::new(l.per_second, l.burst));
        Policy {
            resource: r.name.clone(),
            mode: a.mode,
            required: scope_bits(scope_names, &a.scopes),
            scopes: a.scopes.clone(),
            owner: a.owner_claim.as_ref().map(|c| Owner {
                claim: owner_claims
                    .iter()
                    .position(|x| x == c)
                    .expect("collected above"),
                claim_name: c.clone(),
                column: a.owner_column.clone(),
                key_part: a.owner_key_part,
            }),
            rate,
            salt: keyed.hash64(b'r', r.name.as_bytes()),
            challenge_missing: static_value(&both(&bearer, &api)),
            challenge_token: static_value(&both(&bearer_bad, &api)),
            challenge_key: static_value(&both(&bearer, &api_bad)),
            challenge_scope: static_value(&both(&bearer_scope, &api_scope)),
            challenge_owner: static_value(&both(&bearer_owner, &api_owner)),
            rate_policy: rate.map(|rate| {
                static_value(&format!(
                    "\"{}\";q={};w={}",
                    r.name,
                    rate.burst,
                    rate.window_ns().div_ceil(1_000_000_000).max(1)
                ))
            }),
        }
    }

    /// Whether anything is checked at all: false for a public resource
    /// without a rate limit, whose requests skip [`Auth::check`](super::Auth::check).
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

/// A header value made once per resource and cloned on each refusal (never
/// on a request that is let through).
fn static_value(v: &str) -> HeaderValue {
    HeaderValue::from_str(v).unwrap_or_else(|_| HeaderValue::from_static("Bearer"))
}

pub(super) fn scope_bits(names: &[String], held: impl IntoIterator<Item = impl AsRef<str>>) -> u64 {
    held.into_iter().fold(0, |bits, s| {
        match names.iter().position(|n| n == s.as_ref()) {
            Some(i) => bits | 1 << i,
            None => bits,
        }
    })
}
