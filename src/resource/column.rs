//! A resource's key column and owner column as Postgres compares them
//! (`key::compare`), set once the catalog has been read
//! (`Gateway::resolve`), and the row query that compares the key as the
//! column's own type.

use std::sync::Arc;

use super::Resource;
use crate::error::Error;
use crate::key::compare::Comparison;
use crate::key::{self, Key, KeyType};

pub(super) struct KeyColumn {
    key: Comparison,
    owner: Comparison,
    /// The row query, the key cast to the column's base type where that
    /// compares otherwise than `text` does (`char(n)`, `citext`).
    row: Option<Arc<str>>,
}

const BYTES: Comparison = Comparison::Bytes;

impl Resource {
    /// How the key column (`key`) and the owner column (`owner`) compare;
    /// `base_sql`: the key column's base type as SQL names it. The first
    /// call counts (the catalog is read again on a retried start, with the
    /// same result).
    pub fn set_columns(&self, key: Comparison, owner: Comparison, base_sql: &str) {
        let row = match (&key, self.config.key_type) {
            (Comparison::Blank | Comparison::Lower(_), KeyType::Text) => {
                let text = format!("$1::{}", self.config.key_type.sql_type());
                debug_assert!(self.queries.row.contains(&text));
                Some(Arc::from(
                    self.queries
                        .row
                        .replace(&text, &format!("$1::text::{base_sql}")),
                ))
            }
            _ => None,
        };
        let _ = self.column.set(KeyColumn { key, owner, row });
    }

    /// How the key column compares (bytes until the catalog is read).
    pub fn comparison(&self) -> &Comparison {
        self.column.get().map_or(&BYTES, |c| &c.key)
    }

    /// How the owner column compares (bytes until the catalog is read).
    pub fn owner_comparison(&self) -> &Comparison {
        self.column.get().map_or(&BYTES, |c| &c.owner)
    }

    pub(super) fn row_sql(&self) -> &Arc<str> {
        match self.column.get().and_then(|c| c.row.as_ref()) {
            Some(row) => row,
            None => &self.queries.row,
        }
    }

    /// A parsed key brought to its canonical form. A text key before the
    /// catalog says how its column compares cannot be: not ready (503).
    pub(super) fn canonical(&self, key: Key) -> Result<Key, Error> {
        if !matches!(key, Key::Text(_)) {
            return Ok(key);
        }
        match self.column.get() {
            Some(c) => Ok(c.key.key(key)),
            None => Err(Error::NotReady),
        }
    }

    /// A key as a feed announces it (`key::from_db_text`), canonical.
    pub fn key_from_db(&self, text: &str) -> Option<Key> {
        key::from_db_text(text, self.config.key_type).map(|k| self.comparison().key(k))
    }
}
