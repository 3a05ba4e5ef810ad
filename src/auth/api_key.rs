//! API keys: `auth.api_keys_file`, named keys with their scopes.
//!
//! ```toml
//! [[key]]
//! name = "reporting"                 # the caller, for rate limits
//! sha256 = "9f86d081884c7d65..."     # of the key: printf %s "$KEY" | sha256sum
//! scopes = ["users:read"]
//!
//! [[key]]
//! name = "ops"
//! key = "a long random key"          # or the key itself (keep the file private)
//! ```
//!
//! The gateway holds each key only as the admin token is held: a keyed
//! HighwayHash digest (of the key's SHA-256) under a per-process secret
//! key. A presented key is hashed the same way and its digest is the
//! lookup: a hash table from digest to entry, then one comparison in
//! constant time with the entry found. So a key costs the same however
//! many keys the file holds, known or not (a scan of every entry made an
//! unknown key at 10,000 keys cost 16 times a valid one: a denial of
//! service). What the table's probing may leak in time is about digests,
//! and a digest is unpredictable without the process's secret key: a
//! caller can neither aim at an entry nor learn how close a guess came.

use std::path::Path;

use std::collections::HashMap;

use serde::Deserialize;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use super::keyed::KeyedHash;

/// Shortest key accepted in the file, as for the admin token.
pub const MIN_KEY_LEN: usize = crate::config::MIN_TOKEN_LEN;
/// Most keys in one file.
pub const MAX_KEYS: usize = 10_000;

/// One key, as read from the file.
#[derive(Clone, PartialEq, Eq)]
pub struct Entry {
    pub name: String,
    pub sha256: [u8; 32],
    pub scopes: Vec<String>,
}

impl std::fmt::Debug for Entry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Entry")
            .field("name", &self.name)
            .field("scopes", &self.scopes)
            .finish_non_exhaustive()
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default, rename = "key")]
    keys: Vec<RawEntry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEntry {
    name: String,
    #[serde(default)]
    key: Option<String>,
    #[serde(default)]
    sha256: Option<String>,
    #[serde(default)]
    scopes: Vec<String>,
}

/// The file's keys; the error names the entry and never quotes a key.
pub fn load(path: &Path) -> Result<Vec<Entry>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    parse(&text).map_err(|e| format!("{}: {e}", path.display()))
}

pub fn parse(text: &str) -> Result<Vec<Entry>, String> {
    // toml's message may quote the offending line: keep only where it is.
    let file: File = toml::from_str(text).map_err(|e| match e.span() {
        Some(span) => format!(
            "not a keys file (at byte {}): expected [[key]] tables of name, key or sha256, scopes",
            span.start
        ),
        None => "not a keys file: expected [[key]] tables of name, key or sha256, scopes".into(),
    })?;
    if file.keys.len() > MAX_KEYS {
        return Err(format!("more than {MAX_KEYS} keys"));
    }
    let mut out: Vec<Entry> = Vec::with_capacity(file.keys.len());
    for (i, k) in file.keys.into_iter().enumerate() {
        let at = format!("key[{i}]");
        if k.name.is_empty()
            || k.name.len() > 63
            || !k
                .name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
        {
            return Err(format!("{at}.name: 1-63 letters, digits, '-', '_' or '.'"));
        }
        if out.iter().any(|e| e.name == k.name) {
            return Err(format!("{at}.name: {:?} is used twice", k.name));
        }
        let sha256 = match (k.key, k.sha256) {
            (Some(key), None) => {
                if key.len() < MIN_KEY_LEN {
                    return Err(format!(
                        "{at}.key: must be at least {MIN_KEY_LEN} characters"
                    ));
                }
                Sha256::digest(key.as_bytes()).into()
            }
            (None, Some(hex)) => decode_hex(&hex)
                .ok_or_else(|| format!("{at}.sha256: 64 hexadecimal digits expected"))?,
            _ => return Err(format!("{at}: give exactly one of key and sha256")),
        };
        if out.iter().any(|e| e.sha256 == sha256) {
            return Err(format!("{at}: the same key as another entry"));
        }
        out.push(Entry {
            name: k.name,
            sha256,
            scopes: k.scopes,
        });
    }
    Ok(out)
}

fn decode_hex(s: &str) -> Option<[u8; 32]> {
    let s = s.trim();
    if s.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

/// The keys as the request path holds them: keyed digests only, indexed
/// by their first 8 bytes (see the module doc).
pub struct Keys {
    digests: Vec<[u8; 32]>,
    by_prefix: HashMap<u64, usize, BuildNoHash>,
}

impl Keys {
    pub fn new(entries: &[Entry], keyed: &KeyedHash) -> Self {
        let digests: Vec<[u8; 32]> = entries.iter().map(|e| keyed.digest(&e.sha256)).collect();
        // Two digests sharing 64 bits is a 2^-50 event at 10,000 keys;
        // should it happen, the later entry is found by neither lookup
        // (refused, never taken for the other).
        let mut by_prefix = HashMap::with_capacity_and_hasher(digests.len(), BuildNoHash);
        for (i, d) in digests.iter().enumerate() {
            by_prefix.insert(prefix(d), i);
        }
        Self { digests, by_prefix }
    }

    /// The index of the entry `presented` is: found by its digest, then
    /// compared in full in constant time.
    pub fn find(&self, presented: &[u8], keyed: &KeyedHash) -> Option<usize> {
        let sha: [u8; 32] = Sha256::digest(presented).into();
        let digest = keyed.digest(&sha);
        let &i = self.by_prefix.get(&prefix(&digest))?;
        bool::from(self.digests[i].ct_eq(&digest)).then_some(i)
    }

    pub fn len(&self) -> usize {
        self.digests.len()
    }

    pub fn is_empty(&self) -> bool {
        self.digests.is_empty()
    }
}

fn prefix(digest: &[u8; 32]) -> u64 {
    u64::from_le_bytes(digest[..8].try_into().expect("8 bytes"))
}

/// The table's keys are keyed digests already, uniformly spread and
/// unknown to callers: hashing them again would only cost time.
#[derive(Clone, Copy, Default)]
struct BuildNoHash;

impl std::hash::BuildHasher for BuildNoHash {
    type Hasher = NoHash;
    fn build_hasher(&self) -> NoHash {
        NoHash(0)
    }
}

struct NoHash(u64);

impl std::hash::Hasher for NoHash {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) | u64::from(b);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_found_by_either_form_and_only_exactly() {
        let sha = Sha256::digest(b"second-key-0123456789");
        let hex: String = sha.iter().map(|b| format!("{b:02x}")).collect();
        let text = format!(
            "[[key]]\nname = \"a\"\nkey = \"first-key-0123456789\"\nscopes = [\"x\"]\n\
             [[key]]\nname = \"b\"\nsha256 = \"{hex}\"\n"
        );
        let entries = parse(&text).unwrap();
        assert_eq!(entries[0].scopes, ["x"]);
        let keyed = KeyedHash::random();
        let keys = Keys::new(&entries, &keyed);
        assert_eq!(keys.find(b"first-key-0123456789", &keyed), Some(0));
        assert_eq!(keys.find(b"second-key-0123456789", &keyed), Some(1));
        assert_eq!(keys.find(b"first-key-012345678", &keyed), None);
        assert_eq!(keys.find(b"", &keyed), None);
        assert!(!format!("{entries:?}").contains("first-key"));
    }

    /// Every one of many keys is found as itself, and keys never given
    /// are found as none (the table answers exactly what the scan did).
    #[test]
    fn at_ten_thousand_keys_each_is_found_and_no_other() {
        let entries: Vec<Entry> = (0..MAX_KEYS)
            .map(|i| Entry {
                name: format!("k{i}"),
                sha256: Sha256::digest(format!("key-number-{i}-0123456789")).into(),
                scopes: vec![],
            })
            .collect();
        let keyed = KeyedHash::random();
        let keys = Keys::new(&entries, &keyed);
        assert_eq!(keys.len(), MAX_KEYS);
        for i in (0..MAX_KEYS).step_by(97) {
            let k = format!("key-number-{i}-0123456789");
            assert_eq!(keys.find(k.as_bytes(), &keyed), Some(i));
        }
        for i in 0..1000 {
            let k = format!("key-number-{}-0123456789", MAX_KEYS + i);
            assert_eq!(keys.find(k.as_bytes(), &keyed), None);
        }
    }

    #[test]
    fn bad_files_name_the_entry_and_never_quote_a_key() {
        for (text, want) in [
            (
                "[[key]]\nname = \"a\"\nkey = \"short-secret\"\n",
                "key[0].key",
            ),
            ("[[key]]\nname = \"a\"\n", "exactly one"),
            (
                "[[key]]\nname = \"a b\"\nkey = \"0123456789abcdef\"\n",
                "key[0].name",
            ),
            ("[[key]]\nname = \"a\"\nsha256 = \"xyz\"\n", "key[0].sha256"),
            (
                "[[key]]\nname = \"a\"\nkey = \"0123456789abcdef\"\n[[key]]\nname = \"a\"\nkey = \"0123456789abcdeg\"\n",
                "used twice",
            ),
            (
                "[[key]]\nname = \"a\"\nkey = \"0123456789abcdef\"\n[[key]]\nname = \"b\"\nkey = \"0123456789abcdef\"\n",
                "same key",
            ),
            (
                "[[key]]\nname = \"a\"\nkey = \"0123456789abcdef\"\nsecret = \"s3cret-quoted\"\n",
                "not a keys file",
            ),
        ] {
            let e = parse(text).unwrap_err();
            assert!(e.contains(want), "{text}: {e}");
            assert!(
                !e.contains("0123456789abcdef") && !e.contains("s3cret"),
                "{e}"
            );
        }
    }
}
