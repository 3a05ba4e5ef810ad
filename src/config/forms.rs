//! How durations and byte sizes are written back (`check-config`, the
//! start-up line): in the largest unit that states the value exactly, the
//! forms the reference config uses (`"60s"` is written `"1m"`, `"75s"`
//! stays `"75s"`, 64 MiB is `"64 MiB"`, 1000 bytes `1000`), so a printed
//! config reads like the file it came from and loads back to the same
//! values. Reading accepts everything humantime and bytesize accept.
//! (A duration no one unit can state, centuries to the nanosecond, is
//! written in humantime's mixed form.)

use std::time::Duration;

use serde::Serializer;

/// `with = "crate::config::forms::duration"`, for `Duration` and
/// `Option<Duration>` fields alike.
pub mod duration {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<T: super::Written, S: Serializer>(v: &T, s: S) -> Result<S::Ok, S::Error> {
        v.write(s)
    }

    pub fn deserialize<'de, T, D>(d: D) -> Result<T, D::Error>
    where
        humantime_serde::Serde<T>: Deserialize<'de>,
        D: Deserializer<'de>,
    {
        humantime_serde::deserialize(d)
    }
}

/// A value with a written form.
pub trait Written {
    fn write<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error>;
}

impl Written for Duration {
    fn write<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&duration_text(*self))
    }
}

impl Written for Option<Duration> {
    fn write<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Some(d) => s.serialize_some(&duration_text(*d)),
            None => s.serialize_none(),
        }
    }
}

/// `serialize_with` for a byte size.
pub fn bytes<S: Serializer>(b: &bytesize::ByteSize, s: S) -> Result<S::Ok, S::Error> {
    match bytes_text(b.as_u64()) {
        Some(text) => s.serialize_str(&text),
        None => s.serialize_u64(b.as_u64()),
    }
}

/// `serialize_with` for an optional byte size (with
/// `skip_serializing_if = "Option::is_none"`).
pub fn option_bytes<S: Serializer>(
    b: &Option<bytesize::ByteSize>,
    s: S,
) -> Result<S::Ok, S::Error> {
    match b {
        Some(b) => bytes(b, s),
        None => s.serialize_none(),
    }
}

/// `deserialize_with` for a list of strings: an array, or the
/// comma-separated text an environment variable gives
/// (`BLOOMGATE_DATABASE__REPLICA_URLS=postgres://a/db,postgres://b/db`:
/// figment's environment provider hands that over as one string).
pub fn list<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    use serde::Deserialize;
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        Many(Vec<String>),
        One(String),
    }
    Ok(match OneOrMany::deserialize(d)? {
        OneOrMany::Many(v) => v,
        OneOrMany::One(s) => s
            .split(',')
            .map(str::trim)
            .filter(|u| !u.is_empty())
            .map(String::from)
            .collect(),
    })
}

/// The largest of h, m, s, ms, us, ns that divides `d` exactly.
pub fn duration_text(d: Duration) -> String {
    let nanos = d.as_nanos();
    if nanos == 0 {
        return "0s".into();
    }
    const UNITS: [(&str, u128); 6] = [
        ("h", 3_600_000_000_000),
        ("m", 60_000_000_000),
        ("s", 1_000_000_000),
        ("ms", 1_000_000),
        ("us", 1_000),
        ("ns", 1),
    ];
    let (unit, size) = UNITS
        .iter()
        .find(|(_, size)| nanos.is_multiple_of(*size))
        .copied()
        .unwrap_or(("ns", 1));
    match u64::try_from(nanos / size) {
        Ok(n) => format!("{n}{unit}"),
        // Past what one number of that unit can say (centuries, to the
        // nanosecond): humantime's own form, which reads back too.
        Err(_) => humantime::format_duration(d).to_string(),
    }
}

/// The largest binary unit (KiB to TiB) that divides `n` exactly, else
/// `None` (the plain number of bytes is then the exact form).
pub fn bytes_text(n: u64) -> Option<String> {
    const UNITS: [(&str, u64); 4] = [
        ("TiB", 1 << 40),
        ("GiB", 1 << 30),
        ("MiB", 1 << 20),
        ("KiB", 1 << 10),
    ];
    UNITS
        .iter()
        .find(|(_, size)| n != 0 && n.is_multiple_of(*size))
        .map(|(unit, size)| format!("{} {unit}", n / size))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_reference_forms() {
        assert_eq!(duration_text(Duration::from_secs(60)), "1m");
        assert_eq!(duration_text(Duration::from_secs(75)), "75s");
        assert_eq!(duration_text(Duration::from_secs(86_400)), "24h");
        assert_eq!(duration_text(Duration::from_millis(250)), "250ms");
        assert_eq!(duration_text(Duration::from_millis(1500)), "1500ms");
        assert_eq!(duration_text(Duration::ZERO), "0s");
        assert_eq!(bytes_text(64 << 20).as_deref(), Some("64 MiB"));
        assert_eq!(bytes_text(1024).as_deref(), Some("1 KiB"));
        assert_eq!(bytes_text(1000), None);
        assert_eq!(bytes_text(0), None);
        let odd = Duration::new(u64::MAX / 2, 1);
        assert_eq!(humantime::parse_duration(&duration_text(odd)).unwrap(), odd);
    }

    proptest! {
        /// Every written form reads back to exactly the value written.
        #[test]
        fn written_forms_read_back_exactly(
            nanos in 0u64..u64::MAX / 4,
            bytes in any::<u64>(),
            n in 0u64..100_000,
            unit in 0u32..5,
        ) {
            // Arbitrary values, and round multiples of every unit.
            let round = Duration::from_nanos(n * 1000u64.pow(unit.min(3)) * if unit == 4 { 60 } else { 1 });
            for d in [Duration::from_nanos(nanos), round] {
                prop_assert_eq!(humantime::parse_duration(&duration_text(d)).unwrap(), d);
            }
            for b in [bytes, n << (10 * (unit % 4 + 1))] {
                if let Some(text) = bytes_text(b) {
                    prop_assert_eq!(text.parse::<bytesize::ByteSize>().unwrap().as_u64(), b);
                }
            }
        }
    }
}
