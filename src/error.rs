//! The one error type of the request path.
//!
//! Every failure a client can see is a variant here, and `http::response`
//! maps each to exactly one status code. Display strings are written for
//! clients: they never carry SQL, database messages or secrets. The database's
//! own error stays in [`Error::Unavailable`]'s source, for logs only.

use std::borrow::Cow;

use axum::http::HeaderValue;

use crate::key::KeyError;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The key cannot be parsed for the resource's key type (400).
    #[error("{0}")]
    BadKey(#[from] KeyError),
    /// The resource's filter has not been built yet (503).
    #[error("the gateway is starting: the key filter is still loading")]
    NotReady,
    /// The database could not be reached or did not answer in time (503).
    /// The detail is the driver's message, for logs only.
    #[error("the database is unavailable")]
    Unavailable(String),
    /// The filter rejected the key while the change feed could not vouch
    /// for it (a resync, a silent feed) and the database check budget was
    /// spent (503).
    #[error("the gateway is resyncing with the database: this key cannot be answered right now")]
    Unverified,
    /// Too many requests already in flight (503).
    #[error("the gateway is overloaded")]
    Overloaded,
    /// The request did not finish within the configured timeout (504).
    #[error("the request timed out")]
    Timeout,
    /// No credential, or one that does not verify: missing, malformed,
    /// expired, wrongly signed, for another audience (401). `challenge` is
    /// the resource's `WWW-Authenticate` (RFC 6750 §3); `reason` the
    /// cause's label (`auth::Refusal`); the message says the cause and,
    /// where there is one, the fix, and never quotes the credential.
    #[error("{message}")]
    Unauthorized {
        code: &'static str,
        reason: &'static str,
        message: Cow<'static, str>,
        challenge: HeaderValue,
    },
    /// A bearer token and an API key at once, or a credential header twice
    /// (400, RFC 6750 `invalid_request`): which one is the caller?
    #[error("send one credential: a bearer token or an API key, once")]
    InvalidRequest { challenge: HeaderValue },
    /// A credential that verified but may not read this resource: a scope
    /// is missing, or the owner claim, or it names no owner (403,
    /// `insufficient_scope`); `reason` and the message as for
    /// [`Error::Unauthorized`].
    #[error("{message}")]
    Forbidden {
        reason: &'static str,
        message: Cow<'static, str>,
        challenge: HeaderValue,
    },
    /// The caller is past its rate limit (429): `Retry-After` in seconds,
    /// and the `RateLimit-Policy` and `RateLimit` fields.
    #[error("too many requests; retry after {retry_after} s")]
    RateLimited {
        retry_after: u64,
        policy: HeaderValue,
        state: HeaderValue,
    },
    /// `auth.jwks_url` has not been fetched yet, so no token signed by its
    /// keys can be checked (503).
    #[error("the gateway is starting: the token signing keys are not loaded yet")]
    AuthNotReady,
    /// The key matched two rows: the resource's key columns do not name
    /// one row (a view repeating rows, a unique index dropped). Neither row
    /// is served (500); see `db::Queries::row`.
    #[error("the key matches more than one row: this resource's key is not unique")]
    KeyNotUnique,
    /// A bug: an invariant of ours did not hold (500).
    #[error("internal error")]
    Internal(String),
}

impl Error {
    /// A stable, machine-readable name for the JSON body and metrics.
    pub fn code(&self) -> &'static str {
        match self {
            Error::BadKey(_) => "malformed_key",
            Error::NotReady => "not_ready",
            Error::Unverified => "unverified",
            Error::Unavailable(_) => "database_unavailable",
            Error::Overloaded => "overloaded",
            Error::Timeout => "timeout",
            Error::Unauthorized { code, .. } => code,
            Error::InvalidRequest { .. } => "invalid_request",
            Error::Forbidden { .. } => "insufficient_scope",
            Error::RateLimited { .. } => "rate_limited",
            Error::AuthNotReady => "not_ready",
            Error::KeyNotUnique => "key_not_unique",
            Error::Internal(_) => "internal",
        }
    }
}
