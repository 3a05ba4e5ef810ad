//! `filter`: the membership filter's properties from the outside.

mod props;
