//! Fuzzes `bloomgate::db::copy::CopyParser`, the streaming parser for
//! Postgres' binary COPY format that key scans go through.
//!
//! Input: byte 0 = number of cut points `n` (mod 8), then `n` little-endian
//! u16 cut positions, then the COPY stream. The stream is fed whole, in the
//! chunks the cuts make, and (when short) one byte at a time; the fields
//! emitted and the outcome must be the same every time, and equal to an
//! independent whole-buffer reference parser written here.
#![no_main]

use bloomgate::db::copy::{CopyError, CopyParser};
use libfuzzer_sys::fuzz_target;

const SIGNATURE: &[u8; 11] = b"PGCOPY\n\xff\r\n\0";

#[derive(Debug, PartialEq, Eq)]
struct Outcome {
    fields: Vec<Vec<u8>>,
    result: Result<u64, CopyError>,
}

fuzz_target!(|data: &[u8]| {
    let Some((&n, rest)) = data.split_first() else {
        return;
    };
    let n = usize::from(n % 8);
    if rest.len() < 2 * n {
        return;
    }
    let (cut_bytes, stream) = rest.split_at(2 * n);
    let mut cuts: Vec<usize> = cut_bytes
        .chunks_exact(2)
        .map(|c| usize::from(u16::from_le_bytes([c[0], c[1]])) % (stream.len() + 1))
        .collect();
    cuts.sort_unstable();

    let whole = run(stream, &[]);
    assert_eq!(
        whole,
        reference(stream),
        "parser disagrees with the reference"
    );
    let chunked = run(stream, &cuts);
    assert_eq!(whole, chunked, "chunking at {cuts:?} changed the outcome");
    if stream.len() <= 512 {
        let every: Vec<usize> = (0..=stream.len()).collect();
        assert_eq!(
            whole,
            run(stream, &every),
            "byte-at-a-time changed the outcome"
        );
    }
});

fn run(stream: &[u8], cuts: &[usize]) -> Outcome {
    let mut p = CopyParser::default();
    let mut fields = Vec::new();
    let mut start = 0;
    for &c in cuts.iter().chain([&stream.len()]) {
        let fed = p.feed(&stream[start..c], |row| {
            fields.extend(row.flatten().map(<[u8]>::to_vec));
        });
        if let Err(e) = fed {
            return Outcome {
                fields,
                result: Err(e),
            };
        }
        start = c;
    }
    Outcome {
        result: p.finish(),
        fields,
    }
}

/// The format as documented, over the whole buffer at once. Fields of a
/// tuple count only once the tuple is complete.
fn reference(buf: &[u8]) -> Outcome {
    let mut fields = Vec::new();
    let result = (|| {
        if buf.len() < 19 {
            return Err(CopyError::Truncated);
        }
        if &buf[..11] != SIGNATURE {
            return Err(CopyError::BadSignature);
        }
        let ext = i32::from_be_bytes(buf[15..19].try_into().unwrap());
        if ext < 0 {
            return Err(CopyError::BadLength);
        }
        let mut pos = 19 + ext as usize;
        if pos > buf.len() {
            return Err(CopyError::Truncated);
        }
        let mut rows = 0u64;
        loop {
            let Some(count) = buf.get(pos..pos + 2) else {
                return Err(CopyError::Truncated);
            };
            let count = i16::from_be_bytes([count[0], count[1]]);
            pos += 2;
            if count == -1 {
                return if pos < buf.len() {
                    Err(CopyError::TrailingData)
                } else {
                    Ok(rows)
                };
            }
            if count < 0 {
                return Err(CopyError::BadLength);
            }
            let mut tuple = Vec::new();
            for _ in 0..count {
                let Some(len) = buf.get(pos..pos + 4) else {
                    return Err(CopyError::Truncated);
                };
                let len = i32::from_be_bytes(len.try_into().unwrap());
                pos += 4;
                match len {
                    -1 => {}
                    l if l < 0 => return Err(CopyError::BadLength),
                    l => {
                        let l = l as usize;
                        // A field running past the end: the tuple never
                        // completes (later lengths are not looked at).
                        let Some(v) = buf.get(pos..pos + l) else {
                            return Err(CopyError::Truncated);
                        };
                        tuple.push(v.to_vec());
                        pos += l;
                    }
                }
            }
            fields.extend(tuple);
            rows += 1;
        }
    })();
    Outcome { fields, result }
}
