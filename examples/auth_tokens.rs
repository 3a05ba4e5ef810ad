//! Credentials for `bench/auth.sh`: keys made here (RSA from a PKCS#1 DER
//! file the script makes with the openssl CLI, since `ring` cannot make
//! one), and tokens signed with them.
//!
//!     cargo run --release --example auth_tokens -- DIR RSA_DER COUNT
//!
//! Writes into DIR: `secret` (the HS256 secret), `jwks.json` (the ES256,
//! EdDSA and RS256 public keys), `api-keys.toml` and `api-key` (one key),
//! `{hs256,es256,eddsa,rs256}.warm` (one token each) and
//! `{hs256,es256,eddsa,rs256}.cold` (COUNT distinct tokens each, one a
//! line). Every token is for `sub` bench-N, scope users:read, valid for 2 h.

use std::io::Write;
use std::path::PathBuf;
use std::time::{SystemTime, UNIX_EPOCH};

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use bloomgate::auth::jwt::{self, Alg};
use ring::rand::{SecureRandom, SystemRandom};
use ring::signature::{self, EcdsaKeyPair, Ed25519KeyPair, KeyPair, RsaKeyPair};
use serde_json::json;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [dir, rsa, count] = args.as_slice() else {
        eprintln!("usage: auth_tokens DIR RSA_DER COUNT");
        std::process::exit(2);
    };
    let dir = PathBuf::from(dir);
    let count: usize = count.parse().expect("COUNT is a number");
    std::fs::create_dir_all(&dir).unwrap();
    let rng = SystemRandom::new();
    let mut secret = [0u8; 32];
    rng.fill(&mut secret).unwrap();
    let secret_hex: String = secret.iter().map(|b| format!("{b:02x}")).collect();
    std::fs::write(dir.join("secret"), &secret_hex).unwrap();
    let hs = jwt::Secret::new(secret_hex.as_bytes());
    let ec_doc =
        EcdsaKeyPair::generate_pkcs8(&signature::ECDSA_P256_SHA256_FIXED_SIGNING, &rng).unwrap();
    let ec = EcdsaKeyPair::from_pkcs8(
        &signature::ECDSA_P256_SHA256_FIXED_SIGNING,
        ec_doc.as_ref(),
        &rng,
    )
    .unwrap();
    let ed =
        Ed25519KeyPair::from_pkcs8(Ed25519KeyPair::generate_pkcs8(&rng).unwrap().as_ref()).unwrap();
    let rsa = RsaKeyPair::from_der(&std::fs::read(rsa).unwrap()).unwrap();
    let b64 = |b: &[u8]| URL_SAFE_NO_PAD.encode(b);
    let p = ec.public_key().as_ref();
    let rc = signature::RsaPublicKeyComponents::<Vec<u8>>::from(rsa.public());
    let set = json!({"keys": [
        {"kty": "EC", "crv": "P-256", "kid": "es", "x": b64(&p[1..33]), "y": b64(&p[33..65])},
        {"kty": "OKP", "crv": "Ed25519", "kid": "ed", "x": b64(ed.public_key().as_ref())},
        {"kty": "RSA", "kid": "rs", "alg": "RS256", "n": b64(&rc.n), "e": b64(&rc.e)},
    ]});
    std::fs::write(dir.join("jwks.json"), set.to_string()).unwrap();
    let mut key = [0u8; 24];
    rng.fill(&mut key).unwrap();
    let key = b64(&key);
    std::fs::write(dir.join("api-key"), &key).unwrap();
    std::fs::write(
        dir.join("api-keys.toml"),
        format!("[[key]]\nname = \"bench\"\nkey = \"{key}\"\nscopes = [\"users:read\"]\n"),
    )
    .unwrap();

    let exp = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 7200;
    let sign = |alg: Alg, i: usize| {
        let kid = match alg {
            Alg::ES256 => Some("es"),
            Alg::EdDSA => Some("ed"),
            Alg::RS256 => Some("rs"),
            _ => None,
        };
        let mut header = json!({"alg": alg.name(), "typ": "JWT"});
        if let Some(k) = kid {
            header["kid"] = k.into();
        }
        let claims = json!({"sub": format!("bench-{i}"), "scope": "users:read", "exp": exp});
        jwt::encode(&header, &claims, |m| match alg {
            Alg::HS256 => hs.sign(alg, m).unwrap(),
            Alg::ES256 => ec.sign(&rng, m).unwrap().as_ref().to_vec(),
            Alg::EdDSA => ed.sign(m).as_ref().to_vec(),
            Alg::RS256 => {
                let mut sig = vec![0; rsa.public().modulus_len()];
                rsa.sign(&signature::RSA_PKCS1_SHA256, &rng, m, &mut sig)
                    .unwrap();
                sig
            }
            _ => unreachable!(),
        })
    };
    for (alg, name) in [
        (Alg::HS256, "hs256"),
        (Alg::ES256, "es256"),
        (Alg::EdDSA, "eddsa"),
        (Alg::RS256, "rs256"),
    ] {
        std::fs::write(dir.join(format!("{name}.warm")), sign(alg, 0)).unwrap();
        let mut out = std::io::BufWriter::new(
            std::fs::File::create(dir.join(format!("{name}.cold"))).unwrap(),
        );
        for i in 1..=count {
            writeln!(out, "{}", sign(alg, i)).unwrap();
        }
        eprintln!("{name}: {count} tokens");
    }
}
