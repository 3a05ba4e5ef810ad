//! Writes valid seed inputs for every fuzz target into `fuzz/corpus/`, so
//! the fuzzers start from real serialised filters, real configs, real COPY
//! streams and real keys instead of from nothing.
//!
//! `cargo run --manifest-path fuzz/Cargo.toml --example seed` (from the repo
//! root), then minimise with `cargo fuzz cmin <target>`. Existing files are
//! kept; seeds are named `seed-*`.

use std::fs;
use std::path::{Path, PathBuf};

use bloomgate::filter::{FilterKey, Item, KeyKind, KeySet, KeySetBuilder, Mode};
use highway::{HighwayHash, HighwayHasher, Key};

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
    filter_seeds(&root.join("filter_decode"));
    key_seeds(&root.join("key_parse"));
    config_seeds(&root.join("config_parse"));
    copy_seeds(&root.join("copy_parse"));
}

fn write(dir: &Path, name: &str, bytes: &[u8]) {
    fs::create_dir_all(dir).unwrap();
    let path: PathBuf = dir.join(format!("seed-{name}"));
    fs::write(&path, bytes).unwrap();
    println!("{} ({} bytes)", path.display(), bytes.len());
}

// ---------------------------------------------------------------- filters

fn filter_seeds(dir: &Path) {
    let key = FilterKey::from_bytes([7; 32]);
    let build = |mode: Mode, expected: u64, items: &[Item<'_>], k: &FilterKey| -> KeySet {
        let mut b = KeySetBuilder::new(mode, KeyKind::Int, expected, 0.01, k.clone()).unwrap();
        for &i in items {
            b.insert(i);
        }
        b.finish()
    };
    let ints = |r: &[i64]| r.iter().map(|&v| Item::Int(v)).collect::<Vec<_>>();

    let mut seeds: Vec<(&str, KeySet)> = vec![
        ("bloom-empty", build(Mode::Bloom, 0, &[], &key)),
        ("bloom-3", build(Mode::Bloom, 3, &ints(&[1, 2, 3]), &key)),
        (
            "bloom-40-bytes",
            build(
                Mode::Bloom,
                40,
                &[
                    Item::Bytes(b"alice"),
                    Item::Bytes(&[0x67; 16]),
                    Item::Int(-5),
                ],
                &key,
            ),
        ),
        (
            "bloom-wrong-key",
            build(Mode::Bloom, 3, &ints(&[1]), &FilterKey::from_bytes([1; 32])),
        ),
        ("exact-empty", build(Mode::Exact, 0, &[], &key)),
        ("exact-3", build(Mode::Exact, 3, &ints(&[1, 2, 3]), &key)),
        (
            "exact-extremes",
            build(Mode::Exact, 4, &ints(&[i64::MIN, -1, 0, i64::MAX]), &key),
        ),
        ("auto-dense-run", {
            let v: Vec<i64> = (1000..3000).collect();
            build(Mode::Auto, 2000, &ints(&v), &key)
        }),
        ("exact-bitmap-container", {
            // > 4096 values, no runs: a bitmap container.
            let v: Vec<i64> = (0..10_000).step_by(2).collect();
            build(Mode::Exact, 5000, &ints(&v), &key)
        }),
        ("exact-two-high-words", {
            build(
                Mode::Exact,
                4,
                &ints(&[5, 1 << 32, (1 << 33) + 7, -(1 << 40)]),
                &key,
            )
        }),
    ];
    for (name, set) in seeds.drain(..) {
        let bytes = set.to_bytes();
        // The target's checksum replica must agree with the library.
        let framed = &bytes[..bytes.len() - 8];
        assert_eq!(
            checksum(framed).to_le_bytes(),
            bytes[bytes.len() - 8..],
            "checksum replica is out of date"
        );
        write(dir, name, &bytes);
    }
}

/// Same as the one in fuzz_targets/filter_decode.rs.
fn checksum(data: &[u8]) -> u64 {
    const CHECKSUM_KEY: Key = Key([
        0x626c_6f6f_6d67_6174,
        0x652f_6368_6563_6b73,
        0x756d_2f76_3100_0000,
        0x0,
    ]);
    HighwayHasher::new(CHECKSUM_KEY).hash64(data)
}

// ---------------------------------------------------------------- keys

fn key_seeds(dir: &Path) {
    // Byte 0 picks max_len (index into [1, 4, 19, 20, 32, 36, 256, MAX]).
    let keys: &[(u8, &str)] = &[
        (6, "42"),
        (6, "-7"),
        (6, "9223372036854775807"),
        (6, "-9223372036854775808"),
        (6, "9223372036854775808"),
        (2, "-922337203685477580"),
        (6, "00012"),
        (6, "+1"),
        (6, "1e3"),
        (6, "67e55044-10b1-426f-9247-bb680e5fe0c8"),
        (5, "67E5504410B1426F9247BB680E5FE0C8"),
        (6, "{67e55044-10b1-426f-9247-bb680e5fe0c8}"),
        (6, "urn:uuid:67e55044-10b1-426f-9247-bb680e5fe0c8"),
        (6, "a%20b"),
        (6, "%C3%A9t%C3%A9"),
        (6, "%e2%82%ac%F0%9F%98%80"),
        (6, "a%2"),
        (6, "%zz"),
        (6, "%ff"),
        (6, "a%00b"),
        (6, "%7F"),
        (6, "%C2%85"),
        (1, "%41%41"),
        (0, "x"),
        (7, "user@example.com"),
        (6, "%36%37e55044-10b1-426f-9247-bb680e5fe0c8"),
    ];
    for (i, (sel, k)) in keys.iter().enumerate() {
        let mut b = vec![*sel];
        b.extend_from_slice(k.as_bytes());
        write(dir, &format!("{i:02}"), &b);
    }
}

// ---------------------------------------------------------------- configs

const MINIMAL: &str = r#"[[resource]]
name = "users"
route = "/users/{id}"
table = "users"
key_column = "id"
key_type = "bigint"
columns = ["id", "name"]
"#;

fn config_seeds(dir: &Path) {
    write(dir, "minimal", MINIMAL.as_bytes());
    let full = format!(
        r#"[server]
listen = "127.0.0.1:8080"
request_timeout = "5s"
max_key_length = 256
max_concurrency = 1024
shutdown_timeout = "10s"

[database]
url = "postgres://app:s3cret@db.internal:5432/bloomgate?sslmode=disable&password=hunter22"
pool_size = 16
acquire_timeout = "2s"
statement_timeout = "5s"
migrate = true
listen = true
install_triggers = false

[log]
format = "json"
level = "bloomgate=debug,tower_http=info"

[filter]
enabled = true
mode = "auto"
false_positive_rate = 0.01
headroom = 1.5
rebuild_interval = "10m"
max_shrink = 0.5
verify_above_high_water = false
verify_budget = 100

[cache]
enabled = true
max_entries = 100000
ttl = "60s"
negative_ttl = "5s"
negative_max_entries = 100000

{MINIMAL}
[resource.filter]
mode = "exact"
false_positive_rate = 0.001
rebuild_interval = "1h 30m"
verify_above_high_water = true

[resource.cache]
ttl = "2m"
negative_ttl = "250ms"

[[resource]]
name = "articles"
route = "/v1/articles/{{key}}"
table = "public.articles"
key_column = "article_id"
key_type = "uuid"
columns = ["article_id", "title", "_body2"]

[[resource]]
name = "tags"
route = "/t/{{name}}"
table = "tags"
key_column = "name"
key_type = "text"
columns = ["name"]
[resource.filter]
mode = "bloom"
enabled = false
[resource.cache]
enabled = false
max_entries = 0
"#
    );
    write(dir, "full", full.as_bytes());
    write(
        dir,
        "url-userinfo",
        format!("[database]\nurl = \"postgresql://u:pa%40ss@[::1]:5433/db\"\n{MINIMAL}").as_bytes(),
    );
    write(
        dir,
        "url-query-password",
        format!("[database]\nurl = \"postgres://h/db?user=a&password=s3cret&application_name=x\"\n{MINIMAL}")
            .as_bytes(),
    );
    write(
        dir,
        "inline-tables",
        br#"server = { listen = "[::]:0", max_key_length = 1 }
filter = { rebuild_interval = "0s", headroom = 100.0, max_shrink = 0 }
resource = [{ name = "a-1", route = "/a/{k}", table = "s.t", key_column = "_", key_type = "text", columns = ["c"], cache = { ttl = "1ns" } }]
"#,
    );
    write(
        dir,
        "sql-injection-refused",
        MINIMAL
            .replace("table = \"users\"", "table = \"users; DROP TABLE users\"")
            .as_bytes(),
    );
    if let Ok(repo) =
        fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/bloomgate.toml"))
    {
        write(dir, "repo-config", &repo);
    }
}

// ---------------------------------------------------------------- COPY

fn copy_seeds(dir: &Path) {
    const SIG: &[u8; 11] = b"PGCOPY\n\xff\r\n\0";
    let encode = |ext: &[u8], rows: &[Vec<Option<Vec<u8>>>]| -> Vec<u8> {
        let mut out = SIG.to_vec();
        out.extend(0i32.to_be_bytes());
        out.extend((ext.len() as i32).to_be_bytes());
        out.extend(ext);
        for r in rows {
            out.extend((r.len() as i16).to_be_bytes());
            for f in r {
                match f {
                    Some(v) => {
                        out.extend((v.len() as i32).to_be_bytes());
                        out.extend(v);
                    }
                    None => out.extend((-1i32).to_be_bytes()),
                }
            }
        }
        out.extend((-1i16).to_be_bytes());
        out
    };
    // Prefix: number of cuts, then the cuts (u16 LE).
    let with_cuts = |cuts: &[u16], stream: &[u8]| -> Vec<u8> {
        let mut out = vec![cuts.len() as u8];
        for c in cuts {
            out.extend(c.to_le_bytes());
        }
        out.extend(stream);
        out
    };
    let bigints: Vec<Vec<Option<Vec<u8>>>> = [1i64, -2, i64::MAX]
        .iter()
        .map(|v| vec![Some(v.to_be_bytes().to_vec())])
        .collect();
    write(
        dir,
        "bigint",
        &with_cuts(&[3, 20, 27], &encode(&[], &bigints)),
    );
    let mixed = vec![
        vec![Some(b"alice".to_vec()), None],
        vec![None],
        vec![],
        vec![
            Some(vec![0x67; 16]),
            Some(Vec::new()),
            Some(7i32.to_be_bytes().to_vec()),
        ],
    ];
    write(
        dir,
        "mixed",
        &with_cuts(&[0, 19, 40, 41], &encode(b"ext!", &mixed)),
    );
    write(dir, "empty", &with_cuts(&[], &encode(&[], &[])));
    let mut truncated = encode(&[], &bigints);
    truncated.truncate(truncated.len() - 5);
    write(dir, "truncated", &with_cuts(&[10], &truncated));
    let mut trailing = encode(&[], &bigints);
    trailing.push(0);
    write(dir, "trailing", &with_cuts(&[1, 2], &trailing));
}
