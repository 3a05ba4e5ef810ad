//! `auth`: access control, the keys tokens are checked with, and the
//! identity providers' recipes from the book.

mod checks;
mod identity_providers;
mod keys;
