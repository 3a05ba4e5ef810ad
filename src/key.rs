//! Keys: the typed value a request asks for.
//!
//! A key arrives as one raw (still percent-encoded) path segment, or one
//! segment per column of a composite key, and is parsed for its resource's
//! [`KeyType`]s before anything else happens. A key that does not parse
//! cannot exist in the table, so it is answered 400 without touching the
//! filter, the cache or the database.
//!
//! # A composite key's one encoding
//!
//! The filter holds a composite key ([`Key::Tuple`]) as one byte string:
//! per part, in key column order, a tag naming its type and its value,
//! `i` + 8 bytes big-endian for `bigint`, `u` + 16 bytes for `uuid`, `t` +
//! a 32-bit big-endian length + the UTF-8 bytes for `text`. Every part's
//! length is known from its tag (and length) before its bytes, so the
//! encoding is injective: two different tuples never share bytes (`("1",
//! "23")` and `("12", "3")` differ in their lengths), and a filter never
//! mistakes one tenant's key for another's. The scan
//! ([`encode_part`] on COPY bytes) and a request ([`Key::tuple`] on parsed
//! parts) build it by the same function; `encodings_are_injective` and
//! `column_bytes_match_parsed_tuples` test both properties.

pub mod compare;

use std::fmt;
use std::sync::Arc;

use uuid::Uuid;

use crate::cache::KeyHeap;
use crate::filter::{Item, KeyKind};

pub use crate::config::KeyType;

impl KeyType {
    /// The kind of filter item its keys become (see [`Key::item`]).
    pub fn kind(self) -> KeyKind {
        match self {
            KeyType::Bigint => KeyKind::Int,
            KeyType::Uuid | KeyType::Text => KeyKind::Bytes,
        }
    }

    /// Whether a key column of base type `column` (domains resolved, see
    /// `db::catalog`) can serve this key type: the filter scan, the
    /// triggers and a request must all arrive at the same key for every
    /// value it holds (its `::text` is the key's canonical text).
    pub fn accepts(self, column: ColumnType) -> bool {
        use ColumnType as C;
        match self {
            KeyType::Bigint => matches!(column, C::Int2 | C::Int4 | C::Int8),
            KeyType::Uuid => column == C::Uuid,
            KeyType::Text => matches!(column, C::Text | C::Varchar | C::Bpchar | C::Citext),
        }
    }

    /// What [`accepts`](Self::accepts) accepts, for error messages.
    pub fn accepted(self) -> &'static str {
        match self {
            KeyType::Bigint => "smallint, integer, bigint",
            KeyType::Uuid => "uuid",
            KeyType::Text => "text, varchar, char(n), citext",
        }
    }

    /// The SQL type the key parameter is cast to in queries.
    pub fn sql_type(self) -> &'static str {
        match self {
            KeyType::Bigint => "bigint",
            KeyType::Uuid => "uuid",
            KeyType::Text => "text",
        }
    }
}

/// A parsed key. Cheap to clone: text and tuples are shared.
#[derive(Clone, PartialEq, Eq, Hash)]
pub enum Key {
    Int(i64),
    Uuid(Uuid),
    Text(Arc<str>),
    /// A composite key: its parts (each one of the above) in key column
    /// order.
    Tuple(Arc<Tuple>),
}

/// A composite key's parts and their encoding (see the module doc).
#[derive(PartialEq, Eq, Hash)]
pub struct Tuple {
    parts: Box<[Key]>,
    encoded: Box<[u8]>,
}

impl Tuple {
    pub fn parts(&self) -> &[Key] {
        &self.parts
    }
}

impl Key {
    /// A composite key of `parts` (none of them a tuple).
    pub fn tuple(parts: Vec<Key>) -> Key {
        let mut encoded = Vec::with_capacity(parts.len() * 12);
        for p in &parts {
            let ty = match p {
                Key::Int(_) => KeyType::Bigint,
                Key::Uuid(_) => KeyType::Uuid,
                Key::Text(_) | Key::Tuple(_) => KeyType::Text,
            };
            encode_part(&mut encoded, ty, p.item());
        }
        Key::Tuple(Arc::new(Tuple {
            parts: parts.into_boxed_slice(),
            encoded: encoded.into_boxed_slice(),
        }))
    }

    /// The bytes the membership filter stores for this key. They must match
    /// what [`item_from_column`] (and [`encode_part`], for a tuple) yields
    /// for the same value streamed out of Postgres, or the filter would
    /// report false negatives.
    pub fn item(&self) -> Item<'_> {
        match self {
            Key::Int(v) => Item::Int(*v),
            Key::Uuid(u) => Item::Bytes(u.as_bytes()),
            Key::Text(s) => Item::Bytes(s.as_bytes()),
            Key::Tuple(t) => Item::Bytes(&t.encoded),
        }
    }

    /// Each part as Postgres prints it (`::text`; the inverse of
    /// [`from_db_text`]), in order: a composite key's bound parameter.
    pub fn db_texts(&self) -> Vec<String> {
        match self {
            Key::Int(v) => vec![v.to_string()],
            Key::Uuid(u) => vec![u.to_string()],
            Key::Text(s) => vec![s.to_string()],
            Key::Tuple(t) => t.parts.iter().flat_map(Key::db_texts).collect(),
        }
    }
}

/// Appends one part of a composite key, of type `ty` and filter item
/// `item`, to `out` (see the module doc).
pub fn encode_part(out: &mut Vec<u8>, ty: KeyType, item: Item<'_>) {
    match (ty, item) {
        (_, Item::Int(v)) => {
            out.push(b'i');
            out.extend_from_slice(&v.to_be_bytes());
        }
        (KeyType::Uuid, Item::Bytes(b)) => {
            out.push(b'u');
            out.extend_from_slice(b);
        }
        (_, Item::Bytes(b)) => {
            out.push(b't');
            out.extend_from_slice(&(b.len() as u32).to_be_bytes());
            out.extend_from_slice(b);
        }
    }
}

impl KeyHeap for Key {
    /// A text key's `Arc<str>` block: its two counts and its bytes; a
    /// tuple's block, its parts and its encoding.
    fn heap_bytes(&self) -> usize {
        match self {
            Key::Int(_) | Key::Uuid(_) => 0,
            Key::Text(s) => 16 + s.len(),
            Key::Tuple(t) => {
                16 + std::mem::size_of::<Tuple>()
                    + t.parts.len() * std::mem::size_of::<Key>()
                    + t.parts.iter().map(KeyHeap::heap_bytes).sum::<usize>()
                    + t.encoded.len()
            }
        }
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Key::Int(v) => write!(f, "{v}"),
            Key::Uuid(u) => write!(f, "{u}"),
            Key::Text(s) => write!(f, "{s:?}"),
            Key::Tuple(t) => {
                f.write_str("(")?;
                for (i, p) in t.parts.iter().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    fmt::Display::fmt(p, f)?;
                }
                f.write_str(")")
            }
        }
    }
}

/// Converts one column value in Postgres' binary COPY format into the item
/// the filter stores. Returns `None` for a value that cannot be a valid key of
/// this type (wrong width, invalid UTF-8); such a value could never be asked
/// for either, because [`parse`] would reject it.
pub fn item_from_column(ty: KeyType, raw: &[u8]) -> Option<Item<'_>> {
    match ty {
        KeyType::Bigint => match raw.len() {
            8 => Some(Item::Int(i64::from_be_bytes(raw.try_into().ok()?))),
            4 => Some(Item::Int(i32::from_be_bytes(raw.try_into().ok()?).into())),
            2 => Some(Item::Int(i16::from_be_bytes(raw.try_into().ok()?).into())),
            _ => None,
        },
        KeyType::Uuid => (raw.len() == 16).then_some(Item::Bytes(raw)),
        KeyType::Text => std::str::from_utf8(raw).ok().map(|_| Item::Bytes(raw)),
    }
}

/// Parses a key as Postgres prints it (`::text`), as notifications carry
/// it: no percent-decoding, no length limit (the row exists whatever its
/// length). `None` if it does not fit the type.
pub fn from_db_text(text: &str, ty: KeyType) -> Option<Key> {
    match ty {
        KeyType::Bigint => text.parse().ok().map(Key::Int),
        KeyType::Uuid => Uuid::try_parse(text).ok().map(Key::Uuid),
        KeyType::Text => Some(Key::Text(Arc::from(text))),
    }
}

/// Why a key was refused. The message is safe to show to a client.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("key is empty")]
    Empty,
    #[error("key is longer than {max} bytes")]
    TooLong { max: usize },
    #[error("key has invalid percent-encoding")]
    BadPercentEncoding,
    #[error("key is not valid UTF-8")]
    NotUtf8,
    #[error("key contains control characters")]
    ControlCharacter,
    #[error("key is not an integer")]
    NotAnInteger,
    #[error("key is out of range for a 64-bit integer")]
    OutOfRange,
    #[error("key is not a valid UUID")]
    NotAUuid,
    /// One part of a composite key, named by its column.
    #[error("key part {column}: {error}")]
    Part {
        column: Arc<str>,
        error: Box<KeyError>,
    },
    #[error("key has {got} parts; this resource's key has {want}")]
    Parts { got: usize, want: usize },
}

/// Parses the raw segments of a composite key, one per column of `parts`
/// (column name, type) in order; each as [`parse`] does, `max_len` bounding
/// each. A part that fails is named in the error.
pub fn parse_parts(
    raw: &[&str],
    parts: &[(Arc<str>, KeyType)],
    max_len: usize,
) -> Result<Key, KeyError> {
    if raw.len() != parts.len() {
        return Err(KeyError::Parts {
            got: raw.len(),
            want: parts.len(),
        });
    }
    let mut keys = Vec::with_capacity(parts.len());
    for (raw, (column, ty)) in raw.iter().zip(parts) {
        keys.push(parse(raw, *ty, max_len).map_err(|e| KeyError::Part {
            column: column.clone(),
            error: Box::new(e),
        })?);
    }
    Ok(Key::tuple(keys))
}

/// Parses one raw path segment as a key of type `ty`.
///
/// `max_len` bounds the decoded key in bytes; it is checked on the raw segment
/// first (a percent-escape decodes to one byte from three) so an overlong
/// segment is refused before any decoding work.
pub fn parse(raw: &str, ty: KeyType, max_len: usize) -> Result<Key, KeyError> {
    if raw.is_empty() {
        return Err(KeyError::Empty);
    }
    if raw.len() > max_len.saturating_mul(3) {
        return Err(KeyError::TooLong { max: max_len });
    }
    let decoded = percent_decode_strict(raw)?;
    if decoded.len() > max_len {
        return Err(KeyError::TooLong { max: max_len });
    }
    let text = std::str::from_utf8(&decoded).map_err(|_| KeyError::NotUtf8)?;
    if text.chars().any(char::is_control) {
        return Err(KeyError::ControlCharacter);
    }
    match ty {
        KeyType::Bigint => parse_int(text).map(Key::Int),
        KeyType::Uuid => parse_uuid(text).map(Key::Uuid),
        KeyType::Text => Ok(Key::Text(Arc::from(text))),
    }
}

fn parse_int(s: &str) -> Result<i64, KeyError> {
    let digits = s.strip_prefix('-').unwrap_or(s);
    // `i64::from_str` also takes a leading '+'; a key is a plain decimal.
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(KeyError::NotAnInteger);
    }
    s.parse::<i64>().map_err(|_| KeyError::OutOfRange)
}

fn parse_uuid(s: &str) -> Result<Uuid, KeyError> {
    // Only the two forms people put in URLs: hyphenated and 32 hex digits.
    if s.len() != 36 && s.len() != 32 {
        return Err(KeyError::NotAUuid);
    }
    Uuid::try_parse(s).map_err(|_| KeyError::NotAUuid)
}

/// Percent-decoding that refuses a `%` not followed by two hex digits,
/// rather than passing it through as the lenient decoders do.
fn percent_decode_strict(raw: &str) -> Result<std::borrow::Cow<'_, [u8]>, KeyError> {
    let bytes = raw.as_bytes();
    if !bytes.contains(&b'%') {
        return Ok(std::borrow::Cow::Borrowed(bytes));
    }
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hi = bytes.get(i + 1).and_then(|b| (*b as char).to_digit(16));
            let lo = bytes.get(i + 2).and_then(|b| (*b as char).to_digit(16));
            match (hi, lo) {
                (Some(hi), Some(lo)) => out.push((hi * 16 + lo) as u8),
                _ => return Err(KeyError::BadPercentEncoding),
            }
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    Ok(std::borrow::Cow::Owned(out))
}

/// The base type of a key column, after resolving domains: it decides which
/// key types fit and the canonical text of its values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ColumnType {
    Int2,
    Int4,
    Int8,
    Uuid,
    Text,
    Varchar,
    /// `char(n)` (`bpchar`): blank-padded; canonical text has the trailing
    /// blanks stripped (what `::text` does, and what `bpchareq` ignores:
    /// see [`compare`]).
    Bpchar,
    /// The `citext` extension type: compared by `lower()`, which
    /// [`compare::Comparison::Lower`] reproduces; the feeds announce its
    /// values as stored, and the applier canonicalises them.
    Citext,
    /// Any other type: not a valid key column type.
    Other,
}

impl ColumnType {
    /// From the base type's name (`pg_type.typname`).
    pub fn from_type_name(name: &str) -> ColumnType {
        match name {
            "int2" => ColumnType::Int2,
            "int4" => ColumnType::Int4,
            "int8" => ColumnType::Int8,
            "uuid" => ColumnType::Uuid,
            "text" => ColumnType::Text,
            "varchar" => ColumnType::Varchar,
            "bpchar" => ColumnType::Bpchar,
            "citext" => ColumnType::Citext,
            _ => ColumnType::Other,
        }
    }
}

/// The canonical text of a value whose source gave `raw` (its type's output
/// function text): the value cast to `text`, which is what the filter scan
/// reads. Only `char(n)` differs: its output keeps the padding, the cast
/// strips trailing blanks.
pub fn canonical_text(ty: ColumnType, raw: &str) -> &str {
    match ty {
        ColumnType::Bpchar => raw.trim_end_matches(' '),
        _ => raw,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_bpchar_text_changes() {
        assert_eq!(canonical_text(ColumnType::Bpchar, "ab  "), "ab");
        assert_eq!(canonical_text(ColumnType::Bpchar, " ab"), " ab");
        assert_eq!(canonical_text(ColumnType::Text, "ab  "), "ab  ");
        assert_eq!(canonical_text(ColumnType::Varchar, "ab "), "ab ");
        assert_eq!(canonical_text(ColumnType::Citext, "Ab "), "Ab ");
    }

    use proptest::prelude::*;

    const MAX: usize = 64;

    #[test]
    fn integers() {
        assert_eq!(parse("42", KeyType::Bigint, MAX), Ok(Key::Int(42)));
        assert_eq!(parse("-7", KeyType::Bigint, MAX), Ok(Key::Int(-7)));
        assert_eq!(
            parse("9223372036854775807", KeyType::Bigint, MAX),
            Ok(Key::Int(i64::MAX))
        );
        for bad in ["abc", "+1", "1.5", "1e3", " 1", "-", "0x10", "١"] {
            assert_eq!(
                parse(bad, KeyType::Bigint, MAX),
                Err(KeyError::NotAnInteger),
                "{bad:?}"
            );
        }
        assert_eq!(
            parse("9223372036854775808", KeyType::Bigint, MAX),
            Err(KeyError::OutOfRange)
        );
    }

    #[test]
    fn uuids() {
        let u = "67e55044-10b1-426f-9247-bb680e5fe0c8";
        let want = Key::Uuid(Uuid::parse_str(u).unwrap());
        assert_eq!(parse(u, KeyType::Uuid, MAX), Ok(want.clone()));
        assert_eq!(
            parse(&u.replace('-', "").to_uppercase(), KeyType::Uuid, MAX),
            Ok(want)
        );
        for bad in ["67e55044", "{67e55044-10b1-426f-9247-bb680e5fe0c8}", "zz"] {
            assert_eq!(parse(bad, KeyType::Uuid, MAX), Err(KeyError::NotAUuid));
        }
    }

    #[test]
    fn encoding_and_limits() {
        assert_eq!(
            parse("a%20b", KeyType::Text, MAX),
            Ok(Key::Text(Arc::from("a b")))
        );
        assert_eq!(
            parse("a%2", KeyType::Text, MAX),
            Err(KeyError::BadPercentEncoding)
        );
        assert_eq!(
            parse("%zz", KeyType::Text, MAX),
            Err(KeyError::BadPercentEncoding)
        );
        assert_eq!(parse("%ff", KeyType::Text, MAX), Err(KeyError::NotUtf8));
        assert_eq!(
            parse("a%00b", KeyType::Text, MAX),
            Err(KeyError::ControlCharacter)
        );
        assert_eq!(
            parse("%0A", KeyType::Bigint, MAX),
            Err(KeyError::ControlCharacter)
        );
        assert_eq!(parse("", KeyType::Text, MAX), Err(KeyError::Empty));
        assert_eq!(
            parse(&"x".repeat(MAX + 1), KeyType::Text, MAX),
            Err(KeyError::TooLong { max: MAX })
        );
        assert_eq!(
            parse(&"%41".repeat(MAX + 1), KeyType::Text, MAX),
            Err(KeyError::TooLong { max: MAX })
        );
        assert!(parse(&"x".repeat(MAX), KeyType::Text, MAX).is_ok());
    }

    #[test]
    fn column_bytes_match_parsed_keys() {
        // The filter is filled from COPY bytes and queried with parsed keys:
        // both sides must produce the same item or every lookup is a miss.
        let k = parse("123456789", KeyType::Bigint, MAX).unwrap();
        let col = 123456789i64.to_be_bytes();
        assert!(same(
            k.item(),
            item_from_column(KeyType::Bigint, &col).unwrap()
        ));
        let col4 = 123456789i32.to_be_bytes();
        assert!(same(
            k.item(),
            item_from_column(KeyType::Bigint, &col4).unwrap()
        ));
        let u = Uuid::new_v4();
        let k = parse(&u.to_string(), KeyType::Uuid, MAX).unwrap();
        assert!(same(
            k.item(),
            item_from_column(KeyType::Uuid, u.as_bytes()).unwrap()
        ));
        assert!(item_from_column(KeyType::Uuid, &[0; 15]).is_none());
        assert!(item_from_column(KeyType::Text, &[0xff]).is_none());
    }

    #[test]
    fn database_text_is_taken_literally() {
        assert_eq!(from_db_text("-5", KeyType::Bigint), Some(Key::Int(-5)));
        assert_eq!(from_db_text("x", KeyType::Bigint), None);
        assert_eq!(
            from_db_text("a%20b", KeyType::Text),
            Some(Key::Text(Arc::from("a%20b")))
        );
        let u = Uuid::new_v4();
        assert_eq!(
            from_db_text(&u.to_string(), KeyType::Uuid),
            Some(Key::Uuid(u))
        );
    }

    fn same(a: Item<'_>, b: Item<'_>) -> bool {
        match (a, b) {
            (Item::Int(x), Item::Int(y)) => x == y,
            (Item::Bytes(x), Item::Bytes(y)) => x == y,
            _ => false,
        }
    }

    fn parts() -> Vec<(Arc<str>, KeyType)> {
        vec![
            (Arc::from("tenant_id"), KeyType::Bigint),
            (Arc::from("order_no"), KeyType::Text),
        ]
    }

    #[test]
    fn composite_keys_parse_part_by_part_and_name_the_part_that_fails() {
        let k = parse_parts(&["7", "A%2F12"], &parts(), MAX).unwrap();
        assert_eq!(
            k,
            Key::tuple(vec![Key::Int(7), Key::Text(Arc::from("A/12"))])
        );
        assert_eq!(k.to_string(), r#"(7, "A/12")"#);
        assert_eq!(k.db_texts(), ["7", "A/12"]);
        let e = parse_parts(&["x", "A"], &parts(), MAX).unwrap_err();
        assert_eq!(e.to_string(), "key part tenant_id: key is not an integer");
        let e = parse_parts(&["7", ""], &parts(), MAX).unwrap_err();
        assert_eq!(e.to_string(), "key part order_no: key is empty");
        assert!(matches!(
            parse_parts(&["7"], &parts(), MAX),
            Err(KeyError::Parts { got: 1, want: 2 })
        ));
    }

    #[test]
    fn column_bytes_match_parsed_tuples() {
        // The scan encodes COPY bytes part by part; a request encodes its
        // parsed parts: the same tuple must give the same bytes.
        let u = Uuid::new_v4();
        let k = Key::tuple(vec![
            Key::Int(-3),
            Key::Uuid(u),
            Key::Text(Arc::from("é x")),
        ]);
        let mut scanned = Vec::new();
        let int4 = (-3i32).to_be_bytes();
        for (ty, raw) in [
            (KeyType::Bigint, &int4[..]),
            (KeyType::Uuid, u.as_bytes()),
            (KeyType::Text, "é x".as_bytes()),
        ] {
            encode_part(&mut scanned, ty, item_from_column(ty, raw).unwrap());
        }
        assert!(same(k.item(), Item::Bytes(&scanned)));
    }

    fn any_part() -> impl Strategy<Value = Key> {
        prop_oneof![
            any::<i64>().prop_map(Key::Int),
            any::<u128>().prop_map(|v| Key::Uuid(Uuid::from_u128(v))),
            "[0-9a-z/]{0,6}".prop_map(|s| Key::Text(Arc::from(s.as_str()))),
        ]
    }

    proptest! {
        /// Different tuples never share an encoding, whatever their types
        /// and lengths: `("1", "23")` is not `("12", "3")`, a text part
        /// that spells an integer's bytes is not that integer.
        #[test]
        fn encodings_are_injective(
            a in proptest::collection::vec(any_part(), 1..4),
            b in proptest::collection::vec(any_part(), 1..4),
        ) {
            let (ka, kb) = (Key::tuple(a.clone()), Key::tuple(b.clone()));
            let bytes = |k: &Key| match k.item() {
                Item::Bytes(b) => b.to_vec(),
                Item::Int(_) => unreachable!(),
            };
            prop_assert_eq!(a == b, bytes(&ka) == bytes(&kb));
        }

        #[test]
        fn split_texts_differ(x in "[0-9]{1,5}", y in "[0-9]{1,5}", cut in 1usize..5) {
            let joined = format!("{x}{y}");
            let cut = cut.min(joined.len() - 1).max(1);
            let (l, r) = joined.split_at(cut);
            let t = |a: &str, b: &str| Key::tuple(vec![Key::Text(Arc::from(a)), Key::Text(Arc::from(b))]);
            prop_assert_eq!(t(&x, &y) == t(l, r), x == l);
        }

        #[test]
        fn any_i64_round_trips(v: i64) {
            prop_assert_eq!(parse(&v.to_string(), KeyType::Bigint, MAX), Ok(Key::Int(v)));
        }

        #[test]
        fn encoded_text_round_trips(s in "[^\\p{Cc}]{1,20}") {
            let enc = percent_encoding::utf8_percent_encode(&s, percent_encoding::NON_ALPHANUMERIC).to_string();
            prop_assert_eq!(parse(&enc, KeyType::Text, 256), Ok(Key::Text(Arc::from(s.as_str()))));
        }

        #[test]
        fn never_panics(s in "\\PC{0,80}", ty in prop_oneof![Just(KeyType::Bigint), Just(KeyType::Uuid), Just(KeyType::Text)]) {
            let _ = parse(&s, ty, MAX);
        }
    }
}
