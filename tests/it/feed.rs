//! `feed`: how changes reach the gateway: freshness on every feed (run
//! once per feed by `scripts/test.sh`), the feeds' lifecycle, the queue,
//! the WAL and the bus.

mod bus;
mod freshness;
mod lifecycle;
mod queue;
mod wal;
