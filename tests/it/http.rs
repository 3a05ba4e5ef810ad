//! `http`: the admin API and status page, the lookup's contract, CORS,
//! hostile input and the answers byte for byte.

mod admin;
mod contract;
mod cors;
mod golden;
mod hostile;
