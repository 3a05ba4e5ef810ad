//! What a snapshot on the bus weighs and how fast a gateway loads it
//! (BENCHMARKS.md, "Snapshots"), for the four kinds of key at `N` keys
//! (default 10,000,000): bigint dense (1..N: the `auto` filter is the
//! exact bitmap), bigint sparse (random: a Bloom filter), uuid and text
//! (Bloom filters). Side by side, the alternative the issue weighs: the
//! keys themselves travelling (zstd-compressed), which each gateway would
//! hash into a filter of its own.
//!
//! `cargo run --release --example snapshot_size [N]`

use std::time::Instant;

use bloomgate::filter::{Item, KeyKind, KeySetBuilder, Mode};
use bloomgate::snapshot::{self, BuildKey, FleetKey, Manifest, Mark};

fn main() {
    let n: u64 = std::env::args()
        .nth(1)
        .map(|a| a.parse().expect("N"))
        .unwrap_or(10_000_000);
    let fleet = FleetKey::from_bytes(&[b'k'; 32]).unwrap();
    println!(
        "| keys ({n}) | filter | snapshot in Redis | bytes/key | seal | load (open + decode) | load rate | keys instead: bytes/key | keys instead: build from them |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for kind in [
        "bigint dense",
        "bigint dense, 10 % deleted",
        "bigint sparse",
        "uuid",
        "text",
    ] {
        let key = BuildKey::new(&fleet);
        let items = items(kind, n);
        let (k, mode) = match kind.starts_with("bigint") {
            true => (KeyKind::Int, Mode::Auto),
            false => (KeyKind::Bytes, Mode::Auto),
        };
        // Sized as a scan sizes it: the rows counted times the default
        // headroom (1.2) at the default 1 % rate.
        let expected = (n as f64 * 1.2) as u64;
        let mut b = KeySetBuilder::new(mode, k, expected, 0.01, key.filter.clone()).unwrap();
        for it in &items {
            b.insert(item(kind, it));
        }
        let set = b.finish();
        let filter_bytes = set.to_bytes().len();
        let manifest = Manifest {
            format: snapshot::FORMAT,
            resource: "t".into(),
            shape: "s".into(),
            catalog: String::new(),
            key_id: String::new(),
            at: Mark {
                stream: "s".into(),
                lsn: 1,
                seq: 0,
            },
            nonce: String::new(),
            kind: String::new(),
            keys: n,
            rows: n,
            max_int: i64::MIN,
            plain_bytes: 0,
            sealed_bytes: 0,
            chunks: 0,
            published_ms: 0,
            by: "bench".into(),
        };
        let t = Instant::now();
        let stored = snapshot::publishable(&fleet, &key, manifest, &set);
        let seal = t.elapsed();
        let sealed: usize =
            stored.chunks.iter().map(Vec::len).sum::<usize>() + stored.manifest.len();
        let t = Instant::now();
        let opened = snapshot::open(&fleet, stored, "t", "s").unwrap();
        let load = t.elapsed();
        assert!(opened.set.contains(item(kind, &items[items.len() / 2])));
        // The keys travelling instead: their bytes, compressed as the
        // filter is; and a gateway hashing them into a filter of its own.
        let raw: Vec<u8> = items.iter().flat_map(|i| i.iter().copied()).collect();
        let keys_zstd = zstd::bulk::compress(&raw, 1).unwrap().len();
        let t = Instant::now();
        let mut own =
            KeySetBuilder::new(mode, k, expected, 0.01, BuildKey::new(&fleet).filter).unwrap();
        for it in &items {
            own.insert(item(kind, it));
        }
        drop(own.finish());
        let rebuild = t.elapsed();
        println!(
            "| {kind} ({}) | {:.3} MB | {:.3} MB | {:.3} | {:.3} s | {:.3} s | {:.0} M keys/s | {:.2} | {:.2} s |",
            set.kind(),
            filter_bytes as f64 / 1e6,
            sealed as f64 / 1e6,
            sealed as f64 / items.len() as f64,
            seal.as_secs_f64(),
            load.as_secs_f64(),
            items.len() as f64 / load.as_secs_f64() / 1e6,
            keys_zstd as f64 / items.len() as f64,
            rebuild.as_secs_f64(),
        );
    }
}

/// The keys of `kind`, each as the bytes the filter hashes (integers as
/// little-endian bytes, decoded again by [`item`]).
fn items(kind: &str, n: u64) -> Vec<Vec<u8>> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    (0..n)
        .filter_map(|i| {
            Some(match kind {
                "bigint dense" => ((i + 1) as i64).to_le_bytes().to_vec(),
                "bigint dense, 10 % deleted" => {
                    if rng.random_range(0..10) == 0 {
                        return None;
                    }
                    ((i + 1) as i64).to_le_bytes().to_vec()
                }
                "bigint sparse" => rng.random::<i64>().to_le_bytes().to_vec(),
                "uuid" => rng.random::<[u8; 16]>().to_vec(),
                // An address as users give them: a random local part.
                _ => format!("{:x}.{}@example.com", rng.random::<u64>(), i % 97).into_bytes(),
            })
        })
        .collect()
}

fn item<'a>(kind: &str, bytes: &'a [u8]) -> Item<'a> {
    match kind.starts_with("bigint") {
        true => Item::Int(i64::from_le_bytes(bytes.try_into().unwrap())),
        false => Item::Bytes(bytes),
    }
}
