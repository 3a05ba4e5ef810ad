//! A streaming parser for Postgres' binary `COPY ... TO STDOUT` format.
//!
//! Keys stream out of the database with `COPY (SELECT key FROM t) TO STDOUT
//! (FORMAT binary)`: the cheapest way Postgres has to hand over a column, and
//! the binary form needs no text unescaping. Chunks arrive at arbitrary
//! boundaries; the parser keeps the unfinished tail (less than one tuple) and
//! never holds more.
//!
//! Format: an 11-byte signature, a 32-bit flags word, a 32-bit header
//! extension length and that many bytes; then tuples, each a 16-bit field
//! count followed by, per field, a 32-bit length (-1 for NULL) and the bytes;
//! then a trailer, a field count of -1. All integers are big-endian.

const SIGNATURE: &[u8; 11] = b"PGCOPY\n\xff\r\n\0";

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum CopyError {
    #[error("COPY data does not start with the binary signature")]
    BadSignature,
    #[error("COPY data has a negative length")]
    BadLength,
    #[error("COPY data ended before its trailer")]
    Truncated,
    #[error("COPY data continues after its trailer")]
    TrailingData,
}

#[derive(Debug, PartialEq, Eq)]
enum State {
    Header,
    Tuples,
    Done,
}

#[derive(Debug)]
pub struct CopyParser {
    buf: Vec<u8>,
    state: State,
    rows: u64,
}

impl Default for CopyParser {
    fn default() -> Self {
        Self {
            buf: Vec::with_capacity(64 * 1024),
            state: State::Header,
            rows: 0,
        }
    }
}

impl CopyParser {
    /// Parses `chunk`, calling `row` with the fields of every tuple it
    /// completes, once each.
    pub fn feed(&mut self, chunk: &[u8], mut row: impl FnMut(Fields<'_>)) -> Result<(), CopyError> {
        self.buf.extend_from_slice(chunk);
        let mut pos = 0;
        let buf = &self.buf[..];
        loop {
            match self.state {
                State::Header => {
                    if buf.len() < pos + 19 {
                        break;
                    }
                    if &buf[pos..pos + 11] != SIGNATURE {
                        return Err(CopyError::BadSignature);
                    }
                    let ext = i32::from_be_bytes(buf[pos + 15..pos + 19].try_into().unwrap());
                    let ext = usize::try_from(ext).map_err(|_| CopyError::BadLength)?;
                    if buf.len() < pos + 19 + ext {
                        break;
                    }
                    pos += 19 + ext;
                    self.state = State::Tuples;
                }
                State::Tuples => {
                    let Some(count) = read_i16(buf, pos) else {
                        break;
                    };
                    if count == -1 {
                        pos += 2;
                        self.state = State::Done;
                        continue;
                    }
                    let count = usize::try_from(count).map_err(|_| CopyError::BadLength)?;
                    // Find the tuple's end before emitting anything, so a tuple
                    // split across chunks is emitted exactly once.
                    let mut end = pos + 2;
                    let mut complete = true;
                    for _ in 0..count {
                        match read_i32(buf, end) {
                            None => {
                                complete = false;
                                break;
                            }
                            Some(-1) => end += 4,
                            Some(len) => {
                                let len = usize::try_from(len).map_err(|_| CopyError::BadLength)?;
                                end += 4 + len;
                            }
                        }
                    }
                    if !complete || end > buf.len() {
                        break;
                    }
                    row(Fields {
                        buf: &buf[..end],
                        at: pos + 2,
                        left: count,
                    });
                    self.rows += 1;
                    pos = end;
                }
                State::Done => {
                    if pos < buf.len() {
                        return Err(CopyError::TrailingData);
                    }
                    break;
                }
            }
        }
        self.buf.drain(..pos);
        Ok(())
    }

    /// Checks that the stream ended where it should; returns the tuple count.
    pub fn finish(&self) -> Result<u64, CopyError> {
        if self.state == State::Done && self.buf.is_empty() {
            Ok(self.rows)
        } else {
            Err(CopyError::Truncated)
        }
    }
}

/// The fields of one tuple, in order: `None` for a NULL. Its lengths were
/// checked before it was handed out.
pub struct Fields<'a> {
    buf: &'a [u8],
    at: usize,
    left: usize,
}

impl<'a> Iterator for Fields<'a> {
    type Item = Option<&'a [u8]>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.left == 0 {
            return None;
        }
        self.left -= 1;
        let len = read_i32(self.buf, self.at)?;
        self.at += 4;
        if len < 0 {
            return Some(None);
        }
        let field = self.buf.get(self.at..self.at + len as usize)?;
        self.at += len as usize;
        Some(Some(field))
    }
}

fn read_i16(buf: &[u8], at: usize) -> Option<i16> {
    Some(i16::from_be_bytes(buf.get(at..at + 2)?.try_into().ok()?))
}

fn read_i32(buf: &[u8], at: usize) -> Option<i32> {
    Some(i32::from_be_bytes(buf.get(at..at + 4)?.try_into().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    type Row = Vec<Option<Vec<u8>>>;

    fn encode(rows: &[Row]) -> Vec<u8> {
        let mut out = SIGNATURE.to_vec();
        out.extend(0i32.to_be_bytes());
        out.extend(4i32.to_be_bytes());
        out.extend(b"ext!");
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
    }

    fn parse_in_chunks(data: &[u8], cuts: &[usize]) -> Result<(Vec<Row>, u64), CopyError> {
        let mut p = CopyParser::default();
        let mut got = Vec::new();
        let mut start = 0;
        let mut cuts: Vec<usize> = cuts.iter().map(|c| c % (data.len() + 1)).collect();
        cuts.sort();
        for c in cuts.into_iter().chain([data.len()]) {
            p.feed(&data[start..c], |f| {
                got.push(f.map(|f| f.map(<[u8]>::to_vec)).collect())
            })?;
            start = c;
        }
        Ok((got, p.finish()?))
    }

    proptest! {
        #[test]
        fn any_chunking_yields_every_row_once(
            rows in proptest::collection::vec(
                proptest::collection::vec(
                    proptest::option::of(proptest::collection::vec(any::<u8>(), 0..20)),
                    1..4,
                ),
                0..50,
            ),
            cuts in proptest::collection::vec(any::<usize>(), 0..10),
        ) {
            let data = encode(&rows);
            let (got, n) = parse_in_chunks(&data, &cuts).unwrap();
            prop_assert_eq!(&got, &rows);
            prop_assert_eq!(n, rows.len() as u64);
        }

        #[test]
        fn garbage_never_panics(data in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = parse_in_chunks(&data, &[7, 30]);
        }
    }

    #[test]
    fn truncation_and_garbage_are_errors() {
        let data = encode(&[vec![Some(vec![1; 8])], vec![Some(vec![2; 8]), None]]);
        for cut in 0..data.len() {
            assert_eq!(
                parse_in_chunks(&data[..cut], &[]),
                Err(CopyError::Truncated),
                "cut at {cut}"
            );
        }
        let mut bad = data.clone();
        bad[0] = b'X';
        assert_eq!(parse_in_chunks(&bad, &[]), Err(CopyError::BadSignature));
        let mut long = data.clone();
        long.push(0);
        assert_eq!(parse_in_chunks(&long, &[]), Err(CopyError::TrailingData));
    }
}
