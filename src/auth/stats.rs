//! The access checks' counters: why a request was refused
//! ([`Reason`], `bloomgate_auth_failures_total{reason}`), the
//! verified-credential cache's hits and misses, and the JWKS fetches. Kept
//! apart from the checks so the admin view and the refresher count into
//! the same place the request path does.

use std::sync::atomic::{AtomicU64, Ordering};

use super::jwt::Invalid;
use crate::counter::Counter;

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

    pub(super) fn index(self) -> usize {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reason_has_its_own_label() {
        let labels: std::collections::HashSet<_> = REASONS.iter().map(|r| r.label()).collect();
        assert_eq!(labels.len(), REASONS.len());
    }
}
