//! Fuzzes `bloomgate::config::Config::from_toml`.
//!
//! Never panics; when a config is accepted:
//! * every resource's `table`, `key_column` and `columns` are plain SQL
//!   identifiers (`[A-Za-z_][A-Za-z0-9_]*`, `table` optionally
//!   `schema.table`), so no SQL can ride in through the config;
//! * `to_redacted_toml()` re-parses to the same effective config (redacted
//!   URL aside);
//! * the redacted TOML carries no password from the database URL, judged
//!   the way the Postgres driver reads the URL (the `url` crate: userinfo
//!   password and `password=` query parameters, percent-decoded keys).
#![no_main]

use bloomgate::config::{CacheConfig, Config, redact_url};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(config) = Config::from_toml(text) else {
        return;
    };

    for r in &config.resources {
        let parts: Vec<&str> = r.table.split('.').collect();
        assert!(
            (1..=2).contains(&parts.len()) && parts.iter().all(|p| is_identifier(p)),
            "accepted table {:?}",
            r.table
        );
        let key = r.key_column.as_slice();
        assert!(
            !key.is_empty() && key.iter().all(|c| is_identifier(c)),
            "accepted key_column {key:?}"
        );
        assert!(!r.columns.is_empty());
        for c in &r.columns {
            assert!(is_identifier(c), "accepted column {c:?}");
        }
    }

    let redacted = config.to_redacted_toml();
    assert!(
        !redacted.starts_with("# cannot render"),
        "accepted config does not render: {redacted}"
    );
    let back = match Config::from_toml(&redacted) {
        Ok(c) => c,
        Err(e) => panic!(
            "redacted config does not re-parse: {e}\n--- input\n{text}\n--- redacted\n{redacted}"
        ),
    };
    same_effective_config(&config, &back);
    check_no_password(&config.database.url, &back.database.url);
    // Rendering is stable from then on.
    assert_eq!(back.to_redacted_toml(), redacted);
});

/// The same bound (the redacted TOML names the default byte budget the
/// input left implicit) and the same everything else.
fn same_cache(a: &CacheConfig, b: &CacheConfig) {
    assert_eq!(a.bound(), b.bound());
    let rest = |c: &CacheConfig| CacheConfig {
        max_bytes: None,
        max_entries: None,
        ..c.clone()
    };
    assert_eq!(rest(a), rest(b));
}

fn same_effective_config(a: &Config, b: &Config) {
    assert_eq!(a.server.listen, b.server.listen);
    assert_eq!(a.server.request_timeout, b.server.request_timeout);
    assert_eq!(a.server.max_key_length, b.server.max_key_length);
    assert_eq!(a.server.max_concurrency, b.server.max_concurrency);
    assert_eq!(a.server.shutdown_timeout, b.server.shutdown_timeout);
    assert_eq!(redact_url(&a.database.url), b.database.url);
    assert_eq!(a.database.pool_size, b.database.pool_size);
    assert_eq!(a.database.acquire_timeout, b.database.acquire_timeout);
    assert_eq!(a.database.statement_timeout, b.database.statement_timeout);
    assert_eq!(a.database.migrate, b.database.migrate);
    // `listen` is folded into `freshness` at load: compare what it became.
    assert_eq!(a.database.listen, None);
    assert_eq!(a.database.freshness, b.database.freshness);
    assert_eq!(a.database.install_triggers, b.database.install_triggers);
    assert_eq!(a.log.format, b.log.format);
    assert_eq!(a.log.level, b.log.level);
    assert_eq!(a.filter, b.filter);
    same_cache(&a.cache, &b.cache);
    let (ra, rb) = (a.resolved(), b.resolved());
    assert_eq!(ra.len(), rb.len());
    for (x, y) in ra.iter().zip(&rb) {
        assert_eq!(x.name, y.name);
        assert_eq!(x.route, y.route);
        assert_eq!(x.table, y.table);
        assert_eq!(x.key, y.key);
        assert_eq!(x.columns, y.columns);
        assert_eq!(x.filter, y.filter);
        same_cache(&x.cache, &y.cache);
    }
}

/// `original` is the accepted URL, `redacted` what the redacted TOML
/// re-parsed to.
fn check_no_password(original: &str, redacted: &str) {
    let Ok(orig) = url::Url::parse(original) else {
        // The driver cannot use it either; nothing it would send as a
        // password.
        return;
    };
    let mut secrets: Vec<String> = Vec::new();
    if let Some(pw) = orig.password() {
        secrets.push(pw.to_string());
    }
    for (k, v) in orig.query_pairs() {
        if k == "password" {
            secrets.push(v.into_owned());
        }
    }
    // The same values as they stand in the URL (still percent-encoded).
    for kv in orig.query().unwrap_or("").split('&') {
        if let Some((k, v)) = kv.split_once('=')
            && percent_encoding::percent_decode_str(k).decode_utf8_lossy() == "password"
        {
            secrets.push(v.to_string());
        }
    }

    // Semantically: the redacted URL hands the driver no real password.
    if let Ok(red) = url::Url::parse(redacted) {
        if let Some(pw) = red.password() {
            assert!(
                pw == "***" || pw.is_empty(),
                "redacted URL {redacted:?} (from {original:?}) still has password {pw:?}"
            );
        }
        for (k, v) in red.query_pairs() {
            if k == "password" {
                assert_eq!(
                    v, "***",
                    "redacted URL {redacted:?} (from {original:?}) still has a password parameter"
                );
            }
        }
    }
    // Textually: a secret that occurs exactly once in the original URL (so
    // only as the password) and has no '*' (so redaction cannot create it)
    // must not occur in the redacted URL.
    for s in secrets {
        if !s.is_empty() && !s.contains('*') && original.matches(s.as_str()).count() == 1 {
            assert!(
                !redacted.contains(s.as_str()),
                "password {s:?} from {original:?} survives redaction: {redacted:?}"
            );
        }
    }
}

fn is_identifier(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && (b[0].is_ascii_alphabetic() || b[0] == b'_')
        && b.iter().all(|c| c.is_ascii_alphanumeric() || *c == b'_')
}
