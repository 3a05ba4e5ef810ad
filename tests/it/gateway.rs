//! `gateway`: the gateway end to end.

mod end_to_end;
