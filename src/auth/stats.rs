//! The access checks' counters: why a request was refused
//! ([`Refusal`], `bloomgate_auth_failures_total{reason}`, and the
//! `reason` of its JSON error and access line), the
//! verified-credential cache's hits and misses, and the JWKS fetches. Kept
//! apart from the checks so the admin view and the refresher count into
//! the same place the request path does.

use std::sync::atomic::{AtomicU64, Ordering};

use super::jwt::Invalid;
use crate::counter::Counter;

/// Why a request was refused, for `bloomgate_auth_failures_total{reason}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    Missing,
    Token(Invalid),
    UnknownApiKey,
    TwoCredentials,
    InsufficientScope,
    NoOwnerClaim,
    /// The owner claim holds no owner (an array, an object, ...).
    OwnerClaimType,
    NotOwner,
    RateLimited,
}

/// Every reason, in the order of [`Stats::failures`].
pub const REFUSALS: [Refusal; 20] = [
    Refusal::Missing,
    Refusal::Token(Invalid::TooLong),
    Refusal::Token(Invalid::Malformed),
    Refusal::Token(Invalid::Algorithm),
    Refusal::Token(Invalid::UnknownKey),
    Refusal::Token(Invalid::Signature),
    Refusal::Token(Invalid::Expired),
    Refusal::Token(Invalid::NotYetValid),
    Refusal::Token(Invalid::Issuer),
    Refusal::Token(Invalid::Audience),
    Refusal::Token(Invalid::NoAudience),
    Refusal::Token(Invalid::UnexpectedAudience),
    Refusal::Token(Invalid::Claims),
    Refusal::UnknownApiKey,
    Refusal::TwoCredentials,
    Refusal::InsufficientScope,
    Refusal::NoOwnerClaim,
    Refusal::OwnerClaimType,
    Refusal::NotOwner,
    Refusal::RateLimited,
];

impl Refusal {
    pub fn label(self) -> &'static str {
        match self {
            Refusal::Missing => "missing",
            Refusal::Token(i) => i.reason(),
            Refusal::UnknownApiKey => "unknown_api_key",
            Refusal::TwoCredentials => "two_credentials",
            Refusal::InsufficientScope => "insufficient_scope",
            Refusal::NoOwnerClaim => "no_owner_claim",
            Refusal::OwnerClaimType => "owner_claim_type",
            Refusal::NotOwner => "not_owner",
            Refusal::RateLimited => "rate_limited",
        }
    }

    pub(super) fn index(self) -> usize {
        REFUSALS
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
    pub failures: [AtomicU64; REFUSALS.len()],
    pub jwks_fetches: AtomicU64,
    pub jwks_fetch_failures: AtomicU64,
    pub jwks_changes: AtomicU64,
    /// Refetches asked for by a token naming an unknown `kid`.
    pub jwks_refetches_asked: AtomicU64,
}

impl Stats {
    pub fn count(&self, r: Refusal) {
        self.failures[r.index()].fetch_add(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reason_has_its_own_label() {
        let labels: std::collections::HashSet<_> = REFUSALS.iter().map(|r| r.label()).collect();
        assert_eq!(labels.len(), REFUSALS.len());
        for i in Invalid::ALL {
            assert!(REFUSALS.contains(&Refusal::Token(i)), "{i:?}");
        }
        // Written into access lines as they are: nothing to escape.
        assert!(
            labels
                .iter()
                .all(|l| l.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'))
        );
    }
}
