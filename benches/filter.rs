//! Membership-filter benchmarks (issue 2).
//!
//! `cargo bench --bench filter`. One criterion group per size (1M and 10M
//! keys, p = 0.01): insert, lookup of present keys and lookup of absent keys
//! for our blocked Bloom filter, the exact bitmap (dense ids, with and without
//! a live delta), `fastbloom`, `bloomfilter`, and HighwayHash alone; plus
//! build-from-stream throughput through `KeySetBuilder` at 10M keys.
//! Before the timing runs it prints bits/key and the measured FP rate (1M
//! absent probes) of every filter at both sizes. All inputs come from seeded
//! RNGs.

use std::hint::black_box;
use std::time::{Duration, Instant};

use bloomgate::filter::{BloomFilter, ExactSet, FilterKey, Item, KeyKind, KeySetBuilder, Mode};
use criterion::{
    BenchmarkGroup, Criterion, Throughput, criterion_group, criterion_main, measurement::WallTime,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use roaring::RoaringTreemap;

const P: f64 = 0.01;
const SIZES: [u64; 2] = [1_000_000, 10_000_000];
/// Keys cycled through by lookup benchmarks (random order defeats caching
/// and prefetching the way production traffic would).
const PROBES: usize = 1 << 20;

fn key() -> FilterKey {
    FilterKey::from_bytes([0x42; 32])
}

struct Data {
    /// Random u64 keys stored in the filters (even).
    present: Vec<u64>,
    /// Random u64 keys never stored (odd), in random order.
    absent: Vec<u64>,
    /// A random sample of `present`, in random order.
    present_probes: Vec<u64>,
}

fn data(n: u64) -> Data {
    let mut rng = ChaCha8Rng::seed_from_u64(n);
    let present: Vec<u64> = (0..n).map(|_| rng.random::<u64>() & !1).collect();
    let absent = (0..PROBES).map(|_| rng.random::<u64>() | 1).collect();
    let present_probes = (0..PROBES)
        .map(|_| present[rng.random_range(0..present.len())])
        .collect();
    Data {
        present,
        absent,
        present_probes,
    }
}

fn ours(d: &Data) -> BloomFilter {
    let f = BloomFilter::new(d.present.len() as u64, P, key()).unwrap();
    for k in &d.present {
        f.insert(&k.to_le_bytes());
    }
    f
}

fn fast(d: &Data) -> fastbloom::BloomFilter {
    let mut f = fastbloom::BloomFilter::with_false_pos(P)
        .seed(&7)
        .expected_items(d.present.len());
    for k in &d.present {
        f.insert(k);
    }
    f
}

fn classic(d: &Data) -> bloomfilter::Bloom<u64> {
    let mut f =
        bloomfilter::Bloom::new_for_fp_rate_with_seed(d.present.len(), P, &[7; 32]).unwrap();
    for k in &d.present {
        f.set(k);
    }
    f
}

fn dense_exact(n: u64) -> ExactSet {
    let mut map = RoaringTreemap::new();
    map.insert_range(0..n);
    ExactSet::from_treemap(map)
}

fn fp_rate(absent: &[u64], contains: impl Fn(u64) -> bool) -> f64 {
    absent.iter().filter(|&&k| contains(k)).count() as f64 / absent.len() as f64
}

/// Bits per key and measured FP rate for every filter; printed, not timed.
fn report_space_and_accuracy() {
    println!("\n== space and accuracy (p = {P}, {PROBES} absent probes) ==");
    for n in SIZES {
        let d = data(n);
        let o = ours(&d);
        let f = fast(&d);
        let c = classic(&d);
        let bpk = |bits: u64| bits as f64 / n as f64;
        println!(
            "n={n:>9} ours        bits/key {:6.3}  k={:2}  FP {:.5}",
            bpk(o.num_bits()),
            o.num_hashes(),
            fp_rate(&d.absent, |k| o.contains(&k.to_le_bytes()))
        );
        println!(
            "n={n:>9} fastbloom   bits/key {:6.3}  k={:2}  FP {:.5}",
            bpk(f.num_bits() as u64),
            f.num_hashes(),
            fp_rate(&d.absent, |k| f.contains(&k))
        );
        println!(
            "n={n:>9} bloomfilter bits/key {:6.3}  k={:2}  FP {:.5}",
            bpk(c.len()),
            c.number_of_hash_functions(),
            fp_rate(&d.absent, |k| c.check(&k))
        );
        let e = dense_exact(n);
        println!(
            "n={n:>9} exact dense bits/key {:6.4}  (FP 0 by construction; {} bytes)",
            bpk(e.stats().bits),
            e.stats().bytes
        );
        let mut sparse = RoaringTreemap::new();
        sparse.extend(d.present.iter().copied());
        sparse.optimize();
        println!(
            "n={n:>9} exact random bits/key {:7.2}  (why auto picks Bloom for sparse keys)",
            bpk(sparse.serialized_size() as u64 * 8)
        );
    }
    println!();
}

/// Times `iters` inserts of fresh keys, rebuilding the structure (untimed)
/// whenever `n` keys have gone in, so every insert lands in a filter that is
/// at most at its design load.
fn bench_insert<T>(
    g: &mut BenchmarkGroup<'_, WallTime>,
    name: &str,
    keys: &[u64],
    mut fresh: impl FnMut() -> T,
    mut insert: impl FnMut(&mut T, u64),
) {
    g.bench_function(name, |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            let mut left = iters as usize;
            while left > 0 {
                let chunk = left.min(keys.len());
                let mut t = fresh();
                let start = Instant::now();
                for &k in &keys[..chunk] {
                    insert(&mut t, black_box(k));
                }
                total += start.elapsed();
                black_box(&t);
                left -= chunk;
            }
            total
        })
    });
}

fn bench_lookup(
    g: &mut BenchmarkGroup<'_, WallTime>,
    name: &str,
    probes: &[u64],
    contains: impl Fn(u64) -> bool,
) {
    g.bench_function(name, |b| {
        let mut i = 0;
        b.iter(|| {
            i = (i + 1) & (probes.len() - 1);
            contains(black_box(probes[i]))
        })
    });
}

fn benches(c: &mut Criterion) {
    report_space_and_accuracy();
    for n in SIZES {
        let d = data(n);
        let mut g = c.benchmark_group(format!("filter_{}M", n / 1_000_000));
        g.sample_size(20)
            .warm_up_time(Duration::from_millis(500))
            .measurement_time(Duration::from_secs(2));
        let sized = BloomFilter::new(n, P, key()).unwrap();
        let (blocks, k) = (sized.num_blocks(), sized.num_hashes());
        drop(sized);

        // HighwayHash alone: the floor for anything keyed.
        let hk = key();
        bench_lookup(&mut g, "highwayhash128/8B", &d.absent, |k| {
            black_box(hk.hash128(&k.to_le_bytes()))[0] != 0
        });

        // Ours.
        bench_insert(
            &mut g,
            "ours/insert",
            &d.present,
            || BloomFilter::with_shape(blocks, k, key()).unwrap(),
            |f, k| {
                f.insert(&k.to_le_bytes());
            },
        );
        bench_insert(
            &mut g,
            "ours/insert_builder",
            &d.present,
            || KeySetBuilder::new(Mode::Bloom, KeyKind::Int, n, P, key()).unwrap(),
            |b, k| b.insert(Item::Int(k as i64)),
        );
        let o = ours(&d);
        bench_lookup(&mut g, "ours/lookup_present", &d.present_probes, |k| {
            o.contains(&k.to_le_bytes())
        });
        bench_lookup(&mut g, "ours/lookup_absent", &d.absent, |k| {
            o.contains(&k.to_le_bytes())
        });
        drop(o);

        // fastbloom.
        bench_insert(
            &mut g,
            "fastbloom/insert",
            &d.present,
            || {
                fastbloom::BloomFilter::with_false_pos(P)
                    .seed(&7)
                    .expected_items(n as usize)
            },
            |f, k| {
                f.insert(&k);
            },
        );
        let f = fast(&d);
        bench_lookup(&mut g, "fastbloom/lookup_present", &d.present_probes, |k| {
            f.contains(&k)
        });
        bench_lookup(&mut g, "fastbloom/lookup_absent", &d.absent, |k| {
            f.contains(&k)
        });
        drop(f);

        // bloomfilter.
        bench_insert(
            &mut g,
            "bloomfilter/insert",
            &d.present,
            || bloomfilter::Bloom::new_for_fp_rate_with_seed(n as usize, P, &[7; 32]).unwrap(),
            |f, k| f.set(&k),
        );
        let cl = classic(&d);
        bench_lookup(
            &mut g,
            "bloomfilter/lookup_present",
            &d.present_probes,
            |k| cl.check(&k),
        );
        bench_lookup(&mut g, "bloomfilter/lookup_absent", &d.absent, |k| {
            cl.check(&k)
        });
        drop(cl);

        // Exact bitmap over dense ids 0..n. Inserts are live inserts of new
        // ids (n, n+1, …) into the delta, including its compactions.
        let new_ids: Vec<u64> = (n..2 * n).collect();
        bench_insert(
            &mut g,
            "exact_dense/insert_live",
            &new_ids,
            || dense_exact(n),
            |e, k| {
                e.insert(k);
            },
        );
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let dense_present: Vec<u64> = (0..PROBES).map(|_| rng.random_range(0..n)).collect();
        let dense_absent: Vec<u64> = (0..PROBES).map(|_| rng.random_range(n..4 * n)).collect();
        let e = dense_exact(n);
        bench_lookup(&mut g, "exact_dense/lookup_present", &dense_present, |k| {
            e.contains(k)
        });
        bench_lookup(&mut g, "exact_dense/lookup_absent", &dense_absent, |k| {
            e.contains(k)
        });
        // Read cost while a live delta is pending (below the compaction
        // threshold, so it stays in the hash set during the run).
        for v in 0..1000u64 {
            e.insert(4 * n + v * 3);
        }
        bench_lookup(
            &mut g,
            "exact_dense_with_delta/lookup_present",
            &dense_present,
            |k| e.contains(k),
        );
        bench_lookup(
            &mut g,
            "exact_dense_with_delta/lookup_absent",
            &dense_absent,
            |k| e.contains(k),
        );
        drop(e);
        g.finish();
    }

    // Build from a stream: keys/s on one core at 10M keys.
    let n = 10_000_000u64;
    let d = data(n);
    let mut g = c.benchmark_group("build_stream_10M");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(10))
        .throughput(Throughput::Elements(n));
    g.bench_function("keyset_builder_bloom", |b| {
        b.iter(|| {
            let mut builder = KeySetBuilder::new(Mode::Bloom, KeyKind::Int, n, P, key()).unwrap();
            for &k in &d.present {
                builder.insert(Item::Int(k as i64));
            }
            builder.finish()
        })
    });
    g.bench_function("keyset_builder_auto_dense_ids", |b| {
        b.iter(|| {
            let mut builder = KeySetBuilder::new(Mode::Auto, KeyKind::Int, n, P, key()).unwrap();
            for id in 1..=n as i64 {
                builder.insert(Item::Int(id));
            }
            builder.finish()
        })
    });
    g.finish();
}

criterion_group!(filter, benches);
criterion_main!(filter);
