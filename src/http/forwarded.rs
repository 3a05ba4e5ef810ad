//! The caller behind trusted proxies: who a request is from when a load
//! balancer or an ingress (`server.trusted_proxies`) passes it on, read
//! from the one header they write (`server.forwarded_header`:
//! `X-Forwarded-For`, or RFC 7239's `Forwarded` and its `for=`).
//!
//! # The rule
//! - From a peer that is not trusted, the header is ignored: the caller
//!   is the peer.
//! - From a trusted peer, the header's lines are joined in order (a proxy
//!   may append a line instead of a list element) and read from the right.
//!   The caller is the first address that is not itself trusted. If every
//!   address is trusted, the caller is the leftmost of them; with no
//!   address at all, the peer.
//! - An entry that is no address (`unknown`, an obfuscated `_node`, an
//!   element without `for=`, garbage) where the walk reaches it ends the
//!   walk: the caller is then the last trusted address read (the peer if
//!   none), the nearest hop known, never a guess.
//!
//! # Guarantees (property-tested below)
//! - Whatever a client writes into the header itself, left of what the
//!   trusted proxies appended (more addresses, trusted ones, quotes,
//!   commas, lines, bytes that are no text), the caller is the address
//!   the first trusted proxy saw: the walk stops at it and never reads
//!   further left. For `Forwarded`, whose quoted strings may hold commas,
//!   the elements are split from the right too, so that a client's
//!   unbalanced quote cannot shift the split of the elements right of it.
//! - A header from a peer that is not trusted changes nothing.
//! - Splitting a list into lines at its commas changes nothing.
//! - The caller is an address as the rate limiter and the access line
//!   take it: an IPv4-mapped IPv6 address is its IPv4 address.
//!
//! Used for the rate limits keyed by address and the access line's
//! `client`, and nothing else: no route, no decision of the access checks
//! reads it (the admin listener's audit lines keep the connection's
//! address). Allocates nothing.

use std::net::{IpAddr, Ipv6Addr};

use axum::http::{HeaderMap, HeaderName};

use crate::config::{Cidr, ForwardedHeader};

static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
static FORWARDED: HeaderName = HeaderName::from_static("forwarded");

/// `server.trusted_proxies` and `server.forwarded_header`, prepared.
#[derive(Clone, Debug)]
pub struct Forwarded {
    trusted: Box<[Cidr]>,
    header: ForwardedHeader,
}

/// A request whose header named a caller other than its peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Named {
    /// The connection's address.
    pub peer: IpAddr,
    pub caller: IpAddr,
}

impl Forwarded {
    /// `None` without trusted proxies: then nothing is read.
    pub fn new(trusted: &[Cidr], header: ForwardedHeader) -> Option<Self> {
        (!trusted.is_empty()).then(|| Self {
            trusted: trusted.into(),
            header,
        })
    }

    fn trusts(&self, ip: IpAddr) -> bool {
        self.trusted.iter().any(|n| n.contains(ip))
    }

    /// The caller of a request from `peer` with `headers`, when it is not
    /// the peer itself.
    pub fn named(&self, peer: IpAddr, headers: &HeaderMap) -> Option<Named> {
        // The header is not even looked up for another peer.
        if !self.trusts(peer) {
            return None;
        }
        let name = match self.header {
            ForwardedHeader::XForwardedFor => &X_FORWARDED_FOR,
            ForwardedHeader::Forwarded => &FORWARDED,
        };
        let lines = headers.get_all(name).iter().map(|v| v.as_bytes());
        let caller = caller(peer, |ip| self.trusts(ip), self.header, lines);
        (caller != peer).then_some(Named { peer, caller })
    }
}

/// The rule of the module doc: the caller of a request from `peer` whose
/// header came in `lines`, in order, trusting what `trusts` says.
fn caller<'a>(
    peer: IpAddr,
    trusts: impl Fn(IpAddr) -> bool,
    header: ForwardedHeader,
    lines: impl DoubleEndedIterator<Item = &'a [u8]>,
) -> IpAddr {
    if !trusts(peer) {
        return peer;
    }
    let mut nearest = peer;
    for line in lines.rev() {
        let mut entries = Entries { rest: line, header };
        for entry in &mut entries {
            let Some(ip) = entry else {
                return nearest;
            };
            let ip = ip.to_canonical();
            if !trusts(ip) {
                return ip;
            }
            nearest = ip;
        }
    }
    nearest
}

/// One line's entries from the right: `Some(address)` or `None` for an
/// entry that names none; empty list elements are skipped (RFC 9110
/// §5.6.1).
struct Entries<'a> {
    rest: &'a [u8],
    header: ForwardedHeader,
}

impl Iterator for Entries<'_> {
    type Item = Option<IpAddr>;

    fn next(&mut self) -> Option<Option<IpAddr>> {
        loop {
            if self.rest.is_empty() {
                return None;
            }
            let element = match self.header {
                ForwardedHeader::XForwardedFor => {
                    let at = self.rest.iter().rposition(|&b| b == b',');
                    let element = &self.rest[at.map_or(0, |i| i + 1)..];
                    self.rest = &self.rest[..at.unwrap_or(0)];
                    element
                }
                ForwardedHeader::Forwarded => {
                    let (rest, element) = last_element(self.rest);
                    self.rest = rest;
                    element
                }
            };
            let element = trim(element);
            if element.is_empty() {
                continue;
            }
            return Some(match self.header {
                ForwardedHeader::XForwardedFor => node(element),
                ForwardedHeader::Forwarded => for_of(element).and_then(node),
            });
        }
    }
}

/// The last element of a `Forwarded` list and what is left of it: the
/// split at the last comma outside a quoted string, found from the right
/// (so only the bytes of this element are read).
fn last_element(line: &[u8]) -> (&[u8], &[u8]) {
    let mut quoted = false;
    let mut i = line.len();
    while i > 0 {
        i -= 1;
        match line[i] {
            b'"' if quoted => {
                // Escaped when preceded by an odd run of backslashes.
                let slashes = line[..i].iter().rev().take_while(|&&b| b == b'\\').count();
                if slashes % 2 == 0 {
                    quoted = false;
                }
            }
            b'"' => quoted = true,
            b',' if !quoted => return (&line[..i], &line[i + 1..]),
            _ => {}
        }
    }
    (&[], line)
}

/// The value of the one `for` parameter of a `Forwarded` element (`None`
/// without one, or with two), unquoted.
fn for_of(element: &[u8]) -> Option<&[u8]> {
    let mut found = None;
    let mut rest = element;
    while !rest.is_empty() {
        // The pair up to the next `;` outside a quoted string.
        let mut quoted = false;
        let mut end = rest.len();
        let mut i = 0;
        while i < rest.len() {
            match rest[i] {
                b'\\' if quoted => i += 1,
                b'"' => quoted = !quoted,
                b';' if !quoted => {
                    end = i;
                    break;
                }
                _ => {}
            }
            i += 1;
        }
        let pair = trim(&rest[..end]);
        rest = rest.get(end + 1..).unwrap_or_default();
        let Some(eq) = pair.iter().position(|&b| b == b'=') else {
            continue;
        };
        if !trim(&pair[..eq]).eq_ignore_ascii_case(b"for") {
            continue;
        }
        if found.is_some() {
            // RFC 7239 §4: a parameter occurs at most once per element.
            return None;
        }
        let value = trim(&pair[eq + 1..]);
        found = Some(match value {
            [b'"', inner @ .., b'"'] if !inner.contains(&b'\\') => inner,
            // An address needs no escape: an escaped one is not an address.
            [b'"', ..] => return None,
            v => v,
        });
    }
    found
}

/// A node as the headers write one: `192.0.2.1`, `192.0.2.1:8080`,
/// `2001:db8::1`, `[2001:db8::1]`, `[2001:db8::1]:8080`.
fn node(text: &[u8]) -> Option<IpAddr> {
    let text = std::str::from_utf8(trim(text)).ok()?;
    if let Some(bracketed) = text.strip_prefix('[') {
        let (v6, rest) = bracketed.split_once(']')?;
        if !(rest.is_empty() || rest.strip_prefix(':').is_some_and(port)) {
            return None;
        }
        return v6.parse::<Ipv6Addr>().ok().map(IpAddr::V6);
    }
    if let Ok(ip) = text.parse::<IpAddr>() {
        return Some(ip);
    }
    let (v4, p) = text.split_once(':')?;
    port(p).then(|| v4.parse().ok().map(IpAddr::V4)).flatten()
}

fn port(p: &str) -> bool {
    !p.is_empty() && p.len() <= 5 && p.bytes().all(|b| b.is_ascii_digit())
}

/// Without the optional whitespace (spaces and tabs) around it.
fn trim(b: &[u8]) -> &[u8] {
    let ows = |c: &u8| *c == b' ' || *c == b'\t';
    let start = b.iter().position(|c| !ows(c)).unwrap_or(b.len());
    let end = b.iter().rposition(|c| !ows(c)).map_or(start, |i| i + 1);
    &b[start..end]
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;
    use proptest::prelude::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    /// Trusted: 10.0.0.0/8 and 2001:db8::/32.
    fn trusted(ip: IpAddr) -> bool {
        ["10.0.0.0/8", "2001:db8::/32"]
            .iter()
            .any(|n| n.parse::<Cidr>().unwrap().contains(ip))
    }

    fn of(peer: &str, header: ForwardedHeader, lines: &[&str]) -> IpAddr {
        caller(
            ip(peer),
            trusted,
            header,
            lines.iter().map(|l| l.as_bytes()),
        )
    }

    fn xff(peer: &str, lines: &[&str]) -> IpAddr {
        of(peer, ForwardedHeader::XForwardedFor, lines)
    }

    fn fwd(peer: &str, lines: &[&str]) -> IpAddr {
        of(peer, ForwardedHeader::Forwarded, lines)
    }

    #[test]
    fn the_first_untrusted_address_from_the_right_is_the_caller() {
        assert_eq!(xff("10.0.0.1", &["203.0.113.7"]), ip("203.0.113.7"));
        assert_eq!(
            xff("10.0.0.1", &["198.51.100.1, 203.0.113.7, 10.0.0.9"]),
            ip("203.0.113.7"),
            "the client's own entry, left of the caller, is ignored"
        );
        assert_eq!(
            xff("10.0.0.1", &["10.9.9.9, 203.0.113.7:4711,,  10.0.0.9 "]),
            ip("203.0.113.7"),
            "a port, empty elements and whitespace"
        );
        assert_eq!(
            xff("10.0.0.1", &["[2001:db9::7]:443, [2001:db8::1]"]),
            ip("2001:db9::7")
        );
        assert_eq!(xff("10.0.0.1", &["::ffff:203.0.113.7"]), ip("203.0.113.7"));
        // Every hop trusted: the leftmost; no header: the peer.
        assert_eq!(xff("10.0.0.1", &["10.1.1.1, 10.2.2.2"]), ip("10.1.1.1"));
        assert_eq!(xff("10.0.0.1", &[]), ip("10.0.0.1"));
        assert_eq!(xff("10.0.0.1", &[" , "]), ip("10.0.0.1"));
    }

    #[test]
    fn repeated_lines_are_one_list_in_order() {
        assert_eq!(
            xff(
                "10.0.0.1",
                &["198.51.100.1", "203.0.113.7, 10.0.0.2", "10.0.0.3"]
            ),
            ip("203.0.113.7")
        );
        assert_eq!(
            fwd(
                "10.0.0.1",
                &["for=198.51.100.1", "for=203.0.113.7", "for=10.0.0.3"]
            ),
            ip("203.0.113.7")
        );
    }

    #[test]
    fn a_header_from_an_untrusted_peer_is_ignored() {
        assert_eq!(xff("198.51.100.9", &["203.0.113.7"]), ip("198.51.100.9"));
        let f = Forwarded::new(
            &["10.0.0.0/8".parse().unwrap()],
            ForwardedHeader::XForwardedFor,
        )
        .unwrap();
        let mut h = HeaderMap::new();
        h.insert("x-forwarded-for", HeaderValue::from_static("203.0.113.7"));
        assert_eq!(f.named(ip("198.51.100.9"), &h), None);
        assert_eq!(
            f.named(ip("10.0.0.1"), &h),
            Some(Named {
                peer: ip("10.0.0.1"),
                caller: ip("203.0.113.7")
            })
        );
        // Only the configured header is read: the other says nothing.
        let mut other = HeaderMap::new();
        other.insert("forwarded", HeaderValue::from_static("for=203.0.113.7"));
        assert_eq!(f.named(ip("10.0.0.1"), &other), None);
        assert!(Forwarded::new(&[], ForwardedHeader::Forwarded).is_none());
    }

    #[test]
    fn what_is_no_address_ends_the_walk_at_the_nearest_known_hop() {
        assert_eq!(xff("10.0.0.1", &["203.0.113.7, unknown"]), ip("10.0.0.1"));
        assert_eq!(
            xff("10.0.0.1", &["203.0.113.7, garbage, 10.0.0.5"]),
            ip("10.0.0.5")
        );
        assert_eq!(xff("10.0.0.1", &["fe80::1%eth0"]), ip("10.0.0.1"));
        assert_eq!(xff("10.0.0.1", &["203.0.113.7:http"]), ip("10.0.0.1"));
        assert_eq!(
            fwd("10.0.0.1", &["for=203.0.113.7, for=unknown"]),
            ip("10.0.0.1")
        );
        assert_eq!(
            fwd("10.0.0.1", &["for=203.0.113.7, for=_hidden"]),
            ip("10.0.0.1")
        );
        assert_eq!(
            fwd("10.0.0.1", &["for=203.0.113.7, proto=https;by=10.0.0.2"]),
            ip("10.0.0.1"),
            "an element without for="
        );
        assert_eq!(
            fwd("10.0.0.1", &["for=203.0.113.7;for=198.51.100.1"]),
            ip("10.0.0.1"),
            "for= twice in an element"
        );
    }

    #[test]
    fn forwarded_elements_and_their_for_parameter() {
        assert_eq!(
            fwd(
                "10.0.0.1",
                &["for=198.51.100.1, For=\"[2001:db9:cafe::17]:4711\";proto=https;by=10.0.0.2"]
            ),
            ip("2001:db9:cafe::17")
        );
        assert_eq!(
            fwd(
                "10.0.0.1",
                &["proto=http;for=\"203.0.113.7:80\" ; host=\"a,b;c\""]
            ),
            ip("203.0.113.7"),
            "quoted commas and semicolons stay inside their value"
        );
        assert_eq!(
            fwd(
                "10.0.0.1",
                &["for=203.0.113.7, for=10.0.0.3;by=\"x\\\",y\""]
            ),
            ip("203.0.113.7"),
            "an escaped quote"
        );
    }

    /// Through the front layer: the service below sees the named caller as
    /// the client address (what the rate limiter keys on), a request from
    /// an untrusted peer its peer, and no header is read without the list.
    #[test]
    fn the_service_below_the_front_layer_sees_the_caller() {
        use crate::http::front::{Counters, FrontLayer};
        use axum::body::Body;
        use axum::http::Request;
        use axum::response::Response;
        use futures_util::FutureExt;
        use std::sync::{Arc, Mutex};
        use tower::{Layer, Service};

        let seen = Arc::new(Mutex::new(Vec::new()));
        let seen_by = |trusted: &[&str]| {
            let seen = seen.clone();
            let nets: Vec<Cidr> = trusted.iter().map(|t| t.parse().unwrap()).collect();
            let counters = Counters {
                traffic: Default::default(),
                on_shed: None,
            };
            FrontLayer::new(1024, 16, None, counters)
                .with_forwarded(Forwarded::new(&nets, ForwardedHeader::XForwardedFor))
                .layer(tower::service_fn(move |_req: Request<Body>| {
                    seen.lock().unwrap().push(crate::auth::peer::current());
                    std::future::ready(Ok::<_, std::convert::Infallible>(Response::new(
                        Body::empty(),
                    )))
                }))
        };
        fn call<S>(svc: &mut S, peer: &str)
        where
            S: Service<Request<Body>, Response = Response, Error = std::convert::Infallible>,
        {
            let req = Request::get("/users/1")
                .header("host", "gw")
                .header("x-forwarded-for", "198.51.100.1, 203.0.113.7")
                .body(Body::empty())
                .unwrap();
            let _peer = crate::auth::peer::enter(Some(ip(peer)));
            svc.call(req).now_or_never().unwrap().unwrap();
            // The connection's address again once the call is made.
            assert_eq!(crate::auth::peer::current(), Some(ip(peer)));
        }
        let mut trusting = seen_by(&["10.0.0.0/8"]);
        call(&mut trusting, "10.0.0.1");
        call(&mut trusting, "192.0.2.1");
        call(&mut seen_by(&[]), "10.0.0.1");
        assert_eq!(
            *seen.lock().unwrap(),
            [
                Some(ip("203.0.113.7")),
                Some(ip("192.0.2.1")),
                Some(ip("10.0.0.1"))
            ]
        );
    }

    /// A trusted hop: 10.x.y.z, or in 2001:db8::/32.
    fn hop() -> impl Strategy<Value = IpAddr> {
        prop_oneof![
            any::<[u8; 3]>().prop_map(|b| IpAddr::from([10, b[0], b[1], b[2]])),
            any::<u64>().prop_map(|x| IpAddr::V6(Ipv6Addr::from_bits(
                (0x2001_0db8u128 << 96) | u128::from(x)
            ))),
        ]
    }

    /// A caller the rule does not trust.
    fn client() -> impl Strategy<Value = IpAddr> {
        prop_oneof![
            any::<[u8; 4]>()
                .prop_filter("untrusted", |b| b[0] != 10)
                .prop_map(IpAddr::from),
            any::<u128>()
                .prop_map(|x| IpAddr::V6(Ipv6Addr::from_bits(x)))
                .prop_filter("untrusted, not mapped", |a| !trusted(*a)
                    && !matches!(a, IpAddr::V6(v) if v.to_ipv4_mapped().is_some())),
        ]
    }

    /// How a proxy writes an address in `header`, in one of its spellings.
    fn written(ip: IpAddr, header: ForwardedHeader, style: u8) -> String {
        match (header, ip, style % 3) {
            (ForwardedHeader::XForwardedFor, IpAddr::V4(a), 1) => {
                format!("{a}:{}", 1000 + style as u16)
            }
            (ForwardedHeader::XForwardedFor, IpAddr::V6(a), 1) => format!("[{a}]:443"),
            (ForwardedHeader::XForwardedFor, a, _) => a.to_string(),
            (ForwardedHeader::Forwarded, IpAddr::V4(a), 0) => format!("for={a}"),
            (ForwardedHeader::Forwarded, IpAddr::V4(a), 1) => {
                format!("for=\"{a}:8080\";proto=https")
            }
            (ForwardedHeader::Forwarded, IpAddr::V4(a), _) => {
                format!("proto=http;For=\"{a}\";by=_gw")
            }
            (ForwardedHeader::Forwarded, IpAddr::V6(a), 1) => format!("for=\"[{a}]:4711\""),
            (ForwardedHeader::Forwarded, IpAddr::V6(a), _) => format!("for=\"[{a}]\";host=\"x,y\""),
        }
    }

    fn header() -> impl Strategy<Value = ForwardedHeader> {
        prop_oneof![
            Just(ForwardedHeader::XForwardedFor),
            Just(ForwardedHeader::Forwarded)
        ]
    }

    /// What a client may send in a header line: any byte a field value
    /// can hold (visible ASCII, space, tab, obs-text), quotes, commas,
    /// backslashes and trusted addresses included.
    fn junk() -> impl Strategy<Value = Vec<u8>> {
        prop::collection::vec(
            prop_oneof![
                4 => prop::sample::select(b"\",;=\\[]: \tfor".to_vec()),
                4 => 0x21u8..0x7f,
                1 => 0x80u8..=0xff,
            ],
            0..24,
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// A spoofed header: whatever the client wrote, the caller is the
        /// address the first trusted proxy saw. The proxies append to the
        /// client's last line, or add lines of their own.
        #[test]
        fn what_a_client_writes_left_of_its_address_changes_nothing(
            header in header(),
            client in client(),
            hops in prop::collection::vec((hop(), any::<u8>()), 0..4),
            spoofed in prop::collection::vec(junk(), 0..3),
            style in any::<u8>(),
            own_line in any::<bool>(),
            peer in hop(),
        ) {
            let mut chain = vec![written(client, header, style)];
            chain.extend(hops.iter().map(|(ip, s)| written(*ip, header, *s)));
            let appended = chain.join(", ");
            let mut lines: Vec<Vec<u8>> = spoofed;
            match (own_line, lines.last_mut()) {
                (false, Some(last)) => {
                    last.extend_from_slice(b", ");
                    last.extend_from_slice(appended.as_bytes());
                }
                _ => lines.push(appended.into_bytes()),
            }
            let got = caller(peer, trusted, header, lines.iter().map(Vec::as_slice));
            prop_assert_eq!(got, client, "{:?}", lines.iter().map(|l| String::from_utf8_lossy(l)).collect::<Vec<_>>());
        }

        /// From a peer that is not trusted, no header changes the caller.
        #[test]
        fn an_untrusted_peer_is_the_caller_whatever_it_sends(
            header in header(),
            peer in client(),
            lines in prop::collection::vec(junk(), 0..4),
        ) {
            let f = Forwarded { trusted: ["10.0.0.0/8".parse().unwrap(), "2001:db8::/32".parse().unwrap()].into(), header };
            let mut h = HeaderMap::new();
            for l in &lines {
                if let Ok(v) = HeaderValue::from_bytes(l) {
                    h.append(match header {
                        ForwardedHeader::XForwardedFor => "x-forwarded-for",
                        ForwardedHeader::Forwarded => "forwarded",
                    }, v);
                }
            }
            prop_assert_eq!(f.named(peer, &h), None);
        }

        /// A list split into lines at any of its commas reads the same,
        /// and so does a chain of trusted hops alone (its leftmost).
        #[test]
        fn lines_split_at_commas_read_as_one_list(
            header in header(),
            hops in prop::collection::vec((prop_oneof![hop(), client()], any::<u8>()), 0..6),
            cuts in prop::collection::vec(any::<bool>(), 6),
            peer in hop(),
        ) {
            let entries: Vec<String> = hops.iter().map(|(ip, s)| written(*ip, header, *s)).collect();
            let one = entries.join(", ");
            let mut lines = vec![String::new()];
            for (i, e) in entries.iter().enumerate() {
                let last = lines.last_mut().unwrap();
                if !last.is_empty() {
                    last.push_str(", ");
                }
                last.push_str(e);
                if cuts[i] {
                    lines.push(String::new());
                }
            }
            let whole = caller(peer, trusted, header, std::iter::once(one.as_bytes()));
            let split = caller(peer, trusted, header, lines.iter().map(|l| l.as_bytes()));
            prop_assert_eq!(whole, split);
            let want = hops
                .iter()
                .rev()
                .map(|(ip, _)| ip.to_canonical())
                .find(|ip| !trusted(*ip))
                .or_else(|| hops.first().map(|(ip, _)| ip.to_canonical()))
                .unwrap_or(peer);
            prop_assert_eq!(whole, want);
        }
    }
}
