//! The keyed hash behind every secret comparison and every table index of
//! the access checks: HighwayHash under a key drawn from the OS at start-up
//! and never shown. The admin token is checked with it, API keys are held
//! as its digests, and the verified-token cache and the rate limiter are
//! indexed by it, so no caller can predict a digest, craft collisions or
//! aim at one slot of a table.

use highway::{HighwayHash, HighwayHasher};

pub struct KeyedHash(highway::Key);

impl KeyedHash {
    /// A fresh key from the OS.
    pub fn random() -> Self {
        let mut seed = [0u8; 32];
        getrandom::fill(&mut seed).expect("the OS random source is available");
        Self(highway::Key(std::array::from_fn(|i| {
            u64::from_le_bytes(seed[i * 8..i * 8 + 8].try_into().expect("8 bytes"))
        })))
    }

    /// The 256-bit digest of `data`.
    pub fn digest(&self, data: &[u8]) -> [u8; 32] {
        to_bytes(HighwayHasher::new(self.0).hash256(data))
    }

    /// The 256-bit digest of `domain` then `data`: one byte keeps a JWT
    /// and an API key with the same text apart.
    pub fn digest_in(&self, domain: u8, data: &[u8]) -> [u8; 32] {
        let mut h = HighwayHasher::new(self.0);
        h.append(&[domain]);
        h.append(data);
        to_bytes(h.finalize256())
    }

    /// A 64-bit hash of `domain` then `data`, never 0 (0 marks an empty
    /// slot in the tables that use it).
    pub fn hash64(&self, domain: u8, data: &[u8]) -> u64 {
        let mut h = HighwayHasher::new(self.0);
        h.append(&[domain]);
        h.append(data);
        h.finalize64().max(1)
    }
}

impl std::fmt::Debug for KeyedHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KeyedHash(..)")
    }
}

fn to_bytes(words: [u64; 4]) -> [u8; 32] {
    let mut out = [0u8; 32];
    for (chunk, w) in out.chunks_exact_mut(8).zip(words) {
        chunk.copy_from_slice(&w.to_le_bytes());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn domains_keep_equal_texts_apart_and_keys_differ_per_instance() {
        let k = KeyedHash::random();
        assert_ne!(k.digest_in(b'j', b"abc"), k.digest_in(b'k', b"abc"));
        assert_eq!(k.digest_in(b'j', b"abc"), k.digest_in(b'j', b"abc"));
        assert_ne!(k.digest(b"abc"), KeyedHash::random().digest(b"abc"));
        assert_ne!(k.hash64(0, b""), 0);
        assert!(!format!("{k:?}").contains('0'));
    }
}
