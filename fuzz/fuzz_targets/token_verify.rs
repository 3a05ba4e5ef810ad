//! Fuzzes the token path of the access checks: what a caller controls
//! before a request may reach the filter.
//!
//! The first byte picks what the rest is:
//! * `0`: a bearer token, split and its header read (`jwt::parse`), its key
//!   chosen among an Ed25519, a P-256 and an RSA key (`jwt::choose`), its
//!   signature checked (`jwt::verify_signature`), and its claims read as if
//!   it had verified (`jwt::claims`);
//! * `1`: a token's claims, signed here with the HS256 secret, so the claims
//!   parser is reached through the whole path as a signed token would, and
//!   a refusal's explanation (`jwt::explain`) of them;
//! * `2`: a cached row's JSON, searched for an owner column
//!   (`owner::column`, `owner::equals`);
//! * `3`: a JWK Set document (`jwks::parse`).
//!
//! Never panics; a token that verifies has a valid `exp` in its claims, and
//! a column found is a slice of the row.
#![no_main]

use std::sync::Arc;

use bloomgate::auth::jwt::{self, Alg, PublicKey, Rules, Secret};
use bloomgate::auth::{jwks, owner};
use bloomgate::key::compare::{Comparison, Lowering};
use libfuzzer_sys::fuzz_target;

const SECRET: &[u8] = b"fuzz-secret-0123456789abcdef0123";
const NOW: u64 = 1_800_000_000;

fn keys() -> Vec<PublicKey> {
    let mut n = vec![0xc5u8; 256];
    n[255] = 0x01;
    vec![
        PublicKey::ed25519(Some("ed".into()), &[9u8; 32]).unwrap(),
        PublicKey::ec(Some("ec".into()), Alg::ES256, &[1u8; 32], &[2u8; 32]).unwrap(),
        PublicKey::rsa(Some("rsa".into()), Alg::RS256, &n, &[1, 0, 1]).unwrap(),
    ]
}

fn rules() -> Rules {
    Rules {
        issuer: Some("https://idp".into()),
        audience: Some("api".into()),
        leeway: 30,
        scope_claim: "scope".into(),
        owner_claims: vec!["sub".into(), "tenant".into()],
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    match mode % 4 {
        0 => {
            let Ok(parsed) = jwt::parse(rest, 65_536) else {
                return;
            };
            let keys = keys();
            let secret = Secret::new(SECRET);
            if let Ok(key) = jwt::choose(&parsed, &keys) {
                assert_eq!(key.alg, parsed.alg);
                let _ = jwt::verify_signature(&parsed, Some(key), None);
            }
            if jwt::verify_signature(&parsed, None, Some(&secret)).is_ok()
                && let Ok(c) = jwt::claims(&parsed, &rules(), NOW)
            {
                assert!(c.valid_until > NOW && c.valid_from <= NOW);
            }
            let _ = jwt::claims(&parsed, &rules(), NOW);
        }
        1 => {
            let Ok(claims) = serde_json::from_slice::<serde_json::Value>(rest) else {
                return;
            };
            let secret = Secret::new(SECRET);
            let token = jwt::encode(&serde_json::json!({"alg": "HS256"}), &claims, |m| {
                secret.sign(Alg::HS256, m).unwrap()
            });
            let parsed = jwt::parse(token.as_bytes(), usize::MAX).expect("our own token parses");
            jwt::verify_signature(&parsed, None, Some(&secret)).expect("our own signature verifies");
            match jwt::claims(&parsed, &rules(), NOW) {
                Ok(c) => {
                    assert!(c.valid_until > NOW && c.valid_from <= NOW);
                    assert_eq!(c.owners.len(), 2);
                }
                // What a refusal says of any claims: a bounded text (a
                // claim's value is quoted cut short).
                Err(why) => {
                    if let Some(text) = jwt::explain(&parsed, &rules(), NOW, why) {
                        assert!(text.len() < 2048, "{}", text.len());
                    }
                }
            }
        }
        2 => {
            let (name, row) = match rest.iter().position(|&b| b == 0) {
                Some(i) => (&rest[..i], &rest[i + 1..]),
                None => (&b"owner_id"[..], rest),
            };
            let Ok(name) = std::str::from_utf8(name) else {
                return;
            };
            if let Some(v) = owner::column(row, name) {
                let (start, end) = (row.as_ptr() as usize, row.as_ptr() as usize + row.len());
                assert!(v.as_ptr() as usize >= start && v.as_ptr() as usize + v.len() <= end);
                assert!(!v.is_empty());
                let _ = owner::equals(v, "42", &Comparison::Bytes);
                let _ = owner::equals(v, "Ab", &Comparison::Lower(Arc::new(Lowering::ascii())));
            }
        }
        _ => {
            if let Ok((keys, _)) = jwks::parse(rest) {
                assert!(keys.len() <= jwks::MAX_KEYS);
            }
        }
    }
});
