//! The access line's two formats, written by hand into a byte buffer.
//!
//! # Guarantees (tested below)
//! - One line: whatever the field values hold (a client's `x-request-id`
//!   with a tab or a quote), a line ends in its one `\n` and holds no
//!   other: every string is escaped as RFC 8259 says (`"`, `\`, and every
//!   control character), in both formats.
//! - JSON: every line is one JSON object that `serde_json` reads back to
//!   the same values: `status` a number, `duration_ms` a number with
//!   microsecond precision written from integers (`0.030`, never
//!   `0.030244999999999998`), `client` a string (empty when the request came
//!   from inside the process).
//! - The timestamp is RFC 3339 in UTC with microseconds, as
//!   `humantime::format_rfc3339_micros` writes it (and as the rest of the
//!   log, `tracing-subscriber`'s `SystemTime`, does).
//! - [`bound`] is never below what a line takes: the caller reserves it
//!   and the line is written without growing the buffer.
//!
//! # Why by hand
//! `tracing-subscriber`'s formatter visits each field through `dyn Value`
//! and `core::fmt`, styles it with `nu_ansi_term` even with colours off,
//! and allocates a buffer per event: 47 % of a cached hit's instructions
//! (docs/perf-log/2026-11-26-access-lines.md). Here a field is a copy of
//! bytes or a few integer divisions, and the date part of the timestamp is
//! formatted once per second per thread.

use std::cell::Cell;
use std::net::IpAddr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::{Line, Text};

/// Bytes a line of fixed fields can take at most, beyond its strings: the
/// JSON frame and field names (about 210 bytes), the timestamp (27), the
/// numbers (at most 26 for `duration_ms`, 5 for `status`) and an IPv6
/// client and peer (at most 45 each).
const FIXED: usize = 480;

/// At most the bytes `line` takes in either format.
pub(super) fn bound(line: &Line<'_>) -> usize {
    // Escaping writes at most 6 bytes (`\u001f`) for one.
    FIXED
        + line.route.0.len()
        + line.resource.0.len()
        + line.reason.map_or(0, str::len)
        + 6 * (line.method.as_str().len()
            + line.cache_status.as_str().len()
            + line.request_id.as_str().len())
}

/// A wall-clock time, as written in a line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Stamp {
    secs: u64,
    micros: u32,
}

impl Stamp {
    pub(super) fn now() -> Self {
        Self::from(SystemTime::now())
    }

    #[cfg(test)]
    pub(super) fn micros_since_epoch(self) -> u64 {
        self.secs * 1_000_000 + u64::from(self.micros)
    }

    /// `us` microseconds since the epoch.
    pub(super) fn from_micros(us: u64) -> Self {
        Self {
            secs: us / 1_000_000,
            micros: (us % 1_000_000) as u32,
        }
    }
}

impl From<SystemTime> for Stamp {
    fn from(t: SystemTime) -> Self {
        // A clock before 1970 is written as the epoch.
        let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
        Self {
            secs: d.as_secs(),
            micros: d.subsec_micros(),
        }
    }
}

/// `2026-11-27T10:00:00.123456Z`.
fn timestamp(out: &mut Vec<u8>, t: Stamp) {
    thread_local! {
        // The date and time to the second last written on this thread:
        // most lines in a second share them.
        static SECS: Cell<u64> = const { Cell::new(u64::MAX) };
        static TEXT: Cell<[u8; 19]> = const { Cell::new([0; 19]) };
    }
    if SECS.get() != t.secs {
        SECS.set(t.secs);
        TEXT.set(civil(t.secs));
    }
    out.extend_from_slice(&TEXT.get());
    out.push(b'.');
    fixed::<6>(out, u64::from(t.micros));
    out.push(b'Z');
}

/// `YYYY-MM-DDTHH:MM:SS` of `secs` since the epoch (years past 9999 are
/// written as 9999: a clock that far off is not worth a branch per line).
fn civil(secs: u64) -> [u8; 19] {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Howard Hinnant's days_from_civil, inverted (proleptic Gregorian).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = (yoe + era * 400 + i64::from(month <= 2)).clamp(0, 9999);
    // No allocation: this runs on a request's thread once a second.
    let mut a = *b"0000-00-00T00:00:00";
    let mut put = |at: usize, width: usize, mut n: u64| {
        for i in (at..at + width).rev() {
            a[i] = b'0' + (n % 10) as u8;
            n /= 10;
        }
    };
    put(0, 4, year as u64);
    put(5, 2, month as u64);
    put(8, 2, day as u64);
    put(11, 2, rem / 3600);
    put(14, 2, rem / 60 % 60);
    put(17, 2, rem % 60);
    a
}

/// The last `N` decimal digits of `n`, zero-padded: a copy of a length
/// known when compiling.
fn fixed<const N: usize>(out: &mut Vec<u8>, mut n: u64) {
    let mut buf = [b'0'; N];
    for b in buf.iter_mut().rev() {
        *b = b'0' + (n % 10) as u8;
        n /= 10;
    }
    out.extend_from_slice(&buf);
}

/// `n` (0..=255) in decimal, unpadded: its digits (padded with zeros past
/// the last) and how many there are. A table: an address's four octets
/// are a quarter of the rest of a line's digits.
static OCTETS: [([u8; 3], u8); 256] = {
    let mut t = [([0u8; 3], 0u8); 256];
    let mut n = 0;
    while n < 256 {
        let d = [(n / 100) as u8, (n / 10 % 10) as u8, (n % 10) as u8];
        t[n] = if n >= 100 {
            ([b'0' + d[0], b'0' + d[1], b'0' + d[2]], 3)
        } else if n >= 10 {
            ([b'0' + d[1], b'0' + d[2], 0], 2)
        } else {
            ([b'0' + d[2], 0, 0], 1)
        };
        n += 1;
    }
    t
};

/// `n` in decimal, zero-padded to `width` digits.
fn digits(out: &mut Vec<u8>, mut n: u64, width: usize) {
    let mut buf = [b'0'; 20];
    let mut i = buf.len();
    while n > 0 || buf.len() - i < width.max(1) {
        i -= 1;
        buf[i] = b'0' + (n % 10) as u8;
        n /= 10;
    }
    out.extend_from_slice(&buf[i..]);
}

/// `d` in milliseconds with three decimals: the microseconds, written as
/// integers (a JSON number with no float noise).
fn millis(out: &mut Vec<u8>, d: Duration) {
    let us = d.as_micros().min(u128::from(u64::MAX)) as u64;
    digits(out, us / 1000, 1);
    out.push(b'.');
    fixed::<3>(out, us % 1000);
}

/// An HTTP status: three digits (`http` allows no other), any other
/// number as it is.
fn status(out: &mut Vec<u8>, n: u16) {
    if (100..1000).contains(&n) {
        fixed::<3>(out, u64::from(n));
    } else {
        digits(out, u64::from(n), 1);
    }
}

/// Whether the byte must be escaped inside a JSON string.
fn needs_escape(b: u8) -> bool {
    b < 0x20 || b == b'"' || b == b'\\'
}

/// Whether any byte of `s` must be escaped, eight bytes at a time (a
/// route, a resource, a UUID never need it: one pass, one copy).
fn any_escape(s: &[u8]) -> bool {
    const ONES: u64 = u64::from_le_bytes([1; 8]);
    const HIGH: u64 = ONES * 0x80;
    // Exact for "some byte is zero" / "some byte is below n <= 128", per
    // word (the classic bit tricks; which byte is not needed).
    let zero = |w: u64| w.wrapping_sub(ONES) & !w & HIGH != 0;
    let mut chunks = s.chunks_exact(8);
    for c in &mut chunks {
        let w = u64::from_le_bytes(c.try_into().expect("8 bytes"));
        if w.wrapping_sub(ONES * 0x20) & !w & HIGH != 0
            || zero(w ^ (ONES * u64::from(b'"')))
            || zero(w ^ (ONES * u64::from(b'\\')))
        {
            return true;
        }
    }
    chunks.remainder().iter().any(|&b| needs_escape(b))
}

/// `s` between double quotes, escaped (see [`escape`]) unless it is
/// [`Text::Clean`].
fn quoted(out: &mut Vec<u8>, s: Text<'_>) {
    out.push(b'"');
    match s {
        Text::Clean(s) => {
            debug_assert!(!any_escape(s.as_bytes()), "{s:?} is not clean");
            out.extend_from_slice(s.as_bytes());
        }
        Text::Raw(s) => escape(out, s),
    }
    out.push(b'"');
}

/// `s` escaped as RFC 8259 section 7 says: the two-character escapes where
/// there is one, `\u00XX` for the other control characters; everything
/// else, UTF-8 included, as it is.
pub(super) fn escape(out: &mut Vec<u8>, s: &str) {
    let bytes = s.as_bytes();
    if !any_escape(bytes) {
        out.extend_from_slice(bytes);
        return;
    }
    let mut start = 0;
    for (i, &b) in bytes.iter().enumerate() {
        if !needs_escape(b) {
            continue;
        }
        out.extend_from_slice(&bytes[start..i]);
        start = i + 1;
        match b {
            b'"' => out.extend_from_slice(b"\\\""),
            b'\\' => out.extend_from_slice(b"\\\\"),
            b'\n' => out.extend_from_slice(b"\\n"),
            b'\r' => out.extend_from_slice(b"\\r"),
            b'\t' => out.extend_from_slice(b"\\t"),
            0x08 => out.extend_from_slice(b"\\b"),
            0x0c => out.extend_from_slice(b"\\f"),
            _ => {
                const HEX: &[u8; 16] = b"0123456789abcdef";
                out.extend_from_slice(b"\\u00");
                out.push(HEX[usize::from(b >> 4)]);
                out.push(HEX[usize::from(b & 0xf)]);
            }
        }
    }
    out.extend_from_slice(&bytes[start..]);
}

/// The client address; nothing for a request made inside the process.
fn client(out: &mut Vec<u8>, ip: Option<IpAddr>) {
    match ip {
        Some(IpAddr::V4(v4)) => {
            // `255.255.255.255` at most: built on the stack, copied once.
            let mut buf = [0u8; 15];
            let mut len = 0;
            for (i, o) in v4.octets().into_iter().enumerate() {
                if i > 0 {
                    buf[len] = b'.';
                    len += 1;
                }
                let (digits, n) = OCTETS[usize::from(o)];
                // At most 12 bytes before the last octet's 3.
                buf[len..len + 3].copy_from_slice(&digits);
                len += usize::from(n);
            }
            out.extend_from_slice(&buf[..len]);
        }
        Some(ip @ IpAddr::V6(_)) => {
            use std::io::Write as _;
            // Into the reserved capacity: no allocation.
            let _ = write!(out, "{ip}");
        }
        None => {}
    }
}

/// Calls `$field!(name, kind, value)` for each field of `$line`, in the
/// order both formats write them. A macro rather than a loop over a table:
/// each field's name is then a constant the compiler writes with a move or
/// two, not a copy of a length it learns at run time (a third of the line's
/// cost, measured).
macro_rules! each_field {
    ($field:ident, $line:expr) => {
        $field!("method", text, $line.method);
        $field!("route", escaped, $line.route);
        $field!("status", number, $line.status);
        $field!("cache_status", text, $line.cache_status);
        $field!("resource", escaped, $line.resource);
        $field!("duration_ms", millis, $line.duration);
        $field!("request_id", text, $line.request_id);
        $field!("client", client, $line.client);
        if let Some(peer) = $line.peer {
            $field!("peer", client, Some(peer));
        }
        if let Some(reason) = $line.reason {
            $field!("reason", text, Text::Clean(reason));
        }
    };
}

/// `2026-11-27T10:00:00.123456Z  INFO bloomgate::access: request
/// method="GET" route="/users/{id}" status=200 cache_status="…"
/// resource="users" duration_ms=0.030 request_id="…" client=127.0.0.1`
/// (then `peer=10.0.0.2` when a trusted proxy named the client, and
/// `reason="expired"` for a refusal): the layout of `tracing-subscriber`'s
/// human lines, which the rest of the log keeps.
pub(super) fn human(out: &mut Vec<u8>, t: Stamp, line: &Line<'_>) {
    timestamp(out, t);
    out.extend_from_slice(b"  INFO bloomgate::access: request");
    macro_rules! field {
        ($name:literal, text, $v:expr) => {
            out.extend_from_slice(concat!(" ", $name, "=").as_bytes());
            quoted(out, $v);
        };
        ($name:literal, escaped, $v:expr) => {
            out.extend_from_slice(concat!(" ", $name, "=\"").as_bytes());
            out.extend_from_slice($v.0.as_bytes());
            out.push(b'"');
        };
        ($name:literal, number, $v:expr) => {
            out.extend_from_slice(concat!(" ", $name, "=").as_bytes());
            status(out, $v);
        };
        ($name:literal, millis, $v:expr) => {
            out.extend_from_slice(concat!(" ", $name, "=").as_bytes());
            millis(out, $v);
        };
        // Bare, as `Display` wrote it.
        ($name:literal, client, $v:expr) => {
            out.extend_from_slice(concat!(" ", $name, "=").as_bytes());
            client(out, $v);
        };
    }
    each_field!(field, line);
    out.push(b'\n');
}

/// `{"timestamp":…,"level":"INFO","target":"bloomgate::access","fields":
/// {"message":"request",…}}`: the frame of the rest of the JSON log
/// (`telemetry`'s `TypedJson`).
pub(super) fn json(out: &mut Vec<u8>, t: Stamp, line: &Line<'_>) {
    out.extend_from_slice(b"{\"timestamp\":\"");
    timestamp(out, t);
    out.extend_from_slice(
        b"\",\"level\":\"INFO\",\"target\":\"bloomgate::access\",\"fields\":{\"message\":\"request\"",
    );
    macro_rules! field {
        ($name:literal, text, $v:expr) => {
            out.extend_from_slice(concat!(",\"", $name, "\":").as_bytes());
            quoted(out, $v);
        };
        ($name:literal, escaped, $v:expr) => {
            out.extend_from_slice(concat!(",\"", $name, "\":\"").as_bytes());
            out.extend_from_slice($v.0.as_bytes());
            out.push(b'"');
        };
        ($name:literal, number, $v:expr) => {
            out.extend_from_slice(concat!(",\"", $name, "\":").as_bytes());
            status(out, $v);
        };
        ($name:literal, millis, $v:expr) => {
            out.extend_from_slice(concat!(",\"", $name, "\":").as_bytes());
            millis(out, $v);
        };
        // A string: empty when there is none.
        ($name:literal, client, $v:expr) => {
            out.extend_from_slice(concat!(",\"", $name, "\":\"").as_bytes());
            client(out, $v);
            out.push(b'"');
        };
    }
    each_field!(field, line);
    out.extend_from_slice(b"}}\n");
}

/// A line of the logger's own (lines left out, lines dropped): `message`
/// and counts, in the format of the access lines.
pub(super) fn notice(
    out: &mut Vec<u8>,
    json_format: bool,
    t: Stamp,
    level: &str,
    message: &str,
    counts: &[(&str, u64)],
) {
    if json_format {
        out.extend_from_slice(b"{\"timestamp\":\"");
        timestamp(out, t);
        out.extend_from_slice(b"\",\"level\":");
        quoted(out, Text::Raw(level));
        out.extend_from_slice(b",\"target\":\"bloomgate::access\",\"fields\":{\"message\":");
        quoted(out, Text::Raw(message));
        for (name, n) in counts {
            out.push(b',');
            quoted(out, Text::Raw(name));
            out.push(b':');
            digits(out, *n, 1);
        }
        out.extend_from_slice(b"}}\n");
    } else {
        timestamp(out, t);
        out.extend_from_slice(if level == "WARN" {
            b"  WARN "
        } else {
            b"  INFO "
        });
        out.extend_from_slice(b"bloomgate::access: ");
        // The message is ours, a constant: written as it is, as tracing
        // writes a message.
        out.extend_from_slice(message.as_bytes());
        for (name, n) in counts {
            out.push(b' ');
            out.extend_from_slice(name.as_bytes());
            out.push(b'=');
            digits(out, *n, 1);
        }
        out.push(b'\n');
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::access::Escaped;
    use proptest::prelude::*;

    static ROUTE: Escaped = Escaped::from_static("/users/{id}");
    static USERS: Escaped = Escaped::from_static("users");

    fn line<'a>(request_id: &'a str, route: &'a Escaped) -> Line<'a> {
        Line {
            method: Text::Clean("GET"),
            route,
            status: 200,
            cache_status: Text::Clean("bloomgate; hit"),
            resource: &USERS,
            duration: Duration::from_micros(30),
            request_id: Text::Raw(request_id),
            client: Some("127.0.0.1".parse().unwrap()),
            peer: None,
            reason: None,
        }
    }

    fn at(secs: u64, micros: u32) -> Stamp {
        Stamp { secs, micros }
    }

    #[test]
    fn a_json_line_has_typed_fields() {
        let mut out = Vec::new();
        json(&mut out, at(1_795_780_800, 123), &line("abc", &ROUTE));
        let text = std::str::from_utf8(&out).unwrap();
        assert!(text.ends_with('\n') && text.matches('\n').count() == 1);
        assert!(text.contains("\"duration_ms\":0.030,"), "{text}");
        let v: serde_json::Value = serde_json::from_str(text).unwrap();
        assert_eq!(v["timestamp"], "2026-11-27T12:00:00.000123Z");
        assert_eq!(v["level"], "INFO");
        assert_eq!(v["target"], "bloomgate::access");
        let f = &v["fields"];
        assert_eq!(f["message"], "request");
        assert_eq!(f["method"], "GET");
        assert_eq!(f["route"], "/users/{id}");
        assert_eq!(f["status"], 200);
        assert!(f["status"].is_u64());
        assert_eq!(f["cache_status"], "bloomgate; hit");
        assert_eq!(f["resource"], "users");
        assert!(f["duration_ms"].is_f64());
        assert_eq!(f["duration_ms"].as_f64(), Some(0.03));
        assert_eq!(f["request_id"], "abc");
        assert_eq!(f["client"], "127.0.0.1");
    }

    #[test]
    fn a_human_line_keeps_the_layout_of_the_rest_of_the_log() {
        let mut out = Vec::new();
        let mut l = line("abc", &ROUTE);
        l.duration = Duration::from_micros(12_345_678);
        l.client = Some("::1".parse().unwrap());
        human(&mut out, at(0, 5), &l);
        assert_eq!(
            std::str::from_utf8(&out).unwrap(),
            "1970-01-01T00:00:00.000005Z  INFO bloomgate::access: request method=\"GET\" \
             route=\"/users/{id}\" status=200 cache_status=\"bloomgate; hit\" \
             resource=\"users\" duration_ms=12345.678 request_id=\"abc\" client=::1\n"
        );
        out.clear();
        l.client = None;
        human(&mut out, at(0, 5), &l);
        assert!(out.ends_with(b" client=\n"));
    }

    /// The peer and the reason are written only when there is one, after
    /// the client, in both formats.
    #[test]
    fn a_peer_and_a_reason_are_written_only_when_known() {
        let mut out = Vec::new();
        let mut l = line("abc", &ROUTE);
        json(&mut out, at(0, 0), &l);
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert!(v["fields"].get("peer").is_none() && v["fields"].get("reason").is_none());
        l.client = Some("203.0.113.7".parse().unwrap());
        l.peer = Some("10.0.0.2".parse().unwrap());
        l.reason = Some("audience");
        l.status = 401;
        out.clear();
        json(&mut out, at(0, 0), &l);
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["fields"]["client"], "203.0.113.7");
        assert_eq!(v["fields"]["peer"], "10.0.0.2");
        assert_eq!(v["fields"]["reason"], "audience");
        out.clear();
        human(&mut out, at(0, 0), &l);
        let text = std::str::from_utf8(&out).unwrap();
        assert!(
            text.ends_with(" client=203.0.113.7 peer=10.0.0.2 reason=\"audience\"\n"),
            "{text}"
        );
    }

    #[test]
    fn numbers_are_written_as_decimal() {
        for n in [0u16, 42, 100, 404, 999, 1000, u16::MAX] {
            let mut out = Vec::new();
            status(&mut out, n);
            assert_eq!(out, n.to_string().as_bytes());
        }
    }

    #[test]
    fn durations_are_milliseconds_to_the_microsecond() {
        for (us, text) in [
            (0, "0.000"),
            (1, "0.001"),
            (30, "0.030"),
            (999, "0.999"),
            (1000, "1.000"),
            (1_234_567, "1234.567"),
        ] {
            let mut out = Vec::new();
            millis(&mut out, Duration::from_micros(us));
            assert_eq!(std::str::from_utf8(&out).unwrap(), text);
        }
        // Below a microsecond: cut, not rounded.
        let mut out = Vec::new();
        millis(&mut out, Duration::from_nanos(30_999));
        assert_eq!(out, b"0.030");
    }

    #[test]
    fn notices_are_lines_of_the_same_format() {
        let mut out = Vec::new();
        notice(&mut out, true, at(0, 0), "INFO", "left out", &[("n", 7)]);
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["fields"]["message"], "left out");
        assert_eq!(v["fields"]["n"], 7);
        out.clear();
        notice(&mut out, false, at(0, 0), "WARN", "dropped", &[("n", 7)]);
        assert_eq!(
            out,
            b"1970-01-01T00:00:00.000000Z  WARN bloomgate::access: dropped n=7\n"
        );
    }

    proptest! {
        /// RFC 8259 escaping: any string reads back as itself.
        #[test]
        fn any_string_round_trips_through_serde_json(s in any::<String>()) {
            let mut out = Vec::new();
            quoted(&mut out, Text::Raw(&s));
            let back: String = serde_json::from_slice(&out).unwrap();
            prop_assert_eq!(back, s);
            prop_assert!(!out.contains(&b'\n'));
        }

        /// The word-at-a-time check says what the byte-at-a-time one says.
        #[test]
        fn the_fast_check_agrees_with_the_plain_one(
            s in proptest::collection::vec(prop_oneof![30 => 0x20u8..0x7f, 1 => any::<u8>()], 0..40),
        ) {
            prop_assert_eq!(any_escape(&s), s.iter().any(|&b| needs_escape(b)));
        }

        /// Whatever the strings hold, one line, of at most `bound` bytes,
        /// that parses back to the same fields (JSON), and a human line
        /// with no line break but its last.
        #[test]
        fn any_line_is_one_line_within_its_bound(
            id in any::<String>(),
            route in "[ -~\\t\\n\\r\\x00-\\x1f]{0,40}",
            status in 100u16..600,
            us in any::<u64>(),
            v6 in any::<bool>(),
            refused in any::<bool>(),
        ) {
            let escaped = Escaped::new(&route);
            let mut l = line(&id, &escaped);
            l.status = status;
            l.duration = Duration::from_micros(us);
            if v6 {
                let widest = "ffff:ffff:ffff:ffff:ffff:ffff:255.255.255.255".parse().unwrap();
                l.client = Some(widest);
                l.peer = Some(widest);
            }
            if refused {
                l.reason = Some("unexpected_audience");
            }
            let mut out = Vec::new();
            json(&mut out, at(u64::from(u32::MAX), 999_999), &l);
            prop_assert!(out.len() <= bound(&l));
            prop_assert_eq!(out.iter().filter(|&&b| b == b'\n').count(), 1);
            let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
            prop_assert_eq!(v["fields"]["request_id"].as_str(), Some(id.as_str()));
            prop_assert_eq!(v["fields"]["route"].as_str(), Some(route.as_str()));
            prop_assert_eq!(v["fields"]["status"].as_u64(), Some(u64::from(status)));
            let ms = v["fields"]["duration_ms"].as_f64().unwrap();
            prop_assert!((ms - us as f64 / 1000.0).abs() <= ms.abs() * 1e-12 + 1e-9);
            out.clear();
            human(&mut out, at(0, 0), &l);
            prop_assert!(out.len() <= bound(&l));
            prop_assert_eq!(out.iter().filter(|&&b| b == b'\n').count(), 1);
            prop_assert_eq!(out.last(), Some(&b'\n'));
        }

        /// An IPv4 client is written as `Display` writes it.
        #[test]
        fn any_ipv4_address_is_written_as_display_writes_it(a in any::<std::net::Ipv4Addr>()) {
            let mut out = Vec::new();
            client(&mut out, Some(IpAddr::V4(a)));
            prop_assert_eq!(std::str::from_utf8(&out).unwrap(), a.to_string());
        }

        /// The timestamp is what humantime writes, whatever the second.
        #[test]
        fn timestamps_are_rfc3339_utc_micros(secs in 0u64..253_402_300_800, micros in 0u32..1_000_000) {
            let t = UNIX_EPOCH + Duration::new(secs, micros * 1000);
            let mut out = Vec::new();
            timestamp(&mut out, Stamp::from(t));
            let expected = humantime::format_rfc3339_micros(t).to_string();
            prop_assert_eq!(std::str::from_utf8(&out).unwrap(), expected.as_str());
        }
    }
}
