//! Fuzzes `bloomgate::key`: `parse` (one raw path segment), `from_db_text`
//! and `item_from_column`.
//!
//! Input: byte 0 picks `max_len`; the rest (lossily UTF-8) is the raw
//! segment, parsed as each of the three key types. Besides "never panics",
//! every result is checked against an independent reference parser written
//! here (own percent-decoder, own integer and UUID grammar), and every
//! successful parse must round-trip through its canonical text form and
//! agree with the item the filter is built from.
#![no_main]

use std::sync::Arc;

use bloomgate::filter::Item;
use bloomgate::key::{self, Key, KeyError, KeyType};
use libfuzzer_sys::fuzz_target;
use uuid::Uuid;

const MAX_LENS: [usize; 8] = [1, 4, 19, 20, 32, 36, 256, usize::MAX];
const TYPES: [KeyType; 3] = [KeyType::Bigint, KeyType::Uuid, KeyType::Text];

fuzz_target!(|data: &[u8]| {
    let Some((&sel, rest)) = data.split_first() else {
        return;
    };
    let max_len = MAX_LENS[usize::from(sel % 8)];
    let raw = String::from_utf8_lossy(rest);

    for ty in TYPES {
        let got = key::parse(&raw, ty, max_len);
        let want = reference(&raw, ty, max_len);
        assert_eq!(
            got, want,
            "parse({raw:?}, {ty:?}, {max_len}) disagrees with the reference"
        );
        // The error message is shown to clients: it must render.
        if let Err(e) = &got {
            let _ = e.to_string();
        }
        if let Ok(k) = &got {
            check_key(k, ty, max_len);
        }
        // Text as Postgres prints it: taken literally, never panics.
        if let Some(k) = key::from_db_text(&raw, ty) {
            match (&k, ty) {
                (Key::Int(v), KeyType::Bigint) => assert_eq!(raw.parse::<i64>().ok(), Some(*v)),
                (Key::Uuid(_), KeyType::Uuid) => {}
                (Key::Text(s), KeyType::Text) => assert_eq!(&**s, &*raw),
                _ => panic!("from_db_text({raw:?}, {ty:?}) gave a key of another type: {k:?}"),
            }
        }
        // Column bytes straight from COPY: never panics, right widths only.
        match key::item_from_column(ty, rest) {
            None => match ty {
                KeyType::Bigint => assert!(![2, 4, 8].contains(&rest.len())),
                KeyType::Uuid => assert_ne!(rest.len(), 16),
                KeyType::Text => assert!(std::str::from_utf8(rest).is_err()),
            },
            Some(Item::Int(v)) => {
                assert_eq!(ty, KeyType::Bigint);
                let sign_extended = match rest.len() {
                    8 => i64::from_be_bytes(rest.try_into().unwrap()),
                    4 => i32::from_be_bytes(rest.try_into().unwrap()).into(),
                    2 => i16::from_be_bytes(rest.try_into().unwrap()).into(),
                    n => panic!("Int item from a {n}-byte column"),
                };
                assert_eq!(v, sign_extended);
            }
            Some(Item::Bytes(b)) => {
                assert_ne!(ty, KeyType::Bigint);
                assert_eq!(b, rest);
            }
        }
    }
});

/// Invariants of a successfully parsed key.
fn check_key(k: &Key, ty: KeyType, max_len: usize) {
    match (k, ty) {
        (Key::Int(v), KeyType::Bigint) => {
            // The canonical decimal form is never longer than the accepted
            // input, so it must parse back to the same key.
            let text = v.to_string();
            assert_eq!(key::parse(&text, ty, max_len), Ok(k.clone()), "{text}");
            assert_eq!(key::from_db_text(&text, ty), Some(k.clone()));
            same_item(k.item(), key::item_from_column(ty, &v.to_be_bytes()));
            if let Ok(small) = i32::try_from(*v) {
                same_item(k.item(), key::item_from_column(ty, &small.to_be_bytes()));
            }
        }
        (Key::Uuid(u), KeyType::Uuid) => {
            for text in [u.hyphenated().to_string(), u.simple().to_string()] {
                if text.len() <= max_len {
                    assert_eq!(key::parse(&text, ty, max_len), Ok(k.clone()), "{text}");
                }
                assert_eq!(key::from_db_text(&text, ty), Some(k.clone()));
            }
            same_item(k.item(), key::item_from_column(ty, u.as_bytes()));
        }
        (Key::Text(s), KeyType::Text) => {
            assert!(!s.is_empty());
            assert!(s.len() <= max_len, "{} bytes > max {max_len}", s.len());
            assert!(
                !s.chars().any(char::is_control),
                "control character in {s:?}"
            );
            // Fully percent-encoded, it is the same key (3 bytes per byte
            // at most, within the raw limit).
            let enc = percent_encoding::utf8_percent_encode(s, percent_encoding::NON_ALPHANUMERIC)
                .to_string();
            assert_eq!(key::parse(&enc, ty, max_len), Ok(k.clone()), "{enc}");
            assert_eq!(key::from_db_text(s, ty), Some(k.clone()));
            same_item(k.item(), key::item_from_column(ty, s.as_bytes()));
        }
        _ => panic!("parse as {ty:?} gave a key of another type: {k:?}"),
    }
    let _ = format!("{k} {k:?}");
}

/// The filter is filled from column bytes and queried with parsed keys:
/// both must be the same item, or every lookup is a false negative.
fn same_item(a: Item<'_>, b: Option<Item<'_>>) {
    match (a, b) {
        (Item::Int(x), Some(Item::Int(y))) => assert_eq!(x, y),
        (Item::Bytes(x), Some(Item::Bytes(y))) => assert_eq!(x, y),
        (a, b) => panic!("parsed key item {a:?} != column item {b:?}"),
    }
}

// ---- reference parser: the documented rules, written independently ----

fn reference(raw: &str, ty: KeyType, max: usize) -> Result<Key, KeyError> {
    if raw.is_empty() {
        return Err(KeyError::Empty);
    }
    if raw.len() / 3 > max || (raw.len() / 3 == max && raw.len() % 3 != 0) {
        return Err(KeyError::TooLong { max });
    }
    let mut bytes = Vec::new();
    let mut it = raw.bytes();
    while let Some(b) = it.next() {
        if b == b'%' {
            let hi = it.next().and_then(hex);
            let lo = it.next().and_then(hex);
            match (hi, lo) {
                (Some(h), Some(l)) => bytes.push(h << 4 | l),
                _ => return Err(KeyError::BadPercentEncoding),
            }
        } else {
            bytes.push(b);
        }
    }
    if bytes.len() > max {
        return Err(KeyError::TooLong { max });
    }
    let text = String::from_utf8(bytes).map_err(|_| KeyError::NotUtf8)?;
    if text.chars().any(|c| c.is_control()) {
        return Err(KeyError::ControlCharacter);
    }
    match ty {
        KeyType::Text => Ok(Key::Text(Arc::from(text))),
        KeyType::Bigint => {
            let (neg, digits) = match text.strip_prefix('-') {
                Some(d) => (true, d),
                None => (false, &text[..]),
            };
            if digits.is_empty() || digits.bytes().any(|b| !b.is_ascii_digit()) {
                return Err(KeyError::NotAnInteger);
            }
            // Accumulate negatively so i64::MIN fits.
            let mut v: i64 = 0;
            for d in digits.bytes() {
                v = v
                    .checked_mul(10)
                    .and_then(|v| v.checked_sub(i64::from(d - b'0')))
                    .ok_or(KeyError::OutOfRange)?;
            }
            if neg {
                Ok(Key::Int(v))
            } else {
                v.checked_neg().map(Key::Int).ok_or(KeyError::OutOfRange)
            }
        }
        KeyType::Uuid => {
            let b = text.as_bytes();
            let hexdigits: Vec<u8> = match b.len() {
                32 => b.to_vec(),
                36 if [8, 13, 18, 23].iter().all(|&i| b[i] == b'-') => b
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| ![8, 13, 18, 23].contains(i))
                    .map(|(_, c)| *c)
                    .collect(),
                _ => return Err(KeyError::NotAUuid),
            };
            let mut out = [0u8; 16];
            for (i, pair) in hexdigits.chunks_exact(2).enumerate() {
                match (hex(pair[0]), hex(pair[1])) {
                    (Some(h), Some(l)) => out[i] = h << 4 | l,
                    _ => return Err(KeyError::NotAUuid),
                }
            }
            Ok(Key::Uuid(Uuid::from_bytes(out)))
        }
    }
}

fn hex(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}
