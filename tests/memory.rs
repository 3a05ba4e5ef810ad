//! What the gateway's two big structures hold, counted byte for byte by a
//! global allocator (tests/common/counting.rs): the row cache stays within
//! its byte budget however wide the rows are, its weigher never counts a row
//! as smaller than the heap it holds, and each filter layout holds what its
//! `bloomgate_filter_size_bytes` reports. The tables these tests print
//! (`cargo test --release --test memory -- --nocapture`) are the book's (docs/src/sizing.md)
//! "Sizing".
//!
//! The counts are of requested bytes: the allocator's own rounding and
//! headers (mimalloc's size classes waste up to 1/8 on a block; glibc adds
//! 8–16 bytes) come on top, which is why the book's figures for a process
//! (RSS) are a little higher.

#[path = "common/counting.rs"]
mod counting;

use std::sync::{Arc, Mutex};

use bloomgate::cache::{ENTRY_OVERHEAD, RowCache};
use bloomgate::config::{CacheConfig, DEFAULT_MAX_BYTES};
use bloomgate::filter::{FilterKey, Item, KeyKind, KeySetBuilder, Mode};
use bloomgate::key::Key;
use bytes::Bytes;
use bytesize::ByteSize;
use counting::live_bytes;

#[global_allocator]
static GLOBAL: counting::Counting = counting::Counting;

/// What a row cache holds beside its rows, which no budget counts: moka's
/// tables, channels and queues (measured: 75–350 KiB, growing over the
/// first few hundred rows; docs/src/sizing.md).
const CACHE_FIXED_MAX: u64 = 512 * 1024;

/// The counter is the process's: one measurement at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// A JSON row about `width` bytes long whose text compresses about as a
/// real row's does (words from a small vocabulary, numbers), distinct per
/// `id`: a window of a text made once, at an offset of its own.
fn row_body(id: u64, width: usize) -> Bytes {
    static TEXT: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    let text = TEXT.get_or_init(|| {
        const WORDS: [&str; 16] = [
            "alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india",
            "juliet", "kilo", "lima", "mike", "november", "oscar", "papa",
        ];
        let mut s = String::new();
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        while s.len() < 256 * 1024 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            s.push_str(WORDS[(x % 16) as usize]);
            s.push(if x.is_multiple_of(5) { ',' } else { ' ' });
            if x.is_multiple_of(7) {
                s.push_str(&(x % 100_000).to_string());
            }
        }
        s
    });
    let head = format!("{{\"id\":{id},\"name\":\"user {id}\",\"bio\":\"");
    let fill = width.saturating_sub(head.len() + 2);
    let at = (id as usize * 7919) % (text.len() - fill);
    let mut s = head;
    s.push_str(&text[at..at + fill]);
    s.push_str("\"}");
    Bytes::from(s)
}

/// Fills a cache with `rows` rows of `width` bytes, then reports
/// (heap bytes the cache holds, its weighted size, rows it holds).
async fn fill(cfg: &CacheConfig, rows: u64, width: usize) -> (i64, u64, u64) {
    fill_keyed(cfg, rows, width, |id| Key::Int(id as i64)).await
}

/// [`fill`] with the keys `key` makes.
async fn fill_keyed(
    cfg: &CacheConfig,
    rows: u64,
    width: usize,
    key: impl Fn(u64) -> Key,
) -> (i64, u64, u64) {
    // The rows' source text is made once, and grows to 512 KiB: made
    // before the count starts, it is never counted against a cache.
    row_body(0, 16);
    let before = live_bytes();
    let cache = RowCache::<Key>::new(cfg);
    for id in 0..rows {
        let body = row_body(id, width);
        let got = cache
            .get_or_load(key(id), move || async move {
                Ok::<_, std::convert::Infallible>(Some(body))
            })
            .await;
        assert!(got.is_ok());
        if id % 64 == 63 {
            // Eviction as a busy cache runs it, not once at the end.
            cache.sync().await;
        }
    }
    settle(&cache).await;
    let held = live_bytes() - before;
    let weight = cache.weighted_size();
    let (entries, _) = cache.entry_counts();
    drop(cache);
    (held, weight, entries)
}

/// Applies moka's pending work and lets what it removed be freed, as the
/// epoch's next advances free it in a cache in use.
///
/// moka frees what it removes (an evicted row, a row admission turned away,
/// a finished loader's reference to its row) through crossbeam-epoch's
/// deferred destruction: into a bag stamped, when pushed, with the global
/// epoch, which a later collect runs once the epoch is two past the stamp.
/// Every `sync` ends in a flush per moka cache (rows, and negative entries
/// unless they are off) that pushes the bag, advances the epoch and
/// collects, except where the flush's pin is one that collects by itself
/// (a thread's 1st, 129th, 257th...): that pin already advanced the epoch,
/// and the flush then finds its own thread pinned in the older one, so the
/// bag it pushed waits. One `sync` therefore sometimes leaves a round's
/// evictions allocated, and two are enough: two advances after the push,
/// then a collect. Three are the margin; their six flushes come within a
/// few pins of one another (the later syncs find no work), so at most one
/// of them meets a collecting pin
/// (a_settled_cache_has_freed_what_it_evicted_at_any_pin_count).
async fn settle(cache: &RowCache<Key>) {
    for _ in 0..3 {
        cache.sync().await;
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap()
}

/// The configuration a gateway runs with when `[cache]` names no bound
/// holds wide rows within the default budget, not 100,000 of them
/// (which, at 64 KiB a row, would be 6 GiB).
#[test]
fn wide_rows_stay_within_the_default_budget() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    // Compression off only to keep the test quick: the variants are
    // counted too (the next test).
    let cfg = CacheConfig {
        compression: false,
        ..CacheConfig::default()
    };
    let width = 64 * 1024;
    let rows = 2 * DEFAULT_MAX_BYTES / width as u64;
    let (held, weight, entries) = runtime().block_on(fill(&cfg, rows, width));
    println!(
        "default budget {} MiB, {rows} rows of {width} B offered: {entries} kept, \
         weighted {weight} B, heap {held} B",
        DEFAULT_MAX_BYTES >> 20
    );
    assert!(weight <= DEFAULT_MAX_BYTES, "weighted {weight}");
    assert!(
        held <= (DEFAULT_MAX_BYTES + CACHE_FIXED_MAX) as i64,
        "the cache holds {held} B against a budget of {DEFAULT_MAX_BYTES}"
    );
    // And it is a cache: it keeps what fits.
    assert!(held >= (DEFAULT_MAX_BYTES / 2) as i64, "held only {held} B");
    assert!(entries >= rows / 4, "kept only {entries} rows");
}

/// For every width, compressed variants included: the weigher charges a
/// row at least the heap it holds (so a byte budget is a bound on the
/// heap), and a full cache holds no more than its budget.
#[test]
fn the_weigher_never_undercounts_a_row_and_a_full_cache_keeps_its_budget() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let rt = runtime();
    println!(
        "{:>9} | {:>6} | {:>10} | {:>12} | {:>14} | {:>12} | {:>14}",
        "row bytes",
        "rows",
        "fixed",
        "heap per row",
        "charged per row",
        "charged/heap",
        "rows per GiB"
    );
    for width in [40, 150, 600, 1024, 2000, 4096, 16 * 1024, 64 * 1024] {
        let budget = 2u64 << 20;
        let cfg = CacheConfig {
            max_bytes: Some(ByteSize::b(1 << 40)),
            ..CacheConfig::default()
        };
        // Unbounded in practice: every row stays, so per-row figures are
        // exact averages.
        let rows = (budget / (width as u64 + ENTRY_OVERHEAD as u64)).clamp(1_000, 10_000);
        // Each row's share is the difference between a cache of `rows` and
        // one of half as many: what a cache holds before its rows (moka's
        // table, channels and queues, which grow in steps over the first
        // few hundred) drops out.
        let (half, _, _) = rt.block_on(fill(&cfg, rows / 2, width));
        let (held, weight, entries) = rt.block_on(fill(&cfg, rows, width));
        assert_eq!(entries, rows);
        let heap_per_row = (held - half) as f64 / (rows - rows / 2) as f64;
        let fixed = held - (heap_per_row * rows as f64) as i64;
        let charged_per_row = weight as f64 / rows as f64;
        println!(
            "{width:>9} | {rows:>6} | {fixed:>10} | {heap_per_row:>12.0} | {charged_per_row:>14.0} | {:>12.2} | {:>14.0}",
            charged_per_row / heap_per_row,
            (1u64 << 30) as f64 / heap_per_row
        );
        assert!(
            charged_per_row >= heap_per_row,
            "rows of {width} B hold {heap_per_row:.0} B each but are charged {charged_per_row:.0}"
        );
        // And bounded: offered three budgets' worth, it keeps one.
        let cfg = CacheConfig {
            max_bytes: Some(ByteSize::b(budget)),
            ..CacheConfig::default()
        };
        let offered = (3 * budget / weight.div_ceil(rows)).max(8);
        let (held, weight, entries) = rt.block_on(fill(&cfg, offered, width));
        assert!(weight <= budget, "width {width}: weighted {weight}");
        assert!(
            held <= (budget + CACHE_FIXED_MAX) as i64,
            "width {width}: {entries} rows hold {held} B against a budget of {budget} \
             (and {CACHE_FIXED_MAX} B for the cache's own tables)"
        );
        assert!(
            entries > 0 && held >= (budget / 3) as i64,
            "width {width}: held {held}"
        );
    }
}

/// Whatever the count of epoch pins a thread has made when it fills a
/// bounded cache, the cache, settled, holds no more than its budget: the
/// rows it evicted are freed. A thread's count decides which flush meets a
/// collecting pin (see [`settle`]), so each count modulo 128 is tried, on a
/// thread of its own (whose count starts at zero). After one `sync`, the
/// residue whose last flush meets a collecting pin leaves rows allocated;
/// which residue that is depends on how many pins the fill makes, which
/// moka's random hasher and time-driven maintenance may shift from one
/// cache to the next.
#[test]
fn a_settled_cache_has_freed_what_it_evicted_at_any_pin_count() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let budget = 2u64 << 20;
    let width = 64 * 1024;
    let cfg = CacheConfig {
        max_bytes: Some(ByteSize::b(budget)),
        compression: false,
        ..CacheConfig::default()
    };
    for pins in 0..128 {
        let cfg = cfg.clone();
        let (held, weight, entries) = std::thread::spawn(move || {
            for _ in 0..pins {
                drop(crossbeam_epoch::pin());
            }
            runtime().block_on(fill(&cfg, 3 * budget / width as u64, width))
        })
        .join()
        .unwrap();
        assert!(weight <= budget, "after {pins} pins: weighted {weight}");
        assert!(
            held <= (budget + CACHE_FIXED_MAX) as i64,
            "after {pins} pins: {entries} rows hold {held} B against a budget of {budget}"
        );
        assert!(
            held >= (budget / 3) as i64,
            "after {pins} pins: held {held}"
        );
    }
}

/// Text keys as long as `server.max_key_length` allows (256 by default)
/// are charged their buffers too.
#[test]
fn long_text_keys_are_charged_their_bytes() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let rt = runtime();
    let cfg = CacheConfig {
        max_bytes: Some(ByteSize::b(1 << 40)),
        ..CacheConfig::default()
    };
    let key = |id: u64| Key::Text(format!("{id:0>256}").into());
    let (half, _, _) = rt.block_on(fill_keyed(&cfg, 5_000, 40, key));
    let (held, weight, _) = rt.block_on(fill_keyed(&cfg, 10_000, 40, key));
    let heap_per_row = (held - half) as f64 / 5_000.0;
    let charged_per_row = weight as f64 / 10_000.0;
    println!(
        "40 B rows under 256 B text keys: heap {heap_per_row:.0}, charged {charged_per_row:.0}"
    );
    assert!(
        charged_per_row >= heap_per_row,
        "rows under long keys hold {heap_per_row:.0} B each but are charged {charged_per_row:.0}"
    );
    // And the measurement saw them: each holds its key's 256 bytes at least.
    assert!(heap_per_row >= 256.0, "{heap_per_row:.0} B a row");
}

/// Heap of a finished filter of `n` keys, and what its stats report.
fn filter_heap(
    mode: Mode,
    n: u64,
    p: f64,
    keys: impl Iterator<Item = i64>,
) -> (i64, u64, &'static str) {
    let before = live_bytes();
    let mut b = KeySetBuilder::new(
        mode,
        KeyKind::Int,
        (n as f64 * 1.5) as u64,
        p,
        FilterKey::random(),
    )
    .unwrap();
    for k in keys {
        b.insert(Item::Int(k));
    }
    let set = Arc::new(b.finish());
    let held = live_bytes() - before;
    let stats = set.stats();
    (held, stats.bytes, stats.kind)
}

/// Every layout holds what `bloomgate_filter_size_bytes` says it holds
/// (within a quarter for the roaring bitmap, whose serialised size is what
/// it reports), and the per-million figures the book's sizing table gives.
#[test]
fn each_filter_layout_holds_what_its_metric_reports() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    const N: u64 = 1_000_000;
    let mut x: u64 = 0x2545_F491_4F6C_DD1D;
    let mut random = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x >> 1) as i64
    };
    let randoms: Vec<i64> = (0..N).map(|_| random()).collect();
    // Borrowed, not moved: a vector freed during a measurement would count
    // against the filter.
    type Keys<'a> = Box<dyn Iterator<Item = i64> + 'a>;
    let layouts: Vec<(&str, Mode, f64, Keys)> = vec![
        (
            "bloom, p = 0.01 (default)",
            Mode::Bloom,
            0.01,
            Box::new(1..=N as i64),
        ),
        (
            "bloom, p = 0.001",
            Mode::Bloom,
            0.001,
            Box::new(1..=N as i64),
        ),
        (
            "exact, dense ids 1..N",
            Mode::Exact,
            0.01,
            Box::new(1..=N as i64),
        ),
        (
            "exact, every 16th id",
            Mode::Exact,
            0.01,
            Box::new((1..=N as i64).map(|i| i * 16)),
        ),
        (
            "exact, random 63-bit ids",
            Mode::Exact,
            0.01,
            Box::new(randoms.iter().copied()),
        ),
        (
            "auto, random 63-bit ids",
            Mode::Auto,
            0.01,
            Box::new(randoms.iter().copied()),
        ),
    ];
    println!(
        "{:<28} | {:>6} | {:>16} | {:>13} | {:>14}",
        "layout (1M keys, headroom 1.5)",
        "chosen",
        "heap MiB per 1M",
        "bytes per key",
        "metric / heap"
    );
    for (name, mode, p, keys) in layouts {
        let (held, reported, kind) = filter_heap(mode, N, p, keys);
        let ratio = reported as f64 / held as f64;
        println!(
            "{name:<28} | {kind:>6} | {:>16.2} | {:>13.2} | {ratio:>14.3}",
            held as f64 / (1 << 20) as f64,
            held as f64 / N as f64
        );
        // A bitmap of runs is a few hundred bytes either way; what matters
        // is that a large one is reported as large.
        let tolerance = if kind == "bloom" { 0.01 } else { 0.25 };
        assert!(
            (reported as f64 - held as f64).abs() <= (tolerance * held as f64).max(64.0 * 1024.0),
            "{name}: the metric says {reported} B, the heap holds {held} B"
        );
    }
}

/// What the book's sizing says a negative entry costs, at most.
const NEGATIVE_ENTRY_MAX: f64 = 400.0;

/// "No such row" entries are bounded by count (`negative_max_entries`);
/// each costs what the book's sizing says, so the count is a memory bound.
#[test]
fn a_negative_entry_costs_what_the_sizing_says() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let rt = runtime();
    let absent = |n: u64| async move {
        let before = live_bytes();
        let cache = RowCache::<Key>::new(&CacheConfig::default());
        for id in 0..n {
            let got = cache
                .get_or_load(Key::Int(id as i64), || async {
                    Ok::<_, std::convert::Infallible>(None)
                })
                .await;
            assert!(got.is_ok());
            if id % 64 == 63 {
                cache.sync().await;
            }
        }
        settle(&cache).await;
        let held = live_bytes() - before;
        assert_eq!(cache.entry_counts(), (0, n));
        held
    };
    let (half, full) = (rt.block_on(absent(10_000)), rt.block_on(absent(20_000)));
    let per_entry = (full - half) as f64 / 10_000.0;
    println!(
        "negative entry: {per_entry:.0} B; {:.1} MiB at the default 100,000",
        per_entry * 100_000.0 / (1 << 20) as f64
    );
    assert!(
        per_entry > 0.0 && per_entry <= NEGATIVE_ENTRY_MAX,
        "{per_entry} B"
    );
}
