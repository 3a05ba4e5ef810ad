//! `db`: the database the gateway reads, as it changes under it: its
//! catalog, TLS, read replicas, a standby, failovers, and a real Patroni
//! cluster (ignored here: `scripts/test.sh` runs it in a lane of its own).

mod catalog;
mod failover;
mod patroni;
mod replicas;
mod standby;
mod tls;
