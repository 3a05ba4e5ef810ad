//! Serialised form of the filters.
//!
//! All integers little-endian.
//!
//! ```text
//! offset size  field
//! 0      4     magic  b"BGKS" ("bloomgate key set")
//! 4      2     format version (u16) = 1
//! 6      1     layout: 1 = bloom-blocked-512, 2 = exact-roaring-treemap
//! 7      1     flags, 0
//! 8      8     body length in bytes (u64)
//! 16     ..    body (layout-specific)
//! end-8  8     checksum: HighwayHash-64 under a fixed public key of all
//!              preceding bytes
//!
//! bloom body:  num_blocks u64, k u32, reserved u32, inserted u64,
//!              key fingerprint u64, then num_blocks·8 words u64
//! exact body:  keys u64, payload length u64, roaring treemap
//!              (the crate's portable serialisation)
//! ```
//!
//! Decoding never panics and never trusts a length: every declared size is
//! compared with the bytes actually present before anything is allocated, so
//! arbitrary input costs at most O(input) memory. The checksum turns a flipped
//! bit anywhere into [`FilterError::Corrupt`] instead of a silently wrong
//! filter (a wrong filter could produce false negatives).

use super::FilterError;
use super::hash::checksum;

pub(crate) const MAGIC: [u8; 4] = *b"BGKS";
pub(crate) const VERSION: u16 = 1;
pub(crate) const HEADER_LEN: usize = 16;
pub(crate) const CHECKSUM_LEN: usize = 8;

/// Layout tag in the header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Layout {
    BloomBlocked512 = 1,
    ExactRoaringTreemap = 2,
}

/// Starts an encoding: header with a placeholder body length.
pub(crate) fn header(layout: Layout, body_capacity: u64) -> Vec<u8> {
    let cap = usize::try_from(body_capacity).unwrap_or(0);
    let mut out = Vec::with_capacity(HEADER_LEN + cap + CHECKSUM_LEN);
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.push(layout as u8);
    out.push(0);
    out.extend_from_slice(&0u64.to_le_bytes());
    out
}

/// Finishes an encoding: fills in the body length, appends the checksum.
pub(crate) fn seal(mut out: Vec<u8>) -> Vec<u8> {
    let body_len = (out.len() - HEADER_LEN) as u64;
    out[8..16].copy_from_slice(&body_len.to_le_bytes());
    let sum = checksum(&out);
    out.extend_from_slice(&sum.to_le_bytes());
    out
}

/// Validates framing and checksum; returns the layout and a reader over the
/// body.
pub(crate) fn open(bytes: &[u8]) -> Result<(Layout, Reader<'_>), FilterError> {
    if bytes.len() < 4 {
        return Err(FilterError::Truncated);
    }
    if bytes[..4] != MAGIC {
        return Err(FilterError::BadMagic);
    }
    let mut r = Reader { buf: &bytes[4..] };
    let version = r.u16()?;
    if version != VERSION {
        return Err(FilterError::UnsupportedVersion(version));
    }
    let layout = match r.u8()? {
        1 => Layout::BloomBlocked512,
        2 => Layout::ExactRoaringTreemap,
        _ => return Err(FilterError::Corrupt("unknown layout tag")),
    };
    if r.u8()? != 0 {
        return Err(FilterError::Corrupt("unknown flags"));
    }
    let body_len = r.u64()?;
    let available = (bytes.len() - HEADER_LEN).saturating_sub(CHECKSUM_LEN) as u64;
    if bytes.len() < HEADER_LEN + CHECKSUM_LEN || body_len > available {
        return Err(FilterError::Truncated);
    }
    if body_len < available {
        return Err(FilterError::Corrupt("trailing bytes after the filter"));
    }
    let (framed, sum) = bytes.split_at(bytes.len() - CHECKSUM_LEN);
    if checksum(framed) != u64::from_le_bytes(sum.try_into().expect("8 bytes")) {
        return Err(FilterError::Corrupt("checksum mismatch"));
    }
    Ok((
        layout,
        Reader {
            buf: &framed[HEADER_LEN..],
        },
    ))
}

/// Bounds-checked little-endian reader over a byte slice.
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    /// Exactly `n` bytes, or [`FilterError::Truncated`].
    pub(crate) fn take_exact(&mut self, n: u64) -> Result<&'a [u8], FilterError> {
        let n = usize::try_from(n).map_err(|_| FilterError::Truncated)?;
        if n > self.buf.len() {
            return Err(FilterError::Truncated);
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], FilterError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take_exact(N as u64)?);
        Ok(a)
    }
    pub(crate) fn u8(&mut self) -> Result<u8, FilterError> {
        Ok(self.array::<1>()?[0])
    }
    pub(crate) fn u16(&mut self) -> Result<u16, FilterError> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    pub(crate) fn u32(&mut self) -> Result<u32, FilterError> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    pub(crate) fn u64(&mut self) -> Result<u64, FilterError> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    /// Errors unless everything was consumed.
    pub(crate) fn finish(self) -> Result<(), FilterError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(FilterError::Corrupt("trailing bytes in body"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<u8> {
        let mut out = header(Layout::ExactRoaringTreemap, 4);
        out.extend_from_slice(&[1, 2, 3, 4]);
        seal(out)
    }

    #[test]
    fn framing_round_trip() {
        let bytes = sample();
        let (layout, mut r) = open(&bytes).unwrap();
        assert_eq!(layout, Layout::ExactRoaringTreemap);
        assert_eq!(r.u32().unwrap(), u32::from_le_bytes([1, 2, 3, 4]));
        r.finish().unwrap();
    }

    #[test]
    fn every_truncation_is_an_error() {
        let bytes = sample();
        for len in 0..bytes.len() {
            assert!(open(&bytes[..len]).is_err(), "prefix of {len} accepted");
        }
    }

    #[test]
    fn every_single_bit_flip_is_an_error() {
        let bytes = sample();
        for i in 0..bytes.len() * 8 {
            let mut b = bytes.clone();
            b[i / 8] ^= 1 << (i % 8);
            assert!(open(&b).is_err(), "flip of bit {i} accepted");
        }
    }

    #[test]
    fn specific_errors() {
        let mut b = sample();
        b[0] = b'X';
        assert!(matches!(open(&b), Err(FilterError::BadMagic)));
        let mut b = sample();
        b[4..6].copy_from_slice(&2u16.to_le_bytes());
        assert!(matches!(open(&b), Err(FilterError::UnsupportedVersion(2))));
        let mut b = sample();
        b[6] = 9;
        assert!(matches!(open(&b), Err(FilterError::Corrupt(_))));
        let mut b = sample();
        b.push(0);
        assert!(matches!(open(&b), Err(FilterError::Corrupt(_))));
        // A body length larger than the input is truncation, not an allocation.
        let mut b = sample();
        b[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(open(&b), Err(FilterError::Truncated)));
    }

    #[test]
    fn reader_refuses_overlong_takes() {
        let mut r = Reader { buf: &[1, 2, 3] };
        assert!(matches!(
            r.take_exact(u64::MAX),
            Err(FilterError::Truncated)
        ));
        assert!(matches!(r.u32(), Err(FilterError::Truncated)));
        assert_eq!(r.u16().unwrap(), 0x0201);
        assert!(r.finish().is_err());
    }
}
