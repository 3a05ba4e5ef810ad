//! Compression benchmarks (issue 12): what a row pays once, when it enters
//! the cache, to be stored gzip-, br- and zstd-compressed, and what a hit
//! pays to choose among them.
//!
//! `cargo bench --bench compression`. Inputs: an 8 kB article row (English
//! prose: the first 7,800 bytes of this repository's LICENSE with
//! whitespace runs squeezed, in the JSON the gateway emits), and a 100-byte
//! user row, which stays under the default 1 KiB threshold. Before the
//! timing runs it prints each variant's size.

use std::hint::black_box;

use bloomgate::cache::Row;
use bloomgate::encoding::{self, Coding};
use bytes::Bytes;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};

fn article() -> Bytes {
    let text: String = include_str!("../LICENSE")
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    let body = &text[..7800];
    Bytes::from(
        serde_json::json!({
            "id": "4a2bd3ac-8b13-2bd3-6b1d-e69ed1bb7f6c",
            "author_id": 2,
            "title": "Article 1",
            "body": body,
            "published_at": "2024-01-01T01:00:00+00:00",
        })
        .to_string(),
    )
}

fn user() -> Bytes {
    Bytes::from_static(
        br#"{"id":500,"email":"user500@example.com","name":"User 500","created_at":"2024-01-01T08:20:00+00:00"}"#,
    )
}

const BROWSER: &[u8] = b"gzip, deflate, br, zstd";

fn benches(c: &mut Criterion) {
    let article = article();
    let row = Row::compressed(article.clone(), Some(1024));
    println!("article row: identity {} bytes", article.len());
    for v in row.variants() {
        println!(
            "  {:<4} {} bytes ({:.1} %)",
            v.coding.token(),
            v.rep.body().len(),
            100.0 * v.rep.body().len() as f64 / article.len() as f64
        );
    }

    let mut g = c.benchmark_group("row enters the cache");
    g.throughput(Throughput::Bytes(article.len() as u64));
    g.bench_function("8 kB article: ETag only (compression off)", |b| {
        b.iter(|| black_box(Row::compressed(black_box(article.clone()), None)))
    });
    g.bench_function("8 kB article: ETag + gzip, br, zstd", |b| {
        b.iter(|| black_box(Row::compressed(black_box(article.clone()), Some(1024))))
    });
    let user = user();
    g.throughput(Throughput::Bytes(user.len() as u64));
    g.bench_function("100 B user: ETag only, under the threshold", |b| {
        b.iter(|| black_box(Row::compressed(black_box(user.clone()), Some(1024))))
    });
    g.finish();

    let mut g = c.benchmark_group("hit: choose the coding");
    g.bench_function("negotiate `gzip, deflate, br, zstd`", |b| {
        b.iter(|| {
            black_box(encoding::negotiate(
                std::iter::once(black_box(BROWSER)),
                |c| row.variant(c).is_some(),
            ))
        })
    });
    g.bench_function("negotiate `br;q=0.5, gzip;q=0.8, identity;q=0.1`", |b| {
        b.iter(|| {
            black_box(encoding::negotiate(
                std::iter::once(black_box(&b"br;q=0.5, gzip;q=0.8, identity;q=0.1"[..])),
                |c| row.variant(c).is_some(),
            ))
        })
    });
    g.bench_function("variant lookup (br)", |b| {
        b.iter(|| {
            black_box(
                row.variant(black_box(Coding::Br))
                    .map(|v| v.rep.body().len()),
            )
        })
    });
    g.finish();
}

criterion_group!(compression, benches);
criterion_main!(compression);
