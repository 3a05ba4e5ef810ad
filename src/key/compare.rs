//! How Postgres compares a key column's values, reproduced exactly: the
//! rule is that **two requests Postgres answers with the same row get the
//! same answer** — from the filter, the cache (an entry loaded under one
//! spelling is invalidated by a change announced under another), the
//! negative cache and the owner check. Each key is brought to one
//! canonical text per class of values Postgres holds equal, by
//! [`Comparison::text`]: the request's key (`Resource::parse_key`), the
//! scan's values (`resource::build`), the feeds' announced keys
//! (`apply`), and owner claims (`auth`). The row query then compares the
//! canonical key as the column's own type (`col = $1::citext`), which
//! finds exactly the rows equal to the key as asked, because each
//! canonicalisation below is idempotent and keeps a value's class.
//!
//! Per column type (the base type, domains resolved; see `db::catalog`):
//! - `smallint`, `integer`, `bigint`, `uuid`: compared by value, and a key
//!   is parsed into its value (`key::parse`), so every accepted spelling
//!   (`007`, upper-case or unhyphenated UUIDs) is one key already.
//! - `text`, `varchar` under a deterministic collation: Postgres' equality
//!   is byte equality (a deterministic collation breaks every tie by the
//!   bytes: `texteq` is `memcmp`), so bytes are right, and so is keeping
//!   Unicode normalization forms apart (Postgres does not normalize: `é`
//!   and `e` + U+0301 are two rows).
//! - `char(n)` ([`Comparison::Blank`]): `bpchareq` ignores trailing
//!   spaces (U+0020 only), so the canonical text drops them, as `::text`
//!   does for the scan and the triggers.
//! - `citext` ([`Comparison::Lower`]): `citext_eq` is
//!   `strcmp(lower(a), lower(b))`, `lower()` under the column's collation.
//!   The canonical text is that `lower()`, reproduced from a table the
//!   database itself made at start-up: every code point whose `lower()`
//!   differs from it, with its image (`db::catalog::lowering`). That is
//!   exact when `lower()` maps each code point on its own, which holds
//!   for the providers accepted: libc (`towlower` per wide character in a
//!   UTF-8 database, ASCII only under `C`/`POSIX`) and the builtin
//!   provider's `C` and `C.UTF-8` (simple case mapping). ICU and the
//!   builtin `PG_UNICODE_FAST` map some characters by their context (the
//!   final sigma: `lower('ΑΣ')` is `ας`, `lower('Σ')` is `σ`) and
//!   per-locale rules (Turkish, Lithuanian): a citext key column under
//!   them is refused at start-up, naming it. The table is also checked
//!   against the database on strings where context matters, and for
//!   idempotence (`lower(lower(x)) = lower(x)`, which the row query's
//!   use of the canonical key relies on); either failing refuses too.
//! - A non-deterministic collation on any key or owner column: equality
//!   is the collation's (accents, case, ignorable code points), which no
//!   byte rule can reproduce: refused at start-up, naming the column.
//!
//! Guarantees, tested below: [`Comparison::text`] is idempotent, maps a
//! text to itself under `Bytes`, drops exactly the trailing spaces under
//! `Blank`, and under `Lower` applies the table code point by code point.
//! That it agrees with Postgres is tested against Postgres itself
//! (`tests/it/key/types.rs`: random spellings of every key type, the
//! gateway's answer against `SELECT … WHERE col = '<spelling>'`).

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Arc;

use super::Key;

/// How a column's values compare (see the module doc).
#[derive(Clone, Debug, Default)]
pub enum Comparison {
    /// By bytes (or by value, for the typed keys).
    #[default]
    Bytes,
    /// `char(n)`: trailing spaces do not count.
    Blank,
    /// `citext`: by `lower()` under the column's collation.
    Lower(Arc<Lowering>),
}

impl Comparison {
    /// The canonical text of `s`: equal for exactly the texts Postgres
    /// holds equal in this column.
    pub fn text<'a>(&self, s: &'a str) -> Cow<'a, str> {
        match self {
            Comparison::Bytes => Cow::Borrowed(s),
            Comparison::Blank => Cow::Borrowed(s.trim_end_matches(' ')),
            Comparison::Lower(l) => l.lower(s),
        }
    }

    /// [`text`](Self::text) of a text key; other keys as they are.
    pub fn key(&self, key: Key) -> Key {
        let Key::Text(t) = &key else {
            return key;
        };
        match self.text(t) {
            Cow::Borrowed(b) if b.len() == t.len() => key,
            Cow::Borrowed(b) => Key::Text(Arc::from(b)),
            Cow::Owned(o) => Key::Text(Arc::from(o)),
        }
    }

    /// [`text`](Self::text) of a value as the scan streams it (UTF-8
    /// bytes; anything else is passed through for `item_from_column` to
    /// refuse).
    pub fn bytes<'a>(&self, raw: &'a [u8]) -> Cow<'a, [u8]> {
        if matches!(self, Comparison::Bytes) {
            return Cow::Borrowed(raw);
        }
        match std::str::from_utf8(raw) {
            Ok(s) => match self.text(s) {
                Cow::Borrowed(b) => Cow::Borrowed(b.as_bytes()),
                Cow::Owned(o) => Cow::Owned(o.into_bytes()),
            },
            Err(_) => Cow::Borrowed(raw),
        }
    }

    /// What it is, for the admin API and messages.
    pub fn describe(&self) -> String {
        match self {
            Comparison::Bytes => "bytes".into(),
            Comparison::Blank => "trailing spaces ignored (char(n))".into(),
            Comparison::Lower(l) => format!("lower() under collation {}", l.collation),
        }
    }
}

/// A database's `lower()`, code point by code point.
pub struct Lowering {
    /// The image of every ASCII character.
    ascii: [u8; 128],
    /// Every other code point `lower()` changes, with its image.
    other: HashMap<char, Box<str>>,
    /// The collation it was read under, for messages.
    pub collation: String,
}

impl std::fmt::Debug for Lowering {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lowering")
            .field("collation", &self.collation)
            .field("mapped", &(self.other.len()))
            .finish_non_exhaustive()
    }
}

impl Lowering {
    /// From every code point `lower()` changes and its image. `Err` says
    /// why the table cannot be used: an image that `lower()` would change
    /// again (not idempotent), or an ASCII character lowered to more or
    /// other than one ASCII character.
    pub fn new(
        pairs: impl IntoIterator<Item = (char, String)>,
        collation: &str,
    ) -> Result<Self, String> {
        let mut ascii: [u8; 128] = std::array::from_fn(|i| i as u8);
        let mut other = HashMap::new();
        for (c, image) in pairs {
            if image.chars().eq(std::iter::once(c)) {
                continue;
            }
            if c.is_ascii() {
                match image.as_bytes() {
                    [b] if b.is_ascii() => ascii[c as usize] = *b,
                    _ => {
                        return Err(format!(
                            "lower() maps the ASCII character {c:?} to {image:?}"
                        ));
                    }
                }
            } else {
                other.insert(c, image.into_boxed_str());
            }
        }
        let table = Self {
            ascii,
            other,
            collation: collation.to_string(),
        };
        for (c, image) in table.pairs() {
            if *table.lower(&image) != *image {
                return Err(format!(
                    "lower() is not idempotent: {c:?} becomes {image:?}, which becomes {:?}",
                    table.lower(&image)
                ));
            }
        }
        Ok(table)
    }

    /// ASCII only (the `C` and `POSIX` ctype).
    pub fn ascii() -> Self {
        Self::new(
            ('A'..='Z').map(|c| (c, c.to_ascii_lowercase().to_string())),
            "C",
        )
        .expect("ASCII lowering is idempotent")
    }

    /// Every code point the table changes, with its image.
    fn pairs(&self) -> impl Iterator<Item = (char, String)> + '_ {
        (0u8..128)
            .filter(|&b| self.ascii[b as usize] != b)
            .map(|b| (b as char, (self.ascii[b as usize] as char).to_string()))
            .chain(self.other.iter().map(|(c, s)| (*c, s.to_string())))
    }

    fn image(&self, c: char) -> Option<&str> {
        if c.is_ascii() {
            let b = self.ascii[c as usize];
            return (b != c as u8).then(|| {
                // A one-byte ASCII string, from the table itself.
                std::str::from_utf8(std::slice::from_ref(&self.ascii[c as usize]))
                    .expect("ASCII is UTF-8")
            });
        }
        if self.other.is_empty() {
            return None;
        }
        self.other.get(&c).map(|s| &**s)
    }

    /// `lower(s)` as the database computes it.
    pub fn lower<'a>(&self, s: &'a str) -> Cow<'a, str> {
        let Some((first, _)) = s.char_indices().find(|&(_, c)| self.image(c).is_some()) else {
            return Cow::Borrowed(s);
        };
        let mut out = String::with_capacity(s.len() + 4);
        out.push_str(&s[..first]);
        for c in s[first..].chars() {
            match self.image(c) {
                Some(image) => out.push_str(image),
                None => out.push(c),
            }
        }
        Cow::Owned(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn unicode_like() -> Lowering {
        // A few of what a UTF-8 libc locale maps, Kelvin sign and dotted
        // capital I included (towlower maps each to one code point).
        Lowering::new(
            ('A'..='Z')
                .map(|c| (c, c.to_ascii_lowercase().to_string()))
                .chain([
                    ('À', "à".to_string()),
                    ('Σ', "σ".to_string()),
                    ('\u{212A}', "k".to_string()),
                    ('\u{0130}', "i".to_string()),
                    ('\u{023A}', "\u{2C65}".to_string()),
                ]),
            "C.UTF-8",
        )
        .unwrap()
    }

    #[test]
    fn each_rule_gives_its_canonical_text() {
        assert_eq!(Comparison::Bytes.text("Ab  "), "Ab  ");
        assert_eq!(Comparison::Blank.text("Ab  "), "Ab");
        assert_eq!(Comparison::Blank.text("  Ab\t "), "  Ab\t");
        assert_eq!(Comparison::Blank.text("   "), "");
        let lower = Comparison::Lower(Arc::new(unicode_like()));
        assert_eq!(lower.text("ÀLICE \u{212A}"), "àlice k");
        assert_eq!(
            lower.text("\u{023A}x"),
            "\u{2C65}x",
            "an image may be longer"
        );
        assert!(matches!(lower.text("already lower"), Cow::Borrowed(_)));
        let ascii = Comparison::Lower(Arc::new(Lowering::ascii()));
        assert_eq!(
            ascii.text("ÀLICE"),
            "Àlice",
            "the C ctype lowers ASCII only"
        );
        assert_eq!(
            lower.key(Key::Text(Arc::from("AB"))),
            Key::Text(Arc::from("ab"))
        );
        assert_eq!(lower.key(Key::Int(3)), Key::Int(3));
        assert_eq!(&*Comparison::Blank.bytes(b"ab  "), b"ab");
        assert_eq!(&*lower.bytes(b"AB"), b"ab");
        assert_eq!(&*lower.bytes(&[0xff, b'A']), &[0xff, b'A']);
    }

    #[test]
    fn tables_that_cannot_be_reproduced_are_refused() {
        let chained = Lowering::new([('A', "B".to_string()), ('B', "b".to_string())], "x");
        assert!(chained.unwrap_err().contains("idempotent"));
        let wide = Lowering::new([('A', "ab".to_string())], "x");
        assert!(wide.unwrap_err().contains("ASCII"));
    }

    proptest! {
        /// Idempotent, and code point by code point.
        #[test]
        fn canonical_text_is_idempotent_and_per_code_point(s in "\\PC{0,24}") {
            let lowering = unicode_like();
            for cmp in [Comparison::Bytes, Comparison::Blank, Comparison::Lower(Arc::new(unicode_like()))] {
                let once = cmp.text(&s).into_owned();
                prop_assert_eq!(&*cmp.text(&once), once.as_str());
            }
            let per_char: String = s
                .chars()
                .map(|c| lowering.image(c).map_or_else(|| c.to_string(), str::to_string))
                .collect();
            prop_assert_eq!(lowering.lower(&s).into_owned(), per_char);
            prop_assert_eq!(Comparison::Blank.text(&s), s.trim_end_matches(' '));
        }
    }
}
