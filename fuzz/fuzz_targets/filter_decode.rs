//! Fuzzes `bloomgate::filter::KeySet::from_bytes` (serialised Bloom filters
//! and exact sets, as loaded from disk or another replica).
//!
//! Each input is decoded twice:
//! * as is, which exercises the framing (magic, version, lengths, checksum);
//! * "resealed": the last 8 bytes (the checksum) are dropped, the header's
//!   body length is set to the actual body length and a correct checksum
//!   is appended, so mutations of the body get past the checksum and reach
//!   the Bloom and roaring decoders.
//!
//! Never panics, never allocates much more than the input (run with
//! `-malloc_limit_mb`); a decoded set re-encodes to bytes that decode to
//! the same set, and lookups work.
#![no_main]

use std::sync::OnceLock;

use bloomgate::filter::{FilterKey, Item, KeySet, decode_i64};
use highway::{HighwayHash, HighwayHasher, Key};
use libfuzzer_sys::fuzz_target;

fn key() -> &'static FilterKey {
    static KEY: OnceLock<FilterKey> = OnceLock::new();
    KEY.get_or_init(|| FilterKey::from_bytes([7; 32]))
}

fuzz_target!(
    init: {
        // The resealing below must compute the library's checksum, or every
        // resealed input would stop at "checksum mismatch".
        let mut b = bloomgate::filter::KeySetBuilder::new(
            bloomgate::filter::Mode::Bloom,
            bloomgate::filter::KeyKind::Int,
            10,
            0.01,
            key().clone(),
        )
        .unwrap();
        b.insert(Item::Int(1));
        let valid = b.finish().to_bytes();
        assert_eq!(reseal(&valid[..valid.len() - 8]), valid, "checksum replica is out of date");
    },
    |data: &[u8]| {
    check(data);
    if data.len() >= 16 + 8 {
        check(&reseal(&data[..data.len() - 8]));
    }
}
);

fn check(bytes: &[u8]) {
    let Ok(set) = KeySet::from_bytes(bytes, key()) else {
        return;
    };
    let kind = set.kind();
    let keys = set.keys();
    let stats = set.stats();
    assert_eq!(stats.kind, kind);

    let again = set.to_bytes();
    let back = match KeySet::from_bytes(&again, key()) {
        Ok(b) => b,
        Err(e) => panic!("a decoded {kind} set does not survive its own round trip: {e}"),
    };
    assert_eq!(back.kind(), kind);
    assert_eq!(back.keys(), keys);
    assert_eq!(back.to_bytes(), again, "re-encoding is not stable");

    // Lookups: a handful of probes answer the same before and after the
    // round trip (identical bits / identical key set).
    let probes: [Item<'_>; 6] = [
        Item::Int(0),
        Item::Int(1),
        Item::Int(-1),
        Item::Int(i64::MIN),
        Item::Bytes(b"probe"),
        Item::Bytes(&bytes[..bytes.len().min(16)]),
    ];
    for p in probes {
        assert_eq!(set.contains(p), back.contains(p), "{p:?}");
    }
    // Exact sets: no false negatives for stored keys, before or after.
    if let KeySet::Exact(e) = &set {
        for v in e.snapshot().iter().take(64) {
            let item = Item::Int(decode_i64(v));
            assert!(set.contains(item), "stored key {v} not found");
            assert!(back.contains(item), "stored key {v} lost in the round trip");
        }
    }
    // Inserting into a decoded set works and is then found.
    set.insert(Item::Int(42));
    assert!(set.contains(Item::Int(42)));
}

/// `framed` = header + body without checksum → fixed body length + checksum.
fn reseal(framed: &[u8]) -> Vec<u8> {
    let mut out = framed.to_vec();
    let body_len = (out.len() - 16) as u64;
    out[8..16].copy_from_slice(&body_len.to_le_bytes());
    let sum = checksum(&out);
    out.extend_from_slice(&sum.to_le_bytes());
    out
}

/// Same as `bloomgate::filter::hash::checksum` (crate-private): HighwayHash-64
/// under a fixed public key. `seed.rs` checks the two agree.
pub fn checksum(data: &[u8]) -> u64 {
    const CHECKSUM_KEY: Key = Key([
        0x626c_6f6f_6d67_6174,
        0x652f_6368_6563_6b73,
        0x756d_2f76_3100_0000,
        0x0,
    ]);
    HighwayHasher::new(CHECKSUM_KEY).hash64(data)
}
