//! A snapshot's body sealed under the fleet key, and the filter key a
//! build shares with the fleet.
//!
//! # What a reader of Redis learns (nothing that helps an attacker)
//! The fleet key (`bus.fleet_key_file`) never leaves the gateways. Every
//! build that may be published draws a 128-bit nonce and derives two keys
//! from the fleet key and that nonce (HKDF-SHA256, two labels):
//! - the build's **filter key** (HighwayHash, 256 bits): without the fleet
//!   key, nobody can compute which keys a published Bloom filter's bits
//!   let through, so nobody can craft keys that pass it;
//! - the build's **body key** (ChaCha20-Poly1305): the body, the filter's
//!   own serialised form (for an exact set, the key set itself), is
//!   compressed (zstd) and encrypted, so Redis holds no readable key set.
//!
//! The body travels in chunks of at most [`CHUNK`] bytes, each sealed
//! with its index as the nonce and, as associated data, the SHA-256 of
//! the manifest's exact bytes and the chunk count: a manifest edited by
//! anyone (another position, another resource, another stream, another
//! size), a chunk swapped, dropped, reordered or flipped, or a chunk of
//! another snapshot fails to open ([`SealError::Forged`]). The filter's
//! own checksum and key fingerprint are checked again on decoding. So a
//! snapshot either opens into exactly the set that was published, or is
//! refused, and a refused snapshot costs a scan, never a wrong filter.
//! A genuine older snapshot put back by hand opens, and is safe: its
//! position says what it is complete at, and the loader replays the
//! stream from there.
//!
//! Nonces are drawn at random; the body key is used for one snapshot
//! only, so chunk indexes are unique nonces under it.

use std::fmt;
use std::path::Path;

use ring::{aead, hkdf};

use crate::filter::FilterKey;

/// Bytes of body per chunk (before the 16-byte tag): one Redis command
/// moves at most this much, so a large snapshot never holds Redis' one
/// thread for long. A sealed chunk stays within 1 MiB, one of jemalloc's
/// size classes: 16 bytes past it, Redis would hold each in 1.25 MiB
/// (measured: 14 chunks of 1 MiB + 16 bytes take 18.4 MB, of 1 MiB − 48
/// bytes 14.7 MB; BENCHMARKS.md, "Snapshots").
pub const CHUNK: usize = (1 << 20) - 64;

/// The fewest bytes a fleet key file may hold (after trimming whitespace).
pub const MIN_FLEET_KEY: usize = 32;

/// How many bytes a body may claim when it is opened: far above any
/// filter (a 2^32-key Bloom filter at 1 % is about 5 GiB); a manifest is
/// authenticated before its sizes are believed, so this bounds only what
/// a gateway with the fleet key could have published by mistake.
pub const MAX_PLAIN: u64 = 1 << 36;

const BODY_LABEL: &[u8] = b"bloomgate snapshot body v1";
const ID_LABEL: &[u8] = b"bloomgate fleet key id v1";
const FILTER_LABEL: &[u8] = b"bloomgate snapshot filter key v1";

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SealError {
    /// A chunk did not open: the manifest or a chunk was changed, or it was
    /// sealed under another fleet key.
    #[error(
        "the snapshot does not open under this fleet key (changed, damaged, or another fleet's)"
    )]
    Forged,
    #[error("the snapshot's body is {0}")]
    Body(String),
}

/// The fleet's shared secret (`bus.fleet_key_file`). Never logged or shown.
#[derive(Clone)]
pub struct FleetKey {
    ikm: Vec<u8>,
}

impl fmt::Debug for FleetKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("FleetKey(<redacted>)")
    }
}

/// Why `bus.fleet_key_file` holds no usable key. It never quotes the
/// file (the caller names the config key).
#[derive(Debug, thiserror::Error)]
pub enum FleetKeyError {
    #[error("cannot be read ({})", .0.kind())]
    Unreadable(#[source] std::io::Error),
    /// How many bytes it holds, whitespace trimmed.
    #[error("holds {0} bytes; a fleet key needs at least {MIN_FLEET_KEY} (`openssl rand -hex 32`)")]
    TooShort(usize),
}

impl FleetKey {
    /// The key held by `path`: its bytes, surrounding whitespace trimmed
    /// (so `openssl rand -hex 32 > fleet.key` works), at least
    /// [`MIN_FLEET_KEY`] of them.
    pub fn from_file(path: &Path) -> Result<Self, FleetKeyError> {
        let bytes = std::fs::read(path).map_err(FleetKeyError::Unreadable)?;
        Self::from_bytes(&bytes)
    }

    pub fn from_bytes(bytes: &[u8]) -> Result<Self, FleetKeyError> {
        let trimmed = bytes.trim_ascii();
        if trimmed.len() < MIN_FLEET_KEY {
            return Err(FleetKeyError::TooShort(trimmed.len()));
        }
        Ok(Self {
            ikm: trimmed.to_vec(),
        })
    }

    fn prk(&self, nonce: &Nonce) -> hkdf::Prk {
        hkdf::Salt::new(hkdf::HKDF_SHA256, &nonce.0).extract(&self.ikm)
    }

    /// A name of the key that is safe to publish (64 bits of HKDF output
    /// under a label of its own, which says nothing of the key): a
    /// manifest carries it, so a gateway with another key passes a
    /// snapshot over without fetching it.
    pub fn id(&self) -> String {
        let mut bytes = [0u8; 8];
        hkdf::Salt::new(hkdf::HKDF_SHA256, ID_LABEL)
            .extract(&self.ikm)
            .expand(&[ID_LABEL], Len(8))
            .and_then(|okm| okm.fill(&mut bytes))
            .expect("HKDF-SHA256 yields 8 bytes");
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The filter key of the build `nonce` names (see the module doc).
    pub fn filter_key(&self, nonce: &Nonce) -> FilterKey {
        let mut bytes = [0u8; 32];
        self.prk(nonce)
            .expand(&[FILTER_LABEL], Len(32))
            .and_then(|okm| okm.fill(&mut bytes))
            .expect("HKDF-SHA256 yields 32 bytes");
        FilterKey::from_bytes(bytes)
    }

    fn body_key(&self, nonce: &Nonce) -> aead::LessSafeKey {
        let prk = self.prk(nonce);
        let okm = prk
            .expand(&[BODY_LABEL], &aead::CHACHA20_POLY1305)
            .expect("HKDF-SHA256 yields a ChaCha20 key");
        aead::LessSafeKey::new(aead::UnboundKey::from(okm))
    }
}

struct Len(usize);

impl hkdf::KeyType for Len {
    fn len(&self) -> usize {
        self.0
    }
}

/// A build's nonce: public (it names the snapshot), random.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Nonce(pub [u8; 16]);

impl Nonce {
    pub fn random() -> Self {
        let mut b = [0u8; 16];
        if let Err(e) = getrandom::fill(&mut b) {
            panic!("OS random source unavailable, cannot draw a snapshot nonce: {e}");
        }
        Nonce(b)
    }

    pub fn hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    pub fn parse(hex: &str) -> Option<Nonce> {
        if hex.len() != 32 || !hex.is_ascii() {
            return None;
        }
        let mut b = [0u8; 16];
        for (i, out) in b.iter_mut().enumerate() {
            *out = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok()?;
        }
        Some(Nonce(b))
    }
}

/// A body compressed, ready to seal: its sizes go into the manifest first
/// (the chunks are bound to the manifest's bytes).
pub struct Packed {
    compressed: Vec<u8>,
    /// The filter's serialised length.
    pub plain_len: u64,
    /// Bytes stored: the compressed body plus a tag per chunk.
    pub sealed_len: u64,
    pub chunks: u32,
}

/// Compresses a filter's serialised form (`KeySet::to_bytes`).
pub fn pack(plain: &[u8]) -> Packed {
    // Level 1: a Bloom filter's bits are close to random and do not
    // compress; a dense bitmap's runs do at any level (BENCHMARKS.md,
    // "Snapshots").
    let compressed = zstd::bulk::compress(plain, 1).unwrap_or_else(|_| plain.to_vec());
    let chunks = compressed.len().div_ceil(CHUNK).max(1);
    Packed {
        plain_len: plain.len() as u64,
        sealed_len: (compressed.len() + chunks * aead::CHACHA20_POLY1305.tag_len()) as u64,
        chunks: chunks as u32,
        compressed,
    }
}

/// The associated data of chunk `i`: the manifest's digest, the index and
/// the count.
fn aad(manifest: &[u8], i: u32, n: u32) -> Vec<u8> {
    let mut a = ring::digest::digest(&ring::digest::SHA256, manifest)
        .as_ref()
        .to_vec();
    a.extend_from_slice(&i.to_le_bytes());
    a.extend_from_slice(&n.to_le_bytes());
    a
}

fn chunk_nonce(i: u32) -> aead::Nonce {
    let mut n = [0u8; 12];
    n[..4].copy_from_slice(&i.to_le_bytes());
    aead::Nonce::assume_unique_for_key(n)
}

/// Seals `packed` for the manifest whose exact bytes are `manifest`.
pub fn seal(key: &FleetKey, nonce: &Nonce, manifest: &[u8], packed: Packed) -> Vec<Vec<u8>> {
    let body = key.body_key(nonce);
    let n = packed.chunks;
    let mut out = Vec::with_capacity(n as usize);
    let mut parts = packed.compressed.chunks(CHUNK);
    for i in 0..n {
        let mut c = parts.next().unwrap_or_default().to_vec();
        body.seal_in_place_append_tag(chunk_nonce(i), aead::Aad::from(aad(manifest, i, n)), &mut c)
            .expect("a chunk below ChaCha20-Poly1305's limit");
        out.push(c);
    }
    out
}

/// Opens the chunks of the manifest `manifest` (whose fields say `chunks`
/// and `plain_len`) into the filter's serialised form.
pub fn open(
    key: &FleetKey,
    nonce: &Nonce,
    manifest: &[u8],
    chunks: Vec<Vec<u8>>,
    plain_len: u64,
) -> Result<Vec<u8>, SealError> {
    // A body is at least one chunk (`pack`): none authenticates nothing.
    let n = u32::try_from(chunks.len()).map_err(|_| SealError::Forged)?;
    if n == 0 {
        return Err(SealError::Forged);
    }
    let body = key.body_key(nonce);
    let mut compressed = Vec::new();
    for (i, mut c) in chunks.into_iter().enumerate() {
        let i = i as u32;
        let opened = body
            .open_in_place(chunk_nonce(i), aead::Aad::from(aad(manifest, i, n)), &mut c)
            .map_err(|_| SealError::Forged)?;
        compressed.extend_from_slice(opened);
    }
    if plain_len > MAX_PLAIN {
        return Err(SealError::Body(format!(
            "{plain_len} bytes, past any filter"
        )));
    }
    let plain = zstd::bulk::decompress(&compressed, plain_len as usize)
        .map_err(|e| SealError::Body(format!("not zstd ({e})")))?;
    if plain.len() as u64 != plain_len {
        return Err(SealError::Body(format!(
            "{} bytes, not the {plain_len} its manifest says",
            plain.len()
        )));
    }
    Ok(plain)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn fleet(b: u8) -> FleetKey {
        FleetKey::from_bytes(&[b'a' + b; 32]).unwrap()
    }

    /// Bytes zstd cannot shrink, as a Bloom filter's bits.
    fn random(n: usize) -> Vec<u8> {
        (0..n).map(|_| rand::random::<u8>()).collect()
    }

    fn sealed(plain: &[u8], manifest: &[u8]) -> (Nonce, Vec<Vec<u8>>, u64) {
        let nonce = Nonce::random();
        let packed = pack(plain);
        let len = packed.plain_len;
        (nonce, seal(&fleet(7), &nonce, manifest, packed), len)
    }

    #[test]
    fn a_short_or_unreadable_key_file_is_refused() {
        assert!(matches!(
            FleetKey::from_bytes(b"  short  \n"),
            Err(FleetKeyError::TooShort(5))
        ));
        assert!(FleetKey::from_bytes(&[b'a'; 31]).is_err());
        assert!(FleetKey::from_bytes(&[b'a'; 32]).is_ok());
        let e = FleetKey::from_file(Path::new("/nonexistent/fleet.key")).unwrap_err();
        assert_eq!(e.to_string(), "cannot be read (entity not found)");
        assert!(std::error::Error::source(&e).is_some());
        assert_eq!(format!("{:?}", fleet(1)), "FleetKey(<redacted>)");
    }

    #[test]
    fn whitespace_around_the_key_does_not_change_it() {
        let n = Nonce([3; 16]);
        let a = FleetKey::from_bytes(b"0123456789abcdef0123456789abcdef").unwrap();
        let b = FleetKey::from_bytes(b"\n0123456789abcdef0123456789abcdef \n").unwrap();
        assert_eq!(
            a.filter_key(&n).fingerprint(),
            b.filter_key(&n).fingerprint()
        );
    }

    #[test]
    fn a_key_s_id_names_it_and_is_none_of_its_keys() {
        assert_eq!(fleet(1).id(), fleet(1).id());
        assert_ne!(fleet(1).id(), fleet(2).id());
        assert_eq!(fleet(1).id().len(), 16);
        let n = Nonce([0; 16]);
        let fp = format!("{:016x}", fleet(1).filter_key(&n).fingerprint());
        assert_ne!(fleet(1).id(), fp);
    }

    #[test]
    fn filter_keys_differ_by_nonce_and_by_fleet() {
        let (a, b) = (Nonce([1; 16]), Nonce([2; 16]));
        let k = fleet(1);
        assert_eq!(
            k.filter_key(&a).fingerprint(),
            k.filter_key(&a).fingerprint()
        );
        assert_ne!(
            k.filter_key(&a).fingerprint(),
            k.filter_key(&b).fingerprint()
        );
        assert_ne!(
            k.filter_key(&a).fingerprint(),
            fleet(2).filter_key(&a).fingerprint()
        );
    }

    #[test]
    fn nonces_print_and_parse() {
        let n = Nonce::random();
        assert_eq!(Nonce::parse(&n.hex()), Some(n));
        assert_eq!(Nonce::parse("zz"), None);
        assert_eq!(Nonce::parse(&"g".repeat(32)), None);
    }

    #[test]
    fn a_body_of_several_chunks_round_trips() {
        let plain = random(CHUNK * 2 + 77);
        let (nonce, chunks, len) = sealed(&plain, b"{\"m\":1}");
        assert!(chunks.len() >= 2, "{} chunks", chunks.len());
        assert_eq!(
            open(&fleet(7), &nonce, b"{\"m\":1}", chunks, len).unwrap(),
            plain
        );
    }

    #[test]
    fn no_chunks_at_all_do_not_open() {
        let (nonce, _, len) = sealed(b"x", b"m");
        assert_eq!(
            open(&fleet(7), &nonce, b"m", vec![], len),
            Err(SealError::Forged)
        );
    }

    #[test]
    fn an_empty_body_round_trips() {
        let (nonce, chunks, len) = sealed(b"", b"m");
        assert_eq!(chunks.len(), 1);
        assert_eq!(open(&fleet(7), &nonce, b"m", chunks, len).unwrap(), b"");
    }

    #[test]
    fn a_changed_manifest_or_another_fleet_key_does_not_open() {
        let (nonce, chunks, len) = sealed(b"some filter bytes", b"{\"lsn\":10}");
        let e = open(&fleet(7), &nonce, b"{\"lsn\":11}", chunks.clone(), len);
        assert_eq!(e, Err(SealError::Forged));
        let e = open(&fleet(8), &nonce, b"{\"lsn\":10}", chunks.clone(), len);
        assert_eq!(e, Err(SealError::Forged));
        let e = open(&fleet(7), &Nonce([0; 16]), b"{\"lsn\":10}", chunks, len);
        assert_eq!(e, Err(SealError::Forged));
    }

    #[test]
    fn chunks_dropped_reordered_or_from_another_snapshot_do_not_open() {
        let plain = random(CHUNK * 3);
        let (nonce, chunks, len) = sealed(&plain, b"m");
        assert!(chunks.len() >= 2);
        let mut dropped = chunks.clone();
        dropped.pop();
        assert!(open(&fleet(7), &nonce, b"m", dropped, len).is_err());
        let mut swapped = chunks.clone();
        swapped.swap(0, 1);
        assert_eq!(
            open(&fleet(7), &nonce, b"m", swapped, len),
            Err(SealError::Forged)
        );
        let (other_nonce, other, _) = sealed(&plain, b"m");
        let mut mixed = chunks.clone();
        mixed[0] = other[0].clone();
        assert_eq!(
            open(&fleet(7), &nonce, b"m", mixed, len),
            Err(SealError::Forged)
        );
        assert!(open(&fleet(7), &other_nonce, b"m", other, len).is_ok());
    }

    proptest! {
        /// Any one flipped bit in any chunk is refused: a wrong filter
        /// could answer 404 for a key that exists.
        #[test]
        fn any_flipped_bit_is_refused(
            body in proptest::collection::vec(any::<u8>(), 0..4096),
            at in any::<prop::sample::Index>(),
            bit in 0u8..8,
        ) {
            let (nonce, mut chunks, len) = sealed(&body, b"manifest");
            let c = &mut chunks[0];
            let i = at.index(c.len());
            c[i] ^= 1 << bit;
            prop_assert_eq!(open(&fleet(7), &nonce, b"manifest", chunks, len), Err(SealError::Forged));
        }

        #[test]
        fn any_body_round_trips(body in proptest::collection::vec(any::<u8>(), 0..8192)) {
            let (nonce, chunks, len) = sealed(&body, b"m");
            prop_assert_eq!(open(&fleet(7), &nonce, b"m", chunks, len).unwrap(), body);
        }
    }
}
