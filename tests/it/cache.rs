//! `cache`: loads that outlive the request that started them.

mod detached_loads;
