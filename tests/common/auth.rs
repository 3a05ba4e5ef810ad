//! What the access-control tests share (`tests/it/auth/checks.rs`,
//! `tests/it/auth/keys.rs`): signing keys made for the run, the resources
//! with their rules, the config, a seeded database, a client on a real
//! socket, a local JWKS endpoint.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use bloomgate::auth::jwt::{self, Alg};
use ring::rand::SystemRandom;
use ring::signature::{self, EcdsaKeyPair, Ed25519KeyPair, KeyPair, RsaKeyPair};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use crate::common::*;

pub const SECRET: &str = "test-secret-of-at-least-32-bytes-0123456789";
pub const API_KEY: &str = "reporting-key-0123456789abcdef";
pub const WEAK_KEY: &str = "weak-key-0123456789abcdef";

pub fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

pub fn b64(b: &[u8]) -> String {
    URL_SAFE_NO_PAD.encode(b)
}

/// Signing keys made for this test run.
pub struct Signers {
    pub rsa: RsaKeyPair,
    pub ec: EcdsaKeyPair,
    pub ed: Ed25519KeyPair,
    pub rng: SystemRandom,
}

/// An RSA key from the openssl CLI (ring cannot make one): `-outform DER`
/// writes the PKCS#1 `RSAPrivateKey`.
pub fn rsa_key() -> RsaKeyPair {
    let path = std::env::temp_dir().join(format!("bloomgate-rsa-{:x}.der", rand::random::<u64>()));
    let status = std::process::Command::new("openssl")
        .args([
            "genpkey",
            "-algorithm",
            "RSA",
            "-pkeyopt",
            "rsa_keygen_bits:2048",
            "-outform",
            "DER",
            "-out",
        ])
        .arg(&path)
        .stderr(std::process::Stdio::null())
        .status()
        .expect("the openssl CLI makes the RSA test key (scripts/test.sh installs it)");
    assert!(status.success());
    let der = std::fs::read(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    RsaKeyPair::from_der(&der).unwrap()
}

impl Signers {
    pub fn new() -> Self {
        let rng = SystemRandom::new();
        let ec_doc =
            EcdsaKeyPair::generate_pkcs8(&signature::ECDSA_P256_SHA256_FIXED_SIGNING, &rng)
                .unwrap();
        let ed_doc = Ed25519KeyPair::generate_pkcs8(&rng).unwrap();
        Self {
            rsa: rsa_key(),
            ec: EcdsaKeyPair::from_pkcs8(
                &signature::ECDSA_P256_SHA256_FIXED_SIGNING,
                ec_doc.as_ref(),
                &rng,
            )
            .unwrap(),
            ed: Ed25519KeyPair::from_pkcs8(ed_doc.as_ref()).unwrap(),
            rng,
        }
    }

    pub fn sign(&self, alg: Alg, kid: Option<&str>, claims: &Value) -> String {
        let mut header = json!({"alg": alg.name(), "typ": "JWT"});
        if let Some(k) = kid {
            header["kid"] = json!(k);
        }
        jwt::encode(&header, claims, |m| match alg {
            Alg::HS256 => jwt::Secret::new(SECRET.as_bytes()).sign(alg, m).unwrap(),
            Alg::RS256 => {
                let mut sig = vec![0; self.rsa.public().modulus_len()];
                self.rsa
                    .sign(&signature::RSA_PKCS1_SHA256, &self.rng, m, &mut sig)
                    .unwrap();
                sig
            }
            Alg::ES256 => self.ec.sign(&self.rng, m).unwrap().as_ref().to_vec(),
            Alg::EdDSA => self.ed.sign(m).as_ref().to_vec(),
            other => panic!("no test signer for {other:?}"),
        })
    }

    pub fn jwk(&self, alg: Alg, kid: &str) -> Value {
        match alg {
            Alg::RS256 => {
                let c = signature::RsaPublicKeyComponents::<Vec<u8>>::from(self.rsa.public());
                json!({"kty": "RSA", "kid": kid, "alg": "RS256", "use": "sig", "n": b64(&c.n), "e": b64(&c.e)})
            }
            Alg::ES256 => {
                let p = self.ec.public_key().as_ref();
                json!({"kty": "EC", "kid": kid, "crv": "P-256", "x": b64(&p[1..33]), "y": b64(&p[33..65])})
            }
            Alg::EdDSA => {
                json!({"kty": "OKP", "kid": kid, "crv": "Ed25519", "x": b64(self.ed.public_key().as_ref())})
            }
            other => panic!("no JWK for {other:?}"),
        }
    }
}

pub fn claims(sub: &str, scope: &str) -> Value {
    json!({"sub": sub, "scope": scope, "exp": now() + 600})
}

/// Extra resources on the demo tables, each with its own rules.
pub const RESOURCES: &str = r#"
    [[resource]]
    name = "private_users"
    route = "/private/users/{id}"
    table = "users"
    key_column = "id"
    key_type = "bigint"
    columns = ["id", "email", "name"]
    auth = "jwt"
    scopes = ["users:read"]

    [[resource]]
    name = "me"
    route = "/me/{id}"
    table = "users"
    key_column = "id"
    key_type = "bigint"
    columns = ["id", "email", "name"]
    auth = "jwt"
    owner_claim = "sub"

    [[resource]]
    name = "my_articles"
    route = "/my/articles/{id}"
    table = "articles"
    key_column = "id"
    key_type = "uuid"
    columns = ["id", "author_id", "title"]
    auth = "jwt"
    owner_claim = "sub"
    owner_column = "author_id"

    [[resource]]
    name = "keyed_users"
    route = "/keyed/users/{id}"
    table = "users"
    key_column = "id"
    key_type = "bigint"
    columns = ["id", "name"]
    auth = "api_key"
    scopes = ["users:read"]

    [[resource]]
    name = "any_users"
    route = "/any/users/{id}"
    table = "users"
    key_column = "id"
    key_type = "bigint"
    columns = ["id", "name"]
    auth = "any"

    [[resource]]
    name = "limited_users"
    route = "/limited/users/{id}"
    table = "users"
    key_column = "id"
    key_type = "bigint"
    columns = ["id", "name"]
    auth = "jwt"
    rate_limit = "1/s"
    rate_limit_burst = 3

    [[resource]]
    name = "open_users"
    route = "/open/users/{id}"
    table = "users"
    key_column = "id"
    key_type = "bigint"
    columns = ["id", "name"]
    rate_limit = "1/s"
    rate_limit_burst = 2
"#;

/// A keys file with the reporting key (scope users:read) and a weak one
/// (no scope), written for this test.
pub fn api_keys_file() -> std::path::PathBuf {
    let path =
        std::env::temp_dir().join(format!("bloomgate-keys-{:x}.toml", rand::random::<u64>()));
    std::fs::write(
        &path,
        format!(
            "[[key]]\nname = \"reporting\"\nkey = \"{API_KEY}\"\nscopes = [\"users:read\"]\n\
             [[key]]\nname = \"weak\"\nkey = \"{WEAK_KEY}\"\n"
        ),
    )
    .unwrap();
    path
}

pub fn jwks_file(doc: &Value) -> std::path::PathBuf {
    let path =
        std::env::temp_dir().join(format!("bloomgate-jwks-{:x}.json", rand::random::<u64>()));
    std::fs::write(&path, doc.to_string()).unwrap();
    path
}

/// The test config: `database` lines, the `[auth]` table (plus the keys
/// file when it names none: `keyed_users` needs one), the resources.
pub fn auth_config(db: &TestDb, database: &str, auth: &str) -> bloomgate::config::Config {
    let keys = match auth.contains("api_keys_file") {
        true => String::new(),
        false => format!("api_keys_file = \"{}\"", api_keys_file().display()),
    };
    config(
        &db.url,
        &format!(
            "{database}\n[auth]\n{auth}\n{keys}\n[server]\nmax_header_bytes = 262144\n{RESOURCES}"
        ),
    )
}

pub async fn seeded() -> TestDb {
    let db = TestDb::new().await;
    db.seed_users(50).await;
    db.exec(
        "INSERT INTO articles (id, author_id, title, body) VALUES
         ('00000000-0000-0000-0000-000000000007', 7, 'by seven', 'x'),
         ('00000000-0000-0000-0000-000000000008', 8, 'by eight', 'y')",
    )
    .await;
    db
}

pub struct Client {
    pub http: reqwest::Client,
    pub base: String,
}

impl Client {
    pub fn new(addr: SocketAddr) -> Self {
        Self {
            http: reqwest::Client::new(),
            base: format!("http://{addr}"),
        }
    }

    pub async fn get(&self, path: &str, headers: &[(&str, &str)]) -> reqwest::Response {
        let mut req = self.http.get(format!("{}{path}", self.base));
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        req.send().await.unwrap()
    }

    pub async fn bearer(&self, path: &str, token: &str) -> reqwest::Response {
        self.get(path, &[("authorization", &format!("Bearer {token}"))])
            .await
    }
}

pub fn h<'a>(r: &'a reqwest::Response, name: &str) -> &'a str {
    r.headers()
        .get(name)
        .map(|v| v.to_str().unwrap())
        .unwrap_or_default()
}

/// Status, the headers that describe the response (not the request id or
/// the date), and the body.
pub async fn described(r: reqwest::Response) -> (u16, Vec<(String, String)>, String) {
    let status = r.status().as_u16();
    let mut headers: Vec<_> = r
        .headers()
        .iter()
        .filter(|(n, _)| !matches!(n.as_str(), "x-request-id" | "date"))
        .map(|(n, v)| (n.to_string(), v.to_str().unwrap().to_string()))
        .collect();
    headers.sort();
    (status, headers, r.text().await.unwrap())
}

/// A local JWKS endpoint whose document the test changes, counting fetches.
pub struct JwksServer {
    pub url: String,
    /// `None`: answer 503 (the provider is down).
    pub doc: Arc<Mutex<Option<String>>>,
    pub fetches: Arc<AtomicU64>,
    pub task: tokio::task::JoinHandle<()>,
}

impl JwksServer {
    pub async fn start(doc: &Value) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!(
            "http://{}/.well-known/jwks.json",
            listener.local_addr().unwrap()
        );
        let doc = Arc::new(Mutex::new(Some(doc.to_string())));
        let fetches = Arc::new(AtomicU64::new(0));
        let (d, f) = (doc.clone(), fetches.clone());
        let task = tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                let (d, f) = (d.clone(), f.clone());
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 4096];
                    let mut got = 0;
                    while !buf[..got].windows(4).any(|w| w == b"\r\n\r\n") {
                        match s.read(&mut buf[got..]).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => got += n,
                        }
                    }
                    f.fetch_add(1, Ordering::SeqCst);
                    let (status, body) = match d.lock().unwrap().clone() {
                        Some(body) => ("200 OK", body),
                        None => ("503 Service Unavailable", String::new()),
                    };
                    let resp = format!(
                        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = s.write_all(resp.as_bytes()).await;
                });
            }
        });
        Self {
            url,
            doc,
            fetches,
            task,
        }
    }

    pub fn set(&self, doc: &Value) {
        *self.doc.lock().unwrap() = Some(doc.to_string());
    }

    pub fn fail(&self) {
        *self.doc.lock().unwrap() = None;
    }

    pub fn fetches(&self) -> u64 {
        self.fetches.load(Ordering::SeqCst)
    }
}

impl Drop for JwksServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A gateway served on the seeded database whose keys come from a local
/// JWKS endpoint holding `keys`' ES256 key as `kid` (refetched at most once
/// a second), with `auth` lines added.
pub async fn with_jwks(
    keys: &Signers,
    kid: &str,
    auth: &str,
) -> (TestDb, JwksServer, Arc<bloomgate::gateway::Gateway>, Served) {
    let db = seeded().await;
    let jwks = JwksServer::start(&json!({"keys": [keys.jwk(Alg::ES256, kid)]})).await;
    let cfg = auth_config(
        &db,
        "",
        &format!(
            "jwks_url = \"{}\"\njwks_min_refetch_interval = \"1s\"\n{auth}",
            jwks.url
        ),
    );
    let gw = gateway(cfg);
    let served = serve_socket(&gw, None).await;
    (db, jwks, gw, served)
}

/// Asks until `done` holds for the answer, or panics after 15 s (which
/// only catches "never"; no latency is asserted).
pub async fn until(c: &Client, path: &str, token: &str, done: impl Fn(u16) -> bool, what: &str) {
    let began = std::time::Instant::now();
    loop {
        let status = c.bearer(path, token).await.status().as_u16();
        if done(status) {
            return;
        }
        assert!(
            began.elapsed() < Duration::from_secs(15),
            "{what}: still {status}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A gateway served on the seeded database with `jwt_secret`, and its
/// client.
pub async fn with_secret() -> (TestDb, Served, Client) {
    let db = seeded().await;
    let gw = gateway(auth_config(&db, "", &format!("jwt_secret = \"{SECRET}\"")));
    let served = serve_socket(&gw, None).await;
    let c = Client::new(served.addr);
    (db, served, c)
}

/// `claims` signed HS256 with the test secret.
pub fn hs256(claims: &Value) -> String {
    let s = jwt::Secret::new(SECRET.as_bytes());
    jwt::encode(&json!({"alg": "HS256"}), claims, |m| {
        s.sign(Alg::HS256, m).unwrap()
    })
}
