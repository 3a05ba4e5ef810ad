//! Reading one column from a cached row for an owner check.
//!
//! A row is the JSON object `row_to_json` made, its members in `columns`
//! order. One top-level member is found by walking the object once,
//! skipping every value before it without building anything (no
//! allocation unless the value itself has escapes): the cost is the bytes
//! before the member, so put `owner_column` early in `columns`. Nesting is
//! bounded by [`MAX_DEPTH`]; anything that is not well-formed JSON finds
//! nothing, which refuses the row.

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

/// Whether the raw JSON `value` (a string, or an integer) equals `claim`.
pub fn equals(value: &[u8], claim: &str) -> bool {
    match value.first() {
        Some(b'"') => {
            let inner = &value[1..value.len() - 1];
            if !inner.contains(&b'\\') {
                return inner == claim.as_bytes();
            }
            serde_json::from_slice::<String>(value).is_ok_and(|s| s == claim)
        }
        Some(b'-' | b'0'..=b'9') => {
            // An integer column: compare numerically ("042" is not 42's
            // spelling in JSON, but a claim may carry it as a string).
            match (
                std::str::from_utf8(value)
                    .ok()
                    .and_then(|v| v.parse::<i64>().ok()),
                claim.parse::<i64>().ok(),
            ) {
                (Some(a), Some(b)) => a == b,
                _ => value == claim.as_bytes(),
            }
        }
        _ => false,
    }
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
        assert!(equals(column(row, "owner_id").unwrap(), "42"));
        assert!(!equals(column(row, "owner_id").unwrap(), "4"));
        assert!(equals(column(row, "email").unwrap(), "u@x"));
        assert!(!equals(column(row, "x").unwrap(), "null"));
    }

    #[test]
    fn escaped_names_and_values_compare_by_their_text() {
        let row = br#"{"a\u0062":"x\u0079","c":"\"q\""}"#;
        assert!(equals(column(row, "ab").unwrap(), "xy"));
        assert!(equals(column(row, "c").unwrap(), "\"q\""));
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
                proptest::prop_assert!(equals(raw, &n.to_string()));
            }
        }
    }
}
