//! The one error type of the request path.
//!
//! Every failure a client can see is a variant here, and `http::response`
//! maps each to exactly one status code. Display strings are written for
//! clients: they never carry SQL, database messages or secrets. The database's
//! own error stays in [`Error::Unavailable`]'s source, for logs only.

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
            Error::Internal(_) => "internal",
        }
    }
}
