//! Every integration test but four, in one binary: one link and one process
//! instead of one per file. The modules mirror `src/`; the top-level ones
//! test the binary as a whole (`cli`, `operations`), the shipped files
//! (`deploy`) and `scripts/pg.sh` (`throwaway_servers`).
//!
//! Tests of different modules run at once, so none may rely on process-wide
//! state: a test names the server its databases live on (`TestDb::on`)
//! rather than setting an environment variable, and stops only servers it
//! started (`db::replicas` stops the shared replica, under the lock below).
//! The tests that stream from the shared logical primary, or count its
//! walsenders and slots (preflight counts them server-wide), hold one lock
//! across modules, `common::ON_THE_PRIMARY`, so that they run one at a
//! time as they did when each module was a binary of its own; a file's
//! other serializing (`ONE_AT_A_TIME`) is that file's own.
//!
//! Alone, each in a binary of its own: the allocator-counting tests
//! (`access_alloc`, `auth_alloc`, `memory`: a counting global allocator
//! sees every thread of the process), `flood` (it measures the server
//! under one process's load) and the randomized checker (`truth`).
//!
//! One module's tests: `scripts/test.sh --test it -- feed::bus::`.

#[path = "../common/mod.rs"]
mod common;
// The spawned binary and its output (`tests/common/binary.rs`), and the
// access-control fixtures (`tests/common/auth.rs`), as shared modules.
#[path = "../common/binary.rs"]
mod binary;
#[path = "../common/auth.rs"]
mod support;

mod access;
mod auth;
mod cache;
mod cli;
mod db;
mod deploy;
mod feed;
mod filter;
mod gateway;
mod http;
mod key;
mod operations;
mod rebuild;
mod server;
mod throwaway_servers;
