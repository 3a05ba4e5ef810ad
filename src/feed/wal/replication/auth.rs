//! Authentication at start-up: trust, cleartext, MD5 and SCRAM-SHA-256
//! (RFC 5802, RFC 7677; no channel binding). A SCRAM exchange succeeds
//! only once the server has proved it knows the password too.

use bytes::{BufMut, BytesMut};
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

use super::endpoint::Endpoint;
use super::frame::{get_u32, len32, put_cstr, server_error};
use super::{Connection, ReplError, protocol};

impl Connection {
    /// Answers the server's authentication requests until it accepts.
    pub(super) async fn authenticate(&mut self, ep: &Endpoint) -> Result<(), ReplError> {
        let mut scram: Option<Scram> = None;
        loop {
            let m = self.read().await?;
            match m.tag {
                b'R' => {}
                b'E' => return Err(server_error(&m.body)),
                b'N' => continue,
                t => {
                    return Err(protocol(format!(
                        "unexpected message {:?} during authentication",
                        t as char
                    )));
                }
            }
            let mut b = m.body;
            let kind = get_u32(&mut b)?;
            match kind {
                0 if scram.is_some() => {
                    return Err(ReplError::Auth(
                        "the server ended SCRAM without proving it knows the password".into(),
                    ));
                }
                0 => return Ok(()),
                3 => {
                    let pw = password(ep)?;
                    let mut p = BytesMut::new();
                    put_cstr(&mut p, pw);
                    self.send(b'p', &p).await?;
                }
                5 => {
                    if b.len() < 4 {
                        return Err(protocol("short MD5 salt"));
                    }
                    let salt = b.split_to(4);
                    let hashed = md5_password(&ep.user, password(ep)?, &salt);
                    let mut p = BytesMut::new();
                    put_cstr(&mut p, &hashed);
                    self.send(b'p', &p).await?;
                }
                10 => {
                    // SASL: the mechanisms, NUL-terminated, then an empty one.
                    let mechs: Vec<&[u8]> = b.split(|&c| c == 0).collect();
                    if !mechs.contains(&&b"SCRAM-SHA-256"[..]) {
                        return Err(ReplError::Auth(
                            "the server offers no SASL mechanism this client speaks (SCRAM-SHA-256 without channel binding)".into(),
                        ));
                    }
                    let s = Scram::new(password(ep)?, &nonce());
                    let first = s.client_first();
                    let mut p = BytesMut::new();
                    put_cstr(&mut p, "SCRAM-SHA-256");
                    p.put_i32(len32(first.len())? as i32);
                    p.extend_from_slice(first.as_bytes());
                    self.send(b'p', &p).await?;
                    scram = Some(s);
                }
                11 => {
                    let mut s = scram
                        .take()
                        .ok_or_else(|| protocol("SASL continue without a SASL start"))?;
                    let server_first = std::str::from_utf8(&b)
                        .map_err(|_| protocol("SCRAM server-first is not UTF-8"))?
                        .to_owned();
                    // Thousands of HMAC rounds: off the runtime's threads.
                    let (s, fin) = tokio::task::spawn_blocking(move || {
                        let fin = s.client_final(&server_first);
                        (s, fin)
                    })
                    .await
                    .map_err(|_| ReplError::Auth("the SCRAM computation failed".into()))?;
                    self.send(b'p', fin?.as_bytes()).await?;
                    scram = Some(s);
                }
                12 => {
                    let s = scram
                        .take()
                        .ok_or_else(|| protocol("SASL final without a SASL exchange"))?;
                    let server_final = std::str::from_utf8(&b)
                        .map_err(|_| protocol("SCRAM server-final is not UTF-8"))?;
                    s.verify_server(server_final)?;
                }
                other => {
                    return Err(ReplError::Auth(format!(
                        "authentication method {other} is not supported (trust, password, md5 and scram-sha-256 are)"
                    )));
                }
            }
        }
    }
}

fn password(ep: &Endpoint) -> Result<&str, ReplError> {
    ep.password.as_deref().ok_or_else(|| {
        ReplError::Auth("the server asks for a password and none is configured".into())
    })
}

fn md5_password(user: &str, password: &str, salt: &[u8]) -> String {
    use md5::Md5;
    let inner = hex(&Md5::digest(format!("{password}{user}").as_bytes()));
    let mut h = Md5::new();
    h.update(inner.as_bytes());
    h.update(salt);
    format!("md5{}", hex(&h.finalize()))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn nonce() -> String {
    use base64::Engine;
    let raw: [u8; 18] = rand::random();
    base64::engine::general_purpose::STANDARD.encode(raw)
}

/// One SCRAM-SHA-256 exchange (RFC 5802, RFC 7677), without channel
/// binding (`n,,`). Postgres takes the user from the start-up packet and
/// ignores the one in these messages, so the client sends `n=`.
struct Scram {
    password: String,
    nonce: String,
    client_first_bare: String,
    /// After the client-final: what the server's signature must be.
    expected_server_signature: Option<Vec<u8>>,
}

type HmacSha256 = Hmac<Sha256>;

fn hmac(key: &[u8], data: &[u8]) -> Vec<u8> {
    let mut m = HmacSha256::new_from_slice(key).expect("HMAC takes any key length");
    m.update(data);
    m.finalize().into_bytes().to_vec()
}

impl Scram {
    fn new(password: &str, nonce: &str) -> Self {
        Self::with_user("", password, nonce)
    }

    fn with_user(user: &str, password: &str, nonce: &str) -> Self {
        // SASLprep where it applies; Postgres uses the raw bytes otherwise.
        let password = stringprep::saslprep(password)
            .map(|p| p.into_owned())
            .unwrap_or_else(|_| password.to_owned());
        Self {
            password,
            nonce: nonce.to_owned(),
            client_first_bare: format!("n={user},r={nonce}"),
            expected_server_signature: None,
        }
    }

    fn client_first(&self) -> String {
        format!("n,,{}", self.client_first_bare)
    }

    fn client_final(&mut self, server_first: &str) -> Result<String, ReplError> {
        use base64::Engine;
        let b64 = base64::engine::general_purpose::STANDARD;
        let bad = || ReplError::Auth("malformed SCRAM server-first message".into());
        let mut nonce = None;
        let mut salt = None;
        let mut iterations = None;
        for attr in server_first.split(',') {
            match attr.split_once('=') {
                Some(("r", v)) => nonce = Some(v),
                Some(("s", v)) => salt = Some(b64.decode(v).map_err(|_| bad())?),
                Some(("i", v)) => iterations = Some(v.parse::<u32>().map_err(|_| bad())?),
                _ => {}
            }
        }
        let (Some(nonce), Some(salt), Some(iterations)) = (nonce, salt, iterations) else {
            return Err(bad());
        };
        if !nonce.starts_with(&self.nonce) || nonce.len() == self.nonce.len() {
            return Err(ReplError::Auth(
                "the server's SCRAM nonce does not extend ours".into(),
            ));
        }
        // Postgres' default is 4,096; this bounds the work a hostile server
        // can ask for (about a second).
        if iterations == 0 || iterations > 1_000_000 {
            return Err(bad());
        }
        let salted = pbkdf2_sha256(self.password.as_bytes(), &salt, iterations);
        let client_key = hmac(&salted, b"Client Key");
        let stored_key = Sha256::digest(&client_key);
        let without_proof = format!("c=biws,r={nonce}");
        let auth_message = format!("{},{server_first},{without_proof}", self.client_first_bare);
        let signature = hmac(&stored_key, auth_message.as_bytes());
        let proof: Vec<u8> = client_key
            .iter()
            .zip(&signature)
            .map(|(a, b)| a ^ b)
            .collect();
        let server_key = hmac(&salted, b"Server Key");
        self.expected_server_signature = Some(hmac(&server_key, auth_message.as_bytes()));
        Ok(format!("{without_proof},p={}", b64.encode(proof)))
    }

    fn verify_server(&self, server_final: &str) -> Result<(), ReplError> {
        use base64::Engine;
        if let Some(e) = server_final.strip_prefix("e=") {
            return Err(ReplError::Auth(format!("the server refused: {e}")));
        }
        let got = server_final
            .strip_prefix("v=")
            .and_then(|v| base64::engine::general_purpose::STANDARD.decode(v).ok());
        match (&self.expected_server_signature, got) {
            (Some(want), Some(got)) if *want == got => Ok(()),
            _ => Err(ReplError::Auth(
                "the server's SCRAM signature is wrong: it does not know the password".into(),
            )),
        }
    }
}

fn pbkdf2_sha256(password: &[u8], salt: &[u8], iterations: u32) -> Vec<u8> {
    let mut block = salt.to_vec();
    block.extend_from_slice(&1u32.to_be_bytes());
    let mut u = hmac(password, &block);
    let mut out = u.clone();
    for _ in 1..iterations {
        u = hmac(password, &u);
        for (o, x) in out.iter_mut().zip(&u) {
            *o ^= x;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RFC 7677's example exchange (user "user", password "pencil").
    #[test]
    fn scram_matches_the_rfc_7677_example() {
        let mut s = Scram::with_user("user", "pencil", "rOprNGfwEbeRWgbNEkqO");
        assert_eq!(s.client_first(), "n,,n=user,r=rOprNGfwEbeRWgbNEkqO");
        let fin = s
            .client_final("r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096")
            .unwrap();
        assert_eq!(
            fin,
            "c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ="
        );
        s.verify_server("v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4=")
            .unwrap();
        assert!(
            s.verify_server("v=AAAATRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4=")
                .is_err()
        );
        assert!(s.verify_server("e=invalid-proof").is_err());
    }

    #[test]
    fn scram_refuses_a_server_that_does_not_extend_our_nonce() {
        for first in [
            "r=someoneelse,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096",
            "r=abc,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096",
            "r=abcdef,s=!!,i=4096",
            "r=abcdef,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=0",
            "r=abcdef,s=W22ZaJ0SNY7soEsUEjb6gQ==",
        ] {
            let mut s = Scram::new("pw", "abc");
            assert!(s.client_final(first).is_err(), "{first}");
        }
    }

    #[test]
    fn md5_password_is_postgres_form() {
        // md5(md5("secret" || "alice") || salt), as libpq computes it.
        let inner = hex(&md5::Md5::digest(b"secretalice"));
        let mut h = md5::Md5::new();
        h.update(inner.as_bytes());
        h.update([1, 2, 3, 4]);
        let want = format!("md5{}", hex(&h.finalize()));
        assert_eq!(md5_password("alice", "secret", &[1, 2, 3, 4]), want);
        assert_eq!(want.len(), 35);
    }
}
