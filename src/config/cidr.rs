//! A network in CIDR notation, as `server.trusted_proxies` lists them:
//! `10.0.0.0/8`, `2001:db8::/32`, or a bare address for one host.
//!
//! # Guarantees
//! - An address is in a network exactly when its first `prefix` bits are
//!   the network's; `/0` holds every address of its family.
//! - IPv4 and IPv6 are one space as a dual-stack socket sees it: an
//!   IPv4-mapped IPv6 address (`::ffff:10.0.0.1`) is the IPv4 address,
//!   whether it is the one tested or written in the list
//!   (`::ffff:10.0.0.0/104` is `10.0.0.0/8`).
//! - A network written with host bits set (`10.0.0.1/8`) is refused,
//!   naming the network it may have meant: a list that trusts more than it
//!   says is not guessed at.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A network: an address and the length of its prefix in bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Cidr {
    addr: IpAddr,
    prefix: u8,
}

impl Cidr {
    /// Whether `ip` is in the network (see the module doc).
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, ip.to_canonical()) {
            (IpAddr::V4(net), IpAddr::V4(a)) => same_prefix(
                u128::from(net.to_bits()) << 96,
                u128::from(a.to_bits()) << 96,
                self.prefix,
            ),
            (IpAddr::V6(net), IpAddr::V6(a)) => {
                same_prefix(net.to_bits(), a.to_bits(), self.prefix)
            }
            _ => false,
        }
    }
}

/// Whether the first `prefix` bits of `a` and `b` (left-aligned) agree.
fn same_prefix(a: u128, b: u128, prefix: u8) -> bool {
    prefix == 0 || (a ^ b) >> (128 - u32::from(prefix)) == 0
}

impl FromStr for Cidr {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let (addr, prefix) = match s.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (s, None),
        };
        let addr: IpAddr = addr.parse().map_err(|_| {
            format!("{s:?} is not an address or a network (10.0.0.0/8, 2001:db8::/32)")
        })?;
        let bits = match addr {
            IpAddr::V4(_) => 32,
            IpAddr::V6(_) => 128,
        };
        let prefix: u8 = match prefix {
            None => bits,
            // Digits only: `u8::from_str` would take `+8`.
            Some(p) => Some(p)
                .filter(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|p| p.parse().ok())
                .filter(|p| *p <= bits)
                .ok_or_else(|| format!("{s:?}: the prefix length must be 0 to {bits}"))?,
        };
        // A mapped network is the IPv4 network it maps.
        let (addr, prefix) = match addr {
            IpAddr::V6(v6) if prefix >= 96 && v6.to_ipv4_mapped().is_some() => (
                IpAddr::V4(v6.to_ipv4_mapped().expect("checked")),
                prefix - 96,
            ),
            a => (a, prefix),
        };
        let network = masked(addr, prefix);
        if network != addr {
            return Err(format!(
                "{s:?} has bits set past its prefix: write the network, {}",
                Cidr {
                    addr: network,
                    prefix
                }
            ));
        }
        Ok(Cidr { addr, prefix })
    }
}

/// `addr` with every bit past `prefix` cleared.
fn masked(addr: IpAddr, prefix: u8) -> IpAddr {
    match addr {
        IpAddr::V4(a) => {
            let keep = u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0);
            IpAddr::V4(Ipv4Addr::from_bits(a.to_bits() & keep))
        }
        IpAddr::V6(a) => {
            let keep = u128::MAX.checked_shl(128 - u32::from(prefix)).unwrap_or(0);
            IpAddr::V6(Ipv6Addr::from_bits(a.to_bits() & keep))
        }
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

impl Serialize for Cidr {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Cidr {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// `deserialize_with` for a list of networks: an array, or the
/// comma-separated text an environment variable gives
/// (`BLOOMGATE_SERVER__TRUSTED_PROXIES=10.0.0.0/8,127.0.0.1`).
pub fn list<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Cidr>, D::Error> {
    super::forms::list(d)?
        .iter()
        .map(|s| s.parse().map_err(serde::de::Error::custom))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn net(s: &str) -> Cidr {
        s.parse().unwrap()
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn networks_hold_their_addresses_and_no_others() {
        let ten = net("10.0.0.0/8");
        assert!(ten.contains(ip("10.255.0.1")));
        assert!(!ten.contains(ip("11.0.0.1")));
        assert!(
            ten.contains(ip("::ffff:10.1.2.3")),
            "mapped: the IPv4 address"
        );
        assert!(!ten.contains(ip("::a01:203")), "an IPv6 address is not");
        let host = net("127.0.0.1");
        assert_eq!(host.to_string(), "127.0.0.1/32");
        assert!(host.contains(ip("127.0.0.1")) && !host.contains(ip("127.0.0.2")));
        let v6 = net("2001:db8::/32");
        assert!(v6.contains(ip("2001:db8:ffff::1")));
        assert!(!v6.contains(ip("2001:db9::1")));
        assert!(!v6.contains(ip("10.0.0.1")));
        assert!(net("0.0.0.0/0").contains(ip("203.0.113.9")));
        assert!(!net("0.0.0.0/0").contains(ip("::1")));
        assert!(net("::/0").contains(ip("::1")));
        assert_eq!(net("::ffff:10.0.0.0/104"), ten);
    }

    #[test]
    fn what_is_not_a_network_is_refused_saying_why() {
        for (bad, says) in [
            ("10.0.0.1/8", "10.0.0.0/8"),
            ("10.0.0.0/33", "0 to 32"),
            ("2001:db8::/129", "0 to 128"),
            ("10.0.0.0/", "0 to 32"),
            ("10.0.0.0/+8", "0 to 32"),
            ("10.0.0/8", "not an address"),
            ("localhost", "not an address"),
            ("", "not an address"),
        ] {
            let e = bad.parse::<Cidr>().unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    proptest! {
        /// `contains` is the prefix comparison, bit by bit.
        #[test]
        fn an_address_is_in_a_network_when_its_prefix_bits_agree(
            a in any::<u32>(), b in any::<u32>(), prefix in 0u8..=32,
        ) {
            let network = Cidr { addr: masked(IpAddr::V4(Ipv4Addr::from_bits(a)), prefix), prefix };
            let bit = |x: u32, i: u8| (x >> (31 - i)) & 1;
            let want = (0..prefix).all(|i| bit(a, i) == bit(b, i));
            prop_assert_eq!(network.contains(IpAddr::V4(Ipv4Addr::from_bits(b))), want);
            // Written and read back, the same network.
            prop_assert_eq!(network.to_string().parse::<Cidr>().unwrap(), network);
        }

        #[test]
        fn ipv6_networks_compare_the_same_way(
            a in any::<u128>(), b in any::<u128>(), prefix in 0u8..=128,
        ) {
            let network = Cidr { addr: masked(IpAddr::V6(Ipv6Addr::from_bits(a)), prefix), prefix };
            let b = Ipv6Addr::from_bits(b);
            prop_assume!(b.to_ipv4_mapped().is_none());
            let want = prefix == 0 || (a ^ b.to_bits()) >> (128 - u32::from(prefix)) == 0;
            prop_assert_eq!(network.contains(IpAddr::V6(b)), want);
        }
    }
}
