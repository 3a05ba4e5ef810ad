//! The client address of the request being dispatched, for rate limits
//! keyed by address.
//!
//! The connection sets it around each call of the app (`server::conn`), and
//! the dispatch reads it inside that call, where a resource's `GET` is
//! checked. A thread-local rather than a request extension: inserting an
//! extension allocates its map and a box for the value on every request,
//! and a hit allocates nothing but its response. A request that reaches a
//! handler later (through axum's router: `HEAD`) carries it as a
//! [`PeerAddr`] extension, inserted by the dispatch only for those.

use std::cell::Cell;
use std::net::IpAddr;

thread_local! {
    static PEER: Cell<Option<IpAddr>> = const { Cell::new(None) };
}

/// The client address as a request extension (requests the router serves).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerAddr(pub IpAddr);

/// Restores the previous address when dropped.
pub struct Entered(Option<IpAddr>);

/// `peer` is the current client address until the guard drops.
pub fn enter(peer: Option<IpAddr>) -> Entered {
    Entered(PEER.with(|p| p.replace(peer)))
}

impl Drop for Entered {
    fn drop(&mut self) {
        PEER.with(|p| p.set(self.0));
    }
}

/// The address set by the innermost [`enter`] on this thread.
pub fn current() -> Option<IpAddr> {
    PEER.with(Cell::get)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entered_addresses_nest_and_are_restored() {
        let a: IpAddr = "192.0.2.1".parse().unwrap();
        let b: IpAddr = "2001:db8::1".parse().unwrap();
        assert_eq!(current(), None);
        {
            let _a = enter(Some(a));
            assert_eq!(current(), Some(a));
            {
                let _b = enter(Some(b));
                assert_eq!(current(), Some(b));
            }
            assert_eq!(current(), Some(a));
        }
        assert_eq!(current(), None);
    }
}
