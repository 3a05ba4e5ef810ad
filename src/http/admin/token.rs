//! The admin token check: the token in force (replaced whole on SIGHUP),
//! verified by keyed digests compared in constant time so nothing about it
//! leaks through timing, and the audit lines of the admin listener
//! (refused tokens, and every request that may change state).

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::Response;
use subtle::ConstantTimeEq;

use super::St;
use crate::auth::keyed::KeyedHash;

/// Verifies bearer tokens without keeping or comparing the token itself.
pub struct TokenCheck {
    key: KeyedHash,
    digest: [u8; 32],
}

impl TokenCheck {
    pub fn new(token: &str) -> Self {
        let key = KeyedHash::random();
        let digest = key.digest(token.as_bytes());
        Self { key, digest }
    }

    pub fn verify(&self, presented: &[u8]) -> bool {
        self.key.digest(presented).ct_eq(&self.digest).into()
    }
}

impl std::fmt::Debug for TokenCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TokenCheck(..)")
    }
}

/// The admin token in force, replaced as a whole (SIGHUP re-reads
/// `admin.token_file`): a request is checked against the old token or the
/// new one, never a mix.
pub struct AdminToken(arc_swap::ArcSwap<TokenCheck>);

impl AdminToken {
    pub fn new(token: &str) -> Self {
        Self(arc_swap::ArcSwap::from_pointee(TokenCheck::new(token)))
    }

    pub fn replace(&self, token: &str) {
        self.0.store(Arc::new(TokenCheck::new(token)));
    }

    pub fn verify(&self, presented: &[u8]) -> bool {
        self.0.load().verify(presented)
    }
}

pub(super) async fn require_token(State(state): St, req: Request, next: Next) -> Response {
    let presented = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| crate::auth::bearer_token(v.as_bytes()));
    let client = req
        .extensions()
        .get::<crate::auth::peer::PeerAddr>()
        .map(|p| p.0.to_string())
        .unwrap_or_default();
    let allowed = presented.is_some_and(|t| {
        state.token.verify(t)
            || (req.uri().path() == "/metrics"
                && state.metrics_token.as_ref().is_some_and(|m| m.verify(t)))
    });
    match allowed {
        true => {
            let method = req.method().clone();
            let path = req.uri().path().to_string();
            let resp = next.run(req).await;
            if method != axum::http::Method::GET && method != axum::http::Method::HEAD {
                tracing::info!(
                    target: crate::telemetry::AUDIT,
                    method = %method,
                    path,
                    status = resp.status().as_u16(),
                    client,
                    "admin action"
                );
            }
            resp
        }
        false => {
            tracing::warn!(
                target: crate::telemetry::AUDIT,
                method = %req.method(),
                path = req.uri().path(),
                client,
                token = if presented.is_some() { "wrong" } else { "missing" },
                "admin token refused"
            );
            let mut resp = crate::http::response::refusal(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                match presented {
                    Some(_) => "admin_token",
                    None => "missing",
                },
                match presented {
                    Some(_) => {
                        "the bearer token is not the admin token (admin.token_file, BLOOMGATE_ADMIN_TOKEN) nor the metrics token"
                    }
                    None => {
                        "a bearer token is required: the admin token (admin.token_file, BLOOMGATE_ADMIN_TOKEN)"
                    }
                },
            );
            resp.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"bloomgate-admin\""),
            );
            resp
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_verify_only_exactly() {
        let t = TokenCheck::new("correct horse battery staple");
        assert!(t.verify(b"correct horse battery staple"));
        assert!(!t.verify(b"correct horse battery stapl"));
        assert!(!t.verify(b"correct horse battery staple "));
        assert!(!t.verify(b""));
        assert!(!format!("{t:?}").contains("horse"));
    }
}
