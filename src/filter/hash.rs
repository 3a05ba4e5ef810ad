//! Secret-keyed hashing for the filters.
//!
//! Every Bloom filter hashes its keys with HighwayHash under a 256-bit secret
//! ([`FilterKey`]). Without the key an attacker cannot predict which bits a key
//! sets, so they cannot search offline for keys that all collide (hash
//! flooding) and push requests for absent rows past the gate. HighwayHash is a
//! keyed PRF designed for exactly this, and with AVX2 it costs about as much as
//! a non-keyed hash of comparable quality.
//!
//! Guarantees:
//! * the key bytes never leave this module except through
//!   [`FilterKey::from_bytes`] (input only): `Debug`, errors and serialised
//!   filters carry only [`FilterKey::fingerprint`], a HighwayHash of a fixed
//!   domain string under the key (one-way under HighwayHash's PRF assumption);
//! * one hash call per key: a single 128-bit HighwayHash supplies both the block
//!   index and the in-block bit positions.

use std::fmt;

use highway::{HighwayHash, HighwayHasher, Key};

/// Domain-separation string for the fingerprint, so the fingerprint is never
/// equal to the hash of some real key.
const FINGERPRINT_DOMAIN: &[u8] = b"bloomgate/filter-key-fingerprint/v1";

/// A secret 256-bit HighwayHash key.
///
/// Holds the key together with a hasher already initialised from it: building
/// a `HighwayHasher` dispatches on CPU features and mixes the key into its
/// state, so the hot path clones this prepared state instead (a 160-byte copy).
#[derive(Clone)]
pub struct FilterKey {
    hasher: HighwayHasher,
    fingerprint: u64,
}

impl FilterKey {
    /// A fresh key from the operating system's random source.
    ///
    /// # Panics
    /// Only if the OS random source is unavailable (`getrandom` fails), which
    /// on supported platforms means the system is unusable for anything
    /// security-related; continuing with a predictable key would silently
    /// reopen the hash-flooding hole, so this refuses instead.
    pub fn random() -> Self {
        let mut bytes = [0u8; 32];
        if let Err(e) = getrandom::fill(&mut bytes) {
            panic!("OS random source unavailable, cannot draw a filter key: {e}");
        }
        Self::from_bytes(bytes)
    }

    /// A fixed key (tests, or replicas that must share one filter).
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        let mut words = [0u64; 4];
        for (w, chunk) in words.iter_mut().zip(bytes.chunks_exact(8)) {
            let mut b = [0u8; 8];
            b.copy_from_slice(chunk);
            *w = u64::from_le_bytes(b);
        }
        let hasher = HighwayHasher::new(Key(words));
        let fingerprint = hasher.clone().hash64(FINGERPRINT_DOMAIN);
        FilterKey {
            hasher,
            fingerprint,
        }
    }

    /// A value derived from the key that is safe to show, log and store: it
    /// identifies the key (two filters with equal fingerprints were built with
    /// the same key, up to a 2^-64 accident) without revealing it.
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    /// The 128-bit keyed hash of `data`. This is the one hash call per key.
    #[inline]
    pub fn hash128(&self, data: &[u8]) -> [u64; 2] {
        self.hasher.clone().hash128(data)
    }
}

impl fmt::Debug for FilterKey {
    // Redacted on purpose: the derived impl would print the hasher state,
    // which is the key XORed with public constants, i.e. the key itself.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FilterKey")
            .field("fingerprint", &format_args!("{:016x}", self.fingerprint))
            .finish_non_exhaustive()
    }
}

/// Checksum for serialised filters. Not a secret: HighwayHash under a fixed,
/// public key, used only because it is already linked in and fast (>5 GB/s).
pub(crate) fn checksum(data: &[u8]) -> u64 {
    const CHECKSUM_KEY: Key = Key([
        0x626c_6f6f_6d67_6174, // "bloomgat"
        0x652f_6368_6563_6b73, // "e/checks"
        0x756d_2f76_3100_0000, // "um/v1"
        0x0,
    ]);
    HighwayHasher::new(CHECKSUM_KEY).hash64(data)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key_bytes() -> [u8; 32] {
        let mut b = [0u8; 32];
        for (i, x) in b.iter_mut().enumerate() {
            *x = 0xA0 ^ (i as u8).wrapping_mul(37);
        }
        b
    }

    #[test]
    fn debug_does_not_reveal_key() {
        let bytes = key_bytes();
        let key = FilterKey::from_bytes(bytes);
        let dbg = format!("{key:?} {key:#?}");
        assert!(dbg.contains(&format!("{:016x}", key.fingerprint())));
        // No 8-byte word of the key, in any common rendering, appears.
        for chunk in bytes.chunks_exact(8) {
            let w = u64::from_le_bytes(chunk.try_into().unwrap());
            for needle in [
                format!("{w}"),
                format!("{w:x}"),
                format!("{w:X}"),
                format!("{:x}", w.swap_bytes()),
            ] {
                assert!(!dbg.contains(&needle), "Debug leaked key material: {dbg}");
            }
        }
        // The byte list rendering of the key (as `[160, 133, ...]`) is absent too.
        let as_list = format!("{:?}", &bytes[..4]);
        assert!(!dbg.contains(&as_list[1..as_list.len() - 1]));
    }

    #[test]
    fn key_determines_hash_and_fingerprint() {
        let a = FilterKey::from_bytes(key_bytes());
        let b = FilterKey::from_bytes(key_bytes());
        let mut other = key_bytes();
        other[31] ^= 1;
        let c = FilterKey::from_bytes(other);
        assert_eq!(a.hash128(b"row-42"), b.hash128(b"row-42"));
        assert_eq!(a.fingerprint(), b.fingerprint());
        assert_ne!(a.hash128(b"row-42"), c.hash128(b"row-42"));
        assert_ne!(a.fingerprint(), c.fingerprint());
        // The fingerprint is not simply the hash of an empty or zero input.
        assert_ne!(a.fingerprint(), a.hash128(b"")[0]);
    }

    #[test]
    fn random_keys_differ() {
        let a = FilterKey::random();
        let b = FilterKey::random();
        assert_ne!(a.fingerprint(), b.fingerprint());
        assert_ne!(a.hash128(b"x"), b.hash128(b"x"));
    }

    #[test]
    fn checksum_detects_single_bit_flips() {
        let data: Vec<u8> = (0..200u8).collect();
        let base = checksum(&data);
        for i in 0..data.len() {
            let mut d = data.clone();
            d[i] ^= 0x10;
            assert_ne!(checksum(&d), base, "flip at {i} undetected");
        }
    }
}
