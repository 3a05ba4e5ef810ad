//! Content codings of a row: compressed once, when the row enters the cache,
//! and chosen per request from `Accept-Encoding`.
//!
//! Guarantees:
//! - **Compressed once.** A row's gzip, br and zstd bodies are made when it
//!   is stored, never on a hit; a body under the threshold
//!   (`cache.compress_min_bytes`) or one a coding does not shrink keeps only
//!   its identity form.
//! - **Each representation has its own strong ETag** (RFC 9110 §8.8.3): the
//!   identity tag with the coding appended (`"…-br"`), so a downstream cache
//!   never answers a client with a body in a coding it did not ask for, and
//!   `If-None-Match` works for each.
//! - **Negotiation follows RFC 9110 §12.5.3**: the acceptable coding with the
//!   highest quality value wins, ties broken by size (br, zstd, gzip, then
//!   identity);
//!   `identity` is always possible unless refused explicitly
//!   (`identity;q=0`, or `*;q=0` without naming it), and even then it is
//!   what a client that accepts none of ours gets (a 406 would help nobody).
//!
//! No I/O, no knowledge of the cache or HTTP stack beyond header bytes.

use std::io::Write;

use axum::http::HeaderValue;
use bytes::Bytes;

/// A content coding this gateway can send.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Coding {
    Identity,
    Gzip,
    Br,
    Zstd,
}

impl Coding {
    /// By preference when quality values tie: smallest output first.
    pub const COMPRESSED: [Coding; 3] = [Coding::Br, Coding::Zstd, Coding::Gzip];

    /// The `Content-Encoding` token.
    pub fn token(self) -> &'static str {
        match self {
            Coding::Identity => "identity",
            Coding::Gzip => "gzip",
            Coding::Br => "br",
            Coding::Zstd => "zstd",
        }
    }
}

/// One compressed representation of a row.
#[derive(Debug)]
pub struct Variant {
    pub coding: Coding,
    /// Its ETag is the identity tag with `-<coding>` inside the quotes.
    pub rep: Representation,
}

/// One stored representation of a row: its ETag, its `Content-Length`
/// digits and its body, in one buffer, as a response sends them.
///
/// Guarantees: the [`Parts`] cut from its own bytes ([`Layout::cut`] given
/// a `Bytes` of [`Self::bytes`], or [`Self::parts`]) are exactly what it was
/// made from (the tag, the body's length in decimal, the body).
///
/// Why one buffer: a hit reads the cached row and sends all three, and the
/// rows a gateway serves are far more than its cores' caches hold, so every
/// separate heap block a hit reads is a cache miss of its own (on a
/// 10,000-row working set a hit missed ~11.5 lines of one core's 2 MB L2
/// where bare axum missed none; `bench/profile.sh cachesim`). Apart, the
/// body, the tag and the length were three buffers, each with a reference
/// count in a block of its own (`bytes`' shared header), and their handles
/// made the row 136 bytes. Here they are one buffer, and a response holds
/// it through a `Bytes` of its own that owns the row (`cache::Row::sent`),
/// whose count is in a block the response has just allocated, so hot.
///
/// The row's copy of the body is made once, when it enters the cache (and,
/// with the cache off, once per request, beside that request's query).
#[derive(Debug)]
pub struct Representation {
    /// The tag, the length's digits, then the body. Never cloned, so it
    /// never gets `bytes`' shared count block. A `Bytes` rather than a
    /// `Box<[u8]>` for its size: 32 bytes make the row's `Arc` exactly one
    /// 64-byte block, which mimalloc aligns to a cache line; 16 would make
    /// it 48 bytes, and one in two such blocks straddles two lines.
    buf: Bytes,
    layout: Layout,
}

/// Where a representation's parts lie in its buffer.
#[derive(Clone, Copy, Debug)]
pub struct Layout {
    tag_len: u8,
    length_len: u8,
}

/// What a response sends of one representation: header values and body,
/// slices of one `Bytes`.
#[derive(Debug)]
pub struct Parts {
    pub etag: HeaderValue,
    pub length: HeaderValue,
    pub body: Bytes,
}

impl Layout {
    fn head(self) -> usize {
        usize::from(self.tag_len) + usize::from(self.length_len)
    }

    /// The parts of `whole`, which holds the bytes of the representation
    /// this layout is of ([`Representation::bytes`]): slices, not copies.
    pub fn cut(self, whole: &Bytes) -> Parts {
        let tag = usize::from(self.tag_len);
        Parts {
            etag: HeaderValue::from_maybe_shared(whole.slice(..tag))
                .expect("checked in `Representation::new`"),
            length: HeaderValue::from_maybe_shared(whole.slice(tag..self.head()))
                .expect("digits are a valid header value"),
            body: whole.slice(self.head()..),
        }
    }
}

impl Representation {
    /// `tag` is a quoted entity tag, as sent (ours are at most 23 bytes).
    ///
    /// # Panics
    ///
    /// If `tag` is not a valid header value or is over 255 bytes: checked
    /// here, once, so that cutting the `ETag` cannot fail on a hit.
    pub fn new(tag: &[u8], body: &[u8]) -> Self {
        assert!(
            HeaderValue::from_bytes(tag).is_ok(),
            "an entity tag is a valid header value"
        );
        let length = body.len().to_string();
        let mut buf = Vec::with_capacity(tag.len() + length.len() + body.len());
        buf.extend_from_slice(tag);
        buf.extend_from_slice(length.as_bytes());
        buf.extend_from_slice(body);
        Self {
            buf: Bytes::from(buf),
            layout: Layout {
                tag_len: u8::try_from(tag.len()).expect("an entity tag of at most 255 bytes"),
                length_len: u8::try_from(length.len()).expect("a length of at most 20 digits"),
            },
        }
    }

    /// The whole buffer, for a `Bytes` that owns it to [`Layout::cut`].
    pub fn bytes(&self) -> &[u8] {
        &self.buf
    }

    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// The parts, cut from a copy of the buffer, for tests; a response cuts
    /// them from the row it holds (`cache::Row::sent`).
    #[cfg(test)]
    pub fn parts(&self) -> Parts {
        self.layout.cut(&Bytes::copy_from_slice(&self.buf))
    }

    /// The entity tag's bytes, quotes included, for `If-None-Match`.
    pub fn tag(&self) -> &[u8] {
        &self.buf[..usize::from(self.layout.tag_len)]
    }

    /// The body's bytes.
    pub fn body(&self) -> &[u8] {
        &self.buf[self.layout.head()..]
    }

    /// Bytes held: the body, its tag and its length's digits.
    pub fn stored_len(&self) -> usize {
        self.buf.len()
    }
}

/// Compresses `body` in every coding that makes it smaller, if it is at
/// least `min_bytes` long (`None`: never). `etag` is the identity tag,
/// quoted.
pub fn compress(body: &[u8], etag: &[u8], min_bytes: Option<usize>) -> Vec<Variant> {
    let Some(min) = min_bytes else {
        return Vec::new();
    };
    if body.len() < min {
        return Vec::new();
    }
    Coding::COMPRESSED
        .into_iter()
        .filter_map(|coding| {
            let out = encode(coding, body)?;
            // A coding that does not save at least a little is not worth a
            // second ETag and the client's CPU.
            (out.len() + 32 < body.len()).then(|| Variant {
                coding,
                rep: Representation::new(&tagged(etag, coding), &out),
            })
        })
        .collect()
}

fn encode(coding: Coding, body: &[u8]) -> Option<Vec<u8>> {
    match coding {
        Coding::Identity => None,
        Coding::Gzip => {
            let mut e = flate2::write::GzEncoder::new(
                Vec::with_capacity(body.len() / 2),
                flate2::Compression::new(6),
            );
            e.write_all(body).ok()?;
            e.finish().ok()
        }
        Coding::Br => {
            let mut out = Vec::with_capacity(body.len() / 2);
            let params = brotli::enc::BrotliEncoderParams {
                quality: 6,
                lgwin: 22,
                ..Default::default()
            };
            brotli::BrotliCompress(&mut &body[..], &mut out, &params).ok()?;
            Some(out)
        }
        Coding::Zstd => zstd::bulk::compress(body, 3).ok(),
    }
}

/// `"abc"` + br → `"abc-br"`.
fn tagged(etag: &[u8], coding: Coding) -> Vec<u8> {
    let inner = etag
        .strip_prefix(b"\"")
        .and_then(|e| e.strip_suffix(b"\""))
        .unwrap_or(etag);
    let mut v = Vec::with_capacity(etag.len() + 6);
    v.push(b'"');
    v.extend_from_slice(inner);
    v.push(b'-');
    v.extend_from_slice(coding.token().as_bytes());
    v.push(b'"');
    v
}

/// The coding to send, given the request's `Accept-Encoding` values and
/// whether a variant exists in each coding.
pub fn negotiate<'a>(
    accept: impl Iterator<Item = &'a [u8]>,
    available: impl Fn(Coding) -> bool,
) -> Coding {
    // Quality in thousandths per coding, as the header states it; `star`
    // for every coding not named.
    let mut q: [Option<u16>; 4] = [None; 4];
    let mut star: Option<u16> = None;
    let mut any = false;
    for value in accept {
        let Ok(value) = std::str::from_utf8(value) else {
            continue;
        };
        for item in value.split(',') {
            let mut parts = item.split(';');
            let name = parts.next().unwrap_or("").trim();
            if name.is_empty() {
                continue;
            }
            any = true;
            let quality = parts
                .filter_map(|p| {
                    let (k, v) = p.split_once('=')?;
                    k.trim()
                        .eq_ignore_ascii_case("q")
                        .then(|| parse_q(v.trim()))
                })
                .next()
                .unwrap_or(Some(1000));
            let Some(quality) = quality else {
                // A malformed weight: ignore the item rather than guess.
                continue;
            };
            // Compared in place: lowercasing a copy would allocate on every
            // hit of a compressed row.
            let is = |token: &str| name.eq_ignore_ascii_case(token);
            let slot = if is("identity") {
                0
            } else if is("gzip") || is("x-gzip") {
                1
            } else if is("br") {
                2
            } else if is("zstd") {
                3
            } else if name == "*" {
                star = Some(quality);
                continue;
            } else {
                continue;
            };
            q[slot] = Some(q[slot].map_or(quality, |old| old.max(quality)));
        }
    }
    if !any {
        // No header (or an empty one): any coding is acceptable, but a
        // client that says nothing gets what every client can read.
        return Coding::Identity;
    }
    let quality = |c: Coding| -> u16 {
        let slot = match c {
            Coding::Identity => 0,
            Coding::Gzip => 1,
            Coding::Br => 2,
            Coding::Zstd => 3,
        };
        match (q[slot], star) {
            (Some(v), _) => v,
            (None, Some(s)) => s,
            // Identity is acceptable unless refused; other codings only if
            // named (or covered by `*`).
            (None, None) if c == Coding::Identity => 1,
            (None, None) => 0,
        }
    };
    // The first compressed coding with the highest weight (preference
    // order breaks ties); it beats identity unless identity weighs more.
    let mut best: Option<(u16, Coding)> = None;
    for c in Coding::COMPRESSED {
        let qc = quality(c);
        if qc > 0 && available(c) && best.is_none_or(|(b, _)| qc > b) {
            best = Some((qc, c));
        }
    }
    match best {
        Some((qc, c)) if qc >= quality(Coding::Identity) => c,
        _ => Coding::Identity,
    }
}

/// `0`, `0.5`, `1.000` → thousandths; anything else `None` (RFC 9110 §12.4.2).
fn parse_q(v: &str) -> Option<u16> {
    let (int, frac) = v.split_once('.').unwrap_or((v, ""));
    if frac.len() > 3 || !frac.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let mut thousandths: u16 = 0;
    for (i, b) in frac.bytes().enumerate() {
        thousandths += u16::from(b - b'0') * [100, 10, 1][i];
    }
    match int {
        "0" => Some(thousandths),
        "1" if thousandths == 0 => Some(1000),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::io::Read;

    fn pick(header: &str) -> Coding {
        negotiate(std::iter::once(header.as_bytes()), |_| true)
    }

    #[test]
    fn quality_values_decide() {
        assert_eq!(pick("gzip"), Coding::Gzip);
        assert_eq!(pick("gzip, br, zstd"), Coding::Br);
        assert_eq!(pick("gzip;q=1, br;q=0.5"), Coding::Gzip);
        assert_eq!(pick("br;q=0, gzip;q=0.1"), Coding::Gzip);
        assert_eq!(pick("zstd;q=0.9, br;q=0.8"), Coding::Zstd);
        assert_eq!(pick("*"), Coding::Br);
        assert_eq!(pick("*;q=0.5, br;q=0"), Coding::Zstd);
        assert_eq!(pick("identity"), Coding::Identity);
        assert_eq!(pick("deflate, compress"), Coding::Identity);
        assert_eq!(pick(""), Coding::Identity);
        // Identity outranks a coding with a lower weight.
        assert_eq!(pick("identity;q=1, gzip;q=0.5"), Coding::Identity);
        // Refused identity with nothing else acceptable: identity anyway.
        assert_eq!(pick("identity;q=0"), Coding::Identity);
        assert_eq!(pick("identity;q=0, gzip"), Coding::Gzip);
        // Malformed weights are ignored, not read as 1.
        assert_eq!(pick("br;q=2, gzip"), Coding::Gzip);
        assert_eq!(pick("br;q=0.0001, gzip;q=0.5"), Coding::Gzip);
        assert_eq!(pick("GZIP;Q=0.5"), Coding::Gzip);
    }

    #[test]
    fn only_available_codings_are_chosen() {
        let only_gzip = |c: Coding| c == Coding::Gzip;
        assert_eq!(
            negotiate(std::iter::once(&b"br, gzip;q=0.5"[..]), only_gzip),
            Coding::Gzip
        );
        assert_eq!(
            negotiate(std::iter::once(&b"br"[..]), only_gzip),
            Coding::Identity
        );
    }

    #[test]
    fn small_or_incompressible_bodies_stay_identity() {
        let etag = b"\"0123456789abcdef\"";
        assert!(compress(&[b'x'; 500], etag, Some(1024)).is_empty());
        assert!(compress(&[b'x'; 5000], etag, None).is_empty());
        let mut noise = vec![0u8; 4096];
        getrandom::fill(&mut noise).unwrap();
        assert!(compress(&noise, etag, Some(1024)).is_empty());
        let v = compress(&[b'x'; 5000], etag, Some(1024));
        let codings: Vec<Coding> = v.iter().map(|v| v.coding).collect();
        assert_eq!(codings, Coding::COMPRESSED);
        assert_eq!(v[0].rep.parts().etag, "\"0123456789abcdef-br\"");
    }

    /// What a response sends comes back exactly as made, cut from one
    /// buffer: the tag, the length's digits, the body.
    #[test]
    fn a_representation_is_its_tag_length_and_body_in_one_buffer() {
        let tag = b"\"0123456789abcdef\"";
        let large = vec![b'x'; 100_000];
        for body in [&b"{\"id\":1}"[..], b"", &large[..]] {
            let rep = Representation::new(tag, body);
            let Parts {
                etag,
                length,
                body: got,
            } = rep.parts();
            assert_eq!(etag.as_bytes(), tag);
            assert_eq!(rep.tag(), tag);
            assert_eq!(length, body.len().to_string());
            assert_eq!(&got[..], body);
            assert_eq!(rep.body(), body);
            assert_eq!(rep.bytes(), [&tag[..], length.as_bytes(), body].concat());
            assert_eq!(rep.stored_len(), tag.len() + length.len() + body.len());
            assert_eq!(
                etag.as_bytes().as_ptr_range().end,
                length.as_bytes().as_ptr()
            );
            if !body.is_empty() {
                assert_eq!(length.as_bytes().as_ptr_range().end, got.as_ptr());
            }
        }
    }

    /// A tag that could not be sent is refused when the row is made, not on
    /// every hit.
    #[test]
    #[should_panic(expected = "an entity tag is a valid header value")]
    fn a_tag_that_is_no_header_value_is_refused_when_made() {
        Representation::new(b"\"a\nb\"", b"{}");
    }

    fn decode(v: &Variant) -> Vec<u8> {
        let mut out = Vec::new();
        let body = v.rep.body();
        match v.coding {
            Coding::Gzip => {
                flate2::read::GzDecoder::new(body)
                    .read_to_end(&mut out)
                    .unwrap();
            }
            Coding::Br => {
                brotli::BrotliDecompress(&mut &body[..], &mut out).unwrap();
            }
            Coding::Zstd => out = zstd::decode_all(body).unwrap(),
            Coding::Identity => out = body.to_vec(),
        }
        out
    }

    proptest! {
        /// Every variant decodes to the body, is smaller, and has a tag of
        /// its own; a body under the minimum has none, and one over it
        /// (text of words: it always compresses) has some.
        #[test]
        fn variants_round_trip(words in proptest::collection::vec("[a-z]{1,8}", 200..800)) {
            let body = serde_json::json!({ "body": words.join(" ") }).to_string();
            let etag = b"\"feedfacecafebeef\"";
            let variants = compress(body.as_bytes(), etag, Some(1024));
            prop_assert_eq!(variants.is_empty(), body.len() < 1024, "{} bytes", body.len());
            let mut tags = std::collections::HashSet::new();
            tags.insert(Bytes::from_static(etag));
            for v in &variants {
                prop_assert_eq!(decode(v), body.as_bytes());
                prop_assert!(v.rep.body().len() < body.len());
                prop_assert_eq!(v.rep.parts().length, v.rep.body().len().to_string());
                prop_assert!(tags.insert(Bytes::copy_from_slice(v.rep.tag())));
            }
        }
    }
}
