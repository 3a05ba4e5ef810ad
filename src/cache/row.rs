//! A cached row as HTTP sends it: the JSON body, its ETag, its compressed
//! forms, each stored as one buffer a response cuts its parts from.

use std::hash::{Hash, Hasher};
use std::sync::Arc;

use bytes::Bytes;

use crate::encoding::{self, Coding, Parts, Representation, Variant};

/// A cached row: its JSON body, serialised once, the body's ETag, and its
/// compressed forms.
///
/// Kept to 48 bytes, so that the `Arc` a hit clones and reads is one
/// 64-byte block with its counts (see [`Representation`] for why a hit's
/// lines matter; unit test `a_row_and_its_counts_fit_one_cache_line`).
/// That block is one cache line under mimalloc, the binary's allocator,
/// which aligns a 64-byte block to 64; under glibc's malloc (the tests')
/// it may straddle two.
#[derive(Debug)]
pub struct Row {
    /// The body as sent without a content coding. Its entity tag is quoted
    /// (`"0123456789abcdef"`): a hash of the body, so equal bodies give
    /// equal tags on every replica, formatted once, when the row is loaded.
    pub identity: Representation,
    /// The body in each content coding that shrinks it, made once when the
    /// row enters the cache (see [`crate::encoding`]); `None` for a small
    /// body or with compression off. Behind one thin pointer, not a `Vec`,
    /// for the row's size: most rows have none.
    variants: Option<Box<Variants>>,
}

/// A row's compressed forms (at most one per coding).
#[derive(Debug)]
struct Variants(Vec<Variant>);

impl Row {
    /// A row with no compressed forms.
    pub fn new(body: Bytes) -> Self {
        Self::compressed(body, None)
    }

    /// A row with its compressed forms if the body is at least
    /// `compress_min` bytes (`None`: never).
    pub fn compressed(body: Bytes, compress_min: Option<usize>) -> Self {
        // SipHash with fixed keys: deterministic, and an ETag needs no secret.
        let mut h = std::hash::DefaultHasher::new();
        body.hash(&mut h);
        let tag = format!("\"{:016x}\"", h.finish());
        let mut variants = encoding::compress(&body, tag.as_bytes(), compress_min);
        variants.shrink_to_fit();
        Self {
            identity: Representation::new(tag.as_bytes(), &body),
            variants: (!variants.is_empty()).then(|| Box::new(Variants(variants))),
        }
    }

    /// The identity body.
    pub fn body(&self) -> &[u8] {
        self.identity.body()
    }

    /// The compressed forms.
    pub fn variants(&self) -> &[Variant] {
        self.variants.as_deref().map_or(&[], |v| &v.0)
    }

    /// The representation in `coding`, if the row has one.
    pub fn variant(&self, coding: Coding) -> Option<&Variant> {
        self.variants().iter().find(|v| v.coding == coding)
    }

    /// The representation in `coding`, or identity if the row has none in
    /// it: the one [`Self::sent`] cuts (tests compare the two).
    #[cfg(test)]
    pub fn representation(&self, coding: Coding) -> &Representation {
        self.at(self.index(coding))
    }

    /// What a response sends of the representation in `coding` (identity if
    /// the row has none in it): its `ETag`,
    /// `Content-Length` and body as slices of one `Bytes` that owns this
    /// row, so the row lives as long as the response needs it.
    ///
    /// The cost: a response keeps the whole row, every coding of it, until
    /// its last part is dropped, even when the cache has let the row go (an
    /// eviction or invalidation while a slow client reads). That memory is
    /// outside `cache.max_bytes`: the whole row, not the one representation
    /// sent.
    ///
    /// Why a `Bytes` per response rather than clones of one stored with the
    /// row: a stored one keeps its count in a block of its own, one more
    /// cache line for a hit to fetch on a large working set. This one's
    /// count is in a block allocated here, which the allocator's
    /// thread-local free list hands back already in cache, and freed with
    /// the response.
    pub fn sent(self: Arc<Self>, coding: Coding) -> Parts {
        let variant = self.index(coding);
        let layout = self.at(variant).layout();
        layout.cut(&Bytes::from_owner(RepresentationHold {
            row: self,
            variant,
        }))
    }

    /// Which variant is in `coding`: an index, or `None` for identity.
    fn index(&self, coding: Coding) -> Option<usize> {
        self.variants().iter().position(|v| v.coding == coding)
    }

    fn at(&self, variant: Option<usize>) -> &Representation {
        variant.map_or(&self.identity, |i| &self.variants()[i].rep)
    }
}

/// A response's hold on one representation of a row ([`Row::sent`]):
/// keeps the row alive while any part cut from it is.
struct RepresentationHold {
    row: Arc<Row>,
    /// Which: an index into the row's variants, or identity.
    variant: Option<usize>,
}

impl AsRef<[u8]> for RepresentationHold {
    fn as_ref(&self) -> &[u8] {
        self.row.at(self.variant).bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn etag_depends_on_body() {
        assert_eq!(
            Row::new(Bytes::from("a")).identity.tag().to_vec(),
            Row::new(Bytes::from("a")).identity.tag().to_vec()
        );
        assert_ne!(
            Row::new(Bytes::from("a")).identity.tag().to_vec(),
            Row::new(Bytes::from("b")).identity.tag().to_vec()
        );
    }

    /// The row's `Arc` (counts and row) is one 64-byte block, which a hit
    /// reads whole (its alignment is the allocator's: see [`Row`]).
    #[test]
    fn a_row_and_its_counts_fit_one_cache_line() {
        assert_eq!(std::mem::size_of::<Row>(), 48);
        assert_eq!(
            std::mem::size_of::<Row>() + 2 * std::mem::size_of::<usize>(),
            64
        );
        let row = Row::compressed(Bytes::from(vec![b'a'; 4096]), Some(1024));
        assert_eq!(row.variants().len(), 3);
        assert_eq!(row.body(), &[b'a'; 4096][..]);
        assert!(Row::new(Bytes::from("x")).variants().is_empty());
    }

    /// A response's parts are the representation it asked for, exactly,
    /// and hold the row until the last of them is dropped.
    #[test]
    fn sent_parts_are_the_representation_and_hold_the_row() {
        let row = Arc::new(Row::compressed(
            Bytes::from("the quick brown fox ".repeat(200)),
            Some(1024),
        ));
        let identity = row.identity.tag().to_vec();
        for coding in [Coding::Identity, Coding::Gzip, Coding::Br, Coding::Zstd] {
            let rep = row.representation(coding);
            let Parts { etag, length, body } = row.clone().sent(coding);
            // The coding's own representation: its tag is identity's with
            // the token in the quotes.
            let want = match coding {
                Coding::Identity => identity.clone(),
                c => [&identity[..17], b"-", c.token().as_bytes(), b"\""].concat(),
            };
            assert_eq!(etag.as_bytes(), want, "{coding:?}");
            assert_eq!(etag.as_bytes(), rep.tag());
            assert_eq!(length, rep.body().len().to_string());
            assert_eq!(&body[..], rep.body());
            // Cut from the row, not copied.
            assert_eq!(etag.as_bytes().as_ptr(), rep.tag().as_ptr());
            assert_eq!(body.as_ptr(), rep.body().as_ptr());
            assert_eq!(Arc::strong_count(&row), 2, "held by the parts");
            drop(body);
            assert_eq!(Arc::strong_count(&row), 2, "held by the headers still");
            drop((etag, length));
            assert_eq!(Arc::strong_count(&row), 1);
        }
        // A coding the row has no variant in sends identity, all of it.
        let small = Arc::new(Row::new(Bytes::from("{}")));
        let sent = small.clone().sent(Coding::Br);
        assert_eq!(&sent.body[..], b"{}");
        assert_eq!(sent.etag.as_bytes(), small.identity.tag());
        assert_eq!(sent.length, "2");
    }
}
