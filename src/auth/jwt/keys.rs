//! The keys a token's signature is checked with: the algorithms accepted
//! ([`Alg`]), public keys from a key set or the config ([`PublicKey`]:
//! each carries its one algorithm) and the HMAC secret ([`Secret`]).

use ring::{hmac, signature};

/// The signature algorithms accepted (RFC 7518 §3.1, RFC 8037).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Alg {
    HS256,
    HS384,
    HS512,
    RS256,
    RS384,
    RS512,
    PS256,
    PS384,
    PS512,
    ES256,
    ES384,
    EdDSA,
}

impl Alg {
    pub fn from_name(name: &str) -> Option<Alg> {
        Some(match name {
            "HS256" => Alg::HS256,
            "HS384" => Alg::HS384,
            "HS512" => Alg::HS512,
            "RS256" => Alg::RS256,
            "RS384" => Alg::RS384,
            "RS512" => Alg::RS512,
            "PS256" => Alg::PS256,
            "PS384" => Alg::PS384,
            "PS512" => Alg::PS512,
            "ES256" => Alg::ES256,
            "ES384" => Alg::ES384,
            "EdDSA" => Alg::EdDSA,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Alg::HS256 => "HS256",
            Alg::HS384 => "HS384",
            Alg::HS512 => "HS512",
            Alg::RS256 => "RS256",
            Alg::RS384 => "RS384",
            Alg::RS512 => "RS512",
            Alg::PS256 => "PS256",
            Alg::PS384 => "PS384",
            Alg::PS512 => "PS512",
            Alg::ES256 => "ES256",
            Alg::ES384 => "ES384",
            Alg::EdDSA => "EdDSA",
        }
    }

    pub fn is_hmac(self) -> bool {
        matches!(self, Alg::HS256 | Alg::HS384 | Alg::HS512)
    }

    fn is_rsa(self) -> bool {
        matches!(
            self,
            Alg::RS256 | Alg::RS384 | Alg::RS512 | Alg::PS256 | Alg::PS384 | Alg::PS512
        )
    }

    fn rsa_params(self) -> Option<&'static signature::RsaParameters> {
        Some(match self {
            Alg::RS256 => &signature::RSA_PKCS1_2048_8192_SHA256,
            Alg::RS384 => &signature::RSA_PKCS1_2048_8192_SHA384,
            Alg::RS512 => &signature::RSA_PKCS1_2048_8192_SHA512,
            Alg::PS256 => &signature::RSA_PSS_2048_8192_SHA256,
            Alg::PS384 => &signature::RSA_PSS_2048_8192_SHA384,
            Alg::PS512 => &signature::RSA_PSS_2048_8192_SHA512,
            _ => return None,
        })
    }
}

/// A public key from a key set: one algorithm, maybe a `kid`.
#[derive(Clone, PartialEq, Eq)]
pub struct PublicKey {
    pub kid: Option<String>,
    pub alg: Alg,
    material: Material,
}

#[derive(Clone, PartialEq, Eq)]
enum Material {
    /// Big-endian modulus and exponent.
    Rsa { n: Vec<u8>, e: Vec<u8> },
    /// An uncompressed EC point (`04 || x || y`) or an Ed25519 key.
    Bytes(Vec<u8>),
}

impl std::fmt::Debug for PublicKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PublicKey")
            .field("kid", &self.kid)
            .field("alg", &self.alg)
            .finish_non_exhaustive()
    }
}

impl PublicKey {
    /// An RSA key for `alg` (an RS* or PS*); at least 2048 bits.
    pub fn rsa(kid: Option<String>, alg: Alg, n: &[u8], e: &[u8]) -> Result<Self, String> {
        if !alg.is_rsa() {
            return Err(format!("{} is not an RSA algorithm", alg.name()));
        }
        let n = strip_zeros(n);
        if n.len() < 256 {
            return Err(format!(
                "an RSA key of {} bits: at least 2048 are needed",
                n.len() * 8
            ));
        }
        if n.len() > 1024 || e.is_empty() || e.len() > 8 {
            return Err("the RSA key's modulus or exponent is out of range".into());
        }
        Ok(Self {
            kid,
            alg,
            material: Material::Rsa {
                n: n.to_vec(),
                e: strip_zeros(e).to_vec(),
            },
        })
    }

    /// An EC key for ES256 (P-256) or ES384 (P-384), from its coordinates.
    pub fn ec(kid: Option<String>, alg: Alg, x: &[u8], y: &[u8]) -> Result<Self, String> {
        let size = match alg {
            Alg::ES256 => 32,
            Alg::ES384 => 48,
            _ => return Err(format!("{} is not an EC algorithm", alg.name())),
        };
        if x.len() != size || y.len() != size {
            return Err(format!("coordinates of {size} bytes expected"));
        }
        let mut point = Vec::with_capacity(1 + 2 * size);
        point.push(4);
        point.extend_from_slice(x);
        point.extend_from_slice(y);
        Ok(Self {
            kid,
            alg,
            material: Material::Bytes(point),
        })
    }

    /// An Ed25519 key (EdDSA).
    pub fn ed25519(kid: Option<String>, x: &[u8]) -> Result<Self, String> {
        if x.len() != 32 {
            return Err("an Ed25519 key is 32 bytes".into());
        }
        Ok(Self {
            kid,
            alg: Alg::EdDSA,
            material: Material::Bytes(x.to_vec()),
        })
    }

    pub(super) fn verify(&self, message: &[u8], sig: &[u8]) -> bool {
        match &self.material {
            Material::Rsa { n, e } => {
                let Some(params) = self.alg.rsa_params() else {
                    return false;
                };
                signature::RsaPublicKeyComponents { n, e }
                    .verify(params, message, sig)
                    .is_ok()
            }
            Material::Bytes(key) => {
                let alg: &dyn signature::VerificationAlgorithm = match self.alg {
                    Alg::ES256 => &signature::ECDSA_P256_SHA256_FIXED,
                    Alg::ES384 => &signature::ECDSA_P384_SHA384_FIXED,
                    Alg::EdDSA => &signature::ED25519,
                    _ => return false,
                };
                signature::UnparsedPublicKey::new(alg, key)
                    .verify(message, sig)
                    .is_ok()
            }
        }
    }
}

fn strip_zeros(b: &[u8]) -> &[u8] {
    let first = b.iter().position(|&x| x != 0).unwrap_or(b.len());
    &b[first..]
}

/// `auth.jwt_secret` as HMAC keys, one per hash.
pub struct Secret {
    hs256: hmac::Key,
    hs384: hmac::Key,
    hs512: hmac::Key,
}

impl Secret {
    pub fn new(secret: &[u8]) -> Self {
        Self {
            hs256: hmac::Key::new(hmac::HMAC_SHA256, secret),
            hs384: hmac::Key::new(hmac::HMAC_SHA384, secret),
            hs512: hmac::Key::new(hmac::HMAC_SHA512, secret),
        }
    }

    pub(super) fn key(&self, alg: Alg) -> Option<&hmac::Key> {
        match alg {
            Alg::HS256 => Some(&self.hs256),
            Alg::HS384 => Some(&self.hs384),
            Alg::HS512 => Some(&self.hs512),
            _ => None,
        }
    }

    /// Signs `message` (tokens for tests, benchmarks and `bloomgate
    /// mint-token`).
    pub fn sign(&self, alg: Alg, message: &[u8]) -> Option<Vec<u8>> {
        Some(hmac::sign(self.key(alg)?, message).as_ref().to_vec())
    }
}
