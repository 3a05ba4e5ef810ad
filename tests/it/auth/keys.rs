//! The keys tokens are checked with, over real sockets: a JWKS URL served
//! by a small local HTTP server, rotated, emptied and taken down
//! (revocation, `auth.jwks_max_stale`), and a base64 `jwt_secret`.

use crate::common;
use crate::support;

use std::time::Duration;

use base64::Engine;
use bloomgate::auth::jwt::{self, Alg};
use common::*;
use serde_json::{Value, json};
use support::*;

#[tokio::test]
async fn a_rotated_key_set_refuses_the_removed_kid_and_takes_the_new_one() {
    let keys = Signers::new();
    let (_db, jwks, gw, served) = with_jwks(&keys, "old", "jwks_refresh_interval = \"1h\"").await;
    // Ready only once the key set has been fetched.
    assert!(gw.auth.is_ready());
    let c = Client::new(served.addr);
    let cl = claims("1", "users:read");
    let old = keys.sign(Alg::ES256, Some("old"), &cl);
    assert_eq!(c.bearer("/private/users/3", &old).await.status(), 200);

    // The provider rotates: the old key goes, a new one (EdDSA) comes.
    jwks.set(&json!({"keys": [keys.jwk(Alg::EdDSA, "new")]}));
    let new = keys.sign(Alg::EdDSA, Some("new"), &cl);
    // Its first token names an unknown kid: a refetch, at most one a
    // second, whoever asks; retried until the new set is in.
    let fetched = jwks.fetches();
    let began = std::time::Instant::now();
    loop {
        let status = c.bearer("/private/users/3", &new).await.status();
        if status == 200 {
            break;
        }
        assert_eq!(status, 401);
        assert!(
            began.elapsed() < Duration::from_secs(10),
            "the new key never arrived"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The old kid is refused at once, though its token was verified and
    // cached before the rotation and has not expired.
    let r = c.bearer("/private/users/3", &old).await;
    assert_eq!(r.status(), 401);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["reason"], "unknown_key");
    let message = body["message"].as_str().unwrap();
    assert!(
        message.starts_with("the token's kid \"old\" is not among the 1 keys held"),
        "{message}"
    );
    // A burst of unknown kids cannot make the gateway fetch at will.
    let before = jwks.fetches();
    for i in 0..50 {
        let t = keys.sign(Alg::EdDSA, Some(&format!("k{i}")), &cl);
        assert_eq!(c.bearer("/private/users/3", &t).await.status(), 401);
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        jwks.fetches() - before <= 2,
        "{} fetches",
        jwks.fetches() - before
    );
    assert!(jwks.fetches() - fetched <= 3 + began.elapsed().as_secs());
    served.shutdown().await.unwrap();
}

/// Finding 1: a fetched key set is the provider's word, an empty one too:
/// the removed key's tokens, cached or new, are refused. A provider that
/// stops answering keeps its keys trusted for `jwks_max_stale` only; then
/// they are dropped, tokens signed by them are 503 and `/readyz` says why;
/// a good fetch brings them back.
#[tokio::test]
async fn an_empty_key_set_revokes_and_keys_past_jwks_max_stale_are_dropped() {
    let keys = Signers::new();
    let (_db, jwks, _gw, served) = with_jwks(
        &keys,
        "k1",
        "jwks_refresh_interval = \"1s\"\njwks_max_stale = \"3s\"",
    )
    .await;
    let c = Client::new(served.addr);
    let cl = claims("1", "users:read");
    let cached = keys.sign(Alg::ES256, Some("k1"), &cl);
    assert_eq!(c.bearer("/private/users/3", &cached).await.status(), 200);

    jwks.set(&json!({"keys": []}));
    until(
        &c,
        "/private/users/3",
        &cached,
        |s| s == 401,
        "a token verified before the empty set",
    )
    .await;
    let fresh = keys.sign(
        Alg::ES256,
        Some("k1"),
        &json!({"sub": "2", "scope": "users:read", "exp": now() + 600}),
    );
    assert_eq!(
        c.bearer("/private/users/3", &fresh).await.status(),
        401,
        "a token signed after"
    );
    let ready = c.get("/readyz", &[]).await;
    assert_eq!(
        ready.status(),
        200,
        "an empty set is the provider's word, not an outage"
    );

    // The key comes back, then the provider goes down.
    jwks.set(&json!({"keys": [keys.jwk(Alg::ES256, "k1")]}));
    until(
        &c,
        "/private/users/3",
        &cached,
        |s| s == 200,
        "the key back",
    )
    .await;
    jwks.fail();
    until(
        &c,
        "/private/users/3",
        &cached,
        |s| s == 503,
        "keys past jwks_max_stale",
    )
    .await;
    let r = c.get("/readyz", &[]).await;
    assert_eq!(r.status(), 503);
    let why = r.text().await.unwrap();
    assert!(why.contains("auth.jwks_max_stale"), "{why}");
    jwks.set(&json!({"keys": [keys.jwk(Alg::ES256, "k1")]}));
    until(
        &c,
        "/private/users/3",
        &cached,
        |s| s == 200,
        "a good fetch again",
    )
    .await;
    assert_eq!(c.get("/readyz", &[]).await.status(), 200);
    served.shutdown().await.unwrap();
}

/// `auth.jwt_secret_base64`: a secret that is not text, given in base64,
/// verifies tokens signed with its bytes, and not those signed with its
/// base64 text.
#[tokio::test]
async fn a_base64_secret_verifies_tokens_signed_with_its_bytes() {
    use base64::engine::general_purpose::STANDARD;
    let db = seeded().await;
    let bytes: Vec<u8> = (0u8..40).map(|i| i.wrapping_mul(151) ^ 0x80).collect();
    assert!(std::str::from_utf8(&bytes).is_err(), "not text");
    let encoded = STANDARD.encode(&bytes);
    let gw = gateway(auth_config(
        &db,
        "",
        &format!("jwt_secret = \"{encoded}\"\njwt_secret_base64 = true"),
    ));
    let served = serve_socket(&gw, None).await;
    let c = Client::new(served.addr);
    let sign = |key: &[u8]| {
        let s = jwt::Secret::new(key);
        jwt::encode(&json!({"alg": "HS256"}), &claims("1", "users:read"), |m| {
            s.sign(Alg::HS256, m).unwrap()
        })
    };
    assert_eq!(
        c.bearer("/private/users/3", &sign(&bytes)).await.status(),
        200
    );
    assert_eq!(
        c.bearer("/private/users/3", &sign(encoded.as_bytes()))
            .await
            .status(),
        401
    );
    served.shutdown().await.unwrap();
}
