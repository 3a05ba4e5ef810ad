//! The one mapping from [`Error`] to an HTTP response, and the JSON bodies.
//!
//! Bodies are `{"error": <code>, "message": <text>}`, and for a refused
//! credential (400 `invalid_request`, 401, 403) `"reason": <label>` too,
//! the cause as `bloomgate_auth_failures_total` and the access line name
//! it ([`Refused`]). Messages come from `Error`'s `Display`, which never
//! carries SQL, database text, secrets or a credential.

use std::collections::BTreeSet;
use std::sync::Mutex;

use axum::body::Body;
use axum::http::header::InvalidHeaderValue;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;

use crate::error::Error;

/// RFC 9211. A `HeaderName` rather than a `&str`: a string name is parsed
/// and hashed into one on every insert.
pub const CACHE_STATUS: HeaderName = HeaderName::from_static("cache-status");
/// draft-ietf-httpapi-ratelimit-headers: the quota policy, and what is
/// left of it.
pub const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
pub const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
const JSON: HeaderValue = HeaderValue::from_static("application/json");

/// Why a request was refused, on its response (an extension, never sent):
/// the front layer's access line writes it as `reason`. Set only on
/// refusals, off every fast path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Refused(pub &'static str);

impl Error {
    pub fn status(&self) -> StatusCode {
        match self {
            Error::BadKey(_) | Error::InvalidRequest { .. } => StatusCode::BAD_REQUEST,
            Error::Unauthorized { .. } => StatusCode::UNAUTHORIZED,
            Error::Forbidden { .. } => StatusCode::FORBIDDEN,
            Error::RateLimited { .. } => StatusCode::TOO_MANY_REQUESTS,
            Error::NotReady
            | Error::AuthNotReady
            | Error::Unverified
            | Error::Unavailable(_)
            | Error::Overloaded => StatusCode::SERVICE_UNAVAILABLE,
            Error::Timeout => StatusCode::GATEWAY_TIMEOUT,
            Error::KeyNotUnique | Error::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The cause of a refused credential ([`Refused`]).
    fn reason(&self) -> Option<&'static str> {
        match self {
            Error::Unauthorized { reason, .. } | Error::Forbidden { reason, .. } => Some(reason),
            Error::InvalidRequest { .. } => Some(crate::auth::Refusal::TwoCredentials.label()),
            _ => None,
        }
    }

    /// RFC 9211 `Cache-Status` for a request that ended in this error.
    fn cache_status(&self) -> &'static str {
        match self {
            Error::BadKey(_) => "bloomgate; detail=malformed-key",
            Error::NotReady | Error::AuthNotReady => "bloomgate; detail=not-ready",
            Error::Unverified => "bloomgate; detail=unverified",
            Error::Unauthorized { .. } | Error::InvalidRequest { .. } => {
                "bloomgate; detail=unauthorized"
            }
            Error::Forbidden { .. } => "bloomgate; detail=forbidden",
            Error::RateLimited { .. } => "bloomgate; detail=rate-limited",
            Error::Unavailable(_) => "bloomgate; fwd=miss; detail=database-unavailable",
            Error::Overloaded => "bloomgate; detail=overloaded",
            Error::Timeout => "bloomgate; detail=timeout",
            Error::KeyNotUnique => "bloomgate; fwd=miss; detail=key-not-unique",
            Error::Internal(_) => "bloomgate; detail=internal",
        }
    }
}

impl IntoResponse for Error {
    fn into_response(self) -> Response {
        if let Error::Internal(detail) = &self {
            tracing::error!(%detail, "internal error");
        }
        let status = self.status();
        let reason = self.reason();
        let mut resp = match reason {
            None => json_error(status, self.code(), &self.to_string()),
            Some(reason) => refusal(status, self.code(), reason, &self.to_string()),
        };
        let h = resp.headers_mut();
        h.insert(CACHE_STATUS, HeaderValue::from_static(self.cache_status()));
        // An outage, an overload or a bad key says nothing a downstream
        // cache should keep: the next request may well succeed.
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        if status == StatusCode::SERVICE_UNAVAILABLE {
            h.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        match self {
            Error::Unauthorized { challenge, .. }
            | Error::InvalidRequest { challenge }
            | Error::Forbidden { challenge, .. } => {
                h.insert(header::WWW_AUTHENTICATE, challenge);
            }
            Error::RateLimited {
                retry_after,
                policy,
                state,
            } => {
                h.insert(header::RETRY_AFTER, HeaderValue::from(retry_after));
                h.insert(RATELIMIT_POLICY, policy);
                h.insert(RATELIMIT, state);
            }
            _ => {}
        }
        resp
    }
}

/// A JSON error body.
pub fn json_error(status: StatusCode, code: &str, message: &str) -> Response {
    let body = serde_json::json!({ "error": code, "message": message }).to_string();
    json_bytes(status, Bytes::from(body))
}

/// A refusal's JSON error body, with its `reason`, which the access line
/// is told too ([`Refused`]).
pub fn refusal(status: StatusCode, code: &str, reason: &'static str, message: &str) -> Response {
    let body =
        serde_json::json!({ "error": code, "reason": reason, "message": message }).to_string();
    let mut resp = json_bytes(status, Bytes::from(body));
    resp.extensions_mut().insert(Refused(reason));
    resp
}

/// Headers a response can end with (content type, ETag, Vary,
/// Content-Encoding, Cache-Status, Cache-Control, the request id, what the
/// middleware adds), room made once. A default `HeaderMap` holds 6 before it
/// grows, and a hit has 7 since `Vary`: growing it on every hit would be
/// about a tenth of a hit's cost.
pub const RESPONSE_HEADERS: usize = 12;

/// `value` as a header value cloned by a plain copy, for a value made once
/// and sent on every response of a route (`Cache-Control`, the 404's
/// `Content-Length`).
///
/// Why: a `HeaderValue` (or `Bytes`) made from an owned string is cloned by
/// an atomic reference count. Every hit or filtered 404 of the route, on
/// every core, wrote that one count twice, moving its cache line between
/// the cores on each request. One made from a `&'static str` is copied.
pub fn static_header(value: &str) -> Result<HeaderValue, InvalidHeaderValue> {
    let owned = HeaderValue::from_str(value)?;
    // `from_static` takes visible ASCII and tabs only (it panics on the
    // rest); a value with other bytes `from_str` allows stays owned.
    Ok(
        match value
            .bytes()
            .all(|b| b == b'\t' || (b' '..=b'~').contains(&b))
        {
            true => HeaderValue::from_static(interned(value)),
            false => owned,
        },
    )
}

/// `body` as `Bytes` cloned by a plain copy (see [`static_header`]).
pub fn static_bytes(body: &str) -> Bytes {
    Bytes::from_static(interned(body).as_bytes())
}

/// `s` for the rest of the process, kept once per distinct value: routes
/// are made at start-up (tests make many apps, with the same few values),
/// so what is kept is bounded by the configuration's distinct values.
fn interned(s: &str) -> &'static str {
    static KEPT: Mutex<BTreeSet<&'static str>> = Mutex::new(BTreeSet::new());
    let mut kept = KEPT.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(&s) = kept.get(s) {
        return s;
    }
    let s: &'static str = Box::leak(s.to_owned().into_boxed_str());
    kept.insert(s);
    s
}

/// A response with a prepared JSON body.
pub fn json_bytes(status: StatusCode, body: Bytes) -> Response {
    let mut headers = HeaderMap::with_capacity(RESPONSE_HEADERS);
    headers.insert(header::CONTENT_TYPE, JSON);
    let mut resp = Response::new(Body::from(body));
    *resp.status_mut() = status;
    *resp.headers_mut() = headers;
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A row response gets every header it ends with without its map
    /// growing (a grow is a reallocation and a rehash on every hit).
    #[test]
    fn json_responses_have_room_for_every_header() {
        let resp = json_bytes(StatusCode::OK, Bytes::from_static(b"{}"));
        assert!(resp.headers().capacity() >= RESPONSE_HEADERS);
        assert_eq!(resp.headers()[header::CONTENT_TYPE], "application/json");
        assert_eq!(resp.headers().len(), 1);
    }

    #[test]
    fn static_values_are_checked_kept_once_and_equal_to_their_text() {
        let a = static_header("max-age=0, stale-if-error=300").unwrap();
        let b = static_header(&String::from("max-age=0, stale-if-error=300")).unwrap();
        assert_eq!(a, "max-age=0, stale-if-error=300");
        assert_eq!(a.as_bytes().as_ptr(), b.as_bytes().as_ptr(), "kept once");
        assert!(static_header("no\nnewline").is_err());
        // Bytes `from_str` allows and `from_static` would panic on.
        assert_eq!(
            static_header("a=\u{e9}").unwrap().as_bytes(),
            "a=\u{e9}".as_bytes()
        );
        let body = static_bytes("{\"error\":\"not_found\"}");
        assert_eq!(&body[..], b"{\"error\":\"not_found\"}");
        assert_eq!(
            body.as_ptr(),
            static_bytes("{\"error\":\"not_found\"}").as_ptr()
        );
    }
}
