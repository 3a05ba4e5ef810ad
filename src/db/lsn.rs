//! A position in the write-ahead log, as Postgres writes it (`X/Y`).

use std::fmt;

/// A position in the write-ahead log.
#[derive(Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Lsn(pub u64);

impl Lsn {
    pub const ZERO: Lsn = Lsn(0);

    /// Parses Postgres' `X/Y` form (both halves hexadecimal).
    pub fn parse(text: &str) -> Option<Lsn> {
        let (hi, lo) = text.split_once('/')?;
        let hi = u32::from_str_radix(hi, 16).ok()?;
        let lo = u32::from_str_radix(lo, 16).ok()?;
        Some(Lsn((u64::from(hi) << 32) | u64::from(lo)))
    }
}

impl fmt::Display for Lsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:X}/{:X}", self.0 >> 32, self.0 & 0xffff_ffff)
    }
}

impl fmt::Debug for Lsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lsn_round_trips_postgres_text() {
        for text in ["0/0", "0/16B3748", "1/0", "FFFFFFFF/FFFFFFFF", "A/B"] {
            let lsn = Lsn::parse(text).unwrap();
            assert_eq!(lsn.to_string(), text);
        }
        assert_eq!(Lsn::parse("1/2").unwrap(), Lsn((1 << 32) | 2));
        assert!(Lsn::parse("1/2") > Lsn::parse("0/FFFFFFFF"));
        for bad in ["", "1", "1/", "/1", "x/1", "1/2/3", "100000000/0"] {
            assert_eq!(Lsn::parse(bad), None, "{bad:?}");
        }
    }
}
