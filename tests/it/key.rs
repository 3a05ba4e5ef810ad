//! `key`: every key column type.

mod types;
