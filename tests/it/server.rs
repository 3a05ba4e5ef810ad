//! `server`: connections and a rolling restart.

mod connections;
mod rolling;
