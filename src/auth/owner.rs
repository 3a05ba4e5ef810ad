//! Reading one column from a cached row for an owner check.
//!
//! A row is the JSON object `row_to_json` made, its members in `columns`
//! order. One top-level member is found by walking the object once,
//! skipping every value before it without building anything (no
//! allocation unless the value itself has escapes): the cost is the bytes
//! before the member, so put `owner_column` early in `columns`. Nesting is
//! bounded by [`MAX_DEPTH`]; anything that is not well-formed JSON finds
//! nothing, which refuses the row.

use crate::key::compare::Comparison;

/// Deepest nesting skipped (Postgres' own JSON nests far less in a row).
pub const MAX_DEPTH: usize = 128;

/// The raw JSON of `column`'s value in the object `row`, if present.
pub fn column<'a>(row: &'a [u8], column: &str) -> Option<&'a [u8]> {
    let mut p = Parser { s: row, i: 0 };
    p.ws();
    p.eat(b'{')?;
    p.ws();
    if p.peek()? == b'}' {
        return None;
    }
    loop {
        p.ws();
        let (name, escaped) = p.string()?;
        p.ws();
        p.eat(b':')?;
        p.ws();
        let start = p.i;
        p.value(0)?;
        let value = &row[start..p.i];
        if name_is(name, escaped, column) {
            return Some(value);
        }
        p.ws();
        match p.next()? {
            b',' => continue,
            _ => return None,
        }
    }
}

/// Whether the raw JSON `value` (a string, or a number) equals `claim`,
/// for a column compared as `cmp` says: a string by its text as the
/// column compares it (a citext owner `Alice` is the claim `alice`), a
/// number by its canonical text only. `row_to_json` writes an integer in
/// its one decimal form, so a claim of `"03"` or `"+3"` is nobody's: an
/// identity has one spelling, and a lenient reading would let a token
/// minted for one string own another's rows.
pub fn equals(value: &[u8], claim: &str, cmp: &Comparison) -> bool {
    match value.first() {
        Some(b'"') => {
            let inner = &value[1..value.len() - 1];
            if !inner.contains(&b'\\') {
                return std::str::from_utf8(inner).is_ok_and(|v| cmp.text(v) == cmp.text(claim));
            }
            serde_json::from_slice::<String>(value).is_ok_and(|s| cmp.text(&s) == cmp.text(claim))
        }
        Some(b'-' | b'0'..=b'9') => value == claim.as_bytes(),
        _ => false,
    }
}

/// `claim` as an integer if it is one in canonical decimal form: an
/// optional `-`, then digits without a leading zero (`0` itself aside),
/// no `-0`, within `i64`.
pub fn canonical_int(claim: &str) -> Option<i64> {
    let digits = claim.strip_prefix('-').unwrap_or(claim);
    let canonical = !digits.is_empty()
        && digits.bytes().all(|b| b.is_ascii_digit())
        && (digits == "0" || !digits.starts_with('0'))
        && claim != "-0";
    canonical.then(|| claim.parse().ok()).flatten()
}

fn name_is(name: &[u8], escaped: bool, want: &str) -> bool {
    if !escaped {
        return name == want.as_bytes();
    }
    let mut quoted = Vec::with_capacity(name.len() + 2);
    quoted.push(b'"');
    quoted.extend_from_slice(name);
    quoted.push(b'"');
    serde_json::from_slice::<String>(&quoted).is_ok_and(|s| s == want)
}

struct Parser<'a> {
    s: &'a [u8],
    i: usize,
}

impl<'a> Parser<'a> {
    fn peek(&self) -> Option<u8> {
        self.s.get(self.i).copied()
    }

    fn next(&mut self) -> Option<u8> {
        let b = self.peek()?;
        self.i += 1;
        Some(b)
    }

    fn eat(&mut self, b: u8) -> Option<()> {
        (self.next()? == b).then_some(())
    }

    fn ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.i += 1;
        }
    }

    /// A string's raw contents (between the quotes) and whether it has
    /// escapes.
    fn string(&mut self) -> Option<(&'a [u8], bool)> {
        self.eat(b'"')?;
        let start = self.i;
        let mut escaped = false;
        loop {
            match self.next()? {
                b'"' => return Some((&self.s[start..self.i - 1], escaped)),
                b'\\' => {
                    escaped = true;
                    self.next()?;
                }
                b if b < 0x20 => return None,
                _ => {}
            }
        }
    }

    fn value(&mut self, depth: usize) -> Option<()> {
        if depth > MAX_DEPTH {
            return None;
        }
        match self.peek()? {
            b'"' => self.string().map(drop),
            b'{' | b'[' => {
                let close = if self.next()? == b'{' { b'}' } else { b']' };
                self.ws();
                if self.peek()? == close {
                    self.i += 1;
                    return Some(());
                }
                loop {
                    self.ws();
                    if close == b'}' {
                        self.string()?;
                        self.ws();
                        self.eat(b':')?;
                        self.ws();
                    }
                    self.value(depth + 1)?;
                    self.ws();
                    match self.next()? {
                        b',' => {}
                        b if b == close => return Some(()),
                        _ => return None,
                    }
                }
            }
            b'-' | b'0'..=b'9' | b't' | b'f' | b'n' => {
                let start = self.i;
                while matches!(
                    self.peek(),
                    Some(b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9' | b'a'..=b'z')
                ) {
                    self.i += 1;
                }
                (self.i > start).then_some(())
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_a_member_after_values_of_every_kind() {
        let row = br#"{"id":1,"tags":["a",{"b":[1,2,{}]},"c\"]"],"x":null,"ok":true,"n":-1.5e3,"owner_id":42,"email":"u@x"}"#;
        assert_eq!(column(row, "owner_id"), Some(&b"42"[..]));
        assert_eq!(column(row, "email"), Some(&br#""u@x""#[..]));
        assert_eq!(column(row, "id"), Some(&b"1"[..]));
        assert_eq!(column(row, "missing"), None);
        let b = Comparison::Bytes;
        assert!(equals(column(row, "owner_id").unwrap(), "42", &b));
        assert!(!equals(column(row, "owner_id").unwrap(), "4", &b));
        assert!(equals(column(row, "email").unwrap(), "u@x", &b));
        assert!(!equals(column(row, "x").unwrap(), "null", &b));
    }

    #[test]
    fn escaped_names_and_values_compare_by_their_text() {
        let row = br#"{"a\u0062":"x\u0079","c":"\"q\""}"#;
        assert!(equals(column(row, "ab").unwrap(), "xy", &Comparison::Bytes));
        assert!(equals(
            column(row, "c").unwrap(),
            "\"q\"",
            &Comparison::Bytes
        ));
    }

    /// An integer owner has one spelling (issue: `"03"` and `"+3"` owned
    /// key 3).
    #[test]
    fn an_integer_owner_is_named_by_its_canonical_decimal_only() {
        let row = br#"{"owner_id":3,"neg":-12,"zero":0}"#;
        let b = Comparison::Bytes;
        let owner = column(row, "owner_id").unwrap();
        assert!(equals(owner, "3", &b));
        for lenient in ["03", "+3", " 3", "3 ", "3.0", "0x3", "3e0"] {
            assert!(!equals(owner, lenient, &b), "{lenient:?}");
            assert_eq!(canonical_int(lenient), None, "{lenient:?}");
        }
        assert!(equals(column(row, "neg").unwrap(), "-12", &b));
        assert!(!equals(column(row, "neg").unwrap(), "-012", &b));
        assert!(equals(column(row, "zero").unwrap(), "0", &b));
        assert_eq!(canonical_int("3"), Some(3));
        assert_eq!(canonical_int("-12"), Some(-12));
        assert_eq!(canonical_int("0"), Some(0));
        assert_eq!(canonical_int("-0"), None);
        assert_eq!(canonical_int("9223372036854775808"), None);
    }

    proptest::proptest! {
        /// Every i64 is owned by its own decimal text, and by no other
        /// spelling of it.
        #[test]
        fn canonical_int_is_exactly_to_string(v: i64, pad in 1usize..3) {
            proptest::prop_assert_eq!(canonical_int(&v.to_string()), Some(v));
            let padded = match v < 0 {
                true => format!("-{}{}", "0".repeat(pad), v.unsigned_abs()),
                false => format!("{}{v}", "0".repeat(pad)),
            };
            proptest::prop_assert_eq!(canonical_int(&padded), None);
            proptest::prop_assert_eq!(canonical_int(&format!("+{v}")), None);
        }
    }

    #[test]
    fn malformed_or_deep_rows_find_nothing() {
        for row in [
            &b""[..],
            b"[]",
            b"{",
            b"{}",
            b"{\"a\"}",
            b"{\"a\":}",
            b"{\"a\":1,",
            b"{\"a\":\"\x01\",\"b\":1}",
        ] {
            assert_eq!(column(row, "b"), None, "{}", String::from_utf8_lossy(row));
        }
        let deep = format!("{{\"a\":{}1{},\"b\":2}}", "[".repeat(500), "]".repeat(500));
        assert_eq!(column(deep.as_bytes(), "b"), None);
    }

    proptest::proptest! {
        /// Whatever serde_json finds at the top level, so does this.
        #[test]
        fn agrees_with_serde_json(v in proptest::collection::btree_map("[a-c]{1,2}", proptest::prelude::any::<i32>(), 0..6)) {
            let row = serde_json::to_vec(&v).unwrap();
            for (k, n) in &v {
                let raw = column(&row, k).unwrap();
                proptest::prop_assert!(equals(raw, &n.to_string(), &Comparison::Bytes));
            }
        }
    }
}
