//! `access`: the access log.

mod log;
